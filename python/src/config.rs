//! The Python `Runtime`'s config: a dict (through JSON) or a TOML file, deserialized with serde
//! into [`Config`] and turned into the library's [`RuntimeConfig`].
//!
//! The tables are the `oogc train` config's where they mean the same (`device`, `budgets`,
//! `prefetch`, with the same keys and defaults); `optimizer` has no learning rate (it is given
//! per step to `begin_step`) and carries the optimizer's thread count. `compute_dtype` is
//! `oogc train`'s `[train] compute_dtype` (same values, same default), at the top level: the
//! Python config has no `[train]` table, the training loop being the caller's.
//!
//! | key | type | default |
//! |---|---|---|
//! | `device.kind` | `"sim"` or `"cuda:N"` | `"sim"` |
//! | `device.link_gbps` | sim H2D/D2H GB/s (10⁹ B/s), 0 = unthrottled | 16 |
//! | `device.latency_us` | sim per-copy latency, µs | 0 |
//! | `device.event_tracking` | CUDA: cudarc's per-slice event tracking (the runtime orders its streams itself) | true |
//! | `budgets.gpu` | bytes or a size string (`"64 MiB"`) | required |
//! | `budgets.host` | bytes or a size string | `"4 GiB"` |
//! | `budgets.optimizer_state` | `"host"` or `"nvme"`: where master weights and Adam state live | `"host"` |
//! | `budgets.params` | `"host"` or `"nvme"`: the compute copies' home | `"host"` |
//! | `budgets.nvme_dirs` | directories (relative to a TOML file's directory); with ranks, `{rank}`/`{local_rank}` expanded, else a `rank{r}` subdirectory each | `[]` |
//! | `budgets.nvme_size` | bytes preallocated on NVMe | required with `"nvme"` |
//! | `optimizer.kind` | `"adamw"` or `"adam"` | `"adamw"` |
//! | `optimizer.betas` | `[β1, β2]` | `[0.9, 0.95]` |
//! | `optimizer.eps` | ε | 1e-8 |
//! | `optimizer.weight_decay` | decoupled (AdamW) or L2 (Adam) | 0.1 |
//! | `optimizer.clip_norm` | global gradient-norm clip, 0 = off | 1.0 |
//! | `optimizer.threads` | CPU optimizer threads | 1 |
//! | `prefetch.depth` | units fetched ahead, 0 = on demand | 2 |
//! | `prefetch.host_depth` | units read NVMe → host ahead (`params = "nvme"`) | 4 |
//! | `prefetch.overlap_optimizer` | update units during the backward | true |
//! | `lock_host_memory` | `mlock` the pinned host pool | false |
//! | `compute_dtype` | `"f32"`, `"bf16"` or `"f16"` (or torch's names `"float32"`, `"bfloat16"`, `"float16"`): the compute copies' and gradients' element type | `"f32"`, or the caller's default ([`Config::runtime_config`]) |
//!
//! `device.ops` (`oogc train`'s choice of op sequence) is accepted as `"auto"` only: torch
//! computes the units here.

use std::path::Path;

use oogc::config::{BudgetsConfig, DeviceConfig, OpsPath, PrefetchSection};
use oogc::dist::World;
use oogc::optimizer::{AdamConfig, AdamKind, OptimizerConfig};
use oogc::runtime::RuntimeConfig;
use oogc::swapper::{DType, NvmeConfig, StatePlacement};
use serde::Deserialize;

use crate::error::{Error, Result};

/// The whole config (see the module docs for the keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `device`: which device computes; the sim device's link.
    #[serde(default)]
    pub device: DeviceConfig,
    /// `budgets`: bytes per tier, where optimizer state lives.
    pub budgets: BudgetsConfig,
    /// `optimizer`: the CPU AdamW's hyper-parameters except the learning rate.
    #[serde(default)]
    pub optimizer: OptimizerSettings,
    /// `prefetch`: the window of fetches ahead, overlap of the optimizer.
    #[serde(default)]
    pub prefetch: PrefetchSection,
    /// Page-lock the pinned host pool (falls back with a warning when RLIMIT_MEMLOCK is low).
    #[serde(default)]
    pub lock_host_memory: bool,
    /// The compute copies' and gradients' element type (`oogc train`'s `[train]
    /// compute_dtype`); `None` when the config does not say.
    #[serde(default)]
    pub compute_dtype: Option<ComputeDType>,
}

/// `compute_dtype`: the element type of the units' compute copies in every tier and of the
/// gradients on every link; the master weights and Adam state stay fp32 with the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ComputeDType {
    /// fp32 everywhere.
    #[serde(rename = "f32", alias = "float32")]
    F32,
    /// bf16 compute copies and gradients over fp32 master weights (mixed precision).
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
    /// IEEE half compute copies and gradients over fp32 master weights (no loss scaling: small
    /// gradients underflow; bf16 is the mixed precision to use).
    #[serde(rename = "f16", alias = "float16")]
    F16,
}

impl ComputeDType {
    /// The runtime's element type.
    pub fn dtype(self) -> DType {
        match self {
            ComputeDType::F32 => DType::F32,
            ComputeDType::Bf16 => DType::BF16,
            ComputeDType::F16 => DType::F16,
        }
    }

    /// From a name as the config spells it (`"bf16"`, `"bfloat16"`, ...).
    ///
    /// # Errors
    /// [`Error::Config`] for another name.
    pub fn parse(name: &str) -> Result<Self> {
        serde_json::from_value(serde_json::Value::String(name.to_string())).map_err(|_| {
            Error::Config(format!("compute_dtype: {name:?} is not a compute dtype: use \"f32\", \"bf16\" or \"f16\""))
        })
    }
}

/// `optimizer`: AdamW (Loshchilov & Hutter 2019) or Adam with L2; f64 as torch's floats, so the
/// kernel's constants match `torch.optim.AdamW` for the same Python values.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSettings {
    /// `"adamw"` (decoupled weight decay) or `"adam"` (L2 in the gradient).
    pub kind: AdamKind,
    /// β1, β2.
    pub betas: [f64; 2],
    /// ε.
    pub eps: f64,
    /// Weight decay coefficient.
    pub weight_decay: f64,
    /// Global gradient-norm clip (torch's `clip_grad_norm_`); 0 disables.
    pub clip_norm: f32,
    /// Threads of the CPU optimizer.
    pub threads: usize,
}

impl Default for OptimizerSettings {
    fn default() -> Self {
        Self { kind: AdamKind::AdamW, betas: [0.9, 0.95], eps: 1e-8, weight_decay: 0.1, clip_norm: 1.0, threads: 1 }
    }
}

impl Config {
    /// Parses a config given as JSON text (a Python dict through `json.dumps`); errors name the
    /// key path (`budgets.gpu: ...`).
    ///
    /// # Errors
    /// [`Error::Config`] for a missing, unknown or mistyped key.
    pub fn from_json(text: &str) -> Result<Self> {
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let key = if path == "." { "config".to_string() } else { path };
            Error::Config(format!("{key}: {}", e.inner()))
        })
    }

    /// Reads a TOML file; relative `budgets.nvme_dirs` are relative to the file's directory.
    ///
    /// # Errors
    /// [`Error::Config`] for an unreadable file or a bad key (with the TOML parser's position).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read the config file {}: {e}", path.display())))?;
        let mut config: Self =
            toml::from_str(&text).map_err(|e| Error::Config(format!("config file {}: {e}", path.display())))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for dir in &mut config.budgets.nvme_dirs {
            if dir.is_relative() {
                *dir = base.join(&*dir);
            }
        }
        Ok(config)
    }

    /// The library's runtime config for the process at `world` (its device and NVMe
    /// directories); `default_dtype` is the compute dtype when the config has no `compute_dtype`
    /// (`None`: f32, as `oogc train`).
    ///
    /// # Errors
    /// [`Error::Config`] when optimizer state on NVMe lacks `nvme_dirs` or `nvme_size`, a count
    /// is zero, or `device.ops` is not `"auto"`.
    pub fn runtime_config(&self, default_dtype: Option<ComputeDType>, world: World) -> Result<RuntimeConfig> {
        if self.device.ops != OpsPath::Auto {
            return Err(Error::Config(
                "device.ops: torch computes the units of a Python runtime; only \"auto\" applies here".into(),
            ));
        }
        let device = self.device.spec(world);
        let on_nvme =
            self.budgets.optimizer_state == StatePlacement::Nvme || self.budgets.params == StatePlacement::Nvme;
        let nvme = match on_nvme {
            false => None,
            true => {
                if self.budgets.nvme_dirs.is_empty() {
                    return Err(Error::Config(
                        "budgets.nvme_dirs: optimizer_state or params = \"nvme\" needs at least one directory".into(),
                    ));
                }
                // Units are added after the runtime is made, so the store cannot be sized from
                // them as `oogc train` does: the size is given.
                let Some(size) = self.budgets.nvme_size else {
                    return Err(Error::Config(
                        "budgets.nvme_size: needed with optimizer_state or params = \"nvme\" (the state takes 12 \
                         bytes per parameter, parameters 4 in f32 or 2 in bf16; allow about 3x that, e.g. \"1 GiB\" \
                         for 25M parameters)"
                            .into(),
                    ));
                };
                // With ranks (`oogc.torch.offload(..., process_group=...)`), each its own
                // directories: `{rank}`/`{local_rank}` expanded, else a `rank{r}` subdirectory.
                // The `rank{r}` subdirectory is made when the listed directory exists.
                let mut dirs = Vec::new();
                for dir in &self.budgets.nvme_dirs {
                    let mine = world.rank_dir(dir);
                    if world.size > 1 && dir.is_dir() && !mine.exists() {
                        std::fs::create_dir_all(&mine).map_err(|e| {
                            Error::Config(format!(
                                "budgets.nvme_dirs: cannot make rank {}'s directory {}: {e}",
                                world.rank,
                                mine.display()
                            ))
                        })?;
                    }
                    dirs.push(mine);
                }
                Some(NvmeConfig::new(dirs, size.as_u64()))
            }
        };
        let o = &self.optimizer;
        if o.threads == 0 {
            return Err(Error::Config("optimizer.threads: must be at least 1".into()));
        }
        let optimizer = OptimizerConfig {
            threads: o.threads,
            adam: AdamConfig {
                kind: o.kind,
                beta1: o.betas[0],
                beta2: o.betas[1],
                eps: o.eps,
                weight_decay: o.weight_decay,
            },
            clip_norm: (o.clip_norm > 0.0).then_some(o.clip_norm),
            compute_dtype: self.compute_dtype.or(default_dtype).unwrap_or(ComputeDType::F32).dtype(),
            ..OptimizerConfig::default()
        };
        Ok(RuntimeConfig {
            device,
            gpu_budget_bytes: self.budgets.gpu.as_u64(),
            host_budget_bytes: self.budgets.host.as_u64(),
            state_placement: self.budgets.optimizer_state,
            params_placement: self.budgets.params,
            nvme,
            prefetch_depth: self.prefetch.depth,
            host_prefetch_depth: self.prefetch.host_depth,
            optimizer,
            lock_host_memory: self.lock_host_memory,
            overlap_optimizer: self.prefetch.overlap_optimizer,
            activation_offload: None,
            // The module hands units to torch as pinned device memory (DLPack): whole copies.
            shard_parameters: false,
            checkpoint_staging: false,
        })
    }
}
