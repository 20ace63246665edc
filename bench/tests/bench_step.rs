//! The ZeRO-Infinity-like baseline (`[prefetch] overlap_optimizer = false`, depth 0) trains to
//! bitwise the same losses and weights as the pipelined run: only the timing differs.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;

use oogc::config::TrainConfig;
use oogc::train::Trainer;

/// The tiny model of `tests/train.rs` (24 blocks of width 16), offloaded: GPU budget of about a
/// quarter of the parameters, optimizer state on NVMe.
fn tiny(nvme: &Path, depth: usize, overlap: bool) -> String {
    format!(
        r#"
[model]
d_model = 16
n_layer = 24
n_head = 2
[data]
path = "{data}"
[train]
batch_size = 4
seq_len = 16
steps = 8
seed = 3
eval_interval = 0
eval_batches = 2
[budgets]
gpu = "96KiB"
host = "64MiB"
optimizer_state = "nvme"
nvme_dirs = ["{nvme}"]
[optimizer]
lr = 3e-3
warmup_steps = 2
clip_norm = 0.5
[prefetch]
depth = {depth}
overlap_optimizer = {overlap}
[threads]
optimizer = 2
"#,
        data = common::data_path().display(),
        nvme = nvme.display()
    )
}

fn run(cfg: &str, steps: usize) -> (Vec<f64>, Vec<Vec<f32>>, f64) {
    let mut t = Trainer::new(TrainConfig::from_toml_str(cfg).unwrap(), oogc::dist::Ranks::single()).unwrap();
    let mut losses = Vec::new();
    let mut optimizer_stall = 0.0;
    for _ in 0..steps {
        let out = t.train_step().unwrap();
        optimizer_stall += out.stats.figures.stall_optimizer_s;
        losses.push(out.loss);
    }
    (losses, t.master_weights().unwrap(), optimizer_stall)
}

#[test]
fn baseline_without_overlap_equals_the_pipelined_run_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (a, pa, _) = run(&tiny(&dir.path().join("a"), 2, true), 8);
    let (b, pb, stall_b) = run(&tiny(&dir.path().join("b"), 0, false), 8);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b), "losses differ:\n{a:?}\n{b:?}");
    assert_eq!(pa, pb, "master weights differ");
    assert!(stall_b > 0.0, "the baseline waits for the optimizer at the end of each step");
}

#[test]
fn overlap_optimizer_defaults_to_true_and_parses() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml_str(&tiny(dir.path(), 2, false)).unwrap();
    assert!(!cfg.prefetch.overlap_optimizer);
    let default = tiny(dir.path(), 2, true).replace("overlap_optimizer = true\n", "");
    assert!(TrainConfig::from_toml_str(&default).unwrap().prefetch.overlap_optimizer);
}

#[test]
fn the_turn_splits_each_step_into_forward_and_backward() {
    let nvme = tempfile::tempdir().unwrap();
    let mut t =
        Trainer::new(TrainConfig::from_toml_str(&tiny(nvme.path(), 2, true)).unwrap(), oogc::dist::Ranks::single())
            .unwrap();
    for _ in 0..3 {
        let s = t.train_step().unwrap().stats;
        let f = s.forward;
        assert!(f.wall_s > 0.0 && f.wall_s < s.figures.step_s, "{s:?}");
        assert!(f.stall_s <= s.stall_s() + 1e-12, "{s:?}");
        // The forward fetches every unit but the head, which the backward fetches at the turn.
        assert!(f.h2d_bytes > 0 && f.h2d_bytes < s.figures.h2d_bytes, "{s:?}");
        // Gradients go down only in the backward.
        assert_eq!(f.d2h_bytes, 0, "{s:?}");
    }
}
