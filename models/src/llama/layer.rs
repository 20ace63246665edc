//! The decoder layer on the fused CPU path with a hand-written backward.
//!
//! Through candle's autograd every graph node costs its backward a zero-filled gradient buffer
//! and an add (`GradStore::or_insert` then `add`), reshapes and transposes included: on a layer
//! that is a dozen extra passes over activation-sized tensors, allocations and page faults. Here
//! the forward keeps what the backward needs ([`AttnCache`], [`MlpCache`]) and the backward is
//! the chain rule written out, with the same matmuls candle's autograd would run and the fused
//! kernels' own backward passes. The math is the same as the autograd path's (checked equal in
//! `tests.rs`, against finite differences and against transformers' gradients):
//!
//! ```text
//! attention: n = rms_norm(x)  q,k,v = n Wᵀ (+b)  (Qwen3: q,k = rms_norm per head)
//!            Q = rope(q)/sqrt(hd)  K = rope(k)
//!            S = Q Kᵀ (grouped)  P = causal_softmax(S)  A = P V  o = A Woᵀ (+b)
//! backward : gA = go Wo   gP = gA Vᵀ   gV = Pᵀ gA   gS = P ⊙ (gP − rowsum(gP ⊙ P))
//!            gQ = gS K    gK = gSᵀ Q   gq = rope⁻¹(gQ)/sqrt(hd) ...  gW = gyᵀ x_in
//! mlp      : gu = n [Wg; Wu]ᵀ  a = silu(g) ⊙ u  m = a Wdᵀ;  backward likewise
//! ```

use candle_core::Tensor;

use super::{AttnParams, Llama};
use crate::kernels::{self, rms_norm_backward, rms_norm_fused};
use crate::Result;

/// What the attention's backward needs from its forward (fused CPU path).
pub(crate) struct AttnCache {
    /// The normed input `[N, d]`.
    h: Tensor,
    /// Queries after RoPE and the `1/sqrt(hd)` scale, grouped: `[B, KV, rep·T, hd]`.
    q: Tensor,
    /// Keys after RoPE `[B, KV, T, hd]`.
    k: Tensor,
    /// Values `[B, KV, T, hd]`.
    v: Tensor,
    /// Attention probabilities `[B, H, T, T]`.
    p: Tensor,
    /// The heads' outputs merged, `o_proj`'s input `[N, H·hd]`.
    y: Tensor,
    /// Qwen3 (OLMoE): q and k before their RMSNorm, as rows of the norm's width.
    q_pre_norm: Option<Tensor>,
    k_pre_norm: Option<Tensor>,
    /// The RoPE tables `[T, hd/2]`.
    cos: Tensor,
    sin: Tensor,
    dims: (usize, usize),
}

/// Gradients of an attention's projections, `None` for absent biases.
pub(crate) struct AttnGrads {
    pub q_w: Tensor,
    pub q_b: Option<Tensor>,
    pub k_w: Tensor,
    pub k_b: Option<Tensor>,
    pub v_w: Tensor,
    pub v_b: Option<Tensor>,
    pub o_w: Tensor,
    pub o_b: Option<Tensor>,
    /// Qwen3: the q/k norms' weights `[hd]`.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
}

/// What the MLP's backward needs from its forward.
pub(crate) struct MlpCache {
    /// The normed input `[N, d]`.
    h: Tensor,
    /// Gate and up projections `[N, 2I]`.
    gu: Tensor,
    /// `silu(gate) ⊙ up` `[N, I]`.
    a: Tensor,
}

/// Gradients of an MLP's weights (`gate_up` is `[2I, d]`), `None` for absent biases.
pub(crate) struct MlpGrads {
    pub gate_up_w: Tensor,
    pub gate_up_b: Option<Tensor>,
    pub down_w: Tensor,
    pub down_b: Option<Tensor>,
}

/// `x Wᵀ (+ b)` with the fused bias add.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => kernels::bias_add(&y, b, true)?,
        None => y,
    })
}

/// The q/k RMSNorm of projections `y` `[N, heads·hd]` with weight `w` `[width]` (none: `y` as it
/// is), viewed as rows of `width`: Qwen3's per head (`width = hd`, rows `[N·heads, hd]`), OLMoE's
/// over the whole projection (`width = heads·hd`). Returns `(normed [N, heads·hd], the rows for
/// the backward)`.
fn head_norm(y: Tensor, w: Option<&Tensor>, eps: f64) -> Result<(Tensor, Option<Tensor>)> {
    let Some(w) = w else { return Ok((y, None)) };
    let dims = y.dims().to_vec();
    let rows = y.reshape(((), w.dim(0)?))?;
    Ok((rms_norm_fused(&rows, w, eps)?.reshape(dims)?, Some(rows)))
}

/// The backward of [`head_norm`] for `g` `[N, heads·hd]`: `(gradient of y, of w)`.
fn head_norm_backward(
    rows: Option<Tensor>,
    w: Option<&Tensor>,
    g: Tensor,
    eps: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    let (Some(rows), Some(w)) = (rows, w) else { return Ok((g, None)) };
    let (gy, gw) = rms_norm_backward(&rows, w, &g.reshape(rows.dims())?, eps)?;
    Ok((gy.reshape(g.dims())?, Some(gw)))
}

/// Backward of `y = x Wᵀ (+ b)` for `gy` `[N, out]`: `(gx = gy W, gW = gyᵀ x, gb = Σ_rows gy)`.
fn linear_backward(x: &Tensor, w: &Tensor, has_bias: bool, gy: &Tensor) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let gx = gy.matmul(w)?;
    let gw = gy.t()?.matmul(x)?;
    let gb = if has_bias { Some(kernels::row_sum_tensor(gy)?) } else { None };
    Ok((gx, gw, gb))
}

impl Llama {
    /// The attention on its normed input `h` `[B, T, d]` → `o` `[N, d]` (`N = B·T`, before the
    /// residual), keeping what [`Llama::attention_backward_fused`] needs. Fused CPU path only.
    pub(crate) fn attention_forward_fused(&self, a: &AttnParams<'_>, h: &Tensor) -> Result<(Tensor, AttnCache)> {
        let (b, t, d) = h.dims3()?;
        let (nh, kv, hd) = (self.config.num_attention_heads, self.config.kv_heads(), self.config.head_dim());
        let rep = nh / kv;
        let n = b * t;
        let h = h.reshape((n, d))?;
        let tab = self.tables(t, h.dtype(), h.device(), true)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let eps = self.config.rms_norm_eps;
        let (q, q_pre_norm) = head_norm(linear(&h, a.q_w, a.q_b)?, a.q_norm, eps)?;
        let (k, k_pre_norm) = head_norm(linear(&h, a.k_w, a.k_b)?, a.k_norm, eps)?;
        let q = kernels::rope_fused(&q.reshape((b, t, nh, hd))?, &tab.cos, &tab.sin, scale)?;
        let k = kernels::rope_fused(&k.reshape((b, t, kv, hd))?, &tab.cos, &tab.sin, 1.0)?;
        let v = linear(&h, a.v_w, a.v_b)?.reshape((b, t, kv, hd))?.transpose(1, 2)?.contiguous()?;
        let q = q.reshape((b, kv, rep * t, hd))?;
        let p = kernels::causal_softmax(&q.matmul(&k.t()?)?.reshape((b, nh, t, t))?)?;
        let y = p
            .reshape((b, kv, rep * t, t))?
            .matmul(&v)?
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((n, nh * hd))?;
        let o = linear(&y, a.o_w, a.o_b)?;
        Ok((o, AttnCache { h, q, k, v, p, y, q_pre_norm, k_pre_norm, cos: tab.cos, sin: tab.sin, dims: (b, t) }))
    }

    /// The backward of [`Llama::attention_forward_fused`] for `go` `[N, d]`: the gradient of its
    /// normed input `[N, d]` and of the projections.
    pub(crate) fn attention_backward_fused(
        &self,
        a: &AttnParams<'_>,
        c: AttnCache,
        go: &Tensor,
    ) -> Result<(Tensor, AttnGrads)> {
        let (b, t) = c.dims;
        let (nh, kv, hd) = (self.config.num_attention_heads, self.config.kv_heads(), self.config.head_dim());
        let rep = nh / kv;
        let n = b * t;
        let scale = 1.0 / (hd as f64).sqrt();
        let (gy, o_w, o_b) = linear_backward(&c.y, a.o_w, a.o_b.is_some(), go)?;
        drop(c.y);
        // [N, H·hd] → [B, KV, rep·T, hd]
        let ga = gy.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous()?.reshape((b, kv, rep * t, hd))?;
        let p = c.p.reshape((b, kv, rep * t, t))?;
        let gp = ga.matmul(&c.v.t()?)?; // [B, KV, rep·T, T]
        let gv = p.t()?.matmul(&ga)?; // [B, KV, T, hd]
        drop(ga);
        let gs = kernels::causal_softmax_backward(&c.p, &gp.reshape((b, nh, t, t))?)?.reshape((b, kv, rep * t, t))?;
        drop((gp, p, c.p));
        let gq = gs.matmul(&c.k)?; // [B, KV, rep·T, hd]
        let gk = gs.t()?.matmul(&c.q)?; // [B, KV, T, hd]
        drop(gs);
        let gq = kernels::rope_backward(&gq.reshape((b, nh, t, hd))?, &c.cos, &c.sin, scale)?.reshape((n, nh * hd))?;
        let gk = kernels::rope_backward(&gk, &c.cos, &c.sin, 1.0)?.reshape((n, kv * hd))?;
        let eps = self.config.rms_norm_eps;
        let (gq, q_norm) = head_norm_backward(c.q_pre_norm, a.q_norm, gq, eps)?;
        let (gk, k_norm) = head_norm_backward(c.k_pre_norm, a.k_norm, gk, eps)?;
        let gv = gv.transpose(1, 2)?.contiguous()?.reshape((n, kv * hd))?;
        let (gh_q, q_w, q_b) = linear_backward(&c.h, a.q_w, a.q_b.is_some(), &gq)?;
        let (gh_k, k_w, k_b) = linear_backward(&c.h, a.k_w, a.k_b.is_some(), &gk)?;
        let (gh_v, v_w, v_b) = linear_backward(&c.h, a.v_w, a.v_b.is_some(), &gv)?;
        let gh = ((gh_q + gh_k)? + gh_v)?;
        Ok((gh, AttnGrads { q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, q_norm, k_norm }))
    }

    /// The SwiGLU MLP on its normed input `h` `[N, d]` → `[N, d]`, keeping what
    /// [`Llama::mlp_backward_fused`] needs. Fused CPU path only; shared with MoE experts.
    pub(crate) fn mlp_forward_fused(
        &self,
        gate_up_w: &Tensor,
        gate_up_b: Option<&Tensor>,
        down_w: &Tensor,
        down_b: Option<&Tensor>,
        h: &Tensor,
    ) -> Result<(Tensor, MlpCache)> {
        let gu = linear(h, gate_up_w, gate_up_b)?;
        let a = kernels::swiglu_fused(&gu)?;
        let m = linear(&a, down_w, down_b)?;
        Ok((m, MlpCache { h: h.clone(), gu, a }))
    }

    /// The backward of [`Llama::mlp_forward_fused`] for `gm` `[N, d]`: the gradient of its input
    /// and of its weights.
    pub(crate) fn mlp_backward_fused(
        &self,
        gate_up_w: &Tensor,
        has_gate_up_b: bool,
        down_w: &Tensor,
        has_down_b: bool,
        c: MlpCache,
        gm: &Tensor,
    ) -> Result<(Tensor, MlpGrads)> {
        let (ga, down_w_g, down_b_g) = linear_backward(&c.a, down_w, has_down_b, gm)?;
        drop(c.a);
        let ggu = kernels::swiglu_backward(&c.gu, &ga)?;
        drop((ga, c.gu));
        let (gh, gate_up_w_g, gate_up_b_g) = linear_backward(&c.h, gate_up_w, has_gate_up_b, &ggu)?;
        Ok((gh, MlpGrads { gate_up_w: gate_up_w_g, gate_up_b: gate_up_b_g, down_w: down_w_g, down_b: down_b_g }))
    }

    /// Decoder layer forward on the fused CPU path (`p` the layer's group views), with the
    /// caches of its backward.
    fn block_forward_fused(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, BlockCache)> {
        let g = &self.dense;
        let (b, t, d) = x.dims3()?;
        let eps = self.config.rms_norm_eps;
        let n1 = rms_norm_fused(x, &p[g.ln1], eps)?;
        let (o, attn) = self.attention_forward_fused(&AttnParams::of_block(p, g), &n1)?;
        let x1 = (x + o.reshape((b, t, d))?)?;
        let n2 = rms_norm_fused(&x1, &p[g.ln2], eps)?.reshape((b * t, d))?;
        let (m, mlp) = self.mlp_forward_fused(
            &p[g.gate_up_w],
            g.gate_up_b.map(|i| &p[i]),
            &p[g.down_w],
            g.down_b.map(|i| &p[i]),
            &n2,
        )?;
        let y = (&x1 + m.reshape((b, t, d))?)?;
        Ok((y, BlockCache { x1, attn, mlp }))
    }

    /// Decoder layer output on the fused CPU path.
    pub(super) fn block_math_fused(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        Ok(self.block_forward_fused(p, x)?.0)
    }

    /// Decoder layer backward on the fused CPU path by recomputation from `x` `[B, T, d]`:
    /// `(gradient of the layer's flat vector, gradient of x)` for `gy` `[B, T, d]`.
    pub(super) fn block_backward_fused(&self, p: &[Tensor], x: &Tensor, gy: &Tensor) -> Result<(Tensor, Tensor)> {
        let g = &self.dense;
        let (b, t, d) = x.dims3()?;
        let n = b * t;
        let eps = self.config.rms_norm_eps;
        let (_, cache) = self.block_forward_fused(p, x)?;
        let gy = gy.reshape((n, d))?;
        // y = x1 + mlp(rms_norm(x1))
        let (gn2, mlp) = self.mlp_backward_fused(
            &p[g.gate_up_w],
            g.gate_up_b.is_some(),
            &p[g.down_w],
            g.down_b.is_some(),
            cache.mlp,
            &gy,
        )?;
        let (gx1_norm, ln2) = rms_norm_backward(&cache.x1.reshape((n, d))?, &p[g.ln2], &gn2, eps)?;
        drop((gn2, cache.x1));
        let gx1 = (gy + gx1_norm)?;
        // x1 = x + attention(rms_norm(x))
        let (gn1, attn) = self.attention_backward_fused(&AttnParams::of_block(p, g), cache.attn, &gx1)?;
        let (gx_norm, ln1) = rms_norm_backward(&x.reshape((n, d))?, &p[g.ln1], &gn1, eps)?;
        let gx = (gx1 + gx_norm)?.reshape((b, t, d))?;
        // The groups in flat order (see LlamaConfig::block_groups).
        let mut parts: Vec<Tensor> = vec![ln1, attn.q_w];
        parts.extend(attn.q_b);
        parts.push(attn.k_w);
        parts.extend(attn.k_b);
        parts.push(attn.v_w);
        parts.extend(attn.v_b);
        parts.push(attn.o_w);
        parts.extend(attn.o_b);
        parts.extend(attn.q_norm);
        parts.extend(attn.k_norm);
        parts.push(ln2);
        parts.push(mlp.gate_up_w);
        parts.extend(mlp.gate_up_b);
        parts.push(mlp.down_w);
        parts.extend(mlp.down_b);
        let flat = parts.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<Vec<_>>>()?;
        Ok((Tensor::cat(&flat, 0)?, gx))
    }
}

impl Llama {
    /// The head's loss and its hand-written backward on the fused CPU path:
    /// `n = rms_norm(x, norm_w)`, `z = n w_outᵀ` `[N, V]`, `loss = Σ_counted ce(z) / count`;
    /// returns `(loss, g_x [B, T, d], g_norm_w [d], g_w_out [V, d])`. `targets` `[B, T]` U32
    /// (checked by the caller, `count` of them not ignored).
    pub(super) fn head_loss_backward_fused(
        &self,
        norm_w: &Tensor,
        w_out: &Tensor,
        x: &Tensor,
        targets: &Tensor,
        count: usize,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let n = b * t;
        let eps = self.config.rms_norm_eps;
        let x2 = x.reshape((n, d))?;
        let h = rms_norm_fused(&x2, norm_w, eps)?;
        let z = h.matmul(&w_out.t()?)?;
        let targets = targets.flatten_all()?;
        let rows = kernels::cross_entropy_rows(&z, &targets)?;
        let inv = 1.0 / count.max(1) as f64;
        let loss = (rows.sum_all()? * inv)?;
        let g_rows = Tensor::full(inv, n, x.device())?.to_dtype(x.dtype())?;
        let gz = kernels::cross_entropy_backward(&z, &targets, &g_rows)?;
        drop(z);
        let gh = gz.matmul(w_out)?;
        let gw_out = gz.t()?.matmul(&h)?;
        drop((gz, h));
        let (gx, g_norm) = rms_norm_backward(&x2, norm_w, &gh, eps)?;
        Ok((loss, gx.reshape((b, t, d))?, g_norm, gw_out))
    }
}

/// What a decoder layer's backward needs from its forward.
pub(crate) struct BlockCache {
    /// The residual stream after the attention `[B, T, d]`.
    x1: Tensor,
    attn: AttnCache,
    mlp: MlpCache,
}
