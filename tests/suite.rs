//! The trainer's end-to-end tests in one test binary: each file beside this one is a module
//! (`tests/train.rs` is `suite::train`, and so on). One binary compiles and links the trainer's
//! tests once, and its harness runs the long ones (the bf16 tracking run, the fragmentation run)
//! side by side instead of one binary after another.
//!
//! Run one file's tests with a filter: `cargo test -p oogc --test suite -- bf16_tracking::`.
//! The tests that own something process-wide keep their own binaries (`[[test]]` in
//! `Cargo.toml`; `autotests = false`): `tests/ordering.rs` flips the ordering hooks' environment
//! variable, `tests/device_plan.rs` counts every allocation through its global allocator,
//! `tests/configs.rs` bounds the process's RSS growth while it plans, and `tests/ranks.rs` is the
//! MPI ranks test; `tests/tidy.rs` too.

mod common;
mod fixtures;
mod reference;

mod bf16;
mod bf16_tracking;
mod budgets;
mod dense_among_sparse;
mod device_optimizer;
mod llama;
mod mixtral;
mod moe_bf16;
mod runtime;
mod state_dtype;
mod train;
