//! Eviction policies: which resident, unpinned copy to evict first.
//!
//! The residency manager asks a policy to rank its candidates whenever a tier must make room;
//! the policy never does I/O (decisions in, decisions out), so it can be simulated and tested
//! alone. [`LruPolicy`] is built in; the prefetch crate supplies the next-use (Belady's MIN)
//! policy for traced schedules, and the MoE crate a popularity fallback for experts.

use crate::tier::{TensorId, Tier};

/// A copy the manager could evict, as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictionCandidate {
    /// The tensor.
    pub id: TensorId,
    /// The tier the copy would leave.
    pub tier: Tier,
    /// Bytes the eviction frees on that tier.
    pub num_bytes: u64,
    /// The manager's logical clock at the copy's last acquire or arrival (larger = more recent).
    pub last_use: u64,
    /// Whether evicting needs a write-back to the tier below (the copy is newer than it).
    pub dirty: bool,
}

/// Ranks eviction candidates. Higher [`EvictionPolicy::priority`] is evicted first; ties are
/// broken by larger `num_bytes`, then by tensor id, so a ranking is deterministic.
///
/// `on_acquire` is called, under the manager's lock, at every acquire and prefetch, in order:
/// a schedule-following policy advances its position there.
pub trait EvictionPolicy: Send + 'static {
    /// A short name for logs and benchmark tables (`lru`, `next-use`).
    fn name(&self) -> &str;

    /// Notes that `id` was acquired (or prefetched, `prefetch` true) on `tier` at logical time `clock`.
    fn on_acquire(&mut self, id: TensorId, tier: Tier, clock: u64, prefetch: bool) {
        let _ = (id, tier, clock, prefetch);
    }

    /// The eviction priority of `candidate` at logical time `clock`: larger is evicted first.
    fn priority(&self, candidate: &EvictionCandidate, clock: u64) -> u64;

    /// Notes that the manager chose `id`'s copy on `tier` as a victim (it is dropped, or written
    /// back then dropped) at logical time `clock`. Default: nothing. Insertion-ordered policies
    /// (FIFO) use it to forget an arrival, so a refetched copy counts as new.
    fn on_evict(&mut self, id: TensorId, tier: Tier, clock: u64) {
        let _ = (id, tier, clock);
    }
}

/// Least recently used: the copy whose last acquire is oldest goes first.
#[derive(Debug, Default, Clone, Copy)]
pub struct LruPolicy;

impl EvictionPolicy for LruPolicy {
    fn name(&self) -> &str {
        "lru"
    }

    fn priority(&self, candidate: &EvictionCandidate, clock: u64) -> u64 {
        clock.saturating_sub(candidate.last_use)
    }
}

/// Sorts `candidates` into eviction order under `policy` (first = evict first).
pub fn eviction_order(policy: &dyn EvictionPolicy, candidates: &mut [EvictionCandidate], clock: u64) {
    candidates.sort_by(|a, b| {
        policy
            .priority(b, clock)
            .cmp(&policy.priority(a, clock))
            .then(b.num_bytes.cmp(&a.num_bytes))
            .then(a.id.cmp(&b.id))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: u64, bytes: u64, last_use: u64) -> EvictionCandidate {
        EvictionCandidate { id: TensorId(id), tier: Tier::Device, num_bytes: bytes, last_use, dirty: false }
    }

    #[test]
    fn lru_evicts_oldest_first_and_breaks_ties_by_size() {
        let mut c = vec![cand(1, 10, 5), cand(2, 10, 1), cand(3, 20, 5), cand(4, 5, 9)];
        eviction_order(&LruPolicy, &mut c, 10);
        let order: Vec<u64> = c.iter().map(|c| c.id.0).collect();
        assert_eq!(order, vec![2, 3, 1, 4]);
    }
}
