//! `oogc bench`: offload benchmarks that print human-readable tables or JSON.
//!
//! | command | module | what it measures |
//! |---|---|---|
//! | `oogc bench nvme` | [`nvme`] | the NVMe store per engine, beside `fio` |
//! | `oogc bench swap` | [`swap`] | host↔sim-device copies and the residency manager, beside memcpy or the link throttle |
pub mod adam;
pub mod nvme;
pub mod swap;
