//! `oogc bench`: offload benchmarks that print human-readable tables or JSON.
pub mod nvme;
