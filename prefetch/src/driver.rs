//! The thin driver that applies the [`Prefetcher`]'s plans to a real [`ResidencyManager`].
//!
//! ```no_run
//! # fn main() -> oogc_prefetch::Result<()> {
//! use std::sync::Arc;
//! use oogc_prefetch::{NextUsePolicy, PrefetchConfig, PrefetchDriver, Schedule};
//! use oogc_swapper::{Access, ResidencyManager, Tier};
//! # let manager: ResidencyManager = unimplemented!();
//! # let schedule: Schedule = unimplemented!();
//! let schedule = Arc::new(schedule);
//! let policy = NextUsePolicy::new(schedule.clone());
//! let mut driver = PrefetchDriver::new(&manager, policy.cursor(), PrefetchConfig::default())?;
//! manager.set_policy(Box::new(policy));
//! for entry in schedule.entries().iter().filter(|e| e.tier == Tier::Device) {
//!     let guard = manager.acquire(entry.unit, Tier::Device, Access::Read)?;
//!     driver.after_acquire(&manager, &|_unit| false)?; // no optimizer step pending
//!     // ... compute with `guard` ...
//! }
//! # Ok(()) }
//! ```

use oogc_swapper::{PrefetchHandle, ResidencyManager, TensorId, Tier};

use crate::error::Result;
use crate::policy::{CursorHandle, NextUsePolicy};
use crate::prefetcher::{CopyView, PrefetchConfig, PrefetchPlan, Prefetcher, ResidentView, TierSnapshot};
use crate::schedule::check_budget;

/// Issues the sliding window's prefetches on a [`ResidencyManager`] whose policy is the
/// [`NextUsePolicy`] that `cursor` belongs to.
#[derive(Debug)]
pub struct PrefetchDriver {
    cursor: CursorHandle,
    prefetcher: Prefetcher,
    in_flight: Vec<(TensorId, PrefetchHandle)>,
    issued: u64,
    failed: u64,
}

impl PrefetchDriver {
    /// A driver for `manager`, planning from the position `cursor` reports.
    ///
    /// # Errors
    /// [`crate::Error::BudgetBelowWorkingSet`] when the manager's device budget is below the
    /// schedule's [`crate::min_working_set`] (refused before the step starts);
    /// [`crate::Error::Config`] for a bad `config`.
    pub fn new(manager: &ResidencyManager, cursor: CursorHandle, config: PrefetchConfig) -> Result<Self> {
        check_budget(&cursor.schedule(), manager.budget_bytes(Tier::Device))?;
        Ok(Self { cursor, prefetcher: Prefetcher::new(config)?, in_flight: Vec::new(), issued: 0, failed: 0 })
    }

    /// The tier as the planner needs it: the schedule's units with a device copy (ready, or
    /// arriving from one of this driver's prefetches).
    fn snapshot(&mut self, manager: &ResidencyManager) -> Result<TierSnapshot> {
        self.reap();
        let schedule = self.cursor.schedule();
        let mut copies = Vec::new();
        for (id, bytes) in schedule.units() {
            let loading = self.in_flight.iter().any(|(u, _)| *u == id);
            let info = manager.residency(id)?;
            if info.device || loading {
                copies.push(ResidentView {
                    id,
                    num_bytes: bytes,
                    state: if info.device { CopyView::Ready } else { CopyView::Loading },
                    pinned: info.device_pins > 0,
                    last_use: 0,
                    dirty: info.device_dirty,
                });
            }
        }
        Ok(TierSnapshot {
            budget_bytes: manager.budget_bytes(Tier::Device),
            used_bytes: manager.used_bytes(Tier::Device),
            copies,
            clock: 0,
        })
    }

    /// Drops finished prefetches; a failed one is logged and counted (the acquire that needs
    /// the unit fetches it again and reports a persistent error itself).
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            if self.in_flight[i].1.is_ready() {
                let (id, h) = self.in_flight.swap_remove(i);
                if let Err(e) = h.wait() {
                    self.failed += 1;
                    tracing::warn!(unit = id.0, error = %e, "prefetch failed; the acquire will fetch it");
                }
            } else {
                i += 1;
            }
        }
    }

    /// Plans and issues the window's prefetches. Call it after each device acquire of the
    /// schedule (the policy has advanced its position there); `blocked(unit)` must be true
    /// while the unit's CPU optimizer step is not finished (a fetch then would be stale).
    ///
    /// # Errors
    /// Swapper errors from reading residency or submitting a prefetch.
    pub fn after_acquire(
        &mut self,
        manager: &ResidencyManager,
        blocked: &dyn Fn(TensorId) -> bool,
    ) -> Result<PrefetchPlan> {
        let snapshot = self.snapshot(manager)?;
        let schedule = self.cursor.schedule();
        let ranking = NextUsePolicy::from_cursor(self.cursor.clone());
        let plan = self.prefetcher.plan(&schedule, self.cursor.position(), &snapshot, &ranking, blocked);
        for &(unit, bytes, distance) in &plan.fetch {
            tracing::trace!(unit = unit.0, bytes, distance, "prefetch::issue");
            self.in_flight.push((unit, manager.prefetch(unit, Tier::Device)?));
            self.issued += 1;
        }
        Ok(plan)
    }

    /// Waits for every prefetch in flight (end of step, or tests that want a deterministic order).
    ///
    /// # Errors
    /// None today: failed prefetches are logged and counted ([`PrefetchDriver::failed`]).
    pub fn wait_all(&mut self) -> Result<()> {
        for (id, h) in self.in_flight.drain(..) {
            if let Err(e) = h.wait() {
                self.failed += 1;
                tracing::warn!(unit = id.0, error = %e, "prefetch failed; the acquire will fetch it");
            }
        }
        Ok(())
    }

    /// Prefetches issued so far.
    pub fn issued(&self) -> u64 {
        self.issued
    }

    /// Prefetches that failed (logged).
    pub fn failed(&self) -> u64 {
        self.failed
    }

    /// The cursor the driver plans from.
    pub fn cursor(&self) -> &CursorHandle {
        &self.cursor
    }
}
