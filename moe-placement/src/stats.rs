//! Expert popularity: per (block, expert), exponential moving averages of routed tokens and of
//! use, plus recency.
//!
//! The router of an MoE block (Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al.
//! 2020) sends each token to its top-k experts; which experts a step needs is known only after
//! the router runs. Popularity is skewed and drifts slowly during training, which is what
//! MoE-Infinity (Xue et al. 2024) exploits with activation-aware caching: keep the experts that
//! are expected to receive the most tokens. This module only keeps the figures; the hot set
//! ([`crate::HotSet`]) and the eviction fallback ([`crate::PopularityFallback`]) read them.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use serde::{Deserialize, Serialize};

use crate::error::{config, Error, Result};

/// One expert of one MoE block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExpertId {
    /// The MoE block (0-based, in model order).
    pub block: u32,
    /// The expert within the block (0-based).
    pub expert: u32,
}

impl ExpertId {
    /// `(block, expert)`.
    pub fn new(block: u32, expert: u32) -> Self {
        Self { block, expert }
    }
}

impl std::fmt::Display for ExpertId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "b{}e{}", self.block, self.expert)
    }
}

/// The figures of one expert.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertStats {
    /// Exponential moving average of tokens routed per step (not bias-corrected; see
    /// [`PopularityStats::expected_tokens`]).
    pub ema_tokens: f64,
    /// Exponential moving average of "the expert received at least one token" (0 or 1 per step).
    pub ema_used: f64,
    /// The last step in which the expert received tokens (recency), `None` before its first.
    pub last_step: Option<u64>,
    /// Tokens routed to the expert over all updates.
    pub total_tokens: u64,
    /// Updates (steps) in which the expert received tokens.
    pub steps_used: u64,
}

/// Popularity of every expert of a model: one [`ExpertStats`] per (block, expert), updated once
/// per step and block from the router's token counts.
///
/// With `decay` d, an update with `x` tokens sets `ema ← d·ema + (1 − d)·x`. Averages start at 0
/// and are read bias-corrected (divided by `1 − dⁿ` after `n` updates of the block, as Adam's
/// moments), so the first steps are not underestimated. The memory of the average is about
/// `1 / (1 − d)` steps.
///
/// Serializes (serde) as `{ blocks, experts, decay, updates, entries }` for logs.
#[derive(Debug, Clone, Serialize)]
pub struct PopularityStats {
    blocks: u32,
    experts: u32,
    decay: f64,
    /// Updates per block.
    updates: Vec<u64>,
    /// `decay^updates` per block (for the bias correction).
    #[serde(skip)]
    decay_pow: Vec<f64>,
    /// Block-major: `entries[block * experts + expert]`.
    entries: Vec<ExpertStats>,
}

impl PopularityStats {
    /// Statistics for `blocks` MoE blocks of `experts` experts each, with EMA `decay` in `[0, 1)`
    /// (0: only the last step counts; 0.9: about the last 10 steps). Default decay:
    /// [`PopularityStats::DEFAULT_DECAY`].
    ///
    /// # Errors
    /// [`Error::Config`] for zero blocks or experts, or a decay outside `[0, 1)`.
    pub fn new(blocks: u32, experts: u32, decay: f64) -> Result<Self> {
        if blocks == 0 || experts == 0 {
            return Err(config(
                "blocks/experts",
                format!("{blocks} blocks of {experts} experts: both must be at least 1"),
            ));
        }
        if !(decay.is_finite() && (0.0..1.0).contains(&decay)) {
            return Err(config("decay", format!("{decay} must be in [0, 1) (e.g. 0.9: about 10 steps of memory)")));
        }
        let n = blocks as usize * experts as usize;
        Ok(Self {
            blocks,
            experts,
            decay,
            updates: vec![0; blocks as usize],
            decay_pow: vec![1.0; blocks as usize],
            entries: vec![ExpertStats::default(); n],
        })
    }

    /// The default EMA decay: 0.9 (about 10 steps of memory).
    pub const DEFAULT_DECAY: f64 = 0.9;

    /// MoE blocks.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Experts per block.
    pub fn experts(&self) -> u32 {
        self.experts
    }

    /// The EMA decay.
    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Updates of `block` so far.
    pub fn updates(&self, block: u32) -> u64 {
        self.updates.get(block as usize).copied().unwrap_or(0)
    }

    /// Records one step of `block`'s routing: `tokens_per_expert[e]` tokens went to expert `e`
    /// (top-k assignments, after any capacity drop). Call it once per step and block (sum
    /// micro-batches first); every expert of the block is updated, those with 0 tokens decay.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a block out of range or a slice whose length is not the number
    /// of experts.
    pub fn update(&mut self, step: u64, block: u32, tokens_per_expert: &[u64]) -> Result<()> {
        if block >= self.blocks {
            return Err(Error::OutOfRange { what: "block", index: block.into(), len: self.blocks.into() });
        }
        if tokens_per_expert.len() != self.experts as usize {
            return Err(Error::OutOfRange {
                what: "tokens_per_expert.len()",
                index: tokens_per_expert.len() as u64,
                len: self.experts.into(),
            });
        }
        let d = self.decay;
        let b = block as usize;
        let base = b * self.experts as usize;
        for (s, &t) in self.entries[base..base + self.experts as usize].iter_mut().zip(tokens_per_expert) {
            s.ema_tokens = d * s.ema_tokens + (1.0 - d) * t as f64;
            s.ema_used = d * s.ema_used + if t > 0 { 1.0 - d } else { 0.0 };
            if t > 0 {
                s.last_step = Some(s.last_step.map_or(step, |l| l.max(step)));
                s.total_tokens += t;
                s.steps_used += 1;
            }
        }
        self.updates[b] += 1;
        self.decay_pow[b] *= d;
        Ok(())
    }

    fn index(&self, id: ExpertId) -> Option<usize> {
        (id.block < self.blocks && id.expert < self.experts)
            .then(|| id.block as usize * self.experts as usize + id.expert as usize)
    }

    /// The raw figures of `id`, `None` out of range.
    pub fn get(&self, id: ExpertId) -> Option<&ExpertStats> {
        self.index(id).map(|i| &self.entries[i])
    }

    fn correction(&self, block: u32) -> f64 {
        let c = 1.0 - self.decay_pow[block as usize];
        if c > 0.0 {
            1.0 / c
        } else {
            0.0
        }
    }

    /// Expected tokens routed to `id` in a step: the bias-corrected EMA. 0 before the block's
    /// first update and out of range.
    pub fn expected_tokens(&self, id: ExpertId) -> f64 {
        self.index(id).map_or(0.0, |i| self.entries[i].ema_tokens * self.correction(id.block))
    }

    /// Expected probability that `id` receives at least one token in a step (bias-corrected EMA
    /// of use), in `[0, 1]`.
    pub fn use_probability(&self, id: ExpertId) -> f64 {
        self.index(id).map_or(0.0, |i| (self.entries[i].ema_used * self.correction(id.block)).clamp(0.0, 1.0))
    }

    /// Every expert id, block-major.
    pub fn ids(&self) -> impl Iterator<Item = ExpertId> + '_ {
        (0..self.blocks).flat_map(move |b| (0..self.experts).map(move |e| ExpertId::new(b, e)))
    }

    /// Every expert with its figures, block-major.
    pub fn iter(&self) -> impl Iterator<Item = (ExpertId, &ExpertStats)> + '_ {
        self.ids().zip(self.entries.iter())
    }
}

/// A shared handle to [`PopularityStats`] (the trainer updates, the eviction fallback and the
/// logger read). Cloning shares the statistics.
///
/// Lock order: the swapper calls [`crate::PopularityFallback`] under its own lock, and the
/// fallback takes this lock; never call into the swapper while holding [`StatsHandle::lock`].
#[derive(Debug, Clone)]
pub struct StatsHandle(Arc<Mutex<PopularityStats>>);

impl StatsHandle {
    /// Shares `stats`.
    pub fn new(stats: PopularityStats) -> Self {
        Self(Arc::new(Mutex::new(stats)))
    }

    /// [`PopularityStats::update`] under the lock.
    ///
    /// # Errors
    /// As [`PopularityStats::update`].
    pub fn update(&self, step: u64, block: u32, tokens_per_expert: &[u64]) -> Result<()> {
        self.0.lock().update(step, block, tokens_per_expert)
    }

    /// The statistics, locked (keep the guard short).
    pub fn lock(&self) -> MutexGuard<'_, PopularityStats> {
        self.0.lock()
    }

    /// A copy of the statistics (for logging: `serde_json::to_string(&handle.snapshot())`).
    pub fn snapshot(&self) -> PopularityStats {
        self.0.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ema_is_bias_corrected_and_tracks_recency() {
        let mut s = PopularityStats::new(2, 3, 0.5).unwrap();
        s.update(0, 1, &[4, 0, 2]).unwrap();
        let id = ExpertId::new(1, 0);
        assert!((s.expected_tokens(id) - 4.0).abs() < 1e-12, "first update reads as the observation");
        assert_eq!(s.use_probability(ExpertId::new(1, 1)), 0.0);
        s.update(1, 1, &[0, 0, 2]).unwrap();
        // raw ema: 0.5·2 + 0 = 1; correction 1/(1 − 0.25).
        assert!((s.expected_tokens(id) - 4.0 / 3.0).abs() < 1e-12);
        assert!((s.expected_tokens(ExpertId::new(1, 2)) - 2.0).abs() < 1e-12);
        assert_eq!(s.get(id).unwrap().last_step, Some(0));
        assert_eq!(s.get(ExpertId::new(1, 2)).unwrap().last_step, Some(1));
        assert_eq!(s.get(ExpertId::new(1, 2)).unwrap().total_tokens, 4);
        assert_eq!(s.expected_tokens(ExpertId::new(0, 0)), 0.0, "block 0 never updated");
        assert!(s.update(0, 2, &[1, 1, 1]).is_err());
        assert!(s.update(0, 0, &[1, 1]).is_err());
        assert!(PopularityStats::new(1, 1, 1.0).is_err());
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"ema_tokens\""), "{json}");
    }
}
