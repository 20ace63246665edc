//! The trainer: a model of `oogc-models` (a Llama-family decoder, Mixtral, the byte-level GPT or
//! MoE-GPT) trained out of GPU core through a [`Runtime`], from a [`TrainConfig`]. `oogc train` drives it; tests drive it
//! directly. It talks to the tiers only through the [`Runtime`]'s API.
//!
//! One step (DESIGN.md, "One training step"): the forward fetches the embedding and the blocks in
//! order and keeps each block's input (the activation checkpoint); the head computes the loss
//! and its backward at once (the forward→backward turn); the backward fetches the blocks again
//! in reverse, recomputes each from its checkpoint, takes the vector-Jacobian product and pushes
//! the unit's gradients D2H to the pipelined CPU optimizer while the next unit's backward runs.
//! An MoE block is a trunk unit and one unit per expert; each routed expert runs where the
//! placement says ([`moe`]).
//!
//! **Micro-batches** (`[train] micro_batches = k`, gradient accumulation; dense models): the
//! schedule is layer-major (GreedySnake's "vertical" schedule): each unit is fetched once in the
//! forward and runs all `k` micro-batches of `batch_size` sequences, keeping each one's input;
//! the head takes each micro-batch's loss and backward in turn; in the backward each unit is
//! fetched once, recomputes and back-propagates every micro-batch, and pushes the sum of their
//! gradients once. Parameter traffic per step is that of one micro-batch, so per token it falls
//! by `k`; the checkpoints held grow by `k`. The objective is the mean over the counted tokens
//! of all `k × batch_size` sequences ([`Trainer::train_step`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;
use oogc_models::hf;
use oogc_models::llama::{Llama, LlamaConfig};
use oogc_models::{CausalLm, Gpt, GptConfig, UnitKind};
use oogc_moe_placement::Placement;

use crate::checkpoint::{self, Checkpoint, NamedTensor};
use crate::config::{GptModelConfig, LlamaModelConfig, ModelConfig, OpsPath, TrainConfig};
use crate::data::{Batch, Corpus, Sampler};
use crate::dist::{Ranks, World};
use crate::runtime::budget::{HostOverhead, OverheadInputs, RunShape};
use crate::runtime::{rank_units, HostPlan, NvmePlan, Phase, Runtime, RuntimeConfig, StepStats, UnitId, UnitParams};

mod dump;
mod moe;

pub use dump::BatchDump;
pub use moe::{ExpertPlacement, ExpertTraffic};

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
    /// The batch dump (`oogc train --dump-batches`) cannot be written.
    #[error("batch dump {path}: {reason}")]
    BatchDump {
        /// The dump file.
        path: PathBuf,
        /// What went wrong and the fix.
        reason: String,
    },
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
    /// Mean cross-entropy of the step's batch (all its micro-batches' counted tokens), nats per
    /// token.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Tokens in the step's batch (all micro-batches: `micro_batches × batch_size × seq_len`).
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
    /// MoE: the step's expert copies moved H2D and the uses that moved none.
    pub expert_traffic: ExpertTraffic,
}

/// The GPT's config from the run's `[model]` table (a GPT's), `train.seq_len` and the data's
/// vocabulary (256 for bytes, else the tokenizer's).
pub fn gpt_config(g: &GptModelConfig, seq_len: usize, vocab_size: usize) -> GptConfig {
    GptConfig {
        vocab_size,
        d_model: g.d_model,
        n_layer: g.n_layer,
        n_head: g.n_head,
        d_ff: g.d_ff,
        max_seq_len: g.max_seq_len(seq_len),
        tied_head: g.tied_head,
        moe: g.moe.as_ref().map(|m| m.to_model()),
        ..GptConfig::default()
    }
}

/// The Llama-family config of a run: `[model]`'s keys with the data's vocabulary when it gives
/// none, or the `config.json` of the checkpoint `init` names (whose vocabulary must hold the
/// tokenizer's ids).
///
/// # Errors
/// [`TrainError::Model`] for an unreadable or unsupported checkpoint; [`TrainError::Config`] for a
/// vocabulary smaller than the tokenizer's.
pub fn llama_config(l: &LlamaModelConfig, vocab_size: usize) -> Result<LlamaConfig> {
    let (config, key) = match l {
        LlamaModelConfig::Scratch(c) => {
            let mut c = c.clone();
            if c.vocab_size == 0 {
                c.vocab_size = vocab_size;
            }
            (c, "model.vocab_size")
        }
        LlamaModelConfig::Init(dir) => (hf::HfCheckpoint::open(dir)?.llama_config()?, "model.init"),
    };
    if config.vocab_size < vocab_size {
        return Err(crate::config::ConfigError::Invalid {
            key: key.into(),
            reason: format!(
                "the model's vocabulary of {} tokens is smaller than the tokenizer's {vocab_size}: use the \
                 model's own tokenizer.json (or a larger vocab_size)",
                config.vocab_size
            ),
        }
        .into());
    }
    Ok(config)
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

/// The config of this process's rank: `{rank}` and `{local_rank}` in `[budgets] nvme_dirs`
/// replaced by its own (DeepSpeed's `nvme_path_per_local_rank`); with several ranks, an NVMe
/// directory without either gets a `rank{r}` subdirectory, so ranks never share store files,
/// and only rank 0 keeps `[checkpoint] dir` and `[output] metrics` (the state is the same on
/// every rank: rank 0's checkpoint is the run's). A world of one is unchanged but for the
/// placeholders.
pub fn for_rank(mut cfg: TrainConfig, world: crate::dist::World) -> TrainConfig {
    for dir in &mut cfg.budgets.nvme_dirs {
        *dir = world.rank_dir(dir);
    }
    if !world.is_root() {
        cfg.checkpoint.dir = None;
        cfg.output.metrics = None;
    }
    cfg
}

/// The runtime's config from the run's config and its model: device, budgets, where the
/// optimizer state and the parameters live (the NVMe store sized `[budgets] nvme_size`, else by
/// [`NvmePlan`] over the model's units), prefetch depths, the CPU optimizer, the activation
/// checkpoints it offloads ([`activation_offload`]); for rank `world.rank` of `world.size` (its
/// device and its shards of the NVMe store).
pub fn runtime_config(cfg: &TrainConfig, model: &dyn CausalLm, world: World) -> RuntimeConfig {
    let units = unit_sizes(model);
    let device = cfg.device.spec(world);
    let nvme = nvme_plan(cfg, &units, world)
        .map(|p| oogc_swapper::NvmeConfig::new(cfg.budgets.nvme_dirs.clone(), p.capacity_bytes));
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
        activation_offload: activation_offload(cfg, model),
        shard_parameters: cfg.ranks.shard_parameters,
    }
}

/// The activation checkpoints a run of `model` offloads (`[activations] offload`): one
/// `[batch, seq, hidden]` input per block and micro-batch, in the compute dtype; `None` when it
/// keeps them.
pub fn activation_offload(cfg: &TrainConfig, model: &dyn CausalLm) -> Option<crate::runtime::ActivationOffload> {
    cfg.activations.offload.then(|| {
        let d = model.dims();
        crate::runtime::ActivationOffload {
            checkpoints: d.layers * cfg.train.micro_batches.max(1),
            checkpoint_bytes: cfg
                .train
                .compute_dtype
                .dtype()
                .num_bytes(cfg.train.batch_size * cfg.train.seq_len * d.hidden),
        }
    })
}

/// The CPU optimizer's config from the run's `[optimizer]` and `[threads]` tables, writing
/// compute copies of `[train] compute_dtype`.
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
        nonfinite: o.nonfinite,
        compute_dtype: cfg.train.compute_dtype.dtype(),
        rollback_budget_bytes: o.rollback_budget.map(|b| b.as_u64()),
        stream_host_budget_bytes: o
            .stream_host_budget
            .map_or(oogc_optimizer::OptimizerConfig::default().stream_host_budget_bytes, |b| b.as_u64()),
        ..oogc_optimizer::OptimizerConfig::default()
    }
}

/// The NVMe store of a run of `units` (parameters per unit): [`NvmePlan`] with the config's
/// placements and `[budgets] nvme_size`, for rank `world.rank` of `world.size`; `None` when
/// nothing lives on NVMe.
pub fn nvme_plan(cfg: &TrainConfig, units: &[usize], world: World) -> Option<NvmePlan> {
    NvmePlan::new(
        units,
        cfg.budgets.optimizer_state,
        cfg.budgets.params,
        &optimizer_config(cfg),
        cfg.budgets.nvme_size.map(|s| s.as_u64()),
        cfg.ranks.shard_parameters,
        world,
    )
}

/// Units the trainer holds pinned at once: 2 when a tied head uses the embedding beside its own
/// unit or an MoE trunk stays pinned while its experts run, else 1.
pub fn max_units_in_use(model: &dyn CausalLm) -> usize {
    if model.tied_head() || model.moe().is_some() {
        2
    } else {
        1
    }
}

/// The split of `[budgets] host` of a run of `model` (its units' parameters): [`HostPlan`], as
/// the runtime applies it from the first step on (with ranks, `world`: this rank's shards, MoE
/// experts' compute copies whole as the trainer registers them).
pub fn host_plan(cfg: &TrainConfig, model: &dyn CausalLm, world: World) -> HostPlan {
    let units = unit_sizes(model);
    let room = nvme_plan(cfg, &units, world).map_or(0, |p| p.speculation_room_bytes());
    let rc = runtime_config(cfg, model, world);
    let whole = expert_units(&Layout::of(model), units.len());
    let (shards, copies) = rank_units(world, &units, &whole, rc.shard_parameters);
    HostPlan::with_shards(&rc, &units, &shards, &copies, max_units_in_use(model), room)
}

/// Whether each of the `units` units of a model of `layout` is an MoE block's expert: fetched as
/// the router decides, outside the recorded schedule (and, with ranks sharding the parameters,
/// whole on every rank: each rank's routing decides).
fn expert_units(layout: &Layout, units: usize) -> Vec<bool> {
    let mut expert = vec![false; units];
    for b in &layout.blocks {
        if let Block::Moe { experts, .. } = b {
            experts.iter().for_each(|e| expert[e.0] = true);
        }
    }
    expert
}

/// Parameters of each unit of `model`, in unit order.
pub fn unit_sizes(model: &dyn CausalLm) -> Vec<usize> {
    model.units().iter().map(|u| u.numel).collect()
}

/// The stated overhead of a run of `cfg` besides the host ledger, by part
/// ([`HostOverhead::model`]): the process, the training text of `data_bytes`, on the sim device
/// its memory and candle's buffers, and malloc's keep; for rank `world.rank` of `world.size`.
pub fn host_overhead(cfg: &TrainConfig, model: &dyn CausalLm, data_bytes: u64, world: World) -> HostOverhead {
    overhead_inputs(cfg, model, data_bytes).overhead(&host_plan(cfg, model, world))
}

/// What the overhead model needs of a run of `cfg` with `data_bytes` of text
/// ([`OverheadInputs`]).
pub fn overhead_inputs(cfg: &TrainConfig, model: &dyn CausalLm, data_bytes: u64) -> OverheadInputs {
    let d = model.dims();
    let dtype = cfg.train.compute_dtype.dtype();
    let units = unit_sizes(model);
    let shape = RunShape {
        dtype,
        batch: cfg.train.batch_size as u64,
        micro_batches: cfg.train.micro_batches as u64,
        seq: cfg.train.seq_len as u64,
        d_model: d.hidden as u64,
        d_ff: d.intermediate as u64,
        heads: d.heads as u64,
        layers: d.layers as u64,
        vocab: model.vocab_size() as u64,
        largest_unit_bytes: units.iter().map(|&n| dtype.num_bytes(n) as u64).max().unwrap_or(0),
        compute_copies_bytes: units.iter().map(|&n| dtype.num_bytes(n) as u64).sum(),
    };
    let sim_gpu_budget_bytes = cfg.device.kind.is_sim().then(|| cfg.budgets.gpu.as_u64());
    OverheadInputs { shape, text_bytes: data_bytes, sim_gpu_budget_bytes }
}

/// Checks the run's budgets before anything is written: the host budget against the run's
/// minimum ([`HostPlan::check`]) and the NVMe store's size against its minimum and the free
/// space of its directories (`free_bytes(dir)`, e.g. statvfs; [`NvmePlan::check`]), for rank
/// `world.rank` of `world.size`.
///
/// # Errors
/// [`crate::runtime::RuntimeError::HostBudgetBelowMinimum`] or
/// [`crate::runtime::RuntimeError::NvmeTooSmall`], with the numbers and the fix.
pub fn check_budgets(
    cfg: &TrainConfig,
    model: &dyn CausalLm,
    free_bytes: &dyn Fn(&Path) -> std::io::Result<u64>,
    world: World,
) -> Result<HostPlan> {
    let plan = host_plan(cfg, model, world);
    plan.check()?;
    if let Some(nvme) = nvme_plan(cfg, &unit_sizes(model), world) {
        nvme.check(&cfg.budgets.nvme_dirs, free_bytes)?;
    }
    Ok(plan)
}

/// The vocabulary of a run's data: 256 for bytes, else its tokenizer's (the tokenizer.json is
/// read; the text is not).
///
/// # Errors
/// [`TrainError::Data`] when the tokenizer.json cannot be read or parsed.
pub fn vocab_size(cfg: &TrainConfig) -> Result<usize> {
    Ok(match &cfg.data.tokenizer {
        Some(path) => crate::data::TextTokenizer::load(path)?.vocab_size(),
        None => 256,
    })
}

/// The model of a run's config, with the data's vocabulary of `vocab_size` tokens; with
/// `[device] ops = "composed"` it computes with the candle op compositions only (the op
/// sequence a CUDA GPU runs), else with the fused CPU kernels where they apply.
///
/// # Errors
/// [`TrainError::Model`] for dimensions the model refuses.
pub fn build_model(cfg: &TrainConfig, vocab_size: usize) -> Result<Arc<dyn CausalLm>> {
    let composed = cfg.device.ops == OpsPath::Composed;
    Ok(match &cfg.model {
        ModelConfig::Gpt(g) => {
            let gpt = Gpt::new(gpt_config(g, cfg.train.seq_len, vocab_size))?
                .with_attention_chunk(cfg.device.attention_chunk)?;
            Arc::new(if composed { gpt.composed_only() } else { gpt })
        }
        ModelConfig::Llama(l) => {
            let llama = Llama::new(llama_config(l, vocab_size)?)?.with_attention_chunk(cfg.device.attention_chunk)?;
            Arc::new(if composed { llama.composed_only() } else { llama })
        }
    })
}

/// A validation result: the mean loss per token and the same total over the bytes of text the
/// targets cover, so runs with different tokenizers compare.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Evaluation {
    /// Mean cross-entropy over the validation targets, nats per token.
    pub nats_per_token: f64,
    /// Total cross-entropy / bytes of text the targets cover / ln 2, bits per byte.
    pub bits_per_byte: f64,
}

/// The units of a block: one dense unit, or an MoE trunk and its experts.
#[derive(Debug, Clone)]
enum Block {
    Dense(UnitId),
    Moe { trunk: UnitId, experts: Vec<UnitId> },
}

/// `[optimizer] device_units`: the units that keep their optimizer on the device, chosen in the
/// order their CPU update would be exposed at the end of the backward — the embedding (the
/// backward's last unit), then the blocks from the first (MoE trunks; experts follow
/// `[moe] device_optimizer`), then the head. `N`: the first `N`. `"auto"`: the spare GPU budget
/// only — what `compute_budget_bytes` (the GPU budget less gradient and activation staging: the
/// residency manager's) leaves once every unit's compute copy is in it; placing a unit costs its
/// device optimizer ([`crate::runtime::device_optimizer_bytes`]) less the compute copy it no
/// longer needs there, and units are placed in that order while they fit. So `"auto"` never takes
/// bytes the compute copies would use (a budget below the model's compute copies places none).
/// The trainer places them ([`Trainer::new`]); `oogc plan` reports the same choice.
pub fn choose_device_units(cfg: &TrainConfig, model: &dyn CausalLm, compute_budget_bytes: u64) -> Vec<UnitId> {
    use crate::config::DeviceUnits;
    let layout = Layout::of(model);
    let order = std::iter::once(layout.embed)
        .chain(layout.blocks.iter().map(|b| match b {
            Block::Dense(u) => *u,
            Block::Moe { trunk, .. } => *trunk,
        }))
        .chain((layout.head != layout.embed).then_some(layout.head));
    let dtype = cfg.train.compute_dtype.dtype();
    let units = model.units();
    match cfg.optimizer.device_units {
        DeviceUnits::Count(n) => order.take(n).collect(),
        DeviceUnits::Auto(_) => {
            let copies: u64 = units.iter().map(|u| dtype.num_bytes(u.numel) as u64).sum();
            let mut left = compute_budget_bytes.saturating_sub(copies);
            order
                .filter(|u| {
                    let n = units[u.0].numel;
                    let bytes = crate::runtime::device_optimizer_bytes(n, dtype) - dtype.num_bytes(n) as u64;
                    let fits = bytes <= left;
                    if fits {
                        left -= bytes;
                    }
                    fits
                })
                .collect()
        }
    }
}

/// Places the optimizers of [`choose_device_units`]' units on the device.
///
/// # Errors
/// [`crate::runtime::RuntimeError::Usage`] when `N` units do not fit (the message gives the
/// bytes); runtime errors moving state.
fn place_device_units(cfg: &TrainConfig, model: &dyn CausalLm, rt: &mut Runtime) -> Result<Vec<UnitId>> {
    rt.check_working_set()?;
    let placed = choose_device_units(cfg, model, rt.compute_budget_bytes());
    for &u in &placed {
        rt.place_optimizer(u, crate::runtime::OptimizerPlace::Device)?;
    }
    if !placed.is_empty() {
        let names: Vec<&str> = placed.iter().map(|&u| rt.unit_info(u).0).collect();
        tracing::info!(
            units = placed.len(),
            gpu_bytes = rt.device_optimizer_bytes(),
            names = names.join(", "),
            "device optimizers ([optimizer] device_units)"
        );
    }
    Ok(placed)
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
    /// The block's input of each micro-batch (the activation checkpoints), `[B, T, d]` each;
    /// empty when they were offloaded (`stashed`).
    inputs: Vec<Tensor>,
    /// `[activations] offload`: the inputs in host memory.
    stashed: Vec<crate::runtime::ActivationId>,
    /// MoE: the routing and where each expert ran.
    moe: Option<(oogc_models::Routing, Vec<Placement>)>,
}

/// A training run in progress.
pub struct Trainer {
    cfg: TrainConfig,
    model: Arc<dyn CausalLm>,
    layout: Layout,
    rt: Runtime,
    data: Corpus,
    sampler: Sampler,
    val: Vec<Batch>,
    /// Steps completed.
    step: u64,
    /// Optimizer updates applied (steps skipped for non-finite gradients do not count): the
    /// Adam step counter `t` of the next update is this + 1.
    updates: u64,
    /// MoE: placement, popularity and the routing trace; `None` for a dense model.
    moe: Option<moe::MoeState>,
    /// The run's ranks (a world of one without data-parallel ranks).
    ranks: Ranks,
    /// Whether the run writes checkpoints (`[checkpoint] dir`, which only rank 0 keeps): every
    /// rank gathers the state for them.
    checkpoints: bool,
    /// `--dump-batches`: each step's windows written as they are drawn ([`Trainer::dump_batches`]).
    batch_dump: Option<BatchDump>,
    /// The run's exclusive hold on its checkpoint and NVMe directories (released on drop, after
    /// the runtime has removed its store files).
    _lock: crate::lock::RunLock,
}

impl Trainer {
    /// A fresh run: parameters initialized from `train.seed`, state zero, step 0; this process
    /// as its place among `ranks` ([`Ranks::single`] for one process) trains its shard of each
    /// batch, and the ranks' collectives make the run one.
    ///
    /// # Errors
    /// Bad config, missing or short data, a budget below the minimum working set, a bad NVMe
    /// directory — each naming the key or path.
    pub fn new(cfg: TrainConfig, ranks: Ranks) -> Result<Self> {
        Self::open(cfg, ranks, None, &mut |_, _| {})
    }

    /// A fresh run (`resume` `None`), or one resumed from the newest checkpoint of a directory
    /// (or a checkpoint file) as [`Trainer::resume`], among `ranks` as [`Trainer::new`];
    /// `progress(done_bytes, total_bytes)` is
    /// called while the training text is tokenized (not when the token cache is reused).
    ///
    /// # Errors
    /// As [`Trainer::new`] and [`Trainer::resume`].
    pub fn open(
        cfg: TrainConfig,
        ranks: Ranks,
        resume: Option<&Path>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        match resume {
            Some(dir) => Self::resume_with(cfg, ranks, dir, progress),
            None => Self::build(cfg, ranks, false, progress),
        }
    }

    fn build(cfg: TrainConfig, ranks: Ranks, resuming: bool, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
        cfg.validate()?;
        let world = ranks.world();
        // Every rank takes part in a checkpoint (the state is gathered from its shards); rank 0
        // writes it.
        let checkpoints = cfg.checkpoint.dir.is_some();
        let cfg = for_rank(cfg, world);
        // The model (its shape read, nothing allocated) and the budgets it needs: too small ones
        // are refused before anything is written.
        let model = build_model(&cfg, vocab_size(&cfg)?)?;
        // The config's validation refuses micro-batches for MoE-GPT; a Mixtral's experts (from
        // its keys or an init checkpoint's config.json) are known only once the model is.
        cfg.check_moe_support(model.moe().is_some())?;
        // A killed predecessor's store files count as free: taking its lock over removes them.
        let free =
            |dir: &Path| Ok(crate::runtime::budget::statvfs_free_bytes(dir)? + crate::lock::stale_store_bytes(dir));
        check_budgets(&cfg, &*model, &free, world)?;
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
        let data = Corpus::load(&cfg.data.source(cfg.train.seq_len), progress)?;
        let num_params: usize = model.units().iter().map(|u| u.numel).sum();
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
        let mut rt = Runtime::new(runtime_config(&cfg, &*model, world), ranks.clone())?;
        // One unit at a time, straight into the runtime (never the whole model in memory): from
        // a Hugging Face checkpoint, or drawn from the run's seed.
        let init = match &cfg.model {
            ModelConfig::Llama(LlamaModelConfig::Init(dir)) => {
                let ckpt = hf::HfCheckpoint::open(dir)?;
                ckpt.check_units(model.units())?;
                Some(ckpt)
            }
            _ => None,
        };
        let layout = Layout::of(&*model);
        let experts = expert_units(&layout, model.units().len());
        for (k, spec) in model.units().iter().enumerate() {
            let flat = match &init {
                Some(ckpt) => ckpt.read_unit(spec)?,
                None => oogc_models::init_unit_from_seed(spec, cfg.train.seed),
            };
            if experts[k] {
                rt.add_unscheduled_unit(&spec.name, &flat)?;
            } else {
                rt.add_unit(&spec.name, &flat)?;
            }
        }
        let moe = match model.moe() {
            Some(_) => Some(moe::MoeState::new(&cfg, &*model, &mut rt, ranks.clone())?),
            None => None,
        };
        // A trunk stays pinned while its experts run (MoE); a tied head uses the embedding.
        rt.set_max_units_in_use(max_units_in_use(&*model));
        rt.check_working_set()?;
        place_device_units(&cfg, &*model, &mut rt)?;
        // This rank's shard of each validation batch (the whole batches in a world of one).
        let shard = crate::data::Shard { rank: world.rank, ranks: world.size };
        let val =
            data.val().validation_batches_shard(cfg.train.eval_batches, cfg.train.batch_size, cfg.train.seq_len, shard);
        let sampler = Sampler::new(cfg.train.seed);
        Ok(Self {
            cfg,
            model,
            layout,
            rt,
            data,
            sampler,
            val,
            step: 0,
            updates: 0,
            moe,
            ranks,
            checkpoints,
            batch_dump: None,
            _lock: lock,
        })
    }

    /// Resumes from the newest checkpoint in `dir` (or a checkpoint file): parameters, optimizer
    /// state, step and data position are restored, so the run continues exactly where it stopped
    /// (among `ranks` as [`Trainer::new`]: a checkpoint of any world size loads, each rank taking
    /// its shard).
    ///
    /// # Errors
    /// As [`Trainer::new`]; [`TrainError::Checkpoint`] when there is no readable checkpoint;
    /// [`TrainError::Mismatch`] when its model differs from the config's.
    pub fn resume(cfg: TrainConfig, ranks: Ranks, dir: &Path) -> Result<Self> {
        Self::resume_with(cfg, ranks, dir, &mut |_, _| {})
    }

    fn resume_with(cfg: TrainConfig, ranks: Ranks, dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
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
        let mut t = Self::build(cfg, ranks, true, progress)?;
        if let (Some(saved), Some(ours)) = (ckpt.metadata.get("data_key"), t.data.key()) {
            if *saved != ours {
                return Err(mismatch(format!(
                    "its tokens came from another text or tokenizer.json (data key {saved}, now {ours})"
                )));
            }
        }
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
    pub fn data(&self) -> &Corpus {
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

    /// The stated overhead of this run besides the host ledger, by part ([`host_overhead`]).
    pub fn host_overhead(&self) -> HostOverhead {
        let data = match &self.data {
            Corpus::Bytes(t) => (t.train().len() + t.val().len()) as u64,
            // The token file is mapped: its pages are the process's once read.
            Corpus::Tokens(t) => std::fs::metadata(t.cache_path()).map_or(0, |m| m.len()),
        };
        host_overhead(&self.cfg, &*self.model, data, self.ranks.world())
    }

    /// This process's place in the run (a world of one without data-parallel ranks).
    pub fn world(&self) -> World {
        self.ranks.world()
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

    /// From the next step on, writes each step's token windows to `dump` as the sampler draws
    /// them, before the step computes ([`BatchDump`]: JSON Lines, one line per micro-batch with
    /// its `inputs` and `targets`), so that another implementation can train on the same batches.
    ///
    /// # Errors
    /// [`TrainError::BatchDump`] in a data-parallel run of several ranks (each rank trains on its
    /// own shard of the batch).
    pub fn dump_batches(&mut self, dump: BatchDump) -> Result<()> {
        if self.ranks.world().size > 1 {
            return Err(TrainError::BatchDump {
                path: dump.path().into(),
                reason: format!(
                    "a dump holds one process's batches, and this run has {} ranks, each training on its shard\n  \
                     fix: dump a run of one process (the ranks' shards together are its batches)",
                    self.ranks.world().size
                ),
            });
        }
        self.batch_dump = Some(dump);
        Ok(())
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

    /// The embedding and the blocks forward from `tokens` (one `[B, T]` tensor per micro-batch),
    /// layer-major: each unit is fetched once and runs every micro-batch before the next unit.
    /// Returns the head's inputs (one per micro-batch) and per block what its backward needs.
    /// Resident experts stay pinned in `held` (training only); `cpu_tokens` counts expert tokens
    /// computed on the CPU.
    ///
    /// # Panics
    /// An MoE block with more than one micro-batch ([`TrainConfig::validate`] refuses it).
    fn forward_trunk(
        &mut self,
        tokens: &[Tensor],
        phase: Phase,
        held: &mut HashMap<UnitId, UnitParams>,
        cpu_tokens: &mut usize,
    ) -> Result<(Vec<Tensor>, Vec<Checkpointed>)> {
        let model = Arc::clone(&self.model);
        let embed = self.layout.embed;
        let mut xs = {
            let p = self.rt.fetch(embed, phase)?;
            let _span = tracing::info_span!("compute::forward", unit = embed.0).entered();
            tokens.iter().map(|t| model.forward(embed.0, p.tensor(), t, None)).collect::<Result<Vec<_>, _>>()?
        };
        let mut saved = Vec::with_capacity(self.layout.blocks.len());
        for (i, block) in self.layout.blocks.clone().iter().enumerate() {
            let (ys, routed) = match block {
                Block::Dense(u) => {
                    let p = self.rt.fetch(*u, phase)?;
                    let _span = tracing::info_span!("compute::forward", unit = u.0).entered();
                    let ys =
                        xs.iter().map(|x| model.forward(u.0, p.tensor(), x, None)).collect::<Result<Vec<_>, _>>()?;
                    (ys, None)
                }
                Block::Moe { trunk, experts } => {
                    let [x] = xs.as_slice() else { panic!("an MoE model trains one micro-batch per step") };
                    let state = self.moe.as_mut().expect("an MoE model has MoE state");
                    let (y, routing, placements) =
                        state.block_forward(&mut self.rt, &*model, i, *trunk, experts, x, phase, held, cpu_tokens)?;
                    (vec![y], Some((routing, placements)))
                }
            };
            let inputs = std::mem::replace(&mut xs, ys);
            let c = if self.cfg.activations.offload && phase == Phase::Forward && routed.is_none() {
                // Offloaded: D2H into pinned host memory now, the device copy dropped here.
                let stashed = inputs.iter().map(|x| self.rt.stash_activation(x)).collect::<Result<Vec<_>, _>>()?;
                Checkpointed { inputs: Vec::new(), stashed, moe: routed }
            } else {
                Checkpointed { inputs, stashed: Vec::new(), moe: routed }
            };
            saved.push(c);
        }
        Ok((xs, saved))
    }

    /// Runs one optimizer step on the next training batch: `train.micro_batches` micro-batches
    /// of `train.batch_size` sequences, drawn as one batch of their product (so a run's batches
    /// do not depend on how a step is split), trained layer-major (each unit fetched once in the
    /// forward and once in the backward for all of them) with their gradients summed before the
    /// unit's one [`Runtime::push_grads`]. The loss and its gradients are those of the mean
    /// cross-entropy over every counted token of the step: micro-batch `j` with `n_j` counted
    /// tokens of `N` in all contributes its mean's gradient scaled by `n_j / N`.
    ///
    /// # Errors
    /// Runtime, model or candle failures; with ranks, a failed collective (the run cannot go
    /// on: the caller ends it, [`Ranks::abort`]).
    pub fn train_step(&mut self) -> Result<StepOutcome> {
        crate::hooks::crash_point("step");
        let step = self.step + 1;
        let lr = lr_schedule(&self.cfg).lr(step);
        let (micro, k) = (self.cfg.train.batch_size, self.cfg.train.micro_batches.max(1));
        // This rank's windows of the step's global batch (all of it in a world of one).
        let (rank, ranks) = (self.ranks.world().rank, self.ranks.world().size);
        let shard = crate::data::Shard { rank, ranks };
        let batch = self.data.next_batch_shard(&mut self.sampler, micro * k, self.cfg.train.seq_len, shard);
        if let Some(dump) = &mut self.batch_dump {
            dump.write_step(step, &batch, k)?;
        }
        let per_micro = batch.inputs.len() / k;
        let split = |ids: &[u32]| ids.chunks(per_micro).map(|c| self.tokens(c)).collect::<Result<Vec<_>>>();
        let inputs = split(&batch.inputs)?;
        let targets = split(&batch.targets)?;
        let model = Arc::clone(&self.model);
        let (embed, head) = (self.layout.embed, self.layout.head);
        self.rt.begin_step(self.updates + 1, lr)?;

        if let Some(m) = &mut self.moe {
            m.traffic = ExpertTraffic::default();
        }
        // Forward: keep each block's inputs (the activation checkpoints of every micro-batch).
        let mut held = HashMap::new();
        let mut cpu_tokens = 0;
        let (xs, mut saved) = self.forward_trunk(&inputs, Phase::Forward, &mut held, &mut cpu_tokens)?;
        let routed: Vec<Vec<usize>> = saved.iter().filter_map(|c| c.moe.as_ref().map(|(r, _)| r.counts())).collect();
        // The pass's routings together: a load-balancing loss pooled over the blocks (Mixtral)
        // gives each routing its weights before any block's backward; MoE-GPT's is per block.
        let aux = match model.moe() {
            Some(moe) => {
                let mut routings: Vec<&mut oogc_models::Routing> =
                    saved.iter_mut().filter_map(|c| c.moe.as_mut().map(|(r, _)| r)).collect();
                moe.finish_forward(&mut routings)?;
                let routings: Vec<&oogc_models::Routing> = routings.into_iter().map(|r| &*r).collect();
                moe.aux_loss(&routings)
            }
            None => 0.0,
        };

        // The turn: the head's forward, loss and backward at once, per micro-batch.
        self.rt.end_forward();
        let (loss, mut grad_xs, tied_grad) = {
            let emb = if model.tied_head() { Some(self.rt.fetch(embed, Phase::Backward)?) } else { None };
            let p = self.rt.fetch(head, Phase::Backward)?;
            let _span = tracing::info_span!("compute::backward", unit = head.0).entered();
            let mut acc = HeadAccumulator::new(batch.targets.chunks(per_micro));
            for (x, t) in xs.iter().zip(&targets) {
                acc.add(model.head_loss_backward(p.tensor(), x, emb.as_ref().map(|e| e.tensor()), t)?)?;
            }
            drop((p, emb));
            let mut grads = acc.grads.expect("at least one micro-batch");
            if crate::hooks::nan_grads_at(step) {
                grads = grads.affine(f64::NAN, 0.0)?;
            }
            self.rt.push_grads(head, &grads)?;
            (acc.loss, acc.grad_inputs, acc.tied)
        };

        // Backward in reverse, recomputing each block from its checkpoints.
        for (i, block) in self.layout.blocks.clone().iter().enumerate().rev() {
            let mut c = saved.pop().expect("one checkpoint per block");
            if !c.stashed.is_empty() {
                // Offloaded checkpoints come back H2D; the next block's first one is prefetched
                // so its copy overlaps this block's backward.
                for id in std::mem::take(&mut c.stashed) {
                    c.inputs.push(self.rt.take_activation(id)?);
                }
                if let Some(&next) = saved.last().and_then(|n| n.stashed.first()) {
                    self.rt.prefetch_activation(next)?;
                }
            }
            grad_xs = match block {
                Block::Dense(u) => {
                    let p = self.rt.fetch(*u, Phase::Backward)?;
                    let (grads, grad_inputs) = {
                        let _span = tracing::info_span!("compute::backward", unit = u.0).entered();
                        backward_micro_batches(&*model, u.0, p.tensor(), &c.inputs, &grad_xs)?
                    };
                    drop(p);
                    self.rt.push_grads(*u, &grads)?;
                    grad_inputs.into_iter().map(|g| g.expect("a block returns its input's gradient")).collect()
                }
                Block::Moe { trunk, experts } => {
                    let (routing, placements) = c.moe.expect("an MoE block keeps its routing");
                    let state = self.moe.as_mut().expect("an MoE model has MoE state");
                    let (x_in, grad_y) = (&c.inputs[0], &grad_xs[0]);
                    let args = moe::BlockBackward { block: i, trunk: *trunk, experts, x_in, grad_y };
                    vec![state.block_backward(&mut self.rt, &*model, args, &routing, &placements, &mut held)?]
                }
            };
        }
        {
            let p = self.rt.fetch(embed, Phase::Backward)?;
            let (mut grads, _) = {
                let _span = tracing::info_span!("compute::backward", unit = embed.0).entered();
                backward_micro_batches(&*model, embed.0, p.tensor(), &inputs, &grad_xs)?
            };
            drop(p);
            if let Some(extra) = tied_grad {
                // The embedding's own gradient and the tied head's, summed in f32 for half
                // dtypes (the same value as candle's half add, which rounds f32's sum once).
                grads = (widen(&grads)? + widen(&extra)?)?;
            }
            self.rt.push_grads(embed, &grads)?;
        }
        let stats = self.rt.finish_step()?;
        self.step = step;
        if !stats.skipped {
            self.updates += 1;
        }
        if let Some(m) = &mut self.moe {
            m.after_step(&mut self.rt, step, &routed)?;
        }
        // The step's loss over the global batch: the ranks' means averaged (equal shards).
        // Every gradient reduction of the step is done (finish_step waited for them).
        let loss = if ranks > 1 {
            let mut l = [loss];
            self.ranks.all_reduce_sum_f64(&mut l).map_err(crate::runtime::RuntimeError::from)?;
            l[0] / ranks as f64
        } else {
            loss
        };
        Ok(StepOutcome {
            loss,
            lr,
            tokens: batch.inputs.len() * ranks,
            stats,
            aux_loss: aux,
            routed_tokens: routed,
            cpu_tokens,
            expert_traffic: self.moe.as_ref().map(|m| m.traffic).unwrap_or_default(),
        })
    }

    /// The validation loss over the fixed validation batches, with the latest parameters
    /// (pending updates are awaited): nats per token and bits per byte.
    ///
    /// # Errors
    /// Runtime, model or candle failures; with ranks, a failed collective.
    pub fn evaluate(&mut self) -> Result<Evaluation> {
        let model = Arc::clone(&self.model);
        let (embed, head) = (self.layout.embed, self.layout.head);
        let (mut nats, mut targets, mut bytes) = (0.0, 0u64, 0u64);
        // Each rank evaluates its shard of every validation batch; the sums are the run's.
        let ranks = self.ranks.world().size;
        for b in self.val.clone() {
            let inputs = self.tokens(&b.inputs)?;
            let target_ids = self.tokens(&b.targets)?;
            let (mut held, mut cpu) = (HashMap::new(), 0);
            let (xs, _) = self.forward_trunk(std::slice::from_ref(&inputs), Phase::Eval, &mut held, &mut cpu)?;
            drop(held);
            let x = &xs[0];
            let emb = if model.tied_head() { Some(self.rt.fetch(embed, Phase::Eval)?) } else { None };
            let p = self.rt.fetch(head, Phase::Eval)?;
            let mean = model.head_loss(p.tensor(), x, emb.as_ref().map(|e| e.tensor()), &target_ids)?;
            nats += mean * b.targets.len() as f64;
            targets += b.targets.len() as u64;
            bytes += b.target_bytes;
        }
        if ranks > 1 {
            let mut sums = [nats, targets as f64, bytes as f64];
            self.ranks.all_reduce_sum_f64(&mut sums).map_err(crate::runtime::RuntimeError::from)?;
            (nats, targets, bytes) = (sums[0], sums[1] as u64, sums[2] as u64);
        }
        Ok(Evaluation {
            nats_per_token: nats / targets.max(1) as f64,
            bits_per_byte: nats / bytes.max(1) as f64 / std::f64::consts::LN_2,
        })
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
        if !self.checkpoints {
            return Ok(None);
        }
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
        // The other ranks took part in gathering the state; rank 0 writes it.
        let Some(dir) = self.cfg.checkpoint.dir.clone() else { return Ok(None) };
        let mut metadata = BTreeMap::new();
        metadata.insert("format".into(), "oogc-gpt-1".into());
        metadata.insert("optimizer_updates".into(), self.updates.to_string());
        metadata.insert("model".into(), serde_json::to_string(&self.cfg.model).expect("model config serializes"));
        metadata.insert("sampler".into(), serde_json::to_string(&self.sampler).expect("sampler serializes"));
        metadata.insert("config".into(), toml::to_string(&self.cfg).unwrap_or_default());
        metadata.insert("data".into(), self.data.path().display().to_string());
        if let Some(key) = self.data.key() {
            metadata.insert("data_key".into(), key);
        }
        let ckpt = Checkpoint { step: self.step, metadata, tensors };
        let keep = self.cfg.checkpoint.keep.unwrap_or(2);
        Ok(Some(checkpoint::save(&dir, &ckpt, keep)?))
    }
}

/// Accumulates the head's outcome of a step's micro-batches as one batch of all of them: the
/// loss is the mean over every counted token (`Σ n_j · loss_j / N`, micro-batch `j` counting
/// `n_j` of the step's `N` targets that are not [`oogc_models::IGNORE_INDEX`]); the head's
/// gradients and the tied embedding's are summed with micro-batch `j`'s scaled by `n_j / N`, and
/// so is each micro-batch's input gradient. With one micro-batch nothing is scaled (bit for bit
/// the batch's own outcome).
struct HeadAccumulator {
    /// `n_j / N` per micro-batch; empty for one micro-batch.
    shares: Vec<f64>,
    loss: f64,
    grads: Option<Tensor>,
    grad_inputs: Vec<Tensor>,
    tied: Option<Tensor>,
}

impl HeadAccumulator {
    /// For the micro-batches whose targets are `targets` (flat ids each).
    fn new<'a>(targets: impl ExactSizeIterator<Item = &'a [u32]>) -> Self {
        let shares = if targets.len() == 1 {
            Vec::new()
        } else {
            let counted: Vec<usize> =
                targets.map(|t| t.iter().filter(|&&id| id != oogc_models::IGNORE_INDEX).count()).collect();
            let total = counted.iter().sum::<usize>().max(1) as f64;
            counted.iter().map(|&n| n as f64 / total).collect()
        };
        Self { shares, loss: 0.0, grads: None, grad_inputs: Vec::new(), tied: None }
    }

    /// Adds the next micro-batch's outcome. With several micro-batches the parameters'
    /// gradients are scaled and summed in f32 for half dtypes (one rounding at the push); each
    /// input gradient is scaled in f32 and rounded back to its dtype (the blocks' backward takes
    /// the params' dtype).
    fn add(&mut self, out: oogc_models::HeadLossGrads) -> Result<()> {
        let share = self.shares.get(self.grad_inputs.len()).copied();
        let scale = |t: Tensor| -> Result<Tensor> {
            Ok(match share {
                Some(s) => widen(&t)?.affine(s, 0.0)?,
                None => t,
            })
        };
        self.loss = match share {
            Some(s) => self.loss + out.loss * s,
            None => out.loss,
        };
        sum_into(&mut self.grads, scale(out.grads.grad_params)?)?;
        let grad_input = out.grads.grad_input.expect("the head returns its input's gradient");
        let dtype = grad_input.dtype();
        self.grad_inputs.push(scale(grad_input)?.to_dtype(dtype)?);
        if let Some(t) = out.grads.grad_tied_wte {
            sum_into(&mut self.tied, scale(t)?)?;
        }
        Ok(())
    }
}

/// `acc += t` (`acc = t` when empty). Gradients of half dtypes (bf16, f16) are summed in f32:
/// the sum stays f32 and is rounded once, when it is pushed (DESIGN.md "Precision": gradient
/// accumulation in f32). One term alone is left as it is.
fn sum_into(acc: &mut Option<Tensor>, t: Tensor) -> Result<()> {
    *acc = Some(match acc.take() {
        Some(a) => (widen(&a)? + widen(&t)?)?,
        None => t,
    });
    Ok(())
}

/// `t` in f32 when it is of a half dtype (exact), else `t` itself.
fn widen(t: &Tensor) -> Result<Tensor> {
    Ok(match t.dtype() {
        candle_core::DType::BF16 | candle_core::DType::F16 => t.to_dtype(candle_core::DType::F32)?,
        _ => t.clone(),
    })
}

/// The backward of unit `unit` for each micro-batch (its checkpointed `inputs` and output
/// gradients `grad_ys`, in order) with one fetch of its parameters: the parameters' gradients
/// summed over the micro-batches (in order) and each micro-batch's input gradient.
fn backward_micro_batches(
    model: &dyn CausalLm,
    unit: usize,
    params: &Tensor,
    inputs: &[Tensor],
    grad_ys: &[Tensor],
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    let mut sum = None;
    let mut grad_inputs = Vec::with_capacity(inputs.len());
    for (x, g) in inputs.iter().zip(grad_ys) {
        let ug = model.backward(unit, params, x, g, None)?;
        sum_into(&mut sum, ug.grad_params)?;
        grad_inputs.push(ug.grad_input);
    }
    Ok((sum.expect("at least one micro-batch"), grad_inputs))
}
