//! What a trainer drives: a causal language model cut into units ([`CausalLm`]), and the extra
//! calls of a model whose feed-forward blocks are experts ([`MoeLm`]).
//!
//! One step of a dense model, unit by unit (activation checkpointing, Chen et al. 2016):
//!
//! ```text
//! forward : x_0 = forward(0, p_0, tokens); x_u = forward(u, p_u, x_{u-1})   keep x_u (checkpoint)
//! head    : (loss, g_head, g, g_tied) = head_loss_backward(p_head, x_last, tied, targets)
//! backward: for each block u in reverse: (g_u, g) = backward(u, p_u, x_{u-1}, g)   recompute u, VJP
//!           g_0 = backward(0, p_0, tokens, g).grad_params (+ g_tied when the head is tied)
//! ```
//!
//! With MoE blocks ([`CausalLm::moe`]) each block is a trunk unit and one unit per expert; the
//! trunk routes the tokens and the trainer calls each routed expert where its placement says
//! (see [`MoeLm`], which spells out the calls and their order). [`loss_parts_and_grads`] is that
//! loop, in memory, for any [`CausalLm`], dense or MoE ([`loss_and_grads`]: its total;
//! [`forward_all`], [`loss_parts`] and [`loss`] the forward pass alone).
//!
//! # The unit calls, once
//!
//! The unit calls are written here once for every family of this crate: the dispatch by unit
//! kind with its checks, the recompute-and-VJP backward, the head's loss and its backward
//! (`unit_forward`, `unit_backward`, `unit_head_loss`, `unit_head_loss_backward`), and the MoE
//! block's trunk and expert calls (`trunk_forward`, `expert_forward`, `expert_backward`,
//! `trunk_backward`). A family implements the crate-internal `Family` trait — its views of a
//! unit's flat vector, its embedding, dense block and head, and optionally a loss and a
//! backward of its own (the Llama family's fused CPU layer and head) — and, with MoE blocks,
//! `MoeFamily` (its trunk, routing, expert, gates and load-balancing term); its `impl CausalLm`
//! and `impl MoeLm` take the calls from the `unit_calls!` and `moe_calls!` macros.
//!
//! # Targets and the ignore index
//!
//! Targets are `[B, T]` U32, already shifted (`targets[b, t]` is the token after
//! `tokens[b, t]`). A position whose target is [`IGNORE_INDEX`] (`u32::MAX`, transformers'
//! `-100`) is left out of the loss: the cross-entropy is the mean over the counted positions
//! only ([`TokenLoss`] gives the sum and the count, so losses of several batches can be pooled
//! per token).

use candle_core::{DType, Tensor, Var};

use crate::attention::{AttentionBytes, AttentionShape};
use crate::compute::Compute;
use crate::unit::{UnitKind, UnitSpec};
use crate::{LossParts, Result, Routing, TrunkOut};

/// The target id of a position left out of the loss (`u32::MAX`; transformers' `-100`, the
/// `ignore_index` of `torch.nn.functional.cross_entropy`): padding, or the tokens of a prompt
/// that should not be learned. Every [`CausalLm`] head honours it: the loss is the mean over the
/// other positions, and an ignored position contributes no gradient.
pub const IGNORE_INDEX: u32 = u32::MAX;

/// A cross-entropy as a sum over the counted positions and their number, so that the losses of
/// several batches can be pooled per token (`Σ sum_nats / Σ tokens`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLoss {
    /// Sum of the per-position cross-entropies (nats) over the positions whose target is not
    /// [`IGNORE_INDEX`].
    pub sum_nats: f64,
    /// Number of those positions.
    pub tokens: usize,
}

impl TokenLoss {
    /// The mean in nats per counted token; 0 when no position is counted.
    pub fn mean(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.sum_nats / self.tokens as f64
        }
    }
}

/// Gradients of one unit's backward.
#[derive(Debug, Clone)]
pub struct UnitGrads {
    /// Gradient of the unit's flat parameters: 1-D, `unit.numel` elements, the params' dtype.
    pub grad_params: Tensor,
    /// Gradient of the unit's input `[B, T, d]`; `None` for the embedding (its input is token ids).
    pub grad_input: Option<Tensor>,
    /// Tied head only: gradient of the **embedding unit's** flat vector from the head's use of
    /// the token embedding (1-D, `units[0].numel` elements, zero elsewhere). The embedding's
    /// full gradient is its own [`UnitGrads::grad_params`] plus this. `None` for untied heads and
    /// other units.
    pub grad_tied_wte: Option<Tensor>,
}

/// Output of [`CausalLm::head_loss_backward`].
#[derive(Debug, Clone)]
pub struct HeadLossGrads {
    /// Mean cross-entropy in nats over the positions whose target is not [`IGNORE_INDEX`],
    /// computed in the params' dtype, in F32 for half dtypes (BF16, F16) as transformers upcasts
    /// the logits (0, with zero gradients, when every target is ignored).
    pub loss: f64,
    /// Number of positions counted in [`HeadLossGrads::loss`] (targets not [`IGNORE_INDEX`]).
    pub tokens: usize,
    /// Gradients of the head unit (see [`UnitGrads`]); `grad_input` is always `Some`.
    pub grads: UnitGrads,
}

/// A causal language model cut into units, computed one unit at a time.
///
/// Units are in forward order: unit 0 is the token embedding, the last unit the final norm and
/// LM head ([`crate::UnitKind`]); in between, one unit per block (or, with MoE, a trunk unit
/// followed by its expert units). Every call takes the unit's flat parameters (a 1-D tensor of
/// [`UnitSpec::numel`] elements, any candle device, a float dtype) and computes in that dtype
/// (half dtypes widen to F32 where transformers does: norm statistics, softmax, RoPE tables, the
/// router, the loss, and every reduction over tokens, DESIGN.md "Precision");
/// inputs are token ids `[B, T]` U32 (embedding) or hidden states `[B, T, d]`. Implementations
/// keep no parameters and no activations, are `Send + Sync`, and may be called concurrently.
pub trait CausalLm: Send + Sync + std::fmt::Debug {
    /// The units in forward order with their flat layouts.
    fn units(&self) -> &[UnitSpec];

    /// Token ids are `0..vocab_size`.
    fn vocab_size(&self) -> usize;

    /// The longest sequence the model takes.
    fn max_seq_len(&self) -> usize;

    /// Whether the head reads the embedding unit's parameters (tied embeddings): its calls then
    /// take `tied = Some(embedding unit's flat vector)`, so the embedding must be resident with
    /// the head.
    fn tied_head(&self) -> bool;

    /// Forward of the embedding, a dense block or the head (logits `[B, T, vocab_size]`).
    ///
    /// # Errors
    /// [`crate::Error::Input`] on a wrong unit index, kind (MoE units go through [`MoeLm`]),
    /// shape, dtype or token id; [`crate::Error::Candle`] from the ops.
    fn forward(&self, unit: usize, params: &Tensor, input: &Tensor, tied: Option<&Tensor>) -> Result<Tensor>;

    /// Backward of the embedding, a dense block or the head by recomputation from its
    /// checkpointed `input`: the vector-Jacobian product with `grad_output` (the shape of the
    /// forward's output).
    ///
    /// # Errors
    /// As [`CausalLm::forward`], and when `grad_output` does not match the output.
    fn backward(
        &self,
        unit: usize,
        params: &Tensor,
        input: &Tensor,
        grad_output: &Tensor,
        tied: Option<&Tensor>,
    ) -> Result<UnitGrads>;

    /// Mean cross-entropy (nats) of the head on its input `[B, T, d]` against `targets`
    /// (`[B, T]` U32; positions with [`IGNORE_INDEX`] are left out of the mean, which is 0 when
    /// every target is ignored), without gradients (validation).
    ///
    /// # Errors
    /// As [`CausalLm::forward`]; bad targets (shape, dtype, an id `>= vocab_size` other than
    /// [`IGNORE_INDEX`]).
    fn head_loss(&self, params: &Tensor, input: &Tensor, tied: Option<&Tensor>, targets: &Tensor) -> Result<f64>;

    /// As [`CausalLm::head_loss`], as a sum over the counted positions and their number
    /// ([`TokenLoss`]), to pool validation batches per token. The default multiplies the mean by
    /// the count of targets that are not [`IGNORE_INDEX`].
    ///
    /// # Errors
    /// As [`CausalLm::head_loss`].
    fn head_loss_sum(
        &self,
        params: &Tensor,
        input: &Tensor,
        tied: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<TokenLoss> {
        let mean = self.head_loss(params, input, tied, targets)?;
        let tokens = count_targets(targets)?;
        Ok(TokenLoss { sum_nats: mean * tokens as f64, tokens })
    }

    /// The head's training backward (the forward→backward turn): recomputes the head from its
    /// input, returns the mean cross-entropy against `targets` (over the positions that are not
    /// [`IGNORE_INDEX`], their number in [`HeadLossGrads::tokens`]) and the gradients of that
    /// mean: of the head's parameters, of its input, and (tied) of the embedding's flat vector.
    ///
    /// # Errors
    /// As [`CausalLm::head_loss`].
    fn head_loss_backward(
        &self,
        params: &Tensor,
        input: &Tensor,
        tied: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<HeadLossGrads>;

    /// The model's widths, for memory estimates.
    fn dims(&self) -> Dims;

    /// The MoE calls when the model's blocks are experts behind a router; `None` for a dense
    /// model.
    fn moe(&self) -> Option<&dyn MoeLm> {
        None
    }

    /// How the model computes ([`Compute`]): the fused CPU kernels on or off, the composed
    /// attention's query positions per block; set by [`CausalLm::composed_only`] and
    /// [`CausalLm::with_attention_chunk`].
    fn compute(&self) -> &Compute;

    /// [`CausalLm::compute`], to change (what the builders below write).
    fn compute_mut(&mut self) -> &mut Compute;

    /// Whether the unit calls run fused CPU kernels where they apply (`Device::Cpu`, F32 or
    /// F64). `false` for a model built with [`CausalLm::composed_only`]: it computes with the
    /// candle op compositions only, the op sequence a CUDA device runs (half dtypes always take
    /// it). A trainer that asked for the composed path can check here that it got it.
    fn fused_cpu_kernels(&self) -> bool {
        self.compute().fused_cpu_kernels()
    }

    /// The same model computed with candle op compositions only (no fused CPU kernels): the
    /// path every non-CPU device (and every half dtype) takes, so CPU tests, benchmarks and a
    /// simulated device (`[device] ops = "composed"`) can run the op sequence of a CUDA device.
    /// F32 results agree with the fused path within rounding, not bitwise.
    /// [`CausalLm::fused_cpu_kernels`] tells which.
    fn composed_only(mut self) -> Self
    where
        Self: Sized,
    {
        self.compute_mut().set_composed_only();
        self
    }

    /// The same model with the composed path's attention computed over blocks of `chunk` query
    /// positions ([`crate::attention`]): the largest block holds `B · H · chunk · T` scores
    /// (F32 for half dtypes) instead of the whole sequence's `B · H · T · T`, forward and
    /// backward. `None` (the default) takes [`AttentionShape::default_chunk`] (64 MiB of F32
    /// scores per block); a chunk `>= T` computes the sequence as one block. The fused CPU
    /// kernels (F32/F64 on `Device::Cpu`, unless [`CausalLm::composed_only`]) are not chunked.
    ///
    /// # Errors
    /// [`crate::Error::Config`] (`attention_chunk`) for `Some(0)`.
    fn with_attention_chunk(mut self, chunk: Option<usize>) -> Result<Self>
    where
        Self: Sized,
    {
        self.compute_mut().set_attention_chunk(chunk)?;
        Ok(self)
    }

    /// The configured query positions per attention block (`None`: the default); see
    /// [`CausalLm::with_attention_chunk`].
    fn attention_chunk(&self) -> Option<usize> {
        self.compute().attention_chunk()
    }

    /// Forward FLOPs of unit `unit` over `tokens` tokens of sequences of `seq_len` (for an
    /// expert, `tokens` is the number routed to it), for planners: `2 · params · tokens` for the
    /// matmuls (a multiply-add is 2 FLOPs), plus a family's attention (scores and weighted sum),
    /// minus what is a gather (the embedding: 0), plus the head's output projection even when it
    /// is the tied embedding's. The backward with recompute is a planner's multiple of this.
    fn forward_flops(&self, unit: usize, tokens: usize, seq_len: usize) -> f64 {
        let _ = seq_len;
        match self.units()[unit].kind {
            crate::UnitKind::Embedding => 0.0,
            _ => 2.0 * self.units()[unit].numel as f64 * tokens as f64,
        }
    }

    /// The device bytes the attention core of one block (dense block or MoE trunk) needs at its
    /// peak, forward and backward, for `batch` sequences of `seq_len` tokens computed in `dtype`
    /// ([`AttentionBytes`], term by term in [`crate::attention::attention_workspace_bytes`]),
    /// for planners. The families of this crate answer for their composed path (the one a CUDA
    /// device runs), with the query blocks they use ([`CausalLm::with_attention_chunk`]). The
    /// default: multi-head attention over [`Dims::heads`] heads of `hidden / heads`, the whole
    /// sequence as one block (the eager attention of a model that does not say).
    fn attention_workspace(&self, batch: usize, seq_len: usize, dtype: DType) -> AttentionBytes {
        let d = self.dims();
        let heads = d.heads.max(1);
        let shape = AttentionShape { batch, seq_len, heads, kv_heads: heads, head_dim: d.hidden / heads };
        crate::attention::attention_workspace_bytes(shape, seq_len, dtype)
    }
}

/// A model's widths ([`CausalLm::dims`]), for memory estimates of activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Width of the residual stream (`d_model`, `hidden_size`).
    pub hidden: usize,
    /// Width of the MLP's (or an expert's) hidden layer.
    pub intermediate: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Blocks (decoder layers).
    pub layers: usize,
}

/// Forward FLOPs of causal attention's scores (`QKᵀ`) and weighted sum (`AV`) over `tokens`
/// tokens of sequences of `seq_len`, with `width` = heads × head width: `4 · seq_len · width ·
/// tokens` (causal masking not halved, as the planner has always counted it).
pub fn attention_flops(seq_len: usize, width: usize, tokens: usize) -> f64 {
    4.0 * (seq_len * width) as f64 * tokens as f64
}

/// The number of targets that are not [`IGNORE_INDEX`] in `targets` (any shape, U32).
///
/// # Errors
/// [`crate::Error::Input`] when `targets` is not U32; [`crate::Error::Candle`] when it cannot be
/// read back to the host.
pub fn count_targets(targets: &Tensor) -> Result<usize> {
    Ok(crate::ops::host_targets(targets)?.iter().filter(|&&t| t != IGNORE_INDEX).count())
}

/// Logits `[B, T, vocab_size]` of the whole model: the unit forwards in order (an MoE block as
/// a trainer runs it: trunk, each expert with tokens, combine). `params[u]` is unit `u`'s flat
/// vector, `tokens` `[B, T]` U32.
///
/// # Errors
/// [`crate::Error::Input`] for a wrong number of parameter vectors or unit order; any error of
/// the unit calls.
pub fn forward_all(model: &dyn CausalLm, params: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
    let pass = forward_pass(model, params, tokens, false)?;
    let last = params.len() - 1;
    model.forward(last, &params[last], &pass.x, model.tied_head().then(|| &params[0]))
}

/// The objective of the whole model on `tokens` → `targets` (both `[B, T]` U32) in its two
/// parts, without gradients: the head's [`CausalLm::head_loss`] and, for an MoE model, the
/// weighted load-balancing term ([`MoeLm::aux_loss`]; 0 for a dense model).
///
/// # Errors
/// As [`forward_all`] and [`CausalLm::head_loss`].
pub fn loss_parts(model: &dyn CausalLm, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> Result<LossParts> {
    let pass = forward_pass(model, params, tokens, false)?;
    let last = params.len() - 1;
    let ce = model.head_loss(&params[last], &pass.x, model.tied_head().then(|| &params[0]), targets)?;
    Ok(LossParts { ce, aux: pass.aux })
}

/// [`loss_parts`]' total ([`LossParts::total`]; the mean cross-entropy of a dense model).
///
/// # Errors
/// As [`loss_parts`].
pub fn loss(model: &dyn CausalLm, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> Result<f64> {
    let parts = loss_parts(model, params, tokens, targets)?;
    Ok(if model.moe().is_some() { parts.total() } else { parts.ce })
}

/// Loss and gradients of a [`CausalLm`] over one batch, composed of the unit calls exactly as
/// the out-of-core trainer runs them (the in-memory reference of the module docs): forward unit
/// by unit keeping each unit's input, then [`CausalLm::head_loss_backward`] and
/// [`CausalLm::backward`] in reverse, each recomputing its unit; a tied head's
/// [`UnitGrads::grad_tied_wte`] is added to the embedding's gradient. An MoE model's blocks
/// take the [`MoeLm`] calls ([`loss_parts_and_grads`]).
///
/// `params[u]` is unit `u`'s flat vector (1-D, [`UnitSpec::numel`] elements, one float dtype for
/// all), `tokens` and `targets` `[B, T]` U32 (targets may hold [`IGNORE_INDEX`]). Returns the
/// objective — the head's [`HeadLossGrads::loss`] (mean cross-entropy in nats over the counted
/// positions), plus for an MoE model the weighted load-balancing term ([`LossParts::total`]) —
/// and its gradient, one flat vector per unit, in unit order and the params' dtype.
///
/// # Errors
/// [`crate::Error::Input`] for a wrong number of parameter vectors, or any error of the unit
/// calls.
pub fn loss_and_grads(
    model: &dyn CausalLm,
    params: &[Tensor],
    tokens: &Tensor,
    targets: &Tensor,
) -> Result<(f64, Vec<Tensor>)> {
    let (parts, grads) = loss_parts_and_grads(model, params, tokens, targets)?;
    Ok((if model.moe().is_some() { parts.total() } else { parts.ce }, grads))
}

/// The MoE side of [`loss_and_grads`]: the objective in its two parts ([`LossParts`]: the
/// cross-entropy and the weighted load-balancing term) and its gradient, one flat vector per
/// unit, in unit order — for any [`CausalLm`], dense (`aux = 0`) or MoE. An MoE block runs
/// exactly the calls, in the order, that [`MoeLm`]'s docs prescribe for a trainer, experts in
/// index order; an expert without tokens is not called and its gradient is zero.
///
/// This is the in-memory reference a trainer's MoE path can be compared with (same calls, same
/// order: the same bits).
///
/// # Errors
/// [`crate::Error::Input`] for a wrong number of parameter vectors or a unit order that is not
/// `[embedding, (block | trunk, its experts)*, head]`; any error of the unit calls.
pub fn loss_parts_and_grads(
    model: &dyn CausalLm,
    params: &[Tensor],
    tokens: &Tensor,
    targets: &Tensor,
) -> Result<(LossParts, Vec<Tensor>)> {
    let pass = forward_pass(model, params, tokens, true)?;
    let n = params.len();
    let tied = model.tied_head().then(|| &params[0]);

    // The head, then the blocks in reverse, each recomputed from its input.
    let mut grads: Vec<Option<Tensor>> = vec![None; n];
    let head = model.head_loss_backward(&params[n - 1], &pass.x, tied, targets)?;
    let mut g = head.grads.grad_input.ok_or_else(|| missing_grad("head"))?;
    grads[n - 1] = Some(head.grads.grad_params);
    for ((block, x_in), routing) in pass.blocks.iter().zip(&pass.inputs).zip(&pass.routings).rev() {
        match (block, routing, model.moe()) {
            (BlockUnits::Moe { block, trunk, experts }, Some(routing), Some(moe)) => {
                let t = moe.trunk_forward(*block, &params[*trunk], x_in)?;
                let mut grad_inputs = vec![None; experts.len()];
                let mut grad_gates = vec![None; experts.len()];
                for (e, &u) in experts.iter().enumerate() {
                    let (Some(h_e), Some(go)) =
                        (routing.expert_input(e, &t.h)?, moe.expert_grad_output(routing, e, &g)?)
                    else {
                        grads[u] = Some(params[u].zeros_like()?);
                        continue;
                    };
                    let eg = moe.expert_backward(&params[u], &h_e, &go)?;
                    grad_gates[e] = moe.expert_grad_gate(routing, e, &g, &eg.output)?;
                    grad_inputs[e] = Some(eg.grad_input);
                    grads[u] = Some(eg.grad_params);
                }
                let grad_h = routing.scatter_input_grads(&grad_inputs)?;
                let tg = moe.trunk_backward(*block, &params[*trunk], x_in, routing, &g, &grad_h, &grad_gates)?;
                grads[*trunk] = Some(tg.grad_params);
                g = tg.grad_input.ok_or_else(|| missing_grad("trunk"))?;
            }
            (BlockUnits::Dense(u), ..) | (BlockUnits::Moe { trunk: u, .. }, ..) => {
                let ug = model.backward(*u, &params[*u], x_in, &g, None)?;
                grads[*u] = Some(ug.grad_params);
                g = ug.grad_input.ok_or_else(|| missing_grad("block"))?;
            }
        }
    }
    let mut g0 = model.backward(0, &params[0], tokens, &g, None)?.grad_params;
    if let Some(gt) = head.grads.grad_tied_wte {
        g0 = (g0 + gt)?;
    }
    grads[0] = Some(g0);
    let grads = grads.into_iter().map(|g| g.expect("every unit's gradient is set")).collect();
    Ok((LossParts { ce: head.loss, aux: pass.aux }, grads))
}

/// The head's input `[B, T, d]` and every MoE block's routing (finished by
/// [`MoeLm::finish_forward`]), in block order: the forward pass of [`forward_all`].
///
/// # Errors
/// As [`forward_all`].
#[cfg(test)]
pub(crate) fn forward_hidden(
    model: &dyn CausalLm,
    params: &[Tensor],
    tokens: &Tensor,
) -> Result<(Tensor, Vec<Routing>)> {
    let pass = forward_pass(model, params, tokens, false)?;
    Ok((pass.x, pass.routings.into_iter().flatten().collect()))
}

/// One forward pass over the blocks, as a trainer runs it.
struct Pass {
    /// The head's input `[B, T, d]`.
    x: Tensor,
    /// The blocks between the embedding and the head.
    blocks: Vec<BlockUnits>,
    /// Each block's input (when kept).
    inputs: Vec<Tensor>,
    /// Each block's routing (`None` for a dense block), finished.
    routings: Vec<Option<Routing>>,
    /// [`MoeLm::aux_loss`] of the pass's routings; 0 for a dense model.
    aux: f64,
}

/// The embedding and the blocks of `model` on `tokens`, keeping each block's input when `keep`.
fn forward_pass(model: &dyn CausalLm, params: &[Tensor], tokens: &Tensor, keep: bool) -> Result<Pass> {
    let units = model.units();
    let n = units.len();
    if params.len() != n || n < 2 {
        return Err(crate::ops::input_err("number of unit parameter vectors", n.to_string(), params.len().to_string()));
    }
    let blocks = block_layout(units)?;
    let mut x = model.forward(0, &params[0], tokens, None)?;
    let mut inputs = Vec::with_capacity(if keep { blocks.len() } else { 0 });
    let mut routings: Vec<Option<Routing>> = Vec::with_capacity(blocks.len());
    for block in &blocks {
        let y = match (block, model.moe()) {
            (BlockUnits::Moe { block, trunk, experts }, Some(moe)) => {
                let t = moe.trunk_forward(*block, &params[*trunk], &x)?;
                let mut outs = vec![None; experts.len()];
                for (e, (&u, out)) in experts.iter().zip(outs.iter_mut()).enumerate() {
                    if let Some(h_e) = t.routing.expert_input(e, &t.h)? {
                        *out = Some(moe.expert_forward(&params[u], &h_e)?);
                    }
                }
                let y = moe.combine(&t.x1, &t.routing, &outs)?;
                routings.push(Some(t.routing));
                y
            }
            (BlockUnits::Dense(u), _) | (BlockUnits::Moe { trunk: u, .. }, None) => {
                routings.push(None);
                model.forward(*u, &params[*u], &x, None)?
            }
        };
        let x_in = std::mem::replace(&mut x, y);
        if keep {
            inputs.push(x_in);
        }
    }
    let aux = match model.moe() {
        Some(moe) => {
            let mut finished: Vec<&mut Routing> = routings.iter_mut().flatten().collect();
            moe.finish_forward(&mut finished)?;
            moe.aux_loss(&routings.iter().flatten().collect::<Vec<_>>())
        }
        None => 0.0,
    };
    Ok(Pass { x, blocks, inputs, routings, aux })
}

fn missing_grad(what: &str) -> crate::Error {
    crate::ops::input_err("unit gradients", format!("an input gradient from the {what}"), "None".into())
}

/// The units of one block between the embedding and the head.
enum BlockUnits {
    /// A dense block's unit index.
    Dense(usize),
    /// An MoE block: its 0-based index, its trunk's unit index and its experts' unit indices in
    /// expert order.
    Moe { block: usize, trunk: usize, experts: Vec<usize> },
}

/// The blocks of `units` (`[embedding, (block | trunk, experts)*, head]`).
fn block_layout(units: &[UnitSpec]) -> Result<Vec<BlockUnits>> {
    let bad = |u: &UnitSpec| {
        crate::ops::input_err(
            "unit order",
            "[embedding, (block | trunk, its experts)*, head]".into(),
            format!("{:?} at unit {}", u.kind, u.index),
        )
    };
    let n = units.len();
    let mut blocks: Vec<BlockUnits> = Vec::new();
    for (u, spec) in units.iter().enumerate().take(n - 1).skip(1) {
        match spec.kind {
            UnitKind::Block(_) => blocks.push(BlockUnits::Dense(u)),
            UnitKind::MoeTrunk(block) => blocks.push(BlockUnits::Moe { block, trunk: u, experts: Vec::new() }),
            UnitKind::Expert { block, expert } => match blocks.last_mut() {
                Some(BlockUnits::Moe { block: b, experts, .. }) if *b == block && experts.len() == expert => {
                    experts.push(u)
                }
                _ => return Err(bad(spec)),
            },
            UnitKind::Embedding | UnitKind::Head => return Err(bad(spec)),
        }
    }
    Ok(blocks)
}

/// The calls of an MoE block and of a forward pass over MoE blocks, as a trainer runs them
/// ([`loss_parts_and_grads`] is this sequence in memory, for any model):
///
/// ```text
/// per forward pass (a batch, or one micro-batch), blocks i = 0..L, experts e = 0..E:
/// forward : t_i = trunk_forward(i, p_trunk_i, x_i)                      keep x_i and R_i = t_i.routing
///           out_e = expert_forward(p_e, R_i.expert_input(e, t_i.h))      for each e with R_i.is_active(e)
///           x_{i+1} = combine(t_i.x1, &R_i, outs)
/// then    : finish_forward(&mut [&mut R_0, .., &mut R_{L-1}])            once, after the last block
///           aux = aux_loss(&[&R_0, .., &R_{L-1}])                         the objective is CE + aux
/// head    : (ce, g) = head_loss_backward(..)                             (CausalLm)
/// backward: for i = L-1..0:
///           t = trunk_forward(i, p_trunk_i, x_i)                          recompute: only t.h is used
///           for each e with R_i.is_active(e):
///               go = expert_grad_output(&R_i, e, g)
///               ge = expert_backward(p_e, R_i.expert_input(e, t.h), go)   ge.grad_params: expert e's gradient
///               gate_e = expert_grad_gate(&R_i, e, g, ge.output)
///           g_h = R_i.scatter_input_grads(ge.grad_input of each e, None if inactive)
///           g = trunk_backward(i, p_trunk_i, x_i, &R_i, g, g_h, gates).grad_input
/// ```
///
/// - The backward takes the **forward's** routings `R_i` (after [`MoeLm::finish_forward`]),
///   not the recomputed `t.routing`: the recompute yields the same choices and `h` bitwise (the
///   calls are deterministic), but only the forward's routings carry the pooled statistics.
/// - An expert without tokens is not called in either direction; its gradient is zero.
/// - MoE-GPT's load-balancing loss is per block: [`MoeLm::finish_forward`] is a no-op and
///   [`MoeLm::aux_loss`] the sum of [`Routing::aux_loss`]. Mixtral's pools every block's
///   routing (transformers' `load_balancing_loss_func` over all layers' router logits):
///   [`MoeLm::finish_forward`] must run before any of the pass's [`MoeLm::trunk_backward`]
///   (which refuses a routing without [`Routing::aux_weights`]).
/// - With micro-batches, each forward pass (one micro-batch) is finished on its own routings,
///   as transformers computes the loss per forward call.
/// - The expert calls are pure functions of their arguments: a trainer may run them on another
///   candle device (move `h_e` there and the outputs and gradients back).
pub trait MoeLm: Send + Sync {
    /// Experts each token is routed to, `k` (top-k): MoE-GPT `moe.top_k`, Mixtral
    /// `num_experts_per_tok`.
    fn experts_per_token(&self) -> usize;

    /// Forward of block `block`'s trunk: attention, the norm before the experts, the router
    /// and the routing decision.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn trunk_forward(&self, block: usize, params: &Tensor, x: &Tensor) -> Result<TrunkOut>;

    /// Forward of one expert on its rows `h_e` `[n_e, d]` → `[n_e, d]`.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn expert_forward(&self, params: &Tensor, h_e: &Tensor) -> Result<Tensor>;

    /// Backward of one expert by recomputation, with `grad_out_e` `[n_e, d]`.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn expert_backward(&self, params: &Tensor, h_e: &Tensor, grad_out_e: &Tensor) -> Result<crate::ExpertGrads>;

    /// The block output: `x1 + Σ_e scatter(gate_e · out_e)` `[B, T, d]`; the default is
    /// [`Routing::combine`] (so are the next two calls' defaults, the combine's backward).
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn combine(&self, x1: &Tensor, routing: &Routing, expert_outputs: &[Option<Tensor>]) -> Result<Tensor> {
        routing.combine(x1, expert_outputs)
    }

    /// The gradient of expert `e`'s output from the block output's gradient `grad_y`; `None`
    /// when it has no tokens.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn expert_grad_output(&self, routing: &Routing, e: usize, grad_y: &Tensor) -> Result<Option<Tensor>> {
        routing.expert_grad_output(e, grad_y)
    }

    /// The gradient of expert `e`'s gates from `grad_y` and its output; `None` when it has no
    /// tokens.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn expert_grad_gate(&self, routing: &Routing, e: usize, grad_y: &Tensor, out_e: &Tensor) -> Result<Option<Tensor>> {
        routing.expert_grad_gate(e, grad_y, out_e)
    }

    /// Backward of block `block`'s trunk by recomputation, given the gradients of its outputs.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    #[allow(clippy::too_many_arguments)]
    fn trunk_backward(
        &self,
        block: usize,
        params: &Tensor,
        x: &Tensor,
        routing: &Routing,
        grad_y: &Tensor,
        grad_h: &Tensor,
        grad_gates: &[Option<Tensor>],
    ) -> Result<UnitGrads>;

    /// Called once per forward pass, after the last block's forward and before any
    /// [`MoeLm::trunk_backward`] of the pass, with that pass's routings in block order (one per
    /// MoE block): writes into each routing what its trunk's backward needs from the whole pass.
    /// Mixtral: the pooled load-balancing statistics ([`Routing::aux_weights`]) and each block's
    /// share of the pooled loss ([`Routing::aux_loss`]). The default (MoE-GPT) does nothing.
    ///
    /// # Errors
    /// [`crate::Error::Input`] when the routings do not belong to one pass of this model (no
    /// routing, another number of experts or top-k).
    fn finish_forward(&self, routings: &mut [&mut Routing]) -> Result<()> {
        let _ = routings;
        Ok(())
    }

    /// The weighted load-balancing term of the objective over one forward pass's routings (in
    /// block order): what [`LossParts::aux`] reports and what the trunks' backward
    /// differentiates. The default (MoE-GPT) is the sum of [`Routing::aux_loss`]; Mixtral
    /// computes the pooled loss from the routings' counts and probability sums (it does not
    /// need [`MoeLm::finish_forward`] to have run).
    fn aux_loss(&self, routings: &[&Routing]) -> f64 {
        routings.iter().map(|r| r.aux_loss()).sum()
    }
}

// ---- the unit calls, once for every family ----------------------------------------------------

/// What a model family gives the unit calls of [`CausalLm`], which [`unit_calls!`] implements
/// once for every family ([`unit_forward`], [`unit_backward`], [`unit_head_loss`],
/// [`unit_head_loss_backward`]): the views of a unit's flat vector, its embedding, dense block
/// and head, and optionally a loss and backward passes of its own (the fused CPU kernels). The
/// checks (unit index, parameters, token ids, hidden states, targets, the tied embedding) and
/// the recompute-and-VJP backward are the loop's.
pub(crate) trait Family: CausalLm {
    /// Views of unit `unit`'s parameters (or computation groups) into its flat vector, no copy.
    /// The default: one view per [`crate::ParamSpec`].
    fn views(&self, unit: usize, flat: &Tensor) -> Result<Vec<Tensor>> {
        crate::ops::views(&self.units()[unit], flat)
    }

    /// The tied head's argument name and the config key that ties it, for its errors.
    fn tie_names(&self) -> (&'static str, &'static str);

    /// Embedding: token ids `[B, T]` (checked) → `[B, T, d]`, from the embedding's views.
    fn embed(&self, p: &[Tensor], tokens: &Tensor) -> Result<Tensor>;

    /// The embedding's flat gradient for half dtypes, accumulated in F32: `grad_wte` `[V, d]` is
    /// the scatter-add of the rows' gradients ([`crate::ops::embedding_grad`]); a family with
    /// more parameters in its embedding unit appends theirs (the GPT's `wpe`). `grad_output`
    /// is `[B, T, d]`, checked.
    fn embed_backward_wide(&self, tokens: &Tensor, grad_output: &Tensor, grad_wte: Tensor) -> Result<Tensor> {
        let _ = (tokens, grad_output);
        Ok(grad_wte.flatten_all()?)
    }

    /// A dense block: `[B, T, d]` (checked) → `[B, T, d]`.
    fn block(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor>;

    /// The head: `[B, T, d]` (checked) → logits `[B, T, V]`; `tied` is the embedding's `[V, d]`
    /// ([`tied_view`]) when the head is tied.
    fn head(&self, p: &[Tensor], tied: Option<&Tensor>, x: &Tensor) -> Result<Tensor>;

    /// The mean cross-entropy of `logits` `[B, T, V]` over the `count` targets that are not
    /// ignored (checked), as a scalar tensor. The default: the op composition, in F32 for half
    /// dtypes (transformers upcasts the logits).
    fn loss(&self, logits: &Tensor, targets: &Tensor, count: usize) -> Result<Tensor> {
        let _ = count;
        crate::kernels::cross_entropy_composed(&crate::ops::widen(logits)?, targets)
    }

    /// A dense block's backward of the family's own (a hand-written fused CPU backward) when it
    /// has one for `x`; `None`: the loop recomputes the block under autograd. Arguments checked.
    fn own_block_backward(
        &self,
        unit: usize,
        params: &Tensor,
        x: &Tensor,
        grad_y: &Tensor,
    ) -> Result<Option<UnitGrads>> {
        let _ = (unit, params, x, grad_y);
        Ok(None)
    }

    /// The head's training backward of the family's own (fused CPU kernels) when it has one for
    /// `x`; `None`: the loop's autograd. `params` and `x` checked, `targets` not.
    fn own_head_loss_backward(
        &self,
        params: &Tensor,
        x: &Tensor,
        tied: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<Option<HeadLossGrads>> {
        let _ = (params, x, tied, targets);
        Ok(None)
    }
}

/// Hidden states `[B, 1 <= T <= max_seq_len, hidden]` in `dtype`.
pub(crate) fn check_hidden(
    model: &(impl CausalLm + ?Sized),
    x: &Tensor,
    dtype: DType,
    what: &'static str,
) -> Result<()> {
    crate::ops::check_hidden(x, dtype, model.dims().hidden, model.max_seq_len(), what)
}

/// Token ids `[B, T <= max_seq_len]` U32 below `vocab_size`.
fn check_tokens(model: &(impl CausalLm + ?Sized), tokens: &Tensor) -> Result<()> {
    crate::ops::check_ids(tokens, model.vocab_size(), model.max_seq_len(), "embedding input")
}

/// Targets `[B, T]` like the logits' first dims; returns the number of counted positions.
fn check_targets(model: &(impl CausalLm + ?Sized), targets: &Tensor, logits: &Tensor) -> Result<usize> {
    crate::ops::check_targets(targets, &logits.dims()[..2], model.vocab_size())
}

/// `grad` has the output's shape `want`.
fn check_grad_shape(want: &[usize], grad: &Tensor) -> Result<()> {
    if want != grad.dims() {
        return Err(crate::ops::input_err("grad_output shape", format!("{want:?}"), format!("{:?}", grad.dims())));
    }
    Ok(())
}

/// The embedding `[V, d]` a tied head reads, as a view of the embedding unit's flat vector
/// `tied` (checked: present, its shape, the head params' `dtype`); `None` when the head is not
/// tied.
pub(crate) fn tied_view<F: Family>(f: &F, tied: Option<&Tensor>, dtype: DType) -> Result<Option<Tensor>> {
    if !f.tied_head() {
        return Ok(None);
    }
    let (what, key) = f.tie_names();
    let flat = crate::ops::tied_flat(tied, &f.units()[0], dtype, what, key)?;
    let (v, d) = (f.vocab_size(), f.dims().hidden);
    Ok(Some(flat.narrow(0, 0, v * d)?.reshape((v, d))?))
}

/// The error of a dense unit call on an MoE unit.
fn moe_unit_err(spec: &UnitSpec) -> crate::Error {
    crate::ops::input_err(
        "unit kind",
        "the embedding, a dense block or the head (MoE units: MoeLm's trunk and expert calls)".into(),
        format!("{:?} (unit {})", spec.kind, spec.name),
    )
}

/// [`CausalLm::forward`] of a family.
pub(crate) fn unit_forward<F: Family>(
    f: &F,
    unit: usize,
    params: &Tensor,
    input: &Tensor,
    tied: Option<&Tensor>,
) -> Result<Tensor> {
    let spec = crate::ops::unit_spec(f.units(), unit)?;
    crate::ops::check_params(spec, params)?;
    let p = f.views(unit, params)?;
    match spec.kind {
        UnitKind::Embedding => {
            check_tokens(f, input)?;
            f.embed(&p, input)
        }
        UnitKind::Block(_) => {
            check_hidden(f, input, params.dtype(), "block input")?;
            f.block(&p, input)
        }
        UnitKind::Head => {
            check_hidden(f, input, params.dtype(), "head input")?;
            let w = tied_view(f, tied, params.dtype())?;
            f.head(&p, w.as_ref(), input)
        }
        UnitKind::MoeTrunk(_) | UnitKind::Expert { .. } => Err(moe_unit_err(spec)),
    }
}

/// [`CausalLm::backward`] of a family: the family's own backward where it has one, else the
/// unit recomputed from `input` with its parameters (and input, and a tied head's embedding) as
/// candle `Var`s, and the vector-Jacobian product with `grad_output`.
pub(crate) fn unit_backward<F: Family>(
    f: &F,
    unit: usize,
    params: &Tensor,
    input: &Tensor,
    grad_output: &Tensor,
    tied: Option<&Tensor>,
) -> Result<UnitGrads> {
    let spec = crate::ops::unit_spec(f.units(), unit)?;
    crate::ops::check_params(spec, params)?;
    let dtype = params.dtype();
    if grad_output.dtype() != dtype {
        return Err(crate::ops::input_err(
            "grad_output dtype",
            format!("{dtype:?}"),
            format!("{:?}", grad_output.dtype()),
        ));
    }
    match spec.kind {
        UnitKind::Block(_) => {
            check_hidden(f, input, dtype, "block input")?;
            check_grad_shape(input.dims(), grad_output)?;
            if let Some(g) = f.own_block_backward(unit, params, input, grad_output)? {
                return Ok(g);
            }
        }
        UnitKind::Embedding if crate::ops::is_half(dtype) => {
            // The scatter-add of the rows' gradients in F32 (candle's `index_select` backward
            // would accumulate in the half dtype).
            check_tokens(f, input)?;
            let (b, t) = input.dims2()?;
            let d = f.dims().hidden;
            check_grad_shape(&[b, t, d], grad_output)?;
            let ids = input.flatten_all()?;
            let wte = crate::ops::embedding_grad(&ids, &grad_output.reshape((b * t, d))?, f.vocab_size())?;
            let grad_params = f.embed_backward_wide(input, grad_output, wte)?;
            return Ok(UnitGrads { grad_params, grad_input: None, grad_tied_wte: None });
        }
        _ => {}
    }
    let vars = vars(f, unit, params)?;
    let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (out, x_var, tied_var) = match spec.kind {
        UnitKind::Embedding => {
            check_tokens(f, input)?;
            (f.embed(&p, input)?, None, None)
        }
        UnitKind::Block(_) => {
            let x = Var::from_tensor(input)?;
            (f.block(&p, x.as_tensor())?, Some(x), None)
        }
        UnitKind::Head => {
            check_hidden(f, input, dtype, "head input")?;
            let x = Var::from_tensor(input)?;
            let w = tied_var(f, tied, dtype)?;
            (f.head(&p, w.as_ref().map(Var::as_tensor), x.as_tensor())?, Some(x), w)
        }
        UnitKind::MoeTrunk(_) | UnitKind::Expert { .. } => return Err(moe_unit_err(spec)),
    };
    check_grad_shape(out.dims(), grad_output)?;
    let grads = (out * grad_output)?.sum_all()?.backward()?;
    crate::ops::collect_grads(&vars, x_var.as_ref(), tied_var.as_ref(), &grads, f.units()[0].numel)
}

/// [`CausalLm::head_loss`] of a family.
pub(crate) fn unit_head_loss<F: Family>(
    f: &F,
    params: &Tensor,
    input: &Tensor,
    tied: Option<&Tensor>,
    targets: &Tensor,
) -> Result<f64> {
    let logits = unit_forward(f, f.units().len() - 1, params, input, tied)?;
    let count = check_targets(f, targets, &logits)?;
    crate::ops::scalar(&f.loss(&logits, targets, count)?)
}

/// [`CausalLm::head_loss_backward`] of a family: its own where it has one, else the head and
/// its loss recomputed under autograd.
pub(crate) fn unit_head_loss_backward<F: Family>(
    f: &F,
    params: &Tensor,
    input: &Tensor,
    tied: Option<&Tensor>,
    targets: &Tensor,
) -> Result<HeadLossGrads> {
    let unit = f.units().len() - 1;
    crate::ops::check_params(&f.units()[unit], params)?;
    let dtype = params.dtype();
    check_hidden(f, input, dtype, "head input")?;
    if let Some(g) = f.own_head_loss_backward(params, input, tied, targets)? {
        return Ok(g);
    }
    let vars = vars(f, unit, params)?;
    let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let x = Var::from_tensor(input)?;
    let w = tied_var(f, tied, dtype)?;
    let logits = f.head(&p, w.as_ref().map(Var::as_tensor), x.as_tensor())?;
    let tokens = check_targets(f, targets, &logits)?;
    let loss = f.loss(&logits, targets, tokens)?;
    let grads = loss.backward()?;
    let grads = crate::ops::collect_grads(&vars, Some(&x), w.as_ref(), &grads, f.units()[0].numel)?;
    Ok(HeadLossGrads { loss: crate::ops::scalar(&loss)?, tokens, grads })
}

/// One `Var` per view of unit `unit`, copied out of the flat vector (one pass over the unit's
/// bytes).
///
/// Separate leaves rather than one flat `Var` with narrowed views: candle's backward of `narrow`
/// pads each parameter's gradient to the full flat length and adds it, which costs a pass over
/// the whole unit per parameter; here the flat gradient is one `cat`.
fn vars<F: Family>(f: &F, unit: usize, flat: &Tensor) -> Result<Vec<Var>> {
    f.views(unit, flat)?.iter().map(|v| Ok(Var::from_tensor(v)?)).collect()
}

/// [`tied_view`] as a `Var`.
fn tied_var<F: Family>(f: &F, tied: Option<&Tensor>, dtype: DType) -> Result<Option<Var>> {
    Ok(match tied_view(f, tied, dtype)? {
        Some(w) => Some(Var::from_tensor(&w)?),
        None => None,
    })
}

/// The unit calls of [`CausalLm`] (`forward`, `backward`, `head_loss`, `head_loss_backward`)
/// for a type that implements [`Family`]: written inside its `impl CausalLm`.
macro_rules! unit_calls {
    () => {
        fn forward(
            &self,
            unit: usize,
            params: &candle_core::Tensor,
            input: &candle_core::Tensor,
            tied: Option<&candle_core::Tensor>,
        ) -> crate::Result<candle_core::Tensor> {
            crate::lm::unit_forward(self, unit, params, input, tied)
        }

        fn backward(
            &self,
            unit: usize,
            params: &candle_core::Tensor,
            input: &candle_core::Tensor,
            grad_output: &candle_core::Tensor,
            tied: Option<&candle_core::Tensor>,
        ) -> crate::Result<crate::UnitGrads> {
            crate::lm::unit_backward(self, unit, params, input, grad_output, tied)
        }

        fn head_loss(
            &self,
            params: &candle_core::Tensor,
            input: &candle_core::Tensor,
            tied: Option<&candle_core::Tensor>,
            targets: &candle_core::Tensor,
        ) -> crate::Result<f64> {
            crate::lm::unit_head_loss(self, params, input, tied, targets)
        }

        fn head_loss_backward(
            &self,
            params: &candle_core::Tensor,
            input: &candle_core::Tensor,
            tied: Option<&candle_core::Tensor>,
            targets: &candle_core::Tensor,
        ) -> crate::Result<crate::HeadLossGrads> {
            crate::lm::unit_head_loss_backward(self, params, input, tied, targets)
        }
    };
}
pub(crate) use unit_calls;

// ---- the MoE calls, once for every MoE family -------------------------------------------------

/// What an MoE family gives the calls of [`MoeLm`], which [`moe_calls!`] implements once
/// ([`trunk_forward`], [`expert_forward`], [`expert_backward`], [`trunk_backward`]): where its
/// units are, its trunk, router and expert, and the parts of the objective its trunk's backward
/// differentiates (the gates, the load-balancing term).
pub(crate) trait MoeFamily: Family + MoeLm {
    /// Experts per MoE block, `E`.
    fn num_experts(&self) -> usize;

    /// Block `block`'s trunk unit.
    ///
    /// # Errors
    /// [`crate::Error::Input`] on a model without MoE blocks or a block index out of range.
    fn trunk_unit(&self, block: usize) -> Result<usize>;

    /// Expert 0 of block 0's unit (every expert has its layout).
    ///
    /// # Errors
    /// [`crate::Error::Input`] on a model without MoE blocks.
    fn expert_unit0(&self) -> Result<usize>;

    /// The trunk on its views: `(x1 [B, T, d], h [N, d], logits [N, E], probs [N, E])`, `probs`
    /// in F32 for half dtypes.
    fn trunk_math(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)>;

    /// The routing of `probs` `[N, E]`, gates in `dtype` (the params').
    fn route(&self, probs: &Tensor, dtype: DType) -> Result<Routing>;

    /// One expert on its views and rows `[n_e, d]` → `[n_e, d]`.
    fn expert_math(&self, p: &[Tensor], h: &Tensor) -> Result<Tensor>;

    /// The gates of every (token, slot), `[N · k]`, differentiable in `probs` for fixed
    /// `choices` `[N, k]`.
    fn gate_values(&self, probs: &Tensor, choices: &Tensor, top_k: usize) -> Result<Tensor>;

    /// What the trunk's backward needs of `routing` beyond its shape (Mixtral: the pooled
    /// load-balancing weights of [`MoeLm::finish_forward`]).
    ///
    /// # Errors
    /// [`crate::Error::Input`] when it is missing.
    fn check_finished(&self, routing: &Routing) -> Result<()> {
        let _ = routing;
        Ok(())
    }

    /// The load-balancing term of the objective through this block's `probs` (a scalar in
    /// `probs`' dtype), `None` when the objective has none.
    fn aux_term(&self, probs: &Tensor, routing: &Routing) -> Result<Option<Tensor>>;
}

/// Expert rows `[n_e, hidden]` in `dtype`.
fn check_expert_rows(model: &(impl CausalLm + ?Sized), h: &Tensor, dtype: DType, what: &'static str) -> Result<()> {
    let d = model.dims().hidden;
    if !matches!(h.dims(), &[_, w] if w == d) || h.dtype() != dtype {
        return Err(crate::ops::input_err(
            what,
            format!("{dtype:?} [n_e, {d}]"),
            format!("{:?} {:?}", h.dtype(), h.dims()),
        ));
    }
    Ok(())
}

/// [`MoeLm::trunk_forward`] of a family.
pub(crate) fn trunk_forward<F: MoeFamily>(f: &F, block: usize, params: &Tensor, x: &Tensor) -> Result<TrunkOut> {
    let unit = f.trunk_unit(block)?;
    crate::ops::check_params(&f.units()[unit], params)?;
    check_hidden(f, x, params.dtype(), "MoE trunk input")?;
    let p = f.views(unit, params)?;
    let (x1, h, logits, probs) = f.trunk_math(&p, x)?;
    let routing = f.route(&probs, params.dtype())?;
    Ok(TrunkOut { x1, h, logits, probs, routing })
}

/// [`MoeLm::expert_forward`] of a family: `n_e = 0` gives `[0, d]` without computing.
pub(crate) fn expert_forward<F: MoeFamily>(f: &F, params: &Tensor, h_e: &Tensor) -> Result<Tensor> {
    let unit = f.expert_unit0()?;
    crate::ops::check_params(&f.units()[unit], params)?;
    check_expert_rows(f, h_e, params.dtype(), "expert input")?;
    if h_e.dim(0)? == 0 {
        return Ok(h_e.clone());
    }
    f.expert_math(&f.views(unit, params)?, h_e)
}

/// [`MoeLm::expert_backward`] of a family, by recomputation under autograd; `n_e = 0` gives
/// zero gradients.
pub(crate) fn expert_backward<F: MoeFamily>(
    f: &F,
    params: &Tensor,
    h_e: &Tensor,
    grad_out_e: &Tensor,
) -> Result<crate::ExpertGrads> {
    let unit = f.expert_unit0()?;
    crate::ops::check_params(&f.units()[unit], params)?;
    check_expert_rows(f, h_e, params.dtype(), "expert input")?;
    if let Some(empty) = crate::moe::expert_backward_trivial(params, h_e, grad_out_e)? {
        return Ok(empty);
    }
    let vars = vars(f, unit, params)?;
    let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let x = Var::from_tensor(h_e)?;
    let out = f.expert_math(&p, x.as_tensor())?;
    let grads = (&out * grad_out_e)?.sum_all()?.backward()?;
    let g = crate::ops::collect_grads(&vars, Some(&x), None, &grads, f.units()[0].numel)?;
    Ok(crate::ExpertGrads {
        grad_params: g.grad_params,
        grad_input: g.grad_input.expect("the expert's input is a Var"),
        output: out.detach(),
    })
}

/// [`MoeLm::trunk_backward`] of a family: the trunk recomputed from `x` under autograd, the VJP
/// of `(x1, h, gates)` with `grad_y` (through the residual), `grad_h` and `grad_gates`, plus the
/// family's load-balancing term; the top-k choices are `routing`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn trunk_backward<F: MoeFamily>(
    f: &F,
    block: usize,
    params: &Tensor,
    x: &Tensor,
    routing: &Routing,
    grad_y: &Tensor,
    grad_h: &Tensor,
    grad_gates: &[Option<Tensor>],
) -> Result<UnitGrads> {
    let unit = f.trunk_unit(block)?;
    crate::ops::check_params(&f.units()[unit], params)?;
    let dtype = params.dtype();
    check_hidden(f, x, dtype, "MoE trunk input")?;
    let (e, k) = (f.num_experts(), f.experts_per_token());
    if routing.num_experts() != e || routing.top_k() != k {
        return Err(crate::ops::input_err(
            "routing",
            format!("a routing of this model ({e} experts, top-{k})"),
            format!("{} experts, top-{}", routing.num_experts(), routing.top_k()),
        ));
    }
    let (b, t, _) = x.dims3()?;
    if routing.num_tokens != b * t || routing.dtype != dtype {
        return Err(crate::ops::input_err(
            "routing",
            format!("the routing of this call ({} tokens, {dtype:?})", b * t),
            format!("{} tokens, {:?}", routing.num_tokens, routing.dtype),
        ));
    }
    f.check_finished(routing)?;
    routing.check_x1(grad_y, "grad_y")?;
    routing.check_rows(grad_h, "grad_h")?;
    let (slot_idx, gate_grads) = routing.gate_grad_rows(grad_gates)?;

    let vars = vars(f, unit, params)?;
    let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let xv = Var::from_tensor(x)?;
    let (x1, h, _, probs) = f.trunk_math(&p, xv.as_tensor())?;
    let mut obj = ((&x1 * grad_y)?.sum_all()? + (&h * grad_h)?.sum_all()?)?;
    if !slot_idx.is_empty() {
        let n_slots = routing.num_tokens * routing.top_k;
        let g = Tensor::zeros(n_slots, dtype, x.device())?.index_add(
            &Tensor::cat(&slot_idx, 0)?,
            &Tensor::cat(&gate_grads, 0)?,
            0,
        )?;
        let gates = f.gate_values(&probs, &routing.choices_t, routing.top_k)?.to_dtype(dtype)?;
        obj = (obj + (gates * g)?.sum_all()?.to_dtype(dtype)?)?;
    }
    if let Some(term) = f.aux_term(&probs, routing)? {
        obj = (obj + term.to_dtype(dtype)?)?;
    }
    let grads = obj.backward()?;
    crate::ops::collect_grads(&vars, Some(&xv), None, &grads, f.units()[0].numel)
}

/// The unit calls of [`MoeLm`] (`trunk_forward`, `expert_forward`, `expert_backward`,
/// `trunk_backward`) for a type that implements [`MoeFamily`]: written inside its `impl MoeLm`.
macro_rules! moe_calls {
    () => {
        fn trunk_forward(
            &self,
            block: usize,
            params: &candle_core::Tensor,
            x: &candle_core::Tensor,
        ) -> crate::Result<crate::TrunkOut> {
            crate::lm::trunk_forward(self, block, params, x)
        }

        fn expert_forward(
            &self,
            params: &candle_core::Tensor,
            h_e: &candle_core::Tensor,
        ) -> crate::Result<candle_core::Tensor> {
            crate::lm::expert_forward(self, params, h_e)
        }

        fn expert_backward(
            &self,
            params: &candle_core::Tensor,
            h_e: &candle_core::Tensor,
            grad_out_e: &candle_core::Tensor,
        ) -> crate::Result<crate::ExpertGrads> {
            crate::lm::expert_backward(self, params, h_e, grad_out_e)
        }

        fn trunk_backward(
            &self,
            block: usize,
            params: &candle_core::Tensor,
            x: &candle_core::Tensor,
            routing: &crate::Routing,
            grad_y: &candle_core::Tensor,
            grad_h: &candle_core::Tensor,
            grad_gates: &[Option<candle_core::Tensor>],
        ) -> crate::Result<crate::UnitGrads> {
            crate::lm::trunk_backward(self, block, params, x, routing, grad_y, grad_h, grad_gates)
        }
    };
}
pub(crate) use moe_calls;
