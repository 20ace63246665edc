//! Policy sweeps on GPT-like schedules in the simulator: bytes moved by the next-use policy with
//! its prefetch window against offline MIN (≤ 1.05×), LRU and FIFO reported beside; stall when
//! the links outrun compute; completion at the minimum working set.

use oogc_prefetch::{
    min_working_set, simulate_kind, Phase, PolicyKind, Schedule, ScheduleEntry, SimConfig, SimReport, SimUnit,
};
use oogc_swapper::{TensorId, Tier};
use proptest::prelude::*;

/// A GPT-like model of `n` units (embedding, `n - 2` blocks, head) with block sizes scaled by
/// `scales` (cycled) so that units are unequal; bf16 compute copies.
fn gpt_like(n: usize, d: u64, scales: &[f64], fwd_s_per_mib: f64) -> (Schedule, Vec<SimUnit>) {
    gpt_like_with(n, d, scales, fwd_s_per_mib, true)
}

/// As [`gpt_like`]; `train` false gives a forward-only (evaluation) step: a cyclic scan, LRU's
/// worst case.
fn gpt_like_with(n: usize, d: u64, scales: &[f64], fwd_s_per_mib: f64, train: bool) -> (Schedule, Vec<SimUnit>) {
    let mut units = Vec::with_capacity(n);
    let emb = (256 * d + 256 * d) * 2;
    let block = (12 * d * d + 13 * d) * 2;
    let head = (2 * d + 256 * d) * 2;
    for i in 0..n {
        let bytes = if i == 0 {
            emb
        } else if i == n - 1 {
            head
        } else {
            ((block as f64) * scales[i % scales.len()]) as u64 / 64 * 64
        };
        let mib = bytes as f64 / (1 << 20) as f64;
        units.push(SimUnit {
            forward_s: fwd_s_per_mib * mib,
            backward_s: 3.0 * fwd_s_per_mib * mib,
            ..SimUnit::bf16(TensorId(i as u64), bytes)
        });
    }
    let ids: Vec<_> = units.iter().map(|u| (u.id, u.num_bytes)).collect();
    let s = if train {
        Schedule::training_step(&ids, true).unwrap()
    } else {
        let entries = ids.iter().map(|&(u, _)| ScheduleEntry::new(u, Phase::Forward, Tier::Device)).collect();
        Schedule::new(entries, ids.iter().copied()).unwrap()
    };
    (s, units)
}

fn budget(s: &Schedule, units: &[SimUnit], fraction: f64) -> u64 {
    let total: u64 = units.iter().map(|u| u.num_bytes).sum();
    ((total as f64 * fraction) as u64).max(min_working_set(s))
}

fn run(s: &Schedule, units: &[SimUnit], budget: u64, kind: PolicyKind) -> SimReport {
    let mut cfg = SimConfig::new(budget);
    if kind == PolicyKind::Min {
        cfg.prefetch = None; // offline MIN: demand paging with perfect knowledge
    }
    simulate_kind(s, units, &cfg, kind).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn next_use_moves_at_most_5_percent_more_than_min(
        n in 24usize..=96,
        scales in proptest::collection::vec(0.5f64..1.5, 1..8),
        fraction in 0.1f64..0.9,
    ) {
        let train = true;
        let (s, units) = gpt_like_with(n, 128, &scales, 1e-3, train);
        let b = budget(&s, &units, fraction);
        let ours = run(&s, &units, b, PolicyKind::NextUse);
        let min = run(&s, &units, b, PolicyKind::Min);
        prop_assert!(
            ours.bytes_moved as f64 <= 1.05 * min.bytes_moved as f64,
            "n={n} fraction={fraction:.2} train={train}: next-use {} B, MIN {} B", ours.bytes_moved, min.bytes_moved
        );
    }
}

#[test]
fn sweep_reports_every_policy_beside_min() {
    for (n, train) in [(24usize, true), (48, true), (96, true), (48, false)] {
        let (s, units) = gpt_like_with(n, 128, &[1.0, 0.6, 1.4, 0.8, 1.2], 1e-3, train);
        for fraction in [0.1, 0.3, 0.5, 0.7, 0.9] {
            let b = budget(&s, &units, fraction);
            let min = run(&s, &units, b, PolicyKind::Min).bytes_moved;
            let mut line = format!("n={n:3} train={train:5} budget={fraction:.1}: min {min:>10}");
            let mut bytes = Vec::new();
            for kind in [PolicyKind::NextUse, PolicyKind::Lru, PolicyKind::Fifo] {
                let r = run(&s, &units, b, kind);
                line += &format!(
                    "  {} {:.3}x stall {:.1}%",
                    kind.name(),
                    r.bytes_moved as f64 / min as f64,
                    100.0 * r.stall_s / r.step_s
                );
                bytes.push(r.bytes_moved);
            }
            eprintln!("{line}");
            if train {
                assert!(bytes[0] as f64 <= 1.05 * min as f64, "{line}");
            } else {
                // A forward-only scan: LRU and FIFO evict what comes next; the window costs
                // next-use up to `max_depth` units of cache per pass, still far ahead of them.
                assert!(bytes[0] <= bytes[1] && bytes[0] <= bytes[2], "{line}");
            }
        }
    }
}

#[test]
fn links_above_demand_keep_stall_under_5_percent() {
    // 12 d² B per block at d = 512 is 6 MiB; 25 GB/s moves it in ~0.25 ms, compute takes 6 ms.
    let (s, units) = gpt_like(26, 512, &[1.0, 0.7, 1.3], 1e-3);
    for fraction in [0.2, 0.5, 0.9] {
        let b = budget(&s, &units, fraction);
        let mut cfg = SimConfig::new(b);
        cfg.optimizer_params_per_s = 1e11;
        let r = simulate_kind(&s, &units, &cfg, PolicyKind::NextUse).unwrap();
        assert!(r.stall_s <= 0.05 * r.step_s, "budget {fraction}: stall {} s of {} s: {r:?}", r.stall_s, r.step_s);
        assert!(r.prefetches > 0);
    }
}

#[test]
fn the_minimum_working_set_completes_for_every_policy() {
    let (s, units) = gpt_like(40, 128, &[1.0, 0.5, 1.5], 1e-3);
    let min = min_working_set(&s);
    assert_eq!(min, units.iter().map(|u| u.num_bytes).max().unwrap());
    for kind in PolicyKind::ALL {
        let r = simulate_kind(&s, &units, &SimConfig::new(min), kind).unwrap();
        // Nothing can stay but the turn: the forward's last unit is the backward's first.
        assert_eq!(r.demand_fetches + r.prefetches, s.device_len() - 1, "{kind:?}");
        assert!(r.peak_bytes.device <= min);
    }
}

#[test]
fn no_extra_bytes_keeps_a_forward_scan_at_min() {
    use oogc_prefetch::PrefetchConfig;
    for train in [false, true] {
        let (s, units) = gpt_like_with(32, 128, &[1.0, 0.6, 1.4], 1e-3, train);
        for fraction in [0.2, 0.5, 0.8] {
            let b = budget(&s, &units, fraction);
            let min = run(&s, &units, b, PolicyKind::Min).bytes_moved;
            let mut cfg = SimConfig::new(b);
            cfg.prefetch = Some(PrefetchConfig { no_extra_bytes: true, ..PrefetchConfig::default() });
            let strict = simulate_kind(&s, &units, &cfg, PolicyKind::NextUse).unwrap();
            assert!(
                strict.bytes_moved as f64 <= 1.05 * min as f64,
                "train={train} budget {fraction}: {} B vs MIN {min} B",
                strict.bytes_moved
            );
            if train {
                // Palindromic steps lose no prefetch to the rule.
                let loose = run(&s, &units, b, PolicyKind::NextUse);
                assert_eq!(strict.prefetches, loose.prefetches, "budget {fraction}");
            }
        }
    }
}
