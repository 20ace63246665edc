//! From a run's TOML config to what the trainer builds: the model's config and the model, the
//! runtime's config (device, budgets, placements, the optimizer's hyper-parameters and schedule),
//! the host and NVMe plans and the overhead model, and the units whose optimizer lives on the
//! device (`[optimizer] device_units`). Pure functions of the config and the model, shared with
//! `oogc plan`.

use std::path::Path;
use std::sync::Arc;

use oogc_models::hf;
use oogc_models::llama::{Llama, LlamaConfig};
use oogc_models::{CausalLm, Gpt, GptConfig};

use crate::config::{GptModelConfig, LlamaModelConfig, ModelConfig, OpsPath, TrainConfig};
use crate::dist::World;
use crate::runtime::budget::{HostOverhead, OverheadInputs, RunShape};
use crate::runtime::{rank_units, HostPlan, NvmePlan, Runtime, RuntimeConfig, UnitId};

use super::{Block, Layout, Result};

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
/// [`TrainError::Model`](super::TrainError::Model) for an unreadable or unsupported checkpoint;
/// [`TrainError::Config`](super::TrainError::Config) for a vocabulary smaller than the tokenizer's.
pub fn llama_config(l: &LlamaModelConfig, vocab_size: usize) -> Result<LlamaConfig> {
    let (config, key) = match l {
        LlamaModelConfig::Scratch(c) => {
            let mut c = (**c).clone();
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
/// and only rank 0 keeps `[output] metrics`. Every rank keeps `[checkpoint] dir`: each takes
/// part in a save (the units' state is gathered from the ranks' shards, staged on each: the host
/// plan holds room for it everywhere) and a fresh run into a directory holding checkpoints is
/// refused on every rank alike; rank 0 alone locks it and writes the checkpoint (the state is
/// the same on every rank). A world of one is unchanged but for the placeholders.
pub fn for_rank(mut cfg: TrainConfig, world: crate::dist::World) -> TrainConfig {
    for dir in &mut cfg.budgets.nvme_dirs {
        *dir = world.rank_dir(dir);
    }
    if !world.is_root() {
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
        checkpoint_staging: cfg.checkpoint.dir.is_some(),
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
        state_dtype: o.state_dtype,
        master_dtype: o.master_dtype,
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
pub(super) fn expert_units(layout: &Layout, units: usize) -> Vec<bool> {
    let mut expert = vec![false; units];
    for b in &layout.blocks {
        if let Block::Moe { experts, .. } = b {
            experts.iter().for_each(|&e| expert[e] = true);
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
/// [`TrainError::Data`](super::TrainError::Data) when the tokenizer.json cannot be read or parsed.
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
/// [`TrainError::Model`](super::TrainError::Model) for dimensions the model refuses.
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

/// `[optimizer] device_units`: the units that keep their optimizer on the device, chosen in the
/// order their CPU update would be exposed at the end of the backward — the embedding (the
/// backward's last unit), then the blocks from the first (MoE trunks; experts follow
/// `[moe] device_optimizer`), then the head. `N`: the first `N`. `"auto"`: the spare GPU budget
/// only — what `compute_budget_bytes` (the GPU budget less gradient and activation staging: the
/// residency manager's) leaves once every unit's compute copy is in it; placing a unit costs its
/// device optimizer ([`crate::runtime::device_optimizer_bytes`]) less the compute copy it no
/// longer needs there, and units are placed in that order while they fit. So `"auto"` never takes
/// bytes the compute copies would use (a budget below the model's compute copies places none).
/// The trainer places them ([`Trainer::new`](super::Trainer::new)); `oogc plan` reports the same choice.
pub fn choose_device_units(cfg: &TrainConfig, model: &dyn CausalLm, compute_budget_bytes: u64) -> Vec<usize> {
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
                    let n = units[*u].numel;
                    let bytes = crate::runtime::device_optimizer_bytes(n, dtype, cfg.optimizer.state_dtype)
                        - dtype.num_bytes(n) as u64;
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

/// Places the optimizers of [`choose_device_units`]' units on the device (`ids`: the runtime's
/// id of each model unit).
///
/// # Errors
/// [`crate::runtime::RuntimeError::Usage`] when `N` units do not fit (the message gives the
/// bytes); runtime errors moving state.
pub(super) fn place_device_units(
    cfg: &TrainConfig,
    model: &dyn CausalLm,
    rt: &mut Runtime,
    ids: &[UnitId],
) -> Result<Vec<UnitId>> {
    rt.check_working_set()?;
    let placed: Vec<UnitId> =
        choose_device_units(cfg, model, rt.memory().compute_budget_bytes()).into_iter().map(|k| ids[k]).collect();
    for &u in &placed {
        rt.place_optimizer(u, crate::runtime::OptimizerPlace::Device)?;
    }
    if !placed.is_empty() {
        let names: Vec<&str> = placed.iter().map(|&u| rt.units().name(u)).collect();
        tracing::info!(
            units = placed.len(),
            gpu_bytes = rt.memory().device_optimizer_bytes(),
            names = names.join(", "),
            "device optimizers ([optimizer] device_units)"
        );
    }
    Ok(placed)
}
