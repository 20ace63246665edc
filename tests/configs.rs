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
    oogc::train::check_budgets(&cfg, &*model, &|_| Ok(u64::MAX), oogc::dist::World::SINGLE).unwrap();
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
    let plan = oogc::train::host_plan(&cfg, &*model, oogc::dist::World::SINGLE);
    assert!(plan.min_bytes <= host && plan.gradients_bytes < 4 * params as u64 / 8, "{plan:?}");
    oogc::train::check_budgets(&cfg, &*model, &|_| Ok(u64::MAX), oogc::dist::World::SINGLE).unwrap();
}

/// The machine `configs/llama-8b-h100.toml` is for (README "GPU"): one H100 (about 78 GiB of
/// its 80 GB usable), 128 GiB of RAM, a 64 GiB disk.
const GPU_MACHINE_GPU_BYTES: u64 = 78 << 30;
/// Predicted peak RSS allowed: 128 GiB less 8 GiB for the OS, the CUDA driver and page cache.
const GPU_MACHINE_RSS_BYTES: u64 = 120 << 30;
/// NVMe store allowed: the 64 GiB disk less 8 GiB for the OS and the carried build.
const GPU_MACHINE_NVME_BYTES: u64 = 56 << 30;

/// Llama-3-8B's shape on the GPU machine: `oogc plan` (datasheet figures, no profile) puts every
/// tier within that machine, plans it without allocating its 8 B parameters, and predicts the
/// step with the H100's bf16 rate, not the sim device's.
#[test]
fn the_8b_config_fits_every_tier_of_the_gpu_machine() {
    use oogc::prefetch::HardwareProfile;
    let cfg = TrainConfig::load(&common::repo_root().join("configs/llama-8b-h100.toml")).unwrap();
    assert!(!cfg.device.kind.is_sim(), "a CUDA config");
    let rss_before = oogc::runtime::budget::rss_bytes().unwrap_or(0);
    let args = oogc::plan::plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
    let rss_after = oogc::runtime::budget::rss_bytes().unwrap_or(0);
    // Planning builds the model's layout only: 8 B parameters would be 16 GB in bf16.
    assert!(rss_after.saturating_sub(rss_before) < 1 << 30, "planning grew RSS {rss_before} -> {rss_after} B");
    let params: u64 = args.model.units.iter().map(|u| u.numel).sum();
    assert!((8_000_000_000..8_100_000_000).contains(&params), "{params} parameters");

    let report = oogc::plan::plan_model(&args).unwrap();
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    // Host: the ledger's minimum within the budget, the predicted peak RSS within the machine.
    let (host, nvme) = oogc::plan::host_and_nvme_plan(&args, &report);
    host.check().unwrap();
    let rss = args.overhead.as_ref().unwrap().predicted_peak_rss_bytes(&host);
    assert!(rss <= GPU_MACHINE_RSS_BYTES, "predicted peak RSS {rss} B > {GPU_MACHINE_RSS_BYTES} B");
    // NVMe: the store (compute copies + slack) within the disk.
    let nvme = nvme.expect("parameters on NVMe").capacity_bytes;
    assert!(nvme <= GPU_MACHINE_NVME_BYTES, "NVMe store {nvme} B > {GPU_MACHINE_NVME_BYTES} B");
    // GPU: the whole device figure, not only [budgets] gpu.
    let gpu = args.device.as_ref().expect("a config's plan has a device figure");
    assert!(!gpu.sim && gpu.fits());
    let total = gpu.plan.total_bytes();
    assert!(total <= GPU_MACHINE_GPU_BYTES, "GPU {total} B > {GPU_MACHINE_GPU_BYTES} B");
    assert!(total > gpu.plan.swapper_bytes() + gpu.plan.working_set_bytes, "{:?}", gpu.plan);
    // The step at the datasheet's bf16 rate × the default MFU, said so.
    assert_eq!(args.hardware.device_gflops, 989.0 * 0.5 * 1000.0);
    assert!(args.hardware.source.contains("H100") && !args.hardware.source.contains("sim device"));
    let forward: f64 = args.model.units.iter().map(|u| u.forward_flops).sum();
    let compute = (1.0 + args.hardware.backward_flops_ratio) * forward / (args.hardware.device_gflops * 1e9);
    assert!((report.compute_s - compute).abs() <= 1e-6 * compute, "{} vs {compute}", report.compute_s);
}

/// The MoE main job (README "MoE"): a fine-grained Qwen3-MoE from scratch on BPE tokens — 8
/// blocks of 64 experts, top-8, hidden 256 — with the state on NVMe and a GPU budget below
/// parameters + optimizer state, the hot set alone deciding ([moe] cpu_compute off).
#[test]
fn the_moe_main_job_is_a_fine_grained_qwen3_moe_out_of_gpu_core() {
    let cfg = TrainConfig::load(&common::repo_root().join("configs/qwen3-moe-shakespeare.toml")).unwrap();
    assert_eq!(cfg.model.family(), "qwen3_moe");
    assert!(cfg.data.tokenizer.is_some(), "the MoE main job trains on BPE tokens");
    assert_eq!(cfg.budgets.optimizer_state, StatePlacement::Nvme);
    assert!(!cfg.moe.cpu_compute);
    let vocab = oogc::train::vocab_size(&cfg).unwrap();
    let model = oogc::train::build_model(&cfg, vocab).unwrap();
    let moe = model.moe().expect("an MoE model");
    assert_eq!(moe.experts_per_token(), 8);
    let experts: Vec<(usize, usize)> = model
        .units()
        .iter()
        .filter_map(|u| match u.kind {
            oogc::models::UnitKind::Expert { block, expert } => Some((block, expert)),
            _ => None,
        })
        .collect();
    assert_eq!(experts.len(), 8 * 64, "8 blocks of 64 experts");
    let params: usize = oogc::train::unit_sizes(&*model).iter().sum();
    let gpu = cfg.budgets.gpu.as_u64();
    assert!(gpu < 16 * params as u64, "GPU budget {gpu} B holds parameters + state");
    oogc::train::check_budgets(&cfg, &*model, &|_| Ok(u64::MAX), oogc::dist::World::SINGLE).unwrap();
}
