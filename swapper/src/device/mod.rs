//! The device tier: one trait, two backends (sim, CUDA) and the closed enum callers use.
//!
//! | concept | what it is |
//! |---|---|
//! | [`DeviceBackend`] | alloc with an enforced capacity, asynchronous H2D/D2H copies, events |
//! | [`SimDevice`] | host memory with a byte capacity, a throttled copy engine and a happens-before checker (always built) |
//! | [`CudaDevice`] | cudarc: a copy stream beside compute, driver-pinned host memory (`cuda` feature; a stand-in otherwise) |
//! | [`Device`] / [`DeviceBuffer`] | the closed enums over the backends |
//! | [`Transfer`] | an in-flight copy that owns both buffers until it completes (tokio-uring's `BufResult` shape) |
//! | [`DeviceEvent`] | a point on a stream: after the compute so far ([`Device::record_compute_event`]) or after a copy (`*_after`) |
//! | compute access | a buffer handed to compute: [`SimBuffer::compute_read`]/[`SimBuffer::compute_write`], `CudaBuffer::as_slice`/`as_mut_slice` |
//! | [`ordering`] | the sim device's checker: what each ordering call orders and what is checked |
//!
//! Buffer ownership: a copy takes its host and device buffers by value and hands them back from
//! [`Transfer::wait`]. Dropping an unfinished [`Transfer`] does not free the buffers under the
//! copy: the sim engine drops them after the copy, the CUDA backend synchronises the copy's
//! event first (STYLE.md 6, 7).
//!
//! # Ordering: one API for both backends
//!
//! Compute and copies run on two streams (CUDA: candle's compute stream and the swapper's copy
//! stream; the sim: the CPU and the copy engines, with logical clocks). [`CudaDevice`] documents
//! the contract; [`Device`] carries it for both backends, so the runtime writes one code path:
//!
//! | need | call |
//! |---|---|
//! | compute reads a buffer filled by an H2D | [`Transfer::release_device`] and [`Device::compute_waits_for`] with the copy's event (or [`Device::compute_waits_for_copies`]); a host wait ([`Transfer::wait`]) also orders it on CUDA, but stalls the host, and the runtime's sim device does not count it ([`ordering`], "Host waits") |
//! | compute uses a fresh buffer first (staging it writes) | [`Device::alloc_for_compute`]: the allocation is stream-ordered on the copy stream, and compute waits for it |
//! | a D2H of a buffer compute wrote | [`Device::dtoh_after`] with an event from [`Device::record_compute_event`] recorded after the writing kernel; or the plain [`Device::dtoh`] (after all compute) |
//! | an H2D into a buffer compute used (reuse) | [`Device::htod_after`] with an event recorded after the last kernel using it; or the plain [`Device::htod`] |
//! | free a buffer compute used | [`Device::free_after`] with such an event (or `None`: after all compute), or [`Device::copy_waits_for_compute`] / [`Device::copy_waits_for`] before dropping it |
//! | mark a buffer as handed to compute | sim: [`SimBuffer::compute_read`] / [`SimBuffer::compute_write`]; CUDA: `CudaBuffer::as_slice` / `as_mut_slice` |
//!
//! The plain copies (and `*_after` with `None`, and `free_after` with `None`) are always safe:
//! they wait for all compute when compute used the buffer since its last ordering (less overlap
//! on CUDA). On the sim device the checker fails an `*_after` whose event does not cover the
//! buffer's last compute access, a compute access before its H2D was waited for, and a drop not
//! ordered after compute's last access — see [`ordering`] for the exact rules. On CUDA a drop
//! of a touched buffer is made safe by waiting for all compute; the sim asks for the ordering to
//! be stated, so that CPU tests find the frees that would make the copy stream wait for all of
//! compute, and any free a future path forgets to order.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};

use crate::error::{Error, Result};
use crate::host::{HostAllocator, HostBuffer};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "dummy_cuda.rs"]
mod cuda;
pub mod ordering;
mod sim;

pub use cuda::{CudaBuffer, CudaDevice, CudaEvent};
pub use ordering::{OrderingHazard, OrderingViolation, SimEvent};
pub use sim::{SimBuffer, SimDevice, SimDeviceConfig};

/// An event of either backend: a point on the compute stream ([`Device::record_compute_event`])
/// or on the copy stream (the event of an `*_after` copy). Cheap to clone.
#[derive(Debug, Clone)]
pub enum DeviceEvent {
    /// A sim device event (two logical clock values).
    Sim(SimEvent),
    /// A CUDA event (uninhabited without the `cuda` feature).
    Cuda(Arc<CudaEvent>),
}

fn other_backend_event() -> Error {
    Error::InvalidRequest("an event of another device backend".into())
}

impl DeviceEvent {
    fn sim(ev: Option<&DeviceEvent>) -> Result<Option<&SimEvent>> {
        match ev {
            None => Ok(None),
            Some(DeviceEvent::Sim(e)) => Ok(Some(e)),
            Some(DeviceEvent::Cuda(_)) => Err(other_backend_event()),
        }
    }

    fn cuda(ev: Option<&DeviceEvent>) -> Result<Option<&CudaEvent>> {
        match ev {
            None => Ok(None),
            Some(DeviceEvent::Cuda(e)) => Ok(Some(e)),
            Some(DeviceEvent::Sim(_)) => Err(other_backend_event()),
        }
    }
}

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
    fn host_allocator(&self, lock: bool) -> Arc<dyn HostAllocator>;

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

    /// A buffer of `bytes` bytes that compute may use at once (contents unspecified): the
    /// allocation, stream-ordered on the copy stream, then compute ordered after it (CUDA: an
    /// event on the copy stream the compute stream waits for; sim: the checker's clocks). For a
    /// buffer compute uses before any copy into it (gradient, activation and state staging); a
    /// buffer filled by an H2D first needs only the copy's event.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] on the device tier; [`Error::Cuda`] when recording or waiting fails.
    pub fn alloc_for_compute(&self, bytes: usize) -> Result<DeviceBuffer> {
        Ok(match self {
            Device::Sim(d) => DeviceBuffer::Sim(d.alloc_for_compute(bytes)?),
            Device::Cuda(d) => DeviceBuffer::Cuda(d.alloc_for_compute(bytes)?),
        })
    }

    /// The high-water mark of the device's stream-ordered memory pool since it was opened or
    /// [`Device::reset_pool_peak`]: every byte this process's kernels and copies allocated there
    /// at once (CUDA: the swapper's buffers and candle's tensors; `CU_MEMPOOL_ATTR_USED_MEM_HIGH`).
    /// `None` on the sim device, whose compute allocates host memory, not device memory.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the query.
    pub fn pool_peak_bytes(&self) -> Result<Option<u64>> {
        match self {
            Device::Sim(_) => Ok(None),
            Device::Cuda(d) => d.pool_peak_bytes().map(Some),
        }
    }

    /// Restarts [`Device::pool_peak_bytes`] from the bytes in use now (nothing on the sim).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses it.
    pub fn reset_pool_peak(&self) -> Result<()> {
        match self {
            Device::Sim(_) => Ok(()),
            Device::Cuda(d) => d.reset_pool_peak(),
        }
    }

    /// Starts an H2D copy, ordered after all compute when compute used `dst` since its last
    /// ordering (always safe). See [`DeviceBackend::htod`] and [`Device::htod_after`].
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the buffer belongs to the other backend or is too small;
    /// on the sim, an ordering violation recorded earlier ([`SimDevice::check_ordering`]).
    pub fn htod(&self, src: HostBuffer, dst: DeviceBuffer) -> Result<Transfer> {
        match (self, dst) {
            (Device::Sim(d), DeviceBuffer::Sim(b)) => d.htod(src, b),
            (Device::Cuda(d), DeviceBuffer::Cuda(b)) => d.htod(src, b),
            _ => Err(Error::InvalidRequest("device buffer of another backend".into())),
        }
    }

    /// Starts a D2H copy, ordered after all compute when compute used `src` since its last
    /// ordering (always safe). See [`DeviceBackend::dtoh`] and [`Device::dtoh_after`].
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

    /// The sim device, if this is one (for its checker's log: [`SimDevice::ordering_violations`]).
    pub fn as_sim(&self) -> Option<&SimDevice> {
        match self {
            Device::Sim(d) => Some(d),
            Device::Cuda(_) => None,
        }
    }

    /// An event after the compute submitted so far (CUDA: recorded on the compute stream; sim:
    /// after the compute accesses so far). Pass it as `after` to [`Device::dtoh_after`],
    /// [`Device::htod_after`], [`Device::free_after`], or to [`Device::copy_waits_for`].
    ///
    /// # Errors
    /// [`Error::Cuda`] when recording fails (the sim device never fails here).
    pub fn record_compute_event(&self) -> Result<DeviceEvent> {
        match self {
            Device::Sim(d) => Ok(DeviceEvent::Sim(d.record_compute_event())),
            Device::Cuda(d) => Ok(DeviceEvent::Cuda(Arc::new(d.record_compute_event()?))),
        }
    }

    /// Starts an H2D copy into `dst` after `after` — an event recorded after the last compute
    /// that used `dst` (reuse of a buffer); `None` orders it after all compute when compute used
    /// `dst` (as [`Device::htod`]). Returns the transfer and the copy's event, for
    /// [`Device::compute_waits_for`].
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the buffer or event belongs to the other backend or `dst`
    /// is too small; on the sim, [`Error::Ordering`] when compute used `dst` after `after`, or a
    /// violation recorded earlier; [`Error::Cuda`] from the driver.
    pub fn htod_after(
        &self,
        src: HostBuffer,
        dst: DeviceBuffer,
        after: Option<&DeviceEvent>,
    ) -> Result<(Transfer, DeviceEvent)> {
        match (self, dst) {
            (Device::Sim(d), DeviceBuffer::Sim(b)) => {
                let (t, ev) = d.htod_after(src, b, DeviceEvent::sim(after)?)?;
                Ok((t, DeviceEvent::Sim(ev)))
            }
            (Device::Cuda(d), DeviceBuffer::Cuda(b)) => {
                let (t, ev) = d.htod_after(src, b, DeviceEvent::cuda(after)?)?;
                Ok((t, DeviceEvent::Cuda(ev)))
            }
            _ => Err(Error::InvalidRequest("device buffer of another backend".into())),
        }
    }

    /// Copies each `(src, dst)` pair H2D in one call, each ordered as [`Device::htod_after`]
    /// with no `after` event, and hands each device buffer to compute at once (as
    /// [`Transfer::release_device`]). On the sim device the pairs are one copy-engine job: one
    /// hand-off, the link's latency once for all their bytes, one operation in the link stats
    /// (the call returns when the job is done, as the sim's single copies do). On CUDA each pair is
    /// an async copy queued back to back on the copy stream, with its own event (none waited for).
    /// Returns per pair, in order, the device buffer, the host buffer pending until the copy
    /// completes and the copy's event — or the error and, when it was not lost, the host buffer.
    pub fn htod_batch(&self, copies: Vec<(HostBuffer, DeviceBuffer)>) -> Vec<BatchCopy> {
        match self {
            Device::Sim(d) => {
                let mut out: Vec<Option<BatchCopy>> = Vec::with_capacity(copies.len());
                let (mut sim, mut slots) = (Vec::new(), Vec::new());
                for (host, dev) in copies {
                    match dev {
                        DeviceBuffer::Sim(b) => {
                            slots.push(out.len());
                            out.push(None);
                            sim.push((host, b));
                        }
                        DeviceBuffer::Cuda(_) => out.push(Some(Err((
                            Error::InvalidRequest("device buffer of another backend".into()),
                            Some(host),
                        )))),
                    }
                }
                match d.htod_batch(sim) {
                    Ok(done) => {
                        for (r, slot) in done.into_iter().zip(&slots) {
                            out[*slot] = Some(match r {
                                Ok((b, host, ev)) => Ok((
                                    DeviceBuffer::Sim(b),
                                    PendingHost { event: None, host: Some(host) },
                                    DeviceEvent::Sim(ev),
                                )),
                                Err((e, host)) => Err((e, Some(host))),
                            });
                        }
                    }
                    Err(e) => {
                        for slot in slots {
                            out[slot] = Some(Err((Error::Device(e.to_string()), None)));
                        }
                    }
                }
                out.into_iter().map(|r| r.expect("every pair answered")).collect()
            }
            Device::Cuda(_) => copies
                .into_iter()
                .map(|(host, dev)| {
                    self.htod_after(host, dev, None)
                        .and_then(|(t, ev)| t.release_device().map(|(dev, pending)| (dev, pending, ev)))
                        .map_err(|e| (e, None))
                })
                .collect(),
        }
    }

    /// Starts a D2H copy of `src` after `after` — for a gradient, an event recorded after the
    /// kernel that wrote it; `None` orders it after all compute when compute used `src` (as
    /// [`Device::dtoh`]). Returns the transfer and the copy's event.
    ///
    /// # Errors
    /// As [`Device::htod_after`]; on the sim, [`Error::Ordering`] when compute wrote `src` after
    /// `after`.
    pub fn dtoh_after(
        &self,
        src: DeviceBuffer,
        dst: HostBuffer,
        after: Option<&DeviceEvent>,
    ) -> Result<(Transfer, DeviceEvent)> {
        match (self, src) {
            (Device::Sim(d), DeviceBuffer::Sim(b)) => {
                let (t, ev) = d.dtoh_after(b, dst, DeviceEvent::sim(after)?)?;
                Ok((t, DeviceEvent::Sim(ev)))
            }
            (Device::Cuda(d), DeviceBuffer::Cuda(b)) => {
                let (t, ev) = d.dtoh_after(b, dst, DeviceEvent::cuda(after)?)?;
                Ok((t, DeviceEvent::Cuda(ev)))
            }
            _ => Err(Error::InvalidRequest("device buffer of another backend".into())),
        }
    }

    /// Orders compute submitted from now on after `copy_done`, the event of a copy (it covers
    /// that copy and every copy submitted before it), without blocking the host: the buffer of
    /// that H2D may then go to compute.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an event of the other backend; [`Error::Cuda`] when the
    /// driver refuses the wait.
    pub fn compute_waits_for(&self, copy_done: &DeviceEvent) -> Result<()> {
        match (self, copy_done) {
            (Device::Sim(d), DeviceEvent::Sim(e)) => {
                d.compute_waits_for(e);
                Ok(())
            }
            (Device::Cuda(d), DeviceEvent::Cuda(e)) => d.compute_waits_for(e),
            _ => Err(other_backend_event()),
        }
    }

    /// Blocks the host until `event` has completed (CUDA: `cuEventSynchronize`; the sim device:
    /// at once, its copies being complete when their buffers are handed out). For consumers
    /// outside the device's streams; the device's own compute waits with
    /// [`Device::compute_waits_for`] instead. Not an ordering of compute on the sim's checker.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an event of the other backend; [`Error::Cuda`] when the
    /// event's work failed.
    pub fn synchronize_event(&self, event: &DeviceEvent) -> Result<()> {
        match (self, event) {
            (Device::Sim(_), DeviceEvent::Sim(_)) => Ok(()),
            (Device::Cuda(d), DeviceEvent::Cuda(e)) => d.synchronize_event(e),
            _ => Err(other_backend_event()),
        }
    }

    /// Orders compute submitted from now on after every copy submitted so far; does not block
    /// the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] when recording or waiting fails.
    pub fn compute_waits_for_copies(&self) -> Result<()> {
        match self {
            Device::Sim(d) => {
                d.compute_waits_for_copies();
                Ok(())
            }
            Device::Cuda(d) => d.compute_waits_for_copies(),
        }
    }

    /// Orders copies and frees submitted from now on after every compute submitted so far; does
    /// not block the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] when recording or waiting fails.
    pub fn copy_waits_for_compute(&self) -> Result<()> {
        match self {
            Device::Sim(d) => {
                d.copy_waits_for_compute();
                Ok(())
            }
            Device::Cuda(d) => d.copy_waits_for_compute(),
        }
    }

    /// Orders copies and frees submitted from now on after `event` (from
    /// [`Device::record_compute_event`]); does not block the host.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an event of the other backend; [`Error::Cuda`] when the
    /// driver refuses the wait.
    pub fn copy_waits_for(&self, event: &DeviceEvent) -> Result<()> {
        match (self, event) {
            (Device::Sim(d), DeviceEvent::Sim(e)) => {
                d.copy_waits_for(e);
                Ok(())
            }
            (Device::Cuda(d), DeviceEvent::Cuda(e)) => d.copy_wait(e),
            _ => Err(other_backend_event()),
        }
    }

    /// Frees `buf` after `after` — an event recorded after the last compute that used it; `None`
    /// orders the free after all compute when compute used it. The buffer is freed in every
    /// case (on an error, after all compute).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the buffer or event belongs to the other backend; on the
    /// sim, [`Error::Ordering`] when compute used `buf` after `after`, or a violation recorded
    /// earlier; [`Error::Cuda`] when the driver refuses the wait.
    pub fn free_after(&self, buf: DeviceBuffer, after: Option<&DeviceEvent>) -> Result<()> {
        match (self, buf) {
            (Device::Sim(d), DeviceBuffer::Sim(b)) => match DeviceEvent::sim(after) {
                Ok(after) => d.free_after(b, after),
                Err(e) => d.free_after(b, None).and(Err(e)),
            },
            (Device::Cuda(d), DeviceBuffer::Cuda(b)) => match DeviceEvent::cuda(after) {
                Ok(after) => d.free_after(b, after),
                Err(e) => d.free_after(b, None).and(Err(e)),
            },
            _ => Err(Error::InvalidRequest("device buffer of another backend".into())),
        }
    }

    /// The first ordering error the device recorded: on the sim, the first violation its
    /// checker found ([`SimDevice::check_ordering`]); on CUDA, a driver error recorded in the
    /// context (e.g. by a buffer's free). For a test's last assertion.
    ///
    /// # Errors
    /// [`Error::Ordering`] or [`Error::Cuda`] with that error.
    pub fn check_ordering(&self) -> Result<()> {
        match self {
            Device::Sim(d) => d.check_ordering(),
            Device::Cuda(d) => d.check_ordering(),
        }
    }

    /// Bytes, copies and busy time of the device's links, `(htod, dtoh)`, counting every copy it
    /// made: the sim's copy engines ([`SimDevice::link_stats`]), or the CUDA copy stream timed by
    /// events ([`CudaDevice::link_stats`]).
    pub fn link_stats(&self) -> (&crate::metrics::LinkStats, &crate::metrics::LinkStats) {
        match self {
            Device::Sim(d) => d.link_stats(),
            Device::Cuda(d) => d.link_stats(),
        }
    }

    /// The host allocator this device copies from fastest.
    pub fn host_allocator(&self, lock: bool) -> Arc<dyn HostAllocator> {
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

    /// Blocks until the copy has finished and hands back `(host, device)` buffers. After an
    /// H2D, the device buffer may go to compute at once (the host saw the copy complete).
    ///
    /// # Errors
    /// The copy failed or its engine stopped; the buffers are then dropped safely.
    pub fn wait(mut self) -> CopyResult {
        let r = self.take_result();
        if let Ok((_, DeviceBuffer::Sim(b))) = &r {
            b.host_waited();
        }
        r
    }

    /// H2D only: hands the device buffer back now, without the host waiting for the copy, for
    /// compute ordered after it by [`Device::compute_waits_for`] with the copy's event (or
    /// [`Device::compute_waits_for_copies`]) — a compute access before that is a race on CUDA
    /// and an [`Error::Ordering`] on the sim. The host buffer stays under the copy in the
    /// returned [`PendingHost`]. Copies into or out of the buffer and its free are ordered
    /// after the copy anyway (same copy stream).
    ///
    /// The sim device cannot hand out memory its copy engine is writing: it blocks until the
    /// copy is done, but its checker still counts the copy as not waited for.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a D2H (the copy reads the device buffer; the transfer then
    /// waits for it as when dropped); the copy failed or its engine stopped.
    pub fn release_device(mut self) -> Result<(DeviceBuffer, PendingHost)> {
        if self.direction != Direction::Htod {
            return Err(Error::InvalidRequest(
                "release_device: a D2H reads its device buffer until it completes; wait for the transfer".into(),
            ));
        }
        match std::mem::replace(&mut self.state, TransferState::Taken) {
            TransferState::Event { event, mut buffers } => {
                let (host, dev) = buffers.take().expect("buffers present");
                Ok((dev, PendingHost { event: Some(event), host: Some(host) }))
            }
            other => {
                self.state = other;
                let (host, dev) = self.take_result()?;
                Ok((dev, PendingHost { event: None, host: Some(host) }))
            }
        }
    }

    /// The copy's result, waiting for it.
    fn take_result(&mut self) -> CopyResult {
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

/// One pair's outcome in [`Device::htod_batch`]: the device buffer (compute may use it once
/// ordered after the event), the host buffer pending until the copy completes and the copy's
/// event; or the error and the host buffer when the copy did not take it.
pub type BatchCopy = std::result::Result<(DeviceBuffer, PendingHost, DeviceEvent), (Error, Option<HostBuffer>)>;

/// The host buffer of an H2D whose device buffer went to compute early
/// ([`Transfer::release_device`]): held until the copy completed.
pub struct PendingHost {
    /// The copy's event (CUDA); `None` when the copy is known complete.
    event: Option<Box<dyn CopyEvent>>,
    host: Option<HostBuffer>,
}

impl PendingHost {
    /// Whether the copy has completed (non-blocking).
    ///
    /// # Errors
    /// The copy failed.
    pub fn is_complete(&self) -> Result<bool> {
        self.event.as_ref().map_or(Ok(true), |e| e.query())
    }

    /// Blocks until the copy has completed and hands back the host buffer.
    ///
    /// # Errors
    /// The copy failed; the host buffer is then dropped after the copy stream stopped using it.
    pub fn wait(mut self) -> Result<HostBuffer> {
        if let Some(e) = self.event.take() {
            e.synchronize()?;
        }
        Ok(self.host.take().expect("host buffer present"))
    }
}

impl Drop for PendingHost {
    fn drop(&mut self) {
        if let (Some(e), Some(_)) = (&self.event, &self.host) {
            if let Err(err) = e.synchronize() {
                tracing::error!(error = %err, "copy failed; found while dropping its pending host buffer");
            }
        }
    }
}

impl std::fmt::Debug for PendingHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingHost").field("bytes", &self.host.as_ref().map(|h| h.len())).finish()
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
