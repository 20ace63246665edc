//! The fault-injection soak (issue 17; DESIGN.md invariant 4): `oogc train` is killed again and
//! again — SIGKILL at a random moment (start-up included), SIGKILL while a checkpoint is being
//! written (the `OOGC_PAUSE_AT=checkpoint` hook holds the write open), an abort half-way through
//! a checkpoint write (`OOGC_CRASH_AT=checkpoint`) and half-way through an NVMe write of the
//! optimizer's state stream (`OOGC_FAULT_NVME=abort-write`), and a graceful SIGTERM — and resumed
//! each time from its newest checkpoint. At the end the losses of every step and the final
//! parameters and optimizer state must equal an uninterrupted run's, bit for bit.
//!
//! `OOGC_SOAK_KILLS` (default 20) sets the kills, `OOGC_SOAK_SEED` (default 17) the random
//! moments; `scripts/soak.sh` runs it longer by hand. Deterministic in what it checks: every
//! scenario either makes progress or is followed by one that does, and the comparison does not
//! depend on where the kills land.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use std::os::unix::process::ExitStatusExt;

/// Steps of the run for `kills` kills: enough for them (a cycle advances the run by zero to
/// about three steps).
fn steps_for(kills: usize) -> u64 {
    120.max(6 * kills as u64)
}

fn oogc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oogc"));
    c.env("RAYON_NUM_THREADS", "1").stdout(Stdio::null()).stderr(Stdio::null());
    c
}

/// splitmix64: the soak's random moments, from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// [`common::small_run`] with a checkpoint every step, keeping 2.
fn config(dir: &Path, name: &str, steps: u64) -> PathBuf {
    common::small_run(dir, name, steps, 1, 2)
}

/// The metrics lines' (step, loss, grad_norm, clip_scale, lr, val_loss) as exact bits.
fn records(path: &Path) -> Vec<(u64, u64, u64, u32, u32, Option<u64>)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"));
            let f = |k: &str| v[k].as_f64().unwrap();
            (
                v["step"].as_u64().unwrap(),
                f("loss").to_bits(),
                f("grad_norm").to_bits(),
                (f("clip_scale") as f32).to_bits(),
                (f("lr") as f32).to_bits(),
                v["val_loss"].as_f64().map(f64::to_bits),
            )
        })
        .collect()
}

/// Steps logged (complete lines).
fn logged(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.matches('\n').count())
}

fn spawn(cfg: &Path, ckpt: &Path, envs: &[(&str, String)]) -> Child {
    let mut c = oogc();
    c.args(["train", "--no-progress", "--config"]).arg(cfg);
    if oogc::checkpoint::list(ckpt).is_ok_and(|l| !l.is_empty()) {
        c.arg("--resume").arg(ckpt);
    }
    for (k, v) in envs {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// Polls until `ready` holds or the child exits; `Some(status)` when it exited.
fn wait_until(child: &mut Child, mut ready: impl FnMut() -> bool) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if ready() {
            return None;
        }
        // A hang guard, not a speed check: generous for a busy machine's debug build.
        assert!(start.elapsed() < Duration::from_secs(300), "the run made no progress for 300 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn sigkill(child: &mut Child) -> ExitStatus {
    let _ = child.kill();
    child.wait().unwrap()
}

/// The step of a checkpoint temp file being written in `ckpt`, if any.
fn writing_checkpoint(ckpt: &Path) -> Option<u64> {
    std::fs::read_dir(ckpt).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        name.strip_prefix("ckpt-")?.strip_suffix(".safetensors.tmp")?.parse().ok()
    })
}

#[derive(Debug, Default)]
struct Tally {
    kills: usize,
    sigterms: usize,
    cycles: usize,
    by_scenario: std::collections::BTreeMap<&'static str, usize>,
}

#[test]
fn soak_killed_runs_resume_to_the_uninterrupted_runs_losses_and_parameters_bitwise() {
    let target: usize = std::env::var("OOGC_SOAK_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let seed: u64 = std::env::var("OOGC_SOAK_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(17);
    let steps = steps_for(target);
    let mut rng = Rng(seed);
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();

    let reference = config(dir.path(), "ref", steps);
    let st = oogc().args(["train", "--no-progress", "--config"]).arg(&reference).status().unwrap();
    assert!(st.success(), "{st}");
    let expected = records(&dir.path().join("ref/metrics.jsonl"));
    assert_eq!(expected.len() as u64, steps);

    let cfg = config(dir.path(), "soak", steps);
    let ckpt = dir.path().join("soak/ckpt");
    let metrics = dir.path().join("soak/metrics.jsonl");
    let mut tally = Tally::default();
    loop {
        tally.cycles += 1;
        assert!(tally.cycles < 6 * target + 50, "no end in sight: {tally:?}");
        let resumed = oogc::checkpoint::list(&ckpt).map_or(0, |l| l.last().map_or(0, |c| c.0));
        let base = logged(&metrics).min(resumed as usize);
        if tally.kills >= target {
            // Enough kills: run to the end.
            let st = spawn(&cfg, &ckpt, &[]).wait().unwrap();
            assert!(st.success(), "the final run failed: {st}");
            break;
        }
        let scenario = [
            "sigkill",
            "sigkill-startup",
            "sigkill-in-checkpoint",
            "abort-in-checkpoint",
            "abort-in-nvme-write",
            "sigterm",
        ][(tally.cycles - 1) % 6];
        let (status, killed_here) = match scenario {
            "sigkill" => {
                // Two more steps logged (so one more checkpoint done), then a random moment.
                let mut child = spawn(&cfg, &ckpt, &[]);
                match wait_until(&mut child, || logged(&metrics) >= base + 2) {
                    Some(st) => (st, false),
                    None => {
                        std::thread::sleep(Duration::from_millis(rng.range(0, 25)));
                        (sigkill(&mut child), true)
                    }
                }
            }
            "sigkill-startup" => {
                // Start-up: lock, NVMe preallocation, loading the checkpoint.
                let mut child = spawn(&cfg, &ckpt, &[]);
                std::thread::sleep(Duration::from_millis(rng.range(0, 60)));
                (sigkill(&mut child), true)
            }
            "sigkill-in-checkpoint" => {
                // Checkpoint writes pause half-way: kill inside one, after one more was done.
                let pause = ("OOGC_PAUSE_AT", "checkpoint:150".to_string());
                let mut child = spawn(&cfg, &ckpt, &[pause]);
                match wait_until(&mut child, || writing_checkpoint(&ckpt).is_some_and(|s| s >= resumed + 2)) {
                    Some(st) => (st, false),
                    None => {
                        std::thread::sleep(Duration::from_millis(rng.range(0, 100)));
                        (sigkill(&mut child), true)
                    }
                }
            }
            "abort-in-checkpoint" => {
                let n = rng.range(2, 3);
                let crash = ("OOGC_CRASH_AT", format!("checkpoint:{n}"));
                (spawn(&cfg, &ckpt, &[crash]).wait().unwrap(), true)
            }
            "abort-in-nvme-write" => {
                // 6 units of one chunk: 6 state writes at start (12 when resuming: the state is
                // written again from the checkpoint), then 6 per step.
                let n = 12 + 6 * rng.range(1, 2) + rng.range(1, 6);
                let crash = ("OOGC_FAULT_NVME", format!("abort-write:{n}"));
                (spawn(&cfg, &ckpt, &[crash]).wait().unwrap(), true)
            }
            "sigterm" => {
                let mut child = spawn(&cfg, &ckpt, &[]);
                match wait_until(&mut child, || logged(&metrics) >= base + 2) {
                    Some(st) => (st, false),
                    None => {
                        let st = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
                        assert!(st.success());
                        let st = child.wait().unwrap();
                        if st.code() == Some(3) {
                            tally.sigterms += 1;
                        }
                        (st, false)
                    }
                }
            }
            _ => unreachable!(),
        };
        if status.success() {
            break; // the run reached its last step
        }
        match (status.code(), status.signal()) {
            (Some(3), _) => {}
            (None, Some(9 | 6)) => {
                if killed_here {
                    tally.kills += 1;
                    *tally.by_scenario.entry(scenario).or_default() += 1;
                }
            }
            other => panic!("cycle {} ({scenario}): unexpected end {other:?} ({status})", tally.cycles),
        }
    }
    let wall_s = started.elapsed().as_secs_f64();

    // Bitwise: every step's loss, norm, clip and LR, and the final parameters and Adam state.
    let got = records(&metrics);
    let mut differences = 0;
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        if g != e {
            differences += 1;
            eprintln!("step record {} differs: {g:?} vs {e:?}", i + 1);
        }
    }
    differences += got.len().abs_diff(expected.len());
    let last = |d: &str| oogc::checkpoint::load(&dir.path().join(d).join("ckpt")).unwrap();
    let (a, b) = (last("ref"), last("soak"));
    assert_eq!(a.step, steps);
    assert_eq!(b.step, steps);
    for (ta, tb) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(ta.name, tb.name);
        let same = ta.data.bytes() == tb.data.bytes();
        if !same || ta.shape != tb.shape {
            differences += 1;
            eprintln!("tensor {} differs", ta.name);
        }
    }
    differences += a.tensors.len().abs_diff(b.tensors.len());
    for key in ["sampler", "optimizer_updates"] {
        if a.metadata.get(key) != b.metadata.get(key) {
            differences += 1;
            eprintln!("metadata {key} differs");
        }
    }
    for (_, p) in oogc::checkpoint::list(&ckpt).unwrap() {
        assert!(
            matches!(oogc::checkpoint::verify(&p), Ok(oogc::checksum::Verification::Verified { .. })),
            "{} fails verification",
            p.display()
        );
    }
    println!(
        "soak: {} kills ({:?}), {} graceful SIGTERM stops, {} cycles, {steps} steps, {:.1} s, {differences} differences (seed {seed})",
        tally.kills, tally.by_scenario, tally.sigterms, tally.cycles, wall_s
    );
    assert!(tally.kills >= target, "{tally:?}");
    assert_eq!(differences, 0, "the soaked run differs from the uninterrupted one");
}
