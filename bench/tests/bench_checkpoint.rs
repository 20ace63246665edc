//! `oogc bench checkpoint` ([`oogc_bench::checkpoint`]) end to end on a tiny offloaded config:
//! both modes save, every checkpoint verifies, the report's figures hold together. No timing is
//! asserted (the cost itself is a benchmark figure, in the book).

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;

use oogc::config::TrainConfig;
use oogc_bench::checkpoint::{self, CheckpointBenchArgs, SaveMode};

/// [`common::small_run`]'s 4-block model, state on NVMe, its checkpoints in `run/ckpt` (replaced
/// by the bench's scratch directory, made beside it in `run/`).
fn tiny(dir: &Path) -> TrainConfig {
    TrainConfig::load(&common::small_run(dir, "run", 4, 1, 2)).unwrap()
}

#[test]
fn both_modes_save_verified_checkpoints_of_the_same_state() {
    let dir = tempfile::tempdir().unwrap();
    let args = CheckpointBenchArgs { steps: 7, warmup: 1, interval: 2, ..CheckpointBenchArgs::new(tiny(dir.path())) };
    let r = checkpoint::run(&args).unwrap();
    // Saves after steps 2, 4 and 6: background, sync, background.
    assert_eq!((r.background.mode, r.sync.mode), (SaveMode::Background, SaveMode::Sync));
    assert_eq!((r.background.saves, r.sync.saves), (2, 1), "{r:#?}");
    assert_eq!(
        (r.background.after_steps.as_slice(), r.sync.after_steps.as_slice()),
        ([2, 6].as_slice(), [4].as_slice())
    );
    assert_eq!(r.intervals_s.len(), 7);
    assert!(r.intervals_s.iter().all(|x| x.is_finite() && *x > 0.0), "{:?}", r.intervals_s);
    // The step right after the sync save (step 5) is at least as long as the save held the trainer.
    assert!(r.intervals_s[4] >= r.sync.held_s, "{r:#?}");
    // Steps 1, 2, 4 and 6 follow no save (3, 5 and 7 do).
    assert_eq!(r.baseline_steps, 4, "{r:#?}");
    for m in [&r.background, &r.sync] {
        assert_eq!(m.verified, m.saves, "{m:?}");
        assert!(m.data_bytes > 0 && m.bytes > m.data_bytes, "a file holds its tensors' data and a header: {m:?}");
        for x in [m.after_s, m.cost_s, m.cost_ratio, m.paired_cost_s, m.paired_cost_ratio, m.held_s, m.save_s] {
            assert!(x.is_finite(), "{m:?}");
        }
        assert!(m.after_s > 0.0 && m.held_s > 0.0 && m.save_s > 0.0, "{m:?}");
        assert_eq!(m.cost_s, m.after_s - r.step_s);
        assert!(m.after2_s.is_some(), "every save but the last has a second step after it: {m:?}");
    }
    // The same model's state, whichever way it was written.
    assert_eq!(r.background.data_bytes, r.sync.data_bytes);
    assert_eq!(r.sync.steps_in_flight, 0.0);
    assert!(r.background.steps_in_flight >= 1.0, "a background save is polled after a step at the earliest");
    // The sync save holds the trainer for the whole save; the figures say so.
    assert!(r.sync.held_s >= r.sync.save_s, "{:?}", r.sync);
    assert_eq!(r.passes, r.background.cost_ratio <= r.bar);
    // The scratch directory is removed, the config's own checkpoint directory never made.
    assert!(!r.dir.exists(), "{} left behind", r.dir.display());
    assert!(!dir.path().join("run/ckpt").exists());
    assert!(!dir.path().join("run/metrics.jsonl").exists(), "the bench writes no metrics");
    assert_eq!(r.dir.parent(), Some(dir.path().join("run").as_path()));
}

#[test]
fn too_few_steps_or_a_short_interval_are_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let base = CheckpointBenchArgs::new(tiny(dir.path()));
    let e = checkpoint::run(&CheckpointBenchArgs { steps: 8, interval: 4, ..base.clone() }).unwrap_err();
    assert!(e.to_string().contains("--steps 8") && e.to_string().contains("more than 2 × --interval"), "{e}");
    let e = checkpoint::run(&CheckpointBenchArgs { interval: 1, ..base }).unwrap_err();
    assert!(e.to_string().contains("--interval 1") && e.to_string().contains("at least 2"), "{e}");
}
