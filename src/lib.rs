//! `oogc`: an out-of-GPU-core training runtime.
//!
//! The facade crate: it re-exports the component crates and holds the CLI's commands.
//!
//! | crate | owns |
//! |---|---|
//! | [`swapper`] | tiers (GPU, pinned host, NVMe), residency manager, transfers, metrics |
//! | [`optimizer`] | CPU optimizers (later issue) |
//! | [`prefetch`] | schedule, next-use eviction, lookahead prefetch, simulator (later issue) |
//! | [`moe_placement`] | expert placement (later issue) |
#![deny(unsafe_code)]

pub use oogc_moe_placement as moe_placement;
pub use oogc_optimizer as optimizer;
pub use oogc_prefetch as prefetch;
pub use oogc_swapper as swapper;

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod model;
pub mod plan;
pub mod run;
pub mod runtime;
pub mod train;
