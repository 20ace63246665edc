//! Where the compute runs: `[device]` (the sim device or a CUDA GPU, [`DeviceKind`], the op path,
//! the attention chunk) and `[threads]` (the compute and optimizer pools).

use serde::{Deserialize, Serialize};

use super::default_true;

/// `[device]`: where the forward and backward run.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// `"sim"`, `"cuda:N"` (a binary built with `--features cuda`), or `"cuda"`: the GPU of the
    /// process's local rank (`cuda:{local_rank}` under `mpirun` or `torchrun`, `cuda:0` in one
    /// process) ([`DeviceKind`]). Default: `"sim"`.
    #[serde(default)]
    pub kind: DeviceKind,
    /// Sim device: H2D/D2H link bandwidth in GB/s (10^9 B/s); 0 = unthrottled. Default: 16.
    #[serde(default = "default_link_gbps")]
    pub link_gbps: f64,
    /// Sim device: per-copy latency in microseconds. Default: 0.
    #[serde(default)]
    pub latency_us: f64,
    /// Which op sequence computes the units ([`OpsPath`]): `"auto"` (the fused CPU kernels
    /// where they apply — f32 on the sim device — else the candle compositions) or
    /// `"composed"` (always the candle compositions: the op sequence a CUDA GPU runs, so the
    /// sim device rehearses its numerics, in f32 and bf16). Default: `"auto"`.
    #[serde(default)]
    pub ops: OpsPath,
    /// CUDA: cudarc's per-slice event tracking (an event recorded at every use of a device
    /// buffer, waited for at its next use from another stream). The runtime orders its compute
    /// and copy streams with its own events, so `false` is safe and saves those events; whether
    /// it saves time is measured by `oogc gpu-check` (check 9). Ignored on the sim device.
    /// Default: `true`.
    #[serde(default = "default_true")]
    pub event_tracking: bool,
    /// Query positions per block of the composed attention (`oogc_models::attention`): each
    /// block holds `[batch, heads, attention_chunk, keys]` f32 scores, never the whole
    /// sequence's `[batch, heads, T, T]`, forward and backward. Unset: the largest chunk whose
    /// f32 scores fit 64 MiB (one block when the whole sequence fits). Must be ≥ 1. The fused
    /// CPU kernels (`ops = "auto"` on the sim device in f32) compute the whole sequence.
    #[serde(default)]
    pub attention_chunk: Option<usize>,
}

/// `[device] ops`: the fused CPU kernels or the candle op compositions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OpsPath {
    /// The fused CPU kernels where they apply (f32 on the CPU), else the compositions.
    #[default]
    Auto,
    /// The candle compositions only, on every device and dtype (what CUDA runs).
    Composed,
}

/// `[device] kind`: which device computes, parsed from `"sim"`, `"cuda:N"` or `"cuda"` at load
/// time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceKind {
    /// `"sim"`: host memory with an enforced capacity and throttled copy engines; compute on the
    /// CPU.
    #[default]
    Sim,
    /// `"cuda:N"`: CUDA device `N` (needs a binary built with `--features cuda`).
    Cuda(usize),
    /// `"cuda"`: the CUDA device of this process's local rank (`cuda:{local_rank}` under
    /// `mpirun` or `torchrun`; `cuda:0` in one process).
    CudaLocalRank,
}

impl DeviceKind {
    /// Whether this is the sim device.
    pub fn is_sim(self) -> bool {
        self == DeviceKind::Sim
    }

    /// The CUDA device's ordinal for a process of local rank `local_rank`
    /// ([`crate::dist::World::local_rank`]); `None` for the sim device.
    pub fn cuda_ordinal(self, local_rank: usize) -> Option<usize> {
        match self {
            DeviceKind::Sim => None,
            DeviceKind::Cuda(n) => Some(n),
            DeviceKind::CudaLocalRank => Some(local_rank),
        }
    }
}

impl TryFrom<String> for DeviceKind {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        if s == "sim" {
            return Ok(DeviceKind::Sim);
        }
        if s == "cuda" {
            return Ok(DeviceKind::CudaLocalRank);
        }
        match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => Ok(DeviceKind::Cuda(ordinal)),
            _ => Err(format!(
                "device.kind `{s}`: use \"sim\", \"cuda:N\" with N the device index (e.g. \"cuda:0\"), or \"cuda\" \
                 (the device of the process's local rank)"
            )),
        }
    }
}

impl From<DeviceKind> for String {
    fn from(k: DeviceKind) -> String {
        match k {
            DeviceKind::Sim => "sim".into(),
            DeviceKind::Cuda(n) => format!("cuda:{n}"),
            DeviceKind::CudaLocalRank => "cuda".into(),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from(*self))
    }
}
fn default_link_gbps() -> f64 {
    16.0
}

impl DeviceConfig {
    /// The runtime's device of the process at `world`: the sim device with the link's bandwidth
    /// and latency, or the CUDA device `kind` names (for `"cuda"`, the process's local rank's:
    /// [`DeviceKind::cuda_ordinal`] of [`crate::dist::World::local_rank`]) with `event_tracking`.
    pub fn spec(&self, world: crate::dist::World) -> crate::runtime::DeviceSpec {
        use crate::runtime::DeviceSpec;
        match self.kind.cuda_ordinal(world.local_rank) {
            None => DeviceSpec::Sim { link_gbps: self.link_gbps, latency_us: self.latency_us },
            Some(ordinal) => DeviceSpec::Cuda { ordinal, event_tracking: self.event_tracking },
        }
    }
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            kind: DeviceKind::Sim,
            link_gbps: default_link_gbps(),
            latency_us: 0.0,
            ops: OpsPath::Auto,
            event_tracking: true,
            attention_chunk: None,
        }
    }
}

/// `[threads]`: explicit pool sizes (candle and the optimizer must not oversubscribe).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ThreadsConfig {
    /// Threads of candle's CPU compute (sim device). Default: all cores.
    #[serde(default)]
    pub compute: Option<usize>,
    /// Threads of the CPU optimizer. Default: 1.
    #[serde(default = "default_opt_threads")]
    pub optimizer: usize,
}

fn default_opt_threads() -> usize {
    1
}

impl Default for ThreadsConfig {
    fn default() -> Self {
        Self { compute: None, optimizer: default_opt_threads() }
    }
}
