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

/// Parameters homed on NVMe with a host tier of half the model and a device that holds about
/// one unit: with the host window (NVMe → host ahead of host → device), the units of the next
/// four accesses have their host copy ready far more often than with the device window alone
/// (which reads NVMe only for the unit it brings to the device, when it has room); bytes stay
/// whole.
#[test]
fn two_level_prefetch_brings_nvme_homed_units_to_the_host_ahead() {
    use oogc_swapper::host::size_class;
    use oogc_swapper::{NvmeConfig, NvmeStore};
    let sizes = unit_sizes();
    let classes: u64 = sizes.iter().map(|&b| size_class(b as usize) as u64).sum();
    let total: u64 = sizes.iter().sum();
    let run = |host_depth: usize| -> (u64, u64, u64) {
        let dir = tempfile::tempdir().unwrap();
        let store = NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 4 * total + (8 << 20))).unwrap();
        let budget = total / 5;
        let dev =
            Device::Sim(SimDevice::new(SimDeviceConfig { capacity_bytes: budget, ..Default::default() }).unwrap());
        let cfg = ResidencyConfig {
            device_budget_bytes: Some(budget),
            host_budget_bytes: classes / 2,
            lock_host_memory: false,
            prefetch_threads: 1,
            ..ResidencyConfig::default()
        };
        let m = ResidencyManager::new(dev, Some(Arc::new(store)), cfg, Box::new(LruPolicy)).unwrap();
        for (i, &b) in sizes.iter().enumerate() {
            let meta = TensorMeta::new(TensorId(i as u64), format!("unit.{i}"), &[b as usize], DType::U8, Tier::Nvme);
            m.register(meta, &vec![i as u8; b as usize]).unwrap();
            m.drop_host_copy(TensorId(i as u64)).unwrap();
        }
        let n = sizes.len() as u64;
        let mut rec = TraceRecorder::new();
        // One step to record: forward, then backward with the optimizer's overwrite.
        let mut misses = 0;
        let mut version = 0u8;
        let mut one_step = |rec: Option<&mut TraceRecorder>, driver: Option<&mut PrefetchDriver>, misses: &mut u64| {
            let (mut rec, mut driver) = (rec, driver);
            version = version.wrapping_add(1);
            let order: Vec<(u64, Phase)> =
                (0..n).map(|u| (u, Phase::Forward)).chain((0..n).rev().map(|u| (u, Phase::Backward))).collect();
            for (u, phase) in order {
                let id = TensorId(u);
                let g = m.acquire(id, Tier::Device, Access::Read).unwrap();
                if let Some(r) = rec.as_deref_mut() {
                    r.acquire(id, sizes[u as usize], phase, Tier::Device, false);
                }
                if let Some(d) = driver.as_deref_mut() {
                    d.after_acquire(&m, &|_| false).unwrap();
                    d.wait_all().unwrap();
                    // How far ahead the host tier is ready: of the next 4 accesses' units, those
                    // without a host copy.
                    let s = d.cursor().schedule();
                    let pos = d.cursor().position();
                    for k in 1..=4 {
                        if !m.residency(s.device_unit(pos + k)).unwrap().host {
                            *misses += 1;
                        }
                    }
                }
                drop(g);
                if let Some(r) = rec.as_deref_mut() {
                    r.release(id, Tier::Device);
                }
                if phase == Phase::Backward {
                    let g = m.acquire(id, Tier::Host, Access::Overwrite).unwrap();
                    g.host_bytes_mut().fill(u as u8 ^ version);
                    drop(g);
                    if let Some(r) = rec.as_deref_mut() {
                        r.acquire(id, sizes[u as usize], Phase::Optimizer, Tier::Host, true);
                        r.release(id, Tier::Host);
                    }
                }
            }
        };
        one_step(Some(&mut rec), None, &mut misses);
        let schedule = Arc::new(rec.finish().unwrap());
        let policy = NextUsePolicy::new(schedule.clone());
        let cursor = policy.cursor();
        let config = PrefetchConfig { max_depth: 2, ..PrefetchConfig::default() };
        let mut driver = PrefetchDriver::new(&m, cursor.clone(), config).unwrap().with_host_depth(host_depth).unwrap();
        m.set_policy(Box::new(policy));
        one_step(None, Some(&mut driver), &mut misses);
        misses = 0;
        for _ in 0..2 {
            one_step(None, Some(&mut driver), &mut misses);
            m.check_invariants().unwrap();
        }
        assert_eq!(cursor.mismatches(), 0);
        for u in 0..n {
            let want = u as u8 ^ version;
            assert!(m.read_to_vec(TensorId(u)).unwrap().iter().all(|&x| x == want), "unit {u}");
        }
        (misses, driver.issued_host(), m.metrics().nvme_read.bytes)
    };
    let (misses_device_only, issued_none, _) = run(0);
    let (misses_two_level, issued_host, _) = run(4);
    eprintln!(
        "next-4 units without a host copy: {misses_device_only} device window only, {misses_two_level} two-level"
    );
    assert_eq!(issued_none, 0);
    assert!(issued_host > 0);
    assert!(misses_two_level * 2 < misses_device_only, "{misses_two_level} vs {misses_device_only}");
}

/// The host window plans in pool size classes and never over a host copy needed no later than
/// the unit it fetches.
#[test]
fn the_host_window_never_evicts_a_copy_needed_sooner() {
    use oogc_prefetch::{CopyView, Prefetcher, ResidentView, TierSnapshot};
    use oogc_swapper::host::size_class;
    let ids: Vec<_> = (0..8u64).map(|i| (TensorId(i), 10_000)).collect();
    let schedule = Arc::new(Schedule::training_step(&ids, true).unwrap());
    let class = size_class(10_000) as u64;
    let mut policy = NextUsePolicy::new(schedule.clone());
    use oogc_swapper::EvictionPolicy;
    for (c, u) in [0u64, 1, 2].into_iter().enumerate() {
        policy.on_acquire(TensorId(u), Tier::Device, c as u64 + 1, false);
    }
    let position = policy.cursor().position();
    let view = |id: u64| ResidentView {
        id: TensorId(id),
        num_bytes: class,
        state: CopyView::Ready,
        pinned: id == 2,
        last_use: 0,
        dirty: false,
    };
    // Host copies of 0, 1 (next used in the backward) and 2 (in use); room for one more.
    let snapshot = TierSnapshot {
        budget_bytes: 4 * class,
        used_bytes: 3 * class,
        copies: vec![view(0), view(1), view(2)],
        clock: 0,
    };
    let p = Prefetcher::new(PrefetchConfig { max_depth: 4, ..PrefetchConfig::default() }).unwrap();
    let plan = p.plan_tier(Tier::Host, &schedule, position, &snapshot, &policy, &|_| false);
    for &(unit, bytes, distance) in &plan.fetch {
        assert_eq!(bytes, class);
        for v in &plan.evict {
            let next = schedule.next_use_distance(*v, position).unwrap();
            assert!(next > distance, "evicts {v:?} (next use {next}) to fetch {unit:?} at {distance}");
        }
    }
    let fetched: Vec<u64> = plan.fetch.iter().map(|f| f.0 .0).collect();
    assert_eq!(&fetched[..2], &[3, 4], "{plan:?}");
}
