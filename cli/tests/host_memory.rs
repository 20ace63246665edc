//! `oogc train` keeps the host budget honestly: the process's peak RSS of a small run stays
//! within the plan's host peak × 1.1 plus the stated fixed overhead (the process, the text,
//! the sim device's memory, candle's buffers), and the summary reports the three figures.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::Command;

use common::tiny;

#[test]
fn peak_rss_of_a_small_run_is_within_the_plan_and_the_stated_overhead() {
    let dir = tempfile::tempdir().unwrap();
    // A model whose ledger (state, second buffers, gradients, compute copies) is tens of MB.
    let text = tiny("8MiB", "host", &dir.path().join("nvme"), 2)
        .replace("d_model = 16", "d_model = 128")
        .replace("n_layer = 24", "n_layer = 8")
        .replace("n_head = 2", "n_head = 4")
        .replace("host = \"64MiB\"", "host = \"256MiB\"");
    let path = dir.path().join("run.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oogc"))
        .args(["train", "--no-progress", "--json", "--steps", "4", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let h = &v["host"];
    let [plan, ledger, rss, overhead, budget] =
        ["plan_peak_bytes", "ledger_peak_bytes", "peak_rss_bytes", "fixed_overhead_bytes", "budget_bytes"]
            .map(|k| h[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {h}")));
    eprintln!("plan {plan} ledger {ledger} rss {rss} overhead {overhead} budget {budget}");
    assert!(ledger <= plan && plan <= budget, "{h}");
    assert!(ledger > 20 << 20, "the ledger counts the run's host memory: {h}");
    assert!(rss > 0, "peak RSS is read from /proc/self/status");
    let bound = (plan as f64 * 1.1) as u64 + overhead;
    assert!(rss <= bound, "peak RSS {rss} B > plan {plan} B × 1.1 + overhead {overhead} B = {bound} B");
    let categories = h["categories"].as_array().unwrap();
    assert_eq!(categories.len(), 6, "{h}");
}
