//! The CUDA backend: device memory from the driver's stream-ordered allocator, H2D/D2H copies on
//! a copy stream of their own, driver-pinned host memory, and events between the copy stream and
//! the compute stream (candle's). Built on cudarc's safe API with dynamic loading, so it compiles
//! without CUDA; [`CudaDevice::new`] reports [`Error::NoCudaDevice`] where there is no driver.
//!
//! | concept | what it is |
//! |---|---|
//! | compute stream | where kernels run: candle's stream when built with [`CudaDevice::with_context`] |
//! | copy stream | a second, non-blocking stream that carries every H2D/D2H copy, so copies overlap compute |
//! | copy event | a `CudaEvent` recorded on the copy stream after a copy; guards the copy's buffers |
//! | [`CudaBuffer`] | a `CudaSlice<u8>` counted against the device's byte capacity until dropped |
//! | [`CudaPinnedAllocator`] | page-locked host memory from `cuMemHostAlloc` (fast, truly asynchronous copies) |
//!
//! The ownership rule and the ordering contract between the streams are documented on
//! [`CudaDevice`] (this module is private; its types are re-exported from [`super`]).
//!
//! # Host memory
//!
//! Copies from driver-pinned memory ([`DeviceBackend::host_allocator`]) are asynchronous DMA.
//! From other memory (an `mmap`, even `mlock`ed) the driver stages the bytes: an H2D returns once
//! staged, a D2H only when done. Both are correct; only pinned memory overlaps with the host.
//! [`CudaPinnedMemory`] hands out its bytes without synchronising cudarc's per-slice event (which
//! only cudarc's `HostSlice` path records, and which this backend never uses): the [`Transfer`]
//! ownership rule is what keeps the host off memory a copy is using.

#![allow(unsafe_code)]

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DriverError, PinnedHostSlice};

/// cudarc's event: a point on a stream, recorded after the work submitted to it so far.
pub use cudarc::driver::CudaEvent;

use super::{CopyEvent, DeviceBackend, DeviceBuffer, Direction, Transfer};
use crate::error::{Error, Result};
use crate::host::{HostAllocator, HostBuffer, HostMemory, PAGE_BYTES};
use crate::metrics::LinkStats;
use crate::tier::Tier;

/// Bytes of free device memory left to the compute side (kernels, cuBLAS workspace, candle's own
/// tensors) when no capacity is given: the larger of this and 5% of the total memory.
pub const DEFAULT_RESERVE_BYTES: u64 = 1 << 30;

fn cuda_err(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda { op, message: e.to_string() }
}

fn io_err(op: &'static str) -> impl FnOnce(DriverError) -> io::Error {
    move |e| io::Error::other(format!("CUDA driver error in {op}: {e}"))
}

/// The completion of a copy: the event recorded on the copy stream right after it, shared by the
/// [`Transfer`] that guards the copy's buffers and by whoever orders the compute stream after it.
/// With the timing event recorded just before the copy, it gives the link's busy time: once the
/// copy is seen complete (queried, waited for, or at the latest when dropped), the time between
/// the two events goes to the link's [`LinkStats`], once.
struct CopyDone {
    end: Arc<CudaEvent>,
    timing: Option<CopyTiming>,
}

/// The start of a copy on the copy stream (a timing event) and the link it counts on.
struct CopyTiming {
    start: CudaEvent,
    stats: Arc<LinkStats>,
    counted: AtomicBool,
}

impl CopyDone {
    /// Adds the copy's busy time (end event − start event, measured by the GPU) to its link,
    /// the first time it is called after the copy completed.
    fn count_busy(&self) {
        let Some(t) = &self.timing else { return };
        if t.counted.swap(true, Ordering::AcqRel) {
            return;
        }
        match t.start.elapsed_ms(&self.end) {
            Ok(ms) => t.stats.record_busy(std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3)),
            Err(e) => tracing::warn!(error = %e, "CUDA: a copy's busy time could not be read from its events"),
        }
    }
}

impl CopyEvent for CopyDone {
    fn query(&self) -> Result<bool> {
        let done = self.end.try_is_complete().map_err(cuda_err("event query"))?;
        if done {
            self.count_busy();
        }
        Ok(done)
    }

    fn synchronize(&self) -> Result<()> {
        self.end.synchronize().map_err(cuda_err("event synchronize"))?;
        self.count_busy();
        Ok(())
    }
}

impl Drop for CopyDone {
    fn drop(&mut self) {
        // The transfer synchronised before dropping it (or its copy failed: then nothing is
        // counted, as `elapsed_ms` fails).
        if matches!(self.end.try_is_complete(), Ok(true)) {
            self.count_busy();
        }
    }
}

/// Bytes of device capacity held for one buffer; released when dropped.
pub struct DeviceReservation {
    num_bytes: u64,
    allocated: Arc<AtomicU64>,
}

impl DeviceReservation {
    /// Bytes held.
    pub fn num_bytes(&self) -> u64 {
        self.num_bytes
    }
}

impl Drop for DeviceReservation {
    fn drop(&mut self) {
        self.allocated.fetch_sub(self.num_bytes, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for DeviceReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceReservation").field("num_bytes", &self.num_bytes).finish()
    }
}

/// The streams a buffer needs to order its free, and whether compute has seen the buffer.
/// Its `Drop` runs before the slice's (field order in [`CudaBuffer`]).
struct FreeOrder {
    /// Set when the slice is handed out to compute; cleared when a copy waited for compute.
    touched: AtomicBool,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

impl Drop for FreeOrder {
    fn drop(&mut self) {
        if self.touched.load(Ordering::Acquire) {
            // The free that follows is stream-ordered on the copy stream: make it wait for the
            // kernels that may still use the memory. Errors are recorded in the context and
            // surface at its next call (STYLE.md 7).
            if let Err(e) = self.copy.join(&self.compute) {
                tracing::error!(error = %e, "CUDA: ordering a buffer's free after compute failed");
                self.copy.context().record_err::<()>(Err(e));
            }
        }
    }
}

/// CUDA device memory: `num_bytes()` bytes in a `CudaSlice<u8>` allocated on the device's copy
/// stream and counted against the device's capacity until dropped.
///
/// Fields drop in order: the free is ordered after compute (when compute saw the buffer), then
/// the slice is freed on the copy stream, then the capacity is released.
pub struct CudaBuffer {
    order: FreeOrder,
    slice: CudaSlice<u8>,
    num_bytes: usize,
    reservation: DeviceReservation,
}

impl CudaBuffer {
    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }

    /// The device memory, for kernels on the compute stream. Its `len()` is `num_bytes()`, except
    /// for an empty buffer, which holds 1 byte (the driver does not allocate 0 bytes).
    ///
    /// Marks the buffer as seen by compute, so the next copy without an `after` event and the
    /// free wait for compute (see [`CudaDevice`]).
    pub fn as_slice(&self) -> &CudaSlice<u8> {
        self.order.touched.store(true, Ordering::Release);
        &self.slice
    }

    /// The device memory, mutably. As [`CudaBuffer::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut CudaSlice<u8> {
        self.order.touched.store(true, Ordering::Release);
        &mut self.slice
    }

    /// The buffer's device address (a `CUdeviceptr`) and its GPU's ordinal, for handing the
    /// memory to another framework without a copy (DLPack): valid while the buffer lives, for
    /// kernels on the compute stream. Marks the buffer as seen by compute.
    pub fn device_address(&self) -> (u64, usize) {
        use cudarc::driver::DevicePtr;
        let stream = self.order.compute.clone();
        let (ptr, _sync) = self.as_slice().device_ptr(&stream);
        (ptr, stream.context().ordinal())
    }

    /// A new slice of `numel` elements of `T` on `stream` (candle's compute stream) holding
    /// this buffer's first `numel × size_of::<T>()` bytes: one device-to-device copy, ordered on
    /// `stream` (after the kernels submitted to it so far, before the ones after). For handing a
    /// unit's compute copy to candle as a tensor it owns (`CudaStorage::wrap_cuda_slice`), since
    /// the residency manager keeps owning this buffer. Marks the buffer as seen by compute.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the buffer holds fewer bytes; [`Error::Cuda`] when the
    /// allocation or the copy fails.
    pub fn copy_out<T: cudarc::driver::DeviceRepr>(
        &self,
        numel: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaSlice<T>> {
        let bytes = numel * std::mem::size_of::<T>();
        if bytes > self.num_bytes {
            return Err(Error::InvalidRequest(format!(
                "copy_out of {bytes} bytes from a device buffer of {} bytes",
                self.num_bytes
            )));
        }
        // SAFETY: the memory is uninitialised until the copy below writes every one of its
        // `bytes` bytes; nothing reads it before (the copy is ordered first on `stream`).
        let mut dst = unsafe { stream.alloc::<T>(numel) }.map_err(cuda_err("alloc"))?;
        if bytes == 0 {
            return Ok(dst);
        }
        {
            // SAFETY: any bytes are a valid `u8`: the view reinterprets `dst`'s `bytes` bytes as bytes.
            let mut dst_bytes = unsafe { dst.transmute_mut::<u8>(bytes) }
                .ok_or_else(|| Error::InvalidRequest("copy_out: byte view out of bounds".into()))?;
            let src = self.as_slice().slice(..bytes);
            stream.memcpy_dtod(&src, &mut dst_bytes).map_err(cuda_err("memcpy dtod"))?;
        }
        Ok(dst)
    }

    /// Copies `src` (elements of `T`, e.g. a candle tensor's gradient) into the front of this
    /// buffer on `stream` (candle's compute stream: after the kernels that wrote `src`). Marks
    /// the buffer as seen by compute: a D2H of it afterwards needs an event recorded on
    /// `stream` after this call (see [`CudaDevice::dtoh_after`]).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when `src` does not fit; [`Error::Cuda`] when the copy fails.
    pub fn copy_in<T: cudarc::driver::DeviceRepr>(
        &mut self,
        src: &cudarc::driver::CudaView<'_, T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let bytes = src.len() * std::mem::size_of::<T>();
        if bytes > self.num_bytes {
            return Err(Error::InvalidRequest(format!(
                "copy_in of {bytes} bytes into a device buffer of {} bytes",
                self.num_bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: any bytes are a valid `u8`: the view reinterprets `src`'s bytes as bytes.
        let src_bytes = unsafe { src.transmute::<u8>(bytes) }
            .ok_or_else(|| Error::InvalidRequest("copy_in: byte view out of bounds".into()))?;
        let mut dst = self.as_mut_slice().slice_mut(..bytes);
        stream.memcpy_dtod(&src_bytes, &mut dst).map_err(cuda_err("memcpy dtod"))
    }

    /// Takes the slice out (for `CudaStorage::wrap_cuda_slice`, which takes it by value) with
    /// the capacity it holds. If compute had seen the buffer, the copy stream first waits for the
    /// compute submitted so far.
    ///
    /// The slice stays homed on the copy stream: dropping it frees it there. With cudarc's event
    /// tracking on, cudarc orders that free after the slice's last use; with tracking off, call
    /// [`CudaDevice::copy_waits_for_compute`] after the last kernel using it and before dropping
    /// it. Keep the `DeviceReservation` until then.
    pub fn into_parts(self) -> (CudaSlice<u8>, DeviceReservation) {
        let CudaBuffer { order, slice, num_bytes: _, reservation } = self;
        drop(order);
        (slice, reservation)
    }
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("num_bytes", &self.num_bytes())
            .field("seen_by_compute", &self.order.touched.load(Ordering::Relaxed))
            .finish()
    }
}

/// A CUDA GPU: device memory from the driver's stream-ordered allocator, H2D/D2H copies on a copy
/// stream of their own, driver-pinned host memory ([`DeviceBackend::host_allocator`]), and
/// events between the copy stream and the compute stream (candle's, see
/// [`CudaDevice::with_context`]).
///
/// # Ownership rule (STYLE.md 7)
///
/// A copy takes its host and device buffers by value; the returned [`Transfer`] holds both until
/// the copy's event has completed, and dropping an unfinished transfer synchronises that event
/// first. So no buffer is freed, reused, read or written by the host while a copy uses it.
///
/// # Ordering contract between the streams
///
/// The two streams run independently; they are ordered with events, never by blocking the host:
///
/// - **copy → compute.** Kernels may read a buffer only after the H2D that fills it. Either wait
///   for the [`Transfer`] on the host, or, without blocking, make the compute stream wait for the
///   copy: [`CudaDevice::compute_waits_for`] with the event from [`CudaDevice::htod_after`], or
///   [`CudaDevice::compute_waits_for_copies`] (every copy submitted so far).
/// - **compute → copy.** A copy must not read a buffer before the kernel that writes it (a D2H of
///   a gradient), nor overwrite one a kernel still reads (an H2D into a reused buffer). Pass an
///   event from [`CudaDevice::record_compute_event`], recorded after those kernels, as `after` to
///   [`CudaDevice::dtoh_after`] / [`CudaDevice::htod_after`]. Without `after` (and through
///   [`DeviceBackend::htod`] / [`DeviceBackend::dtoh`]), a buffer that was handed to compute
///   ([`CudaBuffer::as_slice`], [`CudaBuffer::as_mut_slice`]) since its last copy makes the copy
///   stream wait for **all** compute submitted so far: always correct, less overlap. A buffer no
///   kernel has seen is copied without waiting.
/// - **free.** A buffer lives on the copy stream (allocated and freed there, stream-ordered). If
///   compute has seen it, dropping it first makes the copy stream wait for the compute submitted
///   so far, so the memory is not reused under a running kernel.
///
/// cudarc's own event tracking (on unless `disable_event_tracking` was called) also orders each
/// `CudaSlice`'s uses across streams; this contract does not rely on it.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    capacity_bytes: u64,
    allocated: Arc<AtomicU64>,
    device_name: String,
    pinned: Arc<CudaPinnedAllocator>,
    htod_stats: Arc<LinkStats>,
    dtoh_stats: Arc<LinkStats>,
}

impl CudaDevice {
    /// Opens GPU `ordinal` (its primary context, as candle does) with a new compute stream and a
    /// new copy stream. `capacity_bytes` is the most device memory this backend hands out;
    /// `None` takes the free memory less the larger of `DEFAULT_RESERVE_BYTES` (1 GiB) and 5% of the
    /// total.
    ///
    /// # Errors
    /// [`Error::NoCudaDevice`] when `libcuda.so` cannot be loaded, the driver finds no device
    /// (including a stub `libcuda.so`), or `ordinal` is not below the device count;
    /// [`Error::Cuda`] when creating the context or a stream fails.
    pub fn new(ordinal: usize, capacity_bytes: Option<u64>) -> Result<Self> {
        // SAFETY: `is_culib_present` is unsafe only because loading a shared library runs its
        // initialisers; loading the system's CUDA driver library is what this backend is for.
        // Checking first matters: cudarc panics on its first driver call when it is missing.
        // (Linked at build time, `cuda-linked`, the binary does not start without it.)
        #[cfg(not(feature = "cuda-linked"))]
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCudaDevice {
                reason: "libcuda.so not found (no NVIDIA driver installed, or its directory is not on \
                         LD_LIBRARY_PATH)"
                    .into(),
            });
        }
        let count = CudaContext::device_count()
            .map_err(|e| Error::NoCudaDevice { reason: format!("the CUDA driver reports no usable device: {e}") })?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(Error::NoCudaDevice {
                reason: format!("device ordinal {ordinal} requested, {count} CUDA device(s) present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("create context"))?;
        let compute = ctx.new_stream().map_err(cuda_err("create compute stream"))?;
        Self::with_context(ctx, compute, capacity_bytes)
    }

    /// A device on an existing context and compute stream, e.g. candle's
    /// (`candle_core::cuda_backend::CudaDevice::cuda_stream()` and its context), so copy events
    /// order against the stream candle launches on. A new copy stream is created.
    ///
    /// candle's `Device::new_cuda` uses the *per-thread* default stream: events recorded on it
    /// from another thread land on that thread's stream. Record compute events from the thread
    /// that launches the kernels, or build candle with `new_with_stream`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when `compute_stream` belongs to another context; [`Error::Cuda`]
    /// when creating the copy stream, querying memory or the device name, or probing pinned
    /// memory support fails.
    pub fn with_context(
        ctx: Arc<CudaContext>,
        compute_stream: Arc<CudaStream>,
        capacity_bytes: Option<u64>,
    ) -> Result<Self> {
        if **compute_stream.context() != *ctx {
            return Err(Error::InvalidRequest("the compute stream belongs to another CUDA context".into()));
        }
        let copy = ctx.new_stream().map_err(cuda_err("create copy stream"))?;
        let (free, total) = ctx.mem_get_info().map_err(cuda_err("mem_get_info"))?;
        let (free, total) = (free as u64, total as u64);
        let capacity_bytes = match capacity_bytes {
            Some(c) => {
                if c > free {
                    tracing::warn!(
                        capacity_bytes = c,
                        free_bytes = free,
                        "CUDA device capacity exceeds the free memory; allocations may fail in the driver"
                    );
                }
                c
            }
            None => free.saturating_sub(DEFAULT_RESERVE_BYTES.max(total / 20)),
        };
        let device_name = ctx.name().map_err(cuda_err("device name"))?;
        let pinned = Arc::new(CudaPinnedAllocator::new(ctx.clone())?);
        Ok(Self {
            ctx,
            compute: compute_stream,
            copy,
            capacity_bytes,
            allocated: Arc::new(AtomicU64::new(0)),
            device_name,
            pinned,
            htod_stats: Arc::new(LinkStats::default()),
            dtoh_stats: Arc::new(LinkStats::default()),
        })
    }

    /// Bytes, copies and busy time of the copy stream: `(htod, dtoh)`. Every copy of this
    /// device counts (the residency manager's fetches and write-backs, gradients, activation
    /// checkpoints, direct calls): its bytes when submitted, its busy time — the time between
    /// timing events recorded on the copy stream just before and just after it, measured by the
    /// GPU, so waits for compute before a copy are not counted — once it is seen complete.
    pub fn link_stats(&self) -> (&LinkStats, &LinkStats) {
        (&self.htod_stats, &self.dtoh_stats)
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream kernels run on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream copies run on.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// An event recorded on the compute stream now: it completes when the kernels submitted so
    /// far have. Pass it as `after` to [`CudaDevice::dtoh_after`] / [`CudaDevice::htod_after`].
    ///
    /// # Errors
    /// [`Error::Cuda`] when creating or recording the event fails.
    pub fn record_compute_event(&self) -> Result<CudaEvent> {
        self.compute
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(cuda_err("record compute event"))
    }

    /// An event recorded on the copy stream now: it completes when the copies submitted so far
    /// have.
    ///
    /// # Errors
    /// [`Error::Cuda`] when creating or recording the event fails.
    pub fn record_copy_event(&self) -> Result<CudaEvent> {
        self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(cuda_err("record copy event"))
    }

    /// Makes the compute stream wait for `copy_done`, the event of a copy from
    /// [`CudaDevice::htod_after`] (kernels submitted later start after it); does
    /// not block the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the wait.
    pub fn compute_waits_for(&self, copy_done: &CudaEvent) -> Result<()> {
        self.compute.wait(copy_done).map_err(cuda_err("compute stream wait"))
    }

    /// Blocks the host until `event` has completed.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the event's work failed.
    pub fn synchronize_event(&self, event: &CudaEvent) -> Result<()> {
        event.synchronize().map_err(cuda_err("event synchronize"))
    }

    /// Makes the compute stream wait for every copy submitted so far; does not block the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] when recording or waiting fails.
    pub fn compute_waits_for_copies(&self) -> Result<()> {
        self.compute.join(&self.copy).map_err(cuda_err("compute stream wait"))
    }

    /// Makes the copy stream wait for every kernel submitted so far; does not block the host.
    ///
    /// # Errors
    /// [`Error::Cuda`] when recording or waiting fails.
    pub fn copy_waits_for_compute(&self) -> Result<()> {
        self.copy.join(&self.compute).map_err(cuda_err("copy stream wait"))
    }

    /// Makes the copy stream wait for `event` (e.g. from [`CudaDevice::record_compute_event`]).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the wait.
    pub fn copy_wait(&self, event: &CudaEvent) -> Result<()> {
        self.copy.wait(event).map_err(cuda_err("copy stream wait"))
    }

    /// Frees `buf` after `after` (an event from [`CudaDevice::record_compute_event`] recorded
    /// after the last kernel using it): the copy stream, where the free is stream-ordered, waits
    /// for `after`, and not for all compute. With `None`, as dropping it: after all compute when
    /// compute has seen it.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the wait; the buffer is then freed after all
    /// compute.
    pub fn free_after(&self, buf: CudaBuffer, after: Option<&CudaEvent>) -> Result<()> {
        if let Some(ev) = after {
            self.copy_wait(ev)?;
            buf.order.touched.store(false, Ordering::Release);
        }
        drop(buf);
        Ok(())
    }

    /// A driver error recorded in the context since the last check (by a buffer's free, an
    /// event's drop), as cudarc's `check_err` reports it.
    ///
    /// # Errors
    /// [`Error::Cuda`] with that error.
    pub fn check_ordering(&self) -> Result<()> {
        self.ctx.check_err().map_err(cuda_err("recorded error"))
    }

    /// A buffer of `bytes` bytes that compute may use at once: allocated stream-ordered on the
    /// copy stream, then the compute stream waits for an event recorded on the copy stream after
    /// the allocation (not for later copies), so a kernel never touches memory the allocator
    /// still hands to the copy stream's earlier work. For buffers compute writes first (gradient
    /// and activation staging).
    ///
    /// # Errors
    /// As [`DeviceBackend::alloc`]; [`Error::Cuda`] when recording or waiting fails.
    pub fn alloc_for_compute(&self, bytes: usize) -> Result<CudaBuffer> {
        let buf = self.alloc(bytes)?;
        let allocated = self.record_copy_event()?;
        self.compute_waits_for(&allocated)?;
        Ok(buf)
    }

    /// The device's default memory pool, which cudarc's stream-ordered allocations
    /// (`cuMemAllocAsync`: the swapper's buffers and candle's tensors) draw from.
    fn default_pool(&self) -> Result<sys::CUmemoryPool> {
        self.ctx.bind_to_thread().map_err(cuda_err("bind context"))?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer for one `CUmemoryPool`; the device handle comes
        // from the live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(cuda_err("cuDeviceGetDefaultMemPool"))?;
        Ok(pool)
    }

    /// Sets a `cuuint64_t` attribute of the default memory pool.
    fn set_pool_attribute(&self, attr: sys::CUmemPool_attribute, mut value: u64, op: &'static str) -> Result<()> {
        let pool = self.default_pool()?;
        // SAFETY: the attributes set here take a `cuuint64_t` by pointer; `value` is one, alive
        // for the call.
        unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(cuda_err(op))
    }

    /// Keeps the memory pool's memory: sets its release threshold to `u64::MAX`, so memory freed
    /// back to the pool is not returned to the driver at every synchronisation (the default
    /// threshold, 0, trims the pool whenever a stream or event is synchronised, and the next
    /// allocations pay `cuMemMap` again). Called once when the device is opened.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the attribute.
    pub fn keep_pool_memory(&self) -> Result<()> {
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        self.set_pool_attribute(attr, u64::MAX, "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
    }

    /// The memory pool's high-water mark: the most bytes its allocations held at once since the
    /// device was opened or [`CudaDevice::reset_pool_peak`] (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`):
    /// every stream-ordered allocation of this process on the device — the swapper's buffers and
    /// candle's tensors (activations, attention scores, autograd copies) — not the CUDA context
    /// nor libraries' own `cudaMalloc` (cuBLAS's workspace).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the query.
    pub fn pool_peak_bytes(&self) -> Result<u64> {
        let pool = self.default_pool()?;
        let mut high: u64 = 0;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        // SAFETY: the attribute is a `cuuint64_t` written through the pointer, alive for the call.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut high as *mut u64).cast()) }
            .result()
            .map_err(cuda_err("cuMemPoolGetAttribute(USED_MEM_HIGH)"))?;
        Ok(high)
    }

    /// Restarts [`CudaDevice::pool_peak_bytes`] from the bytes in use now (the driver accepts
    /// only 0, which resets the mark to the current use).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver refuses the attribute.
    pub fn reset_pool_peak(&self) -> Result<()> {
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        self.set_pool_attribute(attr, 0, "cuMemPoolSetAttribute(USED_MEM_HIGH)")
    }

    /// Orders the copy stream before a copy of `buf`: after `after` when given, else after all
    /// submitted compute when compute has seen `buf`.
    fn order_copy_after(&self, buf: &CudaBuffer, after: Option<&CudaEvent>) -> Result<()> {
        match after {
            Some(ev) => self.copy_wait(ev)?,
            None if buf.order.touched.load(Ordering::Acquire) => self.copy_waits_for_compute()?,
            None => return Ok(()),
        }
        buf.order.touched.store(false, Ordering::Release);
        Ok(())
    }

    /// A timing event on the copy stream, recorded just before a copy (after its waits). `None`
    /// (the copy's busy time not counted, its bytes still are) when the driver refuses it.
    fn start_timing(&self, direction: Direction, bytes: usize) -> Option<CopyTiming> {
        let stats = match direction {
            Direction::Htod => &self.htod_stats,
            Direction::Dtoh => &self.dtoh_stats,
        };
        stats.record_bytes(bytes as u64);
        match self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)) {
            Ok(start) => Some(CopyTiming { start, stats: stats.clone(), counted: AtomicBool::new(false) }),
            Err(e) => {
                tracing::warn!(error = %e, "CUDA: no timing event for a copy; its busy time is not counted");
                None
            }
        }
    }

    /// Records the copy's event, or, when that fails, waits for the copy stream so the buffers
    /// can be dropped safely with the error.
    fn finish_copy(&self, copied: std::result::Result<(), DriverError>, op: &'static str) -> Result<Arc<CudaEvent>> {
        let recorded = copied.map_err(cuda_err(op)).and_then(|()| {
            self.copy
                .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                .map_err(cuda_err("record copy event"))
        });
        match recorded {
            Ok(ev) => Ok(Arc::new(ev)),
            Err(e) => {
                // The copy may be queued; the buffers must outlive it (STYLE.md 7).
                if let Err(sync) = self.copy.synchronize() {
                    tracing::error!(error = %sync, "CUDA: copy stream synchronize failed after a failed copy");
                }
                Err(e)
            }
        }
    }

    /// Starts copying `src.as_slice()` into the front of `dst` on the copy stream, after `after`
    /// (see [`CudaDevice`]). Returns the transfer, which owns both buffers until the
    /// copy completed, and the copy's event for [`CudaDevice::compute_waits_for`].
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when `dst` is smaller than `src.len()`; [`Error::Cuda`] when a
    /// wait, the copy or the event fails (the buffers are then dropped after the copy stream
    /// drained).
    pub fn htod_after(
        &self,
        src: HostBuffer,
        mut dst: CudaBuffer,
        after: Option<&CudaEvent>,
    ) -> Result<(Transfer, Arc<CudaEvent>)> {
        let bytes = src.len();
        if dst.num_bytes() < bytes {
            return Err(Error::InvalidRequest(format!(
                "copy of {bytes} bytes into a device buffer of {} bytes",
                dst.num_bytes()
            )));
        }
        self.order_copy_after(&dst, after)?;
        let span = tracing::trace_span!("swapper::htod", bytes, tier = "device");
        let _enter = span.enter();
        // Safe cudarc call on a plain `&[u8]`: the slice borrow ends when the call returns, while
        // the DMA from pinned memory may go on; the transfer below owns `src` until the event.
        // An empty copy makes no driver call; its event still orders after earlier copies.
        let timing = self.start_timing(Direction::Htod, bytes);
        let copied = if bytes == 0 { Ok(()) } else { self.copy.memcpy_htod(src.as_slice(), &mut dst.slice) };
        let event = self.finish_copy(copied, "htod")?;
        let transfer = Transfer::from_event(
            Direction::Htod,
            bytes,
            Box::new(CopyDone { end: event.clone(), timing }),
            src,
            DeviceBuffer::Cuda(dst),
        );
        Ok((transfer, event))
    }

    /// Starts copying the first `dst.len()` bytes of `src` into `dst` on the copy stream, after
    /// `after` — for a gradient, an event from [`CudaDevice::record_compute_event`] recorded after
    /// the kernel that wrote it. Returns the transfer and the copy's event.
    ///
    /// # Errors
    /// As [`CudaDevice::htod_after`], with `src` smaller than `dst.len()`.
    pub fn dtoh_after(
        &self,
        src: CudaBuffer,
        mut dst: HostBuffer,
        after: Option<&CudaEvent>,
    ) -> Result<(Transfer, Arc<CudaEvent>)> {
        let bytes = dst.len();
        if src.num_bytes() < bytes {
            return Err(Error::InvalidRequest(format!(
                "copy of {bytes} bytes out of a device buffer of {} bytes",
                src.num_bytes()
            )));
        }
        self.order_copy_after(&src, after)?;
        let span = tracing::trace_span!("swapper::dtoh", bytes, tier = "host");
        let _enter = span.enter();
        // As in `htod_after`: the transfer owns `dst` until the event, the borrow ends here.
        let timing = self.start_timing(Direction::Dtoh, bytes);
        let copied =
            if bytes == 0 { Ok(()) } else { self.copy.memcpy_dtoh(&src.slice.slice(0..bytes), dst.as_mut_slice()) };
        let event = self.finish_copy(copied, "dtoh")?;
        let transfer = Transfer::from_event(
            Direction::Dtoh,
            bytes,
            Box::new(CopyDone { end: event.clone(), timing }),
            dst,
            DeviceBuffer::Cuda(src),
        );
        Ok((transfer, event))
    }

    fn reserve(&self, bytes: u64) -> Result<DeviceReservation> {
        let cap = self.capacity_bytes;
        let mut cur = self.allocated.load(Ordering::Acquire);
        loop {
            if cur.saturating_add(bytes) > cap {
                return Err(Error::OutOfMemory {
                    tier: Tier::Device,
                    requested_bytes: bytes,
                    available_bytes: cap.saturating_sub(cur),
                });
            }
            match self.allocated.compare_exchange_weak(cur, cur + bytes, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(DeviceReservation { num_bytes: bytes, allocated: self.allocated.clone() }),
                Err(v) => cur = v,
            }
        }
    }
}

impl DeviceBackend for CudaDevice {
    type Buffer = CudaBuffer;

    fn name(&self) -> String {
        format!("cuda:{} {}", self.ctx.ordinal(), self.device_name)
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Acquire)
    }

    /// A buffer of `bytes` bytes on the copy stream; contents unspecified (not zeroed).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] on [`Tier::Device`] when `bytes` does not fit the capacity, or the
    /// driver is out of memory (then `available_bytes` is the driver's free memory);
    /// [`Error::Cuda`] on other driver errors.
    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        let reservation = self.reserve(bytes as u64)?;
        // SAFETY: `alloc` is unsafe because the memory is left uninitialised. Device memory is
        // never read as a Rust value here; its contents are unspecified by contract
        // (`DeviceBackend::alloc`), and every bit pattern is a valid `u8`. One byte at least:
        // `cuMemAlloc` refuses 0 bytes.
        let slice = unsafe { self.copy.alloc::<u8>(bytes.max(1)) };
        let slice = slice.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                let free = self.ctx.mem_get_info().map(|(free, _)| free as u64).unwrap_or(0);
                Error::OutOfMemory { tier: Tier::Device, requested_bytes: bytes as u64, available_bytes: free }
            } else {
                Error::Cuda { op: "alloc", message: e.to_string() }
            }
        })?;
        let order =
            FreeOrder { touched: AtomicBool::new(false), compute: self.compute.clone(), copy: self.copy.clone() };
        Ok(CudaBuffer { order, slice, num_bytes: bytes, reservation })
    }

    /// [`CudaDevice::htod_after`] without an `after` event.
    fn htod(&self, src: HostBuffer, dst: CudaBuffer) -> Result<Transfer> {
        self.htod_after(src, dst, None).map(|(t, _)| t)
    }

    /// [`CudaDevice::dtoh_after`] without an `after` event: a buffer compute has seen is copied
    /// after all compute submitted so far.
    fn dtoh(&self, src: CudaBuffer, dst: HostBuffer) -> Result<Transfer> {
        self.dtoh_after(src, dst, None).map(|(t, _)| t)
    }

    /// The driver-pinned allocator; `lock` is ignored (driver-pinned memory is always locked).
    fn host_allocator(&self, lock: bool) -> Arc<dyn HostAllocator> {
        let _ = lock;
        self.pinned.clone()
    }

    /// Blocks until every copy submitted so far on the copy stream has completed (the compute
    /// stream is not synchronised).
    fn synchronize(&self) -> Result<()> {
        self.copy.synchronize().map_err(cuda_err("copy stream synchronize"))
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name())
            .field("capacity_bytes", &self.capacity_bytes)
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

/// Page-locked host memory from the CUDA driver (`cuMemHostAlloc` with
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, cached — not write-combined, which the
/// CPU reads slowly and the optimizer reads gradients from).
pub struct CudaPinnedAllocator {
    ctx: Arc<CudaContext>,
    page_locked: bool,
}

impl CudaPinnedAllocator {
    /// An allocator in `ctx`.
    ///
    /// # Errors
    /// [`Error::Cuda`] when querying the device fails.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self> {
        // Where the GPU reads pageable memory through the host page tables (Grace Hopper),
        // `cuMemHostAlloc` may not lock the pages; report that honestly.
        let uses_host_page_tables = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES)
            .map_err(cuda_err("device attribute"))?;
        Ok(Self { ctx, page_locked: uses_host_page_tables == 0 })
    }
}

impl HostAllocator for CudaPinnedAllocator {
    /// `capacity` rounded up to [`PAGE_BYTES`], zeroed.
    ///
    /// # Errors
    /// The driver refused, or returned memory that is not page-aligned (the CUDA documentation
    /// does not promise alignment; the driver maps whole pages, so this is checked, not assumed).
    fn allocate(&self, capacity: usize) -> io::Result<Box<dyn HostMemory>> {
        let capacity = capacity.max(1).next_multiple_of(PAGE_BYTES);
        // SAFETY: `alloc_pinned_with_flags` is unsafe only because the memory is uninitialised;
        // it is zeroed below before any reference to it exists.
        let mut slice = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(capacity, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(io_err("cuMemHostAlloc"))?;
        // Synchronises the slice's event, which was never recorded: returns at once.
        let ptr = slice.as_mut_ptr().map_err(io_err("pinned event synchronize"))?;
        let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::other("cuMemHostAlloc returned null"))?;
        if ptr.as_ptr() as usize % PAGE_BYTES != 0 {
            return Err(io::Error::other(format!(
                "cuMemHostAlloc returned {:p}, not aligned to {PAGE_BYTES} bytes",
                ptr.as_ptr()
            )));
        }
        // SAFETY: `ptr` is valid for writes of `capacity` bytes (the allocation's size), no
        // reference to the memory exists yet, and no copy uses it.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, capacity) };
        Ok(Box::new(CudaPinnedMemory { ptr, len: capacity, page_locked: self.page_locked, _slice: slice }))
    }

    fn name(&self) -> &'static str {
        "cuda-pinned"
    }
}

/// One driver-pinned allocation: `len` zero-initialised bytes at a page-aligned address, freed
/// with `cuMemFreeHost` when dropped.
pub struct CudaPinnedMemory {
    ptr: NonNull<u8>,
    len: usize,
    page_locked: bool,
    /// Owns the allocation; `ptr` points into it.
    _slice: PinnedHostSlice<u8>,
}

// SAFETY: the memory is owned by this value alone (`PinnedHostSlice` is itself Send + Sync);
// `ptr` is only dereferenced through `&self` (shared reads) or `&mut self` (exclusive writes), so
// it is as thread-safe as a `Box<[u8]>`. Copies touch it only while a `Transfer` owns it.
unsafe impl Send for CudaPinnedMemory {}
// SAFETY: as for `Send`: no interior mutability, access follows `&`/`&mut`.
unsafe impl Sync for CudaPinnedMemory {}

impl HostMemory for CudaPinnedMemory {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes while `_slice` lives (as long as `self`), the
        // bytes were zeroed at allocation, and the borrow of `self` rules out a `&mut` alias. No
        // copy writes to it meanwhile: a copy owns the buffer until its event completed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with `&mut self` making this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn is_page_locked(&self) -> bool {
        self.page_locked
    }
}

#[cfg(test)]
mod tests {
    //! GPU tests: each skips (`<test>: skipped (gpu): no CUDA device (<reason>)`, through
    //! [`crate::skip`]) and passes where there is no GPU, unless `OOGC_REQUIRE_GPU=1` (or
    //! `OOGC_REQUIRE=gpu`), which makes the skip a failure (STYLE.md 9).

    use super::*;
    use crate::host::{PinnedPool, PinnedPoolConfig};

    /// Device 0 with `capacity`, or `None` after the skip line ([`crate::skip`]: to stderr past
    /// the test harness's capture, counted, a failure under `OOGC_REQUIRE_GPU=1`).
    fn gpu(test: &str, capacity: Option<u64>) -> Option<CudaDevice> {
        match CudaDevice::new(0, capacity) {
            Ok(dev) => Some(dev),
            Err(Error::NoCudaDevice { reason }) => {
                crate::skip::skip(crate::skip::Capability::Gpu, test, &format!("no CUDA device ({reason})"));
                None
            }
            Err(e) => panic!("{test}: CUDA device 0 is present but unusable: {e}"),
        }
    }

    /// `cuda_test!(name, capacity, |dev| body)`: a test that runs `body` with device 0, or skips.
    macro_rules! cuda_test {
        ($name:ident, $capacity:expr, |$dev:ident| $body:block) => {
            #[test]
            fn $name() {
                let Some($dev) = gpu(stringify!($name), $capacity) else { return };
                $body
            }
        };
    }

    fn pinned_pool(dev: &CudaDevice) -> PinnedPool {
        PinnedPool::new(&PinnedPoolConfig { budget_bytes: 512 << 20, lock: true }, dev.host_allocator(true))
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8).collect()
    }

    fn into_cuda(buf: DeviceBuffer) -> CudaBuffer {
        match buf {
            DeviceBuffer::Cuda(b) => b,
            DeviceBuffer::Sim(_) => panic!("a CUDA transfer handed back a sim buffer"),
        }
    }

    #[test]
    fn new_reports_no_cuda_device_instead_of_panicking() {
        // SAFETY: loads the system's CUDA driver library if any (see `CudaDevice::new`).
        #[cfg(not(feature = "cuda-linked"))]
        let present = unsafe { sys::is_culib_present() };
        // Linked at build time, the test binary runs only where libcuda is.
        #[cfg(feature = "cuda-linked")]
        let present = true;
        if !present {
            match CudaDevice::new(0, None) {
                Err(Error::NoCudaDevice { reason }) => assert!(reason.contains("libcuda"), "{reason}"),
                other => panic!("expected NoCudaDevice without libcuda, got {other:?}"),
            }
        }
        // With or without a driver, an ordinal past the devices is `NoCudaDevice`.
        assert!(matches!(CudaDevice::new(1_000_000, None), Err(Error::NoCudaDevice { .. })));
    }

    cuda_test!(htod_then_dtoh_round_trips_bytes, None, |dev| {
        let pinned = pinned_pool(&dev);
        let pageable = PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 512 << 20, lock: false });
        for pool in [&pinned, &pageable] {
            for (i, len) in [0usize, 1, 4095, 4096, (1 << 20) + 3, 64 << 20].into_iter().enumerate() {
                let data = pattern(len, i as u32);
                let src = pool.alloc_copy(&data).unwrap();
                let buf = dev.alloc(len).unwrap();
                let (src, buf) = dev.htod(src, buf).unwrap().wait().unwrap();
                drop(src);
                let dst = pool.alloc(len).unwrap();
                let (dst, _buf) = dev.dtoh(into_cuda(buf), dst).unwrap().wait().unwrap();
                assert_eq!(dst.as_slice(), &data[..], "{} bytes via {}", len, pool.allocator_name());
            }
        }
        assert_eq!(dev.allocated_bytes(), 0);
    });

    cuda_test!(dtoh_copies_a_prefix_and_orders_after_compute_events, None, |dev| {
        let pool = pinned_pool(&dev);
        let data = pattern(1 << 20, 7);
        let buf = dev.alloc(data.len()).unwrap();
        let (t, copied) = dev.htod_after(pool.alloc_copy(&data).unwrap(), buf, None).unwrap();
        dev.compute_waits_for(&copied).unwrap();
        let done = dev.record_compute_event().unwrap();
        let (_, buf) = t.wait().unwrap();
        let mut buf = into_cuda(buf);
        let _ = buf.as_mut_slice(); // seen by compute
        let (t, _) = dev.dtoh_after(buf, pool.alloc(1000).unwrap(), Some(&done)).unwrap();
        let (dst, _) = t.wait().unwrap();
        assert_eq!(dst.as_slice(), &data[..1000]);
        dev.synchronize().unwrap();
    });

    cuda_test!(capacity_is_enforced_and_freed_on_drop, Some(1 << 20), |dev| {
        let a = dev.alloc(600_000).unwrap();
        match dev.alloc(500_000) {
            Err(Error::OutOfMemory { tier: Tier::Device, requested_bytes: 500_000, available_bytes }) => {
                assert_eq!(available_bytes, (1 << 20) - 600_000);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        drop(a);
        assert_eq!(dev.allocated_bytes(), 0);
        let b = dev.alloc(1 << 20).unwrap();
        assert_eq!(b.num_bytes(), 1 << 20);
    });

    cuda_test!(too_small_buffers_are_invalid_requests, None, |dev| {
        let pool = pinned_pool(&dev);
        let small = dev.alloc(50).unwrap();
        assert!(matches!(dev.htod(pool.alloc(100).unwrap(), small), Err(Error::InvalidRequest(_))));
        let small = dev.alloc(50).unwrap();
        assert!(matches!(dev.dtoh(small, pool.alloc(100).unwrap()), Err(Error::InvalidRequest(_))));
    });

    cuda_test!(dropping_an_unfinished_transfer_waits_for_its_copy, None, |dev| {
        let pool = pinned_pool(&dev);
        let len = 128 << 20;
        let src = pool.alloc_copy(&pattern(len, 3)).unwrap();
        let buf = dev.alloc(len).unwrap();
        let (t, htod_done) = dev.htod_after(src, buf, None).unwrap();
        drop(t); // must synchronise the event before the buffers go
        assert!(htod_done.try_is_complete().unwrap(), "buffers released before the H2D completed");
        assert_eq!(dev.allocated_bytes(), 0);
        assert_eq!(pool.live_bytes(), 0);

        let buf = dev.alloc(len).unwrap();
        let (t, dtoh_done) = dev.dtoh_after(buf, pool.alloc(len).unwrap(), None).unwrap();
        drop(t);
        assert!(dtoh_done.try_is_complete().unwrap(), "buffers released before the D2H completed");
        assert_eq!(pool.live_bytes(), 0);
        // The pooled host buffer is reused at once: the copy must not write into it any more.
        let mut again = pool.alloc(len).unwrap();
        again.as_mut_slice().fill(0xAB);
        dev.synchronize().unwrap();
        assert!(again.as_slice().iter().all(|&b| b == 0xAB));
    });

    cuda_test!(pinned_allocator_gives_page_aligned_locked_zeroed_memory, None, |dev| {
        let alloc = dev.host_allocator(true);
        assert_eq!(alloc.name(), "cuda-pinned");
        for len in [1usize, PAGE_BYTES, 3 << 20] {
            let mut mem = alloc.allocate(len).unwrap();
            let s = mem.as_slice();
            assert_eq!(s.as_ptr() as usize % PAGE_BYTES, 0);
            assert_eq!(s.len(), len.next_multiple_of(PAGE_BYTES));
            assert!(s.iter().all(|&b| b == 0));
            assert!(mem.is_page_locked());
            mem.as_mut_slice().fill(1);
            assert!(mem.as_slice().iter().all(|&b| b == 1));
        }
    });

    cuda_test!(into_parts_keeps_the_capacity_until_the_reservation_drops, Some(1 << 20), |dev| {
        let buf = dev.alloc(1000).unwrap();
        let (slice, reservation) = buf.into_parts();
        assert_eq!((slice.len(), reservation.num_bytes()), (1000, 1000));
        drop(slice);
        assert_eq!(dev.allocated_bytes(), 1000);
        drop(reservation);
        assert_eq!(dev.allocated_bytes(), 0);
        dev.synchronize().unwrap();
    });

    cuda_test!(name_names_the_ordinal_and_the_gpu, None, |dev| {
        let name = dev.name();
        assert!(name.starts_with("cuda:0 "), "{name}");
        assert!(dev.capacity_bytes() > 0);
    });
}
