//! Checkpoints: one safetensors file per saved step, written atomically (temp file, fsync,
//! rename, fsync of the directory), so a run killed at any moment leaves either the previous
//! checkpoint or the new one, never a torn file (DESIGN.md invariant 4).
//!
//! Saves and loads stream: [`Writer`] writes the header from the tensors' shapes first and
//! appends each tensor's data as the caller produces it (the trainer: one unit's state at a
//! time), [`Reader`] opens a file by its header and reads one tensor at a time. [`save`] and
//! [`load`] are the whole-[`Checkpoint`] forms over them, for small checkpoints and tests.
//!
//! A checkpoint holds tensors by name (the trainer stores each parameter's f32 master weights
//! and Adam `exp_avg` / `exp_avg_sq` in the run's `[optimizer] state_dtype`: f32, bf16, or int8
//! codes beside their blocks' f32 absmax) and string metadata (step, RNG and data position, the
//! config). Files are named `ckpt-{step:08}.safetensors`; [`latest`] picks the highest step.
//! With data-parallel ranks a checkpoint is one file per rank and an index naming them
//! (`ckpt-{step:08}.index.json`, [`shards`]); [`AnyReader`] reads either form.
//!
//! Every checkpoint carries a crc32c per tensor and one for the file in its metadata
//! ([`crate::checksum`]); [`load`] verifies them and names the tensor and the previous
//! checkpoint on a mismatch; [`newest_verified`] is `--resume --fallback`'s choice. A checkpoint
//! written before checksums existed loads with a warning that it cannot be verified.

mod read;
pub mod shards;
mod write;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

pub use read::Reader;
pub use shards::{AnyReader, ShardIndex, ShardedReader};
pub(crate) use write::prune;
pub use write::{Saved, TensorSpec, Writer, WRITE_BUFFER_BYTES};

/// A checkpoint cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file system operation failed.
    #[error("checkpoint I/O on {path}: {source}\n  fix: check that the directory exists, is writable and has space")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a valid checkpoint.
    #[error("corrupt checkpoint {path}: {reason}\n  fix: resume from an older checkpoint in the same directory")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A checksum mismatch: one byte of the file changed since it was written.
    #[error(
        "corrupt checkpoint {path}: {source}\n  fix: {}",
        previous.as_ref().map_or_else(
            || "no older checkpoint is left beside it: start over (remove the directory) or restore it from a backup".to_string(),
            |p| format!("resume from the previous checkpoint (--resume {}), or add --fallback to resume from the newest checkpoint that verifies", p.display())
        )
    )]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Which checksum failed (names the tensor).
        source: crate::checksum::ChecksumError,
        /// The newest older checkpoint in the same directory, if any.
        previous: Option<PathBuf>,
    },
    /// The checkpoint does not fit the free space of its directory's file system (checked
    /// before writing, and a write that fails for space). Nothing of the previous checkpoints
    /// is touched.
    #[error(
        "no space for the checkpoint in {dir}: it needs {needed_bytes} more bytes, the file system has {free_bytes} free\n  \
         fix: free space there, lower [checkpoint] keep, or point [checkpoint] dir at a larger disk"
    )]
    NoSpace {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Bytes the rest of the file needs.
        needed_bytes: u64,
        /// Bytes free for this process.
        free_bytes: u64,
    },
    /// A sharded save that another rank could not complete: no index was written, so the
    /// checkpoint does not exist and the previous one is intact.
    #[error(
        "the checkpoint of step {step} was not saved: rank(s) {ranks:?} could not write their shard (their error \
         says why); no index was written, the previous checkpoint is intact\n  fix: see those ranks' error (a full \
         disk: free space there, lower [checkpoint] keep, or point [checkpoint] dir at a larger disk)"
    )]
    RankFailed {
        /// The step of the checkpoint.
        step: u64,
        /// The ranks whose shard failed.
        ranks: Vec<usize>,
    },
    /// No checkpoint in the directory.
    #[error("no checkpoint (ckpt-*.safetensors) in {dir}\n  fix: pass the [checkpoint] dir of a run that saved one")]
    NotFound {
        /// The directory searched.
        dir: PathBuf,
    },
}

/// Result of checkpoint operations.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// One tensor: name, shape, row-major data (`data.len()` = product of `shape`).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// safetensors key, e.g. `blocks.0.attn.qkv.weight.exp_avg`.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values.
    pub data: TensorData,
}

/// A checkpoint tensor's values, in one of the element types a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f32 (master weights, f32 moments, int8 moments' block absmax).
    F32(Vec<f32>),
    /// bf16 moments.
    BF16(Vec<half::bf16>),
    /// int8 codes of `m` (the linear map).
    I8(Vec<i8>),
    /// uint8 codes of `v` (the dynamic tree map).
    U8(Vec<u8>),
}

impl TensorData {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(d) => d.len(),
            TensorData::BF16(d) => d.len(),
            TensorData::I8(d) => d.len(),
            TensorData::U8(d) => d.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The little-endian bytes (`num_bytes()` of them).
    pub fn bytes(&self) -> &[u8] {
        match self {
            TensorData::F32(d) => bytemuck::cast_slice(d),
            TensorData::BF16(d) => bytemuck::cast_slice(d),
            TensorData::I8(d) => bytemuck::cast_slice(d),
            TensorData::U8(d) => d,
        }
    }

    /// The values widened to f32 (f32 values moved, not copied), or the dtype of a tensor that is
    /// neither f32 nor bf16.
    pub fn into_f32(self) -> std::result::Result<Vec<f32>, Dtype> {
        match self {
            TensorData::F32(d) => Ok(d),
            TensorData::BF16(d) => Ok(d.iter().map(|b| b.to_f32()).collect()),
            other => Err(other.dtype()),
        }
    }

    /// The f32 values, if the tensor is f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            TensorData::F32(d) => Some(d),
            _ => None,
        }
    }

    /// The safetensors element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            TensorData::F32(_) => Dtype::F32,
            TensorData::BF16(_) => Dtype::BF16,
            TensorData::I8(_) => Dtype::I8,
            TensorData::U8(_) => Dtype::U8,
        }
    }
}

/// A checkpoint in memory.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Checkpoint {
    /// Optimizer steps completed.
    pub step: u64,
    /// String metadata (the `step` key is set from [`Checkpoint::step`]).
    pub metadata: BTreeMap<String, String>,
    /// Tensors, names unique.
    pub tensors: Vec<NamedTensor>,
}

impl Checkpoint {
    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&NamedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Total bytes of tensor data.
    pub fn num_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.bytes().len()).sum()
    }
}

/// The file a checkpoint of `step` is stored in under `dir`.
pub fn path_for(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt-{step:08}.safetensors"))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// Writes `ckpt` into `dir` atomically and deletes older checkpoints beyond the newest `keep`.
/// Returns the file written.
///
/// # Errors
/// [`CheckpointError::Io`] (directory not creatable, disk full: the temp file is removed and the
/// previous checkpoints are untouched).
pub fn save(dir: &Path, ckpt: &Checkpoint, keep: usize) -> Result<PathBuf> {
    let specs = ckpt.tensors.iter().map(|t| TensorSpec::new(t.name.clone(), t.data.dtype(), t.shape.clone())).collect();
    let mut w = Writer::create(dir, ckpt.step, &ckpt.metadata, specs)?;
    for t in &ckpt.tensors {
        if t.data.len() != t.shape.iter().product::<usize>() {
            return Err(CheckpointError::Corrupt {
                path: dir.into(),
                reason: format!("tensor {}: {} values for shape {:?}", t.name, t.data.len(), t.shape),
            });
        }
        w.append(t.data.bytes())?;
    }
    Ok(w.finish(keep)?.path)
}

/// Removes `ckpt-*.safetensors.tmp` files that a killed run left half-written, and ranks'
/// shards without their index (a save that failed on another rank, or a pruned set: the run
/// holds the directory's lock and saves one at a time, so no other writer is using them).
/// Failures are only logged.
fn remove_stale_temp_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let unindexed = shards::shard_step(name).is_some_and(|step| !shards::index_path(dir, step).exists());
        if unindexed || (name.starts_with("ckpt-") && name.ends_with(".safetensors.tmp")) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    tracing::info!(path = %entry.path().display(), "removed a half-written checkpoint of a killed run")
                }
                Err(e) => {
                    tracing::warn!(path = %entry.path().display(), error = %e, "cannot remove a half-written checkpoint")
                }
            }
        }
    }
}

/// Checkpoints in `dir`, oldest first, as (step, path): a single file's path, or a sharded
/// checkpoint's index (`ckpt-{step:08}.index.json`, [`shards`]). Temp files and shards are
/// ignored.
///
/// # Errors
/// [`CheckpointError::Io`] when the directory cannot be read.
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix("ckpt-") else { continue };
        let Some(step) = rest.strip_suffix(".safetensors").or_else(|| rest.strip_suffix(shards::INDEX_SUFFIX)) else {
            continue;
        };
        if let Ok(step) = step.parse::<u64>() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The newest checkpoint in `dir`.
///
/// # Errors
/// [`CheckpointError::NotFound`] when there is none; [`CheckpointError::Io`].
pub fn latest(dir: &Path) -> Result<PathBuf> {
    list(dir)?.pop().map(|(_, p)| p).ok_or_else(|| CheckpointError::NotFound { dir: dir.to_path_buf() })
}

/// The newest checkpoint older than `path` in its directory, if any.
pub fn previous(path: &Path) -> Option<PathBuf> {
    let dir = path.parent()?;
    // A rank's shard: the checkpoint is its index.
    let path = match path.file_name().and_then(|n| n.to_str()).and_then(shards::shard_step) {
        Some(step) => shards::index_path(dir, step),
        None => path.to_path_buf(),
    };
    let all = list(dir).ok()?;
    let pos = all.iter().position(|(_, p)| *p == path)?;
    pos.checked_sub(1).map(|i| all[i].1.clone())
}

/// Verifies a checkpoint's checksums — a file's, or every shard file's of a sharded one (given
/// its index, after checking the index against them: [`ShardedReader::open`]) — reading through
/// a fixed buffer (`oogc inspect --verify`, `--resume --fallback`).
///
/// # Errors
/// [`CheckpointError::Io`]; [`CheckpointError::Corrupt`] when it is not a valid safetensors
/// file, or a shard is missing or of another step; [`CheckpointError::Checksum`] naming the
/// file, the tensor that fails and the previous checkpoint.
pub fn verify(path: &Path) -> Result<crate::checksum::Verification> {
    AnyReader::open(path)?.verify()
}

/// A checkpoint that `--fallback` passed over.
#[derive(Debug)]
pub struct Skipped {
    /// The checkpoint.
    pub path: PathBuf,
    /// Why (the verification error).
    pub error: CheckpointError,
}

/// The newest checkpoint at or before `path` that verifies (`oogc train --resume DIR
/// --fallback`): `path` is a checkpoint directory, or a file (then it and the older checkpoints
/// beside it are candidates). Returns it and the newer ones passed over, newest first.
///
/// # Errors
/// [`CheckpointError::NotFound`] when there is no checkpoint; the last candidate's error when
/// none verifies.
pub fn newest_verified(path: &Path) -> Result<(PathBuf, Vec<Skipped>)> {
    let (dir, upto) = if path.is_dir() {
        (path.to_path_buf(), None)
    } else {
        (path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf), Some(path.to_path_buf()))
    };
    let mut candidates = list(&dir)?;
    if let Some(file) = &upto {
        match candidates.iter().position(|(_, p)| p == file) {
            Some(i) => candidates.truncate(i + 1),
            None => candidates = vec![(0, file.clone())],
        }
    }
    let mut skipped = Vec::new();
    while let Some((_, candidate)) = candidates.pop() {
        match verify(&candidate) {
            Ok(_) => return Ok((candidate, skipped)),
            Err(e @ (CheckpointError::Corrupt { .. } | CheckpointError::Checksum { .. })) if !candidates.is_empty() => {
                skipped.push(Skipped { path: candidate, error: e })
            }
            Err(e) => return Err(e),
        }
    }
    Err(CheckpointError::NotFound { dir })
}

/// Reads a checkpoint file or a sharded checkpoint's index (or, given a directory, its newest
/// checkpoint) and verifies its checksums; a checkpoint without checksums (written before they existed) loads with a
/// warning that it cannot be verified.
///
/// # Errors
/// [`CheckpointError::Io`], [`CheckpointError::NotFound`], [`CheckpointError::Checksum`] naming
/// the tensor that fails and the previous checkpoint, or [`CheckpointError::Corrupt`] when the
/// file is truncated, not safetensors, holds a tensor that is not f32, bf16, int8 or uint8, or
/// lacks the `step` key.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let r = AnyReader::open(path)?;
    if !r.has_checksums() {
        tracing::warn!(
            path = %r.path().display(),
            "checkpoint has no checksums (written before oogc checked them): it cannot be verified"
        );
    }
    let mut tensors = Vec::new();
    for name in r.names() {
        tensors.push(r.tensor(&name)?.expect("a name of the file"));
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Checkpoint { step: r.step()?, metadata: r.metadata().clone(), tensors })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use safetensors::tensor::TensorView;

    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            metadata: [("sampler".to_string(), "{\"x\":1}".to_string())].into(),
            tensors: vec![
                NamedTensor {
                    name: "a".into(),
                    shape: vec![2, 3],
                    data: TensorData::F32((0..6).map(|i| i as f32 * 0.5).collect()),
                },
                NamedTensor {
                    name: "b.exp_avg".into(),
                    shape: vec![1],
                    data: TensorData::F32(vec![f32::MIN_POSITIVE]),
                },
                NamedTensor { name: "c.exp_avg".into(), shape: vec![3], data: TensorData::I8(vec![-127, 0, 5]) },
                NamedTensor { name: "c.exp_avg_sq".into(), shape: vec![2], data: TensorData::U8(vec![255, 1]) },
                NamedTensor {
                    name: "d.exp_avg".into(),
                    shape: vec![2],
                    data: TensorData::BF16(vec![half::bf16::MIN_POSITIVE_SUBNORMAL, half::bf16::NEG_ONE]),
                },
            ],
        }
    }

    #[test]
    fn round_trip_keep_and_latest() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20, 30] {
            save(dir.path(), &sample(step), 2).unwrap();
        }
        let steps: Vec<u64> = list(dir.path()).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![20, 30]);
        let back = load(dir.path()).unwrap();
        assert_eq!(back, sample(30));
        assert_eq!(back.num_bytes(), 24 + 4 + 3 + 2 + 4);
    }

    #[test]
    fn truncated_file_is_corrupt_and_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &sample(5), 2).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = load(&path).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("ckpt-00000005"), "{err}");
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(load(empty.path()).unwrap_err(), CheckpointError::NotFound { .. }));
    }

    /// Flips one byte in the middle of the data of the file's largest tensor.
    fn flip_mid_data(path: &Path) {
        let mut bytes = std::fs::read(path).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mid = header + (bytes.len() - header) / 2;
        bytes[mid] ^= 0x10;
        std::fs::write(path, bytes).unwrap();
    }

    fn big(step: u64) -> Checkpoint {
        let mut c = sample(step);
        c.tensors.push(NamedTensor {
            name: "big.w".into(),
            shape: vec![64],
            data: TensorData::F32((0..64).map(|i| i as f32).collect()),
        });
        c.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        c
    }

    #[test]
    fn a_flipped_byte_is_an_error_naming_the_file_the_tensor_and_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let older = save(dir.path(), &big(1), 3).unwrap();
        let newest = save(dir.path(), &big(2), 3).unwrap();
        let bytes = 4 * 71 + 3 + 2 + 4;
        assert_eq!(verify(&newest).unwrap(), crate::checksum::Verification::Verified { tensors: 6, bytes });
        flip_mid_data(&newest);
        let err = load(dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, CheckpointError::Checksum { .. }), "{text}");
        for needle in ["ckpt-00000002", "tensor big.w", "ckpt-00000001", "--fallback"] {
            assert!(text.contains(needle), "`{needle}` not in: {text}");
        }
        assert!(verify(&newest).is_err());
        // --fallback: the newest that verifies, naming the one passed over.
        let (chosen, skipped) = newest_verified(dir.path()).unwrap();
        assert_eq!(chosen, older);
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].path, newest);
        assert_eq!(load(&chosen).unwrap(), big(1));
        // Nothing verifies: the error of the oldest, which has no previous one.
        flip_mid_data(&older);
        let err = newest_verified(dir.path()).unwrap_err().to_string();
        assert!(err.contains("ckpt-00000001") && err.contains("no older checkpoint"), "{err}");
    }

    #[test]
    fn a_checkpoint_without_checksums_still_loads() {
        let dir = tempfile::tempdir().unwrap();
        let c = sample(4);
        let views: Vec<_> = c
            .tensors
            .iter()
            .map(|t| (t.name.clone(), TensorView::new(t.data.dtype(), t.shape.clone(), t.data.bytes()).unwrap()))
            .collect();
        let mut info: HashMap<String, String> = c.metadata.clone().into_iter().collect();
        info.insert("step".into(), "4".into());
        let path = path_for(dir.path(), 4);
        std::fs::write(&path, safetensors::serialize(views, Some(info)).unwrap()).unwrap();
        assert_eq!(verify(&path).unwrap(), crate::checksum::Verification::Unverified);
        assert_eq!(load(&path).unwrap(), c);
    }

    /// Tensors of every dtype, one empty, in an order that is not the alignment order.
    fn mixed() -> Checkpoint {
        Checkpoint {
            step: 9,
            metadata: [("k".to_string(), "v".to_string())].into(),
            tensors: vec![
                NamedTensor { name: "z.codes".into(), shape: vec![5], data: TensorData::U8(vec![1, 2, 3, 4, 5]) },
                NamedTensor {
                    name: "a.w".into(),
                    shape: vec![3, 2],
                    data: TensorData::F32((0..6).map(|i| i as f32 - 2.5).collect()),
                },
                NamedTensor { name: "empty".into(), shape: vec![0, 4], data: TensorData::F32(vec![]) },
                NamedTensor {
                    name: "m.bf16".into(),
                    shape: vec![3],
                    data: TensorData::BF16(vec![half::bf16::ONE, half::bf16::NEG_ONE, half::bf16::MAX]),
                },
                NamedTensor { name: "m.i8".into(), shape: vec![2], data: TensorData::I8(vec![-128, 127]) },
            ],
        }
    }

    fn specs(c: &Checkpoint) -> Vec<TensorSpec> {
        c.tensors.iter().map(|t| TensorSpec::new(t.name.clone(), t.data.dtype(), t.shape.clone())).collect()
    }

    /// The data appended in any cut — one byte at a time, chunks across tensor boundaries — is
    /// the same file as whole tensors; a reader gets each tensor back, verifies the file and
    /// names what it holds.
    #[test]
    fn a_streamed_write_is_the_same_file_however_its_data_is_cut() {
        let c = mixed();
        let whole = tempfile::tempdir().unwrap();
        let reference = std::fs::read(save(whole.path(), &c, 1).unwrap()).unwrap();
        let data: Vec<u8> = c.tensors.iter().flat_map(|t| t.data.bytes().to_vec()).collect();
        for cut in [1, 3, 7, data.len()] {
            let dir = tempfile::tempdir().unwrap();
            let mut w = Writer::create(dir.path(), c.step, &c.metadata, specs(&c)).unwrap();
            for chunk in data.chunks(cut) {
                assert!(w.next_tensor().is_some());
                w.append(chunk).unwrap();
            }
            assert_eq!(
                (w.next_tensor(), w.written_bytes(), w.data_bytes()),
                (None, data.len() as u64, data.len() as u64)
            );
            let saved = w.finish(1).unwrap();
            assert_eq!(std::fs::read(&saved.path).unwrap(), reference, "cut {cut}");
            assert_eq!(saved.bytes, reference.len() as u64);
        }
        let r = Reader::open(whole.path()).unwrap();
        assert_eq!((r.step().unwrap(), r.metadata().get("k").map(String::as_str)), (9, Some("v")));
        assert_eq!(r.names(), c.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>(), "file order");
        for t in &c.tensors {
            assert_eq!(r.tensor(&t.name).unwrap().as_ref(), Some(t));
        }
        assert_eq!(r.tensor("nope").unwrap(), None);
        // A safetensors file with checksums but no `step` (a Hugging Face export's shard) opens
        // and verifies; it is no checkpoint.
        let mut info = HashMap::from([("format".to_string(), "pt".to_string())]);
        let zeros = [0u8; 8];
        let views = vec![("w".to_string(), TensorView::new(Dtype::F32, vec![2], &zeros).unwrap())];
        crate::checksum::add_checksums(&mut info, &views);
        let shard = whole.path().join("model.safetensors");
        std::fs::write(&shard, safetensors::serialize(views, Some(info)).unwrap()).unwrap();
        let hf = Reader::open(&shard).unwrap();
        assert!(matches!(hf.verify(), Ok(crate::checksum::Verification::Verified { tensors: 1, bytes: 8 })));
        assert!(hf.step().unwrap_err().to_string().contains("no `step`"));
        let bytes = data.len() as u64;
        assert_eq!(r.verify().unwrap(), crate::checksum::Verification::Verified { tensors: 5, bytes });
    }

    /// A write that cannot complete — data past the last tensor, a tensor left short, a writer
    /// dropped half-way (an error of the caller) — leaves no temp file and the previous
    /// checkpoint as it was.
    #[test]
    fn an_unfinished_write_leaves_the_previous_checkpoint_and_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let before = save(dir.path(), &sample(1), 3).unwrap();
        let bytes = std::fs::read(&before).unwrap();
        let c = mixed();
        let data: Vec<u8> = c.tensors.iter().flat_map(|t| t.data.bytes().to_vec()).collect();
        let temp_files = || {
            std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp"))
                .count()
        };
        // Past the end.
        let mut w = Writer::create(dir.path(), 2, &c.metadata, specs(&c)).unwrap();
        assert_eq!(temp_files(), 1);
        w.append(&data).unwrap();
        let err = w.append(&[0]).unwrap_err();
        assert!(err.to_string().contains("past the last tensor"), "{err}");
        drop(w);
        assert_eq!(temp_files(), 0);
        // Short.
        let mut w = Writer::create(dir.path(), 2, &c.metadata, specs(&c)).unwrap();
        w.append(&data[..data.len() - 1]).unwrap();
        let err = w.finish(3).unwrap_err().to_string();
        assert!(err.contains("tensor m.i8 has 1 of 2 bytes"), "{err}");
        // Duplicate names are refused before anything is written.
        let mut twice = specs(&c);
        twice.push(twice[0].clone());
        let err = Writer::create(dir.path(), 2, &c.metadata, twice).unwrap_err().to_string();
        assert!(err.contains("z.codes is named twice"), "{err}");
        assert_eq!(temp_files(), 0);
        assert_eq!(list(dir.path()).unwrap(), vec![(1, before.clone())]);
        assert_eq!(std::fs::read(&before).unwrap(), bytes);
        assert_eq!(load(dir.path()).unwrap(), sample(1));
    }

    /// A tensor whose bytes changed fails when it is read, naming it; the others still read.
    #[test]
    fn a_reader_checks_each_tensor_as_it_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), &big(3), 2).unwrap();
        flip_mid_data(&path);
        let r = Reader::open(&path).unwrap();
        let err = r.tensor("big.w").unwrap_err().to_string();
        assert!(err.contains("tensor big.w") && err.contains("ckpt-00000003"), "{err}");
        assert_eq!(r.tensor("a").unwrap().unwrap().data, sample(3).tensors[0].data);
        assert!(r.verify().unwrap_err().to_string().contains("tensor big.w"));
    }
}
