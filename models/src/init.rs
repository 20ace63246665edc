//! Deterministic GPT-2-style initialisation of a unit's flat vector.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::config::{GptConfig, ParamInit, UnitSpec};

/// Fills one unit's flat vector (`unit.numel` f32 elements, layout of [`UnitSpec::params`]).
///
/// GPT-2 (Radford et al. 2019): weights and embeddings N(0, 0.02); the two residual
/// projections of each block (`attn.proj.weight`, `mlp.proj.weight`) N(0, 0.02 / sqrt(2 ·
/// n_layer)); biases 0; LayerNorm weight 1, bias 0. MoE: each expert like the dense MLP (`fc`
/// N(0, 0.02), `proj` N(0, 0.02 / sqrt(2 · n_layer)), biases 0), the router weight N(0, 0.02) and
/// its bias 0. Parameters are drawn in layout order, element
/// by element, so the result depends only on `rng`'s state. `config` is taken for symmetry with
/// the layout; the per-parameter rule is already in [`ParamSpec::init`](super::ParamSpec::init).
pub fn init_unit<R: Rng + ?Sized>(config: &GptConfig, unit: &UnitSpec, rng: &mut R) -> Vec<f32> {
    let _ = config;
    let mut flat = vec![0f32; unit.numel];
    for p in &unit.params {
        let dst = &mut flat[p.offset..p.offset + p.numel()];
        match p.init {
            ParamInit::Zeros => {}
            ParamInit::Ones => dst.fill(1.0),
            ParamInit::Normal { std } => {
                // std > 0 always: it is a positive constant divided by a positive number.
                let normal = Normal::new(0f32, std).expect("positive finite std");
                for x in dst {
                    *x = normal.sample(rng);
                }
            }
        }
    }
    flat
}

/// Initialises one unit from a run seed: a [`ChaCha8Rng`] seeded with `seed` on stream
/// `unit.index`, so each unit can be initialised alone (e.g. straight into its home tier)
/// and the result does not depend on the order units are initialised in.
pub fn init_unit_from_seed(config: &GptConfig, unit: &UnitSpec, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(unit.index as u64);
    init_unit(config, unit, &mut rng)
}

/// All units' flat vectors in unit order, each from [`init_unit_from_seed`].
pub fn init_params(config: &GptConfig, seed: u64) -> Vec<Vec<f32>> {
    config.units().iter().map(|u| init_unit_from_seed(config, u, seed)).collect()
}
