//! `oogc bench nvme`: write then read N GiB through the NVMe store, per engine, beside `fio` in
//! the same run (the local limit: io_uring, O_DIRECT, 1 MiB blocks, queue depth 32).
//!
//! | row | what it measures |
//! |---|---|
//! | `store-uring`, `store-psync` | [`NvmeStore`] writing tensors of `tensor_bytes` from 2 MiB huge-page buffers, a few in flight, then reading and verifying them |
//! | `store-uring-steady`, `store-psync-steady` | the steady pattern of training: the same tensors rewritten every step — each pass reads every tensor and writes it to a new extent, freeing the old one (copy-on-write), reads and writes overlapping ([`STEADY_PASSES`] passes) |
//! | `fio-shmhuge` | `fio --ioengine=io_uring --direct=1 --iomem=shmhuge` (huge-page buffers) |
//! | `fio-malloc` | the same with fio's default malloc'd buffers (requests split: see `../shared/peers/README.md`) |
//! | `fio-overwrite` | fio's time-based overwrite of one file already written, reads and writes mixed 50/50 (`--rw=rw --time_based`; huge-page buffers, malloc'd where none are set aside): the reference for the steady rows (DESIGN.md: compare the same pattern; a first pass over a fresh file runs slower on ext4) |
//!
//! GB/s are 10⁹ bytes per second of wall time, from the first submission to the last completion
//! (steady rows: read and write GB/s over the same wall time).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use oogc_swapper::{EngineChoice, Extent, HostBuffer, NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig, TensorId};
use serde::Serialize;

use crate::error::{Context, Error, Result};

/// Arguments of the NVMe benchmark.
#[derive(Debug, Clone)]
pub struct NvmeBenchArgs {
    /// Directories of the store (the first also holds fio's file).
    pub dirs: Vec<PathBuf>,
    /// GiB written and read back per engine.
    pub size_gib: f64,
    /// Engines to measure (one store row each).
    pub engines: Vec<EngineChoice>,
    /// Bytes per I/O request (store and fio).
    pub block_bytes: usize,
    /// Requests in flight (store and fio).
    pub queue_depth: u32,
    /// Bytes per tensor written by the store (default 64 MiB).
    pub tensor_bytes: usize,
    /// Also run `fio` when it is on the PATH.
    pub fio: bool,
}

impl Default for NvmeBenchArgs {
    fn default() -> Self {
        Self {
            dirs: vec![std::env::temp_dir()],
            size_gib: 2.0,
            engines: vec![EngineChoice::Uring, EngineChoice::Psync],
            block_bytes: 1 << 20,
            queue_depth: 32,
            tensor_bytes: 64 << 20,
            fio: true,
        }
    }
}

/// One row of results.
#[derive(Debug, Clone, Serialize)]
pub struct NvmeBenchRow {
    /// `store-uring`, `store-psync`, `fio-shmhuge`, `fio-malloc`.
    pub engine: String,
    /// Write throughput, GB/s (10⁹ B/s); `None` when not measured.
    pub write_gbps: Option<f64>,
    /// Read throughput, GB/s (10⁹ B/s), checksums verified for the store; `None` when not measured.
    pub read_gbps: Option<f64>,
    /// Bytes per request.
    pub block_bytes: usize,
    /// Requests in flight.
    pub queue_depth: u32,
    /// Bytes written and read.
    pub bytes: u64,
    /// Anything the reader should know (fallbacks, why a row has no figures).
    pub note: String,
}

/// Passes of the steady rewrite (the rows `store-*-steady`).
pub const STEADY_PASSES: usize = 2;

/// Seconds of fio's time-based overwrite (`fio-overwrite`).
const FIO_OVERWRITE_S: u32 = 3;

/// Tensors in flight at once: enough to keep `queue_depth` blocks busy, at least 2.
fn in_flight(args: &NvmeBenchArgs) -> usize {
    let blocks_per_tensor = args.tensor_bytes.div_ceil(args.block_bytes).max(1);
    (args.queue_depth as usize).div_ceil(blocks_per_tensor).clamp(2, 8) + 1
}

/// Writes `n` tensors through `store` from the buffers in `bufs` (each submitted buffer is
/// reused once its write completes: `bufs.len()` tensors in flight), then reads every extent
/// back into the same buffers (checksums verified). Returns the extents and the write and read
/// wall times, seconds. `bufs` holds all its buffers again on return.
///
/// # Errors
/// The store's I/O or checksum errors.
///
/// # Panics
/// If `bufs` is empty.
pub fn write_then_read(store: &NvmeStore, bufs: &mut Vec<HostBuffer>, n: usize) -> Result<(Vec<Extent>, f64, f64)> {
    assert!(!bufs.is_empty(), "write_then_read needs at least one buffer");
    let mut extents = Vec::with_capacity(n);
    let mut pending = VecDeque::new();
    let t = Instant::now();
    for i in 0..n {
        let buf = match bufs.pop() {
            Some(b) => b,
            None => {
                let (r, b) = pending.pop_front().map(|h: oogc_swapper::IoHandle<_>| h.wait()).expect("in flight");
                extents.push(r?);
                b
            }
        };
        pending.push_back(store.write(TensorId(i as u64), buf));
    }
    while let Some(h) = pending.pop_front() {
        let (r, b) = h.wait();
        extents.push(r?);
        bufs.push(b);
    }
    let write_s = t.elapsed().as_secs_f64();

    let mut pending = VecDeque::new();
    let t = Instant::now();
    for ext in &extents {
        let buf = match bufs.pop() {
            Some(b) => b,
            None => {
                let (r, b) = pending.pop_front().map(|h: oogc_swapper::IoHandle<()>| h.wait()).expect("in flight");
                r?;
                b
            }
        };
        pending.push_back(store.read(ext, buf));
    }
    while let Some(h) = pending.pop_front() {
        let (r, b) = h.wait();
        r?;
        bufs.push(b);
    }
    Ok((extents, write_s, t.elapsed().as_secs_f64()))
}

/// One pass of training's steady pattern over `extents`: every tensor read into a buffer of
/// `bufs` (two reads in flight) and written back to a new extent, the old one freed once the
/// write completed (copy-on-write), writes overlapping the next reads. Returns the new extents,
/// in order; `bufs` holds all its buffers again on return.
///
/// # Errors
/// The store's I/O, checksum or space errors.
///
/// # Panics
/// If `bufs` holds fewer than three buffers.
pub fn rewrite_pass(store: &NvmeStore, bufs: &mut Vec<HostBuffer>, extents: Vec<Extent>) -> Result<Vec<Extent>> {
    assert!(bufs.len() >= 3, "a rewrite pass needs at least three buffers");
    let mut out: Vec<Option<Extent>> = (0..extents.len()).map(|_| None).collect();
    let mut reads = VecDeque::new();
    let mut writes: VecDeque<(usize, Extent, oogc_swapper::IoHandle<Extent>)> = VecDeque::new();
    let mut next = extents.into_iter().enumerate();
    let finish_write = |writes: &mut VecDeque<(usize, Extent, oogc_swapper::IoHandle<Extent>)>,
                        out: &mut Vec<Option<Extent>>|
     -> Result<HostBuffer> {
        let (i, old, h) = writes.pop_front().expect("a write in flight");
        let (r, buf) = h.wait();
        out[i] = Some(r?);
        store.free(old);
        Ok(buf)
    };
    loop {
        while reads.len() < 2 {
            let Some((i, e)) = next.next() else { break };
            let buf = match bufs.pop() {
                Some(b) => b,
                None => finish_write(&mut writes, &mut out)?,
            };
            let h = store.read(&e, buf);
            reads.push_back((i, e, h));
        }
        let Some((i, e, h)) = reads.pop_front() else { break };
        let (r, buf) = h.wait();
        r?;
        writes.push_back((i, e, store.write(TensorId(i as u64), buf)));
    }
    while !writes.is_empty() {
        let b = finish_write(&mut writes, &mut out)?;
        bufs.push(b);
    }
    Ok(out.into_iter().map(|e| e.expect("every tensor rewritten")).collect())
}

fn store_row(args: &NvmeBenchArgs, engine: EngineChoice) -> Result<Vec<NvmeBenchRow>> {
    let total = (args.size_gib * (1u64 << 30) as f64) as u64;
    let n = (total / args.tensor_bytes as u64).max(1) as usize;
    let bytes = n as u64 * args.tensor_bytes as u64;
    let k = in_flight(args).max(3);
    // Copy-on-write room for the steady passes: the writes in flight hold new extents beside
    // the old ones.
    let slack = (k as u64 + 1) * args.tensor_bytes as u64 + (args.dirs.len() as u64) * (4 << 20);
    let cfg = NvmeConfig {
        block_bytes: args.block_bytes,
        queue_depth: args.queue_depth,
        engine,
        ..NvmeConfig::new(args.dirs.clone(), bytes + slack)
    };
    let store = NvmeStore::open(cfg)?;
    let pool = PinnedPool::with_mmap(&PinnedPoolConfig {
        budget_bytes: ((k + 1) * oogc_swapper::host::size_class(args.tensor_bytes)) as u64,
        lock: false,
    });
    let mut bufs: Vec<_> = (0..k).map(|_| pool.alloc(args.tensor_bytes)).collect::<Result<_, _>>()?;
    for (i, b) in bufs.iter_mut().enumerate() {
        for (j, chunk) in b.as_mut_slice().chunks_mut(4096).enumerate() {
            chunk.fill((i * 31 + j) as u8);
        }
    }

    let (extents, write_s, read_s) = write_then_read(&store, &mut bufs, n)?;
    let kind = store.engine_kind();
    let direct = store.direct_io().iter().all(|&d| d);
    let note = format!(
        "{n} tensors of {} B, {k} in flight, huge-page buffers{}{}",
        args.tensor_bytes,
        if direct { "" } else { ", buffered I/O (O_DIRECT refused)" },
        if engine == EngineChoice::Auto { format!(", auto chose {kind}") } else { String::new() },
    );
    let t = std::time::Instant::now();
    let mut extents = extents;
    for _ in 0..STEADY_PASSES {
        extents = rewrite_pass(&store, &mut bufs, extents)?;
    }
    let steady_s = t.elapsed().as_secs_f64();
    let steady_bytes = bytes * STEADY_PASSES as u64;
    for e in extents {
        store.free(e);
    }
    let row = |engine: String, write_gbps: f64, read_gbps: f64, bytes: u64, note: String| NvmeBenchRow {
        engine,
        write_gbps: Some(write_gbps),
        read_gbps: Some(read_gbps),
        block_bytes: args.block_bytes,
        queue_depth: args.queue_depth,
        bytes,
        note,
    };
    let steady_gbps = steady_bytes as f64 / steady_s * 1e-9;
    Ok(vec![
        row(format!("store-{kind}"), bytes as f64 / write_s * 1e-9, bytes as f64 / read_s * 1e-9, bytes, note),
        row(
            format!("store-{kind}-steady"),
            steady_gbps,
            steady_gbps,
            steady_bytes,
            format!(
                "{STEADY_PASSES} passes: each tensor read and rewritten to a new extent (copy-on-write), as training's \
                 state every step; read and write overlap"
            ),
        ),
    ])
}

/// Runs fio on `file` (`bytes` long) with the store's block size and queue depth, io_uring and
/// O_DIRECT, `pattern`'s arguments (`--rw=...` and the like) and `iomem` buffers (fio's default
/// when `None`); returns its JSON report. `what` names the run in errors.
fn fio_json(
    file: &Path,
    pattern: &[String],
    bytes: u64,
    args: &NvmeBenchArgs,
    iomem: Option<&str>,
    what: &str,
) -> Result<serde_json::Value> {
    let mut cmd = Command::new("fio");
    cmd.arg("--name=oogc")
        .arg(format!("--filename={}", file.display()))
        .args(pattern)
        .arg(format!("--size={bytes}"))
        .arg(format!("--bs={}", args.block_bytes))
        .arg(format!("--iodepth={}", args.queue_depth))
        .args(["--ioengine=io_uring", "--direct=1", "--numjobs=1", "--output-format=json"]);
    if let Some(m) = iomem {
        cmd.arg(format!("--iomem={m}"));
    }
    let out = cmd.output().map_err(Error::FioStart)?;
    if !out.status.success() {
        let reason = format!("fio {what} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        return Err(Error::Fio { reason });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON object.
    let start = text.find('{').ok_or_else(|| Error::Fio { reason: "no JSON in fio's output".into() })?;
    serde_json::from_str(&text[start..]).map_err(|source| Error::Json { what: "parsing fio's JSON".into(), source })
}

/// Bytes per second of the `rw` direction (`write` or `read`) in fio's JSON report.
fn fio_bw(report: &serde_json::Value, rw: &str) -> Result<f64> {
    report["jobs"][0][rw]["bw_bytes"].as_f64().ok_or_else(|| Error::Fio { reason: "no bw_bytes in fio's JSON".into() })
}

/// Runs fio once for `rw` (`write` or `read`); returns bytes per second.
fn fio_once(file: &Path, rw: &str, bytes: u64, args: &NvmeBenchArgs, iomem: Option<&str>) -> Result<f64> {
    let report = fio_json(file, &[format!("--rw={rw}")], bytes, args, iomem, rw)?;
    fio_bw(&report, rw)
}

/// fio's time-based overwrite of `file` (already `bytes` long): reads and writes mixed 50/50
/// for [`FIO_OVERWRITE_S`] seconds, with `iomem` buffers (fio's default when `None`); returns
/// (write, read) bytes per second.
fn fio_overwrite(file: &Path, bytes: u64, args: &NvmeBenchArgs, iomem: Option<&str>) -> Result<(f64, f64)> {
    let pattern =
        ["--rw=rw".to_string(), "--rwmixread=50".into(), "--time_based".into(), format!("--runtime={FIO_OVERWRITE_S}")];
    let report = fio_json(file, &pattern, bytes, args, iomem, "overwrite")?;
    Ok((fio_bw(&report, "write")?, fio_bw(&report, "read")?))
}

fn fio_rows(args: &NvmeBenchArgs, bytes: u64) -> Vec<NvmeBenchRow> {
    let row = |engine: &str, w: Option<f64>, r: Option<f64>, note: String| NvmeBenchRow {
        engine: engine.into(),
        write_gbps: w,
        read_gbps: r,
        block_bytes: args.block_bytes,
        queue_depth: args.queue_depth,
        bytes,
        note,
    };
    if Command::new("fio").arg("--version").output().is_err() {
        return vec![row(
            "fio",
            None,
            None,
            "fio is not on the PATH; no reference figures (apt-get install fio)".into(),
        )];
    }
    let dir = args.dirs.first().cloned().unwrap_or_else(std::env::temp_dir);
    let file = dir.join(format!("oogc-fio-{}.dat", std::process::id()));
    let mut rows = Vec::new();
    for (name, iomem) in [("fio-shmhuge", Some("shmhuge")), ("fio-malloc", None)] {
        let w = fio_once(&file, "write", bytes, args, iomem);
        let r = w.as_ref().ok().map(|_| fio_once(&file, "read", bytes, args, iomem));
        let note = match (&w, &r) {
            (Ok(_), Some(Ok(_))) => "fio io_uring direct=1".to_string(),
            (Err(e), _) | (_, Some(Err(e))) => format!("fio failed: {}", e.report()),
            _ => String::new(),
        };
        let gbps = |x: f64| x * 1e-9;
        rows.push(row(name, w.ok().map(gbps), r.and_then(Result::ok).map(gbps), note));
    }
    // The file is written: fio's time-based overwrite of it, the steady rows' reference (huge-page
    // buffers, else malloc'd ones where no hugetlb pages are set aside).
    let overwrite = fio_overwrite(&file, bytes, args, Some("shmhuge"))
        .map(|x| (x, "shmhuge"))
        .or_else(|e| fio_overwrite(&file, bytes, args, None).map(|x| (x, "malloc")).map_err(|_| e));
    rows.push(match overwrite {
        Ok(((w, r), mem)) => row(
            "fio-overwrite",
            Some(w * 1e-9),
            Some(r * 1e-9),
            format!("fio io_uring direct=1 {mem} buffers, --rw=rw --time_based --runtime={FIO_OVERWRITE_S}"),
        ),
        Err(e) => row("fio-overwrite", None, None, format!("fio failed: {}", e.report())),
    });
    let _ = std::fs::remove_file(&file);
    rows
}

/// Runs the benchmark: one row per engine, then fio's rows when `args.fio`.
///
/// # Errors
/// The store could not be opened (bad directory, no space, io_uring refused for `Uring`), a
/// buffer could not be allocated, or an I/O failed.
pub fn run(args: &NvmeBenchArgs) -> Result<Vec<NvmeBenchRow>> {
    if args.tensor_bytes == 0 || args.size_gib <= 0.0 {
        return Err(Error::invalid("tensor_bytes and size_gib", "must be positive"));
    }
    let mut rows = Vec::new();
    for &engine in &args.engines {
        rows.extend(store_row(args, engine).with_context(|| format!("store with engine {engine:?}"))?);
    }
    if args.fio {
        let bytes = rows.first().map_or((args.size_gib * (1u64 << 30) as f64) as u64, |r| r.bytes);
        rows.extend(fio_rows(args, bytes));
    }
    Ok(rows)
}

/// Prints the rows as a table for humans, with each store row's ratio to `fio-shmhuge` (a
/// steady row's to `fio-overwrite`, the same pattern).
pub fn print_table(rows: &[NvmeBenchRow]) {
    let fio_first = rows.iter().find(|r| r.engine == "fio-shmhuge");
    let fio_steady = rows.iter().find(|r| r.engine == "fio-overwrite");
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    println!(
        "{:<12} {:>10} {:>10} {:>8} {:>8} {:>9} {:>4}  note",
        "engine", "write GB/s", "read GB/s", "w/fio", "r/fio", "block", "qd"
    );
    for r in rows {
        let fio = if r.engine.ends_with("-steady") { fio_steady } else { fio_first };
        println!(
            "{:<12} {:>10} {:>10} {:>8} {:>8} {:>9} {:>4}  {}",
            r.engine,
            f(r.write_gbps),
            f(r.read_gbps),
            ratio(r.write_gbps, fio.and_then(|x| x.write_gbps)),
            ratio(r.read_gbps, fio.and_then(|x| x.read_gbps)),
            r.block_bytes,
            r.queue_depth,
            r.note
        );
    }
}
