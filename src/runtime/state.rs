//! A unit's optimizer state in and out, for checkpoints: [`Runtime::unit_state`] (all-gathered
//! from the ranks' shards, in the dtypes the optimizer stores) and [`Runtime::load_unit_state`]
//! (re-sharded for this rank), by kind: a device-resident unit's state is the device
//! optimizer's. A rank's shard starts on an int8 block ([`crate::dist::SHARD_ALIGN`]), so the
//! gathered state is the one a world of one holds, block absmaxes included, and a shard of a
//! checkpoint is whole blocks of it.

use std::ops::Range;

use bytemuck::{cast_slice, pod_collect_to_vec};
use oogc_optimizer::{MomentBufs, UnitState};

use super::device_moments::DeviceMoments;
use super::tensor::{self, candle_dtype};
use super::unit::Kind;
use super::{home, Result, Runtime, RuntimeError, UnitId};

impl Runtime {
    /// The unit's fp32 master weights and Adam moments (`[numel]` each) as the optimizer stores
    /// them (`[optimizer] state_dtype`: f32, bf16, or int8 codes with their block absmaxes; f32
    /// vectors through [`UnitState::into_f32`]): what a checkpoint saves, so that a resume is
    /// bitwise. A device-resident unit's are the device optimizer's (the same format). Call
    /// [`Runtime::sync`] first to see the latest update. With data-parallel ranks each holds a
    /// shard: they are all-gathered in their dtype (int8 codes and block absmaxes, bf16 or f32
    /// values; master weights in f32), giving what one process would hold (a collective: every
    /// rank calls this for the same units in the same order).
    ///
    /// # Errors
    /// Optimizer failures (NVMe read); with ranks, a failed all-gather ([`RuntimeError::Dist`]).
    pub fn unit_state(&self, unit: UnitId) -> Result<UnitState> {
        let (_, s) = self.local_unit_state(unit)?;
        let u = self.units.get(unit);
        // Every rank holds a device-resident unit whole (and calls this for it: no collective).
        if self.ranks.world().size == 1 || u.device().is_some() {
            return Ok(s);
        }
        self.gather_state(u.numel, s)
    }

    /// The part of the unit's state this rank holds, no collective (a rank's shard of a
    /// checkpoint): the elements `range` of [`Runtime::unit_state`]'s vectors — this rank's
    /// [`crate::dist::shard_range`] (int8: the absmaxes of its blocks), or the whole unit when
    /// every rank holds it whole (a device-resident unit's, or in a world of one).
    ///
    /// # Errors
    /// Optimizer failures (NVMe read).
    pub(crate) fn local_unit_state(&self, unit: UnitId) -> Result<(Range<usize>, UnitState)> {
        let (range, snap) = self.local_unit_snapshot(unit)?;
        Ok((range, snap.read()?))
    }

    /// [`Runtime::local_unit_state`] as it is now, to be read later while training goes on (a
    /// background checkpoint): the CPU optimizer's [`oogc_optimizer::StateSnapshot`] (nothing
    /// copied now; readable until the unit's next update is committed), a device-resident
    /// unit's state copied D2H now. Call [`Runtime::sync`] first.
    ///
    /// # Errors
    /// Optimizer failures (reading a compute copy's home), device copies.
    pub(crate) fn local_unit_snapshot(&self, unit: UnitId) -> Result<(Range<usize>, UnitSnapshot)> {
        let u = self.units.get(unit);
        if let Some(d) = u.device() {
            // The device optimizer's state (a checkpoint's read, not counted as link traffic).
            let moments = d.moments.to_host(tensor::host_bytes)?;
            let state = UnitState { master: d.master.to_vec1()?, moments };
            return Ok((0..u.numel, UnitSnapshot::Copied(state)));
        }
        let world = self.ranks.world();
        let s = self.grads.optimizer().snapshot_state(unit.tensor())?;
        Ok((crate::dist::shard_range(u.numel, world.rank, world.size), UnitSnapshot::Optimizer(s)))
    }

    /// A unit of `numel`'s whole state from every rank's shard `s`, each array in its dtype.
    fn gather_state(&self, numel: usize, s: UnitState) -> Result<UnitState> {
        let all = |shard: &[u8], width: usize| self.ranks.all_gather_shards(shard, numel, width);
        let blocks = |shard: &[f32]| -> Result<Vec<f32>> {
            Ok(pod_collect_to_vec(&self.ranks.all_gather_shard_blocks(cast_slice(shard), numel, 4)?))
        };
        let master = pod_collect_to_vec(&all(cast_slice(&s.master), 4)?);
        let moments = match s.moments {
            MomentBufs::F32 { m, v } => MomentBufs::F32 {
                m: pod_collect_to_vec(&all(cast_slice(&m), 4)?),
                v: pod_collect_to_vec(&all(cast_slice(&v), 4)?),
            },
            MomentBufs::Bf16 { m, v } => MomentBufs::Bf16 {
                m: pod_collect_to_vec(&all(cast_slice(&m), 2)?),
                v: pod_collect_to_vec(&all(cast_slice(&v), 2)?),
            },
            MomentBufs::Int8 { m, m_absmax, v, v_absmax } => MomentBufs::Int8 {
                m: pod_collect_to_vec(&all(cast_slice(&m), 1)?),
                m_absmax: blocks(&m_absmax)?,
                v: all(&v, 1)?,
                v_absmax: blocks(&v_absmax)?,
            },
        };
        Ok(UnitState { master, moments })
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
            // whole compute copy to the residency manager. The shard's moments are whole blocks
            // of the unit's, in the checkpoint's dtype.
            if !gathers {
                let copy = oogc_optimizer::compute_copy(&state.master, dtype);
                home::overwrite_host_copy(&self.tiers.residency, tensor, &mut |b| {
                    b[..copy.len()].copy_from_slice(&copy)
                })?;
            }
            let r = crate::dist::shard_range(numel, world.rank, world.size);
            self.grads.optimizer().import_state(tensor, shard_of(&state, r))?;
            return Ok(());
        }
        // The optimizer writes the compute copy into its home (the host copy) from `master`.
        self.grads.optimizer().import_state(tensor, state)?;
        Ok(())
    }
}

/// Elements `r` of a unit's `state` (a rank's shard: `r.start` a multiple of
/// [`crate::dist::SHARD_ALIGN`], or `r` empty): its master weights, and its moments in their
/// dtype (int8: the codes and the absmaxes of the blocks of `r`).
fn shard_of(state: &UnitState, r: Range<usize>) -> UnitState {
    let r = if r.is_empty() { 0..0 } else { r };
    let dtype = state.moments.dtype();
    let mut bytes = vec![0u8; dtype.moment_bytes(r.len())];
    state.moments.write_bytes(r.clone(), &mut bytes);
    let mut moments = MomentBufs::zeros(dtype, r.len());
    moments.read_bytes(0..r.len(), &bytes);
    UnitState { master: state.master[r].to_vec(), moments }
}

#[cfg(test)]
mod tests {
    use oogc_optimizer::{MomentBufs, StateDType, UnitState, QUANT_BLOCK};

    use super::shard_of;
    use crate::dist::shard_range;

    /// Shards of a state, in every dtype, are the state of their range: what a rank's optimizer
    /// would hold had it stepped the range alone (int8: the blocks' codes and absmaxes).
    #[test]
    fn a_shard_of_a_state_is_whole_blocks_of_it() {
        let numel = 3 * QUANT_BLOCK + 77;
        let master: Vec<f32> = (0..numel).map(|i| (i as f32 * 0.37).sin()).collect();
        let m: Vec<f32> = (0..numel).map(|i| (i as f32 * 0.11).cos() * (1 + i / QUANT_BLOCK) as f32).collect();
        let v: Vec<f32> = m.iter().map(|x| x * x + 1e-3).collect();
        for dtype in [StateDType::F32, StateDType::Bf16, StateDType::Int8] {
            let whole = UnitState { master: master.clone(), moments: MomentBufs::from_f32(dtype, &m, &v).unwrap() };
            let (wm, wv) = whole.moments.to_f32();
            for ranks in [1, 2, 3, 4, 8] {
                let mut next = 0;
                for rank in 0..ranks {
                    let r = shard_range(numel, rank, ranks);
                    let shard = shard_of(&whole, r.clone());
                    assert_eq!(shard.master, master[r.clone()], "{dtype}, rank {rank} of {ranks}");
                    assert_eq!(shard.moments.dtype(), dtype);
                    assert_eq!(shard.moments.len(), r.len());
                    // Decoded, the shard's moments are the whole state's of its range, bit for bit.
                    let (sm, sv) = shard.moments.to_f32();
                    assert!(sm == wm[r.clone()] && sv == wv[r.clone()], "{dtype}, rank {rank} of {ranks}");
                    // And requantizing the range alone gives the same codes and absmaxes.
                    let alone = MomentBufs::from_f32(dtype, &m[r.clone()], &v[r.clone()]).unwrap();
                    assert!(shard.moments == alone, "{dtype}, rank {rank} of {ranks}: blocks differ");
                    next = r.end;
                }
                assert_eq!(next, numel);
            }
        }
    }
}

/// A unit's state at one moment ([`Runtime::local_unit_snapshot`]), read later, on any thread.
#[derive(Debug)]
pub(crate) enum UnitSnapshot {
    /// Read already (a device-resident unit's, copied D2H).
    Copied(UnitState),
    /// The CPU optimizer's snapshot.
    Optimizer(oogc_optimizer::StateSnapshot),
}

impl UnitSnapshot {
    /// The state as it was when the snapshot was taken.
    ///
    /// # Errors
    /// Optimizer failures (NVMe read).
    pub(crate) fn read(self) -> Result<UnitState> {
        match self {
            UnitSnapshot::Copied(s) => Ok(s),
            UnitSnapshot::Optimizer(s) => Ok(s.read()?),
        }
    }
}
