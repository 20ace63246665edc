//! `oogc bench adam`: the CPU AdamW step of `oogc-optimizer` on one flat tensor, beside a STREAM
//! triad measured in the same process with the same thread count (the memory-bandwidth limit).
//!
//! | column | what it is |
//! |---|---|
//! | `seconds_per_step` | median wall time of `steps` timed steps (after one untimed warm-up that also faults the pages in) |
//! | `params_per_s` | `params / seconds_per_step` |
//! | `state_dtype` | only with `state_dtypes` (`--state-dtype`): the element type of `m` and `v` ([`StateDType`]), the step [`AdamKernel::step_moments`]; absent: the f32 [`AdamKernel::step`] |
//! | `bytes_per_param` | bytes the variant really moves per parameter: read `p, m, v` (12) + the gradient (4 or 2), write `p, m, v` (12) + the compute copy (0, 2 or 4); 28 for the pure fp32 step. With a `state_dtype`, `m` and `v` count [`StateDType::moment_bytes`]`(params) / params` each way: f32 8 (the same 28), bf16 4 (20 with f32 gradients and no copy), int8 2 + 8/256 = 2.03125 (the codes and one f32 absmax per 256-value block of each moment: 16.0625) |
//! | `gbps` | `params_per_s × bytes_per_param`, 10⁹ B/s |
//! | `triad_gbps` | `a[i] = b[i] + s·c[i]` over f32 arrays of 4 × the last-level cache each (huge pages, as the step), counted at 12 B per element as STREAM does (16 B really move, with the write-allocate of `a`); median of as many passes |
//! | `ratio_to_triad` | `gbps / triad_gbps` |
//! | `torch_params_per_s` | torch's fused CPU AdamW at 2 threads on this kind of machine, 2.32 Gparam/s (`../shared/peers/README.md`, not run here); for a variant with half gradients or a compute copy, that step plus torch's separate casts (`grad.float()`, `param.to(bf16)`: 6 B per parameter each), the casts timed at this run's triad bandwidth, which favours torch |
//! | `ratio_to_torch` | `params_per_s / torch_params_per_s` |
//!
//! The figures are only comparable within one run: the machines are shared and noisy.

use std::time::Instant;

use half::{bf16, f16};
use oogc_optimizer::{
    AdamConfig, AdamKernel, CopyOut, DType, GradSlice, Isa, Moments, StateDType, StateIo, QUANT_BLOCK,
};
use oogc_swapper::host::{HostMemory, MmapMemory};
use rayon::prelude::*;
use serde::{Serialize, Serializer};

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
    /// Element types of Adam's moments, rows of [`AdamKernel::step_moments`] each (in this
    /// order, every thread count); empty: the f32 [`AdamKernel::step`] alone, rows without a
    /// `state_dtype`. Default: empty.
    pub state_dtypes: Vec<StateDType>,
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
            state_dtypes: Vec::new(),
        }
    }
}

/// One row: one thread count (and one moment type).
#[derive(Debug, Clone, Serialize)]
pub struct AdamBenchRow {
    /// `adamw g=<dtype> copy=<dtype|none>`, and ` state=<dtype>` with a `state_dtype`.
    pub variant: String,
    /// The moments' element type, for [`AdamKernel::step_moments`]; `None` (not serialized):
    /// the f32 [`AdamKernel::step`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dtype: Option<StateDType>,
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
    /// Bytes moved per parameter (see the module docs): whole, except with int8 moments
    /// (serialized as an integer when whole).
    #[serde(serialize_with = "whole_as_integer")]
    pub bytes_per_param: f64,
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

/// `x` as a JSON integer when it is a whole number (the byte counts of every variant but int8
/// moments), else as a float.
fn whole_as_integer<S: Serializer>(x: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    if x.fract() == 0.0 && (0.0..9.0e15).contains(x) {
        s.serialize_u64(*x as u64)
    } else {
        s.serialize_f64(*x)
    }
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

/// Adam's moments in huge-page memory: f32 (for [`AdamKernel::step`] or
/// [`Moments::F32`]), bf16 or int8 codes with their per-block absmax.
struct MomentBufs {
    dtype: StateDType,
    n: usize,
    m: Huge,
    v: Huge,
    /// The absmax of `m` and of `v` (int8 only).
    absmax: Option<(Huge, Huge)>,
}

impl MomentBufs {
    /// Zero moments (torch's initial state; all-zero int8 codes are zeros) for `n` parameters.
    fn new(dtype: StateDType, n: usize) -> Result<Self> {
        let blocks = n.div_ceil(QUANT_BLOCK);
        let elem = match dtype {
            StateDType::F32 => 4,
            StateDType::Bf16 => 2,
            StateDType::Int8 => 1,
        };
        let absmax = match dtype {
            StateDType::Int8 => Some((Huge::new::<f32>(blocks)?, Huge::new::<f32>(blocks)?)),
            _ => None,
        };
        Ok(Self { dtype, n, m: Huge::new::<u8>(n * elem)?, v: Huge::new::<u8>(n * elem)?, absmax })
    }

    /// The moments, for [`AdamKernel::step_moments`].
    fn moments(&mut self) -> Moments<'_> {
        let (n, blocks) = (self.n, self.n.div_ceil(QUANT_BLOCK));
        match (self.dtype, &mut self.absmax) {
            (StateDType::Bf16, _) => Moments::Bf16 { m: self.m.get(n), v: self.v.get(n) },
            (StateDType::Int8, Some((ma, va))) => {
                Moments::Int8 { m: self.m.get(n), m_absmax: ma.get(blocks), v: self.v.get(n), v_absmax: va.get(blocks) }
            }
            _ => Moments::F32 { m: self.m.get(n), v: self.v.get(n) },
        }
    }

    /// Whether the first block's `m` and `v` are no longer zero: the step really ran.
    fn written(&mut self) -> bool {
        let k = self.n.min(QUANT_BLOCK);
        match self.moments() {
            Moments::F32 { m, v } => m[..k].iter().any(|&x| x != 0.0) && v[..k].iter().any(|&x| x != 0.0),
            Moments::Bf16 { m, v } => {
                m[..k].iter().any(|x| x.to_f32() != 0.0) && v[..k].iter().any(|x| x.to_f32() != 0.0)
            }
            Moments::Int8 { m, m_absmax, v, v_absmax } => {
                m_absmax[0] > 0.0
                    && v_absmax[0] > 0.0
                    && m[..k].iter().any(|&c| c != 0)
                    && v[..k].iter().any(|&c| c != 0)
            }
        }
    }
}

/// Runs the benchmark: one row per thread count, for each of `state_dtypes` when given.
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
    let mut hp = Huge::new::<f32>(n)?;
    let p = hp.get::<f32>(n);
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
    let base = format!("adamw g={} copy={}", args.grad_dtype, args.param_out.map_or("none", |d| d.name()));
    let triad_len = (args.triad_bytes.unwrap_or_else(|| 4 * llc_bytes()) / 4).max(1024);
    // `None`: today's f32 `AdamKernel::step`; `Some`: `step_moments` on that moment type.
    let kinds: Vec<Option<StateDType>> =
        if args.state_dtypes.is_empty() { vec![None] } else { args.state_dtypes.iter().copied().map(Some).collect() };
    let mut rows = Vec::new();
    let mut t = 0u64;
    for kind in kinds {
        let mut state = MomentBufs::new(kind.unwrap_or(StateDType::F32), n)?;
        // p and the gradients (and the copy) move 8 + g + c B; the moments theirs, read and written.
        let bytes_per_param = match kind {
            None => (24 + gsize + copy_bytes) as f64,
            Some(d) => (n * (8 + gsize + copy_bytes) + 2 * d.moment_bytes(n)) as f64 / n as f64,
        };
        let variant = kind.map_or_else(|| base.clone(), |d| format!("{base} state={d}"));
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
                match (kind, state.moments()) {
                    (None, Moments::F32 { m, v }) => {
                        kernel.step(&s, StateIo::InPlace { p: &mut *p, m, v }, grads, out)?
                    }
                    (_, moments) => kernel.step_moments(&s, &mut *p, moments, grads, out)?,
                }
                Ok(start.elapsed().as_secs_f64())
            };
            step()?; // warm-up: page faults, caches
            let times = (0..args.steps).map(|_| step()).collect::<Result<Vec<f64>>>()?;
            if !state.written() {
                return Err(Error::Internal { what: "moments written by the step (the first block is still zero)" });
            }
            let secs = median(times);
            let triad = triad_gbps(&pool, triad_len, args.steps.max(3))?;
            let params_per_s = n as f64 / secs;
            let gbps = params_per_s * bytes_per_param * 1e-9;
            let casts = 6 * usize::from(args.grad_dtype != DType::F32) + 6 * usize::from(copy_bytes > 0);
            let torch = 1.0 / (1.0 / TORCH_FUSED_PARAMS_PER_S + casts as f64 / (triad * 1e9));
            rows.push(AdamBenchRow {
                variant: variant.clone(),
                state_dtype: kind,
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
    }
    std::hint::black_box(&hp);
    Ok(rows)
}

/// Prints the rows as a table.
pub fn print_table(rows: &[AdamBenchRow]) {
    let w = rows.iter().map(|r| r.variant.len()).max().unwrap_or(0).max(26);
    println!(
        "{:<w$} {:>7} {:>7} {:>11} {:>9} {:>9} {:>6} {:>7} {:>8} {:>6} {:>8}",
        "variant", "isa", "threads", "params", "s/step", "Gparam/s", "B/par", "GB/s", "triad", "ratio", "vs torch"
    );
    for r in rows {
        let bytes = r.bytes_per_param;
        let bytes = if bytes.fract() == 0.0 { format!("{bytes}") } else { format!("{bytes:.2}") };
        println!(
            "{:<w$} {:>7} {:>7} {:>11} {:>9.4} {:>9.3} {:>6} {:>7.2} {:>8.2} {:>6.2} {:>8.2}",
            r.variant,
            r.isa,
            r.threads,
            r.params,
            r.seconds_per_step,
            r.params_per_s * 1e-9,
            bytes,
            r.gbps,
            r.triad_gbps,
            r.ratio_to_triad,
            r.ratio_to_torch
        );
    }
}
