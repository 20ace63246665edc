//! End-to-end training through the library: offloaded training equals an independent in-memory
//! reference (DESIGN.md invariant 3: `reference`, a plain loop with neither `Runtime` nor the
//! swapper), dense and MoE, and a GPU budget below the working set is refused. (The CLI's runs:
//! `cli/tests/train.rs`.)

use crate::common;
use crate::reference;

use oogc::config::TrainConfig;
use oogc::models::UnitKind;
use oogc::train::Trainer;

use common::{tiny, tiny_mixtral, tiny_moe};

fn run_steps(cfg: TrainConfig, steps: u64) -> (Vec<f64>, Vec<Vec<f32>>, Trainer) {
    let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    let mut losses = Vec::new();
    let mut clipped = 0;
    for _ in 0..steps {
        let out = t.train_step().unwrap();
        clipped += (out.stats.figures.clip_scale < 1.0) as usize;
        losses.push(out.loss);
    }
    assert!(clipped > 0, "the test should exercise clipping (clip_norm 0.5)");
    let params = t.master_weights().unwrap();
    (losses, params, t)
}

#[test]
fn offloaded_training_equals_in_memory_training_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let mut offloaded = TrainConfig::from_toml_str(&tiny("64MiB", "nvme", dir.path(), 2)).unwrap();
    let t = Trainer::new(offloaded.clone(), oogc::dist::Ranks::single()).unwrap();
    let param_bytes = t.num_params() as u64 * 4;
    drop(t);
    // GPU budget: 1/8 of the parameters' bytes; optimizer state on NVMe; prefetch depth 2.
    offloaded.budgets.gpu = bytesize::ByteSize::b(param_bytes / 8);
    let (losses, params, t) = run_steps(offloaded.clone(), 20);

    // The same model, data and AdamW in a plain in-memory loop: bitwise equal (f32).
    let reference = reference::train(&offloaded, 20);
    assert_eq!(losses, reference.losses);
    assert_eq!(params, reference.params);
    assert!(losses[19] < losses[0], "loss should fall: {losses:?}");
    // The offloaded run really moved bytes: evictions and re-fetches, and NVMe state traffic.
    let traffic = t.runtime().memory().traffic();
    assert!(traffic.htod.bytes > 2 * param_bytes, "h2d {} vs params {param_bytes}", traffic.htod.bytes);
    assert!(traffic.nvme_read.bytes > 0 && traffic.nvme_write.bytes > 0);

    // All-resident through the runtime (GPU budget of everything, state in host memory, no
    // prefetch) is the same run too.
    let resident = TrainConfig::from_toml_str(&tiny("64MiB", "host", dir.path(), 0)).unwrap();
    let (losses_r, params_r, _) = run_steps(resident, 20);
    assert_eq!(losses_r, losses);
    assert_eq!(params_r, params);
}

#[test]
fn a_budget_below_the_working_set_is_refused_with_the_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml_str(&tiny("4KiB", "host", dir.path(), 2)).unwrap();
    let err = Trainer::new(cfg, oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains("minimum working set") && err.contains("budgets] gpu"), "{err}");
}

#[test]
fn moe_training_with_hot_and_cpu_experts_equals_in_memory_moe_training() {
    use oogc::train::ExpertPlacement;
    let dir = tempfile::tempdir().unwrap();
    let run = |cfg: TrainConfig, placement: Option<ExpertPlacement>| {
        let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
        if let Some(p) = placement {
            t.set_expert_placement(p);
        }
        let mut out = Vec::new();
        for _ in 0..20 {
            let s = t.train_step().unwrap();
            out.push((s.loss, s.aux_loss, s.cpu_tokens, s.stats.figures.h2d_bytes));
        }
        (out, t.master_weights().unwrap())
    };
    let resident = TrainConfig::from_toml_str(&tiny_moe("64MiB", "host", dir.path())).unwrap();
    let (a, params_a) = run(resident.clone(), Some(ExpertPlacement::default()));
    // The plain in-memory reference (no Runtime, no swapper).
    let reference = reference::train(&resident, 20);
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), reference.losses);
    assert_eq!(params_a, reference.params);
    let offloaded = TrainConfig::from_toml_str(&tiny_moe("96KiB", "nvme", dir.path())).unwrap();
    let placement = ExpertPlacement { hot: [(0, 0), (1, 1), (2, 2)].into(), cpu_max_tokens: 12 };
    let (b, params_b) = run(offloaded.clone(), Some(placement));
    // The placer's own choices (popularity hot set, CPU compute when the cost model says so).
    let (c, params_c) = run(offloaded, None);
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), c.iter().map(|x| x.0).collect::<Vec<_>>());
    assert_eq!(params_a, params_c);
    // Bitwise: the CPU path and the device path run the same candle ops on the sim device.
    let losses = |v: &[(f64, f64, usize, u64)]| v.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>();
    assert_eq!(losses(&a), losses(&b));
    assert_eq!(params_a, params_b);
    assert!(a[19].0 < a[0].0, "loss should fall");
    assert!(a.iter().all(|x| x.1 > 0.0), "the aux loss is part of the objective");
    assert_eq!(a.iter().map(|x| x.2).sum::<usize>(), 0);
    assert!(b.iter().map(|x| x.2).sum::<usize>() > 0, "some experts ran on the CPU");
}

/// [`tiny_llama`] in `dir` in f32 with a GPU budget of a third of its parameters' bytes (at
/// least two of its largest unit), and those bytes.
fn offloaded_tiny_llama(dir: &std::path::Path) -> (TrainConfig, u64) {
    common::offloaded_tiny_llama(dir, oogc::config::ComputeDType::F32)
}

#[test]
fn offloaded_llama_training_on_bpe_tokens_equals_in_memory_training_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, param_bytes) = offloaded_tiny_llama(dir.path());
    assert!(cfg.budgets.gpu.as_u64() < param_bytes);
    let (losses, params, t) = run_steps(cfg.clone(), 12);
    let reference = reference::train(&cfg, 12);
    assert_eq!(losses, reference.losses);
    assert_eq!(params, reference.params);
    assert!(losses[11] < losses[0], "loss should fall: {losses:?}");
    assert!(t.runtime().memory().traffic().htod.bytes > param_bytes, "units were evicted and fetched again");
}

/// Largest `|a - b| / (abs + rel · |b|)` over two runs' parameters (≤ 1 passes), with where.
fn param_excess(a: &[Vec<f32>], b: &[Vec<f32>], rel: f64, abs: f64) -> (f64, String) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0, String::new());
    for (u, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.len(), b.len());
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            let e = (x as f64 - y as f64).abs() / (abs + rel * (y as f64).abs());
            if e > worst.0 || e.is_nan() {
                worst = (e, format!("unit {u} [{i}]: {x} vs {y}"));
            }
        }
    }
    worst
}

/// Trains `micro` (`[train] micro_batches = k`, batch `b`) for `steps` steps through the
/// offloaded runtime and checks it against the in-memory reference of one batch of `k × b`:
/// losses within 1e-5 relative, parameters within 1e-5 relative + 1e-6 absolute (f32 sums in
/// another order: the micro-batches' gradients are added, the big batch's reduced at once).
fn assert_micro_batches_match_the_big_batch(micro: TrainConfig, steps: u64) {
    let k = micro.train.micro_batches;
    assert!(k > 1);
    let mut big = micro.clone();
    big.train.batch_size *= k;
    big.train.micro_batches = 1;
    let (losses, params, t) = run_steps(micro, steps);
    assert!(t.runtime().memory().traffic().htod.bytes > 0);
    drop(t);
    let reference = reference::train(&big, steps);
    for (s, (a, b)) in losses.iter().zip(&reference.losses).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {}: loss {a} vs the big batch's {b}", s + 1);
    }
    let (excess, at) = param_excess(&params, &reference.params, 1e-5, 1e-6);
    assert!(excess <= 1.0, "parameters differ beyond 1e-5 rel + 1e-6 abs ({excess:.2}×) at {at}");
    assert!(losses[steps as usize - 1] < losses[0], "loss should fall: {losses:?}");
}

/// [`tiny`] with state on NVMe in `dir` and a GPU budget of 1/8 of its parameters' bytes, and
/// those bytes.
fn offloaded_tiny_gpt(dir: &std::path::Path) -> (TrainConfig, u64) {
    let mut cfg = TrainConfig::from_toml_str(&tiny("64MiB", "nvme", dir, 2)).unwrap();
    let param_bytes = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap().num_params() as u64 * 4;
    cfg.budgets.gpu = bytesize::ByteSize::b(param_bytes / 8);
    (cfg, param_bytes)
}

#[test]
fn gpt_micro_batches_equal_one_big_batch_within_f32_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, _) = offloaded_tiny_gpt(dir.path());
    cfg.train.batch_size = 2;
    cfg.train.micro_batches = 4;
    assert_micro_batches_match_the_big_batch(cfg, 8);
}

#[test]
fn llama_micro_batches_on_bpe_tokens_equal_one_big_batch_within_f32_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, _) = offloaded_tiny_llama(dir.path());
    cfg.train.batch_size = 1;
    cfg.train.micro_batches = 4;
    // Adam's update `lr · m / (√v + eps)` amplifies a gradient's rounding by up to `lr / eps`
    // where the gradient is near `eps`: with the default 1e-8 a few parameters whose gradient
    // sums cancel to ~1e-8 (3 of 135 072 after one step) move by ~1% of lr between the two
    // summation orders. eps = 1e-5 (LLaMA's own AdamW setting) keeps the update well-conditioned
    // at f32 rounding (worst parameter at 0.32 of the tolerance after 8 steps).
    cfg.optimizer.eps = 1e-5;
    assert_micro_batches_match_the_big_batch(cfg, 8);
}

#[test]
fn parameter_traffic_per_step_does_not_grow_with_micro_batches() {
    // Each unit moves H2D once per phase whatever the micro-batches, and its gradients D2H once:
    // the bytes per step of k = 4 equal those of k = 1 at the same micro-batch size, so the
    // parameter traffic per token falls by 4.
    let dir = tempfile::tempdir().unwrap();
    let (cfg, param_bytes) = offloaded_tiny_gpt(dir.path());
    let traffic = |k: usize| {
        let mut c = cfg.clone();
        c.train.micro_batches = k;
        let mut t = Trainer::new(c, oogc::dist::Ranks::single()).unwrap();
        let steps: Vec<_> = (0..6).map(|_| t.train_step().unwrap()).collect();
        let tokens = steps[0].tokens;
        (steps.iter().map(|s| (s.stats.figures.h2d_bytes, s.stats.figures.d2h_bytes)).collect::<Vec<_>>(), tokens)
    };
    let (one, tokens_one) = traffic(1);
    let (four, tokens_four) = traffic(4);
    assert_eq!(tokens_four, 4 * tokens_one);
    assert_eq!(four, one, "(h2d, d2h) bytes per step");
    assert!(one.iter().all(|&(h2d, _)| h2d > param_bytes), "units were evicted and fetched again: {one:?}");
}

#[test]
fn micro_batches_of_zero_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let text = tiny("64MiB", "host", dir.path(), 2).replace("seq_len = 16", "seq_len = 16\nmicro_batches = 0");
    let err = TrainConfig::from_toml_str(&text).unwrap_err().to_string();
    assert!(err.contains("train.micro_batches"), "{err}");
}

#[test]
fn a_resumed_micro_batch_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = |name: &str| {
        let text = tiny("64MiB", "nvme", &dir.path().join(name).join("nvme"), 2)
            .replace("n_layer = 24", "n_layer = 4")
            .replace("seq_len = 16", "seq_len = 16\nmicro_batches = 3")
            .replace("[threads]", &format!("[checkpoint]\ndir = \"{}\"\n[threads]", dir.path().join(name).display()));
        TrainConfig::from_toml_str(&text).unwrap()
    };
    common::assert_resume_continues_exactly(&config);
}

#[test]
fn offloaded_mixtral_training_equals_in_memory_training_bitwise_under_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    let (nvme, cache) = (dir.path().join("nvme"), dir.path().join("tokens"));
    let cfg = TrainConfig::from_toml_str(&tiny_mixtral(&nvme, &cache, "64MiB", "ours")).unwrap();
    let t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    let param_bytes = t.num_params() as u64 * 4;
    assert!(t.model().moe().is_some());
    drop(t);
    let reference = reference::train(&cfg, 12);
    assert!(reference.losses[11] < reference.losses[0], "loss should fall: {:?}", reference.losses);
    for policy in ["ours", "fetch", "lru"] {
        // Just above the minimum working set (two units in use, the expert budget, staging).
        let gpu = "400KiB";
        assert!(400 * 1024 < param_bytes);
        let cfg = TrainConfig::from_toml_str(&tiny_mixtral(&nvme, &cache, gpu, policy)).unwrap();
        let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
        let mut losses = Vec::new();
        let (mut uses, mut cpu) = (0, 0);
        for _ in 0..12 {
            let out = t.train_step().unwrap();
            assert!(out.aux_loss > 0.0, "{policy}: the pooled aux loss is part of the objective");
            losses.push(out.loss);
            uses += out.expert_traffic.uses;
            cpu += out.cpu_tokens;
        }
        assert_eq!(losses, reference.losses, "{policy}");
        assert_eq!(t.master_weights().unwrap(), reference.params, "{policy}");
        assert!(uses > 0);
        if policy != "ours" {
            assert_eq!(cpu, 0, "{policy}: no CPU compute");
        }
        assert!(
            t.runtime().memory().traffic().htod.bytes > param_bytes,
            "{policy}: units were evicted and fetched again"
        );
    }
}

/// Micro-batches are for dense models: a Mixtral's experts are known only once its model is
/// built (its keys or an init checkpoint's config.json), and the trainer refuses `micro_batches
/// > 1` then, by name, before anything is written.
#[test]
fn a_mixtral_with_micro_batches_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (nvme, cache) = (dir.path().join("nvme"), dir.path().join("tokens"));
    let text =
        tiny_mixtral(&nvme, &cache, "1MiB", "ours").replace("batch_size = 4", "batch_size = 2\nmicro_batches = 2");
    let cfg = TrainConfig::from_toml_str(&text).unwrap();
    let err = Trainer::new(cfg, oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains("train.micro_batches") && err.contains("micro_batches = 1"), "{err}");
    assert!(!nvme.exists(), "nothing written before the refusal");
}

/// An MoE block's experts reach the device in one batched H2D per block and phase (the trainer
/// announces the block's fetch set, `Memory::will_fetch`), not one copy per expert: with 16
/// experts per block, top-4, under the `fetch` policy, a step moves every routed expert's copy
/// (dozens) in at most two H2D operations per block, beside at most three per other unit (its
/// fetches and a prefetch).
#[test]
fn a_blocks_experts_reach_the_device_in_one_batched_copy_per_phase() {
    let dir = tempfile::tempdir().unwrap();
    let (nvme, cache) = (dir.path().join("nvme"), dir.path().join("tokens"));
    let text = tiny_mixtral(&nvme, &cache, "2MiB", "fetch")
        .replace("num_local_experts = 4", "num_local_experts = 16")
        .replace("num_experts_per_tok = 2", "num_experts_per_tok = 4");
    let mut t = Trainer::new(TrainConfig::from_toml_str(&text).unwrap(), oogc::dist::Ranks::single()).unwrap();
    let kinds: Vec<UnitKind> = t.model().units().iter().map(|u| u.kind).collect();
    let experts = kinds.iter().filter(|k| matches!(k, UnitKind::Expert { .. })).count() as u64;
    let blocks = kinds.iter().filter(|k| matches!(k, UnitKind::Expert { expert: 0, .. })).count() as u64;
    let others = kinds.len() as u64 - experts;
    assert_eq!((experts, blocks), (48, 3));
    for step in 1..=3 {
        let before = t.runtime().memory().residency_metrics().htod.ops;
        let out = t.train_step().unwrap();
        let ops = t.runtime().memory().residency_metrics().htod.ops - before;
        // Every routed expert moves H2D: in step 1 nothing is on the device yet, later the last
        // step's update made its device copy stale.
        let moved = out.routed_tokens.iter().flatten().filter(|&&n| n > 0).count() as u64;
        assert!(out.loss.is_finite());
        assert!(moved > 2 * blocks + 3 * others, "step {step}: the step should move many expert copies ({moved})");
        assert!(
            ops <= 2 * blocks + 3 * others,
            "step {step}: {ops} H2D operations for {moved} expert copies in {blocks} blocks and {others} other units"
        );
    }
}
