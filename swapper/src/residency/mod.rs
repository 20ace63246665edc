//! The residency manager: where each tensor lives, and moving it where it is needed.
//!
//! | concept | what it is |
//! |---|---|
//! | copy | a tensor's bytes on one tier: absent, loading, ready, or lent to a transfer |
//! | home | where the authoritative bytes live when nothing needs them (host or NVMe) |
//! | acquire / [`Resident`] | makes a copy ready on a tier and pins it; dropping the guard unpins |
//! | prefetch / [`PrefetchHandle`] | the same fetch, started on a background thread, without a pin |
//! | eviction | dropping (clean) or writing back (dirty) unpinned copies, in the order an [`EvictionPolicy`] gives |
//!
//! **Inclusion.** A device copy always has a host copy beneath it (a fetch to the device goes
//! through pinned host memory, and a dirty device copy is written back into that host copy), as
//! in ZeRO-Infinity and StrongHold. A host copy of an NVMe-homed tensor is a cache of its NVMe
//! extent; a host-homed tensor never leaves the host.
//!
//! **Coherence.** Acquiring for [`Access::Write`] marks the copy dirty. Acquiring the host copy
//! while the device copy is dirty first copies it back (D2H); acquiring the host copy for write
//! drops the device copy, which would be stale. NVMe write-backs are copy-on-write: the new extent
//! is written before the old one is freed, so a failed write loses nothing.
//!
//! **Ordering with compute.** A device copy goes to compute through a [`Resident`] guard: the
//! holder marks each use as a compute access (sim:
//! [`SimBuffer::compute_read`](crate::SimBuffer::compute_read) /
//! [`SimBuffer::compute_write`](crate::SimBuffer::compute_write); CUDA: `CudaBuffer::as_slice`)
//! while the guard lives. Dropping a device guard records an event on the compute stream
//! ([`Device::record_compute_event`]); the copy's write-back ([`Device::dtoh_after`]) and its
//! free on eviction or removal ([`Device::free_after`]) are ordered after the latest such event,
//! so neither waits for all of compute on CUDA, and the sim device's checker sees every free
//! ordered. A fetch never waits for its H2D on the host: the device copy is ready as soon as
//! the copy is queued ([`Transfer::release_device`](crate::Transfer::release_device)), and
//! pinning it for compute makes the compute stream wait for the copy's event
//! ([`Device::compute_waits_for`]). The host copy it was copied from stays lent to the copy until
//! the copy is seen complete (polled, or waited for by whoever needs that host copy next).
//!
//! **Budgets.** Every byte on a tier is reserved under the manager's lock before it is allocated,
//! so a tier never holds more than its budget (host bytes are counted in the pool's size
//! classes). A pinned copy is never evicted. A request that cannot be met even after evicting
//! everything evictable fails with [`Error::OutOfMemory`]; one that only waits for other
//! threads' pins or in-flight transfers blocks, up to [`ResidencyConfig::wait_timeout`].

mod fetch;
mod guard;
mod prefetch_pool;
mod reserve;
mod state;
mod transfer;

pub use guard::Resident;
pub use prefetch_pool::PrefetchHandle;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::host::{size_class, PinnedPool, PinnedPoolConfig};
use crate::ledger::{HostLedger, HostUse};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::nvme::NvmeStore;
use crate::policy::EvictionPolicy;
use crate::tier::{TensorId, TensorMeta, Tier};

use prefetch_pool::PrefetchPool;
use reserve::Reservation;
use state::{CopyState, Entry, Replica, State};
use transfer::{Action, WriteBack};

/// How an acquired copy will be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Read only: the copy stays clean.
    Read,
    /// Read and write: the copy becomes dirty and is written back before it is evicted.
    Write,
    /// Write every byte without reading the old ones (host tier only): as [`Access::Write`],
    /// but an absent host copy is allocated without reading NVMe, and a device copy is dropped
    /// even when dirty (the caller replaces the whole tensor, e.g. with the optimizer's new
    /// compute copy). The guard's bytes are unspecified until written.
    Overwrite,
}

impl Access {
    /// Whether the access changes the bytes (the copy becomes dirty).
    pub fn writes(self) -> bool {
        self != Access::Read
    }
}

/// Configuration of a [`ResidencyManager`].
#[derive(Debug, Clone)]
pub struct ResidencyConfig {
    /// Device bytes the manager may use. Default `None`: the device's capacity.
    pub device_budget_bytes: Option<u64>,
    /// Host (pinned) bytes the manager may use, counted in pool size classes. Default: 4 GiB.
    pub host_budget_bytes: u64,
    /// The host ledger the host pool claims its memory from ([`HostUse::ComputeCopies`]).
    /// Default: `None` (the pool's own budget only).
    pub host_ledger: Option<Arc<HostLedger>>,
    /// Page-lock host memory (`mlock`; falls back to unlocked with a warning). Default: true.
    pub lock_host_memory: bool,
    /// Threads that run prefetches. Default: 2.
    pub prefetch_threads: usize,
    /// Longest a request waits for other threads' pins or transfers before failing. Default: 60 s.
    pub wait_timeout: Duration,
    /// Pinning a device copy for compute makes the compute stream wait for the H2D that filled
    /// it. Default: true. `false` leaves that wait out: only for the negative control of the
    /// ordering tests (the sim device's checker must then report the compute access as
    /// [`OrderingHazard::ComputeBeforeHtod`](crate::OrderingHazard::ComputeBeforeHtod)).
    pub compute_waits_for_fetch: bool,
}

impl Default for ResidencyConfig {
    fn default() -> Self {
        Self {
            device_budget_bytes: None,
            host_budget_bytes: 4 << 30,
            host_ledger: None,
            lock_host_memory: true,
            prefetch_threads: 2,
            wait_timeout: Duration::from_secs(60),
            compute_waits_for_fetch: true,
        }
    }
}

/// Moves tensors between device, host and NVMe: see the [module docs](self).
///
/// `Send + Sync`; share it by reference or `Arc` between threads. Guards ([`Resident`]) are
/// `'static` and may outlive the borrow they came from.
pub struct ResidencyManager {
    /// Declared first, so it is dropped first: its threads are joined (and their handles on
    /// `inner` gone) before the manager's own handle goes.
    prefetch_pool: PrefetchPool,
    inner: Arc<Inner>,
}

/// Which copies of a tensor exist, for inspection and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidencyInfo {
    /// A ready device copy exists.
    pub device: bool,
    /// The device copy is newer than the host copy.
    pub device_dirty: bool,
    /// A ready host copy exists.
    pub host: bool,
    /// The host copy is newer than the NVMe copy.
    pub host_dirty: bool,
    /// An NVMe extent exists.
    pub nvme: bool,
    /// Pins on the device copy.
    pub device_pins: u32,
    /// Pins on the host copy.
    pub host_pins: u32,
}

impl ResidencyManager {
    /// A manager over `device` and an optional NVMe `nvme` store (shared, e.g. with the
    /// optimizer's state), evicting by `policy`.
    ///
    /// Host memory comes from the device's preferred allocator (driver-pinned under CUDA,
    /// `mlock`ed mmap otherwise) through a [`PinnedPool`] with `config.host_budget_bytes`,
    /// claimed from `config.host_ledger` when there is one.
    ///
    /// # Errors
    /// [`Error::Config`] when a budget is zero, the device budget exceeds the device's capacity,
    /// or `prefetch_threads` is zero.
    pub fn new(
        device: Device,
        nvme: Option<Arc<NvmeStore>>,
        config: ResidencyConfig,
        policy: Box<dyn EvictionPolicy>,
    ) -> Result<Self> {
        let capacity = device.capacity_bytes();
        let device_budget = config.device_budget_bytes.unwrap_or(capacity);
        if device_budget == 0 || device_budget > capacity {
            return Err(Error::Config {
                key: "device_budget_bytes".into(),
                reason: format!("{device_budget} must be in 1..={capacity} (the device's capacity in bytes)"),
            });
        }
        if config.host_budget_bytes == 0 {
            return Err(Error::Config { key: "host_budget_bytes".into(), reason: "must be > 0".into() });
        }
        if config.prefetch_threads == 0 {
            return Err(Error::Config { key: "prefetch_threads".into(), reason: "must be >= 1".into() });
        }
        let pool_config = PinnedPoolConfig { budget_bytes: config.host_budget_bytes, lock: config.lock_host_memory };
        let allocator = device.host_allocator(config.lock_host_memory);
        let pool = match &config.host_ledger {
            Some(l) => PinnedPool::with_ledger(&pool_config, allocator, l.clone(), HostUse::ComputeCopies),
            None => PinnedPool::new(&pool_config, allocator),
        };
        let inner = Arc::new(Inner {
            state: Mutex::new(State::new(policy)),
            cond: Condvar::new(),
            device,
            pool,
            nvme,
            budgets: [AtomicU64::new(device_budget), AtomicU64::new(config.host_budget_bytes)],
            config,
            metrics: Metrics::default(),
        });
        let prefetch_pool = PrefetchPool::start(&inner, inner.config.prefetch_threads);
        Ok(Self { prefetch_pool, inner })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The NVMe store, if any.
    pub fn nvme(&self) -> Option<&NvmeStore> {
        self.inner.nvme.as_deref()
    }

    /// The host pool.
    pub fn host_pool(&self) -> &PinnedPool {
        &self.inner.pool
    }

    /// The byte budget of `tier` (`Nvme`: the store's capacity, 0 without a store).
    pub fn budget_bytes(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device | Tier::Host => self.inner.budget_bytes(tier),
            Tier::Nvme => self.inner.nvme.as_ref().map_or(0, |s| s.capacity_bytes()),
        }
    }

    /// Lowers (or raises, up to the device's capacity) the device budget, e.g. to carve out room
    /// for buffers the caller allocates on the device itself (gradient staging, a device
    /// optimizer's state). Lowering it below the bytes held evicts unpinned device copies by the
    /// policy (dirty ones written back to their host copy first) until they fit.
    ///
    /// # Errors
    /// [`Error::Config`] when `bytes` is 0 or above the device's capacity;
    /// [`Error::OutOfMemory`] on the device tier when the copies that cannot be evicted (pinned
    /// ones) hold more than `bytes` (the budget is then left as it was); write-back errors.
    pub fn set_device_budget_bytes(&self, bytes: u64) -> Result<()> {
        let inner = &self.inner;
        let capacity = inner.device.capacity_bytes();
        if bytes == 0 || bytes > capacity {
            return Err(Error::Config {
                key: "device_budget_bytes".into(),
                reason: format!("{bytes} must be in 1..={capacity} (the device's capacity)"),
            });
        }
        inner.refit_budget(Tier::Device, bytes)
    }

    /// Lowers (or raises) the host budget, and the host pool's with it: unpinned copies are
    /// evicted by the policy (dirty ones written back to NVMe first) until the bytes held fit.
    /// The runtime sets it once it knows what else the host budget must hold.
    ///
    /// # Errors
    /// [`Error::Config`] when `bytes` is 0; [`Error::OutOfMemory`] on the host tier when the
    /// copies that cannot be evicted (host-homed tensors, pinned copies) hold more than `bytes`
    /// (the budget is then left as it was); NVMe write errors.
    pub fn set_host_budget_bytes(&self, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Err(Error::Config { key: "host_budget_bytes".into(), reason: "must be > 0".into() });
        }
        self.inner.refit_budget(Tier::Host, bytes)?;
        self.inner.pool.set_budget_bytes(bytes);
        Ok(())
    }

    /// Highest bytes reserved on `tier` since creation or [`ResidencyManager::reset_peak_bytes`]
    /// (`Nvme`: the bytes in live extents now; the store keeps no peak).
    pub fn peak_bytes(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device | Tier::Host => self.inner.state.lock().peak[tier.index()],
            Tier::Nvme => self.inner.nvme.as_ref().map_or(0, |s| s.used_bytes()),
        }
    }

    /// Restarts [`ResidencyManager::peak_bytes`] from the bytes in use now.
    pub fn reset_peak_bytes(&self) {
        let mut st = self.inner.state.lock();
        st.peak = st.used;
    }

    /// Bytes reserved on `tier` now (NVMe: the store's allocated bytes).
    pub fn used_bytes(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device | Tier::Host => self.inner.state.lock().used_bytes(tier),
            Tier::Nvme => self.inner.nvme.as_ref().map_or(0, |s| s.used_bytes()),
        }
    }

    /// A copy of the traffic counters.
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = self.inner.metrics.snapshot();
        m.unpinned_host_bytes = self.inner.pool.unlocked_bytes();
        m
    }

    /// The name of the eviction policy.
    pub fn policy_name(&self) -> String {
        self.inner.state.lock().policy.name().to_string()
    }

    /// Replaces the eviction policy (between steps, when a schedule was recorded).
    pub fn set_policy(&self, policy: Box<dyn EvictionPolicy>) {
        self.inner.state.lock().policy = policy;
    }

    /// Registers a tensor with its initial bytes, stored at its home tier (an NVMe-homed tensor is
    /// written to the store and its host copy kept as a clean cache while there is room).
    ///
    /// # Errors
    /// [`Error::DuplicateTensor`]; [`Error::InvalidRequest`] when `data` is not
    /// `meta.num_bytes()` long, the home is the device, or the home is NVMe without a store;
    /// [`Error::OutOfMemory`] when the tensor is larger than the host budget or the store;
    /// NVMe I/O errors.
    pub fn register(&self, meta: TensorMeta, data: &[u8]) -> Result<()> {
        let inner = &self.inner;
        let id = meta.id;
        let bytes = meta.num_bytes();
        if data.len() != bytes {
            return Err(Error::InvalidRequest(format!(
                "tensor {id} ({}) is {bytes} bytes by its shape, {} given",
                meta.name,
                data.len()
            )));
        }
        match meta.home {
            Tier::Device => {
                return Err(Error::InvalidRequest(format!("tensor {id}: the device cannot be a home tier")));
            }
            Tier::Nvme => {
                inner.store()?;
            }
            Tier::Host => {}
        }
        let class = size_class(bytes) as u64;
        if class > inner.budget_bytes(Tier::Host) {
            return Err(Error::OutOfMemory {
                tier: Tier::Host,
                requested_bytes: class,
                available_bytes: inner.budget_bytes(Tier::Host),
            });
        }
        let mut st = inner.state.lock();
        if st.entries.contains_key(&id) {
            return Err(Error::DuplicateTensor(id));
        }
        let home = meta.home;
        let mut e = Entry { meta, device: Replica::absent(), host: Replica::absent(), nvme: None, host_pending: None };
        e.host.state = CopyState::Loading;
        st.entries.insert(id, e);
        let deadline = Instant::now() + inner.config.wait_timeout;
        if let Err(err) = inner.reserve(&mut st, Reservation { tier: Tier::Host, bytes: class, for_id: id }, deadline) {
            st.entries.remove(&id);
            return Err(err);
        }
        st.entry(id)?.host.reserved = class;
        let filled = MutexGuard::unlocked(&mut st, || {
            inner.pool.alloc(bytes).map(|mut buf| {
                buf.as_mut_slice().copy_from_slice(data);
                buf
            })
        });
        let buf = match filled {
            Ok(b) => b,
            Err(err) => {
                st.release(Tier::Host, class);
                st.entries.remove(&id);
                inner.cond.notify_all();
                return Err(err);
            }
        };
        let clock = st.clock;
        let e = st.entry(id)?;
        e.host.put(buf);
        e.host.last_use = clock;
        if home == Tier::Nvme {
            // Write the home copy now; the host copy stays as a clean cache.
            let host = e.host.take();
            if let Err(err) = inner.run(&mut st, Action::WriteNvme { id, host, then: WriteBack::Keep }) {
                let e = st.entries.remove(&id).expect("present");
                st.release(Tier::Host, e.host.reserved);
                inner.cond.notify_all();
                return Err(err);
            }
        }
        inner.cond.notify_all();
        Ok(())
    }

    /// Drops the host copy of an NVMe-homed tensor when it is a clean, unpinned cache of its
    /// extent with no device copy above it (e.g. right after [`ResidencyManager::register`], for
    /// a cold start); returns whether it went. The pool keeps the buffer cached for reuse
    /// ([`PinnedPool::trim`] returns cached buffers to the OS).
    ///
    /// # Errors
    /// [`Error::UnknownTensor`].
    pub fn drop_host_copy(&self, id: TensorId) -> Result<bool> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        let e = st.entry(id)?;
        let droppable = e.meta.home == Tier::Nvme
            && e.nvme.is_some()
            && e.host.lendable()
            && !e.host.dirty
            && e.device.state == CopyState::Absent;
        if droppable {
            let freed = e.host.clear();
            st.release(Tier::Host, freed);
            inner.cond.notify_all();
        }
        Ok(droppable)
    }

    /// Unregisters a tensor and frees its copies.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`]; [`Error::InvalidRequest`] when it is pinned or in flight.
    pub fn remove(&self, id: TensorId) -> Result<TensorMeta> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        inner.settle_host(&mut st, id, true)?;
        let e = st.entry(id)?;
        let busy = |s: CopyState| matches!(s, CopyState::Loading | CopyState::Lent);
        if !e.device.pinners.is_empty() || !e.host.pinners.is_empty() || busy(e.device.state) || busy(e.host.state) {
            return Err(Error::InvalidRequest(format!("tensor {id} is pinned or in flight; release it first")));
        }
        let freed = inner.free_device_copy(&mut st, id);
        let e = st.entries.remove(&id).expect("present");
        st.release(Tier::Host, e.host.reserved);
        if let (Some(x), Some(store)) = (e.nvme, inner.nvme.as_deref()) {
            store.free(x);
        }
        inner.cond.notify_all();
        freed.map(|()| e.meta)
    }

    /// The metadata of a tensor.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`].
    pub fn meta(&self, id: TensorId) -> Result<TensorMeta> {
        Ok(self.inner.state.lock().entry(id)?.meta.clone())
    }

    /// Which copies of `id` exist now.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`].
    pub fn residency(&self, id: TensorId) -> Result<ResidencyInfo> {
        let mut st = self.inner.state.lock();
        let e = st.entry(id)?;
        Ok(ResidencyInfo {
            device: e.device.state == CopyState::Ready,
            device_dirty: e.device.dirty,
            host: e.host.state == CopyState::Ready,
            host_dirty: e.host.dirty,
            nvme: e.nvme.is_some(),
            device_pins: e.device.pinners.len() as u32,
            host_pins: e.host.pinners.len() as u32,
        })
    }

    /// Makes `id` ready on `tier` (fetching it, and evicting others, as needed) and pins it there
    /// until the returned guard is dropped. Blocks while the bytes arrive; the wait counts as stall.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for `Tier::Nvme`; [`Error::UnknownTensor`];
    /// [`Error::OutOfMemory`] when the tier cannot make room; device and NVMe errors
    /// ([`Error::Corrupt`] among them).
    pub fn acquire(&self, id: TensorId, tier: Tier, access: Access) -> Result<Resident> {
        let span = tracing::trace_span!("swapper::acquire", tensor = id.0, %tier);
        let _e = span.enter();
        Resident::acquire(&self.inner, id, tier, access)
    }

    /// Starts fetching `id` to `tier` on a background thread, without pinning it. An acquire that
    /// comes later waits only for what is left of the fetch.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for `Tier::Nvme` (reported at once); the fetch's own errors come
    /// from [`PrefetchHandle::wait`].
    pub fn prefetch(&self, id: TensorId, tier: Tier) -> Result<PrefetchHandle> {
        if tier == Tier::Nvme {
            return Err(Error::InvalidRequest("prefetch targets the device or host tier".into()));
        }
        self.prefetch_pool.submit(id, tier)
    }

    /// Loads the device copies of `ids` (a compute step's fetch set, in the order it needs them)
    /// in one batched H2D, without pinning them: each whose device copy is absent and whose host
    /// copy is ready and not pinned, as long as the device has room without waiting (evicting
    /// by policy as an acquire does). The copies are ready for the [`ResidencyManager::acquire`]
    /// that pins each; the others are left to it. The policy hears each id as a prefetch. One
    /// H2D operation in the link metrics for the batch, its bytes all of theirs. Returns how
    /// many copies the batch loaded.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`]; the device's (a failed copy clears that tensor's device copy, as
    /// a failed acquire's does).
    pub fn load_device_batch(&self, ids: &[TensorId]) -> Result<usize> {
        self.inner.load_device_batch(ids)
    }

    /// Copies the current bytes of `id` out (from the freshest copy), for tests and checkpoints.
    ///
    /// # Errors
    /// As [`ResidencyManager::acquire`] on the host tier.
    pub fn read_to_vec(&self, id: TensorId) -> Result<Vec<u8>> {
        let g = self.acquire(id, Tier::Host, Access::Read)?;
        let v = g.host_bytes().to_vec();
        Ok(v)
    }

    /// Checks the bookkeeping: reserved bytes equal the sum over copies, no tier over its budget,
    /// the device and pool within budget (and the pool's memory within its ledger's budget), and
    /// the device's ordering ([`Device::check_ordering`]: on the sim, no happens-before
    /// violation so far). For tests; cheap enough to call often.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] describing the first broken invariant; [`Error::Ordering`] with
    /// the sim device's first ordering violation.
    pub fn check_invariants(&self) -> Result<()> {
        self.inner.device.check_ordering()?;
        let st = self.inner.state.lock();
        let mut sum = [0u64; 2];
        for e in st.entries.values() {
            sum[0] += e.device.reserved;
            sum[1] += e.host.reserved;
            // A device copy still loading may wait for its host copy to arrive.
            if matches!(e.device.state, CopyState::Ready | CopyState::Lent) && e.host.state == CopyState::Absent {
                return Err(Error::InvalidRequest(format!("{}: device copy without host copy", e.meta.id)));
            }
            if !e.device.pinners.is_empty() && e.device.state != CopyState::Ready {
                return Err(Error::InvalidRequest(format!("{}: pinned device copy not ready", e.meta.id)));
            }
            if !e.host.pinners.is_empty() && e.host.state != CopyState::Ready {
                return Err(Error::InvalidRequest(format!("{}: pinned host copy not ready", e.meta.id)));
            }
        }
        for t in [Tier::Device, Tier::Host] {
            let i = t.index();
            if sum[i] != st.used_bytes(t) {
                return Err(Error::InvalidRequest(format!(
                    "{t}: used {} != sum of copies {}",
                    st.used_bytes(t),
                    sum[i]
                )));
            }
            if st.used_bytes(t) > self.inner.budget_bytes(t) {
                return Err(Error::InvalidRequest(format!(
                    "{t}: used {} > budget {}",
                    st.used_bytes(t),
                    self.inner.budget_bytes(t)
                )));
            }
        }
        if self.inner.device.allocated_bytes() > self.inner.device.capacity_bytes() {
            return Err(Error::InvalidRequest("device allocated bytes over budget".into()));
        }
        if self.inner.pool.live_bytes() > self.inner.budget_bytes(Tier::Host) {
            return Err(Error::InvalidRequest("host pool live bytes over budget".into()));
        }
        if let Some(l) = &self.inner.config.host_ledger {
            if l.used_bytes() > l.budget_bytes() {
                return Err(Error::InvalidRequest(format!(
                    "host ledger: used {} > budget {}",
                    l.used_bytes(),
                    l.budget_bytes()
                )));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for ResidencyManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidencyManager")
            .field("device", &self.inner.device.name())
            .field("budgets", &self.inner.budgets)
            .finish()
    }
}

/// The manager's shared core: the records under one mutex, the condvar its waiters sleep on, and
/// the tiers' resources. The manager, its guards and its prefetch threads hold it; its methods
/// live by concern in `fetch`, `reserve` and `transfer`.
struct Inner {
    state: Mutex<State>,
    cond: Condvar,
    device: Device,
    pool: PinnedPool,
    nvme: Option<Arc<NvmeStore>>,
    /// [device, host] budgets; the device budget may be lowered by
    /// [`ResidencyManager::set_device_budget_bytes`].
    budgets: [AtomicU64; 2],
    config: ResidencyConfig,
    metrics: Metrics,
}

impl Drop for Inner {
    /// Frees the device copies through the device, each after the compute that used it (the
    /// ordering contract holds to the end); errors are logged (the sim device's checker keeps its
    /// violations in its log).
    fn drop(&mut self) {
        let ids: Vec<TensorId> = self.state.get_mut().entries.keys().copied().collect();
        let mut st = self.state.lock();
        for id in ids {
            if let Err(e) = self.free_device_copy(&mut st, id) {
                tracing::error!(tensor = id.0, error = %e, "freeing a device copy at shutdown");
            }
        }
    }
}

impl Inner {
    /// The byte budget of `tier`, `Device` or `Host`.
    fn budget_bytes(&self, tier: Tier) -> u64 {
        self.budgets[tier.index()].load(Ordering::Relaxed)
    }

    /// Sets `tier`'s budget (`Device` or `Host`) to `bytes` and evicts by the policy until the
    /// bytes held fit it; on failure (copies that cannot be evicted hold more) the budget is left
    /// as it was and the error returned.
    fn refit_budget(&self, tier: Tier, bytes: u64) -> Result<()> {
        let mut st = self.state.lock();
        let old = self.budget_bytes(tier);
        self.budgets[tier.index()].store(bytes, Ordering::Relaxed);
        let deadline = Instant::now() + self.config.wait_timeout;
        // Room for nothing more: evicts until the bytes held fit the new budget.
        let fit = Reservation { tier, bytes: 0, for_id: TensorId(u64::MAX) };
        if let Err(e) = self.reserve(&mut st, fit, deadline) {
            self.budgets[tier.index()].store(old, Ordering::Relaxed);
            return Err(e);
        }
        Ok(())
    }

    /// The NVMe store.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when none is configured.
    fn store(&self) -> Result<&NvmeStore> {
        self.nvme.as_deref().ok_or_else(|| Error::InvalidRequest("no NVMe store is configured".into()))
    }
}
