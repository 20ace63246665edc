//! `oogc gpu-check` where there is no GPU: `--device sim --quick` (what CI runs on every commit)
//! runs checks 1–8, each a pass or a skip with its reason, and writes one JSON row per check and
//! the Markdown report; a failing check gives a `fail` row, a **FAIL** line and a non-zero exit
//! (missing data; `--device cuda:0` from a binary without CUDA); a check with no time left is
//! skipped, not failed; `--out` holds the reports and `--work` the scratch; every row carries the
//! git revision; SIGTERM stops the run with the check in flight failed and the rest skipped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A run's directories: the reports (`--out`) and the scratch (`--work`), side by side in a
/// temporary directory.
struct Dirs {
    _tmp: tempfile::TempDir,
    out: PathBuf,
    work: PathBuf,
}

impl Dirs {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let (out, work) = (tmp.path().join("out"), tmp.path().join("work"));
        Self { _tmp: tmp, out, work }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_oogc"));
        c.arg("gpu-check").arg("--out").arg(&self.out).arg("--work").arg(&self.work).args(args);
        c
    }
}

fn gpu_check(dirs: &Dirs, args: &[&str]) -> Output {
    dirs.command(args).output().expect("run the oogc binary")
}

/// The revision `oogc --version` names (`oogc 0.1.0 (rev REV)`).
fn version_rev() -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_oogc")).arg("--version").output().unwrap();
    let v = text(&o.stdout);
    v.trim().rsplit_once("(rev ").and_then(|(_, r)| r.strip_suffix(')')).unwrap_or_else(|| panic!("{v}")).to_string()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The rows of `out/gpu-check.jsonl`, each checked for the fields every row has.
fn rows(out: &Path) -> Vec<Value> {
    let jsonl = std::fs::read_to_string(out.join("gpu-check.jsonl")).expect("gpu-check.jsonl");
    let rows: Vec<Value> =
        jsonl.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    for r in &rows {
        assert!(r["id"].as_u64().is_some(), "{r}");
        assert!(r["name"].as_str().is_some_and(|n| !n.is_empty()), "{r}");
        assert!(["pass", "fail", "skip"].contains(&r["status"].as_str().unwrap_or("")), "{r}");
        assert!(r["seconds"].as_f64().is_some_and(|s| s >= 0.0), "{r}");
        assert!(r["figures"].is_object(), "{r}");
        assert!(r["notes"].is_array(), "{r}");
        assert!(r["git_rev"].as_str().is_some_and(|g| !g.is_empty()), "every row names the binary's revision: {r}");
        match r["status"].as_str() {
            Some("fail") => {
                assert!(r["error"].as_str().is_some_and(|e| !e.is_empty()), "a fail row names its error: {r}")
            }
            Some("skip") => assert!(
                r["notes"].as_array().is_some_and(|n| n.iter().any(|n| n.as_str().is_some_and(|s| !s.is_empty()))),
                "a skip row gives its reason: {r}"
            ),
            _ => assert!(r["error"].is_null(), "{r}"),
        }
    }
    rows
}

fn row(rows: &[Value], id: u64) -> &Value {
    rows.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("no row {id} in {rows:?}"))
}

#[test]
fn sim_quick_runs_checks_one_to_eight_and_none_fails() {
    let dirs = Dirs::new();
    let o = gpu_check(&dirs, &["--device", "sim", "--quick"]);
    assert!(o.status.success(), "exit {:?}\nstdout:\n{}\nstderr:\n{}", o.status, text(&o.stdout), text(&o.stderr));
    let out = &dirs.out;
    let rows = rows(out);
    let ids: Vec<u64> = rows.iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, (1..=8).collect::<Vec<_>>(), "checks 1–8 in order");
    let rev = version_rev();
    for r in &rows {
        assert_eq!(r["device"], "sim", "{r}");
        assert_eq!(r["git_rev"], rev.as_str(), "{r}");
        if r["id"] == 2 {
            // The swapper's CUDA tests cannot run on the sim device: an honest skip.
            assert_eq!(r["status"], "skip", "{r}");
            assert!(r["notes"][0].as_str().unwrap().contains("needs CUDA"), "{r}");
        } else {
            assert_eq!(r["status"], "pass", "check {} on the sim device: {r}", r["id"]);
        }
    }
    // What the checks found, not only that they passed.
    let f = |id: u64| &row(&rows, id)["figures"];
    assert_eq!(f(5)["negative_control"]["detected"], true, "{}", f(5));
    for dtype in ["f32", "bf16"] {
        let t = &f(5)[format!("{dtype}.totals")];
        for k in ["fetch_mismatches", "gradient_mismatches", "activation_mismatches"] {
            assert_eq!(t[k], 0, "{dtype} {k}: {t}");
        }
    }
    assert_eq!(f(6)["offloaded"]["bitwise"], true, "{}", f(6));
    assert_eq!(f(6)["nvme_immediate"]["bitwise"], true, "{}", f(6));
    assert_eq!(f(6)["activation_offload"]["bitwise"], true, "{}", f(6));
    assert!(f(8)["ours_h2d_gbps"].as_f64().is_some_and(|g| g > 0.0), "{}", f(8));
    for case in ["llama_gqa", "qwen2_tied", "mixtral_moe"] {
        let share = f(4)[format!("{case}.f32")]["grads"]["worst_tolerance_share"].as_f64().unwrap();
        assert!(share <= 1.0, "{case}: {share}");
    }

    // The Markdown report: the header with the date, the revision, the device, its driver and the
    // machine, one line per check, the summary.
    let md = std::fs::read_to_string(out.join("gpu-check.md")).unwrap();
    assert!(md.starts_with("# oogc gpu-check\n"), "{md}");
    assert!(md.contains("- host: ") && md.contains("- device: `sim`"), "{md}");
    assert!(md.contains(&format!("git rev `{rev}`")), "{md}");
    assert!(md.contains("- driver: "), "{md}");
    let date = md.lines().find_map(|l| l.strip_prefix("- date: ")).unwrap_or_else(|| panic!("no date: {md}"));
    assert!(date.len() > 20 && date[..4].parse::<u32>().is_ok_and(|y| y >= 2024) && date.contains(" UTC"), "{date}");
    for id in 1..=8 {
        assert_eq!(md.lines().filter(|l| l.starts_with(&format!("| {id} | "))).count(), 1, "check {id}'s line:\n{md}");
    }
    assert!(md.contains("7 passed, 0 failed, 1 skipped"), "{md}");
    assert!(!md.contains("FAIL"), "{md}");
    // Each check wrote its log; --out holds reports only, the scratch (the token cache, the
    // checks' own directories) is in --work.
    assert_eq!(std::fs::read_dir(out.join("logs")).unwrap().count(), 8);
    let mut entries: Vec<String> =
        std::fs::read_dir(out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    entries.sort();
    assert_eq!(entries, ["gpu-check.jsonl", "gpu-check.md", "logs", "rows", "traces"]);
    assert!(dirs.work.join("tokens").is_dir(), "the token cache in --work");
    assert!(dirs.work.join("6-training").is_dir(), "check 6's scratch in --work");
}

#[test]
fn a_failing_check_gives_a_fail_row_and_a_nonzero_exit() {
    let dirs = Dirs::new();
    let empty = tempfile::tempdir().unwrap();
    let shared = empty.path().to_str().unwrap();
    let o = gpu_check(&dirs, &["--device", "sim", "--only", "1,2", "--shared", shared]);
    assert!(!o.status.success(), "exit {:?}; stdout:\n{}", o.status, text(&o.stdout));
    let rows = rows(&dirs.out);
    assert_eq!(rows.len(), 2);
    let r = row(&rows, 1);
    assert_eq!(r["status"], "fail", "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("data missing")
            && r["error"].as_str().unwrap().contains("tinyshakespeare.txt"),
        "{r}"
    );
    // The harness went on to the next check after the failure.
    assert_eq!(row(&rows, 2)["status"], "skip");
    let md = std::fs::read_to_string(dirs.out.join("gpu-check.md")).unwrap();
    assert!(md.lines().any(|l| l.starts_with("| 1 | environment | **FAIL** |")), "{md}");
    assert!(md.contains("0 passed, 1 failed, 1 skipped"), "{md}");
}

#[test]
fn cuda_without_a_gpu_fails_honestly() {
    let dirs = Dirs::new();
    let o = gpu_check(&dirs, &["--device", "cuda:0", "--only", "1,2"]);
    let rows = rows(&dirs.out);
    assert_eq!(rows.len(), 2);
    let failed = rows.iter().any(|r| r["status"] == "fail");
    assert_eq!(o.status.success(), !failed, "the exit status follows the rows: {rows:?}");
    if !cfg!(feature = "cuda") {
        // This binary cannot open a GPU, and says why; nothing passes for a GPU result.
        let r = row(&rows, 1);
        assert_eq!(r["status"], "fail", "{r}");
        let e = r["error"].as_str().unwrap();
        assert!(e.contains("built without CUDA") && e.contains("scripts/build-cuda.sh"), "{e}");
        let r = row(&rows, 2);
        assert_eq!(r["status"], "fail", "{r}");
        assert!(r["error"].as_str().unwrap().contains("swapper-tests"), "{r}");
        assert!(!o.status.success());
        assert!(rows.iter().all(|r| r["device"] == "cuda:0"));
    }
}

#[test]
fn a_check_without_time_left_is_skipped_not_failed() {
    let dirs = Dirs::new();
    let o = gpu_check(&dirs, &["--device", "sim", "--only", "3", "--budget-s", "1"]);
    assert!(o.status.success(), "stdout:\n{}\nstderr:\n{}", text(&o.stdout), text(&o.stderr));
    let rows = rows(&dirs.out);
    let r = row(&rows, 3);
    assert_eq!(r["status"], "skip", "{r}");
    assert!(r["notes"][0].as_str().unwrap().starts_with("not started"), "{r}");
}

#[test]
fn sigterm_fails_the_check_in_flight_skips_the_rest_and_writes_the_summary() {
    let dirs = Dirs::new();
    // Checks 6 and 7 (tiny training runs) take seconds on the sim device; the signal comes as
    // soon as check 6's process has started (its log exists).
    let child = dirs
        .command(&["--device", "sim", "--only", "6,7"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = dirs.out.join("logs/6-training.log");
    let waited = Instant::now();
    while !log.exists() {
        assert!(waited.elapsed() < Duration::from_secs(120), "check 6 never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let o = child.wait_with_output().unwrap();
    let rows = rows(&dirs.out);
    assert_eq!(rows.len(), 2, "{rows:?}\nstderr:\n{}", text(&o.stderr));
    let (r6, r7) = (row(&rows, 6), row(&rows, 7));
    if r6["status"] == "pass" {
        // Check 6 finished before the signal arrived (a slow start of the signal): then check 7
        // was the one in flight.
        eprintln!("note: check 6 finished before SIGTERM; check 7 was in flight");
        assert_eq!(r7["status"], "fail", "{r7}");
        assert!(r7["error"].as_str().unwrap().contains("stopped by SIGTERM"), "{r7}");
    } else {
        assert_eq!(r6["status"], "fail", "{r6}");
        assert!(r6["error"].as_str().unwrap().contains("stopped by SIGTERM"), "{r6}");
        assert!(r6["error"].as_str().unwrap().contains("figures so far kept"), "{r6}");
        assert_eq!(r7["status"], "skip", "{r7}");
        assert!(r7["notes"][0].as_str().unwrap().contains("stopped by SIGTERM"), "{r7}");
    }
    assert!(!o.status.success(), "a stopped run is not a success");
    let md = std::fs::read_to_string(dirs.out.join("gpu-check.md")).unwrap();
    assert!(md.contains("stopped by SIGTERM).") && md.contains("1 failed"), "{md}");
}
