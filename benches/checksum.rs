//! Criterion benches of the NVMe store's block checksum (crc32c, computed on every block written
//! and verified on every block read):
//!
//! | bench | what it measures |
//! |---|---|
//! | `block_checksum_{4K,64K,1M}` | [`block_checksum`] over one block of 4 KiB, 64 KiB and 1 MiB (the default block); throughput in bytes/s |
//!
//! The buffers fit in cache: this is the checksum's compute cost, the ceiling it puts on the
//! store's throughput per core, not a memory-bound figure.

use std::time::Duration;

use criterion::{criterion_main, Criterion, Throughput};
use oogc::swapper::nvme::block_checksum;

fn checksum_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("nvme_checksum");
    g.sample_size(20).measurement_time(Duration::from_secs(2));
    for (name, bytes) in [("4K", 4usize << 10), ("64K", 64 << 10), ("1M", 1 << 20)] {
        let buf: Vec<u8> = (0..bytes).map(|i| (i * 31 + i / 4096) as u8).collect();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("block_checksum_{name}"), |b| b.iter(|| block_checksum(std::hint::black_box(&buf))));
    }
    g.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    checksum_benches(&mut c);
}

criterion_main!(benches);
