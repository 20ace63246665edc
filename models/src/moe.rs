//! What the MoE families share: the routing of one block call ([`Routing`]: per expert the
//! tokens it takes and their gates, the top-k choices, the load-balancing statistics), the
//! trunk's output ([`TrunkOut`]), an expert's gradients ([`ExpertGrads`]), the combine of the
//! experts' outputs into the block output and its backward ([`Routing::combine`],
//! [`Routing::expert_grad_output`], [`Routing::expert_grad_gate`],
//! [`Routing::scatter_input_grads`]), and the two parts of the objective ([`LossParts`]).
//!
//! | family | router | gates | load-balancing loss |
//! |---|---|---|---|
//! | MoE-GPT ([`crate::MoeConfig`]) | `softmax(h W_r + b_r)` | top-1: `p`; top-2: `p` renormalized over the pair; capacity | per block, [`Routing::aux_loss`] |
//! | Mixtral ([`crate::MixtralConfig`]) | `softmax(h W_rᵀ)` (no bias) | top-k `p` renormalized to sum to 1; no capacity | pooled over every block of a forward pass, after [`MoeLm::finish_forward`](crate::MoeLm::finish_forward) |
//! | Qwen3-MoE, OLMoE, Qwen2-MoE ([`crate::LlamaConfig`]) | as Mixtral | top-k `p`, renormalized iff `norm_topk_prob`; no capacity | as Mixtral |
//!
//! A [`Routing`] is computed on the CPU from the router's probabilities by the trunk's forward
//! ([`MoeLm::trunk_forward`](crate::MoeLm::trunk_forward)); its tensors (indices, gates) live on the trunk's device. The
//! calls a trainer makes with it are in [`MoeLm`](crate::MoeLm)'s docs.

use candle_core::{DType, Device, Tensor};

use crate::ops::input_err;
use crate::Result;

/// The loss of the whole model in its two parts; the model minimizes [`LossParts::total`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossParts {
    /// Mean cross-entropy over the positions whose target is not [`crate::IGNORE_INDEX`], nats.
    pub ce: f64,
    /// The load-balancing term, dimensionless and already weighted ([`MoeLm::aux_loss`](crate::MoeLm::aux_loss)):
    /// MoE-GPT the sum over blocks of [`Routing::aux_loss`] (`aux_loss_coef` each); Mixtral
    /// `router_aux_loss_coef ×` the loss pooled over every block (0 unless
    /// `output_router_logits`); 0 for a dense model.
    pub aux: f64,
}

impl LossParts {
    /// `ce + aux`: the objective whose gradient [`crate::lm::loss_parts_and_grads`] returns.
    pub fn total(&self) -> f64 {
        self.ce + self.aux
    }
}

/// Output of [`MoeLm::trunk_forward`](crate::MoeLm::trunk_forward) (MoE-GPT: [`crate::Gpt`]; Mixtral:
/// [`crate::Mixtral`]).
#[derive(Debug, Clone)]
pub struct TrunkOut {
    /// `x + attn(norm_1(x))`, `[B, T, d]`: the residual stream the experts' outputs are added to
    /// (MoE-GPT: `ln_1`; Mixtral: `input_layernorm`).
    pub x1: Tensor,
    /// `norm_2(x1)` flattened, `[N, d]` (`N = B · T`, row `b · T + t`): the experts' input rows
    /// (MoE-GPT: `ln_2`; Mixtral: `post_attention_layernorm`).
    pub h: Tensor,
    /// Router logits before the softmax, `[N, E]` (MoE-GPT `h W_r + b_r`; Mixtral `h W_rᵀ`,
    /// transformers' `router_logits`), the params' dtype.
    pub logits: Tensor,
    /// Router probabilities `softmax(logits)`, `[N, E]`: in F32 for half params (BF16, F16), as
    /// transformers' `softmax(.., dtype=torch.float)`; in the params' dtype for F32 and F64.
    pub probs: Tensor,
    /// Which tokens go to which expert, with gates; computed on the CPU from `probs`.
    pub routing: Routing,
}

/// Output of [`MoeLm::expert_backward`](crate::MoeLm::expert_backward).
#[derive(Debug, Clone)]
pub struct ExpertGrads {
    /// Gradient of the expert's flat parameters, 1-D, the expert unit's `numel` elements.
    pub grad_params: Tensor,
    /// Gradient of the expert's input rows `h_e`, `[n_e, d]`.
    pub grad_input: Tensor,
    /// The expert's output `[n_e, d]`, recomputed on the way (equal to [`MoeLm::expert_forward`](crate::MoeLm::expert_forward)'s,
    /// bitwise): a trainer that did not keep the forward's output can take it from here for
    /// [`MoeLm::expert_grad_gate`](crate::MoeLm::expert_grad_gate).
    pub output: Tensor,
}

/// Output of [`Routing::combine_backward`]: per expert (`None` for an expert without tokens).
#[derive(Debug, Clone)]
pub struct CombineGrads {
    /// `grad_out_e = gate_e · grad_y[idx_e]`, `[n_e, d]`: the gradient to hand to
    /// [`MoeLm::expert_backward`](crate::MoeLm::expert_backward).
    pub grad_outputs: Vec<Option<Tensor>>,
    /// `grad_gate_e = Σ_d grad_y[idx_e] ⊙ out_e`, `[n_e]`: the gradient of the gates, for
    /// [`MoeLm::trunk_backward`](crate::MoeLm::trunk_backward).
    pub grad_gates: Vec<Option<Tensor>>,
}

/// The tokens one expert takes in one block call.
#[derive(Debug, Clone)]
pub(crate) struct ExpertRoute {
    /// Token rows (`b · T + t`), ascending.
    pub(crate) tokens: Vec<u32>,
    /// `tokens` as a U32 tensor `[n_e]` on the trunk's device; `None` when empty.
    pub(crate) index: Option<Tensor>,
    /// Flat slot of each token, `t · k + slot`, as a U32 tensor `[n_e]`; `None` when empty.
    pub(crate) slots: Option<Tensor>,
    /// Gates `[n_e]`, the params' dtype, the trunk's device; `None` when empty.
    pub(crate) gates: Option<Tensor>,
    /// Tokens that chose this expert (any slot), before capacity.
    pub(crate) demand: usize,
}

/// The routing of one MoE block call over `N = B · T` tokens (rows `b · T + t`): for each expert,
/// the tokens it takes (ascending) and their gates; the top-k choices; capacity, counts and the
/// auxiliary loss. Computed on the CPU from the router probabilities by
/// [`MoeLm::trunk_forward`](crate::MoeLm::trunk_forward); definitions in [`crate::MoeConfig`] (MoE-GPT) and
/// [`crate::MixtralConfig`] (Mixtral).
///
/// The gates are values (no autograd graph); [`MoeLm::trunk_backward`](crate::MoeLm::trunk_backward) recomputes them from
/// the router, with the same top-k choices, to take their gradient.
///
/// Mixtral's load-balancing loss pools every block of a forward pass: its routings get the
/// pooled statistics from [`MoeLm::finish_forward`](crate::MoeLm::finish_forward) ([`Routing::aux_weights`]), which its
/// [`MoeLm::trunk_backward`](crate::MoeLm::trunk_backward) requires.
#[derive(Debug, Clone)]
pub struct Routing {
    pub(crate) num_tokens: usize,
    pub(crate) d_model: usize,
    pub(crate) top_k: usize,
    /// `[N, k]` row-major: chosen experts per token, best first, before capacity.
    pub(crate) choices: Vec<u32>,
    /// `choices` as a U32 tensor `[N, k]` on the trunk's device.
    pub(crate) choices_t: Tensor,
    pub(crate) experts: Vec<ExpertRoute>,
    pub(crate) capacity: Option<usize>,
    pub(crate) top1_fraction: Vec<f64>,
    /// `top1_fraction` as a `[E]` tensor in the probs' dtype and device.
    pub(crate) top1_fraction_t: Tensor,
    pub(crate) mean_prob: Vec<f64>,
    /// `Σ_n p[n, e]` over the block call's `N` rows, f64 sums of the host probabilities, `[E]`.
    pub(crate) prob_sum: Vec<f64>,
    pub(crate) aux_loss: f64,
    /// Pooled load-balancing loss only (Mixtral): the weight of `p[n, e]` in the objective,
    /// `[E]`, set by [`MoeLm::finish_forward`](crate::MoeLm::finish_forward); with it as a tensor in the probs' dtype on the
    /// trunk's device.
    pub(crate) aux_weights: Option<(Vec<f64>, Tensor)>,
    /// The dtype of the gates and of the tensors the block calls take (the params').
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

impl Routing {
    /// Tokens of the block call, `N = B · T`.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Experts of the block, `E`.
    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// Experts per token, `k`.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The experts chosen per token, `[N, k]` row-major (token `n`'s at `n·k..n·k + k`, best
    /// first, ties to the lower index), **before** capacity drops.
    pub fn choices(&self) -> &[u32] {
        &self.choices
    }

    /// The token rows (`b · T + t`, ascending) expert `e` takes, after capacity. Empty when the
    /// expert receives no tokens.
    ///
    /// # Panics
    /// When `e >= num_experts()`.
    pub fn tokens(&self, e: usize) -> &[u32] {
        &self.experts[e].tokens
    }

    /// [`Routing::tokens`] of expert `e` as a U32 tensor `[n_e]` on the trunk's device, for
    /// `index_select`; `None` when it receives no tokens.
    ///
    /// # Panics
    /// When `e >= num_experts()`.
    pub fn index(&self, e: usize) -> Option<&Tensor> {
        self.experts[e].index.as_ref()
    }

    /// Gates of expert `e`'s tokens, `[n_e]`, in the params' dtype on the trunk's device (same
    /// order as [`Routing::tokens`]); `None` when it receives no tokens.
    ///
    /// # Panics
    /// When `e >= num_experts()`.
    pub fn gates(&self, e: usize) -> Option<&Tensor> {
        self.experts[e].gates.as_ref()
    }

    /// Whether expert `e` receives at least one token (only then is it called).
    ///
    /// # Panics
    /// When `e >= num_experts()`.
    pub fn is_active(&self, e: usize) -> bool {
        !self.experts[e].tokens.is_empty()
    }

    /// Tokens each expert takes (after capacity), `[E]`.
    pub fn counts(&self) -> Vec<usize> {
        self.experts.iter().map(|r| r.tokens.len()).collect()
    }

    /// Tokens that chose each expert (any slot), before capacity, `[E]`.
    pub fn demand(&self) -> Vec<usize> {
        self.experts.iter().map(|r| r.demand).collect()
    }

    /// Expert capacity in tokens, `ceil(capacity_factor · N · k / E)`; `None` without a
    /// capacity factor.
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// (token, slot) assignments dropped by the capacity limit: `N · k − Σ counts`.
    pub fn dropped(&self) -> usize {
        self.num_tokens * self.top_k - self.experts.iter().map(|r| r.tokens.len()).sum::<usize>()
    }

    /// `f_e`: fraction of the `N` tokens whose top-1 choice is `e` (before capacity), `[E]`.
    pub fn top1_fraction(&self) -> &[f64] {
        &self.top1_fraction
    }

    /// `P_e`: mean router probability of expert `e` over the `N` tokens, `[E]`.
    pub fn mean_prob(&self) -> &[f64] {
        &self.mean_prob
    }

    /// The block's part of the auxiliary term of the objective (already weighted):
    ///
    /// - MoE-GPT: the block's load-balancing loss `aux_loss_coef · E · Σ_e f_e · P_e` (computed
    ///   in the router's dtype, widened to f64);
    /// - Mixtral: 0 until [`MoeLm::finish_forward`](crate::MoeLm::finish_forward), then the block's share
    ///   `Σ_e w_e · Σ_n p[n, e]` of the pooled loss (`w` = [`Routing::aux_weights`]), so that the
    ///   shares of a forward pass's blocks add up to the pooled loss ([`MoeLm::aux_loss`](crate::MoeLm::aux_loss)
    ///   computes it directly).
    pub fn aux_loss(&self) -> f64 {
        self.aux_loss
    }

    /// Pooled load-balancing loss (Mixtral), after [`MoeLm::finish_forward`](crate::MoeLm::finish_forward): the weight `w_e`
    /// of each router probability `p[n, e]` of this block in the objective, `[E]`:
    /// `coef · E · C_e / N²` with `C_e` the top-k choices of expert `e` and `N` the rows over
    /// every block of the forward pass. `None` before, and always for MoE-GPT.
    pub fn aux_weights(&self) -> Option<&[f64]> {
        self.aux_weights.as_ref().map(|(w, _)| w.as_slice())
    }

    /// `Σ_n p[n, e]`: the sum of expert `e`'s router probability over the block call's `N`
    /// rows, `[E]` (f64 sums of the probabilities as computed).
    pub fn prob_sum(&self) -> &[f64] {
        &self.prob_sum
    }

    /// Expert `e`'s input rows `h[idx_e]`, `[n_e, d]`, from the trunk's `h` `[N, d]` (on the
    /// trunk's device); `None` when it receives no tokens.
    ///
    /// # Errors
    /// [`crate::Error::Input`] when `h` is not `[N, d]`; [`crate::Error::Candle`] from the op.
    pub fn expert_input(&self, e: usize, h: &Tensor) -> Result<Option<Tensor>> {
        self.check_rows(h, "h")?;
        let Some(index) = self.index(e) else { return Ok(None) };
        Ok(Some(h.index_select(index, 0)?))
    }

    /// `grad_h` `[N, d]`: the experts' input gradients `grad_inputs[e]` (`[n_e, d]`, from
    /// [`MoeLm::expert_backward`](crate::MoeLm::expert_backward); `None` for an expert without tokens) added into the rows of
    /// their tokens, in expert order (in F32 for half dtypes, rounded once). Tensors on another
    /// device are moved to the trunk's.
    ///
    /// # Errors
    /// [`crate::Error::Input`] when `grad_inputs` does not have one entry per expert, an active
    /// expert's entry is `None` or a shape is wrong; [`crate::Error::Candle`] from the ops.
    pub fn scatter_input_grads(&self, grad_inputs: &[Option<Tensor>]) -> Result<Tensor> {
        let (idx, src) = self.per_expert_rows(grad_inputs, "grad_inputs")?;
        let shape = (self.num_tokens, self.d_model);
        if idx.is_empty() {
            return Ok(Tensor::zeros(shape, self.dtype, &self.device)?);
        }
        if crate::ops::is_half(self.dtype) {
            // A token's k rows accumulate in F32 (as torch's indexing backward), rounded once.
            let src = crate::ops::widen(&Tensor::cat(&src, 0)?)?;
            let wide = Tensor::zeros(shape, DType::F32, &self.device)?.index_add(&Tensor::cat(&idx, 0)?, &src, 0)?;
            return Ok(wide.to_dtype(self.dtype)?);
        }
        let zeros = Tensor::zeros(shape, self.dtype, &self.device)?;
        Ok(zeros.index_add(&Tensor::cat(&idx, 0)?, &Tensor::cat(&src, 0)?, 0)?)
    }

    /// The active experts' indices and `[n_e, d]` rows of `rows` (moved to the trunk's device).
    pub(crate) fn per_expert_rows(
        &self,
        rows: &[Option<Tensor>],
        what: &'static str,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        if rows.len() != self.num_experts() {
            return Err(input_err(
                what,
                format!("{} entries (one per expert)", self.num_experts()),
                rows.len().to_string(),
            ));
        }
        let (mut idx, mut src) = (Vec::new(), Vec::new());
        for (e, (route, r)) in self.experts.iter().zip(rows).enumerate() {
            let Some(index) = &route.index else {
                match r {
                    Some(t) if t.dim(0)? != 0 => {
                        return Err(input_err(
                            what,
                            format!("None for expert {e} (no tokens)"),
                            format!("{:?}", t.dims()),
                        ))
                    }
                    _ => continue,
                }
            };
            let r = r.as_ref().ok_or_else(|| {
                input_err(what, format!("[{}, {}] for expert {e}", route.tokens.len(), self.d_model), "None".into())
            })?;
            if r.dims() != [route.tokens.len(), self.d_model] || r.dtype() != self.dtype {
                return Err(input_err(
                    what,
                    format!("{:?} [{}, {}] for expert {e}", self.dtype, route.tokens.len(), self.d_model),
                    format!("{:?} {:?}", r.dtype(), r.dims()),
                ));
            }
            idx.push(index.clone());
            src.push(r.to_device(&self.device)?);
        }
        Ok((idx, src))
    }

    /// The block output `y = x1 + Σ_e scatter(idx_e, gate_e · out_e)`, `[B, T, d]` (`index_add`
    /// of all experts' rows at once, in expert order).
    ///
    /// `expert_outputs[e]` is expert `e`'s [`MoeLm::expert_forward`](crate::MoeLm::expert_forward) output `[n_e, d]`, `None`
    /// for an expert without tokens; outputs on another device are moved to `x1`'s.
    ///
    /// # Errors
    /// [`crate::Error::Input`] when `x1` or an output has the wrong shape or dtype, or an
    /// active expert's output is missing; [`crate::Error::Candle`] from the ops.
    pub fn combine(&self, x1: &Tensor, expert_outputs: &[Option<Tensor>]) -> Result<Tensor> {
        let gates: Vec<Option<Tensor>> = self.experts.iter().map(|r| r.gates.clone()).collect();
        self.check_x1(x1, "x1")?;
        let (_, outs) = self.per_expert_rows(expert_outputs, "expert_outputs")?;
        combine_math(x1, self, &gates, &outs)
    }

    /// `grad_out_e = gate_e · grad_y[idx_e]`, `[n_e, d]`: the gradient of the block output
    /// `grad_y` `[B, T, d]` with respect to expert `e`'s output; `None` when the expert has no
    /// tokens.
    ///
    /// # Errors
    /// [`crate::Error::Input`] on a wrong shape or dtype; [`crate::Error::Candle`] from the ops.
    pub fn expert_grad_output(&self, e: usize, grad_y: &Tensor) -> Result<Option<Tensor>> {
        self.check_x1(grad_y, "grad_y")?;
        let (Some(index), Some(gates)) = (self.index(e), self.gates(e)) else { return Ok(None) };
        let g = grad_y.reshape((self.num_tokens, self.d_model))?.index_select(index, 0)?;
        Ok(Some(g.broadcast_mul(&gates.unsqueeze(1)?)?))
    }

    /// `grad_gate_e = Σ_d grad_y[idx_e] ⊙ out_e`, `[n_e]`: the gradient of the block output
    /// `grad_y` `[B, T, d]` with respect to expert `e`'s gates, from its output `out_e`
    /// `[n_e, d]` (moved to `grad_y`'s device); `None` when the expert has no tokens. The sum
    /// over `d` accumulates in F32 for half dtypes (the result in the routing's dtype).
    ///
    /// # Errors
    /// [`crate::Error::Input`] on a wrong shape or dtype; [`crate::Error::Candle`] from the ops.
    pub fn expert_grad_gate(&self, e: usize, grad_y: &Tensor, out_e: &Tensor) -> Result<Option<Tensor>> {
        self.check_x1(grad_y, "grad_y")?;
        let Some(index) = self.index(e) else { return Ok(None) };
        let n_e = self.tokens(e).len();
        if out_e.dims() != [n_e, self.d_model] || out_e.dtype() != self.dtype {
            return Err(input_err(
                "expert output",
                format!("{:?} [{n_e}, {}]", self.dtype, self.d_model),
                format!("{:?} {:?}", out_e.dtype(), out_e.dims()),
            ));
        }
        let g = grad_y.reshape((self.num_tokens, self.d_model))?.index_select(index, 0)?;
        let out_e = out_e.to_device(grad_y.device())?;
        if crate::ops::is_half(self.dtype) {
            // The dot product over `d` in F32 (torch's reductions of half tensors accumulate in
            // F32; candle's in the half dtype), rounded once.
            let dot = (crate::ops::widen(&g)? * crate::ops::widen(&out_e)?)?.sum(1)?;
            return Ok(Some(dot.to_dtype(self.dtype)?));
        }
        Ok(Some((g * out_e)?.sum(1)?))
    }

    /// The backward of [`Routing::combine`] for every expert: [`Routing::expert_grad_output`]
    /// and [`Routing::expert_grad_gate`] (the gradient to `x1` is `grad_y` itself).
    ///
    /// # Errors
    /// As the two functions; [`crate::Error::Input`] when an active expert's output is missing.
    pub fn combine_backward(&self, grad_y: &Tensor, expert_outputs: &[Option<Tensor>]) -> Result<CombineGrads> {
        if expert_outputs.len() != self.num_experts() {
            return Err(input_err(
                "expert_outputs",
                format!("{} entries (one per expert)", self.num_experts()),
                expert_outputs.len().to_string(),
            ));
        }
        let (mut grad_outputs, mut grad_gates) = (Vec::new(), Vec::new());
        for (e, out) in expert_outputs.iter().enumerate() {
            grad_outputs.push(self.expert_grad_output(e, grad_y)?);
            grad_gates.push(match (self.is_active(e), out) {
                (false, _) => None,
                (true, Some(out)) => self.expert_grad_gate(e, grad_y, out)?,
                (true, None) => {
                    return Err(input_err("expert_outputs", format!("an output for expert {e}"), "None".into()))
                }
            });
        }
        Ok(CombineGrads { grad_outputs, grad_gates })
    }

    /// `t` is `[B, T, d]` with `B · T = N`, in the routing's dtype.
    pub(crate) fn check_x1(&self, t: &Tensor, what: &'static str) -> Result<()> {
        let ok = matches!(t.dims(), &[b, s, d] if b * s == self.num_tokens && d == self.d_model);
        if !ok || t.dtype() != self.dtype {
            return Err(input_err(
                what,
                format!("{:?} [B, T, {}] with B·T = {}", self.dtype, self.d_model, self.num_tokens),
                format!("{:?} {:?}", t.dtype(), t.dims()),
            ));
        }
        Ok(())
    }

    /// The active experts' flat slot indices (`n · k + s`) and `grad_gates[e]` `[n_e]` (checked,
    /// moved to the trunk's device), for a trunk's backward.
    ///
    /// # Errors
    /// [`crate::Error::Input`] when `grad_gates` does not have one entry per expert, or an
    /// active expert's entry is missing or of the wrong shape or dtype.
    pub(crate) fn gate_grad_rows(&self, grad_gates: &[Option<Tensor>]) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        if grad_gates.len() != self.num_experts() {
            return Err(input_err(
                "grad_gates",
                format!("{} entries (one per expert)", self.num_experts()),
                grad_gates.len().to_string(),
            ));
        }
        let (mut idx, mut src) = (Vec::new(), Vec::new());
        for (e, (route, g)) in self.experts.iter().zip(grad_gates).enumerate() {
            let Some(slots) = &route.slots else { continue };
            let g = g.as_ref().ok_or_else(|| {
                input_err("grad_gates", format!("[{}] for expert {e}", route.tokens.len()), "None".into())
            })?;
            if g.dims() != [route.tokens.len()] || g.dtype() != self.dtype {
                return Err(input_err(
                    "grad_gates",
                    format!("{:?} [{}] for expert {e}", self.dtype, route.tokens.len()),
                    format!("{:?} {:?}", g.dtype(), g.dims()),
                ));
            }
            idx.push(slots.clone());
            src.push(g.to_device(&self.device)?);
        }
        Ok((idx, src))
    }

    pub(crate) fn check_rows(&self, t: &Tensor, what: &'static str) -> Result<()> {
        if t.dims() != [self.num_tokens, self.d_model] || t.dtype() != self.dtype {
            return Err(input_err(
                what,
                format!("{:?} [{}, {}] (N, d)", self.dtype, self.num_tokens, self.d_model),
                format!("{:?} {:?}", t.dtype(), t.dims()),
            ));
        }
        Ok(())
    }
}

/// The shared start of an expert's backward: `grad_out_e` must be `h_e`'s shape in the params'
/// dtype; with no rows (`n_e = 0`) the answer is zero gradients, returned without computing.
///
/// # Errors
/// [`crate::Error::Input`] when `grad_out_e` does not match; [`crate::Error::Candle`].
pub(crate) fn expert_backward_trivial(
    params: &Tensor,
    h_e: &Tensor,
    grad_out_e: &Tensor,
) -> Result<Option<ExpertGrads>> {
    let dtype = params.dtype();
    if grad_out_e.dims() != h_e.dims() || grad_out_e.dtype() != dtype {
        return Err(input_err(
            "expert grad_output",
            format!("{dtype:?} {:?}", h_e.dims()),
            format!("{:?} {:?}", grad_out_e.dtype(), grad_out_e.dims()),
        ));
    }
    if h_e.dim(0)? == 0 {
        return Ok(Some(ExpertGrads {
            grad_params: params.zeros_like()?,
            grad_input: h_e.clone(),
            output: h_e.clone(),
        }));
    }
    Ok(None)
}

/// `x1 + Σ_e scatter(idx_e, gate_e · out_e)` (one `index_add` over all active experts' rows in
/// expert order); `gates` and `outs` for the active experts only, in order. Differentiable in
/// every argument (the whole-graph test runs it on `Var`s).
pub(crate) fn combine_math(
    x1: &Tensor,
    routing: &Routing,
    gates: &[Option<Tensor>],
    outs: &[Tensor],
) -> Result<Tensor> {
    let (b, t, d) = x1.dims3()?;
    let mut idx = Vec::with_capacity(outs.len());
    let mut contrib = Vec::with_capacity(outs.len());
    let mut outs = outs.iter();
    for (route, gate) in routing.experts.iter().zip(gates) {
        let (Some(index), Some(gate)) = (&route.index, gate) else { continue };
        let out = outs.next().expect("one output per active expert");
        contrib.push(out.broadcast_mul(&gate.unsqueeze(1)?)?);
        idx.push(index.clone());
    }
    if contrib.is_empty() {
        return Ok(x1.clone());
    }
    let y = x1.reshape((b * t, d))?.index_add(&Tensor::cat(&idx, 0)?, &Tensor::cat(&contrib, 0)?, 0)?;
    Ok(y.reshape((b, t, d))?)
}

#[cfg(test)]
mod tests;
