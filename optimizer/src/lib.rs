//! `oogc-optimizer`: the CPU optimizers of oogc — AdamW and Adam over fp32 master weights, with
//! the compute copy written in the same pass, state streamed from NVMe, and the pipelined
//! per-unit step that overlaps the GPU backward.
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
pub use oogc_swapper::{DType, StatePlacement};
pub use pipeline::{
    compute_copy, speculation_cost, state_host_bytes, stream_host_bytes, Grads, NormReduce, PipelinedOptimizer,
    SpeculationReport, StepReport, UnitState, UpdateHandle,
};
pub use quant::{
    adam_step_moments, bf16_rne, dequantize_dynamic, dequantize_linear, dynamic_map, quantize_dynamic, quantize_linear,
    Moments, StateDType, QUANT_BLOCK,
};
pub use simd::Isa;
pub use stream::{state_nvme_bytes, stream_update, NvmeState, StreamConfig, StreamStats};
