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
//! placement says (the crate-private `train::moe`, over [`crate::moe`]'s placement config).
//!
//! **Micro-batches** (`[train] micro_batches = k`, gradient accumulation; dense models): the
//! schedule is layer-major (GreedySnake's "vertical" schedule): each unit is fetched once in the
//! forward and runs all `k` micro-batches of `batch_size` sequences, keeping each one's input;
//! the head takes each micro-batch's loss and backward in turn; in the backward each unit is
//! fetched once, recomputes and back-propagates every micro-batch, and pushes the sum of their
//! gradients once. Parameter traffic per step is that of one micro-batch, so per token it falls
//! by `k`; the checkpoints held grow by `k`. The objective is the mean over the counted tokens
//! of all `k × batch_size` sequences ([`Trainer::train_step`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;
use oogc_models::hf;
use oogc_models::{CausalLm, UnitKind};
use oogc_moe_placement::Placement;

use crate::checkpoint;
use crate::config::{LlamaModelConfig, ModelConfig, TrainConfig};
use crate::data::{Batch, Corpus, Sampler};
use crate::dist::{Ranks, World};
use crate::runtime::budget::HostOverhead;
use crate::runtime::{Runtime, StepStats, UnitId};
use ckpt::UnitLayout;

mod background;
mod build;
mod ckpt;
mod clock;
mod dump;
mod moe;
mod step;

pub use build::{
    activation_offload, build_model, check_budgets, choose_device_units, for_rank, gpt_config, host_overhead,
    host_plan, llama_config, lr_schedule, max_units_in_use, nvme_plan, optimizer_config, overhead_inputs,
    runtime_config, unit_sizes, vocab_size,
};
use build::{expert_units, place_device_units};

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
    /// MoE: tokens routed to each expert, per MoE block (`[block][expert]`, the sparse layers in
    /// order: a model's dense layers among its sparse ones have no entry); empty for a dense
    /// model.
    pub routed_tokens: Vec<Vec<usize>>,
    /// MoE: tokens whose expert ran on the CPU from its host copy this step (forward).
    pub cpu_tokens: usize,
    /// MoE: the step's expert copies moved H2D and the uses that moved none.
    pub expert_traffic: ExpertTraffic,
    /// Wall time of the whole [`Trainer::train_step`] call, seconds: the runtime's step
    /// (`stats.figures.step_s`, from `begin_step` to the end of `finish_step`) and the trainer's
    /// work before it (the batch's token tensors) and after it (the MoE placer's statistics and
    /// replan, the routing trace).
    pub wall_s: f64,
    /// Of `wall_s`, the time inside the model's calls (the compute): every unit's forward,
    /// recompute and backward, an MoE block's routing, its gathers of each expert's tokens and
    /// scatters back, the combine and the load-balancing loss, the head's loss; seconds. On the
    /// sim device these are candle's CPU ops; on CUDA the host's time issuing kernels (candle's
    /// CUDA ops return before the GPU is done), so there it is not the GPU's compute.
    pub compute_s: f64,
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

/// The units of a block, by their index in the model's unit list (what the model's calls
/// take; the runtime's ids come from the trainer's `ids`): one dense unit, or an MoE trunk and
/// its experts.
#[derive(Debug, Clone)]
enum Block {
    Dense(usize),
    Moe { trunk: usize, experts: Vec<usize> },
}

/// Where the model's units are, by role (from their [`UnitKind`]s), as indices in the model's
/// unit list.
#[derive(Debug, Clone)]
struct Layout {
    embed: usize,
    blocks: Vec<Block>,
    head: usize,
}

impl Layout {
    fn of(model: &dyn CausalLm) -> Self {
        let units = model.units();
        let mut blocks: Vec<Block> = Vec::new();
        for (k, u) in units.iter().enumerate() {
            let id = k;
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
        Self { embed: 0, blocks, head: units.len() - 1 }
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
    /// The runtime's id of each model unit, in the model's order (from registration): the one
    /// mapping between the model's unit index and the runtime's [`UnitId`].
    ids: Vec<UnitId>,
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
    /// Whether the run writes checkpoints (`[checkpoint] dir`): every rank gathers the state for
    /// them, rank 0 writes.
    checkpoints: bool,
    /// `--dump-batches`: each step's windows written as they are drawn ([`Trainer::dump_batches`]).
    batch_dump: Option<BatchDump>,
    /// Time in the model's calls ([`StepOutcome::compute_s`]), shared with the MoE state.
    clock: clock::ComputeClock,
    /// The checkpoint being written in the background ([`Trainer::start_checkpoint`]).
    in_flight: Option<background::InFlight>,
    /// The checkpoint writer's staging, kept from save to save ([`background`]).
    ckpt_staging: Option<background::Staging>,
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
        resume: Option<ResumeFrom<'_>>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        match resume {
            Some(from) => Self::resume_with(cfg, ranks, from, progress),
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
        // Rank 0 alone locks (and writes into) the checkpoint directory.
        let lock = if world.is_root() {
            crate::lock::RunLock::for_config(&cfg)?
        } else {
            let mut others = cfg.clone();
            others.checkpoint.dir = None;
            crate::lock::RunLock::for_config(&others)?
        };
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
        let mut ids = Vec::with_capacity(model.units().len());
        for (k, spec) in model.units().iter().enumerate() {
            let flat = match &init {
                Some(ckpt) => ckpt.read_unit(spec)?,
                None => oogc_models::init_unit_from_seed(spec, cfg.train.seed),
            };
            ids.push(if experts[k] {
                rt.add_unscheduled_unit(&spec.name, &flat)?
            } else {
                rt.add_unit(&spec.name, &flat)?
            });
        }
        let clock = clock::ComputeClock::default();
        let moe = match model.moe() {
            Some(_) => Some(moe::MoeState::new(&cfg, &*model, &mut rt, &ids, ranks.clone(), clock.clone())?),
            None => None,
        };
        // A trunk stays pinned while its experts run (MoE); a tied head uses the embedding.
        rt.set_max_units_in_use(max_units_in_use(&*model));
        rt.check_working_set()?;
        place_device_units(&cfg, &*model, &mut rt, &ids)?;
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
            ids,
            data,
            sampler,
            val,
            step: 0,
            updates: 0,
            moe,
            ranks,
            checkpoints,
            batch_dump: None,
            clock,
            in_flight: None,
            ckpt_staging: None,
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
        Self::resume_with(cfg, ranks, ResumeFrom { path: dir, convert_state: false }, &mut |_, _| {})
    }

    fn resume_with(
        cfg: TrainConfig,
        ranks: Ranks,
        from: ResumeFrom<'_>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let ResumeFrom { path: dir, convert_state } = from;
        // The header alone: the units' state is read one unit at a time below.
        let ckpt = checkpoint::AnyReader::open(dir)?;
        if !ckpt.has_checksums() {
            tracing::warn!(
                path = %ckpt.path().display(),
                "checkpoint has no checksums (written before oogc checked them): it cannot be verified"
            );
        }
        let path = ckpt.path().to_path_buf();
        let step = ckpt.step()?;
        let mismatch = |reason: String| TrainError::Mismatch {
            path: path.clone(),
            reason: format!("cannot resume: {reason}\n  fix: resume with the config the checkpoint was written with"),
        };
        let saved_model = ckpt.metadata().get("model").ok_or_else(|| mismatch("no `model` metadata".into()))?;
        let ours = serde_json::to_string(&cfg.model).expect("model config serializes");
        if *saved_model != ours {
            return Err(mismatch(format!("checkpoint model {saved_model} != config model {ours}")));
        }
        let mut t = Self::build(cfg, ranks, true, progress)?;
        if let (Some(saved), Some(ours)) = (ckpt.metadata().get("data_key"), t.data.key()) {
            if *saved != ours {
                return Err(mismatch(format!(
                    "its tokens came from another text or tokenizer.json (data key {saved}, now {ours})"
                )));
            }
        }
        for (key, what, ours) in [
            ("state_dtype", "Adam moments", t.cfg.optimizer.state_dtype.name()),
            ("master_dtype", "master weights", t.cfg.optimizer.master_dtype.name()),
        ] {
            let saved = ckpt.metadata().get(key).map_or("f32", String::as_str);
            if saved == ours {
                continue;
            }
            if !convert_state {
                return Err(TrainError::Mismatch {
                    path: path.clone(),
                    reason: format!(
                        "cannot resume: the checkpoint's {what} are {saved}, [optimizer] {key} is {ours}\n  fix: add \
                         --convert-state to convert them to {ours} (Trainer::open with ResumeFrom::convert_state), or \
                         set [optimizer] {key} = \"{saved}\""
                    ),
                });
            }
            tracing::warn!(
                path = %path.display(),
                from = saved,
                to = ours,
                "converting the checkpoint's {what} (--convert-state): the run continues from converted state"
            );
        }
        let world = t.ranks.world();
        let (state, master) = (t.cfg.optimizer.state_dtype, t.cfg.optimizer.master_dtype);
        for (k, spec) in t.model.units().to_vec().iter().enumerate() {
            let id = t.ids[k];
            let layout = UnitLayout::new(t.rt.units().optimizer_place(id), state, master);
            ckpt::load_unit(&mut t.rt, world, id, spec, layout, &ckpt)?;
        }
        let sampler = ckpt.metadata().get("sampler").ok_or_else(|| mismatch("no `sampler` metadata".into()))?;
        t.sampler = serde_json::from_str(sampler).map_err(|e| mismatch(format!("sampler state: {e}")))?;
        t.step = step;
        t.updates = match ckpt.metadata().get("optimizer_updates") {
            Some(u) => u.parse().map_err(|e| mismatch(format!("optimizer_updates: {e}")))?,
            None => t.step,
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

    /// Per-unit flat parameter vectors (fp32 master weights), after waiting for pending updates.
    ///
    /// # Errors
    /// Runtime failures.
    pub fn master_weights(&mut self) -> Result<Vec<Vec<f32>>> {
        self.rt.sync()?;
        self.ids.iter().map(|&u| Ok(self.rt.unit_state(u)?.master)).collect()
    }

    /// A checkpoint's string metadata: format, optimizer updates, the state's dtypes, the model,
    /// sampler and run config, the text and its data key.
    fn checkpoint_metadata(&self) -> BTreeMap<String, String> {
        let mut metadata = BTreeMap::new();
        metadata.insert("format".into(), "oogc-gpt-1".into());
        metadata.insert("optimizer_updates".into(), self.updates.to_string());
        metadata.insert("state_dtype".into(), self.cfg.optimizer.state_dtype.name().into());
        metadata.insert("master_dtype".into(), self.cfg.optimizer.master_dtype.name().into());
        metadata.insert("model".into(), serde_json::to_string(&self.cfg.model).expect("model config serializes"));
        metadata.insert("sampler".into(), serde_json::to_string(&self.sampler).expect("sampler serializes"));
        metadata.insert("config".into(), toml::to_string(&self.cfg).unwrap_or_default());
        metadata.insert("data".into(), self.data.path().display().to_string());
        if let Some(key) = self.data.key() {
            metadata.insert("data_key".into(), key);
        }
        metadata
    }
}

/// Where a run resumes from ([`Trainer::open`]): a checkpoint file or the directory whose newest
/// checkpoint is taken.
#[derive(Debug, Clone, Copy)]
pub struct ResumeFrom<'a> {
    /// The checkpoint file or directory.
    pub path: &'a Path,
    /// Convert Adam moments saved in another dtype than `[optimizer] state_dtype` (through f32:
    /// what the new dtype cannot hold is lost). Without it such a checkpoint is refused
    /// (`oogc train --convert-state`).
    pub convert_state: bool,
}
