//! One host budget: the residency manager's host tier claims its pool's memory from a
//! [`HostLedger`] shared with other claimants, and the ledger's total never exceeds the budget
//! under a randomized concurrent workload; an overwrite acquire makes a host copy without
//! reading NVMe; a lowered host share evicts down to it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oogc_swapper::host::size_class;
use oogc_swapper::{
    Access, DType, Device, HostLedger, HostUse, LruPolicy, NvmeConfig, NvmeStore, ResidencyConfig, ResidencyManager,
    SimDevice, SimDeviceConfig, TensorId, TensorMeta, Tier,
};
use proptest::prelude::*;

struct SplitMix(u64);

impl SplitMix {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        (z ^ (z >> 31)) % n
    }
}

fn manager(dir: &std::path::Path, device: u64, host_share: u64, ledger: &Arc<HostLedger>) -> ResidencyManager {
    let store = NvmeStore::open(NvmeConfig::new(vec![dir.to_path_buf()], 64 << 20)).unwrap();
    let dev = SimDevice::new(SimDeviceConfig { capacity_bytes: device, ..Default::default() }).unwrap();
    ResidencyManager::new(
        Device::Sim(dev),
        Some(Arc::new(store)),
        ResidencyConfig {
            host_budget_bytes: host_share,
            host_ledger: Some(ledger.clone()),
            lock_host_memory: false,
            wait_timeout: Duration::from_secs(20),
            ..Default::default()
        },
        Box::new(LruPolicy),
    )
    .unwrap()
}

fn meta(id: u64, bytes: usize) -> TensorMeta {
    TensorMeta::new(TensorId(id), format!("t{id}"), &[bytes], DType::U8, Tier::Nvme)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]
    /// Four threads acquire (read, write, overwrite) on the device and host tiers and prefetch
    /// at random while a fifth claims and releases gradient-like bytes from the same ledger; a
    /// watcher checks the ledger's total against the budget and the host tier's claims against
    /// its share at every turn.
    #[test]
    fn the_host_budget_is_never_exceeded_under_a_random_workload(
        sizes in proptest::collection::vec(4_000usize..200_000, 4..10),
        share_units in 3u64..6,
        other_bytes in 100_000u64..2_000_000,
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let largest = size_class(*sizes.iter().max().unwrap()) as u64;
        let share = share_units * largest;
        let budget = share + other_bytes;
        let ledger = HostLedger::new(budget);
        let m = Arc::new(manager(dir.path(), 3 * largest, share, &ledger));
        for (i, &n) in sizes.iter().enumerate() {
            m.register(meta(i as u64, n), &vec![i as u8; n]).unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (m, ledger, stop) = (m.clone(), ledger.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut checks = 0u64;
                loop {
                    let r = ledger.report();
                    assert!(r.used_bytes <= budget, "ledger {} > budget {budget}", r.used_bytes);
                    assert!(r.of(HostUse::ComputeCopies).used_bytes <= share, "host tier over its share");
                    m.check_invariants().unwrap();
                    checks += 1;
                    if stop.load(Ordering::Relaxed) {
                        break checks;
                    }
                    std::thread::yield_now();
                }
            })
        };
        let other = {
            let (ledger, stop) = (ledger.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = SplitMix(seed ^ 0xabcd);
                let mut held = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if rng.below(2) == 0 || held.is_empty() {
                        // Claims within what the plan left this category: never refused.
                        let bytes = rng.below(other_bytes / 4 + 1);
                        if held.iter().map(|c: &oogc_swapper::HostClaim| c.num_bytes()).sum::<u64>() + bytes <= other_bytes {
                            held.push(ledger.claim(HostUse::Gradients, bytes).unwrap());
                        }
                    } else {
                        held.swap_remove(rng.below(held.len() as u64) as usize);
                    }
                    std::thread::yield_now();
                }
            })
        };
        let n = sizes.len() as u64;
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    let mut rng = SplitMix(seed.wrapping_add(t));
                    for _ in 0..150 {
                        let id = TensorId(rng.below(n));
                        match rng.below(5) {
                            0 => drop(m.acquire(id, Tier::Device, Access::Read).unwrap()),
                            1 => drop(m.acquire(id, Tier::Host, Access::Read).unwrap()),
                            2 => {
                                let g = m.acquire(id, Tier::Host, Access::Overwrite).unwrap();
                                g.host_bytes_mut().fill(id.0 as u8);
                            }
                            3 => {
                                let _ = m.prefetch(id, Tier::Host).unwrap().wait();
                            }
                            _ => {
                                let _ = m.prefetch(id, Tier::Device).unwrap().wait();
                            }
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        other.join().unwrap();
        prop_assert!(watcher.join().unwrap() > 0);
        m.check_invariants().unwrap();
        // Every byte the pool holds is claimed, and nothing more.
        prop_assert_eq!(ledger.used_bytes_of(HostUse::ComputeCopies), m.host_pool().held_bytes());
        prop_assert!(ledger.peak_bytes() <= budget);
        for (i, &len) in sizes.iter().enumerate() {
            let got = m.read_to_vec(TensorId(i as u64)).unwrap();
            prop_assert_eq!(got, vec![i as u8; len]);
        }
    }
}

#[test]
fn an_overwrite_reads_nothing_and_a_lowered_share_writes_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = HostLedger::new(64 << 20);
    let m = manager(dir.path(), 4 << 20, 8 << 20, &ledger);
    let n = 300_000;
    for id in 0..3 {
        m.register(meta(id, n), &vec![1; n]).unwrap();
        assert!(m.drop_host_copy(TensorId(id)).unwrap(), "a clean cache of its extent goes");
    }
    assert_eq!(m.used_bytes(Tier::Host), 0);
    let read_before = m.metrics().nvme_read.bytes;
    {
        let g = m.acquire(TensorId(0), Tier::Host, Access::Overwrite).unwrap();
        g.host_bytes_mut().fill(7);
    }
    assert_eq!(m.metrics().nvme_read.bytes, read_before, "an overwrite reads nothing from NVMe");
    assert!(m.residency(TensorId(0)).unwrap().host_dirty);
    assert!(!m.drop_host_copy(TensorId(0)).unwrap(), "a dirty copy is not dropped");
    // A device copy made stale by an overwrite goes.
    drop(m.acquire(TensorId(1), Tier::Device, Access::Read).unwrap());
    {
        let g = m.acquire(TensorId(1), Tier::Host, Access::Overwrite).unwrap();
        g.host_bytes_mut().fill(9);
    }
    assert!(!m.residency(TensorId(1)).unwrap().device);
    // Room for nothing: both dirty copies are written back and dropped.
    m.set_host_budget_bytes(1).unwrap();
    assert_eq!(m.used_bytes(Tier::Host), 0);
    assert!(m.host_pool().held_bytes() <= 1, "cached buffers above the share went back to the OS");
    assert_eq!(ledger.used_bytes_of(HostUse::ComputeCopies), m.host_pool().held_bytes());
    m.set_host_budget_bytes(8 << 20).unwrap();
    assert_eq!(m.read_to_vec(TensorId(0)).unwrap(), vec![7; n]);
    assert_eq!(m.read_to_vec(TensorId(1)).unwrap(), vec![9; n]);
    assert_eq!(m.read_to_vec(TensorId(2)).unwrap(), vec![1; n]);
    // A pinned host copy cannot go: the share is not lowered below it.
    let _pin = m.acquire(TensorId(2), Tier::Host, Access::Read).unwrap();
    assert!(m.set_host_budget_bytes(1).is_err());
    assert_eq!(m.budget_bytes(Tier::Host), 8 << 20);
}

#[test]
fn a_pool_over_a_full_ledger_is_refused_by_category() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = HostLedger::new(1 << 20);
    let _other = ledger.claim(HostUse::OptimizerState, 900 << 10).unwrap();
    let m = manager(dir.path(), 4 << 20, 1 << 20, &ledger);
    let e = m.register(meta(0, 300_000), &vec![0; 300_000]).unwrap_err().to_string();
    assert!(e.contains("compute_copies") && e.contains("[budgets] host"), "{e}");
    assert_eq!(ledger.used_bytes_of(HostUse::ComputeCopies), 0);
}
