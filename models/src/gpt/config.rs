//! [`GptConfig`] and the flat parameter layout of each unit ([`UnitSpec`], [`ParamSpec`]).

use serde::Deserialize;

use crate::unit::{LayoutBuilder, ParamInit, UnitKind, UnitSpec};
use crate::{Error, Result};

/// Hyper-parameters of the byte-level GPT.
///
/// Embedded in the trainer's TOML as the `[model]` table; every field has a default, unknown keys
/// are rejected. Call [`GptConfig::validate`] (or [`super::Gpt::new`], which does) before use.
///
/// ```toml
/// [model]
/// d_model = 192
/// n_layer = 6
/// n_head = 6
/// max_seq_len = 256
/// tied_head = false
///
/// [model.moe]          # optional: MoE feed-forward blocks (see [`MoeConfig`])
/// experts = 8
/// top_k = 2
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptConfig {
    /// Vocabulary size (token ids are `0..vocab_size`). Default: 256 (bytes).
    pub vocab_size: usize,
    /// Width of the residual stream. Must be a multiple of `n_head`. Default: 128.
    pub d_model: usize,
    /// Number of transformer blocks (≥ 1). Default: 4.
    pub n_layer: usize,
    /// Number of attention heads; the head width is `d_model / n_head`. Default: 4.
    pub n_head: usize,
    /// Hidden width of the MLP. Default: `None`, meaning `4 * d_model` (see [`GptConfig::ff_dim`]).
    pub d_ff: Option<usize>,
    /// Longest sequence (rows of the position embedding); inputs may be shorter. Default: 256.
    pub max_seq_len: usize,
    /// Whether the LM head reuses the token embedding `wte` (transposed) instead of its own
    /// `head.weight`. Default: `false` (the head is then self-contained, which keeps the last unit
    /// independent of the first for the runtime).
    pub tied_head: bool,
    /// Epsilon added to the variance in every LayerNorm. Default: `1e-5`.
    pub ln_eps: f64,
    /// Mixture-of-experts feed-forward blocks: when set, **every** block's MLP is replaced by
    /// `moe.experts` expert MLPs behind a softmax top-k router, and each block becomes one trunk
    /// unit plus one unit per expert (see [`GptConfig::units`]). Default: `None` (the dense GPT).
    pub moe: Option<MoeConfig>,
}

impl Default for GptConfig {
    fn default() -> Self {
        Self {
            vocab_size: 256,
            d_model: 128,
            n_layer: 4,
            n_head: 4,
            d_ff: None,
            max_seq_len: 256,
            tied_head: false,
            ln_eps: 1e-5,
            moe: None,
        }
    }
}

/// Mixture-of-experts feed-forward blocks (the `[model.moe]` table): Switch Transformer (Fedus et
/// al. 2021, "Switch Transformers: Scaling to Trillion Parameter Models with Simple and
/// Efficient Sparsity") for `top_k = 1`, GShard (Lepikhin et al. 2020, "GShard: Scaling Giant
/// Models with Conditional Computation and Automatic Sharding") for `top_k = 2`.
///
/// Each token's `ln_2` output `h` goes through a router `probs = softmax(h W_r + b_r)` over
/// `experts` experts; the token is sent to its `top_k` most probable experts (ties to the lower
/// expert index) and the block adds `Σ gate · expert(h)` to the residual stream:
///
/// - **gate**: `top_k = 1`: the raw router probability of the chosen expert (Switch);
///   `top_k = 2`: the probability renormalized over the chosen pair, `p_e / (p_e1 + p_e2)`
///   (GShard), the pair being the one chosen *before* capacity drops.
/// - **capacity** (when `capacity_factor` is set): each expert takes at most
///   `C = ceil(capacity_factor · N · top_k / experts)` tokens per block call (`N = B · T`);
///   the tokens that chose it beyond the first `C`, in token order (flattened `b · T + t`,
///   whatever the slot), are dropped for that slot: that slot adds nothing (the residual
///   passes through), the token's other slot keeps its gate (not renormalized again).
/// - **auxiliary load-balancing loss** per block: `aux = aux_loss_coef · E · Σ_e f_e · P_e`,
///   `f_e` the fraction of the `N` tokens whose top-1 choice is `e` (before capacity drops; a
///   constant for the gradient), `P_e` the mean router probability of `e` over the `N` tokens.
///   The model minimizes `CE + Σ_blocks aux`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoeConfig {
    /// Experts per block, `E ≥ 2`. Default: 8.
    pub experts: usize,
    /// Experts per token, 1 (Switch) or 2 (GShard), at most `experts`. Default: 2.
    pub top_k: usize,
    /// Weight of the load-balancing loss (≥ 0; 0 turns it off). Default: 0.01 (Switch).
    pub aux_loss_coef: f64,
    /// Capacity factor (> 0): expert capacity `ceil(capacity_factor · N · top_k / experts)`
    /// tokens per block call. Default: `None` (no capacity limit, no token dropped).
    pub capacity_factor: Option<f64>,
    /// Hidden width of each expert's MLP. Default: `None`, meaning the dense MLP's
    /// [`GptConfig::ff_dim`].
    pub d_expert: Option<usize>,
}

impl Default for MoeConfig {
    fn default() -> Self {
        Self { experts: 8, top_k: 2, aux_loss_coef: 0.01, capacity_factor: None, d_expert: None }
    }
}

impl MoeConfig {
    /// Expert capacity in tokens for a block call over `num_tokens` tokens:
    /// `ceil(capacity_factor · num_tokens · top_k / experts)` (at least 1), or `None` without a
    /// capacity factor.
    pub fn capacity(&self, num_tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|cf| {
            let c = (cf * (num_tokens * self.top_k) as f64 / self.experts as f64).ceil();
            (c as usize).max(1)
        })
    }
}

/// Index of each parameter inside a block unit's `params`.
pub(super) mod block_idx {
    pub const LN1_W: usize = 0;
    pub const LN1_B: usize = 1;
    pub const QKV_W: usize = 2;
    pub const QKV_B: usize = 3;
    pub const PROJ_W: usize = 4;
    pub const PROJ_B: usize = 5;
    pub const LN2_W: usize = 6;
    pub const LN2_B: usize = 7;
    pub const FC_W: usize = 8;
    pub const FC_B: usize = 9;
    pub const FC2_W: usize = 10;
    pub const FC2_B: usize = 11;
    /// MoE trunk: router weight `[d, E]` (replaces the MLP).
    pub const ROUTER_W: usize = 8;
    /// MoE trunk: router bias `[E]`.
    pub const ROUTER_B: usize = 9;
}

/// Index of each parameter inside an expert unit's `params`.
pub(super) mod expert_idx {
    pub const FC_W: usize = 0;
    pub const FC_B: usize = 1;
    pub const PROJ_W: usize = 2;
    pub const PROJ_B: usize = 3;
}

/// Standard deviation of GPT-2's weight init.
const INIT_STD: f32 = 0.02;

impl GptConfig {
    /// Hidden width of the MLP: `d_ff`, or `4 * d_model` when unset.
    pub fn ff_dim(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }

    /// Width of one attention head: `d_model / n_head`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Hidden width of each expert's MLP (MoE): `moe.d_expert`, else [`GptConfig::ff_dim`].
    pub fn expert_dim(&self) -> usize {
        self.moe.as_ref().and_then(|m| m.d_expert).unwrap_or_else(|| self.ff_dim())
    }

    /// Experts per block: `moe.experts`, 0 for the dense model.
    pub fn num_experts(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| m.experts)
    }

    /// Number of units: `n_layer + 2` for the dense model (embedding, blocks, head);
    /// `n_layer · (1 + E) + 2` with MoE (embedding, per block a trunk and `E` experts, head).
    pub fn num_units(&self) -> usize {
        self.n_layer * (1 + self.num_experts()) + 2
    }

    /// Unit index of block `block`: the dense block, or the MoE trunk, `1 + block · (1 + E)`.
    pub fn block_unit(&self, block: usize) -> usize {
        1 + block * (1 + self.num_experts())
    }

    /// Unit index of expert `expert` of block `block` (MoE): `block_unit(block) + 1 + expert`.
    pub fn expert_unit(&self, block: usize, expert: usize) -> usize {
        self.block_unit(block) + 1 + expert
    }

    /// Unit index of the head: `num_units() - 1`.
    pub fn head_unit(&self) -> usize {
        self.num_units() - 1
    }

    /// Checks every constraint in one place.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first offending key (`model.<field>`) and the fix.
    pub fn validate(&self) -> Result<()> {
        let cfg = |field: &'static str, reason: String| Err(Error::Config { field, reason });
        let positive = [
            ("model.vocab_size", self.vocab_size),
            ("model.d_model", self.d_model),
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.max_seq_len", self.max_seq_len),
        ];
        for (field, v) in positive {
            if v == 0 {
                return cfg(field, "must be at least 1".into());
            }
        }
        if self.vocab_size > u32::MAX as usize {
            return cfg("model.vocab_size", format!("{} does not fit token ids of type u32", self.vocab_size));
        }
        if self.d_model % self.n_head != 0 {
            return cfg(
                "model.n_head",
                format!("must divide model.d_model = {} (got n_head = {}); pick a divisor", self.d_model, self.n_head),
            );
        }
        if self.d_ff == Some(0) {
            return cfg("model.d_ff", "must be at least 1 (or leave it out for 4 * d_model)".into());
        }
        if !(self.ln_eps.is_finite() && self.ln_eps > 0.0) {
            return cfg("model.ln_eps", format!("must be a positive finite number, got {}", self.ln_eps));
        }
        if let Some(moe) = &self.moe {
            if moe.experts < 2 {
                return cfg("model.moe.experts", format!("must be at least 2, got {}", moe.experts));
            }
            if !(1..=2).contains(&moe.top_k) || moe.top_k > moe.experts {
                return cfg(
                    "model.moe.top_k",
                    format!("must be 1 (Switch) or 2 (GShard) and at most model.moe.experts, got {}", moe.top_k),
                );
            }
            if !(moe.aux_loss_coef.is_finite() && moe.aux_loss_coef >= 0.0) {
                return cfg(
                    "model.moe.aux_loss_coef",
                    format!("must be a finite number >= 0 (0 turns the loss off), got {}", moe.aux_loss_coef),
                );
            }
            if let Some(cf) = moe.capacity_factor {
                if !(cf.is_finite() && cf > 0.0) {
                    return cfg(
                        "model.moe.capacity_factor",
                        format!("must be a positive finite number (or leave it out for no limit), got {cf}"),
                    );
                }
            }
            if moe.d_expert == Some(0) {
                return cfg("model.moe.d_expert", "must be at least 1 (or leave it out for model.d_ff)".into());
            }
        }
        Ok(())
    }

    /// The units in forward order with their flat layouts: `[embed, blocks.0, .., blocks.{L-1}, head]`.
    ///
    /// | unit | parameters (shape) |
    /// |---|---|
    /// | `embed` | `wte.weight` `[V, d]`, `wpe.weight` `[S, d]` |
    /// | `blocks.i` | `ln_1.{weight,bias}` `[d]`, `attn.qkv.weight` `[d, 3d]`, `attn.qkv.bias` `[3d]`, `attn.proj.weight` `[d, d]`, `attn.proj.bias` `[d]`, `ln_2.{weight,bias}` `[d]`, `mlp.fc.weight` `[d, f]`, `mlp.fc.bias` `[f]`, `mlp.proj.weight` `[f, d]`, `mlp.proj.bias` `[d]` |
    /// | `head` | `ln_f.{weight,bias}` `[d]`, and unless `tied_head`: `head.weight` `[d, V]` |
    ///
    /// With `moe` set, block `i` is instead a trunk unit `blocks.{i}` ([`UnitKind::MoeTrunk`])
    /// followed by its `E` expert units `blocks.{i}.experts.{e}` ([`UnitKind::Expert`]):
    ///
    /// | unit | parameters (shape) |
    /// |---|---|
    /// | `blocks.i` (trunk) | `ln_1`, `attn.qkv`, `attn.proj`, `ln_2` as above, `router.weight` `[d, E]`, `router.bias` `[E]` |
    /// | `blocks.i.experts.e` | `fc.weight` `[d, f_e]`, `fc.bias` `[f_e]`, `proj.weight` `[f_e, d]`, `proj.bias` `[d]` (`f_e` = [`GptConfig::expert_dim`]) |
    ///
    /// so the unit order is `[embed, blocks.0, blocks.0.experts.0, .., blocks.0.experts.{E-1},
    /// blocks.1, .., head]` (indices from [`GptConfig::block_unit`] and
    /// [`GptConfig::expert_unit`]).
    ///
    /// Block parameter names carry the prefix `blocks.{i}.`. The layout does not depend on
    /// validation, but it is only meaningful for a valid config.
    pub fn units(&self) -> Vec<UnitSpec> {
        let (v, d, f, s) = (self.vocab_size, self.d_model, self.ff_dim(), self.max_seq_len);
        let normal = ParamInit::Normal { std: INIT_STD };
        // GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) (two per block).
        let resid = ParamInit::Normal { std: INIT_STD / ((2 * self.n_layer.max(1)) as f32).sqrt() };
        let mut units = Vec::with_capacity(self.num_units());

        let mut b = LayoutBuilder::new();
        b.push("wte.weight".into(), vec![v, d], normal);
        b.push("wpe.weight".into(), vec![s, d], normal);
        units.push(b.finish(0, UnitKind::Embedding, "embed".into()));

        for i in 0..self.n_layer {
            let mut b = LayoutBuilder::new();
            let n = |suffix: &str| format!("blocks.{i}.{suffix}");
            b.push(n("ln_1.weight"), vec![d], ParamInit::Ones);
            b.push(n("ln_1.bias"), vec![d], ParamInit::Zeros);
            b.push(n("attn.qkv.weight"), vec![d, 3 * d], normal);
            b.push(n("attn.qkv.bias"), vec![3 * d], ParamInit::Zeros);
            b.push(n("attn.proj.weight"), vec![d, d], resid);
            b.push(n("attn.proj.bias"), vec![d], ParamInit::Zeros);
            b.push(n("ln_2.weight"), vec![d], ParamInit::Ones);
            b.push(n("ln_2.bias"), vec![d], ParamInit::Zeros);
            let Some(moe) = &self.moe else {
                b.push(n("mlp.fc.weight"), vec![d, f], normal);
                b.push(n("mlp.fc.bias"), vec![f], ParamInit::Zeros);
                b.push(n("mlp.proj.weight"), vec![f, d], resid);
                b.push(n("mlp.proj.bias"), vec![d], ParamInit::Zeros);
                units.push(b.finish(units.len(), UnitKind::Block(i), format!("blocks.{i}")));
                continue;
            };
            let e_count = moe.experts;
            b.push(n("router.weight"), vec![d, e_count], normal);
            b.push(n("router.bias"), vec![e_count], ParamInit::Zeros);
            units.push(b.finish(units.len(), UnitKind::MoeTrunk(i), format!("blocks.{i}")));
            let fe = self.expert_dim();
            for e in 0..e_count {
                let mut b = LayoutBuilder::new();
                let n = |suffix: &str| format!("blocks.{i}.experts.{e}.{suffix}");
                b.push(n("fc.weight"), vec![d, fe], normal);
                b.push(n("fc.bias"), vec![fe], ParamInit::Zeros);
                b.push(n("proj.weight"), vec![fe, d], resid);
                b.push(n("proj.bias"), vec![d], ParamInit::Zeros);
                let kind = UnitKind::Expert { block: i, expert: e };
                units.push(b.finish(units.len(), kind, format!("blocks.{i}.experts.{e}")));
            }
        }

        let mut b = LayoutBuilder::new();
        b.push("ln_f.weight".into(), vec![d], ParamInit::Ones);
        b.push("ln_f.bias".into(), vec![d], ParamInit::Zeros);
        if !self.tied_head {
            b.push("head.weight".into(), vec![d, v], normal);
        }
        units.push(b.finish(units.len(), UnitKind::Head, "head".into()));
        units
    }

    /// Total number of parameters over all units (a tied `wte` counted once).
    pub fn num_params(&self) -> usize {
        self.units().iter().map(|u| u.numel).sum()
    }
}
