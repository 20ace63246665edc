//! The reference model: a byte-level GPT (GPT-2 architecture, Radford et al. 2019) on candle,
//! cut into **units** whose parameters are each **one flat vector** — the way the runtime
//! stores, moves and optimizes them (one swapper tensor per unit).
//!
//! | unit index | kind | name | parameters (flat, in this order) | input → output |
//! |---|---|---|---|---|
//! | 0 | [`UnitKind::Embedding`] | `embed` | `wte.weight` `[V, d]`, `wpe.weight` `[S, d]` | tokens `[B, T]` U32 → `[B, T, d]` |
//! | 1..=L | [`UnitKind::Block`]`(i)` | `blocks.{i}` | `ln_1`, `attn.qkv`, `attn.proj`, `ln_2`, `mlp.fc`, `mlp.proj` (weights `[in, out]`, then bias) | `[B, T, d]` → `[B, T, d]` |
//! | L+1 | [`UnitKind::Head`] | `head` | `ln_f.weight`, `ln_f.bias` `[d]`, `head.weight` `[d, V]` (untied only) | `[B, T, d]` → logits `[B, T, V]` |
//!
//! (`V` = `vocab_size`, `S` = `max_seq_len`, `d` = `d_model`, `L` = `n_layer`; exact shapes
//! and offsets in [`GptConfig::units`].)
//!
//! # MoE-GPT
//!
//! With [`GptConfig::moe`] set ([`MoeConfig`]: Switch Transformer, Fedus et al. 2021, for
//! top-1; GShard, Lepikhin et al. 2020, for top-2), every block's MLP becomes `E` experts
//! behind a softmax router, and each expert is **its own unit** (resident or not on its own):
//!
//! | unit index | kind | name | parameters | input → output |
//! |---|---|---|---|---|
//! | 0 | [`UnitKind::Embedding`] | `embed` | as above | tokens → `[B, T, d]` |
//! | `1 + i (1 + E)` | [`UnitKind::MoeTrunk`]`(i)` | `blocks.{i}` | `ln_1`, `attn.qkv`, `attn.proj`, `ln_2`, `router.weight` `[d, E]`, `router.bias` `[E]` | `[B, T, d]` → `x1` `[B, T, d]`, `h` `[N, d]`, probs `[N, E]`, [`Routing`] |
//! | `2 + i (1 + E) + e` | [`UnitKind::Expert`]` { block: i, expert: e }` | `blocks.{i}.experts.{e}` | `fc.weight` `[d, f]`, `fc.bias` `[f]`, `proj.weight` `[f, d]`, `proj.bias` `[d]` | `h_e` `[n_e, d]` → `[n_e, d]` |
//! | last | [`UnitKind::Head`] | `head` | as above | `[B, T, d]` → logits |
//!
//! (`N = B · T`, `f` = [`GptConfig::expert_dim`], `n_e` the tokens routed to expert `e`; the
//! indices are [`GptConfig::block_unit`], [`GptConfig::expert_unit`], [`GptConfig::head_unit`].)
//! The block is `y = x1 + Σ_e scatter(idx_e, gate_e · expert_e(h[idx_e]))` and the objective
//! is `CE + Σ_blocks aux` ([`LossParts`]); gates, capacity and the auxiliary loss are defined
//! in [`MoeConfig`]. The MoE unit calls (trunk forward, expert forward, combine, and their
//! backward) are described in [`Gpt::loss_parts_and_grads`], which runs them as a trainer does.
//!
//! Blocks are pre-LN: `x + proj(attn(ln_1(x)))`, then `x + mlp(ln_2(x))` with causal
//! multi-head self-attention and a GELU (tanh form) MLP. LayerNorm, softmax and the
//! cross-entropy are composed of candle ops that all have a backward (the fused candle-nn ones
//! have none, see DESIGN.md "Traps"). On `Device::Cpu` in F32/F64, four pieces run as fused
//! kernels with their own backward (`kernels.rs`: causal softmax, GELU, bias add, LayerNorm's
//! scale-and-shift; about 2.5× faster per step than the op compositions); every other device or
//! dtype takes the op compositions. Both paths are checked against finite differences and
//! against each other.
//!
//! # One step, unit by unit (activation checkpointing, Chen et al. 2016)
//!
//! ```text
//! forward : x_0 = forward(0, p_0, tokens); x_u = forward(u, p_u, x_{u-1})   keep x_u (checkpoint)
//! head    : (loss, g_head, g, g_tied) = head_loss_backward(p_{L+1}, x_L, tied, targets)
//! backward: for u in L..=1: (g_u, g) = backward(u, p_u, x_{u-1}, g)      recompute u, VJP
//!           g_0 = backward(0, p_0, tokens, g).grad_params (+ g_tied when the head is tied)
//! ```
//!
//! [`Gpt::loss_and_grads`] is exactly this loop, in memory (for the MoE block's calls see
//! [`Gpt::loss_parts_and_grads`]). Nothing is kept between calls but
//! what the caller keeps; a unit's activations live only during its own call.
//!
//! # Tied head
//!
//! With `tied_head = true` the head has no weight of its own; it uses `wte` from the embedding
//! unit. Its calls then take `tied_wte = Some(embedding flat vector)` (so the runtime must have
//! the embedding unit resident for the head), and its backward returns
//! [`UnitGrads::grad_tied_wte`], a gradient over the **embedding unit's** flat vector that the
//! trainer adds to the embedding's own gradient before handing it to the optimizer.
//!
//! # Threads (CPU)
//!
//! candle's CPU matmul runs gemm with `Parallelism::Rayon(n)`, where `n` is
//! `candle_core::utils::get_num_threads()`: the `RAYON_NUM_THREADS` environment variable read
//! at every matmul, else the number of logical CPUs. gemm spreads those `n` tasks over the
//! *current* rayon pool (the global one, sized by the same variable at first use, unless the
//! call runs inside `ThreadPool::install`); this module's fused kernels also run on the current
//! rayon pool. candle's own elementwise ops and reductions are single-threaded. A trainer that
//! shares cores with a CPU optimizer must therefore set `RAYON_NUM_THREADS` (before the first
//! candle or rayon call) and/or run the model inside a sized `ThreadPool::install`, with
//! `RAYON_NUM_THREADS` equal to that pool's size so gemm does not split into more tasks than
//! threads. Results do not depend on the thread count: gemm splits output blocks, not the
//! reduction dimension, and the fused row sums add fixed blocks in a fixed order.
#![deny(unsafe_code)]

mod config;
mod gpt;
mod init;
mod kernels;
mod moe;
#[cfg(test)]
mod moe_tests;
#[cfg(test)]
mod tests;

use candle_core::{DType, Device, Tensor};

pub use config::{GptConfig, MoeConfig, ParamInit, ParamSpec, UnitKind, UnitSpec};
pub use gpt::{Gpt, HeadLossGrads, UnitGrads};
pub use init::{init_params, init_unit, init_unit_from_seed};
pub use moe::{CombineGrads, ExpertGrads, LossParts, Routing, TrunkOut};

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
