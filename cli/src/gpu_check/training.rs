//! Checks 6, 7, 9 and 11: real [`Trainer`] runs on the device.
//!
//! **6, training.** A tiny Llama (hidden 64, 2 layers, GQA, the fixtures' vocabulary of 1024)
//! 20 steps on Tiny Shakespeare, composed ops: offloaded at the minimum GPU budget against
//! all-resident (bitwise: losses and master weights); against the sim device running the same
//! ops (within [`TOL_DEVICE`]; on the sim itself, the fused CPU kernels stand in for the other
//! device); parameters and optimizer state on NVMe with immediate updates against the same
//! run in host memory (bitwise); activation offload against resident (bitwise); a tiny
//! Mixtral under `[moe] policy` ours, fetch and lru (bitwise on the sim; within [`TOL_DEVICE`]
//! on CUDA, where `ours` computes cold experts on the CPU).
//!
//! **7, bf16.** The tiny Llama 50 steps in bf16 against f32: the mean loss of the last 10 steps
//! within 5 %, both learning.
//!
//! **9, throughput.** A Llama of ≥ 1 B parameters in bf16 with a GPU budget ≤ ¼ of parameters and
//! state (14 B per parameter) against the same model all-resident: tokens/s of both, their ratio
//! (target ≥ 0.9 ×), the step's time split, and the copy/compute overlap read from a Chrome
//! trace of the offloaded steps.
//!
//! **9 and 11, GPU figures** ([`gpu_figures`]): tokens/s, MFU against the peak bf16 rate (check
//! 8's measured profile, else the H100 datasheet), the device memory pool's peak
//! (`device_peak_bytes`) against the device plan's bytes in the pool (within ±10 %), and the
//! step's H2D bytes per second against the copy stream's peak.
//!
//! **11, 8 B.** `configs/llama-8b-h100.toml` (Llama-3-8B's shape, bf16, 20 GiB GPU budget) three
//! steps on the GPU.

use std::path::PathBuf;

use oogc::config::TrainConfig;
use oogc::runtime::StepStats;
use oogc::train::Trainer;
use serde_json::json;

use super::common::{diff, verdict, within, Ctx, Figures, Verdict};

/// Tolerance between two devices (or the fused and composed kernels) over a run: the largest
/// relative loss difference of a step, and the relative L2 difference of the final master
/// weights (the CPU's fused against its composed kernels: about 2e-7 and 2e-6 over 20 steps).
const TOL_DEVICE: (f64, f64) = (1e-3, 5e-3);

/// One training run's config, written as the TOML `oogc train` reads.
#[derive(Debug, Clone)]
struct Run {
    family: &'static str,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    /// Mixtral: experts per layer and per token.
    experts: Option<(usize, usize)>,
    batch: usize,
    seq: usize,
    steps: u64,
    bf16: bool,
    device: String,
    composed: bool,
    /// CUDA: cudarc's per-slice event tracking (`[device] event_tracking`).
    event_tracking: bool,
    gpu_bytes: u64,
    host_bytes: u64,
    /// NVMe directory for the optimizer state and (with `params_nvme`) the parameters.
    nvme: Option<PathBuf>,
    params_nvme: bool,
    offload_activations: bool,
    /// Clipping off and `nonfinite = "stop"`: every unit's update final at once.
    immediate: bool,
    moe_policy: Option<&'static str>,
    expert_budget: Option<u64>,
    optimizer_threads: usize,
    text: PathBuf,
    tokenizer: PathBuf,
    cache_dir: PathBuf,
}

impl Run {
    /// The tiny Llama of checks 6 and 7 on `ctx`'s device, all-resident.
    fn tiny_llama(ctx: &Ctx) -> Self {
        Self {
            family: "llama",
            hidden: 64,
            intermediate: 176,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            experts: None,
            batch: 4,
            seq: 32,
            steps: 20,
            bf16: false,
            device: ctx.device_name(),
            composed: true,
            event_tracking: true,
            gpu_bytes: 256 << 20,
            host_bytes: 2 << 30,
            nvme: None,
            params_nvme: false,
            offload_activations: false,
            immediate: false,
            moe_policy: None,
            expert_budget: None,
            optimizer_threads: 1,
            text: ctx.text(),
            tokenizer: ctx.tokenizer(),
            cache_dir: ctx.work_root.join("tokens"),
        }
    }

    fn toml(&self) -> String {
        let q = |p: &PathBuf| format!("{:?}", p.display().to_string());
        let mut s = format!(
            "[model]\nfamily = \"{}\"\nhidden_size = {}\nintermediate_size = {}\nnum_hidden_layers = {}\n\
             num_attention_heads = {}\nnum_key_value_heads = {}\nmax_position_embeddings = {}\nrope_theta = 10000.0\n\
             tie_word_embeddings = false\n",
            self.family,
            self.hidden,
            self.intermediate,
            self.layers,
            self.heads,
            self.kv_heads,
            self.seq.max(128)
        );
        if let Some((e, k)) = self.experts {
            s += &format!(
                "num_local_experts = {e}\nnum_experts_per_tok = {k}\nrouter_aux_loss_coef = 0.02\noutput_router_logits = true\n"
            );
        }
        s += &format!(
            "\n[data]\npath = {}\ntokenizer = {}\ncache_dir = {}\nval_fraction = 0.1\n",
            q(&self.text),
            q(&self.tokenizer),
            q(&self.cache_dir)
        );
        s += &format!(
            "\n[train]\nbatch_size = {}\nseq_len = {}\nsteps = {}\nseed = 1\neval_interval = 0\neval_batches = 1\n\
             compute_dtype = \"{}\"\n",
            self.batch,
            self.seq,
            self.steps,
            if self.bf16 { "bf16" } else { "f32" }
        );
        s += &format!(
            "\n[device]\nkind = \"{}\"\nlink_gbps = 0.0\nops = \"{}\"\nevent_tracking = {}\n",
            self.device,
            if self.composed { "composed" } else { "auto" },
            self.event_tracking
        );
        s += &format!("\n[budgets]\ngpu = {}\nhost = {}\n", self.gpu_bytes, self.host_bytes);
        if let Some(dir) = &self.nvme {
            s += &format!("optimizer_state = \"nvme\"\nnvme_dirs = [{}]\n", q(dir));
            if self.params_nvme {
                s += "params = \"nvme\"\n";
            }
        }
        s += &format!(
            "\n[optimizer]\nlr = 3e-3\nwarmup_steps = 2\nclip_norm = {}\nnonfinite = \"{}\"\n",
            if self.immediate { "0.0" } else { "1.0" },
            if self.immediate { "stop" } else { "skip" }
        );
        s += &format!("\n[threads]\noptimizer = {}\n", self.optimizer_threads);
        if self.offload_activations {
            s += "\n[activations]\noffload = true\n";
        }
        if let Some(policy) = self.moe_policy {
            s += &format!("\n[moe]\npolicy = \"{policy}\"\n");
            if let Some(b) = self.expert_budget {
                s += &format!("expert_budget = {b}\n");
            }
        }
        s
    }

    fn config(&self) -> anyhow::Result<TrainConfig> {
        let text = self.toml();
        TrainConfig::from_toml_str(&text).map_err(|e| anyhow::anyhow!("the check's config is refused: {e}\n{text}"))
    }
}

/// What a run gave.
struct RunOut {
    losses: Vec<f64>,
    stats: Vec<StepStats>,
    masters: Vec<Vec<f32>>,
    /// Bytes of expert copies moved H2D over the run (MoE).
    expert_h2d_bytes: u64,
    /// The minimum working set of this model and dtype (max units in use + gradient staging).
    min_working_set: u64,
    params: usize,
    tokens_per_step: usize,
    /// The device plan's bytes in the memory pool (`oogc plan`'s GPU figure less the CUDA
    /// context and cuBLAS's workspace): what each step's `device_peak_bytes` is compared with.
    plan_pool_bytes: Option<u64>,
}

/// Trains `run.steps` steps; the master weights at the end when `masters`.
fn train(run: &Run, masters: bool) -> anyhow::Result<RunOut> {
    let cfg = run.config()?;
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single())?;
    run_trainer(&mut t, &cfg, run.steps, masters)
}

/// Trains `t` (built from `cfg`) `steps` steps; the master weights at the end when `masters`.
fn run_trainer(t: &mut Trainer, cfg: &TrainConfig, steps: u64, masters: bool) -> anyhow::Result<RunOut> {
    let min_working_set = t.runtime().memory().min_working_set_bytes(oogc::train::max_units_in_use(t.model()));
    let plan_pool_bytes =
        oogc::plan::device_plan_for_config(cfg, t.model(), t.runtime().memory().device_optimizer_bytes())
            .ok()
            .map(|p| p.in_pool_bytes());
    let (mut losses, mut stats, mut expert_h2d_bytes, mut tokens_per_step) = (Vec::new(), Vec::new(), 0, 0);
    for _ in 0..steps {
        let o = t.train_step()?;
        losses.push(o.loss + o.aux_loss);
        stats.push(o.stats);
        expert_h2d_bytes += o.expert_traffic.h2d_bytes;
        tokens_per_step = o.tokens;
    }
    let masters = if masters { t.master_weights()? } else { Vec::new() };
    Ok(RunOut {
        losses,
        stats,
        masters,
        expert_h2d_bytes,
        min_working_set,
        params: t.num_params(),
        tokens_per_step,
        plan_pool_bytes,
    })
}

/// The largest tolerated difference between the device memory pool's measured peak and the
/// plan's bytes in the pool, relative to the plan (issue 37: within 10 %).
const PEAK_VS_PLAN: f64 = 0.10;

/// The GPU figures of a run's measured steps (after `warmup`): tokens/s (median step), MFU
/// (`6 · params` FLOPs per token — forward 2, backward 4 — over the peak bf16 rate, attention
/// not counted), the pool's peak against the plan, and the H2D bytes per second of step against
/// the copy stream's peak; `failures` gets the peak's miss past [`PEAK_VS_PLAN`].
fn gpu_figures(ctx: &Ctx, r: &RunOut, warmup: usize, f: &mut Figures, tag: &str, failures: &mut Vec<String>) -> String {
    let s = &r.stats[warmup.min(r.stats.len().saturating_sub(1))..];
    let step_s = median(&s.iter().map(|x| x.figures.step_s).collect::<Vec<_>>());
    let tps = r.tokens_per_step as f64 / step_s;
    let (peak_tflops, peak_h2d_gbps, source) = super::common::gpu_peaks(&ctx.out);
    let mfu = 6.0 * r.params as f64 * tps / (peak_tflops * 1e12);
    let h2d_gbps =
        median(&s.iter().map(|x| x.figures.h2d_bytes as f64 / x.figures.step_s.max(1e-9) / 1e9).collect::<Vec<_>>());
    f.set(&format!("{tag}_tokens_per_s"), tps);
    f.set(&format!("{tag}_mfu"), mfu);
    f.set(&format!("{tag}_h2d_gbps_over_step"), h2d_gbps);
    f.set(&format!("{tag}_h2d_vs_copy_peak"), h2d_gbps / peak_h2d_gbps);
    f.set("peaks_source", &source);
    let peak = s.iter().filter_map(|x| x.device_peak_bytes).max();
    f.set(&format!("{tag}_device_peak_bytes"), peak);
    f.set(&format!("{tag}_plan_pool_bytes"), r.plan_pool_bytes);
    let vs_plan = match (peak, r.plan_pool_bytes) {
        (Some(p), Some(plan)) => {
            let ratio = p as f64 / plan.max(1) as f64;
            f.set(&format!("{tag}_peak_vs_plan"), ratio);
            if (ratio - 1.0).abs() > PEAK_VS_PLAN {
                failures.push(format!(
                    "{tag}: device pool peak {p} B is {ratio:.2} × the plan's {plan} B in the pool (target within ±{:.0} %)",
                    100.0 * PEAK_VS_PLAN
                ));
            }
            format!("peak {:.2} GiB = {ratio:.2} × plan", p as f64 / (1u64 << 30) as f64)
        }
        _ => "peak vs plan: not measured".into(),
    };
    format!(
        "{tps:.0} tokens/s, MFU {:.1} % of {peak_tflops:.0} TFLOP/s, H2D {h2d_gbps:.1} GB/s over the step ({:.2} × the copy stream's {peak_h2d_gbps:.1}), {vs_plan}",
        100.0 * mfu,
        h2d_gbps / peak_h2d_gbps
    )
}

/// The minimum working set of `run`'s model (a trainer built, no step run).
fn min_working_set(run: &Run) -> anyhow::Result<u64> {
    let t = Trainer::new(run.config()?, oogc::dist::Ranks::single())?;
    Ok(t.runtime().memory().min_working_set_bytes(oogc::train::max_units_in_use(t.model())))
}

/// Whether two runs are bitwise equal: losses and master weights; else what differs.
fn bitwise(a: &RunOut, b: &RunOut) -> Result<(), String> {
    if let Some(i) = a.losses.iter().zip(&b.losses).position(|(x, y)| x.to_bits() != y.to_bits()) {
        return Err(format!("step {} loss {} vs {}", i + 1, a.losses[i], b.losses[i]));
    }
    for (u, (x, y)) in a.masters.iter().zip(&b.masters).enumerate() {
        if let Some(i) = x.iter().zip(y).position(|(p, q)| p.to_bits() != q.to_bits()) {
            return Err(format!("unit {u} master weight {i}: {} vs {}", x[i], y[i]));
        }
    }
    Ok(())
}

/// The largest relative loss difference over the steps and the relative L2 difference of the
/// master weights (all units as one vector).
fn closeness(a: &RunOut, b: &RunOut) -> (f64, f64) {
    let loss = a.losses.iter().zip(&b.losses).map(|(x, y)| (x - y).abs() / y.abs().max(1e-12)).fold(0.0, f64::max);
    let flat = |r: &RunOut| r.masters.iter().flatten().map(|&x| f64::from(x)).collect::<Vec<_>>();
    (loss, diff(&flat(a), &flat(b)).rel_l2)
}

/// Check 6.
pub(crate) fn tiny_runs(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let mut failures = Vec::new();
    let base = Run::tiny_llama(ctx);
    let resident = train(&base, true)?;
    let min = resident.min_working_set;
    f.set("params", resident.params);
    f.set("min_gpu_budget_bytes", min);
    f.set("resident_losses", json!({"first": resident.losses.first(), "last": resident.losses.last()}));

    // Offloaded at the minimum GPU budget: bitwise the resident run.
    let offloaded = train(&Run { gpu_bytes: min, ..base.clone() }, true)?;
    let h2d: u64 = offloaded.stats.iter().map(|s| s.figures.h2d_bytes).sum();
    f.set("offloaded", json!({"h2d_bytes": h2d, "bitwise": bitwise(&offloaded, &resident).is_ok()}));
    if let Err(e) = bitwise(&offloaded, &resident) {
        failures.push(format!("offloaded at the minimum budget differs from resident: {e}"));
    }

    // The offloaded run against the other device's numerics, at the same budget.
    let (other_label, other) = if ctx.is_sim() {
        (
            "fused CPU kernels vs composed (the sim's stand-in for CUDA vs sim)",
            Run { composed: false, gpu_bytes: min, ..base.clone() },
        )
    } else {
        (
            "the sim (the same composed ops on the CPU) vs CUDA",
            Run { device: "sim".into(), gpu_bytes: min, ..base.clone() },
        )
    };
    let other = train(&other, true)?;
    let (loss_rel, master_rel) = closeness(&offloaded, &other);
    f.set(
        "other_device",
        json!({"what": other_label, "max_loss_rel": loss_rel, "masters_rel_l2": master_rel, "limits": TOL_DEVICE}),
    );
    if !(within(loss_rel, TOL_DEVICE.0) && within(master_rel, TOL_DEVICE.1)) {
        failures.push(format!(
            "{other_label}: loss rel {loss_rel:.2e} (limit {:.0e}), masters rel L2 {master_rel:.2e} (limit {:.0e})",
            TOL_DEVICE.0, TOL_DEVICE.1
        ));
    }

    // Parameters and state on NVMe with immediate updates: bitwise the same in host memory.
    let immediate = Run { gpu_bytes: min, immediate: true, ..base.clone() };
    let host = train(&immediate, true)?;
    let nvme = train(&Run { nvme: Some(ctx.work.join("nvme")), params_nvme: true, ..immediate.clone() }, true)?;
    let nvme_bytes: u64 = nvme.stats.iter().map(|s| s.figures.nvme_read_bytes + s.figures.nvme_write_bytes).sum();
    f.set("nvme_immediate", json!({"nvme_bytes": nvme_bytes, "bitwise": bitwise(&nvme, &host).is_ok()}));
    if let Err(e) = bitwise(&nvme, &host) {
        failures.push(format!("parameters on NVMe with immediate updates differ from host memory: {e}"));
    }
    if nvme_bytes == 0 {
        failures.push("the NVMe run moved no NVMe bytes".into());
    }

    // Activation offload (its staging enters the working set): bitwise resident.
    let ckpt_bytes = (base.batch * base.seq * base.hidden * 4) as u64;
    let offload = train(&Run { gpu_bytes: min + 2 * ckpt_bytes, offload_activations: true, ..base.clone() }, true)?;
    f.set("activation_offload", json!({"bitwise": bitwise(&offload, &resident).is_ok()}));
    if let Err(e) = bitwise(&offload, &resident) {
        failures.push(format!("activation offload differs from resident: {e}"));
    }

    // A tiny Mixtral under three expert policies.
    let moe = Run {
        family: "mixtral",
        intermediate: 96,
        experts: Some((4, 2)),
        steps: if ctx.quick { 10 } else { 20 },
        ..base.clone()
    };
    let moe_min = min_working_set(&moe)?;
    let expert_bytes = (3 * moe.hidden * moe.intermediate * 4) as u64;
    let mut policies = Vec::new();
    for policy in ["ours", "fetch", "lru"] {
        let run = Run {
            gpu_bytes: moe_min + 2 * expert_bytes,
            moe_policy: Some(policy),
            expert_budget: Some(2 * expert_bytes),
            ..moe.clone()
        };
        let out = train(&run, true)?;
        f.set(
            &format!("mixtral_{policy}"),
            json!({"expert_h2d_bytes": out.expert_h2d_bytes, "last_loss": out.losses.last()}),
        );
        policies.push((policy, out));
    }
    let (_, fetch) = &policies[1];
    for (policy, out) in policies.iter().filter(|(p, _)| *p != "fetch") {
        if ctx.is_sim() {
            if let Err(e) = bitwise(out, fetch) {
                failures.push(format!("mixtral {policy} differs from fetch on the sim: {e}"));
            }
        } else {
            let (l, m) = closeness(out, fetch);
            if !(within(l, TOL_DEVICE.0) && within(m, TOL_DEVICE.1)) {
                failures.push(format!("mixtral {policy} vs fetch: loss rel {l:.2e}, masters rel L2 {m:.2e}"));
            }
        }
    }
    f.summary(format!(
        "tiny Llama {} steps: offloaded@min {} resident; {other_label}: loss rel {loss_rel:.1e}; NVMe+immediate {}; \
         activation offload {}; Mixtral ours/fetch/lru expert H2D {}/{}/{} B",
        base.steps,
        if bitwise(&offloaded, &resident).is_ok() { "==" } else { "!=" },
        if bitwise(&nvme, &host).is_ok() { "bitwise" } else { "DIFFERS" },
        if bitwise(&offload, &resident).is_ok() { "bitwise" } else { "DIFFERS" },
        policies[0].1.expert_h2d_bytes,
        policies[1].1.expert_h2d_bytes,
        policies[2].1.expert_h2d_bytes
    ));
    Ok(verdict(failures))
}

/// Check 7.
pub(crate) fn bf16_vs_f32(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let base = Run { steps: 50, ..Run::tiny_llama(ctx) };
    let f32_run = train(&base, false)?;
    let bf16_run = train(&Run { bf16: true, ..base.clone() }, false)?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let last = |r: &RunOut| mean(&r.losses[r.losses.len().saturating_sub(10)..]);
    let (lf, lb) = (last(&f32_run), last(&bf16_run));
    let max_step = f32_run.losses.iter().zip(&bf16_run.losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let rel = (lb - lf).abs() / lf;
    f.set("f32_losses", &f32_run.losses);
    f.set("bf16_losses", &bf16_run.losses);
    f.set("last10_f32", lf);
    f.set("last10_bf16", lb);
    f.set("last10_rel", rel);
    f.set("max_step_abs_diff", max_step);
    f.summary(format!(
        "50 steps: last-10 mean loss f32 {lf:.4}, bf16 {lb:.4} ({:.2} %), first {:.3}",
        100.0 * rel,
        f32_run.losses[0]
    ));
    let mut failures = Vec::new();
    if !within(rel, 0.05) {
        failures.push(format!("bf16's last-10 mean loss is {:.1} % from f32's (limit 5 %)", 100.0 * rel));
    }
    for (name, r) in [("f32", &f32_run), ("bf16", &bf16_run)] {
        if !within(last(r), r.losses[0] - 0.5) {
            failures.push(format!("{name} did not learn: {:.3} → {:.3}", r.losses[0], last(r)));
        }
    }
    Ok(verdict(failures))
}

/// The median of `v` (NaN when empty).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// A bf16 Llama for the throughput checks on the GPU (steps: warm-up + measured).
#[allow(clippy::too_many_arguments)]
fn big_llama(
    ctx: &Ctx,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    batch: usize,
    seq: usize,
    steps: u64,
) -> Run {
    Run {
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads: kv,
        batch,
        seq,
        steps,
        bf16: true,
        immediate: true,
        optimizer_threads: std::thread::available_parallelism().map_or(4, |n| n.get()).saturating_sub(2).clamp(1, 12),
        ..Run::tiny_llama(ctx)
    }
}

/// One step of the tiny Llama on the device: the runtime trains there, or the error (before a
/// large model's minutes of set-up are spent on it).
fn probe(ctx: &Ctx) -> Option<String> {
    match train(&Run { steps: 1, ..Run::tiny_llama(ctx) }, false) {
        Ok(_) => None,
        Err(e) => Some(format!("the runtime cannot train on {}: {}", ctx.device_name(), crate::error_line(&e))),
    }
}

/// Memory of this machine, bytes (`MemTotal`).
fn memory_bytes() -> u64 {
    oogc_bench::machine::record(None).memory_bytes
}

/// Check 9.
pub(crate) fn throughput(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    if ctx.is_sim() {
        return Ok(Verdict::Skip("needs CUDA (a 1 B-parameter model)".into()));
    }
    if let Some(why) = probe(ctx) {
        return Ok(Verdict::Fail(why));
    }
    const WARMUP: usize = 2;
    let mut run = big_llama(ctx, 2048, 5632, 24, 16, 8, 8, 1024, (WARMUP + 4) as u64);
    let cfg = run.config()?;
    let model = oogc::train::build_model(&cfg, oogc::train::vocab_size(&cfg)?)?;
    let params: usize = model.units().iter().map(|u| u.numel).sum();
    let state_bytes = params as u64 * 14; // bf16 compute copy + fp32 master, m, v
    f.set("params", params);
    f.set("model", json!({"hidden": run.hidden, "intermediate": run.intermediate, "layers": run.layers, "heads": run.heads, "kv_heads": run.kv_heads, "batch": run.batch, "seq": run.seq}));
    run.host_bytes = params as u64 * 16 + (8 << 30);
    if let Some(skip) = host_memory_skip(run.host_bytes) {
        return Ok(skip);
    }
    // All-resident first (the trace's last steps are then the offloaded run's).
    let resident = train(&Run { gpu_bytes: params as u64 * 2 + (4 << 30), ..run.clone() }, false)?;
    let offloaded_budget = state_bytes / 4;
    f.set("gpu_budget_bytes", offloaded_budget);
    f.set("budget_fraction", offloaded_budget as f64 / state_bytes as f64);
    let started = std::time::Instant::now();
    let offloaded = train(&Run { gpu_bytes: offloaded_budget, ..run.clone() }, false)?;
    let offloaded_s = started.elapsed().as_secs_f64();
    let tps = |r: &RunOut| {
        r.tokens_per_step as f64 / median(&r.stats[WARMUP..].iter().map(|s| s.figures.step_s).collect::<Vec<_>>())
    };
    let (tr, to) = (tps(&resident), tps(&offloaded));
    let ratio = to / tr;
    f.set("tokens_per_s_resident", tr);
    f.set("tokens_per_s_offloaded", to);
    f.set("ratio", ratio);
    // Does cudarc's per-slice event tracking cost anything (issue 25, item 1)? The offloaded run
    // again with it off, when the time is there; the figure decides `[device] event_tracking`'s
    // default.
    if ctx.left_s() > 1.5 * offloaded_s + 10.0 {
        let untracked = train(&Run { gpu_bytes: offloaded_budget, event_tracking: false, ..run.clone() }, false)?;
        let tu = tps(&untracked);
        f.set("tokens_per_s_offloaded_event_tracking_off", tu);
        f.set("event_tracking_off_vs_on", tu / to);
        f.note(format!("event tracking off: {tu:.0} tokens/s, {:.3} × with it on", tu / to));
    } else {
        f.note(format!("event tracking off: not run ({:.0} s left, the run takes ~{offloaded_s:.0} s)", ctx.left_s()));
    }
    let split = |r: &RunOut| {
        let s = &r.stats[WARMUP..];
        let m = |g: &dyn Fn(&StepStats) -> f64| median(&s.iter().map(g).collect::<Vec<_>>());
        json!({
            "step_s": m(&|x| x.figures.step_s), "forward_s": m(&|x| x.forward.wall_s),
            "stall_transfer_s": m(&|x| x.figures.stall_transfer_s), "stall_optimizer_s": m(&|x| x.figures.stall_optimizer_s),
            "h2d_bytes": m(&|x| x.figures.h2d_bytes as f64), "d2h_bytes": m(&|x| x.figures.d2h_bytes as f64),
        })
    };
    f.set("split_resident", split(&resident));
    f.set("split_offloaded", split(&offloaded));
    let mut failures = Vec::new();
    let resident_line = gpu_figures(ctx, &resident, WARMUP, f, "resident", &mut failures);
    let offloaded_line = gpu_figures(ctx, &offloaded, WARMUP, f, "offloaded", &mut failures);
    f.note(format!("resident: {resident_line}"));
    f.note(format!("offloaded: {offloaded_line}"));
    ctx.finish_trace();
    match ctx.trace.as_deref().map(|t| oogc_bench::timeline::parse(t, 3)) {
        Some(Ok(tl)) => f.set("trace", tl.summary()),
        Some(Err(e)) => f.note(format!("trace not read: {e}")),
        None => f.note("no trace"),
    }
    f.summary(format!(
        "{:.2} B params, budget {:.0} % of params+state: {to:.0} vs resident {tr:.0} tokens/s ({ratio:.2} ×; target ≥ 0.9 ×)",
        params as f64 / 1e9,
        100.0 * offloaded_budget as f64 / state_bytes as f64
    ));
    if ratio < 0.9 {
        failures.push(format!("offloaded {ratio:.2} × resident, below the 0.9 × target"));
    }
    Ok(verdict(failures))
}

/// A skip when a run needs more than 90 % of this machine's memory (`host_bytes`).
fn host_memory_skip(host_bytes: u64) -> Option<Verdict> {
    (host_bytes > memory_bytes() * 9 / 10).then(|| {
        Verdict::Skip(format!("host memory: the run needs {host_bytes} bytes, this machine has {}", memory_bytes()))
    })
}

/// The 8 B config of `configs/llama-8b-h100.toml`: in the dist bundle's data (`data/configs/`),
/// else the repository's (known at build time).
fn llama_8b_config(ctx: &Ctx) -> PathBuf {
    let in_data = ctx.shared.join("configs/llama-8b-h100.toml");
    if in_data.exists() {
        return in_data;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/llama-8b-h100.toml")
}

/// Check 11: `configs/llama-8b-h100.toml` (Llama-3-8B's shape, bf16, `[budgets] gpu = "20GiB"`,
/// parameters' home on NVMe, master weights and Adam state in host memory) a few steps on the
/// GPU, its data and NVMe files moved to this run's directories: tokens/s, MFU, the device
/// pool's peak against the plan, H2D GB/s against the copy stream's peak.
pub(crate) fn llama_8b(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let Some(ordinal) = ctx.cuda_ordinal() else {
        return Ok(Verdict::Skip("needs CUDA (an 8 B-parameter model)".into()));
    };
    if let Some(why) = probe(ctx) {
        return Ok(Verdict::Fail(why));
    }
    let path = llama_8b_config(ctx);
    let mut cfg = TrainConfig::load(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    cfg.data.path = ctx.text();
    cfg.data.tokenizer = Some(ctx.tokenizer());
    cfg.data.cache_dir = Some(ctx.work_root.join("tokens"));
    cfg.budgets.nvme_dirs = vec![ctx.work.join("nvme")];
    cfg.device.kind = oogc::config::DeviceKind::Cuda(ordinal);
    cfg.train.eval_interval = 0;
    cfg.checkpoint.dir = None;
    let host = cfg.budgets.host.as_u64() + (8 << 30);
    f.set("config", path.display().to_string());
    f.set("host_budget_bytes", cfg.budgets.host.as_u64());
    if let Some(skip) = host_memory_skip(host) {
        return Ok(skip);
    }
    let started = std::time::Instant::now();
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single())?;
    f.set("setup_s", started.elapsed().as_secs_f64());
    f.set("params", t.num_params());
    let out = run_trainer(&mut t, &cfg, 3, false)?;
    f.set("losses", &out.losses);
    f.set("step_s", out.stats.iter().map(|s| s.figures.step_s).collect::<Vec<_>>());
    let mut failures = Vec::new();
    let line = gpu_figures(ctx, &out, 1, f, "run", &mut failures);
    f.summary(format!("{:.2} B params, GPU budget 20 GiB: {line}", out.params as f64 / 1e9));
    if out.losses.iter().any(|l| !l.is_finite()) {
        failures.push(format!("a loss is not finite: {:?}", out.losses));
    }
    Ok(verdict(failures))
}
