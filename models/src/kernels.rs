//! Fused CPU kernels, with a backward, for the two elementwise-heavy pieces of a block: the
//! GELU of the MLP and the causal softmax of attention.
//!
//! Composed of candle ops, each is 5–6 passes forward and 10–15 backward over the largest
//! tensors of a block (`[B·T, 4d]` and `[B, H, T, T]`), GELU's backward with `tanh` and two
//! `powf` per element; on the CPU they took about a third of a block's time. Here each
//! direction is one pass, spread over the rayon pool. They are used for F32/F64 tensors on
//! `Device::Cpu`; other devices and dtypes use the op compositions in [`crate::ops`] (same math).
//!
//! The GELU is the tanh form of GPT-2 (Hendrycks & Gimpel 2016), written
//! `x · sigmoid(2u)`, `u = sqrt(2/π) (x + 0.044715 x³)` — equal to `0.5 x (1 + tanh u)` — so it
//! needs one `exp` per element; its derivative is exact (candle's built-in `gelu` backward uses
//! 6-digit constants).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// `sqrt(2/π)`.
const GELU_C: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const GELU_A: f64 = 0.044_715;
/// Elements per rayon task for elementwise kernels.
const CHUNK: usize = 1 << 14;

/// Whether the fused kernels apply to a tensor of this dtype on this device.
pub(crate) fn fused_supported(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// Tanh-form GELU of `x` (any shape, F32/F64 on the CPU), with a backward.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

/// Softmax over the last dim of `x` `[.., T, T]` with the causal mask: row `i` of each
/// `[T, T]` matrix is normalised over columns `0..=i`, columns after `i` are 0. F32/F64 on the
/// CPU, with a backward.
pub(crate) fn causal_softmax(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(CausalSoftmax)
}

/// The backward of [`causal_softmax`] without a graph: `y` its output, `g` the gradient of the
/// output (both `[.., T, T]`, F32/F64 on the CPU) → `y ⊙ (g − rowsum(g ⊙ y))` on the causal part.
pub(crate) fn causal_softmax_backward(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    y.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &CausalSoftmaxGrad)
}

fn contiguous<'a, T>(s: &'a [T], l: &Layout, op: &'static str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// Dispatches a kernel generic over f32/f64 on a CPU storage.
macro_rules! on_float {
    ($s:expr, $op:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F32($v) => CpuStorage::F32($body),
            CpuStorage::F64($v) => CpuStorage::F64($body),
            _ => candle_core::bail!("{}: only F32 and F64 are supported", $op),
        }
    };
}

/// The math of each kernel, per precision. f32 computes in f32 (one `expf`), f64 in f64.
trait Kernel: Copy + Send + Sync + 'static {
    fn gelu(x: Self) -> Self;
    /// `g · gelu'(x)`.
    fn gelu_grad(x: Self, g: Self) -> Self;
    fn exp(self) -> Self;
    fn zero() -> Self;
    fn one() -> Self;
    fn max(self, o: Self) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
}

macro_rules! impl_kernel {
    ($t:ty) => {
        impl Kernel for $t {
            #[inline(always)]
            fn gelu(x: $t) -> $t {
                let (c, a) = (GELU_C as $t, GELU_A as $t);
                let u2 = 2.0 * c * x * (1.0 + a * x * x);
                x / (1.0 + (-u2).exp())
            }
            #[inline(always)]
            fn gelu_grad(x: $t, g: $t) -> $t {
                let (c, a) = (GELU_C as $t, GELU_A as $t);
                let x2 = x * x;
                let s = 1.0 / (1.0 + (-2.0 * c * x * (1.0 + a * x2)).exp());
                g * (s + x * s * (1.0 - s) * 2.0 * c * (1.0 + 3.0 * a * x2))
            }
            #[inline(always)]
            fn exp(self) -> $t {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn zero() -> $t {
                0.0
            }
            #[inline(always)]
            fn one() -> $t {
                1.0
            }
            #[inline(always)]
            fn max(self, o: $t) -> $t {
                <$t>::max(self, o)
            }
            #[inline(always)]
            fn add(self, o: $t) -> $t {
                self + o
            }
            #[inline(always)]
            fn sub(self, o: $t) -> $t {
                self - o
            }
            #[inline(always)]
            fn mul(self, o: $t) -> $t {
                self * o
            }
            #[inline(always)]
            fn div(self, o: $t) -> $t {
                self / o
            }
        }
    };
}
impl_kernel!(f32);
impl_kernel!(f64);

fn map1<T: Kernel>(x: &[T], f: impl Fn(T) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)));
    out
}

fn map2<T: Kernel>(x: &[T], y: &[T], f: impl Fn(T, T) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(y.par_chunks(CHUNK)))
        .for_each(|(o, (x, y))| o.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (&x, &y))| *o = f(x, y)));
    out
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "oogc-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = on_float!(s, self.name(), |v| map1(contiguous(v, l, "oogc-gelu")?, Kernel::gelu));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(&grad.contiguous()?, &GeluGrad)?))
    }
}

/// `(x, g) -> g · gelu'(x)`.
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "oogc-gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(map2(
                contiguous(x, l1, "oogc-gelu-grad")?,
                contiguous(g, l2, "oogc-gelu-grad")?,
                Kernel::gelu_grad,
            )),
            (CpuStorage::F64(x), CpuStorage::F64(g)) => CpuStorage::F64(map2(
                contiguous(x, l1, "oogc-gelu-grad")?,
                contiguous(g, l2, "oogc-gelu-grad")?,
                Kernel::gelu_grad,
            )),
            _ => candle_core::bail!("oogc-gelu-grad: unsupported dtypes"),
        };
        Ok((out, l1.shape().clone()))
    }
}

struct CausalSoftmax;

fn causal_dims(l: &Layout, op: &'static str) -> Result<usize> {
    let dims = l.dims();
    match dims {
        [.., q, k] if q == k => Ok(*k),
        _ => candle_core::bail!("{op}: expected [.., T, T], got {dims:?}"),
    }
}

fn causal_softmax_fwd<T: Kernel>(x: &[T], t: usize) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(t * t).zip(x.par_chunks(t * t)).for_each(|(o, x)| {
        for i in 0..t {
            let (xr, or) = (&x[i * t..i * t + i + 1], &mut o[i * t..i * t + i + 1]);
            let m = xr.iter().fold(xr[0], |m, &v| m.max(v));
            let mut sum = T::zero();
            for (o, &v) in or.iter_mut().zip(xr) {
                let e = v.sub(m).exp();
                *o = e;
                sum = sum.add(e);
            }
            let inv = T::one().div(sum);
            or.iter_mut().for_each(|o| *o = o.mul(inv));
            // Columns after i stay 0.
        }
    });
    out
}

/// `gx = y ⊙ (g − rowsum(g ⊙ y))`, over the causal part of each row (y is 0 elsewhere).
fn causal_softmax_bwd<T: Kernel>(y: &[T], g: &[T], t: usize) -> Vec<T> {
    let mut out = vec![T::zero(); y.len()];
    out.par_chunks_mut(t * t).zip(y.par_chunks(t * t).zip(g.par_chunks(t * t))).for_each(|(o, (y, g))| {
        for i in 0..t {
            let r = i * t..i * t + i + 1;
            let (yr, gr, or) = (&y[r.clone()], &g[r.clone()], &mut o[r]);
            let dot = yr.iter().zip(gr).fold(T::zero(), |s, (&y, &g)| s.add(y.mul(g)));
            for ((o, &y), &g) in or.iter_mut().zip(yr).zip(gr) {
                *o = y.mul(g.sub(dot));
            }
        }
    });
    out
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "oogc-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let t = causal_dims(l, self.name())?;
        let out = on_float!(s, self.name(), |v| causal_softmax_fwd(contiguous(v, l, "oogc-causal-softmax")?, t));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &CausalSoftmaxGrad)?))
    }
}

/// `(y, g) -> y ⊙ (g − rowsum(g ⊙ y))` on the causal part.
struct CausalSoftmaxGrad;

impl CustomOp2 for CausalSoftmaxGrad {
    fn name(&self) -> &'static str {
        "oogc-causal-softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let t = causal_dims(l1, self.name())?;
        let n = self.name();
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                CpuStorage::F32(causal_softmax_bwd(contiguous(y, l1, n)?, contiguous(g, l2, n)?, t))
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                CpuStorage::F64(causal_softmax_bwd(contiguous(y, l1, n)?, contiguous(g, l2, n)?, t))
            }
            _ => candle_core::bail!("{n}: unsupported dtypes"),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// `x + b` with `x` `[.., n]` and `b` `[n]` (a linear layer's bias), F32/F64 on the CPU, with a
/// backward whose bias gradient is a fast row sum (candle's backward of `broadcast_add` reduces
/// over the leading dims with a strided loop, ~13% of a block's time).
pub(crate) fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

/// `x * w + b` with `x` `[.., n]`, `w`, `b` `[n]` (LayerNorm's affine part), F32/F64 on the
/// CPU, with a backward whose `w`/`b` gradients are fast row sums.
pub(crate) fn scale_shift(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, ScaleShift)
}

/// Rows per partial sum of [`row_sum`]: fixed, so the summation order (and the bits of the
/// result) do not depend on the number of threads.
const ROW_BLOCK: usize = 64;

/// Sum over the rows of `x` `[R, n]` (contiguous) → `[n]`, in a fixed order: partial sums of
/// [`ROW_BLOCK`] rows in parallel, then the partials added in row order.
fn row_sum<T: Kernel>(x: &[T], n: usize) -> Vec<T> {
    let partials: Vec<Vec<T>> = x
        .par_chunks(ROW_BLOCK * n)
        .map(|blk| {
            let mut acc = vec![T::zero(); n];
            for row in blk.chunks_exact(n) {
                acc.iter_mut().zip(row).for_each(|(a, &v)| *a = a.add(v));
            }
            acc
        })
        .collect();
    let mut out = vec![T::zero(); n];
    for p in partials {
        out.iter_mut().zip(p).for_each(|(o, v)| *o = o.add(v));
    }
    out
}

/// `[n]` sum over the rows of a contiguous `[.., n]` tensor (no backward).
pub(crate) fn row_sum_tensor(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&RowSum)
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

struct RowSum;

impl CustomOp1 for RowSum {
    fn name(&self) -> &'static str {
        "oogc-row-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l);
        let out = on_float!(s, self.name(), |v| row_sum(contiguous(v, l, "oogc-row-sum")?, n));
        Ok((out, Shape::from(n)))
    }
}

fn rows_par<T: Kernel>(x: &[T], n: usize, f: impl Fn(&mut [T], &[T]) + Sync) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    let rows = (CHUNK / n.max(1)).max(1);
    out.par_chunks_mut(rows * n).zip(x.par_chunks(rows * n)).for_each(|(o, x)| {
        for (o, x) in o.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
            f(o, x)
        }
    });
    out
}

struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "oogc-bias-add"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l1);
        if l2.dims() != [n] {
            candle_core::bail!("oogc-bias-add: bias {:?} does not match {:?}", l2.dims(), l1.dims());
        }
        let name = self.name();
        fn run<T: Kernel>(x: &[T], b: &[T], n: usize) -> Vec<T> {
            rows_par(x, n, |o, x| o.iter_mut().zip(x.iter().zip(b)).for_each(|(o, (&x, &b))| *o = x.add(b)))
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(b)) => {
                CpuStorage::F32(run(contiguous(x, l1, name)?, contiguous(b, l2, name)?, n))
            }
            (CpuStorage::F64(x), CpuStorage::F64(b)) => {
                CpuStorage::F64(run(contiguous(x, l1, name)?, contiguous(b, l2, name)?, n))
            }
            _ => candle_core::bail!("{name}: only F32 and F64 are supported"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(row_sum_tensor(grad)?)))
    }
}

struct ScaleShift;

impl candle_core::CustomOp3 for ScaleShift {
    fn name(&self) -> &'static str {
        "oogc-scale-shift"
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
        let n = last_dim(l1);
        if l2.dims() != [n] || l3.dims() != [n] {
            candle_core::bail!("oogc-scale-shift: w {:?}, b {:?} do not match {:?}", l2.dims(), l3.dims(), l1.dims());
        }
        let name = self.name();
        fn run<T: Kernel>(x: &[T], w: &[T], b: &[T], n: usize) -> Vec<T> {
            rows_par(x, n, |o, x| {
                for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                    *o = x.mul(w).add(b);
                }
            })
        }
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::F32(run(contiguous(x, l1, name)?, contiguous(w, l2, name)?, contiguous(b, l3, name)?, n))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                CpuStorage::F64(run(contiguous(x, l1, name)?, contiguous(w, l2, name)?, contiguous(b, l3, name)?, n))
            }
            _ => candle_core::bail!("{name}: only F32 and F64 are supported"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gx = grad.broadcast_mul(w)?;
        let gw = row_sum_tensor(&(grad * x)?)?;
        let gb = row_sum_tensor(grad)?;
        Ok((Some(gx), Some(gw), Some(gb)))
    }
}
