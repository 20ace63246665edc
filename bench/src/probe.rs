//! The machine's figures for the planner: the compute probe behind `oogc plan --probe-compute`
//! (candle's forward and backward of one block of the model in the config's compute dtype on
//! this CPU, the sim device, or with `--device cuda:N` on that GPU: `device_gflops` and
//! `backward_flops_ratio`), the hardware probe behind `oogc plan --hardware-probe` (STREAM
//! triad, the NVMe store's write and read on a directory, a scalar fp32 Adam loop, and the
//! compute probe), and the GPU probe behind `oogc bench probe --device cuda:N` ([`gpu_profile`]:
//! bf16 and f32 matrix-product TFLOP/s on candle's stream, H2D and D2H GB/s on the swapper's copy
//! stream, the GPU's name and memory) into a [`HardwareProfile`].
//!
//! On CUDA every timed region ends with a synchronisation of candle's stream and holds no
//! device-to-host copy (a read-back would serialise the stream and time the copy too).
//!
//! [`ComputeShape::block_forward_flops`] counts FLOPs with the planner's formulas
//! ([`oogc::plan`]), so the probed GFLOP/s is the rate that turns the planner's FLOPs into the
//! sim device's seconds.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
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
    /// [`BenchDevice::Cuda`] (`candle_core::Device::new_cuda_with_stream`, a stream of candle's
    /// own as the runtime opens it; needs the `cuda` feature).
    pub device: BenchDevice,
    /// The dtype the block computes in: the config's compute dtype (`[train] compute_dtype`),
    /// f32 for [`ComputeShape::representative`].
    pub dtype: DType,
}

impl ComputeShape {
    /// The shape of an `oogc train` config: its model (as the trainer builds it), `train.seq_len`,
    /// `train.batch_size`, `[threads] compute`, `[train] compute_dtype`.
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
            dtype: oogc::runtime::tensor::candle_dtype(cfg.train.compute_dtype.dtype())
                .map_err(oogc::train::TrainError::from)?,
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
            dtype: DType::F32,
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
        let dtype = if self.dtype == DType::F32 { String::new() } else { format!(", {:?}", self.dtype).to_lowercase() };
        format!(
            "{}: {kind}, seq {} x batch {}, {} threads{dtype}{on}",
            self.family, self.seq_len, self.batch, self.threads
        )
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

/// Times candle's forward and backward of one block of `shape` in `shape.dtype` on the CPU (the
/// sim device's compute) on `shape.threads` threads, or on the CUDA GPU `shape.device` names (on
/// a stream of candle's own, synchronised before each time is read; nothing is read back inside
/// a timed region), the way the trainer calls them: the dense block's [`CausalLm::forward`] and
/// [`CausalLm::backward`] (recompute + VJP), or the MoE block's trunk, routed experts and combine, and
/// their backward as `Trainer::train_step` runs it; on the CPU the gradients are copied out to
/// host vectors as the trainer pushes them (on a GPU the push is a D2H on the copy stream, beside
/// compute, so it is not timed). Input: the embedding of pseudo-random tokens.
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
            Device::new_cuda_with_stream(n).with_context(|| format!("opening cuda:{n} for the compute probe"))?
        }
    };
    let tensor = |unit: usize| {
        let flat = init_unit_from_seed(&model.units()[unit], 1);
        Tensor::from_slice(&flat, flat.len(), &dev)?.to_dtype(shape.dtype)
    };
    // What the trainer does with a unit's gradients: on the CPU a copy into a host vector; on a
    // GPU nothing inside the timed region (its D2H runs on the copy stream).
    let push = |g: &Tensor| -> Result<()> {
        if dev.is_cpu() {
            copy_out(g)?;
        } else {
            std::hint::black_box(g);
        }
        Ok(())
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
            return push(&g.grad_params);
        };
        let mut tr = moe.trunk_forward(0, &p_block, &x)?;
        // As the trainer does after the forward: a pooled load-balancing loss (Mixtral's family)
        // gives the routing its weights before any backward.
        moe.finish_forward(&mut [&mut tr.routing])?;
        let routing = &tr.routing;
        let mut grad_inputs: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        let mut grad_gates: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        for (e, p) in p_experts.iter().enumerate() {
            let Some(h_e) = routing.expert_input(e, &tr.h)? else { continue };
            let grad_out =
                moe.expert_grad_output(routing, e, &grad_y)?.ok_or(Error::Internal { what: "an active expert" })?;
            let g = moe.expert_backward(p, &h_e, &grad_out)?;
            push(&g.grad_params)?;
            grad_gates[e] = moe.expert_grad_gate(routing, e, &grad_y, &g.output)?;
            grad_inputs[e] = Some(g.grad_input);
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs)?;
        let g = moe.trunk_backward(0, &p_block, &x, routing, &grad_y, &grad_h, &grad_gates)?;
        push(&g.grad_params)
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

/// Copies a tensor's elements into a host vector of its dtype and drops it (the trainer's push
/// on the sim device).
fn copy_out(t: &Tensor) -> Result<()> {
    let t = t.flatten_all()?;
    match t.dtype() {
        DType::BF16 => drop(std::hint::black_box(t.to_vec1::<half::bf16>()?)),
        DType::F16 => drop(std::hint::black_box(t.to_vec1::<half::f16>()?)),
        _ => drop(std::hint::black_box(t.to_dtype(DType::F32)?.to_vec1::<f32>()?)),
    }
    Ok(())
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
    /// A CUDA GPU whose figures ([`gpu_profile`]: matrix-product TFLOP/s, H2D and D2H, name and
    /// memory) join the profile; `None`: no GPU is measured.
    pub gpu: Option<usize>,
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
            gpu: None,
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
/// the CPU Adam rate, with [`ProbeArgs::compute`] the compute rate and backward/forward ratio
/// of a block ([`probe_compute`]), and with [`ProbeArgs::gpu`] the GPU's figures
/// ([`gpu_profile`]: its H2D/D2H replace the defaults). Without a GPU, H2D/D2H keep their
/// defaults.
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
    if let Some(n) = args.gpu {
        let gpu = gpu_profile(n)?;
        profile.source = format!(
            "{}; {}",
            profile.source.replace("h2d/d2h are defaults", "h2d/d2h measured on the GPU"),
            gpu.source.replace("; host figures are defaults", "")
        );
        profile = HardwareProfile {
            h2d_gbps: gpu.h2d_gbps,
            d2h_gbps: gpu.d2h_gbps,
            device_name: gpu.device_name,
            device_memory_bytes: gpu.device_memory_bytes,
            device_bf16_tflops: gpu.device_bf16_tflops,
            device_f32_tflops: gpu.device_f32_tflops,
            ..profile
        };
    }
    Ok(profile)
}

/// What [`gpu_profile_with`] measures on a CUDA GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProbeArgs {
    /// The GPU's ordinal.
    pub ordinal: usize,
    /// Side of the square bf16 matrix product (`n × n × n`). Default: 8192.
    pub bf16_n: usize,
    /// Side of the square f32 matrix product. Default: 4096.
    pub f32_n: usize,
    /// Products run and synchronised before the timing (clocks up, cuBLAS picks its kernels).
    /// Default: 3.
    pub warmups: usize,
    /// Products timed, back to back, between two synchronisations of candle's stream. Default: 10.
    pub reps: usize,
    /// Bytes per H2D and D2H copy. Default: 256 MiB.
    pub copy_bytes: usize,
    /// Timed copies each way. Default: 8.
    pub copy_repeats: usize,
}

impl GpuProbeArgs {
    /// The defaults for GPU `ordinal`: an 8192³ bf16 and a 4096³ f32 product, 3 warm-ups and 10
    /// timed each; 8 copies of 256 MiB each way.
    pub fn new(ordinal: usize) -> Self {
        Self { ordinal, bf16_n: 8192, f32_n: 4096, warmups: 3, reps: 10, copy_bytes: 256 << 20, copy_repeats: 8 }
    }
}

/// The matrix-product rate of `dev` in `dtype`, TFLOP/s (10¹² FLOP/s): `2·n³` FLOPs per
/// product of two `n × n` matrices of normal random values, `warmups` products first, then
/// `reps` products issued back to back between two synchronisations of the device's stream (on
/// a GPU: no read-back in between; each product's output is freed, stream-ordered, as the next
/// is issued).
///
/// # Errors
/// candle failures (out of device memory, a dtype the device does not multiply).
pub fn matmul_tflops(dev: &Device, dtype: DType, n: usize, warmups: usize, reps: usize) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    for _ in 0..warmups {
        std::hint::black_box(a.matmul(&b)?);
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps.max(1) {
        std::hint::black_box(a.matmul(&b)?);
    }
    dev.synchronize()?;
    let s = t.elapsed().as_secs_f64().max(1e-12);
    Ok(2.0 * (n as f64).powi(3) * reps.max(1) as f64 / s * 1e-12)
}

/// [`gpu_profile_with`] with [`GpuProbeArgs::new`]: what `oogc bench probe --device cuda:N`
/// and `oogc gpu-check` write for `oogc plan --profile`.
///
/// # Errors
/// As [`gpu_profile_with`].
pub fn gpu_profile(ordinal: usize) -> Result<HardwareProfile> {
    gpu_profile_with(&GpuProbeArgs::new(ordinal))
}

/// Measures GPU `args.ordinal` for the planner: bf16 and f32 matrix-product TFLOP/s
/// ([`matmul_tflops`] on candle's device opened with its own stream,
/// `Device::new_cuda_with_stream`, as the runtime opens it), H2D and D2H GB/s of the swapper's
/// copies of driver-pinned memory on its copy stream ([`crate::swap::run_cuda`]'s `cuda-htod` and
/// `cuda-dtoh` rows), and the GPU's name and memory (the driver's). The host's figures (NVMe,
/// CPU Adam, memory bandwidth) are [`HardwareProfile::default`]'s: [`probe`] measures them.
///
/// # Errors
/// candle's `NotCompiledWithCudaSupport` or the swapper's [`oogc_swapper::Error::NotCompiledWithCuda`]
/// without the `cuda` feature; [`oogc_swapper::Error::NoCudaDevice`] without a driver or GPU
/// `ordinal`; device memory for the matrices or the copies.
pub fn gpu_profile_with(args: &GpuProbeArgs) -> Result<HardwareProfile> {
    let n = args.ordinal;
    let (bf16, f32) = {
        let dev = Device::new_cuda_with_stream(n).with_context(|| format!("opening cuda:{n} for the GPU probe"))?;
        let bf16 = matmul_tflops(&dev, DType::BF16, args.bf16_n, args.warmups, args.reps)
            .with_context(|| format!("timing a {0}x{0}x{0} bf16 matrix product on cuda:{n}", args.bf16_n))?;
        let f32 = matmul_tflops(&dev, DType::F32, args.f32_n, args.warmups, args.reps)
            .with_context(|| format!("timing a {0}x{0}x{0} f32 matrix product on cuda:{n}", args.f32_n))?;
        (bf16, f32)
    };
    let copies = crate::swap::SwapBenchArgs {
        size_bytes: args.copy_bytes,
        repeats: args.copy_repeats,
        ..crate::swap::SwapBenchArgs::default()
    };
    let rows = crate::swap::run_cuda(n, &copies).context("timing the swapper's H2D and D2H copies")?;
    let gbps = |name: &str| rows.iter().find(|r| r.name == name).map(|r| r.gbps);
    let (Some(h2d), Some(d2h)) = (gbps("cuda-htod"), gbps("cuda-dtoh")) else {
        return Err(Error::Internal { what: "the cuda-htod and cuda-dtoh rows of the swap benchmark" });
    };
    let (name, memory_bytes) = gpu_identity(n)?;
    Ok(HardwareProfile {
        h2d_gbps: h2d,
        d2h_gbps: d2h,
        device_name: Some(name.clone()),
        device_memory_bytes: Some(memory_bytes),
        device_bf16_tflops: Some(bf16),
        device_f32_tflops: Some(f32),
        source: format!(
            "oogc bench probe --device cuda:{n} ({name}): {bf16:.0} TFLOP/s bf16 ({0}^3), {f32:.1} TFLOP/s f32 ({1}^3) \
             on candle's stream; H2D {h2d:.1} GB/s, D2H {d2h:.1} GB/s ({2} MiB copies of pinned memory on the \
             swapper's copy stream); host figures are defaults",
            args.bf16_n,
            args.f32_n,
            args.copy_bytes >> 20
        ),
        ..HardwareProfile::default()
    })
}

/// The GPU's name and total memory in bytes, as its driver reports them.
#[cfg(feature = "cuda")]
fn gpu_identity(ordinal: usize) -> Result<(String, u64)> {
    use oogc_swapper::DeviceBackend;
    let dev = oogc_swapper::CudaDevice::new(ordinal, None).with_context(|| format!("opening cuda:{ordinal}"))?;
    let (_, total) = dev
        .context()
        .mem_get_info()
        .map_err(|e| oogc_swapper::Error::Cuda { op: "mem_get_info", message: e.to_string() })?;
    Ok((dev.name(), total as u64))
}

/// Without the `cuda` feature: [`oogc_swapper::Error::NotCompiledWithCuda`].
#[cfg(not(feature = "cuda"))]
fn gpu_identity(ordinal: usize) -> Result<(String, u64)> {
    Err(oogc_swapper::Error::NotCompiledWithCuda).with_context(|| format!("opening cuda:{ordinal}"))
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
            dtype: DType::F32,
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
    fn the_compute_probe_times_the_configs_dtype() {
        let shape = ComputeShape { dtype: DType::BF16, ..tiny_shape(false) };
        assert!(shape.describe().contains("bf16"), "{}", shape.describe());
        let c = probe_compute(&shape).unwrap();
        assert!(c.device_gflops > 0.0 && c.backward_flops_ratio > 0.0, "{c:?}");
    }

    #[test]
    fn the_matmul_rate_counts_two_n_cubed_flops_per_product() {
        // On the CPU (the same code times a GPU; candle's CPU matmul has no bf16): a positive,
        // finite rate.
        for dtype in [DType::F32, DType::F16] {
            let t = matmul_tflops(&Device::Cpu, dtype, 64, 1, 2).unwrap();
            assert!(t.is_finite() && t > 0.0, "{dtype:?}: {t}");
        }
        assert_eq!(GpuProbeArgs::new(3).ordinal, 3);
        assert_eq!((GpuProbeArgs::new(0).bf16_n, GpuProbeArgs::new(0).f32_n), (8192, 4096));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn the_gpu_probe_without_the_cuda_feature_says_so() {
        let e = gpu_profile(0).unwrap_err().report();
        assert!(e.contains("cuda:0") && e.to_lowercase().contains("cuda support"), "{e}");
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
