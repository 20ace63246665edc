//! Differentiable building blocks shared by the model families, composed of candle ops that
//! all have a backward (candle-nn's fused `layer_norm`, `rms_norm`, `softmax_last_dim` and
//! `rope` have none: DESIGN.md, "Traps"), and the helpers that view a unit's flat vector as its
//! parameters.

use candle_core::{DType, Tensor, Var, D};

use crate::kernels;
use crate::unit::UnitSpec;
use crate::{Error, Result};

pub(crate) fn input_err(what: &'static str, expected: String, got: String) -> Error {
    Error::Input { what, expected, got }
}

/// `h W + b` with `h` `[N, in]`, `w` `[in, out]`, `b` `[out]` → `[N, out]`.
pub(crate) fn linear(h: &Tensor, w: &Tensor, b: &Tensor, fused: bool) -> Result<Tensor> {
    let y = h.matmul(w)?;
    Ok(if fused { kernels::bias_add(&y, b)? } else { y.broadcast_add(b)? })
}

/// Views `[shape]` of each parameter into the flat vector (no copy).
pub(crate) fn views(spec: &UnitSpec, flat: &Tensor) -> Result<Vec<Tensor>> {
    spec.params.iter().map(|p| Ok(flat.narrow(0, p.offset, p.numel())?.reshape(p.shape.as_slice())?)).collect()
}

/// One `Var` per parameter, copied out of the flat vector (one pass over the unit's bytes).
///
/// Separate leaves rather than one flat `Var` with narrowed views: candle's backward of `narrow`
/// pads each parameter's gradient to the full flat length and adds it, which costs a pass over
/// the whole unit per parameter; here the flat gradient is one `cat`.
pub(crate) fn vars(spec: &UnitSpec, flat: &Tensor) -> Result<Vec<Var>> {
    views(spec, flat)?.iter().map(|v| Ok(Var::from_tensor(v)?)).collect()
}

/// A scalar tensor's value widened to f64.
pub(crate) fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// LayerNorm over the last dim composed of ops that all have a backward (candle-nn's fused
/// `layer_norm`/`LayerNorm` have none). Statistics in F32 for half dtypes, as
/// `candle_nn::ops::layer_norm_slow`.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64, fused: bool) -> Result<Tensor> {
    let dtype = x.dtype();
    let xs = match dtype {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let mean = xs.mean_keepdim(D::Minus1)?;
    let xc = xs.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_std = (var + eps)?.sqrt()?.recip()?;
    let xn = xc.broadcast_mul(&inv_std)?.to_dtype(dtype)?;
    if fused {
        Ok(kernels::scale_shift(&xn, w, b)?)
    } else {
        Ok(xn.broadcast_mul(w)?.broadcast_add(b)?)
    }
}

/// Tanh-form GELU (GPT-2) composed of ops with a backward, written `x · sigmoid(2u)`,
/// `u = sqrt(2/π) (x + 0.044715 x³)` (equal to `0.5 x (1 + tanh u)`), so its gradient is exact;
/// candle's own `gelu` backward uses 6-digit constants.
pub(crate) fn gelu_composed(x: &Tensor) -> Result<Tensor> {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2/π)
    const A: f64 = 0.044_715;
    let two_u = (x * x.sqr()?.affine(2.0 * C * A, 2.0 * C)?)?;
    Ok((x * candle_nn::ops::sigmoid(&two_u)?)?)
}

/// Softmax over the last dim. The row max is subtracted for range only and detached: softmax is
/// invariant to a per-row constant, so the gradient is exact and the max's backward is skipped.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

/// Mean cross-entropy of `logits` `[B, T, V]` against `targets` `[B, T]` U32, as a scalar
/// tensor: `mean(logsumexp(z) - z[target])`, the logsumexp's max detached (see
/// [`softmax_last_dim`]).
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let v = logits.dim(D::Minus1)?;
    let z = logits.reshape(((), v))?;
    let n = z.dim(0)?;
    let max = z.max_keepdim(D::Minus1)?.detach();
    let lse = (z.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + max)?; // [N, 1]
    let picked = z.gather(&targets.reshape((n, 1))?, D::Minus1)?; // [N, 1]
    Ok(((lse - picked)?.sum_all()? * (1.0 / n as f64))?)
}
