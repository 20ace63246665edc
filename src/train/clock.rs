//! [`ComputeClock`]: the time a step spends inside the model's calls, so that a step's wall time
//! splits into compute, exposed transfer, exposed optimizer and what is left (the runtime's and
//! the trainer's own work: `oogc bench step`'s `outside_s`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Nanoseconds spent in timed closures, shared by the trainer and its MoE state (clones count
/// into the same total). Only the trainer's thread times; the atomic makes the trainer `Send`.
#[derive(Debug, Clone, Default)]
pub(super) struct ComputeClock(Arc<AtomicU64>);

impl ComputeClock {
    /// Runs `f`, adding its wall time to the total.
    pub(super) fn time<R>(&self, f: impl FnOnce() -> R) -> R {
        let started = Instant::now();
        let r = f();
        self.0.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// The total so far, seconds, and a fresh start from 0.
    pub(super) fn take(&self) -> f64 {
        self.0.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_add_into_one_total_and_take_resets_it() {
        let clock = ComputeClock::default();
        let other = clock.clone();
        assert_eq!(clock.time(|| 7), 7);
        other.time(|| std::thread::sleep(std::time::Duration::from_millis(2)));
        let total = clock.take();
        assert!(total >= 0.002, "{total}");
        assert_eq!(other.take(), 0.0);
    }
}
