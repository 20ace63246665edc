//! The plan as the table `oogc plan` prints ([`render_plan`]), its "GPU memory" section included.

use std::fmt::Write as _;

use oogc_moe_placement::Placement;
use oogc_prefetch::plan::PlanReport;
use oogc_swapper::StatePlacement;

use super::{host_and_nvme_plan, GpuMemory, PlanArgs};

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The "GPU memory" section of [`render_plan`].
fn render_gpu_memory(out: &mut String, g: &GpuMemory, gpu_budget_bytes: u64) {
    let p = &g.plan;
    let what = if g.sim {
        "what the run would need on a GPU (a model: on the sim device candle's buffers are host memory)"
    } else {
        "what the run needs on the device"
    };
    writeln!(out, "GPU memory: {what}; [budgets] gpu covers the swapper's part only").expect("writing to a String");
    let note = |name: &str| match name {
        "residency" => "compute copies in the residency manager".to_string(),
        "gradient_staging" => "the runtime's gradient staging".to_string(),
        "activation_staging" => "activation checkpoints' staging ([activations] offload)".to_string(),
        "in_use_copies" => "candle's copies of the units in use".to_string(),
        "device_optimizers" => "[optimizer] device_units".to_string(),
        "checkpoints" => "activation checkpoints kept on the device".to_string(),
        "input_gradients" => "gradients between units".to_string(),
        "working_set" => format!("the {} backward's activations and their gradients", p.peak_unit),
        "attention" => format!("scores of {}-row query chunks, q/k/v and their gradients", p.attention_chunk),
        "autograd" => format!("the {}'s parameters as Vars and their gradients", p.peak_unit),
        "cublas_workspace" => "cuBLAS workspace (outside the pool)".to_string(),
        _ => "CUDA context (outside the pool; stated)".to_string(),
    };
    for part in p.parts().iter().filter(|q| q.bytes > 0) {
        writeln!(out, "  {:<20} {:>14} {:>16}  {}", part.name, part.bytes, gib(part.bytes), note(part.name))
            .expect("writing to a String");
    }
    writeln!(
        out,
        "  {:<20} {:>14} {:>16}  in the stream-ordered pool {} B (what device_peak_bytes measures) + outside it {} B",
        "total",
        p.total_bytes(),
        gib(p.total_bytes()),
        p.in_pool_bytes(),
        p.outside_pool_bytes()
    )
    .expect("writing to a String");
    let verdict = if g.fits() { "fits" } else { "does NOT fit" };
    if g.sim {
        writeln!(
            out,
            "  sim device: its memory is [budgets] gpu ({gpu_budget_bytes} B), which holds the swapper's part ({} B); \
             on a GPU the run {verdict} {} ({} B)",
            p.swapper_bytes(),
            g.device_memory_source,
            g.device_memory_bytes
        )
    } else {
        writeln!(out, "  {verdict} the GPU: {} ({} B)", g.device_memory_source, g.device_memory_bytes)
    }
    .expect("writing to a String");
}

/// A plan as a human-readable table (what `oogc plan` prints).
pub fn render_plan(args: &PlanArgs, r: &PlanReport) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "model: {}: {} units, {:.1} M params, compute copies {}",
        args.model.description,
        r.units,
        r.params as f64 / 1e6,
        gib(r.model_bytes)
    )
    .expect("writing to a String");
    if !args.model.placements.is_empty() {
        let m = &args.model;
        let routing = args.experts.as_ref().map_or("uniform routing", |e| e.routing.as_str());
        writeln!(
            out,
            "experts: {} hot (resident), {} fetched, {} computed on the CPU, {} idle — the trainer's placement under \
             {routing} (coarse: the trainer re-places every step)",
            m.count(Placement::Resident),
            m.count(Placement::Fetch),
            m.count(Placement::Cpu),
            m.count(Placement::Skip)
        )
        .expect("writing to a String");
    }
    if let Some(e) = &args.experts {
        let mib = |b: f64| b / f64::from(1u32 << 20);
        writeln!(
            out,
            "expert bytes H2D per step (expected): {:.1} MiB, {:.1} experts fetched ([moe] policy = \"fetch\": {:.1} \
             MiB, {:.2}x); the top quarter of a block's experts takes {:.1} % of its tokens",
            mib(e.expected_h2d_bytes),
            e.expected_fetches,
            mib(e.fetch_h2d_bytes),
            e.expected_h2d_bytes / e.fetch_h2d_bytes.max(1.0),
            100.0 * e.top_quarter_share
        )
        .expect("writing to a String");
    }
    if !args.device_units.is_empty() {
        let names: Vec<&str> = args.device_units.iter().map(|(n, _)| n.as_str()).collect();
        let bytes: u64 = args.device_units.iter().map(|(_, b)| b).sum();
        writeln!(
            out,
            "device optimizers ([optimizer] device_units): {} units ({}), {} of the GPU budget (master weights, \
             Adam state, gradients and compute copy); their updates run on the device after the step's decision \
             (the step time below does not model them)",
            names.len(),
            names.join(", "),
            gib(bytes)
        )
        .expect("writing to a String");
    }
    if args.world_size > 1 {
        // Per step each rank reduce-scatters the gradients (f32) and all-gathers the new compute
        // copies: (N − 1) / N of each, sent and received, in a ring.
        let n = args.world_size as u64;
        let params: u64 = args.model.units.iter().map(|u| u.numel).sum();
        let copies: u64 = args.model.units.iter().map(|u| u.compute_bytes).sum();
        let (rs, ag) = (4 * params * (n - 1) / n, copies * (n - 1) / n);
        if args.shard_parameters {
            writeln!(
                out,
                "ranks: {n}, parameters sharded (ZeRO-3; host, NVMe and optimizer figures are one rank's: its 1/{n} of \
                 the compute copies and of the optimizer state); per step each rank sends and receives {rs} B \
                 reducing its gradients (f32 reduce-scatter) and {ag} B per gathering of every unit (all-gather at \
                 a unit's fetch unless it was kept gathered: once to twice per step), not in the predicted step; \
                 the step's GPU and H2D figures below are simulated on whole units (a rank's H2D carries its shards: \
                 about 1/{n} of them)"
            )
        } else {
            writeln!(
                out,
                "ranks: {n} (host, NVMe and optimizer figures are one rank's: its 1/{n} of the optimizer state); \
                 per step each rank sends and receives {rs} B reducing its gradients (f32 reduce-scatter) and {ag} B \
                 gathering the new compute copies (all-gather), not in the predicted step"
            )
        }
        .expect("writing to a String");
    }
    let format = args.optimizer.state_format();
    let place = match args.optimizer_state {
        Some(StatePlacement::Nvme) => "on NVMe",
        Some(StatePlacement::Host) => "in host memory",
        None => "host or NVMe",
    };
    // On NVMe the master weights stay in the compute copies when those hold them bit for bit.
    let (per_param, kept) = match args.optimizer_state {
        Some(StatePlacement::Nvme) if args.optimizer.master_in_compute_copy() => {
            (args.optimizer.stream_config().nvme_bytes_per_param(), ", the master weights kept in the compute copies")
        }
        _ => (format.bytes_per_param(), ""),
    };
    writeln!(
        out,
        "optimizer state: {format} = {per_param:.2} B per parameter {place}{kept} ([optimizer] master_dtype, \
         state_dtype; both f32: 12 B), {}",
        gib((r.params as f64 * per_param).ceil() as u64)
    )
    .expect("writing to a String");
    writeln!(out, "hardware: {}", args.hardware.source).expect("writing to a String");
    writeln!(
        out,
        "compute: {:.1} GFLOP/s, backward {:.2} x forward; links: H2D {:.1} GB/s, D2H {:.1} GB/s",
        args.hardware.device_gflops, args.hardware.backward_flops_ratio, args.hardware.h2d_gbps, args.hardware.d2h_gbps
    )
    .expect("writing to a String");
    out.push('\n');
    writeln!(out, "{:<10} {:>14} {:>16}  note", "tier", "peak bytes", "GiB").expect("writing to a String");
    writeln!(
        out,
        "{:<10} {:>14} {:>16}  budget {} (minimum {} B; all units resident at {} B)",
        "gpu",
        r.memory.device_bytes,
        gib(r.memory.device_bytes),
        args.gpu_budget_bytes,
        r.min_gpu_budget_bytes,
        r.full_gpu_budget_bytes
    )
    .expect("writing to a String");
    let host = Some(host_and_nvme_plan(args, r));
    writeln!(
        out,
        "{:<10} {:>14} {:>16}  every ledger category at its planned bytes{}",
        "host",
        r.memory.host_bytes,
        gib(r.memory.host_bytes),
        host.as_ref().map_or(String::new(), |(h, _)| format!(" (minimum {} B)", h.min_bytes))
    )
    .expect("writing to a String");
    if let Some((h, _)) = &host {
        for (name, bytes) in h.by_category() {
            writeln!(out, "{:<10} {:>14} {:>16}  host: {name}", "", bytes, gib(bytes)).expect("writing to a String");
        }
        if let Some(o) = &args.overhead {
            let overhead = o.overhead(h);
            let rss = o.predicted_peak_rss_bytes(h);
            let parts: Vec<String> = overhead.parts().iter().map(|(n, b)| format!("{n} {b}")).collect();
            writeln!(
                out,
                "{:<10} {:>14} {:>16}  predicted peak RSS: ledger {} B expected + overhead {} B ({}); budget + overhead {} B",
                "rss",
                rss,
                gib(rss),
                h.expected_peak_bytes(),
                overhead.total_bytes(),
                parts.join(", "),
                h.budget_bytes.saturating_add(overhead.total_bytes())
            )
            .expect("writing to a String");
        }
    }
    // Immediate updates speculate nothing: the store has no room for second extents then.
    let room = if host.as_ref().and_then(|(_, n)| n.as_ref()).is_some_and(|n| n.speculation_bytes > 0) {
        " + speculation's room"
    } else {
        ""
    };
    let on_nvme = match (r.optimizer_state_on_nvme, args.params) {
        (true, StatePlacement::Nvme) => format!("optimizer state + compute copies + copy-on-write slack{room}"),
        (true, StatePlacement::Host) => format!("optimizer state + copy-on-write slack{room}"),
        (false, StatePlacement::Nvme) => "compute copies + copy-on-write slack".to_string(),
        (false, StatePlacement::Host) => "-".to_string(),
    };
    writeln!(out, "{:<10} {:>14} {:>16}  {on_nvme}", "nvme", r.memory.nvme_bytes, gib(r.memory.nvme_bytes))
        .expect("writing to a String");
    if let Some(g) = &args.device {
        out.push('\n');
        render_gpu_memory(&mut out, g, args.gpu_budget_bytes);
    }
    out.push('\n');
    let pct = |x: f64| 100.0 * x / r.step_s.max(1e-12);
    writeln!(
        out,
        "predicted step: {:.4} s (lower bound {:.4} s, {:.2}x)",
        r.step_s,
        r.lower_bound_s,
        r.step_s / r.lower_bound_s.max(1e-12)
    )
    .expect("writing to a String");
    writeln!(out, "  compute            {:>10.4} s  {:>5.1}%", r.compute_s, pct(r.compute_s))
        .expect("writing to a String");
    writeln!(out, "  exposed transfer   {:>10.4} s  {:>5.1}%", r.exposed_transfer_s, pct(r.exposed_transfer_s))
        .expect("writing to a String");
    writeln!(out, "  exposed optimizer  {:>10.4} s  {:>5.1}%", r.exposed_optimizer_s, pct(r.exposed_optimizer_s))
        .expect("writing to a String");
    let lb = &r.sim.link_bytes;
    writeln!(
        out,
        "  bytes per step: h2d {} d2h {} nvme read {} nvme write {} (optimizer state{})",
        lb.h2d,
        lb.d2h,
        lb.nvme_read,
        lb.nvme_write,
        if args.params == StatePlacement::Nvme { " + compute copies" } else { "" }
    )
    .expect("writing to a String");
    for w in &r.warnings {
        writeln!(out, "warning: {w}").expect("writing to a String");
    }
    if let Some(g) = args.device.as_ref().filter(|g| !g.fits() && !g.sim) {
        let largest: Vec<String> =
            g.plan.largest_parts(3).iter().map(|p| format!("{} {}", p.name, gib(p.bytes))).collect();
        writeln!(
            out,
            "warning: the run needs {} on the GPU but it has {}: lower [train] batch_size or seq_len, or [budgets] gpu \
             (largest parts: {})",
            gib(g.plan.total_bytes()),
            gib(g.device_memory_bytes),
            largest.join(", ")
        )
        .expect("writing to a String");
    }
    out
}

#[cfg(test)]
mod tests {
    use oogc_prefetch::HardwareProfile;

    use super::*;
    use crate::plan::tests::example;
    use crate::plan::{plan_args_for_config, plan_model};

    #[test]
    fn a_cuda_config_is_planned_with_the_datasheet_and_says_so() {
        let cfg = example("llama-8b-h100.toml");
        let args = plan_args_for_config(&cfg, &HardwareProfile::default(), false).unwrap();
        let text = render_plan(&args, &plan_model(&args).unwrap());
        assert!(text.contains("GPU figures from the NVIDIA H100"), "{text}");
        assert!(text.contains("989 TFLOP/s bf16"), "{text}");
        // None of the sim device's figures: its source, its 50 GFLOP/s, its 15 GB/s links.
        for sim in ["sim device", "compute: 50.0 GFLOP/s", "H2D 15.0 GB/s"] {
            assert!(!text.contains(sim), "{sim} in:\n{text}");
        }
        assert!(
            text.contains("GPU memory: what the run needs on the device") && text.contains("fits the GPU"),
            "{text}"
        );
    }
}
