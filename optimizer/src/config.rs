//! Hyper-parameters and configuration: [`AdamConfig`], [`LrSchedule`], [`OptimizerConfig`].

use oogc_swapper::DType;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::kernel::StepScalars;
use crate::master::{MasterDType, StateFormat};
use crate::quant::StateDType;
use crate::simd::Isa;

/// How weight decay enters the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdamKind {
    /// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019), as
    /// `torch.optim.AdamW`: `p ← p·(1 − lr·wd)` before the Adam step.
    #[default]
    AdamW,
    /// Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015) with L2
    /// regularisation, as `torch.optim.Adam`: `g ← g + wd·p`.
    Adam,
}

/// Adam/AdamW hyper-parameters except the learning rate, which is given per step. `amsgrad` is
/// not supported (torch's default, `False`).
///
/// They are f64, as torch's (Python floats): the kernel's constants such as `1 − β2` are
/// computed in f64 and rounded once; from an f32 `β2 = 0.999` the constant would be off by
/// 1.3e-5 relative, outside the tolerance of torch's reference vectors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamConfig {
    /// Decoupled (AdamW) or L2 (Adam) weight decay. Default: AdamW.
    #[serde(default)]
    pub kind: AdamKind,
    /// Decay of the first moment `m`, in [0, 1). Default: 0.9.
    #[serde(default = "AdamConfig::default_beta1")]
    pub beta1: f64,
    /// Decay of the second moment `v`, in [0, 1). Default: 0.999.
    #[serde(default = "AdamConfig::default_beta2")]
    pub beta2: f64,
    /// Added to `sqrt(v̂)` in the denominator, > 0. Default: 1e-8.
    #[serde(default = "AdamConfig::default_eps")]
    pub eps: f64,
    /// Weight decay coefficient, ≥ 0. Default: 0.01 (torch's AdamW default).
    #[serde(default = "AdamConfig::default_weight_decay")]
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        Self {
            kind: AdamKind::AdamW,
            beta1: Self::default_beta1(),
            beta2: Self::default_beta2(),
            eps: Self::default_eps(),
            weight_decay: Self::default_weight_decay(),
        }
    }
}

impl AdamConfig {
    fn default_beta1() -> f64 {
        0.9
    }
    fn default_beta2() -> f64 {
        0.999
    }
    fn default_eps() -> f64 {
        1e-8
    }
    fn default_weight_decay() -> f64 {
        0.01
    }

    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key (`optimizer.adam.beta1`, ...) and the accepted range.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| Err(Error::Config { key: format!("optimizer.adam.{key}"), reason });
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", format!("{} is not in [0, 1)", self.beta1));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", format!("{} is not in [0, 1)", self.beta2));
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return bad("eps", format!("{} is not a finite number > 0", self.eps));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad("weight_decay", format!("{} is not a finite number >= 0", self.weight_decay));
        }
        Ok(())
    }

    /// The per-step constants of the update at step `t` (1-based, as torch's `state['step']`
    /// after its increment) with learning rate `lr`, gradients multiplied by `grad_scale` (the
    /// clipping factor; 1 for none).
    ///
    /// As torch's fused CPU kernel, the bias corrections `1 − β^t`, the step size
    /// `lr / (1 − β1^t)`, `sqrt(1 − β2^t)`, `1 − lr·wd`, `1 − β1` and `1 − β2` are computed in f64
    /// and rounded once to f32.
    ///
    /// # Errors
    /// [`Error::Config`] when `t` is 0 (steps are 1-based) or `lr` is negative or not finite.
    pub fn scalars(&self, t: u64, lr: f32, grad_scale: f32) -> Result<StepScalars> {
        if t == 0 {
            return Err(Error::Config {
                key: "step".into(),
                reason: "steps are 1-based: the first step is t = 1".into(),
            });
        }
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(Error::Config { key: "lr".into(), reason: format!("{lr} is not a finite number >= 0") });
        }
        Ok(StepScalars::new(self, t, lr, grad_scale))
    }
}

/// Learning-rate schedule: linear warm-up from 0 to `peak_lr` over `warmup_steps`, then cosine
/// decay to `min_lr` at `total_steps`, constant after (as nanoGPT's `get_lr`, Loshchilov &
/// Hutter, "SGDR", ICLR 2017, without restarts). Steps are 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// Learning rate at the end of warm-up. > 0.
    pub peak_lr: f32,
    /// Learning rate from `total_steps` on, in [0, peak_lr].
    pub min_lr: f32,
    /// Steps of linear warm-up (0: start at `peak_lr`).
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr`; at least `warmup_steps`.
    pub total_steps: u64,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f32) -> Self {
        Self { peak_lr: lr, min_lr: lr, warmup_steps: 0, total_steps: 0 }
    }

    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key (`optimizer.schedule.peak_lr`, ...).
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| Err(Error::Config { key: format!("optimizer.schedule.{key}"), reason });
        if !(self.peak_lr > 0.0 && self.peak_lr.is_finite()) {
            return bad("peak_lr", format!("{} is not a finite number > 0", self.peak_lr));
        }
        if !(self.min_lr >= 0.0 && self.min_lr <= self.peak_lr) {
            return bad("min_lr", format!("{} is not in [0, peak_lr = {}]", self.min_lr, self.peak_lr));
        }
        if self.total_steps < self.warmup_steps {
            return bad("total_steps", format!("{} is below warmup_steps = {}", self.total_steps, self.warmup_steps));
        }
        Ok(())
    }

    /// The learning rate of step `t` (1-based; `t = 0` is treated as 1).
    pub fn lr(&self, t: u64) -> f32 {
        let t = t.max(1);
        if t <= self.warmup_steps {
            return (self.peak_lr as f64 * t as f64 / self.warmup_steps as f64) as f32;
        }
        if t >= self.total_steps {
            return if self.total_steps > self.warmup_steps { self.min_lr } else { self.peak_lr };
        }
        let progress = (t - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        (self.min_lr as f64 + cos * (self.peak_lr as f64 - self.min_lr as f64)) as f32
    }
}

/// Configuration of a [`crate::PipelinedOptimizer`] (config key prefix `optimizer.`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Worker threads (updates of units and the threads of one update share them). Size it
    /// explicitly beside the trainer's own pools. Default: 2. From 1 to 1024.
    #[serde(default = "OptimizerConfig::default_threads")]
    pub threads: usize,
    /// Adam hyper-parameters.
    #[serde(default)]
    pub adam: AdamConfig,
    /// Global-norm gradient clipping threshold (torch's `clip_grad_norm_(max_norm)`); `None`
    /// disables clipping. Default: `None`. When set, > 0.
    #[serde(default)]
    pub clip_norm: Option<f32>,
    /// Element type of the compute copy written by each update: a float type (`f32`, `bf16`,
    /// `f16`). Default: bf16.
    #[serde(default = "OptimizerConfig::default_compute_dtype")]
    pub compute_dtype: DType,
    /// Bytes of optimizer state (master, `m`, `v` together: 12 B per parameter) per streamed
    /// NVMe chunk. Default: 12 MiB (1 Mi parameters). Rounded to whole blocks of
    /// [`crate::NORM_BLOCK`] parameters (192 KiB); at least one block.
    #[serde(default = "OptimizerConfig::default_stream_chunk_bytes")]
    pub stream_chunk_bytes: usize,
    /// Most bytes of host memory the NVMe streams hold at once (three chunk buffers per stream
    /// in flight: read, update, write). Default: 128 MiB. At least three chunk buffers.
    #[serde(default = "OptimizerConfig::default_stream_host_budget_bytes")]
    pub stream_host_budget_bytes: u64,
    /// Most bytes of host memory held to roll back a speculative update (the second state
    /// buffers of host-placed units, the second compute copy of every unit); units beyond it
    /// are not speculated but updated once the step's scale is known. `None`: no limit.
    /// Default: `None`.
    #[serde(default)]
    pub rollback_budget_bytes: Option<u64>,
    /// Force a dispatch path (`avx512`, `avx2`, `scalar`); `None` detects. Default: `None`.
    #[serde(default)]
    pub isa: Option<Isa>,
    /// What a non-finite gradient does. Default: [`NonFinite::Skip`].
    #[serde(default)]
    pub nonfinite: NonFinite,
    /// Element type of Adam's moments `m` and `v` (master weights stay f32): `f32` (8 B per
    /// parameter), `bf16` (4 B) or `int8` (block-wise, 2.03 B; [`crate::quant`]). Default: f32.
    #[serde(default)]
    pub state_dtype: StateDType,
    /// Element type of the master weights: `f32` (4 B per parameter) or `bf16` (2 B, written by
    /// stochastic rounding: [`crate::master`]). Default: f32.
    #[serde(default)]
    pub master_dtype: MasterDType,
}

/// What a step with a non-finite gradient (NaN or ±inf anywhere) does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonFinite {
    /// The whole step is skipped: every unit keeps its state (as torch's `GradScaler` and
    /// DeepSpeed's overflow check). Needs each unit's gradients, or a second copy of its update,
    /// until the step's last gradient is in: the gradients are held (or the update speculated)
    /// until then.
    #[default]
    Skip,
    /// The run stops with [`crate::Error::NonFiniteGradient`] naming the unit; that unit is not
    /// updated, but units updated earlier in the step keep their update (resume from the last
    /// checkpoint). With clipping off, this makes every unit's update final as soon as its
    /// gradients arrive ([`OptimizerConfig::updates_immediately`]): no gradients held until the
    /// step's end, no second buffers — what a run whose gradients outgrow host memory needs
    /// (DeepSpeed's bf16 optimizer has no skip either).
    Stop,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            threads: Self::default_threads(),
            adam: AdamConfig::default(),
            clip_norm: None,
            compute_dtype: Self::default_compute_dtype(),
            stream_chunk_bytes: Self::default_stream_chunk_bytes(),
            stream_host_budget_bytes: Self::default_stream_host_budget_bytes(),
            rollback_budget_bytes: None,
            isa: None,
            nonfinite: NonFinite::Skip,
            state_dtype: StateDType::F32,
            master_dtype: MasterDType::F32,
        }
    }
}

impl OptimizerConfig {
    fn default_threads() -> usize {
        2
    }
    fn default_compute_dtype() -> DType {
        DType::BF16
    }
    fn default_stream_chunk_bytes() -> usize {
        12 << 20
    }
    fn default_stream_host_budget_bytes() -> u64 {
        128 << 20
    }

    /// Parameters per streamed chunk: as many whole [`crate::NORM_BLOCK`]s as
    /// `stream_chunk_bytes` holds at [`StateFormat::bytes`] (`stream_chunk_bytes / 12`
    /// rounded down to whole blocks in f32), at least one block.
    pub fn stream_chunk_params(&self) -> usize {
        let block = crate::NORM_BLOCK;
        (self.stream_chunk_bytes / self.state_format().bytes(block)).max(1) * block
    }

    /// Whether the compute copy holds the master weights bit for bit: f32 masters with f32
    /// compute copies, bf16 masters with bf16 ones. Then NVMe-placed state keeps the master
    /// weights there, not in its chunks ([`crate::stream`]'s module docs: 4 B per parameter
    /// fewer to write and read each step in f32).
    pub fn master_in_compute_copy(&self) -> bool {
        self.compute_dtype == self.master_dtype.copy_dtype()
    }

    /// How NVMe-placed state is cut and stored: chunks of [`Self::stream_chunk_params`],
    /// [`Self::state_format`], the master weights in the compute copy when
    /// [`Self::master_in_compute_copy`].
    pub fn stream_config(&self) -> crate::StreamConfig {
        crate::StreamConfig {
            chunk_params: self.stream_chunk_params(),
            format: self.state_format(),
            master_in_copy: self.master_in_compute_copy(),
        }
    }

    /// How a unit's state is stored: [`Self::master_dtype`] and [`Self::state_dtype`].
    pub fn state_format(&self) -> StateFormat {
        StateFormat { master: self.master_dtype, moments: self.state_dtype }
    }

    /// Whether each unit's update is final when its job ends, without waiting for the step's
    /// other gradients: clipping off ([`Self::clip_norm`] `None`) and
    /// [`NonFinite::Stop`]. Then the optimizer holds a unit's gradients only while its update
    /// runs (at most [`Self::gradients_in_flight`] units' at once) and speculates nothing.
    pub fn updates_immediately(&self) -> bool {
        self.clip_norm.is_none() && self.nonfinite == NonFinite::Stop
    }

    /// Units whose gradients the optimizer holds at most at once when it
    /// [updates immediately](Self::updates_immediately): one per worker thread plus one queued;
    /// [`crate::PipelinedOptimizer::wait_for_gradient_room`] holds a submitter back beyond it.
    pub fn gradients_in_flight(&self) -> usize {
        self.threads + 1
    }

    /// Checks every value's range (and the Adam hyper-parameters).
    ///
    /// # Errors
    /// [`Error::Config`] naming the key and the accepted range; [`Error::IsaUnavailable`] for a
    /// forced path this CPU lacks.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| Err(Error::Config { key: format!("optimizer.{key}"), reason });
        if !(1..=1024).contains(&self.threads) {
            return bad("threads", format!("{} is not between 1 and 1024", self.threads));
        }
        self.adam.validate()?;
        if !self.compute_dtype.is_float() {
            return bad("compute_dtype", format!("{} is not a float type: use f32, bf16 or f16", self.compute_dtype));
        }
        if let Some(c) = self.clip_norm {
            if !(c > 0.0 && c.is_finite()) {
                return bad("clip_norm", format!("{c} is not a finite number > 0; leave it unset to disable clipping"));
            }
        }
        if self.stream_chunk_bytes == 0 {
            return bad("stream_chunk_bytes", "must be more than 0".into());
        }
        let need = 3 * oogc_swapper::host::size_class(self.stream_chunk_params() * 12) as u64;
        if self.stream_host_budget_bytes < need {
            return bad(
                "stream_host_budget_bytes",
                format!(
                    "{} bytes cannot hold the three chunk buffers of one stream ({need} bytes at \
                     stream_chunk_bytes = {}); raise it or lower stream_chunk_bytes",
                    self.stream_host_budget_bytes, self.stream_chunk_bytes
                ),
            );
        }
        if let Some(isa) = self.isa {
            if !isa.is_available() {
                return Err(Error::IsaUnavailable { isa });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_linearly_then_decays_by_cosine_to_min() {
        let s = LrSchedule { peak_lr: 1e-3, min_lr: 1e-4, warmup_steps: 10, total_steps: 110 };
        s.validate().unwrap();
        assert!((s.lr(1) - 1e-4).abs() < 1e-9);
        assert!((s.lr(5) - 5e-4).abs() < 1e-9);
        assert_eq!(s.lr(10), 1e-3);
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-8, "{}", s.lr(60));
        assert!(s.lr(11) < 1e-3 && s.lr(11) > 0.99e-3);
        assert_eq!(s.lr(110), 1e-4);
        assert_eq!(s.lr(1000), 1e-4);
        let mut prev = f32::INFINITY;
        for t in 10..=110 {
            assert!(s.lr(t) <= prev);
            prev = s.lr(t);
        }
        assert_eq!(LrSchedule::constant(3e-4).lr(7), 3e-4);
        assert!(LrSchedule { min_lr: 2e-3, ..s }.validate().is_err());
        assert!(LrSchedule { total_steps: 5, ..s }.validate().is_err());
    }

    #[test]
    fn config_errors_name_the_key() {
        let c = OptimizerConfig { threads: 0, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("optimizer.threads"));
        let c = OptimizerConfig { adam: AdamConfig { beta2: 1.0, ..Default::default() }, ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("optimizer.adam.beta2"));
        let c = OptimizerConfig { stream_host_budget_bytes: 1 << 20, ..Default::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("stream_host_budget_bytes") && e.contains("raise it"), "{e}");
        let c = OptimizerConfig { clip_norm: Some(0.0), ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("clip_norm"));
        OptimizerConfig::default().validate().unwrap();
    }

    #[test]
    fn config_parses_from_json_with_defaults_and_refuses_unknown_keys() {
        let c: OptimizerConfig = serde_json::from_str(r#"{"threads": 1, "clip_norm": 1.0, "isa": "scalar"}"#).unwrap();
        assert_eq!(c.threads, 1);
        assert_eq!(c.clip_norm, Some(1.0));
        assert_eq!(c.adam, AdamConfig::default());
        assert!(serde_json::from_str::<OptimizerConfig>(r#"{"thread": 1}"#).is_err());
    }
}
