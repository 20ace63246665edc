//! What a run trains on and what it writes: `[data]` (the text, its tokenizer and cache), `[train]`
//! (batch, sequence length, steps, validation cadence, compute dtype), `[checkpoint]` and
//! `[output]`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::data::{DataSource, TextFormat};

/// `[data]`: the training text.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A text file (plain text, or JSON Lines with a `text` field). Relative to the config file's
    /// directory.
    pub path: PathBuf,
    /// Fraction of the tokens (the text's end) held out for validation. Default: 0.1.
    #[serde(default = "default_val_fraction")]
    pub val_fraction: f64,
    /// A Hugging Face `tokenizer.json`; none: bytes are tokens (vocabulary 256). Default: none.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// `"auto"` (JSON Lines for `.jsonl`/`.ndjson`, else text), `"text"` or `"jsonl"`. Default: auto.
    #[serde(default)]
    pub format: TextFormat,
    /// Where tokenized text is cached (a memory-mapped token file keyed by the text's and the
    /// tokenizer's hashes). Default: `$XDG_CACHE_HOME/oogc/tokens`, else `~/.cache/oogc/tokens`,
    /// else the temp directory's `oogc-tokens`.
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
}

impl DataConfig {
    /// The token cache directory: `cache_dir`, else the default (see the field).
    pub fn cache_dir(&self) -> PathBuf {
        if let Some(d) = &self.cache_dir {
            return d.clone();
        }
        match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
            (Some(x), _) if !x.is_empty() => PathBuf::from(x).join("oogc/tokens"),
            (_, Some(h)) if !h.is_empty() => PathBuf::from(h).join(".cache/oogc/tokens"),
            _ => std::env::temp_dir().join("oogc-tokens"),
        }
    }

    /// The data's description for the loader with `seq_len` tokens per sequence.
    pub fn source(&self, seq_len: usize) -> DataSource {
        DataSource {
            path: self.path.clone(),
            format: self.format,
            tokenizer: self.tokenizer.clone(),
            cache_dir: self.tokenizer.is_some().then(|| self.cache_dir()),
            val_fraction: self.val_fraction,
            seq_len,
            threads: 0,
        }
    }
}

fn default_val_fraction() -> f64 {
    0.1
}

/// `[train]`: the loop.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainLoopConfig {
    /// Sequences per micro-batch: a step trains on `batch_size × micro_batches` sequences
    /// (the micro-batch size, which is the batch size when `micro_batches` is 1).
    pub batch_size: usize,
    /// Micro-batches per step (gradient accumulation with a layer-major schedule): each unit is
    /// fetched once per step and runs all micro-batches in the forward, and once in the backward;
    /// their gradients are summed before the one D2H copy, so parameter traffic per token falls
    /// by this factor. The objective is the mean cross-entropy over the counted tokens of all
    /// `batch_size × micro_batches` sequences (each micro-batch's loss weighted by its share of
    /// the counted tokens), the same as one batch of `batch_size × micro_batches` sequences
    /// within f32 rounding. Dense models only (an MoE model needs 1); must be ≥ 1. Default: 1.
    #[serde(default = "default_micro_batches")]
    pub micro_batches: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Optimizer steps of the run (`oogc train --steps` overrides).
    pub steps: u64,
    /// Seed of parameter init and of batch sampling. Default: 1.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Validation every this many steps (and at the end). 0 = only at the end. Default: 100.
    #[serde(default = "default_eval_interval")]
    pub eval_interval: u64,
    /// Batches averaged per validation. Default: 8.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    /// Validate once before the first step too (the loss to compare the last one with, on the
    /// same validation batches). Default: false.
    #[serde(default)]
    pub eval_at_start: bool,
    /// Element type of the compute copies, activations and gradients: `"f32"`, or `"bf16"` for
    /// mixed precision (bf16 compute copies in every tier and bf16 gradients on every link —
    /// half of f32's bytes — over fp32 master weights and Adam state; norm statistics, softmax,
    /// RoPE angles, the router and the loss in f32; as ZeRO-Offload's and FSDP2's
    /// `MixedPrecisionPolicy(param_dtype=bf16)`). Default: `"f32"`.
    #[serde(default)]
    pub compute_dtype: ComputeDType,
}

/// `[train] compute_dtype`: the compute copies' and gradients' element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDType {
    /// fp32 everywhere (the fused CPU kernels apply on the sim device).
    #[default]
    F32,
    /// bf16 compute copies, activations and gradients over fp32 master weights.
    Bf16,
}

impl ComputeDType {
    /// The swapper's (and the optimizer's) element type.
    pub fn dtype(self) -> oogc_swapper::DType {
        match self {
            ComputeDType::F32 => oogc_swapper::DType::F32,
            ComputeDType::Bf16 => oogc_swapper::DType::BF16,
        }
    }
}

fn default_seed() -> u64 {
    1
}
fn default_micro_batches() -> usize {
    1
}
fn default_eval_interval() -> u64 {
    100
}
fn default_eval_batches() -> usize {
    8
}

/// `[checkpoint]`: safetensors checkpoints, written atomically, streamed and in the background:
/// between two steps a save snapshots each unit (nothing copied but a device optimizer's state),
/// and while training goes on a writer thread reads each unit's master weights and Adam state
/// from wherever they live (host, NVMe) into staging claimed from the host ledger (the
/// `checkpoint` category: the plan keeps room for the largest unit's state), appends it and
/// lets it go; the next step waits, before its updates are committed, until every unit is read.
/// A second save waits for the first, and a stopped or failing run for the one in flight. A resume reads one unit's tensors at a
/// time. A run's memory never holds the model's state for a checkpoint, so a run larger than
/// host memory saves and resumes (`configs/scale-beyond-ram.toml`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Directory of checkpoints. A save that cannot be written (a full disk: checked before
    /// writing, the error names the directory and the bytes needed) leaves the previous
    /// checkpoints intact and the run going, with an error logged; at the run's last step it
    /// fails the run. Default: none (no checkpoints).
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// A checkpoint every this many steps (and at the end). 0 = only at the end. Default: 0.
    #[serde(default)]
    pub interval: u64,
    /// Checkpoints kept (oldest deleted first). Default: 2.
    #[serde(default)]
    pub keep: Option<usize>,
}

/// `[output]`: files the run writes.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// JSON-lines metrics, one object per step: `step`, `loss`, `val_loss` (when evaluated), `lr`,
    /// `tokens_per_s`, `step_s`, `stall_s`, `stall_transfer_s`, `stall_optimizer_s`, `h2d_bytes`,
    /// `d2h_bytes`, `nvme_read_bytes`, `nvme_write_bytes`, `grad_norm`, `clip_scale`, `skipped`;
    /// the step after a checkpoint started has `ckpt_held_s` (the seconds the save held the
    /// trainer: its snapshots), the step by whose end it completed (written in the background)
    /// `ckpt_s` and `ckpt_bytes` (the save's seconds from start to rename, and its files' bytes).
    /// Default: none.
    #[serde(default)]
    pub metrics: Option<PathBuf>,
    /// Chrome/Perfetto trace of the timeline (open in ui.perfetto.dev): one track per thread
    /// (compute, copy engines, optimizer workers, NVMe). Default: none.
    #[serde(default)]
    pub trace: Option<PathBuf>,
}
