//! The MoE placement of a training config, in one place for the trainer and the planner: the
//! expert budget, the popularity decay, and the cost model's rates ([`placer_config`]).
//!
//! | rate | sim device | CUDA |
//! |---|---|---|
//! | H2D, D2H | `[device] link_gbps` when throttled, else 16 GB/s | 16 GB/s |
//! | GPU | the CPU's rate (the sim device computes on this CPU) | the cost model's default |
//! | CPU | the caller's measured or profiled CPU GEMM rate | the same |

use oogc_moe_placement::{CostModelConfig, PlacerConfig};

use crate::config::{MoePolicy, TrainConfig};

/// H2D/D2H rate the cost model starts from when the link is not throttled: a PCIe 4 x16 link's
/// achievable rate, GB/s.
pub const DEFAULT_LINK_GBPS: f64 = 16.0;

/// GPU bytes for hot experts: `[moe] expert_budget`, else a quarter of `[budgets] gpu`.
pub fn expert_budget_bytes(cfg: &TrainConfig) -> u64 {
    cfg.moe.expert_budget.map_or(cfg.budgets.gpu.as_u64() / 4, |b| b.as_u64())
}

/// The link rate of the config, GB/s: the sim device's throttle when it has one, else
/// [`DEFAULT_LINK_GBPS`].
pub fn link_gbps(cfg: &TrainConfig) -> f64 {
    if cfg.device.kind.is_sim() && cfg.device.link_gbps > 0.0 {
        cfg.device.link_gbps
    } else {
        DEFAULT_LINK_GBPS
    }
}

/// Whether the config keeps a hot set and computes cold experts where the cost model says
/// (`[moe] policy = "ours"`); otherwise every routed expert is fetched.
pub fn places_experts(cfg: &TrainConfig) -> bool {
    cfg.moe.policy == MoePolicy::Ours
}

/// The placer's settings for `cfg`: the expert budget, `[moe] popularity_decay` and
/// `cpu_compute`, and the cost model's rates (module docs) with `cpu_gflops` the CPU's GEMM rate
/// in GFLOP/s (measured by the trainer, profiled by the planner).
pub fn placer_config(cfg: &TrainConfig, cpu_gflops: f64) -> PlacerConfig {
    let mut pc = PlacerConfig::new(expert_budget_bytes(cfg));
    pc.decay = cfg.moe.popularity_decay;
    pc.hot_set.cpu_compute = cfg.moe.cpu_compute;
    let link = link_gbps(cfg);
    pc.cost = CostModelConfig {
        h2d_gbps: link,
        d2h_gbps: link,
        gpu_gflops: if cfg.device.kind.is_sim() { cpu_gflops } else { pc.cost.gpu_gflops },
        cpu_gflops,
        ..pc.cost
    };
    pc
}
