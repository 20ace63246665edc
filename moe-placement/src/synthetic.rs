//! A synthetic routing trace with skewed, slowly drifting popularity, so the replay benchmark
//! and its tests run without a trained model.
//!
//! Each block ranks its experts in a random order; the expert of rank `r` (0-based) is chosen
//! with weight `1 / (r + 1)^s` (Zipf, exponent `s`), each token picking `top_k` distinct
//! experts (weighted sampling without replacement). Every `drift_every` steps each block swaps
//! the ranks of one random adjacent pair, so popularity drifts slowly. Deterministic for a
//! seed (SplitMix64).

use serde::{Deserialize, Serialize};

use crate::error::{config, Result};
use crate::trace::{RoutingTrace, TraceHeader};

/// The shape and routing statistics of a synthetic trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticConfig {
    /// MoE blocks. Default: 4.
    pub blocks: u32,
    /// Experts per block. Default: 16.
    pub experts: u32,
    /// Experts per token. Default: 2.
    pub top_k: u32,
    /// Tokens per step entering each block. Default: 256 (e.g. 4 sequences of 64).
    pub tokens_per_step: u64,
    /// Steps. Default: 200.
    pub steps: u64,
    /// Zipf exponent of popularity (0: uniform; 1: classic Zipf). Default: 1.0.
    pub zipf_s: f64,
    /// Steps between two adjacent-rank swaps per block (0: no drift). Default: 20.
    pub drift_every: u64,
    /// Seed. Default: 1.
    pub seed: u64,
    /// Model width (an expert is a `d_model × d_ff` MLP with biases). Default: 256.
    pub d_model: u64,
    /// Expert hidden width. Default: 1024.
    pub d_ff: u64,
    /// Bytes per parameter of the compute copy. Default: 4 (f32, as on the sim device).
    pub dtype_bytes: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            blocks: 4,
            experts: 16,
            top_k: 2,
            tokens_per_step: 256,
            steps: 200,
            zipf_s: 1.0,
            drift_every: 20,
            seed: 1,
            d_model: 256,
            d_ff: 1024,
            dtype_bytes: 4,
        }
    }
}

impl SyntheticConfig {
    /// The trace header: `expert_params = 2·d_model·d_ff + d_ff + d_model`, `flops_per_token =
    /// 8 · expert_params` (2 forward, 2 recompute, 4 backward).
    pub fn header(&self) -> TraceHeader {
        let params = 2 * self.d_model * self.d_ff + self.d_ff + self.d_model;
        TraceHeader::new(
            self.blocks,
            self.experts,
            self.top_k,
            params,
            params * self.dtype_bytes,
            8.0 * params as f64,
            self.tokens_per_step,
        )
    }
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Generates the trace.
///
/// # Errors
/// [`crate::Error::Config`] for zero blocks, experts, steps or tokens, `top_k` outside
/// `1..=experts`, a negative or non-finite exponent, or zero sizes.
pub fn synthetic_trace(cfg: &SyntheticConfig) -> Result<RoutingTrace> {
    let e = cfg.experts as usize;
    if cfg.blocks == 0 || e == 0 || cfg.steps == 0 || cfg.tokens_per_step == 0 {
        return Err(config("synthetic", "blocks, experts, steps and tokens_per_step must be at least 1"));
    }
    if cfg.top_k == 0 || cfg.top_k > cfg.experts {
        return Err(config("top_k", format!("{} must be in 1..={}", cfg.top_k, cfg.experts)));
    }
    if !(cfg.zipf_s.is_finite() && cfg.zipf_s >= 0.0) {
        return Err(config("zipf_s", format!("{} must be a finite number ≥ 0", cfg.zipf_s)));
    }
    if cfg.d_model == 0 || cfg.d_ff == 0 || cfg.dtype_bytes == 0 {
        return Err(config("d_model/d_ff/dtype_bytes", "must be at least 1"));
    }
    let mut rng = SplitMix64(cfg.seed ^ 0x6F6F_6763);
    let weight_of_rank: Vec<f64> = (0..e).map(|r| 1.0 / ((r + 1) as f64).powf(cfg.zipf_s)).collect();
    // rank[block][expert]
    let mut rank: Vec<Vec<usize>> = (0..cfg.blocks)
        .map(|_| {
            let mut p: Vec<usize> = (0..e).collect();
            for i in (1..e).rev() {
                p.swap(i, rng.below(i as u64 + 1) as usize);
            }
            p
        })
        .collect();
    let mut trace = RoutingTrace::new(cfg.header());
    let mut w = vec![0.0; e];
    for step in 0..cfg.steps {
        if cfg.drift_every > 0 && step > 0 && step % cfg.drift_every == 0 && e > 1 {
            for r in rank.iter_mut() {
                let a = rng.below(e as u64 - 1) as usize;
                let (x, y) = (r.iter().position(|&q| q == a).unwrap(), r.iter().position(|&q| q == a + 1).unwrap());
                r.swap(x, y);
            }
        }
        let mut tokens = vec![0u64; cfg.blocks as usize * e];
        for (b, r) in rank.iter().enumerate() {
            let counts = &mut tokens[b * e..(b + 1) * e];
            for _ in 0..cfg.tokens_per_step {
                for (x, &rk) in w.iter_mut().zip(r) {
                    *x = weight_of_rank[rk];
                }
                let mut mass: f64 = w.iter().sum();
                for _ in 0..cfg.top_k {
                    let mut u = rng.next_f64() * mass;
                    let mut pick = e - 1;
                    for (x, &wx) in w.iter().enumerate() {
                        if wx > 0.0 && u < wx {
                            pick = x;
                            break;
                        }
                        u -= wx;
                    }
                    while w[pick] == 0.0 {
                        pick -= 1; // rounding at the end of the scan: the last expert left
                    }
                    counts[pick] += 1;
                    mass -= w[pick];
                    w[pick] = 0.0;
                }
            }
        }
        trace.steps.push((step, tokens));
    }
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_are_skewed_and_deterministic() {
        let cfg = SyntheticConfig { steps: 30, ..SyntheticConfig::default() };
        let t = synthetic_trace(&cfg).unwrap();
        assert_eq!(t.steps.len(), 30);
        for i in 0..t.steps.len() {
            for b in 0..cfg.blocks {
                let tokens = t.tokens(i, b);
                assert_eq!(tokens.iter().sum::<u64>(), cfg.tokens_per_step * cfg.top_k as u64);
                assert!(tokens.iter().all(|&n| n <= cfg.tokens_per_step), "top-k picks distinct experts");
            }
        }
        let mut totals: Vec<u64> = (0..16).map(|x| t.steps.iter().map(|s| s.1[x]).sum()).collect();
        totals.sort();
        assert!(totals[15] > 4 * totals[0], "Zipf skew: {totals:?}");
        assert_eq!(synthetic_trace(&cfg).unwrap(), t);
        let h = cfg.header();
        assert_eq!(h.expert_params, 2 * 256 * 1024 + 1024 + 256);
        assert!(synthetic_trace(&SyntheticConfig { top_k: 17, ..cfg }).is_err());
    }
}
