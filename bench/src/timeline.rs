//! The step timeline of `oogc bench all`: a few real training steps recorded as a Chrome/Perfetto
//! trace ([`record`]), read back into one lane per resource ([`parse`]), with each lane's busy
//! time and how much of the transfers and the optimizer hid under compute ([`Timeline::rows`]).
//! [`super::plots::write_timeline`] draws it.
//!
//! | track | spans (names as `oogc train` traces them) | thread |
//! |---|---|---|
//! | `compute` | `compute::forward`, `compute::backward`, `compute::expert_forward`, `compute::expert_backward` | main |
//! | `h2d` | `swapper::htod` on the sim copy engine (the link's real occupancy); without a sim engine (CUDA), the device-level copies (no `tensor` field) on any thread | `oogc-sim-htod` |
//! | `d2h` | `swapper::dtoh`, chosen as for `h2d` | `oogc-sim-dtoh` |
//! | `nvme` | `swapper::nvme_read`, `swapper::nvme_write` | `oogc-uring` or the store's workers |
//! | `optimizer` | `optimizer::update`, `optimizer::speculate` | `oogc-opt-N` |
//!
//! A step starts where a `compute::forward` follows a backward (or opens the trace): unit 0's
//! forward, or for an MoE model the first trunk's. A full step runs from one start to the next,
//! so a run of N steps holds N − 1 full steps, of which the first records the schedule and is
//! slow: record at least `keep + 2` steps. The `swapper::htod`/`dtoh` spans of the issuing threads
//! (with a `tensor` field) are left out: they time the request, not the link.
//!
//! On CUDA the device-level copy spans end when the copy is queued, not when the DMA finishes,
//! so the `h2d`/`d2h` lanes show issue time, not link occupancy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::step::{remove_scratch, variant_config};
use crate::error::{Context, Error, Result};
use oogc::config::TrainConfig;

/// Training steps [`record`] runs by default: the schedule-recording first step, two full steps
/// and the last (which has no end in the trace).
pub const DEFAULT_RECORD_STEPS: usize = 4;
/// Full steps [`parse`] keeps by default (the last ones of the trace).
pub const DEFAULT_KEEP_STEPS: usize = 2;

/// The file names [`record`] writes in its directory.
pub const TRACE_FILE: &str = "step-trace.json";
/// The config copy [`record`] runs.
pub const CONFIG_FILE: &str = "step-config.toml";

/// A resource lane of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Track {
    /// Forward and backward of units and experts (the compute thread).
    Compute,
    /// Host → device copies (link occupancy on the sim device).
    H2D,
    /// Device → host copies.
    D2H,
    /// NVMe store reads and writes.
    NVMe,
    /// CPU optimizer updates and speculative updates.
    Optimizer,
}

impl Track {
    /// Every track, top lane first.
    pub const ALL: [Track; 5] = [Track::Compute, Track::H2D, Track::D2H, Track::NVMe, Track::Optimizer];

    /// The lane's name in plots: `compute`, `H2D`, `D2H`, `NVMe`, `optimizer`.
    pub fn name(self) -> &'static str {
        match self {
            Track::Compute => "compute",
            Track::H2D => "H2D",
            Track::D2H => "D2H",
            Track::NVMe => "NVMe",
            Track::Optimizer => "optimizer",
        }
    }
}

/// One span on a track.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrackSpan {
    /// The lane.
    pub track: Track,
    /// Start, seconds from the start of the first shown step (clipped to the shown steps).
    pub start_s: f64,
    /// End, seconds from the start of the first shown step (clipped to the shown steps).
    pub end_s: f64,
    /// The span's name in the trace, e.g. `compute::forward`, `swapper::nvme_write`.
    pub name: String,
    /// A short description: the operation and its fields, e.g. `forward unit=3`,
    /// `htod bytes=884736`.
    pub label: String,
}

/// The last full steps of a trace, one lane per [`Track`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timeline {
    /// The plot's title; [`parse`] sets the trace's file name, [`run_title`] makes a better one.
    pub title: String,
    /// The shown steps as (start, end), seconds from the start of the first; consecutive.
    pub steps: Vec<(f64, f64)>,
    /// The spans that overlap the shown steps, clipped to them, in start order.
    pub spans: Vec<TrackSpan>,
}

/// Busy time and overlap of one shown step, or of all of them (a row of `timeline.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineRow {
    /// Index of the shown step (0 = the first); `null`: all shown steps, busy times as means per
    /// step and overlap fractions over their whole time.
    pub step: Option<usize>,
    /// Start, seconds from the start of the first shown step.
    pub start_s: f64,
    /// End, seconds from the start of the first shown step.
    pub end_s: f64,
    /// Wall time of the step, seconds (mean over steps when `step` is `null`).
    pub step_s: f64,
    /// Time the compute lane was busy, seconds (overlapping spans counted once).
    pub compute_s: f64,
    /// Time the H2D lane was busy, seconds.
    pub h2d_s: f64,
    /// Time the D2H lane was busy, seconds.
    pub d2h_s: f64,
    /// Time the NVMe lane was busy (reads or writes), seconds.
    pub nvme_s: f64,
    /// Time the optimizer lane was busy (any worker), seconds.
    pub optimizer_s: f64,
    /// Fraction (0–1) of the H2D busy time during which compute was busy too; `null` without H2D.
    pub h2d_overlap_compute: Option<f64>,
    /// Fraction of the D2H busy time during which compute was busy too; `null` without D2H.
    pub d2h_overlap_compute: Option<f64>,
    /// Fraction of the NVMe busy time during which compute was busy too; `null` without NVMe.
    pub nvme_overlap_compute: Option<f64>,
    /// Fraction of the optimizer busy time during which compute was busy too; `null` without
    /// optimizer spans.
    pub optimizer_overlap_compute: Option<f64>,
}

/// A plot title for a run of `config` read from `config_path`: the file's stem and the link,
/// e.g. `tinyshakespeare, sim link 0.05 GB/s`.
pub fn run_title(config_path: &Path, config: &TrainConfig) -> String {
    let name = config_path.file_stem().map_or_else(|| "config".into(), |s| s.to_string_lossy().into_owned());
    if config.device.kind.is_sim() {
        if config.device.link_gbps > 0.0 {
            format!("{name}, sim link {} GB/s", config.device.link_gbps)
        } else {
            format!("{name}, sim link unthrottled")
        }
    } else {
        format!("{name}, {}", config.device.kind)
    }
}

/// Runs `steps` training steps of `config` in a child `oogc train` (this executable) and
/// returns the path of its trace, `dir/step-trace.json`. See [`record_with`].
///
/// # Errors
/// As [`record_with`], and when the path of this executable is unknown.
pub fn record(config: &TrainConfig, steps: usize, dir: &Path) -> Result<PathBuf> {
    let bin = std::env::current_exe().map_err(Error::CurrentExe)?;
    record_with(&bin, config, steps, dir)
}

/// Runs `bin train --config dir/step-config.toml --steps <steps>` and returns the path of the
/// Chrome trace it wrote, `dir/step-trace.json` ([`TRACE_FILE`]).
///
/// The config copy (`dir/step-config.toml`, [`CONFIG_FILE`], kept beside the trace) is `config`
/// without checkpoints, metrics or routing trace, validation only at the end on one batch, and
/// its NVMe state in a scratch subdirectory of each NVMe directory, removed afterwards. `config`'s
/// paths must be absolute, as [`TrainConfig::load`] leaves them. The run is a child process
/// because the tracing subscriber is global to a process. Its stdout and stderr are captured.
/// `steps` should be at least [`DEFAULT_KEEP_STEPS`] + 2 (see the module docs).
///
/// # Errors
/// `dir` cannot be created or written, the config copy does not read back as `config`, `bin`
/// cannot be started, the run exits with an error (the message holds the end of its stderr), or
/// it wrote no trace.
pub fn record_with(bin: &Path, config: &TrainConfig, steps: usize, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(Error::io("creating the output directory", dir, None))?;
    let dir = std::path::absolute(dir).map_err(Error::io("the absolute path of", dir, None))?;
    let trace = dir.join(TRACE_FILE);
    let copy = dir.join(CONFIG_FILE);
    let mut cfg = variant_config(config, "timeline", steps as u64);
    cfg.output.trace = Some(trace.clone());
    cfg.train.eval_interval = 0;
    cfg.train.eval_batches = 1;
    let text = exact_toml(&cfg)?;
    std::fs::write(&copy, text).map_err(Error::io("writing the config copy", &copy, None))?;
    // A stale trace must not pass for this run's.
    let _ = std::fs::remove_file(&trace);

    let output = Command::new(bin)
        .arg("train")
        .arg("--config")
        .arg(&copy)
        .arg("--steps")
        .arg(steps.to_string())
        .arg("--no-progress")
        .stdin(Stdio::null())
        .output();
    remove_scratch(&cfg);
    let output = output.map_err(|source| Error::StartChild { bin: bin.to_path_buf(), source })?;
    if !output.status.success() {
        return Err(Error::ChildFailed {
            command: format!("{} train --config {} --steps {steps}", bin.display(), copy.display()),
            status: output.status,
            stderr_tail: tail(&String::from_utf8_lossy(&output.stderr), 20),
        });
    }
    if !trace.exists() {
        return Err(Error::NoTrace { command: format!("{} train --config {}", bin.display(), copy.display()), trace });
    }
    Ok(trace)
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.trim_end().lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `cfg` as TOML with sizes as exact byte counts (`ByteSize` writes a rounded `"7.3 MiB"`),
/// checked to read back as `cfg`.
fn exact_toml(cfg: &TrainConfig) -> Result<String> {
    let mut v =
        toml::Value::try_from(cfg).map_err(|source| Error::Toml { what: "serializing the config copy", source })?;
    let bytes = |b: bytesize::ByteSize| toml::Value::Integer(b.as_u64() as i64);
    if let Some(t) = v.get_mut("budgets").and_then(|t| t.as_table_mut()) {
        t.insert("gpu".into(), bytes(cfg.budgets.gpu));
        t.insert("host".into(), bytes(cfg.budgets.host));
        if let Some(n) = cfg.budgets.nvme_size {
            t.insert("nvme_size".into(), bytes(n));
        }
    }
    if let (Some(t), Some(b)) = (v.get_mut("moe").and_then(|t| t.as_table_mut()), cfg.moe.expert_budget) {
        t.insert("expert_budget".into(), bytes(b));
    }
    let text = toml::to_string(&v).map_err(|source| Error::Toml { what: "serializing the config copy", source })?;
    let back = TrainConfig::from_toml_str(&text).context("reading back the config copy")?;
    if back != *cfg {
        return Err(Error::ConfigRoundTrip { text });
    }
    Ok(text)
}

/// One event of a Chrome trace (the fields used here).
#[derive(Debug, Deserialize)]
struct Event {
    ph: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    tid: Value,
    #[serde(default)]
    ts: f64,
    #[serde(default)]
    args: Map<String, Value>,
}

/// A span as read from the trace: times in microseconds of the trace clock.
#[derive(Debug, Clone)]
struct RawSpan {
    tid: String,
    name: String,
    start_us: f64,
    end_us: f64,
    args: Map<String, Value>,
}

/// Reads the Chrome trace `trace` (as `oogc train` writes with `[output] trace`) and keeps its
/// last `keep` full steps (fewer when the trace holds fewer; at least one).
///
/// # Errors
/// The file cannot be read, is not a Chrome trace JSON array (a missing closing `]`, left by a
/// process that died, is tolerated), or holds no full step.
pub fn parse(trace: &Path, keep: usize) -> Result<Timeline> {
    let text = std::fs::read_to_string(trace).map_err(Error::io("reading the trace", trace, None))?;
    let mut tl = parse_str(&text, keep).with_context(|| format!("the trace {}", trace.display()))?;
    tl.title = trace.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    Ok(tl)
}

/// [`parse`] on the text of a trace.
///
/// # Errors
/// As [`parse`], without the read error.
pub fn parse_str(text: &str, keep: usize) -> Result<Timeline> {
    let events = read_events(text)?;
    let spans = pair(&events);
    let (names, sim_copy_engine) = thread_names(&events);
    let mut classified: Vec<(Track, RawSpan)> =
        spans.into_iter().filter_map(|s| classify(&s, &names, sim_copy_engine).map(|t| (t, s))).collect();
    classified.sort_by(|a, b| a.1.start_us.total_cmp(&b.1.start_us));

    let starts = step_starts(&classified);
    if starts.len() < 2 {
        return Err(Error::TooFewSteps { starts: starts.len(), min_steps: keep.max(1) + 2 });
    }
    let full = starts.len() - 1;
    let first = full - keep.clamp(1, full);
    let t0 = starts[first];
    let t1 = starts[full];
    let s = |us: f64| (us - t0) * 1e-6;
    let steps = starts[first..].windows(2).map(|w| (s(w[0]), s(w[1]))).collect();
    let spans = classified
        .into_iter()
        .filter(|(_, r)| r.end_us > t0 && r.start_us < t1)
        .map(|(track, r)| TrackSpan {
            track,
            start_s: s(r.start_us.max(t0)),
            end_s: s(r.end_us.min(t1)),
            label: label(&r.name, &r.args),
            name: r.name,
        })
        .collect();
    Ok(Timeline { title: String::new(), steps, spans })
}

/// The JSON array of events; a trace cut short (no closing `]`, perhaps half a last line) is
/// closed after its last whole event.
fn read_events(text: &str) -> Result<Vec<Event>> {
    let first_err = match serde_json::from_str::<Vec<Event>>(text) {
        Ok(ev) => return Ok(ev),
        Err(e) => e,
    };
    let trimmed = text.trim_end();
    if !trimmed.ends_with(']') {
        let close = |t: &str| format!("{}\n]", t.trim_end().trim_end_matches(','));
        if let Ok(ev) = serde_json::from_str::<Vec<Event>>(&close(trimmed)) {
            return Ok(ev);
        }
        // Half a last line: drop it.
        if let Some(cut) = trimmed.rfind('\n') {
            if let Ok(ev) = serde_json::from_str::<Vec<Event>>(&close(&trimmed[..cut])) {
                return Ok(ev);
            }
        }
    }
    Err(Error::NotATrace { reason: first_err.to_string() })
}

/// A thread id as a string (tracing-chrome writes numbers; others may write strings).
fn tid_key(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Pairs `B`/`E` events per (thread, name), innermost first; unmatched ends and spans still open
/// at the end of the trace are dropped. `X` (complete) events are taken as they are.
fn pair(events: &[Event]) -> Vec<RawSpan> {
    let mut open: HashMap<(String, &str), Vec<&Event>> = HashMap::new();
    let mut out = Vec::new();
    for e in events {
        let tid = tid_key(&e.tid);
        match e.ph.as_str() {
            "B" => open.entry((tid, e.name.as_str())).or_default().push(e),
            "E" => {
                if let Some(b) = open.get_mut(&(tid.clone(), e.name.as_str())).and_then(Vec::pop) {
                    out.push(RawSpan {
                        tid,
                        name: b.name.clone(),
                        start_us: b.ts,
                        end_us: e.ts.max(b.ts),
                        args: b.args.clone(),
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// Thread names by id (`M` events), and whether the sim device's copy engines are among them.
fn thread_names(events: &[Event]) -> (HashMap<String, String>, bool) {
    let names: HashMap<String, String> = events
        .iter()
        .filter(|e| e.ph == "M" && e.name == "thread_name")
        .filter_map(|e| Some((tid_key(&e.tid), e.args.get("name")?.as_str()?.to_string())))
        .collect();
    let sim = names.values().any(|n| n.starts_with("oogc-sim-"));
    (names, sim)
}

fn classify(s: &RawSpan, names: &HashMap<String, String>, sim_copy_engine: bool) -> Option<Track> {
    let copy_engine = || {
        if sim_copy_engine {
            names.get(&s.tid).is_some_and(|n| n.starts_with("oogc-sim-"))
        } else {
            // The device-level copy (CUDA): `bytes` without the residency manager's `tensor`.
            s.args.contains_key("bytes") && !s.args.contains_key("tensor")
        }
    };
    match s.name.as_str() {
        "compute::forward" | "compute::backward" | "compute::expert_forward" | "compute::expert_backward" => {
            Some(Track::Compute)
        }
        "swapper::htod" if copy_engine() => Some(Track::H2D),
        "swapper::dtoh" if copy_engine() => Some(Track::D2H),
        "swapper::nvme_read" | "swapper::nvme_write" => Some(Track::NVMe),
        "optimizer::update" | "optimizer::speculate" => Some(Track::Optimizer),
        _ => None,
    }
}

/// Starts (µs) of the steps: each `compute::forward` that opens the trace's compute or follows a
/// backward.
fn step_starts(spans: &[(Track, RawSpan)]) -> Vec<f64> {
    let mut starts = Vec::new();
    let mut after_backward = true;
    for (_, s) in spans.iter().filter(|(t, _)| *t == Track::Compute) {
        match s.name.as_str() {
            "compute::forward" => {
                if after_backward {
                    starts.push(s.start_us);
                }
                after_backward = false;
            }
            "compute::backward" | "compute::expert_backward" => after_backward = true,
            _ => {}
        }
    }
    starts
}

/// `forward unit=3`, `htod bytes=884736`, `expert_forward block=0 expert=2 tokens=40`.
fn label(name: &str, args: &Map<String, Value>) -> String {
    let op = name.rsplit("::").next().unwrap_or(name);
    let mut out = op.to_string();
    for key in ["unit", "block", "expert", "tokens", "tensor", "bytes", "params"] {
        if let Some(v) = args.get(key) {
            let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
            out.push_str(&format!(" {key}={v}"));
        }
    }
    out
}

/// Merges intervals into disjoint, sorted ones.
fn union(mut iv: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    iv.retain(|(a, b)| b > a);
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(iv.len());
    for (a, b) in iv {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn length(iv: &[(f64, f64)]) -> f64 {
    iv.iter().map(|(a, b)| b - a).sum()
}

/// Length of the intersection of two disjoint, sorted interval lists.
fn intersection(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

impl Timeline {
    /// The busy intervals of `track` within `[lo, hi]` seconds, merged (disjoint, sorted).
    fn busy(&self, track: Track, lo: f64, hi: f64) -> Vec<(f64, f64)> {
        union(self.spans.iter().filter(|s| s.track == track).map(|s| (s.start_s.max(lo), s.end_s.min(hi))).collect())
    }

    /// Seconds `track` was busy within `[lo, hi]` seconds (overlapping spans counted once).
    pub fn busy_s(&self, track: Track, lo: f64, hi: f64) -> f64 {
        length(&self.busy(track, lo, hi))
    }

    /// The fraction (0–1) of `track`'s busy time within `[lo, hi]` seconds during which compute
    /// was busy too; `None` when `track` was idle.
    pub fn overlap_with_compute(&self, track: Track, lo: f64, hi: f64) -> Option<f64> {
        let t = self.busy(track, lo, hi);
        let busy = length(&t);
        (busy > 0.0).then(|| intersection(&t, &self.busy(Track::Compute, lo, hi)) / busy)
    }

    fn row(&self, step: Option<usize>, lo: f64, hi: f64, per: f64) -> TimelineRow {
        let ov = |t| self.overlap_with_compute(t, lo, hi);
        TimelineRow {
            step,
            start_s: lo,
            end_s: hi,
            step_s: (hi - lo) / per,
            compute_s: self.busy_s(Track::Compute, lo, hi) / per,
            h2d_s: self.busy_s(Track::H2D, lo, hi) / per,
            d2h_s: self.busy_s(Track::D2H, lo, hi) / per,
            nvme_s: self.busy_s(Track::NVMe, lo, hi) / per,
            optimizer_s: self.busy_s(Track::Optimizer, lo, hi) / per,
            h2d_overlap_compute: ov(Track::H2D),
            d2h_overlap_compute: ov(Track::D2H),
            nvme_overlap_compute: ov(Track::NVMe),
            optimizer_overlap_compute: ov(Track::Optimizer),
        }
    }

    /// All shown steps at once: busy seconds as means per step, overlap over their whole time.
    pub fn summary(&self) -> TimelineRow {
        let lo = self.steps.first().map_or(0.0, |s| s.0);
        let hi = self.steps.last().map_or(0.0, |s| s.1);
        self.row(None, lo, hi, self.steps.len().max(1) as f64)
    }

    /// One row per shown step, then [`Timeline::summary`] (`step: null`): the rows of
    /// `timeline.json`.
    pub fn rows(&self) -> Vec<TimelineRow> {
        let mut rows: Vec<TimelineRow> =
            self.steps.iter().enumerate().map(|(i, &(lo, hi))| self.row(Some(i), lo, hi, 1.0)).collect();
        rows.push(self.summary());
        rows
    }
}

/// Prints `timeline`'s rows as a table: busy milliseconds per lane and the overlap with compute.
pub fn print_table(timeline: &Timeline) {
    println!("{}", timeline.title);
    println!(
        "{:<6} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7}",
        "step", "step ms", "compute", "H2D", "D2H", "NVMe", "optim", "H2D ov", "D2H ov", "NVMe ov", "opt ov"
    );
    let pct = |f: Option<f64>| f.map_or("-".into(), |f| format!("{:.0}%", 100.0 * f));
    for r in timeline.rows() {
        println!(
            "{:<6} {:>9.1} {:>10.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>7} {:>7} {:>7} {:>7}",
            r.step.map_or("mean".into(), |s| s.to_string()),
            1e3 * r.step_s,
            1e3 * r.compute_s,
            1e3 * r.h2d_s,
            1e3 * r.d2h_s,
            1e3 * r.nvme_s,
            1e3 * r.optimizer_s,
            pct(r.h2d_overlap_compute),
            pct(r.d2h_overlap_compute),
            pct(r.nvme_overlap_compute),
            pct(r.optimizer_overlap_compute),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps starting at 0, 1000, 2000 and 3000 µs on the sim device, each (times from its start,
    /// µs): forward 0–100 and backward 100–300; H2D on the copy engine (tid 2) at 50–150 (under
    /// compute) and 400–600 (not); an htod of the issuing thread (tid 0, with `tensor`) at 10–900,
    /// which is not the link; two optimizer workers at 250–450 and 300–500; an NVMe read at
    /// 700–800. The last step has its compute only.
    fn trace() -> String {
        let mut ev = vec![
            r#"{"args":{"name":"main"},"name":"thread_name","ph":"M","pid":1,"tid":0}"#.to_string(),
            r#"{"args":{"name":"oogc-sim-htod"},"name":"thread_name","ph":"M","pid":1,"tid":2}"#.into(),
            r#"{"args":{"name":"oogc-opt-0"},"name":"thread_name","ph":"M","pid":1,"tid":5}"#.into(),
            r#"{"args":{"name":"oogc-opt-1"},"name":"thread_name","ph":"M","pid":1,"tid":6}"#.into(),
            r#"{"args":{"name":"oogc-uring"},"name":"thread_name","ph":"M","pid":1,"tid":1}"#.into(),
        ];
        let span = |name: &str, tid: u32, a: f64, b: f64, args: &str| {
            vec![
                format!(r#"{{"args":{{{args}}},"name":"{name}","ph":"B","pid":1,"tid":{tid},"ts":{a}}}"#),
                format!(r#"{{"args":{{{args}}},"name":"{name}","ph":"E","pid":1,"tid":{tid},"ts":{b}}}"#),
            ]
        };
        for k in 0..4 {
            let o = 1000.0 * k as f64;
            ev.extend(span("compute::forward", 0, o, o + 100.0, r#""unit":"0""#));
            ev.extend(span("compute::backward", 0, o + 100.0, o + 300.0, r#""unit":"0""#));
            if k < 3 {
                ev.extend(span("swapper::htod", 2, o + 50.0, o + 150.0, r#""bytes":"1000","tier":"device""#));
                ev.extend(span("swapper::htod", 2, o + 400.0, o + 600.0, r#""bytes":"2000","tier":"device""#));
                ev.extend(span("swapper::htod", 0, o + 10.0, o + 900.0, r#""bytes":"1000","tensor":"4""#));
                ev.extend(span("optimizer::update", 5, o + 250.0, o + 450.0, r#""unit":"0","params":"10""#));
                ev.extend(span("optimizer::speculate", 6, o + 300.0, o + 500.0, r#""unit":"0","params":"10""#));
                ev.extend(span("swapper::nvme_read", 1, o + 700.0, o + 800.0, r#""bytes":"4096","tensor":"1""#));
            }
        }
        // Tracing-chrome writes `[`, one event per line with a trailing comma, then `]`.
        format!("[\n{}\n]\n", ev.join(",\n"))
    }

    #[test]
    fn pairs_classifies_and_keeps_the_last_full_steps() {
        let tl = parse_str(&trace(), 2).unwrap();
        assert_eq!(tl.steps, vec![(0.0, 0.001), (0.001, 0.002)]);
        let count = |t: Track| tl.spans.iter().filter(|s| s.track == t).count();
        assert_eq!(count(Track::Compute), 4);
        assert_eq!(count(Track::H2D), 4, "the issuing thread's htod is not the link");
        assert_eq!(count(Track::D2H), 0);
        assert_eq!(count(Track::NVMe), 2);
        assert_eq!(count(Track::Optimizer), 4);
        let first = &tl.spans[0];
        assert_eq!(
            (first.track, first.name.as_str(), first.label.as_str()),
            (Track::Compute, "compute::forward", "forward unit=0")
        );
        assert!(tl.spans.iter().any(|s| s.label == "htod bytes=2000"), "{:?}", tl.spans);
        // All three: the window is clamped to the full steps there are.
        assert_eq!(parse_str(&trace(), 10).unwrap().steps.len(), 3);
    }

    #[test]
    fn busy_time_is_a_union_and_overlap_a_fraction_of_it() {
        let tl = parse_str(&trace(), 2).unwrap();
        let rows = tl.rows();
        assert_eq!(rows.len(), 3);
        let r = &rows[0];
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert_eq!(r.step, Some(0));
        assert!(close(r.step_s, 1e-3) && close(r.compute_s, 300e-6), "{r:?}");
        assert!(close(r.h2d_s, 300e-6), "{r:?}");
        // Two workers at 250–450 and 300–500: busy 250 µs, not 400.
        assert!(close(r.optimizer_s, 250e-6), "{r:?}");
        assert!(close(r.nvme_s, 100e-6), "{r:?}");
        // H2D: 100 of 300 µs under compute; optimizer: 50 of 250; NVMe: none; no D2H.
        assert!(close(r.h2d_overlap_compute.unwrap(), 1.0 / 3.0), "{r:?}");
        assert!(close(r.optimizer_overlap_compute.unwrap(), 0.2), "{r:?}");
        assert_eq!(r.nvme_overlap_compute, Some(0.0));
        assert_eq!(r.d2h_overlap_compute, None);
        let all = &rows[2];
        assert_eq!(all.step, None);
        assert!(close(all.step_s, 1e-3) && close(all.h2d_s, 300e-6), "{all:?}");
        assert!(close(all.h2d_overlap_compute.unwrap(), 1.0 / 3.0), "{all:?}");
        let json = serde_json::to_value(&rows).unwrap();
        assert!(json[2]["step"].is_null() && json[0]["d2h_overlap_compute"].is_null(), "{json}");
    }

    #[test]
    fn an_unterminated_trace_is_read_up_to_its_last_whole_event() {
        let full = trace();
        let body = full.trim_end().trim_end_matches(']').trim_end();
        // Without `]`, with a trailing comma, and with half an event after it.
        for cut in [body.to_string(), format!("{body},\n"), format!("{body},\n{{\"args\":{{\"na")] {
            let tl = parse_str(&cut, 2).unwrap();
            assert_eq!(tl.steps.len(), 2, "{cut:.40}");
        }
        // The last span is still open: it is dropped, the others stand.
        let open = full.trim_end().trim_end_matches(']').trim_end().rsplit_once(",\n").unwrap().0.to_string();
        let tl = parse_str(&open, 2).unwrap();
        assert_eq!(tl.steps.len(), 2);
    }

    #[test]
    fn the_copy_engine_fallback_takes_device_level_copies() {
        // No oogc-sim-* thread (CUDA): the htod without `tensor` is the device copy.
        let t = trace().replace("oogc-sim-htod", "copy");
        let tl = parse_str(&t, 1).unwrap();
        let h2d: Vec<&TrackSpan> = tl.spans.iter().filter(|s| s.track == Track::H2D).collect();
        assert_eq!(h2d.len(), 2);
        assert!(h2d.iter().all(|s| !s.label.contains("tensor")), "{h2d:?}");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse_str("{not json", 2).unwrap_err().to_string();
        assert!(e.contains("Chrome trace") && e.contains("[output] trace"), "{e}");
        let e = parse_str("[]", 2).unwrap_err().to_string();
        assert!(e.contains("0 step start(s)") && e.contains("at least 4"), "{e}");
    }

    #[test]
    fn union_merges_and_intersection_counts_once() {
        let u = union(vec![(3.0, 4.0), (0.0, 2.0), (1.0, 2.5), (5.0, 5.0)]);
        assert_eq!(u, vec![(0.0, 2.5), (3.0, 4.0)]);
        assert_eq!(length(&u), 3.5);
        assert_eq!(intersection(&u, &[(2.0, 3.5)]), 1.0);
    }

    #[test]
    fn the_config_copy_keeps_exact_sizes() {
        let text = r#"
[model]
d_model = 32
n_layer = 2
n_head = 2
[data]
path = "/data/x.txt"
[train]
batch_size = 2
seq_len = 8
steps = 10
[budgets]
gpu = 7654321
host = "1GiB"
optimizer_state = "nvme"
nvme_dirs = ["/tmp/nvme"]
"#;
        let cfg = TrainConfig::from_toml_str(text).unwrap();
        let copy = exact_toml(&cfg).unwrap();
        assert!(copy.contains("gpu = 7654321"), "{copy}");
        assert_eq!(TrainConfig::from_toml_str(&copy).unwrap(), cfg);
    }

    /// The child's plumbing with a stand-in binary: arguments, the config copy, the trace path,
    /// the error with the child's stderr, and the scratch directory removed.
    #[cfg(unix)]
    #[test]
    fn record_runs_the_binary_on_a_config_copy() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let nvme = tmp.path().join("nvme");
        let text = format!(
            "[model]\nd_model = 32\nn_layer = 2\nn_head = 2\n[data]\npath = \"/data/x.txt\"\n[train]\nbatch_size = 2\n\
             seq_len = 8\nsteps = 10\n[budgets]\ngpu = \"1MiB\"\nnvme_dirs = [\"{}\"]\n[checkpoint]\ndir = \"/nope\"\n",
            nvme.display()
        );
        let cfg = TrainConfig::from_toml_str(&text).unwrap();
        // Writes its arguments, creates the scratch directory as the store would, and writes
        // the trace named in the config.
        let bin = tmp.path().join("fake-oogc");
        std::fs::write(
            &bin,
            "#!/bin/sh\necho \"$@\" > \"$(dirname \"$3\")/args\"\n\
             mkdir -p \"$(sed -n 's/^nvme_dirs = \\[\"\\(.*\\)\"\\]$/\\1/p' \"$3\")\"\n\
             trace=$(sed -n 's/^trace = \"\\(.*\\)\"$/\\1/p' \"$3\")\n\
             [ -e \"$(dirname \"$3\")/fail\" ] && { echo 'line 1' >&2; echo 'the real reason' >&2; exit 3; }\n\
             echo '[]' > \"$trace\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = tmp.path().join("out");
        let trace = record_with(&bin, &cfg, 4, &out).unwrap();
        assert_eq!(trace, out.join(TRACE_FILE));
        assert!(trace.exists());
        let args = std::fs::read_to_string(out.join("args")).unwrap();
        assert_eq!(args.trim(), format!("train --config {} --steps 4 --no-progress", out.join(CONFIG_FILE).display()));
        let copy = TrainConfig::load(&out.join(CONFIG_FILE)).unwrap();
        assert_eq!(copy.output.trace.as_deref(), Some(trace.as_path()));
        assert_eq!((copy.checkpoint.dir, copy.output.metrics), (None, None));
        assert_eq!(copy.train.eval_interval, 0);
        assert!(copy.budgets.nvme_dirs[0].starts_with(&nvme) && copy.budgets.nvme_dirs[0] != nvme);
        assert!(!copy.budgets.nvme_dirs[0].exists(), "the scratch directory is removed");

        std::fs::write(out.join("fail"), "").unwrap();
        let e = record_with(&bin, &cfg, 4, &out).unwrap_err().report();
        assert!(e.contains("the real reason") && e.contains("--steps 4") && e.contains("failed"), "{e}");
    }
}
