//! Device optimizers (`runtime/device_optim.rs`): units whose master weights and Adam state live
//! on the device, updated there. Oracles: the plain in-memory loop with the CPU kernel for every
//! unit (`tests/reference`), within a stated tolerance (the device update is torch's formula in
//! candle ops, not the CPU kernel's FMA order); moving state between the tiers is bitwise; a
//! resumed run continues bitwise.

use crate::common;
use crate::reference;

use oogc::config::{DeviceUnits, TrainConfig};
use oogc::runtime::Phase;
use oogc::runtime::{OptimizerPlace, Runtime, RuntimeConfig};
use oogc::train::Trainer;

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
    t.model().units().iter().take(k).map(|u| oogc::runtime::device_optimizer_bytes(u.numel, dtype)).sum()
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
