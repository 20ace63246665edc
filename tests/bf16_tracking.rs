//! bf16 trains like f32 (issue: mixed precision end to end): 200 steps of the main job's model
//! (`configs/llama-shakespeare.toml`: the Llama of 0.99 M parameters, batches of 16 × 128 tokens,
//! its optimizer settings) in `compute_dtype = "bf16"` track the f32 run's validation loss within
//! 2 % at every evaluation, with no non-finite step. In a test binary of its own: the two runs
//! take minutes on 2 cores (bf16 through candle's compositions).

mod common;

use oogc::config::{ComputeDType, TrainConfig};
use oogc::train::Trainer;

/// Steps of each run, and validation every this many.
const STEPS: u64 = 200;
const EVAL_INTERVAL: u64 = 50;

/// The main job's config for `STEPS` steps in `dtype`, its files in `dir` (no checkpoints, no
/// metrics), and the GPU budget halved for bf16 so the same units fit.
fn main_job(dir: &std::path::Path, dtype: ComputeDType) -> TrainConfig {
    let mut cfg = TrainConfig::load(&common::repo_root().join("configs/llama-shakespeare.toml")).unwrap();
    cfg.train.steps = STEPS;
    cfg.train.eval_interval = EVAL_INTERVAL;
    cfg.train.compute_dtype = dtype;
    cfg.data.cache_dir = Some(dir.join("tokens"));
    cfg.budgets.nvme_dirs = vec![dir.join(format!("nvme-{dtype:?}"))];
    cfg.checkpoint.dir = None;
    cfg.output.metrics = None;
    if dtype == ComputeDType::Bf16 {
        cfg.budgets.gpu = bytesize::ByteSize::b(cfg.budgets.gpu.as_u64() / 2);
    }
    cfg
}

/// The validation losses (nats/token) at every `EVAL_INTERVAL` steps.
fn validation_losses(cfg: TrainConfig) -> Vec<f64> {
    let mut t = Trainer::new(cfg).unwrap();
    let mut val = Vec::new();
    for step in 1..=STEPS {
        let out = t.train_step().unwrap();
        assert!(out.loss.is_finite() && !out.stats.skipped, "step {step}: {out:?}");
        assert!(out.stats.grad_norm.is_finite(), "step {step}: grad norm {}", out.stats.grad_norm);
        if step % EVAL_INTERVAL == 0 {
            val.push(t.evaluate().unwrap().nats_per_token);
        }
    }
    val
}

#[test]
fn bf16_tracks_f32_on_the_main_jobs_model_within_two_percent() {
    let dir = tempfile::tempdir().unwrap();
    let f32_val = validation_losses(main_job(dir.path(), ComputeDType::F32));
    let bf16_val = validation_losses(main_job(dir.path(), ComputeDType::Bf16));
    eprintln!("validation nats/token every {EVAL_INTERVAL} steps: f32 {f32_val:?}, bf16 {bf16_val:?}");
    assert_eq!(f32_val.len(), (STEPS / EVAL_INTERVAL) as usize);
    for (k, (f, b)) in f32_val.iter().zip(&bf16_val).enumerate() {
        let rel = (b - f).abs() / f;
        assert!(
            rel <= 0.02,
            "evaluation {} (step {}): bf16 {b} vs f32 {f}: {:.2} %",
            k,
            (k as u64 + 1) * EVAL_INTERVAL,
            100.0 * rel
        );
    }
    // The runs learned: the last evaluation is well below the first.
    assert!(f32_val[f32_val.len() - 1] < f32_val[0] - 0.3, "{f32_val:?}");
}
