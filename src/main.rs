//! The `oogc` command line.
fn main() {}
