//! `oogc bench adam`: the CPU AdamW step of `oogc-optimizer` on one flat tensor, beside a STREAM
//! triad measured in the same process with the same thread count (the memory-bandwidth limit).
//!
//! | column | what it is |
//! |---|---|
//! | `seconds_per_step` | median wall time of `steps` timed steps (after one untimed warm-up that also faults the pages in) |
//! | `params_per_s` | `params / seconds_per_step` |
//! | `bytes_per_param` | bytes the variant really moves per parameter: read `p, m, v` (12) + the gradient (4 or 2), write `p, m, v` (12) + the compute copy (0, 2 or 4); 28 for the pure fp32 step |
//! | `gbps` | `params_per_s × bytes_per_param`, 10⁹ B/s |
//! | `triad_gbps` | `a[i] = b[i] + s·c[i]` over f32 arrays of 4 × the last-level cache each (huge pages, as the step), counted at 12 B per element as STREAM does (16 B really move, with the write-allocate of `a`); median of as many passes |
//! | `ratio_to_triad` | `gbps / triad_gbps` |
//! | `torch_params_per_s` | torch's fused CPU AdamW at 2 threads on this kind of machine, 2.32 Gparam/s (`../shared/peers/README.md`, not run here); for a variant with half gradients or a compute copy, that step plus torch's separate casts (`grad.float()`, `param.to(bf16)`: 6 B per parameter each), the casts timed at this run's triad bandwidth, which favours torch |
//! | `ratio_to_torch` | `params_per_s / torch_params_per_s` |
//!
//! The figures are only comparable within one run: the machines are shared and noisy.

use std::time::Instant;

use half::{bf16, f16};
use oogc_optimizer::{AdamConfig, AdamKernel, CopyOut, DType, GradSlice, Isa, StateIo};
use oogc_swapper::host::{HostMemory, MmapMemory};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Context, Error, Result};

/// torch's `AdamW(fused=True)` on this kind of machine, 2 threads (`../shared/peers/README.md`).
pub const TORCH_FUSED_PARAMS_PER_S: f64 = 2.32e9;

/// Arguments of the Adam benchmark.
#[derive(Debug, Clone)]
pub struct AdamBenchArgs {
    /// Parameters of the flat tensor. Default: 256 Mi.
    pub params: usize,
    /// Thread counts, one row each. Default: [1, 2].
    pub threads: Vec<usize>,
    /// Element type of the gradients. Default: f32.
    pub grad_dtype: DType,
    /// Element type of the compute copy written in the same pass; `None`: none. Default: `None`.
    pub param_out: Option<DType>,
    /// Timed steps per row (the median is reported). Default: 5.
    pub steps: usize,
    /// Dispatch path; `None` detects. Default: `None`.
    pub isa: Option<Isa>,
    /// Bytes of each of the triad's three f32 arrays; `None`: 4 × the last-level cache
    /// ([`llc_bytes`]), so that the triad measures memory, not cache. A smaller size only makes
    /// the run shorter (a host with a 480 MiB L3 allocates and touches 5.6 GiB otherwise).
    /// Default: `None`.
    pub triad_bytes: Option<usize>,
}

impl Default for AdamBenchArgs {
    fn default() -> Self {
        Self {
            params: 256 << 20,
            threads: vec![1, 2],
            grad_dtype: DType::F32,
            param_out: None,
            steps: 5,
            isa: None,
            triad_bytes: None,
        }
    }
}

/// One row: one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct AdamBenchRow {
    /// `adamw g=<dtype> copy=<dtype|none>`.
    pub variant: String,
    /// Dispatch path.
    pub isa: String,
    /// Threads of the optimizer pool and of the triad.
    pub threads: usize,
    /// Parameters.
    pub params: usize,
    /// Median seconds per step.
    pub seconds_per_step: f64,
    /// Parameters updated per second.
    pub params_per_s: f64,
    /// Bytes moved per parameter (see the module docs).
    pub bytes_per_param: usize,
    /// Effective GB/s (10⁹ B/s) at `bytes_per_param`.
    pub gbps: f64,
    /// STREAM triad GB/s, same process, same thread count.
    pub triad_gbps: f64,
    /// `gbps / triad_gbps`.
    pub ratio_to_triad: f64,
    /// The torch figure this variant is compared with (see the module docs).
    pub torch_params_per_s: f64,
    /// `params_per_s / torch_params_per_s`.
    pub ratio_to_torch: f64,
}

/// Host memory as the optimizer state would get it from the swapper's pool: an anonymous
/// mapping, 2 MiB-aligned and advised `MADV_HUGEPAGE` (THP is `madvise` on these machines; 4 KiB
/// pages cost the seven streams of the step TLB misses), pre-faulted.
struct Huge(MmapMemory);

impl Huge {
    fn new<T: bytemuck::Pod>(n: usize) -> Result<Self> {
        let bytes = n * std::mem::size_of::<T>();
        let (mem, _) = MmapMemory::new(bytes, false).map_err(|source| Error::Mmap { bytes, source })?;
        Ok(Self(mem))
    }

    fn get<T: bytemuck::Pod>(&mut self, n: usize) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(self.0.as_mut_slice())[..n]
    }
}

/// A deterministic value in [-0.5, 0.5) for element `i` (no subnormals, no zeros to speak of).
fn val(i: usize, salt: u32) -> f32 {
    let x = (i as u32).wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503));
    (x >> 8) as f32 / 16_777_216.0 - 0.5
}

/// Bytes of the last-level cache (sysfs), 32 MiB when unknown.
pub fn llc_bytes() -> usize {
    let mut best = 0;
    for idx in 0..8 {
        let p = format!("/sys/devices/system/cpu/cpu0/cache/index{idx}/size");
        if let Ok(s) = std::fs::read_to_string(p) {
            let s = s.trim();
            let (num, mult) = match s.strip_suffix('K') {
                Some(n) => (n, 1 << 10),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s, 1),
                },
            };
            if let Ok(n) = num.parse::<usize>() {
                best = best.max(n * mult);
            }
        }
    }
    if best == 0 {
        32 << 20
    } else {
        best
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// STREAM triad `a = b + s·c` on `pool`, f32 arrays of `len`; median of `passes` GB/s at
/// 12 B per element.
///
/// # Errors
/// The arrays cannot be mapped.
pub fn triad_gbps(pool: &rayon::ThreadPool, len: usize, passes: usize) -> Result<f64> {
    let chunk = len.div_ceil(pool.current_num_threads()).next_multiple_of(1024);
    let (mut ha, mut hb, mut hc) = (Huge::new::<f32>(len)?, Huge::new::<f32>(len)?, Huge::new::<f32>(len)?);
    let (a, b, c) = (ha.get::<f32>(len), hb.get::<f32>(len), hc.get::<f32>(len));
    // First touch on the pool's threads.
    pool.install(|| {
        a.par_chunks_mut(chunk).zip(b.par_chunks_mut(chunk)).zip(c.par_chunks_mut(chunk)).enumerate().for_each(
            |(k, ((a, b), c))| {
                for i in 0..a.len() {
                    a[i] = 0.0;
                    b[i] = val(k * chunk + i, 1);
                    c[i] = val(k * chunk + i, 2);
                }
            },
        )
    });
    let s = 3.0f32;
    let pass = |a: &mut [f32]| {
        let t = Instant::now();
        pool.install(|| {
            a.par_chunks_mut(chunk).zip(b.par_chunks(chunk)).zip(c.par_chunks(chunk)).for_each(|((a, b), c)| {
                for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                    *a = b + s * c;
                }
            })
        });
        t.elapsed().as_secs_f64()
    };
    pass(a);
    let times: Vec<f64> = (0..passes.max(1)).map(|_| pass(a)).collect();
    std::hint::black_box(&a);
    Ok(12.0 * len as f64 / median(times) * 1e-9)
}

/// Runs the benchmark: one row per thread count.
///
/// # Errors
/// Bad arguments (no thread counts, 0 parameters or steps, a forced ISA this CPU lacks), or a
/// thread pool that cannot be built.
pub fn run(args: &AdamBenchArgs) -> Result<Vec<AdamBenchRow>> {
    if args.params == 0 || args.steps == 0 || args.threads.is_empty() || args.threads.contains(&0) {
        return Err(Error::invalid("--params, --steps and every --threads value", "must be at least 1"));
    }
    let isa = args.isa.unwrap_or_else(Isa::detect);
    let n = args.params;
    let adam = AdamConfig::default();
    let (mut hp, mut hm, mut hv) = (Huge::new::<f32>(n)?, Huge::new::<f32>(n)?, Huge::new::<f32>(n)?);
    let (p, m, v) = (hp.get::<f32>(n), hm.get::<f32>(n), hv.get::<f32>(n));
    p.iter_mut().enumerate().for_each(|(i, x)| *x = val(i, 3));
    let gsize = args.grad_dtype.size_in_bytes();
    let mut hg = Huge::new::<u8>(n * gsize)?;
    let g = hg.get::<u8>(n * gsize);
    let grads = match args.grad_dtype {
        DType::F32 => {
            let g: &mut [f32] = bytemuck::cast_slice_mut(g);
            g.iter_mut().enumerate().for_each(|(i, x)| *x = val(i, 4) * 1e-2);
            GradSlice::F32(g)
        }
        DType::BF16 => {
            let g: &mut [bf16] = bytemuck::cast_slice_mut(g);
            g.iter_mut().enumerate().for_each(|(i, x)| *x = bf16::from_f32(val(i, 4) * 1e-2));
            GradSlice::BF16(g)
        }
        DType::F16 => {
            let g: &mut [f16] = bytemuck::cast_slice_mut(g);
            g.iter_mut().enumerate().for_each(|(i, x)| *x = f16::from_f32(val(i, 4) * 1e-2));
            GradSlice::F16(g)
        }
        DType::U8 => return Err(Error::invalid("--grad-dtype u8", "is not a gradient type: use f32, bf16 or f16")),
    };
    let mut hc = args.param_out.map(|d| Huge::new::<u8>(n * d.size_in_bytes())).transpose()?;
    let copy_bytes = args.param_out.map_or(0, |d| d.size_in_bytes());
    let bytes_per_param = 24 + args.grad_dtype.size_in_bytes() + copy_bytes;
    let variant = format!("adamw g={} copy={}", args.grad_dtype, args.param_out.map_or("none", |d| d.name()));
    let triad_len = (args.triad_bytes.unwrap_or_else(|| 4 * llc_bytes()) / 4).max(1024);
    let mut rows = Vec::new();
    let mut t = 0u64;
    for &threads in &args.threads {
        let kernel = AdamKernel::new(isa, threads).with_context(|| format!("optimizer kernel on {isa}"))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|source| Error::ThreadPool { what: "triad thread pool", source })?;
        let mut step = || -> Result<f64> {
            t += 1;
            let s = adam.scalars(t, 1e-3, 1.0)?;
            let start = Instant::now();
            let out = match (args.param_out, hc.as_mut()) {
                (Some(d), Some(c)) => CopyOut::from_bytes(d, c.get::<u8>(n * d.size_in_bytes())),
                _ => CopyOut::None,
            };
            kernel.step(&s, StateIo::InPlace { p: &mut *p, m: &mut *m, v: &mut *v }, grads, out)?;
            Ok(start.elapsed().as_secs_f64())
        };
        step()?; // warm-up: page faults, caches
        let times = (0..args.steps).map(|_| step()).collect::<Result<Vec<f64>>>()?;
        let secs = median(times);
        let triad = triad_gbps(&pool, triad_len, args.steps.max(3))?;
        let params_per_s = n as f64 / secs;
        let gbps = params_per_s * bytes_per_param as f64 * 1e-9;
        let casts = 6 * usize::from(args.grad_dtype != DType::F32) + 6 * usize::from(copy_bytes > 0);
        let torch = 1.0 / (1.0 / TORCH_FUSED_PARAMS_PER_S + casts as f64 / (triad * 1e9));
        rows.push(AdamBenchRow {
            variant: variant.clone(),
            isa: isa.name().into(),
            threads,
            params: n,
            seconds_per_step: secs,
            params_per_s,
            bytes_per_param,
            gbps,
            triad_gbps: triad,
            ratio_to_triad: gbps / triad,
            torch_params_per_s: torch,
            ratio_to_torch: params_per_s / torch,
        });
    }
    std::hint::black_box(&hp);
    Ok(rows)
}

/// Prints the rows as a table.
pub fn print_table(rows: &[AdamBenchRow]) {
    println!(
        "{:<26} {:>7} {:>7} {:>11} {:>9} {:>9} {:>6} {:>7} {:>8} {:>6} {:>8}",
        "variant", "isa", "threads", "params", "s/step", "Gparam/s", "B/par", "GB/s", "triad", "ratio", "vs torch"
    );
    for r in rows {
        println!(
            "{:<26} {:>7} {:>7} {:>11} {:>9.4} {:>9.3} {:>6} {:>7.2} {:>8.2} {:>6.2} {:>8.2}",
            r.variant,
            r.isa,
            r.threads,
            r.params,
            r.seconds_per_step,
            r.params_per_s * 1e-9,
            r.bytes_per_param,
            r.gbps,
            r.triad_gbps,
            r.ratio_to_triad,
            r.ratio_to_torch
        );
    }
}
