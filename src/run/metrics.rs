//! The metrics file of a run: one [`StepRecord`] per step as a JSON line (the runtime's step
//! figures flattened into it), read back with a torn last line tolerated ([`read_metrics`]), and
//! trimmed to the resumed step on resume.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::runtime::StepFigures;
use crate::train::{Result, TrainError};

/// One line of the metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step (1-based).
    pub step: u64,
    /// Training loss of the step's batch, nats per token (per byte for byte-level data).
    pub loss: f64,
    /// Validation loss when evaluated at this step, nats per token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The same validation loss over the bytes of text the targets cover, bits per byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_bits_per_byte: Option<f64>,
    /// Learning rate.
    pub lr: f32,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
    /// Time the step waited for transfers or optimizer updates, seconds
    /// (`stats.stall_transfer_s + stats.stall_optimizer_s`).
    pub stall_s: f64,
    /// The runtime's figures of the step (time, stalls, bytes per link, the optimizer's
    /// verdict), written inline: `step_s`, `stall_transfer_s`, ... are keys of the line itself.
    #[serde(flatten)]
    pub stats: StepFigures,
    /// MoE: the load-balancing loss (the objective is `loss + aux_loss`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// MoE: tokens whose expert ran on the CPU from its host copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_tokens: Option<usize>,
    /// MoE: bytes of expert copies moved H2D (part of `h2d_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_h2d_bytes: Option<u64>,
    /// MoE: the share of routed experts' uses (forward and backward) that moved no bytes H2D
    /// (a copy already on the device, or CPU compute from the host copy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_hit_rate: Option<f64>,
    /// Data-parallel ranks: each rank's step time, seconds, in rank order (the step's
    /// `step_s` is rank 0's; `tokens_per_s` counts the global batch over rank 0's time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_step_s: Option<Vec<f64>>,
    /// The process's resident set size after the step (`VmRSS`), bytes; absent where
    /// `/proc/self/status` cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    /// Minor page faults during the step (`minflt` of `/proc/self/stat`): pages touched for the
    /// first time, each a trip into the kernel; near zero once the step's buffers are reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_faults: Option<u64>,
    /// Units whose optimizer is on the device (`[optimizer] device_units`, MoE hot experts) at
    /// the step's end; absent when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_units: Option<usize>,
    /// Their GPU bytes (`oogc::runtime::device_optimizer_bytes`: 16, 12 or 10.03 B per parameter
    /// by `[optimizer] state_dtype`, + the compute copy); absent when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_optimizer_bytes: Option<u64>,
    /// Ranks with sharded parameters (`[ranks] shard_parameters`): units all-gathered from the
    /// ranks' shards in the step (rank 0's), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gathers: Option<u64>,
    /// The bytes rank 0 received in those all-gathers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather_bytes: Option<u64>,
    /// CUDA: the device memory pool's high-water mark during the step, bytes (the swapper's
    /// buffers and candle's tensors; [`crate::runtime::StepStats::device_peak_bytes`]); absent
    /// on the sim device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_peak_bytes: Option<u64>,
    /// Seconds the trainer was held between the previous step and this one by a checkpoint
    /// started there (its snapshots, outside `step_s`: the rest of the save is written in the
    /// background, [`crate::train::Trainer::start_checkpoint`]); absent when none started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_held_s: Option<f64>,
    /// Seconds of a checkpoint completed by the end of this step, from its start to its rename
    /// (written in the background while training went on); absent when none completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_s: Option<f64>,
    /// Bytes of that checkpoint's files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_bytes: Option<u64>,
}

/// A line of a JSON-lines file cut short by a crash (the last line, without its newline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornLine {
    /// Byte offset of the line's start in the file.
    pub offset: u64,
    /// Bytes of the torn line.
    pub len: u64,
}

impl TornLine {
    /// Logs a warning naming the file, the offset and what is done with the line (`action`).
    fn warn(&self, path: &Path, action: &str) {
        tracing::warn!(
            "metrics file {}: torn last line at byte offset {} ({} bytes, no newline: a run was killed while writing \
             it); {action}",
            path.display(),
            self.offset,
            self.len
        );
    }
}

/// The records of a metrics file (`[output] metrics`) and its torn last line, if any.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsFile {
    /// One record per complete line, in file order.
    pub records: Vec<StepRecord>,
    /// The last line, when a crash cut it (tolerated: reported, not parsed).
    pub torn: Option<TornLine>,
}

/// Reads a metrics file. A torn last line (no newline: the run was killed while writing it) is
/// left out and reported in [`MetricsFile::torn`] and as a warning naming the file and offset.
///
/// # Errors
/// [`TrainError::Checkpoint`] with the I/O error naming the file; [`TrainError::Mismatch`]
/// naming the file and line for a complete line that is not a step record.
pub fn read_metrics(path: &Path) -> Result<MetricsFile> {
    let io = |source| TrainError::Checkpoint(crate::checkpoint::CheckpointError::Io { path: path.into(), source });
    let bytes = std::fs::read(path).map_err(io)?;
    let (complete, torn) = split_torn(&bytes);
    if let Some(t) = &torn {
        t.warn(path, "ignored");
    }
    let mut records = Vec::new();
    for (i, line) in complete.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let r = serde_json::from_slice(line).map_err(|e| TrainError::Mismatch {
            path: path.into(),
            reason: format!("line {} is not a step record: {e}", i + 1),
        })?;
        records.push(r);
    }
    Ok(MetricsFile { records, torn })
}

/// `bytes` up to and including its last newline, and the torn rest (if not empty).
fn split_torn(bytes: &[u8]) -> (&[u8], Option<TornLine>) {
    let end = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let torn = (end < bytes.len()).then(|| TornLine { offset: end as u64, len: (bytes.len() - end) as u64 });
    (&bytes[..end], torn)
}

/// Before a resumed run appends to its metrics file: cuts a torn last line (warning with the
/// byte offset) and the lines of steps after `resumed_step` (the killed run logged them after
/// its last checkpoint; they are run again), so the file holds each step once.
pub(super) fn trim_metrics_for_resume(path: &Path, resumed_step: u64) -> std::io::Result<()> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let (complete, torn) = split_torn(&bytes);
    if let Some(t) = &torn {
        t.warn(path, "cut before appending");
    }
    let mut cut = complete.len();
    let mut offset = 0;
    for line in complete.split_inclusive(|&b| b == b'\n') {
        let step = serde_json::from_slice::<serde_json::Value>(line).ok().and_then(|v| v["step"].as_u64());
        if step.is_some_and(|s| s > resumed_step) {
            cut = offset;
            break;
        }
        offset += line.len();
    }
    if cut < complete.len() {
        tracing::info!(
            "metrics file {}: dropping the lines after step {resumed_step} (logged after the last checkpoint; run again)",
            path.display()
        );
    }
    if cut < bytes.len() {
        std::fs::OpenOptions::new().write(true).open(path)?.set_len(cut as u64)?;
    }
    Ok(())
}
