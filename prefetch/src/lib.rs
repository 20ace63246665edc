//! `oogc-prefetch`: the schedule of a training step and the policies that follow from it.
//!
//! # Example
//!
//! A training step over four units of 100 bytes (forward `F0 F1 F2 F3`, backward `B3 B2 B1 B0`);
//! the forward has used units 0, 1 and 2, and the device (300 bytes) is full. The lookahead
//! window asks the next-use policy what to evict to prefetch unit 3:
//!
//! ```
//! use std::sync::Arc;
//!
//! use oogc_prefetch::{CopyView, NextUsePolicy, PrefetchConfig, Prefetcher, ResidentView, Schedule, TierSnapshot};
//! use oogc_swapper::{EvictionPolicy, TensorId, Tier};
//!
//! let units: Vec<(TensorId, u64)> = (0..4).map(|u| (TensorId(u), 100)).collect();
//! let schedule = Arc::new(Schedule::training_step(&units, false)?); // no optimizer entries
//! let mut policy = NextUsePolicy::new(schedule.clone());
//! for u in 0..3 {
//!     policy.on_acquire(TensorId(u), Tier::Device, u + 1, false); // demand acquires move its cursor
//! }
//! let copy = |u: u64| ResidentView {
//!     id: TensorId(u),
//!     num_bytes: 100,
//!     state: CopyView::Ready,
//!     pinned: u == 2, // in use
//!     last_use: u + 1,
//!     dirty: false,
//! };
//! let device = TierSnapshot { budget_bytes: 300, used_bytes: 300, copies: (0..3).map(copy).collect(), clock: 3 };
//!
//! let window = Prefetcher::new(PrefetchConfig { max_depth: 2, ..PrefetchConfig::default() })?;
//! let plan = window.plan(&schedule, policy.cursor().position(), &device, &policy, &|_| false);
//! // Fetch unit 3 (bytes, next use 1 device access ahead), evicting unit 0: next used last, at B0.
//! assert_eq!(plan.fetch, vec![(TensorId(3), 100, 1)]);
//! assert_eq!(plan.evict, vec![TensorId(0)]);
//! # Ok::<(), oogc_prefetch::Error>(())
//! ```
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | trace | [`TraceRecorder`] | the recorded acquires of one step (unit, phase, tier, write, bytes held) |
//! | schedule | [`Schedule`] | the trace as the order of the following steps; next-use lookups, cyclic |
//! | minimum working set | [`min_working_set`], [`check_budget`] | the smallest device budget that can run the step |
//! | eviction priority | [`NextUsePolicy`] | Belady's MIN (1966) over the schedule, plugged into the swapper's `EvictionPolicy` |
//! | position | [`CursorHandle`] | where the policy is in the schedule (advanced by demand acquires) |
//! | lookahead | [`Prefetcher`], [`PrefetchDriver`] | the sliding window of prefetches (StrongHold, ZeRO-Infinity), pure planner + thin driver |
//! | baselines | [`FifoPolicy`], [`PolicyKind`] | FIFO, the swapper's LRU, and offline MIN for comparisons |
//! | simulator | [`simulate`], [`SimReport`] | a discrete-event model of steps: bytes per link, stalls, peaks, Perfetto trace |
//! | planner | [`plan::plan`], [`HardwareProfile`] | memory per tier, minimum GPU budget and predicted step time for a model |
//!
//! Pure policy: decisions in, decisions out; only [`PrefetchDriver`] touches a
//! `ResidencyManager`. No CUDA types, no candle.
#![forbid(unsafe_code)]

pub mod driver;
pub mod error;
pub mod plan;
pub mod policy;
pub mod prefetcher;
pub mod schedule;
pub mod sim;

pub use driver::PrefetchDriver;
pub use error::{Error, Result};
pub use plan::{GpuDatasheet, HardwareProfile, ModelUnit, PlanInput, PlanReport, DEFAULT_GPU_MFU};
pub use policy::{CursorHandle, FifoPolicy, NextUsePolicy, PolicyKind, PRIORITY_DEAD, PRIORITY_UNKNOWN};
pub use prefetcher::{CopyView, PrefetchConfig, PrefetchPlan, Prefetcher, ResidentView, Stop, TierSnapshot};
pub use schedule::{check_budget, min_working_set, Phase, Schedule, ScheduleEntry, TraceRecorder};
pub use sim::{simulate, simulate_kind, LinkBandwidths, LinkBytes, SimConfig, SimReport, SimUnit, TierBytes};
