//! `oogc train`'s driver: the loop around [`Trainer`] with validation, metrics (JSON lines, one
//! object per step), checkpoints, and the end-of-run summary. What a caller shows while it runs
//! (the CLI's progress bar) comes through a [`RunObserver`].

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::config::TrainConfig;
use crate::train::{Result, TrainError, Trainer};

mod metrics;
mod summary;

use metrics::trim_metrics_for_resume;
pub use metrics::{read_metrics, MetricsFile, StepRecord, TornLine};
use summary::host_report;
pub use summary::{gb, HostReport, RunSummary};

/// candle's CPU compute threads of a run (sim device): `[threads] compute`, else every core
/// available to the process shared by the ranks on this node (`OMPI_COMM_WORLD_LOCAL_SIZE`
/// under mpirun), at least one.
pub fn compute_threads(cfg: &TrainConfig) -> usize {
    cfg.threads.compute.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let local_ranks =
            std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|s| s.parse::<usize>().ok()).unwrap_or(1);
        (cores / local_ranks.max(1)).max(1)
    })
}

/// Sizes candle's CPU compute pool (sim device) from `[threads] compute` ([`compute_threads`]):
/// candle's matmuls split into `RAYON_NUM_THREADS` tasks on the global rayon pool, so both are
/// set. Call it before any candle or rayon work, from the main thread.
///
/// # Errors
/// When the global rayon pool was already built with another size.
pub fn size_compute_threads(cfg: &TrainConfig) -> Result<(), rayon::ThreadPoolBuildError> {
    let n = compute_threads(cfg);
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    rayon::ThreadPoolBuilder::new().num_threads(n).thread_name(|i| format!("oogc-compute-{i}")).build_global()
}

/// Options of one `oogc train` invocation.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Resume from this checkpoint directory (or file).
    pub resume: Option<PathBuf>,
    /// Stop after this step (overrides `train.steps` as the last step; the LR schedule still
    /// spans `train.steps`).
    pub steps: Option<u64>,
    /// With `resume`: when the newest checkpoint fails its checksums, resume from the newest one
    /// that verifies (each one passed over is logged with why). Without it such a checkpoint is
    /// an error.
    pub fallback: bool,
    /// With `resume`: convert Adam moments saved in another dtype than `[optimizer] state_dtype`
    /// ([`crate::train::ResumeFrom::convert_state`]); without it such a checkpoint is refused.
    pub convert_state: bool,
    /// A graceful stop: once set (the CLI sets it on SIGINT/SIGTERM), the run finishes the step
    /// in flight, writes a checkpoint (when the config has a checkpoint directory) and returns
    /// with [`RunSummary::stopped`]. The library installs no signal handler itself.
    pub stop: Option<Arc<AtomicBool>>,
    /// Write each step's token windows to this file as they are drawn (`oogc train
    /// --dump-batches`; [`crate::train::BatchDump`]: the format). Created or truncated; it holds
    /// this invocation's steps.
    pub dump_batches: Option<PathBuf>,
}

/// What a caller of [`run`] sees while the run goes on (the CLI draws a progress bar from it).
/// Every method has an empty default.
pub trait RunObserver {
    /// The run starts at step `first` (1-based) and stops after step `last`.
    fn start(&mut self, first: u64, last: u64) {
        let _ = (first, last);
    }

    /// A step finished: its metrics record and the run's totals so far.
    fn step(&mut self, record: &StepRecord, totals: &RunSummary) {
        let _ = (record, totals);
    }

    /// A line worth showing (a validation result, a skipped step).
    fn line(&mut self, line: &str) {
        let _ = line;
    }

    /// The training text is being tokenized: `done` of `total` bytes (only when the token cache
    /// is built, not when it is reused).
    fn tokenize(&mut self, done: u64, total: u64) {
        let _ = (done, total);
    }

    /// The loop is over (before the summary is returned).
    fn finish(&mut self) {}
}

/// A [`RunObserver`] that shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quiet;

impl RunObserver for Quiet {}

/// Runs the training described by `cfg` as this process's place among `ranks`
/// ([`crate::dist::Ranks::single`] for one process), telling `observer` of each step.
///
/// # Errors
/// Whatever [`Trainer`] returns; I/O errors of the metrics file (named); [`TrainError::BatchDump`]
/// when `dump_batches` cannot be created (before anything is written); a failed collective
/// between the ranks (the caller ends the run: [`crate::dist::Ranks::abort`]).
pub fn run(
    cfg: TrainConfig,
    ranks: crate::dist::Ranks,
    opts: &RunOptions,
    observer: &mut dyn RunObserver,
) -> Result<RunSummary> {
    let world = ranks.world();
    // With ranks, a stop is decided together: any rank's request stops every rank after the
    // same step (mpirun forwards the signal, but the ranks may see it at different steps).
    let stop_requested = || -> Result<bool> {
        let local = opts.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
        if world.size == 1 {
            return Ok(local);
        }
        let mut any = [f64::from(u8::from(local))];
        ranks.all_reduce_sum_f64(&mut any).map_err(crate::runtime::RuntimeError::from)?;
        Ok(any[0] > 0.0)
    };
    // A bad path is refused before the run writes anything.
    let dump = opts.dump_batches.as_deref().map(crate::train::BatchDump::create).transpose()?;
    let mut resumed_from = None;
    let mut trainer = match &opts.resume {
        Some(dir) => {
            let from = if opts.fallback {
                let (chosen, skipped) = crate::checkpoint::newest_verified(dir)?;
                for s in &skipped {
                    let why = match &s.error {
                        crate::checkpoint::CheckpointError::Checksum { source, .. } => source.to_string(),
                        crate::checkpoint::CheckpointError::Corrupt { reason, .. } => reason.clone(),
                        e => e.to_string(),
                    };
                    let line = format!("--fallback: skipping {}: {why}", s.path.display());
                    tracing::warn!("{line}");
                    observer.line(&line);
                }
                if !skipped.is_empty() {
                    tracing::warn!("--fallback: resuming from {}", chosen.display());
                }
                chosen
            } else {
                dir.clone()
            };
            let resume = crate::train::ResumeFrom { path: &from, convert_state: opts.convert_state };
            let t = Trainer::open(cfg.clone(), ranks.clone(), Some(resume), &mut |done, total| {
                observer.tokenize(done, total)
            })?;
            resumed_from = Some(if from.is_dir() { crate::checkpoint::latest(&from)? } else { from });
            t
        }
        None => Trainer::open(cfg.clone(), ranks.clone(), None, &mut |done, total| observer.tokenize(done, total))?,
    };
    if let Some(dump) = dump {
        trainer.dump_batches(dump)?;
    }
    let last = opts.steps.unwrap_or(cfg.train.steps);
    let first = trainer.step() + 1;
    // Data-parallel ranks: rank 0 writes the metrics (with every rank's step time).
    let mut metrics = match cfg.output.metrics.as_ref().filter(|_| world.is_root()) {
        Some(path) => {
            let io =
                |source| TrainError::Checkpoint(crate::checkpoint::CheckpointError::Io { path: path.clone(), source });
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io)?;
            }
            if opts.resume.is_some() {
                trim_metrics_for_resume(path, trainer.step()).map_err(io)?;
            }
            // A resumed run appends: the file then holds the whole run.
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(opts.resume.is_some())
                .write(true)
                .truncate(opts.resume.is_none())
                .open(path)
                .map_err(io)?;
            Some((std::io::BufWriter::new(f), path.clone()))
        }
        None => None,
    };
    let mut summary = RunSummary {
        first_step: first,
        params: trainer.num_params(),
        unigram_entropy_nats: trainer.data().unigram_entropy_nats(),
        bytes_per_token: trainer.data().bytes_per_token(),
        model_to_gpu_ratio: (cfg.train.compute_dtype.dtype().num_bytes(trainer.num_params())
            + oogc_swapper::DType::F32.num_bytes(3 * trainer.num_params())) as f64
            / cfg.budgets.gpu.as_u64() as f64,
        ..RunSummary::default()
    };
    tracing::info!(
        params = summary.params,
        unigram_nats = summary.unigram_entropy_nats,
        ratio = summary.model_to_gpu_ratio,
        "starting at step {first}"
    );
    observer.start(first, last);
    let mut tokens = 0usize;
    let mut rss_guard = RssGuard::new(trainer.host_overhead());
    // The plan of the GPU's memory (what the pool's per-step peak is held to on CUDA); a model
    // the planner cannot describe only loses the warning.
    let mut device_guard =
        crate::plan::device_plan_for_config(&cfg, trainer.model(), trainer.runtime().memory().device_optimizer_bytes())
            .map(DeviceGuard::new)
            .map_err(|e| tracing::debug!(error = %e, "no device plan: the device peak is not checked"))
            .ok();
    let run_start = Instant::now();
    if cfg.train.eval_at_start && trainer.step() < last {
        let v = trainer.evaluate()?;
        summary.initial_val_loss = Some(v.nats_per_token);
        observer.line(&format!(
            "step {:>6}  val {:.4} nats/token ({:.3} bits/byte) before training",
            trainer.step(),
            v.nats_per_token,
            v.bits_per_byte
        ));
    }
    let mut saved_step = resumed_from.as_ref().map(|_| trainer.step());
    // Seconds the trainer was held by the checkpoint started after the previous step (on the
    // next step's line); a completed one's figures go on the line of the step it completed in.
    let mut held_s: Option<f64> = None;
    summary.checkpoint = resumed_from;
    while trainer.step() < last {
        if stop_requested()? {
            summary.stopped = true;
            break;
        }
        let faults_before = crate::runtime::budget::minor_faults();
        let out = trainer.train_step()?;
        let minor_faults = faults_before.zip(crate::runtime::budget::minor_faults()).map(|(a, b)| b.saturating_sub(a));
        let rss_bytes = crate::runtime::budget::rss_bytes();
        if let Some(rss) = rss_bytes {
            rss_guard.check(rss, trainer.runtime().memory().host_ledger());
        }
        let s = &out.stats;
        if let (Some(guard), Some(peak)) = (device_guard.as_mut(), s.device_peak_bytes) {
            if let Some(msg) = guard.over(peak) {
                tracing::warn!("{msg}");
            }
        }
        tokens += out.tokens;
        summary.train_s += s.figures.step_s;
        summary.exposed_transfer_s += s.figures.stall_transfer_s;
        summary.exposed_optimizer_s += s.figures.stall_optimizer_s;
        summary.h2d_bytes += s.figures.h2d_bytes;
        summary.d2h_bytes += s.figures.d2h_bytes;
        summary.nvme_read_bytes += s.figures.nvme_read_bytes;
        summary.nvme_write_bytes += s.figures.nvme_write_bytes;
        summary.gather_bytes += s.gather_bytes;
        summary.final_loss = out.loss;
        let step = trainer.step();
        let interval = cfg.checkpoint.interval;
        let ckpt_now = step == last || (interval > 0 && step % interval == 0);
        // A save written in the background is completed when done (and before the next starts).
        let completed = complete_save(&mut trainer, ckpt_now, &mut summary, observer)?;
        if let Some(saved) = &completed {
            saved_step = Some(saved.step);
        }
        let eval_now = step == last || (cfg.train.eval_interval > 0 && step % cfg.train.eval_interval == 0);
        let val = if eval_now { Some(trainer.evaluate()?) } else { None };
        if let Some(v) = val {
            summary.final_val_loss = v.nats_per_token;
            summary.final_val_bits_per_byte = v.bits_per_byte;
            observer.line(&format!(
                "step {step:>6}  train {:.4}  val {:.4} nats/token ({:.3} bits/byte)",
                out.loss, v.nats_per_token, v.bits_per_byte
            ));
        }
        let record = StepRecord {
            step,
            loss: out.loss,
            val_loss: val.map(|v| v.nats_per_token),
            val_bits_per_byte: val.map(|v| v.bits_per_byte),
            lr: out.lr,
            tokens_per_s: out.tokens as f64 / s.figures.step_s.max(1e-9),
            stall_s: s.stall_s(),
            stats: s.figures,
            aux_loss: (!out.routed_tokens.is_empty()).then_some(out.aux_loss),
            cpu_tokens: (!out.routed_tokens.is_empty()).then_some(out.cpu_tokens),
            expert_h2d_bytes: (!out.routed_tokens.is_empty()).then_some(out.expert_traffic.h2d_bytes),
            expert_hit_rate: (!out.routed_tokens.is_empty())
                .then(|| out.expert_traffic.hits as f64 / out.expert_traffic.uses.max(1) as f64),
            rank_step_s: match world.size {
                1 => None,
                _ => Some(ranks.all_gather_f64(s.figures.step_s).map_err(crate::runtime::RuntimeError::from)?),
            },
            rss_bytes,
            minor_faults,
            device_units: (s.device_units > 0).then_some(s.device_units),
            device_optimizer_bytes: (s.device_units > 0).then_some(s.device_optimizer_bytes),
            gathers: (s.gathers > 0).then_some(s.gathers),
            gather_bytes: (s.gathers > 0).then_some(s.gather_bytes),
            device_peak_bytes: s.device_peak_bytes,
            ckpt_held_s: held_s.take(),
            ckpt_s: completed.as_ref().map(|c| c.seconds),
            ckpt_bytes: completed.as_ref().map(|c| c.bytes),
        };
        if s.figures.skipped {
            observer.line(&format!("step {step}: skipped, a gradient was not finite (norm {})", s.figures.grad_norm));
        }
        if let Some((w, path)) = &mut metrics {
            let line = serde_json::to_string(&record).expect("record serializes");
            writeln!(w, "{line}").and_then(|_| w.flush()).map_err(|source| {
                TrainError::Checkpoint(crate::checkpoint::CheckpointError::Io { path: path.clone(), source })
            })?;
        }
        observer.step(&record, &summary);
        if ckpt_now && step == last {
            // The last step's save is waited for; its failure ends the run.
            if let Some(saved) = trainer.save_checkpoint()? {
                note_save(&mut summary, observer, &saved);
                saved_step = Some(step);
            }
        } else if ckpt_now {
            match trainer.start_checkpoint() {
                Ok(held) => held_s = held,
                Err(TrainError::Checkpoint(e)) => checkpoint_failed(&mut summary, observer, &e),
                Err(e) => return Err(e),
            }
        }
    }
    if summary.stopped {
        // A stop waits for the save in flight before its own.
        if let Some(saved) = complete_save(&mut trainer, true, &mut summary, observer)? {
            saved_step = Some(saved.step);
        }
    }
    if summary.stopped && saved_step != Some(trainer.step()) {
        tracing::warn!(step = trainer.step(), "stop requested: writing a checkpoint of the steps done");
        if let Some(saved) = trainer.save_checkpoint()? {
            note_save(&mut summary, observer, &saved);
        }
    }
    observer.finish();
    summary.last_step = trainer.step();
    summary.tokens_per_s = tokens as f64 / summary.train_s.max(1e-9);
    summary.compute_s = (summary.train_s - summary.exposed_transfer_s - summary.exposed_optimizer_s).max(0.0);
    let peak = trainer.runtime().memory().peak_bytes();
    summary.peak_gpu_bytes = peak.device;
    summary.peak_host_bytes = peak.host;
    summary.nvme_bytes = peak.nvme;
    summary.host = host_report(&trainer);
    tracing::debug!(wall_s = run_start.elapsed().as_secs_f64(), "run finished");
    Ok(summary)
}

/// Completes the save in flight ([`Trainer::finish_checkpoint`]: with `wait`, once written, else
/// if done) and records it; a save that could not be written (a full disk) is logged and
/// counted, the previous checkpoint intact and the run going.
///
/// # Errors
/// The save's other failures (runtime, a collective).
fn complete_save(
    trainer: &mut Trainer,
    wait: bool,
    summary: &mut RunSummary,
    observer: &mut dyn RunObserver,
) -> Result<Option<crate::checkpoint::Saved>> {
    match trainer.finish_checkpoint(wait) {
        Ok(saved) => {
            if let Some(saved) = &saved {
                note_save(summary, observer, saved);
            }
            Ok(saved)
        }
        Err(TrainError::Checkpoint(e)) => {
            checkpoint_failed(summary, observer, &e);
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Logs a checkpoint that could not be written (the run goes on) and counts it.
fn checkpoint_failed(summary: &mut RunSummary, observer: &mut dyn RunObserver, e: &crate::checkpoint::CheckpointError) {
    tracing::error!(error = %e, "checkpoint not saved: training goes on");
    observer.line(&format!("checkpoint not saved ({e}); training goes on"));
    summary.checkpoint_failures += 1;
}

/// Records a checkpoint the run saved in its summary and tells the observer.
fn note_save(summary: &mut RunSummary, observer: &mut dyn RunObserver, saved: &crate::checkpoint::Saved) {
    observer.line(&format!(
        "step {}: checkpoint {} ({:.2} GB in {:.1} s)",
        saved.step,
        saved.path.display(),
        saved.bytes as f64 / 1e9,
        saved.seconds
    ));
    tracing::info!(
        path = %saved.path.display(),
        bytes = saved.bytes,
        seconds = saved.seconds,
        "checkpoint saved: {:.2} GB in {:.1} s",
        saved.bytes as f64 / 1e9,
        saved.seconds
    );
    summary.checkpoints.push(saved.path.clone());
    summary.checkpoint = Some(saved.path.clone());
    summary.checkpoint_s += saved.seconds;
    summary.checkpoint_bytes = saved.bytes;
}

/// The run-time side of the host budget: the process's RSS, sampled after each step, against
/// `[budgets] host` plus the run's stated overhead outside the ledger
/// ([`Trainer::host_overhead`], computed once: it is fixed for the run). Past it, one warning
/// names the figures and the largest categories (the ledger's, and the overhead's parts), then
/// stays quiet.
#[derive(Debug)]
struct RssGuard {
    overhead: crate::runtime::budget::HostOverhead,
    warned: bool,
}

impl RssGuard {
    fn new(overhead: crate::runtime::budget::HostOverhead) -> Self {
        Self { overhead, warned: false }
    }

    /// Samples against `ledger`; logs the warning the first time.
    fn check(&mut self, rss: u64, ledger: &oogc_swapper::HostLedger) {
        if let Some(msg) = self.over(rss, ledger) {
            tracing::warn!("{msg}");
        }
    }

    /// The warning when `rss` is past the budget plus the overhead for the first time, naming
    /// the figures and the four largest parts (the ledger's categories now and the
    /// overhead's); `None` otherwise.
    fn over(&mut self, rss: u64, ledger: &oogc_swapper::HostLedger) -> Option<String> {
        let overhead = &self.overhead;
        let limit = ledger.budget_bytes().saturating_add(overhead.total_bytes());
        if self.warned || rss <= limit {
            return None;
        }
        self.warned = true;
        let mut parts: Vec<(String, u64)> = ledger
            .report()
            .categories
            .iter()
            .map(|c| (format!("ledger {}", c.category.name()), c.used_bytes))
            .collect();
        parts.extend(overhead.parts().iter().map(|(n, b)| (format!("overhead {n}"), *b)));
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        let largest: Vec<String> = parts.iter().take(4).map(|(n, b)| format!("{n} {b} B")).collect();
        Some(format!(
            "host memory: the process holds {rss} B, above [budgets] host ({} B) + the stated overhead outside the \
             ledger ({} B) = {limit} B; largest now: {}\n  fix: lower [budgets] host or the batch, or report the \
             shape (the overhead model missed it)",
            ledger.budget_bytes(),
            overhead.total_bytes(),
            largest.join(", ")
        ))
    }
}

/// Holds each step's device peak (CUDA: the memory pool's high-water mark,
/// [`crate::runtime::StepStats::device_peak_bytes`]) to the plan's bytes in the pool
/// ([`crate::runtime::device_plan::DevicePlan::in_pool_bytes`]). Past it, one warning names the
/// figures and the plan's largest parts, then stays quiet.
#[derive(Debug)]
struct DeviceGuard {
    plan: crate::runtime::device_plan::DevicePlan,
    warned: bool,
}

impl DeviceGuard {
    fn new(plan: crate::runtime::device_plan::DevicePlan) -> Self {
        Self { plan, warned: false }
    }

    /// The warning when `peak_bytes` passes the plan for the first time; `None` otherwise.
    fn over(&mut self, peak_bytes: u64) -> Option<String> {
        let planned = self.plan.in_pool_bytes();
        if self.warned || peak_bytes <= planned {
            return None;
        }
        self.warned = true;
        let mut parts: Vec<_> = self.plan.parts().into_iter().filter(|p| p.in_pool && p.bytes > 0).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        let largest: Vec<String> = parts.iter().take(3).map(|p| format!("{} {} B", p.name, p.bytes)).collect();
        Some(format!(
            "device memory: the step's pool peak was {peak_bytes} B, above the plan's {planned} B in the pool \
             ({:.2} ×); the plan's largest parts: {}\n  fix: lower the batch or [device] attention_chunk, offload \
             activations ([activations] offload = true), or report the shape (the device model missed it)",
            peak_bytes as f64 / planned.max(1) as f64,
            largest.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::StepFigures;

    #[test]
    fn the_device_guard_warns_once_past_the_plans_pool_bytes_naming_its_largest_parts() {
        use crate::runtime::device_plan::{DevicePlan, PeakUnit};
        let plan = DevicePlan {
            residency_bytes: 500,
            gradient_staging_bytes: 100,
            activation_staging_bytes: 0,
            in_use_copies_bytes: 100,
            device_optimizer_bytes: 0,
            checkpoints_bytes: 50,
            input_gradients_bytes: 10,
            peak_unit: PeakUnit::Head,
            working_set_bytes: 300,
            attention_bytes: 40,
            autograd_bytes: 60,
            attention_chunk: 16,
            cublas_workspace_bytes: 7000,
            cuda_context_bytes: 9000,
        };
        let planned = plan.in_pool_bytes();
        assert_eq!(planned, 1160, "the parts outside the pool are not compared with its peak");
        let mut guard = DeviceGuard::new(plan);
        assert_eq!(guard.over(planned), None);
        let msg = guard.over(planned + 1).expect("past the plan");
        assert!(msg.contains("1161 B") && msg.contains("1160 B"), "{msg}");
        assert!(msg.contains("residency 500 B") && msg.contains("fix:"), "{msg}");
        assert!(!msg.contains("cuda_context"), "the largest parts named are the pool's: {msg}");
        assert_eq!(guard.over(2 * planned), None, "once");
    }

    #[test]
    fn the_rss_guard_warns_once_past_the_budget_plus_the_overhead_naming_the_largest_parts() {
        use oogc_swapper::{HostLedger, HostUse};
        let ledger = HostLedger::new(100 << 20);
        let _grads = ledger.claim(HostUse::Gradients, 60 << 20).unwrap();
        let _copies = ledger.claim(HostUse::ComputeCopies, 30 << 20).unwrap();
        let overhead = crate::runtime::budget::HostOverhead {
            process_bytes: 10 << 20,
            activation_bytes: 40 << 20,
            ..Default::default()
        };
        let limit = (100 + 50) << 20;
        let mut guard = RssGuard::new(overhead);
        assert_eq!(guard.over(limit, &ledger), None, "at the limit: quiet");
        let msg = guard.over(limit + 1, &ledger).expect("past the limit: a warning");
        assert!(msg.contains(&format!("{limit} B")) && msg.contains("fix:"), "{msg}");
        let (g, a, c) = (msg.find("ledger gradients"), msg.find("overhead activations"), msg.find("ledger compute"));
        assert!(g < a && a < c && c.is_some(), "the largest first: {msg}");
        assert_eq!(guard.over(limit * 2, &ledger), None, "once");
    }

    fn record(step: u64) -> String {
        let r = StepRecord {
            val_bits_per_byte: None,
            step,
            loss: 1.5 + step as f64,
            val_loss: None,
            lr: 1e-3,
            tokens_per_s: 1.0,
            stall_s: 0.0,
            stats: StepFigures {
                step_s: 1.0,
                stall_transfer_s: 0.0,
                stall_optimizer_s: 0.0,
                h2d_bytes: 0,
                d2h_bytes: 0,
                nvme_read_bytes: 0,
                nvme_write_bytes: 0,
                grad_norm: 0.5,
                clip_scale: 1.0,
                skipped: false,
            },
            aux_loss: None,
            cpu_tokens: None,
            expert_h2d_bytes: None,
            expert_hit_rate: None,
            rank_step_s: None,
            rss_bytes: None,
            minor_faults: None,
            device_units: None,
            device_optimizer_bytes: None,
            device_peak_bytes: None,
            gathers: None,
            gather_bytes: None,
            ckpt_held_s: None,
            ckpt_s: None,
            ckpt_bytes: None,
        };
        serde_json::to_string(&r).unwrap() + "\n"
    }

    /// The runtime's figures are flattened into the line: the keys are the record's own and
    /// `StepStats`' names, none nested, and a line reads back as the record it was.
    #[test]
    fn a_metrics_line_has_the_figures_at_the_top_level_and_reads_back() {
        let mut r: StepRecord = serde_json::from_str(record(7).trim_end()).unwrap();
        r.val_loss = Some(2.0);
        r.val_bits_per_byte = Some(2.5);
        r.aux_loss = Some(0.01);
        r.cpu_tokens = Some(3);
        r.expert_h2d_bytes = Some(4);
        r.expert_hit_rate = Some(0.5);
        r.rank_step_s = Some(vec![1.0, 1.5]);
        r.rss_bytes = Some(5);
        r.minor_faults = Some(6);
        r.device_units = Some(2);
        r.device_optimizer_bytes = Some(8);
        r.gathers = Some(9);
        r.gather_bytes = Some(10);
        r.device_peak_bytes = Some(11);
        r.ckpt_held_s = Some(0.25);
        r.ckpt_s = Some(0.5);
        r.ckpt_bytes = Some(13);
        r.stats.h2d_bytes = 12;
        r.stats.clip_scale = 0.25;
        r.stats.skipped = true;
        let line = serde_json::to_string(&r).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want: Vec<&str> = "step loss val_loss val_bits_per_byte lr tokens_per_s step_s stall_s \
             stall_transfer_s stall_optimizer_s h2d_bytes d2h_bytes nvme_read_bytes nvme_write_bytes grad_norm \
             clip_scale skipped aux_loss cpu_tokens expert_h2d_bytes expert_hit_rate rank_step_s rss_bytes \
             minor_faults device_units device_optimizer_bytes gathers gather_bytes device_peak_bytes ckpt_held_s ckpt_s ckpt_bytes"
            .split_whitespace()
            .collect();
        want.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!((v["step_s"].as_f64(), v["h2d_bytes"].as_u64()), (Some(1.0), Some(12)));
        assert_eq!((v["clip_scale"].as_f64(), v["skipped"].as_bool()), (Some(0.25), Some(true)));
        assert_eq!(serde_json::from_str::<StepRecord>(&line).unwrap(), r);
    }

    #[test]
    fn a_torn_metrics_line_is_reported_and_a_resume_cuts_it_and_the_steps_after_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let whole = [record(1), record(2), record(3)].concat();
        let torn = &record(4)[..20];
        std::fs::write(&path, format!("{whole}{torn}")).unwrap();
        let m = read_metrics(&path).unwrap();
        assert_eq!(m.records.iter().map(|r| r.step).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(m.torn, Some(TornLine { offset: whole.len() as u64, len: 20 }));
        trim_metrics_for_resume(&path, 2).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), [record(1), record(2)].concat());
        // A complete line that is not a record is an error naming the line.
        std::fs::write(&path, format!("{}oops\n", record(1))).unwrap();
        let e = read_metrics(&path).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("m.jsonl"), "{e}");
    }
}
