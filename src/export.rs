//! `oogc export CKPT --hf OUT_DIR`: the trained weights of a Llama-family run written back as a
//! Hugging Face checkpoint (`config.json`, safetensors sharded with
//! `model.safetensors.index.json`, the run's `tokenizer.json` copied), which
//! `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads.
//!
//! The checkpoint's master weights (fp32) are written unit by unit in the model's layout
//! (Hugging Face's names and `[out, in]` weights), so importing a checkpoint (`[model] init`)
//! and exporting it again is bitwise the identity for f32 weights. A run that started from a
//! checkpoint carries that checkpoint's other `config.json` keys (token ids, ...) over.

use std::path::{Path, PathBuf};

use oogc_models::hf::{self, HfDtype, WriteOptions, WrittenCheckpoint};

use crate::checkpoint::{self, CheckpointError};
use crate::config::{LlamaModelConfig, ModelConfig, TrainConfig};
use crate::train::{self, TrainError};

/// How [`export_hf`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// Largest shard, bytes of tensor data. Default: 5 GB (transformers').
    pub max_shard_bytes: u64,
    /// f32 (bitwise the master weights; default) or bf16 / f16 (rounded to nearest even).
    pub dtype: HfDtype,
}

impl Default for ExportOptions {
    fn default() -> Self {
        let w = WriteOptions::default();
        Self { max_shard_bytes: w.max_shard_bytes, dtype: w.dtype }
    }
}

/// What [`export_hf`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The oogc checkpoint read (the newest of a directory).
    pub checkpoint: PathBuf,
    /// Its step.
    pub step: u64,
    /// The safetensors files and index.
    pub weights: WrittenCheckpoint,
    /// `config.json`.
    pub config: PathBuf,
    /// The copied `tokenizer.json`.
    pub tokenizer: PathBuf,
}

/// Reads the oogc checkpoint `ckpt` (a file, a sharded checkpoint's index, or a directory's
/// newest) one unit's master weights at a time (each checked against its crc32c as it is read;
/// a sharded one's assembled from its ranks' pieces) and writes its model as a Hugging Face
/// checkpoint into `out` (created if missing).
///
/// # Errors
/// [`TrainError::Checkpoint`] for an unreadable or corrupt checkpoint; [`TrainError::Mismatch`]
/// when it holds no run config, its model is not of the Llama family (the byte-level GPT has no
/// Hugging Face layout), or a tensor is missing; model and I/O errors naming the path.
pub fn export_hf(ckpt: &Path, out: &Path, opts: &ExportOptions) -> Result<Exported, TrainError> {
    let path = if ckpt.is_dir() { checkpoint::latest(ckpt)? } else { ckpt.to_path_buf() };
    // The header now, each parameter's master weights as its unit is written (checked against
    // its crc32c as it is read): never the whole checkpoint in memory.
    let loaded = checkpoint::AnyReader::open(&path)?;
    let step = loaded.step()?;
    let mismatch = |reason: String| TrainError::Mismatch { path: path.clone(), reason };
    let text = loaded
        .metadata()
        .get("config")
        .ok_or_else(|| mismatch("no `config` metadata: not a run's checkpoint".into()))?;
    let cfg = TrainConfig::from_toml_str(text).map_err(|e| mismatch(format!("its run config does not parse: {e}")))?;
    let ModelConfig::Llama(llama) = &cfg.model else {
        return Err(mismatch(format!(
            "its model is the {} family; `--hf` writes Llama-family models (the byte-level GPT has no Hugging Face layout)",
            cfg.model.family()
        )));
    };
    let tokenizer = cfg.data.tokenizer.clone().ok_or_else(|| mismatch("its run has no tokenizer.json".into()))?;
    let config = train::llama_config(llama, train::vocab_size(&cfg)?)?;
    let extra = match llama {
        LlamaModelConfig::Init(dir) => hf::passthrough_keys(hf::HfCheckpoint::open(dir)?.config_json()),
        LlamaModelConfig::Scratch(_) => Default::default(),
    };
    let units = config.units();
    let wopts = WriteOptions { max_shard_bytes: opts.max_shard_bytes, dtype: opts.dtype };
    let weights = hf::write_checkpoint(out, &config, &extra, &units, &wopts, |unit| {
        let mut flat = vec![0f32; unit.numel];
        for p in &unit.params {
            let t = loaded
                .tensor(&p.name)
                .map_err(|e| oogc_models::Error::HfTensor {
                    path: path.clone(),
                    tensor: p.name.clone(),
                    reason: e.to_string(),
                })?
                .ok_or_else(|| oogc_models::Error::HfTensor {
                    path: path.clone(),
                    tensor: p.name.clone(),
                    reason: "missing from the checkpoint".into(),
                })?;
            if t.data.len() != p.numel() {
                return Err(oogc_models::Error::HfTensor {
                    path: path.clone(),
                    tensor: p.name.clone(),
                    reason: format!("{} values, the model's layout has {}", t.data.len(), p.numel()),
                });
            }
            let values = t.data.into_f32().map_err(|d| oogc_models::Error::HfTensor {
                path: path.clone(),
                tensor: p.name.clone(),
                reason: format!("{d:?} master weights, expected F32 or BF16"),
            })?;
            flat[p.offset..p.offset + p.numel()].copy_from_slice(&values);
        }
        Ok(flat)
    })?;
    let tokenizer_out = out.join("tokenizer.json");
    std::fs::copy(&tokenizer, &tokenizer_out)
        .map_err(|source| TrainError::Checkpoint(CheckpointError::Io { path: tokenizer_out.clone(), source }))?;
    Ok(Exported { checkpoint: path, step, weights, config: out.join("config.json"), tokenizer: tokenizer_out })
}
