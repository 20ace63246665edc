//! `oogc bench all`: the whole offload suite in one run — `nvme`, `swap`, `adam`, `evict` and
//! `moe` (a synthetic trace, plus a recorded one when given) — one JSON file per benchmark and the
//! plots of [`super::plots`], with a progress bar over the benchmarks.
//!
//! | file | what it holds |
//! |---|---|
//! | `DIR/<name>.json` | `{ "benchmark": name, "args": {...}, "rows": [...] }`: the rows are those of `oogc bench <name> --json`; `moe-trace.json` for a recorded trace |
//! | `DIR/*.png`, `DIR/*.svg` | the plots (see [`super::plots`]) |
//!
//! | sizes | `--quick` (the suite in under 3 minutes on 2 cores) | full (the defaults of each benchmark) |
//! |---|---|---|
//! | nvme | 0.25 GiB per engine, 64 MiB tensors | 2 GiB per engine |
//! | swap | 64 MiB | 256 MiB |
//! | adam | 16 Mi parameters, threads 1 and 2, 3 timed steps | 256 Mi parameters, 5 steps |
//! | evict | the default GPT (24 × 512) and budget sweep | the same |
//! | moe | synthetic, 100 steps | synthetic, 200 steps |
//!
//! fio runs beside the store when it is on the PATH (`--no-fio` skips it). With a training config
//! (`--config F`, optionally `--link-gbps G` to throttle its sim link) the suite also runs
//! `oogc bench step` on it (`step.json`: 3 measured steps after 1 warmup with `--quick`, else 10
//! after 3) and records a step timeline from a real run's trace (`timeline.json`,
//! `timeline.png`/`.svg`; see [`super::timeline`]). With `--plan-config F` (repeatable; default:
//! the `--config` run) the plan is checked against real steps of each config
//! (`plan.json`, [`super::plan_check`]: 3 steps after 2 with `--quick`, else 5 after 2).

use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use oogc_moe_placement::{read_trace_file, synthetic_trace, RoutingTrace, SyntheticConfig};
use oogc_swapper::EngineChoice;
use serde::Serialize;
use serde_json::{json, Value};

use super::{adam, evict, moe, nvme, plan_check, plots, step, swap, timeline};
use crate::error::{Context, Error, Result};
use oogc::plan::GptShape;

/// How large each benchmark runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SuiteSize {
    /// Each benchmark's defaults (minutes per benchmark).
    Full,
    /// The whole suite in under 3 minutes on a 2-core machine (`--quick`).
    Quick,
    /// Seconds in a debug build, for the CLI test (hidden `--tiny`); the figures mean little.
    Tiny,
}

/// Arguments of the suite.
#[derive(Debug, Clone)]
pub struct AllBenchArgs {
    /// Directory for the JSON files and plots (created when missing).
    pub out: PathBuf,
    /// Sizes of the benchmarks.
    pub size: SuiteSize,
    /// Directories of the NVMe store (default: the system temp directory).
    pub nvme_dirs: Vec<PathBuf>,
    /// Run fio beside the store when it is on the PATH.
    pub fio: bool,
    /// A recorded MoE routing trace (JSON Lines) replayed after the synthetic one.
    pub moe_trace: Option<PathBuf>,
    /// A training config for `oogc bench step` and the step timeline; none: both are left out.
    pub step_config: Option<PathBuf>,
    /// Throttle the step config's sim link to this many GB/s (10⁹ B/s) each way.
    pub link_gbps: Option<f64>,
    /// Configs whose `oogc plan` is checked against real steps (`plan.json`); empty: the
    /// step config (as throttled), if any.
    pub plan_configs: Vec<PathBuf>,
    /// Show the progress bar (it is hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// Print each benchmark's table on stdout as it finishes.
    pub tables: bool,
}

/// One benchmark of the suite after it ran.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteEntry {
    /// `nvme`, `swap`, `adam`, `evict`, `moe`, `moe-trace`.
    pub benchmark: String,
    /// The JSON file written.
    pub file: PathBuf,
    /// Rows in it.
    pub rows: usize,
    /// Wall time of the benchmark, seconds.
    pub seconds: f64,
}

/// What the suite wrote.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteReport {
    /// The benchmarks, in the order they ran.
    pub entries: Vec<SuiteEntry>,
    /// The plot files written (PNG and SVG).
    pub plots: Vec<PathBuf>,
    /// Wall time of the whole suite, seconds.
    pub seconds: f64,
}

/// The rows of every benchmark, for the plots.
#[derive(Debug, Clone, Default)]
pub struct SuiteRows {
    /// `bench nvme` rows.
    pub nvme: Vec<nvme::NvmeBenchRow>,
    /// `bench swap` rows.
    pub swap: Vec<swap::SwapBenchRow>,
    /// `bench adam` rows.
    pub adam: Vec<adam::AdamBenchRow>,
    /// `bench evict` rows.
    pub evict: Vec<evict::EvictBenchRow>,
    /// `bench moe` rows of the synthetic trace.
    pub moe: Vec<moe::MoeBenchRow>,
    /// `bench moe` rows of the recorded trace, when one was given.
    pub moe_trace: Vec<moe::MoeBenchRow>,
}

fn nvme_args(a: &AllBenchArgs) -> nvme::NvmeBenchArgs {
    let dirs = if a.nvme_dirs.is_empty() { vec![std::env::temp_dir()] } else { a.nvme_dirs.clone() };
    let (size_gib, tensor_bytes) = match a.size {
        SuiteSize::Full => (2.0, 64 << 20),
        SuiteSize::Quick => (0.25, 64 << 20),
        SuiteSize::Tiny => (8.0 / 1024.0, 2 << 20),
    };
    nvme::NvmeBenchArgs { dirs, size_gib, tensor_bytes, fio: a.fio, ..nvme::NvmeBenchArgs::default() }
}

fn swap_args(a: &AllBenchArgs) -> swap::SwapBenchArgs {
    let (size_bytes, repeats) = match a.size {
        SuiteSize::Full => (256 << 20, 8),
        SuiteSize::Quick => (64 << 20, 8),
        SuiteSize::Tiny => (4 << 20, 2),
    };
    swap::SwapBenchArgs { size_bytes, repeats, ..swap::SwapBenchArgs::default() }
}

fn adam_args(a: &AllBenchArgs) -> adam::AdamBenchArgs {
    // The tiny suite's triad is as small as its step: a smoke run, not a bandwidth figure.
    let (params, steps, triad_bytes) = match a.size {
        SuiteSize::Full => (256 << 20, 5, None),
        SuiteSize::Quick => (16 << 20, 3, None),
        SuiteSize::Tiny => (64 << 10, 1, Some(16 << 20)),
    };
    adam::AdamBenchArgs { params, steps, threads: vec![1, 2], triad_bytes, ..adam::AdamBenchArgs::default() }
}

fn evict_args(a: &AllBenchArgs) -> evict::EvictBenchArgs {
    match a.size {
        SuiteSize::Full | SuiteSize::Quick => evict::EvictBenchArgs::default(),
        SuiteSize::Tiny => evict::EvictBenchArgs {
            shape: GptShape { layers: 4, d_model: 64, seq_len: 32, batch: 2, dtype_bytes: 2 },
            fractions: vec![0.2, 0.6],
            ..evict::EvictBenchArgs::default()
        },
    }
}

fn moe_steps(size: SuiteSize) -> u64 {
    match size {
        SuiteSize::Full => SyntheticConfig::default().steps,
        SuiteSize::Quick => 100,
        SuiteSize::Tiny => 20,
    }
}

/// Writes `{ "benchmark": name, "args": args, "rows": rows }` to `DIR/<name>.json`.
fn write_json<T: Serialize>(dir: &Path, name: &str, args: Value, rows: &[T]) -> Result<PathBuf> {
    let path = dir.join(format!("{name}.json"));
    let doc = json!({
        "benchmark": name,
        "oogc_version": env!("CARGO_PKG_VERSION"),
        "machine": crate::machine::record(Some(dir)),
        "args": args,
        "rows": rows,
    });
    let text = serde_json::to_string_pretty(&doc)
        .map_err(|source| Error::Json { what: format!("serializing the {name} rows"), source })?;
    std::fs::write(&path, text).map_err(Error::io("writing", &path, Some("is --out writable?")))?;
    Ok(path)
}

fn trace_json(trace: &RoutingTrace) -> Value {
    let h = &trace.header;
    json!({
        "steps": trace.steps.len(), "blocks": h.blocks, "experts": h.experts, "top_k": h.top_k,
        "tokens_per_step": h.tokens_per_step, "expert_bytes": h.expert_bytes,
    })
}

/// Runs the suite and writes its files to `args.out`.
///
/// # Errors
/// `args.out` cannot be created or written, or a benchmark failed (its error names it and the
/// cause: a bad `--nvme-dir`, no space, an unreadable `--moe-trace`). io_uring refused by the
/// kernel is not an error: the NVMe benchmark then measures the psync engine only.
pub fn run(args: &AllBenchArgs) -> Result<(SuiteReport, SuiteRows)> {
    let start = Instant::now();
    std::fs::create_dir_all(&args.out).map_err(Error::io(
        "creating the output directory",
        &args.out,
        Some("check --out"),
    ))?;
    let step_config = match &args.step_config {
        Some(path) => Some((path, step::load_config(path, args.link_gbps)?)),
        None => None,
    };
    let names: Vec<&str> = ["nvme", "swap", "adam", "evict", "moe"]
        .into_iter()
        .chain(args.moe_trace.as_ref().map(|_| "moe-trace"))
        .chain(step_config.iter().flat_map(|_| ["step", "timeline"]))
        .chain((step_config.is_some() || !args.plan_configs.is_empty()).then_some("plan"))
        .chain(["plots"])
        .collect();
    let bar = if args.progress {
        let bar = ProgressBar::new(names.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} bench {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut rows = SuiteRows::default();
    let mut entries = Vec::new();
    let mut plots_written = Vec::new();
    for name in names {
        bar.set_message(name);
        let t = Instant::now();
        let (file, n) = match name {
            "nvme" => {
                let mut a = nvme_args(args);
                let r = match nvme::run(&a) {
                    Err(e) if e.is_uring_unavailable() => {
                        tracing::warn!("{}; measuring psync only", e.report());
                        a.engines = vec![EngineChoice::Psync];
                        nvme::run(&a)
                    }
                    r => r,
                }
                .context("bench all: nvme (check --nvme-dir)")?;
                let engines: Vec<String> = a.engines.iter().map(|e| format!("{e:?}").to_lowercase()).collect();
                let j = json!({
                    "dirs": a.dirs, "size_gib": a.size_gib, "engines": engines, "block_bytes": a.block_bytes,
                    "queue_depth": a.queue_depth, "tensor_bytes": a.tensor_bytes, "fio": a.fio,
                });
                if args.tables {
                    bar.suspend(|| nvme::print_table(&r));
                }
                rows.nvme = r;
                (write_json(&args.out, name, j, &rows.nvme)?, rows.nvme.len())
            }
            "swap" => {
                let a = swap_args(args);
                let r = swap::run(&a).context("bench all: swap")?;
                let j = json!({
                    "size_bytes": a.size_bytes, "link_gbps": a.link_gbps, "repeats": a.repeats,
                    "tensors": a.tensors, "lock": a.lock,
                });
                if args.tables {
                    bar.suspend(|| swap::print_table(&r));
                }
                rows.swap = r;
                (write_json(&args.out, name, j, &rows.swap)?, rows.swap.len())
            }
            "adam" => {
                let a = adam_args(args);
                let r = adam::run(&a).context("bench all: adam")?;
                let j = json!({
                    "params": a.params, "threads": a.threads, "grad_dtype": a.grad_dtype.to_string(),
                    "param_out": a.param_out.map(|d| d.to_string()), "steps": a.steps,
                });
                if args.tables {
                    bar.suspend(|| adam::print_table(&r));
                }
                rows.adam = r;
                (write_json(&args.out, name, j, &rows.adam)?, rows.adam.len())
            }
            "evict" => {
                let a = evict_args(args);
                let r = evict::run(&a).context("bench all: evict")?;
                let j = json!({
                    "shape": a.shape, "fractions": a.fractions, "workloads": a.workloads,
                    "max_depth": a.max_depth, "no_extra_bytes": a.no_extra_bytes,
                });
                if args.tables {
                    bar.suspend(|| evict::print_table(&r));
                }
                rows.evict = r;
                (write_json(&args.out, name, j, &rows.evict)?, rows.evict.len())
            }
            "moe" | "moe-trace" => {
                let trace = match (name, &args.moe_trace) {
                    ("moe-trace", Some(path)) => {
                        read_trace_file(path).with_context(|| format!("bench all: --moe-trace {}", path.display()))?
                    }
                    _ => {
                        synthetic_trace(&SyntheticConfig { steps: moe_steps(args.size), ..SyntheticConfig::default() })
                            .context("bench all: the synthetic MoE trace")?
                    }
                };
                let a = moe::MoeBenchArgs::default();
                let r = moe::run(&trace, &a).with_context(|| format!("bench all: {name}"))?;
                let j = json!({
                    "trace": args.moe_trace.as_ref().filter(|_| name == "moe-trace"),
                    "synthetic": name == "moe", "header": trace_json(&trace),
                    "budget_fraction": a.budget_fraction, "decay": a.decay, "margin": a.margin,
                });
                if args.tables {
                    bar.suspend(|| moe::print_table(&trace, &r));
                }
                let file = write_json(&args.out, name, j, &r)?;
                let n = r.len();
                if name == "moe" {
                    rows.moe = r;
                } else {
                    rows.moe_trace = r;
                }
                (file, n)
            }
            "step" => {
                let (path, cfg) = step_config.as_ref().expect("step runs with a config");
                let mut a = step::StepBenchArgs::new(cfg.clone());
                if args.size != SuiteSize::Full {
                    (a.steps, a.warmup) = (3, 1);
                }
                let r = step::run(&a).context("bench all: step")?;
                if args.tables {
                    bar.suspend(|| step::print_table(&r));
                }
                let j = json!({
                    "config": path, "link_gbps": cfg.device.link_gbps, "steps": a.steps, "warmup": a.warmup,
                    "skipped": r.skipped,
                });
                (write_json(&args.out, name, j, &r.rows)?, r.rows.len())
            }
            "timeline" => {
                let (path, cfg) = step_config.as_ref().expect("the timeline runs with a config");
                let trace = timeline::record(cfg, timeline::DEFAULT_RECORD_STEPS, &args.out)
                    .context("bench all: recording the step timeline")?;
                let mut tl = timeline::parse(&trace, timeline::DEFAULT_KEEP_STEPS)
                    .with_context(|| format!("bench all: reading the trace {}", trace.display()))?;
                tl.title = timeline::run_title(path, cfg);
                let r = tl.rows();
                if args.tables {
                    bar.suspend(|| timeline::print_table(&tl));
                }
                plots_written.extend(plots::write_timeline(&args.out, &tl).context("bench all: the timeline plot")?);
                let j = json!({ "config": path, "link_gbps": cfg.device.link_gbps, "trace": trace });
                (write_json(&args.out, name, j, &r)?, r.len())
            }
            "plan" => {
                let mut a = plan_check::PlanCheckArgs::new(args.plan_configs.clone());
                if args.size != SuiteSize::Full {
                    (a.steps, a.warmup) = (3, 2);
                }
                let r = if args.plan_configs.is_empty() {
                    let (path, cfg) = step_config.as_ref().expect("a config to plan");
                    vec![plan_check::check(cfg, &path.display().to_string(), &a)
                        .with_context(|| format!("bench all: checking the plan of {}", path.display()))?]
                } else {
                    plan_check::run_with(&a).context("bench all: plan")?
                };
                if args.tables {
                    bar.suspend(|| plan_check::print_table(&r));
                }
                let configs: Vec<PathBuf> = r.iter().map(|row| PathBuf::from(&row.config)).collect();
                let j = json!({ "configs": configs, "steps": a.steps, "warmup": a.warmup });
                (write_json(&args.out, name, j, &r)?, r.len())
            }
            _ => {
                plots_written.extend(plots::write_all(&args.out, &rows).context("bench all: plots")?);
                bar.inc(1);
                continue;
            }
        };
        entries.push(SuiteEntry { benchmark: name.into(), file, rows: n, seconds: t.elapsed().as_secs_f64() });
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((SuiteReport { entries, plots: plots_written, seconds: start.elapsed().as_secs_f64() }, rows))
}

/// Prints what the suite wrote: one line per benchmark, then the plots.
pub fn print_summary(report: &SuiteReport) {
    println!("{:<10} {:>6} {:>9}  file", "benchmark", "rows", "seconds");
    for e in &report.entries {
        println!("{:<10} {:>6} {:>9.2}  {}", e.benchmark, e.rows, e.seconds, e.file.display());
    }
    for p in &report.plots {
        println!("plot       {}", p.display());
    }
    println!("suite: {:.1} s", report.seconds);
}
