//! The training config: one TOML file per run (`oogc train --config F`).
//!
//! Every table and key is documented in the README ("Config reference"); example configs live in
//! `configs/`. Unknown keys are refused (`deny_unknown_fields`) so a typo never silently falls back
//! to a default. Sizes are human-friendly strings (`"8GiB"`, `"512 MiB"`, or a plain byte count).
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

use std::path::{Path, PathBuf};

use bytesize::ByteSize;
use oogc_optimizer::AdamKind;
use oogc_swapper::StatePlacement;
use serde::{Deserialize, Serialize};

use crate::data::{DataSource, TextFormat};

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
    #[error("invalid config {path}: {message}\n  (every key is listed in the README's config reference)")]
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

/// `[ranks]`: what data-parallel ranks shard. Without ranks (a world of one) nothing here
/// changes anything.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RanksConfig {
    /// Shard the compute copies too (ZeRO-3, FSDP's `FULL_SHARD`): each rank's host tier, NVMe
    /// files and device hold its `1/N` shard of every unit's parameters; a fetch copies the
    /// shard H2D and all-gathers the unit, which stays gathered for its next use while the GPU
    /// budget allows. `false`: whole compute copies on every rank (ZeRO-2, FSDP's
    /// `SHARD_GRAD_OP`: master weights, Adam state and gradients sharded only). Default: true.
    #[serde(default = "default_true")]
    pub shard_parameters: bool,
}

impl Default for RanksConfig {
    fn default() -> Self {
        Self { shard_parameters: true }
    }
}

/// `[activations]`: the activation checkpoints (each block's input, of every micro-batch).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ActivationsConfig {
    /// Copy each checkpoint D2H into pinned host memory (claimed from `[budgets] host`, category
    /// `activations`) as soon as its block's forward made it, free it on the device, and copy it
    /// back H2D one block ahead of its backward (ZeRO-Offload's and ZeRO-Infinity's activation
    /// checkpoint offload). Same results bit for bit; the GPU holds two checkpoints' staging
    /// instead of all of them. Dense models only. Default: false.
    #[serde(default)]
    pub offload: bool,
}

/// `[moe]`: where the experts of an MoE model live and run.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MoePlacementConfig {
    /// Where the experts go ([`MoePolicy`]). Default: ours.
    #[serde(default)]
    pub policy: MoePolicy,
    /// GPU bytes for hot experts, kept from their forward to their backward. Default: a quarter
    /// of `budgets.gpu`.
    #[serde(default)]
    pub expert_budget: Option<ByteSize>,
    /// Decay of the per-expert moving average of routed tokens, in [0, 1). Default: 0.8.
    #[serde(default = "default_decay")]
    pub popularity_decay: f64,
    /// Compute cold experts on the CPU when the cost model says it is faster than fetching them.
    /// Default: true.
    #[serde(default = "default_true")]
    pub cpu_compute: bool,
    /// JSON-lines routing trace (step, block, expert, tokens) for `oogc bench moe`. Default: none.
    #[serde(default)]
    pub routing_trace: Option<PathBuf>,
    /// With `policy = "ours"`: the hot experts keep their optimizer on the device (master
    /// weights, Adam state and gradients, 16 B per parameter, plus the compute copy, all counted
    /// in `expert_budget`) and are updated there, so they are not uploaded again after each
    /// update; moved in and out only when the hot set changes (with hysteresis). false: the hot
    /// set holds compute copies only (4 B per f32 parameter), refreshed from the CPU optimizer
    /// every step. Unset: on when `expert_budget` holds at least one expert with its optimizer,
    /// else off.
    #[serde(default)]
    pub device_optimizer: Option<bool>,
    /// The CPU's GEMM rate the cost model starts from, GFLOP/s (10⁹ FLOP/s) over the compute
    /// threads (on the sim device, the "GPU"'s too). Unset: measured at start (a small matrix
    /// product times `[threads] compute`), so placements follow the machine and its load; set it
    /// for placements that depend on the routing alone (reproducible runs, tests).
    #[serde(default)]
    pub cpu_gflops: Option<f64>,
}

/// `[moe] policy`: how the experts of an MoE model are placed.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum MoePolicy {
    /// `"ours"`: a popularity hot set kept on the device under `[moe] expert_budget`, cold
    /// experts fetched or computed on the CPU, whichever the cost model says is faster.
    #[default]
    Ours,
    /// `"fetch"`: every routed expert fetched on demand (twice per step: forward and backward).
    Fetch,
    /// `"resident"`: as fetch (none kept, none on the CPU), for in-memory baselines with a GPU
    /// budget that holds every expert.
    Resident,
    /// `"lru"`: an LRU cache of expert copies on the device of `[moe] expert_budget` bytes (as
    /// many whole experts as fit): every routed expert is fetched, used on the device and kept
    /// pinned until the cache evicts the least recently used; a use while cached moves nothing.
    /// The cache is emptied between steps (the optimizer's update makes every copy stale).
    Lru,
}
fn default_decay() -> f64 {
    0.8
}
fn default_true() -> bool {
    true
}

impl Default for MoePlacementConfig {
    fn default() -> Self {
        Self {
            policy: MoePolicy::Ours,
            expert_budget: None,
            popularity_decay: default_decay(),
            cpu_compute: true,
            routing_trace: None,
            device_optimizer: None,
            cpu_gflops: None,
        }
    }
}

/// `[model]`: the model family (`family`, default `"gpt"`) and its shape, or a Hugging Face
/// checkpoint to start from.
///
/// ```toml
/// [model]                  # the byte-level GPT (the default family)
/// d_model = 192
/// n_layer = 8
/// n_head = 6
///
/// [model]                  # a Llama-family decoder from scratch: config.json's keys
/// family = "llama"         # or "mistral", "qwen2"
/// hidden_size = 256
/// intermediate_size = 688
/// num_hidden_layers = 6
/// num_attention_heads = 8
/// num_key_value_heads = 4  # GQA
///
/// [model]                  # fine-tuning a Hugging Face checkpoint: its config.json is the shape
/// family = "llama"
/// init = "path/to/hf_dir"
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// `family = "gpt"` (or none): the byte-level GPT / MoE-GPT of `oogc-models`.
    Gpt(GptModelConfig),
    /// `family = "llama" | "mistral" | "qwen2" | "mixtral"`: a Llama-family decoder (Mixtral:
    /// with sparse MoE layers, trained through the MoE step and the placer as MoE-GPT).
    Llama(LlamaModelConfig),
}

/// `[model]` of the Llama family: from scratch (`config`) or from a Hugging Face checkpoint
/// (`init`).
#[derive(Debug, Clone, PartialEq)]
pub enum LlamaModelConfig {
    /// The shape, with `config.json`'s keys (every key of [`oogc_models::llama::LlamaConfig`];
    /// `vocab_size` 0 or absent: the tokenizer's).
    Scratch(oogc_models::llama::LlamaConfig),
    /// `init = "dir"`: a Hugging Face checkpoint directory (`config.json` + safetensors); its
    /// config is the shape and its weights the initial parameters.
    Init(PathBuf),
}

impl ModelConfig {
    /// The GPT's section, `None` for another family.
    pub fn gpt(&self) -> Option<&GptModelConfig> {
        match self {
            ModelConfig::Gpt(g) => Some(g),
            ModelConfig::Llama(_) => None,
        }
    }

    /// The family's name as in `[model] family`.
    pub fn family(&self) -> &'static str {
        match self {
            ModelConfig::Gpt(_) => "gpt",
            ModelConfig::Llama(LlamaModelConfig::Scratch(c)) => c.family.model_type(),
            ModelConfig::Llama(LlamaModelConfig::Init(_)) => "llama",
        }
    }

    /// MoE feed-forward blocks (`[model.moe]` of the GPT); `None` for dense models.
    pub fn moe(&self) -> Option<&MoeModelConfig> {
        self.gpt().and_then(|g| g.moe.as_ref())
    }
}

impl<'de> Deserialize<'de> for ModelConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::deserialize(d)?;
        let family = match table.get("family") {
            None => "gpt".to_string(),
            Some(toml::Value::String(s)) => s.clone(),
            Some(v) => return Err(D::Error::custom(format!("model.family must be a string, got {v}"))),
        };
        match family.as_str() {
            "gpt" => {
                table.remove("family");
                GptModelConfig::deserialize(toml::Value::Table(table)).map(ModelConfig::Gpt).map_err(D::Error::custom)
            }
            "llama" | "mistral" | "qwen2" | "mixtral" => match table.remove("init") {
                Some(toml::Value::String(dir)) => {
                    if let Some(key) = table.keys().find(|k| *k != "family") {
                        return Err(D::Error::custom(format!(
                            "model.{key}: with model.init the checkpoint's config.json gives the shape; remove \
                             `{key}` (or `init` to train from scratch)"
                        )));
                    }
                    Ok(ModelConfig::Llama(LlamaModelConfig::Init(PathBuf::from(dir))))
                }
                Some(v) => Err(D::Error::custom(format!("model.init must be a directory path, got {v}"))),
                None => {
                    table.entry("vocab_size").or_insert(toml::Value::Integer(0));
                    oogc_models::llama::LlamaConfig::deserialize(toml::Value::Table(table))
                        .map(|c| ModelConfig::Llama(LlamaModelConfig::Scratch(c)))
                        .map_err(|e| D::Error::custom(format!("[model] ({family}): {e}")))
                }
            },
            other => Err(D::Error::custom(format!(
                "model.family `{other}`: use \"gpt\" (the byte-level GPT) or \"llama\", \"mistral\", \"qwen2\", \
                 \"mixtral\" (the Llama family)"
            ))),
        }
    }
}

impl Serialize for ModelConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut table = match self {
            ModelConfig::Gpt(g) => toml::Table::try_from(g).map_err(S::Error::custom)?,
            ModelConfig::Llama(LlamaModelConfig::Scratch(c)) => toml::Table::try_from(c).map_err(S::Error::custom)?,
            ModelConfig::Llama(LlamaModelConfig::Init(dir)) => {
                let mut t = toml::Table::new();
                t.insert("init".into(), toml::Value::String(dir.display().to_string()));
                t
            }
        };
        table.insert("family".into(), toml::Value::String(self.family().into()));
        table.serialize(s)
    }
}

/// `[model]` of the byte-level GPT (vocabulary 256, or the tokenizer's).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GptModelConfig {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; must divide `d_model`.
    pub n_head: usize,
    /// Hidden width of the MLP. Default: 4 × `d_model`.
    #[serde(default)]
    pub d_ff: Option<usize>,
    /// Tie the LM head to the token embedding. Default: false.
    #[serde(default)]
    pub tied_head: bool,
    /// Learned positions available; must be ≥ `train.seq_len`. Default: `train.seq_len`.
    #[serde(default)]
    pub max_seq_len: Option<usize>,
    /// Mixture-of-Experts feed-forward blocks (every block): `experts`, `top_k` (1 or 2),
    /// `aux_loss_coef`, `capacity_factor`, `d_expert`. Default: none (a dense model).
    #[serde(default)]
    pub moe: Option<MoeModelConfig>,
}

/// `[model.moe]`: Mixture-of-Experts feed-forward blocks (Switch Transformer / GShard routing).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MoeModelConfig {
    /// Experts per block (≥ 2); each expert is its own unit.
    pub experts: usize,
    /// Experts per token: 1 (Switch) or 2 (GShard). Default: 2.
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    /// Weight of the load-balancing loss; 0 turns it off. Default: 0.01.
    #[serde(default = "default_aux")]
    pub aux_loss_coef: f64,
    /// Expert capacity factor; tokens beyond `ceil(cf · tokens · top_k / experts)` per expert are
    /// dropped. Default: none (no capacity limit).
    #[serde(default)]
    pub capacity_factor: Option<f64>,
    /// Hidden width of each expert's MLP. Default: the dense MLP's width.
    #[serde(default)]
    pub d_expert: Option<usize>,
}

fn default_top_k() -> usize {
    2
}
fn default_aux() -> f64 {
    0.01
}

impl GptModelConfig {
    /// The MLP width: `d_ff` or 4 × `d_model`.
    pub fn d_ff(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }

    /// The learned positions for sequences of `seq_len` tokens: `max_seq_len` or `seq_len`.
    pub fn max_seq_len(&self, seq_len: usize) -> usize {
        self.max_seq_len.unwrap_or(seq_len)
    }
}

impl MoeModelConfig {
    /// The model's MoE config.
    pub fn to_model(&self) -> oogc_models::MoeConfig {
        oogc_models::MoeConfig {
            experts: self.experts,
            top_k: self.top_k,
            aux_loss_coef: self.aux_loss_coef,
            capacity_factor: self.capacity_factor,
            d_expert: self.d_expert,
        }
    }
}

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
    /// within f32 rounding. Dense models only (an MoE model needs 1). Default: 1; must be ≥ 1.
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

/// `[device]`: where the forward and backward run.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// `"sim"` or `"cuda:N"` ([`DeviceKind`]). Default: `"sim"`.
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

/// `[budgets]`: bytes per tier.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BudgetsConfig {
    /// GPU memory for parameters (compute copies) and gradient staging, e.g. `"2MiB"`.
    pub gpu: ByteSize,
    /// Host memory for everything the run holds there: compute copies (their home or NVMe
    /// cache), optimizer state on the host, speculation's second buffers, NVMe stream buffers,
    /// gradients. A budget below the run's minimum is refused before anything is written, with
    /// the minimum. Default: `"4GiB"`.
    #[serde(default = "default_host_budget")]
    pub host: ByteSize,
    /// Where optimizer state (master weights, m, v) lives: `"host"` or `"nvme"`. Default: host.
    #[serde(default)]
    pub optimizer_state: StatePlacement,
    /// Where the compute copies' home is: `"host"` (pinned host memory) or `"nvme"` (the NVMe
    /// store, with the host budget's share as its cache; ZeRO-Infinity's `offload_param`).
    /// Default: host.
    #[serde(default)]
    pub params: StatePlacement,
    /// NVMe directories (files are striped over them). Needed when `optimizer_state` or
    /// `params` is `"nvme"`.
    #[serde(default)]
    pub nvme_dirs: Vec<PathBuf>,
    /// Bytes preallocated on NVMe in all. Default: what the run holds there (optimizer state,
    /// compute copies with `params = "nvme"`, copy-on-write slack) plus room for speculated
    /// units' second extents; checked against the file systems' free space before the run.
    #[serde(default)]
    pub nvme_size: Option<ByteSize>,
}

fn default_host_budget() -> ByteSize {
    ByteSize::gib(4)
}

/// `[optimizer]`: AdamW (Loshchilov & Hutter 2019) with linear warmup then cosine decay.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// `"adamw"` (decoupled weight decay) or `"adam"` (L2 in the gradient). Default: adamw.
    #[serde(default)]
    pub kind: AdamKind,
    /// Peak learning rate. Default: 1e-3.
    #[serde(default = "default_lr")]
    pub lr: f32,
    /// Learning rate at the end of the cosine decay. Default: 0.1 × `lr`.
    #[serde(default)]
    pub min_lr: Option<f32>,
    /// Steps of linear warmup from 0 to `lr`. Default: 100.
    #[serde(default = "default_warmup")]
    pub warmup_steps: u64,
    /// Adam β1, β2. Default: [0.9, 0.95].
    #[serde(default = "default_betas")]
    pub betas: [f32; 2],
    /// Adam ε. Default: 1e-8.
    #[serde(default = "default_eps")]
    pub eps: f32,
    /// Weight decay. Default: 0.1.
    #[serde(default = "default_wd")]
    pub weight_decay: f32,
    /// Global gradient-norm clip; 0 disables. Default: 1.0.
    #[serde(default = "default_clip")]
    pub clip_norm: f32,
    /// What a non-finite gradient does: `"skip"` the step (every unit keeps its state; the
    /// gradients, or a speculated second copy of each update, are held until the step's last
    /// gradient is in) or `"stop"` the run with an error naming the unit (units updated earlier
    /// in the step keep their update: resume from the last checkpoint). With `"stop"` and
    /// `clip_norm = 0` every unit's update is final as soon as its gradients arrive: host memory
    /// holds a few units' gradients instead of all of them, which a run larger than host memory
    /// needs (`configs/scale-beyond-ram.toml`). Default: skip.
    #[serde(default)]
    pub nonfinite: oogc_optimizer::NonFinite,
    /// Most host bytes for speculation's second buffers (a second compute copy per unit, and a
    /// second p, m, v for host-placed state); units beyond it are updated after the step's
    /// clip decision instead (same results, less overlap). Default: what the host budget has
    /// left.
    #[serde(default)]
    pub rollback_budget: Option<ByteSize>,
    /// Most host bytes for the NVMe stream buffers of optimizer state on NVMe (three chunk
    /// buffers per stream). Default: 128 MiB (the run uses at most one stream per optimizer
    /// thread).
    #[serde(default)]
    pub stream_host_budget: Option<ByteSize>,
    /// Units whose optimizer (fp32 master weights, Adam state, gradients: 16 B per parameter,
    /// plus the compute copy) lives in GPU memory and is updated there: `N` units (refused with
    /// the bytes when they do not fit beyond the minimum working set), or `"auto"`: the spare
    /// GPU budget only, what is left once every unit's compute copy fits (none below that).
    /// Either way the units whose CPU update would be exposed come first: the last units of the
    /// backward (the embedding, then the first blocks, then the head;
    /// [`crate::train::choose_device_units`]). MoE experts follow `[moe] device_optimizer`.
    /// Not with data-parallel ranks. Default: 0.
    #[serde(default)]
    pub device_units: DeviceUnits,
}

/// `[optimizer] device_units`: how many units keep their optimizer on the device.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum DeviceUnits {
    /// That many units (0: none).
    Count(usize),
    /// `"auto"`: as many as the GPU budget's spare room holds.
    Auto(AutoKeyword),
}

/// The keyword `"auto"`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AutoKeyword {
    /// `"auto"`.
    Auto,
}

impl Default for DeviceUnits {
    fn default() -> Self {
        Self::Count(0)
    }
}

fn default_lr() -> f32 {
    1e-3
}
fn default_warmup() -> u64 {
    100
}
fn default_betas() -> [f32; 2] {
    [0.9, 0.95]
}
fn default_eps() -> f32 {
    1e-8
}
fn default_wd() -> f32 {
    0.1
}
fn default_clip() -> f32 {
    1.0
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            kind: AdamKind::AdamW,
            lr: default_lr(),
            min_lr: None,
            warmup_steps: default_warmup(),
            betas: default_betas(),
            eps: default_eps(),
            weight_decay: default_wd(),
            clip_norm: default_clip(),
            nonfinite: oogc_optimizer::NonFinite::Skip,
            rollback_budget: None,
            stream_host_budget: None,
            device_units: DeviceUnits::default(),
        }
    }
}

/// `[prefetch]`: the sliding window of fetches ahead of compute.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefetchSection {
    /// Units fetched ahead of the one in use; 0 = fetch on demand. Default: 2.
    #[serde(default = "default_depth")]
    pub depth: usize,
    /// With `[budgets] params = "nvme"`: units read NVMe → host ahead (the host window, ahead
    /// of the device window). Default: 4.
    #[serde(default = "default_host_depth")]
    pub host_depth: usize,
    /// Run the CPU optimizer on each unit as soon as its gradients land, overlapping compute
    /// (ours). false: hold the gradients and update every unit at the end of the step, waiting
    /// for it (the ZeRO-Infinity-like baseline; same results bit for bit). Default: true.
    #[serde(default = "default_true")]
    pub overlap_optimizer: bool,
}

fn default_depth() -> usize {
    2
}
fn default_host_depth() -> usize {
    4
}

impl Default for PrefetchSection {
    fn default() -> Self {
        Self { depth: default_depth(), host_depth: default_host_depth(), overlap_optimizer: true }
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

/// `[checkpoint]`: safetensors checkpoints, written atomically.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Directory of checkpoints. Default: none (no checkpoints).
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
    /// JSON-lines metrics, one object per step. Default: none.
    #[serde(default)]
    pub metrics: Option<PathBuf>,
    /// Chrome/Perfetto trace of the timeline (open in ui.perfetto.dev). Default: none.
    #[serde(default)]
    pub trace: Option<PathBuf>,
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
                let c = oogc_models::llama::LlamaConfig { vocab_size: c.vocab_size.max(1), ..c.clone() };
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
