//! What one step cost: [`StepStats`] (time, stall, bytes per link, the optimizer's verdict) and
//! [`PhaseStats`] for the forward phase.

/// Time and traffic of one step, for logs, metrics and the end-of-run summary.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StepStats {
    /// The optimizer step (1-based).
    pub step: u64,
    /// Its time, link traffic and the optimizer's verdict (what a metrics line carries as it
    /// is, flattened: serialised as fields of the step).
    #[serde(flatten)]
    pub figures: StepFigures,
    /// The forward phase (from [`super::Runtime::begin_step`] to
    /// [`super::Runtime::end_forward`]); all zero when the caller did not mark the turn. The
    /// backward phase is the step minus this.
    pub forward: PhaseStats,
    /// Units whose optimizer was on the device at the step's end
    /// ([`super::Runtime::place_optimizer`]).
    pub device_units: usize,
    /// Their GPU bytes (master weights, Adam state, gradients and compute copy).
    pub device_optimizer_bytes: u64,
    /// Of `stall_optimizer_s`, the device optimizers' part: their gradients' sums of squares and
    /// their updates after the decision, seconds (on the sim device candle's CPU ops; on CUDA
    /// the host's wait for them).
    pub device_update_s: f64,
    /// With sharded parameters ([`super::RuntimeConfig::shard_parameters`]): units
    /// all-gathered from the ranks' shards at their fetch (the others were kept gathered).
    pub gathers: u64,
    /// Bytes those all-gathers received from the other ranks (the whole units less this rank's
    /// shards).
    pub gather_bytes: u64,
    /// Time the caller was blocked in those all-gathers, seconds, with the wait before each for
    /// the gradient reductions queued ahead of it (one collective at a time, in push order).
    pub gather_s: f64,
    /// CUDA: the high-water mark of the device's memory pool during the step, bytes
    /// (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`, reset at [`super::Runtime::begin_step`]): the swapper's
    /// buffers and every tensor candle allocated — activations, attention scores, autograd
    /// copies — but not the CUDA context nor cuBLAS's own workspace. `None` on the sim device,
    /// whose compute allocates host memory.
    pub device_peak_bytes: Option<u64>,
}

/// The figures of one step that every metrics line carries as they are (flattened into
/// [`StepStats`] and into `crate::run::StepRecord`, same names, same values): time, link
/// traffic and the optimizer's verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepFigures {
    /// Wall time from [`super::Runtime::begin_step`] to the end of
    /// [`super::Runtime::finish_step`], seconds.
    pub step_s: f64,
    /// Time the caller was blocked in [`super::Runtime::fetch`] waiting for H2D copies (exposed
    /// transfer), seconds.
    pub stall_transfer_s: f64,
    /// Time the caller was blocked waiting for optimizer updates (at fetch and at the end of the
    /// step), seconds.
    pub stall_optimizer_s: f64,
    /// Bytes copied host→device.
    pub h2d_bytes: u64,
    /// Bytes copied device→host (gradients and write-backs).
    pub d2h_bytes: u64,
    /// Bytes read from NVMe (optimizer state, spilled compute copies).
    pub nvme_read_bytes: u64,
    /// Bytes written to NVMe.
    pub nvme_write_bytes: u64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Scale applied to the gradients (1 = not clipped).
    pub clip_scale: f32,
    /// The step was skipped: a gradient was not finite.
    pub skipped: bool,
}

/// Time and link traffic of one phase of a step (see [`StepStats::forward`]).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PhaseStats {
    /// Wall time of the phase, seconds.
    pub wall_s: f64,
    /// Time blocked on transfers and optimizer updates in the phase, seconds.
    pub stall_s: f64,
    /// Bytes copied host→device during the phase.
    pub h2d_bytes: u64,
    /// Bytes copied device→host during the phase.
    pub d2h_bytes: u64,
}

impl StepStats {
    /// Total stall (exposed transfer + exposed optimizer), seconds.
    pub fn stall_s(&self) -> f64 {
        self.figures.stall_transfer_s + self.figures.stall_optimizer_s
    }
}

/// Peak bytes held per tier since the runtime began (the residency manager's accounting).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PeakBytes {
    /// Compute copies on the device (gradient staging, carved out of the budget, excluded).
    pub device: u64,
    /// Compute copies in the residency manager's host tier (their home or NVMe cache).
    pub host: u64,
    /// Optimizer state (and compute copies placed there) on NVMe, now.
    pub nvme: u64,
    /// Highest bytes claimed at once from the host ledger: everything the runtime holds in host
    /// memory (compute copies, optimizer state, second buffers, stream buffers, gradients).
    pub host_ledger: u64,
}

/// The step part of a runtime: the open step's number, learning rate and clock, and the
/// [`StepStats`] it accumulates from [`super::Runtime::begin_step`] to
/// [`super::Runtime::finish_step`].
#[derive(Debug, Default)]
pub(super) struct StepClock {
    /// The open (or last) step's Adam step `t`.
    pub(super) step: u64,
    /// The open step's learning rate, for the device optimizers' update.
    pub(super) lr: f32,
    /// When the open step began (`None` between steps).
    started: Option<std::time::Instant>,
    /// The traffic counters when it began.
    at_begin: Option<oogc_swapper::MetricsSnapshot>,
    /// What the open step costs so far.
    pub(super) stats: StepStats,
}

impl StepClock {
    /// Opens step `step` with learning rate `lr`; `traffic` is the counters now.
    pub(super) fn begin(&mut self, step: u64, lr: f32, traffic: oogc_swapper::MetricsSnapshot) {
        self.step = step;
        self.lr = lr;
        self.stats = StepStats {
            step,
            figures: StepFigures { clip_scale: 1.0, ..StepFigures::default() },
            ..StepStats::default()
        };
        self.at_begin = Some(traffic);
        self.started = Some(std::time::Instant::now());
    }

    /// Whether a step is open.
    pub(super) fn in_step(&self) -> bool {
        self.started.is_some()
    }

    /// The turn from forward to backward (the first call of a step counts): time, stall and
    /// link bytes so far become [`StepStats::forward`]; `traffic` gives the counters now.
    pub(super) fn end_forward(&mut self, traffic: impl FnOnce() -> oogc_swapper::MetricsSnapshot) {
        if self.stats.forward.wall_s > 0.0 {
            return;
        }
        let (Some(start), Some(begin)) = (self.started, self.at_begin.as_ref()) else {
            return;
        };
        let now = traffic();
        self.stats.forward = PhaseStats {
            wall_s: start.elapsed().as_secs_f64(),
            stall_s: self.stats.stall_s(),
            h2d_bytes: now.htod.bytes - begin.htod.bytes,
            d2h_bytes: now.dtoh.bytes - begin.dtoh.bytes,
        };
    }

    /// Closes the step: its link and NVMe bytes from `now` (the counters now) and its wall time.
    pub(super) fn close(&mut self, now: &oogc_swapper::MetricsSnapshot) {
        if let Some(begin) = self.at_begin.take() {
            self.stats.figures.h2d_bytes = now.htod.bytes - begin.htod.bytes;
            self.stats.figures.d2h_bytes = now.dtoh.bytes - begin.dtoh.bytes;
            self.stats.figures.nvme_read_bytes = now.nvme_read.bytes - begin.nvme_read.bytes;
            self.stats.figures.nvme_write_bytes = now.nvme_write.bytes - begin.nvme_write.bytes;
        }
        self.stats.figures.step_s = self.started.take().map_or(0.0, |s| s.elapsed().as_secs_f64());
    }
}
