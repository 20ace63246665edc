//! `oogc bench checkpoint --config F`: what a checkpoint costs the step after it, written in the
//! background ([`Trainer::start_checkpoint`], completed by polling
//! [`Trainer::finish_checkpoint`] after every step, as `oogc train` does) or synchronously
//! ([`Trainer::save_checkpoint`], the old way), beside the steps of the same run that follow no
//! save.
//!
//! One trainer of the config (its model, budgets and threads; no metrics, trace or routing trace;
//! NVMe state in a scratch subdirectory of each `[budgets] nvme_dirs` entry) trains `warmup`
//! steps, then `steps` measured ones. After every `interval`-th measured step (but the last) a
//! save starts, the modes alternating: background, sync, background, … The checkpoints go to a
//! scratch directory (`oogc-bench-checkpoint-<pid>` under [`CheckpointBenchArgs::dir`]), every
//! one is kept and verified against its checksums after the steps, and the directory is removed.
//!
//! Each step's interval is wall time from the end of the step before it to its own end, so the
//! poll and whatever a save started between two steps held the trainer count against the step
//! after the save. Per run and per mode:
//!
//! | figure | how |
//! |---|---|
//! | `step_s` | median interval of the steps that do not come right after a save (the baseline) |
//! | `after_s` | median interval of the steps right after a save of the mode |
//! | `cost_s`, `cost_ratio` | `after_s − step_s`, and that over `step_s` (the bar: background ≤ [`COST_BAR`]) |
//! | `paired_cost_s`, `paired_cost_ratio` | median over the mode's saves of the step right after a save less the step the save followed (the steps a save sits between, so a slow drift of the machine's load cancels), and that over `step_s` |
//! | `after2_s`, `after2_cost_ratio` | the same for the second step after a save (a background writer may still run then) |
//! | `held_s` | median seconds the save held the trainer: [`Trainer::start_checkpoint`]'s figure (background), the whole [`Trainer::save_checkpoint`] call (sync) |
//! | `save_s` | median [`oogc::checkpoint::Saved::seconds`]: the trainer's figure for the save, the writer's seconds from the file's creation to its rename |
//! | `steps_in_flight` | median step ends a background save stayed in flight (1: done by the end of the step after it); one still in flight after the last step counts the steps it was in flight for |
//! | `bytes`, `data_bytes` | the largest file of the mode, and its tensors' data bytes as [`oogc::checkpoint::verify`] counted them |

use std::path::PathBuf;
use std::time::Instant;

use oogc::checkpoint::Saved;
use oogc::checksum::Verification;
use oogc::config::TrainConfig;
use oogc::train::Trainer;
use serde::Serialize;

use crate::error::{Context, Error, Result};
use crate::machine::{self, Machine};
use crate::step::{median, remove_scratch, variant_config};

/// The bar: a background save costs the step after it at most this fraction of a step.
pub const COST_BAR: f64 = 0.10;

/// Arguments of the checkpoint benchmark.
#[derive(Debug, Clone)]
pub struct CheckpointBenchArgs {
    /// The run's config (paths already resolved); its `[checkpoint]` is replaced.
    pub config: TrainConfig,
    /// Measured steps (more than 2 × `interval`, so that each mode saves at least once).
    pub steps: usize,
    /// Steps run first and not measured (the first one records the schedule).
    pub warmup: usize,
    /// A save after every this many measured steps (≥ 2, so that some steps follow no save).
    pub interval: usize,
    /// Directory under which the scratch checkpoint directory is made; `None`: the parent of
    /// the config's `[checkpoint] dir` (the file system its checkpoints go to), else the temp
    /// directory.
    pub dir: Option<PathBuf>,
}

impl CheckpointBenchArgs {
    /// `steps` 48, `warmup` 4, `interval` 4, the default scratch directory.
    pub fn new(config: TrainConfig) -> Self {
        Self { config, steps: 48, warmup: 4, interval: 4, dir: None }
    }
}

/// How a save was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveMode {
    /// [`Trainer::start_checkpoint`], then [`Trainer::finish_checkpoint`]`(false)` after each step.
    Background,
    /// [`Trainer::save_checkpoint`]: the trainer waits for the whole file.
    Sync,
}

/// One mode's figures (seconds are wall time; see the module docs).
#[derive(Debug, Clone, Serialize)]
pub struct ModeFigures {
    /// The mode.
    pub mode: SaveMode,
    /// Saves of this mode (each followed by a measured step).
    pub saves: usize,
    /// The measured steps (1-based) after which they started.
    pub after_steps: Vec<usize>,
    /// Median interval of the steps right after a save of this mode, seconds.
    pub after_s: f64,
    /// `after_s − step_s`, seconds (negative when within the noise).
    pub cost_s: f64,
    /// `cost_s / step_s`.
    pub cost_ratio: f64,
    /// Median over the mode's saves of (the step right after it − the step it followed),
    /// seconds: the cost with the machine's load at that moment cancelled.
    pub paired_cost_s: f64,
    /// `paired_cost_s / step_s`.
    pub paired_cost_ratio: f64,
    /// Median interval of the second steps after a save of this mode, seconds (`None` when no
    /// save had a second measured step after it).
    pub after2_s: Option<f64>,
    /// `(after2_s − step_s) / step_s`.
    pub after2_cost_ratio: Option<f64>,
    /// Median seconds the save held the trainer.
    pub held_s: f64,
    /// Median [`oogc::checkpoint::Saved::seconds`] (from the file's creation to its rename).
    pub save_s: f64,
    /// Median step ends a save stayed in flight after it started (0 for sync saves).
    pub steps_in_flight: f64,
    /// Bytes of the mode's largest checkpoint file (header and data).
    pub bytes: u64,
    /// Data bytes of that file's tensors, as verified.
    pub data_bytes: u64,
    /// Files of this mode that verified against their checksums (all of them, or the bench
    /// fails).
    pub verified: usize,
}

/// What [`run`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointBenchReport {
    /// Measured steps.
    pub steps: usize,
    /// Unmeasured steps before them.
    pub warmup: usize,
    /// A save after every this many measured steps.
    pub interval: usize,
    /// Steps in the baseline (not right after a save).
    pub baseline_steps: usize,
    /// Median interval of the baseline steps, seconds.
    pub step_s: f64,
    /// Every measured step's interval, seconds (measured step `j + 1` at index `j`).
    pub intervals_s: Vec<f64>,
    /// Background saves.
    pub background: ModeFigures,
    /// Synchronous saves.
    pub sync: ModeFigures,
    /// [`COST_BAR`].
    pub bar: f64,
    /// `background.cost_ratio ≤ bar`.
    pub passes: bool,
    /// The scratch directory the checkpoints went to (removed after).
    pub dir: PathBuf,
    /// The machine.
    pub machine: Machine,
}

/// One save of the measured steps.
struct Save {
    mode: SaveMode,
    /// The measured step (1-based) at whose end it started.
    at: usize,
    held_s: f64,
    saved: Option<Saved>,
    /// Step ends it stayed in flight.
    in_flight: usize,
}

/// The scratch directory for `args`' checkpoints (see [`CheckpointBenchArgs::dir`]).
fn scratch_dir(args: &CheckpointBenchArgs) -> PathBuf {
    let parent = args
        .dir
        .clone()
        .or_else(|| args.config.checkpoint.dir.as_ref().and_then(|d| d.parent()).map(PathBuf::from))
        .unwrap_or_else(std::env::temp_dir);
    parent.join(format!("oogc-bench-checkpoint-{}", std::process::id()))
}

/// Runs the benchmark (module docs).
///
/// # Errors
/// `steps ≤ 2 × interval` or `interval < 2` (named with the fix); the scratch directory exists
/// already or cannot be made; the trainer's errors (bad config, data, NVMe, a save that fails,
/// e.g. a full disk); a checkpoint that fails its checksums.
pub fn run(args: &CheckpointBenchArgs) -> Result<CheckpointBenchReport> {
    if args.interval < 2 {
        return Err(Error::invalid(
            format!("--interval {}", args.interval),
            "must be at least 2: the baseline is the steps that follow no save",
        ));
    }
    if args.steps <= 2 * args.interval {
        return Err(Error::invalid(
            format!("--steps {}", args.steps),
            format!(
                "must be more than 2 × --interval ({}): each mode saves at least once, with a measured step after it",
                args.interval
            ),
        ));
    }
    let dir = scratch_dir(args);
    if dir.exists() {
        return Err(Error::invalid(
            format!("the scratch directory {}", dir.display()),
            "exists already (left by an earlier run?): remove it, or give another --dir",
        ));
    }
    std::fs::create_dir_all(&dir).map_err(Error::io("creating the scratch directory", &dir, Some("check --dir")))?;
    let mut cfg = variant_config(&args.config, "checkpoint", (args.warmup + args.steps) as u64);
    cfg.checkpoint.dir = Some(dir.clone());
    cfg.checkpoint.interval = 0;
    // Every checkpoint is kept, to be verified after the steps.
    cfg.checkpoint.keep = Some(args.steps / args.interval + 1);
    let machine = machine::record(Some(&dir));
    let result = measure(&cfg, args).and_then(|(intervals, saves)| Ok((figures(args, &intervals, &saves)?, intervals)));
    remove_scratch(&cfg);
    let _ = std::fs::remove_dir_all(&dir);
    let ((baseline_steps, step_s, background, sync), intervals_s) = result?;
    let passes = background.cost_ratio <= COST_BAR;
    Ok(CheckpointBenchReport {
        steps: args.steps,
        warmup: args.warmup,
        interval: args.interval,
        baseline_steps,
        step_s,
        intervals_s,
        background,
        sync,
        bar: COST_BAR,
        passes,
        dir,
        machine,
    })
}

/// Trains the warmup and the measured steps of `cfg`, saving as the module docs say. Returns
/// each measured step's interval (seconds) and the saves.
fn measure(cfg: &TrainConfig, args: &CheckpointBenchArgs) -> Result<(Vec<f64>, Vec<Save>)> {
    let no_dir = || Error::Internal { what: "the benchmark's config has a checkpoint directory" };
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single())?;
    for _ in 0..args.warmup {
        t.train_step()?;
    }
    let mut intervals = Vec::with_capacity(args.steps);
    let mut saves: Vec<Save> = Vec::new();
    // The background save in flight, by its index in `saves`.
    let mut pending: Option<usize> = None;
    let mut last = Instant::now();
    for i in 1..=args.steps {
        t.train_step().with_context(|| format!("measured step {i}"))?;
        let end = Instant::now();
        intervals.push((end - last).as_secs_f64());
        last = end;
        if let Some(k) = pending {
            saves[k].in_flight += 1;
        }
        // As `oogc train` does: a save in the background is completed once done.
        if let Some(saved) = t.finish_checkpoint(false).with_context(|| format!("the save after step {i}"))? {
            let k = pending.take().ok_or(Error::Internal { what: "a background save in flight" })?;
            saves[k].saved = Some(saved);
        }
        if i % args.interval != 0 || i == args.steps {
            continue;
        }
        let began = Instant::now();
        // A save still in flight is completed first (the trainer would wait for it too).
        if let Some(k) = pending.take() {
            saves[k].saved = t.finish_checkpoint(true)?;
        }
        let mode = if saves.len() % 2 == 0 { SaveMode::Background } else { SaveMode::Sync };
        let saved = match mode {
            SaveMode::Background => {
                t.start_checkpoint()
                    .with_context(|| format!("a background save after step {i}"))?
                    .ok_or_else(no_dir)?;
                pending = Some(saves.len());
                None
            }
            SaveMode::Sync => {
                Some(t.save_checkpoint().with_context(|| format!("a sync save after step {i}"))?.ok_or_else(no_dir)?)
            }
        };
        saves.push(Save { mode, at: i, held_s: began.elapsed().as_secs_f64(), saved, in_flight: 0 });
    }
    if let Some(k) = pending {
        saves[k].saved = t.finish_checkpoint(true)?;
    }
    Ok((intervals, saves))
}

/// The baseline (steps, median interval) and each mode's figures, every file verified.
fn figures(
    args: &CheckpointBenchArgs,
    intervals: &[f64],
    saves: &[Save],
) -> Result<(usize, f64, ModeFigures, ModeFigures)> {
    // `intervals[j]` is measured step `j + 1`.
    let after = |s: &Save, k: usize| intervals.get(s.at + k - 1).copied();
    let right_after: Vec<usize> = saves.iter().map(|s| s.at + 1).collect();
    let baseline: Vec<f64> =
        intervals.iter().enumerate().filter(|(j, _)| !right_after.contains(&(j + 1))).map(|(_, &x)| x).collect();
    let (baseline_steps, step_s) = (baseline.len(), median(baseline));
    let mode = |mode: SaveMode| -> Result<ModeFigures> {
        let of: Vec<&Save> = saves.iter().filter(|s| s.mode == mode).collect();
        let (mut largest, mut verified) = ((0u64, 0u64), 0);
        for s in &of {
            let saved = s.saved.as_ref().ok_or(Error::Internal { what: "every save completed" })?;
            let data_bytes = match oogc::checkpoint::verify(&saved.path).map_err(oogc::train::TrainError::from)? {
                Verification::Verified { bytes, .. } => bytes,
                Verification::Unverified => {
                    return Err(Error::Internal { what: "a checkpoint the trainer wrote carries checksums" })
                }
            };
            largest = largest.max((saved.bytes, data_bytes));
            verified += 1;
        }
        let after_s = median(of.iter().filter_map(|s| after(s, 1)).collect());
        let after2: Vec<f64> = of.iter().filter_map(|s| after(s, 2)).collect();
        let after2_s = (!after2.is_empty()).then(|| median(after2));
        let paired_cost_s = median(of.iter().filter_map(|s| Some(after(s, 1)? - after(s, 0)?)).collect());
        let ratio = |x: f64| (x - step_s) / step_s.max(1e-12);
        Ok(ModeFigures {
            mode,
            saves: of.len(),
            after_steps: of.iter().map(|s| s.at).collect(),
            after_s,
            cost_s: after_s - step_s,
            cost_ratio: ratio(after_s),
            paired_cost_s,
            paired_cost_ratio: paired_cost_s / step_s.max(1e-12),
            after2_s,
            after2_cost_ratio: after2_s.map(ratio),
            held_s: median(of.iter().map(|s| s.held_s).collect()),
            save_s: median(of.iter().filter_map(|s| s.saved.as_ref()).map(|s| s.seconds).collect()),
            steps_in_flight: median(of.iter().map(|s| s.in_flight as f64).collect()),
            bytes: largest.0,
            data_bytes: largest.1,
            verified,
        })
    };
    let background = mode(SaveMode::Background).context("the background saves")?;
    let sync = mode(SaveMode::Sync).context("the sync saves")?;
    debug_assert!(background.saves + sync.saves == saves.len() && args.steps == intervals.len());
    Ok((baseline_steps, step_s, background, sync))
}

/// Prints the report as a table.
pub fn print_table(r: &CheckpointBenchReport) {
    println!(
        "{} measured steps after {}, a save after every {} (alternating background and sync); baseline: {} steps \
         that follow no save, median {:.4} s",
        r.steps, r.warmup, r.interval, r.baseline_steps, r.step_s
    );
    println!(
        "{:<11} {:>5} {:>9} {:>9} {:>7} {:>8} {:>9} {:>7} {:>9} {:>9} {:>7} {:>11}",
        "mode",
        "saves",
        "after s",
        "cost s",
        "cost %",
        "paired %",
        "after2 s",
        "2nd %",
        "held s",
        "save s",
        "flight",
        "bytes"
    );
    for m in [&r.background, &r.sync] {
        let mode = match m.mode {
            SaveMode::Background => "background",
            SaveMode::Sync => "sync",
        };
        println!(
            "{:<11} {:>5} {:>9.4} {:>+9.4} {:>+6.1}% {:>+7.1}% {:>9} {:>7} {:>9.4} {:>9.4} {:>7.1} {:>11}",
            mode,
            m.saves,
            m.after_s,
            m.cost_s,
            100.0 * m.cost_ratio,
            100.0 * m.paired_cost_ratio,
            m.after2_s.map_or("-".into(), |x| format!("{x:.4}")),
            m.after2_cost_ratio.map_or("-".into(), |x| format!("{:+.1}%", 100.0 * x)),
            m.held_s,
            m.save_s,
            m.steps_in_flight,
            m.bytes
        );
    }
    println!(
        "background save costs the step after it {:+.1}% of a step (bar ≤ {:.0}%): {} (paired with the step before \
         each save: {:+.1}%)",
        100.0 * r.background.cost_ratio,
        100.0 * r.bar,
        if r.passes { "passes" } else { "fails" },
        100.0 * r.background.paired_cost_ratio
    );
    println!(
        "machine: {} ({} cores), checkpoints on {} ({}), git {}",
        r.machine.cpu_model,
        r.machine.cores,
        r.dir.display(),
        r.machine.fs_type,
        r.machine.git_rev
    );
}
