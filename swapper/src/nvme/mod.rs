//! The NVMe tier: tensors stored as checksummed extents in preallocated files, moved by io_uring
//! or by a pread/pwrite thread pool.
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | store | [`NvmeStore`] | one preallocated file per directory; extents striped across the files |
//! | config | [`NvmeConfig`] | directories, capacity (bytes), block size (bytes), queue depth, engine, O_DIRECT |
//! | extent | [`Extent`] | where a tensor's bytes are: one block-striped region per file, a crc32c per block |
//! | block | [`BlockLocation`] | `block_bytes` of a tensor: one I/O request and one checksum |
//! | allocator | [`alloc::ExtentAllocator`] | best-fit free map of one file, 4 KiB granules, coalescing |
//! | engine | [`EngineChoice`], [`EngineKind`] | io_uring (one ring thread, `queue_depth` requests in flight) or pread/pwrite threads |
//! | handle | [`IoHandle`] | an I/O in flight; owns the buffer until done, then hands it back (tokio-uring's `BufResult`) |
//!
//! **Layout.** A tensor of `n` bytes is padded to 4 KiB (O_DIRECT) and cut into blocks of
//! `block_bytes`; block `i` goes to file `(first + i) % files` (RAID-0 striping, `first` rotates per
//! write), and the blocks of one file sit in one contiguous region of it. Each block is one I/O
//! request (a 1 MiB block from a 2 MiB huge-page buffer reaches the disk whole; see
//! `../shared/peers/README.md`) and carries a crc32c of its real bytes, computed when the write is
//! waited for and verified on every read.
//!
//! **Failures.** A directory that is missing, not a directory, read-only or too small fails
//! [`NvmeStore::open`] with [`Error::NvmeDir`] before anything is written; so does a failed
//! preallocation. Space is preallocated (`fallocate`), so a full disk shows at open, not in the
//! middle of training. A write that fails later (EIO, EFBIG) returns [`Error::Io`] and frees its
//! new extent; extents stored before are untouched. Checksum mismatches return [`Error::Corrupt`].
//!
//! **Engines.** [`EngineChoice::Auto`] probes io_uring (a ring and a NOP) and falls back to
//! pread/pwrite with the reason logged; `OOGC_DISABLE_URING=1` forces the fallback (for tests and
//! for kernels where io_uring misbehaves). The engine seam is foyer's `IoEngine`.

pub mod alloc;
mod engine;
pub mod fault;
mod uring;

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use self::alloc::{ExtentAllocator, GRANULE_BYTES};
use self::engine::{Completion, IoEngine, IoRequest, Op, PsyncEngine, Segment, StoreFile};
use crate::error::{Error, Result};
use crate::host::HostBuffer;
use crate::metrics::LinkStats;
use crate::tier::{TensorId, Tier};

/// Environment variable that, set to `1`, makes [`EngineChoice::Auto`] skip io_uring (and
/// [`EngineChoice::Uring`] fail with [`Error::UringUnavailable`]).
pub const DISABLE_URING_ENV: &str = "OOGC_DISABLE_URING";

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

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineKind::Uring => "uring",
            EngineKind::Psync => "psync",
        })
    }
}

fn default_block_bytes() -> usize {
    NvmeConfig::DEFAULT_BLOCK_BYTES
}
fn default_queue_depth() -> u32 {
    NvmeConfig::DEFAULT_QUEUE_DEPTH
}
fn default_true() -> bool {
    true
}

/// Configuration of an [`NvmeStore`] (config key prefix `nvme.`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmeConfig {
    /// Directories, one store file each; extents are striped across them. At least one.
    pub dirs: Vec<PathBuf>,
    /// Total bytes of the store, split evenly across the directories (each share rounded up to
    /// 4 KiB) and preallocated at open. More than 0.
    pub capacity_bytes: u64,
    /// Bytes per I/O request and per checksum. Default: 1 MiB. A multiple of 4 KiB, at most 64 MiB.
    #[serde(default = "default_block_bytes")]
    pub block_bytes: usize,
    /// Requests in flight per engine (io_uring SQEs; psync merges up to this many blocks per
    /// call). Default: 32. From 1 to 4096.
    #[serde(default = "default_queue_depth")]
    pub queue_depth: u32,
    /// Engine choice. Default: auto.
    #[serde(default)]
    pub engine: EngineChoice,
    /// Open the files with O_DIRECT (bypass the page cache). Default: true. Falls back to
    /// buffered I/O with a warning where the filesystem refuses O_DIRECT (tmpfs).
    #[serde(default = "default_true")]
    pub direct_io: bool,
}

impl NvmeConfig {
    /// Default [`NvmeConfig::block_bytes`]: 1 MiB.
    pub const DEFAULT_BLOCK_BYTES: usize = 1 << 20;
    /// Default [`NvmeConfig::queue_depth`]: 32.
    pub const DEFAULT_QUEUE_DEPTH: u32 = 32;

    /// A config over `dirs` of `capacity_bytes` in total, with 1 MiB blocks, queue depth 32,
    /// [`EngineChoice::Auto`] and O_DIRECT.
    pub fn new(dirs: Vec<PathBuf>, capacity_bytes: u64) -> Self {
        Self {
            dirs,
            capacity_bytes,
            block_bytes: Self::DEFAULT_BLOCK_BYTES,
            queue_depth: Self::DEFAULT_QUEUE_DEPTH,
            engine: EngineChoice::Auto,
            direct_io: true,
        }
    }

    /// Checks every value's range.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key (`nvme.dirs`, `nvme.capacity_bytes`, `nvme.block_bytes`,
    /// `nvme.queue_depth`) and the accepted range.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| Err(Error::Config { key: key.into(), reason });
        if self.dirs.is_empty() {
            return bad("nvme.dirs", "no directory given; list at least one directory on a fast disk".into());
        }
        if self.capacity_bytes == 0 {
            return bad("nvme.capacity_bytes", "must be more than 0 bytes".into());
        }
        let b = self.block_bytes;
        if b == 0 || b % GRANULE_BYTES as usize != 0 || b > 64 << 20 {
            return bad("nvme.block_bytes", format!("{b} is not a multiple of 4096 between 4096 and 67108864 bytes"));
        }
        if !(1..=4096).contains(&self.queue_depth) {
            return bad("nvme.queue_depth", format!("{} is not between 1 and 4096", self.queue_depth));
        }
        Ok(())
    }

    /// Bytes preallocated in each directory: the capacity split evenly, rounded up to 4 KiB.
    pub fn bytes_per_dir(&self) -> u64 {
        let n = self.dirs.len().max(1) as u64;
        self.capacity_bytes.div_ceil(n).next_multiple_of(GRANULE_BYTES)
    }
}

/// Where one block of an extent is: file index (see [`NvmeStore::file_paths`]), byte offset in
/// that file, and the bytes transferred (a multiple of 4 KiB; the last block's real bytes may be
/// fewer, see [`Extent::num_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLocation {
    /// Index of the store file.
    pub file: usize,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes of the I/O request (padded to 4 KiB).
    pub len: u64,
}

/// A contiguous allocated range of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    file: usize,
    offset: u64,
    len: u64,
}

/// Where a tensor's bytes are on the store, with their checksums.
///
/// Not `Clone`: give it back with [`NvmeStore::free`] exactly once; an extent dropped without
/// `free` keeps its space until the store drops.
#[derive(Debug)]
pub struct Extent {
    tensor: TensorId,
    len: u64,
    store_id: u64,
    regions: Vec<Region>,
    blocks: Arc<[BlockLocation]>,
    crcs: Arc<[u32]>,
}

impl Extent {
    /// The tensor stored.
    pub fn tensor(&self) -> TensorId {
        self.tensor
    }
    /// Bytes stored (the tensor's real length, not padded).
    pub fn num_bytes(&self) -> u64 {
        self.len
    }
    /// Bytes the extent occupies on the store (padded to 4 KiB).
    pub fn allocated_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.len).sum()
    }
    /// The blocks, in tensor order: block `i` holds bytes `[i × block_bytes, (i+1) × block_bytes)`.
    pub fn blocks(&self) -> &[BlockLocation] {
        &self.blocks
    }
    /// The crc32c of each block's real bytes, in block order.
    pub fn checksums(&self) -> &[u32] {
        &self.crcs
    }
}

/// What the engine's callback sends to a handle: the completion and, for a write, the space.
struct Msg {
    completion: Completion,
    reservation: Option<Reservation>,
}

type Finish<T> = Box<dyn FnOnce(Msg) -> (Result<T>, HostBuffer) + Send + Sync>;

enum HandleState<T> {
    Ready(Option<(Result<T>, HostBuffer)>),
    Pending { rx: Receiver<Msg>, finish: Finish<T> },
}

/// An I/O in flight; owns its buffer until it completes (tokio-uring's `BufResult` shape).
///
/// Dropping a handle does not cancel the I/O: the engine keeps the buffer until the kernel is
/// done with it, then returns it to its pool; a dropped write's new extent is freed.
pub struct IoHandle<T> {
    state: HandleState<T>,
}

impl<T> IoHandle<T> {
    fn ready(result: Result<T>, buf: HostBuffer) -> Self {
        Self { state: HandleState::Ready(Some((result, buf))) }
    }

    /// Blocks until done; hands back the buffer with the result. For a write the checksums are
    /// computed here, for a read they are verified here (on the waiting thread).
    ///
    /// # Errors
    /// In the result: [`Error::Io`], [`Error::Corrupt`], [`Error::OutOfMemory`] on
    /// [`Tier::Nvme`], [`Error::InvalidRequest`].
    ///
    /// # Panics
    /// If the engine thread died (a bug: it panicked); its buffers are leaked, not freed, because
    /// the kernel may still write into them.
    pub fn wait(self) -> (Result<T>, HostBuffer) {
        match self.state {
            HandleState::Ready(mut r) => r.take().expect("ready handle holds its result"),
            HandleState::Pending { rx, finish } => match rx.recv() {
                Ok(msg) => finish(msg),
                Err(_) => panic!("the NVMe I/O engine thread died with this request in flight"),
            },
        }
    }

    /// Whether done (a later [`IoHandle::wait`] only does the checksum work).
    pub fn is_complete(&self) -> bool {
        match &self.state {
            HandleState::Ready(_) => true,
            HandleState::Pending { rx, .. } => !rx.is_empty(),
        }
    }
}

impl<T> std::fmt::Debug for IoHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoHandle").field("complete", &self.is_complete()).finish()
    }
}

struct Inner {
    id: u64,
    files: Arc<[StoreFile]>,
    alloc: Mutex<Vec<ExtentAllocator>>,
    used_bytes: AtomicU64,
    capacity_bytes: u64,
    block_bytes: usize,
    next_stripe: AtomicUsize,
    read_stats: LinkStats,
    write_stats: LinkStats,
}

impl Inner {
    fn free_regions(&self, regions: &[Region]) {
        let mut alloc = self.alloc.lock();
        for r in regions {
            if let Err(e) = alloc[r.file].free(r.offset, r.len) {
                tracing::error!(error = %e, file = r.file, "NVMe extent free refused");
                continue;
            }
            self.used_bytes.fetch_sub(r.len, Ordering::Relaxed);
        }
    }

    /// Allocates the regions of a `len`-byte tensor and lays its blocks out across them.
    fn plan(self: &Arc<Self>, len: u64) -> Result<(Reservation, Vec<BlockLocation>)> {
        let padded = len.next_multiple_of(GRANULE_BYTES);
        let b = self.block_bytes as u64;
        let n = self.files.len();
        let nblocks = padded.div_ceil(b) as usize;
        let first = self.next_stripe.fetch_add(1, Ordering::Relaxed) % n;
        let block_len = |i: usize| b.min(padded - i as u64 * b);
        let mut per_file = vec![0u64; n];
        for i in 0..nblocks {
            per_file[(first + i) % n] += block_len(i);
        }
        let mut regions = Vec::new();
        {
            let mut alloc = self.alloc.lock();
            for (file, &bytes) in per_file.iter().enumerate().filter(|(_, &b)| b > 0) {
                match alloc[file].alloc(bytes) {
                    Ok(offset) => regions.push(Region { file, offset, len: bytes }),
                    Err(_) => {
                        for r in &regions {
                            alloc[r.file].free(r.offset, r.len).expect("just allocated");
                        }
                        let available_bytes = alloc.iter().map(ExtentAllocator::free_bytes).sum();
                        return Err(Error::OutOfMemory { tier: Tier::Nvme, requested_bytes: padded, available_bytes });
                    }
                }
            }
        }
        self.used_bytes.fetch_add(padded, Ordering::Relaxed);
        let start_of = |file: usize| regions.iter().find(|r| r.file == file).expect("region per used file").offset;
        let blocks = (0..nblocks)
            .map(|i| {
                let file = (first + i) % n;
                BlockLocation { file, offset: start_of(file) + (i / n) as u64 * b, len: block_len(i) }
            })
            .collect();
        Ok((Reservation { inner: self.clone(), regions }, blocks))
    }

    fn segments(&self, blocks: &[BlockLocation]) -> Vec<Segment> {
        blocks
            .iter()
            .enumerate()
            .map(|(i, bl)| Segment {
                file: bl.file,
                file_offset: bl.offset,
                buf_offset: i * self.block_bytes,
                len: bl.len as usize,
            })
            .collect()
    }

    /// crc32c of each block's real bytes of `data`.
    fn checksums(&self, data: &[u8]) -> Vec<u32> {
        data.chunks(self.block_bytes).map(block_checksum).collect()
    }
}

/// Space allocated for a write in flight; freed on drop unless turned into an [`Extent`]. It
/// travels with the completion, so the space is only freed once the kernel is done writing it.
struct Reservation {
    inner: Arc<Inner>,
    regions: Vec<Region>,
}

impl Reservation {
    fn into_regions(mut self) -> Vec<Region> {
        std::mem::take(&mut self.regions)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.regions.is_empty() {
            self.inner.free_regions(&self.regions);
        }
    }
}

/// The checksum of one block's bytes: crc32c (Castagnoli; SSE4.2/ARMv8 CRC instructions when
/// the CPU has them, detected at run time by the `crc32c` crate).
pub fn block_checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

/// The NVMe store: extents of tensors in preallocated files, read and written asynchronously.
///
/// `Send + Sync`: share it with `Arc`. Dropping it waits for the I/O in flight, then removes its
/// files (a handle still holding a finished write keeps its file's inode until it drops).
pub struct NvmeStore {
    inner: Arc<Inner>,
    engine: Option<Box<dyn IoEngine>>,
    config: NvmeConfig,
}

impl std::fmt::Debug for NvmeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeStore")
            .field("engine", &self.engine_kind())
            .field("files", &self.file_paths().collect::<Vec<_>>())
            .field("capacity_bytes", &self.capacity_bytes())
            .field("used_bytes", &self.used_bytes())
            .finish()
    }
}

/// Bytes available to this process on the file system of `dir` (statvfs: `f_bavail × f_frsize`).
///
/// # Errors
/// statvfs failed (the directory does not exist, ...).
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let vfs = rustix::fs::statvfs(dir).map_err(io::Error::from)?;
    Ok(vfs.f_bavail.saturating_mul(vfs.f_frsize))
}

/// Checks one directory before anything is written there.
fn check_dir(dir: &Path, needed_bytes: u64) -> Result<()> {
    let fail = |reason: String| Err(Error::NvmeDir { path: dir.to_path_buf(), needed_bytes, reason });
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return fail("does not exist; create it (`mkdir -p`) or list an existing directory in nvme.dirs".into())
        }
        Err(e) => return fail(format!("cannot be inspected ({e}); fix its permissions or choose another directory")),
        Ok(m) if !m.is_dir() => return fail("is not a directory; list a directory in nvme.dirs".into()),
        Ok(_) => {}
    }
    let vfs = match rustix::fs::statvfs(dir) {
        Ok(v) => v,
        Err(e) => return fail(format!("statvfs failed ({e}); choose another directory")),
    };
    if vfs.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY) {
        return fail("is on a read-only filesystem; remount it read-write or choose another directory".into());
    }
    if let Err(e) = rustix::fs::access(dir, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK) {
        return fail(format!(
            "is not writable by this process ({e}); `chmod u+w` / `chown` it or choose another directory"
        ));
    }
    let free = vfs.f_bavail.saturating_mul(vfs.f_frsize);
    if free < needed_bytes {
        return fail(format!(
            "has only {free} bytes free; free space there, lower nvme.capacity_bytes, or add directories"
        ));
    }
    Ok(())
}

/// Creates and preallocates one store file.
fn create_file(dir: &Path, name: &str, bytes: u64, direct: bool) -> Result<StoreFile> {
    let path = dir.join(name);
    let fail = |reason: String| Error::NvmeDir { path: dir.to_path_buf(), needed_bytes: bytes, reason };
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create_new(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&path)
    };
    let (file, direct) = match open(direct) {
        Ok(f) => (f, direct),
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(
                path = %path.display(),
                "the filesystem refuses O_DIRECT; using buffered I/O (slower, goes through the page cache)"
            );
            let _ = std::fs::remove_file(&path);
            (open(false).map_err(|e| fail(format!("cannot create {} ({e})", path.display())))?, false)
        }
        Err(e) => return Err(fail(format!("cannot create {} ({e}); check permissions", path.display()))),
    };
    // From here on the file is removed on every path out (StoreFile::drop).
    let sf = StoreFile { path, file, direct };
    match rustix::fs::fallocate(&sf.file, rustix::fs::FallocateFlags::empty(), 0, bytes) {
        Ok(()) => {}
        Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
            tracing::warn!(path = %sf.path.display(), "fallocate unsupported; the store file is sparse");
            sf.file.set_len(bytes).map_err(|e| fail(format!("cannot size the store file ({e})")))?;
        }
        Err(e) => {
            return Err(fail(format!(
                "preallocating {bytes} bytes failed ({e}); free space there, lower nvme.capacity_bytes, \
                 or raise the file size limit (`ulimit -f`)"
            )))
        }
    }
    Ok(sf)
}

/// The prefix of the store files [`NvmeStore::open`] creates for process `pid` in a directory:
/// `oogc-nvme-<pid>-`.
pub fn store_file_prefix(pid: u32) -> String {
    format!("oogc-nvme-{pid}-")
}

/// Removes the store files a process `pid` left in `dir` (it was killed: a store removes its
/// files when dropped). Call it only for a process known to be gone (a run directory's stale
/// lock). Returns the files removed and their bytes.
///
/// # Errors
/// The I/O error of reading the directory or removing a file.
pub fn remove_stale_store_files(dir: &Path, pid: u32) -> io::Result<(usize, u64)> {
    let prefix = store_file_prefix(pid);
    let (mut files, mut bytes) = (0, 0);
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with(&prefix) && name.ends_with(".swap") {
            let len = entry.metadata().map_or(0, |m| m.len());
            std::fs::remove_file(entry.path())?;
            files += 1;
            bytes += len;
        }
    }
    Ok((files, bytes))
}

/// Decides the engine; `disabled` is why io_uring must not be used, if it must not.
fn choose_engine(choice: EngineChoice, disabled: Option<String>) -> Result<EngineKind> {
    let uring = || disabled.clone().map_or_else(uring::probe, Err);
    match choice {
        EngineChoice::Psync => Ok(EngineKind::Psync),
        EngineChoice::Uring => uring().map(|()| EngineKind::Uring).map_err(|reason| Error::UringUnavailable { reason }),
        EngineChoice::Auto => match uring() {
            Ok(()) => Ok(EngineKind::Uring),
            Err(reason) => {
                tracing::warn!(%reason, "io_uring unavailable; using the pread/pwrite engine");
                Ok(EngineKind::Psync)
            }
        },
    }
}

impl NvmeStore {
    /// Opens a new, empty store: checks every directory, then creates and preallocates one file
    /// per directory (named `oogc-nvme-<pid>-<n>-<i>.swap`, so several stores can share one).
    ///
    /// # Errors
    /// [`Error::Config`] from [`NvmeConfig::validate`]; [`Error::NvmeDir`] for a directory that is
    /// missing, not a directory, read-only, short of free space, or where preallocation fails;
    /// [`Error::UringUnavailable`] when [`EngineChoice::Uring`] is refused. Nothing is left on
    /// disk after an error.
    ///
    /// The test hook `OOGC_FAULT_NVME` ([`fault::FAULT_ENV`]) makes chosen requests fail (see
    /// [`NvmeStore::open_with_faults`]); a malformed value is [`Error::Config`].
    pub fn open(config: NvmeConfig) -> Result<Self> {
        let disabled =
            std::env::var_os(DISABLE_URING_ENV).filter(|v| v == "1").map(|_| format!("{DISABLE_URING_ENV}=1 is set"));
        Self::open_inner(config, disabled, fault::FaultPlan::from_env()?)
    }

    /// [`NvmeStore::open`] with fault injection (a test hook): requests chosen by `plan` fail with
    /// an injected `io::Error` naming the store file and offset (as a failing disk's would), or
    /// abort the process half-way (module [`fault`]).
    ///
    /// # Errors
    /// As [`NvmeStore::open`].
    pub fn open_with_faults(config: NvmeConfig, plan: fault::FaultPlan) -> Result<Self> {
        let disabled =
            std::env::var_os(DISABLE_URING_ENV).filter(|v| v == "1").map(|_| format!("{DISABLE_URING_ENV}=1 is set"));
        Self::open_inner(config, disabled, Some(plan))
    }

    #[cfg(test)]
    fn open_with(config: NvmeConfig, uring_disabled: Option<String>) -> Result<Self> {
        Self::open_inner(config, uring_disabled, None)
    }

    fn open_inner(
        config: NvmeConfig,
        uring_disabled: Option<String>,
        faults: Option<fault::FaultPlan>,
    ) -> Result<Self> {
        config.validate()?;
        let per_dir = config.bytes_per_dir();
        for dir in &config.dirs {
            check_dir(dir, per_dir)?;
        }
        let mut kind = choose_engine(config.engine, uring_disabled)?;
        let id = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let files: Vec<StoreFile> = config
            .dirs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                create_file(d, &format!("{}{id}-{i}.swap", store_file_prefix(pid)), per_dir, config.direct_io)
            })
            .collect::<Result<_>>()?;
        let files: Arc<[StoreFile]> = files.into();
        let psync = |files: Arc<[StoreFile]>| -> Result<Box<dyn IoEngine>> {
            let threads = (config.queue_depth as usize / 8).clamp(2, 8);
            let max_call = config.block_bytes * config.queue_depth as usize;
            Ok(Box::new(PsyncEngine::new(files, threads, max_call)?))
        };
        let engine: Box<dyn IoEngine> = match kind {
            EngineKind::Psync => psync(files.clone())?,
            EngineKind::Uring => match uring::UringEngine::new(files.clone(), config.queue_depth) {
                Ok(e) => Box::new(e),
                Err(e) if config.engine == EngineChoice::Auto => {
                    tracing::warn!(reason = %e, "io_uring ring refused; using the pread/pwrite engine");
                    kind = EngineKind::Psync;
                    psync(files.clone())?
                }
                Err(e) => return Err(e),
            },
        };
        debug_assert_eq!(engine.kind(), kind);
        let engine: Box<dyn IoEngine> = match faults {
            Some(plan) => Box::new(fault::FaultyEngine::new(engine, files.clone(), plan)),
            None => engine,
        };
        let inner = Arc::new(Inner {
            id,
            alloc: Mutex::new(files.iter().map(|_| ExtentAllocator::new(per_dir)).collect()),
            files,
            used_bytes: AtomicU64::new(0),
            capacity_bytes: per_dir * config.dirs.len() as u64,
            block_bytes: config.block_bytes,
            next_stripe: AtomicUsize::new(0),
            read_stats: LinkStats::default(),
            write_stats: LinkStats::default(),
        });
        tracing::info!(engine = %kind, capacity_bytes = inner.capacity_bytes, files = config.dirs.len(), "NVMe store open");
        Ok(Self { inner, engine: Some(engine), config })
    }

    fn engine(&self) -> &dyn IoEngine {
        self.engine.as_deref().expect("engine present until drop")
    }

    /// Engine in use.
    pub fn engine_kind(&self) -> EngineKind {
        self.engine().kind()
    }

    /// The config the store was opened with.
    pub fn config(&self) -> &NvmeConfig {
        &self.config
    }

    /// Capacity in bytes (the preallocated bytes of all files).
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    /// Bytes in live extents (padded to 4 KiB), including writes in flight.
    pub fn used_bytes(&self) -> u64 {
        self.inner.used_bytes.load(Ordering::Relaxed)
    }

    /// Bytes not in extents (possibly fragmented).
    pub fn available_bytes(&self) -> u64 {
        self.capacity_bytes() - self.used_bytes()
    }

    /// The store files, by file index (see [`BlockLocation::file`]).
    pub fn file_paths(&self) -> impl Iterator<Item = &Path> {
        self.inner.files.iter().map(|f| f.path.as_path())
    }

    /// Whether each file is opened with O_DIRECT (false where the filesystem refused it).
    pub fn direct_io(&self) -> Vec<bool> {
        self.inner.files.iter().map(|f| f.direct).collect()
    }

    /// Writes `buf.as_slice()` to a new extent; returns at once.
    ///
    /// The buffer is transferred as `buf.as_padded_slice()` (4 KiB multiple); the extent records
    /// the real length. The handle gives the buffer back with the extent.
    ///
    /// # Errors
    /// In the handle: [`Error::OutOfMemory`] on [`Tier::Nvme`] when no space is left (nothing was
    /// written); [`Error::Io`] naming the file, offset and bytes of the failed piece, with the new
    /// extent freed and every other extent intact.
    pub fn write(&self, tensor: TensorId, buf: HostBuffer) -> IoHandle<Extent> {
        let len = buf.len() as u64;
        let span = tracing::info_span!("swapper::nvme_write", bytes = len, tensor = tensor.0);
        if len == 0 {
            let (regions, blocks, crcs) = (Vec::new(), Arc::from([]), Arc::from([]));
            return IoHandle::ready(Ok(Extent { tensor, len, store_id: self.inner.id, regions, blocks, crcs }), buf);
        }
        let (reservation, blocks) = match self.inner.plan(len) {
            Ok(p) => p,
            Err(e) => return IoHandle::ready(Err(e), buf),
        };
        let segments = self.inner.segments(&blocks);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let inner = self.inner.clone();
        let start = Instant::now();
        let done = Box::new(move |completion: Completion| {
            let _g = span.enter();
            if completion.result.is_ok() {
                inner.write_stats.record(len, start.elapsed());
            }
            // A dropped handle drops the message, and with it the reservation: space freed.
            let _ = tx.send(Msg { completion, reservation: Some(reservation) });
        });
        self.engine().submit(IoRequest { op: Op::Write, buf, segments, done });
        let inner = self.inner.clone();
        let blocks: Arc<[BlockLocation]> = blocks.into();
        let finish: Finish<Extent> = Box::new(move |msg: Msg| {
            let Msg { completion: Completion { result, buf }, reservation } = msg;
            let reservation = reservation.expect("write message carries its reservation");
            match result {
                Ok(()) => {
                    let crcs = inner.checksums(buf.as_slice()).into();
                    let regions = reservation.into_regions();
                    (Ok(Extent { tensor, len, store_id: inner.id, regions, blocks, crcs }), buf)
                }
                Err(e) => {
                    drop(reservation);
                    (Err(e), buf)
                }
            }
        });
        IoHandle { state: HandleState::Pending { rx, finish } }
    }

    /// Reads `extent` into `buf`; returns at once. `buf.len()` is set to the extent's bytes.
    ///
    /// Do not [`NvmeStore::free`] the extent while a read of it is in flight.
    ///
    /// # Errors
    /// In the handle: [`Error::InvalidRequest`] when `buf.capacity()` is below the extent's bytes
    /// or the extent is from another store; [`Error::Io`] naming the file, offset and bytes;
    /// [`Error::Corrupt`] naming the tensor and the file offset of the first bad block.
    pub fn read(&self, extent: &Extent, mut buf: HostBuffer) -> IoHandle<()> {
        let len = extent.len;
        let span = tracing::info_span!("swapper::nvme_read", bytes = len, tensor = extent.tensor.0);
        if extent.store_id != self.inner.id {
            return IoHandle::ready(Err(Error::InvalidRequest("extent belongs to another NVMe store".into())), buf);
        }
        if (buf.capacity() as u64) < len {
            let msg = format!("read of {len} bytes into a buffer of {} bytes", buf.capacity());
            return IoHandle::ready(Err(Error::InvalidRequest(msg)), buf);
        }
        buf.set_len(len as usize);
        let segments = self.inner.segments(&extent.blocks);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let inner = self.inner.clone();
        let start = Instant::now();
        let done = Box::new(move |completion: Completion| {
            let _g = span.enter();
            if completion.result.is_ok() {
                inner.read_stats.record(len, start.elapsed());
            }
            let _ = tx.send(Msg { completion, reservation: None });
        });
        self.engine().submit(IoRequest { op: Op::Read, buf, segments, done });
        let inner = self.inner.clone();
        let (tensor, blocks, crcs) = (extent.tensor, extent.blocks.clone(), extent.crcs.clone());
        let finish: Finish<()> = Box::new(move |msg: Msg| {
            let Completion { result, buf } = msg.completion;
            if let Err(e) = result {
                return (Err(e), buf);
            }
            let actual = inner.checksums(buf.as_slice());
            for ((&expected, actual), bl) in crcs.iter().zip(actual).zip(blocks.iter()) {
                if expected != actual {
                    let path = inner.files[bl.file].path.clone();
                    return (Err(Error::Corrupt { tensor, path, offset: bl.offset, expected, actual }), buf);
                }
            }
            (Ok(()), buf)
        });
        IoHandle { state: HandleState::Pending { rx, finish } }
    }

    /// Frees an extent (its space may be reused at once: no read of it may be in flight).
    /// An extent of another store is refused with an error in the log.
    pub fn free(&self, extent: Extent) {
        if extent.store_id != self.inner.id {
            tracing::error!(tensor = %extent.tensor, "free of an extent from another NVMe store ignored");
            return;
        }
        self.inner.free_regions(&extent.regions);
    }

    /// (read, write) counters: bytes and busy time (submission to completion) per request.
    pub fn link_stats(&self) -> (&LinkStats, &LinkStats) {
        (&self.inner.read_stats, &self.inner.write_stats)
    }
}

impl Drop for NvmeStore {
    fn drop(&mut self) {
        // Joins the engine thread(s): every request in flight completes first. The files are
        // removed when their last owner drops (StoreFile::drop).
        self.engine.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{PinnedPool, PinnedPoolConfig};

    fn pool() -> PinnedPool {
        PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 256 << 20, lock: false })
    }

    #[test]
    fn store_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<NvmeStore>();
        check::<IoHandle<Extent>>();
    }

    #[test]
    fn validate_names_the_key() {
        let mut c = NvmeConfig::new(vec![std::env::temp_dir()], 1 << 20);
        c.validate().unwrap();
        c.block_bytes = 1000;
        assert!(matches!(c.validate(), Err(Error::Config { key, .. }) if key == "nvme.block_bytes"));
        c.block_bytes = 4096;
        c.queue_depth = 0;
        assert!(matches!(c.validate(), Err(Error::Config { key, .. }) if key == "nvme.queue_depth"));
        let c = NvmeConfig::new(vec![], 1 << 20);
        assert!(matches!(c.validate(), Err(Error::Config { key, .. }) if key == "nvme.dirs"));
    }

    #[test]
    fn auto_falls_back_to_psync_when_uring_is_disabled() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = NvmeConfig::new(vec![dir.path().into()], 8 << 20);
        let store = NvmeStore::open_with(cfg.clone(), Some("disabled by the test".into())).unwrap();
        assert_eq!(store.engine_kind(), EngineKind::Psync);
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let (r, buf) = store.write(TensorId(1), pool().alloc_copy(&data).unwrap()).wait();
        let ext = r.unwrap();
        let (r, buf) = store.read(&ext, buf).wait();
        r.unwrap();
        assert_eq!(buf.as_slice(), &data[..]);
        let uring = NvmeConfig { engine: EngineChoice::Uring, ..cfg };
        match NvmeStore::open_with(uring, Some("disabled by the test".into())) {
            Err(Error::UringUnavailable { reason }) => assert!(reason.contains("disabled by the test")),
            other => panic!("expected UringUnavailable, got {other:?}"),
        }
    }

    #[test]
    fn striping_alternates_files_and_a_full_store_reports_out_of_memory() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let mut cfg = NvmeConfig::new(vec![a.path().into(), b.path().into()], 8 << 20);
        cfg.block_bytes = 1 << 20;
        let store = NvmeStore::open(cfg).unwrap();
        assert_eq!(store.capacity_bytes(), 8 << 20);
        let p = pool();
        let (r, _buf) = store.write(TensorId(1), p.alloc((3 << 20) + 5).unwrap()).wait();
        let ext = r.unwrap();
        let files: Vec<usize> = ext.blocks().iter().map(|b| b.file).collect();
        assert_eq!(files, [0, 1, 0, 1]);
        assert_eq!(ext.blocks()[2].offset, ext.blocks()[0].offset + (1 << 20));
        assert_eq!(store.used_bytes(), (3 << 20) + 4096);
        let (r, _buf) = store.write(TensorId(2), p.alloc(6 << 20).unwrap()).wait();
        assert!(
            matches!(r, Err(Error::OutOfMemory { tier: Tier::Nvme, requested_bytes, .. }) if requested_bytes == 6 << 20)
        );
        assert_eq!(store.used_bytes(), (3 << 20) + 4096, "a refused write holds no space");
        store.free(ext);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn a_dropped_write_handle_frees_its_space_after_completion() {
        let dir = tempfile::tempdir().unwrap();
        let store = NvmeStore::open(NvmeConfig::new(vec![dir.path().into()], 16 << 20)).unwrap();
        drop(store.write(TensorId(3), pool().alloc(4 << 20).unwrap()));
        let paths: Vec<PathBuf> = store.file_paths().map(Path::to_path_buf).collect();
        drop(store); // waits for the write
        assert!(paths.iter().all(|p| !p.exists()), "store files are removed on drop");
    }
}
