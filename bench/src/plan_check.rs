//! `oogc plan` checked against reality: for each config, the planner's predicted step beside
//! the median of real training steps of the config as it is, on the sim device.
//!
//! Per config, on the config's compute threads ([`oogc::run::compute_threads`]; where, below):
//!
//! | step | how |
//! |---|---|
//! | probe | [`crate::probe::probe_compute`] for the config's block shape, in the steps' conditions (the trainer alive and idle): after the warmup steps, after the measured steps (the machine's load drifts), and a third time when those two differ by more than [`PROBE_DISAGREEMENT`] (a transient caught one of them); `device_gflops` and `backward_flops_ratio` from the mean forward and backward times of the two closest (about 1 s each) |
//! | plan | [`oogc::plan::plan_args_for_config`] with the probed figures over the base profile (default: the sim defaults; the link of a throttled sim device replaces H2D/D2H), MoE blocks with their coarse expert placement ([`oogc::plan::moe_placement`]) |
//! | measure | `warmup + steps` real steps of the config ([`crate::step`]'s variant without checkpoints, metrics or traces; NVMe scratch in a subdirectory, removed after); the median of the last `steps` |
//! | compare | `error = plan / measured − 1`, `within_15pct = |error| ≤ 0.15` |
//!
//! The machine's load moves both figures (a probe measures the rate of its moment; the probes
//! bracket the steps): the 1-minute load average is recorded before the run and after it, and
//! every probe's rate is kept in the row. The probes run while the trainer exists, not before it
//! is built or after it is dropped: on the development VM the seconds after a run with state on
//! NVMe (its store files deleted, discarded on the virtual disk) computed up to a third slower,
//! which a probe there took for the machine's rate.
//!
//! The probes and the steps run where `oogc train` runs a step: on the calling thread over the
//! global rayon pool when that has the config's compute threads (call
//! [`oogc::run::size_compute_threads`] first, as the CLI does), else on a dedicated pool
//! ([`crate::probe::with_compute_threads`]).

use std::path::PathBuf;

use oogc_prefetch::HardwareProfile;
use serde::Serialize;

use crate::error::{Context, Error, Result};
use crate::machine::{self, Machine};
use crate::probe::{probe_compute_on_current_pool, ComputeProbe, ComputeShape};
use crate::step::{measure_with, variant_config, Moment};
use oogc::config::TrainConfig;
use oogc::plan::{plan_args_for_config, plan_model};

/// The largest `|plan / measured − 1|` that counts as a correct plan (issue 7: 15%).
pub const TOLERANCE: f64 = 0.15;

/// Two probes whose block times (forward + backward) differ by more than this factor call for a
/// third.
pub const PROBE_DISAGREEMENT: f64 = 1.25;

/// What [`run_with`] checks.
#[derive(Debug, Clone)]
pub struct PlanCheckArgs {
    /// `oogc train` configs (relative paths in them resolve against each file's directory).
    pub configs: Vec<PathBuf>,
    /// Steps measured per config, after the warmup (≥ 1).
    pub steps: usize,
    /// Steps run first and not measured (the first one records the schedule).
    pub warmup: usize,
    /// The profile the plan starts from; its compute figures are replaced by the probe's.
    /// Default: the sim defaults.
    pub hardware: HardwareProfile,
}

impl PlanCheckArgs {
    /// `configs` with 5 measured steps after 2 warmup steps and the default profile.
    pub fn new(configs: Vec<PathBuf>) -> Self {
        Self { configs, steps: 5, warmup: 2, hardware: HardwareProfile::default() }
    }
}

/// One config's plan beside its measured step.
#[derive(Debug, Clone, Serialize)]
pub struct PlanCheckRow {
    /// The config file as given.
    pub config: String,
    /// The planned model ([`oogc::plan::PlannedModel::description`]).
    pub model: String,
    /// Whether the model has MoE blocks (planned with the coarse expert placement).
    pub moe: bool,
    /// Predicted step, seconds.
    pub plan_step_s: f64,
    /// Its compute part, seconds.
    pub plan_compute_s: f64,
    /// Its exposed transfer part, seconds.
    pub plan_exposed_transfer_s: f64,
    /// Its exposed optimizer part, seconds.
    pub plan_exposed_optimizer_s: f64,
    /// Median measured step, seconds.
    pub measured_step_s: f64,
    /// Median measured `step − stalls` (compute and overheads), seconds.
    pub measured_busy_s: f64,
    /// Median measured time blocked on transfers, seconds.
    pub measured_stall_transfer_s: f64,
    /// Median measured time blocked on the optimizer, seconds.
    pub measured_stall_optimizer_s: f64,
    /// Predicted H2D bytes per step.
    pub plan_h2d_bytes: u64,
    /// Measured H2D bytes per step (mean).
    pub measured_h2d_bytes: u64,
    /// `plan_step_s / measured_step_s − 1`.
    pub error: f64,
    /// `|error| ≤` [`TOLERANCE`].
    pub within_15pct: bool,
    /// The compute rate the plan used (the two closest probes' mean forward), GFLOP/s.
    pub device_gflops: f64,
    /// The backward/forward time ratio the plan used (the two closest probes' means).
    pub backward_flops_ratio: f64,
    /// The probed block's forward (mean of the two closest probes' medians), seconds.
    pub probe_forward_s: f64,
    /// The probed block's backward (mean of the two closest probes' medians), seconds.
    pub probe_backward_s: f64,
    /// Each probe's own rate in order (after the warmup, after the measured steps, and a third
    /// when those two disagree), GFLOP/s.
    pub probe_gflops: Vec<f64>,
    /// Wall time of one probe (the longest), seconds.
    pub probe_wall_s: f64,
    /// candle's CPU compute threads (probe and steps).
    pub compute_threads: usize,
    /// The plan's hardware profile `source` (base profile and probe).
    pub hardware_source: String,
    /// Steps measured.
    pub steps: usize,
    /// Steps run before, not measured.
    pub warmup: usize,
    /// 1-minute load average before the probe.
    pub load_avg_1m_before: f64,
    /// 1-minute load average after the steps.
    pub load_avg_1m_after: f64,
    /// The machine.
    pub machine: Machine,
}

/// [`run_with`] over `configs` with `steps` measured after `warmup` steps and the default
/// profile.
///
/// # Errors
/// As [`run_with`].
pub fn run(configs: &[PathBuf], steps: usize, warmup: usize) -> Result<Vec<PlanCheckRow>> {
    run_with(&PlanCheckArgs { steps, warmup, ..PlanCheckArgs::new(configs.to_vec()) })
}

/// Probes, plans and measures every config, in order (module docs).
///
/// # Errors
/// `steps` 0; a config that cannot be read or trained (named); a plan the planner refuses; a
/// probe failure.
pub fn run_with(args: &PlanCheckArgs) -> Result<Vec<PlanCheckRow>> {
    args.configs
        .iter()
        .map(|path| {
            let cfg = TrainConfig::load(path).with_context(|| format!("reading {}", path.display()))?;
            check(&cfg, &path.display().to_string(), args)
                .with_context(|| format!("checking the plan of {}", path.display()))
        })
        .collect()
}

/// Probes, plans and measures one loaded config; `name` labels the row. `args.configs` is not
/// read.
///
/// # Errors
/// As [`run_with`].
pub fn check(cfg: &TrainConfig, name: &str, args: &PlanCheckArgs) -> Result<PlanCheckRow> {
    if args.steps == 0 {
        return Err(Error::invalid("steps", "must be at least 1 (the steps measured after the warmup)"));
    }
    let shape = ComputeShape::for_config(cfg)?;
    let threads = shape.threads;
    let load_before = load_avg_1m();
    let run = variant_config(cfg, "plan-check", (args.warmup + args.steps) as u64);
    let (measured, probes) = measure_probed(&run, args.warmup, args.steps).context("training the measured steps")?;
    let load_after = load_avg_1m();
    let probe = closest_pair_mean(&probes);
    let mut hardware = args.hardware.clone();
    probe.apply(&mut hardware);
    let plan_args = plan_args_for_config(cfg, &hardware, false)?;
    let plan = plan_model(&plan_args)?;
    let error = plan.step_s / measured.step_s.max(1e-12) - 1.0;
    Ok(PlanCheckRow {
        config: name.to_string(),
        model: plan_args.model.description.clone(),
        moe: cfg.model.moe().is_some(),
        plan_step_s: plan.step_s,
        plan_compute_s: plan.compute_s,
        plan_exposed_transfer_s: plan.exposed_transfer_s,
        plan_exposed_optimizer_s: plan.exposed_optimizer_s,
        measured_step_s: measured.step_s,
        measured_busy_s: measured.busy_s,
        measured_stall_transfer_s: measured.stall_transfer_s,
        measured_stall_optimizer_s: measured.stall_optimizer_s,
        plan_h2d_bytes: plan.sim.link_bytes.h2d,
        measured_h2d_bytes: measured.h2d,
        error,
        within_15pct: error.abs() <= TOLERANCE,
        device_gflops: probe.device_gflops,
        backward_flops_ratio: probe.backward_flops_ratio,
        probe_forward_s: probe.forward_s,
        probe_backward_s: probe.backward_s,
        probe_gflops: probes.iter().map(|p| p.device_gflops).collect(),
        probe_wall_s: probes.iter().map(|p| p.wall_s).fold(0.0, f64::max),
        compute_threads: threads,
        hardware_source: hardware.source,
        steps: args.steps,
        warmup: args.warmup,
        load_avg_1m_before: load_before,
        load_avg_1m_after: load_after,
        machine: machine::record_for_config(cfg),
    })
}

/// [`crate::step::measure`] of `run` (a [`variant_config`]) on its compute threads, with
/// the compute probe of its block shape taken in the steps' conditions (module docs): after the
/// warmup, after the measured steps, and a third time when those two differ by more than
/// [`PROBE_DISAGREEMENT`]. Returns the measurement and the 2 or 3 probes (pick with
/// [`closest_pair_mean`]).
///
/// # Errors
/// The trainer's errors; the probe's (a shape candle refuses); a pool that cannot be built.
pub(crate) fn measure_probed(
    run: &TrainConfig,
    warmup: usize,
    steps: usize,
) -> Result<(crate::step::Measured, Vec<ComputeProbe>)> {
    let shape = ComputeShape::for_config(run)?;
    crate::probe::with_compute_threads(shape.threads, || -> Result<_> {
        let mut probes = Vec::new();
        let measured = measure_with(run, warmup, steps, |moment| {
            probes.push(probe_compute_on_current_pool(&shape).context("probing compute")?);
            if moment == Moment::Measured && spread(&probes[0], &probes[1]) > PROBE_DISAGREEMENT {
                probes.push(probe_compute_on_current_pool(&shape).context("probing compute a third time")?);
            }
            Ok(())
        })?;
        Ok((measured, probes))
    })?
}

/// The larger over the smaller block time (forward + backward) of two probes.
fn spread(a: &ComputeProbe, b: &ComputeProbe) -> f64 {
    let (x, y) = (a.forward_s + a.backward_s, b.forward_s + b.backward_s);
    x.max(y) / x.min(y).max(1e-12)
}

/// [`ComputeProbe::mean`] of the two probes of `probes` (2 or 3) with the closest block times.
pub(crate) fn closest_pair_mean(probes: &[ComputeProbe]) -> ComputeProbe {
    let mut best = (0, 1);
    for i in 0..probes.len() {
        for j in i + 1..probes.len() {
            if spread(&probes[i], &probes[j]) < spread(&probes[best.0], &probes[best.1]) {
                best = (i, j);
            }
        }
    }
    ComputeProbe::mean(&probes[best.0], &probes[best.1])
}

/// The 1-minute load average (/proc/loadavg); -1 when it cannot be read.
pub fn load_avg_1m() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(-1.0)
}

/// Prints the rows as a table: plan and measured step side by side, the error, and what the
/// plan was made from.
pub fn print_table(rows: &[PlanCheckRow]) {
    println!(
        "{:<40} {:>9} {:>10} {:>7} {:>6} {:>9} {:>17} {:>8} {:>11}",
        "config", "plan s", "measured s", "error", "≤15%", "compute", "GFLOP/s (probes)", "bwd/fwd", "load 1m"
    );
    for r in rows {
        println!(
            "{:<40} {:>9.4} {:>10.4} {:>+6.1}% {:>6} {:>9.4} {:>17} {:>8.2} {:>5.2}→{:<5.2}",
            r.config,
            r.plan_step_s,
            r.measured_step_s,
            100.0 * r.error,
            if r.within_15pct { "yes" } else { "NO" },
            r.plan_compute_s,
            format!(
                "{:.1} ({})",
                r.device_gflops,
                r.probe_gflops.iter().map(|g| format!("{g:.0}")).collect::<Vec<_>>().join("/")
            ),
            r.backward_flops_ratio,
            r.load_avg_1m_before,
            r.load_avg_1m_after,
        );
    }
    for r in rows {
        println!("  {}: {}{}", r.config, r.model, if r.moe { " (MoE: coarse expert placement)" } else { "" });
    }
    if let Some(r) = rows.first() {
        println!(
            "plan: probed compute ({} threads) over the {} profile; measured: median of {} steps after {} warmup; \
             machine: {} ({} cores), git {}",
            r.compute_threads,
            if r.hardware_source.starts_with("defaults") { "default" } else { "given" },
            r.steps,
            r.warmup,
            r.machine.cpu_model,
            r.machine.cores,
            r.machine.git_rev
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_average_reads() {
        let l = load_avg_1m();
        assert!(l >= 0.0, "{l}");
    }

    fn probe(forward_s: f64, backward_s: f64) -> ComputeProbe {
        ComputeProbe {
            shape: "test".into(),
            threads: 1,
            reps: 3,
            forward_s,
            backward_s,
            forward_flops: 1e9,
            device_gflops: 1.0 / forward_s,
            backward_flops_ratio: backward_s / forward_s,
            wall_s: 1.0,
        }
    }

    #[test]
    fn a_third_probe_outvotes_a_disturbed_one() {
        let (calm, disturbed, calm2) = (probe(0.02, 0.08), probe(0.04, 0.16), probe(0.022, 0.088));
        assert!(spread(&calm, &disturbed) > PROBE_DISAGREEMENT);
        let m = closest_pair_mean(&[disturbed.clone(), calm.clone(), calm2.clone()]);
        assert!((m.forward_s - 0.021).abs() < 1e-12 && (m.backward_s - 0.084).abs() < 1e-12, "{m:?}");
        assert!((m.device_gflops - 1.0 / 0.021).abs() < 1e-9, "{m:?}");
        let m = closest_pair_mean(&[calm, disturbed]);
        assert!((m.forward_s - 0.03).abs() < 1e-12, "two probes: their mean");
    }

    #[test]
    fn zero_steps_are_refused() {
        let cfg = TrainConfig::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tinyshakespeare.toml"),
        )
        .unwrap();
        let args = PlanCheckArgs { steps: 0, ..PlanCheckArgs::new(Vec::new()) };
        let e = check(&cfg, "x", &args).unwrap_err();
        assert!(e.to_string().contains("steps"), "{e}");
    }

    #[test]
    fn a_missing_config_is_named() {
        let e = run(&[PathBuf::from("/nonexistent/run.toml")], 1, 0).unwrap_err();
        assert!(e.report().contains("/nonexistent/run.toml"), "{}", e.report());
    }
}
