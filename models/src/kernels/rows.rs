//! A bias added to every row (a linear layer's), and the fixed-order row sum its backward (and
//! the norms' weight gradients) reduce with: the fused CPU kernels and the composition.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{float_storages, last_dim, Float, CHUNK};
use crate::ops::{is_half, matmul, widen};

/// `h W + b` with `h` `[N, in]`, `w` `[in, out]`, `b` `[out]` → `[N, out]` ([`bias_add`]).
pub(crate) fn linear(h: &Tensor, w: &Tensor, b: &Tensor, fused: bool) -> crate::Result<Tensor> {
    let y = matmul(h, w)?;
    bias_add(&y, b, fused)
}

/// `y + b` with `y` `[.., n]` and `b` `[n]` (a linear layer's bias): the fused kernel when
/// `fused` (F32/F64 on the CPU; its backward's bias gradient is a fast row sum: candle's
/// backward of `broadcast_add` reduces over the leading dims with a strided loop, ~13% of a
/// block's time), else [`bias_add_composed`].
pub(crate) fn bias_add(y: &Tensor, b: &Tensor, fused: bool) -> crate::Result<Tensor> {
    if fused {
        Ok(y.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)?)
    } else {
        bias_add_composed(y, b)
    }
}

/// `y + b` with `b` broadcast over the leading dims (a bias). Half dtypes add in F32 and round
/// once (the same value as the half add), so that the bias gradient — a sum over every row —
/// accumulates in F32.
pub(crate) fn bias_add_composed(y: &Tensor, b: &Tensor) -> crate::Result<Tensor> {
    if is_half(y.dtype()) {
        return Ok(widen(y)?.broadcast_add(&widen(b)?)?.to_dtype(y.dtype())?);
    }
    Ok(y.broadcast_add(b)?)
}

/// Rows per partial sum of [`row_sum`]: fixed, so the summation order (and the bits of the
/// result) do not depend on the number of threads.
const ROW_BLOCK: usize = 64;

/// Sum over the rows of `x` `[R, n]` (contiguous) → `[n]`, in a fixed order: partial sums of
/// [`ROW_BLOCK`] rows in parallel, then the partials added in row order.
fn row_sum<T: Float>(x: &[T], n: usize) -> Vec<T> {
    let partials: Vec<Vec<T>> = x
        .par_chunks(ROW_BLOCK * n)
        .map(|blk| {
            let mut acc = vec![T::ZERO; n];
            for row in blk.chunks_exact(n) {
                acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            }
            acc
        })
        .collect();
    let mut out = vec![T::ZERO; n];
    for p in partials {
        out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
    }
    out
}

/// `[n]` sum over the rows of a contiguous `[.., n]` tensor (no backward).
pub(crate) fn row_sum_tensor(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&RowSum)
}

struct RowSum;

impl CustomOp1 for RowSum {
    fn name(&self) -> &'static str {
        "oogc-row-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l);
        let out = float_storages!(self.name(), (s: l), |x| row_sum(x, n));
        Ok((out, Shape::from(n)))
    }
}

/// `f(out_row, x_row)` for every row of `x` `[R, n]` (contiguous), rows spread over the rayon
/// pool in tasks of about [`CHUNK`] elements.
pub(super) fn rows_par<T: Float>(x: &[T], n: usize, f: impl Fn(&mut [T], &[T]) + Sync) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
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
        fn run<T: Float>(x: &[T], b: &[T], n: usize) -> Vec<T> {
            rows_par(x, n, |o, x| o.iter_mut().zip(x.iter().zip(b)).for_each(|(o, (&x, &b))| *o = x + b))
        }
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |x, b| run(x, b, n));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(row_sum_tensor(grad)?)))
    }
}
