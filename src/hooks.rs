//! Test hooks: environment variables that crash or pause a process at a named point, so the
//! fault-injection soak (`cli/tests/soak.rs`, `scripts/soak.sh`) can kill a run exactly inside
//! a checkpoint write. They are for tests only; an unset variable costs one lookup per process.
//!
//! | variable | effect |
//! |---|---|
//! | `OOGC_CRASH_AT=<point>:<n>` | the `n`-th time (1-based) this process reaches `<point>`, it aborts (SIGABRT, no core file): as abrupt as SIGKILL |
//! | `OOGC_PAUSE_AT=<point>:<ms>` | every time this process reaches `<point>`, it sleeps `ms` milliseconds (a wide window for an outside SIGKILL) |
//! | `OOGC_NAN_GRADS=<step>` | the trainer makes the head's gradients NaN at step `<step>` in this process (under `mpirun`, on the ranks whose environment has it): the step must be skipped on every rank |
//! | `OOGC_DROP_ORDERING=<call>` | runtimes built from then on leave out one ordering call between compute and copies (`<call>` is an [`OrderingCall`](crate::runtime::OrderingCall) name, e.g. `grads.dtoh_after_write`: each gradient's D2H ordered after an event that covers no compute, what a forgotten event does on a GPU); the sim device's happens-before checker must catch it (`tests/ordering.rs` leaves out each call in turn) |
//!
//! Points: `checkpoint` — half-way through writing a checkpoint's temp file (before its fsync and
//! rename); `step` — the start of each training step (`Trainer::train_step`). The NVMe store has its own hook, `OOGC_FAULT_NVME` (`oogc_swapper::FaultPlan`), that
//! fails or aborts inside a store write.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// `OOGC_CRASH_AT`: `<point>:<n>`.
pub const CRASH_ENV: &str = "OOGC_CRASH_AT";
/// `OOGC_PAUSE_AT`: `<point>:<ms>`.
pub const PAUSE_ENV: &str = "OOGC_PAUSE_AT";
/// `OOGC_DROP_ORDERING`: `<call>`.
pub const DROP_ORDERING_ENV: &str = "OOGC_DROP_ORDERING";

/// `OOGC_NAN_GRADS`: `<step>`.
pub const NAN_GRADS_ENV: &str = "OOGC_NAN_GRADS";

/// Whether `OOGC_NAN_GRADS` names `step` (the trainer then poisons that step's head gradients
/// in this process). Read once per process.
pub fn nan_grads_at(step: u64) -> bool {
    static STEP: OnceLock<Option<u64>> = OnceLock::new();
    *STEP.get_or_init(|| std::env::var(NAN_GRADS_ENV).ok().and_then(|s| s.parse().ok())) == Some(step)
}

/// The ordering call `OOGC_DROP_ORDERING` names, if set (a negative control for the sim
/// device's happens-before checker: a runtime built now leaves that call out). Read each time a
/// runtime is built, so one test process can leave out each call in turn.
pub fn dropped_ordering() -> Option<String> {
    std::env::var(DROP_ORDERING_ENV).ok().filter(|s| !s.is_empty())
}

fn parse(var: &str) -> Option<(String, u64)> {
    let value = std::env::var(var).ok()?;
    let parsed = value.rsplit_once(':').and_then(|(p, n)| Some((p.to_string(), n.parse().ok()?)));
    if parsed.is_none() {
        tracing::warn!("{var}={value} is not `<point>:<number>`: ignored");
    }
    parsed
}

/// Aborts the process when `OOGC_CRASH_AT` names `point` and this is its `n`-th visit.
pub fn crash_point(point: &str) {
    static SPEC: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static VISITS: OnceLock<Mutex<HashMap<String, u64>>> = OnceLock::new();
    let Some((p, n)) = SPEC.get_or_init(|| parse(CRASH_ENV)) else { return };
    if p != point {
        return;
    }
    let mut visits = VISITS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let count = visits.entry(point.to_string()).or_default();
    *count += 1;
    if *count == *n {
        abort_now(&format!("{CRASH_ENV}={point}:{n}"));
    }
}

/// Sleeps when `OOGC_PAUSE_AT` names `point`.
pub fn pause_point(point: &str) {
    static SPEC: OnceLock<Option<(String, u64)>> = OnceLock::new();
    if let Some((p, ms)) = SPEC.get_or_init(|| parse(PAUSE_ENV)) {
        if p == point {
            std::thread::sleep(std::time::Duration::from_millis(*ms));
        }
    }
}

/// Aborts at once, without a core file, after saying why on stderr.
pub fn abort_now(why: &str) -> ! {
    eprintln!("test hook {why}: aborting the process");
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let maximum = getrlimit(Resource::Core).maximum;
    let _ = setrlimit(Resource::Core, Rlimit { current: Some(0), maximum });
    std::process::abort()
}
