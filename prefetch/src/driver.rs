//! The thin driver that applies the [`Prefetcher`]'s plans to a real [`ResidencyManager`]: the
//! device window, and with [`PrefetchDriver::with_host_depth`] (parameters homed on NVMe) the
//! host window ahead of it — NVMe → host fetches of the next units, so that the device window
//! only ever moves host → device (a unit whose host copy is neither ready nor arriving stops the
//! device window, as a unit with a pending optimizer step does).
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

use oogc_swapper::host::size_class;
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
    /// The host window (NVMe → host), when parameters are homed on NVMe.
    host_prefetcher: Option<Prefetcher>,
    /// Prefetches in flight: the unit, the tier, the handle.
    in_flight: Vec<(TensorId, Tier, PrefetchHandle)>,
    issued: u64,
    issued_host: u64,
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
        Ok(Self {
            cursor,
            prefetcher: Prefetcher::new(config)?,
            host_prefetcher: None,
            in_flight: Vec::new(),
            issued: 0,
            issued_host: 0,
            failed: 0,
        })
    }

    /// Adds the host window: NVMe → host prefetches of the next `depth` device accesses' units
    /// (for units homed on NVMe; 0 turns it off).
    ///
    /// # Errors
    /// None today (a depth of 0 turns the window off).
    pub fn with_host_depth(mut self, depth: usize) -> Result<Self> {
        self.host_prefetcher = match depth {
            0 => None,
            d => Some(Prefetcher::new(PrefetchConfig { max_depth: d, ..*self.prefetcher.config() })?),
        };
        Ok(self)
    }

    fn in_flight_to(&self, id: TensorId, tier: Tier) -> bool {
        self.in_flight.iter().any(|(u, t, _)| *u == id && *t == tier)
    }

    /// The tier as the planner needs it: the schedule's units with a device copy (ready, or
    /// arriving from one of this driver's prefetches).
    fn snapshot(&mut self, manager: &ResidencyManager) -> Result<TierSnapshot> {
        self.reap();
        let schedule = self.cursor.schedule();
        let mut copies = Vec::new();
        for (id, bytes) in schedule.units() {
            let loading = self.in_flight_to(id, Tier::Device);
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
    /// The host tier as the planner needs it: the schedule's units with a host copy (ready, or
    /// arriving from one of this driver's prefetches, or from a device prefetch planned now in
    /// `planned`), in pool size classes; a host copy under a pinned or arriving device copy
    /// cannot go.
    fn host_snapshot(&self, manager: &ResidencyManager, planned: &[(TensorId, u64, u64)]) -> Result<TierSnapshot> {
        let schedule = self.cursor.schedule();
        let mut copies = Vec::new();
        let mut extra = 0;
        for (id, bytes) in schedule.units() {
            let info = manager.residency(id)?;
            let planned_now = planned.iter().any(|p| p.0 == id);
            let loading = self.in_flight_to(id, Tier::Host) || self.in_flight_to(id, Tier::Device) || planned_now;
            if planned_now && !info.host {
                extra += size_class(bytes as usize) as u64;
            }
            if info.host || loading {
                copies.push(ResidentView {
                    id,
                    num_bytes: size_class(bytes as usize) as u64,
                    state: if info.host { CopyView::Ready } else { CopyView::Loading },
                    pinned: info.host_pins > 0 || info.device_pins > 0 || self.in_flight_to(id, Tier::Device),
                    last_use: 0,
                    dirty: info.host_dirty,
                });
            }
        }
        Ok(TierSnapshot {
            budget_bytes: manager.budget_bytes(Tier::Host),
            used_bytes: manager.used_bytes(Tier::Host) + extra,
            copies,
            clock: 0,
        })
    }

    fn reap(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            if self.in_flight[i].2.is_ready() {
                let (id, _, h) = self.in_flight.swap_remove(i);
                if let Err(e) = h.wait() {
                    self.failed += 1;
                    tracing::warn!(unit = id.0, error = %e, "prefetch failed; the acquire will fetch it");
                }
            } else {
                i += 1;
            }
        }
    }

    /// Plans and issues the window's prefetches (the device window's plan is returned; with a
    /// host window, its NVMe → host prefetches follow the device window's). Call it after each
    /// device acquire of the schedule (the policy has advanced its position there);
    /// `blocked(unit)` must be true while the unit's CPU optimizer step is not finished (a fetch
    /// then would be stale).
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
        let position = self.cursor.position();
        let plan = if self.host_prefetcher.is_some() {
            // Two levels: the device window moves host → device only; a unit whose host copy is
            // neither there nor arriving waits for the host window.
            let mut no_host = std::collections::HashSet::new();
            for (id, _) in schedule.units() {
                if !manager.residency(id)?.host && !self.in_flight_to(id, Tier::Host) {
                    no_host.insert(id);
                }
            }
            let gate = |id: TensorId| blocked(id) || no_host.contains(&id);
            self.prefetcher.plan(&schedule, position, &snapshot, &ranking, &gate)
        } else {
            self.prefetcher.plan(&schedule, position, &snapshot, &ranking, blocked)
        };
        for &(unit, bytes, distance) in &plan.fetch {
            tracing::trace!(unit = unit.0, bytes, distance, "prefetch::issue");
            self.in_flight.push((unit, Tier::Device, manager.prefetch(unit, Tier::Device)?));
            self.issued += 1;
        }
        if let Some(host) = &self.host_prefetcher {
            let snapshot = self.host_snapshot(manager, &plan.fetch)?;
            let host_plan = host.plan_tier(Tier::Host, &schedule, position, &snapshot, &ranking, blocked);
            for &(unit, bytes, distance) in &host_plan.fetch {
                tracing::trace!(unit = unit.0, bytes, distance, "prefetch::issue_host");
                self.in_flight.push((unit, Tier::Host, manager.prefetch(unit, Tier::Host)?));
                self.issued_host += 1;
            }
        }
        Ok(plan)
    }

    /// Waits for every prefetch in flight (end of step, or tests that want a deterministic order).
    ///
    /// # Errors
    /// None today: failed prefetches are logged and counted ([`PrefetchDriver::failed`]).
    pub fn wait_all(&mut self) -> Result<()> {
        for (id, _, h) in self.in_flight.drain(..) {
            if let Err(e) = h.wait() {
                self.failed += 1;
                tracing::warn!(unit = id.0, error = %e, "prefetch failed; the acquire will fetch it");
            }
        }
        Ok(())
    }

    /// Device prefetches issued so far.
    pub fn issued(&self) -> u64 {
        self.issued
    }

    /// Host (NVMe → host) prefetches issued so far.
    pub fn issued_host(&self) -> u64 {
        self.issued_host
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
