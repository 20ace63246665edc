//! `oogc plan`: memory per tier, the minimum GPU budget and the predicted step time of a GPT
//! (dense or MoE) under budgets (the library part is [`oogc_prefetch::plan`]), `oogc plan
//! --hardware-probe`, which measures this machine's figures into a [`HardwareProfile`], and the
//! compute probe behind `oogc plan --probe-compute`, which measures the sim device's compute
//! rate for a model's shape.
//!
//! | piece | what it does |
//! |---|---|
//! | [`GptShape`], [`FeedForward`], [`model_units`] | the units of a byte-level GPT (dense or MoE) and their sizes and FLOPs (small pure functions) |
//! | [`plan_args_for_config`], [`moe_placement`] | what to plan for an `oogc train` config, MoE expert placement included |
//! | [`plan_gpt`] | [`oogc_prefetch::plan::plan`] over those units |
//! | [`probe_compute`] | candle's forward and backward of one block of the model on this CPU (the sim device): `device_gflops` and `backward_flops_ratio` |
//! | [`probe`] | STREAM triad, NVMe store write/read on a directory, a scalar fp32 Adam loop, and the compute probe |
//!
//! **FLOP model** (forward, one step of `N = seq · batch` tokens; the backward with recompute is
//! [`HardwareProfile::backward_flops_ratio`] × this): `2 · params · N` for the matmuls of a unit,
//! plus `4 · seq · d · N` for a block's attention scores and weighted sum (causal masking not
//! halved); the embedding is a gather (0). An MoE expert sees `top_k / experts` of the tokens
//! (uniform routing, no capacity drops). [`probe_compute`] counts a probed block's FLOPs with the
//! same formulas, so its GFLOP/s is the rate that turns the planner's FLOPs into the sim device's
//! seconds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{Device, Tensor};
use oogc_moe_placement::{ColdMode, CostModel, CostModelConfig, ExpertShape, Placement};
use oogc_prefetch::plan::{plan, ModelUnit, PlanInput, PlanReport, StatePlacement};
use oogc_prefetch::{HardwareProfile, PrefetchConfig};
use oogc_swapper::{EngineChoice, NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig};
use serde::Serialize;

use crate::config::TrainConfig;
use oogc_models::{init_params, Gpt, GptConfig};

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
pub fn model_units(s: &GptShape, ff: &FeedForward) -> anyhow::Result<Vec<ModelUnit>> {
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
                bail!(
                    "the MoE placement must be {} blocks x {} experts (got {} blocks)",
                    s.layers,
                    m.experts,
                    m.placements.len()
                );
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

/// What `oogc plan` plans.
#[derive(Debug, Clone)]
pub struct PlanArgs {
    /// The model.
    pub shape: GptShape,
    /// The blocks' feed-forward: dense MLP or MoE experts with their placement.
    pub feed_forward: FeedForward,
    /// GPU bytes for unit copies.
    pub gpu_budget_bytes: u64,
    /// Host bytes, if limited.
    pub host_budget_bytes: Option<u64>,
    /// Optimizer state placement.
    pub optimizer_state: StatePlacement,
    /// Prefetch depth, units.
    pub max_depth: usize,
    /// The machine.
    pub hardware: HardwareProfile,
    /// Build the Perfetto trace of the simulated step.
    pub trace: bool,
}

/// The plan of an `oogc train` config: its model (f32 compute copies, as on the sim device; MoE
/// blocks with [`moe_placement`]), batch, GPU and host budgets, state tier and prefetch depth. On
/// the sim device with a throttled link (`[device] link_gbps > 0`) the link replaces the
/// profile's H2D/D2H bandwidth, since that is the link the run will have.
pub fn plan_args_for_config(cfg: &TrainConfig, hardware: &HardwareProfile, trace: bool) -> PlanArgs {
    let mut hardware = hardware.clone();
    if cfg.device.kind == "sim" && cfg.device.link_gbps > 0.0 {
        hardware.h2d_gbps = cfg.device.link_gbps;
        hardware.d2h_gbps = cfg.device.link_gbps;
    }
    let feed_forward = match &cfg.model.moe {
        None => FeedForward::Dense { d_ff: Some(cfg.d_ff() as u64) },
        Some(m) => FeedForward::Moe(MoePlan {
            experts: m.experts as u64,
            top_k: m.top_k as u64,
            d_expert: m.d_expert.unwrap_or_else(|| cfg.d_ff()) as u64,
            placements: moe_placement(cfg, &hardware),
        }),
    };
    PlanArgs {
        shape: GptShape {
            layers: cfg.model.n_layer as u64,
            d_model: cfg.model.d_model as u64,
            seq_len: cfg.train.seq_len as u64,
            batch: cfg.train.batch_size as u64,
            dtype_bytes: 4,
        },
        feed_forward,
        gpu_budget_bytes: cfg.budgets.gpu.as_u64(),
        host_budget_bytes: Some(cfg.budgets.host.as_u64()),
        optimizer_state: match cfg.budgets.optimizer_state {
            crate::config::StateTier::Host => oogc_prefetch::plan::StatePlacement::Host,
            crate::config::StateTier::Nvme => oogc_prefetch::plan::StatePlacement::Nvme,
        },
        max_depth: cfg.prefetch.depth.max(1),
        hardware,
        trace,
    }
}

/// Where the experts of an MoE config run in a steady-state step, `[block][expert]` (empty for a
/// dense config): the trainer's placement logic applied to **uniform routing** (every expert
/// receives `top_k / experts` of the step's tokens), a coarse model of `[moe]`:
///
/// - `policy = "fetch"` or `"resident"`: every expert [`Placement::Fetch`].
/// - `policy = "ours"`: the hot set holds `expert_budget / expert bytes` experts (spread over
///   the blocks in turn) when keeping an expert resident saves time under the cost model
///   ([`CostModel::hot_benefit_s`] over the statistics' horizon `1 / (1 − popularity_decay)`
///   steps beats the move, as [`oogc_moe_placement::HotSet::replan`] decides), else none; then
///   each block is placed by [`CostModel::place_block`] (cold experts fetched or computed on the
///   CPU, `cpu_compute` permitting).
///
/// The cost model gets the trainer's rates: the link (sim device) or 16 GB/s, and on the sim
/// device `hardware.device_gflops` for both GPU and CPU (the sim device's GPU is this CPU); on
/// a GPU the cost model's defaults. The trainer corrects its rates online and routing is not
/// uniform, so a real step places a few experts differently.
pub fn moe_placement(cfg: &TrainConfig, hardware: &HardwareProfile) -> Vec<Vec<Placement>> {
    let Some(m) = &cfg.model.moe else { return Vec::new() };
    let (layers, experts) = (cfg.model.n_layer, m.experts);
    if cfg.moe.policy != "ours" {
        return vec![vec![Placement::Fetch; experts]; layers];
    }
    let d = cfg.model.d_model as u64;
    let numel = expert_params(d, m.d_expert.unwrap_or_else(|| cfg.d_ff()) as u64);
    let bytes = numel * 4;
    let tokens = (cfg.train.batch_size * cfg.train.seq_len * m.top_k / experts.max(1)) as u64;
    let sim = cfg.device.kind == "sim";
    let link = if sim && cfg.device.link_gbps > 0.0 { cfg.device.link_gbps } else { 16.0 };
    let defaults = CostModelConfig::default();
    let rate = hardware.device_gflops;
    let cost = CostModel::new(
        ExpertShape { param_bytes: bytes, grad_bytes: bytes, flops_per_token: 8.0 * numel as f64 },
        CostModelConfig {
            h2d_gbps: link,
            d2h_gbps: link,
            gpu_gflops: if sim { rate } else { defaults.gpu_gflops },
            cpu_gflops: if sim { rate } else { defaults.cpu_gflops },
            ..defaults
        },
    );
    let Ok(cost) = cost else {
        // A rate that is not a positive number: the planner refuses the profile anyway.
        return vec![vec![Placement::Fetch; experts]; layers];
    };
    let mode = if cfg.moe.cpu_compute { ColdMode::FetchOrCpu } else { ColdMode::FetchOnly };
    let budget = cfg.moe.expert_budget.map_or(cfg.budgets.gpu.as_u64() / 4, |b| b.as_u64());
    let capacity = ((budget / bytes.max(1)) as usize).min(layers * experts);
    let horizon = 1.0 / (1.0 - cfg.moe.popularity_decay).max(1e-6);
    let worth_keeping = cost.hot_benefit_s(tokens as f64, 1.0, mode) * horizon > 1.5 * cost.h2d_s(bytes);
    let hot = if worth_keeping { capacity } else { 0 };
    (0..layers)
        .map(|b| {
            // Expert e of block b is the (e · layers + b)-th in turn.
            let resident: Vec<bool> = (0..experts).map(|e| e * layers + b < hot).collect();
            cost.place_block(&vec![tokens; experts], &resident, mode)
        })
        .collect()
}

/// Plans a GPT: [`model_units`] then [`oogc_prefetch::plan::plan`].
///
/// # Errors
/// A zero dimension; an MoE placement of the wrong shape; the planner's errors (a GPU budget
/// below the minimum names the minimum in bytes).
pub fn plan_gpt(args: &PlanArgs) -> anyhow::Result<PlanReport> {
    if args.shape.layers == 0 || args.shape.d_model == 0 || args.shape.seq_len == 0 || args.shape.batch == 0 {
        bail!("--layers, --d-model, --seq-len and --batch must be > 0");
    }
    let input = PlanInput {
        units: model_units(&args.shape, &args.feed_forward)?,
        gpu_budget_bytes: args.gpu_budget_bytes,
        host_budget_bytes: args.host_budget_bytes,
        optimizer_state: args.optimizer_state,
        prefetch: PrefetchConfig { max_depth: args.max_depth, ..PrefetchConfig::default() },
        steps: 3,
        trace: args.trace,
    };
    plan(&input, &args.hardware).context("planning the step")
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// One line describing the model of `args` (`GPT byte-vocab, 8 layers, d_model 192, ...`).
pub fn describe_model(args: &PlanArgs) -> String {
    let s = &args.shape;
    let ff = match &args.feed_forward {
        FeedForward::Dense { d_ff } => format!("MLP {}", d_ff.unwrap_or(4 * s.d_model)),
        FeedForward::Moe(m) => format!("MoE {} experts top-{} of width {}", m.experts, m.top_k, m.d_expert),
    };
    format!("GPT byte-vocab, {} layers, d_model {}, {ff}, seq {} x batch {}", s.layers, s.d_model, s.seq_len, s.batch)
}

/// Prints a plan as a human-readable table.
pub fn print_plan(args: &PlanArgs, r: &PlanReport) {
    println!(
        "model: {}: {} units, {:.1} M params, compute copies {}",
        describe_model(args),
        r.units,
        r.params as f64 / 1e6,
        gib(r.model_bytes)
    );
    if let FeedForward::Moe(m) = &args.feed_forward {
        println!(
            "experts: {} hot (resident), {} fetched, {} computed on the CPU, {} idle — the trainer's placement under \
             uniform routing (coarse: real routing is skewed and the trainer re-places every step)",
            m.count(Placement::Resident),
            m.count(Placement::Fetch),
            m.count(Placement::Cpu),
            m.count(Placement::Skip)
        );
    }
    println!("hardware: {}", args.hardware.source);
    println!(
        "compute: {:.1} GFLOP/s, backward {:.2} x forward",
        args.hardware.device_gflops, args.hardware.backward_flops_ratio
    );
    println!();
    println!("{:<10} {:>14} {:>16}  note", "tier", "peak bytes", "GiB");
    println!(
        "{:<10} {:>14} {:>16}  budget {} (minimum {} B; all units resident at {} B)",
        "gpu",
        r.memory.device_bytes,
        gib(r.memory.device_bytes),
        args.gpu_budget_bytes,
        r.min_gpu_budget_bytes,
        r.full_gpu_budget_bytes
    );
    println!(
        "{:<10} {:>14} {:>16}  compute copies + {} + gradients in flight",
        "host",
        r.memory.host_bytes,
        gib(r.memory.host_bytes),
        if r.optimizer_state_on_nvme { "NVMe staging" } else { "optimizer state (12 B/param)" }
    );
    println!(
        "{:<10} {:>14} {:>16}  {}",
        "nvme",
        r.memory.nvme_bytes,
        gib(r.memory.nvme_bytes),
        if r.optimizer_state_on_nvme { "optimizer state (12 B/param)" } else { "-" }
    );
    println!();
    let pct = |x: f64| 100.0 * x / r.step_s.max(1e-12);
    println!(
        "predicted step: {:.4} s (lower bound {:.4} s, {:.2}x)",
        r.step_s,
        r.lower_bound_s,
        r.step_s / r.lower_bound_s.max(1e-12)
    );
    println!("  compute            {:>10.4} s  {:>5.1}%", r.compute_s, pct(r.compute_s));
    println!("  exposed transfer   {:>10.4} s  {:>5.1}%", r.exposed_transfer_s, pct(r.exposed_transfer_s));
    println!("  exposed optimizer  {:>10.4} s  {:>5.1}%", r.exposed_optimizer_s, pct(r.exposed_optimizer_s));
    let lb = &r.sim.link_bytes;
    println!("  bytes per step: h2d {} d2h {} nvme read {} nvme write {}", lb.h2d, lb.d2h, lb.nvme_read, lb.nvme_write);
    for w in &r.warnings {
        println!("warning: {w}");
    }
}

/// The shape the compute probe times: one block of `model` (its `n_layer` is ignored) over a
/// batch of `batch` sequences of `seq_len` tokens, on `threads` CPU threads.
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeShape {
    /// The model: width, heads, MLP width or MoE experts.
    pub model: GptConfig,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per step.
    pub batch: usize,
    /// candle's CPU compute threads (the sim device's; [`crate::run::compute_threads`]).
    pub threads: usize,
}

impl ComputeShape {
    /// The shape of an `oogc train` config: its model, `train.seq_len`, `train.batch_size`,
    /// `[threads] compute`.
    pub fn for_config(cfg: &TrainConfig) -> Self {
        Self {
            model: crate::train::gpt_config(cfg),
            seq_len: cfg.train.seq_len,
            batch: cfg.train.batch_size,
            threads: crate::run::compute_threads(cfg),
        }
    }

    /// The main example job's block (`configs/tinyshakespeare.toml`): dense, `d_model` 192, 6
    /// heads, MLP 768, 16 sequences of 128 tokens, all cores. What `oogc plan --hardware-probe`
    /// times without `--config`.
    pub fn representative() -> Self {
        Self {
            model: GptConfig { d_model: 192, n_head: 6, max_seq_len: 128, ..GptConfig::default() },
            seq_len: 128,
            batch: 16,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }

    /// Forward FLOPs of the probed block under the planner's FLOP model (module docs): a dense
    /// block, or an MoE trunk plus `top_k` experts' worth of tokens.
    pub fn block_forward_flops(&self) -> f64 {
        let m = &self.model;
        let (d, tokens) = (m.d_model as u64, (self.seq_len * self.batch) as u64);
        let attention = attention_forward_flops(self.seq_len as u64, d, tokens);
        match &m.moe {
            None => 2.0 * (dense_block_params(d, m.ff_dim() as u64) * tokens) as f64 + attention,
            Some(moe) => {
                let trunk = moe_trunk_params(d, moe.experts as u64);
                let expert = expert_params(d, m.expert_dim() as u64);
                2.0 * (trunk * tokens) as f64 + attention + 2.0 * (expert * tokens * moe.top_k as u64) as f64
            }
        }
    }

    /// `dense block d_model 192, 6 heads, MLP 768, seq 128 x batch 16, 2 threads`.
    pub fn describe(&self) -> String {
        let m = &self.model;
        let ff = match &m.moe {
            None => format!("dense block d_model {}, {} heads, MLP {}", m.d_model, m.n_head, m.ff_dim()),
            Some(moe) => format!(
                "MoE block d_model {}, {} heads, {} experts top-{} of width {}",
                m.d_model,
                m.n_head,
                moe.experts,
                moe.top_k,
                m.expert_dim()
            ),
        };
        format!("{ff}, seq {} x batch {}, {} threads", self.seq_len, self.batch, self.threads)
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
/// [`crate::run::size_compute_threads`], used from the main thread), else inside a dedicated
/// pool of `threads` threads (`ThreadPool::install`: `f` runs on one of its workers, which
/// spares the wake-up of the pool's threads at every parallel op — small ops run faster there
/// than from outside the pool, so figures taken that way may beat `oogc train`'s).
///
/// Asking for the current pool's size builds the global pool (default size) if nothing has yet:
/// call [`crate::run::size_compute_threads`] first where that matters.
///
/// # Errors
/// When the dedicated pool cannot be built.
pub fn with_compute_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> anyhow::Result<R> {
    if rayon::current_num_threads() == threads.max(1) {
        return Ok(f());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("oogc-compute-{i}"))
        .build()
        .context("building the compute thread pool")?;
    Ok(pool.install(f))
}

/// Times candle's forward and backward of one block of `shape` on the CPU (the sim device's
/// compute) on `shape.threads` threads, the way the trainer calls them: the dense block's
/// [`Gpt::forward`] and [`Gpt::backward`] (recompute + VJP), or the MoE block's trunk, routed
/// experts and combine, and their backward as `Trainer::train_step` runs it; gradients copied
/// out to host vectors as the trainer pushes them. Input: the embedding of pseudo-random bytes.
/// One warm-up, then repetitions until 9, or 3 and 1 s, or 3 s (so at least one); the
/// medians. About 1 s for the example configs' blocks.
///
/// # Errors
/// A shape the model refuses (heads not dividing the width, ...); candle failures; a pool that
/// cannot be built.
pub fn probe_compute(shape: &ComputeShape) -> anyhow::Result<ComputeProbe> {
    with_compute_threads(shape.threads, || probe_compute_on_current_pool(shape))?
}

/// [`probe_compute`] on the current rayon pool (the caller sized it).
pub(crate) fn probe_compute_on_current_pool(shape: &ComputeShape) -> anyhow::Result<ComputeProbe> {
    let started = Instant::now();
    let gcfg = GptConfig {
        n_layer: 1,
        max_seq_len: shape.model.max_seq_len.max(shape.seq_len),
        tied_head: false,
        ..shape.model.clone()
    };
    let gpt = Gpt::new(gcfg.clone()).context("the probed block's model")?;
    let params = init_params(&gcfg, 1);
    let dev = Device::Cpu;
    let tensor = |flat: &[f32]| Tensor::from_slice(flat, flat.len(), &dev);
    let (b, t) = (shape.batch.max(1), shape.seq_len.max(1));
    let ids: Vec<u32> = (0..b * t).map(|i| ((i as u64 * 2_654_435_761) >> 11) as u32 % VOCAB as u32).collect();
    let tokens = Tensor::from_slice(&ids, (b, t), &dev)?;
    let x = gpt.forward(0, &tensor(&params[0])?, &tokens, None)?;
    let grad_y = x.affine(1e-2, 0.0)?;
    let block = gcfg.block_unit(0);
    let p_block = tensor(&params[block])?;
    let p_experts: Vec<Tensor> =
        (0..gcfg.num_experts()).map(|e| tensor(&params[gcfg.expert_unit(0, e)])).collect::<Result<_, _>>()?;
    let forward = || -> anyhow::Result<()> {
        if gcfg.moe.is_none() {
            std::hint::black_box(gpt.forward(block, &p_block, &x, None)?);
            return Ok(());
        }
        let tr = gpt.moe_trunk_forward(0, &p_block, &x)?;
        let mut outs: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        for (e, (out, p)) in outs.iter_mut().zip(&p_experts).enumerate() {
            if let Some(h_e) = tr.routing.expert_input(e, &tr.h)? {
                *out = Some(gpt.expert_forward(p, &h_e)?);
            }
        }
        std::hint::black_box(gpt.moe_combine(&tr.x1, &tr.routing, &outs)?);
        Ok(())
    };
    let backward = || -> anyhow::Result<()> {
        if gcfg.moe.is_none() {
            let g = gpt.backward(block, &p_block, &x, &grad_y, None)?;
            std::hint::black_box(g.grad_params.to_vec1::<f32>()?);
            return Ok(());
        }
        let tr = gpt.moe_trunk_forward(0, &p_block, &x)?;
        let routing = &tr.routing;
        let mut grad_inputs: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        let mut grad_gates: Vec<Option<Tensor>> = vec![None; p_experts.len()];
        for (e, p) in p_experts.iter().enumerate() {
            let Some(h_e) = routing.expert_input(e, &tr.h)? else { continue };
            let grad_out = gpt.moe_expert_grad_output(routing, e, &grad_y)?.context("an active expert")?;
            let g = gpt.expert_backward(p, &h_e, &grad_out)?;
            std::hint::black_box(g.grad_params.to_vec1::<f32>()?);
            grad_gates[e] = gpt.moe_expert_grad_gate(routing, e, &grad_y, &g.output)?;
            grad_inputs[e] = Some(g.grad_input);
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs)?;
        let g = gpt.moe_trunk_backward(0, &p_block, &x, routing, &grad_y, &grad_h, &grad_gates)?;
        std::hint::black_box(g.grad_params.to_vec1::<f32>()?);
        Ok(())
    };
    forward()?;
    backward()?;
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    let timed = Instant::now();
    loop {
        let t0 = Instant::now();
        forward()?;
        let t1 = Instant::now();
        backward()?;
        fwd.push((t1 - t0).as_secs_f64());
        bwd.push(t1.elapsed().as_secs_f64());
        let elapsed = timed.elapsed().as_secs_f64();
        let n = fwd.len();
        if n >= 9 || (n >= 3 && elapsed >= 1.0) || elapsed >= 3.0 {
            break;
        }
    }
    let reps = fwd.len();
    let median = crate::bench::step::median;
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
pub fn nvme_gbps(dir: &std::path::Path, bytes: u64) -> anyhow::Result<(f64, f64, String)> {
    let tensor = 8usize << 20;
    let n = (bytes as usize / tensor).max(1);
    let sub = dir.join(format!("oogc-probe-{}", std::process::id()));
    std::fs::create_dir_all(&sub).with_context(|| format!("creating {} (check --probe-dir)", sub.display()))?;
    let result = (|| -> anyhow::Result<(f64, f64, String)> {
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
        let (extents, write_s, read_s) = crate::bench::nvme::write_then_read(&store, &mut bufs, n)?;
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
pub fn probe(args: &ProbeArgs) -> anyhow::Result<HardwareProfile> {
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

    #[test]
    fn the_example_configs_plan_the_trainers_parameters() {
        for name in ["tinyshakespeare.toml", "tinyshakespeare-resident.toml", "tinyshakespeare-moe.toml"] {
            let cfg = example(name);
            let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false);
            let units = model_units(&args.shape, &args.feed_forward).unwrap();
            let params: u64 = units.iter().map(|u| u.numel).sum();
            let gcfg = crate::train::gpt_config(&cfg);
            assert_eq!(params, gcfg.num_params() as u64, "{name}");
            let r = plan_gpt(&args).unwrap();
            assert!(r.step_s > 0.0 && r.compute_s > 0.0, "{name}: {r:?}");
        }
    }

    #[test]
    fn moe_placement_follows_the_cost_model() {
        let mut cfg = example("tinyshakespeare-moe.toml");
        let hw = HardwareProfile::default();
        let p = moe_placement(&cfg, &hw);
        assert_eq!((p.len(), p[0].len()), (4, 8));
        // The sim device's GPU is this CPU: keeping an expert resident saves nothing, and the
        // block balances its experts between fetching and the CPU.
        let all: Vec<Placement> = p.iter().flatten().copied().collect();
        assert!(!all.contains(&Placement::Resident), "{p:?}");
        assert!(all.contains(&Placement::Cpu) && all.contains(&Placement::Fetch), "{p:?}");
        let args = plan_args_for_config(&cfg, &hw, false);
        let units = model_units(&args.shape, &args.feed_forward).unwrap();
        let cpu = units.iter().filter(|u| u.host_compute).count();
        assert_eq!(cpu, all.iter().filter(|&&q| q == Placement::Cpu).count());
        cfg.moe.cpu_compute = false;
        assert!(moe_placement(&cfg, &hw).iter().flatten().all(|&q| q != Placement::Cpu));
        cfg.moe.policy = "fetch".into();
        assert!(moe_placement(&cfg, &hw).iter().flatten().all(|&q| q == Placement::Fetch));
        // A fast device beside a slow CPU keeps a hot set.
        cfg.moe.policy = "ours".into();
        cfg.device.kind = "cuda:0".into();
        let hot = moe_placement(&cfg, &hw).iter().flatten().filter(|&&q| q == Placement::Resident).count();
        assert!(hot > 0, "{hot}");
    }

    #[test]
    fn a_bad_moe_placement_is_refused() {
        let s = GptShape { layers: 2, d_model: 32, seq_len: 8, batch: 1, dtype_bytes: 4 };
        let ff =
            FeedForward::Moe(MoePlan { experts: 4, top_k: 2, d_expert: 64, placements: vec![vec![Placement::Cpu; 4]] });
        assert!(model_units(&s, &ff).unwrap_err().to_string().contains("2 blocks x 4 experts"));
    }

    fn tiny_shape(moe: bool) -> ComputeShape {
        ComputeShape {
            model: GptConfig {
                d_model: 32,
                n_head: 2,
                max_seq_len: 16,
                moe: moe.then(|| oogc_models::MoeConfig { experts: 4, top_k: 2, ..Default::default() }),
                ..GptConfig::default()
            },
            seq_len: 16,
            batch: 2,
            threads: 1,
        }
    }

    #[test]
    fn the_probe_counts_flops_as_the_planner_does() {
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
