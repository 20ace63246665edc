//! One host budget, kept honestly: the [`HostLedger`] every host allocation of the runtime is
//! claimed from before it is made, under a category label ([`HostUse`]), with the bytes in use
//! and their peak per category.
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | ledger | [`HostLedger`] | the budget (bytes), and per category the bytes claimed now and their peak |
//! | category | [`HostUse`] | what the bytes are for: compute copies, optimizer state, speculation, NVMe streams, gradients, activations, checkpoint staging |
//! | claim | [`HostClaim`] | bytes taken from the ledger; given back when dropped |
//! | report | [`HostLedgerReport`] | a copy of the figures, serde-serializable, for summaries and logs |
//!
//! A claim that would take the ledger's total above its budget is refused with
//! [`Error::HostBudget`] naming the category, so the allocation it was for is never made. The
//! claimants: the residency manager's host tier (through its [`crate::PinnedPool`], which claims
//! when it takes memory from the OS and gives it back when it returns it, so cached free buffers
//! count too), the optimizer's state, speculation and stream buffers, and the runtime's gradient
//! staging and the gradients the optimizer holds, and the trainer's checkpoint staging. How the budget is shared between them is the
//! caller's plan (the runtime's `HostPlan`); the ledger enforces and measures.

use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What host bytes are for: the categories of the [`HostLedger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostUse {
    /// Compute copies in pinned host memory: their home (parameters on the host) or the cache
    /// of their NVMe home, NVMe → host prefetches, and the host pool's cached free buffers.
    ComputeCopies,
    /// fp32 master weights and Adam `m`, `v` of units whose state lives in host memory
    /// (12 B per parameter), with their gradient-norm partials.
    OptimizerState,
    /// Second buffers of speculated units: the new compute copy, and for host-placed state a
    /// second `p`, `m`, `v`.
    Speculation,
    /// The optimizer's NVMe stream buffers (three chunk buffers per stream in flight).
    NvmeStream,
    /// Gradients: the pinned buffers their D2H copies land in, and the gradients the optimizer
    /// holds until the step's update is final.
    Gradients,
    /// Activations (checkpointed inputs) kept in host memory. Nothing claims it yet: the hook
    /// for `[activations] offload`.
    Activations,
    /// A checkpoint's staging: one unit's master weights and Adam state at a time, read from
    /// wherever they live while a checkpoint is saved (or restored while one is loaded), and the
    /// writer's buffer.
    Checkpoint,
}

impl HostUse {
    /// Every category, in report order.
    pub const ALL: [HostUse; 7] = [
        HostUse::ComputeCopies,
        HostUse::OptimizerState,
        HostUse::Speculation,
        HostUse::NvmeStream,
        HostUse::Gradients,
        HostUse::Activations,
        HostUse::Checkpoint,
    ];

    /// The snake_case name, as in reports (`compute_copies`, ...).
    pub fn name(self) -> &'static str {
        match self {
            HostUse::ComputeCopies => "compute_copies",
            HostUse::OptimizerState => "optimizer_state",
            HostUse::Speculation => "speculation",
            HostUse::NvmeStream => "nvme_stream",
            HostUse::Gradients => "gradients",
            HostUse::Activations => "activations",
            HostUse::Checkpoint => "checkpoint",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for HostUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

const N: usize = HostUse::ALL.len();

#[derive(Debug, Default)]
struct Figures {
    used: [u64; N],
    peak: [u64; N],
    total: u64,
    peak_total: u64,
}

/// The host budget and what is claimed from it: see the [module docs](self).
///
/// `Send + Sync`; share it with `Arc` (claims hold one).
#[derive(Debug)]
pub struct HostLedger {
    budget_bytes: u64,
    figures: Mutex<Figures>,
}

impl HostLedger {
    /// A ledger of `budget_bytes`.
    pub fn new(budget_bytes: u64) -> Arc<Self> {
        Arc::new(Self { budget_bytes, figures: Mutex::new(Figures::default()) })
    }

    /// A ledger without a limit, for components used on their own (tests, benchmarks): it still
    /// measures, never refuses.
    pub fn unlimited() -> Arc<Self> {
        Self::new(u64::MAX)
    }

    /// The budget, bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Bytes claimed now, all categories.
    pub fn used_bytes(&self) -> u64 {
        self.figures.lock().total
    }

    /// Bytes claimed now for `use_`.
    pub fn used_bytes_of(&self, use_: HostUse) -> u64 {
        self.figures.lock().used[use_.index()]
    }

    /// The budget less the bytes claimed now.
    pub fn available_bytes(&self) -> u64 {
        self.budget_bytes.saturating_sub(self.used_bytes())
    }

    /// Highest total claimed at once since the ledger was made.
    pub fn peak_bytes(&self) -> u64 {
        self.figures.lock().peak_total
    }

    /// Claims `bytes` for `use_`, before the allocation they are for is made.
    ///
    /// # Errors
    /// [`Error::HostBudget`] (nothing claimed) when the claim would take the total above the
    /// budget.
    pub fn claim(self: &Arc<Self>, use_: HostUse, bytes: u64) -> Result<HostClaim> {
        let mut f = self.figures.lock();
        let total = f.total.saturating_add(bytes);
        if total > self.budget_bytes {
            return Err(Error::HostBudget {
                category: use_,
                requested_bytes: bytes,
                available_bytes: self.budget_bytes.saturating_sub(f.total),
                budget_bytes: self.budget_bytes,
            });
        }
        let i = use_.index();
        f.total = total;
        f.used[i] += bytes;
        f.peak[i] = f.peak[i].max(f.used[i]);
        f.peak_total = f.peak_total.max(total);
        Ok(HostClaim { ledger: Some(self.clone()), use_, bytes })
    }

    fn release(&self, use_: HostUse, bytes: u64) {
        let mut f = self.figures.lock();
        let i = use_.index();
        debug_assert!(f.used[i] >= bytes, "{use_}: releasing {bytes} of {} bytes", f.used[i]);
        f.used[i] = f.used[i].saturating_sub(bytes);
        f.total = f.total.saturating_sub(bytes);
    }

    /// A copy of the figures.
    pub fn report(&self) -> HostLedgerReport {
        let f = self.figures.lock();
        HostLedgerReport {
            budget_bytes: self.budget_bytes,
            used_bytes: f.total,
            peak_bytes: f.peak_total,
            categories: HostUse::ALL
                .iter()
                .map(|&u| CategoryFigures { category: u, used_bytes: f.used[u.index()], peak_bytes: f.peak[u.index()] })
                .collect(),
        }
    }
}

/// Bytes claimed from a [`HostLedger`] for one [`HostUse`]; dropping it gives them back.
#[derive(Debug)]
pub struct HostClaim {
    ledger: Option<Arc<HostLedger>>,
    use_: HostUse,
    bytes: u64,
}

impl HostClaim {
    /// A claim of nothing (for code paths that hold a claim only sometimes).
    pub fn none(use_: HostUse) -> Self {
        Self { ledger: None, use_, bytes: 0 }
    }

    /// Bytes claimed.
    pub fn num_bytes(&self) -> u64 {
        self.bytes
    }

    /// The category.
    pub fn category(&self) -> HostUse {
        self.use_
    }

    /// Adds `other` (of the same ledger and category) to this claim.
    ///
    /// # Panics
    /// If the categories differ.
    pub fn merge(&mut self, mut other: HostClaim) {
        assert_eq!(self.use_, other.use_, "claims of different categories");
        if self.ledger.is_none() {
            self.ledger = other.ledger.take();
        } else {
            other.ledger = None;
        }
        self.bytes += std::mem::take(&mut other.bytes);
    }
}

impl Drop for HostClaim {
    fn drop(&mut self) {
        if let Some(l) = self.ledger.take() {
            if self.bytes > 0 {
                l.release(self.use_, self.bytes);
            }
        }
    }
}

/// One category's figures in a [`HostLedgerReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CategoryFigures {
    /// The category.
    pub category: HostUse,
    /// Bytes claimed now.
    pub used_bytes: u64,
    /// Highest bytes claimed at once.
    pub peak_bytes: u64,
}

/// The figures of a [`HostLedger`] at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostLedgerReport {
    /// The budget, bytes.
    pub budget_bytes: u64,
    /// Bytes claimed now, all categories.
    pub used_bytes: u64,
    /// Highest total claimed at once.
    pub peak_bytes: u64,
    /// Per category, in [`HostUse::ALL`] order.
    pub categories: Vec<CategoryFigures>,
}

impl HostLedgerReport {
    /// The figures of `use_`.
    pub fn of(&self, use_: HostUse) -> CategoryFigures {
        self.categories[use_.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_refused_above_the_budget_and_given_back_on_drop() {
        let l = HostLedger::new(100);
        let a = l.claim(HostUse::OptimizerState, 60).unwrap();
        let b = l.claim(HostUse::Gradients, 40).unwrap();
        match l.claim(HostUse::Speculation, 1) {
            Err(Error::HostBudget {
                category: HostUse::Speculation, requested_bytes: 1, available_bytes: 0, ..
            }) => {}
            other => panic!("expected HostBudget, got {other:?}"),
        }
        assert_eq!(l.used_bytes(), 100);
        drop(a);
        assert_eq!(l.used_bytes(), 40);
        let mut c = l.claim(HostUse::Gradients, 10).unwrap();
        c.merge(l.claim(HostUse::Gradients, 5).unwrap());
        assert_eq!(c.num_bytes(), 15);
        assert_eq!(l.used_bytes_of(HostUse::Gradients), 55);
        drop((b, c));
        let r = l.report();
        assert_eq!((r.used_bytes, r.peak_bytes), (0, 100));
        assert_eq!(r.of(HostUse::Gradients).peak_bytes, 55);
        assert_eq!(r.of(HostUse::OptimizerState).peak_bytes, 60);
    }
}
