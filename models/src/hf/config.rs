//! `config.json` of a Hugging Face Llama-family checkpoint ↔ [`LlamaConfig`].
//!
//! Read: transformers 4 (`rope_theta` and `rope_scaling` at the top level — most Hub
//! checkpoints) and transformers 5 (`rope_parameters` with `rope_theta`, `rope_type`, ...) both
//! parse; defaults are those of transformers' `LlamaConfig`, `MistralConfig`, `Qwen2Config`,
//! `Qwen3Config`, `MixtralConfig`, `Qwen3MoeConfig`, `OlmoeConfig`, `Qwen2MoeConfig` where
//! a key is absent or `null`; the five size keys are required. Options this crate does not
//! implement are refused by name (sliding-window attention, RoPE types other than `default`,
//! `linear` and `llama3`, partial rotary, activations other than SiLU, attention dropout,
//! quantized weights, other model types), never computed wrongly. Unknown keys are ignored (Hub
//! configs carry many), and can be carried into an exported `config.json` ([`passthrough_keys`]).
//!
//! Write ([`config_json`]): the transformers-4 layout, which transformers 4 and 5 both load.

use std::path::Path;

use serde_json::{Map, Value};

use crate::llama::{LlamaConfig, LlamaFamily, RopeScaling};
use crate::{Error, Result};

/// Keys this module reads or writes; everything else in a `config.json` is passed through by
/// [`passthrough_keys`] (except `transformers_version`).
const MODEL_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "quantization_config",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_jitter_noise",
    "num_experts",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
    "qkv_bias",
    "clip_qkv",
];

/// Reads and parses `path` (a `config.json`) with [`parse_config`].
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; as [`parse_config`].
pub fn read_config(path: &Path) -> Result<LlamaConfig> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    parse_config(&text, path)
}

/// Parses the text of a Hugging Face `config.json` into a validated, resolved [`LlamaConfig`]
/// (every default written out, see [`LlamaConfig::resolved`]). `path` only names the file in
/// errors.
///
/// Accepted: `model_type` (or, without it, `architectures[0]`) `llama`/`LlamaForCausalLM`,
/// `mistral`/`MistralForCausalLM`, `qwen2`/`Qwen2ForCausalLM`, `mixtral`/`MixtralForCausalLM`,
/// `qwen3`/`Qwen3ForCausalLM`, `qwen3_moe`/`Qwen3MoeForCausalLM`, `olmoe`/`OlmoeForCausalLM`,
/// `qwen2_moe`/`Qwen2MoeForCausalLM` (the expert count as `num_experts` or
/// `num_local_experts`); RoPE as transformers 4 or 5
/// writes it, `rope_type` (or the older `type`) `default`, `linear` or `llama3`.
///
/// # Errors
/// [`Error::HfConfig`] naming the key and the fix: invalid JSON (key `<json>`), a missing size
/// key, a value of the wrong type, an unsupported `model_type`/`architectures`, `hidden_act`
/// other than `silu`, sliding-window attention (Mistral's `sliding_window` — absent means
/// transformers' default 4096 —, Qwen2's `use_sliding_window: true`, a `layer_types` entry other
/// than `full_attention`), an unsupported `rope_type`, `partial_rotary_factor` ≠ 1, a non-zero
/// `attention_dropout`, a `quantization_config`, both `rope_scaling` and `rope_parameters`; MoE
/// options no family here computes (`router_bias`, `scoring_func` other than softmax,
/// `n_group`/`topk_group` > 1, `kv_lora_rank`/`q_lora_rank`, OLMoE's `clip_qkv`, OLMoE's
/// `decoder_sparse_step` ≠ 1 or non-empty `mlp_only_layers` (Qwen3-MoE and Qwen2-MoE take
/// both: their dense layers among the sparse ones), `num_experts` ≠ `num_local_experts`); or a
/// config that fails [`LlamaConfig::validate`] (the key it names).
pub fn parse_config(text: &str, path: &Path) -> Result<LlamaConfig> {
    let value: Value = serde_json::from_str(text).map_err(|e| Error::HfConfig {
        path: path.to_path_buf(),
        key: "<json>".into(),
        reason: format!("not valid JSON: {e}"),
    })?;
    let Value::Object(map) = &value else {
        return Err(Error::HfConfig {
            path: path.to_path_buf(),
            key: "<json>".into(),
            reason: "not a JSON object".into(),
        });
    };
    parse_map(map, path)
}

/// The keys of a `config.json` that [`parse_config`] does not interpret (token ids, `use_cache`,
/// ...), to carry into an exported `config.json` ([`config_json`]'s `extra`).
pub fn passthrough_keys(map: &Map<String, Value>) -> Map<String, Value> {
    map.iter().filter(|(k, _)| !MODEL_KEYS.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// The `config.json` of `config` in transformers 4's layout (`rope_theta` and `rope_scaling` at
/// the top level, which transformers 5 reads as well), with `dtype` = `torch_dtype`
/// (`"float32"` or `"bfloat16"`: the dtype of the weights written beside it; the key older
/// transformers called `torch_dtype`), and each key of
/// `extra` that is not a model key ([`passthrough_keys`]) added.
pub fn config_json(config: &LlamaConfig, torch_dtype: &str, extra: &Map<String, Value>) -> Value {
    let c = config.resolved();
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("architectures", Value::from(vec![c.family.architecture()]));
    put("model_type", c.family.model_type().into());
    put("vocab_size", c.vocab_size.into());
    put("hidden_size", c.hidden_size.into());
    put("intermediate_size", c.intermediate_size.into());
    put("num_hidden_layers", c.num_hidden_layers.into());
    put("num_attention_heads", c.num_attention_heads.into());
    put("num_key_value_heads", c.kv_heads().into());
    put("head_dim", c.head_dim().into());
    put("hidden_act", "silu".into());
    put("max_position_embeddings", c.max_position_embeddings.into());
    put("initializer_range", c.initializer_range.into());
    put("rms_norm_eps", c.rms_norm_eps.into());
    put("rope_theta", c.rope_theta.into());
    put(
        "rope_scaling",
        match c.rope_scaling {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => serde_json::json!({ "rope_type": "linear", "factor": factor }),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                serde_json::json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                })
            }
        },
    );
    put("tie_word_embeddings", c.tie_word_embeddings.into());
    put("attention_dropout", 0.0.into());
    match c.family {
        LlamaFamily::Llama => {
            put("attention_bias", c.qkv_bias().into());
            put("mlp_bias", c.mlp_bias.into());
        }
        LlamaFamily::Mistral => put("sliding_window", Value::Null),
        LlamaFamily::Mixtral => {
            put("sliding_window", Value::Null);
            put("num_local_experts", c.num_experts().into());
            put("num_experts_per_tok", c.top_k().into());
            put("router_aux_loss_coef", c.router_aux_loss_coef.unwrap_or(0.001).into());
            put("output_router_logits", c.output_router_logits.unwrap_or(false).into());
            put("router_jitter_noise", 0.0.into());
        }
        LlamaFamily::Qwen2 => {
            put("use_sliding_window", false.into());
            put("sliding_window", Value::Null);
            put("max_window_layers", c.num_hidden_layers.into());
        }
        LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe => {
            put("attention_bias", c.qkv_bias().into());
            put("use_sliding_window", false.into());
            put("sliding_window", Value::Null);
            put("max_window_layers", c.num_hidden_layers.into());
        }
        LlamaFamily::Olmoe => {
            put("attention_bias", c.qkv_bias().into());
            put("clip_qkv", Value::Null);
        }
        LlamaFamily::Qwen2Moe => {
            put("qkv_bias", c.qkv_bias().into());
            put("use_sliding_window", false.into());
            put("sliding_window", Value::Null);
            put("max_window_layers", c.num_hidden_layers.into());
            put("shared_expert_intermediate_size", c.shared_expert_width().unwrap_or(0).into());
        }
    }
    if c.is_moe() && c.family != LlamaFamily::Mixtral {
        // `num_experts`, as Hub checkpoints (transformers 4) write it; transformers 5 reads it too.
        put("num_experts", c.num_experts().into());
        put("num_experts_per_tok", c.top_k().into());
        put("router_aux_loss_coef", c.router_aux_loss_coef.unwrap_or(0.001).into());
        put("output_router_logits", c.output_router_logits.unwrap_or(false).into());
        put("norm_topk_prob", c.norm_topk_prob().into());
        if c.family != LlamaFamily::Olmoe {
            put("moe_intermediate_size", c.expert_intermediate_size().into());
            put("decoder_sparse_step", c.decoder_sparse_step.unwrap_or(1).into());
            put("mlp_only_layers", c.mlp_only_layers.clone().unwrap_or_default().into());
        }
    }
    // transformers ≥ 4.56 and 5 name it `dtype` (and warn on the older `torch_dtype`).
    put("dtype", torch_dtype.into());
    for (k, v) in passthrough_keys(extra) {
        m.entry(k).or_insert(v);
    }
    Value::Object(m)
}

/// Reads typed keys of one JSON object, errors naming `prefix.key` and the file.
struct Keys<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
    prefix: &'a str,
}

impl<'a> Keys<'a> {
    fn name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    fn err(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::HfConfig { path: self.path.to_path_buf(), key: self.name(key), reason: reason.into() }
    }

    /// The value of `key`; `null` counts as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.err(key, format!("must be a non-negative integer, got {v}")))
            })
            .transpose()
    }

    fn required_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| self.err(key, "is missing (every Llama-family config.json has it)"))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| self.err(key, format!("must be a number, got {v}")))).transpose()
    }

    fn required_f64(&self, key: &str, why: &str) -> Result<f64> {
        self.f64(key)?.ok_or_else(|| self.err(key, format!("is missing ({why})")))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.err(key, format!("must be true or false, got {v}"))))
            .transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| self.err(key, format!("must be a string, got {v}")))).transpose()
    }

    fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>> {
        self.get(key)
            .map(|v| v.as_object().ok_or_else(|| self.err(key, format!("must be an object or null, got {v}"))))
            .transpose()
    }
}

const SUPPORTED: &str = "supported: llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), \
                         mixtral (MixtralForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), \
                         olmoe (OlmoeForCausalLM), qwen2_moe (Qwen2MoeForCausalLM)";

/// Every family `config.json` may name.
const FAMILIES: [LlamaFamily; 8] = [
    LlamaFamily::Llama,
    LlamaFamily::Mistral,
    LlamaFamily::Qwen2,
    LlamaFamily::Mixtral,
    LlamaFamily::Qwen3,
    LlamaFamily::Qwen3Moe,
    LlamaFamily::Olmoe,
    LlamaFamily::Qwen2Moe,
];

fn family_of_model_type(t: &str) -> Option<LlamaFamily> {
    FAMILIES.into_iter().find(|f| f.model_type() == t)
}

fn family_of_architecture(a: &str) -> Option<LlamaFamily> {
    FAMILIES.into_iter().find(|f| f.architecture() == a)
}

/// A `sliding_window` that is not null: refused (full causal attention only).
fn sliding_window_err(k: &Keys<'_>, v: &Value) -> Error {
    k.err(
        "sliding_window",
        format!(
            "{v}: sliding-window attention is not supported; set it to null for full causal attention (identical for \
             sequences no longer than the window)"
        ),
    )
}

fn parse_map(map: &Map<String, Value>, path: &Path) -> Result<LlamaConfig> {
    let k = Keys { map, path, prefix: "" };

    // Which model.
    let architectures: Vec<&str> = match k.get("architectures") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().ok_or_else(|| k.err("architectures", format!("must be a list of strings, got {v}"))))
            .collect::<Result<_>>()?,
        Some(v) => return Err(k.err("architectures", format!("must be a list of strings, got {v}"))),
    };
    let family = match k.str("model_type")? {
        Some(t) => family_of_model_type(t).ok_or_else(|| {
            let hint = if t.contains("moe") || t.contains("deepseek") {
                " (of the mixture-of-experts models Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE are implemented)"
            } else {
                ""
            };
            k.err("model_type", format!("`{t}` is not supported{hint}; {SUPPORTED}"))
        })?,
        None => match architectures.first() {
            Some(a) => family_of_architecture(a).ok_or_else(|| {
                k.err("architectures", format!("`{a}` is not supported (and `model_type` is absent); {SUPPORTED}"))
            })?,
            None => return Err(k.err("model_type", format!("is missing (and so is `architectures`); {SUPPORTED}"))),
        },
    };
    for a in &architectures {
        if *a != family.architecture() {
            return Err(k.err(
                "architectures",
                format!(
                    "`{a}` is not supported for model_type `{}`: only `{}` (a causal LM with its `model.` tensors \
                     and `lm_head`)",
                    family.model_type(),
                    family.architecture()
                ),
            ));
        }
    }

    // Options that are refused.
    if let Some(act) = k.str("hidden_act")? {
        if act != "silu" && act != "swish" {
            return Err(k.err("hidden_act", format!("`{act}` is not supported: the MLP is SwiGLU, set `silu`")));
        }
    }
    if let Some(p) = k.f64("attention_dropout")? {
        if p != 0.0 {
            return Err(
                k.err("attention_dropout", format!("{p} is not supported (no dropout is implemented): set it to 0.0"))
            );
        }
    }
    if k.get("quantization_config").is_some() {
        return Err(k.err(
            "quantization_config",
            "quantized checkpoints are not supported: use a float32, bfloat16 or float16 checkpoint",
        ));
    }
    match family {
        LlamaFamily::Mistral => {
            // transformers' MistralConfig defaults `sliding_window` to 4096 when absent.
            match k.map.get("sliding_window") {
                Some(Value::Null) => {}
                None => {
                    return Err(k.err(
                        "sliding_window",
                        "is absent, which transformers reads as 4096 (sliding-window attention, not supported): \
                         set it to null for full causal attention, identical for sequences up to the window",
                    ))
                }
                Some(v) => return Err(sliding_window_err(&k, v)),
            }
        }
        LlamaFamily::Qwen2 | LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe | LlamaFamily::Qwen2Moe => {
            if k.bool("use_sliding_window")? == Some(true) {
                return Err(k.err(
                    "use_sliding_window",
                    "true: sliding-window attention is not supported; set it to false for full causal attention \
                     (identical for sequences no longer than `sliding_window`)",
                ));
            }
        }
        LlamaFamily::Mixtral => {
            // transformers' MixtralConfig defaults `sliding_window` to None.
            match k.map.get("sliding_window") {
                None | Some(Value::Null) => {}
                Some(v) => return Err(sliding_window_err(&k, v)),
            }
            if let Some(j) = k.f64("router_jitter_noise")? {
                if j != 0.0 {
                    return Err(k.err(
                        "router_jitter_noise",
                        format!("{j} is not supported (the router's training-time noise is not implemented): set 0.0"),
                    ));
                }
            }
        }
        LlamaFamily::Llama => {}
        LlamaFamily::Olmoe => {
            if let Some(c) = k.get("clip_qkv") {
                return Err(k.err(
                    "clip_qkv",
                    format!("{c}: clamping q, k and v is not supported; set it to null (OLMoE's default)"),
                ));
            }
        }
    }
    refuse_moe_options(&k)?;
    if let Some(types) = k.get("layer_types") {
        let Value::Array(types) = types else {
            return Err(k.err("layer_types", format!("must be a list of strings, got {types}")));
        };
        if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| t.as_str() != Some("full_attention")) {
            return Err(k.err(
                "layer_types",
                format!(
                    "layer {i} is {t}: only `full_attention` is supported (sliding-window attention is not \
                     implemented); set every entry to \"full_attention\""
                ),
            ));
        }
    }
    if let Some(f) = k.f64("partial_rotary_factor")? {
        if f != 1.0 {
            return Err(k.err("partial_rotary_factor", format!("{f}: only full rotary embeddings (1.0) are supported")));
        }
    }

    // Sizes and the rest.
    let num_attention_heads = k.required_usize("num_attention_heads")?;
    let (theta_default, max_pos_default) = match family {
        LlamaFamily::Llama => (10000.0, 2048),
        LlamaFamily::Mistral => (10000.0, 4096 * 32),
        LlamaFamily::Qwen2 | LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe | LlamaFamily::Qwen2Moe => (10000.0, 32768),
        LlamaFamily::Olmoe => (10000.0, 4096),
        LlamaFamily::Mixtral => (1e6, 4096 * 32),
    };
    let (rope_theta, rope_scaling) = parse_rope(&k, theta_default)?;
    let attention_bias = match family {
        LlamaFamily::Llama | LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe | LlamaFamily::Olmoe => {
            Some(k.bool("attention_bias")?.unwrap_or(false))
        }
        // transformers' Mistral has no biases and Qwen2's q/k/v always have one, whatever the key.
        LlamaFamily::Mistral | LlamaFamily::Mixtral => Some(false),
        LlamaFamily::Qwen2 => Some(true),
        // transformers 5's Qwen2-MoE reads `qkv_bias` (default true; transformers 4: always).
        LlamaFamily::Qwen2Moe => Some(k.bool("qkv_bias")?.unwrap_or(true)),
    };
    let mlp_bias = match family {
        LlamaFamily::Llama => k.bool("mlp_bias")?.unwrap_or(false),
        _ => false,
    };
    let config = LlamaConfig {
        family,
        vocab_size: k.required_usize("vocab_size")?,
        hidden_size: k.required_usize("hidden_size")?,
        intermediate_size: k.required_usize("intermediate_size")?,
        num_hidden_layers: k.required_usize("num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads: k.usize("num_key_value_heads")?,
        head_dim: k.usize("head_dim")?,
        rms_norm_eps: k.f64("rms_norm_eps")?.unwrap_or(1e-6),
        max_position_embeddings: k.usize("max_position_embeddings")?.unwrap_or(max_pos_default),
        rope_theta,
        rope_scaling,
        tie_word_embeddings: k.bool("tie_word_embeddings")?.unwrap_or(false),
        attention_bias,
        mlp_bias,
        initializer_range: k.f64("initializer_range")?.unwrap_or(0.02),
        num_local_experts: None,
        num_experts_per_tok: None,
        router_aux_loss_coef: None,
        output_router_logits: None,
        moe_intermediate_size: None,
        norm_topk_prob: None,
        shared_expert_intermediate_size: None,
        decoder_sparse_step: None,
        mlp_only_layers: None,
    };
    let config = if config.is_moe() { parse_moe(&k, config)? } else { config };
    config.validate().map_err(|e| match e {
        Error::Config { field, reason } => {
            let key = field.strip_prefix("model.").unwrap_or(field);
            Error::HfConfig { path: path.to_path_buf(), key: key.to_string(), reason }
        }
        other => other,
    })?;
    Ok(config.resolved())
}

/// Options of MoE configs (DeepSeek's, GLM's, ...) that no implemented family computes: refused
/// by name wherever they appear, not silently ignored.
fn refuse_moe_options(k: &Keys<'_>) -> Result<()> {
    if k.bool("router_bias")? == Some(true) {
        return Err(k.err("router_bias", "true: a bias on the router is not supported; set it to false"));
    }
    if let Some(f) = k.str("scoring_func")? {
        if f != "softmax" {
            return Err(k.err(
                "scoring_func",
                format!("`{f}`: only softmax routing over all experts is supported; set \"softmax\""),
            ));
        }
    }
    for key in ["n_group", "topk_group"] {
        if let Some(g) = k.usize(key)? {
            if g > 1 {
                return Err(k.err(
                    key,
                    format!("{g}: group-limited top-k routing (DeepSeek's) is not supported; set it to 1 or null"),
                ));
            }
        }
    }
    for key in ["kv_lora_rank", "q_lora_rank"] {
        if let Some(r) = k.get(key) {
            return Err(k.err(
                key,
                format!("{r}: multi-head latent attention (MLA) is not supported; set it to null (full-rank q/k/v)"),
            ));
        }
    }
    Ok(())
}

/// The MoE keys of an MoE family, with transformers' defaults per family: the expert count as
/// `num_local_experts` or `num_experts` (both spellings; equal when both are given), top-k, the
/// load-balancing loss's weight and switch, `norm_topk_prob`, the expert widths; and
/// `decoder_sparse_step` / `mlp_only_layers` (Qwen3-MoE, Qwen2-MoE: dense layers among the
/// sparse ones).
fn parse_moe(k: &Keys<'_>, config: LlamaConfig) -> Result<LlamaConfig> {
    let family = config.family;
    // transformers' defaults: (experts, top-k, aux coef, moe_intermediate_size, shared width).
    let (experts, top_k, coef, moe_width, shared_width) = match family {
        LlamaFamily::Qwen3Moe => (128, 8, 0.001, 768, 0),
        LlamaFamily::Olmoe => (64, 8, 0.01, 0, 0),
        LlamaFamily::Qwen2Moe => (60, 4, 0.001, 1408, 5632),
        _ => (8, 2, 0.001, 0, 0),
    };
    let experts = match (k.usize("num_local_experts")?, k.usize("num_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(k.err("num_experts", format!("{b} disagrees with num_local_experts = {a}: keep one")))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => experts,
    };
    let (decoder_sparse_step, mlp_only_layers) = parse_dense_layers(k, family)?;
    let uses_moe_width = matches!(family, LlamaFamily::Qwen3Moe | LlamaFamily::Qwen2Moe);
    Ok(LlamaConfig {
        num_local_experts: Some(experts),
        num_experts_per_tok: Some(k.usize("num_experts_per_tok")?.unwrap_or(top_k)),
        router_aux_loss_coef: Some(k.f64("router_aux_loss_coef")?.unwrap_or(coef)),
        output_router_logits: Some(k.bool("output_router_logits")?.unwrap_or(false)),
        norm_topk_prob: if family == LlamaFamily::Mixtral {
            None
        } else {
            Some(k.bool("norm_topk_prob")?.unwrap_or(false))
        },
        moe_intermediate_size: if uses_moe_width {
            Some(k.usize("moe_intermediate_size")?.unwrap_or(moe_width))
        } else {
            None
        },
        shared_expert_intermediate_size: (family == LlamaFamily::Qwen2Moe)
            .then(|| k.usize("shared_expert_intermediate_size"))
            .transpose()?
            .map(|s| s.unwrap_or(shared_width)),
        decoder_sparse_step,
        mlp_only_layers,
        ..config
    })
}

/// `decoder_sparse_step` and `mlp_only_layers`, the dense layers among the sparse ones of
/// Qwen3-MoE and Qwen2-MoE (`None` for their defaults, 1 and `[]`). OLMoE has neither (every
/// layer is sparse): a value other than the default is refused there. Mixtral's config has no
/// such keys; they are ignored.
fn parse_dense_layers(k: &Keys<'_>, family: LlamaFamily) -> Result<(Option<usize>, Option<Vec<usize>>)> {
    if family == LlamaFamily::Mixtral {
        return Ok((None, None));
    }
    let step = k.usize("decoder_sparse_step")?.filter(|&s| s != 1);
    let layers = match k.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| {
                k.err("mlp_only_layers", format!("must be a list of layer indices, got {}", Value::Array(a.clone())))
            })?,
        Some(v) => return Err(k.err("mlp_only_layers", format!("must be a list of layer indices, got {v}"))),
    };
    if family == LlamaFamily::Olmoe {
        if let Some(s) = step {
            return Err(k.err(
                "decoder_sparse_step",
                format!("{s}: OLMoE has no dense layers among its sparse ones; set it to 1"),
            ));
        }
        if !layers.is_empty() {
            return Err(k.err(
                "mlp_only_layers",
                format!("{layers:?}: OLMoE has no dense layers among its sparse ones; set it to []"),
            ));
        }
    }
    Ok((step, (!layers.is_empty()).then_some(layers)))
}

/// `(rope_theta, rope_scaling)` from transformers 5's `rope_parameters` or transformers 4's
/// top-level `rope_theta` / `rope_scaling`.
fn parse_rope(k: &Keys<'_>, theta_default: f64) -> Result<(f64, RopeScaling)> {
    let top_theta = k.f64("rope_theta")?;
    let top_scaling = k.object("rope_scaling")?;
    let Some(params) = k.object("rope_parameters")? else {
        let scaling = match top_scaling {
            None => RopeScaling::Default,
            Some(s) => parse_scaling(&Keys { map: s, path: k.path, prefix: "rope_scaling" })?,
        };
        return Ok((top_theta.unwrap_or(theta_default), scaling));
    };
    let p = Keys { map: params, path: k.path, prefix: "rope_parameters" };
    if let Some((key, _)) = params.iter().find(|(_, v)| v.is_object()) {
        return Err(p.err(
            key,
            "per-layer-type RoPE parameters are not supported (only one set for every layer, as Llama has)",
        ));
    }
    if top_scaling.is_some() {
        return Err(k.err(
            "rope_scaling",
            "is set beside `rope_parameters`: keep one (transformers 4 writes `rope_scaling`, transformers 5 \
             `rope_parameters`)",
        ));
    }
    let theta = match (p.f64("rope_theta")?, top_theta) {
        (Some(a), Some(b)) if a != b => {
            return Err(k.err("rope_theta", format!("{b} disagrees with rope_parameters.rope_theta = {a}: keep one")))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => theta_default,
    };
    if let Some(f) = p.f64("partial_rotary_factor")? {
        if f != 1.0 {
            return Err(p.err("partial_rotary_factor", format!("{f}: only full rotary embeddings (1.0) are supported")));
        }
    }
    Ok((theta, parse_scaling(&p)?))
}

/// One RoPE parameter object (`rope_scaling` or `rope_parameters`).
fn parse_scaling(p: &Keys<'_>) -> Result<RopeScaling> {
    let (key, rope_type) = match (p.str("rope_type")?, p.str("type")?) {
        (Some(t), _) => ("rope_type", t),
        (None, Some(t)) => ("type", t),
        (None, None) => ("rope_type", "default"),
    };
    let why = "required by this rope_type";
    match rope_type {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear { factor: p.required_f64("factor", why)? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: p.required_f64("factor", why)?,
            low_freq_factor: p.required_f64("low_freq_factor", why)?,
            high_freq_factor: p.required_f64("high_freq_factor", why)?,
            original_max_position_embeddings: p
                .usize("original_max_position_embeddings")?
                .ok_or_else(|| p.err("original_max_position_embeddings", format!("is missing ({why})")))?,
        }),
        other => Err(p.err(
            key,
            format!(
                "`{other}` is not supported (supported: default, linear, llama3); `dynamic`, `yarn` and `longrope` \
                 depend on the sequence length or rescale attention and are not implemented"
            ),
        )),
    }
}
