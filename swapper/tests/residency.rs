//! The residency manager on the sim device: bytes round-trip, budgets hold, pins are respected,
//! and a randomized concurrent workload keeps every invariant.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oogc_swapper::{
    Access, DType, Device, Error, LruPolicy, ResidencyConfig, ResidencyManager, SimDevice, SimDeviceConfig, TensorId,
    TensorMeta, Tier,
};
use proptest::prelude::*;

fn manager(device_bytes: u64, host_bytes: u64) -> ResidencyManager {
    manager_with(device_bytes, host_bytes, true)
}

/// A manager whose sim device counts no host wait as ordering compute after an H2D (as the
/// runtime's): every compute access below is ordered by the fetch's event or reported.
fn manager_with(device_bytes: u64, host_bytes: u64, compute_waits_for_fetch: bool) -> ResidencyManager {
    let dev = SimDevice::new(SimDeviceConfig {
        capacity_bytes: device_bytes,
        host_wait_orders_compute: false,
        ..Default::default()
    })
    .unwrap();
    ResidencyManager::new(
        Device::Sim(dev),
        None,
        ResidencyConfig {
            host_budget_bytes: host_bytes,
            lock_host_memory: false,
            wait_timeout: Duration::from_secs(20),
            compute_waits_for_fetch,
            ..Default::default()
        },
        Box::new(LruPolicy),
    )
    .unwrap()
}

/// A fetched copy reaches compute through the H2D's event, which pinning it makes compute wait
/// for (no host wait): without that wait the sim device's checker reports the first compute
/// access, naming the hazard. A prefetched copy is ordered the same way when it is pinned.
#[test]
fn a_fetch_reaches_compute_through_its_copy_event() {
    for waits in [true, false] {
        let m = manager_with(1 << 20, 16 << 20, waits);
        let data = pattern(9, 0, 4096);
        m.register(meta(9, data.len()), &data).unwrap();
        m.register(meta(10, data.len()), &data).unwrap();
        m.prefetch(TensorId(10), Tier::Device).unwrap().wait().unwrap();
        for id in [9, 10] {
            let g = m.acquire(TensorId(id), Tier::Device, Access::Read).unwrap();
            let got = g.device_buffer().as_sim().unwrap().compute_read().map(<[u8]>::to_vec);
            match (waits, got) {
                (true, Ok(bytes)) => assert_eq!(bytes, data),
                (false, Err(Error::Ordering { hazard, .. })) => {
                    assert_eq!(hazard, oogc_swapper::OrderingHazard::ComputeBeforeHtod)
                }
                (w, r) => panic!("compute_waits_for_fetch {w}: {r:?}"),
            }
        }
        assert_eq!(m.check_invariants().is_ok(), waits);
    }
}

fn meta(id: u64, bytes: usize) -> TensorMeta {
    TensorMeta::new(TensorId(id), format!("t{id}"), &[bytes], DType::U8, Tier::Host)
}

fn pattern(id: u64, version: u8, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i as u64 * 31 + id * 7 + version as u64) as u8).collect()
}

/// A tiny deterministic generator (splitmix64) for the randomized workload.
struct SplitMix(u64);

impl SplitMix {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

fn device_bytes(g: &oogc_swapper::Resident) -> Vec<u8> {
    g.device_buffer().as_sim().unwrap().compute_read().unwrap().to_vec()
}

#[test]
fn device_copy_matches_host_and_writes_come_back() {
    let m = manager(1 << 20, 16 << 20);
    let data = pattern(1, 0, 300_001);
    m.register(meta(1, data.len()), &data).unwrap();
    {
        let g = m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap();
        assert_eq!(device_bytes(&g), data);
    }
    let new = pattern(1, 9, data.len());
    {
        let g = m.acquire(TensorId(1), Tier::Device, Access::Write).unwrap();
        g.device_buffer_mut().as_sim_mut().unwrap().compute_write().unwrap().copy_from_slice(&new);
    }
    assert!(m.residency(TensorId(1)).unwrap().device_dirty);
    assert_eq!(m.read_to_vec(TensorId(1)).unwrap(), new, "host acquire must copy the dirty device copy back");
    let info = m.residency(TensorId(1)).unwrap();
    assert!(info.device && !info.device_dirty);
    assert!(m.metrics().dtoh.bytes >= data.len() as u64);
    m.check_invariants().unwrap();
}

#[test]
fn host_write_drops_the_stale_device_copy() {
    let m = manager(1 << 20, 16 << 20);
    let data = pattern(2, 0, 5000);
    m.register(meta(2, data.len()), &data).unwrap();
    drop(m.acquire(TensorId(2), Tier::Device, Access::Read).unwrap());
    let new = pattern(2, 3, data.len());
    m.acquire(TensorId(2), Tier::Host, Access::Write).unwrap().host_bytes_mut().copy_from_slice(&new);
    assert!(!m.residency(TensorId(2)).unwrap().device);
    let g = m.acquire(TensorId(2), Tier::Device, Access::Read).unwrap();
    assert_eq!(device_bytes(&g), new);
}

#[test]
fn eviction_keeps_the_device_under_budget_and_dirty_copies_survive() {
    // Room for 3 of 8 tensors on the device.
    let size = 100_000;
    let m = manager(3 * size as u64, 64 << 20);
    for id in 0..8 {
        m.register(meta(id, size), &pattern(id, 0, size)).unwrap();
    }
    for round in 1..4u8 {
        for id in 0..8 {
            let g = m.acquire(TensorId(id), Tier::Device, Access::Write).unwrap();
            let mut buf = g.device_buffer_mut();
            let s = buf.as_sim_mut().unwrap().compute_write().unwrap();
            assert_eq!(s, &pattern(id, round - 1, size)[..], "tensor {id} round {round}");
            s.copy_from_slice(&pattern(id, round, size));
            drop(buf);
            assert!(m.used_bytes(Tier::Device) <= m.budget_bytes(Tier::Device));
            m.check_invariants().unwrap();
        }
    }
    for id in 0..8 {
        assert_eq!(m.read_to_vec(TensorId(id)).unwrap(), pattern(id, 3, size));
    }
    let mt = m.metrics();
    assert!(mt.evictions >= 8 * 3 - 3, "evictions {}", mt.evictions);
    assert!(mt.dtoh.bytes >= ((8 * 3 - 3) * size) as u64);
}

#[test]
fn pinned_tensors_are_never_evicted_and_an_impossible_request_fails_at_once() {
    let size = 1000;
    let m = manager(2 * size as u64, 1 << 20);
    for id in 0..3 {
        m.register(meta(id, size), &pattern(id, 0, size)).unwrap();
    }
    let a = m.acquire(TensorId(0), Tier::Device, Access::Read).unwrap();
    let b = m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap();
    match m.acquire(TensorId(2), Tier::Device, Access::Read) {
        Err(Error::OutOfMemory { tier: Tier::Device, requested_bytes, .. }) => assert_eq!(requested_bytes, size as u64),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(m.residency(TensorId(0)).unwrap().device && m.residency(TensorId(1)).unwrap().device);
    drop(a);
    let c = m.acquire(TensorId(2), Tier::Device, Access::Read).unwrap();
    assert!(!m.residency(TensorId(0)).unwrap().device, "the unpinned one goes");
    assert!(m.residency(TensorId(1)).unwrap().device);
    drop((b, c));
    m.check_invariants().unwrap();
}

#[test]
fn budgets_smaller_than_one_tensor_are_out_of_memory_errors() {
    let m = manager(1000, 1 << 20);
    m.register(meta(1, 4000), &pattern(1, 0, 4000)).unwrap();
    let e = m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap_err();
    assert!(
        matches!(e, Error::OutOfMemory { tier: Tier::Device, requested_bytes: 4000, available_bytes: 1000 }),
        "{e:?}"
    );
    assert!(e.to_string().contains("raise the device budget"), "{e}");
    let e = m.register(meta(2, 2 << 20), &vec![0; 2 << 20]).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { tier: Tier::Host, .. }), "{e:?}");
}

#[test]
fn bad_requests_name_their_cause() {
    let m = manager(1 << 20, 1 << 20);
    assert!(matches!(m.acquire(TensorId(9), Tier::Host, Access::Read), Err(Error::UnknownTensor(TensorId(9)))));
    m.register(meta(1, 10), &[0; 10]).unwrap();
    assert!(matches!(m.register(meta(1, 10), &[0; 10]), Err(Error::DuplicateTensor(TensorId(1)))));
    assert!(matches!(m.register(meta(2, 10), &[0; 9]), Err(Error::InvalidRequest(_))));
    let nvme = TensorMeta::new(TensorId(3), "x", &[10], DType::U8, Tier::Nvme);
    let e = m.register(nvme, &[0; 10]).unwrap_err();
    assert!(e.to_string().contains("no NVMe store"), "{e}");
    assert!(matches!(m.acquire(TensorId(1), Tier::Nvme, Access::Read), Err(Error::InvalidRequest(_))));
}

#[test]
fn prefetch_brings_the_tensor_and_the_acquire_is_a_hit() {
    let m = manager(1 << 20, 16 << 20);
    m.register(meta(1, 70_000), &pattern(1, 0, 70_000)).unwrap();
    m.prefetch(TensorId(1), Tier::Device).unwrap().wait().unwrap();
    assert!(m.residency(TensorId(1)).unwrap().device);
    let before = m.metrics();
    let g = m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap();
    assert_eq!(device_bytes(&g), pattern(1, 0, 70_000));
    let after = m.metrics();
    assert_eq!(after.prefetch_hits, before.prefetch_hits + 1);
    assert_eq!(after.htod.bytes, 70_000, "one copy only");
}

/// Threads acquire, write, prefetch and release at random; each thread writes only its own
/// tensors (so the final bytes are known) but reads everyone's. Budgets must hold at every check,
/// no pinned copy may vanish, and every copy read must be whole (one version throughout).
#[test]
fn randomized_concurrent_workload_keeps_every_invariant() {
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 4;
    let size = 64 * 1024;
    let m = Arc::new(manager(5 * size as u64, 12 * size as u64 + (1 << 20)));
    for id in 0..THREADS * PER_THREAD {
        m.register(meta(id, size), &vec![0u8; size]).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let checker = {
        let (m, stop) = (m.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut checks = 0;
            while !stop.load(Ordering::Relaxed) {
                m.check_invariants().unwrap();
                checks += 1;
                std::thread::yield_now();
            }
            checks
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let m = m.clone();
            std::thread::spawn(move || {
                let mut rng = SplitMix(0x5eed + t);
                let mut versions = vec![0u8; PER_THREAD as usize];
                for _ in 0..300 {
                    let own = rng.below(PER_THREAD);
                    let id = t * PER_THREAD + own;
                    match rng.below(6) {
                        0 | 1 => {
                            let v = versions[own as usize].wrapping_add(1);
                            let g = m.acquire(TensorId(id), Tier::Device, Access::Write).unwrap();
                            g.device_buffer_mut().as_sim_mut().unwrap().compute_write().unwrap().fill(v);
                            versions[own as usize] = v;
                        }
                        2 => {
                            let v = versions[own as usize].wrapping_add(1);
                            let g = m.acquire(TensorId(id), Tier::Host, Access::Write).unwrap();
                            g.host_bytes_mut().fill(v);
                            versions[own as usize] = v;
                        }
                        3 => {
                            let any = rng.below(THREADS * PER_THREAD);
                            let g = m.acquire(TensorId(any), Tier::Device, Access::Read).unwrap();
                            let b = g.device_buffer();
                            let s = b.as_sim().unwrap().compute_read().unwrap();
                            assert!(s.iter().all(|&x| x == s[0]), "torn device copy of {any}");
                            drop(b);
                            assert!(m.residency(TensorId(any)).unwrap().device, "pinned copy vanished");
                        }
                        4 => {
                            let any = rng.below(THREADS * PER_THREAD);
                            let g = m.acquire(TensorId(any), Tier::Host, Access::Read).unwrap();
                            let s = g.host_bytes();
                            assert!(s.iter().all(|&x| x == s[0]), "torn host copy of {any}");
                        }
                        _ => {
                            let any = rng.below(THREADS * PER_THREAD);
                            let _ = m.prefetch(TensorId(any), Tier::Device).unwrap();
                        }
                    }
                    let own_v = versions[own as usize];
                    let got = m.read_to_vec(TensorId(id)).unwrap();
                    assert!(got.iter().all(|&x| x == own_v), "tensor {id}: expected version {own_v}");
                }
                versions
            })
        })
        .collect();
    let versions: Vec<Vec<u8>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    assert!(checker.join().unwrap() > 0);
    m.check_invariants().unwrap();
    for t in 0..THREADS {
        for k in 0..PER_THREAD {
            let got = m.read_to_vec(TensorId(t * PER_THREAD + k)).unwrap();
            assert!(got.iter().all(|&x| x == versions[t as usize][k as usize]));
        }
    }
    assert!(m.metrics().evictions > 0, "the budget must have forced evictions");
}

/// The manager follows the device's ordering contract: device copies that compute read or wrote
/// are written back, evicted clean, dropped by a host write or an overwrite, and removed, each
/// after the compute that used them (the event recorded when the guard dropped), so the sim
/// device's happens-before checker finds nothing (`check_invariants` asks it).
#[test]
fn every_write_back_and_free_is_ordered_after_compute() {
    let size = 10_000;
    let m = manager(2 * size as u64, 16 << 20);
    for id in 0..5 {
        m.register(meta(id, size), &pattern(id, 0, size)).unwrap();
    }
    for round in 0..4u64 {
        for id in 0..5 {
            let write = (id + round) % 2 == 0;
            let g = m.acquire(TensorId(id), Tier::Device, if write { Access::Write } else { Access::Read }).unwrap();
            if write {
                g.device_buffer_mut().as_sim_mut().unwrap().compute_write().unwrap().fill(round as u8);
            } else {
                g.device_buffer().as_sim().unwrap().compute_read().unwrap();
            }
            drop(g);
            m.check_invariants().unwrap();
        }
    }
    // A host write drops a device copy compute read.
    drop(device_bytes(&m.acquire(TensorId(0), Tier::Device, Access::Read).unwrap()));
    m.acquire(TensorId(0), Tier::Host, Access::Write).unwrap().host_bytes_mut().fill(7);
    assert!(!m.residency(TensorId(0)).unwrap().device);
    // An overwrite drops a dirty device copy compute wrote.
    m.acquire(TensorId(1), Tier::Device, Access::Write)
        .unwrap()
        .device_buffer_mut()
        .as_sim_mut()
        .unwrap()
        .compute_write()
        .unwrap()
        .fill(8);
    m.acquire(TensorId(1), Tier::Host, Access::Overwrite).unwrap().host_bytes_mut().fill(9);
    assert!(!m.residency(TensorId(1)).unwrap().device);
    // Removal frees a device copy compute read.
    drop(device_bytes(&m.acquire(TensorId(2), Tier::Device, Access::Read).unwrap()));
    m.remove(TensorId(2)).unwrap();
    m.check_invariants().unwrap();
    assert!(m.device().as_sim().unwrap().ordering_violations().is_empty());
    assert_eq!(device_bytes(&m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap()), vec![9; size]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random sizes round-trip host → device → host through the residency manager.
    #[test]
    fn random_sizes_round_trip_through_the_device(sizes in proptest::collection::vec(1usize..300_000, 1..6)) {
        let m = manager(400_000, 64 << 20);
        for (i, &n) in sizes.iter().enumerate() {
            m.register(meta(i as u64, n), &pattern(i as u64, 1, n)).unwrap();
        }
        for (i, &n) in sizes.iter().enumerate() {
            let g = m.acquire(TensorId(i as u64), Tier::Device, Access::Write).unwrap();
            let mut b = g.device_buffer_mut();
            let s = b.as_sim_mut().unwrap().compute_write().unwrap();
            prop_assert_eq!(&*s, &pattern(i as u64, 1, n)[..]);
            s.copy_from_slice(&pattern(i as u64, 2, n));
        }
        for (i, &n) in sizes.iter().enumerate() {
            prop_assert_eq!(m.read_to_vec(TensorId(i as u64)).unwrap(), pattern(i as u64, 2, n));
        }
        m.check_invariants().unwrap();
    }
}

#[test]
fn a_lowered_device_budget_holds_and_peaks_are_tracked() {
    let m = manager(1 << 20, 16 << 20);
    for id in 0..3 {
        m.register(meta(id, 300_000), &pattern(id, 0, 300_000)).unwrap();
    }
    // Room for two tensors of 300 kB once the budget drops to 700 kB; the caller keeps the rest.
    m.set_device_budget_bytes(700_000).unwrap();
    for id in 0..3 {
        drop(m.acquire(TensorId(id), Tier::Device, Access::Read).unwrap());
    }
    assert!(m.used_bytes(Tier::Device) <= 700_000);
    assert!(m.peak_bytes(Tier::Device) <= 700_000 && m.peak_bytes(Tier::Device) >= 300_000);
    m.check_invariants().unwrap();
    // Lowered below what is held: unpinned copies are evicted until the rest fits, a dirty one
    // written back first.
    {
        let g = m.acquire(TensorId(2), Tier::Device, Access::Write).unwrap();
        g.device_buffer_mut().as_sim_mut().unwrap().compute_write().unwrap().copy_from_slice(&pattern(2, 1, 300_000));
    }
    assert!(m.used_bytes(Tier::Device) > 300_000, "{}", m.used_bytes(Tier::Device));
    m.set_device_budget_bytes(300_000).unwrap();
    assert!(m.used_bytes(Tier::Device) <= 300_000, "{}", m.used_bytes(Tier::Device));
    assert_eq!(m.read_to_vec(TensorId(2)).unwrap(), pattern(2, 1, 300_000));
    m.check_invariants().unwrap();
    m.set_device_budget_bytes(700_000).unwrap();
    // Two pinned tensors fill the budget: it cannot go below what they hold (and stays as it
    // was), nor above capacity.
    let _a = m.acquire(TensorId(0), Tier::Device, Access::Read).unwrap();
    let _b = m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap();
    assert!(matches!(m.set_device_budget_bytes(100_000), Err(Error::OutOfMemory { tier: Tier::Device, .. })));
    assert_eq!(m.budget_bytes(Tier::Device), 700_000);
    assert!(matches!(m.set_device_budget_bytes(2 << 20), Err(Error::Config { .. })));
    m.reset_peak_bytes();
    assert_eq!(m.peak_bytes(Tier::Device), m.used_bytes(Tier::Device));
}

/// A fetch set loaded with `load_device_batch` is one H2D operation for all its bytes (the link
/// stats' ops), not one per tensor; each copy then reaches compute through its own event, with
/// its bytes, and the acquires that pin them move nothing more. A device budget that holds only
/// some of the set ends the batch there (nothing waits), and the rest come by their own acquire.
#[test]
fn a_fetch_set_is_one_batched_htod_that_the_acquires_only_pin() {
    let n = 8u64;
    let bytes = 4096;
    for (device, batched) in [(1 << 20, n), (5 * bytes as u64, 5)] {
        let m = manager(device, 16 << 20);
        for id in 0..n {
            m.register(meta(id, bytes), &pattern(id, 1, bytes)).unwrap();
        }
        let ids: Vec<TensorId> = (0..n).map(TensorId).collect();
        let before = m.metrics().htod;
        assert_eq!(m.load_device_batch(&ids).unwrap() as u64, batched);
        let after = m.metrics().htod;
        assert_eq!(after.ops - before.ops, 1, "one H2D operation for the set");
        assert_eq!(after.bytes - before.bytes, batched * bytes as u64);
        for id in 0..batched {
            let g = m.acquire(TensorId(id), Tier::Device, Access::Read).unwrap();
            assert_eq!(device_bytes(&g), pattern(id, 1, bytes), "tensor {id}");
        }
        assert_eq!(m.metrics().htod.ops, after.ops, "the batch's copies are pinned, not fetched again");
        for id in batched..n {
            let g = m.acquire(TensorId(id), Tier::Device, Access::Read).unwrap();
            assert_eq!(device_bytes(&g), pattern(id, 1, bytes), "tensor {id}");
        }
        assert_eq!(m.metrics().htod.ops, after.ops + (n - batched), "the rest one by one");
        // Loaded copies are skipped: nothing to move is no operation.
        let before = m.metrics().htod;
        let on_device: Vec<TensorId> = ids.iter().copied().filter(|&id| m.residency(id).unwrap().device).collect();
        assert_eq!(m.load_device_batch(&on_device).unwrap(), 0);
        assert_eq!(m.metrics().htod.ops, before.ops);
        m.check_invariants().unwrap();
    }
}
