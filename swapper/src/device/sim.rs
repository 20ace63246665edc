//! The sim device: device memory is host memory with an enforced byte capacity; copies run
//! asynchronously on two copy-engine threads (one per direction, as a GPU has separate H2D and
//! D2H engines) with an optional bandwidth and latency throttle that models the PCIe link
//! (foyer's `Throttle` device plays the same part for disks).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Sender};

use super::{CopyResult, DeviceBackend, DeviceBuffer, Direction, Transfer};
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
}

impl Default for SimDeviceConfig {
    fn default() -> Self {
        Self { capacity_bytes: 1 << 30, link_gbps: None, latency_us: 0.0 }
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
/// dropped.
pub struct SimBuffer {
    words: Vec<u64>,
    num_bytes: usize,
    allocated: Arc<AtomicU64>,
}

impl SimBuffer {
    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }

    /// The bytes (sim device memory is host-addressable; compute reads it directly).
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.num_bytes]
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.num_bytes]
    }
}

impl Drop for SimBuffer {
    fn drop(&mut self) {
        self.allocated.fetch_sub(self.num_bytes as u64, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for SimBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBuffer").field("num_bytes", &self.num_bytes).finish()
    }
}

enum Job {
    Copy { host: HostBuffer, dev: SimBuffer, reply: Sender<CopyResult> },
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
                for job in rx {
                    let (mut host, mut dev, reply) = match job {
                        Job::Copy { host, dev, reply } => (host, dev, reply),
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
                    if let Some(gbps) = link_gbps {
                        let busy = latency + Duration::from_secs_f64(bytes as f64 / (gbps * 1e9));
                        link_free = link_free.max(start) + busy;
                        let now = Instant::now();
                        if link_free > now {
                            std::thread::sleep(link_free - now);
                        }
                    } else if !latency.is_zero() {
                        std::thread::sleep(latency);
                    }
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

/// A simulated GPU: host memory with an enforced byte capacity, and two copy-engine threads (H2D,
/// D2H) with an optional bandwidth and latency throttle that models the PCIe link.
pub struct SimDevice {
    config: SimDeviceConfig,
    allocated: Arc<AtomicU64>,
    htod: Engine,
    dtoh: Engine,
    htod_stats: Arc<LinkStats>,
    dtoh_stats: Arc<LinkStats>,
}

impl SimDevice {
    /// A sim device with `config`'s capacity and throttle; starts its two copy-engine threads.
    ///
    /// # Errors
    /// [`Error::Config`] from [`SimDeviceConfig::validate`].
    pub fn new(config: SimDeviceConfig) -> Result<Self> {
        config.validate()?;
        let htod_stats = Arc::new(LinkStats::default());
        let dtoh_stats = Arc::new(LinkStats::default());
        Ok(Self {
            htod: Engine::spawn(Direction::Htod, &config, htod_stats.clone()),
            dtoh: Engine::spawn(Direction::Dtoh, &config, dtoh_stats.clone()),
            allocated: Arc::new(AtomicU64::new(0)),
            config,
            htod_stats,
            dtoh_stats,
        })
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

    fn copy(&self, direction: Direction, host: HostBuffer, dev: SimBuffer) -> Result<Transfer> {
        Self::check_len(&host, &dev)?;
        let bytes = host.len();
        let (reply, rx) = bounded(1);
        let engine = match direction {
            Direction::Htod => &self.htod,
            Direction::Dtoh => &self.dtoh,
        };
        engine.submit(Job::Copy { host, dev, reply })?;
        Ok(Transfer::from_channel(direction, bytes, rx))
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
        Ok(SimBuffer { words: vec![0u64; bytes.div_ceil(8)], num_bytes: bytes, allocated: self.allocated.clone() })
    }

    fn htod(&self, src: HostBuffer, dst: SimBuffer) -> Result<Transfer> {
        self.copy(Direction::Htod, src, dst)
    }

    fn dtoh(&self, src: SimBuffer, dst: HostBuffer) -> Result<Transfer> {
        self.copy(Direction::Dtoh, dst, src)
    }

    fn host_allocator(&self, lock: bool) -> Arc<dyn HostAllocator> {
        Arc::new(MmapAllocator::new(lock))
    }

    fn synchronize(&self) -> Result<()> {
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
        let dev = SimDevice::new(SimDeviceConfig { link_gbps: Some(1.0), capacity_bytes: 64 << 20, latency_us: 0.0 })
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
}
