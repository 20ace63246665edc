//! The schedule part of a runtime ([`Scheduler`]): each step's accesses are recorded into a trace;
//! a trace that differs from the schedule in force becomes the schedule at the step's end, and
//! with it the next-use (Belady) eviction policy and the sliding prefetch window
//! (`oogc-prefetch`'s `NextUsePolicy` and `PrefetchDriver`).

use std::sync::Arc;

use oogc_prefetch::{
    check_budget, CursorHandle, NextUsePolicy, Phase, PrefetchConfig, PrefetchDriver, Schedule, TraceRecorder,
};
use oogc_swapper::{EvictionPolicy, ResidencyManager, StatePlacement, TensorId, Tier};
use parking_lot::Mutex;

use super::Result;

/// The trace being recorded, the schedule in force, the policy's cursor on it and the prefetch
/// window.
pub(super) struct Scheduler {
    /// The access trace of the step in progress (shared with the [`super::PinnedUnit`]s, which
    /// record their release when dropped).
    recorder: Arc<Mutex<TraceRecorder>>,
    /// The schedule in force (the last step's trace whose accesses changed).
    schedule: Option<Arc<Schedule>>,
    /// The next-use policy's cursor on the schedule.
    cursor: Option<CursorHandle>,
    /// The sliding window of prefetches (depth > 0, from the second step on).
    driver: Option<PrefetchDriver>,
    /// Ranks unscheduled units for eviction once the next-use policy is installed.
    fallback: Option<Box<dyn EvictionPolicy>>,
    /// Units prefetched to the device ahead (0: on demand).
    depth: usize,
    /// Units prefetched NVMe → host ahead when the parameters live on NVMe.
    host_depth: usize,
}

impl Scheduler {
    /// A scheduler with a device window of `depth` units and, with parameters on NVMe
    /// (`params_placement`), a host window of `host_depth`.
    pub(super) fn new(depth: usize, host_depth: usize, params_placement: StatePlacement) -> Self {
        Self {
            recorder: Arc::new(Mutex::new(TraceRecorder::new())),
            schedule: None,
            cursor: None,
            driver: None,
            fallback: None,
            depth,
            host_depth: match params_placement {
                StatePlacement::Nvme => host_depth,
                StatePlacement::Host => 0,
            },
        }
    }

    /// The policy for unscheduled units, installed with the next-use policy after the first step.
    pub(super) fn set_fallback(&mut self, policy: Box<dyn EvictionPolicy>) {
        self.fallback = Some(policy);
    }

    /// A new step: a fresh trace; the cursor restarts (evaluation between steps made
    /// off-schedule acquires).
    pub(super) fn begin_step(&mut self) {
        *self.recorder.lock() = TraceRecorder::new();
        if let Some(cursor) = &self.cursor {
            cursor.restart_step();
        }
    }

    /// Records a scheduled unit's acquire of `bytes` on the device; returns the trace, which the
    /// pin's guard records the release into.
    pub(super) fn record_fetch(
        &self,
        tensor: TensorId,
        bytes: u64,
        phase: Phase,
        write: bool,
    ) -> Arc<Mutex<TraceRecorder>> {
        self.recorder.lock().acquire(tensor, bytes, phase, Tier::Device, write);
        Arc::clone(&self.recorder)
    }

    /// Records that the optimizer will rewrite a scheduled unit's compute copy (`bytes` in the
    /// host tier): its device copy is dead from here.
    pub(super) fn record_optimizer_write(&self, tensor: TensorId, bytes: u64) {
        let mut recorder = self.recorder.lock();
        recorder.acquire(tensor, bytes, Phase::Optimizer, Tier::Host, true);
        recorder.release(tensor, Tier::Host);
    }

    /// Whether the prefetch window runs (from the step after the first schedule on, with a
    /// depth).
    pub(super) fn windowed(&self) -> bool {
        self.driver.is_some()
    }

    /// After an acquire: the window plans and issues its prefetches; `blocked` tells which
    /// tensors wait for an update (not prefetched yet).
    pub(super) fn after_acquire(
        &mut self,
        residency: &ResidencyManager,
        blocked: &dyn Fn(TensorId) -> bool,
    ) -> Result<()> {
        if let Some(driver) = self.driver.as_mut() {
            driver.after_acquire(residency, blocked)?;
        }
        Ok(())
    }

    /// The step's trace becomes the schedule when it differs from the one in force: the policy
    /// switches to next-use over it (with the fallback for unscheduled units) and the prefetch
    /// window starts.
    ///
    /// # Errors
    /// The schedule does not fit the device budget; the prefetch driver's.
    pub(super) fn end_step(&mut self, residency: &ResidencyManager) -> Result<()> {
        let recorder = std::mem::take(&mut *self.recorder.lock());
        if recorder.is_empty() {
            return Ok(());
        }
        let trace = recorder.finish()?;
        if self.schedule.as_ref().is_some_and(|s| s.same_accesses(&trace)) {
            return Ok(());
        }
        let schedule = Arc::new(trace);
        check_budget(&schedule, residency.budget_bytes(Tier::Device))?;
        match &self.cursor {
            Some(cursor) => cursor.set_schedule(schedule.clone()),
            None => {
                let mut policy = NextUsePolicy::new(schedule.clone());
                if let Some(fallback) = self.fallback.take() {
                    policy = policy.with_fallback(fallback);
                }
                let cursor = policy.cursor();
                residency.set_policy(Box::new(policy));
                if self.depth > 0 {
                    let config = PrefetchConfig { max_depth: self.depth, ..PrefetchConfig::default() };
                    let driver = PrefetchDriver::new(residency, cursor.clone(), config)?;
                    self.driver = Some(driver.with_host_depth(self.host_depth)?);
                }
                self.cursor = Some(cursor);
            }
        }
        tracing::debug!(accesses = schedule.entries().len(), "runtime: new schedule");
        self.schedule = Some(schedule);
        Ok(())
    }

    /// Waits for the window's prefetches in flight (the runtime's drop).
    pub(super) fn wait_all(&mut self) {
        if let Some(d) = self.driver.as_mut() {
            let _ = d.wait_all();
        }
    }
}
