//! Room on a tier: reserving a copy's bytes under the tier's budget, under the lock, before
//! anything is allocated; and making room by eviction — victims chosen among unpinned, ready
//! copies in the order the [`EvictionPolicy`](crate::policy::EvictionPolicy) gives, clean ones
//! dropped, dirty ones written back to the tier below first. A host copy goes only after the
//! device copy above it (inclusion), and a pinned copy is never a candidate.

use std::time::Instant;

use parking_lot::MutexGuard;

use super::state::{CopyState, State};
use super::transfer::{Action, WriteBack};
use super::Inner;
use crate::error::{Error, Result};
use crate::policy::{eviction_order, EvictionCandidate};
use crate::tier::{TensorId, Tier};

/// Bytes to reserve on a tier for one tensor's copy.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reservation {
    /// `Device` or `Host`.
    pub(super) tier: Tier,
    /// Bytes counted against the tier's budget (a host copy counts its pool size class).
    pub(super) bytes: u64,
    /// The tensor the room is for: none of its own copies is a victim.
    pub(super) for_id: TensorId,
}

/// What a tier holds besides the reserving tensor, when its budget has no room.
struct Scan {
    /// Copies that can be evicted now.
    candidates: Vec<EvictionCandidate>,
    /// Whether another thread's pin or an in-flight transfer may free room later.
    blocked_by_others: bool,
    /// Bytes that neither eviction nor waiting can free (host homes, our own pins).
    fixed: u64,
}

impl Scan {
    fn of(st: &State, tier: Tier, for_id: TensorId) -> Self {
        let me = std::thread::current().id();
        let mut scan = Scan { candidates: Vec::new(), blocked_by_others: false, fixed: 0 };
        for e in st.entries.values() {
            if e.meta.id == for_id {
                continue;
            }
            let copy = match tier {
                Tier::Device => {
                    (e.device.state, &e.device.pinners, e.device.dirty, e.device.reserved, e.device.last_use)
                }
                _ => (e.host.state, &e.host.pinners, e.host.dirty, e.host.reserved, e.host.last_use),
            };
            let (state, pinners, dirty, reserved, last_use) = copy;
            if state == CopyState::Absent {
                continue;
            }
            if matches!(state, CopyState::Loading | CopyState::Lent) {
                scan.blocked_by_others = true;
                continue;
            }
            let evictable = pinners.is_empty()
                && match tier {
                    Tier::Device => !dirty || e.host.lendable(),
                    // A device copy above goes first (written back when dirty): inclusion.
                    _ => e.meta.home == Tier::Nvme && (e.device.state == CopyState::Absent || e.device.lendable()),
                };
            if evictable {
                scan.candidates.push(EvictionCandidate { id: e.meta.id, tier, num_bytes: reserved, last_use, dirty });
            } else if (tier == Tier::Host && e.meta.home == Tier::Host)
                || !(e.device.pinned_by_others(me)
                    || e.host.pinned_by_others(me)
                    || e.device.in_flight()
                    || e.host.in_flight())
            {
                scan.fixed += reserved;
            } else {
                scan.blocked_by_others = true;
            }
        }
        scan
    }
}

impl Inner {
    /// Reserves `need` bytes on `tier` for `for_id`, evicting by policy; may release the lock to
    /// write back dirty victims or to wait for other threads' pins and transfers.
    pub(super) fn reserve(
        &self,
        st: &mut MutexGuard<'_, State>,
        reservation: Reservation,
        deadline: Instant,
    ) -> Result<()> {
        let Reservation { tier, bytes: need, for_id } = reservation;
        let budget = self.budget_bytes(tier);
        loop {
            if st.used_bytes(tier) + need <= budget {
                st.claim(tier, need);
                return Ok(());
            }
            let mut scan = Scan::of(st, tier, for_id);
            if scan.candidates.is_empty() {
                let out_of_memory = Error::OutOfMemory {
                    tier,
                    requested_bytes: need,
                    available_bytes: budget.saturating_sub(st.used_bytes(tier)),
                };
                if need > budget.saturating_sub(scan.fixed) || !scan.blocked_by_others {
                    return Err(out_of_memory);
                }
                // A host copy lent to an H2D comes back once the copy completes, which no one
                // signals: take it back (waiting for the oldest copy if none is done) and look again.
                if tier == Tier::Host && self.settle_hosts(st, true)? {
                    continue;
                }
                if self.cond.wait_until(st, deadline).timed_out() {
                    return Err(out_of_memory);
                }
                continue;
            }
            let clock = st.clock;
            eviction_order(st.policy.as_ref(), &mut scan.candidates, clock);
            self.evict(st, scan.candidates[0])?;
            self.cond.notify_all();
        }
    }

    /// Evicts `victim`'s copy from its tier: a clean copy is dropped; a dirty device copy is
    /// written back (D2H) first; a host copy takes the device copy above it along, written back
    /// first when dirty (the host copy then stays, dirty, for a later round), and a dirty host
    /// copy is written to NVMe first.
    fn evict(&self, st: &mut MutexGuard<'_, State>, victim: EvictionCandidate) -> Result<()> {
        let tier = victim.tier;
        let clock = st.clock;
        st.policy.on_evict(victim.id, tier, clock);
        let _span =
            tracing::trace_span!("swapper::evict", tensor = victim.id.0, %tier, bytes = victim.num_bytes).entered();
        self.metrics.add_eviction();
        let e = st.entry(victim.id)?;
        match tier {
            Tier::Device if e.device.dirty => {
                let after = e.device.compute_done.clone();
                let dev = e.device.take();
                let host = e.host.take();
                self.run(st, Action::Dtoh { id: victim.id, dev, host, after, then: WriteBack::Evict })?;
            }
            Tier::Device => self.free_device_copy(st, victim.id)?,
            _ if e.device.state != CopyState::Absent && e.device.dirty => {
                let after = e.device.compute_done.clone();
                let dev = e.device.take();
                let host = e.host.take();
                self.run(st, Action::Dtoh { id: victim.id, dev, host, after, then: WriteBack::Evict })?;
            }
            _ if e.host.dirty => {
                let host = e.host.take();
                self.run(st, Action::WriteNvme { id: victim.id, host, then: WriteBack::Evict })?;
            }
            _ => {
                let hr = e.host.clear();
                st.release(Tier::Host, hr);
                self.free_device_copy(st, victim.id)?;
            }
        }
        Ok(())
    }
}
