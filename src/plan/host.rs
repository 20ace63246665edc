//! The plan's host and NVMe parts: the split of the host budget and the NVMe store a model needs
//! ([`host_and_nvme_plan`], the runtime's own figures), and the step planned through the
//! simulator with them ([`plan_model`]).

use oogc_prefetch::plan::{plan, PlanInput, PlanReport};
use oogc_prefetch::PrefetchConfig;
use oogc_swapper::StatePlacement;

use super::{PlanArgs, PlanError};
use crate::runtime::{HostPlan, NvmePlan, RuntimeConfig};

/// The split of the host budget for `args`' model ([`HostPlan`], what the runtime applies
/// before its first step), and the NVMe store it needs ([`NvmePlan`]; `None` when nothing lives
/// there). Without a host budget, an unlimited one.
pub fn host_and_nvme_plan(args: &PlanArgs, report: &PlanReport) -> (HostPlan, Option<NvmePlan>) {
    let units: Vec<usize> = args.model.units.iter().map(|u| u.numel as usize).collect();
    // Rank 0's shards (the largest) of each unit's optimizer state, and of its compute copies.
    let rank0 = crate::dist::World { rank: 0, size: args.world_size.max(1), local_rank: 0 };
    let (shards, copies) = crate::runtime::rank_units(rank0, &units, &[], args.shard_parameters);
    let state = if report.optimizer_state_on_nvme { StatePlacement::Nvme } else { StatePlacement::Host };
    let optimizer = args.optimizer.clone();
    let nvme = NvmePlan::with_shards(&shards, &copies, state, args.params, &optimizer, None);
    let mut rc = RuntimeConfig::sim(args.gpu_budget_bytes);
    rc.host_budget_bytes = args.host_budget_bytes.unwrap_or(u64::MAX);
    rc.state_placement = state;
    rc.params_placement = args.params;
    rc.optimizer = optimizer;
    rc.checkpoint_staging = args.checkpoints;
    let room = nvme.as_ref().map_or(0, |p| p.speculation_room_bytes());
    (HostPlan::with_shards(&rc, &units, &shards, &copies, args.max_units_in_use, room), nvme)
}

/// Plans a model: its units through [`oogc_prefetch::plan::plan`] (the step simulator with the
/// prefetch and eviction policies the runtime uses); the host and NVMe figures are the runtime's
/// ([`host_and_nvme_plan`]: the host peak of every ledger category, the NVMe store's size).
///
/// # Errors
/// The planner's errors (a GPU budget below the minimum names the minimum in bytes).
pub fn plan_model(args: &PlanArgs) -> Result<PlanReport, PlanError> {
    let input = PlanInput {
        units: args.model.units.clone(),
        gpu_budget_bytes: args.gpu_budget_bytes,
        host_budget_bytes: args.host_budget_bytes,
        optimizer_state: args.optimizer_state,
        state_bytes_per_param: args.optimizer.stream_config().nvme_bytes_per_param(),
        prefetch: PrefetchConfig { max_depth: args.max_depth, ..PrefetchConfig::default() },
        steps: 3,
        trace: args.trace,
    };
    let mut report = plan(&input, &args.hardware)?;
    let (host, nvme) = host_and_nvme_plan(args, &report);
    if args.params == StatePlacement::Nvme {
        // The compute copies' own NVMe traffic (the step simulator moves only the optimizer
        // state): the host tier's share, less the units in use and in the host window, caches them.
        let copies: Vec<u64> = args.model.units.iter().map(|u| u.compute_bytes).collect();
        let largest = copies.iter().copied().max().unwrap_or(0);
        let pinned = (args.max_units_in_use + args.host_depth) as u64 * largest;
        let all: u64 = copies.iter().map(|&b| oogc_swapper::host::size_class(b as usize) as u64).sum();
        // A share that holds every copy keeps them all (the window's units are cached ones).
        let cache = if host.compute_copies_bytes >= all {
            u64::MAX
        } else {
            host.compute_copies_bytes - pinned.min(host.compute_copies_bytes)
        };
        let (read, write) = param_nvme_traffic(&copies, cache, args.optimizer.master_in_compute_copy());
        report.sim.link_bytes.nvme_read += read;
        report.sim.link_bytes.nvme_write += write;
    }
    report.memory.host_bytes = host.peak_bytes();
    report.memory.nvme_bytes = nvme.as_ref().map_or(0, |p| p.capacity_bytes);
    report.warnings.retain(|w| !w.starts_with("host needs"));
    if host.check().is_err() {
        report.warnings.push(format!(
            "the host budget of {} B is below the run's minimum of {} B: raise it, or put the optimizer state \
             and/or the parameters on NVMe",
            host.budget_bytes, host.min_bytes
        ));
    }
    Ok(report)
}

/// Compute-copy NVMe traffic of one steady-state step with parameters on NVMe: `(read, write)`
/// bytes. A model of the host tier as a cache of `cache_bytes` over the units' compute copies
/// (`copy_bytes`, in unit order): each step reads every unit in the forward (unit order) and in
/// the backward (reverse order), and the optimizer rewrites each unit's copy right after its
/// backward (dirty): without reading it, or reading it first when `optimizer_reads` (the
/// master weights live in the compute copy: `OptimizerConfig::master_in_compute_copy`). A miss
/// on a read is an NVMe read; the victim is the cached unit whose next read is farthest
/// (Belady's MIN, the runtime's next-use eviction; a copy about to be overwritten first), and a
/// dirty victim is written back. Three steps are run and the last is reported. All of it
/// cached: `(0, 0)`.
pub fn param_nvme_traffic(copy_bytes: &[u64], cache_bytes: u64, optimizer_reads: bool) -> (u64, u64) {
    const STEPS: usize = 3;
    let n_units = copy_bytes.len();
    if copy_bytes.iter().sum::<u64>() <= cache_bytes {
        return (0, 0);
    }
    // (unit, reads, dirties) in step order: the forward's and the backward's reads, the
    // optimizer's rewrite.
    let one: Vec<(usize, bool, bool)> = (0..n_units)
        .map(|u| (u, true, false))
        .chain((0..n_units).rev().flat_map(|u| [(u, true, false), (u, optimizer_reads, true)]))
        .collect();
    let seq: Vec<(usize, bool, bool)> = one.iter().copied().cycle().take(STEPS * one.len()).collect();
    // Next read of a unit after position t: usize::MAX when its next access overwrites it.
    let next_read = |u: usize, t: usize| -> usize {
        match seq[t + 1..].iter().position(|&(v, _, _)| v == u) {
            Some(k) if seq[t + 1 + k].1 => t + 1 + k,
            _ => usize::MAX,
        }
    };
    let mut cached: Vec<Option<bool>> = vec![None; n_units]; // Some(dirty)
    let mut used = 0u64;
    let (mut read, mut write) = (0u64, 0u64);
    for (t, &(u, reads, dirties)) in seq.iter().enumerate() {
        let last_step = t >= (STEPS - 1) * one.len();
        if cached[u].is_none() {
            if reads && last_step {
                read += copy_bytes[u];
            }
            while used + copy_bytes[u] > cache_bytes {
                let Some(victim) =
                    (0..n_units).filter(|&v| v != u && cached[v].is_some()).max_by_key(|&v| next_read(v, t))
                else {
                    break;
                };
                if cached[victim] == Some(true) && last_step {
                    write += copy_bytes[victim];
                }
                used -= copy_bytes[victim];
                cached[victim] = None;
            }
            used += copy_bytes[u];
            cached[u] = Some(false);
        }
        if dirties {
            cached[u] = Some(true);
        }
    }
    (read, write)
}

#[cfg(test)]
mod tests {
    use oogc_prefetch::HardwareProfile;

    use super::*;
    use crate::plan::plan_args_for_config;
    use crate::plan::tests::example;

    #[test]
    fn a_rank_of_two_plans_half_the_optimizer_state_and_all_of_the_compute_copies() {
        let mut cfg = example("llama-shakespeare.toml");
        cfg.budgets.host = bytesize::ByteSize::gib(1);
        let hw = HardwareProfile::default();
        let one = plan_args_for_config(&cfg, &hw, false).unwrap();
        let two = PlanArgs { world_size: 2, shard_parameters: false, ..one.clone() };
        // With the parameters sharded too (the default), half of the compute copies as well.
        let three = PlanArgs { world_size: 2, shard_parameters: true, ..one.clone() };
        let (h3, _) = host_and_nvme_plan(&three, &plan_model(&three).unwrap());
        let ((h1, n1), (h2, n2)) = (
            host_and_nvme_plan(&one, &plan_model(&one).unwrap()),
            host_and_nvme_plan(&two, &plan_model(&two).unwrap()),
        );
        assert_eq!(h2.compute_copies_bytes, h1.compute_copies_bytes);
        let (c1, c3) = (h1.compute_copies_bytes, h3.compute_copies_bytes);
        assert!(c3 * 2 >= c1 && c3 * 2 <= c1 + 2 * 4096 * one.model.units.len() as u64, "{c1} vs {c3}");
        // The shards are ⌈numel / 2⌉ rounded up to a block of 256 (`dist::SHARD_ALIGN`): half,
        // or up to a block more, per unit (12 B of f32 state per parameter), and each shard's last
        // chunk padded to 4 KiB: up to a page more per unit for the two.
        let units: u64 = one.model.units.iter().map(|u| u.numel).sum();
        let (s1, s2) = (n1.unwrap().state_bytes, n2.unwrap().state_bytes);
        let blocks = 2 * crate::dist::SHARD_ALIGN as u64 * one.model.units.len() as u64;
        let pages = 4096 * one.model.units.len() as u64;
        assert!(s2 * 2 >= s1 && s2 * 2 <= s1 + 12 * blocks + pages, "{s1} vs {s2}");
        assert!(s2 * 2 < s1 + s1 / 50, "{s1} vs {s2}: a rank's shard is about half");
        assert!(h2.speculation_bytes * 2 <= h1.speculation_bytes + 16 * blocks);
        assert!(units > 0 && h2.min_bytes < h1.min_bytes);
    }

    #[test]
    fn parameters_on_nvme_add_the_compute_copies_nvme_traffic_as_the_host_tier_caches_them() {
        let on_host = example("tinyshakespeare.toml");
        let hw = HardwareProfile::default();
        let args = plan_args_for_config(&on_host, &hw, false).unwrap();
        let base = plan_model(&args).unwrap().sim.link_bytes;
        let copies: u64 = args.model.units.iter().map(|u| u.compute_bytes).sum();
        // Parameters on NVMe with a host budget at the run's minimum: the host tier caches only
        // the units in use and the window, so every copy is read and written back each step.
        let mut args_nvme = args.clone();
        args_nvme.params = StatePlacement::Nvme;
        let (min_host, _) = host_and_nvme_plan(&args_nvme, &plan_model(&args_nvme).unwrap());
        args_nvme.host_budget_bytes = Some(min_host.min_bytes);
        let tight = plan_model(&args_nvme).unwrap().sim.link_bytes;
        assert!(tight.nvme_read >= base.nvme_read + copies, "{tight:?} vs {base:?}");
        assert!(tight.nvme_write >= base.nvme_write + copies, "{tight:?} vs {base:?}");
        // A host budget that holds every copy: no compute-copy traffic in the steady state.
        args_nvme.host_budget_bytes = Some(1 << 30);
        let roomy = plan_model(&args_nvme).unwrap().sim.link_bytes;
        assert_eq!((roomy.nvme_read, roomy.nvme_write), (base.nvme_read, base.nvme_write));
    }

    #[test]
    fn param_nvme_traffic_follows_the_cache() {
        let units = vec![100u64; 10];
        assert_eq!(param_nvme_traffic(&units, 1000, false), (0, 0));
        // Half cached: the forward hits what the last updates left, the backward what the
        // forward left; every unit is read once and written once.
        let (r, w) = param_nvme_traffic(&units, 500, false);
        assert_eq!((r, w), (1000, 1000));
        // Room for one unit: every read misses but the turn's (the last unit's backward right
        // after its forward) and the next forward's first (the last update's copy); every update
        // is written back.
        assert_eq!(param_nvme_traffic(&units, 100, false), (1800, 1000));
        // Traffic falls as the cache grows.
        let (r9, w9) = param_nvme_traffic(&units, 900, false);
        assert!(r9 < r && w9 < w, "{r9} {w9}");
        // An optimizer that reads the copy it rewrites (master weights in the compute copy) finds
        // it cached right after its backward: the same traffic at these sizes, never less.
        for cache in [100, 500, 900] {
            let (r0, w0) = param_nvme_traffic(&units, cache, false);
            let (r1, w1) = param_nvme_traffic(&units, cache, true);
            assert!(r1 >= r0 && w1 == w0, "{cache}: {r0} {w0} -> {r1} {w1}");
        }
    }
}
