//! `oogc bench`: offload benchmarks that print human-readable tables or JSON.
//!
//! # Example
//!
//! `oogc bench evict` through the library: a 4-layer GPT's training step in the step simulator
//! at a device budget of 30% of its compute copies, one row per eviction policy:
//!
//! ```
//! use oogc::plan::GptShape;
//! use oogc_bench::evict::{self, EvictBenchArgs, Workload};
//!
//! let args = EvictBenchArgs {
//!     shape: GptShape { layers: 4, d_model: 64, seq_len: 16, batch: 2, dtype_bytes: 2 },
//!     fractions: vec![0.3],
//!     workloads: vec![Workload::Train],
//!     ..EvictBenchArgs::default()
//! };
//! let rows = evict::run(&args)?;
//! let policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
//! assert_eq!(policies, ["next-use", "lru", "fifo", "min"]);
//! for r in &rows {
//!     // No policy moves fewer bytes than offline MIN at the same budget.
//!     assert!(r.bytes_moved >= r.min_bytes && r.ratio_to_min >= 1.0, "{r:?}");
//!     assert!(r.step_s > 0.0 && r.stall_s <= r.step_s);
//! }
//! # Ok::<(), oogc_bench::Error>(())
//! ```
//!
//! | command | module | what it measures |
//! |---|---|---|
//! | `oogc bench nvme` | [`nvme`] | the NVMe store per engine, beside `fio` |
//! | `oogc bench evict` | [`evict`] | bytes moved and stall of next-use, LRU, FIFO and offline MIN over device budgets, in the step simulator |
//! | `oogc bench moe` | [`moe`] | expert bytes moved, hit rate and predicted MoE step of expert placement policies replaying a routing trace |
//! | `oogc bench step` | [`step`] | real training steps under ours, on-demand and all-resident, beside the lower bound and the plan ([`machine`] records the machine) |
//! | `oogc bench checkpoint` | [`checkpoint`] | what a checkpoint written in the background (and, beside it, a synchronous one) costs the step after it, against the steps of the same run that follow no save |
//! | `oogc bench plan` | [`plan_check`] | `oogc plan`'s predicted step (compute probed for the config's shape) beside the measured one, per config, within 15% or not |
//! | `oogc plan --probe-compute`, `--hardware-probe`, `oogc bench probe` | [`probe`] | candle's compute rate for a model's block (the config's dtype), this machine's memory, NVMe and Adam figures, and a GPU's matrix-product TFLOP/s, H2D/D2H, name and memory ([`probe::gpu_profile`]), for the planner |
//! | `oogc bench swap` | [`swap`] | host↔sim-device copies and the residency manager, beside memcpy or the link throttle |
//! | `oogc bench all` | [`all`], [`plots`] | every benchmark above (quick or full sizes): one JSON file each and PNG + SVG plots in one directory |
//! | (in `oogc bench all`) | [`timeline`] | a step timeline (compute, H2D, D2H, NVMe, optimizer lanes) from a real run's trace, and how much of the transfers and optimizer overlapped compute |
//!
//! Every benchmark returns this crate's one [`Error`] ([`error`]): the errors of the crates it
//! drives pass through unchanged, with a layer naming the stage, variant or policy that failed.
pub mod adam;
pub mod all;
pub mod checkpoint;
pub mod error;
pub mod evict;
pub mod machine;
pub mod moe;
pub mod nvme;
pub mod plan_check;
pub mod plots;
pub mod probe;
pub mod step;
pub mod swap;
pub mod timeline;

pub use error::{Error, Result};
