//! `oogc-models`: the model families oogc trains, on candle, cut into **units** whose parameters
//! are each **one flat vector** — the way the runtime stores, moves and optimizes them (one
//! swapper tensor per unit). It knows nothing of tiers, budgets or the CLI.
//!
//! # Example
//!
//! A two-layer Llama from scratch on candle's CPU device, run unit by unit (embedding, layers,
//! head) from token ids to logits:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use oogc_models::{init_params, unit_tensor, CausalLm, Llama, LlamaConfig};
//!
//! // vocab 64, hidden 32, MLP 64, 2 layers, 4 heads: units [embedding, layer 0, layer 1, head].
//! let model = Llama::new(LlamaConfig::new(64, 32, 64, 2, 4))?;
//! assert_eq!(model.units().len(), 4);
//! let dev = Device::Cpu;
//! let mut h = Tensor::from_vec((0..16u32).collect(), (2, 8), &dev)?; // token ids [B = 2, T = 8]
//! for (u, flat) in init_params(model.units(), 0).iter().enumerate() {
//!     let params = unit_tensor(flat, DType::F32, &dev)?; // the unit's flat parameter vector
//!     h = model.forward(u, &params, &h, None)?; // [2, 8] → [2, 8, 32] → … → logits
//! }
//! assert_eq!(h.dims(), &[2, 8, 64]); // [B, T, vocab]
//! # Ok::<(), oogc_models::Error>(())
//! ```
//!
//! | module | owns |
//! |---|---|
//! | [`mod@unit`] | the unit of residency: [`UnitKind`], [`UnitSpec`] (a unit's parameters back to back in one flat vector), [`ParamSpec`], deterministic init |
//! | [`lm`] | [`CausalLm`]: what a trainer drives — units, per-unit forward and recompute-based backward from a checkpointed input, the head's loss — and [`MoeLm`] for models with expert units (the calls and their order); [`loss_parts_and_grads`], that step in memory |
//! | [`moe`] | what the MoE families share: [`Routing`] (tokens and gates per expert, top-k choices, load-balancing statistics), [`TrunkOut`], [`ExpertGrads`], the combine and its backward, [`LossParts`] |
//! | [`attention`] | causal (grouped-query) attention over blocks of query positions with a recomputing backward — the composed path's attention core, which never holds the whole sequence's `[B, H, T, T]` scores — and the bytes it needs at its peak ([`attention_workspace_bytes`]) |
//! | [`gpt`] | the byte-level GPT (GPT-2 architecture) and MoE-GPT (Switch / GShard routing) |
//! | [`llama`] | the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): [`Llama`], [`LlamaConfig`], with Hugging Face tensor names |
//! | [`mixtral`] | Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE: the Llama family's attention with a sparse MoE feed-forward network per layer (top-k of `E` SwiGLU experts, each a unit; Qwen2-MoE's shared expert in the trunk; the load-balancing loss pooled over all layers): [`Mixtral`], [`MixtralConfig`] |
//! | [`hf`] | Hugging Face checkpoints: `config.json` ↔ [`LlamaConfig`] (the MoE families' too), safetensors read unit by unit ([`hf::HfCheckpoint`]) and written in shards ([`hf::write_checkpoint`]) |
//! | [`checksum`] | crc32c per tensor and for the file in safetensors `__metadata__` (oogc checkpoints and Hugging Face exports), verified on read |
//! | [`streamed`] | one safetensors file written as its data is produced ([`streamed::StreamedFile`]: header first with placeholder checksums, data in pieces, checksums over the header at the end): the Hugging Face export's shards and oogc's checkpoints |
//! | `ops`, `kernels` | the checks, views and mixed-precision helpers shared by the families; their ops, each a fused CPU kernel with its own backward beside its composition of candle ops |
//!
//! Every call takes a unit's flat parameters as a 1-D [`Tensor`] on any candle device and
//! computes in its dtype; nothing is kept between calls but what the caller keeps (activation
//! checkpointing, Chen et al. 2016: the trainer keeps each unit's input and recomputes the unit
//! in the backward).
#![deny(unsafe_code)]

pub mod attention;
pub mod checksum;
mod compute;
pub mod gpt;
pub mod hf;
mod kernels;
pub mod llama;
pub mod lm;
pub mod mixtral;
pub mod moe;
mod ops;
#[cfg(test)]
mod shared_tests;
pub mod streamed;
pub mod unit;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

pub use attention::{attention_workspace_bytes, AttentionBytes, AttentionShape};
pub use compute::Compute;
pub use gpt::{Gpt, GptConfig, MoeConfig};
pub use llama::{Llama, LlamaConfig, LlamaFamily, RopeScaling};
pub use lm::{
    forward_all, loss, loss_and_grads, loss_parts, loss_parts_and_grads, CausalLm, Dims, HeadLossGrads, MoeLm,
    TokenLoss, UnitGrads, IGNORE_INDEX,
};
pub use mixtral::{Mixtral, MixtralConfig};
pub use moe::{CombineGrads, ExpertGrads, LossParts, Routing, TrunkOut};
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
    /// A key of a Hugging Face `config.json` that is missing, malformed, or names an option this
    /// crate does not implement ([`hf::parse_config`]).
    #[error("{}: `{key}` {reason}", path.display())]
    HfConfig {
        /// The `config.json`.
        path: PathBuf,
        /// The key, dotted for nested ones (`rope_scaling.rope_type`); `<json>` for a file that
        /// does not parse.
        key: String,
        /// What is wrong and the fix.
        reason: String,
    },
    /// A checkpoint tensor that is missing, unexpected, of the wrong shape or an unsupported
    /// dtype ([`hf::HfCheckpoint`]).
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    HfTensor {
        /// The file that holds (or, for a missing tensor, should hold) it; the checkpoint
        /// directory when no file names it.
        path: PathBuf,
        /// The tensor name, e.g. `model.layers.3.self_attn.q_proj.weight`.
        tensor: String,
        /// What is wrong and the fix.
        reason: String,
    },
    /// A checkpoint file that is missing or malformed (no weights, a bad index, a safetensors
    /// header that does not parse).
    #[error("{}: {reason}", path.display())]
    HfFile {
        /// The file (or directory).
        path: PathBuf,
        /// What is wrong and the fix.
        reason: String,
    },
    /// I/O on a checkpoint file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
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
