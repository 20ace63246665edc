//! Adam's moments in bf16 and block-wise int8 (Dettmers et al., "8-bit Optimizers via Block-wise
//! Quantization", ICLR 2022): the codecs against references written here from the paper's
//! description (bit-exact), bf16 against `half`, one step against the f32 kernel followed by the
//! reference codecs (bit-exact, ragged last block, every path), and several steps on torch's
//! AdamW vectors within a bound derived from the quantization error.

mod common;

use half::bf16;
use oogc_optimizer::{
    adam_step, adam_step_moments, bf16_rne, dequantize_dynamic, dequantize_linear, dynamic_map, grad_sumsq,
    quantize_dynamic, quantize_linear, AdamConfig, AdamKernel, AdamKind, CopyOut, Error, GradSlice, Isa, Moments,
    StateDType, StateIo, StepScalars, NORM_BLOCK, QUANT_BLOCK,
};

use common::{bits, load_cases, Lcg};

// ---- references from the paper's description -------------------------------------------------

/// The unsigned dynamic tree map, built from the paper's bit layout: a code with `E` leading
/// zeros is decade `10^-E`; the first one bit is the indicator; the bits after it index `2^f`
/// equal intervals of `[0.1, 1]` (`f = 7 − E`), taken at their middle; the all-zero code is 0.
/// Each value is the exact rational `10^-E · (b_k + b_{k+1}) / 2`, `b_k = 0.1 + 0.9 k / 2^f`,
/// rounded once to f32.
fn reference_map() -> Vec<f32> {
    let mut map = vec![0.0f32; 256];
    for e in 0..8u32 {
        let f = 7 - e;
        for k in 0..(1u64 << f) {
            let code = (1usize << f) | k as usize; // e zeros, the indicator, then f fraction bits
                                                   // b_k = (2^f + 9k) / (10·2^f); the middle of [b_k, b_k+1] over 10^e.
            let (lo, hi) = ((1u64 << f) + 9 * k, (1u64 << f) + 9 * (k + 1));
            let (num, den) = (lo + hi, 2 * 10 * (1u64 << f) * 10u64.pow(e));
            map[code] = (num as f64 / den as f64) as f32;
        }
    }
    map
}

/// Absmax of a block by a plain loop.
fn ref_absmax(x: &[f32]) -> f32 {
    let mut a = 0.0f32;
    for &y in x {
        if y.abs() > a {
            a = y.abs();
        }
    }
    a
}

/// The paper's quantization by exhaustive search: the codebook value (times the absmax) nearest
/// to each value. `dist(x, c)` is an exact (or monotone) distance; the first minimum wins unless
/// `prefer` breaks the tie.
fn nearest<C: Copy>(codes: &[C], dist: impl Fn(C) -> f64, prefer: impl Fn(C, C) -> bool) -> C {
    let mut best = codes[0];
    for &c in &codes[1..] {
        let (d, b) = (dist(c), dist(best));
        if d < b || (d == b && prefer(c, best)) {
            best = c;
        }
    }
    best
}

/// Linear map by exhaustive search over `j·A/127`, ties to the even `j`: `|127x − jA|` is exact in
/// f64 (31-bit products).
fn ref_quantize_linear(x: &[f32]) -> (f32, Vec<i8>) {
    let a = ref_absmax(x);
    let js: Vec<i8> = (-127..=127).collect();
    let codes = x
        .iter()
        .map(|&y| {
            if a == 0.0 {
                return 0;
            }
            nearest(&js, |j| (127.0 * y as f64 - j as f64 * a as f64).abs(), |j, _| j % 2 == 0)
        })
        .collect();
    (a, codes)
}

/// Tree map by exhaustive search over all 256 values, ties to the lower code.
fn ref_quantize_dynamic(x: &[f32], map: &[f32]) -> (f32, Vec<u8>) {
    let a = ref_absmax(x);
    let all: Vec<u8> = (0..=255).collect();
    let codes = x
        .iter()
        .map(|&y| {
            if a == 0.0 {
                return 0;
            }
            nearest(&all, |c| (y as f64 - map[c as usize] as f64 * a as f64).abs(), |_, _| false)
        })
        .collect();
    (a, codes)
}

/// Block values of several shapes: normal, spanning 12 decades, with zeros and exact ties.
fn sample_blocks(rng: &mut Lcg, positive: bool) -> Vec<Vec<f32>> {
    let mut blocks = Vec::new();
    for len in [QUANT_BLOCK, QUANT_BLOCK, 1, 17, 255] {
        blocks.push((0..len).map(|_| rng.normal()).collect::<Vec<f32>>());
        blocks.push(
            (0..len)
                .map(|_| {
                    let x = 10f32.powf(-12.0 * rng.uniform()) * if rng.next().is_multiple_of(2) { 1.0 } else { -1.0 };
                    if rng.next().is_multiple_of(10) {
                        0.0
                    } else {
                        x
                    }
                })
                .collect(),
        );
    }
    blocks.push(vec![0.0; 40]);
    // Exact ties of the linear map: A = 127, x = j + 1/2.
    let mut ties: Vec<f32> = (-127..127).map(|j| j as f32 + 0.5).collect();
    ties.push(127.0);
    blocks.push(ties);
    // Exact ties of the tree map: A = 1, x = the midpoint of two values where it is an f32.
    let map = reference_map();
    let mut mids: Vec<f32> = map
        .windows(2)
        .map(|w| (w[0] as f64 + w[1] as f64) / 2.0)
        .filter(|&m| m as f32 as f64 == m)
        .map(|m| m as f32)
        .collect();
    mids.push(1.0);
    blocks.push(mids);
    if positive {
        for b in &mut blocks {
            b.iter_mut().for_each(|x| *x = x.abs());
        }
    }
    blocks
}

// ---- (a) codecs, bit-exact ---------------------------------------------------------------------

#[test]
fn dynamic_map_is_the_papers_tree() {
    let (ours, reference) = (dynamic_map(), reference_map());
    assert_eq!(bits(ours), bits(&reference), "the tree map differs from the paper's layout");
    assert!(ours.windows(2).all(|w| w[0] < w[1]), "the map is not strictly ascending: codes are not ranks");
    assert_eq!(ours[0], 0.0);
    // Top value 1 − 0.45/128, smallest non-zero 0.55e-7.
    assert!((ours[255] as f64 - (1.0 - 0.45 / 128.0)).abs() < 1e-7, "{}", ours[255]);
    assert!((ours[1] as f64 - 0.55e-7).abs() < 1e-14, "{}", ours[1]);
    // Decade E holds 2^(7−E) values in [0.1·10^-E, 10^-E).
    for e in 0..8 {
        let (lo, hi) = (0.1 * 10f64.powi(-e), 10f64.powi(-e));
        let count = ours.iter().filter(|&&x| (x as f64) > lo && (x as f64) < hi).count();
        assert_eq!(count, 1 << (7 - e), "decade {e}");
    }
}

#[test]
fn linear_round_trip_equals_the_reference_bitwise() {
    let mut rng = Lcg(1);
    let mut seen_ties = 0;
    for x in sample_blocks(&mut rng, false) {
        let (ra, rcodes) = ref_quantize_linear(&x);
        for isa in Isa::available() {
            let mut codes = vec![0i8; x.len()];
            let a = quantize_linear(isa, &x, &mut codes).unwrap();
            assert_eq!(a.to_bits(), ra.to_bits(), "{isa}");
            assert_eq!(codes, rcodes, "{isa}: codes of a block of {}", x.len());
            let mut back = vec![0f32; x.len()];
            dequantize_linear(isa, &codes, a, &mut back).unwrap();
            for ((&y, &b), &j) in x.iter().zip(&back).zip(&codes) {
                // The value j·A/127 rounded once to f32, from exact rationals.
                let exact = j as f64 * a as f64 / 127.0;
                assert_eq!(b.to_bits(), (exact as f32).to_bits(), "{isa}: dequantized {j}·{a}/127");
                assert!(((y - b).abs() as f64) <= a as f64 / 254.0 * (1.0 + 1e-6), "{y} → {b} with A = {a}");
                seen_ties += (a > 0.0 && (127.0 * y as f64 / a as f64).fract().abs() == 0.5) as usize;
            }
        }
    }
    assert!(seen_ties > 100, "the samples hold {seen_ties} exact ties");
}

#[test]
fn dynamic_round_trip_equals_the_reference_bitwise() {
    let map = reference_map();
    let mut rng = Lcg(2);
    for x in sample_blocks(&mut rng, true) {
        let (ra, rcodes) = ref_quantize_dynamic(&x, &map);
        for isa in Isa::available() {
            let mut codes = vec![0u8; x.len()];
            let a = quantize_dynamic(isa, &x, &mut codes).unwrap();
            assert_eq!(a.to_bits(), ra.to_bits(), "{isa}");
            assert_eq!(codes, rcodes, "{isa}: codes of a block of {}", x.len());
            let mut back = vec![0f32; x.len()];
            dequantize_dynamic(isa, &codes, a, &mut back).unwrap();
            for (&b, &c) in back.iter().zip(&codes) {
                assert_eq!(b.to_bits(), (map[c as usize] * a).to_bits(), "{isa}");
            }
        }
    }
    // Every threshold times an absmax is exact in f64 (the exactness the codes rely on): its
    // fused multiply-add residual is zero.
    let mids: Vec<f64> = map.windows(2).map(|w| (w[0] as f64 + w[1] as f64) / 2.0).collect();
    for _ in 0..2000 {
        let a = (rng.uniform() * 10f32.powi((rng.next() % 40) as i32 - 20)) as f64;
        assert!(mids.iter().all(|&t| t.mul_add(a, -(t * a)) == 0.0), "a threshold times {a} is not exact");
    }
    let e = quantize_dynamic(Isa::Scalar, &[1.0; 3], &mut [0u8; 2]).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { expected: 3, got: 2, .. }), "{e}");
}

// ---- (b) bf16 against half ---------------------------------------------------------------------

#[test]
fn bf16_rne_equals_half_on_a_sweep_of_bit_patterns() {
    let mut patterns: Vec<u32> = (0..u32::MAX / 997).map(|k| k.wrapping_mul(997)).collect();
    for base in [0u32, 0x0000_8000, 0x0001_8000, 0x007f_ffff, 0x3f80_8000, 0x3f81_8000, 0x7f7f_ffff, 0x7f80_0000] {
        for d in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1_0000, 0x1_8000] {
            patterns.push(base.wrapping_add(d));
            patterns.push(base.wrapping_add(d) | 0x8000_0000);
        }
    }
    patterns.extend([0x7f80_0001, 0x7fc0_0000, 0x7fff_ffff, 0xffc0_1234]);
    for b in patterns {
        let x = f32::from_bits(b);
        assert_eq!(bf16_rne(x).to_bits(), bf16::from_f32(x).to_bits(), "bf16 of {b:#010x}");
    }
}

// ---- one step, bit-exact, ragged ---------------------------------------------------------------

struct Quantized {
    m: Vec<i8>,
    ma: Vec<f32>,
    v: Vec<u8>,
    va: Vec<f32>,
}

/// Quantizes whole moment vectors block by block with the test's references.
fn ref_quantize(m: &[f32], v: &[f32]) -> Quantized {
    let map = reference_map();
    let mut q = Quantized { m: vec![], ma: vec![], v: vec![], va: vec![] };
    for (mb, vb) in m.chunks(QUANT_BLOCK).zip(v.chunks(QUANT_BLOCK)) {
        let (a, c) = ref_quantize_linear(mb);
        q.ma.push(a);
        q.m.extend(c);
        let (a, c) = ref_quantize_dynamic(vb, &map);
        q.va.push(a);
        q.v.extend(c);
    }
    q
}

/// The dequantized vectors (by the reference formulas: `j·A/127`, `map[c]·A`).
fn ref_dequantize(q: &Quantized) -> (Vec<f32>, Vec<f32>) {
    let map = reference_map();
    let m = q.m.iter().enumerate().map(|(i, &j)| (j as f64 * q.ma[i / QUANT_BLOCK] as f64 / 127.0) as f32).collect();
    let v = q.v.iter().enumerate().map(|(i, &c)| map[c as usize] * q.va[i / QUANT_BLOCK]).collect();
    (m, v)
}

/// The f32 kernel's step (scalar path) from copies of `p`, `m`, `v`.
fn f32_step(
    s: &StepScalars,
    p: &[f32],
    m: &[f32],
    v: &[f32],
    g: &[f32],
    out: CopyOut<'_>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut p, mut m, mut v) = (p.to_vec(), m.to_vec(), v.to_vec());
    adam_step(Isa::Scalar, s, StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v }, GradSlice::F32(g), out).unwrap();
    (p, m, v)
}

fn random_state(rng: &mut Lcg, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let p: Vec<f32> = (0..n).map(|_| rng.normal() * 0.1).collect();
    let g: Vec<f32> = (0..n).map(|_| rng.normal() * 10f32.powi((rng.next() % 7) as i32 - 4)).collect();
    let m: Vec<f32> = g.iter().map(|&x| x * 0.3 + rng.normal() * 1e-3).collect();
    let v: Vec<f32> = g.iter().map(|&x| x * x * 0.5 + 1e-9).collect();
    (p, g, m, v)
}

/// From a state the int8 codes represent exactly, one step equals the f32 kernel's step followed by
/// the reference quantizer, bit for bit (p, the bf16 copy, codes, absmax), on every path, for
/// lengths with a ragged last block (1, 255, 257, 3·256 + 17) and whole blocks.
#[test]
fn int8_step_equals_f32_step_then_reference_quantizer() {
    let mut rng = Lcg(3);
    for n in [1usize, 255, 256, 257, 3 * QUANT_BLOCK + 17, 8 * QUANT_BLOCK] {
        let (p0, g, m0, v0) = random_state(&mut rng, n);
        let q0 = ref_quantize(&m0, &v0);
        let (mq, vq) = ref_dequantize(&q0);
        for kind in [AdamKind::AdamW, AdamKind::Adam] {
            let cfg = AdamConfig { kind, ..AdamConfig::default() };
            let s = cfg.scalars(7, 1e-3, 0.8).unwrap();
            let mut of = vec![bf16::ZERO; n];
            let (pf, mf, vf) = f32_step(&s, &p0, &mq, &vq, &g, CopyOut::BF16(&mut of));
            let want = ref_quantize(&mf, &vf);
            assert_eq!(want.ma.len(), n.div_ceil(QUANT_BLOCK));
            for isa in Isa::available() {
                let (mut p, mut q) = (p0.clone(), ref_quantize(&m0, &v0));
                let mut o = vec![bf16::ZERO; n];
                let moments = Moments::Int8 { m: &mut q.m, m_absmax: &mut q.ma, v: &mut q.v, v_absmax: &mut q.va };
                adam_step_moments(isa, &s, &mut p, moments, GradSlice::F32(&g), CopyOut::BF16(&mut o)).unwrap();
                assert_eq!(bits(&p), bits(&pf), "{isa} n={n} {kind:?}: p");
                assert!(o.iter().zip(&of).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa} n={n}: copy");
                assert_eq!(q.m, want.m, "{isa} n={n} {kind:?}: m codes");
                assert_eq!(bits(&q.ma), bits(&want.ma), "{isa} n={n} {kind:?}: m absmax");
                assert_eq!(q.v, want.v, "{isa} n={n} {kind:?}: v codes");
                assert_eq!(bits(&q.va), bits(&want.va), "{isa} n={n} {kind:?}: v absmax");
            }
        }
    }
}

/// From bf16-exact moments, one step equals the f32 kernel's step with `m` and `v` then rounded by
/// `half` (RNE), bit for bit, on every path.
#[test]
fn bf16_step_equals_f32_step_then_half_rounding() {
    let mut rng = Lcg(4);
    for n in [1usize, 300, 4 * QUANT_BLOCK + 5] {
        let (p0, g, m0, v0) = random_state(&mut rng, n);
        let (mb0, vb0): (Vec<bf16>, Vec<bf16>) =
            (m0.iter().map(|&x| bf16::from_f32(x)).collect(), v0.iter().map(|&x| bf16::from_f32(x)).collect());
        let s = AdamConfig::default().scalars(3, 1e-3, 1.0).unwrap();
        let up = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let (pf, mf, vf) = f32_step(&s, &p0, &up(&mb0), &up(&vb0), &g, CopyOut::None);
        for isa in Isa::available() {
            let (mut p, mut mb, mut vb) = (p0.clone(), mb0.clone(), vb0.clone());
            let moments = Moments::Bf16 { m: &mut mb, v: &mut vb };
            adam_step_moments(isa, &s, &mut p, moments, GradSlice::F32(&g), CopyOut::None).unwrap();
            assert_eq!(bits(&p), bits(&pf), "{isa} n={n}: p");
            for i in 0..n {
                assert_eq!(mb[i].to_bits(), bf16::from_f32(mf[i]).to_bits(), "{isa} n={n}: m[{i}]");
                assert_eq!(vb[i].to_bits(), bf16::from_f32(vf[i]).to_bits(), "{isa} n={n}: v[{i}]");
            }
        }
    }
}

/// The threaded step cuts the buffers (at whole blocks) but gives the single-threaded bits, with a
/// ragged last block; its fused gradient sum of squares has `grad_sumsq`'s bits.
#[test]
fn threaded_step_equals_single_thread_bitwise() {
    let n = 9 * NORM_BLOCK + 123;
    let mut rng = Lcg(6);
    let (p0, g, m0, v0) = random_state(&mut rng, n);
    let s = AdamConfig::default().scalars(4, 1e-3, 0.7).unwrap();
    let isa = Isa::detect();
    let run = |threads: Option<(usize, bool)>, dtype: StateDType| {
        let mut p = p0.clone();
        let mut q = ref_quantize(&m0, &v0);
        let (mut mb, mut vb): (Vec<bf16>, Vec<bf16>) =
            (m0.iter().map(|&x| bf16::from_f32(x)).collect(), v0.iter().map(|&x| bf16::from_f32(x)).collect());
        let mut o = vec![bf16::ZERO; n];
        let moments = match dtype {
            StateDType::Bf16 => Moments::Bf16 { m: &mut mb, v: &mut vb },
            _ => Moments::Int8 { m: &mut q.m, m_absmax: &mut q.ma, v: &mut q.v, v_absmax: &mut q.va },
        };
        let (grads, out) = (GradSlice::F32(&g), CopyOut::BF16(&mut o));
        match threads {
            None => adam_step_moments(isa, &s, &mut p, moments, grads, out).unwrap(),
            Some((t, false)) => AdamKernel::new(isa, t).unwrap().step_moments(&s, &mut p, moments, grads, out).unwrap(),
            Some((t, true)) => {
                let mut partials = vec![0f64; n.div_ceil(NORM_BLOCK)];
                let k = AdamKernel::new(isa, t).unwrap();
                let ss = k.step_moments_with_sumsq(&s, &mut p, moments, grads, out, &mut partials).unwrap();
                assert_eq!(ss.to_bits(), grad_sumsq(isa, grads).unwrap().to_bits(), "{t} threads: sum of squares");
            }
        }
        let mbits: Vec<u16> = mb.iter().chain(&vb).map(|x| x.to_bits()).collect();
        (bits(&p), o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), mbits, q.m, q.v, bits(&q.ma), bits(&q.va))
    };
    for dtype in [StateDType::Bf16, StateDType::Int8] {
        let one = run(None, dtype);
        for threads in [1, 2, 3] {
            for sumsq in [false, true] {
                assert!(run(Some((threads, sumsq)), dtype) == one, "{dtype}, {threads} threads, sumsq {sumsq}");
            }
        }
    }
}

#[test]
fn f32_moments_are_the_f32_kernel() {
    let mut rng = Lcg(5);
    let n = 1000;
    let (p0, g, m0, v0) = random_state(&mut rng, n);
    let s = AdamConfig::default().scalars(2, 1e-3, 1.0).unwrap();
    let (pf, mf, vf) = f32_step(&s, &p0, &m0, &v0, &g, CopyOut::None);
    let (mut p, mut m, mut v) = (p0, m0, v0);
    adam_step_moments(
        Isa::detect(),
        &s,
        &mut p,
        Moments::F32 { m: &mut m, v: &mut v },
        GradSlice::F32(&g),
        CopyOut::None,
    )
    .unwrap();
    assert_eq!((bits(&p), bits(&m), bits(&v)), (bits(&pf), bits(&mf), bits(&vf)));
}

#[test]
fn lengths_are_checked_and_bytes_are_documented() {
    let s = AdamConfig::default().scalars(1, 1e-3, 1.0).unwrap();
    let n = QUANT_BLOCK + 1;
    let (mut p, g) = (vec![0f32; n], vec![0f32; n]);
    let (mut m, mut v) = (vec![0i8; n], vec![0u8; n]);
    let (mut ma, mut va) = (vec![0f32; 1], vec![0f32; 2]);
    let moments = Moments::Int8 { m: &mut m, m_absmax: &mut ma, v: &mut v, v_absmax: &mut va };
    let e = adam_step_moments(Isa::Scalar, &s, &mut p, moments, GradSlice::F32(&g), CopyOut::None).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { expected: 2, got: 1, .. }), "{e}");
    assert!(e.to_string().contains("m absmax"), "{e}");
    let (mut mb, mut vb) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let e = adam_step_moments(
        Isa::Scalar,
        &s,
        &mut p,
        Moments::Bf16 { m: &mut mb, v: &mut vb },
        GradSlice::F32(&g[1..]),
        CopyOut::None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("gradients"), "{e}");
    let k = AdamKernel::new(Isa::Scalar, 1).unwrap();
    let moments = Moments::Bf16 { m: &mut mb, v: &mut vb };
    let e =
        k.step_moments_with_sumsq(&s, &mut p, moments, GradSlice::F32(&g), CopyOut::None, &mut [0.0; 2]).unwrap_err();
    assert!(e.to_string().contains("norm partials") && e.to_string().contains('2'), "{e}");
    assert_eq!(StateDType::F32.moment_bytes(1000), 8000);
    assert_eq!(StateDType::Bf16.moment_bytes(1000), 4000);
    assert_eq!(StateDType::Int8.moment_bytes(1000), 2000 + 8 * 4);
    assert_eq!(StateDType::Int8.moment_bytes(1 << 20) as f64 / (1 << 20) as f64, 2.03125);
    let parsed: Vec<StateDType> = serde_json::from_str(r#"["f32", "bf16", "int8"]"#).unwrap();
    assert_eq!(parsed, [StateDType::F32, StateDType::Bf16, StateDType::Int8]);
}

// ---- (c) torch's vectors: several steps within the derived bound --------------------------------

/// Per-element bounds on |reduced − f32| for p, m, v, carried from step to step.
///
/// With both runs at radii (rp, rm, rv) before a step, the step's exact arithmetic gives:
/// `Δg ≤ l2·rp` (Adam's L2 term), `rm ← β1·rm + (1−β1)·Δg`, `rv ← β2·rv + (1−β2)(2|g|Δg + Δg²)`,
/// and the parameter update `u(m, v) = s·m/(√v/√(1−β2^t) + ε)`, monotone in `m` and in `v`, moves
/// by at most its largest change over the box `m ± rm`, `v ± rv` (its corners), where `v` is also
/// at least `(1−β2)·g²` in both runs since stored values are ≥ 0: `rp ← decay·rp + Δu`.
/// Storing then adds the map's error: int8 `m`: `A/254`; int8 `v`: `A`·half the larger gap of the
/// tree map beside the stored code; bf16: `2^-8/(1 − 2^-8)·|stored|` (8 significant bits). Each
/// run's own f32 rounding adds a few ulp (`4·2^-24` relative per quantity per step).
struct Bounds {
    rp: Vec<f64>,
    rm: Vec<f64>,
    rv: Vec<f64>,
}

const ULP: f64 = 4.0 / (1u64 << 24) as f64;

#[test]
fn several_steps_on_torch_vectors_stay_within_the_quantization_bound() {
    let map = reference_map();
    let half_gap = |c: usize| {
        let lo = if c > 0 { map[c] - map[c - 1] } else { 0.0 };
        let hi = if c < 255 { map[c + 1] - map[c] } else { map[255] - map[254] };
        lo.max(hi) as f64 / 2.0
    };
    let isa = Isa::detect();
    for case in load_cases() {
        let (n, cfg) = (case.n, case.cfg);
        for dtype in [StateDType::Bf16, StateDType::Int8] {
            let (mut pf, mut mf, mut vf) = (case.p0.clone(), vec![0f32; n], vec![0f32; n]);
            let mut pq = case.p0.clone();
            let (mut mb, mut vb) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
            let blocks = n.div_ceil(QUANT_BLOCK);
            let mut q = Quantized { m: vec![0; n], ma: vec![0.0; blocks], v: vec![0; n], va: vec![0.0; blocks] };
            let mut b = Bounds { rp: vec![0.0; n], rm: vec![0.0; n], rv: vec![0.0; n] };
            let mut worst = [0.0f64; 3];
            let mut step1_ratio = [0.0f64; 2];
            let mut differs = 0usize;
            for t in 1..=case.steps {
                let g = &case.grads[(t - 1) * n..t * n];
                let s = cfg.scalars(t as u64, case.lr, 1.0).unwrap();
                // The bound's constants in f64, from the hyper-parameters.
                let (b1, b2, tf) = (cfg.beta1, cfg.beta2, t as f64);
                let ss = case.lr as f64 / (1.0 - b1.powf(tf));
                let bc2 = (1.0 - b2.powf(tf)).sqrt();
                let (l2, decay) = match cfg.kind {
                    AdamKind::Adam => (cfg.weight_decay, 1.0),
                    AdamKind::AdamW => (0.0, 1.0 - case.lr as f64 * cfg.weight_decay),
                };
                let gf: Vec<f64> = (0..n).map(|i| g[i] as f64 + l2 * pf[i] as f64).collect();
                let state = StateIo::InPlace { p: &mut pf, m: &mut mf, v: &mut vf };
                adam_step(isa, &s, state, GradSlice::F32(g), CopyOut::None).unwrap();
                let moments = match dtype {
                    StateDType::Bf16 => Moments::Bf16 { m: &mut mb, v: &mut vb },
                    _ => Moments::Int8 { m: &mut q.m, m_absmax: &mut q.ma, v: &mut q.v, v_absmax: &mut q.va },
                };
                adam_step_moments(isa, &s, &mut pq, moments, GradSlice::F32(g), CopyOut::None).unwrap();
                let (md, vd): (Vec<f32>, Vec<f32>) = match dtype {
                    StateDType::Bf16 => {
                        (mb.iter().map(|x| x.to_f32()).collect(), vb.iter().map(|x| x.to_f32()).collect())
                    }
                    _ => ref_dequantize(&q),
                };
                let u = |m: f64, v: f64| ss * m / (v.max(0.0).sqrt() / bc2 + cfg.eps);
                for i in 0..n {
                    let dg = l2 * b.rp[i];
                    let rm = b1 * b.rm[i] + (1.0 - b1) * dg + ULP * (mf[i].abs() as f64 + b.rm[i]);
                    let rv =
                        b2 * b.rv[i] + (1.0 - b2) * (2.0 * gf[i].abs() * dg + dg * dg) + ULP * (vf[i] as f64 + b.rv[i]);
                    let (mc, vc) = (mf[i] as f64, vf[i] as f64);
                    let uc = u(mc, vc);
                    // The new v is at least (1 − β2)·g² in both runs (the stored v is ≥ 0).
                    let v_floor = (1.0 - b2) * (gf[i].abs() - dg).max(0.0).powi(2) * (1.0 - ULP);
                    let vlo = (vc - rv).max(v_floor);
                    let du = [(mc - rm, vlo), (mc - rm, vc + rv), (mc + rm, vlo), (mc + rm, vc + rv)]
                        .iter()
                        .map(|&(m, v)| (u(m, v) - uc).abs())
                        .fold(0.0f64, f64::max);
                    b.rp[i] = decay * b.rp[i] + du + ULP * (pf[i].abs() as f64 + uc.abs() + du);
                    let (em, ev) = match dtype {
                        StateDType::Bf16 => {
                            let r = 2f64.powi(-8) / (1.0 - 2f64.powi(-8));
                            (r * md[i].abs() as f64 + 1e-40, r * vd[i] as f64 + 1e-40)
                        }
                        _ => {
                            let blk = i / QUANT_BLOCK;
                            (q.ma[blk] as f64 / 254.0, q.va[blk] as f64 * half_gap(q.v[i] as usize))
                        }
                    };
                    b.rm[i] = rm + em + ULP * md[i].abs() as f64;
                    b.rv[i] = rv + ev + ULP * vd[i] as f64;
                    let errs = [
                        (pq[i] as f64 - pf[i] as f64).abs(),
                        (md[i] as f64 - mf[i] as f64).abs(),
                        (vd[i] as f64 - vf[i] as f64).abs(),
                    ];
                    let bounds = [b.rp[i], b.rm[i], b.rv[i]];
                    for k in 0..3 {
                        assert!(
                            errs[k] <= bounds[k],
                            "{} {dtype} step {t} element {i}: |{}| error {:e} above its bound {:e} (p {} vs {}, m {} vs {}, v {} vs {})",
                            case.name,
                            ["p", "m", "v"][k],
                            errs[k],
                            bounds[k],
                            pq[i],
                            pf[i],
                            md[i],
                            mf[i],
                            vd[i],
                            vf[i]
                        );
                        if bounds[k] > 0.0 {
                            worst[k] = worst[k].max(errs[k] / bounds[k]);
                        }
                    }
                    if t == 1 {
                        // After one step from zero the two runs differ by the storing alone.
                        step1_ratio[0] = step1_ratio[0].max(errs[1] / (em + 1e-300));
                        step1_ratio[1] = step1_ratio[1].max(errs[2] / (ev + 1e-300));
                    }
                    differs += (errs[0] > 0.0) as usize;
                }
            }
            let max_rp = b.rp.iter().fold(0.0f64, |a, &x| a.max(x));
            let mut sorted = b.rp.clone();
            sorted.sort_by(f64::total_cmp);
            let q99 = sorted[(n - 1) * 99 / 100];
            let dp: Vec<f64> = (0..n).map(|i| (pq[i] as f64 - pf[i] as f64).abs()).collect();
            let max_dp = dp.iter().fold(0.0f64, |a, &x| a.max(x));
            let big = dp.iter().filter(|&&x| x > case.lr as f64).count();
            eprintln!(
                "  largest |p − p_f32| {max_dp:.3e} = {:.2} lr; {big} of {n} elements off by more than lr",
                max_dp / case.lr as f64
            );
            eprintln!(
                "{} {dtype}: {} steps, p differs from f32 in {differs} element-steps; worst error/bound p {:.3} m {:.3} v {:.3}; \
                 step-1 storing error / map bound m {:.3} v {:.3}; largest p bound {max_rp:.3e}, 99th percentile {q99:.3e} (lr {})",
                case.name, case.steps, worst[0], worst[1], worst[2], step1_ratio[0], step1_ratio[1], case.lr
            );
            // The reduced state really is reduced (the error is not zero) ...
            assert!(differs > 0, "{} {dtype}: the reduced-state run equals the f32 run", case.name);
            // ... and the storing bound is tight on the larger cases: a coder with twice the error
            // (truncation instead of rounding, a stale absmax) would exceed it.
            if n > 10 * QUANT_BLOCK {
                assert!(step1_ratio.iter().all(|&r| r > 0.9), "{} {dtype}: step-1 ratios {step1_ratio:?}", case.name);
            }
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Random blocks (any length up to two blocks, scales over 30 decades, signs, zeros) give the
    /// reference codes and absmax on every path; negative values on the tree map give code 0.
    #[test]
    fn codecs_equal_the_references_on_random_blocks(len in 0usize..2 * QUANT_BLOCK, seed in proptest::prelude::any::<u64>(), decades in 0i32..30) {
        let mut rng = Lcg(seed);
        let scale = 10f32.powi(rng.next().is_multiple_of(2) as i32 * 10 - 5);
        let x: Vec<f32> = (0..len)
            .map(|_| if rng.next().is_multiple_of(16) { 0.0 } else { rng.normal() * scale * 10f32.powf(-(decades as f32) * rng.uniform()) })
            .collect();
        let map = reference_map();
        let (la, lc) = ref_quantize_linear(&x);
        let (da, dc) = ref_quantize_dynamic(&x, &map);
        for isa in Isa::available() {
            let (mut c8, mut u8s) = (vec![0i8; len], vec![0u8; len]);
            proptest::prop_assert_eq!(quantize_linear(isa, &x, &mut c8).unwrap().to_bits(), la.to_bits());
            proptest::prop_assert_eq!(&c8, &lc, "{} linear", isa);
            proptest::prop_assert_eq!(quantize_dynamic(isa, &x, &mut u8s).unwrap().to_bits(), da.to_bits());
            proptest::prop_assert_eq!(&u8s, &dc, "{} dynamic", isa);
            proptest::prop_assert!(x.iter().zip(&u8s).all(|(&y, &c)| y > 0.0 || c == 0));
        }
    }
}
