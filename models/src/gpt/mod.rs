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

use candle_core::{DType, Tensor, Var};

use crate::kernels;
use crate::lm::{HeadLossGrads, UnitGrads};
use crate::ops::{self, cross_entropy, gelu_composed, input_err, layer_norm, linear, scalar, vars, views};
use crate::unit::{UnitKind, UnitSpec};
use crate::{Error, Result};

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
    /// The composed path's causal masks (one `[chunk, chunk]` triangle per dtype and device).
    masks: crate::attention::Masks,
    /// Query positions per block of the composed attention; `None`: the default
    /// ([`crate::AttentionShape::default_chunk`]).
    attention_chunk: Option<usize>,
    /// Use the fused CPU kernels ([`kernels`]) where they apply; `false` forces the op
    /// compositions everywhere (tests compare the two).
    fused_cpu_kernels: bool,
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
    /// [`Error::Config`] from [`GptConfig::validate`].
    pub fn new(config: GptConfig) -> Result<Self> {
        config.validate()?;
        let units = config.units();
        Ok(Self {
            config,
            units,
            masks: crate::attention::Masks::default(),
            attention_chunk: None,
            fused_cpu_kernels: true,
        })
    }

    /// The same model computed with candle op compositions only (no fused CPU kernels): the
    /// path every non-CPU device (and every half dtype) takes, so CPU tests and the sim device
    /// (`[device] ops = "composed"`) can run it. F32 results agree with the fused path within
    /// rounding, not bitwise. [`crate::CausalLm::fused_cpu_kernels`] tells which.
    pub fn composed_only(mut self) -> Self {
        self.fused_cpu_kernels = false;
        self
    }

    /// The same model with the composed path's attention computed over blocks of `chunk` query
    /// positions ([`crate::attention`]): the largest block holds `B · H · chunk · T` scores
    /// (F32 for half dtypes) instead of the whole sequence's `B · H · T · T`, forward and
    /// backward. `None` (the default) takes [`crate::AttentionShape::default_chunk`] (64 MiB of
    /// F32 scores per block); a chunk `>= T` computes the sequence as one block. The fused CPU
    /// kernels (F32/F64 on `Device::Cpu`, unless [`Gpt::composed_only`]) are not chunked.
    ///
    /// # Errors
    /// [`Error::Config`] (`attention_chunk`) for `Some(0)`.
    pub fn with_attention_chunk(mut self, chunk: Option<usize>) -> Result<Self> {
        self.attention_chunk = crate::attention::check_chunk(chunk)?;
        Ok(self)
    }

    /// The configured query positions per attention block (`None`: the default); see
    /// [`Gpt::with_attention_chunk`].
    pub fn attention_chunk(&self) -> Option<usize> {
        self.attention_chunk
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The units in forward order ([`GptConfig::num_units`] of them), as [`GptConfig::units`].
    pub fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    /// Forward of unit `unit`.
    ///
    /// - embedding: `input` token ids `[B, T]` (U32, `T <= max_seq_len`) → hidden `[B, T, d]`;
    /// - block: hidden `[B, T, d]` → hidden `[B, T, d]`;
    /// - head: hidden `[B, T, d]` → logits `[B, T, vocab_size]`.
    ///
    /// `params` is the unit's flat vector; `tied_wte` is the **embedding unit's** flat vector and
    /// is required by the head when `tied_head` is set (ignored otherwise and by other units).
    /// Nothing is kept after the call.
    ///
    /// MoE trunk and expert units are refused (`what = "unit kind"`): their calls take and
    /// return more than one tensor, see [`Gpt::moe_trunk_forward`] and [`Gpt::expert_forward`].
    ///
    /// # Errors
    /// [`Error::Input`] on a wrong unit index, kind, shape, dtype, sequence length or token id;
    /// [`Error::Candle`] from the ops.
    pub fn forward(&self, unit: usize, params: &Tensor, input: &Tensor, tied_wte: Option<&Tensor>) -> Result<Tensor> {
        let spec = self.unit_spec(unit)?;
        self.check_params(spec, params)?;
        let p = views(spec, params)?;
        match spec.kind {
            UnitKind::Embedding => {
                self.check_tokens(input, "embedding input")?;
                self.embed_math(&p, input)
            }
            UnitKind::Block(_) => {
                self.check_hidden(input, params.dtype(), "block input")?;
                self.block_math(&p, input)
            }
            UnitKind::Head => {
                self.check_hidden(input, params.dtype(), "head input")?;
                let w_out = self.head_out_weight(&p, tied_wte, params.dtype())?;
                self.head_math(&p, &w_out, input)
            }
            UnitKind::MoeTrunk(_) | UnitKind::Expert { .. } => Err(moe_unit_err(spec)),
        }
    }

    /// Backward of unit `unit` by recomputation: runs the unit's forward again from its
    /// checkpointed `input` with its parameters (and the input) as candle `Var`s, then takes the
    /// vector-Jacobian product with `grad_output` (same shape as the forward's output; for the
    /// head, the gradient of the logits). Only this unit's activations live during the call
    /// (activation checkpointing, Chen et al. 2016).
    ///
    /// For the head of the training loss use [`Gpt::head_loss_backward`], which takes the targets.
    ///
    /// # Errors
    /// As [`Gpt::forward`], and [`Error::Input`] when `grad_output` does not match the output.
    pub fn backward(
        &self,
        unit: usize,
        params: &Tensor,
        input: &Tensor,
        grad_output: &Tensor,
        tied_wte: Option<&Tensor>,
    ) -> Result<UnitGrads> {
        let spec = self.unit_spec(unit)?;
        self.check_params(spec, params)?;
        let dtype = params.dtype();
        if grad_output.dtype() != dtype {
            return Err(input_err("grad_output dtype", format!("{dtype:?}"), format!("{:?}", grad_output.dtype())));
        }
        if spec.kind == UnitKind::Embedding && ops::is_half(dtype) {
            self.check_tokens(input, "embedding input")?;
            return self.embed_backward_f32(input, grad_output, dtype);
        }
        let vars = vars(spec, params)?;
        let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let (out, x_var, wte_var) = match spec.kind {
            UnitKind::Embedding => {
                self.check_tokens(input, "embedding input")?;
                (self.embed_math(&p, input)?, None, None)
            }
            UnitKind::Block(_) => {
                self.check_hidden(input, dtype, "block input")?;
                let x = Var::from_tensor(input)?;
                (self.block_math(&p, x.as_tensor())?, Some(x), None)
            }
            UnitKind::Head => {
                self.check_hidden(input, dtype, "head input")?;
                let x = Var::from_tensor(input)?;
                let wte = self.tied_wte_var(tied_wte, dtype)?;
                let w_out = match &wte {
                    Some(w) => w.as_tensor().t()?,
                    None => p[2].clone(),
                };
                (self.head_math(&p, &w_out, x.as_tensor())?, Some(x), wte)
            }
            UnitKind::MoeTrunk(_) | UnitKind::Expert { .. } => return Err(moe_unit_err(spec)),
        };
        if out.dims() != grad_output.dims() {
            return Err(input_err(
                "grad_output shape",
                format!("{:?}", out.dims()),
                format!("{:?}", grad_output.dims()),
            ));
        }
        let grads = (out * grad_output)?.sum_all()?.backward()?;
        self.collect(spec, &vars, x_var.as_ref(), wte_var.as_ref(), &grads)
    }

    /// Validation loss of the head: mean cross-entropy in nats of `softmax(logits)` against
    /// `targets` (`[B, T]` U32; positions whose target is [`crate::lm::IGNORE_INDEX`] are left
    /// out of the mean), no gradient kept. `input` is the head's input `[B, T, d]`.
    ///
    /// The loss is returned as f64 (the mean is computed in the params' dtype, then widened) so
    /// that finite-difference checks in F64 keep their precision.
    ///
    /// # Errors
    /// As [`Gpt::forward`], and [`Error::Input`] when `targets` is not `[B, T]` U32 below
    /// `vocab_size`.
    pub fn head_loss(
        &self,
        params: &Tensor,
        input: &Tensor,
        tied_wte: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<f64> {
        let logits = self.forward(self.units.len() - 1, params, input, tied_wte)?;
        self.check_targets(targets, &logits)?;
        scalar(&cross_entropy(&ops::widen(&logits)?, targets)?)
    }

    /// The head's training backward: recomputes the head from its checkpointed `input`
    /// (`[B, T, d]`), returns the mean cross-entropy (nats) against `targets` (`[B, T]` U32) and
    /// the gradients of that loss: the head's flat params, its input, and, when the head is tied,
    /// the embedding unit's flat vector ([`UnitGrads::grad_tied_wte`], which the trainer adds to
    /// the embedding's own gradient).
    ///
    /// # Errors
    /// As [`Gpt::head_loss`].
    pub fn head_loss_backward(
        &self,
        params: &Tensor,
        input: &Tensor,
        tied_wte: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<HeadLossGrads> {
        let spec = &self.units[self.units.len() - 1];
        self.check_params(spec, params)?;
        let dtype = params.dtype();
        self.check_hidden(input, dtype, "head input")?;
        let vars = vars(spec, params)?;
        let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let x = Var::from_tensor(input)?;
        let wte = self.tied_wte_var(tied_wte, dtype)?;
        let w_out = match &wte {
            Some(w) => w.as_tensor().t()?,
            None => p[2].clone(),
        };
        let logits = self.head_math(&p, &w_out, x.as_tensor())?;
        let tokens = self.check_targets(targets, &logits)?;
        // In F32 for half dtypes, as transformers upcasts the logits.
        let loss = cross_entropy(&ops::widen(&logits)?, targets)?;
        let grads = loss.backward()?;
        let grads = self.collect(spec, &vars, Some(&x), wte.as_ref(), &grads)?;
        Ok(HeadLossGrads { loss: scalar(&loss)?, tokens, grads })
    }

    /// Logits `[B, T, vocab_size]` of the whole model: the unit forwards in order.
    /// `params[u]` is unit `u`'s flat vector (`n_layer + 2` of them); `tokens` is `[B, T]` U32.
    ///
    /// With MoE the blocks run as a trainer runs them: [`Gpt::moe_trunk_forward`], then
    /// [`Gpt::expert_forward`] for every expert that received tokens, then [`Gpt::moe_combine`].
    ///
    /// # Errors
    /// As [`Gpt::forward`]; [`Error::Input`] when `params` has the wrong length.
    pub fn forward_all(&self, params: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
        let x = self.forward_trunk(params, tokens)?.0;
        let last = self.units.len() - 1;
        self.forward(last, &params[last], &x, self.tied(params))
    }

    /// The training objective of the whole model on `tokens` → `targets` (both `[B, T]` U32):
    /// the mean cross-entropy (nats) plus, with MoE, the blocks' load-balancing losses
    /// ([`LossParts::total`]). For the dense model this is the mean cross-entropy.
    ///
    /// # Errors
    /// As [`Gpt::forward_all`] and [`Gpt::head_loss`].
    pub fn loss(&self, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> Result<f64> {
        Ok(self.loss_parts(params, tokens, targets)?.total())
    }

    /// The cross-entropy and the auxiliary loss of the whole model, separately (see
    /// [`LossParts`]).
    ///
    /// # Errors
    /// As [`Gpt::loss`].
    pub fn loss_parts(&self, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> Result<LossParts> {
        let (x, aux) = self.forward_trunk(params, tokens)?;
        let last = self.units.len() - 1;
        let ce = self.head_loss(&params[last], &x, self.tied(params), targets)?;
        Ok(LossParts { ce, aux })
    }

    /// Loss and gradients of the whole model, composed of the unit calls exactly as the
    /// out-of-core trainer runs them (the in-memory reference): forward unit by unit keeping
    /// each unit's input, then [`Gpt::head_loss_backward`] and [`Gpt::backward`] in reverse,
    /// each recomputing its unit. The tied head's `wte` gradient is added to the embedding's.
    ///
    /// Returns the objective ([`Gpt::loss`]: the mean cross-entropy in nats, plus the MoE
    /// auxiliary loss) and its gradient, one flat vector per unit, in unit order. With MoE see
    /// [`Gpt::loss_parts_and_grads`] for the unit calls.
    ///
    /// # Errors
    /// As [`Gpt::forward_all`].
    pub fn loss_and_grads(&self, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> Result<(f64, Vec<Tensor>)> {
        let (parts, grads) = self.loss_parts_and_grads(params, tokens, targets)?;
        Ok((parts.total(), grads))
    }

    /// As [`Gpt::loss_and_grads`], with the cross-entropy and the auxiliary loss apart; the
    /// gradients are those of [`LossParts::total`].
    ///
    /// With MoE, block `i` runs forward as [`Gpt::moe_trunk_forward`] → [`Gpt::expert_forward`]
    /// for each expert with tokens → [`Gpt::moe_combine`], keeping the trunk's input `x`, `h`,
    /// the [`Routing`] and the experts' outputs; backward (after the head's) as
    /// [`Gpt::moe_combine_backward`] → [`Gpt::expert_backward`] for each expert with tokens, in
    /// reverse expert order (an expert without tokens is not called; its gradient is zero) →
    /// [`Routing::scatter_input_grads`] → [`Gpt::moe_trunk_backward`].
    ///
    /// # Errors
    /// As [`Gpt::forward_all`].
    pub fn loss_parts_and_grads(
        &self,
        params: &[Tensor],
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<(LossParts, Vec<Tensor>)> {
        if self.config.moe.is_some() {
            return self.moe_loss_parts_and_grads(params, tokens, targets);
        }
        self.check_num_units(params)?;
        // The dense loop is the trait's (forward keeping each unit's input, head, reverse).
        let (ce, grads) = crate::lm::loss_and_grads(self, params, tokens, targets)?;
        Ok((LossParts { ce, aux: 0.0 }, grads))
    }

    // ---- internals -----------------------------------------------------------------------

    /// The head's input `[B, T, d]` and the sum of the blocks' auxiliary losses (0 when dense).
    fn forward_trunk(&self, params: &[Tensor], tokens: &Tensor) -> Result<(Tensor, f64)> {
        if self.config.moe.is_some() {
            let (x, routings) = self.moe_forward_hidden(params, tokens)?;
            return Ok((x, routings.iter().map(Routing::aux_loss).sum()));
        }
        self.check_num_units(params)?;
        let mut x = self.forward(0, &params[0], tokens, None)?;
        for (u, p) in params.iter().enumerate().take(self.units.len() - 1).skip(1) {
            x = self.forward(u, p, &x, None)?;
        }
        Ok((x, 0.0))
    }

    pub(super) fn tied<'a>(&self, params: &'a [Tensor]) -> Option<&'a Tensor> {
        self.config.tied_head.then(|| &params[0])
    }

    pub(super) fn check_num_units(&self, params: &[Tensor]) -> Result<()> {
        if params.len() != self.units.len() {
            return Err(input_err(
                "number of unit parameter vectors",
                self.units.len().to_string(),
                params.len().to_string(),
            ));
        }
        Ok(())
    }

    pub(super) fn unit_spec(&self, unit: usize) -> Result<&UnitSpec> {
        ops::unit_spec(&self.units, unit)
    }

    pub(super) fn check_params(&self, spec: &UnitSpec, params: &Tensor) -> Result<()> {
        ops::check_params(spec, params)
    }

    pub(super) fn check_hidden(&self, x: &Tensor, dtype: DType, what: &'static str) -> Result<()> {
        ops::check_hidden(x, dtype, self.config.d_model, self.config.max_seq_len, what)
    }

    fn check_tokens(&self, tokens: &Tensor, what: &'static str) -> Result<()> {
        ops::check_ids(tokens, self.config.vocab_size, self.config.max_seq_len, what)
    }

    /// Targets are `[B, T]` U32 like the logits' first dims, each `< vocab_size` or
    /// [`crate::lm::IGNORE_INDEX`]; returns the number of counted positions.
    fn check_targets(&self, targets: &Tensor, logits: &Tensor) -> Result<usize> {
        ops::check_targets(targets, &logits.dims()[..2], self.config.vocab_size)
    }

    /// `[d, V]` output weight of the head for forward (a view, no copy).
    fn head_out_weight(&self, p: &[Tensor], tied_wte: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
        match self.tied_wte_view(tied_wte, dtype)? {
            Some(wte) => Ok(wte.t()?),
            None => Ok(p[2].clone()),
        }
    }

    /// `wte` `[V, d]` as a view of the embedding's flat vector, when the head is tied.
    fn tied_wte_view(&self, tied_wte: Option<&Tensor>, dtype: DType) -> Result<Option<Tensor>> {
        if !self.config.tied_head {
            return Ok(None);
        }
        let flat = ops::tied_flat(tied_wte, &self.units[0], dtype, "tied_wte", "model.tied_head = true")?;
        let (v, d) = (self.config.vocab_size, self.config.d_model);
        Ok(Some(flat.narrow(0, 0, v * d)?.reshape((v, d))?))
    }

    fn tied_wte_var(&self, tied_wte: Option<&Tensor>, dtype: DType) -> Result<Option<Var>> {
        Ok(match self.tied_wte_view(tied_wte, dtype)? {
            Some(w) => Some(Var::from_tensor(&w)?),
            None => None,
        })
    }

    /// Flattens the gradients of `vars` into one vector in layout order, plus the input's and
    /// the tied `wte`'s.
    pub(super) fn collect(
        &self,
        spec: &UnitSpec,
        vars: &[Var],
        x: Option<&Var>,
        wte: Option<&Var>,
        grads: &candle_core::backprop::GradStore,
    ) -> Result<UnitGrads> {
        let g = ops::collect_grads(vars, x, wte, grads, self.units[0].numel)?;
        debug_assert_eq!(g.grad_params.dims(), [spec.numel]);
        Ok(g)
    }

    /// Embedding: `wte[tokens] + wpe[0..T]` → `[B, T, d]`.
    pub(super) fn embed_math(&self, p: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let d = self.config.d_model;
        let x = p[0].index_select(&tokens.flatten_all()?, 0)?.reshape((b, t, d))?;
        Ok(x.broadcast_add(&p[1].narrow(0, 0, t)?)?)
    }

    /// The embedding's backward for half dtypes, accumulated in F32: `wte`'s gradient is the
    /// scatter-add of the rows' gradients, `wpe`'s (rows `0..T`) their sum over the batch, both
    /// in F32 (candle's `index_select` and broadcast backward would accumulate in the half
    /// dtype), rounded once to `dtype`.
    fn embed_backward_f32(&self, tokens: &Tensor, grad_output: &Tensor, dtype: DType) -> Result<UnitGrads> {
        let (b, t) = tokens.dims2()?;
        let (v, s, d) = (self.config.vocab_size, self.config.max_seq_len, self.config.d_model);
        if grad_output.dims() != [b, t, d] {
            return Err(input_err(
                "grad_output shape",
                format!("{:?}", [b, t, d]),
                format!("{:?}", grad_output.dims()),
            ));
        }
        let wte = ops::embedding_grad(&tokens.flatten_all()?, &grad_output.reshape((b * t, d))?, v)?;
        let mut wpe = grad_output.to_dtype(DType::F32)?.sum(0)?.to_dtype(dtype)?; // [T, d]
        if t < s {
            wpe = Tensor::cat(&[&wpe, &Tensor::zeros((s - t, d), dtype, wpe.device())?], 0)?;
        }
        let grad_params = Tensor::cat(&[&wte.flatten_all()?, &wpe.flatten_all()?], 0)?;
        Ok(UnitGrads { grad_params, grad_input: None, grad_tied_wte: None })
    }

    /// Whether the fused CPU kernels apply to computations on `x`.
    pub(super) fn fused(&self, x: &Tensor) -> bool {
        self.fused_cpu_kernels && kernels::fused_supported(x)
    }

    /// Pre-LN block: `x + attn(ln_1(x))`, then `+ mlp(ln_2(.))` → `[B, T, d]`.
    pub(super) fn block_math(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let fused = self.fused(x);
        let x = self.attention_residual(p, x)?;

        // MLP.
        let h = layer_norm(&x, &p[bi::LN2_W], &p[bi::LN2_B], self.config.ln_eps, fused)?.reshape((b * t, d))?;
        let h = linear(&h, &p[bi::FC_W], &p[bi::FC_B], fused)?;
        let h = if fused { kernels::gelu(&h)? } else { gelu_composed(&h)? };
        let h = linear(&h, &p[bi::FC2_W], &p[bi::FC2_B], fused)?;
        Ok((x + h.reshape((b, t, d))?)?)
    }

    /// The attention half of a block (dense or MoE trunk; `p` holds `ln_1`, `attn.*` at the
    /// indices of [`bi`]): `x + proj(attn(ln_1(x)))` → `[B, T, d]`.
    pub(super) fn attention_residual(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let (nh, hd) = (self.config.n_head, self.config.head_dim());
        let eps = self.config.ln_eps;
        let fused = self.fused(x);
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
        let y = if fused {
            let att = kernels::causal_softmax(&ops::matmul(&q, &k.t()?)?)?; // [B, H, T, T]
            ops::matmul(&att, &v)?.transpose(1, 2)? // [B, T, H, hd]
        } else {
            // Over query blocks, the softmax in F32 for half dtypes (transformers' eager
            // attention): [B, T, H, hd].
            self.masks.attention(&q, &k, &v, self.attention_chunk)?
        };
        let y = y.reshape((b * t, d))?;
        let y = linear(&y, bi::PROJ_W, bi::PROJ_B)?;
        Ok((x + y.reshape((b, t, d))?)?)
    }

    /// Head: `ln_f(x) @ w_out` → logits `[B, T, V]`; `w_out` is `[d, V]`.
    pub(super) fn head_math(&self, p: &[Tensor], w_out: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let h = layer_norm(x, &p[0], &p[1], self.config.ln_eps, self.fused(x))?.reshape((b * t, d))?;
        Ok(ops::matmul(&h, w_out)?.reshape((b, t, self.config.vocab_size))?)
    }
}

/// The error of [`Gpt::forward`]/[`Gpt::backward`] on an MoE unit.
fn moe_unit_err(spec: &UnitSpec) -> Error {
    input_err(
        "unit kind",
        "the embedding, a dense block or the head (MoE units: moe_trunk_forward, expert_forward, ...)".into(),
        format!("{:?} (unit {})", spec.kind, spec.name),
    )
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

    fn forward(&self, unit: usize, params: &Tensor, input: &Tensor, tied: Option<&Tensor>) -> Result<Tensor> {
        Gpt::forward(self, unit, params, input, tied)
    }

    fn backward(
        &self,
        unit: usize,
        params: &Tensor,
        input: &Tensor,
        grad_output: &Tensor,
        tied: Option<&Tensor>,
    ) -> Result<UnitGrads> {
        Gpt::backward(self, unit, params, input, grad_output, tied)
    }

    fn head_loss(&self, params: &Tensor, input: &Tensor, tied: Option<&Tensor>, targets: &Tensor) -> Result<f64> {
        Gpt::head_loss(self, params, input, tied, targets)
    }

    fn head_loss_backward(
        &self,
        params: &Tensor,
        input: &Tensor,
        tied: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<HeadLossGrads> {
        Gpt::head_loss_backward(self, params, input, tied, targets)
    }

    fn moe(&self) -> Option<&dyn crate::MoeLm> {
        self.config.moe.is_some().then_some(self as &dyn crate::MoeLm)
    }

    /// `false` after [`Gpt::composed_only`].
    fn fused_cpu_kernels(&self) -> bool {
        self.fused_cpu_kernels
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
    /// of [`Gpt::attention_chunk`] (or the default) query positions. (The fused CPU kernels,
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
        crate::attention_workspace_bytes(shape, shape.chunk(self.attention_chunk), dtype)
    }
}

impl crate::MoeLm for Gpt {
    fn experts_per_token(&self) -> usize {
        self.config.moe.as_ref().map_or(1, |m| m.top_k)
    }

    fn trunk_forward(&self, block: usize, params: &Tensor, x: &Tensor) -> Result<TrunkOut> {
        self.moe_trunk_forward(block, params, x)
    }

    fn expert_forward(&self, params: &Tensor, h_e: &Tensor) -> Result<Tensor> {
        Gpt::expert_forward(self, params, h_e)
    }

    fn expert_backward(&self, params: &Tensor, h_e: &Tensor, grad_out_e: &Tensor) -> Result<ExpertGrads> {
        Gpt::expert_backward(self, params, h_e, grad_out_e)
    }

    fn trunk_backward(
        &self,
        block: usize,
        params: &Tensor,
        x: &Tensor,
        routing: &Routing,
        grad_y: &Tensor,
        grad_h: &Tensor,
        grad_gates: &[Option<Tensor>],
    ) -> Result<UnitGrads> {
        self.moe_trunk_backward(block, params, x, routing, grad_y, grad_h, grad_gates)
    }
}
