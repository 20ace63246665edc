//! Criterion benches of the host↔device path on the sim device (small sizes, a few seconds each):
//!
//! | bench | what it measures |
//! |---|---|
//! | `sim_htod_64MiB`, `sim_dtoh_64MiB` | one unthrottled [`SimDevice`] copy of a pinned 64 MiB buffer, waited for |
//! | `sim_residency_acquire_evict` | one pass of acquires over 16 tensors of 256 KiB with a device budget of 8 (each acquire fetches, LRU evicts) |
//! | `pinned_pool_alloc_reuse` | allocating and dropping a 1 MiB [`PinnedPool`] buffer (a cached reuse) |
//!
//! The end-to-end figures with limits beside them come from `oogc bench swap`.

use std::time::Duration;

use criterion::{criterion_main, Criterion, Throughput};
use oogc::swapper::{
    Access, DType, Device, LruPolicy, PinnedPool, PinnedPoolConfig, ResidencyConfig, ResidencyManager, SimDevice,
    SimDeviceConfig, TensorId, TensorMeta, Tier,
};

const MIB64: usize = 64 << 20;

fn pool(budget_bytes: u64) -> PinnedPool {
    PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes, lock: false })
}

fn sim(capacity_bytes: u64) -> Device {
    Device::Sim(SimDevice::new(SimDeviceConfig { capacity_bytes, ..Default::default() }).expect("sim device"))
}

fn copy_benches(c: &mut Criterion) {
    let dev = sim(MIB64 as u64);
    let pool = pool(2 * MIB64 as u64);
    let mut host = Some(pool.alloc(MIB64).expect("host buffer"));
    let mut dbuf = Some(dev.alloc(MIB64).expect("device buffer"));
    let mut g = c.benchmark_group("sim_copy");
    g.sample_size(10).measurement_time(Duration::from_secs(2)).throughput(Throughput::Bytes(MIB64 as u64));
    // `wait` returns only after the copy engine finished: the device is synchronised before the
    // timer stops.
    g.bench_function("sim_htod_64MiB", |b| {
        b.iter(|| {
            let (h, d) = dev.htod(host.take().unwrap(), dbuf.take().unwrap()).unwrap().wait().unwrap();
            (host, dbuf) = (Some(h), Some(d));
        })
    });
    g.bench_function("sim_dtoh_64MiB", |b| {
        b.iter(|| {
            let (h, d) = dev.dtoh(dbuf.take().unwrap(), host.take().unwrap()).unwrap().wait().unwrap();
            (host, dbuf) = (Some(h), Some(d));
        })
    });
    g.finish();
}

fn residency_bench(c: &mut Criterion) {
    const K: u64 = 16;
    const T_BYTES: usize = 256 << 10;
    let budget = K / 2 * T_BYTES as u64;
    let cfg = ResidencyConfig {
        device_budget_bytes: Some(budget),
        host_budget_bytes: 2 * K * T_BYTES as u64,
        lock_host_memory: false,
        prefetch_threads: 1,
        ..ResidencyConfig::default()
    };
    let mgr = ResidencyManager::new(sim(budget), None, cfg, Box::new(LruPolicy)).expect("residency manager");
    let data = vec![0x5au8; T_BYTES];
    for i in 0..K {
        mgr.register(TensorMeta::new(TensorId(i), format!("t{i}"), &[T_BYTES], DType::U8, Tier::Host), &data)
            .expect("register");
    }
    let mut g = c.benchmark_group("sim_residency");
    g.sample_size(10).measurement_time(Duration::from_secs(2)).throughput(Throughput::Bytes(K * T_BYTES as u64));
    g.bench_function("sim_residency_acquire_evict", |b| {
        b.iter(|| {
            for i in 0..K {
                drop(mgr.acquire(TensorId(i), Tier::Device, Access::Read).unwrap());
            }
        })
    });
    g.finish();
    mgr.device().synchronize().expect("synchronize");
}

fn pool_bench(c: &mut Criterion) {
    let pool = pool(4 << 20);
    drop(pool.alloc(1 << 20).unwrap()); // the first allocation maps; later ones reuse it
    let mut g = c.benchmark_group("pinned_pool");
    g.sample_size(10).measurement_time(Duration::from_secs(1));
    g.bench_function("pinned_pool_alloc_reuse", |b| {
        b.iter(|| drop(std::hint::black_box(pool.alloc(1 << 20).unwrap())))
    });
    g.finish();
}

/// `criterion_group!` generates an undocumented `pub fn`; its lint allowance stays in here.
mod group {
    #![allow(missing_docs)]
    use super::{copy_benches, pool_bench, residency_bench};
    criterion::criterion_group!(benches, copy_benches, residency_bench, pool_bench);
}
criterion_main!(group::benches);
