//! `oogc bench evict`: bytes moved and stall of the eviction policies over a sweep of device
//! budgets, in the step simulator (`oogc_prefetch::sim`), for a GPT's schedule.
//!
//! | row `policy` | what runs |
//! |---|---|
//! | `next-use` | [`NextUsePolicy`](oogc_prefetch::NextUsePolicy) (Belady's MIN over the cyclic schedule) with the sliding prefetch window |
//! | `lru` | the swapper's `LruPolicy` with the same window (its victims checked the same way) |
//! | `fifo` | [`FifoPolicy`](oogc_prefetch::FifoPolicy) with the same window |
//! | `min` | offline MIN (perfect knowledge of the simulated steps), demand fetches only: the byte floor, `min_bytes` |
//!
//! Workloads: `train` (forward, backward with recompute, CPU optimizer step after each unit's
//! backward, which makes its device copy stale) and `forward` (forward passes only, as in
//! evaluation: a cyclic scan). Bytes are those of the last of 3 simulated steps.

use oogc_prefetch::plan::ModelUnit;
use oogc_prefetch::{
    min_working_set, simulate_kind, HardwareProfile, Phase, PolicyKind, PrefetchConfig, Schedule, ScheduleEntry,
    SimConfig, SimUnit,
};
use oogc_swapper::{TensorId, Tier};
use serde::Serialize;

use oogc::plan::{gpt_units, GptShape};

use crate::error::{Context, Result};

/// Arguments of the eviction benchmark.
#[derive(Debug, Clone)]
pub struct EvictBenchArgs {
    /// The model whose schedule is swept.
    pub shape: GptShape,
    /// Device budgets as fractions of the model's compute copies (raised to the minimum working set).
    pub fractions: Vec<f64>,
    /// Workloads: `train`, `forward`.
    pub workloads: Vec<Workload>,
    /// The machine (links, optimizer rate, device GFLOP/s for compute times).
    pub hardware: HardwareProfile,
    /// Prefetch window depth, units.
    pub max_depth: usize,
    /// The window's `no_extra_bytes` rule (never move more bytes than MIN's demand fetching).
    pub no_extra_bytes: bool,
}

impl Default for EvictBenchArgs {
    fn default() -> Self {
        Self {
            shape: GptShape { layers: 24, d_model: 512, seq_len: 256, batch: 8, dtype_bytes: 2 },
            fractions: vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
            workloads: vec![Workload::Train, Workload::Forward],
            hardware: HardwareProfile::default(),
            max_depth: PrefetchConfig::default().max_depth,
            no_extra_bytes: false,
        }
    }
}

/// The step that is simulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Forward, backward (recompute), CPU optimizer.
    Train,
    /// Forward only.
    Forward,
}

/// One row: a policy at a budget.
#[derive(Debug, Clone, Serialize)]
pub struct EvictBenchRow {
    /// `train` or `forward`.
    pub workload: Workload,
    /// `next-use`, `lru`, `fifo`, `min`.
    pub policy: String,
    /// The budget as a fraction of the model's compute copies (asked for).
    pub budget_fraction: f64,
    /// The budget simulated, bytes (at least the minimum working set).
    pub budget_bytes: u64,
    /// Unit bytes moved device↔host in the step, bytes.
    pub bytes_moved: u64,
    /// Offline MIN's bytes at the same budget, bytes.
    pub min_bytes: u64,
    /// `bytes_moved / min_bytes`.
    pub ratio_to_min: f64,
    /// Time the compute stream waited, seconds.
    pub stall_s: f64,
    /// Step time, seconds.
    pub step_s: f64,
    /// `stall_s / step_s`.
    pub stall_fraction: f64,
    /// Fetches issued by the prefetch window.
    pub prefetches: u64,
}

fn schedule(units: &[ModelUnit], workload: Workload) -> Result<(Schedule, Vec<(TensorId, u64)>)> {
    let ids: Vec<(TensorId, u64)> =
        units.iter().enumerate().map(|(i, u)| (TensorId(i as u64), u.compute_bytes)).collect();
    let s = match workload {
        Workload::Train => Schedule::training_step(&ids, true)?,
        Workload::Forward => Schedule::new(
            ids.iter().map(|&(u, _)| ScheduleEntry::new(u, Phase::Forward, Tier::Device)).collect(),
            ids.iter().copied(),
        )?,
    };
    Ok((s, ids))
}

/// Runs the sweep.
///
/// # Errors
/// A bad hardware profile, or the simulator's errors.
pub fn run(args: &EvictBenchArgs) -> Result<Vec<EvictBenchRow>> {
    args.hardware.validate().context("the hardware profile")?;
    let units = gpt_units(&args.shape);
    let flops_s = args.hardware.device_gflops * 1e9;
    let sim_units: Vec<SimUnit> = units
        .iter()
        .enumerate()
        .map(|(i, u)| SimUnit {
            id: TensorId(i as u64),
            num_bytes: u.compute_bytes,
            numel: u.numel,
            grad_bytes: u.compute_bytes,
            forward_s: u.forward_flops / flops_s,
            backward_s: 3.0 * u.forward_flops / flops_s,
            optimizer_on_nvme: false,
        })
        .collect();
    let total: u64 = units.iter().map(|u| u.compute_bytes).sum();
    let mut rows = Vec::new();
    for &workload in &args.workloads {
        let (s, _) = schedule(&units, workload)?;
        for &fraction in &args.fractions {
            let budget = ((total as f64 * fraction) as u64).max(min_working_set(&s));
            let mut cfg = SimConfig::new(budget);
            cfg.links = args.hardware.links();
            cfg.optimizer_params_per_s = args.hardware.cpu_adam_params_per_s;
            cfg.prefetch = Some(PrefetchConfig { max_depth: args.max_depth, no_extra_bytes: args.no_extra_bytes });
            let mut min_cfg = cfg.clone();
            min_cfg.prefetch = None;
            let min = simulate_kind(&s, &sim_units, &min_cfg, PolicyKind::Min)?;
            for kind in PolicyKind::ALL {
                let r = if kind == PolicyKind::Min { min.clone() } else { simulate_kind(&s, &sim_units, &cfg, kind)? };
                rows.push(EvictBenchRow {
                    workload,
                    policy: kind.name().to_string(),
                    budget_fraction: fraction,
                    budget_bytes: budget,
                    bytes_moved: r.bytes_moved,
                    min_bytes: min.bytes_moved,
                    ratio_to_min: r.bytes_moved as f64 / min.bytes_moved.max(1) as f64,
                    stall_s: r.stall_s,
                    step_s: r.step_s,
                    stall_fraction: r.stall_s / r.step_s.max(1e-12),
                    prefetches: r.prefetches,
                });
            }
        }
    }
    Ok(rows)
}

/// Prints the rows as a table.
pub fn print_table(rows: &[EvictBenchRow]) {
    println!(
        "{:<8} {:<9} {:>6} {:>12} {:>13} {:>8} {:>10} {:>8} {:>7}",
        "workload", "policy", "budget", "budget B", "bytes moved", "x MIN", "stall s", "stall %", "prefetch"
    );
    for r in rows {
        let w = match r.workload {
            Workload::Train => "train",
            Workload::Forward => "forward",
        };
        println!(
            "{:<8} {:<9} {:>6.2} {:>12} {:>13} {:>8.3} {:>10.5} {:>8.1} {:>7}",
            w,
            r.policy,
            r.budget_fraction,
            r.budget_bytes,
            r.bytes_moved,
            r.ratio_to_min,
            r.stall_s,
            100.0 * r.stall_fraction,
            r.prefetches
        );
    }
}
