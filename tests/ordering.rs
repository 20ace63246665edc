//! The ordering contract between compute and copies, checked on the CPU: the sim device's
//! happens-before checker (`oogc_swapper::device::ordering`) runs under every runtime and trainer
//! test (`Runtime::finish_step` reports a violation as an error), and the runtime's sim device
//! counts no host wait as ordering (compute waits on a copy's event, never the host). This test
//! leaves out each ordering call of the runtime in turn ([`OrderingCall::ALL`], through the
//! `OOGC_DROP_ORDERING` hook that `runtime/ordering.rs` reads when a runtime is built) and shows
//! the checker names its hazard; the same scenario with nothing left out passes (the positive
//! control). One test: the hook is an environment variable, which parallel tests would share.

mod common;

use oogc::config::ComputeDType;
use oogc::runtime::{OptimizerPlace, OrderingCall, Phase, Runtime, RuntimeConfig};
use oogc::train::Trainer;

/// The scenario that makes `call`: the training step of an offloaded tiny Llama (fetches and
/// gradient D2H; with `[activations] offload` for the checkpoint calls), or a unit's optimizer
/// moved to the device and back between steps (the state's H2D and D2H).
fn scenario(call: OrderingCall, dir: &std::path::Path) -> Result<(), String> {
    match call {
        OrderingCall::StateUploadComputeWaits
        | OrderingCall::StateUploadFreeAfterRead
        | OrderingCall::StateDownloadAlloc
        | OrderingCall::StateDownloadDtohAfterWrite
        | OrderingCall::StateDownloadFreeAfterWrite => place_and_back().map_err(|e| e.to_string()),
        // In a trainer every unit's H2D follows the staging buffers' allocation (made before the
        // first step), so compute's wait for a fetch covers them too; the allocation's own
        // ordering shows where units were on the device before the first step.
        // (Activation staging is allocated after gradient staging, so compute's wait for it
        // would cover the gradients' too: that one runs without activation offload.)
        OrderingCall::GradStagingAlloc => warm_before_staging(false).map_err(|e| e.to_string()),
        OrderingCall::ActivationStagingAlloc => warm_before_staging(true).map_err(|e| e.to_string()),
        OrderingCall::FetchComputeWaits
        | OrderingCall::GradDtohAfterWrite
        | OrderingCall::ActivationDtohAfterWrite
        | OrderingCall::ActivationHtodAfterRead
        | OrderingCall::ActivationComputeWaits => {
            let (mut cfg, _) = common::offloaded_tiny_llama(dir, ComputeDType::F32);
            cfg.activations.offload = true;
            // Room for the activation offload's two staging buffers.
            cfg.budgets.gpu = bytesize::ByteSize::b(2 * cfg.budgets.gpu.as_u64());
            let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).map_err(|e| e.to_string())?;
            for _ in 0..2 {
                t.train_step().map_err(|e| e.to_string())?;
            }
            t.runtime().memory().check_ordering().map_err(|e| e.to_string())
        }
    }
}

/// Two units fetched for validation before the first step (their H2D copies come before the
/// staging buffers, which the first step allocates), then a step that (with `activations`)
/// stashes and takes back an activation checkpoint and pushes both units' gradients while they
/// are still on the device.
fn warm_before_staging(activations: bool) -> oogc::runtime::Result<()> {
    let offload = oogc::runtime::ActivationOffload { checkpoints: 1, checkpoint_bytes: 4 * 64 };
    let mut rt = Runtime::new(
        RuntimeConfig {
            prefetch_depth: 0,
            activation_offload: activations.then_some(offload),
            ..RuntimeConfig::sim(1 << 20)
        },
        oogc::dist::Ranks::single(),
    )?;
    let units = [rt.add_unit("a", &[0.25f32; 3000])?, rt.add_unit("b", &[-0.5f32; 1000])?];
    for &u in &units {
        drop(rt.fetch(u, Phase::Eval)?);
    }
    rt.begin_step(1, 1e-3)?;
    if activations {
        let x = candle_core::Tensor::arange(0f32, 64.0, rt.compute_device())?;
        let id = rt.activations().stash(&x)?;
        let back = rt.activations().take(id)?;
        assert_eq!(back.to_vec1::<f32>()?, x.to_vec1::<f32>()?);
    }
    for &u in units.iter().rev() {
        let p = rt.fetch(u, Phase::Backward)?;
        let g = p.tensor().sin()?;
        drop(p);
        rt.push_grads(u, &g)?;
    }
    rt.finish_step()?;
    rt.memory().check_ordering()
}

/// Two units, a step, unit 0's optimizer to the device (state H2D), a step, back to the host
/// (state D2H), a step.
fn place_and_back() -> oogc::runtime::Result<()> {
    let mut rt =
        Runtime::new(RuntimeConfig { prefetch_depth: 0, ..RuntimeConfig::sim(1 << 20) }, oogc::dist::Ranks::single())?;
    let units = [rt.add_unit("a", &[0.25f32; 3000])?, rt.add_unit("b", &[-0.5f32; 1000])?];
    let step = |rt: &mut Runtime, t: u64| -> oogc::runtime::Result<()> {
        rt.begin_step(t, 1e-3)?;
        for &u in units.iter().rev() {
            let p = rt.fetch(u, Phase::Backward)?;
            let g = p.tensor().sin()?;
            drop(p);
            rt.push_grads(u, &g)?;
        }
        rt.finish_step().map(|_| ())
    };
    step(&mut rt, 1)?;
    rt.place_optimizer(units[0], OptimizerPlace::Device)?;
    step(&mut rt, 2)?;
    rt.place_optimizer(units[0], OptimizerPlace::Host)?;
    step(&mut rt, 3)?;
    rt.memory().check_ordering()
}

#[test]
fn each_ordering_call_left_out_is_caught_and_named() {
    let dir = tempfile::tempdir().unwrap();
    for call in OrderingCall::ALL {
        let case = dir.path().join(call.name());
        std::env::remove_var(oogc::hooks::DROP_ORDERING_ENV);
        scenario(call, &case.join("ordered")).unwrap_or_else(|e| panic!("{call}: the ordered run failed: {e}"));
        std::env::set_var(oogc::hooks::DROP_ORDERING_ENV, call.name());
        let err = scenario(call, &case.join("dropped")).expect_err(&format!("{call}: left out, yet nothing reported"));
        std::env::remove_var(oogc::hooks::DROP_ORDERING_ENV);
        let hazard = call.hazard();
        assert!(err.contains("ordering violation"), "{call}: {err}");
        assert!(err.contains(hazard.operation()), "{call}: expected `{}`, got: {err}", hazard.operation());
        assert!(err.contains("fix:"), "{call}: the error says how to fix it: {err}");
    }
    // A name that is no ordering call is refused when the runtime is built, with the names.
    std::env::set_var(oogc::hooks::DROP_ORDERING_ENV, "grads");
    let err = Runtime::new(RuntimeConfig::sim(1 << 20), oogc::dist::Ranks::single())
        .err()
        .expect("an unknown call name is refused")
        .to_string();
    std::env::remove_var(oogc::hooks::DROP_ORDERING_ENV);
    assert!(err.contains("not an ordering call") && err.contains("grads.dtoh_after_write"), "{err}");
}
