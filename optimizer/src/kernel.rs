//! The fused update over slices: [`adam_step`] on one thread, [`AdamKernel`] over a thread pool,
//! and the canonical gradient sum of squares ([`grad_sumsq`]).
//!
//! One pass per element reads `p, m, v, g` and writes `p, m, v` and the compute copy
//! (28 B/param in fp32 with no copy; 4 + 12 + 12 + 2 = 30 B/param with bf16 gradients in and a
//! bf16 copy out, where separate casts would add a pass over the gradients and one over the
//! parameters). The pass is element-wise, so there is nothing to reuse across elements; it is
//! tiled into blocks of [`NORM_BLOCK`] parameters only so that the gradient sum of squares of a
//! block is taken just before the block's update, with the gradients still in L1/L2.
//!
//! **Threads.** [`AdamKernel`] cuts a buffer into as many contiguous ranges as it has threads,
//! each a multiple of [`NORM_BLOCK`] parameters (so no two threads write one cache line, and the
//! norm partials do not depend on the cut), and runs them with `rayon::join` on its own pool.
//! Nothing is allocated inside a step.

use std::sync::Arc;

use half::{bf16, f16};
use rayon::ThreadPool;

use crate::config::{AdamConfig, AdamKind};
use crate::error::{Error, Result};
use crate::simd::{self, Isa};
use oogc_swapper::DType;

/// Parameters per block of the gradient norm and of the thread cut: the global sum of squares
/// is the sum, in order, of per-block sums (each in the 16-lane order of [`grad_sumsq`]).
pub const NORM_BLOCK: usize = 16 * 1024;

/// Least parameters given to one thread; smaller buffers use fewer threads.
const MIN_PARAMS_PER_THREAD: usize = 4 * NORM_BLOCK;

/// The per-step constants of the element update, in f32, from [`AdamConfig::scalars`].
///
/// The element update (every [`Isa`] evaluates exactly this, in this order; `fma` is a fused
/// multiply-add, the rest IEEE f32):
///
/// ```text
/// g ← g·scale                      (clipping; scale = 1 without)
/// g ← g + p·wd                     (Adam only, when wd ≠ 0)
/// p ← p·(1 − lr·wd)                (AdamW only)
/// m ← fma(1 − β1, g − m, m)        (torch's lerp)
/// v ← v·β2 + ((1 − β2)·g)·g
/// p ← p − (step_size·m) / (sqrt(v) / sqrt(1 − β2^t) + eps),   step_size = lr / (1 − β1^t)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    pub(crate) scale: f32,
    pub(crate) l2: f32,
    pub(crate) has_l2: bool,
    pub(crate) decay: f32,
    pub(crate) c1: f32,
    pub(crate) b2: f32,
    pub(crate) c2: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) eps: f32,
    pub(crate) step_size: f32,
    /// The step `t` (1-based): the stochastic rounding of bf16 master weights draws from it.
    pub(crate) t: u64,
}

impl StepScalars {
    pub(crate) fn new(cfg: &AdamConfig, t: u64, lr: f32, grad_scale: f32) -> Self {
        let (lr64, b1, b2, wd) = (lr as f64, cfg.beta1, cfg.beta2, cfg.weight_decay);
        let tf = t as f64;
        let bc1 = 1.0 - b1.powf(tf);
        let bc2 = 1.0 - b2.powf(tf);
        let (l2, decay) = match cfg.kind {
            AdamKind::AdamW => (0.0, (1.0 - lr64 * wd) as f32),
            AdamKind::Adam => (wd as f32, 1.0),
        };
        Self {
            scale: grad_scale,
            l2,
            has_l2: l2 != 0.0,
            decay,
            c1: (1.0 - b1) as f32,
            b2: b2 as f32,
            c2: (1.0 - b2) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: cfg.eps as f32,
            step_size: (lr64 / bc1) as f32,
            t,
        }
    }

    /// The step `t` (1-based) these constants are of.
    pub fn step(&self) -> u64 {
        self.t
    }

    /// The same constants with another gradient scale.
    pub fn with_grad_scale(mut self, grad_scale: f32) -> Self {
        self.scale = grad_scale;
        self
    }

    /// The gradient scale (clipping factor).
    pub fn grad_scale(&self) -> f32 {
        self.scale
    }

    /// `lr / (1 − β1^t)`, rounded to f32.
    pub fn step_size(&self) -> f32 {
        self.step_size
    }

    /// The element update's constants, for an implementation of the same update elsewhere (a
    /// device optimizer): see [`ElementConstants`] for the formula they enter.
    pub fn element_constants(&self) -> ElementConstants {
        ElementConstants {
            grad_scale: self.scale,
            l2: self.l2,
            decay: self.decay,
            c1: self.c1,
            b2: self.b2,
            c2: self.c2,
            bc2_sqrt: self.bc2_sqrt,
            eps: self.eps,
            step_size: self.step_size,
        }
    }
}

/// The f32 constants of one step's element update, as the CPU kernel uses them (torch's fused
/// AdamW/Adam; `t` 1-based):
///
/// ```text
/// g ← g · grad_scale + l2 · p          (l2 = weight decay for Adam, 0 for AdamW)
/// p ← p · decay                        (decay = 1 − lr · wd for AdamW, 1 for Adam)
/// m ← m + c1 · (g − m)                 (c1 = 1 − β1)
/// v ← v · b2 + (c2 · g) · g            (c2 = 1 − β2)
/// p ← p − step_size · m / (√v / bc2_sqrt + eps)   (step_size = lr / (1 − β1^t), bc2_sqrt = √(1 − β2^t))
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ElementConstants {
    /// The step's gradient scale (the clipping factor; 1 unclipped).
    pub grad_scale: f32,
    /// L2 coefficient added to the gradient (Adam), 0 for AdamW.
    pub l2: f32,
    /// Decoupled weight-decay factor on `p` (AdamW), 1 for Adam.
    pub decay: f32,
    /// `1 − β1`.
    pub c1: f32,
    /// `β2`.
    pub b2: f32,
    /// `1 − β2`.
    pub c2: f32,
    /// `√(1 − β2^t)`.
    pub bc2_sqrt: f32,
    /// ε.
    pub eps: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
}

/// Gradients of a unit or a slice of it, borrowed (`len()` elements).
#[derive(Debug, Clone, Copy)]
pub enum GradSlice<'a> {
    /// fp32 gradients.
    F32(&'a [f32]),
    /// bf16 gradients (up-cast exactly in the kernel).
    BF16(&'a [bf16]),
    /// f16 gradients (up-cast exactly in the kernel).
    F16(&'a [f16]),
}

impl<'a> GradSlice<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            GradSlice::F32(g) => g.len(),
            GradSlice::BF16(g) => g.len(),
            GradSlice::F16(g) => g.len(),
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            GradSlice::F32(_) => DType::F32,
            GradSlice::BF16(_) => DType::BF16,
            GradSlice::F16(_) => DType::F16,
        }
    }

    /// Elements `range`.
    ///
    /// # Panics
    /// If `range` is out of bounds.
    pub fn slice(&self, range: std::ops::Range<usize>) -> GradSlice<'a> {
        match *self {
            GradSlice::F32(g) => GradSlice::F32(&g[range]),
            GradSlice::BF16(g) => GradSlice::BF16(&g[range]),
            GradSlice::F16(g) => GradSlice::F16(&g[range]),
        }
    }

    /// The gradients' bytes (little-endian, `dtype().num_bytes(len())` of them).
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            GradSlice::F32(g) => bytemuck::cast_slice(g),
            GradSlice::BF16(g) => bytemuck::cast_slice(g),
            GradSlice::F16(g) => bytemuck::cast_slice(g),
        }
    }

    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            GradSlice::F32(g) => g[i],
            GradSlice::BF16(g) => g[i].to_f32(),
            GradSlice::F16(g) => g[i].to_f32(),
        }
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        (self.slice(0..mid), self.slice(mid..self.len()))
    }
}

/// Where the update writes the compute copy of the parameters (`None`: nowhere).
#[derive(Debug)]
pub enum CopyOut<'a> {
    /// No compute copy.
    None,
    /// fp32 copy.
    F32(&'a mut [f32]),
    /// bf16 copy, round-to-nearest-even (NaN stays NaN), bit-identical to `half::bf16::from_f32`.
    BF16(&'a mut [bf16]),
    /// f16 copy, round-to-nearest-even, bit-identical to `half::f16::from_f32`.
    F16(&'a mut [f16]),
}

impl CopyOut<'_> {
    /// Elements (`None` for no copy).
    #[allow(clippy::len_without_is_empty)] // "no copy" is not "an empty copy"
    pub fn len(&self) -> Option<usize> {
        match self {
            CopyOut::None => None,
            CopyOut::F32(o) => Some(o.len()),
            CopyOut::BF16(o) => Some(o.len()),
            CopyOut::F16(o) => Some(o.len()),
        }
    }

    /// The same destination as a byte buffer of `dtype` (`bytes.len()` a multiple of its size).
    ///
    /// # Panics
    /// If the bytes are not aligned to or a multiple of the element size (no bytes need no
    /// alignment), or `dtype` is not a float type ([`DType::U8`]).
    pub fn from_bytes(dtype: DType, bytes: &mut [u8]) -> CopyOut<'_> {
        if bytes.is_empty() {
            // No elements (a data-parallel rank's empty shard): an empty buffer's address need
            // not be aligned for the dtype, so no cast.
            return match dtype {
                DType::F32 => CopyOut::F32(&mut []),
                DType::BF16 => CopyOut::BF16(&mut []),
                DType::F16 => CopyOut::F16(&mut []),
                DType::U8 => panic!("a compute copy is a float type, not u8"),
            };
        }
        match dtype {
            DType::F32 => CopyOut::F32(bytemuck::cast_slice_mut(bytes)),
            DType::BF16 => CopyOut::BF16(bytemuck::cast_slice_mut(bytes)),
            DType::F16 => CopyOut::F16(bytemuck::cast_slice_mut(bytes)),
            DType::U8 => panic!("a compute copy is a float type, not u8"),
        }
    }

    #[inline(always)]
    pub(crate) fn set(&mut self, i: usize, p: f32) {
        match self {
            CopyOut::None => {}
            CopyOut::F32(o) => o[i] = p,
            CopyOut::BF16(o) => o[i] = bf16::from_f32(p),
            CopyOut::F16(o) => o[i] = f16::from_f32(p),
        }
    }

    /// Elements `range` of the destination, reborrowed.
    ///
    /// # Panics
    /// If `range` is out of bounds.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> CopyOut<'_> {
        match self {
            CopyOut::None => CopyOut::None,
            CopyOut::F32(o) => CopyOut::F32(&mut o[range]),
            CopyOut::BF16(o) => CopyOut::BF16(&mut o[range]),
            CopyOut::F16(o) => CopyOut::F16(&mut o[range]),
        }
    }

    /// Element type of the copy (`None` for no copy).
    pub(crate) fn dtype(&self) -> Option<DType> {
        match self {
            CopyOut::None => None,
            CopyOut::F32(_) => Some(DType::F32),
            CopyOut::BF16(_) => Some(DType::BF16),
            CopyOut::F16(_) => Some(DType::F16),
        }
    }

    /// The destination's current bytes (`None` for no copy): what an update whose master
    /// weights live in the compute copy reads before it overwrites them.
    pub(crate) fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            CopyOut::None => None,
            CopyOut::F32(o) => Some(bytemuck::cast_slice(o)),
            CopyOut::BF16(o) => Some(bytemuck::cast_slice(o)),
            CopyOut::F16(o) => Some(bytemuck::cast_slice(o)),
        }
    }

    pub(crate) fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            CopyOut::None => (CopyOut::None, CopyOut::None),
            CopyOut::F32(o) => {
                let (a, b) = o.split_at_mut(mid);
                (CopyOut::F32(a), CopyOut::F32(b))
            }
            CopyOut::BF16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (CopyOut::BF16(a), CopyOut::BF16(b))
            }
            CopyOut::F16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (CopyOut::F16(a), CopyOut::F16(b))
            }
        }
    }
}

/// The optimizer state an update reads and writes: fp32 master weights `p`, first moment `m`,
/// second moment `v`, all of one length.
#[derive(Debug)]
pub enum StateIo<'a> {
    /// Read and written in place.
    InPlace {
        /// Master weights.
        p: &'a mut [f32],
        /// First moment (torch's `exp_avg`).
        m: &'a mut [f32],
        /// Second moment (torch's `exp_avg_sq`).
        v: &'a mut [f32],
    },
    /// Read from `src = [p, m, v]`, written to `dst = [p, m, v]`, leaving `src` as it was (the
    /// speculative update of the pipelined step; same bytes moved as in place).
    OutOfPlace {
        /// Old state.
        src: [&'a [f32]; 3],
        /// New state.
        dst: [&'a mut [f32]; 3],
    },
}

impl StateIo<'_> {
    /// Elements of `p`.
    pub fn len(&self) -> usize {
        match self {
            StateIo::InPlace { p, .. } => p.len(),
            StateIo::OutOfPlace { src, .. } => src[0].len(),
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check(&self) -> Result<()> {
        let n = self.len();
        let lens: [(&str, usize); 5] = match self {
            StateIo::InPlace { m, v, .. } => [("m", m.len()), ("v", v.len()), ("", n), ("", n), ("", n)],
            StateIo::OutOfPlace { src, dst } => [
                ("src m", src[1].len()),
                ("src v", src[2].len()),
                ("dst p", dst[0].len()),
                ("dst m", dst[1].len()),
                ("dst v", dst[2].len()),
            ],
        };
        for (what, got) in lens {
            if got != n {
                return Err(Error::LengthMismatch {
                    what: format!("optimizer state {what} (length of p)"),
                    expected: n,
                    got,
                });
            }
        }
        Ok(())
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            StateIo::InPlace { p, m, v } => {
                let (p0, p1) = p.split_at_mut(mid);
                let (m0, m1) = m.split_at_mut(mid);
                let (v0, v1) = v.split_at_mut(mid);
                (StateIo::InPlace { p: p0, m: m0, v: v0 }, StateIo::InPlace { p: p1, m: m1, v: v1 })
            }
            StateIo::OutOfPlace { src, dst } => {
                let [sp, sm, sv] = src;
                let [dp, dm, dv] = dst;
                let (sp0, sp1) = sp.split_at(mid);
                let (sm0, sm1) = sm.split_at(mid);
                let (sv0, sv1) = sv.split_at(mid);
                let (dp0, dp1) = dp.split_at_mut(mid);
                let (dm0, dm1) = dm.split_at_mut(mid);
                let (dv0, dv1) = dv.split_at_mut(mid);
                (
                    StateIo::OutOfPlace { src: [sp0, sm0, sv0], dst: [dp0, dm0, dv0] },
                    StateIo::OutOfPlace { src: [sp1, sm1, sv1], dst: [dp1, dm1, dv1] },
                )
            }
        }
    }
}

pub(crate) fn check_isa(isa: Isa) -> Result<()> {
    if isa.is_available() {
        Ok(())
    } else {
        Err(Error::IsaUnavailable { isa })
    }
}

/// Checks the lengths of `state` (its own buffers), `grads`, `out` and `partials` (one slot per
/// [`NORM_BLOCK`]).
fn check_work<S: StepState>(
    state: &S,
    grads: &GradSlice<'_>,
    out: &CopyOut<'_>,
    partials: Option<&[f64]>,
) -> Result<()> {
    state.check()?;
    check_io(state.len(), grads, out)?;
    partials.map_or(Ok(()), |p| check_partials(state.len(), p))
}

/// One step over `state` on the calling thread, block by block, with the block sums of squares
/// written to `partials` when given; every length checked.
pub(crate) fn step_one<S: StepState>(
    isa: Isa,
    scalars: &StepScalars,
    state: S,
    grads: GradSlice<'_>,
    out: CopyOut<'_>,
    partials: Option<&mut [f64]>,
) -> Result<()> {
    check_isa(isa)?;
    check_work(&state, &grads, &out, partials.as_deref())?;
    Work { state, grads, out, partials }.run(isa, scalars);
    Ok(())
}

/// Checks that `grads` and `out` (unless `None`) have `n` elements.
pub(crate) fn check_io(n: usize, grads: &GradSlice<'_>, out: &CopyOut<'_>) -> Result<()> {
    if grads.len() != n {
        return Err(Error::LengthMismatch { what: "gradients (length of p)".into(), expected: n, got: grads.len() });
    }
    if let Some(got) = out.len() {
        if got != n {
            return Err(Error::LengthMismatch { what: "compute copy (length of p)".into(), expected: n, got });
        }
    }
    Ok(())
}

/// One Adam/AdamW step over `state` with `grads`, writing the compute copy to `out`, on the
/// calling thread with the `isa` path. Algorithm: see [`StepScalars`].
///
/// # Errors
/// [`Error::IsaUnavailable`] when the CPU lacks `isa`; [`Error::LengthMismatch`] when `grads`,
/// `out` or a state slice has another length than `p`.
pub fn adam_step(
    isa: Isa,
    scalars: &StepScalars,
    state: StateIo<'_>,
    grads: GradSlice<'_>,
    out: CopyOut<'_>,
) -> Result<()> {
    check_isa(isa)?;
    check_work(&state, &grads, &out, None)?;
    simd::adam(isa, scalars, state, grads, out);
    Ok(())
}

/// The sum of squares of `grads` in f64, in the canonical order: per block of [`NORM_BLOCK`]
/// elements, element `i` into lane `i % 16`, lanes reduced pairwise (8, 4, 2, 1); the block sums
/// added in order. Squares of f32 are exact in f64, so every [`Isa`] and every thread cut of the
/// pipelined step give the same bits. Non-finite for any non-finite gradient.
///
/// # Errors
/// [`Error::IsaUnavailable`].
pub fn grad_sumsq(isa: Isa, grads: GradSlice<'_>) -> Result<f64> {
    check_isa(isa)?;
    let mut total = 0.0f64;
    let mut start = 0;
    while start < grads.len() {
        let end = (start + NORM_BLOCK).min(grads.len());
        total += simd::sumsq(isa, grads.slice(start..end));
        start = end;
    }
    Ok(total)
}

/// The global gradient norm from per-unit sums of squares, in the order given (callers pass
/// them in unit-id order): `sqrt(Σ sumsq)` in f64.
pub fn global_norm(sumsqs: impl IntoIterator<Item = f64>) -> f64 {
    sumsqs.into_iter().fold(0.0f64, |a, s| a + s).sqrt()
}

/// The clipping factor of torch's `clip_grad_norm_(max_norm)`: `min(1, max_norm / (norm + 1e-6))`,
/// in f64, rounded to f32; 1 when `max_norm` is `None`.
pub fn clip_scale(norm: f64, max_norm: Option<f32>) -> f32 {
    match max_norm {
        Some(c) => (c as f64 / (norm + 1e-6)).min(1.0) as f32,
        None => 1.0,
    }
}

/// The per-parameter state a step updates in place, as a thread's range of it: cut at block
/// boundaries and updated one [`NORM_BLOCK`] at a time by [`run_parts`]. The f32 state
/// ([`StateIo`]) and the reduced moments of [`crate::quant`] are the two.
pub(crate) trait StepState: Sized + Send {
    /// Parameters covered.
    fn len(&self) -> usize;
    /// Cuts at `mid`, a multiple of [`NORM_BLOCK`].
    fn split_at(self, mid: usize) -> (Self, Self);
    /// Updates these parameters on this thread with `grads`, writing the compute copy to `out`.
    fn step(self, isa: Isa, s: &StepScalars, grads: GradSlice<'_>, out: CopyOut<'_>);
    /// Checks that the state's own buffers are `len()` long.
    fn check(&self) -> Result<()>;
}

impl StepState for StateIo<'_> {
    fn len(&self) -> usize {
        StateIo::len(self)
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        StateIo::split_at(self, mid)
    }

    fn step(self, isa: Isa, s: &StepScalars, grads: GradSlice<'_>, out: CopyOut<'_>) {
        simd::adam(isa, s, self, grads, out)
    }

    fn check(&self) -> Result<()> {
        StateIo::check(self)
    }
}

/// One buffer's worth of work, cut along with the buffers.
pub(crate) struct Work<'a, S> {
    pub(crate) state: S,
    pub(crate) grads: GradSlice<'a>,
    pub(crate) out: CopyOut<'a>,
    /// One slot per [`NORM_BLOCK`] for the block sums of squares, or none.
    pub(crate) partials: Option<&'a mut [f64]>,
}

impl<'a, S: StepState> Work<'a, S> {
    /// Cuts at `mid`, a multiple of [`NORM_BLOCK`].
    fn split_at(self, mid: usize) -> (Self, Self) {
        debug_assert_eq!(mid % NORM_BLOCK, 0);
        let (s0, s1) = self.state.split_at(mid);
        let (g0, g1) = self.grads.split_at(mid);
        let (o0, o1) = self.out.split_at(mid);
        let (n0, n1) = match self.partials {
            Some(p) => {
                let (a, b) = p.split_at_mut(mid / NORM_BLOCK);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        (Work { state: s0, grads: g0, out: o0, partials: n0 }, Work { state: s1, grads: g1, out: o1, partials: n1 })
    }

    /// Runs block by block on this thread: the block's sum of squares (when asked), then its update.
    pub(crate) fn run(self, isa: Isa, s: &StepScalars) {
        let mut rest = (self.state.len() > 0).then_some(self);
        while let Some(w) = rest.take() {
            let (now, later) = if w.state.len() > NORM_BLOCK {
                let (a, b) = w.split_at(NORM_BLOCK);
                (a, Some(b))
            } else {
                (w, None)
            };
            if let Some(slot) = now.partials.and_then(|p| p.first_mut()) {
                *slot = simd::sumsq(isa, now.grads);
            }
            now.state.step(isa, s, now.grads, now.out);
            rest = later;
        }
    }
}

/// Checks that `partials` has one slot per [`NORM_BLOCK`] of `n` parameters.
pub(crate) fn check_partials(n: usize, partials: &[f64]) -> Result<()> {
    let blocks = n.div_ceil(NORM_BLOCK);
    if partials.len() != blocks {
        return Err(Error::LengthMismatch {
            what: "norm partials scratch".into(),
            expected: blocks,
            got: partials.len(),
        });
    }
    Ok(())
}

/// Runs `w` over `parts` threads of the current rayon pool, cut at multiples of [`NORM_BLOCK`].
pub(crate) fn run_parts<S: StepState>(w: Work<'_, S>, parts: usize, isa: Isa, s: &StepScalars) {
    let blocks = w.state.len().div_ceil(NORM_BLOCK);
    if parts <= 1 || blocks <= 1 {
        return w.run(isa, s);
    }
    let left_parts = parts / 2;
    let mid = (blocks * left_parts / parts).max(1) * NORM_BLOCK;
    let (a, b) = w.split_at(mid);
    rayon::join(|| run_parts(a, left_parts, isa, s), || run_parts(b, parts - left_parts, isa, s));
}

/// The fused update over a thread pool of its own: [`adam_step`] with the buffer cut into one
/// contiguous range per thread (ranges of whole [`NORM_BLOCK`]s, at least 4 blocks each).
///
/// Cloning shares the pool.
#[derive(Clone)]
pub struct AdamKernel {
    isa: Isa,
    threads: usize,
    pool: Arc<ThreadPool>,
}

impl std::fmt::Debug for AdamKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamKernel").field("isa", &self.isa).field("threads", &self.threads).finish()
    }
}

impl AdamKernel {
    /// A kernel on `isa` with a pool of `threads` threads (named `oogc-opt-<i>`).
    ///
    /// # Errors
    /// [`Error::IsaUnavailable`]; [`Error::Config`] for 0 threads; [`Error::ThreadPool`] when
    /// the threads cannot be started.
    pub fn new(isa: Isa, threads: usize) -> Result<Self> {
        check_isa(isa)?;
        if threads == 0 {
            return Err(Error::Config { key: "optimizer.threads".into(), reason: "must be at least 1".into() });
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("oogc-opt-{i}"))
            .build()
            .map_err(|e| Error::ThreadPool { threads, reason: e.to_string() })?;
        Ok(Self { isa, threads, pool: Arc::new(pool) })
    }

    /// The dispatch path.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads of the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job` on the pool, asynchronously (the pipelined optimizer's unit jobs).
    pub(crate) fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        self.pool.spawn(job)
    }

    /// Threads to use for `n` parameters (at least [`MIN_PARAMS_PER_THREAD`] each).
    pub(crate) fn parts(&self, n: usize) -> usize {
        self.threads.min(n.div_ceil(MIN_PARAMS_PER_THREAD)).max(1)
    }

    /// [`adam_step`] over the pool's threads. Blocks until done; allocates nothing.
    ///
    /// # Errors
    /// As [`adam_step`].
    pub fn step(
        &self,
        scalars: &StepScalars,
        state: StateIo<'_>,
        grads: GradSlice<'_>,
        out: CopyOut<'_>,
    ) -> Result<()> {
        self.step_state(scalars, state, grads, out, None).map(|_| ())
    }

    /// [`AdamKernel::step`] that also returns the gradients' sum of squares ([`grad_sumsq`]'s
    /// bits), taken block by block just before each block's update. `partials` is scratch of
    /// `len.div_ceil(NORM_BLOCK)` slots.
    ///
    /// # Errors
    /// As [`adam_step`]; [`Error::LengthMismatch`] for `partials`.
    pub fn step_with_sumsq(
        &self,
        scalars: &StepScalars,
        state: StateIo<'_>,
        grads: GradSlice<'_>,
        out: CopyOut<'_>,
        partials: &mut [f64],
    ) -> Result<f64> {
        self.step_state(scalars, state, grads, out, Some(partials))
    }

    /// One step over `state` on the pool's threads (whole [`NORM_BLOCK`]s per thread, the same
    /// bits as on one thread), with the block sums of squares into `partials` when given;
    /// returns their sum (0 without). Every length checked.
    pub(crate) fn step_state<S: StepState>(
        &self,
        scalars: &StepScalars,
        state: S,
        grads: GradSlice<'_>,
        out: CopyOut<'_>,
        mut partials: Option<&mut [f64]>,
    ) -> Result<f64> {
        check_work(&state, &grads, &out, partials.as_deref())?;
        let parts = self.parts(state.len());
        let w = Work { state, grads, out, partials: partials.as_deref_mut() };
        self.pool.install(|| run_parts(w, parts, self.isa, scalars));
        Ok(partials.map_or(0.0, |p| p.iter().fold(0.0f64, |a, &s| a + s)))
    }

    /// [`grad_sumsq`] on this kernel's path, on the calling thread.
    pub fn grad_sumsq(&self, grads: GradSlice<'_>) -> f64 {
        grad_sumsq(self.isa, grads).expect("the kernel's isa was checked at construction")
    }

    /// Runs `f` inside the pool (so nested `step`s use its threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
