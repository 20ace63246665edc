//! Where the state lives and how it moves: `[budgets]` (bytes per tier), `[optimizer]`,
//! `[prefetch]`, `[activations]`, `[moe]` (expert placement) and `[ranks]` (what data-parallel
//! ranks shard).

use std::path::PathBuf;

use bytesize::ByteSize;
use oogc_optimizer::AdamKind;
use oogc_swapper::StatePlacement;
use serde::{Deserialize, Serialize};

use super::default_true;

/// `[budgets]`: bytes per tier.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BudgetsConfig {
    /// GPU memory for parameters (compute copies) and gradient staging, e.g. `"2MiB"`.
    pub gpu: ByteSize,
    /// Host memory for everything the run holds there: compute copies (their home or NVMe
    /// cache), optimizer state on the host, speculation's second buffers, NVMe stream buffers,
    /// gradients. A budget below the run's minimum is refused before anything is written, with
    /// the minimum. Default: `"4GiB"`.
    #[serde(default = "default_host_budget")]
    pub host: ByteSize,
    /// Where optimizer state (master weights, m, v) lives: `"host"` or `"nvme"`. Default: host.
    #[serde(default)]
    pub optimizer_state: StatePlacement,
    /// Where the compute copies' home is: `"host"` (pinned host memory) or `"nvme"` (the NVMe
    /// store, with the host budget's share as its cache; ZeRO-Infinity's `offload_param`).
    /// Default: host.
    #[serde(default)]
    pub params: StatePlacement,
    /// NVMe directories (created if missing; the store's files are striped over them). Needed
    /// when `optimizer_state` or `params` is `"nvme"`. Default: none (`[]`).
    #[serde(default)]
    pub nvme_dirs: Vec<PathBuf>,
    /// Bytes preallocated on NVMe in all. Default: what the run holds there (optimizer state,
    /// compute copies with `params = "nvme"`, copy-on-write slack) plus room for speculated
    /// units' second extents; checked against the file systems' free space before the run.
    #[serde(default)]
    pub nvme_size: Option<ByteSize>,
}

fn default_host_budget() -> ByteSize {
    ByteSize::gib(4)
}

/// `[optimizer]`: AdamW (Loshchilov & Hutter 2019) with linear warmup then cosine decay.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// `"adamw"` (decoupled weight decay) or `"adam"` (L2 in the gradient). Default: adamw.
    #[serde(default)]
    pub kind: AdamKind,
    /// Peak learning rate. Default: 1e-3.
    #[serde(default = "default_lr")]
    pub lr: f32,
    /// Learning rate at the end of the cosine decay: step `t` (1-based) of `train.steps` = `S`,
    /// with `w` = min(`warmup_steps`, `S`), trains at `lr·t/w` for `t ≤ w`, then at
    /// `min_lr + ½(1 + cos(π(t − w)/(S − w)))(lr − min_lr)`, and at `min_lr` from `S` on.
    /// Default: 0.1 × `lr`.
    #[serde(default)]
    pub min_lr: Option<f32>,
    /// Steps of linear warmup from 0 to `lr`. Default: 100.
    #[serde(default = "default_warmup")]
    pub warmup_steps: u64,
    /// Adam β1, β2. Default: [0.9, 0.95].
    #[serde(default = "default_betas")]
    pub betas: [f32; 2],
    /// Adam ε. Default: 1e-8.
    #[serde(default = "default_eps")]
    pub eps: f32,
    /// Weight decay. Default: 0.1.
    #[serde(default = "default_wd")]
    pub weight_decay: f32,
    /// Global gradient-norm clip; 0 disables. Default: 1.0.
    #[serde(default = "default_clip")]
    pub clip_norm: f32,
    /// What a non-finite gradient does: `"skip"` the step (every unit keeps its state; the
    /// gradients, or a speculated second copy of each update, are held until the step's last
    /// gradient is in) or `"stop"` the run with an error naming the unit (units updated earlier
    /// in the step keep their update: resume from the last checkpoint). With `"stop"` and
    /// `clip_norm = 0` every unit's update is final as soon as its gradients arrive: host memory
    /// holds a few units' gradients instead of all of them, which a run larger than host memory
    /// needs (`configs/scale-beyond-ram.toml`). Default: skip.
    #[serde(default)]
    pub nonfinite: oogc_optimizer::NonFinite,
    /// Most host bytes for speculation's second buffers (a second compute copy per unit, and a
    /// second p, m, v for host-placed state); units beyond it are updated after the step's
    /// clip decision instead (same results, less overlap). Default: what the host budget has
    /// left.
    #[serde(default)]
    pub rollback_budget: Option<ByteSize>,
    /// Most host bytes for the NVMe stream buffers of optimizer state on NVMe (three chunk
    /// buffers per stream). Default: 128 MiB (the run uses at most one stream per optimizer
    /// thread).
    #[serde(default)]
    pub stream_host_budget: Option<ByteSize>,
    /// Units whose optimizer (fp32 master weights, Adam state in `state_dtype`, gradients: 16 B
    /// per parameter with f32 moments, 12 with bf16, 10.03 with int8, plus the compute copy)
    /// lives in GPU memory and is updated there: `N` units (refused with
    /// the bytes when they do not fit beyond the minimum working set), or `"auto"`: the spare
    /// GPU budget only, what is left once every unit's compute copy fits (none below that).
    /// Either way the units whose CPU update would be exposed come first: the last units of the
    /// backward (the embedding, then the first blocks, then the head;
    /// [`crate::train::choose_device_units`]). MoE experts follow `[moe] device_optimizer`.
    /// Not with data-parallel ranks. Default: 0.
    #[serde(default)]
    pub device_units: DeviceUnits,
    /// Element type of Adam's moments `m` and `v` on the CPU optimizer (master weights stay
    /// f32): `"f32"` (8 B per parameter, as torch), `"bf16"` (4 B, rounded to nearest even) or
    /// `"int8"` (2.03 B: block-wise quantization of Dettmers et al. 2022, blocks of 256 with one
    /// f32 absmax each, `m` on a linear map and `v` on the dynamic tree map). The host ledger,
    /// the NVMe store, the streams' chunks and `oogc plan` count the bytes of the dtype; a
    /// checkpoint saves the moments as stored, and resuming one of another dtype needs
    /// `oogc train --convert-state`. Device optimizers (`device_units`, `[moe]
    /// device_optimizer`) keep the moments in this dtype and format too, updated on the device.
    /// With data-parallel ranks each rank's shard starts on a block, so ranks train and
    /// checkpoint as one process does. Default: f32.
    #[serde(default)]
    pub state_dtype: oogc_optimizer::StateDType,
    /// Element type of the CPU optimizer's master weights: `"f32"` (4 B per parameter) or
    /// `"bf16"` (2 B, written by stochastic rounding so that updates below half a bf16 ulp still
    /// move the weights in expectation; the compute copy is then the master's value). A
    /// checkpoint saves the master weights in their dtype; resuming one of another dtype needs
    /// `oogc train --convert-state`. Device optimizers keep f32 master weights. With
    /// data-parallel ranks an element rounds by its index in the unit, as in one process.
    /// Default: f32.
    #[serde(default)]
    pub master_dtype: oogc_optimizer::MasterDType,
}

/// `[optimizer] device_units`: how many units keep their optimizer on the device.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum DeviceUnits {
    /// That many units (0: none).
    Count(usize),
    /// `"auto"`: as many as the GPU budget's spare room holds.
    Auto(AutoKeyword),
}

/// The keyword `"auto"`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AutoKeyword {
    /// `"auto"`.
    Auto,
}

impl Default for DeviceUnits {
    fn default() -> Self {
        Self::Count(0)
    }
}

fn default_lr() -> f32 {
    1e-3
}
fn default_warmup() -> u64 {
    100
}
fn default_betas() -> [f32; 2] {
    [0.9, 0.95]
}
fn default_eps() -> f32 {
    1e-8
}
fn default_wd() -> f32 {
    0.1
}
fn default_clip() -> f32 {
    1.0
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            kind: AdamKind::AdamW,
            lr: default_lr(),
            min_lr: None,
            warmup_steps: default_warmup(),
            betas: default_betas(),
            eps: default_eps(),
            weight_decay: default_wd(),
            clip_norm: default_clip(),
            nonfinite: oogc_optimizer::NonFinite::Skip,
            rollback_budget: None,
            stream_host_budget: None,
            device_units: DeviceUnits::default(),
            state_dtype: oogc_optimizer::StateDType::F32,
            master_dtype: oogc_optimizer::MasterDType::F32,
        }
    }
}

/// `[prefetch]`: the sliding window of fetches ahead of compute.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefetchSection {
    /// Units fetched ahead of the one in use; 0 = fetch on demand. Default: 2.
    #[serde(default = "default_depth")]
    pub depth: usize,
    /// With `[budgets] params = "nvme"`: units read NVMe → host ahead (the host window, ahead
    /// of the device window). Default: 4.
    #[serde(default = "default_host_depth")]
    pub host_depth: usize,
    /// Run the CPU optimizer on each unit as soon as its gradients land, overlapping compute
    /// (ours). false: hold the gradients and update every unit at the end of the step, waiting
    /// for it (the ZeRO-Infinity-like baseline; same results bit for bit). Default: true.
    #[serde(default = "default_true")]
    pub overlap_optimizer: bool,
}

fn default_depth() -> usize {
    2
}
fn default_host_depth() -> usize {
    4
}

impl Default for PrefetchSection {
    fn default() -> Self {
        Self { depth: default_depth(), host_depth: default_host_depth(), overlap_optimizer: true }
    }
}

/// `[ranks]`: what data-parallel ranks shard. Without ranks (a world of one) nothing here
/// changes anything.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RanksConfig {
    /// Shard the compute copies too (ZeRO-3, FSDP's `FULL_SHARD`): each rank's host tier, NVMe
    /// files and device hold its `1/N` shard of every unit's parameters; a fetch copies the
    /// shard H2D and all-gathers the unit, which stays gathered for its next use while the GPU
    /// budget allows (shards are whole blocks of 256 parameters: a unit too small to give every
    /// rank one stays whole on every rank). `false`: whole compute copies on every rank (ZeRO-2,
    /// FSDP's `SHARD_GRAD_OP`: master weights, Adam state and gradients sharded only). Default:
    /// true.
    #[serde(default = "default_true")]
    pub shard_parameters: bool,
}

impl Default for RanksConfig {
    fn default() -> Self {
        Self { shard_parameters: true }
    }
}

/// `[activations]`: the activation checkpoints (each block's input, of every micro-batch).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ActivationsConfig {
    /// Copy each checkpoint D2H into pinned host memory (claimed from `[budgets] host`, category
    /// `activations`) as soon as its block's forward made it, free it on the device, and copy it
    /// back H2D one block ahead of its backward (ZeRO-Offload's and ZeRO-Infinity's activation
    /// checkpoint offload). Same results bit for bit; the GPU holds two checkpoints' staging
    /// instead of all of them. Dense models only. Default: false.
    #[serde(default)]
    pub offload: bool,
}

/// `[moe]`: where the experts of an MoE model live and run.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MoePlacementConfig {
    /// Where the experts go ([`MoePolicy`]): `"ours"` (a hot set on the device, cold experts
    /// fetched or computed on the CPU by the cost model), `"fetch"` (every routed expert
    /// fetched), `"resident"` (in-memory baselines) or `"lru"` (an LRU cache of expert copies
    /// under `expert_budget`). Default: `"ours"`.
    #[serde(default)]
    pub policy: MoePolicy,
    /// GPU bytes for hot experts, kept from their forward to their backward. Default: a quarter
    /// of `budgets.gpu`.
    #[serde(default)]
    pub expert_budget: Option<ByteSize>,
    /// Decay of the per-expert moving average of routed tokens, in [0, 1). Default: 0.8.
    #[serde(default = "default_decay")]
    pub popularity_decay: f64,
    /// Compute cold experts on the CPU when the cost model says it is faster than fetching them.
    /// Default: true.
    #[serde(default = "default_true")]
    pub cpu_compute: bool,
    /// JSON-lines routing trace (step, block, expert, tokens) for `oogc bench moe`. Default: none.
    #[serde(default)]
    pub routing_trace: Option<PathBuf>,
    /// With `policy = "ours"`: the hot experts keep their optimizer on the device (master
    /// weights, Adam state and gradients: 16 B per parameter with f32 moments, 12 with bf16,
    /// 10.03 with int8 (`[optimizer] state_dtype`), plus the compute copy, all counted in
    /// `expert_budget`) and are updated there, so they are not uploaded again after each
    /// update; moved in and out only when the hot set changes (with hysteresis). false: the hot
    /// set holds compute copies only (4 B per f32 parameter), refreshed from the CPU optimizer
    /// every step. Unset: on when `expert_budget` holds at least one expert with its optimizer,
    /// else off.
    #[serde(default)]
    pub device_optimizer: Option<bool>,
    /// The CPU's GEMM rate the cost model starts from, GFLOP/s (10⁹ FLOP/s) over the compute
    /// threads (on the sim device, the "GPU"'s too). Unset: measured at start (a small matrix
    /// product times `[threads] compute`), so placements follow the machine and its load; set it
    /// for placements that depend on the routing alone (reproducible runs, tests).
    #[serde(default)]
    pub cpu_gflops: Option<f64>,
}

/// `[moe] policy`: how the experts of an MoE model are placed.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum MoePolicy {
    /// `"ours"`: a popularity hot set kept on the device under `[moe] expert_budget`, cold
    /// experts fetched or computed on the CPU, whichever the cost model says is faster.
    #[default]
    Ours,
    /// `"fetch"`: every routed expert fetched on demand (twice per step: forward and backward).
    Fetch,
    /// `"resident"`: as fetch (none kept, none on the CPU), for in-memory baselines with a GPU
    /// budget that holds every expert.
    Resident,
    /// `"lru"`: an LRU cache of expert copies on the device of `[moe] expert_budget` bytes (as
    /// many whole experts as fit): every routed expert is fetched, used on the device and kept
    /// pinned until the cache evicts the least recently used; a use while cached moves nothing.
    /// The cache is emptied between steps (the optimizer's update makes every copy stale).
    Lru,
}
fn default_decay() -> f64 {
    0.8
}
impl Default for MoePlacementConfig {
    fn default() -> Self {
        Self {
            policy: MoePolicy::Ours,
            expert_budget: None,
            popularity_decay: default_decay(),
            cpu_compute: true,
            routing_trace: None,
            device_optimizer: None,
            cpu_gflops: None,
        }
    }
}
