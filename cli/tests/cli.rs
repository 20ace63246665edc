//! End-to-end tests of the `oogc` binary: `bench nvme`, `bench swap`, `bench evict` and `bench moe` with
//! `--json` (JSON Lines on stdout), `plan` (JSON, a budget below the minimum, the hardware probe
//! and profiles), a missing `--dir`, `--help`, and `config --example` (loads) and `--reference`
//! (the book's copy).
//!
//! The io_uring, git and GPU-probe tests skip through `oogc::swapper::skip` (a line on stderr
//! past the harness's capture, counted in `OOGC_SKIP_LOG`) where the machine lacks them;
//! `OOGC_REQUIRE=io_uring` (or `OOGC_REQUIRE_URING=1`) turns the io_uring skip into a failure.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

use oogc::swapper::skip::{skip, Capability};
use serde_json::Value;

fn oogc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oogc")).args(args).output().expect("run the oogc binary")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Parses stdout as JSON Lines: one object per non-empty line, at least one.
fn json_rows(out: &Output) -> Vec<Value> {
    let stdout = text(&out.stdout);
    let rows: Vec<Value> = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}\nstdout:\n{stdout}")))
        .collect();
    assert!(!rows.is_empty(), "no rows on stdout; stderr:\n{}", text(&out.stderr));
    rows
}

fn positive(row: &Value, key: &str) -> f64 {
    let v = row[key].as_f64().unwrap_or_else(|| panic!("`{key}` is not a number in {row}"));
    assert!(v > 0.0 && v.is_finite(), "`{key}` = {v} is not positive in {row}");
    v
}

fn bench_nvme_json(engine: &str, dir: &std::path::Path) -> Output {
    let dir = dir.to_str().expect("utf-8 temp dir");
    oogc(&["bench", "nvme", "--dir", dir, "--size-gib", "0.0625", "--engine", engine, "--no-fio", "--json"])
}

fn check_nvme_rows(out: &Output, engine: &str) {
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(out);
    assert_eq!(rows.len(), 2, "--no-fio with one engine gives a first-pass and a steady row: {rows:?}");
    for (row, name, bytes) in [
        (&rows[0], format!("store-{engine}"), 64 << 20),
        (&rows[1], format!("store-{engine}-steady"), oogc_bench::nvme::STEADY_PASSES * (64 << 20)),
    ] {
        assert_eq!(row["engine"], name, "{row}");
        positive(row, "write_gbps");
        positive(row, "read_gbps");
        assert_eq!(row["block_bytes"], 1 << 20, "{row}");
        assert_eq!(row["queue_depth"], 32, "{row}");
        assert_eq!(row["bytes"], bytes, "{row}");
    }
}

#[test]
fn bench_nvme_psync_prints_json_rows() {
    let dir = tempfile::tempdir().unwrap();
    let out = bench_nvme_json("psync", dir.path());
    check_nvme_rows(&out, "psync");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the store left files behind");
}

#[test]
fn bench_nvme_uring_prints_json_rows_or_skips_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let out = bench_nvme_json("uring", dir.path());
    let stderr = text(&out.stderr);
    if !out.status.success() && stderr.contains("io_uring is unavailable") {
        skip(Capability::IoUring, "bench_nvme_uring", stderr.trim());
        return;
    }
    check_nvme_rows(&out, "uring");
}

#[test]
fn bench_nvme_missing_dir_fails_and_names_it() {
    let out =
        oogc(&["bench", "nvme", "--dir", "/nonexistent/x", "--size-gib", "0.0625", "--engine", "psync", "--no-fio"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "exit {:?} for a missing --dir", out.status);
    assert!(out.stdout.is_empty(), "stdout for a failed run: {}", text(&out.stdout));
    assert!(stderr.contains("/nonexistent/x"), "stderr does not name the path:\n{stderr}");
    assert!(stderr.contains("does not exist"), "stderr does not give the cause:\n{stderr}");
    assert!(stderr.contains("mkdir -p"), "stderr does not give the fix:\n{stderr}");
}

#[test]
fn bench_swap_prints_json_rows() {
    let out = oogc(&["bench", "swap", "--size-mib", "8", "--json"]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().expect("name")).collect();
    assert_eq!(names, ["sim-htod", "sim-dtoh", "residency-htod"], "{rows:?}");
    for row in &rows {
        positive(row, "gbps");
        positive(row, "limit_gbps");
        positive(row, "bytes");
        positive(row, "ops");
        // Every row says where and how it was measured.
        assert!(row["machine"]["cores"].as_u64().unwrap() >= 1, "{row}");
        assert!(row["machine"]["git_rev"].is_string(), "{row}");
        assert!(row["command"].as_str().unwrap().contains("bench swap --size-mib 8"), "{row}");
    }
    let res = &rows[2];
    // 16 tensors, budget of 8, cyclic order: every timed acquire fetches and evicts.
    assert_eq!(res["ops"], 8 * 16, "{res}");
    assert_eq!(res["bytes"], 8 * (8 << 20), "{res}");
    assert_eq!(res["evictions"], 8 * 16, "{res}");
    assert!(res["stall_s"].as_f64().is_some_and(|s| s >= 0.0), "{res}");
}

#[test]
fn bench_swap_throttled_rows_stay_under_the_link() {
    let out = oogc(&["bench", "swap", "--size-mib", "4", "--link-gbps", "2", "--repeats", "2", "--json"]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    let throttled: Vec<&Value> =
        rows.iter().filter(|r| r["name"].as_str().is_some_and(|n| n.ends_with("-throttled"))).collect();
    assert_eq!(throttled.len(), 3, "{rows:?}");
    for row in throttled {
        // The limit is the lower of the throttle and the memcpy measured in the same run (on a
        // loaded machine memcpy can fall below 2 GB/s): never above the throttle.
        assert!(positive(row, "limit_gbps") <= 2.0, "{row}");
        if row["limit"] == "link throttle" {
            assert_eq!(row["limit_gbps"], 2.0, "{row}");
        }
        // The throttle is a lower bound on time, so the rate never exceeds it (small slack for timer rounding).
        assert!(positive(row, "gbps") <= 2.0 * 1.02, "{row}");
    }
}

#[test]
fn bad_link_gbps_is_refused_naming_the_flag() {
    let out = oogc(&["bench", "swap", "--size-mib", "1", "--link-gbps", "0"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--link-gbps"), "{}", text(&out.stderr));
}

#[test]
fn version_names_the_git_revision_it_was_built_from() {
    let out = oogc(&["--version"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let rev = stdout
        .trim()
        .strip_prefix(&format!("oogc {} (rev ", env!("CARGO_PKG_VERSION")))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not `oogc VERSION (rev REV)`: {stdout}"));
    // The oracle: git itself, where the tests run in a checkout (the binary was built from HEAD;
    // `-dirty` depends on the tree at build time, so only the hash is compared).
    let head =
        Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output();
    match head {
        Ok(h) if h.status.success() && env!("OOGC_GIT_REV_FROM") == "git" => {
            let head = text(&h.stdout).trim().to_string();
            assert!(rev == head || rev == format!("{head}-dirty"), "rev {rev}, HEAD {head}");
        }
        _ => {
            skip(
                Capability::Git,
                "version_names_the_git_revision_it_was_built_from",
                &format!("the revision is not compared with git (no git checkout here, or OOGC_GIT_REV set for the build): {rev}"),
            );
            assert!(!rev.is_empty(), "{stdout}");
        }
    }
}

#[test]
fn help_mentions_bench() {
    let out = oogc(&["--help"]);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    assert!(stdout.contains("bench"), "{stdout}");
    let out = oogc(&["bench", "nvme", "--help"]);
    let stdout = text(&out.stdout);
    for flag in
        ["--dir", "--size-gib", "--engine", "--block-bytes", "--queue-depth", "--tensor-mib", "--no-fio", "--json"]
    {
        assert!(stdout.contains(flag), "`bench nvme --help` lacks {flag}:\n{stdout}");
    }
    assert!(stdout.contains("JSON Lines"), "{stdout}");
}

#[test]
fn bench_evict_prints_json_rows_for_every_policy() {
    let out = oogc(&[
        "bench",
        "evict",
        "--layers",
        "4",
        "--d-model",
        "64",
        "--seq-len",
        "32",
        "--batch",
        "2",
        "--fractions",
        "0.2,0.6",
        "--json",
    ]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 2 * 2 * 4, "2 workloads x 2 budgets x 4 policies: {rows:?}");
    for row in &rows {
        for key in ["policy", "budget_fraction", "bytes_moved", "min_bytes", "stall_s", "step_s", "workload"] {
            assert!(!row[key].is_null(), "`{key}` missing in {row}");
        }
        positive(row, "bytes_moved");
        positive(row, "min_bytes");
        assert!(row["stall_s"].as_f64().is_some_and(|s| s >= 0.0), "{row}");
        if row["policy"] == "next-use" && row["workload"] == "train" {
            let ratio = row["bytes_moved"].as_f64().unwrap() / row["min_bytes"].as_f64().unwrap();
            assert!(ratio <= 1.05, "next-use moves {ratio:.3}x MIN: {row}");
        }
    }
    let policies: std::collections::BTreeSet<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies.into_iter().collect::<Vec<_>>(), ["fifo", "lru", "min", "next-use"]);
}

#[test]
fn bench_evict_no_extra_bytes_keeps_every_row_at_min() {
    let out = oogc(&[
        "bench",
        "evict",
        "--layers",
        "6",
        "--d-model",
        "64",
        "--seq-len",
        "32",
        "--batch",
        "2",
        "--fractions",
        "0.3,0.7",
        "--no-extra-bytes",
        "--json",
    ]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    for row in json_rows(&out).iter().filter(|r| r["policy"] == "next-use") {
        assert!(row["ratio_to_min"].as_f64().unwrap() <= 1.05, "{row}");
    }
}

#[test]
fn bench_evict_refuses_a_fraction_out_of_range() {
    let out = oogc(&["bench", "evict", "--fractions", "0.5,1.5"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--fractions"), "{}", text(&out.stderr));
}

fn plan_small(extra: &[&str]) -> Output {
    let mut args = vec!["plan", "--layers", "2", "--d-model", "64", "--seq-len", "32", "--batch", "2"];
    args.extend_from_slice(extra);
    oogc(&args)
}

#[test]
fn plan_prints_memory_and_a_step_breakdown_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("step.json");
    let out = plan_small(&["--gpu-budget", "128KiB", "--json", "--trace", trace.to_str().unwrap()]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    // The largest unit is a block: (12·64² + 13·64) params × 2 B.
    assert_eq!(r["min_gpu_budget_bytes"], (12 * 64 * 64 + 13 * 64) * 2, "{r}");
    assert_eq!(r["units"], 4, "{r}");
    let step = positive(r, "step_s");
    let sum = positive(r, "compute_s")
        + r["exposed_transfer_s"].as_f64().unwrap()
        + r["exposed_optimizer_s"].as_f64().unwrap();
    assert!((sum - step).abs() <= 1e-9 + 1e-6 * step, "{r}");
    assert!(step >= 0.999 * positive(r, "lower_bound_s"), "{r}");
    for tier in ["device_bytes", "host_bytes"] {
        positive(&r["memory"], tier);
    }
    // The host figure is the runtime's plan: every ledger category at its planned bytes.
    let host = &r["host_plan"];
    let parts: u64 = ["compute_copies_bytes", "optimizer_state_bytes", "speculation_bytes", "nvme_stream_bytes"]
        .iter()
        .chain(["gradients_bytes", "activations_bytes"].iter())
        .map(|k| host[*k].as_u64().unwrap_or_else(|| panic!("{k}: {host}")))
        .sum();
    assert_eq!(r["memory"]["host_bytes"].as_u64(), Some(parts), "{r}");
    assert!(host["min_bytes"].as_u64().unwrap() > 0, "{host}");
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    assert!(events.iter().any(|e| e["ph"] == "X" && e["tid"] == 1), "no compute events");
}

#[test]
fn plan_refuses_a_gpu_budget_below_the_minimum_and_names_it() {
    let out = plan_small(&["--gpu-budget", "64KiB"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    let min = (12 * 64 * 64 + 13 * 64) * 2;
    assert!(stderr.contains(&format!("{min} B")), "stderr does not give the minimum:\n{stderr}");
    assert!(stderr.contains("raise"), "stderr does not give the fix:\n{stderr}");
}

#[test]
fn plan_hardware_probe_writes_a_profile_that_plan_reads() {
    let dir = tempfile::tempdir().unwrap();
    let hw = dir.path().join("hw.toml");
    let out = oogc(&[
        "plan",
        "--hardware-probe",
        "--out",
        hw.to_str().unwrap(),
        "--probe-dir",
        dir.path().to_str().unwrap(),
        "--probe-mib",
        "8",
        // Small loops: the swap benchmark's memcpy limit is measured beside this test.
        "--probe-triad-elems",
        "262144",
        "--probe-adam-params",
        "262144",
    ]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let profile = oogc::prefetch::HardwareProfile::load(&hw).expect("the probe writes a valid profile");
    assert!(profile.nvme_read_gbps > 0.0 && profile.cpu_adam_params_per_s > 0.0 && profile.host_memory_gbps > 0.0);
    assert!(profile.source.contains("probe"), "{}", profile.source);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("hw.toml")], "the probe left files behind");
    let out = plan_small(&["--hardware", hw.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "stderr:\n{}", text(&out.stderr));
}

#[test]
fn plan_refuses_an_unknown_profile_key_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let hw = dir.path().join("hw.toml");
    std::fs::write(&hw, "h2d_gbps = 20.0\nnvme_gbps = 3.0\n").unwrap();
    let out = plan_small(&["--hardware", hw.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("nvme_gbps") && stderr.contains("hw.toml"), "{stderr}");
}

#[test]
fn plan_with_a_gpu_profile_plans_a_cuda_config_with_it_and_refuses_an_unknown_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::repo_root().join("configs/llama-8b-h100.toml");
    let cfg = cfg.to_str().unwrap();
    // Without a profile: the datasheet's figures, said so, and the GPU figure in the JSON.
    let out = oogc(&["plan", "--config", cfg, "--json"]);
    assert!(out.status.success(), "stderr:\n{}", text(&out.stderr));
    let r = &json_rows(&out)[0];
    assert!(r["hardware"]["source"].as_str().unwrap().contains("datasheet"), "{}", r["hardware"]);
    let d = &r["device_plan"];
    assert_eq!(d["fits"], true, "{d}");
    let parts: u64 = d["parts"].as_array().unwrap().iter().map(|p| p["bytes"].as_u64().unwrap()).sum();
    assert_eq!(d["total_bytes"].as_u64(), Some(parts), "{d}");
    // A profile as `oogc bench probe --device cuda:N` writes it.
    let hw = dir.path().join("gpu.toml");
    let profile = "h2d_gbps = 52.0\nd2h_gbps = 50.0\ndevice_name = \"NVIDIA H100 80GB HBM3\"\n\
                   device_memory_bytes = 85520809984\ndevice_bf16_tflops = 760.0\ndevice_f32_tflops = 48.0\n";
    std::fs::write(&hw, profile).unwrap();
    let out = oogc(&["plan", "--config", cfg, "--profile", hw.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "stderr:\n{}", text(&out.stderr));
    assert!(stdout.contains("GPU figures of the profile (NVIDIA H100 80GB HBM3)"), "{stdout}");
    assert!(stdout.contains("compute: 380000.0 GFLOP/s") && !stdout.contains("datasheet"), "{stdout}");
    // A key misspelt: refused, naming it and the file.
    std::fs::write(&hw, profile.replace("device_bf16_tflops", "device_bf16_tflop")).unwrap();
    let out = oogc(&["plan", "--config", cfg, "--profile", hw.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("device_bf16_tflop") && stderr.contains("gpu.toml"), "{stderr}");
}

#[test]
fn bench_probe_writes_a_profile_or_says_why_not_on_cuda() {
    let dir = tempfile::tempdir().unwrap();
    let hw = dir.path().join("hw.toml");
    let dir_arg = dir.path().to_str().unwrap();
    let out = oogc(&["bench", "probe", "--out", hw.to_str().unwrap(), "--probe-dir", dir_arg, "--probe-mib", "8"]);
    assert!(out.status.success(), "stderr:\n{}", text(&out.stderr));
    let profile = oogc::prefetch::HardwareProfile::load(&hw).unwrap();
    assert!(profile.nvme_read_gbps > 0.0 && profile.device_gflops > 0.0 && !profile.has_gpu_figures());
    // On CUDA: a build without the feature, or a machine without a GPU, says so.
    let out = oogc(&["bench", "probe", "--device", "cuda:0", "--gpu-only", "--out", hw.to_str().unwrap()]);
    if out.status.success() {
        let profile = oogc::prefetch::HardwareProfile::load(&hw).unwrap();
        assert!(profile.device_bf16_tflops.is_some_and(|t| t > 0.0) && profile.device_memory_bytes.is_some());
    } else {
        let stderr = text(&out.stderr);
        assert!(stderr.to_lowercase().contains("cuda"), "{stderr}");
        skip(Capability::Gpu, "bench_probe", &format!("no CUDA GPU probed ({})", stderr.trim()));
    }
}

#[test]
fn bench_adam_prints_json_rows_per_thread_count() {
    for (grad, out, bytes) in [("f32", "none", 28), ("f16", "f32", 30)] {
        let out_ = oogc(&[
            "bench",
            "adam",
            "--params",
            "64K",
            "--threads",
            "1,2",
            "--steps",
            "2",
            "--grad-dtype",
            grad,
            "--param-out",
            out,
            "--triad-mib",
            "16",
            "--json",
        ]);
        assert!(out_.status.success(), "exit {:?}; stderr:\n{}", out_.status, text(&out_.stderr));
        let rows = json_rows(&out_);
        assert_eq!(rows.len(), 2, "{rows:?}");
        for (row, threads) in rows.iter().zip([1, 2]) {
            assert_eq!(row["threads"], threads, "{row}");
            assert_eq!(row["params"], 64 << 10, "{row}");
            assert_eq!(row["bytes_per_param"], bytes, "{row}");
            assert!(row.get("state_dtype").is_none(), "no --state-dtype, no state_dtype: {row}");
            adam_rates_agree(row, bytes as f64);
        }
    }
}

/// A `bench adam` row's rates: positive, finite, and `gbps`, `ratio_to_triad` from
/// `bytes_per_param` = `bytes`.
fn adam_rates_agree(row: &Value, bytes: f64) {
    let (pps, gbps, triad, ratio) = (
        positive(row, "params_per_s"),
        positive(row, "gbps"),
        positive(row, "triad_gbps"),
        positive(row, "ratio_to_triad"),
    );
    assert!((gbps - pps * bytes * 1e-9).abs() <= 1e-9 * gbps.max(1.0) * 1e3, "{row}");
    assert!((ratio - gbps / triad).abs() <= 1e-9 * ratio.max(1.0) * 1e3, "{row}");
    positive(row, "seconds_per_step");
    positive(row, "ratio_to_torch");
}

#[test]
fn bench_adam_state_dtypes_print_rows_with_their_moment_bytes() {
    use oogc::optimizer::StateDType;
    // 65,636 parameters: 256 blocks and a ragged one of 100 (a whole absmax each).
    let n = 65_636usize;
    let flags =
        format!("--params {n} --threads 1,2 --steps 2 --state-dtype f32,bf16 --state-dtype int8 --triad-mib 16");
    let out = oogc(&[&["bench", "adam", "--json"][..], &flags.split(' ').collect::<Vec<_>>()].concat());
    // `adam::run` fails when a step left the first block's moments zero: success means the
    // kernel ran on each type (the int8 codes and absmax included).
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    let dtypes = [StateDType::F32, StateDType::Bf16, StateDType::Int8];
    assert_eq!(rows.len(), dtypes.len() * 2, "{rows:?}");
    for (k, row) in rows.iter().enumerate() {
        let (dtype, threads) = (dtypes[k / 2], [1, 2][k % 2]);
        assert_eq!(row["state_dtype"], dtype.name(), "{row}");
        assert_eq!(row["variant"], format!("adamw g=f32 copy=none state={dtype}"), "{row}");
        assert_eq!(row["threads"], threads, "{row}");
        assert_eq!(row["params"], n, "{row}");
        // p read and written (8), f32 gradients (4), the moments read and written.
        let bytes = (12 * n + 2 * dtype.moment_bytes(n)) as f64 / n as f64;
        let got = row["bytes_per_param"].as_f64().expect("bytes_per_param");
        assert!((got - bytes).abs() <= 1e-12 * bytes, "{bytes} B/param expected: {row}");
        if dtype == StateDType::F32 {
            assert_eq!(row["bytes_per_param"], 28, "an integer, as without --state-dtype: {row}");
        }
        adam_rates_agree(row, bytes);
    }
    let out = oogc(&["bench", "adam", "--params", "1K", "--state-dtype", "f16"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--state-dtype"), "{}", text(&out.stderr));
}

#[test]
fn bench_adam_refuses_bad_arguments_naming_them() {
    let out = oogc(&["bench", "adam", "--params", "0"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--params"), "{}", text(&out.stderr));
    let out = oogc(&["bench", "adam", "--params", "1K", "--grad-dtype", "none"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--grad-dtype"), "{}", text(&out.stderr));
    let out = oogc(&["bench", "adam", "--threads", "0"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--threads"), "{}", text(&out.stderr));
}

#[test]
fn bench_moe_synthetic_prints_one_json_row_per_policy() {
    let dir = tempfile::tempdir().unwrap();
    let written = dir.path().join("routing.jsonl");
    let out =
        oogc(&["bench", "moe", "--synthetic", "--steps", "30", "--write-trace", written.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    let policies: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().expect("policy")).collect();
    assert_eq!(policies, ["fetch-on-demand", "lru", "static", "ours", "ours-no-cpu"]);
    for row in &rows {
        for key in ["expert_h2d_bytes", "hit_rate", "cpu_tokens", "step_s", "refresh_h2d_bytes", "budget_bytes"] {
            assert!(row[key].is_number(), "`{key}` missing in {row}");
        }
        positive(row, "step_s");
        let hit = row["hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit), "{row}");
    }
    // By construction: fetch-on-demand serves nothing in place and only ours computes on the CPU.
    assert_eq!(rows[0]["hit_rate"], 0.0, "{}", rows[0]);
    assert!(rows.iter().filter(|r| r["policy"] != "ours").all(|r| r["cpu_tokens"] == 0), "{rows:?}");
    // The written trace replays to the same rows.
    let again = oogc(&["bench", "moe", "--trace", written.to_str().unwrap(), "--json"]);
    assert!(again.status.success(), "stderr:\n{}", text(&again.stderr));
    // (The rows' `machine` and `command` say when and how they ran, so they differ.)
    let results = |rows: Vec<Value>| -> Vec<Value> {
        rows.into_iter()
            .map(|mut r| {
                let m = r.as_object_mut().unwrap();
                assert!(m.remove("machine").is_some() && m.remove("command").is_some(), "{m:?}");
                r
            })
            .collect()
    };
    assert_eq!(results(json_rows(&again)), results(rows));
}

#[test]
fn bench_moe_refuses_bad_arguments_naming_them() {
    let out = oogc(&["bench", "moe", "--synthetic", "--budget-fraction", "1.5"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--budget-fraction"), "{}", text(&out.stderr));
    let out = oogc(&["bench", "moe"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--trace"), "{}", text(&out.stderr));
    let out = oogc(&["bench", "moe", "--trace", "/nonexistent/routing.jsonl"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("/nonexistent/routing.jsonl"), "{}", text(&out.stderr));
    // A budget below one expert (64 experts: 1/128 of them is half an expert) names the fix.
    let out = oogc(&["bench", "moe", "--synthetic", "--steps", "2", "--budget-fraction", "0.0078125"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("raise the expert budget"), "{}", text(&out.stderr));
}

/// A tiny offloaded config for `bench step`: 8 blocks of width 16, GPU budget of a few blocks,
/// optimizer state on NVMe under `dir`.
fn tiny_step_config(dir: &std::path::Path) -> std::path::PathBuf {
    let data = common::data_path();
    let cfg = format!(
        r#"
[model]
d_model = 16
n_layer = 8
n_head = 2
[data]
path = "{data}"
[train]
batch_size = 2
seq_len = 16
steps = 100
eval_interval = 0
eval_batches = 1
[device]
link_gbps = 1.0
[budgets]
gpu = "48KiB"
host = "64MiB"
optimizer_state = "nvme"
nvme_dirs = ["{nvme}"]
[prefetch]
depth = 2
[threads]
compute = 1
optimizer = 1
[checkpoint]
dir = "{ckpt}"
[output]
metrics = "{metrics}"
"#,
        data = data.display(),
        nvme = dir.join("nvme").display(),
        ckpt = dir.join("ckpt").display(),
        metrics = dir.join("metrics.jsonl").display(),
    );
    let path = dir.join("tiny.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

#[test]
fn bench_step_prints_one_json_row_per_variant() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_step_config(dir.path());
    let out = oogc(&["bench", "step", "--config", cfg.to_str().unwrap(), "--steps", "2", "--warmup", "1", "--json"]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    let variants: Vec<&str> = rows.iter().map(|r| r["variant"].as_str().expect("variant")).collect();
    assert_eq!(variants, ["ours", "on-demand", "resident"], "{rows:?}");
    for row in &rows {
        for key in ["step_s", "lower_bound_s", "ratio_to_lower_bound", "compute_s", "optimizer_s", "transfer_s"] {
            positive(row, key);
        }
        positive(row, "speedup_vs_on_demand");
        positive(row, "d2h_bytes");
        // The schedule bound splits the step at the turn: never below the plain bound, and the
        // forward's compute is a part of the step's.
        let f = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("`{k}` missing in {row}"));
        assert!(f("schedule_bound_s") >= f("lower_bound_s"), "{row}");
        assert!((f("ratio_to_schedule_bound") - f("step_s") / f("schedule_bound_s")).abs() < 1e-9, "{row}");
        assert!(f("forward_compute_s") > 0.0 && f("forward_compute_s") < f("compute_s"), "{row}");
        assert!((f("forward_compute_s") + f("backward_compute_s") - f("compute_s")).abs() < 1e-9, "{row}");
        positive(row, "speedup_ceiling");
        for key in ["h2d_bytes", "nvme_read_bytes", "nvme_write_bytes"] {
            assert!(row[key].is_u64(), "`{key}` missing in {row}");
        }
        assert!(row["machine"]["cores"].as_u64().unwrap() >= 1, "{row}");
        assert!(row["machine"]["git_rev"].is_string(), "{row}");
        assert!(row["config"].as_str().unwrap().contains("[model]"), "{row}");
    }
    let (ours, on_demand, resident) = (&rows[0], &rows[1], &rows[2]);
    positive(ours, "plan_step_s");
    assert!(ours["plan_error"].is_number(), "{ours}");
    assert!(on_demand["plan_step_s"].is_null(), "{on_demand}");
    // Both move bytes. (Not "on demand moves at least ours": under a tight budget the prefetch
    // window may fetch a unit that is evicted again before its use, trading bytes for stall.)
    let bytes = |r: &Value| r["h2d_bytes"].as_u64().unwrap() + r["d2h_bytes"].as_u64().unwrap();
    assert!(bytes(on_demand) > 0 && bytes(ours) > 0, "{on_demand}\n{ours}");
    assert_eq!(on_demand["prefetch_depth"], 0);
    assert_eq!(on_demand["overlap_optimizer"], false);
    // Ours keeps its optimizer state on NVMe; resident keeps it in host memory.
    positive(ours, "nvme_read_bytes");
    assert_eq!(resident["nvme_read_bytes"], 0, "{resident}");
    // No checkpoints, metrics, or NVMe scratch are left behind.
    assert!(!dir.path().join("ckpt").exists());
    assert!(!dir.path().join("metrics.jsonl").exists());
    let left: Vec<_> = std::fs::read_dir(dir.path().join("nvme")).map(|d| d.flatten().collect()).unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn bench_step_skips_resident_over_the_cap_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_step_config(dir.path());
    let out = oogc(&[
        "bench",
        "step",
        "--config",
        cfg.to_str().unwrap(),
        "--steps",
        "1",
        "--warmup",
        "1",
        "--resident-cap",
        "1KiB",
        "--json",
    ]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(rows[2]["variant"], "resident");
    assert!(rows[2]["skipped"].as_str().unwrap().contains("resident cap"), "{}", rows[2]);
    assert_eq!(rows[0]["compute_source"], "own steps minus stalls");
}

#[test]
fn bench_all_writes_a_json_file_per_benchmark_and_the_plots() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out_dir = tmp.path().join("suite");
    let nvme_dir = tmp.path().join("nvme");
    std::fs::create_dir_all(&nvme_dir).expect("nvme dir");
    // `--config F` adds `oogc bench step` (its rows are checked by its own test) and the timeline.
    let cfg = tiny_step_config(tmp.path());
    let out = oogc(&[
        "bench",
        "all",
        "--tiny",
        "--no-fio",
        "--no-progress",
        "--out",
        out_dir.to_str().unwrap(),
        "--nvme-dir",
        nvme_dir.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
        "--link-gbps",
        "0.5",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}\nstdout:\n{stdout}", out.status, text(&out.stderr));
    for name in ["nvme", "swap", "adam", "evict", "moe", "step", "timeline", "plan"] {
        let path = out_dir.join(format!("{name}.json"));
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}")))
                .unwrap_or_else(|e| panic!("{path:?} is not JSON: {e}"));
        assert_eq!(doc["benchmark"], name, "{doc}");
        assert!(doc["args"].is_object(), "{doc}");
        assert!(doc["machine"]["cores"].as_u64().is_some_and(|c| c > 0), "no machine record: {doc}");
        let rows = doc["rows"].as_array().unwrap_or_else(|| panic!("no rows array in {path:?}"));
        assert!(!rows.is_empty(), "{path:?} has no rows");
    }
    // Without --plan-config the plan is checked on the --config run, as throttled.
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("plan.json")).unwrap()).unwrap();
    let row = &plan["rows"][0];
    assert!(row["plan_step_s"].as_f64().is_some_and(|p| p > 0.0), "{row}");
    assert!(row["measured_step_s"].as_f64().is_some_and(|p| p > 0.0), "{row}");
    assert!(row["within_15pct"].is_boolean(), "{row}");
    assert!(stdout.contains("measured s"), "the suite prints the plan beside the measured step:\n{stdout}");
    let step: Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("step.json")).unwrap()).unwrap();
    assert_eq!(step["args"]["link_gbps"], 0.5, "--link-gbps reaches the step bench: {step}");
    let timeline: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("timeline.json")).unwrap()).unwrap();
    // One row per shown step and a summary (`step: null`) whose lanes were busy.
    let rows = timeline["rows"].as_array().unwrap();
    let summary = rows.last().unwrap();
    assert!(summary["step"].is_null(), "{summary}");
    for lane in ["compute_s", "h2d_s", "d2h_s", "optimizer_s"] {
        assert!(summary[lane].as_f64().is_some_and(|t| t > 0.0), "`{lane}` not busy: {summary}");
    }
    for name in ["nvme", "adam", "evict", "moe", "timeline"] {
        for ext in ["png", "svg"] {
            let path = out_dir.join(format!("{name}.{ext}"));
            let len = std::fs::metadata(&path).unwrap_or_else(|e| panic!("{path:?}: {e}")).len();
            assert!(len > 0, "{path:?} is empty");
        }
    }
}

#[test]
fn bench_step_refuses_a_link_that_is_not_positive() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_step_config(dir.path());
    let out = oogc(&["bench", "step", "--config", cfg.to_str().unwrap(), "--link-gbps", "0"]);
    assert!(!out.status.success(), "a zero link must be refused");
    let err = text(&out.stderr);
    assert!(err.contains("--link-gbps 0") && err.contains("positive"), "{err}");
}

#[test]
fn bench_plan_prints_the_plan_beside_the_measured_step() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_step_config(dir.path());
    let out = oogc(&["bench", "plan", "--config", cfg.to_str().unwrap(), "--steps", "2", "--warmup", "1", "--json"]);
    assert!(out.status.success(), "exit {:?}; stderr:\n{}", out.status, text(&out.stderr));
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0];
    for key in ["plan_step_s", "measured_step_s", "device_gflops", "backward_flops_ratio"] {
        positive(row, key);
    }
    assert!(row["error"].as_f64().is_some_and(f64::is_finite) && row["within_15pct"].is_boolean(), "{row}");
}

#[test]
fn config_example_loads_and_config_reference_is_the_books() {
    let out = oogc(&["config", "--example"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("example.toml");
    std::fs::write(&path, &out.stdout).unwrap();
    let cfg = oogc::config::TrainConfig::load(&path).unwrap_or_else(|e| panic!("{e}\n{}", text(&out.stdout)));
    assert_eq!((cfg.train.steps, cfg.budgets.gpu.as_u64()), (600, 2 << 20));
    let out = oogc(&["config", "--reference"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let book = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference/config.md");
    assert!(std::fs::read(&book).unwrap() == out.stdout, "{} differs from `oogc config --reference`", book.display());
    // Neither flag, or both: a usage error (clap's status 2).
    for args in [&["config"][..], &["config", "--reference", "--example"]] {
        assert_eq!(oogc(args).status.code(), Some(2), "{args:?}");
    }
}
