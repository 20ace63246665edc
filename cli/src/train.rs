//! `oogc train`: a run from a TOML config, with a progress bar on stderr and the summary on stdout.
//!
//! The first SIGINT or SIGTERM asks for a graceful stop: the step in flight finishes, a
//! checkpoint is written (when the config has a checkpoint directory), a line says how to resume,
//! and the process exits with [`EXIT_STOPPED`]. A second signal exits at once with 128 + the
//! signal number (the last checkpoint stays valid: checkpoints are written atomically).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use oogc::config::TrainConfig;

#[derive(Debug, Args)]
pub(crate) struct TrainCmd {
    /// The run's TOML config (see configs/ and `oogc config --reference`).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: PathBuf,
    /// Continue from the newest checkpoint in DIR (or from a checkpoint file).
    #[arg(long, value_name = "DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// With --resume: if the newest checkpoint fails its checksums, resume from the newest one
    /// that verifies (each one skipped is named, with why).
    #[arg(long, requires = "resume")]
    pub(crate) fallback: bool,
    /// With --resume: convert Adam moments saved in another dtype than the config's
    /// `[optimizer] state_dtype` (f32, bf16, int8; through f32, losing what the new dtype cannot
    /// hold). Without it such a checkpoint is refused.
    #[arg(long, requires = "resume")]
    pub(crate) convert_state: bool,
    /// Stop after this step (default: train.steps of the config).
    #[arg(long, value_name = "N")]
    pub(crate) steps: Option<u64>,
    /// Override `[data] path` (relative to the working directory).
    #[arg(long, value_name = "FILE")]
    pub(crate) data: Option<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub(crate) no_progress: bool,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    pub(crate) json: bool,
    /// Write each step's token windows to FILE (JSON Lines, one line per micro-batch:
    /// `{"step": n, "micro": m, "inputs": [[ids]...], "targets": [[ids]...]}`, targets the
    /// inputs shifted by one), so another implementation can train on the same batches.
    #[arg(long, value_name = "FILE")]
    pub(crate) dump_batches: Option<PathBuf>,
}

/// Exit status of a run stopped by SIGINT/SIGTERM after writing its checkpoint (not 0: the run
/// did not reach its last step; not 1: nothing failed).
pub(crate) const EXIT_STOPPED: u8 = 3;

/// Sets `stop` on the first SIGINT/SIGTERM (saying so on stderr); exits at once with 128 + the
/// signal number on the second.
fn install_stop_handlers(stop: &Arc<AtomicBool>) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    for sig in [SIGINT, SIGTERM] {
        // Runs in the handler: exits only when a first signal has already set the flag.
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, stop.clone())?;
    }
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    let stop = stop.clone();
    std::thread::Builder::new().name("oogc-signals".into()).spawn(move || {
        for sig in signals.forever() {
            if !stop.swap(true, Ordering::SeqCst) {
                let name = if sig == SIGINT { "SIGINT" } else { "SIGTERM" };
                eprintln!(
                    "{name}: finishing the step in flight, then writing a checkpoint and stopping \
                     (send it again to exit at once; the last checkpoint stays valid)"
                );
            }
        }
    })?;
    Ok(())
}

pub(crate) fn train(cmd: TrainCmd, cfg: TrainConfig) -> anyhow::Result<ExitCode> {
    // Started by mpirun: MPI is initialised here and finalised when this returns; its ranks (a
    // world of one otherwise) are passed down to the run.
    let mpi = oogc::dist::init().context("oogc train: setting up the ranks")?;
    let ranks = mpi.ranks();
    let world = ranks.world();
    let mut cfg = cfg;
    oogc::run::size_compute_threads(&cfg)?;
    if let Some(data) = &cmd.data {
        cfg.data.path = data.clone();
    }
    let stop = Arc::new(AtomicBool::new(false));
    install_stop_handlers(&stop)?;
    let opts = oogc::run::RunOptions {
        resume: cmd.resume.clone(),
        steps: cmd.steps,
        fallback: cmd.fallback,
        convert_state: cmd.convert_state,
        stop: Some(stop),
        dump_batches: cmd.dump_batches.clone(),
    };
    // Rank 0 reports (the progress bar, the summary); the other ranks train quietly.
    let progress = !cmd.no_progress && world.is_root() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut bar = ProgressObserver::new(progress);
    let ckpt_dir = cfg.checkpoint.dir.clone();
    let summary = match oogc::run::run(cfg, ranks.clone(), &opts, &mut bar).context("oogc train") {
        Ok(s) => s,
        Err(e) if world.size > 1 => {
            // The other ranks would wait for this one in their next collective: end them all
            // (MPI_Abort does not return), then this process.
            eprintln!("rank {} of {}: error: {e:#}", world.rank, world.size);
            ranks.abort(1);
            std::process::exit(1)
        }
        Err(e) => return Err(e),
    };
    if !world.is_root() {
        return Ok(if summary.stopped { ExitCode::from(EXIT_STOPPED) } else { ExitCode::SUCCESS });
    }
    if cmd.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print!("{}", summary.render());
    }
    if !summary.stopped {
        return Ok(ExitCode::SUCCESS);
    }
    match (&summary.checkpoint, &ckpt_dir) {
        (Some(ckpt), Some(dir)) => {
            let mut line = format!("oogc train --config {} --resume {}", cmd.config.display(), dir.display());
            if let Some(n) = cmd.steps {
                line += &format!(" --steps {n}");
            }
            if let Some(d) = &cmd.data {
                line += &format!(" --data {}", d.display());
            }
            eprintln!("stopped after step {}; checkpoint {}", summary.last_step, ckpt.display());
            eprintln!("resume with: {line}");
        }
        _ => eprintln!(
            "stopped after step {} without a checkpoint: the config sets no [checkpoint] dir, so these steps are lost",
            summary.last_step
        ),
    }
    Ok(ExitCode::from(EXIT_STOPPED))
}

/// `oogc train`'s progress bar on stderr (hidden with `--no-progress` or when stderr is not a
/// terminal): elapsed time, steps, loss, tokens/s, stall and bytes per link so far.
pub(crate) struct ProgressObserver {
    pub(crate) bar: ProgressBar,
    pub(crate) show: bool,
}

impl ProgressObserver {
    fn new(show: bool) -> Self {
        Self { bar: ProgressBar::hidden(), show }
    }
}

impl oogc::run::RunObserver for ProgressObserver {
    fn tokenize(&mut self, done: u64, total: u64) {
        if !self.show {
            return;
        }
        if self.bar.is_hidden() {
            self.bar = ProgressBar::new(total);
            self.bar.set_style(
                ProgressStyle::with_template("tokenizing {bytes}/{total_bytes} [{bar:30}] {bytes_per_sec}, eta {eta}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
        }
        self.bar.set_position(done);
        if done >= total {
            self.bar.finish_and_clear();
            self.bar = ProgressBar::hidden();
        }
    }

    fn start(&mut self, first: u64, last: u64) {
        if self.show && last >= first {
            self.bar = ProgressBar::new(last - first + 1);
            self.bar.set_style(
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
        }
    }

    fn step(&mut self, r: &oogc::run::StepRecord, totals: &oogc::run::RunSummary) {
        use oogc::run::gb;
        self.bar.set_message(format!(
            "loss {:.3} | {:.0} tok/s | stall {:.0}% | H2D {} D2H {} NVMe r {} w {}",
            r.loss,
            r.tokens_per_s,
            100.0 * r.stall_s / r.stats.step_s.max(1e-9),
            gb(totals.h2d_bytes),
            gb(totals.d2h_bytes),
            gb(totals.nvme_read_bytes),
            gb(totals.nvme_write_bytes),
        ));
        self.bar.inc(1);
    }

    fn line(&mut self, line: &str) {
        self.bar.println(line);
    }

    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
}
