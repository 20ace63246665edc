//! Hugging Face checkpoints of the Llama family, in and out, unit by unit.
//!
//! | piece | what |
//! |---|---|
//! | [`parse_config`], [`read_config`] | `config.json` (transformers 4 or 5 layout) → [`crate::LlamaConfig`], unsupported options refused by key |
//! | [`config_json`], [`write_config`] | [`crate::LlamaConfig`] → `config.json` (transformers-4 layout, which 4 and 5 load) |
//! | [`HfCheckpoint`] | a checkpoint directory: `model.safetensors` or shards + `model.safetensors.index.json`; [`HfCheckpoint::read_unit`] gives one unit's flat f32 vector (F32/BF16/F16 in the files), mapping each shard only for the copy |
//! | [`write_safetensors`], [`write_checkpoint`] | units' flat vectors (from a callback, one unit at a time) → sharded safetensors + index (+ `config.json`), F32 (bitwise) or BF16/F16 |
//! | [`read_tensors`] | every tensor of one small safetensors file (test references, the AdamW oracle) |
//!
//! The units' parameter names are the checkpoint's tensor names and their layouts the same
//! ([`crate::LlamaConfig::units`]), so reading and writing is a copy: import then export of
//! F32 weights is bitwise the identity.

mod config;
mod mmap;
mod read;
mod write;

pub use config::{config_json, parse_config, passthrough_keys, read_config};
pub use read::{read_tensors, HfCheckpoint, NamedTensor, TensorData, TensorInfo};
pub use write::{write_checkpoint, write_config, write_safetensors, WriteOptions, WrittenCheckpoint};

/// The single weights file of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint (`weight_map`: tensor name → shard file).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Element type of checkpoint weights (safetensors `F32`, `BF16`, `F16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HfDtype {
    /// IEEE binary32.
    F32,
    /// bfloat16 (the top 16 bits of an f32; written rounded to nearest even).
    BF16,
    /// IEEE binary16.
    F16,
}

impl HfDtype {
    /// Bytes per element: 4 or 2.
    pub fn size_bytes(self) -> usize {
        match self {
            HfDtype::F32 => 4,
            HfDtype::BF16 | HfDtype::F16 => 2,
        }
    }

    /// The safetensors header name: `F32`, `BF16`, `F16`.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            HfDtype::F32 => "F32",
            HfDtype::BF16 => "BF16",
            HfDtype::F16 => "F16",
        }
    }

    /// The `torch_dtype` of `config.json`: `float32`, `bfloat16`, `float16`.
    pub fn torch_name(self) -> &'static str {
        match self {
            HfDtype::F32 => "float32",
            HfDtype::BF16 => "bfloat16",
            HfDtype::F16 => "float16",
        }
    }
}

impl From<HfDtype> for safetensors::Dtype {
    /// The safetensors element type ([`HfDtype::safetensors_name`]).
    fn from(d: HfDtype) -> Self {
        match d {
            HfDtype::F32 => safetensors::Dtype::F32,
            HfDtype::BF16 => safetensors::Dtype::BF16,
            HfDtype::F16 => safetensors::Dtype::F16,
        }
    }
}

#[cfg(test)]
mod tests;
