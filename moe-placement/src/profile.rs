//! Routing skew as a profile: the share of a block's routed assignments that its r-th most
//! popular expert takes, measured on a routing trace and carried over to a model of another
//! expert count (`oogc plan --routing-trace`: the hot set and the expected expert bytes per step of a
//! large model at the skew a small run measured).
//!
//! A profile is the long-run popularity of a block's experts sorted by rank, averaged over the
//! blocks: per block, each expert's tokens summed over the trace's steps (after a warm-up the
//! caller skips), sorted descending, normalised to sum 1. Summing over steps first keeps the
//! per-step sampling noise (which makes even uniform routing look skewed in a sorted single
//! step) out of the curve. Carried over to `n` experts by its cumulative curve: the top `q`
//! fraction of the experts takes the same share of the assignments, linear between the measured
//! points (MoE-Infinity's and Fiddler's traces show such heavy-headed curves; the profile
//! assumes the shape, not the expert count, carries over).

use crate::error::{Error, Result};
use crate::trace::RoutingTrace;

/// The mean share of routed assignments by popularity rank (`shares[0]` the most popular
/// expert's), summing to 1 (module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct PopularityProfile {
    shares: Vec<f64>,
    /// Measured on a trace: per rank, the share of (step, block) pairs in which that rank's
    /// expert received at least one token, and the routed assignments per block and step
    /// (`tokens_per_step · top_k`) it was measured at.
    used: Option<(Vec<f64>, f64)>,
}

impl PopularityProfile {
    /// Uniform routing over `experts` experts (each `1 / experts`).
    ///
    /// # Panics
    /// When `experts` is 0.
    pub fn uniform(experts: usize) -> Self {
        assert!(experts > 0, "a profile needs at least one expert");
        Self { shares: vec![1.0 / experts as f64; experts], used: None }
    }

    /// The profile of `trace`, leaving out its first `skip_steps` steps (the router's warm-up).
    ///
    /// # Errors
    /// [`Error::Config`] (key `routing trace`) when no tokens remain after the skipped steps.
    pub fn from_trace(trace: &RoutingTrace, skip_steps: usize) -> Result<Self> {
        let experts = trace.header.experts as usize;
        let blocks = trace.header.blocks as usize;
        let mut shares = vec![0.0f64; experts];
        let mut used = vec![0.0f64; experts];
        let mut counted = 0usize;
        let steps = trace.steps.len().saturating_sub(skip_steps);
        for b in 0..blocks {
            // Per expert: tokens over the steps kept, and steps in which it received any.
            let mut totals = vec![(0u64, 0u64); experts];
            for index in skip_steps..trace.steps.len() {
                for (t, &n) in totals.iter_mut().zip(trace.tokens(index, b as u32)) {
                    t.0 += n;
                    t.1 += u64::from(n > 0);
                }
            }
            let sum: u64 = totals.iter().map(|t| t.0).sum();
            if sum == 0 {
                continue;
            }
            totals.sort_unstable_by(|a, b| b.cmp(a));
            for ((s, u), &(t, n)) in shares.iter_mut().zip(&mut used).zip(&totals) {
                *s += t as f64 / sum as f64;
                *u += n as f64 / steps as f64;
            }
            counted += 1;
        }
        if counted == 0 {
            return Err(Error::Config {
                key: "routing trace".into(),
                reason: format!(
                    "no routed tokens after skipping {skip_steps} of its {} steps; record more steps or skip fewer",
                    trace.steps.len()
                ),
            });
        }
        shares.iter_mut().for_each(|s| *s /= counted as f64);
        used.iter_mut().for_each(|u| *u /= counted as f64);
        let assignments = (trace.header.tokens_per_step * u64::from(trace.header.top_k)) as f64;
        Ok(Self { shares, used: Some((used, assignments)) })
    }

    /// Experts in the profile.
    pub fn experts(&self) -> usize {
        self.shares.len()
    }

    /// The shares by rank, most popular first (they sum to 1).
    pub fn shares(&self) -> &[f64] {
        &self.shares
    }

    /// The share of the assignments the most popular `fraction` (0..=1) of the experts take:
    /// the cumulative curve, linear between ranks.
    pub fn top_share(&self, fraction: f64) -> f64 {
        let x = fraction.clamp(0.0, 1.0) * self.shares.len() as f64;
        let whole = x.floor() as usize;
        let head: f64 = self.shares[..whole.min(self.shares.len())].iter().sum();
        let part = self.shares.get(whole).map_or(0.0, |s| s * (x - whole as f64));
        (head + part).min(1.0)
    }

    /// The profile carried over to `experts` experts through the cumulative curve ([`top_share`](Self::top_share)
    /// at `r / experts`).
    ///
    /// # Panics
    /// When `experts` is 0.
    pub fn resample(&self, experts: usize) -> Self {
        assert!(experts > 0, "a profile needs at least one expert");
        let at = |r: usize| self.top_share(r as f64 / experts as f64);
        let n = self.shares.len();
        // A measured use probability is taken at the rank whose quantile holds the new rank's
        // middle.
        let used = self.used.as_ref().map(|(u, a)| {
            let nearest = |r: usize| u[(((r as f64 + 0.5) / experts as f64 * n as f64) as usize).min(n - 1)];
            ((0..experts).map(nearest).collect(), *a)
        });
        Self { shares: (0..experts).map(|r| at(r + 1) - at(r)).collect(), used }
    }

    /// The probability that the rank-`rank` expert receives at least one of a step's `tokens`
    /// tokens under top-`top_k` routing.
    ///
    /// From a trace: the measured share `u` of steps in which the rank's expert was used, at the
    /// trace's `a0` assignments per block and step, carried over to `a = tokens · top_k` as
    /// `1 − (1 − u)^(a / a0)` (a step of `a` assignments as `a / a0` independent trace steps;
    /// exact at the trace's own size). Routing within a step is correlated — an expert the
    /// router has abandoned gets no token from any of the step's tokens — which the per-token
    /// form below would miss. Uniform: each token picks it with probability
    /// `min(1, top_k · share)`, independently of the other tokens.
    ///
    /// # Panics
    /// When `rank` is out of range.
    pub fn used_probability(&self, rank: usize, tokens: u64, top_k: usize) -> f64 {
        let a = tokens as f64 * top_k as f64;
        match &self.used {
            Some((u, a0)) => 1.0 - (1.0 - u[rank]).powf(a / a0.max(1.0)),
            None => {
                let p = (top_k as f64 * self.shares[rank]).min(1.0);
                1.0 - (1.0 - p).powf(tokens as f64)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceHeader;

    fn trace(blocks: u32, experts: u32, steps: &[Vec<u64>]) -> RoutingTrace {
        let mut t = RoutingTrace::new(TraceHeader::new(blocks, experts, 2, 10, 40, 80.0, 100));
        t.steps = steps.iter().enumerate().map(|(i, s)| (i as u64 + 1, s.clone())).collect();
        t
    }

    #[test]
    fn a_trace_gives_the_sorted_long_run_shares_averaged_over_blocks() {
        // Block 0: expert 2 takes 60 %, expert 0 30 %, expert 1 10 % (over the two steps kept);
        // block 1: 50 / 30 / 20. The first step (skipped) would say otherwise.
        let t = trace(2, 3, &[vec![100, 0, 0, 0, 0, 100], vec![2, 1, 7, 3, 2, 5], vec![4, 1, 5, 1, 4, 5]]);
        let p = PopularityProfile::from_trace(&t, 1).unwrap();
        let want = [(0.6 + 0.5) / 2.0, (0.3 + 0.3) / 2.0, (0.1 + 0.2) / 2.0];
        for (got, want) in p.shares().iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{:?}", p.shares());
        }
        // Used in both kept steps, except block 1's least popular (expert 0: 3 tokens, then 1).
        // At the trace's own size (100 tokens, top-2) the measured shares come back.
        assert_eq!(p.used_probability(0, 100, 2), 1.0);
        assert!((p.used_probability(2, 100, 2) - 1.0).abs() < 1e-12);
        let half = trace(1, 2, &[vec![5, 0], vec![4, 1]]);
        let q = PopularityProfile::from_trace(&half, 0).unwrap();
        assert!((q.used_probability(1, 100, 2) - 0.5).abs() < 1e-12);
        // Twice the tokens: as two independent trace steps.
        assert!((q.used_probability(1, 200, 2) - 0.75).abs() < 1e-12);
        let err = PopularityProfile::from_trace(&t, 3).unwrap_err().to_string();
        assert!(err.contains("skipping 3 of its 3 steps"), "{err}");
    }

    #[test]
    fn resampling_keeps_the_cumulative_curve() {
        let p = PopularityProfile { shares: vec![0.4, 0.3, 0.2, 0.1], used: Some((vec![1.0, 0.9, 0.5, 0.1], 8.0)) };
        let q = p.resample(8);
        assert_eq!(q.experts(), 8);
        assert!((q.shares().iter().sum::<f64>() - 1.0).abs() < 1e-12);
        for f in [0.25, 0.5, 0.75, 1.0] {
            assert!((p.top_share(f) - q.top_share(f)).abs() < 1e-12, "{f}: {} vs {}", p.top_share(f), q.top_share(f));
        }
        // Each measured rank splits into two halves of its share.
        assert!((q.shares()[0] - 0.2).abs() < 1e-12 && (q.shares()[7] - 0.05).abs() < 1e-12, "{:?}", q.shares());
        // Use probabilities by quantile: ranks 0 and 1 of 8 are rank 0 of 4, and so on.
        let used: Vec<f64> = (0..8).map(|r| q.used_probability(r, 4, 2)).collect();
        let want = [1.0, 1.0, 0.9, 0.9, 0.5, 0.5, 0.1, 0.1];
        assert!(used.iter().zip(want).all(|(u, w)| (u - w).abs() < 1e-12), "{used:?}");
        // Uniform stays uniform at any count.
        let u = PopularityProfile::uniform(64).resample(128);
        assert!(u.shares().iter().all(|s| (s - 1.0 / 128.0).abs() < 1e-12));
    }

    /// The uniform closed form against a simulation of top-k routing (k distinct experts per token,
    /// drawn by the shares without replacement): the independent-tokens form is exact for
    /// k = 1 and close for k > 1 while no share nears 1 / k.
    #[test]
    fn used_probability_matches_a_simulation_of_top_k_routing() {
        let shares: Vec<f64> = (0..16).map(|r| 0.9f64.powi(r)).collect();
        let sum: f64 = shares.iter().sum();
        let p = PopularityProfile { shares: shares.iter().map(|s| s / sum).collect(), used: None };
        let (k, tokens, trials) = (2usize, 12u64, 20_000u32);
        let mut used = [0u32; 16];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut uniform = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        for _ in 0..trials {
            let mut hit = [false; 16];
            for _ in 0..tokens {
                let mut taken = [false; 16];
                for _ in 0..k {
                    let left: f64 = (0..16).filter(|&e| !taken[e]).map(|e| p.shares[e]).sum();
                    let mut x = uniform() * left;
                    let e = (0..16).filter(|&e| !taken[e]).find(|&e| {
                        x -= p.shares[e];
                        x < 0.0
                    });
                    let e = e.unwrap_or(15);
                    taken[e] = true;
                    hit[e] = true;
                }
            }
            for (u, h) in used.iter_mut().zip(hit) {
                *u += u32::from(h);
            }
        }
        for (r, &u) in used.iter().enumerate() {
            let simulated = f64::from(u) / f64::from(trials);
            let closed = p.used_probability(r, tokens, k);
            assert!((simulated - closed).abs() < 0.03, "rank {r}: simulated {simulated}, closed form {closed}");
        }
    }
}
