//! The crate's one error type.

use oogc_swapper::{TensorId, Tier};

/// Errors of `oogc-prefetch`. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tier's budget cannot hold what one step must hold at once.
    #[error(
        "the {tier} budget of {budget_bytes} B is below the step's minimum working set of {min_bytes} B \
         (largest unit {largest_unit_bytes} B); raise the {tier} budget to at least {min_bytes} B, or cut \
         the model into smaller units"
    )]
    BudgetBelowWorkingSet {
        /// The tier whose budget is too small.
        tier: Tier,
        /// The budget given, bytes.
        budget_bytes: u64,
        /// The minimum working set of the schedule ([`crate::min_working_set`]), bytes.
        min_bytes: u64,
        /// The largest unit accessed on the tier, bytes.
        largest_unit_bytes: u64,
    },
    /// A schedule entry names a unit whose size was not given.
    #[error("unit {unit} appears in the schedule but has no size; give every unit's size in bytes")]
    UnknownUnit {
        /// The unit (the swapper tensor of its compute copy).
        unit: TensorId,
    },
    /// A schedule without any device-tier access: nothing to order.
    #[error("the schedule has no device-tier access; record a step that acquires its units on the device")]
    EmptySchedule,
    /// A configuration or input value out of range.
    #[error("invalid `{key}`: {reason}")]
    Config {
        /// The key (field or flag) at fault.
        key: String,
        /// What is wrong and what is allowed.
        reason: String,
    },
    /// The simulator could not make progress (a bug, or an input the budget check missed).
    #[error("simulation stuck at {time_s:.6} s on unit {unit}: {reason}; raise the device budget")]
    Stuck {
        /// Simulated time, seconds.
        time_s: f64,
        /// The unit that could not be placed.
        unit: TensorId,
        /// Why.
        reason: String,
    },
    /// An error from the swapper (prefetch driver).
    #[error(transparent)]
    Swapper(#[from] oogc_swapper::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
