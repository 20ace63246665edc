//! The sliding window of prefetches: which units to fetch next, decided from the schedule, the
//! position in it and a snapshot of the tier (pure: decisions in, decisions out).
//!
//! After each acquire the window looks at the next `max_depth` device accesses of the schedule
//! and, in order, plans a fetch for each unit that is not resident or arriving, as long as the
//! budget allows it **without evicting anything needed sooner** than the unit fetched: it ranks
//! the evictable copies with the installed eviction policy (as the swapper will when the fetch
//! reserves its bytes) and stops at the first unit whose victims would include a copy used no
//! later than it. Stopping (not skipping) keeps fetches in schedule order, so a farther
//! prefetch never queues ahead of a nearer fetch on the FIFO link: a prefetch that would stall a
//! nearer fetch is deferred to the next acquire. This is StrongHold's sliding window of layers
//! (Sun et al., SC'22) with ZeRO-Infinity's schedule-driven prefetch (Rajbhandari et al.,
//! SC'21) and Belady's next-use rule as the safety check.
//!
//! The same window plans the host tier when parameters live on NVMe ([`Prefetcher::plan_tier`]
//! with [`Tier::Host`]): NVMe → host fetches of the units a few device accesses ahead, each
//! placed only if the host copies the policy would evict are needed later than it (a host copy
//! is needed at its unit's next device access, which loads through it), so the two-level
//! pipeline NVMe → pinned host → device keeps the same invariant on both tiers.
//!
//! [`crate::PrefetchDriver`] applies a plan to a real `ResidencyManager`; the simulator applies
//! it to its model of the tier.

use std::collections::HashSet;

use oogc_swapper::policy::eviction_order;
use oogc_swapper::{EvictionCandidate, EvictionPolicy, TensorId, Tier};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::schedule::Schedule;

/// Configuration of the sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefetchConfig {
    /// Device accesses looked ahead of the current position (units in the window, resident or
    /// not). Default: 4. Must be ≥ 1.
    pub max_depth: usize,
    /// Never move more bytes than demand fetching under Belady's MIN: a victim is also refused
    /// when MIN, at the fetched unit's use, would rather evict a unit used in between (its next
    /// use after that is farther than the victim's). Costs stall where the schedule is a cyclic
    /// scan (forward-only steps: no prefetch fits without giving up cache); changes nothing on
    /// palindromic training steps. Default: false (hide transfers first).
    pub no_extra_bytes: bool,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self { max_depth: 4, no_extra_bytes: false }
    }
}

impl PrefetchConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::Config`] naming `max_depth` when it is 0.
    pub fn validate(&self) -> Result<()> {
        if self.max_depth == 0 {
            return Err(Error::Config { key: "max_depth".into(), reason: "must be >= 1 (units ahead)".into() });
        }
        Ok(())
    }
}

/// The state of a copy on the tier, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyView {
    /// Ready: evictable when not pinned.
    Ready,
    /// Arriving (bytes reserved): not evictable.
    Loading,
}

/// One copy on the tier in a [`TierSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentView {
    /// The unit.
    pub id: TensorId,
    /// Bytes it holds on the tier.
    pub num_bytes: u64,
    /// Ready or arriving.
    pub state: CopyView,
    /// Pinned (in use): never evicted.
    pub pinned: bool,
    /// The swapper's logical clock at its last use (for LRU-like rankings; 0 when unknown).
    pub last_use: u64,
    /// Newer than the tier below (evicting it costs a write-back).
    pub dirty: bool,
}

/// The tier at the moment of planning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierSnapshot {
    /// The tier's budget, bytes.
    pub budget_bytes: u64,
    /// Bytes reserved now (ready and arriving copies), bytes.
    pub used_bytes: u64,
    /// The copies on the tier.
    pub copies: Vec<ResidentView>,
    /// The swapper's logical clock now.
    pub clock: u64,
}

/// Why the window stopped before `max_depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stop {
    /// Placing the unit would evict a copy used no later than it: deferred.
    NoRoom,
    /// The unit's host copy is not final yet (its optimizer step is running): deferred.
    Blocked,
}

/// The planner's decision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefetchPlan {
    /// Units to fetch, in order, with their bytes and next-use distance (device accesses ahead).
    pub fetch: Vec<(TensorId, u64, u64)>,
    /// Copies the fetches are expected to evict, in order.
    pub evict: Vec<TensorId>,
    /// The unit the window stopped at, and why; `None` when it reached `max_depth`.
    pub stopped: Option<(TensorId, Stop)>,
}

/// The pure sliding-window planner (see the [module docs](self)).
#[derive(Debug, Clone, Default)]
pub struct Prefetcher {
    config: PrefetchConfig,
}

impl Prefetcher {
    /// A planner with `config`.
    ///
    /// # Errors
    /// [`Error::Config`] from [`PrefetchConfig::validate`].
    pub fn new(config: PrefetchConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }

    /// The configuration.
    pub fn config(&self) -> &PrefetchConfig {
        &self.config
    }

    /// Plans the fetches after the acquire at device position `position` of `schedule`.
    ///
    /// `snapshot` is the device tier now; `ranking` the eviction policy the swapper will use to
    /// pick victims (asked for priorities only, never notified); `blocked(unit)` is true while a
    /// unit may not be fetched yet (its CPU optimizer step is not finished).
    pub fn plan(
        &self,
        schedule: &Schedule,
        position: u64,
        snapshot: &TierSnapshot,
        ranking: &dyn EvictionPolicy,
        blocked: &dyn Fn(TensorId) -> bool,
    ) -> PrefetchPlan {
        self.plan_tier(Tier::Device, schedule, position, snapshot, ranking, blocked)
    }

    /// [`Prefetcher::plan`] for `tier`: the device tier, or the host tier (NVMe → host fetches
    /// of NVMe-homed units; `snapshot` is then the host tier, its copies counted in pool size
    /// classes, and `ranking` is asked for host-copy priorities). Victims are checked against
    /// the units' next device access on either tier: a host copy is needed when its unit's
    /// device copy is loaded.
    pub fn plan_tier(
        &self,
        tier: Tier,
        schedule: &Schedule,
        position: u64,
        snapshot: &TierSnapshot,
        ranking: &dyn EvictionPolicy,
        blocked: &dyn Fn(TensorId) -> bool,
    ) -> PrefetchPlan {
        let bytes_on_tier = |b: u64| match tier {
            Tier::Host => oogc_swapper::host::size_class(b as usize) as u64,
            _ => b,
        };
        let mut plan = PrefetchPlan::default();
        let mut used = snapshot.used_bytes;
        let present: HashSet<TensorId> = snapshot.copies.iter().map(|c| c.id).collect();
        let mut gone: HashSet<TensorId> = HashSet::new();
        let mut planned: HashSet<TensorId> = HashSet::new();
        for k in 1..=self.config.max_depth as u64 {
            let unit = schedule.device_unit(position + k);
            if planned.contains(&unit) || (present.contains(&unit) && !gone.contains(&unit)) {
                continue;
            }
            if blocked(unit) {
                plan.stopped = Some((unit, Stop::Blocked));
                break;
            }
            let need = bytes_on_tier(schedule.unit_bytes(unit).unwrap_or(0));
            if used + need > snapshot.budget_bytes {
                let mut cands: Vec<EvictionCandidate> = snapshot
                    .copies
                    .iter()
                    .filter(|c| c.state == CopyView::Ready && !c.pinned && !gone.contains(&c.id) && c.id != unit)
                    .map(|c| EvictionCandidate {
                        id: c.id,
                        tier,
                        num_bytes: c.num_bytes,
                        last_use: c.last_use,
                        dirty: c.dirty,
                    })
                    .collect();
                eviction_order(ranking, &mut cands, snapshot.clock);
                // The farthest next use (absolute) of the units used from now until `unit`: with
                // `no_extra_bytes`, a victim must be needed after all of them (stale copies are
                // dropped, not evicted, so they do not compete).
                let horizon = if self.config.no_extra_bytes {
                    (0..k)
                        .filter_map(|i| {
                            let q = position + i;
                            schedule.next_use_distance(schedule.device_unit(q), q).map(|d| q + d)
                        })
                        .max()
                } else {
                    None
                };
                let mut victims = Vec::new();
                let mut freed = 0u64;
                let mut safe = true;
                for v in cands {
                    if used - freed + need <= snapshot.budget_bytes {
                        break;
                    }
                    // A victim needed no later than `unit` (at distance k) would be refetched
                    // before `unit` is used: not worth it.
                    let next = schedule.next_use_distance(v.id, position);
                    if next.is_some_and(|d| d <= k || horizon.is_some_and(|h| position + d <= h)) {
                        safe = false;
                        break;
                    }
                    freed += v.num_bytes;
                    victims.push(v.id);
                }
                if !safe || used - freed + need > snapshot.budget_bytes {
                    plan.stopped = Some((unit, Stop::NoRoom));
                    break;
                }
                used -= freed;
                gone.extend(victims.iter().copied());
                plan.evict.extend(victims);
            }
            used += need;
            planned.insert(unit);
            plan.fetch.push((unit, need, k));
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use oogc_swapper::LruPolicy;

    use super::*;
    use crate::policy::NextUsePolicy;

    fn ready(id: u64, bytes: u64) -> ResidentView {
        ResidentView {
            id: TensorId(id),
            num_bytes: bytes,
            state: CopyView::Ready,
            pinned: false,
            last_use: id,
            dirty: false,
        }
    }

    fn sched(n: u64) -> Arc<Schedule> {
        let units: Vec<_> = (0..n).map(|i| (TensorId(i), 100)).collect();
        Arc::new(Schedule::training_step(&units, false).unwrap())
    }

    #[test]
    fn fetches_in_order_up_to_the_depth_when_there_is_room() {
        let s = sched(8);
        let p = Prefetcher::new(PrefetchConfig { max_depth: 3, ..PrefetchConfig::default() }).unwrap();
        let snap = TierSnapshot { budget_bytes: 10_000, used_bytes: 100, copies: vec![ready(0, 100)], clock: 1 };
        let pol = NextUsePolicy::new(s.clone());
        let plan = p.plan(&s, 16, &snap, &pol, &|_| false);
        let ids: Vec<u64> = plan.fetch.iter().map(|f| f.0 .0).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert!(plan.stopped.is_none());
    }

    #[test]
    fn evicts_only_copies_needed_later_and_stops_otherwise() {
        let s = sched(8);
        // Position 16 + 2 = F2 of step 2. Resident: 0, 1 (needed in the backward, far), 2 pinned.
        let mut pinned = ready(2, 100);
        pinned.pinned = true;
        let snap = TierSnapshot {
            budget_bytes: 300,
            used_bytes: 300,
            copies: vec![ready(0, 100), ready(1, 100), pinned],
            clock: 3,
        };
        let mut pol = NextUsePolicy::new(s.clone());
        for u in 0..3 {
            pol.on_acquire(TensorId(u), Tier::Device, u + 1, false);
        }
        assert_eq!(pol.cursor().position(), 18);
        let p = Prefetcher::new(PrefetchConfig { max_depth: 4, ..PrefetchConfig::default() }).unwrap();
        let plan = p.plan(&s, 18, &snap, &pol, &|_| false);
        let ids: Vec<u64> = plan.fetch.iter().map(|f| f.0 .0).collect();
        assert_eq!(ids, vec![3, 4], "{plan:?}");
        assert_eq!(plan.evict, vec![TensorId(0), TensorId(1)]);
        assert_eq!(plan.stopped, Some((TensorId(5), Stop::NoRoom)));
    }

    #[test]
    fn an_lru_ranking_that_would_evict_a_nearer_unit_stops_the_window() {
        let s = sched(4);
        // Position 8 + 4 = B3 (step 1). Resident: 2 (next use B2, distance 1) with the oldest
        // last use, so LRU picks it first for the fetch of 1 (distance 2).
        let mut pinned = ready(3, 100);
        pinned.pinned = true;
        let mut r2 = ready(2, 100);
        r2.last_use = 0;
        let snap = TierSnapshot { budget_bytes: 200, used_bytes: 200, copies: vec![r2, pinned], clock: 9 };
        let p = Prefetcher::new(PrefetchConfig { max_depth: 2, ..PrefetchConfig::default() }).unwrap();
        let plan = p.plan(&s, 8 + 4, &snap, &LruPolicy, &|_| false);
        assert!(plan.fetch.is_empty(), "{plan:?}");
        assert_eq!(plan.stopped, Some((TensorId(1), Stop::NoRoom)));
    }

    #[test]
    fn a_blocked_unit_defers_the_rest() {
        let s = sched(4);
        let p = Prefetcher::new(PrefetchConfig { max_depth: 4, ..PrefetchConfig::default() }).unwrap();
        let snap = TierSnapshot { budget_bytes: 10_000, ..Default::default() };
        let pol = NextUsePolicy::new(s.clone());
        let plan = p.plan(&s, 7, &snap, &pol, &|u| u == TensorId(1));
        let ids: Vec<u64> = plan.fetch.iter().map(|f| f.0 .0).collect();
        assert_eq!(ids, vec![0]);
        assert_eq!(plan.stopped, Some((TensorId(1), Stop::Blocked)));
        assert!(Prefetcher::new(PrefetchConfig { max_depth: 0, ..PrefetchConfig::default() }).is_err());
    }
}
