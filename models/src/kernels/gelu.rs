//! Tanh-form GELU of GPT-2 (Hendrycks & Gimpel 2016), written `x · sigmoid(2u)`,
//! `u = sqrt(2/π) (x + 0.044715 x³)` — equal to `0.5 x (1 + tanh u)` — so it needs one `exp`
//! per element and its derivative is exact (candle's built-in `gelu` backward uses 6-digit
//! constants): the fused kernel and the composition.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{float_storages, Float, CHUNK};
use crate::ops::{is_half, widen};

/// `sqrt(2/π)`.
const GELU_C: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const GELU_A: f64 = 0.044_715;

/// Tanh-form GELU of `x` (any shape): the fused kernel when `fused` (F32/F64 on the CPU), else
/// [`gelu_composed`]; both with a backward.
pub(crate) fn gelu(x: &Tensor, fused: bool) -> crate::Result<Tensor> {
    if fused {
        Ok(x.contiguous()?.apply_op1(Gelu)?)
    } else {
        gelu_composed(x)
    }
}

/// Tanh-form GELU (GPT-2) composed of ops with a backward, written `x · sigmoid(2u)`,
/// `u = sqrt(2/π) (x + 0.044715 x³)` (equal to `0.5 x (1 + tanh u)`), so its gradient is exact;
/// candle's own `gelu` backward uses 6-digit constants.
///
/// Half dtypes compute it in F32 and round once, as torch's `gelu` kernel on half inputs (the
/// composition in the half dtype would round after each of its five ops, forward and backward).
pub(crate) fn gelu_composed(x: &Tensor) -> crate::Result<Tensor> {
    if is_half(x.dtype()) {
        return Ok(gelu_composed(&widen(x)?)?.to_dtype(x.dtype())?);
    }
    let two_u = (x * x.sqr()?.affine(2.0 * GELU_C * GELU_A, 2.0 * GELU_C)?)?;
    Ok((x * candle_nn::ops::sigmoid(&two_u)?)?)
}

/// `gelu(x)` in `T`'s precision.
#[inline(always)]
fn gelu_of<T: Float>(x: T) -> T {
    let (c, a) = (T::from_f64(GELU_C), T::from_f64(GELU_A));
    let u2 = T::from_f64(2.0) * c * x * (T::ONE + a * x * x);
    x / (T::ONE + (-u2).exp())
}

/// `g · gelu'(x)` in `T`'s precision.
#[inline(always)]
fn gelu_grad_of<T: Float>(x: T, g: T) -> T {
    let (c, a) = (T::from_f64(GELU_C), T::from_f64(GELU_A));
    let x2 = x * x;
    let s = T::ONE / (T::ONE + (T::from_f64(-2.0) * c * x * (T::ONE + a * x2)).exp());
    g * (s + x * s * (T::ONE - s) * T::from_f64(2.0) * c * (T::ONE + T::from_f64(3.0) * a * x2))
}

fn map1<T: Float>(x: &[T], f: impl Fn(T) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)));
    out
}

fn map2<T: Float>(x: &[T], y: &[T], f: impl Fn(T, T) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
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
        let out = float_storages!(self.name(), (s: l), |x| map1(x, gelu_of));
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
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |x, g| map2(x, g, gelu_grad_of));
        Ok((out, l1.shape().clone()))
    }
}
