//! The elementwise-heavy ops of the families, each in one file with its two forms side by side
//! (candle-nn's `ops::rms_norm` / `rms_norm_slow` shape): a fused CPU kernel with its own
//! backward (a candle `CustomOp`), and the composition of candle ops that all have a backward
//! (candle-nn's fused `layer_norm`, `rms_norm`, `softmax_last_dim` and `rope` have none:
//! DESIGN.md, "Traps"). One dispatcher per op takes the path: `fused` (the model's
//! [`crate::Compute::fused`]: its flag and [`fused_supported`]) applies the kernel, else the
//! composition.
//!
//! | file | op | fused kernel (forward, backward) | composed form |
//! |---|---|---|---|
//! | `gelu.rs` | tanh-form GELU (GPT-2) | `Gelu`, `GeluGrad` | `gelu_composed` |
//! | `softmax.rs` | causal softmax of attention; plain softmax | `CausalSoftmax`, `CausalSoftmaxGrad` | [`crate::attention`]'s; `softmax_last_dim` |
//! | `rows.rs` | bias add, linear, row sums | `BiasAdd`, `RowSum` | `bias_add_composed` |
//! | `layer_norm.rs` | LayerNorm | `ScaleShift` (the affine part) | `layer_norm`'s other branch |
//! | `rms_norm.rs` | RMSNorm | `RmsNorm`, `RmsNormGradX`, `RmsNormGXhat` | `rms_norm_composed` |
//! | `rope.rs` | rotary embedding (+ head transpose, scale) | `Rope`, `RopeGrad` | `rope_composed` |
//! | `swiglu.rs` | SwiGLU | `SwiGlu`, `SwiGluGrad` | `swiglu_composed` |
//! | `cross_entropy.rs` | cross-entropy with an ignore index | `CrossEntropyRows`, `CrossEntropyGrad` | `cross_entropy_composed` |
//!
//! Composed of candle ops, each is several passes forward and more backward over the largest
//! tensors of a block (`[B·T, 4d]`, `[B, H, T, T]`; GELU's backward with `tanh` and two `powf`
//! per element, RoPE's `rotate_half` two narrows, a neg, a cat, two broadcast muls and an add);
//! on the CPU they took about a third of a block's time. A kernel is one pass per direction
//! (two for RMSNorm's weight gradient, a fixed-order row sum), spread over the rayon pool. The
//! kernels apply to F32/F64 tensors on `Device::Cpu`; other devices and dtypes take the
//! compositions (same math, checked equal in the families' tests). The compositions compute
//! half dtypes (BF16, F16) as torch does: statistics, softmax and activations in F32, rounded
//! once (DESIGN.md "Precision", [`crate::ops`]).

use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

use candle_core::{DType, Layout, Result, Tensor};

mod cross_entropy;
mod gelu;
mod layer_norm;
mod rms_norm;
mod rope;
mod rows;
mod softmax;
mod swiglu;

pub(crate) use cross_entropy::{cross_entropy, cross_entropy_backward, cross_entropy_composed, cross_entropy_rows};
pub(crate) use gelu::gelu;
pub(crate) use layer_norm::layer_norm;
pub(crate) use rms_norm::{rms_norm, rms_norm_backward, rms_norm_fused};
pub(crate) use rope::{rope, rope_backward, rope_fused};
pub(crate) use rows::{bias_add, linear, row_sum_tensor};
pub(crate) use softmax::{causal_softmax, causal_softmax_backward, softmax_last_dim};
pub(crate) use swiglu::{swiglu, swiglu_backward, swiglu_fused};
/// The compositions alone, for the tests that compare them with the kernels.
#[cfg(test)]
pub(crate) use {rms_norm::rms_norm_composed, rope::rope_composed, swiglu::swiglu_composed};

/// Elements per rayon task of the elementwise kernels (GELU, bias add, scale-and-shift).
const CHUNK: usize = 1 << 14;

/// Rows per rayon task of the row kernels (RMSNorm, SwiGLU, cross-entropy).
const ROWS_PER_TASK: usize = 64;

/// Whether the fused kernels apply to a tensor of this dtype on this device.
pub(crate) fn fused_supported(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The arithmetic the kernels need, for f32 and f64 (each computes in its own precision: f32
/// in f32, one `expf`, f64 in f64).
trait Float:
    Copy
    + Send
    + Sync
    + 'static
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(v: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, o: Self) -> Self;
}

macro_rules! impl_float {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: $t = 0.0;
            const ONE: $t = 1.0;
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                v as $t
            }
            #[inline(always)]
            fn exp(self) -> $t {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> $t {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> $t {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max(self, o: $t) -> $t {
                <$t>::max(self, o)
            }
        }
    };
}
impl_float!(f32);
impl_float!(f64);

/// A CPU storage: what a `CustomOp`'s `cpu_fwd` reads and returns (a short name that keeps the
/// three-input signature on one line).
type Host = candle_core::CpuStorage;

/// The elements of a contiguous layout in `s`, or an error naming `op`.
fn contiguous<'a, T>(s: &'a [T], l: &Layout, op: &'static str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// The size of the last dim of a layout (1 for a scalar).
fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

/// Runs `body` on the contiguous elements of one to three CPU storages of one float precision
/// (each named with its layout), the result wrapped in that precision's storage, or fails
/// naming `op`.
macro_rules! float_storages {
    ($op:expr, ($($s:ident : $l:ident),+), |$($v:ident),+| $body:expr) => {
        match ($($s,)+) {
            ($(candle_core::CpuStorage::F32($v),)+) => {
                $(let $v = $crate::kernels::contiguous($v, $l, $op)?;)+
                candle_core::CpuStorage::F32($body)
            }
            ($(candle_core::CpuStorage::F64($v),)+) => {
                $(let $v = $crate::kernels::contiguous($v, $l, $op)?;)+
                candle_core::CpuStorage::F64($body)
            }
            _ => candle_core::bail!("{}: only F32 and F64 of one dtype are supported", $op),
        }
    };
}
use float_storages;
