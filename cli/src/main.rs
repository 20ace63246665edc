//! The `oogc` command line: `oogc train`, `oogc inspect`, `oogc plan`, `oogc bench nvme`,
//! `oogc bench swap`, `oogc bench evict`, `oogc bench adam`, `oogc bench moe`, `oogc bench step`,
//! `oogc bench all`.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default `warn`); results go to stdout, as a table
//! or, with `--json`, as JSON Lines (one object per row per line). Errors print the whole cause
//! chain on stderr and exit with status 1; bad arguments exit with status 2 (clap).
#![deny(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use oogc::config::TrainConfig;
use oogc::optimizer::{FloatType, Isa};
use oogc::plan as planner;
use oogc::prefetch::plan::StatePlacement;
use oogc::prefetch::HardwareProfile;
use oogc::swapper::{EngineChoice, Error as SwapError};
use oogc_bench::probe;
use oogc_bench::{adam, all, evict, moe, nvme, plan_check, step, swap};
use serde::Serialize;
use tracing_subscriber::EnvFilter;

/// oogc: an out-of-GPU-core training runtime (tiered GPU / pinned host / NVMe memory).
///
/// Logs go to stderr; set RUST_LOG (e.g. `RUST_LOG=oogc_swapper=debug`) to see more than warnings.
#[derive(Debug, Parser)]
#[command(name = "oogc", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train the byte-level GPT of a TOML config out of GPU core (sim device unless the config
    /// says `device.kind = "cuda:N"`): progress bar, validation, metrics, checkpoints, summary.
    Train(TrainCmd),
    /// Summarize a checkpoint (a ckpt-*.safetensors file, or a checkpoint directory: its newest).
    Inspect(InspectCmd),
    /// Offload benchmarks: a table on stdout, or JSON Lines with --json.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Plan a GPT under budgets: memory per tier, the minimum GPU budget, and the predicted step
    /// time (compute, exposed transfer, exposed optimizer) from the step simulator; or, with
    /// --hardware-probe, measure this machine into a hardware profile (TOML).
    Plan(PlanCmd),
}

#[derive(Debug, Args)]
struct TrainCmd {
    /// The run's TOML config (see configs/ and the README's config reference).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Continue from the newest checkpoint in DIR (or from a checkpoint file).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Stop after this step (default: train.steps of the config).
    #[arg(long, value_name = "N")]
    steps: Option<u64>,
    /// Override [data] path (relative to the working directory).
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct InspectCmd {
    /// A checkpoint file or directory.
    path: PathBuf,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Write then read N GiB through the NVMe store per engine, beside fio (io_uring, O_DIRECT)
    /// in the same run. GB/s are 10^9 bytes per second.
    Nvme(NvmeCmd),
    /// Host<->device copies on the sim device (raw and through the residency manager), each row
    /// beside a limit measured or set in the same run. GB/s are 10^9 bytes per second.
    Swap(SwapCmd),
    /// Bytes moved and stall of the eviction policies (next-use, LRU, FIFO, offline MIN) over a
    /// sweep of device budgets, in the step simulator, for a GPT's training and forward-only steps.
    Evict(EvictCmd),
    /// The CPU AdamW step (fused: gradients in, compute copy out) on one flat tensor, per thread
    /// count, beside a STREAM triad of the same run. GB/s are 10^9 bytes per second.
    Adam(AdamCmd),
    /// Replay an MoE routing trace (or a synthetic one) under expert placement policies with the
    /// same GPU expert budget: fetch-on-demand, an LRU cache, a static hot set, and ours (EMA hot
    /// set with hysteresis plus CPU compute of cold experts). Reports expert bytes moved H2D, hit
    /// rate, CPU-computed tokens and the predicted expert time per step (cost model).
    Moe(MoeCmd),
    /// Real training steps of a config under ours, the on-demand baseline (no lookahead, no
    /// pipelined optimizer) and all-resident (when it fits): median step time beside its lower
    /// bound max(compute, transfer, optimizer), the schedule's bound (forward and backward
    /// phases each bounded by their busiest resource), the speedup over on-demand, and the
    /// planner's prediction. With --json: one JSON object per variant (each with a `machine`
    /// record and the variant's config), then `{"variant":..,"skipped":reason}` for a variant
    /// not run.
    Step(StepCmd),
    /// `oogc plan` checked against reality: per config, the plan (with this CPU's compute rate
    /// probed around the steps) beside the median of real training steps, and whether it is
    /// within 15%.
    Plan(PlanBenchCmd),
    /// The whole suite (nvme, swap, adam, evict, moe; with --config also step, the step timeline
    /// and the plan check) with --quick or full sizes: one JSON file per benchmark
    /// (`{ "benchmark", "args", "rows" }`) and PNG + SVG plots in --out DIR.
    All(AllCmd),
}

#[derive(Debug, Args)]
struct PlanBenchCmd {
    /// `oogc train` configs to check (repeat the flag; the configs run as they are, without
    /// checkpoints or metrics; NVMe scratch goes to a subdirectory of their nvme_dirs).
    #[arg(long = "config", value_name = "FILE", required = true)]
    configs: Vec<PathBuf>,
    /// Steps measured per config, after the warmup.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Steps run first per config and not measured.
    #[arg(long, value_name = "N", default_value_t = 2)]
    warmup: u64,
    /// Hardware profile the plan starts from (TOML; its compute figures are replaced by the probe's).
    #[arg(long, value_name = "FILE")]
    hardware: Option<PathBuf>,
    /// JSON Lines on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct StepCmd {
    /// The `oogc train` config (no checkpoints or metrics are written; NVMe scratch goes to a
    /// subdirectory of its nvme_dirs, removed after).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Steps measured per variant, after the warmup.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Steps run first per variant and not measured (the first one records the schedule).
    #[arg(long, value_name = "N", default_value_t = 3)]
    warmup: u64,
    /// Run the all-resident variant only when parameters + optimizer state (16 B/param) fit in
    /// this many bytes; suffixes KiB, MiB, GiB.
    #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    resident_cap: usize,
    /// Hardware profile for the plan's prediction (TOML; see `oogc plan --hardware-probe`).
    #[arg(long, value_name = "FILE")]
    hardware: Option<PathBuf>,
    /// Throttle the sim device's link to this many GB/s (10⁹ B/s) each way instead of the config's
    /// `[device] link_gbps` (sim device only).
    #[arg(long, value_name = "GBPS")]
    link_gbps: Option<f64>,
    /// JSON Lines on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct AllCmd {
    /// Directory for the JSON files and plots (created when missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Small sizes: the whole suite in under 3 minutes on 2 cores (nvme 0.25 GiB, swap 64 MiB,
    /// adam 16 Mi parameters, moe 100 synthetic steps).
    #[arg(long)]
    quick: bool,
    /// Test sizes (seconds in a debug build; the figures mean little).
    #[arg(long, hide = true, conflicts_with = "quick")]
    tiny: bool,
    /// Directory of the NVMe store and fio's file (repeat for several; default: the temp dir).
    #[arg(long = "nvme-dir", value_name = "DIR")]
    nvme_dirs: Vec<PathBuf>,
    /// Do not run fio beside the store even when it is installed.
    #[arg(long)]
    no_fio: bool,
    /// A recorded MoE routing trace (JSON Lines, from a training run) replayed after the
    /// synthetic one into moe-trace.json.
    #[arg(long, value_name = "FILE")]
    moe_trace: Option<PathBuf>,
    /// A training config: also run `oogc bench step` on it (3 steps after 1 warmup with --quick;
    /// step.json) and record a step timeline from a real run of it (timeline.json, timeline.png).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Throttle the --config run's sim link to this many GB/s (10⁹ B/s) each way.
    #[arg(long, value_name = "GBPS", requires = "config")]
    link_gbps: Option<f64>,
    /// Check `oogc plan` against real steps of these configs (repeat the flag; plan.json);
    /// default: the --config run, if any.
    #[arg(long = "plan-config", value_name = "FILE")]
    plan_configs: Vec<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// Print only the summary, not each benchmark's table.
    #[arg(long)]
    summary_only: bool,
}

/// Element types for `bench adam`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// No compute copy (only for --param-out).
    None,
}

impl DTypeArg {
    fn float(self) -> Option<FloatType> {
        match self {
            DTypeArg::F32 => Some(FloatType::F32),
            DTypeArg::Bf16 => Some(FloatType::BF16),
            DTypeArg::F16 => Some(FloatType::F16),
            DTypeArg::None => None,
        }
    }
}

/// Dispatch paths for `bench adam`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum IsaArg {
    /// AVX-512F.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Plain Rust.
    Scalar,
}

#[derive(Debug, Args)]
struct AdamCmd {
    /// Parameters of the flat tensor; suffixes K, M, G are 2^10, 2^20, 2^30 (256M = 268435456).
    #[arg(long, value_name = "N", default_value = "256M", value_parser = parse_count)]
    params: usize,
    /// Thread counts, comma-separated; one row each.
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_value = "1,2", value_parser = clap::value_parser!(u16).range(1..))]
    threads: Vec<u16>,
    /// Element type of the gradients.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    grad_dtype: DTypeArg,
    /// Element type of the compute copy written in the same pass, or none.
    #[arg(long, value_enum, default_value_t = DTypeArg::None)]
    param_out: DTypeArg,
    /// Timed steps per row (the median is reported).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Force a dispatch path (default: the widest this CPU has).
    #[arg(long, value_enum)]
    isa: Option<IsaArg>,
    /// Print JSON Lines on stdout: one object per row per line, with fields variant, isa,
    /// threads, params, seconds_per_step, params_per_s, bytes_per_param, gbps, triad_gbps,
    /// ratio_to_triad, torch_params_per_s, ratio_to_torch.
    #[arg(long)]
    json: bool,
}

/// The GPT whose units are planned or swept (byte vocabulary of 256).
#[derive(Debug, Args)]
struct ModelArgs {
    /// Transformer blocks.
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    layers: u64,
    /// Model width.
    #[arg(long, value_name = "D", default_value_t = 768, value_parser = clap::value_parser!(u64).range(1..))]
    d_model: u64,
    /// Tokens per sequence.
    #[arg(long, value_name = "T", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    seq_len: u64,
    /// Sequences per step.
    #[arg(long, value_name = "B", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Bytes per element of the compute copy (2: bf16, 4: f32).
    #[arg(long, value_name = "BYTES", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=4))]
    dtype_bytes: u64,
}

impl ModelArgs {
    fn shape(&self) -> planner::GptShape {
        planner::GptShape {
            layers: self.layers,
            d_model: self.d_model,
            seq_len: self.seq_len,
            batch: self.batch,
            dtype_bytes: self.dtype_bytes,
        }
    }
}

/// Where the optimizer state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StateArg {
    /// Host memory.
    Host,
    /// NVMe.
    Nvme,
    /// Host when --host-budget holds it, else NVMe.
    Auto,
}

#[derive(Debug, Args)]
struct PlanCmd {
    /// Plan the run of an `oogc train` config: its model, batch, GPU and host budgets, optimizer
    /// state tier and prefetch depth replace --layers/--d-model/--seq-len/--batch/--gpu-budget/
    /// --host-budget/--optimizer-state/--max-depth (f32 compute copies, as on the sim device).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// GPU bytes for the units' compute copies; suffixes KiB, MiB, GiB (or K, M, G).
    #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    gpu_budget: usize,
    /// Host bytes, if limited (decides --optimizer-state auto and warns when exceeded).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    host_budget: Option<usize>,
    /// Where the optimizer state (12 B per parameter) lives.
    #[arg(long, value_enum, default_value_t = StateArg::Auto)]
    optimizer_state: StateArg,
    /// Prefetch window, units ahead.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    max_depth: u64,
    /// Hardware profile (TOML; see `--hardware-probe`); defaults: the sim device.
    #[arg(long, value_name = "FILE")]
    hardware: Option<PathBuf>,
    /// Write the simulated step's Chrome/Perfetto trace (JSON) here.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Measure this machine (memory triad, NVMe through the store, CPU Adam, and the sim
    /// device's compute: one block forward and backward, of --config's shape if given, else the
    /// main example's) and print or write (--out) a hardware profile instead of planning.
    #[arg(long)]
    hardware_probe: bool,
    /// With --config: before planning, time one block of the config's model forward and
    /// backward with candle on this CPU (the sim device, the config's compute threads; about
    /// 1 s) and plan with the measured GFLOP/s and backward/forward ratio instead of the
    /// profile's.
    #[arg(long, requires = "config", conflicts_with = "hardware_probe")]
    probe_compute: bool,
    /// With --hardware-probe: write the profile (TOML) to this file.
    #[arg(long, value_name = "FILE", requires = "hardware_probe")]
    out: Option<PathBuf>,
    /// With --hardware-probe: directory for the NVMe store's temporary file (default: the temp dir).
    #[arg(long, value_name = "DIR", requires = "hardware_probe")]
    probe_dir: Option<PathBuf>,
    /// With --hardware-probe: MiB written then read through the NVMe store.
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(8..))]
    probe_mib: u64,
    /// With --hardware-probe: f64 elements per triad array (tests use small sizes).
    #[arg(long, value_name = "N", hide = true, default_value_t = probe::ProbeArgs::default().triad_elems)]
    probe_triad_elems: usize,
    /// With --hardware-probe: parameters of the Adam loop (tests use small sizes).
    #[arg(long, value_name = "N", hide = true, default_value_t = probe::ProbeArgs::default().adam_params)]
    probe_adam_params: usize,
    /// Print the plan as one JSON object (fields: units, params, model_bytes, min_gpu_budget_bytes,
    /// memory, step_s, compute_s, exposed_transfer_s, exposed_optimizer_s, lower_bound_s, sim, warnings).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct EvictCmd {
    #[command(flatten)]
    model: ModelArgs,
    /// Device budgets as fractions of the model's compute copies, comma-separated (each in (0, 1]).
    #[arg(long, value_name = "F,F,..", value_delimiter = ',', default_value = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", value_parser = parse_fraction)]
    fractions: Vec<f64>,
    /// Prefetch window, units ahead.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    max_depth: u64,
    /// Hardware profile (TOML); defaults: the sim device.
    #[arg(long, value_name = "FILE")]
    hardware: Option<PathBuf>,
    /// Override the profile's device GFLOP/s (compute time per unit), e.g. 100000 for a GPU.
    #[arg(long, value_name = "GFLOPS", value_parser = parse_positive_f64)]
    device_gflops: Option<f64>,
    /// The window never moves more bytes than offline MIN's demand fetching would (it then
    /// defers prefetches that need cache MIN keeps: more stall on forward-only scans).
    #[arg(long)]
    no_extra_bytes: bool,
    /// Print JSON Lines on stdout: one object per row per line, with fields workload, policy,
    /// budget_fraction, budget_bytes, bytes_moved, min_bytes, ratio_to_min, stall_s, step_s,
    /// stall_fraction, prefetches.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct MoeCmd {
    /// A routing trace (oogc-routing-1 JSON Lines, as `oogc train` records it).
    #[arg(long, value_name = "FILE", required_unless_present = "synthetic", conflicts_with = "synthetic")]
    trace: Option<PathBuf>,
    /// Replay a synthetic trace instead: Zipf-skewed popularity that drifts slowly (4 blocks of
    /// 16 experts, top-2, 256 tokens per step, 2 MiB f32 experts).
    #[arg(long)]
    synthetic: bool,
    /// Steps of the synthetic trace.
    #[arg(long, value_name = "N", default_value_t = 200, requires = "synthetic", value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Seed of the synthetic trace.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "synthetic")]
    seed: u64,
    /// Zipf exponent of the synthetic trace's popularity (0: uniform).
    #[arg(long, value_name = "S", default_value_t = 1.0, requires = "synthetic", value_parser = parse_nonnegative_f64)]
    zipf: f64,
    /// Also write the synthetic trace (oogc-routing-1) to this file.
    #[arg(long, value_name = "FILE", requires = "synthetic")]
    write_trace: Option<PathBuf>,
    /// GPU bytes for resident experts, as a fraction of all experts' bytes, in (0, 1].
    #[arg(long, value_name = "F", default_value_t = 0.25, value_parser = parse_fraction)]
    budget_fraction: f64,
    /// Host-to-device bandwidth, GB/s (10^9 B/s).
    #[arg(long, value_name = "GBPS", default_value_t = 16.0, value_parser = parse_positive_f64)]
    h2d_gbps: f64,
    /// Device-to-host bandwidth (gradients), GB/s; default: --h2d-gbps.
    #[arg(long, value_name = "GBPS", value_parser = parse_positive_f64)]
    d2h_gbps: Option<f64>,
    /// Achieved CPU rate on expert GEMMs, GFLOP/s (10^9 FLOP/s).
    #[arg(long, value_name = "G", default_value_t = 100.0, value_parser = parse_positive_f64)]
    cpu_gflops: f64,
    /// Achieved GPU rate on expert GEMMs, GFLOP/s.
    #[arg(long, value_name = "G", default_value_t = 50000.0, value_parser = parse_positive_f64)]
    gpu_gflops: f64,
    /// EMA decay of expert popularity, in [0, 1).
    #[arg(long, value_name = "D", default_value_t = 0.9, value_parser = parse_decay)]
    decay: f64,
    /// Hysteresis margin: the hot set changes when the gain exceeds the cost of moving by this fraction.
    #[arg(long, value_name = "M", default_value_t = 0.5, value_parser = parse_nonnegative_f64)]
    margin: f64,
    /// Print JSON Lines on stdout: one object per policy per line, with fields policy,
    /// budget_bytes, expert_h2d_bytes, refresh_h2d_bytes, bytes_vs_fetch, hit_rate,
    /// resident_rate, cpu_tokens, fetches, uses, step_s, speedup_vs_fetch.
    #[arg(long)]
    json: bool,
}

fn parse_nonnegative_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("`{s}` must be a finite number ≥ 0"))
    }
}

fn parse_decay(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("`{s}` must be in [0, 1)"))
    }
}

/// Which store engines `bench nvme` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum EngineArg {
    /// io_uring (fails where the kernel refuses it).
    Uring,
    /// The pread/pwrite thread pool.
    Psync,
    /// io_uring when available, else psync.
    Auto,
    /// uring, then psync (psync only, with a warning, where io_uring is unavailable).
    All,
}

#[derive(Debug, Args)]
struct NvmeCmd {
    /// Directory of the store (repeat for several disks; the first also holds fio's file).
    /// It must exist and have room for --size-gib plus 4 MiB.
    #[arg(long = "dir", value_name = "DIR", required = true)]
    dirs: Vec<PathBuf>,
    /// GiB (2^30 bytes) written and read back per engine; rounded down to whole tensors, at
    /// least one. Fractions allowed (0.0625 = 64 MiB).
    #[arg(long, value_name = "GIB", value_parser = parse_positive_f64)]
    size_gib: f64,
    /// Store engines to measure.
    #[arg(long, value_enum, default_value_t = EngineArg::All)]
    engine: EngineArg,
    /// Bytes per I/O request (store and fio): a multiple of 4096 up to 64 MiB; suffixes KiB,
    /// MiB, GiB (or K, M, G) accepted.
    #[arg(long, value_name = "BYTES", default_value = "1MiB", value_parser = parse_bytes)]
    block_bytes: usize,
    /// Requests in flight (store and fio), 1 to 4096.
    #[arg(long, value_name = "N", default_value_t = 32)]
    queue_depth: u32,
    /// MiB (2^20 bytes) per tensor written by the store.
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    tensor_mib: u64,
    /// Do not run fio (otherwise run when it is on the PATH).
    #[arg(long)]
    no_fio: bool,
    /// Print JSON Lines on stdout: one object per row per line, with fields engine, write_gbps,
    /// read_gbps (GB/s, null when not measured), block_bytes, queue_depth, bytes, note.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct SwapCmd {
    /// MiB (2^20 bytes) per raw copy, and the total MiB of the residency manager's tensors.
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    size_mib: u64,
    /// Also measure with the sim link throttled to this many GB/s (10^9 B/s) per direction
    /// (PCIe 4.0 x16 is about 25, PCIe 5.0 x16 about 50).
    #[arg(long, value_name = "GBPS", value_parser = parse_positive_f64)]
    link_gbps: Option<f64>,
    /// Timed copies per raw row, and timed passes over the tensors for the residency rows.
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    repeats: u64,
    /// Tensors registered with the residency manager (each size-mib/tensors); the device
    /// budget holds half of them.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(2..))]
    tensors: u64,
    /// Print JSON Lines on stdout: one object per row per line, with fields name, bytes, gbps,
    /// ops, limit_gbps, limit, evictions, stall_s (null for raw rows), note.
    #[arg(long)]
    json: bool,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("`{s}` must be a fraction in (0, 1]"))
    }
}

fn parse_positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("`{s}` must be a number greater than 0"))
    }
}

/// Parses `1048576`, `1MiB`, `1M`, `4KiB`, `4k`, `1GiB` into bytes.
fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a byte count (e.g. 1048576, 1MiB, 4KiB)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        other => return Err(format!("unknown unit `{other}` in `{s}`: use B, KiB, MiB or GiB")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("`{s}` is too large"))
}

/// Parses `1000`, `4K`, `256M`, `1G` (binary multiples) into a count.
fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a count (e.g. 1000, 4K, 256M)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        other => return Err(format!("unknown suffix `{other}` in `{s}`: use K, M or G")),
    };
    match n.checked_mul(mult) {
        Some(0) => Err(format!("`{s}` must be at least 1")),
        Some(v) => Ok(v),
        None => Err(format!("`{s}` is too large")),
    }
}

/// Prints `rows` as JSON Lines: one compact object per line.
fn print_json_lines<T: Serialize>(rows: &[T]) -> anyhow::Result<()> {
    for r in rows {
        println!("{}", serde_json::to_string(r).context("serializing a result row")?);
    }
    Ok(())
}

/// JSON Lines of a benchmark's rows, each with the `machine` it ran on (CPU, cores, memory,
/// kernel, file system of `dir`, git revision) and the `command` line that produced it, so two
/// runs can be compared row by row.
fn print_bench_json<T: Serialize>(rows: &[T], dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    let machine = serde_json::to_value(oogc_bench::machine::record(dir)).context("serializing the machine")?;
    let command: Vec<String> = std::env::args().collect();
    for r in rows {
        let mut v = serde_json::to_value(r).context("serializing a result row")?;
        if let serde_json::Value::Object(m) = &mut v {
            m.insert("machine".into(), machine.clone());
            m.insert("command".into(), command.join(" ").into());
        }
        println!("{v}");
    }
    Ok(())
}

fn is_uring_unavailable(e: &anyhow::Error) -> bool {
    e.chain().any(|c| matches!(c.downcast_ref::<SwapError>(), Some(SwapError::UringUnavailable { .. })))
}

fn bench_nvme(cmd: NvmeCmd) -> anyhow::Result<()> {
    let engines = match cmd.engine {
        EngineArg::Uring => vec![EngineChoice::Uring],
        EngineArg::Psync => vec![EngineChoice::Psync],
        EngineArg::Auto => vec![EngineChoice::Auto],
        EngineArg::All => vec![EngineChoice::Uring, EngineChoice::Psync],
    };
    let tensor_bytes = usize::try_from(cmd.tensor_mib << 20).context("--tensor-mib is too large")?;
    let mut args = nvme::NvmeBenchArgs {
        dirs: cmd.dirs.clone(),
        size_gib: cmd.size_gib,
        engines,
        block_bytes: cmd.block_bytes,
        queue_depth: cmd.queue_depth,
        tensor_bytes,
        fio: !cmd.no_fio,
    };
    let rows = match nvme::run(&args) {
        Err(e) if cmd.engine == EngineArg::All && is_uring_unavailable(&e) => {
            tracing::warn!("{e:#}; measuring psync only");
            args.engines = vec![EngineChoice::Psync];
            nvme::run(&args)
        }
        r => r,
    }
    .context("oogc bench nvme")?;
    if cmd.json {
        print_bench_json(&rows, cmd.dirs.first().map(PathBuf::as_path))
    } else {
        nvme::print_table(&rows);
        Ok(())
    }
}

fn bench_swap(cmd: SwapCmd) -> anyhow::Result<()> {
    let size_bytes = cmd.size_mib.checked_mul(1 << 20).and_then(|b| usize::try_from(b).ok());
    let args = swap::SwapBenchArgs {
        size_bytes: size_bytes.context("--size-mib is too large")?,
        link_gbps: cmd.link_gbps,
        repeats: cmd.repeats as usize,
        tensors: cmd.tensors as usize,
        ..swap::SwapBenchArgs::default()
    };
    let rows = swap::run(&args).context("oogc bench swap")?;
    if cmd.json {
        print_bench_json(&rows, None)
    } else {
        swap::print_table(&rows);
        Ok(())
    }
}

fn load_hardware(path: Option<&PathBuf>) -> anyhow::Result<HardwareProfile> {
    match path {
        Some(p) => HardwareProfile::load(p).context("--hardware"),
        None => Ok(HardwareProfile::default()),
    }
}

fn plan(cmd: PlanCmd) -> anyhow::Result<()> {
    if cmd.hardware_probe {
        let args = probe::ProbeArgs {
            dir: cmd.probe_dir.unwrap_or_else(std::env::temp_dir),
            nvme_bytes: cmd.probe_mib << 20,
            triad_elems: cmd.probe_triad_elems.max(1),
            adam_params: cmd.probe_adam_params.max(1),
            compute: Some(match &cmd.config {
                Some(path) => probe::ComputeShape::for_config(&TrainConfig::load(path)?),
                None => probe::ComputeShape::representative(),
            }),
        };
        let profile = probe::probe(&args).context("oogc plan --hardware-probe")?;
        let toml = profile.to_toml_string();
        match &cmd.out {
            Some(path) => {
                std::fs::write(path, &toml).with_context(|| format!("writing the profile to {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            None => print!("{toml}"),
        }
        return Ok(());
    }
    if let Some(path) = &cmd.config {
        let cfg = TrainConfig::load(path)?;
        let mut hardware = load_hardware(cmd.hardware.as_ref())?;
        if cmd.probe_compute {
            let probe = probe::probe_compute(&probe::ComputeShape::for_config(&cfg)).context("--probe-compute")?;
            probe.apply(&mut hardware);
        }
        let args = planner::plan_args_for_config(&cfg, &hardware, cmd.trace.is_some());
        return finish_plan(&cmd, args);
    }
    let args = planner::PlanArgs {
        shape: cmd.model.shape(),
        feed_forward: planner::FeedForward::default(),
        gpu_budget_bytes: cmd.gpu_budget as u64,
        host_budget_bytes: cmd.host_budget.map(|b| b as u64),
        optimizer_state: match cmd.optimizer_state {
            StateArg::Host => StatePlacement::Host,
            StateArg::Nvme => StatePlacement::Nvme,
            StateArg::Auto => StatePlacement::Auto,
        },
        max_depth: cmd.max_depth as usize,
        hardware: load_hardware(cmd.hardware.as_ref())?,
        trace: cmd.trace.is_some(),
    };
    finish_plan(&cmd, args)
}

fn finish_plan(cmd: &PlanCmd, args: planner::PlanArgs) -> anyhow::Result<()> {
    let mut report = planner::plan_gpt(&args).context("oogc plan")?;
    if let (Some(path), Some(trace)) = (&cmd.trace, report.sim.trace.take()) {
        let json = serde_json::to_string(&trace).context("serializing the trace")?;
        std::fs::write(path, json).with_context(|| format!("writing the trace to {}", path.display()))?;
        eprintln!("wrote {} (open in https://ui.perfetto.dev)", path.display());
    }
    if cmd.json {
        println!("{}", serde_json::to_string(&report).context("serializing the plan")?);
    } else {
        print!("{}", planner::render_plan(&args, &report));
    }
    Ok(())
}

fn bench_step(cmd: StepCmd) -> anyhow::Result<()> {
    let cfg = step::load_config(&cmd.config, cmd.link_gbps)?;
    oogc::run::size_compute_threads(&cfg)?;
    let args = step::StepBenchArgs {
        steps: cmd.steps as usize,
        warmup: cmd.warmup as usize,
        resident_cap_bytes: cmd.resident_cap as u64,
        hardware: load_hardware(cmd.hardware.as_ref())?,
        ..step::StepBenchArgs::new(cfg)
    };
    let report = step::run(&args).context("oogc bench step")?;
    if cmd.json {
        print_json_lines(&report.rows)?;
        print_json_lines(&report.skipped)?;
    } else {
        step::print_table(&report);
    }
    Ok(())
}

fn bench_plan(cmd: PlanBenchCmd) -> anyhow::Result<()> {
    // The probe times candle on the global pool: size it first, from the first config.
    oogc::run::size_compute_threads(&TrainConfig::load(&cmd.configs[0])?)?;
    let args = plan_check::PlanCheckArgs {
        steps: cmd.steps as usize,
        warmup: cmd.warmup as usize,
        hardware: load_hardware(cmd.hardware.as_ref())?,
        ..plan_check::PlanCheckArgs::new(cmd.configs)
    };
    let rows = plan_check::run_with(&args).context("oogc bench plan")?;
    if cmd.json {
        print_json_lines(&rows)
    } else {
        plan_check::print_table(&rows);
        Ok(())
    }
}

fn bench_evict(cmd: EvictCmd) -> anyhow::Result<()> {
    let mut hardware = load_hardware(cmd.hardware.as_ref())?;
    if let Some(g) = cmd.device_gflops {
        hardware.device_gflops = g;
    }
    let args = evict::EvictBenchArgs {
        shape: cmd.model.shape(),
        fractions: cmd.fractions,
        hardware,
        max_depth: cmd.max_depth as usize,
        no_extra_bytes: cmd.no_extra_bytes,
        ..evict::EvictBenchArgs::default()
    };
    let rows = evict::run(&args).context("oogc bench evict")?;
    if cmd.json {
        print_bench_json(&rows, None)
    } else {
        evict::print_table(&rows);
        Ok(())
    }
}

fn bench_moe(cmd: MoeCmd) -> anyhow::Result<()> {
    use oogc::moe_placement::{read_trace_file, synthetic_trace, CostModelConfig, SyntheticConfig};
    let trace = match &cmd.trace {
        Some(path) => read_trace_file(path).context("--trace")?,
        None => {
            let cfg =
                SyntheticConfig { steps: cmd.steps, seed: cmd.seed, zipf_s: cmd.zipf, ..SyntheticConfig::default() };
            let trace = synthetic_trace(&cfg).context("--synthetic")?;
            if let Some(path) = &cmd.write_trace {
                let file = std::fs::File::create(path).with_context(|| format!("--write-trace {}", path.display()))?;
                trace
                    .write_to(std::io::BufWriter::new(file))
                    .with_context(|| format!("--write-trace {}", path.display()))?;
            }
            trace
        }
    };
    let args = moe::MoeBenchArgs {
        budget_fraction: cmd.budget_fraction,
        cost: CostModelConfig {
            h2d_gbps: cmd.h2d_gbps,
            d2h_gbps: cmd.d2h_gbps.unwrap_or(cmd.h2d_gbps),
            gpu_gflops: cmd.gpu_gflops,
            cpu_gflops: cmd.cpu_gflops,
            ..CostModelConfig::default()
        },
        decay: cmd.decay,
        margin: cmd.margin,
    };
    let rows = moe::run(&trace, &args).context("oogc bench moe")?;
    if cmd.json {
        print_bench_json(&rows, None)
    } else {
        moe::print_table(&trace, &rows);
        Ok(())
    }
}

fn bench_adam(cmd: AdamCmd) -> anyhow::Result<()> {
    let grad_dtype =
        cmd.grad_dtype.float().context("--grad-dtype none is not a gradient type: use f32, bf16 or f16")?;
    let isa = cmd.isa.map(|i| match i {
        IsaArg::Avx512 => Isa::Avx512,
        IsaArg::Avx2 => Isa::Avx2,
        IsaArg::Scalar => Isa::Scalar,
    });
    let args = adam::AdamBenchArgs {
        params: cmd.params,
        threads: cmd.threads.iter().map(|&t| t as usize).collect(),
        grad_dtype,
        param_out: cmd.param_out.float(),
        steps: cmd.steps as usize,
        isa,
    };
    let rows = adam::run(&args).context("oogc bench adam")?;
    if cmd.json {
        print_bench_json(&rows, None)
    } else {
        adam::print_table(&rows);
        Ok(())
    }
}

fn bench_all(cmd: AllCmd) -> anyhow::Result<()> {
    let size = match (cmd.quick, cmd.tiny) {
        (_, true) => all::SuiteSize::Tiny,
        (true, _) => all::SuiteSize::Quick,
        _ => all::SuiteSize::Full,
    };
    let args = all::AllBenchArgs {
        out: cmd.out,
        size,
        nvme_dirs: cmd.nvme_dirs,
        fio: !cmd.no_fio,
        moe_trace: cmd.moe_trace,
        step_config: cmd.config,
        link_gbps: cmd.link_gbps,
        plan_configs: cmd.plan_configs,
        progress: !cmd.no_progress,
        tables: !cmd.summary_only,
    };
    let (report, _) = all::run(&args).context("oogc bench all")?;
    all::print_summary(&report);
    Ok(())
}

/// The error's cause chain as one line, leaving out a cause whose text the previous message
/// already contains (the swapper's `Io` error prints its source itself).
fn error_line(e: &anyhow::Error) -> String {
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

/// Logs to stderr by `RUST_LOG`; with `trace`, also a Chrome trace of the runtime's spans (one
/// track per thread: compute, copy engines, optimizer workers). The guard flushes the trace.
fn init_tracing(trace: Option<&std::path::Path>) -> Option<tracing_chrome::FlushGuard> {
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

fn train(cmd: TrainCmd, cfg: TrainConfig) -> anyhow::Result<()> {
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
struct ProgressObserver {
    bar: ProgressBar,
    show: bool,
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

fn inspect(cmd: InspectCmd) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let ckpt = oogc::checkpoint::load(&cmd.path).context("oogc inspect")?;
    let is_state = |name: &str| name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq");
    let mut out = String::new();
    writeln!(out, "step: {}", ckpt.step)?;
    for (k, v) in ckpt.metadata.iter().filter(|(k, _)| *k != "config") {
        writeln!(out, "{k}: {v}")?;
    }
    let params: usize = ckpt.tensors.iter().filter(|t| !is_state(&t.name)).map(|t| t.data.len()).sum();
    writeln!(out, "tensors: {} ({} parameters, {} bytes in all)", ckpt.tensors.len(), params, ckpt.num_bytes())?;
    for t in ckpt.tensors.iter().filter(|t| !is_state(&t.name)) {
        let n = t.data.len().max(1) as f64;
        let rms = (t.data.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>() / n).sqrt();
        let finite = t.data.iter().all(|x| x.is_finite());
        writeln!(out, "  {:<40} {:?} rms {rms:.4e}{}", t.name, t.shape, if finite { "" } else { "  NOT FINITE" })?;
    }
    // A closed pipe (`| head`) is not an error.
    match std::io::stdout().write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn main() -> ExitCode {
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
    } else {
        init_tracing(None);
    }
    let result = match cli.command {
        Command::Train(cmd) => train(cmd, train_cfg.expect("loaded above")),
        Command::Inspect(cmd) => inspect(cmd),
        Command::Bench(BenchCommand::Nvme(cmd)) => bench_nvme(cmd),
        Command::Bench(BenchCommand::Swap(cmd)) => bench_swap(cmd),
        Command::Bench(BenchCommand::Evict(cmd)) => bench_evict(cmd),
        Command::Bench(BenchCommand::Adam(cmd)) => bench_adam(cmd),
        Command::Bench(BenchCommand::Moe(cmd)) => bench_moe(cmd),
        Command::Bench(BenchCommand::Step(cmd)) => bench_step(cmd),
        Command::Bench(BenchCommand::Plan(cmd)) => bench_plan(cmd),
        Command::Bench(BenchCommand::All(cmd)) => bench_all(cmd),
        Command::Plan(cmd) => plan(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            if e.chain().any(|c| matches!(c.downcast_ref::<SwapError>(), Some(SwapError::NvmeDir { .. }))) {
                eprintln!("hint: store directories are given with --dir (nvme.dirs in a config file)");
            }
            if e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<oogc::prefetch::Error>(),
                    Some(oogc::prefetch::Error::BudgetBelowWorkingSet { .. })
                )
            }) {
                eprintln!("hint: the GPU budget is given with --gpu-budget (e.g. --gpu-budget 2GiB)");
            }
            ExitCode::FAILURE
        }
    }
}
