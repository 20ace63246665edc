//! The planner's accuracy against a fixed bound, in its own test binary so that no other test
//! shares the cores with its measured steps and compute probes (cargo runs test binaries one
//! after another).

#[path = "../../tests/common/mod.rs"]
mod common;

use oogc_bench::plan_check;

/// The planner's accuracy on the main example config (`configs/tinyshakespeare.toml`: dense,
/// state on NVMe, GPU budget 1/8 of parameters + state), a fixed bound: within 25 % of the
/// measured step. The benchmark (`oogc bench plan`) reports the 15 % target on a quiet machine;
/// this bound leaves room for a shared 2-core CI machine (identical runs differ by ±10 %) and
/// still fails a planner whose FLOP or transfer model is off by a third. Measured while writing
/// this test, under a load average of 9 on 2 cores: +3 % (dense, NVMe), −3 % (dense, resident),
/// +28 % (MoE: the plan's uniform routing is coarse, so the MoE example is not bounded here).
#[test]
fn the_plan_of_the_main_example_config_is_within_a_quarter_of_the_measured_step() {
    let config = common::repo_root().join("configs/tinyshakespeare.toml");
    let rows = plan_check::run(&[config], 2, 1).unwrap();
    let r = &rows[0];
    assert!(r.error.abs() <= 0.25, "plan {} s vs measured {} s: {r:?}", r.plan_step_s, r.measured_step_s);
}
