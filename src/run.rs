//! `oogc train`'s driver: the loop around [`Trainer`] with validation, metrics (JSON lines, one
//! object per step), checkpoints, and the end-of-run summary. What a caller shows while it runs
//! (the CLI's progress bar) comes through a [`RunObserver`].

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::train::{Result, TrainError, Trainer};

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

/// One line of the metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step (1-based).
    pub step: u64,
    /// Training loss of the step's batch, nats per token (per byte for byte-level data).
    pub loss: f64,
    /// Validation loss when evaluated at this step, nats per token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The same validation loss over the bytes of text the targets cover, bits per byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_bits_per_byte: Option<f64>,
    /// Learning rate.
    pub lr: f32,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
    /// Time the step waited for transfers or optimizer updates, seconds
    /// (`stats.stall_transfer_s + stats.stall_optimizer_s`).
    pub stall_s: f64,
    /// The runtime's figures of the step (time, stalls, bytes per link, the optimizer's
    /// verdict), written inline: `step_s`, `stall_transfer_s`, ... are keys of the line itself.
    #[serde(flatten)]
    pub stats: StepFigures,
    /// MoE: the load-balancing loss (the objective is `loss + aux_loss`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// MoE: tokens whose expert ran on the CPU from its host copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_tokens: Option<usize>,
    /// MoE: bytes of expert copies moved H2D (part of `h2d_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_h2d_bytes: Option<u64>,
    /// MoE: the share of routed experts' uses (forward and backward) that moved no bytes H2D
    /// (a copy already on the device, or CPU compute from the host copy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_hit_rate: Option<f64>,
    /// Data-parallel ranks: each rank's step time, seconds, in rank order (the step's
    /// `step_s` is rank 0's; `tokens_per_s` counts the global batch over rank 0's time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_step_s: Option<Vec<f64>>,
    /// The process's resident set size after the step (`VmRSS`), bytes; absent where
    /// `/proc/self/status` cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    /// Minor page faults during the step (`minflt` of `/proc/self/stat`): pages touched for the
    /// first time, each a trip into the kernel; near zero once the step's buffers are reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_faults: Option<u64>,
    /// Units whose optimizer is on the device (`[optimizer] device_units`, MoE hot experts) at
    /// the step's end; absent when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_units: Option<usize>,
    /// Their GPU bytes (16 B per parameter + the compute copy); absent when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_optimizer_bytes: Option<u64>,
    /// Ranks with sharded parameters (`[ranks] shard_parameters`): units all-gathered from the
    /// ranks' shards in the step (rank 0's), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gathers: Option<u64>,
    /// The bytes rank 0 received in those all-gathers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather_bytes: Option<u64>,
    /// CUDA: the device memory pool's high-water mark during the step, bytes (the swapper's
    /// buffers and candle's tensors; [`crate::runtime::StepStats::device_peak_bytes`]); absent
    /// on the sim device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_peak_bytes: Option<u64>,
}

/// The figures of [`crate::runtime::StepStats`] that a metrics line carries as they are: always
/// written, same names, same values ([`StepRecord::stats`], flattened into the line). The rest
/// of `StepStats` is left out (`forward`, `device_update_s`, `gather_s`) or written by
/// [`StepRecord`] only when it means something (`device_units`, `gathers`, ...:
/// absent when zero; `device_peak_bytes`: absent on the sim device).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepFigures {
    /// Step wall time, seconds.
    pub step_s: f64,
    /// Time waiting for H2D/D2H copies, seconds.
    pub stall_transfer_s: f64,
    /// Time waiting for optimizer updates, seconds.
    pub stall_optimizer_s: f64,
    /// Bytes host→device.
    pub h2d_bytes: u64,
    /// Bytes device→host.
    pub d2h_bytes: u64,
    /// Bytes read from NVMe.
    pub nvme_read_bytes: u64,
    /// Bytes written to NVMe.
    pub nvme_write_bytes: u64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Clip scale (1 = not clipped).
    pub clip_scale: f32,
    /// Step skipped for a non-finite gradient.
    pub skipped: bool,
}

impl From<&crate::runtime::StepStats> for StepFigures {
    fn from(s: &crate::runtime::StepStats) -> Self {
        Self {
            step_s: s.step_s,
            stall_transfer_s: s.stall_transfer_s,
            stall_optimizer_s: s.stall_optimizer_s,
            h2d_bytes: s.h2d_bytes,
            d2h_bytes: s.d2h_bytes,
            nvme_read_bytes: s.nvme_read_bytes,
            nvme_write_bytes: s.nvme_write_bytes,
            grad_norm: s.grad_norm,
            clip_scale: s.clip_scale,
            skipped: s.skipped,
        }
    }
}

/// What a run did, printed at the end.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunSummary {
    /// First step run (1-based) and last.
    pub first_step: u64,
    /// Last step completed.
    pub last_step: u64,
    /// Parameters of the model.
    pub params: usize,
    /// Unigram entropy of the training tokens, nats per token (the loss to beat).
    pub unigram_entropy_nats: f64,
    /// Bytes of text per training token (1 for byte-level data).
    pub bytes_per_token: f64,
    /// Last training loss, nats per token.
    pub final_loss: f64,
    /// Validation loss before the first step (`[train] eval_at_start`), nats per token.
    pub initial_val_loss: Option<f64>,
    /// Last validation loss, nats per token.
    pub final_val_loss: f64,
    /// Last validation loss over the bytes of text it covers, bits per byte.
    pub final_val_bits_per_byte: f64,
    /// Tokens per second over the run (steps only, validation excluded).
    pub tokens_per_s: f64,
    /// Seconds in steps.
    pub train_s: f64,
    /// Of which compute (not waiting).
    pub compute_s: f64,
    /// Of which exposed transfer.
    pub exposed_transfer_s: f64,
    /// Of which exposed optimizer.
    pub exposed_optimizer_s: f64,
    /// Bytes per link over the run.
    pub h2d_bytes: u64,
    /// D2H bytes.
    pub d2h_bytes: u64,
    /// NVMe bytes read.
    pub nvme_read_bytes: u64,
    /// NVMe bytes written.
    pub nvme_write_bytes: u64,
    /// Bytes received from the other ranks gathering sharded parameters (0 without).
    pub gather_bytes: u64,
    /// Peak bytes held on the GPU tier (compute copies; gradient staging excluded).
    pub peak_gpu_bytes: u64,
    /// Peak bytes held in pinned host memory by the residency manager.
    pub peak_host_bytes: u64,
    /// NVMe bytes in use at the end (optimizer state, compute copies placed there).
    pub nvme_bytes: u64,
    /// Host memory: the plan, the ledger and the process (see [`HostReport`]).
    pub host: HostReport,
    /// Parameters + optimizer state (the compute copy in the compute dtype — 4 B/param in f32, 2
    /// in bf16 — plus 12 B/param of fp32 master, m and v) over the GPU budget.
    pub model_to_gpu_ratio: f64,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// The run was stopped early by [`RunOptions::stop`] (after `last_step`, checkpointed when
    /// `checkpoint` is set).
    pub stopped: bool,
    /// The checkpoint a later `--resume` continues from (the newest written or resumed from);
    /// `None` without a checkpoint directory.
    pub checkpoint: Option<PathBuf>,
}

/// Host memory at the end of a run: what the plan predicted, what the runtime's ledger counted,
/// and what the process really held (peak RSS), beside the stated overhead outside the ledger.
/// Bytes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostReport {
    /// `[budgets] host`.
    pub budget_bytes: u64,
    /// The plan's host peak: every ledger category at its planned bytes.
    pub plan_peak_bytes: u64,
    /// The ledger's peak: the most bytes claimed at once.
    pub ledger_peak_bytes: u64,
    /// The process's peak resident set size (`VmHWM`); 0 where it cannot be read.
    pub peak_rss_bytes: u64,
    /// The stated overhead outside the ledger, all parts: the process, the training text, the
    /// sim device's memory, candle's buffers, malloc's keep
    /// ([`crate::runtime::budget::HostOverhead::model`]).
    pub fixed_overhead_bytes: u64,
    /// The same by part.
    pub overhead: crate::runtime::budget::HostOverhead,
    /// Per ledger category: `(category, planned bytes, ledger peak bytes)`.
    pub categories: Vec<(String, u64, u64)>,
}

/// `bytes` as decimal gigabytes, `"1.23 GB"`.
pub fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

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
            let t = Trainer::open(cfg.clone(), ranks.clone(), Some(&from), &mut |done, total| {
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
        summary.train_s += s.step_s;
        summary.exposed_transfer_s += s.stall_transfer_s;
        summary.exposed_optimizer_s += s.stall_optimizer_s;
        summary.h2d_bytes += s.h2d_bytes;
        summary.d2h_bytes += s.d2h_bytes;
        summary.nvme_read_bytes += s.nvme_read_bytes;
        summary.nvme_write_bytes += s.nvme_write_bytes;
        summary.gather_bytes += s.gather_bytes;
        summary.final_loss = out.loss;
        let step = trainer.step();
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
            tokens_per_s: out.tokens as f64 / s.step_s.max(1e-9),
            stall_s: s.stall_s(),
            stats: StepFigures::from(s),
            aux_loss: (!out.routed_tokens.is_empty()).then_some(out.aux_loss),
            cpu_tokens: (!out.routed_tokens.is_empty()).then_some(out.cpu_tokens),
            expert_h2d_bytes: (!out.routed_tokens.is_empty()).then_some(out.expert_traffic.h2d_bytes),
            expert_hit_rate: (!out.routed_tokens.is_empty())
                .then(|| out.expert_traffic.hits as f64 / out.expert_traffic.uses.max(1) as f64),
            rank_step_s: match world.size {
                1 => None,
                _ => Some(ranks.all_gather_f64(s.step_s).map_err(crate::runtime::RuntimeError::from)?),
            },
            rss_bytes,
            minor_faults,
            device_units: (s.device_units > 0).then_some(s.device_units),
            device_optimizer_bytes: (s.device_units > 0).then_some(s.device_optimizer_bytes),
            gathers: (s.gathers > 0).then_some(s.gathers),
            gather_bytes: (s.gathers > 0).then_some(s.gather_bytes),
            device_peak_bytes: s.device_peak_bytes,
        };
        if s.skipped {
            observer.line(&format!("step {step}: skipped, a gradient was not finite (norm {})", s.grad_norm));
        }
        if let Some((w, path)) = &mut metrics {
            let line = serde_json::to_string(&record).expect("record serializes");
            writeln!(w, "{line}").and_then(|_| w.flush()).map_err(|source| {
                TrainError::Checkpoint(crate::checkpoint::CheckpointError::Io { path: path.clone(), source })
            })?;
        }
        observer.step(&record, &summary);
        let interval = cfg.checkpoint.interval;
        if step == last || (interval > 0 && step % interval == 0) {
            if let Some(p) = trainer.save_checkpoint()? {
                summary.checkpoints.push(p.clone());
                summary.checkpoint = Some(p);
                saved_step = Some(step);
            }
        }
    }
    if summary.stopped && saved_step != Some(trainer.step()) {
        tracing::warn!(step = trainer.step(), "stop requested: writing a checkpoint of the steps done");
        if let Some(p) = trainer.save_checkpoint()? {
            summary.checkpoints.push(p.clone());
            summary.checkpoint = Some(p);
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

/// A line of a JSON-lines file cut short by a crash (the last line, without its newline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornLine {
    /// Byte offset of the line's start in the file.
    pub offset: u64,
    /// Bytes of the torn line.
    pub len: u64,
}

impl TornLine {
    /// Logs a warning naming the file, the offset and what is done with the line (`action`).
    fn warn(&self, path: &Path, action: &str) {
        tracing::warn!(
            "metrics file {}: torn last line at byte offset {} ({} bytes, no newline: a run was killed while writing \
             it); {action}",
            path.display(),
            self.offset,
            self.len
        );
    }
}

/// The records of a metrics file (`[output] metrics`) and its torn last line, if any.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsFile {
    /// One record per complete line, in file order.
    pub records: Vec<StepRecord>,
    /// The last line, when a crash cut it (tolerated: reported, not parsed).
    pub torn: Option<TornLine>,
}

/// Reads a metrics file. A torn last line (no newline: the run was killed while writing it) is
/// left out and reported in [`MetricsFile::torn`] and as a warning naming the file and offset.
///
/// # Errors
/// [`TrainError::Checkpoint`] with the I/O error naming the file; [`TrainError::Mismatch`]
/// naming the file and line for a complete line that is not a step record.
pub fn read_metrics(path: &Path) -> Result<MetricsFile> {
    let io = |source| TrainError::Checkpoint(crate::checkpoint::CheckpointError::Io { path: path.into(), source });
    let bytes = std::fs::read(path).map_err(io)?;
    let (complete, torn) = split_torn(&bytes);
    if let Some(t) = &torn {
        t.warn(path, "ignored");
    }
    let mut records = Vec::new();
    for (i, line) in complete.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let r = serde_json::from_slice(line).map_err(|e| TrainError::Mismatch {
            path: path.into(),
            reason: format!("line {} is not a step record: {e}", i + 1),
        })?;
        records.push(r);
    }
    Ok(MetricsFile { records, torn })
}

/// `bytes` up to and including its last newline, and the torn rest (if not empty).
fn split_torn(bytes: &[u8]) -> (&[u8], Option<TornLine>) {
    let end = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let torn = (end < bytes.len()).then(|| TornLine { offset: end as u64, len: (bytes.len() - end) as u64 });
    (&bytes[..end], torn)
}

/// Before a resumed run appends to its metrics file: cuts a torn last line (warning with the
/// byte offset) and the lines of steps after `resumed_step` (the killed run logged them after
/// its last checkpoint; they are run again), so the file holds each step once.
fn trim_metrics_for_resume(path: &Path, resumed_step: u64) -> std::io::Result<()> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let (complete, torn) = split_torn(&bytes);
    if let Some(t) = &torn {
        t.warn(path, "cut before appending");
    }
    let mut cut = complete.len();
    let mut offset = 0;
    for line in complete.split_inclusive(|&b| b == b'\n') {
        let step = serde_json::from_slice::<serde_json::Value>(line).ok().and_then(|v| v["step"].as_u64());
        if step.is_some_and(|s| s > resumed_step) {
            cut = offset;
            break;
        }
        offset += line.len();
    }
    if cut < complete.len() {
        tracing::info!(
            "metrics file {}: dropping the lines after step {resumed_step} (logged after the last checkpoint; run again)",
            path.display()
        );
    }
    if cut < bytes.len() {
        std::fs::OpenOptions::new().write(true).open(path)?.set_len(cut as u64)?;
    }
    Ok(())
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

/// The host memory figures of `trainer`'s run so far.
fn host_report(trainer: &Trainer) -> HostReport {
    let rt = trainer.runtime();
    let overhead = trainer.host_overhead();
    let ledger = rt.memory().host_ledger().report();
    let plan = rt.memory().host_plan().cloned().unwrap_or_else(|| rt.memory().plan_host());
    HostReport {
        budget_bytes: ledger.budget_bytes,
        plan_peak_bytes: plan.peak_bytes(),
        ledger_peak_bytes: ledger.peak_bytes,
        peak_rss_bytes: crate::runtime::budget::peak_rss_bytes().unwrap_or(0),
        fixed_overhead_bytes: overhead.total_bytes(),
        overhead,
        categories: ledger
            .categories
            .iter()
            .map(|c| (c.category.name().to_string(), plan.bytes_of(c.category), c.peak_bytes))
            .collect(),
    }
}

impl RunSummary {
    /// A human-readable report.
    pub fn render(&self) -> String {
        let pct = |x: f64| 100.0 * x / self.train_s.max(1e-9);
        let mut s = String::new();
        s += &format!("steps {}..={}, {} parameters\n", self.first_step, self.last_step, self.params);
        s += &format!(
            "loss: train {:.4}, val {:.4} nats/token = {:.3} bits/byte; unigram entropy of the text {:.4} nats/token ({:.3} bits/byte at {:.3} bytes/token)\n",
            self.final_loss,
            self.final_val_loss,
            self.final_val_bits_per_byte,
            self.unigram_entropy_nats,
            self.unigram_entropy_nats / std::f64::consts::LN_2 / self.bytes_per_token.max(1e-9),
            self.bytes_per_token
        );
        if let Some(v) = self.initial_val_loss {
            s += &format!("loss before the first step: val {v:.4} nats/token\n");
        }
        s += &format!(
            "throughput: {:.0} tokens/s; time {:.1} s = compute {:.1} s ({:.0}%) + exposed transfer {:.1} s ({:.0}%) + exposed optimizer {:.1} s ({:.0}%)\n",
            self.tokens_per_s,
            self.train_s,
            self.compute_s,
            pct(self.compute_s),
            self.exposed_transfer_s,
            pct(self.exposed_transfer_s),
            self.exposed_optimizer_s,
            pct(self.exposed_optimizer_s)
        );
        s += &format!(
            "traffic: H2D {}, D2H {}, NVMe read {}, NVMe write {}\n",
            gb(self.h2d_bytes),
            gb(self.d2h_bytes),
            gb(self.nvme_read_bytes),
            gb(self.nvme_write_bytes)
        );
        if self.gather_bytes > 0 {
            s.pop();
            s += &format!("; all-gathers of sharded parameters received {}\n", gb(self.gather_bytes));
        }
        s += &format!(
            "peak: GPU {} B, pinned host {} B, NVMe {} B; parameters + optimizer state = {:.1} × the GPU budget\n",
            self.peak_gpu_bytes, self.peak_host_bytes, self.nvme_bytes, self.model_to_gpu_ratio
        );
        let h = &self.host;
        s += &format!(
            "host: budget {} B; plan peak {} B, ledger peak {} B, process peak RSS {} B (stated overhead outside the \
             ledger {} B)\n",
            h.budget_bytes, h.plan_peak_bytes, h.ledger_peak_bytes, h.peak_rss_bytes, h.fixed_overhead_bytes
        );
        s += "  by category (plan / ledger peak):";
        for (name, plan, peak) in &h.categories {
            s += &format!(" {name} {plan} / {peak};");
        }
        s += "\n";
        if let Some(last) = self.checkpoints.last() {
            s += &format!("checkpoints: {} written, the last {}\n", self.checkpoints.len(), last.display());
        }
        if self.stopped {
            s += &format!("stopped early (signal) after step {}\n", self.last_step);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
             minor_faults device_units device_optimizer_bytes gathers gather_bytes device_peak_bytes"
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
