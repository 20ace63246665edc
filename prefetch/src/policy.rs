//! Eviction policies for the swapper: next-use distance (Belady's MIN over the schedule), its
//! offline form, and FIFO as a baseline.
//!
//! **Belady's MIN** (L. A. Belady, "A study of replacement algorithms for a virtual-storage
//! computer", IBM Systems Journal 5(2), 1966): evict the copy whose next use is farthest in the
//! future. With units of unequal sizes MIN is a heuristic, not optimal; ties go to the larger
//! unit (the swapper's `eviction_order` breaks ties by size).
//!
//! [`NextUsePolicy`] keeps its position in the schedule itself: every demand acquire on the
//! device (`on_acquire` with `prefetch == false`, which the swapper calls in order from the
//! compute thread) is matched against the schedule, so prefetches and host-tier acquires from
//! optimizer threads do not move it. The runtime reads the position through a
//! [`CursorHandle`] (for the prefetcher) and learns from [`CursorHandle::mismatches`] that the
//! access order changed and the trace should be re-recorded.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use oogc_swapper::{EvictionCandidate, EvictionPolicy, LruPolicy, TensorId, Tier};
use parking_lot::Mutex;

use crate::schedule::Schedule;

/// Priority band of copies that are never used again, or are stale before their next use.
pub const PRIORITY_DEAD: u64 = u64::MAX;
/// Start of the priority band of units the schedule does not know (MoE experts); the fallback's
/// priority is added, capped below [`PRIORITY_DEAD`]. Known next-use distances lie below it.
pub const PRIORITY_UNKNOWN: u64 = 1 << 62;

#[derive(Debug)]
struct CursorState {
    schedule: Arc<Schedule>,
    /// Absolute device position of the last matched demand acquire (starts at `n - 1`: the end
    /// of "step -1", so the first expected access is position `n`).
    pos: u64,
    /// Demand acquires that did not land on the expected next position.
    mismatches: u64,
    /// Demand acquires matched.
    matched: u64,
    /// Demand acquires of units the schedule does not know.
    unknown: u64,
    /// Position at the last device on_acquire (demand or prefetch) of each unit.
    last_device: HashMap<TensorId, u64>,
    /// Units whose host copy was acquired (e.g. written by the optimizer) since their last device acquire.
    host_seen: HashSet<TensorId>,
    /// Positions at or beyond this are "never" (offline MIN's horizon); `None`: cyclic forever.
    horizon: Option<u64>,
}

impl CursorState {
    fn new(schedule: Arc<Schedule>, horizon_steps: Option<u64>) -> Self {
        let n = schedule.device_len();
        Self {
            pos: n - 1,
            horizon: horizon_steps.map(|s| n + s * n),
            schedule,
            mismatches: 0,
            matched: 0,
            unknown: 0,
            last_device: HashMap::new(),
            host_seen: HashSet::new(),
        }
    }

    fn on_demand_device(&mut self, id: TensorId) {
        let s = &self.schedule;
        if !s.is_scheduled(id) {
            self.unknown += 1;
            return;
        }
        let expected = self.pos + 1;
        if s.device_unit(expected) == id {
            self.pos = expected;
            self.matched += 1;
        } else if self.matched > 0 && s.device_unit(self.pos) == id {
            // A repeated acquire of the current entry: stay.
        } else {
            let p = s.next_use(id, self.pos).expect("scheduled unit has a next use");
            self.pos = p;
            self.mismatches += 1;
        }
    }

    /// Device-copy priority of `id` at the current position.
    fn device_priority(&self, id: TensorId) -> Option<u64> {
        let s = &self.schedule;
        let c = self.pos;
        let p = s.next_use(id, c)?;
        if self.horizon.is_some_and(|h| p >= h) || s.invalidated_between(id, c, p) {
            return Some(PRIORITY_DEAD);
        }
        // A write placed between the copy's arrival and now that the optimizer has not done
        // yet (it runs on other threads, behind the schedule): the copy is about to go stale.
        if let Some(&since) = self.last_device.get(&id) {
            if since < c && !self.host_seen.contains(&id) && s.invalidated_between(id, since, c) {
                return Some(PRIORITY_DEAD);
            }
        }
        Some(p - c)
    }

    /// Host-copy priority: distance to the next access at any tier (a device fetch needs the host copy).
    fn host_priority(&self, id: TensorId) -> Option<u64> {
        let s = &self.schedule;
        let c = self.pos;
        let d = [s.next_use(id, c), s.next_host_use(id, c)].into_iter().flatten().min()?;
        if self.horizon.is_some_and(|h| d >= h) {
            return Some(PRIORITY_DEAD);
        }
        Some(d - c)
    }
}

/// A shared view of a [`NextUsePolicy`]'s position, for the runtime and the prefetch driver.
///
/// Cloning shares the state. Do not call it while holding the swapper's lock (the swapper calls
/// the policy under its own lock; this handle takes the policy's lock).
#[derive(Debug, Clone)]
pub struct CursorHandle(Arc<Mutex<CursorState>>);

impl CursorHandle {
    /// The absolute device position of the last demand acquire (see [`crate::schedule`]): the
    /// prefetcher plans from here. Before the first acquire it is `n - 1`.
    pub fn position(&self) -> u64 {
        self.0.lock().pos
    }

    /// The schedule the policy follows.
    pub fn schedule(&self) -> Arc<Schedule> {
        self.0.lock().schedule.clone()
    }

    /// Demand acquires that did not land on the next scheduled position. A count that keeps
    /// growing means the access order changed: record a new trace and call
    /// [`CursorHandle::set_schedule`].
    pub fn mismatches(&self) -> u64 {
        self.0.lock().mismatches
    }

    /// Demand acquires of units the schedule does not know (ranked by the fallback).
    pub fn unknown_acquires(&self) -> u64 {
        self.0.lock().unknown
    }

    /// Replaces the schedule (after re-recording) and restarts at the beginning of a step.
    pub fn set_schedule(&self, schedule: Arc<Schedule>) {
        let mut st = self.0.lock();
        let horizon = st.horizon.map(|h| (h - st.schedule.device_len()) / st.schedule.device_len());
        *st = CursorState::new(schedule, horizon);
    }

    /// Sets the position to the end of the current step (`position` rounded up to `k·n - 1`),
    /// so that the next demand acquire is expected at the start of a step. Call it between
    /// steps if a step ended early (an error, an interrupted step).
    pub fn restart_step(&self) {
        let mut st = self.0.lock();
        let n = st.schedule.device_len();
        st.pos = (st.pos / n) * n + n - 1;
    }

    /// The priority the policy gives `id`'s device copy now (see [`NextUsePolicy`]); `None` for a
    /// unit outside the schedule.
    pub fn device_priority(&self, id: TensorId) -> Option<u64> {
        self.0.lock().device_priority(id)
    }
}

/// Belady's MIN over the recorded schedule: the eviction priority of a copy is its next-use
/// distance (device accesses until its next use, wrapping into the next step), so the copy used
/// farthest in the future goes first; ties go to the larger copy.
///
/// | copy | priority |
/// |---|---|
/// | never used again, or made stale (optimizer write) before its next use | [`PRIORITY_DEAD`] (first to go) |
/// | unit outside the schedule (MoE experts) | [`PRIORITY_UNKNOWN`] + the fallback's priority (default LRU) |
/// | next use `d` device accesses ahead | `d` |
///
/// Host-tier copies rank by the distance to the next access at any tier.
///
/// ```
/// use std::sync::Arc;
/// use oogc_prefetch::{NextUsePolicy, Schedule};
/// use oogc_swapper::TensorId;
/// let units: Vec<_> = (0..4).map(|i| (TensorId(i), 1 << 20)).collect();
/// let schedule = Arc::new(Schedule::training_step(&units, true).unwrap());
/// let policy = NextUsePolicy::new(schedule);
/// let cursor = policy.cursor(); // keep: the prefetch driver reads the position from it
/// // manager.set_policy(Box::new(policy));
/// # let _ = cursor;
/// ```
pub struct NextUsePolicy {
    state: Arc<Mutex<CursorState>>,
    fallback: Box<dyn EvictionPolicy>,
    name: &'static str,
}

impl std::fmt::Debug for NextUsePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NextUsePolicy").field("name", &self.name).field("fallback", &self.fallback.name()).finish()
    }
}

impl NextUsePolicy {
    /// The online policy over `schedule`, treated as cyclic (the same every step); fallback
    /// [`LruPolicy`] for units outside it.
    pub fn new(schedule: Arc<Schedule>) -> Self {
        Self {
            state: Arc::new(Mutex::new(CursorState::new(schedule, None))),
            fallback: Box::new(LruPolicy),
            name: "next-use",
        }
    }

    /// Offline MIN over exactly `steps` repetitions of `schedule` (positions past them are never
    /// used): the reference the online policy is compared with. Named `min`.
    pub fn offline(schedule: Arc<Schedule>, steps: u64) -> Self {
        Self {
            state: Arc::new(Mutex::new(CursorState::new(schedule, Some(steps)))),
            fallback: Box::new(LruPolicy),
            name: "min",
        }
    }

    /// A policy sharing `cursor`'s state (its position and schedule), with an LRU fallback: a
    /// second view for ranking (the prefetch driver asks it for priorities). Do not install
    /// two views that both receive `on_acquire` calls: each would advance the shared position.
    pub fn from_cursor(cursor: CursorHandle) -> Self {
        Self { state: cursor.0, fallback: Box::new(LruPolicy), name: "next-use" }
    }

    /// Ranks units outside the schedule (MoE experts) by `fallback` instead of LRU.
    pub fn with_fallback(mut self, fallback: Box<dyn EvictionPolicy>) -> Self {
        self.fallback = fallback;
        self
    }

    /// A handle on the policy's position, shared with the policy once it is boxed into the swapper.
    pub fn cursor(&self) -> CursorHandle {
        CursorHandle(self.state.clone())
    }
}

impl EvictionPolicy for NextUsePolicy {
    fn name(&self) -> &str {
        self.name
    }

    fn on_acquire(&mut self, id: TensorId, tier: Tier, clock: u64, prefetch: bool) {
        {
            let mut st = self.state.lock();
            match (tier, prefetch) {
                (Tier::Device, false) => {
                    st.on_demand_device(id);
                    let pos = st.pos;
                    st.last_device.insert(id, pos);
                    st.host_seen.remove(&id);
                }
                (Tier::Device, true) => {
                    let pos = st.pos;
                    st.last_device.insert(id, pos);
                    st.host_seen.remove(&id);
                }
                (_, false) => {
                    st.host_seen.insert(id);
                }
                (_, true) => {}
            }
        }
        self.fallback.on_acquire(id, tier, clock, prefetch);
    }

    fn on_evict(&mut self, id: TensorId, tier: Tier, clock: u64) {
        self.fallback.on_evict(id, tier, clock);
    }

    fn priority(&self, candidate: &EvictionCandidate, clock: u64) -> u64 {
        let st = self.state.lock();
        let known = match candidate.tier {
            Tier::Device => st.device_priority(candidate.id),
            _ => st.host_priority(candidate.id),
        };
        drop(st);
        known.unwrap_or_else(|| {
            PRIORITY_UNKNOWN.saturating_add(self.fallback.priority(candidate, clock).min(PRIORITY_UNKNOWN - 1))
        })
    }
}

/// First in, first out: the copy that arrived on its tier earliest goes first, whatever its use
/// since. A baseline for `oogc bench evict`. Needs the swapper's `on_evict` calls to forget a
/// copy that left; a host-tier demand acquire (which may drop a stale device copy) also
/// forgets the device arrival.
#[derive(Debug, Default, Clone)]
pub struct FifoPolicy {
    arrival: HashMap<(TensorId, Tier), u64>,
}

impl FifoPolicy {
    /// An empty FIFO.
    pub fn new() -> Self {
        Self::default()
    }
}

impl EvictionPolicy for FifoPolicy {
    fn name(&self) -> &str {
        "fifo"
    }

    fn on_acquire(&mut self, id: TensorId, tier: Tier, clock: u64, prefetch: bool) {
        if tier == Tier::Host && !prefetch {
            self.arrival.remove(&(id, Tier::Device));
        }
        self.arrival.entry((id, tier)).or_insert(clock);
    }

    fn on_evict(&mut self, id: TensorId, tier: Tier, _clock: u64) {
        self.arrival.remove(&(id, tier));
    }

    fn priority(&self, candidate: &EvictionCandidate, clock: u64) -> u64 {
        let arrived = self.arrival.get(&(candidate.id, candidate.tier)).copied().unwrap_or(candidate.last_use);
        clock.saturating_sub(arrived)
    }
}

/// Which eviction policy to build (for benchmarks, the simulator and configs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// [`NextUsePolicy`] (online, cyclic schedule).
    NextUse,
    /// The swapper's [`LruPolicy`].
    Lru,
    /// [`FifoPolicy`].
    Fifo,
    /// [`NextUsePolicy::offline`] over the simulated steps.
    Min,
}

impl PolicyKind {
    /// All kinds, in table order.
    pub const ALL: [PolicyKind; 4] = [PolicyKind::NextUse, PolicyKind::Lru, PolicyKind::Fifo, PolicyKind::Min];

    /// The policy's name (as its `EvictionPolicy::name`).
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::NextUse => "next-use",
            PolicyKind::Lru => "lru",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Min => "min",
        }
    }

    /// Builds the policy for `schedule`; `steps` is the horizon of [`PolicyKind::Min`].
    pub fn build(self, schedule: Arc<Schedule>, steps: u64) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::NextUse => Box::new(NextUsePolicy::new(schedule)),
            PolicyKind::Lru => Box::new(LruPolicy),
            PolicyKind::Fifo => Box::new(FifoPolicy::new()),
            PolicyKind::Min => Box::new(NextUsePolicy::offline(schedule, steps)),
        }
    }
}

#[cfg(test)]
mod tests {
    use oogc_swapper::policy::eviction_order;

    use super::*;

    fn cand(id: u64, bytes: u64) -> EvictionCandidate {
        EvictionCandidate { id: TensorId(id), tier: Tier::Device, num_bytes: bytes, last_use: 0, dirty: false }
    }

    fn sched(n: u64, opt: bool) -> Arc<Schedule> {
        let units: Vec<_> = (0..n).map(|i| (TensorId(i), 100)).collect();
        Arc::new(Schedule::training_step(&units, opt).unwrap())
    }

    #[test]
    fn evicts_the_farthest_next_use_first() {
        let mut p = NextUsePolicy::new(sched(4, false));
        // F0 F1 F2 F3 B3 B2 B1 B0
        for (c, u) in [0, 1, 2].into_iter().enumerate() {
            p.on_acquire(TensorId(u), Tier::Device, c as u64 + 1, false);
        }
        assert_eq!(p.cursor().position(), 8 + 2);
        let mut c = vec![cand(0, 100), cand(1, 100), cand(2, 100)];
        eviction_order(&p, &mut c, 10);
        // Next uses: 2 at B2 (5), 1 at B1 (6), 0 at B0 (7): unit 0 is farthest.
        let order: Vec<u64> = c.iter().map(|c| c.id.0).collect();
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(p.cursor().mismatches(), 0);
    }

    #[test]
    fn keeps_the_backward_end_for_the_next_forward_and_counts_mismatches() {
        let mut p = NextUsePolicy::new(sched(4, false));
        for (c, u) in [0, 1, 2, 3, 3, 2, 1].into_iter().enumerate() {
            p.on_acquire(TensorId(u), Tier::Device, c as u64 + 1, false);
        }
        // At B1: unit 1 is next used at F1 (distance 1 + ... ), 3 at F3 of the next step.
        let cur = p.cursor();
        let d1 = cur.device_priority(TensorId(1)).unwrap();
        let d3 = cur.device_priority(TensorId(3)).unwrap();
        assert!(d1 < d3, "{d1} {d3}");
        assert_eq!(cur.mismatches(), 0);
        p.on_acquire(TensorId(3), Tier::Device, 9, false); // out of order
        assert_eq!(cur.mismatches(), 1);
    }

    #[test]
    fn stale_copies_go_first_until_the_optimizer_has_run() {
        let mut p = NextUsePolicy::new(sched(3, true));
        // F0 F1 F2 B2 (then the optimizer of 2 is due) B1
        for (c, u) in [0, 1, 2, 2, 1].into_iter().enumerate() {
            p.on_acquire(TensorId(u), Tier::Device, c as u64 + 1, false);
        }
        let cur = p.cursor();
        // 2's write is due before B1 but has not been seen: the copy is about to go stale.
        assert_eq!(cur.device_priority(TensorId(2)), Some(PRIORITY_DEAD));
        p.on_acquire(TensorId(2), Tier::Host, 7, false);
        p.on_acquire(TensorId(2), Tier::Device, 8, true); // refetched after the update
        assert!(cur.device_priority(TensorId(2)).unwrap() < PRIORITY_UNKNOWN);
    }

    #[test]
    fn unknown_units_rank_by_the_fallback_between_known_and_dead() {
        let p = NextUsePolicy::new(sched(2, false));
        let mut a = cand(50, 10);
        a.last_use = 1;
        let mut b = cand(51, 10);
        b.last_use = 5;
        let pa = p.priority(&a, 10);
        let pb = p.priority(&b, 10);
        assert!(pa > pb && pb > PRIORITY_UNKNOWN && pa < PRIORITY_DEAD);
        assert!(p.priority(&cand(0, 100), 10) < PRIORITY_UNKNOWN);
    }

    #[test]
    fn fifo_evicts_the_earliest_arrival() {
        let mut f = FifoPolicy::new();
        f.on_acquire(TensorId(1), Tier::Device, 1, false);
        f.on_acquire(TensorId(2), Tier::Device, 2, false);
        f.on_acquire(TensorId(1), Tier::Device, 3, false);
        let mut c = vec![cand(2, 1), cand(1, 1)];
        eviction_order(&f, &mut c, 4);
        assert_eq!(c[0].id, TensorId(1));
        f.on_evict(TensorId(1), Tier::Device, 4);
        f.on_acquire(TensorId(1), Tier::Device, 5, false);
        eviction_order(&f, &mut c, 6);
        assert_eq!(c[0].id, TensorId(2));
    }
}
