//! A step's frame: [`Runtime::begin_step`] (the first one checks the working set and carves the
//! budgets), [`Runtime::end_forward`], and [`Runtime::finish_step`], which closes the step by
//! unit kind — device-resident units updated on the device after the decision, gathered units'
//! gathered copies dropped, whole units' new copies all-gathered with ranks — and turns the
//! step's trace into the schedule.

use std::time::Instant;

use oogc_optimizer::StepReport;
use oogc_swapper::StatePlacement;

use super::device_optim;
use super::grads::STAGING_BUFFERS;
use super::tensor::candle_dtype;
use super::unit::{Kind, Update};
use super::{gathered, home, staging_bytes, OrderingCall, Result, Runtime, RuntimeError, StepStats};

impl Runtime {
    /// Starts a step whose update is Adam step `step` (1-based `t`; a skipped step does not
    /// advance it) with learning rate `lr`. The first call checks the
    /// GPU budget against the minimum working set and carves out gradient staging.
    ///
    /// # Errors
    /// [`RuntimeError::BudgetBelowWorkingSet`] with the minimum in bytes; optimizer errors.
    pub fn begin_step(&mut self, step: u64, lr: f32) -> Result<()> {
        self.check_working_set()?;
        self.grads.optimizer().begin_step(step, lr)?;
        self.clock.begin(step, lr, self.tiers.traffic());
        // The step's device high-water mark starts from what is held now.
        self.tiers.device().reset_pool_peak()?;
        self.scheduler.begin_step();
        Ok(())
    }

    /// Marks the turn from the forward to the backward phase (before the head's backward): the
    /// time, stalls and H2D/D2H bytes so far become [`StepStats::forward`], which lets a
    /// benchmark bound each phase by its own busiest resource. Optional; idempotent within a
    /// step (the first call counts).
    pub fn end_forward(&mut self) {
        let tiers = &self.tiers;
        self.clock.end_forward(|| tiers.traffic());
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
        if self.carve.checked {
            return Ok(());
        }
        let min = self.min_working_set_bytes(self.units.max_in_use());
        if self.config.gpu_budget_bytes < min {
            return Err(RuntimeError::BudgetBelowWorkingSet {
                budget_bytes: self.config.gpu_budget_bytes,
                min_bytes: min,
            });
        }
        self.apply_host_plan()?;
        let largest = self.units.largest_bytes(1) as usize;
        let device = self.tiers.residency.device();
        let order = self.tiers.order;
        for _ in 0..STAGING_BUFFERS {
            // The backward writes a staging buffer before any copy uses it.
            self.grads.add_staging(order.alloc_for_compute(device, OrderingCall::GradStagingAlloc, largest.max(1))?);
        }
        if let Some(a) = self.config.activation_offload {
            self.activations.make_staging(device, order, a.checkpoint_bytes)?;
        }
        let in_use = self.compute_side_copies_bytes();
        self.carve.base =
            self.config.gpu_budget_bytes - staging_bytes(largest as u64, self.config.activation_offload) - in_use;
        if self.sharded() {
            let extra = self.gathered_extra_bytes(self.carve.base, in_use);
            self.gathered.set_capacity_bytes(in_use + extra);
            self.carve.base -= extra;
        }
        self.tiers.residency.set_device_budget_bytes(self.carve.residency_bytes())?;
        self.carve.checked = true;
        Ok(())
    }

    /// Splits the host budget ([`super::HostPlan`]) and applies the split.
    fn apply_host_plan(&mut self) -> Result<()> {
        let plan = self.plan_host();
        plan.check()?;
        self.tiers.residency.set_host_budget_bytes(plan.compute_copies_bytes.max(1))?;
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
        self.carve.host_plan = Some(plan);
        Ok(())
    }

    /// Ends the step: waits until every gradient is submitted, then for the optimizer's verdict
    /// (global norm, clip scale, non-finite skip). Updates may still be running; the next fetch
    /// of each unit waits for its own. With [`super::RuntimeConfig::overlap_optimizer`] false,
    /// the held gradients are submitted here (in arrival order) and every unit's update is
    /// awaited and published before this returns (the baseline's serial optimizer phase).
    ///
    /// # Errors
    /// A failure of a gradient copy or of the optimizer; with ranks, a failed collective
    /// ([`RuntimeError::Dist`], or the optimizer's [`oogc_optimizer::Error::NormReduce`]).
    pub fn finish_step(&mut self) -> Result<StepStats> {
        let t = Instant::now();
        self.grads.wait_submitted()?;
        for (unit, grads, claim) in self.grads.take_held() {
            let handle = self.grads.optimizer().submit_claimed(unit.tensor(), grads, claim)?;
            self.units.get_mut(unit).handle = Some(handle);
        }
        self.collect_handles();
        let device_started = Instant::now();
        let device_failed = self.add_device_sumsqs()?;
        let mut device_update_s = device_started.elapsed().as_secs_f64();
        let report: StepReport = self.grads.optimizer().finish_step()?;
        if let Some(e) = device_failed {
            for (_, u) in self.units.iter_mut() {
                if let Some(d) = u.device_mut() {
                    d.grads = None;
                }
            }
            return Err(e);
        }
        let device_started = Instant::now();
        self.update_device_units(&report)?;
        device_update_s += device_started.elapsed().as_secs_f64();
        self.clock.stats.device_update_s = device_update_s;
        for (k, u) in self.units.iter_mut() {
            if u.update == Update::Pushed {
                u.update = Update::StepFinished;
                // Its gathered copy is the old parameters (on every rank: the same units were
                // pushed everywhere, skipped step or not).
                self.gathered.remove(k);
            }
        }
        self.gathered.end_step();
        if self.ranks.world().size > 1 && !report.skipped {
            self.gather_updates()?;
        }
        self.clock.stats.figures.stall_optimizer_s += t.elapsed().as_secs_f64();
        if !self.config.overlap_optimizer {
            // `publish` adds its own wait to `stall_optimizer_s`.
            self.sync()?;
        }
        self.scheduler.end_step(&self.tiers.residency)?;
        let device_units = self.units.iter().filter(|(_, u)| u.device().is_some()).count();
        let now = self.tiers.traffic();
        let stats = &mut self.clock.stats;
        stats.figures.grad_norm = report.grad_norm;
        stats.figures.clip_scale = report.clip_scale;
        stats.device_units = device_units;
        stats.device_optimizer_bytes = self.carve.device_optimizers;
        stats.figures.skipped = report.skipped;
        self.clock.close(&now);
        self.clock.stats.device_peak_bytes = self.tiers.device().pool_peak_bytes()?;
        // A copy, free or reuse of a device buffer not ordered after the compute that used it
        // (the sim device's happens-before checker; on CUDA, an error the driver recorded).
        self.tiers.device().check_ordering()?;
        Ok(self.clock.stats.clone())
    }

    /// The units with their optimizer on the device add their gradients' sums of squares to the
    /// step's global norm (unit-id order, with the CPU optimizer's units). With immediate updates
    /// (no clipping, `nonfinite = "stop"`) a non-finite sum is not added: it is returned, the
    /// error [`Runtime::finish_step`] gives once the CPU optimizer's step is closed.
    fn add_device_sumsqs(&mut self) -> Result<Option<RuntimeError>> {
        let immediate = self.config.optimizer.updates_immediately();
        let mut failed = None;
        for (id, u) in self.units.iter() {
            let Some(g) = u.device().and_then(|d| d.grads.as_ref()) else { continue };
            let sumsq = device_optim::sumsq(g)?;
            if immediate && !sumsq.is_finite() {
                failed.get_or_insert(RuntimeError::Optimizer(oogc_optimizer::Error::NonFiniteGradient {
                    step: self.clock.step,
                    unit: id.tensor(),
                    sumsq,
                }));
                continue;
            }
            self.grads.optimizer().add_external_sumsq(id.tensor(), sumsq)?;
        }
        Ok(failed)
    }

    /// After the step's decision: each unit with its optimizer on the device is updated there
    /// with the step's clip scale (not at all when the step was skipped), its compute copy
    /// rewritten; the gradients go.
    fn update_device_units(&mut self, report: &StepReport) -> Result<()> {
        if self.carve.device_optimizers == 0 {
            return Ok(());
        }
        let c =
            self.config.optimizer.adam.scalars(self.clock.step, self.clock.lr, report.clip_scale)?.element_constants();
        for (_, u) in self.units.iter_mut() {
            let dtype = u.dtype;
            let Some(d) = u.device_mut() else { continue };
            if report.skipped {
                d.grads = None;
            } else {
                d.update(&c, candle_dtype(dtype)?)?;
            }
        }
        Ok(())
    }

    /// Data-parallel ranks: every whole unit updated this step gets its new compute copy from all
    /// ranks' shards (each rank's optimizer updated its own), in unit order on every rank, and
    /// is current from here (its fetches publish nothing). Waits for the updates.
    fn gather_updates(&mut self) -> Result<()> {
        let optimizer = self.grads.optimizer();
        for (id, u) in self.units.iter_mut() {
            // A gathered unit's copy is gathered at its fetch instead.
            if u.update != Update::StepFinished || matches!(u.kind, Kind::Gathered) {
                continue;
            }
            optimizer.publish(id.tensor())?;
            let mut shard = Vec::new();
            optimizer.read_compute_copy(id.tensor(), |bytes| shard = bytes.to_vec())?;
            let full = gathered::all_gather_unit(&self.ranks, &shard, u.numel, u.dtype)?;
            home::overwrite_host_copy(&self.tiers.residency, id.tensor(), &mut |b| {
                b[..full.len()].copy_from_slice(&full)
            })?;
            u.update = Update::Current;
        }
        Ok(())
    }
}
