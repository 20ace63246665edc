//! Criterion benches of the prefetcher's decisions, on the schedule of a 96-unit training step
//! (F0…F95, B95…B0: 192 device accesses), halfway through the forward pass with 48 units
//! resident on a full device tier:
//!
//! | bench | what it measures |
//! |---|---|
//! | `next_use_priority_48` | [`NextUsePolicy::priority`] of each of the 48 resident copies (one eviction decision's ranking); throughput in candidates/s |
//! | `next_use_eviction_order_48` | sorting the 48 candidates into eviction order under next-use (`eviction_order`) |
//! | `prefetcher_plan_depth_{4,16}` | one [`Prefetcher::plan`] call after an acquire: the lookahead window of 4 or 16 units, each needing an eviction |
//!
//! These run on every acquire of the trainer; a regression shows up here before a step slows.

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_main, Criterion, Throughput};
use oogc::prefetch::{CopyView, NextUsePolicy, PrefetchConfig, Prefetcher, ResidentView, Schedule, TierSnapshot};
use oogc::swapper::policy::eviction_order;
use oogc::swapper::{EvictionCandidate, EvictionPolicy, TensorId, Tier};

const UNITS: u64 = 96;
const RESIDENT: u64 = 48;
const UNIT_BYTES: u64 = 4 << 20;

fn policy_benches(c: &mut Criterion) {
    let units: Vec<(TensorId, u64)> = (0..UNITS).map(|i| (TensorId(i), UNIT_BYTES)).collect();
    let schedule = Arc::new(Schedule::training_step(&units, true).expect("schedule"));
    let mut policy = NextUsePolicy::new(schedule.clone());
    for i in 0..RESIDENT {
        policy.on_acquire(TensorId(i), Tier::Device, i + 1, false);
    }
    let clock = RESIDENT + 1;
    let cands: Vec<EvictionCandidate> = (0..RESIDENT)
        .map(|i| EvictionCandidate {
            id: TensorId(i),
            tier: Tier::Device,
            num_bytes: UNIT_BYTES,
            last_use: i + 1,
            dirty: i % 3 == 0,
        })
        .collect();

    let mut g = c.benchmark_group("prefetch_policy");
    g.sample_size(20).measurement_time(Duration::from_secs(2));
    g.throughput(Throughput::Elements(RESIDENT));
    g.bench_function("next_use_priority_48", |b| {
        b.iter(|| cands.iter().map(|c| policy.priority(std::hint::black_box(c), clock)).fold(0u64, u64::wrapping_add))
    });
    g.bench_function("next_use_eviction_order_48", |b| {
        b.iter(|| {
            let mut cs = cands.clone();
            eviction_order(&policy, &mut cs, clock);
            cs
        })
    });

    let snapshot = TierSnapshot {
        budget_bytes: RESIDENT * UNIT_BYTES,
        used_bytes: RESIDENT * UNIT_BYTES,
        copies: (0..RESIDENT)
            .map(|i| ResidentView {
                id: TensorId(i),
                num_bytes: UNIT_BYTES,
                state: CopyView::Ready,
                pinned: i + 1 == RESIDENT,
                last_use: i + 1,
                dirty: false,
            })
            .collect(),
        clock,
    };
    let position = RESIDENT - 1;
    for depth in [4usize, 16] {
        let p = Prefetcher::new(PrefetchConfig { max_depth: depth, ..PrefetchConfig::default() }).expect("config");
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("prefetcher_plan_depth_{depth}"), |b| {
            b.iter(|| p.plan(&schedule, position, std::hint::black_box(&snapshot), &policy, &|_| false))
        });
    }
    g.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    policy_benches(&mut c);
}

criterion_main!(benches);
