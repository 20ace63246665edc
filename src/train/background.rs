//! Checkpoints written in the background: [`Trainer::start_checkpoint`] takes each unit's state
//! as it is between two steps and a writer thread streams it into the file while training goes
//! on; [`Trainer::finish_checkpoint`] completes the save (with ranks: a collective on every
//! rank's shard, then rank 0's index).
//!
//! The split is CheckFreq's (Mohan et al., FAST '21): a snapshot the trainer waits for, then a
//! persist it does not. A unit's snapshot is its optimizer's
//! ([`oogc_optimizer::StateSnapshot`]: host-placed state copied, NVMe-placed state held by its
//! extents, copy-on-write, so an update during the save writes new extents and leaves the
//! snapshot's alone; a device-resident unit's state copied D2H). Each snapshot claims its unit's
//! staging ([`crate::runtime::budget::checkpoint_staging_bytes`], category `checkpoint`) from the
//! host ledger until the writer has appended it; the snapshots held at once are bounded by the
//! room the run has never used (the ledger's budget less its peak so far), so a save never
//! takes memory a step needs. When that room is spent the trainer waits for the writer to let
//! earlier units go: a run whose state outgrows the room (the beyond-RAM run) saves partly in
//! the foreground, in at most one unit's staging at a time, as a synchronous save does.
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
use oogc_swapper::{HostClaim, HostUse};
use parking_lot::{Condvar, Mutex};

use super::ckpt::{self, UnitLayout};
use super::{Result, TrainError, Trainer};
use crate::checkpoint::{self, CheckpointError, Saved, Writer};
use crate::runtime::{RuntimeError, UnitSnapshot};

/// Host bytes the snapshots of a save hold, shared by the trainer (which takes them) and the
/// writer thread (which lets them go once appended).
#[derive(Debug, Default)]
struct Room {
    held: Mutex<Held>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Held {
    /// Host bytes of the staging claimed.
    bytes: u64,
    /// NVMe bytes of extents kept by copy-on-write snapshots.
    nvme: u64,
    /// The writer failed: it drops what it is sent, and the trainer stops sending.
    failed: bool,
}

impl Room {
    /// Gives back `bytes` of host staging and `nvme` bytes of extents (and records a failure),
    /// waking the trainer.
    fn release(&self, bytes: u64, nvme: u64, failed: bool) {
        let mut h = self.held.lock();
        h.bytes -= bytes;
        h.nvme -= nvme;
        h.failed |= failed;
        self.changed.notify_all();
    }
}

/// One unit's snapshot on its way to the writer, with the claim of its staging.
struct Staged {
    /// The unit's index in the model.
    unit: usize,
    /// The elements of the unit it holds (a rank's shard, or all of them).
    range: Range<usize>,
    snap: UnitSnapshot,
    /// The claim of its staging, of `bytes`.
    claim: HostClaim,
    bytes: u64,
    /// NVMe bytes the snapshot keeps allocated.
    nvme: u64,
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
    job: std::result::Result<JoinHandle<Result<Saved>>, TrainError>,
    /// When it started (the save's seconds run from here).
    started: Instant,
}

impl InFlight {
    fn finished(&self) -> bool {
        self.job.as_ref().map_or(true, JoinHandle::is_finished)
    }

    /// Waits for the writer: what it saved, or its error.
    fn join(self) -> Result<Saved> {
        let handle = self.job?;
        match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
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
        let started = Instant::now();
        let step = self.step;
        let writer = match writer {
            Ok(w) => w,
            Err(e) if world.size > 1 => {
                // Shared with the other ranks when the save completes.
                self.in_flight = Some(InFlight { step, job: Err(e.into()), started });
                return Ok(Some(began.elapsed().as_secs_f64()));
            }
            Err(e) => return Err(e.into()),
        };
        let room = Arc::new(Room::default());
        let (tx, rx) = crossbeam_channel::unbounded::<Staged>();
        let thread = {
            let (room, layouts, units) = (Arc::clone(&room), layouts.clone(), units.clone());
            std::thread::Builder::new()
                .name("oogc-checkpoint".into())
                .spawn(move || write_all(writer, &units, &layouts, rx, &room, close))
                .map_err(|e| RuntimeError::Usage(format!("cannot start the checkpoint writer thread: {e}")))?
        };
        let sent = self.send_snapshots(&units, &layouts, &ranges, &tx, &room);
        drop(tx);
        let job = match sent {
            Ok(()) => Ok(thread),
            Err(e) => {
                // The writer sees its channel end early and drops its temp file.
                let _ = thread.join();
                if world.size == 1 {
                    return Err(e);
                }
                Err(e) // shared with the other ranks when the save completes
            }
        };
        self.in_flight = Some(InFlight { step, job, started });
        Ok(Some(began.elapsed().as_secs_f64()))
    }

    /// Whether a checkpoint is being written ([`Trainer::start_checkpoint`]).
    pub fn checkpoint_in_flight(&self) -> bool {
        self.in_flight.is_some()
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
            let f = self.in_flight.take().expect("in flight");
            let started = f.started;
            return f.join().map(|s| Some(Saved { seconds: started.elapsed().as_secs_f64(), ..s }));
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
    fn finish_shards(&mut self, f: InFlight) -> Result<Option<Saved>> {
        use checkpoint::shards::{self, ShardIndex};
        let world = self.ranks.world();
        let dir = self.cfg.checkpoint.dir.clone().expect("a run that checkpoints has a directory");
        let (step, started) = (f.step, f.started);
        let name = shards::shard_file_name(step, world.rank, world.size);
        let written = f.join();
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
        let layouts = self.layouts();
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

    /// Each unit's layout in a checkpoint, in the model's order.
    fn layouts(&self) -> Vec<UnitLayout> {
        let o = &self.cfg.optimizer;
        self.ids
            .iter()
            .map(|&id| UnitLayout::new(self.rt.units().optimizer_place(id), o.state_dtype, o.master_dtype))
            .collect()
    }

    /// Takes each unit's snapshot (this rank's elements `ranges`) within a claim of its staging
    /// and sends it to the writer, waiting for staging room (module docs).
    fn send_snapshots(
        &self,
        units: &[UnitSpec],
        layouts: &[UnitLayout],
        ranges: &[Range<usize>],
        tx: &crossbeam_channel::Sender<Staged>,
        room: &Room,
    ) -> Result<()> {
        let ledger = self.rt.memory().host_ledger();
        // The room the run has never used: snapshots held beside a step stay within the host
        // budget and the NVMe store.
        let spare = ledger.budget_bytes().saturating_sub(ledger.peak_bytes());
        let spare_nvme = self.rt.memory().nvme_spare_bytes();
        for (k, spec) in units.iter().enumerate() {
            let range = ranges[k].clone();
            if range.is_empty() {
                continue;
            }
            let bytes = layouts[k].staging_bytes(range.len());
            let claim = {
                let mut held = room.held.lock();
                loop {
                    if held.failed {
                        return Ok(()); // the writer's error is the save's
                    }
                    if held.bytes == 0 || held.bytes + bytes <= spare {
                        match ledger.claim(HostUse::Checkpoint, bytes) {
                            Ok(c) => break c,
                            Err(e) if held.bytes == 0 => return Err(RuntimeError::from(e).into()),
                            Err(_) => {}
                        }
                    }
                    room.changed.wait(&mut held);
                }
            };
            room.held.lock().bytes += bytes;
            let (held, snap) =
                self.rt.local_unit_snapshot(self.ids[k]).inspect_err(|_| room.release(bytes, 0, false))?;
            if held != range {
                room.release(bytes, 0, false);
                let msg = format!(
                    "unit {}: this rank holds elements {held:?} of its state, its checkpoint shard is {range:?}",
                    spec.name
                );
                return Err(RuntimeError::Usage(msg).into());
            }
            let nvme = snap.nvme_bytes();
            room.held.lock().nvme += nvme;
            if tx.send(Staged { unit: k, range, snap, claim, bytes, nvme }).is_err() {
                room.release(bytes, nvme, true);
            }
            // Extents kept beyond the store's spare room are read before training goes on.
            let mut held = room.held.lock();
            while held.nvme > spare_nvme && !held.failed {
                room.changed.wait(&mut held);
            }
        }
        Ok(())
    }
}

/// The writer thread: appends each unit's snapshot as it arrives (read, then written, then let
/// go), then closes the file (`close`). After an error it drops what it is sent (giving back
/// its room) and returns the error once the trainer is done sending.
fn write_all(
    mut w: Writer,
    units: &[UnitSpec],
    layouts: &[UnitLayout],
    rx: crossbeam_channel::Receiver<Staged>,
    room: &Room,
    close: Close,
) -> Result<Saved> {
    let mut failed: Option<TrainError> = None;
    for s in rx {
        let (bytes, nvme) = (s.bytes, s.nvme);
        if failed.is_none() {
            let r = s.snap.read().map_err(TrainError::from).and_then(|state| {
                Ok(ckpt::write_unit(&mut w, &units[s.unit], layouts[s.unit], &state, s.range.clone())?)
            });
            failed = r.err();
        } else {
            drop(s.snap);
        }
        drop(s.claim);
        room.release(bytes, nvme, failed.is_some());
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(match close {
        Close::Finish { keep } => w.finish(keep)?,
        Close::Shard => w.complete()?,
    })
}

impl Drop for Trainer {
    /// Waits for a checkpoint still in flight (a run failing or returning without
    /// [`Trainer::finish_checkpoint`]): a world of one's file is completed and renamed; a rank's
    /// shard is completed but no index is written, so the set does not count.
    fn drop(&mut self) {
        if let Some(f) = self.in_flight.take() {
            let step = f.step;
            match f.join() {
                Ok(saved) => tracing::info!(step, path = %saved.path.display(), "checkpoint in flight completed"),
                Err(e) => tracing::error!(step, error = %e, "checkpoint in flight failed"),
            }
        }
    }
}
