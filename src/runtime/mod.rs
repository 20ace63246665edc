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
//! `host_budget_bytes` ([`Memory::host_ledger`]): the residency manager's host tier (compute
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

//!
//! **The house.** [`Runtime`] is a façade over parts with one job each: the unit table
//! ([`Units`], `runtime/unit.rs`: each unit a `unit::Kind` — tiered, gathered, unscheduled or
//! device-resident — that owns how it is fetched, how its gradients leave and how its update is
//! committed), the step clock and its stats (`runtime/stats.rs`), the schedule and prefetch
//! window (`runtime/schedule.rs`), the tiers and the carved budgets (`runtime/memory.rs`), the
//! gradient pipe (`runtime/grads.rs`) and the activation pipe (`runtime/activations.rs`). Its
//! calls live by what they do: `runtime/fetch.rs` (fetch, publish), `runtime/push.rs`
//! (gradients), `runtime/step.rs` (begin, check the working set, finish), `runtime/state.rs`
//! (checkpoint state) and `runtime/device_optim.rs` (placing a unit's optimizer). A unit's
//! update is committed in one place: a finished update is published into the unit's home at
//! the unit's next fetch (`Runtime::publish`), or at [`Runtime::sync`]; with ranks, a whole
//! unit's new copy is all-gathered at the step's end.

use std::sync::Arc;

use oogc_optimizer::PipelinedOptimizer;
use oogc_swapper::{
    DType, Device, HostLedger, HostUse, NvmeStore, PinnedPool, ResidencyConfig, ResidencyManager, SimDevice,
    SimDeviceConfig, StatePlacement, TensorId, TensorMeta, Tier,
};

mod activations;
pub mod budget;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_dummy.rs"]
mod cuda;
mod device_moments;
mod device_optim;
pub mod device_plan;
mod error;
mod fetch;
mod gathered;
mod grads;
mod home;
mod memory;
mod ordering;
mod process;
mod push;
mod schedule;
mod state;
mod stats;
mod step;
pub mod tensor;
mod unit;

pub use activations::{ActivationId, Activations};
pub use budget::{rank_units, HostPlan, NvmePlan};
pub use config::{ActivationOffload, DeviceSpec, RuntimeConfig};
pub use device_moments::moment_codec_excess;
pub use device_optim::{adam_fixture_excess, adam_step_tensors, device_optimizer_bytes, OptimizerPlace};
pub use error::{Result, RuntimeError};
pub use memory::Memory;
pub use oogc_prefetch::Phase;
pub use ordering::OrderingCall;
pub(crate) use state::UnitSnapshot;
pub use stats::{PeakBytes, PhaseStats, StepFigures, StepStats};
pub use unit::{DeviceMemory, PinnedUnit, UnitParams, Units};

use activations::ActivationPipe;
use grads::{GradPipe, STAGING_BUFFERS};
use home::ResidencyHome;
use memory::{Carve, Tiers};
use ordering::{Order, OrderingCall as Call};
use schedule::Scheduler;
use stats::StepClock;
use unit::{Kind, Unit};

/// Device bytes a runtime carves out of the GPU budget for staging before the residency manager
/// gets the rest: gradient staging (the largest unit's compute-copy bytes, `largest_unit_bytes`,
/// per buffer) and, with `activation_offload`, its staging buffers of the largest checkpoint.
/// On CUDA candle's copies of the units in use come off too (the runtime knows its device).
pub fn staging_bytes(largest_unit_bytes: u64, activation_offload: Option<ActivationOffload>) -> u64 {
    STAGING_BUFFERS as u64 * largest_unit_bytes
        + activation_offload.map_or(0, |a| (activations::STAGING * a.checkpoint_bytes) as u64)
}

/// A unit handle, made only by its runtime ([`Runtime::add_unit`], [`Units::ids`], [`Units::id`]):
/// a caller maps its own indices (a model's unit index, a Python integer) to these through a
/// table of its own or [`Units::id`], never by a cast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitId(usize);

impl UnitId {
    /// Its registration index (0-based): for a caller's own tables and messages.
    pub fn index(self) -> usize {
        self.0
    }

    /// The swapper tensor of the unit's compute copy and the optimizer's key for it — the one
    /// mapping (tensors are numbered as units are), with its inverse [`UnitId::of_tensor`].
    fn tensor(self) -> TensorId {
        TensorId(self.0 as u64)
    }

    /// The unit whose compute copy is swapper tensor `tensor` (not checked against a table).
    fn of_tensor(tensor: TensorId) -> Option<Self> {
        usize::try_from(tensor.0).ok().map(Self)
    }
}

/// The out-of-GPU-core runtime for one model on one device. See the module docs.
pub struct Runtime {
    /// The run's ranks: with more than one, the optimizer holds this rank's shard of every
    /// unit ([`crate::dist::shard_range`]).
    ranks: crate::dist::Ranks,
    config: RuntimeConfig,
    /// The compute device, the residency manager's tiers, the NVMe store, the host ledger.
    tiers: Tiers,
    /// The gradient pipe and, behind it, the pipelined CPU optimizer.
    grads: GradPipe,
    /// The units, each of its kind.
    units: Units,
    /// The trace, the schedule in force, the eviction policy's cursor and the prefetch window.
    scheduler: Scheduler,
    /// The open step and its stats.
    clock: StepClock,
    /// The budgets as carved at the first step.
    carve: Carve,
    /// Offloaded activation checkpoints (`RuntimeConfig::activation_offload`).
    activations: ActivationPipe,
    /// Units gathered from the ranks' shards, kept for their next use (sharded only).
    gathered: gathered::Gathered,
    /// With sharded compute copies ([`RuntimeConfig::shard_parameters`] and more than one
    /// rank), the optimizer's compute-copy home (which routes the units kept whole).
    rank_home: Option<Arc<home::RankHome>>,
    /// The units the caller announced it fetches next ([`Memory::will_fetch`]): the first fetch
    /// of one of them loads their device copies in one batched H2D.
    fetch_set: std::sync::Mutex<Vec<UnitId>>,
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
                compute_waits_for_fetch: !order.drops(Call::FetchComputeWaits),
                ..ResidencyConfig::default()
            },
            Box::new(oogc_swapper::LruPolicy),
        )?);
        // Data-parallel ranks shard the optimizer (ZeRO-style): this rank's optimizer holds its
        // shard of every unit's master weights and Adam state, in any state format (a shard
        // starts on an int8 block; bf16 masters round by their index in the unit). Without
        // sharded parameters it writes its shard's compute copy into a home of its own and
        // `finish_step` all-gathers the shards into the residency manager's whole copies. The
        // norm it clips with is the run's.
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
        let pool = |use_: HostUse| {
            PinnedPool::with_ledger(
                &oogc_swapper::PinnedPoolConfig {
                    budget_bytes: config.host_budget_bytes,
                    lock: config.lock_host_memory,
                },
                host_allocator.clone(),
                ledger.clone(),
                use_,
            )
        };
        let activations = ActivationPipe::new(pool(HostUse::Activations));
        let grads = GradPipe::new(
            optimizer,
            ranks.clone(),
            pool(HostUse::Gradients),
            ledger.clone(),
            !config.overlap_optimizer,
        );
        Ok(Self {
            ranks,
            activations,
            scheduler: Scheduler::new(config.prefetch_depth, config.host_prefetch_depth, config.params_placement),
            config,
            tiers: Tiers { compute_device, residency, nvme, ledger, order },
            grads,
            units: Units::new(),
            clock: StepClock::default(),
            carve: Carve::default(),
            rank_home,
            fetch_set: std::sync::Mutex::new(Vec::new()),
            gathered: gathered::Gathered::new(),
        })
    }

    /// Registers a unit: `master` is its flat fp32 parameter vector (`[numel]`); the compute
    /// copy (in the compute dtype, rounded to nearest even as the optimizer writes it) gets its
    /// home in pinned host memory (or on NVMe, written there now, with
    /// [`RuntimeConfig::params_placement`]) and the master weights and Adam state go to the
    /// optimizer's tier. Units are numbered in registration order.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] after the first step began; swapper or optimizer errors (host
    /// budget, NVMe full).
    pub fn add_unit(&mut self, name: &str, master: &[f32]) -> Result<UnitId> {
        self.add_unit_as(name, master, false)
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
        self.add_unit_as(name, master, true)
    }

    fn add_unit_as(&mut self, name: &str, master: &[f32], unscheduled: bool) -> Result<UnitId> {
        if self.carve.checked {
            return Err(RuntimeError::Usage(format!("add_unit({name}) after the first step began")));
        }
        let unit = self.units.next_id();
        let tensor = unit.tensor();
        let home = self.config.params_placement.tier();
        let dtype = self.compute_dtype();
        let world = self.ranks.world();
        let shard = crate::dist::shard_range(master.len(), world.rank, world.size);
        // Sharded parameters: the tiers hold this rank's shard of a scheduled unit's compute copy;
        // a unit too small to give every rank a block stays whole (gathered at the step's end).
        let kind = match (self.sharded(), unscheduled) {
            (true, false) if crate::dist::every_rank_holds(master.len(), world.size) => Kind::Gathered,
            (_, false) => Kind::Tiered,
            (_, true) => Kind::Unscheduled,
        };
        let gathers = matches!(kind, Kind::Gathered);
        let kept = if gathers { shard.clone() } else { 0..master.len() };
        if let (Some(home), false) = (&self.rank_home, gathers) {
            home.keep_whole(tensor);
        }
        let meta = TensorMeta::new(tensor, name, &[kept.len()], dtype, home);
        let residency = &self.tiers.residency;
        residency.register(meta, &oogc_optimizer::compute_copy(&master[kept.clone()], dtype))?;
        if home == Tier::Nvme {
            // A cold start: the copy is on NVMe; the host tier fills as the schedule needs it.
            residency.drop_host_copy(tensor)?;
            residency.host_pool().trim();
        }
        self.grads.optimizer().add_shard(tensor, &master[shard.clone()], shard.start, self.config.state_placement)?;
        // Gradients land in buffers of the largest unit's size (the plan's two): reused by every
        // unit's D2H instead of one size class giving way to another every step.
        self.grads.raise_landing_len(dtype.num_bytes(master.len()));
        Ok(self.units.push(Unit::new(name, master.len(), kept.len(), dtype, kind)))
    }

    /// Declares how many units the caller pins at once (default 1; 2 for a tied LM head, which
    /// uses the embedding unit beside its own). Enters the minimum working set.
    pub fn set_max_units_in_use(&mut self, units: usize) {
        self.units.set_max_in_use(units);
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
        let u = self.units.get_mut(unit);
        match &mut u.kind {
            Kind::Gathered => {
                return Err(RuntimeError::Usage(format!(
                    "set_unscheduled({}): its compute copy is sharded over the ranks and all-gathered at each fetch, \
                     which every rank must make at the same point; register it with add_unscheduled_unit, which \
                     keeps it whole on every rank",
                    u.name
                )))
            }
            Kind::Device { off, .. } => *off = unit::OffDevice::Unscheduled,
            Kind::Tiered | Kind::Unscheduled => u.kind = Kind::Unscheduled,
        }
        Ok(())
    }

    /// The policy that ranks unscheduled units (default LRU) once the next-use policy is
    /// installed after the first step, e.g. MoE expert popularity from `oogc-moe-placement`.
    /// It sees units as the swapper tensors of [`Units::tensor`].
    pub fn set_fallback_policy(&mut self, policy: Box<dyn oogc_swapper::EvictionPolicy>) {
        self.scheduler.set_fallback(policy);
    }

    /// The registered units (names, sizes, swapper tensors, optimizer places), read-only.
    pub fn units(&self) -> &Units {
        &self.units
    }

    /// What the runtime holds and moved, read-only: peaks, the host ledger and plan, the carved
    /// budgets, traffic.
    pub fn memory(&self) -> Memory<'_> {
        Memory { rt: self }
    }

    /// The activation offload ([`RuntimeConfig::activation_offload`]): stash, prefetch and take
    /// checkpoints.
    pub fn activations(&mut self) -> Activations<'_> {
        Activations { rt: self }
    }

    /// candle's device the units' tensors live on ([`UnitParams::tensor`]): the CPU for the
    /// sim device, the GPU for CUDA. Build inputs (token ids) there.
    pub fn compute_device(&self) -> &candle_core::Device {
        &self.tiers.compute_device
    }

    /// The compute copies' and gradients' element type (f32, bf16 or f16): what
    /// [`UnitParams::tensor`] holds and what [`Runtime::push_grads`] sends over the link.
    pub fn compute_dtype(&self) -> DType {
        self.config.optimizer.compute_dtype
    }

    /// Whether the tiers hold shards of the compute copies ([`RuntimeConfig::shard_parameters`]
    /// with more than one rank).
    fn sharded(&self) -> bool {
        self.rank_home.is_some()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.scheduler.wait_all();
        // The staging buffers are freed after the compute that last used them (a checkpoint
        // read back, a gradient written): the copy stream, which frees them, waits for it.
        let _ = self.tiers.order.copies_wait_for_compute(self.tiers.device());
    }
}
