//! `oogc gpu-check --out DIR [--work DIR] [--device sim|cuda:N] [--quick] [--only N,M] [--shared DIR]`:
//! every GPU check in one command (DESIGN.md, "GPU backends"), run on the GPU machine from
//! `dist/oogc-cuda/` by `scripts/device-check.sh` (which packs the reports into the few files the
//! device tool brings back), and by CI on the sim device with `--quick`.
//!
//! | # | check | on CUDA | on the sim device |
//! |---|---|---|---|
//! | 1 | environment | GPU, driver, CUDA, every shared library resolved, the device opened | the machine, libraries, data |
//! | 2 | swapper tests | the swapper's CUDA tests (`swapper-tests` beside the binary) | skip: needs CUDA |
//! | 3 | ops | the composed path's units and models, forward and backward, CUDA (and the CPU) against f64 on the CPU, f32 and bf16 | the composed and fused CPU paths against f64 |
//! | 4 | fixtures | `llama_gqa`, `qwen2_tied`, `mixtral_moe` through the runtime: logits, loss, gradients against transformers'; the device optimizer's update against torch's AdamW vectors and its bf16 / int8 moment codecs against the CPU optimizer's | the same on the sim device |
//! | 5 | round trips | fetch, gradient and activation bytes exact under a long kernel chain; a missing event detected | the same; the happens-before checker as the negative control |
//! | 6 | training | a tiny Llama 20 steps: offloaded at the minimum GPU budget vs all-resident (bitwise), vs the sim (tolerance), parameters on NVMe with immediate updates, activation offload, a tiny Mixtral under ours/fetch/lru | the same runs; fused vs composed stands in for CUDA vs sim |
//! | 7 | bf16 | bf16 against f32 over 50 steps | the same |
//! | 8 | bandwidth | H2D/D2H GB/s of the copy stream vs torch's pinned `copy_` (target ≥ 0.9 ×); the GPU profile (`gpu-profile.toml` in the reports: bf16/f32 TFLOP/s, the copy stream's GB/s) for `oogc plan --profile` | the sim link vs a memcpy |
//! | 9 | throughput | a ≥ 1 B Llama in bf16, GPU budget ≤ ¼ of parameters + state, vs all-resident (target ≥ 0.9 ×); MFU, the pool's peak against the device plan (within ±10 %), H2D against the copy stream | skip: needs CUDA |
//! | 10 | peers | PyTorch resident (AdamW fused), FSDP2 + CPUOffloadPolicy, oogc.torch.offload | skip: needs CUDA |
//! | 11 | 8 B | `configs/llama-8b-h100.toml` (Llama-3-8B's shape, bf16, GPU budget 20 GiB) three steps, if time remains: tokens/s, MFU, the pool's peak against the plan, H2D against the copy stream | skip: needs CUDA |
//!
//! Each check runs in a child process of this binary (`--child N`) with a time budget: past it
//! the child (and what it started) is killed and the row says so; a crash (a CUDA abort) fails
//! only its own row. The child writes its figures as it goes (`rows/N.partial.json`), so a killed
//! check keeps what it measured. As each check finishes, its JSON row is appended to
//! `DIR/gpu-check.jsonl` and its Markdown line to `DIR/gpu-check.md` (flushed). Exit status 0
//! only when no check failed; a check that cannot run where it is (no GPU, no torch) is a skip
//! with its reason, never a pass. SIGINT or SIGTERM (an outer timeout) stops the run: the check
//! in flight is killed and fails with its figures so far, the rest are skipped, the report ends
//! with its summary.
//!
//! `--out` holds the reports only: `gpu-check.md`, `gpu-check.jsonl`, `logs/N-name.log` (each
//! child's output), `rows/` (each child's row and partial figures) and `traces/` (check 9's Chrome
//! trace). Scratch goes to `--work` (default: a fresh `oogc-gpu-check-PID` in the system's temp
//! directory, printed, kept): the token cache (`tokens/`), and per check `N-name/` (NVMe files,
//! the pip tree, its subprocesses' `*.stdout`/`*.stderr`). Every row carries `git_rev`, the
//! revision the binary was built from (`cli/build.rs`).

mod common;
mod env;
mod numerics;
mod peers;
mod training;
mod transfers;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use oogc::config::DeviceKind;
use serde_json::{json, Map, Value};

use common::{Ctx, Figures, Verdict};

/// `oogc gpu-check`: the GPU checks of DESIGN.md in one command (see the module docs).
#[derive(Debug, Args)]
pub(crate) struct GpuCheckCmd {
    /// Directory for the reports: gpu-check.jsonl, gpu-check.md, logs/, rows/, traces/.
    #[arg(long)]
    out: PathBuf,
    /// Directory for scratch: the token cache, NVMe files, the pip tree, subprocesses' output
    /// (default: a fresh `oogc-gpu-check-PID` in the system's temp directory, kept).
    #[arg(long)]
    work: Option<PathBuf>,
    /// The device: `sim` or `cuda:N`.
    #[arg(long, default_value = "sim", value_parser = parse_device)]
    device: DeviceKind,
    /// Checks 1–8 only, each sized to finish the whole in under 3 minutes on a GPU.
    #[arg(long)]
    quick: bool,
    /// Only these checks (comma-separated numbers, e.g. `--only 3,4`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<usize>,
    /// Where the data is: `data/tinyshakespeare.txt` and `fixtures/llama/` (default: `../shared`
    /// beside the repository when it exists, else `data/` beside this binary, as in
    /// dist/oogc-cuda).
    #[arg(long)]
    shared: Option<PathBuf>,
    /// Seconds for the whole run; a check that would start past it is skipped, and each check's
    /// budget is cut to what is left (default: 175 with --quick, 470 without, on CUDA; 900 on
    /// the sim device).
    #[arg(long)]
    budget_s: Option<f64>,
    /// Internal: run check N in this process (the parent starts one child per check).
    #[arg(long, hide = true)]
    child: Option<usize>,
    /// Internal: the child's time budget, seconds.
    #[arg(long, hide = true)]
    child_budget_s: Option<f64>,
}

fn parse_device(s: &str) -> Result<DeviceKind, String> {
    DeviceKind::try_from(s.to_string())
}

/// A check: its number, name, time budgets (seconds) on CUDA and on the sim device, and the
/// function that runs it in the child.
pub(crate) struct CheckDef {
    id: usize,
    name: &'static str,
    cuda_budget_s: f64,
    sim_budget_s: f64,
    /// The least time worth starting it with (a check started with less is skipped).
    min_start_s: f64,
    run: fn(&Ctx, &mut Figures) -> anyhow::Result<Verdict>,
}

const fn check(
    id: usize,
    name: &'static str,
    cuda_budget_s: f64,
    sim_budget_s: f64,
    min_start_s: f64,
    run: fn(&Ctx, &mut Figures) -> anyhow::Result<Verdict>,
) -> CheckDef {
    CheckDef { id, name, cuda_budget_s, sim_budget_s, min_start_s, run }
}

/// Every check, in the order they run: number, name, budget on CUDA and on the sim (seconds),
/// the least time worth starting it with, the function.
#[rustfmt::skip]
const CHECKS: &[CheckDef] = &[
    check(1, "environment", 60.0, 60.0, 5.0, env::environment),
    check(2, "swapper-tests", 120.0, 30.0, 10.0, env::swapper_tests),
    check(3, "ops", 90.0, 300.0, 10.0, numerics::ops),
    check(4, "fixtures", 60.0, 300.0, 10.0, numerics::fixtures),
    check(5, "round-trips", 60.0, 300.0, 10.0, transfers::round_trips),
    check(6, "training", 150.0, 400.0, 20.0, training::tiny_runs),
    check(7, "bf16-vs-f32", 60.0, 300.0, 10.0, training::bf16_vs_f32),
    check(8, "bandwidth", 60.0, 120.0, 10.0, transfers::bandwidth),
    check(9, "throughput-1b", 200.0, 30.0, 60.0, training::throughput),
    check(10, "peers", 180.0, 30.0, 60.0, peers::peers),
    check(11, "llama-8b", 600.0, 30.0, 150.0, training::llama_8b),
];

/// Runs the command: the parent (every selected check in a child, rows written as they finish)
/// or, with `--child N`, check N in this process.
pub(crate) fn run(cmd: GpuCheckCmd) -> anyhow::Result<ExitCode> {
    let shared = resolve_shared(cmd.shared.as_deref())?;
    match cmd.child {
        Some(id) => {
            let work = cmd.work.clone().context("internal: a check's process needs --work")?;
            run_child(&cmd, id, shared, &work)
        }
        None => {
            crate::init_tracing(None);
            run_parent(&cmd, shared)
        }
    }
}

/// `--work`, else a fresh `oogc-gpu-check-PID` in the system's temp directory (emptied first).
fn resolve_work(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = match given {
        Some(dir) => std::path::absolute(dir).with_context(|| format!("--work {}", dir.display()))?,
        None => {
            let dir = std::env::temp_dir().join(format!("oogc-gpu-check-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            dir
        }
    };
    std::fs::create_dir_all(&dir).with_context(|| {
        format!("creating the scratch directory {}\n  fix: pass --work DIR on a writable disk", dir.display())
    })?;
    Ok(dir)
}

/// `--shared`, else `../shared` beside the repository (known at build time) when it exists,
/// else `data/` beside this binary (dist/oogc-cuda/data).
fn resolve_shared(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = given {
        return std::path::absolute(dir).with_context(|| format!("--shared {}", dir.display()));
    }
    let beside_repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    if beside_repo.join("fixtures/llama").is_dir() {
        return Ok(beside_repo.canonicalize().unwrap_or(beside_repo));
    }
    let exe = std::env::current_exe().context("the path of this binary")?;
    let beside_bin = exe.parent().unwrap_or(Path::new(".")).join("data");
    if beside_bin.is_dir() {
        return Ok(beside_bin);
    }
    anyhow::bail!(
        "no data: neither {} nor {} exists\n  fix: pass --shared DIR (a directory holding data/tinyshakespeare.txt and \
         fixtures/llama/), or run from dist/oogc-cuda as scripts/build-cuda.sh writes it",
        beside_repo.display(),
        beside_bin.display()
    )
}

/// The checks `cmd` selects: `--only`, else 1–8 with `--quick`, else all.
fn selected(cmd: &GpuCheckCmd) -> Vec<&'static CheckDef> {
    CHECKS
        .iter()
        .filter(|c| if cmd.only.is_empty() { !cmd.quick || c.id <= 8 } else { cmd.only.contains(&c.id) })
        .collect()
}

fn device_name(d: DeviceKind) -> String {
    String::from(d)
}

fn run_parent(cmd: &GpuCheckCmd, shared: PathBuf) -> anyhow::Result<ExitCode> {
    for id in &cmd.only {
        anyhow::ensure!(
            CHECKS.iter().any(|c| c.id == *id),
            "--only {id}: the checks are numbered 1 to {}",
            CHECKS.len()
        );
    }
    let out = &cmd.out;
    for sub in ["logs", "rows", "traces"] {
        std::fs::create_dir_all(out.join(sub)).with_context(|| format!("creating {}", out.join(sub).display()))?;
    }
    let work = resolve_work(cmd.work.as_deref())?;
    eprintln!("gpu-check: reports in {}, scratch in {}", out.display(), work.display());
    // SIGINT/SIGTERM (Ctrl-C, an outer timeout): the signal's number, read between checks and
    // while a check runs.
    let stop = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, stop.clone(), sig as usize).context("installing a signal handler")?;
    }
    let exe = std::env::current_exe().context("the path of this binary")?;
    let sim = cmd.device.is_sim();
    let total_s = cmd.budget_s.unwrap_or(match (sim, cmd.quick) {
        (true, _) => 900.0,
        (false, true) => 175.0,
        (false, false) => 470.0,
    });
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(total_s);
    let jsonl_path = out.join("gpu-check.jsonl");
    let md_path = out.join("gpu-check.md");
    let mut jsonl = std::fs::File::create(&jsonl_path).with_context(|| format!("creating {}", jsonl_path.display()))?;
    let mut md = std::fs::File::create(&md_path).with_context(|| format!("creating {}", md_path.display()))?;
    md.write_all(header(cmd, &exe, &shared, &work, total_s).as_bytes())?;
    md.flush()?;
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for def in selected(cmd) {
        let left_s = deadline.saturating_duration_since(Instant::now()).as_secs_f64();
        let budget_s = (if sim { def.sim_budget_s } else { def.cuda_budget_s }).min(left_s);
        let signal = stop.load(Ordering::SeqCst);
        let mut row = if signal != 0 {
            skip_row(def, cmd.device, format!("not started: the run was stopped by {}", signal_name(signal)))
        } else if left_s < def.min_start_s {
            skip_row(
                def,
                cmd.device,
                format!(
                    "not started: {left_s:.0} s left of the run's {total_s:.0} s, it needs at least {:.0} s",
                    def.min_start_s
                ),
            )
        } else {
            run_in_child(cmd, def, &Paths { exe: &exe, shared: &shared, work: &work }, budget_s, &stop)
        };
        row["git_rev"] = json!(crate::GIT_REV);
        match row["status"].as_str() {
            Some("pass") => passed += 1,
            Some("skip") => skipped += 1,
            _ => failed += 1,
        }
        writeln!(jsonl, "{}", serde_json::to_string(&row)?)?;
        jsonl.flush()?;
        let line = markdown_line(&row);
        md.write_all(line.as_bytes())?;
        md.flush()?;
        print!("{line}");
        std::io::stdout().flush()?;
    }
    let signal = stop.load(Ordering::SeqCst);
    let summary = format!(
        "\n{passed} passed, {failed} failed, {skipped} skipped in {:.1} s ({}{}).\n",
        start.elapsed().as_secs_f64(),
        if failed == 0 { "no check failed" } else { "FAILED" },
        if signal != 0 { format!("; stopped by {}", signal_name(signal)) } else { String::new() }
    );
    md.write_all(summary.as_bytes())?;
    md.flush()?;
    print!("{summary}");
    eprintln!(
        "gpu-check: rows in {}, report in {}, scratch in {} (kept)",
        jsonl_path.display(),
        md_path.display(),
        work.display()
    );
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The Markdown report's header: the date, the build (version, git revision), the device (the
/// GPU, its driver), the host, the command, then the table's head.
fn header(cmd: &GpuCheckCmd, exe: &Path, shared: &Path, work: &Path, total_s: f64) -> String {
    let m = oogc_bench::machine::record(None);
    let mut s = String::from("# oogc gpu-check\n\n");
    s += &format!("- date: {} (unix time {})\n", oogc::lock::utc(m.timestamp_unix_s), m.timestamp_unix_s);
    s += &format!(
        "- oogc {}, git rev `{}`; binary {} (CUDA {})\n",
        env!("CARGO_PKG_VERSION"),
        crate::GIT_REV,
        exe.display(),
        if cfg!(feature = "cuda") { "built in" } else { "not built in" }
    );
    let gpu = match (cmd.device.is_sim(), env::nvidia_smi_summary()) {
        (_, Some(gpu)) => format!("GPU {gpu} (index, name, driver, memory, compute capability)"),
        (true, None) => "no GPU (the sim device: the CPU stands in)".to_string(),
        (false, None) => "nvidia-smi not found".to_string(),
    };
    s += &format!("- device: `{}`; {gpu}\n", device_name(cmd.device));
    s += &format!("- driver: {}\n", env::driver_version().unwrap_or_else(|| "none found".into()));
    s += &format!(
        "- host: {}, {} cores, {:.1} GiB, kernel {}\n",
        m.cpu_model,
        m.cores,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        m.kernel,
    );
    let args: Vec<String> = std::env::args().collect();
    s += &format!("- command: `{}`\n", args.join(" "));
    s += &format!("- data: {}; scratch: {}; budget {total_s:.0} s\n\n", shared.display(), work.display());
    s += "| # | check | status | s | figures | error / notes |\n|---|---|---|---|---|---|\n";
    s
}

/// The name of a signal the run handles.
fn signal_name(sig: usize) -> &'static str {
    match sig as i32 {
        signal_hook::consts::SIGINT => "SIGINT",
        signal_hook::consts::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// A row for a check that did not start.
fn skip_row(def: &CheckDef, device: DeviceKind, reason: String) -> Value {
    json!({
        "id": def.id, "name": def.name, "device": device_name(device), "status": "skip",
        "seconds": 0.0, "budget_s": 0.0, "figures": {}, "notes": [reason], "error": null,
    })
}

/// The paths a check's process is started with: this binary, the data, the run's scratch.
struct Paths<'a> {
    exe: &'a Path,
    shared: &'a Path,
    work: &'a Path,
}

/// Starts `def` in a child with `budget_s`, waits for it (killing it and its process group at
/// the budget, or when `stop` holds a signal's number), and returns its row, or a failure row
/// made from what it left.
fn run_in_child(cmd: &GpuCheckCmd, def: &CheckDef, paths: &Paths, budget_s: f64, stop: &AtomicUsize) -> Value {
    let (exe, out) = (paths.exe, &cmd.out);
    let log_path = out.join("logs").join(format!("{}-{}.log", def.id, def.name));
    let row_path = common::row_path(out, def.id);
    let partial_path = common::partial_path(out, def.id);
    let _ = std::fs::remove_file(&row_path);
    let _ = std::fs::remove_file(&partial_path);
    let started = Instant::now();
    eprintln!("gpu-check: {} {} (budget {budget_s:.0} s) ...", def.id, def.name);
    let fail = |error: String, mut figures: Value| {
        // The partial figures carry the check's notes so far.
        let mut notes: Vec<Value> = match figures.as_object_mut().and_then(|m| m.remove("notes")) {
            Some(Value::Array(n)) => n,
            _ => Vec::new(),
        };
        notes.push(Value::String(format!("log: {}", log_path.display())));
        json!({
            "id": def.id, "name": def.name, "device": device_name(cmd.device), "status": "fail",
            "seconds": started.elapsed().as_secs_f64(), "budget_s": budget_s,
            "figures": figures, "notes": notes, "error": error,
        })
    };
    let log = match std::fs::File::create(&log_path) {
        Ok(f) => f,
        Err(e) => return fail(format!("cannot create the log {}: {e}", log_path.display()), json!({})),
    };
    let log_err = match log.try_clone() {
        Ok(f) => f,
        Err(e) => return fail(format!("cannot share the log file: {e}"), json!({})),
    };
    let mut child = Command::new(exe);
    child
        .arg("gpu-check")
        .arg("--out")
        .arg(out)
        .arg("--work")
        .arg(paths.work)
        .arg("--device")
        .arg(device_name(cmd.device))
        .arg("--shared")
        .arg(paths.shared)
        .arg("--child")
        .arg(def.id.to_string())
        .arg("--child-budget-s")
        .arg(format!("{budget_s:.3}"));
    if cmd.quick {
        child.arg("--quick");
    }
    // Its own process group, so that a timeout also ends what it started (python3, the
    // swapper's tests).
    std::os::unix::process::CommandExt::process_group(&mut child, 0);
    let mut child = match child.stdin(Stdio::null()).stdout(log).stderr(log_err).spawn() {
        Ok(c) => c,
        Err(e) => return fail(format!("cannot start {}: {e}", exe.display()), json!({})),
    };
    let deadline = started + Duration::from_secs_f64(budget_s);
    // `Ok`: the child's exit status; `Err`: why it was killed.
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() >= deadline => {
                break Err(format!("timed out after {budget_s:.0} s (the check's budget)"))
            }
            Ok(None) if stop.load(Ordering::SeqCst) != 0 => {
                break Err(format!(
                    "stopped by {} after {:.0} s (the run's outer time limit, or Ctrl-C)",
                    signal_name(stop.load(Ordering::SeqCst)),
                    started.elapsed().as_secs_f64()
                ))
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return fail(format!("waiting for the check's process: {e}"), json!({})),
        }
    };
    if status.is_err() {
        common::kill_group(&mut child);
    }
    let figures = std::fs::read(&partial_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .unwrap_or_else(|| json!({}));
    match status {
        Err(why) => fail(format!("{why}: killed; figures so far kept"), figures),
        Ok(status) => match std::fs::read(&row_path).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok()) {
            Some(row) => {
                let _ = std::fs::remove_file(&partial_path);
                row
            }
            None => fail(
                format!(
                    "the check's process exited ({status}) without writing its row; its log ends:\n{}",
                    common::tail_of_file(&log_path, 12)
                ),
                figures,
            ),
        },
    }
}

/// One Markdown table line for `row`.
fn markdown_line(row: &Value) -> String {
    let cell = |s: &str| s.replace('|', "\\|").replace('\n', " ");
    let status = row["status"].as_str().unwrap_or("fail");
    let shown = match status {
        "pass" => "pass".to_string(),
        "skip" => "skip".to_string(),
        _ => "**FAIL**".to_string(),
    };
    let figures =
        row["figures"]["summary"].as_str().map(str::to_string).unwrap_or_else(|| scalar_figures(&row["figures"]));
    let mut extra = Vec::new();
    if let Some(e) = row["error"].as_str() {
        extra.push(e.to_string());
    }
    if let Some(notes) = row["notes"].as_array() {
        extra.extend(notes.iter().filter_map(|n| n.as_str()).filter(|n| !n.starts_with("log: ")).map(str::to_string));
    }
    format!(
        "| {} | {} | {} | {:.1} | {} | {} |\n",
        row["id"],
        row["name"].as_str().unwrap_or("?"),
        shown,
        row["seconds"].as_f64().unwrap_or(0.0),
        cell(&figures),
        cell(&extra.join("; "))
    )
}

/// The top-level scalar figures of a row, `key=value` comma-separated (at most 10).
fn scalar_figures(figures: &Value) -> String {
    let Some(map) = figures.as_object() else { return String::new() };
    map.iter()
        .filter_map(|(k, v)| match v {
            Value::Number(n) => Some(format!("{k}={}", common::short_number(n.as_f64().unwrap_or(0.0)))),
            Value::Bool(b) => Some(format!("{k}={b}")),
            Value::String(s) if s.len() <= 40 => Some(format!("{k}={s}")),
            _ => None,
        })
        .take(10)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The child: runs check `id` and writes its row (`rows/N.json`); exits 0 whatever the check's
/// status (the row says it).
fn run_child(cmd: &GpuCheckCmd, id: usize, shared: PathBuf, work_root: &Path) -> anyhow::Result<ExitCode> {
    let def = CHECKS.iter().find(|c| c.id == id).with_context(|| format!("no check {id}"))?;
    let budget_s = cmd.child_budget_s.unwrap_or(if cmd.device.is_sim() { def.sim_budget_s } else { def.cuda_budget_s });
    let work = work_root.join(format!("{}-{}", def.id, def.name));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    // Check 9 reads the copy/compute overlap from a Chrome trace of its own run (a report: in
    // --out, which device-check.sh packs).
    let trace = (def.id == 9 && !cmd.device.is_sim())
        .then(|| cmd.out.join("traces").join(format!("{}-{}.json", def.id, def.name)));
    let guard = crate::init_tracing(trace.as_deref());
    let dirs = common::Dirs { shared, out: cmd.out.clone(), work_root: work_root.to_path_buf(), work };
    let ctx = Ctx::new(cmd.device, cmd.quick, dirs, budget_s, guard, trace)?;
    let mut figures = Figures::new(common::partial_path(&cmd.out, id));
    let started = Instant::now();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (def.run)(&ctx, &mut figures)));
    let seconds = started.elapsed().as_secs_f64();
    let (status, error) = match outcome {
        Ok(Ok(Verdict::Pass)) => ("pass", None),
        Ok(Ok(Verdict::Skip(reason))) => {
            figures.note(reason);
            ("skip", None)
        }
        Ok(Ok(Verdict::Fail(reason))) => ("fail", Some(reason)),
        Ok(Err(e)) => ("fail", Some(crate::error_line(&e))),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            ("fail", Some(format!("panicked: {msg}")))
        }
    };
    let (figures, notes) = figures.into_parts();
    let row = json!({
        "id": def.id, "name": def.name, "device": device_name(cmd.device), "status": status,
        "seconds": seconds, "budget_s": budget_s, "figures": Value::Object(figures), "notes": notes,
        "error": error, "git_rev": crate::GIT_REV,
    });
    common::write_atomic(&common::row_path(&cmd.out, id), serde_json::to_vec(&row)?.as_slice())?;
    eprintln!("gpu-check child {id}: {status} in {seconds:.1} s");
    Ok(ExitCode::SUCCESS)
}

/// The row of check `id` in this run's `gpu-check.jsonl` (what a check reads of an earlier one).
pub(crate) fn read_row(out: &Path, id: usize) -> Option<Map<String, Value>> {
    let text = std::fs::read_to_string(out.join("gpu-check.jsonl")).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .rfind(|r| r["id"].as_u64() == Some(id as u64))
        .and_then(|r| r.as_object().cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(signal_hook::consts::SIGTERM as usize), "SIGTERM");
        assert_eq!(signal_name(signal_hook::consts::SIGINT as usize), "SIGINT");
        assert_eq!(signal_name(0), "a signal");
    }
}
