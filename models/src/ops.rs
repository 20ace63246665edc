//! Differentiable building blocks shared by the model families, composed of candle ops that
//! all have a backward (candle-nn's fused `layer_norm`, `rms_norm`, `softmax_last_dim` and
//! `rope` have none: DESIGN.md, "Traps"), and the helpers that view a unit's flat vector as its
//! parameters.

use candle_core::{DType, Tensor, Var, D};

use crate::kernels;
use crate::lm::{UnitGrads, IGNORE_INDEX};
use crate::unit::UnitSpec;
use crate::{Error, Result};

pub(crate) fn input_err(what: &'static str, expected: String, got: String) -> Error {
    Error::Input { what, expected, got }
}

/// `units[unit]`, or [`Error::Input`] (`what = "unit index"`).
pub(crate) fn unit_spec(units: &[UnitSpec], unit: usize) -> Result<&UnitSpec> {
    units.get(unit).ok_or_else(|| input_err("unit index", format!("< {}", units.len()), unit.to_string()))
}

/// A unit's flat parameters are 1-D of `spec.numel` elements and a float dtype.
pub(crate) fn check_params(spec: &UnitSpec, params: &Tensor) -> Result<()> {
    if params.dims() != [spec.numel] {
        return Err(input_err(
            "unit parameters shape",
            format!("[{}] (unit {})", spec.numel, spec.name),
            format!("{:?}", params.dims()),
        ));
    }
    if !params.dtype().is_float() {
        return Err(input_err("unit parameters dtype", "a float dtype".into(), format!("{:?}", params.dtype())));
    }
    Ok(())
}

/// Hidden states are `[B, 1 <= T <= max_t, d]` of the params' `dtype`.
pub(crate) fn check_hidden(x: &Tensor, dtype: DType, d: usize, max_t: usize, what: &'static str) -> Result<()> {
    let ok = matches!(x.dims(), &[_, t, dd] if dd == d && t >= 1 && t <= max_t);
    if !ok {
        return Err(input_err(what, format!("[B, T <= {max_t}, {d}]"), format!("{:?}", x.dims())));
    }
    if x.dtype() != dtype {
        return Err(input_err(what, format!("dtype {dtype:?} (the params')"), format!("{:?}", x.dtype())));
    }
    Ok(())
}

/// Token ids are U32 `[B >= 1, 1 <= T <= max_t]`, each `< vocab`.
pub(crate) fn check_ids(ids: &Tensor, vocab: usize, max_t: usize, what: &'static str) -> Result<()> {
    let ok = matches!(ids.dims(), &[b, t] if b >= 1 && t >= 1 && t <= max_t);
    if !ok || ids.dtype() != DType::U32 {
        return Err(input_err(what, format!("U32 [B, T <= {max_t}]"), format!("{:?} {:?}", ids.dtype(), ids.dims())));
    }
    let max = ids.max_all()?.to_scalar::<u32>()? as usize;
    if max >= vocab {
        return Err(input_err(what, format!("ids < vocab_size = {vocab}"), format!("id {max}")));
    }
    Ok(())
}

/// Targets are `[B, T]` (`bt`) U32, each `< vocab` or [`IGNORE_INDEX`]; returns the number of
/// counted positions.
pub(crate) fn check_targets(targets: &Tensor, bt: &[usize], vocab: usize) -> Result<usize> {
    if targets.dims() != bt {
        return Err(input_err("targets shape", format!("{bt:?}"), format!("{:?}", targets.dims())));
    }
    Ok(check_target_ids(targets, vocab)?.1)
}

/// The embedding unit's flat vector a tied head takes: present (`what` names the argument and
/// `key` the config key that ties), of the embedding's shape and the head params' `dtype`.
pub(crate) fn tied_flat<'a>(
    tied: Option<&'a Tensor>,
    embedding: &UnitSpec,
    dtype: DType,
    what: &'static str,
    key: &str,
) -> Result<&'a Tensor> {
    let flat =
        tied.ok_or_else(|| input_err(what, format!("the embedding unit's flat params ({key})"), "None".into()))?;
    check_params(embedding, flat)?;
    if flat.dtype() != dtype {
        return Err(input_err(what, format!("dtype {dtype:?} (the head params')"), format!("{:?}", flat.dtype())));
    }
    Ok(flat)
}

/// Flattens the gradients of `vars` into one vector in layout order (zeros for a parameter the
/// output does not depend on), plus the input's and, for a tied head, the embedding's (its
/// `[V, d]` gradient first in a vector of `embedding_numel` elements, zeros after).
pub(crate) fn collect_grads(
    vars: &[Var],
    x: Option<&Var>,
    tied: Option<&Var>,
    grads: &candle_core::backprop::GradStore,
    embedding_numel: usize,
) -> Result<UnitGrads> {
    let flat_grad = |v: &Var| -> Result<Tensor> {
        Ok(match grads.get(v.as_tensor()) {
            Some(g) => g.flatten_all()?,
            None => v.as_tensor().zeros_like()?.flatten_all()?,
        })
    };
    let parts = vars.iter().map(flat_grad).collect::<Result<Vec<_>>>()?;
    let grad_params = Tensor::cat(&parts, 0)?;
    let grad_input = match x {
        Some(x) => Some(match grads.get(x.as_tensor()) {
            Some(g) => g.clone(),
            None => x.as_tensor().zeros_like()?,
        }),
        None => None,
    };
    let grad_tied_wte = match tied {
        Some(w) => {
            let g = flat_grad(w)?;
            let rest = embedding_numel - g.elem_count();
            Some(if rest == 0 { g } else { Tensor::cat(&[&g, &Tensor::zeros(rest, g.dtype(), g.device())?], 0)? })
        }
        None => None,
    };
    Ok(UnitGrads { grad_params, grad_input, grad_tied_wte })
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

/// `targets` (any shape, U32) read back to the host, flattened.
///
/// # Errors
/// [`Error::Input`] when `targets` is not U32; [`Error::Candle`] on a failed read.
pub(crate) fn host_targets(targets: &Tensor) -> Result<Vec<u32>> {
    if targets.dtype() != DType::U32 {
        return Err(input_err("targets", "dtype U32".into(), format!("{:?}", targets.dtype())));
    }
    Ok(targets.flatten_all()?.to_vec1::<u32>()?)
}

/// Checks that every target is `< vocab` or [`IGNORE_INDEX`] and returns the host copy
/// (flattened) with the number of counted positions.
///
/// # Errors
/// [`Error::Input`] (`what = "targets"`) naming the first bad id.
pub(crate) fn check_target_ids(targets: &Tensor, vocab: usize) -> Result<(Vec<u32>, usize)> {
    let ids = host_targets(targets)?;
    let mut count = 0;
    for &t in &ids {
        if t == IGNORE_INDEX {
            continue;
        }
        if t as usize >= vocab {
            return Err(input_err(
                "targets",
                format!("ids < vocab_size = {vocab} or IGNORE_INDEX (u32::MAX)"),
                format!("id {t}"),
            ));
        }
        count += 1;
    }
    Ok((ids, count))
}

/// Mean cross-entropy of `logits` `[B, T, V]` against `targets` `[B, T]` U32, as a scalar
/// tensor: `Σ_counted (logsumexp(z) - z[target]) / count` over the positions whose target is not
/// [`IGNORE_INDEX`] (the mean of transformers' `ForCausalLMLoss` with `ignore_index = -100`),
/// the logsumexp's max detached (see [`softmax_last_dim`]). When no target is ignored this is
/// `sum(lse - picked) · (1/N)`; ignored positions are gathered at id 0 and multiplied by a 0
/// mask; with no counted position the result is 0 (torch gives NaN) and so are the gradients.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let v = logits.dim(D::Minus1)?;
    let z = logits.reshape(((), v))?;
    let n = z.dim(0)?;
    let ids = host_targets(targets)?;
    let count = ids.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let max = z.max_keepdim(D::Minus1)?.detach();
    let lse = (z.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + max)?; // [N, 1]
    if count == n {
        let picked = z.gather(&targets.reshape((n, 1))?, D::Minus1)?; // [N, 1]
        return Ok(((lse - picked)?.sum_all()? * (1.0 / n as f64))?);
    }
    let dev = logits.device();
    let safe: Vec<u32> = ids.iter().map(|&t| if t == IGNORE_INDEX { 0 } else { t }).collect();
    let mask: Vec<f32> = ids.iter().map(|&t| if t == IGNORE_INDEX { 0.0 } else { 1.0 }).collect();
    let safe = Tensor::from_vec(safe, (n, 1), dev)?;
    let mask = Tensor::from_vec(mask, (n, 1), dev)?.to_dtype(logits.dtype())?;
    let picked = z.gather(&safe, D::Minus1)?; // [N, 1]
    Ok((((lse - picked)? * mask)?.sum_all()? * (1.0 / count.max(1) as f64))?)
}

/// RMSNorm over the last dim (Zhang & Sennrich 2019) composed of ops that all have a backward
/// (candle-nn's fused `rms_norm`/`RmsNorm` have none), in the cast order of transformers'
/// `LlamaRMSNorm`: the statistics in F32 (half dtypes are widened), `x · 1/sqrt(mean(x²) + eps)`
/// cast back to `x`'s dtype, then multiplied by `w` `[d]`.
pub(crate) fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xs = match dtype {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let var = xs.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    let xn = xs.broadcast_mul(&inv)?.to_dtype(dtype)?;
    Ok(xn.broadcast_mul(w)?)
}

/// Rotary position embedding in transformers' `rotate_half` convention, composed of ops with a
/// backward: `x · cos + rotate_half(x) · sin`, `rotate_half(x) = cat(−x[.., hd/2..], x[.., ..hd/2])`,
/// with `x` `[B, nh, T, hd]` (any strides) and `cos`, `sin` `[T, hd]` (the half tables repeated).
pub(crate) fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let half = hd / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// SwiGLU composed of ops with a backward (candle's `silu` has an exact one): `gu` `[N, 2I]`
/// (gate outputs, then up outputs) → `silu(gate) ⊙ up` `[N, I]`.
pub(crate) fn swiglu_composed(gu: &Tensor) -> Result<Tensor> {
    let i = gu.dim(D::Minus1)? / 2;
    let gate = gu.narrow(D::Minus1, 0, i)?;
    let up = gu.narrow(D::Minus1, i, i)?;
    Ok((gate.silu()? * up)?)
}
