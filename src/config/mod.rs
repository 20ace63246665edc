//! The training config: one TOML file per run (`oogc train --config F`).
//!
//! Unknown keys are refused (`deny_unknown_fields`) so a typo never silently falls back to a
//! default. Sizes are human-friendly strings (`"8GiB"`, `"512 MiB"`, or a plain byte count).
//! Relative paths (data, NVMe directories, checkpoint, trace, metrics) are resolved against the
//! directory of the config file, so a run does not depend on the working directory.
//!
//! ```toml
//! [model]
//! d_model = 128
//! n_layer = 4
//! n_head = 4
//!
//! [data]
//! path = "../../shared/data/tinyshakespeare.txt"
//!
//! [train]
//! batch_size = 16
//! seq_len = 128
//! steps = 600
//!
//! [budgets]
//! gpu = "2MiB"
//! ```
//!
//! Every table and key is documented in the book's config reference
//! (`docs/src/reference/config.md`, generated from these doc comments by `oogc config
//! --reference`: [`mod@reference`]); example configs live in `configs/`, and `oogc config --example`
//! prints one with every key.
//!
//! | file | tables |
//! |---|---|
//! | `model.rs` | `[model]`, `[model.moe]` |
//! | `workload.rs` | `[data]`, `[train]`, `[checkpoint]`, `[output]` |
//! | `device.rs` | `[device]`, `[threads]` |
//! | `memory.rs` | `[budgets]`, `[optimizer]`, `[prefetch]`, `[activations]`, `[moe]`, `[ranks]` |
//! | `reference.rs` | the config reference and the example config, generated from these files' doc comments |
//!
//! This file holds [`TrainConfig`] itself: loading, path resolution and validation.

use std::path::{Path, PathBuf};

use oogc_swapper::StatePlacement;
use serde::{Deserialize, Serialize};

mod device;
mod memory;
mod model;
pub mod reference;
mod workload;

pub use device::{DeviceConfig, DeviceKind, OpsPath, ThreadsConfig};
pub use memory::{
    ActivationsConfig, AutoKeyword, BudgetsConfig, DeviceUnits, MoePlacementConfig, MoePolicy, OptimizerSection,
    PrefetchSection, RanksConfig,
};
pub use model::{GptModelConfig, LlamaModelConfig, ModelConfig, MoeModelConfig};
pub use workload::{CheckpointConfig, ComputeDType, DataConfig, OutputConfig, TrainLoopConfig};

/// A config that cannot be used: which key, why, and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The config path as given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML does not parse or does not match the schema (unknown key, wrong type).
    #[error("invalid config {path}: {message}\n  fix: correct the key or value; every key with its type and default: `oogc config --reference`")]
    Parse {
        /// The config path.
        path: PathBuf,
        /// The parser's message; it names the key and the line.
        message: String,
    },
    /// A value is out of range or inconsistent with another.
    #[error("invalid config value `{key}`: {reason}")]
    Invalid {
        /// Dotted key, e.g. `train.seq_len`.
        key: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

/// Result of config loading.
pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// A whole run: model, data, training loop, device, budgets, optimizer, prefetch, threads,
/// checkpoints and outputs.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The GPT's dimensions.
    pub model: ModelConfig,
    /// The training text.
    pub data: DataConfig,
    /// Batch, sequence length, steps, seed, validation cadence.
    pub train: TrainLoopConfig,
    /// Which device computes: the sim device or a CUDA GPU.
    #[serde(default)]
    pub device: DeviceConfig,
    /// Per-tier byte budgets and where optimizer state lives.
    pub budgets: BudgetsConfig,
    /// AdamW hyper-parameters and the learning-rate schedule.
    #[serde(default)]
    pub optimizer: OptimizerSection,
    /// Lookahead prefetch.
    #[serde(default)]
    pub prefetch: PrefetchSection,
    /// Thread counts (this machine has few cores: size every pool explicitly).
    #[serde(default)]
    pub threads: ThreadsConfig,
    /// Checkpoints: where and how often.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Metrics and trace files.
    #[serde(default)]
    pub output: OutputConfig,
    /// Expert placement for an MoE model (`[model.moe]`).
    #[serde(default)]
    pub moe: MoePlacementConfig,
    /// Where the activation checkpoints live between forward and backward.
    #[serde(default)]
    pub activations: ActivationsConfig,
    /// What data-parallel ranks shard (`mpirun -np N oogc train`).
    #[serde(default)]
    pub ranks: RanksConfig,
}

/// The serde default of the keys that default to true (in several tables).
fn default_true() -> bool {
    true
}

impl TrainConfig {
    /// Reads, parses, resolves relative paths against the file's directory (made absolute), and
    /// validates.
    ///
    /// # Errors
    /// [`ConfigError::Read`] when the file cannot be read, [`ConfigError::Parse`] for bad TOML or
    /// an unknown key, [`ConfigError::Invalid`] for a bad value (see [`TrainConfig::validate`]).
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let mut cfg = Self::from_toml_str(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_path_buf(), message },
            other => other,
        })?;
        let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        // Absolute, so that the loaded config means the same files from any working directory
        // (a benchmark writes a copy of it elsewhere and runs it there).
        let base = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
        cfg.resolve_paths(&base);
        Ok(cfg)
    }

    /// Parses and validates TOML text; relative paths stay as written.
    ///
    /// # Errors
    /// As [`TrainConfig::load`], without the read error.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let cfg: Self = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: PathBuf::from("<string>"), message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Makes every relative path absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.data.path);
        if let Some(p) = &mut self.data.tokenizer {
            fix(p);
        }
        if let Some(p) = &mut self.data.cache_dir {
            fix(p);
        }
        self.budgets.nvme_dirs.iter_mut().for_each(fix);
        if let Some(d) = &mut self.checkpoint.dir {
            fix(d);
        }
        if let Some(p) = &mut self.output.metrics {
            fix(p);
        }
        if let Some(p) = &mut self.output.trace {
            fix(p);
        }
        if let Some(p) = &mut self.moe.routing_trace {
            fix(p);
        }
    }

    /// Refuses `train.micro_batches > 1` and `[activations] offload` for a model with MoE blocks
    /// (`moe`): the layer-major schedule and the checkpoint offload are for dense models.
    /// [`TrainConfig::validate`] calls it for MoE-GPT; the trainer again once the model is built
    /// (a Mixtral's experts may come from an init checkpoint).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `train.micro_batches` or `activations.offload`, with the fix.
    pub fn check_moe_support(&self, moe: bool) -> Result<()> {
        if self.activations.offload && moe {
            return Err(ConfigError::Invalid {
                key: "activations.offload".into(),
                reason: format!(
                    "offloading activation checkpoints with MoE blocks ({}) is not supported (an MoE block keeps \
                     its routing beside its checkpoint); set offload = false",
                    self.model.family()
                ),
            });
        }
        let k = self.train.micro_batches;
        if k > 1 && moe {
            return Err(ConfigError::Invalid {
                key: "train.micro_batches".into(),
                reason: format!(
                    "{k} micro-batches with MoE blocks ({}) is not supported (the layer-major schedule is for dense \
                     models); set micro_batches = 1 and raise train.batch_size instead",
                    self.model.family()
                ),
            });
        }
        Ok(())
    }

    /// Checks ranges and consistency; the error names the key and the fix.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`].
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| Err(ConfigError::Invalid { key: key.into(), reason });
        let t = &self.train;
        match &self.model {
            ModelConfig::Gpt(m) => {
                if m.d_model == 0 || m.n_layer == 0 || m.n_head == 0 {
                    return bad("model", "d_model, n_layer and n_head must be ≥ 1".into());
                }
                if m.d_model % m.n_head != 0 {
                    return bad("model.n_head", format!("n_head = {} must divide d_model = {}", m.n_head, m.d_model));
                }
                if m.d_ff == Some(0) {
                    return bad("model.d_ff", "must be ≥ 1 (or left out for 4 × d_model)".into());
                }
                if let Some(max) = m.max_seq_len {
                    if max < t.seq_len {
                        return bad("model.max_seq_len", format!("{max} is below train.seq_len = {}", t.seq_len));
                    }
                }
            }
            ModelConfig::Llama(LlamaModelConfig::Scratch(c)) => {
                // The vocabulary comes from the tokenizer when it is 0: check the rest.
                let c = oogc_models::llama::LlamaConfig { vocab_size: c.vocab_size.max(1), ..(**c).clone() };
                if let Err(e) = c.validate() {
                    return bad("model", e.to_string());
                }
                if c.max_position_embeddings < t.seq_len {
                    return bad(
                        "model.max_position_embeddings",
                        format!("{} is below train.seq_len = {}", c.max_position_embeddings, t.seq_len),
                    );
                }
                if self.data.tokenizer.is_none() {
                    return bad(
                        "data.tokenizer",
                        "a Llama-family model needs a tokenizer.json (the GPT trains on bytes)".into(),
                    );
                }
            }
            ModelConfig::Llama(LlamaModelConfig::Init(_)) => {
                if self.data.tokenizer.is_none() {
                    return bad(
                        "data.tokenizer",
                        "a Llama-family model needs a tokenizer.json: usually the checkpoint's own".into(),
                    );
                }
            }
        }
        if t.batch_size == 0 {
            return bad("train.batch_size", "must be ≥ 1".into());
        }
        if t.seq_len == 0 {
            return bad("train.seq_len", "must be ≥ 1".into());
        }
        if t.micro_batches == 0 {
            return bad("train.micro_batches", "must be ≥ 1 (1 = no gradient accumulation)".into());
        }
        self.check_moe_support(self.model.moe().is_some())?;
        if t.eval_batches == 0 {
            return bad("train.eval_batches", "must be ≥ 1".into());
        }
        if !(self.data.val_fraction > 0.0 && self.data.val_fraction < 1.0) {
            return bad("data.val_fraction", format!("{} must be in (0, 1)", self.data.val_fraction));
        }
        let d = &self.device;
        if !(d.link_gbps >= 0.0 && d.link_gbps.is_finite()) {
            return bad("device.link_gbps", "must be ≥ 0 (0 = unthrottled)".into());
        }
        if !(d.latency_us >= 0.0 && d.latency_us.is_finite()) {
            return bad("device.latency_us", "must be ≥ 0".into());
        }
        let b = &self.budgets;
        if b.gpu.as_u64() == 0 {
            return bad("budgets.gpu", "must be > 0, e.g. \"64MiB\"".into());
        }
        if (b.optimizer_state == StatePlacement::Nvme || b.params == StatePlacement::Nvme) && b.nvme_dirs.is_empty() {
            return bad(
                "budgets.nvme_dirs",
                "optimizer_state = \"nvme\" or params = \"nvme\" needs at least one directory, e.g. \
                 nvme_dirs = [\"/tmp/oogc-nvme\"]"
                    .into(),
            );
        }
        if b.host.as_u64() == 0 {
            return bad("budgets.host", "must be > 0, e.g. \"1GiB\"".into());
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return bad("optimizer.lr", "must be > 0".into());
        }
        if let Some(min) = o.min_lr {
            if !(0.0..=o.lr).contains(&min) {
                return bad("optimizer.min_lr", format!("{min} must be in [0, lr = {}]", o.lr));
            }
        }
        for (i, beta) in o.betas.iter().enumerate() {
            if !(0.0..1.0).contains(beta) {
                return bad("optimizer.betas", format!("betas[{i}] = {beta} must be in [0, 1)"));
            }
        }
        if o.eps.is_nan() || o.eps <= 0.0 {
            return bad("optimizer.eps", "must be > 0".into());
        }
        if o.weight_decay.is_nan() || o.weight_decay < 0.0 {
            return bad("optimizer.weight_decay", "must be ≥ 0".into());
        }
        if o.clip_norm.is_nan() || o.clip_norm < 0.0 {
            return bad("optimizer.clip_norm", "must be ≥ 0 (0 disables clipping)".into());
        }
        if self.threads.optimizer == 0 {
            return bad("threads.optimizer", "must be ≥ 1".into());
        }
        if self.threads.compute == Some(0) {
            return bad("threads.compute", "must be ≥ 1".into());
        }
        let moe = &self.moe;
        if self.device.attention_chunk == Some(0) {
            return bad(
                "device.attention_chunk",
                "0 query positions per attention block: give at least 1, or leave it out for the default".into(),
            );
        }
        if let Some(g) = moe.cpu_gflops {
            if !(g.is_finite() && g > 0.0) {
                return bad("moe.cpu_gflops", format!("{g} must be a finite number of GFLOP/s > 0"));
            }
        }
        if !(0.0..1.0).contains(&moe.popularity_decay) {
            return bad("moe.popularity_decay", format!("{} must be in [0, 1)", moe.popularity_decay));
        }
        if let Some(m) = self.model.moe() {
            if m.experts < 2 {
                return bad("model.moe.experts", format!("{} must be ≥ 2", m.experts));
            }
            if !(1..=2).contains(&m.top_k) || m.top_k > m.experts {
                return bad("model.moe.top_k", format!("{} must be 1 or 2 (and ≤ experts)", m.top_k));
            }
            if self.model.gpt().is_some_and(|g| g.tied_head) {
                return bad(
                    "model.tied_head",
                    "a tied LM head with MoE blocks is not supported; set tied_head = false".into(),
                );
            }
        }
        if self.checkpoint.keep == Some(0) {
            return bad("checkpoint.keep", "must be ≥ 1".into());
        }
        Ok(())
    }

    /// Whether anything (optimizer state or parameters) lives on NVMe.
    pub fn uses_nvme(&self) -> bool {
        self.budgets.optimizer_state == StatePlacement::Nvme || self.budgets.params == StatePlacement::Nvme
    }

    /// The end-of-decay learning rate: `min_lr` or 0.1 × `lr`.
    pub fn min_lr(&self) -> f32 {
        self.optimizer.min_lr.unwrap_or(0.1 * self.optimizer.lr)
    }
}

#[cfg(test)]
mod tests {
    use oogc_optimizer::AdamKind;

    use super::*;

    const MINIMAL: &str = r#"
[model]
d_model = 32
n_layer = 2
n_head = 4
[data]
path = "text.txt"
[train]
batch_size = 2
seq_len = 16
steps = 3
[budgets]
gpu = "1.5MiB"
"#;

    #[test]
    fn minimal_config_gets_defaults_and_parses_sizes() {
        let cfg = TrainConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(cfg.budgets.gpu.as_u64(), 3 << 19);
        assert_eq!(cfg.budgets.host.as_u64(), 4 << 30);
        assert_eq!(cfg.model.gpt().unwrap().d_ff(), 128);
        assert_eq!(cfg.model.gpt().unwrap().max_seq_len(cfg.train.seq_len), 16);
        assert_eq!(cfg.device.kind, DeviceKind::Sim);
        assert_eq!(cfg.prefetch.depth, 2);
        assert!((cfg.min_lr() - 1e-4).abs() < 1e-9);
    }

    #[test]
    fn the_host_budget_keys_parse() {
        let text = MINIMAL.replace(
            "gpu = \"1.5MiB\"",
            "gpu = \"1.5MiB\"\nhost = \"512MiB\"\nparams = \"nvme\"\nnvme_dirs = [\"n\"]\nnvme_size = \"1GiB\"",
        )
            + "[optimizer]\nrollback_budget = \"16MiB\"\nstream_host_budget = \"32MiB\"\n[prefetch]\nhost_depth = 3\n";
        let cfg = TrainConfig::from_toml_str(&text).unwrap();
        assert_eq!(cfg.budgets.params, StatePlacement::Nvme);
        assert_eq!(cfg.budgets.host.as_u64(), 512 << 20);
        assert_eq!(cfg.optimizer.rollback_budget.map(|b| b.as_u64()), Some(16 << 20));
        assert_eq!(cfg.optimizer.stream_host_budget.map(|b| b.as_u64()), Some(32 << 20));
        assert_eq!(cfg.prefetch.host_depth, 3);
        assert!(cfg.uses_nvme());
        let o = crate::train::optimizer_config(&cfg);
        assert_eq!((o.rollback_budget_bytes, o.stream_host_budget_bytes), (Some(16 << 20), 32 << 20));
        let d = TrainConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(
            (d.budgets.params, d.prefetch.host_depth, d.optimizer.rollback_budget),
            (StatePlacement::Host, 4, None)
        );
    }

    #[test]
    fn unknown_key_is_refused_with_its_name() {
        let text = MINIMAL.replace("steps = 3", "steps = 3\nstesp = 4");
        let err = TrainConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(err.contains("stesp"), "{err}");
    }

    #[test]
    fn bad_values_name_the_key() {
        for (from, to, key) in [
            ("n_head = 4", "n_head = 5", "model.n_head"),
            ("gpu = \"1.5MiB\"", "gpu = \"0B\"", "budgets.gpu"),
            ("gpu = \"1.5MiB\"", "gpu = \"1MiB\"\noptimizer_state = \"nvme\"", "budgets.nvme_dirs"),
            ("gpu = \"1.5MiB\"", "gpu = \"1MiB\"\nparams = \"nvme\"", "budgets.nvme_dirs"),
            ("gpu = \"1.5MiB\"", "gpu = \"1MiB\"\nhost = \"0B\"", "budgets.host"),
            ("seq_len = 16", "seq_len = 0", "train.seq_len"),
            ("seq_len = 16", "seq_len = 16\nmicro_batches = 0", "train.micro_batches"),
            ("gpu = \"1.5MiB\"", "gpu = \"1.5MiB\"\n[device]\nattention_chunk = 0", "device.attention_chunk"),
            ("gpu = \"1.5MiB\"", "gpu = \"1.5MiB\"\n[moe]\ncpu_gflops = -1.0", "moe.cpu_gflops"),
        ] {
            let err = TrainConfig::from_toml_str(&MINIMAL.replace(from, to)).unwrap_err();
            assert!(matches!(&err, ConfigError::Invalid { key: k, .. } if k == key), "{to}: {err}");
        }
    }

    #[test]
    fn micro_batches_default_to_one_and_moe_refuses_more_by_name() {
        assert_eq!(TrainConfig::from_toml_str(MINIMAL).unwrap().train.micro_batches, 1);
        let four = MINIMAL.replace("seq_len = 16", "seq_len = 16\nmicro_batches = 4");
        assert_eq!(TrainConfig::from_toml_str(&four).unwrap().train.micro_batches, 4);
        let moe = four.replace("[data]", "[model.moe]\nexperts = 4\ntop_k = 2\n[data]");
        let err = TrainConfig::from_toml_str(&moe).unwrap_err();
        assert!(matches!(&err, ConfigError::Invalid { key, .. } if key == "train.micro_batches"), "{err}");
        assert!(err.to_string().contains("micro_batches = 1"), "{err}");
    }

    #[test]
    fn enums_are_parsed_at_load_time_and_bad_names_are_refused_by_name() {
        let with = |table: &str, line: &str| {
            let text = if MINIMAL.contains(&format!("[{table}]")) {
                MINIMAL.replace(&format!("[{table}]"), &format!("[{table}]\n{line}"))
            } else {
                format!("{MINIMAL}[{table}]\n{line}\n")
            };
            TrainConfig::from_toml_str(&text)
        };
        assert_eq!(with("device", "kind = \"cuda:3\"").unwrap().device.kind, DeviceKind::Cuda(3));
        let local = with("device", "kind = \"cuda\"").unwrap().device.kind;
        assert_eq!((local, local.cuda_ordinal(5)), (DeviceKind::CudaLocalRank, Some(5)));
        assert_eq!(with("optimizer", "kind = \"adam\"").unwrap().optimizer.kind, AdamKind::Adam);
        assert_eq!(with("moe", "policy = \"fetch\"").unwrap().moe.policy, MoePolicy::Fetch);
        assert_eq!(with("moe", "policy = \"lru\"").unwrap().moe.policy, MoePolicy::Lru);
        // "cudaX" used to pass validation and become device 0.
        for (table, line, needle) in [
            ("device", "kind = \"cudaX\"", "cudaX"),
            ("device", "kind = \"cuda:\"", "cuda:N"),
            ("device", "kind = \"gpu\"", "\"cuda:N\" with N the device index"),
            ("optimizer", "kind = \"sgd\"", "sgd"),
            ("moe", "policy = \"lfu\"", "lfu"),
        ] {
            let err = with(table, line).unwrap_err().to_string();
            assert!(err.contains(needle), "{line}: {err}");
        }
        // A kind written back reads the same.
        for kind in ["cuda:1", "cuda"] {
            let cfg = with("device", &format!("kind = \"{kind}\"")).unwrap();
            assert_eq!(TrainConfig::from_toml_str(&toml::to_string(&cfg).unwrap()).unwrap(), cfg);
        }
    }

    #[test]
    fn relative_paths_resolve_against_the_config_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, MINIMAL).unwrap();
        let cfg = TrainConfig::load(&path).unwrap();
        assert_eq!(cfg.data.path, dir.path().join("text.txt"));
        let err = TrainConfig::load(&dir.path().join("missing.toml")).unwrap_err().to_string();
        assert!(err.contains("missing.toml"), "{err}");
        // A config named by a relative path (tests run in the crate's root) still resolves to
        // absolute paths: a copy written elsewhere means the same files.
        let cfg = TrainConfig::load(Path::new("configs/tinyshakespeare.toml")).unwrap();
        assert!(cfg.data.path.is_absolute(), "{:?}", cfg.data.path);
        assert!(cfg.budgets.nvme_dirs.iter().all(|d| d.is_absolute()), "{:?}", cfg.budgets.nvme_dirs);
        assert!(cfg.data.path.ends_with("configs/../../shared/data/tinyshakespeare.txt"), "{:?}", cfg.data.path);
    }
}
