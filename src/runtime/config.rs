//! How a [`Runtime`](super::Runtime) is built: [`RuntimeConfig`] (device, budgets, placements,
//! prefetch depths, the optimizer, activation offload, sharding) — plain data; the TOML config
//! (`crate::config`) is mapped onto it by the trainer, never read here.

use oogc_optimizer::OptimizerConfig;
use oogc_swapper::{DType, NvmeConfig, StatePlacement};

/// Which device computes.
#[derive(Debug, Clone)]
pub enum DeviceSpec {
    /// The sim device: capacity = the GPU budget, H2D/D2H throttled to `link_gbps` (0 = no
    /// throttle) plus `latency_us` per copy; compute is candle on the CPU.
    Sim {
        /// GB/s (10^9 B/s).
        link_gbps: f64,
        /// Microseconds per copy.
        latency_us: f64,
    },
    /// CUDA device `ordinal` (needs `--features cuda`).
    Cuda {
        /// Device index.
        ordinal: usize,
        /// cudarc's per-slice event tracking (an event recorded at each use of a device slice
        /// and waited for at the next use from another stream). The runtime orders its streams
        /// with events of its own (swapper's `CudaDevice`), so it does not rely on it; `false`
        /// turns it off for every slice allocated after the device is opened.
        event_tracking: bool,
    },
}

/// How a [`Runtime`](super::Runtime) is built.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The compute device.
    pub device: DeviceSpec,
    /// Device bytes for compute copies and gradient staging.
    pub gpu_budget_bytes: u64,
    /// Host bytes for everything the runtime holds in host memory (the [`HostLedger`](oogc_swapper::HostLedger)'s budget:
    /// compute copies, optimizer state, second buffers, stream buffers, gradients).
    pub host_budget_bytes: u64,
    /// Where master weights and Adam state live.
    pub state_placement: StatePlacement,
    /// Where the compute copies' home is: pinned host memory, or the NVMe store with the host
    /// tier as its cache (ZeRO-Infinity's `offload_param`).
    pub params_placement: StatePlacement,
    /// NVMe store for optimizer state and/or parameters (needed when either is on NVMe).
    pub nvme: Option<NvmeConfig>,
    /// Units prefetched ahead; 0 = on demand.
    pub prefetch_depth: usize,
    /// Units prefetched NVMe → host ahead, when parameters live on NVMe (the host window, ahead
    /// of the device window); 0 = none.
    pub host_prefetch_depth: usize,
    /// The CPU optimizer.
    pub optimizer: OptimizerConfig,
    /// Page-lock host memory (falls back with a warning when RLIMIT_MEMLOCK is low).
    pub lock_host_memory: bool,
    /// true (ours): each unit's gradients go to the CPU optimizer as soon as their D2H copy
    /// lands, so updates overlap the rest of the backward and the next step's forward. false (the
    /// ZeRO-Infinity-like baseline): gradients are still copied D2H per unit but held, submitted
    /// only in [`Runtime::finish_step`](super::Runtime::finish_step), which then waits for every unit's update before
    /// returning: the optimizer never overlaps compute. Same results bit for bit.
    pub overlap_optimizer: bool,
    /// Activation checkpoints offloaded to pinned host memory ([`Activations::stash`](super::Activations::stash));
    /// `None`: the caller keeps them on the device.
    pub activation_offload: Option<ActivationOffload>,
    /// With data-parallel ranks, shard the compute copies too (ZeRO-3, FSDP's `FULL_SHARD`):
    /// each rank's tiers (host, NVMe, device) hold only its [`crate::dist::shard_range`] of
    /// every unit's compute copy, a fetch copies that shard H2D and all-gathers the whole unit
    /// on the compute device, and gathered units are kept for their next use while the GPU
    /// budget allows (`runtime/gathered.rs`); a unit that leaves a rank no shard (a shard is whole
    /// blocks of 256: [`crate::dist::every_rank_holds`]) stays whole on every rank, as with
    /// `false`. `false`: every rank's tiers hold whole compute
    /// copies, all-gathered once per update in [`Runtime::finish_step`](super::Runtime::finish_step) (ZeRO-2, FSDP's
    /// `SHARD_GRAD_OP`), which [`Runtime::fetch_pinned`](super::Runtime::fetch_pinned) needs. No effect in a world of one.
    pub shard_parameters: bool,
    /// The run saves or loads checkpoints: the host plan keeps room for one unit's state
    /// ([`HostUse::Checkpoint`](oogc_swapper::HostUse::Checkpoint),
    /// [`checkpoint_staging_bytes`](super::budget::checkpoint_staging_bytes)).
    pub checkpoint_staging: bool,
}

/// What a run offloads of its activation checkpoints (`[activations] offload`): enters the host
/// plan ([`HostUse::Activations`](oogc_swapper::HostUse::Activations): `checkpoints` buffers of `checkpoint_bytes`) and the device's
/// working set (two staging buffers of `checkpoint_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationOffload {
    /// Checkpoints held at once (blocks × micro-batches).
    pub checkpoints: usize,
    /// Bytes of the largest checkpoint (`[batch, seq, hidden]` in the compute dtype).
    pub checkpoint_bytes: usize,
}

impl RuntimeConfig {
    /// A sim-device runtime with `gpu_budget_bytes`, an unthrottled link, state in host memory,
    /// prefetch depth 2 and the optimizer's defaults with f32 compute copies (set
    /// `optimizer.compute_dtype` to [`DType::BF16`] for mixed precision).
    pub fn sim(gpu_budget_bytes: u64) -> Self {
        Self {
            device: DeviceSpec::Sim { link_gbps: 0.0, latency_us: 0.0 },
            gpu_budget_bytes,
            host_budget_bytes: 4 << 30,
            state_placement: StatePlacement::Host,
            params_placement: StatePlacement::Host,
            nvme: None,
            prefetch_depth: 2,
            host_prefetch_depth: 4,
            optimizer: OptimizerConfig { compute_dtype: DType::F32, ..OptimizerConfig::default() },
            lock_host_memory: false,
            overlap_optimizer: true,
            activation_offload: None,
            shard_parameters: false,
            checkpoint_staging: false,
        }
    }
}
