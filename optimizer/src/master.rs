//! bf16 master weights with stochastic rounding: [`MasterDType`], [`StateFormat`] (the bytes of
//! a unit's optimizer state) and [`adam_step_bf16_master`].
//!
//! A bf16 master weight cannot take an update smaller than half its ulp by rounding to nearest:
//! late in training most updates are that small, and training stalls. Stochastic rounding rounds
//! `x` up with probability equal to its distance from the bf16 below it (in units of the ulp), so
//! the stored weight equals `x` in expectation and small updates accumulate (Gupta et al., "Deep
//! Learning with Limited Numerical Precision", ICML 2015; Zamirai et al., "Revisiting BFloat16
//! Training", 2020; DeepSpeed's bf16 optimizer states and MegaTrain keep bf16 masters this way).
//!
//! **Rounding.** `sr_bf16(x, r)` adds a 16-bit random `r` to the low 16 bits of `x`'s f32 bits
//! and truncates: the magnitude rounds up exactly when `r ≥ 2^16 − low`, with probability
//! `low / 2^16` — the distance to the bf16 below in ulps. The sign is untouched (sign-magnitude),
//! NaN stays NaN (quiet), ±inf stays ±inf; the largest finite values may round to ±inf with
//! their probability.
//!
//! **Random bits.** Counter-based, so any thread cut gives the same bits and a redone update (a
//! clipped step) the same rounding: element `i` of a unit in step `t` takes the top 16 bits of
//! SplitMix64 (Steele, Lea & Flood, OOPSLA 2014) of `key ^ i·φ` where `key` mixes the unit's id
//! and `t` ([`sr_key`]).
//!
//! **The step.** Block by block ([`QUANT_BLOCK`] values, in L1): decode the block's bf16 master
//! weights and its moments to f32, the f32 kernel's element update (the same code on every
//! [`Isa`]), encode the moments as [`crate::quant`] does and the master weights by stochastic
//! rounding; the compute copy is the new master itself (bf16: its bits; f32: widened; f16: from
//! the widened value), so a bf16 compute copy equals the master.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::kernel::{step_one, AdamKernel, CopyOut, GradSlice, StateIo, StepScalars, StepState};
use crate::quant::{for_each_block, Moments, StateDType, QUANT_BLOCK};
use crate::simd::{self, Isa};

/// The element type of the master weights (`optimizer.master_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MasterDType {
    /// f32 master weights (4 B per parameter), as torch.
    #[default]
    F32,
    /// bf16 master weights (2 B per parameter) written by stochastic rounding.
    Bf16,
}

impl MasterDType {
    /// Bytes of `n` master weights, padded to 4 bytes (so that what follows them in a buffer,
    /// the moments, stays 4-byte aligned).
    pub fn master_bytes(self, n: usize) -> usize {
        match self {
            MasterDType::F32 => 4 * n,
            MasterDType::Bf16 => (2 * n).next_multiple_of(4),
        }
    }

    /// The compute copy's element type that holds these master weights bit for bit (f32 or
    /// bf16): with it, NVMe-placed state keeps the master weights in the compute copy
    /// ([`crate::OptimizerConfig::master_in_compute_copy`]).
    pub fn copy_dtype(self) -> oogc_swapper::DType {
        match self {
            MasterDType::F32 => oogc_swapper::DType::F32,
            MasterDType::Bf16 => oogc_swapper::DType::BF16,
        }
    }

    /// Lowercase name (`f32`, `bf16`), as in the config.
    pub fn name(self) -> &'static str {
        match self {
            MasterDType::F32 => "f32",
            MasterDType::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for MasterDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a unit's optimizer state is stored: the master weights' and the moments' element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StateFormat {
    /// Master weights.
    pub master: MasterDType,
    /// Adam's `m` and `v`.
    pub moments: StateDType,
}

impl StateFormat {
    /// f32 master weights with moments of `moments`.
    pub fn with_moments(moments: StateDType) -> Self {
        Self { master: MasterDType::F32, moments }
    }

    /// Bytes of the state of `n` parameters: [`MasterDType::master_bytes`] +
    /// [`StateDType::moment_bytes`] (12 B per parameter in f32; 6.03 with int8 moments; 4.03
    /// with a bf16 master too).
    pub fn bytes(self, n: usize) -> usize {
        self.master.master_bytes(n) + self.moments.moment_bytes(n)
    }

    /// Bytes per parameter over whole blocks of [`QUANT_BLOCK`] (what a planner multiplies).
    pub fn bytes_per_param(self) -> f64 {
        self.bytes(QUANT_BLOCK) as f64 / QUANT_BLOCK as f64
    }
}

impl std::fmt::Display for StateFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} master weights + {} moments", self.master, self.moments)
    }
}

/// The random key of a unit's stochastic rounding in step `t`: SplitMix64 of the two.
pub fn sr_key(unit: u64, t: u64) -> u64 {
    splitmix64(unit.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ splitmix64(t))
}

/// SplitMix64's output function.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 16 random bits of element `index` under `key`.
#[inline(always)]
pub fn sr_bits(key: u64, index: u64) -> u16 {
    (splitmix64(key ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 48) as u16
}

/// `x` rounded to bf16 stochastically with the random bits `r` (see the module docs): up in
/// magnitude with probability (`x`'s low 16 bits) / 2^16.
#[inline(always)]
pub fn sr_bf16(x: f32, r: u16) -> bf16 {
    if x.is_nan() {
        return bf16::from_f32(x);
    }
    let b = x.to_bits();
    if b & 0x7fff_ffff == 0x7f80_0000 {
        return bf16::from_bits((b >> 16) as u16);
    }
    bf16::from_bits((b.wrapping_add(r as u32) >> 16) as u16)
}

/// One Adam/AdamW step over bf16 master weights `p` with `moments` (any [`StateDType`]),
/// writing the compute copy to `out` from the new master, on the calling thread: element `i`
/// rounds with [`sr_bits`]`(key, offset + i)`. See the module docs.
///
/// # Errors
/// As [`crate::adam_step_moments`].
#[allow(clippy::too_many_arguments)]
pub fn adam_step_bf16_master(
    isa: Isa,
    scalars: &StepScalars,
    p: &mut [bf16],
    moments: Moments<'_>,
    grads: GradSlice<'_>,
    out: CopyOut<'_>,
    key: u64,
    offset: u64,
) -> Result<()> {
    step_one(isa, scalars, Bf16Master { p, moments, key, offset }, grads, out, None)
}

/// bf16 master weights and their moments: the state of a bf16-master step, cut at multiples of
/// [`crate::NORM_BLOCK`] by the kernel's threads (`offset` follows the cut).
pub(crate) struct Bf16Master<'a> {
    /// Master weights.
    pub(crate) p: &'a mut [bf16],
    /// Their moments.
    pub(crate) moments: Moments<'a>,
    /// [`sr_key`] of the unit and step.
    pub(crate) key: u64,
    /// Index of `p[0]` in the unit.
    pub(crate) offset: u64,
}

impl StepState for Bf16Master<'_> {
    fn len(&self) -> usize {
        self.p.len()
    }

    fn check(&self) -> Result<()> {
        self.moments.check(self.p.len())
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (m0, m1) = self.moments.split_at(mid);
        let (key, offset) = (self.key, self.offset);
        (
            Bf16Master { p: p0, moments: m0, key, offset },
            Bf16Master { p: p1, moments: m1, key, offset: offset + mid as u64 },
        )
    }

    fn step(self, isa: Isa, s: &StepScalars, grads: GradSlice<'_>, mut out: CopyOut<'_>) {
        let Bf16Master { p, moments, key, offset } = self;
        let mut pb = [0.0f32; QUANT_BLOCK];
        for_each_block(isa, moments, |start, mf, vf| {
            let r = start..start + mf.len();
            let (pm, pf) = (&mut p[r.clone()], &mut pb[..mf.len()]);
            simd::bf16_decode(isa, pm, pf);
            let state = StateIo::InPlace { p: pf, m: mf, v: vf };
            simd::adam(isa, s, state, grads.slice(r.clone()), CopyOut::None);
            for (i, (dst, &x)) in pm.iter_mut().zip(pf.iter()).enumerate() {
                *dst = sr_bf16(x, sr_bits(key, offset + (start + i) as u64));
            }
            match out.slice_mut(r) {
                CopyOut::None => {}
                CopyOut::BF16(o) => o.copy_from_slice(pm),
                CopyOut::F32(o) => simd::bf16_decode(isa, pm, o),
                CopyOut::F16(o) => o.iter_mut().zip(pm.iter()).for_each(|(o, b)| *o = f16::from_f32(b.to_f32())),
            }
        });
    }
}

impl AdamKernel {
    /// [`adam_step_bf16_master`] over the kernel's threads (whole [`crate::NORM_BLOCK`]s per
    /// thread), with the gradients' sum of squares into `partials` when given (as
    /// [`AdamKernel::step_moments_with_sumsq`]); returns it (0 without `partials`). The same bits
    /// as on one thread.
    ///
    /// # Errors
    /// As [`adam_step_bf16_master`]; [`crate::Error::LengthMismatch`] for `partials`.
    #[allow(clippy::too_many_arguments)]
    pub fn step_bf16_master(
        &self,
        scalars: &StepScalars,
        p: &mut [bf16],
        moments: Moments<'_>,
        grads: GradSlice<'_>,
        out: CopyOut<'_>,
        key: u64,
        partials: Option<&mut [f64]>,
    ) -> Result<f64> {
        self.step_state(scalars, Bf16Master { p, moments, key, offset: 0 }, grads, out, partials)
    }
}

/// A unit's master weights, owned, in their [`MasterDType`].
#[derive(Debug, Clone, PartialEq)]
pub enum MasterBuf {
    /// f32.
    F32(Vec<f32>),
    /// bf16.
    Bf16(Vec<bf16>),
}

impl MasterBuf {
    /// `master` in `dtype` (bf16 rounded to nearest even: exact for values that are bf16).
    pub fn from_f32(dtype: MasterDType, master: &[f32]) -> Self {
        match dtype {
            MasterDType::F32 => MasterBuf::F32(master.to_vec()),
            MasterDType::Bf16 => MasterBuf::Bf16(master.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    /// The master weights in f32 (bf16 widened exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = Vec::new();
        self.write_f32(&mut out);
        out
    }

    /// [`MasterBuf::to_f32`] into `out` (replacing what it held, within its capacity when that
    /// suffices: a buffer reused unit after unit allocates once).
    pub fn write_f32(&self, out: &mut Vec<f32>) {
        out.clear();
        match self {
            MasterBuf::F32(p) => out.extend_from_slice(p),
            MasterBuf::Bf16(p) => out.extend(p.iter().map(|b| b.to_f32())),
        }
    }

    /// Parameters.
    pub fn len(&self) -> usize {
        match self {
            MasterBuf::F32(p) => p.len(),
            MasterBuf::Bf16(p) => p.len(),
        }
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> MasterDType {
        match self {
            MasterBuf::F32(_) => MasterDType::F32,
            MasterBuf::Bf16(_) => MasterDType::Bf16,
        }
    }

    /// The bytes of parameters `range`.
    pub fn range_bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        match self {
            MasterBuf::F32(p) => bytemuck::cast_slice(&p[range]),
            MasterBuf::Bf16(p) => bytemuck::cast_slice(&p[range]),
        }
    }

    /// The bytes of parameters `range`, writable.
    pub fn range_bytes_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        match self {
            MasterBuf::F32(p) => bytemuck::cast_slice_mut(&mut p[range]),
            MasterBuf::Bf16(p) => bytemuck::cast_slice_mut(&mut p[range]),
        }
    }

    /// Copies `other`'s values (one dtype and length) into these.
    pub fn copy_from(&mut self, other: &MasterBuf) {
        let n = other.len();
        self.range_bytes_mut(0..n).copy_from_slice(other.range_bytes(0..n));
    }
}
