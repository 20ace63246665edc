//! The fused Adam/AdamW kernel: torch's reference vectors on every dispatch path, a property test
//! against an independent scalar reference (bitwise), conversions against `half`, threads.

mod common;

use half::{bf16, f16};
use oogc_optimizer::{
    adam_step, grad_sumsq, AdamConfig, AdamKernel, AdamKind, CopyOut, GradSlice, Isa, StateIo, StepScalars, NORM_BLOCK,
};
use proptest::prelude::*;

use common::{bits, load_cases, Case, Lcg};

fn within(ours: f32, reference: f32, rel: f32, abs: f32) -> bool {
    (ours - reference).abs() <= rel * reference.abs() + abs
}

#[test]
fn torch_reference_vectors_match_on_every_available_path() {
    let cases = load_cases();
    assert!(cases.len() >= 5, "expected at least 5 cases, got {}", cases.len());
    let paths = Isa::available();
    assert!(paths.contains(&Isa::Scalar));
    eprintln!("checking dispatch paths {paths:?}");
    for case in &cases {
        let Case { name, n, steps, cfg, lr, p0, grads, p: rp, m: rm, v: rv } = case;
        let (n, steps, lr) = (*n, *steps, *lr);
        let mut results = Vec::new();
        for &isa in &paths {
            let (mut p, mut m, mut v) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
            for t in 1..=steps {
                let s = cfg.scalars(t as u64, lr, 1.0).unwrap();
                let g = &grads[(t - 1) * n..t * n];
                adam_step(
                    isa,
                    &s,
                    StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v },
                    GradSlice::F32(g),
                    CopyOut::None,
                )
                .unwrap();
                let r = (t - 1) * n..t * n;
                for (what, ours, reference, rel, abs) in [
                    ("p", &p, &rp[r.clone()], 1e-5, 1e-8),
                    ("m", &m, &rm[r.clone()], 1e-5, 1e-6),
                    ("v", &v, &rv[r.clone()], 1e-5, 1e-12),
                ] {
                    let bad: Vec<usize> =
                        (0..n).filter(|&i| !within(ours[i], reference[i], rel, abs)).take(5).collect();
                    assert!(
                        bad.is_empty(),
                        "{name} {isa} step {t} {what}: {} elements outside tolerance, e.g. {:?}",
                        (0..n).filter(|&i| !within(ours[i], reference[i], rel, abs)).count(),
                        bad.iter().map(|&i| (i, ours[i], reference[i])).collect::<Vec<_>>()
                    );
                }
            }
            results.push((isa, p, m, v));
        }
        for w in results.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            assert!(
                bits(&a.1) == bits(&b.1) && bits(&a.2) == bits(&b.2) && bits(&a.3) == bits(&b.3),
                "{name}: {} and {} differ",
                a.0,
                b.0
            );
        }
    }
}

/// The documented element update, written independently of the crate (f64 constants rounded once).
#[allow(clippy::too_many_arguments)]
fn reference(cfg: &AdamConfig, t: u64, lr: f32, scale: f32, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let (b1, b2) = (cfg.beta1, cfg.beta2);
    let step_size = (lr as f64 / (1.0 - b1.powf(t as f64))) as f32;
    let bc2 = (1.0 - b2.powf(t as f64)).sqrt() as f32;
    let c1 = (1.0 - b1) as f32;
    let c2 = (1.0 - b2) as f32;
    let decay = (1.0 - lr as f64 * cfg.weight_decay) as f32;
    let (wd, beta2, eps) = (cfg.weight_decay as f32, cfg.beta2 as f32, cfg.eps as f32);
    for i in 0..p.len() {
        let mut gi = g[i] * scale;
        let mut pi = p[i];
        match cfg.kind {
            AdamKind::AdamW => pi *= decay,
            AdamKind::Adam => {
                if cfg.weight_decay != 0.0 {
                    gi += pi * wd
                }
            }
        }
        m[i] = c1.mul_add(gi - m[i], m[i]);
        v[i] = v[i] * beta2 + (c2 * gi) * gi;
        let denom = v[i].sqrt() / bc2 + eps;
        p[i] = pi - (step_size * m[i]) / denom;
    }
}

#[derive(Debug, Clone, Copy)]
enum Dt {
    F32,
    BF16,
    F16,
}

fn dt() -> impl Strategy<Value = Dt> {
    prop_oneof![Just(Dt::F32), Just(Dt::BF16), Just(Dt::F16)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    /// Every path, in place and out of place, every gradient and copy type, equals the
    /// independent reference bit for bit (p, m, v and the copy).
    #[test]
    fn every_path_equals_the_scalar_reference_bitwise(
        n in 0usize..700,
        seed in any::<u64>(),
        adamw in any::<bool>(),
        beta1 in 0.0f64..0.99,
        beta2 in 0.5f64..0.9999,
        eps in 1e-10f64..1e-2,
        wd in prop_oneof![Just(0.0f64), 0.0f64..0.2],
        lr in 1e-6f32..1e-1,
        t in 1u64..2000,
        scale in prop_oneof![Just(1.0f32), 0.01f32..1.0],
        gdt in dt(),
        odt in prop_oneof![Just(None), dt().prop_map(Some)],
        out_of_place in any::<bool>(),
    ) {
        let cfg = AdamConfig { kind: if adamw { AdamKind::AdamW } else { AdamKind::Adam }, beta1, beta2, eps, weight_decay: wd };
        let mut rng = Lcg(seed);
        let p0: Vec<f32> = (0..n).map(|_| rng.normal() * 0.1).collect();
        let m0: Vec<f32> = (0..n).map(|_| rng.normal() * 1e-2).collect();
        let v0: Vec<f32> = (0..n).map(|_| (rng.normal() * 1e-2).powi(2)).collect();
        let graw: Vec<f32> = (0..n).map(|_| rng.normal() * 10f32.powi((rng.next() % 8) as i32 - 5)).collect();
        let gb: Vec<bf16> = graw.iter().map(|&x| bf16::from_f32(x)).collect();
        let gh: Vec<f16> = graw.iter().map(|&x| f16::from_f32(x)).collect();
        let (grads, g32): (GradSlice<'_>, Vec<f32>) = match gdt {
            Dt::F32 => (GradSlice::F32(&graw), graw.clone()),
            Dt::BF16 => (GradSlice::BF16(&gb), gb.iter().map(|x| x.to_f32()).collect()),
            Dt::F16 => (GradSlice::F16(&gh), gh.iter().map(|x| x.to_f32()).collect()),
        };
        let (mut rp, mut rm, mut rv) = (p0.clone(), m0.clone(), v0.clone());
        reference(&cfg, t, lr, scale, &mut rp, &mut rm, &mut rv, &g32);
        let s = cfg.scalars(t, lr, scale).unwrap();
        for isa in Isa::available() {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let (mut o32, mut ob, mut oh) = (vec![0f32; n], vec![bf16::ZERO; n], vec![f16::ZERO; n]);
            let out = match odt {
                None => CopyOut::None,
                Some(Dt::F32) => CopyOut::F32(&mut o32),
                Some(Dt::BF16) => CopyOut::BF16(&mut ob),
                Some(Dt::F16) => CopyOut::F16(&mut oh),
            };
            if out_of_place {
                let (mut dp, mut dm, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
                adam_step(isa, &s, StateIo::OutOfPlace { src: [&p, &m, &v], dst: [&mut dp, &mut dm, &mut dv] }, grads, out).unwrap();
                prop_assert_eq!(bits(&p), bits(&p0), "out-of-place changed its source");
                (p, m, v) = (dp, dm, dv);
            } else {
                adam_step(isa, &s, StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v }, grads, out).unwrap();
            }
            prop_assert_eq!(bits(&p), bits(&rp), "{} p", isa);
            prop_assert_eq!(bits(&m), bits(&rm), "{} m", isa);
            prop_assert_eq!(bits(&v), bits(&rv), "{} v", isa);
            match odt {
                None => {}
                Some(Dt::F32) => prop_assert_eq!(bits(&o32), bits(&rp)),
                Some(Dt::BF16) => prop_assert!(ob.iter().zip(&rp).all(|(o, r)| o.to_bits() == bf16::from_f32(*r).to_bits()), "{} bf16 copy", isa),
                Some(Dt::F16) => prop_assert!(oh.iter().zip(&rp).all(|(o, r)| o.to_bits() == f16::from_f32(*r).to_bits()), "{} f16 copy", isa),
            }
        }
    }

    /// The canonical sum of squares has the same bits on every path.
    #[test]
    fn sumsq_is_the_same_on_every_path(n in 0usize..40_000, seed in any::<u64>(), gdt in dt()) {
        let mut rng = Lcg(seed);
        let graw: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
        let gb: Vec<bf16> = graw.iter().map(|&x| bf16::from_f32(x)).collect();
        let gh: Vec<f16> = graw.iter().map(|&x| f16::from_f32(x)).collect();
        let grads = match gdt { Dt::F32 => GradSlice::F32(&graw), Dt::BF16 => GradSlice::BF16(&gb), Dt::F16 => GradSlice::F16(&gh) };
        let s: Vec<u64> = Isa::available().into_iter().map(|isa| grad_sumsq(isa, grads).unwrap().to_bits()).collect();
        prop_assert!(s.windows(2).all(|w| w[0] == w[1]), "{:?}", s);
        let exact: f64 = (0..n).map(|i| (grads_get(&grads, i) as f64).powi(2)).sum();
        prop_assert!((f64::from_bits(s[0]) - exact).abs() <= 1e-12 * exact.max(1e-300));
    }
}

fn grads_get(g: &GradSlice<'_>, i: usize) -> f32 {
    match g {
        GradSlice::F32(g) => g[i],
        GradSlice::BF16(g) => g[i].to_f32(),
        GradSlice::F16(g) => g[i].to_f32(),
    }
}

/// With lr = 0 and zero gradients the parameters pass through unchanged, so the compute copy is
/// the conversion of the input: compare with `half` over a sweep of bit patterns (subnormals,
/// ties, NaN payloads, infinities, the largest finite values).
#[test]
fn compute_copy_conversions_equal_half_on_every_path() {
    let mut patterns: Vec<u32> = (0..u32::MAX / 4093).map(|k| k.wrapping_mul(4093)).collect();
    for base in [
        0u32,
        0x0000_8000,
        0x0001_8000,
        0x007f_ffff,
        0x3f80_8000,
        0x3f81_8000,
        0x7f7f_ffff,
        0x7f7f_8000,
        0x7f80_0000,
        0x7f80_0001,
        0x7fc0_0000,
        0x7fff_ffff,
        0x3880_0000,
        0x3800_1000,
        0x3380_0000,
        0x3300_0001,
    ] {
        for d in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
            patterns.push(base.wrapping_add(d));
            patterns.push((base.wrapping_add(d)) | 0x8000_0000);
        }
    }
    let p0: Vec<f32> = patterns.iter().map(|&b| f32::from_bits(b)).collect();
    let n = p0.len();
    let g = vec![0.0f32; n];
    let s = AdamConfig { kind: AdamKind::AdamW, weight_decay: 0.0, ..Default::default() }.scalars(1, 0.0, 1.0).unwrap();
    for isa in Isa::available() {
        let mut p = p0.clone();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut ob = vec![bf16::ZERO; n];
        adam_step(
            isa,
            &s,
            StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v },
            GradSlice::F32(&g),
            CopyOut::BF16(&mut ob),
        )
        .unwrap();
        let mut oh = vec![f16::ZERO; n];
        let mut p2 = p0.clone();
        adam_step(
            isa,
            &s,
            StateIo::InPlace { p: &mut p2, m: &mut m, v: &mut v },
            GradSlice::F32(&g),
            CopyOut::F16(&mut oh),
        )
        .unwrap();
        for i in 0..n {
            let x = p0[i];
            if !x.is_nan() {
                assert_eq!(p[i].to_bits(), x.to_bits(), "{isa}: lr = 0 changed {x:e}");
            }
            assert_eq!(ob[i].to_bits(), bf16::from_f32(p[i]).to_bits(), "{isa}: bf16 of {:#010x}", p[i].to_bits());
            assert_eq!(oh[i].to_bits(), f16::from_f32(p2[i]).to_bits(), "{isa}: f16 of {:#010x}", p2[i].to_bits());
        }
    }
}

/// Gradients in bf16/f16 are up-cast exactly: the same values given as f32 give the same bits.
#[test]
fn half_gradients_are_upcast_exactly() {
    let n = 1000;
    let mut rng = Lcg(7);
    let gb: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.normal())).collect();
    let gh: Vec<f16> = (0..n).map(|_| f16::from_f32(rng.normal())).collect();
    let s = AdamConfig::default().scalars(3, 1e-3, 1.0).unwrap();
    for isa in Isa::available() {
        for (half, full) in [
            (GradSlice::BF16(&gb), gb.iter().map(|x| x.to_f32()).collect::<Vec<_>>()),
            (GradSlice::F16(&gh), gh.iter().map(|x| x.to_f32()).collect::<Vec<_>>()),
        ] {
            let run = |g: GradSlice<'_>| {
                let (mut p, mut m, mut v) = (vec![0.5f32; n], vec![0.01f32; n], vec![1e-4f32; n]);
                adam_step(isa, &s, StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v }, g, CopyOut::None).unwrap();
                (bits(&p), bits(&m), bits(&v))
            };
            assert_eq!(run(half), run(GradSlice::F32(&full)), "{isa}");
        }
    }
}

/// The threaded kernel cuts the buffer but gives the single-threaded bits, and its fused sum of
/// squares equals `grad_sumsq`.
#[test]
fn threaded_kernel_equals_single_thread_bitwise() {
    let n = 9 * NORM_BLOCK + 123;
    let mut rng = Lcg(11);
    let p0: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let g: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.normal() * 1e-2)).collect();
    let s: StepScalars = AdamConfig::default().scalars(5, 3e-4, 0.5).unwrap();
    let isa = Isa::detect();
    let (mut p1, mut m1, mut v1) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
    let mut o1 = vec![bf16::ZERO; n];
    adam_step(
        isa,
        &s,
        StateIo::InPlace { p: &mut p1, m: &mut m1, v: &mut v1 },
        GradSlice::BF16(&g),
        CopyOut::BF16(&mut o1),
    )
    .unwrap();
    for threads in [1, 2, 3] {
        let k = AdamKernel::new(isa, threads).unwrap();
        let (mut p, mut m, mut v) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
        let mut o = vec![bf16::ZERO; n];
        let mut partials = vec![0f64; n.div_ceil(NORM_BLOCK)];
        let ss = k
            .step_with_sumsq(
                &s,
                StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v },
                GradSlice::BF16(&g),
                CopyOut::BF16(&mut o),
                &mut partials,
            )
            .unwrap();
        assert_eq!(ss.to_bits(), grad_sumsq(isa, GradSlice::BF16(&g)).unwrap().to_bits(), "{threads} threads");
        assert_eq!((bits(&p), bits(&m), bits(&v)), (bits(&p1), bits(&m1), bits(&v1)), "{threads} threads");
        assert!(o.iter().zip(&o1).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn length_mismatch_names_the_buffer_and_both_lengths() {
    let s = AdamConfig::default().scalars(1, 1e-3, 1.0).unwrap();
    let (mut p, mut m, mut v) = (vec![0f32; 10], vec![0f32; 10], vec![0f32; 10]);
    let e = adam_step(
        Isa::Scalar,
        &s,
        StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v },
        GradSlice::F32(&[0.0; 9]),
        CopyOut::None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("gradients") && e.contains("10") && e.contains('9'), "{e}");
    let e = AdamConfig::default().scalars(0, 1e-3, 1.0).unwrap_err().to_string();
    assert!(e.contains("1-based"), "{e}");
}
