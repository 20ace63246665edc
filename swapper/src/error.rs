//! The swapper's one error type.

use std::path::PathBuf;

use crate::device::OrderingHazard;
use crate::tier::{TensorId, Tier};

/// Errors of the swapper. Each variant names the cause and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tier cannot hold the bytes asked for, even after evicting every tensor it may evict.
    #[error(
        "out of memory on the {tier} tier: {requested_bytes} bytes requested, {available_bytes} \
         available; raise the {tier} budget or shrink the working set (pinned tensors cannot be evicted)"
    )]
    OutOfMemory {
        /// The tier that is full.
        tier: Tier,
        /// Bytes the request needed.
        requested_bytes: u64,
        /// Bytes that could be made free (free + evictable) when the request failed.
        available_bytes: u64,
    },

    /// A host allocation would take the host ledger above `[budgets] host`.
    #[error(
        "host budget exceeded: {requested_bytes} bytes of {category} requested, {available_bytes} of the \
         {budget_bytes}-byte host budget left; raise [budgets] host (or lower what the run holds in host memory)"
    )]
    HostBudget {
        /// What the bytes were for.
        category: crate::ledger::HostUse,
        /// Bytes the claim asked for.
        requested_bytes: u64,
        /// Bytes left in the budget when the claim was refused.
        available_bytes: u64,
        /// The budget, bytes.
        budget_bytes: u64,
    },

    /// The binary was built without the `cuda` feature.
    #[error("CUDA support is not compiled in: rebuild with `cargo build --features cuda`, or use the sim device")]
    NotCompiledWithCuda,

    /// Built with CUDA, but no usable driver or device was found.
    #[error("no CUDA device: {reason}; use the sim device (`device = \"sim\"`) on a machine without a GPU")]
    NoCudaDevice {
        /// What was missing (driver library, device ordinal, ...).
        reason: String,
    },

    /// A CUDA driver call failed.
    #[error("CUDA driver error in {op}: {message}")]
    Cuda {
        /// The operation that failed (`htod`, `alloc`, ...).
        op: &'static str,
        /// The driver's message.
        message: String,
    },

    /// The sim device's happens-before checker found an operation CUDA would race on: a copy,
    /// free or compute access not ordered after what it must follow (see
    /// [`crate::device::ordering`]).
    #[error(
        "ordering violation: {hazard} (sim buffer #{buffer}, {num_bytes} bytes: it had to follow {} #{needed}, \
         was ordered after #{ordered}); fix: {}",
        .hazard.needs(),
        .hazard.fix()
    )]
    Ordering {
        /// The rule broken, naming the operation.
        hazard: OrderingHazard,
        /// The buffer's number on its device (allocation order, from 1).
        buffer: u64,
        /// The buffer's size in bytes.
        num_bytes: u64,
        /// The compute position (or, for [`OrderingHazard::ComputeBeforeHtod`], the copy id)
        /// the operation had to be ordered after.
        needed: u64,
        /// The position (or copy id) it was ordered after.
        ordered: u64,
    },

    /// The device backend stopped (its copy engine is gone) or was given an invalid request.
    #[error("device error: {0}")]
    Device(String),

    /// An NVMe directory cannot be used: missing, not a directory, read-only, or too small.
    #[error("NVMe directory {path}: {reason} (the store needs {needed_bytes} bytes there)")]
    NvmeDir {
        /// The directory.
        path: PathBuf,
        /// Bytes the store needs in it.
        needed_bytes: u64,
        /// Why it cannot be used, with the fix.
        reason: String,
    },

    /// An I/O call on a store file failed.
    #[error("I/O error on {path} at offset {offset} ({len} bytes): {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Byte offset in the file.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// Bytes read back from the NVMe tier do not match their checksum.
    #[error(
        "corrupt data for tensor {tensor}: checksum mismatch in the block at offset {offset} of {path} \
         (expected crc32c {expected:#010x}, read {actual:#010x}); the store file was changed or the disk is failing"
    )]
    Corrupt {
        /// The tensor whose extent is corrupt.
        tensor: TensorId,
        /// The store file.
        path: PathBuf,
        /// Byte offset of the corrupt block in the file.
        offset: u64,
        /// The checksum recorded when the block was written.
        expected: u32,
        /// The checksum of the bytes read.
        actual: u32,
    },

    /// io_uring was asked for explicitly but cannot be used here.
    #[error("io_uring is unavailable: {reason}; use `engine = \"psync\"` (or `auto`)")]
    UringUnavailable {
        /// Why (kernel too old, seccomp, io_uring_disabled, ...).
        reason: String,
    },

    /// A tensor id that was never registered.
    #[error("unknown tensor {0}: register it first")]
    UnknownTensor(TensorId),

    /// A tensor id registered twice.
    #[error("tensor {0} is already registered")]
    DuplicateTensor(TensorId),

    /// A request that does not fit the tensor or tier (wrong length, tier without a backend, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// A configuration value is out of range.
    #[error("invalid config `{key}`: {reason}")]
    Config {
        /// The key, as written in the config.
        key: String,
        /// Why, with the accepted range.
        reason: String,
    },
}

/// The swapper's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
