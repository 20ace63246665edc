//! bf16 master weights by stochastic rounding (`optimizer.master_dtype = "bf16"`): the rounding
//! is unbiased (exactly, over all 2^16 random values; and in expectation over seeds), a step of
//! the fused kernel equals the f32 update followed by the rounding, its mean over many seeds is
//! the f32 kernel's update within the statistical bound, any thread cut gives the same bits, and
//! the compute copy is the master itself.

mod common;

use half::bf16;
use oogc_optimizer::{
    adam_step, adam_step_bf16_master, sr_bf16, sr_bits, sr_key, AdamConfig, AdamKernel, CopyOut, GradSlice, Isa,
    MomentBufs, StateDType, StateIo, NORM_BLOCK,
};

use common::Lcg;

/// A plain reference of stochastic rounding: the bf16 below `x` in magnitude (truncation) and
/// the one above, chosen up when `r` reaches `2^16 − (x's low 16 bits)`.
fn reference_sr(x: f32, r: u16) -> bf16 {
    let b = x.to_bits();
    let low = b & 0xffff;
    let down = bf16::from_bits((b >> 16) as u16);
    if low == 0 || (r as u32) < 0x1_0000 - low {
        down
    } else {
        bf16::from_bits(down.to_bits() + 1)
    }
}

#[test]
fn stochastic_rounding_is_exactly_unbiased_over_all_random_values() {
    let mut rng = Lcg(7);
    let mut xs: Vec<f32> = (0..200).map(|_| (rng.uniform() - 0.5) * 10f32.powi((rng.next() % 12) as i32 - 6)).collect();
    xs.extend([1.0, -1.0, 1.0 + f32::EPSILON, -3.0e-39, f32::MIN_POSITIVE, 0.0, -0.0]);
    for &x in &xs {
        let mut sum = 0.0f64;
        for r in 0..=u16::MAX {
            let y = sr_bf16(x, r);
            assert_eq!(y.to_bits(), reference_sr(x, r).to_bits(), "x {x:e} r {r}");
            sum += y.to_f64();
        }
        // Σ over all r of the rounded value is 2^16 · x exactly (both are exact in f64).
        assert_eq!(sum, x as f64 * 65536.0, "x {x:e}: biased");
    }
    for x in [f32::INFINITY, f32::NEG_INFINITY] {
        assert!((0..=u16::MAX).all(|r| sr_bf16(x, r).to_f32() == x));
    }
    assert!(sr_bf16(f32::NAN, 0xffff).is_nan());
}

#[test]
fn the_random_bits_are_uniform_enough_and_keyed() {
    // Mean of SR(x) over many elements' bits: within 5 σ of x.
    let x = 1.0f32 + 3.0 * f32::EPSILON; // 3/128 of a bf16 ulp above 1
    let n = 200_000u64;
    let key = sr_key(3, 17);
    let mean = (0..n).map(|i| sr_bf16(x, sr_bits(key, i)).to_f64()).sum::<f64>() / n as f64;
    let ulp = 2f64.powi(-7);
    let p = (x.to_bits() & 0xffff) as f64 / 65536.0; // the probability of rounding up
    let sigma = ulp * (p * (1.0 - p)).sqrt() / (n as f64).sqrt();
    assert!((mean - x as f64).abs() < 5.0 * sigma, "mean {mean} vs {x} (σ {sigma:e})");
    assert_ne!(sr_key(3, 17), sr_key(3, 18));
    assert_ne!(sr_key(3, 17), sr_key(4, 17));
    assert_ne!(sr_bits(key, 1), sr_bits(key, 2));
}

fn setup(n: usize, seed: u64) -> (Vec<bf16>, MomentBufs, Vec<f32>) {
    let mut rng = Lcg(seed);
    let p: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.uniform() - 0.5)).collect();
    let m: Vec<f32> = (0..n).map(|_| (rng.uniform() - 0.5) * 1e-2).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform() * 1e-4).collect();
    let g: Vec<f32> = (0..n).map(|_| (rng.uniform() - 0.5) * 1e-1).collect();
    (p, MomentBufs::F32 { m, v }, g)
}

#[test]
fn a_step_is_the_f32_update_then_stochastic_rounding_and_the_copy_is_the_master() {
    let n = 3 * 256 + 77;
    let cfg = AdamConfig { weight_decay: 0.1, ..Default::default() };
    let s = cfg.scalars(5, 1e-3, 0.5).unwrap();
    let key = sr_key(9, 5);
    for isa in Isa::available() {
        for dtype in [StateDType::F32, StateDType::Bf16, StateDType::Int8] {
            let (mut p, mom, g) = setup(n, 1);
            let (m0, v0) = mom.to_f32();
            let mut mom = MomentBufs::from_f32(dtype, &m0, &v0).unwrap();
            // The reference: the f32 kernel on the widened master and the decoded moments.
            let (mut pf, (mut mf, mut vf)) = (p.iter().map(|b| b.to_f32()).collect::<Vec<f32>>(), mom.to_f32());
            let state = StateIo::InPlace { p: &mut pf, m: &mut mf, v: &mut vf };
            adam_step(isa, &s, state, GradSlice::F32(&g), CopyOut::None).unwrap();
            let mut copy = vec![bf16::ZERO; n];
            adam_step_bf16_master(isa, &s, &mut p, mom.view(), GradSlice::F32(&g), CopyOut::BF16(&mut copy), key, 0)
                .unwrap();
            for i in 0..n {
                let want = reference_sr(pf[i], sr_bits(key, i as u64));
                assert_eq!(p[i].to_bits(), want.to_bits(), "{isa} {dtype}: element {i}");
            }
            assert_eq!(copy, p, "{isa} {dtype}: the compute copy is the master");
            let want = MomentBufs::from_f32(dtype, &mf, &vf).unwrap();
            assert!(mom == want, "{isa} {dtype}: moments");
        }
    }
}

#[test]
fn the_mean_over_seeds_is_the_f32_update() {
    // An update far below half a bf16 ulp: rounding to nearest would never move the weights;
    // stochastic rounding moves them by the update in expectation.
    let n = 512;
    let cfg = AdamConfig::default();
    let s = cfg.scalars(1, 1e-5, 1.0).unwrap();
    let (p0, _, g) = setup(n, 3);
    let mut pf: Vec<f32> = p0.iter().map(|b| b.to_f32()).collect();
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    adam_step(
        Isa::Scalar,
        &s,
        StateIo::InPlace { p: &mut pf, m: &mut m, v: &mut v },
        GradSlice::F32(&g),
        CopyOut::None,
    )
    .unwrap();
    let seeds = 4000;
    let mut sum = vec![0.0f64; n];
    for seed in 0..seeds {
        let mut p = p0.clone();
        let mut mom = MomentBufs::zeros(StateDType::F32, n);
        let key = sr_key(seed, 1);
        adam_step_bf16_master(Isa::detect(), &s, &mut p, mom.view(), GradSlice::F32(&g), CopyOut::None, key, 0)
            .unwrap();
        sum.iter_mut().zip(&p).for_each(|(a, b)| *a += b.to_f64());
    }
    let mut moved = 0;
    for i in 0..n {
        let mean = sum[i] / seeds as f64;
        let ulp = (bf16::from_bits(p0[i].to_bits() + 1).to_f64() - p0[i].to_f64()).abs();
        // Each draw is one of two bf16 an ulp apart: σ ≤ ulp/2.
        let bound = 5.0 * ulp / 2.0 / (seeds as f64).sqrt() + 1e-12;
        assert!((mean - pf[i] as f64).abs() <= bound, "element {i}: mean {mean} vs f32 update {}", pf[i]);
        moved += (mean != p0[i].to_f64()) as usize;
    }
    assert!(moved > n * 9 / 10, "stochastic rounding moved only {moved} of {n} weights");
}

#[test]
fn any_thread_cut_gives_the_same_bits() {
    let n = 3 * NORM_BLOCK + 1000;
    let s = AdamConfig::default().scalars(2, 1e-3, 1.0).unwrap();
    let run = |threads: usize, sumsq: bool| {
        let (mut p, _, g) = setup(n, 5);
        let mut mom = MomentBufs::zeros(StateDType::Int8, n);
        let k = AdamKernel::new(Isa::detect(), threads).unwrap();
        let mut part = vec![0.0f64; n.div_ceil(NORM_BLOCK)];
        let partials = sumsq.then_some(&mut part[..]);
        let ss = k.step_bf16_master(&s, &mut p, mom.view(), GradSlice::F32(&g), CopyOut::None, 42, partials).unwrap();
        (p, mom, ss)
    };
    let one = run(1, true);
    for threads in [2, 3] {
        let other = run(threads, true);
        assert!(other.0 == one.0 && other.1 == one.1, "{threads} threads");
        assert_eq!(other.2.to_bits(), one.2.to_bits());
    }
    assert!(run(2, false).0 == one.0);
}
