//! The trainer's MoE blocks: where each routed expert runs ([`ExpertPlacement`] or the
//! `oogc-moe-placement` [`Placer`]), the block's forward and backward through the [`Runtime`],
//! and the bookkeeping between steps (popularity, the hot set's replan, the routing trace).
//!
//! Per block and step each expert is **resident** (hot: pinned from its forward to its
//! backward), **fetched** (H2D, computed on the device), computed on the **CPU** from its host
//! copy (gradients straight to the CPU optimizer, no D2H), or **skipped** (no tokens: no
//! transfer, no compute, no gradient).

use std::collections::{HashMap, HashSet};
use std::io::BufWriter;
use std::time::Instant;

use candle_core::Tensor;
use oogc_models::{CausalLm, MoeLm, Routing, UnitKind};
use oogc_moe_placement::{ExpertId, Placement, Placer, RoutingTraceWriter, TraceHeader};

use super::{Result, TrainError};
use crate::checkpoint::CheckpointError;
use crate::config::TrainConfig;
use crate::runtime::{Phase, Runtime, UnitId, UnitParams};

/// Where the experts of an MoE model run in a step, fixed by the caller (tests, baselines)
/// instead of the placer (DESIGN.md: hot experts stay on the GPU, a cold expert is fetched or
/// computed on the CPU, whichever is cheaper).
#[derive(Debug, Clone, Default)]
pub struct ExpertPlacement {
    /// (block, expert) pairs kept on the device from their forward to their backward in a step;
    /// `block` is the layer index (`UnitKind::Expert { block, .. }`, dense layers counted).
    pub hot: HashSet<(usize, usize)>,
    /// A cold expert with at most this many routed tokens runs on the CPU from its host copy
    /// (no H2D, gradients straight to the CPU optimizer); 0: cold experts are always fetched.
    pub cpu_max_tokens: usize,
}

impl ExpertPlacement {
    fn place(&self, block: usize, expert: usize, tokens: usize) -> Placement {
        if tokens == 0 {
            Placement::Skip
        } else if self.hot.contains(&(block, expert)) {
            Placement::Resident
        } else if tokens <= self.cpu_max_tokens {
            Placement::Cpu
        } else {
            Placement::Fetch
        }
    }
}

/// `[moe] policy = "lru"`: an LRU cache of expert copies on the device, `cap` experts (the
/// expert budget's whole experts). A cached expert is held pinned (the trainer's `held` map);
/// an expert the cache evicts loses its pin, so the runtime may evict its copy.
#[derive(Debug)]
struct LruCache {
    cap: usize,
    clock: u64,
    last_use: HashMap<UnitId, u64>,
}

impl LruCache {
    /// Records a use of `unit` (inserting it) and returns the least recently used units evicted
    /// to keep at most `cap`.
    fn touch(&mut self, unit: UnitId) -> Vec<UnitId> {
        self.clock += 1;
        self.last_use.insert(unit, self.clock);
        let mut evicted = Vec::new();
        while self.last_use.len() > self.cap {
            let victim = *self.last_use.iter().min_by_key(|(_, &t)| t).map(|(u, _)| u).expect("non-empty");
            self.last_use.remove(&victim);
            evicted.push(victim);
        }
        evicted
    }
}

/// Expert traffic of one step, for the metrics: every use of a routed expert (forward and
/// backward) and how many moved no bytes H2D (a copy already on the device, or CPU compute).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertTraffic {
    /// Bytes of expert copies moved H2D (fetches of an expert without a device copy).
    pub h2d_bytes: u64,
    /// Uses of routed experts, forward and backward.
    pub uses: u64,
    /// Uses that moved no bytes H2D.
    pub hits: u64,
    /// Bytes of CPU-placed experts' inputs and outputs moved between the compute device and the
    /// host (their tokens' hidden states and gradients; 0 on the sim device, whose compute is
    /// the CPU already).
    pub cpu_link_bytes: u64,
}

/// A placement-crate error as a config error naming `key`.
fn moe_err(key: &'static str) -> impl Fn(oogc_moe_placement::Error) -> TrainError {
    move |e| TrainError::Config(crate::config::ConfigError::Invalid { key: key.into(), reason: e.to_string() })
}

/// The MoE side of a run.
pub(super) struct MoeState {
    /// A fixed placement ([`super::Trainer::set_expert_placement`]); `None`: the placer decides.
    pub(super) placement: Option<ExpertPlacement>,
    /// Popularity statistics, hot set and cost model (`[moe] policy = "ours"`).
    pub(super) placer: Option<Placer>,
    /// The run computes on the sim device (`[device] kind = "sim"`): its fetch times measure
    /// this CPU's load, not a link.
    sim: bool,
    /// The routing trace being written (`[moe] routing_trace`).
    routing_trace: Option<RoutingTraceWriter<BufWriter<std::fs::File>>>,
    /// Bytes of one expert's f32 compute copy.
    expert_bytes: u64,
    /// `[moe] policy = "lru"`: the cache.
    lru: Option<LruCache>,
    /// Each expert's unit, for moving hot experts' optimizers.
    units: HashMap<ExpertId, UnitId>,
    /// The MoE block number (the [`ExpertId`] block of the placer, the statistics and the
    /// routing trace: the sparse layers' order) of each sparse layer (the trainer's block index,
    /// `UnitKind::Expert { block, .. }`); the same numbers when every layer is sparse.
    ordinals: HashMap<usize, u32>,
    /// The placer's hot experts keep their optimizer on the device
    /// ([`crate::moe::device_optimizer`]).
    device_optimizer: bool,
    /// This step's expert traffic so far.
    pub(super) traffic: ExpertTraffic,
    /// With data-parallel ranks: per block, whether any rank routed tokens to each expert in
    /// this step's forward (the ranks whose own tokens missed it push zero gradients, so that
    /// every rank reduces the same experts' gradients in the same order, and an expert no rank
    /// used is not updated anywhere, as in one process with the whole batch).
    used_anywhere: HashMap<usize, Vec<bool>>,
    /// The run's ranks (the routing counts are summed over them).
    ranks: crate::dist::Ranks,
    /// The trainer's compute clock: the blocks' model calls are timed into it.
    clock: super::clock::ComputeClock,
}

/// The arguments of [`MoeState::block_backward`] that say which block.
pub(super) struct BlockBackward<'a> {
    /// 0-based block index: the layer (dense layers count).
    pub(super) block: usize,
    pub(super) trunk: UnitId,
    pub(super) experts: &'a [UnitId],
    /// The block's checkpointed input `[B, T, d]`.
    pub(super) x_in: &'a Tensor,
    /// The gradient of the block's output `[B, T, d]`.
    pub(super) grad_y: &'a Tensor,
}

impl MoeState {
    /// The placer (popularity, hot set under `[moe] expert_budget`, the cost model calibrated
    /// from the link and a measured CPU GEMM rate: [`crate::moe::placer_config`]) and the
    /// routing trace writer of an MoE run among `ranks`; the placer's popularity ranks expert
    /// copies for eviction (the runtime's fallback policy).
    ///
    /// # Errors
    /// An unwritable routing trace; an expert budget below one expert.
    pub(super) fn new(
        cfg: &TrainConfig,
        model: &dyn CausalLm,
        rt: &mut Runtime,
        ids: &[UnitId],
        ranks: crate::dist::Ranks,
        clock: super::clock::ComputeClock,
    ) -> Result<Self> {
        let world = ranks.world();
        let units = model.units();
        let expert_params = units.iter().find(|u| matches!(u.kind, UnitKind::Expert { .. })).map_or(0, |u| u.numel);
        let experts: Vec<(UnitId, usize, usize)> = units
            .iter()
            .zip(ids)
            .filter_map(|(u, &id)| match u.kind {
                UnitKind::Expert { block, expert } => Some((id, block, expert)),
                _ => None,
            })
            .collect();
        // The MoE blocks in layer order: the placer, the popularity statistics and the routing
        // trace number them 0, 1, .. (a model's dense layers among its sparse ones have none).
        let mut moe_layers: Vec<usize> = experts.iter().map(|&(_, b, _)| b).collect();
        moe_layers.dedup();
        let ordinals: HashMap<usize, u32> = moe_layers.iter().enumerate().map(|(i, &l)| (l, i as u32)).collect();
        let blocks = moe_layers.len();
        let per_block = experts.iter().map(|&(_, _, e)| e + 1).max().unwrap_or(0);
        let top_k = model.moe().map_or(1, |m| m.experts_per_token());
        let expert_bytes = rt.compute_dtype().num_bytes(expert_params) as u64;
        // Forward 2, recompute 2, backward 4 FLOPs per parameter and token.
        let flops_per_token = 8.0 * expert_params as f64;
        let tokens_per_step = (cfg.train.batch_size * cfg.train.seq_len) as u64;
        let header = TraceHeader::new(
            blocks as u32,
            per_block as u32,
            top_k as u32,
            expert_params as u64,
            expert_bytes,
            flops_per_token,
            tokens_per_step,
        );
        let routing_trace = match &cfg.moe.routing_trace {
            Some(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|source| {
                        TrainError::Checkpoint(CheckpointError::Io { path: dir.to_path_buf(), source })
                    })?;
                }
                Some(RoutingTraceWriter::create(path, header.clone()).map_err(moe_err("moe.routing_trace"))?)
            }
            None => None,
        };
        let device_optimizer = crate::moe::device_optimizer(cfg, expert_params, world)?;
        let placer = if crate::moe::places_experts(cfg) {
            // On the sim device the "GPU" is this CPU: both rates are the CPU GEMM rate, measured
            // unless the config gives it.
            let cpu = cfg.moe.cpu_gflops.unwrap_or_else(|| {
                oogc_moe_placement::calibrate_cpu_gemm() * cfg.threads.compute.unwrap_or(1).max(1) as f64
            });
            let pc = crate::moe::placer_config(cfg, cpu, expert_params, world);
            let placer = Placer::new(blocks as u32, per_block as u32, header.expert_shape(), pc)
                .map_err(moe_err("moe.expert_budget"))?;
            let ids = experts.iter().map(|&(u, b, e)| (rt.units().tensor(u), ExpertId::new(ordinals[&b], e as u32)));
            rt.set_fallback_policy(Box::new(placer.fallback(ids)));
            Some(placer)
        } else {
            None
        };
        let lru = (cfg.moe.policy == crate::config::MoePolicy::Lru).then(|| LruCache {
            cap: (crate::moe::expert_budget_bytes(cfg) / expert_bytes.max(1)).max(1) as usize,
            clock: 0,
            last_use: HashMap::new(),
        });
        let units = experts.iter().map(|&(u, b, e)| (ExpertId::new(ordinals[&b], e as u32), u)).collect();
        if device_optimizer {
            tracing::info!(
                hot_expert_bytes = crate::moe::hot_expert_bytes(cfg, expert_params, world),
                "moe: hot experts keep their optimizer on the device"
            );
        }
        Ok(Self {
            placement: None,
            placer,
            sim: cfg.device.kind.is_sim(),
            routing_trace,
            expert_bytes,
            lru,
            units,
            ordinals,
            device_optimizer,
            traffic: ExpertTraffic::default(),
            used_anywhere: HashMap::new(),
            ranks,
            clock,
        })
    }

    /// Where each expert of `block` (a sparse layer's index) runs for the routed `tokens`.
    fn place_block(&self, block: usize, tokens: &[usize]) -> Result<Vec<Placement>> {
        if let Some(p) = &self.placement {
            return Ok(tokens.iter().enumerate().map(|(e, &n)| p.place(block, e, n)).collect());
        }
        if self.lru.is_some() {
            // Every routed expert on the device, held while the cache keeps it.
            return Ok(tokens.iter().map(|&n| if n == 0 { Placement::Skip } else { Placement::Resident }).collect());
        }
        match &self.placer {
            Some(placer) => {
                let t: Vec<u64> = tokens.iter().map(|&n| n as u64).collect();
                placer.place_block(self.ordinals[&block], &t).map_err(moe_err("moe"))
            }
            // `fetch` / `resident`: every routed expert fetched on demand.
            None => Ok(tokens.iter().map(|&n| if n == 0 { Placement::Skip } else { Placement::Fetch }).collect()),
        }
    }

    /// Pins an expert where `placement` says: on the device, or its host copy for CPU compute.
    fn fetch_expert(rt: &mut Runtime, unit: UnitId, placement: Placement, phase: Phase) -> Result<UnitParams> {
        match placement {
            Placement::Cpu => Ok(rt.fetch_host(unit)?),
            _ => Ok(rt.fetch(unit, phase)?),
        }
    }

    /// [`MoeState::fetch_expert`], feeding the time of a real H2D copy (the expert had no device
    /// copy) to the cost model's bandwidth estimate. `batched`: the expert is in the block's
    /// announced fetch set ([`crate::runtime::Memory::will_fetch`]) and whether it lacked a device
    /// copy when announced — its bytes count as moved then, and its fetch's time is not one copy's
    /// (the batch loads with the set's first fetch), so the cost model does not hear it.
    fn timed_fetch_expert(
        &mut self,
        rt: &mut Runtime,
        unit: UnitId,
        placement: Placement,
        phase: Phase,
        batched: Option<bool>,
    ) -> Result<UnitParams> {
        let moves = batched.unwrap_or_else(|| placement != Placement::Cpu && !rt.memory().is_on_device(unit));
        // The cost model learns the link from timed fetches on a GPU. On the sim device the
        // link's rate is the configured throttle, and a fetch's wall time measures this CPU's
        // load as much as the link: the model keeps the configured rate, so placements (and
        // the numbers they lead to) do not depend on how busy the machine is.
        let cold = moves && batched.is_none() && self.placer.is_some() && !self.sim;
        if phase != Phase::Eval {
            self.count_use(moves);
        }
        let started = Instant::now();
        let p = Self::fetch_expert(rt, unit, placement, phase)?;
        if cold {
            if let Some(placer) = &mut self.placer {
                placer.cost_model_mut().observe_fetch(self.expert_bytes, started.elapsed().as_secs_f64());
            }
        }
        Ok(p)
    }

    fn count_use(&mut self, moves: bool) {
        self.traffic.uses += 1;
        if moves {
            self.traffic.h2d_bytes += self.expert_bytes;
        } else {
            self.traffic.hits += 1;
        }
    }

    /// LRU policy: records a use of `unit`; the experts the cache evicts lose their pin.
    fn lru_touch(&mut self, unit: UnitId, held: &mut HashMap<UnitId, UnitParams>) {
        if let Some(lru) = &mut self.lru {
            for victim in lru.touch(unit) {
                held.remove(&victim);
            }
        }
    }

    /// One MoE block forward: the trunk, the routed experts where placed (resident ones stay
    /// pinned in `held` until the backward when training), the combine. Returns the block's
    /// output, its routing and the placements.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block_forward(
        &mut self,
        rt: &mut Runtime,
        model: &dyn CausalLm,
        block: usize,
        trunk: UnitId,
        experts: &[UnitId],
        x: &Tensor,
        phase: Phase,
        held: &mut HashMap<UnitId, UnitParams>,
        cpu_tokens: &mut usize,
    ) -> Result<(Tensor, Routing, Vec<Placement>)> {
        let moe = model.moe().expect("an MoE model");
        let t = {
            let p = rt.fetch(trunk, phase)?;
            let _span = tracing::info_span!("compute::forward", unit = trunk.index()).entered();
            self.clock.time(|| moe.trunk_forward(block, p.tensor(), x))?
        };
        let counts = t.routing.counts();
        if phase != Phase::Eval && self.ranks.world().size > 1 {
            let mut anywhere: Vec<f64> = counts.iter().map(|&n| n as f64).collect();
            self.ranks.all_reduce_sum_f64(&mut anywhere).map_err(crate::runtime::RuntimeError::from)?;
            self.used_anywhere.insert(block, anywhere.iter().map(|&n| n > 0.0).collect());
        }
        let placements = self.place_block(block, &counts)?;
        // The block's fetch set: its routed experts that run on the device, loaded together.
        let on_device: Vec<UnitId> = (0..experts.len())
            .filter(|&e| matches!(placements[e], Placement::Fetch | Placement::Resident) && counts[e] > 0)
            .map(|e| experts[e])
            .collect();
        // Whether each expert lacked a device copy when announced (its traffic, counted below).
        let missing: Vec<bool> = experts.iter().map(|&u| !rt.memory().is_on_device(u)).collect();
        let announced = on_device.len() > 1;
        rt.memory().will_fetch(&on_device);
        let mut outs: Vec<Option<Tensor>> = vec![None; t.routing.num_experts()];
        for (e, out) in outs.iter_mut().enumerate() {
            let Some(h_e) = self.clock.time(|| t.routing.expert_input(e, &t.h))? else { continue };
            let tokens = counts[e];
            let on_cpu = placements[e] == Placement::Cpu;
            let batched = (announced && placements[e] != Placement::Cpu).then_some(missing[e]);
            let p = self.timed_fetch_expert(rt, experts[e], placements[e], phase, batched)?;
            if on_cpu {
                *cpu_tokens += tokens;
            }
            let _span = tracing::info_span!("compute::expert_forward", block, expert = e, tokens, on_cpu).entered();
            let clock = self.clock.clone();
            *out = Some(clock.time(|| -> Result<Tensor> {
                Ok(if on_cpu {
                    // A CPU expert (Fiddler's placement): its tokens to the host, its output back.
                    let h_cpu = self.move_to_host(&h_e)?;
                    let y = moe.expert_forward(p.tensor(), &h_cpu)?;
                    self.move_to_compute(&y, h_e.device())?
                } else {
                    moe.expert_forward(p.tensor(), &h_e)?
                })
            })?);
            if placements[e] == Placement::Resident && phase != Phase::Eval {
                self.lru_touch(experts[e], held);
                held.insert(experts[e], p);
            }
        }
        let y = self.clock.time(|| moe.combine(&t.x1, &t.routing, &outs))?;
        Ok((y, t.routing, placements))
    }

    /// One MoE block backward: recompute the trunk, each routed expert's backward where it ran
    /// (its gradients pushed D2H, or straight to the CPU optimizer when it ran on the CPU), the
    /// trunk's backward. Returns the gradient of the block's input.
    pub(super) fn block_backward(
        &mut self,
        rt: &mut Runtime,
        model: &dyn CausalLm,
        args: BlockBackward<'_>,
        routing: &Routing,
        placements: &[Placement],
        held: &mut HashMap<UnitId, UnitParams>,
    ) -> Result<Tensor> {
        let moe: &dyn MoeLm = model.moe().expect("an MoE model");
        let BlockBackward { block, trunk, experts, x_in, grad_y } = args;
        let p = rt.fetch(trunk, Phase::Backward)?;
        let t = self.clock.time(|| moe.trunk_forward(block, p.tensor(), x_in))?;
        let n = routing.num_experts();
        let counts = routing.counts();
        let on_device: Vec<UnitId> = (0..n)
            .filter(|&e| placements[e] != Placement::Cpu && counts[e] > 0 && !held.contains_key(&experts[e]))
            .map(|e| experts[e])
            .collect();
        // Whether each expert lacked a device copy when announced (its traffic).
        let missing: Vec<bool> = experts.iter().map(|&u| !rt.memory().is_on_device(u)).collect();
        rt.memory().will_fetch(&on_device);
        let mut grad_inputs: Vec<Option<Tensor>> = vec![None; n];
        let mut grad_gates: Vec<Option<Tensor>> = vec![None; n];
        for e in 0..n {
            let Some(h_e) = self.clock.time(|| routing.expert_input(e, &t.h))? else {
                if self.used_anywhere.get(&block).is_some_and(|used| used[e]) {
                    // Another rank's tokens used it: this rank's share of its gradients is zero.
                    let numel = rt.units().numel(experts[e]);
                    let zeros = Tensor::zeros(numel, candle_core::DType::F32, &candle_core::Device::Cpu)?;
                    rt.push_grads_host(experts[e], &zeros)?;
                }
                continue;
            };
            let grad_out = self.clock.time(|| moe.expert_grad_output(routing, e, grad_y))?.expect("active expert");
            let tokens = routing.tokens(e).len();
            let on_cpu = placements[e] == Placement::Cpu;
            let pe = match held.remove(&experts[e]) {
                Some(pe) => {
                    self.count_use(false);
                    pe
                }
                None => {
                    self.count_use(placements[e] != Placement::Cpu && missing[e]);
                    Self::fetch_expert(rt, experts[e], placements[e], Phase::Backward)?
                }
            };
            self.lru_touch(experts[e], held);
            let g = {
                let _span =
                    tracing::info_span!("compute::expert_backward", block, expert = e, tokens, on_cpu).entered();
                let clock = self.clock.clone();
                clock.time(|| -> Result<_> {
                    Ok(if on_cpu {
                        let (h_cpu, go_cpu) = (self.move_to_host(&h_e)?, self.move_to_host(&grad_out)?);
                        let mut g = moe.expert_backward(pe.tensor(), &h_cpu, &go_cpu)?;
                        g.output = self.move_to_compute(&g.output, h_e.device())?;
                        g.grad_input = self.move_to_compute(&g.grad_input, h_e.device())?;
                        g
                    } else {
                        moe.expert_backward(pe.tensor(), &h_e, &grad_out)?
                    })
                })?
            };
            drop(pe);
            if on_cpu {
                rt.push_grads_host(experts[e], &g.grad_params)?;
            } else {
                rt.push_grads(experts[e], &g.grad_params)?;
            }
            grad_gates[e] = self.clock.time(|| moe.expert_grad_gate(routing, e, grad_y, &g.output))?;
            grad_inputs[e] = Some(g.grad_input);
        }
        let g = {
            let _span = tracing::info_span!("compute::backward", unit = trunk.index()).entered();
            self.clock.time(|| -> Result<_> {
                let grad_h = routing.scatter_input_grads(&grad_inputs)?;
                Ok(moe.trunk_backward(block, p.tensor(), x_in, routing, grad_y, &grad_h, &grad_gates)?)
            })?
        };
        drop(p);
        rt.push_grads(trunk, &g.grad_params)?;
        Ok(g.grad_input.expect("the trunk returns its input's gradient"))
    }

    /// `t` in host memory for a CPU expert: itself on the sim device (its compute is the CPU),
    /// else a D2H copy whose bytes count in [`ExpertTraffic::cpu_link_bytes`].
    fn move_to_host(&mut self, t: &Tensor) -> Result<Tensor> {
        if t.device().is_cpu() {
            return Ok(t.clone());
        }
        self.traffic.cpu_link_bytes += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        // A CPU-placed expert computes on the CPU by nature.
        Ok(t.to_device(&candle_core::Device::Cpu)?)
    }

    /// A CPU expert's result `t` back on the compute device `device` (an H2D copy counted in
    /// [`ExpertTraffic::cpu_link_bytes`]; itself when that is the CPU).
    fn move_to_compute(&mut self, t: &Tensor, device: &candle_core::Device) -> Result<Tensor> {
        if device.is_cpu() {
            return Ok(t.clone());
        }
        self.traffic.cpu_link_bytes += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        Ok(t.to_device(device)?)
    }

    /// Between steps: the step's routing (`routed[block][expert]` tokens, `block` the MoE block
    /// number: the sparse layers in order) feeds the popularity
    /// statistics and the routing trace, and the hot set is re-placed (with hysteresis). With
    /// device optimizers the experts leaving the hot set take their optimizer back to the host
    /// first, then those entering move theirs to the device (their state's H2D bytes count in
    /// the step's expert traffic).
    ///
    /// # Errors
    /// A routing the statistics refuse; the trace cannot be written; moving an optimizer fails.
    pub(super) fn after_step(&mut self, rt: &mut Runtime, step: u64, routed: &[Vec<usize>]) -> Result<()> {
        for (i, counts) in routed.iter().enumerate() {
            let t: Vec<u64> = counts.iter().map(|&n| n as u64).collect();
            if let Some(placer) = &self.placer {
                placer.observe_routing(step, i as u32, &t).map_err(moe_err("moe"))?;
            }
            if let Some(w) = &mut self.routing_trace {
                w.record(step, i as u32, &t).map_err(moe_err("moe.routing_trace"))?;
            }
        }
        if let Some(lru) = &mut self.lru {
            // The step's update made every cached copy stale.
            lru.last_use.clear();
        }
        if let Some(placer) = &mut self.placer {
            let change = placer.replan();
            tracing::debug!(?change, "moe: hot set");
            if self.device_optimizer {
                use crate::runtime::OptimizerPlace;
                for (ids, place) in [(&change.evict, OptimizerPlace::Host), (&change.admit, OptimizerPlace::Device)] {
                    for id in ids {
                        let moved = rt.place_optimizer(self.units[id], place)?;
                        if place == OptimizerPlace::Device {
                            self.traffic.h2d_bytes += moved;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
