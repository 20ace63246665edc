//! Mixed precision end to end (`[train] compute_dtype = "bf16"`): bf16 compute copies and
//! gradients over fp32 master weights. Offloaded bf16 training equals the in-memory bf16
//! reference bitwise (`reference`, which computes on bf16 copies of its master weights with the
//! same unit calls); every link and the NVMe parameter traffic carry exactly half of f32's bytes;
//! a bf16 run resumes bitwise.

use crate::common;
use crate::reference;

use oogc::config::{ComputeDType, TrainConfig};
use oogc::train::Trainer;

/// The tiny Llama of `common` in `compute_dtype` (state on NVMe), with a GPU budget of a third
/// of its compute copies' bytes: units are evicted and fetched again every step.
fn offloaded(dir: &std::path::Path, compute_dtype: ComputeDType) -> (TrainConfig, u64) {
    common::offloaded_tiny_llama(dir, compute_dtype)
}

#[test]
fn offloaded_bf16_training_equals_in_memory_bf16_training_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, copy_bytes) = offloaded(dir.path(), ComputeDType::Bf16);
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    assert_eq!(t.runtime().compute_dtype(), oogc::optimizer::DType::BF16);
    let mut losses = Vec::new();
    let mut clipped = 0;
    for _ in 0..12 {
        let out = t.train_step().unwrap();
        assert!(out.loss.is_finite() && !out.stats.figures.skipped, "{out:?}");
        clipped += (out.stats.figures.clip_scale < 1.0) as usize;
        losses.push(out.loss);
    }
    assert!(clipped > 0, "the test should exercise clipping (clip_norm 0.5)");
    let params = t.master_weights().unwrap();
    assert!(t.runtime().memory().traffic().htod.bytes > copy_bytes, "units were evicted and fetched again");
    let reference = reference::train(&cfg, 12);
    assert_eq!(losses, reference.losses);
    assert_eq!(params, reference.params);
    assert!(losses[11] < losses[0], "loss should fall: {losses:?}");
    // Not the f32 run: the same config in f32 gives other losses.
    let mut f32_cfg = cfg.clone();
    f32_cfg.train.compute_dtype = ComputeDType::F32;
    f32_cfg.budgets.gpu = bytesize::ByteSize::b(2 * cfg.budgets.gpu.as_u64());
    let f32_losses = reference::train(&f32_cfg, 2).losses;
    assert_ne!(f32_losses[1], losses[1]);
}

/// `(h2d, d2h, nvme read, nvme write)` bytes of each of `steps` steps of `cfg`.
fn traffic(cfg: &TrainConfig, steps: usize) -> Vec<[u64; 4]> {
    let mut t = Trainer::new(cfg.clone(), oogc::dist::Ranks::single()).unwrap();
    (0..steps)
        .map(|_| {
            let s = t.train_step().unwrap().stats;
            [s.figures.h2d_bytes, s.figures.d2h_bytes, s.figures.nvme_read_bytes, s.figures.nvme_write_bytes]
        })
        .collect()
}

#[test]
fn bf16_moves_exactly_half_the_parameter_and_gradient_bytes_of_f32() {
    // The same run in f32 and in bf16 with half the GPU budget: the same units fit, so the same
    // copies move H2D, each of half the bytes, and gradients cross D2H in bf16. Parameters on
    // NVMe (a cold start: the first step reads every compute copy from NVMe once) with the
    // optimizer state in host memory, so the NVMe traffic is the compute copies' alone.
    let dir = tempfile::tempdir().unwrap();
    let run = |dtype: ComputeDType, name: &str| {
        let (mut cfg, copy_bytes) = offloaded(&dir.path().join(name), dtype);
        if dtype == ComputeDType::Bf16 {
            // The f32 run's budget, halved (as `offloaded` sized it for f32).
            let (f32_cfg, _) = offloaded(&dir.path().join(name), ComputeDType::F32);
            cfg.budgets.gpu = bytesize::ByteSize::b(f32_cfg.budgets.gpu.as_u64() / 2);
        }
        cfg.budgets.optimizer_state = oogc::swapper::StatePlacement::Host;
        cfg.budgets.params = oogc::swapper::StatePlacement::Nvme;
        // On demand (no prefetch window): which copies move does not depend on when the
        // optimizer's updates finish, so the two runs' bytes compare exactly.
        cfg.prefetch.depth = 0;
        (traffic(&cfg, 4), copy_bytes)
    };
    let (f32_bytes, f32_copies) = run(ComputeDType::F32, "f32");
    let (bf16_bytes, bf16_copies) = run(ComputeDType::Bf16, "bf16");
    assert_eq!(2 * bf16_copies, f32_copies);
    // The cold start: every compute copy read from NVMe once.
    assert_eq!((f32_bytes[0][2], bf16_bytes[0][2]), (f32_copies, bf16_copies));
    for (step, (f, b)) in f32_bytes.iter().zip(&bf16_bytes).enumerate() {
        assert!(f[0] > f32_copies && f[1] > 0, "step {step}: units were evicted and fetched again: {f:?}");
        assert_eq!([f[0] / 2, f[1] / 2], [b[0], b[1]], "step {step}: (h2d, d2h) f32 {f:?}, bf16 {b:?}");
        assert!(f[0] % 2 == 0 && f[1] % 2 == 0, "{f:?}");
    }
}

#[test]
fn a_resumed_bf16_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = |name: &str| {
        let (mut cfg, _) = offloaded(&dir.path().join(name), ComputeDType::Bf16);
        cfg.checkpoint.dir = Some(dir.path().join(name).join("ckpt"));
        cfg
    };
    common::assert_resume_continues_exactly(&config);
}

#[test]
fn bf16_activation_checkpoints_offload_as_bf16() {
    // `[activations] offload` stashes bf16 checkpoints (half the host bytes) and gives them back
    // bitwise: the run equals the one that keeps them.
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = offloaded(dir.path(), ComputeDType::Bf16);
    let run = |offload: bool| {
        let mut c = cfg.clone();
        c.activations.offload = offload;
        // Room for the two staging buffers of the offload.
        c.budgets.gpu = bytesize::ByteSize::b(2 * cfg.budgets.gpu.as_u64());
        let mut t = Trainer::new(c, oogc::dist::Ranks::single()).unwrap();
        let losses: Vec<f64> = (0..3).map(|_| t.train_step().unwrap().loss).collect();
        let peak = t.runtime().memory().host_ledger().report().of(oogc::swapper::HostUse::Activations).peak_bytes;
        (losses, t.master_weights().unwrap(), peak)
    };
    let (kept, kept_params, _) = run(false);
    let (offloaded, offloaded_params, peak) = run(true);
    assert_eq!(offloaded, kept);
    assert_eq!(offloaded_params, kept_params);
    // 6 blocks × one [4, 16, 32] bf16 checkpoint each (pool size classes round up).
    let one = 2 * 4 * 16 * 32;
    assert!(peak >= 6 * one && peak < 6 * 2 * one, "activations peak {peak} B for bf16 checkpoints of {one} B");
}

#[test]
fn composed_ops_rehearse_the_gpu_op_sequence_on_the_sim_device() {
    // `[device] ops = "composed"`: the units run the candle compositions (what CUDA runs)
    // instead of the fused CPU kernels, offloaded exactly as the in-memory loop over the same
    // compositions, and within f32 rounding of the fused kernels' run.
    let dir = tempfile::tempdir().unwrap();
    let (fused, _) = offloaded(dir.path(), ComputeDType::F32);
    let mut composed = fused.clone();
    composed.device.ops = oogc::config::OpsPath::Composed;
    let mut t = Trainer::new(composed.clone(), oogc::dist::Ranks::single()).unwrap();
    let losses: Vec<f64> = (0..4).map(|_| t.train_step().unwrap().loss).collect();
    let params = t.master_weights().unwrap();
    let reference = reference::train(&composed, 4);
    assert_eq!(losses, reference.losses);
    assert_eq!(params, reference.params);
    let fused_losses = reference::train(&fused, 4).losses;
    assert_ne!(fused_losses, losses, "the fused kernels round differently");
    for (f, c) in fused_losses.iter().zip(&losses) {
        assert!((f - c).abs() <= 1e-4 * f.abs(), "fused {f} vs composed {c}");
    }
}
