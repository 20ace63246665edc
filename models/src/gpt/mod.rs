//! The byte-level GPT (GPT-2 architecture, Radford et al. 2019) on candle,
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
//! backward) are [`crate::MoeLm`]'s; [`crate::lm::loss_parts_and_grads`] runs them as a trainer does.
//!
//! Blocks are pre-LN: `x + proj(attn(ln_1(x)))`, then `x + mlp(ln_2(x))` with causal
//! multi-head self-attention and a GELU (tanh form) MLP. LayerNorm, softmax and the
//! cross-entropy are composed of candle ops that all have a backward (the fused candle-nn ones
//! have none, see DESIGN.md "Traps"). On `Device::Cpu` in F32/F64, four pieces run as fused
//! kernels with their own backward (`kernels/`: causal softmax, GELU, bias add, LayerNorm's
//! scale-and-shift, each beside its composition; about 2.5× faster per step than the op compositions); every other device or
//! dtype takes the op compositions. Both paths are checked against finite differences and
//! against each other.
//!
//! Half dtypes (BF16, F16) always take the op compositions and compute as torch does under
//! bf16: matmuls (BF16 on the CPU through F32, as a GPU's BF16 GEMM accumulates in F32) and
//! residual adds in the half dtype; LayerNorm (statistics, scale and shift, one rounding), GELU,
//! the attention softmax, MoE-GPT's router softmax, gates and load-balancing loss, and the
//! cross-entropy in F32; every gradient that sums over tokens (LayerNorm weights and biases,
//! biases, `wte`'s scatter-add and `wpe`) accumulated in F32, then rounded once to the params'
//! dtype.
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
//! [`crate::lm::loss_and_grads`] is exactly this loop, in memory (for the MoE block's calls see
//! [`crate::lm::loss_parts_and_grads`]). The unit calls are written once for every family in
//! [`crate::lm`]; this module gives the GPT's embedding, block and head. Nothing is kept between calls but
//! what the caller keeps; a unit's activations live only during its own call.
//!
//! # Tied head
//!
//! With `tied_head = true` the head has no weight of its own; it uses `wte` from the embedding
//! unit. Its calls then take `tied_wte = Some(embedding flat vector)` (so the runtime must have
//! the embedding unit resident for the head), and its backward returns
//! [`UnitGrads::grad_tied_wte`](crate::lm::UnitGrads::grad_tied_wte), a gradient over the
//! **embedding unit's** flat vector that the trainer adds to the embedding's own gradient before
//! handing it to the optimizer.
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

use candle_core::{DType, Tensor};

use crate::kernels::{gelu, layer_norm, linear};
use crate::lm::Family;
use crate::ops;
use crate::unit::{UnitKind, UnitSpec};
use crate::Result;

use config::block_idx as bi;

mod config;
mod moe;
#[cfg(test)]
mod moe_tests;
#[cfg(test)]
mod tests;

pub use crate::moe::{CombineGrads, ExpertGrads, LossParts, Routing, TrunkOut};
pub use config::{GptConfig, MoeConfig};

/// The byte-level GPT, computed one unit at a time.
///
/// Holds the configuration, the unit layouts and a small cache of causal masks; no parameters
/// and no activations. Every call takes a unit's flat parameters (a 1-D [`Tensor`] of
/// `unit.numel` elements on any candle device, dtype F32, F64, BF16, or F16 where the device has
/// matmuls for it; BF16 on the CPU multiplies through F32) and computes in that dtype. Half
/// dtypes (BF16/F16, always the op compositions) compute as torch does: LayerNorm, GELU, the
/// attention softmax, the router's softmax and gates (MoE) and the loss in F32, and every
/// reduction over tokens in F32 (the norm weights' and biases' gradients, the embedding's).
///
/// `Gpt` is `Send + Sync`; calls may run concurrently.
pub struct Gpt {
    pub(super) config: GptConfig,
    pub(super) units: Vec<UnitSpec>,
    /// The fused kernels on or off, the composed attention's chunk and masks.
    compute: crate::Compute,
}

impl std::fmt::Debug for Gpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Gpt {
    /// Validates `config` and computes the unit layouts.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) from [`GptConfig::validate`].
    pub fn new(config: GptConfig) -> Result<Self> {
        config.validate()?;
        let units = config.units();
        Ok(Self { config, units, compute: crate::Compute::default() })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Embedding: `wte[tokens] + wpe[0..T]` → `[B, T, d]`.
    pub(super) fn embed_math(&self, p: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let d = self.config.d_model;
        let x = p[0].index_select(&tokens.flatten_all()?, 0)?.reshape((b, t, d))?;
        Ok(x.broadcast_add(&p[1].narrow(0, 0, t)?)?)
    }

    /// Pre-LN block: `x + attn(ln_1(x))`, then `+ mlp(ln_2(.))` → `[B, T, d]`.
    pub(super) fn block_math(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let fused = self.compute.fused(x);
        let x = self.attention_residual(p, x)?;

        // MLP.
        let h = layer_norm(&x, &p[bi::LN2_W], &p[bi::LN2_B], self.config.ln_eps, fused)?.reshape((b * t, d))?;
        let h = linear(&h, &p[bi::FC_W], &p[bi::FC_B], fused)?;
        let h = gelu(&h, fused)?;
        let h = linear(&h, &p[bi::FC2_W], &p[bi::FC2_B], fused)?;
        Ok((x + h.reshape((b, t, d))?)?)
    }

    /// The attention half of a block (dense or MoE trunk; `p` holds `ln_1`, `attn.*` at the
    /// indices of [`bi`]): `x + proj(attn(ln_1(x)))` → `[B, T, d]`.
    pub(super) fn attention_residual(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let (nh, hd) = (self.config.n_head, self.config.head_dim());
        let eps = self.config.ln_eps;
        let fused = self.compute.fused(x);
        let linear = |h: &Tensor, w: usize, bias: usize| linear(h, &p[w], &p[bias], fused);

        // Attention.
        let h = layer_norm(x, &p[bi::LN1_W], &p[bi::LN1_B], eps, fused)?.reshape((b * t, d))?;
        let qkv = linear(&h, bi::QKV_W, bi::QKV_B)?.reshape((b, t, 3, nh, hd))?;
        let head = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2) // [B, H, T, hd], strided
        };
        // The scale is folded into the copy that makes q contiguous.
        let q = head(0)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?;
        let k = head(1)?.contiguous()?;
        let v = head(2)?.contiguous()?;
        let y = self.compute.attention(&q, &k, &v, fused)?.reshape((b * t, d))?; // [B, T, H, hd]
        let y = linear(&y, bi::PROJ_W, bi::PROJ_B)?;
        Ok((x + y.reshape((b, t, d))?)?)
    }

    /// Head: `ln_f(x) @ w_out` → logits `[B, T, V]`; `w_out` is `[d, V]`.
    pub(super) fn head_math(&self, p: &[Tensor], w_out: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let h = layer_norm(x, &p[0], &p[1], self.config.ln_eps, self.compute.fused(x))?.reshape((b * t, d))?;
        Ok(ops::matmul(&h, w_out)?.reshape((b, t, self.config.vocab_size))?)
    }
}

/// The GPT's embedding (`wte[tokens] + wpe`), pre-LN block and head; the unit calls are
/// [`crate::lm`]'s.
impl Family for Gpt {
    fn tie_names(&self) -> (&'static str, &'static str) {
        ("tied_wte", "model.tied_head = true")
    }

    fn embed(&self, p: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
        self.embed_math(p, tokens)
    }

    /// `wte`'s scatter-add, then `wpe`'s gradient (rows `0..T`): the rows' gradients summed
    /// over the batch in F32, rounded once, zeros for the rows past `T`.
    fn embed_backward_wide(&self, tokens: &Tensor, grad_output: &Tensor, grad_wte: Tensor) -> Result<Tensor> {
        let t = tokens.dim(1)?;
        let (s, d, dtype) = (self.config.max_seq_len, self.config.d_model, grad_output.dtype());
        let mut wpe = grad_output.to_dtype(DType::F32)?.sum(0)?.to_dtype(dtype)?; // [T, d]
        if t < s {
            wpe = Tensor::cat(&[&wpe, &Tensor::zeros((s - t, d), dtype, wpe.device())?], 0)?;
        }
        Ok(Tensor::cat(&[&grad_wte.flatten_all()?, &wpe.flatten_all()?], 0)?)
    }

    fn block(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        self.block_math(p, x)
    }

    /// `ln_f(x) @ w_out` with `w_out` the head's `[d, V]` or the tied `wte`'s transpose.
    fn head(&self, p: &[Tensor], tied: Option<&Tensor>, x: &Tensor) -> Result<Tensor> {
        let w_out = match tied {
            Some(wte) => wte.t()?,
            None => p[2].clone(),
        };
        self.head_math(p, &w_out, x)
    }
}

impl crate::CausalLm for Gpt {
    fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.config.max_seq_len
    }

    fn tied_head(&self) -> bool {
        self.config.tied_head
    }

    crate::lm::unit_calls!();

    fn moe(&self) -> Option<&dyn crate::MoeLm> {
        self.config.moe.is_some().then_some(self as &dyn crate::MoeLm)
    }

    fn compute(&self) -> &crate::Compute {
        &self.compute
    }

    fn compute_mut(&mut self) -> &mut crate::Compute {
        &mut self.compute
    }

    fn dims(&self) -> crate::Dims {
        let c = &self.config;
        let intermediate = if c.moe.is_some() { c.expert_dim() } else { c.ff_dim() };
        crate::Dims { hidden: c.d_model, intermediate, heads: c.n_head, layers: c.n_layer }
    }

    /// As the trait's, with the GPT's attention (width `d_model`) on dense blocks and MoE
    /// trunks, and the head's output projection `2 · vocab · d · tokens` (its LayerNorm not
    /// counted), tied or not.
    fn forward_flops(&self, unit: usize, tokens: usize, seq_len: usize) -> f64 {
        let spec = &self.units[unit];
        let matmuls = 2.0 * spec.numel as f64 * tokens as f64;
        match spec.kind {
            UnitKind::Embedding => 0.0,
            UnitKind::Block(_) | UnitKind::MoeTrunk(_) => {
                matmuls + crate::lm::attention_flops(seq_len, self.config.d_model, tokens)
            }
            UnitKind::Expert { .. } => matmuls,
            UnitKind::Head => 2.0 * (self.config.vocab_size * self.config.d_model) as f64 * tokens as f64,
        }
    }

    /// The composed path's attention core over `n_head` heads of `d_model / n_head`, in blocks
    /// of [`crate::CausalLm::attention_chunk`] (or the default) query positions. (The fused CPU kernels,
    /// F32/F64 on `Device::Cpu`, hold the whole sequence's scores:
    /// [`crate::attention_workspace_bytes`] with `chunk = seq_len`.)
    fn attention_workspace(&self, batch: usize, seq_len: usize, dtype: DType) -> crate::AttentionBytes {
        let shape = crate::AttentionShape {
            batch,
            seq_len,
            heads: self.config.n_head,
            kv_heads: self.config.n_head,
            head_dim: self.config.head_dim(),
        };
        crate::attention_workspace_bytes(shape, shape.chunk(self.compute.attention_chunk()), dtype)
    }
}

impl crate::MoeLm for Gpt {
    fn experts_per_token(&self) -> usize {
        self.config.moe.as_ref().map_or(1, |m| m.top_k)
    }

    crate::lm::moe_calls!();
}
