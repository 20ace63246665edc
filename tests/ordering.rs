//! The ordering contract between compute and copies, checked on the CPU: the sim device's
//! happens-before checker (`oogc_swapper::device::ordering`) runs under every runtime and
//! trainer test (`Runtime::finish_step` reports a violation as an error). This test removes one
//! ordering call from the runtime (`OOGC_DROP_ORDERING=grads`: each gradient's D2H ordered after
//! an event recorded before the backward wrote its staging buffer, as a forgotten event would on
//! a GPU) and shows the checker catches it. In a test binary of its own: the hook is read once
//! per process.

mod common;

use oogc::config::ComputeDType;
use oogc::train::Trainer;

#[test]
fn a_gradient_copy_not_ordered_after_the_backward_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = common::offloaded_tiny_llama(dir.path(), ComputeDType::F32);
    // The same run without the hook trains (the other test binaries run it so, checker on).
    std::env::set_var(oogc::hooks::DROP_ORDERING_ENV, "grads");
    let mut t = Trainer::new(cfg).unwrap();
    let err = t.train_step().expect_err("the checker must refuse the unordered D2H").to_string();
    assert!(err.contains("ordering violation") && err.contains("dtoh"), "{err}");
    assert!(err.contains("fix:"), "the error says how to fix it: {err}");
}
