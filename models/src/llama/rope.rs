//! The rotary frequencies and the `cos`/`sin` tables of RoPE (Su et al. 2021, "RoFormer"), as
//! transformers computes them (`modeling_rope_utils.py`: `_compute_default_rope_parameters`,
//! `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`; the tables in
//! `LlamaRotaryEmbedding.forward`).
//!
//! transformers computes in f32: `inv_freq = 1 / theta^(arange(0, hd, 2) / hd)`, the scaling, the
//! angles `inv_freq · position` and their `cos`/`sin`, each op rounded to f32. The f32 tables
//! here repeat those roundings (every op in f64, rounded to f32 after each, which is the
//! correctly rounded f32 result), so they match torch's up to its last-ulp `pow`/`cos`
//! differences; the f64 tables (finite-difference tests) round nothing.

use super::config::{LlamaConfig, RopeScaling};

/// Rounds to f32 after each op (`f32` tables) or not at all (`f64`).
#[derive(Clone, Copy)]
pub(crate) enum Precision {
    F32,
    F64,
}

impl Precision {
    #[inline]
    fn r(self, v: f64) -> f64 {
        match self {
            Precision::F32 => v as f32 as f64,
            Precision::F64 => v,
        }
    }
}

/// The `head_dim / 2` inverse frequencies of `config`'s RoPE in `p`'s precision.
pub(crate) fn inv_freq(config: &LlamaConfig, p: Precision) -> Vec<f64> {
    let hd = config.head_dim();
    let base = p.r(config.rope_theta);
    let default: Vec<f64> = (0..hd / 2)
        .map(|i| {
            let exponent = p.r((2 * i) as f64 / hd as f64);
            p.r(1.0 / p.r(base.powf(exponent)))
        })
        .collect();
    match config.rope_scaling {
        RopeScaling::Default => default,
        RopeScaling::Linear { factor } => default.iter().map(|&f| p.r(f / p.r(factor))).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let old_len = original_max_position_embeddings as f64;
            // Python scalars (f64), compared against the f32 wavelengths.
            let low_freq_wavelen = old_len / low_freq_factor;
            let high_freq_wavelen = old_len / high_freq_factor;
            let factor_r = p.r(factor);
            default
                .iter()
                .map(|&f| {
                    let wavelen = p.r(p.r(2.0 * std::f64::consts::PI) / f);
                    let scaled = if wavelen > low_freq_wavelen { p.r(f / factor_r) } else { f };
                    // transformers: `~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)`.
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    if !medium {
                        return scaled;
                    }
                    let smooth = p
                        .r(p.r(p.r(old_len / wavelen) - p.r(low_freq_factor))
                            / p.r(high_freq_factor - low_freq_factor));
                    let a = p.r(p.r(p.r(1.0 - smooth) * scaled) / factor_r);
                    let b = p.r(smooth * scaled);
                    p.r(a + b)
                })
                .collect()
        }
    }
}

/// `cos` and `sin` tables `[t, head_dim / 2]` (row-major, positions `0..t`) in `p`'s precision:
/// `angle = inv_freq[i] · pos` rounded like the frequencies. (transformers' tables are
/// `[t, head_dim]`, the same half repeated: `emb = cat(freqs, freqs)`.)
pub(crate) fn tables(config: &LlamaConfig, t: usize, p: Precision) -> (Vec<f64>, Vec<f64>) {
    let inv = inv_freq(config, p);
    let half = inv.len();
    let (mut cos, mut sin) = (Vec::with_capacity(t * half), Vec::with_capacity(t * half));
    for pos in 0..t {
        for &f in &inv {
            let angle = p.r(f * pos as f64);
            cos.push(p.r(angle.cos()));
            sin.push(p.r(angle.sin()));
        }
    }
    (cos, sin)
}
