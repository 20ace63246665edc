//! Fault injection behind the `IoEngine` seam (a test hook): the crate-private `FaultyEngine`
//! wraps the real engine and fails chosen requests with an injected `io::Error`, or aborts the
//! process in the middle of one, so tests can show that a failing disk loses nothing and that a
//! run killed inside an NVMe write resumes exactly.
//!
//! | plan | effect |
//! |---|---|
//! | `write:17` | the 17th write request (1-based, counted per store) fails with `EIO`; nothing of it is written |
//! | `write:17+` | every write request from the 17th on fails |
//! | `read:5`, `read:5+` | the same for reads |
//! | `abort-write:17` | the 17th write request writes its first half, then the process aborts (SIGABRT, no core file) |
//!
//! [`NvmeStore::open`](super::NvmeStore::open) takes a plan from the environment variable
//! `OOGC_FAULT_NVME` (so the `oogc` binary can be driven from a test); tests in-process use
//! [`NvmeStore::open_with_faults`](super::NvmeStore::open_with_faults).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::Arc;

use super::engine::{io_error, Completion, IoEngine, IoRequest, Op, StoreFile};
use super::EngineKind;
use crate::error::{Error, Result};

/// Environment variable read by [`NvmeStore::open`](super::NvmeStore::open): a [`FaultPlan`] in
/// the syntax of [`FaultPlan::parse`]. A test hook; never set it in production.
pub const FAULT_ENV: &str = "OOGC_FAULT_NVME";

/// Which requests fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTrigger {
    /// Only the n-th (1-based).
    Nth(u64),
    /// The n-th and every later one.
    From(u64),
}

impl FaultTrigger {
    fn hits(self, count: u64) -> bool {
        match self {
            FaultTrigger::Nth(n) => count == n,
            FaultTrigger::From(n) => count >= n,
        }
    }
}

/// What happens to a chosen request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// It fails with an injected `io::Error` (EIO) before any byte moves.
    Fail,
    /// It moves about half its bytes (writes only), then the process aborts.
    Abort,
}

/// A fault to inject: which direction, which requests, what happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    /// Reads or writes ([`FaultPlan::parse`] accepts `read` and `write`).
    pub on_write: bool,
    /// Which requests of that direction.
    pub trigger: FaultTrigger,
    /// What happens to them.
    pub action: FaultAction,
}

impl FaultPlan {
    /// Fail the n-th write.
    pub fn fail_write(n: u64) -> Self {
        Self { on_write: true, trigger: FaultTrigger::Nth(n), action: FaultAction::Fail }
    }

    /// Fail every write from the n-th on.
    pub fn fail_writes_from(n: u64) -> Self {
        Self { on_write: true, trigger: FaultTrigger::From(n), action: FaultAction::Fail }
    }

    /// Fail the n-th read.
    pub fn fail_read(n: u64) -> Self {
        Self { on_write: false, trigger: FaultTrigger::Nth(n), action: FaultAction::Fail }
    }

    /// Parses `write:N`, `write:N+`, `read:N`, `read:N+` or `abort-write:N` (module docs).
    ///
    /// # Errors
    /// [`Error::Config`] naming `OOGC_FAULT_NVME` and the accepted forms.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || Error::Config {
            key: FAULT_ENV.into(),
            reason: format!("`{s}`: use write:N, write:N+, read:N, read:N+ or abort-write:N (N ≥ 1)"),
        };
        let (what, n) = s.trim().split_once(':').ok_or_else(bad)?;
        let (n, from) = match n.strip_suffix('+') {
            Some(n) => (n, true),
            None => (n, false),
        };
        let n: u64 = n.parse().ok().filter(|&n| n >= 1).ok_or_else(bad)?;
        let trigger = if from { FaultTrigger::From(n) } else { FaultTrigger::Nth(n) };
        let (on_write, action) = match what {
            "write" => (true, FaultAction::Fail),
            "read" => (false, FaultAction::Fail),
            "abort-write" if !from => (true, FaultAction::Abort),
            _ => return Err(bad()),
        };
        Ok(Self { on_write, trigger, action })
    }

    /// The plan in `OOGC_FAULT_NVME`, if set.
    ///
    /// # Errors
    /// As [`FaultPlan::parse`].
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(FAULT_ENV) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v).map(Some),
            _ => Ok(None),
        }
    }
}

/// The engine wrapper: counts requests per direction and applies the plan.
pub(crate) struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    files: Arc<[StoreFile]>,
    plan: FaultPlan,
    reads: AtomicU64,
    writes: AtomicU64,
}

impl FaultyEngine {
    pub(crate) fn new(inner: Box<dyn IoEngine>, files: Arc<[StoreFile]>, plan: FaultPlan) -> Self {
        tracing::warn!(?plan, "NVMe fault injection is on ({FAULT_ENV} or a test): chosen requests will fail");
        Self { inner, files, plan, reads: AtomicU64::new(0), writes: AtomicU64::new(0) }
    }
}

impl IoEngine for FaultyEngine {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn submit(&self, mut req: IoRequest) {
        let is_write = req.op == Op::Write;
        let counter = if is_write { &self.writes } else { &self.reads };
        let count = counter.fetch_add(1, Ordering::Relaxed) + 1;
        if is_write != self.plan.on_write || !self.plan.trigger.hits(count) {
            return self.inner.submit(req);
        }
        match self.plan.action {
            FaultAction::Fail => {
                let what = if is_write { "write" } else { "read" };
                let source = io::Error::other(format!("injected fault: {FAULT_ENV} fails {what} request {count}"));
                let error = match req.segments.first().filter(|s| s.file < self.files.len()) {
                    Some(s) => io_error(&self.files[s.file], s.file_offset, s.len, source),
                    None => Error::Device(source.to_string()),
                };
                (req.done)(Completion { result: Err(error), buf: req.buf });
            }
            FaultAction::Abort => {
                // Write the first half of the segments for real, then abort: a torn extent.
                let keep = req.segments.len().div_ceil(2);
                req.segments.truncate(keep.max(1));
                let (tx, rx) = crossbeam_channel::bounded(1);
                req.done = Box::new(move |c: Completion| {
                    let _ = tx.send(c.result.is_ok());
                });
                self.inner.submit(req);
                let _ = rx.recv();
                eprintln!("test hook {FAULT_ENV}=abort-write:{count}: aborting inside an NVMe write");
                use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
                let maximum = getrlimit(Resource::Core).maximum;
                let _ = setrlimit(Resource::Core, Rlimit { current: Some(0), maximum });
                std::process::abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_bad_ones_name_the_variable() {
        assert_eq!(FaultPlan::parse("write:17").unwrap(), FaultPlan::fail_write(17));
        assert_eq!(FaultPlan::parse("write:17+").unwrap(), FaultPlan::fail_writes_from(17));
        assert_eq!(FaultPlan::parse("read:2").unwrap(), FaultPlan::fail_read(2));
        let abort = FaultPlan::parse("abort-write:3").unwrap();
        assert_eq!((abort.on_write, abort.action), (true, FaultAction::Abort));
        for bad in ["write", "write:0", "write:x", "erase:3", "abort-write:3+"] {
            let e = FaultPlan::parse(bad).unwrap_err().to_string();
            assert!(e.contains(FAULT_ENV) && e.contains("write:N"), "{bad}: {e}");
        }
    }
}
