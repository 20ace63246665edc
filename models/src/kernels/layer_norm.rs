//! LayerNorm over the last dim (Ba et al. 2016): the statistics composed of candle ops, the
//! affine part (`x̂ · w + b`) a fused CPU kernel whose `w`/`b` gradients are fast row sums, or
//! composed too.

use candle_core::{CustomOp3, Layout, Result, Shape, Tensor, D};

use super::rows::{row_sum_tensor, rows_par};
use super::{float_storages, last_dim, Float, Host};
use crate::ops::{is_half, widen};

/// LayerNorm over the last dim composed of ops that all have a backward (candle-nn's fused
/// `layer_norm`/`LayerNorm` have none); with `fused` (F32/F64 on the CPU) the scale and shift
/// run as one kernel. Half dtypes compute it all in F32 (statistics, scale and shift) and round
/// the output once, as torch's `layer_norm` on half inputs.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64, fused: bool) -> crate::Result<Tensor> {
    let dtype = x.dtype();
    let xs = widen(x)?;
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
        Ok(scale_shift(&xn, w, b)?)
    } else {
        Ok(xn.broadcast_mul(w)?.broadcast_add(b)?)
    }
}

/// `x * w + b` with `x` `[.., n]`, `w`, `b` `[n]` (LayerNorm's affine part), F32/F64 on the
/// CPU, with a backward whose `w`/`b` gradients are fast row sums.
fn scale_shift(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, ScaleShift)
}

struct ScaleShift;

impl CustomOp3 for ScaleShift {
    fn name(&self) -> &'static str {
        "oogc-scale-shift"
    }

    fn cpu_fwd(&self, s1: &Host, l1: &Layout, s2: &Host, l2: &Layout, s3: &Host, l3: &Layout) -> Result<(Host, Shape)> {
        let n = last_dim(l1);
        if l2.dims() != [n] || l3.dims() != [n] {
            candle_core::bail!("oogc-scale-shift: w {:?}, b {:?} do not match {:?}", l2.dims(), l3.dims(), l1.dims());
        }
        fn run<T: Float>(x: &[T], w: &[T], b: &[T], n: usize) -> Vec<T> {
            rows_par(x, n, |o, x| {
                for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                    *o = x * w + b;
                }
            })
        }
        let out = float_storages!(self.name(), (s1: l1, s2: l2, s3: l3), |x, w, b| run(x, w, b, n));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gx = grad.broadcast_mul(w)?;
        let gw = row_sum_tensor(&(grad * x)?)?;
        let gb = row_sum_tensor(grad)?;
        Ok((Some(gx), Some(gw), Some(gb)))
    }
}
