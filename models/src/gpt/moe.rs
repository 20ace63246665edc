//! Mixture-of-experts blocks, unit by unit: the trunk (attention, `ln_2`, router), the experts,
//! the routing (top-k, gates, capacity, auxiliary loss), the combine, and their backward.
//!
//! Switch Transformer (Fedus et al. 2021) for `top_k = 1`, GShard (Lepikhin et al. 2020) for
//! `top_k = 2`; definitions of gates, capacity and the auxiliary loss in [`MoeConfig`].
//!
//! # One MoE block, as a trainer runs it
//!
//! ```text
//! forward : tr = moe_trunk_forward(i, p_trunk, x)                  keep x, tr.h, tr.routing
//!           for e with tokens: out_e = expert_forward(p_e, routing.expert_input(e, h))
//!           y = moe_combine(tr.x1, routing, outs)                  = x1 + Σ_e gate_e · out_e (scattered)
//! backward: cg = moe_combine_backward(routing, grad_y, outs)      grad_out_e, grad_gate_e
//!           for e with tokens: eg_e = expert_backward(p_e, h_e, cg.grad_outputs[e])
//!           grad_h = routing.scatter_input_grads(eg.grad_input)
//!           g = moe_trunk_backward(i, p_trunk, x, routing, grad_y, grad_h, cg.grad_gates)
//! ```
//!
//! The expert calls are pure functions of their arguments (no block, no routing): a trainer
//! may run them on another candle device (move `h_e` there, the output and `grad_input` back).
//! An expert that receives no tokens is not called and its gradient is zero.

use candle_core::{DType, Tensor, Var};

use super::config::{block_idx as bi, expert_idx as ei, MoeConfig};
use super::{Gpt, UnitGrads};
use crate::kernels;
#[cfg(test)]
pub(super) use crate::moe::combine_math;
use crate::moe::{CombineGrads, ExpertGrads, ExpertRoute, LossParts, Routing, TrunkOut};
use crate::ops::{self, gelu_composed, input_err, layer_norm, linear, scalar, softmax_last_dim, vars, views};
use crate::unit::{UnitKind, UnitSpec};
use crate::Result;

/// The gates of every (token, slot), `[N · k]` (flat slot `n · k + s`), as a differentiable
/// function of `probs` `[N, E]` for fixed `choices` `[N, k]`: `k = 1` the chosen probability,
/// `k = 2` the chosen probability over the sum of the chosen pair.
pub(super) fn gate_values(probs: &Tensor, choices: &Tensor, top_k: usize) -> Result<Tensor> {
    let sel = probs.gather(choices, 1)?; // [N, k]
    let g = if top_k == 2 { sel.broadcast_div(&sel.sum_keepdim(1)?)? } else { sel };
    Ok(g.flatten_all()?)
}

/// The load-balancing loss `coef · E · Σ_e f_e · mean_n(probs[n, e])` as a scalar tensor, `f`
/// (`[E]`) a constant.
pub(super) fn aux_value(probs: &Tensor, f: &Tensor, coef: f64) -> Result<Tensor> {
    let e = probs.dim(1)?;
    Ok((probs.mean(0)? * f)?.sum_all()?.affine(coef * e as f64, 0.0)?)
}

/// The `k` best experts of one token's probabilities, best first, ties to the lower index.
fn top_k_of(row: &[f64], k: usize, out: &mut Vec<u32>) {
    let best = |skip: Option<usize>| {
        let mut b: Option<usize> = None;
        for (e, &p) in row.iter().enumerate() {
            if Some(e) != skip && b.is_none_or(|j| p > row[j]) {
                b = Some(e);
            }
        }
        b.expect("at least two experts")
    };
    let first = best(None);
    out.push(first as u32);
    if k == 2 {
        out.push(best(Some(first)) as u32);
    }
}

impl Gpt {
    fn moe_config(&self) -> Result<&MoeConfig> {
        self.config.moe.as_ref().ok_or_else(|| {
            input_err("model", "an MoE model (model.moe set)".into(), "a dense model (model.moe unset)".into())
        })
    }

    fn trunk_spec(&self, block: usize) -> Result<&UnitSpec> {
        self.moe_config()?;
        if block >= self.config.n_layer {
            return Err(input_err("block index", format!("< {}", self.config.n_layer), block.to_string()));
        }
        let spec = &self.units[self.config.block_unit(block)];
        debug_assert_eq!(spec.kind, UnitKind::MoeTrunk(block));
        Ok(spec)
    }

    /// The layout of expert (0, 0); every expert unit has the same offsets and shapes.
    fn expert_spec(&self) -> Result<&UnitSpec> {
        self.moe_config()?;
        Ok(&self.units[self.config.expert_unit(0, 0)])
    }

    /// Forward of MoE block `block`'s trunk unit (`blocks.{block}`, [`UnitKind::MoeTrunk`]):
    /// `x1 = x + attn(ln_1(x))`, `h = ln_2(x1)`, `probs = softmax(h W_r + b_r)`, and the
    /// [`Routing`] from `probs` (top-k, gates, capacity, auxiliary loss; see [`MoeConfig`]).
    /// For half dtypes the softmax, the gates and the auxiliary loss are computed in F32
    /// (`probs` is F32), the gates then cast to the params' dtype.
    ///
    /// `params` is the trunk's flat vector, `x` the block input `[B, T, d]` in the params' dtype.
    /// Index tensors and gates are on `x`'s device.
    ///
    /// # Errors
    /// [`super::Error::Input`] on a dense model, a block index `>= n_layer` or a wrong shape or
    /// dtype; [`super::Error::Candle`] from the ops.
    pub fn moe_trunk_forward(&self, block: usize, params: &Tensor, x: &Tensor) -> Result<TrunkOut> {
        let spec = self.trunk_spec(block)?;
        self.check_params(spec, params)?;
        self.check_hidden(x, params.dtype(), "MoE trunk input")?;
        let p = views(spec, params)?;
        let (x1, h, logits, probs) = self.trunk_math_logits(&p, x)?;
        let routing = self.route_as(&probs, params.dtype())?;
        Ok(TrunkOut { x1, h, logits, probs, routing })
    }

    /// Forward of one expert (any block's; the layout is the same): `gelu(h_e W_fc + b_fc)
    /// W_proj + b_proj`, `[n_e, d]` → `[n_e, d]`, on `h_e`'s device in the params' dtype. A pure
    /// function of its arguments. `n_e = 0` gives an empty `[0, d]` without computing.
    ///
    /// # Errors
    /// [`super::Error::Input`] on a dense model or a wrong shape or dtype;
    /// [`super::Error::Candle`] from the ops.
    pub fn expert_forward(&self, params: &Tensor, h_e: &Tensor) -> Result<Tensor> {
        let spec = self.expert_spec()?;
        self.check_params(spec, params)?;
        self.check_expert_rows(h_e, params.dtype(), "expert input")?;
        if h_e.dim(0)? == 0 {
            return Ok(h_e.clone());
        }
        self.expert_math(&views(spec, params)?, h_e)
    }

    /// Backward of one expert by recomputation: the VJP of [`Gpt::expert_forward`] at
    /// (`params`, `h_e` `[n_e, d]`) with `grad_out_e` `[n_e, d]` (from
    /// [`Gpt::moe_expert_grad_output`]). A pure function of its arguments; `n_e = 0` gives zero
    /// gradients without computing.
    ///
    /// # Errors
    /// As [`Gpt::expert_forward`], and [`super::Error::Input`] when `grad_out_e` does not match.
    pub fn expert_backward(&self, params: &Tensor, h_e: &Tensor, grad_out_e: &Tensor) -> Result<ExpertGrads> {
        let spec = self.expert_spec()?;
        self.check_params(spec, params)?;
        let dtype = params.dtype();
        self.check_expert_rows(h_e, dtype, "expert input")?;
        if let Some(empty) = crate::moe::expert_backward_trivial(params, h_e, grad_out_e)? {
            return Ok(empty);
        }
        let vars = vars(spec, params)?;
        let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let x = Var::from_tensor(h_e)?;
        let out = self.expert_math(&p, x.as_tensor())?;
        let grads = (&out * grad_out_e)?.sum_all()?.backward()?;
        let g = self.collect(spec, &vars, Some(&x), None, &grads)?;
        Ok(ExpertGrads {
            grad_params: g.grad_params,
            grad_input: g.grad_input.expect("the expert's input is a Var"),
            output: out.detach(),
        })
    }

    /// The MoE block's output `y = x1 + Σ_e scatter(idx_e, gate_e · out_e)`, `[B, T, d]`
    /// (`index_add` of all experts' rows at once, in expert order).
    ///
    /// `expert_outputs[e]` is expert `e`'s [`Gpt::expert_forward`] output `[n_e, d]`, `None`
    /// for an expert without tokens; outputs on another device are moved to `x1`'s.
    ///
    /// # Errors
    /// [`super::Error::Input`] when `x1` or an output has the wrong shape or dtype, or an
    /// active expert's output is missing; [`super::Error::Candle`] from the ops.
    pub fn moe_combine(&self, x1: &Tensor, routing: &Routing, expert_outputs: &[Option<Tensor>]) -> Result<Tensor> {
        routing.combine(x1, expert_outputs)
    }

    /// `grad_out_e = gate_e · grad_y[idx_e]`, `[n_e, d]`: the gradient of the block output
    /// `grad_y` `[B, T, d]` with respect to expert `e`'s output; `None` when the expert has no
    /// tokens.
    ///
    /// # Errors
    /// [`super::Error::Input`] on a wrong shape or dtype; [`super::Error::Candle`] from the ops.
    pub fn moe_expert_grad_output(&self, routing: &Routing, e: usize, grad_y: &Tensor) -> Result<Option<Tensor>> {
        routing.expert_grad_output(e, grad_y)
    }

    /// `grad_gate_e = Σ_d grad_y[idx_e] ⊙ out_e`, `[n_e]`: the gradient of the block output
    /// `grad_y` `[B, T, d]` with respect to expert `e`'s gates, from its output `out_e`
    /// `[n_e, d]` (moved to `grad_y`'s device); `None` when the expert has no tokens.
    ///
    /// # Errors
    /// [`super::Error::Input`] on a wrong shape or dtype; [`super::Error::Candle`] from the ops.
    pub fn moe_expert_grad_gate(
        &self,
        routing: &Routing,
        e: usize,
        grad_y: &Tensor,
        out_e: &Tensor,
    ) -> Result<Option<Tensor>> {
        routing.expert_grad_gate(e, grad_y, out_e)
    }

    /// The backward of [`Gpt::moe_combine`] for every expert: [`Gpt::moe_expert_grad_output`]
    /// and [`Gpt::moe_expert_grad_gate`] (the gradient to `x1` is `grad_y` itself).
    ///
    /// # Errors
    /// As the two functions; [`super::Error::Input`] when an active expert's output is missing.
    pub fn moe_combine_backward(
        &self,
        routing: &Routing,
        grad_y: &Tensor,
        expert_outputs: &[Option<Tensor>],
    ) -> Result<CombineGrads> {
        routing.combine_backward(grad_y, expert_outputs)
    }

    /// Backward of MoE block `block`'s trunk by recomputation from its input `x` `[B, T, d]`:
    /// the VJP of `(x1, h, gates, aux)` with
    ///
    /// - `grad_y` `[B, T, d]`, the gradient of the block output (`dL/dx1 = grad_y`, the residual);
    /// - `grad_h` `[N, d]`, the experts' input gradients scattered back
    ///   ([`Routing::scatter_input_grads`]);
    /// - `grad_gates[e]` `[n_e]` ([`Gpt::moe_expert_grad_gate`]; `None` for experts without
    ///   tokens), through the gates to the router probabilities (for `k = 2` through the
    ///   renormalization over the chosen pair);
    /// - the block's auxiliary loss, weight 1 (it is part of the objective), through `P_e` to the
    ///   probabilities (`f_e` is a constant).
    ///
    /// The top-k choices are `routing`'s (from the forward), not recomputed. Returns the trunk's
    /// flat parameter gradient and `grad_input` (`[B, T, d]`).
    ///
    /// # Errors
    /// [`super::Error::Input`] on a dense model, a wrong block index, shape or dtype, or a
    /// `routing` of another shape; [`super::Error::Candle`] from the ops.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_trunk_backward(
        &self,
        block: usize,
        params: &Tensor,
        x: &Tensor,
        routing: &Routing,
        grad_y: &Tensor,
        grad_h: &Tensor,
        grad_gates: &[Option<Tensor>],
    ) -> Result<UnitGrads> {
        let spec = self.trunk_spec(block)?;
        self.check_params(spec, params)?;
        let dtype = params.dtype();
        self.check_hidden(x, dtype, "MoE trunk input")?;
        let (b, t, _) = x.dims3()?;
        if routing.num_tokens != b * t || routing.dtype != dtype || routing.num_experts() != self.config.num_experts() {
            return Err(input_err(
                "routing",
                format!("the routing of this call ({} tokens, {dtype:?})", b * t),
                format!("{} tokens, {:?}", routing.num_tokens, routing.dtype),
            ));
        }
        routing.check_x1(grad_y, "grad_y")?;
        routing.check_rows(grad_h, "grad_h")?;
        let (slot_idx, gate_grads) = routing.gate_grad_rows(grad_gates)?;

        let vars = vars(spec, params)?;
        let p: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let xv = Var::from_tensor(x)?;
        let (x1, h, probs) = self.trunk_math(&p, xv.as_tensor())?;
        let mut obj = ((&x1 * grad_y)?.sum_all()? + (&h * grad_h)?.sum_all()?)?;
        if !slot_idx.is_empty() {
            let n_slots = routing.num_tokens * routing.top_k;
            let g = Tensor::zeros(n_slots, dtype, x.device())?.index_add(
                &Tensor::cat(&slot_idx, 0)?,
                &Tensor::cat(&gate_grads, 0)?,
                0,
            )?;
            let gates = gate_values(&probs, &routing.choices_t, routing.top_k)?.to_dtype(dtype)?;
            obj = (obj + (gates * g)?.sum_all()?)?;
        }
        let coef = self.moe_config()?.aux_loss_coef;
        if coef != 0.0 {
            obj = (obj + aux_value(&probs, &routing.top1_fraction_t, coef)?.to_dtype(dtype)?)?;
        }
        let grads = obj.backward()?;
        self.collect(spec, &vars, Some(&xv), None, &grads)
    }

    // ---- internals -----------------------------------------------------------------------

    fn check_expert_rows(&self, h: &Tensor, dtype: DType, what: &'static str) -> Result<()> {
        let d = self.config.d_model;
        if !matches!(h.dims(), &[_, w] if w == d) || h.dtype() != dtype {
            return Err(input_err(what, format!("{dtype:?} [n_e, {d}]"), format!("{:?} {:?}", h.dtype(), h.dims())));
        }
        Ok(())
    }

    /// The trunk: `(x1 [B, T, d], h [N, d], probs [N, E])`.
    pub(super) fn trunk_math(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (x1, h, _, probs) = self.trunk_math_logits(p, x)?;
        Ok((x1, h, probs))
    }

    /// The trunk with the router logits: `(x1 [B, T, d], h [N, d], logits [N, E], probs [N, E])`;
    /// `probs` in F32 for half dtypes, the params' dtype otherwise.
    fn trunk_math_logits(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let fused = self.fused(x);
        let x1 = self.attention_residual(p, x)?;
        let h = layer_norm(&x1, &p[bi::LN2_W], &p[bi::LN2_B], self.config.ln_eps, fused)?.reshape((b * t, d))?;
        let logits = linear(&h, &p[bi::ROUTER_W], &p[bi::ROUTER_B], fused)?;
        // In F32 for half dtypes (the router computes in F32: DESIGN.md "Precision").
        let probs = softmax_last_dim(&ops::widen(&logits)?)?;
        Ok((x1, h, logits, probs))
    }

    /// One expert's MLP on its rows `[n_e, d]` → `[n_e, d]`.
    pub(super) fn expert_math(&self, p: &[Tensor], h: &Tensor) -> Result<Tensor> {
        let fused = self.fused(h);
        let a = linear(h, &p[ei::FC_W], &p[ei::FC_B], fused)?;
        let a = if fused { kernels::gelu(&a)? } else { gelu_composed(&a)? };
        linear(&a, &p[ei::PROJ_W], &p[ei::PROJ_B], fused)
    }

    /// [`Gpt::route_as`] with gates in `probs`' dtype.
    #[cfg(test)]
    pub(super) fn route(&self, probs: &Tensor) -> Result<Routing> {
        self.route_as(probs, probs.dtype())
    }

    /// The routing of `probs` `[N, E]` (see [`MoeConfig`]): top-k on the CPU (one host copy of
    /// `N · E` values), capacity in token order, gates and the auxiliary loss in candle on
    /// `probs`' device in `probs`' dtype (the same ops [`Gpt::moe_trunk_backward`]
    /// differentiates), the gates then cast to `dtype` (the params').
    pub(super) fn route_as(&self, probs: &Tensor, dtype: DType) -> Result<Routing> {
        let moe = self.moe_config()?;
        let (n, e_count) = probs.dims2()?;
        let (k, device) = (moe.top_k, probs.device().clone());
        let host: Vec<f64> = probs.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let mut choices = Vec::with_capacity(n * k);
        for row in host.chunks_exact(e_count) {
            top_k_of(row, k, &mut choices);
        }
        let capacity = moe.capacity(n);
        let mut tokens = vec![Vec::new(); e_count];
        let mut slots = vec![Vec::new(); e_count];
        let mut demand = vec![0usize; e_count];
        let mut top1 = vec![0usize; e_count];
        // Flat slot order is token order (then slot): capacity keeps the first tokens.
        for (slot, &c) in choices.iter().enumerate() {
            let c = c as usize;
            demand[c] += 1;
            if slot % k == 0 {
                top1[c] += 1;
            }
            if capacity.is_none_or(|cap| tokens[c].len() < cap) {
                tokens[c].push((slot / k) as u32);
                slots[c].push(slot as u32);
            }
        }
        let top1_fraction: Vec<f64> = top1.iter().map(|&c| c as f64 / n as f64).collect();
        let top1_fraction_t = Tensor::from_slice(&top1_fraction, e_count, &device)?.to_dtype(probs.dtype())?;
        let choices_t = Tensor::from_slice(&choices, (n, k), &device)?;
        let gate_all = gate_values(probs, &choices_t, k)?.to_dtype(dtype)?;
        let mut experts = Vec::with_capacity(e_count);
        for ((tokens, slots), demand) in tokens.into_iter().zip(slots).zip(demand) {
            let route = if tokens.is_empty() {
                ExpertRoute { tokens, index: None, slots: None, gates: None, demand }
            } else {
                let index = Tensor::from_slice(&tokens, tokens.len(), &device)?;
                let slot_t = Tensor::from_slice(&slots, slots.len(), &device)?;
                let gates = gate_all.index_select(&slot_t, 0)?;
                ExpertRoute { tokens, index: Some(index), slots: Some(slot_t), gates: Some(gates), demand }
            };
            experts.push(route);
        }
        let mean_prob: Vec<f64> = probs.mean(0)?.to_dtype(DType::F64)?.to_vec1()?;
        let mut prob_sum = vec![0f64; e_count];
        for row in host.chunks_exact(e_count) {
            prob_sum.iter_mut().zip(row).for_each(|(s, &p)| *s += p);
        }
        let aux_loss = scalar(&aux_value(probs, &top1_fraction_t, moe.aux_loss_coef)?)?;
        Ok(Routing {
            num_tokens: n,
            d_model: self.config.d_model,
            top_k: k,
            choices,
            choices_t,
            experts,
            capacity,
            top1_fraction,
            top1_fraction_t,
            mean_prob,
            prob_sum,
            aux_loss,
            aux_weights: None,
            dtype,
            device,
        })
    }

    /// The MoE model's forward up to the head's input, unit call by unit call; also returns
    /// every block's routing.
    pub(super) fn moe_forward_hidden(&self, params: &[Tensor], tokens: &Tensor) -> Result<(Tensor, Vec<Routing>)> {
        self.check_num_units(params)?;
        let mut x = self.forward(0, &params[0], tokens, None)?;
        let mut routings = Vec::with_capacity(self.config.n_layer);
        for i in 0..self.config.n_layer {
            let (y, _, tr, _) = self.moe_block_forward(i, params, &x)?;
            x = y;
            routings.push(tr.routing);
        }
        Ok((x, routings))
    }

    /// One MoE block through the unit calls: `(y, x, trunk output, expert outputs)`.
    pub(super) fn moe_block_forward(
        &self,
        i: usize,
        params: &[Tensor],
        x: &Tensor,
    ) -> Result<(Tensor, Tensor, TrunkOut, Vec<Option<Tensor>>)> {
        let tr = self.moe_trunk_forward(i, &params[self.config.block_unit(i)], x)?;
        let mut outs = Vec::with_capacity(tr.routing.num_experts());
        for e in 0..tr.routing.num_experts() {
            outs.push(match tr.routing.expert_input(e, &tr.h)? {
                Some(h_e) => Some(self.expert_forward(&params[self.config.expert_unit(i, e)], &h_e)?),
                None => None,
            });
        }
        let y = self.moe_combine(&tr.x1, &tr.routing, &outs)?;
        Ok((y, x.clone(), tr, outs))
    }

    /// [`Gpt::loss_parts_and_grads`] of the MoE model (documented there).
    pub(super) fn moe_loss_parts_and_grads(
        &self,
        params: &[Tensor],
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<(LossParts, Vec<Tensor>)> {
        self.check_num_units(params)?;
        let n_units = self.units.len();
        let mut x = self.forward(0, &params[0], tokens, None)?;
        let mut kept = Vec::with_capacity(self.config.n_layer);
        let mut aux = 0.0;
        for i in 0..self.config.n_layer {
            let (y, x_in, tr, outs) = self.moe_block_forward(i, params, &x)?;
            aux += tr.routing.aux_loss();
            kept.push((x_in, tr.h, tr.routing, outs));
            x = y;
        }

        let mut grads: Vec<Option<Tensor>> = vec![None; n_units];
        let head = self.head_loss_backward(&params[n_units - 1], &x, self.tied(params), targets)?;
        let mut g = head.grads.grad_input.expect("head has an input gradient");
        grads[n_units - 1] = Some(head.grads.grad_params);
        for i in (0..self.config.n_layer).rev() {
            let (x_in, h, routing, outs) = kept.pop().expect("one per block");
            let cg = self.moe_combine_backward(&routing, &g, &outs)?;
            let mut grad_inputs = vec![None; routing.num_experts()];
            for e in (0..routing.num_experts()).rev() {
                let u = self.config.expert_unit(i, e);
                let (Some(h_e), Some(go)) = (routing.expert_input(e, &h)?, &cg.grad_outputs[e]) else {
                    grads[u] = Some(params[u].zeros_like()?);
                    continue;
                };
                let eg = self.expert_backward(&params[u], &h_e, go)?;
                grads[u] = Some(eg.grad_params);
                grad_inputs[e] = Some(eg.grad_input);
            }
            let grad_h = routing.scatter_input_grads(&grad_inputs)?;
            let u = self.config.block_unit(i);
            let tg = self.moe_trunk_backward(i, &params[u], &x_in, &routing, &g, &grad_h, &cg.grad_gates)?;
            grads[u] = Some(tg.grad_params);
            g = tg.grad_input.expect("the trunk has an input gradient");
        }
        let mut g0 = self.backward(0, &params[0], tokens, &g, None)?.grad_params;
        if let Some(gt) = head.grads.grad_tied_wte {
            g0 = (g0 + gt)?;
        }
        grads[0] = Some(g0);
        let parts = LossParts { ce: head.loss, aux };
        Ok((parts, grads.into_iter().map(|g| g.expect("set")).collect()))
    }
}

/// Test access to the routing's internals for the whole-graph reference.
#[cfg(test)]
impl Routing {
    pub(super) fn slots(&self, e: usize) -> Option<&Tensor> {
        self.experts[e].slots.as_ref()
    }

    pub(super) fn choices_tensor(&self) -> &Tensor {
        &self.choices_t
    }

    pub(super) fn top1_fraction_tensor(&self) -> &Tensor {
        &self.top1_fraction_t
    }
}
