//! The Llama family of decoders — Llama 2/3 (Touvron et al. 2023; Grattafiori et al. 2024),
//! Mistral without sliding window (Jiang et al. 2023), Qwen2 (Yang et al. 2024), Qwen3 (Yang et
//! al. 2025: an RMSNorm over each head of q and k, `self_attn.{q,k}_norm` `[hd]`, after the
//! projections and before RoPE) — on candle, cut
//! into **units** whose parameters are each one flat vector, with the Hugging Face tensor names
//! and layouts so that a checkpoint's tensors *are* the units' flat vectors ([`crate::hf`]).
//!
//! | unit index | kind | name | parameters | input → output |
//! |---|---|---|---|---|
//! | 0 | [`UnitKind::Embedding`] | `model.embed_tokens` | `model.embed_tokens.weight` `[V, d]` | tokens `[B, T]` U32 → `[B, T, d]` |
//! | `1 + i` | [`UnitKind::Block`]`(i)` | `model.layers.{i}` | `input_layernorm`, `self_attn.{q,k,v,o}_proj` (+ biases), `post_attention_layernorm`, `mlp.{gate,up,down}_proj` | `[B, T, d]` → `[B, T, d]` |
//! | `L + 1` | [`UnitKind::Head`] | `head` | `model.norm.weight` `[d]`, `lm_head.weight` `[V, d]` (untied only) | `[B, T, d]` → logits `[B, T, V]` |
//!
//! (exact layouts in [`LlamaConfig::units`].) The math is transformers' `modeling_llama.py`
//! (and `modeling_qwen2.py`, `modeling_qwen3.py`, `modeling_mistral.py`), in its float32 form:
//!
//! ```text
//! embed : x = embed_tokens[tokens]
//! layer : h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1))),  n1 = rms_norm(x, input_layernorm)
//!         y = h + down_proj(silu(gate_proj(n2)) ⊙ up_proj(n2)),                  n2 = rms_norm(h, post_attention_layernorm)
//! head  : logits = rms_norm(x, model.norm) lm_headᵀ        (lm_head = embed_tokens when tied)
//! loss  : mean over targets ≠ IGNORE_INDEX of logsumexp(logits) − logits[target]
//! ```
//!
//! - Linear layers keep the checkpoint's `[out, in]` weights: `y = x Wᵀ + b`.
//! - RMSNorm `w ⊙ (x / sqrt(mean(x²) + eps))` (Zhang & Sennrich 2019), statistics in F32.
//! - RoPE (Su et al. 2021) on q and k with transformers' `rotate_half` pairing (`i` with
//!   `i + hd/2`), positions `0..T`, frequencies per [`RopeScaling`] (default, linear, llama3).
//! - Grouped-query attention (Ainslie et al. 2023): query head `h` reads key/value head
//!   `h / (H / KV)` (transformers' `repeat_kv`), computed without repeating k and v: the queries
//!   of a group are stacked along the sequence axis (`[B, KV, (H/KV)·T, hd]`) and multiply their
//!   group's keys once. Scores scaled by `1/sqrt(hd)`, causal softmax. The op compositions
//!   compute it over blocks of query positions ([`crate::attention`],
//!   [`CausalLm::with_attention_chunk`]): no tensor of the whole sequence's `[B, H, T, T]` scores,
//!   forward or backward.
//! - SwiGLU MLP (Shazeer 2020); `gate_proj` and `up_proj` run as one `[2I, d]` matmul (their
//!   tensors are adjacent in the flat vector).
//!
//! On `Device::Cpu` in F32/F64 RMSNorm, RoPE (with the head transpose and the score scale),
//! SwiGLU, the causal softmax and the cross-entropy run as fused kernels with their own backward
//! (`kernels/`, each op's kernel beside its composition); other devices and dtypes take op compositions
//! that all have a backward (candle-nn's fused `rms_norm`, `softmax_last_dim` and `rope` have
//! none, DESIGN.md "Traps"). Both paths are checked against finite differences and against each
//! other, and against transformers' logits, loss and gradients (`shared/fixtures/llama`).
//!
//! Half dtypes (BF16, F16) always take the op compositions and compute as transformers and
//! torch do under bf16: matmuls, RoPE products, SwiGLU's product and the residual adds in the
//! half dtype (BF16 matmuls on the CPU through F32, as a GPU's BF16 GEMM accumulates in F32);
//! RMSNorm statistics, RoPE tables, the attention softmax (transformers' eager `softmax(..,
//! dtype=torch.float32).to(query.dtype)`), the `silu`, Mixtral's router softmax and gates, and
//! the cross-entropy in F32; and every gradient that sums over tokens (norm weights, biases, the
//! embedding's scatter-add) accumulated in F32, then rounded once to the params' dtype. Checked
//! against transformers' f32 oracle in BF16 (`hf/tests.rs`, `mixtral/tests.rs`).
//!
//! One training step runs unit by unit exactly as for the GPT ([`crate::lm`], activation
//! checkpointing): [`crate::lm::loss_and_grads`] is that loop in memory. The unit calls are
//! [`crate::lm`]'s; this module gives the family's embedding, decoder layer and head, and the
//! fused CPU path's own backward of a layer and of the head's loss. A tied head takes the
//! embedding unit's flat vector (`tied`) and returns its gradient as
//! [`UnitGrads::grad_tied_wte`]. Threads: as the GPT (`RAYON_NUM_THREADS`, see [`crate::gpt`]).
//!
//! The attention (`Llama::attention`, crate-private) and the SwiGLU MLP are separate pieces over
//! views of the layer's groups so that an MoE layer (Mixtral: the same attention, experts as
//! units) can reuse them.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::attention::{self, AttentionBytes, AttentionShape};
use crate::compute::Compute;
use crate::kernels;
use crate::lm::{CausalLm, Family, HeadLossGrads, UnitGrads};
use crate::ops::{self, scalar};
use crate::unit::{UnitKind, UnitSpec};
use crate::Result;

mod config;
mod layer;
mod rope;
#[cfg(test)]
mod tests;

pub use config::{LlamaConfig, LlamaFamily, RopeScaling};

/// The source text of [`LlamaConfig`]'s file: the `oogc` crate's config reference reads the
/// `[model]` keys of the Llama family (their doc comments and types) from it.
pub const CONFIG_SOURCE: &str = include_str!("config.rs");

use config::BlockGroups;

/// A computation group of a unit's flat vector: `(offset, shape)`.
type Group = (usize, Vec<usize>);

/// The RoPE tables of one `(T, dtype, device, path)`.
#[derive(Clone)]
struct Tables {
    seq_len: usize,
    dtype: DType,
    device: Device,
    fused: bool,
    /// Fused: `[T, hd/2]`; composed: `[T, hd]` (the half repeated, as transformers' `emb`).
    cos: Tensor,
    sin: Tensor,
}

/// The projections of one attention (views of a layer's groups): `[out, in]` weights and
/// optional biases.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnParams<'a> {
    pub q_w: &'a Tensor,
    pub q_b: Option<&'a Tensor>,
    pub k_w: &'a Tensor,
    pub k_b: Option<&'a Tensor>,
    pub v_w: &'a Tensor,
    pub v_b: Option<&'a Tensor>,
    pub o_w: &'a Tensor,
    pub o_b: Option<&'a Tensor>,
    /// Qwen3: the per-head RMSNorm weights of q and k, `[hd]` each.
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
}

impl<'a> AttnParams<'a> {
    pub(crate) fn of_block(p: &'a [Tensor], g: &BlockGroups) -> Self {
        Self {
            q_w: &p[g.q_w],
            q_b: g.q_b.map(|i| &p[i]),
            k_w: &p[g.k_w],
            k_b: g.k_b.map(|i| &p[i]),
            v_w: &p[g.v_w],
            v_b: g.v_b.map(|i| &p[i]),
            o_w: &p[g.o_w],
            o_b: g.o_b.map(|i| &p[i]),
            q_norm: g.q_norm.map(|i| &p[i]),
            k_norm: g.k_norm.map(|i| &p[i]),
        }
    }
}

/// A Llama-family decoder ([`LlamaConfig`]), computed one unit at a time through its
/// [`CausalLm`] calls.
///
/// Holds the configuration, the unit layouts and a small cache of RoPE tables; no parameters and
/// no activations. Every call takes a unit's flat parameters (a 1-D [`Tensor`] of
/// [`UnitSpec::numel`] elements on any candle device, dtype F32, F64, BF16, or F16 where the
/// device has matmuls for it; BF16 on the CPU multiplies through F32) and computes in that dtype.
/// Half dtypes (BF16/F16, always the op compositions) compute as transformers and torch do:
/// RMSNorm statistics, the attention softmax, RoPE tables, the router's softmax and gates
/// (Mixtral) and the loss in F32, and every reduction over tokens in F32 (the norm weights'
/// and biases' gradients, the embedding's scatter-add of its rows' gradients). `Llama` is
/// `Send + Sync`; calls may run concurrently.
pub struct Llama {
    config: LlamaConfig,
    units: Vec<UnitSpec>,
    /// Computation groups of each unit's flat vector (every parameter, but gate/up merged).
    groups: Vec<Vec<Group>>,
    /// Where the groups of a layer unit sit: an MoE trunk's (MoE families), else a dense
    /// layer's.
    block: BlockGroups,
    /// Where the groups of a dense layer unit sit (a dense family's layers, or the dense layers
    /// among an MoE family's sparse ones).
    dense: BlockGroups,
    tables: Mutex<Vec<Tables>>,
    /// The fused kernels on or off, the composed attention's chunk and masks.
    compute: Compute,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Llama {
    /// Validates `config` and computes the unit layouts. The model keeps
    /// [`LlamaConfig::resolved`]`(config)`.
    ///
    /// # Errors
    /// [`crate::Error::Config`] from [`LlamaConfig::validate`].
    pub fn new(config: LlamaConfig) -> Result<Self> {
        config.validate()?;
        let config = config.resolved();
        let units = config.units();
        let (block_groups, block) = config.block_groups();
        let (dense_groups, dense) = config.dense_block_groups();
        let groups = units
            .iter()
            .map(|u| match u.kind {
                UnitKind::Block(_) => dense_groups.clone(),
                UnitKind::MoeTrunk(_) => block_groups.clone(),
                UnitKind::Expert { .. } => config.expert_groups(),
                _ => u.params.iter().map(|p| (p.offset, p.shape.clone())).collect(),
            })
            .collect();
        Ok(Self { config, units, groups, block, dense, tables: Mutex::new(Vec::new()), compute: Compute::default() })
    }

    /// The configuration (with its defaults resolved).
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The units in forward order (`num_hidden_layers + 2`), as [`LlamaConfig::units`].
    pub fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    // ---- pieces (shared with an MoE layer) ----------------------------------------------------

    /// RMSNorm of `x` `[.., d]` with weight `w` `[d]` and the config's eps.
    pub(crate) fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        kernels::rms_norm(x, w, self.config.rms_norm_eps, self.compute.fused(x))
    }

    /// `x Wᵀ (+ b)`: `x` `[N, in]`, `w` `[out, in]`, `b` `[out]` → `[N, out]`.
    fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, fused: bool) -> Result<Tensor> {
        let y = ops::matmul(x, &w.t()?)?;
        match b {
            None => Ok(y),
            Some(b) => kernels::bias_add(&y, b, fused),
        }
    }

    /// The self-attention of a layer on its normed input `h` `[B, T, d]` → `[B, T, d]` (before
    /// the residual add): projections, (Qwen3) an RMSNorm per head on q and k, RoPE on q and k,
    /// grouped-query causal attention scaled by `1/sqrt(hd)`, `o_proj` (transformers' `LlamaAttention.forward` with the eager kernel).
    /// The op compositions run the attention core over query blocks ([`crate::attention`]).
    pub(crate) fn attention(&self, p: &AttnParams<'_>, h: &Tensor) -> Result<Tensor> {
        let (b, t, d) = h.dims3()?;
        let (nh, kv, hd) = (self.config.num_attention_heads, self.config.kv_heads(), self.config.head_dim());
        let n = b * t;
        let fused = self.compute.fused(h);
        let h = h.reshape((n, d))?;
        let q = self.linear(&h, p.q_w, p.q_b, fused)?;
        let k = self.linear(&h, p.k_w, p.k_b, fused)?;
        // Qwen3: an RMSNorm over each head's hd values (transformers' `Qwen3Attention`); OLMoE:
        // over the whole projection (`OlmoeAttention`): the rows are the weight's width.
        let qk_norm = |x: Tensor, w: Option<&Tensor>| -> Result<Tensor> {
            match w {
                Some(w) => Ok(self.rms_norm(&x.reshape(((), w.dim(0)?))?, w)?.reshape(x.dims())?),
                None => Ok(x),
            }
        };
        let q = qk_norm(q, p.q_norm)?.reshape((b, t, nh, hd))?;
        let k = qk_norm(k, p.k_norm)?.reshape((b, t, kv, hd))?;
        let v = self.linear(&h, p.v_w, p.v_b, fused)?.reshape((b, t, kv, hd))?;
        let tab = self.tables(t, h.dtype(), h.device(), fused)?;
        let scale = 1.0 / (hd as f64).sqrt();
        // [B, nh, T, hd], [B, KV, T, hd]
        let q = kernels::rope(&q, &tab.cos, &tab.sin, scale, fused)?;
        let k = kernels::rope(&k, &tab.cos, &tab.sin, 1.0, fused)?;
        // [B, KV, T, hd]
        let v = v.transpose(1, 2)?.contiguous()?;
        // [B, T, H, hd]
        let y = self.compute.attention(&q, &k, &v, fused)?.reshape((n, nh * hd))?;
        Ok(self.linear(&y, p.o_w, p.o_b, fused)?.reshape((b, t, d))?)
    }

    /// The SwiGLU MLP on its normed input `h` `[B, T, d]` → `[B, T, d]` (before the residual
    /// add): `down(silu(gate h) ⊙ up h)` with `gate_up_w` `[2I, d]` (gate rows, then up rows),
    /// `down_w` `[d, I]` (transformers' `LlamaMLP`). Shared with MoE experts.
    pub(crate) fn mlp(
        &self,
        gate_up_w: &Tensor,
        gate_up_b: Option<&Tensor>,
        down_w: &Tensor,
        down_b: Option<&Tensor>,
        h: &Tensor,
    ) -> Result<Tensor> {
        let dims = h.dims().to_vec();
        let d = *dims.last().expect("rank >= 1");
        let fused = self.compute.fused(h);
        let h = h.reshape(((), d))?;
        let gu = self.linear(&h, gate_up_w, gate_up_b, fused)?;
        let a = kernels::swiglu(&gu, fused)?;
        Ok(self.linear(&a, down_w, down_b, fused)?.reshape(dims)?)
    }

    // ---- units ---------------------------------------------------------------------------------

    /// Embedding: `embed_tokens[tokens]` → `[B, T, d]`.
    fn embed_math(&self, w: &Tensor, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        Ok(w.index_select(&tokens.flatten_all()?, 0)?.reshape((b, t, self.config.hidden_size))?)
    }

    /// Decoder layer (transformers' `LlamaDecoderLayer`): pre-norm attention and MLP, each with
    /// a residual add.
    fn block_math(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        // Outside a graph (no Var among the inputs) the fused CPU path runs the layer.rs forward,
        // the one its hand-written backward recomputes.
        if self.compute.fused(x) && !x.track_op() && p.iter().all(|t| !t.track_op()) {
            return self.block_math_fused(p, x);
        }
        let g = &self.dense;
        let h = self.rms_norm(x, &p[g.ln1])?;
        let x = (x + self.attention(&AttnParams::of_block(p, g), &h)?)?;
        let h = self.rms_norm(&x, &p[g.ln2])?;
        let m = self.mlp(&p[g.gate_up_w], g.gate_up_b.map(|i| &p[i]), &p[g.down_w], g.down_b.map(|i| &p[i]), &h)?;
        Ok((x + m)?)
    }

    /// Head: `rms_norm(x, norm_w) w_outᵀ` → logits `[B, T, V]`; `w_out` is `[V, d]`.
    fn head_math(&self, norm_w: &Tensor, w_out: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let h = self.rms_norm(x, norm_w)?.reshape((b * t, d))?;
        Ok(ops::matmul(&h, &w_out.t()?)?.reshape((b, t, self.config.vocab_size))?)
    }

    /// The mean cross-entropy of `logits` `[B, T, V]` over the `count` targets that are not
    /// ignored, as a scalar tensor (F32 for half dtypes, as transformers upcasts the logits).
    fn loss_math(&self, logits: &Tensor, targets: &Tensor, count: usize) -> Result<Tensor> {
        kernels::cross_entropy(logits, targets, count, self.compute.fused(logits))
    }

    // ---- helpers -------------------------------------------------------------------------------

    /// The RoPE tables for `(t, dtype, device)`, cached (at most 8 entries).
    fn tables(&self, t: usize, dtype: DType, device: &Device, fused: bool) -> Result<Tables> {
        let mut cache = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = cache
            .iter()
            .find(|e| e.seq_len == t && e.dtype == dtype && e.fused == fused && e.device.same_device(device))
        {
            return Ok(e.clone());
        }
        let precision = if dtype == DType::F64 { rope::Precision::F64 } else { rope::Precision::F32 };
        let (cos, sin) = rope::tables(&self.config, t, precision);
        let half = self.config.head_dim() / 2;
        let table = |v: Vec<f64>| -> Result<Tensor> {
            let v = Tensor::from_vec(v, (t, half), device)?;
            let v = if fused { v } else { Tensor::cat(&[&v, &v], 1)? };
            // Via F32 as transformers (`cos.to(x.dtype)` from its f32 tables), F64 directly.
            let v = if dtype == DType::F64 { v } else { v.to_dtype(DType::F32)? };
            Ok(v.to_dtype(dtype)?)
        };
        let (cos, sin) = (table(cos)?, table(sin)?);
        let e = Tables { seq_len: t, dtype, device: device.clone(), fused, cos, sin };
        if cache.len() >= 8 {
            cache.remove(0);
        }
        cache.push(e.clone());
        Ok(e)
    }

    /// Where each group of a decoder layer (Mixtral: a trunk) sits.
    pub(crate) fn block_groups(&self) -> &BlockGroups {
        &self.block
    }
}

/// `flat[off .. off + numel(shape)]` viewed as `shape`.
fn group_view(flat: &Tensor, off: usize, shape: &[usize]) -> candle_core::Result<Tensor> {
    flat.narrow(0, off, shape.iter().product())?.reshape(shape)
}

/// The Llama family's embedding, decoder layer and head, with the fused CPU path's own
/// backward of a layer and of the head's loss (`layer.rs`); the unit calls are [`crate::lm`]'s.
impl Family for Llama {
    /// Views of unit `unit`'s computation groups (`[2I, d]` gate/up merged) into its flat
    /// vector (no copy).
    fn views(&self, unit: usize, flat: &Tensor) -> Result<Vec<Tensor>> {
        self.groups[unit].iter().map(|(off, shape)| Ok(group_view(flat, *off, shape)?)).collect()
    }

    fn tie_names(&self) -> (&'static str, &'static str) {
        ("tied", "tie_word_embeddings = true")
    }

    fn embed(&self, p: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
        self.embed_math(&p[0], tokens)
    }

    fn block(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        self.block_math(p, x)
    }

    /// `rms_norm(x, model.norm) lm_headᵀ`, `lm_head` the head's `[V, d]` or the tied embedding.
    fn head(&self, p: &[Tensor], tied: Option<&Tensor>, x: &Tensor) -> Result<Tensor> {
        let w_out = match tied {
            Some(w) => w.clone(),
            None => p[1].clone(),
        };
        self.head_math(&p[0], &w_out, x)
    }

    fn loss(&self, logits: &Tensor, targets: &Tensor, count: usize) -> Result<Tensor> {
        self.loss_math(logits, targets, count)
    }

    /// The fused CPU path (`Device::Cpu`, F32/F64): the hand-written backward of `layer.rs`.
    fn own_block_backward(
        &self,
        unit: usize,
        params: &Tensor,
        x: &Tensor,
        grad_y: &Tensor,
    ) -> Result<Option<UnitGrads>> {
        if !self.compute.fused(x) {
            return Ok(None);
        }
        let (grad_params, gx) = self.block_backward_fused(&self.views(unit, params)?, x, grad_y)?;
        Ok(Some(UnitGrads { grad_params, grad_input: Some(gx), grad_tied_wte: None }))
    }

    /// The fused CPU path (`Device::Cpu`, F32/F64): the hand-written backward of `layer.rs`.
    fn own_head_loss_backward(
        &self,
        params: &Tensor,
        x: &Tensor,
        tied: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<Option<HeadLossGrads>> {
        if !self.compute.fused(x) {
            return Ok(None);
        }
        let p = self.views(self.units.len() - 1, params)?;
        let w_out = match crate::lm::tied_view(self, tied, params.dtype())? {
            Some(w) => w,
            None => p[1].clone(),
        };
        let (b, t, _) = x.dims3()?;
        let tokens = ops::check_targets(targets, &[b, t], self.config.vocab_size)?;
        let (loss, gx, g_norm, g_out) = self.head_loss_backward_fused(&p[0], &w_out, x, targets, tokens)?;
        let (grad_params, grad_tied_wte) = if self.config.tie_word_embeddings {
            (g_norm, Some(g_out.flatten_all()?))
        } else {
            (Tensor::cat(&[&g_norm, &g_out.flatten_all()?], 0)?, None)
        };
        let grads = UnitGrads { grad_params, grad_input: Some(gx), grad_tied_wte };
        Ok(Some(HeadLossGrads { loss: scalar(&loss)?, tokens, grads }))
    }
}

/// The unit calls (the model's API; see [`crate::lm`] for the step they make up).
impl CausalLm for Llama {
    fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn tied_head(&self) -> bool {
        self.config.tie_word_embeddings
    }

    crate::lm::unit_calls!();

    /// Mixtral's MoE calls ([`crate::mixtral`]); `None` for the dense families.
    fn moe(&self) -> Option<&dyn crate::MoeLm> {
        if self.config.is_moe() {
            Some(self)
        } else {
            None
        }
    }

    fn compute(&self) -> &Compute {
        &self.compute
    }

    fn compute_mut(&mut self) -> &mut Compute {
        &mut self.compute
    }

    fn dims(&self) -> crate::Dims {
        let c = &self.config;
        crate::Dims {
            hidden: c.hidden_size,
            intermediate: if c.is_moe() { c.expert_intermediate_size() } else { c.intermediate_size },
            heads: c.num_attention_heads,
            layers: c.num_hidden_layers,
        }
    }

    /// As the trait's, with attention over `heads × head_dim` on every decoder layer and the
    /// head's output projection `2 · vocab · hidden · tokens`, tied or not.
    fn forward_flops(&self, unit: usize, tokens: usize, seq_len: usize) -> f64 {
        let spec = &self.units[unit];
        let c = &self.config;
        match spec.kind {
            UnitKind::Embedding => 0.0,
            UnitKind::Head => 2.0 * (c.vocab_size * c.hidden_size) as f64 * tokens as f64,
            UnitKind::Block(_) | UnitKind::MoeTrunk(_) => {
                2.0 * spec.numel as f64 * tokens as f64
                    + crate::lm::attention_flops(seq_len, c.num_attention_heads * c.head_dim(), tokens)
            }
            UnitKind::Expert { .. } => 2.0 * spec.numel as f64 * tokens as f64,
        }
    }

    /// The composed path's attention core over `num_attention_heads` query heads, `kv_heads`
    /// key/value heads of `head_dim`, in blocks of [`CausalLm::attention_chunk`] (or the default)
    /// query positions. (The fused CPU kernels, F32/F64 on `Device::Cpu`, hold the whole
    /// sequence's scores: [`attention::attention_workspace_bytes`] with `chunk = seq_len`.)
    fn attention_workspace(&self, batch: usize, seq_len: usize, dtype: DType) -> AttentionBytes {
        let c = &self.config;
        let shape = AttentionShape {
            batch,
            seq_len,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
        };
        attention::attention_workspace_bytes(shape, shape.chunk(self.compute.attention_chunk()), dtype)
    }
}
