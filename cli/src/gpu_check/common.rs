//! What the checks share: the context of a child ([`Ctx`]), the figures it writes as it goes
//! ([`Figures`]), its verdict ([`Verdict`]), subprocesses with a timeout, tensors read back to the
//! host and compared, and the fixtures' reference files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use candle_core::{DType, Device, Tensor};
use oogc::config::DeviceKind;
use oogc::models::hf::{read_tensors, NamedTensor};
use oogc::models::IGNORE_INDEX;
use serde_json::{Map, Value};

/// How a check ended when it did not return an error.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Everything it checked held.
    Pass,
    /// It cannot run here (no GPU, no torch, no time); the reason.
    Skip(String),
    /// It ran and a comparison or a target failed; what.
    Fail(String),
}

/// A verdict from the failures a check collected: pass when there are none. Failures of the form
/// `label: message` (a label without spaces) that share their message are shown once, with
/// their labels together (`llama_gqa.f32, llama_gqa.bf16: <message>`).
pub(crate) fn verdict(failures: Vec<String>) -> Verdict {
    if failures.is_empty() {
        return Verdict::Pass;
    }
    let mut groups: Vec<(Vec<String>, String)> = Vec::new();
    for f in failures {
        match f.split_once(": ").filter(|(label, _)| !label.contains(' ')) {
            Some((label, msg)) => match groups.iter_mut().find(|(labels, m)| !labels.is_empty() && m == msg) {
                Some((labels, _)) => labels.push(label.to_string()),
                None => groups.push((vec![label.to_string()], msg.to_string())),
            },
            None => groups.push((Vec::new(), f)),
        }
    }
    Verdict::Fail(
        groups
            .into_iter()
            .map(|(labels, msg)| if labels.is_empty() { msg } else { format!("{}: {msg}", labels.join(", ")) })
            .collect::<Vec<_>>()
            .join("; "),
    )
}

/// The CPU: the reference the device is compared against (check 3's f64 oracle and its CPU f32
/// beside the GPU's) and the sim device's compute. The one place the checks name it.
pub(crate) fn cpu() -> Device {
    Device::Cpu
}

/// The GPU profile check 8 writes into the reports (`oogc plan --profile FILE`), which the
/// throughput checks read for their MFU and link figures.
pub(crate) fn profile_path(out: &Path) -> PathBuf {
    out.join("gpu-profile.toml")
}

/// The peak bf16 TFLOP/s and H2D GB/s the throughput checks divide by: check 8's measured
/// profile when it exists, else the NVIDIA H100 SXM datasheet's (named in the returned source).
pub(crate) fn gpu_peaks(out: &Path) -> (f64, f64, String) {
    let sheet = oogc::prefetch::GpuDatasheet::H100_SXM;
    match oogc::prefetch::HardwareProfile::load(&profile_path(out)) {
        Ok(p) => (
            p.device_bf16_tflops.unwrap_or(sheet.bf16_tflops),
            p.h2d_gbps,
            format!("measured ({})", profile_path(out).display()),
        ),
        Err(_) => (sheet.bf16_tflops, sheet.link_gbps * sheet.link_fraction, format!("the {} datasheet", sheet.name)),
    }
}

/// The context of one check in its child process.
pub(crate) struct Ctx {
    /// The device the checks run on.
    pub device: DeviceKind,
    /// `--quick`: sizes for the 3-minute run.
    pub quick: bool,
    /// Where the data is (`data/`, `fixtures/llama/`).
    pub shared: PathBuf,
    /// The run's reports directory, `--out` (`gpu-check.jsonl` of the checks before this one).
    pub out: PathBuf,
    /// The run's scratch directory, `--work` (what the checks share: the token cache).
    pub work_root: PathBuf,
    /// This check's scratch directory, `N-name/` in `work_root` (emptied at its start).
    pub work: PathBuf,
    /// This binary's directory (`swapper-tests` and the data of dist/oogc-cuda are beside it).
    pub exe_dir: PathBuf,
    /// When this check's budget ends (its subprocesses get what is left).
    pub deadline: Instant,
    /// The Chrome trace this child writes, if any, and the guard that flushes it when dropped.
    pub trace: Option<PathBuf>,
    trace_guard: Mutex<Option<tracing_chrome::FlushGuard>>,
}

/// The directories of a check's process (see the fields of [`Ctx`] of the same names).
pub(crate) struct Dirs {
    pub shared: PathBuf,
    pub out: PathBuf,
    pub work_root: PathBuf,
    pub work: PathBuf,
}

impl Ctx {
    pub(crate) fn new(
        device: DeviceKind,
        quick: bool,
        dirs: Dirs,
        budget_s: f64,
        trace_guard: Option<tracing_chrome::FlushGuard>,
        trace: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("the path of this binary")?;
        let Dirs { shared, out, work_root, work } = dirs;
        Ok(Self {
            device,
            quick,
            shared,
            out,
            work_root,
            work,
            exe_dir: exe.parent().unwrap_or(Path::new(".")).to_path_buf(),
            deadline: Instant::now() + Duration::from_secs_f64(budget_s.max(1.0)),
            trace,
            trace_guard: Mutex::new(trace_guard),
        })
    }

    /// Whether the checks run on the sim device.
    pub(crate) fn is_sim(&self) -> bool {
        self.device.is_sim()
    }

    /// The CUDA ordinal, `None` on the sim device.
    pub(crate) fn cuda_ordinal(&self) -> Option<usize> {
        self.device.cuda_ordinal(0)
    }

    /// `"sim"` or `"cuda:N"`.
    pub(crate) fn device_name(&self) -> String {
        String::from(self.device)
    }

    /// candle's device for the checks' compute: the CPU on the sim device, else the GPU.
    ///
    /// # Errors
    /// candle's, e.g. a binary built without CUDA or no device.
    pub(crate) fn compute_device(&self) -> anyhow::Result<Device> {
        match self.device.cuda_ordinal(0) {
            None => Ok(cpu()),
            Some(n) => Device::new_cuda(n).with_context(|| format!("opening cuda:{n} in candle")),
        }
    }

    /// The training text.
    pub(crate) fn text(&self) -> PathBuf {
        self.shared.join("data/tinyshakespeare.txt")
    }

    /// The Llama-family fixtures' directory.
    pub(crate) fn fixtures(&self) -> PathBuf {
        self.shared.join("fixtures/llama")
    }

    /// The fixtures' tokenizer (vocabulary 1024).
    pub(crate) fn tokenizer(&self) -> PathBuf {
        self.fixtures().join("tokenizer.json")
    }

    /// Seconds left of this check's budget.
    pub(crate) fn left_s(&self) -> f64 {
        self.deadline.saturating_duration_since(Instant::now()).as_secs_f64()
    }

    /// Flushes and closes this child's Chrome trace (its spans are in the file afterwards).
    pub(crate) fn finish_trace(&self) {
        if let Ok(mut g) = self.trace_guard.lock() {
            drop(g.take());
        }
    }
}

/// Figures of a check, written to `rows/N.partial.json` at each change, so a check killed at
/// its budget keeps what it had measured.
pub(crate) struct Figures {
    map: Map<String, Value>,
    notes: Vec<String>,
    path: PathBuf,
}

impl Figures {
    pub(crate) fn new(path: PathBuf) -> Self {
        Self { map: Map::new(), notes: Vec::new(), path }
    }

    /// Sets figure `key` (any serializable value) and saves the figures.
    pub(crate) fn set(&mut self, key: &str, value: impl serde::Serialize) {
        let v = serde_json::to_value(value).unwrap_or_else(|e| Value::String(format!("unserializable: {e}")));
        self.map.insert(key.to_string(), v);
        self.save();
    }

    /// The one-line summary shown in the Markdown report.
    pub(crate) fn summary(&mut self, text: impl Into<String>) {
        self.set("summary", text.into());
    }

    /// A note for the report (what did not run and why, a caveat).
    pub(crate) fn note(&mut self, text: impl Into<String>) {
        self.notes.push(text.into());
        self.save();
    }

    fn save(&self) {
        let mut v = self.map.clone();
        v.insert("notes".into(), Value::from(self.notes.clone()));
        if let Ok(bytes) = serde_json::to_vec(&Value::Object(v)) {
            let _ = write_atomic(&self.path, &bytes);
        }
    }

    pub(crate) fn into_parts(self) -> (Map<String, Value>, Vec<String>) {
        (self.map, self.notes)
    }
}

/// Where the child writes its row.
pub(crate) fn row_path(out: &Path, id: usize) -> PathBuf {
    out.join("rows").join(format!("{id}.json"))
}

/// Where the child writes its figures as it goes.
pub(crate) fn partial_path(out: &Path, id: usize) -> PathBuf {
    out.join("rows").join(format!("{id}.partial.json"))
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Kills `child` and the process group it leads (started with `process_group(0)`), then reaps it.
pub(crate) fn kill_group(child: &mut Child) {
    let pgid = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &pgid]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of a text file (empty when it cannot be read).
pub(crate) fn tail_of_file(path: &Path, lines: usize) -> String {
    tail(&String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()), lines)
}

/// The last `lines` lines of `text`.
pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.trim_end().lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A number in a few significant digits.
pub(crate) fn short_number(x: f64) -> String {
    if x == 0.0 || x.fract() == 0.0 && x.abs() < 1e9 {
        format!("{x}")
    } else if x.abs() >= 1e4 || x.abs() < 1e-3 {
        format!("{x:.3e}")
    } else {
        format!("{x:.4}")
    }
}

/// What a subprocess did: its exit status (`None`: killed at the timeout) and output.
pub(crate) struct Ran {
    pub code: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    pub(crate) fn success(&self) -> bool {
        !self.timed_out && self.code == Some(0)
    }
}

/// Runs `cmd` for at most `timeout` (in its own process group, killed at the timeout), its
/// output going through files in `work` (named after `tag`).
///
/// # Errors
/// When it cannot be started.
pub(crate) fn run_with_timeout(cmd: &mut Command, timeout: Duration, work: &Path, tag: &str) -> anyhow::Result<Ran> {
    let out_path = work.join(format!("{tag}.stdout"));
    let err_path = work.join(format!("{tag}.stderr"));
    let out = std::fs::File::create(&out_path)?;
    let err = std::fs::File::create(&err_path)?;
    std::os::unix::process::CommandExt::process_group(cmd, 0);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let deadline = Instant::now() + timeout;
    let (code, timed_out) = loop {
        if let Some(status) = child.try_wait()? {
            break (status.code(), false);
        }
        if Instant::now() >= deadline {
            kill_group(&mut child);
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    Ok(Ran { code, timed_out, stdout: read(&out_path), stderr: read(&err_path) })
}

/// Whether `python3 -c "import torch"` works here, and torch's version (or why not).
pub(crate) fn torch_version(work: &Path) -> Result<String, String> {
    let mut cmd = Command::new("python3");
    cmd.args(["-c", "import torch; print(torch.__version__)"]);
    match run_with_timeout(&mut cmd, Duration::from_secs(60), work, "import-torch") {
        Ok(r) if r.success() => Ok(r.stdout.trim().to_string()),
        Ok(r) if r.timed_out => Err("python3 -c 'import torch' timed out after 60 s".into()),
        Ok(r) => Err(format!("python3 -c 'import torch' failed: {}", tail(&r.stderr, 1))),
        Err(e) => Err(format!("python3 cannot be started: {e}")),
    }
}

/// A tensor's elements (any shape, dtype and device) on the host as f64; f64 tensors exactly,
/// others through f32 (exact for f32, bf16 and f16).
///
/// # Errors
/// candle's.
pub(crate) fn host_f64(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    let t = t.flatten_all()?;
    if t.dtype() == DType::F64 {
        return Ok(t.to_vec1::<f64>()?);
    }
    Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(f64::from).collect())
}

/// A tensor's elements on the host as f32 bit patterns (bf16 and f16 widened exactly).
///
/// # Errors
/// candle's.
pub(crate) fn host_bits(t: &Tensor) -> anyhow::Result<Vec<u32>> {
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(v.into_iter().map(f32::to_bits).collect())
}

/// How far `a` is from the reference `b`.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(crate) struct Diff {
    /// ‖a − b‖₂ / ‖b‖₂ (‖a − b‖₂ when ‖b‖₂ is 0).
    pub rel_l2: f64,
    /// max |a − b| / max |b| (the worst element against the tensor's scale).
    pub max_rel: f64,
    /// max |a − b|.
    pub max_abs: f64,
}

/// [`Diff`] of `a` against the reference `b` (equal lengths; a NaN makes every figure NaN).
pub(crate) fn diff(a: &[f64], b: &[f64]) -> Diff {
    assert_eq!(a.len(), b.len(), "compared tensors have different lengths");
    let (mut num, mut den, mut max_abs, mut max_ref) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x - y;
        num += d * d;
        den += y * y;
        max_abs = if d.is_nan() { f64::NAN } else { max_abs.max(d.abs()) };
        max_ref = max_ref.max(y.abs());
    }
    let rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    let max_rel = if max_ref > 0.0 { max_abs / max_ref } else { max_abs };
    Diff { rel_l2, max_rel, max_abs }
}

/// The worst element's share of its tolerance `atol + rtol · |b|` (≤ 1: within), the oracle
/// tolerance of the fixtures' README.
pub(crate) fn tolerance_share(a: &[f64], b: &[f64], rtol: f64, atol: f64) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| (x - y).abs() / (atol + rtol * y.abs())).fold(0.0, |m, s| {
        if s.is_nan() {
            f64::NAN
        } else {
            m.max(s)
        }
    })
}

/// Whether `x ≤ limit` (false for NaN).
pub(crate) fn within(x: f64, limit: f64) -> bool {
    x <= limit
}

/// Whether `x ≥ target` (false for NaN).
pub(crate) fn at_least(x: f64, target: f64) -> bool {
    x >= target
}

/// The tensors of a fixture file by name.
pub(crate) fn fixture_tensors(path: &Path) -> anyhow::Result<BTreeMap<String, NamedTensor>> {
    Ok(read_tensors(path)
        .with_context(|| format!("reading {}", path.display()))?
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect())
}

/// A float tensor of a fixture file as f64.
pub(crate) fn fixture_floats(t: &BTreeMap<String, NamedTensor>, name: &str) -> anyhow::Result<Vec<f64>> {
    let v = t.get(name).and_then(|t| t.as_f32()).with_context(|| format!("fixture tensor {name} (float) missing"))?;
    Ok(v.iter().map(|&x| f64::from(x)).collect())
}

/// `input_ids` or `labels` `[B, T]` of a fixture as U32 ids (transformers' -100 as
/// [`IGNORE_INDEX`]) and `(B, T)`.
pub(crate) fn fixture_id_vec(
    t: &BTreeMap<String, NamedTensor>,
    name: &str,
) -> anyhow::Result<(Vec<u32>, (usize, usize))> {
    let nt = t.get(name).with_context(|| format!("fixture tensor {name} missing"))?;
    let v = nt.as_i64().with_context(|| format!("fixture tensor {name} is not an integer tensor"))?;
    anyhow::ensure!(nt.shape.len() == 2, "fixture tensor {name}: shape {:?}, expected [B, T]", nt.shape);
    Ok((v.iter().map(|&x| if x < 0 { IGNORE_INDEX } else { x as u32 }).collect(), (nt.shape[0], nt.shape[1])))
}

/// [`fixture_id_vec`] as a `[B, T]` U32 tensor on `device`.
pub(crate) fn fixture_ids(t: &BTreeMap<String, NamedTensor>, name: &str, device: &Device) -> anyhow::Result<Tensor> {
    let (ids, shape) = fixture_id_vec(t, name)?;
    Ok(Tensor::from_vec(ids, shape, device)?)
}

/// A deterministic stream of pseudo-random u64 (splitmix64).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A finite, nonzero f32 that bf16 represents exactly (magnitude in [2⁻⁸, 2⁸), either sign).
    pub(crate) fn bf16_exact(&mut self) -> f32 {
        let r = self.next_u64();
        let sign = ((r >> 63) as u32) << 31;
        let exponent = 119 + (r >> 8) as u32 % 16; // 2^-8 .. 2^7
        let mantissa = ((r >> 20) as u32 & 0x7F) << 16;
        f32::from_bits(sign | exponent << 23 | mantissa)
    }

    /// `n` values of [`Rng::bf16_exact`].
    pub(crate) fn bf16_exact_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.bf16_exact()).collect()
    }
}
