//! Units gathered from the ranks' shards (ZeRO-3 / FSDP `FULL_SHARD`,
//! [`super::RuntimeConfig::shard_parameters`]): each rank's tiers hold its shard of every unit's
//! compute copy; a fetch brings the shard H2D and all-gathers the whole unit on the compute
//! device. [`Gathered`] keeps gathered units for their next use while its byte budget allows
//! (DeepSpeed's `stage3_max_reuse_distance`, FSDP's `reshard_after_forward = False`), evicting
//! the one whose next use is farthest (Belady's MIN over the last step's fetch order; the least
//! recently used before the first step is recorded).
//!
//! **Every rank decides the same.** A miss is an all-gather, a collective: every rank must miss
//! on the same fetches. The decisions here depend only on the sequence of fetches, the units in
//! use and the budget — the same on every rank of a dense model (the trainer fetches the same
//! units in the same order everywhere) — never on timing, on threads, or on what the residency
//! manager happened to evict. A unit's entry goes when its update is published (at the end of
//! the step that pushed its gradients, on every rank alike).

use std::sync::Arc;

use oogc_swapper::DType;

use super::{Result, UnitId};

/// The fetch's collective step (and the end of a step's, for units whose new copy is whole on
/// every rank): a unit's compute copy of `numel` elements of `dtype` from every rank's shard
/// (`shard` is this rank's [`crate::dist::shard_range`]), as bytes
/// ([`crate::dist::Ranks::all_gather_shards`]). Every rank calls it for the same units in the
/// same order. `shard` itself in a world of one.
///
/// # Errors
/// The collective failed ([`super::RuntimeError::Dist`]).
///
/// # Panics
/// When `shard` is not this rank's shard's size.
pub(super) fn all_gather_unit(ranks: &crate::dist::Ranks, shard: &[u8], numel: usize, dtype: DType) -> Result<Vec<u8>> {
    Ok(ranks.all_gather_shards(shard, numel, dtype.size_in_bytes())?)
}

/// One gathered unit: the whole compute copy as a tensor on the compute device.
struct Entry {
    unit: UnitId,
    tensor: candle_core::Tensor,
    bytes: u64,
    /// Held by every [`super::UnitParams`] handed out for it: in use while more than one.
    in_use: Arc<()>,
    /// The fetch (counted over the run) that used it last.
    last_use: u64,
}

/// The gathered units a rank keeps, within a byte budget. See the module docs.
pub(super) struct Gathered {
    entries: Vec<Entry>,
    capacity_bytes: u64,
    /// Units fetched this step, in order (the next step's schedule).
    order: Vec<UnitId>,
    /// The last step's fetch order: where each unit is used next.
    schedule: Vec<UnitId>,
    /// Fetches so far (over the run): the LRU clock.
    fetches: u64,
}

impl Gathered {
    pub(super) fn new() -> Self {
        Self { entries: Vec::new(), capacity_bytes: 0, order: Vec::new(), schedule: Vec::new(), fetches: 0 }
    }

    /// The bytes gathered units may hold at once (GPU memory beside the residency manager's).
    pub(super) fn set_capacity_bytes(&mut self, bytes: u64) {
        self.capacity_bytes = bytes;
    }

    pub(super) fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes the gathered units hold now.
    pub(super) fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// A fetch of `unit` (`scheduled`: part of the step's order, not an evaluation): its
    /// gathered tensor and the guard marking it in use, if it is kept.
    pub(super) fn get(&mut self, unit: UnitId, scheduled: bool) -> Option<(candle_core::Tensor, Arc<()>)> {
        if scheduled {
            self.order.push(unit);
        }
        self.fetches += 1;
        let now = self.fetches;
        let e = self.entries.iter_mut().find(|e| e.unit == unit)?;
        e.last_use = now;
        Some((e.tensor.clone(), e.in_use.clone()))
    }

    /// Keeps a unit just gathered (after [`Gathered::get`] missed it), first evicting unused
    /// entries by farthest next use until it fits; returns the guard marking it in use. Entries
    /// in use stay: the budget may be exceeded while the caller holds more units than it planned.
    pub(super) fn insert(&mut self, unit: UnitId, tensor: candle_core::Tensor, bytes: u64) -> Arc<()> {
        self.remove(unit);
        while self.bytes() + bytes > self.capacity_bytes {
            let Some(victim) = self.victim() else { break };
            self.entries.swap_remove(victim);
        }
        let in_use = Arc::new(());
        self.entries.push(Entry { unit, tensor, bytes, in_use: in_use.clone(), last_use: self.fetches });
        in_use
    }

    /// Drops `unit`'s gathered copy (its compute copy changed).
    pub(super) fn remove(&mut self, unit: UnitId) {
        self.entries.retain(|e| e.unit != unit);
    }

    /// Ends the step: its fetch order becomes the schedule the next step's evictions follow.
    pub(super) fn end_step(&mut self) {
        if !self.order.is_empty() {
            self.schedule = std::mem::take(&mut self.order);
        }
    }

    /// The unused entry to evict: the one used farthest ahead in the schedule (not at all: the
    /// farthest of all), ties and the first step by least recent use.
    fn victim(&self) -> Option<usize> {
        let position = self.order.len();
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| Arc::strong_count(&e.in_use) == 1)
            .max_by_key(|(_, e)| (self.next_use(e.unit, position), std::cmp::Reverse(e.last_use)))
            .map(|(k, _)| k)
    }

    /// Fetches from `position` of this step until `unit` is fetched again, by the last step's
    /// order (this step's rest, then the next step's); `usize::MAX` when it is not in it, or
    /// before a schedule exists (then LRU decides).
    fn next_use(&self, unit: UnitId, position: usize) -> usize {
        let n = self.schedule.len();
        if n == 0 {
            return usize::MAX;
        }
        let later = self.schedule.iter().skip(position).position(|&u| u == unit);
        match later {
            Some(k) => k,
            None => match self.schedule.iter().position(|&u| u == unit) {
                Some(k) => n.saturating_sub(position) + k,
                None => usize::MAX,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> candle_core::Tensor {
        candle_core::Tensor::zeros(4, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap()
    }

    /// Fetches `units` in order as a trainer would, each kept (budget permitting) and released
    /// at once; returns the misses.
    fn step(g: &mut Gathered, units: &[usize]) -> Vec<usize> {
        let mut missed = Vec::new();
        for &u in units {
            if g.get(UnitId(u), true).is_none() {
                missed.push(u);
                drop(g.insert(UnitId(u), t(), 10));
            }
        }
        g.end_step();
        missed
    }

    #[test]
    fn the_farthest_next_use_goes_first_once_a_step_is_recorded() {
        let mut g = Gathered::new();
        g.set_capacity_bytes(20);
        // Three units fetched in a cycle, room for two: LRU misses every fetch.
        let order = [0, 1, 2];
        assert_eq!(step(&mut g, &order), [0, 1, 2], "the first step: nothing kept yet");
        // With the first step as the schedule (worked by hand): at 0's miss, 1 is used next and
        // 2 after it, so 2 goes; at 2's miss, 0 (the next step's first) stays and 1 goes; ...
        // half of LRU's misses.
        assert_eq!(step(&mut g, &order), [0, 2]);
        assert_eq!(step(&mut g, &order), [1]);
        assert_eq!(step(&mut g, &order), [0, 2]);
        assert_eq!(step(&mut g, &order), [1]);
    }

    #[test]
    fn units_in_use_are_never_evicted_and_removed_copies_miss() {
        let mut g = Gathered::new();
        g.set_capacity_bytes(10);
        let held = g.insert(UnitId(0), t(), 10);
        let _other = g.insert(UnitId(1), t(), 10);
        // Over budget while the caller holds both: nothing in use was dropped.
        assert_eq!(g.bytes(), 20);
        drop(held);
        assert!(g.get(UnitId(0), true).is_some());
        g.remove(UnitId(0));
        assert!(g.get(UnitId(0), true).is_none());
    }
}
