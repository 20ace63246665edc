//! Checksums inside safetensors files (DESIGN.md invariant 2): a crc32c per tensor and one for
//! the file, stored as `__metadata__` string entries, so any safetensors reader still loads the
//! file and any writer (the checkpoint writer, a Hugging Face exporter) can add them.
//!
//! | entry | value |
//! |---|---|
//! | `oogc.crc32c:<tensor name>` | crc32c (Castagnoli) of the tensor's data bytes, 8 lowercase hex digits |
//! | `oogc.crc32c` | crc32c of the file's **manifest**, 8 lowercase hex digits |
//!
//! The manifest is, with every length a little-endian u64: for each metadata entry except
//! `oogc.crc32c`, sorted by key (bytewise), `len(key) key len(value) value`; then for each tensor,
//! sorted by name, `len(name) name len(dtype) dtype ndim dim…` (`dtype` as safetensors names it,
//! `F32`). It covers the metadata, names, dtypes and shapes, and — through the per-tensor entries
//! it includes — every data byte: one flipped byte anywhere in a file is either a parse error or a
//! checksum mismatch, naming the tensor when the byte is in its data.
//!
//! A file without any of these entries (written before they existed, or by another tool) is
//! [`Verification::Unverified`]: callers load it with a warning. A file with some of them must
//! have all of them.

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::{SafeTensors, View};

/// Metadata key of the file's checksum (the manifest's crc32c).
pub const FILE_KEY: &str = "oogc.crc32c";

/// Prefix of a tensor's checksum key: `oogc.crc32c:<tensor name>`.
pub const TENSOR_KEY_PREFIX: &str = "oogc.crc32c:";

/// A checksum does not match, or the checksum entries are malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChecksumError {
    /// A tensor's data does not match its stored crc32c.
    #[error("tensor {name} fails its crc32c (stored {expected:08x}, computed {actual:08x}): its data is corrupt")]
    Tensor {
        /// The tensor.
        name: String,
        /// Stored checksum.
        expected: u32,
        /// Checksum of the bytes read.
        actual: u32,
    },
    /// The manifest (metadata, names, dtypes, shapes, tensor checksums) does not match.
    #[error(
        "the file's crc32c fails (stored {expected:08x}, computed {actual:08x}): its header (metadata, tensor names, \
         dtypes or shapes) is corrupt"
    )]
    File {
        /// Stored checksum.
        expected: u32,
        /// Checksum of the manifest read.
        actual: u32,
    },
    /// The file has checksums but none for this tensor (or no file checksum).
    #[error("no checksum entry `{key}` although the file has checksums: the header is corrupt")]
    Missing {
        /// The missing metadata key.
        key: String,
    },
    /// A checksum entry is not 8 lowercase hex digits, or names no tensor.
    #[error("checksum entry `{key}` = `{value}` is malformed (8 lowercase hex digits naming a tensor of the file)")]
    Malformed {
        /// The key.
        key: String,
        /// Its value.
        value: String,
    },
}

/// What [`verify`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verification {
    /// Every tensor and the manifest match their checksums.
    Verified {
        /// Tensors checked.
        tensors: usize,
        /// Data bytes checked.
        bytes: u64,
    },
    /// The file carries no checksums (written before they existed, or by another tool): it
    /// cannot be verified.
    Unverified,
}

/// crc32c of one tensor's data bytes (the `crc32c` crate: SSE4.2 / ARMv8 instructions when the
/// CPU has them, as the NVMe store's blocks).
pub fn tensor_checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn hex(x: u32) -> String {
    format!("{x:08x}")
}

fn parse_hex(key: &str, value: &str) -> Result<u32, ChecksumError> {
    let ok = value.len() == 8 && value.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let malformed = || ChecksumError::Malformed { key: key.to_string(), value: value.to_string() };
    if !ok {
        return Err(malformed());
    }
    u32::from_str_radix(value, 16).map_err(|_| malformed())
}

/// The manifest's crc32c (module docs) over `metadata` (the [`FILE_KEY`] entry is left out) and
/// `(name, dtype, shape)` of each tensor.
fn manifest_checksum<'a>(
    metadata: &HashMap<String, String>,
    tensors: impl Iterator<Item = (&'a str, String, &'a [usize])>,
) -> u32 {
    let mut crc = 0u32;
    let put = |crc: &mut u32, bytes: &[u8]| {
        *crc = crc32c::crc32c_append(*crc, &(bytes.len() as u64).to_le_bytes());
        *crc = crc32c::crc32c_append(*crc, bytes);
    };
    let sorted: BTreeMap<&str, &str> =
        metadata.iter().filter(|(k, _)| k.as_str() != FILE_KEY).map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for (k, v) in sorted {
        put(&mut crc, k.as_bytes());
        put(&mut crc, v.as_bytes());
    }
    let mut tensors: Vec<_> = tensors.collect();
    tensors.sort_by(|a, b| a.0.cmp(b.0));
    for (name, dtype, shape) in tensors {
        put(&mut crc, name.as_bytes());
        put(&mut crc, dtype.as_bytes());
        let mut dims = Vec::with_capacity(8 * (shape.len() + 1));
        dims.extend_from_slice(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            dims.extend_from_slice(&(d as u64).to_le_bytes());
        }
        crc = crc32c::crc32c_append(crc, &dims);
    }
    crc
}

/// Adds the checksum entries of `tensors` to `metadata` (a tensor's crc32c, then the file's),
/// for `safetensors::serialize(tensors, Some(metadata))`. Call it last: any metadata entry
/// changed afterwards fails [`verify`].
///
/// ```
/// use std::collections::HashMap;
/// use safetensors::tensor::{Dtype, TensorView};
/// let data = [0u8; 8];
/// let tensors = vec![("w".to_string(), TensorView::new(Dtype::F32, vec![2], &data).unwrap())];
/// let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
/// oogc_models::checksum::add_checksums(&mut metadata, &tensors);
/// let bytes = safetensors::serialize(tensors, Some(metadata)).unwrap();
/// assert!(matches!(oogc_models::checksum::verify_bytes(&bytes), Ok(oogc_models::checksum::Verification::Verified { tensors: 1, .. })));
/// ```
pub fn add_checksums<S: AsRef<str>, V: View>(metadata: &mut HashMap<String, String>, tensors: &[(S, V)]) {
    let entries: Vec<TensorChecksum<'_>> = tensors
        .iter()
        .map(|(name, view)| TensorChecksum {
            name: name.as_ref(),
            dtype: format!("{:?}", view.dtype()),
            shape: view.shape(),
            crc32c: tensor_checksum(&view.data()),
        })
        .collect();
    checksum_entries(metadata, &entries);
}

/// One tensor of a file as the checksum entries see it (for writers that stream the data and
/// compute each crc32c as they go: [`checksum_entries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorChecksum<'a> {
    /// The tensor's name in the file.
    pub name: &'a str,
    /// Its dtype as safetensors names it (`format!("{:?}", safetensors::Dtype)`: `F32`, `BF16`,
    /// `F16`).
    pub dtype: String,
    /// Its shape.
    pub shape: &'a [usize],
    /// crc32c of its data bytes ([`tensor_checksum`], or `crc32c::crc32c_append` over the bytes
    /// as they are written).
    pub crc32c: u32,
}

/// Inserts the checksum entries of `tensors` into `metadata`: `oogc.crc32c:<name>` per tensor,
/// then [`FILE_KEY`] over the manifest — what [`add_checksums`] adds, for a writer that has the
/// checksums but not the views (a streaming writer). Call it last, as [`add_checksums`].
///
/// The values are fixed-width (8 hex digits), so a writer can serialize a header with
/// placeholder checksums (e.g. all `0`) first and overwrite it in place with the real ones once
/// the data is written: the header's length does not change.
///
/// ```
/// use std::collections::HashMap;
/// use oogc_models::checksum::{checksum_entries, tensor_checksum, TensorChecksum};
/// let data = [1u8; 8];
/// let mut metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
/// let t = TensorChecksum { name: "w", dtype: "F32".into(), shape: &[2], crc32c: tensor_checksum(&data) };
/// checksum_entries(&mut metadata, &[t]);
/// assert_eq!(metadata["oogc.crc32c:w"], format!("{:08x}", tensor_checksum(&data)));
/// assert_eq!(metadata["oogc.crc32c"].len(), 8);
/// ```
pub fn checksum_entries(metadata: &mut HashMap<String, String>, tensors: &[TensorChecksum<'_>]) {
    for t in tensors {
        metadata.insert(format!("{TENSOR_KEY_PREFIX}{}", t.name), hex(t.crc32c));
    }
    let file = manifest_checksum(metadata, tensors.iter().map(|t| (t.name, t.dtype.clone(), t.shape)));
    metadata.insert(FILE_KEY.to_string(), hex(file));
}

/// The stored crc32c of tensor `name` in `metadata`, if the file has checksums: `Ok(None)` for
/// a file without any checksum entry ([`Verification::Unverified`]).
///
/// # Errors
/// [`ChecksumError::Missing`] when the file has checksums but none for `name`;
/// [`ChecksumError::Malformed`] for an entry that is not 8 lowercase hex digits.
pub fn stored_tensor_checksum(metadata: &HashMap<String, String>, name: &str) -> Result<Option<u32>, ChecksumError> {
    if !has_checksums(metadata) {
        return Ok(None);
    }
    let key = format!("{TENSOR_KEY_PREFIX}{name}");
    let stored = metadata.get(&key).ok_or_else(|| ChecksumError::Missing { key: key.clone() })?;
    parse_hex(&key, stored).map(Some)
}

/// Checks one tensor's data bytes against its stored crc32c (see [`stored_tensor_checksum`]).
///
/// # Errors
/// [`ChecksumError::Tensor`] naming the tensor on a mismatch.
pub fn verify_tensor(name: &str, expected: u32, bytes: &[u8]) -> Result<(), ChecksumError> {
    let actual = tensor_checksum(bytes);
    if expected != actual {
        return Err(ChecksumError::Tensor { name: name.to_string(), expected, actual });
    }
    Ok(())
}

/// Checks the manifest only (metadata, names, dtypes, shapes and the stored per-tensor
/// checksums; no data byte is read): the cheap check a reader does at open, before it checks
/// each tensor's data as it reads it ([`stored_tensor_checksum`], [`verify_tensor`]). `tensors`
/// are `(name, dtype as safetensors names it, shape)` of every tensor of the file. `Ok(true)`:
/// the file has checksums and its manifest matches; `Ok(false)`: it has none (unverifiable).
///
/// # Errors
/// As [`verify`], less [`ChecksumError::Tensor`]: a missing or malformed entry, an entry for a
/// tensor the file lacks, or a manifest mismatch.
pub fn verify_manifest<'a>(
    metadata: &HashMap<String, String>,
    tensors: impl IntoIterator<Item = (&'a str, String, &'a [usize])>,
) -> Result<bool, ChecksumError> {
    if !has_checksums(metadata) {
        return Ok(false);
    }
    let mut tensors: Vec<(&str, String, &[usize])> = tensors.into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(b.0));
    for (name, _, _) in &tensors {
        stored_tensor_checksum(metadata, name)?;
    }
    check_entries_name_tensors(metadata, |name| tensors.binary_search_by(|t| t.0.cmp(name)).is_ok())?;
    let stored = metadata.get(FILE_KEY).ok_or_else(|| ChecksumError::Missing { key: FILE_KEY.into() })?;
    let expected = parse_hex(FILE_KEY, stored)?;
    let actual = manifest_checksum(metadata, tensors.iter().map(|(n, d, s)| (*n, d.clone(), *s)));
    if expected != actual {
        return Err(ChecksumError::File { expected, actual });
    }
    Ok(true)
}

fn has_checksums(metadata: &HashMap<String, String>) -> bool {
    metadata.keys().any(|k| is_checksum_key(k))
}

/// An entry for a tensor the file does not have (a renamed tensor, a corrupt key) is malformed.
fn check_entries_name_tensors(
    metadata: &HashMap<String, String>,
    has_tensor: impl Fn(&str) -> bool,
) -> Result<(), ChecksumError> {
    for (key, value) in metadata {
        if let Some(name) = key.strip_prefix(TENSOR_KEY_PREFIX) {
            if !has_tensor(name) {
                return Err(ChecksumError::Malformed { key: key.clone(), value: value.clone() });
            }
        }
    }
    Ok(())
}

/// Checks a parsed safetensors file against its checksum entries (`metadata` is its
/// `__metadata__`, empty when it has none).
///
/// # Errors
/// The first [`ChecksumError`]: a tensor whose data fails its checksum (named), a missing or
/// malformed entry, or a manifest mismatch.
pub fn verify(st: &SafeTensors<'_>, metadata: &HashMap<String, String>) -> Result<Verification, ChecksumError> {
    if !has_checksums(metadata) {
        return Ok(Verification::Unverified);
    }
    let mut names: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let mut bytes = 0u64;
    for (name, view) in &names {
        let expected = stored_tensor_checksum(metadata, name)?.expect("the file has checksums");
        verify_tensor(name, expected, view.data())?;
        bytes += view.data().len() as u64;
    }
    check_entries_name_tensors(metadata, |name| names.binary_search_by(|(n, _)| n.as_str().cmp(name)).is_ok())?;
    let stored = metadata.get(FILE_KEY).ok_or_else(|| ChecksumError::Missing { key: FILE_KEY.into() })?;
    let expected = parse_hex(FILE_KEY, stored)?;
    let actual =
        manifest_checksum(metadata, names.iter().map(|(n, v)| (n.as_str(), format!("{:?}", v.dtype()), v.shape())));
    if expected != actual {
        return Err(ChecksumError::File { expected, actual });
    }
    Ok(Verification::Verified { tensors: names.len(), bytes })
}

/// A safetensors file that cannot be parsed, or fails [`verify`].
#[derive(Debug, thiserror::Error)]
pub enum VerifyBytesError {
    /// Not a valid safetensors file (truncated, bad header).
    #[error("not a valid safetensors file: {0}")]
    Parse(#[from] safetensors::SafeTensorError),
    /// A checksum mismatch.
    #[error(transparent)]
    Checksum(#[from] ChecksumError),
}

/// [`verify`] on the bytes of a whole safetensors file.
///
/// # Errors
/// [`VerifyBytesError::Parse`] for a file safetensors refuses; [`VerifyBytesError::Checksum`].
pub fn verify_bytes(bytes: &[u8]) -> Result<Verification, VerifyBytesError> {
    let (_, meta) = SafeTensors::read_metadata(bytes)?;
    let st = SafeTensors::deserialize(bytes)?;
    Ok(verify(&st, &meta.metadata().clone().unwrap_or_default())?)
}

/// Whether `key` is one of the checksum entries (readers that show metadata leave them out).
pub fn is_checksum_key(key: &str) -> bool {
    key == FILE_KEY || key.starts_with(TENSOR_KEY_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::{Dtype, TensorView};

    fn file(with_checksums: bool) -> Vec<u8> {
        let a: Vec<u8> = (0..24u8).collect();
        let b: Vec<u8> = (100..108u8).collect();
        let tensors = vec![
            ("a".to_string(), TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap()),
            ("b.exp_avg".to_string(), TensorView::new(Dtype::F32, vec![2], &b).unwrap()),
        ];
        let mut meta = HashMap::from([("step".to_string(), "7".to_string()), ("x".to_string(), "{\"y\":1}".into())]);
        if with_checksums {
            add_checksums(&mut meta, &tensors);
        }
        safetensors::serialize(tensors, Some(meta)).unwrap()
    }

    #[test]
    fn a_sealed_file_verifies_and_one_without_checksums_is_unverified() {
        assert_eq!(verify_bytes(&file(true)).unwrap(), Verification::Verified { tensors: 2, bytes: 32 });
        assert_eq!(verify_bytes(&file(false)).unwrap(), Verification::Unverified);
    }

    #[test]
    fn every_single_flipped_byte_is_caught() {
        let good = file(true);
        let data_start = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        for pos in 0..good.len() {
            for mask in [0x01u8, 0x20, 0x80] {
                let mut bad = good.clone();
                bad[pos] ^= mask;
                match verify_bytes(&bad) {
                    Ok(v) => panic!("byte {pos} ^ {mask:#x} not caught: {v:?}"),
                    // In the data: the tensor is named. In the header: any error (a changed
                    // offset may also show as a tensor mismatch).
                    Err(VerifyBytesError::Checksum(ChecksumError::Tensor { name, .. })) if pos >= data_start => {
                        let expected = if pos < data_start + 24 { "a" } else { "b.exp_avg" };
                        assert_eq!(name, expected, "byte {pos}");
                    }
                    Err(e) => assert!(pos < data_start, "byte {pos} ^ {mask:#x} in the data: {e}"),
                }
            }
        }
    }
}
