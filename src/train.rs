//! The reference trainer: the byte-level GPT of [`oogc_models`] trained out of GPU core through
//! a [`Runtime`], from a [`TrainConfig`]. `oogc train` drives it; tests drive it directly.
//!
//! One step (DESIGN.md, "One training step"): the forward fetches units 0..L in order and keeps
//! each unit's input (the activation checkpoint); the head computes the loss and its backward at
//! once (the forward→backward turn); the backward fetches units L..0 again, recomputes each from
//! its checkpoint, takes the vector-Jacobian product and pushes the unit's gradients D2H to the
//! pipelined CPU optimizer while the next unit's backward runs.

use candle_core::Tensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::checkpoint::{self, Checkpoint, NamedTensor};
use crate::config::{StateTier, TrainConfig};
use crate::data::{validation_batches, Batch, Sampler, TextData};
use crate::runtime::{DeviceSpec, Phase, Runtime, RuntimeConfig, StepStats, UnitId, UnitParams};
use oogc_models::{init_params, Gpt, GptConfig, UnitSpec};

/// Anything that stops a training run; every variant's message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad config value.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Missing or unusable training text.
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// Runtime (tiers, optimizer, prefetch) failure.
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    /// Model failure.
    #[error(transparent)]
    Model(#[from] oogc_models::Error),
    /// candle failure.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// Checkpoint failure.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// A run directory is held by another run, or cannot be locked.
    #[error(transparent)]
    Lock(#[from] crate::lock::LockError),
    /// The checkpoint does not belong to this config.
    #[error("checkpoint {path}: {reason}")]
    Mismatch {
        /// The checkpoint.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
}

/// Result of trainer operations.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// The outcome of one training step.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// Mean cross-entropy of the step's batch, nats per byte.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Tokens in the batch.
    pub tokens: usize,
    /// Time and traffic.
    pub stats: StepStats,
    /// MoE: the load-balancing loss of the step (sum over blocks, already weighted); 0 for a
    /// dense model. The objective is `loss + aux_loss`.
    pub aux_loss: f64,
    /// MoE: tokens routed to each expert, per block (`[block][expert]`); empty for a dense model.
    pub routed_tokens: Vec<Vec<usize>>,
    /// MoE: tokens whose expert ran on the CPU from its host copy this step (forward).
    pub cpu_tokens: usize,
}

/// The model's config from the run's `[model]` table and `train.seq_len`.
pub fn gpt_config(cfg: &TrainConfig) -> GptConfig {
    GptConfig {
        vocab_size: 256,
        d_model: cfg.model.d_model,
        n_layer: cfg.model.n_layer,
        n_head: cfg.model.n_head,
        d_ff: cfg.model.d_ff,
        max_seq_len: cfg.max_seq_len(),
        tied_head: cfg.model.tied_head,
        moe: cfg.model.moe.as_ref().map(|m| m.to_model()),
        ..GptConfig::default()
    }
}

/// The learning-rate schedule of the run: linear warmup over `warmup_steps`, cosine decay to
/// `min_lr` at `train.steps`.
pub fn lr_schedule(cfg: &TrainConfig) -> oogc_optimizer::LrSchedule {
    oogc_optimizer::LrSchedule {
        peak_lr: cfg.optimizer.lr,
        min_lr: cfg.min_lr(),
        warmup_steps: cfg.optimizer.warmup_steps.min(cfg.train.steps),
        total_steps: cfg.train.steps,
    }
}

/// The runtime's config from the run's config.
///
/// # Errors
/// [`TrainError::Config`] for a device kind it cannot build.
pub fn runtime_config(cfg: &TrainConfig, num_params: usize) -> Result<RuntimeConfig> {
    let device = if cfg.device.kind == "sim" {
        DeviceSpec::Sim { link_gbps: cfg.device.link_gbps, latency_us: cfg.device.latency_us }
    } else {
        let ordinal = cfg.device.kind.strip_prefix("cuda:").unwrap_or("0").parse::<usize>().map_err(|_| {
            crate::config::ConfigError::Invalid {
                key: "device.kind".into(),
                reason: format!("`{}`: use \"cuda:N\" with N the device index", cfg.device.kind),
            }
        })?;
        DeviceSpec::Cuda { ordinal }
    };
    let nvme = (cfg.budgets.optimizer_state == StateTier::Nvme).then(|| {
        let state_bytes = num_params as u64 * 12;
        let size = cfg.budgets.nvme_size.map_or(3 * state_bytes + (64 << 20), |s| s.as_u64());
        oogc_swapper::NvmeConfig::new(cfg.budgets.nvme_dirs.clone(), size)
    });
    Ok(RuntimeConfig {
        device,
        gpu_budget_bytes: cfg.budgets.gpu.as_u64(),
        host_budget_bytes: cfg.budgets.host.as_u64(),
        state_tier: cfg.budgets.optimizer_state,
        nvme,
        prefetch_depth: cfg.prefetch.depth,
        optimizer: crate::train::optimizer_config(cfg),
        lock_host_memory: true,
        overlap_optimizer: cfg.prefetch.overlap_optimizer,
    })
}

/// The CPU optimizer's config from the run's `[optimizer]` and `[threads]` tables: f32 compute
/// copies on the sim device.
pub fn optimizer_config(cfg: &TrainConfig) -> oogc_optimizer::OptimizerConfig {
    let o = &cfg.optimizer;
    oogc_optimizer::OptimizerConfig {
        threads: cfg.threads.optimizer,
        adam: oogc_optimizer::AdamConfig {
            kind: if o.kind == "adam" { oogc_optimizer::AdamKind::Adam } else { oogc_optimizer::AdamKind::AdamW },
            beta1: o.betas[0] as f64,
            beta2: o.betas[1] as f64,
            eps: o.eps as f64,
            weight_decay: o.weight_decay as f64,
        },
        clip_norm: (o.clip_norm > 0.0).then_some(o.clip_norm),
        compute_dtype: oogc_optimizer::FloatType::F32,
        ..oogc_optimizer::OptimizerConfig::default()
    }
}

fn moe_err(key: &'static str) -> impl Fn(oogc_moe_placement::Error) -> TrainError {
    move |e| TrainError::Config(crate::config::ConfigError::Invalid { key: key.into(), reason: e.to_string() })
}

/// A training run in progress.
pub struct Trainer {
    cfg: TrainConfig,
    model: Gpt,
    units: Vec<UnitSpec>,
    rt: Runtime,
    ids: Vec<UnitId>,
    data: TextData,
    sampler: Sampler,
    val: Vec<Batch>,
    /// Steps completed.
    step: u64,
    /// Optimizer updates applied (steps skipped for non-finite gradients do not count): the
    /// Adam step counter `t` of the next update is this + 1.
    updates: u64,
    /// MoE: unit indices of each block's trunk and experts; `None` for a dense model.
    moe: Option<MoeUnits>,
    /// MoE: a fixed placement set by [`Trainer::set_expert_placement`] (tests, baselines);
    /// `None`: the placer decides.
    placement: Option<ExpertPlacement>,
    /// MoE: popularity statistics, hot set and cost model (`[moe] policy = "ours"`).
    placer: Option<oogc_moe_placement::Placer>,
    /// MoE: forward compute seconds of each expert in the step, until its backward.
    expert_compute_s: std::collections::HashMap<(usize, usize), f64>,
    /// MoE: the routing trace being written (`[moe] routing_trace`).
    routing_trace: Option<oogc_moe_placement::RoutingTraceWriter<std::io::BufWriter<std::fs::File>>>,
    /// The run's exclusive hold on its checkpoint and NVMe directories (released on drop).
    _lock: crate::lock::RunLock,
}

/// Unit indices of an MoE model's blocks.
#[derive(Debug, Clone)]
struct MoeUnits {
    trunks: Vec<usize>,
    experts: Vec<Vec<usize>>,
}

/// Where the experts of an MoE model run in a step (DESIGN.md: hot experts stay on the GPU, a
/// cold expert is fetched or computed on the CPU, whichever is cheaper).
#[derive(Debug, Clone, Default)]
pub struct ExpertPlacement {
    /// (block, expert) pairs kept on the device from their forward to their backward in a step.
    pub hot: std::collections::HashSet<(usize, usize)>,
    /// A cold expert with at most this many routed tokens runs on the CPU from its host copy
    /// (no H2D, gradients straight to the CPU optimizer); 0: cold experts are always fetched.
    pub cpu_max_tokens: usize,
}

impl ExpertPlacement {
    fn place(&self, block: usize, expert: usize, tokens: usize) -> Placement {
        if tokens == 0 {
            Placement::Skip
        } else if self.hot.contains(&(block, expert)) {
            Placement::Resident
        } else if tokens <= self.cpu_max_tokens {
            Placement::Cpu
        } else {
            Placement::Fetch
        }
    }
}

use oogc_moe_placement::Placement;

impl Trainer {
    /// A fresh run: parameters initialized from `train.seed`, state zero, step 0.
    ///
    /// # Errors
    /// Bad config, missing or short data, a budget below the minimum working set, a bad NVMe
    /// directory — each naming the key or path.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        Self::build(cfg, false)
    }

    fn build(cfg: TrainConfig, resuming: bool) -> Result<Self> {
        cfg.validate()?;
        // Before anything is written: one run at a time owns its directories.
        let lock = crate::lock::RunLock::for_config(&cfg)?;
        if let Some(dir) = cfg.checkpoint.dir.as_deref().filter(|_| !resuming) {
            // A fresh run must not mix its checkpoints with another run's (nor rotate them away).
            if let Some((step, path)) = checkpoint::list(dir).ok().and_then(|l| l.last().cloned()) {
                return Err(TrainError::Mismatch {
                    path,
                    reason: format!(
                        "[checkpoint] dir {} already holds a run's checkpoint (step {step}); a fresh run would \
                         mix with it\n  fix: continue that run with --resume {}, or start over after removing the \
                         directory (or set another [checkpoint] dir)",
                        dir.display(),
                        dir.display()
                    ),
                });
            }
        }
        let gcfg = gpt_config(&cfg);
        let model = Gpt::new(gcfg.clone())?;
        let data = TextData::load(&cfg.data.path, cfg.data.val_fraction, cfg.train.seq_len)?;
        if cfg.budgets.optimizer_state == StateTier::Nvme {
            for dir in &cfg.budgets.nvme_dirs {
                std::fs::create_dir_all(dir).map_err(|e| {
                    crate::runtime::RuntimeError::Swapper(oogc_swapper::Error::NvmeDir {
                        path: dir.clone(),
                        needed_bytes: gcfg.num_params() as u64 * 12,
                        reason: format!(
                            "cannot create it: {e}; fix: point [budgets] nvme_dirs at a writable directory on a fast disk"
                        ),
                    })
                })?;
            }
        }
        let params = init_params(&gcfg.units(), cfg.train.seed);
        let units = model.units().to_vec();
        let mut rt = Runtime::new(runtime_config(&cfg, gcfg.num_params())?)?;
        let mut ids = Vec::with_capacity(units.len());
        for (spec, flat) in units.iter().zip(&params) {
            ids.push(rt.add_unit(&spec.name, flat)?);
        }
        if gcfg.moe.is_some() && gcfg.tied_head {
            return Err(crate::config::ConfigError::Invalid {
                key: "model.tied_head".into(),
                reason: "a tied LM head with MoE blocks is not supported; set tied_head = false".into(),
            }
            .into());
        }
        if let Some(m) = &gcfg.moe {
            // Experts are fetched as the router decides: outside the recorded schedule.
            for (k, spec) in units.iter().enumerate() {
                if matches!(spec.kind, oogc_models::UnitKind::Expert { .. }) {
                    rt.set_unscheduled(ids[k]);
                }
            }
            let _ = m;
        }
        // A trunk stays pinned while its experts run (MoE); a tied head uses the embedding.
        rt.set_max_units_in_use(if cfg.model.tied_head || gcfg.moe.is_some() { 2 } else { 1 });
        rt.check_working_set()?;
        let val = validation_batches(&data, cfg.train.eval_batches, cfg.train.batch_size, cfg.train.seq_len);
        let sampler = Sampler::new(cfg.train.seed);
        let (placer, routing_trace) = match &gcfg.moe {
            Some(m) => Self::moe_placement(&cfg, &gcfg, m, &units, &ids, &mut rt)?,
            None => (None, None),
        };
        let moe = gcfg.moe.as_ref().map(|m| {
            let trunks = (0..gcfg.n_layer).map(|i| gcfg.block_unit(i)).collect();
            let experts = (0..gcfg.n_layer).map(|i| (0..m.experts).map(|e| gcfg.expert_unit(i, e)).collect()).collect();
            MoeUnits { trunks, experts }
        });
        Ok(Self {
            cfg,
            model,
            units,
            rt,
            ids,
            data,
            sampler,
            val,
            step: 0,
            updates: 0,
            moe,
            placement: None,
            placer,
            expert_compute_s: std::collections::HashMap::new(),
            routing_trace,
            _lock: lock,
        })
    }

    /// Resumes from the newest checkpoint in `dir` (or a checkpoint file): parameters, optimizer
    /// state, step and data position are restored, so the run continues exactly where it stopped.
    ///
    /// # Errors
    /// As [`Trainer::new`]; [`TrainError::Checkpoint`] when there is no readable checkpoint;
    /// [`TrainError::Mismatch`] when its model differs from the config's.
    pub fn resume(cfg: TrainConfig, dir: &Path) -> Result<Self> {
        let ckpt = checkpoint::load(dir)?;
        let path = if dir.is_dir() { checkpoint::latest(dir)? } else { dir.to_path_buf() };
        let mismatch = |reason: String| TrainError::Mismatch {
            path: path.clone(),
            reason: format!("cannot resume: {reason}\n  fix: resume with the config the checkpoint was written with"),
        };
        let saved_model = ckpt.metadata.get("model").ok_or_else(|| mismatch("no `model` metadata".into()))?;
        let ours = serde_json::to_string(&cfg.model).expect("model config serializes");
        if *saved_model != ours {
            return Err(mismatch(format!("checkpoint model {saved_model} != config model {ours}")));
        }
        let mut t = Self::build(cfg, true)?;
        for (k, spec) in t.units.clone().iter().enumerate() {
            let mut state = [vec![0f32; spec.numel], vec![0f32; spec.numel], vec![0f32; spec.numel]];
            for p in &spec.params {
                for (slot, suffix) in state.iter_mut().zip(["", ".exp_avg", ".exp_avg_sq"]) {
                    let name = format!("{}{suffix}", p.name);
                    let tensor = ckpt.tensor(&name).ok_or_else(|| mismatch(format!("tensor {name} is missing")))?;
                    if tensor.data.len() != p.numel() {
                        return Err(mismatch(format!(
                            "{name} has {} values, expected {}",
                            tensor.data.len(),
                            p.numel()
                        )));
                    }
                    slot[p.offset..p.offset + p.numel()].copy_from_slice(&tensor.data);
                }
            }
            let [master, m, v] = state;
            t.rt.load_unit_state(t.ids[k], master, m, v)?;
        }
        let sampler = ckpt.metadata.get("sampler").ok_or_else(|| mismatch("no `sampler` metadata".into()))?;
        t.sampler = serde_json::from_str(sampler).map_err(|e| mismatch(format!("sampler state: {e}")))?;
        t.step = ckpt.step;
        t.updates = match ckpt.metadata.get("optimizer_updates") {
            Some(u) => u.parse().map_err(|e| mismatch(format!("optimizer_updates: {e}")))?,
            None => ckpt.step,
        };
        Ok(t)
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The run's config.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The training text.
    pub fn data(&self) -> &TextData {
        &self.data
    }

    /// The runtime (tiers, traffic, optimizer).
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// Parameters in the model.
    pub fn num_params(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    fn tokens(&self, ids: &[u32]) -> Result<Tensor> {
        let (b, t) = (self.cfg.train.batch_size, ids.len() / self.cfg.train.batch_size);
        Ok(Tensor::from_slice(ids, (b, t), &candle_core::Device::Cpu)?)
    }

    /// Runs one optimizer step on the next training batch.
    ///
    /// # Errors
    /// Runtime, model or candle failures.
    pub fn train_step(&mut self) -> Result<StepOutcome> {
        if self.moe.is_some() {
            return self.train_step_moe();
        }
        let step = self.step + 1;
        let lr = lr_schedule(&self.cfg).lr(step);
        let batch = self.sampler.next_batch(self.data.train(), self.cfg.train.batch_size, self.cfg.train.seq_len);
        let inputs = self.tokens(&batch.inputs)?;
        let targets = self.tokens(&batch.targets)?;
        let n = self.units.len();
        let head = n - 1;
        let tied = self.cfg.model.tied_head;
        self.rt.begin_step(self.updates + 1, lr)?;

        // Forward: keep each unit's input (the activation checkpoint).
        let mut checkpoints: Vec<Tensor> = Vec::with_capacity(n);
        let mut x = inputs;
        for u in 0..head {
            let p = self.rt.fetch(self.ids[u], Phase::Forward)?;
            let _span = tracing::info_span!("compute::forward", unit = u).entered();
            let y = self.model.forward(u, p.tensor(), &x, None)?;
            checkpoints.push(std::mem::replace(&mut x, y));
        }

        // The turn: the head's forward, loss and backward at once.
        self.rt.end_forward();
        let (loss, mut grad_x, mut tied_grad) = {
            let emb = if tied { Some(self.rt.fetch(self.ids[0], Phase::Backward)?) } else { None };
            let p = self.rt.fetch(self.ids[head], Phase::Backward)?;
            let _span = tracing::info_span!("compute::backward", unit = head).entered();
            let out = self.model.head_loss_backward(p.tensor(), &x, emb.as_ref().map(|e| e.tensor()), &targets)?;
            drop((p, emb));
            self.rt.push_grads(self.ids[head], &out.grads.grad_params.to_vec1::<f32>()?)?;
            (out.loss, out.grads.grad_input.expect("the head returns its input's gradient"), out.grads.grad_tied_wte)
        };

        // Backward in reverse, recomputing each unit from its checkpoint.
        for u in (0..head).rev() {
            let p = self.rt.fetch(self.ids[u], Phase::Backward)?;
            let input = checkpoints.pop().expect("one checkpoint per unit");
            let g = {
                let _span = tracing::info_span!("compute::backward", unit = u).entered();
                self.model.backward(u, p.tensor(), &input, &grad_x, None)?
            };
            drop(p);
            let mut grads = g.grad_params;
            if u == 0 {
                if let Some(extra) = tied_grad.take() {
                    grads = (grads + extra)?;
                }
            }
            self.rt.push_grads(self.ids[u], &grads.to_vec1::<f32>()?)?;
            if let Some(gi) = g.grad_input {
                grad_x = gi;
            }
        }
        let stats = self.rt.finish_step()?;
        self.step = step;
        if !stats.skipped {
            self.updates += 1;
        }
        Ok(StepOutcome {
            loss,
            lr,
            tokens: batch.inputs.len(),
            stats,
            aux_loss: 0.0,
            routed_tokens: Vec::new(),
            cpu_tokens: 0,
        })
    }

    /// Fixes where experts run (MoE), overriding the placer; between steps only.
    pub fn set_expert_placement(&mut self, placement: ExpertPlacement) {
        self.placement = Some(placement);
    }

    /// The MoE placer: its statistics, hot set and cost model (`[moe] policy = "ours"`).
    pub fn placer(&self) -> Option<&oogc_moe_placement::Placer> {
        self.placer.as_ref()
    }

    /// The placer (popularity, hot set under `[moe] expert_budget`, cost model calibrated from
    /// the link and a measured CPU GEMM rate) and the routing trace writer of an MoE run; the
    /// placer's popularity ranks expert copies for eviction.
    #[allow(clippy::type_complexity)]
    fn moe_placement(
        cfg: &TrainConfig,
        gcfg: &GptConfig,
        m: &oogc_models::MoeConfig,
        units: &[UnitSpec],
        ids: &[UnitId],
        rt: &mut Runtime,
    ) -> Result<(
        Option<oogc_moe_placement::Placer>,
        Option<oogc_moe_placement::RoutingTraceWriter<std::io::BufWriter<std::fs::File>>>,
    )> {
        let expert_params =
            units.iter().find(|u| matches!(u.kind, oogc_models::UnitKind::Expert { .. })).map_or(0, |u| u.numel);
        let expert_bytes = expert_params as u64 * 4;
        // Forward 2, recompute 2, backward 4 FLOPs per parameter and token.
        let flops_per_token = 8.0 * expert_params as f64;
        let tokens_per_step = (cfg.train.batch_size * cfg.train.seq_len) as u64;
        let header = oogc_moe_placement::TraceHeader::new(
            gcfg.n_layer as u32,
            m.experts as u32,
            m.top_k as u32,
            expert_params as u64,
            expert_bytes,
            flops_per_token,
            tokens_per_step,
        );
        let trace = match &cfg.moe.routing_trace {
            Some(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|source| {
                        TrainError::Checkpoint(checkpoint::CheckpointError::Io { path: dir.to_path_buf(), source })
                    })?;
                }
                Some(
                    oogc_moe_placement::RoutingTraceWriter::create(path, header.clone())
                        .map_err(moe_err("moe.routing_trace"))?,
                )
            }
            None => None,
        };
        if cfg.moe.policy != "ours" {
            return Ok((None, trace));
        }
        let budget = cfg.moe.expert_budget.map_or(cfg.budgets.gpu.as_u64() / 4, |b| b.as_u64());
        let link = if cfg.device.kind == "sim" && cfg.device.link_gbps > 0.0 { cfg.device.link_gbps } else { 16.0 };
        // On the sim device the "GPU" is this CPU: both rates are the measured CPU GEMM rate.
        let cpu = oogc_moe_placement::calibrate_cpu_gemm() * cfg.threads.compute.unwrap_or(1).max(1) as f64;
        let mut pc = oogc_moe_placement::PlacerConfig::new(budget);
        pc.decay = cfg.moe.popularity_decay;
        pc.hot_set.cpu_compute = cfg.moe.cpu_compute;
        pc.cost = oogc_moe_placement::CostModelConfig {
            h2d_gbps: link,
            d2h_gbps: link,
            gpu_gflops: if cfg.device.kind == "sim" { cpu } else { pc.cost.gpu_gflops },
            cpu_gflops: cpu,
            ..pc.cost
        };
        let placer = oogc_moe_placement::Placer::new(gcfg.n_layer as u32, m.experts as u32, header.expert_shape(), pc)
            .map_err(moe_err("moe.expert_budget"))?;
        let experts = units.iter().zip(ids).filter_map(|(u, id)| match u.kind {
            oogc_models::UnitKind::Expert { block, expert } => Some((
                oogc_swapper::TensorId(id.0 as u64),
                oogc_moe_placement::ExpertId::new(block as u32, expert as u32),
            )),
            _ => None,
        });
        rt.set_fallback_policy(Box::new(placer.fallback(experts)));
        Ok((Some(placer), trace))
    }

    /// Where each expert of `block` runs for the routed `tokens`.
    fn place_block(&self, block: usize, tokens: &[usize]) -> Result<Vec<Placement>> {
        if let Some(p) = &self.placement {
            return Ok(tokens.iter().enumerate().map(|(e, &n)| p.place(block, e, n)).collect());
        }
        match &self.placer {
            Some(placer) => {
                let t: Vec<u64> = tokens.iter().map(|&n| n as u64).collect();
                placer.place_block(block as u32, &t).map_err(moe_err("moe"))
            }
            // `fetch` / `resident`: every routed expert fetched on demand.
            None => Ok(tokens.iter().map(|&n| if n == 0 { Placement::Skip } else { Placement::Fetch }).collect()),
        }
    }

    /// [`Trainer::fetch_expert`], feeding the time of a real H2D copy (the expert had no device
    /// copy) to the cost model's bandwidth estimate.
    fn timed_fetch_expert(
        &mut self,
        block: usize,
        expert: usize,
        placement: Placement,
        phase: Phase,
    ) -> Result<UnitParams> {
        let unit = self.ids[self.moe.as_ref().expect("MoE").experts[block][expert]];
        let cold = placement != Placement::Cpu
            && self.placer.is_some()
            && !self.rt.residency().residency(oogc_swapper::TensorId(unit.0 as u64)).is_ok_and(|r| r.device);
        let started = std::time::Instant::now();
        let p = self.fetch_expert(block, expert, placement, phase)?;
        if cold {
            let bytes = self.units[self.moe.as_ref().expect("MoE").experts[block][expert]].numel as u64 * 4;
            if let Some(placer) = &mut self.placer {
                placer.cost_model_mut().observe_fetch(bytes, started.elapsed().as_secs_f64());
            }
        }
        Ok(p)
    }

    /// Fetches expert `(block, expert)` where `placement` says: pinned on the device, or its
    /// host copy for CPU compute.
    fn fetch_expert(&mut self, block: usize, expert: usize, placement: Placement, phase: Phase) -> Result<UnitParams> {
        let unit = self.ids[self.moe.as_ref().expect("MoE").experts[block][expert]];
        match placement {
            Placement::Cpu => Ok(self.rt.fetch_host(unit)?),
            _ => Ok(self.rt.fetch(unit, phase)?),
        }
    }

    /// One MoE block forward: trunk, the routed experts (hot ones stay pinned in `held` until the
    /// backward), combine. Returns the block output and the routing.
    fn moe_block_forward(
        &mut self,
        block: usize,
        x: &Tensor,
        phase: Phase,
        held: &mut std::collections::HashMap<(usize, usize), UnitParams>,
        cpu_tokens: &mut usize,
    ) -> Result<(Tensor, oogc_models::Routing, Vec<Placement>)> {
        let trunk = self.ids[self.moe.as_ref().expect("MoE").trunks[block]];
        let t = {
            let p = self.rt.fetch(trunk, phase)?;
            let _span = tracing::info_span!("compute::forward", unit = trunk.0).entered();
            self.model.moe_trunk_forward(block, p.tensor(), x)?
        };
        let experts = t.routing.num_experts();
        let counts = t.routing.counts();
        let placements = self.place_block(block, &counts)?;
        let mut outs: Vec<Option<Tensor>> = vec![None; experts];
        for (e, out) in outs.iter_mut().enumerate() {
            let Some(h_e) = t.routing.expert_input(e, &t.h)? else { continue };
            let tokens = counts[e];
            let on_cpu = placements[e] == Placement::Cpu;
            let p = self.timed_fetch_expert(block, e, placements[e], phase)?;
            if on_cpu {
                *cpu_tokens += tokens;
            }
            let _span = tracing::info_span!("compute::expert_forward", block, expert = e, tokens, on_cpu).entered();
            let started = std::time::Instant::now();
            *out = Some(self.model.expert_forward(p.tensor(), &h_e)?);
            self.expert_compute_s.insert((block, e), started.elapsed().as_secs_f64());
            if placements[e] == Placement::Resident && phase != Phase::Eval {
                held.insert((block, e), p);
            }
        }
        let y = self.model.moe_combine(&t.x1, &t.routing, &outs)?;
        Ok((y, t.routing, placements))
    }

    fn train_step_moe(&mut self) -> Result<StepOutcome> {
        let step = self.step + 1;
        let lr = lr_schedule(&self.cfg).lr(step);
        let batch = self.sampler.next_batch(self.data.train(), self.cfg.train.batch_size, self.cfg.train.seq_len);
        let inputs = self.tokens(&batch.inputs)?;
        let targets = self.tokens(&batch.targets)?;
        let head = self.units.len() - 1;
        let layers = self.moe.as_ref().expect("MoE").trunks.len();
        self.rt.begin_step(self.updates + 1, lr)?;

        let mut held = std::collections::HashMap::new();
        let mut cpu_tokens = 0;
        let x0 = {
            let p = self.rt.fetch(self.ids[0], Phase::Forward)?;
            self.model.forward(0, p.tensor(), &inputs, None)?
        };
        let mut x = x0;
        let mut checkpoints = Vec::with_capacity(layers);
        for i in 0..layers {
            let (y, routing, placements) = self.moe_block_forward(i, &x, Phase::Forward, &mut held, &mut cpu_tokens)?;
            checkpoints.push((std::mem::replace(&mut x, y), routing, placements));
        }
        let aux: f64 = checkpoints.iter().map(|(_, r, _)| r.aux_loss()).sum();
        let routed: Vec<Vec<usize>> = checkpoints.iter().map(|(_, r, _)| r.counts()).collect();

        self.rt.end_forward();
        let (loss, mut grad_y) = {
            let p = self.rt.fetch(self.ids[head], Phase::Backward)?;
            let out = self.model.head_loss_backward(p.tensor(), &x, None, &targets)?;
            drop(p);
            self.rt.push_grads(self.ids[head], &out.grads.grad_params.to_vec1::<f32>()?)?;
            (out.loss, out.grads.grad_input.expect("the head returns its input's gradient"))
        };

        for i in (0..layers).rev() {
            let (x_in, routing, placements) = checkpoints.pop().expect("one checkpoint per block");
            let trunk = self.ids[self.moe.as_ref().expect("MoE").trunks[i]];
            let p = self.rt.fetch(trunk, Phase::Backward)?;
            let t = self.model.moe_trunk_forward(i, p.tensor(), &x_in)?;
            let experts = routing.num_experts();
            let mut grad_inputs: Vec<Option<Tensor>> = vec![None; experts];
            let mut grad_gates: Vec<Option<Tensor>> = vec![None; experts];
            for e in 0..experts {
                let Some(h_e) = routing.expert_input(e, &t.h)? else { continue };
                let grad_out = self.model.moe_expert_grad_output(&routing, e, &grad_y)?.expect("active expert");
                let tokens = routing.tokens(e).len();
                let on_cpu = placements[e] == Placement::Cpu;
                let pe = match held.remove(&(i, e)) {
                    Some(pe) => pe,
                    None => self.fetch_expert(i, e, placements[e], Phase::Backward)?,
                };
                let g = {
                    let _span = tracing::info_span!("compute::expert_backward", block = i, expert = e, tokens, on_cpu)
                        .entered();
                    self.model.expert_backward(pe.tensor(), &h_e, &grad_out)?
                };
                drop(pe);
                let unit = self.ids[self.moe.as_ref().expect("MoE").experts[i][e]];
                let flat = g.grad_params.to_vec1::<f32>()?;
                if on_cpu {
                    self.rt.push_grads_host(unit, &flat)?;
                } else {
                    self.rt.push_grads(unit, &flat)?;
                }
                grad_gates[e] = self.model.moe_expert_grad_gate(&routing, e, &grad_y, &g.output)?;
                grad_inputs[e] = Some(g.grad_input);
            }
            let grad_h = routing.scatter_input_grads(&grad_inputs)?;
            let g = {
                let _span = tracing::info_span!("compute::backward", unit = trunk.0).entered();
                self.model.moe_trunk_backward(i, p.tensor(), &x_in, &routing, &grad_y, &grad_h, &grad_gates)?
            };
            drop(p);
            self.rt.push_grads(trunk, &g.grad_params.to_vec1::<f32>()?)?;
            grad_y = g.grad_input.expect("the trunk returns its input's gradient");
        }
        {
            let p = self.rt.fetch(self.ids[0], Phase::Backward)?;
            let g = self.model.backward(0, p.tensor(), &inputs, &grad_y, None)?;
            drop(p);
            self.rt.push_grads(self.ids[0], &g.grad_params.to_vec1::<f32>()?)?;
        }
        let stats = self.rt.finish_step()?;
        self.step = step;
        if !stats.skipped {
            self.updates += 1;
        }
        for (i, counts) in routed.iter().enumerate() {
            let t: Vec<u64> = counts.iter().map(|&n| n as u64).collect();
            if let Some(placer) = &self.placer {
                placer.observe_routing(step, i as u32, &t).map_err(moe_err("moe"))?;
            }
            if let Some(w) = &mut self.routing_trace {
                w.record(step, i as u32, &t).map_err(moe_err("moe.routing_trace"))?;
            }
        }
        if let Some(placer) = &mut self.placer {
            // Between steps: re-place the hot set (with hysteresis).
            let change = placer.replan();
            tracing::debug!(?change, "moe: hot set");
        }
        Ok(StepOutcome {
            loss,
            lr,
            tokens: batch.inputs.len(),
            stats,
            aux_loss: aux,
            routed_tokens: routed,
            cpu_tokens,
        })
    }

    /// Mean validation loss (nats per byte) over the fixed validation batches, with the latest
    /// parameters (pending updates are awaited).
    ///
    /// # Errors
    /// Runtime, model or candle failures.
    pub fn evaluate(&mut self) -> Result<f64> {
        let head = self.units.len() - 1;
        let mut total = 0.0;
        for b in self.val.clone() {
            let mut x = self.tokens(&b.inputs)?;
            let targets = self.tokens(&b.targets)?;
            if let Some(layers) = self.moe.as_ref().map(|m| m.trunks.len()) {
                let p = self.rt.fetch(self.ids[0], Phase::Eval)?;
                x = self.model.forward(0, p.tensor(), &x, None)?;
                drop(p);
                let (mut held, mut cpu) = (std::collections::HashMap::new(), 0);
                for i in 0..layers {
                    x = self.moe_block_forward(i, &x, Phase::Eval, &mut held, &mut cpu)?.0;
                }
                drop(held);
            } else {
                for u in 0..head {
                    let p = self.rt.fetch(self.ids[u], Phase::Eval)?;
                    x = self.model.forward(u, p.tensor(), &x, None)?;
                }
            }
            let emb = if self.cfg.model.tied_head { Some(self.rt.fetch(self.ids[0], Phase::Eval)?) } else { None };
            let p = self.rt.fetch(self.ids[head], Phase::Eval)?;
            total += self.model.head_loss(p.tensor(), &x, emb.as_ref().map(|e| e.tensor()), &targets)?;
        }
        Ok(total / self.val.len() as f64)
    }

    /// Per-unit flat parameter vectors (fp32 master weights), after waiting for pending updates.
    ///
    /// # Errors
    /// Runtime failures.
    pub fn master_weights(&mut self) -> Result<Vec<Vec<f32>>> {
        self.rt.sync()?;
        self.ids.iter().map(|&u| Ok(self.rt.unit_state(u)?.0)).collect()
    }

    /// Writes a checkpoint of the completed steps into `[checkpoint] dir` (atomically) and
    /// returns its path; `None` when the config has no checkpoint directory.
    ///
    /// # Errors
    /// Runtime or checkpoint I/O failures (the previous checkpoint stays intact).
    pub fn save_checkpoint(&mut self) -> Result<Option<PathBuf>> {
        let Some(dir) = self.cfg.checkpoint.dir.clone() else { return Ok(None) };
        self.rt.sync()?;
        let mut tensors = Vec::new();
        for (k, spec) in self.units.iter().enumerate() {
            let (master, m, v) = self.rt.unit_state(self.ids[k])?;
            for p in &spec.params {
                let range = p.offset..p.offset + p.numel();
                for (src, suffix) in [(&master, ""), (&m, ".exp_avg"), (&v, ".exp_avg_sq")] {
                    tensors.push(NamedTensor {
                        name: format!("{}{suffix}", p.name),
                        shape: p.shape.clone(),
                        data: src[range.clone()].to_vec(),
                    });
                }
            }
        }
        let mut metadata = BTreeMap::new();
        metadata.insert("format".into(), "oogc-gpt-1".into());
        metadata.insert("optimizer_updates".into(), self.updates.to_string());
        metadata.insert("model".into(), serde_json::to_string(&self.cfg.model).expect("model config serializes"));
        metadata.insert("sampler".into(), serde_json::to_string(&self.sampler).expect("sampler serializes"));
        metadata.insert("config".into(), toml::to_string(&self.cfg).unwrap_or_default());
        metadata.insert("data".into(), self.data.path().display().to_string());
        let ckpt = Checkpoint { step: self.step, metadata, tensors };
        let keep = self.cfg.checkpoint.keep.unwrap_or(2);
        Ok(Some(checkpoint::save(&dir, &ckpt, keep)?))
    }
}
