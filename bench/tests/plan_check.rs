//! `oogc plan` checked against reality ([`oogc_bench::plan_check`]) end to end on tiny dense
//! and MoE configs: the compute probe, the plan and the measured steps all produce figures, and
//! the row's verdict follows its error. (Tiny models are dominated by per-op overheads the FLOP
//! model does not see, so the 15% itself is checked on the example configs, not here.)

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;

use oogc_bench::plan_check;

fn tiny(nvme: &Path, moe: bool) -> String {
    format!(
        r#"
[model]
d_model = 16
n_layer = 4
n_head = 2
{moe}
[data]
path = "{data}"
[train]
batch_size = 4
seq_len = 16
steps = 8
seed = 3
eval_interval = 0
eval_batches = 2
[device]
kind = "sim"
link_gbps = 1.0
[budgets]
gpu = "64KiB"
host = "64MiB"
optimizer_state = "nvme"
nvme_dirs = ["{nvme}"]
[prefetch]
depth = 2
[threads]
compute = 1
optimizer = 1
"#,
        moe = if moe { "[model.moe]\nexperts = 4\ntop_k = 2" } else { "" },
        data = common::data_path().display(),
        nvme = nvme.display()
    )
}

#[test]
fn plan_check_puts_the_plan_beside_measured_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut configs = Vec::new();
    for (name, moe) in [("dense.toml", false), ("moe.toml", true)] {
        let path = dir.path().join(name);
        std::fs::write(&path, tiny(&dir.path().join("nvme"), moe)).unwrap();
        configs.push(path);
    }
    let rows = plan_check::run(&configs, 2, 1).unwrap();
    assert_eq!(rows.len(), 2);
    for (r, moe) in rows.iter().zip([false, true]) {
        assert_eq!(r.moe, moe, "{r:?}");
        assert!(r.plan_step_s > 0.0 && r.measured_step_s > 0.0 && r.plan_compute_s > 0.0, "{r:?}");
        assert!(r.device_gflops > 0.0 && r.backward_flops_ratio > 0.0 && r.probe_forward_s > 0.0, "{r:?}");
        assert!(r.error.is_finite(), "{r:?}");
        assert!(r.hardware_source.contains("compute probed"), "{r:?}");
        assert_eq!((r.compute_threads, r.steps, r.warmup), (1, 2, 1), "{r:?}");
        assert!((2..=3).contains(&r.probe_gflops.len()), "{r:?}");
    }
    assert!(rows[1].model.contains("MoE 4 experts top-2"), "{:?}", rows[1]);
    // The NVMe scratch of the measured runs is gone.
    let nvme = dir.path().join("nvme");
    let left: Vec<_> =
        std::fs::read_dir(&nvme).map(|d| d.map(|e| e.unwrap().file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "left behind in {}: {left:?}", nvme.display());
    plan_check::print_table(&rows);
}
