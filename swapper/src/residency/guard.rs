//! [`Resident`]: a pin on one copy of a tensor — taken through `ensure` for the calling thread,
//! given back when the guard drops — and byte access to the pinned copy through its cell
//! ([`PinnedCell`]), under short-lived lock guards.

use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::{MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLockReadGuard, RwLockWriteGuard};

use super::fetch::{Caller, Pin};
use super::state::Cell;
use super::{Access, Inner};
use crate::device::DeviceBuffer;
use crate::error::Result;
use crate::host::HostBuffer;
use crate::tier::{TensorId, Tier};

/// The cell of a pinned copy, which a guard reads and writes the bytes through.
pub(super) enum PinnedCell {
    Host(Cell<HostBuffer>),
    Device(Cell<DeviceBuffer>),
}

/// A pinned copy of a tensor on one tier. While it lives the copy is not evicted; dropping it
/// unpins. Byte access goes through short-lived lock guards.
pub struct Resident {
    inner: Arc<Inner>,
    id: TensorId,
    tier: Tier,
    access: Access,
    num_bytes: usize,
    cell: PinnedCell,
    thread: ThreadId,
}

impl Resident {
    /// Makes `id` ready on `tier` and pins it for the calling thread: the work of
    /// [`ResidencyManager::acquire`](super::ResidencyManager::acquire).
    pub(super) fn acquire(inner: &Arc<Inner>, id: TensorId, tier: Tier, access: Access) -> Result<Self> {
        let cell = inner.ensure(id, tier, Pin::Yes(access), Caller::Acquire)?.expect("pinned acquire returns its cell");
        let num_bytes = inner.state.lock().entry(id)?.num_bytes();
        Ok(Resident { inner: inner.clone(), id, tier, access, num_bytes, cell, thread: std::thread::current().id() })
    }

    /// The tensor.
    pub fn id(&self) -> TensorId {
        self.id
    }

    /// The tier it is pinned on.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }

    /// The host bytes.
    ///
    /// # Panics
    /// If the guard is not for the host tier.
    pub fn host_bytes(&self) -> MappedRwLockReadGuard<'_, [u8]> {
        let PinnedCell::Host(cell) = &self.cell else { panic!("guard is for the {} tier", self.tier) };
        RwLockReadGuard::map(cell.read(), |b| b.as_ref().expect("pinned copy present").as_slice())
    }

    /// The host bytes, mutably.
    ///
    /// # Panics
    /// If the guard is not for the host tier or was acquired for [`Access::Read`].
    pub fn host_bytes_mut(&self) -> MappedRwLockWriteGuard<'_, [u8]> {
        assert!(self.access.writes(), "acquired for read");
        let PinnedCell::Host(cell) = &self.cell else { panic!("guard is for the {} tier", self.tier) };
        RwLockWriteGuard::map(cell.write(), |b| b.as_mut().expect("pinned copy present").as_mut_slice())
    }

    /// The device buffer, for compute while the guard lives: mark each use as a compute access
    /// (sim: [`SimBuffer::compute_read`](crate::SimBuffer::compute_read); CUDA:
    /// `CudaBuffer::as_slice`). Dropping the guard records an event after that compute, which the
    /// copy's write-back and free are ordered after.
    ///
    /// # Panics
    /// If the guard is not for the device tier.
    pub fn device_buffer(&self) -> MappedRwLockReadGuard<'_, DeviceBuffer> {
        let PinnedCell::Device(cell) = &self.cell else { panic!("guard is for the {} tier", self.tier) };
        RwLockReadGuard::map(cell.read(), |b| b.as_ref().expect("pinned copy present"))
    }

    /// Blocks the host until the H2D that filled this device copy has completed: for handing the
    /// memory to a consumer on another stream than the device's compute stream (a DLPack
    /// export to torch), which the compute stream's wait for the copy does not order. Returns at
    /// once for a copy that did not arrive by an H2D, and on the sim device (its engine finishes
    /// a copy before handing the buffer out).
    ///
    /// # Errors
    /// The copy failed.
    ///
    /// # Panics
    /// If the guard is not for the device tier.
    pub fn wait_arrived(&self) -> Result<()> {
        assert!(matches!(self.cell, PinnedCell::Device(_)), "guard is for the {} tier", self.tier);
        let arrived = self.inner.state.lock().entry(self.id)?.device.arrived.clone();
        match arrived {
            Some(ev) => self.inner.device.synchronize_event(&ev),
            None => Ok(()),
        }
    }

    /// The device buffer, mutably (sim: [`SimBuffer::compute_write`](crate::SimBuffer::compute_write);
    /// CUDA: `CudaBuffer::as_mut_slice`). As [`Resident::device_buffer`].
    ///
    /// # Panics
    /// If the guard is not for the device tier or was acquired for [`Access::Read`].
    pub fn device_buffer_mut(&self) -> MappedRwLockWriteGuard<'_, DeviceBuffer> {
        assert!(self.access.writes(), "acquired for read");
        let PinnedCell::Device(cell) = &self.cell else { panic!("guard is for the {} tier", self.tier) };
        RwLockWriteGuard::map(cell.write(), |b| b.as_mut().expect("pinned copy present"))
    }
}

impl Drop for Resident {
    /// Unpins. A device pin also records an event on the compute stream (under the lock, so the
    /// copy's event is the latest): after every kernel the holder launched on the buffer, for
    /// its write-back and free to follow (`Replica::compute_done`).
    fn drop(&mut self) {
        let mut st = self.inner.state.lock();
        if let Some(e) = st.entries.get_mut(&self.id) {
            match self.tier {
                Tier::Host => e.host.unpin(self.thread),
                _ => {
                    e.device.unpin(self.thread);
                    e.device.compute_done = match self.inner.device.record_compute_event() {
                        Ok(ev) => Some(ev),
                        Err(err) => {
                            // Without an event, the write-back and free wait for all compute.
                            tracing::error!(tensor = self.id.0, error = %err, "recording a compute event at unpin");
                            None
                        }
                    };
                }
            }
        }
        self.inner.cond.notify_all();
    }
}

impl std::fmt::Debug for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resident")
            .field("id", &self.id)
            .field("tier", &self.tier)
            .field("access", &self.access)
            .finish()
    }
}
