//! The `oogc` command line: `oogc bench nvme`, `oogc bench swap` and `oogc bench adam`.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default `warn`); results go to stdout, as a table
//! or, with `--json`, as JSON Lines (one object per row per line). Errors print the whole cause
//! chain on stderr and exit with status 1; bad arguments exit with status 2 (clap).
#![deny(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use oogc::bench::{adam, nvme, swap};
use oogc::optimizer::{FloatType, Isa};
use oogc::swapper::{EngineChoice, Error as SwapError};
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
    /// Offload benchmarks: a table on stdout, or JSON Lines with --json.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Write then read N GiB through the NVMe store per engine, beside fio (io_uring, O_DIRECT)
    /// in the same run. GB/s are 10^9 bytes per second.
    Nvme(NvmeCmd),
    /// Host<->device copies on the sim device (raw and through the residency manager), each row
    /// beside a limit measured or set in the same run. GB/s are 10^9 bytes per second.
    Swap(SwapCmd),
    /// The CPU AdamW step (fused: gradients in, compute copy out) on one flat tensor, per thread
    /// count, beside a STREAM triad of the same run. GB/s are 10^9 bytes per second.
    Adam(AdamCmd),
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
        dirs: cmd.dirs,
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
        print_json_lines(&rows)
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
        print_json_lines(&rows)
    } else {
        swap::print_table(&rows);
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
        print_json_lines(&rows)
    } else {
        adam::print_table(&rows);
        Ok(())
    }
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

fn init_tracing() {
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
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let result = match cli.command {
        Command::Bench(BenchCommand::Nvme(cmd)) => bench_nvme(cmd),
        Command::Bench(BenchCommand::Swap(cmd)) => bench_swap(cmd),
        Command::Bench(BenchCommand::Adam(cmd)) => bench_adam(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            if e.chain().any(|c| matches!(c.downcast_ref::<SwapError>(), Some(SwapError::NvmeDir { .. }))) {
                eprintln!("hint: store directories are given with --dir (nvme.dirs in a config file)");
            }
            ExitCode::FAILURE
        }
    }
}
