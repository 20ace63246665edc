//! `oogc plan`: memory per tier, the minimum GPU budget and the predicted step time of a GPT
//! under budgets (the library part is [`oogc_prefetch::plan`]), and `oogc plan --hardware-probe`,
//! which measures this machine's figures into a [`HardwareProfile`].
//!
//! | piece | what it does |
//! |---|---|
//! | [`GptShape`], [`gpt_units`] | the units of a byte-level GPT and their sizes (a small pure function) |
//! | [`plan_gpt`] | [`oogc_prefetch::plan::plan`] over those units |
//! | [`probe`] | STREAM triad, NVMe store write/read on a directory, a scalar fp32 Adam loop |
//!
//! The `--config run.toml` input comes with the trainer (issue 5); until then the model is given
//! by `--layers --d-model --seq-len --batch`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use oogc_prefetch::plan::{plan, ModelUnit, PlanInput, PlanReport, StatePlacement};
use oogc_prefetch::{HardwareProfile, PrefetchConfig};
use oogc_swapper::{EngineChoice, NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig};
use serde::Serialize;

/// Byte-level vocabulary of the reference GPT.
pub const VOCAB: u64 = 256;

/// The shape of a GPT for planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GptShape {
    /// Transformer blocks.
    pub layers: u64,
    /// Model width `d`.
    pub d_model: u64,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Sequences per step.
    pub batch: u64,
    /// Bytes per element of the compute copy (2 for bf16, 4 for f32).
    pub dtype_bytes: u64,
}

/// The units of a byte-level GPT (vocabulary [`VOCAB`]) in forward order, with parameter counts:
///
/// | unit | parameters |
/// |---|---|
/// | `embedding` | token `256·d` + position `seq·d` |
/// | `block.i` | `12d² + 13d`: ln1 `2d`, qkv `3d² + 3d`, proj `d² + d`, ln2 `2d`, fc `4d² + 4d`, fc2 `4d² + d` |
/// | `head` | final LayerNorm `2d` + untied output `256·d + 256` |
///
/// Forward FLOPs per step are `2 · params · tokens` for the matmuls, plus `4 · seq · d · tokens`
/// for a block's attention scores and weighted sum (causal masking not halved); the embedding
/// is a gather (0). Approximate, documented: good to the ~10% a plan needs.
pub fn gpt_units(s: &GptShape) -> Vec<ModelUnit> {
    let d = s.d_model;
    let tokens = (s.seq_len * s.batch) as f64;
    let unit = |name: String, numel: u64, flops: f64| ModelUnit {
        name,
        numel,
        compute_bytes: numel * s.dtype_bytes,
        forward_flops: flops,
    };
    let mut units = Vec::with_capacity(s.layers as usize + 2);
    units.push(unit("embedding".into(), VOCAB * d + s.seq_len * d, 0.0));
    let block = 12 * d * d + 13 * d;
    for i in 0..s.layers {
        let flops = 2.0 * block as f64 * tokens + 4.0 * (s.seq_len * d) as f64 * tokens;
        units.push(unit(format!("block.{i}"), block, flops));
    }
    let head = 2 * d + VOCAB * d + VOCAB;
    units.push(unit("head".into(), head, 2.0 * (VOCAB * d) as f64 * tokens));
    units
}

/// What `oogc plan` plans.
#[derive(Debug, Clone)]
pub struct PlanArgs {
    /// The model.
    pub shape: GptShape,
    /// GPU bytes for unit copies.
    pub gpu_budget_bytes: u64,
    /// Host bytes, if limited.
    pub host_budget_bytes: Option<u64>,
    /// Optimizer state placement.
    pub optimizer_state: StatePlacement,
    /// Prefetch depth, units.
    pub max_depth: usize,
    /// The machine.
    pub hardware: HardwareProfile,
    /// Build the Perfetto trace of the simulated step.
    pub trace: bool,
}

/// The plan of an `oogc train` config: its model (f32 compute copies, as on the sim device),
/// batch, GPU and host budgets, state tier and prefetch depth. On the sim device with a throttled
/// link (`[device] link_gbps > 0`) the link replaces the profile's H2D/D2H bandwidth, since that
/// is the link the run will have.
pub fn plan_args_for_config(cfg: &crate::config::TrainConfig, hardware: &HardwareProfile, trace: bool) -> PlanArgs {
    let mut hardware = hardware.clone();
    if cfg.device.kind == "sim" && cfg.device.link_gbps > 0.0 {
        hardware.h2d_gbps = cfg.device.link_gbps;
        hardware.d2h_gbps = cfg.device.link_gbps;
    }
    PlanArgs {
        shape: GptShape {
            layers: cfg.model.n_layer as u64,
            d_model: cfg.model.d_model as u64,
            seq_len: cfg.train.seq_len as u64,
            batch: cfg.train.batch_size as u64,
            dtype_bytes: 4,
        },
        gpu_budget_bytes: cfg.budgets.gpu.as_u64(),
        host_budget_bytes: Some(cfg.budgets.host.as_u64()),
        optimizer_state: match cfg.budgets.optimizer_state {
            crate::config::StateTier::Host => oogc_prefetch::plan::StatePlacement::Host,
            crate::config::StateTier::Nvme => oogc_prefetch::plan::StatePlacement::Nvme,
        },
        max_depth: cfg.prefetch.depth.max(1),
        hardware,
        trace,
    }
}

/// Plans a GPT: [`gpt_units`] then [`oogc_prefetch::plan::plan`].
///
/// # Errors
/// The planner's errors (a GPU budget below the minimum names the minimum in bytes).
pub fn plan_gpt(args: &PlanArgs) -> anyhow::Result<PlanReport> {
    if args.shape.layers == 0 || args.shape.d_model == 0 || args.shape.seq_len == 0 || args.shape.batch == 0 {
        bail!("--layers, --d-model, --seq-len and --batch must be > 0");
    }
    let input = PlanInput {
        units: gpt_units(&args.shape),
        gpu_budget_bytes: args.gpu_budget_bytes,
        host_budget_bytes: args.host_budget_bytes,
        optimizer_state: args.optimizer_state,
        prefetch: PrefetchConfig { max_depth: args.max_depth, ..PrefetchConfig::default() },
        steps: 3,
        trace: args.trace,
    };
    plan(&input, &args.hardware).context("planning the step")
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Prints a plan as a human-readable table.
pub fn print_plan(args: &PlanArgs, r: &PlanReport) {
    let s = &args.shape;
    println!(
        "model: GPT byte-vocab, {} layers, d_model {}, seq {} x batch {}: {} units, {:.1} M params, compute copies {}",
        s.layers,
        s.d_model,
        s.seq_len,
        s.batch,
        r.units,
        r.params as f64 / 1e6,
        gib(r.model_bytes)
    );
    println!("hardware: {}", args.hardware.source);
    println!();
    println!("{:<10} {:>14} {:>16}  note", "tier", "peak bytes", "GiB");
    println!(
        "{:<10} {:>14} {:>16}  budget {} (minimum {} B; all units resident at {} B)",
        "gpu",
        r.memory.device_bytes,
        gib(r.memory.device_bytes),
        args.gpu_budget_bytes,
        r.min_gpu_budget_bytes,
        r.full_gpu_budget_bytes
    );
    println!(
        "{:<10} {:>14} {:>16}  compute copies + {} + gradients in flight",
        "host",
        r.memory.host_bytes,
        gib(r.memory.host_bytes),
        if r.optimizer_state_on_nvme { "NVMe staging" } else { "optimizer state (12 B/param)" }
    );
    println!(
        "{:<10} {:>14} {:>16}  {}",
        "nvme",
        r.memory.nvme_bytes,
        gib(r.memory.nvme_bytes),
        if r.optimizer_state_on_nvme { "optimizer state (12 B/param)" } else { "-" }
    );
    println!();
    let pct = |x: f64| 100.0 * x / r.step_s.max(1e-12);
    println!(
        "predicted step: {:.4} s (lower bound {:.4} s, {:.2}x)",
        r.step_s,
        r.lower_bound_s,
        r.step_s / r.lower_bound_s.max(1e-12)
    );
    println!("  compute            {:>10.4} s  {:>5.1}%", r.compute_s, pct(r.compute_s));
    println!("  exposed transfer   {:>10.4} s  {:>5.1}%", r.exposed_transfer_s, pct(r.exposed_transfer_s));
    println!("  exposed optimizer  {:>10.4} s  {:>5.1}%", r.exposed_optimizer_s, pct(r.exposed_optimizer_s));
    let lb = &r.sim.link_bytes;
    println!("  bytes per step: h2d {} d2h {} nvme read {} nvme write {}", lb.h2d, lb.d2h, lb.nvme_read, lb.nvme_write);
    for w in &r.warnings {
        println!("warning: {w}");
    }
}

/// What the hardware probe measures.
#[derive(Debug, Clone)]
pub struct ProbeArgs {
    /// Directory for the NVMe store's file (a temporary directory under it is removed after).
    pub dir: PathBuf,
    /// Bytes written then read through the store.
    pub nvme_bytes: u64,
    /// Elements per array of the triad (f64; three arrays).
    pub triad_elems: usize,
    /// Parameters of the Adam loop.
    pub adam_params: usize,
}

impl Default for ProbeArgs {
    fn default() -> Self {
        Self { dir: std::env::temp_dir(), nvme_bytes: 64 << 20, triad_elems: 2 << 20, adam_params: 1 << 20 }
    }
}

/// STREAM triad `a = b + s·c` over f64 arrays, best of 5, GB/s (24 B per element).
pub fn triad_gbps(n: usize) -> f64 {
    let b = vec![1.0f64; n];
    let c = vec![2.0f64; n];
    let mut a = vec![0.0f64; n];
    let mut best = f64::INFINITY;
    for k in 0..5 {
        let s = 3.0 + k as f64;
        let t = Instant::now();
        for ((a, b), c) in a.iter_mut().zip(&b).zip(&c) {
            *a = b + s * c;
        }
        std::hint::black_box(&a);
        best = best.min(t.elapsed().as_secs_f64());
    }
    24.0 * n as f64 / best * 1e-9
}

/// A scalar fp32 AdamW loop on one thread (the optimizer crate's SIMD, threaded step is faster),
/// best of 3, parameters per second.
pub fn adam_params_per_s(n: usize) -> f64 {
    let (lr, b1, b2, eps, wd) = (1e-3f32, 0.9f32, 0.999f32, 1e-8f32, 0.01f32);
    let mut p = vec![0.5f32; n];
    let g = vec![0.01f32; n];
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    let mut best = f64::INFINITY;
    for step in 1..=3 {
        let bc1 = 1.0 - b1.powi(step);
        let bc2 = 1.0 - b2.powi(step);
        let t = Instant::now();
        for i in 0..n {
            let gi = g[i];
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + wd * p[i];
            p[i] -= lr * update;
        }
        std::hint::black_box(&p);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best
}

/// NVMe store write then read of `bytes` in 8 MiB tensors (4 in flight), GB/s each way.
///
/// # Errors
/// The store's errors (a missing or full directory names the fix).
pub fn nvme_gbps(dir: &std::path::Path, bytes: u64) -> anyhow::Result<(f64, f64, String)> {
    let tensor = 8usize << 20;
    let n = (bytes as usize / tensor).max(1);
    let sub = dir.join(format!("oogc-probe-{}", std::process::id()));
    std::fs::create_dir_all(&sub).with_context(|| format!("creating {} (check --probe-dir)", sub.display()))?;
    let result = (|| -> anyhow::Result<(f64, f64, String)> {
        let store = NvmeStore::open(NvmeConfig {
            engine: EngineChoice::Auto,
            ..NvmeConfig::new(vec![sub.clone()], (n * tensor) as u64 + (4 << 20))
        })?;
        let pool = PinnedPool::with_mmap(&PinnedPoolConfig {
            budget_bytes: (5 * oogc_swapper::host::size_class(tensor)) as u64,
            lock: false,
        });
        let mut bufs: Vec<_> = (0..4).map(|_| pool.alloc(tensor)).collect::<Result<_, _>>()?;
        for (i, b) in bufs.iter_mut().enumerate() {
            b.as_mut_slice().iter_mut().enumerate().for_each(|(j, x)| *x = (i + j / 4096) as u8);
        }
        let (extents, write_s, read_s) = crate::bench::nvme::write_then_read(&store, &mut bufs, n)?;
        let note = format!("{} engine, {} MiB", store.engine_kind(), (n * tensor) >> 20);
        for e in extents {
            store.free(e);
        }
        let total = (n * tensor) as f64;
        Ok((total / write_s * 1e-9, total / read_s * 1e-9, note))
    })();
    let _ = std::fs::remove_dir_all(&sub);
    result
}

/// Measures this machine: host memory bandwidth (triad), NVMe read/write through the store,
/// the CPU Adam rate. H2D/D2H and the device's GFLOP/s keep their defaults (no GPU is measured
/// here; edit the file on a GPU machine).
///
/// # Errors
/// NVMe store errors (directory missing, no room).
pub fn probe(args: &ProbeArgs) -> anyhow::Result<HardwareProfile> {
    let mem = triad_gbps(args.triad_elems);
    let (w, r, note) = nvme_gbps(&args.dir, args.nvme_bytes).context("probing NVMe through the store")?;
    let adam = adam_params_per_s(args.adam_params);
    Ok(HardwareProfile {
        nvme_read_gbps: r,
        nvme_write_gbps: w,
        cpu_adam_params_per_s: adam,
        host_memory_gbps: mem,
        source: format!(
            "oogc plan --hardware-probe: triad {} elements, NVMe store in {} ({note}), scalar Adam on 1 thread \
             ({} params); h2d/d2h/device_gflops are defaults",
            args.triad_elems,
            args.dir.display(),
            args.adam_params
        ),
        ..HardwareProfile::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_units_match_the_formula() {
        let s = GptShape { layers: 2, d_model: 64, seq_len: 32, batch: 4, dtype_bytes: 2 };
        let u = gpt_units(&s);
        assert_eq!(u.len(), 4);
        assert_eq!(u[0].numel, 256 * 64 + 32 * 64);
        assert_eq!(u[1].numel, 12 * 64 * 64 + 13 * 64);
        assert_eq!(u[3].numel, 2 * 64 + 256 * 64 + 256);
        assert_eq!(u[1].compute_bytes, 2 * u[1].numel);
    }
}
