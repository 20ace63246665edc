//! The crate's one error type.
//!
//! Errors of the crates a benchmark drives (swapper, optimizer, prefetch, placement, models,
//! candle, the trainer, the planner, configs) pass through unchanged (`#[error(transparent)]`);
//! [`Error::Context`] adds the layer that says which benchmark, stage, variant or policy failed
//! (`bench all: nvme (check --nvme-dir)`, `policy lru`, `the resident variant`). A message reads
//! as the chain of causes, outermost first, `: `-separated ([`Error::report`], or `anyhow`'s
//! `{:#}` in the CLI).

use std::path::PathBuf;
use std::process::ExitStatus;

/// Errors of `oogc-bench`. Each message names the cause and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// What was being done (a suite stage, a benchmark variant or policy, a probe) when `source`
    /// failed.
    #[error("{what}")]
    Context {
        /// The stage, variant or step, e.g. `bench all: swap`.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<Error>,
    },

    /// A bad benchmark argument or input.
    #[error("{what} {reason}")]
    Invalid {
        /// The argument or input, e.g. `--budget-fraction 2`.
        what: String,
        /// What it must be, e.g. `must be in (0, 1]`.
        reason: String,
    },

    /// `--link-gbps` for a config whose device is not the sim device, or not a positive rate.
    #[error(
        "--link-gbps {link_gbps}: only a sim device's link can be throttled, to a positive rate ({} has device \
         `{device}`); drop the flag or use a sim config",
        config.display()
    )]
    LinkThrottle {
        /// The rate asked for, 10⁹ B/s.
        link_gbps: f64,
        /// The training config.
        config: PathBuf,
        /// Its `device.kind`.
        device: String,
    },

    /// A file or directory operation failed.
    #[error("{action} {}{}", path.display(), fix.map_or(String::new(), |f| format!(" ({f})")))]
    Io {
        /// What was done to `path`: `writing`, `creating the output directory`, ...
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The argument to check, e.g. `check --out`.
        fix: Option<&'static str>,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Host memory could not be mapped.
    #[error("mapping {bytes} bytes")]
    Mmap {
        /// Bytes asked for.
        bytes: usize,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The path of the running executable is unknown.
    #[error("the path of this executable (to run `oogc train` for the trace)")]
    CurrentExe(#[source] std::io::Error),

    /// A child `oogc train` (for the step timeline) could not be started.
    #[error("starting {} (the oogc binary) for the step trace", bin.display())]
    StartChild {
        /// The binary.
        bin: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A child `oogc train` (for the step timeline) exited with an error.
    #[error("`{command}` failed ({status}); the end of its stderr:\n{stderr_tail}")]
    ChildFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: ExitStatus,
        /// The last lines of its stderr.
        stderr_tail: String,
    },

    /// A child `oogc train` succeeded without writing the trace its config names.
    #[error("`{command}` succeeded but wrote no trace at {} (is it an oogc binary of this version?)", trace.display())]
    NoTrace {
        /// The command line.
        command: String,
        /// Where the trace should be.
        trace: PathBuf,
    },

    /// The config copy of the step timeline does not read back as the config.
    #[error("the config copy does not read back as the config (a field does not round-trip):\n{text}")]
    ConfigRoundTrip {
        /// The TOML written.
        text: String,
    },

    /// A file that is not a Chrome trace (a JSON array of events).
    #[error(
        "not a Chrome trace JSON array of events ({reason}); write one with `[output] trace = \"FILE\"` in the \
         config of `oogc train`"
    )]
    NotATrace {
        /// The JSON parser's message.
        reason: String,
    },

    /// A trace with too few steps to cut a full one out.
    #[error(
        "{starts} step start(s) found (a compute::forward after a backward): a full step needs two; record at least \
         {min_steps} steps (the first records the schedule, the last has no end), and trace with the `oogc=trace` \
         filter of `oogc train`"
    )]
    TooFewSteps {
        /// Step starts found.
        starts: usize,
        /// Steps to record for the steps asked for.
        min_steps: usize,
    },

    /// JSON could not be written or read.
    #[error("{what}")]
    Json {
        /// What was serialized or parsed.
        what: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },

    /// TOML could not be written.
    #[error("{what}")]
    Toml {
        /// What was serialized.
        what: &'static str,
        /// toml's error.
        #[source]
        source: toml::ser::Error,
    },

    /// A thread pool could not be built.
    #[error("{what}")]
    ThreadPool {
        /// Which pool.
        what: &'static str,
        /// rayon's error.
        #[source]
        source: rayon::ThreadPoolBuildError,
    },

    /// fio could not be started.
    #[error("running fio")]
    FioStart(#[source] std::io::Error),

    /// fio failed or printed something unexpected.
    #[error("{reason}")]
    Fio {
        /// What went wrong, with fio's stderr when it failed.
        reason: String,
    },

    /// plotters failed to draw.
    #[error("drawing: {reason}")]
    Draw {
        /// plotters' message.
        reason: String,
    },

    /// plotters failed to write a plot file.
    #[error("writing {} (is the directory writable?): drawing: {reason}", path.display())]
    Plot {
        /// The PNG or SVG file.
        path: PathBuf,
        /// plotters' message.
        reason: String,
    },

    /// Something the benchmark's own code expected is missing (a bug).
    #[error("{what}")]
    Internal {
        /// What was expected.
        what: &'static str,
    },

    /// The swapper failed (bad NVMe directory, io_uring refused, out of memory, ...).
    #[error(transparent)]
    Swapper(#[from] oogc_swapper::Error),

    /// The optimizer failed.
    #[error(transparent)]
    Optimizer(#[from] oogc_optimizer::Error),

    /// The prefetch crate (schedule, simulator, hardware profile) refused its input.
    #[error(transparent)]
    Prefetch(#[from] oogc_prefetch::Error),

    /// The MoE placement crate (cost model, hot set, routing) refused its input.
    #[error(transparent)]
    Placement(#[from] oogc_moe_placement::Error),

    /// The model refused its shape or failed.
    #[error(transparent)]
    Model(#[from] oogc::models::Error),

    /// candle failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A training config could not be read.
    #[error(transparent)]
    Config(#[from] oogc::config::ConfigError),

    /// The trainer failed (config, data, tiers, optimizer, checkpoint).
    #[error(transparent)]
    Train(#[from] oogc::train::TrainError),

    /// The planner refused the plan.
    #[error(transparent)]
    Plan(#[from] oogc::plan::PlanError),
}

/// The result of the benchmarks.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A bad argument: `what` (the argument and its value), then `reason`.
    pub(crate) fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { what: what.into(), reason: reason.into() }
    }

    /// A file or directory operation on `path` failed; `fix` names the argument to check.
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        fix: Option<&'static str>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { action, path, fix, source }
    }

    /// The error of another crate that a transparent variant wraps (its message is this error's
    /// message, and `source()` skips it): for callers that look for a cause by type.
    pub fn wrapped(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Swapper(e) => Some(e),
            Self::Optimizer(e) => Some(e),
            Self::Prefetch(e) => Some(e),
            Self::Placement(e) => Some(e),
            Self::Model(e) => Some(e),
            Self::Candle(e) => Some(e),
            Self::Config(e) => Some(e),
            Self::Train(e) => Some(e),
            Self::Plan(e) => Some(e),
            _ => None,
        }
    }

    /// The first cause of type `E` in this error's chain, looking inside transparent variants.
    pub fn find<E: std::error::Error + 'static>(&self) -> Option<&E> {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(c) = cause {
            if let Some(e) = c.downcast_ref::<E>() {
                return Some(e);
            }
            // A `Context`'s source is a `Box<Error>` (its own type for `downcast_ref`).
            let bench = c.downcast_ref::<Error>().or_else(|| c.downcast_ref::<Box<Error>>().map(|b| &**b));
            if let Some(e) = bench.and_then(Error::wrapped).and_then(|w| w.downcast_ref::<E>()) {
                return Some(e);
            }
            cause = c.source();
        }
        None
    }

    /// Whether the kernel refused io_uring (the swapper's `UringUnavailable`) somewhere in the
    /// chain: the NVMe benchmarks then measure the psync engine only.
    pub fn is_uring_unavailable(&self) -> bool {
        matches!(self.find::<oogc_swapper::Error>(), Some(oogc_swapper::Error::UringUnavailable { .. }))
    }

    /// The message and every cause's, `: `-separated (as `anyhow` prints an error with `{:#}`).
    pub fn report(&self) -> String {
        let mut out = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cause = c.source();
        }
        out
    }
}

/// Adds an [`Error::Context`] layer to a failure, as `anyhow::Context` did.
pub(crate) trait Context<T> {
    /// `what` was being done when this failed.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// [`Context::context`] with the text built only on failure.
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context { what: what.into(), source: Box::new(e.into()) })
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| Error::Context { what: what().into(), source: Box::new(e.into()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uring_refused() -> Result<()> {
        Err(oogc_swapper::Error::UringUnavailable { reason: "test".into() }.into())
    }

    #[test]
    fn causes_are_found_through_context_layers() {
        let e = uring_refused().context("store with engine Uring").context("bench all: nvme").unwrap_err();
        assert!(e.is_uring_unavailable());
        assert!(e.find::<oogc_swapper::Error>().is_some());
        assert!(e.find::<oogc_optimizer::Error>().is_none());
        let inner = oogc_swapper::Error::UringUnavailable { reason: "test".into() }.to_string();
        assert_eq!(e.report(), format!("bench all: nvme: store with engine Uring: {inner}"));
    }

    #[test]
    fn io_errors_name_the_path_and_the_fix() {
        let e = Error::io("writing", "/x/y.json", Some("is --out writable?"))(std::io::ErrorKind::NotFound.into());
        assert_eq!(e.to_string(), "writing /x/y.json (is --out writable?)");
        assert!(e.report().starts_with("writing /x/y.json (is --out writable?): "), "{}", e.report());
        let e = Error::io("reading the trace", "/t.json", None)(std::io::ErrorKind::NotFound.into());
        assert_eq!(e.to_string(), "reading the trace /t.json");
    }
}
