//! Mixture-of-experts blocks, unit by unit: the trunk (attention, `ln_2`, router), the experts,
//! the routing (top-k, gates, capacity, auxiliary loss), the combine, and their backward.
//!
//! Switch Transformer (Fedus et al. 2021) for `top_k = 1`, GShard (Lepikhin et al. 2020) for
//! `top_k = 2`; definitions of gates, capacity and the auxiliary loss in [`MoeConfig`].
//!
//! The block's calls are [`crate::MoeLm`]'s (trunk forward, expert forward, combine, and
//! their backward, in the order its docs give), written once in [`crate::lm`] over this
//! module's pieces: the trunk's math, the routing, an expert's math, the gates and the
//! load-balancing term its backward differentiates. An expert that receives no tokens is not
//! called and its gradient is zero.

use candle_core::{DType, Tensor};

use super::config::{block_idx as bi, expert_idx as ei, MoeConfig};
use super::Gpt;
use crate::kernels::{gelu, layer_norm, linear, softmax_last_dim};
use crate::lm::MoeFamily;
#[cfg(test)]
pub(super) use crate::moe::combine_math;
use crate::moe::{ExpertRoute, Routing};
use crate::ops::{self, input_err, scalar};
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

    /// The trunk with the router logits: `(x1 [B, T, d], h [N, d], logits [N, E], probs [N, E])`;
    /// `probs` in F32 for half dtypes, the params' dtype otherwise.
    pub(super) fn trunk_math(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let fused = self.compute.fused(x);
        let x1 = self.attention_residual(p, x)?;
        let h = layer_norm(&x1, &p[bi::LN2_W], &p[bi::LN2_B], self.config.ln_eps, fused)?.reshape((b * t, d))?;
        let logits = linear(&h, &p[bi::ROUTER_W], &p[bi::ROUTER_B], fused)?;
        // In F32 for half dtypes (the router computes in F32: DESIGN.md "Precision").
        let probs = softmax_last_dim(&ops::widen(&logits)?)?;
        Ok((x1, h, logits, probs))
    }

    /// One expert's MLP on its rows `[n_e, d]` → `[n_e, d]`.
    pub(super) fn expert_math(&self, p: &[Tensor], h: &Tensor) -> Result<Tensor> {
        let fused = self.compute.fused(h);
        let a = linear(h, &p[ei::FC_W], &p[ei::FC_B], fused)?;
        let a = gelu(&a, fused)?;
        linear(&a, &p[ei::PROJ_W], &p[ei::PROJ_B], fused)
    }

    /// [`Gpt::route_as`] with gates in `probs`' dtype.
    #[cfg(test)]
    pub(super) fn route(&self, probs: &Tensor) -> Result<Routing> {
        self.route_as(probs, probs.dtype())
    }

    /// The routing of `probs` `[N, E]` (see [`MoeConfig`]): top-k on the CPU (one host copy of
    /// `N · E` values), capacity in token order, gates and the auxiliary loss in candle on
    /// `probs`' device in `probs`' dtype (the same ops [`crate::MoeLm::trunk_backward`]
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
}

/// MoE-GPT's trunk (`blocks.{i}`: `x1 = x + attn(ln_1(x))`, `h = ln_2(x1)`, `probs =
/// softmax(h W_r + b_r)`), routing ([`MoeConfig`]: top-k, capacity, gates, the block's
/// auxiliary loss) and experts (`gelu(h_e W_fc + b_fc) W_proj + b_proj`); the calls are
/// [`crate::lm`]'s.
impl MoeFamily for Gpt {
    fn num_experts(&self) -> usize {
        self.config.num_experts()
    }

    fn trunk_unit(&self, block: usize) -> Result<usize> {
        self.moe_config()?;
        if block >= self.config.n_layer {
            return Err(input_err("block index", format!("< {}", self.config.n_layer), block.to_string()));
        }
        Ok(self.config.block_unit(block))
    }

    fn expert_unit0(&self) -> Result<usize> {
        self.moe_config()?;
        Ok(self.config.expert_unit(0, 0))
    }

    fn trunk_math(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        Gpt::trunk_math(self, p, x)
    }

    fn route(&self, probs: &Tensor, dtype: DType) -> Result<Routing> {
        self.route_as(probs, dtype)
    }

    fn expert_math(&self, p: &[Tensor], h: &Tensor) -> Result<Tensor> {
        Gpt::expert_math(self, p, h)
    }

    fn gate_values(&self, probs: &Tensor, choices: &Tensor, top_k: usize) -> Result<Tensor> {
        gate_values(probs, choices, top_k)
    }

    /// The block's load-balancing loss, weight 1 (it is part of the objective), through `P_e`
    /// to the probabilities (`f_e` a constant); none when `aux_loss_coef = 0`.
    fn aux_term(&self, probs: &Tensor, routing: &Routing) -> Result<Option<Tensor>> {
        let coef = self.moe_config()?.aux_loss_coef;
        Ok(if coef != 0.0 { Some(aux_value(probs, &routing.top1_fraction_t, coef)?) } else { None })
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
