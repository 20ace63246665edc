//! The access trace of one training step and the schedule built from it.
//!
//! The trainer records every acquire of a unit in one step ([`TraceRecorder`]); the recorded
//! order is the [`Schedule`] of the following steps (the access order of a dense model is the
//! same every step). Positions in the schedule are counted in **device accesses**: position `p`
//! is the `p mod n`-th device-tier entry of step `p / n` (`n` = [`Schedule::device_len`]), so a
//! position keeps growing across steps and next-use distances wrap into the next step (the
//! schedule is cyclic, which keeps the forward's last units for the backward and the
//! backward's last units for the next forward, as Belady's MIN would).
//!
//! Host-tier entries are not positions; each is placed *before* a device position (the count of
//! device entries recorded before it). A host-tier write (the CPU optimizer writing a unit's
//! compute copy) makes the device copy stale: the swapper drops it, and the next device use
//! refetches it. Such an entry is an **invalidation** of the device copy.

use std::collections::{BTreeMap, HashMap};

use oogc_swapper::{TensorId, Tier};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The phase of a training step an access belongs to (DESIGN.md, "One training step").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// The forward pass: fetch, compute, keep the input activation (checkpoint).
    Forward,
    /// The backward pass: fetch, recompute from the checkpoint, VJP, gradients D2H.
    Backward,
    /// The CPU optimizer step of the unit (on the host copy).
    Optimizer,
    /// An off-schedule use between steps (validation): never recorded, no prefetch.
    Eval,
}

/// One acquire of a unit in the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleEntry {
    /// The unit: the swapper tensor of its flat compute copy.
    pub unit: TensorId,
    /// The phase of the step.
    pub phase: Phase,
    /// The tier it was acquired on.
    pub tier: Tier,
    /// Acquired for write (a host-tier write invalidates the device copy; a device-tier write
    /// makes it dirty).
    pub write: bool,
    /// Bytes pinned on `tier` at once while this acquire was held, this unit included.
    pub held_bytes: u64,
}

impl ScheduleEntry {
    /// A read access of `unit` on `tier` in `phase`, holding only itself (`held_bytes` is filled
    /// by [`Schedule::new`] from the unit's size when 0).
    pub fn new(unit: TensorId, phase: Phase, tier: Tier) -> Self {
        Self { unit, phase, tier, write: false, held_bytes: 0 }
    }

    /// The same access, for write.
    pub fn write(mut self) -> Self {
        self.write = true;
        self
    }
}

/// The schedule of a step: the recorded entries plus next-use tables.
///
/// Lookups ([`Schedule::next_use`]) are `O(log k)` in the number of accesses `k` of a unit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "ScheduleData", into = "ScheduleData")]
pub struct Schedule {
    entries: Vec<ScheduleEntry>,
    sizes: BTreeMap<TensorId, u64>,
    /// Device-tier entries in order: unit and index into `entries`.
    device: Vec<(TensorId, usize)>,
    /// Sorted device positions (in `0..n`) of each unit.
    dev_pos: HashMap<TensorId, Vec<u64>>,
    /// Positions (in `0..=n`, "before device entry d") of each unit's host-tier writes.
    inv_pos: HashMap<TensorId, Vec<u64>>,
    /// Positions of each unit's host-tier accesses (read or write).
    host_pos: HashMap<TensorId, Vec<u64>>,
}

#[derive(Serialize, Deserialize)]
struct ScheduleData {
    entries: Vec<ScheduleEntry>,
    sizes: Vec<(TensorId, u64)>,
}

impl From<ScheduleData> for Schedule {
    fn from(d: ScheduleData) -> Self {
        Self::build(d.entries, d.sizes.into_iter().collect())
    }
}

impl From<Schedule> for ScheduleData {
    fn from(s: Schedule) -> Self {
        ScheduleData { entries: s.entries, sizes: s.sizes.into_iter().collect() }
    }
}

impl Schedule {
    /// A schedule from recorded `entries` and each unit's size in bytes (`sizes`).
    ///
    /// # Errors
    /// [`Error::UnknownUnit`] when an entry's unit has no size; [`Error::EmptySchedule`] when no
    /// entry is on the device tier.
    pub fn new(entries: Vec<ScheduleEntry>, sizes: impl IntoIterator<Item = (TensorId, u64)>) -> Result<Self> {
        let sizes: BTreeMap<TensorId, u64> = sizes.into_iter().collect();
        if let Some(e) = entries.iter().find(|e| !sizes.contains_key(&e.unit)) {
            return Err(Error::UnknownUnit { unit: e.unit });
        }
        if !entries.iter().any(|e| e.tier == Tier::Device) {
            return Err(Error::EmptySchedule);
        }
        Ok(Self::build(entries, sizes))
    }

    fn build(mut entries: Vec<ScheduleEntry>, sizes: BTreeMap<TensorId, u64>) -> Self {
        let mut device = Vec::new();
        let mut dev_pos: HashMap<TensorId, Vec<u64>> = HashMap::new();
        let mut inv_pos: HashMap<TensorId, Vec<u64>> = HashMap::new();
        let mut host_pos: HashMap<TensorId, Vec<u64>> = HashMap::new();
        for (i, e) in entries.iter_mut().enumerate() {
            if e.held_bytes == 0 {
                e.held_bytes = sizes.get(&e.unit).copied().unwrap_or(0);
            }
            let d = device.len() as u64;
            match e.tier {
                Tier::Device => {
                    dev_pos.entry(e.unit).or_default().push(d);
                    device.push((e.unit, i));
                }
                _ => {
                    host_pos.entry(e.unit).or_default().push(d);
                    if e.write {
                        inv_pos.entry(e.unit).or_default().push(d);
                    }
                }
            }
        }
        Self { entries, sizes, device, dev_pos, inv_pos, host_pos }
    }

    /// A synthetic training step (DESIGN.md): forward over `units` in order, backward in
    /// reverse, and, with `optimizer`, the unit's CPU optimizer step (a host-tier write) right
    /// after its backward. `units` are (unit, bytes) in forward order.
    ///
    /// # Errors
    /// [`Error::EmptySchedule`] for no units.
    pub fn training_step(units: &[(TensorId, u64)], optimizer: bool) -> Result<Self> {
        let mut entries = Vec::with_capacity(units.len() * 3);
        for &(u, _) in units {
            entries.push(ScheduleEntry::new(u, Phase::Forward, Tier::Device));
        }
        for &(u, _) in units.iter().rev() {
            entries.push(ScheduleEntry::new(u, Phase::Backward, Tier::Device));
            if optimizer {
                entries.push(ScheduleEntry::new(u, Phase::Optimizer, Tier::Host).write());
            }
        }
        Self::new(entries, units.iter().copied())
    }

    /// The recorded entries, in order.
    pub fn entries(&self) -> &[ScheduleEntry] {
        &self.entries
    }

    /// Number of device-tier entries per step (`n`; positions advance by one per device access).
    pub fn device_len(&self) -> u64 {
        self.device.len() as u64
    }

    /// The unit of device position `pos` (any step: `pos mod n`).
    pub fn device_unit(&self, pos: u64) -> TensorId {
        self.device[(pos % self.device_len()) as usize].0
    }

    /// The entry of device position `pos` (any step).
    pub fn device_entry(&self, pos: u64) -> &ScheduleEntry {
        &self.entries[self.device[(pos % self.device_len()) as usize].1]
    }

    /// Size of `unit` in bytes, if known.
    pub fn unit_bytes(&self, unit: TensorId) -> Option<u64> {
        self.sizes.get(&unit).copied()
    }

    /// Every unit with its size in bytes, by id.
    pub fn units(&self) -> impl Iterator<Item = (TensorId, u64)> + '_ {
        self.sizes.iter().map(|(k, v)| (*k, *v))
    }

    /// Sum of the sizes of the units accessed on the device, bytes.
    pub fn device_unit_bytes(&self) -> u64 {
        self.dev_pos.keys().map(|u| self.sizes[u]).sum()
    }

    /// Whether `unit` is accessed on the device in the schedule.
    pub fn is_scheduled(&self, unit: TensorId) -> bool {
        self.dev_pos.contains_key(&unit)
    }

    /// The first device position strictly after `pos` at which `unit` is used (wrapping into
    /// later steps); `None` when the schedule never uses it on the device.
    pub fn next_use(&self, unit: TensorId, pos: u64) -> Option<u64> {
        next_after(self.dev_pos.get(&unit)?, self.device_len(), pos)
    }

    /// The first host-tier access of `unit` placed after device position `pos` (an access
    /// "before device entry d" is placed at `d`, so this returns the first such `d > pos`).
    pub fn next_host_use(&self, unit: TensorId, pos: u64) -> Option<u64> {
        next_after(self.host_pos.get(&unit)?, self.device_len(), pos)
    }

    /// Whether a host-tier write of `unit` (an invalidation of its device copy) is placed in
    /// the device positions `(after, up_to]`.
    pub fn invalidated_between(&self, unit: TensorId, after: u64, up_to: u64) -> bool {
        match self.inv_pos.get(&unit) {
            Some(list) => next_after(list, self.device_len(), after).is_some_and(|d| d <= up_to),
            None => false,
        }
    }

    /// The next-use distance of `unit`'s device copy seen from position `pos`: device accesses
    /// until its next use, or `None` when it has no next use in the schedule or its copy is
    /// invalidated (made stale by a host write) before that use.
    pub fn next_use_distance(&self, unit: TensorId, pos: u64) -> Option<u64> {
        let p = self.next_use(unit, pos)?;
        if self.invalidated_between(unit, pos, p) {
            return None;
        }
        Some(p - pos)
    }

    /// Whether `other` accesses the same units in the same order on the same tiers (the test for
    /// re-recording: a schedule that changed must replace the old one).
    pub fn same_accesses(&self, other: &Schedule) -> bool {
        self.entries.len() == other.entries.len()
            && self
                .entries
                .iter()
                .zip(&other.entries)
                .all(|(a, b)| a.unit == b.unit && a.tier == b.tier && a.write == b.write)
            && self.sizes == other.sizes
    }
}

/// The first value `> pos` of `base + k·n` over `base` in `list` (sorted, in `0..=n`) and `k ≥ 0`.
fn next_after(list: &[u64], n: u64, pos: u64) -> Option<u64> {
    if list.is_empty() || n == 0 {
        return None;
    }
    let step = pos / n;
    let idx = pos % n;
    // Values in `list` may equal n ("before device entry n" = start of the next step).
    let i = list.partition_point(|&d| d <= idx);
    if i < list.len() {
        Some(step * n + list[i])
    } else {
        Some((step + 1) * n + list[0])
    }
}

/// The minimum device working set of `schedule`, bytes: the most a single device access holds
/// pinned at once (the unit plus any other unit held across it), and at least the largest unit
/// accessed on the device. A device budget below it cannot run the step.
pub fn min_working_set(schedule: &Schedule) -> u64 {
    schedule
        .entries()
        .iter()
        .filter(|e| e.tier == Tier::Device)
        .map(|e| e.held_bytes.max(schedule.unit_bytes(e.unit).unwrap_or(0)))
        .max()
        .unwrap_or(0)
}

/// Refuses a device budget below [`min_working_set`], before the step starts.
///
/// # Errors
/// [`Error::BudgetBelowWorkingSet`] with the minimum in bytes.
pub fn check_budget(schedule: &Schedule, device_budget_bytes: u64) -> Result<()> {
    let min_bytes = min_working_set(schedule);
    if device_budget_bytes < min_bytes {
        let largest_unit_bytes = schedule
            .entries()
            .iter()
            .filter(|e| e.tier == Tier::Device)
            .filter_map(|e| schedule.unit_bytes(e.unit))
            .max()
            .unwrap_or(0);
        return Err(Error::BudgetBelowWorkingSet {
            tier: Tier::Device,
            budget_bytes: device_budget_bytes,
            min_bytes,
            largest_unit_bytes,
        });
    }
    Ok(())
}

/// Records the access trace of one step: call [`TraceRecorder::acquire`] at every acquire of a
/// unit and [`TraceRecorder::release`] when its guard drops, then [`TraceRecorder::finish`].
///
/// ```
/// use oogc_prefetch::{Phase, TraceRecorder};
/// use oogc_swapper::{TensorId, Tier};
/// let mut rec = TraceRecorder::new();
/// for (u, bytes) in [(0, 100), (1, 200)] {
///     rec.acquire(TensorId(u), bytes, Phase::Forward, Tier::Device, false);
///     rec.release(TensorId(u), Tier::Device);
/// }
/// let schedule = rec.finish().unwrap();
/// assert_eq!(oogc_prefetch::min_working_set(&schedule), 200);
/// ```
#[derive(Debug, Default, Clone)]
pub struct TraceRecorder {
    entries: Vec<ScheduleEntry>,
    sizes: BTreeMap<TensorId, u64>,
    /// Pins held now: (unit, tier) → count.
    held: HashMap<(TensorId, Tier), u32>,
}

impl TraceRecorder {
    /// An empty trace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an acquire of `unit` (`num_bytes` bytes) on `tier` in `phase`; `write` for an
    /// acquire for write. The unit counts as held until [`TraceRecorder::release`]. An access in
    /// [`Phase::Eval`] is not recorded.
    pub fn acquire(&mut self, unit: TensorId, num_bytes: u64, phase: Phase, tier: Tier, write: bool) {
        if phase == Phase::Eval {
            // Off-schedule by definition.
            return;
        }
        self.sizes.insert(unit, num_bytes);
        *self.held.entry((unit, tier)).or_default() += 1;
        let held_bytes = self
            .held
            .iter()
            .filter(|((_, t), c)| *t == tier && **c > 0)
            .map(|((u, _), _)| self.sizes.get(u).copied().unwrap_or(0))
            .sum();
        self.entries.push(ScheduleEntry { unit, phase, tier, write, held_bytes });
    }

    /// Records that the guard of `unit` on `tier` dropped.
    pub fn release(&mut self, unit: TensorId, tier: Tier) {
        if let Some(c) = self.held.get_mut(&(unit, tier)) {
            *c = c.saturating_sub(1);
            if *c == 0 {
                self.held.remove(&(unit, tier));
            }
        }
    }

    /// Entries recorded so far.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The schedule of the recorded step.
    ///
    /// # Errors
    /// [`Error::EmptySchedule`] when no device acquire was recorded.
    pub fn finish(self) -> Result<Schedule> {
        Schedule::new(self.entries, self.sizes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u64) -> Vec<(TensorId, u64)> {
        (0..n).map(|i| (TensorId(i), 10 + i)).collect()
    }

    #[test]
    fn next_use_wraps_into_the_next_step() {
        let s = Schedule::training_step(&ids(3), false).unwrap();
        // device order: F0 F1 F2 B2 B1 B0 (n = 6)
        assert_eq!(s.device_len(), 6);
        assert_eq!(s.next_use(TensorId(2), 2), Some(3));
        assert_eq!(s.next_use(TensorId(0), 0), Some(5));
        assert_eq!(s.next_use(TensorId(0), 5), Some(6));
        assert_eq!(s.next_use(TensorId(1), 4), Some(7));
        assert_eq!(s.next_use(TensorId(9), 0), None);
        assert_eq!(s.next_use_distance(TensorId(1), 4), Some(3));
    }

    #[test]
    fn optimizer_writes_invalidate_the_device_copy() {
        let s = Schedule::training_step(&ids(3), true).unwrap();
        // B2 at 3, optimizer(2) before 4; next use of 2 after 3 is 8 (F2 of the next step).
        assert!(s.invalidated_between(TensorId(2), 3, 8));
        assert_eq!(s.next_use_distance(TensorId(2), 3), None);
        // Seen from position 4 (past the write) the copy fetched after it is live.
        assert_eq!(s.next_use_distance(TensorId(2), 4), Some(4));
        // B0 at 5, its write is placed at 6 (before the next step's F0).
        assert_eq!(s.next_use_distance(TensorId(0), 5), None);
    }

    #[test]
    fn recorder_counts_units_held_at_once() {
        let mut r = TraceRecorder::new();
        r.acquire(TensorId(0), 100, Phase::Forward, Tier::Device, false);
        r.acquire(TensorId(1), 50, Phase::Forward, Tier::Device, false);
        r.release(TensorId(0), Tier::Device);
        r.release(TensorId(1), Tier::Device);
        r.acquire(TensorId(1), 50, Phase::Backward, Tier::Device, false);
        let s = r.finish().unwrap();
        assert_eq!(min_working_set(&s), 150);
        assert!(check_budget(&s, 150).is_ok());
        let e = check_budget(&s, 149).unwrap_err();
        assert!(e.to_string().contains("150 B"), "{e}");
    }

    #[test]
    fn serde_round_trip_rebuilds_the_tables() {
        let s = Schedule::training_step(&ids(4), true).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        let back: Schedule = serde_json::from_str(&json).unwrap();
        assert_eq!(s, back);
        assert!(s.same_accesses(&back));
    }

    #[test]
    fn unknown_unit_and_empty_schedule_are_refused() {
        let e = Schedule::new(vec![ScheduleEntry::new(TensorId(1), Phase::Forward, Tier::Device)], []);
        assert!(matches!(e, Err(Error::UnknownUnit { .. })));
        let e = Schedule::new(vec![ScheduleEntry::new(TensorId(1), Phase::Optimizer, Tier::Host)], [(TensorId(1), 4)]);
        assert!(matches!(e, Err(Error::EmptySchedule)));
    }
}
