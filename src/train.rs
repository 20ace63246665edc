//! The reference trainer: the byte-level GPT of [`crate::model`] trained out of GPU core through
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
use crate::model::{init_params, Gpt, GptConfig, UnitSpec};
use crate::runtime::{DeviceSpec, Phase, Runtime, RuntimeConfig, StepStats, UnitId};

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
    Model(#[from] crate::model::Error),
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
        let params = init_params(&gcfg, cfg.train.seed);
        let units = model.units().to_vec();
        let mut rt = Runtime::new(runtime_config(&cfg, gcfg.num_params())?)?;
        let mut ids = Vec::with_capacity(units.len());
        for (spec, flat) in units.iter().zip(&params) {
            ids.push(rt.add_unit(&spec.name, flat)?);
        }
        rt.set_max_units_in_use(if cfg.model.tied_head { 2 } else { 1 });
        rt.check_working_set()?;
        let val = validation_batches(&data, cfg.train.eval_batches, cfg.train.batch_size, cfg.train.seq_len);
        let sampler = Sampler::new(cfg.train.seed);
        Ok(Self { cfg, model, units, rt, ids, data, sampler, val, step: 0, updates: 0 })
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
        Ok(StepOutcome { loss, lr, tokens: batch.inputs.len(), stats })
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
            for u in 0..head {
                let p = self.rt.fetch(self.ids[u], Phase::Eval)?;
                x = self.model.forward(u, p.tensor(), &x, None)?;
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
