//! How a run's budgets are shared: [`HostPlan`] splits `[budgets] host` between the categories
//! of the host ledger ([`HostUse`]), [`NvmePlan`] sizes the NVMe store from what it must hold,
//! and both say the minimum a run needs, so a budget too small is refused before anything is
//! written. The runtime applies the host plan before its first step (and the ledger enforces
//! it); `oogc plan` prints it; `oogc train` reports it beside the ledger's peak and the
//! process's peak RSS ([`peak_rss_bytes`]).
//!
//! | category | holds at most (bytes) |
//! |---|---|
//! | compute copies | parameters on the host: every unit's compute copy (pool size classes); on NVMe: the host tier's share, at least the `max_units_in_use + 2 + threads` largest units, at most all |
//! | optimizer state | host state: 12 B per parameter; either way 8 B per 16 Ki parameters of norm partials |
//! | speculation | second buffers of the units that fit what is left, in unit order, within `[optimizer] rollback_budget` |
//! | NVMe stream | state on NVMe: `threads` streams of three chunk buffers of the largest unit (within `stream_host_budget_bytes`) |
//! | gradients | every unit's gradients (compute dtype) (held until the step is final; with immediate updates — `clip_norm = 0`, `nonfinite = "stop"` — only the `threads + 1` largest units' whose update runs or waits), two more of the largest unit's (arriving while their unit's last update runs), two pinned landing buffers of the largest unit |
//! | activations | with `[activations] offload`: every checkpoint of a step (blocks × micro-batches, pool size classes); else 0 (on the sim device the checkpoints of every micro-batch are candle's buffers: the overhead below) |
//! | checkpoint | with `[checkpoint] dir`: one unit's state while a checkpoint is saved or loaded ([`checkpoint_staging_bytes`] of the largest unit); else 0 |
//!
//! **Overhead** (not in the ledger, stated): the process itself (binary, libraries, thread
//! stacks), the training text, on the sim device its memory (host memory there) and candle's
//! buffers (activations and the temporaries of one unit's forward and backward), and what malloc
//! keeps between blocks: [`HostOverhead::model`], from the model's shape and batch. `oogc plan`
//! prints the predicted peak RSS ([`HostPlan::expected_peak_bytes`] + the overhead); `oogc
//! train` samples the process's RSS after each step, warns once past `[budgets] host` + the
//! overhead, and writes RSS and minor page faults into each metrics line.

use std::path::{Path, PathBuf};

use oogc_optimizer::{speculation_cost, state_host_bytes, state_nvme_bytes, stream_host_bytes, OptimizerConfig};
use oogc_swapper::host::{size_class, PAGE_BYTES};
use oogc_swapper::{DType, HostUse, StatePlacement};
use serde::Serialize;

use super::grads::GRAD_LANDING_BUFFERS;
pub use super::process::{minor_faults, peak_rss_bytes, rss_bytes, statvfs_free_bytes};
use super::{RuntimeConfig, RuntimeError};
use crate::dist::World;

/// Prefetch threads of the residency manager (its default), which may write compute copies back
/// to NVMe at once.
const PREFETCH_THREADS: u64 = 2;

/// The process's own resident bytes besides the ledger, the text, the sim device and candle's
/// buffers: binary, libraries, thread stacks, the tracing subscriber, malloc's bookkeeping. Fitted
/// with the other coefficients of [`HostOverhead::model`] (a 0.04 M-parameter run holds
/// 16–18 MB in all).
pub const BASE_OVERHEAD_BYTES: u64 = 18_300_000;

/// What the overhead model needs of a run ([`HostOverhead::model`]): its shape and batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RunShape {
    /// The compute dtype (activations, compute copies, gradients).
    pub dtype: DType,
    /// Sequences per micro-batch (`[train] batch_size`).
    pub batch: u64,
    /// Micro-batches per step (`[train] micro_batches`, 1 without gradient accumulation).
    pub micro_batches: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// `hidden_size`.
    pub d_model: u64,
    /// `intermediate_size` (an expert's with MoE).
    pub d_ff: u64,
    /// Query heads.
    pub heads: u64,
    /// Blocks.
    pub layers: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// The largest unit's compute copy, bytes.
    pub largest_unit_bytes: u64,
    /// Every unit's compute copy, bytes.
    pub compute_copies_bytes: u64,
}

/// A run as [`HostOverhead::model`] sees it, before its host plan: the shape, the text's bytes,
/// and the sim device's GPU budget (`None` on a GPU).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OverheadInputs {
    /// Shape and batch.
    pub shape: RunShape,
    /// The training text (or its token file), bytes.
    pub text_bytes: u64,
    /// The GPU budget on the sim device, bytes; `None` on a GPU.
    pub sim_gpu_budget_bytes: Option<u64>,
}

impl OverheadInputs {
    /// The overhead under `plan` ([`HostOverhead::model`]).
    pub fn overhead(&self, plan: &HostPlan) -> HostOverhead {
        HostOverhead::model(&self.shape, self.text_bytes, self.sim_gpu_budget_bytes, plan)
    }

    /// The predicted peak RSS under `plan`, bytes: the ledger's expected peak
    /// ([`HostPlan::expected_peak_bytes`]) plus the overhead.
    pub fn predicted_peak_rss_bytes(&self, plan: &HostPlan) -> u64 {
        plan.expected_peak_bytes() + self.overhead(plan).total_bytes()
    }
}

/// The stated overhead of a run besides what the ledger counts (module docs), by part. Bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HostOverhead {
    /// The process itself ([`BASE_OVERHEAD_BYTES`]).
    pub process_bytes: u64,
    /// The training text (read whole) or its token file (mapped).
    pub text_bytes: u64,
    /// The sim device's memory (its buffers are host memory); 0 on a GPU.
    pub sim_device_bytes: u64,
    /// candle's buffers on the sim device: the unit in use, logits, attention scores, MLP
    /// activations, activation checkpoints of further micro-batches.
    pub activation_bytes: u64,
    /// Memory malloc keeps between the blocks that live across a step (held gradients, second
    /// buffers) and candle's, which come and go.
    pub allocator_bytes: u64,
}

impl HostOverhead {
    /// The overhead of a run of `shape` with `text_bytes` of training text, on the sim device
    /// with a GPU budget of `sim_gpu_budget_bytes` (`None` on a GPU), under `plan`.
    ///
    /// A model of the process's resident bytes outside the ledger, on the sim device (where
    /// candle's activations are host memory), with `N = batch × seq` tokens per micro-batch and
    /// 4-byte elements where candle computes in f32:
    ///
    /// | part | bytes |
    /// |---|---|
    /// | process | [`BASE_OVERHEAD_BYTES`] |
    /// | sim device | 0.47 × min(GPU budget, every compute copy + the largest unit's) |
    /// | candle | the largest unit (its fetched copy) + 2.07 × `N·vocab·4` (logits) + 4.77 × `batch·heads·seq²·4` (attention scores) + 6.88 × `N·d_ff·4` (MLP); in bf16 also 28.0 × `N·d_ff·4` and 7.10 × `N·vocab·4` (candle's f32 upcasts on the CPU); with `k` micro-batches the checkpoints of `k − 1` more (`(k − 1)·(layers + 1)·N·d_model` elements) |
    /// | allocator | 0.49 × the plan's held gradients (less their margins, [`HostPlan::expected_gradients_bytes`]) and second buffers |
    ///
    /// On a GPU (`sim_gpu_budget_bytes` `None`) the sim device and candle parts are 0: candle's
    /// buffers are device memory there (not yet measured on one).
    ///
    /// The coefficients are measured: a least-squares fit (non-negative, relative error) of
    /// `peak RSS − ledger peak − text` over 19 Llama shapes (0.99–24 M parameters, d_model
    /// 64–1024, 2–96 layers, vocabulary 1 k–32 k, 512–2048 tokens per step, f32 and bf16, state on
    /// NVMe), 6 steps of `oogc train` each on the 2-core development machine, with
    /// [`oogc_swapper::huge_malloc`]'s malloc settings; the fit's own shapes land within
    /// 0.93–1.05 of their peak RSS, and the four shapes of `cli/tests/host_memory.rs`, held out,
    /// within 0.93–0.97. Since then pooled gradient buffers lowered the held-out d_model 512
    /// shape's ledger peak and RSS, and with the allocator part at 0.49 × the whole gradients
    /// budget, margins included, the prediction sat +7.5–10.2 % over the RSS (ten debug runs).
    /// The allocator part now takes the gradients the ledger expects (the margins are not
    /// expected to be held, as in [`HostPlan::expected_peak_bytes`]); the 19-shape fit has not
    /// been rerun.
    pub fn model(shape: &RunShape, text_bytes: u64, sim_gpu_budget_bytes: Option<u64>, plan: &HostPlan) -> Self {
        let s = shape;
        let f = |x: u64, c: f64| (x as f64 * c) as u64;
        let tokens = s.batch * s.seq;
        let bf16 = u64::from(s.dtype == DType::BF16);
        let logits = tokens * s.vocab * 4;
        let mlp = tokens * s.d_ff * 4;
        let attention = s.batch * s.heads * s.seq * s.seq * 4;
        let more_checkpoints = s
            .dtype
            .num_bytes((s.micro_batches.max(1) - 1) as usize * (s.layers as usize + 1) * (tokens * s.d_model) as usize)
            as u64;
        // On a GPU candle's buffers are device memory (the host's part there is unmeasured: no
        // session has had a GPU yet; README "GPU").
        let on_sim = u64::from(sim_gpu_budget_bytes.is_some());
        let activation_bytes = on_sim
            * (s.largest_unit_bytes
                + f(logits, 2.07)
                + f(attention, 4.77)
                + f(mlp, 6.88)
                + bf16 * (f(mlp, 28.0) + f(logits, 7.10))
                + more_checkpoints);
        let sim_device_bytes =
            sim_gpu_budget_bytes.map_or(0, |b| f(b.min(s.compute_copies_bytes + s.largest_unit_bytes), 0.47));
        Self {
            process_bytes: BASE_OVERHEAD_BYTES,
            text_bytes,
            sim_device_bytes,
            activation_bytes,
            allocator_bytes: f(plan.expected_gradients_bytes() + plan.speculation_bytes, 0.49),
        }
    }

    /// The sum of the parts.
    pub fn total_bytes(&self) -> u64 {
        self.parts().iter().map(|(_, b)| b).sum()
    }

    /// `(name, bytes)` of each part.
    pub fn parts(&self) -> [(&'static str, u64); 5] {
        [
            ("process", self.process_bytes),
            ("text", self.text_bytes),
            ("sim_device", self.sim_device_bytes),
            ("activations", self.activation_bytes),
            ("allocator", self.allocator_bytes),
        ]
    }
}

/// The split of `[budgets] host` between the ledger's categories, and the minimum a run needs
/// (module docs). All figures are bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostPlan {
    /// `[budgets] host`.
    pub budget_bytes: u64,
    /// What the run needs at least: every category at its minimum, no speculation.
    pub min_bytes: u64,
    /// The residency manager's host tier: compute copies (and NVMe → host prefetches).
    pub compute_copies_bytes: u64,
    /// Of which the minimum.
    pub compute_copies_min_bytes: u64,
    /// Host-placed master weights and Adam state, and every unit's norm partials.
    pub optimizer_state_bytes: u64,
    /// The speculation budget given to the optimizer (what is left, within the roll-back budget).
    pub speculation_budget_bytes: u64,
    /// Of which the second buffers of the units that fit (in unit order): what they will hold.
    pub speculation_bytes: u64,
    /// Units with second buffers.
    pub speculative_units: usize,
    /// NVMe stream buffers (state on NVMe).
    pub nvme_stream_bytes: u64,
    /// Gradients: held gradients (compute dtype) and the pinned landing buffers.
    pub gradients_bytes: u64,
    /// Of which the pinned landing pool.
    pub gradient_landing_bytes: u64,
    /// Of which margins a steady step rarely uses ([`HostPlan::expected_peak_bytes`]).
    pub gradients_margin_bytes: u64,
    /// Activation checkpoints offloaded to pinned host memory (`[activations] offload`).
    pub activations_bytes: u64,
    /// A checkpoint's staging ([`checkpoint_staging_bytes`] of the largest unit) when the run
    /// writes checkpoints ([`RuntimeConfig::checkpoint_staging`]), else 0.
    pub checkpoint_bytes: u64,
}

impl HostPlan {
    /// The plan of a run of `units` (parameters per unit, in unit order) under `config`, with
    /// `max_units_in_use` units pinned at once by the trainer and `nvme_speculation_bytes` of
    /// NVMe room for speculated NVMe units' second extents (see [`NvmePlan`]), for rank
    /// `world.rank` of `world.size` ([`rank_units`]).
    pub fn new(
        config: &RuntimeConfig,
        units: &[usize],
        max_units_in_use: usize,
        nvme_speculation_bytes: u64,
        world: World,
    ) -> Self {
        let (shards, copies) = rank_units(world, units, &[], config.shard_parameters);
        Self::with_shards(config, units, &shards, &copies, max_units_in_use, nvme_speculation_bytes)
    }

    /// [`HostPlan::new`] for a rank whose optimizer holds `shards[k]` elements of unit `k` (of
    /// `units[k]`) and whose compute-copy home holds `copies[k]` of them (the shard with
    /// [`RuntimeConfig::shard_parameters`], else the whole unit): the state, held gradients,
    /// streams and speculation on the shards, the compute copies on `copies`, the gradients'
    /// landing buffers on the whole units (`oogc plan --world-size`).
    pub fn with_shards(
        config: &RuntimeConfig,
        units: &[usize],
        shards: &[usize],
        copies: &[usize],
        max_units_in_use: usize,
        nvme_speculation_bytes: u64,
    ) -> Self {
        let opt = &config.optimizer;
        let dtype = opt.compute_dtype;
        let largest = units.iter().copied().max().unwrap_or(0);
        let largest_shard = shards.iter().copied().max().unwrap_or(0);
        // A unit's compute copy and its gradients have the compute dtype.
        let bytes = |n: usize| dtype.num_bytes(n) as u64;
        let copy_class = |n: usize| size_class(dtype.num_bytes(n)) as u64;
        let all_copies: u64 = copies.iter().map(|&n| copy_class(n)).sum();
        let compute_copies_min_bytes = match config.params_placement {
            StatePlacement::Host => all_copies,
            StatePlacement::Nvme => {
                let mut classes: Vec<u64> = copies.iter().map(|&n| copy_class(n)).collect();
                classes.sort_unstable_by(|a, b| b.cmp(a));
                let k = max_units_in_use.max(1) + 2 + opt.threads;
                classes.iter().take(k).sum()
            }
        };
        let optimizer_state_bytes: u64 =
            shards.iter().map(|&n| state_host_bytes(n, config.state_placement, opt.state_format())).sum();
        let gradient_landing_bytes = GRAD_LANDING_BUFFERS as u64 * copy_class(largest.max(1));
        // One more unit's gradients from the drain thread and one from a CPU-computed unit may
        // arrive while their unit's previous update still holds its own. Immediate updates
        // hold only the units whose update runs or waits to run, not every unit's.
        let held: u64 = if opt.updates_immediately() {
            opt.gradients_in_flight() as u64 * bytes(largest_shard)
        } else {
            shards.iter().map(|&n| bytes(n)).sum()
        };
        let gradients_bytes = held + 2 * bytes(largest) + gradient_landing_bytes;
        let (stream_min, stream_want) = match config.state_placement {
            StatePlacement::Host => (0, 0),
            StatePlacement::Nvme => {
                let one = stream_host_bytes(largest_shard, &opt.stream_config());
                let want = (opt.threads as u64 * one).min(opt.stream_host_budget_bytes).max(one);
                (one, want)
            }
        };
        // Offloaded activation checkpoints: every one of a step is held from its forward to its
        // backward (pool size classes).
        let activations_bytes = config
            .activation_offload
            .map_or(0, |a| a.checkpoints as u64 * size_class(a.checkpoint_bytes.max(1)) as u64);
        let checkpoint_bytes = if config.checkpoint_staging {
            checkpoint_staging_bytes(largest, largest_shard, opt.state_format().moments)
        } else {
            0
        };
        let min_bytes = compute_copies_min_bytes
            + optimizer_state_bytes
            + gradients_bytes
            + stream_min
            + activations_bytes
            + checkpoint_bytes;
        let budget = config.host_budget_bytes;
        let mut left = budget.saturating_sub(min_bytes);
        let nvme_stream_bytes = stream_min + (stream_want - stream_min).min(left);
        left -= nvme_stream_bytes - stream_min;
        let extra_copies = (all_copies - compute_copies_min_bytes).min(left);
        left -= extra_copies;
        let speculation_budget_bytes = opt.rollback_budget_bytes.map_or(left, |b| b.min(left));
        let (speculation_bytes, speculative_units) =
            speculation_fit(shards, config.state_placement, opt, speculation_budget_bytes, nvme_speculation_bytes);
        HostPlan {
            budget_bytes: budget,
            min_bytes,
            compute_copies_bytes: compute_copies_min_bytes + extra_copies,
            compute_copies_min_bytes,
            optimizer_state_bytes,
            speculation_budget_bytes,
            speculation_bytes,
            speculative_units,
            nvme_stream_bytes,
            gradients_bytes,
            gradient_landing_bytes,
            gradients_margin_bytes: 2 * bytes(largest) + gradient_landing_bytes / GRAD_LANDING_BUFFERS as u64,
            activations_bytes,
            checkpoint_bytes,
        }
    }

    /// The bytes the plan lets `use_` hold at most (speculation: what the fitting units hold).
    pub fn bytes_of(&self, use_: HostUse) -> u64 {
        match use_ {
            HostUse::ComputeCopies => self.compute_copies_bytes,
            HostUse::OptimizerState => self.optimizer_state_bytes,
            HostUse::Speculation => self.speculation_bytes,
            HostUse::NvmeStream => self.nvme_stream_bytes,
            HostUse::Gradients => self.gradients_bytes,
            HostUse::Activations => self.activations_bytes,
            HostUse::Checkpoint => self.checkpoint_bytes,
        }
    }

    /// The predicted host peak: every category at its planned bytes.
    pub fn peak_bytes(&self) -> u64 {
        HostUse::ALL.iter().map(|&u| self.bytes_of(u)).sum()
    }

    /// The gradients a steady step holds at most, bytes: the category's budget less its margins
    /// for coincidences a step rarely meets (the two more of the largest unit's gradients, and
    /// one of the two landing buffers).
    pub fn expected_gradients_bytes(&self) -> u64 {
        self.gradients_bytes.saturating_sub(self.gradients_margin_bytes)
    }

    /// The ledger's expected peak: [`peak_bytes`](Self::peak_bytes) less the gradients' margins
    /// (as [`HostPlan::expected_gradients_bytes`]). What `oogc plan`'s predicted peak RSS starts
    /// from.
    pub fn expected_peak_bytes(&self) -> u64 {
        self.peak_bytes().saturating_sub(self.gradients_margin_bytes)
    }

    /// Per category, `(name, bytes)`, in ledger order.
    pub fn by_category(&self) -> Vec<(&'static str, u64)> {
        HostUse::ALL.iter().map(|&u| (u.name(), self.bytes_of(u))).collect()
    }

    /// Refuses a budget below [`HostPlan::min_bytes`].
    ///
    /// # Errors
    /// [`RuntimeError::HostBudgetBelowMinimum`] with the minimum and its parts.
    pub fn check(&self) -> Result<(), RuntimeError> {
        if self.budget_bytes >= self.min_bytes {
            return Ok(());
        }
        Err(RuntimeError::HostBudgetBelowMinimum {
            budget_bytes: self.budget_bytes,
            min_bytes: self.min_bytes,
            parts: format!(
                "compute copies {}, optimizer state {}, gradients {}, activations {}, checkpoint staging {}, NVMe stream {}",
                self.compute_copies_min_bytes,
                self.optimizer_state_bytes,
                self.gradients_bytes,
                self.activations_bytes,
                self.checkpoint_bytes,
                self.min_bytes
                    - self.compute_copies_min_bytes
                    - self.optimizer_state_bytes
                    - self.gradients_bytes
                    - self.activations_bytes
                    - self.checkpoint_bytes
            ),
        })
    }
}

/// Host bytes a checkpoint's save or load holds at once (the ledger's
/// [`HostUse::Checkpoint`]) for a unit of `numel` parameters of which this rank's optimizer
/// holds `shard` (`numel` in a world of one), with moments of `moments`: the unit's state as
/// [`Runtime::unit_state`](super::Runtime::unit_state) returns it — f32 master weights (4 B per
/// parameter; bf16 masters are widened) and the moments in their dtype; with ranks the
/// all-gathered whole unit besides this rank's shard, both so — plus the checkpoint writer's
/// buffer ([`crate::checkpoint::WRITE_BUFFER_BYTES`]). A unit whose optimizer is on the
/// device holds its moments in the same dtype.
pub fn checkpoint_staging_bytes(numel: usize, shard: usize, moments: oogc_optimizer::StateDType) -> u64 {
    let state = |n: usize| 4 * n as u64 + moments.moment_bytes(n) as u64;
    let shard_copy = if shard < numel { state(shard) } else { 0 };
    state(numel) + shard_copy + crate::checkpoint::WRITE_BUFFER_BYTES as u64
}

/// The units that speculate, as [`oogc_optimizer::PipelinedOptimizer::reserve_speculation`]
/// picks them: in unit order, each while its cost fits both budgets. Returns (host bytes, units).
fn speculation_fit(
    units: &[usize],
    state: StatePlacement,
    opt: &OptimizerConfig,
    host_budget: u64,
    nvme_budget: u64,
) -> (u64, usize) {
    let (mut host, mut nvme, mut count) = (0u64, 0u64, 0usize);
    for &n in units {
        let (h, v) = speculation_cost(n, state, opt.compute_dtype, &opt.stream_config());
        if host + h <= host_budget && nvme + v <= nvme_budget {
            host += h;
            nvme += v;
            count += 1;
        }
    }
    (host, count)
}

/// Extents of the largest size the NVMe store keeps free beyond what it holds, for
/// fragmentation: units' extents differ in size and are rewritten copy-on-write every step, so
/// best fit leaves part of the free space in pieces too small for the largest unit. Without
/// this room the byte-level GPT main job (10 units of three sizes, state on NVMe, every unit
/// speculated) failed at step 57: 11.6 MB free in pieces, 5.3 MB asked in one extent.
pub const FRAGMENTATION_EXTENTS: u64 = 2;

/// The NVMe store a run needs: optimizer state, compute copies when parameters live on NVMe,
/// copy-on-write slack for the writes in flight, and room for speculated NVMe units' second
/// extents. All figures are bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NvmePlan {
    /// Optimizer state on NVMe: every unit's chunks, each padded to 4 KiB.
    pub state_bytes: u64,
    /// Compute copies on NVMe (parameters on NVMe), each padded to 4 KiB.
    pub params_bytes: u64,
    /// Copy-on-write slack: a new extent is written before the old one is freed — one stream
    /// of the largest unit's state per optimizer thread, and one largest compute copy per
    /// writer of compute copies (prefetch threads, optimizer threads, the trainer's thread) —
    /// plus [`FRAGMENTATION_EXTENTS`] of the largest extents of each kind, for the free space
    /// that best fit leaves in pieces.
    pub slack_bytes: u64,
    /// What the run needs at least: state + params + slack.
    pub min_bytes: u64,
    /// Room for speculation: the second extents of every NVMe-placed unit (what the default
    /// size adds to the minimum); 0 when the optimizer updates immediately.
    pub speculation_bytes: u64,
    /// The store's size: `[budgets] nvme_size`, else the minimum plus the speculation room.
    pub capacity_bytes: u64,
}

impl NvmePlan {
    /// The store of a run of `units` (parameters per unit) with state and parameters placed as
    /// `state` and `params`, compute copies of `opt.compute_dtype`, `opt`'s threads and chunks,
    /// and an explicit size `nvme_size` if the config gives one; with data-parallel ranks
    /// (`world`) this rank's shards of the state, and of the compute copies when
    /// `shard_parameters` ([`RuntimeConfig::shard_parameters`]). `None` when nothing lives on NVMe.
    pub fn new(
        units: &[usize],
        state: StatePlacement,
        params: StatePlacement,
        opt: &OptimizerConfig,
        nvme_size: Option<u64>,
        shard_parameters: bool,
        world: World,
    ) -> Option<Self> {
        let (shards, copies) = rank_units(world, units, &[], shard_parameters);
        Self::with_shards(&shards, &copies, state, params, opt, nvme_size)
    }

    /// [`NvmePlan::new`] for a rank whose optimizer holds `shards[k]` elements of unit `k` and
    /// whose compute-copy home holds `copies[k]` (the shard with
    /// [`RuntimeConfig::shard_parameters`], else the whole unit).
    pub fn with_shards(
        shards: &[usize],
        copies: &[usize],
        state: StatePlacement,
        params: StatePlacement,
        opt: &OptimizerConfig,
        nvme_size: Option<u64>,
    ) -> Option<Self> {
        if state == StatePlacement::Host && params == StatePlacement::Host {
            return None;
        }
        let stream = opt.stream_config();
        let largest = copies.iter().copied().max().unwrap_or(0);
        let largest_shard = shards.iter().copied().max().unwrap_or(0);
        let pad = |b: u64| b.next_multiple_of(PAGE_BYTES as u64);
        let on = |p: StatePlacement| p == StatePlacement::Nvme;
        let state_bytes: u64 = if on(state) { shards.iter().map(|&n| state_nvme_bytes(n, &stream)).sum() } else { 0 };
        let params_bytes: u64 =
            if on(params) { copies.iter().map(|&n| pad(opt.compute_dtype.num_bytes(n) as u64)).sum() } else { 0 };
        let threads = opt.threads as u64;
        let frag = FRAGMENTATION_EXTENTS;
        let slack_bytes = if on(state) { (threads + frag) * state_nvme_bytes(largest_shard, &stream) } else { 0 }
            + if on(params) {
                (PREFETCH_THREADS + threads + 1 + frag) * pad(opt.compute_dtype.num_bytes(largest) as u64)
            } else {
                0
            };
        let min_bytes = state_bytes + params_bytes + slack_bytes;
        // Immediate updates speculate nothing: no second extents.
        let speculation_bytes = if opt.updates_immediately() { 0 } else { state_bytes };
        let capacity_bytes = nvme_size.unwrap_or(min_bytes + speculation_bytes);
        Some(Self { state_bytes, params_bytes, slack_bytes, min_bytes, speculation_bytes, capacity_bytes })
    }

    /// NVMe bytes speculated units' second extents may take: the capacity beyond the minimum.
    pub fn speculation_room_bytes(&self) -> u64 {
        self.capacity_bytes.saturating_sub(self.min_bytes)
    }

    /// Checks the size against the minimum and every directory's free space (`free_bytes(dir)`:
    /// statvfs's available bytes, [`statvfs_free_bytes`]; injectable for tests), before the
    /// store is created. A directory that does not exist yet is checked on its nearest existing
    /// ancestor (the trainer creates it).
    ///
    /// # Errors
    /// [`RuntimeError::NvmeTooSmall`] with the numbers and the fix.
    pub fn check(
        &self,
        dirs: &[PathBuf],
        free_bytes: &dyn Fn(&Path) -> std::io::Result<u64>,
    ) -> Result<(), RuntimeError> {
        if self.capacity_bytes < self.min_bytes {
            return Err(RuntimeError::NvmeTooSmall {
                path: dirs.first().cloned().unwrap_or_default(),
                needed_bytes: self.min_bytes,
                available_bytes: self.capacity_bytes,
                fix: format!(
                    "[budgets] nvme_size is below what the run needs (state {} + parameters {} + copy-on-write slack {}); \
                     raise it to at least {} bytes or leave it out",
                    self.state_bytes, self.params_bytes, self.slack_bytes, self.min_bytes
                ),
            });
        }
        let per_dir = self.capacity_bytes.div_ceil(dirs.len().max(1) as u64).next_multiple_of(PAGE_BYTES as u64);
        for dir in dirs {
            let existing = dir.ancestors().find(|d| d.exists()).unwrap_or(dir);
            let free = free_bytes(existing).map_err(|e| RuntimeError::NvmeTooSmall {
                path: dir.clone(),
                needed_bytes: per_dir,
                available_bytes: 0,
                fix: format!("cannot read the free space of {} ({e}); choose another directory", existing.display()),
            })?;
            if free < per_dir {
                return Err(RuntimeError::NvmeTooSmall {
                    path: dir.clone(),
                    needed_bytes: per_dir,
                    available_bytes: free,
                    fix: format!(
                        "free space there, add directories to [budgets] nvme_dirs (the store is split across them), \
                         or lower [budgets] nvme_size (the run needs {} bytes in all, {} without speculation's room)",
                        self.capacity_bytes, self.min_bytes
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The elements of each unit (`units`, whole sizes) that rank `w.rank`'s optimizer holds: its
/// shard with data-parallel ranks ([`crate::dist::shard_range`] over `w.size`), the whole unit
/// in a world of one. The state, held gradients, streams and speculation are planned on these;
/// compute copies too with [`RuntimeConfig::shard_parameters`].
pub(super) fn optimizer_units(w: World, units: &[usize]) -> Vec<usize> {
    units.iter().map(|&n| crate::dist::shard_range(n, w.rank, w.size).len()).collect()
}

/// Rank `world.rank`'s shards of `units` (the elements its optimizer holds, `optimizer_units`),
/// and the elements of each unit its compute-copy home holds: the same shards with
/// `shard_parameters` ([`RuntimeConfig::shard_parameters`]), else the whole units. Units marked
/// in `whole` (MoE experts, registered with [`crate::runtime::Runtime::add_unscheduled_unit`])
/// and units that leave a rank no shard ([`crate::dist::every_rank_holds`]) keep whole copies on
/// every rank either way; `whole` shorter than `units` marks none of the rest.
/// In a world of one, both are `units`.
pub fn rank_units(world: World, units: &[usize], whole: &[bool], shard_parameters: bool) -> (Vec<usize>, Vec<usize>) {
    let shards = optimizer_units(world, units);
    let copies = if shard_parameters {
        let is_whole =
            |k: usize| whole.get(k).is_some_and(|&w| w) || !crate::dist::every_rank_holds(units[k], world.size);
        shards.iter().enumerate().map(|(k, &s)| if is_whole(k) { units[k] } else { s }).collect()
    } else {
        units.to_vec()
    };
    (shards, copies)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(host: u64, state: StatePlacement, params: StatePlacement) -> RuntimeConfig {
        let mut c = RuntimeConfig::sim(64 << 20);
        c.host_budget_bytes = host;
        c.state_placement = state;
        c.params_placement = params;
        c
    }

    #[test]
    fn host_plan_adds_up_and_refuses_below_the_minimum() {
        let units = [70_000, 450_000, 450_000, 50_000];
        for (state, params) in [
            (StatePlacement::Host, StatePlacement::Host),
            (StatePlacement::Nvme, StatePlacement::Host),
            (StatePlacement::Nvme, StatePlacement::Nvme),
            (StatePlacement::Host, StatePlacement::Nvme),
        ] {
            let big = HostPlan::new(&config(1 << 30, state, params), &units, 1, u64::MAX, World::SINGLE);
            big.check().unwrap();
            assert!(big.peak_bytes() <= big.budget_bytes, "{big:?}");
            assert_eq!(big.speculative_units, units.len(), "room for every unit's second buffers: {big:?}");
            // At the minimum: no speculation, still runs.
            let tight = HostPlan::new(&config(big.min_bytes, state, params), &units, 1, u64::MAX, World::SINGLE);
            tight.check().unwrap();
            assert_eq!(tight.speculation_bytes, 0);
            assert_eq!(tight.peak_bytes(), tight.min_bytes, "{tight:?}");
            let e = HostPlan::new(&config(big.min_bytes - 1, state, params), &units, 1, u64::MAX, World::SINGLE)
                .check()
                .unwrap_err();
            assert!(e.to_string().contains(&big.min_bytes.to_string()) && e.to_string().contains("[budgets] host"));
        }
        let many = [450_000; 12];
        let on_host =
            HostPlan::new(&config(1 << 30, StatePlacement::Host, StatePlacement::Host), &many, 1, 0, World::SINGLE);
        let on_nvme =
            HostPlan::new(&config(1 << 30, StatePlacement::Host, StatePlacement::Nvme), &many, 1, 0, World::SINGLE);
        assert!(on_nvme.compute_copies_min_bytes < on_host.compute_copies_min_bytes);
    }

    #[test]
    fn nvme_plan_is_sized_from_the_state_and_checked_against_free_space() {
        let units = [70_000, 450_000, 50_000];
        let opt = OptimizerConfig { compute_dtype: DType::F32, ..OptimizerConfig::default() };
        let p = NvmePlan::new(&units, StatePlacement::Nvme, StatePlacement::Nvme, &opt, None, false, World::SINGLE)
            .unwrap();
        let params: u64 = units.iter().map(|&n| DType::F32.num_bytes(n) as u64).sum();
        // f32 compute copies hold the f32 master weights: the state's chunks keep m and v alone.
        assert!(p.state_bytes >= 2 * params && p.state_bytes < 2 * params + 3 * 4096 && p.params_bytes >= params);
        // bf16 compute copies: half the parameter bytes on NVMe (within the 4 KiB padding).
        let half = NvmePlan::new(
            &units,
            StatePlacement::Nvme,
            StatePlacement::Nvme,
            &OptimizerConfig::default(),
            None,
            false,
            World::SINGLE,
        );
        let half = half.unwrap();
        assert_eq!(OptimizerConfig::default().compute_dtype, DType::BF16);
        assert!(half.params_bytes >= params / 2 && half.params_bytes < params / 2 + 3 * 4096, "{half:?}");
        // bf16 copies cannot hold them: master weights, m and v in the chunks.
        assert!(half.state_bytes >= 3 * params && half.state_bytes < 3 * params + 3 * 4096, "{half:?}");
        assert_eq!(p.capacity_bytes, p.min_bytes + p.state_bytes);
        assert!(p.capacity_bytes < 3 * p.state_bytes + p.params_bytes + (64 << 20));
        let dirs = vec![PathBuf::from("/nonexistent-oogc/a")];
        p.check(&dirs, &|_| Ok(u64::MAX)).unwrap();
        let e = p.check(&dirs, &|_| Ok(1 << 20)).unwrap_err().to_string();
        assert!(e.contains(&p.capacity_bytes.to_string()) && e.contains(&(1u64 << 20).to_string()), "{e}");
        let small = NvmePlan::new(
            &units,
            StatePlacement::Nvme,
            StatePlacement::Host,
            &opt,
            Some(1 << 20),
            false,
            World::SINGLE,
        )
        .unwrap();
        let e = small.check(&dirs, &|_| Ok(u64::MAX)).unwrap_err().to_string();
        assert!(e.contains("nvme_size") && e.contains(&small.min_bytes.to_string()), "{e}");
        assert!(NvmePlan::new(&units, StatePlacement::Host, StatePlacement::Host, &opt, None, false, World::SINGLE)
            .is_none());
    }

    #[test]
    fn peak_rss_is_read_from_proc() {
        let rss = rss_bytes().expect("VmRSS in /proc/self/status");
        let hwm = peak_rss_bytes().expect("VmHWM in /proc/self/status");
        assert!(hwm >= rss && hwm > 1 << 20, "{hwm} {rss}");
    }

    #[test]
    fn touching_fresh_pages_counts_minor_faults() {
        let before = minor_faults().expect("minflt in /proc/self/stat");
        // 64 MiB mapped afresh (above malloc's mmap threshold) and touched page by page.
        let mut v = vec![0u8; 64 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        let after = minor_faults().unwrap();
        // 16,384 pages of 4 KiB, fewer with transparent huge pages (2 MiB: 32 faults).
        assert!(after >= before + 32, "{before} -> {after}");
    }
}
