//! What the model families share besides their ops (those are [`crate::kernels`]'s, each in
//! its fused and composed forms): the checks of a unit call's inputs, the views of a unit's
//! flat vector as its parameters and the collection of their gradients, the mixed-precision
//! helpers (half dtypes widened to F32 where torch computes in F32; BF16 matmuls on the CPU
//! through F32) and the embedding's gradient.

use candle_core::{DType, Tensor, Var};

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
