//! [`GptConfig`] and the flat parameter layout of each unit ([`UnitSpec`], [`ParamSpec`]).

use serde::Deserialize;

use super::{Error, Result};

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
        }
    }
}

/// Which part of the model a unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnitKind {
    /// Unit 0: token embedding `wte` and position embedding `wpe`.
    Embedding,
    /// Units `1..=n_layer`: transformer block `i` (0-based layer index, unit index `i + 1`).
    Block(usize),
    /// Unit `n_layer + 1`: final LayerNorm and the LM head.
    Head,
}

/// How [`super::init_unit`] fills a parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// Normal distribution with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// All zeros (biases, LayerNorm bias).
    Zeros,
    /// All ones (LayerNorm weight).
    Ones,
}

/// One parameter inside a unit's flat vector.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Full name, usable as a safetensors key, e.g. `blocks.3.attn.qkv.weight`.
    pub name: String,
    /// Shape, row-major. Linear weights are `[in, out]` (GPT-2's `Conv1D` layout: `y = x W + b`).
    pub shape: Vec<usize>,
    /// Offset of the first element in the unit's flat vector, in elements.
    pub offset: usize,
    /// Initialisation rule.
    pub init: ParamInit,
}

impl ParamSpec {
    /// Number of elements (product of `shape`).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The flat layout of one unit: its parameters, back to back, in one vector of `numel` elements.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitSpec {
    /// Position of the unit in the forward order (`0..n_layer + 2`).
    pub index: usize,
    /// What the unit is.
    pub kind: UnitKind,
    /// Name prefix of the unit: `embed`, `blocks.{i}`, `head`.
    pub name: String,
    /// Parameters in flat order; `params[k].offset == sum of numel of params[..k]`.
    pub params: Vec<ParamSpec>,
    /// Total elements of the flat vector.
    pub numel: usize,
}

impl UnitSpec {
    /// The parameter named `name` (full name), if the unit has it.
    pub fn param(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name == name)
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
}

/// Standard deviation of GPT-2's weight init.
const INIT_STD: f32 = 0.02;

struct LayoutBuilder {
    params: Vec<ParamSpec>,
    offset: usize,
}

impl LayoutBuilder {
    fn new() -> Self {
        Self { params: Vec::new(), offset: 0 }
    }

    fn push(&mut self, name: String, shape: Vec<usize>, init: ParamInit) {
        let p = ParamSpec { name, shape, offset: self.offset, init };
        self.offset += p.numel();
        self.params.push(p);
    }

    fn finish(self, index: usize, kind: UnitKind, name: String) -> UnitSpec {
        UnitSpec { index, kind, name, params: self.params, numel: self.offset }
    }
}

impl GptConfig {
    /// Hidden width of the MLP: `d_ff`, or `4 * d_model` when unset.
    pub fn ff_dim(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }

    /// Width of one attention head: `d_model / n_head`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Number of units: `n_layer + 2` (embedding, blocks, head).
    pub fn num_units(&self) -> usize {
        self.n_layer + 2
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
            b.push(n("mlp.fc.weight"), vec![d, f], normal);
            b.push(n("mlp.fc.bias"), vec![f], ParamInit::Zeros);
            b.push(n("mlp.proj.weight"), vec![f, d], resid);
            b.push(n("mlp.proj.bias"), vec![d], ParamInit::Zeros);
            units.push(b.finish(i + 1, UnitKind::Block(i), format!("blocks.{i}")));
        }

        let mut b = LayoutBuilder::new();
        b.push("ln_f.weight".into(), vec![d], ParamInit::Ones);
        b.push("ln_f.bias".into(), vec![d], ParamInit::Zeros);
        if !self.tied_head {
            b.push("head.weight".into(), vec![d, v], normal);
        }
        units.push(b.finish(self.n_layer + 1, UnitKind::Head, "head".into()));
        units
    }

    /// Total number of parameters over all units (a tied `wte` counted once).
    pub fn num_params(&self) -> usize {
        self.units().iter().map(|u| u.numel).sum()
    }
}
