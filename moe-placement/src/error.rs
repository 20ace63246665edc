//! The crate's one error type.

use std::path::PathBuf;

/// Errors of `oogc-moe-placement`. Each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The expert budget cannot hold a single expert.
    #[error(
        "the GPU expert budget of {budget_bytes} B is smaller than one expert ({expert_bytes} B); raise the \
         expert budget to at least {expert_bytes} B (or 0 experts hot: fetch or CPU-compute every expert)"
    )]
    BudgetBelowOneExpert {
        /// The budget given, bytes.
        budget_bytes: u64,
        /// The bytes of one expert's compute copy.
        expert_bytes: u64,
    },
    /// A block or expert index outside the model's shape.
    #[error("{what} {index} is out of range: the model has {len}; check the routing input against the model shape")]
    OutOfRange {
        /// `block`, `expert` or `tokens_per_expert.len()`.
        what: &'static str,
        /// The index (or length) given.
        index: u64,
        /// The number of blocks / experts.
        len: u64,
    },
    /// A configuration or input value out of range.
    #[error("invalid `{key}`: {reason}")]
    Config {
        /// The key (field or flag) at fault.
        key: String,
        /// What is wrong and what is allowed.
        reason: String,
    },
    /// A routing trace that does not follow the `oogc-routing-1` format.
    #[error("routing trace line {line}: {reason} (format oogc-routing-1: a header object, then one `{{\"step\",\"block\",\"expert\",\"tokens\"}}` object per line)")]
    TraceFormat {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a trace failed.
    #[error("{}: {source}", path.as_ref().map_or("routing trace".to_string(), |p| p.display().to_string()))]
    Io {
        /// The file, when known.
        path: Option<PathBuf>,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn config(key: &str, reason: impl Into<String>) -> Error {
    Error::Config { key: key.to_string(), reason: reason.into() }
}

/// Checks `v` is finite and `> 0`, naming `key`.
pub(crate) fn positive(key: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(config(key, format!("{v} must be a finite number greater than 0")))
    }
}
