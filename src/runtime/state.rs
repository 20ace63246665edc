//! A unit's optimizer state in and out, for checkpoints: [`Runtime::unit_state`] (all-gathered
//! from the ranks' shards) and [`Runtime::load_unit_state`] (re-sharded for this rank), by kind:
//! a device-resident unit's state is the device optimizer's.

use oogc_optimizer::UnitState;

use super::device_moments::DeviceMoments;
use super::tensor::{self, candle_dtype};
use super::unit::Kind;
use super::{home, Result, Runtime, RuntimeError, UnitId};

impl Runtime {
    /// The unit's fp32 master weights and Adam moments (`[numel]` each) as the optimizer stores
    /// them (`[optimizer] state_dtype`: f32, bf16, or int8 codes with their block absmaxes; f32
    /// vectors through [`UnitState::into_f32`]): what a checkpoint saves, so that a resume is
    /// bitwise. A device-resident unit's are the device optimizer's (the same format). Call
    /// [`Runtime::sync`] first to see the latest update. With data-parallel ranks (f32 state
    /// only) each holds a shard: they are all-gathered (a collective: every rank calls this for
    /// the same units in the same order).
    ///
    /// # Errors
    /// Optimizer failures (NVMe read); with ranks, a failed all-gather ([`RuntimeError::Dist`]).
    pub fn unit_state(&self, unit: UnitId) -> Result<UnitState> {
        let u = self.units.get(unit);
        if let Some(d) = u.device() {
            // The device optimizer's state (a checkpoint's read, not counted as link traffic).
            let moments = d.moments.to_host(tensor::host_bytes)?;
            return Ok(UnitState { master: d.master.to_vec1()?, moments });
        }
        let s = self.grads.optimizer().export_state(unit.tensor())?;
        if self.ranks.world().size == 1 {
            return Ok(s);
        }
        let numel = u.numel;
        let gather = |shard: Vec<f32>| -> Result<Vec<f32>> {
            let whole = self.ranks.all_gather_shards(bytemuck::cast_slice(&shard), numel, 4)?;
            Ok(bytemuck::pod_collect_to_vec(&whole))
        };
        // Ranks keep f32 moments (`Runtime::new` refuses others).
        let (master, m, v) = s.into_f32();
        Ok(UnitState::from_f32(gather(master)?, gather(m)?, gather(v)?)?)
    }

    /// Replaces the unit's master weights and Adam state (a checkpoint being restored) and its
    /// compute copy. The moments may be of any dtype ([`UnitState::from_f32`] for f32 vectors):
    /// stored as they are when they are of `[optimizer] state_dtype` (a bitwise resume), else
    /// converted through f32 ([`oogc_optimizer::MomentBufs::converted`]; a checkpoint's loader
    /// refuses that unless asked); a device-resident unit takes them the same way, on the device.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a length mismatch; optimizer or swapper failures.
    pub fn load_unit_state(&mut self, unit: UnitId, state: UnitState) -> Result<()> {
        let u = self.units.get(unit);
        let numel = u.numel;
        if state.master.len() != numel || state.moments.len() != numel {
            return Err(RuntimeError::Usage(format!("load_unit_state({}): lengths differ from {numel}", u.name)));
        }
        self.publish(unit)?;
        let u = self.units.get_mut(unit);
        let (tensor, dtype) = (unit.tensor(), u.dtype);
        let copy_dtype = candle_dtype(dtype)?;
        if let Some(d) = u.device_mut() {
            // Restored where the optimizer lives: on the device.
            let moments = state.moments.converted(self.config.optimizer.state_dtype);
            let dev = &self.tiers.compute_device;
            d.master = candle_core::Tensor::from_vec(state.master, numel, dev)?;
            d.moments = DeviceMoments::from_host(&moments, |b, dt| {
                tensor::tensor_from_bytes(b, dt, b.len() / dt.num_bytes(1), dev)
            })?;
            d.copy = d.master.to_dtype(copy_dtype)?;
            d.grads = None;
            return Ok(());
        }
        let gathers = matches!(u.kind, Kind::Gathered);
        self.gathered.remove(unit);
        let world = self.ranks.world();
        if world.size > 1 {
            // This rank's shard to its optimizer (a checkpoint of any world size re-shards), which
            // writes the compute copy's shard into the tiers when they hold shards; else the
            // whole compute copy to the residency manager.
            let (master, m, v) = state.into_f32();
            if !gathers {
                let copy = oogc_optimizer::compute_copy(&master, dtype);
                home::overwrite_host_copy(&self.tiers.residency, tensor, &mut |b| {
                    b[..copy.len()].copy_from_slice(&copy)
                })?;
            }
            let r = crate::dist::shard_range(numel, world.rank, world.size);
            let state = UnitState::from_f32(master[r.clone()].to_vec(), m[r.clone()].to_vec(), v[r].to_vec())?;
            self.grads.optimizer().import_state(tensor, state)?;
            return Ok(());
        }
        // The optimizer writes the compute copy into its home (the host copy) from `master`.
        self.grads.optimizer().import_state(tensor, state)?;
        Ok(())
    }
}
