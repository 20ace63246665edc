//! The real swapper (`ResidencyManager` on a `SimDevice`, host-homed units, a device budget)
//! driven by the next-use policy and the prefetch driver moves the bytes the simulator predicts
//! for the same schedule (within 1%). The trace is recorded from a first step under LRU, as the
//! trainer does.

use std::sync::Arc;

use oogc_prefetch::{
    min_working_set, simulate, Error, NextUsePolicy, Phase, PrefetchConfig, PrefetchDriver, Schedule, SimConfig,
    SimUnit, TraceRecorder,
};
use oogc_swapper::{
    Access, DType, Device, LruPolicy, ResidencyConfig, ResidencyManager, SimDevice, SimDeviceConfig, TensorId,
    TensorMeta, Tier,
};

/// 24 units of unequal sizes (a few KiB to ~100 KiB, multiples of 64 B).
fn unit_sizes() -> Vec<u64> {
    (0..24u64).map(|i| if i == 0 || i == 23 { 24 << 10 } else { (48 + (i * 37) % 64) << 10 }).collect()
}

fn manager(budget: u64, total: u64) -> ResidencyManager {
    let dev = Device::Sim(SimDevice::new(SimDeviceConfig { capacity_bytes: budget, ..Default::default() }).unwrap());
    let cfg = ResidencyConfig {
        device_budget_bytes: Some(budget),
        host_budget_bytes: 4 * total + (64 << 20),
        lock_host_memory: false,
        prefetch_threads: 1,
        ..ResidencyConfig::default()
    };
    ResidencyManager::new(dev, None, cfg, Box::new(LruPolicy)).unwrap()
}

fn register(m: &ResidencyManager, sizes: &[u64]) {
    for (i, &b) in sizes.iter().enumerate() {
        let meta = TensorMeta::new(TensorId(i as u64), format!("unit.{i}"), &[b as usize], DType::U8, Tier::Host);
        m.register(meta, &vec![i as u8; b as usize]).unwrap();
    }
}

/// One training step as the trainer runs it; with `rec`, records the trace; with `driver`,
/// issues the window after each device acquire and waits for it (a deterministic order).
fn step(
    m: &ResidencyManager,
    sizes: &[u64],
    mut rec: Option<&mut TraceRecorder>,
    mut driver: Option<&mut PrefetchDriver>,
) {
    let n = sizes.len() as u64;
    let mut device = |u: u64, phase: Phase, rec: &mut Option<&mut TraceRecorder>| {
        let g = m.acquire(TensorId(u), Tier::Device, Access::Read).unwrap();
        if let Some(r) = rec.as_deref_mut() {
            r.acquire(TensorId(u), sizes[u as usize], phase, Tier::Device, false);
        }
        if let Some(d) = driver.as_deref_mut() {
            d.after_acquire(m, &|_| false).unwrap();
            d.wait_all().unwrap();
        }
        drop(g);
        if let Some(r) = rec.as_deref_mut() {
            r.release(TensorId(u), Tier::Device);
        }
    };
    for u in 0..n {
        device(u, Phase::Forward, &mut rec);
    }
    for u in (0..n).rev() {
        device(u, Phase::Backward, &mut rec);
        // The CPU optimizer writes the unit's host copy: the device copy goes stale.
        let g = m.acquire(TensorId(u), Tier::Host, Access::Write).unwrap();
        if let Some(r) = rec.as_deref_mut() {
            r.acquire(TensorId(u), sizes[u as usize], Phase::Optimizer, Tier::Host, true);
            r.release(TensorId(u), Tier::Host);
        }
        drop(g);
    }
}

#[test]
fn real_swapper_moves_what_the_simulator_predicts() {
    let sizes = unit_sizes();
    let total: u64 = sizes.iter().sum();
    for fraction in [0.15, 0.4, 0.75] {
        let budget = (total as f64 * fraction) as u64;
        let m = manager(budget, total);
        register(&m, &sizes);

        let mut rec = TraceRecorder::new();
        step(&m, &sizes, Some(&mut rec), None);
        let schedule = Arc::new(rec.finish().unwrap());
        assert_eq!(schedule.device_len(), 48);
        assert!(min_working_set(&schedule) <= budget);

        let policy = NextUsePolicy::new(schedule.clone());
        let cursor = policy.cursor();
        let mut driver = PrefetchDriver::new(&m, cursor.clone(), PrefetchConfig::default()).unwrap();
        m.set_policy(Box::new(policy));
        let steps = 3;
        let mut before = m.metrics();
        for s in 0..steps {
            if s == steps - 1 {
                before = m.metrics();
            }
            step(&m, &sizes, None, Some(&mut driver));
            m.check_invariants().unwrap();
        }
        let after = m.metrics();
        assert_eq!(cursor.mismatches(), 0, "the policy lost its place in the schedule");
        let real = (after.htod.bytes - before.htod.bytes) + (after.dtoh.bytes - before.dtoh.bytes);

        // The simulator: same schedule, budget, policy and window; compute long enough that
        // each window's fetches land before the next acquire, as `wait_all` makes them here.
        let units: Vec<SimUnit> = sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| SimUnit {
                forward_s: 1e-3,
                backward_s: 2e-3,
                grad_bytes: 0,
                ..SimUnit::bf16(TensorId(i as u64), b)
            })
            .collect();
        let mut cfg = SimConfig::new(budget);
        cfg.steps = steps;
        cfg.optimizer_params_per_s = 1e15;
        let mut sim_policy = NextUsePolicy::new(schedule.clone());
        let predicted = simulate(&schedule, &units, &cfg, &mut sim_policy).unwrap().bytes_moved;
        let ratio = real as f64 / predicted as f64;
        eprintln!(
            "budget {fraction}: real {real} B, simulated {predicted} B ({ratio:.4}), prefetches {}",
            driver.issued()
        );
        assert!((ratio - 1.0).abs() <= 0.01, "budget {fraction}: real {real} B vs simulated {predicted} B");
        assert!(driver.issued() > 0);
    }
}

#[test]
fn a_budget_below_the_working_set_is_refused_before_the_step() {
    let sizes = unit_sizes();
    let total: u64 = sizes.iter().sum();
    let largest = *sizes.iter().max().unwrap();
    let ids: Vec<_> = sizes.iter().enumerate().map(|(i, &b)| (TensorId(i as u64), b)).collect();
    let schedule = Arc::new(Schedule::training_step(&ids, true).unwrap());
    let m = manager(largest - 64, total);
    let e = PrefetchDriver::new(&m, NextUsePolicy::new(schedule).cursor(), PrefetchConfig::default()).unwrap_err();
    assert!(matches!(e, Error::BudgetBelowWorkingSet { min_bytes, .. } if min_bytes == largest), "{e}");
    assert!(e.to_string().contains(&format!("at least {largest} B")), "{e}");
}
