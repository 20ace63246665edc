//! Checkpoints written in the background: [`Trainer::start_checkpoint`] takes each unit's
//! snapshot between two steps and a writer thread streams the units into the file while
//! training goes on; [`Trainer::finish_checkpoint`] completes the save (with ranks: a
//! collective on every rank's shard, then rank 0's index).
//!
//! The split is CheckFreq's (Mohan et al., FAST '21): a snapshot the trainer waits for, then a
//! persist it does not. A unit's snapshot is its optimizer's ([`oogc_optimizer::StateSnapshot`]):
//! nothing is copied when it is taken; the writer reads it later — a host-placed unit's buffers,
//! an NVMe-placed unit's extents — which is the state of the snapshot as long as the unit's
//! committed state has not moved on. It moves on only at the next step's commit
//! ([`oogc_optimizer::PipelinedOptimizer::finish_step`]; with immediate updates, at the unit's
//! update in the backward), so the trainer waits there, if it must, until the writer has read
//! every unit ([`Trainer::before_updates`]): the writer reads while the next step's forward
//! (and with speculated updates, its backward) runs. A read that comes too late fails the save,
//! never writes another step's state. A device-resident unit's state is copied D2H when its
//! snapshot is taken. The writer reads one unit at a time into one staging, claimed from the
//! host ledger (`checkpoint`: the plan's room for the largest unit's state) at the first save
//! and kept from save to save ([`Staging`]: a unit's state allocated and freed beside a step
//! would stay in malloc's heap beside the step's own memory, 100 MB of peak RSS more at a 32 k
//! vocabulary), and appends it; device units' copies are claimed when taken, and when the
//! ledger has no room for one the trainer waits for the writer to let earlier ones go.
//!
//! One checkpoint is in flight at a time: starting another waits for it. A run that stops
//! (SIGTERM) waits for it before its last save; a failing run's trainer waits for it when it is
//! dropped (with ranks no index is then written: the shards do not count, the previous
//! checkpoint stays the newest).

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use oogc_models::UnitSpec;
use oogc_optimizer::{MomentBufs, StateDType, UnitState};
use oogc_swapper::{HostClaim, HostLedger, HostUse};
use parking_lot::{Condvar, Mutex};

use super::ckpt::{self, UnitLayout};
use super::{Result, TrainError, Trainer};
use crate::checkpoint::{self, CheckpointError, Saved, Writer};
use crate::runtime::{RuntimeError, UnitSnapshot};

/// A save's progress, shared by the trainer (which takes the snapshots and waits on it) and
/// the writer thread (which reads and lets them go).
#[derive(Debug, Default)]
struct Room {
    state: Mutex<Progress>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Progress {
    /// Snapshots sent and not read yet.
    unread: usize,
    /// Host bytes of device units' copies claimed and not yet appended.
    bytes: u64,
    /// The writer has ended (done, failed or panicked): nothing more will change.
    ended: bool,
}

impl Room {
    /// Changes the progress and wakes the trainer.
    fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.state.lock());
        self.changed.notify_all();
    }
}

/// One unit's snapshot on its way to the writer.
struct Staged {
    /// The unit's index in the model.
    unit: usize,
    /// The elements of the unit it holds (a rank's shard, or all of them).
    range: Range<usize>,
    snap: UnitSnapshot,
    /// A device unit's copy: the claim of its `bytes` (the others are read into the writer's
    /// [`Staging`]).
    claim: Option<(HostClaim, u64)>,
}

/// What the writer thread does with its file once every unit is appended.
#[derive(Debug, Clone, Copy)]
enum Close {
    /// A world of one: rename it and keep the newest `keep` checkpoints.
    Finish { keep: usize },
    /// A rank's shard: rename it; the set counts once rank 0 has written the index.
    Shard,
}

/// A checkpoint being written.
#[derive(Debug)]
pub(super) struct InFlight {
    /// The step it saves.
    step: u64,
    /// This rank's writer, or why this rank has none (a failed start, shared with the other
    /// ranks when the save completes).
    job: std::result::Result<JoinHandle<(Result<Saved>, Staging)>, TrainError>,
    /// When it started (the save's seconds run from here).
    started: Instant,
    /// Its progress (`None` without a writer).
    room: Option<Arc<Room>>,
    /// Each unit's layout, as written (rank 0's index names them).
    layouts: Vec<UnitLayout>,
    /// The next step's updates move the committed state at the turn (immediate updates), not
    /// at its finish: the snapshots must be read by then.
    read_by_turn: bool,
}

impl InFlight {
    fn finished(&self) -> bool {
        self.job.as_ref().map_or(true, JoinHandle::is_finished)
    }

    /// Waits for the writer: what it saved, or its error; its staging goes back to `staging`.
    fn join(self, staging: &mut Option<Staging>) -> Result<Saved> {
        let handle = self.job?;
        match handle.join() {
            Ok((r, s)) => {
                *staging = Some(s);
                r
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// The writer's staging of one unit's state, kept from save to save with the claim of its bytes
/// (`HostUse::Checkpoint`: the plan's room for the largest unit's state): allocated once, so
/// that no unit's state is allocated and freed beside a step (the heap would keep the freed
/// block beside the step's own memory).
#[derive(Debug)]
pub(super) struct Staging {
    state: UnitState,
    /// Elements its vectors hold without growing.
    elements: usize,
    _claim: HostClaim,
}

impl Staging {
    /// A staging of `elements` of f32 master weights and moments of `moments`, claiming `bytes`
    /// (its vectors and the writer's buffer) from `ledger`.
    fn new(ledger: &Arc<HostLedger>, elements: usize, moments: StateDType, bytes: u64) -> Result<Self> {
        let claim = ledger.claim(HostUse::Checkpoint, bytes).map_err(RuntimeError::from)?;
        let state = UnitState { master: Vec::with_capacity(elements), moments: MomentBufs::zeros(moments, elements) };
        Ok(Self { state, elements, _claim: claim })
    }
}

impl Trainer {
    /// Writes a checkpoint of the completed steps into `[checkpoint] dir` and waits for it:
    /// [`Trainer::start_checkpoint`] then [`Trainer::finish_checkpoint`]. Returns what was saved,
    /// `None` when the config has no checkpoint directory (and on ranks other than 0).
    ///
    /// # Errors
    /// As [`Trainer::start_checkpoint`] and [`Trainer::finish_checkpoint`].
    pub fn save_checkpoint(&mut self) -> Result<Option<Saved>> {
        if self.start_checkpoint()?.is_none() {
            return Ok(None);
        }
        self.finish_checkpoint(true)
    }

    /// Starts a checkpoint of the completed steps, written in the background (module docs):
    /// each unit's state is snapshotted now, in the model's order, and a writer thread streams
    /// it into the file (safetensors, crc32c per tensor, atomically: temp file, fsync, rename).
    /// With ranks each rank writes its own shard of every unit to its own file; rank 0 writes
    /// the index in [`Trainer::finish_checkpoint`], once every shard is durable. A checkpoint
    /// still in flight is finished first. Returns the seconds the trainer was held (waiting for
    /// the previous save, the snapshots, waiting for staging room), `None` when the config has
    /// no checkpoint directory.
    ///
    /// # Errors
    /// The previous save's error (nothing started); runtime failures taking a snapshot;
    /// [`CheckpointError::NoSpace`] when the directory's disk has less room than the file (a
    /// world of one; with ranks a rank's failure to start is returned by
    /// [`Trainer::finish_checkpoint`] on every rank). The previous checkpoint stays intact.
    pub fn start_checkpoint(&mut self) -> Result<Option<f64>> {
        if !self.checkpoints {
            return Ok(None);
        }
        let began = Instant::now();
        if self.in_flight.is_some() {
            self.finish_checkpoint(true)?;
        }
        self.rt.sync()?;
        let world = self.ranks.world();
        let dir = self.cfg.checkpoint.dir.clone().expect("a run that checkpoints has a directory");
        let layouts = self.layouts();
        let units = self.model.units().to_vec();
        let ranges: Vec<_> =
            units.iter().zip(&layouts).map(|(u, l)| l.written_range(u.numel, world.rank, world.size)).collect();
        let meta = self.checkpoint_metadata();
        let (writer, close) = if world.size == 1 {
            let tensors = units.iter().zip(&layouts).flat_map(|(spec, l)| l.tensors(spec)).collect();
            let keep = self.cfg.checkpoint.keep.unwrap_or(2);
            (Writer::create(&dir, self.step, &meta, tensors), Close::Finish { keep })
        } else {
            use checkpoint::shards;
            let tensors = units
                .iter()
                .zip(&layouts)
                .zip(&ranges)
                .flat_map(|((u, l), r)| l.shard_tensors(u, r.clone()).into_iter().map(|(t, _)| t))
                .collect();
            let path = dir.join(shards::shard_file_name(self.step, world.rank, world.size));
            let meta = shards::shard_metadata(&meta, world.rank, world.size);
            (Writer::create_at(&dir, path, self.step, &meta, tensors), Close::Shard)
        };
        // The staging of the largest unit the writer reads (not a device unit's: copied now).
        let elements = (0..units.len()).filter(|&k| !layouts[k].is_device()).map(|k| ranges[k].len()).max();
        let staging = match (self.ckpt_staging.take(), elements.unwrap_or(0)) {
            (Some(s), n) if s.elements >= n => Ok(s),
            (old, n) => {
                drop(old);
                let bytes = elements.map_or(0, |_| UnitLayout::staging_bytes_of(n, self.cfg.optimizer.state_dtype));
                Staging::new(self.rt.memory().host_ledger(), n, self.cfg.optimizer.state_dtype, bytes)
            }
        };
        let started = Instant::now();
        let step = self.step;
        let writer = match staging.and_then(|s| Ok((writer?, s))) {
            Ok(w) => w,
            Err(e) if world.size > 1 => {
                // Shared with the other ranks when the save completes.
                let read_by_turn = false;
                self.in_flight = Some(InFlight { step, job: Err(e), started, room: None, layouts, read_by_turn });
                return Ok(Some(began.elapsed().as_secs_f64()));
            }
            Err(e) => return Err(e),
        };
        let (writer, staging) = writer;
        let room = Arc::new(Room::default());
        let (tx, rx) = crossbeam_channel::unbounded::<Staged>();
        let thread = {
            let (room, layouts, units) = (Arc::clone(&room), layouts.clone(), units.clone());
            std::thread::Builder::new()
                .name("oogc-checkpoint".into())
                .spawn(move || write_all(writer, staging, &units, &layouts, rx, &room, close))
                .map_err(|e| RuntimeError::Usage(format!("cannot start the checkpoint writer thread: {e}")))?
        };
        let sent = self.send_snapshots(&units, &layouts, &ranges, &tx, &room);
        drop(tx);
        let job = match sent {
            Ok(()) => Ok(thread),
            Err(e) => {
                // The writer sees its channel end early and drops its temp file.
                if let Ok((_, staging)) = thread.join() {
                    self.ckpt_staging = Some(staging);
                }
                if world.size == 1 {
                    return Err(e);
                }
                Err(e) // shared with the other ranks when the save completes
            }
        };
        let read_by_turn = super::optimizer_config(&self.cfg).updates_immediately();
        self.in_flight = Some(InFlight { step, job, started, room: Some(room), layouts, read_by_turn });
        Ok(Some(began.elapsed().as_secs_f64()))
    }

    /// Completes the checkpoint in flight: with `wait`, once its writer is done; without, only
    /// if it is done already (with ranks: on every rank, decided by a collective, so every rank
    /// calls this at the same points), else `Ok(None)` and it stays in flight. Returns what was
    /// saved (its seconds from the start to the rename) on rank 0 of a completed save, `None`
    /// otherwise (no save in flight, not done yet, another rank).
    ///
    /// # Errors
    /// The save's: [`CheckpointError::NoSpace`] when the disk filled, I/O errors, runtime
    /// failures reading a snapshot; with ranks [`CheckpointError::RankFailed`] when another
    /// rank's shard failed (every rank removes its shard; no index is written). The previous
    /// checkpoint stays intact.
    pub fn finish_checkpoint(&mut self, wait: bool) -> Result<Option<Saved>> {
        let Some(f) = self.in_flight.as_ref() else { return Ok(None) };
        let world = self.ranks.world();
        let done = wait || f.finished();
        if world.size == 1 {
            if !done {
                return Ok(None);
            }
            // The writer's seconds run from the file's creation to its rename.
            return self.in_flight.take().expect("in flight").join(&mut self.ckpt_staging).map(Some);
        }
        if !wait {
            let mut pending = [f64::from(u8::from(!done))];
            self.ranks.all_reduce_sum_f64(&mut pending).map_err(RuntimeError::from)?;
            if pending[0] > 0.0 {
                return Ok(None);
            }
        }
        let f = self.in_flight.take().expect("in flight");
        self.finish_shards(f)
    }

    /// [`Trainer::finish_checkpoint`] with ranks: a collective on whether every rank's shard is
    /// durable, then rank 0's index.
    fn finish_shards(&mut self, mut f: InFlight) -> Result<Option<Saved>> {
        use checkpoint::shards::{self, ShardIndex};
        let world = self.ranks.world();
        let dir = self.cfg.checkpoint.dir.clone().expect("a run that checkpoints has a directory");
        let (step, started) = (f.step, f.started);
        let name = shards::shard_file_name(step, world.rank, world.size);
        let layouts = std::mem::take(&mut f.layouts);
        let written = f.join(&mut self.ckpt_staging);
        let mut outcome = [0.0; 2];
        match &written {
            Ok(saved) => outcome[1] = saved.bytes as f64,
            Err(_) => outcome[0] = 1.0,
        }
        let failed = self.ranks.all_gather_f64(outcome[0]).map_err(RuntimeError::from)?;
        let failed: Vec<usize> = failed.iter().enumerate().filter(|(_, &f)| f != 0.0).map(|(r, _)| r).collect();
        if !failed.is_empty() {
            let _ = std::fs::remove_file(dir.join(&name));
            written?;
            return Err(CheckpointError::RankFailed { step, ranks: failed }.into());
        }
        self.ranks.all_reduce_sum_f64(&mut outcome).map_err(RuntimeError::from)?;
        if !world.is_root() {
            return Ok(None);
        }
        let units = self.model.units();
        let (units_index, tensors_index): (Vec<_>, Vec<_>) =
            units.iter().zip(&layouts).map(|(u, l)| l.index_entries(u, world.size)).unzip();
        let index = ShardIndex {
            format: shards::FORMAT.into(),
            step,
            world_size: world.size,
            files: (0..world.size).map(|r| shards::shard_file_name(step, r, world.size)).collect(),
            units: units_index,
            tensors: tensors_index.into_iter().flatten().collect(),
        };
        let (path, index_bytes) = index.write(&dir)?;
        checkpoint::prune(&dir, self.cfg.checkpoint.keep.unwrap_or(2))?;
        let bytes = outcome[1] as u64 + index_bytes;
        Ok(Some(Saved { step, path, bytes, seconds: started.elapsed().as_secs_f64() }))
    }

    /// Called by the step at its forward→backward turn (`at_turn`) and before its finish: where
    /// the optimizer may move a unit's committed state on (module docs), waits until the writer
    /// of the checkpoint in flight has read every snapshot.
    pub(super) fn before_updates(&self, at_turn: bool) {
        let Some(f) = self.in_flight.as_ref() else { return };
        let Some(room) = f.room.as_ref().filter(|_| f.read_by_turn || !at_turn) else { return };
        let mut p = room.state.lock();
        while p.unread > 0 && !p.ended {
            room.changed.wait(&mut p);
        }
    }

    /// Each unit's layout in a checkpoint, in the model's order.
    fn layouts(&self) -> Vec<UnitLayout> {
        let o = &self.cfg.optimizer;
        self.ids
            .iter()
            .map(|&id| UnitLayout::new(self.rt.units().optimizer_place(id), o.state_dtype, o.master_dtype))
            .collect()
    }

    /// Takes each unit's snapshot (this rank's elements `ranges`) and sends it to the writer; a
    /// device unit's copy within a claim of its staging, waiting for the writer to let earlier
    /// copies go when the ledger has no room (module docs).
    fn send_snapshots(
        &self,
        units: &[UnitSpec],
        layouts: &[UnitLayout],
        ranges: &[Range<usize>],
        tx: &crossbeam_channel::Sender<Staged>,
        room: &Room,
    ) -> Result<()> {
        let ledger = self.rt.memory().host_ledger();
        for (k, spec) in units.iter().enumerate() {
            let range = ranges[k].clone();
            if range.is_empty() {
                continue;
            }
            let claim = match layouts[k].is_device() {
                false => None,
                true => {
                    let bytes = layouts[k].staging_bytes(range.len());
                    let mut p = room.state.lock();
                    let claim = loop {
                        match ledger.claim(HostUse::Checkpoint, bytes) {
                            Ok(c) => break c,
                            Err(e) if p.bytes == 0 || p.ended => return Err(RuntimeError::from(e).into()),
                            Err(_) => room.changed.wait(&mut p),
                        }
                    };
                    p.bytes += bytes;
                    Some((claim, bytes))
                }
            };
            let taken = self.rt.local_unit_snapshot(self.ids[k]);
            let give_back = |claim: &Option<(HostClaim, u64)>| {
                let bytes = claim.as_ref().map_or(0, |c| c.1);
                room.update(|p| p.bytes -= bytes);
            };
            let (held, snap) = taken.inspect_err(|_| give_back(&claim))?;
            if held != range {
                give_back(&claim);
                let msg = format!(
                    "unit {}: this rank holds elements {held:?} of its state, its checkpoint shard is {range:?}",
                    spec.name
                );
                return Err(RuntimeError::Usage(msg).into());
            }
            room.update(|p| p.unread += 1);
            if let Err(e) = tx.send(Staged { unit: k, range, snap, claim }) {
                // The writer has ended (it failed): its error is the save's.
                give_back(&e.0.claim);
                room.update(|p| p.unread -= 1);
                return Ok(());
            }
        }
        Ok(())
    }
}

/// The writer thread: reads each unit's snapshot as it arrives into `staging` (a device unit's
/// copy is read already), appends it, then closes the file (`close`). After an error it drops
/// what it is sent and returns the error once the trainer is done sending. Gives the staging
/// back either way.
fn write_all(
    mut w: Writer,
    mut staging: Staging,
    units: &[UnitSpec],
    layouts: &[UnitLayout],
    rx: crossbeam_channel::Receiver<Staged>,
    room: &Room,
    close: Close,
) -> (Result<Saved>, Staging) {
    /// However the writer ends (a panic too), the trainer stops waiting on it.
    struct Ended<'a>(&'a Room);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            self.0.update(|p| p.ended = true);
        }
    }
    let _ended = Ended(room);
    let mut failed: Option<TrainError> = None;
    for s in rx {
        let copied = s.claim.as_ref().map_or(0, |c| c.1);
        let (spec, layout) = (&units[s.unit], layouts[s.unit]);
        let r = match (&failed, s.snap) {
            (Some(_), snap) => {
                drop(snap);
                room.update(|p| p.unread -= 1);
                Ok(())
            }
            (None, UnitSnapshot::Copied(state)) => {
                room.update(|p| p.unread -= 1);
                ckpt::write_unit(&mut w, spec, layout, &state, s.range.clone()).map_err(TrainError::from)
            }
            (None, UnitSnapshot::Optimizer(snap)) => {
                let read = snap.read_into(&mut staging.state);
                room.update(|p| p.unread -= 1);
                read.map_err(|e| TrainError::from(RuntimeError::from(e)))
                    .and_then(|()| Ok(ckpt::write_unit(&mut w, spec, layout, &staging.state, s.range.clone())?))
            }
        };
        if let Err(e) = r {
            failed = Some(e);
        }
        drop(s.claim);
        room.update(|p| p.bytes -= copied);
    }
    let r = match failed {
        Some(e) => Err(e),
        None => match close {
            Close::Finish { keep } => w.finish(keep).map_err(TrainError::from),
            Close::Shard => w.complete().map_err(TrainError::from),
        },
    };
    (r, staging)
}

impl Drop for Trainer {
    /// Waits for a checkpoint still in flight (a run failing or returning without
    /// [`Trainer::finish_checkpoint`]): a world of one's file is completed and renamed; a rank's
    /// shard is completed but no index is written, so the set does not count.
    fn drop(&mut self) {
        if let Some(f) = self.in_flight.take() {
            let step = f.step;
            match f.join(&mut self.ckpt_staging) {
                Ok(saved) => tracing::info!(step, path = %saved.path.display(), "checkpoint in flight completed"),
                Err(e) => tracing::error!(step, error = %e, "checkpoint in flight failed"),
            }
        }
    }
}
