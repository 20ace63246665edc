//! Data-parallel ranks over MPI (`src/dist.rs`) against their oracle: one process with the whole
//! batch. The test starts itself under `mpirun -np 2` (each rank runs this test binary filtered
//! to the test, sees `OMPI_COMM_WORLD_*` and trains its half of every batch), then compares
//! what the ranks wrote with a single process trained on the global batch. Needs the `mpi`
//! feature and Open MPI (`.ci/run` installs it and runs `cargo test -p oogc --features mpi --test
//! ranks`); without the feature the test says it skipped and why.

mod common;

use std::path::{Path, PathBuf};

use oogc::config::TrainConfig;
use oogc::dist::Ranks;
use oogc::optimizer::{MasterDType, StateDType, StateFormat};
use oogc::train::Trainer;

const STEPS: u64 = 20;
const RANKS: usize = 2;

/// The tiny Llama with state on NVMe and a clip norm the gradients exceed (so the global norm
/// decides every step's scale), `batch_size` windows per rank.
fn config(dir: &Path, batch_size: usize) -> TrainConfig {
    TrainConfig::from_toml_str(&config_text(dir, batch_size)).expect("config")
}

/// [`config`]'s TOML.
fn config_text(dir: &Path, batch_size: usize) -> String {
    common::tiny_llama(&dir.join("nvme"), &dir.join("cache"))
        .replace("batch_size = 4", &format!("batch_size = {batch_size}"))
        .replace("steps = 12", &format!("steps = {STEPS}"))
}

/// [`config`] with a GPU budget that keeps a rank's shards and the unit in use, with room to
/// keep a few more units gathered (the embedding and head of 128 KiB each, six blocks of 45
/// KiB, 2 × 128 KiB of gradient staging): gathered units are evicted and gathered again.
fn tight_config(dir: &Path, batch_size: usize) -> TrainConfig {
    let mut cfg = config(dir, batch_size);
    cfg.budgets.gpu = bytesize::ByteSize::kib(800);
    cfg.train.steps = TIGHT_STEPS;
    cfg
}

const TIGHT_STEPS: u64 = 6;

/// [`config`] with what else must keep working across ranks: two micro-batches of
/// `batch_size` windows, activation checkpoints offloaded, the compute copies (and so their
/// shards) on NVMe with the host tier as their cache, immediate updates (no clipping,
/// `nonfinite = "stop"`), and a head tied to the embedding: its unit, the final norm's 32
/// parameters, is too small to give each rank a block of 256, so its compute copy stays whole
/// on every rank (its optimizer state on rank 0 alone) while the others are sharded.
fn features_config(dir: &Path, batch_size: usize) -> TrainConfig {
    let text = config_text(dir, batch_size)
        .replace("max_position_embeddings = 32", "max_position_embeddings = 32\ntie_word_embeddings = true");
    let mut cfg = TrainConfig::from_toml_str(&text).expect("config");
    assert!(text.contains("tie_word_embeddings = true"), "{text}");
    cfg.train.micro_batches = 2;
    cfg.train.steps = FEATURES_STEPS;
    cfg.activations.offload = true;
    cfg.budgets.params = oogc::swapper::StatePlacement::Nvme;
    cfg.optimizer.clip_norm = 0.0;
    cfg.optimizer.nonfinite = oogc::optimizer::NonFinite::Stop;
    cfg
}

const FEATURES_STEPS: u64 = 4;

/// A tiny Mixtral (3 MoE blocks of 16 experts, top-2: with a window per rank, some experts get
/// tokens from one rank only, some from none) with `batch_size` windows, the placer's
/// policy (hot set, cold experts computed on the CPU when cheaper), its optimizer state on NVMe,
/// without the load-balancing loss (each rank's would be its own batch's, as in DeepSpeed and
/// Megatron, not the whole batch's: the oracle compares the language-model loss).
fn moe_config(dir: &Path, batch_size: usize) -> TrainConfig {
    TrainConfig::from_toml_str(&moe_text(dir, batch_size)).expect("config")
}

/// [`moe_config`]'s TOML.
fn moe_text(dir: &Path, batch_size: usize) -> String {
    common::tiny_mixtral(&dir.join("nvme"), &dir.join("cache"), "1MiB", "ours")
        .replace("output_router_logits = true", "output_router_logits = false")
        .replace("num_local_experts = 4", "num_local_experts = 16")
        .replace("batch_size = 4", &format!("batch_size = {batch_size}"))
        .replace("steps = 12", &format!("steps = {MOE_STEPS}"))
        + "device_optimizer = false\n"
}

const MOE_STEPS: u64 = 6;

/// [`moe_config`] as a fine-grained Qwen3-MoE from scratch: 16 experts of width 24 per block,
/// top-4 with the top-k weights renormalized (`norm_topk_prob`), per-head q/k RMSNorm.
fn qwen3_moe_config(dir: &Path, batch_size: usize) -> TrainConfig {
    let text = moe_text(dir, batch_size)
        .replace("family = \"mixtral\"", "family = \"qwen3_moe\"")
        .replace("num_local_experts = 16", "num_experts = 16\nmoe_intermediate_size = 24\nnorm_topk_prob = true")
        .replace("num_experts_per_tok = 2", "num_experts_per_tok = 4");
    let cfg = TrainConfig::from_toml_str(&text).expect("config");
    assert_eq!(cfg.model.family(), "qwen3_moe", "{text}");
    cfg
}

/// [`config`] with reduced optimizer state: `[optimizer] state_dtype` (int8: blocks of 256 with
/// an absmax each) and `master_dtype` (bf16: stochastic rounding).
fn reduced_config(dir: &Path, batch_size: usize, format: StateFormat) -> TrainConfig {
    let mut cfg = config(dir, batch_size);
    cfg.optimizer.state_dtype = format.moments;
    cfg.optimizer.master_dtype = format.master;
    cfg
}

/// The reduced formats the ranks train with (name, outcome suffix, format); the last one also
/// checkpoints at STEPS / 2 and resumes across world sizes.
const REDUCED: [(&str, &str, StateFormat); 3] = [
    ("int8 moments", "-int8", StateFormat { master: MasterDType::F32, moments: StateDType::Int8 }),
    ("bf16 master weights", "-bf16-master", StateFormat { master: MasterDType::Bf16, moments: StateDType::F32 }),
    ("int8 moments + bf16 master weights", "-reduced", BOTH),
];
const BOTH: StateFormat = StateFormat { master: MasterDType::Bf16, moments: StateDType::Int8 };

/// [`config`] writing checkpoints into `ckpt`.
fn config_with_checkpoints(dir: &Path, batch_size: usize, ckpt: &Path) -> TrainConfig {
    let mut cfg = config(dir, batch_size);
    cfg.checkpoint.dir = Some(ckpt.to_path_buf());
    cfg
}

/// The second half of a run resumed from `from` (a checkpoint of step STEPS / 2), with a
/// checkpoint of its own written at its end into `ckpt`.
/// What a run gave: each step's loss, grad norm (-1 when not finite) and whether it was skipped, the validation loss,
/// the master weights (gathered from the ranks' shards), the NVMe bytes of this process's
/// optimizer state; for a resumed run the whole state as loaded, and the state a run saved.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Outcome {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    skipped: Vec<bool>,
    val: f64,
    masters: Vec<Vec<f32>>,
    state_nvme_bytes: u64,
    /// Bytes copied H2D over the run's steps (the compute copies: nothing else goes H2D here).
    h2d_bytes: u64,
    /// Units all-gathered from the ranks' shards, and the bytes received doing it.
    gathers: u64,
    gather_bytes: u64,
    /// The host ledger's peak, all of it and the compute copies' part.
    ledger_peak: u64,
    ledger_copies_peak: u64,
    /// The host ledger's peak of checkpoint staging (a fresh run's: its saves').
    ledger_ckpt_peak: u64,
    /// The GPU bytes of the residency manager's copies at their peak.
    device_peak: u64,
    /// MoE: each step's tokens routed to each expert, `[step][block][expert]`.
    routed: Vec<Vec<Vec<usize>>>,
    loaded: Vec<UnitState>,
    saved: Vec<UnitState>,
}

/// A unit's master weights, `m` and `v` (fp32, `[numel]` each).
type UnitState = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Every unit's whole committed state, gathered from the ranks' shards (a collective: every
/// rank calls it).
fn state(t: &Trainer) -> Vec<UnitState> {
    let rt = t.runtime();
    rt.units().ids().map(|u| rt.unit_state(u).expect("unit state").into_f32()).collect()
}

fn train_resumed(cfg: TrainConfig, from: &Path, ranks: &Ranks) -> Outcome {
    let t = Trainer::resume(cfg, ranks.clone(), from).expect("resume");
    assert_eq!(t.step(), STEPS / 2);
    let loaded = state(&t);
    Outcome { loaded, ..run_to(t, STEPS, Some(STEPS)) }
}

/// Trains `t` to step `last`, writes a checkpoint after step `save_at` (and keeps the state it
/// saved), evaluates.
fn run_to(mut t: Trainer, last: u64, save_at: Option<u64>) -> Outcome {
    let mut saved = Vec::new();
    let (mut losses, mut grad_norms, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
    let (mut h2d_bytes, mut gathers, mut gather_bytes, mut routed) = (0, 0, 0, Vec::new());
    while t.step() < last {
        let o = t.train_step().expect("step");
        h2d_bytes += o.stats.figures.h2d_bytes;
        routed.push(o.routed_tokens.clone());
        gathers += o.stats.gathers;
        gather_bytes += o.stats.gather_bytes;
        losses.push(o.loss);
        // JSON has no NaN: a non-finite norm is written as -1.
        grad_norms.push(if o.stats.figures.grad_norm.is_finite() { o.stats.figures.grad_norm } else { -1.0 });
        skipped.push(o.stats.figures.skipped);
        if save_at == Some(t.step()) {
            t.save_checkpoint().expect("checkpoint");
            saved = state(&t);
        }
    }
    // The budget check before the run (and the summary's plan peak) plans what the runtime
    // applies: on each rank its shards, MoE experts' compute copies whole.
    let applied = t.runtime().memory().host_plan().cloned().expect("a host plan from the first step on");
    let planned = oogc::train::host_plan(t.config(), t.model(), t.world());
    assert_eq!(planned, applied, "train::host_plan against the runtime's plan");
    let val = t.evaluate().expect("evaluate").nats_per_token;
    let state_nvme_bytes = t.runtime().memory().nvme_bytes();
    let masters = t.master_weights().expect("masters");
    let ledger = t.runtime().memory().host_ledger().report();
    Outcome {
        losses,
        grad_norms,
        skipped,
        val,
        masters,
        state_nvme_bytes,
        h2d_bytes,
        gathers,
        gather_bytes,
        ledger_peak: ledger.peak_bytes,
        ledger_copies_peak: ledger.of(oogc::swapper::HostUse::ComputeCopies).peak_bytes,
        ledger_ckpt_peak: ledger.of(oogc::swapper::HostUse::Checkpoint).peak_bytes,
        device_peak: t.runtime().memory().peak_bytes().device,
        routed,
        loaded: Vec::new(),
        saved,
    }
}

fn train(cfg: TrainConfig, ranks: &Ranks) -> Outcome {
    train_steps(cfg, STEPS, ranks)
}

fn train_steps(cfg: TrainConfig, steps: u64, ranks: &Ranks) -> Outcome {
    run_to(Trainer::new(cfg, ranks.clone()).expect("trainer"), steps, None)
}

/// One rank of an `mpirun` run of this test binary: what `OOGC_RANKS_MODE` asks, its outcome
/// written to `OOGC_RANKS_OUT`.
fn rank_main() {
    let out = PathBuf::from(std::env::var("OOGC_RANKS_OUT").expect("OOGC_RANKS_OUT set by the parent"));
    let mpi = oogc::dist::init().expect("MPI");
    let ranks = mpi.ranks();
    let world = ranks.world();
    assert_eq!(world.size, RANKS, "started with -np {RANKS}");
    match std::env::var("OOGC_RANKS_MODE").as_deref() {
        Ok("train") => rank_train(&out, &ranks),
        // Rank 1 poisons its gradients at step 2 (OOGC_NAN_GRADS), or aborts at step 3
        // (OOGC_CRASH_AT): 4 steps.
        Ok("faults") => {
            write_outcome(&out, world.rank, "", &train_steps(config(&out, 4 / RANKS), 4, &ranks));
        }
        Ok("ckpt-faults") => rank_ckpt_faults(&out, &ranks),
        other => panic!("OOGC_RANKS_MODE {other:?}"),
    }
}

/// Starts `RANKS` copies of this test binary filtered to `test` under mpirun, `rank1_env` set
/// for rank 1 only (Open MPI's MPMD form `-np 1 A : -np 1 A`); returns its status and output.
fn launch(test: &str, mode: &str, out: &Path, rank1_env: &[(&str, &str)]) -> std::process::Output {
    launch_with(test, mode, out, rank1_env, None)
}

/// [`launch`], rank 1 started through `sh -c` running `rank1_sh` first (then `exec`ing the
/// test binary: what the shell sets, such as an ignored signal, is inherited).
fn launch_with(
    test: &str,
    mode: &str,
    out: &Path,
    rank1_env: &[(&str, &str)],
    rank1_sh: Option<&str>,
) -> std::process::Output {
    let mpirun = mpirun().expect("mpirun not on PATH: install Open MPI (apt-get install openmpi-bin libopenmpi-dev)");
    let exe = std::env::current_exe().unwrap();
    let args = ["--exact", test, "--nocapture", "--test-threads=1"];
    let mut cmd = std::process::Command::new(mpirun);
    cmd.args(["--allow-run-as-root", "--oversubscribe"])
        .args([
            "-x",
            "OOGC_RANKS_OUT",
            "-x",
            "OOGC_RANKS_MODE",
            "-x",
            "RAYON_NUM_THREADS=1",
            "-x",
            "OMPI_MCA_plm=isolated",
        ])
        .args(["-np", "1"])
        .arg(&exe)
        .args(args)
        .arg(":")
        .args(["-np", "1"]);
    for (k, v) in rank1_env {
        cmd.args(["-x", &format!("{k}={v}")]);
    }
    if let Some(script) = rank1_sh {
        cmd.args(["sh", "-c", &format!("{script}; exec \"$0\" \"$@\"")]);
    }
    cmd.arg(&exe).args(args).env("OOGC_RANKS_OUT", out).env("OOGC_RANKS_MODE", mode).env("OMPI_MCA_plm", "isolated");
    cmd.output().expect("mpirun starts")
}

/// Whether this process is a rank (then it ran [`rank_main`]), or the test cannot run here (it
/// said why).
fn as_rank_or_skipped(test: &str) -> bool {
    if oogc::dist::launched_by_mpirun().is_some() {
        rank_main();
        return true;
    }
    if !cfg!(feature = "mpi") {
        oogc::swapper::skip::skip(
            oogc::swapper::skip::Capability::Ranks,
            test,
            "built without the `mpi` feature (run `cargo test -p oogc --features mpi --test ranks`, with Open MPI \
             installed, as .ci/run does)",
        );
        return true;
    }
    false
}

fn rank_train(out: &Path, ranks: &Ranks) {
    let world = ranks.world();
    write_outcome(out, world.rank, "", &train(config(out, 4 / RANKS), ranks));
    let tight = tight_config(&out.join("tight"), 4 / RANKS);
    write_outcome(out, world.rank, "-tight", &train_steps(tight, TIGHT_STEPS, ranks));
    let features = features_config(&out.join("features"), 2 / RANKS);
    write_outcome(out, world.rank, "-features", &train_steps(features, FEATURES_STEPS, ranks));
    write_outcome(out, world.rank, "-moe", &train_steps(moe_config(&out.join("moe"), 2 / RANKS), MOE_STEPS, ranks));
    let qwen3 = qwen3_moe_config(&out.join("qwen3-moe"), 2 / RANKS);
    write_outcome(out, world.rank, "-qwen3-moe", &train_steps(qwen3, MOE_STEPS, ranks));
    // Resumed at another world size: the one process's checkpoint of step STEPS / 2, re-sharded.
    let cfg = config_with_checkpoints(&out.join("resumed"), 4 / RANKS, &out.join("ckpt-ranks"));
    write_outcome(out, world.rank, "-resumed", &train_resumed(cfg, &out.join("ckpt-one"), ranks));
    // Resumed at the same world size: the checkpoint these ranks just wrote, as loaded.
    let again =
        Trainer::resume(config(&out.join("again"), 4 / RANKS), ranks.clone(), &out.join("ckpt-ranks")).expect("resume");
    let loaded = state(&again);
    let outcome = Outcome { loaded, ..Outcome::default() };
    write_outcome(out, world.rank, "-again", &outcome);
    // Reduced state: each format's whole run, the last with a checkpoint at STEPS / 2; and its
    // second half resumed from one process's checkpoint of STEPS / 2.
    for (_, suffix, format) in REDUCED {
        let mut reduced = reduced_config(&out.join(&suffix[1..]), 4 / RANKS, format);
        let save_at = (format == BOTH).then_some(STEPS / 2);
        reduced.checkpoint.dir = save_at.map(|_| out.join("ckpt-ranks-reduced"));
        let t = Trainer::new(reduced, ranks.clone()).expect("trainer");
        write_outcome(out, world.rank, suffix, &run_to(t, STEPS, save_at));
    }
    let mut cfg = reduced_config(&out.join("reduced-resumed"), 4 / RANKS, BOTH);
    cfg.checkpoint.dir = Some(out.join("ckpt-ranks-reduced-resumed"));
    write_outcome(out, world.rank, "-reduced-resumed", &train_resumed(cfg, &out.join("ckpt-one-reduced"), ranks));
    // The ranks' own sharded checkpoint of STEPS / 2 (int8 + bf16), resumed at the same world
    // size: the rest of the uninterrupted run.
    let cfg = reduced_config(&out.join("reduced-again"), 4 / RANKS, BOTH);
    let t = Trainer::resume(cfg, ranks.clone(), &out.join("ckpt-ranks-reduced")).expect("resume the ranks' shards");
    write_outcome(out, world.rank, "-reduced-again", &run_to(t, STEPS, None));
}

/// A rank's outcome, as `dir/rank{rank}{suffix}.json`.
fn write_outcome(dir: &Path, rank: usize, suffix: &str, outcome: &Outcome) {
    std::fs::write(dir.join(format!("rank{rank}{suffix}.json")), serde_json::to_vec(outcome).unwrap()).unwrap();
}

/// Every rank's outcome written by [`write_outcome`], in rank order.
fn read_outcomes(dir: &Path, suffix: &str) -> Vec<Outcome> {
    (0..RANKS)
        .map(|r| {
            let path = dir.join(format!("rank{r}{suffix}.json"));
            serde_json::from_slice(&std::fs::read(&path).expect("the rank wrote its outcome")).unwrap()
        })
        .collect()
}

fn mpirun() -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join("mpirun")).find(|p| p.exists())
}

#[test]
fn two_ranks_train_as_one_process_with_the_whole_batch() {
    const TEST: &str = "two_ranks_train_as_one_process_with_the_whole_batch";
    if as_rank_or_skipped(TEST) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ranks_dir = dir.path().join("ranks");
    std::fs::create_dir_all(&ranks_dir).unwrap();
    // A checkpoint of step STEPS / 2 from one process, for the ranks to resume from.
    let one_saved = {
        let cfg = config_with_checkpoints(&dir.path().join("half"), 4, &ranks_dir.join("ckpt-one"));
        let mut t = Trainer::new(cfg, Ranks::single()).expect("trainer");
        for _ in 0..STEPS / 2 {
            t.train_step().expect("step");
        }
        t.save_checkpoint().expect("checkpoint");
        state(&t)
    };
    let (one_reduced_saved, one_ckpt_peak) = {
        let mut cfg = reduced_config(&dir.path().join("half-reduced"), 4, BOTH);
        cfg.checkpoint.dir = Some(ranks_dir.join("ckpt-one-reduced"));
        let mut t = Trainer::new(cfg, Ranks::single()).expect("trainer");
        for _ in 0..STEPS / 2 {
            t.train_step().expect("step");
        }
        t.save_checkpoint().expect("checkpoint");
        let ledger = t.runtime().memory().host_ledger().report();
        (state(&t), ledger.of(oogc::swapper::HostUse::Checkpoint).peak_bytes)
    };
    let ran = launch(TEST, "train", &ranks_dir, &[]);
    assert!(ran.status.success(), "mpirun -np {RANKS}: {}\n{}", ran.status, String::from_utf8_lossy(&ran.stderr));
    let ranks = read_outcomes(&ranks_dir, "");
    // Every rank ends with the same parameters: the same averaged gradients, the same clip scale.
    for (r, o) in ranks.iter().enumerate().skip(1) {
        assert!(o.masters == ranks[0].masters, "rank {r}'s master weights differ from rank 0's");
        assert_eq!(o.losses, ranks[0].losses, "rank {r} reports other losses");
        assert_eq!(o.val, ranks[0].val);
    }
    // The oracle: one process, the whole batch (the ranks' shards together), the same steps.
    let one = train(config(&dir.path().join("one"), 4), &Ranks::single());
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
    for (s, (a, b)) in ranks[0].losses.iter().zip(&one.losses).enumerate() {
        assert!(rel(*a, *b) < 1e-5, "step {}: loss {a} over 2 ranks, {b} in one process", s + 1);
    }
    for (s, (a, b)) in ranks[0].grad_norms.iter().zip(&one.grad_norms).enumerate() {
        assert!(rel(*a, *b) < 1e-4, "step {}: grad norm {a} over 2 ranks, {b} in one process", s + 1);
    }
    assert!(rel(ranks[0].val, one.val) < 1e-5, "validation {} vs {}", ranks[0].val, one.val);
    // Parameters: the reductions sum in another order (rank means, then their mean), so not
    // bitwise; within Adam's amplification of float rounding over STEPS steps.
    let worst = max_abs_diff(&ranks[0].masters, &one.masters);
    assert!(worst < 1e-4, "master weights differ by up to {worst}");
    // ZeRO-style sharding: each rank's optimizer state (on NVMe here) is its share of the
    // one process's, not all of it.
    for (r, o) in ranks.iter().enumerate() {
        let share = o.state_nvme_bytes as f64 / one.state_nvme_bytes as f64;
        assert!(
            share < 0.6,
            "rank {r} holds {} bytes of optimizer state on NVMe, {share:.2} × the one process's {}",
            o.state_nvme_bytes,
            one.state_nvme_bytes
        );
    }
    let max_rel = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| rel(*x, *y)).fold(0.0, f64::max);
    // ZeRO-3: the compute copies are sharded too. Each rank's host ledger, H2D and device
    // copies are its share of the one process's; every unit is gathered once a step (a 64 MiB
    // budget keeps it gathered from its forward to its backward).
    let units = one.masters.len() as u64;
    for (r, o) in ranks.iter().enumerate() {
        eprintln!(
            "rank {r}: H2D {} B, {} all-gathers receiving {} B, host ledger peak {} B (compute copies {} B), device \
             copies' peak {} B; one process: H2D {} B, host ledger peak {} B (compute copies {} B), device copies' \
             peak {} B",
            o.h2d_bytes,
            o.gathers,
            o.gather_bytes,
            o.ledger_peak,
            o.ledger_copies_peak,
            o.device_peak,
            one.h2d_bytes,
            one.ledger_peak,
            one.ledger_copies_peak,
            one.device_peak
        );
        for (what, mine, all) in [
            ("H2D", o.h2d_bytes, one.h2d_bytes),
            ("host ledger peak", o.ledger_peak, one.ledger_peak),
            ("compute copies' host bytes", o.ledger_copies_peak, one.ledger_copies_peak),
            ("device copies' peak", o.device_peak, one.device_peak),
        ] {
            let share = mine as f64 / all as f64;
            assert!(share > 0.4 && share < 0.6, "rank {r}: {what} {mine} B is {share:.2} × the one process's {all} B");
        }
        assert_eq!(o.gathers, units * STEPS, "rank {r}: one all-gather per unit and step");
        assert!(o.gather_bytes > 0 && o.gather_bytes < one.h2d_bytes, "rank {r}: gathered {} B", o.gather_bytes);
    }
    assert_eq!(one.gathers, 0, "one process gathers nothing");
    // A budget that cannot keep every unit gathered: gathered units are evicted by next use
    // and gathered again, the same on both ranks (or they would hang in mismatched
    // all-gathers), and the run is still the one process's.
    let tight = read_outcomes(&ranks_dir, "-tight");
    let one_tight = train_steps(tight_config(&dir.path().join("one-tight"), 4), TIGHT_STEPS, &Ranks::single());
    assert_eq!(tight[0].gathers, tight[1].gathers);
    assert!(
        tight[0].gathers > units * TIGHT_STEPS && tight[0].gathers < 2 * units * TIGHT_STEPS,
        "{} all-gathers in {TIGHT_STEPS} steps of {units} units: not between one and two per unit and step",
        tight[0].gathers
    );
    assert_same_run("tight budget", &tight, &one_tight);
    // Micro-batches, activation offload, parameter shards on NVMe, immediate updates: the same
    // run as one process's with the whole batch.
    let features = read_outcomes(&ranks_dir, "-features");
    let one_features =
        train_steps(features_config(&dir.path().join("one-features"), 2), FEATURES_STEPS, &Ranks::single());
    assert!(features[0].gathers > 0, "the features run gathered nothing");
    assert_same_run("micro-batches etc.", &features, &one_features);
    assert_eq!(features[0].losses.len() as u64, FEATURES_STEPS);
    let worst_features = max_abs_diff(&features[0].masters, &one_features.masters);
    assert!(worst_features < 1e-4, "micro-batches etc.: master weights differ by up to {worst_features}");
    // A Mixtral: each rank routes its own tokens and fetches (or computes on the CPU) the experts
    // they need, whole; an expert only the other rank used gets zero gradients here; the
    // trunks are sharded and gathered. The same run as one process's.
    for (name, suffix, config) in [
        ("Mixtral", "-moe", moe_config as fn(&Path, usize) -> TrainConfig),
        ("Qwen3-MoE", "-qwen3-moe", qwen3_moe_config),
    ] {
        let moe = read_outcomes(&ranks_dir, suffix);
        let one_moe = train_steps(config(&dir.path().join(format!("one{suffix}")), 2), MOE_STEPS, &Ranks::single());
        // The cases the ranks must agree on happened: an expert routed tokens by one rank only
        // (the other pushes zeros), and one routed none by either (neither pushes, neither
        // updates it).
        let (mut one_side, mut neither) = (0, 0);
        for (a, b) in moe[0].routed.iter().flatten().flatten().zip(moe[1].routed.iter().flatten().flatten()) {
            one_side += usize::from((*a == 0) != (*b == 0));
            neither += usize::from(*a == 0 && *b == 0);
        }
        assert!(
            one_side > 0 && neither > 0,
            "{name}: experts used by one rank only: {one_side}, by neither: {neither}"
        );
        assert_eq!(moe[0].losses.len() as u64, MOE_STEPS);
        assert_same_run(name, &moe, &one_moe);
        let worst_moe = max_abs_diff(&moe[0].masters, &one_moe.masters);
        assert!(worst_moe < 1e-4, "{name}: master weights differ by up to {worst_moe}");
        assert!(moe[0].gathers > 0 && moe[0].state_nvme_bytes * 10 < one_moe.state_nvme_bytes * 6, "{name}");
        eprintln!(
            "{name} on 2 ranks: losses ≤ {:.1e} rel., master weights ≤ {worst_moe:.1e}, {} all-gathers of trunks, \
             embedding and head per rank; experts used by one rank only {one_side} times, by neither {neither}",
            max_rel(&moe[0].losses, &one_moe.losses),
            moe[0].gathers
        );
    }
    eprintln!(
        "micro-batches, activation offload, parameters on NVMe, immediate updates: losses ≤ {:.1e} rel., master \
         weights ≤ {worst_features:.1e}",
        max_rel(&features[0].losses, &one_features.losses)
    );
    eprintln!(
        "tight GPU budget (800 KiB): {} all-gathers per rank over {TIGHT_STEPS} steps of {units} units, H2D {} B per \
         rank against {} B in one process",
        tight[0].gathers, tight[0].h2d_bytes, one_tight.h2d_bytes
    );
    eprintln!(
        "{RANKS} ranks vs one process, {STEPS} steps: losses ≤ {:.1e} rel., grad norms ≤ {:.1e} rel., \
         validation {:.1e} rel., master weights ≤ {worst:.1e}; optimizer state on NVMe per rank {:?} of {} bytes",
        max_rel(&ranks[0].losses, &one.losses),
        max_rel(&ranks[0].grad_norms, &one.grad_norms),
        rel(ranks[0].val, one.val),
        ranks.iter().map(|o| o.state_nvme_bytes).collect::<Vec<_>>(),
        one.state_nvme_bytes
    );
    // Resumed on 2 ranks from one process's checkpoint: the second half of the one process's
    // run; and the checkpoint rank 0 wrote holds the state the ranks gathered, bit for bit.
    let resumed = read_outcomes(&ranks_dir, "-resumed");
    assert!(resumed[1].masters == resumed[0].masters, "resumed ranks differ");
    for (s, (a, b)) in resumed[0].losses.iter().zip(&one.losses[STEPS as usize / 2..]).enumerate() {
        assert!(
            rel(*a, *b) < 1e-5,
            "resumed step {}: loss {a} over 2 ranks, {b} in one process",
            s as u64 + 1 + STEPS / 2
        );
    }
    let worst_resumed = max_abs_diff(&resumed[0].masters, &one.masters);
    assert!(worst_resumed < 1e-4, "resumed master weights differ by up to {worst_resumed}");
    // Checkpoints across world sizes, master weights and Adam state bitwise as saved: one
    // process's at 2 ranks, the 2 ranks' at 2 ranks again and in one process.
    assert!(
        one_saved.len() > 1
            && one_saved.iter().all(|(p, m, v)| !p.is_empty() && m.len() == p.len() && v.len() == p.len())
    );
    for (r, o) in resumed.iter().enumerate() {
        assert!(o.loaded == one_saved, "rank {r} resumed one process's checkpoint as another state");
    }
    let saved = &resumed[0].saved;
    assert!(resumed[1].saved == *saved, "the ranks gathered different states at their checkpoint");
    for (r, again) in read_outcomes(&ranks_dir, "-again").iter().enumerate() {
        assert!(again.loaded == *saved, "rank {r} resumed the ranks' checkpoint as another state");
    }
    let reloaded =
        Trainer::resume(config(&dir.path().join("reload"), 4), Ranks::single(), &ranks_dir.join("ckpt-ranks"))
            .expect("the ranks' checkpoint loads in one process");
    assert!(state(&reloaded) == *saved, "one process loaded the ranks' checkpoint as another state");
    // And the run moved them: the comparison is not between two untouched initialisations.
    let init = train_zero_steps(&dir.path().join("init"));
    let moved = one.masters.iter().flatten().zip(init.iter().flatten()).filter(|(a, b)| a != b).count();
    assert!(moved > 0, "training changed no parameter");
    reduced_state_over_ranks(dir.path(), &ranks_dir, &one_reduced_saved);
    sharded_checkpoint(dir.path(), &ranks_dir, one_ckpt_peak);
}

/// The ranks' checkpoint (int8 moments + bf16 masters, step STEPS / 2): each rank wrote its own
/// shard file and rank 0 an index naming them and each unit's ranges (no single file); the
/// shards hold together exactly the bytes one process's file of the same state holds, about
/// half each; rank 0 staged only its shard while saving (the host ledger's checkpoint peak about
/// half one process's: it gathered nothing); resumed at 2 ranks it is the rest of the
/// uninterrupted run bit for bit (at 1 rank: [`reduced_state_over_ranks`]).
fn sharded_checkpoint(dir: &Path, ranks_dir: &Path, one_ckpt_peak: u64) {
    use oogc::checkpoint::{shards, AnyReader, Reader};
    let ckpt = ranks_dir.join("ckpt-ranks-reduced");
    let step = STEPS / 2;
    let mut names: Vec<String> =
        std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let files: Vec<String> = (0..RANKS).map(|r| shards::shard_file_name(step, r, RANKS)).collect();
    let index_name = format!("ckpt-{step:08}.index.json");
    let mut want: Vec<String> = files.iter().cloned().chain([index_name.clone(), ".oogc.lock".into()]).collect();
    want.sort();
    assert_eq!(names, want, "the ranks' checkpoint directory");
    let index = shards::ShardIndex::read(&ckpt.join(&index_name)).expect("the index");
    assert_eq!((index.step, index.world_size, &index.files), (step, RANKS, &files));
    let one = AnyReader::open(&dir.join("ckpt-reduced-one")).expect("one process's checkpoint of the same state");
    let AnyReader::File(one) = one else { panic!("one process writes a single file") };
    let numels: Vec<usize> = index.units.iter().map(|u| u.numel).collect();
    assert!(numels.iter().sum::<usize>() > 0 && numels.len() > 1);
    for u in &index.units {
        let ranges: Vec<[usize; 2]> = (0..RANKS)
            .map(|r| {
                let s = oogc::dist::shard_range(u.numel, r, RANKS);
                [s.start, s.end]
            })
            .collect();
        assert_eq!(u.ranges, ranges, "unit {}: each rank's range is its optimizer's shard", u.name);
    }
    let shards: Vec<Reader> = files.iter().map(|f| Reader::open(&ckpt.join(f)).expect("a shard")).collect();
    let bytes: Vec<u64> = shards.iter().map(Reader::data_bytes).collect();
    assert_eq!(bytes.iter().sum::<u64>(), one.data_bytes(), "the shards hold other bytes than one process's file");
    for (r, b) in bytes.iter().enumerate() {
        let share = *b as f64 / one.data_bytes() as f64;
        assert!(share > 0.4 && share < 0.6, "rank {r}'s shard holds {b} B, {share:.2} × one process's file");
    }
    // Rank 0's staging while saving: its shard of the largest unit (and the writer's buffer),
    // not the whole unit one process (or a gathering rank) stages.
    let ranks = read_outcomes(ranks_dir, "-reduced");
    let buffer = oogc::checkpoint::WRITE_BUFFER_BYTES as u64;
    let share = (ranks[0].ledger_ckpt_peak - buffer) as f64 / (one_ckpt_peak - buffer) as f64;
    eprintln!(
        "sharded checkpoint of step {step} over {RANKS} ranks: shard files of {bytes:?} B (one process's file {} B); \
         rank 0's checkpoint staging peak {} B against one process's {one_ckpt_peak} B ({share:.2} × beyond the \
         {buffer} B write buffer)",
        one.data_bytes(),
        ranks[0].ledger_ckpt_peak
    );
    assert!(share > 0.4 && share < 0.6, "rank 0 staged {share:.2} × one process's checkpoint state while saving");
    // `oogc inspect --verify` and `oogc export --hf` read the shards: every file's crc32c, and
    // the same Hugging Face weights as one process's file of the same state.
    let verified = oogc::checkpoint::verify(&ckpt).expect("the shards verify");
    let tensors = shards.iter().map(|r| r.names().len()).sum();
    assert_eq!(verified, oogc::checksum::Verification::Verified { tensors, bytes: one.data_bytes() });
    let opts = oogc::export::ExportOptions::default();
    let from_shards = oogc::export::export_hf(&ckpt, &dir.join("hf-shards"), &opts).expect("export the shards");
    let from_one = oogc::export::export_hf(one.path(), &dir.join("hf-one"), &opts).expect("export one file");
    assert_eq!(from_shards.step, step);
    assert_eq!(from_shards.weights.files.len(), from_one.weights.files.len());
    for (a, b) in from_shards.weights.files.iter().zip(&from_one.weights.files) {
        assert!(std::fs::read(a).unwrap() == std::fs::read(b).unwrap(), "exported {} differs", a.display());
    }
    // Resumed at 2 ranks from the shards: the uninterrupted run's second half, bit for bit.
    let again = read_outcomes(ranks_dir, "-reduced-again");
    assert_eq!(again[0].losses, ranks[0].losses[STEPS as usize / 2..], "resumed at 2 ranks: other losses");
    assert!(again[0].masters == ranks[0].masters, "resumed at 2 ranks: other master weights");
}

/// Reduced optimizer state over 2 ranks (int8 moments, bf16 master weights, both): each run is
/// the one process's with the whole batch (a shard starts on an int8 block, and a bf16 master
/// rounds by its index in the unit); the ranks' checkpoint holds the state as stored (I8/U8
/// codes, f32 absmaxes, BF16 masters), the tensors one process writes of the same state, and
/// resumes at one rank; one process's resumes at 2 ranks.
fn reduced_state_over_ranks(dir: &Path, ranks_dir: &Path, one_saved: &[UnitState]) {
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
    let max_rel = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| rel(*x, *y)).fold(0.0, f64::max);
    let mut measured = Vec::new();
    for (name, suffix, format) in REDUCED {
        let ranks = read_outcomes(ranks_dir, suffix);
        assert_eq!(ranks[0].losses.len() as u64, STEPS);
        assert!(ranks[1].masters == ranks[0].masters, "{name}: the ranks' master weights differ");
        assert_eq!(ranks[1].losses, ranks[0].losses, "{name}: the ranks report other losses");
        let one = train(reduced_config(&dir.join(format!("one{suffix}")), 4, format), &Ranks::single());
        let worst = max_abs_diff(&ranks[0].masters, &one.masters);
        let differ = ranks[0].masters.iter().flatten().zip(one.masters.iter().flatten()).filter(|(a, b)| a != b);
        let line = format!(
            "{name}, {RANKS} ranks vs one process, {STEPS} steps: losses ≤ {:.1e} rel., grad norms ≤ {:.1e} rel. \
             (per step {}), validation {:.1e} rel., master weights ≤ {worst:.1e} ({} of {} differ)",
            max_rel(&ranks[0].losses, &one.losses),
            max_rel(&ranks[0].grad_norms, &one.grad_norms),
            ranks[0]
                .grad_norms
                .iter()
                .zip(&one.grad_norms)
                .map(|(a, b)| format!("{:.0e}", rel(*a, *b)))
                .collect::<Vec<_>>()
                .join(" "),
            rel(ranks[0].val, one.val),
            differ.count(),
            one.masters.iter().map(Vec::len).sum::<usize>(),
        );
        eprintln!("{line}");
        measured.push((name, ranks, one));
    }
    // Not the f32 case's tolerances: the ranks' gradients differ from the one process's in the
    // last bits (another summation order), and quantization amplifies that — an int8 code or a
    // stochastically rounded bf16 that lands on the other side of its threshold moves by a
    // whole step (1/127 of a block's absmax, a bf16 ulp) where f32 moves by an ulp. Measured
    // (20 steps, tiny Llama): losses ≤ 9.3e-6 rel., grad norms ≤ 4.5e-3 rel., master weights
    // ≤ 4.6e-3 (about one bf16 ulp); the f32 case: 2.1e-7, 7.2e-7, 1.8e-5. The first two steps
    // are the sharp check: step 2's gradients come from one sharded update, which rounds and
    // quantizes as one process's only when the shards start on blocks and the rounding keys
    // on the unit's indices (measured ≤ 3e-7 rel.; f32 ≤ 7.2e-7).
    for (name, ranks, one) in &measured {
        for (s, (a, b)) in ranks[0].losses.iter().zip(&one.losses).enumerate() {
            assert!(rel(*a, *b) < 3e-5, "{name}, step {}: loss {a} over 2 ranks, {b} in one process", s + 1);
        }
        for (s, (a, b)) in ranks[0].grad_norms.iter().zip(&one.grad_norms).enumerate() {
            let tolerance = if s < 2 { 1e-6 } else { 1e-2 };
            assert!(rel(*a, *b) < tolerance, "{name}, step {}: grad norm {a} over 2 ranks, {b} in one process", s + 1);
        }
        assert!(rel(ranks[0].val, one.val) < 1e-5, "{name}: validation {} vs {}", ranks[0].val, one.val);
        let worst = max_abs_diff(&ranks[0].masters, &one.masters);
        assert!(worst < 1e-2, "{name}: master weights differ by up to {worst}");
    }
    let (_, ranks, one) = measured.pop().expect("the int8 + bf16 run");
    assert!(ranks[1].saved == ranks[0].saved, "reduced state: the ranks gathered different states");
    // bf16 master weights, all of them: the values a bf16 holds.
    assert!(ranks[0].masters.iter().flatten().all(|x| half::bf16::from_f32(*x).to_f32() == *x));
    // The shards together are about half of the one process's state on NVMe each, in the
    // reduced format's bytes (2 B master + 2.03 B moments per parameter), about half of the f32
    // run's (which keeps its f32 master weights in the f32 compute copies: 8 B of moments).
    let f32_ranks = read_outcomes(ranks_dir, "");
    for (r, o) in ranks.iter().enumerate() {
        let share = o.state_nvme_bytes as f64 / one.state_nvme_bytes as f64;
        let against_f32 = o.state_nvme_bytes as f64 / f32_ranks[r].state_nvme_bytes as f64;
        assert!(
            share > 0.4 && share < 0.6,
            "rank {r}: {} B of reduced state, {share:.2} × one process's",
            o.state_nvme_bytes
        );
        let want = 4.03125 / 8.0;
        assert!(
            (against_f32 - want).abs() < 0.05,
            "rank {r}: reduced state {against_f32:.2} × the f32 state's bytes, not about {want:.2}"
        );
    }
    // The ranks' checkpoint (step STEPS / 2) holds int8 codes, absmaxes and bf16 masters...
    let ckpt = oogc::checkpoint::AnyReader::open(&ranks_dir.join("ckpt-ranks-reduced")).expect("the ranks' checkpoint");
    assert_eq!(ckpt.step().unwrap(), STEPS / 2);
    let kinds = |r: &oogc::checkpoint::AnyReader| -> Vec<(String, String)> {
        r.names().into_iter().map(|n| (format!("{:?}", r.info(&n).unwrap().0), n)).collect()
    };
    let names = kinds(&ckpt);
    for (dtype, suffix) in [("I8", ".exp_avg"), ("U8", ".exp_avg_sq"), ("F32", ".exp_avg.absmax"), ("BF16", ".weight")]
    {
        assert!(names.iter().any(|(d, n)| d == dtype && n.ends_with(suffix)), "no {dtype} tensor {suffix}: {names:?}");
    }
    // ...and loads in one process as the state the ranks gathered; saved again by that process,
    // every tensor is the same: the file one process writes of that state.
    let mut cfg = reduced_config(&dir.join("reduced-one"), 4, BOTH);
    cfg.checkpoint.dir = Some(dir.join("ckpt-reduced-one"));
    let mut t = Trainer::resume(cfg, Ranks::single(), &ranks_dir.join("ckpt-ranks-reduced")).expect("resume at 1 rank");
    assert!(state(&t) == ranks[0].saved, "one process loaded the ranks' reduced checkpoint as another state");
    t.save_checkpoint().expect("checkpoint");
    let again = oogc::checkpoint::AnyReader::open(&dir.join("ckpt-reduced-one")).expect("one process's checkpoint");
    assert_eq!(kinds(&again), names);
    for (_, name) in &names {
        let (a, b) = (ckpt.tensor(name).unwrap().unwrap(), again.tensor(name).unwrap().unwrap());
        assert!(a.data == b.data, "tensor {name}: the ranks saved other values than one process");
    }
    // Resumed at 1 rank: the ranks' second half.
    let resumed_one = run_to(t, STEPS, None);
    for (s, (a, b)) in resumed_one.losses.iter().zip(&ranks[0].losses[STEPS as usize / 2..]).enumerate() {
        let step = s as u64 + 1 + STEPS / 2;
        assert!(rel(*a, *b) < 3e-5, "reduced, resumed at 1 rank, step {step}: loss {a}, {b} over 2 ranks");
    }
    // One process's reduced checkpoint resumed at 2 ranks: loaded as saved, the second half of
    // the one process's run.
    let resumed = read_outcomes(ranks_dir, "-reduced-resumed");
    for (r, o) in resumed.iter().enumerate() {
        assert!(o.loaded == one_saved, "rank {r} resumed one process's reduced checkpoint as another state");
    }
    assert!(resumed[1].masters == resumed[0].masters, "reduced state: resumed ranks differ");
    for (s, (a, b)) in resumed[0].losses.iter().zip(&one.losses[STEPS as usize / 2..]).enumerate() {
        let step = s as u64 + 1 + STEPS / 2;
        assert!(rel(*a, *b) < 3e-5, "reduced, resumed at 2 ranks, step {step}: loss {a}, {b} in one process");
    }
    let worst_resumed = max_abs_diff(&resumed[0].masters, &one.masters);
    assert!(worst_resumed < 1e-2, "reduced state resumed at 2 ranks: master weights differ by up to {worst_resumed}");
    eprintln!(
        "int8 moments + bf16 master weights: resumed at 1 rank losses ≤ {:.1e} rel., at 2 ranks ≤ {:.1e} rel., \
         master weights ≤ {worst_resumed:.1e}; state on NVMe per rank {:?} of {} bytes",
        max_rel(&resumed_one.losses, &ranks[0].losses[STEPS as usize / 2..]),
        max_rel(&resumed[0].losses, &one.losses[STEPS as usize / 2..]),
        ranks.iter().map(|o| o.state_nvme_bytes).collect::<Vec<_>>(),
        one.state_nvme_bytes
    );
}

/// The ranks' run `ranks` is the one process's `one`: every step's loss within 1e-5 relative,
/// and the ranks' master weights identical.
fn assert_same_run(what: &str, ranks: &[Outcome], one: &Outcome) {
    for (s, (a, b)) in ranks[0].losses.iter().zip(&one.losses).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        assert!(rel < 1e-5, "{what}, step {}: loss {a} over 2 ranks, {b} in one process", s + 1);
    }
    assert!(ranks[0].masters == ranks[1].masters, "{what}: the ranks' master weights differ");
}

/// The largest absolute difference between two models' parameters, unit by unit.
fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

fn train_zero_steps(dir: &Path) -> Vec<Vec<f32>> {
    Trainer::new(config(dir, 4), Ranks::single()).unwrap().master_weights().unwrap()
}

#[test]
fn a_nan_on_one_rank_skips_the_step_on_every_rank() {
    const TEST: &str = "a_nan_on_one_rank_skips_the_step_on_every_rank";
    if as_rank_or_skipped(TEST) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ran = launch(TEST, "faults", dir.path(), &[("OOGC_NAN_GRADS", "2")]);
    assert!(ran.status.success(), "mpirun: {}\n{}", ran.status, String::from_utf8_lossy(&ran.stderr));
    let ranks = read_outcomes(dir.path(), "");
    for (r, o) in ranks.iter().enumerate() {
        // Only rank 1's gradients were poisoned; the all-reduced norm is NaN on both.
        assert_eq!(o.skipped, [false, true, false, false], "rank {r}'s skipped steps");
        assert_eq!(o.grad_norms[1], -1.0, "rank {r}: step 2's norm is finite");
        assert!(o.grad_norms.iter().enumerate().all(|(s, g)| s == 1 || *g > 0.0), "rank {r}: {:?}", o.grad_norms);
    }
    assert!(ranks[0].masters == ranks[1].masters, "the ranks' parameters differ after the skip");
}

#[test]
fn a_rank_that_dies_ends_the_run_naming_it() {
    const TEST: &str = "a_rank_that_dies_ends_the_run_naming_it";
    if as_rank_or_skipped(TEST) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    // Rank 1 aborts (SIGABRT, as abrupt as a kill) at the start of its third step; rank 0 is
    // then waiting for it in a collective.
    let ran = launch(TEST, "faults", dir.path(), &[("OOGC_CRASH_AT", "step:3")]);
    let took = started.elapsed();
    let said = String::from_utf8_lossy(&ran.stderr).into_owned() + &String::from_utf8_lossy(&ran.stdout);
    assert!(!ran.status.success(), "mpirun succeeded with a dead rank:\n{said}");
    // A hang guard (a rank left waiting in a collective forever), not a speed bar.
    assert!(took < std::time::Duration::from_secs(120), "the run took {took:?} to end: a rank hung");
    assert!(said.contains("rank 1"), "the launcher's output does not name rank 1:\n{said}");
    assert!(!dir.path().join("rank0.json").exists(), "rank 0 finished its run alone");
}

/// What a rank saw of [`rank_ckpt_faults`]: each save's outcome (`ok` or the error's text) and
/// the master weights at the end.
#[derive(serde::Serialize, serde::Deserialize)]
struct SaveFaults {
    saves: Vec<String>,
    masters: Vec<Vec<f32>>,
    steps: u64,
}

/// This process's soft file size limit (RLIMIT_FSIZE, bytes or `unlimited`), through util-linux's
/// `prlimit`.
fn set_file_size_limit(soft: &str) {
    let pid = std::process::id().to_string();
    let ran = std::process::Command::new("prlimit").args(["--pid", &pid, &format!("--fsize={soft}:")]).status();
    assert!(ran.is_ok_and(|s| s.success()), "prlimit --fsize={soft}: (util-linux) failed");
}

/// Saves after steps 1, 2 and 3; rank 1 writes the second under a file size limit of
/// `OOGC_CKPT_FSIZE` bytes (a disk that fills part-way through its shard: RLIMIT_FSIZE, SIGXFSZ
/// ignored by the shell that started it, so the write fails with EFBIG), then trains on.
fn rank_ckpt_faults(out: &Path, ranks: &Ranks) {
    let world = ranks.world();
    let cfg = config_with_checkpoints(&out.join("run"), 4 / RANKS, &out.join("ckpt"));
    let mut t = Trainer::new(cfg, ranks.clone()).expect("trainer");
    let limit: Option<u64> = std::env::var("OOGC_CKPT_FSIZE").ok().map(|v| v.parse().expect("bytes"));
    let mut saves = Vec::new();
    for step in 1..=3 {
        t.train_step().expect("step");
        // Pending updates (NVMe writes) done before the limit, which is the checkpoint's alone.
        t.master_weights().expect("sync");
        let limited = limit.filter(|_| step == 2);
        if let Some(bytes) = limited {
            set_file_size_limit(&bytes.to_string());
        }
        saves.push(match t.save_checkpoint() {
            Ok(_) => "ok".to_string(),
            Err(e) => e.to_string(),
        });
        if limited.is_some() {
            set_file_size_limit("unlimited");
        }
    }
    let masters = t.master_weights().expect("masters");
    let outcome = SaveFaults { saves, masters, steps: t.step() };
    std::fs::write(out.join(format!("faults{}.json", world.rank)), serde_json::to_vec(&outcome).unwrap()).unwrap();
}

#[test]
fn a_shard_that_fails_to_write_leaves_no_index_and_the_run_going() {
    const TEST: &str = "a_shard_that_fails_to_write_leaves_no_index_and_the_run_going";
    if as_rank_or_skipped(TEST) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A rank's shard is about 800 KB here: the limit cuts it part-way.
    let ran = launch_with(TEST, "ckpt-faults", dir.path(), &[("OOGC_CKPT_FSIZE", "131072")], Some("trap '' XFSZ"));
    assert!(ran.status.success(), "mpirun: {}\n{}", ran.status, String::from_utf8_lossy(&ran.stderr));
    let seen: Vec<SaveFaults> = (0..RANKS)
        .map(|r| serde_json::from_slice(&std::fs::read(dir.path().join(format!("faults{r}.json"))).unwrap()).unwrap())
        .collect();
    // Both ranks failed the second save, together: rank 1 with its write's error, rank 0 naming
    // rank 1; both saved before and after it, and trained on in step.
    assert_eq!((seen[0].saves[0].as_str(), seen[0].saves[2].as_str()), ("ok", "ok"), "{:?}", seen[0].saves);
    assert_eq!((seen[1].saves[0].as_str(), seen[1].saves[2].as_str()), ("ok", "ok"), "{:?}", seen[1].saves);
    let (zero, one) = (&seen[0].saves[1], &seen[1].saves[1]);
    eprintln!("a shard cut by a full disk on rank 1:\n  rank 0: {zero}\n  rank 1: {one}");
    assert!(zero.contains("step 2 was not saved") && zero.contains("rank(s) [1]"), "rank 0: {zero}");
    assert!(one.contains("ckpt-00000002.rank-1-of-2.safetensors"), "rank 1: {one}");
    assert!(seen.iter().all(|s| s.steps == 3) && seen[0].masters == seen[1].masters);
    // No index of step 2 and none of its shards (rank 0's, complete, removed too); steps 1
    // and 3 whole, and they verify.
    let ckpt = dir.path().join("ckpt");
    let mut names: Vec<String> =
        std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert!(!names.iter().any(|n| n.starts_with("ckpt-00000002")), "step 2 left {names:?}");
    let listed: Vec<u64> = oogc::checkpoint::list(&ckpt).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(listed, [1, 3]);
    for (_, p) in oogc::checkpoint::list(&ckpt).unwrap() {
        assert!(matches!(oogc::checkpoint::verify(&p), Ok(oogc::checksum::Verification::Verified { .. })), "{p:?}");
    }
}
