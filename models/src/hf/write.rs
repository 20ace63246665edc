//! Writing Hugging Face checkpoints: sharded safetensors, streamed unit by unit.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{HfDtype, INDEX_FILE, SINGLE_FILE};
use crate::llama::LlamaConfig;
use crate::streamed::{StreamError, StreamedFile, TensorSpec};
use crate::unit::UnitSpec;
use crate::{Error, Result};

/// Bytes per write when converting a tensor.
const WRITE_CHUNK_ELEMS: usize = 1 << 16;

/// How [`write_safetensors`] / [`write_checkpoint`] write the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    /// Largest shard in bytes of tensor data: tensors are added to a shard in unit order until
    /// the next would pass this size (a larger tensor gets a shard of its own), as transformers'
    /// `save_pretrained(max_shard_size=...)`. Default: 5 GB (`5_000_000_000`, transformers 4's
    /// default).
    pub max_shard_bytes: u64,
    /// The dtype written: [`HfDtype::F32`] (bitwise the flat vectors; default) or
    /// [`HfDtype::BF16`] (rounded to nearest even) or [`HfDtype::F16`].
    pub dtype: HfDtype,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self { max_shard_bytes: 5_000_000_000, dtype: HfDtype::F32 }
    }
}

/// What [`write_safetensors`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct WrittenCheckpoint {
    /// The safetensors files, in order (one `model.safetensors`, or `model-0000k-of-0000n`).
    pub files: Vec<PathBuf>,
    /// `model.safetensors.index.json`, when there is more than one file.
    pub index: Option<PathBuf>,
    /// Bytes of tensor data (`metadata.total_size` of the index).
    pub total_bytes: u64,
    /// Number of parameters written (`metadata.total_parameters`).
    pub total_parameters: u64,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// Whether `name` is a weights file a previous export may have left (transformers' naming).
fn is_weights_file(name: &str) -> bool {
    if name == SINGLE_FILE || name == INDEX_FILE {
        return true;
    }
    // model-00001-of-00012.safetensors
    let Some(rest) = name.strip_prefix("model-").and_then(|r| r.strip_suffix(".safetensors")) else {
        return false;
    };
    let mut parts = rest.split("-of-");
    matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None)
        if a.len() == 5 && b.len() == 5 && a.bytes().chain(b.bytes()).all(|c| c.is_ascii_digit()))
}

/// Writes the weights of `units` as Hugging Face safetensors into `dir` (created if needed):
/// `model.safetensors` when they fit one shard of [`WriteOptions::max_shard_bytes`], else
/// `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json` (`metadata.total_size`
/// and `total_parameters`, `weight_map` tensor → file) — the layout transformers'
/// `save_pretrained` writes and `from_pretrained` loads. Tensors are named by
/// [`crate::ParamSpec::name`] with their shapes, in unit order; each safetensors header carries
/// `{"format": "pt"}` and the [`crate::checksum`] entries (a crc32c per tensor and one for the
/// file, which [`super::HfCheckpoint`] verifies and other readers ignore), and is padded to 8
/// bytes. Each shard is a [`StreamedFile`]: its header first with placeholder checksums, each
/// tensor's crc32c computed over the bytes as they are written, the real values over the header
/// when the shard is complete, before it is synced.
///
/// `unit_data` is called once per unit, in order, and returns that unit's flat f32 vector
/// (`unit.numel` elements): only one unit's data is held at a time, and each shard is streamed.
/// Files are written under a `.tmp` name, synced, then renamed; weights files of an earlier
/// export in `dir` that this one does not overwrite are removed.
///
/// # Errors
/// [`Error::Io`] on a write failure; [`Error::Input`] when `unit_data` returns a vector of the
/// wrong length; any error of `unit_data` (the `.tmp` files are then removed).
pub fn write_safetensors(
    dir: &Path,
    units: &[UnitSpec],
    opts: &WriteOptions,
    mut unit_data: impl FnMut(&UnitSpec) -> Result<Vec<f32>>,
) -> Result<WrittenCheckpoint> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let es = opts.dtype.size_bytes() as u64;

    // Plan the shards: (unit, param) in order, a new shard when the next tensor would overflow.
    let mut shard_of: Vec<Vec<usize>> = Vec::with_capacity(units.len());
    let mut shard_sizes: Vec<u64> = Vec::new();
    for unit in units {
        let mut v = Vec::with_capacity(unit.params.len());
        for p in &unit.params {
            let bytes = p.numel() as u64 * es;
            match shard_sizes.last_mut() {
                Some(cur) if *cur == 0 || *cur + bytes <= opts.max_shard_bytes => *cur += bytes,
                _ => shard_sizes.push(bytes),
            }
            v.push(shard_sizes.len() - 1);
        }
        shard_of.push(v);
    }
    let n = shard_sizes.len().max(1);
    let names: Vec<String> = if n == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=n).map(|k| format!("model-{k:05}-of-{n:05}.safetensors")).collect()
    };
    let tmp_of = |name: &str| dir.join(format!("{name}.tmp"));

    // Each shard's tensors, in write order (unit order).
    let specs = |k: usize| -> Vec<TensorSpec> {
        let params = units.iter().zip(&shard_of).flat_map(|(u, s)| u.params.iter().zip(s));
        params
            .filter(|(_, &s)| s == k)
            .map(|(p, _)| TensorSpec::new(p.name.clone(), opts.dtype.into(), p.shape.clone()))
            .collect()
    };
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let stream_err = |path: &Path| {
        let path = path.to_path_buf();
        move |e: StreamError| match e {
            StreamError::Io(source) => Error::Io { path: path.clone(), source },
            StreamError::Invalid(reason) => crate::ops::input_err("shard", "a complete shard".into(), reason),
        }
    };
    let result = (|| -> Result<(u64, u64, Map<String, Value>)> {
        let mut weight_map = Map::new();
        let mut total_parameters = 0u64;
        // The open shard: its index and file.
        let mut current: Option<(usize, StreamedFile)> = None;
        let finish = |(_, f): (usize, StreamedFile)| -> Result<()> {
            let path = f.path().to_path_buf();
            f.finish().map(|_| ()).map_err(stream_err(&path))
        };
        let mut buf: Vec<u8> = Vec::with_capacity(WRITE_CHUNK_ELEMS * es as usize);
        for (u, unit) in units.iter().enumerate() {
            let flat = unit_data(unit)?;
            if flat.len() != unit.numel {
                return Err(crate::ops::input_err(
                    "unit data length",
                    format!("{} (unit {})", unit.numel, unit.name),
                    flat.len().to_string(),
                ));
            }
            for (p, &k) in unit.params.iter().zip(&shard_of[u]) {
                if current.as_ref().is_none_or(|(ck, _)| *ck != k) {
                    if let Some(c) = current.take() {
                        finish(c)?;
                    }
                    let path = tmp_of(&names[k]);
                    current = Some((k, StreamedFile::create(&path, &metadata, specs(k)).map_err(stream_err(&path))?));
                }
                let (_, f) = current.as_mut().expect("a shard is open");
                for chunk in flat[p.offset..p.offset + p.numel()].chunks(WRITE_CHUNK_ELEMS) {
                    buf.clear();
                    match opts.dtype {
                        HfDtype::F32 => chunk.iter().for_each(|v| buf.extend_from_slice(&v.to_le_bytes())),
                        HfDtype::BF16 => chunk
                            .iter()
                            .for_each(|v| buf.extend_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes())),
                        HfDtype::F16 => chunk
                            .iter()
                            .for_each(|v| buf.extend_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes())),
                    }
                    let path = f.path().to_path_buf();
                    f.append(&buf).map_err(stream_err(&path))?;
                }
                weight_map.insert(p.name.clone(), Value::from(names[k].clone()));
                total_parameters += p.numel() as u64;
            }
        }
        if let Some(c) = current.take() {
            finish(c)?;
        }
        if units.iter().all(|u| u.params.is_empty()) {
            // No tensor at all: still a valid (empty) safetensors file.
            let path = tmp_of(&names[0]);
            let f = StreamedFile::create(&path, &metadata, Vec::new()).map_err(stream_err(&path))?;
            f.finish().map_err(stream_err(&path))?;
        }
        Ok((total_parameters * es, total_parameters, weight_map))
    })();

    let (total_bytes, total_parameters, weight_map) = match result {
        Ok(v) => v,
        Err(e) => {
            for name in &names {
                let _ = std::fs::remove_file(tmp_of(name));
            }
            return Err(e);
        }
    };
    let mut files = Vec::with_capacity(n);
    for name in &names {
        let path = dir.join(name);
        std::fs::rename(tmp_of(name), &path).map_err(io_err(&path))?;
        files.push(path);
    }
    let index = if n > 1 {
        let path = dir.join(INDEX_FILE);
        let v = serde_json::json!({
            "metadata": { "total_parameters": total_parameters, "total_size": total_bytes },
            "weight_map": weight_map,
        });
        write_atomically(&path, format!("{:#}\n", v).as_bytes())?;
        Some(path)
    } else {
        None
    };

    // Remove the weights files of an earlier export that this one did not overwrite.
    let keep: BTreeSet<&str> = names.iter().map(String::as_str).chain(index.as_ref().map(|_| INDEX_FILE)).collect();
    let entries = std::fs::read_dir(dir).map_err(io_err(dir))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_weights_file(name) && !keep.contains(name) {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io_err(&path))?;
        }
    }
    Ok(WrittenCheckpoint { files, index, total_bytes, total_parameters })
}

/// Writes `bytes` to `path` through a synced `.tmp` file and a rename.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Writes `config`'s `config.json` into `dir` ([`super::config_json`], transformers-4 layout,
/// `torch_dtype` from `dtype`, the keys of `extra` that are not model keys added).
///
/// # Errors
/// [`Error::Io`] on a write failure.
pub fn write_config(dir: &Path, config: &LlamaConfig, dtype: HfDtype, extra: &Map<String, Value>) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join("config.json");
    let v = super::config::config_json(config, dtype.torch_name(), extra);
    write_atomically(&path, format!("{:#}\n", v).as_bytes())?;
    Ok(path)
}

/// A whole Hugging Face checkpoint of a Llama-family model in `dir`: the weights
/// ([`write_safetensors`]) then `config.json` ([`write_config`]), so that a directory with a
/// `config.json` from this call has complete weights. `units` must be `config`'s
/// ([`LlamaConfig::units`], or a [`crate::Llama`]'s); `extra` holds `config.json` keys to carry
/// over (e.g. [`super::HfCheckpoint::config_json`] of the checkpoint the model came from: token
/// ids and the like; model keys in it are ignored).
///
/// # Errors
/// As [`write_safetensors`] and [`write_config`]; [`Error::Input`] when `units` are not
/// `config`'s.
pub fn write_checkpoint(
    dir: &Path,
    config: &LlamaConfig,
    extra: &Map<String, Value>,
    units: &[UnitSpec],
    opts: &WriteOptions,
    unit_data: impl FnMut(&UnitSpec) -> Result<Vec<f32>>,
) -> Result<WrittenCheckpoint> {
    if config.units() != units {
        return Err(crate::ops::input_err(
            "units",
            "the units of the config (LlamaConfig::units)".into(),
            "units of another layout".into(),
        ));
    }
    let written = write_safetensors(dir, units, opts, unit_data)?;
    write_config(dir, config, opts.dtype, extra)?;
    Ok(written)
}
