//! Beyond host memory, end to end through the trainer: parameters homed on NVMe train bitwise
//! as parameters in host memory (and as the in-memory reference); the runtime's host ledger
//! never exceeds `[budgets] host`, nor any category its planned share, under randomized runs;
//! a host budget or an NVMe file system too small is refused before anything is written, with
//! the numbers.

use crate::common;
use crate::reference;

use oogc::config::TrainConfig;
use oogc::swapper::{HostUse, StatePlacement};
use oogc::train::Trainer;
use proptest::prelude::*;

use common::tiny;

fn model_of(cfg: &TrainConfig) -> std::sync::Arc<dyn oogc::models::CausalLm> {
    oogc::train::build_model(cfg, oogc::train::vocab_size(cfg).unwrap()).unwrap()
}

fn units_of(cfg: &TrainConfig) -> Vec<usize> {
    oogc::train::unit_sizes(&*model_of(cfg))
}

/// The tiny config (state on NVMe in `dir`) with a GPU budget of 1/8 of its parameters' bytes:
/// units are evicted and fetched again every step. Returns it, its units' parameters and those
/// bytes.
fn tiny_eighth_on_gpu(dir: &std::path::Path) -> (TrainConfig, Vec<usize>, u64) {
    let mut cfg = TrainConfig::from_toml_str(&tiny("64MiB", "nvme", dir, 2)).unwrap();
    let units = units_of(&cfg);
    let param_bytes: u64 = units.iter().map(|&n| 4 * n as u64).sum();
    cfg.budgets.gpu = bytesize::ByteSize::b(param_bytes / 8);
    (cfg, units, param_bytes)
}

/// Runs `steps` and checks the ledger against the budget and every category against its
/// planned bytes; returns the losses and the final master weights.
fn run_checked(cfg: TrainConfig, steps: u64) -> (Vec<f64>, Vec<Vec<f32>>, Trainer) {
    let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    let losses: Vec<f64> = (0..steps).map(|_| t.train_step().unwrap().loss).collect();
    let params = t.master_weights().unwrap();
    let rt = t.runtime();
    let ledger = rt.memory().host_ledger().report();
    let plan = rt.memory().host_plan().expect("applied at the first step").clone();
    assert!(ledger.peak_bytes <= ledger.budget_bytes, "{ledger:?}");
    for c in &ledger.categories {
        assert!(
            c.peak_bytes <= plan.bytes_of(c.category),
            "{}: peak {} B over its planned {} B ({plan:?})",
            c.category,
            c.peak_bytes,
            plan.bytes_of(c.category)
        );
    }
    (losses, params, t)
}

#[test]
fn parameters_on_nvme_train_bitwise_as_parameters_in_host_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (on_host, units, param_bytes) = tiny_eighth_on_gpu(dir.path());
    let mut on_nvme = on_host.clone();
    on_nvme.budgets.params = StatePlacement::Nvme;
    // A host budget whose compute-copy share holds about a third of the copies: the host tier
    // evicts (writing the optimizer's new copies back to NVMe) and reads them again.
    let plan = oogc::train::host_plan(&on_nvme, &*model_of(&on_nvme), oogc::dist::World::SINGLE);
    let all_copies: u64 = units.iter().map(|&n| oogc::swapper::host::size_class(4 * n) as u64).sum();
    on_nvme.budgets.host = bytesize::ByteSize::b(plan.min_bytes + all_copies / 3);
    on_nvme.optimizer.rollback_budget = Some(bytesize::ByteSize::b(0));

    let (losses_h, params_h, _) = run_checked(on_host.clone(), 20);
    let (losses_n, params_n, t) = run_checked(on_nvme, 20);
    assert_eq!(losses_n, losses_h, "losses differ with parameters on NVMe");
    assert_eq!(params_n, params_h, "master weights differ with parameters on NVMe");
    let reference = reference::train(&on_host, 20);
    assert_eq!(losses_n, reference.losses);
    assert_eq!(params_n, reference.params);
    // The compute copies really lived on NVMe: the residency manager read and wrote them there
    // (the optimizer's state goes through the store directly, not through the manager).
    let m = t.runtime().memory().residency_metrics();
    assert!(m.nvme_read.bytes > param_bytes && m.nvme_write.bytes > param_bytes, "{m:?}");
    assert!(m.evictions > 0);
    let plan = t.runtime().memory().host_plan().unwrap();
    assert!(plan.compute_copies_bytes < all_copies, "{plan:?}");
}

#[test]
fn immediate_updates_hold_a_few_units_gradients_and_train_bitwise_as_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, units, param_bytes) = tiny_eighth_on_gpu(dir.path());
    cfg.budgets.params = StatePlacement::Nvme;
    cfg.optimizer.clip_norm = 0.0;
    let held = oogc::train::host_plan(&cfg, &*model_of(&cfg), oogc::dist::World::SINGLE);
    cfg.optimizer.nonfinite = oogc::optimizer::NonFinite::Stop;
    let plan = oogc::train::host_plan(&cfg, &*model_of(&cfg), oogc::dist::World::SINGLE);
    // The plan no longer holds every unit's gradients, nor any speculation.
    assert!(plan.gradients_bytes < held.gradients_bytes, "{plan:?} vs {held:?}");
    assert_eq!((plan.speculation_bytes, plan.speculative_units), (0, 0), "{plan:?}");
    assert!(plan.min_bytes < held.min_bytes, "{plan:?} vs {held:?}");
    let nvme = oogc::train::nvme_plan(&cfg, &units, oogc::dist::World::SINGLE).unwrap();
    assert_eq!(nvme.speculation_bytes, 0, "{nvme:?}");
    cfg.budgets.host = bytesize::ByteSize::b(plan.min_bytes);

    let (losses, params, t) = run_checked(cfg.clone(), 12);
    let reference = reference::train(&cfg, 12);
    assert_eq!(losses, reference.losses, "immediate updates: losses differ from the in-memory loop");
    assert_eq!(params, reference.params, "immediate updates: master weights differ from the in-memory loop");
    let g = t.runtime().memory().host_ledger().report().of(HostUse::Gradients).peak_bytes;
    assert!(g < param_bytes, "gradients peak {g} B: every unit's ({param_bytes} B) was held");
}

#[test]
fn offloaded_activation_checkpoints_train_bitwise_and_move_once_each_way() {
    let dir = tempfile::tempdir().unwrap();
    let mut kept = TrainConfig::from_toml_str(&tiny("64MiB", "host", dir.path(), 2)).unwrap();
    kept.train.micro_batches = 2;
    let mut offloaded = kept.clone();
    offloaded.activations.offload = true;
    let model = model_of(&offloaded);
    let a = oogc::train::activation_offload(&offloaded, &*model).expect("offload on");
    let d = model.dims();
    assert_eq!(a.checkpoints, d.layers * 2);
    assert_eq!(a.checkpoint_bytes, 4 * 4 * 16 * d.hidden);
    let plan = oogc::train::host_plan(&offloaded, &*model, oogc::dist::World::SINGLE);
    assert!(plan.activations_bytes >= (a.checkpoints * a.checkpoint_bytes) as u64, "{plan:?}");
    assert!(
        plan.min_bytes
            >= oogc::train::host_plan(&kept, &*model, oogc::dist::World::SINGLE).min_bytes + plan.activations_bytes
    );

    let steps = 6;
    let (losses_k, params_k, tk) = run_checked(kept, steps);
    let (losses_o, params_o, to) = run_checked(offloaded, steps);
    assert_eq!(losses_o, losses_k, "losses differ with activation checkpoints offloaded");
    assert_eq!(params_o, params_k, "master weights differ with activation checkpoints offloaded");
    // Every checkpoint went D2H once and came back H2D once, and none is left behind.
    let (k, o) = (tk.runtime().memory().traffic(), to.runtime().memory().traffic());
    let moved = steps * (a.checkpoints * a.checkpoint_bytes) as u64;
    assert_eq!(o.dtoh.bytes - k.dtoh.bytes, moved, "D2H");
    assert_eq!(o.htod.bytes - k.htod.bytes, moved, "H2D");
    assert_eq!(to.runtime().memory().stashed_activations(), 0);
    let peak = to.runtime().memory().host_ledger().report().of(HostUse::Activations).peak_bytes;
    assert!(peak >= (a.checkpoints * a.checkpoint_bytes) as u64 && peak <= plan.activations_bytes, "{peak}");
}

#[test]
fn activation_offload_is_refused_for_moe_blocks_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = TrainConfig::from_toml_str(&common::tiny_moe("64MiB", "host", dir.path())).unwrap();
    cfg.activations.offload = true;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("activations.offload") && err.contains("offload = false"), "{err}");
}

#[test]
fn a_host_budget_below_the_minimum_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme-not-yet");
    let mut cfg = TrainConfig::from_toml_str(&tiny("64MiB", "nvme", &nvme, 2)).unwrap();
    cfg.budgets.host = bytesize::ByteSize::kib(256);
    let min = oogc::train::host_plan(&cfg, &*model_of(&cfg), oogc::dist::World::SINGLE).min_bytes;
    assert!(min > 256 << 10);
    let err = Trainer::new(cfg, oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains(&min.to_string()) && err.contains("[budgets] host") && err.contains("fix"), "{err}");
    assert!(!nvme.exists(), "nothing is written before the refusal");
}

#[test]
fn an_nvme_file_system_too_small_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme-not-yet");
    let mut cfg = TrainConfig::from_toml_str(&tiny("64MiB", "nvme", &nvme, 2)).unwrap();
    cfg.budgets.params = StatePlacement::Nvme;
    let units = units_of(&cfg);
    // The file system as a function: 1 MiB free where the store needs more.
    let store = oogc::train::nvme_plan(&cfg, &units, oogc::dist::World::SINGLE).unwrap();
    let err = oogc::train::check_budgets(&cfg, &*model_of(&cfg), &|_| Ok(1 << 20), oogc::dist::World::SINGLE)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&store.capacity_bytes.to_string()) && err.contains(&(1u64 << 20).to_string()), "{err}");
    assert!(err.contains("free space"), "{err}");
    // The real file system, with a store larger than any disk here.
    cfg.budgets.nvme_size = Some(bytesize::ByteSize::pib(1000));
    let err = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains("NVMe store") && err.contains("free space"), "{err}");
    // Below what the run needs.
    cfg.budgets.nvme_size = Some(bytesize::ByteSize::kib(64));
    let err = Trainer::new(cfg, oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains("nvme_size") && err.contains(&store.min_bytes.to_string()), "{err}");
    assert!(!nvme.exists(), "nothing is written before the refusal");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]
    /// Random placements, host budgets from the minimum to twice it, prefetch depths and
    /// optimizer threads: the runtime's ledger never exceeds the budget, nor any category its
    /// planned share, and the run equals the same run with everything in host memory.
    #[test]
    fn the_runtime_never_exceeds_its_host_budget(
        state_nvme in any::<bool>(),
        params_nvme in any::<bool>(),
        slack in 0.0f64..1.0,
        depth in 0usize..3,
        threads in 1usize..3,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let state = if state_nvme { "nvme" } else { "host" };
        let mut cfg = TrainConfig::from_toml_str(&tiny("64MiB", state, dir.path(), depth)).unwrap();
        if let oogc::config::ModelConfig::Gpt(g) = &mut cfg.model {
            g.n_layer = 6;
        }
        cfg.threads.optimizer = threads;
        let units = units_of(&cfg);
        cfg.budgets.gpu = bytesize::ByteSize::b(units.iter().map(|&n| 4 * n as u64).sum::<u64>() / 3);
        if params_nvme {
            cfg.budgets.params = StatePlacement::Nvme;
        }
        let min = oogc::train::host_plan(&cfg, &*model_of(&cfg), oogc::dist::World::SINGLE).min_bytes;
        cfg.budgets.host = bytesize::ByteSize::b(min + (min as f64 * slack) as u64);
        let (losses, params, t) = run_checked(cfg.clone(), 3);
        prop_assert!(t.runtime().memory().host_ledger().report().of(HostUse::Activations).peak_bytes == 0);
        let mut resident = cfg;
        resident.budgets.params = StatePlacement::Host;
        resident.budgets.optimizer_state = StatePlacement::Host;
        resident.budgets.host = bytesize::ByteSize::gib(1);
        let (losses_r, params_r, _) = run_checked(resident, 3);
        prop_assert_eq!(losses, losses_r);
        prop_assert_eq!(params, params_r);
    }
}

/// The NVMe store of the default size lasts: units of three sizes rewritten copy-on-write every
/// step (the byte-level GPT main job's model, every unit speculated) fragment the free space.
/// Without the store's fragmentation room (`runtime::budget::FRAGMENTATION_EXTENTS`) this run
/// stopped at step 47 with "out of memory on the nvme tier: 5341184 bytes requested, 11567104
/// available" (the main job itself at step 57).
#[test]
fn the_default_nvme_store_outlasts_fragmentation() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = TrainConfig::load(&common::repo_root().join("configs/tinyshakespeare.toml")).unwrap();
    cfg.train.batch_size = 2;
    cfg.train.eval_interval = 0;
    cfg.budgets.nvme_dirs = vec![dir.path().join("nvme")];
    cfg.checkpoint.dir = None;
    cfg.output.metrics = None;
    assert_eq!(cfg.budgets.nvme_size, None, "the default size is what is tested");
    let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    for step in 1..=60 {
        let out = t.train_step().unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert!(out.loss.is_finite(), "step {step}: loss {}", out.loss);
    }
}
