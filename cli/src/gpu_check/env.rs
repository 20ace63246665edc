//! Checks 1 and 2: the environment (GPU, driver, CUDA, every shared library resolved, the
//! device opened by the swapper, candle and the runtime; the data) and the swapper's CUDA tests.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use candle_core::{DType, Tensor};
use oogc::runtime::{DeviceSpec, Runtime, RuntimeConfig};
use oogc::swapper::{CudaDevice, Device};

use super::common::{run_with_timeout, tail, torch_version, verdict, Ctx, Figures, Verdict};

/// `nvidia-smi --query-gpu=FIELDS --format=csv,noheader`: one line per GPU; `None` without
/// nvidia-smi (or when it fails, or prints nothing).
fn nvidia_smi_query(fields: &str) -> Option<String> {
    let out =
        Command::new("nvidia-smi").arg(format!("--query-gpu={fields}")).arg("--format=csv,noheader").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

/// `nvidia-smi`'s name, driver, memory and compute capability of each GPU, one line; `None`
/// without nvidia-smi.
pub(crate) fn nvidia_smi_summary() -> Option<String> {
    nvidia_smi_query("index,name,driver_version,memory.total,compute_cap").map(|s| s.replace('\n', "; "))
}

/// The NVIDIA driver's version: nvidia-smi's `driver_version` (of the first GPU), else the first
/// line of `/proc/driver/nvidia/version`; `None` without either (no driver: the sim device's host).
pub(crate) fn driver_version() -> Option<String> {
    nvidia_smi_query("driver_version").and_then(|s| s.lines().next().map(str::to_string)).or_else(|| {
        let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
        text.lines().next().map(|l| l.trim().to_string())
    })
}

/// Check 1.
pub(crate) fn environment(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let mut failures = Vec::new();
    let exe = std::env::current_exe()?;
    f.set("binary", exe.display().to_string());
    f.set("cuda_built_in", cfg!(feature = "cuda"));
    let m = oogc_bench::machine::record(None);
    f.set("host", &m);

    // The data the checks read.
    let mut missing = Vec::new();
    let text = ctx.text();
    match std::fs::metadata(&text) {
        Ok(md) => f.set("text_bytes", md.len()),
        Err(_) => missing.push(text.display().to_string()),
    }
    for name in ["tokenizer.json", "cases.json"] {
        if !ctx.fixtures().join(name).is_file() {
            missing.push(ctx.fixtures().join(name).display().to_string());
        }
    }
    for case in ["llama_gqa", "qwen2_tied", "mixtral_moe"] {
        for file in ["config.json", "reference.safetensors"] {
            let p = ctx.fixtures().join(case).join(file);
            if !p.is_file() {
                missing.push(p.display().to_string());
            }
        }
    }
    f.set("data_dir", ctx.shared.display().to_string());
    if !missing.is_empty() {
        failures.push(format!("data missing: {}", missing.join(", ")));
    }

    // Every shared library of this binary resolved (run.sh set LD_LIBRARY_PATH).
    let mut cmd = Command::new("ldd");
    cmd.arg(&exe);
    match run_with_timeout(&mut cmd, Duration::from_secs(30), &ctx.work, "ldd") {
        Ok(r) if r.success() => {
            let mut libs = BTreeMap::new();
            let mut unresolved = Vec::new();
            for line in r.stdout.lines() {
                let line = line.trim();
                if line.contains("not found") {
                    unresolved.push(line.to_string());
                } else if let Some((name, rest)) = line.split_once(" => ") {
                    let path = rest.split(" (").next().unwrap_or(rest).trim();
                    libs.insert(name.trim().to_string(), path.to_string());
                }
            }
            f.set("libraries", &libs);
            if !unresolved.is_empty() {
                failures.push(format!("shared libraries not found: {}", unresolved.join(", ")));
            }
        }
        Ok(r) => f.note(format!(
            "ldd failed ({}): {}",
            r.code.map_or("killed".into(), |c| c.to_string()),
            tail(&r.stderr, 2)
        )),
        Err(e) => f.note(format!("ldd not run: {e}")),
    }

    // PyTorch, for checks 8 and 10 (informational here).
    match torch_version(&ctx.work) {
        Ok(v) => f.set("torch", v),
        Err(e) => f.set("torch", format!("unavailable: {e}")),
    }

    let Some(ordinal) = ctx.cuda_ordinal() else {
        f.note("sim device: no GPU, driver or CUDA to check");
        f.summary(format!(
            "sim device; {} cores, {:.1} GiB; data {}",
            m.cores,
            m.memory_bytes as f64 / (1u64 << 30) as f64,
            if missing.is_empty() { "present" } else { "MISSING" }
        ));
        return Ok(verdict(failures));
    };

    // The GPU and its driver.
    let smi = nvidia_smi_summary();
    f.set("nvidia_smi", smi.clone().unwrap_or_else(|| "nvidia-smi not found".into()));
    let driver =
        std::fs::read_to_string("/proc/driver/nvidia/version").ok().and_then(|s| s.lines().next().map(str::to_string));
    f.set("driver", driver.clone().unwrap_or_else(|| "no /proc/driver/nvidia/version".into()));
    if !cfg!(feature = "cuda") {
        failures.push(
            "this binary is built without CUDA (the `cuda` feature): build dist/oogc-cuda with scripts/build-cuda.sh"
                .into(),
        );
    }
    // The swapper's device (its own streams), candle's device and one kernel, and the runtime.
    match CudaDevice::new(ordinal, Some(64 << 20)) {
        Ok(d) => f.set("swapper_device", Device::Cuda(d).name()),
        Err(e) => failures.push(format!("the swapper cannot open cuda:{ordinal}: {e}")),
    }
    let sum =
        ctx.compute_device().and_then(|dev| Ok(Tensor::ones(1024, DType::F32, &dev)?.sum_all()?.to_scalar::<f32>()?));
    match sum {
        Ok(s) if s.to_bits() == 1024f32.to_bits() => f.set("candle_kernel", "sum of 1024 ones = 1024"),
        Ok(s) => failures.push(format!("candle on cuda:{ordinal}: the sum of 1024 ones is {s}")),
        Err(e) => failures.push(format!("candle on cuda:{ordinal}: {}", crate::error_line(&e))),
    }
    let mut rc = RuntimeConfig::sim(64 << 20);
    rc.device = DeviceSpec::Cuda { ordinal, event_tracking: true };
    rc.host_budget_bytes = 1 << 30;
    match Runtime::new(rc, oogc::dist::Ranks::single()) {
        Ok(_) => f.set("runtime", "opened"),
        Err(e) => failures.push(format!("Runtime::new on cuda:{ordinal}: {e}")),
    }
    f.summary(format!(
        "{}; driver {}",
        smi.unwrap_or_else(|| "no nvidia-smi".into()),
        driver.map_or("?".into(), |d| d
            .split_whitespace()
            .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))
            .unwrap_or("?")
            .to_string())
    ));
    Ok(verdict(failures))
}

/// Check 2: `swapper-tests cuda` beside this binary (dist/oogc-cuda), every GPU test required to
/// run (`OOGC_REQUIRE_GPU=1`: a skip is a failure).
pub(crate) fn swapper_tests(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    if ctx.is_sim() {
        return Ok(Verdict::Skip("needs CUDA (the swapper's sim tests run in CI: cargo test -p oogc-swapper)".into()));
    }
    let bin = ctx.exe_dir.join("swapper-tests");
    if !bin.is_file() {
        return Ok(Verdict::Fail(format!(
            "{} not found: scripts/build-cuda.sh writes it beside the binary in dist/oogc-cuda",
            bin.display()
        )));
    }
    let mut cmd = Command::new(&bin);
    cmd.args(["cuda", "--test-threads=1"]).env("OOGC_REQUIRE_GPU", "1");
    let timeout = Duration::from_secs_f64((ctx.left_s() - 3.0).max(5.0));
    let r = run_with_timeout(&mut cmd, timeout, &ctx.work, "swapper-tests")?;
    let all = format!("{}\n{}", r.stdout, r.stderr);
    // `test result: ok. 9 passed; 0 failed; 0 ignored; 0 measured; 57 filtered out; ...`
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in all.lines().filter(|l| l.starts_with("test result:")) {
        for part in line.split(['.', ';']) {
            let words: Vec<&str> = part.split_whitespace().collect();
            if let [n, what] = words.as_slice() {
                let n: u64 = n.parse().unwrap_or(0);
                match *what {
                    "passed" => passed += n,
                    "failed" => failed += n,
                    _ => {}
                }
            }
        }
    }
    let skipped = all.lines().filter(|l| l.contains("skipped:")).count();
    f.set("passed", passed);
    f.set("failed", failed);
    f.set("skipped", skipped);
    f.summary(format!("{passed} passed, {failed} failed, {skipped} skipped"));
    if r.timed_out {
        return Ok(Verdict::Fail(format!(
            "timed out after {:.0} s; output ends:\n{}",
            timeout.as_secs_f64(),
            tail(&all, 8)
        )));
    }
    if !r.success() || failed > 0 || passed == 0 || skipped > 0 {
        return Ok(Verdict::Fail(format!(
            "exit {:?}, {passed} passed, {failed} failed, {skipped} skipped; output ends:\n{}",
            r.code,
            tail(&all, 8)
        )));
    }
    Ok(Verdict::Pass)
}
