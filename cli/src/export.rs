//! `oogc export CKPT --hf OUT_DIR`: a Llama-family run's checkpoint as a Hugging Face checkpoint
//! directory (`config.json`, safetensors + index, `tokenizer.json`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use oogc::export::{export_hf, ExportOptions};
use oogc::models::hf::HfDtype;

use crate::args::parse_bytes;

/// The dtype of the exported weights.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ExportDtype {
    /// fp32: bitwise the master weights.
    F32,
    /// bfloat16, rounded to nearest even.
    Bf16,
    /// IEEE half, rounded to nearest even.
    F16,
}

#[derive(Debug, Args)]
pub(crate) struct ExportCmd {
    /// An oogc checkpoint file, or a checkpoint directory (its newest).
    pub(crate) checkpoint: PathBuf,
    /// The Hugging Face directory to write (created if missing; an earlier export's weights
    /// files there are replaced).
    #[arg(long, value_name = "OUT_DIR")]
    pub(crate) hf: PathBuf,
    /// Largest safetensors shard (bytes of tensor data; units as in `5GB`, `512MiB`).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, default_value = "5000000000")]
    pub(crate) max_shard_size: usize,
    /// The weights' dtype.
    #[arg(long, value_enum, default_value = "f32")]
    pub(crate) dtype: ExportDtype,
}

pub(crate) fn export(cmd: ExportCmd) -> anyhow::Result<()> {
    let dtype = match cmd.dtype {
        ExportDtype::F32 => HfDtype::F32,
        ExportDtype::Bf16 => HfDtype::BF16,
        ExportDtype::F16 => HfDtype::F16,
    };
    let opts = ExportOptions { max_shard_bytes: cmd.max_shard_size as u64, dtype };
    let e = export_hf(&cmd.checkpoint, &cmd.hf, &opts).context("oogc export")?;
    println!(
        "exported step {} of {} to {}: {} file(s), {} parameters, {} bytes; {}, {}",
        e.step,
        e.checkpoint.display(),
        cmd.hf.display(),
        e.weights.files.len(),
        e.weights.total_parameters,
        e.weights.total_bytes,
        e.config.display(),
        e.tokenizer.display()
    );
    Ok(())
}
