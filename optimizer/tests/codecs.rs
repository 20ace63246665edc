//! The int8 block codecs' vector paths (the AVX-512 f32 fast paths with their exact fallbacks, the
//! AVX2 f64 path) against the scalar path, which decides in exact f64 arithmetic, and against an
//! exhaustive nearest-code search, on blocks built to sit on and next to every decision
//! threshold: for many absmax values (every binade from subnormal to `f32::MAX`, the edges of the
//! fast paths' range `[2^−90, 2^90]`, values with 127 as a factor, where the linear map has exact
//! ties), the f32 values at and within a few ulps of each exact threshold `(2j+1)·A/254` (linear)
//! and `mid_k·A` (tree map), exact ties, zeros, negative values, random values, and ragged
//! lengths. Decoding is checked for every code and each absmax.

mod common;

use oogc_optimizer::{dequantize_dynamic, dequantize_linear, dynamic_map, quantize_dynamic, quantize_linear, Isa};

use common::Lcg;

/// `x` moved by `k` ulps (through zero as the integers of the sign-magnitude order).
fn ulps(x: f32, k: i32) -> f32 {
    let b = x.to_bits() as i32;
    let ord = if b < 0 { i32::MIN - b } else { b };
    let o = ord.saturating_add(k);
    f32::from_bits(if o < 0 { (i32::MIN - o) as u32 } else { o as u32 })
}

/// Absmax values to test: every binade's first value and a random one, both range edges of the
/// fast paths, values with 127 as a factor, the extremes.
fn absmaxes(rng: &mut Lcg) -> Vec<f32> {
    let mut a = vec![1.0, 127.0, 127.0 * 3.0, 0.5, 1.0 / 127.0, f32::MAX, f32::MIN_POSITIVE, 1e-45, 1.4e-44, 1e-40];
    for e in -149..=127 {
        let p = 2f64.powi(e) as f32;
        a.push(p);
        a.push(p * (1.0 + rng.uniform()).min(1.9999999));
        a.push(127.0 * p);
    }
    for edge in [2f32.powi(-90), 2f32.powi(90)] {
        for k in -2..=2 {
            a.push(ulps(edge, k));
        }
    }
    a.retain(|x| x.is_finite() && *x > 0.0);
    a
}

/// Candidate values for a block of absmax `a`: `a` itself, then the f32 values within 2 ulps of
/// each exact threshold (rounded to f32 from f64; the exact threshold is within half an f32 ulp),
/// both signs for the linear map.
fn threshold_neighbours(a: f32, thresholds: impl Iterator<Item = f64>, signed: bool) -> Vec<f32> {
    let mut v = Vec::new();
    for t in thresholds {
        let c = t as f32;
        for k in -2..=2 {
            let y = ulps(c, k);
            if y.abs() <= a {
                v.push(y);
                if signed {
                    v.push(-y);
                }
            }
        }
    }
    v
}

/// Every length-`len` window (with `a` first, so the block's absmax is `a`) of `values`, padded
/// with random values in `[0, a]`.
fn blocks_of(a: f32, values: &[f32], rng: &mut Lcg, signed: bool) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for len in [256usize, 255, 33, 16, 1] {
        let mut rest = values.iter().copied();
        loop {
            let mut b = vec![a];
            b.extend(rest.by_ref().take(len - 1));
            let done = b.len() < len;
            while b.len() < len {
                let r = a * rng.uniform();
                b.push(if signed && rng.next().is_multiple_of(2) { -r } else { r });
            }
            if rng.next().is_multiple_of(4) {
                let k = (rng.next() % len as u64) as usize;
                if k > 0 {
                    b[k] = 0.0;
                }
            }
            out.push(b);
            if done || len < 33 {
                break;
            }
        }
    }
    out
}

/// The linear code by exhaustive search: `j` minimizing `|127·y − j·a|` (exact in f64), ties to
/// even.
fn exhaustive_linear(y: f32, a: f32) -> i8 {
    let mut best = 0i8;
    for j in -127i8..=127 {
        let (d, b) =
            ((127.0 * y as f64 - j as f64 * a as f64).abs(), (127.0 * y as f64 - best as f64 * a as f64).abs());
        if d < b || (d == b && j % 2 == 0) {
            best = j;
        }
    }
    best
}

/// The tree-map code by exhaustive search over the 256 values, ties to the lower code.
fn exhaustive_dynamic(y: f32, a: f32, map: &[f32; 256]) -> u8 {
    let mut best = 0u8;
    for c in 1..=255u8 {
        let d = (y as f64 - map[c as usize] as f64 * a as f64).abs();
        if d < (y as f64 - map[best as usize] as f64 * a as f64).abs() {
            best = c;
        }
    }
    best
}

#[test]
fn linear_codes_equal_the_exact_reference_at_every_threshold() {
    let mut rng = Lcg(0x11ea5);
    let mut checked = 0usize;
    for a in absmaxes(&mut rng) {
        let t = (0..127).map(|j| (2 * j + 1) as f64 * a as f64 / 254.0);
        let values = threshold_neighbours(a, t, true);
        for (n, x) in blocks_of(a, &values, &mut rng, true).into_iter().enumerate() {
            let mut want = vec![0i8; x.len()];
            let wa = quantize_linear(Isa::Scalar, &x, &mut want).unwrap();
            assert_eq!(wa.to_bits(), a.to_bits());
            if n % 31 == 0 {
                for (&y, &c) in x.iter().zip(&want) {
                    assert_eq!(c, exhaustive_linear(y, a), "scalar linear code of {y:e} (absmax {a:e})");
                }
            }
            for isa in Isa::available() {
                let mut got = vec![0i8; x.len()];
                assert_eq!(quantize_linear(isa, &x, &mut got).unwrap().to_bits(), a.to_bits());
                for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g, w, "{isa}: linear code of {:e} (bits {:#x}), absmax {a:e}", x[k], x[k].to_bits());
                }
            }
            checked += x.len();
        }
    }
    assert!(checked > 1_000_000, "{checked}");
}

#[test]
fn dynamic_codes_equal_the_exact_reference_at_every_threshold() {
    let map = dynamic_map();
    let mids: Vec<f64> = map.windows(2).map(|w| (w[0] as f64 + w[1] as f64) / 2.0).collect();
    let mut rng = Lcg(0xd1a9);
    let mut checked = 0usize;
    for a in absmaxes(&mut rng) {
        let mut values = threshold_neighbours(a, mids.iter().map(|m| m * a as f64), false);
        // A few negative values (code 0) and values across the eight decades.
        for k in 0..40 {
            values.push(-a * rng.uniform());
            values.push(a * 10f32.powf(-9.0 * rng.uniform()) * if k == 0 { 0.0 } else { 1.0 });
        }
        for (n, x) in blocks_of(a, &values, &mut rng, false).into_iter().enumerate() {
            let mut want = vec![0u8; x.len()];
            assert_eq!(quantize_dynamic(Isa::Scalar, &x, &mut want).unwrap().to_bits(), a.to_bits());
            if n % 31 == 0 {
                for (&y, &c) in x.iter().zip(&want) {
                    assert_eq!(c, exhaustive_dynamic(y, a, map), "scalar tree code of {y:e} (absmax {a:e})");
                }
            }
            for isa in Isa::available() {
                let mut got = vec![0u8; x.len()];
                assert_eq!(quantize_dynamic(isa, &x, &mut got).unwrap().to_bits(), a.to_bits());
                for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g, w, "{isa}: tree code of {:e} (bits {:#x}), absmax {a:e}", x[k], x[k].to_bits());
                }
            }
            checked += x.len();
        }
    }
    assert!(checked > 1_000_000, "{checked}");
}

#[test]
fn decoders_equal_the_scalar_path_for_every_code() {
    let mut rng = Lcg(0xdec0);
    let lin: Vec<i8> = (-127..=127).chain([0, 5, -3]).collect();
    let tree: Vec<u8> = (0..=255).chain([7, 200, 0]).collect();
    let mut absmax = absmaxes(&mut rng);
    absmax.extend([0.0, -0.0, -3.0]);
    for a in absmax {
        for len in [lin.len(), 16, 17, 1] {
            let codes = &lin[..len];
            let mut want = vec![0f32; len];
            dequantize_linear(Isa::Scalar, codes, a, &mut want).unwrap();
            for (&c, &w) in codes.iter().zip(&want) {
                assert_eq!(w.to_bits(), (((c as f64 * a as f64) / 127.0) as f32).to_bits(), "scalar {c}·{a:e}/127");
            }
            for isa in Isa::available() {
                let mut got = vec![0f32; len];
                dequantize_linear(isa, codes, a, &mut got).unwrap();
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa}: {}·{a:e}/127", codes[k]);
                }
            }
        }
        for len in [tree.len(), 16, 17, 1] {
            let codes = &tree[..len];
            let mut want = vec![0f32; len];
            dequantize_dynamic(Isa::Scalar, codes, a, &mut want).unwrap();
            for isa in Isa::available() {
                let mut got = vec![0f32; len];
                dequantize_dynamic(isa, codes, a, &mut got).unwrap();
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa}: map[{}]·{a:e}", codes[k]);
                }
            }
        }
    }
}

/// Many random blocks of random scales: every path gives the scalar path's codes.
#[test]
fn random_blocks_give_the_scalar_codes_on_every_path() {
    let mut rng = Lcg(0x5eed);
    for n in 0..4000 {
        let len = if n % 3 == 0 { 1 + (rng.next() % 256) as usize } else { 256 };
        let scale = 2f32.powi((rng.next() % 200) as i32 - 100);
        let spread = (rng.next() % 12) as f32;
        let x: Vec<f32> = (0..len).map(|_| rng.normal() * scale * 10f32.powf(-spread * rng.uniform())).collect();
        let v: Vec<f32> = x.iter().map(|y| y * y).collect();
        let (mut lw, mut dw) = (vec![0i8; len], vec![0u8; len]);
        let la = quantize_linear(Isa::Scalar, &x, &mut lw).unwrap();
        let da = quantize_dynamic(Isa::Scalar, &v, &mut dw).unwrap();
        for isa in Isa::available() {
            let (mut lg, mut dg) = (vec![0i8; len], vec![0u8; len]);
            assert_eq!(quantize_linear(isa, &x, &mut lg).unwrap().to_bits(), la.to_bits());
            assert_eq!(lg, lw, "{isa} linear, block {n}");
            assert_eq!(quantize_dynamic(isa, &v, &mut dg).unwrap().to_bits(), da.to_bits());
            assert_eq!(dg, dw, "{isa} dynamic, block {n}");
        }
    }
}

/// The int8 step (the fused AVX-512 kernel on whole blocks, the block-by-block path on the rest)
/// equals the scalar path bit for bit over several consecutive steps, from blocks of every kind of
/// absmax: ordinary, zero (the initial state), below and above the fast paths' range (2^−90,
/// 2^90), and blocks mixing eight decades; with f32, bf16 and f16 gradients, every kind of compute
/// copy, Adam and AdamW, and a ragged last block.
#[test]
fn int8_steps_equal_the_scalar_path_bitwise() {
    use half::{bf16, f16};
    use oogc_optimizer::{adam_step_moments, AdamConfig, AdamKind, CopyOut, GradSlice, Moments, QUANT_BLOCK};

    let mut rng = Lcg(0x57e9);
    let n = 13 * QUANT_BLOCK + 77;
    // Per block: scales of m, v and the gradient.
    let scales: [(f32, f32, f32); 14] = [
        (1.0, 1.0, 1.0),
        (0.0, 0.0, 0.0),
        (1e-30, 1e-32, 1e-31),
        (1e30, 1e30, 1.0),
        (1e-3, 1e-6, 1e-3),
        (2e-27, 1e-25, 1e-27),
        (3e27, 3e27, 1.0),
        (1.0, 1.0, 1.0),
        (1e-12, 1e-24, 1e-12),
        (0.0, 0.0, 0.0),
        (5.0, 25.0, 5.0),
        (1e-20, 1e-40, 1e-20),
        (1e20, 1e36, 1.0),
        (1.0, 1.0, 1.0),
    ];
    let mut p0 = vec![0f32; n];
    let (mut m0, mut v0, mut g) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    for i in 0..n {
        let (sm, sv, sg) = scales[i / QUANT_BLOCK];
        // Block 7 mixes eight decades.
        let spread = if i / QUANT_BLOCK == 7 { 10f32.powf(-8.0 * rng.uniform()) } else { 1.0 };
        p0[i] = rng.normal();
        m0[i] = rng.normal() * sm * spread;
        v0[i] = rng.normal().powi(2) * sv * spread;
        g[i] = rng.normal() * sg * spread;
    }
    let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
    let gh: Vec<f16> = g.iter().map(|&x| f16::from_f32(x)).collect();
    // The initial codes and absmax by the scalar path (the zero blocks: codes 0, absmax 0).
    let init = oogc_optimizer::MomentBufs::from_f32(oogc_optimizer::StateDType::Int8, &m0, &v0).unwrap();
    let run = |isa: Isa, kind: AdamKind, grads: usize, copy: usize| {
        let cfg = AdamConfig { kind, weight_decay: 0.01, ..AdamConfig::default() };
        let mut st = init.clone();
        let mut p = p0.clone();
        let (mut o32, mut o16, mut ob) = (vec![0f32; n], vec![f16::ZERO; n], vec![bf16::ZERO; n]);
        for t in 1..=4u64 {
            let s = cfg.scalars(t, 1e-3, 0.9).unwrap();
            let grads = match grads {
                0 => GradSlice::F32(&g),
                1 => GradSlice::BF16(&gb),
                _ => GradSlice::F16(&gh),
            };
            let out = match copy {
                0 => CopyOut::None,
                1 => CopyOut::F32(&mut o32),
                2 => CopyOut::BF16(&mut ob),
                _ => CopyOut::F16(&mut o16),
            };
            let moments: Moments<'_> = st.view();
            adam_step_moments(isa, &s, &mut p, moments, grads, out).unwrap();
        }
        let copy_bits: Vec<u32> = o32
            .iter()
            .map(|x| x.to_bits())
            .chain(o16.iter().map(|x| x.to_bits() as u32))
            .chain(ob.iter().map(|x| x.to_bits() as u32))
            .collect();
        (p.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), copy_bits, st)
    };
    for kind in [AdamKind::AdamW, AdamKind::Adam] {
        for (grads, copy) in [(0, 0), (0, 2), (1, 1), (2, 3), (1, 2)] {
            let want = run(Isa::Scalar, kind, grads, copy);
            for isa in Isa::available() {
                let got = run(isa, kind, grads, copy);
                assert!(got.0 == want.0, "{isa} {kind:?} grads {grads} copy {copy}: p");
                assert!(got.1 == want.1, "{isa} {kind:?} grads {grads} copy {copy}: copy");
                assert!(got.2 == want.2, "{isa} {kind:?} grads {grads} copy {copy}: moments");
            }
        }
    }
    let (_, _, st) = run(Isa::detect(), AdamKind::AdamW, 0, 0);
    assert!(st != init, "the steps moved the moments");
}
