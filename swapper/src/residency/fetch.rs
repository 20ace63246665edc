//! Bringing a tensor's copy to a tier: [`Inner::ensure`], the loop behind acquire and prefetch.
//! Each round decides under the lock ([`Step`]): the copy is ready (pin it), someone else's
//! transfer or pin is in the way (wait on the condvar), or a transfer is needed (reserve its
//! room, lend its buffers, run it with the lock released). A device copy is loaded through a
//! pinned host copy beneath it (inclusion); a host acquire first copies a dirty device copy back
//! (coherence). Who calls ([`Caller`]) decides what the policy hears and what counts as stall.

use std::time::Instant;

use parking_lot::MutexGuard;

use super::guard::PinnedCell;
use super::reserve::Reservation;
use super::state::{CopyState, State};
use super::transfer::{Action, WriteBack};
use super::{Access, Inner};
use crate::error::{Error, Result};
use crate::host::size_class;
use crate::tier::{TensorId, Tier};

/// Whether [`Inner::ensure`] pins the copy it makes ready, and for what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pin {
    /// Leave it unpinned (a prefetch).
    No,
    /// Pin it for the calling thread; [`Access::Write`] makes it dirty.
    Yes(Access),
}

/// Who asks [`Inner::ensure`] for a copy: decides what the policy hears and what the metrics
/// count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Caller {
    /// A demand access ([`ResidencyManager::acquire`](super::ResidencyManager::acquire)): the
    /// policy hears it; a copy ready at once counts as a prefetch hit, a wait as stall.
    Acquire,
    /// A prefetch thread: the policy hears it as a prefetch; no hit, no stall.
    Prefetch,
    /// A device load bringing the host copy beneath it: nested in an `ensure` that told the
    /// policy already and counts the stall itself.
    DeviceLoad,
}

impl Caller {
    /// Whether the policy hears of the call (`on_acquire`).
    fn notifies_policy(self) -> bool {
        self != Caller::DeviceLoad
    }

    /// Whether the call is a demand access, which counts prefetch hits and stall time.
    fn is_demand(self) -> bool {
        self == Caller::Acquire
    }
}

/// One decision of [`Inner::ensure`]'s loop.
enum Step {
    /// The copy is ready (and pinned, if asked).
    Done,
    /// Another thread's pin or transfer is in the way: wait for a change.
    Wait,
    /// Something changed (a device load ran): decide again.
    Retry,
    /// Run this transfer, then decide again.
    Act(Action),
}

impl Inner {
    /// Brings `id` to `tier`; with [`Pin::Yes`], pins it and returns its cell. Calls other than
    /// [`Caller::Acquire`] count no stall; [`Caller::DeviceLoad`] calls (a device fetch bringing
    /// its host copy) do not notify the policy.
    pub(super) fn ensure(&self, id: TensorId, tier: Tier, pin: Pin, caller: Caller) -> Result<Option<PinnedCell>> {
        if tier == Tier::Nvme {
            return Err(Error::InvalidRequest("acquire targets the device or host tier; NVMe is a home".into()));
        }
        let start = Instant::now();
        let deadline = start + self.config.wait_timeout;
        let mut st = self.state.lock();
        st.entry(id)?;
        if caller.notifies_policy() {
            st.clock += 1;
            let clock = st.clock;
            st.policy.on_acquire(id, tier, clock, !caller.is_demand());
        }
        let mut first = true;
        let result = loop {
            let step = match self.step(&mut st, id, tier, pin, deadline) {
                Ok(s) => s,
                Err(e) => break Err(e),
            };
            let was_first = std::mem::replace(&mut first, false);
            match step {
                Step::Done => {
                    if was_first && caller.is_demand() {
                        self.metrics.add_prefetch_hit();
                    }
                    let clock = st.clock;
                    let e = st.entry(id)?;
                    if let (Pin::Yes(_), Tier::Device, Some(copied)) = (pin, tier, &e.device.arrived) {
                        // Compute will use the copy: the compute stream waits for its H2D (the
                        // host does not).
                        if self.config.compute_waits_for_fetch {
                            if let Err(err) = self.device.compute_waits_for(copied) {
                                e.device.unpin(std::thread::current().id());
                                break Err(err);
                            }
                        }
                    }
                    let cell = match (pin, tier) {
                        (Pin::No, _) => None,
                        (Pin::Yes(_), Tier::Host) => Some(PinnedCell::Host(e.host.cell.clone())),
                        (Pin::Yes(_), _) => Some(PinnedCell::Device(e.device.cell.clone())),
                    };
                    match tier {
                        Tier::Host => e.host.last_use = clock,
                        _ => e.device.last_use = clock,
                    }
                    break Ok(cell);
                }
                Step::Retry => {}
                Step::Wait => {
                    if self.cond.wait_until(&mut st, deadline).timed_out() {
                        tracing::warn!(tensor = id.0, %tier, waited_s = start.elapsed().as_secs_f64(), "gave up waiting");
                        let requested_bytes = st.entries.get(&id).map_or(0, |e| e.num_bytes() as u64);
                        break Err(Error::OutOfMemory {
                            tier,
                            requested_bytes,
                            available_bytes: self.budget_bytes(tier).saturating_sub(st.used_bytes(tier)),
                        });
                    }
                }
                Step::Act(action) => {
                    // A fresh host buffer for an overwrite is pinned by the run itself, so that
                    // no one reads its unspecified bytes before the caller writes them.
                    let pinned_by_run = matches!(action, Action::AllocHost { .. });
                    if let Err(e) = self.run(&mut st, action) {
                        break Err(e);
                    }
                    if pinned_by_run {
                        let clock = st.clock;
                        let e = st.entry(id)?;
                        e.host.last_use = clock;
                        break Ok(Some(PinnedCell::Host(e.host.cell.clone())));
                    }
                }
            }
        };
        if caller.is_demand() && !first {
            self.metrics.add_stall(start.elapsed());
        }
        result
    }

    /// One decision for `ensure`, under the lock.
    fn step(
        &self,
        st: &mut MutexGuard<'_, State>,
        id: TensorId,
        tier: Tier,
        pin: Pin,
        deadline: Instant,
    ) -> Result<Step> {
        match tier {
            Tier::Host => self.step_host(st, id, pin, deadline),
            _ => self.step_device(st, id, pin, deadline),
        }
    }

    /// [`Inner::step`] for the host tier: coherence with a dirty device copy first (copied back,
    /// or dropped for an [`Access::Overwrite`]), then pin a ready copy (dropping a device copy a
    /// write would make stale), or read an absent one from NVMe (an overwrite only allocates).
    fn step_host(&self, st: &mut MutexGuard<'_, State>, id: TensorId, pin: Pin, deadline: Instant) -> Result<Step> {
        let overwrite = pin == Pin::Yes(Access::Overwrite);
        if st.entry(id)?.host_pending.is_some() {
            // The host copy is still lent to an H2D queued earlier: it comes back when the copy
            // is complete (a wait here, on the thread that needs the host copy).
            self.settle_host(st, id, true)?;
            return Ok(Step::Retry);
        }
        let e = st.entry(id)?;
        let bytes = e.num_bytes() as u64;
        // Coherence first: a dirty device copy is newer than the host copy.
        if e.device.dirty {
            if !e.device.lendable() {
                return Ok(Step::Wait);
            }
            if overwrite {
                // Every byte is about to be replaced: the newer device copy is dropped, not
                // copied back.
                let freed = self.free_device_copy(st, id);
                self.cond.notify_all();
                freed?;
                return Ok(Step::Retry);
            }
            if !e.host.lendable() {
                return Ok(Step::Wait);
            }
            let after = e.device.compute_done.clone();
            let dev = e.device.take();
            let host = e.host.take();
            return Ok(Step::Act(Action::Dtoh { id, dev, host, after, then: WriteBack::Keep }));
        }
        match e.host.state {
            CopyState::Ready => {
                if matches!(pin, Pin::Yes(a) if a.writes()) && e.device.state != CopyState::Absent {
                    // The device copy would go stale: drop it (it is clean here).
                    if !e.device.lendable() {
                        return Ok(Step::Wait);
                    }
                    let freed = self.free_device_copy(st, id);
                    self.cond.notify_all();
                    freed?;
                }
                let e = st.entry(id)?;
                if let Pin::Yes(access) = pin {
                    e.host.pin_for(access);
                }
                Ok(Step::Done)
            }
            CopyState::Loading | CopyState::Lent => Ok(Step::Wait),
            CopyState::Absent => {
                let class = size_class(bytes as usize) as u64;
                e.host.state = CopyState::Loading;
                if let Err(err) = self.reserve(st, Reservation { tier: Tier::Host, bytes: class, for_id: id }, deadline)
                {
                    st.entry(id)?.host.state = CopyState::Absent;
                    self.cond.notify_all();
                    return Err(err);
                }
                let e = st.entry(id)?;
                e.host.reserved = class;
                if overwrite {
                    // Nothing to read: a fresh buffer, filled by the caller.
                    return Ok(Step::Act(Action::AllocHost { id }));
                }
                match e.nvme.take() {
                    Some(extent) => Ok(Step::Act(Action::ReadNvme { id, extent })),
                    None => {
                        let freed = e.host.clear();
                        st.release(Tier::Host, freed);
                        self.cond.notify_all();
                        Err(Error::InvalidRequest(format!("tensor {id} has neither a host copy nor an NVMe extent")))
                    }
                }
            }
        }
    }

    /// [`Inner::step`] for the device tier: pin a ready copy, or claim the load of an absent one
    /// and run it ([`Inner::load_device`]), then look again.
    fn step_device(&self, st: &mut MutexGuard<'_, State>, id: TensorId, pin: Pin, deadline: Instant) -> Result<Step> {
        let e = st.entry(id)?;
        let bytes = e.num_bytes() as u64;
        match e.device.state {
            CopyState::Ready => {
                if let Pin::Yes(access) = pin {
                    e.device.pin_for(access);
                }
                Ok(Step::Done)
            }
            CopyState::Loading | CopyState::Lent => Ok(Step::Wait),
            CopyState::Absent => {
                if bytes > self.budget_bytes(Tier::Device) {
                    return Err(Error::OutOfMemory {
                        tier: Tier::Device,
                        requested_bytes: bytes,
                        available_bytes: self.budget_bytes(Tier::Device),
                    });
                }
                // Claim the load: others wait for it instead of starting their own.
                e.device.state = CopyState::Loading;
                let r = self.load_device(st, id, bytes, deadline);
                if r.is_err() {
                    let e = st.entry(id)?;
                    if e.device.state == CopyState::Loading {
                        e.device.state = CopyState::Absent;
                    }
                }
                self.cond.notify_all();
                r.map(|()| Step::Retry)
            }
        }
    }

    /// Fetches `id` to the device after `step` claimed the load (device copy `Loading`): brings
    /// the host copy and pins it, reserves device room, waits until no one else reads the host
    /// copy, then lends it to the H2D copy.
    fn load_device(&self, st: &mut MutexGuard<'_, State>, id: TensorId, bytes: u64, deadline: Instant) -> Result<()> {
        let me = std::thread::current().id();
        MutexGuard::unlocked(st, || self.ensure(id, Tier::Host, Pin::Yes(Access::Read), Caller::DeviceLoad))?;
        let unpin = |st: &mut MutexGuard<'_, State>| {
            if let Some(e) = st.entries.get_mut(&id) {
                e.host.unpin(me);
            }
        };
        if let Err(err) = self.reserve(st, Reservation { tier: Tier::Device, bytes, for_id: id }, deadline) {
            unpin(st);
            return Err(err);
        }
        st.entry(id)?.device.reserved = bytes;
        // Readers of the host copy are short-lived; the copy needs the buffer to itself.
        while st.entry(id)?.host.pinners.len() > 1 {
            if self.cond.wait_until(st, deadline).timed_out() {
                unpin(st);
                let e = st.entry(id)?;
                e.device.reserved = 0;
                st.release(Tier::Device, bytes);
                return Err(Error::InvalidRequest(format!(
                    "tensor {id}: its host copy stayed pinned by another thread while its device copy was \
                     fetched; do not hold a host guard of a tensor while acquiring its device copy"
                )));
            }
        }
        let e = st.entry(id)?;
        e.host.unpin(me);
        let host = e.host.take();
        self.run(st, Action::Htod { id, host })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each caller tells the policy and counts, as the `prefetch`/`nested` flags did.
    #[test]
    fn callers_notify_and_count_as_before() {
        let table =
            [Caller::Acquire, Caller::Prefetch, Caller::DeviceLoad].map(|c| (c, c.notifies_policy(), c.is_demand()));
        assert_eq!(
            table,
            [(Caller::Acquire, true, true), (Caller::Prefetch, true, false), (Caller::DeviceLoad, false, false)]
        );
    }
}
