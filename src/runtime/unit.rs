//! One registered unit's state in the runtime ([`Unit`]): its size, whether it is in the
//! recorded schedule, and where its optimizer update stands ([`Update`]); and the guard a
//! fetch returns ([`UnitParams`]).

use std::sync::Arc;

use oogc_optimizer::UpdateHandle;
use oogc_prefetch::TraceRecorder;
use oogc_swapper::{Resident, Tier};
use parking_lot::Mutex;

use super::UnitId;

/// Whether a unit's uses are part of the recorded schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scheduling {
    /// Fetched in the same order every step: recorded, prefetched, ranked by next use.
    Scheduled,
    /// Used as data decides (MoE experts): not recorded, not prefetched, ranked by the fallback
    /// eviction policy.
    Unscheduled,
}

/// Where a unit's optimizer update stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Update {
    /// No update outstanding: the tiers hold the unit's current compute copy.
    Current,
    /// Gradients pushed in the step still running: the tiers hold the copy this step must use
    /// (the unit's own later fetches in the step see the old parameters).
    Pushed,
    /// The step that pushed them finished: the update is final once the optimizer is done with
    /// it, and its compute copy is published to the host copy before the unit's next use.
    StepFinished,
}

/// A registered unit.
#[derive(Debug)]
pub(super) struct Unit {
    pub(super) name: String,
    /// Parameters (elements of the flat vector).
    pub(super) numel: usize,
    pub(super) scheduling: Scheduling,
    pub(super) update: Update,
    /// The handle of the unit's latest submitted update (tells whether it is done without
    /// waiting).
    pub(super) handle: Option<UpdateHandle>,
}

impl Unit {
    pub(super) fn new(name: &str, numel: usize) -> Self {
        Self { name: name.to_string(), numel, scheduling: Scheduling::Scheduled, update: Update::Current, handle: None }
    }

    /// Bytes of the f32 compute copy.
    pub(super) fn bytes(&self) -> u64 {
        self.numel as u64 * 4
    }

    /// Whether its compute copy can be published now without waiting.
    pub(super) fn ready_to_publish(&self) -> bool {
        self.update == Update::StepFinished && self.handle.as_ref().is_some_and(|h| h.is_ready())
    }
}

/// A unit pinned for compute: its parameters as one flat candle tensor (`[numel]`, f32).
/// Dropping it releases the unit (it may then be evicted).
pub struct UnitParams {
    pub(super) tensor: candle_core::Tensor,
    pub(super) _pin: Resident,
    pub(super) unit: UnitId,
    /// The step's trace, which records the release (scheduled device fetches only).
    pub(super) recorder: Option<Arc<Mutex<TraceRecorder>>>,
}

impl Drop for UnitParams {
    fn drop(&mut self) {
        if let Some(r) = &self.recorder {
            r.lock().release(self.unit.tensor(), Tier::Device);
        }
    }
}

impl UnitParams {
    /// The flat parameter tensor, `[numel]`.
    pub fn tensor(&self) -> &candle_core::Tensor {
        &self.tensor
    }

    /// The unit.
    pub fn unit(&self) -> UnitId {
        self.unit
    }
}
