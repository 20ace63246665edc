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
