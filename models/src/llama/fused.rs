//! Fused CPU kernels, each with its own backward, for the elementwise-heavy pieces of a Llama
//! layer and head: RMSNorm, rotary embeddings (with the head transpose and the attention scale
//! folded in), SwiGLU, and the cross-entropy with an ignore index.
//!
//! Composed of candle ops each is several passes forward and more backward (RoPE's
//! `rotate_half` is two narrows, a neg, a cat, two broadcast muls and an add; its backward pads
//! each narrow back to full size); here each direction is one pass (two for RMSNorm's weight
//! gradient, a fixed-order row sum), spread over the rayon pool. They apply to F32/F64 tensors on
//! `Device::Cpu` ([`crate::kernels::fused_supported`]); other devices and dtypes take the op
//! compositions of `super::ops` (same math, checked equal in the tests).

use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::lm::IGNORE_INDEX;

/// Rows per rayon task of the row kernels (RMSNorm, SwiGLU, cross-entropy).
const ROWS_PER_TASK: usize = 64;

/// The arithmetic the kernels need, for f32 and f64 (each computes in its own precision).
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + 'static
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(v: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, o: Self) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: $t = 0.0;
            const ONE: $t = 1.0;
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            #[inline(always)]
            fn exp(self) -> $t {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> $t {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> $t {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max(self, o: $t) -> $t {
                <$t>::max(self, o)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

fn contiguous<'a, T>(s: &'a [T], l: &Layout, op: &'static str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

/// Runs `f` on two (or three) float storages of one precision, or fails naming `op`.
macro_rules! float_storages {
    ($op:expr, ($($s:ident : $l:ident),+), |$($v:ident),+| $body:expr) => {
        match ($($s),+) {
            ($(CpuStorage::F32($v)),+) => {
                $(let $v = contiguous($v, $l, $op)?;)+
                CpuStorage::F32($body)
            }
            ($(CpuStorage::F64($v)),+) => {
                $(let $v = contiguous($v, $l, $op)?;)+
                CpuStorage::F64($body)
            }
            _ => candle_core::bail!("{}: only F32 and F64 of one dtype are supported", $op),
        }
    };
}

// ---- RMSNorm -------------------------------------------------------------------------------

/// RMSNorm over the last dim (Zhang & Sennrich 2019), as transformers' `LlamaRMSNorm`:
/// `y = w ⊙ (x · 1/sqrt(mean(x²) + eps))`, `x` `[.., d]`, `w` `[d]`, with a backward for both.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

struct RmsNorm {
    eps: f64,
}

/// `1 / sqrt(mean(x²) + eps)` of one row.
#[inline(always)]
fn rstd<T: Real>(x: &[T], eps: T) -> T {
    let mut ss = T::ZERO;
    for &v in x {
        ss += v * v;
    }
    T::ONE / (ss / T::from_f64(x.len() as f64) + eps).sqrt()
}

fn rms_norm_fwd<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let eps = T::from_f64(eps);
    let mut out = vec![T::ZERO; x.len()];
    out.par_chunks_mut(ROWS_PER_TASK * d).zip(x.par_chunks(ROWS_PER_TASK * d)).for_each(|(o, x)| {
        for (o, x) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let r = rstd(x, eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = w * (x * r);
            }
        }
    });
    out
}

/// `gx = r (g⊙w − x̂ · mean(g⊙w⊙x̂))`, `x̂ = r x`.
fn rms_norm_grad_x<T: Real>(x: &[T], w: &[T], g: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let eps = T::from_f64(eps);
    let inv_d = T::from_f64(1.0 / d as f64);
    let mut out = vec![T::ZERO; x.len()];
    let chunk = ROWS_PER_TASK * d;
    out.par_chunks_mut(chunk).zip(x.par_chunks(chunk).zip(g.par_chunks(chunk))).for_each(|(o, (x, g))| {
        for ((o, x), g) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(g.chunks_exact(d)) {
            let r = rstd(x, eps);
            let mut dot = T::ZERO;
            for ((&x, &g), &w) in x.iter().zip(g).zip(w) {
                dot += g * w * x;
            }
            let c = dot * r * inv_d;
            for (((o, &x), &g), &w) in o.iter_mut().zip(x).zip(g).zip(w) {
                *o = r * (g * w - x * r * c);
            }
        }
    });
    out
}

/// `g ⊙ x̂` (summed over rows by [`crate::kernels::row_sum_tensor`] into the weight gradient).
fn rms_norm_g_xhat<T: Real>(x: &[T], g: &[T], d: usize, eps: f64) -> Vec<T> {
    let eps = T::from_f64(eps);
    let mut out = vec![T::ZERO; x.len()];
    let chunk = ROWS_PER_TASK * d;
    out.par_chunks_mut(chunk).zip(x.par_chunks(chunk).zip(g.par_chunks(chunk))).for_each(|(o, (x, g))| {
        for ((o, x), g) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(g.chunks_exact(d)) {
            let r = rstd(x, eps);
            for ((o, &x), &g) in o.iter_mut().zip(x).zip(g) {
                *o = g * (x * r);
            }
        }
    });
    out
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "oogc-rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = last_dim(l1);
        if l2.dims() != [d] {
            candle_core::bail!("oogc-rms-norm: weight {:?} does not match {:?}", l2.dims(), l1.dims());
        }
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |x, w| rms_norm_fwd(x, w, self.eps));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let gx = x.apply_op3_no_bwd(w, &grad, &RmsNormGradX { eps: self.eps })?;
        let g_xhat = x.apply_op2_no_bwd(&grad, &RmsNormGXhat { eps: self.eps })?;
        let gw = crate::kernels::row_sum_tensor(&g_xhat)?;
        Ok((Some(gx), Some(gw)))
    }
}

/// The backward of [`rms_norm`] without a graph: `(g_x, g_w)` for the output gradient `g`.
pub(crate) fn rms_norm_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (x, w, g) = (x.contiguous()?, w.contiguous()?, g.contiguous()?);
    let gx = x.apply_op3_no_bwd(&w, &g, &RmsNormGradX { eps })?;
    let gw = crate::kernels::row_sum_tensor(&x.apply_op2_no_bwd(&g, &RmsNormGXhat { eps })?)?;
    Ok((gx, gw))
}

struct RmsNormGradX {
    eps: f64,
}

impl CustomOp3 for RmsNormGradX {
    fn name(&self) -> &'static str {
        "oogc-rms-norm-grad-x"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.dims() != l3.dims() || l2.dims() != [last_dim(l1)] {
            candle_core::bail!("oogc-rms-norm-grad-x: shapes {:?} {:?} {:?}", l1.dims(), l2.dims(), l3.dims());
        }
        let out = float_storages!(self.name(), (s1: l1, s2: l2, s3: l3), |x, w, g| rms_norm_grad_x(x, w, g, self.eps));
        Ok((out, l1.shape().clone()))
    }
}

struct RmsNormGXhat {
    eps: f64,
}

impl CustomOp2 for RmsNormGXhat {
    fn name(&self) -> &'static str {
        "oogc-rms-norm-g-xhat"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if l1.dims() != l2.dims() {
            candle_core::bail!("oogc-rms-norm-g-xhat: shapes {:?} {:?}", l1.dims(), l2.dims());
        }
        let d = last_dim(l1);
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |x, g| rms_norm_g_xhat(x, g, d, self.eps));
        Ok((out, l1.shape().clone()))
    }
}

// ---- RoPE ----------------------------------------------------------------------------------

/// Rotary position embedding (Su et al. 2021, "RoFormer") in transformers' `rotate_half`
/// convention (`apply_rotary_pos_emb` of `modeling_llama.py`), fused with the head transpose and
/// a scale: `x` `[B, T, nh, hd]` (the projection's output, contiguous), `cos`, `sin`
/// `[T, hd/2]` → `[B, nh, T, hd]` contiguous with, for `i < hd/2`,
/// `y[i] = s (x[i] cos_i − x[i + hd/2] sin_i)`, `y[i + hd/2] = s (x[i + hd/2] cos_i + x[i] sin_i)`.
/// The backward (to `x` only; the tables are constants) is the inverse rotation, transposed back.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { scale })
}

struct Rope {
    scale: f64,
}

/// `(B, T, nh, hd)` of a RoPE input and the tables' `[T, hd/2]` check.
fn rope_dims(x: &[usize], tab: &Layout, tab2: &Layout, op: &'static str) -> Result<(usize, usize, usize, usize)> {
    let &[b, t, nh, hd] = x else { candle_core::bail!("{op}: expected [B, T, nh, hd], got {x:?}") };
    if hd % 2 != 0 || tab.dims() != [t, hd / 2] || tab2.dims() != [t, hd / 2] {
        candle_core::bail!("{op}: tables {:?}, {:?} do not match {x:?}", tab.dims(), tab2.dims());
    }
    Ok((b, t, nh, hd))
}

/// Forward (`inverse = false`): `[B, T, nh, hd]` → `[B, nh, T, hd]` rotated by +θ.
/// Backward (`inverse = true`): `[B, nh, T, hd]` → `[B, T, nh, hd]` rotated by −θ.
fn rope_apply<T: Real>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    (_, t, nh, hd): (usize, usize, usize, usize),
    scale: f64,
    inverse: bool,
) -> Vec<T> {
    let half = hd / 2;
    let s = T::from_f64(scale);
    let mut out = vec![T::ZERO; x.len()];
    // Forward: tasks over the output's (b, head) blocks [T, hd]; backward: over (b, t) rows
    // [nh, hd]. Either way a task writes one contiguous block.
    let block = if inverse { nh * hd } else { t * hd };
    out.par_chunks_mut(block).enumerate().for_each(|(k, o)| {
        let rot = |dst: &mut [T], src: &[T], pos: usize| {
            let (c, sn) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
            let (d1, d2) = dst.split_at_mut(half);
            let (x1, x2) = src.split_at(half);
            if inverse {
                for i in 0..half {
                    d1[i] = s * (x1[i] * c[i] + x2[i] * sn[i]);
                    d2[i] = s * (x2[i] * c[i] - x1[i] * sn[i]);
                }
            } else {
                for i in 0..half {
                    d1[i] = s * (x1[i] * c[i] - x2[i] * sn[i]);
                    d2[i] = s * (x2[i] * c[i] + x1[i] * sn[i]);
                }
            }
        };
        if inverse {
            // k = bi * t + ti; output row [nh, hd]; source (bi, h, ti) in [B, nh, T, hd].
            let (bi, ti) = (k / t, k % t);
            for h in 0..nh {
                let src = ((bi * nh + h) * t + ti) * hd;
                rot(&mut o[h * hd..(h + 1) * hd], &x[src..src + hd], ti);
            }
        } else {
            // k = bi * nh + h; output block [T, hd]; source (bi, ti, h) in [B, T, nh, hd].
            let (bi, h) = (k / nh, k % nh);
            for ti in 0..t {
                let src = ((bi * t + ti) * nh + h) * hd;
                rot(&mut o[ti * hd..(ti + 1) * hd], &x[src..src + hd], ti);
            }
        }
    });
    out
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "oogc-rope"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = rope_dims(l1.dims(), l2, l3, self.name())?;
        let (b, t, nh, hd) = dims;
        let out = float_storages!(self.name(), (s1: l1, s2: l2, s3: l3), |x, c, s| rope_apply(x, c, s, dims, self.scale, false));
        Ok((out, Shape::from((b, nh, t, hd))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &RopeGrad { scale: self.scale })?;
        Ok((Some(gx), None, None))
    }
}

/// The backward of [`rope`] without a graph: `g` `[B, nh, T, hd]` → `[B, T, nh, hd]`.
pub(crate) fn rope_backward(g: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
    g.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &RopeGrad { scale })
}

/// The backward of [`Rope`]: `[B, nh, T, hd]` → `[B, T, nh, hd]`, rotated by −θ and scaled.
struct RopeGrad {
    scale: f64,
}

impl CustomOp3 for RopeGrad {
    fn name(&self) -> &'static str {
        "oogc-rope-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let &[b, nh, t, hd] = l1.dims() else {
            candle_core::bail!("oogc-rope-grad: expected [B, nh, T, hd], got {:?}", l1.dims())
        };
        let dims = rope_dims(&[b, t, nh, hd], l2, l3, self.name())?;
        let out = float_storages!(self.name(), (s1: l1, s2: l2, s3: l3), |g, c, s| rope_apply(g, c, s, dims, self.scale, true));
        Ok((out, Shape::from((b, t, nh, hd))))
    }
}

// ---- SwiGLU --------------------------------------------------------------------------------

/// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"), as transformers' `LlamaMLP`:
/// `gu` `[.., 2I]` holds `gate_proj` outputs in columns `0..I` and `up_proj` outputs in
/// `I..2I`; the result `[.., I]` is `silu(gate) ⊙ up`, `silu(a) = a · sigmoid(a)`. With a
/// backward to `gu`.
pub(crate) fn swiglu(gu: &Tensor) -> Result<Tensor> {
    gu.contiguous()?.apply_op1(SwiGlu)
}

struct SwiGlu;

#[inline(always)]
fn sigmoid<T: Real>(a: T) -> T {
    T::ONE / (T::ONE + (-a).exp())
}

fn swiglu_fwd<T: Real>(gu: &[T], i2: usize) -> Vec<T> {
    let i = i2 / 2;
    let mut out = vec![T::ZERO; gu.len() / 2];
    out.par_chunks_mut(ROWS_PER_TASK * i).zip(gu.par_chunks(ROWS_PER_TASK * i2)).for_each(|(o, gu)| {
        for (o, gu) in o.chunks_exact_mut(i).zip(gu.chunks_exact(i2)) {
            let (g, u) = gu.split_at(i);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g * sigmoid(g) * u;
            }
        }
    });
    out
}

/// `(gu, gy)` → `[g_gate | g_up]`: `g_gate = gy · u · σ(a)(1 + a(1 − σ(a)))`, `g_up = gy · silu(a)`.
fn swiglu_bwd<T: Real>(gu: &[T], gy: &[T], i2: usize) -> Vec<T> {
    let i = i2 / 2;
    let mut out = vec![T::ZERO; gu.len()];
    out.par_chunks_mut(ROWS_PER_TASK * i2)
        .zip(gu.par_chunks(ROWS_PER_TASK * i2).zip(gy.par_chunks(ROWS_PER_TASK * i)))
        .for_each(|(o, (gu, gy))| {
            for ((o, gu), gy) in o.chunks_exact_mut(i2).zip(gu.chunks_exact(i2)).zip(gy.chunks_exact(i)) {
                let (g, u) = gu.split_at(i);
                let (og, ou) = o.split_at_mut(i);
                for j in 0..i {
                    let (a, s) = (g[j], sigmoid(g[j]));
                    og[j] = gy[j] * u[j] * (s * (T::ONE + a * (T::ONE - s)));
                    ou[j] = gy[j] * (a * s);
                }
            }
        });
    out
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "oogc-swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let i2 = last_dim(l);
        if i2 % 2 != 0 {
            candle_core::bail!("oogc-swiglu: last dim must be even (gate | up), got {:?}", l.dims());
        }
        let out = match s {
            CpuStorage::F32(gu) => CpuStorage::F32(swiglu_fwd(contiguous(gu, l, self.name())?, i2)),
            CpuStorage::F64(gu) => CpuStorage::F64(swiglu_fwd(contiguous(gu, l, self.name())?, i2)),
            _ => candle_core::bail!("oogc-swiglu: only F32 and F64 are supported"),
        };
        let mut dims = l.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = i2 / 2;
        Ok((out, Shape::from(dims)))
    }

    fn bwd(&self, gu: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(gu.apply_op2_no_bwd(&grad.contiguous()?, &SwiGluGrad)?))
    }
}

/// The backward of [`swiglu`] without a graph: `(gu, g)` → the gradient of `gu` `[.., 2I]`.
pub(crate) fn swiglu_backward(gu: &Tensor, g: &Tensor) -> Result<Tensor> {
    gu.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &SwiGluGrad)
}

struct SwiGluGrad;

impl CustomOp2 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "oogc-swiglu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let i2 = last_dim(l1);
        if l1.dims().len() != l2.dims().len() || last_dim(l2) * 2 != i2 {
            candle_core::bail!("oogc-swiglu-grad: shapes {:?} {:?}", l1.dims(), l2.dims());
        }
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |gu, gy| swiglu_bwd(gu, gy, i2));
        Ok((out, l1.shape().clone()))
    }
}

// ---- cross-entropy -------------------------------------------------------------------------

/// Per-row cross-entropy `logsumexp(z) − z[target]` of `logits` `[N, V]` against `targets`
/// `[N]` U32 → `[N]`, 0 for a row whose target is [`IGNORE_INDEX`]; with a backward to the
/// logits: `g_row · (softmax(z) − onehot(target))` (0 on ignored rows). The caller sums the rows
/// and divides by the count (transformers' `ForCausalLMLoss`, `reduction = "mean"` with
/// `ignore_index`). Targets must be `< V` or [`IGNORE_INDEX`] (checked by the caller).
pub(crate) fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropyRows)
}

struct CrossEntropyRows;

/// `(max, Σ exp(z − max))` of a row.
#[inline(always)]
fn row_max_sum<T: Real>(z: &[T]) -> (T, T) {
    let m = z.iter().fold(z[0], |m, &v| m.max(v));
    let mut s = T::ZERO;
    for &v in z {
        s += (v - m).exp();
    }
    (m, s)
}

fn ce_fwd<T: Real>(z: &[T], t: &[u32], v: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; t.len()];
    out.par_chunks_mut(ROWS_PER_TASK).zip(z.par_chunks(ROWS_PER_TASK * v).zip(t.par_chunks(ROWS_PER_TASK))).for_each(
        |(o, (z, t))| {
            for ((o, z), &t) in o.iter_mut().zip(z.chunks_exact(v)).zip(t) {
                if t == IGNORE_INDEX {
                    continue;
                }
                let (m, s) = row_max_sum(z);
                *o = s.ln() + m - z[t as usize];
            }
        },
    );
    out
}

fn ce_bwd<T: Real>(z: &[T], t: &[u32], g: &[T], v: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; z.len()];
    out.par_chunks_mut(ROWS_PER_TASK * v)
        .zip(z.par_chunks(ROWS_PER_TASK * v).zip(t.par_chunks(ROWS_PER_TASK).zip(g.par_chunks(ROWS_PER_TASK))))
        .for_each(|(o, (z, (t, g)))| {
            for (((o, z), &t), &g) in o.chunks_exact_mut(v).zip(z.chunks_exact(v)).zip(t).zip(g) {
                if t == IGNORE_INDEX {
                    continue;
                }
                let (m, s) = row_max_sum(z);
                let scale = g / s;
                for (o, &zv) in o.iter_mut().zip(z) {
                    *o = (zv - m).exp() * scale;
                }
                o[t as usize] = o[t as usize] - g;
            }
        });
    out
}

fn ce_dims(l1: &Layout, l2: &Layout, op: &'static str) -> Result<(usize, usize)> {
    match (l1.dims(), l2.dims()) {
        (&[n, v], &[n2]) if n == n2 && v >= 1 => Ok((n, v)),
        (a, b) => candle_core::bail!("{op}: expected logits [N, V] and targets [N], got {a:?} and {b:?}"),
    }
}

impl CustomOp2 for CrossEntropyRows {
    fn name(&self) -> &'static str {
        "oogc-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = ce_dims(l1, l2, self.name())?;
        let CpuStorage::U32(t) = s2 else { candle_core::bail!("oogc-cross-entropy: targets must be U32") };
        let t = contiguous(t, l2, self.name())?;
        let out = match s1 {
            CpuStorage::F32(z) => CpuStorage::F32(ce_fwd(contiguous(z, l1, self.name())?, t, v)),
            CpuStorage::F64(z) => CpuStorage::F64(ce_fwd(contiguous(z, l1, self.name())?, t, v)),
            _ => candle_core::bail!("oogc-cross-entropy: only F32 and F64 are supported"),
        };
        Ok((out, Shape::from(n)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = logits.apply_op3_no_bwd(targets, &grad.contiguous()?, &CrossEntropyGrad)?;
        Ok((Some(g), None))
    }
}

/// The backward of [`cross_entropy_rows`] without a graph: `g_rows` `[N]` → the gradient of
/// the logits `[N, V]`.
pub(crate) fn cross_entropy_backward(logits: &Tensor, targets: &Tensor, g_rows: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(&targets.contiguous()?, &g_rows.contiguous()?, &CrossEntropyGrad)
}

struct CrossEntropyGrad;

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "oogc-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = ce_dims(l1, l2, self.name())?;
        if l3.dims() != [n] {
            candle_core::bail!("oogc-cross-entropy-grad: row gradient {:?}, expected [{n}]", l3.dims());
        }
        let CpuStorage::U32(t) = s2 else { candle_core::bail!("oogc-cross-entropy-grad: targets must be U32") };
        let t = contiguous(t, l2, self.name())?;
        let name = self.name();
        let out = match (s1, s3) {
            (CpuStorage::F32(z), CpuStorage::F32(g)) => {
                CpuStorage::F32(ce_bwd(contiguous(z, l1, name)?, t, contiguous(g, l3, name)?, v))
            }
            (CpuStorage::F64(z), CpuStorage::F64(g)) => {
                CpuStorage::F64(ce_bwd(contiguous(z, l1, name)?, t, contiguous(g, l3, name)?, v))
            }
            _ => candle_core::bail!("{name}: only F32 and F64 of one dtype are supported"),
        };
        Ok((out, l1.shape().clone()))
    }
}
