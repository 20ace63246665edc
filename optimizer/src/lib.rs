//! `oogc-optimizer`: the CPU optimizers of oogc — AdamW and Adam over fp32 master weights, with
//! the compute copy written in the same pass, state streamed from NVMe, and the pipelined
//! per-unit step that overlaps the GPU backward.
//!
//! # Example
//!
//! One AdamW step of the SIMD kernel over four fp32 master weights, against the closed form of
//! Adam's first step (from `m = v = 0`: `p ← p − lr·g / (|g| + ε)`, about `lr·sign(g)`):
//!
//! ```
//! use oogc_optimizer::{adam_step, AdamConfig, CopyOut, GradSlice, Isa, StateIo};
//!
//! let cfg = AdamConfig { weight_decay: 0.0, ..AdamConfig::default() }; // β = (0.9, 0.999), ε = 1e-8
//! let lr = 1e-3_f32;
//! let scalars = cfg.scalars(1, lr, 1.0)?; // step t = 1, no clipping (gradient scale 1)
//! let p0 = [1.0_f32, -2.0, 0.5, 0.0];
//! let g = [0.3_f32, -0.1, 2.0, -4.0];
//! let (mut p, mut m, mut v) = (p0.to_vec(), vec![0.0; 4], vec![0.0; 4]);
//! let mut copy = vec![0.0_f32; 4]; // the compute copy, written in the same pass (f32 here)
//! adam_step(
//!     Isa::detect(),
//!     &scalars,
//!     StateIo::InPlace { p: &mut p, m: &mut m, v: &mut v },
//!     GradSlice::F32(&g),
//!     CopyOut::F32(&mut copy),
//! )?;
//! for i in 0..4 {
//!     let expected = p0[i] as f64 - lr as f64 * g[i] as f64 / (g[i].abs() as f64 + 1e-8);
//!     assert!((p[i] as f64 - expected).abs() < 1e-6, "{i}: {} vs {expected}", p[i]);
//!     assert!((m[i] - 0.1 * g[i]).abs() < 1e-7); // m = (1 − β1)·g
//!     assert_eq!(copy[i], p[i]);
//! }
//! # Ok::<(), oogc_optimizer::Error>(())
//! ```
//!
//! | concept | type | what it is |
//! |---|---|---|
//! | hyper-parameters | [`AdamConfig`], [`LrSchedule`] | torch's `AdamW`/`Adam` (decoupled or L2 decay, bias correction); warm-up + cosine |
//! | dispatch | [`Isa`] | AVX-512, AVX2+FMA+F16C or scalar, detected at run time or forced; all bit-identical |
//! | kernel | [`adam_step`], [`AdamKernel`] | one fused pass: read `p, m, v, g` (f32/bf16/f16), write `p, m, v` and the compute copy (f32/bf16/f16) |
//! | reduced moments | [`StateDType`], [`Moments`], [`adam_step_moments`], [`AdamKernel::step_moments`] (and `_with_sumsq`) | `m`, `v` in bf16 or block-wise int8 (Dettmers et al., ICLR 2022): 8, 4 or 2.03 B/param |
//! | gradient norm | [`grad_sumsq`], [`global_norm`], [`clip_scale`] | a canonical f64 sum of squares, the same bits on every path and thread count |
//! | streamed state | [`NvmeState`], [`StreamConfig`], [`stream_update`] | state chunks on the swapper's `NvmeStore`, read k+1 ‖ update k ‖ write k−1 |
//! | pipelined step | [`PipelinedOptimizer`] | `submit(unit, grads)` returns at once; speculative update with exact global-norm clipping |
//! | compute copy home | [`ComputeCopyHome`], [`MemoryHome`] | where the new compute copy is written: its one home (the runtime's residency manager) |
//!
//! Sources: Kingma & Ba, "Adam" (ICLR 2015); Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization" (ICLR 2019); the CPU-side step of ZeRO-Offload (Ren et al., USENIX ATC 2021)
//! and DeepSpeed's `DeepSpeedCPUAdam`; speculation with roll-back as in DeepSpeed SuperOffload.
//!
//! It depends on `oogc-swapper`'s public types only (tensor ids, host buffers, the NVMe store);
//! it knows nothing of CUDA or of the model. `unsafe` code lives only in the `simd` module.
#![deny(unsafe_code)]

pub mod config;
pub mod error;
pub mod grad_pool;
pub mod home;
pub mod kernel;
pub mod master;
pub mod pipeline;
pub mod quant;
mod simd;
pub mod stream;

pub use config::{AdamConfig, AdamKind, LrSchedule, NonFinite, OptimizerConfig};
pub use error::{Error, Result};
pub use grad_pool::GradPool;
pub use home::{ComputeCopyHome, MemoryHome};
pub use kernel::{
    adam_step, clip_scale, global_norm, grad_sumsq, AdamKernel, CopyOut, ElementConstants, GradSlice, StateIo,
    StepScalars, NORM_BLOCK,
};
pub use master::{adam_step_bf16_master, sr_bf16, sr_bits, sr_key, MasterDType, StateFormat};
pub use oogc_swapper::{DType, StatePlacement};
pub use pipeline::{
    compute_copy, speculation_cost, state_host_bytes, stream_host_bytes, Grads, NormReduce, PipelinedOptimizer,
    SpeculationReport, StateSnapshot, StepReport, UnitState, UpdateHandle,
};
pub use quant::{
    adam_step_moments, bf16_rne, dequantize_dynamic, dequantize_linear, dynamic_map, quantize_dynamic, quantize_linear,
    MomentBufs, Moments, StateDType, QUANT_BLOCK,
};
pub use simd::Isa;
pub use stream::{state_nvme_bytes, stream_update, MasterIn, NvmeState, StreamConfig, StreamStats};
