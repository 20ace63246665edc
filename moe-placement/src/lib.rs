//! `oogc-moe-placement`: where the experts of a Mixture-of-Experts model live and run.
//!
//! Owns (filled by the MoE issue):
//!
//! | concept | what it is |
//! |---|---|
//! | popularity | per block and expert, a moving average of routed tokens |
//! | hot set | the experts kept resident on the GPU under an expert byte budget |
//! | compute placement | per cold expert and step, CPU compute vs fetch, by a calibrated cost model |
//!
//! No CUDA types, no candle. Today the crate holds no code.
#![forbid(unsafe_code)]
