//! The moves between tiers — NVMe → host reads, H2D and D2H copies, host → NVMe writes — as
//! [`Action`]s: each runs with the manager's lock released, on buffers lent out of their copies
//! (which stay `Loading` or `Lent` meanwhile), and its outcome is applied to the copies under the
//! lock again. Also the per-link busy-time accounting ([`LinksInFlight`]).
//!
//! A failed NVMe write loses nothing: the new extent is never installed, the old extent and the
//! dirty host copy stay.

use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use super::state::{CopyState, State};
use super::{Access, Inner};
use crate::device::{BatchCopy, DeviceBuffer, DeviceEvent};
use crate::error::Result;
use crate::host::HostBuffer;
use crate::metrics::{Link, Metrics};
use crate::nvme::Extent;
use crate::tier::{TensorId, Tier};

/// What a write-back does with the copy it wrote from, once its bytes are safe on the tier below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriteBack {
    /// Keep the copy, now clean: a host acquire over a dirty device copy, an NVMe home written at
    /// registration.
    Keep,
    /// Drop the copy (and, for an NVMe write, a clean device copy above it): an eviction.
    Evict,
}

/// A long data movement, run with the lock released.
pub(super) enum Action {
    /// NVMe → host: read `extent` into a new host buffer.
    ReadNvme { id: TensorId, extent: Extent },
    /// A new host buffer for a copy the caller overwrites whole: nothing is read.
    AllocHost { id: TensorId },
    /// Host → device: copy the lent host buffer into a new device buffer.
    Htod { id: TensorId, host: HostBuffer },
    /// Device → host: write the lent dirty device copy back into the lent host copy, after
    /// `after` (the device copy's `compute_done`: after the kernels that wrote it); drop the
    /// device copy afterwards when `then` is [`WriteBack::Evict`].
    Dtoh { id: TensorId, dev: DeviceBuffer, host: HostBuffer, after: Option<DeviceEvent>, then: WriteBack },
    /// Host → NVMe: write the lent host copy to a new extent and free the old one; then drop the
    /// host copy (and a clean device copy above it) when `then` is [`WriteBack::Evict`] and no
    /// device copy above is pinned or loading by then, else keep it as a clean cache.
    WriteNvme { id: TensorId, host: HostBuffer, then: WriteBack },
}

#[derive(Default, Clone, Copy)]
struct LinkBusy {
    in_flight: u32,
    since: Option<Instant>,
}

/// Per [`Link`], the transfers in flight and since when it has been busy: a link's busy time is
/// the union of its in-flight intervals, recorded when the last transfer of a run ends.
#[derive(Default)]
pub(super) struct LinksInFlight([LinkBusy; 4]);

impl LinksInFlight {
    fn begin(&mut self, link: Link) {
        let l = &mut self.0[link as usize];
        if l.in_flight == 0 {
            l.since = Some(Instant::now());
        }
        l.in_flight += 1;
    }

    fn end(&mut self, link: Link, bytes: u64, metrics: &Metrics) {
        let l = &mut self.0[link as usize];
        l.in_flight -= 1;
        let busy =
            if l.in_flight == 0 { l.since.take().map(|s| s.elapsed()).unwrap_or_default() } else { Duration::ZERO };
        metrics.link(link).record(bytes, busy);
    }
}

impl Inner {
    /// Drops `id`'s device copy: its buffer (if it holds one) freed through the device after
    /// the event of compute's last use (`compute_done`; after all compute without one), its
    /// reservation taken off the device tier. Under the lock, so the device's allocator sees the
    /// bytes free as soon as the budget does.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`](crate::Error::UnknownTensor); the device's: on the sim an
    /// ordering violation (this free's or one recorded earlier), CUDA errors. The copy is gone
    /// either way.
    pub(super) fn free_device_copy(&self, st: &mut State, id: TensorId) -> Result<()> {
        let e = st.entry(id)?;
        let (buf, after, reserved) = e.device.take_for_free();
        st.release(Tier::Device, reserved);
        match buf {
            Some(b) => self.device.free_after(b, after.as_ref()),
            None => Ok(()),
        }
    }

    /// Runs `action` with the lock released and applies its outcome.
    pub(super) fn run(&self, st: &mut MutexGuard<'_, State>, action: Action) -> Result<()> {
        let r = match action {
            Action::ReadNvme { id, extent } => self.read_nvme(st, id, extent),
            Action::AllocHost { id } => self.alloc_host(st, id),
            Action::Htod { id, host } => self.htod(st, id, host),
            Action::Dtoh { id, dev, host, after, then } => self.dtoh(st, id, dev, host, after, then),
            Action::WriteNvme { id, host, then } => self.write_nvme(st, id, host, then),
        };
        self.cond.notify_all();
        r
    }

    /// [`Action::ReadNvme`]: the extent goes back to the entry whatever happens; the host copy
    /// (reserved and `Loading`) becomes ready and clean, or is cleared on an error.
    fn read_nvme(&self, st: &mut MutexGuard<'_, State>, id: TensorId, extent: Extent) -> Result<()> {
        st.links.begin(Link::NvmeRead);
        let bytes = extent.num_bytes();
        let (res, extent) = MutexGuard::unlocked(st, || {
            let r = self.pool.alloc(bytes as usize).and_then(|buf| {
                let (r, buf) = self.store()?.read(&extent, buf).wait();
                r.map(|()| buf)
            });
            (r, extent)
        });
        st.links.end(Link::NvmeRead, bytes, &self.metrics);
        let clock = st.clock;
        let e = st.entry(id)?;
        e.nvme = Some(extent);
        match res {
            Ok(buf) => {
                e.host.put(buf);
                e.host.dirty = false;
                e.host.last_use = clock;
                Ok(())
            }
            Err(err) => {
                let freed = e.host.clear();
                st.release(Tier::Host, freed);
                Err(err)
            }
        }
    }

    /// [`Action::AllocHost`]: the host copy (reserved and `Loading`) becomes ready with a buffer
    /// of unspecified bytes, pinned for the calling thread's overwrite (so dirty) under the same
    /// lock, so no one reads it before it is written; on an error it is cleared. Any NVMe extent
    /// stays (the old bytes, replaced when the overwritten copy is written back).
    fn alloc_host(&self, st: &mut MutexGuard<'_, State>, id: TensorId) -> Result<()> {
        let bytes = st.entry(id)?.num_bytes();
        let res = MutexGuard::unlocked(st, || self.pool.alloc(bytes));
        let clock = st.clock;
        let e = st.entry(id)?;
        match res {
            Ok(buf) => {
                e.host.put(buf);
                e.host.last_use = clock;
                e.host.pin_for(Access::Overwrite);
                Ok(())
            }
            Err(err) => {
                let freed = e.host.clear();
                st.release(Tier::Host, freed);
                Err(err)
            }
        }
    }

    /// [`Action::Htod`]: the copy is queued and the device copy (reserved and `Loading`)
    /// becomes ready and clean at once, with the copy's event in `arrived` for compute to wait
    /// for; the host buffer comes back to its copy when the copy is complete — now, if it is,
    /// else later ([`Inner::settle_host`]; the host copy stays `Lent` meanwhile). The host does
    /// not wait for the copy (the sim device's engine finishes it before handing the buffer out,
    /// but its checker still counts the copy as not waited for). On an error the device copy is
    /// cleared.
    fn htod(&self, st: &mut MutexGuard<'_, State>, id: TensorId, host: HostBuffer) -> Result<()> {
        let bytes = host.len();
        st.links.begin(Link::Htod);
        let res = MutexGuard::unlocked(st, || {
            let span = tracing::trace_span!("swapper::htod", tensor = id.0, bytes);
            let _e = span.enter();
            match self.device.alloc(bytes) {
                Ok(dev) => self
                    .device
                    .htod_after(host, dev, None)
                    .and_then(|(t, copied)| t.release_device().map(|(dev, pending)| (dev, pending, copied)))
                    .map_err(|e| (e, None)),
                Err(e) => Err((e, Some(host))),
            }
        });
        // Busy until queued: on CUDA the copy's real duration is in the device's link stats
        // (timed by events); the sim's engine has finished it by now.
        st.links.end(Link::Htod, bytes as u64, &self.metrics);
        self.apply_htod(st, id, res)
    }

    /// Applies an H2D's outcome to `id`'s copies (device copy reserved and `Loading`, host copy
    /// lent): the device copy ready and clean with the copy's event in `arrived`, the host
    /// buffer back now or once the copy completes ([`Inner::settle_host`]); on an error the
    /// device copy cleared and the host buffer put back — a failed copy loses it only if the
    /// engine lost it, and the host copy is then refetched from NVMe or, for host-homed
    /// tensors, reported.
    fn apply_htod(&self, st: &mut MutexGuard<'_, State>, id: TensorId, outcome: BatchCopy) -> Result<()> {
        let clock = st.clock;
        let e = st.entry(id)?;
        match outcome {
            Ok((dev, pending, copied)) => {
                e.device.put(dev);
                e.device.dirty = false;
                e.device.last_use = clock;
                e.device.arrived = Some(copied);
                e.host_pending = Some(pending);
                st.pending_hosts.push(id);
                self.settle_host(st, id, false).map(|_| ())
            }
            Err((err, host)) => {
                match host {
                    Some(h) => e.host.put(h),
                    None => {
                        let r = e.host.clear();
                        st.release(Tier::Host, r);
                    }
                }
                let e = st.entry(id)?;
                let r = e.device.clear();
                st.release(Tier::Device, r);
                Err(err)
            }
        }
    }

    /// [`ResidencyManager::load_device_batch`](super::ResidencyManager::load_device_batch): under
    /// the lock, claims the device load of each of `ids` whose device copy is absent and whose
    /// host copy is ready and unpinned, reserving its room (evicting by policy, never waiting:
    /// the first that finds no room ends the batch) and lending its host copy; then one batched
    /// H2D ([`Device::htod_batch`](crate::Device::htod_batch)) with the lock released; then each
    /// outcome applied as [`Inner::run`]'s H2D applies its own. Returns how many were loaded.
    pub(super) fn load_device_batch(&self, ids: &[TensorId]) -> Result<usize> {
        let mut st = self.state.lock();
        let budget = self.budget_bytes(Tier::Device);
        // Reserving never waits: the deadline is now.
        let now = Instant::now();
        let mut batch: Vec<(TensorId, HostBuffer)> = Vec::new();
        for &id in ids {
            st.clock += 1;
            let clock = st.clock;
            st.policy.on_acquire(id, Tier::Device, clock, true);
            let e = st.entry(id)?;
            let bytes = e.num_bytes() as u64;
            if e.device.state != CopyState::Absent || !e.host.lendable() || e.host_pending.is_some() || bytes > budget {
                continue;
            }
            e.device.state = CopyState::Loading;
            let reservation = super::reserve::Reservation { tier: Tier::Device, bytes, for_id: id };
            if self.reserve(&mut st, reservation, now).is_err() {
                // No room without waiting (or an eviction failed, which the caller's own
                // acquire meets again): the batch ends here.
                st.entry(id)?.device.state = CopyState::Absent;
                break;
            }
            let e = st.entry(id)?;
            // Evictions may have released the lock: look again before lending.
            if !e.host.lendable() || e.host_pending.is_some() {
                e.device.state = CopyState::Absent;
                st.release(Tier::Device, bytes);
                continue;
            }
            e.device.reserved = bytes;
            batch.push((id, e.host.take()));
        }
        if batch.is_empty() {
            self.cond.notify_all();
            return Ok(0);
        }
        let total: usize = batch.iter().map(|(_, h)| h.len()).sum();
        st.links.begin(Link::Htod);
        let ids: Vec<TensorId> = batch.iter().map(|&(id, _)| id).collect();
        let outcomes = MutexGuard::unlocked(&mut st, || {
            let _span = tracing::trace_span!("swapper::htod_batch", copies = batch.len(), bytes = total).entered();
            let mut copies = Vec::with_capacity(batch.len());
            let mut failed: Vec<Option<BatchCopy>> = Vec::with_capacity(batch.len());
            for (_, host) in batch {
                match self.device.alloc(host.len()) {
                    Ok(dev) => {
                        copies.push((host, dev));
                        failed.push(None);
                    }
                    Err(e) => failed.push(Some(Err((e, Some(host))))),
                }
            }
            let mut done = self.device.htod_batch(copies).into_iter();
            failed
                .into_iter()
                .map(|f| f.unwrap_or_else(|| done.next().expect("one outcome per copy")))
                .collect::<Vec<_>>()
        });
        st.links.end(Link::Htod, total as u64, &self.metrics);
        let mut first_err = None;
        let mut loaded = 0;
        for (id, outcome) in ids.into_iter().zip(outcomes) {
            match self.apply_htod(&mut st, id, outcome) {
                Ok(()) => loaded += 1,
                Err(err) => {
                    first_err.get_or_insert(err);
                }
            }
        }
        self.cond.notify_all();
        match first_err {
            Some(e) => Err(e),
            None => Ok(loaded),
        }
    }

    /// Gives `id`'s host copy its buffer back from the H2D that read it
    /// ([`Entry::host_pending`](super::state::Entry)), once the copy is complete: at once when it
    /// is, else — with `blocking` — after waiting for it with the lock released, else not yet.
    /// Returns whether the host copy is free of a pending copy now. A failed copy takes the
    /// device copy it filled and the host buffer with it (the host copy is then read from NVMe
    /// again, or reported for a host-homed tensor).
    ///
    /// # Errors
    /// The copy failed; [`Error::UnknownTensor`](crate::Error::UnknownTensor).
    pub(super) fn settle_host(&self, st: &mut MutexGuard<'_, State>, id: TensorId, blocking: bool) -> Result<bool> {
        let Some(pending) = st.entry(id)?.host_pending.take() else { return Ok(true) };
        let done = match pending.is_complete() {
            Ok(true) => pending.wait(),
            Ok(false) if !blocking => {
                st.entry(id)?.host_pending = Some(pending);
                return Ok(false);
            }
            Ok(false) => MutexGuard::unlocked(st, || pending.wait()),
            Err(e) => {
                drop(pending);
                Err(e)
            }
        };
        st.pending_hosts.retain(|&p| p != id);
        let e = st.entry(id)?;
        let r = match done {
            Ok(host) => {
                e.host.put(host);
                Ok(true)
            }
            Err(err) => {
                let hr = e.host.clear();
                st.release(Tier::Host, hr);
                let freed = self.free_device_copy(st, id);
                freed.and(Err(err))
            }
        };
        self.cond.notify_all();
        r
    }

    /// [`Inner::settle_host`] without blocking for every host copy an H2D still holds; with
    /// `wait_one`, waits for the oldest one if none was complete. Returns whether a host copy
    /// came back.
    ///
    /// # Errors
    /// As [`Inner::settle_host`].
    pub(super) fn settle_hosts(&self, st: &mut MutexGuard<'_, State>, wait_one: bool) -> Result<bool> {
        let mut settled = false;
        for id in st.pending_hosts.clone() {
            settled |= self.settle_host(st, id, false)?;
        }
        if !settled && wait_one {
            if let Some(&id) = st.pending_hosts.first() {
                settled = self.settle_host(st, id, true)?;
            }
        }
        Ok(settled)
    }

    /// [`Action::Dtoh`]: the host copy comes back dirty (it now holds the newest bytes); the
    /// device copy comes back clean or is freed (after `after`), as `then` says.
    fn dtoh(
        &self,
        st: &mut MutexGuard<'_, State>,
        id: TensorId,
        dev: DeviceBuffer,
        host: HostBuffer,
        after: Option<DeviceEvent>,
        then: WriteBack,
    ) -> Result<()> {
        let bytes = host.len();
        st.links.begin(Link::Dtoh);
        let res = MutexGuard::unlocked(st, || {
            let span = tracing::trace_span!("swapper::dtoh", tensor = id.0, bytes);
            let _e = span.enter();
            self.device.dtoh_after(dev, host, after.as_ref()).and_then(|(t, _)| t.wait())
        });
        st.links.end(Link::Dtoh, bytes as u64, &self.metrics);
        let e = st.entry(id)?;
        match res {
            Ok((host, dev)) => {
                e.host.put(host);
                e.host.dirty = true;
                match then {
                    WriteBack::Evict => {
                        let r = e.device.clear();
                        st.release(Tier::Device, r);
                        self.device.free_after(dev, after.as_ref())
                    }
                    WriteBack::Keep => {
                        e.device.put(dev);
                        e.device.dirty = false;
                        Ok(())
                    }
                }
            }
            Err(err) => {
                // The engine dropped both buffers: the newest bytes are gone with the
                // device buffer. Report it; the tensor falls back to its host copy.
                let (hr, dr) = (e.host.clear(), e.device.clear());
                st.release(Tier::Device, dr);
                st.release(Tier::Host, hr);
                Err(err)
            }
        }
    }

    /// [`Action::WriteNvme`]: copy-on-write — the new extent replaces the old one only once it is
    /// written; the host copy comes back clean or is dropped, as `then` says.
    fn write_nvme(
        &self,
        st: &mut MutexGuard<'_, State>,
        id: TensorId,
        host: HostBuffer,
        then: WriteBack,
    ) -> Result<()> {
        let bytes = host.len() as u64;
        st.links.begin(Link::NvmeWrite);
        let (res, host) = MutexGuard::unlocked(st, || match self.store() {
            Ok(s) => s.write(id, host).wait(),
            Err(e) => (Err(e), host),
        });
        st.links.end(Link::NvmeWrite, bytes, &self.metrics);
        let e = st.entry(id)?;
        match res {
            Ok(extent) => {
                if let Some(old) = e.nvme.replace(extent) {
                    self.store()?.free(old);
                }
                let e = st.entry(id)?;
                // The device copy above may have been pinned, evicted or started loading again
                // while the lock was released: the host copy goes (with a clean device copy)
                // only if nothing above needs it now (inclusion), else it stays, clean.
                let above_free = e.device.state == CopyState::Absent || e.device.lendable();
                match then {
                    WriteBack::Evict if above_free => {
                        drop(host);
                        let hr = e.host.clear();
                        st.release(Tier::Host, hr);
                        self.free_device_copy(st, id)
                    }
                    WriteBack::Evict | WriteBack::Keep => {
                        e.host.put(host);
                        e.host.dirty = false;
                        Ok(())
                    }
                }
            }
            Err(err) => {
                // Nothing is lost: the dirty host copy stays, the old extent too.
                e.host.put(host);
                Err(err)
            }
        }
    }
}
