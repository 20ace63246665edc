//! The MoE placement of a training config, in one place for the trainer and the planner: the
//! expert budget, the popularity decay, and the cost model's rates ([`placer_config`]).
//!
//! | rate | sim device | CUDA |
//! |---|---|---|
//! | H2D, D2H | `[device] link_gbps` when throttled, else 16 GB/s | 16 GB/s |
//! | GPU | the CPU's rate (the sim device computes on this CPU) | the cost model's default |
//! | CPU | the caller's measured or profiled CPU GEMM rate | the same |

use oogc_moe_placement::{CostModelConfig, PlacerConfig};

use crate::config::{ConfigError, MoePolicy, TrainConfig};
use crate::dist::World;

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

/// Whether the hot experts of `cfg`'s run keep their optimizer on the device (`[moe]
/// device_optimizer`, with `policy = "ours"`): `true` when set so; unset, when the expert budget
/// holds at least one expert of `expert_params` parameters with its optimizer
/// ([`crate::runtime::device_optimizer_bytes`]). Off with data-parallel ranks (`world.size > 1`:
/// each rank's optimizer holds a shard of every expert's state).
///
/// # Errors
/// [`ConfigError::Invalid`] naming `moe.expert_budget` when `device_optimizer = true` and the
/// budget cannot hold one such expert, or naming `moe.device_optimizer` when it is `true` with
/// several ranks.
pub fn device_optimizer(cfg: &TrainConfig, expert_params: usize, world: World) -> Result<bool, ConfigError> {
    if !places_experts(cfg) {
        return Ok(false);
    }
    let need = device_expert_bytes(cfg, expert_params);
    let fits = expert_budget_bytes(cfg) >= need;
    let ranks = world.size;
    if ranks > 1 {
        // Each rank's optimizer holds a shard of every expert's state.
        return match cfg.moe.device_optimizer {
            Some(true) => Err(ConfigError::Invalid {
                key: "moe.device_optimizer".into(),
                reason: format!(
                    "device optimizers with {ranks} data-parallel ranks are not supported (each rank's optimizer \
                     holds a shard of every expert's state); fix: set [moe] device_optimizer = false, or leave it \
                     unset (off with ranks)"
                ),
            }),
            _ => Ok(false),
        };
    }
    match cfg.moe.device_optimizer {
        Some(false) => Ok(false),
        None => Ok(fits),
        Some(true) if fits => Ok(true),
        Some(true) => Err(ConfigError::Invalid {
            key: "moe.expert_budget".into(),
            reason: format!(
                "{} bytes cannot hold one hot expert with its optimizer on the device ({need} bytes: master \
                 weights, {} moments, gradients and the compute copy); fix: raise [moe] expert_budget to at least \
                 {need} bytes, or set [moe] device_optimizer = false",
                expert_budget_bytes(cfg),
                cfg.optimizer.state_dtype
            ),
        }),
    }
}

/// GPU bytes of one expert of `expert_params` parameters with its optimizer on the device in
/// `cfg`'s run ([`crate::runtime::device_optimizer_bytes`] with the compute dtype and
/// `[optimizer] state_dtype`).
pub fn device_expert_bytes(cfg: &TrainConfig, expert_params: usize) -> u64 {
    crate::runtime::device_optimizer_bytes(expert_params, cfg.train.compute_dtype.dtype(), cfg.optimizer.state_dtype)
}

/// GPU bytes of one hot expert of `expert_params` parameters in `cfg`'s run: its compute copy,
/// and its optimizer when [`device_optimizer`] says so for `world` (an error there counts as not).
pub fn hot_expert_bytes(cfg: &TrainConfig, expert_params: usize, world: World) -> u64 {
    let dtype = cfg.train.compute_dtype.dtype();
    if device_optimizer(cfg, expert_params, world).unwrap_or(false) {
        device_expert_bytes(cfg, expert_params)
    } else {
        dtype.num_bytes(expert_params) as u64
    }
}

/// The placer's settings for `cfg`: the expert budget, `[moe] popularity_decay` and
/// `cpu_compute`, and the cost model's rates (module docs) with `cpu_gflops` the CPU's GEMM rate
/// in GFLOP/s (measured by the trainer, profiled by the planner); with hot experts of
/// `expert_params` parameters keeping their optimizer on the device ([`device_optimizer`] for
/// `world`), the hot set counts and moves their optimizer state.
pub fn placer_config(cfg: &TrainConfig, cpu_gflops: f64, expert_params: usize, world: World) -> PlacerConfig {
    let mut pc = PlacerConfig::new(expert_budget_bytes(cfg));
    if device_optimizer(cfg, expert_params, world).unwrap_or(false) {
        // A hot expert holds its optimizer too, moves its state (f32 master weights and the
        // moments as stored: 12, 8 or 6.03 B per parameter) to enter, and keeps its gradients on
        // the device.
        pc.hot_expert_bytes = Some(device_expert_bytes(cfg, expert_params));
        pc.hot_set.admit_bytes =
            Some((4 * expert_params + cfg.optimizer.state_dtype.moment_bytes(expert_params)) as u64);
        pc.hot_set.keeps_gradients = true;
    }
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
