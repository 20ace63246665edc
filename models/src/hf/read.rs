//! Reading Hugging Face safetensors checkpoints tensor by tensor, unit by unit.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Map, Value};

use super::mmap::map_read_only;
use super::{HfDtype, INDEX_FILE, SINGLE_FILE};
use crate::checksum;
use crate::llama::LlamaConfig;
use crate::unit::UnitSpec;
use crate::{Error, Result};

/// Elements per rayon task when converting a tensor to f32.
const CONVERT_CHUNK: usize = 1 << 16;

/// Where one tensor of a checkpoint lies.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The safetensors file that holds it.
    pub path: PathBuf,
    /// Its dtype in the file.
    pub dtype: HfDtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Index of the file in the checkpoint's file list (internal).
    file: usize,
    /// Its stored crc32c, when the file carries [`crate::checksum`] entries (an oogc export);
    /// checked whenever its data is read.
    crc32c: Option<u32>,
    /// Byte range of its data from the start of the file.
    start: usize,
    end: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Debug)]
struct ShardFile {
    path: PathBuf,
    file: File,
}

/// A Hugging Face checkpoint directory opened for reading: its `config.json` and the headers
/// of its safetensors files (`model.safetensors`, or the shards named by
/// `model.safetensors.index.json`), with tensor data read on demand.
///
/// Nothing but the headers is read at [`HfCheckpoint::open`]. [`HfCheckpoint::read_unit`] maps
/// each shard it needs (`memmap2`, read-only), copies the unit's tensors into one flat f32 vector
/// (converting BF16/F16; F32 bits are kept) and unmaps, so at most one unit's data is resident
/// at a time (plus the page cache, which the OS may drop) — never the whole model.
///
/// A file with [`crate::checksum`] entries (an oogc export, [`super::write_safetensors`]) is
/// verified: its manifest (metadata, names, dtypes, shapes, the stored checksums) at open, and
/// each tensor's crc32c whenever its data is read. A file without them (a Hub checkpoint) loads
/// unverified, as before.
///
/// ```no_run
/// # fn main() -> oogc_models::Result<()> {
/// use oogc_models::{hf::HfCheckpoint, Llama};
/// let ckpt = HfCheckpoint::open(std::path::Path::new("Llama-3.2-1B"))?;
/// let model = Llama::new(ckpt.llama_config()?)?;
/// ckpt.check_units(model.units())?;
/// for unit in model.units() {
///     let flat: Vec<f32> = ckpt.read_unit(unit)?; // unit.numel elements, HF tensors back to back
///     # let _ = flat;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    config: Map<String, Value>,
    files: Vec<ShardFile>,
    tensors: BTreeMap<String, TensorInfo>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

fn file_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::HfFile { path: path.to_path_buf(), reason: reason.into() }
}

fn tensor_err(path: &Path, tensor: &str, reason: impl Into<String>) -> Error {
    Error::HfTensor { path: path.to_path_buf(), tensor: tensor.to_string(), reason: reason.into() }
}

/// Tensors a checkpoint may carry that are not parameters (non-persistent buffers some older
/// conversions saved); skipped, as transformers does.
fn is_ignored_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// The header of one safetensors file: `(offset of the data, tensors, __metadata__)`.
type Header = (usize, Vec<(String, safetensors::tensor::TensorInfo)>, HashMap<String, String>);

fn read_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let (n, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| file_err(path, format!("not a valid safetensors file: {e}")))?;
    let tensors = meta.tensors().into_iter().map(|(name, info)| (name, info.clone())).collect();
    Ok((8 + n, tensors, meta.metadata().clone().unwrap_or_default()))
}

/// What to do about a corrupt checkpoint, appended to every checksum error.
const CORRUPT_FIX: &str = "the checkpoint is corrupt (re-export or re-download it)";

/// Checks a file's checksum manifest, if it has checksum entries (header only, no data read),
/// and returns each tensor's stored crc32c (empty for a file without checksums).
fn verify_header(
    path: &Path,
    tensors: &[(String, safetensors::tensor::TensorInfo)],
    metadata: &HashMap<String, String>,
) -> Result<HashMap<String, u32>> {
    let corrupt = |e: checksum::ChecksumError| file_err(path, format!("{e}: {CORRUPT_FIX}"));
    let manifest = tensors.iter().map(|(n, i)| (n.as_str(), format!("{:?}", i.dtype), i.shape.as_slice()));
    if !checksum::verify_manifest(metadata, manifest).map_err(corrupt)? {
        return Ok(HashMap::new());
    }
    let mut crcs = HashMap::with_capacity(tensors.len());
    for (name, _) in tensors {
        let crc = checksum::stored_tensor_checksum(metadata, name).map_err(corrupt)?;
        crcs.insert(name.clone(), crc.expect("the manifest has checksums"));
    }
    Ok(crcs)
}

/// Checks `bytes`, the data of tensor `name` of `info`, against its stored crc32c, if any.
fn verify_data(info: &TensorInfo, name: &str, bytes: &[u8]) -> Result<()> {
    match info.crc32c {
        Some(expected) => checksum::verify_tensor(name, expected, bytes).map_err(|e| match e {
            checksum::ChecksumError::Tensor { expected, actual, .. } => tensor_err(
                &info.path,
                name,
                format!("fails its crc32c (stored {expected:08x}, computed {actual:08x}): {CORRUPT_FIX}"),
            ),
            other => tensor_err(&info.path, name, format!("{other}: {CORRUPT_FIX}")),
        }),
        None => Ok(()),
    }
}

impl HfCheckpoint {
    /// Opens the checkpoint in `dir`: reads `config.json` (as JSON, not yet interpreted), the
    /// index if there is one, and every safetensors file's header.
    ///
    /// # Errors
    /// [`Error::Io`] for a file that cannot be read (`config.json` included);
    /// [`Error::HfFile`] when there is neither `model.safetensors` nor
    /// `model.safetensors.index.json`, the index or a header is malformed, or the index names a
    /// file outside `dir`; [`Error::HfTensor`] for a tensor the index maps to a file that lacks
    /// it, a tensor of a shard that the index does not map there, or one in two files;
    /// [`Error::HfFile`] naming the file for a header that fails its checksum manifest (the
    /// checkpoint is corrupt).
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(io_err(&config_path))?;
        let config = match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(file_err(&config_path, "not a JSON object")),
            Err(e) => return Err(file_err(&config_path, format!("not valid JSON: {e}"))),
        };

        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        // weight_map: tensor name → file name (None: the single file holds every tensor).
        let weight_map: Option<BTreeMap<String, String>> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(io_err(&index_path))?;
            let v: Value =
                serde_json::from_str(&text).map_err(|e| file_err(&index_path, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| file_err(&index_path, "has no `weight_map` object"))?;
            let mut wm = BTreeMap::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| file_err(&index_path, format!("weight_map[{name}] is not a file name")))?;
                let p = Path::new(file);
                if p.components().count() != 1 || p.is_absolute() || file == ".." {
                    return Err(file_err(
                        &index_path,
                        format!("weight_map[{name}] = {file:?} is not a file name in the checkpoint directory"),
                    ));
                }
                wm.insert(name.clone(), file.to_string());
            }
            Some(wm)
        } else if single_path.exists() {
            None
        } else {
            return Err(file_err(
                dir,
                format!(
                    "has neither {SINGLE_FILE} nor {INDEX_FILE} (a pytorch_model.bin checkpoint must be converted to \
                     safetensors first)"
                ),
            ));
        };

        let file_names: Vec<String> = match &weight_map {
            Some(wm) => wm.values().cloned().collect::<BTreeSet<_>>().into_iter().collect(),
            None => vec![SINGLE_FILE.to_string()],
        };
        let mut files = Vec::with_capacity(file_names.len());
        let mut tensors = BTreeMap::new();
        for (fi, fname) in file_names.iter().enumerate() {
            let path = dir.join(fname);
            let file = File::open(&path).map_err(io_err(&path))?;
            let map = map_read_only(&file, &path)?;
            let (data_start, infos, metadata) = read_header(&path, &map)?;
            drop(map);
            let crcs = verify_header(&path, &infos, &metadata)?;
            for (name, info) in infos {
                if let Some(wm) = &weight_map {
                    match wm.get(&name) {
                        Some(f) if f == fname => {}
                        Some(f) => {
                            return Err(tensor_err(
                                &path,
                                &name,
                                format!("is also in this file, but {INDEX_FILE} maps it to {f}"),
                            ))
                        }
                        None if is_ignored_buffer(&name) => continue,
                        None => {
                            return Err(tensor_err(&path, &name, format!("is in this file but not in {INDEX_FILE}")))
                        }
                    }
                }
                let dtype = match info.dtype {
                    Dtype::F32 => HfDtype::F32,
                    Dtype::BF16 => HfDtype::BF16,
                    Dtype::F16 => HfDtype::F16,
                    other if is_ignored_buffer(&name) => {
                        let _ = other;
                        continue;
                    }
                    other => {
                        return Err(tensor_err(
                            &path,
                            &name,
                            format!("has dtype {other:?}; only F32, BF16 and F16 weights are supported"),
                        ))
                    }
                };
                let (s, e) = info.data_offsets;
                let entry = TensorInfo {
                    path: path.clone(),
                    dtype,
                    shape: info.shape,
                    file: fi,
                    crc32c: crcs.get(&name).copied(),
                    start: data_start + s,
                    end: data_start + e,
                };
                if tensors.insert(name.clone(), entry).is_some() {
                    return Err(tensor_err(&path, &name, "is in more than one file"));
                }
            }
            files.push(ShardFile { path, file });
        }
        if let Some(wm) = &weight_map {
            for (name, fname) in wm {
                if !tensors.contains_key(name) && !is_ignored_buffer(name) {
                    return Err(tensor_err(&dir.join(fname), name, format!("is named by {INDEX_FILE} but missing")));
                }
            }
        }
        Ok(Self { dir: dir.to_path_buf(), config, files, tensors })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json` as a JSON object, uninterpreted (see [`super::passthrough_keys`] to carry
    /// its other keys into an export).
    pub fn config_json(&self) -> &Map<String, Value> {
        &self.config
    }

    /// `config.json` parsed as a Llama-family config ([`super::parse_config`]).
    ///
    /// # Errors
    /// As [`super::parse_config`].
    pub fn llama_config(&self) -> Result<LlamaConfig> {
        let path = self.dir.join("config.json");
        super::config::parse_config(&Value::Object(self.config.clone()).to_string(), &path)
    }

    /// The safetensors files, in the order they were opened.
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Every tensor of the checkpoint by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// Checks that the checkpoint holds exactly the parameters of `units` (by Hugging Face
    /// name), each with its shape: call it once after [`HfCheckpoint::open`] so that a wrong
    /// checkpoint fails before any data is read.
    ///
    /// # Errors
    /// [`Error::HfTensor`] naming the first tensor that is missing (with the directory as the
    /// path), unexpected, or of another shape (with its file). A tied model's checkpoint must not
    /// have `lm_head.weight` and an untied one must.
    pub fn check_units(&self, units: &[UnitSpec]) -> Result<()> {
        let mut expected = BTreeSet::new();
        for unit in units {
            for p in &unit.params {
                let info = self.tensors.get(&p.name).ok_or_else(|| {
                    let hint = if p.name == "lm_head.weight" {
                        " (the config has tie_word_embeddings = false: a checkpoint without lm_head.weight needs \
                         tie_word_embeddings = true)"
                    } else {
                        ""
                    };
                    tensor_err(&self.dir, &p.name, format!("is missing from the checkpoint{hint}"))
                })?;
                if info.shape != p.shape {
                    return Err(tensor_err(
                        &info.path,
                        &p.name,
                        format!("has shape {:?}, the config needs {:?}", info.shape, p.shape),
                    ));
                }
                expected.insert(p.name.as_str());
            }
        }
        if let Some((name, info)) = self.tensors.iter().find(|(n, _)| !expected.contains(n.as_str())) {
            let hint = if name == "lm_head.weight" {
                " (the config has tie_word_embeddings = true; set it to false to use this lm_head)"
            } else {
                " (not a parameter of this config's model)"
            };
            return Err(tensor_err(&info.path, name, format!("is unexpected{hint}")));
        }
        Ok(())
    }

    /// One unit's flat vector: its parameters' tensors, converted to f32, back to back in
    /// [`UnitSpec::params`] order (`unit.numel` elements). Each shard involved is mapped for the
    /// copy and unmapped after.
    ///
    /// # Errors
    /// [`Error::HfTensor`] for a parameter the checkpoint lacks or has with another shape;
    /// [`Error::Io`] when a shard cannot be mapped; [`Error::HfFile`] when a shard changed size
    /// since it was opened; [`Error::HfTensor`] naming the tensor and file when its data fails
    /// its stored crc32c (the checkpoint is corrupt).
    pub fn read_unit(&self, unit: &UnitSpec) -> Result<Vec<f32>> {
        let mut flat = vec![0f32; unit.numel];
        // Parameters grouped by file, so that each shard is mapped once per unit.
        let mut by_file: BTreeMap<usize, Vec<(&TensorInfo, &str, usize)>> = BTreeMap::new();
        for p in &unit.params {
            let info = self
                .tensors
                .get(&p.name)
                .ok_or_else(|| tensor_err(&self.dir, &p.name, "is missing from the checkpoint"))?;
            if info.shape != p.shape {
                return Err(tensor_err(
                    &info.path,
                    &p.name,
                    format!("has shape {:?}, the unit needs {:?}", info.shape, p.shape),
                ));
            }
            by_file.entry(info.file).or_default().push((info, &p.name, p.offset));
        }
        for (fi, params) in by_file {
            let shard = &self.files[fi];
            let map = map_read_only(&shard.file, &shard.path)?;
            for (info, name, offset) in params {
                let bytes = map.get(info.start..info.end).ok_or_else(|| {
                    file_err(&shard.path, "is shorter than its header says (was it changed while open?)")
                })?;
                verify_data(info, name, bytes)?;
                convert_to_f32(info.dtype, bytes, &mut flat[offset..offset + info.numel()]);
            }
        }
        Ok(flat)
    }

    /// One tensor by name, converted to f32, with its shape.
    ///
    /// # Errors
    /// [`Error::HfTensor`] when the checkpoint has no such tensor; as [`HfCheckpoint::read_unit`].
    pub fn read_tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info =
            self.tensors.get(name).ok_or_else(|| tensor_err(&self.dir, name, "is missing from the checkpoint"))?;
        let shard = &self.files[info.file];
        let map = map_read_only(&shard.file, &shard.path)?;
        let bytes = map
            .get(info.start..info.end)
            .ok_or_else(|| file_err(&shard.path, "is shorter than its header says (was it changed while open?)"))?;
        verify_data(info, name, bytes)?;
        let mut out = vec![0f32; info.numel()];
        convert_to_f32(info.dtype, bytes, &mut out);
        Ok((info.shape.clone(), out))
    }
}

/// Little-endian `dtype` elements → f32 (exact for all three; F32 bits are kept).
pub(super) fn convert_to_f32(dtype: HfDtype, bytes: &[u8], out: &mut [f32]) {
    let es = dtype.size_bytes();
    debug_assert_eq!(bytes.len(), out.len() * es);
    out.par_chunks_mut(CONVERT_CHUNK).zip(bytes.par_chunks(CONVERT_CHUNK * es)).for_each(|(o, b)| match dtype {
        HfDtype::F32 => {
            for (o, c) in o.iter_mut().zip(b.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        HfDtype::BF16 => {
            for (o, c) in o.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        HfDtype::F16 => {
            for (o, c) in o.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    });
}

/// The data of a tensor read by [`read_tensors`].
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// A float tensor (F32, BF16, F16 exactly; F64 rounded) as f32.
    F32(Vec<f32>),
    /// An integer or boolean tensor (I64, I32, I16, I8, U32, U16, U8, BOOL) as i64.
    I64(Vec<i64>),
}

/// One tensor of a safetensors file ([`read_tensors`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// Its name in the file.
    pub name: String,
    /// Its shape (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Its elements, row-major.
    pub data: TensorData,
}

impl NamedTensor {
    /// The elements as f32, if it is a float tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            TensorData::I64(_) => None,
        }
    }

    /// The elements as i64, if it is an integer tensor.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            TensorData::F32(_) => None,
        }
    }
}

/// Every tensor of one safetensors file, in file order: floats as f32, integers as i64 — for
/// small files such as test references (e.g. `shared/fixtures/llama/*/reference.safetensors` and
/// the AdamW oracle `step.safetensors`), since the whole file is converted at once.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or mapped; [`Error::HfFile`] when it is not a
/// valid safetensors file; [`Error::HfTensor`] for an unsupported dtype (F8, F4, U64 ...).
pub fn read_tensors(path: &Path) -> Result<Vec<NamedTensor>> {
    let file = File::open(path).map_err(io_err(path))?;
    let map = map_read_only(&file, path)?;
    let (data_start, mut infos, _) = read_header(path, &map)?;
    infos.sort_by_key(|(_, i)| i.data_offsets.0);
    let mut out = Vec::with_capacity(infos.len());
    for (name, info) in infos {
        let (s, e) = info.data_offsets;
        let b = &map[data_start + s..data_start + e];
        let n: usize = info.shape.iter().product();
        let ints = |size: usize, f: &dyn Fn(&[u8]) -> i64| TensorData::I64(b.chunks_exact(size).map(f).collect());
        let data = match info.dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => {
                let dtype = match info.dtype {
                    Dtype::F32 => HfDtype::F32,
                    Dtype::BF16 => HfDtype::BF16,
                    _ => HfDtype::F16,
                };
                let mut v = vec![0f32; n];
                convert_to_f32(dtype, b, &mut v);
                TensorData::F32(v)
            }
            Dtype::F64 => TensorData::F32(
                b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
            ),
            Dtype::I64 => ints(8, &|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))),
            Dtype::I32 => ints(4, &|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64),
            Dtype::U32 => ints(4, &|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as i64),
            Dtype::I16 => ints(2, &|c| i16::from_le_bytes(c.try_into().expect("2 bytes")) as i64),
            Dtype::U16 => ints(2, &|c| u16::from_le_bytes(c.try_into().expect("2 bytes")) as i64),
            Dtype::I8 => ints(1, &|c| c[0] as i8 as i64),
            Dtype::U8 | Dtype::BOOL => ints(1, &|c| c[0] as i64),
            other => return Err(tensor_err(path, &name, format!("has unsupported dtype {other:?}"))),
        };
        out.push(NamedTensor { name, shape: info.shape, data });
    }
    Ok(out)
}
