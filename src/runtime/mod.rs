//! The runtime a trainer embeds: it owns the tiers (through the swapper's residency manager), the
//! pipelined CPU optimizer and the prefetch schedule, and runs one training step as
//! fetch → compute → release per unit (DESIGN.md, "One training step").
//!
//! | call | what happens |
//! |---|---|
//! | [`Runtime::add_unit`] | the unit's compute copy is registered (home: pinned host, or NVMe with `params_placement`); its fp32 master weights and Adam state go to the optimizer (host or NVMe) |
//! | [`Runtime::begin_step`] | checks budgets against the minimum working set and applies the host plan (first step); sets the step's learning rate |
//! | [`Runtime::fetch`] | waits for the unit's pending update if any (publishing the new compute copy into its home), pins the unit on the device, issues prefetches for the next units of the schedule (NVMe → host ahead of host → device when parameters live on NVMe) |
//! | [`Runtime::push_grads`] | copies the unit's gradients (a tensor on the compute device, sent in the compute dtype) D2H on the copy engine and hands them to the optimizer, which updates the unit on CPU threads while the caller goes on |
//! | [`Runtime::finish_step`] | waits until every gradient is submitted; global norm, clip scale and non-finite skip come back in [`StepStats`] |
//!
//! The next step's forward waits only for units whose update is not finished: a unit's update is
//! awaited at its first [`Runtime::fetch`] after [`Runtime::push_grads`].
//!
//! **Host memory.** Every host allocation of the runtime is claimed from one [`HostLedger`] of
//! `host_budget_bytes` ([`Runtime::host_ledger`]): the residency manager's host tier (compute
//! copies), the optimizer's state, second buffers and stream buffers, the gradients' landing
//! buffers and the gradients the optimizer holds. [`HostPlan`] splits the budget between them
//! before the first step (module [`budget`]). A unit's compute copy has one home, the residency
//! manager's host copy (or its NVMe extent): the optimizer writes the new copy there.
//!
//! **Precision.** The compute copies and the gradients are in the compute dtype
//! (`RuntimeConfig::optimizer.compute_dtype`: f32, or bf16 for mixed precision as ZeRO-Offload
//! and FSDP2's `MixedPrecisionPolicy` run it) in every tier and on every link; the fp32 master
//! weights and Adam state stay with the optimizer. Every byte size follows from the dtype
//! ([`DType::num_bytes`]).
//!
//! ```no_run
//! use oogc::dist::Ranks;
//! use oogc::runtime::{Phase, Runtime, RuntimeConfig};
//! # fn grads_of(p: &candle_core::Tensor) -> candle_core::Tensor { p.ones_like().unwrap() }
//! let mut rt = Runtime::new(RuntimeConfig::sim(64 << 20), Ranks::single())?; // one process
//! let unit = rt.add_unit("layer0", &[0.5f32; 4])?;
//! rt.begin_step(1, 1e-3)?;
//! let params = rt.fetch(unit, Phase::Forward)?;          // a [4] f32 tensor on the compute device
//! let grads = grads_of(params.tensor());                  // [4], on the compute device
//! drop(params);                                           // release: the unit may be evicted
//! rt.push_grads(unit, &grads)?;                           // D2H + pipelined CPU AdamW
//! let stats = rt.finish_step()?;
//! # anyhow::Ok(())
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use oogc_optimizer::{GradSlice, Grads, OptimizerConfig, PipelinedOptimizer, StepReport};
use oogc_prefetch::{
    check_budget, CursorHandle, NextUsePolicy, PrefetchConfig, PrefetchDriver, Schedule, TraceRecorder,
};
use oogc_swapper::{
    Access, DType, Device, HostLedger, HostUse, NvmeConfig, NvmeStore, PinnedPool, ResidencyConfig, ResidencyManager,
    SimDevice, SimDeviceConfig, StatePlacement, TensorId, TensorMeta, Tier,
};
use parking_lot::Mutex;

mod activations;
pub mod budget;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_dummy.rs"]
mod cuda;
mod device_optim;
pub mod device_plan;
mod gathered;
mod grads;
mod home;
mod ordering;
mod stats;
pub mod tensor;
mod unit;

pub use activations::ActivationId;
pub use device_optim::{adam_fixture_excess, adam_step_tensors, device_optimizer_bytes, OptimizerPlace};
pub use ordering::OrderingCall;

/// Device bytes a runtime carves out of the GPU budget for staging before the residency manager
/// gets the rest: gradient staging (the largest unit's compute-copy bytes, `largest_unit_bytes`,
/// per buffer) and, with `activation_offload`, its staging buffers of the largest checkpoint.
/// On CUDA candle's copies of the units in use come off too (the runtime knows its device).
pub fn staging_bytes(largest_unit_bytes: u64, activation_offload: Option<ActivationOffload>) -> u64 {
    STAGING_BUFFERS as u64 * largest_unit_bytes
        + activation_offload.map_or(0, |a| (activations::STAGING * a.checkpoint_bytes) as u64)
}
pub use budget::{param_nvme_traffic, rank_units, HostPlan, NvmePlan};
pub use oogc_prefetch::Phase;
pub use stats::{PeakBytes, PhaseStats, StepStats};
pub use unit::{DeviceMemory, PinnedUnit, UnitParams};

use activations::ActivationPipe;
use grads::{GradPipe, GradSource, STAGING_BUFFERS};
use home::ResidencyHome;
use ordering::Order;
use tensor::{candle_dtype, device_tensor, swapper_dtype, tensor_from_bytes, tensor_values};
use unit::{Scheduling, Unit, Update};

/// What can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The swapper failed (out of memory, I/O, corrupt NVMe block, no CUDA device...).
    #[error(transparent)]
    Swapper(#[from] oogc_swapper::Error),
    /// The optimizer failed.
    #[error(transparent)]
    Optimizer(#[from] oogc_optimizer::Error),
    /// The prefetch planner refused the budgets or the schedule.
    #[error(transparent)]
    Prefetch(#[from] oogc_prefetch::Error),
    /// candle failed while wrapping or reading a tensor.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The GPU budget cannot hold what one step must hold at once.
    #[error(
        "GPU budget of {budget_bytes} bytes is below the minimum working set of {min_bytes} bytes \
         (largest unit(s) in use at once plus gradient staging)\n  fix: raise [budgets] gpu to at least {min_bytes} bytes"
    )]
    BudgetBelowWorkingSet {
        /// The configured GPU budget.
        budget_bytes: u64,
        /// The minimum.
        min_bytes: u64,
    },
    /// The host budget cannot hold what the run must hold at once.
    #[error(
        "host budget of {budget_bytes} bytes is below the {min_bytes} bytes this run needs at least ({parts})\n  \
         fix: raise [budgets] host to at least {min_bytes} bytes, or put the optimizer state and/or the parameters \
         on NVMe ([budgets] optimizer_state / params = \"nvme\")"
    )]
    HostBudgetBelowMinimum {
        /// The configured host budget.
        budget_bytes: u64,
        /// The minimum.
        min_bytes: u64,
        /// The minimum's parts by category.
        parts: String,
    },
    /// The NVMe store cannot be made as large as the run needs.
    #[error("NVMe store in {path}: {needed_bytes} bytes needed, {available_bytes} available\n  fix: {fix}")]
    NvmeTooSmall {
        /// The directory (or the first one).
        path: PathBuf,
        /// Bytes needed there.
        needed_bytes: u64,
        /// Bytes available (free space, or the configured size).
        available_bytes: u64,
        /// How to fix it.
        fix: String,
    },
    /// A call out of order or with a wrong argument.
    #[error("runtime misuse: {0}")]
    Usage(String),
    /// A collective between the data-parallel ranks failed, or the ranks are not a world: the
    /// run cannot go on (the entry point ends it).
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
}

/// Result of runtime operations.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// A unit handle: its index in registration order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitId(pub usize);

impl UnitId {
    /// The swapper tensor that holds the unit's compute copy (and the optimizer's unit id).
    fn tensor(self) -> TensorId {
        TensorId(self.0 as u64)
    }
}

/// Which device computes.
#[derive(Debug, Clone)]
pub enum DeviceSpec {
    /// The sim device: capacity = the GPU budget, H2D/D2H throttled to `link_gbps` (0 = no
    /// throttle) plus `latency_us` per copy; compute is candle on the CPU.
    Sim {
        /// GB/s (10^9 B/s).
        link_gbps: f64,
        /// Microseconds per copy.
        latency_us: f64,
    },
    /// CUDA device `ordinal` (needs `--features cuda`).
    Cuda {
        /// Device index.
        ordinal: usize,
        /// cudarc's per-slice event tracking (an event recorded at each use of a device slice
        /// and waited for at the next use from another stream). The runtime orders its streams
        /// with events of its own (swapper's `CudaDevice`), so it does not rely on it; `false`
        /// turns it off for every slice allocated after the device is opened.
        event_tracking: bool,
    },
}

/// How a [`Runtime`] is built.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The compute device.
    pub device: DeviceSpec,
    /// Device bytes for compute copies and gradient staging.
    pub gpu_budget_bytes: u64,
    /// Host bytes for everything the runtime holds in host memory (the [`HostLedger`]'s budget:
    /// compute copies, optimizer state, second buffers, stream buffers, gradients).
    pub host_budget_bytes: u64,
    /// Where master weights and Adam state live.
    pub state_placement: StatePlacement,
    /// Where the compute copies' home is: pinned host memory, or the NVMe store with the host
    /// tier as its cache (ZeRO-Infinity's `offload_param`).
    pub params_placement: StatePlacement,
    /// NVMe store for optimizer state and/or parameters (needed when either is on NVMe).
    pub nvme: Option<NvmeConfig>,
    /// Units prefetched ahead; 0 = on demand.
    pub prefetch_depth: usize,
    /// Units prefetched NVMe → host ahead, when parameters live on NVMe (the host window, ahead
    /// of the device window); 0 = none.
    pub host_prefetch_depth: usize,
    /// The CPU optimizer.
    pub optimizer: OptimizerConfig,
    /// Page-lock host memory (falls back with a warning when RLIMIT_MEMLOCK is low).
    pub lock_host_memory: bool,
    /// true (ours): each unit's gradients go to the CPU optimizer as soon as their D2H copy
    /// lands, so updates overlap the rest of the backward and the next step's forward. false (the
    /// ZeRO-Infinity-like baseline): gradients are still copied D2H per unit but held, submitted
    /// only in [`Runtime::finish_step`], which then waits for every unit's update before
    /// returning: the optimizer never overlaps compute. Same results bit for bit.
    pub overlap_optimizer: bool,
    /// Activation checkpoints offloaded to pinned host memory ([`Runtime::stash_activation`]);
    /// `None`: the caller keeps them on the device.
    pub activation_offload: Option<ActivationOffload>,
    /// With data-parallel ranks, shard the compute copies too (ZeRO-3, FSDP's `FULL_SHARD`):
    /// each rank's tiers (host, NVMe, device) hold only its [`crate::dist::shard_range`] of
    /// every unit's compute copy, a fetch copies that shard H2D and all-gathers the whole unit
    /// on the compute device, and gathered units are kept for their next use while the GPU
    /// budget allows (`runtime/gathered.rs`). `false`: every rank's tiers hold whole compute
    /// copies, all-gathered once per update in [`Runtime::finish_step`] (ZeRO-2, FSDP's
    /// `SHARD_GRAD_OP`), which [`Runtime::fetch_pinned`] needs. No effect in a world of one.
    pub shard_parameters: bool,
}

/// What a run offloads of its activation checkpoints (`[activations] offload`): enters the host
/// plan ([`HostUse::Activations`]: `checkpoints` buffers of `checkpoint_bytes`) and the device's
/// working set (two staging buffers of `checkpoint_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationOffload {
    /// Checkpoints held at once (blocks × micro-batches).
    pub checkpoints: usize,
    /// Bytes of the largest checkpoint (`[batch, seq, hidden]` in the compute dtype).
    pub checkpoint_bytes: usize,
}

impl RuntimeConfig {
    /// A sim-device runtime with `gpu_budget_bytes`, an unthrottled link, state in host memory,
    /// prefetch depth 2 and the optimizer's defaults with f32 compute copies (set
    /// `optimizer.compute_dtype` to [`DType::BF16`] for mixed precision).
    pub fn sim(gpu_budget_bytes: u64) -> Self {
        Self {
            device: DeviceSpec::Sim { link_gbps: 0.0, latency_us: 0.0 },
            gpu_budget_bytes,
            host_budget_bytes: 4 << 30,
            state_placement: StatePlacement::Host,
            params_placement: StatePlacement::Host,
            nvme: None,
            prefetch_depth: 2,
            host_prefetch_depth: 4,
            optimizer: OptimizerConfig { compute_dtype: DType::F32, ..OptimizerConfig::default() },
            lock_host_memory: false,
            overlap_optimizer: true,
            activation_offload: None,
            shard_parameters: false,
        }
    }
}

/// The out-of-GPU-core runtime for one model on one device. See the module docs.
pub struct Runtime {
    /// The run's ranks: with more than one, the optimizer holds this rank's shard of every
    /// unit ([`crate::dist::shard_range`]).
    ranks: crate::dist::Ranks,
    config: RuntimeConfig,
    /// candle's device for the units' tensors (the CPU for the sim device).
    compute_device: candle_core::Device,
    residency: Arc<ResidencyManager>,
    grads: GradPipe,
    /// Per-unit state, indexed by [`UnitId`].
    units: Vec<Unit>,
    /// Ranks unscheduled units for eviction once the next-use policy is installed.
    fallback: Option<Box<dyn oogc_swapper::EvictionPolicy>>,
    step: u64,
    step_started: Option<Instant>,
    stats: StepStats,
    metrics_at_begin: Option<oogc_swapper::MetricsSnapshot>,
    checked_working_set: bool,
    /// Units a caller holds pinned at once (2 when a tied head uses the embedding).
    max_units_in_use: usize,
    /// The access trace of the step in progress (shared with [`UnitParams`], which records its
    /// release when dropped).
    recorder: Arc<Mutex<TraceRecorder>>,
    /// The schedule in force (the last step's trace) and the policy's cursor on it.
    schedule: Option<Arc<Schedule>>,
    cursor: Option<CursorHandle>,
    /// The sliding window of prefetches (depth > 0, from the second step on).
    driver: Option<PrefetchDriver>,
    nvme_dirs: Vec<PathBuf>,
    /// The NVMe store of the optimizer state and/or the parameters (shared by the optimizer and
    /// the residency manager).
    nvme: Option<Arc<NvmeStore>>,
    /// The one host budget every host allocation is claimed from.
    ledger: Arc<HostLedger>,
    /// Offloaded activation checkpoints (`RuntimeConfig::activation_offload`).
    activations: ActivationPipe,
    /// The split of the host budget, applied before the first step.
    host_plan: Option<HostPlan>,
    /// The residency manager's device budget without device optimizers (set by
    /// [`Runtime::check_working_set`]); theirs is carved out of it.
    device_budget_base: u64,
    /// GPU bytes of the units whose optimizer is on the device ([`device_optimizer_bytes`]).
    device_optimizer_bytes: u64,
    /// The open step's learning rate (its `t` is `step`), for the device optimizers' update.
    lr: f32,
    /// Units gathered from the ranks' shards, kept for their next use (`sharded` only).
    gathered: gathered::Gathered,
    /// With sharded compute copies ([`RuntimeConfig::shard_parameters`] and more than one
    /// rank: [`Runtime::sharded`]), the optimizer's compute-copy home (which routes the units
    /// kept whole).
    rank_home: Option<Arc<home::RankHome>>,
    /// The ordering calls between compute and the copy stream (`runtime/ordering.rs`), one of
    /// which the test hook may leave out.
    order: Order,
}

impl Runtime {
    /// Builds the device, the host ledger, the residency manager, the optimizer (and the NVMe
    /// store when state or parameters live on NVMe), for this process's place among `ranks`
    /// ([`crate::dist::Ranks::single`] for one process): with more than one rank its optimizer
    /// holds this rank's shard of every unit and its collectives go to `ranks`.
    ///
    /// # Errors
    /// [`RuntimeError::Swapper`] for a bad device (no CUDA device, not compiled with CUDA), a bad
    /// NVMe directory (named, with the bytes needed) or budget; [`RuntimeError::Optimizer`] for a
    /// bad optimizer config.
    pub fn new(config: RuntimeConfig, ranks: crate::dist::Ranks) -> Result<Self> {
        if !config.optimizer.compute_dtype.is_float() {
            return Err(RuntimeError::Usage(format!(
                "compute copies are f32, bf16 or f16; set the optimizer's compute_dtype to one of them (got {})",
                config.optimizer.compute_dtype
            )));
        }
        let order = Order::from_env()?;
        let (device, compute_device) = match &config.device {
            DeviceSpec::Sim { link_gbps, latency_us } => {
                let sim = SimDevice::new(SimDeviceConfig {
                    capacity_bytes: config.gpu_budget_bytes,
                    link_gbps: (*link_gbps > 0.0).then_some(*link_gbps),
                    latency_us: *latency_us,
                    // The runtime's contract: compute waits on a copy's event, never the host.
                    host_wait_orders_compute: false,
                })?;
                // The sim device's compute is candle on this CPU, by definition.
                (Device::Sim(sim), candle_core::Device::Cpu)
            }
            // One compute stream, candle's: the swapper's device is built on it.
            DeviceSpec::Cuda { ordinal, event_tracking } => {
                cuda::open(*ordinal, config.gpu_budget_bytes, *event_tracking)?
            }
        };
        let on_nvme = config.state_placement == StatePlacement::Nvme || config.params_placement == StatePlacement::Nvme;
        let nvme = match (on_nvme, &config.nvme) {
            (true, Some(nvme)) => Some(Arc::new(NvmeStore::open(nvme.clone())?)),
            (true, None) => {
                return Err(RuntimeError::Usage(
                    "optimizer state or parameters on NVMe need an NVMe config (RuntimeConfig::nvme)".into(),
                ));
            }
            (false, _) => None,
        };
        let nvme_dirs = config.nvme.as_ref().map(|n| n.dirs.clone()).unwrap_or_default();
        let ledger = HostLedger::new(config.host_budget_bytes);
        let host_allocator = device.host_allocator(config.lock_host_memory);
        let residency = Arc::new(ResidencyManager::new(
            device,
            nvme.clone(),
            ResidencyConfig {
                // Set for real once the units are known (gradient staging is carved out).
                device_budget_bytes: Some(config.gpu_budget_bytes),
                // Set for real before the first step (the host plan's share).
                host_budget_bytes: config.host_budget_bytes,
                host_ledger: Some(ledger.clone()),
                lock_host_memory: config.lock_host_memory,
                compute_waits_for_fetch: !order.drops(OrderingCall::FetchComputeWaits),
                ..ResidencyConfig::default()
            },
            Box::new(oogc_swapper::LruPolicy),
        )?);
        // Data-parallel ranks shard the optimizer (ZeRO-style): this rank's optimizer holds its
        // shard of every unit's master weights and Adam state. Without sharded parameters it
        // writes its shard's compute copy into a home of its own and `finish_step` all-gathers
        // the shards into the residency manager's whole copies. The norm it clips with is the
        // run's.
        let world = ranks.world();
        // With sharded parameters the tiers hold exactly the optimizer's shard of each copy: the
        // optimizer writes it there, as in a world of one.
        let sharded = config.shard_parameters && world.size > 1;
        let rank_home = sharded.then(|| Arc::new(home::RankHome::new(residency.clone())));
        let home: Arc<dyn oogc_optimizer::ComputeCopyHome> = match &rank_home {
            Some(h) => h.clone(),
            None if world.size > 1 => Arc::new(oogc_optimizer::MemoryHome::new()),
            None => Arc::new(ResidencyHome::new(residency.clone())),
        };
        let optimizer = PipelinedOptimizer::with_home(config.optimizer.clone(), nvme.clone(), ledger.clone(), home)?;
        if world.size > 1 {
            let ranks = ranks.clone();
            optimizer.set_norm_reduce(Arc::new(move |sumsq| {
                let mut s = [sumsq];
                ranks.all_reduce_sum_f64(&mut s).map_err(|e| e.to_string())?;
                Ok(s[0])
            }));
        }
        let activation_pool = PinnedPool::with_ledger(
            &oogc_swapper::PinnedPoolConfig { budget_bytes: config.host_budget_bytes, lock: config.lock_host_memory },
            host_allocator.clone(),
            ledger.clone(),
            HostUse::Activations,
        );
        let grad_pool = PinnedPool::with_ledger(
            &oogc_swapper::PinnedPoolConfig { budget_bytes: config.host_budget_bytes, lock: config.lock_host_memory },
            host_allocator,
            ledger.clone(),
            HostUse::Gradients,
        );
        let grads = GradPipe::new(optimizer, ranks.clone(), grad_pool, ledger.clone(), !config.overlap_optimizer);
        Ok(Self {
            ranks,
            activations: ActivationPipe::new(activation_pool),
            config,
            compute_device,
            residency,
            grads,
            units: Vec::new(),
            fallback: None,
            step: 0,
            step_started: None,
            stats: StepStats::default(),
            metrics_at_begin: None,
            checked_working_set: false,
            max_units_in_use: 1,
            recorder: Arc::new(Mutex::new(TraceRecorder::new())),
            schedule: None,
            cursor: None,
            driver: None,
            nvme_dirs,
            nvme,
            ledger,
            host_plan: None,
            device_budget_base: 0,
            device_optimizer_bytes: 0,
            lr: 0.0,
            rank_home,
            gathered: gathered::Gathered::new(),
            order,
        })
    }

    /// Registers a unit: `master` is its flat fp32 parameter vector (`[numel]`); the compute
    /// copy (in the compute dtype, rounded to nearest even as the optimizer writes it) gets its home in pinned host memory (or on NVMe, written there now, with
    /// [`RuntimeConfig::params_placement`]) and the master weights and Adam state go to the
    /// optimizer's tier. Units are numbered in registration order.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] after the first step began; swapper or optimizer errors (host
    /// budget, NVMe full).
    pub fn add_unit(&mut self, name: &str, master: &[f32]) -> Result<UnitId> {
        self.add_unit_as(name, master, Scheduling::Scheduled)
    }

    /// [`Runtime::add_unit`] for a unit used as data decides, such as an MoE expert (its next
    /// use is unknown until the router runs): kept out of the recorded schedule as
    /// [`Runtime::set_unscheduled`] does, and with sharded parameters
    /// ([`RuntimeConfig::shard_parameters`]) its compute copy stays whole on every rank — each
    /// rank fetches it as its own data needs, so an all-gather at its fetch would be a
    /// collective only some ranks call — while its master weights and Adam state are sharded
    /// like every unit's (its new copy all-gathered at the end of each step that updates it).
    ///
    /// # Errors
    /// As [`Runtime::add_unit`].
    pub fn add_unscheduled_unit(&mut self, name: &str, master: &[f32]) -> Result<UnitId> {
        self.add_unit_as(name, master, Scheduling::Unscheduled)
    }

    fn add_unit_as(&mut self, name: &str, master: &[f32], scheduling: Scheduling) -> Result<UnitId> {
        if self.checked_working_set {
            return Err(RuntimeError::Usage(format!("add_unit({name}) after the first step began")));
        }
        let unit = UnitId(self.units.len());
        let home = self.config.params_placement.tier();
        let dtype = self.compute_dtype();
        let world = self.ranks.world();
        let shard = crate::dist::shard_range(master.len(), world.rank, world.size);
        // Sharded parameters: the tiers hold this rank's shard of a scheduled unit's compute copy.
        let gathers = self.sharded() && scheduling == Scheduling::Scheduled;
        let kept = if gathers { shard.clone() } else { 0..master.len() };
        if let (Some(home), false) = (&self.rank_home, gathers) {
            home.keep_whole(unit.tensor());
        }
        if gathers && kept.is_empty() {
            return Err(RuntimeError::Usage(format!(
                "add_unit({name}): {} parameters leave rank {} of {} no shard of the unit; shard the parameters of \
                 units of at least one element per rank (shard_parameters = false keeps whole copies)",
                master.len(),
                world.rank,
                world.size
            )));
        }
        let meta = TensorMeta::new(unit.tensor(), name, &[kept.len()], dtype, home);
        self.residency.register(meta, &oogc_optimizer::compute_copy(&master[kept.clone()], dtype))?;
        if home == Tier::Nvme {
            // A cold start: the copy is on NVMe; the host tier fills as the schedule needs it.
            self.residency.drop_host_copy(unit.tensor())?;
            self.residency.host_pool().trim();
        }
        self.grads.optimizer().add_unit(unit.tensor(), &master[shard], self.config.state_placement)?;
        // Gradients land in buffers of the largest unit's size (the plan's two): reused by every
        // unit's D2H instead of one size class giving way to another every step.
        self.grads.raise_landing_len(dtype.num_bytes(master.len()));
        let mut u = Unit::new(name, master.len(), kept.len(), dtype);
        u.scheduling = scheduling;
        u.gathers = gathers;
        self.units.push(u);
        Ok(unit)
    }

    /// Declares how many units the caller pins at once (default 1; 2 for a tied LM head, which
    /// uses the embedding unit beside its own). Enters the minimum working set.
    pub fn set_max_units_in_use(&mut self, units: usize) {
        self.max_units_in_use = units.max(1);
    }

    /// Keeps `unit` out of the recorded schedule: its fetches are not recorded, the prefetch
    /// window does not fetch it, and the eviction policy ranks it by its fallback (see
    /// [`Runtime::set_fallback_policy`]). For units used as data decides, such as MoE experts
    /// (their next use is unknown until the router runs). With sharded parameters register such
    /// units with [`Runtime::add_unscheduled_unit`] instead, which keeps their copies whole.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a unit whose compute copy is sharded over the ranks (its
    /// fetches all-gather it: every rank must fetch it at the same point of the schedule).
    pub fn set_unscheduled(&mut self, unit: UnitId) -> Result<()> {
        let u = &mut self.units[unit.0];
        if u.gathers {
            return Err(RuntimeError::Usage(format!(
                "set_unscheduled({}): its compute copy is sharded over the ranks and all-gathered at each fetch, \
                 which every rank must make at the same point; register it with add_unscheduled_unit, which keeps \
                 it whole on every rank",
                u.name
            )));
        }
        u.scheduling = Scheduling::Unscheduled;
        Ok(())
    }

    /// The policy that ranks unscheduled units (default LRU) once the next-use policy is
    /// installed after the first step, e.g. MoE expert popularity from `oogc-moe-placement`.
    /// It sees units as the swapper tensors of [`Runtime::unit_tensor`].
    pub fn set_fallback_policy(&mut self, policy: Box<dyn oogc_swapper::EvictionPolicy>) {
        self.fallback = Some(policy);
    }

    /// The swapper tensor that holds `unit`'s compute copy (what eviction policies and the
    /// swapper's metrics and traces name).
    pub fn unit_tensor(&self, unit: UnitId) -> TensorId {
        unit.tensor()
    }

    /// Registered units in order.
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// The unit's name and element count.
    pub fn unit_info(&self, unit: UnitId) -> (&str, usize) {
        let u = &self.units[unit.0];
        (&u.name, u.numel)
    }

    /// The device the runtime was opened on: `sim`, or `cuda:N`.
    pub fn device_kind(&self) -> crate::config::DeviceKind {
        match self.config.device {
            DeviceSpec::Sim { .. } => crate::config::DeviceKind::Sim,
            DeviceSpec::Cuda { ordinal, .. } => crate::config::DeviceKind::Cuda(ordinal),
        }
    }

    /// candle's device the units' tensors live on ([`UnitParams::tensor`]): the CPU for the
    /// sim device, the GPU for CUDA. Build inputs (token ids) there.
    pub fn compute_device(&self) -> &candle_core::Device {
        &self.compute_device
    }

    /// The compute copies' and gradients' element type (f32, bf16 or f16): what
    /// [`UnitParams::tensor`] holds and what [`Runtime::push_grads`] sends over the link.
    pub fn compute_dtype(&self) -> DType {
        self.config.optimizer.compute_dtype
    }

    /// Whether `unit` has a copy on the device now (a fetch would move no bytes).
    pub fn is_on_device(&self, unit: UnitId) -> bool {
        self.units[unit.0].on_device.is_some() || self.residency.residency(unit.tensor()).is_ok_and(|r| r.device)
    }

    /// Peak bytes held on the device and in pinned host memory since the runtime began, and the
    /// NVMe bytes in use now.
    pub fn peak_bytes(&self) -> PeakBytes {
        PeakBytes {
            device: self.residency.peak_bytes(Tier::Device),
            host: self.residency.peak_bytes(Tier::Host),
            nvme: self.optimizer_nvme_bytes(),
            host_ledger: self.ledger.peak_bytes(),
        }
    }

    /// The host ledger: every host byte the runtime holds, by category, with peaks. The hook for
    /// host-kept activations ([`HostUse::Activations`]).
    pub fn host_ledger(&self) -> &Arc<HostLedger> {
        &self.ledger
    }

    /// The split of the host budget in force (from the first step on).
    pub fn host_plan(&self) -> Option<&HostPlan> {
        self.host_plan.as_ref()
    }

    /// The plan of the host budget for the units added so far (what [`Runtime::begin_step`]
    /// applies).
    pub fn plan_host(&self) -> HostPlan {
        let units: Vec<usize> = self.units.iter().map(|u| u.numel).collect();
        let shards = budget::optimizer_units(self.ranks.world(), &units);
        let copies: Vec<usize> = self.units.iter().map(|u| u.home_numel).collect();
        HostPlan::with_shards(
            &self.config,
            &units,
            &shards,
            &copies,
            self.max_units_in_use,
            self.nvme_speculation_room(),
        )
    }

    /// NVMe bytes the store has beyond what the run needs ([`NvmePlan::speculation_room_bytes`]):
    /// room for speculated NVMe units' second extents.
    fn nvme_speculation_room(&self) -> u64 {
        let units: Vec<usize> = self.units.iter().map(|u| u.numel).collect();
        self.nvme.as_ref().map_or(0, |store| {
            NvmePlan::new(
                &units,
                self.config.state_placement,
                self.config.params_placement,
                &self.config.optimizer,
                Some(store.capacity_bytes()),
                self.config.shard_parameters,
                self.ranks.world(),
            )
            .map_or(0, |p| p.speculation_room_bytes())
        })
    }

    /// The residency manager (tiers, residency of each unit's compute copy, metrics).
    pub fn residency(&self) -> &ResidencyManager {
        &self.residency
    }

    /// The pipelined optimizer.
    pub fn optimizer(&self) -> &PipelinedOptimizer {
        self.grads.optimizer()
    }

    /// The NVMe directories of the optimizer state (empty when it lives in host memory).
    pub fn nvme_dirs(&self) -> &[PathBuf] {
        &self.nvme_dirs
    }

    /// Bytes the device must hold at once: the `max_units_in_use` largest units' copies in the
    /// tiers (with sharded parameters, this rank's shards of them, and the whole units gathered
    /// beside) plus gradient staging (buffers of the largest unit's gradients).
    pub fn min_working_set_bytes(&self, max_units_in_use: usize) -> u64 {
        largest_bytes(self.units.iter().map(Unit::home_bytes), max_units_in_use)
            + staging_bytes(self.largest_units_bytes(1), self.config.activation_offload)
            + self.compute_side_copies_bytes()
    }

    /// Bytes of the `k` (at least 1) largest units' compute copies together.
    fn largest_units_bytes(&self, k: usize) -> u64 {
        largest_bytes(self.units.iter().map(Unit::bytes), k)
    }

    /// Device bytes of candle's own copies of the units in use on CUDA (`max_units_in_use` of the
    /// largest unit): a fetched unit becomes a tensor candle owns by one device-to-device copy
    /// (`runtime/cuda.rs`). 0 on the sim device, whose tensors are CPU tensors — except the
    /// units gathered from the ranks' shards, which stand for GPU memory on either device.
    fn compute_side_copies_bytes(&self) -> u64 {
        if self.sharded() || matches!(self.residency.device(), Device::Cuda(_)) {
            self.largest_units_bytes(self.max_units_in_use)
        } else {
            0
        }
    }

    /// With sharded parameters ([`RuntimeConfig::shard_parameters`] and ranks), the GPU bytes
    /// set aside for units all-gathered from the ranks' shards (the units in use, and those
    /// kept for their next use), out of the GPU budget; known from the first step on (0
    /// before, and without sharding).
    pub fn gathered_budget_bytes(&self) -> u64 {
        self.gathered.capacity_bytes()
    }

    /// Whether the tiers hold shards of the compute copies ([`RuntimeConfig::shard_parameters`]
    /// with more than one rank).
    fn sharded(&self) -> bool {
        self.rank_home.is_some()
    }

    /// With sharded parameters, the GPU bytes gathered units ([`StepStats::gathers`]) may hold
    /// beyond the units in use ([`Runtime::compute_side_copies_bytes`], `in_use`): what
    /// `available` (the budget less staging and the units in use) leaves once every shard fits,
    /// up to every whole unit. Shards come first: a resident shard saves its H2D over the link,
    /// a gathered unit N × its bytes of GPU memory for an all-gather over the ranks' faster
    /// links.
    fn gathered_extra_bytes(&self, available: u64, in_use: u64) -> u64 {
        let shards: u64 = self.units.iter().map(Unit::home_bytes).sum();
        let whole: u64 = self.units.iter().filter(|u| u.gathers).map(Unit::bytes).sum();
        available.saturating_sub(shards).min(whole.saturating_sub(in_use))
    }

    /// Copies an activation checkpoint (`data`: any shape, f32, bf16 or f16, on the compute
    /// device) D2H into pinned host memory claimed from the host ledger
    /// ([`HostUse::Activations`]) and returns its handle; the caller drops its device copy. Bring it back with
    /// [`prefetch_activation`](Self::prefetch_activation) (ahead) and
    /// [`take_activation`](Self::take_activation).
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] without `RuntimeConfig::activation_offload`, before the first
    /// [`begin_step`](Self::begin_step), or for a checkpoint larger than configured; the host
    /// budget ([`RuntimeError::Swapper`]) or the copy failing.
    pub fn stash_activation(&mut self, data: &candle_core::Tensor) -> Result<ActivationId> {
        self.check_activation_offload()?;
        self.activations.stash(self.residency.device(), self.order, data)
    }

    /// Starts the H2D copy of a stashed checkpoint back to the device (at most one at a time
    /// besides the one being taken).
    ///
    /// # Errors
    /// As [`stash_activation`](Self::stash_activation); an unknown or taken `id`.
    pub fn prefetch_activation(&mut self, id: ActivationId) -> Result<()> {
        self.check_activation_offload()?;
        self.activations.prefetch(self.residency.device(), self.order, id)
    }

    /// A stashed checkpoint back on the compute device, as the tensor stashed (shape, dtype and
    /// bits); its host memory is given back.
    ///
    /// # Errors
    /// As [`prefetch_activation`](Self::prefetch_activation).
    pub fn take_activation(&mut self, id: ActivationId) -> Result<candle_core::Tensor> {
        self.check_activation_offload()?;
        self.activations.take(self.residency.device(), self.order, &self.compute_device, id)
    }

    /// Checkpoints stashed and not taken yet.
    pub fn stashed_activations(&self) -> usize {
        self.activations.len()
    }

    fn check_activation_offload(&self) -> Result<()> {
        if self.config.activation_offload.is_none() {
            return Err(RuntimeError::Usage(
                "activation offload is off: set RuntimeConfig::activation_offload ([activations] offload = true)"
                    .into(),
            ));
        }
        if !self.checked_working_set {
            return Err(RuntimeError::Usage("stash activations after begin_step (the staging is made there)".into()));
        }
        Ok(())
    }

    /// Starts a step whose update is Adam step `step` (1-based `t`; a skipped step does not
    /// advance it) with learning rate `lr`. The first call checks the
    /// GPU budget against the minimum working set and carves out gradient staging.
    ///
    /// # Errors
    /// [`RuntimeError::BudgetBelowWorkingSet`] with the minimum in bytes; optimizer errors.
    pub fn begin_step(&mut self, step: u64, lr: f32) -> Result<()> {
        self.check_working_set()?;
        self.grads.optimizer().begin_step(step, lr)?;
        self.step = step;
        self.lr = lr;
        self.stats = StepStats { step, clip_scale: 1.0, ..StepStats::default() };
        self.metrics_at_begin = Some(self.traffic());
        // The step's device high-water mark starts from what is held now.
        self.residency.device().reset_pool_peak()?;
        self.step_started = Some(Instant::now());
        *self.recorder.lock() = TraceRecorder::new();
        if let Some(cursor) = &self.cursor {
            // Evaluation between steps made off-schedule acquires: start the step afresh.
            cursor.restart_step();
        }
        Ok(())
    }

    /// Marks the turn from the forward to the backward phase (before the head's backward): the
    /// time, stalls and H2D/D2H bytes so far become [`StepStats::forward`], which lets a
    /// benchmark bound each phase by its own busiest resource. Optional; idempotent within a
    /// step (the first call counts).
    pub fn end_forward(&mut self) {
        if self.stats.forward.wall_s > 0.0 {
            return;
        }
        let (Some(start), Some(begin)) = (self.step_started, self.metrics_at_begin.as_ref()) else {
            return;
        };
        let now = self.traffic();
        self.stats.forward = PhaseStats {
            wall_s: start.elapsed().as_secs_f64(),
            stall_s: self.stats.stall_s(),
            h2d_bytes: now.htod.bytes - begin.htod.bytes,
            d2h_bytes: now.dtoh.bytes - begin.dtoh.bytes,
        };
    }

    /// Checks the GPU budget against the minimum working set and carves out gradient staging,
    /// checks the host budget against the run's minimum and applies the host plan (the host
    /// tier's share, the stream and gradient pools' caps, the optimizer's second buffers); no
    /// more units can be added afterwards. [`Runtime::begin_step`] calls it; call it earlier
    /// to refuse a bad budget before anything else happens.
    ///
    /// # Errors
    /// [`RuntimeError::BudgetBelowWorkingSet`] or [`RuntimeError::HostBudgetBelowMinimum`] with
    /// the minimum in bytes; swapper errors applying the host tier's share.
    pub fn check_working_set(&mut self) -> Result<()> {
        if self.checked_working_set {
            return Ok(());
        }
        let min = self.min_working_set_bytes(self.max_units_in_use);
        if self.config.gpu_budget_bytes < min {
            return Err(RuntimeError::BudgetBelowWorkingSet {
                budget_bytes: self.config.gpu_budget_bytes,
                min_bytes: min,
            });
        }
        self.apply_host_plan()?;
        let largest = self.units.iter().map(Unit::bytes).max().unwrap_or(0) as usize;
        let device = self.residency.device();
        for _ in 0..STAGING_BUFFERS {
            // The backward writes a staging buffer before any copy uses it.
            self.grads.add_staging(self.order.alloc_for_compute(
                device,
                OrderingCall::GradStagingAlloc,
                largest.max(1),
            )?);
        }
        if let Some(a) = self.config.activation_offload {
            self.activations.make_staging(device, self.order, a.checkpoint_bytes)?;
        }
        let in_use = self.compute_side_copies_bytes();
        self.device_budget_base =
            self.config.gpu_budget_bytes - staging_bytes(largest as u64, self.config.activation_offload) - in_use;
        if self.sharded() {
            let extra = self.gathered_extra_bytes(self.device_budget_base, in_use);
            self.gathered.set_capacity_bytes(in_use + extra);
            self.device_budget_base -= extra;
        }
        self.residency.set_device_budget_bytes(self.device_budget_base - self.device_optimizer_bytes)?;
        self.checked_working_set = true;
        Ok(())
    }

    /// Splits the host budget ([`HostPlan`]) and applies the split.
    fn apply_host_plan(&mut self) -> Result<()> {
        let plan = self.plan_host();
        plan.check()?;
        self.residency.set_host_budget_bytes(plan.compute_copies_bytes.max(1))?;
        self.grads.set_landing_budget_bytes(plan.gradient_landing_bytes);
        self.activations.set_budget_bytes(plan.activations_bytes);
        let optimizer = self.grads.optimizer();
        if self.config.state_placement == StatePlacement::Nvme {
            optimizer.set_stream_host_budget_bytes(plan.nvme_stream_bytes)?;
        }
        let spec = optimizer.reserve_speculation(plan.speculation_budget_bytes, self.nvme_speculation_room())?;
        tracing::info!(
            budget_bytes = plan.budget_bytes,
            min_bytes = plan.min_bytes,
            compute_copies_bytes = plan.compute_copies_bytes,
            speculative_units = spec.speculative_units,
            deferred_units = spec.deferred_units,
            "host plan"
        );
        self.host_plan = Some(plan);
        Ok(())
    }

    /// Pins `unit` on the device and returns its parameters as a tensor. Waits first for the
    /// unit's pending optimizer update (its new compute copy is published to the host copy, which
    /// drops the stale device copy). Then issues prefetches for the next units of the schedule.
    /// [`Phase::Eval`] fetches (validation) are not recorded and prefetch nothing.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for [`Phase::Optimizer`] (not a compute phase); swapper errors
    /// (out of device memory with everything pinned, I/O), optimizer errors;
    /// [`RuntimeError::Dist`] when a sharded unit's all-gather failed.
    pub fn fetch(&mut self, unit: UnitId, phase: Phase) -> Result<UnitParams> {
        if let Some(d) = &self.units[unit.0].on_device {
            // Its optimizer keeps the compute copy on the device: nothing moves, nothing is
            // recorded (the unit is outside the schedule while it stays there).
            return Ok(UnitParams { tensor: d.copy.clone(), unit, _pinned: None, _gathered: None });
        }
        if self.units[unit.0].gathers {
            return self.fetch_gathered(unit, phase);
        }
        let pinned = self.pin_on_device(unit, phase, Access::Read)?;
        let tensor = {
            let buf = pinned.pin.device_buffer();
            device_tensor(&buf, pinned.numel, pinned.dtype, &self.compute_device)?
        };
        Ok(UnitParams { tensor, unit, _pinned: Some(pinned), _gathered: None })
    }

    /// [`Runtime::fetch`] without the tensor: pins `unit` on the device (waiting for its
    /// pending update, recording the access, issuing prefetches, as `fetch` does) and returns
    /// the guard, whose [`PinnedUnit::memory`] is the pinned compute copy itself, for sharing
    /// it with another framework without a copy (the Python bindings' DLPack tensors).
    /// [`Access::Write`] makes the device copy dirty: writes through the memory are what the
    /// unit's next compute sees (written back to the host copy on eviction) until the
    /// optimizer publishes the unit's next update.
    ///
    /// # Errors
    /// As [`Runtime::fetch`].
    pub fn fetch_pinned(&mut self, unit: UnitId, phase: Phase, access: Access) -> Result<PinnedUnit> {
        if self.units[unit.0].gathers {
            return Err(RuntimeError::Usage(format!(
                "fetch_pinned({}): the parameters are sharded over the ranks, so the device holds this rank's shard \
                 of the unit, not the unit; use fetch (which all-gathers it), or build the runtime with \
                 shard_parameters = false",
                self.units[unit.0].name
            )));
        }
        self.pin_on_device(unit, phase, access)
    }

    /// With sharded parameters: the unit kept gathered, or this rank's shard pinned on the
    /// device (as [`Runtime::fetch_pinned`] pins a unit) and all-gathered from the ranks' into
    /// the whole unit, kept for its next use while the budget allows (`runtime/gathered.rs`).
    /// The same fetches miss on every rank, so every rank calls the all-gather.
    fn fetch_gathered(&mut self, unit: UnitId, phase: Phase) -> Result<UnitParams> {
        if phase == Phase::Optimizer {
            return Err(RuntimeError::Usage("fetch(.., Phase::Optimizer): the optimizer does not fetch units".into()));
        }
        if let Some((tensor, in_use)) = self.gathered.get(unit, phase != Phase::Eval) {
            return Ok(UnitParams { tensor, unit, _pinned: None, _gathered: Some(in_use) });
        }
        let shard = {
            let pinned = self.pin_on_device(unit, phase, Access::Read)?;
            let buf = pinned.pin.device_buffer();
            tensor::device_bytes(&buf, pinned.numel, pinned.dtype, &self.compute_device)?
        };
        let (numel, dtype, bytes) = (self.units[unit.0].numel, self.units[unit.0].dtype, self.units[unit.0].bytes());
        let t = Instant::now();
        // One collective at a time, in the same order on every rank: the gradients pushed before
        // this fetch are reduce-scattered (by the drain thread) before the unit is gathered.
        self.grads.wait_submitted()?;
        let whole = gathered::all_gather_unit(&self.ranks, &shard, numel, dtype)?;
        self.stats.gather_s += t.elapsed().as_secs_f64();
        self.stats.gathers += 1;
        self.stats.gather_bytes += (whole.len() - shard.len()) as u64;
        let tensor = tensor_from_bytes(&whole, dtype, numel, &self.compute_device)?;
        let in_use = self.gathered.insert(unit, tensor.clone(), bytes);
        Ok(UnitParams { tensor, unit, _pinned: None, _gathered: Some(in_use) })
    }

    /// Pins `unit`'s copy in the tiers (the shard with sharded parameters) on the device:
    /// [`Runtime::fetch_pinned`].
    fn pin_on_device(&mut self, unit: UnitId, phase: Phase, access: Access) -> Result<PinnedUnit> {
        if phase == Phase::Optimizer {
            return Err(RuntimeError::Usage("fetch(.., Phase::Optimizer): the optimizer does not fetch units".into()));
        }
        if self.units[unit.0].on_device.is_some() {
            return Err(RuntimeError::Usage(format!(
                "fetch_pinned({}): the unit's optimizer is on the device, which keeps its compute copy as a tensor; \
                 use fetch, or place its optimizer on the host first (place_optimizer)",
                self.units[unit.0].name
            )));
        }
        let span = tracing::info_span!("runtime::fetch", unit = unit.0, ?phase);
        let _e = span.enter();
        self.publish(unit)?;
        let t = Instant::now();
        let pin = self.residency.acquire(unit.tensor(), Tier::Device, access)?;
        self.stats.stall_transfer_s += t.elapsed().as_secs_f64();
        let mut recorder = None;
        if phase != Phase::Eval && self.units[unit.0].scheduling == Scheduling::Scheduled {
            let bytes = self.units[unit.0].home_bytes();
            self.recorder.lock().acquire(unit.tensor(), bytes, phase, Tier::Device, access == Access::Write);
            recorder = Some(Arc::clone(&self.recorder));
            self.issue_prefetches()?;
        }
        let u = &self.units[unit.0];
        Ok(PinnedUnit { pin, unit, numel: u.home_numel, dtype: u.dtype, access, recorder })
    }

    /// Takes the handles of the updates the drain thread submitted into the units' states.
    fn collect_handles(&mut self) {
        for (unit, handle) in self.grads.submitted() {
            self.units[unit.0].handle = Some(handle);
        }
    }

    /// Waits for `unit`'s pending update and has the optimizer publish its new compute copy
    /// into its home (the host copy, which drops the stale device copy); a deferred update
    /// wrote it there already.
    fn publish(&mut self, unit: UnitId) -> Result<()> {
        if self.units[unit.0].update != Update::StepFinished {
            // No update, or one pushed in the step still running: the copy in the tiers is the
            // one this step must use.
            return Ok(());
        }
        let t = Instant::now();
        self.grads.wait_submitted()?;
        self.grads.optimizer().publish(unit.tensor())?;
        self.units[unit.0].update = Update::Current;
        self.stats.stall_optimizer_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Publishes the compute copies of units whose update has finished, so the window can
    /// prefetch them; then lets the driver plan and issue the window's prefetches.
    fn issue_prefetches(&mut self) -> Result<()> {
        if self.driver.is_none() {
            return Ok(());
        }
        self.collect_handles();
        let ready: Vec<UnitId> =
            self.units.iter().enumerate().filter(|(_, u)| u.ready_to_publish()).map(|(k, _)| UnitId(k)).collect();
        for u in ready {
            self.publish(u)?;
        }
        let units = &self.units;
        let blocked = |id: TensorId| units.get(id.0 as usize).is_some_and(|u| u.update != Update::Current);
        let driver = self.driver.as_mut().expect("checked above");
        driver.after_acquire(&self.residency, &blocked)?;
        Ok(())
    }

    fn check_grads_len(&self, unit: UnitId, len: usize, call: &str) -> Result<()> {
        let u = &self.units[unit.0];
        if len != u.numel {
            return Err(RuntimeError::Usage(format!(
                "{call}({}): {len} gradients for a unit of {} parameters",
                u.name, u.numel
            )));
        }
        Ok(())
    }

    /// Hands `unit`'s gradients to the pipeline: `grads` holds `numel` elements in the unit's
    /// flat layout (any shape, flattened; f32, bf16 or f16 — converted to the compute dtype, rounded
    /// to nearest even, before the copy, so bf16 compute sends half of f32's bytes), on the
    /// compute device. They are written to a device staging buffer, copied D2H on the copy
    /// engine, and submitted to the CPU optimizer by a background thread. Returns as soon as the
    /// D2H copy is queued.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a length mismatch or a non-float tensor; candle failing to
    /// read it; a failure of an earlier submission.
    pub fn push_grads(&mut self, unit: UnitId, grads: &candle_core::Tensor) -> Result<()> {
        self.check_grads_len(unit, grads.elem_count(), "push_grads")?;
        swapper_dtype(grads.dtype())?;
        if self.units[unit.0].on_device.is_some() {
            return self.keep_device_grads(unit, grads);
        }
        self.push_to_device(unit, GradSource::Tensor(grads))
    }

    /// A unit with its optimizer on the device keeps its gradients there (f32, on the compute
    /// device) until [`Runtime::finish_step`] updates it.
    fn keep_device_grads(&mut self, unit: UnitId, grads: &candle_core::Tensor) -> Result<()> {
        let g = grads.flatten_all()?.to_device(&self.compute_device)?.to_dtype(candle_core::DType::F32)?;
        let u = &mut self.units[unit.0];
        let d = u.on_device.as_mut().expect("checked by the caller");
        if d.grads.is_some() {
            return Err(RuntimeError::Usage(format!("push_grads({}): a second push of the unit in one step", u.name)));
        }
        d.grads = Some(g);
        Ok(())
    }

    /// [`Runtime::push_grads`] from host memory (callers whose gradients are not candle tensors,
    /// such as the Python bindings): `grads` (`[numel]`, f32, bf16 or f16) are converted to the
    /// compute dtype if they are not in it; on the sim device they are copied to the device
    /// staging buffer and D2H as `push_grads` does (the link is what is simulated), on CUDA they
    /// are in host memory already and go to the optimizer directly.
    ///
    /// # Errors
    /// As [`Runtime::push_grads`].
    pub fn push_grads_slice(&mut self, unit: UnitId, grads: GradSlice<'_>) -> Result<()> {
        self.check_grads_len(unit, grads.len(), "push_grads_slice")?;
        if self.units[unit.0].on_device.is_some() {
            let g = Grads::converted(grads, DType::F32);
            let GradSlice::F32(values) = g.as_slice() else { unreachable!("converted to f32") };
            let t = candle_core::Tensor::from_slice(values, values.len(), &self.compute_device)?;
            return self.keep_device_grads(unit, &t);
        }
        let dtype = self.units[unit.0].dtype;
        if matches!(self.residency.device(), Device::Cuda(_)) {
            return self.submit_from_host(unit, || Ok(Grads::converted(grads, dtype)));
        }
        if grads.dtype() == dtype {
            return self.push_to_device(unit, GradSource::Bytes(grads.as_bytes()));
        }
        let converted = Grads::converted(grads, dtype);
        self.push_to_device(unit, GradSource::Bytes(converted.as_slice().as_bytes()))
    }

    fn push_to_device(&mut self, unit: UnitId, src: GradSource<'_>) -> Result<()> {
        self.grads.check()?;
        let dtype = self.units[unit.0].dtype;
        let stall_s = self.grads.push(unit, src, dtype, self.residency.device(), self.order)?;
        self.stats.stall_transfer_s += stall_s;
        self.units[unit.0].update = Update::Pushed;
        self.record_optimizer_write(unit);
        Ok(())
    }

    /// The optimizer will rewrite the unit's compute copy: its device copy is dead from here.
    fn record_optimizer_write(&self, unit: UnitId) {
        let u = &self.units[unit.0];
        if u.scheduling == Scheduling::Unscheduled {
            return;
        }
        let mut recorder = self.recorder.lock();
        recorder.acquire(unit.tensor(), u.home_bytes(), Phase::Optimizer, Tier::Host, true);
        recorder.release(unit.tensor(), Tier::Host);
    }

    /// Pins `unit`'s host copy and returns its parameters as a CPU tensor (`[numel]`, the
    /// compute dtype), for computing the unit on the CPU instead of fetching it (a cold MoE
    /// expert with few tokens, as Fiddler does). Waits for the unit's pending update first.
    /// Nothing moves H2D.
    ///
    /// # Errors
    /// Swapper errors (host budget, NVMe read), optimizer errors.
    pub fn fetch_host(&mut self, unit: UnitId) -> Result<UnitParams> {
        let _e = tracing::info_span!("runtime::fetch_host", unit = unit.0).entered();
        if let Some(d) = &self.units[unit.0].on_device {
            // The copy lives on the device: computing on the CPU needs it there.
            let tensor = d.copy.to_device(&candle_core::Device::Cpu)?;
            return Ok(UnitParams { tensor, unit, _pinned: None, _gathered: None });
        }
        if self.units[unit.0].gathers {
            return Err(RuntimeError::Usage(format!(
                "fetch_host({}): the parameters are sharded over the ranks (this rank's host copy is its shard); \
                 use fetch",
                self.units[unit.0].name
            )));
        }
        self.publish(unit)?;
        let pin = self.residency.acquire(unit.tensor(), Tier::Host, Access::Read)?;
        let (numel, dtype) = (self.units[unit.0].numel, self.units[unit.0].dtype);
        // A host copy computed on the CPU: CPU by nature.
        let tensor =
            tensor_from_bytes(&pin.host_bytes()[..dtype.num_bytes(numel)], dtype, numel, &candle_core::Device::Cpu)?;
        let pinned = PinnedUnit { pin, unit, numel, dtype, access: Access::Read, recorder: None };
        Ok(UnitParams { tensor, unit, _pinned: Some(pinned), _gathered: None })
    }

    /// Submits gradients computed on the CPU (after [`Runtime::fetch_host`]; `grads` `[numel]`
    /// on the CPU, converted to the compute dtype as in [`Runtime::push_grads`]) straight to the
    /// CPU optimizer: no device staging, no D2H.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a length mismatch; the host budget; optimizer errors.
    pub fn push_grads_host(&mut self, unit: UnitId, grads: &candle_core::Tensor) -> Result<()> {
        self.check_grads_len(unit, grads.elem_count(), "push_grads_host")?;
        swapper_dtype(grads.dtype())?;
        if self.units[unit.0].on_device.is_some() {
            return self.keep_device_grads(unit, grads);
        }
        let dtype = self.units[unit.0].dtype;
        self.submit_from_host(unit, || tensor_values(grads, dtype))
    }

    /// Submits `unit`'s gradients from host memory straight to the CPU optimizer (`make` builds
    /// them in the compute dtype once their bytes are claimed from the ledger): no staging, no
    /// copy over the link.
    fn submit_from_host(&mut self, unit: UnitId, make: impl FnOnce() -> Result<Grads>) -> Result<()> {
        self.grads.check()?;
        let (numel, dtype) = (self.units[unit.0].numel, self.units[unit.0].dtype);
        let handle = self.grads.submit_host(unit, dtype, numel, make)?;
        let u = &mut self.units[unit.0];
        u.handle = Some(handle);
        u.update = Update::Pushed;
        self.record_optimizer_write(unit);
        Ok(())
    }

    /// Ends the step: waits until every gradient is submitted, then for the optimizer's verdict
    /// (global norm, clip scale, non-finite skip). Updates may still be running; the next fetch
    /// of each unit waits for its own. With [`RuntimeConfig::overlap_optimizer`] false, the held
    /// gradients are submitted here (in arrival order) and every unit's update is awaited and
    /// published before this returns (the baseline's serial optimizer phase).
    ///
    /// # Errors
    /// A failure of a gradient copy or of the optimizer; with ranks, a failed collective
    /// ([`RuntimeError::Dist`], or the optimizer's [`oogc_optimizer::Error::NormReduce`]).
    pub fn finish_step(&mut self) -> Result<StepStats> {
        let t = Instant::now();
        self.grads.wait_submitted()?;
        for (unit, grads, claim) in self.grads.take_held() {
            let handle = self.grads.optimizer().submit_claimed(unit.tensor(), grads, claim)?;
            self.units[unit.0].handle = Some(handle);
        }
        self.collect_handles();
        let device_started = Instant::now();
        let device_failed = self.add_device_sumsqs()?;
        let mut device_update_s = device_started.elapsed().as_secs_f64();
        let report: StepReport = self.grads.optimizer().finish_step()?;
        if let Some(e) = device_failed {
            for d in self.units.iter_mut().filter_map(|u| u.on_device.as_mut()) {
                d.grads = None;
            }
            return Err(e);
        }
        let device_started = Instant::now();
        self.update_device_units(&report)?;
        device_update_s += device_started.elapsed().as_secs_f64();
        self.stats.device_update_s = device_update_s;
        for (k, u) in self.units.iter_mut().enumerate() {
            if u.update == Update::Pushed {
                u.update = Update::StepFinished;
                // Its gathered copy is the old parameters (on every rank: the same units were
                // pushed everywhere, skipped step or not).
                self.gathered.remove(UnitId(k));
            }
        }
        self.gathered.end_step();
        if self.ranks.world().size > 1 && !report.skipped {
            self.gather_updates()?;
        }
        self.stats.stall_optimizer_s += t.elapsed().as_secs_f64();
        if !self.config.overlap_optimizer {
            // `publish` adds its own wait to `stall_optimizer_s`.
            self.sync()?;
        }
        self.update_schedule()?;
        self.stats.grad_norm = report.grad_norm;
        self.stats.clip_scale = report.clip_scale;
        self.stats.device_units = self.units.iter().filter(|u| u.on_device.is_some()).count();
        self.stats.device_optimizer_bytes = self.device_optimizer_bytes;
        self.stats.skipped = report.skipped;
        let now = self.traffic();
        if let Some(begin) = self.metrics_at_begin.take() {
            self.stats.h2d_bytes = now.htod.bytes - begin.htod.bytes;
            self.stats.d2h_bytes = now.dtoh.bytes - begin.dtoh.bytes;
            self.stats.nvme_read_bytes = now.nvme_read.bytes - begin.nvme_read.bytes;
            self.stats.nvme_write_bytes = now.nvme_write.bytes - begin.nvme_write.bytes;
        }
        self.stats.step_s = self.step_started.take().map_or(0.0, |s| s.elapsed().as_secs_f64());
        self.stats.device_peak_bytes = self.residency.device().pool_peak_bytes()?;
        // A copy, free or reuse of a device buffer not ordered after the compute that used it
        // (the sim device's happens-before checker; on CUDA, an error the driver recorded).
        self.residency.device().check_ordering()?;
        Ok(self.stats.clone())
    }

    /// The units with their optimizer on the device add their gradients' sums of squares to the
    /// step's global norm (unit-id order, with the CPU optimizer's units). With immediate updates
    /// (no clipping, `nonfinite = "stop"`) a non-finite sum is not added: it is returned, the
    /// error [`Runtime::finish_step`] gives once the CPU optimizer's step is closed.
    fn add_device_sumsqs(&mut self) -> Result<Option<RuntimeError>> {
        let immediate = self.config.optimizer.updates_immediately();
        let mut failed = None;
        for (k, u) in self.units.iter().enumerate() {
            let Some(g) = u.on_device.as_ref().and_then(|d| d.grads.as_ref()) else { continue };
            let sumsq = device_optim::sumsq(g)?;
            if immediate && !sumsq.is_finite() {
                failed.get_or_insert(RuntimeError::Optimizer(oogc_optimizer::Error::NonFiniteGradient {
                    step: self.step,
                    unit: UnitId(k).tensor(),
                    sumsq,
                }));
                continue;
            }
            self.grads.optimizer().add_external_sumsq(UnitId(k).tensor(), sumsq)?;
        }
        Ok(failed)
    }

    /// After the step's decision: each unit with its optimizer on the device is updated there
    /// with the step's clip scale (not at all when the step was skipped), its compute copy
    /// rewritten; the gradients go.
    fn update_device_units(&mut self, report: &StepReport) -> Result<()> {
        if self.device_optimizer_bytes == 0 {
            return Ok(());
        }
        let c = self.config.optimizer.adam.scalars(self.step, self.lr, report.clip_scale)?.element_constants();
        for u in &mut self.units {
            let Some(d) = u.on_device.as_mut() else { continue };
            if report.skipped {
                d.grads = None;
            } else {
                d.update(&c, candle_dtype(u.dtype)?)?;
            }
        }
        Ok(())
    }

    /// Where `unit`'s optimizer lives.
    pub fn optimizer_place(&self, unit: UnitId) -> OptimizerPlace {
        if self.units[unit.0].on_device.is_some() {
            OptimizerPlace::Device
        } else {
            OptimizerPlace::Host
        }
    }

    /// GPU bytes held by device optimizers now ([`device_optimizer_bytes`] per unit placed
    /// there), carved out of the residency manager's device budget.
    pub fn device_optimizer_bytes(&self) -> u64 {
        self.device_optimizer_bytes
    }

    /// The residency manager's device budget without device optimizers: the GPU budget less
    /// gradient staging, activation staging and (on CUDA) candle's copies of the units in use
    /// (0 before [`Runtime::check_working_set`]).
    pub fn compute_budget_bytes(&self) -> u64 {
        self.device_budget_base
    }

    /// GPU bytes a device optimizer could still take: the device budget less the minimum
    /// working set and the device optimizers placed already.
    pub fn device_optimizer_room(&mut self) -> Result<u64> {
        self.check_working_set()?;
        let floor = self.largest_units_bytes(self.max_units_in_use);
        Ok(self.device_budget_base.saturating_sub(floor).saturating_sub(self.device_optimizer_bytes))
    }

    /// Moves `unit`'s optimizer (fp32 master weights, Adam `m` and `v`) to `place`, between
    /// steps: to the device, the state goes H2D over the link from the CPU optimizer's tier and
    /// the compute copy is made there; from then the unit's fetches move nothing, its gradients
    /// stay on the device and [`Runtime::finish_step`] updates it there after the step's
    /// decision. Back to the host, the state goes D2H into the CPU optimizer (which rewrites the
    /// compute copy's home from it). The state is not changed by the move (bitwise). Its GPU
    /// bytes ([`device_optimizer_bytes`]) are carved out of the residency manager's budget
    /// (evicting other copies if needed). Returns the bytes moved over the link.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] during a step, with data-parallel ranks (their optimizer holds a
    /// shard), or when the GPU budget has no room for it beyond the minimum working set (the
    /// message gives the bytes and the fix); swapper, optimizer or candle errors moving state.
    pub fn place_optimizer(&mut self, unit: UnitId, place: OptimizerPlace) -> Result<u64> {
        if self.optimizer_place(unit) == place {
            return Ok(0);
        }
        let name = self.units[unit.0].name.clone();
        if self.ranks.world().size > 1 {
            return Err(RuntimeError::Usage(format!(
                "place_optimizer({name}): device optimizers with data-parallel ranks are not supported (each rank's \
                 optimizer holds a shard); keep [optimizer] device_units = 0 and [moe] device_optimizer = false"
            )));
        }
        if self.step_started.is_some() || self.units[unit.0].update == Update::Pushed {
            return Err(RuntimeError::Usage(format!("place_optimizer({name}) during a step: call it between steps")));
        }
        self.check_working_set()?;
        self.publish(unit)?;
        let (numel, dtype) = (self.units[unit.0].numel, self.units[unit.0].dtype);
        let bytes = device_optimizer_bytes(numel, dtype);
        match place {
            OptimizerPlace::Device => {
                let room = self.device_optimizer_room()?;
                if bytes > room {
                    return Err(RuntimeError::Usage(format!(
                        "place_optimizer({name}): its device optimizer needs {bytes} GPU bytes (16 B per parameter + \
                         the compute copy), the GPU budget has {room} bytes beyond the minimum working set and the \
                         device optimizers placed already\n  fix: raise [budgets] gpu, or lower [optimizer] \
                         device_units / [moe] expert_budget"
                    )));
                }
                self.device_optimizer_bytes += bytes;
                self.residency.set_device_budget_bytes(self.device_budget_base - self.device_optimizer_bytes)?;
                let state = self.grads.optimizer().export_state(unit.tensor())?;
                let (master, m, v) =
                    (self.upload_f32(&state.master)?, self.upload_f32(&state.m)?, self.upload_f32(&state.v)?);
                let copy = master.to_dtype(candle_dtype(dtype)?)?;
                self.units[unit.0].on_device =
                    Some(Box::new(device_optim::DeviceState { master, m, v, copy, grads: None }));
                tracing::debug!(unit = unit.0, bytes, "runtime: optimizer placed on the device");
                Ok(12 * numel as u64)
            }
            OptimizerPlace::Host => {
                let d = self.units[unit.0].on_device.take().expect("placed on the device");
                let state = oogc_optimizer::UnitState {
                    master: self.download_f32(&d.master)?,
                    m: self.download_f32(&d.m)?,
                    v: self.download_f32(&d.v)?,
                };
                drop(d);
                self.grads.optimizer().import_state(unit.tensor(), state)?;
                self.device_optimizer_bytes -= bytes;
                self.residency.set_device_budget_bytes(self.device_budget_base - self.device_optimizer_bytes)?;
                tracing::debug!(unit = unit.0, bytes, "runtime: optimizer placed on the host");
                Ok(12 * numel as u64)
            }
        }
    }

    /// Bytes of one H2D/D2H piece of a state move: the gradient landing pool's buffers serve
    /// them (at least the largest unit's compute copy), whole f32 elements.
    fn state_chunk_bytes(&self) -> usize {
        (self.largest_units_bytes(1) as usize / 4).max(1) * 4
    }

    /// `values` H2D over the link (pieces through the landing pool and a device buffer), as an
    /// f32 tensor `[len]` on the compute device. No host wait: compute waits for each piece's
    /// copy event; the landing buffers go back to the pool once their copies are complete.
    fn upload_f32(&self, values: &[f32]) -> Result<candle_core::Tensor> {
        let device = self.residency.device();
        let mut parts = Vec::new();
        let mut in_flight = Vec::new();
        for piece in bytemuck::cast_slice::<f32, u8>(values).chunks(self.state_chunk_bytes()) {
            let mut host = self.grads.landing_buffer(piece.len())?;
            host.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            let dev = self.order.alloc(device, piece.len())?;
            let (transfer, copied) = self.order.htod_fresh(device, host, dev)?;
            let (dev, host) = transfer.release_device()?;
            in_flight.push(host);
            self.order.compute_waits(device, OrderingCall::StateUploadComputeWaits, &copied)?;
            parts.push(device_tensor(&dev, piece.len() / 4, DType::F32, &self.compute_device)?);
            self.order.free_after_use(device, OrderingCall::StateUploadFreeAfterRead, dev)?;
        }
        // Between steps: the host buffers go back to the pool here (their copies finish while
        // compute concatenates the pieces).
        let tensor = if parts.is_empty() {
            candle_core::Tensor::zeros(0, candle_core::DType::F32, &self.compute_device)?
        } else {
            candle_core::Tensor::cat(&parts, 0)?
        };
        for host in in_flight {
            drop(host.wait()?);
        }
        Ok(tensor)
    }

    /// An f32 tensor on the compute device D2H over the link (pieces through a device buffer
    /// and the landing pool), as host values.
    fn download_f32(&self, t: &candle_core::Tensor) -> Result<Vec<f32>> {
        let device = self.residency.device();
        let flat = t.flatten_all()?;
        let n = flat.elem_count();
        let per = self.state_chunk_bytes() / 4;
        let mut out = Vec::with_capacity(n);
        let mut start = 0;
        while start < n {
            let len = per.min(n - start);
            let mut dev = self.order.alloc_for_compute(device, OrderingCall::StateDownloadAlloc, len * 4)?;
            tensor::write_to_device(&flat.narrow(0, start, len)?, DType::F32, &mut dev, device)?;
            let host = self.grads.landing_buffer(len * 4)?;
            let transfer = self.order.dtoh_after_write(device, OrderingCall::StateDownloadDtohAfterWrite, dev, host)?;
            // The host needs the bytes: it waits for this copy (a D2H, between steps).
            let (host, dev) = transfer.wait()?;
            out.extend(bytemuck::pod_collect_to_vec::<u8, f32>(&host.as_slice()[..len * 4]));
            self.order.free_after_use(device, OrderingCall::StateDownloadFreeAfterWrite, dev)?;
            start += len;
        }
        Ok(out)
    }

    /// Data-parallel ranks: every unit updated this step gets its new compute copy from all
    /// ranks' shards (each rank's optimizer updated its own), in unit order on every rank, and
    /// is current from here (its fetches publish nothing). Waits for the updates.
    fn gather_updates(&mut self) -> Result<()> {
        let optimizer = self.grads.optimizer();
        for (k, u) in self.units.iter_mut().enumerate() {
            // A sharded unit's copy is gathered at its fetch instead.
            if u.update != Update::StepFinished || u.gathers {
                continue;
            }
            let unit = UnitId(k).tensor();
            optimizer.publish(unit)?;
            let mut shard = Vec::new();
            optimizer.read_compute_copy(unit, |bytes| shard = bytes.to_vec())?;
            let full = gathered::all_gather_unit(&self.ranks, &shard, u.numel, u.dtype)?;
            home::overwrite_host_copy(&self.residency, unit, &mut |b| b[..full.len()].copy_from_slice(&full))?;
            u.update = Update::Current;
        }
        Ok(())
    }

    /// The step's trace becomes the schedule when it differs from the one in force: the policy
    /// switches to next-use (Belady) over it and the prefetch window starts.
    fn update_schedule(&mut self) -> Result<()> {
        let recorder = std::mem::take(&mut *self.recorder.lock());
        if recorder.is_empty() {
            return Ok(());
        }
        let trace = recorder.finish()?;
        if self.schedule.as_ref().is_some_and(|s| s.same_accesses(&trace)) {
            return Ok(());
        }
        let schedule = Arc::new(trace);
        check_budget(&schedule, self.residency.budget_bytes(Tier::Device))?;
        match &self.cursor {
            Some(cursor) => cursor.set_schedule(schedule.clone()),
            None => {
                let mut policy = NextUsePolicy::new(schedule.clone());
                if let Some(fallback) = self.fallback.take() {
                    policy = policy.with_fallback(fallback);
                }
                let cursor = policy.cursor();
                self.residency.set_policy(Box::new(policy));
                if self.config.prefetch_depth > 0 {
                    let config = PrefetchConfig { max_depth: self.config.prefetch_depth, ..PrefetchConfig::default() };
                    let host_depth = match self.config.params_placement {
                        StatePlacement::Nvme => self.config.host_prefetch_depth,
                        StatePlacement::Host => 0,
                    };
                    let driver = PrefetchDriver::new(&self.residency, cursor.clone(), config)?;
                    self.driver = Some(driver.with_host_depth(host_depth)?);
                }
                self.cursor = Some(cursor);
            }
        }
        tracing::debug!(accesses = schedule.entries().len(), "runtime: new schedule");
        self.schedule = Some(schedule);
        Ok(())
    }

    /// The schedule in force (recorded from the last step whose accesses changed).
    pub fn schedule(&self) -> Option<&Schedule> {
        self.schedule.as_deref()
    }

    /// Waits for every pending update and publishes the compute copies (before a checkpoint or
    /// an evaluation that must see the latest parameters).
    ///
    /// # Errors
    /// As [`Runtime::fetch`].
    pub fn sync(&mut self) -> Result<()> {
        for u in 0..self.units.len() {
            self.publish(UnitId(u))?;
        }
        Ok(())
    }

    /// Bytes on the NVMe store now: optimizer state and compute copies placed there (0 without
    /// a store).
    pub fn optimizer_nvme_bytes(&self) -> u64 {
        self.nvme.as_ref().map_or(0, |s| s.used_bytes())
    }

    /// The unit's fp32 master weights, Adam `m` and `v` (each `[numel]`). Call [`Runtime::sync`]
    /// first to see the latest update. With data-parallel ranks each holds a shard: the three are
    /// all-gathered (a collective: every rank calls this for the same units in the same order).
    ///
    /// # Errors
    /// Optimizer failures (NVMe read); with ranks, a failed all-gather ([`RuntimeError::Dist`]).
    pub fn unit_state(&self, unit: UnitId) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        if let Some(d) = &self.units[unit.0].on_device {
            // The device optimizer's state (a checkpoint's read, not counted as link traffic).
            return Ok((d.master.to_vec1()?, d.m.to_vec1()?, d.v.to_vec1()?));
        }
        let s = self.grads.optimizer().export_state(unit.tensor())?;
        if self.ranks.world().size == 1 {
            return Ok((s.master, s.m, s.v));
        }
        let numel = self.units[unit.0].numel;
        let gather = |shard: Vec<f32>| -> Result<Vec<f32>> {
            let whole = self.ranks.all_gather_shards(bytemuck::cast_slice(&shard), numel, 4)?;
            Ok(bytemuck::pod_collect_to_vec(&whole))
        };
        Ok((gather(s.master)?, gather(s.m)?, gather(s.v)?))
    }

    /// Replaces the unit's master weights and Adam state (a checkpoint being restored) and its
    /// compute copy.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a length mismatch; optimizer or swapper failures.
    pub fn load_unit_state(&mut self, unit: UnitId, master: Vec<f32>, m: Vec<f32>, v: Vec<f32>) -> Result<()> {
        let numel = self.units[unit.0].numel;
        if master.len() != numel || m.len() != numel || v.len() != numel {
            return Err(RuntimeError::Usage(format!(
                "load_unit_state({}): lengths differ from {numel}",
                self.units[unit.0].name
            )));
        }
        self.publish(unit)?;
        let copy_dtype = candle_dtype(self.units[unit.0].dtype)?;
        if let Some(d) = self.units[unit.0].on_device.as_mut() {
            // Restored where the optimizer lives: on the device.
            let dev = &self.compute_device;
            d.master = candle_core::Tensor::from_vec(master, numel, dev)?;
            d.m = candle_core::Tensor::from_vec(m, numel, dev)?;
            d.v = candle_core::Tensor::from_vec(v, numel, dev)?;
            d.copy = d.master.to_dtype(copy_dtype)?;
            d.grads = None;
            return Ok(());
        }
        self.gathered.remove(unit);
        let world = self.ranks.world();
        if world.size > 1 {
            // This rank's shard to its optimizer (a checkpoint of any world size re-shards), which
            // writes the compute copy's shard into the tiers when they hold shards; else the
            // whole compute copy to the residency manager.
            if !self.units[unit.0].gathers {
                let copy = oogc_optimizer::compute_copy(&master, self.units[unit.0].dtype);
                home::overwrite_host_copy(&self.residency, unit.tensor(), &mut |b| {
                    b[..copy.len()].copy_from_slice(&copy)
                })?;
            }
            let r = crate::dist::shard_range(numel, world.rank, world.size);
            let state = oogc_optimizer::UnitState {
                master: master[r.clone()].to_vec(),
                m: m[r.clone()].to_vec(),
                v: v[r].to_vec(),
            };
            self.grads.optimizer().import_state(unit.tensor(), state)?;
            return Ok(());
        }
        // The optimizer writes the compute copy into its home (the host copy) from `master`.
        self.grads.optimizer().import_state(unit.tensor(), oogc_optimizer::UnitState { master, m, v })?;
        Ok(())
    }

    /// Traffic counters since the runtime began: the device's H2D/D2H links, every copy on them
    /// (fetches, write-backs, gradients, activation checkpoints; on CUDA, busy time from events
    /// around each copy on the copy stream), and the NVMe reads and writes of the store
    /// (optimizer state and compute copies).
    pub fn traffic(&self) -> oogc_swapper::MetricsSnapshot {
        let mut m = self.residency.metrics();
        // The device counts every copy it made; the residency manager only its own.
        let (h2d, d2h) = self.residency.device().link_stats();
        m.htod = h2d.snapshot();
        m.dtoh = d2h.snapshot();
        if let Some(store) = &self.nvme {
            let (read, write) = store.link_stats();
            let (read, write) = (read.snapshot(), write.snapshot());
            // The store counts every request on it: the optimizer's streams and the residency
            // manager's compute copies alike.
            m.nvme_read.bytes = read.bytes;
            m.nvme_read.busy_s = read.busy_s;
            m.nvme_write.bytes = write.bytes;
            m.nvme_write.busy_s = write.busy_s;
        }
        m
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(d) = self.driver.as_mut() {
            let _ = d.wait_all();
        }
        // The staging buffers are freed after the compute that last used them (a checkpoint
        // read back, a gradient written): the copy stream, which frees them, waits for it.
        let _ = self.order.copies_wait_for_compute(self.residency.device());
    }
}

/// Bytes of the `k` (at least 1) largest of `sizes` together.
fn largest_bytes(sizes: impl Iterator<Item = u64>, k: usize) -> u64 {
    let mut sizes: Vec<u64> = sizes.collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.iter().take(k.max(1)).sum()
}
