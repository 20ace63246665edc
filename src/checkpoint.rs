//! Checkpoints: one safetensors file per saved step, written atomically (temp file, fsync,
//! rename, fsync of the directory), so a run killed at any moment leaves either the previous
//! checkpoint or the new one, never a torn file (DESIGN.md invariant 4).
//!
//! A checkpoint holds f32 tensors by name (the trainer stores each parameter's master weights
//! and Adam `exp_avg` / `exp_avg_sq`) and string metadata (step, RNG and data position, the
//! config). Files are named `ckpt-{step:08}.safetensors`; [`latest`] picks the highest step.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

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
    /// No checkpoint in the directory.
    #[error("no checkpoint (ckpt-*.safetensors) in {dir}\n  fix: pass the [checkpoint] dir of a run that saved one")]
    NotFound {
        /// The directory searched.
        dir: PathBuf,
    },
}

/// Result of checkpoint operations.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// One tensor: name, shape, row-major f32 data (`data.len()` = product of `shape`).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// safetensors key, e.g. `blocks.0.attn.qkv.weight.exp_avg`.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
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
        self.tensors.iter().map(|t| t.data.len() * 4).sum()
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
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut info: HashMap<String, String> = ckpt.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    info.insert("step".into(), ckpt.step.to_string());
    let views = ckpt
        .tensors
        .iter()
        .map(|t| {
            let view = TensorView::new(Dtype::F32, t.shape.clone(), bytemuck::cast_slice(&t.data)).map_err(|e| {
                CheckpointError::Corrupt { path: dir.into(), reason: format!("tensor {}: {e}", t.name) }
            })?;
            Ok((t.name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, Some(info))
        .map_err(|e| CheckpointError::Corrupt { path: dir.into(), reason: e.to_string() })?;
    let path = path_for(dir, ckpt.step);
    let tmp = path.with_extension("safetensors.tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(&tmp)(e));
    }
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))?;
    let mut all = list(dir)?;
    while all.len() > keep.max(1) {
        let (_, old) = all.remove(0);
        std::fs::remove_file(&old).map_err(io(&old))?;
    }
    Ok(path)
}

/// Checkpoints in `dir`, oldest first, as (step, path). Temp files are ignored.
///
/// # Errors
/// [`CheckpointError::Io`] when the directory cannot be read.
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(step) = name.strip_prefix("ckpt-").and_then(|s| s.strip_suffix(".safetensors")) {
            if let Ok(step) = step.parse::<u64>() {
                out.push((step, entry.path()));
            }
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

/// Reads a checkpoint file (or, given a directory, its newest checkpoint).
///
/// # Errors
/// [`CheckpointError::Io`], [`CheckpointError::NotFound`], or [`CheckpointError::Corrupt`] when
/// the file is truncated, not safetensors, holds a non-f32 tensor or lacks the `step` key.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let path = if path.is_dir() { latest(path)? } else { path.to_path_buf() };
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.clone(), reason };
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let mut metadata: BTreeMap<String, String> = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    let step = metadata
        .remove("step")
        .ok_or_else(|| corrupt("no `step` in the metadata".into()))?
        .parse::<u64>()
        .map_err(|e| corrupt(format!("step: {e}")))?;
    let mut tensors = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            if view.dtype() != Dtype::F32 {
                return Err(corrupt(format!("tensor {name} is {:?}, expected F32", view.dtype())));
            }
            let data = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Ok(NamedTensor { name, shape: view.shape().to_vec(), data })
        })
        .collect::<Result<Vec<_>>>()?;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Checkpoint { step, metadata, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            metadata: [("sampler".to_string(), "{\"x\":1}".to_string())].into(),
            tensors: vec![
                NamedTensor { name: "a".into(), shape: vec![2, 3], data: (0..6).map(|i| i as f32 * 0.5).collect() },
                NamedTensor { name: "b.exp_avg".into(), shape: vec![1], data: vec![f32::MIN_POSITIVE] },
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
        assert_eq!(back.num_bytes(), 28);
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
}
