//! RMSNorm over the last dim (Zhang & Sennrich 2019), as transformers' `LlamaRMSNorm`: the
//! fused CPU kernel (forward, and its backward to `x` and to the weight) and the composition.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::rows::row_sum_tensor;
use super::{float_storages, last_dim, Float, Host, ROWS_PER_TASK};
use crate::ops::{is_half, widen};

/// RMSNorm of `x` `[.., d]` with weight `w` `[d]`: [`rms_norm_fused`] when `fused` (F32/F64 on
/// the CPU), else [`rms_norm_composed`].
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, fused: bool) -> crate::Result<Tensor> {
    if fused {
        Ok(rms_norm_fused(x, w, eps)?)
    } else {
        rms_norm_composed(x, w, eps)
    }
}

/// RMSNorm over the last dim (Zhang & Sennrich 2019), as transformers' `LlamaRMSNorm`:
/// `y = w ⊙ (x · 1/sqrt(mean(x²) + eps))`, `x` `[.., d]`, `w` `[d]`, with a backward for both
/// (the fused CPU kernel, F32/F64).
pub(crate) fn rms_norm_fused(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

/// RMSNorm over the last dim (Zhang & Sennrich 2019) composed of ops that all have a backward
/// (candle-nn's fused `rms_norm`/`RmsNorm` have none), in the cast order of transformers'
/// `LlamaRMSNorm`: the statistics in F32 (half dtypes are widened), `x · 1/sqrt(mean(x²) + eps)`
/// cast back to `x`'s dtype, then multiplied by `w` `[d]` ([`scale`]: the weight's gradient
/// accumulated in F32 for half dtypes).
pub(crate) fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> crate::Result<Tensor> {
    let dtype = x.dtype();
    let xs = widen(x)?;
    let var = xs.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    let xn = xs.broadcast_mul(&inv)?.to_dtype(dtype)?;
    scale(&xn, w)
}

/// `x ⊙ w` with `w` `[d]` broadcast over the leading dims (a norm's weight). Half dtypes multiply
/// in F32 and round once (the same value as the half product, which is exact in F32), so that
/// the weight's gradient — a sum over every row — accumulates in F32.
fn scale(x: &Tensor, w: &Tensor) -> crate::Result<Tensor> {
    if is_half(x.dtype()) {
        return Ok(widen(x)?.broadcast_mul(&widen(w)?)?.to_dtype(x.dtype())?);
    }
    Ok(x.broadcast_mul(w)?)
}

struct RmsNorm {
    eps: f64,
}

/// `1 / sqrt(mean(x²) + eps)` of one row.
#[inline(always)]
fn rstd<T: Float>(x: &[T], eps: T) -> T {
    let mut ss = T::ZERO;
    for &v in x {
        ss += v * v;
    }
    T::ONE / (ss / T::from_f64(x.len() as f64) + eps).sqrt()
}

fn rms_norm_fwd<T: Float>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
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
fn rms_norm_grad_x<T: Float>(x: &[T], w: &[T], g: &[T], eps: f64) -> Vec<T> {
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

/// `g ⊙ x̂` (summed over rows by [`row_sum_tensor`] into the weight gradient).
fn rms_norm_g_xhat<T: Float>(x: &[T], g: &[T], d: usize, eps: f64) -> Vec<T> {
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
        let gw = row_sum_tensor(&g_xhat)?;
        Ok((Some(gx), Some(gw)))
    }
}

/// The backward of [`rms_norm_fused`] without a graph: `(g_x, g_w)` for the output gradient `g`.
pub(crate) fn rms_norm_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (x, w, g) = (x.contiguous()?, w.contiguous()?, g.contiguous()?);
    let gx = x.apply_op3_no_bwd(&w, &g, &RmsNormGradX { eps })?;
    let gw = row_sum_tensor(&x.apply_op2_no_bwd(&g, &RmsNormGXhat { eps })?)?;
    Ok((gx, gw))
}

struct RmsNormGradX {
    eps: f64,
}

impl CustomOp3 for RmsNormGradX {
    fn name(&self) -> &'static str {
        "oogc-rms-norm-grad-x"
    }

    fn cpu_fwd(&self, s1: &Host, l1: &Layout, s2: &Host, l2: &Layout, s3: &Host, l3: &Layout) -> Result<(Host, Shape)> {
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
