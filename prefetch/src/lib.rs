//! `oogc-prefetch`: the schedule of a training step and the policies that follow from it.
//!
//! Owns (filled by the prefetch issue):
//!
//! | concept | what it is |
//! |---|---|
//! | trace | the recorded acquire order of one step (unit, phase, tier) |
//! | next-use distance | for each resident unit, how far in the schedule its next acquire is |
//! | eviction priority | Belady's MIN over the schedule, given to the swapper through `oogc_swapper::EvictionPolicy` |
//! | lookahead | the sliding window of prefetches, several units ahead, under the tier budgets |
//! | simulator | a discrete-event model of one step (bytes, stalls, timeline) |
//!
//! Pure policy: decisions in, decisions out, no I/O, no CUDA, no candle. Today the crate holds
//! no code; the swapper's `EvictionPolicy` trait is the seam it will plug into.
#![forbid(unsafe_code)]
