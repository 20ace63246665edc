//! One safetensors file written as its data is produced: [`StreamedFile`], the mechanism under
//! every file oogc writes tensor by tensor (the Hugging Face export's shards,
//! `hf::write_safetensors`; the trainer's checkpoints, `oogc::checkpoint::Writer`), so that a
//! writer holds one piece of data at a time, never the file's.
//!
//! The header is written first from the tensors' names, dtypes and shapes with placeholder
//! [`crate::checksum`] entries (all `0`: their values are fixed width, so the header's length
//! does not change); the data is appended in the tensors' order, in pieces of any size, each
//! tensor's crc32c computed over its bytes as they pass; [`StreamedFile::finish`] writes the
//! real checksums over the header and syncs the file. Naming, renaming and cleaning up are the
//! caller's (each writer has its own rules).
//!
//! Tensors are laid out in the order given, not sorted by alignment as
//! `safetensors::serialize` does: a tensor's data may start at any byte.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::checksum::{checksum_entries, TensorChecksum};

/// Bytes of the buffer between a [`StreamedFile`]'s caller and the file.
pub const BUFFER_BYTES: usize = 1 << 20;

/// A tensor of a file to be written: what its header entry needs before its data exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// safetensors key, e.g. `model.layers.0.mlp.up_proj.weight`.
    pub name: String,
    /// Element type (oogc writes F32, BF16, F16, I8 and U8).
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A tensor called `name` of `dtype` and `shape`.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self { name: name.into(), dtype, shape }
    }

    /// Bytes of its data: the product of `shape` × the dtype's size (saturating: a shape that
    /// overflows is refused by [`StreamedFile::create`]).
    pub fn num_bytes(&self) -> u64 {
        let elems = self.shape.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64));
        elems.saturating_mul(self.dtype.bitsize() as u64).div_ceil(8)
    }
}

/// What went wrong writing a [`StreamedFile`].
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The tensors or the data do not make a file: a name given twice, a shape whose size
    /// overflows, data past the last tensor or short of it.
    #[error("{0}")]
    Invalid(String),
    /// Writing failed (`ErrorKind::StorageFull` when the disk is full).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A safetensors file being written, tensor by tensor (module docs).
///
/// ```
/// use std::collections::BTreeMap;
/// use oogc_models::streamed::{StreamedFile, TensorSpec};
/// use safetensors::Dtype;
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("x.safetensors");
/// let tensors = vec![TensorSpec::new("w", Dtype::F32, vec![2]), TensorSpec::new("c", Dtype::U8, vec![3])];
/// let mut f = StreamedFile::create(&path, &BTreeMap::new(), tensors).unwrap();
/// f.append(&[1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat()).unwrap();
/// f.append(&[1, 2, 3]).unwrap();
/// f.finish().unwrap();
/// let bytes = std::fs::read(&path).unwrap();
/// let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
/// assert_eq!(st.tensor("c").unwrap().data(), &[1u8, 2, 3][..]);
/// ```
#[derive(Debug)]
pub struct StreamedFile {
    path: PathBuf,
    file: BufWriter<File>,
    metadata: BTreeMap<String, String>,
    tensors: Vec<TensorSpec>,
    /// crc32c of each tensor written in full, in order.
    crcs: Vec<u32>,
    /// The tensor being written: its bytes so far and their crc32c.
    filled: u64,
    crc: u32,
    header_len: usize,
    data_bytes: u64,
    written: u64,
}

impl StreamedFile {
    /// Creates `path` (truncating it) and writes the header of `tensors` (in the order their
    /// data will be appended) with `metadata` and placeholder checksums.
    ///
    /// # Errors
    /// [`StreamError::Invalid`] for a tensor name given twice or a shape whose size overflows
    /// (nothing created); [`StreamError::Io`].
    pub fn create(
        path: &Path,
        metadata: &BTreeMap<String, String>,
        tensors: Vec<TensorSpec>,
    ) -> Result<Self, StreamError> {
        let mut seen = HashSet::new();
        for t in &tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(StreamError::Invalid(format!("tensor {} is named twice", t.name)));
            }
        }
        let header = header(metadata, &tensors, None).map_err(StreamError::Invalid)?;
        let data_bytes = tensors.iter().map(TensorSpec::num_bytes).sum();
        let mut file = BufWriter::with_capacity(BUFFER_BYTES, File::create(path)?);
        file.write_all(&(header.len() as u64).to_le_bytes())?;
        file.write_all(header.as_bytes())?;
        let mut f = Self {
            path: path.to_path_buf(),
            file,
            metadata: metadata.clone(),
            tensors,
            crcs: Vec::new(),
            filled: 0,
            crc: 0,
            header_len: header.len(),
            data_bytes,
            written: 0,
        };
        f.skip_empty();
        Ok(f)
    }

    /// Bytes of the whole file once complete: 8 + header + data.
    pub fn file_bytes(&self) -> u64 {
        8 + self.header_len as u64 + self.data_bytes
    }

    /// Bytes of tensor data the file holds when complete.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// Bytes of tensor data written so far.
    pub fn written_bytes(&self) -> u64 {
        self.written
    }

    /// The tensor whose data the next [`StreamedFile::append`] continues, `None` when every
    /// tensor is complete.
    pub fn next_tensor(&self) -> Option<&TensorSpec> {
        self.tensors.get(self.crcs.len())
    }

    /// Bytes of [`Self::next_tensor`] written so far.
    pub fn next_tensor_filled(&self) -> u64 {
        self.filled
    }

    /// Appends `bytes` of tensor data (little-endian), continuing where the last call stopped,
    /// in the order of the tensors given to [`StreamedFile::create`]: a call may hold part of a
    /// tensor, one, or the end of one and the start of the next.
    ///
    /// # Errors
    /// [`StreamError::Invalid`] when `bytes` run past the last tensor (the bytes before it are
    /// written); [`StreamError::Io`].
    pub fn append(&mut self, mut bytes: &[u8]) -> Result<(), StreamError> {
        while !bytes.is_empty() {
            let Some(spec) = self.tensors.get(self.crcs.len()) else {
                return Err(StreamError::Invalid(format!("{} bytes of data past the last tensor", bytes.len())));
            };
            let take = (spec.num_bytes() - self.filled).min(bytes.len() as u64) as usize;
            let (now, rest) = bytes.split_at(take);
            self.crc = crc32c::crc32c_append(self.crc, now);
            self.file.write_all(now)?;
            self.filled += take as u64;
            self.written += take as u64;
            bytes = rest;
            self.skip_empty();
        }
        Ok(())
    }

    /// Writes the buffered bytes to the file.
    ///
    /// # Errors
    /// [`StreamError::Io`].
    pub fn flush(&mut self) -> Result<(), StreamError> {
        Ok(self.file.flush()?)
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

    /// Completes the file: the real checksums over the header, then `sync_all`. Returns the
    /// file's length in bytes.
    ///
    /// # Errors
    /// [`StreamError::Invalid`] when a tensor's data is incomplete (naming it; the file is left
    /// for the caller to remove); [`StreamError::Io`].
    pub fn finish(self) -> Result<u64, StreamError> {
        if let Some(t) = self.next_tensor() {
            return Err(StreamError::Invalid(format!(
                "tensor {} has {} of {} bytes ({} of {} data bytes written)",
                t.name,
                self.filled,
                t.num_bytes(),
                self.written,
                self.data_bytes
            )));
        }
        let header = header(&self.metadata, &self.tensors, Some(&self.crcs)).map_err(StreamError::Invalid)?;
        assert_eq!(header.len(), self.header_len, "checksum entries are fixed width");
        let mut file = self.file.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(8))?;
        file.write_all(header.as_bytes())?;
        file.sync_all()?;
        Ok(file.metadata()?.len())
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The safetensors header of `tensors` (data in their order) with `metadata` and the checksum
/// entries (`crcs`: each tensor's crc32c; `None` for the placeholder of the same length),
/// padded with spaces to a multiple of 8 bytes. The same inputs give the same bytes.
///
/// # Errors
/// A shape whose size overflows, named.
pub fn header(
    metadata: &BTreeMap<String, String>,
    tensors: &[TensorSpec],
    crcs: Option<&[u32]>,
) -> Result<String, String> {
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
    let mut info: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    checksum_entries(&mut info, &checksums);
    let sorted: BTreeMap<String, String> = info.into_iter().collect();
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
