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
//!
//! | file | part |
//! |---|---|
//! | `model.rs` | the units of a GPT shape or of a config's model |
//! | `device.rs` | the GPU memory a config's run needs |
//! | `host.rs` | the host budget's split, the NVMe store, the step through the simulator |
//! | `render.rs` | the table `oogc plan` prints |
//!
//! This file holds what to plan for a config ([`PlanArgs`], [`plan_args_for_config`],
//! [`moe_placement`]).

use oogc_models::{CausalLm, UnitKind};
use oogc_moe_placement::{ColdMode, CostModel, CostModelConfig, ExpertShape, Placement, PopularityProfile};
use oogc_optimizer::OptimizerConfig;
use oogc_prefetch::{GpuDatasheet, HardwareProfile};
use oogc_swapper::StatePlacement;

use crate::config::TrainConfig;
use crate::runtime::budget::OverheadInputs;

mod device;
mod host;
mod model;
mod render;

pub use device::{device_plan_for_config, device_shape, GpuMemory};
pub use host::{host_and_nvme_plan, plan_model};
pub use model::{
    attention_forward_flops, dense_block_params, expert_params, gpt_units, model_units, moe_trunk_params, FeedForward,
    GptShape, MoePlan, PlannedModel, VOCAB,
};
pub use render::render_plan;

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
    /// [`crate::train::choose_device_units`]), with their GPU bytes
    /// ([`crate::runtime::device_optimizer_bytes`]: 16, 12 or 10.03 B per parameter by
    /// `[optimizer] state_dtype`, + the compute copy), carved out of the GPU budget; empty for none.
    pub device_units: Vec<(String, u64)>,
    /// What the run needs on the GPU and whether it fits (an `oogc train` config's; `None` for
    /// a shape-only plan).
    pub device: Option<GpuMemory>,
    /// The run writes checkpoints (`[checkpoint] dir`): the host plan keeps one unit's state
    /// for them ([`crate::runtime::budget::checkpoint_staging_bytes`]).
    pub checkpoints: bool,
    /// MoE: the hot set and the expected expert bytes per step at the routing skew planned
    /// with ([`plan_args_at_skew`]); `None` for a dense model or a shape-only plan.
    pub experts: Option<PlannedExperts>,
}

/// An MoE config's experts in a steady-state step at a routing skew: how many the hot set
/// holds, and the expert bytes a step is expected to move H2D (what the run's metrics call
/// `expert_h2d_bytes`).
///
/// Expected bytes: a non-resident expert that is not computed on the CPU is fetched when it
/// receives at least one token ([`PopularityProfile::used_probability`] at its rank's share), once
/// per step (its forward copy kept for its backward, as the run keeps it when the GPU budget
/// allows); a resident one moves nothing (with device optimizers its update stays on the
/// device too). `fetch_h2d_bytes` is the same step under `[moe] policy = "fetch"` (every used
/// expert fetched).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PlannedExperts {
    /// Where the skew came from: `uniform routing`, or the routing trace's path.
    pub routing: String,
    /// The share of a block's routed assignments its most popular quarter of experts takes
    /// (0.25 under uniform routing).
    pub top_quarter_share: f64,
    /// Experts resident for the whole step (the hot set), over all blocks.
    pub hot: usize,
    /// Experts computed on the CPU from their host copy, over all blocks.
    pub cpu: usize,
    /// Expected experts fetched per step.
    pub expected_fetches: f64,
    /// Expected expert bytes H2D per step (compute copies, `[train] compute_dtype`).
    pub expected_h2d_bytes: f64,
    /// Expected expert bytes H2D per step when every used expert is fetched.
    pub fetch_h2d_bytes: f64,
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
    plan_args_at_skew(cfg, hardware, trace, None)
}

/// [`plan_args_for_config`] with MoE experts placed at a routing skew: `routing` is a
/// profile and where it came from (`oogc plan --routing-trace`: [`PopularityProfile::from_trace`],
/// carried over to the config's expert count); `None` plans uniform routing.
///
/// # Errors
/// As [`plan_args_for_config`].
pub fn plan_args_at_skew(
    cfg: &TrainConfig,
    hardware: &HardwareProfile,
    trace: bool,
    routing: Option<(&PopularityProfile, &str)>,
) -> Result<PlanArgs, PlanError> {
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
    let (placements, experts) = match moe_placement_at(cfg, &*model, &hardware, routing) {
        Some((p, e)) => (p, Some(e)),
        None => (Vec::new(), None),
    };
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
            (spec.name.clone(), crate::runtime::device_optimizer_bytes(spec.numel, dtype, cfg.optimizer.state_dtype))
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
        checkpoints: cfg.checkpoint.dir.is_some(),
        experts,
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
    moe_placement_at(cfg, model, hardware, None).map(|(p, _)| p).unwrap_or_default()
}

/// [`moe_placement`] at a routing skew (`None`: uniform routing), `[block][expert]` with
/// `block` the MoE block's number (the sparse layers in order), with the step's expected
/// expert traffic ([`PlannedExperts`]); `None` for a dense model. Expert `e` of a block is the
/// profile's rank `e` (it receives `tokens · top_k · share[e]` of the step's tokens), so the hot
/// set, filled in turn across the blocks, holds the most popular ranks; an expert is kept only
/// when keeping it beats its moves under the cost model at its own token count.
pub fn moe_placement_at(
    cfg: &TrainConfig,
    model: &dyn CausalLm,
    hardware: &HardwareProfile,
    routing: Option<(&PopularityProfile, &str)>,
) -> Option<(Vec<Vec<Placement>>, PlannedExperts)> {
    let experts_of = |u: &oogc_models::UnitSpec| match u.kind {
        UnitKind::Expert { block, expert } => Some((block, expert, u.numel as u64)),
        _ => None,
    };
    let all: Vec<(usize, usize, u64)> = model.units().iter().filter_map(experts_of).collect();
    let &(_, _, numel) = all.first()?;
    // The MoE blocks (the sparse layers; dense layers among them have no experts).
    let mut moe_blocks: Vec<usize> = all.iter().map(|e| e.0).collect();
    moe_blocks.dedup();
    let layers = moe_blocks.len();
    let experts = all.iter().map(|e| e.1 + 1).max().unwrap_or(0);
    let top_k = model.moe().map_or(1, |m| m.experts_per_token());
    let bytes = cfg.train.compute_dtype.dtype().num_bytes(numel as usize) as u64;
    let step_tokens = (cfg.train.batch_size * cfg.train.seq_len) as u64;
    let (profile, source) = match routing {
        Some((p, source)) => (p.resample(experts), source.to_string()),
        None => (PopularityProfile::uniform(experts), "uniform routing".to_string()),
    };
    let tokens: Vec<u64> =
        profile.shares().iter().map(|s| (step_tokens as f64 * top_k as f64 * s).round() as u64).collect();
    let used: Vec<f64> = (0..experts).map(|r| profile.used_probability(r, step_tokens, top_k)).collect();
    let traffic = |placements: &[Vec<Placement>]| {
        let hot = placements.iter().flatten().filter(|&&q| q == Placement::Resident).count();
        let cpu = placements.iter().flatten().filter(|&&q| q == Placement::Cpu).count();
        let fetches: f64 = placements
            .iter()
            .flat_map(|block| block.iter().zip(&used))
            .filter(|(&q, _)| q != Placement::Resident && q != Placement::Cpu)
            .map(|(_, &p)| p)
            .sum();
        PlannedExperts {
            routing: source.clone(),
            top_quarter_share: profile.top_share(0.25),
            hot,
            cpu,
            expected_fetches: fetches,
            expected_h2d_bytes: fetches * bytes as f64,
            fetch_h2d_bytes: layers as f64 * used.iter().sum::<f64>() * bytes as f64,
        }
    };
    if !crate::moe::places_experts(cfg) {
        let placements = vec![vec![Placement::Fetch; experts]; layers];
        let t = traffic(&placements);
        return Some((placements, t));
    }
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
        let placements = vec![vec![Placement::Fetch; experts]; layers];
        let t = traffic(&placements);
        return Some((placements, t));
    };
    let mode = if cfg.moe.cpu_compute { ColdMode::FetchOrCpu } else { ColdMode::FetchOnly };
    // A hot expert's GPU bytes: its compute copy, and its optimizer when it lives there.
    let hot_bytes = crate::moe::hot_expert_bytes(cfg, numel as usize, crate::dist::World::SINGLE);
    let capacity = ((pc.hot_set.budget_bytes / hot_bytes.max(1)) as usize).min(layers * experts);
    let horizon = 1.0 / (1.0 - cfg.moe.popularity_decay).max(1e-6);
    let worth_keeping = |tokens: u64| {
        cost.hot_benefit_s(tokens as f64, 1.0, mode, pc.hot_set.keeps_gradients) * horizon
            > (1.0 + pc.hot_set.margin) * cost.h2d_s(pc.hot_set.admit_bytes.unwrap_or(bytes))
    };
    let placements: Vec<Vec<Placement>> = (0..layers)
        .map(|b| {
            // Expert e of block b is the (e · layers + b)-th in turn.
            let resident: Vec<bool> =
                (0..experts).map(|e| e * layers + b < capacity && worth_keeping(tokens[e])).collect();
            cost.place_block(&tokens, &resident, mode)
        })
        .collect();
    let t = traffic(&placements);
    Some((placements, t))
}

#[cfg(test)]
mod tests {
    use oogc_prefetch::plan::ModelUnit;

    use super::*;

    /// The example config `configs/{name}`, loaded.
    pub(super) fn example(name: &str) -> TrainConfig {
        TrainConfig::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(name)).unwrap()
    }

    /// The GPT-shape formulas of `model.rs`, for a GPT config.
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
    fn a_configs_units_from_the_model_agree_with_the_gpt_formulas() {
        for name in ["tinyshakespeare.toml", "tinyshakespeare-resident.toml", "tinyshakespeare-moe.toml"] {
            let cfg = example(name);
            let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
            // Two independent counts: the model's unit layouts and FLOPs vs `model.rs`'s formulas.
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
        // Their bytes follow `[optimizer] state_dtype`, in the list and the device plan: fewer
        // with bf16 and int8 moments.
        let mut totals = Vec::new();
        for dtype in
            [oogc_optimizer::StateDType::F32, oogc_optimizer::StateDType::Bf16, oogc_optimizer::StateDType::Int8]
        {
            cfg.optimizer.state_dtype = dtype;
            let args = plan_args_for_config(&cfg, &hw, false).unwrap();
            let want: Vec<u64> = model.units()[..2]
                .iter()
                .map(|u| crate::runtime::device_optimizer_bytes(u.numel, cfg.train.compute_dtype.dtype(), dtype))
                .collect();
            assert_eq!(args.device_units.iter().map(|(_, b)| *b).collect::<Vec<_>>(), want, "{dtype}");
            let total: u64 = want.iter().sum();
            assert_eq!(args.device.as_ref().unwrap().plan.device_optimizer_bytes, total, "{dtype}");
            totals.push(total);
        }
        assert!(totals[0] > totals[1] && totals[1] > totals[2], "{totals:?}");
        cfg.optimizer.state_dtype = oogc_optimizer::StateDType::F32;
        // "auto" below the compute copies places none; with twice their bytes, some.
        cfg.optimizer.device_units = crate::config::DeviceUnits::Auto(crate::config::AutoKeyword::Auto);
        assert!(names(&cfg).is_empty());
        let copies: u64 = model.units().iter().map(|u| 4 * u.numel as u64).sum();
        cfg.budgets.gpu = bytesize::ByteSize::b(2 * copies);
        assert!(!names(&cfg).is_empty());
    }

    #[test]
    fn a_measured_routing_skew_places_the_hot_set_on_the_used_experts() {
        // Mixtral's example: 4 blocks of 8 experts, an expert budget of 16 hot experts with
        // their optimizer; the hot set alone (no CPU compute).
        let mut cfg = example("mixtral-shakespeare.toml");
        cfg.moe.cpu_compute = false;
        let hw = HardwareProfile::default();
        let model = crate::train::build_model(&cfg, 1024).unwrap();
        let bytes =
            4.0 * model.units().iter().find(|u| matches!(u.kind, UnitKind::Expert { .. })).unwrap().numel as f64;
        let (_, uniform) = moe_placement_at(&cfg, &*model, &hw, None).unwrap();
        assert_eq!(uniform.hot, 16);
        // A trace in which experts 4..8 of every block never receive a token, and expert 3
        // only every other step.
        let header = oogc_moe_placement::TraceHeader::new(4, 8, 2, 10, 40, 80.0, 512);
        let mut trace = oogc_moe_placement::RoutingTrace::new(header);
        trace.steps = (0..10u64)
            .map(|s| {
                (s + 1, (0..32).map(|i| [400, 300, 200, if s % 2 == 0 { 124 } else { 0 }, 0, 0, 0, 0][i % 8]).collect())
            })
            .collect();
        let profile = PopularityProfile::from_trace(&trace, 0).unwrap();
        let (p, skewed) = moe_placement_at(&cfg, &*model, &hw, Some((&profile, "trace"))).unwrap();
        // The hot set holds ranks 0..4 of every block: nothing left to fetch but what is never
        // used, so no bytes are expected; under uniform routing, 16 used cold experts per step.
        assert!(p.iter().all(|b| b[..4].iter().all(|&q| q == Placement::Resident)), "{p:?}");
        assert!(skewed.expected_h2d_bytes.abs() < 1e-9, "{skewed:?}");
        assert!((uniform.expected_h2d_bytes - 16.0 * bytes).abs() < 1e-6 * bytes, "{uniform:?}");
        // Fetching every used expert: 3 per block every step and the fourth every other step,
        // against all 8 under uniform routing (at the trace's own 512 tokens, top-2).
        assert!((skewed.fetch_h2d_bytes - 4.0 * 3.5 * bytes).abs() < 1e-6 * bytes, "{skewed:?}");
        assert!((uniform.fetch_h2d_bytes - 32.0 * bytes).abs() < 1e-6 * bytes, "{uniform:?}");
        assert!(skewed.top_quarter_share > 0.6 && (uniform.top_quarter_share - 0.25).abs() < 1e-12);
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
}
