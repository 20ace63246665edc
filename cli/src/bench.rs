//! `oogc bench`: the offload benchmarks (nvme, swap, evict, adam, moe, step, checkpoint, plan, all) of `oogc-bench`, as tables or JSON Lines, and `probe`, the machine's figures for `oogc plan --profile`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use oogc::config::TrainConfig;
use oogc::optimizer::{DType, Isa, StateDType};
use oogc::swapper::EngineChoice;
use oogc_bench::{adam, all, checkpoint, evict, moe, nvme, plan_check, probe, step, swap};
use serde::Serialize;

use crate::args::{
    parse_bytes, parse_count, parse_decay, parse_fraction, parse_nonnegative_f64, parse_positive_f64, print_json_lines,
};
use crate::plan::{load_hardware, ModelArgs};

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Write then read N GiB through the NVMe store per engine, beside fio (io_uring, O_DIRECT)
    /// in the same run. GB/s are 10^9 bytes per second.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"NVMe tier (`oogc bench nvme`)\"")]
    Nvme(NvmeCmd),
    /// Host<->device copies on the sim device (raw and through the residency manager), or with
    /// --device cuda:N the swapper's CUDA copies beside a plain pinned cudaMemcpyAsync, each row
    /// beside a limit measured or set in the same run. GB/s are 10^9 bytes per second.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"Host ↔ device copies (`oogc bench swap`)\"")]
    Swap(SwapCmd),
    /// Bytes moved and stall of the eviction policies (next-use, LRU, FIFO, offline MIN) over a
    /// sweep of device budgets, in the step simulator, for a GPT's training and forward-only steps.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"Eviction and prefetch (`oogc bench evict`)\"")]
    Evict(EvictCmd),
    /// The CPU AdamW step (fused: gradients in, compute copy out) on one flat tensor, per thread
    /// count, beside a STREAM triad of the same run. GB/s are 10^9 bytes per second.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"CPU optimizer (`oogc bench adam`)\"")]
    Adam(AdamCmd),
    /// Replay an MoE routing trace (or a synthetic one) under expert placement policies with the
    /// same GPU expert budget: fetch-on-demand, an LRU cache, a static hot set, and ours (EMA hot
    /// set with hysteresis plus CPU compute of cold experts). Reports expert bytes moved H2D, hit
    /// rate, CPU-computed tokens and the predicted expert time per step (cost model).
    #[command(after_help = "Book: docs/src/guide/moe.md")]
    Moe(MoeCmd),
    /// Real training steps of a config under ours, the on-demand baseline (no lookahead, no
    /// pipelined optimizer) and all-resident (when it fits): median step time beside its lower
    /// bound max(compute, transfer, optimizer), the schedule's bound (forward and backward
    /// phases each bounded by their busiest resource), the speedup over on-demand, and the
    /// planner's prediction. With --json: one JSON object per variant (each with a `machine`
    /// record and the variant's config), then `{"variant":..,"skipped":reason}` for a variant
    /// not run.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"End-to-end step (`oogc bench step`)\"")]
    Step(StepCmd),
    /// What a checkpoint costs the step after it: one trainer of the config saves after every
    /// --interval steps, alternating a save in the background (as `oogc train` does) and a
    /// synchronous one, into a scratch directory; each step is timed from the end of the step
    /// before it. Reports the median step that follows no save, and per mode the median step
    /// right after a save, its cost over that baseline (the bar: background ≤ 10 % of a step),
    /// the seconds the save held the trainer and the save's own; every checkpoint is verified
    /// against its checksums. With --json: one JSON object.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"Checkpoint cost (`oogc bench checkpoint`)\"")]
    Checkpoint(CheckpointCmd),
    /// `oogc plan` checked against reality: per config, the plan (with this CPU's compute rate
    /// probed around the steps) beside the median of real training steps, and whether it is
    /// within 15%.
    #[command(after_help = "Book: docs/src/benchmarks.md, section \"Plan against reality (`oogc bench plan`)\"")]
    Plan(PlanBenchCmd),
    /// Measure this machine for `oogc plan --profile`: with --device cuda:N the GPU (bf16 and
    /// f32 matrix-product TFLOP/s on candle's stream, H2D and D2H GB/s of the swapper's copies,
    /// its name and memory) and the host (memory triad, NVMe through the store, CPU Adam); with
    /// --device sim the host and the sim device's compute (as `oogc plan --hardware-probe`).
    /// Prints the profile (TOML) or writes it (--out).
    #[command(after_help = "Book: docs/src/guide/gpu.md")]
    Probe(ProbeCmd),
    /// The whole suite (nvme, swap, adam, evict, moe; with --config also step, the step timeline
    /// and the plan check) with --quick or full sizes: one JSON file per benchmark
    /// (`{ "benchmark", "args", "rows" }`) and PNG + SVG plots in --out DIR.
    #[command(after_help = "Book: docs/src/benchmarks.md")]
    All(AllCmd),
}

#[derive(Debug, Args)]
pub(crate) struct ProbeCmd {
    /// `sim` (this CPU) or `cuda:N` (GPU N; needs a build with the `cuda` feature).
    #[arg(long, value_name = "DEVICE", default_value = "sim")]
    pub(crate) device: swap::BenchDevice,
    /// Write the profile (TOML) here instead of printing it.
    #[arg(long, value_name = "FILE")]
    pub(crate) out: Option<PathBuf>,
    /// Directory for the NVMe store's temporary file (default: the temp dir).
    #[arg(long, value_name = "DIR")]
    pub(crate) probe_dir: Option<PathBuf>,
    /// MiB written then read through the NVMe store.
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(8..))]
    pub(crate) probe_mib: u64,
    /// Only the GPU's figures (--device cuda:N): the host's keep their defaults.
    #[arg(long)]
    pub(crate) gpu_only: bool,
}

#[derive(Debug, Args)]
pub(crate) struct PlanBenchCmd {
    /// `oogc train` configs to check (repeat the flag; the configs run as they are, without
    /// checkpoints or metrics; NVMe scratch goes to a subdirectory of their nvme_dirs).
    #[arg(long = "config", value_name = "FILE", required = true)]
    pub(crate) configs: Vec<PathBuf>,
    /// Steps measured per config, after the warmup.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// Steps run first per config and not measured.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub(crate) warmup: u64,
    /// Hardware profile the plan starts from (TOML; its compute figures are replaced by the probe's).
    #[arg(long, value_name = "FILE")]
    pub(crate) hardware: Option<PathBuf>,
    /// JSON Lines on stdout instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct StepCmd {
    /// The `oogc train` config (no checkpoints or metrics are written; NVMe scratch goes to a
    /// subdirectory of its nvme_dirs, removed after).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: PathBuf,
    /// Steps measured per variant, after the warmup.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// Steps run first per variant and not measured (the first one records the schedule).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub(crate) warmup: u64,
    /// Run the all-resident variant only when parameters + optimizer state (16 B/param) fit in
    /// this many bytes; suffixes KiB, MiB, GiB.
    #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    pub(crate) resident_cap: usize,
    /// Hardware profile for the plan's prediction (TOML; see `oogc plan --hardware-probe`).
    #[arg(long, value_name = "FILE")]
    pub(crate) hardware: Option<PathBuf>,
    /// Throttle the sim device's link to this many GB/s (10⁹ B/s) each way instead of the config's
    /// `[device] link_gbps` (sim device only).
    #[arg(long, value_name = "GBPS")]
    pub(crate) link_gbps: Option<f64>,
    /// Instead of the three variants: the config at GPU budgets of these fractions of its
    /// parameters + optimizer state (16 B/param), each with `[optimizer] device_units` = 0 and
    /// "auto", and the optimizer time each step waits for (comma-separated, e.g. 0.25,0.5).
    #[arg(long, value_name = "FRACTIONS", value_delimiter = ',')]
    pub(crate) device_units: Option<Vec<f64>>,
    /// JSON Lines on stdout instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct CheckpointCmd {
    /// The `oogc train` config (its `[checkpoint]` is replaced by the scratch directory; no
    /// metrics or trace are written; NVMe scratch goes to a subdirectory of its nvme_dirs).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: PathBuf,
    /// Steps measured, after the warmup (more than 2 × --interval).
    #[arg(long, value_name = "N", default_value_t = 48)]
    pub(crate) steps: u64,
    /// A save after every this many measured steps (at least 2).
    #[arg(long, value_name = "K", default_value_t = 4)]
    pub(crate) interval: u64,
    /// Steps run first and not measured.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub(crate) warmup: u64,
    /// Directory under which the scratch checkpoint directory `oogc-bench-checkpoint-<pid>` is
    /// made and removed (default: the parent of the config's `[checkpoint] dir`, else the temp
    /// directory).
    #[arg(long, value_name = "DIR")]
    pub(crate) dir: Option<PathBuf>,
    /// One JSON object on stdout instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct AllCmd {
    /// Directory for the JSON files and plots (created when missing).
    #[arg(long, value_name = "DIR")]
    pub(crate) out: PathBuf,
    /// Small sizes: the whole suite in under 3 minutes on 2 cores (nvme 0.25 GiB, swap 64 MiB,
    /// adam 16 Mi parameters, moe 100 synthetic steps).
    #[arg(long)]
    pub(crate) quick: bool,
    /// Test sizes (seconds in a debug build; the figures mean little).
    #[arg(long, hide = true, conflicts_with = "quick")]
    pub(crate) tiny: bool,
    /// Directory of the NVMe store and fio's file (repeat for several; default: the temp dir).
    #[arg(long = "nvme-dir", value_name = "DIR")]
    pub(crate) nvme_dirs: Vec<PathBuf>,
    /// Do not run fio beside the store even when it is installed.
    #[arg(long)]
    pub(crate) no_fio: bool,
    /// A recorded MoE routing trace (JSON Lines, from a training run) replayed after the
    /// synthetic one into moe-trace.json.
    #[arg(long, value_name = "FILE")]
    pub(crate) moe_trace: Option<PathBuf>,
    /// A training config: also run `oogc bench step` on it (3 steps after 1 warmup with --quick;
    /// step.json) and record a step timeline from a real run of it (timeline.json, timeline.png).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Throttle the --config run's sim link to this many GB/s (10⁹ B/s) each way.
    #[arg(long, value_name = "GBPS", requires = "config")]
    pub(crate) link_gbps: Option<f64>,
    /// Check `oogc plan` against real steps of these configs (repeat the flag; plan.json);
    /// default: the --config run, if any.
    #[arg(long = "plan-config", value_name = "FILE")]
    pub(crate) plan_configs: Vec<PathBuf>,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub(crate) no_progress: bool,
    /// Print only the summary, not each benchmark's table.
    #[arg(long)]
    pub(crate) summary_only: bool,
}

/// Element types for `bench adam`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum DTypeArg {
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
    fn float(self) -> Option<DType> {
        match self {
            DTypeArg::F32 => Some(DType::F32),
            DTypeArg::Bf16 => Some(DType::BF16),
            DTypeArg::F16 => Some(DType::F16),
            DTypeArg::None => None,
        }
    }
}

/// Element types of Adam's moments for `bench adam --state-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum StateDTypeArg {
    /// f32 moments (8 B/param for m and v).
    F32,
    /// bf16 moments (4 B/param).
    Bf16,
    /// block-wise int8 moments, one f32 absmax per 256 values (2.03 B/param).
    Int8,
}

impl StateDTypeArg {
    fn dtype(self) -> StateDType {
        match self {
            StateDTypeArg::F32 => StateDType::F32,
            StateDTypeArg::Bf16 => StateDType::Bf16,
            StateDTypeArg::Int8 => StateDType::Int8,
        }
    }
}

/// Dispatch paths for `bench adam`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum IsaArg {
    /// AVX-512F.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Plain Rust.
    Scalar,
}

#[derive(Debug, Args)]
pub(crate) struct AdamCmd {
    /// Parameters of the flat tensor; suffixes K, M, G are 2^10, 2^20, 2^30 (256M = 268435456).
    #[arg(long, value_name = "N", default_value = "256M", value_parser = parse_count)]
    pub(crate) params: usize,
    /// Thread counts, comma-separated; one row each.
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_value = "1,2", value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) threads: Vec<u16>,
    /// Element type of the gradients.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub(crate) grad_dtype: DTypeArg,
    /// Element type of the compute copy written in the same pass, or none.
    #[arg(long, value_enum, default_value_t = DTypeArg::None)]
    pub(crate) param_out: DTypeArg,
    /// Timed steps per row (the median is reported).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// Force a dispatch path (default: the widest this CPU has).
    #[arg(long, value_enum)]
    pub(crate) isa: Option<IsaArg>,
    /// MiB of each of the triad's three f32 arrays (default: 4 × the last-level cache, so that
    /// the triad measures memory bandwidth; smaller only makes a smoke run shorter).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) triad_mib: Option<u64>,
    /// Element types of Adam's moments m and v, comma-separated or repeated: rows of the
    /// reduced-moment step (AdamKernel::step_moments) per type and thread count, bytes counted
    /// with the moments' own size (default: none, only the rows of the f32 AdamKernel::step).
    #[arg(long = "state-dtype", value_name = "DTYPE,..", value_enum, value_delimiter = ',')]
    pub(crate) state_dtypes: Vec<StateDTypeArg>,
    /// Print JSON Lines on stdout: one object per row per line, with fields variant,
    /// state_dtype (with --state-dtype), isa, threads, params, seconds_per_step, params_per_s,
    /// bytes_per_param, gbps, triad_gbps, ratio_to_triad, torch_params_per_s, ratio_to_torch.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct EvictCmd {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Device budgets as fractions of the model's compute copies, comma-separated (each in (0, 1]).
    #[arg(long, value_name = "F,F,..", value_delimiter = ',', default_value = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", value_parser = parse_fraction)]
    pub(crate) fractions: Vec<f64>,
    /// Prefetch window, units ahead.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_depth: u64,
    /// Hardware profile (TOML); defaults: the sim device.
    #[arg(long, value_name = "FILE")]
    pub(crate) hardware: Option<PathBuf>,
    /// Override the profile's device GFLOP/s (compute time per unit), e.g. 100000 for a GPU.
    #[arg(long, value_name = "GFLOPS", value_parser = parse_positive_f64)]
    pub(crate) device_gflops: Option<f64>,
    /// The window never moves more bytes than offline MIN's demand fetching would (it then
    /// defers prefetches that need cache MIN keeps: more stall on forward-only scans).
    #[arg(long)]
    pub(crate) no_extra_bytes: bool,
    /// Print JSON Lines on stdout: one object per row per line, with fields workload, policy,
    /// budget_fraction, budget_bytes, bytes_moved, min_bytes, ratio_to_min, stall_s, step_s,
    /// stall_fraction, prefetches.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct MoeCmd {
    /// A routing trace (oogc-routing-1 JSON Lines, as `oogc train` records it).
    #[arg(long, value_name = "FILE", required_unless_present = "synthetic", conflicts_with = "synthetic")]
    pub(crate) trace: Option<PathBuf>,
    /// Replay a synthetic trace instead: Zipf-skewed popularity that drifts slowly (4 blocks of
    /// 16 experts, top-2, 256 tokens per step, 2 MiB f32 experts).
    #[arg(long)]
    pub(crate) synthetic: bool,
    /// Steps of the synthetic trace.
    #[arg(long, value_name = "N", default_value_t = 200, requires = "synthetic", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// Seed of the synthetic trace.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "synthetic")]
    pub(crate) seed: u64,
    /// Zipf exponent of the synthetic trace's popularity (0: uniform).
    #[arg(long, value_name = "S", default_value_t = 1.0, requires = "synthetic", value_parser = parse_nonnegative_f64)]
    pub(crate) zipf: f64,
    /// Also write the synthetic trace (oogc-routing-1) to this file.
    #[arg(long, value_name = "FILE", requires = "synthetic")]
    pub(crate) write_trace: Option<PathBuf>,
    /// GPU bytes for resident experts, as a fraction of all experts' bytes, in (0, 1].
    #[arg(long, value_name = "F", default_value_t = 0.25, value_parser = parse_fraction)]
    pub(crate) budget_fraction: f64,
    /// Host-to-device bandwidth, GB/s (10^9 B/s).
    #[arg(long, value_name = "GBPS", default_value_t = 16.0, value_parser = parse_positive_f64)]
    pub(crate) h2d_gbps: f64,
    /// Device-to-host bandwidth (gradients), GB/s; default: --h2d-gbps.
    #[arg(long, value_name = "GBPS", value_parser = parse_positive_f64)]
    pub(crate) d2h_gbps: Option<f64>,
    /// Achieved CPU rate on expert GEMMs, GFLOP/s (10^9 FLOP/s).
    #[arg(long, value_name = "G", default_value_t = 100.0, value_parser = parse_positive_f64)]
    pub(crate) cpu_gflops: f64,
    /// Achieved GPU rate on expert GEMMs, GFLOP/s.
    #[arg(long, value_name = "G", default_value_t = 50000.0, value_parser = parse_positive_f64)]
    pub(crate) gpu_gflops: f64,
    /// EMA decay of expert popularity, in [0, 1).
    #[arg(long, value_name = "D", default_value_t = 0.9, value_parser = parse_decay)]
    pub(crate) decay: f64,
    /// Hysteresis margin: the hot set changes when the gain exceeds the cost of moving by this fraction.
    #[arg(long, value_name = "M", default_value_t = 0.5, value_parser = parse_nonnegative_f64)]
    pub(crate) margin: f64,
    /// Print JSON Lines on stdout: one object per policy per line, with fields policy,
    /// budget_bytes, expert_h2d_bytes, refresh_h2d_bytes, bytes_vs_fetch, hit_rate,
    /// resident_rate, cpu_tokens, fetches, uses, step_s, speedup_vs_fetch.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Which store engines `bench nvme` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum EngineArg {
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
pub(crate) struct NvmeCmd {
    /// Directory of the store (repeat for several disks; the first also holds fio's file).
    /// It must exist and have room for --size-gib plus 4 MiB.
    #[arg(long = "dir", value_name = "DIR", required = true)]
    pub(crate) dirs: Vec<PathBuf>,
    /// GiB (2^30 bytes) written and read back per engine; rounded down to whole tensors, at
    /// least one. Fractions allowed (0.0625 = 64 MiB).
    #[arg(long, value_name = "GIB", value_parser = parse_positive_f64)]
    pub(crate) size_gib: f64,
    /// Store engines to measure.
    #[arg(long, value_enum, default_value_t = EngineArg::All)]
    pub(crate) engine: EngineArg,
    /// Bytes per I/O request (store and fio): a multiple of 4096 up to 64 MiB; suffixes KiB,
    /// MiB, GiB (or K, M, G) accepted.
    #[arg(long, value_name = "BYTES", default_value = "1MiB", value_parser = parse_bytes)]
    pub(crate) block_bytes: usize,
    /// Requests in flight (store and fio), 1 to 4096.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub(crate) queue_depth: u32,
    /// MiB (2^20 bytes) per tensor written by the store.
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) tensor_mib: u64,
    /// Do not run fio (otherwise run when it is on the PATH).
    #[arg(long)]
    pub(crate) no_fio: bool,
    /// Print JSON Lines on stdout: one object per row per line, with fields engine, write_gbps,
    /// read_gbps (GB/s, null when not measured), block_bytes, queue_depth, bytes, note.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct SwapCmd {
    /// MiB (2^20 bytes) per raw copy, and the total MiB of the residency manager's tensors.
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) size_mib: u64,
    /// Also measure with the sim link throttled to this many GB/s (10^9 B/s) per direction
    /// (PCIe 4.0 x16 is about 25, PCIe 5.0 x16 about 50).
    #[arg(long, value_name = "GBPS", value_parser = parse_positive_f64)]
    pub(crate) link_gbps: Option<f64>,
    /// Timed copies per raw row, and timed passes over the tensors for the residency rows.
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) repeats: u64,
    /// Tensors registered with the residency manager (each size-mib/tensors); the device
    /// budget holds half of them.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(2..))]
    pub(crate) tensors: u64,
    /// `sim`: the rows above. `cuda:N`: GPU N instead, rows cuda-htod and cuda-dtoh (the
    /// swapper's copies of driver-pinned memory) beside a plain pinned cudaMemcpyAsync of the
    /// same size in the same run (--link-gbps and --tensors do not apply). Needs a build with
    /// the `cuda` feature (scripts/build-cuda.sh) and a GPU; fails otherwise.
    #[arg(long, value_name = "DEVICE", default_value = "sim")]
    pub(crate) device: swap::BenchDevice,
    /// Print JSON Lines on stdout: one object per row per line, with fields name, bytes, gbps,
    /// ops, limit_gbps, limit, evictions, stall_s (null for raw rows), note.
    #[arg(long)]
    pub(crate) json: bool,
}

/// JSON Lines of a benchmark's rows, each with the `machine` it ran on (CPU, cores, memory,
/// kernel, file system of `dir`, git revision) and the `command` line that produced it, so two
/// runs can be compared row by row.
pub(crate) fn print_bench_json<T: Serialize>(rows: &[T], dir: Option<&std::path::Path>) -> anyhow::Result<()> {
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

pub(crate) fn bench_nvme(cmd: NvmeCmd) -> anyhow::Result<()> {
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
        Err(e) if cmd.engine == EngineArg::All && e.is_uring_unavailable() => {
            tracing::warn!("{}; measuring psync only", e.report());
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

pub(crate) fn bench_swap(cmd: SwapCmd) -> anyhow::Result<()> {
    let size_bytes = cmd.size_mib.checked_mul(1 << 20).and_then(|b| usize::try_from(b).ok());
    let args = swap::SwapBenchArgs {
        size_bytes: size_bytes.context("--size-mib is too large")?,
        link_gbps: cmd.link_gbps,
        repeats: cmd.repeats as usize,
        tensors: cmd.tensors as usize,
        ..swap::SwapBenchArgs::default()
    };
    let rows = match cmd.device {
        swap::BenchDevice::Sim => swap::run(&args),
        swap::BenchDevice::Cuda(ordinal) => swap::run_cuda(ordinal, &args),
    }
    .context("oogc bench swap")?;
    if cmd.json {
        print_bench_json(&rows, None)
    } else {
        swap::print_table(&rows);
        Ok(())
    }
}

pub(crate) fn bench_step(cmd: StepCmd) -> anyhow::Result<()> {
    let cfg = step::load_config(&cmd.config, cmd.link_gbps)?;
    oogc::run::size_compute_threads(&cfg)?;
    let args = step::StepBenchArgs {
        steps: cmd.steps as usize,
        warmup: cmd.warmup as usize,
        resident_cap_bytes: cmd.resident_cap as u64,
        hardware: load_hardware(cmd.hardware.as_ref())?,
        ..step::StepBenchArgs::new(cfg)
    };
    if let Some(fractions) = &cmd.device_units {
        if fractions.is_empty() || fractions.iter().any(|f| !(*f > 0.0 && f.is_finite())) {
            anyhow::bail!("--device-units {fractions:?}: give positive fractions of parameters + state, e.g. 0.25,0.5");
        }
        let rows = step::run_device_units(&args, fractions).context("oogc bench step --device-units")?;
        if cmd.json {
            print_json_lines(&rows)?;
        } else {
            step::print_device_units_table(&rows);
        }
        return Ok(());
    }
    let report = step::run(&args).context("oogc bench step")?;
    if cmd.json {
        print_json_lines(&report.rows)?;
        print_json_lines(&report.skipped)?;
    } else {
        step::print_table(&report);
    }
    Ok(())
}

pub(crate) fn bench_checkpoint(cmd: CheckpointCmd) -> anyhow::Result<()> {
    let cfg = step::load_config(&cmd.config, None)?;
    oogc::run::size_compute_threads(&cfg)?;
    let args = checkpoint::CheckpointBenchArgs {
        steps: cmd.steps as usize,
        warmup: cmd.warmup as usize,
        interval: cmd.interval as usize,
        dir: cmd.dir,
        ..checkpoint::CheckpointBenchArgs::new(cfg)
    };
    let report = checkpoint::run(&args).context("oogc bench checkpoint")?;
    if cmd.json {
        print_json_lines(&[report])
    } else {
        checkpoint::print_table(&report);
        Ok(())
    }
}

pub(crate) fn bench_plan(cmd: PlanBenchCmd) -> anyhow::Result<()> {
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

pub(crate) fn bench_evict(cmd: EvictCmd) -> anyhow::Result<()> {
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

pub(crate) fn bench_moe(cmd: MoeCmd) -> anyhow::Result<()> {
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

pub(crate) fn bench_adam(cmd: AdamCmd) -> anyhow::Result<()> {
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
        triad_bytes: cmd.triad_mib.map(|m| (m as usize) << 20),
        state_dtypes: cmd.state_dtypes.iter().map(|d| d.dtype()).collect(),
    };
    let rows = adam::run(&args).context("oogc bench adam")?;
    if cmd.json {
        print_bench_json(&rows, None)
    } else {
        adam::print_table(&rows);
        Ok(())
    }
}

pub(crate) fn bench_probe(cmd: ProbeCmd) -> anyhow::Result<()> {
    let profile = match (cmd.device, cmd.gpu_only) {
        (swap::BenchDevice::Cuda(n), true) => probe::gpu_profile(n).context("oogc bench probe")?,
        (swap::BenchDevice::Sim, true) => anyhow::bail!("--gpu-only needs --device cuda:N"),
        (device, false) => {
            let args = probe::ProbeArgs {
                dir: cmd.probe_dir.unwrap_or_else(std::env::temp_dir),
                nvme_bytes: cmd.probe_mib << 20,
                // On a GPU the plan computes at the GPU's matrix-product rate, not a block's on
                // this CPU.
                compute: (device == swap::BenchDevice::Sim).then(probe::ComputeShape::representative),
                gpu: match device {
                    swap::BenchDevice::Cuda(n) => Some(n),
                    swap::BenchDevice::Sim => None,
                },
                ..probe::ProbeArgs::default()
            };
            probe::probe(&args).context("oogc bench probe")?
        }
    };
    let toml = profile.to_toml_string();
    match &cmd.out {
        Some(path) => {
            std::fs::write(path, &toml).with_context(|| format!("writing the profile to {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{toml}"),
    }
    Ok(())
}

pub(crate) fn bench_all(cmd: AllCmd) -> anyhow::Result<()> {
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

/// Runs one `oogc bench` subcommand.
pub(crate) fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Nvme(cmd) => bench_nvme(cmd),
        BenchCommand::Swap(cmd) => bench_swap(cmd),
        BenchCommand::Evict(cmd) => bench_evict(cmd),
        BenchCommand::Adam(cmd) => bench_adam(cmd),
        BenchCommand::Moe(cmd) => bench_moe(cmd),
        BenchCommand::Step(cmd) => bench_step(cmd),
        BenchCommand::Checkpoint(cmd) => bench_checkpoint(cmd),
        BenchCommand::Plan(cmd) => bench_plan(cmd),
        BenchCommand::All(cmd) => bench_all(cmd),
        BenchCommand::Probe(cmd) => bench_probe(cmd),
    }
}
