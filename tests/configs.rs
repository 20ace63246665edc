//! The shipped configs (`configs/*.toml`): every one loads and validates, and the main job is
//! what the README says it is — a Llama-family model on BPE tokens, optimizer state on NVMe, a
//! GPU budget at most 1/8 of parameters + optimizer state (16 B per parameter: the f32 compute
//! copy, the fp32 master weights, Adam m and v); the scale run outgrows the machine's memory 1.5×
//! with a host budget of at most 8 GiB.

mod common;

use oogc::config::{ModelConfig, TrainConfig};
use oogc::swapper::StatePlacement;

#[test]
fn every_shipped_config_loads_and_validates() {
    let dir = common::repo_root().join("configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let cfg = TrainConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            cfg.validate().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(seen >= 4, "expected the shipped configs in {}, found {seen}", dir.display());
}

#[test]
fn the_main_job_is_a_llama_out_of_gpu_core() {
    let cfg = TrainConfig::load(&common::repo_root().join("configs/llama-shakespeare.toml")).unwrap();
    assert!(matches!(cfg.model, ModelConfig::Llama(_)), "family {}", cfg.model.family());
    assert!(cfg.data.tokenizer.is_some(), "the main job trains on BPE tokens");
    assert_eq!(cfg.budgets.optimizer_state, StatePlacement::Nvme);
    let vocab = oogc::train::vocab_size(&cfg).unwrap();
    let model = oogc::train::build_model(&cfg, vocab).unwrap();
    let params: usize = oogc::train::unit_sizes(&*model).iter().sum();
    let params_and_state = 16 * params as u64;
    let gpu = cfg.budgets.gpu.as_u64();
    assert!(8 * gpu <= params_and_state, "GPU budget {gpu} B > 1/8 of parameters + state ({params_and_state} B)");
    // Its host budget and NVMe store pass the trainer's own checks (free space aside: any).
    oogc::train::check_budgets(&cfg, &*model, &|_| Ok(u64::MAX)).unwrap();
}

#[test]
fn the_scale_run_outgrows_host_memory_and_fits_its_budgets() {
    let cfg = TrainConfig::load(&common::repo_root().join("configs/scale-beyond-ram.toml")).unwrap();
    assert!(matches!(cfg.model, ModelConfig::Llama(_)), "family {}", cfg.model.family());
    assert!(cfg.data.tokenizer.is_some(), "the scale run trains on BPE tokens of real text");
    assert_eq!((cfg.budgets.optimizer_state, cfg.budgets.params), (StatePlacement::Nvme, StatePlacement::Nvme));
    assert!(cfg.train.steps >= 5);
    let vocab = oogc::train::vocab_size(&cfg).unwrap();
    let model = oogc::train::build_model(&cfg, vocab).unwrap();
    let params: usize = oogc::train::unit_sizes(&*model).iter().sum();
    // Parameters + optimizer state ≥ 1.5 × the 24 GiB these machines have.
    let params_and_state = 16 * params as u64;
    assert!(params_and_state * 2 >= 3 * (24u64 << 30), "{params_and_state} B < 1.5 × 24 GiB");
    let host = cfg.budgets.host.as_u64();
    assert!(host <= 8 << 30, "host budget {host} B > 8 GiB");
    // Immediate updates: without them the held gradients alone (4 B per parameter) would not fit.
    assert!(oogc::train::optimizer_config(&cfg).updates_immediately());
    let plan = oogc::train::host_plan(&cfg, &*model);
    assert!(plan.min_bytes <= host && plan.gradients_bytes < 4 * params as u64 / 8, "{plan:?}");
    oogc::train::check_budgets(&cfg, &*model, &|_| Ok(u64::MAX)).unwrap();
}
