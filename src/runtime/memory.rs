//! The memory parts of a runtime: the [`Tiers`] (the compute device, the residency manager over
//! the device, host and NVMe tiers, the one host ledger, the ordering calls), the [`Carve`] of the
//! budgets (the GPU budget split into staging, units in use, gathered units, device optimizers
//! and the residency manager's share; the host plan applied), and [`Memory`], the read-only view
//! a caller gets of both ([`Runtime::memory`]).

use std::sync::Arc;

use oogc_swapper::{Device, HostLedger, MetricsSnapshot, NvmeStore, ResidencyManager, Tier};

use super::budget::{self, HostPlan, NvmePlan};
use super::ordering::Order;
use super::unit::{Kind, Update};
use super::{staging_bytes, PeakBytes, Result, Runtime, UnitId};

/// Where the units' bytes live and move.
pub(super) struct Tiers {
    /// candle's device for the units' tensors (the CPU for the sim device).
    pub(super) compute_device: candle_core::Device,
    /// The device, host and NVMe tiers of the compute copies.
    pub(super) residency: Arc<ResidencyManager>,
    /// The NVMe store of the optimizer state and/or the parameters (shared by the optimizer and
    /// the residency manager).
    pub(super) nvme: Option<Arc<NvmeStore>>,
    /// The one host budget every host allocation is claimed from.
    pub(super) ledger: Arc<HostLedger>,
    /// The ordering calls between compute and the copy stream (`runtime/ordering.rs`), one of
    /// which the test hook may leave out.
    pub(super) order: Order,
}

impl Tiers {
    /// The device (sim or CUDA) the residency manager copies to and from.
    pub(super) fn device(&self) -> &Device {
        self.residency.device()
    }

    /// Traffic counters since the runtime began: the device's links (every copy on them) and
    /// the NVMe store's reads and writes (every request on it).
    pub(super) fn traffic(&self) -> MetricsSnapshot {
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

    /// Bytes on the NVMe store now (0 without one).
    pub(super) fn nvme_bytes(&self) -> u64 {
        self.nvme.as_ref().map_or(0, |s| s.used_bytes())
    }
}

/// The budgets as carved at the first step ([`Runtime::check_working_set`]).
#[derive(Debug, Default)]
pub(super) struct Carve {
    /// Whether the working set was checked and the budgets carved (no unit may be added after).
    pub(super) checked: bool,
    /// The residency manager's device budget without device optimizers; theirs is carved out
    /// of it.
    pub(super) base: u64,
    /// GPU bytes of the units whose optimizer is on the device
    /// ([`super::device_optimizer_bytes`] each).
    pub(super) device_optimizers: u64,
    /// The split of the host budget, applied before the first step.
    pub(super) host_plan: Option<HostPlan>,
}

impl Carve {
    /// The residency manager's device budget now: the base less the device optimizers.
    pub(super) fn residency_bytes(&self) -> u64 {
        self.base - self.device_optimizers
    }
}

/// What a runtime holds and moved, read-only ([`Runtime::memory`]): peaks, the host ledger and
/// plan, the carved budgets, traffic, and the device's ordering check.
pub struct Memory<'a> {
    pub(super) rt: &'a Runtime,
}

impl<'a> Memory<'a> {
    /// Peak bytes held on the device and in pinned host memory since the runtime began, and the
    /// NVMe bytes in use now.
    pub fn peak_bytes(&self) -> PeakBytes {
        let tiers = &self.rt.tiers;
        PeakBytes {
            device: tiers.residency.peak_bytes(Tier::Device),
            host: tiers.residency.peak_bytes(Tier::Host),
            nvme: tiers.nvme_bytes(),
            host_ledger: tiers.ledger.peak_bytes(),
        }
    }

    /// The host ledger: every host byte the runtime holds, by category, with peaks. The hook for
    /// host-kept activations ([`oogc_swapper::HostUse::Activations`]).
    pub fn host_ledger(&self) -> &'a Arc<HostLedger> {
        &self.rt.tiers.ledger
    }

    /// The split of the host budget in force (from the first step on).
    pub fn host_plan(&self) -> Option<&'a HostPlan> {
        self.rt.carve.host_plan.as_ref()
    }

    /// The plan of the host budget for the units added so far (what the first
    /// [`Runtime::begin_step`] applies).
    pub fn plan_host(&self) -> HostPlan {
        self.rt.plan_host()
    }

    /// Bytes the device must hold at once: the `max_units_in_use` largest units' copies in the
    /// tiers (with sharded parameters, this rank's shards of them, and the whole units gathered
    /// beside) plus gradient staging (buffers of the largest unit's gradients).
    pub fn min_working_set_bytes(&self, max_units_in_use: usize) -> u64 {
        self.rt.min_working_set_bytes(max_units_in_use)
    }

    /// GPU bytes held by device optimizers now ([`super::device_optimizer_bytes`] per unit
    /// placed there), carved out of the residency manager's device budget.
    pub fn device_optimizer_bytes(&self) -> u64 {
        self.rt.carve.device_optimizers
    }

    /// GPU bytes `unit`'s device optimizer holds, measured on its tensors: master weights,
    /// moments (in their stored dtype, absmaxes included) and compute copy, plus the step's f32
    /// gradients (4 B per parameter, held from its `push_grads` to the update). What
    /// [`super::device_optimizer_bytes`] counts for it; `None` when its optimizer is on the host.
    pub fn device_optimizer_held_bytes(&self, unit: UnitId) -> Option<u64> {
        let u = self.rt.units.get(unit);
        u.device().map(|d| d.bytes() + 4 * u.numel as u64)
    }

    /// The residency manager's device budget without device optimizers: the GPU budget less
    /// gradient staging, activation staging and (on CUDA) candle's copies of the units in use
    /// (0 before [`Runtime::check_working_set`]).
    pub fn compute_budget_bytes(&self) -> u64 {
        self.rt.carve.base
    }

    /// With sharded parameters ([`super::RuntimeConfig::shard_parameters`] and ranks), the GPU
    /// bytes set aside for units all-gathered from the ranks' shards (the units in use, and
    /// those kept for their next use), out of the GPU budget; known from the first step on (0
    /// before, and without sharding).
    pub fn gathered_budget_bytes(&self) -> u64 {
        self.rt.gathered.capacity_bytes()
    }

    /// Bytes on the NVMe store now: optimizer state and compute copies placed there (0 without
    /// a store).
    pub fn nvme_bytes(&self) -> u64 {
        self.rt.tiers.nvme_bytes()
    }

    /// Traffic counters since the runtime began: the device's H2D/D2H links, every copy on them
    /// (fetches, write-backs, gradients, activation checkpoints; on CUDA, busy time from events
    /// around each copy on the copy stream), and the NVMe reads and writes of the store
    /// (optimizer state and compute copies).
    pub fn traffic(&self) -> MetricsSnapshot {
        self.rt.tiers.traffic()
    }

    /// The residency manager's own counters (its fetches, write-backs, evictions and the NVMe
    /// reads and writes of compute copies), without the optimizer's traffic that
    /// [`Memory::traffic`] adds.
    pub fn residency_metrics(&self) -> MetricsSnapshot {
        self.rt.tiers.residency.metrics()
    }

    /// Activation checkpoints stashed and not taken yet ([`super::Activations`]).
    pub fn stashed_activations(&self) -> usize {
        self.rt.activations.len()
    }

    /// Announces the units the caller fetches next, in the order it will (an MoE block's
    /// routed experts that run on the device): the first [`Runtime::fetch`] (or
    /// [`Runtime::fetch_pinned`]) of one of them publishes the finished updates of all of them
    /// and loads every device copy they lack in one batched H2D
    /// ([`oogc_swapper::ResidencyManager::load_device_batch`]: one copy-engine operation instead
    /// of one per unit, as many as the device budget holds without waiting), so each fetch after
    /// it only pins. Replaces an earlier announcement not yet used; units whose optimizer is on
    /// the device or whose parameters are sharded are left out (their fetch moves nothing or
    /// gathers). What the fetches return is unchanged: this moves copies, never values.
    pub fn will_fetch(&self, units: &[UnitId]) {
        let mut set = self.rt.fetch_set.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        set.clear();
        set.extend(
            units.iter().copied().filter(|&u| matches!(self.rt.units.get(u).kind, Kind::Tiered | Kind::Unscheduled)),
        );
    }

    /// Whether `unit`'s next fetch finds its current copy on the device (and moves no bytes):
    /// its optimizer lives there, or the device holds a copy that no finished update has made
    /// stale (the fetch would publish the update first, dropping that copy, and copy the new
    /// one H2D).
    pub fn is_on_device(&self, unit: UnitId) -> bool {
        let u = self.rt.units.get(unit);
        match u.kind {
            Kind::Device { .. } => true,
            _ => {
                u.update != Update::StepFinished
                    && self.rt.tiers.residency.residency(unit.tensor()).is_ok_and(|r| r.device)
            }
        }
    }

    /// The device's ordering check: a copy, free or reuse of a device buffer not ordered after
    /// the compute that used it (the sim device's happens-before checker; on CUDA, an error the
    /// driver recorded). [`Runtime::finish_step`] makes it at every step's end.
    ///
    /// # Errors
    /// The first such hazard, named.
    pub fn check_ordering(&self) -> Result<()> {
        Ok(self.rt.tiers.device().check_ordering()?)
    }
}

impl Runtime {
    /// The plan of the host budget for the units added so far.
    pub(super) fn plan_host(&self) -> HostPlan {
        let units = self.units.numels();
        let shards = budget::optimizer_units(self.ranks.world(), &units);
        HostPlan::with_shards(
            &self.config,
            &units,
            &shards,
            &self.units.home_numels(),
            self.units.max_in_use(),
            self.nvme_speculation_room(),
        )
    }

    /// NVMe bytes the store has beyond what the run needs ([`NvmePlan::speculation_room_bytes`]):
    /// room for speculated NVMe units' second extents.
    pub(super) fn nvme_speculation_room(&self) -> u64 {
        let units = self.units.numels();
        self.tiers.nvme.as_ref().map_or(0, |store| {
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

    /// [`Memory::min_working_set_bytes`].
    pub(super) fn min_working_set_bytes(&self, max_units_in_use: usize) -> u64 {
        self.units.largest_home_bytes(max_units_in_use)
            + staging_bytes(self.units.largest_bytes(1), self.config.activation_offload)
            + self.compute_side_copies_bytes()
    }

    /// Device bytes of candle's own copies of the units in use on CUDA (`max_units_in_use` of the
    /// largest unit): a fetched unit becomes a tensor candle owns by one device-to-device copy
    /// (`runtime/cuda.rs`). 0 on the sim device, whose tensors are CPU tensors — except the
    /// units gathered from the ranks' shards, which stand for GPU memory on either device.
    pub(super) fn compute_side_copies_bytes(&self) -> u64 {
        if self.sharded() || matches!(self.tiers.device(), Device::Cuda(_)) {
            self.units.largest_bytes(self.units.max_in_use())
        } else {
            0
        }
    }

    /// With sharded parameters, the GPU bytes gathered units ([`super::StepStats::gathers`]) may
    /// hold beyond the units in use (`in_use`): what `available` (the budget less staging and
    /// the units in use) leaves once every shard fits, up to every whole unit. Shards come
    /// first: a resident shard saves its H2D over the link, a gathered unit N × its bytes of GPU
    /// memory for an all-gather over the ranks' faster links.
    pub(super) fn gathered_extra_bytes(&self, available: u64, in_use: u64) -> u64 {
        let shards: u64 = self.units.iter().map(|(_, u)| u.home_bytes()).sum();
        let whole: u64 =
            self.units.iter().filter(|(_, u)| matches!(u.kind, Kind::Gathered)).map(|(_, u)| u.bytes()).sum();
        available.saturating_sub(shards).min(whole.saturating_sub(in_use))
    }
}
