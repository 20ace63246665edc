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
//! **Codecs.** The scalar int8 codecs decide in exact f64 arithmetic (`127·y/A` divided and
//! rounded to nearest even; `c·A/127` divided, then narrowed to f32; the tree map's code counts
//! the thresholds `t` with `y > t·A`). The AVX2 path computes the same in f64 lanes (the tree
//! map's code a first guess from the value's decade, kept where the two thresholds around it
//! confirm it by gathers, else a binary search). The AVX-512 path works in f32 where a block's
//! absmax allows it ([`quant::fast_codec_range`], `2^−90 ≤ A ≤ 2^90`) and proves each result
//! equal to the exact one: `c·A/127` as `fma(c, h, RN(c·l))` with `h + l = A/127` (a number
//! within 2^−45 of the quotient, which is at least 2^−32 from every f32 midpoint); the linear
//! code as `round(y·RN(127/A))` where that product is farther than 2^−14 from a half-integer
//! (else the f64 division); the tree-map code from a continuous piecewise-linear position
//! ([`quant::TreeLines`]) where it is farther than 2^−11 from the threshold it could cross
//! (else one exact f64 comparison with that threshold). The int8 step runs fused on AVX-512
//! ([`adam_int8`]): decode, update and the new absmax of one block in the loop that encodes the
//! block before it. Every path's codes and values equal the scalar ones bit for bit on finite
//! inputs (`optimizer/tests/codecs.rs` checks them at and around every threshold).
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
    let done: usize = match isa {
        Isa::Scalar => 0,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if quant::fast_codec_range(a) => {
            let (lines, mid) = (quant::tree_lines(), quant::thresholds_padded());
            // SAFETY: the caller checked `Isa::Avx512.is_available()` (AVX-512F); the function
            // reads and writes its slices only through bounds-checked sub-slices.
            unsafe { avx512::dynamic_encode_lines(x, a, lines, mid, codes) }
        }
        _ => {
            let guess = quant::TreeGuess::new(a);
            vector_part!(isa, dynamic_encode(x, a, &guess, quant::thresholds(), codes))
        }
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

/// The int8-moment step ([`quant::adam_step_moments`] with [`quant::Moments::Int8`]) of the whole
/// [`quant::QUANT_BLOCK`]s of `p` in one pass per block on `isa` (AVX-512; other paths do none):
/// decode, update and the new absmax fused, then the two encoders. Returns how many elements it
/// did (a multiple of the block); the same bits as the block-by-block path, which does the rest.
/// The caller checked the lengths (`n` values and codes, `n.div_ceil(QUANT_BLOCK)` absmaxes,
/// `grads` and `out` `n` long or `out` none) and that `isa` is available.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adam_int8(
    isa: Isa,
    c: &StepScalars,
    p: &mut [f32],
    mc: &mut [i8],
    ma: &mut [f32],
    vc: &mut [u8],
    va: &mut [f32],
    grads: GradSlice<'_>,
    out: &mut CopyOut<'_>,
) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512.is_available()` (checked by the caller): the CPU has AVX-512F;
        // the function reads and writes its slices only through bounds-checked sub-slices.
        Isa::Avx512 => unsafe { avx512::adam_int8(c, p, mc, ma, vc, va, grads, out) },
        _ => 0,
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
        let k = Consts::new(c);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` and every pointer/slice covers `n` elements (contract).
            unsafe {
                let p = _mm512_loadu_ps(s.p_in.add(i));
                let m = _mm512_loadu_ps(s.m_in.add(i));
                let v = _mm512_loadu_ps(s.v_in.add(i));
                let (p, m, v) = k.update(p, m, v, load_grads(&g, i));
                _mm512_storeu_ps(s.p_out.add(i), p);
                _mm512_storeu_ps(s.m_out.add(i), m);
                _mm512_storeu_ps(s.v_out.add(i), v);
                store_copy(out, i, p);
            }
            i += 16;
        }
        i
    }

    /// [`StepScalars`] in 16 lanes each.
    struct Consts {
        scale: __m512,
        l2: __m512,
        decay: __m512,
        c1: __m512,
        b2: __m512,
        c2: __m512,
        bc2: __m512,
        eps: __m512,
        step: __m512,
        has_l2: bool,
    }

    impl Consts {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(c: &StepScalars) -> Self {
            Consts {
                scale: _mm512_set1_ps(c.scale),
                l2: _mm512_set1_ps(c.l2),
                decay: _mm512_set1_ps(c.decay),
                c1: _mm512_set1_ps(c.c1),
                b2: _mm512_set1_ps(c.b2),
                c2: _mm512_set1_ps(c.c2),
                bc2: _mm512_set1_ps(c.bc2_sqrt),
                eps: _mm512_set1_ps(c.eps),
                step: _mm512_set1_ps(c.step_size),
                has_l2: c.has_l2,
            }
        }

        /// The element update of 16 lanes (`elem`'s expression, in its order): new (p, m, v).
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn update(&self, p: __m512, m: __m512, v: __m512, g: __m512) -> (__m512, __m512, __m512) {
            self.update_l2(self.has_l2, p, m, v, g)
        }

        /// [`Self::update`] with `has_l2` given (a constant where the caller's loop was split on it,
        /// which spares AdamW the two instructions of the L2 term).
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn update_l2(&self, has_l2: bool, p: __m512, m: __m512, v: __m512, g: __m512) -> (__m512, __m512, __m512) {
            let mut gv = _mm512_mul_ps(g, self.scale);
            if has_l2 {
                gv = _mm512_add_ps(gv, _mm512_mul_ps(p, self.l2));
            }
            let p = _mm512_mul_ps(p, self.decay);
            let m = _mm512_fmadd_ps(self.c1, _mm512_sub_ps(gv, m), m);
            let v = _mm512_add_ps(_mm512_mul_ps(v, self.b2), _mm512_mul_ps(_mm512_mul_ps(self.c2, gv), gv));
            let denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), self.bc2), self.eps);
            let p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(self.step, m), denom));
            (p, m, v)
        }
    }

    /// [`super::adam_int8`] on AVX-512, one loop of 16 lanes per block that does two blocks' work:
    ///
    /// - block `b`: decode `m` ([`linear_decode_f32`]'s arithmetic, or the f64 path first for an
    ///   absmax outside [`quant::fast_codec_range`]) and `v` (`map[c]·A`, gathered), update
    ///   ([`Consts::update`], the bits of [`adam`]), store `p` and the copy, keep the new `m`,
    ///   `v` in a 2 KiB buffer pair and their absmax in registers;
    /// - block `b − 1`, whose new absmax is known: encode its buffers with [`LinearEnc`] and
    ///   [`TreeEnc`] into its codes.
    ///
    /// The update is bound by the divider (two divisions and a square root per 16 lanes); the
    /// encoders are other ports' work, so in one loop they overlap. A block whose new absmax is 0
    /// (codes 0, as [`quant`]'s `encode`) or outside the fast range is encoded alone by the
    /// block encoders ([`encode_block`]). The loop prefetches `p`, the gradients and the codes
    /// [`PREFETCH_BLOCKS`] blocks ahead (1 thread, 128 Mi parameters: 1.6 → 1.25 ns/param). The
    /// same bits as the block-by-block path.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) fn adam_int8(
        c: &StepScalars,
        p: &mut [f32],
        mc: &mut [i8],
        ma: &mut [f32],
        vc: &mut [u8],
        va: &mut [f32],
        g: GradSlice<'_>,
        out: &mut CopyOut<'_>,
    ) -> usize {
        // One instance of the loop per kind of gradient, and for no copy: no dispatch per group.
        let g_bytes = match g {
            GradSlice::F32(g) => (g.as_ptr().cast::<u8>(), 4),
            GradSlice::BF16(g) => (g.as_ptr().cast::<u8>(), 2),
            GradSlice::F16(g) => (g.as_ptr().cast::<u8>(), 2),
        };
        let st = Int8State { p, mc: bytemuck::cast_slice_mut(mc), ma, vc, va, g_bytes };
        match g {
            GradSlice::F32(g) => int8_copy(c, st, |k| load_grads(&GradSlice::F32(g), k), out),
            GradSlice::BF16(g) => int8_copy(c, st, |k| load_grads(&GradSlice::BF16(g), k), out),
            GradSlice::F16(g) => int8_copy(c, st, |k| load_grads(&GradSlice::F16(g), k), out),
        }
    }

    /// The state [`adam_int8`] reads and writes: `p`, the codes (`m`'s as bytes) and absmax.
    struct Int8State<'a> {
        p: &'a mut [f32],
        mc: &'a mut [u8],
        ma: &'a mut [f32],
        vc: &'a mut [u8],
        va: &'a mut [f32],
        /// The gradients' first byte and bytes per element (for prefetches only).
        g_bytes: (*const u8, usize),
    }

    /// [`adam_int8`] with the gradients' loader `g` (16 lanes from an element index), split by
    /// whether a copy is written and whether the update has an L2 term.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn int8_copy(c: &StepScalars, st: Int8State<'_>, g: impl Fn(usize) -> __m512, out: &mut CopyOut<'_>) -> usize {
        match (out, c.has_l2) {
            (CopyOut::None, false) => int8_blocks::<false>(c, st, g, |_, _| {}),
            (CopyOut::None, true) => int8_blocks::<true>(c, st, g, |_, _| {}),
            (out, false) => int8_blocks::<false>(c, st, g, |k, p| store_copy(out, k, p)),
            (out, true) => int8_blocks::<true>(c, st, g, |k, p| store_copy(out, k, p)),
        }
    }

    /// The loop of [`adam_int8`], with the gradients' loader `g` and the copy's store `out` (both by
    /// element index); `HAS_L2` is `c.has_l2`.
    #[target_feature(enable = "avx512f")]
    fn int8_blocks<const HAS_L2: bool>(
        c: &StepScalars,
        st: Int8State<'_>,
        g: impl Fn(usize) -> __m512,
        mut out: impl FnMut(usize, __m512),
    ) -> usize {
        const B: usize = quant::QUANT_BLOCK;
        let Int8State { p, mc, ma, vc, va, g_bytes } = st;
        // Addresses for the prefetches only (never dereferenced).
        let (p_at, mc_at, vc_at) = (p.as_ptr(), mc.as_ptr(), vc.as_ptr());
        let k = Consts::new(c);
        let map = quant::dynamic_map();
        let tree = TreeEnc::new(quant::tree_lines(), quant::thresholds_padded());
        // Buffer pairs (m, v) by block parity.
        let mut bufs = [[[0.0f32; B]; 2]; 2];
        let blocks = p.len() / B;
        // The block whose update is done and whose codes are not written yet, with its absmax.
        let mut pending: Option<(usize, f32, f32)> = None;
        for b in 0..=blocks {
            let (even, odd) = bufs.split_at_mut(1);
            let (cur, prev) = if b % 2 == 0 { (&mut even[0], &odd[0]) } else { (&mut odd[0], &even[0]) };
            let (mc_done, mc_cur) = mc.split_at_mut(b * B);
            let (vc_done, vc_cur) = vc.split_at_mut(b * B);
            let mut enc = match pending.take() {
                Some((pb, a_m, a_v)) => {
                    let r = pb * B..(pb + 1) * B;
                    let mcp: &mut [u8; B] = (&mut mc_done[r.clone()]).try_into().expect("a whole block");
                    let vcp: &mut [u8; B] = (&mut vc_done[r]).try_into().expect("a whole block");
                    if quant::fast_codec_range(a_m) && quant::fast_codec_range(a_v) {
                        Some((LinearEnc::new(a_m), tree.absmax(a_v), mcp, vcp))
                    } else {
                        encode_block(prev, a_m, a_v, mcp, vcp);
                        None
                    }
                }
                None => None,
            };
            let mut step = if b < blocks {
                let base = b * B;
                let mcb: &[u8; B] = mc_cur[..B].try_into().expect("a whole block");
                let vcb: &[u8; B] = vc_cur[..B].try_into().expect("a whole block");
                let pb: &mut [f32; B] = (&mut p[base..base + B]).try_into().expect("a whole block");
                let (a_m, a_v) = (ma[b], va[b]);
                let m_fast = quant::fast_codec_range(a_m);
                if !m_fast {
                    let done = linear_decode(bytemuck::cast_slice(mcb), a_m, &mut cur[0]);
                    debug_assert_eq!(done, B);
                }
                let q = a_m as f64 / 127.0;
                let h = q as f32;
                let (h, l) = (_mm512_set1_ps(h), _mm512_set1_ps((q - h as f64) as f32));
                Some((base, m_fast, h, l, _mm512_set1_ps(a_v), mcb, vcb, pb))
            } else {
                None
            };
            let (mut m_max, mut v_max) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for j in 0..B / 16 {
                let i = 16 * j;
                if b + PREFETCH_BLOCKS < blocks {
                    // One line of `p` and of the gradients per group, the codes in the first four
                    // groups, `PREFETCH_BLOCKS` blocks ahead of the update.
                    let e = (b + PREFETCH_BLOCKS) * B + i;
                    // (A prefetch is a hint that never faults; the addresses, in wrapping
                    // arithmetic, lie inside the slices: `e < blocks · B`.)
                    _mm_prefetch::<_MM_HINT_T0>(p_at.wrapping_add(e).cast());
                    _mm_prefetch::<_MM_HINT_T0>(g_bytes.0.wrapping_add(e * g_bytes.1).cast());
                    if j < 4 {
                        let c = (b + PREFETCH_BLOCKS) * B + 64 * j;
                        _mm_prefetch::<_MM_HINT_T0>(mc_at.wrapping_add(c).cast());
                        _mm_prefetch::<_MM_HINT_T0>(vc_at.wrapping_add(c).cast());
                    }
                }
                if let Some((base, m_fast, h, l, a_v, mcb, vcb, pb)) = &mut step {
                    let m = if *m_fast {
                        let s = &mcb[i..i + 16];
                        // SAFETY: `s` holds 16 bytes (an unaligned load).
                        let c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(s.as_ptr().cast()) }));
                        _mm512_fmadd_ps(c, *h, _mm512_mul_ps(c, *l))
                    } else {
                        // SAFETY: `cur[0][i..i + 16]` is in bounds (i + 16 <= B).
                        unsafe { _mm512_loadu_ps(cur[0][i..i + 16].as_ptr()) }
                    };
                    let s = &vcb[i..i + 16];
                    // SAFETY: `s` holds 16 bytes (an unaligned load).
                    let cv = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(s.as_ptr().cast()) });
                    // SAFETY: every index is a byte, below the map's 256 entries.
                    let v = _mm512_mul_ps(unsafe { _mm512_i32gather_ps::<4>(cv, map.as_ptr()) }, *a_v);
                    let ps = &mut pb[i..i + 16];
                    // SAFETY: `ps` holds 16 f32 (an unaligned load).
                    let pv = unsafe { _mm512_loadu_ps(ps.as_ptr()) };
                    let (pn, mn, vn) = k.update_l2(HAS_L2, pv, m, v, g(*base + i));
                    // SAFETY: `ps`, `cur[0][i..i + 16]` and `cur[1][i..i + 16]` hold 16 f32 each.
                    unsafe {
                        _mm512_storeu_ps(ps.as_mut_ptr(), pn);
                        _mm512_storeu_ps(cur[0][i..i + 16].as_mut_ptr(), mn);
                        _mm512_storeu_ps(cur[1][i..i + 16].as_mut_ptr(), vn);
                    }
                    out(*base + i, pn);
                    // |x| first: `max` returns its second operand when one is NaN (ignored, as
                    // `absmax`).
                    m_max = _mm512_max_ps(_mm512_abs_ps(mn), m_max);
                    v_max = _mm512_max_ps(_mm512_abs_ps(vn), v_max);
                }
                if let Some((lin, t, mcp, vcp)) = &mut enc {
                    store16_bytes(&mut mcp[i..i + 16], lin.codes(&prev[0], i));
                    store16_bytes(&mut vcp[i..i + 16], tree.codes(&prev[1], i, *t));
                }
            }
            if b < blocks {
                let (a_m, a_v) = (_mm512_reduce_max_ps(m_max), _mm512_reduce_max_ps(v_max));
                (ma[b], va[b]) = (a_m, a_v);
                pending = Some((b, a_m, a_v));
            }
        }
        blocks * B
    }

    /// How many blocks ahead of the update [`int8_blocks`] prefetches its inputs.
    const PREFETCH_BLOCKS: usize = 2;

    /// Encodes one block's new `m`, `v` (`buf`) with absmax `a_m`, `a_v` by the block encoders:
    /// codes 0 for an absmax of 0, else [`linear_encode`] and the tree-map encoder of `a_v`'s range.
    #[target_feature(enable = "avx512f")]
    fn encode_block(buf: &[[f32; quant::QUANT_BLOCK]; 2], a_m: f32, a_v: f32, mc: &mut [u8], vc: &mut [u8]) {
        const B: usize = quant::QUANT_BLOCK;
        if a_m > 0.0 {
            let done = linear_encode(&buf[0], a_m, bytemuck::cast_slice_mut(mc));
            debug_assert_eq!(done, B);
        } else {
            mc.fill(0);
        }
        if a_v > 0.0 {
            let done = if quant::fast_codec_range(a_v) {
                dynamic_encode_lines(&buf[1], a_v, quant::tree_lines(), quant::thresholds_padded(), vc)
            } else {
                dynamic_encode(&buf[1], a_v, &quant::TreeGuess::new(a_v), quant::thresholds(), vc)
            };
            debug_assert_eq!(done, B);
        } else {
            vc.fill(0);
        }
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

    /// Linear-map codes of whole groups of 8 ([`quant::linear_code`]), and their count. With `a`
    /// in [`quant::fast_codec_range`], groups of 16 by [`linear_encode_f32`]; else (and for what
    /// it leaves) `127·y/a` in f64, nearest even.
    #[target_feature(enable = "avx512f")]
    pub(super) fn linear_encode(x: &[f32], a: f32, codes: &mut [i8]) -> usize {
        let mut i = if quant::fast_codec_range(a) { linear_encode_f32(x, a, codes) } else { 0 };
        let codes: &mut [u8] = bytemuck::cast_slice_mut(codes);
        while i + 8 <= x.len() {
            store8_bytes(&mut codes[i..], _mm512_cvtepi32_epi64(linear_code_f64(x, i, a)));
            i += 8;
        }
        i
    }

    /// [`quant::linear_code`] of `x[i..i + 8]`: `127·y/a` in f64 (`127·y` exact), divided,
    /// rounded to nearest even, as i32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn linear_code_f64(x: &[f32], i: usize, a: f32) -> __m256i {
        let (a, k) = (_mm512_set1_pd(a as f64), _mm512_set1_pd(127.0));
        _mm512_cvtpd_epi32(_mm512_roundscale_pd::<NEAREST>(_mm512_div_pd(_mm512_mul_pd(k, load8_pd(x, i)), a)))
    }

    /// Largest `|q − round(q)|` at which the f32 quotient decides alone: `½ − 2^−14`.
    const LINEAR_SURE: f32 = 0.5 - 1.0 / 16384.0;

    /// Linear-map codes of whole groups of 16 for `a` in [`quant::fast_codec_range`], and their
    /// count; the same codes as [`quant::linear_code`].
    ///
    /// `q = y·r` in f32 with `r = RN(127/a)` is within `127·2^−23 < 2^−15.9` of the exact `127·y/a`
    /// (two roundings of relative 2^−24, `|q| ≤ 127`; a subnormal product adds at most 2^−150).
    /// Where `|q − round(q)| ≤ ½ − 2^−14` in every lane, the exact quotient is more than 2^−16 from
    /// every half-integer, so its nearest integer is `round(q)` — and so is f64's (its quotient
    /// is within 2^−46 of the exact one). Otherwise (about one group in 500 on random data, and
    /// every exact tie) the group is divided in f64 as [`quant::linear_code`].
    #[target_feature(enable = "avx512f")]
    fn linear_encode_f32(x: &[f32], a: f32, codes: &mut [i8]) -> usize {
        let e = LinearEnc::new(a);
        let codes: &mut [u8] = bytemuck::cast_slice_mut(codes);
        let mut i = 0;
        while i + 16 <= x.len() {
            store16_bytes(&mut codes[i..], e.codes(x, i));
            i += 16;
        }
        i
    }

    /// Stores the low byte of each of 16 i32 lanes to `d[..16]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store16_bytes(d: &mut [u8], c: __m512i) {
        let d = &mut d[..16];
        // SAFETY: `d` holds 16 bytes (an unaligned store).
        unsafe { _mm_storeu_si128(d.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(c)) }
    }

    /// The linear-map encoder of one block of absmax `a` in [`quant::fast_codec_range`]
    /// ([`linear_encode_f32`]).
    struct LinearEnc {
        /// `RN(127/a)` in every lane.
        r: __m512,
        /// [`LINEAR_SURE`] in every lane.
        sure: __m512,
        /// The absmax.
        a: f32,
    }

    impl LinearEnc {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(a: f32) -> Self {
            LinearEnc { r: _mm512_set1_ps(127.0 / a), sure: _mm512_set1_ps(LINEAR_SURE), a }
        }

        /// The codes of `x[i..i + 16]` as i32 lanes.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn codes(&self, x: &[f32], i: usize) -> __m512i {
            let s = &x[i..i + 16];
            // SAFETY: `s` holds 16 f32 (an unaligned load).
            let q = _mm512_mul_ps(unsafe { _mm512_loadu_ps(s.as_ptr()) }, self.r);
            let n = _mm512_roundscale_ps::<NEAREST>(q);
            // `q − n` is exact (Sterbenz, or n = 0).
            let near_tie = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(_mm512_sub_ps(q, n)), self.sure);
            if near_tie == 0 {
                _mm512_cvtps_epi32(n)
            } else {
                let (lo, hi) = (linear_code_f64(x, i, self.a), linear_code_f64(x, i + 8, self.a));
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
            }
        }
    }

    /// Linear-map values of whole groups of 8 ([`quant::linear_value`]: `c·a/127` in f64, then
    /// f32), and their count. With `a` in [`quant::fast_codec_range`], groups of 16 by
    /// [`linear_decode_f32`] first.
    #[target_feature(enable = "avx512f")]
    pub(super) fn linear_decode(codes: &[i8], a: f32, out: &mut [f32]) -> usize {
        let mut i = if quant::fast_codec_range(a) { linear_decode_f32(codes, a, out) } else { 0 };
        let (a, k) = (_mm512_set1_pd(a as f64), _mm512_set1_pd(127.0));
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

    /// Linear-map values of whole groups of 16 for `a` in [`quant::fast_codec_range`], and their
    /// count; the same bits as [`quant::linear_value`].
    ///
    /// The value is `RN32(c·a/127)`: with `a = A·2^e` (`A` < 2^24) the exact quotient is never an
    /// f32 midpoint (127 is prime and `|c| < 127` or the quotient is `±a`; a midpoint needs 25
    /// significant bits) and lies at least a relative 2^−32 from every one (both sides are
    /// multiples of the finer of `2^e`, the midpoint spacing), so f64's `RN64(c·a)/127` rounds to
    /// the same f32. Here `a/127 = h + l` (`h = RN32`, `l = RN32` of the f64 remainder, within
    /// 2^−48 of `a/127` together) and `fma(c, h, RN(c·l))` is one rounding of a number within a
    /// relative 2^−45 of `c·a/127`: the same f32.
    #[target_feature(enable = "avx512f")]
    fn linear_decode_f32(codes: &[i8], a: f32, out: &mut [f32]) -> usize {
        let q = a as f64 / 127.0;
        let h = q as f32;
        let l = (q - h as f64) as f32;
        let (h, l) = (_mm512_set1_ps(h), _mm512_set1_ps(l));
        let mut i = 0;
        while i + 16 <= codes.len() {
            let s = &codes[i..i + 16];
            // SAFETY: `s` holds 16 bytes (an unaligned load).
            let c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(s.as_ptr().cast()) }));
            let y = _mm512_fmadd_ps(c, h, _mm512_mul_ps(c, l));
            let d = &mut out[i..i + 16];
            // SAFETY: `d` holds 16 f32 (an unaligned store).
            unsafe { _mm512_storeu_ps(d.as_mut_ptr(), y) };
            i += 16;
        }
        i
    }

    /// Tree-map codes of whole groups of 16 for `a` in [`quant::fast_codec_range`], and their
    /// count; the same codes as [`quant::dynamic_code`].
    ///
    /// `u = max(y·RN(1/a), 2^−31)` (within a relative 2^−22 of `y/a` where that is above
    /// 2^−31), the position `X − 0.6 = min(S_a·u + O_a, S_b·u + O_b)` from `u`'s octave's two
    /// lines ([`quant::TreeLines`], looked up in registers by `vpermt2ps`) and the first guess
    /// `g = ⌊X − 0.6⌋`, which is the code or one below it. Where `X` is at least [`TREE_SURE`]
    /// from threshold `g`'s position (`g + 1`, or `g + 1.2` where `g + 1` is a power of two) in
    /// all 16 lanes, the side decides; else `g + [y > mid[g]·a]` with `mid[g]` gathered and the
    /// comparison in f64 (exact, as [`quant::dynamic_code`]; `mid[255] = +∞`). Negative values
    /// and NaN give `u = 2^−31` and code 0, as the scalar count.
    #[target_feature(enable = "avx512f")]
    pub(super) fn dynamic_encode_lines(
        x: &[f32],
        a: f32,
        t: &quant::TreeLines,
        mid: &[f64; 256],
        codes: &mut [u8],
    ) -> usize {
        let e = TreeEnc::new(t, mid);
        let a = e.absmax(a);
        let mut i = 0;
        while i + 16 <= x.len() {
            store16_bytes(&mut codes[i..], e.codes(x, i, a));
            i += 16;
        }
        i
    }

    /// The tree-map encoder ([`dynamic_encode_lines`]): [`quant::TreeLines`] in registers and
    /// the padded thresholds.
    struct TreeEnc<'a> {
        /// Slopes of line a (entries 0..16, 16..32).
        sa: (__m512, __m512),
        /// Slopes of line b.
        sb: (__m512, __m512),
        /// Offsets of line a.
        oa: (__m512, __m512),
        /// Offsets of line b.
        ob: (__m512, __m512),
        /// The 256 thresholds (the last +∞).
        mid: &'a [f64; 256],
    }

    /// How far (`2^−11`, 4.9·10^−4) `X` must be from the guess's threshold for its side to
    /// decide: 3× the bound on the error of the computed distance (1.6·10^−4, table rounding
    /// included, [`quant::TreeLines`]); about one group of 16 in 60 on random data takes the exact
    /// comparison.
    const TREE_SURE: f32 = 1.0 / 2048.0;

    /// 2^−31, the smallest `u` the tree-map encoder looks up (the start of [`quant::TreeLines`]'
    /// first octave; the first threshold is 2.75·10^−8).
    const MIN_U: f32 = 1.0 / (1u64 << 31) as f32;

    /// A block's absmax for [`TreeEnc::codes`]: `RN(1/a)` (f32 lanes) and `a` (f64 lanes).
    #[derive(Clone, Copy)]
    struct TreeAbsmax {
        ra: __m512,
        a: __m512d,
    }

    impl<'a> TreeEnc<'a> {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new(t: &quant::TreeLines, mid: &'a [f64; 256]) -> Self {
            let table = |t: &[f32; 32]| {
                // SAFETY: `t` holds 32 f32 (two unaligned loads of 16).
                unsafe { (_mm512_loadu_ps(t.as_ptr()), _mm512_loadu_ps(t[16..].as_ptr())) }
            };
            TreeEnc {
                sa: table(&t.slope[0]),
                sb: table(&t.slope[1]),
                oa: table(&t.offset[0]),
                ob: table(&t.offset[1]),
                mid,
            }
        }

        /// The per-block constants of absmax `a` (in [`quant::fast_codec_range`]).
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn absmax(&self, a: f32) -> TreeAbsmax {
            TreeAbsmax { ra: _mm512_set1_ps(1.0 / a), a: _mm512_set1_pd(a as f64) }
        }

        /// The codes of `x[i..i + 16]` as i32 lanes.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn codes(&self, x: &[f32], i: usize, a: TreeAbsmax) -> __m512i {
            let look = |(lo, hi): (__m512, __m512), o: __m512i| _mm512_permutex2var_ps(lo, o, hi);
            let s = &x[i..i + 16];
            // SAFETY: `s` holds 16 f32 (an unaligned load).
            let y = unsafe { _mm512_loadu_ps(s.as_ptr()) };
            // u ≥ 2^−31 (biased exponent ≥ 96, the first octave of the tables, where every code is 0
            // as for u = 0); `max` returns its second operand when one is NaN: NaN takes it too,
            // and so do negative values (code 0, as the scalar count).
            let u = _mm512_max_ps(_mm512_mul_ps(y, a.ra), _mm512_set1_ps(MIN_U));
            let o = _mm512_srli_epi32::<23>(_mm512_castps_si512(u));
            let xa = _mm512_fmadd_ps(u, look(self.sa, o), look(self.oa, o));
            let xb = _mm512_fmadd_ps(u, look(self.sb, o), look(self.ob, o));
            // X − 0.6 (the offsets hold the −0.6): in [0.30, 255.41] for u in [2^−31, 1 + 2^−22],
            // so g is in 0..=255 (the exact path clamps it anyway, for its gather).
            let xs = _mm512_min_ps(xa, xb);
            let g = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(xs);
            let one = _mm512_set1_epi32(1);
            // Threshold g at X = g + 1 (+ 0.2 where g + 1 is a power of two), X − 0.6 = g + 0.4 (+ 0.2).
            let pos = _mm512_add_ps(_mm512_cvtepi32_ps(g), _mm512_set1_ps(0.4));
            let boundary = _mm512_testn_epi32_mask(g, _mm512_add_epi32(g, one));
            let d = _mm512_sub_ps(xs, _mm512_mask_add_ps(pos, boundary, pos, _mm512_set1_ps(0.2)));
            let unsure = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(d), _mm512_set1_ps(TREE_SURE));
            if unsure == 0 {
                return _mm512_mask_add_epi32(g, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, _mm512_setzero_ps()), g, one);
            }
            self.verified(y, g, a)
        }

        /// The codes of `y` whose guess `g` is the code or one below: `g + [y > mid[g]·a]` (f64).
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn verified(&self, y: __m512, g: __m512i, a: TreeAbsmax) -> __m512i {
            let g = _mm512_min_epi32(_mm512_max_epi32(g, _mm512_setzero_si512()), _mm512_set1_epi32(255));
            let (g_lo, g_hi) = (_mm512_castsi512_si256(g), _mm512_extracti64x4_epi64::<1>(g));
            // SAFETY: every index is in 0..=255, inside the 256 thresholds.
            let (t_lo, t_hi) = unsafe {
                (_mm512_i32gather_pd::<8>(g_lo, self.mid.as_ptr()), _mm512_i32gather_pd::<8>(g_hi, self.mid.as_ptr()))
            };
            let y_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
            let y_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(y))));
            let above_lo = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(y_lo, _mm512_mul_pd(t_lo, a.a));
            let above_hi = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(y_hi, _mm512_mul_pd(t_hi, a.a));
            _mm512_mask_add_epi32(g, above_lo as u16 | (above_hi as u16) << 8, g, _mm512_set1_epi32(1))
        }
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
