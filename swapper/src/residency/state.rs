//! What the manager's lock guards: per tensor, its copy on each tier ([`Replica`]: state, buffer
//! cell, pins, dirty flag, last use, reserved bytes, the event after compute's last use of a
//! device copy) and its NVMe extent ([`Entry`]); per tier, the bytes reserved and their peak;
//! the logical clock and the eviction policy ([`State`]).
//!
//! Nothing here blocks or moves bytes: these are the records the decisions (`fetch`, `reserve`)
//! read and the transfers (`transfer`) update.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::RwLock;

use super::transfer::LinksInFlight;
use super::Access;
use crate::device::{DeviceBuffer, DeviceEvent, PendingHost};
use crate::error::{Error, Result};
use crate::host::HostBuffer;
use crate::nvme::Extent;
use crate::policy::EvictionPolicy;
use crate::tier::{TensorId, TensorMeta, Tier};

/// Where a copy's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CopyState {
    /// No bytes on this tier.
    Absent,
    /// Bytes reserved, arriving.
    Loading,
    /// The buffer is in the cell.
    Ready,
    /// The buffer is out on a transfer (read from or written to); it comes back.
    Lent,
}

/// A buffer shared between a copy and the guards pinning it.
pub(super) type Cell<B> = Arc<RwLock<Option<B>>>;

/// A tensor's copy on one tier.
pub(super) struct Replica<B> {
    pub(super) state: CopyState,
    /// The buffer while the copy is ready; guards read and write the bytes through it.
    pub(super) cell: Cell<B>,
    /// Threads holding a pin (one entry per pin).
    pub(super) pinners: Vec<ThreadId>,
    /// Newer than the copy on the tier below: written back before it goes.
    pub(super) dirty: bool,
    /// The clock at the copy's last acquire or arrival.
    pub(super) last_use: u64,
    /// Bytes counted against the tier's budget (0 when absent).
    pub(super) reserved: u64,
    /// Device copies: an event recorded on the compute stream when a pin was last given back
    /// ([`Resident`](super::Resident)'s drop), so after every kernel a pin holder launched on
    /// the buffer. A write-back (D2H) and the free of the buffer are ordered after it. `None`
    /// when no pin was given back since the copy arrived (no compute saw it), or recording
    /// failed (then they are ordered after all compute). Host copies: always `None`.
    pub(super) compute_done: Option<DeviceEvent>,
    /// Device copies: the event of the H2D that filled the buffer, which compute waits for when
    /// the copy is pinned for compute (`Inner::ensure`), so no thread blocks on the copy. Kept
    /// while the copy lives (waiting on a completed event costs a stream wait, nothing more).
    /// Host copies: always `None`.
    pub(super) arrived: Option<DeviceEvent>,
}

impl<B> Replica<B> {
    pub(super) fn absent() -> Self {
        Self {
            state: CopyState::Absent,
            cell: Arc::new(RwLock::new(None)),
            pinners: Vec::new(),
            dirty: false,
            last_use: 0,
            reserved: 0,
            compute_done: None,
            arrived: None,
        }
    }
    pub(super) fn take(&mut self) -> B {
        debug_assert_eq!(self.state, CopyState::Ready);
        self.state = CopyState::Lent;
        self.cell.write().take().expect("ready copy holds its buffer")
    }
    pub(super) fn put(&mut self, b: B) {
        *self.cell.write() = Some(b);
        self.state = CopyState::Ready;
    }
    /// Drops the buffer now (not when the last guard's handle on the cell goes) and resets to
    /// absent, so the tier's allocator sees the bytes free as soon as the budget does. Returns the
    /// bytes of the released reservation, for the caller to take off the tier's `used`.
    pub(super) fn clear(&mut self) -> u64 {
        let reserved = self.reserved;
        drop(self.cell.write().take());
        *self = Self::absent();
        reserved
    }
    pub(super) fn lendable(&self) -> bool {
        self.state == CopyState::Ready && self.pinners.is_empty()
    }
    /// Pins for the calling thread; a write access makes the copy dirty.
    pub(super) fn pin_for(&mut self, access: Access) {
        self.pinners.push(std::thread::current().id());
        if access.writes() {
            self.dirty = true;
        }
    }
    pub(super) fn unpin(&mut self, thread: ThreadId) {
        if let Some(i) = self.pinners.iter().position(|t| *t == thread) {
            self.pinners.swap_remove(i);
        }
    }
    pub(super) fn pinned_by_others(&self, me: ThreadId) -> bool {
        self.pinners.iter().any(|t| *t != me)
    }
    pub(super) fn in_flight(&self) -> bool {
        matches!(self.state, CopyState::Loading | CopyState::Lent)
    }
}

impl Replica<DeviceBuffer> {
    /// Takes the buffer out (if the copy holds it) with the event its free must follow, and
    /// resets to absent; returns them and the bytes of the released reservation. The caller
    /// frees the buffer through the device (`Inner::free_device_copy`), under the same lock, so
    /// the device's allocator sees the bytes free as soon as the budget does.
    pub(super) fn take_for_free(&mut self) -> (Option<DeviceBuffer>, Option<DeviceEvent>, u64) {
        let buf = self.cell.write().take();
        let after = self.compute_done.take();
        let reserved = self.reserved;
        *self = Self::absent();
        (buf, after, reserved)
    }
}

/// A registered tensor: its metadata and its copies.
pub(super) struct Entry {
    pub(super) meta: TensorMeta,
    pub(super) device: Replica<DeviceBuffer>,
    pub(super) host: Replica<HostBuffer>,
    /// The NVMe copy; valid unless the host copy is dirty. Taken out while a read uses it.
    pub(super) nvme: Option<Extent>,
    /// The host copy's buffer while an H2D from it may still be reading it: the device copy
    /// went to compute as soon as the copy was queued (compute waits for its event), and the
    /// host copy stays [`CopyState::Lent`] until the copy is seen complete
    /// (`Inner::settle_host`).
    pub(super) host_pending: Option<PendingHost>,
}

impl Entry {
    pub(super) fn num_bytes(&self) -> usize {
        self.meta.num_bytes()
    }
}

/// What the manager's lock guards.
pub(super) struct State {
    /// Every registered tensor.
    pub(super) entries: HashMap<TensorId, Entry>,
    /// Reserved bytes: [device, host].
    pub(super) used: [u64; 2],
    /// Highest `used` since creation or the last [`ResidencyManager::reset_peak_bytes`].
    ///
    /// [`ResidencyManager::reset_peak_bytes`]: super::ResidencyManager::reset_peak_bytes
    pub(super) peak: [u64; 2],
    /// Transfers in flight per link, for the links' busy time.
    pub(super) links: LinksInFlight,
    /// The logical clock: one tick per acquire or prefetch the policy hears of.
    pub(super) clock: u64,
    /// Ranks eviction candidates; told of acquires, prefetches and victims.
    pub(super) policy: Box<dyn EvictionPolicy>,
    /// Tensors whose host copy waits for an H2D to complete ([`Entry::host_pending`]).
    pub(super) pending_hosts: Vec<TensorId>,
}

impl State {
    /// No tensors, nothing reserved, evicting by `policy`.
    pub(super) fn new(policy: Box<dyn EvictionPolicy>) -> Self {
        Self {
            entries: HashMap::new(),
            used: [0, 0],
            peak: [0, 0],
            links: LinksInFlight::default(),
            clock: 0,
            policy,
            pending_hosts: Vec::new(),
        }
    }

    pub(super) fn entry(&mut self, id: TensorId) -> Result<&mut Entry> {
        self.entries.get_mut(&id).ok_or(Error::UnknownTensor(id))
    }

    /// Bytes reserved on `tier` (device or host) now.
    pub(super) fn used_bytes(&self, tier: Tier) -> u64 {
        self.used[tier.index()]
    }

    /// Counts `bytes` more as reserved on `tier` and raises its peak; the caller checked the
    /// budget.
    pub(super) fn claim(&mut self, tier: Tier, bytes: u64) {
        let t = tier.index();
        self.used[t] += bytes;
        self.peak[t] = self.peak[t].max(self.used[t]);
    }

    /// Takes `bytes` of a released reservation (a [`Replica::clear`]'s return) off `tier`'s
    /// `used`.
    pub(super) fn release(&mut self, tier: Tier, bytes: u64) {
        self.used[tier.index()] -= bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn other_thread() -> ThreadId {
        std::thread::spawn(|| std::thread::current().id()).join().unwrap()
    }

    #[test]
    fn lending_takes_the_buffer_out_and_put_brings_it_back() {
        let mut r = Replica::<Vec<u8>>::absent();
        r.put(vec![1, 2, 3]);
        assert!(r.lendable() && !r.in_flight());
        assert_eq!(r.take(), vec![1, 2, 3]);
        assert_eq!(r.state, CopyState::Lent);
        assert!(r.in_flight() && !r.lendable() && r.cell.read().is_none());
        r.put(vec![4]);
        assert_eq!(r.state, CopyState::Ready);
        assert_eq!(r.cell.read().as_deref(), Some(&[4u8][..]));
    }

    #[test]
    fn clear_drops_the_buffer_under_outstanding_cell_handles_and_returns_the_reservation() {
        let mut r = Replica::<Vec<u8>>::absent();
        r.put(vec![0; 8]);
        r.reserved = 4096;
        r.dirty = true;
        r.last_use = 7;
        let handle = r.cell.clone();
        assert_eq!(r.clear(), 4096);
        assert!(handle.read().is_none(), "the buffer goes now, not with the last handle");
        assert_eq!(r.state, CopyState::Absent);
        assert_eq!((r.reserved, r.dirty, r.last_use), (0, false, 0));
        assert!(r.pinners.is_empty());
    }

    #[test]
    fn pins_count_per_thread_and_a_write_pin_dirties() {
        let me = std::thread::current().id();
        let other = other_thread();
        let mut r = Replica::<Vec<u8>>::absent();
        r.put(vec![0]);
        r.pin_for(Access::Read);
        assert!(!r.dirty && !r.lendable());
        assert!(!r.pinned_by_others(me) && r.pinned_by_others(other));
        r.pin_for(Access::Write);
        assert!(r.dirty);
        r.unpin(me);
        assert_eq!(r.pinners.len(), 1);
        r.unpin(other);
        assert_eq!(r.pinners.len(), 1, "unpinning a thread without a pin changes nothing");
        r.unpin(me);
        assert!(r.lendable());
    }
}
