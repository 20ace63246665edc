//! The planner behind `oogc plan`: memory per tier, the minimum GPU budget and the predicted
//! step time of a model under budgets, from a [`HardwareProfile`] and the [simulator](crate::sim).
//!
//! Compute time per unit is estimated from FLOPs: forward `2 · params · tokens` (one multiply
//! and one add per parameter and token; the caller adds attention, see `oogc::plan::gpt_units`),
//! backward with recompute [`HardwareProfile::backward_flops_ratio`] `×` forward (default 3:
//! recompute 1× + VJP 2×, Chen et al. 2016 / Kaplan et al. 2020), divided by
//! [`HardwareProfile::device_gflops`]. `oogc plan --probe-compute` measures both figures on
//! the sim device for a model's shape.
//!
//! **A GPU's figures.** A profile may carry a GPU's measured figures ([`HardwareProfile::device_name`],
//! [`HardwareProfile::device_memory_bytes`], [`HardwareProfile::device_bf16_tflops`],
//! [`HardwareProfile::device_f32_tflops`]: `oogc bench probe --device cuda:N` writes them). A
//! CUDA run is planned with [`HardwareProfile::for_gpu`]: the compute rate is the compute
//! dtype's matmul TFLOP/s × [`HardwareProfile::device_mfu`], and without measured figures those
//! of a named datasheet ([`GpuDatasheet::H100_SXM`]), said so in the profile's `source`.
//!
//! A unit marked [`ModelUnit::host_compute`] (an MoE expert computed on the CPU from its host
//! copy) moves nothing over H2D/D2H; its compute is charged to the same compute stream at
//! [`HardwareProfile::device_gflops`], which is exact for the sim device (its "GPU" is this
//! CPU) and pessimistic on a GPU machine (there the CPU computes beside the GPU).

use std::path::Path;

use oogc_swapper::{StatePlacement, TensorId};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::policy::PolicyKind;
use crate::prefetcher::PrefetchConfig;
use crate::schedule::{min_working_set, Schedule};
use crate::sim::{simulate_kind, LinkBandwidths, SimConfig, SimReport, SimUnit};

/// The figures of a machine that the planner needs. TOML, every key optional (defaults: the
/// sim device on the development machine), unknown keys refused.
///
/// ```toml
/// h2d_gbps = 25.0
/// nvme_read_gbps = 3.1
/// cpu_adam_params_per_s = 1.2e9
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HardwareProfile {
    /// Host → device bandwidth, GB/s (10⁹ B/s). Default: 15 (the sim device's memcpy speed on
    /// the development machine; PCIe 4.0 x16 is about 25, PCIe 5.0 x16 about 50).
    pub h2d_gbps: f64,
    /// Device → host bandwidth, GB/s (10⁹ B/s). Default: 15.
    pub d2h_gbps: f64,
    /// NVMe read bandwidth of the store, GB/s (10⁹ B/s). Default: 3.0.
    pub nvme_read_gbps: f64,
    /// NVMe write bandwidth of the store, GB/s (10⁹ B/s). Default: 3.0.
    pub nvme_write_gbps: f64,
    /// CPU Adam(W) rate, parameters per second, all optimizer threads together. Default: 1e9.
    pub cpu_adam_params_per_s: f64,
    /// Device compute rate for the step-time estimate, GFLOP/s (10⁹ FLOP/s) achieved, not peak,
    /// counted on the forward FLOPs of the model (see the module docs).
    /// Default: 50 (candle on the CPU of a 2-core machine, which is what the sim device computes
    /// with); `oogc plan --probe-compute` measures it.
    pub device_gflops: f64,
    /// Time of a unit's backward (recompute + vector-Jacobian product) over the time of its
    /// forward, dimensionless (> 0). Default: 3 (recompute 1× + VJP 2× the forward FLOPs);
    /// `oogc plan --probe-compute` measures it (candle on the CPU is often above 3: its
    /// backward runs more, smaller ops than the forward). Missing in a profile file: 3.
    pub backward_flops_ratio: f64,
    /// Host memory bandwidth (STREAM triad), GB/s (10⁹ B/s). Informational: the CPU Adam
    /// roofline is this / 28 B per parameter. Default: 40.
    pub host_memory_gbps: f64,
    /// Where the figures come from (`defaults (sim device)`, or what the probe measured and when).
    pub source: String,
    /// The GPU's name as the driver reports it (`NVIDIA H100 80GB HBM3`); absent in a profile
    /// without GPU figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    /// The GPU's memory, bytes (the driver's total); absent: unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory_bytes: Option<u64>,
    /// The GPU's measured bf16 matrix-product rate, TFLOP/s (10¹² FLOP/s): an 8192³ product on
    /// candle's stream (`oogc bench probe --device cuda:N`); absent: unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_bf16_tflops: Option<f64>,
    /// The GPU's measured f32 matrix-product rate, TFLOP/s (a 4096³ product); absent: unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_f32_tflops: Option<f64>,
    /// Model FLOP utilisation of a training step on a GPU against its matrix-product rate
    /// (dimensionless, in (0, 1]): a CUDA run is planned at `tflops × device_mfu`
    /// ([`HardwareProfile::for_gpu`]). Default: [`DEFAULT_GPU_MFU`] (assumed; `oogc bench step`
    /// on the GPU measures a step). Unused on the sim device.
    pub device_mfu: f64,
}

/// The default [`HardwareProfile::device_mfu`]: half the matrix-product rate. An assumption, not
/// a measurement: Megatron-LM trains GPT models at about half of an A100's peak (52 % in
/// Narayanan et al., SC 2021; 54–56 % model FLOP utilisation in Korthikanti et al. 2022) with
/// fused kernels; the candle compositions here (f32 softmax, unfused element-wise ops, no flash
/// attention) lose more, and a measured profile's rate is the matmul's achieved rate (about 0.8
/// of the datasheet's on an H100), not the peak, which gives some of it back.
pub const DEFAULT_GPU_MFU: f64 = 0.5;

/// A GPU's datasheet figures: what a CUDA run is planned with when no profile measured the GPU
/// ([`HardwareProfile::for_gpu`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuDatasheet {
    /// The GPU.
    pub name: &'static str,
    /// GPU memory, bytes.
    pub memory_bytes: u64,
    /// Dense bf16 tensor-core rate, TFLOP/s (without sparsity).
    pub bf16_tflops: f64,
    /// f32 rate (not tensor cores), TFLOP/s.
    pub f32_tflops: f64,
    /// Nominal host link per direction, GB/s (10⁹ B/s).
    pub link_gbps: f64,
    /// The fraction of `link_gbps` a pinned `cudaMemcpyAsync` achieves, dimensionless.
    pub link_fraction: f64,
    /// Where the figures come from.
    pub citation: &'static str,
}

impl GpuDatasheet {
    /// NVIDIA H100 SXM5 80 GB (the NVIDIA H100 Tensor Core GPU datasheet): BF16 tensor core
    /// 1,979 TFLOP/s with sparsity, so 989 dense; FP32 67 TFLOP/s; 80 GB HBM3; PCIe Gen5
    /// 128 GB/s (both directions: 64 GB/s each way). Pinned copies reach about 0.8 of the
    /// nominal link (PCIe 5.0 x16's 64 GB/s carries about 52 GB/s of payload after encoding
    /// and packet headers).
    pub const H100_SXM: GpuDatasheet = GpuDatasheet {
        name: "NVIDIA H100 SXM 80 GB",
        memory_bytes: 80_000_000_000,
        bf16_tflops: 989.0,
        f32_tflops: 67.0,
        link_gbps: 64.0,
        link_fraction: 0.8,
        citation: "NVIDIA H100 Tensor Core GPU datasheet",
    };
}

impl Default for HardwareProfile {
    fn default() -> Self {
        Self {
            h2d_gbps: 15.0,
            d2h_gbps: 15.0,
            nvme_read_gbps: 3.0,
            nvme_write_gbps: 3.0,
            cpu_adam_params_per_s: 1e9,
            device_gflops: 50.0,
            backward_flops_ratio: 3.0,
            host_memory_gbps: 40.0,
            source: "defaults (sim device)".into(),
            device_name: None,
            device_memory_bytes: None,
            device_bf16_tflops: None,
            device_f32_tflops: None,
            device_mfu: DEFAULT_GPU_MFU,
        }
    }
}

impl HardwareProfile {
    /// Parses a TOML profile and checks it.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key for an unknown key, a bad type or a value that is not a
    /// positive number.
    pub fn from_toml_str(s: &str) -> Result<Self> {
        let p: HardwareProfile =
            toml::from_str(s).map_err(|e| Error::Config { key: "hardware profile".into(), reason: e.to_string() })?;
        p.validate()?;
        Ok(p)
    }

    /// Reads a TOML profile from `path`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file when it cannot be read, else as [`HardwareProfile::from_toml_str`].
    pub fn load(path: &Path) -> Result<Self> {
        let s = std::fs::read_to_string(path).map_err(|e| Error::Config {
            key: path.display().to_string(),
            reason: format!(
                "cannot read the hardware profile ({e}); write one with `oogc plan --hardware-probe --out {}`",
                path.display()
            ),
        })?;
        Self::from_toml_str(&s).map_err(|e| match e {
            Error::Config { reason, .. } => Error::Config { key: path.display().to_string(), reason },
            e => e,
        })
    }

    /// The profile as TOML.
    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).expect("a profile of numbers and a string serializes")
    }

    /// Checks every rate is a finite number > 0.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key.
    pub fn validate(&self) -> Result<()> {
        for (key, v) in [
            ("h2d_gbps", self.h2d_gbps),
            ("d2h_gbps", self.d2h_gbps),
            ("nvme_read_gbps", self.nvme_read_gbps),
            ("nvme_write_gbps", self.nvme_write_gbps),
            ("cpu_adam_params_per_s", self.cpu_adam_params_per_s),
            ("device_gflops", self.device_gflops),
            ("backward_flops_ratio", self.backward_flops_ratio),
            ("host_memory_gbps", self.host_memory_gbps),
            ("device_bf16_tflops", self.device_bf16_tflops.unwrap_or(1.0)),
            ("device_f32_tflops", self.device_f32_tflops.unwrap_or(1.0)),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::Config { key: key.into(), reason: format!("{v} must be a finite number > 0") });
            }
        }
        if !(self.device_mfu.is_finite() && self.device_mfu > 0.0 && self.device_mfu <= 1.0) {
            return Err(Error::Config {
                key: "device_mfu".into(),
                reason: format!("{} must be a fraction in (0, 1]", self.device_mfu),
            });
        }
        if self.device_memory_bytes == Some(0) {
            return Err(Error::Config { key: "device_memory_bytes".into(), reason: "0 must be > 0".into() });
        }
        Ok(())
    }

    /// Whether the profile carries a GPU's measured matrix-product rates.
    pub fn has_gpu_figures(&self) -> bool {
        self.device_bf16_tflops.is_some() || self.device_f32_tflops.is_some()
    }

    /// The profile for a run on a CUDA GPU computing in `dtype_bytes`-byte elements (2: bf16,
    /// the tensor cores' rate; 4: f32): `device_gflops` = the dtype's matrix-product TFLOP/s ×
    /// [`HardwareProfile::device_mfu`] × 1000, from the profile's measured figures, else (and
    /// for a dtype it did not measure) from `datasheet`, whose memory and links
    /// (`link_gbps × link_fraction`) are taken too when the profile measured no GPU; the host's
    /// figures (NVMe, CPU Adam, memory) stay the profile's. `source` says which figures came
    /// from where, so a plan never shows the sim device's figures for a GPU silently.
    pub fn for_gpu(&self, dtype_bytes: u64, datasheet: &GpuDatasheet) -> HardwareProfile {
        let mut hw = self.clone();
        let (measured, dtype) =
            if dtype_bytes <= 2 { (self.device_bf16_tflops, "bf16") } else { (self.device_f32_tflops, "f32") };
        let sheet = if dtype_bytes <= 2 { datasheet.bf16_tflops } else { datasheet.f32_tflops };
        let tflops = measured.unwrap_or(sheet);
        hw.device_gflops = tflops * self.device_mfu * 1000.0;
        let host = if self.source == HardwareProfile::default().source {
            "host figures (NVMe, CPU Adam, memory): defaults, not measured on this machine".to_string()
        } else {
            format!("host figures from the profile ({})", self.source)
        };
        let compute = format!(
            "compute {tflops:.0} TFLOP/s {dtype} x {:.2} model FLOP utilisation (device_mfu) = {:.0} TFLOP/s",
            self.device_mfu,
            hw.device_gflops / 1000.0
        );
        if self.has_gpu_figures() {
            let name = self.device_name.as_deref().unwrap_or("the GPU");
            let from = if measured.is_some() {
                "measured".to_string()
            } else {
                format!("not measured: the {} datasheet's", datasheet.name)
            };
            hw.source = format!(
                "GPU figures of the profile ({name}): {compute} ({dtype} rate {from}); H2D {:.1} GB/s, D2H {:.1} GB/s; {host}",
                hw.h2d_gbps, hw.d2h_gbps
            );
        } else {
            let link = datasheet.link_gbps * datasheet.link_fraction;
            hw.h2d_gbps = link;
            hw.d2h_gbps = link;
            hw.device_name = Some(datasheet.name.into());
            hw.device_memory_bytes = hw.device_memory_bytes.or(Some(datasheet.memory_bytes));
            hw.source = format!(
                "no --profile with GPU figures: GPU figures from the {} ({}): {compute}; H2D and D2H {link:.1} GB/s \
                 ({:.0} GB/s per direction nominal x {:.2}); {host}",
                datasheet.citation, datasheet.name, datasheet.link_gbps, datasheet.link_fraction
            );
        }
        hw
    }

    /// The links as the simulator takes them.
    pub fn links(&self) -> LinkBandwidths {
        LinkBandwidths {
            h2d_gbps: self.h2d_gbps,
            d2h_gbps: self.d2h_gbps,
            nvme_read_gbps: self.nvme_read_gbps,
            nvme_write_gbps: self.nvme_write_gbps,
        }
    }
}

/// One unit of a model, for planning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelUnit {
    /// Name (`embedding`, `block.3`, `head`).
    pub name: String,
    /// Parameters.
    pub numel: u64,
    /// Bytes of the compute copy (and of its gradients): `numel ×` the compute dtype's size.
    pub compute_bytes: u64,
    /// Forward FLOPs of one step (all tokens of the batch).
    pub forward_flops: f64,
    /// Computed on the CPU from its host copy (an MoE expert the placement keeps cold): no H2D
    /// copy, no D2H gradients (they go straight to the CPU optimizer), no device bytes; the
    /// compute is charged to the compute stream as for any unit (see the module docs).
    /// Default (missing in a serialized unit): false.
    #[serde(default)]
    pub host_compute: bool,
}

/// What to plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanInput {
    /// The model's units in forward order.
    pub units: Vec<ModelUnit>,
    /// Device bytes for unit copies.
    pub gpu_budget_bytes: u64,
    /// Host bytes, if limited (decides an automatic state placement and the warnings).
    pub host_budget_bytes: Option<u64>,
    /// Where the optimizer state (fp32 master, m, v: 12 B per parameter) lives; `None`: host
    /// if the host budget holds everything, else NVMe.
    pub optimizer_state: Option<StatePlacement>,
    /// Bytes of optimizer state per parameter: 12 (fp32 master, m, v), 8 with bf16 moments,
    /// 6.03 with int8 ones. Default: 12.
    #[serde(default = "PlanInput::default_state_bytes_per_param")]
    pub state_bytes_per_param: f64,
    /// The sliding window.
    pub prefetch: PrefetchConfig,
    /// Simulated steps (the last is reported). Default 3.
    pub steps: usize,
    /// Keep the Chrome/Perfetto trace of the simulated step in [`PlanReport::sim`].
    pub trace: bool,
}

impl PlanInput {
    fn default_state_bytes_per_param() -> f64 {
        12.0
    }
}

/// Bytes needed per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TierNeeds {
    /// Device: the budget the step uses (at most the model's compute copies), bytes.
    pub device_bytes: u64,
    /// Host: compute copies, optimizer state kept in memory, gradients in flight (peak), bytes.
    pub host_bytes: u64,
    /// NVMe: optimizer state kept there, bytes.
    pub nvme_bytes: u64,
}

/// The plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    /// Units in the model.
    pub units: usize,
    /// Parameters in the model.
    pub params: u64,
    /// Bytes of all compute copies.
    pub model_bytes: u64,
    /// The smallest GPU budget that can run the step ([`min_working_set`]), bytes.
    pub min_gpu_budget_bytes: u64,
    /// The GPU budget that holds every unit at once (nothing moves but the post-update refresh;
    /// units computed on the host excluded), bytes.
    pub full_gpu_budget_bytes: u64,
    /// Memory per tier.
    pub memory: TierNeeds,
    /// Whether the optimizer state was placed on NVMe.
    pub optimizer_state_on_nvme: bool,
    /// Predicted step time, seconds.
    pub step_s: f64,
    /// Compute part, seconds.
    pub compute_s: f64,
    /// Transfers the compute stream waited for, seconds.
    pub exposed_transfer_s: f64,
    /// Optimizer steps the compute stream waited for, seconds.
    pub exposed_optimizer_s: f64,
    /// `max(compute, H2D, D2H, NVMe read, NVMe write, optimizer)` seconds: no schedule beats it.
    pub lower_bound_s: f64,
    /// The simulation behind the figures (next-use policy with the window).
    pub sim: SimReport,
    /// Things to fix (host budget exceeded, ...).
    pub warnings: Vec<String>,
}

/// Plans `input` on `hw`.
///
/// # Errors
/// [`Error::Config`] for no units or a bad profile; [`Error::BudgetBelowWorkingSet`] (with the
/// minimum) when the GPU budget cannot run the step.
pub fn plan(input: &PlanInput, hw: &HardwareProfile) -> Result<PlanReport> {
    hw.validate()?;
    if input.units.is_empty() {
        return Err(Error::Config { key: "units".into(), reason: "the model has no units".into() });
    }
    // A unit computed on the host has no device copy: 0 bytes for the schedule and the links.
    let device_bytes = |u: &ModelUnit| if u.host_compute { 0 } else { u.compute_bytes };
    let ids: Vec<(TensorId, u64)> =
        input.units.iter().enumerate().map(|(i, u)| (TensorId(i as u64), device_bytes(u))).collect();
    let host_compute_bytes: u64 = input.units.iter().filter(|u| u.host_compute).map(|u| u.compute_bytes).sum();
    let schedule = Schedule::training_step(&ids, true)?;
    let params: u64 = input.units.iter().map(|u| u.numel).sum();
    let model_bytes: u64 = input.units.iter().map(|u| u.compute_bytes).sum();
    let state_bytes = (params as f64 * input.state_bytes_per_param).ceil() as u64;
    let grads_bytes = model_bytes;
    let mut warnings = Vec::new();
    let on_nvme = match input.optimizer_state {
        Some(StatePlacement::Host) => false,
        Some(StatePlacement::Nvme) => true,
        None => input.host_budget_bytes.is_some_and(|b| model_bytes + grads_bytes + state_bytes > b),
    };
    let flops_s = hw.device_gflops * 1e9;
    let units: Vec<SimUnit> = input
        .units
        .iter()
        .zip(&ids)
        .map(|(u, (id, _))| SimUnit {
            id: *id,
            num_bytes: device_bytes(u),
            numel: u.numel,
            grad_bytes: device_bytes(u),
            forward_s: u.forward_flops / flops_s,
            backward_s: hw.backward_flops_ratio * u.forward_flops / flops_s,
            optimizer_on_nvme: on_nvme,
        })
        .collect();
    let mut cfg = SimConfig::new(input.gpu_budget_bytes.min(model_bytes.max(min_working_set(&schedule))));
    cfg.links = hw.links();
    cfg.optimizer_params_per_s = hw.cpu_adam_params_per_s;
    cfg.optimizer_state_bytes_per_param = input.state_bytes_per_param;
    cfg.steps = input.steps.max(1);
    cfg.prefetch = Some(input.prefetch);
    cfg.trace = input.trace;
    if input.gpu_budget_bytes < min_working_set(&schedule) {
        cfg.device_budget_bytes = input.gpu_budget_bytes;
    }
    let sim = simulate_kind(&schedule, &units, &cfg, PolicyKind::NextUse)?;
    // The simulator counts the host copies of units with a device copy; add the others'.
    let host_peak_bytes = sim.peak_bytes.host + host_compute_bytes;
    if let Some(b) = input.host_budget_bytes {
        if host_peak_bytes > b {
            warnings.push(format!(
                "host needs {host_peak_bytes} B at peak but the host budget is {b} B: raise the host budget{}",
                if on_nvme { "" } else { " or put the optimizer state on NVMe" }
            ));
        }
    }
    let lb = &sim.link_bytes;
    let l = hw.links();
    let lower_bound_s = [
        sim.compute_s,
        lb.h2d as f64 / (l.h2d_gbps * 1e9),
        lb.d2h as f64 / (l.d2h_gbps * 1e9),
        lb.nvme_read as f64 / (l.nvme_read_gbps * 1e9),
        lb.nvme_write as f64 / (l.nvme_write_gbps * 1e9),
        params as f64 / hw.cpu_adam_params_per_s,
    ]
    .into_iter()
    .fold(0.0, f64::max);
    Ok(PlanReport {
        units: input.units.len(),
        params,
        model_bytes,
        min_gpu_budget_bytes: min_working_set(&schedule),
        full_gpu_budget_bytes: model_bytes - host_compute_bytes,
        memory: TierNeeds {
            device_bytes: sim.peak_bytes.device,
            host_bytes: host_peak_bytes,
            nvme_bytes: sim.peak_bytes.nvme,
        },
        optimizer_state_on_nvme: on_nvme,
        step_s: sim.step_s,
        compute_s: sim.compute_s,
        exposed_transfer_s: sim.exposed_transfer_s,
        exposed_optimizer_s: sim.exposed_optimizer_s,
        lower_bound_s,
        sim,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(n: usize) -> Vec<ModelUnit> {
        (0..n)
            .map(|i| ModelUnit {
                name: format!("block.{i}"),
                numel: 1 << 20,
                compute_bytes: 2 << 20,
                forward_flops: 2.0 * (1u64 << 20) as f64 * 2048.0,
                host_compute: false,
            })
            .collect()
    }

    #[test]
    fn profile_round_trips_and_refuses_unknown_keys() {
        let p = HardwareProfile::default();
        let back = HardwareProfile::from_toml_str(&p.to_toml_string()).unwrap();
        assert_eq!(p, back);
        let e = HardwareProfile::from_toml_str("h2d_gbs = 3.0").unwrap_err();
        assert!(e.to_string().contains("h2d_gbs"), "{e}");
        let e = HardwareProfile::from_toml_str("h2d_gbps = 0").unwrap_err();
        assert!(e.to_string().contains("h2d_gbps"), "{e}");
        let p = HardwareProfile::from_toml_str("nvme_read_gbps = 7.5").unwrap();
        assert_eq!(p.nvme_read_gbps, 7.5);
        assert_eq!(p.h2d_gbps, 15.0);
        // A profile written before `backward_flops_ratio` existed still parses, with 3.
        assert_eq!(p.backward_flops_ratio, 3.0);
        let e = HardwareProfile::from_toml_str("backward_flops_ratio = -1.0").unwrap_err();
        assert!(e.to_string().contains("backward_flops_ratio"), "{e}");
    }

    #[test]
    fn gpu_figures_are_optional_and_checked() {
        // A profile of before the GPU keys loads with none of them, and the default MFU.
        let old = "h2d_gbps = 25.0\nnvme_read_gbps = 3.1\ncpu_adam_params_per_s = 1.2e9\nsource = \"x\"\n";
        let p = HardwareProfile::from_toml_str(old).unwrap();
        assert!(!p.has_gpu_figures() && p.device_name.is_none() && p.device_memory_bytes.is_none());
        assert_eq!(p.device_mfu, 0.5);
        // Written and read back with them.
        let gpu = HardwareProfile {
            device_name: Some("NVIDIA H100 80GB HBM3".into()),
            device_memory_bytes: Some(85_520_809_984),
            device_bf16_tflops: Some(760.0),
            device_f32_tflops: Some(50.0),
            ..p
        };
        let back = HardwareProfile::from_toml_str(&gpu.to_toml_string()).unwrap();
        assert_eq!(back, gpu);
        for (bad, key) in [
            ("device_bf16_tflops = 0.0", "device_bf16_tflops"),
            ("device_mfu = 1.5", "device_mfu"),
            ("device_memory_bytes = 0", "device_memory_bytes"),
            ("device_bf16_tflop = 3.0", "device_bf16_tflop"),
        ] {
            let e = HardwareProfile::from_toml_str(bad).unwrap_err().to_string();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn a_gpu_run_computes_at_the_dtypes_rate_or_the_datasheets() {
        let sheet = GpuDatasheet::H100_SXM;
        // No GPU figures: the datasheet's rate, memory and link, said so.
        let hw = HardwareProfile::default().for_gpu(2, &sheet);
        assert_eq!(hw.device_gflops, 989.0 * 0.5 * 1000.0);
        assert_eq!((hw.h2d_gbps, hw.d2h_gbps), (64.0 * 0.8, 64.0 * 0.8));
        assert_eq!(hw.device_memory_bytes, Some(80_000_000_000));
        assert!(hw.source.contains("datasheet") && !hw.source.contains("sim device"), "{}", hw.source);
        assert_eq!(HardwareProfile::default().for_gpu(4, &sheet).device_gflops, 67.0 * 0.5 * 1000.0);
        // Measured figures: the dtype's, the profile's links kept.
        let measured = HardwareProfile {
            device_bf16_tflops: Some(700.0),
            device_f32_tflops: Some(40.0),
            h2d_gbps: 50.0,
            device_mfu: 0.4,
            ..HardwareProfile::default()
        };
        let bf16 = measured.for_gpu(2, &sheet);
        assert_eq!((bf16.device_gflops, bf16.h2d_gbps), (700.0 * 0.4 * 1000.0, 50.0));
        assert_eq!(measured.for_gpu(4, &sheet).device_gflops, 40.0 * 0.4 * 1000.0);
        assert!(bf16.source.contains("measured"), "{}", bf16.source);
    }

    fn input(units: Vec<ModelUnit>) -> PlanInput {
        PlanInput {
            units,
            gpu_budget_bytes: 1 << 30,
            host_budget_bytes: None,
            optimizer_state: Some(StatePlacement::Host),
            state_bytes_per_param: 12.0,
            prefetch: PrefetchConfig::default(),
            steps: 3,
            trace: false,
        }
    }

    #[test]
    fn backward_time_follows_the_ratio() {
        let hw = HardwareProfile { device_gflops: 1.0, ..HardwareProfile::default() };
        let fwd: f64 = units(4).iter().map(|u| u.forward_flops).sum::<f64>() / 1e9;
        let r3 = plan(&input(units(4)), &hw).unwrap();
        assert!((r3.compute_s - 4.0 * fwd).abs() < 1e-9 * r3.compute_s, "{}", r3.compute_s);
        let hw5 = HardwareProfile { backward_flops_ratio: 5.0, ..hw };
        let r5 = plan(&input(units(4)), &hw5).unwrap();
        assert!((r5.compute_s - 6.0 * fwd).abs() < 1e-9 * r5.compute_s, "{}", r5.compute_s);
    }

    #[test]
    fn host_compute_units_move_nothing_but_compute_and_update() {
        let mut u = units(4);
        u[1].host_compute = true;
        u[2].host_compute = true;
        let r = plan(&input(u.clone()), &HardwareProfile::default()).unwrap();
        let device: u64 = u.iter().filter(|u| !u.host_compute).map(|u| u.compute_bytes).sum();
        // Each device unit is fetched once and sends its gradients once (everything fits).
        assert_eq!(r.sim.link_bytes.h2d, device);
        assert_eq!(r.sim.link_bytes.d2h, device);
        assert_eq!(r.full_gpu_budget_bytes, device);
        let all = plan(&input(units(4)), &HardwareProfile::default()).unwrap();
        assert!((r.compute_s - all.compute_s).abs() < 1e-12, "the same compute either way");
        assert!(r.memory.host_bytes >= 12 * r.params + r.model_bytes, "host copies of host units counted");
    }

    #[test]
    fn plan_reports_the_minimum_and_a_breakdown() {
        let input = PlanInput {
            units: units(12),
            gpu_budget_bytes: 8 << 20,
            host_budget_bytes: None,
            optimizer_state: None,
            state_bytes_per_param: 12.0,
            prefetch: PrefetchConfig::default(),
            steps: 3,
            trace: false,
        };
        let r = plan(&input, &HardwareProfile::default()).unwrap();
        assert_eq!(r.min_gpu_budget_bytes, 2 << 20);
        assert!(!r.optimizer_state_on_nvme);
        assert!(r.step_s >= r.lower_bound_s * 0.999, "{r:?}");
        let sum = r.compute_s + r.exposed_transfer_s + r.exposed_optimizer_s;
        assert!((sum - r.step_s).abs() < 1e-9 * r.step_s.max(1.0), "{r:?}");
        assert!(r.memory.host_bytes >= 12 * r.params + r.model_bytes);
        let small = PlanInput { gpu_budget_bytes: 1 << 20, ..input.clone() };
        let e = plan(&small, &HardwareProfile::default()).unwrap_err();
        assert!(e.to_string().contains(&format!("{} B", 2 << 20)), "{e}");
        let tight = PlanInput { host_budget_bytes: Some(32 << 20), ..input };
        let r = plan(&tight, &HardwareProfile::default()).unwrap();
        assert!(r.optimizer_state_on_nvme && r.memory.nvme_bytes == 12 * r.params);
    }
}
