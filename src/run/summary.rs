//! The end of a run: [`RunSummary`] (losses, throughput, stalls, traffic, host memory against
//! the plan: [`HostReport`]) and its rendering.

use std::path::PathBuf;

use serde::Serialize;

use crate::train::Trainer;

/// What a run did, printed at the end.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunSummary {
    /// First step run (1-based) and last.
    pub first_step: u64,
    /// Last step completed.
    pub last_step: u64,
    /// Parameters of the model.
    pub params: usize,
    /// Unigram entropy of the training tokens, nats per token (the loss to beat).
    pub unigram_entropy_nats: f64,
    /// Bytes of text per training token (1 for byte-level data).
    pub bytes_per_token: f64,
    /// Last training loss, nats per token.
    pub final_loss: f64,
    /// Validation loss before the first step (`[train] eval_at_start`), nats per token.
    pub initial_val_loss: Option<f64>,
    /// Last validation loss, nats per token.
    pub final_val_loss: f64,
    /// Last validation loss over the bytes of text it covers, bits per byte.
    pub final_val_bits_per_byte: f64,
    /// Tokens per second over the run (steps only, validation excluded).
    pub tokens_per_s: f64,
    /// Seconds in steps.
    pub train_s: f64,
    /// Of which compute (not waiting).
    pub compute_s: f64,
    /// Of which exposed transfer.
    pub exposed_transfer_s: f64,
    /// Of which exposed optimizer.
    pub exposed_optimizer_s: f64,
    /// Bytes per link over the run.
    pub h2d_bytes: u64,
    /// D2H bytes.
    pub d2h_bytes: u64,
    /// NVMe bytes read.
    pub nvme_read_bytes: u64,
    /// NVMe bytes written.
    pub nvme_write_bytes: u64,
    /// Bytes received from the other ranks gathering sharded parameters (0 without).
    pub gather_bytes: u64,
    /// Peak bytes held on the GPU tier (compute copies; gradient staging excluded).
    pub peak_gpu_bytes: u64,
    /// Peak bytes held in pinned host memory by the residency manager.
    pub peak_host_bytes: u64,
    /// NVMe bytes in use at the end (optimizer state, compute copies placed there).
    pub nvme_bytes: u64,
    /// Host memory: the plan, the ledger and the process (see [`HostReport`]).
    pub host: HostReport,
    /// Parameters + optimizer state (the compute copy in the compute dtype — 4 B/param in f32, 2
    /// in bf16 — plus 12 B/param of fp32 master, m and v) over the GPU budget.
    pub model_to_gpu_ratio: f64,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Seconds spent writing them (all saves together).
    pub checkpoint_s: f64,
    /// Bytes of the newest checkpoint written (0 when none was).
    pub checkpoint_bytes: u64,
    /// Saves between steps that failed (a full disk): the run went on from the previous
    /// checkpoint's safety; each is logged.
    pub checkpoint_failures: u64,
    /// The run was stopped early by [`RunOptions::stop`](crate::run::RunOptions::stop) (after
    /// `last_step`, checkpointed when `checkpoint` is set).
    pub stopped: bool,
    /// The checkpoint a later `--resume` continues from (the newest written or resumed from);
    /// `None` without a checkpoint directory.
    pub checkpoint: Option<PathBuf>,
}

/// Host memory at the end of a run: what the plan predicted, what the runtime's ledger counted,
/// and what the process really held (peak RSS), beside the stated overhead outside the ledger.
/// Bytes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostReport {
    /// `[budgets] host`.
    pub budget_bytes: u64,
    /// The plan's host peak: every ledger category at its planned bytes.
    pub plan_peak_bytes: u64,
    /// The ledger's peak: the most bytes claimed at once.
    pub ledger_peak_bytes: u64,
    /// The process's peak resident set size (`VmHWM`); 0 where it cannot be read.
    pub peak_rss_bytes: u64,
    /// The stated overhead outside the ledger, all parts: the process, the training text, the
    /// sim device's memory, candle's buffers, malloc's keep
    /// ([`crate::runtime::budget::HostOverhead::model`]).
    pub fixed_overhead_bytes: u64,
    /// The same by part.
    pub overhead: crate::runtime::budget::HostOverhead,
    /// Per ledger category: `(category, planned bytes, ledger peak bytes)`.
    pub categories: Vec<(String, u64, u64)>,
}

/// `bytes` as decimal gigabytes, `"1.23 GB"`.
pub fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

/// The host memory figures of `trainer`'s run so far.
pub(super) fn host_report(trainer: &Trainer) -> HostReport {
    let rt = trainer.runtime();
    let overhead = trainer.host_overhead();
    let ledger = rt.memory().host_ledger().report();
    let plan = rt.memory().host_plan().cloned().unwrap_or_else(|| rt.memory().plan_host());
    HostReport {
        budget_bytes: ledger.budget_bytes,
        plan_peak_bytes: plan.peak_bytes(),
        ledger_peak_bytes: ledger.peak_bytes,
        peak_rss_bytes: crate::runtime::budget::peak_rss_bytes().unwrap_or(0),
        fixed_overhead_bytes: overhead.total_bytes(),
        overhead,
        categories: ledger
            .categories
            .iter()
            .map(|c| (c.category.name().to_string(), plan.bytes_of(c.category), c.peak_bytes))
            .collect(),
    }
}

impl RunSummary {
    /// A human-readable report.
    pub fn render(&self) -> String {
        let pct = |x: f64| 100.0 * x / self.train_s.max(1e-9);
        let mut s = String::new();
        s += &format!("steps {}..={}, {} parameters\n", self.first_step, self.last_step, self.params);
        s += &format!(
            "loss: train {:.4}, val {:.4} nats/token = {:.3} bits/byte; unigram entropy of the text {:.4} nats/token ({:.3} bits/byte at {:.3} bytes/token)\n",
            self.final_loss,
            self.final_val_loss,
            self.final_val_bits_per_byte,
            self.unigram_entropy_nats,
            self.unigram_entropy_nats / std::f64::consts::LN_2 / self.bytes_per_token.max(1e-9),
            self.bytes_per_token
        );
        if let Some(v) = self.initial_val_loss {
            s += &format!("loss before the first step: val {v:.4} nats/token\n");
        }
        s += &format!(
            "throughput: {:.0} tokens/s; time {:.1} s = compute {:.1} s ({:.0}%) + exposed transfer {:.1} s ({:.0}%) + exposed optimizer {:.1} s ({:.0}%)\n",
            self.tokens_per_s,
            self.train_s,
            self.compute_s,
            pct(self.compute_s),
            self.exposed_transfer_s,
            pct(self.exposed_transfer_s),
            self.exposed_optimizer_s,
            pct(self.exposed_optimizer_s)
        );
        s += &format!(
            "traffic: H2D {}, D2H {}, NVMe read {}, NVMe write {}\n",
            gb(self.h2d_bytes),
            gb(self.d2h_bytes),
            gb(self.nvme_read_bytes),
            gb(self.nvme_write_bytes)
        );
        if self.gather_bytes > 0 {
            s.pop();
            s += &format!("; all-gathers of sharded parameters received {}\n", gb(self.gather_bytes));
        }
        s += &format!(
            "peak: GPU {} B, pinned host {} B, NVMe {} B; parameters + optimizer state = {:.1} × the GPU budget\n",
            self.peak_gpu_bytes, self.peak_host_bytes, self.nvme_bytes, self.model_to_gpu_ratio
        );
        let h = &self.host;
        s += &format!(
            "host: budget {} B; plan peak {} B, ledger peak {} B, process peak RSS {} B (stated overhead outside the \
             ledger {} B)\n",
            h.budget_bytes, h.plan_peak_bytes, h.ledger_peak_bytes, h.peak_rss_bytes, h.fixed_overhead_bytes
        );
        s += "  by category (plan / ledger peak):";
        for (name, plan, peak) in &h.categories {
            s += &format!(" {name} {plan} / {peak};");
        }
        s += "\n";
        if let Some(last) = self.checkpoints.last() {
            s += &format!("checkpoints: {} written, the last {}\n", self.checkpoints.len(), last.display());
        }
        if self.stopped {
            s += &format!("stopped early (signal) after step {}\n", self.last_step);
        }
        s
    }
}
