//! Traffic counters: bytes and busy time per link, stall time of callers.
//!
//! Counters are lock-free atomics shared (`Arc`) by whoever moves the bytes: the device's copy
//! engine records H2D/D2H, the NVMe store records reads and writes, the residency manager records
//! the time callers spent waiting (stall). [`Metrics::snapshot`] reads them all at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// The links bytes move over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Link {
    /// Host → device copies.
    Htod,
    /// Device → host copies.
    Dtoh,
    /// NVMe → host reads.
    NvmeRead,
    /// Host → NVMe writes.
    NvmeWrite,
}

impl Link {
    /// All links.
    pub const ALL: [Link; 4] = [Link::Htod, Link::Dtoh, Link::NvmeRead, Link::NvmeWrite];
}

/// Counters of one link. Busy time is the wall time the link had at least one of *this
/// recorder's* operations in flight, as measured by the recorder.
#[derive(Debug, Default)]
pub struct LinkStats {
    bytes: AtomicU64,
    ops: AtomicU64,
    busy_ns: AtomicU64,
}

impl LinkStats {
    /// Records one finished operation of `bytes` that kept the link busy for `busy`.
    pub fn record(&self, bytes: u64, busy: Duration) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.busy_ns.fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts one operation of `bytes` whose busy time is recorded later
    /// ([`LinkStats::record_busy`]), when its completion is seen (a CUDA copy timed by events).
    pub fn record_bytes(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.ops.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `busy` to the link's busy time (of an operation counted by
    /// [`LinkStats::record_bytes`]).
    pub fn record_busy(&self, busy: Duration) {
        self.busy_ns.fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A copy of the counters.
    pub fn snapshot(&self) -> LinkSnapshot {
        LinkSnapshot {
            bytes: self.bytes.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            busy_s: self.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// A point-in-time copy of a link's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LinkSnapshot {
    /// Bytes moved.
    pub bytes: u64,
    /// Operations finished.
    pub ops: u64,
    /// Seconds the link was busy.
    pub busy_s: f64,
}

impl LinkSnapshot {
    /// Average throughput while busy, in GB/s (10⁹ bytes per second); 0 when never busy.
    pub fn busy_gbps(&self) -> f64 {
        if self.busy_s > 0.0 {
            self.bytes as f64 / self.busy_s * 1e-9
        } else {
            0.0
        }
    }
}

/// All counters of a residency manager (or of one component, for the parts it owns).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Host → device.
    pub htod: LinkStats,
    /// Device → host.
    pub dtoh: LinkStats,
    /// NVMe → host.
    pub nvme_read: LinkStats,
    /// Host → NVMe.
    pub nvme_write: LinkStats,
    stall_ns: AtomicU64,
    evictions: AtomicU64,
    prefetch_hits: AtomicU64,
    unpinned_host_bytes: AtomicU64,
}

impl Metrics {
    /// The counters of `link`.
    pub fn link(&self, link: Link) -> &LinkStats {
        match link {
            Link::Htod => &self.htod,
            Link::Dtoh => &self.dtoh,
            Link::NvmeRead => &self.nvme_read,
            Link::NvmeWrite => &self.nvme_write,
        }
    }

    /// Adds `d` to the time callers were blocked waiting for a tensor.
    pub fn add_stall(&self, d: Duration) {
        self.stall_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts one eviction (a copy dropped or written back to make room).
    pub fn add_eviction(&self) {
        self.evictions.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one acquire that found its tensor already resident or arriving from a prefetch.
    pub fn add_prefetch_hit(&self) {
        self.prefetch_hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Sets the bytes of host memory that could not be page-locked (RLIMIT_MEMLOCK fallback).
    pub fn set_unpinned_host_bytes(&self, bytes: u64) {
        self.unpinned_host_bytes.store(bytes, Ordering::Relaxed);
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            htod: self.htod.snapshot(),
            dtoh: self.dtoh.snapshot(),
            nvme_read: self.nvme_read.snapshot(),
            nvme_write: self.nvme_write.snapshot(),
            stall_s: self.stall_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            evictions: self.evictions.load(Ordering::Relaxed),
            prefetch_hits: self.prefetch_hits.load(Ordering::Relaxed),
            unpinned_host_bytes: self.unpinned_host_bytes.load(Ordering::Relaxed),
        }
    }
}

/// A point-in-time copy of [`Metrics`], serializable for metrics files and `--json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    /// Host → device.
    pub htod: LinkSnapshot,
    /// Device → host.
    pub dtoh: LinkSnapshot,
    /// NVMe → host.
    pub nvme_read: LinkSnapshot,
    /// Host → NVMe.
    pub nvme_write: LinkSnapshot,
    /// Seconds callers were blocked in `acquire` waiting for bytes to arrive.
    pub stall_s: f64,
    /// Copies dropped or written back to make room.
    pub evictions: u64,
    /// Acquires served without waiting for a fetch they started themselves.
    pub prefetch_hits: u64,
    /// Host bytes that are not page-locked because `mlock` was refused (RLIMIT_MEMLOCK).
    pub unpinned_host_bytes: u64,
}
