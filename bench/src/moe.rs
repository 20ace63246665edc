//! `oogc bench moe`: replays a routing trace (`oogc-routing-1`, or a synthetic one) under five
//! expert placement policies with the same GPU byte budget for experts, and predicts the MoE
//! part of each step with the placement crate's cost model.
//!
//! | row `policy` | what runs |
//! |---|---|
//! | `fetch-on-demand` | every routed expert is fetched each step (kept from its forward to its backward), nothing kept across steps |
//! | `lru` | an LRU cache of expert copies: a hit computes in place, a miss fetches and inserts (evicting the least recently used) |
//! | `static` | a fixed hot set: the experts with the most tokens over the whole trace (an oracle of the future); cold ones fetched |
//! | `ours` | [`Placer`]: the EMA hot set with hysteresis, re-placed between steps, and cold experts on the CPU where the cost model says it is faster |
//! | `ours-no-cpu` | the same hot set, cold experts always fetched (to separate the two effects) |
//!
//! **Model.** Per step and block, the block's routed experts are placed and the block costs
//! [`CostModel::block_cost`] (GPU path `max(gpu, h2d + last fetched expert's compute)`, the
//! gradients' D2H and the CPU in parallel; the time of a block is the largest). A step is the
//! sum over its blocks, but at least the H2D link time of everything the step moves, including
//! what the previous step's end queued (hot-set admissions, refreshes), which overlaps the
//! step's compute where the link is idle. `step_s` is the mean over the trace's steps of the
//! expert part of a step only (attention, router, and the optimizer are not in it).
//!
//! **Training refresh.** The CPU optimizer updates every expert that received tokens, which makes
//! its device copy stale. A policy that keeps copies must re-upload each kept, used expert once
//! per step (eagerly, between steps, off the demand path): `refresh_h2d_bytes`, counted apart
//! from the demand fetches and admissions of `expert_h2d_bytes` and on the link in `step_s`.
//! Fetch-on-demand and CPU-computed experts have none. In inference (no updates) it is zero.
//!
//! `hit_rate`: routed expert-uses served without a transfer (resident, or computed on the CPU);
//! `resident_rate`: served by a resident copy.

use std::collections::{BTreeSet, HashMap};

use oogc_moe_placement::{
    ColdMode, CostModel, CostModelConfig, ExpertId, HotSet, HotSetConfig, Placement, Placer, PlacerConfig, RoutingTrace,
};
use serde::Serialize;

use crate::error::{Context, Error, Result};

/// Arguments of the MoE placement benchmark.
#[derive(Debug, Clone)]
pub struct MoeBenchArgs {
    /// GPU bytes for resident experts, as a fraction of all experts' bytes, in (0, 1].
    pub budget_fraction: f64,
    /// Links and compute rates of the cost model.
    pub cost: CostModelConfig,
    /// EMA decay of the popularity statistics (`ours`).
    pub decay: f64,
    /// Hysteresis margin of the hot set (`ours`).
    pub margin: f64,
}

impl Default for MoeBenchArgs {
    fn default() -> Self {
        Self { budget_fraction: 0.25, cost: CostModelConfig::default(), decay: 0.9, margin: 0.5 }
    }
}

/// One row: a policy replayed over the whole trace.
#[derive(Debug, Clone, Serialize)]
pub struct MoeBenchRow {
    /// `fetch-on-demand`, `lru`, `static`, `ours`, `ours-no-cpu`.
    pub policy: String,
    /// GPU bytes for resident experts.
    pub budget_bytes: u64,
    /// Expert bytes moved H2D: demand fetches and hot-set admissions (static: its initial load).
    pub expert_h2d_bytes: u64,
    /// Expert bytes re-uploaded after the CPU optimizer's update of kept experts (training).
    pub refresh_h2d_bytes: u64,
    /// `expert_h2d_bytes / ` fetch-on-demand's.
    pub bytes_vs_fetch: f64,
    /// Routed expert-uses served without a transfer (resident or CPU), fraction.
    pub hit_rate: f64,
    /// Routed expert-uses served by a resident copy, fraction.
    pub resident_rate: f64,
    /// Tokens computed on the CPU.
    pub cpu_tokens: u64,
    /// Fetches (demand).
    pub fetches: u64,
    /// Routed expert-uses (step, block, expert with tokens).
    pub uses: u64,
    /// Predicted expert time per step (mean), seconds.
    pub step_s: f64,
    /// Fetch-on-demand's `step_s` / this `step_s`.
    pub speedup_vs_fetch: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fetch,
    Lru,
    Static,
    Ours { cpu: bool },
}

impl Kind {
    const ALL: [Kind; 5] = [Kind::Fetch, Kind::Lru, Kind::Static, Kind::Ours { cpu: true }, Kind::Ours { cpu: false }];

    fn name(self) -> &'static str {
        match self {
            Kind::Fetch => "fetch-on-demand",
            Kind::Lru => "lru",
            Kind::Static => "static",
            Kind::Ours { cpu: true } => "ours",
            Kind::Ours { cpu: false } => "ours-no-cpu",
        }
    }
}

/// The state of one policy during a replay.
enum State {
    Fetch,
    /// Expert → last use (a counter).
    Lru {
        cap: usize,
        clock: u64,
        cache: HashMap<ExpertId, u64>,
    },
    Static(BTreeSet<ExpertId>),
    Ours(Box<Placer>),
}

impl State {
    fn resident(&self, id: ExpertId) -> bool {
        match self {
            State::Fetch => false,
            State::Lru { cache, .. } => cache.contains_key(&id),
            State::Static(set) => set.contains(&id),
            State::Ours(p) => p.hot_set().contains(id),
        }
    }
}

#[derive(Default)]
struct Totals {
    expert_h2d_bytes: u64,
    refresh_h2d_bytes: u64,
    uses: u64,
    hits: u64,
    resident_hits: u64,
    cpu_tokens: u64,
    fetches: u64,
    step_s_sum: f64,
}

fn replay(trace: &RoutingTrace, args: &MoeBenchArgs, budget_bytes: u64, kind: Kind) -> Result<Totals> {
    let h = &trace.header;
    let shape = h.expert_shape();
    let cost = CostModel::new(shape, args.cost).context("the cost model")?;
    let cap = HotSet::new(HotSetConfig::new(budget_bytes), h.expert_bytes).context("the expert budget")?.capacity();
    let mut state = match kind {
        Kind::Fetch => State::Fetch,
        Kind::Lru => State::Lru { cap, clock: 0, cache: HashMap::new() },
        Kind::Static => {
            let mut totals: Vec<(u64, ExpertId)> = (0..h.blocks)
                .flat_map(|b| (0..h.experts).map(move |e| ExpertId::new(b, e)))
                .map(|id| {
                    let i = (id.block * h.experts + id.expert) as usize;
                    (trace.steps.iter().map(|s| s.1[i]).sum::<u64>(), id)
                })
                .collect();
            totals.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            State::Static(totals.into_iter().take(cap).filter(|t| t.0 > 0).map(|t| t.1).collect())
        }
        Kind::Ours { cpu } => {
            let mut cfg = PlacerConfig::new(budget_bytes);
            cfg.decay = args.decay;
            cfg.hot_set.margin = args.margin;
            cfg.hot_set.cpu_compute = cpu;
            cfg.cost = args.cost;
            State::Ours(Box::new(Placer::new(h.blocks, h.experts, shape, cfg)?))
        }
    };
    let mut t = Totals::default();
    // Bytes queued on the H2D link at the end of the previous step (admissions, refreshes).
    let mut pending_bytes = match &state {
        State::Static(set) => set.len() as u64 * h.expert_bytes,
        _ => 0,
    };
    t.expert_h2d_bytes += pending_bytes;
    for i in 0..trace.steps.len() {
        let step = trace.steps[i].0;
        let mut blocks_s = 0.0;
        let mut step_h2d = 0;
        let mut used_resident: Vec<ExpertId> = Vec::new();
        for b in 0..h.blocks {
            let tokens = trace.tokens(i, b);
            let mask: Vec<bool> = (0..h.experts).map(|e| state.resident(ExpertId::new(b, e))).collect();
            let placements = match &state {
                State::Ours(p) => p.place_block(b, tokens)?,
                _ => cost.place_block(tokens, &mask, ColdMode::FetchOnly),
            };
            let c = cost.block_cost(tokens, &placements);
            blocks_s += c.block_s;
            step_h2d += c.h2d_bytes;
            t.cpu_tokens += c.cpu_tokens;
            for (e, (&n, &p)) in tokens.iter().zip(&placements).enumerate() {
                if n == 0 {
                    continue;
                }
                let id = ExpertId::new(b, e as u32);
                t.uses += 1;
                match p {
                    Placement::Resident => {
                        t.hits += 1;
                        t.resident_hits += 1;
                        used_resident.push(id);
                    }
                    Placement::Cpu => t.hits += 1,
                    Placement::Fetch => t.fetches += 1,
                    Placement::Skip => {}
                }
            }
            if let State::Lru { cap, clock, cache } = &mut state {
                for (e, &n) in tokens.iter().enumerate() {
                    if n == 0 {
                        continue;
                    }
                    *clock += 1;
                    cache.insert(ExpertId::new(b, e as u32), *clock);
                    if cache.len() > *cap {
                        let victim = *cache.iter().min_by_key(|(id, &used)| (used, **id)).expect("non-empty").0;
                        cache.remove(&victim);
                    }
                }
            }
        }
        t.expert_h2d_bytes += step_h2d;
        let link_s = cost.h2d_s(step_h2d + pending_bytes);
        t.step_s_sum += blocks_s.max(link_s);
        // Between steps: statistics, re-placement, refreshes of kept experts that were updated.
        let mut admitted = 0;
        match &mut state {
            State::Ours(p) => {
                for b in 0..h.blocks {
                    p.observe_routing(step, b, trace.tokens(i, b))?;
                }
                admitted = p.replan().admit.len() as u64 * h.expert_bytes;
            }
            State::Lru { cache, .. } => {
                // Every cached expert used this step (hit or inserted miss) was updated.
                used_resident = (0..h.blocks)
                    .flat_map(|b| (0..h.experts).map(move |e| ExpertId::new(b, e)))
                    .filter(|id| cache.contains_key(id) && trace.tokens(i, id.block)[id.expert as usize] > 0)
                    .collect();
            }
            _ => {}
        }
        let refresh = used_resident.iter().filter(|&&id| state.resident(id)).count() as u64 * h.expert_bytes;
        t.expert_h2d_bytes += admitted;
        t.refresh_h2d_bytes += refresh;
        pending_bytes = admitted + refresh;
    }
    Ok(t)
}

/// Replays `trace` under every policy.
///
/// # Errors
/// A budget below one expert, bad rates, or a trace whose shape the placer refuses.
pub fn run(trace: &RoutingTrace, args: &MoeBenchArgs) -> Result<Vec<MoeBenchRow>> {
    if !(args.budget_fraction > 0.0 && args.budget_fraction <= 1.0) {
        return Err(Error::invalid(format!("--budget-fraction {}", args.budget_fraction), "must be in (0, 1]"));
    }
    if trace.steps.is_empty() {
        return Err(Error::invalid("the routing trace", "has no steps"));
    }
    let h = &trace.header;
    let all = h.blocks as u64 * h.experts as u64 * h.expert_bytes;
    let budget_bytes = (all as f64 * args.budget_fraction) as u64;
    let steps = trace.steps.len() as f64;
    let mut rows: Vec<MoeBenchRow> = Vec::new();
    for kind in Kind::ALL {
        let t = replay(trace, args, budget_bytes, kind).with_context(|| format!("policy {}", kind.name()))?;
        let uses = t.uses.max(1) as f64;
        rows.push(MoeBenchRow {
            policy: kind.name().into(),
            budget_bytes,
            expert_h2d_bytes: t.expert_h2d_bytes,
            refresh_h2d_bytes: t.refresh_h2d_bytes,
            bytes_vs_fetch: 0.0,
            hit_rate: t.hits as f64 / uses,
            resident_rate: t.resident_hits as f64 / uses,
            cpu_tokens: t.cpu_tokens,
            fetches: t.fetches,
            uses: t.uses,
            step_s: t.step_s_sum / steps,
            speedup_vs_fetch: 0.0,
        });
    }
    let (fetch_bytes, fetch_s) = (rows[0].expert_h2d_bytes.max(1) as f64, rows[0].step_s);
    for r in &mut rows {
        r.bytes_vs_fetch = r.expert_h2d_bytes as f64 / fetch_bytes;
        r.speedup_vs_fetch = if r.step_s > 0.0 { fetch_s / r.step_s } else { 0.0 };
    }
    Ok(rows)
}

/// Prints the rows as a table.
pub fn print_table(trace: &RoutingTrace, rows: &[MoeBenchRow]) {
    let h = &trace.header;
    println!(
        "{} steps, {} blocks x {} experts (top-{}), {} tokens/step, {} B/expert; expert budget {} B",
        trace.steps.len(),
        h.blocks,
        h.experts,
        h.top_k,
        h.tokens_per_step,
        h.expert_bytes,
        rows.first().map_or(0, |r| r.budget_bytes)
    );
    println!(
        "{:<16} {:>14} {:>7} {:>14} {:>8} {:>9} {:>10} {:>11} {:>8}",
        "policy", "expert H2D B", "x fetch", "refresh B", "hit %", "resident%", "CPU tokens", "step ms", "speedup"
    );
    for r in rows {
        println!(
            "{:<16} {:>14} {:>7.3} {:>14} {:>8.1} {:>9.1} {:>10} {:>11.4} {:>8.3}",
            r.policy,
            r.expert_h2d_bytes,
            r.bytes_vs_fetch,
            r.refresh_h2d_bytes,
            100.0 * r.hit_rate,
            100.0 * r.resident_rate,
            r.cpu_tokens,
            1e3 * r.step_s,
            r.speedup_vs_fetch
        );
    }
}

#[cfg(test)]
mod tests {
    use oogc_moe_placement::{synthetic_trace, SyntheticConfig};

    use super::*;

    #[test]
    fn structural_properties_hold_on_a_synthetic_trace() {
        let trace = synthetic_trace(&SyntheticConfig { steps: 40, ..SyntheticConfig::default() }).unwrap();
        let rows = run(&trace, &MoeBenchArgs::default()).unwrap();
        let names: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
        assert_eq!(names, ["fetch-on-demand", "lru", "static", "ours", "ours-no-cpu"]);
        let fetch = &rows[0];
        // By construction: fetch-on-demand moves one expert per use and serves nothing in place.
        assert_eq!(fetch.expert_h2d_bytes, fetch.uses * trace.header.expert_bytes);
        assert_eq!((fetch.hit_rate, fetch.refresh_h2d_bytes, fetch.cpu_tokens), (0.0, 0, 0));
        for r in &rows {
            assert_eq!(r.uses, fetch.uses, "{r:?}");
            assert!(r.hit_rate >= r.resident_rate && r.hit_rate <= 1.0, "{r:?}");
            assert!(r.step_s > 0.0 && r.step_s.is_finite(), "{r:?}");
            if r.policy != "ours" {
                assert_eq!(r.cpu_tokens, 0, "{r:?}");
            }
        }
        // A policy that serves a use in place does not fetch it.
        for r in &rows[1..] {
            assert_eq!(r.fetches, r.uses - (r.hit_rate * r.uses as f64).round() as u64, "{r:?}");
        }
    }

    #[test]
    fn a_budget_below_one_expert_is_refused() {
        let trace = synthetic_trace(&SyntheticConfig { steps: 2, ..SyntheticConfig::default() }).unwrap();
        let args = MoeBenchArgs { budget_fraction: 0.001, ..MoeBenchArgs::default() };
        let e = run(&trace, &args).unwrap_err();
        assert!(e.report().contains("raise the expert budget"), "{}", e.report());
    }
}
