//! The plan of a training config: memory per tier, the minimum GPU budget and the predicted step
//! time of a GPT (dense or MoE) under budgets, through the step simulator of
//! [`oogc_prefetch::plan`]. `oogc plan` prints it; the machine's figures come from a
//! [`HardwareProfile`] (defaults, a file, or the probes of `oogc-bench`).
//!
//! | piece | what it does |
//! |---|---|
//! | [`GptShape`], [`FeedForward`], [`model_units`] | the units of a byte-level GPT (dense or MoE) and their sizes and FLOPs (small pure functions) |
//! | [`plan_args_for_config`], [`moe_placement`] | what to plan for an `oogc train` config, MoE expert placement included |
//! | [`PlannedModel`] | the model a plan is for: a GPT shape ([`PlannedModel::gpt`]) or a config's own model ([`PlannedModel::of_model`], sizes and FLOPs from `oogc-models`) |
//! | [`plan_model`] | [`oogc_prefetch::plan::plan`] over those units; [`render_plan`] the table |
//! | [`device_shape`], [`device_plan_for_config`], [`GpuMemory`] | what a config's run needs on the GPU, by part ([`crate::runtime::device_plan`]), and whether it fits |
//!
//! **A CUDA config** is planned with a GPU's figures ([`HardwareProfile::for_gpu`]): a profile's
//! measured matrix-product rate in the compute dtype (`oogc bench probe --device cuda:N`), else
//! the NVIDIA H100 SXM datasheet's ([`GpuDatasheet::H100_SXM`]), times the profile's model FLOP
//! utilisation; the plan's `hardware:` line says which. Never the sim device's figures.
//!
//! **FLOP model** (forward, one step of `N = seq · batch` tokens; the backward with recompute is
//! [`HardwareProfile::backward_flops_ratio`] × this): `2 · params · N` for the matmuls of a unit,
//! plus `4 · seq · d · N` for a block's attention scores and weighted sum (causal masking not
//! halved); the embedding is a gather (0). An MoE expert sees `top_k / experts` of the tokens
//! (uniform routing, no capacity drops).

use std::fmt::Write as _;

use oogc_moe_placement::{ColdMode, CostModel, CostModelConfig, ExpertShape, Placement};
use oogc_optimizer::OptimizerConfig;
use oogc_prefetch::plan::{plan, ModelUnit, PlanInput, PlanReport};
use oogc_prefetch::{GpuDatasheet, HardwareProfile, PrefetchConfig};
use oogc_swapper::{DType, StatePlacement};
use serde::Serialize;

use crate::config::TrainConfig;
use crate::runtime::budget::OverheadInputs;
use crate::runtime::device_plan::{DevicePlan, DeviceShape, SwapperShare};
use crate::runtime::{param_nvme_traffic, HostPlan, NvmePlan, RuntimeConfig};
use oogc_models::{CausalLm, UnitKind};

/// Why a plan cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The model's shape is unusable (a zero dimension, an MoE placement of the wrong shape).
    #[error("{0}")]
    Shape(String),
    /// The config's model cannot be built (tokenizer.json, Hugging Face checkpoint, dimensions).
    #[error("the model to plan: {0}")]
    Model(String),
    /// The planner refused the budgets or the hardware profile (a GPU budget below the minimum
    /// names the minimum in bytes).
    #[error("planning the step: {0}")]
    Planner(#[from] oogc_prefetch::Error),
}

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

/// The feed-forward half of every block, for planning.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FeedForward {
    /// A dense MLP `d → d_ff → d`; `None`: GPT-2's `4 · d`.
    Dense {
        /// Hidden width.
        d_ff: Option<u64>,
    },
    /// Mixture of experts behind a top-k router (see [`MoePlan`]).
    Moe(MoePlan),
}

impl Default for FeedForward {
    /// The dense GPT-2 MLP (`d_ff = 4 · d`).
    fn default() -> Self {
        Self::Dense { d_ff: None }
    }
}

/// The MoE blocks of a model and where their experts run, for planning.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoePlan {
    /// Experts per block.
    pub experts: u64,
    /// Experts per token.
    pub top_k: u64,
    /// Hidden width of each expert's MLP.
    pub d_expert: u64,
    /// Where each expert runs, `placements[block][expert]`: [`Placement::Resident`] (hot: on
    /// the device), [`Placement::Fetch`] (cold, copied H2D when used), [`Placement::Cpu`] (cold,
    /// computed from its host copy: nothing moves), [`Placement::Skip`] (no tokens: no unit).
    pub placements: Vec<Vec<Placement>>,
}

impl MoePlan {
    /// Experts placed `p`, all blocks together.
    pub fn count(&self, p: Placement) -> usize {
        self.placements.iter().flatten().filter(|&&q| q == p).count()
    }
}

/// Parameters of a dense block with an MLP of width `d_ff`: ln1 `2d`, qkv `3d² + 3d`, proj
/// `d² + d`, ln2 `2d`, fc `d·d_ff + d_ff`, fc2 `d_ff·d + d` (`12d² + 13d` for `d_ff = 4d`).
pub fn dense_block_params(d: u64, d_ff: u64) -> u64 {
    4 * d * d + 2 * d * d_ff + 9 * d + d_ff
}

/// Parameters of an MoE block's trunk: ln1 `2d`, qkv `3d² + 3d`, proj `d² + d`, ln2 `2d`,
/// router `d·E + E`.
pub fn moe_trunk_params(d: u64, experts: u64) -> u64 {
    4 * d * d + 8 * d + d * experts + experts
}

/// Parameters of one expert: fc `d·f + f`, proj `f·d + d`.
pub fn expert_params(d: u64, d_expert: u64) -> u64 {
    2 * d * d_expert + d_expert + d
}

/// Forward FLOPs of a block's attention scores and weighted sum over `tokens` tokens of
/// sequences of `seq_len`: `4 · seq_len · d · tokens` (causal masking not halved).
pub fn attention_forward_flops(seq_len: u64, d: u64, tokens: u64) -> f64 {
    4.0 * (seq_len * d) as f64 * tokens as f64
}

/// The units of a dense byte-level GPT (vocabulary [`VOCAB`], MLP `4d`) in forward order:
/// [`model_units`] with [`FeedForward::default`].
///
/// | unit | parameters |
/// |---|---|
/// | `embedding` | token `256·d` + position `seq·d` |
/// | `block.i` | [`dense_block_params`] (`12d² + 13d`) |
/// | `head` | final LayerNorm `2d` + untied output `256·d` (no bias, as the model) |
///
/// FLOPs as in the module docs. Approximate, documented: good to the ~10% a plan needs.
pub fn gpt_units(s: &GptShape) -> Vec<ModelUnit> {
    model_units(s, &FeedForward::default()).expect("a dense model has no placement to check")
}

/// The units of a byte-level GPT in forward order, with parameter counts, bytes and forward
/// FLOPs (module docs):
///
/// | unit | parameters | forward FLOPs |
/// |---|---|---|
/// | `embedding` | token `256·d` + position `seq·d` | 0 |
/// | dense `block.i` | [`dense_block_params`] | `2·params·N` + [`attention_forward_flops`] |
/// | MoE `block.i` (trunk) | [`moe_trunk_params`] | `2·params·N` + [`attention_forward_flops`] |
/// | MoE `block.i.expert.e` | [`expert_params`] | `2·params·N·top_k/E` |
/// | `head` | final LayerNorm `2d` + untied output `256·d` (no bias) | `2·256·d·N` |
///
/// MoE experts placed [`Placement::Cpu`] are [`ModelUnit::host_compute`] units; experts placed
/// [`Placement::Skip`] are left out (they compute nothing; their state is not updated).
///
/// # Errors
/// An MoE plan whose placements are not `layers × experts`.
pub fn model_units(s: &GptShape, ff: &FeedForward) -> Result<Vec<ModelUnit>, PlanError> {
    let d = s.d_model;
    let tokens = s.seq_len * s.batch;
    let unit = |name: String, numel: u64, flops: f64| ModelUnit {
        name,
        numel,
        compute_bytes: numel * s.dtype_bytes,
        forward_flops: flops,
        host_compute: false,
    };
    let attention = attention_forward_flops(s.seq_len, d, tokens);
    let mut units = Vec::with_capacity(s.layers as usize + 2);
    units.push(unit("embedding".into(), VOCAB * d + s.seq_len * d, 0.0));
    match ff {
        FeedForward::Dense { d_ff } => {
            let block = dense_block_params(d, d_ff.unwrap_or(4 * d));
            for i in 0..s.layers {
                units.push(unit(format!("block.{i}"), block, 2.0 * (block * tokens) as f64 + attention));
            }
        }
        FeedForward::Moe(m) => {
            if m.placements.len() as u64 != s.layers || m.placements.iter().any(|b| b.len() as u64 != m.experts) {
                return Err(PlanError::Shape(format!(
                    "the MoE placement must be {} blocks x {} experts (got {} blocks)",
                    s.layers,
                    m.experts,
                    m.placements.len()
                )));
            }
            let trunk = moe_trunk_params(d, m.experts);
            let expert = expert_params(d, m.d_expert);
            let expert_flops = 2.0 * expert as f64 * tokens as f64 * m.top_k as f64 / m.experts.max(1) as f64;
            for (i, block) in m.placements.iter().enumerate() {
                units.push(unit(format!("block.{i}"), trunk, 2.0 * (trunk * tokens) as f64 + attention));
                for (e, p) in block.iter().enumerate() {
                    if *p == Placement::Skip {
                        continue;
                    }
                    let mut u = unit(format!("block.{i}.expert.{e}"), expert, expert_flops);
                    u.host_compute = *p == Placement::Cpu;
                    units.push(u);
                }
            }
        }
    }
    let head = 2 * d + VOCAB * d;
    units.push(unit("head".into(), head, 2.0 * (VOCAB * d) as f64 * tokens as f64));
    Ok(units)
}

/// The model a plan is made for: a one-line description, its units in forward order (sizes
/// and FLOPs) and, for MoE, where each expert runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlannedModel {
    /// One line describing the model (`GPT byte-vocab, 8 layers, ...`, `llama, 6 layers, ...`).
    pub description: String,
    /// Its units in forward order.
    pub units: Vec<ModelUnit>,
    /// MoE: where each expert runs, `[block][expert]` (under uniform routing); empty for a
    /// dense model.
    pub placements: Vec<Vec<Placement>>,
}

impl PlannedModel {
    /// A byte-level GPT of `shape` with `ff` blocks ([`model_units`]): the shape-only plan of
    /// `oogc plan --layers .. --d-model ..`.
    ///
    /// # Errors
    /// A zero dimension; an MoE placement of the wrong shape.
    pub fn gpt(shape: &GptShape, ff: &FeedForward) -> Result<Self, PlanError> {
        if shape.layers == 0 || shape.d_model == 0 || shape.seq_len == 0 || shape.batch == 0 {
            return Err(PlanError::Shape("--layers, --d-model, --seq-len and --batch must be > 0".into()));
        }
        let ffs = match ff {
            FeedForward::Dense { d_ff } => format!("MLP {}", d_ff.unwrap_or(4 * shape.d_model)),
            FeedForward::Moe(m) => format!("MoE {} experts top-{} of width {}", m.experts, m.top_k, m.d_expert),
        };
        let description = format!(
            "GPT byte-vocab, {} layers, d_model {}, {ffs}, seq {} x batch {}",
            shape.layers, shape.d_model, shape.seq_len, shape.batch
        );
        let placements = match ff {
            FeedForward::Moe(m) => m.placements.clone(),
            FeedForward::Dense { .. } => Vec::new(),
        };
        Ok(Self { description, units: model_units(shape, ff)?, placements })
    }

    /// The model of a training config, its units taken from the model itself (`oogc-models`:
    /// sizes from the unit layouts, FLOPs from [`CausalLm::forward_flops`]) with compute copies
    /// of `dtype` (`[train] compute_dtype`), `batch × seq_len` tokens per step, MoE experts placed by
    /// [`moe_placement`] with `top_k / experts` of the tokens each (uniform routing); experts
    /// placed [`Placement::Cpu`] are [`ModelUnit::host_compute`] units, [`Placement::Skip`]
    /// ones are left out.
    pub fn of_model(
        model: &dyn CausalLm,
        family: &str,
        dtype: DType,
        batch: usize,
        seq_len: usize,
        top_k: usize,
        placements: Vec<Vec<Placement>>,
    ) -> Self {
        let tokens = batch * seq_len;
        let mut units = Vec::with_capacity(model.units().len());
        let mut experts_per_block = 0;
        for (k, u) in model.units().iter().enumerate() {
            let mut unit = ModelUnit {
                name: u.name.clone(),
                numel: u.numel as u64,
                compute_bytes: dtype.num_bytes(u.numel) as u64,
                forward_flops: model.forward_flops(k, tokens, seq_len),
                host_compute: false,
            };
            if let UnitKind::Expert { block, expert } = u.kind {
                experts_per_block = experts_per_block.max(expert + 1);
                let experts = model
                    .units()
                    .iter()
                    .filter(|s| matches!(s.kind, UnitKind::Expert { block: b, .. } if b == block))
                    .count();
                let placement = placements.get(block).and_then(|b| b.get(expert)).copied().unwrap_or(Placement::Fetch);
                if placement == Placement::Skip {
                    continue;
                }
                unit.forward_flops = model.forward_flops(k, tokens * top_k / experts.max(1), seq_len);
                unit.host_compute = placement == Placement::Cpu;
            }
            units.push(unit);
        }
        let blocks =
            model.units().iter().filter(|u| matches!(u.kind, UnitKind::Block(_) | UnitKind::MoeTrunk(_))).count();
        let params: usize = model.units().iter().map(|u| u.numel).sum();
        let moe = if experts_per_block > 0 {
            format!(", MoE {experts_per_block} experts top-{top_k}")
        } else {
            String::new()
        };
        let description = format!(
            "{family}, {blocks} blocks{moe}, vocab {}, {:.2} M params, seq {seq_len} x batch {batch}",
            model.vocab_size(),
            params as f64 / 1e6
        );
        Self { description, units, placements }
    }

    /// Experts placed `p`, all blocks together.
    pub fn count(&self, p: Placement) -> usize {
        self.placements.iter().flatten().filter(|&&q| q == p).count()
    }
}

/// What `oogc plan` plans.
#[derive(Debug, Clone)]
pub struct PlanArgs {
    /// The model.
    pub model: PlannedModel,
    /// GPU bytes for unit copies.
    pub gpu_budget_bytes: u64,
    /// Host bytes, if limited.
    pub host_budget_bytes: Option<u64>,
    /// Optimizer state placement; `None`: host if the host budget holds it, else NVMe.
    pub optimizer_state: Option<StatePlacement>,
    /// Where the compute copies' home is (`[budgets] params`).
    pub params: StatePlacement,
    /// The CPU optimizer (threads, stream chunks and budget, roll-back budget): what the host
    /// plan splits the budget by.
    pub optimizer: OptimizerConfig,
    /// Units the trainer pins at once (2 with a tied head or MoE blocks).
    pub max_units_in_use: usize,
    /// Prefetch depth, units.
    pub max_depth: usize,
    /// With parameters on NVMe: units read NVMe → host ahead (`[prefetch] host_depth`); they
    /// and the units in use are not the host tier's cache.
    pub host_depth: usize,
    /// The machine.
    pub hardware: HardwareProfile,
    /// Build the Perfetto trace of the simulated step.
    pub trace: bool,
    /// Data-parallel ranks (`mpirun -np N`): the host and NVMe figures are one rank's (rank 0,
    /// the largest shard of each unit's optimizer state); 1 for a single process.
    pub world_size: usize,
    /// With ranks, whether each rank's tiers hold its shard of the compute copies too (`[ranks]
    /// shard_parameters`, ZeRO-3) or whole copies (ZeRO-2).
    pub shard_parameters: bool,
    /// The run's shape for the host overhead model (an `oogc train` config's): with it the plan
    /// predicts the process's peak RSS ([`OverheadInputs::predicted_peak_rss_bytes`]).
    pub overhead: Option<OverheadInputs>,
    /// Units whose optimizer the run keeps on the device (`[optimizer] device_units`:
    /// [`crate::train::choose_device_units`]), with their GPU bytes (16 B per parameter + the
    /// compute copy), carved out of the GPU budget; empty for none.
    pub device_units: Vec<(String, u64)>,
    /// What the run needs on the GPU and whether it fits (an `oogc train` config's; `None` for
    /// a shape-only plan).
    pub device: Option<GpuMemory>,
}

/// What a config's run needs on its GPU ([`DevicePlan`]) beside the GPU's memory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuMemory {
    /// The parts.
    pub plan: DevicePlan,
    /// The GPU memory it is compared with, bytes: the profile's when it measured a GPU, else
    /// the datasheet's ([`GpuDatasheet::H100_SXM`]).
    pub device_memory_bytes: u64,
    /// Where `device_memory_bytes` comes from.
    pub device_memory_source: String,
    /// The run's device is the sim device: candle's buffers are host memory there, the figure is
    /// what the run would need on a GPU, and the sim device's memory is `[budgets] gpu`.
    pub sim: bool,
}

impl GpuMemory {
    /// Whether [`DevicePlan::total_bytes`] fits `device_memory_bytes`.
    pub fn fits(&self) -> bool {
        self.plan.fits(self.device_memory_bytes)
    }

    /// The JSON of `oogc plan --json`'s `device_plan`: `parts` (`name`, `bytes`, `in_pool`),
    /// `in_pool_bytes`, `outside_pool_bytes`, `total_bytes`, `swapper_bytes`, `peak_unit`,
    /// `attention_chunk`, `device_memory_bytes`, `device_memory_source`, `fits`, `sim`.
    pub fn to_json(&self) -> serde_json::Value {
        let p = &self.plan;
        serde_json::json!({
            "parts": p.parts(),
            "in_pool_bytes": p.in_pool_bytes(),
            "outside_pool_bytes": p.outside_pool_bytes(),
            "total_bytes": p.total_bytes(),
            "swapper_bytes": p.swapper_bytes(),
            "peak_unit": p.peak_unit,
            "attention_chunk": p.attention_chunk,
            "device_memory_bytes": self.device_memory_bytes,
            "device_memory_source": self.device_memory_source,
            "fits": self.fits(),
            "sim": self.sim,
        })
    }
}

/// The shape of `cfg`'s run for its device plan ([`DeviceShape`]): batch, micro-batches,
/// sequence, the model's widths (Llama family: key/value heads and head width from its config;
/// GPT: as many key/value heads as heads; MoE: an expert's width × top-k as the MLP), its units'
/// parameters (the largest block or MoE trunk, the head, the embedding), the compute dtype and
/// `[activations] offload`, `[device] attention_chunk` (unset: the models crate's default).
///
/// # Errors
/// [`PlanError::Model`] when a Llama config's checkpoint cannot be read.
pub fn device_shape(cfg: &TrainConfig, model: &dyn CausalLm) -> Result<DeviceShape, PlanError> {
    let dims = model.dims();
    let (d, heads) = (dims.hidden as u64, dims.heads.max(1) as u64);
    let top_k = model.moe().map_or(1, |m| m.experts_per_token()) as u64;
    let (kv_heads, head_dim, d_ff, largest_group) = match &cfg.model {
        crate::config::ModelConfig::Llama(l) => {
            let c = crate::train::llama_config(l, model.vocab_size()).map_err(|e| PlanError::Model(e.to_string()))?;
            let (kv, hd, i) = (c.kv_heads() as u64, c.head_dim() as u64, c.intermediate_size as u64);
            (kv, hd, i * top_k, (2 * i * d).max(heads * hd * d))
        }
        crate::config::ModelConfig::Gpt(g) => {
            let ff = g.moe.as_ref().map_or(g.d_ff(), |m| m.d_expert.unwrap_or_else(|| g.d_ff())) as u64;
            (heads, d / heads, ff * top_k, (3 * d * d).max(ff * d))
        }
    };
    let numel = |f: &dyn Fn(&UnitKind) -> bool| {
        model.units().iter().filter(|u| f(&u.kind)).map(|u| u.numel as u64).max().unwrap_or(0)
    };
    Ok(DeviceShape {
        dtype: cfg.train.compute_dtype.dtype(),
        batch: cfg.train.batch_size as u64,
        micro_batches: cfg.train.micro_batches.max(1) as u64,
        seq: cfg.train.seq_len as u64,
        d_model: d,
        d_ff,
        heads,
        kv_heads,
        head_dim,
        layers: dims.layers as u64,
        vocab: model.vocab_size() as u64,
        block_params: numel(&|k| matches!(k, UnitKind::Block(_) | UnitKind::MoeTrunk(_))),
        block_largest_group: largest_group,
        head_params: numel(&|k| matches!(k, UnitKind::Head)),
        embedding_params: numel(&|k| matches!(k, UnitKind::Embedding)),
        tied_head: model.tied_head(),
        activation_offload: cfg.activations.offload,
        attention_chunk: cfg.device.attention_chunk.map(|c| c as u64),
    })
}

/// What `cfg`'s run of `model` needs on its GPU ([`DevicePlan`]): [`device_shape`] and the
/// swapper's share of `[budgets] gpu` as the runtime carves it (gradient and activation staging,
/// candle's copies of the units in use as on CUDA, the device optimizers of
/// `device_optimizer_bytes`). What the trainer compares the pool's peak with.
///
/// # Errors
/// As [`device_shape`].
pub fn device_plan_for_config(
    cfg: &TrainConfig,
    model: &dyn CausalLm,
    device_optimizer_bytes: u64,
) -> Result<DevicePlan, PlanError> {
    let dtype = cfg.train.compute_dtype.dtype();
    let units: Vec<u64> = model.units().iter().map(|u| dtype.num_bytes(u.numel) as u64).collect();
    let share = SwapperShare::new(
        cfg.budgets.gpu.as_u64(),
        &units,
        crate::train::max_units_in_use(model),
        crate::train::activation_offload(cfg, model),
        device_optimizer_bytes,
    );
    Ok(DevicePlan::new(&device_shape(cfg, model)?, &share))
}

/// The plan of an `oogc train` config: its model ([`PlannedModel::of_model`]: the model the
/// trainer builds, compute copies of `[train] compute_dtype`, MoE blocks with [`moe_placement`]),
/// batch (`batch_size × micro_batches` sequences per step: compute scales with the micro-batches,
/// parameter transfers do not, since the layer-major schedule fetches each unit once per phase
/// for all of them), GPU and host budgets, state tier and prefetch depth. On the sim device with a throttled
/// link (`[device] link_gbps > 0`) the link replaces the profile's H2D/D2H bandwidth, since that
/// is the link the run will have.
///
/// # Errors
/// [`PlanError::Model`] when the config's model cannot be built (its tokenizer.json or
/// Hugging Face checkpoint unreadable, bad dimensions).
pub fn plan_args_for_config(cfg: &TrainConfig, hardware: &HardwareProfile, trace: bool) -> Result<PlanArgs, PlanError> {
    let mut hardware = hardware.clone();
    let sim = cfg.device.kind.is_sim();
    let dtype = cfg.train.compute_dtype.dtype();
    if sim && cfg.device.link_gbps > 0.0 {
        hardware.h2d_gbps = cfg.device.link_gbps;
        hardware.d2h_gbps = cfg.device.link_gbps;
    }
    let sheet = GpuDatasheet::H100_SXM;
    if !sim {
        hardware = hardware.for_gpu(dtype.num_bytes(1) as u64, &sheet);
    }
    let model_err = |e: crate::train::TrainError| PlanError::Model(e.to_string());
    let vocab = crate::train::vocab_size(cfg).map_err(model_err)?;
    let model = crate::train::build_model(cfg, vocab).map_err(model_err)?;
    let placements = moe_placement(cfg, &*model, &hardware);
    let top_k = model.moe().map_or(1, |m| m.experts_per_token());
    // A step computes all its micro-batches' sequences; each unit still moves once per phase.
    let sequences = cfg.train.batch_size * cfg.train.micro_batches.max(1);
    let planned =
        PlannedModel::of_model(&*model, cfg.model.family(), dtype, sequences, cfg.train.seq_len, top_k, placements);
    // The residency manager's share of the GPU budget, staging carved out as the runtime does.
    let largest = model.units().iter().map(|u| dtype.num_bytes(u.numel) as u64).max().unwrap_or(0);
    let staging = crate::runtime::staging_bytes(largest, crate::train::activation_offload(cfg, &*model));
    let compute_budget = cfg.budgets.gpu.as_u64().saturating_sub(staging);
    let device_units: Vec<(String, u64)> = crate::train::choose_device_units(cfg, &*model, compute_budget)
        .into_iter()
        .map(|u| {
            let spec = &model.units()[u];
            (spec.name.clone(), crate::runtime::device_optimizer_bytes(spec.numel, dtype))
        })
        .collect();
    let plan = device_plan_for_config(cfg, &*model, device_units.iter().map(|(_, b)| b).sum())?;
    let (device_memory_bytes, device_memory_source) = match (hardware.device_memory_bytes, &hardware.device_name) {
        (Some(b), Some(name)) if hardware.has_gpu_figures() => (b, format!("{name}, the profile's")),
        _ => (sheet.memory_bytes, format!("{}, the {}'s", sheet.name, sheet.citation)),
    };
    let device = Some(GpuMemory { plan, device_memory_bytes, device_memory_source, sim });
    Ok(PlanArgs {
        model: planned,
        gpu_budget_bytes: cfg.budgets.gpu.as_u64(),
        host_budget_bytes: Some(cfg.budgets.host.as_u64()),
        optimizer_state: Some(cfg.budgets.optimizer_state),
        params: cfg.budgets.params,
        optimizer: crate::train::optimizer_config(cfg),
        max_units_in_use: crate::train::max_units_in_use(&*model),
        max_depth: cfg.prefetch.depth.max(1),
        host_depth: cfg.prefetch.host_depth,
        hardware,
        trace,
        world_size: 1,
        shard_parameters: cfg.ranks.shard_parameters,
        overhead: Some(crate::train::overhead_inputs(cfg, &*model, text_bytes(cfg))),
        device_units,
        device,
    })
}

/// The bytes of `cfg`'s training text (0 when it cannot be read): the run maps its token file,
/// about as large (0.8 × with the fixture's BPE at 2 bytes per token).
fn text_bytes(cfg: &TrainConfig) -> u64 {
    std::fs::metadata(&cfg.data.path).map_or(0, |m| m.len())
}

/// Where the experts of an MoE config run in a steady-state step, `[block][expert]` (empty for a
/// dense config): the trainer's placement logic applied to **uniform routing** (every expert
/// receives `top_k / experts` of the step's tokens), a coarse model of `[moe]`:
///
/// - `policy = "fetch"`, `"resident"` or `"lru"`: every expert [`Placement::Fetch`] (an LRU
///   cache's few hits within a step are not modelled).
/// - `policy = "ours"`: the hot set holds `expert_budget / hot expert bytes` experts (spread over
///   the blocks in turn; a hot expert's bytes count its optimizer when it lives on the device:
///   [`crate::moe::hot_expert_bytes`]) when keeping an expert resident saves time under the cost model
///   ([`CostModel::hot_benefit_s`] over the statistics' horizon `1 / (1 − popularity_decay)`
///   steps beats the move, as [`oogc_moe_placement::HotSet::replan`] decides), else none; then
///   each block is placed by [`CostModel::place_block`] (cold experts fetched or computed on the
///   CPU, `cpu_compute` permitting).
///
/// The cost model gets the trainer's rates: the link (sim device) or 16 GB/s, and on the sim
/// device `hardware.device_gflops` for both GPU and CPU (the sim device's GPU is this CPU); on
/// a GPU the cost model's defaults. The trainer corrects its rates online and routing is not
/// uniform, so a real step places a few experts differently.
pub fn moe_placement(cfg: &TrainConfig, model: &dyn CausalLm, hardware: &HardwareProfile) -> Vec<Vec<Placement>> {
    let experts_of = |u: &oogc_models::UnitSpec| match u.kind {
        UnitKind::Expert { block, expert } => Some((block, expert, u.numel as u64)),
        _ => None,
    };
    let all: Vec<(usize, usize, u64)> = model.units().iter().filter_map(experts_of).collect();
    let Some(&(_, _, numel)) = all.first() else { return Vec::new() };
    let layers = all.iter().map(|e| e.0 + 1).max().unwrap_or(0);
    let experts = all.iter().map(|e| e.1 + 1).max().unwrap_or(0);
    let top_k = model.moe().map_or(1, |m| m.experts_per_token());
    if !crate::moe::places_experts(cfg) {
        return vec![vec![Placement::Fetch; experts]; layers];
    }
    let bytes = cfg.train.compute_dtype.dtype().num_bytes(numel as usize) as u64;
    let tokens = (cfg.train.batch_size * cfg.train.seq_len * top_k / experts.max(1)) as u64;
    // The sim device's GPU is this CPU, at the profile's rate; on a GPU the cost model's CPU rate.
    let cpu_gflops =
        if cfg.device.kind.is_sim() { hardware.device_gflops } else { CostModelConfig::default().cpu_gflops };
    // `oogc plan` runs as one process: the placements of a world of one.
    let pc = crate::moe::placer_config(cfg, cpu_gflops, numel as usize, crate::dist::World::SINGLE);
    let cost = CostModel::new(
        ExpertShape { param_bytes: bytes, grad_bytes: bytes, flops_per_token: 8.0 * numel as f64 },
        pc.cost,
    );
    let Ok(cost) = cost else {
        // A rate that is not a positive number: the planner refuses the profile anyway.
        return vec![vec![Placement::Fetch; experts]; layers];
    };
    let mode = if cfg.moe.cpu_compute { ColdMode::FetchOrCpu } else { ColdMode::FetchOnly };
    // A hot expert's GPU bytes: its compute copy, and its optimizer when it lives there.
    let hot_bytes = crate::moe::hot_expert_bytes(cfg, numel as usize, crate::dist::World::SINGLE);
    let capacity = ((pc.hot_set.budget_bytes / hot_bytes.max(1)) as usize).min(layers * experts);
    let horizon = 1.0 / (1.0 - cfg.moe.popularity_decay).max(1e-6);
    let worth_keeping = cost.hot_benefit_s(tokens as f64, 1.0, mode, pc.hot_set.keeps_gradients) * horizon
        > (1.0 + pc.hot_set.margin) * cost.h2d_s(pc.hot_set.admit_bytes.unwrap_or(bytes));
    let hot = if worth_keeping { capacity } else { 0 };
    (0..layers)
        .map(|b| {
            // Expert e of block b is the (e · layers + b)-th in turn.
            let resident: Vec<bool> = (0..experts).map(|e| e * layers + b < hot).collect();
            cost.place_block(&vec![tokens; experts], &resident, mode)
        })
        .collect()
}

/// The split of the host budget for `args`' model ([`HostPlan`], what the runtime applies
/// before its first step), and the NVMe store it needs ([`NvmePlan`]; `None` when nothing lives
/// there). Without a host budget, an unlimited one.
pub fn host_and_nvme_plan(args: &PlanArgs, report: &PlanReport) -> (HostPlan, Option<NvmePlan>) {
    let units: Vec<usize> = args.model.units.iter().map(|u| u.numel as usize).collect();
    // Rank 0's shards (the largest) of each unit's optimizer state.
    let shards: Vec<usize> =
        units.iter().map(|&n| crate::dist::shard_range(n, 0, args.world_size.max(1)).len()).collect();
    let state = if report.optimizer_state_on_nvme { StatePlacement::Nvme } else { StatePlacement::Host };
    let optimizer = args.optimizer.clone();
    let copies = if args.shard_parameters { &shards } else { &units };
    let nvme = NvmePlan::with_shards(&shards, copies, state, args.params, &optimizer, None);
    let mut rc = RuntimeConfig::sim(args.gpu_budget_bytes);
    rc.host_budget_bytes = args.host_budget_bytes.unwrap_or(u64::MAX);
    rc.state_placement = state;
    rc.params_placement = args.params;
    rc.optimizer = optimizer;
    let room = nvme.as_ref().map_or(0, |p| p.speculation_room_bytes());
    (HostPlan::with_shards(&rc, &units, &shards, copies, args.max_units_in_use, room), nvme)
}

/// Plans a model: its units through [`oogc_prefetch::plan::plan`] (the step simulator with the
/// prefetch and eviction policies the runtime uses); the host and NVMe figures are the runtime's
/// ([`host_and_nvme_plan`]: the host peak of every ledger category, the NVMe store's size).
///
/// # Errors
/// The planner's errors (a GPU budget below the minimum names the minimum in bytes).
pub fn plan_model(args: &PlanArgs) -> Result<PlanReport, PlanError> {
    let input = PlanInput {
        units: args.model.units.clone(),
        gpu_budget_bytes: args.gpu_budget_bytes,
        host_budget_bytes: args.host_budget_bytes,
        optimizer_state: args.optimizer_state,
        prefetch: PrefetchConfig { max_depth: args.max_depth, ..PrefetchConfig::default() },
        steps: 3,
        trace: args.trace,
    };
    let mut report = plan(&input, &args.hardware)?;
    let (host, nvme) = host_and_nvme_plan(args, &report);
    if args.params == StatePlacement::Nvme {
        // The compute copies' own NVMe traffic (the step simulator moves only the optimizer
        // state): the host tier's share, less the units in use and in the host window, caches them.
        let copies: Vec<u64> = args.model.units.iter().map(|u| u.compute_bytes).collect();
        let largest = copies.iter().copied().max().unwrap_or(0);
        let pinned = (args.max_units_in_use + args.host_depth) as u64 * largest;
        let all: u64 = copies.iter().map(|&b| oogc_swapper::host::size_class(b as usize) as u64).sum();
        // A share that holds every copy keeps them all (the window's units are cached ones).
        let cache = if host.compute_copies_bytes >= all {
            u64::MAX
        } else {
            host.compute_copies_bytes - pinned.min(host.compute_copies_bytes)
        };
        let (read, write) = param_nvme_traffic(&copies, cache);
        report.sim.link_bytes.nvme_read += read;
        report.sim.link_bytes.nvme_write += write;
    }
    report.memory.host_bytes = host.peak_bytes();
    report.memory.nvme_bytes = nvme.as_ref().map_or(0, |p| p.capacity_bytes);
    report.warnings.retain(|w| !w.starts_with("host needs"));
    if host.check().is_err() {
        report.warnings.push(format!(
            "the host budget of {} B is below the run's minimum of {} B: raise it, or put the optimizer state \
             and/or the parameters on NVMe",
            host.budget_bytes, host.min_bytes
        ));
    }
    Ok(report)
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The "GPU memory" section of [`render_plan`].
fn render_gpu_memory(out: &mut String, g: &GpuMemory, gpu_budget_bytes: u64) {
    let p = &g.plan;
    let what = if g.sim {
        "what the run would need on a GPU (a model: on the sim device candle's buffers are host memory)"
    } else {
        "what the run needs on the device"
    };
    writeln!(out, "GPU memory: {what}; [budgets] gpu covers the swapper's part only").expect("writing to a String");
    let note = |name: &str| match name {
        "residency" => "compute copies in the residency manager".to_string(),
        "gradient_staging" => "the runtime's gradient staging".to_string(),
        "activation_staging" => "activation checkpoints' staging ([activations] offload)".to_string(),
        "in_use_copies" => "candle's copies of the units in use".to_string(),
        "device_optimizers" => "[optimizer] device_units".to_string(),
        "checkpoints" => "activation checkpoints kept on the device".to_string(),
        "input_gradients" => "gradients between units".to_string(),
        "working_set" => format!("the {} backward's activations and their gradients", p.peak_unit),
        "attention" => format!("scores of {}-row query chunks, q/k/v and their gradients", p.attention_chunk),
        "autograd" => format!("the {}'s parameters as Vars and their gradients", p.peak_unit),
        "cublas_workspace" => "cuBLAS workspace (outside the pool)".to_string(),
        _ => "CUDA context (outside the pool; stated)".to_string(),
    };
    for part in p.parts().iter().filter(|q| q.bytes > 0) {
        writeln!(out, "  {:<20} {:>14} {:>16}  {}", part.name, part.bytes, gib(part.bytes), note(part.name))
            .expect("writing to a String");
    }
    writeln!(
        out,
        "  {:<20} {:>14} {:>16}  in the stream-ordered pool {} B (what device_peak_bytes measures) + outside it {} B",
        "total",
        p.total_bytes(),
        gib(p.total_bytes()),
        p.in_pool_bytes(),
        p.outside_pool_bytes()
    )
    .expect("writing to a String");
    let verdict = if g.fits() { "fits" } else { "does NOT fit" };
    if g.sim {
        writeln!(
            out,
            "  sim device: its memory is [budgets] gpu ({gpu_budget_bytes} B), which holds the swapper's part ({} B); \
             on a GPU the run {verdict} {} ({} B)",
            p.swapper_bytes(),
            g.device_memory_source,
            g.device_memory_bytes
        )
    } else {
        writeln!(out, "  {verdict} the GPU: {} ({} B)", g.device_memory_source, g.device_memory_bytes)
    }
    .expect("writing to a String");
}

/// A plan as a human-readable table (what `oogc plan` prints).
pub fn render_plan(args: &PlanArgs, r: &PlanReport) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "model: {}: {} units, {:.1} M params, compute copies {}",
        args.model.description,
        r.units,
        r.params as f64 / 1e6,
        gib(r.model_bytes)
    )
    .expect("writing to a String");
    if !args.model.placements.is_empty() {
        let m = &args.model;
        writeln!(
            out,
            "experts: {} hot (resident), {} fetched, {} computed on the CPU, {} idle — the trainer's placement under \
             uniform routing (coarse: real routing is skewed and the trainer re-places every step)",
            m.count(Placement::Resident),
            m.count(Placement::Fetch),
            m.count(Placement::Cpu),
            m.count(Placement::Skip)
        )
        .expect("writing to a String");
    }
    if !args.device_units.is_empty() {
        let names: Vec<&str> = args.device_units.iter().map(|(n, _)| n.as_str()).collect();
        let bytes: u64 = args.device_units.iter().map(|(_, b)| b).sum();
        writeln!(
            out,
            "device optimizers ([optimizer] device_units): {} units ({}), {} of the GPU budget (master weights, \
             Adam state, gradients and compute copy); their updates run on the device after the step's decision \
             (the step time below does not model them)",
            names.len(),
            names.join(", "),
            gib(bytes)
        )
        .expect("writing to a String");
    }
    if args.world_size > 1 {
        // Per step each rank reduce-scatters the gradients (f32) and all-gathers the new compute
        // copies: (N − 1) / N of each, sent and received, in a ring.
        let n = args.world_size as u64;
        let params: u64 = args.model.units.iter().map(|u| u.numel).sum();
        let copies: u64 = args.model.units.iter().map(|u| u.compute_bytes).sum();
        let (rs, ag) = (4 * params * (n - 1) / n, copies * (n - 1) / n);
        if args.shard_parameters {
            writeln!(
                out,
                "ranks: {n}, parameters sharded (ZeRO-3; host, NVMe and optimizer figures are one rank's: its 1/{n} of \
                 the compute copies and of the optimizer state); per step each rank sends and receives {rs} B \
                 reducing its gradients (f32 reduce-scatter) and {ag} B per gathering of every unit (all-gather at \
                 a unit's fetch unless it was kept gathered: once to twice per step), not in the predicted step; \
                 the step's GPU and H2D figures below are simulated on whole units (a rank's H2D carries its shards: \
                 about 1/{n} of them)"
            )
        } else {
            writeln!(
                out,
                "ranks: {n} (host, NVMe and optimizer figures are one rank's: its 1/{n} of the optimizer state); \
                 per step each rank sends and receives {rs} B reducing its gradients (f32 reduce-scatter) and {ag} B \
                 gathering the new compute copies (all-gather), not in the predicted step"
            )
        }
        .expect("writing to a String");
    }
    writeln!(out, "hardware: {}", args.hardware.source).expect("writing to a String");
    writeln!(
        out,
        "compute: {:.1} GFLOP/s, backward {:.2} x forward; links: H2D {:.1} GB/s, D2H {:.1} GB/s",
        args.hardware.device_gflops, args.hardware.backward_flops_ratio, args.hardware.h2d_gbps, args.hardware.d2h_gbps
    )
    .expect("writing to a String");
    out.push('\n');
    writeln!(out, "{:<10} {:>14} {:>16}  note", "tier", "peak bytes", "GiB").expect("writing to a String");
    writeln!(
        out,
        "{:<10} {:>14} {:>16}  budget {} (minimum {} B; all units resident at {} B)",
        "gpu",
        r.memory.device_bytes,
        gib(r.memory.device_bytes),
        args.gpu_budget_bytes,
        r.min_gpu_budget_bytes,
        r.full_gpu_budget_bytes
    )
    .expect("writing to a String");
    let host = Some(host_and_nvme_plan(args, r));
    writeln!(
        out,
        "{:<10} {:>14} {:>16}  every ledger category at its planned bytes{}",
        "host",
        r.memory.host_bytes,
        gib(r.memory.host_bytes),
        host.as_ref().map_or(String::new(), |(h, _)| format!(" (minimum {} B)", h.min_bytes))
    )
    .expect("writing to a String");
    if let Some((h, _)) = &host {
        for (name, bytes) in h.by_category() {
            writeln!(out, "{:<10} {:>14} {:>16}  host: {name}", "", bytes, gib(bytes)).expect("writing to a String");
        }
        if let Some(o) = &args.overhead {
            let overhead = o.overhead(h);
            let rss = o.predicted_peak_rss_bytes(h);
            let parts: Vec<String> = overhead.parts().iter().map(|(n, b)| format!("{n} {b}")).collect();
            writeln!(
                out,
                "{:<10} {:>14} {:>16}  predicted peak RSS: ledger {} B expected + overhead {} B ({}); budget + overhead {} B",
                "rss",
                rss,
                gib(rss),
                h.expected_peak_bytes(),
                overhead.total_bytes(),
                parts.join(", "),
                h.budget_bytes.saturating_add(overhead.total_bytes())
            )
            .expect("writing to a String");
        }
    }
    // Immediate updates speculate nothing: the store has no room for second extents then.
    let room = if host.as_ref().and_then(|(_, n)| n.as_ref()).is_some_and(|n| n.speculation_bytes > 0) {
        " + speculation's room"
    } else {
        ""
    };
    let on_nvme = match (r.optimizer_state_on_nvme, args.params) {
        (true, StatePlacement::Nvme) => format!("optimizer state + compute copies + copy-on-write slack{room}"),
        (true, StatePlacement::Host) => format!("optimizer state + copy-on-write slack{room}"),
        (false, StatePlacement::Nvme) => "compute copies + copy-on-write slack".to_string(),
        (false, StatePlacement::Host) => "-".to_string(),
    };
    writeln!(out, "{:<10} {:>14} {:>16}  {on_nvme}", "nvme", r.memory.nvme_bytes, gib(r.memory.nvme_bytes))
        .expect("writing to a String");
    if let Some(g) = &args.device {
        out.push('\n');
        render_gpu_memory(&mut out, g, args.gpu_budget_bytes);
    }
    out.push('\n');
    let pct = |x: f64| 100.0 * x / r.step_s.max(1e-12);
    writeln!(
        out,
        "predicted step: {:.4} s (lower bound {:.4} s, {:.2}x)",
        r.step_s,
        r.lower_bound_s,
        r.step_s / r.lower_bound_s.max(1e-12)
    )
    .expect("writing to a String");
    writeln!(out, "  compute            {:>10.4} s  {:>5.1}%", r.compute_s, pct(r.compute_s))
        .expect("writing to a String");
    writeln!(out, "  exposed transfer   {:>10.4} s  {:>5.1}%", r.exposed_transfer_s, pct(r.exposed_transfer_s))
        .expect("writing to a String");
    writeln!(out, "  exposed optimizer  {:>10.4} s  {:>5.1}%", r.exposed_optimizer_s, pct(r.exposed_optimizer_s))
        .expect("writing to a String");
    let lb = &r.sim.link_bytes;
    writeln!(
        out,
        "  bytes per step: h2d {} d2h {} nvme read {} nvme write {} (optimizer state{})",
        lb.h2d,
        lb.d2h,
        lb.nvme_read,
        lb.nvme_write,
        if args.params == StatePlacement::Nvme { " + compute copies" } else { "" }
    )
    .expect("writing to a String");
    for w in &r.warnings {
        writeln!(out, "warning: {w}").expect("writing to a String");
    }
    if let Some(g) = args.device.as_ref().filter(|g| !g.fits() && !g.sim) {
        let largest: Vec<String> =
            g.plan.largest_parts(3).iter().map(|p| format!("{} {}", p.name, gib(p.bytes))).collect();
        writeln!(
            out,
            "warning: the run needs {} on the GPU but it has {}: lower [train] batch_size or seq_len, or [budgets] gpu \
             (largest parts: {})",
            gib(g.plan.total_bytes()),
            gib(g.device_memory_bytes),
            largest.join(", ")
        )
        .expect("writing to a String");
    }
    out
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
        assert_eq!(u[3].numel, 2 * 64 + 256 * 64);
        assert_eq!(u[1].compute_bytes, 2 * u[1].numel);
    }

    fn example(name: &str) -> TrainConfig {
        TrainConfig::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(name)).unwrap()
    }

    /// The GPT-shape formulas of this module, for a GPT config.
    fn shape_units(cfg: &TrainConfig, placements: Vec<Vec<Placement>>) -> Vec<ModelUnit> {
        let g = cfg.model.gpt().expect("a GPT config");
        let shape = GptShape {
            layers: g.n_layer as u64,
            d_model: g.d_model as u64,
            seq_len: cfg.train.seq_len as u64,
            batch: cfg.train.batch_size as u64,
            dtype_bytes: 4,
        };
        let ff = match &g.moe {
            None => FeedForward::Dense { d_ff: Some(g.d_ff() as u64) },
            Some(m) => FeedForward::Moe(MoePlan {
                experts: m.experts as u64,
                top_k: m.top_k as u64,
                d_expert: m.d_expert.unwrap_or_else(|| g.d_ff()) as u64,
                placements,
            }),
        };
        model_units(&shape, &ff).unwrap()
    }

    #[test]
    fn micro_batches_scale_a_configs_compute_and_not_its_units() {
        let one = example("tinyshakespeare.toml");
        let mut four = one.clone();
        four.train.micro_batches = 4;
        let hw = HardwareProfile::default();
        let (a, b) =
            (plan_args_for_config(&one, &hw, false).unwrap(), plan_args_for_config(&four, &hw, false).unwrap());
        assert_eq!(a.model.units.len(), b.model.units.len());
        for (a, b) in a.model.units.iter().zip(&b.model.units) {
            assert_eq!((a.numel, a.compute_bytes), (b.numel, b.compute_bytes), "{}", a.name);
            assert!((b.forward_flops - 4.0 * a.forward_flops).abs() <= 1e-9 * b.forward_flops.max(1.0), "{}", a.name);
        }
    }

    #[test]
    fn a_rank_of_two_plans_half_the_optimizer_state_and_all_of_the_compute_copies() {
        let mut cfg = example("llama-shakespeare.toml");
        cfg.budgets.host = bytesize::ByteSize::gib(1);
        let hw = HardwareProfile::default();
        let one = plan_args_for_config(&cfg, &hw, false).unwrap();
        let two = PlanArgs { world_size: 2, shard_parameters: false, ..one.clone() };
        // With the parameters sharded too (the default), half of the compute copies as well.
        let three = PlanArgs { world_size: 2, shard_parameters: true, ..one.clone() };
        let (h3, _) = host_and_nvme_plan(&three, &plan_model(&three).unwrap());
        let ((h1, n1), (h2, n2)) = (
            host_and_nvme_plan(&one, &plan_model(&one).unwrap()),
            host_and_nvme_plan(&two, &plan_model(&two).unwrap()),
        );
        assert_eq!(h2.compute_copies_bytes, h1.compute_copies_bytes);
        let (c1, c3) = (h1.compute_copies_bytes, h3.compute_copies_bytes);
        assert!(c3 * 2 >= c1 && c3 * 2 <= c1 + 2 * 4096 * one.model.units.len() as u64, "{c1} vs {c3}");
        // The shards are ⌈numel / 2⌉: half, or half an element more, per unit.
        let units: u64 = one.model.units.iter().map(|u| u.numel).sum();
        let (s1, s2) = (n1.unwrap().state_bytes, n2.unwrap().state_bytes);
        assert!(s2 * 2 >= s1 && s2 * 2 <= s1 + 24 * one.model.units.len() as u64 + 2 * 4096, "{s1} vs {s2}");
        assert!(h2.speculation_bytes * 2 <= h1.speculation_bytes + 8 * one.model.units.len() as u64);
        assert!(units > 0 && h2.min_bytes < h1.min_bytes);
    }

    #[test]
    fn parameters_on_nvme_add_the_compute_copies_nvme_traffic_as_the_host_tier_caches_them() {
        let on_host = example("tinyshakespeare.toml");
        let hw = HardwareProfile::default();
        let args = plan_args_for_config(&on_host, &hw, false).unwrap();
        let base = plan_model(&args).unwrap().sim.link_bytes;
        let copies: u64 = args.model.units.iter().map(|u| u.compute_bytes).sum();
        // Parameters on NVMe with a host budget at the run's minimum: the host tier caches only
        // the units in use and the window, so every copy is read and written back each step.
        let mut args_nvme = args.clone();
        args_nvme.params = StatePlacement::Nvme;
        let (min_host, _) = host_and_nvme_plan(&args_nvme, &plan_model(&args_nvme).unwrap());
        args_nvme.host_budget_bytes = Some(min_host.min_bytes);
        let tight = plan_model(&args_nvme).unwrap().sim.link_bytes;
        assert!(tight.nvme_read >= base.nvme_read + copies, "{tight:?} vs {base:?}");
        assert!(tight.nvme_write >= base.nvme_write + copies, "{tight:?} vs {base:?}");
        // A host budget that holds every copy: no compute-copy traffic in the steady state.
        args_nvme.host_budget_bytes = Some(1 << 30);
        let roomy = plan_model(&args_nvme).unwrap().sim.link_bytes;
        assert_eq!((roomy.nvme_read, roomy.nvme_write), (base.nvme_read, base.nvme_write));
    }

    #[test]
    fn a_configs_units_from_the_model_agree_with_the_gpt_formulas() {
        for name in ["tinyshakespeare.toml", "tinyshakespeare-resident.toml", "tinyshakespeare-moe.toml"] {
            let cfg = example(name);
            let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
            // Two independent counts: the model's unit layouts and FLOPs vs this module's formulas.
            let formulas = shape_units(&cfg, args.model.placements.clone());
            let from_model = &args.model.units;
            assert_eq!(from_model.len(), formulas.len(), "{name}");
            for (a, b) in from_model.iter().zip(&formulas) {
                assert_eq!(
                    (a.numel, a.compute_bytes, a.host_compute),
                    (b.numel, b.compute_bytes, b.host_compute),
                    "{name}: {a:?} vs {b:?}"
                );
                assert!(
                    (a.forward_flops - b.forward_flops).abs() <= 1e-9 * b.forward_flops.max(1.0),
                    "{name}: {a:?} vs {b:?}"
                );
            }
            let r = plan_model(&args).unwrap();
            assert!(r.step_s > 0.0 && r.compute_s > 0.0, "{name}: {r:?}");
        }
    }

    /// `oogc plan` lists the units `[optimizer] device_units` places, as the trainer chooses
    /// them: the embedding first, then the first blocks; "auto" only with a spare budget.
    #[test]
    fn the_plan_names_the_device_optimizer_units() {
        let mut cfg = example("tinyshakespeare.toml");
        let hw = HardwareProfile::default();
        let names = |cfg: &TrainConfig| -> Vec<String> {
            plan_args_for_config(cfg, &hw, false).unwrap().device_units.into_iter().map(|(n, _)| n).collect()
        };
        assert!(names(&cfg).is_empty());
        cfg.optimizer.device_units = crate::config::DeviceUnits::Count(2);
        let two = names(&cfg);
        let model = crate::train::build_model(&cfg, 256).unwrap();
        assert_eq!(two, [model.units()[0].name.clone(), model.units()[1].name.clone()]);
        let args = plan_args_for_config(&cfg, &hw, false).unwrap();
        let text = render_plan(&args, &plan_model(&args).unwrap());
        assert!(text.contains("device optimizers") && text.contains(&two[1]), "{text}");
        // "auto" below the compute copies places none; with twice their bytes, some.
        cfg.optimizer.device_units = crate::config::DeviceUnits::Auto(crate::config::AutoKeyword::Auto);
        assert!(names(&cfg).is_empty());
        let copies: u64 = model.units().iter().map(|u| 4 * u.numel as u64).sum();
        cfg.budgets.gpu = bytesize::ByteSize::b(2 * copies);
        assert!(!names(&cfg).is_empty());
    }

    #[test]
    fn moe_placement_follows_the_cost_model() {
        let mut cfg = example("tinyshakespeare-moe.toml");
        let hw = HardwareProfile::default();
        let model = crate::train::build_model(&cfg, 256).unwrap();
        let p = moe_placement(&cfg, &*model, &hw);
        assert_eq!((p.len(), p[0].len()), (4, 8));
        // The sim device's GPU is this CPU: keeping an expert resident saves nothing, and the
        // block balances its experts between fetching and the CPU.
        let all: Vec<Placement> = p.iter().flatten().copied().collect();
        assert!(!all.contains(&Placement::Resident), "{p:?}");
        assert!(all.contains(&Placement::Cpu) && all.contains(&Placement::Fetch), "{p:?}");
        let args = plan_args_for_config(&cfg, &hw, false).unwrap();
        let cpu = args.model.units.iter().filter(|u| u.host_compute).count();
        assert_eq!(cpu, all.iter().filter(|&&q| q == Placement::Cpu).count());
        cfg.moe.cpu_compute = false;
        assert!(moe_placement(&cfg, &*model, &hw).iter().flatten().all(|&q| q != Placement::Cpu));
        cfg.moe.policy = crate::config::MoePolicy::Fetch;
        assert!(moe_placement(&cfg, &*model, &hw).iter().flatten().all(|&q| q == Placement::Fetch));
        // A fast device beside a slow CPU keeps a hot set.
        cfg.moe.policy = crate::config::MoePolicy::Ours;
        cfg.device.kind = crate::config::DeviceKind::Cuda(0);
        let hot = moe_placement(&cfg, &*model, &hw).iter().flatten().filter(|&&q| q == Placement::Resident).count();
        assert!(hot > 0, "{hot}");
    }

    #[test]
    fn a_cuda_config_is_planned_with_the_datasheet_and_says_so() {
        let cfg = example("llama-8b-h100.toml");
        let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
        let text = render_plan(&args, &plan_model(&args).unwrap());
        assert!(text.contains("GPU figures from the NVIDIA H100"), "{text}");
        assert!(text.contains("989 TFLOP/s bf16"), "{text}");
        // None of the sim device's figures: its source, its 50 GFLOP/s, its 15 GB/s links.
        for sim in ["sim device", "compute: 50.0 GFLOP/s", "H2D 15.0 GB/s"] {
            assert!(!text.contains(sim), "{sim} in:\n{text}");
        }
        assert!(
            text.contains("GPU memory: what the run needs on the device") && text.contains("fits the GPU"),
            "{text}"
        );
    }

    #[test]
    fn a_profiles_gpu_rate_scales_the_compute() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = example("llama-8b-h100.toml");
        let plan_with = |tflops: f64| {
            let path = dir.path().join(format!("gpu-{tflops}.toml"));
            std::fs::write(
                &path,
                format!(
                    "h2d_gbps = 50.0\nd2h_gbps = 50.0\ndevice_name = \"NVIDIA H100 80GB HBM3\"\n\
                     device_memory_bytes = 85520809984\ndevice_bf16_tflops = {tflops}\ndevice_f32_tflops = 50.0\n\
                     source = \"test\"\n"
                ),
            )
            .unwrap();
            let args = plan_args_for_config(&cfg, &HardwareProfile::load(&path).unwrap(), false).unwrap();
            let r = plan_model(&args).unwrap();
            (args, r)
        };
        let (a400, r400) = plan_with(400.0);
        let (_, r800) = plan_with(800.0);
        let ratio = r400.compute_s / r800.compute_s;
        assert!((ratio - 2.0).abs() < 1e-9, "{ratio}");
        assert_eq!(a400.hardware.device_gflops, 400.0 * 0.5 * 1000.0);
        // The profile's GPU memory is what the plan compares with.
        let gpu = a400.device.unwrap();
        assert_eq!(gpu.device_memory_bytes, 85_520_809_984);
        assert!(gpu.device_memory_source.contains("NVIDIA H100 80GB HBM3"), "{}", gpu.device_memory_source);
    }

    #[test]
    fn the_gpu_figure_of_the_main_job() {
        // configs/llama-shakespeare.toml: d 128, 4 blocks, 4 query heads of 32 over 2 key/value
        // heads, SwiGLU 344, batch 16 × 128 tokens, f32, on the sim device.
        let cfg = example("llama-shakespeare.toml");
        let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
        let g = args.device.as_ref().unwrap();
        assert!(g.sim);
        let p = &g.plan;
        // A block: q and o 128·128 each, k and v 128·64 each, gate/up 2·344·128, down 344·128,
        // two norms of 128: 181,504 parameters, 726,016 B in f32 — the largest unit.
        let block = 4 * (2 * 16_384 + 2 * 8_192 + 3 * 344 * 128 + 2 * 128);
        assert_eq!(block, 726_016);
        assert_eq!((p.gradient_staging_bytes, p.in_use_copies_bytes), (block, block));
        // Checkpoints: 4 blocks' inputs + the head's, [16, 128, 128] f32 = 1 MiB each.
        assert_eq!(p.checkpoints_bytes, 5 << 20);
        assert_eq!(p.input_gradients_bytes, 2 << 20);
        // The swapper's share is the GPU budget (1900 KiB): staging, candle's copy, residency.
        assert_eq!(p.swapper_bytes(), 1900 << 10);
        assert_eq!(p.peak_unit, crate::runtime::device_plan::PeakUnit::Block);
        assert_eq!(p.attention_chunk, 128);
        assert!(p.attention_bytes > 0 && g.fits());
        let json = g.to_json();
        assert_eq!(json["total_bytes"].as_u64(), Some(p.total_bytes()));
        assert_eq!(json["parts"].as_array().map(Vec::len), Some(12));
    }

    #[test]
    fn a_bad_moe_placement_is_refused() {
        let s = GptShape { layers: 2, d_model: 32, seq_len: 8, batch: 1, dtype_bytes: 4 };
        let ff =
            FeedForward::Moe(MoePlan { experts: 4, top_k: 2, d_expert: 64, placements: vec![vec![Placement::Cpu; 4]] });
        assert!(model_units(&s, &ff).unwrap_err().to_string().contains("2 blocks x 4 experts"));
    }
}
