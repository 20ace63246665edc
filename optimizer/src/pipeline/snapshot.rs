//! [`StateSnapshot`]: a unit's committed state at one moment, read later while the optimizer
//! goes on (background checkpoints: CheckFreq's snapshot-then-persist split, Mohan et al.,
//! FAST '21, with NVMe state copy-on-write as in DeepSpeed's async checkpoint engine).

use std::sync::Arc;

use oogc_swapper::TensorId;

use super::{Shared, UnitState};
use crate::error::{Error, Result};
use crate::quant::MomentBufs;
use crate::stream::NvmeState;

/// A unit's committed optimizer state as it was when [`super::PipelinedOptimizer::snapshot_state`]
/// took it: host-placed state copied, NVMe-placed state held by its extents (copy-on-write:
/// updates write new extents, these stay allocated until the snapshot is read or dropped).
/// `Send`: read it on another thread.
pub struct StateSnapshot {
    pub(super) unit: TensorId,
    pub(super) held: Held,
}

/// What a snapshot holds.
pub(super) enum Held {
    /// A host-placed unit's state, copied (`Some` until read).
    Copied(Option<UnitState>),
    /// An NVMe-placed unit's state: its extents (`Some` until freed), and its master weights
    /// when they live in the compute copy (copied at the snapshot).
    Nvme { state: Option<NvmeState>, master: Option<Vec<f32>>, shared: Arc<Shared> },
}

impl StateSnapshot {
    /// The unit.
    pub fn unit(&self) -> TensorId {
        self.unit
    }

    /// Host bytes the snapshot holds until it is read (a host-placed unit's copied state: 4 B
    /// per parameter of master weights and its moments' bytes; an NVMe-placed unit's master
    /// weights copied from its compute copy, else 0).
    pub fn host_bytes(&self) -> u64 {
        match &self.held {
            Held::Copied(s) => s.as_ref().map_or(0, |s| {
                let moments = match &s.moments {
                    MomentBufs::F32 { m, v } => 4 * (m.len() + v.len()),
                    MomentBufs::Bf16 { m, v } => 2 * (m.len() + v.len()),
                    MomentBufs::Int8 { m, m_absmax, v, v_absmax } => {
                        m.len() + v.len() + 4 * (m_absmax.len() + v_absmax.len())
                    }
                };
                (4 * s.master.len() + moments) as u64
            }),
            Held::Nvme { master, .. } => 4 * master.as_ref().map_or(0, Vec::len) as u64,
        }
    }

    /// NVMe bytes the snapshot keeps allocated until it is read (an NVMe-placed unit's extents,
    /// padded; 0 for a host-placed unit). They cost store room only once the optimizer has
    /// moved the unit on to new extents.
    pub fn nvme_bytes(&self) -> u64 {
        match &self.held {
            Held::Copied(_) => 0,
            Held::Nvme { state, .. } => state.as_ref().map_or(0, NvmeState::allocated_bytes),
        }
    }

    /// The state as it was: an NVMe-placed unit's read from its extents now (through one of the
    /// optimizer's stream slots and a buffer of its stream pool), which are then let go.
    ///
    /// # Errors
    /// [`Error::Swapper`] reading NVMe (an I/O error, a corrupt block); [`Error::NoNvmeStore`].
    pub fn read(mut self) -> Result<UnitState> {
        let unit = self.unit;
        match &mut self.held {
            Held::Copied(s) => Ok(s.take().expect("read once")),
            Held::Nvme { state, master, shared } => {
                let store = shared.nvme.as_ref().ok_or(Error::NoNvmeStore { unit })?;
                let st = state.as_ref().expect("held until dropped");
                let (stored, moments) = {
                    let _slot = shared.slots.acquire();
                    st.read(store, &shared.stream_pool)?
                };
                let master = stored.or_else(|| master.take()).expect("the master is stored or copied");
                Ok(UnitState { master, moments })
            }
        }
    }
}

impl Drop for StateSnapshot {
    /// Lets an NVMe-placed unit's extents go (freed when the optimizer has let them go too).
    fn drop(&mut self) {
        if let Held::Nvme { state, shared, .. } = &mut self.held {
            if let (Some(st), Some(store)) = (state.take(), shared.nvme.as_ref()) {
                st.free(store);
            }
        }
    }
}

impl std::fmt::Debug for StateSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.held {
            Held::Copied(_) => "copied",
            Held::Nvme { .. } => "nvme",
        };
        f.debug_struct("StateSnapshot").field("unit", &self.unit).field("held", &kind).finish()
    }
}
