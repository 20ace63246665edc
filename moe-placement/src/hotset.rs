//! The hot set: which experts stay resident on the GPU under an expert byte budget.
//!
//! Ranking follows MoE-Infinity's activation-aware caching (Xue et al. 2024): keep the experts
//! expected to serve the most per byte. The expected saving of a resident expert is
//! [`CostModel::hot_benefit_s`] (seconds per step: the fetch, or the CPU compute, it avoids);
//! experts are ranked by it per byte, ties by expected tokens per byte
//! ([`PopularityStats::expected_tokens`] / bytes), then by id.
//!
//! **Hysteresis.** Moving an expert in costs `bytes / h2d` seconds (moving one out is free: the
//! host copy is current). [`HotSet::replan`] admits an expert into a free slot, or swaps it for
//! the least valuable resident one, only when the expected gain over the horizon exceeds that
//! cost by the margin:
//!
//! `gain_s_per_step · horizon_steps > (1 + margin) · bytes / h2d`
//!
//! where the gain is the candidate's benefit (free slot) or the difference of the two benefits
//! (swap), and the horizon defaults to the statistics' memory, `1 / (1 − decay)` steps. A small
//! wobble of popularity changes no set; a real shift does. Re-placement happens only in
//! `replan`, which the trainer calls between steps, never mid-step.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::cost::{ColdMode, CostModel};
use crate::error::{config, Error, Result};
use crate::stats::{ExpertId, PopularityStats};

/// Settings of a [`HotSet`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotSetConfig {
    /// GPU bytes for resident experts (the compute copies of the hot set). Transient buffers of
    /// fetched cold experts are not counted here. Must hold at least one expert.
    pub budget_bytes: u64,
    /// How much the expected gain must exceed the cost of moving, as a fraction: a change
    /// happens when `gain > (1 + margin) · cost`. Default: 0.5.
    pub margin: f64,
    /// Steps over which a change's gain is counted; `None` (default): the statistics' memory,
    /// `1 / (1 − decay)` steps.
    pub horizon_steps: Option<f64>,
    /// Whether cold experts may compute on the CPU (their cost is then the cheaper of fetch and
    /// CPU, which makes low-token experts less worth keeping). Default: true.
    pub cpu_compute: bool,
    /// Bytes moved H2D to admit an expert, for the cost of a change; `None` (default): its
    /// budget bytes (the compute copy). A hot expert with its optimizer on the device moves its
    /// optimizer state (fp32 master weights, `m`, `v`: 12 B per parameter) and makes its
    /// compute copy there.
    #[serde(default)]
    pub admit_bytes: Option<u64>,
    /// Hot experts keep their gradients on the device (their optimizer lives there): residency
    /// then saves the gradients' D2H too ([`CostModel::hot_benefit_s`] with `keeps_gradients`).
    /// Default: false.
    #[serde(default)]
    pub keeps_gradients: bool,
}

impl HotSetConfig {
    /// Defaults with a budget of `budget_bytes`.
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            margin: 0.5,
            horizon_steps: None,
            cpu_compute: true,
            admit_bytes: None,
            keeps_gradients: false,
        }
    }

    fn cold_mode(&self) -> ColdMode {
        if self.cpu_compute {
            ColdMode::FetchOrCpu
        } else {
            ColdMode::FetchOnly
        }
    }
}

/// What [`HotSet::replan`] changed: upload `admit` (H2D), drop the device copies of `evict`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HotSetChange {
    /// Experts that become resident (sorted).
    pub admit: Vec<ExpertId>,
    /// Experts that stop being resident (sorted).
    pub evict: Vec<ExpertId>,
}

impl HotSetChange {
    /// No change.
    pub fn is_empty(&self) -> bool {
        self.admit.is_empty() && self.evict.is_empty()
    }
}

/// The experts resident on the GPU. Its bytes never exceed the budget.
#[derive(Debug, Clone, Serialize)]
pub struct HotSet {
    cfg: HotSetConfig,
    expert_bytes: u64,
    resident: BTreeSet<ExpertId>,
}

impl HotSet {
    /// An empty hot set for experts of `expert_bytes` each.
    ///
    /// # Errors
    /// [`Error::BudgetBelowOneExpert`] when `cfg.budget_bytes < expert_bytes`;
    /// [`Error::Config`] for `expert_bytes` 0, a negative or non-finite margin, or a horizon
    /// that is not positive.
    pub fn new(cfg: HotSetConfig, expert_bytes: u64) -> Result<Self> {
        if expert_bytes == 0 {
            return Err(config("expert_bytes", "0: an expert has at least one byte"));
        }
        if cfg.budget_bytes < expert_bytes {
            return Err(Error::BudgetBelowOneExpert { budget_bytes: cfg.budget_bytes, expert_bytes });
        }
        if !(cfg.margin.is_finite() && cfg.margin >= 0.0) {
            return Err(config("margin", format!("{} must be a finite number ≥ 0", cfg.margin)));
        }
        if let Some(h) = cfg.horizon_steps {
            crate::error::positive("horizon_steps", h)?;
        }
        Ok(Self { cfg, expert_bytes, resident: BTreeSet::new() })
    }

    /// The settings.
    pub fn config(&self) -> &HotSetConfig {
        &self.cfg
    }

    /// Experts the budget holds.
    pub fn capacity(&self) -> usize {
        (self.cfg.budget_bytes / self.expert_bytes) as usize
    }

    /// Bytes of the resident experts (≤ the budget).
    pub fn resident_bytes(&self) -> u64 {
        self.resident.len() as u64 * self.expert_bytes
    }

    /// Whether `id` is resident.
    pub fn contains(&self, id: ExpertId) -> bool {
        self.resident.contains(&id)
    }

    /// The resident experts, sorted.
    pub fn iter(&self) -> impl Iterator<Item = ExpertId> + '_ {
        self.resident.iter().copied()
    }

    /// `resident[e]` for the experts of `block` (for [`CostModel::place_block`]).
    pub fn block_mask(&self, block: u32, experts: u32) -> Vec<bool> {
        (0..experts).map(|e| self.contains(ExpertId::new(block, e))).collect()
    }

    /// Sets the resident experts (at start-up, or to follow a decision made elsewhere).
    ///
    /// # Errors
    /// [`Error::Config`] when they exceed the budget.
    pub fn set_resident(&mut self, ids: impl IntoIterator<Item = ExpertId>) -> Result<()> {
        let set: BTreeSet<ExpertId> = ids.into_iter().collect();
        if set.len() > self.capacity() {
            return Err(config(
                "resident",
                format!("{} experts exceed the budget of {} ({} B)", set.len(), self.capacity(), self.cfg.budget_bytes),
            ));
        }
        self.resident = set;
        Ok(())
    }

    /// Re-places the hot set from the statistics (call between steps): fills free slots and
    /// swaps resident experts for better ones where the gain beats the cost of moving by the
    /// margin (see the module docs). Returns what changed; the set is updated.
    pub fn replan(&mut self, stats: &PopularityStats, cost: &CostModel) -> HotSetChange {
        let mode = self.cfg.cold_mode();
        let bytes = self.expert_bytes as f64;
        let horizon = self.cfg.horizon_steps.unwrap_or(1.0 / (1.0 - stats.decay()));
        let move_s = (1.0 + self.cfg.margin) * cost.h2d_s(self.cfg.admit_bytes.unwrap_or(self.expert_bytes));
        let keeps_gradients = self.cfg.keeps_gradients;
        // (benefit per byte, tokens per byte, id), best first.
        let score = |id: ExpertId| {
            let t = stats.expected_tokens(id);
            (cost.hot_benefit_s(t, stats.use_probability(id), mode, keeps_gradients), t)
        };
        let cmp = |a: &(f64, f64, ExpertId), b: &(f64, f64, ExpertId)| {
            b.0.total_cmp(&a.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2))
        };
        let mut outside: Vec<(f64, f64, ExpertId)> = stats
            .ids()
            .filter(|id| !self.resident.contains(id))
            .map(|id| {
                let (g, t) = score(id);
                (g / bytes, t / bytes, id)
            })
            .collect();
        outside.sort_by(cmp);
        let mut inside: Vec<(f64, f64, ExpertId)> = self
            .resident
            .iter()
            .map(|&id| {
                let (g, t) = score(id);
                (g / bytes, t / bytes, id)
            })
            .collect();
        inside.sort_by(|a, b| cmp(b, a)); // worst first
        let mut change = HotSetChange::default();
        let mut out = outside.into_iter().peekable();
        let mut free = self.capacity().saturating_sub(self.resident.len());
        while free > 0 {
            match out.peek() {
                Some(&(g, _, id)) if g * bytes * horizon > move_s => {
                    change.admit.push(id);
                    free -= 1;
                    out.next();
                }
                _ => break,
            }
        }
        for ((g_in, _, id_in), (g_out, _, id_out)) in out.zip(inside) {
            if (g_in - g_out) * bytes * horizon > move_s {
                change.admit.push(id_in);
                change.evict.push(id_out);
            } else {
                break;
            }
        }
        for id in &change.evict {
            self.resident.remove(id);
        }
        self.resident.extend(change.admit.iter().copied());
        change.admit.sort();
        change.evict.sort();
        debug_assert!(self.resident_bytes() <= self.cfg.budget_bytes);
        if !change.is_empty() {
            tracing::debug!(
                target: "moe_placement::replan",
                admit = change.admit.len(),
                evict = change.evict.len(),
                resident_bytes = self.resident_bytes(),
                "hot set changed"
            );
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::cost::{CostModelConfig, ExpertShape};

    const MB: u64 = 1_000_000;

    fn cost() -> CostModel {
        let shape = ExpertShape { param_bytes: MB, grad_bytes: MB, flops_per_token: 1e6 };
        let cfg =
            CostModelConfig { h2d_gbps: 1.0, d2h_gbps: 1.0, gpu_gflops: 1000.0, cpu_gflops: 10.0, observe_weight: 0.2 };
        CostModel::new(shape, cfg).unwrap()
    }

    #[test]
    fn a_budget_below_one_expert_is_a_clear_error() {
        let e = HotSet::new(HotSetConfig::new(MB - 1), MB).unwrap_err();
        assert!(
            matches!(e, Error::BudgetBelowOneExpert { budget_bytes, expert_bytes } if budget_bytes == MB - 1 && expert_bytes == MB)
        );
        let msg = e.to_string();
        assert!(msg.contains("raise the expert budget to at least 1000000 B"), "{msg}");
        assert_eq!(HotSet::new(HotSetConfig::new(MB), MB).unwrap().capacity(), 1);
    }

    /// One block of 8 experts; `tokens` per step, repeated `steps` times.
    fn feed(stats: &mut PopularityStats, step0: u64, steps: u64, tokens: &[u64]) {
        for s in step0..step0 + steps {
            stats.update(s, 0, tokens).unwrap();
        }
    }

    #[test]
    fn a_small_wobble_keeps_the_set_and_a_big_shift_changes_it() {
        let c = cost();
        let mut stats = PopularityStats::new(1, 8, 0.8).unwrap();
        let mut hot = HotSet::new(HotSetConfig::new(3 * MB), MB).unwrap();
        // Experts 0..3 popular, 3..8 a trickle (the CPU handles them: 1 ms per 10 tokens).
        let base = [400, 300, 200, 2, 2, 1, 1, 0];
        feed(&mut stats, 0, 10, &base);
        let ch = hot.replan(&stats, &c);
        assert_eq!(ch.admit, [0, 1, 2].map(|e| ExpertId::new(0, e)));
        assert!(ch.evict.is_empty());
        // Wobble: expert 3 now gets a little more than expert 2 for a few steps.
        feed(&mut stats, 10, 3, &[380, 320, 150, 160, 3, 1, 1, 0]);
        assert!(hot.replan(&stats, &c).is_empty(), "a wobble must not move experts");
        feed(&mut stats, 13, 3, &[400, 300, 200, 2, 2, 1, 1, 0]);
        assert!(hot.replan(&stats, &c).is_empty());
        // Shift: expert 2 goes quiet and expert 5 takes its tokens.
        feed(&mut stats, 16, 15, &[400, 300, 0, 2, 2, 200, 1, 0]);
        let ch = hot.replan(&stats, &c);
        assert_eq!(ch.admit, vec![ExpertId::new(0, 5)]);
        assert_eq!(ch.evict, vec![ExpertId::new(0, 2)]);
        assert!(hot.contains(ExpertId::new(0, 5)) && !hot.contains(ExpertId::new(0, 2)));
        assert!(hot.replan(&stats, &c).is_empty(), "replanning twice on the same figures changes nothing");
    }

    #[test]
    fn nothing_is_admitted_before_any_routing() {
        let c = cost();
        let stats = PopularityStats::new(2, 4, 0.9).unwrap();
        let mut hot = HotSet::new(HotSetConfig::new(10 * MB), MB).unwrap();
        assert!(hot.replan(&stats, &c).is_empty());
        assert_eq!(hot.resident_bytes(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn placement_never_exceeds_the_expert_budget(
            blocks in 1u32..4,
            experts in 1u32..12,
            expert_bytes in 1u64..5_000_000,
            budget_experts in 1u64..20,
            extra in 0u64..1_000_000,
            decay in 0.0f64..0.99,
            margin in 0.0f64..3.0,
            cpu in any::<bool>(),
            steps in proptest::collection::vec(proptest::collection::vec(0u64..500, 48), 1..12),
        ) {
            let budget = budget_experts * expert_bytes + extra % expert_bytes;
            let mut cfg = HotSetConfig::new(budget);
            cfg.margin = margin;
            cfg.cpu_compute = cpu;
            let mut hot = HotSet::new(cfg, expert_bytes).unwrap();
            let shape = ExpertShape { param_bytes: expert_bytes, grad_bytes: expert_bytes, flops_per_token: 1e6 };
            let c = CostModel::new(shape, CostModelConfig::default()).unwrap();
            let mut stats = PopularityStats::new(blocks, experts, decay).unwrap();
            for (s, tokens) in steps.iter().enumerate() {
                for b in 0..blocks {
                    let start = (b * experts) as usize % 24;
                    stats.update(s as u64, b, &tokens[start..start + experts as usize]).unwrap();
                }
                let before: BTreeSet<ExpertId> = hot.iter().collect();
                let ch = hot.replan(&stats, &c);
                prop_assert!(hot.resident_bytes() <= budget);
                prop_assert!(hot.iter().count() <= (blocks * experts) as usize);
                for id in &ch.admit { prop_assert!(!before.contains(id) && hot.contains(*id)); }
                for id in &ch.evict { prop_assert!(before.contains(id) && !hot.contains(*id)); }
                for b in 0..blocks {
                    let t = &tokens[..experts as usize];
                    let p = c.place_block(t, &hot.block_mask(b, experts), cfg.cold_mode());
                    for (e, (&n, &pl)) in t.iter().zip(&p).enumerate() {
                        prop_assert_eq!(n == 0, pl == crate::Placement::Skip);
                        prop_assert_eq!(
                            pl == crate::Placement::Resident,
                            n > 0 && hot.contains(ExpertId::new(b, e as u32))
                        );
                    }
                }
            }
        }
    }
}
