//! Softmax over the last dim: the causal softmax of attention scores as a fused CPU kernel (its
//! composed form is the attention core of [`crate::attention`], over query blocks with a
//! mask), and the plain softmax composed of candle ops (routers, tests).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::{float_storages, Float};

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

/// Softmax over the last dim. The row max is subtracted for range only and detached: softmax is
/// invariant to a per-row constant, so the gradient is exact and the max's backward is skipped.
pub(crate) fn softmax_last_dim(x: &Tensor) -> crate::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

struct CausalSoftmax;

fn causal_dims(l: &Layout, op: &'static str) -> Result<usize> {
    let dims = l.dims();
    match dims {
        [.., q, k] if q == k => Ok(*k),
        _ => candle_core::bail!("{op}: expected [.., T, T], got {dims:?}"),
    }
}

fn causal_softmax_fwd<T: Float>(x: &[T], t: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
    out.par_chunks_mut(t * t).zip(x.par_chunks(t * t)).for_each(|(o, x)| {
        for i in 0..t {
            let (xr, or) = (&x[i * t..i * t + i + 1], &mut o[i * t..i * t + i + 1]);
            let m = xr.iter().fold(xr[0], |m, &v| m.max(v));
            let mut sum = T::ZERO;
            for (o, &v) in or.iter_mut().zip(xr) {
                let e = (v - m).exp();
                *o = e;
                sum += e;
            }
            let inv = T::ONE / sum;
            or.iter_mut().for_each(|o| *o = *o * inv);
            // Columns after i stay 0.
        }
    });
    out
}

/// `gx = y ⊙ (g − rowsum(g ⊙ y))`, over the causal part of each row (y is 0 elsewhere).
fn causal_softmax_bwd<T: Float>(y: &[T], g: &[T], t: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; y.len()];
    out.par_chunks_mut(t * t).zip(y.par_chunks(t * t).zip(g.par_chunks(t * t))).for_each(|(o, (y, g))| {
        for i in 0..t {
            let r = i * t..i * t + i + 1;
            let (yr, gr, or) = (&y[r.clone()], &g[r.clone()], &mut o[r]);
            let dot = yr.iter().zip(gr).fold(T::ZERO, |s, (&y, &g)| s + y * g);
            for ((o, &y), &g) in or.iter_mut().zip(yr).zip(gr) {
                *o = y * (g - dot);
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
        let out = float_storages!(self.name(), (s: l), |x| causal_softmax_fwd(x, t));
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
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |y, g| causal_softmax_bwd(y, g, t));
        Ok((out, l1.shape().clone()))
    }
}
