//! Checks 5 and 8: bytes through the links.
//!
//! **5, round trips.** A [`Runtime`] with a GPU budget of three units (so fetches evict and
//! reuse device memory), f32 and bf16, two steps: every fetched unit read by a kernel at once
//! (the H2D → compute order) and again after a long matmul chain (the reuse-after-compute
//! order), every gradient made at the end of a chain and pushed (the compute → D2H order, read
//! back bitwise as Adam's `m` with β1 = 0), every activation checkpoint made at the end of a
//! chain, stashed and taken back: all byte-exact. Then the negative control: a D2H ordered after
//! an event recorded *before* the compute write that it must follow (the missing event) — the
//! sim device's happens-before checker must refuse it (`Error::Ordering`).
//!
//! **8, bandwidth.** H2D and D2H GB/s of the device's copy path (pinned host memory from the
//! device's allocator) against the reference on the same machine in the same run: on CUDA
//! torch's pinned `copy_(non_blocking=True)` timed with CUDA events (target ≥ 0.9 ×), on the
//! sim device a plain memcpy (figures only: no timing assertion where CI runs).

use std::time::{Duration, Instant};

use candle_core::{DType, Device as CandleDevice, Tensor};
use oogc::optimizer::{AdamConfig, AdamKind, OptimizerConfig};
use oogc::runtime::{ActivationOffload, DeviceSpec, Phase, Runtime, RuntimeConfig};
use oogc::swapper::{CudaDevice, Device, PinnedPool, PinnedPoolConfig, SimDevice, SimDeviceConfig};
use serde_json::json;

use super::common::{at_least, host_bits, run_with_timeout, tail, torch_version, verdict, Ctx, Figures, Rng, Verdict};

/// Sizes of check 5 on this device.
struct RoundTripSizes {
    units: usize,
    numel: usize,
    /// `[B, T, d]` of each activation checkpoint.
    activation: (usize, usize, usize),
    /// The matmul chain: `k` products of `n × n`.
    chain_n: usize,
    chain_k: usize,
}

fn round_trip_sizes(ctx: &Ctx) -> RoundTripSizes {
    match (ctx.is_sim(), ctx.quick) {
        (true, true) => RoundTripSizes { units: 5, numel: 48 << 10, activation: (2, 32, 128), chain_n: 96, chain_k: 2 },
        (true, false) => {
            RoundTripSizes { units: 6, numel: 256 << 10, activation: (4, 64, 256), chain_n: 128, chain_k: 4 }
        }
        (false, _) => {
            RoundTripSizes { units: 6, numel: 16 << 20, activation: (8, 512, 1024), chain_n: 2048, chain_k: 24 }
        }
    }
}

/// A scalar 0 that the compute stream can produce only after `k` products of `n × n` matrices
/// (each entry 1/n, so every product is exact and the chain stays finite), in `dtype`.
fn chain_zero(dev: &CandleDevice, n: usize, k: usize, dtype: DType) -> anyhow::Result<Tensor> {
    let a = (Tensor::ones((n, n), DType::F32, dev)? / n as f64)?;
    let mut x = a.clone();
    for _ in 0..k {
        x = x.matmul(&a)?;
    }
    Ok((x.sum_all()? * 0.0)?.to_dtype(dtype)?)
}

/// Mismatching elements of `t` against `want` (bitwise, as f32).
fn mismatches(t: &Tensor, want: &[f32]) -> anyhow::Result<usize> {
    let got = host_bits(t)?;
    anyhow::ensure!(got.len() == want.len(), "{} elements read back, {} written", got.len(), want.len());
    Ok(got.iter().zip(want).filter(|(g, w)| **g != w.to_bits()).count())
}

/// Two steps of check 5 in `dtype`; returns the failures.
fn round_trip_run(ctx: &Ctx, dtype: oogc::swapper::DType, f: &mut Figures) -> anyhow::Result<Vec<String>> {
    let s = round_trip_sizes(ctx);
    let cdtype = match dtype {
        oogc::swapper::DType::BF16 => DType::BF16,
        _ => DType::F32,
    };
    let unit_bytes = dtype.num_bytes(s.numel) as u64;
    let (b, t, d) = s.activation;
    let act_bytes = dtype.num_bytes(b * t * d);
    // Three units on the device at most (the fourth fetch evicts), plus gradient staging and the
    // activation staging.
    let mut rc = RuntimeConfig::sim(4 * unit_bytes + 2 * act_bytes as u64);
    if let Some(ordinal) = ctx.cuda_ordinal() {
        rc.device = DeviceSpec::Cuda { ordinal, event_tracking: true };
    }
    rc.host_budget_bytes = 4 << 30;
    rc.activation_offload = Some(ActivationOffload { checkpoints: s.units, checkpoint_bytes: act_bytes });
    // β1 = 0: Adam's m is the pushed gradient bit for bit; lr 0 and no decay keep the parameters.
    rc.optimizer = OptimizerConfig {
        threads: 1,
        adam: AdamConfig { kind: AdamKind::AdamW, beta1: 0.0, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 },
        clip_norm: None,
        compute_dtype: dtype,
        ..OptimizerConfig::default()
    };
    let mut rt = Runtime::new(rc, oogc::dist::Ranks::single())?;
    let mut rng = Rng::new(11);
    let masters: Vec<Vec<f32>> = (0..s.units).map(|_| rng.bf16_exact_vec(s.numel)).collect();
    let ids =
        masters.iter().enumerate().map(|(u, m)| rt.add_unit(&format!("unit{u}"), m)).collect::<Result<Vec<_>, _>>()?;
    let dev = rt.compute_device().clone();
    let (mut fetch_bad, mut grad_bad, mut act_bad) = (0usize, 0usize, 0usize);
    let mut failures = Vec::new();
    let started = Instant::now();
    for step in 1..=2u64 {
        rt.begin_step(step, 0.0)?;
        let grads: Vec<Vec<f32>> = (0..s.units).map(|_| rng.bf16_exact_vec(s.numel)).collect();
        let acts: Vec<Vec<f32>> = (0..s.units).map(|_| rng.bf16_exact_vec(b * t * d)).collect();
        let mut reads = Vec::new();
        let mut stashed = Vec::new();
        for (u, act) in acts.iter().enumerate() {
            let p = rt.fetch(ids[u], Phase::Forward)?;
            let first = (p.tensor() * 1.0)?;
            let z = chain_zero(&dev, s.chain_n, s.chain_k, cdtype)?;
            let after_chain = p.tensor().broadcast_add(&z)?;
            drop(p);
            reads.push((u, first, after_chain));
            let z = chain_zero(&dev, s.chain_n, s.chain_k, cdtype)?;
            let a = Tensor::from_slice(act, (b, t, d), &dev)?.to_dtype(cdtype)?.broadcast_add(&z)?;
            stashed.push(rt.activations().stash(&a)?);
        }
        rt.end_forward();
        for u in (0..s.units).rev() {
            if u > 0 {
                rt.activations().prefetch(stashed[u - 1])?;
            }
            let a = rt.activations().take(stashed[u])?;
            act_bad += mismatches(&a, &acts[u])?;
            let p = rt.fetch(ids[u], Phase::Backward)?;
            let first = (p.tensor() * 1.0)?;
            let z = chain_zero(&dev, s.chain_n, s.chain_k, cdtype)?;
            reads.push((u, first, p.tensor().broadcast_add(&z)?));
            drop(p);
            let z = chain_zero(&dev, s.chain_n, s.chain_k, cdtype)?;
            let g = Tensor::from_slice(&grads[u], s.numel, &dev)?.to_dtype(cdtype)?.broadcast_add(&z)?;
            rt.push_grads(ids[u], &g)?;
        }
        // Read the fetched copies back only now, after later fetches had the chance to reuse
        // their device memory.
        for (u, x, y) in &reads {
            fetch_bad += mismatches(x, &masters[*u])? + mismatches(y, &masters[*u])?;
        }
        let stats = rt.finish_step()?;
        rt.sync()?;
        for (u, g) in grads.iter().enumerate() {
            let (master, m, _) = rt.unit_state(ids[u])?.into_f32();
            grad_bad += m.iter().zip(g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            // lr 0: the parameters (and the compute copies fetched next step) must not move.
            let moved = master.iter().zip(&masters[u]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            if moved > 0 {
                failures.push(format!("{dtype} step {step} unit {u}: {moved} parameters moved with lr 0"));
            }
        }
        f.set(
            &format!("{dtype}.step{step}"),
            json!({"h2d_bytes": stats.figures.h2d_bytes, "d2h_bytes": stats.figures.d2h_bytes, "stall_transfer_s": stats.figures.stall_transfer_s}),
        );
    }
    let traffic = rt.memory().traffic();
    f.set(
        &format!("{dtype}.totals"),
        json!({
            "units": s.units, "unit_bytes": unit_bytes, "activation_bytes": act_bytes,
            "h2d_bytes": traffic.htod.bytes, "d2h_bytes": traffic.dtoh.bytes,
            "h2d_busy_s": traffic.htod.busy_s, "d2h_busy_s": traffic.dtoh.busy_s,
            "fetch_mismatches": fetch_bad, "gradient_mismatches": grad_bad, "activation_mismatches": act_bad,
            "seconds": started.elapsed().as_secs_f64(),
        }),
    );
    for (what, n) in [("fetched parameter", fetch_bad), ("gradient", grad_bad), ("activation", act_bad)] {
        if n > 0 {
            failures.push(format!("{dtype}: {n} {what} elements differ after the round trip"));
        }
    }
    // The device counts every copy on its links: the gradients and the activation checkpoints
    // went D2H outside the residency manager, and must be in the runtime's traffic, with busy
    // time (on CUDA, from the events around each copy).
    let pushed = 2 * s.units as u64 * (unit_bytes + act_bytes as u64);
    if traffic.dtoh.bytes < pushed {
        failures.push(format!(
            "{dtype}: the runtime's traffic counts {} bytes D2H, fewer than the {pushed} bytes of gradients and \
             activation checkpoints copied out",
            traffic.dtoh.bytes
        ));
    }
    if traffic.htod.busy_s <= 0.0 || traffic.dtoh.busy_s <= 0.0 {
        failures.push(format!(
            "{dtype}: no busy time on the links (H2D {} s, D2H {} s)",
            traffic.htod.busy_s, traffic.dtoh.busy_s
        ));
    }
    if traffic.htod.bytes < (s.units as u64 + 1) * unit_bytes {
        failures
            .push(format!("{dtype}: only {} bytes went H2D: the budget did not force re-fetches", traffic.htod.bytes));
    }
    Ok(failures)
}

/// The negative control on the sim device: a D2H ordered after an event recorded before the
/// compute write it must follow. `Ok(message)`: the checker refused it (detected).
fn sim_negative_control() -> anyhow::Result<Result<String, String>> {
    let dev = Device::Sim(SimDevice::new(SimDeviceConfig { capacity_bytes: 1 << 20, ..SimDeviceConfig::default() })?);
    let pool = PinnedPool::new(&PinnedPoolConfig { budget_bytes: 1 << 20, lock: false }, dev.host_allocator(false));
    let n = 4096;
    // With the event: the bytes arrive.
    let mut buf = dev.alloc_for_compute(n)?;
    buf.as_sim_mut().ok_or_else(|| anyhow::anyhow!("a sim buffer"))?.compute_write()?.fill(0xAB);
    let ev = dev.record_compute_event()?;
    let (t, _) = dev.dtoh_after(buf, pool.alloc(n)?, Some(&ev))?;
    let (host, mut buf) = t.wait()?;
    if host.as_slice().iter().any(|&x| x != 0xAB) {
        return Ok(Err("the ordered D2H did not carry the compute write".into()));
    }
    // Without it: the event predates the write.
    let stale = dev.record_compute_event()?;
    buf.as_sim_mut().ok_or_else(|| anyhow::anyhow!("a sim buffer"))?.compute_write()?.fill(0xCD);
    Ok(match dev.dtoh_after(buf, host, Some(&stale)) {
        Err(e @ oogc::swapper::Error::Ordering { .. }) => Ok(e.to_string()),
        Err(e) => Err(format!("refused, but not as an ordering violation: {e}")),
        Ok(_) => Err("a D2H that misses the compute write's event was accepted".into()),
    })
}

/// Check 5.
pub(crate) fn round_trips(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let mut failures = Vec::new();
    let mut completed = 0;
    for dtype in [oogc::swapper::DType::F32, oogc::swapper::DType::BF16] {
        match round_trip_run(ctx, dtype, f) {
            Ok(fails) => {
                completed += 1;
                failures.extend(fails);
            }
            Err(e) => failures.push(format!("{dtype}: {}", crate::error_line(&e))),
        }
    }
    let bytes = match (completed, failures.iter().any(|x| x.contains("differ"))) {
        (0, _) => "not compared (the runs failed)",
        (_, true) => "DIFFER",
        (2, false) => "exact",
        (_, false) => "exact where compared",
    };
    let control = if ctx.is_sim() {
        match sim_negative_control()? {
            Ok(msg) => {
                f.set("negative_control", json!({"detected": true, "error": msg}));
                "missing event detected"
            }
            Err(why) => {
                f.set("negative_control", json!({"detected": false, "why": why}));
                failures.push(format!("negative control: {why}"));
                "missing event NOT detected"
            }
        }
    } else {
        // On CUDA a missed event is a race, shown by stale bytes: it needs a swapper device
        // buffer written by a kernel on candle's compute stream, which the runtime's CUDA path
        // (being wired) provides; until then the control is not run.
        f.note(
            "negative control not run on CUDA: it needs a device buffer written by a kernel on the compute stream \
             (the runtime's CUDA tensors); the sim device's checker covers the ordering contract",
        );
        "negative control not run on CUDA"
    };
    f.summary(format!(
        "{} units × 2 steps × f32/bf16: fetch, gradient, activation bytes {bytes}; {control}",
        round_trip_sizes(ctx).units
    ));
    Ok(verdict(failures))
}

/// Sizes of check 8: bytes per copy and copies timed.
fn bandwidth_sizes(ctx: &Ctx) -> (usize, usize) {
    match (ctx.is_sim(), ctx.quick) {
        (true, true) => (32 << 20, 4),
        (true, false) => (128 << 20, 5),
        (false, _) => (256 << 20, 20),
    }
}

/// Host and device buffer of a copy loop (a transfer owns both while it runs).
type Pair = Option<(oogc::swapper::HostBuffer, oogc::swapper::DeviceBuffer)>;

/// Seconds of `iters` copies through `dev` (H2D when `htod`, else D2H), each waited for.
fn timed_copies(dev: &Device, pair: &mut Pair, htod: bool, iters: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    for _ in 0..iters {
        let (h, b) = pair.take().ok_or_else(|| anyhow::anyhow!("a failed copy kept its buffers"))?;
        let t = if htod { dev.htod(h, b)? } else { dev.dtoh(b, h)? };
        *pair = Some(t.wait()?);
    }
    Ok(start.elapsed().as_secs_f64())
}

/// GB/s (10⁹ B/s) of `iters` copies of `bytes` each way through `dev`, after one untimed copy
/// each way, from pinned host memory of the device's allocator; and whether the bytes copied
/// H2D came back D2H.
fn device_gbps(dev: &Device, bytes: usize, iters: usize) -> anyhow::Result<(f64, f64, bool)> {
    let pool =
        PinnedPool::new(&PinnedPoolConfig { budget_bytes: 2 * bytes as u64, lock: true }, dev.host_allocator(true));
    let mut host = pool.alloc(bytes)?;
    for (i, x) in host.as_mut_slice().iter_mut().enumerate() {
        *x = (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    }
    let expected = host.as_slice()[..4096.min(bytes)].to_vec();
    let mut pair: Pair = Some((host, dev.alloc(bytes)?));
    timed_copies(dev, &mut pair, true, 1)?;
    let h2d = (bytes * iters) as f64 / timed_copies(dev, &mut pair, true, iters)? / 1e9;
    if let Some((h, _)) = pair.as_mut() {
        h.as_mut_slice().fill(0);
    }
    timed_copies(dev, &mut pair, false, 1)?;
    let d2h = (bytes * iters) as f64 / timed_copies(dev, &mut pair, false, iters)? / 1e9;
    let intact = pair.as_ref().is_some_and(|(h, _)| h.as_slice()[..expected.len()] == expected[..]);
    Ok((h2d, d2h, intact))
}

/// GB/s of a plain memcpy of `bytes`, `iters` times.
fn memcpy_gbps(bytes: usize, iters: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| (i >> 7) as u8).collect();
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (bytes * iters) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Check 8.
pub(crate) fn bandwidth(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let (bytes, iters) = bandwidth_sizes(ctx);
    f.set("bytes_per_copy", bytes);
    f.set("copies", iters);
    let dev = match ctx.cuda_ordinal() {
        None => Device::Sim(SimDevice::with_ordering_checks(
            SimDeviceConfig { capacity_bytes: 2 * bytes as u64, ..SimDeviceConfig::default() },
            false,
        )?),
        Some(n) => Device::Cuda(CudaDevice::new(n, Some(2 * bytes as u64))?),
    };
    let (h2d, d2h, intact) = device_gbps(&dev, bytes, iters)?;
    f.set("ours_h2d_gbps", h2d);
    f.set("ours_d2h_gbps", d2h);
    if !intact {
        return Ok(Verdict::Fail("the bytes copied H2D did not come back D2H".into()));
    }
    if ctx.is_sim() {
        let memcpy = memcpy_gbps(bytes, iters);
        f.set("memcpy_gbps", memcpy);
        f.set("h2d_ratio", h2d / memcpy);
        f.set("d2h_ratio", d2h / memcpy);
        f.summary(format!(
            "sim link H2D {h2d:.1} GB/s ({:.2} × memcpy {memcpy:.1}), D2H {d2h:.1} GB/s ({:.2} ×); no target on the sim",
            h2d / memcpy,
            d2h / memcpy
        ));
        return Ok(Verdict::Pass);
    }
    // The profile `oogc plan --profile` reads (matrix-product TFLOP/s on candle's stream, the
    // copy stream's GB/s): into the reports, so it comes back with them.
    if let Some(n) = ctx.cuda_ordinal() {
        drop(dev);
        match oogc_bench::probe::gpu_profile(n) {
            Ok(p) => {
                f.set("profile_bf16_tflops", p.device_bf16_tflops);
                f.set("profile_f32_tflops", p.device_f32_tflops);
                f.set("profile_h2d_gbps", p.h2d_gbps);
                f.set("profile_d2h_gbps", p.d2h_gbps);
                let path = super::common::profile_path(&ctx.out);
                std::fs::write(&path, p.to_toml_string())?;
                f.note(format!("GPU profile written to {} (oogc plan --profile)", path.display()));
            }
            Err(e) => f.note(format!("GPU profile not measured: {e}")),
        }
    }
    // torch's pinned copy_ on the same GPU, timed with CUDA events.
    let script = super::peers::write_script(ctx)?;
    let torch = match torch_version(&ctx.work) {
        Ok(v) => v,
        Err(why) => {
            f.summary(format!("ours H2D {h2d:.1} GB/s, D2H {d2h:.1} GB/s; torch unavailable"));
            return Ok(Verdict::Skip(format!("no reference: {why}")));
        }
    };
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(&script).args(["bandwidth", "--bytes", &bytes.to_string(), "--iters", &iters.to_string()]);
    let r = run_with_timeout(
        &mut cmd,
        Duration::from_secs_f64((ctx.left_s() - 2.0).max(5.0)),
        &ctx.work,
        "torch-bandwidth",
    )?;
    if !r.success() {
        return Ok(Verdict::Fail(format!("torch's bandwidth run failed: {}", tail(&r.stderr, 4))));
    }
    let v: serde_json::Value = serde_json::from_str(r.stdout.lines().last().unwrap_or(""))
        .map_err(|e| anyhow::anyhow!("torch's bandwidth output is not JSON ({e}): {}", tail(&r.stdout, 2)))?;
    let (th2d, td2h) = (v["h2d_gbps"].as_f64().unwrap_or(f64::NAN), v["d2h_gbps"].as_f64().unwrap_or(f64::NAN));
    f.set("torch", torch);
    f.set("torch_h2d_gbps", th2d);
    f.set("torch_d2h_gbps", td2h);
    let (rh, rd) = (h2d / th2d, d2h / td2h);
    f.set("h2d_ratio", rh);
    f.set("d2h_ratio", rd);
    f.summary(format!(
        "H2D {h2d:.1} vs torch {th2d:.1} GB/s ({rh:.2} ×), D2H {d2h:.1} vs {td2h:.1} GB/s ({rd:.2} ×); target ≥ 0.9 ×"
    ));
    let mut failures = Vec::new();
    if !at_least(rh, 0.9) {
        failures.push(format!("H2D {rh:.2} × torch's, below the 0.9 × target"));
    }
    if !at_least(rd, 0.9) {
        failures.push(format!("D2H {rd:.2} × torch's, below the 0.9 × target"));
    }
    Ok(verdict(failures))
}
