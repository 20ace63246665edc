//! `oogc-moe-placement`: where the experts of a Mixture-of-Experts model live and run.
//!
//! # Example
//!
//! One MoE block of four 1 MiB experts and a GPU expert budget of 2 MiB: after a few steps of
//! routing, the two busiest experts are made resident; each step's placement follows.
//!
//! ```
//! use oogc_moe_placement::{ExpertId, ExpertShape, Placement, Placer, PlacerConfig};
//!
//! let shape = ExpertShape { param_bytes: 1 << 20, grad_bytes: 1 << 20, flops_per_token: 8e6 };
//! let mut placer = Placer::new(1, 4, shape, PlacerConfig::new(2 << 20))?; // 1 block, 4 experts
//! let tokens = [900, 1, 0, 300]; // tokens the router sent to each expert
//! for step in 0..5 {
//!     placer.observe_routing(step, 0, &tokens)?;
//! }
//! let change = placer.replan(); // between steps
//! assert_eq!(change.admit, vec![ExpertId::new(0, 0), ExpertId::new(0, 3)]);
//! assert_eq!(
//!     placer.place_block(0, &tokens)?,
//!     [Placement::Resident, Placement::Cpu, Placement::Skip, Placement::Resident]
//! );
//! # Ok::<(), oogc_moe_placement::Error>(())
//! ```
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | popularity | [`PopularityStats`], [`StatsHandle`] | per block and expert, moving averages of routed tokens and of use, plus recency |
//! | hot set | [`HotSet`], [`HotSetChange`] | the experts kept resident on the GPU under an expert byte budget, re-placed between steps with hysteresis |
//! | compute placement | [`CostModel`], [`Placement`] | per cold expert and step: fetch, or compute on the CPU (Fiddler), by a calibrated, online-corrected cost model |
//! | eviction fallback | [`PopularityFallback`] | the swapper `EvictionPolicy` that ranks expert copies by popularity, for `NextUsePolicy::with_fallback` |
//! | routing traces | [`RoutingTraceWriter`], [`read_trace`], [`synthetic_trace`] | `oogc-routing-1` JSON Lines: what the router chose, for replay (`oogc bench moe`) |
//! | routing skew | [`PopularityProfile`] | a trace's share of assignments by popularity rank, carried over to another expert count (`oogc plan --routing-trace`) |
//! | facade | [`Placer`] | the statistics, hot set and cost model of one model, as the trainer uses them |
//!
//! Sources: routing by a softmax router with top-k selection (Switch Transformer, Fedus et al.
//! 2021; GShard, Lepikhin et al. 2020); activation-aware expert caching (MoE-Infinity, Xue et
//! al. 2024); CPU compute of cold experts (Fiddler, Kamahori et al. 2024).
//!
//! A step with the trainer:
//!
//! ```text
//! for each MoE block b:  router -> tokens[e]
//!                        placer.place_block(b, &tokens) -> Resident | Fetch | Cpu | Skip per expert
//!                        placer.observe_routing(step, b, &tokens)
//!                        (measured times -> placer.cost_model_mut().observe_cpu / observe_fetch)
//! between steps:         placer.replan() -> HotSetChange { admit (upload), evict (drop device copy) }
//! ```
//!
//! Pure decision code: no CUDA types, no candle; the only I/O is the trace reader and writer.
#![forbid(unsafe_code)]

pub mod cost;
pub mod error;
pub mod fallback;
pub mod hotset;
pub mod profile;
pub mod stats;
pub mod synthetic;
pub mod trace;

pub use cost::{calibrate_cpu_gemm, BlockCost, ColdMode, CostModel, CostModelConfig, ExpertShape, Placement};
pub use error::{Error, Result};
pub use fallback::PopularityFallback;
pub use hotset::{HotSet, HotSetChange, HotSetConfig};
pub use oogc_swapper::TensorId;
pub use profile::PopularityProfile;
pub use stats::{ExpertId, ExpertStats, PopularityStats, StatsHandle};
pub use synthetic::{synthetic_trace, SyntheticConfig};
pub use trace::{
    read_trace, read_trace_file, RoutingRecord, RoutingTrace, RoutingTraceWriter, TraceHeader, TRACE_FORMAT,
};

/// Settings of a [`Placer`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlacerConfig {
    /// EMA decay of the popularity statistics, `[0, 1)`. Default: 0.9.
    pub decay: f64,
    /// The hot set (budget, margin, horizon, CPU compute).
    pub hot_set: HotSetConfig,
    /// The cost model's start-up figures.
    pub cost: CostModelConfig,
    /// GPU bytes one hot expert holds, counted against the hot set's budget: `None`, its
    /// compute copy (`shape.param_bytes`); more when a hot expert keeps its optimizer on the
    /// device too (the `oogc` runtime's device optimizers: 16 B per parameter more).
    pub hot_expert_bytes: Option<u64>,
}

impl PlacerConfig {
    /// Defaults with an expert budget of `budget_bytes`.
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            decay: PopularityStats::DEFAULT_DECAY,
            hot_set: HotSetConfig::new(budget_bytes),
            cost: CostModelConfig::default(),
            hot_expert_bytes: None,
        }
    }
}

/// The placement state of one MoE model: shared popularity statistics, the hot set and the cost
/// model.
#[derive(Debug)]
pub struct Placer {
    experts: u32,
    stats: StatsHandle,
    hot: HotSet,
    cost: CostModel,
}

impl Placer {
    /// A placer for `blocks` MoE blocks of `experts` experts of `shape`.
    ///
    /// # Errors
    /// [`Error::BudgetBelowOneExpert`] when the budget cannot hold one expert
    /// (`cfg.hot_expert_bytes`, else `shape.param_bytes`); [`Error::Config`] naming the field for
    /// other bad settings.
    pub fn new(blocks: u32, experts: u32, shape: ExpertShape, cfg: PlacerConfig) -> Result<Self> {
        Ok(Self {
            experts,
            stats: StatsHandle::new(PopularityStats::new(blocks, experts, cfg.decay)?),
            hot: HotSet::new(cfg.hot_set, cfg.hot_expert_bytes.unwrap_or(shape.param_bytes))?,
            cost: CostModel::new(shape, cfg.cost)?,
        })
    }

    /// Records the router's counts of `block` in `step` (see [`PopularityStats::update`]).
    ///
    /// # Errors
    /// As [`PopularityStats::update`].
    pub fn observe_routing(&self, step: u64, block: u32, tokens_per_expert: &[u64]) -> Result<()> {
        self.stats.update(step, block, tokens_per_expert)
    }

    /// The placement of `block`'s experts for `tokens_per_expert` routed tokens (see
    /// [`CostModel::place_block`]; cold experts go to the CPU only when the hot set's
    /// `cpu_compute` is on).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a slice whose length is not the number of experts.
    pub fn place_block(&self, block: u32, tokens_per_expert: &[u64]) -> Result<Vec<Placement>> {
        if tokens_per_expert.len() != self.experts as usize {
            return Err(Error::OutOfRange {
                what: "tokens_per_expert.len()",
                index: tokens_per_expert.len() as u64,
                len: self.experts.into(),
            });
        }
        let mode = if self.hot.config().cpu_compute { ColdMode::FetchOrCpu } else { ColdMode::FetchOnly };
        Ok(self.cost.place_block(tokens_per_expert, &self.hot.block_mask(block, self.experts), mode))
    }

    /// Re-places the hot set (between steps): see [`HotSet::replan`].
    pub fn replan(&mut self) -> HotSetChange {
        let stats = self.stats.lock();
        self.hot.replan(&stats, &self.cost)
    }

    /// The shared statistics (clone it for a logger or a [`PopularityFallback`]).
    pub fn stats(&self) -> &StatsHandle {
        &self.stats
    }

    /// The hot set.
    pub fn hot_set(&self) -> &HotSet {
        &self.hot
    }

    /// The hot set, to seed it ([`HotSet::set_resident`]).
    pub fn hot_set_mut(&mut self) -> &mut HotSet {
        &mut self.hot
    }

    /// The cost model.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// The cost model, for online corrections ([`CostModel::observe_cpu`], ...).
    pub fn cost_model_mut(&mut self) -> &mut CostModel {
        &mut self.cost
    }

    /// The eviction fallback over this placer's statistics; `experts` maps each swapper tensor of
    /// an expert to its (block, expert).
    pub fn fallback(&self, experts: impl IntoIterator<Item = (TensorId, ExpertId)>) -> PopularityFallback {
        PopularityFallback::new(self.stats.clone(), experts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placer_wires_stats_hot_set_and_cost() {
        let shape = ExpertShape { param_bytes: 1 << 20, grad_bytes: 1 << 20, flops_per_token: 8e6 };
        let e = Placer::new(2, 4, shape, PlacerConfig::new(1 << 19)).unwrap_err();
        assert!(matches!(e, Error::BudgetBelowOneExpert { .. }), "{e}");
        let mut p = Placer::new(2, 4, shape, PlacerConfig::new(2 << 20)).unwrap();
        for s in 0..5 {
            p.observe_routing(s, 0, &[900, 0, 1, 300]).unwrap();
            p.observe_routing(s, 1, &[0, 500, 0, 0]).unwrap();
        }
        let ch = p.replan();
        assert_eq!(ch.admit, vec![ExpertId::new(0, 0), ExpertId::new(1, 1)], "the two busiest, across blocks");
        assert!(p.hot_set().resident_bytes() <= 2 << 20);
        let pl = p.place_block(0, &[900, 0, 1, 300]).unwrap();
        assert_eq!(pl, [Placement::Resident, Placement::Skip, Placement::Cpu, Placement::Fetch]);
        assert!(p.place_block(0, &[1]).is_err());
        let _ = p.fallback([(TensorId(7), ExpertId::new(0, 0))]);
    }
}
