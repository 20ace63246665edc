//! `oogc bench swap`: host↔device copies through the swapper on the sim device, each row beside a
//! limit measured (or set) in the same run, so the table shows the swapper's overhead as a ratio.
//!
//! | row | what it measures | `limit_gbps` |
//! |---|---|---|
//! | `sim-htod`, `sim-dtoh` | [`SimDevice`] copies of one pinned [`HostBuffer`] of `size_bytes`, unthrottled, one at a time | the best single `copy_from_slice` of the same size between pinned and heap memory, this run |
//! | `sim-htod-throttled`, `sim-dtoh-throttled` | the same with the link throttled to `link_gbps` (only when given) | `link_gbps`, or memcpy where that is lower |
//! | `residency-htod` | [`ResidencyManager`]: `tensors` host-homed tensors, a device budget of half of them, acquired on the device in order (LRU evicts each before its next use) | the `sim-htod` row's GB/s |
//! | `residency-htod-throttled` | the same on the throttled device (only when `link_gbps` is given) | `link_gbps`, or the `sim-htod` row's GB/s where that is lower |
//! | `cuda-htod`, `cuda-dtoh` | [`run_cuda`] only: the swapper's [`CudaDevice`](oogc_swapper::CudaDevice) copies (`Device::htod`/`dtoh` on its copy stream, each timed to its `Transfer::wait`) of one driver-pinned [`HostBuffer`] of `size_bytes`, one at a time | `cudaMemcpyAsync`: the best of two runs (before and after the swapper's) of a plain async copy of the same size between another driver-pinned buffer and a `CudaSlice`, on a stream of its own through cudarc, each copy followed by a stream synchronize |
//!
//! GB/s are 10⁹ bytes per second of wall time, from the first submission to the last completion;
//! one warm-up copy (page faults of fresh device memory) precedes each timed loop.

use std::time::Instant;

use oogc_swapper::host::size_class;
use oogc_swapper::{
    Access, DType, Device, DeviceBuffer, HostBuffer, LruPolicy, PinnedPool, PinnedPoolConfig, ResidencyConfig,
    ResidencyManager, SimDevice, SimDeviceConfig, TensorId, TensorMeta, Tier,
};
#[cfg(feature = "cuda")]
use oogc_swapper::{CudaDevice, DeviceBackend};
use serde::Serialize;

use crate::error::{Context, Error, Result};

/// Arguments of the swap benchmark.
#[derive(Debug, Clone)]
pub struct SwapBenchArgs {
    /// Bytes per raw copy, and the total bytes of the residency manager's tensors. Default: 256 MiB.
    pub size_bytes: usize,
    /// Link throttle in GB/s (10⁹ B/s) for the `*-throttled` rows; `None` skips them. Default: `None`.
    pub link_gbps: Option<f64>,
    /// Timed copies per raw row, and timed passes over all tensors for the residency rows. Default: 8.
    pub repeats: usize,
    /// Tensors registered with the residency manager (each `size_bytes / tensors` bytes); the
    /// device budget holds half of them. Default: 16.
    pub tensors: usize,
    /// Page-lock host buffers with `mlock` (falls back to unlocked memory with a warning). Default: true.
    pub lock: bool,
}

impl Default for SwapBenchArgs {
    fn default() -> Self {
        Self { size_bytes: 256 << 20, link_gbps: None, repeats: 8, tensors: 16, lock: true }
    }
}

/// The device a benchmark measures: the sim device (its compute: candle on the CPU), or CUDA GPU
/// `N`. Parsed from `sim` (or `cpu`), `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BenchDevice {
    /// The sim device (host memory, copy-engine threads; compute on the CPU).
    #[default]
    Sim,
    /// CUDA GPU of this ordinal (needs the `cuda` feature).
    Cuda(usize),
}

impl std::str::FromStr for BenchDevice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sim" | "cpu" => Ok(Self::Sim),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("`{s}`: expected sim, cpu, cuda or cuda:N (N a GPU ordinal)")),
        }
    }
}

impl std::fmt::Display for BenchDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sim => f.write_str("sim"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// One row of results.
#[derive(Debug, Clone, Serialize)]
pub struct SwapBenchRow {
    /// `sim-htod`, `sim-dtoh`, `sim-htod-throttled`, `sim-dtoh-throttled`, `residency-htod`,
    /// `residency-htod-throttled`; `cuda-htod`, `cuda-dtoh` ([`run_cuda`]).
    pub name: String,
    /// Bytes copied in the timed part.
    pub bytes: u64,
    /// Throughput, GB/s (10⁹ B/s) of wall time.
    pub gbps: f64,
    /// Copies (raw rows) or acquires (residency rows) timed.
    pub ops: u64,
    /// The row's limit, GB/s (10⁹ B/s): measured in this run or the throttle (see `limit`).
    pub limit_gbps: f64,
    /// What `limit_gbps` is: `memcpy`, `link throttle`, `sim-htod`, `cudaMemcpyAsync`.
    pub limit: String,
    /// Evictions during the timed part (residency rows only).
    pub evictions: Option<u64>,
    /// Seconds the caller was blocked in `acquire` waiting for bytes (residency rows only).
    pub stall_s: Option<f64>,
    /// Anything the reader should know (page-locking, tensor sizes).
    pub note: String,
}

impl SwapBenchRow {
    /// `gbps / limit_gbps` (1.0 = at the limit); `None` when the limit is not positive.
    pub fn ratio(&self) -> Option<f64> {
        (self.limit_gbps > 0.0).then(|| self.gbps / self.limit_gbps)
    }
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) * 1e-9
}

fn sim_device(capacity_bytes: u64, link_gbps: Option<f64>) -> Result<Device> {
    let dev = SimDevice::new(SimDeviceConfig { capacity_bytes, link_gbps, ..SimDeviceConfig::default() })
        .context("starting the sim device (check --link-gbps)")?;
    Ok(Device::Sim(dev))
}

fn lock_note(buf: &HostBuffer) -> &'static str {
    if buf.is_page_locked() {
        "page-locked host buffer"
    } else {
        "host buffer not page-locked (mlock refused; raise `ulimit -l`)"
    }
}

/// The memcpy limit: the best GB/s of one `copy_from_slice` of `size_bytes` between a pinned
/// buffer and plain heap memory (what sim device memory is), either way, over `repeats` copies
/// per direction after a warm-up. The best single copy, not the mean, so that noise does not
/// push the limit below the rows measured against it.
fn memcpy_gbps(pool: &PinnedPool, args: &SwapBenchArgs) -> Result<f64> {
    let n = args.size_bytes;
    let mut host = pool.alloc(n).context("allocating the memcpy buffer")?;
    let mut heap = vec![0u8; n];
    heap.copy_from_slice(host.as_slice()); // warm-up: faults in the heap pages
    let mut best_s = f64::INFINITY;
    for _ in 0..args.repeats {
        let t = Instant::now();
        heap.copy_from_slice(std::hint::black_box(host.as_slice()));
        std::hint::black_box(&heap);
        best_s = best_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        host.as_mut_slice().copy_from_slice(std::hint::black_box(&heap));
        std::hint::black_box(host.as_slice());
        best_s = best_s.min(t.elapsed().as_secs_f64());
    }
    Ok(gbps(n as u64, best_s))
}

/// The `sim-htod` and `sim-dtoh` rows on a device throttled to `link_gbps` (or not).
fn raw_rows(pool: &PinnedPool, args: &SwapBenchArgs, link_gbps: Option<f64>) -> Result<[SwapBenchRow; 2]> {
    let n = args.size_bytes;
    let dev = sim_device(n as u64, link_gbps)?;
    let mut host = pool.alloc(n).context("allocating the pinned host buffer")?;
    for (i, chunk) in host.as_mut_slice().chunks_mut(4096).enumerate() {
        chunk.fill(i as u8);
    }
    let note = format!("{n} B per copy, {}", lock_note(&host));
    let dbuf = dev.alloc(n).context("allocating sim device memory")?;
    let (htod_s, dtoh_s) = time_copies(&dev, host, dbuf, args.repeats)?;

    let bytes = (n * args.repeats) as u64;
    let suffix = if link_gbps.is_some() { "-throttled" } else { "" };
    let row = |dir: &str, secs: f64| SwapBenchRow {
        name: format!("sim-{dir}{suffix}"),
        bytes,
        gbps: gbps(bytes, secs),
        ops: args.repeats as u64,
        limit_gbps: 0.0, // set by `run`
        limit: String::new(),
        evictions: None,
        stall_s: None,
        note: note.clone(),
    };
    Ok([row("htod", htod_s), row("dtoh", dtoh_s)])
}

/// Seconds of `repeats` H2D copies of `host` into `dbuf`, then of `repeats` D2H copies back, one
/// at a time (each waited for), after one warm-up H2D (page faults of fresh device memory).
fn time_copies(dev: &Device, mut host: HostBuffer, mut dbuf: DeviceBuffer, repeats: usize) -> Result<(f64, f64)> {
    (host, dbuf) = dev.htod(host, dbuf)?.wait().context("warm-up H2D copy")?;
    let t = Instant::now();
    for _ in 0..repeats {
        (host, dbuf) = dev.htod(host, dbuf)?.wait().context("H2D copy")?;
    }
    let htod_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..repeats {
        (host, dbuf) = dev.dtoh(dbuf, host)?.wait().context("D2H copy")?;
    }
    let dtoh_s = t.elapsed().as_secs_f64();
    dev.synchronize()?;
    drop((host, dbuf));
    Ok((htod_s, dtoh_s))
}

/// The residency row: `args.tensors` host-homed tensors cycled through a device budget of half.
fn residency_row(args: &SwapBenchArgs, link_gbps: Option<f64>) -> Result<SwapBenchRow> {
    let k = args.tensors;
    let t_bytes = args.size_bytes / k;
    let on_device = (k / 2).max(1);
    let device_budget = (on_device * t_bytes) as u64;
    let dev = sim_device(device_budget, link_gbps)?;
    let cfg = ResidencyConfig {
        device_budget_bytes: Some(device_budget),
        host_budget_bytes: ((k + 2) * size_class(t_bytes)) as u64,
        lock_host_memory: args.lock,
        prefetch_threads: 1,
        ..ResidencyConfig::default()
    };
    let mgr = ResidencyManager::new(dev, None, cfg, Box::new(LruPolicy)).context("starting the residency manager")?;
    let data: Vec<u8> = (0..t_bytes).map(|i| (i / 4096) as u8).collect();
    for i in 0..k {
        let meta = TensorMeta::new(TensorId(i as u64), format!("bench.{i}"), &[t_bytes], DType::U8, Tier::Host);
        mgr.register(meta, &data).with_context(|| format!("registering tensor {i} of {t_bytes} bytes"))?;
    }
    let pass = |mgr: &ResidencyManager| -> Result<()> {
        for i in 0..k {
            let g = mgr.acquire(TensorId(i as u64), Tier::Device, Access::Read);
            drop(g.with_context(|| format!("acquiring tensor {i} on the device"))?);
        }
        Ok(())
    };
    pass(&mgr)?; // warm-up: first fetches and device page faults
    let before = mgr.metrics();
    let t = Instant::now();
    for _ in 0..args.repeats {
        pass(&mgr)?;
    }
    let wall_s = t.elapsed().as_secs_f64();
    let after = mgr.metrics();
    mgr.check_invariants().context("residency bookkeeping after the benchmark")?;
    let bytes = after.htod.bytes - before.htod.bytes;
    let unpinned = after.unpinned_host_bytes > 0;
    Ok(SwapBenchRow {
        name: if link_gbps.is_some() { "residency-htod-throttled".into() } else { "residency-htod".into() },
        bytes,
        gbps: gbps(bytes, wall_s),
        ops: (k * args.repeats) as u64,
        limit_gbps: 0.0, // set by `run`
        limit: String::new(),
        evictions: Some(after.evictions - before.evictions),
        stall_s: Some(after.stall_s - before.stall_s),
        note: format!(
            "{k} tensors of {t_bytes} B, device budget {on_device} of them, lru, {}",
            if unpinned { "host memory not page-locked (mlock refused)" } else { "page-locked host memory" }
        ),
    })
}

/// Sets the row's limit: `measured` (GB/s, name), or the link throttle when that is lower (a
/// throttle above what the copy itself reaches does not bind).
fn with_limit(mut row: SwapBenchRow, measured: (f64, &str), link_gbps: Option<f64>) -> SwapBenchRow {
    let (gbps, name) = match link_gbps {
        Some(g) if g < measured.0 => (g, "link throttle"),
        _ => measured,
    };
    row.limit_gbps = gbps;
    row.limit = name.into();
    row
}

/// Runs the benchmark: the raw sim rows, the throttled rows when `link_gbps` is given, then the
/// residency rows.
///
/// # Errors
/// `size_bytes`, `repeats` or `tensors` is zero, or `size_bytes / tensors` is zero; `link_gbps`
/// is not a positive number (the sim device's config error names the key); host memory could
/// not be allocated; a copy or an acquire failed.
pub fn run(args: &SwapBenchArgs) -> Result<Vec<SwapBenchRow>> {
    if args.size_bytes == 0 || args.repeats == 0 || args.tensors == 0 {
        return Err(Error::invalid("size_bytes, repeats and tensors", "must be positive"));
    }
    if args.size_bytes / args.tensors == 0 {
        let what = format!("size_bytes ({})", args.size_bytes);
        return Err(Error::invalid(what, format!("must be at least tensors ({}) bytes", args.tensors)));
    }
    // One buffer for memcpy, one for the copies (a freed buffer is reused by size class).
    let pool = PinnedPool::with_mmap(&PinnedPoolConfig {
        budget_bytes: 3 * size_class(args.size_bytes) as u64,
        lock: args.lock,
    });
    let memcpy = memcpy_gbps(&pool, args).context("measuring the memcpy limit")?;
    let mut rows = Vec::new();
    let raw = raw_rows(&pool, args, None).context("unthrottled sim copies")?;
    let sim_htod = raw[0].gbps;
    rows.extend(raw.map(|r| with_limit(r, (memcpy, "memcpy"), None)));
    if let Some(g) = args.link_gbps {
        let raw = raw_rows(&pool, args, Some(g)).with_context(|| format!("sim copies throttled to {g} GB/s"))?;
        rows.extend(raw.map(|r| with_limit(r, (memcpy, "memcpy"), Some(g))));
    }
    drop(pool);
    let row = residency_row(args, None).context("residency manager, unthrottled")?;
    rows.push(with_limit(row, (sim_htod, "sim-htod"), None));
    if let Some(g) = args.link_gbps {
        let row = residency_row(args, Some(g)).with_context(|| format!("residency manager, throttled to {g} GB/s"))?;
        rows.push(with_limit(row, (sim_htod, "sim-htod"), Some(g)));
    }
    Ok(rows)
}

/// Runs the CUDA rows on GPU `ordinal`: `cuda-htod` and `cuda-dtoh`, the swapper's copies beside
/// a plain pinned async copy of the same size in the same run (`limit` `cudaMemcpyAsync`). Uses
/// `size_bytes` and `repeats` (`link_gbps`, `tensors` and `lock` do not apply: the host buffers
/// are driver-pinned).
///
/// # Errors
/// `size_bytes` or `repeats` is zero; [`oogc_swapper::Error::NotCompiledWithCuda`] when built
/// without the `cuda` feature; [`oogc_swapper::Error::NoCudaDevice`] when there is no driver or
/// no GPU `ordinal`; device or pinned memory could not be allocated; a copy failed.
pub fn run_cuda(ordinal: usize, args: &SwapBenchArgs) -> Result<Vec<SwapBenchRow>> {
    if args.size_bytes == 0 || args.repeats == 0 {
        return Err(Error::invalid("size_bytes and repeats", "must be positive"));
    }
    #[cfg(feature = "cuda")]
    {
        let dev = CudaDevice::new(ordinal, None).with_context(|| format!("opening cuda:{ordinal}"))?;
        cuda_rows(dev, args)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(oogc_swapper::Error::NotCompiledWithCuda).with_context(|| format!("opening cuda:{ordinal}"))
    }
}

/// A cudarc driver error as the swapper's [`oogc_swapper::Error::Cuda`] (bench names no cudarc
/// type: the calls go through the swapper's context).
#[cfg(feature = "cuda")]
fn cuda_err<E: std::fmt::Display>(op: &'static str) -> impl FnOnce(E) -> Error {
    move |e| oogc_swapper::Error::Cuda { op, message: e.to_string() }.into()
}

#[cfg(feature = "cuda")]
fn cuda_rows(dev: CudaDevice, args: &SwapBenchArgs) -> Result<Vec<SwapBenchRow>> {
    let n = args.size_bytes;
    let pinned = dev.host_allocator(true);
    let pinned_buffer = |what: &'static str| -> Result<HostBuffer> {
        let mem = pinned.allocate(n).map_err(|source| Error::Mmap { bytes: n, source }).context(what)?;
        Ok(HostBuffer::unpooled(mem, n))
    };
    let name = dev.name();

    // The baseline: cudarc's async copies on a stream of their own, between driver-pinned host
    // memory and a plain `CudaSlice`, each followed by a stream synchronize (as each of the
    // swapper's copies is waited for).
    let stream = dev.context().new_stream().map_err(cuda_err("creating the baseline stream"))?;
    let mut base_host = pinned_buffer("allocating the baseline's pinned host buffer")?;
    for (i, chunk) in base_host.as_mut_slice().chunks_mut(4096).enumerate() {
        chunk.fill(i as u8);
    }
    let mut base_dev = stream.alloc_zeros::<u8>(n).map_err(cuda_err("allocating the baseline's device memory"))?;
    let mut baseline = || -> Result<(f64, f64)> {
        stream.memcpy_htod(base_host.as_slice(), &mut base_dev).map_err(cuda_err("baseline warm-up H2D"))?;
        stream.synchronize().map_err(cuda_err("baseline synchronize"))?;
        let t = Instant::now();
        for _ in 0..args.repeats {
            stream.memcpy_htod(base_host.as_slice(), &mut base_dev).map_err(cuda_err("baseline H2D"))?;
            stream.synchronize().map_err(cuda_err("baseline synchronize"))?;
        }
        let htod_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..args.repeats {
            stream.memcpy_dtoh(&base_dev, base_host.as_mut_slice()).map_err(cuda_err("baseline D2H"))?;
            stream.synchronize().map_err(cuda_err("baseline synchronize"))?;
        }
        Ok((htod_s, t.elapsed().as_secs_f64()))
    };
    let before = baseline().context("the cudaMemcpyAsync baseline, before")?;

    // The swapper's copies: `Device::htod`/`dtoh` on its copy stream, each waited for.
    let mut host = pinned_buffer("allocating the swapper's pinned host buffer")?;
    for (i, chunk) in host.as_mut_slice().chunks_mut(4096).enumerate() {
        chunk.fill(i as u8);
    }
    let note = format!("{n} B per copy, {name}, {}", lock_note(&host));
    let dev = Device::Cuda(dev);
    let dbuf = dev.alloc(n).context("allocating CUDA device memory")?;
    let (htod_s, dtoh_s) = time_copies(&dev, host, dbuf, args.repeats).context("the swapper's copies")?;

    let after = baseline().context("the cudaMemcpyAsync baseline, after")?;
    let bytes = (n * args.repeats) as u64;
    let row = |dir: &str, secs: f64, base_s: f64| SwapBenchRow {
        name: format!("cuda-{dir}"),
        bytes,
        gbps: gbps(bytes, secs),
        ops: args.repeats as u64,
        limit_gbps: gbps(bytes, base_s),
        limit: "cudaMemcpyAsync".into(),
        evictions: None,
        stall_s: None,
        note: note.clone(),
    };
    Ok(vec![row("htod", htod_s, before.0.min(after.0)), row("dtoh", dtoh_s, before.1.min(after.1))])
}

/// Prints the rows as a table for humans, with each row's ratio to its limit.
pub fn print_table(rows: &[SwapBenchRow]) {
    let opt = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    println!(
        "{:<25} {:>8} {:>10} {:>7} {:>13} {:>10} {:>9} {:>5}  note",
        "row", "GB/s", "limit GB/s", "ratio", "limit", "evictions", "stall s", "ops"
    );
    for r in rows {
        println!(
            "{:<25} {:>8.2} {:>10.2} {:>7} {:>13} {:>10} {:>9} {:>5}  {}",
            r.name,
            r.gbps,
            r.limit_gbps,
            opt(r.ratio().map(|x| format!("{x:.2}"))),
            r.limit,
            opt(r.evictions.map(|e| e.to_string())),
            opt(r.stall_s.map(|s| format!("{s:.4}"))),
            r.ops,
            r.note
        );
    }
}
