//! [`LlamaConfig`]: the hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral without
//! sliding window, Qwen2, Qwen3), named as in Hugging Face's `config.json`, and the flat layout of each
//! unit ([`LlamaConfig::units`]) with the checkpoint's tensor names.

use serde::{Deserialize, Serialize};

use crate::unit::{LayoutBuilder, ParamInit, UnitKind, UnitSpec};
use crate::{Error, Result};

/// Which Hugging Face model class the config describes (`model_type` of `config.json`). The
/// three compute the same decoder; they differ in which projections have a bias and in the
/// keys of their `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlamaFamily {
    /// `LlamaForCausalLM` (Llama 2, Llama 3.x, and most "llama-architecture" models):
    /// `attention_bias` puts a bias on q/k/v **and** o, `mlp_bias` on gate/up/down.
    Llama,
    /// `MistralForCausalLM` without sliding-window attention: no biases.
    Mistral,
    /// `Qwen2ForCausalLM`: q/k/v always have a bias, o and the MLP never.
    Qwen2,
    /// `MixtralForCausalLM` (Jiang et al. 2024, "Mixtral of Experts"): Mistral's attention (no
    /// biases) and, in place of the MLP, a sparse MoE block of `num_local_experts` SwiGLU experts
    /// behind a router (`block_sparse_moe`); see [`crate::mixtral`].
    Mixtral,
    /// `Qwen3ForCausalLM` (Yang et al. 2025, "Qwen3 Technical Report"): Llama's decoder with an
    /// RMSNorm per head on q and k (`self_attn.q_norm`, `k_norm`, weight `[head_dim]`) after the
    /// projection and before RoPE; `attention_bias` on q/k/v and o as Llama's, no MLP bias.
    Qwen3,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention (per-head q/k norm) and a sparse MoE block per
    /// layer (`mlp.gate` router, `mlp.experts.{e}.{gate,up,down}_proj` of width
    /// `moe_intermediate_size`), top-k of the softmax, renormalized when `norm_topk_prob`.
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// `OlmoeForCausalLM` (Muennighoff et al. 2024, "OLMoE"): an RMSNorm over the whole q and k
    /// projections (`self_attn.q_norm` `[H·hd]`, `k_norm` `[KV·hd]`) before the head split and
    /// RoPE, and Qwen3-MoE's sparse block (experts of width `intermediate_size`).
    Olmoe,
    /// `Qwen2MoeForCausalLM`: Qwen2's attention (q/k/v bias), routed experts of width
    /// `moe_intermediate_size` and a shared expert (`mlp.shared_expert`, width
    /// `shared_expert_intermediate_size`) scaled by `sigmoid(mlp.shared_expert_gate · h)`, a
    /// dense part of the trunk unit.
    #[serde(rename = "qwen2_moe")]
    Qwen2Moe,
}

impl LlamaFamily {
    /// `model_type` in `config.json`: `llama`, `mistral`, `qwen2`, `mixtral`, `qwen3`,
    /// `qwen3_moe`, `olmoe`, `qwen2_moe`.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "llama",
            LlamaFamily::Mistral => "mistral",
            LlamaFamily::Qwen2 => "qwen2",
            LlamaFamily::Mixtral => "mixtral",
            LlamaFamily::Qwen3 => "qwen3",
            LlamaFamily::Qwen3Moe => "qwen3_moe",
            LlamaFamily::Olmoe => "olmoe",
            LlamaFamily::Qwen2Moe => "qwen2_moe",
        }
    }

    /// The `architectures` entry: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, ...
    pub fn architecture(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "LlamaForCausalLM",
            LlamaFamily::Mistral => "MistralForCausalLM",
            LlamaFamily::Qwen2 => "Qwen2ForCausalLM",
            LlamaFamily::Mixtral => "MixtralForCausalLM",
            LlamaFamily::Qwen3 => "Qwen3ForCausalLM",
            LlamaFamily::Qwen3Moe => "Qwen3MoeForCausalLM",
            LlamaFamily::Olmoe => "OlmoeForCausalLM",
            LlamaFamily::Qwen2Moe => "Qwen2MoeForCausalLM",
        }
    }
}

/// How the rotary frequencies are derived from `rope_theta` (transformers'
/// `modeling_rope_utils.py`, `ROPE_INIT_FUNCTIONS`). The TOML/JSON form is tagged by
/// `rope_type`, as transformers writes it: `{ rope_type = "llama3", factor = 8.0, ... }`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// `inv_freq[i] = 1 / theta^(2i / head_dim)`, `i < head_dim / 2` (RoFormer, Su et al. 2021).
    Default,
    /// Position interpolation (Chen et al. 2023): the default frequencies divided by `factor`.
    Linear {
        /// Divisor of every frequency (> 0).
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling (`_compute_llama3_parameters`): with
    /// `L = original_max_position_embeddings` and wavelength `w = 2π / f`, frequencies with
    /// `w > L / low_freq_factor` are divided by `factor`, those with `w < L / high_freq_factor`
    /// are kept, and in between `f' = (1 - s) f / factor + s f` with
    /// `s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
    Llama3 {
        /// Divisor of the low frequencies (> 0), e.g. 8 (Llama 3.1) or 32 (Llama 3.2).
        factor: f64,
        /// e.g. 1.
        low_freq_factor: f64,
        /// e.g. 4; must exceed `low_freq_factor`.
        high_freq_factor: f64,
        /// The context length of pre-training, e.g. 8192.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// transformers' `rope_type` name: `default`, `linear`, `llama3`.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }
}

/// Hyper-parameters of a Llama-family decoder, with the names and meaning of Hugging Face's
/// `config.json` (transformers' `LlamaConfig`, `MistralConfig`, `Qwen2Config`).
///
/// Read one from a checkpoint with [`crate::hf::parse_config`] /
/// [`crate::hf::HfCheckpoint::llama_config`], build one for training from scratch with
/// [`LlamaConfig::new`] (or deserialize the TOML form: the same keys, unknown keys refused, every
/// key but the five sizes of [`LlamaConfig::new`] optional), and write it back as `config.json`
/// with [`crate::hf::config_json`]. Call [`LlamaConfig::validate`] (or
/// [`super::Llama::new`], which does) before use.
///
/// ```toml
/// [model]
/// family = "llama"          # or "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe"
/// vocab_size = 1024
/// hidden_size = 256
/// intermediate_size = 688
/// num_hidden_layers = 4
/// num_attention_heads = 4
/// num_key_value_heads = 2   # GQA; default: num_attention_heads
/// max_position_embeddings = 256
/// tie_word_embeddings = true
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    /// The model class (`model_type`). Default: `llama`.
    #[serde(default = "default_family")]
    pub family: LlamaFamily,
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Width `d` of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP's hidden layer (`gate_proj`/`up_proj` outputs).
    pub intermediate_size: usize,
    /// Number of decoder layers (≥ 1).
    pub num_hidden_layers: usize,
    /// Query heads `H`.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention, Ainslie et al. 2023); must divide
    /// `num_attention_heads`. Default (`None`): `num_attention_heads` (multi-head attention).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of one head; even (RoPE rotates pairs). Default (`None`): `hidden_size /
    /// num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Epsilon added to the mean square in every RMSNorm. Default: `1e-6` (transformers').
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// Longest sequence the model takes. Default: 2048.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Base of the rotary frequencies. Default: 10000.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Frequency scaling of RoPE: `{ rope_type = "linear", factor }` or `{ rope_type = "llama3",
    /// factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }` (a
    /// checkpoint's `rope_parameters`, transformers 5, are read too); other types are refused by
    /// name. Default: [`RopeScaling::Default`] (none).
    #[serde(default = "default_rope_scaling")]
    pub rope_scaling: RopeScaling,
    /// Whether `lm_head` is the token embedding (no `lm_head.weight` of its own). Default: false.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (`attention_bias` of Llama; always true for Qwen2).
    /// Default: false (Llama, Mistral), true (Qwen2) — see [`LlamaConfig::qkv_bias`].
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Bias on `gate_proj`, `up_proj`, `down_proj` (Llama's `mlp_bias`). Default: false.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Standard deviation of the normal init of weights and embeddings (transformers'
    /// `_init_weights`). Default: 0.02.
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    /// MoE families only (required there, refused elsewhere): experts per MoE layer `E`
    /// (`num_local_experts`; `num_experts` in most Hub `config.json` files, ≥ 2); each
    /// expert's hidden width is [`LlamaConfig::expert_intermediate_size`].
    #[serde(default, alias = "num_experts")]
    pub num_local_experts: Option<usize>,
    /// MoE families only: experts per token `k` (`num_experts_per_tok`, `1..=E`). Default: 2.
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    /// MoE families only: weight of the load-balancing loss in the objective
    /// (`router_aux_loss_coef`, ≥ 0). Default: 0.001 (transformers').
    #[serde(default)]
    pub router_aux_loss_coef: Option<f64>,
    /// MoE families only: whether the load-balancing loss is part of the objective (transformers adds
    /// it to the loss only with `output_router_logits`). Default: false (transformers').
    #[serde(default)]
    pub output_router_logits: Option<bool>,
    /// Qwen3-MoE and Qwen2-MoE only: each routed expert's hidden width
    /// (`moe_intermediate_size`). Default: `intermediate_size`.
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    /// Qwen3-MoE, OLMoE and Qwen2-MoE only: whether the top-k probabilities are renormalized
    /// to sum to 1 (`norm_topk_prob`). Default: false (transformers'); Mixtral always
    /// renormalizes.
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// Qwen2-MoE only (required there): the shared expert's hidden width
    /// (`shared_expert_intermediate_size`, ≥ 1).
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Qwen3-MoE and Qwen2-MoE only: layer `i` is sparse (an MoE block) when `(i + 1)` is a
    /// multiple of this (`decoder_sparse_step`, ≥ 1) and `i` is not in `mlp_only_layers`; the
    /// other layers are dense, a SwiGLU MLP of width
    /// `intermediate_size` (transformers' `Qwen3MoeDecoderLayer`). Default: 1 (every layer
    /// sparse).
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    /// Qwen3-MoE and Qwen2-MoE only: 0-based indices of the layers that are dense whatever
    /// `decoder_sparse_step` says (`mlp_only_layers`, each `< num_hidden_layers`).
    /// Qwen2-MoE's dense layers have no shared expert. Default: none.
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
}

fn default_family() -> LlamaFamily {
    LlamaFamily::Llama
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_max_position_embeddings() -> usize {
    2048
}
fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rope_scaling() -> RopeScaling {
    RopeScaling::Default
}
fn default_initializer_range() -> f64 {
    0.02
}

/// Where each computation group sits in a decoder layer's group list (see
/// [`LlamaConfig::block_groups`]): the q/k/v/o projections, the two norms and the MLP, biases
/// where the config has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockGroups {
    pub ln1: usize,
    pub q_w: usize,
    pub q_b: Option<usize>,
    pub k_w: usize,
    pub k_b: Option<usize>,
    pub v_w: usize,
    pub v_b: Option<usize>,
    pub o_w: usize,
    pub o_b: Option<usize>,
    /// Qwen3: the per-head RMSNorm weights of q and k, `[hd]` each (after `o_proj`).
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub ln2: usize,
    /// `gate_proj.weight` and `up_proj.weight` back to back: one `[2I, d]` matrix.
    pub gate_up_w: usize,
    /// `gate_proj.bias` and `up_proj.bias` back to back: `[2I]`.
    pub gate_up_b: Option<usize>,
    pub down_w: usize,
    pub down_b: Option<usize>,
    /// Mixtral trunks: `block_sparse_moe.gate.weight` `[E, d]` (then `gate_up_w` and `down_w`
    /// name the same group: a trunk has no MLP); `None` for a dense layer.
    pub router: Option<usize>,
    /// Qwen2-MoE trunks: the shared expert's `gate_up` `[2S, d]`, `down_proj` `[d, S]` and
    /// `shared_expert_gate` `[1, d]`.
    pub shared: Option<(usize, usize, usize)>,
}

impl LlamaConfig {
    /// A config for training from scratch with transformers' defaults for everything but the
    /// sizes: family `llama`, multi-head attention (`num_key_value_heads = None`), `head_dim =
    /// hidden_size / num_attention_heads`, RMSNorm eps 1e-6, RoPE theta 1e4 without scaling,
    /// `max_position_embeddings` 2048, untied head, no biases, `initializer_range` 0.02. Set the
    /// public fields to change the rest (e.g. `num_key_value_heads: Some(2)` for GQA).
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
    ) -> Self {
        Self {
            family: LlamaFamily::Llama,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: None,
            head_dim: None,
            rms_norm_eps: default_rms_norm_eps(),
            max_position_embeddings: default_max_position_embeddings(),
            rope_theta: default_rope_theta(),
            rope_scaling: RopeScaling::Default,
            tie_word_embeddings: false,
            attention_bias: None,
            mlp_bias: false,
            initializer_range: default_initializer_range(),
            num_local_experts: None,
            num_experts_per_tok: None,
            router_aux_loss_coef: None,
            output_router_logits: None,
            moe_intermediate_size: None,
            norm_topk_prob: None,
            shared_expert_intermediate_size: None,
            decoder_sparse_step: None,
            mlp_only_layers: None,
        }
    }

    /// A Mixtral config for training from scratch: [`LlamaConfig::new`]'s defaults with family
    /// `mixtral`, `experts` experts per layer of hidden width `intermediate_size`, `top_k` of
    /// them per token, the load-balancing loss in the objective (`output_router_logits = true`)
    /// weighted by transformers' default `router_aux_loss_coef` 0.001 (set the field to change
    /// it), and RoPE theta 1e6 (transformers' `MixtralConfig`).
    pub fn mixtral(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        experts: usize,
        top_k: usize,
    ) -> Self {
        Self {
            family: LlamaFamily::Mixtral,
            rope_theta: 1e6,
            num_local_experts: Some(experts),
            num_experts_per_tok: Some(top_k),
            router_aux_loss_coef: Some(0.001),
            output_router_logits: Some(true),
            ..Self::new(vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads)
        }
    }

    /// Whether the layers' feed-forward networks are sparse MoE blocks (families `mixtral`,
    /// `qwen3_moe`, `olmoe`, `qwen2_moe`).
    pub fn is_moe(&self) -> bool {
        matches!(self.family, LlamaFamily::Mixtral | LlamaFamily::Qwen3Moe | LlamaFamily::Olmoe | LlamaFamily::Qwen2Moe)
    }

    /// MoE: each routed expert's hidden width: `moe_intermediate_size` (Qwen3-MoE,
    /// Qwen2-MoE; default `intermediate_size`), else `intermediate_size` (Mixtral, OLMoE).
    pub fn expert_intermediate_size(&self) -> usize {
        match self.family {
            LlamaFamily::Qwen3Moe | LlamaFamily::Qwen2Moe => {
                self.moe_intermediate_size.unwrap_or(self.intermediate_size)
            }
            _ => self.intermediate_size,
        }
    }

    /// MoE: whether the chosen top-k probabilities are renormalized to sum to 1 (the gates):
    /// always for Mixtral, `norm_topk_prob` (default false) for the others.
    pub fn norm_topk_prob(&self) -> bool {
        self.family == LlamaFamily::Mixtral || self.norm_topk_prob.unwrap_or(false)
    }

    /// Qwen2-MoE: the shared expert's hidden width; `None` for the other families.
    pub fn shared_expert_width(&self) -> Option<usize> {
        (self.family == LlamaFamily::Qwen2Moe).then(|| self.shared_expert_intermediate_size.unwrap_or(0))
    }

    /// The tensor-name prefix of an MoE layer's feed-forward block under `model.layers.{i}`:
    /// `block_sparse_moe` (Mixtral) or `mlp`.
    pub(crate) fn moe_prefix(&self) -> &'static str {
        if self.family == LlamaFamily::Mixtral {
            "block_sparse_moe"
        } else {
            "mlp"
        }
    }

    /// MoE: experts per layer `E` (`num_local_experts`); 0 for a dense family.
    pub fn num_experts(&self) -> usize {
        if self.is_moe() {
            self.num_local_experts.unwrap_or(0)
        } else {
            0
        }
    }

    /// MoE: experts per token `k` (`num_experts_per_tok`, default 2).
    pub fn top_k(&self) -> usize {
        self.num_experts_per_tok.unwrap_or(2)
    }

    /// MoE: the weight of the load-balancing loss in the objective: `router_aux_loss_coef`
    /// (default 0.001) when `output_router_logits`, else 0 (transformers adds it only then).
    pub fn aux_loss_weight(&self) -> f64 {
        if self.output_router_logits.unwrap_or(false) {
            self.router_aux_loss_coef.unwrap_or(0.001)
        } else {
            0.0
        }
    }

    /// Whether layer `layer`'s feed-forward network is a sparse MoE block (transformers' rule:
    /// an MoE family, `layer` not in `mlp_only_layers` and `(layer + 1) % decoder_sparse_step
    /// == 0`); false for every layer of a dense family.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.is_moe()
            && (layer + 1) % self.decoder_sparse_step.unwrap_or(1).max(1) == 0
            && !self.mlp_only_layers.as_deref().unwrap_or_default().contains(&layer)
    }

    /// MoE: the sparse layers in order (every layer unless `decoder_sparse_step` or
    /// `mlp_only_layers` make some dense); empty for a dense family. The trainer's routing
    /// statistics, routing trace and placer number MoE blocks by their position here.
    pub fn sparse_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers).filter(|&l| self.is_sparse_layer(l)).collect()
    }

    /// Unit index of layer `layer`'s unit: its decoder layer (dense) or its MoE trunk: `1 +`
    /// the units of the layers before it (one per dense layer, `1 + E` per sparse one; Mixtral
    /// `1 + layer · (1 + E)`).
    pub fn block_unit(&self, layer: usize) -> usize {
        1 + (0..layer).map(|l| if self.is_sparse_layer(l) { 1 + self.num_experts() } else { 1 }).sum::<usize>()
    }

    /// MoE: unit index of expert `expert` of the sparse layer `layer` (`block_unit(layer) + 1 +
    /// expert`).
    pub fn expert_unit(&self, layer: usize, expert: usize) -> usize {
        self.block_unit(layer) + 1 + expert
    }

    /// Key/value heads: `num_key_value_heads`, else `num_attention_heads`.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one head: `head_dim`, else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether q/k/v have a bias: `attention_bias`, else true for Qwen2 and Qwen2-MoE and false
    /// otherwise.
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(matches!(self.family, LlamaFamily::Qwen2 | LlamaFamily::Qwen2Moe))
    }

    /// Whether `o_proj` has a bias: the `attention_bias` of Llama, Qwen3, Qwen3-MoE and OLMoE
    /// (which covers q/k/v/o); never for Mistral, Mixtral, Qwen2 and Qwen2-MoE.
    pub fn o_bias(&self) -> bool {
        matches!(self.family, LlamaFamily::Llama | LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe | LlamaFamily::Olmoe)
            && self.qkv_bias()
    }

    /// Whether q and k are RMS-normed per head after their projection, before RoPE
    /// (`self_attn.q_norm.weight`, `k_norm.weight`, `[head_dim]`, eps `rms_norm_eps`): Qwen3.
    pub fn qk_norm(&self) -> bool {
        matches!(self.family, LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe | LlamaFamily::Olmoe)
    }

    /// The widths of the q and k norms' weights: `[hd]` each per head (Qwen3, Qwen3-MoE), or
    /// over the whole projections `[H·hd]` and `[KV·hd]` (OLMoE); `None` without q/k norms.
    pub fn qk_norm_widths(&self) -> Option<(usize, usize)> {
        let hd = self.head_dim();
        match self.family {
            LlamaFamily::Olmoe => Some((self.num_attention_heads * hd, self.kv_heads() * hd)),
            _ if self.qk_norm() => Some((hd, hd)),
            _ => None,
        }
    }

    /// The same config with every `None` default written out (`num_key_value_heads`,
    /// `head_dim`, `attention_bias`), as [`crate::hf::parse_config`] returns it.
    pub fn resolved(&self) -> Self {
        Self {
            num_key_value_heads: Some(self.kv_heads()),
            head_dim: Some(self.head_dim()),
            attention_bias: Some(self.qkv_bias()),
            num_experts_per_tok: self.is_moe().then(|| self.top_k()),
            router_aux_loss_coef: self.is_moe().then(|| self.router_aux_loss_coef.unwrap_or(0.001)),
            output_router_logits: self.is_moe().then(|| self.output_router_logits.unwrap_or(false)),
            moe_intermediate_size: matches!(self.family, LlamaFamily::Qwen3Moe | LlamaFamily::Qwen2Moe)
                .then(|| self.expert_intermediate_size()),
            norm_topk_prob: (self.is_moe() && self.family != LlamaFamily::Mixtral).then(|| self.norm_topk_prob()),
            ..self.clone()
        }
    }

    /// Number of units: `num_hidden_layers + 2` (embedding, layers, head), plus `E` experts per
    /// sparse layer of an MoE family (Mixtral: `num_hidden_layers · (1 + E) + 2`).
    pub fn num_units(&self) -> usize {
        self.num_hidden_layers + self.sparse_layers().len() * self.num_experts() + 2
    }

    /// Checks every constraint in one place.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first offending key (`model.<key>`) and the fix.
    pub fn validate(&self) -> Result<()> {
        let cfg = |field: &'static str, reason: String| Err(Error::Config { field, reason });
        let positive = [
            ("model.vocab_size", self.vocab_size),
            ("model.hidden_size", self.hidden_size),
            ("model.intermediate_size", self.intermediate_size),
            ("model.num_hidden_layers", self.num_hidden_layers),
            ("model.num_attention_heads", self.num_attention_heads),
            ("model.num_key_value_heads", self.kv_heads()),
            ("model.head_dim", self.head_dim()),
            ("model.max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return cfg(field, "must be at least 1".into());
            }
        }
        if self.vocab_size >= u32::MAX as usize {
            return cfg("model.vocab_size", format!("{} does not fit token ids of type u32", self.vocab_size));
        }
        if self.head_dim.is_none() && self.hidden_size % self.num_attention_heads != 0 {
            return cfg(
                "model.num_attention_heads",
                format!(
                    "must divide model.hidden_size = {} (got {}), or set model.head_dim",
                    self.hidden_size, self.num_attention_heads
                ),
            );
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            return cfg(
                "model.num_key_value_heads",
                format!(
                    "must divide model.num_attention_heads = {} (got {})",
                    self.num_attention_heads,
                    self.kv_heads()
                ),
            );
        }
        if self.head_dim() % 2 != 0 {
            return cfg("model.head_dim", format!("must be even (RoPE rotates pairs), got {}", self.head_dim()));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return cfg("model.rms_norm_eps", format!("must be a positive finite number, got {}", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return cfg("model.rope_theta", format!("must be a finite number > 1, got {}", self.rope_theta));
        }
        if !(self.initializer_range.is_finite() && self.initializer_range > 0.0) {
            return cfg(
                "model.initializer_range",
                format!("must be a positive finite number, got {}", self.initializer_range),
            );
        }
        match self.rope_scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return cfg("model.rope_scaling.factor", format!("must be a positive number, got {factor}"));
                }
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return cfg("model.rope_scaling.factor", format!("must be a positive number, got {factor}"));
                }
                if !(low_freq_factor.is_finite() && low_freq_factor > 0.0 && high_freq_factor.is_finite())
                    || high_freq_factor <= low_freq_factor
                {
                    return cfg(
                        "model.rope_scaling.high_freq_factor",
                        format!("must exceed low_freq_factor > 0 (got low {low_freq_factor}, high {high_freq_factor})"),
                    );
                }
                if original_max_position_embeddings == 0 {
                    return cfg("model.rope_scaling.original_max_position_embeddings", "must be at least 1".into());
                }
            }
        }
        if !self.is_moe() {
            for (field, set) in [
                ("model.num_local_experts", self.num_local_experts.is_some()),
                ("model.num_experts_per_tok", self.num_experts_per_tok.is_some()),
                ("model.router_aux_loss_coef", self.router_aux_loss_coef.is_some()),
                ("model.output_router_logits", self.output_router_logits.is_some()),
            ] {
                if set {
                    return cfg(
                        field,
                        format!(
                            "is an MoE key: remove it or set an MoE family (\"mixtral\", \"qwen3_moe\", \"olmoe\", \
                             \"qwen2_moe\"; family is {})",
                            self.family.model_type()
                        ),
                    );
                }
            }
        }
        for (field, set, families) in [
            (
                "model.moe_intermediate_size",
                self.moe_intermediate_size.is_some(),
                &[LlamaFamily::Qwen3Moe, LlamaFamily::Qwen2Moe][..],
            ),
            (
                "model.norm_topk_prob",
                self.norm_topk_prob.is_some(),
                &[LlamaFamily::Qwen3Moe, LlamaFamily::Olmoe, LlamaFamily::Qwen2Moe][..],
            ),
            (
                "model.shared_expert_intermediate_size",
                self.shared_expert_intermediate_size.is_some(),
                &[LlamaFamily::Qwen2Moe][..],
            ),
            (
                "model.decoder_sparse_step",
                self.decoder_sparse_step.is_some(),
                &[LlamaFamily::Qwen3Moe, LlamaFamily::Qwen2Moe][..],
            ),
            (
                "model.mlp_only_layers",
                self.mlp_only_layers.is_some(),
                &[LlamaFamily::Qwen3Moe, LlamaFamily::Qwen2Moe][..],
            ),
        ] {
            if set && !families.contains(&self.family) {
                let names: Vec<&str> = families.iter().map(|f| f.model_type()).collect();
                return cfg(
                    field,
                    format!(
                        "is a key of family {} only: remove it (family is {})",
                        names.join(" or "),
                        self.family.model_type()
                    ),
                );
            }
        }
        if self.is_moe() {
            self.validate_moe()?;
        }
        match self.family {
            LlamaFamily::Llama | LlamaFamily::Qwen3Moe | LlamaFamily::Olmoe => {}
            LlamaFamily::Qwen2Moe => {
                if self.o_bias() || self.mlp_bias {
                    return cfg("model.mlp_bias", "Qwen2-MoE has no o_proj or MLP bias: leave mlp_bias unset".into());
                }
                if self.shared_expert_width() == Some(0) {
                    return cfg(
                        "model.shared_expert_intermediate_size",
                        "Qwen2-MoE needs its shared expert's width (at least 1)".into(),
                    );
                }
            }
            LlamaFamily::Mistral => {
                if self.qkv_bias() || self.mlp_bias {
                    return cfg(
                        "model.attention_bias",
                        "Mistral has no biases: leave attention_bias and mlp_bias unset (or use family = \"llama\")"
                            .into(),
                    );
                }
            }
            LlamaFamily::Mixtral => {
                if self.qkv_bias() || self.mlp_bias {
                    return cfg(
                        "model.attention_bias",
                        "Mixtral has no biases: leave attention_bias and mlp_bias unset".into(),
                    );
                }
            }
            LlamaFamily::Qwen3 => {
                if self.mlp_bias {
                    return cfg("model.mlp_bias", "Qwen3 has no MLP bias: leave mlp_bias unset".into());
                }
            }
            LlamaFamily::Qwen2 => {
                if !self.qkv_bias() || self.mlp_bias {
                    return cfg(
                        "model.attention_bias",
                        "Qwen2 always has q/k/v biases and no MLP bias: leave attention_bias and mlp_bias unset \
                         (or use family = \"llama\")"
                            .into(),
                    );
                }
            }
        }
        Ok(())
    }

    /// The MoE keys of an MoE family: at least 2 experts, top-k in `1..=E`, a finite
    /// non-negative load-balancing weight, a non-zero expert width.
    fn validate_moe(&self) -> Result<()> {
        let cfg = |field: &'static str, reason: String| Err(Error::Config { field, reason });
        let e = self.num_local_experts.unwrap_or(0);
        if e < 2 {
            return cfg(
                "model.num_local_experts",
                format!("an MoE family needs at least 2 experts per layer, got {e}"),
            );
        }
        if !(1..=e).contains(&self.top_k()) {
            return cfg(
                "model.num_experts_per_tok",
                format!("must be in 1..={e} (model.num_local_experts), got {}", self.top_k()),
            );
        }
        if let Some(c) = self.router_aux_loss_coef {
            if !(c.is_finite() && c >= 0.0) {
                return cfg("model.router_aux_loss_coef", format!("must be a finite number >= 0, got {c}"));
            }
        }
        if self.expert_intermediate_size() == 0 {
            return cfg("model.moe_intermediate_size", "must be at least 1".into());
        }
        if self.decoder_sparse_step == Some(0) {
            return cfg("model.decoder_sparse_step", "must be at least 1 (1: every layer sparse)".into());
        }
        let layers = self.num_hidden_layers;
        if let Some(&l) = self.mlp_only_layers.iter().flatten().find(|&&l| l >= layers) {
            return cfg(
                "model.mlp_only_layers",
                format!("names layer {l}, but the model has {layers} (0-based indices below num_hidden_layers)"),
            );
        }
        if self.sparse_layers().is_empty() {
            let only = self.mlp_only_layers.as_ref().is_some_and(|l| !l.is_empty());
            return cfg(
                if only { "model.mlp_only_layers" } else { "model.decoder_sparse_step" },
                format!(
                    "with decoder_sparse_step = {} no layer of {layers} is sparse: keep at least one MoE layer, or \
                     use the dense family (\"qwen3\" or \"qwen2\")",
                    self.decoder_sparse_step.unwrap_or(1)
                ),
            );
        }
        if self.family == LlamaFamily::Mixtral && self.norm_topk_prob == Some(false) {
            return cfg("model.norm_topk_prob", "Mixtral always renormalizes its top-k: leave it unset".into());
        }
        Ok(())
    }

    /// The units in forward order with their flat layouts. Parameter names are the Hugging Face
    /// tensor names and shapes their layout (Linear weights `[out, in]`, `y = x Wᵀ + b`), so a
    /// unit's flat vector is the checkpoint's tensors back to back:
    ///
    /// | unit | kind | name | parameters (shape), in flat order |
    /// |---|---|---|---|
    /// | 0 | [`UnitKind::Embedding`] | `model.embed_tokens` | `model.embed_tokens.weight` `[V, d]` |
    /// | `1 + i` | [`UnitKind::Block`]`(i)` | `model.layers.{i}` | `input_layernorm.weight` `[d]`, `self_attn.q_proj.weight` `[H·hd, d]` (+ `.bias` `[H·hd]`), `self_attn.k_proj.weight` `[KV·hd, d]` (+ bias), `self_attn.v_proj.weight` `[KV·hd, d]` (+ bias), `self_attn.o_proj.weight` `[d, H·hd]` (+ bias `[d]`), (Qwen3: `self_attn.q_norm.weight`, `self_attn.k_norm.weight` `[hd]`), `post_attention_layernorm.weight` `[d]`, `mlp.gate_proj.weight` `[I, d]`, `mlp.up_proj.weight` `[I, d]` (+ `gate_proj.bias`, `up_proj.bias` `[I]`), `mlp.down_proj.weight` `[d, I]` (+ bias `[d]`) — each prefixed `model.layers.{i}.` |
    /// | `L + 1` | [`UnitKind::Head`] | `head` | `model.norm.weight` `[d]`, and unless tied `lm_head.weight` `[V, d]` |
    ///
    /// Mixtral: layer `i` is a trunk unit [`UnitKind::MoeTrunk`]`(i)` at
    /// [`LlamaConfig::block_unit`]`(i)` (`model.layers.{i}`: the norms and attention as above,
    /// then `block_sparse_moe.gate.weight` `[E, d]`, the router) followed by `E` expert units
    /// [`UnitKind::Expert`] (`model.layers.{i}.block_sparse_moe.experts.{e}`: `w1.weight`
    /// `[I, d]` (gate), `w3.weight` `[I, d]` (up), `w2.weight` `[d, I]` (down)); the head is
    /// the last unit. Qwen3-MoE, OLMoE and Qwen2-MoE: the router is `mlp.gate.weight`, an expert
    /// `model.layers.{i}.mlp.experts.{e}` (`gate_proj`, `up_proj` `[I_e, d]`, `down_proj`
    /// `[d, I_e]`, `I_e` = [`LlamaConfig::expert_intermediate_size`]); Qwen2-MoE's trunk ends
    /// with `mlp.shared_expert.{gate,up,down}_proj` (width `shared_expert_intermediate_size`)
    /// and `mlp.shared_expert_gate.weight` `[1, d]`; Qwen3-MoE's and OLMoE's attention has
    /// `q_norm`/`k_norm` after `o_proj` (`[hd]`, OLMoE `[H·hd]` and `[KV·hd]`).
    ///
    /// (`V` vocab, `d` hidden, `H`/`KV` query/key-value heads, `hd` head width, `I`
    /// intermediate, `L` layers.) `gate_proj` and `up_proj` (weights, and biases) are adjacent so
    /// that the model can run them as one `[2I, d]` matmul. Init (transformers'
    /// `_init_weights`): weights and the embedding N(0, `initializer_range`), norms 1, biases 0.
    pub fn units(&self) -> Vec<UnitSpec> {
        let (v, d, i_sz) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let normal = ParamInit::Normal { std: self.initializer_range as f32 };
        let mut units = Vec::with_capacity(self.num_units());

        let mut b = LayoutBuilder::new();
        b.push("model.embed_tokens.weight".into(), vec![v, d], normal);
        units.push(b.finish(0, UnitKind::Embedding, "model.embed_tokens".into()));

        for layer in 0..self.num_hidden_layers {
            let prefix = format!("model.layers.{layer}");
            let mut b = LayoutBuilder::new();
            b.push(format!("{prefix}.input_layernorm.weight"), vec![d], ParamInit::Ones);
            self.push_attention(&mut b, &format!("{prefix}.self_attn"));
            b.push(format!("{prefix}.post_attention_layernorm.weight"), vec![d], ParamInit::Ones);
            if self.is_sparse_layer(layer) {
                let moe = format!("{prefix}.{}", self.moe_prefix());
                b.push(format!("{moe}.gate.weight"), vec![self.num_experts(), d], normal);
                if let Some(s) = self.shared_expert_width() {
                    self.push_mlp(&mut b, &format!("{moe}.shared_expert"), s);
                    b.push(format!("{moe}.shared_expert_gate.weight"), vec![1, d], normal);
                }
                units.push(b.finish(units.len(), UnitKind::MoeTrunk(layer), prefix));
                let e_sz = self.expert_intermediate_size();
                for expert in 0..self.num_experts() {
                    let name = format!("{moe}.experts.{expert}");
                    let mut b = LayoutBuilder::new();
                    if self.family == LlamaFamily::Mixtral {
                        b.push(format!("{name}.w1.weight"), vec![e_sz, d], normal);
                        b.push(format!("{name}.w3.weight"), vec![e_sz, d], normal);
                        b.push(format!("{name}.w2.weight"), vec![d, e_sz], normal);
                    } else {
                        self.push_mlp(&mut b, &name, e_sz);
                    }
                    units.push(b.finish(units.len(), UnitKind::Expert { block: layer, expert }, name));
                }
                continue;
            }
            self.push_mlp(&mut b, &format!("{prefix}.mlp"), i_sz);
            units.push(b.finish(units.len(), UnitKind::Block(layer), prefix));
        }

        let mut b = LayoutBuilder::new();
        b.push("model.norm.weight".into(), vec![d], ParamInit::Ones);
        if !self.tie_word_embeddings {
            b.push("lm_head.weight".into(), vec![v, d], normal);
        }
        units.push(b.finish(units.len(), UnitKind::Head, "head".into()));
        units
    }

    /// The attention's parameters under `prefix` (`model.layers.{i}.self_attn`): q, k, v, o
    /// weights `[out, in]`, each followed by its bias when the config has one. Shared with an
    /// MoE layer, whose attention is the same.
    pub(crate) fn push_attention(&self, b: &mut LayoutBuilder, prefix: &str) {
        let (d, hd) = (self.hidden_size, self.head_dim());
        let (q, kv) = (self.num_attention_heads * hd, self.kv_heads() * hd);
        let normal = ParamInit::Normal { std: self.initializer_range as f32 };
        for (name, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            b.push(format!("{prefix}.{name}.weight"), vec![out, d], normal);
            if self.qkv_bias() {
                b.push(format!("{prefix}.{name}.bias"), vec![out], ParamInit::Zeros);
            }
        }
        b.push(format!("{prefix}.o_proj.weight"), vec![d, q], normal);
        if self.o_bias() {
            b.push(format!("{prefix}.o_proj.bias"), vec![d], ParamInit::Zeros);
        }
        if let Some((qn, kn)) = self.qk_norm_widths() {
            b.push(format!("{prefix}.q_norm.weight"), vec![qn], ParamInit::Ones);
            b.push(format!("{prefix}.k_norm.weight"), vec![kn], ParamInit::Ones);
        }
    }

    /// A SwiGLU MLP's parameters under `prefix` (`model.layers.{i}.mlp`) with hidden width
    /// `inter`: `gate_proj.weight`, `up_proj.weight` `[inter, d]` (then their biases when
    /// `mlp_bias`), `down_proj.weight` `[d, inter]` (then its bias). Shared with MoE experts.
    pub(crate) fn push_mlp(&self, b: &mut LayoutBuilder, prefix: &str, inter: usize) {
        let d = self.hidden_size;
        let normal = ParamInit::Normal { std: self.initializer_range as f32 };
        b.push(format!("{prefix}.gate_proj.weight"), vec![inter, d], normal);
        b.push(format!("{prefix}.up_proj.weight"), vec![inter, d], normal);
        if self.mlp_bias {
            b.push(format!("{prefix}.gate_proj.bias"), vec![inter], ParamInit::Zeros);
            b.push(format!("{prefix}.up_proj.bias"), vec![inter], ParamInit::Zeros);
        }
        b.push(format!("{prefix}.down_proj.weight"), vec![d, inter], normal);
        if self.mlp_bias {
            b.push(format!("{prefix}.down_proj.bias"), vec![d], ParamInit::Zeros);
        }
    }

    /// MoE: the computation groups of an expert's flat vector, `[(0, [2I, d]), (2I·d, [d, I])]`
    /// (`w1` and `w3`, or `gate_proj` and `up_proj`, as one `[2I, d]` gate/up matrix, then the
    /// down projection; `I` the expert width).
    pub(crate) fn expert_groups(&self) -> Vec<(usize, Vec<usize>)> {
        let (d, i) = (self.hidden_size, self.expert_intermediate_size());
        vec![(0, vec![2 * i, d]), (2 * i * d, vec![d, i])]
    }

    /// The computation groups of a decoder layer's flat vector (Mixtral: its trunk's), as `(offset, shape)` in flat
    /// order (they cover it exactly), and where each piece is among them. Every parameter is
    /// its own group but `gate_proj`/`up_proj`, merged into one `[2I, d]` weight (and `[2I]`
    /// bias).
    pub(crate) fn block_groups(&self) -> (Vec<(usize, Vec<usize>)>, BlockGroups) {
        self.layer_groups(self.is_moe())
    }

    /// The computation groups of a dense decoder layer's flat vector (a dense family's layer, or
    /// a dense layer among an MoE family's sparse ones: attention, then the MLP of width
    /// `intermediate_size`), as [`LlamaConfig::block_groups`].
    pub(crate) fn dense_block_groups(&self) -> (Vec<(usize, Vec<usize>)>, BlockGroups) {
        self.layer_groups(false)
    }

    /// [`LlamaConfig::block_groups`] of an MoE trunk (`sparse`) or a dense layer.
    fn layer_groups(&self, sparse: bool) -> (Vec<(usize, Vec<usize>)>, BlockGroups) {
        let (d, hd, inter) = (self.hidden_size, self.head_dim(), self.intermediate_size);
        let (q, kv) = (self.num_attention_heads * hd, self.kv_heads() * hd);
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut offset = 0;
        let mut push = |shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            groups.push((offset, shape));
            offset += n;
            groups.len() - 1
        };
        let qkv_bias = self.qkv_bias();
        let ln1 = push(vec![d]);
        let q_w = push(vec![q, d]);
        let q_b = qkv_bias.then(|| push(vec![q]));
        let k_w = push(vec![kv, d]);
        let k_b = qkv_bias.then(|| push(vec![kv]));
        let v_w = push(vec![kv, d]);
        let v_b = qkv_bias.then(|| push(vec![kv]));
        let o_w = push(vec![d, q]);
        let o_b = self.o_bias().then(|| push(vec![d]));
        let q_norm = self.qk_norm_widths().map(|(qn, _)| push(vec![qn]));
        let k_norm = self.qk_norm_widths().map(|(_, kn)| push(vec![kn]));
        let ln2 = push(vec![d]);
        // An MoE trunk has the router in place of the MLP (gate_up_w and down_w name it).
        let router = sparse.then(|| push(vec![self.num_experts(), d]));
        // Qwen2-MoE: the shared expert's gate/up, down and its sigmoid gate `[1, d]`.
        let shared = self
            .shared_expert_width()
            .filter(|_| sparse)
            .map(|s| (push(vec![2 * s, d]), push(vec![d, s]), push(vec![1, d])));
        let (gate_up_w, gate_up_b, down_w, down_b) = match router {
            Some(r) => (r, None, r, None),
            None => {
                let gate_up_w = push(vec![2 * inter, d]);
                let gate_up_b = self.mlp_bias.then(|| push(vec![2 * inter]));
                let down_w = push(vec![d, inter]);
                let down_b = self.mlp_bias.then(|| push(vec![d]));
                (gate_up_w, gate_up_b, down_w, down_b)
            }
        };
        let idx = BlockGroups {
            ln1,
            q_w,
            q_b,
            k_w,
            k_b,
            v_w,
            v_b,
            o_w,
            o_b,
            q_norm,
            k_norm,
            ln2,
            gate_up_w,
            gate_up_b,
            down_w,
            down_b,
            router,
            shared,
        };
        (groups, idx)
    }

    /// Total number of parameters over all units (a tied embedding counted once).
    pub fn num_params(&self) -> usize {
        self.units().iter().map(|u| u.numel).sum()
    }
}
