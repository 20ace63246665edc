//! The model a plan is for: the units of a byte-level GPT from its shape ([`GptShape`],
//! [`FeedForward`], [`model_units`]: parameters and forward FLOPs by formula) or of a config's
//! own model ([`PlannedModel::of_model`]).

use oogc_models::{CausalLm, UnitKind};
use oogc_moe_placement::Placement;
use oogc_prefetch::plan::ModelUnit;
use oogc_swapper::DType;
use serde::Serialize;

use super::PlanError;

/// Byte-level vocabulary of the reference GPT.
pub const VOCAB: u64 = 256;

/// The shape of a GPT for planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GptShape {
    /// Transformer blocks.
    pub layers: u64,
    /// Model width `d`.
    pub d_model: u64,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Sequences per step.
    pub batch: u64,
    /// Bytes per element of the compute copy (2 for bf16, 4 for f32).
    pub dtype_bytes: u64,
}

/// The feed-forward half of every block, for planning.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FeedForward {
    /// A dense MLP `d → d_ff → d`; `None`: GPT-2's `4 · d`.
    Dense {
        /// Hidden width.
        d_ff: Option<u64>,
    },
    /// Mixture of experts behind a top-k router (see [`MoePlan`]).
    Moe(MoePlan),
}

impl Default for FeedForward {
    /// The dense GPT-2 MLP (`d_ff = 4 · d`).
    fn default() -> Self {
        Self::Dense { d_ff: None }
    }
}

/// The MoE blocks of a model and where their experts run, for planning.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoePlan {
    /// Experts per block.
    pub experts: u64,
    /// Experts per token.
    pub top_k: u64,
    /// Hidden width of each expert's MLP.
    pub d_expert: u64,
    /// Where each expert runs, `placements[block][expert]`: [`Placement::Resident`] (hot: on
    /// the device), [`Placement::Fetch`] (cold, copied H2D when used), [`Placement::Cpu`] (cold,
    /// computed from its host copy: nothing moves), [`Placement::Skip`] (no tokens: no unit).
    pub placements: Vec<Vec<Placement>>,
}

impl MoePlan {
    /// Experts placed `p`, all blocks together.
    pub fn count(&self, p: Placement) -> usize {
        self.placements.iter().flatten().filter(|&&q| q == p).count()
    }
}

/// Parameters of a dense block with an MLP of width `d_ff`: ln1 `2d`, qkv `3d² + 3d`, proj
/// `d² + d`, ln2 `2d`, fc `d·d_ff + d_ff`, fc2 `d_ff·d + d` (`12d² + 13d` for `d_ff = 4d`).
pub fn dense_block_params(d: u64, d_ff: u64) -> u64 {
    4 * d * d + 2 * d * d_ff + 9 * d + d_ff
}

/// Parameters of an MoE block's trunk: ln1 `2d`, qkv `3d² + 3d`, proj `d² + d`, ln2 `2d`,
/// router `d·E + E`.
pub fn moe_trunk_params(d: u64, experts: u64) -> u64 {
    4 * d * d + 8 * d + d * experts + experts
}

/// Parameters of one expert: fc `d·f + f`, proj `f·d + d`.
pub fn expert_params(d: u64, d_expert: u64) -> u64 {
    2 * d * d_expert + d_expert + d
}

/// Forward FLOPs of a block's attention scores and weighted sum over `tokens` tokens of
/// sequences of `seq_len`: `4 · seq_len · d · tokens` (causal masking not halved).
pub fn attention_forward_flops(seq_len: u64, d: u64, tokens: u64) -> f64 {
    4.0 * (seq_len * d) as f64 * tokens as f64
}

/// The units of a dense byte-level GPT (vocabulary [`VOCAB`], MLP `4d`) in forward order:
/// [`model_units`] with [`FeedForward::default`].
///
/// | unit | parameters |
/// |---|---|
/// | `embedding` | token `256·d` + position `seq·d` |
/// | `block.i` | [`dense_block_params`] (`12d² + 13d`) |
/// | `head` | final LayerNorm `2d` + untied output `256·d` (no bias, as the model) |
///
/// FLOPs as in the [`crate::plan`] docs. Approximate, documented: good to the ~10% a plan needs.
pub fn gpt_units(s: &GptShape) -> Vec<ModelUnit> {
    model_units(s, &FeedForward::default()).expect("a dense model has no placement to check")
}

/// The units of a byte-level GPT in forward order, with parameter counts, bytes and forward
/// FLOPs ([`crate::plan`]'s docs):
///
/// | unit | parameters | forward FLOPs |
/// |---|---|---|
/// | `embedding` | token `256·d` + position `seq·d` | 0 |
/// | dense `block.i` | [`dense_block_params`] | `2·params·N` + [`attention_forward_flops`] |
/// | MoE `block.i` (trunk) | [`moe_trunk_params`] | `2·params·N` + [`attention_forward_flops`] |
/// | MoE `block.i.expert.e` | [`expert_params`] | `2·params·N·top_k/E` |
/// | `head` | final LayerNorm `2d` + untied output `256·d` (no bias) | `2·256·d·N` |
///
/// MoE experts placed [`Placement::Cpu`] are [`ModelUnit::host_compute`] units; experts placed
/// [`Placement::Skip`] are left out (they compute nothing; their state is not updated).
///
/// # Errors
/// An MoE plan whose placements are not `layers × experts`.
pub fn model_units(s: &GptShape, ff: &FeedForward) -> Result<Vec<ModelUnit>, PlanError> {
    let d = s.d_model;
    let tokens = s.seq_len * s.batch;
    let unit = |name: String, numel: u64, flops: f64| ModelUnit {
        name,
        numel,
        compute_bytes: numel * s.dtype_bytes,
        forward_flops: flops,
        host_compute: false,
    };
    let attention = attention_forward_flops(s.seq_len, d, tokens);
    let mut units = Vec::with_capacity(s.layers as usize + 2);
    units.push(unit("embedding".into(), VOCAB * d + s.seq_len * d, 0.0));
    match ff {
        FeedForward::Dense { d_ff } => {
            let block = dense_block_params(d, d_ff.unwrap_or(4 * d));
            for i in 0..s.layers {
                units.push(unit(format!("block.{i}"), block, 2.0 * (block * tokens) as f64 + attention));
            }
        }
        FeedForward::Moe(m) => {
            if m.placements.len() as u64 != s.layers || m.placements.iter().any(|b| b.len() as u64 != m.experts) {
                return Err(PlanError::Shape(format!(
                    "the MoE placement must be {} blocks x {} experts (got {} blocks)",
                    s.layers,
                    m.experts,
                    m.placements.len()
                )));
            }
            let trunk = moe_trunk_params(d, m.experts);
            let expert = expert_params(d, m.d_expert);
            let expert_flops = 2.0 * expert as f64 * tokens as f64 * m.top_k as f64 / m.experts.max(1) as f64;
            for (i, block) in m.placements.iter().enumerate() {
                units.push(unit(format!("block.{i}"), trunk, 2.0 * (trunk * tokens) as f64 + attention));
                for (e, p) in block.iter().enumerate() {
                    if *p == Placement::Skip {
                        continue;
                    }
                    let mut u = unit(format!("block.{i}.expert.{e}"), expert, expert_flops);
                    u.host_compute = *p == Placement::Cpu;
                    units.push(u);
                }
            }
        }
    }
    let head = 2 * d + VOCAB * d;
    units.push(unit("head".into(), head, 2.0 * (VOCAB * d) as f64 * tokens as f64));
    Ok(units)
}

/// The model a plan is made for: a one-line description, its units in forward order (sizes
/// and FLOPs) and, for MoE, where each expert runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlannedModel {
    /// One line describing the model (`GPT byte-vocab, 8 layers, ...`, `llama, 6 layers, ...`).
    pub description: String,
    /// Its units in forward order.
    pub units: Vec<ModelUnit>,
    /// MoE: where each expert runs, `[block][expert]` (under uniform routing; `block` the MoE
    /// block's number, the sparse layers in order); empty for a dense model.
    pub placements: Vec<Vec<Placement>>,
}

impl PlannedModel {
    /// A byte-level GPT of `shape` with `ff` blocks ([`model_units`]): the shape-only plan of
    /// `oogc plan --layers .. --d-model ..`.
    ///
    /// # Errors
    /// A zero dimension; an MoE placement of the wrong shape.
    pub fn gpt(shape: &GptShape, ff: &FeedForward) -> Result<Self, PlanError> {
        if shape.layers == 0 || shape.d_model == 0 || shape.seq_len == 0 || shape.batch == 0 {
            return Err(PlanError::Shape("--layers, --d-model, --seq-len and --batch must be > 0".into()));
        }
        let ffs = match ff {
            FeedForward::Dense { d_ff } => format!("MLP {}", d_ff.unwrap_or(4 * shape.d_model)),
            FeedForward::Moe(m) => format!("MoE {} experts top-{} of width {}", m.experts, m.top_k, m.d_expert),
        };
        let description = format!(
            "GPT byte-vocab, {} layers, d_model {}, {ffs}, seq {} x batch {}",
            shape.layers, shape.d_model, shape.seq_len, shape.batch
        );
        let placements = match ff {
            FeedForward::Moe(m) => m.placements.clone(),
            FeedForward::Dense { .. } => Vec::new(),
        };
        Ok(Self { description, units: model_units(shape, ff)?, placements })
    }

    /// The model of a training config, its units taken from the model itself (`oogc-models`:
    /// sizes from the unit layouts, FLOPs from [`CausalLm::forward_flops`]) with compute copies
    /// of `dtype` (`[train] compute_dtype`), `batch × seq_len` tokens per step, MoE experts placed by
    /// [`moe_placement`](super::moe_placement) with `top_k / experts` of the tokens each (uniform routing); experts
    /// placed [`Placement::Cpu`] are [`ModelUnit::host_compute`] units, [`Placement::Skip`]
    /// ones are left out.
    pub fn of_model(
        model: &dyn CausalLm,
        family: &str,
        dtype: DType,
        batch: usize,
        seq_len: usize,
        top_k: usize,
        placements: Vec<Vec<Placement>>,
    ) -> Self {
        let tokens = batch * seq_len;
        let mut units = Vec::with_capacity(model.units().len());
        let mut experts_per_block = 0;
        // `placements[b]` is the b-th MoE block's (the sparse layers in order).
        let mut moe_blocks: Vec<usize> = model
            .units()
            .iter()
            .filter_map(|u| match u.kind {
                UnitKind::Expert { block, .. } => Some(block),
                _ => None,
            })
            .collect();
        moe_blocks.dedup();
        for (k, u) in model.units().iter().enumerate() {
            let mut unit = ModelUnit {
                name: u.name.clone(),
                numel: u.numel as u64,
                compute_bytes: dtype.num_bytes(u.numel) as u64,
                forward_flops: model.forward_flops(k, tokens, seq_len),
                host_compute: false,
            };
            if let UnitKind::Expert { block, expert } = u.kind {
                experts_per_block = experts_per_block.max(expert + 1);
                let experts = model
                    .units()
                    .iter()
                    .filter(|s| matches!(s.kind, UnitKind::Expert { block: b, .. } if b == block))
                    .count();
                let ordinal = moe_blocks.iter().position(|&b| b == block).expect("an expert's block");
                let placement =
                    placements.get(ordinal).and_then(|b| b.get(expert)).copied().unwrap_or(Placement::Fetch);
                if placement == Placement::Skip {
                    continue;
                }
                unit.forward_flops = model.forward_flops(k, tokens * top_k / experts.max(1), seq_len);
                unit.host_compute = placement == Placement::Cpu;
            }
            units.push(unit);
        }
        let blocks =
            model.units().iter().filter(|u| matches!(u.kind, UnitKind::Block(_) | UnitKind::MoeTrunk(_))).count();
        let params: usize = model.units().iter().map(|u| u.numel).sum();
        let moe = if experts_per_block > 0 {
            format!(", MoE {experts_per_block} experts top-{top_k}")
        } else {
            String::new()
        };
        let description = format!(
            "{family}, {blocks} blocks{moe}, vocab {}, {:.2} M params, seq {seq_len} x batch {batch}",
            model.vocab_size(),
            params as f64 / 1e6
        );
        Self { description, units, placements }
    }

    /// Experts placed `p`, all blocks together.
    pub fn count(&self, p: Placement) -> usize {
        self.placements.iter().flatten().filter(|&&q| q == p).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_units_match_the_formula() {
        let s = GptShape { layers: 2, d_model: 64, seq_len: 32, batch: 4, dtype_bytes: 2 };
        let u = gpt_units(&s);
        assert_eq!(u.len(), 4);
        assert_eq!(u[0].numel, 256 * 64 + 32 * 64);
        assert_eq!(u[1].numel, 12 * 64 * 64 + 13 * 64);
        assert_eq!(u[3].numel, 2 * 64 + 256 * 64);
        assert_eq!(u[1].compute_bytes, 2 * u[1].numel);
    }

    #[test]
    fn a_bad_moe_placement_is_refused() {
        let s = GptShape { layers: 2, d_model: 32, seq_len: 8, batch: 1, dtype_bytes: 4 };
        let ff =
            FeedForward::Moe(MoePlan { experts: 4, top_k: 2, d_expert: 64, placements: vec![vec![Placement::Cpu; 4]] });
        assert!(model_units(&s, &ff).unwrap_err().to_string().contains("2 blocks x 4 experts"));
    }
}
