//! The sim device's happens-before checker: the CUDA ordering contract ([`super::CudaDevice`])
//! modelled on the CPU, so that a missing ordering call fails a CPU test instead of racing on a
//! GPU.
//!
//! | concept | what it is |
//! |---|---|
//! | compute stream | a logical clock: each compute access ([`SimBuffer::compute_read`], [`SimBuffer::compute_write`]) takes the next position (from 1) |
//! | copy stream | a logical clock: each copy (`htod`, `dtoh`, their `_after` forms) takes the next copy id (from 1), in submission order, as on CUDA's one copy stream |
//! | [`SimEvent`] | a two-entry vector clock: the compute position and the copy id an event covers |
//! | stream knowledge | what each stream is ordered after: the copy stream after compute position `copy_sees_compute`, compute after copy id `compute_sees_copy` |
//! | buffer record | per buffer: the position of compute's last write and last access (read or write), and the copy-stream operation compute has not been ordered after yet: its allocation (stream-ordered on the copy stream) or an H2D into it |
//! | [`OrderingViolation`] | a broken rule: which ([`OrderingHazard`]), the buffer, what it had to follow and what it was ordered after |
//!
//! # What orders what
//!
//! The calls move the clocks as the CUDA calls move the streams:
//!
//! | call | effect |
//! |---|---|
//! | `alloc` | the allocation takes the next copy id (CUDA allocates stream-ordered on the copy stream): compute must be ordered after it before the buffer's first compute access |
//! | `alloc_for_compute` | `alloc`, then `compute_waits_for` the allocation |
//! | `record_compute_event` | an event `{compute: now, copy: compute_sees_copy}` |
//! | `htod_after` / `dtoh_after` with `Some(ev)` | the copy stream waits for `ev`: `copy_sees_compute = max(.., ev.compute)`; the copy's event is `{compute: copy_sees_compute, copy: its id}` |
//! | `htod` / `dtoh`, or `_after` with `None` | when compute accessed the buffer after `copy_sees_compute`, the copy stream waits for all compute: `copy_sees_compute = now` (CUDA: a buffer "touched" by compute) |
//! | `copy_waits_for_compute` / `copy_waits_for(ev)` | `copy_sees_compute = now` / `max(.., ev.compute)` |
//! | `compute_waits_for(ev)` / `compute_waits_for_copies` | `compute_sees_copy = max(.., ev.copy)` / the last copy id |
//! | `free_after(buf, Some(ev))` / `free_after(buf, None)` | as an `_after` copy / a plain copy, then the buffer is freed |
//! | `Transfer::wait` | the host saw the copy complete (and, same stream, every earlier copy of the buffer): the buffer's pending H2D is cleared — unless the device counts no host wait as ordering ([`SimDeviceConfig::host_wait_orders_compute`](super::SimDeviceConfig::host_wait_orders_compute) false, as the runtime's is) |
//! | `Transfer::release_device` of an H2D | the device buffer comes back with its H2D still pending, for compute to wait for |
//!
//! # What is checked
//!
//! | operation | violation when | reported |
//! |---|---|---|
//! | `dtoh_after(buf, _, Some(ev))` | compute wrote `buf` after `ev` ([`OrderingHazard::DtohBeforeComputeWrite`]) | `Err` from the call |
//! | `htod_after(_, buf, Some(ev))` | compute read or wrote `buf` after `ev` ([`OrderingHazard::HtodOverComputeAccess`]) | `Err` from the call |
//! | `free_after(buf, Some(ev))` | compute read or wrote `buf` after `ev` ([`OrderingHazard::FreeBeforeComputeAccess`]) | `Err` from the call |
//! | dropping a buffer | compute read or wrote it after the copy stream's last ordering (`copy_sees_compute`) ([`OrderingHazard::DropBeforeComputeAccess`]) | recorded; the device's next reporting call returns it |
//! | `compute_read` / `compute_write` | an H2D into the buffer is pending: neither host-waited ([`Transfer::wait`](super::Transfer::wait), where host waits count) nor covered by `compute_sees_copy` ([`OrderingHazard::ComputeBeforeHtod`]) | `Err` from the call |
//! | `compute_read` / `compute_write` | the buffer's allocation is not covered by `compute_sees_copy` ([`OrderingHazard::ComputeBeforeAlloc`]) | `Err` from the call |
//!
//! The plain copies (`htod`, `dtoh`, `_after` with `None`) and `free_after(buf, None)` are
//! always safe: they order the copy stream after all compute when the buffer needs it, as CUDA
//! does. An `_after` event is checked on its own, not together with what the copy stream waited
//! for earlier: on CUDA an earlier wait (another thread's eviction, say) may cover the access by
//! luck of timing, and the checker should not depend on it. A plain drop has no event; it is
//! checked against the copy stream's ordering as it stands, which another thread's wait may have
//! advanced — prefer `free_after`. A D2H reads the buffer, so compute reads after its event are
//! no hazard for it; an H2D and a free are hazards for any access.
//!
//! **Host waits.** On CUDA a host that waited for an H2D (`cuEventSynchronize`) orders the
//! kernels it launches afterwards, but only those, and only by stalling the thread that should
//! be queueing kernels. The runtime orders every H2D before compute with an event instead (its
//! contract: compute waits on the copy stream's event, never the host), so its sim device counts
//! no host wait as ordering: a compute access that relies on one is reported as
//! [`OrderingHazard::ComputeBeforeHtod`], as a missing event would race on CUDA where the wait
//! happened on another thread. Callers that do rely on host waits (tests, benchmarks) keep the
//! default, which counts them.
//!
//! Every violation goes into the device's log
//! ([`SimDevice::ordering_violations`](super::SimDevice::ordering_violations);
//! [`SimDevice::check_ordering`](super::SimDevice::check_ordering) returns the first). One found
//! in a `Drop` (which cannot return an error) is also returned once, as cudarc's `record_err`
//! does, by the device's next reporting call: `alloc`, `htod`, `dtoh`, `htod_after`, `dtoh_after`,
//! `free_after`, `synchronize`. The marks (`record_compute_event`, the `*_waits_for*` calls) never
//! fail, so callers that cannot propagate an error (a guard's `Drop`) use them safely.
//!
//! Limits: an access is placed on the compute clock where `compute_read`/`compute_write` is
//! called, so call it where the kernel is launched, not before recording an event the kernel
//! must follow. Buffers under a [`Transfer`](super::Transfer) are owned by it, so compute cannot
//! touch them and needs no check; only [`Transfer::release_device`](super::Transfer::release_device)
//! hands a buffer out before its copy is known complete.
//!
//! [`SimBuffer::compute_read`]: super::SimBuffer::compute_read
//! [`SimBuffer::compute_write`]: super::SimBuffer::compute_write

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use parking_lot::Mutex;

use super::Direction;
use crate::error::Error;

/// An event of the sim device: the compute position and the copy id it covers (a vector clock
/// over the two logical streams). Without the checker both are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SimEvent {
    compute_pos: u64,
    copy_id: u64,
}

impl SimEvent {
    /// The last compute position the event covers (compute accesses are numbered from 1).
    pub fn compute_pos(&self) -> u64 {
        self.compute_pos
    }

    /// The last copy id the event covers (copies are numbered from 1).
    pub fn copy_id(&self) -> u64 {
        self.copy_id
    }
}

/// Which ordering rule an operation broke (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrderingHazard {
    /// `dtoh_after` with an `after` event recorded before compute's last write of the buffer: the
    /// copy may read bytes the kernel has not written yet.
    DtohBeforeComputeWrite,
    /// `htod_after` with an `after` event recorded before compute's last access to the buffer:
    /// the copy may overwrite bytes a kernel still reads or writes.
    HtodOverComputeAccess,
    /// `free_after` with an `after` event recorded before compute's last access to the buffer:
    /// the memory may be reused under a running kernel.
    FreeBeforeComputeAccess,
    /// A buffer dropped while compute's last access to it is not covered by the copy stream's
    /// ordering: the memory may be reused under a running kernel.
    DropBeforeComputeAccess,
    /// A compute access to a buffer whose H2D copy was neither waited for on the host nor by
    /// compute: the kernel may read bytes that have not arrived.
    ComputeBeforeHtod,
    /// A compute access to a buffer whose allocation (stream-ordered on the copy stream) compute
    /// was not ordered after: the kernel may use memory the allocator still hands to the copy
    /// stream's earlier work.
    ComputeBeforeAlloc,
}

impl OrderingHazard {
    /// The operation, in words: `dtoh of a buffer compute wrote after the \`after\` event`, ...
    pub fn operation(self) -> &'static str {
        match self {
            OrderingHazard::DtohBeforeComputeWrite => "dtoh of a buffer compute wrote after the `after` event",
            OrderingHazard::HtodOverComputeAccess => "htod into a buffer compute used after the `after` event",
            OrderingHazard::FreeBeforeComputeAccess => "free_after of a buffer compute used after the `after` event",
            OrderingHazard::DropBeforeComputeAccess => {
                "drop (free) of a buffer compute used after the copy stream's last ordering"
            }
            OrderingHazard::ComputeBeforeHtod => {
                "compute access to a buffer whose htod was waited for neither on the host nor by compute"
            }
            OrderingHazard::ComputeBeforeAlloc => {
                "compute access to a buffer allocated on the copy stream that compute was not ordered after"
            }
        }
    }

    /// The fix, in words.
    pub fn fix(self) -> &'static str {
        match self {
            OrderingHazard::DtohBeforeComputeWrite => {
                "record the `after` event (Device::record_compute_event) after the kernel that writes the buffer, \
                 or use the plain dtoh (ordered after all compute)"
            }
            OrderingHazard::HtodOverComputeAccess => {
                "record the `after` event after the last kernel that uses the buffer, or use the plain htod \
                 (ordered after all compute)"
            }
            OrderingHazard::FreeBeforeComputeAccess => {
                "record the `after` event after the last kernel that uses the buffer, or pass None (ordered after \
                 all compute)"
            }
            OrderingHazard::DropBeforeComputeAccess => {
                "free it with Device::free_after (an event recorded after its last kernel, or None), or call \
                 Device::copy_waits_for_compute before dropping it"
            }
            OrderingHazard::ComputeBeforeHtod => {
                "call Device::compute_waits_for with the htod's event (or compute_waits_for_copies) before \
                 handing the buffer to compute"
            }
            OrderingHazard::ComputeBeforeAlloc => {
                "allocate a buffer compute uses first with Device::alloc_for_compute (or order compute after its \
                 allocation with compute_waits_for_copies)"
            }
        }
    }

    /// What the operation had to be ordered after: `compute access` or `copy`.
    pub fn needs(self) -> &'static str {
        match self {
            OrderingHazard::ComputeBeforeHtod | OrderingHazard::ComputeBeforeAlloc => "copy",
            _ => "compute access",
        }
    }
}

impl std::fmt::Display for OrderingHazard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.operation())
    }
}

/// One broken ordering rule, as the sim device's checker records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OrderingViolation {
    /// The rule.
    pub hazard: OrderingHazard,
    /// The buffer's number on its device (allocation order, from 1).
    pub buffer: u64,
    /// The buffer's size in bytes.
    pub num_bytes: u64,
    /// What the operation had to be ordered after: a compute position, or for
    /// [`OrderingHazard::ComputeBeforeHtod`] and [`OrderingHazard::ComputeBeforeAlloc`] a copy id.
    pub needed: u64,
    /// What it was ordered after (same clock as `needed`, smaller).
    pub ordered: u64,
}

impl From<OrderingViolation> for Error {
    fn from(v: OrderingViolation) -> Self {
        Error::Ordering {
            hazard: v.hazard,
            buffer: v.buffer,
            num_bytes: v.num_bytes,
            needed: v.needed,
            ordered: v.ordered,
        }
    }
}

/// The checker of one sim device, shared with its buffers.
#[derive(Default)]
pub(super) struct Checker {
    /// Whether a host wait for an H2D ([`Transfer::wait`](super::Transfer::wait)) orders compute
    /// after it (see the module docs, "Host waits").
    host_wait_orders: bool,
    /// The last compute position handed out.
    compute_clock: AtomicU64,
    /// The last copy id handed out.
    copy_clock: AtomicU64,
    /// The compute position the copy stream is ordered after.
    copy_sees_compute: AtomicU64,
    /// The copy id compute is ordered after.
    compute_sees_copy: AtomicU64,
    /// The last buffer number handed out.
    buffers: AtomicU64,
    /// Set while the log holds a violation not yet reported.
    unreported: AtomicBool,
    /// Every violation, with whether it was reported.
    log: Mutex<Vec<(OrderingViolation, bool)>>,
}

impl Checker {
    /// A checker; `host_wait_orders`: whether a host wait for an H2D orders compute after it.
    pub(super) fn new(host_wait_orders: bool) -> Self {
        Self { host_wait_orders, ..Self::default() }
    }

    /// A record for a new buffer of `num_bytes` bytes. Its allocation is an operation of the
    /// copy stream (it takes the next copy id), which compute must be ordered after before the
    /// buffer's first compute access; returns the allocation's event (for
    /// `compute_waits_for`).
    pub(super) fn new_buffer(self: &std::sync::Arc<Self>, num_bytes: usize) -> (BufferOrder, SimEvent) {
        let alloc = self.copy_clock.fetch_add(1, SeqCst) + 1;
        let order = BufferOrder {
            checker: self.clone(),
            id: self.buffers.fetch_add(1, SeqCst) + 1,
            num_bytes: num_bytes as u64,
            last_write: AtomicU64::new(0),
            last_access: AtomicU64::new(0),
            pending_copy: AtomicU64::new(alloc),
            pending_is_alloc: AtomicBool::new(true),
        };
        (order, SimEvent { compute_pos: self.copy_sees_compute.load(SeqCst), copy_id: alloc })
    }

    /// An event after the compute accesses so far.
    pub(super) fn record_compute_event(&self) -> SimEvent {
        SimEvent { compute_pos: self.compute_clock.load(SeqCst), copy_id: self.compute_sees_copy.load(SeqCst) }
    }

    /// Compute waits for `ev`'s copies.
    pub(super) fn compute_waits_for(&self, ev: &SimEvent) {
        self.compute_sees_copy.fetch_max(ev.copy_id, SeqCst);
    }

    /// Compute waits for every copy submitted so far.
    pub(super) fn compute_waits_for_copies(&self) {
        self.compute_sees_copy.fetch_max(self.copy_clock.load(SeqCst), SeqCst);
    }

    /// The copy stream waits for every compute access so far.
    pub(super) fn copy_waits_for_compute(&self) {
        self.copy_sees_compute.fetch_max(self.compute_clock.load(SeqCst), SeqCst);
    }

    /// The copy stream waits for `ev`'s compute.
    pub(super) fn copy_waits_for(&self, ev: &SimEvent) {
        self.copy_sees_compute.fetch_max(ev.compute_pos, SeqCst);
    }

    /// Orders the copy stream before an operation on `buf` that must follow compute's accesses
    /// (`last`: the position of the last one that matters): after `after` when given (checked,
    /// `hazard` when it does not cover `last`), else after all compute when the copy stream is
    /// not ordered after `last` yet.
    fn order_after(
        &self,
        buf: &BufferOrder,
        last: u64,
        after: Option<&SimEvent>,
        hazard: OrderingHazard,
    ) -> Result<(), OrderingViolation> {
        match after {
            Some(ev) => {
                if last > ev.compute_pos {
                    return Err(self.violation(buf, hazard, last, ev.compute_pos, true));
                }
                self.copy_waits_for(ev);
            }
            None => {
                if buf.last_access.load(SeqCst) > self.copy_sees_compute.load(SeqCst) {
                    self.copy_waits_for_compute();
                }
            }
        }
        Ok(())
    }

    /// Orders and numbers a copy of `buf` in `direction` after `after` (see [`Checker::order_after`]);
    /// returns the copy's event.
    pub(super) fn order_copy(
        &self,
        direction: Direction,
        buf: &BufferOrder,
        after: Option<&SimEvent>,
    ) -> Result<SimEvent, OrderingViolation> {
        match direction {
            Direction::Dtoh => {
                self.order_after(buf, buf.last_write.load(SeqCst), after, OrderingHazard::DtohBeforeComputeWrite)?
            }
            Direction::Htod => {
                self.order_after(buf, buf.last_access.load(SeqCst), after, OrderingHazard::HtodOverComputeAccess)?
            }
        }
        let id = self.copy_clock.fetch_add(1, SeqCst) + 1;
        if direction == Direction::Htod {
            // Later on the same stream: covers the allocation too.
            buf.pending_is_alloc.store(false, SeqCst);
            buf.pending_copy.store(id, SeqCst);
        }
        Ok(SimEvent { compute_pos: self.copy_sees_compute.load(SeqCst), copy_id: id })
    }

    /// Orders the free of `buf` after `after` (see [`Checker::order_after`]).
    pub(super) fn order_free(&self, buf: &BufferOrder, after: Option<&SimEvent>) -> Result<(), OrderingViolation> {
        self.order_after(buf, buf.last_access.load(SeqCst), after, OrderingHazard::FreeBeforeComputeAccess)
    }

    /// A violation, logged; `reported` when the caller returns it now.
    fn violation(
        &self,
        buf: &BufferOrder,
        hazard: OrderingHazard,
        needed: u64,
        ordered: u64,
        reported: bool,
    ) -> OrderingViolation {
        let v = OrderingViolation { hazard, buffer: buf.id, num_bytes: buf.num_bytes, needed, ordered };
        tracing::error!(
            hazard = hazard.operation(),
            buffer = buf.id,
            bytes = buf.num_bytes,
            needed,
            ordered,
            "sim device: ordering violation"
        );
        self.log.lock().push((v, reported));
        if !reported {
            self.unreported.store(true, SeqCst);
        }
        v
    }

    /// The first violation not reported yet, now marked reported.
    pub(super) fn take_unreported(&self) -> Option<OrderingViolation> {
        if !self.unreported.load(SeqCst) {
            return None;
        }
        let mut log = self.log.lock();
        let mut found = None;
        let mut more = false;
        for (v, reported) in log.iter_mut().filter(|(_, r)| !*r) {
            if found.is_none() {
                *reported = true;
                found = Some(*v);
            } else {
                more = true;
            }
        }
        self.unreported.store(more, SeqCst);
        found
    }

    /// Every violation so far, in the order found.
    pub(super) fn violations(&self) -> Vec<OrderingViolation> {
        self.log.lock().iter().map(|(v, _)| *v).collect()
    }

    /// The first violation so far; every one counts as reported after this.
    pub(super) fn first_violation(&self) -> Option<OrderingViolation> {
        let mut log = self.log.lock();
        log.iter_mut().for_each(|(_, r)| *r = true);
        self.unreported.store(false, SeqCst);
        log.first().map(|(v, _)| *v)
    }
}

/// What the checker knows of one buffer. Lives in the buffer; its `Drop` is the free check.
pub(super) struct BufferOrder {
    checker: std::sync::Arc<Checker>,
    id: u64,
    num_bytes: u64,
    /// Compute position of the last write (0: none).
    last_write: AtomicU64,
    /// Compute position of the last read or write (0: none).
    last_access: AtomicU64,
    /// Copy id of the last copy-stream operation on the buffer that compute must follow and
    /// was not ordered after yet (0: none): its allocation, or an H2D into it that neither the
    /// host (where host waits count) nor compute waited for.
    pending_copy: AtomicU64,
    /// Whether `pending_copy` is the allocation (else an H2D).
    pending_is_alloc: AtomicBool,
}

impl BufferOrder {
    /// The buffer's number on its device.
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// A compute access (`write` or read) now: checked against a pending allocation or H2D,
    /// then placed on the compute clock.
    pub(super) fn compute_access(&self, write: bool) -> Result<(), OrderingViolation> {
        let ck = &*self.checker;
        let pending = self.pending_copy.load(SeqCst);
        if pending != 0 {
            let seen = ck.compute_sees_copy.load(SeqCst);
            if seen < pending {
                let hazard = if self.pending_is_alloc.load(SeqCst) {
                    OrderingHazard::ComputeBeforeAlloc
                } else {
                    OrderingHazard::ComputeBeforeHtod
                };
                return Err(ck.violation(self, hazard, pending, seen, true));
            }
            let _ = self.pending_copy.compare_exchange(pending, 0, SeqCst, SeqCst);
        }
        let pos = ck.compute_clock.fetch_add(1, SeqCst) + 1;
        self.last_access.fetch_max(pos, SeqCst);
        if write {
            self.last_write.fetch_max(pos, SeqCst);
        }
        Ok(())
    }

    /// Forgets the buffer's compute accesses, so that dropping it records nothing: for a buffer
    /// that goes with an error its operation already reported.
    pub(super) fn disarm(&self) {
        self.last_access.store(0, SeqCst);
    }

    /// The host saw the buffer's H2D complete ([`Transfer::wait`](super::Transfer::wait)):
    /// compute is ordered after it where host waits count.
    pub(super) fn host_waited(&self) {
        if self.checker.host_wait_orders && !self.pending_is_alloc.load(SeqCst) {
            self.pending_copy.store(0, SeqCst);
        }
    }
}

impl Drop for BufferOrder {
    fn drop(&mut self) {
        let last = self.last_access.load(SeqCst);
        let ordered = self.checker.copy_sees_compute.load(SeqCst);
        if last > ordered {
            self.checker.violation(self, OrderingHazard::DropBeforeComputeAccess, last, ordered, false);
        }
    }
}
