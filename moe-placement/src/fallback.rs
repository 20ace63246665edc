//! The eviction priority of expert copies, for the prefetch crate's fallback hook.
//!
//! An expert's next use is not in the recorded schedule (it depends on the router), so
//! `oogc_prefetch::NextUsePolicy` ranks experts by a fallback policy
//! (`NextUsePolicy::with_fallback`). [`PopularityFallback`] is that policy: the expert expected
//! to serve the fewest tokens per byte goes first (MoE-Infinity's activation-aware eviction).

use std::collections::HashMap;

use oogc_swapper::{EvictionCandidate, EvictionPolicy, TensorId};

use crate::stats::{ExpertId, StatsHandle};

/// Largest priority this policy returns (`NextUsePolicy` adds fallback priorities to its
/// unknown-unit band and caps them below `2^62`).
pub const MAX_PRIORITY: u64 = (1 << 62) - 1;

/// Ranks expert copies by popularity: priority falls as the expected tokens per byte rise, so
/// the least popular copy is evicted first. Among equally popular copies the one used longest
/// ago goes first (then the swapper's tie-breaking: larger, then lower id).
///
/// | candidate | priority |
/// |---|---|
/// | a tensor the map does not know | [`MAX_PRIORITY`] (first to go) |
/// | expert with `x` expected tokens per MiB | `MAX_PRIORITY / (1 + x)`, lowered by recency within a quantum |
///
/// Reads the statistics through a [`StatsHandle`] (its lock is taken inside the swapper's
/// lock; see [`StatsHandle`] for the lock order).
#[derive(Debug, Clone)]
pub struct PopularityFallback {
    stats: StatsHandle,
    experts: HashMap<TensorId, ExpertId>,
}

impl PopularityFallback {
    /// A policy over `stats`, with `experts` mapping each swapper tensor of an expert's compute
    /// copy to its (block, expert). Several tensors may map to one expert.
    ///
    /// ```
    /// use oogc_moe_placement::{ExpertId, PopularityFallback, PopularityStats, StatsHandle};
    /// use oogc_swapper::TensorId;
    /// let stats = StatsHandle::new(PopularityStats::new(2, 8, 0.9).unwrap());
    /// let map = (0..16u64).map(|i| (TensorId(100 + i), ExpertId::new((i / 8) as u32, (i % 8) as u32)));
    /// let fallback = PopularityFallback::new(stats.clone(), map);
    /// // let policy = oogc_prefetch::NextUsePolicy::new(schedule).with_fallback(Box::new(fallback));
    /// # let _ = fallback;
    /// ```
    pub fn new(stats: StatsHandle, experts: impl IntoIterator<Item = (TensorId, ExpertId)>) -> Self {
        Self { stats, experts: experts.into_iter().collect() }
    }

    /// The expert of `id`, if it is one.
    pub fn expert(&self, id: TensorId) -> Option<ExpertId> {
        self.experts.get(&id).copied()
    }
}

impl EvictionPolicy for PopularityFallback {
    fn name(&self) -> &str {
        "moe-popularity"
    }

    fn priority(&self, candidate: &EvictionCandidate, clock: u64) -> u64 {
        let Some(&id) = self.experts.get(&candidate.id) else {
            return MAX_PRIORITY;
        };
        let tokens = self.stats.lock().expected_tokens(id);
        let per_mib = tokens / (candidate.num_bytes.max(1) as f64 / (1u64 << 20) as f64);
        // 2^52 popularity levels, then up to 2^10 - 1 of recency (age in the manager's clock).
        let level = ((MAX_PRIORITY >> 10) as f64 / (1.0 + per_mib.max(0.0))) as u64;
        let age = clock.saturating_sub(candidate.last_use).min((1 << 10) - 1);
        (level << 10 | age).min(MAX_PRIORITY)
    }
}

#[cfg(test)]
mod tests {
    use oogc_swapper::policy::eviction_order;
    use oogc_swapper::Tier;

    use super::*;
    use crate::stats::PopularityStats;

    fn cand(id: u64, last_use: u64) -> EvictionCandidate {
        EvictionCandidate { id: TensorId(id), tier: Tier::Device, num_bytes: 1 << 20, last_use, dirty: false }
    }

    #[test]
    fn the_least_popular_expert_is_evicted_first() {
        let stats = StatsHandle::new(PopularityStats::new(1, 4, 0.5).unwrap());
        stats.update(0, 0, &[50, 0, 400, 3]).unwrap();
        let map = (0..4).map(|e| (TensorId(10 + e), ExpertId::new(0, e as u32)));
        let policy = PopularityFallback::new(stats.clone(), map);
        // Expert 1 (0 tokens) was used most recently, expert 2 (400 tokens) longest ago:
        // popularity decides, not recency. TensorId 99 is no expert: first.
        let mut c = vec![cand(10, 5), cand(11, 9), cand(12, 1), cand(13, 7), cand(99, 9)];
        eviction_order(&policy, &mut c, 10);
        let order: Vec<u64> = c.iter().map(|c| c.id.0).collect();
        assert_eq!(order, vec![99, 11, 13, 10, 12]);
        // The routing shifts: expert 2 goes quiet, expert 1 busy.
        for s in 1..6 {
            stats.update(s, 0, &[50, 500, 0, 3]).unwrap();
        }
        eviction_order(&policy, &mut c, 10);
        let order: Vec<u64> = c.iter().map(|c| c.id.0).collect();
        assert_eq!(order, vec![99, 13, 12, 10, 11]);
        // Equal popularity: the older copy goes first.
        let stats = StatsHandle::new(PopularityStats::new(1, 2, 0.5).unwrap());
        stats.update(0, 0, &[7, 7]).unwrap();
        let policy =
            PopularityFallback::new(stats, [(TensorId(1), ExpertId::new(0, 0)), (TensorId(2), ExpertId::new(0, 1))]);
        let mut c = vec![cand(1, 8), cand(2, 3)];
        eviction_order(&policy, &mut c, 10);
        assert_eq!(c[0].id, TensorId(2));
        assert!(policy.priority(&cand(1, 0), u64::MAX) <= MAX_PRIORITY);
    }
}
