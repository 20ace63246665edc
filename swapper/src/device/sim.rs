//! The sim device: device memory is host memory with an enforced byte capacity; copies run
//! asynchronously on two copy-engine threads (one per direction, as a GPU has separate H2D and
//! D2H engines) with an optional bandwidth and latency throttle that models the PCIe link
//! (foyer's `Throttle` device plays the same part for disks); compute is the CPU, synchronous.
//!
//! | concept | what it is |
//! |---|---|
//! | [`SimDevice`] | capacity, the two copy engines, and the happens-before checker (on unless [`SimDevice::with_ordering_checks`] turned it off) |
//! | [`SimBuffer`] | device memory: host memory counted against the capacity, with the checker's record of compute's last write and last access |
//! | compute access | [`SimBuffer::compute_read`] / [`SimBuffer::compute_write`]: the bytes for compute, placed on the checker's compute clock (CUDA: `CudaBuffer::as_slice`/`as_mut_slice`) |
//! | host view | [`SimBuffer::as_slice`] / [`SimBuffer::as_mut_slice`]: the bytes, unseen by the checker (the copy engines, tests, inspection) |
//! | [`SimEvent`] | an event: the compute position and copy id it covers |
//! | ordering calls | [`SimDevice::record_compute_event`], [`SimDevice::htod_after`], [`SimDevice::dtoh_after`], [`SimDevice::compute_waits_for`], [`SimDevice::compute_waits_for_copies`], [`SimDevice::copy_waits_for_compute`], [`SimDevice::copy_waits_for`], [`SimDevice::free_after`]: CUDA's, with the same meaning |
//!
//! Compute on the CPU needs none of the ordering calls to be correct here, which is why the
//! checker exists: it models CUDA's two streams with logical clocks and fails an operation that
//! CUDA would race on (what each call orders and what is checked: [`super::ordering`]). It
//! costs a few atomic integers per buffer and per call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Sender};

use super::ordering::{BufferOrder, Checker};
use super::{CopyResult, DeviceBackend, DeviceBuffer, Direction, OrderingViolation, SimEvent, Transfer};
use crate::error::{Error, Result};
use crate::host::{HostAllocator, HostBuffer, MmapAllocator};
use crate::metrics::LinkStats;
use crate::tier::Tier;

/// Configuration of a [`SimDevice`].
#[derive(Debug, Clone)]
pub struct SimDeviceConfig {
    /// Bytes of device memory. Default: 1 GiB.
    pub capacity_bytes: u64,
    /// Link bandwidth per direction in GB/s (10⁹ B/s); `None` copies at memcpy speed.
    /// Default: `None`. PCIe 4.0 x16 is about 25, PCIe 5.0 x16 about 50.
    pub link_gbps: Option<f64>,
    /// Fixed latency added to each copy, in microseconds. Default: 0.
    pub latency_us: f64,
    /// Whether the checker counts a host wait for an H2D ([`Transfer::wait`]) as ordering
    /// compute after the copy. Default: true. The runtime sets false: its contract is that
    /// compute waits on the copy's event, never on the host (see [`super::ordering`], "Host
    /// waits"), so a compute access that only a host wait ordered is a violation there.
    pub host_wait_orders_compute: bool,
}

impl Default for SimDeviceConfig {
    fn default() -> Self {
        Self { capacity_bytes: 1 << 30, link_gbps: None, latency_us: 0.0, host_wait_orders_compute: true }
    }
}

impl SimDeviceConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key when `link_gbps` is not positive or `latency_us` is negative.
    pub fn validate(&self) -> Result<()> {
        if let Some(g) = self.link_gbps {
            if !(g.is_finite() && g > 0.0) {
                return Err(Error::Config { key: "link_gbps".into(), reason: format!("{g} must be > 0 GB/s") });
            }
        }
        if !(self.latency_us.is_finite() && self.latency_us >= 0.0) {
            return Err(Error::Config {
                key: "latency_us".into(),
                reason: format!("{} must be >= 0 µs", self.latency_us),
            });
        }
        Ok(())
    }
}

/// Sim device memory: host memory, 8-byte aligned, counted against the device's capacity until
/// dropped. With the checker on, it records compute's accesses, and dropping it checks that the
/// free is ordered after them (recorded as
/// [`OrderingHazard::DropBeforeComputeAccess`](super::OrderingHazard::DropBeforeComputeAccess)).
pub struct SimBuffer {
    words: Vec<u64>,
    num_bytes: usize,
    allocated: Arc<AtomicU64>,
    /// The checker's record (`None` with the checker off). Dropped after the capacity is released.
    order: Option<BufferOrder>,
}

impl SimBuffer {
    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }

    /// The bytes as compute reads them: a compute access (a kernel reading the buffer) at the
    /// checker's next compute position. Call it where the kernel runs; CUDA's counterpart is
    /// `CudaBuffer::as_slice`.
    ///
    /// # Errors
    /// [`Error::Ordering`]
    /// ([`OrderingHazard::ComputeBeforeHtod`](super::OrderingHazard::ComputeBeforeHtod)) when an
    /// H2D into the buffer was neither waited for on the host ([`Transfer::wait`]) nor by compute
    /// ([`SimDevice::compute_waits_for`] with its event, or [`SimDevice::compute_waits_for_copies`]).
    pub fn compute_read(&self) -> Result<&[u8]> {
        if let Some(o) = &self.order {
            o.compute_access(false)?;
        }
        Ok(self.as_slice())
    }

    /// The bytes as compute writes them (and reads them): a compute write at the checker's next
    /// compute position. CUDA's counterpart is `CudaBuffer::as_mut_slice`.
    ///
    /// # Errors
    /// As [`SimBuffer::compute_read`].
    pub fn compute_write(&mut self) -> Result<&mut [u8]> {
        if let Some(o) = &self.order {
            o.compute_access(true)?;
        }
        Ok(self.as_mut_slice())
    }

    /// The bytes, as the host sees them: not a compute access, unseen by the checker (for the
    /// copy engines, tests and inspection). Compute uses [`SimBuffer::compute_read`].
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.num_bytes]
    }

    /// The bytes, mutably, as the host sees them: unseen by the checker, as
    /// [`SimBuffer::as_slice`]. Compute uses [`SimBuffer::compute_write`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.num_bytes]
    }

    /// The buffer's number on its device (allocation order, from 1; 0 with the checker off), as
    /// [`OrderingViolation::buffer`] names it.
    pub fn id(&self) -> u64 {
        self.order.as_ref().map_or(0, BufferOrder::id)
    }

    /// The host saw the buffer's H2D complete: called by [`Transfer::wait`].
    pub(super) fn host_waited(&self) {
        if let Some(o) = &self.order {
            o.host_waited();
        }
    }

    /// Forgets compute's accesses before the buffer goes with an error (nothing to check twice).
    fn disarm(&self) {
        if let Some(o) = &self.order {
            o.disarm();
        }
    }
}

impl Drop for SimBuffer {
    fn drop(&mut self) {
        self.allocated.fetch_sub(self.num_bytes as u64, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for SimBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBuffer").field("id", &self.id()).field("num_bytes", &self.num_bytes).finish()
    }
}

enum Job {
    Copy {
        host: HostBuffer,
        dev: SimBuffer,
        reply: Sender<CopyResult>,
    },
    /// Several H2D copies as one: one hand-off to the engine, the link's latency paid once for
    /// the bytes of all of them, every buffer handed back together.
    Batch {
        copies: Vec<(HostBuffer, SimBuffer)>,
        reply: Sender<Vec<(HostBuffer, SimBuffer)>>,
    },
    Barrier(Sender<()>),
}

/// A copy engine: one thread serving one direction, throttled by a virtual clock.
struct Engine {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    fn spawn(direction: Direction, cfg: &SimDeviceConfig, stats: Arc<LinkStats>) -> Self {
        let (tx, rx) = unbounded::<Job>();
        let link_gbps = cfg.link_gbps;
        let latency = Duration::from_secs_f64(cfg.latency_us * 1e-6);
        let name = match direction {
            Direction::Htod => "oogc-sim-htod",
            Direction::Dtoh => "oogc-sim-dtoh",
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // The link is free again at `link_free`; a copy occupies it for latency + bytes/bw.
                let mut link_free = Instant::now();
                // Occupies the link for latency + bytes / bandwidth from `start` (sleeping until
                // then).
                let throttle = |link_free: &mut Instant, start: Instant, bytes: usize| {
                    if let Some(gbps) = link_gbps {
                        let busy = latency + Duration::from_secs_f64(bytes as f64 / (gbps * 1e9));
                        *link_free = (*link_free).max(start) + busy;
                        let now = Instant::now();
                        if *link_free > now {
                            std::thread::sleep(*link_free - now);
                        }
                    } else if !latency.is_zero() {
                        std::thread::sleep(latency);
                    }
                };
                for job in rx {
                    let (mut host, mut dev, reply) = match job {
                        Job::Copy { host, dev, reply } => (host, dev, reply),
                        Job::Batch { mut copies, reply } => {
                            let bytes: usize = copies.iter().map(|(h, _)| h.len()).sum();
                            let _enter =
                                tracing::trace_span!("swapper::htod", bytes, tier = "device", copies = copies.len())
                                    .entered();
                            let start = Instant::now();
                            for (host, dev) in &mut copies {
                                let n = host.len();
                                dev.as_mut_slice()[..n].copy_from_slice(host.as_slice());
                            }
                            throttle(&mut link_free, start, bytes);
                            stats.record(bytes as u64, start.elapsed());
                            let _ = reply.send(copies);
                            continue;
                        }
                        Job::Barrier(done) => {
                            let _ = done.send(());
                            continue;
                        }
                    };
                    let bytes = host.len();
                    let span = match direction {
                        Direction::Htod => tracing::trace_span!("swapper::htod", bytes, tier = "device"),
                        Direction::Dtoh => tracing::trace_span!("swapper::dtoh", bytes, tier = "host"),
                    };
                    let _enter = span.enter();
                    let start = Instant::now();
                    match direction {
                        Direction::Htod => dev.as_mut_slice()[..bytes].copy_from_slice(host.as_slice()),
                        Direction::Dtoh => host.as_mut_slice().copy_from_slice(&dev.as_slice()[..bytes]),
                    }
                    throttle(&mut link_free, start, bytes);
                    stats.record(bytes as u64, start.elapsed());
                    let _ = reply.send(Ok((host, DeviceBuffer::Sim(dev))));
                }
            })
            .expect("spawn sim copy engine");
        Self { tx: Some(tx), thread: Some(thread) }
    }

    fn submit(&self, job: Job) -> Result<()> {
        self.tx.as_ref().expect("engine running").send(job).map_err(|_| Error::Device("sim copy engine stopped".into()))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.tx.take()); // the thread finishes the queued copies, then exits
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A simulated GPU: host memory with an enforced byte capacity, two copy-engine threads (H2D,
/// D2H) with an optional bandwidth and latency throttle that models the PCIe link, and a
/// happens-before checker that holds callers to [`CudaDevice`](super::CudaDevice)'s ordering
/// contract (what each call orders and checks: [`super::ordering`]).
///
/// The checker's calls mirror CUDA's: [`SimDevice::record_compute_event`],
/// [`SimDevice::htod_after`], [`SimDevice::dtoh_after`], [`SimDevice::compute_waits_for`],
/// [`SimDevice::compute_waits_for_copies`], [`SimDevice::copy_waits_for_compute`],
/// [`SimDevice::copy_waits_for`], [`SimDevice::free_after`]; compute accesses are
/// [`SimBuffer::compute_read`] / [`SimBuffer::compute_write`].
pub struct SimDevice {
    config: SimDeviceConfig,
    allocated: Arc<AtomicU64>,
    htod: Engine,
    dtoh: Engine,
    htod_stats: Arc<LinkStats>,
    dtoh_stats: Arc<LinkStats>,
    /// The happens-before checker (`None` when turned off).
    checker: Option<Arc<Checker>>,
}

impl SimDevice {
    /// A sim device with `config`'s capacity and throttle and the ordering checker on; starts its
    /// two copy-engine threads.
    ///
    /// # Errors
    /// [`Error::Config`] from [`SimDeviceConfig::validate`].
    pub fn new(config: SimDeviceConfig) -> Result<Self> {
        Self::with_ordering_checks(config, true)
    }

    /// [`SimDevice::new`], with the happens-before checker on (`check_ordering`, the default of
    /// `new`) or off (no records, no checks, events carry zeros; for benchmarks that want the
    /// last few atomics gone).
    ///
    /// # Errors
    /// [`Error::Config`] from [`SimDeviceConfig::validate`].
    pub fn with_ordering_checks(config: SimDeviceConfig, check_ordering: bool) -> Result<Self> {
        config.validate()?;
        let htod_stats = Arc::new(LinkStats::default());
        let dtoh_stats = Arc::new(LinkStats::default());
        let checker = check_ordering.then(|| Arc::new(Checker::new(config.host_wait_orders_compute)));
        Ok(Self {
            htod: Engine::spawn(Direction::Htod, &config, htod_stats.clone()),
            dtoh: Engine::spawn(Direction::Dtoh, &config, dtoh_stats.clone()),
            allocated: Arc::new(AtomicU64::new(0)),
            config,
            htod_stats,
            dtoh_stats,
            checker,
        })
    }

    /// Whether the happens-before checker is on.
    pub fn checks_ordering(&self) -> bool {
        self.checker.is_some()
    }

    /// An event after the compute accesses so far (CUDA: recorded on the compute stream). Pass
    /// it as `after` to [`SimDevice::dtoh_after`], [`SimDevice::htod_after`],
    /// [`SimDevice::free_after`].
    pub fn record_compute_event(&self) -> SimEvent {
        self.checker.as_ref().map_or_else(SimEvent::default, |c| c.record_compute_event())
    }

    /// Orders compute after `copy_done`, the event of a copy (CUDA: the compute stream waits for
    /// it); compute may then read the buffer of that H2D, and of every H2D submitted before it.
    pub fn compute_waits_for(&self, copy_done: &SimEvent) {
        if let Some(c) = &self.checker {
            c.compute_waits_for(copy_done);
        }
    }

    /// A buffer of `bytes` bytes (contents unspecified) that compute may use at once: the
    /// allocation, then compute ordered after it ([`SimDevice::compute_waits_for`] with the
    /// allocation's event; CUDA's counterpart waits for an event recorded on the copy stream after
    /// the stream-ordered allocation). For buffers compute writes first (staging).
    ///
    /// # Errors
    /// As [`DeviceBackend::alloc`].
    pub fn alloc_for_compute(&self, bytes: usize) -> Result<SimBuffer> {
        let (buf, allocated) = self.alloc_with_event(bytes)?;
        self.compute_waits_for(&allocated);
        Ok(buf)
    }

    /// Orders compute after every copy submitted so far.
    pub fn compute_waits_for_copies(&self) {
        if let Some(c) = &self.checker {
            c.compute_waits_for_copies();
        }
    }

    /// Orders the copy stream (later copies and frees) after every compute access so far.
    pub fn copy_waits_for_compute(&self) {
        if let Some(c) = &self.checker {
            c.copy_waits_for_compute();
        }
    }

    /// Orders the copy stream (later copies and frees) after `event`'s compute.
    pub fn copy_waits_for(&self, event: &SimEvent) {
        if let Some(c) = &self.checker {
            c.copy_waits_for(event);
        }
    }

    /// Starts copying `src.as_slice()` into the front of `dst`, after `after` (an event from
    /// [`SimDevice::record_compute_event`] recorded after the last compute access to `dst`);
    /// with `None`, after all compute when compute used `dst` since the copy stream's last
    /// ordering. Returns the transfer and the copy's event (for [`SimDevice::compute_waits_for`]).
    ///
    /// # Errors
    /// [`Error::Ordering`]
    /// ([`OrderingHazard::HtodOverComputeAccess`](super::OrderingHazard::HtodOverComputeAccess))
    /// when compute used `dst` after `after` (nothing is copied; both buffers are dropped); a
    /// violation recorded earlier (see [`SimDevice::check_ordering`]); as
    /// [`DeviceBackend::htod`].
    pub fn htod_after(
        &self,
        src: HostBuffer,
        dst: SimBuffer,
        after: Option<&SimEvent>,
    ) -> Result<(Transfer, SimEvent)> {
        self.copy(Direction::Htod, src, dst, after)
    }

    /// Starts copying the first `dst.len()` bytes of `src` into `dst`, after `after` — for a
    /// gradient, an event recorded after the compute that wrote it; with `None`, as the plain
    /// [`DeviceBackend::dtoh`]. Returns the transfer and the copy's event.
    ///
    /// # Errors
    /// [`Error::Ordering`]
    /// ([`OrderingHazard::DtohBeforeComputeWrite`](super::OrderingHazard::DtohBeforeComputeWrite))
    /// when compute wrote `src` after `after` (nothing is copied); otherwise as
    /// [`SimDevice::htod_after`].
    pub fn dtoh_after(
        &self,
        src: SimBuffer,
        dst: HostBuffer,
        after: Option<&SimEvent>,
    ) -> Result<(Transfer, SimEvent)> {
        self.copy(Direction::Dtoh, dst, src, after)
    }

    /// Copies each `(src, dst)` pair H2D as one copy-engine job (one hand-off, the link's
    /// latency once for all the bytes: the link stats count one operation) and waits for it;
    /// each pair's copy is ordered as [`SimDevice::htod_after`] with no `after` event. Returns
    /// per pair, in order, the filled buffer, the host buffer and the copy's event — or, when
    /// that pair's ordering check or length check failed (nothing copied for it), the error and
    /// its host buffer back.
    ///
    /// # Errors
    /// The copy engine stopped (every pair's buffers are lost with it).
    #[allow(clippy::type_complexity)]
    pub fn htod_batch(
        &self,
        copies: Vec<(HostBuffer, SimBuffer)>,
    ) -> Result<Vec<std::result::Result<(SimBuffer, HostBuffer, SimEvent), (Error, HostBuffer)>>> {
        let mut out: Vec<Option<std::result::Result<(SimBuffer, HostBuffer, SimEvent), (Error, HostBuffer)>>> =
            Vec::with_capacity(copies.len());
        let (mut queued, mut events, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (host, dev) in copies {
            let checked = self.report().and_then(|()| Self::check_len(&host, &dev)).and_then(|()| {
                match (&self.checker, &dev.order) {
                    (Some(c), Some(o)) => c.order_copy(Direction::Htod, o, None).map_err(Error::from),
                    _ => Ok(SimEvent::default()),
                }
            });
            match checked {
                Ok(ev) => {
                    slots.push(out.len());
                    out.push(None);
                    events.push(ev);
                    queued.push((host, dev));
                }
                Err(e) => {
                    dev.disarm();
                    out.push(Some(Err((e, host))));
                }
            }
        }
        if !queued.is_empty() {
            let (reply, rx) = bounded(1);
            self.htod.submit(Job::Batch { copies: queued, reply })?;
            let done = rx.recv().map_err(|_| Error::Device("copy engine stopped before the copies finished".into()))?;
            for (((host, dev), ev), slot) in done.into_iter().zip(events).zip(slots) {
                out[slot] = Some(Ok((dev, host, ev)));
            }
        }
        Ok(out.into_iter().map(|r| r.expect("every pair answered")).collect())
    }

    /// Frees `buf` after `after` (an event recorded after compute's last access to it); with
    /// `None`, after all compute when compute used it since the copy stream's last ordering.
    /// The buffer is freed in every case.
    ///
    /// # Errors
    /// [`Error::Ordering`]
    /// ([`OrderingHazard::FreeBeforeComputeAccess`](super::OrderingHazard::FreeBeforeComputeAccess))
    /// when compute used `buf` after `after`; a violation recorded earlier (see
    /// [`SimDevice::check_ordering`]).
    pub fn free_after(&self, buf: SimBuffer, after: Option<&SimEvent>) -> Result<()> {
        if let (Some(c), Some(o)) = (&self.checker, &buf.order) {
            if let Err(v) = c.order_free(o, after) {
                buf.disarm();
                return Err(v.into());
            }
        }
        drop(buf);
        self.report()
    }

    /// Every ordering violation the checker found so far, in the order found (empty with the
    /// checker off).
    pub fn ordering_violations(&self) -> Vec<OrderingViolation> {
        self.checker.as_ref().map_or_else(Vec::new, |c| c.violations())
    }

    /// The first ordering violation found so far, for a test's last assertion; every violation
    /// counts as reported afterwards.
    ///
    /// # Errors
    /// [`Error::Ordering`] with that violation.
    pub fn check_ordering(&self) -> Result<()> {
        match self.checker.as_ref().and_then(|c| c.first_violation()) {
            Some(v) => Err(v.into()),
            None => Ok(()),
        }
    }

    /// The first violation recorded (in a `Drop`) and not reported yet, as an error: called at
    /// the start of the device's calls that can fail, as cudarc reports a recorded error.
    fn report(&self) -> Result<()> {
        match self.checker.as_ref().and_then(|c| c.take_unreported()) {
            Some(v) => Err(v.into()),
            None => Ok(()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SimDeviceConfig {
        &self.config
    }

    /// Bytes and busy time of the copy engines: `(htod, dtoh)`.
    pub fn link_stats(&self) -> (&LinkStats, &LinkStats) {
        (&self.htod_stats, &self.dtoh_stats)
    }

    fn check_len(host: &HostBuffer, dev: &SimBuffer) -> Result<()> {
        if dev.num_bytes() < host.len() {
            return Err(Error::InvalidRequest(format!(
                "copy of {} bytes into/out of a device buffer of {} bytes",
                host.len(),
                dev.num_bytes()
            )));
        }
        Ok(())
    }

    /// A buffer of `bytes` bytes and its allocation's event (copy-stream ordered; see
    /// [`SimDevice::alloc_for_compute`]).
    fn alloc_with_event(&self, bytes: usize) -> Result<(SimBuffer, SimEvent)> {
        self.report()?;
        let cap = self.config.capacity_bytes;
        let mut cur = self.allocated.load(Ordering::Acquire);
        loop {
            if cur + bytes as u64 > cap {
                return Err(Error::OutOfMemory {
                    tier: Tier::Device,
                    requested_bytes: bytes as u64,
                    available_bytes: cap.saturating_sub(cur),
                });
            }
            match self.allocated.compare_exchange_weak(cur, cur + bytes as u64, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(v) => cur = v,
            }
        }
        let (order, event) = match &self.checker {
            Some(c) => {
                let (o, e) = c.new_buffer(bytes);
                (Some(o), e)
            }
            None => (None, SimEvent::default()),
        };
        let buf = SimBuffer {
            words: vec![0u64; bytes.div_ceil(8)],
            num_bytes: bytes,
            allocated: self.allocated.clone(),
            order,
        };
        Ok((buf, event))
    }

    /// Checks and orders a copy (see [`SimDevice::htod_after`]), then queues it on its engine.
    /// A buffer dropped with an error is disarmed: the error is the report.
    fn copy(
        &self,
        direction: Direction,
        host: HostBuffer,
        dev: SimBuffer,
        after: Option<&SimEvent>,
    ) -> Result<(Transfer, SimEvent)> {
        let checked = self.report().and_then(|()| Self::check_len(&host, &dev)).and_then(|()| {
            match (&self.checker, &dev.order) {
                (Some(c), Some(o)) => c.order_copy(direction, o, after).map_err(Error::from),
                _ => Ok(SimEvent::default()),
            }
        });
        let event = match checked {
            Ok(ev) => ev,
            Err(e) => {
                dev.disarm();
                return Err(e);
            }
        };
        let bytes = host.len();
        let (reply, rx) = bounded(1);
        let engine = match direction {
            Direction::Htod => &self.htod,
            Direction::Dtoh => &self.dtoh,
        };
        engine.submit(Job::Copy { host, dev, reply })?;
        Ok((Transfer::from_channel(direction, bytes, rx), event))
    }
}

impl DeviceBackend for SimDevice {
    type Buffer = SimBuffer;

    fn name(&self) -> String {
        let gib = self.config.capacity_bytes as f64 / (1u64 << 30) as f64;
        match self.config.link_gbps {
            Some(g) => format!("sim ({gib:.2} GiB, {g} GB/s link)"),
            None => format!("sim ({gib:.2} GiB, unthrottled link)"),
        }
    }

    fn capacity_bytes(&self) -> u64 {
        self.config.capacity_bytes
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Acquire)
    }

    fn alloc(&self, bytes: usize) -> Result<SimBuffer> {
        self.alloc_with_event(bytes).map(|(b, _)| b)
    }

    /// [`SimDevice::htod_after`] without an `after` event.
    fn htod(&self, src: HostBuffer, dst: SimBuffer) -> Result<Transfer> {
        self.copy(Direction::Htod, src, dst, None).map(|(t, _)| t)
    }

    /// [`SimDevice::dtoh_after`] without an `after` event.
    fn dtoh(&self, src: SimBuffer, dst: HostBuffer) -> Result<Transfer> {
        self.copy(Direction::Dtoh, dst, src, None).map(|(t, _)| t)
    }

    fn host_allocator(&self, lock: bool) -> Arc<dyn HostAllocator> {
        Arc::new(MmapAllocator::new(lock))
    }

    fn synchronize(&self) -> Result<()> {
        self.report()?;
        for engine in [&self.htod, &self.dtoh] {
            let (tx, rx) = bounded(1);
            engine.submit(Job::Barrier(tx))?;
            rx.recv().map_err(|_| Error::Device("sim copy engine stopped".into()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::OrderingHazard;
    use crate::host::{PinnedPool, PinnedPoolConfig};

    fn pool() -> PinnedPool {
        PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 64 << 20, lock: false })
    }

    #[test]
    fn capacity_is_enforced_and_freed_on_drop() {
        let dev = SimDevice::new(SimDeviceConfig { capacity_bytes: 1000, ..Default::default() }).unwrap();
        let a = dev.alloc(600).unwrap();
        match dev.alloc(500) {
            Err(Error::OutOfMemory { tier: Tier::Device, requested_bytes: 500, available_bytes: 400 }) => {}
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        drop(a);
        assert_eq!(dev.allocated_bytes(), 0);
        dev.alloc(1000).unwrap();
    }

    #[test]
    fn htod_then_dtoh_round_trips_bytes() {
        let dev = SimDevice::new(SimDeviceConfig::default()).unwrap();
        let pool = pool();
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 7 + 3) as u8).collect();
        let src = pool.alloc_copy(&data).unwrap();
        let buf = dev.alloc(data.len()).unwrap();
        let mut t = dev.htod(src, buf).unwrap();
        let (src, buf) = t_wait(&mut t);
        drop(src);
        assert_eq!(buf.as_sim().unwrap().as_slice(), &data[..]);
        let dst = pool.alloc(data.len()).unwrap();
        let DeviceBuffer::Sim(buf) = buf else { unreachable!() };
        let (dst, _buf) = dev.dtoh(buf, dst).unwrap().wait().unwrap();
        assert_eq!(dst.as_slice(), &data[..]);
    }

    fn t_wait(t: &mut Transfer) -> (HostBuffer, DeviceBuffer) {
        while !t.is_complete() {
            std::thread::yield_now();
        }
        std::mem::replace(t, Transfer::from_channel(Direction::Htod, 0, bounded(1).1)).wait().unwrap()
    }

    #[test]
    fn throttle_spaces_copies_by_bytes_over_bandwidth() {
        // 1 GB/s: 8 MiB must take at least 8.4 ms. A lower bound only: a slow machine is never wrong.
        let dev = SimDevice::new(SimDeviceConfig {
            link_gbps: Some(1.0),
            capacity_bytes: 64 << 20,
            latency_us: 0.0,
            ..Default::default()
        })
        .unwrap();
        let pool = pool();
        let src = pool.alloc(8 << 20).unwrap();
        let buf = dev.alloc(8 << 20).unwrap();
        let start = Instant::now();
        dev.htod(src, buf).unwrap().wait().unwrap();
        assert!(start.elapsed() >= Duration::from_secs_f64((8 << 20) as f64 / 1e9));
        let (h, _) = dev.link_stats();
        assert_eq!(h.snapshot().bytes, 8 << 20);
    }

    #[test]
    fn too_small_destination_is_an_invalid_request() {
        let dev = SimDevice::new(SimDeviceConfig::default()).unwrap();
        let src = pool().alloc(100).unwrap();
        let buf = dev.alloc(50).unwrap();
        assert!(matches!(dev.htod(src, buf), Err(Error::InvalidRequest(_))));
    }

    #[test]
    fn bad_config_names_the_key() {
        let e = SimDevice::new(SimDeviceConfig { link_gbps: Some(0.0), ..Default::default() }).err().unwrap();
        assert!(e.to_string().contains("link_gbps"), "{e}");
    }

    fn take_sim(buf: DeviceBuffer) -> SimBuffer {
        match buf {
            DeviceBuffer::Sim(b) => b,
            DeviceBuffer::Cuda(_) => unreachable!("a sim transfer hands back sim buffers"),
        }
    }

    fn hazard(r: Result<impl std::fmt::Debug>) -> OrderingHazard {
        match r {
            Err(Error::Ordering { hazard, .. }) => hazard,
            other => panic!("expected an ordering violation, got {other:?}"),
        }
    }

    /// A buffer filled by a waited H2D, and the device.
    fn filled(len: usize) -> (SimDevice, PinnedPool, SimBuffer) {
        let dev = SimDevice::new(SimDeviceConfig::default()).unwrap();
        let pool = pool();
        let buf = dev.alloc(len).unwrap();
        let (_, buf) = dev.htod(pool.alloc_copy(&vec![1u8; len]).unwrap(), buf).unwrap().wait().unwrap();
        (dev, pool, take_sim(buf))
    }

    #[test]
    fn dtoh_after_must_follow_compute_s_last_write() {
        let (dev, pool, mut buf) = filled(64);
        buf.compute_write().unwrap().fill(7);
        let done = dev.record_compute_event();
        buf.compute_read().unwrap(); // a read after the event is no hazard for a D2H
        let (t, _) = dev.dtoh_after(buf, pool.alloc(64).unwrap(), Some(&done)).unwrap();
        let (host, buf) = t.wait().unwrap();
        assert_eq!(host.as_slice(), &[7u8; 64][..]);
        let mut buf = take_sim(buf);
        // The event comes before the write it should cover.
        let early = dev.record_compute_event();
        buf.compute_write().unwrap().fill(8);
        let e = dev.dtoh_after(buf, pool.alloc(64).unwrap(), Some(&early)).unwrap_err();
        assert_eq!(hazard(Err::<(), _>(e)), OrderingHazard::DtohBeforeComputeWrite);
        let v = dev.ordering_violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].num_bytes, v[0].needed, v[0].ordered), (64, early.compute_pos() + 1, early.compute_pos()));
        assert!(dev.check_ordering().is_err());
    }

    #[test]
    fn htod_after_into_a_reused_buffer_must_follow_its_last_access() {
        let (dev, pool, buf) = filled(64);
        let early = dev.record_compute_event();
        buf.compute_read().unwrap();
        let late = dev.record_compute_event();
        let (t, _) = dev.htod_after(pool.alloc_copy(&[2u8; 64]).unwrap(), buf, Some(&late)).unwrap();
        let buf = take_sim(t.wait().unwrap().1);
        assert_eq!(buf.compute_read().unwrap(), &[2u8; 64][..]);
        let e = dev.htod_after(pool.alloc_copy(&[3u8; 64]).unwrap(), buf, Some(&early)).unwrap_err();
        assert!(e.to_string().contains("htod into a buffer compute used after the `after` event"), "{e}");
        assert!(e.to_string().contains("fix: record the `after` event"), "{e}");
        assert_eq!(hazard(Err::<(), _>(e)), OrderingHazard::HtodOverComputeAccess);
        // The buffer went with the error: it is not reported a second time as a bad free.
        assert_eq!(dev.ordering_violations().len(), 1);
        assert!(dev.alloc(8).is_ok(), "the returned violation is not reported again");
    }

    #[test]
    fn free_after_must_follow_the_last_access_and_none_is_always_safe() {
        let (dev, _pool, buf) = filled(64);
        buf.compute_read().unwrap();
        let done = dev.record_compute_event();
        dev.free_after(buf, Some(&done)).unwrap();

        let (dev, _pool, mut buf) = filled(64);
        buf.compute_write().unwrap();
        dev.free_after(buf, None).unwrap();
        dev.check_ordering().unwrap();

        let (dev, _pool, buf) = filled(64);
        let early = dev.record_compute_event();
        buf.compute_read().unwrap();
        assert_eq!(hazard(dev.free_after(buf, Some(&early))), OrderingHazard::FreeBeforeComputeAccess);
        assert_eq!(dev.allocated_bytes(), 0, "the buffer is freed all the same");
    }

    #[test]
    fn a_drop_after_compute_is_recorded_and_reported_by_the_next_call() {
        let (dev, pool, buf) = filled(48);
        buf.compute_read().unwrap();
        let id = buf.id();
        drop(buf);
        let v = dev.ordering_violations();
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].hazard, v[0].buffer, v[0].num_bytes), (OrderingHazard::DropBeforeComputeAccess, id, 48));
        // Reported once, by the next call that can fail, as cudarc's `record_err`.
        let e = dev.alloc(8).unwrap_err();
        assert!(e.to_string().starts_with("ordering violation: drop (free) of a buffer compute used"), "{e}");
        let b = dev.alloc(8).unwrap();
        let (t, _) = dev.htod_after(pool.alloc(8).unwrap(), b, None).unwrap();
        t.wait().unwrap();
        // The log keeps it for the test's last assertion.
        assert_eq!(hazard(dev.check_ordering()), OrderingHazard::DropBeforeComputeAccess);
    }

    #[test]
    fn a_drop_ordered_by_a_wait_or_a_copy_is_fine() {
        let (dev, _pool, mut buf) = filled(48);
        buf.compute_write().unwrap();
        dev.copy_waits_for_compute();
        drop(buf);

        let (dev2, pool, buf) = filled(48);
        buf.compute_read().unwrap();
        let done = dev2.record_compute_event();
        dev2.copy_waits_for(&done);
        drop(buf);

        // A plain copy orders the copy stream after all compute the buffer saw.
        let (dev3, _, mut buf) = filled(48);
        buf.compute_write().unwrap();
        let (_, buf) = dev3.dtoh(buf, pool.alloc(48).unwrap()).unwrap().wait().unwrap();
        drop(buf);
        for d in [&dev, &dev2, &dev3] {
            d.check_ordering().unwrap();
        }
    }

    #[test]
    fn compute_after_an_early_released_htod_must_wait_for_it() {
        let dev = SimDevice::new(SimDeviceConfig::default()).unwrap();
        let pool = pool();
        let data: Vec<u8> = (0..100u8).collect();
        // Waited for by compute: fine.
        let (t, copied) = dev.htod_after(pool.alloc_copy(&data).unwrap(), dev.alloc(100).unwrap(), None).unwrap();
        let (buf, host) = t.release_device().unwrap();
        dev.compute_waits_for(&copied);
        let buf = take_sim(buf);
        assert_eq!(buf.compute_read().unwrap(), &data[..]);
        drop(host.wait().unwrap());
        dev.free_after(buf, None).unwrap();
        // Waited for by compute for every copy so far: fine.
        let (t, _) = dev.htod_after(pool.alloc_copy(&data).unwrap(), dev.alloc(100).unwrap(), None).unwrap();
        let (buf, _host) = t.release_device().unwrap();
        dev.compute_waits_for_copies();
        let buf = take_sim(buf);
        buf.compute_read().unwrap();
        dev.free_after(buf, None).unwrap();
        // Waited for by neither.
        let (t, _) = dev.htod_after(pool.alloc_copy(&data).unwrap(), dev.alloc(100).unwrap(), None).unwrap();
        let (buf, _host) = t.release_device().unwrap();
        let mut buf = take_sim(buf);
        assert_eq!(hazard(buf.compute_write()), OrderingHazard::ComputeBeforeHtod);
        let e = buf.compute_read().unwrap_err();
        assert!(e.to_string().contains("htod was waited for neither on the host nor by compute"), "{e}");
        // The host waited: fine.
        let (t, _) = dev.htod_after(pool.alloc_copy(&data).unwrap(), dev.alloc(100).unwrap(), None).unwrap();
        let buf = take_sim(t.wait().unwrap().1);
        buf.compute_read().unwrap();
        dev.free_after(buf, None).unwrap();
        // A D2H cannot hand its device buffer out early.
        let (t, _) = dev.dtoh_after(dev.alloc(100).unwrap(), pool.alloc(100).unwrap(), None).unwrap();
        assert!(matches!(t.release_device(), Err(Error::InvalidRequest(_))));
        let v = dev.ordering_violations();
        assert_eq!(v.iter().map(|v| v.hazard).collect::<Vec<_>>(), [OrderingHazard::ComputeBeforeHtod; 2], "{v:?}");
    }

    #[test]
    fn the_plain_copies_are_always_ordered() {
        let (dev, pool, mut buf) = filled(32);
        for round in 0..3u8 {
            buf.compute_write().unwrap().fill(round);
            let (host, b) = dev.dtoh(buf, pool.alloc(32).unwrap()).unwrap().wait().unwrap();
            assert_eq!(host.as_slice(), &[round; 32][..]);
            let b = take_sim(b);
            b.compute_read().unwrap();
            let (_, b) = dev.htod(pool.alloc_copy(&[9; 32]).unwrap(), b).unwrap().wait().unwrap();
            buf = take_sim(b);
        }
        dev.free_after(buf, None).unwrap();
        dev.check_ordering().unwrap();
        assert!(dev.ordering_violations().is_empty());
    }

    #[test]
    fn with_the_checker_off_nothing_is_recorded() {
        let dev = SimDevice::with_ordering_checks(SimDeviceConfig::default(), false).unwrap();
        assert!(!dev.checks_ordering());
        let pool = pool();
        let early = dev.record_compute_event();
        let mut buf = dev.alloc(16).unwrap();
        buf.compute_write().unwrap().fill(1);
        let (t, _) = dev.dtoh_after(buf, pool.alloc(16).unwrap(), Some(&early)).unwrap();
        let buf = take_sim(t.wait().unwrap().1);
        buf.compute_read().unwrap();
        drop(buf);
        assert_eq!(early, SimEvent::default());
        assert!(dev.ordering_violations().is_empty());
        dev.check_ordering().unwrap();
    }
}
