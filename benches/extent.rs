//! Criterion benches of the NVMe store's extent allocator (best fit over free ranges, with
//! coalescing; one call per tensor written or freed):
//!
//! | bench | what it measures |
//! |---|---|
//! | `extent_alloc_free_cycle_fragmented` | one `alloc` + `free` of a 1 MiB…4 MiB extent in a 64 GiB file holding 4096 live extents with 2048 holes between them (a fragmented steady state) |
//! | `extent_fill_then_drain_1024` | 1024 allocations of 4 KiB…1 MiB into an empty 64 GiB file, then freeing all of them in a shuffled order (coalescing back to one range) |
//!
//! Throughput is in allocator calls (elements) per second.

use std::time::Duration;

use criterion::{criterion_main, BatchSize, Criterion, Throughput};
use oogc::swapper::nvme::alloc::{ExtentAllocator, GRANULE_BYTES};

const CAPACITY: u64 = 64 << 30;

/// Deterministic sizes of 1..=256 granules (4 KiB…1 MiB), or 256..=1024 granules for `large`.
fn size(i: u64, large: bool) -> u64 {
    let x = i.wrapping_mul(2654435761) >> 7;
    if large {
        (256 + x % 769) * GRANULE_BYTES
    } else {
        (1 + x % 256) * GRANULE_BYTES
    }
}

fn fragmented() -> ExtentAllocator {
    let mut a = ExtentAllocator::new(CAPACITY);
    let live: Vec<(u64, u64)> = (0..4096).map(|i| (a.alloc(size(i, false)).expect("fits"), size(i, false))).collect();
    for (k, &(off, len)) in live.iter().enumerate() {
        if k % 2 == 1 {
            a.free(off, len).expect("free");
        }
    }
    a
}

fn extent_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("nvme_extent");
    g.sample_size(20).measurement_time(Duration::from_secs(2));

    let mut a = fragmented();
    let mut i = 0u64;
    g.throughput(Throughput::Elements(2));
    g.bench_function("extent_alloc_free_cycle_fragmented", |b| {
        b.iter(|| {
            i += 1;
            let len = size(i, true);
            let off = a.alloc(len).expect("fits");
            a.free(std::hint::black_box(off), len).expect("free");
        })
    });

    let mut order: Vec<u64> = (0..1024).collect();
    order.sort_by_key(|&k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17));
    g.throughput(Throughput::Elements(2048));
    g.bench_function("extent_fill_then_drain_1024", |b| {
        b.iter_batched(
            || ExtentAllocator::new(CAPACITY),
            |mut a| {
                let offs: Vec<u64> = (0..1024).map(|k| a.alloc(size(k, false)).expect("fits")).collect();
                for &k in &order {
                    a.free(offs[k as usize], size(k, false)).expect("free");
                }
                assert_eq!(a.free_ranges(), 1);
                a
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    extent_benches(&mut c);
}

criterion_main!(benches);
