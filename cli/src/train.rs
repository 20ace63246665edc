//! `oogc train`: a run from a TOML config, with a progress bar on stderr and the summary on stdout.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use oogc::config::TrainConfig;

#[derive(Debug, Args)]
pub(crate) struct TrainCmd {
    /// The run's TOML config (see configs/ and the README's config reference).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: PathBuf,
    /// Continue from the newest checkpoint in DIR (or from a checkpoint file).
    #[arg(long, value_name = "DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// Stop after this step (default: train.steps of the config).
    #[arg(long, value_name = "N")]
    pub(crate) steps: Option<u64>,
    /// Override [data] path (relative to the working directory).
    #[arg(long, value_name = "FILE")]
    pub(crate) data: Option<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub(crate) no_progress: bool,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn train(cmd: TrainCmd, cfg: TrainConfig) -> anyhow::Result<()> {
    let mut cfg = cfg;
    oogc::run::size_compute_threads(&cfg)?;
    if let Some(data) = cmd.data {
        cfg.data.path = data;
    }
    let opts = oogc::run::RunOptions { resume: cmd.resume, steps: cmd.steps };
    let progress = !cmd.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut bar = ProgressObserver::new(progress);
    let summary = oogc::run::run(cfg, &opts, &mut bar).context("oogc train")?;
    if cmd.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print!("{}", summary.render());
    }
    Ok(())
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
            100.0 * r.stall_s / r.step_s.max(1e-9),
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
