//! Rotary position embedding (Su et al. 2021, "RoFormer") in transformers' `rotate_half`
//! convention: the fused CPU kernel (with the head transpose and the attention scale folded
//! in, and its backward) and the composition.

use candle_core::{CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::{float_storages, Float, Host};

/// RoPE on the projection's output `x` `[B, T, nh, hd]` → `[B, nh, T, hd]` contiguous, times
/// `scale`: [`rope_fused`] with the half tables `cos`, `sin` `[T, hd/2]` when `fused` (F32/F64
/// on the CPU), else [`rope_composed`] on the transposed `x` with the full tables `[T, hd]`, then
/// the copy that makes it contiguous, which multiplies by `scale` unless it is 1 (the keys).
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64, fused: bool) -> crate::Result<Tensor> {
    if fused {
        return Ok(rope_fused(x, cos, sin, scale)?);
    }
    let y = rope_composed(&x.transpose(1, 2)?, cos, sin)?;
    Ok(if scale == 1.0 { y.contiguous()? } else { y.affine(scale, 0.0)? })
}

/// Rotary position embedding in transformers' `rotate_half` convention, composed of ops with a
/// backward: `x · cos + rotate_half(x) · sin`, `rotate_half(x) = cat(−x[.., hd/2..], x[.., ..hd/2])`,
/// with `x` `[B, nh, T, hd]` (any strides) and `cos`, `sin` `[T, hd]` (the half tables repeated).
pub(crate) fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> crate::Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let half = hd / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// Rotary position embedding (Su et al. 2021, "RoFormer") in transformers' `rotate_half`
/// convention (`apply_rotary_pos_emb` of `modeling_llama.py`), fused with the head transpose and
/// a scale: `x` `[B, T, nh, hd]` (the projection's output, contiguous), `cos`, `sin`
/// `[T, hd/2]` → `[B, nh, T, hd]` contiguous with, for `i < hd/2`,
/// `y[i] = s (x[i] cos_i − x[i + hd/2] sin_i)`, `y[i + hd/2] = s (x[i + hd/2] cos_i + x[i] sin_i)`.
/// The backward (to `x` only; the tables are constants) is the inverse rotation, transposed back.
pub(crate) fn rope_fused(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { scale })
}

struct Rope {
    scale: f64,
}

/// `(B, T, nh, hd)` of a RoPE input and the tables' `[T, hd/2]` check.
fn rope_dims(x: &[usize], tab: &Layout, tab2: &Layout, op: &'static str) -> Result<(usize, usize, usize, usize)> {
    let &[b, t, nh, hd] = x else { candle_core::bail!("{op}: expected [B, T, nh, hd], got {x:?}") };
    if hd % 2 != 0 || tab.dims() != [t, hd / 2] || tab2.dims() != [t, hd / 2] {
        candle_core::bail!("{op}: tables {:?}, {:?} do not match {x:?}", tab.dims(), tab2.dims());
    }
    Ok((b, t, nh, hd))
}

/// Forward (`inverse = false`): `[B, T, nh, hd]` → `[B, nh, T, hd]` rotated by +θ.
/// Backward (`inverse = true`): `[B, nh, T, hd]` → `[B, T, nh, hd]` rotated by −θ.
fn rope_apply<T: Float>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    (_, t, nh, hd): (usize, usize, usize, usize),
    scale: f64,
    inverse: bool,
) -> Vec<T> {
    let half = hd / 2;
    let s = T::from_f64(scale);
    let mut out = vec![T::ZERO; x.len()];
    // Forward: tasks over the output's (b, head) blocks [T, hd]; backward: over (b, t) rows
    // [nh, hd]. Either way a task writes one contiguous block.
    let block = if inverse { nh * hd } else { t * hd };
    out.par_chunks_mut(block).enumerate().for_each(|(k, o)| {
        let rot = |dst: &mut [T], src: &[T], pos: usize| {
            let (c, sn) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
            let (d1, d2) = dst.split_at_mut(half);
            let (x1, x2) = src.split_at(half);
            if inverse {
                for i in 0..half {
                    d1[i] = s * (x1[i] * c[i] + x2[i] * sn[i]);
                    d2[i] = s * (x2[i] * c[i] - x1[i] * sn[i]);
                }
            } else {
                for i in 0..half {
                    d1[i] = s * (x1[i] * c[i] - x2[i] * sn[i]);
                    d2[i] = s * (x2[i] * c[i] + x1[i] * sn[i]);
                }
            }
        };
        if inverse {
            // k = bi * t + ti; output row [nh, hd]; source (bi, h, ti) in [B, nh, T, hd].
            let (bi, ti) = (k / t, k % t);
            for h in 0..nh {
                let src = ((bi * nh + h) * t + ti) * hd;
                rot(&mut o[h * hd..(h + 1) * hd], &x[src..src + hd], ti);
            }
        } else {
            // k = bi * nh + h; output block [T, hd]; source (bi, ti, h) in [B, T, nh, hd].
            let (bi, h) = (k / nh, k % nh);
            for ti in 0..t {
                let src = ((bi * t + ti) * nh + h) * hd;
                rot(&mut o[ti * hd..(ti + 1) * hd], &x[src..src + hd], ti);
            }
        }
    });
    out
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "oogc-rope"
    }

    fn cpu_fwd(&self, s1: &Host, l1: &Layout, s2: &Host, l2: &Layout, s3: &Host, l3: &Layout) -> Result<(Host, Shape)> {
        let dims = rope_dims(l1.dims(), l2, l3, self.name())?;
        let (b, t, nh, hd) = dims;
        let out = float_storages!(self.name(), (s1: l1, s2: l2, s3: l3), |x, c, s| rope_apply(x, c, s, dims, self.scale, false));
        Ok((out, Shape::from((b, nh, t, hd))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &RopeGrad { scale: self.scale })?;
        Ok((Some(gx), None, None))
    }
}

/// The backward of [`rope_fused`] without a graph: `g` `[B, nh, T, hd]` → `[B, T, nh, hd]`.
pub(crate) fn rope_backward(g: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
    g.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &RopeGrad { scale })
}

/// The backward of [`Rope`]: `[B, nh, T, hd]` → `[B, T, nh, hd]`, rotated by −θ and scaled.
struct RopeGrad {
    scale: f64,
}

impl CustomOp3 for RopeGrad {
    fn name(&self) -> &'static str {
        "oogc-rope-grad"
    }

    fn cpu_fwd(&self, s1: &Host, l1: &Layout, s2: &Host, l2: &Layout, s3: &Host, l3: &Layout) -> Result<(Host, Shape)> {
        let &[b, nh, t, hd] = l1.dims() else {
            candle_core::bail!("oogc-rope-grad: expected [B, nh, T, hd], got {:?}", l1.dims())
        };
        let dims = rope_dims(&[b, t, nh, hd], l2, l3, self.name())?;
        let out = float_storages!(self.name(), (s1: l1, s2: l2, s3: l3), |g, c, s| rope_apply(g, c, s, dims, self.scale, true));
        Ok((out, Shape::from((b, t, nh, hd))))
    }
}
