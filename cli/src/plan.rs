//! `oogc plan`: memory per tier (the GPU's whole figure included), the minimum GPU budget and the predicted step of a GPT under budgets, or of an `oogc train` config; `--profile` plans with measured figures (a CUDA config without one: a named GPU's datasheet); `--hardware-probe` measures this machine.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use oogc::config::TrainConfig;
use oogc::plan as planner;
use oogc::prefetch::HardwareProfile;
use oogc::swapper::StatePlacement;
use oogc_bench::probe;

use crate::args::parse_bytes;

/// The GPT whose units are planned or swept (byte vocabulary of 256).
#[derive(Debug, Args)]
pub(crate) struct ModelArgs {
    /// Transformer blocks.
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) layers: u64,
    /// Model width.
    #[arg(long, value_name = "D", default_value_t = 768, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) d_model: u64,
    /// Tokens per sequence.
    #[arg(long, value_name = "T", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) seq_len: u64,
    /// Sequences per step.
    #[arg(long, value_name = "B", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) batch: u64,
    /// Bytes per element of the compute copy (2: bf16, 4: f32).
    #[arg(long, value_name = "BYTES", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=4))]
    pub(crate) dtype_bytes: u64,
}

impl ModelArgs {
    pub(crate) fn shape(&self) -> planner::GptShape {
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
pub(crate) enum StateArg {
    /// Host memory.
    Host,
    /// NVMe.
    Nvme,
    /// Host when --host-budget holds it, else NVMe.
    Auto,
}

#[derive(Debug, Args)]
pub(crate) struct PlanCmd {
    /// Plan the run of an `oogc train` config: its model, batch, GPU and host budgets, optimizer
    /// state tier and prefetch depth replace --layers/--d-model/--seq-len/--batch/--gpu-budget/
    /// --host-budget/--optimizer-state/--max-depth (compute copies in its `[train] compute_dtype`),
    /// and the plan adds what the run needs on the GPU ("GPU memory").
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// GPU bytes for the units' compute copies; suffixes KiB, MiB, GiB (or K, M, G).
    #[arg(long, value_name = "BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    pub(crate) gpu_budget: usize,
    /// Host bytes, if limited (decides --optimizer-state auto and warns when exceeded).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub(crate) host_budget: Option<usize>,
    /// Where the optimizer state (12 B per parameter) lives.
    #[arg(long, value_enum, default_value_t = StateArg::Auto)]
    pub(crate) optimizer_state: StateArg,
    /// Where the compute copies' home is: host memory, or NVMe with the host budget's share as
    /// its cache (`auto` means host here).
    #[arg(long, value_enum, default_value_t = StateArg::Host)]
    pub(crate) params: StateArg,
    /// Prefetch window, units ahead.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_depth: u64,
    /// Hardware profile (TOML) to plan with: written by `oogc bench probe --device cuda:N --out
    /// FILE` on the GPU machine (GPU figures: matrix-product TFLOP/s, H2D/D2H, memory), by
    /// gpu-check, or by `--hardware-probe`. Without it: the sim device's defaults for a sim
    /// config; for a CUDA config the NVIDIA H100 SXM datasheet's GPU figures (the plan says so).
    #[arg(long = "profile", visible_alias = "hardware", value_name = "FILE")]
    pub(crate) hardware: Option<PathBuf>,
    /// Data-parallel ranks (`mpirun -np N oogc train`): the host and NVMe figures are one rank's,
    /// holding 1/N of the optimizer state; the bytes each rank moves over MPI per step are added.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) world_size: u64,
    /// Write the simulated step's Chrome/Perfetto trace (JSON) here.
    #[arg(long, value_name = "FILE")]
    pub(crate) trace: Option<PathBuf>,
    /// With --config of an MoE model: place its experts and predict its expert bytes per step at
    /// the routing skew of this routing trace (`[moe] routing_trace` of a run, `oogc-routing-1`),
    /// carried over to the config's expert count by popularity rank, instead of uniform routing.
    #[arg(long, value_name = "FILE", requires = "config")]
    pub(crate) routing_trace: Option<PathBuf>,
    /// With --routing-trace: leave out the trace's first N steps (the router's warm-up).
    #[arg(long, value_name = "N", default_value_t = 10, requires = "routing_trace")]
    pub(crate) routing_skip_steps: usize,
    /// Measure this machine (memory triad, NVMe through the store, CPU Adam, and the sim
    /// device's compute: one block forward and backward, of --config's shape if given, else the
    /// main example's) and print or write (--out) a hardware profile instead of planning.
    #[arg(long)]
    pub(crate) hardware_probe: bool,
    /// With --config: before planning, time one block of the config's model forward and
    /// backward with candle on this CPU (the sim device, the config's compute threads; about
    /// 1 s) and plan with the measured GFLOP/s and backward/forward ratio instead of the
    /// profile's.
    #[arg(long, requires = "config", conflicts_with = "hardware_probe")]
    pub(crate) probe_compute: bool,
    /// Where --probe-compute and --hardware-probe time the block: `sim` (this CPU, the sim
    /// device's compute) or `cuda:N` (candle on GPU N, so the plan predicts GPU steps; needs a
    /// build with the `cuda` feature and a GPU).
    #[arg(long, value_name = "DEVICE", default_value = "sim")]
    pub(crate) device: oogc_bench::swap::BenchDevice,
    /// With --hardware-probe: write the profile (TOML) to this file.
    #[arg(long, value_name = "FILE", requires = "hardware_probe")]
    pub(crate) out: Option<PathBuf>,
    /// With --hardware-probe: directory for the NVMe store's temporary file (default: the temp dir).
    #[arg(long, value_name = "DIR", requires = "hardware_probe")]
    pub(crate) probe_dir: Option<PathBuf>,
    /// With --hardware-probe: MiB written then read through the NVMe store.
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(8..))]
    pub(crate) probe_mib: u64,
    /// With --hardware-probe: f64 elements per triad array (tests use small sizes).
    #[arg(long, value_name = "N", hide = true, default_value_t = probe::ProbeArgs::default().triad_elems)]
    pub(crate) probe_triad_elems: usize,
    /// With --hardware-probe: parameters of the Adam loop (tests use small sizes).
    #[arg(long, value_name = "N", hide = true, default_value_t = probe::ProbeArgs::default().adam_params)]
    pub(crate) probe_adam_params: usize,
    /// Print the plan as one JSON object (fields: units, params, model_bytes, min_gpu_budget_bytes,
    /// memory, step_s, compute_s, exposed_transfer_s, exposed_optimizer_s, lower_bound_s, sim, warnings,
    /// host_plan: the host budget by ledger category, nvme_plan: the NVMe store's size, hardware:
    /// the figures planned with, device_plan: what the run needs on the GPU, by part, with
    /// in_pool_bytes, outside_pool_bytes, total_bytes, device_memory_bytes and fits; experts, for an
    /// MoE config: routing, top_quarter_share, hot, cpu, expected_fetches, expected_h2d_bytes,
    /// fetch_h2d_bytes).
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn load_hardware(path: Option<&PathBuf>) -> anyhow::Result<HardwareProfile> {
    match path {
        Some(p) => HardwareProfile::load(p).context("--profile"),
        None => Ok(HardwareProfile::default()),
    }
}

pub(crate) fn plan(cmd: PlanCmd) -> anyhow::Result<()> {
    if cmd.hardware_probe {
        let args = probe::ProbeArgs {
            dir: cmd.probe_dir.unwrap_or_else(std::env::temp_dir),
            nvme_bytes: cmd.probe_mib << 20,
            triad_elems: cmd.probe_triad_elems.max(1),
            adam_params: cmd.probe_adam_params.max(1),
            compute: Some(probe::ComputeShape {
                device: cmd.device,
                ..match &cmd.config {
                    Some(path) => probe::ComputeShape::for_config(&TrainConfig::load(path)?)?,
                    None => probe::ComputeShape::representative(),
                }
            }),
            gpu: match cmd.device {
                oogc_bench::swap::BenchDevice::Cuda(n) => Some(n),
                oogc_bench::swap::BenchDevice::Sim => None,
            },
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
        let hardware = load_hardware(cmd.hardware.as_ref())?;
        let profile = match &cmd.routing_trace {
            Some(trace) => {
                let t = oogc::moe_placement::read_trace_file(trace).context("--routing-trace")?;
                let p = oogc::moe_placement::PopularityProfile::from_trace(&t, cmd.routing_skip_steps)
                    .with_context(|| format!("--routing-trace {}", trace.display()))?;
                Some((p, trace.display().to_string()))
            }
            None => None,
        };
        let routing = profile.as_ref().map(|(p, source)| (p, source.as_str()));
        let mut args = planner::plan_args_at_skew(&cfg, &hardware, cmd.trace.is_some(), routing)?;
        if cmd.routing_trace.is_some() && args.experts.is_none() {
            anyhow::bail!("--routing-trace: {} is a dense model (no experts to place)", path.display());
        }
        if cmd.probe_compute {
            if !cfg.device.kind.is_sim() && cmd.device == oogc_bench::swap::BenchDevice::Sim {
                anyhow::bail!(
                    "--probe-compute --device sim times this CPU, but {} computes on `{}`\n  fix: run it on the GPU \
                     machine with --device cuda:N (or plan with --profile FILE from `oogc bench probe --device cuda:N`)",
                    path.display(),
                    cfg.device.kind
                );
            }
            // After the config's GPU figures: the block measured in the config's dtype wins.
            let shape = probe::ComputeShape { device: cmd.device, ..probe::ComputeShape::for_config(&cfg)? };
            let probe = probe::probe_compute(&shape).context("--probe-compute")?;
            probe.apply(&mut args.hardware);
        }
        args.world_size = cmd.world_size as usize;
        return finish_plan(&cmd, args);
    }
    let args = planner::PlanArgs {
        model: planner::PlannedModel::gpt(&cmd.model.shape(), &planner::FeedForward::default())?,
        gpu_budget_bytes: cmd.gpu_budget as u64,
        host_budget_bytes: cmd.host_budget.map(|b| b as u64),
        optimizer_state: match cmd.optimizer_state {
            StateArg::Host => Some(StatePlacement::Host),
            StateArg::Nvme => Some(StatePlacement::Nvme),
            StateArg::Auto => None,
        },
        params: match cmd.params {
            StateArg::Nvme => StatePlacement::Nvme,
            StateArg::Host | StateArg::Auto => StatePlacement::Host,
        },
        // The compute copies' dtype is the shape's (`--dtype-bytes`): it sizes the host plan.
        optimizer: oogc::optimizer::OptimizerConfig {
            compute_dtype: match cmd.model.dtype_bytes {
                2 => oogc::optimizer::DType::BF16,
                _ => oogc::optimizer::DType::F32,
            },
            ..oogc::optimizer::OptimizerConfig::default()
        },
        max_units_in_use: 1,
        max_depth: cmd.max_depth as usize,
        host_depth: oogc::config::PrefetchSection::default().host_depth,
        hardware: load_hardware(cmd.hardware.as_ref())?,
        trace: cmd.trace.is_some(),
        world_size: cmd.world_size as usize,
        shard_parameters: oogc::config::RanksConfig::default().shard_parameters,
        overhead: None,
        device_units: Vec::new(),
        device: None,
        checkpoints: false,
        experts: None,
    };
    finish_plan(&cmd, args)
}

pub(crate) fn finish_plan(cmd: &PlanCmd, args: planner::PlanArgs) -> anyhow::Result<()> {
    let mut report = planner::plan_model(&args).context("oogc plan")?;
    if let (Some(path), Some(trace)) = (&cmd.trace, report.sim.trace.take()) {
        let json = serde_json::to_string(&trace).context("serializing the trace")?;
        std::fs::write(path, json).with_context(|| format!("writing the trace to {}", path.display()))?;
        eprintln!("wrote {} (open in https://ui.perfetto.dev)", path.display());
    }
    if cmd.json {
        let mut v = serde_json::to_value(&report).context("serializing the plan")?;
        let (host, nvme) = planner::host_and_nvme_plan(&args, &report);
        v["host_plan"] = serde_json::to_value(&host).context("serializing the host plan")?;
        v["nvme_plan"] = serde_json::to_value(&nvme).context("serializing the NVMe plan")?;
        if let Some(o) = &args.overhead {
            v["host_overhead"] = serde_json::to_value(o.overhead(&host)).context("serializing the overhead")?;
            v["predicted_peak_rss_bytes"] = o.predicted_peak_rss_bytes(&host).into();
        }
        v["hardware"] = serde_json::to_value(&args.hardware).context("serializing the hardware profile")?;
        if let Some(d) = &args.device {
            v["device_plan"] = d.to_json();
        }
        if let Some(e) = &args.experts {
            v["experts"] = serde_json::to_value(e).context("serializing the experts' plan")?;
        }
        println!("{}", serde_json::to_string(&v).context("serializing the plan")?);
    } else {
        print!("{}", planner::render_plan(&args, &report));
    }
    Ok(())
}
