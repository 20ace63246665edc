//! What every model family shares: the unit of residency and its flat parameter layout
//! ([`UnitKind`], [`UnitSpec`], [`ParamSpec`]), and the deterministic initialisation of a
//! unit's flat vector from its layout ([`init_unit`], [`init_unit_from_seed`], [`init_params`]).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

/// Which part of the model a unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnitKind {
    /// Unit 0: the token embedding (GPT: `wte` and the position embedding `wpe`; Llama:
    /// `model.embed_tokens`).
    Embedding,
    /// Dense model only: transformer block / decoder layer `i` (0-based layer index, unit index
    /// `i + 1`).
    Block(usize),
    /// MoE model only: the trunk of block `i` (0-based layer index): `ln_1`, attention, `ln_2`
    /// and the router; unit index [`GptConfig::block_unit`](crate::GptConfig::block_unit)`(i)`.
    MoeTrunk(usize),
    /// MoE model only: expert `expert` of block `block`, an MLP `[d] → [d_expert] → [d]`;
    /// unit index [`GptConfig::expert_unit`](crate::GptConfig::expert_unit)`(block, expert)`.
    Expert {
        /// 0-based layer index.
        block: usize,
        /// 0-based expert index within the block.
        expert: usize,
    },
    /// The last unit (`n_layer + 1` when dense): the final norm and the LM head.
    Head,
}

/// How [`init_unit`] fills a parameter.
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
    /// Shape, row-major. Linear weights are `[in, out]` in the GPT (GPT-2's `Conv1D` layout:
    /// `y = x W + b`) and `[out, in]` in the Llama family (`torch.nn.Linear`'s, as Hugging Face
    /// checkpoints store them: `y = x Wᵀ + b`).
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
    /// Position of the unit in the forward order (`0..` the model's number of units).
    pub index: usize,
    /// What the unit is.
    pub kind: UnitKind,
    /// Name prefix of the unit: GPT `embed`, `blocks.{i}`, `blocks.{i}.experts.{e}`, `head`;
    /// Llama `model.embed_tokens`, `model.layers.{i}`, `head`.
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

/// Builds a [`UnitSpec`] parameter by parameter, offsets back to back.
#[derive(Debug, Default)]
pub(crate) struct LayoutBuilder {
    params: Vec<ParamSpec>,
    offset: usize,
}

impl LayoutBuilder {
    pub(crate) fn new() -> Self {
        Self { params: Vec::new(), offset: 0 }
    }

    pub(crate) fn push(&mut self, name: String, shape: Vec<usize>, init: ParamInit) {
        let p = ParamSpec { name, shape, offset: self.offset, init };
        self.offset += p.numel();
        self.params.push(p);
    }

    pub(crate) fn finish(self, index: usize, kind: UnitKind, name: String) -> UnitSpec {
        UnitSpec { index, kind, name, params: self.params, numel: self.offset }
    }
}

/// Fills one unit's flat vector (`unit.numel` f32 elements, layout of [`UnitSpec::params`]) by
/// each parameter's [`ParamSpec::init`] rule: `Normal { std }` draws N(0, std), `Zeros` and
/// `Ones` fill. Parameters are drawn in layout order, element by element, so the result depends
/// only on `rng`'s state. (The GPT's rules are GPT-2's: [`crate::gpt::GptConfig::units`]; the
/// Llama family's are transformers' `_init_weights`: [`crate::LlamaConfig::units`].)
pub fn init_unit<R: Rng + ?Sized>(unit: &UnitSpec, rng: &mut R) -> Vec<f32> {
    let mut flat = vec![0f32; unit.numel];
    for p in &unit.params {
        let dst = &mut flat[p.offset..p.offset + p.numel()];
        match p.init {
            ParamInit::Zeros => {}
            ParamInit::Ones => dst.fill(1.0),
            ParamInit::Normal { std } => {
                // std > 0 always: it is a positive constant divided by a positive number.
                let normal = Normal::new(0f32, std).expect("positive finite std");
                for x in dst {
                    *x = normal.sample(rng);
                }
            }
        }
    }
    flat
}

/// Initialises one unit from a run seed: a [`ChaCha8Rng`] seeded with `seed` on stream
/// `unit.index`, so each unit can be initialised alone (e.g. straight into its home tier)
/// and the result does not depend on the order units are initialised in.
pub fn init_unit_from_seed(unit: &UnitSpec, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(unit.index as u64);
    init_unit(unit, &mut rng)
}

/// All units' flat vectors in unit order, each from [`init_unit_from_seed`].
pub fn init_params(units: &[UnitSpec], seed: u64) -> Vec<Vec<f32>> {
    units.iter().map(|u| init_unit_from_seed(u, seed)).collect()
}
