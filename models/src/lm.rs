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
//! (see [`MoeLm`]).

use candle_core::Tensor;

use crate::unit::UnitSpec;
use crate::{Result, Routing, TrunkOut};

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
    /// Mean cross-entropy over the `B * T` positions, in nats, computed in the params' dtype.
    pub loss: f64,
    /// Gradients of the head unit (see [`UnitGrads`]); `grad_input` is always `Some`.
    pub grads: UnitGrads,
}

/// A causal language model cut into units, computed one unit at a time.
///
/// Units are in forward order: unit 0 is the token embedding, the last unit the final norm and
/// LM head ([`crate::UnitKind`]); in between, one unit per block (or, with MoE, a trunk unit
/// followed by its expert units). Every call takes the unit's flat parameters (a 1-D tensor of
/// [`UnitSpec::numel`] elements, any candle device, a float dtype) and computes in that dtype;
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
    /// (`[B, T]` U32), without gradients (validation).
    ///
    /// # Errors
    /// As [`CausalLm::forward`]; bad targets.
    fn head_loss(&self, params: &Tensor, input: &Tensor, tied: Option<&Tensor>, targets: &Tensor) -> Result<f64>;

    /// The head's training backward (the forward→backward turn): recomputes the head from its
    /// input, returns the mean cross-entropy against `targets` and the gradients of the head's
    /// parameters, of its input, and (tied) of the embedding's flat vector.
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

    /// The MoE calls when the model's blocks are experts behind a router; `None` for a dense
    /// model.
    fn moe(&self) -> Option<&dyn MoeLm> {
        None
    }
}

/// The calls of an MoE block, as a trainer runs them (see [`crate::Gpt::loss_parts_and_grads`]
/// for the whole sequence in memory):
///
/// ```text
/// forward : t = trunk_forward(i, p_trunk, x)                       route the tokens
///           out_e = expert_forward(p_e, t.routing.expert_input(e, t.h))   for each routed e
///           y = combine(t.x1, t.routing, outs)
/// backward: t = trunk_forward(i, p_trunk, x)                       recompute
///           for each routed e: g_e = expert_backward(p_e, h_e, expert_grad_output(routing, e, g_y))
///                              gate_e = expert_grad_gate(routing, e, g_y, g_e.output)
///           g_h = routing.scatter_input_grads(grad inputs)
///           trunk_backward(i, p_trunk, x, routing, g_y, g_h, gates)
/// ```
pub trait MoeLm: Send + Sync {
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

    /// The block output: `x1 + Σ_e scatter(gate_e · out_e)` `[B, T, d]`.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn combine(&self, x1: &Tensor, routing: &Routing, expert_outputs: &[Option<Tensor>]) -> Result<Tensor>;

    /// The gradient of expert `e`'s output from the block output's gradient `grad_y`; `None`
    /// when it has no tokens.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn expert_grad_output(&self, routing: &Routing, e: usize, grad_y: &Tensor) -> Result<Option<Tensor>>;

    /// The gradient of expert `e`'s gates from `grad_y` and its output; `None` when it has no
    /// tokens.
    ///
    /// # Errors
    /// Bad shapes or dtypes; candle failures.
    fn expert_grad_gate(&self, routing: &Routing, e: usize, grad_y: &Tensor, out_e: &Tensor) -> Result<Option<Tensor>>;

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
}
