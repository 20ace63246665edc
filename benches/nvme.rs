//! Criterion benches of the NVMe tier (small sizes, seconds): a 64 MiB write and read through the
//! store in `OOGC_NVME_BENCH_DIR` (default: the temp dir), crc32c of 1 MiB, and an extent
//! alloc/free pair. The full store-vs-fio comparison is `oogc bench nvme --dir DIR --size-gib N`.
#![allow(missing_docs)]

use std::path::PathBuf;

use criterion::{criterion_group, Criterion, Throughput};
use oogc::swapper::nvme::alloc::ExtentAllocator;
use oogc::swapper::nvme::block_checksum;
use oogc::swapper::{NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig, TensorId};

const MIB64: usize = 64 << 20;

fn store_benches(c: &mut Criterion) {
    let dir = std::env::var_os("OOGC_NVME_BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let store = NvmeStore::open(NvmeConfig::new(vec![dir], 4 * MIB64 as u64)).expect("open store");
    let pool = PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 4 * MIB64 as u64, lock: false });
    let mut g = c.benchmark_group("nvme");
    g.sample_size(10).throughput(Throughput::Bytes(MIB64 as u64));
    let mut buf = Some(pool.alloc(MIB64).unwrap());
    g.bench_function("nvme_write_64MiB", |b| {
        b.iter(|| {
            let (r, back) = store.write(TensorId(1), buf.take().unwrap()).wait();
            store.free(r.unwrap());
            buf = Some(back);
        })
    });
    let (r, back) = store.write(TensorId(2), buf.take().unwrap()).wait();
    let ext = r.unwrap();
    buf = Some(back);
    g.bench_function("nvme_read_64MiB", |b| {
        b.iter(|| {
            let (r, back) = store.read(&ext, buf.take().unwrap()).wait();
            r.unwrap();
            buf = Some(back);
        })
    });
    g.finish();
    store.free(ext);

    let data = vec![0x5au8; 1 << 20];
    let mut g = c.benchmark_group("crc");
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("crc32c_1MiB", |b| b.iter(|| block_checksum(std::hint::black_box(&data))));
    g.finish();

    let mut a = ExtentAllocator::new(1 << 30);
    let held: Vec<u64> = (0..1000).map(|i| a.alloc(4096 * (1 + i % 7)).unwrap()).collect();
    for (i, &o) in held.iter().enumerate().step_by(2) {
        a.free(o, 4096 * (1 + i as u64 % 7)).unwrap();
    }
    c.bench_function("extent_alloc_free", |b| {
        b.iter(|| {
            let o = a.alloc(3 * 4096).unwrap();
            a.free(o, 3 * 4096).unwrap();
        })
    });
}

criterion_group!(benches, store_benches);

criterion::criterion_main!(benches);
