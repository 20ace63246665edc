//! The `oogc` command line: `oogc train`, `oogc inspect`, `oogc plan`, `oogc bench nvme`,
//! `oogc bench swap`, `oogc bench evict`, `oogc bench adam`, `oogc bench moe`, `oogc bench step`,
//! `oogc bench all`, `oogc gpu-check`, `oogc config`.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default `warn`); results go to stdout, as a table
//! or, with `--json`, as JSON Lines (one object per row per line). Errors print the whole cause
//! chain on stderr and exit with status 1; bad arguments exit with status 2 (clap). `oogc train`
//! stopped by SIGINT/SIGTERM exits with status 3 after writing its checkpoint (a second signal:
//! 128 + the signal number, at once).
#![deny(unsafe_code)]

mod args;
mod bench;
mod config;
mod export;
mod gpu_check;
mod inspect;
mod plan;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use oogc::config::TrainConfig;
use oogc::swapper::Error as SwapError;
use tracing_subscriber::EnvFilter;

use crate::bench::BenchCommand;
use crate::config::ConfigCmd;
use crate::export::ExportCmd;
use crate::gpu_check::GpuCheckCmd;
use crate::inspect::InspectCmd;
use crate::plan::PlanCmd;
use crate::train::TrainCmd;

/// `oogc --version`: the package's version and the git revision it was built from (`cli/build.rs`:
/// 12 hex digits, `-dirty` when tracked files differed from it, `unknown` without git), e.g.
/// `0.1.0 (rev 62018f8c1d2e)`.
pub(crate) const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (rev ", env!("OOGC_GIT_REV"), ")");

/// The git revision this binary was built from (see [`VERSION`]).
pub(crate) const GIT_REV: &str = env!("OOGC_GIT_REV");

/// oogc: an out-of-GPU-core training runtime (tiered GPU / pinned host / NVMe memory).
///
/// Logs go to stderr; set RUST_LOG (e.g. `RUST_LOG=oogc_swapper=debug`) to see more than warnings.
///
/// Each command's `--help` ends with its page in the book (docs/src, Markdown; `mdbook serve docs`
/// renders it).
#[derive(Debug, Parser)]
#[command(name = "oogc", version = VERSION, propagate_version = true, after_help = "Book: docs/src/introduction.md")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Train the model of a TOML config out of GPU core — a Llama, Mistral, Qwen2, Qwen3,
    /// Mixtral, Qwen3-MoE, OLMoE or Qwen2-MoE (from a Hugging Face checkpoint, `[model] init`, or
    /// from scratch) or the byte-level GPT / MoE-GPT — on the sim device unless the config says
    /// `device.kind = "cuda:N"`; under `mpirun -np N` (feature `mpi`) as N data-parallel ranks.
    /// Progress bar, validation, metrics, checkpoints (`--resume`), summary.
    #[command(after_help = "Book: docs/src/guide/main-job.md")]
    Train(TrainCmd),
    /// Summarize a checkpoint (a ckpt-*.safetensors file, or a checkpoint directory: its newest);
    /// `--verify` checks every tensor's crc32c. Also reads a Hugging Face safetensors file.
    #[command(after_help = "Book: docs/src/guide/failure-modes.md")]
    Inspect(InspectCmd),
    /// Write a Llama-family run's checkpoint as a Hugging Face checkpoint (`--hf OUT_DIR`:
    /// config.json, sharded safetensors + index, tokenizer.json) that transformers loads.
    #[command(after_help = "Book: docs/src/guide/your-model.md")]
    Export(ExportCmd),
    /// Offload benchmarks (NVMe, swap, Adam, eviction, MoE placement, the end-to-end step, the
    /// plan's accuracy; `all` for every one with plots): a table on stdout, or JSON with --json.
    #[command(subcommand)]
    #[command(after_help = "Book: docs/src/benchmarks.md")]
    Bench(BenchCommand),
    /// Plan a config's run under its budgets (any family): bytes per tier (GPU, host, NVMe), the
    /// GPU memory section, the predicted peak RSS, the minimum GPU budget and the predicted step
    /// time (compute, exposed transfer, exposed optimizer) from the step simulator, with a
    /// hardware profile's figures (`--profile`); or, with --hardware-probe, measure this machine
    /// into a hardware profile (TOML).
    #[command(after_help = "Book: docs/src/guide/budgets.md")]
    Plan(PlanCmd),
    /// Every GPU check in one run (`--device cuda:N` on the GPU machine, `sim` in CI): one JSON
    /// row per check in OUT/gpu-check.jsonl and a Markdown report in OUT/gpu-check.md, written
    /// as each check finishes; exit status 0 only when no check failed.
    #[command(after_help = "Book: docs/src/guide/gpu.md")]
    GpuCheck(GpuCheckCmd),
    /// The config file's every table and key, generated from the config types' doc comments:
    /// `--reference` (Markdown: key, type, unit, default, meaning; the book's
    /// docs/src/reference/config.md) or `--example` (a commented TOML to start from).
    #[command(after_help = "Book: docs/src/reference/config.md")]
    Config(ConfigCmd),
}

/// The error's cause chain as one line, leaving out a cause whose text the previous message
/// already contains (the swapper's `Io` error prints its source itself).
pub(crate) fn error_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut prev = String::new();
    for cause in e.chain() {
        let msg = cause.to_string();
        if !prev.is_empty() && prev.contains(&msg) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&msg);
        prev = msg;
    }
    out
}

/// The first cause of type `E` in `e`'s chain, looking inside the errors that `oogc-bench`
/// wraps transparently (which `source()` skips).
pub(crate) fn cause<E: std::error::Error + 'static>(e: &anyhow::Error) -> Option<&E> {
    e.chain().find_map(|c| c.downcast_ref::<E>().or_else(|| c.downcast_ref::<oogc_bench::Error>()?.find::<E>()))
}

/// Logs to stderr by `RUST_LOG`; with `trace`, also a Chrome trace of the runtime's spans (one
/// track per thread: compute, copy engines, optimizer workers). The guard flushes the trace.
pub(crate) fn init_tracing(trace: Option<&std::path::Path>) -> Option<tracing_chrome::FlushGuard> {
    use tracing_subscriber::prelude::*;
    let filter = match EnvFilter::try_from_default_env() {
        Ok(f) => f,
        Err(e) => {
            if std::env::var_os(EnvFilter::DEFAULT_ENV).is_some() {
                eprintln!("warning: ignoring RUST_LOG ({e}); logging warnings only");
            }
            EnvFilter::new("warn")
        }
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi).with_filter(filter);
    let (chrome, guard) = match trace {
        Some(path) => {
            if let Some(dir) = path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new().file(path).include_args(true).build();
            let filter = EnvFilter::new("oogc=trace,oogc_swapper=trace,oogc_optimizer=trace,oogc_prefetch=info");
            (Some(layer.with_filter(filter)), Some(guard))
        }
        None => (None, None),
    };
    tracing_subscriber::registry().with(fmt).with(chrome).init();
    guard
}

/// malloc with large blocks on transparent huge pages: candle's per-step tensors fault 512 × fewer
/// times (`oogc_swapper::huge_malloc`; `main` also fixes malloc's thresholds with `tune_malloc`).
#[global_allocator]
static ALLOC: oogc::swapper::HugePageMalloc = oogc::swapper::HugePageMalloc;

fn main() -> ExitCode {
    oogc::swapper::huge_malloc::tune_malloc(oogc::swapper::huge_malloc::TRIM_THRESHOLD_BYTES);
    let cli = Cli::parse();
    // `train` reads its config first: a trace file in it adds a Chrome/Perfetto layer.
    let mut train_cfg = None;
    let mut _trace_guard = None;
    if let Command::Train(cmd) = &cli.command {
        match TrainConfig::load(&cmd.config) {
            Ok(cfg) => {
                _trace_guard = init_tracing(cfg.output.trace.as_deref());
                train_cfg = Some(cfg);
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else if !matches!(cli.command, Command::GpuCheck(_)) {
        // gpu-check sets up its own (a child may write a trace).
        init_tracing(None);
    }
    let result = match cli.command {
        Command::Train(cmd) => train::train(cmd, train_cfg.expect("loaded above")),
        Command::Inspect(cmd) => inspect::inspect(cmd),
        Command::Export(cmd) => export::export(cmd).map(|()| ExitCode::SUCCESS),
        Command::Bench(cmd) => bench::run(cmd).map(|()| ExitCode::SUCCESS),
        Command::Plan(cmd) => plan::plan(cmd).map(|()| ExitCode::SUCCESS),
        Command::GpuCheck(cmd) => gpu_check::run(cmd),
        Command::Config(cmd) => config::run(&cmd).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            if matches!(cause::<SwapError>(&e), Some(SwapError::Io { .. })) {
                eprintln!(
                    "hint: an NVMe read or write failed and the run stopped; its checkpoints are intact. Check the disk \
                     (dmesg, free space), then continue with `oogc train --config FILE --resume CKPT_DIR`"
                );
            }
            if matches!(cause::<SwapError>(&e), Some(SwapError::NvmeDir { .. })) {
                eprintln!("hint: store directories are given with --dir (nvme.dirs in a config file)");
            }
            if matches!(cause::<oogc::prefetch::Error>(&e), Some(oogc::prefetch::Error::BudgetBelowWorkingSet { .. })) {
                eprintln!("hint: the GPU budget is given with --gpu-budget (e.g. --gpu-budget 2GiB)");
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Every command's path (`["oogc", "bench", "nvme"]`) with its `--help`'s after-help text.
    fn commands(cmd: &clap::Command, path: &mut Vec<String>, out: &mut Vec<(String, String)>) {
        path.push(cmd.get_name().to_string());
        out.push((path.join(" "), cmd.get_after_help().map(|h| h.to_string()).unwrap_or_default()));
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            commands(sub, path, out);
        }
        path.pop();
    }

    /// Each command's `--help` ends with `Book: docs/src/PAGE.md[, section "HEADING"]`: the page
    /// exists in the book, is listed in its SUMMARY.md, and has the named heading.
    #[test]
    fn every_commands_help_names_its_book_page() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let summary = std::fs::read_to_string(root.join("docs/src/SUMMARY.md")).unwrap();
        let mut all = Vec::new();
        commands(&Cli::command(), &mut Vec::new(), &mut all);
        assert!(all.len() > 15, "{all:?}");
        for (name, after) in &all {
            let book = after
                .lines()
                .find_map(|l| l.strip_prefix("Book: "))
                .unwrap_or_else(|| panic!("`{name} --help` names no book page (after_help = \"Book: docs/src/..\")"));
            let (page, section) = match book.split_once(", section ") {
                Some((page, section)) => (page, Some(section.trim_matches('"'))),
                None => (book, None),
            };
            let rel = page.strip_prefix("docs/src/").unwrap_or_else(|| panic!("{name}: {page} is not under docs/src"));
            let text = std::fs::read_to_string(root.join(page)).unwrap_or_else(|e| panic!("{name}: {page}: {e}"));
            assert!(summary.contains(&format!("({rel})")), "{name}: {page} is not in docs/src/SUMMARY.md");
            if let Some(section) = section {
                assert!(
                    text.lines().any(|l| l.starts_with('#') && l.trim_start_matches('#').trim() == section),
                    "{name}: {page} has no heading `{section}`"
                );
            }
        }
    }
}
