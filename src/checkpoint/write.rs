//! Streamed saves: [`Writer`] writes a checkpoint file tensor by tensor, so a save holds one
//! unit's state at a time, never the model's.
//!
//! The file is the one [`super::save`] writes (safetensors, a crc32c per tensor and one for the
//! file): the header is written first from the tensors' names, dtypes and shapes, with
//! placeholder checksums (all `0`: [`crate::checksum::checksum_entries`]' values are fixed
//! width, so the header's length does not change), the data is appended in the tensors' order
//! as the caller produces it, each tensor's crc32c computed over its bytes as they pass, and the
//! header is overwritten with the real checksums once the data is complete. Then the temp file
//! is synced and renamed, and the directory synced (DESIGN.md invariant 4): a run killed at any
//! moment leaves the previous checkpoint or the new one, never a torn file.
//!
//! Tensors are laid out in the order given, not sorted by alignment as
//! `safetensors::serialize` does: a tensor's data may start at any byte (oogc's readers copy
//! it out).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use oogc_models::streamed::TensorSpec;
use oogc_models::streamed::{StreamError, StreamedFile};

use super::{io, list, path_for, remove_stale_temp_files, CheckpointError, Result};

/// Bytes of the buffer between a [`Writer`]'s caller and its file (the only memory a writer
/// holds besides the header).
pub const WRITE_BUFFER_BYTES: usize = oogc_models::streamed::BUFFER_BYTES;

/// What a finished [`Writer`] saved.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// The step it holds.
    pub step: u64,
    /// The checkpoint file.
    pub path: PathBuf,
    /// Bytes of the file (header and data).
    pub bytes: u64,
    /// Seconds from [`Writer::create`] to the rename, including the caller's time between
    /// appends (reading the state it writes).
    pub seconds: f64,
}

/// A checkpoint file being written, tensor by tensor (module docs).
///
/// ```
/// use std::collections::BTreeMap;
/// use oogc::checkpoint::{Writer, TensorSpec};
/// use safetensors::Dtype;
/// let dir = tempfile::tempdir().unwrap();
/// let tensors = vec![TensorSpec::new("w", Dtype::F32, vec![2]), TensorSpec::new("c", Dtype::U8, vec![3])];
/// let mut w = Writer::create(dir.path(), 7, &BTreeMap::new(), tensors).unwrap();
/// w.append(bytemuck::cast_slice(&[1.0f32, 2.0])).unwrap();
/// w.append(&[1, 2, 3]).unwrap();
/// let saved = w.finish(2).unwrap();
/// let back = oogc::checkpoint::load(&saved.path).unwrap();
/// assert_eq!((back.step, back.tensor("c").unwrap().data.bytes()), (7, &[1u8, 2, 3][..]));
/// ```
#[derive(Debug)]
pub struct Writer {
    dir: PathBuf,
    path: PathBuf,
    tmp: PathBuf,
    /// `None` once finished (then `Drop` leaves the file alone).
    file: Option<StreamedFile>,
    half_way: bool,
    step: u64,
    start: Instant,
}

impl Writer {
    /// Starts the checkpoint of `step` in `dir` (created if needed): its temp file
    /// (`ckpt-{step:08}.safetensors.tmp`) with the header of `tensors` (in the order their data
    /// will be appended) and `metadata` (plus `step`; the checksum entries are added), an
    /// [`oogc_models::streamed::StreamedFile`].
    ///
    /// # Errors
    /// [`CheckpointError::NoSpace`] when the directory's file system has less free space than
    /// the file needs (nothing written); [`CheckpointError::Corrupt`] for duplicate tensor
    /// names or a shape whose size overflows; [`CheckpointError::Io`].
    pub fn create(
        dir: &Path,
        step: u64,
        metadata: &BTreeMap<String, String>,
        tensors: Vec<TensorSpec>,
    ) -> Result<Self> {
        Self::create_at(dir, path_for(dir, step), step, metadata, tensors)
    }

    /// [`Writer::create`] of the file `path` in `dir` (a rank's shard: [`super::shards`]).
    pub(crate) fn create_at(
        dir: &Path,
        path: PathBuf,
        step: u64,
        metadata: &BTreeMap<String, String>,
        tensors: Vec<TensorSpec>,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let invalid = |reason: String| CheckpointError::Corrupt { path: dir.to_path_buf(), reason };
        let mut info = metadata.clone();
        info.insert("step".into(), step.to_string());
        let header = oogc_models::streamed::header(&info, &tensors, None).map_err(invalid)?;
        let needed = 8 + header.len() as u64 + tensors.iter().map(TensorSpec::num_bytes).sum::<u64>();
        if let Ok(free) = crate::runtime::budget::statvfs_free_bytes(dir) {
            if free < needed {
                return Err(CheckpointError::NoSpace {
                    dir: dir.to_path_buf(),
                    needed_bytes: needed,
                    free_bytes: free,
                });
            }
        }
        let tmp = path.with_extension("safetensors.tmp");
        let file = match StreamedFile::create(&tmp, &info, tensors) {
            Ok(f) => f,
            Err(StreamError::Invalid(reason)) => return Err(invalid(reason)),
            Err(StreamError::Io(e)) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(io_or_no_space(dir, &tmp, needed, 0, e));
            }
        };
        Ok(Self { dir: dir.to_path_buf(), path, tmp, file: Some(file), half_way: false, step, start: Instant::now() })
    }

    fn file(&self) -> &StreamedFile {
        self.file.as_ref().expect("a writer is open until finished")
    }

    /// The tensor whose data the next [`Writer::append`] continues, `None` when every tensor is
    /// complete.
    pub fn next_tensor(&self) -> Option<&TensorSpec> {
        self.file().next_tensor()
    }

    /// Bytes of tensor data written so far, of [`Writer::data_bytes`].
    pub fn written_bytes(&self) -> u64 {
        self.file().written_bytes()
    }

    /// Bytes of tensor data the file holds when complete.
    pub fn data_bytes(&self) -> u64 {
        self.file().data_bytes()
    }

    /// Appends `bytes` of tensor data (little-endian), continuing where the last call stopped,
    /// in the order of the tensors given to [`Writer::create`]: a call may hold part of a
    /// tensor, one, or the end of one and the start of the next.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] when `bytes` run past the last tensor; [`CheckpointError::Io`]
    /// or [`CheckpointError::NoSpace`] when the write fails (the temp file is removed when the
    /// writer is dropped; earlier checkpoints are untouched).
    pub fn append(&mut self, bytes: &[u8]) -> Result<()> {
        let f = self.file.as_mut().expect("a writer is open until finished");
        let r = f.append(bytes);
        let r = r.and_then(|()| {
            if !self.half_way && 2 * f.written_bytes() >= f.data_bytes() {
                self.half_way = true;
                f.flush()?;
                // Test hooks (crate::hooks): the soak kills a run half-way through this write.
                crate::hooks::pause_point("checkpoint");
                crate::hooks::crash_point("checkpoint");
            }
            Ok(())
        });
        r.map_err(|e| self.stream_error(e))
    }

    /// A [`StreamError`] of the temp file: [`CheckpointError::NoSpace`] when the disk is full.
    fn stream_error(&self, e: StreamError) -> CheckpointError {
        match e {
            StreamError::Invalid(reason) => CheckpointError::Corrupt { path: self.tmp.clone(), reason },
            StreamError::Io(e) => {
                let f = self.file();
                io_or_no_space(&self.dir, &self.tmp, f.file_bytes(), 8 + f.written_bytes(), e)
            }
        }
    }

    /// Completes the file: writes the real checksums into its header, syncs it, renames it to
    /// `ckpt-{step:08}.safetensors`, syncs the directory, and deletes older checkpoints beyond
    /// the newest `keep` (at least 1) and temp files a killed run left.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] when a tensor's data is incomplete (nothing renamed);
    /// [`CheckpointError::Io`] / [`CheckpointError::NoSpace`].
    pub fn finish(self, keep: usize) -> Result<Saved> {
        let dir = self.dir.clone();
        let saved = self.complete()?;
        prune(&dir, keep)?;
        Ok(saved)
    }

    /// [`Writer::finish`] without the pruning: the file is complete, synced and renamed (a
    /// rank's shard, which counts once its set's index is written).
    pub(crate) fn complete(mut self) -> Result<Saved> {
        if let Some(t) = self.next_tensor() {
            let f = self.file();
            return Err(CheckpointError::Corrupt {
                path: self.tmp.clone(),
                reason: format!(
                    "tensor {} has {} of {} bytes ({} of {} data bytes written)",
                    t.name,
                    f.next_tensor_filled(),
                    t.num_bytes(),
                    f.written_bytes(),
                    f.data_bytes()
                ),
            });
        }
        if !self.half_way {
            // A checkpoint without data still passes the hooks' point.
            self.half_way = true;
            crate::hooks::pause_point("checkpoint");
            crate::hooks::crash_point("checkpoint");
        }
        let file = self.file.take().expect("open");
        let size = file.file_bytes();
        let tmp = self.tmp.clone();
        let bytes = match file.finish() {
            Ok(bytes) => bytes,
            Err(e) => {
                let err = match e {
                    StreamError::Invalid(reason) => CheckpointError::Corrupt { path: tmp.clone(), reason },
                    StreamError::Io(e) => io_or_no_space(&self.dir, &tmp, size, size, e),
                };
                let _ = std::fs::remove_file(&tmp);
                return Err(err);
            }
        };
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&self.path)(e));
        }
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(&self.dir))?;
        Ok(Saved { step: self.step, path: self.path.clone(), bytes, seconds: self.start.elapsed().as_secs_f64() })
    }
}

/// Deletes the checkpoints of `dir` beyond the newest `keep` (at least 1; a sharded one as a
/// whole set: its index first, so that it is never visible half-deleted, then its shards), and
/// the temp files and unindexed shards a killed run or a failed save left.
///
/// # Errors
/// [`CheckpointError::Io`] when a checkpoint cannot be deleted.
pub(crate) fn prune(dir: &Path, keep: usize) -> Result<()> {
    let mut all = list(dir)?;
    while all.len() > keep.max(1) {
        let (_, old) = all.remove(0);
        std::fs::remove_file(&old).map_err(io(&old))?;
    }
    remove_stale_temp_files(dir);
    Ok(())
}

impl Drop for Writer {
    /// An unfinished writer (an error, a panic) removes its temp file.
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// An I/O error writing `tmp` in `dir`: [`CheckpointError::NoSpace`] when the disk is full (the
/// bytes still needed: `file_bytes` less the `written` ones), else [`CheckpointError::Io`].
fn io_or_no_space(dir: &Path, tmp: &Path, file_bytes: u64, written: u64, e: std::io::Error) -> CheckpointError {
    if e.kind() == std::io::ErrorKind::StorageFull {
        let free = crate::runtime::budget::statvfs_free_bytes(dir).unwrap_or(0);
        return CheckpointError::NoSpace {
            dir: dir.to_path_buf(),
            needed_bytes: file_bytes.saturating_sub(written),
            free_bytes: free,
        };
    }
    io(tmp)(e)
}
