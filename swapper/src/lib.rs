//! `oogc-swapper`: the tiers of oogc and the residency manager that moves tensors between them.
//!
//! # Example
//!
//! A tensor registered in host memory, moved to a (sim) device, written there by compute and
//! read back to the host:
//!
//! ```
//! use oogc_swapper::{
//!     Access, DType, Device, LruPolicy, ResidencyConfig, ResidencyManager, SimDevice, SimDeviceConfig,
//!     TensorId, TensorMeta, Tier,
//! };
//!
//! let device = Device::Sim(SimDevice::new(SimDeviceConfig { capacity_bytes: 1 << 20, ..Default::default() })?);
//! let config = ResidencyConfig { host_budget_bytes: 16 << 20, lock_host_memory: false, ..Default::default() };
//! let m = ResidencyManager::new(device, None, config, Box::new(LruPolicy))?;
//!
//! let data: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect(); // 4 KiB of u8
//! m.register(TensorMeta::new(TensorId(0), "w", &[data.len()], DType::U8, Tier::Host), &data)?;
//! {
//!     // H2D on acquire; the guard pins the device copy until dropped.
//!     let w = m.acquire(TensorId(0), Tier::Device, Access::Write)?;
//!     let mut buf = w.device_buffer_mut();
//!     let on_device = buf.as_sim_mut().expect("a sim device").compute_write()?;
//!     assert_eq!(on_device, &data[..]);
//!     on_device.iter_mut().for_each(|b| *b = b.wrapping_add(1));
//! }
//! // Reading on the host copies the dirty device copy back (D2H).
//! let back = m.read_to_vec(TensorId(0))?;
//! assert_eq!(back, data.iter().map(|b| b.wrapping_add(1)).collect::<Vec<u8>>());
//! assert_eq!((m.metrics().htod.bytes, m.metrics().dtoh.bytes), (4096, 4096));
//! # Ok::<(), oogc_swapper::Error>(())
//! ```
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | tier | [`Tier`] | device (GPU), host (pinned), NVMe |
//! | device backend | [`Device`], [`SimDevice`], [`CudaDevice`] | enforced capacity, asynchronous H2D/D2H, events |
//! | ordering | [`DeviceEvent`], [`Device::record_compute_event`], [`Device::dtoh_after`], [`Device::free_after`] | one compute/copy ordering API for both backends; the sim device checks it (happens-before) |
//! | pinned pool | [`PinnedPool`], [`HostBuffer`] | page-aligned, page-locked host buffers with a byte budget |
//! | process allocator | [`HugePageMalloc`] | malloc with large blocks advised as huge pages (`oogc train`'s) |
//! | host ledger | [`HostLedger`], [`HostUse`] | the one host budget every host allocation is claimed from, by category, with peaks |
//! | NVMe store | [`NvmeStore`] | files striped over directories, extents with checksums, io_uring or pread/pwrite |
//! | residency | [`ResidencyManager`] | where each tensor lives, acquire/release (pins), prefetch, eviction by a policy |
//! | metrics | [`Metrics`] | bytes and busy time per link, stall time |
//!
//! The swapper knows nothing of models or optimizer math: it moves bytes of tensors it is told
//! about, keeps each tier under its budget, and never evicts a pinned tensor.
#![deny(unsafe_code)]

pub mod device;
pub mod error;
pub mod host;
pub mod huge_malloc;
pub mod ledger;
pub mod metrics;
pub mod nvme;
pub mod policy;
pub mod residency;
pub mod skip;
pub mod tier;

pub use device::{
    BatchCopy, CudaBuffer, CudaDevice, CudaEvent, Device, DeviceBackend, DeviceBuffer, DeviceEvent, Direction,
    OrderingHazard, OrderingViolation, PendingHost, SimBuffer, SimDevice, SimDeviceConfig, SimEvent, Transfer,
};
pub use error::{Error, Result};
pub use host::{HostAllocator, HostBuffer, HostMemory, MmapAllocator, PinnedPool, PinnedPoolConfig};
pub use huge_malloc::HugePageMalloc;
pub use ledger::{CategoryFigures, HostClaim, HostLedger, HostLedgerReport, HostUse};
pub use metrics::{Link, LinkSnapshot, LinkStats, Metrics, MetricsSnapshot};
pub use nvme::fault::{FaultAction, FaultPlan, FaultTrigger};
pub use nvme::{EngineChoice, EngineKind, Extent, IoHandle, NvmeConfig, NvmeStore};
pub use policy::{EvictionCandidate, EvictionPolicy, LruPolicy};
pub use residency::{Access, PrefetchHandle, ResidencyConfig, ResidencyManager, Resident};
pub use tier::{DType, StatePlacement, TensorId, TensorMeta, Tier};
