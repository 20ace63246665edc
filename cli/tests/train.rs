//! End-to-end runs of `oogc train` as a user runs it: a run killed with SIGKILL resumes to the
//! same losses (DESIGN.md invariant 4), bad input is a clear error that loses nothing (invariant
//! 5), and a run's trace, metrics, checkpoint and routing trace are read back by `oogc inspect`,
//! `oogc plan` and `oogc bench moe`.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{metrics_losses, tiny, tiny_moe};

fn oogc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_oogc"))
}

fn cli_config(dir: &Path, name: &str) -> PathBuf {
    let text = tiny("64KiB", "nvme", &dir.join("nvme"), 2)
        .replace("steps = 20", "steps = 60")
        .replace("[threads]", &format!("[checkpoint]\ndir = \"{name}/ckpt\"\ninterval = 3\n[output]\nmetrics = \"{name}/metrics.jsonl\"\n[threads]"));
    std::fs::create_dir_all(dir.join("nvme")).unwrap();
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_run_killed_mid_step_resumes_with_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    // The uninterrupted run.
    let full = cli_config(dir.path(), "full");
    let st = oogc().args(["train", "--no-progress", "--config"]).arg(&full).status().unwrap();
    assert!(st.success());
    let reference = metrics_losses(&dir.path().join("full/metrics.jsonl"));
    assert_eq!(reference.len(), 60);

    // The same run, killed with SIGKILL once step 7 is logged (mid-way through a later step).
    let killed = cli_config(dir.path(), "killed");
    let metrics = dir.path().join("killed/metrics.jsonl");
    let mut child =
        oogc().args(["train", "--no-progress", "--config"]).arg(&killed).stdout(Stdio::null()).spawn().unwrap();
    while metrics_losses(&metrics).len() < 7 {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the run ended ({st}) before it was killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    // Killed by the signal, not finished: the run was cut mid-way.
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}");
    assert!(metrics_losses(&metrics).len() < 60);
    let ckpts = oogc::checkpoint::list(&dir.path().join("killed/ckpt")).unwrap();
    let resumed_from = ckpts.last().expect("a checkpoint before the kill").0;
    assert!(resumed_from >= 6, "checkpoints {ckpts:?}");

    let st = oogc()
        .args(["train", "--no-progress", "--config"])
        .arg(&killed)
        .arg("--resume")
        .arg(dir.path().join("killed/ckpt"))
        .status()
        .unwrap();
    assert!(st.success());
    let after: Vec<(u64, f64)> = metrics_losses(&metrics).into_iter().filter(|(s, _)| *s > resumed_from).collect();
    let expected: Vec<(u64, f64)> = reference.into_iter().filter(|(s, _)| *s > resumed_from).collect();
    assert!(!after.is_empty());
    // Of the steps logged twice (before the kill and after the resume), the last copy counts.
    let mut dedup = std::collections::BTreeMap::new();
    dedup.extend(after);
    assert_eq!(dedup.into_iter().collect::<Vec<_>>(), expected);
}

fn run_cli_err(config_text: &str, dir: &Path) -> (i32, String) {
    let path = dir.join("bad.toml");
    std::fs::write(&path, config_text).unwrap();
    let out = oogc().args(["train", "--no-progress", "--config"]).arg(&path).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_input_names_the_cause_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let good =
        tiny("64KiB", "nvme", &nvme, 2).replace("[threads]", "[output]\nmetrics = \"out/metrics.jsonl\"\n[threads]");
    let metrics = dir.path().join("out/metrics.jsonl");
    std::fs::create_dir_all(metrics.parent().unwrap()).unwrap();
    std::fs::write(&metrics, "previous run\n").unwrap();

    let cases = [
        (good.replace("seed = 3", "seed = 3\nsede = 4"), "sede"),
        (good.replace("gpu = \"64KiB\"", "gpu = \"4KiB\""), "minimum working set"),
        (good.replace(&common::data_path().display().to_string(), "/nonexistent/text.txt"), "/nonexistent/text.txt"),
        (good.replace(&nvme.display().to_string(), "/proc/oogc-not-writable"), "/proc/oogc-not-writable"),
    ];
    for (text, needle) in cases {
        let (code, err) = run_cli_err(&text, dir.path());
        assert_ne!(code, 0, "{needle}: {err}");
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
        assert!(err.contains("fix"), "no fix in: {err}");
        assert_eq!(std::fs::read_to_string(&metrics).unwrap(), "previous run\n", "{needle}: metrics overwritten");
    }
    // A batch dump that cannot be created: refused before anything is written.
    let good_path = dir.path().join("good.toml");
    std::fs::write(&good_path, &good).unwrap();
    let out = oogc()
        .args(["train", "--no-progress", "--dump-batches", "/nonexistent/batches.jsonl", "--config"])
        .arg(&good_path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("batch dump /nonexistent/batches.jsonl") && err.contains("fix:"), "{err}");
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), "previous run\n", "metrics overwritten");
    // A fresh run into a checkpoint directory that holds another run's checkpoint.
    let ckpt_dir = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt_dir).unwrap();
    let old = oogc::checkpoint::Checkpoint { step: 7, ..Default::default() };
    let old_path = oogc::checkpoint::save(&ckpt_dir, &old, 2).unwrap();
    let before = std::fs::read(&old_path).unwrap();
    let text = good.replace("[threads]", "[checkpoint]\ndir = \"ckpt\"\ninterval = 1\n[threads]");
    let (code, err) = run_cli_err(&text, dir.path());
    assert_ne!(code, 0);
    assert!(err.contains("--resume") && err.contains("fix"), "{err}");
    assert_eq!(std::fs::read(&old_path).unwrap(), before);
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), "previous run\n");

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let (code, err) = run_cli_err(
        &good.replace(&common::data_path().display().to_string(), &empty.display().to_string()),
        dir.path(),
    );
    assert_ne!(code, 0);
    assert!(err.contains("empty.txt") && err.contains("0 bytes"), "{err}");
}

#[test]
fn train_writes_trace_metrics_and_a_checkpoint_that_inspect_and_plan_read() {
    let dir = tempfile::tempdir().unwrap();
    let text = tiny("64KiB", "nvme", &dir.path().join("nvme"), 2).replace("steps = 20", "steps = 4").replace(
        "[threads]",
        "[checkpoint]\ndir = \"ckpt\"\n[output]\nmetrics = \"m.jsonl\"\ntrace = \"trace.json\"\n[threads]",
    );
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, text).unwrap();
    let dump = dir.path().join("batches.jsonl");
    let out = oogc()
        .args(["train", "--no-progress", "--json", "--dump-batches"])
        .arg(&dump)
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["last_step"], 4);
    // One line per step (one micro-batch each): the windows' inputs and their shifted targets.
    let batches: Vec<serde_json::Value> =
        std::fs::read_to_string(&dump).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(
        batches.iter().map(|b| (b["step"].as_u64(), b["micro"].as_u64())).collect::<Vec<_>>(),
        [(Some(1), Some(0)), (Some(2), Some(0)), (Some(3), Some(0)), (Some(4), Some(0))]
    );
    for b in &batches {
        let rows = |k: &str| -> Vec<Vec<u64>> { serde_json::from_value(b[k].clone()).unwrap() };
        let (inputs, targets) = (rows("inputs"), rows("targets"));
        assert!(!inputs.is_empty() && inputs.len() == targets.len());
        for (i, t) in inputs.iter().zip(&targets) {
            assert_eq!(i[1..], t[..t.len() - 1]);
        }
    }
    assert!(summary["h2d_bytes"].as_u64().unwrap() > 0 && summary["nvme_write_bytes"].as_u64().unwrap() > 0);
    assert!(summary["final_val_loss"].as_f64().unwrap() > 0.0);

    // One metrics object per step with the documented fields.
    let lines = std::fs::read_to_string(dir.path().join("m.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 4);
    for key in
        ["step", "loss", "tokens_per_s", "stall_s", "h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes"]
    {
        assert!(rows.iter().all(|r| !r[key].is_null()), "{key} missing");
    }

    // The trace holds compute spans and copy-engine spans on their own threads.
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    let events = trace.as_array().or_else(|| trace["traceEvents"].as_array()).expect("trace events");
    let names: std::collections::HashSet<&str> = events.iter().filter_map(|e| e["name"].as_str()).collect();
    for name in ["compute::forward", "compute::backward", "runtime::fetch", "swapper::dtoh"] {
        assert!(names.contains(name), "{name} not in the trace: {names:?}");
    }

    let out = oogc().arg("inspect").arg(dir.path().join("ckpt")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("step: 4") && text.contains("blocks.0.attn.qkv.weight"), "{text}");

    let out = oogc().args(["plan", "--config"]).arg(&cfg).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("predicted step"), "{text}{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_routing_trace_recorded_by_moe_training_replays_in_bench_moe() {
    let dir = tempfile::tempdir().unwrap();
    let text = tiny_moe("96KiB", "host", &dir.path().join("nvme"))
        .replace("steps = 20", "steps = 12")
        .replace("[threads]", "[moe]\nrouting_trace = \"routing.jsonl\"\n[threads]");
    let cfg = dir.path().join("moe.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = oogc().args(["train", "--no-progress", "--config"]).arg(&cfg).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let trace = dir.path().join("routing.jsonl");
    let lines = std::fs::read_to_string(&trace).unwrap();
    assert!(lines.starts_with("{\"format\":\"oogc-routing-1\""), "{}", &lines[..100.min(lines.len())]);
    // Rates of the sim device: its "GPU" is this CPU, and a slow link (see configs/tinyshakespeare-moe.toml).
    let out = oogc()
        .args(["bench", "moe", "--h2d-gbps", "0.1", "--cpu-gflops", "50", "--gpu-gflops", "50", "--json", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let row =
        |p: &str| rows.iter().find(|r| r["policy"] == p).unwrap_or_else(|| panic!("no {p} row: {rows:?}")).clone();
    let moved = |r: &serde_json::Value| r["expert_h2d_bytes"].as_u64().unwrap();
    let (ours, fetch, lru) = (row("ours"), row("fetch-on-demand"), row("lru"));
    assert!(moved(&fetch) > 0);
    assert!((moved(&ours) as f64) <= 0.6 * moved(&fetch) as f64, "ours {ours} vs fetch {fetch}");
    assert!((moved(&ours) as f64) <= 0.8 * moved(&lru) as f64, "ours {ours} vs lru {lru}");
    assert!(ours["step_s"].as_f64().unwrap() * 1.15 <= fetch["step_s"].as_f64().unwrap(), "{ours} vs {fetch}");
}
