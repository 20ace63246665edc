//! Fetching a unit, by its kind ([`Kind`]): a device-resident unit's tensor as it is, a gathered
//! unit's shard all-gathered, a tiered or unscheduled unit pinned on the device (or on the host
//! for CPU compute); and the commit of a finished update into the unit's home (`publish`), which
//! every fetch makes first.

use std::time::Instant;

use oogc_swapper::{Access, TensorId, Tier};

use super::tensor::{self, device_tensor, tensor_from_bytes};
use super::unit::{Kind, Update};
use super::{gathered, Phase, PinnedUnit, Result, Runtime, RuntimeError, UnitId, UnitParams};

impl Runtime {
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
        match &self.units.get(unit).kind {
            // Its optimizer keeps the compute copy on the device: nothing moves, nothing is
            // recorded (the unit is outside the schedule while it stays there).
            Kind::Device { state, .. } => {
                Ok(UnitParams { tensor: state.copy.clone(), unit, _pinned: None, _gathered: None })
            }
            Kind::Gathered => self.fetch_gathered(unit, phase),
            Kind::Tiered | Kind::Unscheduled => {
                let pinned = self.pin_on_device(unit, phase, Access::Read)?;
                let tensor = {
                    let buf = pinned.pin.device_buffer();
                    device_tensor(&buf, pinned.numel, pinned.dtype, &self.tiers.compute_device)?
                };
                Ok(UnitParams { tensor, unit, _pinned: Some(pinned), _gathered: None })
            }
        }
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
    /// As [`Runtime::fetch`]; [`RuntimeError::Usage`] for a unit sharded over the ranks or with
    /// its optimizer on the device.
    pub fn fetch_pinned(&mut self, unit: UnitId, phase: Phase, access: Access) -> Result<PinnedUnit> {
        let u = self.units.get(unit);
        if let Kind::Gathered = u.kind {
            return Err(RuntimeError::Usage(format!(
                "fetch_pinned({}): the parameters are sharded over the ranks, so the device holds this rank's shard \
                 of the unit, not the unit; use fetch (which all-gathers it), or build the runtime with \
                 shard_parameters = false",
                u.name
            )));
        }
        self.pin_on_device(unit, phase, access)
    }

    /// A gathered unit: kept gathered, or this rank's shard pinned on the device (as
    /// [`Runtime::fetch_pinned`] pins a unit) and all-gathered from the ranks' into the whole
    /// unit, kept for its next use while the budget allows (`runtime/gathered.rs`). The same
    /// fetches miss on every rank, so every rank calls the all-gather.
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
            tensor::device_bytes(&buf, pinned.numel, pinned.dtype, &self.tiers.compute_device)?
        };
        let u = self.units.get(unit);
        let (numel, dtype, bytes) = (u.numel, u.dtype, u.bytes());
        let t = Instant::now();
        // One collective at a time, in the same order on every rank: the gradients pushed before
        // this fetch are reduce-scattered (by the drain thread) before the unit is gathered.
        self.grads.wait_submitted()?;
        let whole = gathered::all_gather_unit(&self.ranks, &shard, numel, dtype)?;
        let stats = &mut self.clock.stats;
        stats.gather_s += t.elapsed().as_secs_f64();
        stats.gathers += 1;
        stats.gather_bytes += (whole.len() - shard.len()) as u64;
        let tensor = tensor_from_bytes(&whole, dtype, numel, &self.tiers.compute_device)?;
        let in_use = self.gathered.insert(unit, tensor.clone(), bytes);
        Ok(UnitParams { tensor, unit, _pinned: None, _gathered: Some(in_use) })
    }

    /// Pins `unit`'s copy in the tiers (the shard of a gathered unit) on the device:
    /// [`Runtime::fetch_pinned`].
    fn pin_on_device(&mut self, unit: UnitId, phase: Phase, access: Access) -> Result<PinnedUnit> {
        if phase == Phase::Optimizer {
            return Err(RuntimeError::Usage("fetch(.., Phase::Optimizer): the optimizer does not fetch units".into()));
        }
        let u = self.units.get(unit);
        if let Kind::Device { .. } = u.kind {
            return Err(RuntimeError::Usage(format!(
                "fetch_pinned({}): the unit's optimizer is on the device, which keeps its compute copy as a tensor; \
                 use fetch, or place its optimizer on the host first (place_optimizer)",
                u.name
            )));
        }
        let span = tracing::info_span!("runtime::fetch", unit = unit.index(), ?phase);
        let _e = span.enter();
        self.load_fetch_set(unit)?;
        self.publish(unit)?;
        let tensor = unit.tensor();
        let t = Instant::now();
        let pin = self.tiers.residency.acquire(tensor, Tier::Device, access)?;
        self.clock.stats.figures.stall_transfer_s += t.elapsed().as_secs_f64();
        let u = self.units.get(unit);
        let mut recorder = None;
        if phase != Phase::Eval && u.scheduled() {
            recorder = Some(self.scheduler.record_fetch(tensor, u.home_bytes(), phase, access == Access::Write));
            self.issue_prefetches()?;
        }
        let u = self.units.get(unit);
        Ok(PinnedUnit { pin, unit, tensor, numel: u.home_numel, dtype: u.dtype, access, recorder })
    }

    /// When `unit` is in the announced fetch set ([`super::Memory::will_fetch`]): loads the
    /// missing device copies of the set's units whose compute copy is final now — no update
    /// outstanding, or one the optimizer has finished (published here, without waiting) — in
    /// one batched H2D (the wait counts as exposed transfer); `unit` itself always (its fetch
    /// waits for its update anyway). A unit whose update is still running is left to its own
    /// fetch, so the set's first fetch never waits for the others' updates. The set is used up.
    fn load_fetch_set(&mut self, unit: UnitId) -> Result<()> {
        let set = {
            let mut set = self.fetch_set.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !set.contains(&unit) {
                return Ok(());
            }
            std::mem::take(&mut *set)
        };
        self.collect_handles();
        let mut tensors = Vec::with_capacity(set.len());
        for u in set {
            let s = self.units.get(u);
            if u == unit || s.update != Update::StepFinished || s.ready_to_publish() {
                self.publish(u)?;
                tensors.push(u.tensor());
            }
        }
        let t = Instant::now();
        self.tiers.residency.load_device_batch(&tensors)?;
        self.clock.stats.figures.stall_transfer_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Takes the handles of the updates the drain thread submitted into the units' states.
    pub(super) fn collect_handles(&mut self) {
        for (unit, handle) in self.grads.submitted() {
            self.units.get_mut(unit).handle = Some(handle);
        }
    }

    /// The commit of a finished update: waits for `unit`'s pending update and has the optimizer
    /// publish its new compute copy into its home (the host copy, which drops the stale device
    /// copy); a deferred update wrote it there already.
    pub(super) fn publish(&mut self, unit: UnitId) -> Result<()> {
        if self.units.get(unit).update != Update::StepFinished {
            // No update, or one pushed in the step still running: the copy in the tiers is the
            // one this step must use.
            return Ok(());
        }
        let t = Instant::now();
        self.grads.wait_submitted()?;
        self.grads.optimizer().publish(unit.tensor())?;
        self.units.get_mut(unit).update = Update::Current;
        self.clock.stats.figures.stall_optimizer_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Publishes the compute copies of units whose update has finished, so the window can
    /// prefetch them; then lets the window plan and issue its prefetches.
    fn issue_prefetches(&mut self) -> Result<()> {
        if !self.scheduler.windowed() {
            return Ok(());
        }
        self.collect_handles();
        let ready: Vec<UnitId> = self.units.iter().filter(|(_, u)| u.ready_to_publish()).map(|(k, _)| k).collect();
        for u in ready {
            self.publish(u)?;
        }
        let units = &self.units;
        let blocked = |id: TensorId| units.of_tensor(id).is_some_and(|u| u.update != Update::Current);
        self.scheduler.after_acquire(&self.tiers.residency, &blocked)
    }

    /// Pins `unit`'s host copy and returns its parameters as a CPU tensor (`[numel]`, the
    /// compute dtype), for computing the unit on the CPU instead of fetching it (a cold MoE
    /// expert with few tokens, as Fiddler does). Waits for the unit's pending update first.
    /// Nothing moves H2D.
    ///
    /// # Errors
    /// Swapper errors (host budget, NVMe read), optimizer errors; [`RuntimeError::Usage`] for a
    /// unit sharded over the ranks.
    pub fn fetch_host(&mut self, unit: UnitId) -> Result<UnitParams> {
        let _e = tracing::info_span!("runtime::fetch_host", unit = unit.index()).entered();
        let u = self.units.get(unit);
        match &u.kind {
            Kind::Device { state, .. } => {
                // The copy lives on the device: computing on the CPU needs it there.
                let tensor = state.copy.to_device(&candle_core::Device::Cpu)?;
                return Ok(UnitParams { tensor, unit, _pinned: None, _gathered: None });
            }
            Kind::Gathered => {
                return Err(RuntimeError::Usage(format!(
                    "fetch_host({}): the parameters are sharded over the ranks (this rank's host copy is its shard); \
                     use fetch",
                    u.name
                )))
            }
            Kind::Tiered | Kind::Unscheduled => {}
        }
        self.publish(unit)?;
        let u = self.units.get(unit);
        let (tensor, numel, dtype) = (unit.tensor(), u.numel, u.dtype);
        let pin = self.tiers.residency.acquire(tensor, Tier::Host, Access::Read)?;
        // A host copy computed on the CPU: CPU by nature.
        let t =
            tensor_from_bytes(&pin.host_bytes()[..dtype.num_bytes(numel)], dtype, numel, &candle_core::Device::Cpu)?;
        let pinned = PinnedUnit { pin, unit, tensor, numel, dtype, access: Access::Read, recorder: None };
        Ok(UnitParams { tensor: t, unit, _pinned: Some(pinned), _gathered: None })
    }

    /// Waits for every pending update and publishes the compute copies (before a checkpoint or
    /// an evaluation that must see the latest parameters).
    ///
    /// # Errors
    /// As [`Runtime::fetch`].
    pub fn sync(&mut self) -> Result<()> {
        let ids: Vec<UnitId> = self.units.ids().collect();
        for u in ids {
            self.publish(u)?;
        }
        Ok(())
    }
}
