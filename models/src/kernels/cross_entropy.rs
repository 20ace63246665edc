//! The cross-entropy of logits against targets with an ignore index (transformers'
//! `ForCausalLMLoss`, `reduction = "mean"` with `ignore_index`): the fused CPU kernel (per-row
//! losses and their backward) and the composition.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::{contiguous, float_storages, Float, Host, ROWS_PER_TASK};
use crate::lm::IGNORE_INDEX;
use crate::ops::{host_targets, widen};

/// The mean cross-entropy of `logits` `[B, T, V]` against `targets` `[B, T]` U32 over the
/// `count` targets that are not [`IGNORE_INDEX`], as a scalar tensor: the sum of
/// [`cross_entropy_rows`] times `1/count` when `fused` (F32/F64 on the CPU), else
/// [`cross_entropy_composed`] on the logits widened to F32 for half dtypes (as transformers
/// upcasts them), which counts the targets itself.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor, count: usize, fused: bool) -> crate::Result<Tensor> {
    if fused {
        let v = logits.dim(D::Minus1)?;
        let rows = cross_entropy_rows(&logits.reshape(((), v))?, &targets.flatten_all()?)?;
        return Ok((rows.sum_all()? * (1.0 / count.max(1) as f64))?);
    }
    cross_entropy_composed(&widen(logits)?, targets)
}

/// Mean cross-entropy of `logits` `[B, T, V]` against `targets` `[B, T]` U32, as a scalar
/// tensor: `Σ_counted (logsumexp(z) - z[target]) / count` over the positions whose target is not
/// [`IGNORE_INDEX`] (the mean of transformers' `ForCausalLMLoss` with `ignore_index = -100`),
/// the logsumexp's max detached (see [`super::softmax_last_dim`]). When no target is ignored this is
/// `sum(lse - picked) · (1/N)`; ignored positions are gathered at id 0 and multiplied by a 0
/// mask; with no counted position the result is 0 (torch gives NaN) and so are the gradients.
pub(crate) fn cross_entropy_composed(logits: &Tensor, targets: &Tensor) -> crate::Result<Tensor> {
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
fn row_max_sum<T: Float>(z: &[T]) -> (T, T) {
    let m = z.iter().fold(z[0], |m, &v| m.max(v));
    let mut s = T::ZERO;
    for &v in z {
        s += (v - m).exp();
    }
    (m, s)
}

fn ce_fwd<T: Float>(z: &[T], t: &[u32], v: usize) -> Vec<T> {
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

fn ce_bwd<T: Float>(z: &[T], t: &[u32], g: &[T], v: usize) -> Vec<T> {
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
        let out = float_storages!(self.name(), (s1: l1), |z| ce_fwd(z, t, v));
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

    fn cpu_fwd(&self, s1: &Host, l1: &Layout, s2: &Host, l2: &Layout, s3: &Host, l3: &Layout) -> Result<(Host, Shape)> {
        let (n, v) = ce_dims(l1, l2, self.name())?;
        if l3.dims() != [n] {
            candle_core::bail!("oogc-cross-entropy-grad: row gradient {:?}, expected [{n}]", l3.dims());
        }
        let CpuStorage::U32(t) = s2 else { candle_core::bail!("oogc-cross-entropy-grad: targets must be U32") };
        let t = contiguous(t, l2, self.name())?;
        let out = float_storages!(self.name(), (s1: l1, s3: l3), |z, g| ce_bwd(z, t, g, v));
        Ok((out, l1.shape().clone()))
    }
}
