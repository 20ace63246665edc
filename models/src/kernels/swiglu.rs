//! SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"), as transformers' `LlamaMLP`:
//! the fused CPU kernel (and its backward) and the composition.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::{float_storages, last_dim, Float, ROWS_PER_TASK};
use crate::ops::{is_half, widen};

/// `silu(gate) ⊙ up` of `gu` `[.., 2I]` (gate outputs, then up outputs) → `[.., I]`:
/// [`swiglu_fused`] when `fused` (F32/F64 on the CPU), else [`swiglu_composed`].
pub(crate) fn swiglu(gu: &Tensor, fused: bool) -> crate::Result<Tensor> {
    if fused {
        Ok(swiglu_fused(gu)?)
    } else {
        swiglu_composed(gu)
    }
}

/// SwiGLU composed of ops with a backward (candle's `silu` has an exact one): `gu` `[N, 2I]`
/// (gate outputs, then up outputs) → `silu(gate) ⊙ up` `[N, I]`; the `silu` in F32 for half
/// dtypes, rounded once, the product in `gu`'s dtype (transformers' `act_fn(gate) * up`).
pub(crate) fn swiglu_composed(gu: &Tensor) -> crate::Result<Tensor> {
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

/// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"), as transformers' `LlamaMLP`:
/// `gu` `[.., 2I]` holds `gate_proj` outputs in columns `0..I` and `up_proj` outputs in
/// `I..2I`; the result `[.., I]` is `silu(gate) ⊙ up`, `silu(a) = a · sigmoid(a)`. With a
/// backward to `gu`.
pub(crate) fn swiglu_fused(gu: &Tensor) -> Result<Tensor> {
    gu.contiguous()?.apply_op1(SwiGlu)
}

struct SwiGlu;

#[inline(always)]
fn sigmoid<T: Float>(a: T) -> T {
    T::ONE / (T::ONE + (-a).exp())
}

fn swiglu_fwd<T: Float>(gu: &[T], i2: usize) -> Vec<T> {
    let i = i2 / 2;
    let mut out = vec![T::ZERO; gu.len() / 2];
    out.par_chunks_mut(ROWS_PER_TASK * i).zip(gu.par_chunks(ROWS_PER_TASK * i2)).for_each(|(o, gu)| {
        for (o, gu) in o.chunks_exact_mut(i).zip(gu.chunks_exact(i2)) {
            let (g, u) = gu.split_at(i);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g * sigmoid(g) * u;
            }
        }
    });
    out
}

/// `(gu, gy)` → `[g_gate | g_up]`: `g_gate = gy · u · σ(a)(1 + a(1 − σ(a)))`, `g_up = gy · silu(a)`.
fn swiglu_bwd<T: Float>(gu: &[T], gy: &[T], i2: usize) -> Vec<T> {
    let i = i2 / 2;
    let mut out = vec![T::ZERO; gu.len()];
    out.par_chunks_mut(ROWS_PER_TASK * i2)
        .zip(gu.par_chunks(ROWS_PER_TASK * i2).zip(gy.par_chunks(ROWS_PER_TASK * i)))
        .for_each(|(o, (gu, gy))| {
            for ((o, gu), gy) in o.chunks_exact_mut(i2).zip(gu.chunks_exact(i2)).zip(gy.chunks_exact(i)) {
                let (g, u) = gu.split_at(i);
                let (og, ou) = o.split_at_mut(i);
                for j in 0..i {
                    let (a, s) = (g[j], sigmoid(g[j]));
                    og[j] = gy[j] * u[j] * (s * (T::ONE + a * (T::ONE - s)));
                    ou[j] = gy[j] * (a * s);
                }
            }
        });
    out
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "oogc-swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let i2 = last_dim(l);
        if i2 % 2 != 0 {
            candle_core::bail!("oogc-swiglu: last dim must be even (gate | up), got {:?}", l.dims());
        }
        let out = float_storages!(self.name(), (s: l), |gu| swiglu_fwd(gu, i2));
        let mut dims = l.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = i2 / 2;
        Ok((out, Shape::from(dims)))
    }

    fn bwd(&self, gu: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(gu.apply_op2_no_bwd(&grad.contiguous()?, &SwiGluGrad)?))
    }
}

/// The backward of [`swiglu_fused`] without a graph: `(gu, g)` → the gradient of `gu` `[.., 2I]`.
pub(crate) fn swiglu_backward(gu: &Tensor, g: &Tensor) -> Result<Tensor> {
    gu.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &SwiGluGrad)
}

struct SwiGluGrad;

impl CustomOp2 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "oogc-swiglu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let i2 = last_dim(l1);
        if l1.dims().len() != l2.dims().len() || last_dim(l2) * 2 != i2 {
            candle_core::bail!("oogc-swiglu-grad: shapes {:?} {:?}", l1.dims(), l2.dims());
        }
        let out = float_storages!(self.name(), (s1: l1, s2: l2), |gu, gy| swiglu_bwd(gu, gy, i2));
        Ok((out, l1.shape().clone()))
    }
}
