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

/// A tiny Llama (GQA, untied) on the BPE tokenizer's ids, state on NVMe and a GPU budget of a
/// third of its parameters' bytes.
pub fn tiny_llama(nvme: &std::path::Path, cache: &std::path::Path) -> String {
    format!(
        r#"
[model]
family = "llama"
hidden_size = 32
intermediate_size = 88
num_hidden_layers = 6
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 32
[data]
path = "{data}"
tokenizer = "{tok}"
cache_dir = "{cache}"
[train]
batch_size = 4
seq_len = 16
steps = 12
seed = 5
eval_interval = 0
eval_batches = 2
[budgets]
gpu = "64MiB"
host = "64MiB"
optimizer_state = "nvme"
nvme_dirs = ["{nvme}"]
[optimizer]
lr = 3e-3
warmup_steps = 3
clip_norm = 0.5
[threads]
optimizer = 2
"#,
        data = data_path().display(),
        tok = repo_root().join("../shared/fixtures/llama/tokenizer.json").display(),
        cache = cache.display(),
        nvme = nvme.display()
    )
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

/// Each complete line of a metrics file (`[output] metrics`), parsed; none when missing.
pub fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// (step, loss) of each complete line of a metrics file ([`metrics_lines`]).
pub fn metrics_losses(path: &Path) -> Vec<(u64, f64)> {
    metrics_lines(path).iter().map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())).collect()
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

/// Four steps of `config("whole")` against two of `config("parts")`, a checkpoint, and two more
/// steps of the run resumed from it: the losses and the final master weights are bitwise the
/// same (each config must have a `[checkpoint] dir` of its own).
pub fn assert_resume_continues_exactly(config: &dyn Fn(&str) -> oogc::config::TrainConfig) {
    use oogc::train::Trainer;
    let mut whole = Trainer::new(config("whole"), oogc::dist::Ranks::single()).unwrap();
    let losses: Vec<f64> = (0..4).map(|_| whole.train_step().unwrap().loss).collect();
    let params = whole.master_weights().unwrap();
    drop(whole);
    let cfg = config("parts");
    let mut first = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let mut resumed_losses: Vec<f64> = (0..2).map(|_| first.train_step().unwrap().loss).collect();
    let ckpt = first.save_checkpoint().unwrap().expect("a checkpoint dir").path;
    drop(first);
    let mut second = Trainer::resume(cfg, oogc::dist::Ranks::single(), &ckpt).unwrap();
    resumed_losses.extend((0..2).map(|_| second.train_step().unwrap().loss));
    assert_eq!(resumed_losses, losses);
    assert_eq!(second.master_weights().unwrap(), params);
}

/// [`tiny_llama`] in `dir` in `compute_dtype` with a GPU budget of a third of its compute
/// copies' bytes (at least two of its largest unit), and those bytes: units are evicted and
/// fetched again every step.
pub fn offloaded_tiny_llama(dir: &Path, compute_dtype: oogc::config::ComputeDType) -> (oogc::config::TrainConfig, u64) {
    let mut cfg =
        oogc::config::TrainConfig::from_toml_str(&tiny_llama(&dir.join("nvme"), &dir.join("tokens"))).unwrap();
    cfg.train.compute_dtype = compute_dtype;
    let t = oogc::train::Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let dtype = compute_dtype.dtype();
    let copy_bytes = dtype.num_bytes(t.num_params()) as u64;
    let largest = t.model().units().iter().map(|u| dtype.num_bytes(u.numel) as u64).max().unwrap();
    drop(t);
    cfg.budgets.gpu = bytesize::ByteSize::b((copy_bytes / 3).max(2 * largest));
    (cfg, copy_bytes)
}

/// A tiny Mixtral (4 experts per layer, top-2, the pooled load-balancing loss) on the BPE
/// tokenizer's ids, state on NVMe.
pub fn tiny_mixtral(nvme: &std::path::Path, cache: &std::path::Path, gpu: &str, policy: &str) -> String {
    let experts = "max_position_embeddings = 32\nnum_local_experts = 4\nnum_experts_per_tok = 2\n\
                   router_aux_loss_coef = 0.05\noutput_router_logits = true";
    tiny_llama(nvme, cache)
        .replace("family = \"llama\"", "family = \"mixtral\"")
        .replace("intermediate_size = 88", "intermediate_size = 48")
        .replace("num_hidden_layers = 6", "num_hidden_layers = 3")
        .replace("max_position_embeddings = 32", experts)
        .replace("gpu = \"64MiB\"", &format!("gpu = \"{gpu}\""))
        + &format!("[moe]\npolicy = \"{policy}\"\nexpert_budget = \"40KiB\"\n")
}
