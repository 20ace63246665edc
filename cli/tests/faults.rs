//! Faults as a user meets them (issue 17; DESIGN.md invariants 2, 4, 5): a corrupt checkpoint is
//! an error naming the file and the tensor (and `--fallback` goes back to one that verifies), a
//! second run of a config is refused while the first holds its directories, SIGTERM checkpoints
//! and exits 3 (a second signal exits at once), and a failing NVMe write stops the run with the
//! file and offset, after which resuming gives the same losses.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn oogc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oogc"));
    c.env("RAYON_NUM_THREADS", "1");
    c
}

use common::metrics_losses as losses;

/// [`common::small_run`] keeping 3 checkpoints.
fn config(dir: &Path, name: &str, steps: u64, interval: u64) -> PathBuf {
    common::small_run(dir, name, steps, interval, 3)
}

fn train(cfg: &Path, extra: &[&str]) -> Output {
    train_env(cfg, extra, &[])
}

/// [`train`] with the environment variables `envs` (the test hooks).
fn train_env(cfg: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Output {
    train_command(cfg, extra, envs).output().unwrap()
}

/// `oogc train --no-progress --config CFG EXTRA…` with the environment variables `envs`.
fn train_command(cfg: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut c = oogc();
    c.args(["train", "--no-progress", "--config"]).arg(cfg).args(extra);
    for (k, v) in envs {
        c.env(k, v);
    }
    c
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn spawn(cfg: &Path, envs: &[(&str, &str)]) -> Child {
    train_command(cfg, &[], envs).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits until `metrics` has at least `n` lines (the child must still be running).
fn wait_for_steps(child: &mut Child, metrics: &Path, n: usize) {
    let start = Instant::now();
    while losses(metrics).len() < n {
        assert!(start.elapsed() < Duration::from_secs(120), "the run did not reach step {n}");
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the run ended ({st}) before step {n}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap();
    assert!(st.success());
}

fn flip_mid_data(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mid = header + (bytes.len() - header) / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_flipped_byte_in_a_checkpoint_is_caught_and_fallback_resumes_from_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let reference = config(dir.path(), "ref", 10, 2);
    assert!(train(&reference, &[]).status.success());
    let expected = losses(&dir.path().join("ref/metrics.jsonl"));

    let cfg = config(dir.path(), "run", 10, 2);
    let out = train(&cfg, &["--steps", "6"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ckpt = dir.path().join("run/ckpt");
    let newest = oogc::checkpoint::path_for(&ckpt, 6);
    flip_mid_data(&newest);

    // Resume: refused, naming the file, the tensor and the previous checkpoint.
    let out = train(&cfg, &["--resume", ckpt.to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for needle in
        ["ckpt-00000006.safetensors", "tensor ", "fails its crc32c", "ckpt-00000004.safetensors", "--fallback"]
    {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // inspect reports it; --verify names each checkpoint.
    let out = oogc().arg("inspect").arg(&ckpt).output().unwrap();
    assert!(!out.status.success() && stderr(&out).contains("fails its crc32c"), "{}", stderr(&out));
    let out = oogc().args(["inspect", "--verify"]).arg(&ckpt).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("CORRUPT") && text.contains("ckpt-00000006"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("ok")).count(), 2, "{text}");

    // --fallback: says which one it skipped and why, resumes from step 4, same losses.
    let out = train(&cfg, &["--resume", ckpt.to_str().unwrap(), "--fallback"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("skipping") && err.contains("ckpt-00000006") && err.contains("crc32c"), "{err}");
    assert!(err.contains("resuming from") && err.contains("ckpt-00000004"), "{err}");
    assert_eq!(losses(&dir.path().join("run/metrics.jsonl")), expected);
}

#[test]
fn a_second_run_of_a_config_is_refused_while_the_first_holds_its_directories() {
    let dir = tempfile::tempdir().unwrap();
    // No checkpoint before the end: the old code let a second run in.
    let cfg = config(dir.path(), "run", 100_000, 0);
    let metrics = dir.path().join("run/metrics.jsonl");
    let mut first = spawn(&cfg, &[]);
    wait_for_steps(&mut first, &metrics, 2);
    let out = train(&cfg, &["--steps", "3"]);
    let err = stderr(&out);
    let still_running = first.try_wait().unwrap().is_none();
    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(out.status.code(), Some(1), "the second run was not refused: {err}");
    assert!(still_running, "the first run must not be disturbed");
    for needle in ["is in use by another oogc run", &format!("pid {}", first.id()), "fix", "kill -TERM"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // The first one was killed: its lock is stale, and the next run takes it over with a warning.
    let out = train(&cfg, &["--steps", "1"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("taking over the lock"), "{err}");
    let nvme = dir.path().join("run/nvme");
    let left: Vec<_> = std::fs::read_dir(&nvme).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from(oogc::lock::LOCK_FILE)], "the killed run's store file is removed");
}

#[test]
fn sigterm_checkpoints_the_finished_step_and_exits_3_and_a_second_signal_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let reference = config(dir.path(), "ref", 40, 0);
    assert!(train(&reference, &[]).status.success());
    let expected = losses(&dir.path().join("ref/metrics.jsonl"));

    let cfg = config(dir.path(), "run", 40, 0);
    let metrics = dir.path().join("run/metrics.jsonl");
    let mut child = spawn(&cfg, &[]);
    wait_for_steps(&mut child, &metrics, 5);
    signal(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    let done = losses(&metrics).len() as u64;
    assert!(done < 40, "{done}");
    let ckpts = oogc::checkpoint::list(&dir.path().join("run/ckpt")).unwrap();
    assert_eq!(ckpts.last().map(|c| c.0), Some(done), "a checkpoint of the last finished step: {ckpts:?}");
    let resume = format!("resume with: oogc train --config {} --resume", cfg.display());
    assert!(err.contains(&resume), "{err}");
    let out = train(&cfg, &["--resume", dir.path().join("run/ckpt").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(losses(&metrics), expected, "the stopped and resumed run equals the uninterrupted one");

    // A second signal while the stop waits for the checkpoint in flight (paused there by the
    // test hook) exits at once with 128 + 15; the checkpoints before stay valid. Step 4's line
    // is written after step 2's checkpoint completed (a save waits for the one before it), so
    // the first signal comes while step 4's is in flight.
    let cfg = config(dir.path(), "twice", 40, 2);
    let metrics = dir.path().join("twice/metrics.jsonl");
    let mut child = spawn(&cfg, &[("OOGC_PAUSE_AT", "checkpoint:1500")]);
    wait_for_steps(&mut child, &metrics, 4);
    signal(&child, "-TERM");
    // Let the first signal be taken (the flag set) before the second.
    std::thread::sleep(Duration::from_millis(200));
    let ckpt = dir.path().join("twice/ckpt");
    let tmp_seen = Instant::now();
    // Wait until a checkpoint write is in progress (its temp file exists), then signal again.
    while !std::fs::read_dir(&ckpt).unwrap().flatten().any(|e| e.file_name().to_string_lossy().ends_with(".tmp")) {
        assert!(tmp_seen.elapsed() < Duration::from_secs(60), "no checkpoint write seen");
        std::thread::sleep(Duration::from_millis(2));
    }
    signal(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    // 128 + 15 is the second signal's exit, taken inside the paused write; had the process slept
    // the write out and stopped gracefully, it would exit with 3 (no clock needed to tell them).
    assert_eq!(out.status.code(), Some(128 + 15), "{}", stderr(&out));
    let ckpts = oogc::checkpoint::list(&ckpt).unwrap();
    assert!(!ckpts.is_empty());
    for (_, p) in ckpts {
        assert!(matches!(oogc::checkpoint::verify(&p), Ok(oogc::checksum::Verification::Verified { .. })), "{p:?}");
    }
}

/// A checkpoint is written in the background while the next step runs (its writer paused
/// half-way by the test hook): the next step's speculated updates write new NVMe extents beside
/// the ones being read and the step waits before committing them until every unit is read, so
/// the file holds the state of the step it was started after and a resume from it gives the
/// uninterrupted run's losses (without that wait the save reads a moved state and fails). Every
/// save puts `ckpt_held_s` on the next step's line and `ckpt_s` / `ckpt_bytes` on the line of
/// the step it completed by, its seconds including the pause.
#[test]
fn a_background_checkpoint_holds_the_state_it_was_started_at_while_steps_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let reference = config(dir.path(), "ref", 10, 0);
    assert!(train(&reference, &[]).status.success());
    let expected = losses(&dir.path().join("ref/metrics.jsonl"));

    // Seven steps of the reference's ten (its learning-rate schedule).
    let cfg = config(dir.path(), "run", 10, 2);
    let out = train_env(&cfg, &["--steps", "7"], &[("OOGC_PAUSE_AT", "checkpoint:400")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = common::metrics_lines(&dir.path().join("run/metrics.jsonl"));
    assert_eq!(lines.len(), 7, "a line per step, each whole");
    let steps_with = |key: &str| -> Vec<u64> {
        lines.iter().filter(|v| v.get(key).is_some()).map(|v| v["step"].as_u64().unwrap()).collect()
    };
    assert_eq!(steps_with("ckpt_held_s"), [3, 5, 7], "saves started after steps 2, 4 and 6");
    let completed = steps_with("ckpt_s");
    assert_eq!(completed.len(), 3, "each save completed by a step's end: {completed:?}");
    for (saved, by) in [2, 4, 6].into_iter().zip(&completed) {
        assert!(*by > saved && *by <= saved + 2, "the save of step {saved} completed by step {by}");
    }
    for v in lines.iter().filter(|v| v.get("ckpt_s").is_some()) {
        assert!(v["ckpt_s"].as_f64().unwrap() >= 0.4, "the pause is in the save's seconds: {v}");
        assert!(v["ckpt_bytes"].as_u64().unwrap() > 0, "{v}");
    }
    let ckpt = dir.path().join("run/ckpt");
    let saved: Vec<u64> = oogc::checkpoint::list(&ckpt).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(saved, [4, 6, 7], "keep 3: the saves of steps 4, 6 and the last step's");
    for step in [4, 6] {
        let resumed = config(dir.path(), &format!("from{step}"), 10, 0);
        let from = oogc::checkpoint::path_for(&ckpt, step);
        let out = train(&resumed, &["--resume", from.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        let got = losses(&dir.path().join(format!("from{step}/metrics.jsonl")));
        assert_eq!(got, expected[step as usize..], "resumed from the background save of step {step}");
    }
}

#[test]
fn a_failing_nvme_write_stops_the_run_naming_the_file_and_resuming_gives_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let reference = config(dir.path(), "ref", 16, 3);
    assert!(train(&reference, &[]).status.success());
    let expected = losses(&dir.path().join("ref/metrics.jsonl"));

    // 6 units of one chunk each: 6 state writes at start, 6 per step; write 50 is in step 8.
    let cfg = config(dir.path(), "run", 16, 3);
    let out = train_env(&cfg, &[], &[("OOGC_FAULT_NVME", "write:50")]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for needle in ["I/O error on", "oogc-nvme-", ".swap at offset", "injected fault", "--resume"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    let metrics = dir.path().join("run/metrics.jsonl");
    let logged = losses(&metrics).len();
    assert!((3..16).contains(&logged), "the run stopped mid-way: {logged} steps");
    let out = train(&cfg, &["--resume", dir.path().join("run/ckpt").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(losses(&metrics), expected);
}

/// A save that cannot be written — the process's file size limit (RLIMIT_FSIZE, SIGXFSZ
/// ignored) fails the checkpoint's writes as a full disk would — leaves the previous
/// checkpoints as they were and no temp file, and the run goes on; the last step's save failing
/// ends the run with an error naming the checkpoint's directory and a fix.
#[test]
fn a_checkpoint_that_cannot_be_written_leaves_the_previous_one_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    // State in host memory: the NVMe store's files would meet the limit too.
    let text = common::tiny("64KiB", "host", &dir.path().join("nvme"), 2)
        .replace("n_layer = 24", "n_layer = 4")
        .replace("steps = 20", "steps = 8")
        .replace(
            "[threads]",
            "[checkpoint]\ndir = \"run/ckpt\"\ninterval = 2\nkeep = 3\n[output]\nmetrics = \"run/metrics.jsonl\"\n[threads]",
        );
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = train(&cfg, &["--steps", "4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ckpt = dir.path().join("run/ckpt");
    let saved: Vec<(u64, Vec<u8>)> =
        oogc::checkpoint::list(&ckpt).unwrap().into_iter().map(|(s, p)| (s, std::fs::read(p).unwrap())).collect();
    assert_eq!(saved.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![2, 4]);
    let limit_blocks = 64; // 32 KiB in sh's 512-byte blocks: below a checkpoint, above a metrics line
    assert!(saved[1].1.len() > 4 * 512 * limit_blocks, "the checkpoint is larger than the limit");
    let script = format!(
        "trap '' XFSZ; ulimit -f {limit_blocks}; exec \"{}\" train --no-progress --config \"{}\" --resume \"{}\"",
        env!("CARGO_BIN_EXE_oogc"),
        cfg.display(),
        ckpt.display()
    );
    let out = Command::new("sh").args(["-c", &script]).env("RAYON_NUM_THREADS", "1").output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "the last save fails the run: {err}");
    assert!(err.contains("checkpoint not saved") && err.contains("training goes on"), "step 6's save: {err}");
    assert!(err.contains(&ckpt.display().to_string()) && err.contains("fix"), "{err}");
    // Steps 5-8 ran past the failed save at step 6.
    let steps: Vec<u64> = std::fs::read_to_string(dir.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>(), "{err}");
    // The previous checkpoints untouched, no temp file left.
    let after: Vec<(u64, Vec<u8>)> =
        oogc::checkpoint::list(&ckpt).unwrap().into_iter().map(|(s, p)| (s, std::fs::read(p).unwrap())).collect();
    assert!(after == saved, "checkpoints changed");
    let names: Vec<String> =
        std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    // And it still resumes.
    let out = train(&cfg, &["--resume", ckpt.to_str().unwrap(), "--steps", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
}
