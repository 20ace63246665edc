//! [`StateSnapshot`]: a unit's committed state at one moment, read later while the optimizer
//! goes on (background checkpoints: CheckFreq's snapshot-then-persist split, Mohan et al.,
//! FAST '21; NVMe state read copy-on-write, as DeepSpeed's async checkpointing leans on
//! immutable files).

use std::sync::Arc;

use oogc_swapper::TensorId;

use super::{copy_bytes, copy_to_f32, Home, Shared, UnitCell, UnitState};
use crate::error::{Error, Result};

/// A unit's committed optimizer state as it was when
/// [`super::PipelinedOptimizer::snapshot_state`] took it, read by [`StateSnapshot::read`] as long
/// as the unit's committed state has not changed since. `Send`: read it on another thread.
pub struct StateSnapshot {
    pub(super) cell: Arc<UnitCell>,
    /// The unit's state version when taken.
    pub(super) version: u64,
    pub(super) shared: Arc<Shared>,
}

impl StateSnapshot {
    /// The unit.
    pub fn unit(&self) -> TensorId {
        self.cell.id
    }

    /// The state as it was taken: master weights in f32 and the moments as stored (`[len]`
    /// each; int8 with their block absmaxes): [`StateSnapshot::read_into`] a new state.
    ///
    /// # Errors
    /// As [`StateSnapshot::read_into`].
    pub fn read(self) -> Result<UnitState> {
        let mut out = UnitState { master: Vec::new(), moments: crate::quant::MomentBufs::zeros(Default::default(), 0) };
        self.read_into(&mut out)?;
        Ok(out)
    }

    /// The state as it was taken, into `out` (replacing what it held, within its vectors'
    /// capacity when it suffices: a staging reused unit after unit allocates once). Waits while
    /// a job runs on the unit, then copies a host-placed unit's buffers under its lock; an
    /// NVMe-placed unit's extents are read without it (held by the read, copy-on-write: an
    /// update meanwhile writes new ones), with the master weights from its committed compute
    /// copy when they live there ([`crate::StreamConfig::master_in_copy`]).
    ///
    /// # Errors
    /// [`Error::Protocol`] when the unit's committed state changed since the snapshot (a commit,
    /// an update in place, an import: the caller did not read it in time) or its last job
    /// failed; [`Error::Swapper`] reading NVMe or the compute copy's home;
    /// [`Error::NoNvmeStore`].
    pub fn read_into(self, out: &mut UnitState) -> Result<()> {
        let (unit, n, sh) = (self.cell.id, self.cell.n, &self.shared);
        let dtype = sh.config.compute_dtype;
        let (extents, from_spare) = {
            let g = self.cell.idle();
            let data = g.data.as_ref().expect("idle cell holds its data");
            self.check(g.error.is_some(), data.version)?;
            match &data.home {
                Home::Host { cur, .. } => {
                    cur.p.write_f32(&mut out.master);
                    out.moments.clone_from(&cur.mom);
                    return Ok(());
                }
                Home::Nvme { cur, .. } => {
                    // A committed compute copy not yet in the home waits in the second buffer.
                    let spare = data.spare_copy.as_ref().filter(|s| s.unpublished && sh.stream.master_in_copy);
                    if let Some(s) = spare {
                        out.master.clear();
                        out.master.resize(n, 0.0);
                        copy_to_f32(copy_bytes(&s.words, n, dtype), dtype, &mut out.master);
                    }
                    (cur.as_ref().expect("committed state").share(), spare.is_some())
                }
            }
        };
        let store = sh.nvme.as_ref().ok_or(Error::NoNvmeStore { unit })?;
        let in_copy = sh.stream.master_in_copy;
        // Stored master weights go to `out`; with the master in the compute copy the read leaves
        // its vector empty.
        let mut none = Vec::new();
        let read = {
            let _slot = sh.slots.acquire();
            let master = if in_copy { &mut none } else { &mut out.master };
            extents.read_into(store, &sh.stream_pool, master, &mut out.moments)
        };
        extents.free(store);
        read?;
        if in_copy && !from_spare {
            out.master.clear();
            out.master.resize(n, 0.0);
            let master = &mut out.master;
            let mut fill = |bytes: &[u8]| copy_to_f32(&bytes[..n * dtype.size_in_bytes()], dtype, master);
            sh.home.read(unit, &mut fill).map_err(|source| Error::Swapper { unit, source })?;
        }
        // The compute copy is the committed one only while the state is.
        let g = self.cell.idle();
        self.check(g.error.is_some(), g.data.as_ref().expect("idle cell holds its data").version)
    }

    /// Fails when the unit's job failed or its committed state is not the snapshot's.
    fn check(&self, failed: bool, version: u64) -> Result<()> {
        let unit = self.cell.id;
        if failed {
            return Err(Error::Protocol(format!("unit {unit}: its last update failed; its snapshot cannot be read")));
        }
        if version != self.version {
            return Err(Error::Protocol(format!(
                "unit {unit}: its state was updated since the snapshot (version {} → {version}): read a snapshot before \
                 the next step's updates of the unit",
                self.version
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for StateSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateSnapshot").field("unit", &self.cell.id).field("version", &self.version).finish()
    }
}
