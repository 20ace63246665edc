//! What can go wrong in the runtime: [`RuntimeError`], each variant naming its cause and, where the
//! caller can fix it, the fix; and the module's [`Result`].

use std::path::PathBuf;

/// What can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The swapper failed (out of memory, I/O, corrupt NVMe block, no CUDA device...).
    #[error(transparent)]
    Swapper(#[from] oogc_swapper::Error),
    /// The optimizer failed.
    #[error(transparent)]
    Optimizer(#[from] oogc_optimizer::Error),
    /// The prefetch planner refused the budgets or the schedule.
    #[error(transparent)]
    Prefetch(#[from] oogc_prefetch::Error),
    /// candle failed while wrapping or reading a tensor.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The GPU budget cannot hold what one step must hold at once.
    #[error(
        "GPU budget of {budget_bytes} bytes is below the minimum working set of {min_bytes} bytes \
         (largest unit(s) in use at once plus gradient staging)\n  fix: raise [budgets] gpu to at least {min_bytes} bytes"
    )]
    BudgetBelowWorkingSet {
        /// The configured GPU budget.
        budget_bytes: u64,
        /// The minimum.
        min_bytes: u64,
    },
    /// The host budget cannot hold what the run must hold at once.
    #[error(
        "host budget of {budget_bytes} bytes is below the {min_bytes} bytes this run needs at least ({parts})\n  \
         fix: raise [budgets] host to at least {min_bytes} bytes, or put the optimizer state and/or the parameters \
         on NVMe ([budgets] optimizer_state / params = \"nvme\")"
    )]
    HostBudgetBelowMinimum {
        /// The configured host budget.
        budget_bytes: u64,
        /// The minimum.
        min_bytes: u64,
        /// The minimum's parts by category.
        parts: String,
    },
    /// The NVMe store cannot be made as large as the run needs.
    #[error("NVMe store in {path}: {needed_bytes} bytes needed, {available_bytes} available\n  fix: {fix}")]
    NvmeTooSmall {
        /// The directory (or the first one).
        path: PathBuf,
        /// Bytes needed there.
        needed_bytes: u64,
        /// Bytes available (free space, or the configured size).
        available_bytes: u64,
        /// How to fix it.
        fix: String,
    },
    /// A call out of order or with a wrong argument.
    #[error("runtime misuse: {0}")]
    Usage(String),
    /// A collective between the data-parallel ranks failed, or the ranks are not a world: the
    /// run cannot go on (the entry point ends it).
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
}

/// Result of runtime operations.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
