//! `oogc`: an out-of-GPU-core training runtime.
//!
//! # Example
//!
//! A trainer embeds a [`runtime::Runtime`]: two units (4×4 f32 weights, each one flat vector)
//! on the sim GPU, one step of fetch → compute → release, gradients to the CPU AdamW.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use oogc::runtime::{Phase, Runtime, RuntimeConfig};
//!
//! let mut rt = Runtime::new(RuntimeConfig::sim(4 << 10), oogc::dist::Ranks::single())?;
//! let init: Vec<f32> = (0..16).map(|i| (i * 7 % 16) as f32 / 16.0 + 0.1).collect();
//! let units = [rt.add_unit("layer0", &init)?, rt.add_unit("layer1", &init)?];
//!
//! rt.begin_step(1, 1e-2)?; // step 1, lr 1e-2
//! let mut inputs = Vec::new(); // each unit's input, kept for the backward's recompute
//! let mut h = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?; // [batch 2, width 4]
//! for &u in &units {
//!     let w = rt.fetch(u, Phase::Forward)?; // pinned on the device until dropped
//!     inputs.push(h.clone());
//!     h = h.matmul(&w.tensor().reshape((4, 4))?)?;
//! }
//! // Backward of loss = sum(h), in reverse: refetch, recompute, push the weights' gradient.
//! let mut grad = h.ones_like()?;
//! for (&u, input) in units.iter().zip(&inputs).rev() {
//!     let w = Var::from_tensor(rt.fetch(u, Phase::Backward)?.tensor())?;
//!     let x = Var::from_tensor(input)?;
//!     let out = x.as_tensor().matmul(&w.as_tensor().reshape((4, 4))?)?;
//!     let grads = (out * &grad)?.sum_all()?.backward()?;
//!     rt.push_grads(u, grads.get(&w).expect("a weight gradient"))?;
//!     grad = grads.get(&x).expect("an input gradient").clone();
//! }
//! rt.finish_step()?;
//! rt.sync()?; // wait for the pipelined optimizer
//!
//! // Every gradient is positive, so AdamW's first step lowers every weight (by ≈ lr).
//! for &u in &units {
//!     let master = rt.unit_state(u)?.master;
//!     assert!(master.iter().zip(&init).all(|(p, p0)| p < p0 && p0 - p < 2e-2));
//! }
//! # anyhow::Ok(())
//! ```
//!
//! The facade crate: it re-exports the component crates, wires them into the [`runtime::Runtime`]
//! a trainer embeds, and holds the reference GPT trainer and the CLI's commands.
//!
//! | crate / module | owns |
//! |---|---|
//! | [`swapper`] | tiers (GPU, pinned host, NVMe), residency manager, transfers, metrics |
//! | [`optimizer`] | CPU AdamW/Adam (SIMD, threads), NVMe-streamed state, the pipelined per-unit step |
//! | [`prefetch`] | traced schedule, next-use (Belady) eviction, lookahead prefetch, simulator, planner |
//! | [`moe_placement`] | expert placement (later issue) |
//! | [`runtime`] | `Runtime`: fetch → compute → release per unit, gradients D2H to the pipelined optimizer |
//! | [`models`], [`train`], [`run`] | the model families on candle (Llama, Mistral, Qwen2, Mixtral, the byte-level GPT / MoE-GPT), the trainer, the `oogc train` loop |
//! | [`config`], [`data`], [`checkpoint`] | the TOML config, training text, safetensors checkpoints |
//! | [`checksum`], [`lock`], [`hooks`] | crc32c in safetensors metadata, exclusive run directories, test hooks of the fault-injection soak |
#![deny(unsafe_code)]

pub use oogc_models as models;
pub use oogc_moe_placement as moe_placement;
pub use oogc_optimizer as optimizer;
pub use oogc_prefetch as prefetch;
pub use oogc_swapper as swapper;

pub mod checkpoint;
pub use oogc_models::checksum;
pub mod config;
pub mod data;
pub mod dist;
pub mod export;
pub mod hooks;
pub mod lock;
pub mod moe;
pub mod plan;
pub mod run;
pub mod runtime;
pub mod train;
