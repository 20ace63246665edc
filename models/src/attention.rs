//! Causal (grouped-query) attention computed one **block of query positions** at a time: the
//! attention core of the composed path, the one every non-CPU device and every half dtype
//! takes (the fused CPU kernels of `kernels/` keep their own). No tensor
//! of `[B, H, T, T]` scores is ever held for the whole sequence (DESIGN.md, "GPU backends"):
//! each block of `chunk` queries sees its `[B, H, chunk, end]` scores, and its backward
//! recomputes them from q, k and v instead of keeping them — the recomputation of
//! FlashAttention's backward (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient
//! Exact Attention with IO-Awareness", Algorithm 4), here over whole query blocks with candle
//! ops rather than in one fused kernel over tiles.
//!
//! | item | what |
//! |---|---|
//! | [`causal_attention`] | the forward, differentiable through candle's autograd (a custom op whose backward is [`causal_attention_backward`]) |
//! | [`causal_attention_backward`] | the vector-Jacobian product, block by block |
//! | [`AttentionShape`], [`attention_workspace_bytes`], [`AttentionBytes`] | the chunk a model uses by default and the device bytes the core needs at its peak, for planners |
//!
//! The math of one block of queries `s .. s + c` (keys `0 .. e`, `e = s + c`, the keys it can
//! see), in the eager attention's precision (transformers' `eager_attention_forward`: scores in
//! the compute dtype, the softmax in F32 for half dtypes, `.to(query.dtype)` before `· v`):
//!
//! ```text
//! forward : S = q_c k_eᵀ                       [B, KV, rep·c, e], the compute dtype (q carries 1/sqrt(hd))
//!           P = softmax(f32(S) + M)            M = 0 for key ≤ query, -inf after; F32 for half dtypes
//!           y_c = dtype(P) v_e                 [B, KV, rep·c, hd]
//! backward: gv += dtype(P)ᵀ gy_c
//!           dP = f32(gy_c v_eᵀ)
//!           dS = P ⊙ (dP − rowsum(dP ⊙ P))    torch's softmax backward on the F32 output
//!           gq_c = dtype(dS) k_e,  gk += dtype(dS)ᵀ q_c
//! ```
//!
//! Grouped-query attention (Ainslie et al. 2023): query head `h` reads key/value head
//! `h / rep` (`rep = H / KV`, transformers' `repeat_kv`) without repeating k and v: a block's
//! queries of the `rep` heads of a group are stacked (`[B, KV, rep·c, hd]`) and multiply their
//! group's keys once. `gk` and `gv` sum over the blocks in F32 for half dtypes (rounded once).
//!
//! With one block (`chunk >= T`) the forward runs exactly the ops of the unchunked eager
//! attention, so its output is bitwise that of `softmax(q kᵀ + mask) v`; the backward is the
//! formula above, not candle's autograd of the composition (equal within rounding).

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor, D};

use crate::ops::{self, is_half, softmax_dtype};
use crate::Result;

/// The bytes of F32 scores one query block may hold by default: 64 MiB
/// ([`AttentionShape::default_chunk`]). The workspace of the core is a few times this
/// ([`AttentionBytes`]); blocks of this size keep each of the block's elementwise kernels long
/// (64 MiB at ~3 TB/s is ~20 µs on an H100) next to the few µs of a kernel launch.
pub const DEFAULT_SCORES_CHUNK_BYTES: u64 = 64 << 20;

/// The shape of one attention call: `batch` sequences of `seq_len` tokens, `heads` query heads
/// over `kv_heads` key/value heads (grouped-query attention; `kv_heads = heads` for multi-head
/// attention), each `head_dim` wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences in the batch, `B`.
    pub batch: usize,
    /// Tokens per sequence, `T`.
    pub seq_len: usize,
    /// Query heads, `H`.
    pub heads: usize,
    /// Key/value heads, `KV` (divides `H`).
    pub kv_heads: usize,
    /// Width of one head, `hd`.
    pub head_dim: usize,
}

impl AttentionShape {
    /// The query positions per block when none is configured: the most whose F32 scores
    /// (`B · H · chunk · T` elements, every block's keys bounded by `T`) fit in
    /// [`DEFAULT_SCORES_CHUNK_BYTES`], rounded down to a multiple of 16 from 16 on (GPU matmul
    /// tiles), at least 1 and at most `T` — so a sequence whose whole scores fit (the sim's
    /// models, short contexts) runs as one block. Llama-3-8B (`H = 32`) at `B = 1` gets 256
    /// queries at `T = 2048` and 128 at `T = 4096`.
    pub fn default_chunk(&self) -> usize {
        let t = self.seq_len.max(1);
        let row_bytes = (self.batch.max(1) * self.heads.max(1) * t) as u64 * 4;
        let c = (DEFAULT_SCORES_CHUNK_BYTES / row_bytes) as usize;
        let c = if c >= 16 { c - c % 16 } else { c };
        c.clamp(1, t)
    }

    /// The query positions per block for a configured `chunk` (`None`: [`Self::default_chunk`]),
    /// clamped to `1 ..= T`.
    pub fn chunk(&self, chunk: Option<usize>) -> usize {
        chunk.unwrap_or_else(|| self.default_chunk()).clamp(1, self.seq_len.max(1))
    }
}

/// The device bytes of the attention core of one layer ([`attention_workspace_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionBytes {
    /// Query positions per block (the `chunk` asked for, clamped to `1 ..= T`).
    pub chunk: usize,
    /// The largest block's scores in the softmax's dtype (F32 for half dtypes, F64 for F64):
    /// `B · H · chunk · T` elements — the term that replaces the whole sequence's `B · H · T · T`.
    pub scores_chunk_bytes: u64,
    /// Peak of the forward: q, k, v, the output and the largest block's workspace.
    pub forward_peak_bytes: u64,
    /// Peak of the backward (one block's recomputation and gradients at a time): q, k, v, the
    /// output and its gradient, the gradients of q, k and v, and the largest block's workspace.
    pub backward_peak_bytes: u64,
}

/// The device bytes the attention core ([`causal_attention`] and its backward) needs at its
/// peak for `shape`, query blocks of `chunk` positions (clamped to `1 ..= T`) and compute
/// dtype `dtype` (`s` bytes per element; its softmax dtype — F32 for BF16/F16, else `dtype` —
/// `f` bytes). An upper bound, term by term, of the tensors the core holds at once (`E = B · H ·
/// chunk · T` elements: the largest block's scores, `c · e ≤ chunk · T` for every block):
///
/// | term | elements × bytes | forward | backward |
/// |---|---|---|---|
/// | q, the output y | `2 · B·H·T·hd × s` | ✓ | ✓ |
/// | k, v | `2 · B·KV·T·hd × s` | ✓ | ✓ |
/// | the autograd copy of y (tracked calls) | `B·H·T·hd × s` | ✓ | |
/// | gy, gq | `2 · B·H·T·hd × s` | | ✓ |
/// | gk, gv sums, one padded block gradient and the next sum | `4 · B·KV·T·hd × f`, `+ 2 · B·KV·T·hd × s` at the cast | | ✓ |
/// | scores: the softmax's two live `[B, H, c, e]` temporaries (widened/masked/shifted/exp/P) | `2 · E × f` | ✓ | |
/// | backward scores: P, dP and one of `dP ⊙ P`, `dP − D`, dS | `3 · E × f` | | ✓ |
/// | the block's mask `[c, e]` (and its zeros while built) and the cached `[c, c]` triangle | `(2 · chunk · T + chunk²) × f` | ✓ | ✓ |
/// | the block's q, y/gy rows and their reordered copies | `4 · B·H·chunk·hd × s` | ✓ | ✓ |
/// | half dtypes on the CPU: a matmul's operands widened to F32 (candle's CPU has no BF16 GEMM) | `(B·H·chunk·hd + B·KV·T·hd) × 4` | ✓ | ✓ |
///
/// The half-dtype score terms are counted at `f` (F32) though some of them are half tensors:
/// `S` and `dtype(P)` (2 bytes) live beside at most one F32 temporary of the same size where
/// two are counted. Not counted: the layer's other activations (the projections' inputs and
/// outputs, the MLP), candle's gradient store around the op, library workspaces (cuBLAS).
pub fn attention_workspace_bytes(shape: AttentionShape, chunk: usize, dtype: DType) -> AttentionBytes {
    let AttentionShape { batch: b, seq_len: t, heads: h, kv_heads: kv, head_dim: hd } = shape;
    let chunk = chunk.clamp(1, t.max(1));
    let s = dtype.size_in_bytes() as u64;
    let f = softmax_dtype(dtype).size_in_bytes() as u64;
    let qo = (b * h * t * hd) as u64; // q, y, gy, gq
    let kvn = (b * kv * t * hd) as u64; // k, v, gk, gv
    let e = (b * h * chunk * t) as u64;
    let mask = (2 * chunk * t + chunk * chunk) as u64 * f;
    let rows = 4 * (b * h * chunk * hd) as u64 * s;
    let widened = if is_half(dtype) { ((b * h * chunk * hd) as u64 + kvn) * 4 } else { 0 };
    let block = mask + rows + widened;
    let io = 2 * qo * s + 2 * kvn * s;
    AttentionBytes {
        chunk,
        scores_chunk_bytes: e * f,
        forward_peak_bytes: io + qo * s + 2 * e * f + block,
        backward_peak_bytes: io + 2 * qo * s + 4 * kvn * f + 2 * kvn * s + 3 * e * f + block,
    }
}

/// Causal attention `softmax(q kᵀ + mask) v` over query blocks of `chunk` positions (see the
/// module docs): `q` `[B, H, T, hd]` (already scaled by `1/sqrt(hd)` and rotated as the model
/// wants), `k` and `v` `[B, KV, T, hd]` with `KV` dividing `H`, one float dtype on one device
/// (any strides) → `y` `[B, T, H, hd]` (the layout the output projection reads), contiguous.
///
/// When any input is tracked by candle's autograd (a [`candle_core::Var`] or computed from
/// one), the output is too, and its backward is [`causal_attention_backward`]: only q, k, v
/// and y are kept, never a block's scores. Builds the block's causal mask on each call (a
/// model caches it).
///
/// # Errors
/// [`crate::Error::Input`] on mismatched shapes, dtypes or devices, or `chunk = 0`;
/// [`crate::Error::Candle`] from the ops.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, chunk: usize) -> Result<Tensor> {
    Masks::default().attention(q, k, v, Some(chunk))
}

/// The vector-Jacobian product of [`causal_attention`] with `gy` `[B, T, H, hd]` (the output's
/// gradient): `(gq [B, H, T, hd], gk [B, KV, T, hd], gv [B, KV, T, hd])` in the inputs' dtype,
/// computed block by block from q, k and v (each block's probabilities recomputed, module docs).
///
/// # Errors
/// As [`causal_attention`], and [`crate::Error::Input`] when `gy` is not the output's shape and
/// dtype.
pub fn causal_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gy: &Tensor,
    chunk: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = check(q, k, v, Some(chunk))?;
    let (b, h, t, hd) = dims;
    if gy.dims() != [b, t, h, hd] || gy.dtype() != q.dtype() {
        return Err(ops::input_err(
            "attention output gradient",
            format!("{:?} [{b}, {t}, {h}, {hd}]", q.dtype()),
            format!("{:?} {:?}", gy.dtype(), gy.dims()),
        ));
    }
    let chunk = chunk.min(t);
    let tri = Masks::default().tri(chunk, softmax_dtype(q.dtype()), q.device())?;
    backward(&q.detach(), &k.detach(), &v.detach(), &gy.detach(), chunk, &tri)
}

/// Checks q, k, v (and a configured chunk); returns `(B, H, T, hd)`.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, chunk: Option<usize>) -> Result<(usize, usize, usize, usize)> {
    let (b, h, t, hd) = q.dims4()?;
    let kv = k.dim(1).unwrap_or(0);
    let ok = k.dims().len() == 4
        && k.dims() == v.dims()
        && k.dims() == [b, kv, t, hd]
        && kv >= 1
        && h % kv == 0
        && t >= 1
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
        && q.dtype().is_float()
        && k.device().same_device(q.device())
        && v.device().same_device(q.device());
    if !ok {
        return Err(ops::input_err(
            "attention inputs",
            "q [B, H, T, hd], k and v [B, KV, T, hd] with KV dividing H, one float dtype and device".into(),
            format!(
                "q {:?} {:?}, k {:?} {:?}, v {:?} {:?}",
                q.dtype(),
                q.dims(),
                k.dtype(),
                k.dims(),
                v.dtype(),
                v.dims()
            ),
        ));
    }
    if chunk == Some(0) {
        return Err(ops::input_err("attention chunk", "query positions per block >= 1".into(), "0".into()));
    }
    Ok((b, h, t, hd))
}

/// The `[c, c]` causal triangles (0 on and below the diagonal, -inf above) in the softmax's
/// dtype, cached per `(c, dtype, device)`: what a model holds of the masks (at most 8 entries).
#[derive(Default)]
pub(crate) struct Masks {
    cache: Mutex<Vec<(usize, DType, Device, Tensor)>>,
}

impl Masks {
    /// [`causal_attention`] with this cache; `chunk = None` takes
    /// [`AttentionShape::default_chunk`].
    pub(crate) fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, chunk: Option<usize>) -> Result<Tensor> {
        let (b, h, t, hd) = check(q, k, v, chunk)?;
        let shape = AttentionShape { batch: b, seq_len: t, heads: h, kv_heads: k.dim(1)?, head_dim: hd };
        let chunk = shape.chunk(chunk);
        let tri = self.tri(chunk, softmax_dtype(q.dtype()), q.device())?;
        let y = forward(&q.detach(), &k.detach(), &v.detach(), chunk, &tri)?;
        if !(q.track_op() || k.track_op() || v.track_op()) {
            return Ok(y);
        }
        let op = AttentionOp { chunk, tri, output: Mutex::new(Some(y)) };
        Ok(q.apply_op3_arc(k, v, Arc::new(Box::new(op)))?)
    }

    /// The `[c, c]` triangle in `dtype` on `device`.
    fn tri(&self, c: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, _, m)) =
            cache.iter().find(|(n, d, dev, _)| *n == c && *d == dtype && dev.same_device(device))
        {
            return Ok(m.clone());
        }
        let data: Vec<f32> = (0..c * c).map(|i| if i % c > i / c { f32::NEG_INFINITY } else { 0.0 }).collect();
        // -inf and 0 are exact in every float dtype.
        let m = Tensor::from_vec(data, (c, c), device)?.to_dtype(dtype)?;
        if cache.len() >= 8 {
            cache.remove(0);
        }
        cache.push((c, dtype, device.clone(), m.clone()));
        Ok(m)
    }
}

/// The query blocks `(start, len)` of `t` positions.
fn blocks(t: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(chunk).map(move |s| (s, chunk.min(t - s)))
}

/// The mask `[c, s + c]` of the queries `s .. s + c`: zeros for the keys before the block
/// (all visible), the triangle `tri[..c, ..c]` for the block's own keys.
fn block_mask(tri: &Tensor, s: usize, c: usize) -> Result<Tensor> {
    let diag = if tri.dim(0)? == c { tri.clone() } else { tri.narrow(0, 0, c)?.narrow(1, 0, c)? };
    if s == 0 {
        return Ok(diag);
    }
    let before = Tensor::zeros((c, s), tri.dtype(), tri.device())?;
    Ok(Tensor::cat(&[&before, &diag], 1)?)
}

/// A block's stacked queries `[B, KV, rep·c, hd]` (contiguous) from `q5` `[B, KV, rep, T, hd]`.
fn block_rows(q5: &Tensor, s: usize, c: usize) -> Result<Tensor> {
    let (b, kv, rep, _, hd) = q5.dims5()?;
    Ok(q5.narrow(3, s, c)?.contiguous()?.reshape((b, kv, rep * c, hd))?)
}

/// `softmax(widen(scores) + mask)` over the last dim for scores `[B, KV, rep·c, e]` and mask
/// `[c, e]`: `(P in the softmax dtype, P in the scores' dtype)` (the same tensor unless half).
/// The ops of `kernels::softmax_last_dim` (the row max subtracted for range only) in the order of
/// transformers' eager attention; each temporary is dropped as soon as the next exists, so at
/// most two `[B, H, c, e]` temporaries live at once outside a graph.
fn probs(scores: Tensor, mask: &Tensor, rep: usize) -> Result<(Tensor, Tensor)> {
    let (b, kv, rows, e) = scores.dims4()?;
    let dtype = scores.dtype();
    // (No shadowing below: a shadowed tensor would live to the end of the function.)
    let wide = ops::widen(&scores)?;
    drop(scores);
    let x = wide.reshape((b, kv, rep, rows / rep, e))?.broadcast_add(mask)?;
    drop(wide);
    let max = x.max_keepdim(D::Minus1)?;
    let z = x.broadcast_sub(&max)?;
    drop(x);
    let ex = z.exp()?;
    drop(z);
    let sum = ex.sum_keepdim(D::Minus1)?;
    let p = ex.broadcast_div(&sum)?.reshape((b, kv, rows, e))?;
    drop(ex);
    let p_dtype = if is_half(dtype) { p.to_dtype(dtype)? } else { p.clone() };
    Ok((p, p_dtype))
}

/// The forward over query blocks (no graph): `y` `[B, T, H, hd]`, contiguous.
fn forward(q: &Tensor, k: &Tensor, v: &Tensor, chunk: usize, tri: &Tensor) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let kv = k.dim(1)?;
    let rep = h / kv;
    let q5 = q.reshape((b, kv, rep, t, hd))?;
    // [B, KV, rep·c, hd] → [B, c, KV, rep, hd]: the output's rows of the block.
    let block_out = |y_c: &Tensor, c: usize| -> Result<Tensor> {
        Ok(y_c.reshape((b, kv, rep, c, hd))?.permute((0, 3, 1, 2, 4))?.contiguous()?)
    };
    let mut y: Option<Tensor> = None;
    for (s, c) in blocks(t, chunk) {
        let e = s + c;
        let q_c = block_rows(&q5, s, c)?;
        let (k_e, v_e) = (k.narrow(2, 0, e)?, v.narrow(2, 0, e)?);
        let mask = block_mask(tri, s, c)?;
        let (p, p_dtype) = probs(ops::matmul(&q_c, &k_e.t()?)?, &mask, rep)?;
        drop((p, mask, q_c));
        let y_c = block_out(&ops::matmul(&p_dtype, &v_e)?, c)?;
        drop(p_dtype);
        if c == t {
            return Ok(y_c.reshape((b, t, h, hd))?);
        }
        let out = match &y {
            Some(out) => out,
            None => y.insert(Tensor::zeros((b, t, kv, rep, hd), q.dtype(), q.device())?),
        };
        out.slice_set(&y_c, 1, s)?;
    }
    Ok(y.expect("t >= 1 gives a block").reshape((b, t, h, hd))?)
}

/// `acc + g` with `g` `[B, KV, e, hd]` widened to the accumulator's dtype and padded with zero
/// rows to `t` keys.
fn accumulate(acc: Option<Tensor>, g: &Tensor, t: usize) -> Result<Tensor> {
    let e = g.dim(2)?;
    let g = ops::widen(g)?.pad_with_zeros(2, 0, t - e)?;
    Ok(match acc {
        None => g,
        Some(acc) => (acc + g)?,
    })
}

/// The backward over query blocks (no graph; see the module docs): `(gq [B, H, T, hd], gk, gv
/// [B, KV, T, hd])`.
fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gy: &Tensor,
    chunk: usize,
    tri: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, h, t, hd) = q.dims4()?;
    let kv = k.dim(1)?;
    let rep = h / kv;
    let dtype = q.dtype();
    let q5 = q.reshape((b, kv, rep, t, hd))?;
    let mut gq: Option<Tensor> = None;
    let (mut gk, mut gv) = (None, None);
    for (s, c) in blocks(t, chunk) {
        let e = s + c;
        let q_c = block_rows(&q5, s, c)?;
        let (k_e, v_e) = (k.narrow(2, 0, e)?, v.narrow(2, 0, e)?);
        let mask = block_mask(tri, s, c)?;
        let (p, p_dtype) = probs(ops::matmul(&q_c, &k_e.t()?)?, &mask, rep)?;
        drop(mask);
        // The block's output gradient as stacked rows [B, KV, rep·c, hd].
        let gy_c = gy
            .narrow(1, s, c)?
            .reshape((b, c, kv, rep, hd))?
            .permute((0, 2, 3, 1, 4))?
            .contiguous()?
            .reshape((b, kv, rep * c, hd))?;
        gv = Some(accumulate(gv, &ops::matmul(&p_dtype.t()?, &gy_c)?, t)?);
        drop(p_dtype);
        let dp = ops::widen(&ops::matmul(&gy_c, &v_e.t()?)?)?;
        drop(gy_c);
        let d = (&dp * &p)?.sum_keepdim(D::Minus1)?;
        let centred = dp.broadcast_sub(&d)?;
        drop(dp);
        let ds_wide = (centred * p)?;
        let ds = ds_wide.to_dtype(dtype)?;
        drop(ds_wide);
        let gq_c = ops::matmul(&ds, &k_e)?.reshape((b, kv, rep, c, hd))?;
        gk = Some(accumulate(gk, &ops::matmul(&ds.t()?, &q_c)?, t)?);
        drop((ds, q_c));
        if c == t {
            gq = Some(gq_c);
            break;
        }
        let out = match &gq {
            Some(out) => out,
            None => gq.insert(Tensor::zeros((b, kv, rep, t, hd), dtype, q.device())?),
        };
        out.slice_set(&gq_c, 3, s)?;
    }
    let gq = gq.expect("t >= 1 gives a block").reshape((b, h, t, hd))?;
    let gk = gk.expect("t >= 1 gives a block").to_dtype(dtype)?;
    let gv = gv.expect("t >= 1 gives a block").to_dtype(dtype)?;
    Ok((gq, gk, gv))
}

/// The custom op that puts [`causal_attention`] into candle's autograd: its forward hands back
/// the output computed block by block before the op was applied (candle's custom ops see
/// storages, not tensors), its backward is [`backward`] — so the graph holds q, k, v and y, never
/// a block's scores.
struct AttentionOp {
    chunk: usize,
    /// The `[chunk, chunk]` causal triangle in the softmax dtype.
    tri: Tensor,
    /// The output, taken by the forward (which runs once, when the op is applied).
    output: Mutex<Option<Tensor>>,
}

impl AttentionOp {
    /// A copy of the output's storage (the op's result must own its storage).
    fn output_storage<S>(&self, pick: impl Fn(&Storage) -> Option<&S>) -> candle_core::Result<(S, Shape)>
    where
        S: BackendStorage,
        S::Device: BackendDevice<Storage = S>,
    {
        let y = self.output.lock().unwrap_or_else(|e| e.into_inner()).take();
        let y = y.ok_or_else(|| candle_core::Error::Msg("causal attention: the op's forward ran twice".into()))?;
        let (storage, layout) = y.storage_and_layout();
        let src = pick(&storage)
            .ok_or_else(|| candle_core::Error::Msg("causal attention: output on another device than q".into()))?;
        let mut dst = src.device().zeros_impl(layout.shape(), src.dtype())?;
        src.copy_strided_src(&mut dst, 0, layout)?;
        Ok((dst, layout.shape().clone()))
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "causal-attention-blocks"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.output_storage(|s| match s {
            Storage::Cpu(s) => Some(s),
            _ => None,
        })
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.output_storage(|s| match s {
            Storage::Cuda(s) => Some(s),
            _ => None,
        })
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gq, gk, gv) = backward(&q.detach(), &k.detach(), &v.detach(), &gy.detach(), self.chunk, &self.tri)
            .map_err(candle_core::Error::wrap)?;
        Ok((Some(gq), Some(gk), Some(gv)))
    }
}

/// A configured chunk: `None` (the default) or `Some(n >= 1)`.
///
/// # Errors
/// [`crate::Error::Config`] (`attention_chunk`) for `Some(0)`.
pub(crate) fn check_chunk(chunk: Option<usize>) -> Result<Option<usize>> {
    if chunk == Some(0) {
        return Err(crate::Error::Config {
            field: "attention_chunk",
            reason: "0 query positions per attention block; fix: a chunk >= 1, or none for the default \
                     (64 MiB of F32 scores per block)"
                .into(),
        });
    }
    Ok(chunk)
}

#[cfg(test)]
mod tests;
