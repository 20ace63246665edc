//! The machine's figures for the planner: the compute probe behind `oogc plan --probe-compute`
//! (candle's forward and backward of one block of the model on this CPU, the sim device, or with
//! `--device cuda:N` on that GPU: `device_gflops` and `backward_flops_ratio`) and the hardware probe behind `oogc plan
//! --hardware-probe` (STREAM triad, the NVMe store's write and read on a directory, a scalar fp32
//! Adam loop, and the compute probe) into a [`HardwareProfile`].
//!
//! [`ComputeShape::block_forward_flops`] counts FLOPs with the planner's formulas
//! ([`oogc::plan`]), so the probed GFLOP/s is the rate that turns the planner's FLOPs into the
//! sim device's seconds.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{Device, Tensor};
use oogc::config::TrainConfig;
use std::sync::Arc;

use oogc::models::{init_unit_from_seed, CausalLm, Gpt, GptConfig, UnitKind};
use oogc_prefetch::HardwareProfile;
use oogc_swapper::{EngineChoice, NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig};
use serde::Serialize;

use crate::error::{Context, Error, Result};
use crate::swap::BenchDevice;

/// The shape the compute probe times: the first block of `model` (its trunk and experts for
/// MoE) over a batch of `batch` sequences of `seq_len` tokens, on `threads` CPU threads (or on a
/// CUDA GPU: `device`).
#[derive(Debug, Clone)]
pub struct ComputeShape {
    /// The model (only its embedding and first block get parameters).
    pub model: Arc<dyn CausalLm>,
    /// Its family, for the description (`gpt`, `llama`, ...).
    pub family: String,
    /// Experts per token (MoE; 1 for a dense model).
    pub top_k: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per step.
    pub batch: usize,
    /// candle's CPU compute threads (the sim device's; [`oogc::run::compute_threads`]).
    pub threads: usize,
    /// Where candle runs the block: [`BenchDevice::Sim`] (the CPU, the default) or
    /// [`BenchDevice::Cuda`] (`candle_core::Device::new_cuda`; needs the `cuda` feature).
    pub device: BenchDevice,
}

impl ComputeShape {
    /// The shape of an `oogc train` config: its model (as the trainer builds it), `train.seq_len`,
    /// `train.batch_size`, `[threads] compute`.
    ///
    /// # Errors
    /// The config's model cannot be built (tokenizer.json, Hugging Face checkpoint, dimensions).
    pub fn for_config(cfg: &TrainConfig) -> Result<Self> {
        let model = oogc::train::build_model(cfg, oogc::train::vocab_size(cfg)?)?;
        Ok(Self {
            model,
            family: cfg.model.family().into(),
            top_k: cfg.model.moe().map_or(1, |m| m.top_k),
            seq_len: cfg.train.seq_len,
            batch: cfg.train.batch_size,
            threads: oogc::run::compute_threads(cfg),
            device: BenchDevice::Sim,
        })
    }

    /// The main example job's block (`configs/tinyshakespeare.toml`): the byte-level GPT, dense,
    /// `d_model` 192, 6 heads, MLP 768, 16 sequences of 128 tokens, all cores. What `oogc plan
    /// --hardware-probe` times without `--config`.
    pub fn representative() -> Self {
        let gpt = GptConfig { d_model: 192, n_head: 6, n_layer: 1, max_seq_len: 128, ..GptConfig::default() };
        Self {
            model: Arc::new(Gpt::new(gpt).expect("a valid GPT")),
            family: "gpt".into(),
            top_k: 1,
            seq_len: 128,
            batch: 16,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            device: BenchDevice::Sim,
        }
    }

    /// The probed block: its unit (dense block or MoE trunk) and its experts' units.
    fn block(&self) -> Result<(usize, Vec<usize>)> {
        let units = self.model.units();
        let block = units
            .iter()
            .position(|u| matches!(u.kind, UnitKind::Block(0) | UnitKind::MoeTrunk(0)))
            .ok_or(Error::Internal { what: "a model with a first block" })?;
        let experts =
            (0..units.len()).filter(|&k| matches!(units[k].kind, UnitKind::Expert { block: 0, .. })).collect();
        Ok((block, experts))
    }

    /// Forward FLOPs of the probed block under the planner's FLOP model
    /// ([`CausalLm::forward_flops`]): a dense block, or an MoE trunk plus `top_k` experts' worth
    /// of tokens.
    pub fn block_forward_flops(&self) -> f64 {
        let tokens = self.seq_len * self.batch;
        let Ok((block, experts)) = self.block() else { return 0.0 };
        let trunk = self.model.forward_flops(block, tokens, self.seq_len);
        match experts.first() {
            None => trunk,
            Some(&e) => trunk + self.model.forward_flops(e, tokens * self.top_k, self.seq_len),
        }
    }

    /// `gpt: dense block of 443,328 params, seq 128 x batch 16, 2 threads` (or `MoE block ...,
    /// 8 experts top-2`; `..., on cuda:0` on a GPU).
    pub fn describe(&self) -> String {
        let Ok((block, experts)) = self.block() else { return format!("{}: no block", self.family) };
        let params = self.model.units()[block].numel;
        let kind = if experts.is_empty() {
            format!("dense block of {params} params")
        } else {
            let e = self.model.units()[experts[0]].numel;
            format!("MoE block of {params} params, {} experts top-{} of {e} params", experts.len(), self.top_k)
        };
        let on = match self.device {
            BenchDevice::Sim => String::new(),
            d @ BenchDevice::Cuda(_) => format!(", on {d}"),
        };
        format!("{}: {kind}, seq {} x batch {}, {} threads{on}", self.family, self.seq_len, self.batch, self.threads)
    }
}

/// What [`probe_compute`] measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComputeProbe {
    /// The probed shape ([`ComputeShape::describe`]).
    pub shape: String,
    /// candle's CPU threads.
    pub threads: usize,
    /// Timed repetitions (after one warm-up).
    pub reps: usize,
    /// Median forward of the block, seconds.
    pub forward_s: f64,
    /// Median backward of the block (recompute + VJP, gradients copied out), seconds.
    pub backward_s: f64,
    /// The block's forward FLOPs under the planner's model ([`ComputeShape::block_forward_flops`]).
    pub forward_flops: f64,
    /// `forward_flops / forward_s`, GFLOP/s: the planner's [`HardwareProfile::device_gflops`].
    pub device_gflops: f64,
    /// `backward_s / forward_s`: the planner's [`HardwareProfile::backward_flops_ratio`].
    pub backward_flops_ratio: f64,
    /// Wall time of the whole probe (model set-up and warm-up included), seconds.
    pub wall_s: f64,
}

impl ComputeProbe {
    /// Two probes of the same shape as one: the mean of their forward and backward times (the
    /// rates follow), the repetitions and wall times added.
    pub fn mean(a: &ComputeProbe, b: &ComputeProbe) -> ComputeProbe {
        let forward_s = 0.5 * (a.forward_s + b.forward_s);
        let backward_s = 0.5 * (a.backward_s + b.backward_s);
        ComputeProbe {
            reps: a.reps + b.reps,
            forward_s,
            backward_s,
            device_gflops: a.forward_flops / forward_s.max(1e-12) * 1e-9,
            backward_flops_ratio: backward_s / forward_s.max(1e-12),
            wall_s: a.wall_s + b.wall_s,
            ..a.clone()
        }
    }

    /// Puts the measured compute figures into `hw` and says so in its `source`.
    pub fn apply(&self, hw: &mut HardwareProfile) {
        hw.device_gflops = self.device_gflops;
        hw.backward_flops_ratio = self.backward_flops_ratio;
        hw.source = format!(
            "{}; compute probed ({}): {:.1} GFLOP/s, backward {:.2} x forward",
            hw.source, self.shape, self.device_gflops, self.backward_flops_ratio
        );
    }
}

/// Runs `f` where candle's CPU compute gets `threads` threads (its matmuls and the fused
/// kernels run on the current rayon pool): on the calling thread when the current pool has that
/// many threads (as `oogc train` runs a step: the global pool sized by
/// [`oogc::run::size_compute_threads`], used from the main thread), else inside a dedicated
/// pool of `threads` threads (`ThreadPool::install`: `f` runs on one of its workers, which
/// spares the wake-up of the pool's threads at every parallel op — small ops run faster there
/// than from outside the pool, so figures taken that way may beat `oogc train`'s).
///
/// Asking for the current pool's size builds the global pool (default size) if nothing has yet:
/// call [`oogc::run::size_compute_threads`] first where that matters.
///
/// # Errors
/// When the dedicated pool cannot be built.
pub fn with_compute_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    if rayon::current_num_threads() == threads.max(1) {
        return Ok(f());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("oogc-compute-{i}"))
        .build()
        .map_err(|source| Error::ThreadPool { what: "building the compute thread pool", source })?;
    Ok(pool.install(f))
}

/// Times candle's forward and backward of one block of `shape` on the CPU (the sim device's
/// compute) on `shape.threads` threads, or on the CUDA GPU `shape.device` names (the device
/// synchronised before each time is read), the way the trainer calls them: the dense block's
/// [`Gpt::forward`] and [`Gpt::backward`] (recompute + VJP), or the MoE block's trunk, routed
/// experts and combine, and their backward as `Trainer::train_step` runs it; gradients copied
/// out to host vectors as the trainer pushes them. Input: the embedding of pseudo-random bytes.
/// One warm-up, then repetitions until 9, or 3 and 1 s, or 3 s (so at least one); the
/// medians. About 1 s for the example configs' blocks.
///
/// # Errors
/// A shape the model refuses (heads not dividing the width, ...); candle failures; a pool that
/// cannot be built; on CUDA, candle's `NotCompiledWithCudaSupport` without the `cuda` feature or
/// its driver error without a GPU.
pub fn probe_compute(shape: &ComputeShape) -> Result<ComputeProbe> {
    with_compute_threads(shape.threads, || probe_compute_on_current_pool(shape))?
}

/// [`probe_compute`] on the current rayon pool (the caller sized it).
pub(crate) fn probe_compute_on_current_pool(shape: &ComputeShape) -> Result<ComputeProbe> {
    let started = Instant::now();
    let model = &*shape.model;
    let (block, experts) = shape.block()?;
    let dev = match shape.device {
        BenchDevice::Sim => Device::Cpu,
        BenchDevice::Cuda(n) => {
            Device::new_cuda(n).with_context(|| format!("opening cuda:{n} for the compute probe"))?
        }
    };
    let tensor = |unit: usize| {
        let flat = init_unit_from_seed(&model.units()[unit], 1);
        Tensor::from_slice(&flat, flat.len(), &dev)
    };
    let (b, t) = (shape.batch.max(1), shape.seq_len.max(1));
    let vocab = model.vocab_size() as u64;
    let ids: Vec<u32> = (0..b * t).map(|i| (((i as u64 * 2_654_435_761) >> 11) % vocab) as u32).collect();
    let tokens = Tensor::from_slice(&ids, (b, t), &dev)?;
    let x = model.forward(0, &tensor(0)?, &tokens, None)?;
    let grad_y = x.affine(1e-2, 0.0)?;
    let p_block = tensor(block)?;
    let p_experts: Vec<Tensor> = experts.iter().map(|&e| tensor(e)).collect::<Result<_, _>>()?;
    let moe = model.moe().filter(|_| !experts.is_empty());
    let forward = || -> Result<()> {
        let Some(moe) = moe else {
            std::hint::black_box(model.forward(block, &p_block, &x, None)?);
            return Ok(());
        };
        let tr = moe.trunk_forward(0, &p_block, &x)?;
        let mut outs: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        for (e, (out, p)) in outs.iter_mut().zip(&p_experts).enumerate() {
            if let Some(h_e) = tr.routing.expert_input(e, &tr.h)? {
                *out = Some(moe.expert_forward(p, &h_e)?);
            }
        }
        std::hint::black_box(moe.combine(&tr.x1, &tr.routing, &outs)?);
        Ok(())
    };
    let backward = || -> Result<()> {
        let Some(moe) = moe else {
            let g = model.backward(block, &p_block, &x, &grad_y, None)?;
            std::hint::black_box(g.grad_params.to_vec1::<f32>()?);
            return Ok(());
        };
        let tr = moe.trunk_forward(0, &p_block, &x)?;
        let routing = &tr.routing;
        let mut grad_inputs: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        let mut grad_gates: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        for (e, p) in p_experts.iter().enumerate() {
            let Some(h_e) = routing.expert_input(e, &tr.h)? else { continue };
            let grad_out =
                moe.expert_grad_output(routing, e, &grad_y)?.ok_or(Error::Internal { what: "an active expert" })?;
            let g = moe.expert_backward(p, &h_e, &grad_out)?;
            std::hint::black_box(g.grad_params.to_vec1::<f32>()?);
            grad_gates[e] = moe.expert_grad_gate(routing, e, &grad_y, &g.output)?;
            grad_inputs[e] = Some(g.grad_input);
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs)?;
        let g = moe.trunk_backward(0, &p_block, &x, routing, &grad_y, &grad_h, &grad_gates)?;
        std::hint::black_box(g.grad_params.to_vec1::<f32>()?);
        Ok(())
    };
    forward()?;
    backward()?;
    dev.synchronize()?;
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    let timed = Instant::now();
    loop {
        let t0 = Instant::now();
        forward()?;
        dev.synchronize()?; // CUDA kernels run asynchronously; the CPU's returns at once
        let t1 = Instant::now();
        backward()?;
        dev.synchronize()?;
        fwd.push((t1 - t0).as_secs_f64());
        bwd.push(t1.elapsed().as_secs_f64());
        let elapsed = timed.elapsed().as_secs_f64();
        let n = fwd.len();
        if n >= 9 || (n >= 3 && elapsed >= 1.0) || elapsed >= 3.0 {
            break;
        }
    }
    let reps = fwd.len();
    let median = crate::step::median;
    let (forward_s, backward_s) = (median(fwd).max(1e-9), median(bwd));
    let forward_flops = shape.block_forward_flops();
    Ok(ComputeProbe {
        shape: shape.describe(),
        threads: shape.threads,
        reps,
        forward_s,
        backward_s,
        forward_flops,
        device_gflops: forward_flops / forward_s * 1e-9,
        backward_flops_ratio: backward_s / forward_s,
        wall_s: started.elapsed().as_secs_f64(),
    })
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
    /// The block [`probe_compute`] times; `None`: the compute figures keep their defaults.
    pub compute: Option<ComputeShape>,
}

impl Default for ProbeArgs {
    /// The temp directory, 64 MiB through the store, 2 Mi triad elements, 1 Mi Adam
    /// parameters, [`ComputeShape::representative`].
    fn default() -> Self {
        Self {
            dir: std::env::temp_dir(),
            nvme_bytes: 64 << 20,
            triad_elems: 2 << 20,
            adam_params: 1 << 20,
            compute: Some(ComputeShape::representative()),
        }
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
pub fn nvme_gbps(dir: &std::path::Path, bytes: u64) -> Result<(f64, f64, String)> {
    let tensor = 8usize << 20;
    let n = (bytes as usize / tensor).max(1);
    let sub = dir.join(format!("oogc-probe-{}", std::process::id()));
    std::fs::create_dir_all(&sub).map_err(Error::io("creating", &sub, Some("check --probe-dir")))?;
    let result = (|| -> Result<(f64, f64, String)> {
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
        let (extents, write_s, read_s) = crate::nvme::write_then_read(&store, &mut bufs, n)?;
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
/// the CPU Adam rate and, with [`ProbeArgs::compute`], the sim device's compute rate and
/// backward/forward ratio ([`probe_compute`]). H2D/D2H keep their defaults (no GPU is measured
/// here; edit the file on a GPU machine, where the compute figures must be the GPU's too).
///
/// # Errors
/// NVMe store errors (directory missing, no room); compute probe errors.
pub fn probe(args: &ProbeArgs) -> Result<HardwareProfile> {
    let mem = triad_gbps(args.triad_elems);
    let (w, r, note) = nvme_gbps(&args.dir, args.nvme_bytes).context("probing NVMe through the store")?;
    let adam = adam_params_per_s(args.adam_params);
    let compute = args.compute.as_ref().map(probe_compute).transpose().context("probing compute")?;
    let mut profile = HardwareProfile {
        nvme_read_gbps: r,
        nvme_write_gbps: w,
        cpu_adam_params_per_s: adam,
        host_memory_gbps: mem,
        source: format!(
            "oogc plan --hardware-probe: triad {} elements, NVMe store in {} ({note}), scalar Adam on 1 thread \
             ({} params); h2d/d2h are defaults{}",
            args.triad_elems,
            args.dir.display(),
            args.adam_params,
            if compute.is_some() { "" } else { ", device_gflops and backward_flops_ratio too" }
        ),
        ..HardwareProfile::default()
    };
    if let Some(c) = &compute {
        c.apply(&mut profile);
    }
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use oogc::plan::{gpt_units, model_units, FeedForward, GptShape, MoePlan};
    use oogc_moe_placement::Placement;

    fn tiny_shape(moe: bool) -> ComputeShape {
        let gpt = GptConfig {
            d_model: 32,
            n_head: 2,
            n_layer: 1,
            max_seq_len: 16,
            moe: moe.then(|| oogc::models::MoeConfig { experts: 4, top_k: 2, ..Default::default() }),
            ..GptConfig::default()
        };
        ComputeShape {
            model: Arc::new(Gpt::new(gpt).unwrap()),
            family: "gpt".into(),
            top_k: if moe { 2 } else { 1 },
            seq_len: 16,
            batch: 2,
            threads: 1,
            device: BenchDevice::Sim,
        }
    }

    #[test]
    fn the_probe_counts_flops_as_the_planners_gpt_formulas_do() {
        let shape = tiny_shape(false);
        let s = GptShape { layers: 1, d_model: 32, seq_len: 16, batch: 2, dtype_bytes: 4 };
        let units = gpt_units(&s);
        assert_eq!(shape.block_forward_flops(), units[1].forward_flops);
        let moe = tiny_shape(true);
        let ff = FeedForward::Moe(MoePlan {
            experts: 4,
            top_k: 2,
            d_expert: 128,
            placements: vec![vec![Placement::Cpu; 4]],
        });
        let units = model_units(&s, &ff).unwrap();
        let block: f64 = units[1..units.len() - 1].iter().map(|u| u.forward_flops).sum();
        assert!((moe.block_forward_flops() - block).abs() < 1e-6 * block);
    }

    #[test]
    fn the_compute_probe_measures_a_rate_and_a_ratio() {
        for moe in [false, true] {
            let c = probe_compute(&tiny_shape(moe)).unwrap();
            assert!(c.reps >= 1 && c.forward_s > 0.0 && c.backward_s > 0.0, "{c:?}");
            assert!(c.device_gflops.is_finite() && c.device_gflops > 0.0, "{c:?}");
            assert!(c.backward_flops_ratio.is_finite() && c.backward_flops_ratio > 0.0, "{c:?}");
            assert!(c.shape.contains(if moe { "MoE" } else { "dense" }), "{c:?}");
            let mut hw = HardwareProfile::default();
            c.apply(&mut hw);
            assert_eq!((hw.device_gflops, hw.backward_flops_ratio), (c.device_gflops, c.backward_flops_ratio));
            hw.validate().unwrap();
            let twice = ComputeProbe { forward_s: 2.0 * c.forward_s, ..c.clone() };
            let m = ComputeProbe::mean(&c, &twice);
            assert!((m.forward_s - 1.5 * c.forward_s).abs() < 1e-15 && m.reps == 2 * c.reps, "{m:?}");
            assert!((m.device_gflops - c.device_gflops / 1.5).abs() < 1e-9 * c.device_gflops, "{m:?}");
        }
    }
}
