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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use safetensors::tensor::Dtype;

use super::{io, list, path_for, remove_stale_temp_files, CheckpointError, Result};
use crate::checksum::{checksum_entries, TensorChecksum};

/// Bytes of the buffer between a [`Writer`]'s caller and its file (the only memory a writer
/// holds besides the header).
pub const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// A tensor of a checkpoint to be written: what its header entry needs before its data exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// safetensors key, e.g. `blocks.0.attn.qkv.weight.exp_avg`.
    pub name: String,
    /// Element type (F32, BF16, I8 or U8 in oogc's checkpoints).
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A tensor called `name` of `dtype` and `shape`.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self { name: name.into(), dtype, shape }
    }

    /// Bytes of its data: the product of `shape` × the dtype's size.
    pub fn num_bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() as u64 * self.dtype.bitsize() as u64).div_ceil(8)
    }
}

/// What a finished [`Writer`] saved.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
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
    file: Option<BufWriter<File>>,
    metadata: HashMap<String, String>,
    tensors: Vec<TensorSpec>,
    /// crc32c of each tensor written in full, in order.
    crcs: Vec<u32>,
    /// The tensor being written: its bytes so far and their crc32c.
    filled: u64,
    crc: u32,
    header_len: usize,
    data_bytes: u64,
    written: u64,
    half_way: bool,
    start: Instant,
}

impl Writer {
    /// Starts the checkpoint of `step` in `dir` (created if needed): its temp file
    /// (`ckpt-{step:08}.safetensors.tmp`) with the header of `tensors` (in the order their data
    /// will be appended) and `metadata` (plus `step`; the checksum entries are added).
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
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let invalid = |reason: String| CheckpointError::Corrupt { path: dir.to_path_buf(), reason };
        let mut seen = HashSet::new();
        for t in &tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(invalid(format!("tensor {} is named twice", t.name)));
            }
        }
        let mut info: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        info.insert("step".into(), step.to_string());
        let header = header(&info, &tensors, None).map_err(invalid)?;
        let data_bytes: u64 = tensors.iter().map(TensorSpec::num_bytes).sum();
        let needed = 8 + header.len() as u64 + data_bytes;
        if let Ok(free) = crate::runtime::budget::statvfs_free_bytes(dir) {
            if free < needed {
                return Err(CheckpointError::NoSpace {
                    dir: dir.to_path_buf(),
                    needed_bytes: needed,
                    free_bytes: free,
                });
            }
        }
        let path = path_for(dir, step);
        let tmp = path.with_extension("safetensors.tmp");
        let file = File::create(&tmp).map_err(io(&tmp))?;
        let mut w = Self {
            dir: dir.to_path_buf(),
            path,
            tmp,
            file: Some(BufWriter::with_capacity(WRITE_BUFFER_BYTES, file)),
            metadata: info,
            tensors,
            crcs: Vec::new(),
            filled: 0,
            crc: 0,
            header_len: header.len(),
            data_bytes,
            written: 0,
            half_way: false,
            start: Instant::now(),
        };
        let f = w.file.as_mut().expect("open");
        let r = f.write_all(&(header.len() as u64).to_le_bytes()).and_then(|_| f.write_all(header.as_bytes()));
        r.map_err(|e| w.write_error(e))?;
        w.skip_empty();
        Ok(w)
    }

    /// The tensor whose data the next [`Writer::append`] continues, `None` when every tensor is
    /// complete.
    pub fn next_tensor(&self) -> Option<&TensorSpec> {
        self.tensors.get(self.crcs.len())
    }

    /// Bytes of tensor data written so far, of [`Writer::data_bytes`].
    pub fn written_bytes(&self) -> u64 {
        self.written
    }

    /// Bytes of tensor data the file holds when complete.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// Appends `bytes` of tensor data (little-endian), continuing where the last call stopped,
    /// in the order of the tensors given to [`Writer::create`]: a call may hold part of a
    /// tensor, one, or the end of one and the start of the next.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] when `bytes` run past the last tensor; [`CheckpointError::Io`]
    /// or [`CheckpointError::NoSpace`] when the write fails (the temp file is removed when the
    /// writer is dropped; earlier checkpoints are untouched).
    pub fn append(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let Some(spec) = self.tensors.get(self.crcs.len()) else {
                return Err(CheckpointError::Corrupt {
                    path: self.tmp.clone(),
                    reason: format!("{} bytes of data past the last tensor", bytes.len()),
                });
            };
            let take = (spec.num_bytes() - self.filled).min(bytes.len() as u64) as usize;
            let (now, rest) = bytes.split_at(take);
            self.crc = crc32c::crc32c_append(self.crc, now);
            let f = self.file.as_mut().expect("a writer is open until finished");
            f.write_all(now).map_err(|e| self.write_error(e))?;
            self.filled += take as u64;
            self.written += take as u64;
            bytes = rest;
            self.skip_empty();
            if !self.half_way && 2 * self.written >= self.data_bytes {
                self.half_way = true;
                self.file.as_mut().expect("open").flush().map_err(|e| self.write_error(e))?;
                // Test hooks (crate::hooks): the soak kills a run half-way through this write.
                crate::hooks::pause_point("checkpoint");
                crate::hooks::crash_point("checkpoint");
            }
        }
        Ok(())
    }

    /// Closes the tensor being written when it is complete, and every empty one after it.
    fn skip_empty(&mut self) {
        while let Some(spec) = self.tensors.get(self.crcs.len()) {
            if self.filled < spec.num_bytes() {
                break;
            }
            self.crcs.push(std::mem::take(&mut self.crc));
            self.filled = 0;
        }
    }

    /// An I/O error of the temp file: [`CheckpointError::NoSpace`] when the disk is full.
    fn write_error(&self, e: std::io::Error) -> CheckpointError {
        if e.kind() == std::io::ErrorKind::StorageFull {
            let free = crate::runtime::budget::statvfs_free_bytes(&self.dir).unwrap_or(0);
            let needed = (8 + self.header_len as u64 + self.data_bytes).saturating_sub(8 + self.written);
            return CheckpointError::NoSpace { dir: self.dir.clone(), needed_bytes: needed, free_bytes: free };
        }
        io(&self.tmp)(e)
    }

    /// Completes the file: writes the real checksums into its header, syncs it, renames it to
    /// `ckpt-{step:08}.safetensors`, syncs the directory, and deletes older checkpoints beyond
    /// the newest `keep` (at least 1) and temp files a killed run left.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] when a tensor's data is incomplete (nothing renamed);
    /// [`CheckpointError::Io`] / [`CheckpointError::NoSpace`].
    pub fn finish(mut self, keep: usize) -> Result<Saved> {
        if let Some(t) = self.next_tensor() {
            return Err(CheckpointError::Corrupt {
                path: self.tmp.clone(),
                reason: format!(
                    "tensor {} has {} of {} bytes ({} of {} data bytes written)",
                    t.name,
                    self.filled,
                    t.num_bytes(),
                    self.written,
                    self.data_bytes
                ),
            });
        }
        if !self.half_way {
            // A checkpoint without data still passes the hooks' point.
            self.half_way = true;
            crate::hooks::pause_point("checkpoint");
            crate::hooks::crash_point("checkpoint");
        }
        let header = header(&self.metadata, &self.tensors, Some(&self.crcs))
            .map_err(|reason| CheckpointError::Corrupt { path: self.tmp.clone(), reason })?;
        assert_eq!(header.len(), self.header_len, "checksum entries are fixed width");
        let w = self.file.take().expect("open");
        let result = (|| -> std::io::Result<u64> {
            let mut file = w.into_inner().map_err(|e| e.into_error())?;
            file.seek(SeekFrom::Start(8))?;
            file.write_all(header.as_bytes())?;
            file.sync_all()?;
            Ok(file.metadata()?.len())
        })();
        let tmp = self.tmp.clone();
        let bytes = match result {
            Ok(bytes) => bytes,
            Err(e) => {
                let err = self.write_error(e);
                let _ = std::fs::remove_file(&tmp);
                return Err(err);
            }
        };
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&self.path)(e));
        }
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(&self.dir))?;
        let mut all = list(&self.dir)?;
        while all.len() > keep.max(1) {
            let (_, old) = all.remove(0);
            std::fs::remove_file(&old).map_err(io(&old))?;
        }
        remove_stale_temp_files(&self.dir);
        Ok(Saved { path: self.path.clone(), bytes, seconds: self.start.elapsed().as_secs_f64() })
    }
}

impl Drop for Writer {
    /// An unfinished writer (an error, a panic) removes its temp file.
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The safetensors header of `tensors` (data in their order) with `metadata` and the checksum
/// entries (`crcs`: each tensor's crc32c; `None` for the placeholder of the same length),
/// padded with spaces to a multiple of 8 bytes. The same inputs give the same bytes (metadata
/// keys sorted). Errors: a shape whose size overflows.
fn header(
    metadata: &HashMap<String, String>,
    tensors: &[TensorSpec],
    crcs: Option<&[u32]>,
) -> std::result::Result<String, String> {
    use serde_json::{Map, Value};
    let mut offset = 0u64;
    let mut entries = Vec::with_capacity(tensors.len());
    let mut checksums = Vec::with_capacity(tensors.len());
    for (k, t) in tensors.iter().enumerate() {
        let elems = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        let end = elems
            .and_then(|n| n.checked_mul(t.dtype.bitsize() as u64))
            .and_then(|bits| offset.checked_add(bits.div_ceil(8)))
            .ok_or_else(|| format!("tensor {}: shape {:?} overflows", t.name, t.shape))?;
        entries.push((
            t.name.clone(),
            serde_json::json!({ "dtype": format!("{:?}", t.dtype), "shape": t.shape, "data_offsets": [offset, end] }),
        ));
        offset = end;
        checksums.push(TensorChecksum {
            name: &t.name,
            dtype: format!("{:?}", t.dtype),
            shape: &t.shape,
            crc32c: crcs.map_or(0, |c| c[k]),
        });
    }
    let mut metadata = metadata.clone();
    checksum_entries(&mut metadata, &checksums);
    let sorted: BTreeMap<String, String> = metadata.into_iter().collect();
    let mut m = Map::new();
    m.insert("__metadata__".into(), Value::Object(sorted.into_iter().map(|(k, v)| (k, Value::from(v))).collect()));
    for (name, entry) in entries {
        m.insert(name, entry);
    }
    let mut header = Value::Object(m).to_string();
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    Ok(header)
}
