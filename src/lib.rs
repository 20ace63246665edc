//! `oogc`: an out-of-GPU-core training runtime.
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
