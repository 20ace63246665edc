//! Helpers shared by the end-to-end tests of every crate (`#[path]`-included).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The repository's root: the nearest ancestor of the test's crate with a `Cargo.lock` (these
/// helpers serve the tests of every crate of the workspace).
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors().find(|d| d.join("Cargo.lock").exists()).unwrap_or(here).to_path_buf()
}

/// `../shared/data/tinyshakespeare.txt` beside the repository; panics (the test fails, never
/// skips) when it is missing.
pub fn data_path() -> PathBuf {
    let p = repo_root().join("../shared/data/tinyshakespeare.txt");
    assert!(p.exists(), "{} is missing: the tests need ../shared beside the repository", p.display());
    p
}

/// A 24-block model of tiny width, so a GPU budget of 1/8 of the parameters still holds the
/// minimum working set (one block + its gradients).
pub fn tiny(gpu: &str, state: &str, nvme: &Path, depth: usize) -> String {
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
steps = 20
seed = 3
eval_interval = 0
eval_batches = 2
[budgets]
gpu = "{gpu}"
host = "64MiB"
optimizer_state = "{state}"
nvme_dirs = ["{nvme}"]
[optimizer]
lr = 3e-3
warmup_steps = 5
clip_norm = 0.5
[prefetch]
depth = {depth}
[threads]
optimizer = 2
"#,
        data = data_path().display(),
        nvme = nvme.display()
    )
}

pub fn tiny_moe(gpu: &str, state: &str, nvme: &Path) -> String {
    tiny(gpu, state, nvme, 2)
        .replace("n_layer = 24", "n_layer = 3")
        .replace("[data]", "[model.moe]\nexperts = 4\ntop_k = 2\ncapacity_factor = 1.25\n[data]")
}

/// (step, loss) of each complete line of a metrics file (`[output] metrics`); none when missing.
pub fn metrics_losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// A 4-block [`tiny`] run written to `dir/{name}.toml`: state on NVMe in `dir/name/nvme`,
/// `steps` steps, a checkpoint every `interval` (keep `keep`) in `name/ckpt`, metrics in
/// `name/metrics.jsonl`, one compute and one optimizer thread (the fault tests and the soak).
pub fn small_run(dir: &Path, name: &str, steps: u64, interval: u64, keep: usize) -> PathBuf {
    let nvme = dir.join(name).join("nvme");
    let text = tiny("64KiB", "nvme", &nvme, 2)
        .replace("n_layer = 24", "n_layer = 4")
        .replace("steps = 20", &format!("steps = {steps}"))
        .replace(
            "[threads]",
            &format!(
                "[checkpoint]\ndir = \"{name}/ckpt\"\ninterval = {interval}\nkeep = {keep}\n[output]\nmetrics = \"{name}/metrics.jsonl\"\n[threads]\ncompute = 1"
            ),
        )
        .replace("optimizer = 2", "optimizer = 1");
    std::fs::create_dir_all(&nvme).unwrap();
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}
