//! A discrete-event simulator of training steps: the device tier under a budget, the links
//! (H2D, D2H, NVMe read, NVMe write) as FIFO servers with a bandwidth, the GPU compute stream and
//! the CPU optimizer, driven by the same [`EvictionPolicy`] and [`Prefetcher`] code as the real
//! runtime.
//!
//! The step follows DESIGN.md: the schedule's entries in order; a device entry acquires its unit
//! (a miss is fetched H2D after evicting by the policy, waiting for arriving copies if nothing
//! else can go), the prefetcher plans the window, the unit computes (`forward_s`, or
//! `backward_s` for the recompute + VJP); after a backward, the unit's gradients go D2H and,
//! when its optimizer state is on NVMe, the state is read as the backward starts. A host-tier
//! optimizer entry runs the unit's CPU optimizer step (`numel / optimizer_params_per_s`) once
//! its gradients (and state) arrived, on one CPU resource in order, then writes the state back
//! to NVMe; its write to the host copy drops the device copy, and the unit's next fetch waits
//! for the update (the next forward's unit 0 waits for the last update).
//!
//! Several steps run back to back; the report is the last one (steady state: the next-use
//! distances wrap, and the step pays the previous step's optimizer tail).
//!
//! Simplifications: one unit is pinned at a time (the current one); a write-back delays the
//! fetch that needed the room; stale device copies are dropped when the schedule reaches the
//! optimizer entry (the real runtime drops them when the optimizer starts, a little later).
//! A unit of 0 bytes (computed on the host: an MoE expert kept on the CPU) moves nothing and
//! never waits for a link; it still computes on the compute stream and updates on the CPU.

use std::collections::HashMap;

use oogc_swapper::policy::eviction_order;
use oogc_swapper::{EvictionCandidate, EvictionPolicy, TensorId, Tier};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::policy::PolicyKind;
use crate::prefetcher::{CopyView, PrefetchConfig, Prefetcher, ResidentView, TierSnapshot};
use crate::schedule::{check_budget, Phase, Schedule};

/// Bandwidth of each link, GB/s (10⁹ bytes per second).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkBandwidths {
    /// Host → device, GB/s.
    pub h2d_gbps: f64,
    /// Device → host, GB/s.
    pub d2h_gbps: f64,
    /// NVMe → host, GB/s.
    pub nvme_read_gbps: f64,
    /// Host → NVMe, GB/s.
    pub nvme_write_gbps: f64,
}

impl Default for LinkBandwidths {
    /// PCIe 4.0 x16-like links and one NVMe drive: 25, 25, 3, 3 GB/s.
    fn default() -> Self {
        Self { h2d_gbps: 25.0, d2h_gbps: 25.0, nvme_read_gbps: 3.0, nvme_write_gbps: 3.0 }
    }
}

/// One unit as the simulator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimUnit {
    /// The unit (its compute copy's swapper tensor).
    pub id: TensorId,
    /// Bytes of the compute copy (what moves H2D).
    pub num_bytes: u64,
    /// Parameters (the optimizer's work and its state: `optimizer_state_bytes_per_param` each).
    pub numel: u64,
    /// Bytes of the gradients sent D2H after the unit's backward.
    pub grad_bytes: u64,
    /// Forward compute time, seconds.
    pub forward_s: f64,
    /// Backward compute time (recompute + VJP), seconds.
    pub backward_s: f64,
    /// Whether the unit's optimizer state (master weights, m, v) lives on NVMe.
    pub optimizer_on_nvme: bool,
}

impl SimUnit {
    /// A unit of `num_bytes` bf16 compute copy (`numel = num_bytes / 2`, gradients the same
    /// size), no compute time, optimizer state in host memory.
    pub fn bf16(id: TensorId, num_bytes: u64) -> Self {
        Self {
            id,
            num_bytes,
            numel: num_bytes / 2,
            grad_bytes: num_bytes,
            forward_s: 0.0,
            backward_s: 0.0,
            optimizer_on_nvme: false,
        }
    }
}

/// Inputs of a simulation besides the schedule and the units.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    /// Device bytes available to units. Must be ≥ [`crate::min_working_set`].
    pub device_budget_bytes: u64,
    /// Link bandwidths.
    pub links: LinkBandwidths,
    /// CPU optimizer rate, parameters per second (all optimizer threads together).
    pub optimizer_params_per_s: f64,
    /// Bytes of optimizer state per parameter on host or NVMe (fp32 master + Adam m + v: 12;
    /// 8 with bf16 moments, 6.03 with int8).
    pub optimizer_state_bytes_per_param: f64,
    /// Steps simulated back to back (the last is reported). Default: 3. Must be ≥ 2 for a
    /// steady state (1 is allowed and reports the cold step).
    pub steps: usize,
    /// The sliding window; `None`: demand fetches only.
    pub prefetch: Option<PrefetchConfig>,
    /// Build the Chrome/Perfetto trace of the last step.
    pub trace: bool,
}

impl SimConfig {
    /// A configuration with `device_budget_bytes`, default links, 1 Gparam/s optimizer, 12 B of
    /// state per parameter, 3 steps, the default window, no trace.
    pub fn new(device_budget_bytes: u64) -> Self {
        Self {
            device_budget_bytes,
            links: LinkBandwidths::default(),
            optimizer_params_per_s: 1e9,
            optimizer_state_bytes_per_param: 12.0,
            steps: 3,
            prefetch: Some(PrefetchConfig::default()),
            trace: false,
        }
    }

    fn validate(&self) -> Result<()> {
        let pos = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::Config { key: key.into(), reason: format!("{v} must be a finite number > 0") })
            }
        };
        pos("h2d_gbps", self.links.h2d_gbps)?;
        pos("d2h_gbps", self.links.d2h_gbps)?;
        pos("nvme_read_gbps", self.links.nvme_read_gbps)?;
        pos("nvme_write_gbps", self.links.nvme_write_gbps)?;
        pos("optimizer_params_per_s", self.optimizer_params_per_s)?;
        if self.steps == 0 {
            return Err(Error::Config { key: "steps".into(), reason: "must be >= 1".into() });
        }
        if let Some(p) = &self.prefetch {
            p.validate()?;
        }
        Ok(())
    }
}

/// Bytes per link, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// Host → device (unit fetches).
    pub h2d: u64,
    /// Device → host (gradients and dirty write-backs).
    pub d2h: u64,
    /// NVMe → host (optimizer state).
    pub nvme_read: u64,
    /// Host → NVMe (optimizer state).
    pub nvme_write: u64,
}

/// Peak bytes held per tier, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierBytes {
    /// Device: unit copies (ready and arriving).
    pub device: u64,
    /// Host: compute copies, in-memory optimizer state, gradients and NVMe state in flight.
    pub host: u64,
    /// NVMe: optimizer state of the units that keep it there.
    pub nvme: u64,
}

/// The result of a simulation: the last simulated step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    /// The eviction policy's name.
    pub policy: String,
    /// Step time, seconds (end of the previous step's compute to the end of this one's).
    pub step_s: f64,
    /// Compute time of the step, seconds.
    pub compute_s: f64,
    /// Time the compute stream waited for units, seconds (`step_s - compute_s`).
    pub stall_s: f64,
    /// Part of `stall_s` spent waiting for a unit's CPU optimizer step, seconds.
    pub exposed_optimizer_s: f64,
    /// The rest of `stall_s`: waiting for transfers, seconds.
    pub exposed_transfer_s: f64,
    /// Unit bytes moved between device and host by the policy (fetches H2D plus dirty
    /// write-backs D2H; gradients excluded), bytes.
    pub bytes_moved: u64,
    /// Bytes per link (gradients included), bytes.
    pub link_bytes: LinkBytes,
    /// Peak bytes per tier over all simulated steps.
    pub peak_bytes: TierBytes,
    /// Fetches the compute stream asked for (misses).
    pub demand_fetches: u64,
    /// Fetches issued by the prefetcher.
    pub prefetches: u64,
    /// Copies evicted to make room.
    pub evictions: u64,
    /// The Chrome/Perfetto trace of the last step (`traceEvents`; `ts`/`dur` in µs), when asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<Value>,
}

struct Copy {
    ready_at: f64,
    last_use: u64,
    dirty: bool,
}

#[derive(Clone, Copy)]
struct Link {
    free_at: f64,
    bytes_per_s: f64,
}

const H2D: usize = 0;
const D2H: usize = 1;
const NVME_READ: usize = 2;
const NVME_WRITE: usize = 3;
const TID_COMPUTE: u32 = 1;
const TID_OPTIMIZER: u32 = 6;
const LINK_TID: [u32; 4] = [2, 3, 4, 5];
/// Bytes of the optimizer state of `numel` parameters at `per_param` bytes each, rounded up.
fn state_bytes(numel: u64, per_param: f64) -> u64 {
    (numel as f64 * per_param).ceil() as u64
}

const LINK_NAME: [&str; 4] = ["h2d", "d2h", "nvme_read", "nvme_write"];

#[derive(Default)]
struct StepStats {
    compute_s: f64,
    stall_s: f64,
    exposed_opt_s: f64,
    bytes_moved: u64,
    link_bytes: [u64; 4],
    demand_fetches: u64,
    prefetches: u64,
    evictions: u64,
}

struct Sim<'a> {
    schedule: &'a Schedule,
    units: HashMap<TensorId, SimUnit>,
    cfg: &'a SimConfig,
    prefetcher: Option<Prefetcher>,
    copies: HashMap<TensorId, Copy>,
    used: u64,
    peak_device: u64,
    clock: u64,
    links: [Link; 4],
    cpu_free: f64,
    /// When each unit's last optimizer step finished (its host copy is final).
    gate: HashMap<TensorId, f64>,
    grad_at: HashMap<TensorId, (f64, f64)>,
    state_at: HashMap<TensorId, (f64, f64)>,
    host_intervals: Vec<(f64, f64, u64)>,
    recording: bool,
    events: Vec<Value>,
    stats: StepStats,
}

impl Sim<'_> {
    fn event(&mut self, tid: u32, name: String, start: f64, end: f64, args: Value) {
        if self.recording && self.cfg.trace {
            self.events.push(json!({
                "name": name, "ph": "X", "pid": 1, "tid": tid,
                "ts": start * 1e6, "dur": (end - start) * 1e6, "args": args,
            }));
        }
    }

    /// Queues `bytes` on `link` (FIFO) no earlier than `earliest`; returns (start, end). Nothing
    /// to move (a unit computed on the host) takes no time and does not wait for the link.
    fn transfer(&mut self, link: usize, earliest: f64, bytes: u64, unit: TensorId) -> (f64, f64) {
        if bytes == 0 {
            return (earliest, earliest);
        }
        let l = &mut self.links[link];
        let start = earliest.max(l.free_at);
        let end = start + bytes as f64 / l.bytes_per_s;
        l.free_at = end;
        if self.recording {
            self.stats.link_bytes[link] += bytes;
        }
        self.event(
            LINK_TID[link],
            format!("{} {}", LINK_NAME[link], unit.0),
            start,
            end,
            json!({"unit": unit.0, "bytes": bytes}),
        );
        (start, end)
    }

    /// Evicts by `policy` until `need` more bytes fit; with `may_wait`, waits for arriving
    /// copies when nothing is evictable. Returns the earliest time the fetch may start (after
    /// write-backs and waits), or `None` when it would have to wait and may not.
    fn make_room(
        &mut self,
        unit: TensorId,
        need: u64,
        now: f64,
        policy: &mut dyn EvictionPolicy,
        pinned: Option<TensorId>,
        may_wait: bool,
    ) -> Result<Option<f64>> {
        let budget = self.cfg.device_budget_bytes;
        let mut t = now;
        let mut earliest = now;
        loop {
            if self.used + need <= budget {
                return Ok(Some(earliest.max(t)));
            }
            let mut cands: Vec<EvictionCandidate> = self
                .copies
                .iter()
                .filter(|(id, c)| c.ready_at <= t && Some(**id) != pinned && **id != unit)
                .map(|(id, c)| EvictionCandidate {
                    id: *id,
                    tier: Tier::Device,
                    num_bytes: self.units[id].num_bytes,
                    last_use: c.last_use,
                    dirty: c.dirty,
                })
                .collect();
            if cands.is_empty() {
                let next = self.copies.values().map(|c| c.ready_at).filter(|&r| r > t).fold(f64::INFINITY, f64::min);
                if !may_wait {
                    return Ok(None);
                }
                if !next.is_finite() {
                    return Err(Error::Stuck {
                        time_s: t,
                        unit,
                        reason: format!("{need} B do not fit in {} B with nothing evictable", budget - self.used),
                    });
                }
                t = next;
                continue;
            }
            eviction_order(policy, &mut cands, self.clock);
            let v = cands[0];
            policy.on_evict(v.id, Tier::Device, self.clock);
            let c = self.copies.remove(&v.id).expect("candidate is resident");
            self.used -= v.num_bytes;
            if self.recording {
                self.stats.evictions += 1;
            }
            if c.dirty {
                let (_, end) = self.transfer(D2H, t, v.num_bytes, v.id);
                earliest = earliest.max(end);
                if self.recording {
                    self.stats.bytes_moved += v.num_bytes;
                }
            }
        }
    }

    fn fetch(&mut self, unit: TensorId, earliest: f64) {
        let bytes = self.units[&unit].num_bytes;
        let gate = self.gate.get(&unit).copied().unwrap_or(0.0);
        let (_, end) = self.transfer(H2D, earliest.max(gate), bytes, unit);
        self.copies.insert(unit, Copy { ready_at: end, last_use: self.clock, dirty: false });
        self.used += bytes;
        self.peak_device = self.peak_device.max(self.used);
        if self.recording {
            self.stats.bytes_moved += bytes;
        }
    }

    fn device_access(&mut self, pos: u64, t: f64, policy: &mut dyn EvictionPolicy) -> Result<f64> {
        let entry = *self.schedule.device_entry(pos);
        let u = entry.unit;
        let unit = self.units[&u];
        self.clock += 1;
        policy.on_acquire(u, Tier::Device, self.clock, false);
        if let Some(c) = self.copies.get_mut(&u) {
            c.last_use = self.clock;
        } else {
            let ok = self.make_room(u, unit.num_bytes, t, policy, None, true)?.expect("demand fetches may wait");
            self.fetch(u, ok);
            if self.recording {
                self.stats.demand_fetches += 1;
            }
        }
        let start = t.max(self.copies[&u].ready_at);
        if self.recording {
            let gate = self.gate.get(&u).copied().unwrap_or(0.0);
            self.stats.stall_s += start - t;
            self.stats.exposed_opt_s += (gate.min(start) - t).max(0.0);
        }
        if entry.write {
            self.copies.get_mut(&u).expect("resident").dirty = true;
        }
        // The window, planned as the acquire returns (the unit pinned).
        if let Some(pf) = self.prefetcher.clone() {
            let snapshot = TierSnapshot {
                budget_bytes: self.cfg.device_budget_bytes,
                used_bytes: self.used,
                copies: self
                    .copies
                    .iter()
                    .map(|(id, c)| ResidentView {
                        id: *id,
                        num_bytes: self.units[id].num_bytes,
                        state: if c.ready_at <= start { CopyView::Ready } else { CopyView::Loading },
                        pinned: *id == u,
                        last_use: c.last_use,
                        dirty: c.dirty,
                    })
                    .collect(),
                clock: self.clock,
            };
            let gate = &self.gate;
            let plan = pf.plan(self.schedule, pos, &snapshot, &*policy, &|x| gate.get(&x).is_some_and(|&g| g > start));
            for (p, need, _) in plan.fetch {
                self.clock += 1;
                policy.on_acquire(p, Tier::Device, self.clock, true);
                match self.make_room(p, need, start, policy, Some(u), false)? {
                    Some(ok) => {
                        self.fetch(p, ok);
                        if self.recording {
                            self.stats.prefetches += 1;
                        }
                    }
                    None => break,
                }
            }
        }
        let dur = match entry.phase {
            Phase::Forward => unit.forward_s,
            Phase::Backward => unit.backward_s,
            Phase::Optimizer | Phase::Eval => 0.0,
        };
        let end = start + dur;
        if self.recording {
            self.stats.compute_s += dur;
        }
        let phase = match entry.phase {
            Phase::Forward => "fwd",
            Phase::Backward => "bwd",
            Phase::Optimizer => "opt",
            Phase::Eval => "eval",
        };
        self.event(TID_COMPUTE, format!("{phase} {}", u.0), start, end, json!({"unit": u.0, "wait_s": start - t}));
        if entry.phase == Phase::Backward {
            if unit.optimizer_on_nvme {
                let bytes = state_bytes(unit.numel, self.cfg.optimizer_state_bytes_per_param);
                let (s, e) = self.transfer(NVME_READ, start, bytes, u);
                self.state_at.insert(u, (s, e));
            }
            let (s, e) = self.transfer(D2H, end, unit.grad_bytes, u);
            self.grad_at.insert(u, (s, e));
        }
        Ok(end)
    }

    fn host_access(&mut self, i: usize, t: f64, policy: &mut dyn EvictionPolicy) {
        let entry = self.schedule.entries()[i];
        let u = entry.unit;
        let unit = self.units[&u];
        self.clock += 1;
        policy.on_acquire(u, Tier::Host, self.clock, false);
        if entry.phase == Phase::Optimizer {
            let (g0, g1) = self.grad_at.remove(&u).unwrap_or((t, t));
            let state = self.state_at.remove(&u);
            let ready = g1.max(state.map_or(0.0, |s| s.1)).max(self.cpu_free);
            let end = ready + unit.numel as f64 / self.cfg.optimizer_params_per_s;
            self.cpu_free = end;
            self.gate.insert(u, end);
            self.event(TID_OPTIMIZER, format!("adam {}", u.0), ready, end, json!({"unit": u.0, "params": unit.numel}));
            self.host_intervals.push((g0, end, unit.grad_bytes));
            if let Some((s0, _)) = state {
                let bytes = state_bytes(unit.numel, self.cfg.optimizer_state_bytes_per_param);
                let (_, w1) = self.transfer(NVME_WRITE, end, bytes, u);
                self.host_intervals.push((s0, w1, bytes));
            }
        }
        if entry.write {
            // The host copy changes: the swapper drops the stale device copy.
            if let Some(_c) = self.copies.remove(&u) {
                self.used -= unit.num_bytes;
            }
        }
    }
}

/// Simulates `config.steps` steps of `schedule` over `units` with `policy`, and reports the last.
///
/// # Errors
/// [`Error::BudgetBelowWorkingSet`] before anything runs when the device budget is below
/// [`crate::min_working_set`]; [`Error::Config`] for a bandwidth or rate that is not positive
/// or zero steps; [`Error::UnknownUnit`] for a scheduled unit missing from `units`;
/// [`Error::Stuck`] if a fetch can never be placed.
pub fn simulate(
    schedule: &Schedule,
    units: &[SimUnit],
    config: &SimConfig,
    policy: &mut dyn EvictionPolicy,
) -> Result<SimReport> {
    config.validate()?;
    check_budget(schedule, config.device_budget_bytes)?;
    let units: HashMap<TensorId, SimUnit> = units.iter().map(|u| (u.id, *u)).collect();
    if let Some(e) = schedule.entries().iter().find(|e| !units.contains_key(&e.unit)) {
        return Err(Error::UnknownUnit { unit: e.unit });
    }
    let l = &config.links;
    let link = |gbps: f64| Link { free_at: 0.0, bytes_per_s: gbps * 1e9 };
    let mut sim = Sim {
        schedule,
        units,
        cfg: config,
        prefetcher: config.prefetch.map(Prefetcher::new).transpose()?,
        copies: HashMap::new(),
        used: 0,
        peak_device: 0,
        clock: 0,
        links: [link(l.h2d_gbps), link(l.d2h_gbps), link(l.nvme_read_gbps), link(l.nvme_write_gbps)],
        cpu_free: 0.0,
        gate: HashMap::new(),
        grad_at: HashMap::new(),
        state_at: HashMap::new(),
        host_intervals: Vec::new(),
        recording: false,
        events: Vec::new(),
        stats: StepStats::default(),
    };
    let n = schedule.device_len();
    let mut t = 0.0;
    let mut step_start = 0.0;
    for step in 0..config.steps as u64 {
        if step + 1 == config.steps as u64 {
            sim.recording = true;
            step_start = t;
        }
        let mut pos = n + step * n;
        for i in 0..schedule.entries().len() {
            if schedule.entries()[i].tier == Tier::Device {
                t = sim.device_access(pos, t, policy)?;
                pos += 1;
            } else {
                sim.host_access(i, t, policy);
            }
        }
    }
    let state_bytes = |u: &SimUnit| state_bytes(u.numel, config.optimizer_state_bytes_per_param);
    let host_static: u64 =
        sim.units.values().map(|u| u.num_bytes + if u.optimizer_on_nvme { 0 } else { state_bytes(u) }).sum();
    let nvme: u64 = sim.units.values().filter(|u| u.optimizer_on_nvme).map(state_bytes).sum();
    let mut marks: Vec<(f64, i64)> = Vec::with_capacity(sim.host_intervals.len() * 2);
    for &(s, e, b) in &sim.host_intervals {
        marks.push((s, b as i64));
        marks.push((e, -(b as i64)));
    }
    marks.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut cur, mut peak) = (0i64, 0i64);
    for (_, d) in marks {
        cur += d;
        peak = peak.max(cur);
    }
    let trace = config.trace.then(|| {
        let mut events: Vec<Value> = [
            (TID_COMPUTE, "compute"),
            (LINK_TID[H2D], "h2d"),
            (LINK_TID[D2H], "d2h"),
            (LINK_TID[NVME_READ], "nvme_read"),
            (LINK_TID[NVME_WRITE], "nvme_write"),
            (TID_OPTIMIZER, "optimizer"),
        ]
        .iter()
        .map(|(tid, name)| json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}))
        .collect();
        events.append(&mut sim.events);
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    });
    let s = &sim.stats;
    Ok(SimReport {
        policy: policy.name().to_string(),
        step_s: t - step_start,
        compute_s: s.compute_s,
        stall_s: s.stall_s,
        exposed_optimizer_s: s.exposed_opt_s,
        exposed_transfer_s: (s.stall_s - s.exposed_opt_s).max(0.0),
        bytes_moved: s.bytes_moved,
        link_bytes: LinkBytes {
            h2d: s.link_bytes[H2D],
            d2h: s.link_bytes[D2H],
            nvme_read: s.link_bytes[NVME_READ],
            nvme_write: s.link_bytes[NVME_WRITE],
        },
        peak_bytes: TierBytes { device: sim.peak_device, host: host_static + peak as u64, nvme },
        demand_fetches: s.demand_fetches,
        prefetches: s.prefetches,
        evictions: s.evictions,
        trace,
    })
}

/// [`simulate`] with a policy built from `kind` ([`PolicyKind::Min`] gets the simulated steps
/// plus one as its horizon, so the reported step does not see the end of time).
///
/// # Errors
/// As [`simulate`].
pub fn simulate_kind(
    schedule: &Schedule,
    units: &[SimUnit],
    config: &SimConfig,
    kind: PolicyKind,
) -> Result<SimReport> {
    let schedule_arc = std::sync::Arc::new(schedule.clone());
    let mut policy = kind.build(schedule_arc, config.steps as u64 + 1);
    simulate(schedule, units, config, policy.as_mut())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::min_working_set;

    fn model(n: u64) -> (Schedule, Vec<SimUnit>) {
        let units: Vec<SimUnit> = (0..n)
            .map(|i| SimUnit { forward_s: 1e-3, backward_s: 2e-3, ..SimUnit::bf16(TensorId(i), (1 << 20) + i * 4096) })
            .collect();
        let ids: Vec<_> = units.iter().map(|u| (u.id, u.num_bytes)).collect();
        (Schedule::training_step(&ids, true).unwrap(), units)
    }

    #[test]
    fn everything_fits_moves_each_unit_once_per_step() {
        let (s, units) = model(8);
        let total: u64 = units.iter().map(|u| u.num_bytes).sum();
        let r = simulate_kind(&s, &units, &SimConfig::new(total), PolicyKind::NextUse).unwrap();
        // The optimizer makes every device copy stale once per step.
        assert_eq!(r.bytes_moved, total);
        assert_eq!(r.link_bytes.d2h, units.iter().map(|u| u.grad_bytes).sum::<u64>());
        assert!((r.step_s - r.compute_s - r.stall_s).abs() < 1e-9);
    }

    #[test]
    fn budget_at_the_minimum_completes_and_below_is_refused() {
        let (s, units) = model(8);
        let min = min_working_set(&s);
        for kind in PolicyKind::ALL {
            let r = simulate_kind(&s, &units, &SimConfig::new(min), kind).unwrap();
            assert!(r.bytes_moved > 0);
            assert!(r.peak_bytes.device <= min);
        }
        let e = simulate_kind(&s, &units, &SimConfig::new(min - 1), PolicyKind::NextUse).unwrap_err();
        assert!(matches!(e, Error::BudgetBelowWorkingSet { min_bytes, .. } if min_bytes == min), "{e}");
    }

    #[test]
    fn trace_has_one_track_per_resource() {
        let (s, mut units) = model(4);
        units[1].optimizer_on_nvme = true;
        let mut cfg = SimConfig::new(3 << 20);
        cfg.trace = true;
        let r = simulate_kind(&s, &units, &cfg, PolicyKind::NextUse).unwrap();
        let ev = r.trace.as_ref().unwrap()["traceEvents"].as_array().unwrap().clone();
        for tid in 1..=6 {
            assert!(ev.iter().any(|e| e["ph"] == "X" && e["tid"] == tid), "no events on track {tid}");
        }
        assert!(r.link_bytes.nvme_read > 0 && r.peak_bytes.nvme > 0);
    }
}
