//! Criterion benches of the CPU optimizer (small sizes, a few seconds each):
//!
//! | bench | what it measures |
//! |---|---|
//! | `cpu_adamw_f32_4M_t{1,2}` | one fused AdamW step over 4 Mi parameters, fp32 gradients, no compute copy |
//! | `cpu_adamw_bf16_bf16copy_4M_t{1,2}` | the offload variant: bf16 gradients in, bf16 compute copy out |
//! | `cpu_grad_sumsq_bf16_4M` | the canonical gradient sum of squares (clipping) |
//!
//! 4 Mi parameters (112 MB per step) exceed the last-level cache, so these are memory-bound like
//! the real step; the figures beside a triad come from `oogc bench adam`.

use std::time::Duration;

use criterion::{criterion_main, Criterion, Throughput};
use half::bf16;
use oogc::optimizer::{grad_sumsq, AdamConfig, AdamKernel, CopyOut, GradSlice, Isa, StateIo};

const N: usize = 4 << 20;

fn adam_benches(c: &mut Criterion) {
    let isa = Isa::detect();
    let s = AdamConfig::default().scalars(10, 1e-3, 1.0).expect("scalars");
    let (mut p, mut m, mut v) = (vec![0.1f32; N], vec![0f32; N], vec![0f32; N]);
    let g32 = vec![1e-3f32; N];
    let g16 = vec![bf16::from_f32(1e-3); N];
    let mut copy = vec![bf16::ZERO; N];
    let mut g = c.benchmark_group("cpu_adam");
    g.sample_size(10).measurement_time(Duration::from_secs(2)).throughput(Throughput::Elements(N as u64));
    for threads in [1, 2] {
        let k = AdamKernel::new(isa, threads).expect("kernel");
        g.bench_function(format!("cpu_adamw_f32_4M_t{threads}"), |b| {
            b.iter(|| {
                k.step(&s, StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v }, GradSlice::F32(&g32), CopyOut::None)
                    .expect("step")
            })
        });
        g.bench_function(format!("cpu_adamw_bf16_bf16copy_4M_t{threads}"), |b| {
            b.iter(|| {
                let state = StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v };
                k.step(&s, state, GradSlice::BF16(&g16), CopyOut::BF16(&mut copy)).expect("step")
            })
        });
    }
    g.bench_function("cpu_grad_sumsq_bf16_4M", |b| b.iter(|| grad_sumsq(isa, GradSlice::BF16(&g16)).expect("sumsq")));
    g.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    adam_benches(&mut c);
}

criterion_main!(benches);
