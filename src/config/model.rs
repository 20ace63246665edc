//! `[model]`: the model family and its shape ([`ModelConfig`]: the byte-level GPT with its
//! `[model.moe]` blocks, or a Llama-family decoder from scratch or from a Hugging Face checkpoint).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The `family` names of the Llama family (`model_type` of a Hugging Face `config.json`).
const LLAMA_FAMILIES: [&str; 8] = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe"];

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
/// family = "llama"         # or "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe"
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
    /// `family = "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen3_moe" | "olmoe" |
    /// "qwen2_moe"`: a Llama-family decoder (the MoE families with sparse MoE layers, trained
    /// through the MoE step and the placer as MoE-GPT).
    Llama(LlamaModelConfig),
}

/// `[model]` of the Llama family: from scratch (`config`) or from a Hugging Face checkpoint
/// (`init`).
#[derive(Debug, Clone, PartialEq)]
pub enum LlamaModelConfig {
    /// The shape, with `config.json`'s keys (every key of [`oogc_models::llama::LlamaConfig`];
    /// `vocab_size` 0 or absent: the tokenizer's).
    Scratch(Box<oogc_models::llama::LlamaConfig>),
    /// `init = "dir"`: a Hugging Face checkpoint directory (`config.json`, `model.safetensors`
    /// or shards + `model.safetensors.index.json`; f32, bf16 or f16) to fine-tune; its config is
    /// the shape (no other `[model]` key then) and its weights the initial parameters, read
    /// memory-mapped, unit by unit, into each unit's home tier.
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
            f if LLAMA_FAMILIES.contains(&f) => match table.remove("init") {
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
                        .map(|c| ModelConfig::Llama(LlamaModelConfig::Scratch(Box::new(c))))
                        .map_err(|e| D::Error::custom(format!("[model] ({family}): {e}")))
                }
            },
            other => Err(D::Error::custom(format!(
                "model.family `{other}`: use \"gpt\" (the byte-level GPT) or \"llama\", \"mistral\", \"qwen2\", \
                 \"qwen3\", \"mixtral\", \"qwen3_moe\", \"olmoe\", \"qwen2_moe\" (the Llama family)"
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
