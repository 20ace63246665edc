//! Adam's moments `m` and `v` in fewer bytes: [`StateDType`] (f32, bf16 or block-wise int8),
//! the block codecs, and [`adam_step_moments`], the step that reads and writes them.
//!
//! Source: Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via Block-wise
//! Quantization" (ICLR 2022), as in bitsandbytes' `AdamW8bit`: each block of [`QUANT_BLOCK`]
//! values is normalized by its own absolute maximum (one f32 per block) and each normalized value
//! is stored as the 8-bit code of the nearest value of a fixed codebook. The step dequantizes a
//! block, updates it in f32 exactly as the f32 kernel does (the same [`StepScalars`], the same
//! vector code on every [`Isa`]), and requantizes it with the absmax of the updated values.
//! Master weights stay f32. Each stage is a vector loop on the [`Isa`] (AVX-512, AVX2, scalar);
//! the block's f32 moments pass between them through 2 KiB on the stack (in L1), not in
//! registers, because the new absmax must be known before the first code is written. On
//! AVX-512 the whole-block part of the step is one fused kernel (`simd::adam_int8`: decode,
//! update and absmax of block `b` in the loop that encodes block `b − 1`) with f32 codecs that
//! are proven (and tested) to choose the same codes as the exact f64 ones.
//!
//! **Maps.**
//! - `m` (signed): the linear map `j / 127`, `j ∈ −127..=127` ([`quantize_linear`]): `m` is
//!   symmetric around 0, and its error enters the update linearly, so a uniform grid is the best
//!   for its worst case: `|m − m̃| ≤ absmax / 254` (and half an f32 ulp of `m̃`).
//! - `v` (non-negative): the paper's unsigned dynamic tree map ([`dynamic_map`],
//!   [`quantize_dynamic`]). A linear map would store every `v < absmax / 510` as 0, and with a
//!   block holding gradients of 1e-6 and of 10 (torch's reference vectors) that is most of the
//!   block: a zero `v` with a non-zero `m` next step divides by `eps` alone. The tree map spans
//!   eight decades (its smallest non-zero value is 5.5e-8 of the absmax) at a relative error of
//!   at most 0.35 % at the top and `4.5·2^(E−7)` at the bottom of decade `E` below it (3.5 %,
//!   7 %, 14 %, …), where the paper found linear quantization of the second state unstable.
//!
//! Measured on torch's reference vectors (`shared/fixtures/adamw`, gradient magnitudes drawn per
//! element and step over seven decades, so most blocks mix 1e-6 and 10), against the f32
//! kernel after 4–6 steps: bf16 moves `p` by at most 0.02·lr; these int8 maps by at most
//! 10.5·lr (a quarter of the elements by more than 1·lr), and that error comes from `m`'s map
//! (quantizing `m` alone: 9.2·lr). The paper's signed tree map (bitsandbytes' layout) for `m`
//! with this `v` map instead moved `p` by up to 2.4·10^6·lr (and the tree map for `v` with an
//! exact `m` by up to 2.8·10^6·lr): where `v`'s code rounds to 0 the tree map keeps a small `m`
//! that the linear map rounds to 0 too, and `m/(√v + ε)` with `v ≈ 0` is `m/ε`.
//!
//! **Block size** [`QUANT_BLOCK`] = 256: the block of bitsandbytes' current 8-bit optimizer
//! kernels (`BLOCKSIZE_2STATE`; the paper and earlier versions used 2048); a smaller block
//! confines an outlier's large absmax to fewer neighbours, at 4 B / 256 = 1.6 % overhead per
//! moment. 256 is a multiple of every vector width (16 lanes) and
//! divides [`crate::NORM_BLOCK`], so blocks never straddle a thread cut or a lane group.
//!
//! **Non-finite values** are not representable: a block with NaN or ±inf decodes to unspecified
//! finite or non-finite values (nothing panics). The pipeline does not step on non-finite
//! gradients ([`crate::NonFinite`]).

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::kernel::{check_isa, step_one, AdamKernel, CopyOut, GradSlice, StateIo, StepScalars, StepState};
use crate::simd::{self, Isa};

/// Values per quantization block (one f32 absmax each); see the module docs for why 256.
pub const QUANT_BLOCK: usize = 256;

/// The element type of Adam's moments `m` and `v` (`optimizer.state_dtype` in a later config).
///
/// Bytes per parameter for `m` and `v` together: `F32` 8, `Bf16` 4, `Int8` 2 + 8/[`QUANT_BLOCK`]
/// (= 2.03125). Master weights are f32 (4 B/param) in every case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateDType {
    /// f32 moments, as torch (exact).
    #[default]
    F32,
    /// bf16 moments, rounded to nearest even from the f32 update: relative error ≤ 2^−8 (8
    /// significant bits) per stored value (normal range).
    Bf16,
    /// Block-wise int8 (Dettmers et al., ICLR 2022): `m` on the linear map, `v` on the dynamic
    /// tree map, one f32 absmax per [`QUANT_BLOCK`] values of each. Not exact: where a block
    /// mixes gradients of very different magnitudes its small elements take updates several
    /// learning rates away from f32's within a few steps (see the module docs).
    Int8,
}

impl StateDType {
    /// Bytes of `m` and `v` together for `n` parameters (the int8 absmax included; a ragged last
    /// block has a whole absmax).
    pub fn moment_bytes(self, n: usize) -> usize {
        match self {
            StateDType::F32 => 8 * n,
            StateDType::Bf16 => 4 * n,
            StateDType::Int8 => 2 * n + 2 * 4 * n.div_ceil(QUANT_BLOCK),
        }
    }

    /// Bytes of a unit's optimizer state of `n` parameters: f32 master weights (4 B each) and
    /// the moments ([`Self::moment_bytes`]): 12, 8 or 6.03 B per parameter.
    pub fn state_bytes(self, n: usize) -> usize {
        4 * n + self.moment_bytes(n)
    }

    /// Lowercase name (`f32`, `bf16`, `int8`), as in the config.
    pub fn name(self) -> &'static str {
        match self {
            StateDType::F32 => "f32",
            StateDType::Bf16 => "bf16",
            StateDType::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for StateDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The moments of `n` parameters that [`adam_step_moments`] reads and writes in place.
#[derive(Debug)]
pub enum Moments<'a> {
    /// f32 `m` and `v`, `n` each.
    F32 {
        /// First moment (torch's `exp_avg`).
        m: &'a mut [f32],
        /// Second moment (torch's `exp_avg_sq`).
        v: &'a mut [f32],
    },
    /// bf16 `m` and `v`, `n` each (round to nearest even, [`bf16_rne`]).
    Bf16 {
        /// First moment.
        m: &'a mut [bf16],
        /// Second moment.
        v: &'a mut [bf16],
    },
    /// Block-wise int8: block `b` holds elements `b·QUANT_BLOCK ..` (the last may be shorter).
    /// Zero moments (torch's initial state) are all codes 0 with any absmax (0 is what the
    /// encoders write).
    Int8 {
        /// Codes of `m` on the linear map ([`quantize_linear`]), `n`.
        m: &'a mut [i8],
        /// Per-block absmax of `m`, `n.div_ceil(QUANT_BLOCK)`.
        m_absmax: &'a mut [f32],
        /// Codes of `v` on the dynamic tree map ([`quantize_dynamic`]), `n`.
        v: &'a mut [u8],
        /// Per-block absmax of `v`, `n.div_ceil(QUANT_BLOCK)`.
        v_absmax: &'a mut [f32],
    },
}

impl Moments<'_> {
    /// The moments' element type.
    pub fn dtype(&self) -> StateDType {
        match self {
            Moments::F32 { .. } => StateDType::F32,
            Moments::Bf16 { .. } => StateDType::Bf16,
            Moments::Int8 { .. } => StateDType::Int8,
        }
    }

    /// Cuts at `mid`, a multiple of [`QUANT_BLOCK`].
    pub(crate) fn split_at(self, mid: usize) -> (Self, Self) {
        debug_assert_eq!(mid % QUANT_BLOCK, 0);
        match self {
            Moments::F32 { m, v } => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(mid), v.split_at_mut(mid));
                (Moments::F32 { m: m0, v: v0 }, Moments::F32 { m: m1, v: v1 })
            }
            Moments::Bf16 { m, v } => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(mid), v.split_at_mut(mid));
                (Moments::Bf16 { m: m0, v: v0 }, Moments::Bf16 { m: m1, v: v1 })
            }
            Moments::Int8 { m, m_absmax, v, v_absmax } => {
                let ((m0, m1), (v0, v1)) = (m.split_at_mut(mid), v.split_at_mut(mid));
                let b = mid / QUANT_BLOCK;
                let ((ma0, ma1), (va0, va1)) = (m_absmax.split_at_mut(b), v_absmax.split_at_mut(b));
                (
                    Moments::Int8 { m: m0, m_absmax: ma0, v: v0, v_absmax: va0 },
                    Moments::Int8 { m: m1, m_absmax: ma1, v: v1, v_absmax: va1 },
                )
            }
        }
    }

    pub(crate) fn check(&self, n: usize) -> Result<()> {
        let blocks = n.div_ceil(QUANT_BLOCK);
        let lens: [(&str, usize, usize); 4] = match self {
            Moments::F32 { m, v } => [("m", m.len(), n), ("v", v.len(), n), ("m", n, n), ("v", n, n)],
            Moments::Bf16 { m, v } => [("m", m.len(), n), ("v", v.len(), n), ("m", n, n), ("v", n, n)],
            Moments::Int8 { m, m_absmax, v, v_absmax } => [
                ("m codes", m.len(), n),
                ("m absmax (one per 256-value block)", m_absmax.len(), blocks),
                ("v codes", v.len(), n),
                ("v absmax (one per 256-value block)", v_absmax.len(), blocks),
            ],
        };
        for (what, got, expected) in lens {
            if got != expected {
                return Err(Error::LengthMismatch { what: format!("{} moments {what}", self.dtype()), expected, got });
            }
        }
        Ok(())
    }
}

/// Where each array of [`Moments`] of `n` parameters sits in one byte buffer of
/// [`StateDType::moment_bytes`]`(n)` bytes (the NVMe chunk layout after the master weights):
/// f32 `[m | v]`; bf16 `[m | v]`; int8 `[m absmax | v absmax | m codes | v codes]` (the f32
/// absmax first, so every f32 array is 4-byte aligned when the buffer is).
fn byte_ranges(dtype: StateDType, n: usize) -> [std::ops::Range<usize>; 4] {
    match dtype {
        StateDType::F32 => [0..4 * n, 4 * n..8 * n, 0..0, 0..0],
        StateDType::Bf16 => [0..2 * n, 2 * n..4 * n, 0..0, 0..0],
        StateDType::Int8 => {
            let b = 4 * n.div_ceil(QUANT_BLOCK);
            [2 * b..2 * b + n, 2 * b + n..2 * b + 2 * n, 0..b, b..2 * b]
        }
    }
}

impl<'a> Moments<'a> {
    /// Views `bytes` as the moments of `n` parameters in `dtype`, in the layout of
    /// [`MomentBufs::write_bytes`]: f32 `[m | v]`, bf16 `[m | v]`, int8
    /// `[m absmax | v absmax | m codes | v codes]`.
    ///
    /// # Panics
    /// When `bytes` is not [`StateDType::moment_bytes`]`(n)` long or not 4-byte aligned.
    pub fn from_bytes(dtype: StateDType, n: usize, bytes: &'a mut [u8]) -> Moments<'a> {
        assert_eq!(bytes.len(), dtype.moment_bytes(n), "{dtype} moments of {n} parameters");
        let [m, v, ma, va] = byte_ranges(dtype, n);
        match dtype {
            StateDType::F32 | StateDType::Bf16 => {
                let (mb, vb) = bytes.split_at_mut(m.end);
                match dtype {
                    StateDType::F32 => {
                        Moments::F32 { m: bytemuck::cast_slice_mut(mb), v: bytemuck::cast_slice_mut(vb) }
                    }
                    _ => Moments::Bf16 { m: bytemuck::cast_slice_mut(mb), v: bytemuck::cast_slice_mut(vb) },
                }
            }
            StateDType::Int8 => {
                let (abs, codes) = bytes.split_at_mut(va.end);
                let (mab, vab) = abs.split_at_mut(ma.end);
                let (mc, vc) = codes.split_at_mut(m.len());
                debug_assert_eq!(vc.len(), v.len());
                Moments::Int8 {
                    m: bytemuck::cast_slice_mut(mc),
                    m_absmax: bytemuck::cast_slice_mut(mab),
                    v: vc,
                    v_absmax: bytemuck::cast_slice_mut(vab),
                }
            }
        }
    }
}

/// A unit's Adam moments, owned, in their [`StateDType`]: what the pipelined optimizer keeps
/// for host-placed state, and what a checkpoint saves (the codes and absmaxes as they are, so a
/// resume is bitwise: decoding and requantizing int8 `v` is not the identity, the tree map's
/// largest value being 0.99648, not 1).
#[derive(Debug, Clone, PartialEq)]
pub enum MomentBufs {
    /// f32 `m`, `v`.
    F32 {
        /// First moment (torch's `exp_avg`).
        m: Vec<f32>,
        /// Second moment (torch's `exp_avg_sq`).
        v: Vec<f32>,
    },
    /// bf16 `m`, `v`.
    Bf16 {
        /// First moment.
        m: Vec<bf16>,
        /// Second moment.
        v: Vec<bf16>,
    },
    /// Block-wise int8, as [`Moments::Int8`].
    Int8 {
        /// Codes of `m` on the linear map, one per parameter.
        m: Vec<i8>,
        /// Absmax of `m` per [`QUANT_BLOCK`].
        m_absmax: Vec<f32>,
        /// Codes of `v` on the dynamic tree map, one per parameter.
        v: Vec<u8>,
        /// Absmax of `v` per [`QUANT_BLOCK`].
        v_absmax: Vec<f32>,
    },
}

impl MomentBufs {
    /// Zero moments (torch's initial state) of `n` parameters.
    pub fn zeros(dtype: StateDType, n: usize) -> Self {
        let b = n.div_ceil(QUANT_BLOCK);
        match dtype {
            StateDType::F32 => MomentBufs::F32 { m: vec![0.0; n], v: vec![0.0; n] },
            StateDType::Bf16 => MomentBufs::Bf16 { m: vec![bf16::ZERO; n], v: vec![bf16::ZERO; n] },
            StateDType::Int8 => {
                MomentBufs::Int8 { m: vec![0; n], m_absmax: vec![0.0; b], v: vec![0; n], v_absmax: vec![0.0; b] }
            }
        }
    }

    /// Makes these moments zero moments of `dtype` and `n` parameters, as [`MomentBufs::zeros`],
    /// within the vectors' capacity when the dtype is theirs and it suffices (a buffer reused unit
    /// after unit allocates once).
    pub fn reset(&mut self, dtype: StateDType, n: usize) {
        fn zeroed<T: Copy>(v: &mut Vec<T>, n: usize, zero: T) {
            v.clear();
            v.resize(n, zero);
        }
        let b = n.div_ceil(QUANT_BLOCK);
        match (self, dtype) {
            (MomentBufs::F32 { m, v }, StateDType::F32) => {
                zeroed(m, n, 0.0);
                zeroed(v, n, 0.0);
            }
            (MomentBufs::Bf16 { m, v }, StateDType::Bf16) => {
                zeroed(m, n, bf16::ZERO);
                zeroed(v, n, bf16::ZERO);
            }
            (MomentBufs::Int8 { m, m_absmax, v, v_absmax }, StateDType::Int8) => {
                zeroed(m, n, 0);
                zeroed(m_absmax, b, 0.0);
                zeroed(v, n, 0);
                zeroed(v_absmax, b, 0.0);
            }
            (this, _) => *this = MomentBufs::zeros(dtype, n),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> StateDType {
        match self {
            MomentBufs::F32 { .. } => StateDType::F32,
            MomentBufs::Bf16 { .. } => StateDType::Bf16,
            MomentBufs::Int8 { .. } => StateDType::Int8,
        }
    }

    /// Parameters.
    pub fn len(&self) -> usize {
        match self {
            MomentBufs::F32 { m, .. } => m.len(),
            MomentBufs::Bf16 { m, .. } => m.len(),
            MomentBufs::Int8 { m, .. } => m.len(),
        }
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The moments as the kernel reads and writes them.
    pub fn view(&mut self) -> Moments<'_> {
        match self {
            MomentBufs::F32 { m, v } => Moments::F32 { m, v },
            MomentBufs::Bf16 { m, v } => Moments::Bf16 { m, v },
            MomentBufs::Int8 { m, m_absmax, v, v_absmax } => Moments::Int8 { m, m_absmax, v, v_absmax },
        }
    }

    /// The moments in f32 (`m`, `v`): bf16 widened, int8 dequantized (each code times its
    /// block's absmax, as the step reads them).
    pub fn to_f32(&self) -> (Vec<f32>, Vec<f32>) {
        let isa = Isa::Scalar;
        let n = self.len();
        let (mut mf, mut vf) = (vec![0.0f32; n], vec![0.0f32; n]);
        match self {
            MomentBufs::F32 { m, v } => return (m.clone(), v.clone()),
            MomentBufs::Bf16 { m, v } => {
                simd::bf16_decode(isa, m, &mut mf);
                simd::bf16_decode(isa, v, &mut vf);
            }
            MomentBufs::Int8 { m, m_absmax, v, v_absmax } => {
                let blocks = mf.chunks_mut(QUANT_BLOCK).zip(vf.chunks_mut(QUANT_BLOCK));
                for (k, (mo, vo)) in blocks.enumerate() {
                    let r = k * QUANT_BLOCK..k * QUANT_BLOCK + mo.len();
                    simd::linear_decode(isa, &m[r.clone()], m_absmax[k], mo);
                    simd::dynamic_decode(isa, &v[r], v_absmax[k], vo);
                }
            }
        }
        (mf, vf)
    }

    /// Moments of `dtype` from f32 `m` and `v` (one length): bf16 rounded to nearest even, int8
    /// quantized block by block with each block's absmax (as the step stores them).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `v` is not as long as `m`.
    pub fn from_f32(dtype: StateDType, m: &[f32], v: &[f32]) -> Result<Self> {
        if v.len() != m.len() {
            return Err(Error::LengthMismatch {
                what: "moments v (the length of m)".into(),
                expected: m.len(),
                got: v.len(),
            });
        }
        let isa = Isa::Scalar;
        let mut out = MomentBufs::zeros(dtype, m.len());
        match &mut out {
            MomentBufs::F32 { m: mo, v: vo } => {
                mo.copy_from_slice(m);
                vo.copy_from_slice(v);
            }
            MomentBufs::Bf16 { m: mo, v: vo } => {
                simd::bf16_encode(isa, m, mo);
                simd::bf16_encode(isa, v, vo);
            }
            MomentBufs::Int8 { m: mc, m_absmax, v: vc, v_absmax } => {
                let blocks = mc.chunks_mut(QUANT_BLOCK).zip(vc.chunks_mut(QUANT_BLOCK));
                for (k, (mo, vo)) in blocks.enumerate() {
                    let r = k * QUANT_BLOCK..k * QUANT_BLOCK + mo.len();
                    m_absmax[k] = encode(isa, &m[r.clone()], mo, simd::linear_encode);
                    v_absmax[k] = encode(isa, &v[r], vo, simd::dynamic_encode);
                }
            }
        }
        Ok(out)
    }

    /// These moments in `dtype`: themselves when they are of it, else through f32 ([`Self::to_f32`],
    /// [`Self::from_f32`]): a conversion that loses what `dtype` cannot hold.
    pub fn converted(self, dtype: StateDType) -> Self {
        if self.dtype() == dtype {
            return self;
        }
        let (m, v) = self.to_f32();
        Self::from_f32(dtype, &m, &v).expect("m and v of one length")
    }

    /// The moments' arrays as bytes, in [`byte_ranges`]' order (`m`, `v`, `m` absmax, `v` absmax;
    /// empty where the dtype has none).
    fn arrays(&self) -> [&[u8]; 4] {
        match self {
            MomentBufs::F32 { m, v } => [bytemuck::cast_slice(m), bytemuck::cast_slice(v), &[], &[]],
            MomentBufs::Bf16 { m, v } => [bytemuck::cast_slice(m), bytemuck::cast_slice(v), &[], &[]],
            MomentBufs::Int8 { m, m_absmax, v, v_absmax } => {
                [bytemuck::cast_slice(m), v, bytemuck::cast_slice(m_absmax), bytemuck::cast_slice(v_absmax)]
            }
        }
    }

    /// [`Self::arrays`], writable.
    fn arrays_mut(&mut self) -> [&mut [u8]; 4] {
        match self {
            MomentBufs::F32 { m, v } => [bytemuck::cast_slice_mut(m), bytemuck::cast_slice_mut(v), &mut [], &mut []],
            MomentBufs::Bf16 { m, v } => [bytemuck::cast_slice_mut(m), bytemuck::cast_slice_mut(v), &mut [], &mut []],
            MomentBufs::Int8 { m, m_absmax, v, v_absmax } => {
                [bytemuck::cast_slice_mut(m), v, bytemuck::cast_slice_mut(m_absmax), bytemuck::cast_slice_mut(v_absmax)]
            }
        }
    }

    /// For parameters `range` (its start a multiple of [`QUANT_BLOCK`]): each array's bytes that
    /// hold them (in [`Self::arrays`]) and where they go in the layout of [`Moments::from_bytes`]
    /// for `range.len()` parameters.
    fn cut(
        &self,
        range: std::ops::Range<usize>,
        layout_len: usize,
    ) -> [(std::ops::Range<usize>, std::ops::Range<usize>); 4] {
        let (n, dtype) = (range.len(), self.dtype());
        assert_eq!(layout_len, dtype.moment_bytes(n), "{dtype} moments of {n} parameters");
        assert_eq!(range.start % QUANT_BLOCK, 0, "moments cut off a block");
        let width = match dtype {
            StateDType::F32 => 4,
            StateDType::Bf16 => 2,
            StateDType::Int8 => 1,
        };
        let b = range.start / QUANT_BLOCK..range.start / QUANT_BLOCK + n.div_ceil(QUANT_BLOCK);
        let (values, absmax) = (width * range.start..width * range.end, 4 * b.start..4 * b.end);
        let [rm, rv, rma, rva] = byte_ranges(dtype, n);
        let absmax = |r: std::ops::Range<usize>| if r.is_empty() { 0..0 } else { absmax.clone() };
        [(values.clone(), rm), (values, rv), (absmax(rma.clone()), rma), (absmax(rva.clone()), rva)]
    }

    /// Writes the moments of parameters `range` (its start a multiple of [`QUANT_BLOCK`]) to
    /// `out` in the layout of [`Moments::from_bytes`] for `range.len()` parameters.
    ///
    /// # Panics
    /// When `range` is out of bounds or does not start on a block, or `out` is not
    /// `moment_bytes(range.len())` long.
    pub fn write_bytes(&self, range: std::ops::Range<usize>, out: &mut [u8]) {
        for (array, (from, to)) in self.arrays().into_iter().zip(self.cut(range, out.len())) {
            out[to].copy_from_slice(&array[from]);
        }
    }

    /// Reads the moments of parameters `range` from `bytes`, the inverse of [`Self::write_bytes`].
    ///
    /// # Panics
    /// As [`Self::write_bytes`].
    pub fn read_bytes(&mut self, range: std::ops::Range<usize>, bytes: &[u8]) {
        let cut = self.cut(range, bytes.len());
        for (array, (to, from)) in self.arrays_mut().into_iter().zip(cut) {
            array[to].copy_from_slice(&bytes[from]);
        }
    }
}

/// bf16 of `x`, rounded to nearest, ties to even (`(bits + 0x7fff + lsb) >> 16`; NaN stays a
/// quiet NaN with its sign and high payload). Bit-identical to `half::bf16::from_f32`.
pub fn bf16_rne(x: f32) -> bf16 {
    let b = x.to_bits();
    if x.is_nan() {
        return bf16::from_bits(((b >> 16) | 0x40) as u16);
    }
    let lsb = (b >> 16) & 1;
    bf16::from_bits((b.wrapping_add(0x7fff + lsb) >> 16) as u16)
}

/// Checks that a block's codes and values have one length.
fn check_block(what: &str, values: usize, codes: usize) -> Result<()> {
    if values == codes {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what: format!("{what} codes (length of the values)"),
            expected: values,
            got: codes,
        })
    }
}

/// The code of `y` on the linear map of absmax `a > 0` (in f64): nearest integer to `127·y/a`,
/// ties to even.
#[inline(always)]
pub(crate) fn linear_code(y: f32, a: f64) -> i8 {
    ((127.0 * y as f64) / a).round_ties_even() as i8
}

/// The value of code `c` on the linear map of absmax `a`: `c·a/127` rounded once to f32.
#[inline(always)]
pub(crate) fn linear_value(c: i8, a: f32) -> f32 {
    ((c as f64 * a as f64) / 127.0) as f32
}

/// A block's absmax `A`, and its codes by `codec` (all 0 when `A` is 0). Lengths checked.
fn encode<C: Copy + Default>(isa: Isa, x: &[f32], codes: &mut [C], codec: fn(Isa, &[f32], f32, &mut [C])) -> f32 {
    let a = simd::absmax(isa, x);
    if a > 0.0 {
        codec(isa, x, a, codes);
    } else {
        codes.fill(C::default());
    }
    a
}

/// Quantizes one block on the linear signed map: returns `A = max |x|` and writes
/// `codes[i] = j`, the integer nearest to `127·x[i]/A` (ties to even; all 0 when `A = 0`), so
/// that [`dequantize_linear`] gives `j·A/127` with `|x − j·A/127| ≤ A/254`.
///
/// The quotient is taken in f64 (`127·x` is exact there), where it is never close enough to a
/// half-integer to round to the wrong side: the code is the nearest one in exact arithmetic.
/// Every `isa` gives the same bits for finite values.
///
/// # Errors
/// [`Error::IsaUnavailable`]; [`Error::LengthMismatch`] when `codes` and `x` differ in length.
pub fn quantize_linear(isa: Isa, x: &[f32], codes: &mut [i8]) -> Result<f32> {
    check_isa(isa)?;
    check_block("linear", x.len(), codes.len())?;
    Ok(encode(isa, x, codes, simd::linear_encode))
}

/// Dequantizes one block of the linear map: `out[i] = j·A/127` for `j = codes[i]`, rounded once
/// to f32 (taken in f64, where `j·A` is exact; the second rounding to f32 is harmless).
///
/// # Errors
/// [`Error::IsaUnavailable`]; [`Error::LengthMismatch`] when `codes` and `out` differ in length.
pub fn dequantize_linear(isa: Isa, codes: &[i8], absmax: f32, out: &mut [f32]) -> Result<()> {
    check_isa(isa)?;
    check_block("linear", out.len(), codes.len())?;
    simd::linear_decode(isa, codes, absmax, out);
    Ok(())
}

/// The dynamic tree map's 256 values, ascending (code `c` decodes to `dynamic_map()[c]`).
///
/// The paper's unsigned map (the sign bit is an extra fraction bit, `v` being non-negative):
/// in code `c`, the number `E` of leading zero bits is the decade, the first one bit is the
/// indicator, and the `7 − E` bits after it are a fraction index `k` on a linear grid of
/// `[0.1, 1]` cut into `2^(7−E)` equal intervals, taken at the interval's middle (as
/// bitsandbytes' `create_dynamic_map`): `value = 10^(−E) · (0.1 + 0.9·(k + ½)/2^(7−E))`, the
/// exact rational rounded once to f32. Code 0 is 0. The largest value is 0.99648 (code 255),
/// the smallest non-zero 5.5e-8 (code 1). bitsandbytes instead drops the code of decade 7 and
/// adds 1.0; the tree keeps the paper's layout, where the code is the value's rank.
pub fn dynamic_map() -> &'static [f32; 256] {
    &tables().0
}

/// The map and the 255 decision thresholds between consecutive values, in f64 (the exact
/// midpoint of two f32 is an f64).
fn tables() -> &'static ([f32; 256], [f64; 255]) {
    static T: std::sync::OnceLock<([f32; 256], [f64; 255])> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut map = [0.0f32; 256];
        for (c, slot) in map.iter_mut().enumerate().skip(1) {
            let e = (c as u32).leading_zeros() - 24; // leading zeros of the 8-bit code
            let bits = 7 - e;
            let k = c as u64 - (1u64 << bits); // the fraction index after the indicator bit
            let n = 1u64 << bits;
            // 10^-e · (0.1 + 0.9 (2k+1) / 2n) = (2n + 9(2k+1)) / (20 n 10^e), both exact integers.
            let num = 2 * n + 9 * (2 * k + 1);
            let den = 20 * n * 10u64.pow(e);
            *slot = (num as f64 / den as f64) as f32;
        }
        let mut mid = [0.0f64; 255];
        for (k, t) in mid.iter_mut().enumerate() {
            *t = (map[k] as f64 + map[k + 1] as f64) / 2.0;
        }
        (map, mid)
    })
}

/// The code of `y` on the tree map of absmax `a > 0` (in f64): how many thresholds `t` (the
/// midpoints of consecutive map values) have `y > t·a`.
#[inline(always)]
pub(crate) fn dynamic_code(y: f32, a: f64) -> u8 {
    let y = y as f64;
    thresholds().partition_point(|&t| y > t * a) as u8
}

/// The 255 decision thresholds of the tree map (exact midpoints, in f64).
pub(crate) fn thresholds() -> &'static [f64; 255] {
    &tables().1
}

/// Per-block constants of the vector tree-map encoder's first guess, for absmax `a`. The guess
/// is checked against the exact thresholds before it is used, so these need no exactness.
///
/// A value's level `l` (0..=8) is how many of the 8 thresholds at decade ends
/// (`thresholds()[2^j − 1]·a`, `j = 0..8`) it exceeds: `l = 0` is code 0, else its code is in
/// decade `E = 8 − l`, codes `2^f ..= 2^(f+1) − 1` with `f = l − 1`, and the guess is
/// `2^f + clamp(⌊y·scale[l] − offset[l]⌋, 0, 2^f − 1)`: the interval of `[0.1, 1]`'s `2^f`
/// that holds `y/(a·10^−E)`.
pub(crate) struct TreeGuess {
    /// The decade-end thresholds times `a` (exact in f64), ascending.
    pub(crate) levels: [f64; 8],
    /// `10^E·2^f/(0.9·a)` per level (16 slots, 9 used).
    pub(crate) scale: [f64; 16],
    /// `0.1·2^f/0.9` per level.
    pub(crate) offset: [f64; 16],
    /// `2^f` per level (0 for level 0).
    pub(crate) base: [f64; 16],
}

impl TreeGuess {
    pub(crate) fn new(a: f32) -> Self {
        let (mid, a) = (thresholds(), a as f64);
        let mut g = TreeGuess { levels: [0.0; 8], scale: [0.0; 16], offset: [0.0; 16], base: [0.0; 16] };
        for (j, t) in g.levels.iter_mut().enumerate() {
            *t = mid[(1 << j) - 1] * a;
        }
        for l in 1..=8 {
            let (f, e) = (l as i32 - 1, 8 - l as i32);
            let two_f = 2f64.powi(f);
            g.scale[l] = 10f64.powi(e) * two_f / (0.9 * a);
            g.offset[l] = 0.1 * two_f / 0.9;
            g.base[l] = two_f;
        }
        g
    }
}

/// Whether the AVX-512 codecs' f32 fast paths ([`TreeLines`], the linear map's f32 quotient and
/// split reciprocal) apply to a block of absmax `a`: `2^−90 ≤ a ≤ 2^90`, where `1/a`, `127/a`,
/// `a/127` and the low half of `a/127` are normal f32, so each of them is within 2^−24 of its
/// exact value. Other blocks (and NaN) take the f64 paths, which are exact for any `a`.
#[inline(always)]
pub(crate) fn fast_codec_range(a: f32) -> bool {
    (FAST_MIN..=FAST_MAX).contains(&a)
}

/// 2^−90, the smallest absmax of [`fast_codec_range`].
const FAST_MIN: f32 = 1.0 / (1u128 << 90) as f32;
/// 2^90, the largest absmax of [`fast_codec_range`].
const FAST_MAX: f32 = (1u128 << 90) as f32;

/// The tree map's 255 decision thresholds ([`thresholds`]) followed by +∞: the table the AVX-512
/// encoder gathers from, so that a first guess of 255 reads a threshold no value exceeds.
pub(crate) fn thresholds_padded() -> &'static [f64; 256] {
    static T: std::sync::OnceLock<[f64; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = [f64::INFINITY; 256];
        t[..255].copy_from_slice(thresholds());
        t
    })
}

/// The AVX-512 tree-map encoder's first guess, independent of the absmax: per binary octave of
/// `u ≈ y/A` the two lines of a continuous, concave, piecewise-linear position `X(u)` whose
/// value at every decision threshold `k` (0..=254, [`thresholds`]) lies within 5·10^−5 of
/// `k + 1`, or of `k + 1.2` where `k + 1` is a power of two (with the table's f32 rounding;
/// checked by the tests; 3·10^−6 in exact arithmetic).
///
/// `X` on decade `E` of the map (`10^−(E+1) ≤ u < 10^−E`, codes `2^f ..= 2^(f+1) − 1`,
/// `f = 7 − E`, `E < 7`) is the map's own linear grid, `X_E(u) = 2^f + (10^E·u − 0.1)·2^f/0.9`,
/// so the code `c` value sits at `X = c + ½` and the threshold between two codes of one decade at
/// an integer; the threshold at a decade boundary sits at `+0.2`, because the decade below has 10×
/// the resolution. Decade 7 (below `10^−7`, down to 0) takes the line through `(10^−7, 2)` that
/// puts threshold 0 at 1.2; decade 0's line continues above 1. The lines meet at every
/// `10^−(E+1)` (both give `2^f`) and their slopes (`S_E = 10^E·2^f/0.9 = 128·5^E/0.9`, then
/// 1.1·10^7) fall as `u` grows, so `X = min_E X_E`: on an octave, which meets at most two
/// decades, `X` is the smaller of those two lines — no decision on the decade is needed, and an
/// error in `u` moves `X` by `S_E·Δu` only.
///
/// So threshold `k` sits at `pos_k = k + 1 + 0.2·[k + 1 is a power of two]`. With `u` within a
/// relative 2^−22 of `y/A`, the computed `X − pos_g` is within 1.6·10^−4 of the exact one (the
/// table's 5·10^−5; `u`'s error times `S·u + |O| ≤ 370`, 4.4·10^−5; four f32 roundings below
/// 256, 1.5·10^−5 each). So the guess `g = clamp(⌊X(u) − 0.6⌋, 0, 255)` satisfies
/// `code ∈ {g, g + 1}`: thresholds `k < g` lie at or below `g + 0.2` (plus the margins) `< X`,
/// thresholds `k > g` at or above `g + 2` (minus the margins) `> X`. Where `|X − pos_g| ≥ 2^−11`
/// the side of `X` decides; else one exact comparison with threshold `g` does (`y > mid[g]·A`
/// in f64, as [`dynamic_code`]).
pub(crate) struct TreeLines {
    /// Slopes of the two lines, indexed by `octave & 31` where `octave` is `u`'s biased f32
    /// exponent clamped to `≥ 96` (`u ∈ [2^(o−127), 2^(o−126))`; below `2^−31` is decade 7).
    pub(crate) slope: [[f32; 32]; 2],
    /// Their offsets, `(8/9)·2^f − 0.6` (the guess's −0.6 included).
    pub(crate) offset: [[f32; 32]; 2],
}

/// The decade `E` (0..=7) of the tree map that holds `u` (`10^−(E+1) ≤ u < 10^−E`), decade 0
/// above 1 and decade 7 below `10^−8`.
fn decade(u: f64) -> usize {
    let mut e = 0;
    while e < 7 && u < 10f64.powi(-(e as i32 + 1)) {
        e += 1;
    }
    e
}

/// The tables of [`TreeLines`], built once.
pub(crate) fn tree_lines() -> &'static TreeLines {
    static T: std::sync::OnceLock<TreeLines> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = TreeLines { slope: [[0.0; 32]; 2], offset: [[0.0; 32]; 2] };
        let line = |e: usize| {
            let two_f = (1u32 << (7 - e)) as f64;
            ((10f64.powi(e as i32) * two_f / 0.9) as f32, (8.0 / 9.0 * two_f - 0.6) as f32)
        };
        // Decade 7 (code 1 alone, and threshold 0 below it) takes the line through decade 6's
        // start `(10^−7, 2)` and `(mid_0, 1.2)`, so that threshold 0 too sits at `+0.2`; its
        // slope (1.10·10^7) is above decade 6's (2.2·10^6): `X` stays concave.
        let slope7 = 0.8 / (1e-7 - thresholds()[0]);
        let line7 = (slope7 as f32, (2.0 - slope7 * 1e-7 - 0.6) as f32);
        for i in 0..32 {
            // Octave: biased exponents 96..=127 → u ∈ [2^(i−31), 2^(i−30)).
            let lo = 2f64.powi(i as i32 - 31);
            let (ea, eb) = (decade(lo), decade(2.0 * lo * (1.0 - 1e-12)));
            for (s, e) in [ea, eb].into_iter().enumerate() {
                (t.slope[s][i], t.offset[s][i]) = if e == 7 { line7 } else { line(e) };
            }
        }
        t
    })
}

/// Quantizes one block of non-negative values on the dynamic tree map: returns
/// `A = max |x|` and writes `codes[i]`, the code of the map value nearest to `x[i]/A` (ties to
/// the lower code; all 0 when `A = 0`; negative values give 0).
///
/// Decided exactly: `x[i] > t·A` is compared in f64 for each threshold `t` (the midpoint of two
/// map values, at most 28 significant bits) by binary search, and `t·A` is exact in f64. The
/// error is at most half the gap between the two map values around `x/A`, times `A`. Every
/// `isa` gives the same bits for finite values.
///
/// # Errors
/// [`Error::IsaUnavailable`]; [`Error::LengthMismatch`] when `codes` and `x` differ in length.
pub fn quantize_dynamic(isa: Isa, x: &[f32], codes: &mut [u8]) -> Result<f32> {
    check_isa(isa)?;
    check_block("dynamic", x.len(), codes.len())?;
    Ok(encode(isa, x, codes, simd::dynamic_encode))
}

/// Dequantizes one block of the dynamic tree map: `out[i] = dynamic_map()[codes[i]] · A`, one
/// f32 multiplication.
///
/// # Errors
/// [`Error::IsaUnavailable`]; [`Error::LengthMismatch`] when `codes` and `out` differ in length.
pub fn dequantize_dynamic(isa: Isa, codes: &[u8], absmax: f32, out: &mut [f32]) -> Result<()> {
    check_isa(isa)?;
    check_block("dynamic", out.len(), codes.len())?;
    simd::dynamic_decode(isa, codes, absmax, out);
    Ok(())
}

/// One Adam/AdamW step over f32 master weights `p` with the moments in `moments`' element type,
/// writing the compute copy to `out`, on the calling thread. The update is [`StepScalars`]'s,
/// evaluated by the f32 kernel's `isa` path on each [`QUANT_BLOCK`] of dequantized moments;
/// the parameter update uses the updated moments before they are rounded or requantized (as
/// bitsandbytes), then `m` and `v` are stored: bf16 by [`bf16_rne`], int8 by
/// [`quantize_linear`] (`m`) and [`quantize_dynamic`] (`v`) with each block's new absmax.
/// With [`Moments::F32`] it is [`crate::adam_step`] exactly.
///
/// Every `isa` gives the same bits for finite values: the element update is the f32 kernel's,
/// bit-identical on every path, and the codecs' vector loops decide exactly as the scalar ones.
///
/// # Errors
/// [`Error::IsaUnavailable`] when the CPU lacks `isa`; [`Error::LengthMismatch`] when `grads`,
/// `out`, a moment buffer (`p.len()` codes or values) or an absmax buffer
/// (`p.len().div_ceil(QUANT_BLOCK)`) has another length.
pub fn adam_step_moments(
    isa: Isa,
    scalars: &StepScalars,
    p: &mut [f32],
    moments: Moments<'_>,
    grads: GradSlice<'_>,
    out: CopyOut<'_>,
) -> Result<()> {
    step_one(isa, scalars, Reduced { p, moments }, grads, out, None)
}

/// [`adam_step_moments`] with the checks done.
fn step_blocks(
    isa: Isa,
    scalars: &StepScalars,
    p: &mut [f32],
    moments: Moments<'_>,
    grads: GradSlice<'_>,
    mut out: CopyOut<'_>,
) {
    // The fused int8 kernel (AVX-512) takes the whole blocks; the rest (a ragged last block, or
    // everything on other paths) goes block by block through f32 buffers.
    let (moments, done) = match moments {
        Moments::F32 { m, v } => return simd::adam(isa, scalars, StateIo::InPlace { p, m, v }, grads, out),
        Moments::Int8 { m, m_absmax, v, v_absmax } => {
            let done = simd::adam_int8(isa, scalars, p, m, m_absmax, v, v_absmax, grads, &mut out);
            let b = done / QUANT_BLOCK;
            let rest = Moments::Int8 {
                m: &mut m[done..],
                m_absmax: &mut m_absmax[b..],
                v: &mut v[done..],
                v_absmax: &mut v_absmax[b..],
            };
            (rest, done)
        }
        other => (other, 0),
    };
    let block = |start: usize, mf: &mut [f32], vf: &mut [f32]| {
        let r = done + start..done + start + mf.len();
        let state = StateIo::InPlace { p: &mut p[r.clone()], m: mf, v: vf };
        simd::adam(isa, scalars, state, grads.slice(r.clone()), out.slice_mut(r));
    };
    for_each_block(isa, moments, block);
}

/// Calls `f(start, m, v)` for each [`QUANT_BLOCK`] of `moments` in order, with the block's
/// moments in f32 (f32 ones as they are; bf16 and int8 decoded into L1 and encoded again after
/// `f`, int8 with the block's new absmax).
pub(crate) fn for_each_block(isa: Isa, moments: Moments<'_>, mut f: impl FnMut(usize, &mut [f32], &mut [f32])) {
    let (mut mb, mut vb) = ([0.0f32; QUANT_BLOCK], [0.0f32; QUANT_BLOCK]);
    let mut start = 0;
    match moments {
        Moments::F32 { m, v } => {
            for (ms, vs) in m.chunks_mut(QUANT_BLOCK).zip(v.chunks_mut(QUANT_BLOCK)) {
                f(start, ms, vs);
                start += ms.len();
            }
        }
        Moments::Bf16 { m, v } => {
            for (ms, vs) in m.chunks_mut(QUANT_BLOCK).zip(v.chunks_mut(QUANT_BLOCK)) {
                let (mf, vf) = (&mut mb[..ms.len()], &mut vb[..ms.len()]);
                simd::bf16_decode(isa, ms, mf);
                simd::bf16_decode(isa, vs, vf);
                f(start, mf, vf);
                simd::bf16_encode(isa, mf, ms);
                simd::bf16_encode(isa, vf, vs);
                start += ms.len();
            }
        }
        Moments::Int8 { m, m_absmax, v, v_absmax } => {
            let blocks = m.chunks_mut(QUANT_BLOCK).zip(v.chunks_mut(QUANT_BLOCK));
            for ((mc, vc), (ma, va)) in blocks.zip(m_absmax.iter_mut().zip(v_absmax.iter_mut())) {
                let (mf, vf) = (&mut mb[..mc.len()], &mut vb[..mc.len()]);
                simd::linear_decode(isa, mc, *ma, mf);
                simd::dynamic_decode(isa, vc, *va, vf);
                f(start, mf, vf);
                *ma = encode(isa, mf, mc, simd::linear_encode);
                *va = encode(isa, vf, vc, simd::dynamic_encode);
                start += mc.len();
            }
        }
    }
}

/// A thread's range of a reduced-moment step's state: f32 master weights and their moments, cut
/// at multiples of [`crate::NORM_BLOCK`] (whole quantization blocks) by the kernel's threads.
pub(crate) struct Reduced<'a> {
    /// Master weights.
    pub(crate) p: &'a mut [f32],
    /// Their moments.
    pub(crate) moments: Moments<'a>,
}

impl StepState for Reduced<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (m0, m1) = self.moments.split_at(mid);
        (Reduced { p: p0, moments: m0 }, Reduced { p: p1, moments: m1 })
    }

    fn step(self, isa: Isa, s: &StepScalars, grads: GradSlice<'_>, out: CopyOut<'_>) {
        step_blocks(isa, s, self.p, self.moments, grads, out)
    }

    fn check(&self) -> Result<()> {
        self.moments.check(self.p.len())
    }
}

impl AdamKernel {
    /// [`adam_step_moments`] over the kernel's threads (one contiguous range of whole
    /// [`crate::NORM_BLOCK`]s per thread, as [`AdamKernel::step`]); the same bits as on one thread.
    /// Blocks until done; allocates nothing.
    ///
    /// # Errors
    /// As [`adam_step_moments`].
    pub fn step_moments(
        &self,
        scalars: &StepScalars,
        p: &mut [f32],
        moments: Moments<'_>,
        grads: GradSlice<'_>,
        out: CopyOut<'_>,
    ) -> Result<()> {
        self.step_state(scalars, Reduced { p, moments }, grads, out, None).map(|_| ())
    }

    /// [`AdamKernel::step_moments`] that also returns the gradients' sum of squares
    /// ([`crate::grad_sumsq`]'s bits), taken block by block just before each block's update, as
    /// [`AdamKernel::step_with_sumsq`]. `partials` is scratch of `p.len().div_ceil(NORM_BLOCK)`
    /// slots.
    ///
    /// # Errors
    /// As [`adam_step_moments`]; [`Error::LengthMismatch`] for `partials`.
    pub fn step_moments_with_sumsq(
        &self,
        scalars: &StepScalars,
        p: &mut [f32],
        moments: Moments<'_>,
        grads: GradSlice<'_>,
        out: CopyOut<'_>,
        partials: &mut [f64],
    ) -> Result<f64> {
        self.step_state(scalars, Reduced { p, moments }, grads, out, Some(partials))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reset buffer equals fresh zeros of the dtype and length, from any dtype and length
    /// before it (and keeps its capacity when it can).
    #[test]
    fn reset_moments_equal_fresh_zeros() {
        let dtypes = [StateDType::F32, StateDType::Bf16, StateDType::Int8];
        for from in dtypes {
            for to in dtypes {
                for (a, b) in [(5000, 300), (300, 5000), (0, 257)] {
                    let mut m = MomentBufs::zeros(from, a);
                    if let MomentBufs::Int8 { m_absmax, .. } = &mut m {
                        m_absmax.fill(3.0);
                    }
                    m.read_bytes(0..a.min(1), &vec![7u8; from.moment_bytes(a.min(1))]);
                    m.reset(to, b);
                    assert_eq!(m, MomentBufs::zeros(to, b), "{from} {a} -> {to} {b}");
                }
            }
        }
    }

    /// [`TreeLines`]' claim: at every threshold `k` the position `X` (the smaller of the octave's
    /// two lines, evaluated in f64 from the f32 table entries, plus the guess's 0.6) lies in
    /// `[k + 1 − 10^−5, k + 1.2 + 10^−5]`, so `⌊X(u) − 0.6⌋` is the code or one below it for any
    /// `u` within a relative 2^−22 of `y/A`; and the same for the f32 neighbours of the threshold.
    #[test]
    fn tree_lines_put_every_threshold_where_the_guess_needs_it() {
        let t = tree_lines();
        // X at an exact u (f64), from the f32 table entries (their rounding included).
        let x = |u: f64| {
            let o = (((u as f32).to_bits() >> 23).max(96) & 31) as usize;
            let line = |s: usize| t.slope[s][o] as f64 * u + t.offset[s][o] as f64 + 0.6;
            line(0).min(line(1))
        };
        for (k, &m) in thresholds().iter().enumerate() {
            let pos = x(m) - (k + 1) as f64;
            assert!((-5e-5..=0.2 + 5e-5).contains(&pos), "threshold {k} at X = k + 1 + {pos}");
            // Where the vector encoder's certificate expects it: within 5·10^−5 (the table's f32
            // rounding, at most 2^−24 of `S·u + |O|` ≤ 500, is in this, and in the budget of
            // `TREE_SURE`).
            let boundary = if (k + 1).is_power_of_two() { 0.2 } else { 0.0 };
            assert!((pos - boundary).abs() < 5e-5, "threshold {k} at X = k + 1 + {pos}, not + {boundary}");
            // Values a relative 2^−22 around it stay within the guess's margins (0.4 each side).
            for u in [m * (1.0 - 2f64.powi(-22)), m * (1.0 + 2f64.powi(-22))] {
                let pos = x(u) - (k + 1) as f64;
                assert!((-0.01..=0.21).contains(&pos), "threshold {k}: u = {u} at X = k + 1 + {pos}");
            }
        }
        // The vector encoder's range of `X − 0.6` (so its guess is in 0..=255 without a clamp).
        let (lo, hi) = (x(2f64.powi(-31)) - 0.6, x(1.0 + 2f64.powi(-22)) - 0.6);
        assert!(lo > 0.29 && hi < 255.45, "X − 0.6 in [{lo}, {hi}]");
        // Across each octave's ends and the decade powers, the two lines agree with the true
        // (decade-wise) position within 10^−4.
        for i in -31..=0 {
            for f in [1.0, 1.0000001, 1.999999, 1.25, 1.5] {
                let u = 2f64.powi(i) * f;
                let e = decade(u);
                let two_f = (1u32 << (7 - e)) as f64;
                let exact = if e == 7 {
                    2.0 - 0.8 * (1e-7 - u) / (1e-7 - thresholds()[0])
                } else {
                    two_f + (10f64.powi(e as i32) * u - 0.1) * two_f / 0.9
                };
                assert!((x(u) - exact).abs() < 1e-4 * exact.max(1.0), "u = {u}: {} vs {exact}", x(u));
            }
        }
    }

    #[test]
    fn fast_range_edges() {
        assert!(fast_codec_range(2f32.powi(-90)) && fast_codec_range(2f32.powi(90)) && fast_codec_range(1.0));
        assert!(!fast_codec_range(2f32.powi(-91)) && !fast_codec_range(2f32.powi(91)));
        assert!(!fast_codec_range(f32::NAN) && !fast_codec_range(0.0) && !fast_codec_range(f32::INFINITY));
    }
}
