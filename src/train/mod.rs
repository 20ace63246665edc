//! The reference trainer: a model of `oogc-models` (the byte-level GPT or MoE-GPT) trained out of
//! GPU core through a [`Runtime`], from a [`TrainConfig`]. `oogc train` drives it; tests drive it
//! directly. It talks to the tiers only through the [`Runtime`]'s API.
//!
//! One step (DESIGN.md, "One training step"): the forward fetches the embedding and the blocks in
//! order and keeps each block's input (the activation checkpoint); the head computes the loss
//! and its backward at once (the forward→backward turn); the backward fetches the blocks again
//! in reverse, recomputes each from its checkpoint, takes the vector-Jacobian product and pushes
//! the unit's gradients D2H to the pipelined CPU optimizer while the next unit's backward runs.
//! An MoE block is a trunk unit and one unit per expert; each routed expert runs where the
//! placement says ([`moe`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;
use oogc_models::{CausalLm, Gpt, GptConfig, UnitKind};
use oogc_moe_placement::Placement;

use crate::checkpoint::{self, Checkpoint, NamedTensor};
use crate::config::{DeviceKind, TrainConfig};
use crate::data::{validation_batches, Batch, Sampler, TextData};
use crate::runtime::{DeviceSpec, HostPlan, NvmePlan, Phase, Runtime, RuntimeConfig, StepStats, UnitId, UnitParams};

mod moe;

pub use moe::ExpertPlacement;

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

/// The runtime's config from the run's config and its model's units (parameters per unit):
/// device, budgets, where the optimizer state and the parameters live (the NVMe store sized
/// `[budgets] nvme_size`, else by [`NvmePlan`]), prefetch depths, the CPU optimizer.
pub fn runtime_config(cfg: &TrainConfig, units: &[usize]) -> RuntimeConfig {
    let device = match cfg.device.kind {
        DeviceKind::Sim => DeviceSpec::Sim { link_gbps: cfg.device.link_gbps, latency_us: cfg.device.latency_us },
        DeviceKind::Cuda(ordinal) => DeviceSpec::Cuda { ordinal },
    };
    let nvme =
        nvme_plan(cfg, units).map(|p| oogc_swapper::NvmeConfig::new(cfg.budgets.nvme_dirs.clone(), p.capacity_bytes));
    RuntimeConfig {
        device,
        gpu_budget_bytes: cfg.budgets.gpu.as_u64(),
        host_budget_bytes: cfg.budgets.host.as_u64(),
        state_placement: cfg.budgets.optimizer_state,
        params_placement: cfg.budgets.params,
        nvme,
        prefetch_depth: cfg.prefetch.depth,
        host_prefetch_depth: cfg.prefetch.host_depth,
        optimizer: optimizer_config(cfg),
        lock_host_memory: true,
        overlap_optimizer: cfg.prefetch.overlap_optimizer,
    }
}

/// The CPU optimizer's config from the run's `[optimizer]` and `[threads]` tables: f32 compute
/// copies on the sim device.
pub fn optimizer_config(cfg: &TrainConfig) -> oogc_optimizer::OptimizerConfig {
    let o = &cfg.optimizer;
    oogc_optimizer::OptimizerConfig {
        threads: cfg.threads.optimizer,
        adam: oogc_optimizer::AdamConfig {
            kind: o.kind,
            beta1: o.betas[0] as f64,
            beta2: o.betas[1] as f64,
            eps: o.eps as f64,
            weight_decay: o.weight_decay as f64,
        },
        clip_norm: (o.clip_norm > 0.0).then_some(o.clip_norm),
        compute_dtype: oogc_optimizer::DType::F32,
        rollback_budget_bytes: o.rollback_budget.map(|b| b.as_u64()),
        stream_host_budget_bytes: o
            .stream_host_budget
            .map_or(oogc_optimizer::OptimizerConfig::default().stream_host_budget_bytes, |b| b.as_u64()),
        ..oogc_optimizer::OptimizerConfig::default()
    }
}

/// The NVMe store of a run of `units` (parameters per unit): [`NvmePlan`] with the config's
/// placements and `[budgets] nvme_size`; `None` when nothing lives on NVMe.
pub fn nvme_plan(cfg: &TrainConfig, units: &[usize]) -> Option<NvmePlan> {
    NvmePlan::new(
        units,
        cfg.budgets.optimizer_state,
        cfg.budgets.params,
        4,
        &optimizer_config(cfg),
        cfg.budgets.nvme_size.map(|s| s.as_u64()),
    )
}

/// Units the trainer holds pinned at once: 2 when a tied head uses the embedding beside its own
/// unit or an MoE trunk stays pinned while its experts run, else 1.
pub fn max_units_in_use(cfg: &TrainConfig) -> usize {
    if cfg.model.tied_head || cfg.model.moe.is_some() {
        2
    } else {
        1
    }
}

/// The split of `[budgets] host` of a run of `units` (parameters per unit): [`HostPlan`].
pub fn host_plan(cfg: &TrainConfig, units: &[usize]) -> HostPlan {
    let room = nvme_plan(cfg, units).map_or(0, |p| p.speculation_room_bytes());
    HostPlan::new(&runtime_config(cfg, units), units, max_units_in_use(cfg), room)
}

/// The stated fixed overhead of a run of `cfg` besides the host ledger, bytes
/// ([`crate::runtime::budget::fixed_overhead_bytes`]): the process, the training text of
/// `data_bytes`, the sim device's memory (the GPU budget) and candle's buffers.
pub fn host_overhead_bytes(cfg: &TrainConfig, data_bytes: u64) -> u64 {
    use crate::runtime::budget::{activation_overhead_bytes, fixed_overhead_bytes};
    let m = &cfg.model;
    let (batch, seq) = (cfg.train.batch_size as u64, cfg.train.seq_len as u64);
    let d_ff = m.moe.as_ref().and_then(|x| x.d_expert).unwrap_or_else(|| cfg.d_ff()) as u64;
    let activations = activation_overhead_bytes(batch, seq, m.d_model as u64, d_ff, m.n_head as u64, m.n_layer as u64);
    let sim_device = if cfg.device.kind.is_sim() { cfg.budgets.gpu.as_u64() } else { 0 };
    fixed_overhead_bytes(data_bytes, sim_device, activations)
}

/// Checks the run's budgets before anything is written: the host budget against the run's
/// minimum ([`HostPlan::check`]) and the NVMe store's size against its minimum and the free
/// space of its directories (`free_bytes(dir)`, e.g. statvfs; [`NvmePlan::check`]).
///
/// # Errors
/// [`crate::runtime::RuntimeError::HostBudgetBelowMinimum`] or
/// [`crate::runtime::RuntimeError::NvmeTooSmall`], with the numbers and the fix.
pub fn check_budgets(
    cfg: &TrainConfig,
    units: &[usize],
    free_bytes: &dyn Fn(&Path) -> std::io::Result<u64>,
) -> Result<HostPlan> {
    let plan = host_plan(cfg, units);
    plan.check()?;
    if let Some(nvme) = nvme_plan(cfg, units) {
        nvme.check(&cfg.budgets.nvme_dirs, free_bytes)?;
    }
    Ok(plan)
}

/// The model of a run's config.
///
/// # Errors
/// [`TrainError::Model`] for dimensions the model refuses.
pub fn build_model(cfg: &TrainConfig) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Gpt::new(gpt_config(cfg))?))
}

/// The units of a block: one dense unit, or an MoE trunk and its experts.
#[derive(Debug, Clone)]
enum Block {
    Dense(UnitId),
    Moe { trunk: UnitId, experts: Vec<UnitId> },
}

/// Where the model's units are, by role (from their [`UnitKind`]s).
#[derive(Debug, Clone)]
struct Layout {
    embed: UnitId,
    blocks: Vec<Block>,
    head: UnitId,
}

impl Layout {
    fn of(model: &dyn CausalLm) -> Self {
        let units = model.units();
        let mut blocks: Vec<Block> = Vec::new();
        for (k, u) in units.iter().enumerate() {
            let id = UnitId(k);
            match u.kind {
                UnitKind::Block(_) => blocks.push(Block::Dense(id)),
                UnitKind::MoeTrunk(_) => blocks.push(Block::Moe { trunk: id, experts: Vec::new() }),
                UnitKind::Expert { block, .. } => match blocks.get_mut(block) {
                    Some(Block::Moe { experts, .. }) => experts.push(id),
                    _ => unreachable!("an expert follows its block's trunk"),
                },
                UnitKind::Embedding | UnitKind::Head => {}
            }
        }
        Self { embed: UnitId(0), blocks, head: UnitId(units.len() - 1) }
    }
}

/// What the forward keeps of a block for its backward.
struct Checkpointed {
    /// The block's input (the activation checkpoint).
    input: Tensor,
    /// MoE: the routing and where each expert ran.
    moe: Option<(oogc_models::Routing, Vec<Placement>)>,
}

/// A training run in progress.
pub struct Trainer {
    cfg: TrainConfig,
    model: Arc<dyn CausalLm>,
    layout: Layout,
    rt: Runtime,
    data: TextData,
    sampler: Sampler,
    val: Vec<Batch>,
    /// Steps completed.
    step: u64,
    /// Optimizer updates applied (steps skipped for non-finite gradients do not count): the
    /// Adam step counter `t` of the next update is this + 1.
    updates: u64,
    /// MoE: placement, popularity and the routing trace; `None` for a dense model.
    moe: Option<moe::MoeState>,
}

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
        let model = build_model(&cfg)?;
        let num_params: usize = model.units().iter().map(|u| u.numel).sum();
        let units: Vec<usize> = model.units().iter().map(|u| u.numel).collect();
        // Budgets too small are refused before anything is written.
        check_budgets(&cfg, &units, &crate::runtime::budget::statvfs_free_bytes)?;
        let data = TextData::load(&cfg.data.path, cfg.data.val_fraction, cfg.train.seq_len)?;
        if cfg.uses_nvme() {
            for dir in &cfg.budgets.nvme_dirs {
                std::fs::create_dir_all(dir).map_err(|e| {
                    crate::runtime::RuntimeError::Swapper(oogc_swapper::Error::NvmeDir {
                        path: dir.clone(),
                        needed_bytes: num_params as u64 * 12,
                        reason: format!(
                            "cannot create it: {e}; fix: point [budgets] nvme_dirs at a writable directory on a fast disk"
                        ),
                    })
                })?;
            }
        }
        let params = oogc_models::init_params(model.units(), cfg.train.seed);
        let mut rt = Runtime::new(runtime_config(&cfg, &units))?;
        for (spec, flat) in model.units().iter().zip(&params) {
            rt.add_unit(&spec.name, flat)?;
        }
        drop(params);
        let layout = Layout::of(&*model);
        let moe = match model.moe() {
            Some(_) => {
                // Experts are fetched as the router decides: outside the recorded schedule.
                for b in &layout.blocks {
                    if let Block::Moe { experts, .. } = b {
                        experts.iter().for_each(|&e| rt.set_unscheduled(e));
                    }
                }
                Some(moe::MoeState::new(&cfg, &*model, &mut rt)?)
            }
            None => None,
        };
        // A trunk stays pinned while its experts run (MoE); a tied head uses the embedding.
        rt.set_max_units_in_use(max_units_in_use(&cfg));
        rt.check_working_set()?;
        let val = validation_batches(&data, cfg.train.eval_batches, cfg.train.batch_size, cfg.train.seq_len);
        let sampler = Sampler::new(cfg.train.seed);
        Ok(Self { cfg, model, layout, rt, data, sampler, val, step: 0, updates: 0, moe })
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
        for (k, spec) in t.model.units().to_vec().iter().enumerate() {
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
            t.rt.load_unit_state(UnitId(k), master, m, v)?;
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

    /// The model.
    pub fn model(&self) -> &dyn CausalLm {
        &*self.model
    }

    /// The runtime (traffic, peaks, optimizer).
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The stated fixed overhead of this run besides the host ledger ([`host_overhead_bytes`]).
    pub fn host_overhead_bytes(&self) -> u64 {
        let data = (self.data.train().len() + self.data.val().len()) as u64;
        host_overhead_bytes(&self.cfg, data)
    }

    /// Parameters in the model.
    pub fn num_params(&self) -> usize {
        self.model.units().iter().map(|u| u.numel).sum()
    }

    /// Token ids `[B, T]` U32 on the compute device.
    fn tokens(&self, ids: &[u32]) -> Result<Tensor> {
        let (b, t) = (self.cfg.train.batch_size, ids.len() / self.cfg.train.batch_size);
        Ok(Tensor::from_slice(ids, (b, t), self.rt.compute_device())?)
    }

    /// Fixes where experts run (MoE), overriding the placer; between steps only.
    pub fn set_expert_placement(&mut self, placement: ExpertPlacement) {
        if let Some(m) = &mut self.moe {
            m.placement = Some(placement);
        }
    }

    /// The MoE placer: its statistics, hot set and cost model (`[moe] policy = "ours"`).
    pub fn placer(&self) -> Option<&oogc_moe_placement::Placer> {
        self.moe.as_ref().and_then(|m| m.placer.as_ref())
    }

    /// The embedding and the blocks forward from `tokens`: the head's input, and per block what
    /// its backward needs. Resident experts stay pinned in `held` (training only); `cpu_tokens`
    /// counts expert tokens computed on the CPU.
    fn forward_trunk(
        &mut self,
        tokens: &Tensor,
        phase: Phase,
        held: &mut HashMap<UnitId, UnitParams>,
        cpu_tokens: &mut usize,
    ) -> Result<(Tensor, Vec<Checkpointed>)> {
        let model = Arc::clone(&self.model);
        let embed = self.layout.embed;
        let mut x = {
            let p = self.rt.fetch(embed, phase)?;
            let _span = tracing::info_span!("compute::forward", unit = embed.0).entered();
            model.forward(embed.0, p.tensor(), tokens, None)?
        };
        let mut saved = Vec::with_capacity(self.layout.blocks.len());
        for (i, block) in self.layout.blocks.clone().iter().enumerate() {
            let (y, routed) = match block {
                Block::Dense(u) => {
                    let p = self.rt.fetch(*u, phase)?;
                    let _span = tracing::info_span!("compute::forward", unit = u.0).entered();
                    (model.forward(u.0, p.tensor(), &x, None)?, None)
                }
                Block::Moe { trunk, experts } => {
                    let state = self.moe.as_mut().expect("an MoE model has MoE state");
                    let (y, routing, placements) =
                        state.block_forward(&mut self.rt, &*model, i, *trunk, experts, &x, phase, held, cpu_tokens)?;
                    (y, Some((routing, placements)))
                }
            };
            saved.push(Checkpointed { input: std::mem::replace(&mut x, y), moe: routed });
        }
        Ok((x, saved))
    }

    /// Runs one optimizer step on the next training batch.
    ///
    /// # Errors
    /// Runtime, model or candle failures.
    pub fn train_step(&mut self) -> Result<StepOutcome> {
        let step = self.step + 1;
        let lr = lr_schedule(&self.cfg).lr(step);
        let batch = self.sampler.next_batch(self.data.train(), self.cfg.train.batch_size, self.cfg.train.seq_len);
        let inputs = self.tokens(&batch.inputs)?;
        let targets = self.tokens(&batch.targets)?;
        let model = Arc::clone(&self.model);
        let (embed, head) = (self.layout.embed, self.layout.head);
        self.rt.begin_step(self.updates + 1, lr)?;

        // Forward: keep each block's input (the activation checkpoint).
        let mut held = HashMap::new();
        let mut cpu_tokens = 0;
        let (x, mut saved) = self.forward_trunk(&inputs, Phase::Forward, &mut held, &mut cpu_tokens)?;
        let routed: Vec<Vec<usize>> = saved.iter().filter_map(|c| c.moe.as_ref().map(|(r, _)| r.counts())).collect();
        let aux: f64 = saved.iter().filter_map(|c| c.moe.as_ref().map(|(r, _)| r.aux_loss())).sum();

        // The turn: the head's forward, loss and backward at once.
        self.rt.end_forward();
        let (loss, mut grad_x, mut tied_grad) = {
            let emb = if model.tied_head() { Some(self.rt.fetch(embed, Phase::Backward)?) } else { None };
            let p = self.rt.fetch(head, Phase::Backward)?;
            let _span = tracing::info_span!("compute::backward", unit = head.0).entered();
            let out = model.head_loss_backward(p.tensor(), &x, emb.as_ref().map(|e| e.tensor()), &targets)?;
            drop((p, emb));
            self.rt.push_grads(head, &out.grads.grad_params.to_vec1::<f32>()?)?;
            (out.loss, out.grads.grad_input.expect("the head returns its input's gradient"), out.grads.grad_tied_wte)
        };

        // Backward in reverse, recomputing each block from its checkpoint.
        for (i, block) in self.layout.blocks.clone().iter().enumerate().rev() {
            let c = saved.pop().expect("one checkpoint per block");
            grad_x = match block {
                Block::Dense(u) => {
                    let p = self.rt.fetch(*u, Phase::Backward)?;
                    let g = {
                        let _span = tracing::info_span!("compute::backward", unit = u.0).entered();
                        model.backward(u.0, p.tensor(), &c.input, &grad_x, None)?
                    };
                    drop(p);
                    self.rt.push_grads(*u, &g.grad_params.to_vec1::<f32>()?)?;
                    g.grad_input.expect("a block returns its input's gradient")
                }
                Block::Moe { trunk, experts } => {
                    let (routing, placements) = c.moe.expect("an MoE block keeps its routing");
                    let state = self.moe.as_mut().expect("an MoE model has MoE state");
                    let args = moe::BlockBackward { block: i, trunk: *trunk, experts, x_in: &c.input, grad_y: &grad_x };
                    state.block_backward(&mut self.rt, &*model, args, &routing, &placements, &mut held)?
                }
            };
        }
        {
            let p = self.rt.fetch(embed, Phase::Backward)?;
            let g = {
                let _span = tracing::info_span!("compute::backward", unit = embed.0).entered();
                model.backward(embed.0, p.tensor(), &inputs, &grad_x, None)?
            };
            drop(p);
            let mut grads = g.grad_params;
            if let Some(extra) = tied_grad.take() {
                grads = (grads + extra)?;
            }
            self.rt.push_grads(embed, &grads.to_vec1::<f32>()?)?;
        }
        let stats = self.rt.finish_step()?;
        self.step = step;
        if !stats.skipped {
            self.updates += 1;
        }
        if let Some(m) = &mut self.moe {
            m.after_step(step, &routed)?;
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
        let model = Arc::clone(&self.model);
        let (embed, head) = (self.layout.embed, self.layout.head);
        let mut total = 0.0;
        for b in self.val.clone() {
            let inputs = self.tokens(&b.inputs)?;
            let targets = self.tokens(&b.targets)?;
            let (mut held, mut cpu) = (HashMap::new(), 0);
            let (x, _) = self.forward_trunk(&inputs, Phase::Eval, &mut held, &mut cpu)?;
            drop(held);
            let emb = if model.tied_head() { Some(self.rt.fetch(embed, Phase::Eval)?) } else { None };
            let p = self.rt.fetch(head, Phase::Eval)?;
            total += model.head_loss(p.tensor(), &x, emb.as_ref().map(|e| e.tensor()), &targets)?;
        }
        Ok(total / self.val.len() as f64)
    }

    /// Per-unit flat parameter vectors (fp32 master weights), after waiting for pending updates.
    ///
    /// # Errors
    /// Runtime failures.
    pub fn master_weights(&mut self) -> Result<Vec<Vec<f32>>> {
        self.rt.sync()?;
        (0..self.rt.num_units()).map(|u| Ok(self.rt.unit_state(UnitId(u))?.0)).collect()
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
        for (k, spec) in self.model.units().iter().enumerate() {
            let (master, m, v) = self.rt.unit_state(UnitId(k))?;
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
