//! Device optimizers (`runtime/device_optim.rs`): units whose master weights and Adam state live
//! on the device, updated there. Oracles: the plain in-memory loop with the CPU kernel for every
//! unit (`tests/reference`), within a stated tolerance (the device update is torch's formula in
//! candle ops, not the CPU kernel's FMA order); with bf16 and int8 moments
//! (`runtime/device_moments.rs`), the CPU optimizer with the same state dtype, within the
//! quantization's bound; moving state between the tiers is bitwise; a resumed run continues
//! bitwise.

use crate::common;
use crate::reference;

use oogc::config::{DeviceUnits, TrainConfig};
use oogc::runtime::Phase;
use oogc::runtime::{OptimizerPlace, Runtime, RuntimeConfig};
use oogc::train::Trainer;
use oogc_optimizer::StateDType;

/// Relative tolerance on the losses of 20 steps against the all-CPU reference, and on the
/// parameters (with [`PARAM_ABS`]): a few f32 ulps per update, compounded by Adam's division by
/// `√v` over 20 steps.
const LOSS_REL: f64 = 1e-4;
const PARAM_REL: f64 = 1e-3;
const PARAM_ABS: f64 = 1e-5;

/// Largest `|a − b| / (PARAM_ABS + PARAM_REL · |b|)` over two runs' parameters, with where.
fn param_excess(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for (u, (a, b)) in a.iter().zip(b).enumerate() {
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            let e = (x as f64 - y as f64).abs() / (PARAM_ABS + PARAM_REL * (y as f64).abs());
            if e > worst.0 || e.is_nan() {
                worst = (e, format!("unit {u} [{i}]: {x} vs {y}"));
            }
        }
    }
    worst
}

/// GPU bytes of the device optimizers of `cfg`'s model's first `k` units (the order
/// `device_units` places them in for a Llama: the embedding, then the blocks).
fn device_bytes(cfg: &TrainConfig, k: usize) -> u64 {
    let t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let dtype = cfg.train.compute_dtype.dtype();
    let state = cfg.optimizer.state_dtype;
    t.model().units().iter().take(k).map(|u| oogc::runtime::device_optimizer_bytes(u.numel, dtype, state)).sum()
}

fn assert_close_to_reference(cfg: &TrainConfig, losses: &[f64], params: &[Vec<f32>], what: &str) {
    let reference = reference::train(cfg, losses.len() as u64);
    for (s, (a, b)) in losses.iter().zip(&reference.losses).enumerate() {
        assert!((a - b).abs() <= LOSS_REL * b.abs(), "{what}: step {}: loss {a} vs all-CPU {b}", s + 1);
    }
    let (excess, at) = param_excess(params, &reference.params);
    let loss_rel = losses.iter().zip(&reference.losses).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
    eprintln!("{what}: largest loss difference {loss_rel:.2e} relative; parameters at {excess:.2e} of the tolerance");
    assert!(excess <= 1.0, "{what}: parameters differ beyond tolerance ({excess:.2}×) at {at}");
    assert!(losses[losses.len() - 1] < losses[0], "{what}: loss should fall: {losses:?}");
}

#[test]
fn a_llama_with_device_optimizers_tracks_the_all_cpu_run() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, _) = common::offloaded_tiny_llama(dir.path(), oogc::config::ComputeDType::F32);
    // Room for three units' device optimizers beside the offloaded rest.
    cfg.budgets.gpu = bytesize::ByteSize::b(cfg.budgets.gpu.as_u64() + device_bytes(&cfg, 3));
    cfg.optimizer.device_units = DeviceUnits::Count(3);
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let rt = t.runtime();
    let placed: Vec<usize> = rt
        .units()
        .ids()
        .filter(|&u| rt.units().optimizer_place(u) == OptimizerPlace::Device)
        .map(|u| u.index())
        .collect();
    // The embedding (the backward's last unit), then the first two blocks.
    assert_eq!(placed, vec![0, 1, 2]);
    assert!(rt.memory().device_optimizer_bytes() > 0);
    let mut losses = Vec::new();
    let mut clipped = 0;
    for _ in 0..20 {
        let out = t.train_step().unwrap();
        clipped += (out.stats.figures.clip_scale < 1.0) as usize;
        losses.push(out.loss);
    }
    assert!(clipped > 0, "the clip scale reaches the device updates too (clip_norm 0.5)");
    let params = t.master_weights().unwrap();
    assert_close_to_reference(&cfg, &losses, &params, "device_units = 3");
}

#[test]
fn a_bf16_llama_with_device_optimizers_tracks_the_all_cpu_run() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, copy_bytes) = common::offloaded_tiny_llama(dir.path(), oogc::config::ComputeDType::Bf16);
    // "auto" takes the spare budget only: none while the compute copies do not all fit.
    cfg.optimizer.device_units = DeviceUnits::Auto(oogc::config::AutoKeyword::Auto);
    assert!(
        Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap().runtime().memory().device_optimizer_bytes()
            == 0
    );
    // Every compute copy (and staging) with room to spare for two units' optimizers.
    cfg.budgets.gpu = bytesize::ByteSize::b(2 * copy_bytes + device_bytes(&cfg, 2));
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let units = t.runtime().units();
    let on_device = units.ids().filter(|&u| units.optimizer_place(u) == OptimizerPlace::Device).count();
    assert!(on_device >= 2 && on_device < t.runtime().units().len(), "auto placed {on_device} units");
    let losses: Vec<f64> = (0..12).map(|_| t.train_step().unwrap().loss).collect();
    let params = t.master_weights().unwrap();
    // bf16 compute copies round the same master weights to the same copies (within the
    // device update's ulps): the same tolerance as f32.
    assert_close_to_reference(&cfg, &losses, &params, "bf16, device_units = auto");
}

#[test]
fn too_many_device_units_are_refused_with_the_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, _) = common::offloaded_tiny_llama(dir.path(), oogc::config::ComputeDType::F32);
    cfg.optimizer.device_units = DeviceUnits::Count(8);
    let err = Trainer::new(cfg, oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains("GPU bytes") && err.contains("[budgets] gpu"), "{err}");
}

#[test]
fn a_resumed_run_with_device_optimizers_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = |name: &str| {
        let (mut cfg, _) = common::offloaded_tiny_llama(&dir.path().join(name), oogc::config::ComputeDType::F32);
        cfg.budgets.gpu = bytesize::ByteSize::b(cfg.budgets.gpu.as_u64() + device_bytes(&cfg, 2));
        cfg.optimizer.device_units = DeviceUnits::Count(2);
        cfg.checkpoint.dir = Some(dir.path().join(name).join("ckpt"));
        cfg
    };
    common::assert_resume_continues_exactly(&config);
}

/// The same with int8 moments: the checkpoint saves the device units' codes and absmaxes as
/// stored (the layout of a host unit's), and the resumed run places them on the device again
/// and continues bitwise.
#[test]
fn a_resumed_run_with_int8_device_optimizers_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = |name: &str| {
        let (mut cfg, _) = common::offloaded_tiny_llama(&dir.path().join(name), oogc::config::ComputeDType::F32);
        cfg.optimizer.state_dtype = StateDType::Int8;
        cfg.budgets.gpu = bytesize::ByteSize::b(cfg.budgets.gpu.as_u64() + device_bytes(&cfg, 2));
        cfg.optimizer.device_units = DeviceUnits::Count(2);
        cfg.checkpoint.dir = Some(dir.path().join(name).join("ckpt"));
        cfg
    };
    common::assert_resume_continues_exactly(&config);
}

/// A sim runtime of `cfg` with one unit per entry of `sizes` (parameters), master weights from
/// a fixed pattern.
fn runtime_with_units(cfg: RuntimeConfig, sizes: &[usize]) -> Runtime {
    let mut rt = Runtime::new(cfg, oogc::dist::Ranks::single()).unwrap();
    for (k, &n) in sizes.iter().enumerate() {
        let master: Vec<f32> = (0..n).map(|i| ((i * 7 + k) % 13) as f32 * 0.1 - 0.6).collect();
        rt.add_unit(&format!("u{k}"), &master).unwrap();
    }
    rt
}

/// One step `t` (learning rate 1e-2): every unit's backward, last unit first, pushing
/// `grad(unit, its parameters)`; then the updates are awaited.
fn backward_step(
    rt: &mut Runtime,
    t: u64,
    grad: impl Fn(usize, &candle_core::Tensor) -> candle_core::Tensor,
) -> oogc::runtime::StepStats {
    rt.begin_step(t, 1e-2).unwrap();
    for u in (0..rt.units().len()).rev() {
        let id = rt.units().id(u).unwrap();
        let p = rt.fetch(id, Phase::Backward).unwrap();
        let g = grad(u, p.tensor());
        drop(p);
        rt.push_grads(id, &g).unwrap();
    }
    let stats = rt.finish_step().unwrap();
    rt.sync().unwrap();
    stats
}

/// Every unit's master weights, `m` and `v`.
fn states(rt: &Runtime) -> Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    rt.units().ids().map(|u| rt.unit_state(u).unwrap().into_f32()).collect()
}

fn sine_grads(_unit: usize, p: &candle_core::Tensor) -> candle_core::Tensor {
    (p.sin().unwrap() * 0.3).unwrap()
}

fn without_prefetch() -> RuntimeConfig {
    RuntimeConfig { prefetch_depth: 0, ..RuntimeConfig::sim(1 << 20) }
}

/// Moving a unit's optimizer to the device and back leaves its state bitwise as it was, and the
/// run goes on bitwise as one that never moved it (no step ran while it was on the device).
#[test]
fn re_placement_moves_state_without_changing_it() {
    let run = |round_trip: bool| {
        let mut rt = runtime_with_units(without_prefetch(), &[4099, 2048, 777]);
        let mut after_each = Vec::new();
        for step in 1..=6u64 {
            if round_trip && step == 4 {
                let before = states(&rt);
                let h2d = rt.memory().traffic().htod.bytes;
                assert_eq!(rt.place_optimizer(rt.units().id(1).unwrap(), OptimizerPlace::Device).unwrap(), 12 * 2048);
                assert_eq!(rt.memory().traffic().htod.bytes - h2d, 12 * 2048, "the state moved over the link");
                assert_eq!(
                    rt.unit_state(rt.units().id(1).unwrap()).unwrap().into_f32(),
                    before[1],
                    "on the device, bitwise"
                );
                rt.place_optimizer(rt.units().id(1).unwrap(), OptimizerPlace::Host).unwrap();
                assert_eq!(states(&rt), before, "back on the host, bitwise");
            }
            backward_step(&mut rt, step, sine_grads);
            after_each.push(states(&rt));
        }
        after_each
    };
    assert_eq!(run(true), run(false));
}

/// A unit updated on the device for some steps and moved back: the CPU optimizer takes the
/// device's state bitwise, and the unit's next fetch sees the compute copy of those master
/// weights (the tiers' copy from before it went to the device is gone).
#[test]
fn a_unit_moved_back_computes_with_its_device_updated_parameters() {
    let mut rt = runtime_with_units(without_prefetch(), &[1000, 3000]);
    backward_step(&mut rt, 1, sine_grads);
    let before = rt.unit_state(rt.units().id(0).unwrap()).unwrap().master;
    rt.place_optimizer(rt.units().id(0).unwrap(), OptimizerPlace::Device).unwrap();
    backward_step(&mut rt, 2, sine_grads);
    backward_step(&mut rt, 3, sine_grads);
    let on_device = rt.unit_state(rt.units().id(0).unwrap()).unwrap().into_f32();
    assert_ne!(on_device.0, before, "updated on the device");
    rt.place_optimizer(rt.units().id(0).unwrap(), OptimizerPlace::Host).unwrap();
    assert_eq!(
        rt.unit_state(rt.units().id(0).unwrap()).unwrap().into_f32(),
        on_device,
        "the CPU optimizer took the device's state"
    );
    let p = rt.fetch(rt.units().id(0).unwrap(), Phase::Forward).unwrap();
    assert_eq!(p.tensor().to_vec1::<f32>().unwrap(), on_device.0, "the fetch sees the device-updated parameters");
    drop(p);
    backward_step(&mut rt, 4, sine_grads);
    assert_eq!(rt.memory().device_optimizer_bytes(), 0);
}

/// A unit updated on the device follows the CPU optimizer's run of the same unit within the
/// tolerance, with clipping decided over both optimizers' gradients, and a non-finite gradient
/// on the device skips the step for every unit.
#[test]
fn device_updates_share_the_steps_clip_and_skip() {
    let run = |device: bool, poison_at: Option<u64>| {
        let mut cfg = RuntimeConfig::sim(1 << 20);
        cfg.optimizer.clip_norm = Some(0.05);
        let mut rt = runtime_with_units(cfg, &[3001, 1500]);
        if device {
            rt.place_optimizer(rt.units().id(0).unwrap(), OptimizerPlace::Device).unwrap();
        }
        let mut reports = Vec::new();
        let mut t = 1;
        for step in 1..=5u64 {
            let s = backward_step(&mut rt, t, |u, p| {
                let g = (p.cos().unwrap() * 0.2).unwrap();
                if poison_at == Some(step) && u == 0 {
                    (g / 0.0).unwrap()
                } else {
                    g
                }
            });
            t += u64::from(!s.figures.skipped);
            reports.push((s.figures.skipped, s.figures.clip_scale, s.figures.grad_norm));
        }
        (reports, states(&rt))
    };
    let (cpu, cpu_state) = run(false, None);
    let (dev, dev_state) = run(true, None);
    for ((s0, c0, n0), (s1, c1, n1)) in cpu.iter().zip(&dev) {
        assert!(!s0 && !s1);
        assert!(*c0 < 1.0, "clipped");
        assert!((n0 - n1).abs() <= 1e-5 * n0, "norm {n0} vs {n1}");
        assert!((c0 - c1).abs() <= 1e-5 * c0, "scale {c0} vs {c1}");
    }
    for (a, b) in cpu_state.iter().zip(&dev_state) {
        let (excess, at) = param_excess(&[a.0.clone(), a.1.clone()], &[b.0.clone(), b.1.clone()]);
        assert!(excess <= 1.0, "{excess} at {at}");
    }
    // A NaN in the device unit's gradients at step 3: the step is skipped for both units.
    let (poisoned, _) = run(true, Some(3));
    assert_eq!(poisoned.iter().map(|r| r.0).collect::<Vec<_>>(), [false, false, true, false, false]);
}

/// A tiny Mixtral whose hot experts (the placer's, under `[moe] expert_budget`, counting 16 B
/// per parameter + the compute copy) keep their optimizer on the device: within the tolerance
/// of the all-CPU loop over 20 steps; hot experts really were placed there and moved nothing
/// H2D when used.
#[test]
fn a_mixtral_with_hot_experts_optimized_on_the_device_tracks_the_all_cpu_run() {
    let dir = tempfile::tempdir().unwrap();
    let (nvme, cache) = (dir.path().join("nvme"), dir.path().join("tokens"));
    // A throttled link (as the README's Mixtral run's): residency saves transfer time.
    let text = common::tiny_mixtral(&nvme, &cache, "1MiB", "ours").replace(
        "expert_budget = \"40KiB\"",
        // A given CPU rate: the hot set follows the routing alone, not the machine's load.
        "expert_budget = \"200KiB\"\ndevice_optimizer = true\ncpu_compute = false\ncpu_gflops = 20.0\n[device]\nkind = \"sim\"\nlink_gbps = 0.05",
    );
    let cfg = TrainConfig::from_toml_str(&text).unwrap();
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let (mut losses, mut most, mut hits) = (Vec::new(), 0, 0);
    for _ in 0..20 {
        let out = t.train_step().unwrap();
        losses.push(out.loss);
        most = most.max(t.runtime().memory().device_optimizer_bytes());
        hits += out.expert_traffic.hits;
    }
    // 200 KiB holds two experts of 4,608 parameters with their optimizers (92,160 B each).
    assert_eq!(most, 2 * 92_160, "two hot experts on the device at most");
    assert!(hits > 0, "hot experts were used without a fetch");
    let params = t.master_weights().unwrap();
    assert_close_to_reference(&cfg, &losses, &params, "mixtral, hot experts on the device");
}

/// `[moe] device_optimizer = true` with an expert budget below one expert and its optimizer is
/// refused by name, with the bytes needed.
#[test]
fn an_expert_budget_below_one_device_expert_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (nvme, cache) = (dir.path().join("nvme"), dir.path().join("tokens"));
    let text = common::tiny_mixtral(&nvme, &cache, "1MiB", "ours") + "device_optimizer = true\n";
    let err = Trainer::new(TrainConfig::from_toml_str(&text).unwrap(), oogc::dist::Ranks::single())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("moe.expert_budget") && err.contains("92160"), "{err}");
}

/// A sim runtime of units `sizes` with `[optimizer] state_dtype = dtype`.
fn runtime_with_state(dtype: StateDType, sizes: &[usize]) -> Runtime {
    let mut cfg = without_prefetch();
    cfg.optimizer.state_dtype = dtype;
    runtime_with_units(cfg, sizes)
}

/// Gradients of step `t` that do not depend on the parameters (so two runs see the same ones
/// whatever their updates did): magnitudes over four decades within each block, signs mixed.
fn fixed_grads(t: u64) -> impl Fn(usize, &candle_core::Tensor) -> candle_core::Tensor {
    move |u, p| {
        let n = p.elem_count();
        let g: Vec<f32> = (0..n)
            .map(|i| {
                let x = (i as f32 * 0.37 + t as f32 * 1.3 + u as f32).sin();
                x * 10f32.powi(-((i * 7 % 5) as i32))
            })
            .collect();
        candle_core::Tensor::from_vec(g, n, p.device()).unwrap()
    }
}

/// Per element, the largest `|x|` of its [`oogc_optimizer::QUANT_BLOCK`]-value block.
fn block_absmax(x: &[f32]) -> Vec<f32> {
    x.chunks(oogc_optimizer::QUANT_BLOCK)
        .flat_map(|b| {
            let a = b.iter().fold(0f32, |s, x| s.max(x.abs()));
            std::iter::repeat_n(a, b.len())
        })
        .collect()
}

/// A unit whose optimizer is on the device with bf16 or int8 moments follows the same unit on
/// the CPU optimizer with the same state dtype (gradients independent of the parameters),
/// step by step, within the quantization's bound on `m` and `v`. Each step each run rounds
/// its new moments once, so with `e` the difference of the stored values,
/// `e_t ≤ β·e_(t−1) + r_t(cpu) + r_t(device)` (β = β₁ for `m`, β₂ for `v`, both < 1): the
/// differences stay within the sum of both runs' rounding bounds over the steps. Per rounding:
/// bf16, a relative 2^−8 of the value; int8 `m`, `A/254` (`A` the block's absmax); int8 `v`,
/// half the tree map's largest gap (0.9/256, the top decade's) times `A`. Plus the device
/// update's f32 difference from the CPU kernel's (a relative 1e-5, the fixtures' tolerance).
#[test]
fn reduced_moments_on_the_device_track_the_cpu_optimizer_within_the_codecs_bound() {
    let n = 3 * oogc_optimizer::QUANT_BLOCK + 77;
    for dtype in [StateDType::Bf16, StateDType::Int8] {
        let mut cpu = runtime_with_state(dtype, &[n]);
        let mut dev = runtime_with_state(dtype, &[n]);
        let id = dev.units().id(0).unwrap();
        dev.place_optimizer(id, OptimizerPlace::Device).unwrap();
        // Accumulated rounding bounds per element (`m`, `v`).
        let (mut bm, mut bv) = (vec![0f64; n], vec![0f64; n]);
        let (mut worst_m, mut worst_v, mut differ) = (0f64, 0f64, 0usize);
        let (b1, b2) = (0.9f64, 0.999f64);
        for t in 1..=6u64 {
            backward_step(&mut cpu, t, fixed_grads(t));
            backward_step(&mut dev, t, fixed_grads(t));
            let state = |rt: &Runtime| {
                let s = rt.unit_state(rt.units().id(0).unwrap()).unwrap();
                assert_eq!(s.moments.dtype(), dtype, "the state stays in the run's dtype");
                s.into_f32()
            };
            let ((_, mc, vc), (_, md, vd)) = (state(&cpu), state(&dev));
            let nonzero = |x: &[f32]| x.iter().filter(|x| **x != 0.0).count();
            assert!(nonzero(&mc) > n / 2 && nonzero(&vc) > n / 2, "{dtype}: the moments moved");
            let (amc, avc, amd, avd) = (block_absmax(&mc), block_absmax(&vc), block_absmax(&md), block_absmax(&vd));
            for i in 0..n {
                // Each run's rounding bound, from its own stored values (a stored bf16 is within
                // a relative 2^−8 of the value it rounded).
                let bf = |x: f32| f64::from(x.abs()) / 256.0 * (1.0 + 1.0 / 128.0);
                let (rm, rv) = match dtype {
                    StateDType::Bf16 => (bf(mc[i]) + bf(md[i]), bf(vc[i]) + bf(vd[i])),
                    _ => (f64::from(amc[i] + amd[i]) / 254.0, f64::from(avc[i] + avd[i]) * 0.9 / 256.0),
                };
                // Plus the device update's f32 difference from the CPU kernel's.
                bm[i] = b1 * bm[i] + rm * (1.0 + 1e-5) + 1e-5 * f64::from(mc[i].abs());
                bv[i] = b2 * bv[i] + rv * (1.0 + 1e-5) + 1e-5 * f64::from(vc[i].abs());
                let (em, ev) = (f64::from((md[i] - mc[i]).abs()), f64::from((vd[i] - vc[i]).abs()));
                assert!(
                    em <= bm[i] + 1e-30,
                    "{dtype} step {t} m[{i}]: device {} vs cpu {} (bound {})",
                    md[i],
                    mc[i],
                    bm[i]
                );
                assert!(
                    ev <= bv[i] + 1e-30,
                    "{dtype} step {t} v[{i}]: device {} vs cpu {} (bound {})",
                    vd[i],
                    vc[i],
                    bv[i]
                );
                differ += usize::from(em > 0.0 || ev > 0.0);
                worst_m = worst_m.max(em / bm[i].max(1e-30));
                worst_v = worst_v.max(ev / bv[i].max(1e-30));
            }
        }
        eprintln!(
            "{dtype}: largest difference from the CPU optimizer over 6 steps: m {worst_m:.2e}, v {worst_v:.2e} of the \
             bound; {differ} of the {} (element, step) pairs differ",
            6 * n
        );
    }
}

/// With bf16 and int8 moments a unit's optimizer moved device → host → device leaves its
/// state bitwise as it was (the stored arrays are copied, not re-encoded; the link carries the
/// master weights and the moments' bytes), and the run goes on bitwise as one that kept it on
/// the device.
#[test]
fn reduced_moments_move_between_host_and_device_without_drift() {
    let n = 2 * oogc_optimizer::QUANT_BLOCK + 9;
    for dtype in [StateDType::Bf16, StateDType::Int8] {
        let run = |round_trip: bool| {
            let mut rt = runtime_with_state(dtype, &[n, 700]);
            let id = rt.units().id(0).unwrap();
            backward_step(&mut rt, 1, sine_grads);
            rt.place_optimizer(id, OptimizerPlace::Device).unwrap();
            let mut after = Vec::new();
            for t in 2..=6u64 {
                if round_trip && (t == 4 || t == 5) {
                    let before = rt.unit_state(id).unwrap();
                    assert_eq!(before.moments.dtype(), dtype);
                    let moved = (4 * n + dtype.moment_bytes(n)) as u64;
                    let d2h = rt.memory().traffic().dtoh.bytes;
                    assert_eq!(rt.place_optimizer(id, OptimizerPlace::Host).unwrap(), moved);
                    assert_eq!(rt.memory().traffic().dtoh.bytes - d2h, moved, "the stored bytes crossed the link");
                    assert_eq!(rt.unit_state(id).unwrap(), before, "{dtype}: on the host, bitwise");
                    let h2d = rt.memory().traffic().htod.bytes;
                    assert_eq!(rt.place_optimizer(id, OptimizerPlace::Device).unwrap(), moved);
                    assert_eq!(rt.memory().traffic().htod.bytes - h2d, moved);
                    assert_eq!(rt.unit_state(id).unwrap(), before, "{dtype}: back on the device, bitwise");
                }
                backward_step(&mut rt, t, sine_grads);
                after.push(rt.unit_state(id).unwrap());
            }
            after
        };
        assert_eq!(run(true), run(false), "{dtype}: the moves changed the run");
    }
}

/// The GPU bytes a device-resident unit holds, measured on its tensors (master weights, moments
/// with their absmaxes, compute copy, the step's gradients), equal `device_optimizer_bytes` for
/// its state dtype and are what the runtime carves; bf16 and int8 moments hold fewer than f32.
#[test]
fn device_optimizer_bytes_are_what_the_device_state_holds() {
    let n = 4099; // a ragged last int8 block
    let mut held = Vec::new();
    for dtype in [StateDType::F32, StateDType::Bf16, StateDType::Int8] {
        let mut rt = runtime_with_state(dtype, &[n, 300]);
        let id = rt.units().id(0).unwrap();
        assert_eq!(rt.memory().device_optimizer_held_bytes(id), None);
        rt.place_optimizer(id, OptimizerPlace::Device).unwrap();
        let want = oogc::runtime::device_optimizer_bytes(n, oogc_swapper::DType::F32, dtype);
        assert_eq!(rt.memory().device_optimizer_held_bytes(id), Some(want), "{dtype}: placed");
        assert_eq!(rt.memory().device_optimizer_bytes(), want, "{dtype}: carved");
        backward_step(&mut rt, 1, sine_grads);
        assert_eq!(rt.memory().device_optimizer_held_bytes(id), Some(want), "{dtype}: after an update");
        held.push(want);
    }
    assert!(held[0] > held[1] && held[1] > held[2], "{held:?}");
}

/// The Mixtral hot set with `[moe] device_optimizer = true` and int8 moments: hot experts are
/// placed on the device holding int8 state (the hot set counts their smaller bytes), were used
/// without a fetch, and the run follows the same run with every expert on the CPU optimizer's
/// int8 moments: the loss falls and the two runs' losses agree within the tolerance of the f32
/// device test (the codes differ only where a value lies within f32 rounding of a decision
/// boundary).
#[test]
fn a_mixtral_with_int8_hot_experts_on_the_device_tracks_the_cpu_int8_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = |name: &str, device: bool| {
        let (nvme, cache) = (dir.path().join(name).join("nvme"), dir.path().join("tokens"));
        let text = common::tiny_mixtral(&nvme, &cache, "1MiB", "ours")
            .replace("clip_norm = 0.5", "clip_norm = 0.5\nstate_dtype = \"int8\"")
            .replace(
                "expert_budget = \"40KiB\"",
                &format!(
                    "expert_budget = \"200KiB\"\ndevice_optimizer = {device}\ncpu_compute = false\ncpu_gflops = 20.0\n\
                     [device]\nkind = \"sim\"\nlink_gbps = 0.05"
                ),
            );
        TrainConfig::from_toml_str(&text).unwrap()
    };
    let cfg = config("dev", true);
    assert_eq!(cfg.optimizer.state_dtype, StateDType::Int8);
    let per = oogc::moe::device_expert_bytes(&cfg, 4608);
    assert!(per < 92_160, "int8 moments make a device expert smaller than f32's: {per}");
    let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    let (mut losses, mut most, mut hits) = (Vec::new(), 0, 0);
    for _ in 0..20 {
        let out = t.train_step().unwrap();
        losses.push(out.loss);
        most = most.max(t.runtime().memory().device_optimizer_bytes());
        hits += out.expert_traffic.hits;
        let rt = t.runtime();
        for u in rt.units().ids().filter(|&u| rt.units().optimizer_place(u) == OptimizerPlace::Device) {
            assert_eq!(rt.unit_state(u).unwrap().moments.dtype(), StateDType::Int8);
        }
    }
    assert!(most > 0 && most % per == 0 && most <= 200 * 1024, "hot experts of {per} B each: {most}");
    assert!(hits > 0, "hot experts were used without a fetch");
    // The hot set sizes by the int8 bytes: more experts than f32's 92,160 B each would fit.
    assert!(most / per > 200 * 1024 / 92_160, "{} hot experts at most", most / per);
    let mut cpu = Trainer::new(config("cpu", false), oogc::dist::Ranks::single()).unwrap();
    let cpu_losses: Vec<f64> = (0..20).map(|_| cpu.train_step().unwrap().loss).collect();
    let rel = losses.iter().zip(&cpu_losses).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
    eprintln!("mixtral int8: hot set up to {most} B ({per} B per expert); largest loss difference {rel:.2e}");
    assert!(rel <= LOSS_REL, "losses {losses:?} vs the CPU int8 run's {cpu_losses:?}");
    assert!(losses[19] < losses[0], "{losses:?}");
}
