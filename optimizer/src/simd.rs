//! The vectorized loops: the fused Adam/AdamW element update, the gradient sum of squares and
//! the block codecs of the reduced moments ([`crate::quant`]), for AVX-512, AVX2+FMA+F16C and a
//! scalar path, chosen at run time.
//!
//! This is the only module of the crate that holds `unsafe` code (`#![allow(unsafe_code)]`
//! below): raw-pointer loads and stores of `std::arch` intrinsics, and calls into
//! `#[target_feature]` functions after [`Isa::is_available`] said the CPU has the features.
//! Every pointer comes from a slice whose length was checked by the safe wrappers in
//! [`crate::kernel`] before the call; every `unsafe` block says why it is sound.
//!
//! **Bit-identical paths.** The three paths evaluate the same expression in the same order
//! (FMA exactly where the scalar code calls [`f32::mul_add`], IEEE `sqrt` and division, no
//! reassociation), so their results are equal bit for bit; the tests check it. The sum of squares
//! uses a canonical 16-lane order (element `i` of a block goes to lane `i % 16`, lanes reduced
//! pairwise) that every path reproduces, so the global gradient norm does not depend on the ISA
//! or the thread count either.
//!
//! **Conversions.** bf16 is produced by integer round-to-nearest-even (`(x + 0x7fff + lsb) >> 16`,
//! quiet NaN for NaN), bit-identical to `half::bf16::from_f32` on every input. The AVX-512 BF16
//! instruction `vcvtneps2bf16` is deliberately not used: it flushes subnormal inputs to zero
//! (measured on this CPU: `0x0001_8000` gives `0x0000`, `half` gives `0x0002`). f16 uses the
//! hardware conversion (`vcvtps2ph`, round to nearest even), which is IEEE-exact like `half`.
//!
//! **Codecs.** The int8 codecs compute in f64 lanes as the scalar code does (`127·y/A` divided
//! and rounded to nearest even; `c·A/127` divided, then narrowed to f32; the tree map's code is
//! a first guess from the value's decade, kept only where the two thresholds around it confirm it
//! (`t·A < y ≤ t'·A`, exact in f64, by gathers), else a binary search of `y > t·A`), so each
//! path's codes and values equal the scalar ones bit for bit on finite inputs.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::bf16;

use crate::kernel::{CopyOut, GradSlice, StateIo, StepScalars};
use crate::quant;
use serde::{Deserialize, Serialize};

/// An instruction-set path of the kernels.
///
/// [`Isa::detect`] picks the widest available; tests and benches force each of
/// [`Isa::available`] to check that they agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// AVX-512F: 16 lanes of f32.
    Avx512,
    /// AVX2 with FMA and F16C: 8 lanes of f32.
    Avx2,
    /// Plain Rust, one element at a time (any CPU).
    Scalar,
}

impl Isa {
    /// Every path, widest first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Scalar];

    /// The widest path this CPU supports (run-time detection).
    pub fn detect() -> Isa {
        Isa::ALL.into_iter().find(|i| i.is_available()).unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 | Isa::Avx2 => false,
            Isa::Scalar => true,
        }
    }

    /// The paths this CPU supports, widest first (always ends with [`Isa::Scalar`]).
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// Lowercase name (`avx512`, `avx2`, `scalar`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The element update, in the order every path follows. Returns (p, m, v).
#[inline(always)]
fn elem(c: &StepScalars, p: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let mut g = g * c.scale;
    if c.has_l2 {
        g += p * c.l2;
    }
    let p = p * c.decay;
    let m = c.c1.mul_add(g - m, m);
    let v = v * c.b2 + (c.c2 * g) * g;
    let denom = v.sqrt() / c.bc2_sqrt + c.eps;
    (p - (c.step_size * m) / denom, m, v)
}

/// Raw pointers of a [`StateIo`]; `*_in` equal `*_out` for an in-place update.
#[cfg(target_arch = "x86_64")]
struct Ptrs {
    p_in: *const f32,
    m_in: *const f32,
    v_in: *const f32,
    p_out: *mut f32,
    m_out: *mut f32,
    v_out: *mut f32,
}

#[cfg(target_arch = "x86_64")]
impl Ptrs {
    fn new(st: &mut StateIo<'_>) -> Self {
        match st {
            StateIo::InPlace { p, m, v } => Self {
                p_in: p.as_ptr(),
                m_in: m.as_ptr(),
                v_in: v.as_ptr(),
                p_out: p.as_mut_ptr(),
                m_out: m.as_mut_ptr(),
                v_out: v.as_mut_ptr(),
            },
            StateIo::OutOfPlace { src, dst } => Self {
                p_in: src[0].as_ptr(),
                m_in: src[1].as_ptr(),
                v_in: src[2].as_ptr(),
                p_out: dst[0].as_mut_ptr(),
                m_out: dst[1].as_mut_ptr(),
                v_out: dst[2].as_mut_ptr(),
            },
        }
    }
}

/// Updates `n = state.len()` elements on `isa`. The caller checked that every slice has `n`
/// elements (`grads`, `out` unless `None`) and that `isa` is available.
pub(crate) fn adam(isa: Isa, c: &StepScalars, mut state: StateIo<'_>, grads: GradSlice<'_>, mut out: CopyOut<'_>) {
    let n = state.len();
    debug_assert!(isa.is_available());
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            let ptrs = Ptrs::new(&mut state);
            // SAFETY: `Isa::Avx512.is_available()` (checked by the caller, asserted above) means
            // the CPU has AVX-512F; every pointer covers `n` elements (lengths checked by the
            // caller), in and out pointers are either equal or from disjoint slices.
            unsafe { avx512::adam(c, &ptrs, n, grads, &mut out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            let ptrs = Ptrs::new(&mut state);
            // SAFETY: as above, for AVX2 + FMA + F16C.
            unsafe { avx2::adam(c, &ptrs, n, grads, &mut out) }
        }
        _ => 0,
    };
    scalar_tail(c, state, grads, out, done);
}

/// The scalar update of elements `from..n` (the whole range on the scalar path, the remainder
/// after the vector loop otherwise).
fn scalar_tail(c: &StepScalars, state: StateIo<'_>, grads: GradSlice<'_>, mut out: CopyOut<'_>, from: usize) {
    match state {
        StateIo::InPlace { p, m, v } => {
            for i in from..p.len() {
                let (np, nm, nv) = elem(c, p[i], m[i], v[i], grads.get(i));
                (p[i], m[i], v[i]) = (np, nm, nv);
                out.set(i, np);
            }
        }
        StateIo::OutOfPlace { src, dst } => {
            let [dp, dm, dv] = dst;
            for i in from..src[0].len() {
                let (np, nm, nv) = elem(c, src[0][i], src[1][i], src[2][i], grads.get(i));
                (dp[i], dm[i], dv[i]) = (np, nm, nv);
                out.set(i, np);
            }
        }
    }
}

/// Lanes of the canonical sum of squares.
pub(crate) const SUMSQ_LANES: usize = 16;

/// Reduces the 16 lanes pairwise: lane `i` += lane `i + w` for w = 8, 4, 2, 1.
#[inline(always)]
fn reduce_lanes(mut acc: [f64; SUMSQ_LANES]) -> f64 {
    let mut w = SUMSQ_LANES / 2;
    while w > 0 {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Sum of squares of `grads` in f64 in the canonical lane order (element `i` to lane `i % 16`,
/// lanes reduced pairwise). Each square of an f32 is exact in f64, so every path agrees bitwise.
pub(crate) fn sumsq(isa: Isa, grads: GradSlice<'_>) -> f64 {
    let n = grads.len();
    let mut acc = [0.0f64; SUMSQ_LANES];
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (`is_available`, checked by the caller); `grads` holds `n`
        // elements and the loop reads only whole 16-element groups below `n`.
        Isa::Avx512 => unsafe { avx512::sumsq(grads, n, &mut acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 + FMA + F16C.
        Isa::Avx2 => unsafe { avx2::sumsq(grads, n, &mut acc) },
        _ => 0,
    };
    for i in done..n {
        let g = grads.get(i) as f64;
        acc[i % SUMSQ_LANES] += g * g;
    }
    reduce_lanes(acc)
}

/// Runs a block codec's vector loop on `isa`, which returns how many leading elements it did; the
/// scalar path does none.
macro_rules! vector_part {
    ($isa:expr, $f:ident($($arg:expr),*)) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller checked `Isa::Avx512.is_available()` (AVX-512F); the function
            // reads and writes its slices only through bounds-checked sub-slices.
            Isa::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 + FMA + F16C.
            Isa::Avx2 => unsafe { avx2::$f($($arg),*) },
            _ => Default::default(),
        }
    };
}

/// `max |x|` (NaN ignored, 0 for an empty block) on `isa`; max is exact, so every path agrees.
pub(crate) fn absmax(isa: Isa, x: &[f32]) -> f32 {
    let (a, done): (f32, usize) = vector_part!(isa, absmax(x));
    x[done..].iter().fold(a, |a, &y| a.max(y.abs()))
}

/// Codes of `x` on the linear map of absmax `a > 0` ([`quant::linear_code`]).
pub(crate) fn linear_encode(isa: Isa, x: &[f32], a: f32, codes: &mut [i8]) {
    let done: usize = vector_part!(isa, linear_encode(x, a, codes));
    for (c, &y) in codes[done..].iter_mut().zip(&x[done..]) {
        *c = quant::linear_code(y, a as f64);
    }
}

/// Values of linear-map `codes` of absmax `a` ([`quant::linear_value`]).
pub(crate) fn linear_decode(isa: Isa, codes: &[i8], a: f32, out: &mut [f32]) {
    let done: usize = vector_part!(isa, linear_decode(codes, a, out));
    for (o, &c) in out[done..].iter_mut().zip(&codes[done..]) {
        *o = quant::linear_value(c, a);
    }
}

/// Codes of `x` on the tree map of absmax `a > 0` ([`quant::dynamic_code`]).
pub(crate) fn dynamic_encode(isa: Isa, x: &[f32], a: f32, codes: &mut [u8]) {
    let guess = match isa {
        Isa::Scalar => None,
        _ => Some(quant::TreeGuess::new(a)),
    };
    let done: usize = match &guess {
        Some(guess) => vector_part!(isa, dynamic_encode(x, a, guess, quant::thresholds(), codes)),
        None => 0,
    };
    for (c, &y) in codes[done..].iter_mut().zip(&x[done..]) {
        *c = quant::dynamic_code(y, a as f64);
    }
}

/// Values of tree-map `codes` of absmax `a`: `map[c]·a` in f32.
pub(crate) fn dynamic_decode(isa: Isa, codes: &[u8], a: f32, out: &mut [f32]) {
    let map = quant::dynamic_map();
    let done: usize = vector_part!(isa, dynamic_decode(codes, a, map, out));
    for (o, &c) in out[done..].iter_mut().zip(&codes[done..]) {
        *o = map[c as usize] * a;
    }
}

/// bf16 to f32 (exact).
pub(crate) fn bf16_decode(isa: Isa, x: &[bf16], out: &mut [f32]) {
    let done: usize = vector_part!(isa, bf16_decode(x, out));
    for (o, &y) in out[done..].iter_mut().zip(&x[done..]) {
        *o = y.to_f32();
    }
}

/// f32 to bf16, round to nearest even ([`quant::bf16_rne`], the copy's conversion).
pub(crate) fn bf16_encode(isa: Isa, x: &[f32], out: &mut [bf16]) {
    let done: usize = vector_part!(isa, bf16_encode(x, out));
    for (o, &y) in out[done..].iter_mut().zip(&x[done..]) {
        *o = quant::bf16_rne(y);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load_grads(g: &GradSlice<'_>, i: usize) -> __m512 {
        match g {
            GradSlice::F32(g) => {
                let s = &g[i..i + 16];
                // SAFETY: `s` holds 16 f32 (an unaligned load).
                unsafe { _mm512_loadu_ps(s.as_ptr()) }
            }
            GradSlice::BF16(g) => {
                let s = &g[i..i + 16];
                // SAFETY: `s` holds 16 × 2 bytes (an unaligned load).
                let h = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            GradSlice::F16(g) => {
                let s = &g[i..i + 16];
                // SAFETY: `s` holds 16 × 2 bytes (an unaligned load).
                let h = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
                _mm512_cvtph_ps(h)
            }
        }
    }

    /// bf16 round-to-nearest-even of 16 floats, quiet NaN for NaN (as `half`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn to_bf16(p: __m512) -> __m256i {
        let bits = _mm512_castps_si512(p);
        let hi = _mm512_srli_epi32::<16>(bits);
        let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(p, p);
        let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store_copy(out: &mut CopyOut<'_>, i: usize, p: __m512) {
        match out {
            CopyOut::None => {}
            CopyOut::F32(o) => {
                let d = &mut o[i..i + 16];
                // SAFETY: `d` holds 16 f32 (an unaligned store).
                unsafe { _mm512_storeu_ps(d.as_mut_ptr(), p) }
            }
            CopyOut::BF16(o) => {
                let (d, x) = (&mut o[i..i + 16], to_bf16(p));
                // SAFETY: `d` holds 16 × 2 bytes (an unaligned store).
                unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), x) }
            }
            CopyOut::F16(o) => {
                let (d, x) = (&mut o[i..i + 16], _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p));
                // SAFETY: `d` holds 16 × 2 bytes (an unaligned store).
                unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), x) }
            }
        }
    }

    /// Updates whole groups of 16 below `n`; returns how many elements it did.
    ///
    /// # Safety
    /// AVX-512F present; every pointer of `s` valid for `n` elements (in = out or disjoint);
    /// `g` and `out` (unless `None`) hold `n` elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn adam(c: &StepScalars, s: &Ptrs, n: usize, g: GradSlice<'_>, out: &mut CopyOut<'_>) -> usize {
        let scale = _mm512_set1_ps(c.scale);
        let l2 = _mm512_set1_ps(c.l2);
        let decay = _mm512_set1_ps(c.decay);
        let c1 = _mm512_set1_ps(c.c1);
        let b2 = _mm512_set1_ps(c.b2);
        let c2 = _mm512_set1_ps(c.c2);
        let bc2 = _mm512_set1_ps(c.bc2_sqrt);
        let eps = _mm512_set1_ps(c.eps);
        let step = _mm512_set1_ps(c.step_size);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` and every pointer/slice covers `n` elements (contract).
            unsafe {
                let mut gv = _mm512_mul_ps(load_grads(&g, i), scale);
                let p = _mm512_loadu_ps(s.p_in.add(i));
                let m = _mm512_loadu_ps(s.m_in.add(i));
                let v = _mm512_loadu_ps(s.v_in.add(i));
                if c.has_l2 {
                    gv = _mm512_add_ps(gv, _mm512_mul_ps(p, l2));
                }
                let p = _mm512_mul_ps(p, decay);
                let m = _mm512_fmadd_ps(c1, _mm512_sub_ps(gv, m), m);
                let v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(c2, gv), gv));
                let denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
                let p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(step, m), denom));
                _mm512_storeu_ps(s.p_out.add(i), p);
                _mm512_storeu_ps(s.m_out.add(i), m);
                _mm512_storeu_ps(s.v_out.add(i), v);
                store_copy(out, i, p);
            }
            i += 16;
        }
        i
    }

    /// Accumulates whole groups of 16 below `n` into `acc` (lane `i % 16`); returns the count.
    ///
    /// # Safety
    /// AVX-512F present; `g` holds `n` elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sumsq(g: GradSlice<'_>, n: usize, acc: &mut [f64; SUMSQ_LANES]) -> usize {
        let mut lo = _mm512_setzero_pd();
        let mut hi = _mm512_setzero_pd();
        let mut i = 0;
        while i + 16 <= n {
            let x = load_grads(&g, i);
            let a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
            let b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
            lo = _mm512_fmadd_pd(a, a, lo);
            hi = _mm512_fmadd_pd(b, b, hi);
            i += 16;
        }
        let mut lanes = [0.0f64; SUMSQ_LANES];
        let (l, h) = lanes.split_at_mut(8);
        // SAFETY: `l` and `h` hold 8 f64 each.
        unsafe {
            _mm512_storeu_pd(l.as_mut_ptr(), lo);
            _mm512_storeu_pd(h.as_mut_ptr(), hi);
        }
        for (a, b) in acc.iter_mut().zip(lanes) {
            *a += b;
        }
        i
    }
    /// Round to nearest, ties to even, in the f64 lanes.
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// 8 f32 from `x[i..]`, widened to f64 (exact).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load8_pd(x: &[f32], i: usize) -> __m512d {
        let s = &x[i..i + 8];
        // SAFETY: `s` holds 8 f32 (an unaligned load).
        _mm512_cvtps_pd(unsafe { _mm256_loadu_ps(s.as_ptr()) })
    }

    /// Stores the low byte of each of 8 i64 lanes to `d` (8 bytes).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store8_bytes(d: &mut [u8], x: __m512i) {
        let d = &mut d[..8];
        // SAFETY: `d` holds 8 bytes (an unaligned 64-bit store).
        unsafe { _mm_storel_epi64(d.as_mut_ptr().cast(), _mm512_cvtepi64_epi8(x)) }
    }

    /// `max |x|` over whole groups of 16, and their count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn absmax(x: &[f32]) -> (f32, usize) {
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= x.len() {
            let s = &x[i..i + 16];
            // SAFETY: `s` holds 16 f32 (an unaligned load).
            let y = unsafe { _mm512_loadu_ps(s.as_ptr()) };
            // |y| first: `max` returns its second operand when one is NaN, so NaN is ignored.
            acc = _mm512_max_ps(_mm512_abs_ps(y), acc);
            i += 16;
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        (lanes.into_iter().fold(0.0f32, f32::max), i)
    }

    /// Linear-map codes of whole groups of 8 ([`quant::linear_code`]: `127·y/a` in f64, nearest
    /// even), and their count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn linear_encode(x: &[f32], a: f32, codes: &mut [i8]) -> usize {
        let (a, k) = (_mm512_set1_pd(a as f64), _mm512_set1_pd(127.0));
        let codes: &mut [u8] = bytemuck::cast_slice_mut(codes);
        let mut i = 0;
        while i + 8 <= x.len() {
            let q = _mm512_roundscale_pd::<NEAREST>(_mm512_div_pd(_mm512_mul_pd(k, load8_pd(x, i)), a));
            store8_bytes(&mut codes[i..], _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(q)));
            i += 8;
        }
        i
    }

    /// Linear-map values of whole groups of 8 ([`quant::linear_value`]: `c·a/127` in f64, then
    /// f32), and their count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn linear_decode(codes: &[i8], a: f32, out: &mut [f32]) -> usize {
        let (a, k) = (_mm512_set1_pd(a as f64), _mm512_set1_pd(127.0));
        let mut i = 0;
        while i + 8 <= codes.len() {
            let s = &codes[i..i + 8];
            // SAFETY: `s` holds 8 bytes (an unaligned 64-bit load).
            let c = _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(s.as_ptr().cast()) });
            let y = _mm512_cvtpd_ps(_mm512_div_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(c), a), k));
            let d = &mut out[i..i + 8];
            // SAFETY: `d` holds 8 f32 (an unaligned store).
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), y) };
            i += 8;
        }
        i
    }

    /// Tree-map codes of whole groups of 8 ([`quant::dynamic_code`]), and their count: the guess
    /// of [`quant::TreeGuess`], kept when `mid[c − 1]·a < y ≤ mid[c]·a` (the definition of code
    /// `c`, exact in f64) holds in every lane, else a binary search of `y > t·a` over the 255
    /// thresholds.
    #[target_feature(enable = "avx512f")]
    pub(super) fn dynamic_encode(x: &[f32], a: f32, g: &quant::TreeGuess, mid: &[f64; 255], codes: &mut [u8]) -> usize {
        let a = _mm512_set1_pd(a as f64);
        let table = |t: &[f64; 16]| {
            // SAFETY: `t` holds 16 f64 (two unaligned loads of 8).
            unsafe { (_mm512_loadu_pd(t.as_ptr()), _mm512_loadu_pd(t[8..].as_ptr())) }
        };
        let (scale, offset, base) = (table(&g.scale), table(&g.offset), table(&g.base));
        let look = |l: __m512i, (lo, hi): (__m512d, __m512d)| _mm512_permutex2var_pd(lo, l, hi);
        let (one, zero) = (_mm512_set1_epi64(1), _mm512_setzero_pd());
        let mut i = 0;
        while i + 8 <= x.len() {
            let y = load8_pd(x, i);
            let mut l = _mm512_setzero_si512();
            for &t in &g.levels {
                l = _mm512_mask_add_epi64(l, _mm512_cmp_pd_mask::<_CMP_GT_OQ>(y, _mm512_set1_pd(t)), l, one);
            }
            let (b, k) = (look(l, base), _mm512_fmsub_pd(y, look(l, scale), look(l, offset)));
            let k = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(k);
            let k = _mm512_max_pd(_mm512_min_pd(k, _mm512_sub_pd(b, _mm512_set1_pd(1.0))), zero);
            let c = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(_mm512_add_pd(b, k)));
            let lo = _mm512_max_epi64(_mm512_sub_epi64(c, one), _mm512_setzero_si512());
            let hi = _mm512_min_epi64(c, _mm512_set1_epi64(254));
            // SAFETY: `lo` is in 0..=254, inside the 255 thresholds.
            let tlo = unsafe { _mm512_i64gather_pd::<8>(lo, mid.as_ptr()) };
            // SAFETY: `hi` is in 0..=254 too.
            let thi = unsafe { _mm512_i64gather_pd::<8>(hi, mid.as_ptr()) };
            let above_lo = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(y, _mm512_mul_pd(tlo, a))
                | _mm512_cmpeq_epi64_mask(c, _mm512_setzero_si512());
            let below_hi = !_mm512_cmp_pd_mask::<_CMP_GT_OQ>(y, _mm512_mul_pd(thi, a))
                | _mm512_cmpeq_epi64_mask(c, _mm512_set1_epi64(255));
            let c = if above_lo & below_hi == 0xff { c } else { search(y, a, mid) };
            store8_bytes(&mut codes[i..], c);
            i += 8;
        }
        i
    }

    /// The tree-map codes of 8 values by binary search: how many thresholds `t` have `y > t·a`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn search(y: __m512d, a: __m512d, mid: &[f64; 255]) -> __m512i {
        let mut idx = _mm512_setzero_si512();
        for b in [128i64, 64, 32, 16, 8, 4, 2, 1] {
            let cand = _mm512_add_epi64(idx, _mm512_set1_epi64(b));
            // SAFETY: `cand − 1` is at most 254 (the search's largest index is 255), so every
            // lane reads inside the 255 thresholds.
            let t = unsafe { _mm512_i64gather_pd::<8>(_mm512_sub_epi64(cand, _mm512_set1_epi64(1)), mid.as_ptr()) };
            let gt = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(y, _mm512_mul_pd(t, a));
            idx = _mm512_mask_blend_epi64(gt, idx, cand);
        }
        idx
    }

    /// Tree-map values `map[c]·a` of whole groups of 16, and their count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn dynamic_decode(codes: &[u8], a: f32, map: &[f32; 256], out: &mut [f32]) -> usize {
        let a = _mm512_set1_ps(a);
        let mut i = 0;
        while i + 16 <= codes.len() {
            let s = &codes[i..i + 16];
            // SAFETY: `s` holds 16 bytes (an unaligned load).
            let c = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(s.as_ptr().cast()) });
            // SAFETY: every index is a byte, below the map's 256 entries.
            let y = _mm512_mul_ps(unsafe { _mm512_i32gather_ps::<4>(c, map.as_ptr()) }, a);
            let d = &mut out[i..i + 16];
            // SAFETY: `d` holds 16 f32 (an unaligned store).
            unsafe { _mm512_storeu_ps(d.as_mut_ptr(), y) };
            i += 16;
        }
        i
    }

    /// bf16 to f32 of whole groups of 16, and their count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn bf16_decode(x: &[bf16], out: &mut [f32]) -> usize {
        let mut i = 0;
        while i + 16 <= x.len() {
            let (y, d) = (load_grads(&GradSlice::BF16(x), i), &mut out[i..i + 16]);
            // SAFETY: `d` holds 16 f32 (an unaligned store).
            unsafe { _mm512_storeu_ps(d.as_mut_ptr(), y) };
            i += 16;
        }
        i
    }

    /// f32 to bf16 (nearest even) of whole groups of 16, and their count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn bf16_encode(x: &[f32], out: &mut [bf16]) -> usize {
        let mut i = 0;
        while i + 16 <= x.len() {
            let s = &x[i..i + 16];
            // SAFETY: `s` holds 16 f32 (an unaligned load).
            let y = unsafe { _mm512_loadu_ps(s.as_ptr()) };
            store_copy(&mut CopyOut::BF16(out), i, y);
            i += 16;
        }
        i
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load_grads(g: &GradSlice<'_>, i: usize) -> __m256 {
        match g {
            GradSlice::F32(g) => {
                let s = &g[i..i + 8];
                // SAFETY: `s` holds 8 f32 (an unaligned load).
                unsafe { _mm256_loadu_ps(s.as_ptr()) }
            }
            GradSlice::BF16(g) => {
                let s = &g[i..i + 8];
                // SAFETY: `s` holds 8 × 2 bytes (an unaligned load).
                let h = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            GradSlice::F16(g) => {
                let s = &g[i..i + 8];
                // SAFETY: `s` holds 8 × 2 bytes (an unaligned load).
                let h = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
                _mm256_cvtph_ps(h)
            }
        }
    }

    /// bf16 round-to-nearest-even of 8 floats, quiet NaN for NaN (as `half`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn to_bf16(p: __m256) -> __m128i {
        let bits = _mm256_castps_si256(p);
        let hi = _mm256_srli_epi32::<16>(bits);
        let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(p, p));
        let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
        let r = _mm256_blendv_epi8(rounded, quiet, nan);
        // Every lane is below 0x10000, so the unsigned saturating pack is exact; it works per
        // 128-bit half, and qwords 0 and 2 hold the 8 results in order.
        let packed = _mm256_packus_epi32(r, r);
        _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn store_copy(out: &mut CopyOut<'_>, i: usize, p: __m256) {
        match out {
            CopyOut::None => {}
            CopyOut::F32(o) => {
                let d = &mut o[i..i + 8];
                // SAFETY: `d` holds 8 f32 (an unaligned store).
                unsafe { _mm256_storeu_ps(d.as_mut_ptr(), p) }
            }
            CopyOut::BF16(o) => {
                let (d, x) = (&mut o[i..i + 8], to_bf16(p));
                // SAFETY: `d` holds 8 × 2 bytes (an unaligned store).
                unsafe { _mm_storeu_si128(d.as_mut_ptr().cast(), x) }
            }
            CopyOut::F16(o) => {
                let (d, x) = (&mut o[i..i + 8], _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p));
                // SAFETY: `d` holds 8 × 2 bytes (an unaligned store).
                unsafe { _mm_storeu_si128(d.as_mut_ptr().cast(), x) }
            }
        }
    }

    /// Updates whole groups of 8 below `n`; returns how many elements it did.
    ///
    /// # Safety
    /// AVX2, FMA and F16C present; every pointer of `s` valid for `n` elements (in = out or
    /// disjoint); `g` and `out` (unless `None`) hold `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn adam(c: &StepScalars, s: &Ptrs, n: usize, g: GradSlice<'_>, out: &mut CopyOut<'_>) -> usize {
        let scale = _mm256_set1_ps(c.scale);
        let l2 = _mm256_set1_ps(c.l2);
        let decay = _mm256_set1_ps(c.decay);
        let c1 = _mm256_set1_ps(c.c1);
        let b2 = _mm256_set1_ps(c.b2);
        let c2 = _mm256_set1_ps(c.c2);
        let bc2 = _mm256_set1_ps(c.bc2_sqrt);
        let eps = _mm256_set1_ps(c.eps);
        let step = _mm256_set1_ps(c.step_size);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` and every pointer/slice covers `n` elements (contract).
            unsafe {
                let mut gv = _mm256_mul_ps(load_grads(&g, i), scale);
                let p = _mm256_loadu_ps(s.p_in.add(i));
                let m = _mm256_loadu_ps(s.m_in.add(i));
                let v = _mm256_loadu_ps(s.v_in.add(i));
                if c.has_l2 {
                    gv = _mm256_add_ps(gv, _mm256_mul_ps(p, l2));
                }
                let p = _mm256_mul_ps(p, decay);
                let m = _mm256_fmadd_ps(c1, _mm256_sub_ps(gv, m), m);
                let v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(c2, gv), gv));
                let denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
                let p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step, m), denom));
                _mm256_storeu_ps(s.p_out.add(i), p);
                _mm256_storeu_ps(s.m_out.add(i), m);
                _mm256_storeu_ps(s.v_out.add(i), v);
                store_copy(out, i, p);
            }
            i += 8;
        }
        i
    }

    /// Accumulates whole groups of 16 below `n` into `acc` (lane `i % 16`); returns the count.
    ///
    /// # Safety
    /// AVX2, FMA and F16C present; `g` holds `n` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn sumsq(g: GradSlice<'_>, n: usize, acc: &mut [f64; SUMSQ_LANES]) -> usize {
        let mut a = [_mm256_setzero_pd(); 4];
        let mut i = 0;
        while i + 16 <= n {
            let (x, y) = (load_grads(&g, i), load_grads(&g, i + 8));
            let parts = [
                _mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)),
                _mm256_cvtps_pd(_mm256_castps256_ps128(y)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(y)),
            ];
            for (acc, q) in a.iter_mut().zip(parts) {
                *acc = _mm256_fmadd_pd(q, q, *acc);
            }
            i += 16;
        }
        let mut lanes = [0.0f64; SUMSQ_LANES];
        for (k, v) in a.into_iter().enumerate() {
            // SAFETY: `lanes[4k..4k+4]` is in bounds for k < 4.
            unsafe { _mm256_storeu_pd(lanes[4 * k..].as_mut_ptr(), v) };
        }
        for (x, y) in acc.iter_mut().zip(lanes) {
            *x += y;
        }
        i
    }

    /// Round to nearest, ties to even, in the f64 lanes.
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// 4 f32 from `x[i..]`, widened to f64 (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load4_pd(x: &[f32], i: usize) -> __m256d {
        let s = &x[i..i + 4];
        // SAFETY: `s` holds 4 f32 (an unaligned load).
        _mm256_cvtps_pd(unsafe { _mm_loadu_ps(s.as_ptr()) })
    }

    /// Stores the 8 low bytes of `x` to `d`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn store8_bytes(d: &mut [u8], x: __m128i) {
        let d = &mut d[..8];
        // SAFETY: `d` holds 8 bytes (an unaligned 64-bit store).
        unsafe { _mm_storel_epi64(d.as_mut_ptr().cast(), x) }
    }

    /// `max |x|` over whole groups of 8, and their count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn absmax(x: &[f32]) -> (f32, usize) {
        let (mut acc, sign) = (_mm256_setzero_ps(), _mm256_set1_ps(-0.0));
        let mut i = 0;
        while i + 8 <= x.len() {
            let s = &x[i..i + 8];
            // SAFETY: `s` holds 8 f32 (an unaligned load).
            let y = unsafe { _mm256_loadu_ps(s.as_ptr()) };
            // |y| first: `max` returns its second operand when one is NaN, so NaN is ignored.
            acc = _mm256_max_ps(_mm256_andnot_ps(sign, y), acc);
            i += 8;
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        (lanes.into_iter().fold(0.0f32, f32::max), i)
    }

    /// Linear-map codes of whole groups of 8 (as [`quant::linear_code`]), and their count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn linear_encode(x: &[f32], a: f32, codes: &mut [i8]) -> usize {
        let (a, k) = (_mm256_set1_pd(a as f64), _mm256_set1_pd(127.0));
        let codes: &mut [u8] = bytemuck::cast_slice_mut(codes);
        let mut i = 0;
        while i + 8 <= x.len() {
            let q = |h| _mm256_cvtpd_epi32(_mm256_round_pd::<NEAREST>(_mm256_div_pd(_mm256_mul_pd(k, h), a)));
            let (lo, hi) = (q(load4_pd(x, i)), q(load4_pd(x, i + 4)));
            // |code| ≤ 127: the saturating packs are exact.
            let w = _mm_packs_epi32(lo, hi);
            store8_bytes(&mut codes[i..], _mm_packs_epi16(w, w));
            i += 8;
        }
        i
    }

    /// Linear-map values of whole groups of 8 (as [`quant::linear_value`]), and their count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn linear_decode(codes: &[i8], a: f32, out: &mut [f32]) -> usize {
        let (a, k) = (_mm256_set1_pd(a as f64), _mm256_set1_pd(127.0));
        let mut i = 0;
        while i + 8 <= codes.len() {
            let s = &codes[i..i + 8];
            // SAFETY: `s` holds 8 bytes (an unaligned 64-bit load).
            let c = _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(s.as_ptr().cast()) });
            let v = |h| _mm256_cvtpd_ps(_mm256_div_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(h), a), k));
            let y = _mm256_set_m128(v(_mm256_extracti128_si256::<1>(c)), v(_mm256_castsi256_si128(c)));
            let d = &mut out[i..i + 8];
            // SAFETY: `d` holds 8 f32 (an unaligned store).
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), y) };
            i += 8;
        }
        i
    }

    /// f64 lanes holding small non-negative integers, as i64 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn to_i64(v: __m256d) -> __m256i {
        _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(v))
    }

    /// Tree-map codes of whole groups of 4 (as [`quant::dynamic_code`]), and their count: the
    /// guess of [`quant::TreeGuess`], kept when `mid[c − 1]·a < y ≤ mid[c]·a` holds in every lane
    /// (exact in f64), else a binary search over the 255 thresholds.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dynamic_encode(x: &[f32], a: f32, g: &quant::TreeGuess, mid: &[f64; 255], codes: &mut [u8]) -> usize {
        let a = _mm256_set1_pd(a as f64);
        let (one, zero) = (_mm256_set1_pd(1.0), _mm256_setzero_pd());
        let look = |t: &[f64; 16], l: __m256i| {
            // SAFETY: `look` is given levels only, counts of 8 comparisons (0..=8), inside the
            // 16-slot tables.
            unsafe { _mm256_i64gather_pd::<8>(t.as_ptr(), l) }
        };
        let mut i = 0;
        while i + 4 <= x.len() {
            let y = load4_pd(x, i);
            let mut l = zero;
            for &t in &g.levels {
                l = _mm256_add_pd(l, _mm256_and_pd(_mm256_cmp_pd::<_CMP_GT_OQ>(y, _mm256_set1_pd(t)), one));
            }
            let l = to_i64(l);
            let (b, k) = (look(&g.base, l), _mm256_fmsub_pd(y, look(&g.scale, l), look(&g.offset, l)));
            let k = _mm256_max_pd(_mm256_min_pd(_mm256_floor_pd(k), _mm256_sub_pd(b, one)), zero);
            let c = _mm256_add_pd(b, k);
            let lo = to_i64(_mm256_max_pd(_mm256_sub_pd(c, one), zero));
            let hi = to_i64(_mm256_min_pd(c, _mm256_set1_pd(254.0)));
            // SAFETY: `lo` is in 0..=254, inside the 255 thresholds.
            let tlo = unsafe { _mm256_i64gather_pd::<8>(mid.as_ptr(), lo) };
            // SAFETY: `hi` is in 0..=254 too.
            let thi = unsafe { _mm256_i64gather_pd::<8>(mid.as_ptr(), hi) };
            let above_lo = _mm256_or_pd(
                _mm256_cmp_pd::<_CMP_GT_OQ>(y, _mm256_mul_pd(tlo, a)),
                _mm256_cmp_pd::<_CMP_EQ_OQ>(c, zero),
            );
            let below_hi = _mm256_or_pd(
                _mm256_cmp_pd::<_CMP_NGT_UQ>(y, _mm256_mul_pd(thi, a)),
                _mm256_cmp_pd::<_CMP_EQ_OQ>(c, _mm256_set1_pd(255.0)),
            );
            let c = if _mm256_movemask_pd(_mm256_and_pd(above_lo, below_hi)) == 0xf {
                to_i64(c)
            } else {
                search(y, a, mid)
            };
            let mut lanes = [0i64; 4];
            // SAFETY: `lanes` holds 4 i64.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), c) };
            for (d, l) in codes[i..i + 4].iter_mut().zip(lanes) {
                *d = l as u8;
            }
            i += 4;
        }
        i
    }

    /// The tree-map codes of 4 values by binary search: how many thresholds `t` have `y > t·a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn search(y: __m256d, a: __m256d, mid: &[f64; 255]) -> __m256i {
        let mut idx = _mm256_setzero_si256();
        for b in [128i64, 64, 32, 16, 8, 4, 2, 1] {
            let cand = _mm256_add_epi64(idx, _mm256_set1_epi64x(b));
            // SAFETY: `cand − 1` is at most 254, inside the 255 thresholds.
            let t = unsafe { _mm256_i64gather_pd::<8>(mid.as_ptr(), _mm256_sub_epi64(cand, _mm256_set1_epi64x(1))) };
            let gt = _mm256_castpd_si256(_mm256_cmp_pd::<_CMP_GT_OQ>(y, _mm256_mul_pd(t, a)));
            idx = _mm256_blendv_epi8(idx, cand, gt);
        }
        idx
    }

    /// Tree-map values `map[c]·a` of whole groups of 8, and their count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dynamic_decode(codes: &[u8], a: f32, map: &[f32; 256], out: &mut [f32]) -> usize {
        let a = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= codes.len() {
            let s = &codes[i..i + 8];
            // SAFETY: `s` holds 8 bytes (an unaligned 64-bit load).
            let c = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(s.as_ptr().cast()) });
            // SAFETY: every index is a byte, below the map's 256 entries.
            let y = _mm256_mul_ps(unsafe { _mm256_i32gather_ps::<4>(map.as_ptr(), c) }, a);
            let d = &mut out[i..i + 8];
            // SAFETY: `d` holds 8 f32 (an unaligned store).
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), y) };
            i += 8;
        }
        i
    }

    /// bf16 to f32 of whole groups of 8, and their count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn bf16_decode(x: &[bf16], out: &mut [f32]) -> usize {
        let mut i = 0;
        while i + 8 <= x.len() {
            let (y, d) = (load_grads(&GradSlice::BF16(x), i), &mut out[i..i + 8]);
            // SAFETY: `d` holds 8 f32 (an unaligned store).
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), y) };
            i += 8;
        }
        i
    }

    /// f32 to bf16 (nearest even) of whole groups of 8, and their count.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn bf16_encode(x: &[f32], out: &mut [bf16]) -> usize {
        let mut i = 0;
        while i + 8 <= x.len() {
            let s = &x[i..i + 8];
            // SAFETY: `s` holds 8 f32 (an unaligned load).
            let y = unsafe { _mm256_loadu_ps(s.as_ptr()) };
            store_copy(&mut CopyOut::BF16(out), i, y);
            i += 8;
        }
        i
    }
}
