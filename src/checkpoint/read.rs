//! Streamed loads: [`Reader`] opens a checkpoint file by its header alone and reads one tensor
//! at a time (positioned reads: no mapping, so what was read leaves the process with its
//! buffer), checking each tensor's crc32c as it is read. A resume holds one unit's state at a
//! time, never the model's; [`Reader::verify`] checks a whole file through a fixed buffer.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata};

use super::{io, previous, CheckpointError, NamedTensor, Result, TensorData};
use crate::checksum::{self, Verification};

/// Bytes [`Reader::verify`] reads at a time.
const VERIFY_CHUNK_BYTES: usize = 1 << 20;

/// Largest header a checkpoint may have (safetensors' own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A checkpoint file open for reading (module docs).
#[derive(Debug)]
pub struct Reader {
    path: PathBuf,
    file: File,
    /// Offset of the data (8 + the header's length).
    data_start: u64,
    layout: Metadata,
    /// The header's `__metadata__`, checksum entries included.
    raw: HashMap<String, String>,
    metadata: BTreeMap<String, String>,
    /// The `step` metadata entry, parsed (an error message when it does not parse).
    step: Option<std::result::Result<u64, String>>,
    has_checksums: bool,
}

impl Reader {
    /// Opens the checkpoint `path` (or, given a directory, its newest checkpoint): reads and
    /// parses its header, checks that the file holds exactly the data the header describes, and
    /// verifies the manifest (metadata, names, dtypes, shapes: [`checksum::verify_manifest`]).
    /// Tensor data is checked as it is read.
    ///
    /// # Errors
    /// [`CheckpointError::NotFound`] for a directory without checkpoints; [`CheckpointError::Io`];
    /// [`CheckpointError::Corrupt`] when the file is truncated or not safetensors;
    /// [`CheckpointError::Checksum`] when its manifest fails (naming the previous checkpoint);
    /// [`CheckpointError::Corrupt`] for a sharded checkpoint's index (read by
    /// [`super::AnyReader`]).
    /// Any safetensors file with oogc's checksums opens (a Hugging Face export's shards too:
    /// `oogc inspect --verify`); [`Reader::step`] tells a checkpoint.
    pub fn open(path: &Path) -> Result<Self> {
        let path = if path.is_dir() { super::latest(path)? } else { path.to_path_buf() };
        let corrupt = |reason: String| CheckpointError::Corrupt { path: path.clone(), reason };
        if path.to_string_lossy().ends_with(super::shards::INDEX_SUFFIX) {
            return Err(corrupt("a sharded checkpoint's index, not a file: read it with checkpoint::AnyReader".into()));
        }
        let file = File::open(&path).map_err(io(&path))?;
        let len = file.metadata().map_err(io(&path))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| corrupt(format!("{len} bytes: shorter than a safetensors header")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES || 8 + n > len {
            return Err(corrupt(format!("header length {n} does not fit the file's {len} bytes: it is truncated")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(io(&path))?;
        let header = std::str::from_utf8(&header).map_err(|e| corrupt(format!("header: {e}")))?;
        let layout: Metadata = serde_json::from_str(header).map_err(|e| corrupt(format!("header: {e}")))?;
        let data_start = 8 + n;
        if data_start + layout.data_len() as u64 != len {
            return Err(corrupt(format!(
                "the header describes {} data bytes, the file holds {}: it is truncated or padded",
                layout.data_len(),
                len - data_start
            )));
        }
        let raw = layout.metadata().clone().unwrap_or_default();
        let infos = layout.tensors();
        let has_checksums = checksum::verify_manifest(
            &raw,
            infos.iter().map(|(name, info)| (name.as_str(), format!("{:?}", info.dtype), info.shape.as_slice())),
        )
        .map_err(|source| CheckpointError::Checksum {
            path: path.clone(),
            source,
            previous: previous(&path),
        })?;
        let mut metadata: BTreeMap<String, String> =
            raw.iter().filter(|(k, _)| !checksum::is_checksum_key(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let step = metadata.remove("step").map(|s| s.parse::<u64>().map_err(|e| format!("step `{s}`: {e}")));
        Ok(Self { path, file, data_start, layout, raw, metadata, step, has_checksums })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Optimizer steps the checkpoint holds (its `step` metadata).
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] when the file has no `step` entry (not a checkpoint) or it
    /// does not parse.
    pub fn step(&self) -> Result<u64> {
        let corrupt = |reason: String| CheckpointError::Corrupt { path: self.path.clone(), reason };
        match &self.step {
            None => Err(corrupt("no `step` in the metadata".into())),
            Some(Err(e)) => Err(corrupt(e.clone())),
            Some(Ok(step)) => Ok(*step),
        }
    }

    /// Its string metadata, without `step` and the checksum entries.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Whether the file carries checksums (one written before they existed does not: its
    /// tensors are read unverified).
    pub fn has_checksums(&self) -> bool {
        self.has_checksums
    }

    /// Tensor names in file order.
    pub fn names(&self) -> Vec<String> {
        self.layout.offset_keys()
    }

    /// The dtype and shape of tensor `name`, if the file has it.
    pub fn info(&self, name: &str) -> Option<(Dtype, &[usize])> {
        self.layout.info(name).map(|i| (i.dtype, i.shape.as_slice()))
    }

    /// Bytes of tensor data in the file.
    pub fn data_bytes(&self) -> u64 {
        self.layout.data_len() as u64
    }

    /// Reads tensor `name` (`None` when the file has no such tensor) and checks its crc32c.
    ///
    /// # Errors
    /// [`CheckpointError::Io`]; [`CheckpointError::Checksum`] naming the tensor and the previous
    /// checkpoint; [`CheckpointError::Corrupt`] for a dtype other than F32, BF16, I8 or U8.
    pub fn tensor(&self, name: &str) -> Result<Option<NamedTensor>> {
        let Some(info) = self.layout.info(name) else { return Ok(None) };
        let (start, end) = info.data_offsets;
        let n = info.shape.iter().product::<usize>();
        let at = self.data_start + start as u64;
        let read = |buf: &mut [u8]| -> Result<()> {
            debug_assert_eq!(buf.len(), end - start);
            self.file.read_exact_at(buf, at).map_err(io(&self.path))?;
            self.check(name, buf)
        };
        let data = match info.dtype {
            Dtype::F32 => {
                let mut v = vec![0f32; n];
                read(bytemuck::cast_slice_mut(&mut v))?;
                TensorData::F32(v)
            }
            Dtype::BF16 => {
                let mut v = vec![half::bf16::ZERO; n];
                read(bytemuck::cast_slice_mut(&mut v))?;
                TensorData::BF16(v)
            }
            Dtype::I8 => {
                let mut v = vec![0i8; n];
                read(bytemuck::cast_slice_mut(&mut v))?;
                TensorData::I8(v)
            }
            Dtype::U8 => {
                let mut v = vec![0u8; n];
                read(&mut v)?;
                TensorData::U8(v)
            }
            other => {
                return Err(CheckpointError::Corrupt {
                    path: self.path.clone(),
                    reason: format!("tensor {name} is {other:?}, expected F32, BF16, I8 or U8"),
                })
            }
        };
        Ok(Some(NamedTensor { name: name.to_string(), shape: info.shape.clone(), data }))
    }

    /// Checks `bytes` (tensor `name`'s data) against its stored crc32c, if the file has them.
    fn check(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let fail =
            |source| CheckpointError::Checksum { path: self.path.clone(), source, previous: previous(&self.path) };
        if let Some(expected) = checksum::stored_tensor_checksum(&self.raw, name).map_err(fail)? {
            checksum::verify_tensor(name, expected, bytes).map_err(fail)?;
        }
        Ok(())
    }

    /// Checks every tensor's data against its crc32c, reading the file through one buffer of
    /// 1 MiB (the manifest was checked at open).
    ///
    /// # Errors
    /// [`CheckpointError::Io`]; [`CheckpointError::Checksum`] naming the first tensor that
    /// fails.
    pub fn verify(&self) -> Result<Verification> {
        if !self.has_checksums {
            return Ok(Verification::Unverified);
        }
        let mut buf = vec![0u8; VERIFY_CHUNK_BYTES];
        let names = self.names();
        for name in &names {
            let info = self.layout.info(name).expect("a name of the file");
            let (start, end) = info.data_offsets;
            let mut crc = 0u32;
            let mut at = start;
            while at < end {
                let len = (end - at).min(buf.len());
                self.file.read_exact_at(&mut buf[..len], self.data_start + at as u64).map_err(io(&self.path))?;
                crc = crc32c::crc32c_append(crc, &buf[..len]);
                at += len;
            }
            let fail =
                |source| CheckpointError::Checksum { path: self.path.clone(), source, previous: previous(&self.path) };
            let expected =
                checksum::stored_tensor_checksum(&self.raw, name).map_err(fail)?.expect("the file has checksums");
            if crc != expected {
                return Err(fail(checksum::ChecksumError::Tensor { name: name.clone(), expected, actual: crc }));
            }
        }
        Ok(Verification::Verified { tensors: names.len(), bytes: self.data_bytes() })
    }
}
