//! Helpers shared by the end-to-end tests.

use std::path::{Path, PathBuf};

/// `../shared/data/tinyshakespeare.txt` beside the repository; panics (the test fails, never
/// skips) when it is missing.
pub fn data_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt");
    assert!(p.exists(), "{} is missing: the tests need ../shared beside the repository", p.display());
    p
}
