//! Check 10: the peers on the model of check 9, tokens/s side by side — PyTorch resident with
//! AdamW(fused), PyTorch FSDP2 with CPUOffloadPolicy at world size 1, oogc.torch.offload — and
//! oogc's own figures from check 9's row. Each peer runs in its own `python3` process
//! (`torch_peers.py`, embedded in this binary) within what is left of the budget. The oogc
//! peer's wheel (the Python module built with the `cuda` feature by `scripts/build-cuda.sh`
//! into `wheels/` beside this binary) is installed into the check's scratch directory
//! (`pip install --no-deps --no-index --target`: no network) and found through `PYTHONPATH`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use super::common::{run_with_timeout, tail, torch_version, Ctx, Figures, Verdict};

/// The peers' script, embedded so the GPU machine needs only this binary.
const SCRIPT: &str = include_str!("torch_peers.py");

/// Writes the peers' script into the check's scratch directory and returns its path.
///
/// # Errors
/// When it cannot be written.
pub(crate) fn write_script(ctx: &Ctx) -> anyhow::Result<PathBuf> {
    let path = ctx.work.join("torch_peers.py");
    std::fs::write(&path, SCRIPT)?;
    Ok(path)
}

/// Check 10.
pub(crate) fn peers(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    if ctx.is_sim() {
        return Ok(Verdict::Skip("needs CUDA (the peers train the 1 B model of check 9 on the GPU)".into()));
    }
    let torch = match torch_version(&ctx.work) {
        Ok(v) => v,
        Err(why) => return Ok(Verdict::Skip(why)),
    };
    f.set("torch", torch);
    let script = write_script(ctx)?;
    // The model of check 9 (training::throughput): 24 layers of hidden 2048, GQA 16/8,
    // SwiGLU 5632, the fixtures' vocabulary, batch 8 × 1024.
    let shape = [
        ("hidden", 2048),
        ("intermediate", 5632),
        ("layers", 24),
        ("heads", 16),
        ("kv-heads", 8),
        ("vocab", 1024),
        ("batch", 8),
        ("seq", 1024),
        ("steps", 4),
        ("warmup", 2),
    ];
    let pythonpath = match install_wheel(ctx) {
        Ok(dir) => Some(dir),
        Err(why) => {
            f.note(format!("oogc.torch.offload: {why}"));
            None
        }
    };
    let mut results = serde_json::Map::new();
    for peer in ["resident", "fsdp2", "oogc"] {
        let left = ctx.left_s() - 5.0;
        if left < 20.0 {
            f.note(format!("{peer}: not run, {left:.0} s left"));
            continue;
        }
        let mut cmd = Command::new("python3");
        cmd.arg(&script).args(["train", "--peer", peer]);
        for (k, v) in shape {
            cmd.arg(format!("--{k}")).arg(v.to_string());
        }
        if peer == "oogc" {
            match &pythonpath {
                Some(dir) => {
                    cmd.env("PYTHONPATH", dir);
                }
                None => continue,
            }
        }
        let r =
            run_with_timeout(&mut cmd, Duration::from_secs_f64(left.min(150.0)), &ctx.work, &format!("peer-{peer}"))?;
        let v = if r.timed_out {
            json!({"error": format!("timed out after {:.0} s", left.min(150.0))})
        } else {
            serde_json::from_str::<Value>(r.stdout.lines().last().unwrap_or(""))
                .unwrap_or_else(|_| json!({"error": format!("exit {:?}: {}", r.code, tail(&r.stderr, 3))}))
        };
        f.set(peer, &v);
        results.insert(peer.to_string(), v);
    }
    let tps = |k: &str| results.get(k).and_then(|v| v["tokens_per_s"].as_f64());
    if let (Some(o), Some(fs)) = (tps("oogc"), tps("fsdp2")) {
        f.set("oogc_torch_vs_fsdp2", o / fs);
    }
    let row9 = crate::gpu_check::read_row(&ctx.out, 9);
    let ours =
        row9.as_ref().filter(|r| r["status"] == "pass").and_then(|r| r["figures"]["tokens_per_s_offloaded"].as_f64());
    f.set("oogc_offloaded_tokens_per_s", ours);
    let mut failures = Vec::new();
    for peer in ["resident", "fsdp2"] {
        if tps(peer).is_none() {
            failures
                .push(format!("{peer}: {}", results.get(peer).map_or("not run".into(), |v| v["error"].to_string())));
        }
    }
    match (ours, tps("fsdp2")) {
        (Some(o), Some(fs)) => f.set("oogc_vs_fsdp2", o / fs),
        (None, _) => failures.push(format!(
            "oogc's figures missing: check 9 {}",
            row9.map_or("did not run".to_string(), |r| format!("is {}", r["status"]))
        )),
        _ => {}
    }
    if let Some(s) = results.get("oogc").and_then(|v| v["skipped"].as_str()) {
        f.note(format!("oogc.torch.offload: {s}"));
    }
    let show = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.0}"));
    f.summary(format!(
        "tokens/s: oogc {} | torch resident {} | FSDP2 CPU offload {} | oogc.torch.offload {}",
        show(ours),
        show(tps("resident")),
        show(tps("fsdp2")),
        show(tps("oogc"))
    ));
    Ok(super::common::verdict(failures))
}

/// Installs the CUDA wheel beside this binary (`wheels/oogc-*.whl`) into the check's scratch
/// directory; returns the directory to put on `PYTHONPATH`.
///
/// # Errors
/// A message when there is no wheel (built without it) or pip refuses it.
fn install_wheel(ctx: &Ctx) -> Result<PathBuf, String> {
    let wheels = ctx.exe_dir.join("wheels");
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| format!("no wheel: {} unreadable ({e}); scripts/build-cuda.sh builds it there", wheels.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("no wheel in {}; scripts/build-cuda.sh builds it there", wheels.display()))?;
    let target = ctx.work.join("py");
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q", "--target"])
        .arg(&target)
        .arg(&wheel);
    let r = run_with_timeout(&mut cmd, Duration::from_secs(60), &ctx.work, "pip-install")
        .map_err(|e| format!("pip install {}: {e}", wheel.display()))?;
    if r.code != Some(0) {
        return Err(format!("pip install {} failed: {}", wheel.display(), tail(&r.stderr, 3)));
    }
    Ok(target)
}
