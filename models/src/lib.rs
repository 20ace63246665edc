//! `oogc-models`: the model families oogc trains, on candle, cut into **units** whose parameters
//! are each **one flat vector** — the way the runtime stores, moves and optimizes them (one
//! swapper tensor per unit). It knows nothing of tiers, budgets or the CLI.
//!
//! | module | owns |
//! |---|---|
//! | [`unit`] | the unit of residency: [`UnitKind`], [`UnitSpec`] (a unit's parameters back to back in one flat vector), [`ParamSpec`], deterministic init |
//! | [`lm`] | [`CausalLm`]: what a trainer drives — units, per-unit forward and recompute-based backward from a checkpointed input, the head's loss — and [`MoeLm`] for models with expert units |
//! | [`gpt`] | the byte-level GPT (GPT-2 architecture) and MoE-GPT (Switch / GShard routing) |
//! | `ops`, `kernels` | differentiable compositions shared by the families, and fused CPU kernels with their own backward |
//!
//! Every call takes a unit's flat parameters as a 1-D [`Tensor`] on any candle device and
//! computes in its dtype; nothing is kept between calls but what the caller keeps (activation
//! checkpointing, Chen et al. 2016: the trainer keeps each unit's input and recomputes the unit
//! in the backward).
#![deny(unsafe_code)]

pub mod gpt;
mod kernels;
pub mod lm;
mod ops;
pub mod unit;

use candle_core::{DType, Device, Tensor};

pub use gpt::{CombineGrads, ExpertGrads, Gpt, GptConfig, LossParts, MoeConfig, Routing, TrunkOut};
pub use lm::{CausalLm, HeadLossGrads, MoeLm, UnitGrads};
pub use unit::{init_params, init_unit, init_unit_from_seed, ParamInit, ParamSpec, UnitKind, UnitSpec};

/// Errors of the model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range; `field` is its key (`model.<field>`).
    #[error("invalid `{field}`: {reason}")]
    Config {
        /// The TOML key, e.g. `model.n_head`.
        field: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// An argument to a forward/backward call has the wrong shape, dtype or value.
    #[error("bad {what}: expected {expected}, got {got}")]
    Input {
        /// Which argument.
        what: &'static str,
        /// What was expected.
        expected: String,
        /// What was passed.
        got: String,
    },
    /// An error from a candle op (device, allocation, unsupported dtype for an op).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Result type of the model module.
pub type Result<T> = std::result::Result<T, Error>;

/// A unit's flat vector (from [`init_unit`] or a checkpoint) as a 1-D tensor of `dtype` on
/// `device`.
///
/// # Errors
/// [`Error::Candle`] when the device cannot allocate or convert.
pub fn unit_tensor(flat: &[f32], dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(flat, flat.len(), device)?.to_dtype(dtype)?)
}
