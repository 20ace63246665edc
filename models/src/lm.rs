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
//! loop, in memory, for any [`CausalLm`], dense or MoE ([`loss_and_grads`]: its total).
//!
//! # Targets and the ignore index
//!
//! Targets are `[B, T]` U32, already shifted (`targets[b, t]` is the token after
//! `tokens[b, t]`). A position whose target is [`IGNORE_INDEX`] (`u32::MAX`, transformers'
//! `-100`) is left out of the loss: the cross-entropy is the mean over the counted positions
//! only ([`TokenLoss`] gives the sum and the count, so losses of several batches can be pooled
//! per token).

use candle_core::{DType, Tensor};

use crate::attention::{AttentionBytes, AttentionShape};
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

    /// Whether the unit calls run fused CPU kernels where they apply (`Device::Cpu`, F32 or
    /// F64). `false` for a model built with `composed_only()` ([`crate::Gpt::composed_only`],
    /// [`crate::Llama::composed_only`]): it computes with the candle op compositions only, the
    /// op sequence a CUDA device runs (half dtypes always take it). A trainer that asked for
    /// the composed path can check here that it got it. The default is `false` (a model
    /// without fused kernels).
    fn fused_cpu_kernels(&self) -> bool {
        false
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
    /// device runs), with the query blocks they use ([`crate::Llama::with_attention_chunk`],
    /// [`crate::Gpt::with_attention_chunk`]). The default: multi-head attention over
    /// [`Dims::heads`] heads of `hidden / heads`, the whole sequence as one block (the eager
    /// attention of a model that does not say).
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
    if model.moe().is_some() {
        let (parts, grads) = loss_parts_and_grads(model, params, tokens, targets)?;
        return Ok((parts.total(), grads));
    }
    dense_loss_and_grads(model, params, tokens, targets)
}

/// [`loss_and_grads`] of a dense model.
fn dense_loss_and_grads(
    model: &dyn CausalLm,
    params: &[Tensor],
    tokens: &Tensor,
    targets: &Tensor,
) -> Result<(f64, Vec<Tensor>)> {
    let units = model.units();
    let n = units.len();
    if params.len() != n || n < 2 {
        return Err(crate::ops::input_err("number of unit parameter vectors", n.to_string(), params.len().to_string()));
    }
    let tied = model.tied_head().then(|| &params[0]);
    // checkpoints[u] = output of unit u = input of unit u + 1, u in 0..n-1.
    let mut checkpoints: Vec<Tensor> = Vec::with_capacity(n - 1);
    let mut x = model.forward(0, &params[0], tokens, None)?;
    for (u, p) in params.iter().enumerate().take(n - 1).skip(1) {
        let y = model.forward(u, p, &x, None)?;
        checkpoints.push(std::mem::replace(&mut x, y));
    }
    checkpoints.push(x);

    let mut grads: Vec<Option<Tensor>> = vec![None; n];
    let head = model.head_loss_backward(&params[n - 1], &checkpoints[n - 2], tied, targets)?;
    let mut g = head
        .grads
        .grad_input
        .ok_or_else(|| crate::ops::input_err("head gradients", "an input gradient".into(), "None".into()))?;
    grads[n - 1] = Some(head.grads.grad_params);
    for u in (1..n - 1).rev() {
        let ug = model.backward(u, &params[u], &checkpoints[u - 1], &g, None)?;
        grads[u] = Some(ug.grad_params);
        g = ug
            .grad_input
            .ok_or_else(|| crate::ops::input_err("block gradients", "an input gradient".into(), "None".into()))?;
    }
    let mut g0 = model.backward(0, &params[0], tokens, &g, None)?.grad_params;
    if let Some(gt) = head.grads.grad_tied_wte {
        g0 = (g0 + gt)?;
    }
    grads[0] = Some(g0);
    Ok((head.loss, grads.into_iter().map(|g| g.expect("every unit's gradient is set")).collect()))
}

/// The MoE side of [`loss_and_grads`]: the objective in its two parts ([`LossParts`]: the
/// cross-entropy and the weighted load-balancing term) and its gradient, one flat vector per
/// unit, in unit order — for any [`CausalLm`], dense (`aux = 0`, the dense loop of
/// [`loss_and_grads`]) or MoE. An MoE block runs exactly the calls, in the order, that
/// [`MoeLm`]'s docs prescribe for a trainer, experts in index order; an expert without tokens
/// is not called and its gradient is zero.
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
    let Some(moe) = model.moe() else {
        let (ce, grads) = dense_loss_and_grads(model, params, tokens, targets)?;
        return Ok((LossParts { ce, aux: 0.0 }, grads));
    };
    let units = model.units();
    let n = units.len();
    if params.len() != n || n < 2 {
        return Err(crate::ops::input_err("number of unit parameter vectors", n.to_string(), params.len().to_string()));
    }
    let blocks = block_layout(units)?;
    let tied = model.tied_head().then(|| &params[0]);

    // Forward: keep each block's input and (MoE) routing.
    let mut x = model.forward(0, &params[0], tokens, None)?;
    let mut inputs = Vec::with_capacity(blocks.len());
    let mut routings: Vec<Option<Routing>> = Vec::with_capacity(blocks.len());
    for block in &blocks {
        let y = match block {
            BlockUnits::Dense(u) => {
                routings.push(None);
                model.forward(*u, &params[*u], &x, None)?
            }
            BlockUnits::Moe { block, trunk, experts } => {
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
        };
        inputs.push(std::mem::replace(&mut x, y));
    }
    let mut finished: Vec<&mut Routing> = routings.iter_mut().flatten().collect();
    moe.finish_forward(&mut finished)?;
    let aux = moe.aux_loss(&routings.iter().flatten().collect::<Vec<_>>());

    // The head, then the blocks in reverse, each recomputed from its input.
    let mut grads: Vec<Option<Tensor>> = vec![None; n];
    let head = model.head_loss_backward(&params[n - 1], &x, tied, targets)?;
    let mut g = head.grads.grad_input.ok_or_else(|| missing_grad("head"))?;
    grads[n - 1] = Some(head.grads.grad_params);
    for ((block, x_in), routing) in blocks.iter().zip(&inputs).zip(&routings).rev() {
        match (block, routing) {
            (BlockUnits::Moe { block, trunk, experts }, Some(routing)) => {
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
            (BlockUnits::Dense(u), _) | (BlockUnits::Moe { trunk: u, .. }, None) => {
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
    Ok((LossParts { ce: head.loss, aux }, grads))
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
