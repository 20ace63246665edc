//! The crate's one error type.

use oogc_swapper::TensorId;

use crate::simd::Isa;

/// Everything that can go wrong in `oogc-optimizer`. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of range.
    #[error("optimizer config `{key}`: {reason}")]
    Config {
        /// The key, as in the TOML config (`optimizer.threads`, `optimizer.adam.beta1`, ...).
        key: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
    /// A dispatch path was forced that this CPU lacks.
    #[error("instruction set `{isa}` is not available on this CPU; use Isa::detect() or one of Isa::available()")]
    IsaUnavailable {
        /// The path asked for.
        isa: Isa,
    },
    /// Two buffers that must have one length do not.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// Which buffer, and of which unit (`unit #3 gradients`, `m`).
        what: String,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// A unit id that was never added.
    #[error("unit {unit} is not known to the optimizer; call add_unit first")]
    UnknownUnit {
        /// The unit.
        unit: TensorId,
    },
    /// A unit id added twice.
    #[error("unit {unit} was already added; unit ids must be unique")]
    DuplicateUnit {
        /// The unit.
        unit: TensorId,
    },
    /// A unit's gradients hold NaN or ±inf under [`crate::NonFinite::Stop`]: the unit was not
    /// updated; units updated before it in the step keep their update.
    #[error(
        "step {step}: unit {unit}'s gradients are not finite (sum of squares {sumsq}); the unit was not updated, \
         units updated before it in this step were (optimizer.nonfinite = \"stop\"): resume from the last \
         checkpoint with a lower learning rate, or set nonfinite = \"skip\" to skip such steps"
    )]
    NonFiniteGradient {
        /// The step (1-based).
        step: u64,
        /// The unit.
        unit: TensorId,
        /// The gradients' sum of squares (NaN or inf).
        sumsq: f64,
    },
    /// The [`crate::NormReduce`] failed (a collective between ranks): the step was rolled back
    /// for every unit.
    #[error("step {step}: making the global norm the run's failed: {reason}; the step was rolled back")]
    NormReduce {
        /// The step (1-based).
        step: u64,
        /// The reduction's failure.
        reason: String,
    },
    /// A call out of order (`submit` without `begin_step`, two `submit`s of one unit in a step, ...).
    #[error("{0}")]
    Protocol(String),
    /// NVMe placement asked for, but the optimizer was built without a store.
    #[error("unit {unit} asks for NVMe-placed state but the optimizer has no NvmeStore; pass one to PipelinedOptimizer::new or use StatePlacement::Host")]
    NoNvmeStore {
        /// The unit.
        unit: TensorId,
    },
    /// The swapper failed (NVMe I/O, corrupt extent, host pool budget).
    #[error("unit {unit}: {source}")]
    Swapper {
        /// The unit whose state was moving.
        unit: TensorId,
        /// The swapper's error (names file, offset, budget).
        #[source]
        source: oogc_swapper::Error,
    },
    /// The worker thread pool could not be built.
    #[error("building the optimizer thread pool of {threads} threads failed: {reason}")]
    ThreadPool {
        /// Threads asked for.
        threads: usize,
        /// rayon's message.
        reason: String,
    },
    /// A worker panicked while updating a unit (a bug); the unit's committed state is intact.
    #[error("the update of unit {unit} panicked: {message}")]
    WorkerPanic {
        /// The unit.
        unit: TensorId,
        /// The panic payload, when it is a string.
        message: String,
    },
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
