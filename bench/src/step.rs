//! `oogc bench step --config F`: real training steps of a config under three policies, each
//! beside its lower bound `max(compute, transfer, optimizer)`, and the planner's prediction.
//!
//! | `variant` | what runs |
//! |---|---|
//! | `ours` | the config as it is (prefetch window, pipelined CPU optimizer) |
//! | `on-demand` | `[prefetch] depth = 0`, `overlap_optimizer = false`: every unit fetched when used, gradients held and the optimizer run after the backward (the ZeRO-Infinity-like baseline) |
//! | `resident` | GPU budget raised to hold every unit, optimizer state in host memory (skipped, with the reason, when parameters + state exceed the cap) |
//!
//! Each variant runs on a copy of the config without checkpoints, metrics, trace or routing
//! trace; its NVMe state goes to a scratch subdirectory of each `[budgets] nvme_dirs` entry,
//! removed afterwards. Per variant, over the measured steps (after the warmup ones):
//!
//! | figure | how |
//! |---|---|
//! | `step_s` | median step wall time |
//! | `compute_s` | the smaller of: median `step_s − stall_s` of the `resident` run (no NVMe, nothing evicted), and that of the variant's own steps (runs at different moments see different machine load) |
//! | `transfer_s` | the busiest link: max(H2D bytes / link GB/s, D2H bytes / link GB/s, NVMe store busy time), per step; 0 for an unthrottled sim link |
//! | `optimizer_s` | parameters / the params/s of one [`AdamKernel`] step over all parameters in this process (same threads, f32 copy out) |
//! | `lower_bound_s` | max(compute, transfer, optimizer) |
//! | `schedule_bound_s` | the schedule's bound: `max(compute_f, H2D_f, D2H_f) + max(compute_b, H2D_b, D2H_b)` over the forward (`f`, up to the turn: [`oogc::runtime::Runtime::end_forward`]) and backward (`b`) phases, at least NVMe busy time and the optimizer |
//! | `speedup_ceiling` | on-demand's `step_s` / the variant's `schedule_bound_s` |
//! | `plan_step_s` | `oogc plan --config --probe-compute` for the variant's config, compute probed around ours' steps as `oogc bench plan` does (the planner models the prefetch window and the pipelined optimizer, so `null` for `on-demand`) |
//! | `train_step_s` | median wall time of the whole `Trainer::train_step` call: `step_s` and the trainer's work before and after the runtime's step (the batch's tensors; an MoE model's placer statistics, replan and routing trace) |
//! | `measured_compute_s` | median time inside the model's calls in the step ([`oogc::train::StepOutcome::compute_s`]: forward, recompute, backward, routing, gathers, scatters, combine, losses) |
//! | `outside_s` | median per step of `train_step_s − measured_compute_s − stall_transfer_s − stall_optimizer_s`: the time that is neither compute nor waiting for a copy (exposed H2D, D2H, NVMe reads of a fetch) nor for the optimizer (exposed) — the runtime's and trainer's own work: fetch and push calls when they do not wait (bookkeeping, the residency manager's lock, reservations and evictions, issuing copies, staging gradients, the prefetch window's planning, the step's trace), `begin_step` / `finish_step` less their waits, the MoE placer and its trace, and the trainer's loops and maps |
//! | `outside_share` | median per step of `outside_s / train_step_s` |
//!
//! Why two bounds: every unit's new compute copy depends on the whole step's gradients (the
//! global-norm clip and the skip of a non-finite step are decided after the last gradient), so
//! no H2D of step `t + 1`'s forward can start before step `t`'s backward has ended. The forward's
//! H2D therefore cannot hide behind the backward's compute, and with a slow link the forward is
//! link-bound while the backward is compute-bound: `lower_bound_s`, which lets all traffic hide
//! behind all compute, is then out of reach for any schedule with these bytes; the schedule bound
//! is not.
//!
//! The compute of the sim device runs on the same CPU cores as the optimizer, so on a small
//! machine compute and optimizer contend and the bound is optimistic.

use std::path::Path;
use std::time::Instant;

use oogc_optimizer::{AdamConfig, AdamKernel, CopyOut, DType, GradSlice, Isa, StateIo};
use oogc_prefetch::HardwareProfile;
use serde::Serialize;

use crate::error::{Context, Error, Result};
use crate::machine::{self, Machine};
use oogc::config::TrainConfig;
use oogc::plan::plan_model;
use oogc::train::Trainer;
use oogc_swapper::StatePlacement;

/// Arguments of the step benchmark.
#[derive(Debug, Clone)]
pub struct StepBenchArgs {
    /// The run's config (paths already resolved).
    pub config: TrainConfig,
    /// Measured steps per variant (≥ 1).
    pub steps: usize,
    /// Steps run first and not measured (the first step records the schedule).
    pub warmup: usize,
    /// The `resident` variant runs only when parameters + optimizer state (16 B/param) fit in
    /// this many bytes.
    pub resident_cap_bytes: u64,
    /// The machine profile the plan uses (`oogc plan --hardware`; default: the sim defaults).
    pub hardware: HardwareProfile,
}

impl StepBenchArgs {
    /// `steps` 10, `warmup` 3, a 1 GiB resident cap, the default hardware profile.
    pub fn new(config: TrainConfig) -> Self {
        Self { config, steps: 10, warmup: 3, resident_cap_bytes: 1 << 30, hardware: HardwareProfile::default() }
    }
}

/// One variant's measured step.
#[derive(Debug, Clone, Serialize)]
pub struct StepBenchRow {
    /// `ours`, `on-demand` or `resident`.
    pub variant: String,
    /// Steps measured.
    pub steps: usize,
    /// Median step wall time, seconds.
    pub step_s: f64,
    /// max(compute, transfer, optimizer), seconds.
    pub lower_bound_s: f64,
    /// `step_s / lower_bound_s`.
    pub ratio_to_lower_bound: f64,
    /// The schedule's lower bound: each phase bounded by its own busiest resource,
    /// `max(compute_f, H2D_f, D2H_f) + max(compute_b, H2D_b, D2H_b)`, and the whole step by
    /// NVMe and the optimizer, seconds (see the module docs). Never below `lower_bound_s`.
    pub schedule_bound_s: f64,
    /// `step_s / schedule_bound_s`.
    pub ratio_to_schedule_bound: f64,
    /// Compute of the forward phase (from the same run as `compute_s`), seconds.
    pub forward_compute_s: f64,
    /// Compute of the backward phase (with recompute and the head's loss), seconds.
    pub backward_compute_s: f64,
    /// Mean H2D bytes per step in the forward phase.
    pub forward_h2d_bytes: u64,
    /// Mean D2H bytes per step in the forward phase.
    pub forward_d2h_bytes: u64,
    /// Compute per step, seconds (see the module docs).
    pub compute_s: f64,
    /// Where `compute_s` comes from: `resident run` or `own steps minus stalls` (the smaller).
    pub compute_source: String,
    /// The busiest link's time per step, seconds.
    pub transfer_s: f64,
    /// H2D bytes / link bandwidth, seconds per step.
    pub h2d_s: f64,
    /// D2H bytes / link bandwidth, seconds per step.
    pub d2h_s: f64,
    /// NVMe store busy time (reads + writes), seconds per step.
    pub nvme_s: f64,
    /// Parameters / measured optimizer rate, seconds per step.
    pub optimizer_s: f64,
    /// Mean H2D bytes per step.
    pub h2d_bytes: u64,
    /// Mean D2H bytes per step.
    pub d2h_bytes: u64,
    /// Mean NVMe bytes read per step.
    pub nvme_read_bytes: u64,
    /// Mean NVMe bytes written per step.
    pub nvme_write_bytes: u64,
    /// Median time blocked on transfers per step, seconds.
    pub stall_transfer_s: f64,
    /// Median time blocked on the optimizer per step, seconds.
    pub stall_optimizer_s: f64,
    /// `on-demand`'s `step_s` over this `step_s`.
    pub speedup_vs_on_demand: f64,
    /// `on-demand`'s `step_s` over this variant's `schedule_bound_s`: the most that any
    /// schedule moving this variant's bytes could gain over the measured baseline.
    pub speedup_ceiling: f64,
    /// The planner's predicted step for this variant's config, seconds (`null` for on-demand).
    pub plan_step_s: Option<f64>,
    /// `(plan_step_s − step_s) / step_s`.
    pub plan_error: Option<f64>,
    /// Parameters of the model.
    pub params: usize,
    /// The variant's GPU budget, bytes.
    pub gpu_budget_bytes: u64,
    /// The variant's prefetch depth, units.
    pub prefetch_depth: usize,
    /// The variant's `[prefetch] overlap_optimizer`.
    pub overlap_optimizer: bool,
    /// The machine (same in every row).
    pub machine: Machine,
    /// Median wall time of the whole `Trainer::train_step` call, seconds (see the module docs).
    pub train_step_s: f64,
    /// Median time inside the model's calls per step, seconds.
    pub measured_compute_s: f64,
    /// Median per step of the time outside compute, exposed transfer and exposed optimizer,
    /// seconds (see the module docs for what it holds).
    pub outside_s: f64,
    /// Median per step of `outside_s / train_step_s`.
    pub outside_share: f64,
    /// The variant's config as TOML.
    pub config: String,
}

/// A variant that did not run.
#[derive(Debug, Clone, Serialize)]
pub struct StepBenchSkip {
    /// The variant.
    pub variant: String,
    /// Why it did not run.
    pub skipped: String,
}

/// What [`run`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct StepBenchReport {
    /// Variants that ran, in the order `ours`, `on-demand`, `resident`.
    pub rows: Vec<StepBenchRow>,
    /// Variants that did not run.
    pub skipped: Vec<StepBenchSkip>,
}

/// Raw measurements of one variant: medians over the measured steps, or means per step for
/// bytes.
pub(crate) struct Measured {
    /// Median step wall time, seconds.
    pub(crate) step_s: f64,
    /// Median `step_s − stall_s` (compute and everything else not waiting), seconds.
    pub(crate) busy_s: f64,
    /// Median forward-phase wall time minus its stalls (to [`oogc::runtime::Runtime::end_forward`]), seconds.
    pub(crate) forward_busy_s: f64,
    /// Mean H2D bytes per step in the forward phase.
    pub(crate) forward_h2d: u64,
    /// Mean D2H bytes per step in the forward phase.
    pub(crate) forward_d2h: u64,
    /// Median time blocked on transfers, seconds.
    pub(crate) stall_transfer_s: f64,
    /// Median time blocked on the optimizer, seconds.
    pub(crate) stall_optimizer_s: f64,
    /// Mean H2D bytes per step.
    pub(crate) h2d: u64,
    /// Mean D2H bytes per step.
    pub(crate) d2h: u64,
    /// Mean NVMe bytes read per step.
    pub(crate) nvme_r: u64,
    /// Mean NVMe bytes written per step.
    pub(crate) nvme_w: u64,
    /// NVMe store busy time per step, seconds.
    pub(crate) nvme_busy_s: f64,
    /// Median seconds per step of device optimizer work (part of `stall_optimizer_s`).
    pub(crate) device_update_s: f64,
    /// Units whose optimizer was on the device after the measured steps.
    pub(crate) device_units: usize,
    /// Their GPU bytes ([`oogc::runtime::device_optimizer_bytes`] each).
    pub(crate) device_optimizer_bytes: u64,
    /// Median wall time of the whole `Trainer::train_step` call, seconds.
    pub(crate) train_step_s: f64,
    /// Median time inside the model's calls, seconds.
    pub(crate) compute_s: f64,
    /// Median per step of the wall time less compute and both stalls, seconds.
    pub(crate) outside_s: f64,
    /// Median per step of `outside_s` over the wall time.
    pub(crate) outside_share: f64,
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The config of one variant: no checkpoints or output files (metrics, trace, routing trace),
/// NVMe state in a scratch subdirectory `oogc-bench-step-<pid>-<tag>` of each NVMe directory
/// (remove it with [`remove_scratch`]), at least `steps` scheduled steps for the LR schedule.
pub(crate) fn variant_config(base: &TrainConfig, tag: &str, steps: u64) -> TrainConfig {
    let mut c = base.clone();
    c.checkpoint.dir = None;
    c.output.metrics = None;
    c.output.trace = None;
    c.moe.routing_trace = None;
    c.train.steps = c.train.steps.max(steps);
    let sub = format!("oogc-bench-step-{}-{tag}", std::process::id());
    c.budgets.nvme_dirs = c.budgets.nvme_dirs.iter().map(|d| d.join(&sub)).collect();
    c
}

/// Removes the NVMe scratch directories of a [`variant_config`] and whatever is left in them.
pub(crate) fn remove_scratch(cfg: &TrainConfig) {
    for d in &cfg.budgets.nvme_dirs {
        // The store deletes its own files as its last users let go; give it a moment, then
        // remove whatever is left.
        for _ in 0..20 {
            if std::fs::remove_dir(d).is_ok() || !d.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Trains `warmup` then `steps` steps of `cfg` (a [`variant_config`]) and measures the latter;
/// removes `cfg`'s NVMe directories afterwards.
///
/// # Errors
/// The trainer's errors (bad config, data, NVMe).
pub(crate) fn measure(cfg: &TrainConfig, warmup: usize, steps: usize) -> Result<Measured> {
    measure_with(cfg, warmup, steps, |_| Ok(()))
}

/// When [`measure_with`] calls back: the trainer is alive (its memory allocated, its threads
/// idle or finishing the last updates), no step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moment {
    /// After the warmup steps, before the measured ones.
    Warm,
    /// After the measured steps, before the trainer is dropped and its NVMe files removed.
    Measured,
}

/// [`measure`], calling `at` at each [`Moment`] (to take other measurements in the steps'
/// conditions).
///
/// # Errors
/// The trainer's errors; `at`'s.
pub(crate) fn measure_with(
    cfg: &TrainConfig,
    warmup: usize,
    steps: usize,
    mut at: impl FnMut(Moment) -> Result<()>,
) -> Result<Measured> {
    let result = (|| -> Result<Measured> {
        let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single())?;
        for _ in 0..warmup {
            t.train_step()?;
        }
        at(Moment::Warm)?;
        let before = t.runtime().memory().traffic();
        let mut stats = Vec::with_capacity(steps);
        // Per step: (train_step wall, compute, outside).
        let mut split = Vec::with_capacity(steps);
        for _ in 0..steps {
            let o = t.train_step()?;
            let outside = o.wall_s - o.compute_s - o.stats.stall_s();
            split.push((o.wall_s, o.compute_s, outside));
            stats.push(o.stats);
        }
        let after = t.runtime().memory().traffic();
        at(Moment::Measured)?;
        let n = steps as u64;
        let sum = |f: fn(&oogc::runtime::StepStats) -> u64| stats.iter().map(f).sum::<u64>() / n;
        Ok(Measured {
            step_s: median(stats.iter().map(|s| s.figures.step_s).collect()),
            busy_s: median(stats.iter().map(|s| (s.figures.step_s - s.stall_s()).max(0.0)).collect()),
            forward_busy_s: median(stats.iter().map(|s| (s.forward.wall_s - s.forward.stall_s).max(0.0)).collect()),
            forward_h2d: sum(|s| s.forward.h2d_bytes),
            forward_d2h: sum(|s| s.forward.d2h_bytes),
            stall_transfer_s: median(stats.iter().map(|s| s.figures.stall_transfer_s).collect()),
            stall_optimizer_s: median(stats.iter().map(|s| s.figures.stall_optimizer_s).collect()),
            h2d: sum(|s| s.figures.h2d_bytes),
            d2h: sum(|s| s.figures.d2h_bytes),
            nvme_r: sum(|s| s.figures.nvme_read_bytes),
            nvme_w: sum(|s| s.figures.nvme_write_bytes),
            nvme_busy_s: ((after.nvme_read.busy_s - before.nvme_read.busy_s)
                + (after.nvme_write.busy_s - before.nvme_write.busy_s))
                / steps as f64,
            device_update_s: median(stats.iter().map(|s| s.device_update_s).collect()),
            // As the last measured step ended (the step's own record of them).
            device_units: stats.last().map_or(0, |s| s.device_units),
            device_optimizer_bytes: stats.last().map_or(0, |s| s.device_optimizer_bytes),
            train_step_s: median(split.iter().map(|s| s.0).collect()),
            compute_s: median(split.iter().map(|s| s.1).collect()),
            outside_s: median(split.iter().map(|s| s.2).collect()),
            outside_share: median(split.iter().map(|s| s.2 / s.0.max(1e-12)).collect()),
        })
    })();
    remove_scratch(cfg);
    result
}

/// Loads a training config for a benchmark, its sim link throttled to `link_gbps` (10⁹ B/s each
/// way) when given.
///
/// # Errors
/// The config's load errors (named by key or path); `link_gbps` not positive and finite, or given
/// for a config whose device is not the sim device.
pub fn load_config(path: &Path, link_gbps: Option<f64>) -> Result<TrainConfig> {
    let mut cfg = TrainConfig::load(path)?;
    if let Some(l) = link_gbps {
        if !(cfg.device.kind.is_sim() && l > 0.0 && l.is_finite()) {
            return Err(Error::LinkThrottle {
                link_gbps: l,
                config: path.to_path_buf(),
                device: cfg.device.kind.to_string(),
            });
        }
        cfg.device.link_gbps = l;
    }
    Ok(cfg)
}

/// Seconds of one fused AdamW step (f32 gradients in, f32 compute copy out) over `params`
/// parameters on `threads` threads: median of 3 after a warm-up step.
///
/// # Errors
/// The kernel's errors (no SIMD path, zero threads).
pub fn optimizer_step_s(params: usize, threads: usize) -> Result<f64> {
    let kernel = AdamKernel::new(Isa::detect(), threads).context("the optimizer kernel")?;
    let adam = AdamConfig::default();
    let (mut p, mut m, mut v) = (vec![0.5f32; params], vec![0f32; params], vec![0f32; params]);
    let g = vec![1e-3f32; params];
    let mut copy = vec![0u8; params * 4];
    let mut times = Vec::new();
    for t in 1..=4u64 {
        let s = adam.scalars(t, 1e-3, 1.0)?;
        let start = Instant::now();
        kernel.step(
            &s,
            StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v },
            GradSlice::F32(&g),
            CopyOut::from_bytes(DType::F32, &mut copy),
        )?;
        if t > 1 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box(&copy);
    Ok(median(times))
}

/// `oogc plan --config`'s prediction for `cfg`, seconds.
///
/// # Errors
/// The planner's errors.
pub fn plan_step_s(cfg: &TrainConfig, hardware: &HardwareProfile) -> Result<f64> {
    Ok(plan_model(&oogc::plan::plan_args_for_config(cfg, hardware, false)?)?.step_s)
}

/// Runs the three variants and computes their bounds.
///
/// # Errors
/// `--steps 0`; a config that cannot train (named by the trainer); NVMe or optimizer failures.
pub fn run(args: &StepBenchArgs) -> Result<StepBenchReport> {
    if args.steps == 0 {
        return Err(Error::invalid("--steps", "must be at least 1 (the steps measured after --warmup)"));
    }
    let base = &args.config;
    let total = (args.warmup + args.steps) as u64;
    let model = oogc::train::build_model(base, oogc::train::vocab_size(base)?)?;
    let params: usize = model.units().iter().map(|u| u.numel).sum();
    let machine = machine::record_for_config(base);

    let ours = variant_config(base, "ours", total);
    let mut on_demand = variant_config(base, "on-demand", total);
    on_demand.prefetch.depth = 0;
    on_demand.prefetch.overlap_optimizer = false;
    let model_bytes = params as u64 * 16;
    let resident = if model_bytes > args.resident_cap_bytes {
        Err(format!(
            "parameters + optimizer state = {model_bytes} bytes (16 B/param) exceed the resident cap of {} bytes",
            args.resident_cap_bytes
        ))
    } else {
        let mut r = variant_config(base, "resident", total);
        // Every unit's compute copy, twice over for gradient staging and slack.
        r.budgets.gpu = bytesize::ByteSize::b(2 * params as u64 * 4 + (1 << 20));
        r.budgets.optimizer_state = StatePlacement::Host;
        Ok(r)
    };

    let mut measured: Vec<(&str, TrainConfig, Measured)> = Vec::new();
    let mut skipped = Vec::new();
    match resident {
        Ok(cfg) => {
            let m = measure(&cfg, args.warmup, args.steps).context("the resident variant")?;
            measured.push(("resident", cfg, m));
        }
        Err(reason) => skipped.push(StepBenchSkip { variant: "resident".into(), skipped: reason }),
    }
    let m = measure(&on_demand, args.warmup, args.steps).context("the on-demand variant")?;
    measured.push(("on-demand", on_demand, m));
    // The plan's compute rate: this CPU's, probed in ours' steps' conditions as `oogc bench plan`
    // probes (after the warmup and after the measured steps, with the trainer alive).
    let (m, probes) = crate::plan_check::measure_probed(&ours, args.warmup, args.steps).context("the ours variant")?;
    measured.push(("ours", ours, m));
    let mut hardware = args.hardware.clone();
    crate::plan_check::closest_pair_mean(&probes).apply(&mut hardware);

    let optimizer_s = optimizer_step_s(params, base.threads.optimizer)?;
    let resident_compute =
        measured.iter().find(|(v, ..)| *v == "resident").map(|(_, _, m)| (m.busy_s, m.forward_busy_s));
    let on_demand_step = measured.iter().find(|(v, ..)| *v == "on-demand").map_or(0.0, |(_, _, m)| m.step_s);
    let link = base.device.link_gbps * 1e9;
    let mut rows = Vec::new();
    for variant in ["ours", "on-demand", "resident"] {
        let Some((_, cfg, m)) = measured.iter().find(|(v, ..)| *v == variant) else { continue };
        // The smaller of the two estimates: runs at different moments see different machine
        // load, and a bound must not exceed what any run achieved.
        let (compute_s, forward_compute_s, compute_source) = match resident_compute {
            Some((c, f)) if c <= m.busy_s => (c, f, "resident run"),
            _ => (m.busy_s, m.forward_busy_s, "own steps minus stalls"),
        };
        let forward_compute_s = forward_compute_s.min(compute_s);
        let backward_compute_s = compute_s - forward_compute_s;
        let per_link = |bytes: u64| if link > 0.0 { bytes as f64 / link } else { 0.0 };
        let (h2d_s, d2h_s) = (per_link(m.h2d), per_link(m.d2h));
        let transfer_s = h2d_s.max(d2h_s).max(m.nvme_busy_s);
        let lower_bound_s = compute_s.max(transfer_s).max(optimizer_s);
        let forward_s = forward_compute_s.max(per_link(m.forward_h2d)).max(per_link(m.forward_d2h));
        let backward_s = backward_compute_s
            .max(per_link(m.h2d.saturating_sub(m.forward_h2d)))
            .max(per_link(m.d2h.saturating_sub(m.forward_d2h)));
        let schedule_bound_s = (forward_s + backward_s).max(m.nvme_busy_s).max(optimizer_s).max(lower_bound_s);
        let plan = if variant == "on-demand" {
            None
        } else {
            Some(plan_step_s(cfg, &hardware).with_context(|| format!("planning the {variant} variant"))?)
        };
        rows.push(StepBenchRow {
            variant: variant.into(),
            steps: args.steps,
            step_s: m.step_s,
            lower_bound_s,
            ratio_to_lower_bound: m.step_s / lower_bound_s.max(1e-12),
            schedule_bound_s,
            ratio_to_schedule_bound: m.step_s / schedule_bound_s.max(1e-12),
            forward_compute_s,
            backward_compute_s,
            forward_h2d_bytes: m.forward_h2d,
            forward_d2h_bytes: m.forward_d2h,
            compute_s,
            compute_source: compute_source.into(),
            transfer_s,
            h2d_s,
            d2h_s,
            nvme_s: m.nvme_busy_s,
            optimizer_s,
            h2d_bytes: m.h2d,
            d2h_bytes: m.d2h,
            nvme_read_bytes: m.nvme_r,
            nvme_write_bytes: m.nvme_w,
            stall_transfer_s: m.stall_transfer_s,
            stall_optimizer_s: m.stall_optimizer_s,
            speedup_vs_on_demand: on_demand_step / m.step_s.max(1e-12),
            speedup_ceiling: on_demand_step / schedule_bound_s.max(1e-12),
            plan_step_s: plan,
            plan_error: plan.map(|p| (p - m.step_s) / m.step_s.max(1e-12)),
            params,
            gpu_budget_bytes: cfg.budgets.gpu.as_u64(),
            prefetch_depth: cfg.prefetch.depth,
            overlap_optimizer: cfg.prefetch.overlap_optimizer,
            machine: machine.clone(),
            train_step_s: m.train_step_s,
            measured_compute_s: m.compute_s,
            outside_s: m.outside_s,
            outside_share: m.outside_share,
            config: toml::to_string(cfg).unwrap_or_default(),
        });
    }
    Ok(StepBenchReport { rows, skipped })
}

/// One run of [`run_device_units`]: a GPU budget, with or without device optimizers.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceUnitsRow {
    /// The GPU budget as a fraction of parameters + optimizer state (16 B per parameter).
    pub gpu_fraction: f64,
    /// The GPU budget, bytes.
    pub gpu_budget_bytes: u64,
    /// `[optimizer] device_units`: `none` (0) or `auto`.
    pub device_units: String,
    /// Units whose optimizer the run placed on the device.
    pub placed_units: usize,
    /// Their GPU bytes (16 B per parameter + the compute copy).
    pub device_optimizer_bytes: u64,
    /// Median step wall time, seconds.
    pub step_s: f64,
    /// Exposed optimizer time: median seconds per step the step waited for optimizer work (a
    /// unit's CPU update not done when the next forward needs it, the end-of-step decision, and
    /// the device updates, which run after the decision on the compute stream).
    pub stall_optimizer_s: f64,
    /// Of it, the device optimizers' work (median seconds per step): on the sim device candle's
    /// CPU ops on the same cores as the CPU optimizer, unfused; on a GPU, kernels at its memory
    /// bandwidth.
    pub device_update_s: f64,
    /// `stall_optimizer_s − device_update_s`: waiting for the CPU optimizer and the decision.
    pub cpu_optimizer_wait_s: f64,
    /// Median seconds per step blocked on transfers.
    pub stall_transfer_s: f64,
    /// Mean H2D bytes per step.
    pub h2d_bytes: u64,
    /// Mean D2H bytes per step.
    pub d2h_bytes: u64,
    /// `stall_optimizer_s` over the `none` run's at the same budget (1 for `none` itself).
    pub stall_optimizer_vs_none: f64,
    /// The `none` run's `step_s` over this one's at the same budget.
    pub speedup_vs_none: f64,
    /// The machine (same in every row).
    pub machine: Machine,
}

/// `oogc bench step --device-units`: the config at GPU budgets of `fractions` of its parameters
/// and optimizer state (16 B per parameter; each at least the run's minimum working set), each with
/// `[optimizer] device_units` = 0 and `"auto"`, measured as [`run`]'s variants are (warmup, then
/// medians over the measured steps). What it shows: the optimizer time the step waits for, with
/// and without the spare GPU budget given to the units whose update would otherwise be exposed.
///
/// # Errors
/// `--steps 0`; the trainer's errors.
pub fn run_device_units(args: &StepBenchArgs, fractions: &[f64]) -> Result<Vec<DeviceUnitsRow>> {
    use oogc::config::{AutoKeyword, DeviceUnits};
    if args.steps == 0 {
        return Err(Error::invalid("--steps", "must be at least 1 (the steps measured after --warmup)"));
    }
    let base = &args.config;
    let total = (args.warmup + args.steps) as u64;
    let model = oogc::train::build_model(base, oogc::train::vocab_size(base)?)?;
    let params: u64 = model.units().iter().map(|u| u.numel as u64).sum();
    let machine = machine::record_for_config(base);
    let mut rows = Vec::new();
    for &fraction in fractions {
        let gpu = (fraction * 16.0 * params as f64) as u64;
        let mut none_row: Option<(f64, f64)> = None;
        for (name, units) in [("none", DeviceUnits::Count(0)), ("auto", DeviceUnits::Auto(AutoKeyword::Auto))] {
            let mut cfg = variant_config(base, &format!("device-units-{name}"), total);
            cfg.budgets.gpu = bytesize::ByteSize::b(gpu);
            cfg.optimizer.device_units = units;
            let m = measure(&cfg, args.warmup, args.steps)
                .with_context(|| format!("device_units = {name} at {fraction} of parameters + state"))?;
            let (none_stall, none_step) = *none_row.get_or_insert((m.stall_optimizer_s, m.step_s));
            rows.push(DeviceUnitsRow {
                gpu_fraction: fraction,
                gpu_budget_bytes: gpu,
                device_units: name.into(),
                placed_units: m.device_units,
                device_optimizer_bytes: m.device_optimizer_bytes,
                step_s: m.step_s,
                stall_optimizer_s: m.stall_optimizer_s,
                device_update_s: m.device_update_s,
                cpu_optimizer_wait_s: (m.stall_optimizer_s - m.device_update_s).max(0.0),
                stall_transfer_s: m.stall_transfer_s,
                h2d_bytes: m.h2d,
                d2h_bytes: m.d2h,
                stall_optimizer_vs_none: m.stall_optimizer_s / none_stall.max(1e-12),
                speedup_vs_none: none_step / m.step_s.max(1e-12),
                machine: machine.clone(),
            });
        }
    }
    Ok(rows)
}

/// Prints [`run_device_units`]' rows as a table.
pub fn print_device_units_table(rows: &[DeviceUnitsRow]) {
    println!(
        "{:>6} {:>11} {:>6} {:>6} {:>11} {:>9} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11} {:>11}",
        "gpu",
        "GPU B",
        "units",
        "placed",
        "dev opt B",
        "step s",
        "opt wait",
        "cpu opt",
        "dev upd",
        "xfer wait",
        "speedup",
        "H2D B",
        "D2H B"
    );
    for r in rows {
        println!(
            "{:>6.2} {:>11} {:>6} {:>6} {:>11} {:>9.4} {:>10.4} {:>10.4} {:>10.4} {:>10.4} {:>8.2} {:>11} {:>11}",
            r.gpu_fraction,
            r.gpu_budget_bytes,
            r.device_units,
            r.placed_units,
            r.device_optimizer_bytes,
            r.step_s,
            r.stall_optimizer_s,
            r.cpu_optimizer_wait_s,
            r.device_update_s,
            r.stall_transfer_s,
            r.speedup_vs_none,
            r.h2d_bytes,
            r.d2h_bytes
        );
    }
    if let Some(r) = rows.first() {
        println!("machine: {} ({} cores), git {}", r.machine.cpu_model, r.machine.cores, r.machine.git_rev);
    }
}

/// Prints the report as a table (skipped variants with their reason).
pub fn print_table(r: &StepBenchReport) {
    println!(
        "{:<10} {:>9} {:>9} {:>6} {:>9} {:>6} {:>9} {:>9} {:>9} {:>8} {:>11} {:>11} {:>11} {:>9} {:>7}",
        "variant",
        "step s",
        "bound s",
        "x bnd",
        "sched s",
        "x sch",
        "compute",
        "transfer",
        "optim",
        "speedup",
        "H2D B",
        "D2H B",
        "NVMe r+w B",
        "plan s",
        "plan err"
    );
    for row in &r.rows {
        println!(
            "{:<10} {:>9.4} {:>9.4} {:>6.2} {:>9.4} {:>6.2} {:>9.4} {:>9.4} {:>9.4} {:>8.2} {:>11} {:>11} {:>11} {:>9} {:>7}",
            row.variant,
            row.step_s,
            row.lower_bound_s,
            row.ratio_to_lower_bound,
            row.schedule_bound_s,
            row.ratio_to_schedule_bound,
            row.compute_s,
            row.transfer_s,
            row.optimizer_s,
            row.speedup_vs_on_demand,
            row.h2d_bytes,
            row.d2h_bytes,
            row.nvme_read_bytes + row.nvme_write_bytes,
            row.plan_step_s.map_or("-".into(), |p| format!("{p:.4}")),
            row.plan_error.map_or("-".into(), |e| format!("{:+.0}%", 100.0 * e)),
        );
    }
    for s in &r.skipped {
        println!("{:<10} skipped: {}", s.variant, s.skipped);
    }
    println!();
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "variant", "call s", "compute", "xfer wt", "opt wait", "outside", "out %"
    );
    for row in &r.rows {
        println!(
            "{:<10} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>6.1}%",
            row.variant,
            row.train_step_s,
            row.measured_compute_s,
            row.stall_transfer_s,
            row.stall_optimizer_s,
            row.outside_s,
            100.0 * row.outside_share
        );
    }
    println!(
        "call s: the whole train_step call; compute: inside the model's calls; xfer wt / opt wait: exposed transfer / \
         optimizer; outside: the rest (the runtime's and trainer's own work), medians per step"
    );
    if let Some(row) = r.rows.iter().find(|r| r.variant == "ours") {
        println!(
            "ours: {:.2}x the schedule bound, {:.2}x faster than on-demand (a perfect schedule of the same bytes: {:.2}x)",
            row.ratio_to_schedule_bound, row.speedup_vs_on_demand, row.speedup_ceiling
        );
    }
    if let Some(row) = r.rows.first() {
        println!(
            "compute from: {}; machine: {} ({} cores), NVMe dir on {}, git {}",
            row.compute_source, row.machine.cpu_model, row.machine.cores, row.machine.fs_type, row.machine.git_rev
        );
    }
}
