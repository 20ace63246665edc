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
    let y = matmul(h, w)?;
    Ok(if fused { kernels::bias_add(&y, b)? } else { bias_add(&y, b)? })
}

// ---- mixed precision -------------------------------------------------------------------------
//
// DESIGN.md "Precision": a half dtype (BF16, F16) computes the matmuls and elementwise ops in
// that dtype, but norm statistics, softmax, RoPE angles, the router and the loss in F32, and
// every reduction over tokens (bias, norm-weight and embedding gradients) accumulates in F32, as
// torch does (its bf16 reductions accumulate in f32; candle's accumulate in the tensor's dtype,
// on the CPU one element after the other). F32 and F64 never take these branches: their ops are
// exactly the plain ones.

/// Whether `dtype` is a half dtype (BF16, F16): the dtypes that widen to F32 where transformers
/// does.
pub(crate) fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `x` widened to F32 when its dtype is a half dtype (exact), else `x` itself (no op).
pub(crate) fn widen(x: &Tensor) -> Result<Tensor> {
    Ok(if is_half(x.dtype()) { x.to_dtype(DType::F32)? } else { x.clone() })
}

/// `a · b` (candle's `matmul`: `[.., m, k] · [.., k, n]`). BF16 on the CPU, whose candle backend
/// has no BF16 gemm, goes through F32: the operands widened (exact), the products accumulated in
/// F32, the result rounded once to BF16 — what a GPU's BF16 GEMM computes (F32 accumulation, one
/// rounding of the output); the backward flows through the casts, so its matmuls accumulate in
/// F32 too and each gradient is rounded once. Every other dtype and device: `a.matmul(b)`.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() == DType::BF16 && a.device().is_cpu() {
        let wide = a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?;
        return Ok(wide.to_dtype(DType::BF16)?);
    }
    Ok(a.matmul(b)?)
}

/// `y + b` with `b` broadcast over the leading dims (a bias). Half dtypes add in F32 and round
/// once (the same value as the half add), so that the bias gradient — a sum over every row —
/// accumulates in F32.
pub(crate) fn bias_add(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    if is_half(y.dtype()) {
        return Ok(widen(y)?.broadcast_add(&widen(b)?)?.to_dtype(y.dtype())?);
    }
    Ok(y.broadcast_add(b)?)
}

/// `x ⊙ w` with `w` `[d]` broadcast over the leading dims (a norm's weight). Half dtypes multiply
/// in F32 and round once (the same value as the half product, which is exact in F32), so that
/// the weight's gradient — a sum over every row — accumulates in F32.
pub(crate) fn scale(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if is_half(x.dtype()) {
        return Ok(widen(x)?.broadcast_mul(&widen(w)?)?.to_dtype(x.dtype())?);
    }
    Ok(x.broadcast_mul(w)?)
}

/// The dtype the attention mask and softmax use for scores of `dtype`: F32 for half dtypes,
/// else `dtype`.
pub(crate) fn softmax_dtype(dtype: DType) -> DType {
    if is_half(dtype) {
        DType::F32
    } else {
        dtype
    }
}

/// The gradient of an embedding table `[rows, d]` gathered at `ids` (`[N]` U32, each
/// `< rows`) from the gradient of the gathered rows `grad` `[N, d]`, in `grad`'s dtype on its
/// device: the rows' gradients (widened) are summed per distinct id in F32, so that a row hit by
/// many tokens accumulates in F32 whatever `grad`'s dtype (candle's `index_select` backward adds
/// in the tensor's dtype), rounded once, and written into zeros `[rows, d]` (each distinct row
/// added once to zero: exact). The F32 temporary is `[U, d]` for the `U ≤ N` distinct ids, not
/// the table's size. The ids are read back to the host.
///
/// # Errors
/// [`Error::Input`] for an id `>= rows`; [`Error::Candle`] on a shape mismatch or a failed op.
pub(crate) fn embedding_grad(ids: &Tensor, grad: &Tensor, rows: usize) -> Result<Tensor> {
    let (n, d) = grad.dims2()?;
    let dev = grad.device();
    let mut compact = vec![u32::MAX; rows];
    let mut distinct: Vec<u32> = Vec::new();
    let mut slots: Vec<u32> = Vec::with_capacity(n);
    for id in ids.to_vec1::<u32>()? {
        let Some(c) = compact.get_mut(id as usize) else {
            return Err(input_err("embedding ids", format!("< {rows}"), id.to_string()));
        };
        if *c == u32::MAX {
            *c = distinct.len() as u32;
            distinct.push(id);
        }
        slots.push(*c);
    }
    let u = distinct.len();
    let sums = Tensor::zeros((u, d), DType::F32, dev)?.index_add(
        &Tensor::from_vec(slots, n, dev)?,
        &grad.to_dtype(DType::F32)?,
        0,
    )?;
    let distinct = Tensor::from_vec(distinct, u, dev)?;
    Ok(Tensor::zeros((rows, d), grad.dtype(), dev)?.index_add(&distinct, &sums.to_dtype(grad.dtype())?, 0)?)
}

/// Views `[shape]` of each parameter into the flat vector (no copy).
pub(crate) fn views(spec: &UnitSpec, flat: &Tensor) -> Result<Vec<Tensor>> {
    spec.params.iter().map(|p| Ok(flat.narrow(0, p.offset, p.numel())?.reshape(p.shape.as_slice())?)).collect()
}

/// A scalar tensor's value widened to f64.
pub(crate) fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// LayerNorm over the last dim composed of ops that all have a backward (candle-nn's fused
/// `layer_norm`/`LayerNorm` have none). Half dtypes compute it all in F32 (statistics, scale
/// and shift) and round the output once, as torch's `layer_norm` on half inputs.
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
    if is_half(dtype) {
        // As torch's layer norm on half inputs: normalize, scale and shift in F32, round once;
        // the weight's and bias's gradients accumulate over the rows in F32.
        let y = xc.broadcast_mul(&inv_std)?.broadcast_mul(&widen(w)?)?.broadcast_add(&widen(b)?)?;
        return Ok(y.to_dtype(dtype)?);
    }
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
///
/// Half dtypes compute it in F32 and round once, as torch's `gelu` kernel on half inputs (the
/// composition in the half dtype would round after each of its five ops, forward and backward).
pub(crate) fn gelu_composed(x: &Tensor) -> Result<Tensor> {
    if is_half(x.dtype()) {
        return Ok(gelu_composed(&widen(x)?)?.to_dtype(x.dtype())?);
    }
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
/// cast back to `x`'s dtype, then multiplied by `w` `[d]` ([`scale`]: the weight's gradient
/// accumulated in F32 for half dtypes).
pub(crate) fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xs = match dtype {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let var = xs.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    let xn = xs.broadcast_mul(&inv)?.to_dtype(dtype)?;
    scale(&xn, w)
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
/// (gate outputs, then up outputs) → `silu(gate) ⊙ up` `[N, I]`; the `silu` in F32 for half
/// dtypes, rounded once, the product in `gu`'s dtype (transformers' `act_fn(gate) * up`).
pub(crate) fn swiglu_composed(gu: &Tensor) -> Result<Tensor> {
    let i = gu.dim(D::Minus1)? / 2;
    let gate = gu.narrow(D::Minus1, 0, i)?;
    let up = gu.narrow(D::Minus1, i, i)?;
    let act = if is_half(gu.dtype()) {
        // As torch's `silu` kernel on half inputs: computed in F32, rounded once (candle's half
        // `silu` rounds after each of its ops, and so does its backward).
        widen(&gate)?.silu()?.to_dtype(gu.dtype())?
    } else {
        gate.silu()?
    };
    Ok((act * up)?)
}
