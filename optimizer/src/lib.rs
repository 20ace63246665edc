//! `oogc-optimizer`: the CPU optimizers of oogc.
//!
//! Owns (filled by the optimizer issue):
//!
//! | concept | what it is |
//! |---|---|
//! | kernel | AdamW / Adam step over fp32 master weights, `m`, `v`, with the bf16/f16 compute copy written in the same pass (SIMD, run-time dispatch) |
//! | streamed state | optimizer state chunks read from and written to the NVMe tier of `oogc-swapper` with double buffering |
//! | pipelined step | a per-unit update submitted as soon as the unit's gradients reach the host, overlapping the GPU backward |
//!
//! It depends on `oogc-swapper`'s public types only (tensor ids, tiers, host buffers); it knows
//! nothing of CUDA or of the model. Today the crate holds no code: the layout of the workspace
//! is fixed first so the swapper can be built against it.
#![forbid(unsafe_code)]
