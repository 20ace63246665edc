//! The host tier: page-aligned, page-locked buffers from a pooled allocator with a byte budget.
//!
//! | concept | what it is |
//! |---|---|
//! | [`HostMemory`] | one allocation of host memory (an anonymous mapping, or the CUDA driver's pinned memory) |
//! | [`HostAllocator`] | makes [`HostMemory`]; [`MmapAllocator`] by default, the CUDA backend's under `cuda` |
//! | [`HostBuffer`] | a buffer handed out by the pool: `len()` bytes in use of a `capacity()` that is a multiple of 4 KiB |
//! | [`PinnedPool`] | size classes, a byte budget, reuse of freed buffers without re-pinning |
//!
//! Buffers of 2 MiB or more are 2 MiB-aligned and advised `MADV_HUGEPAGE`, so that an
//! O_DIRECT request of 1 MiB is physically contiguous and reaches the disk whole (a virtio disk
//! takes 254 segments per request; see `../shared/peers/README.md`). Locking uses `mlock`; when
//! RLIMIT_MEMLOCK refuses, the pool keeps the memory unlocked, warns once and counts the bytes.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{Advice, MmapMut};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::ledger::{HostClaim, HostLedger, HostUse};
use crate::tier::Tier;

/// Bytes of a base page; every host buffer's address and capacity are multiples of it.
pub const PAGE_BYTES: usize = 4096;
/// Bytes of a transparent huge page on x86-64.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// One allocation of host memory. Implementations own the memory; dropping frees it.
pub trait HostMemory: Send + Sync + 'static {
    /// The whole allocation, `capacity` bytes, starting at a [`PAGE_BYTES`]-aligned address.
    fn as_slice(&self) -> &[u8];
    /// The whole allocation, mutably.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// Whether the pages are locked in RAM (mlock or driver-pinned).
    fn is_page_locked(&self) -> bool;
}

/// Makes [`HostMemory`] for a [`PinnedPool`].
pub trait HostAllocator: Send + Sync + 'static {
    /// Allocates at least `capacity` bytes (a multiple of [`PAGE_BYTES`]), zeroed.
    ///
    /// # Errors
    /// The OS or driver refused the allocation.
    fn allocate(&self, capacity: usize) -> io::Result<Box<dyn HostMemory>>;
    /// A short name for logs (`mmap`, `cuda-pinned`).
    fn name(&self) -> &'static str;
}

/// Host memory from an anonymous `mmap`: page-aligned, 2 MiB-aligned and `MADV_HUGEPAGE` when
/// at least 2 MiB, locked with `mlock` when asked and allowed.
pub struct MmapMemory {
    map: MmapMut,
    offset: usize,
    capacity: usize,
    locked: bool,
}

impl MmapMemory {
    /// Maps `capacity` bytes (rounded up to [`PAGE_BYTES`]) and pre-faults them. With `lock`, tries
    /// `mlock`; the second value is the error when locking was refused (the memory is still usable).
    ///
    /// # Errors
    /// `mmap` failed.
    pub fn new(capacity: usize, lock: bool) -> io::Result<(Self, Option<io::Error>)> {
        let capacity = capacity.max(1).next_multiple_of(PAGE_BYTES);
        let huge = capacity >= HUGE_PAGE_BYTES;
        let align = if huge { HUGE_PAGE_BYTES } else { PAGE_BYTES };
        let map = MmapMut::map_anon(capacity + align - PAGE_BYTES)?;
        let addr = map.as_ptr() as usize;
        let offset = addr.next_multiple_of(align) - addr;
        if huge {
            // Best effort: THP may be off ("never"); the buffer works either way.
            let _ = map.advise_range(Advice::HugePage, offset, capacity);
        }
        let mut mem = Self { map, offset, capacity, locked: false };
        let mut lock_err = None;
        if lock {
            match mem.map.lock() {
                Ok(()) => mem.locked = true,
                Err(e) => lock_err = Some(e),
            }
        }
        if !mem.locked {
            // Fault the pages in now (after MADV_HUGEPAGE, so they come as huge pages), so the
            // first transfer does not pay for page faults.
            let step = if huge { HUGE_PAGE_BYTES } else { PAGE_BYTES };
            let s = mem.as_mut_slice();
            for i in (0..s.len()).step_by(step) {
                s[i] = 0;
            }
        }
        Ok((mem, lock_err))
    }
}

impl HostMemory for MmapMemory {
    fn as_slice(&self) -> &[u8] {
        &self.map[self.offset..self.offset + self.capacity]
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[self.offset..self.offset + self.capacity]
    }
    fn is_page_locked(&self) -> bool {
        self.locked
    }
}

/// The default [`HostAllocator`]: [`MmapMemory`], locked with `mlock` when `lock` is set. The
/// first refusal is logged once as a warning; refused bytes are counted in
/// [`MmapAllocator::unlocked_bytes`].
pub struct MmapAllocator {
    lock: bool,
    warned: AtomicBool,
    unlocked_bytes: AtomicU64,
}

impl MmapAllocator {
    /// An allocator that locks its memory when `lock` is true.
    pub fn new(lock: bool) -> Self {
        Self { lock, warned: AtomicBool::new(false), unlocked_bytes: AtomicU64::new(0) }
    }

    /// Bytes allocated so far that could not be locked (cumulative).
    pub fn unlocked_bytes(&self) -> u64 {
        self.unlocked_bytes.load(Ordering::Relaxed)
    }
}

impl HostAllocator for MmapAllocator {
    fn allocate(&self, capacity: usize) -> io::Result<Box<dyn HostMemory>> {
        let (mem, lock_err) = MmapMemory::new(capacity, self.lock)?;
        if let Some(e) = lock_err {
            self.unlocked_bytes.fetch_add(mem.capacity as u64, Ordering::Relaxed);
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    error = %e,
                    bytes = mem.capacity,
                    "mlock refused (RLIMIT_MEMLOCK, see `ulimit -l`): host buffers stay unlocked; \
                     raise the limit for page-locked transfers"
                );
            }
        }
        Ok(Box::new(mem))
    }
    fn name(&self) -> &'static str {
        "mmap"
    }
}

/// Rounds a request up to its size class: a multiple of 4 KiB, and at most 1/8 larger than the
/// request (8 classes per power of two above 32 KiB), so a class wastes at most 12.5% there.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    let granule = (bytes.next_power_of_two() / 16).max(PAGE_BYTES);
    bytes.next_multiple_of(granule)
}

/// A host buffer from a [`PinnedPool`]: `len()` bytes in use out of `capacity()`.
///
/// `capacity()` is the size class, a multiple of [`PAGE_BYTES`], and the address is page-aligned,
/// so [`HostBuffer::as_padded_slice`] is always valid for O_DIRECT. Dropping the buffer returns
/// its memory to the pool (it stays locked) for the next request of the same class.
pub struct HostBuffer {
    mem: Option<Box<dyn HostMemory>>,
    len: usize,
    pool: Option<Arc<PoolShared>>,
}

impl HostBuffer {
    /// A buffer over `mem` that belongs to no pool (freed on drop), with `len` bytes in use.
    ///
    /// # Panics
    /// If `len` exceeds the memory's capacity.
    pub fn unpooled(mem: Box<dyn HostMemory>, len: usize) -> Self {
        assert!(len <= mem.as_slice().len(), "len {len} > capacity {}", mem.as_slice().len());
        Self { mem: Some(mem), len, pool: None }
    }

    fn mem(&self) -> &dyn HostMemory {
        self.mem.as_deref().expect("host buffer memory taken")
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes are in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the allocation (a multiple of [`PAGE_BYTES`]).
    pub fn capacity(&self) -> usize {
        self.mem().as_slice().len()
    }

    /// Sets the bytes in use.
    ///
    /// # Panics
    /// If `len > capacity()`.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "len {len} > capacity {}", self.capacity());
        self.len = len;
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        &self.mem().as_slice()[..self.len]
    }

    /// The bytes in use, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.mem.as_deref_mut().expect("host buffer memory taken").as_mut_slice()[..len]
    }

    /// The bytes in use rounded up to a multiple of [`PAGE_BYTES`] (what O_DIRECT transfers).
    pub fn as_padded_slice(&self) -> &[u8] {
        let n = self.len.next_multiple_of(PAGE_BYTES).min(self.capacity());
        &self.mem().as_slice()[..n]
    }

    /// The bytes in use rounded up to a multiple of [`PAGE_BYTES`], mutably.
    pub fn as_padded_mut_slice(&mut self) -> &mut [u8] {
        let n = self.len.next_multiple_of(PAGE_BYTES).min(self.capacity());
        &mut self.mem.as_deref_mut().expect("host buffer memory taken").as_mut_slice()[..n]
    }

    /// The whole allocation, mutably (`capacity()` bytes).
    pub fn as_capacity_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_deref_mut().expect("host buffer memory taken").as_mut_slice()
    }

    /// Whether the memory is page-locked.
    pub fn is_page_locked(&self) -> bool {
        self.mem().is_page_locked()
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("page_locked", &self.is_page_locked())
            .finish()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let (Some(mem), Some(pool)) = (self.mem.take(), self.pool.take()) {
            pool.give_back(mem);
        }
    }
}

/// Configuration of a [`PinnedPool`].
#[derive(Debug, Clone)]
pub struct PinnedPoolConfig {
    /// Most bytes the pool may hold, live and cached together. Default: 4 GiB.
    pub budget_bytes: u64,
    /// Lock pages with `mlock` (ignored by allocators that pin by other means). Default: true.
    pub lock: bool,
}

impl Default for PinnedPoolConfig {
    fn default() -> Self {
        Self { budget_bytes: 4 << 30, lock: true }
    }
}

struct PoolShared {
    budget_bytes: AtomicU64,
    allocator: Arc<dyn HostAllocator>,
    /// The ledger every allocation from the OS is claimed from, and under which category.
    ledger: Option<(Arc<HostLedger>, HostUse)>,
    state: Mutex<PoolState>,
    allocations: AtomicU64,
    reuses: AtomicU64,
    /// Requests shorter than this are served at this length ([`PinnedPool::raise_min_len`]).
    min_len: AtomicU64,
}

#[derive(Default)]
struct PoolState {
    /// Bytes of live buffers plus cached free ones.
    held_bytes: u64,
    /// Bytes of cached free buffers.
    cached_bytes: u64,
    free: BTreeMap<usize, Vec<Box<dyn HostMemory>>>,
    unlocked_bytes: u64,
}

impl PoolShared {
    fn give_back(&self, mem: Box<dyn HostMemory>) {
        let cap = mem.as_slice().len();
        let mut st = self.state.lock();
        st.cached_bytes += cap as u64;
        st.free.entry(cap).or_default().push(mem);
    }
}

impl PoolState {
    /// Takes cached free buffers out (largest first) until the bytes held are at most `limit` or
    /// none is cached; the caller drops them (their memory goes back to the OS).
    fn take_cached_until(&mut self, limit: u64) -> Vec<Box<dyn HostMemory>> {
        let mut out = Vec::new();
        while self.held_bytes > limit && self.cached_bytes > 0 {
            let (&cap, _) = self.free.iter().next_back().expect("cached bytes without buffers");
            let list = self.free.get_mut(&cap).expect("class present");
            let mem = list.pop().expect("non-empty class");
            if list.is_empty() {
                self.free.remove(&cap);
            }
            self.cached_bytes -= cap as u64;
            self.held_bytes -= cap as u64;
            if !mem.is_page_locked() {
                self.unlocked_bytes -= cap as u64;
            }
            out.push(mem);
        }
        out
    }
}

/// Host memory whose bytes are claimed from a [`HostLedger`] for as long as it lives.
struct LedgerMemory {
    mem: Box<dyn HostMemory>,
    _claim: HostClaim,
}

impl HostMemory for LedgerMemory {
    fn as_slice(&self) -> &[u8] {
        self.mem.as_slice()
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
    fn is_page_locked(&self) -> bool {
        self.mem.is_page_locked()
    }
}

/// A pool of page-aligned, page-locked host buffers with a byte budget.
///
/// Requests are rounded to a [`size_class`] (of at least [`PinnedPool::raise_min_len`]'s length);
/// a freed buffer is cached by class and handed out again without re-allocating, re-locking or
/// faulting its pages in. When a new allocation would exceed the budget, the
/// pool first frees cached buffers of other classes; if it still does not fit, the request fails
/// with [`Error::OutOfMemory`] on [`Tier::Host`]. Cloning the pool shares it.
///
/// With a [`HostLedger`] ([`PinnedPool::with_ledger`]) every allocation from the OS is claimed
/// from the ledger first, under the pool's category, and given back when the memory goes back
/// to the OS: cached free buffers count, as they are resident.
#[derive(Clone)]
pub struct PinnedPool {
    shared: Arc<PoolShared>,
}

impl PinnedPool {
    /// A pool over `allocator` with `config`'s budget.
    pub fn new(config: &PinnedPoolConfig, allocator: Arc<dyn HostAllocator>) -> Self {
        Self::build(config, allocator, None)
    }

    /// A pool over `allocator` with `config`'s budget whose allocations from the OS are claimed
    /// from `ledger` under `use_` (see the type's docs).
    pub fn with_ledger(
        config: &PinnedPoolConfig,
        allocator: Arc<dyn HostAllocator>,
        ledger: Arc<HostLedger>,
        use_: HostUse,
    ) -> Self {
        Self::build(config, allocator, Some((ledger, use_)))
    }

    fn build(
        config: &PinnedPoolConfig,
        allocator: Arc<dyn HostAllocator>,
        ledger: Option<(Arc<HostLedger>, HostUse)>,
    ) -> Self {
        Self {
            shared: Arc::new(PoolShared {
                budget_bytes: AtomicU64::new(config.budget_bytes),
                allocator,
                ledger,
                state: Mutex::new(PoolState::default()),
                allocations: AtomicU64::new(0),
                reuses: AtomicU64::new(0),
                min_len: AtomicU64::new(0),
            }),
        }
    }

    /// A pool of [`MmapAllocator`] memory, locked when `config.lock`.
    pub fn with_mmap(config: &PinnedPoolConfig) -> Self {
        Self::new(config, Arc::new(MmapAllocator::new(config.lock)))
    }

    /// The budget in bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.shared.budget_bytes.load(Ordering::Relaxed)
    }

    /// Serves every later request shorter than `len` bytes from a buffer of `len`'s size class
    /// (never lowers it). A pool whose requests vary in length (one per unit) and whose budget
    /// holds a few of the largest then keeps buffers of one class: each is handed out again,
    /// instead of cached buffers of one class being given back to the OS to make room for
    /// another's, mapped afresh and faulted in every step.
    pub fn raise_min_len(&self, len: usize) {
        self.shared.min_len.fetch_max(len as u64, Ordering::Relaxed);
    }

    /// Changes the budget; cached free buffers are given back to the OS (largest first) until
    /// the bytes held fit. Buffers handed out are not touched: the caller keeps their bytes
    /// below the new budget (the residency manager evicts first).
    pub fn set_budget_bytes(&self, bytes: u64) {
        self.shared.budget_bytes.store(bytes, Ordering::Relaxed);
        let freed = self.shared.state.lock().take_cached_until(bytes);
        drop(freed);
    }

    /// Bytes held from the OS: live buffers and cached free ones.
    pub fn held_bytes(&self) -> u64 {
        self.shared.state.lock().held_bytes
    }

    /// Bytes of buffers handed out and not yet dropped (by size class).
    pub fn live_bytes(&self) -> u64 {
        let st = self.shared.state.lock();
        st.held_bytes - st.cached_bytes
    }

    /// Bytes a new request could still get: the budget less the live bytes (cached free buffers
    /// count as available, they are released on demand).
    pub fn available_bytes(&self) -> u64 {
        self.budget_bytes().saturating_sub(self.live_bytes())
    }

    /// Bytes held from the OS that are not page-locked (mlock refused).
    pub fn unlocked_bytes(&self) -> u64 {
        self.shared.state.lock().unlocked_bytes
    }

    /// (new allocations, reuses of a cached buffer) since the pool was made.
    pub fn allocation_counts(&self) -> (u64, u64) {
        (self.shared.allocations.load(Ordering::Relaxed), self.shared.reuses.load(Ordering::Relaxed))
    }

    /// Name of the allocator (`mmap`, `cuda-pinned`).
    pub fn allocator_name(&self) -> &'static str {
        self.shared.allocator.name()
    }

    /// A buffer of `len` bytes in use (zeroed when newly allocated; a reused buffer keeps old bytes).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] on [`Tier::Host`] when the size class does not fit in the budget
    /// after releasing cached buffers; [`Error::HostBudget`] when the pool's ledger refuses the
    /// bytes; [`Error::InvalidRequest`] when the allocator fails.
    pub fn alloc(&self, len: usize) -> Result<HostBuffer> {
        let class = size_class(len.max(self.shared.min_len.load(Ordering::Relaxed) as usize));
        let sh = &self.shared;
        let budget_bytes = self.budget_bytes();
        let claim = {
            let mut st = sh.state.lock();
            if let Some(list) = st.free.get_mut(&class) {
                if let Some(mem) = list.pop() {
                    if list.is_empty() {
                        st.free.remove(&class);
                    }
                    st.cached_bytes -= class as u64;
                    drop(st);
                    sh.reuses.fetch_add(1, Ordering::Relaxed);
                    return Ok(HostBuffer { mem: Some(mem), len, pool: Some(sh.clone()) });
                }
            }
            // Release cached buffers (largest first) until the new class fits.
            let to_release = st.take_cached_until(budget_bytes.saturating_sub(class as u64));
            if st.held_bytes + class as u64 > budget_bytes {
                return Err(Error::OutOfMemory {
                    tier: Tier::Host,
                    requested_bytes: class as u64,
                    available_bytes: budget_bytes.saturating_sub(st.held_bytes),
                });
            }
            // Freed (and their ledger claims given back) under the lock, before the new claim, so
            // that the ledger never counts both the old buffers and the new one.
            drop(to_release);
            // Claimed from the ledger before the memory is made; given back when it is freed.
            let claim = match &sh.ledger {
                Some((ledger, use_)) => Some(ledger.claim(*use_, class as u64)?),
                None => None,
            };
            st.held_bytes += class as u64; // reserved before the (slow) allocation
            claim
        };
        let mem = match sh.allocator.allocate(class) {
            Ok(mem) => mem,
            Err(e) => {
                sh.state.lock().held_bytes -= class as u64;
                return Err(Error::InvalidRequest(format!(
                    "host allocation of {class} bytes failed ({}): {e}",
                    sh.allocator.name()
                )));
            }
        };
        if !mem.is_page_locked() {
            sh.state.lock().unlocked_bytes += class as u64;
        }
        let mem: Box<dyn HostMemory> = match claim {
            Some(c) => Box::new(LedgerMemory { mem, _claim: c }),
            None => mem,
        };
        sh.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(HostBuffer { mem: Some(mem), len, pool: Some(sh.clone()) })
    }

    /// A buffer holding a copy of `bytes`.
    ///
    /// # Errors
    /// As [`PinnedPool::alloc`].
    pub fn alloc_copy(&self, bytes: &[u8]) -> Result<HostBuffer> {
        let mut buf = self.alloc(bytes.len())?;
        buf.as_mut_slice().copy_from_slice(bytes);
        Ok(buf)
    }

    /// Frees every cached (unused) buffer back to the OS.
    pub fn trim(&self) {
        let freed = self.shared.state.lock().take_cached_until(0);
        drop(freed);
    }
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("budget_bytes", &self.budget_bytes())
            .field("live_bytes", &self.live_bytes())
            .field("allocator", &self.allocator_name())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_are_page_multiples_and_waste_at_most_an_eighth() {
        for bytes in [1usize, 4095, 4096, 4097, 100_000, 1 << 20, (1 << 20) + 1, 3 << 20, 123_456_789] {
            let c = size_class(bytes);
            assert!(c >= bytes);
            assert_eq!(c % PAGE_BYTES, 0);
            if bytes > 8 * PAGE_BYTES {
                assert!(c as f64 <= bytes as f64 * 1.125 + 1.0, "{bytes} -> {c}");
            }
        }
    }

    #[test]
    fn buffers_are_aligned_and_reused_without_new_allocations() {
        let pool = PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 64 << 20, lock: true });
        let a = pool.alloc(3 << 20).unwrap();
        assert_eq!(a.as_slice().as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        let b = pool.alloc(10_000).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % PAGE_BYTES, 0);
        assert_eq!(b.len(), 10_000);
        drop(a);
        let _a2 = pool.alloc(3 << 20).unwrap();
        assert_eq!(pool.allocation_counts(), (2, 1));
    }

    #[test]
    fn requests_below_the_minimum_length_share_one_class_and_reuse_its_buffers() {
        // Room for two buffers of the larger class only, as the stream and landing pools are
        // planned: without a minimum length the classes would give way to each other.
        let big = size_class(3 << 20);
        let pool = PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 2 * big as u64, lock: false });
        pool.raise_min_len(3 << 20);
        pool.raise_min_len(1 << 20); // never lowers it
        for _ in 0..4 {
            let a = pool.alloc(1 << 20).unwrap();
            let b = pool.alloc(3 << 20).unwrap();
            assert_eq!((a.len(), a.capacity(), b.capacity()), (1 << 20, big, big));
        }
        let (allocations, reuses) = pool.allocation_counts();
        assert_eq!((allocations, reuses), (2, 6), "two buffers mapped, then handed out again");
    }

    #[test]
    fn budget_is_enforced_and_cached_buffers_are_released_for_new_classes() {
        let pool = PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 8 << 20, lock: false });
        let a = pool.alloc(6 << 20).unwrap();
        match pool.alloc(4 << 20) {
            Err(Error::OutOfMemory { tier: Tier::Host, requested_bytes, available_bytes }) => {
                assert_eq!(requested_bytes, 4 << 20);
                assert_eq!(available_bytes, 2 << 20);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        drop(a); // cached, 6 MiB held
        let b = pool.alloc(4 << 20).unwrap(); // must release the cached 6 MiB first
        assert_eq!(pool.live_bytes(), 4 << 20);
        assert!(pool.shared.state.lock().held_bytes <= 8 << 20);
        drop(b);
    }
}
