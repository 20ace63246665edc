//! `[optimizer] state_dtype` and `master_dtype`: bf16 and int8 Adam moments and bf16 master
//! weights through the whole trainer — they train, take the bytes their dtype says in the host
//! ledger and on NVMe, move fewer NVMe bytes per step, checkpoint in their dtype and resume
//! bitwise; a checkpoint of another dtype is refused unless `convert_state` is asked, and then
//! converted.

use crate::common;

use oogc::checkpoint::TensorData;
use oogc::config::TrainConfig;
use oogc::train::{ResumeFrom, Trainer};
use oogc_optimizer::StateDType;
use oogc_swapper::HostUse;

/// A 4-block [`common::tiny`] with `state` ("host" or "nvme") and `dtype` moments (`"bf16 master
/// + int8"`: bf16 master weights too), checkpoints in `dir/name`.
fn config(dir: &std::path::Path, name: &str, state: &str, dtype: &str) -> TrainConfig {
    let (dtype, master) = match dtype.strip_prefix("bf16 master + ") {
        Some(d) => (d, "bf16"),
        None => (dtype, "f32"),
    };
    let nvme = dir.join(name).join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let text = common::tiny("64MiB", state, &nvme, 2)
        .replace("n_layer = 24", "n_layer = 4")
        .replace("clip_norm = 0.5", &format!("clip_norm = 0.5\nstate_dtype = \"{dtype}\"\nmaster_dtype = \"{master}\""))
        .replace("[threads]", &format!("[checkpoint]\ndir = \"{}\"\n[threads]", dir.join(name).join("ckpt").display()));
    TrainConfig::from_toml_str(&text).unwrap()
}

/// (losses, NVMe bytes held, NVMe bytes read per step, host bytes of optimizer state) of `steps`.
fn train(cfg: TrainConfig, steps: usize) -> (Vec<f64>, u64, u64, u64) {
    let opt = oogc::train::optimizer_config(&cfg);
    let mut t = Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    let units: Vec<usize> = t.model().units().iter().map(|u| u.numel).collect();
    if t.runtime().memory().nvme_bytes() > 0 {
        // Before the first step the store holds each unit's state in chunks of its dtype.
        let stream = opt.stream_config();
        let want: u64 = units.iter().map(|&n| oogc_optimizer::state_nvme_bytes(n, &stream)).sum();
        assert_eq!(t.runtime().memory().nvme_bytes(), want, "{}", opt.state_format());
    }
    let losses = (0..steps).map(|_| t.train_step().unwrap().loss).collect();
    let mem = t.runtime().memory();
    let read = mem.traffic().nvme_read.bytes / steps as u64;
    (losses, mem.nvme_bytes(), read, mem.host_ledger().used_bytes_of(HostUse::OptimizerState))
}

#[test]
fn reduced_moments_train_in_fewer_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 12;
    let f32_cfg = config(dir.path(), "f32", "nvme", "f32");
    let f32_stream = oogc::train::optimizer_config(&f32_cfg).stream_config();
    // f32 compute copies hold f32 master weights: NVMe keeps the moments alone (8 B per parameter).
    assert!(f32_stream.master_in_copy && f32_stream.nvme_bytes_per_param() == 8.0, "{f32_stream:?}");
    let (f32_losses, f32_nvme, f32_read, _) = train(f32_cfg, steps);
    let (_, _, _, f32_host) = train(config(dir.path(), "f32h", "host", "f32"), 1);
    for (dtype, bytes_per_param) in [("bf16", 8.0), ("int8", 6.03125), ("bf16 master + int8", 4.03125)] {
        let cfg = config(dir.path(), &dtype.replace(' ', "_"), "nvme", dtype);
        let stream = oogc::train::optimizer_config(&cfg).stream_config();
        let (losses, nvme, read, _) = train(cfg, steps);
        // The same run up to the moments' rounding: the loss falls as f32's does and stays close.
        assert!(losses[steps - 1] < losses[0], "{dtype}: {losses:?}");
        for (a, b) in losses.iter().zip(&f32_losses) {
            assert!((a - b).abs() <= 0.02 * b, "{dtype}: loss {a} vs f32's {b}");
        }
        assert_ne!(losses, f32_losses, "{dtype}: not a different optimizer state");
        // NVMe streams about the dtype's share of f32's bytes per step (chunks padded to 4 KiB
        // and clipped steps' redos, which differ from f32's run, move it a little): its moments,
        // and its master weights unless the f32 compute copy holds them (a bf16 master's does
        // not). What the store holds is checked exactly before the first step (`train`); after
        // it, speculated units' second extents come and go with the step's timing.
        let (master, stored) = if dtype.starts_with("bf16 master") { (2.0, 2.0) } else { (4.0, 0.0) };
        assert_eq!(stream.nvme_bytes_per_param(), bytes_per_param - master + stored, "{dtype}");
        let want = stream.nvme_bytes_per_param() / f32_stream.nvme_bytes_per_param();
        let moved = read as f64 / f32_read as f64;
        assert!(nvme > 0 && f32_nvme > 0);
        assert!(moved < want + 0.08 && moved > want - 0.08, "{dtype}: read {read}/step vs f32 {f32_read}");
        // Host-placed state claims the dtype's bytes from the host ledger.
        let (_, _, _, host) = train(config(dir.path(), &format!("{}h", dtype.replace(' ', "_")), "host", dtype), 1);
        let (ratio, want) = (host as f64 / f32_host as f64, bytes_per_param / 12.0);
        assert!(ratio < want + 0.03 && ratio > want - 0.02, "{dtype}: host state {host} vs f32 {f32_host}");
    }
}

#[test]
fn reduced_moments_checkpoint_in_their_dtype_and_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    for (dtype, m_dtype, w_dtype) in
        [("bf16", "BF16", "F32"), ("int8", "I8", "F32"), ("bf16 master + f32", "F32", "BF16")]
    {
        for state in ["host", "nvme"] {
            let tag = dtype.replace(' ', "_");
            let config = |name: &str| config(dir.path(), &format!("{tag}-{state}-{name}"), state, dtype);
            common::assert_resume_continues_exactly(&config);
            let ckpt = oogc::checkpoint::load(&dir.path().join(format!("{tag}-{state}-parts")).join("ckpt")).unwrap();
            let moments = dtype.strip_prefix("bf16 master + ").unwrap_or(dtype);
            assert_eq!(ckpt.metadata.get("state_dtype").map(String::as_str), Some(moments));
            let m = ckpt.tensors.iter().find(|t| t.name.ends_with(".exp_avg")).unwrap();
            assert_eq!(format!("{:?}", m.data.dtype()), m_dtype, "{}", m.name);
            let w = ckpt.tensors.iter().find(|t| t.name.ends_with(".weight")).unwrap();
            assert_eq!(format!("{:?}", w.data.dtype()), w_dtype, "{}", w.name);
            let absmax = ckpt.tensors.iter().filter(|t| t.name.ends_with(".absmax")).count();
            assert_eq!(absmax, if dtype == "int8" { 2 * 6 } else { 0 }, "{dtype}: two per unit");
        }
    }
}

#[test]
fn a_checkpoint_of_another_state_dtype_is_refused_unless_converted() {
    let dir = tempfile::tempdir().unwrap();
    let int8 = config(dir.path(), "run", "nvme", "int8");
    let mut t = Trainer::new(int8.clone(), oogc::dist::Ranks::single()).unwrap();
    for _ in 0..3 {
        t.train_step().unwrap();
    }
    let ckpt = t.save_checkpoint().unwrap().unwrap().path;
    let saved: Vec<_> = t.runtime().units().ids().map(|u| t.runtime().unit_state(u).unwrap().into_f32()).collect();
    drop(t);
    let mut f32_cfg = int8.clone();
    f32_cfg.optimizer.state_dtype = StateDType::F32;
    let err = Trainer::resume(f32_cfg.clone(), oogc::dist::Ranks::single(), &ckpt).err().unwrap().to_string();
    for needle in ["int8", "f32", "--convert-state", "state_dtype"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // Converted on request: the moments are the int8 ones decoded, and training goes on.
    let from = ResumeFrom { path: &ckpt, convert_state: true };
    let mut t = Trainer::open(f32_cfg, oogc::dist::Ranks::single(), Some(from), &mut |_, _| {}).unwrap();
    let loaded: Vec<_> = t.runtime().units().ids().map(|u| t.runtime().unit_state(u).unwrap().into_f32()).collect();
    assert!(loaded == saved, "converted moments differ from the int8 ones decoded");
    let loss = t.train_step().unwrap().loss;
    assert!(loss.is_finite());
    drop(t);
    // The same dtype needs no flag; a corrupt tensor dtype is named.
    let mut c = oogc::checkpoint::load(&ckpt).unwrap();
    let m = c.tensors.iter_mut().find(|t| t.name.ends_with(".exp_avg_sq")).unwrap();
    let name = m.name.clone();
    m.data = TensorData::I8(vec![0; m.data.len()]);
    let bad = dir.path().join("bad");
    oogc::checkpoint::save(&bad, &c, 1).unwrap();
    let err = Trainer::resume(int8, oogc::dist::Ranks::single(), &bad).err().unwrap().to_string();
    assert!(err.contains(&name) && err.contains("I8"), "{err}");
    // A bf16 master's checkpoint into an f32-master run: refused naming master_dtype.
    let bf16 = config(dir.path(), "bf16m", "host", "bf16 master + f32");
    let mut t = Trainer::new(bf16.clone(), oogc::dist::Ranks::single()).unwrap();
    t.train_step().unwrap();
    let ckpt = t.save_checkpoint().unwrap().unwrap().path;
    drop(t);
    let mut f32_cfg = bf16;
    f32_cfg.optimizer.master_dtype = oogc_optimizer::MasterDType::F32;
    let err = Trainer::resume(f32_cfg.clone(), oogc::dist::Ranks::single(), &ckpt).err().unwrap().to_string();
    assert!(err.contains("master_dtype") && err.contains("--convert-state"), "{err}");
    let from = ResumeFrom { path: &ckpt, convert_state: true };
    assert!(Trainer::open(f32_cfg, oogc::dist::Ranks::single(), Some(from), &mut |_, _| {}).is_ok());
}

#[test]
fn an_unknown_state_dtype_is_refused_naming_the_key_and_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    let text = common::tiny("64MiB", "host", dir.path(), 2)
        .replace("clip_norm = 0.5", "clip_norm = 0.5\nstate_dtype = \"int4\"");
    let err = TrainConfig::from_toml_str(&text).unwrap_err().to_string();
    for needle in ["state_dtype", "int4", "f32", "bf16", "int8"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
}
