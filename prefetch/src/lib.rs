//! `oogc-prefetch`: the schedule of a training step and the policies that follow from it.
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
