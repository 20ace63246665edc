//! The device tier: one trait, two backends (sim, CUDA) and the closed enum callers use.
//!
//! | concept | what it is |
//! |---|---|
//! | [`DeviceBackend`] | alloc with an enforced capacity, asynchronous H2D/D2H copies, events |
//! | [`SimDevice`] | host memory with a byte capacity and a throttled copy engine (always built) |
//! | [`CudaDevice`] | cudarc: a copy stream beside compute, driver-pinned host memory (`cuda` feature; a stand-in otherwise) |
//! | [`Device`] / [`DeviceBuffer`] | the closed enums over the backends |
//! | [`Transfer`] | an in-flight copy that owns both buffers until it completes (tokio-uring's `BufResult` shape) |
//!
//! Buffer ownership: a copy takes its host and device buffers by value and hands them back from
//! [`Transfer::wait`]. Dropping an unfinished [`Transfer`] does not free the buffers under the
//! copy: the sim engine drops them after the copy, the CUDA backend synchronises the copy's
//! event first (STYLE.md 6, 7).

use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};

use crate::error::{Error, Result};
use crate::host::{HostAllocator, HostBuffer};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
mod cuda;
mod sim;

pub use cuda::{CudaBuffer, CudaDevice};
pub use sim::{SimBuffer, SimDevice, SimDeviceConfig};

/// Direction of a copy between host and device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host → device.
    Htod,
    /// Device → host.
    Dtoh,
}

/// What a device backend provides. Callers use the closed enum [`Device`].
pub trait DeviceBackend: Send + Sync + 'static {
    /// The backend's buffer type.
    type Buffer: Send + 'static;

    /// A short description, e.g. `sim (2.0 GiB, 16 GB/s)` or `cuda:0 NVIDIA H100`.
    fn name(&self) -> String;

    /// Bytes of device memory the backend may hand out.
    fn capacity_bytes(&self) -> u64;

    /// Bytes handed out in live buffers.
    fn allocated_bytes(&self) -> u64;

    /// A buffer of `bytes` bytes (contents unspecified).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] on [`crate::Tier::Device`] when it does not fit the capacity.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Starts copying `src.as_slice()` into the front of `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when `dst` is smaller than `src.len()`; [`Error::Device`] when the
    /// copy engine is gone.
    fn htod(&self, src: HostBuffer, dst: Self::Buffer) -> Result<Transfer>;

    /// Starts copying the first `dst.len()` bytes of `src` into `dst`.
    ///
    /// # Errors
    /// As [`DeviceBackend::htod`].
    fn dtoh(&self, src: Self::Buffer, dst: HostBuffer) -> Result<Transfer>;

    /// The allocator whose memory this backend copies from fastest (driver-pinned under CUDA).
    fn host_allocator(&self, lock: bool) -> std::sync::Arc<dyn HostAllocator>;

    /// Blocks until every copy submitted so far has completed.
    ///
    /// # Errors
    /// A copy failed or the backend is gone.
    fn synchronize(&self) -> Result<()>;
}

/// A device buffer of either backend.
#[derive(Debug)]
pub enum DeviceBuffer {
    /// Sim device memory.
    Sim(SimBuffer),
    /// CUDA device memory.
    Cuda(CudaBuffer),
}

impl DeviceBuffer {
    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        match self {
            DeviceBuffer::Sim(b) => b.num_bytes(),
            DeviceBuffer::Cuda(b) => b.num_bytes(),
        }
    }

    /// The sim buffer, if this is one (sim device memory is host-addressable).
    pub fn as_sim(&self) -> Option<&SimBuffer> {
        match self {
            DeviceBuffer::Sim(b) => Some(b),
            DeviceBuffer::Cuda(_) => None,
        }
    }

    /// The sim buffer, mutably, if this is one.
    pub fn as_sim_mut(&mut self) -> Option<&mut SimBuffer> {
        match self {
            DeviceBuffer::Sim(b) => Some(b),
            DeviceBuffer::Cuda(_) => None,
        }
    }

    /// The CUDA buffer, if this is one.
    pub fn as_cuda(&self) -> Option<&CudaBuffer> {
        match self {
            DeviceBuffer::Cuda(b) => Some(b),
            DeviceBuffer::Sim(_) => None,
        }
    }
}

/// The device callers use: a closed enum over the backends.
pub enum Device {
    /// The simulated device.
    Sim(SimDevice),
    /// A CUDA GPU.
    Cuda(CudaDevice),
}

impl Device {
    /// A short description of the device.
    pub fn name(&self) -> String {
        match self {
            Device::Sim(d) => d.name(),
            Device::Cuda(d) => d.name(),
        }
    }

    /// Bytes of device memory the backend may hand out.
    pub fn capacity_bytes(&self) -> u64 {
        match self {
            Device::Sim(d) => d.capacity_bytes(),
            Device::Cuda(d) => d.capacity_bytes(),
        }
    }

    /// Bytes handed out in live buffers.
    pub fn allocated_bytes(&self) -> u64 {
        match self {
            Device::Sim(d) => d.allocated_bytes(),
            Device::Cuda(d) => d.allocated_bytes(),
        }
    }

    /// A buffer of `bytes` bytes. See [`DeviceBackend::alloc`].
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] on the device tier.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        Ok(match self {
            Device::Sim(d) => DeviceBuffer::Sim(d.alloc(bytes)?),
            Device::Cuda(d) => DeviceBuffer::Cuda(d.alloc(bytes)?),
        })
    }

    /// Starts an H2D copy. See [`DeviceBackend::htod`].
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the buffer belongs to the other backend or is too small.
    pub fn htod(&self, src: HostBuffer, dst: DeviceBuffer) -> Result<Transfer> {
        match (self, dst) {
            (Device::Sim(d), DeviceBuffer::Sim(b)) => d.htod(src, b),
            (Device::Cuda(d), DeviceBuffer::Cuda(b)) => d.htod(src, b),
            _ => Err(Error::InvalidRequest("device buffer of another backend".into())),
        }
    }

    /// Starts a D2H copy. See [`DeviceBackend::dtoh`].
    ///
    /// # Errors
    /// As [`Device::htod`].
    pub fn dtoh(&self, src: DeviceBuffer, dst: HostBuffer) -> Result<Transfer> {
        match (self, src) {
            (Device::Sim(d), DeviceBuffer::Sim(b)) => d.dtoh(b, dst),
            (Device::Cuda(d), DeviceBuffer::Cuda(b)) => d.dtoh(b, dst),
            _ => Err(Error::InvalidRequest("device buffer of another backend".into())),
        }
    }

    /// The host allocator this device copies from fastest.
    pub fn host_allocator(&self, lock: bool) -> std::sync::Arc<dyn HostAllocator> {
        match self {
            Device::Sim(d) => d.host_allocator(lock),
            Device::Cuda(d) => d.host_allocator(lock),
        }
    }

    /// Blocks until every copy submitted so far has completed.
    ///
    /// # Errors
    /// A copy failed or the backend is gone.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Sim(d) => d.synchronize(),
            Device::Cuda(d) => d.synchronize(),
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// The completion signal of a copy on a stream (a CUDA event), for backends without a callback.
pub trait CopyEvent: Send + 'static {
    /// Whether the copy has completed (non-blocking).
    ///
    /// # Errors
    /// The copy failed.
    fn query(&self) -> Result<bool>;
    /// Blocks until the copy has completed.
    ///
    /// # Errors
    /// The copy failed.
    fn synchronize(&self) -> Result<()>;
}

/// The result of a finished copy: both buffers handed back.
pub type CopyResult = Result<(HostBuffer, DeviceBuffer)>;

enum TransferState {
    /// The copy engine sends the buffers back when done (sim).
    Channel(Receiver<CopyResult>),
    /// An event guards the buffers, which the transfer holds meanwhile (CUDA).
    Event { event: Box<dyn CopyEvent>, buffers: Option<(HostBuffer, DeviceBuffer)> },
    /// Finished, result not yet taken.
    Done(CopyResult),
    /// Result taken.
    Taken,
}

/// An in-flight copy between host and device. It owns both buffers until [`Transfer::wait`]
/// hands them back.
///
/// A `tracing` span `swapper::htod` / `swapper::dtoh` with `bytes` is entered by the engine for
/// the copy's real duration.
pub struct Transfer {
    direction: Direction,
    num_bytes: usize,
    submitted: Instant,
    state: TransferState,
}

impl Transfer {
    /// A transfer whose buffers come back on `rx` (backends with a copy-engine thread).
    pub fn from_channel(direction: Direction, num_bytes: usize, rx: Receiver<CopyResult>) -> Self {
        Self { direction, num_bytes, submitted: Instant::now(), state: TransferState::Channel(rx) }
    }

    /// A transfer guarded by `event`; the buffers are released only after it completes.
    pub fn from_event(
        direction: Direction,
        num_bytes: usize,
        event: Box<dyn CopyEvent>,
        host: HostBuffer,
        device: DeviceBuffer,
    ) -> Self {
        Self {
            direction,
            num_bytes,
            submitted: Instant::now(),
            state: TransferState::Event { event, buffers: Some((host, device)) },
        }
    }

    /// Direction of the copy.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Bytes copied.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }

    /// When the copy was submitted.
    pub fn submitted_at(&self) -> Instant {
        self.submitted
    }

    /// Whether the copy has finished (successfully or not). Non-blocking.
    pub fn is_complete(&mut self) -> bool {
        let next = match &mut self.state {
            TransferState::Channel(rx) => match rx.try_recv() {
                Ok(r) => TransferState::Done(r),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => {
                    TransferState::Done(Err(Error::Device("copy engine stopped before the copy finished".into())))
                }
            },
            TransferState::Event { event, buffers } => match event.query() {
                Ok(false) => return false,
                Ok(true) => TransferState::Done(Ok(buffers.take().expect("buffers present"))),
                Err(e) => {
                    // The buffers may still be in use by a failed stream: synchronise before
                    // letting them go.
                    let _ = event.synchronize();
                    TransferState::Done(Err(e))
                }
            },
            TransferState::Done(_) | TransferState::Taken => return true,
        };
        self.state = next;
        true
    }

    /// Blocks until the copy has finished and hands back `(host, device)` buffers.
    ///
    /// # Errors
    /// The copy failed or its engine stopped; the buffers are then dropped safely.
    pub fn wait(mut self) -> CopyResult {
        match std::mem::replace(&mut self.state, TransferState::Taken) {
            TransferState::Channel(rx) => {
                rx.recv().unwrap_or_else(|_| Err(Error::Device("copy engine stopped before the copy finished".into())))
            }
            TransferState::Event { event, mut buffers } => {
                let r = event.synchronize();
                let bufs = buffers.take().expect("buffers present");
                r.map(|()| bufs)
            }
            TransferState::Done(r) => r,
            TransferState::Taken => Err(Error::Device("transfer result already taken".into())),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if let TransferState::Event { event, buffers } = &mut self.state {
            if buffers.is_some() {
                if let Err(e) = event.synchronize() {
                    tracing::error!(error = %e, "copy failed; found while dropping its transfer");
                }
            }
        }
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer").field("direction", &self.direction).field("num_bytes", &self.num_bytes).finish()
    }
}
