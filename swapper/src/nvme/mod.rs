//! The NVMe tier (stub: the interface the residency manager is written against; the
//! implementation lands in the same issue).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::host::HostBuffer;
use crate::metrics::LinkStats;
use crate::tier::TensorId;

/// Which I/O engine the store uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    /// io_uring when the kernel allows it, else psync (the reason is logged).
    #[default]
    Auto,
    /// io_uring, or an error.
    Uring,
    /// A pread/pwrite thread pool.
    Psync,
}

/// The engine in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// io_uring.
    Uring,
    /// pread/pwrite threads.
    Psync,
}

/// Configuration of an [`NvmeStore`].
#[derive(Debug, Clone)]
pub struct NvmeConfig {
    /// Directories, one store file each; extents are striped across them.
    pub dirs: Vec<PathBuf>,
    /// Total bytes of the store (split evenly across the directories).
    pub capacity_bytes: u64,
    /// Bytes per I/O request. Default 1 MiB.
    pub block_bytes: usize,
    /// Requests in flight per engine. Default 32.
    pub queue_depth: u32,
    /// Engine choice. Default auto.
    pub engine: EngineChoice,
    /// Open the files with O_DIRECT. Default true.
    pub direct_io: bool,
}

/// Where a tensor's bytes are on the store, with their checksums.
#[derive(Debug)]
pub struct Extent {
    tensor: TensorId,
    len: u64,
}

impl Extent {
    /// The tensor stored.
    pub fn tensor(&self) -> TensorId {
        self.tensor
    }
    /// Bytes stored.
    pub fn num_bytes(&self) -> u64 {
        self.len
    }
}

/// An I/O in flight; owns its buffer until it completes.
pub struct IoHandle<T> {
    _t: std::marker::PhantomData<T>,
}

impl<T> IoHandle<T> {
    /// Blocks until done; hands back the buffer.
    pub fn wait(self) -> (Result<T>, HostBuffer) {
        todo!()
    }
    /// Whether done.
    pub fn is_complete(&self) -> bool {
        todo!()
    }
}

/// The NVMe store.
pub struct NvmeStore {}

impl NvmeStore {
    /// Opens the store.
    pub fn open(_config: NvmeConfig) -> Result<Self> {
        todo!()
    }
    /// Engine in use.
    pub fn engine_kind(&self) -> EngineKind {
        todo!()
    }
    /// Capacity.
    pub fn capacity_bytes(&self) -> u64 {
        todo!()
    }
    /// Bytes in live extents.
    pub fn used_bytes(&self) -> u64 {
        todo!()
    }
    /// Writes `buf.as_slice()` to a new extent.
    pub fn write(&self, _tensor: TensorId, _buf: HostBuffer) -> IoHandle<Extent> {
        todo!()
    }
    /// Reads `extent` into `buf` (capacity >= extent bytes; len set to the extent's bytes).
    pub fn read(&self, _extent: &Extent, _buf: HostBuffer) -> IoHandle<()> {
        todo!()
    }
    /// Frees an extent.
    pub fn free(&self, _extent: Extent) {
        todo!()
    }
    /// (read, write) counters.
    pub fn link_stats(&self) -> (&LinkStats, &LinkStats) {
        todo!()
    }
}
