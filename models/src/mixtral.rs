//! Mixtral (Jiang et al. 2024, "Mixtral of Experts"; transformers' `modeling_mixtral.py`): the
//! Llama family's decoder ([`crate::llama`], Mistral's attention without biases) whose every
//! layer's feed-forward network is a sparse MoE block. It is the [`Llama`] type with
//! [`LlamaFamily::Mixtral`](crate::LlamaFamily::Mixtral) ([`Mixtral`] and [`MixtralConfig`] are the same types under the
//! family's name); this module holds its [`MoeLm`] calls.
//!
//! | unit | kind | parameters (flat order) | computes |
//! |---|---|---|---|
//! | `model.layers.{i}` | [`UnitKind::MoeTrunk`](crate::UnitKind::MoeTrunk)`(i)` | `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`, `block_sparse_moe.gate` `[E, d]` | `x1 = x + attn(rms(x))`, `h = rms(x1)`, `logits = h Gᵀ`, `p = softmax(logits)`, the [`Routing`] |
//! | `model.layers.{i}.block_sparse_moe.experts.{e}` | [`UnitKind::Expert`](crate::UnitKind::Expert) | `w1` `[I, d]`, `w3` `[I, d]`, `w2` `[d, I]` | `w2(silu(w1 h) ⊙ w3 h)` on its tokens' rows |
//!
//! ```text
//! router : logits = h Gᵀ (no bias), p = softmax(logits) in F32 over all E experts
//! top-k  : the k largest p per token (ties to the lower index), gates = p_chosen / Σ p_chosen
//! block  : y = x1 + Σ_{chosen e} gate_e · expert_e(h)
//! aux    : N = L_s·B·T rows over the L_s sparse layers of the pass, c_e = picks of e among N·k,
//!          P_e = Σ_n p[n, e];  aux = E · Σ_e (c_e / N) (P_e / N)      (gradient through P_e only)
//! loss   : ce + router_aux_loss_coef · aux     (when output_router_logits, as transformers)
//! ```
//!
//! The fine-grained MoE families are the same code with other names and switches
//! (transformers' `modeling_qwen3_moe.py`, `modeling_olmoe.py`, `modeling_qwen2_moe.py`):
//!
//! | family | router, experts | gates | attention | trunk extra |
//! |---|---|---|---|---|
//! | Mixtral | `block_sparse_moe.gate`, `experts.{e}.w1/w3/w2` | renormalized | Mistral's | — |
//! | Qwen3-MoE | `mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj` (`moe_intermediate_size`) | renormalized iff `norm_topk_prob` | per-head q/k RMSNorm | — |
//! | OLMoE | as Qwen3-MoE (`intermediate_size`) | as Qwen3-MoE | q/k RMSNorm over the whole projections | — |
//! | Qwen2-MoE | as Qwen3-MoE | as Qwen3-MoE | q/k/v bias | `x1 += sigmoid(h g_sᵀ) ⊙ shared_expert(h)` |
//!
//! Qwen2-MoE's shared expert runs on every token: it is a dense part of the trunk unit (added
//! to the residual stream the routed experts' outputs join), not a routed expert unit.
//!
//! **Dense layers among the sparse ones** (Qwen3-MoE and Qwen2-MoE: `decoder_sparse_step`,
//! `mlp_only_layers`; transformers' rule [`LlamaConfig::is_sparse_layer`]: layer `i` is sparse
//! iff `i ∉ mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`): a dense layer is one
//! [`UnitKind::Block`](crate::UnitKind::Block)`(i)` unit `model.layers.{i}`, the dense family's
//! decoder layer (the family's attention, then `mlp.{gate,up,down}_proj` of width
//! `intermediate_size`; Qwen2-MoE's has no shared expert), computed by [`crate::CausalLm`]'s
//! unit calls; a sparse layer is a trunk and its experts as above. Blocks are numbered by
//! **layer**: `MoeTrunk(i)`, `Expert { block: i, .. }` and the `block` of [`MoeLm`]'s calls are
//! the layer index `i` (a dense layer's index is refused there); unit indices from
//! [`LlamaConfig::block_unit`] and [`LlamaConfig::expert_unit`]. (The trainer's placer,
//! routing statistics and routing trace number the MoE blocks `0..` in the order of
//! [`LlamaConfig::sparse_layers`].) OLMoE and Mixtral have no dense layers.
//!
//! The load-balancing loss pools every sparse layer ([`MoeLm::finish_forward`] hands each routing the
//! pooled weights `w_e = coef · E · c_e / N²` of its probabilities, which
//! [`MoeLm::trunk_backward`] differentiates); no capacity, no tokens dropped. The router's
//! jitter noise (training-time only in transformers) is not implemented and refused in
//! `config.json` ([`crate::hf`]).

use candle_core::{DType, Tensor};

use crate::kernels::softmax_last_dim;
use crate::llama::{AttnParams, Llama, LlamaConfig};
use crate::lm::{MoeFamily, MoeLm};
use crate::moe::{ExpertRoute, Routing, TrunkOut};
use crate::ops::{self, input_err};
use crate::Result;

/// A Mixtral decoder: the [`Llama`] type with family [`LlamaFamily::Mixtral`](crate::LlamaFamily::Mixtral).
pub type Mixtral = Llama;

/// A Mixtral config: [`LlamaConfig`] with family [`LlamaFamily::Mixtral`](crate::LlamaFamily::Mixtral) and its MoE keys
/// (`num_local_experts`, `num_experts_per_tok`, `router_aux_loss_coef`, `output_router_logits`);
/// build one with [`LlamaConfig::mixtral`].
pub type MixtralConfig = LlamaConfig;

/// The chosen probabilities per token, renormalized (`sel / Σ sel`, `renormalize`: Mixtral,
/// `norm_topk_prob`) or as they are, flat `[N · k]` (slot `n · k + s`): differentiable in
/// `probs` `[N, E]` for fixed `choices` `[N, k]`.
fn gate_values(probs: &Tensor, choices: &Tensor, renormalize: bool) -> Result<Tensor> {
    let sel = probs.gather(choices, 1)?;
    if !renormalize {
        return Ok(sel.flatten_all()?);
    }
    Ok(sel.broadcast_div(&sel.sum_keepdim(1)?)?.flatten_all()?)
}

/// The `k` best experts of one row of probabilities, best first, ties to the lower index.
fn top_k_of(row: &[f64], k: usize, out: &mut Vec<u32>) {
    let start = out.len();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (e, &p) in row.iter().enumerate() {
            if out[start..].contains(&(e as u32)) {
                continue;
            }
            if best.is_none_or(|j| p > row[j]) {
                best = Some(e);
            }
        }
        out.push(best.expect("k <= E") as u32);
    }
}

impl Llama {
    fn moe_check(&self) -> Result<()> {
        if !self.config().is_moe() {
            return Err(input_err(
                "model",
                "an MoE model (family mixtral, qwen3_moe, olmoe or qwen2_moe)".into(),
                format!("family {}", self.config().family.model_type()),
            ));
        }
        Ok(())
    }

    /// The trunk: `(x1 [B, T, d], h [N, d], logits [N, E], probs [N, E])`; `probs` in F32 for
    /// half dtypes (transformers' `softmax(.., dtype=torch.float)`), the params' otherwise.
    fn mixtral_trunk_math(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let g = self.block_groups();
        let router = &p[g.router.expect("an MoE trunk has a router")];
        let n1 = self.rms_norm(x, &p[g.ln1])?;
        let x1 = (x + self.attention(&AttnParams::of_block(p, g), &n1)?)?;
        let h = self.rms_norm(&x1, &p[g.ln2])?.reshape((b * t, d))?;
        let logits = ops::matmul(&h, &router.t()?)?;
        let probs = softmax_last_dim(&ops::widen(&logits)?)?;
        // Qwen2-MoE: the shared expert, a dense part of the trunk, joins the residual stream the
        // routed experts are added to: `x1 + sigmoid(h g_sᵀ) ⊙ shared(h)`.
        let x1 = match g.shared {
            Some((gate_up, down, gate)) => {
                let s = self.mlp(&p[gate_up], None, &p[down], None, &h)?;
                let z = ops::matmul(&h, &p[gate].t()?)?;
                // sigmoid(z) = 1 / (1 + exp(-z)), composed (every op has a backward).
                let sig = (z.neg()?.exp()? + 1.0)?.recip()?;
                (x1 + s.broadcast_mul(&sig)?.reshape((b, t, d))?)?
            }
            None => x1,
        };
        Ok((x1, h, logits, probs))
    }

    /// The routing of `probs` `[N, E]`: top-k on the CPU (one host copy), gates renormalized
    /// over the chosen k (in candle, the ops [`MoeLm::trunk_backward`] differentiates), the
    /// per-block statistics the pooled load-balancing loss needs.
    fn mixtral_route(&self, probs: &Tensor, dtype: DType) -> Result<Routing> {
        let (n, e_count) = probs.dims2()?;
        let k = self.config().top_k();
        let host: Vec<f64> = probs.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let mut choices = Vec::with_capacity(n * k);
        for row in host.chunks_exact(e_count) {
            top_k_of(row, k, &mut choices);
        }
        self.mixtral_routing_of(probs, &host, choices, dtype)
    }

    /// The [`Routing`] of `probs` `[N, E]` (`host`: the same, f64 on the CPU) with the top-k
    /// `choices` `[N · k]` (checked by the caller).
    fn mixtral_routing_of(&self, probs: &Tensor, host: &[f64], choices: Vec<u32>, dtype: DType) -> Result<Routing> {
        let (n, e_count) = probs.dims2()?;
        let k = self.config().top_k();
        let device = probs.device().clone();
        let mut tokens = vec![Vec::new(); e_count];
        let mut slots = vec![Vec::new(); e_count];
        let mut top1 = vec![0usize; e_count];
        for (slot, &c) in choices.iter().enumerate() {
            let c = c as usize;
            if slot % k == 0 {
                top1[c] += 1;
            }
            tokens[c].push((slot / k) as u32);
            slots[c].push(slot as u32);
        }
        let choices_t = Tensor::from_slice(&choices, (n, k), &device)?;
        let gate_all = gate_values(probs, &choices_t, self.config().norm_topk_prob())?.to_dtype(dtype)?;
        let mut experts = Vec::with_capacity(e_count);
        for (tokens, slots) in tokens.into_iter().zip(slots) {
            let demand = tokens.len();
            experts.push(if tokens.is_empty() {
                ExpertRoute { tokens, index: None, slots: None, gates: None, demand }
            } else {
                let index = Tensor::from_slice(&tokens, demand, &device)?;
                let slot_t = Tensor::from_slice(&slots, demand, &device)?;
                let gates = gate_all.index_select(&slot_t, 0)?;
                ExpertRoute { tokens, index: Some(index), slots: Some(slot_t), gates: Some(gates), demand }
            });
        }
        let top1_fraction: Vec<f64> = top1.iter().map(|&c| c as f64 / n as f64).collect();
        let top1_fraction_t = Tensor::from_slice(&top1_fraction, e_count, &device)?.to_dtype(probs.dtype())?;
        let mut prob_sum = vec![0f64; e_count];
        for row in host.chunks_exact(e_count) {
            prob_sum.iter_mut().zip(row).for_each(|(s, &p)| *s += p);
        }
        let mean_prob = prob_sum.iter().map(|s| s / n as f64).collect();
        Ok(Routing {
            num_tokens: n,
            d_model: self.config().hidden_size,
            top_k: k,
            choices,
            choices_t,
            experts,
            capacity: None,
            top1_fraction,
            top1_fraction_t,
            mean_prob,
            prob_sum,
            aux_loss: 0.0,
            aux_weights: None,
            dtype,
            device,
        })
    }

    /// Routing replay: block `block`'s trunk forward as [`MoeLm::trunk_forward`] computes it
    /// (`x1`, `h`, the router's logits and probabilities), but routed to the given experts
    /// instead of the router's top-k: `choices` `[N · k]` (`N = B · T` rows of `x` `[B, T, d]`,
    /// row `n`'s experts at `n · k ..`, best first: the first counts as the row's top-1 in the
    /// routing's statistics), the gates those experts' probabilities
    /// (renormalized per [`LlamaConfig::norm_topk_prob`]), the load-balancing statistics counting
    /// these picks. [`MoeLm::trunk_backward`] differentiates it as it does any routing. For
    /// replaying a routing decided elsewhere (another precision, an inference engine's): the
    /// rows' outputs and gradients are then those of that routing.
    ///
    /// # Errors
    /// [`crate::Error::Input`] for a model of another family, `choices` of another length than
    /// `N · k`, an expert index `>= E`, or a row naming an expert twice; as
    /// [`MoeLm::trunk_forward`] otherwise.
    pub fn trunk_forward_routed(&self, block: usize, params: &Tensor, x: &Tensor, choices: &[u32]) -> Result<TrunkOut> {
        let mut t = crate::lm::trunk_forward(self, block, params, x)?;
        let (n, e_count) = t.probs.dims2()?;
        let k = self.config().top_k();
        if choices.len() != n * k {
            return Err(input_err(
                "routing choices",
                format!("{n} rows × top-{k} = {} experts", n * k),
                choices.len().to_string(),
            ));
        }
        for (row, c) in choices.chunks_exact(k).enumerate() {
            let repeated = c.iter().enumerate().any(|(i, e)| c[..i].contains(e));
            if c.iter().any(|&e| e as usize >= e_count) || repeated {
                return Err(input_err(
                    "routing choices",
                    format!("{k} distinct experts < {e_count} per row"),
                    format!("row {row}: {c:?}"),
                ));
            }
        }
        let host: Vec<f64> = t.probs.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        t.routing = self.mixtral_routing_of(&t.probs, &host, choices.to_vec(), params.dtype())?;
        Ok(t)
    }

    fn check_routing(&self, routing: &Routing) -> Result<()> {
        let (e, k) = (self.config().num_experts(), self.config().top_k());
        if routing.num_experts() != e || routing.top_k() != k {
            return Err(input_err(
                "routing",
                format!("a routing of this model ({e} experts, top-{k})"),
                format!("{} experts, top-{}", routing.num_experts(), routing.top_k()),
            ));
        }
        Ok(())
    }
}

/// The MoE families' trunk (`x1 = x + attn(rms(x))`, `h = rms(x1)`, Qwen2-MoE's shared expert
/// added to `x1`, the router's logits and probabilities, the [`Routing`]: top-k, gates
/// (renormalized per [`LlamaConfig::norm_topk_prob`]) in the params' dtype, index tensors
/// on `x`'s device), its SwiGLU experts (`w2(silu(w1 h_e) ⊙ w3 h_e)`) and the pooled
/// load-balancing loss through each layer's probabilities with [`Routing::aux_weights`] (from
/// [`MoeLm::finish_forward`]); the calls are [`crate::lm`]'s. Every call refuses a model of
/// another family with [`crate::Error::Input`].
impl MoeFamily for Llama {
    fn num_experts(&self) -> usize {
        self.config().num_experts()
    }

    fn trunk_unit(&self, block: usize) -> Result<usize> {
        self.moe_check()?;
        let layers = self.config().num_hidden_layers;
        if block >= layers {
            return Err(input_err("block index", format!("< {layers}"), block.to_string()));
        }
        if !self.config().is_sparse_layer(block) {
            return Err(input_err(
                "block index",
                format!("a sparse layer (one of {:?})", self.config().sparse_layers()),
                format!("{block}, a dense layer (decoder_sparse_step, mlp_only_layers): call CausalLm::forward"),
            ));
        }
        Ok(self.config().block_unit(block))
    }

    fn expert_unit0(&self) -> Result<usize> {
        self.moe_check()?;
        let first = self.config().sparse_layers()[0];
        Ok(self.config().expert_unit(first, 0))
    }

    fn trunk_math(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        self.mixtral_trunk_math(p, x)
    }

    fn route(&self, probs: &Tensor, dtype: DType) -> Result<Routing> {
        self.mixtral_route(probs, dtype)
    }

    fn expert_math(&self, p: &[Tensor], h: &Tensor) -> Result<Tensor> {
        self.mlp(&p[0], None, &p[1], None, h)
    }

    fn gate_values(&self, probs: &Tensor, choices: &Tensor, _top_k: usize) -> Result<Tensor> {
        gate_values(probs, choices, self.config().norm_topk_prob())
    }

    /// With a load-balancing loss in the objective, a routing [`MoeLm::finish_forward`] has
    /// finished.
    fn check_finished(&self, routing: &Routing) -> Result<()> {
        if self.config().aux_loss_weight() != 0.0 && routing.aux_weights.is_none() {
            return Err(input_err(
                "routing",
                "a routing finished by MoeLm::finish_forward (the pooled load-balancing weights)".into(),
                "an unfinished routing".into(),
            ));
        }
        Ok(())
    }

    fn aux_term(&self, probs: &Tensor, routing: &Routing) -> Result<Option<Tensor>> {
        if self.config().aux_loss_weight() == 0.0 {
            return Ok(None);
        }
        let (_, w) = routing.aux_weights.as_ref().expect("checked by check_finished");
        Ok(Some(probs.broadcast_mul(w)?.sum_all()?))
    }
}

/// The MoE calls of a Mixtral model (see [`MoeLm`] for their order); every call refuses a
/// model of another family with [`crate::Error::Input`].
impl MoeLm for Llama {
    fn experts_per_token(&self) -> usize {
        self.config().top_k()
    }

    crate::lm::moe_calls!();

    /// Pools the forward pass's routings (one per sparse layer, in order): `N = Σ N_i`, `c_e` the
    /// picks of expert `e` over all `N · k` choices, and gives each routing the weights
    /// `w_e = coef · E · c_e / N²` of its probabilities in the objective
    /// ([`Routing::aux_weights`]) and its share `Σ_e w_e Σ_n p[n, e]` of the loss
    /// ([`Routing::aux_loss`]). `coef` is [`LlamaConfig::aux_loss_weight`].
    ///
    /// # Errors
    /// [`crate::Error::Input`] for a routing of another model (experts, top-k).
    fn finish_forward(&self, routings: &mut [&mut Routing]) -> Result<()> {
        self.moe_check()?;
        for r in routings.iter() {
            self.check_routing(r)?;
        }
        let e_count = self.config().num_experts();
        let n: usize = routings.iter().map(|r| r.num_tokens).sum();
        if n == 0 {
            return Ok(());
        }
        let mut picks = vec![0f64; e_count];
        for r in routings.iter() {
            for (c, route) in picks.iter_mut().zip(&r.experts) {
                *c += route.demand as f64;
            }
        }
        let coef = self.config().aux_loss_weight();
        let scale = coef * e_count as f64 / (n as f64 * n as f64);
        let w: Vec<f64> = picks.iter().map(|c| scale * c).collect();
        for r in routings.iter_mut() {
            let wt = Tensor::from_slice(&w, e_count, &r.device)?.to_dtype(r.top1_fraction_t.dtype())?;
            r.aux_loss = w.iter().zip(&r.prob_sum).map(|(w, p)| w * p).sum();
            r.aux_weights = Some((w.clone(), wt));
        }
        Ok(())
    }

    /// `coef · E · Σ_e (c_e / N)(P_e / N)` over the pass's routings (see
    /// [`MoeLm::finish_forward`]; `P_e` the probability sums over all `N` rows).
    fn aux_loss(&self, routings: &[&Routing]) -> f64 {
        let e_count = self.config().num_experts();
        let n: usize = routings.iter().map(|r| r.num_tokens).sum();
        if n == 0 || e_count == 0 {
            return 0.0;
        }
        let (mut picks, mut probs) = (vec![0f64; e_count], vec![0f64; e_count]);
        for r in routings {
            for e in 0..e_count.min(r.num_experts()) {
                picks[e] += r.experts[e].demand as f64;
                probs[e] += r.prob_sum[e];
            }
        }
        let n = n as f64;
        let sum: f64 = picks.iter().zip(&probs).map(|(c, p)| (c / n) * (p / n)).sum();
        self.config().aux_loss_weight() * e_count as f64 * sum
    }
}

#[cfg(test)]
mod tests;
