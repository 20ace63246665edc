//! The pipelined step against the non-pipelined reference (all norms first, then every unit),
//! bitwise: without clipping, with clipping that triggers, with a non-finite gradient, with
//! NVMe-placed units, with a roll-back budget, and with many units and threads.

use std::sync::Arc;

use half::bf16;
use oogc_optimizer::sr_key;
use oogc_optimizer::{
    adam_step_bf16_master, adam_step_moments, clip_scale, global_norm, grad_sumsq, AdamConfig, CopyOut, DType,
    GradSlice, Grads, Isa, MasterDType, MomentBufs, NonFinite, OptimizerConfig, PipelinedOptimizer, StateDType,
    StateFormat, StatePlacement, UnitState, NORM_BLOCK,
};
use oogc_swapper::{NvmeConfig, NvmeStore, TensorId};

fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn grads(unit: u64, step: u64, n: usize, scale: f32) -> Vec<bf16> {
    noise(unit * 1000 + step, n, scale).into_iter().map(bf16::from_f32).collect()
}

/// The non-pipelined reference of the same steps: in-memory state per unit.
struct Reference {
    cfg: OptimizerConfig,
    /// Each unit's id, state and compute copy (bytes of `cfg.compute_dtype` in 4-byte words).
    units: Vec<(TensorId, UnitState, Vec<u32>)>,
}

/// The first `n` elements of `words` as an update's output of `dtype` (f32 or bf16).
fn out_of(dtype: DType, words: &mut [u32], n: usize) -> CopyOut<'_> {
    match dtype {
        DType::F32 => CopyOut::F32(&mut bytemuck::cast_slice_mut(words)[..n]),
        DType::BF16 => CopyOut::BF16(&mut bytemuck::cast_slice_mut(words)[..n]),
        other => panic!("the reference keeps f32 or bf16 copies, not {other}"),
    }
}

impl Reference {
    fn new(cfg: &OptimizerConfig) -> Self {
        Self { cfg: cfg.clone(), units: Vec::new() }
    }

    fn add(&mut self, id: TensorId, master: &[f32]) {
        let n = master.len();
        // A bf16 master holds the weights rounded to nearest even.
        let rounded: Vec<f32> = master.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        let master = if self.cfg.master_dtype == MasterDType::Bf16 { &rounded[..] } else { master };
        let mut copy = vec![0u32; (n * self.cfg.compute_dtype.size_in_bytes()).div_ceil(4)];
        let mut out = out_of(self.cfg.compute_dtype, &mut copy, n);
        match &mut out {
            CopyOut::F32(o) => o.copy_from_slice(master),
            CopyOut::BF16(o) => o.iter_mut().zip(master).for_each(|(o, &x)| *o = bf16::from_f32(x)),
            _ => unreachable!(),
        }
        let moments = MomentBufs::zeros(self.cfg.state_dtype, n);
        self.units.push((id, UnitState { master: master.to_vec(), moments }, copy));
        self.units.sort_by_key(|u| u.0);
    }

    /// Clip over all gradients, then step every unit. Returns (norm, scale, skipped).
    fn step(&mut self, t: u64, lr: f32, g: &[(TensorId, Vec<bf16>)]) -> (f64, f32, bool) {
        let isa = Isa::detect();
        let mut by_id: Vec<&(TensorId, Vec<bf16>)> = g.iter().collect();
        by_id.sort_by_key(|x| x.0);
        let norm = global_norm(by_id.iter().map(|(_, g)| grad_sumsq(isa, GradSlice::BF16(g)).unwrap()));
        if !norm.is_finite() {
            return (norm, 1.0, true);
        }
        let scale = clip_scale(norm, self.cfg.clip_norm);
        let s = self.cfg.adam.scalars(t, lr, scale).unwrap();
        for (id, gr) in by_id {
            let (_, st, copy) = self.units.iter_mut().find(|u| u.0 == *id).unwrap();
            let moments = st.moments.view();
            if self.cfg.master_dtype == MasterDType::Bf16 {
                let mut pb: Vec<bf16> = st.master.iter().map(|&x| bf16::from_f32(x)).collect();
                let n = st.master.len();
                let (key, out) = (sr_key(id.0, t), out_of(self.cfg.compute_dtype, copy, n));
                adam_step_bf16_master(isa, &s, &mut pb, moments, GradSlice::BF16(gr), out, key, 0).unwrap();
                st.master = pb.iter().map(|b| b.to_f32()).collect();
            } else {
                let out = out_of(self.cfg.compute_dtype, copy, st.master.len());
                adam_step_moments(isa, &s, &mut st.master, moments, GradSlice::BF16(gr), out).unwrap();
            }
        }
        (norm, scale, false)
    }

    fn check(&self, opt: &PipelinedOptimizer, what: &str) {
        for (id, st, copy) in &self.units {
            opt.wait_unit(*id).unwrap();
            let got = opt.export_state(*id).unwrap();
            assert!(bits(&got.master) == bits(&st.master), "{what}: unit {id} master differs");
            assert!(moment_bytes(&got.moments) == moment_bytes(&st.moments), "{what}: unit {id} moments differ");
            let len = st.master.len() * self.cfg.compute_dtype.size_in_bytes();
            opt.read_compute_copy(*id, |b| {
                assert!(b == &bytemuck::cast_slice::<u32, u8>(copy)[..len], "{what}: unit {id} copy")
            })
            .unwrap();
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The moments' bytes, as stored (f32 and bf16 values, int8 codes and absmaxes).
fn moment_bytes(m: &MomentBufs) -> Vec<u8> {
    let mut out = vec![0u8; m.dtype().moment_bytes(m.len())];
    m.write_bytes(0..m.len(), &mut out);
    out
}

const SIZES: [usize; 6] = [3 * NORM_BLOCK + 5, 1, 1000, NORM_BLOCK, 9 * NORM_BLOCK + 333, 17];

fn config(clip: Option<f32>, threads: usize) -> OptimizerConfig {
    OptimizerConfig {
        threads,
        clip_norm: clip,
        adam: AdamConfig { weight_decay: 0.1, ..Default::default() },
        compute_dtype: DType::BF16,
        stream_chunk_bytes: 12 * 2 * NORM_BLOCK,
        stream_host_budget_bytes: 8 << 20,
        ..Default::default()
    }
}

/// Runs `steps` (t, lr, gradient scale, poison unit) through both, checking after each.
fn run(
    opt: &PipelinedOptimizer,
    reference: &mut Reference,
    sizes: &[usize],
    steps: &[(u64, f32, f32, Option<usize>)],
) -> Vec<oogc_optimizer::StepReport> {
    let mut reports = Vec::new();
    for &(t, lr, gscale, poison) in steps {
        let mut all = Vec::new();
        opt.begin_step(t, lr).unwrap();
        // Backward order: last unit first.
        for (i, &n) in sizes.iter().enumerate().rev() {
            let mut g = grads(i as u64, t, n, gscale);
            if poison == Some(i) {
                g[n / 2] = bf16::NAN;
            }
            all.push((TensorId(i as u64), g.clone()));
            opt.submit(TensorId(i as u64), Grads::BF16(g)).unwrap();
        }
        let r = opt.finish_step().unwrap();
        let (norm, scale, skipped) = reference.step(t, lr, &all);
        assert_eq!(r.skipped, skipped, "step {t}");
        assert_eq!(r.step, t);
        if !skipped {
            assert_eq!(r.grad_norm.to_bits(), norm.to_bits(), "step {t} norm");
            assert_eq!(r.clip_scale.to_bits(), scale.to_bits(), "step {t} scale");
        }
        reference.check(opt, &format!("step {t}"));
        reports.push(r);
    }
    reports
}

fn setup(
    cfg: &OptimizerConfig,
    nvme: Option<Arc<NvmeStore>>,
    sizes: &[usize],
    place: impl Fn(usize) -> StatePlacement,
) -> (PipelinedOptimizer, Reference) {
    let opt = PipelinedOptimizer::new(cfg.clone(), nvme).unwrap();
    let mut reference = Reference::new(cfg);
    for (i, &n) in sizes.iter().enumerate() {
        let master = noise(77 + i as u64, n, 2.0);
        opt.add_unit(TensorId(i as u64), &master, place(i)).unwrap();
        reference.add(TensorId(i as u64), &master);
    }
    (opt, reference)
}

#[test]
fn pipelined_equals_reference_without_clipping() {
    let cfg = config(None, 2);
    let (opt, mut reference) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    let reports =
        run(&opt, &mut reference, &SIZES, &[(1, 1e-3, 1.0, None), (2, 9e-4, 1.0, None), (3, 8e-4, 0.1, None)]);
    for r in reports {
        assert_eq!((r.units, r.committed_speculative, r.redone, r.deferred), (6, 6, 0, 0), "{r:?}");
        assert_eq!(r.clip_scale, 1.0);
    }
    assert_eq!(opt.last_step(), Some(3));
}

#[test]
fn clipping_that_triggers_equals_clipping_after_the_whole_backward() {
    // Gradients of ~0.5 per element over ~200k elements: norm ~ 130; clip at 1 triggers;
    // then a step with tiny gradients that does not trigger.
    let cfg = config(Some(1.0), 2);
    let (opt, mut reference) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    let reports =
        run(&opt, &mut reference, &SIZES, &[(1, 1e-3, 1.0, None), (2, 1e-3, 1e-5, None), (3, 1e-3, 1.0, None)]);
    assert!(reports[0].clip_scale < 0.1, "{:?}", reports[0]);
    assert_eq!(reports[0].redone + reports[0].deferred, 6, "{:?}", reports[0]);
    assert_eq!(reports[1].clip_scale, 1.0, "{:?}", reports[1]);
    assert_eq!(reports[1].committed_speculative, 6, "{:?}", reports[1]);
    assert!(reports[2].clip_scale < 0.1);
}

#[test]
fn a_non_finite_gradient_skips_the_step_for_every_unit() {
    let cfg = config(Some(1.0), 2);
    let (opt, mut reference) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    // Poison the unit submitted last (unit 0), after every other unit speculated.
    let reports =
        run(&opt, &mut reference, &SIZES, &[(1, 1e-3, 1e-5, None), (2, 1e-3, 1e-5, Some(0)), (2, 1e-3, 1e-5, None)]);
    assert!(!reports[0].skipped);
    assert!(reports[1].skipped && !reports[1].grad_norm.is_finite(), "{:?}", reports[1]);
    assert!(!reports[2].skipped);
    assert_eq!(opt.last_step(), Some(2));
    // And the poisoned unit submitted first, without clipping.
    let cfg = config(None, 1);
    let (opt, mut reference) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    let reports = run(&opt, &mut reference, &SIZES, &[(1, 1e-3, 1.0, Some(5)), (1, 1e-3, 1.0, None)]);
    assert!(reports[0].skipped);
    assert_eq!(opt.last_step(), Some(1));
}

#[test]
fn immediate_updates_equal_the_reference_and_hold_no_gradients_to_the_step_end() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 256 << 20)).unwrap());
    let mut cfg = config(None, 2);
    cfg.nonfinite = NonFinite::Stop;
    assert!(cfg.updates_immediately());
    let place = |i: usize| if i.is_multiple_of(2) { StatePlacement::Nvme } else { StatePlacement::Host };
    let (opt, mut reference) = setup(&cfg, Some(store.clone()), &SIZES, place);
    let spec = opt.reserve_speculation(u64::MAX, u64::MAX).unwrap();
    assert_eq!((spec.speculative_units, spec.host_bytes, spec.nvme_bytes), (0, 0, 0), "{spec:?}");
    let ledger = opt.host_ledger().clone();
    let steps: [(u64, f32, f32); 3] = [(1, 1e-3, 1.0), (2, 9e-4, 1e-3), (3, 8e-4, 1.0)];
    for &(t, lr, gscale) in &steps {
        let mut all = Vec::new();
        opt.begin_step(t, lr).unwrap();
        for (i, &n) in SIZES.iter().enumerate().rev() {
            opt.wait_for_gradient_room();
            let g = grads(i as u64, t, n, gscale);
            all.push((TensorId(i as u64), g.clone()));
            opt.submit(TensorId(i as u64), Grads::BF16(g)).unwrap();
        }
        // Each unit is final once its job ends, before the step is closed: its gradients are gone.
        for (i, _) in SIZES.iter().enumerate() {
            opt.wait_unit(TensorId(i as u64)).unwrap();
        }
        assert_eq!(ledger.used_bytes_of(oogc_swapper::HostUse::Gradients), 0, "step {t}: gradients still held");
        let r = opt.finish_step().unwrap();
        let (norm, scale, skipped) = reference.step(t, lr, &all);
        assert!(!r.skipped && !skipped);
        assert_eq!(r.grad_norm.to_bits(), norm.to_bits(), "step {t} norm");
        assert_eq!((r.clip_scale, scale), (1.0, 1.0));
        assert_eq!((r.committed_speculative, r.redone, r.deferred), (0, 0, 0), "{r:?}");
        reference.check(&opt, &format!("immediate step {t}"));
    }
    // At most threads + 1 units' gradients were held at once (the largest units' bytes bound it).
    let peak = ledger.report().of(oogc_swapper::HostUse::Gradients).peak_bytes;
    let mut largest: Vec<usize> = SIZES.to_vec();
    largest.sort_unstable_by(|a, b| b.cmp(a));
    let bound: usize = largest.iter().take(cfg.gradients_in_flight()).map(|n| 2 * n).sum();
    assert!(peak as usize <= bound, "gradients peak {peak} > {bound}");
    assert_eq!(opt.last_step(), Some(3));
    drop(opt);
    assert_eq!(store.used_bytes(), 0, "extents left on the store");
}

#[test]
fn immediate_updates_stop_at_a_non_finite_gradient_and_leave_that_unit_untouched() {
    let mut cfg = config(None, 1);
    cfg.nonfinite = NonFinite::Stop;
    let (opt, _) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    let before = opt.export_state(TensorId(2)).unwrap();
    opt.begin_step(1, 1e-3).unwrap();
    for (i, &n) in SIZES.iter().enumerate().rev() {
        let mut g = grads(i as u64, 1, n, 1.0);
        if i == 2 {
            g[n / 2] = bf16::INFINITY;
        }
        opt.submit(TensorId(i as u64), Grads::BF16(g)).unwrap();
    }
    let e = opt.finish_step().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, oogc_optimizer::Error::NonFiniteGradient { step: 1, .. }), "{e:?}");
    assert!(msg.contains("not finite") && msg.contains("resume from the last checkpoint"), "{msg}");
    assert_eq!(opt.export_state(TensorId(2)).unwrap(), before, "the poisoned unit was updated");
    // A unit submitted before it (unit 5, the backward's first) was updated.
    assert_ne!(opt.export_state(TensorId(5)).unwrap().into_f32().1, vec![0.0; SIZES[5]]);
}

#[test]
fn nvme_placed_units_equal_the_reference_and_leave_no_extents() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 256 << 20)).unwrap());
    let cfg = config(Some(50.0), 2);
    let place = |i: usize| if i.is_multiple_of(2) { StatePlacement::Nvme } else { StatePlacement::Host };
    let (opt, mut reference) = setup(&cfg, Some(store.clone()), &SIZES, place);
    assert!(store.used_bytes() > 0);
    let reports = run(
        &opt,
        &mut reference,
        &SIZES,
        &[(1, 1e-3, 1e-3, None), (2, 1e-3, 1.0, None), (3, 1e-3, 1e-3, Some(4)), (3, 1e-3, 1e-3, None)],
    );
    assert_eq!(reports[0].committed_speculative, 6, "{:?}", reports[0]);
    assert!(reports[1].clip_scale < 1.0, "{:?}", reports[1]);
    assert!(reports[2].skipped);
    assert!(opt.stream_host_bytes() <= cfg.stream_host_budget_bytes);
    // Export/import round trip through NVMe.
    let st = opt.export_state(TensorId(4)).unwrap();
    let mut changed = st.clone();
    changed.master[0] += 1.0;
    opt.import_state(TensorId(4), changed.clone()).unwrap();
    assert_eq!(opt.export_state(TensorId(4)).unwrap(), changed);
    drop(opt);
    assert_eq!(store.used_bytes(), 0, "extents left on the store");
}

/// An empty state of `n` parameters (f32 moments).
fn opt_state(n: usize) -> oogc_optimizer::UnitState {
    oogc_optimizer::UnitState { master: vec![0.0; n], moments: MomentBufs::zeros(StateDType::F32, n) }
}

/// A snapshot taken between steps, read on another thread while the next step's speculated
/// updates run (before `finish_step` commits them), is the state of that moment — host-placed
/// and NVMe-placed, the master weights stored or in the compute copy — and is refused once the
/// unit's committed state has moved on (after a commit; after an immediate update), naming
/// the unit. The NVMe extents the reads held are freed.
#[test]
fn snapshots_read_the_state_they_were_taken_at_until_it_changes() {
    for master_in_copy in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 256 << 20)).unwrap());
        let mut cfg = config(Some(50.0), 2);
        if master_in_copy {
            cfg.compute_dtype = DType::F32;
        }
        let place = |i: usize| if i.is_multiple_of(2) { StatePlacement::Nvme } else { StatePlacement::Host };
        let (opt, mut reference) = setup(&cfg, Some(store.clone()), &SIZES, place);
        let case = format!("master in copy {master_in_copy}");
        run(&opt, &mut reference, &SIZES, &[(1, 1e-3, 1e-3, None)]);
        let ids: Vec<TensorId> = (0..SIZES.len() as u64).map(TensorId).collect();
        let then: Vec<_> = ids.iter().map(|&u| opt.export_state(u).unwrap()).collect();
        let snaps: Vec<_> = ids.iter().map(|&u| opt.snapshot_state(u).unwrap()).collect();
        // Step 2's updates speculate (out of place) while the snapshots are read.
        opt.begin_step(2, 1e-3).unwrap();
        for (i, &n) in SIZES.iter().enumerate().rev() {
            opt.submit(TensorId(i as u64), Grads::BF16(grads(i as u64, 2, n, 1e-3))).unwrap();
        }
        // Into one staging reused unit after unit (sizes up and down), as a checkpoint's writer.
        let read = std::thread::spawn(move || {
            let mut staging = opt_state(0);
            snaps.into_iter().map(|s| s.read_into(&mut staging).map(|()| staging.clone()).unwrap()).collect::<Vec<_>>()
        });
        assert_eq!(read.join().unwrap(), then, "{case}");
        let r = opt.finish_step().unwrap();
        assert_eq!(r.committed_speculative, SIZES.len(), "{case}: {r:?}");
        assert_ne!(opt.export_state(TensorId(4)).unwrap(), then[4], "{case}: step 2 updated unit 4");
        // A snapshot read after its unit's commit is refused.
        let stale = opt.snapshot_state(TensorId(3)).unwrap();
        opt.begin_step(3, 1e-3).unwrap();
        for (i, &n) in SIZES.iter().enumerate().rev() {
            opt.submit(TensorId(i as u64), Grads::BF16(grads(i as u64, 3, n, 1e-3))).unwrap();
        }
        opt.finish_step().unwrap();
        let err = stale.read().unwrap_err().to_string();
        assert!(err.contains("unit #3") && err.contains("updated since the snapshot"), "{case}: {err}");
        drop(opt);
        assert_eq!(store.used_bytes(), 0, "{case}: extents left on the store");
    }
    // Immediate updates change the state at the unit's update: a snapshot read after it fails.
    let mut cfg = config(None, 1);
    cfg.nonfinite = oogc_optimizer::NonFinite::Stop;
    let (opt, _) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    let snap = opt.snapshot_state(TensorId(5)).unwrap();
    opt.begin_step(1, 1e-3).unwrap();
    opt.submit(TensorId(5), Grads::BF16(grads(5, 1, SIZES[5], 1e-3))).unwrap();
    opt.wait_unit(TensorId(5)).unwrap();
    let err = snap.read().unwrap_err().to_string();
    assert!(err.contains("unit #5") && err.contains("updated since the snapshot"), "{err}");
}

#[test]
fn rollback_budget_bounds_the_second_buffers_and_defers_the_rest() {
    let mut cfg = config(None, 2);
    // Room for the second buffers of the first unit only (12 B + 2 B per parameter).
    cfg.rollback_budget_bytes = Some(14 * SIZES[0] as u64 + 4096);
    let (opt, mut reference) = setup(&cfg, None, &SIZES, |_| StatePlacement::Host);
    assert!(opt.rollback_bytes() <= cfg.rollback_budget_bytes.unwrap());
    let reports =
        run(&opt, &mut reference, &SIZES, &[(1, 1e-3, 1.0, None), (2, 1e-3, 1.0, Some(2)), (2, 1e-3, 1.0, None)]);
    // Units 0, 1 and 5 fit (first come, first served); 2, 3 and 4 do not.
    assert_eq!((reports[0].committed_speculative, reports[0].deferred), (3, 3), "{:?}", reports[0]);
    assert!(reports[1].skipped);
}

#[test]
fn many_units_from_several_threads_equal_the_reference() {
    let sizes: Vec<usize> = (0..40).map(|i| [777, NORM_BLOCK + 1, 5 * NORM_BLOCK, 3][i % 4] + i).collect();
    for clip in [None, Some(3.0)] {
        let cfg = config(clip, 3);
        let (opt, mut reference) = setup(&cfg, None, &sizes, |_| StatePlacement::Host);
        let opt = Arc::new(opt);
        for t in 1..=3u64 {
            opt.begin_step(t, 1e-3).unwrap();
            let all: Vec<(TensorId, Vec<bf16>)> =
                (0..sizes.len()).map(|i| (TensorId(i as u64), grads(i as u64, t, sizes[i], 0.02))).collect();
            std::thread::scope(|s| {
                for part in all.chunks(10) {
                    let opt = opt.clone();
                    s.spawn(move || {
                        for (id, g) in part.iter().rev() {
                            opt.submit(*id, Grads::BF16(g.clone())).unwrap();
                        }
                    });
                }
            });
            let r = opt.finish_step().unwrap();
            let (norm, scale, _) = reference.step(t, 1e-3, &all);
            assert_eq!(r.grad_norm.to_bits(), norm.to_bits());
            assert_eq!(r.clip_scale, scale);
            if clip.is_some() {
                assert!(scale < 1.0, "the clip should trigger: norm {norm}");
            }
            reference.check(&opt, &format!("clip {clip:?} step {t}"));
        }
    }
}

#[test]
fn handles_and_protocol_errors() {
    let cfg = config(None, 1);
    let (opt, _) = setup(&cfg, None, &[100, 200], |_| StatePlacement::Host);
    let e = opt.submit(TensorId(0), Grads::BF16(vec![bf16::ZERO; 100])).unwrap_err().to_string();
    assert!(e.contains("begin_step"), "{e}");
    opt.begin_step(1, 1e-3).unwrap();
    assert!(opt.begin_step(2, 1e-3).unwrap_err().to_string().contains("finish_step"));
    let e = opt.submit(TensorId(1), Grads::F32(vec![0.0; 99])).unwrap_err().to_string();
    assert!(e.contains("unit #1") && e.contains("200") && e.contains("99"), "{e}");
    let e = opt.submit(TensorId(5), Grads::F32(vec![0.0; 5])).unwrap_err().to_string();
    assert!(e.contains("#5") && e.contains("add_unit"), "{e}");
    let h = opt.submit(TensorId(0), Grads::F32(vec![0.5; 100])).unwrap();
    assert!(opt.submit(TensorId(0), Grads::F32(vec![0.5; 100])).unwrap_err().to_string().contains("twice"));
    assert!(opt.add_unit(TensorId(9), &[1.0], StatePlacement::Host).unwrap_err().to_string().contains("begin_step"));
    assert!(opt.export_state(TensorId(0)).is_err());
    assert!(opt.add_unit(TensorId(0), &[1.0], StatePlacement::Nvme).is_err());
    let mut before = Vec::new();
    opt.read_compute_copy(TensorId(0), |b| before = b.to_vec()).unwrap();
    let r = opt.finish_step().unwrap();
    h.wait().unwrap();
    assert!(h.is_ready() && h.unit() == TensorId(0));
    assert_eq!(r.units, 1, "unit 1 was not submitted: not updated");
    let mut after = Vec::new();
    opt.read_compute_copy(TensorId(0), |b| after = b.to_vec()).unwrap();
    assert_eq!(after.len(), 200);
    assert_ne!(before, after, "the committed copy changed");
    assert_eq!(opt.export_state(TensorId(1)).unwrap().into_f32().1, vec![0.0; 200]);
    let e = PipelinedOptimizer::new(cfg.clone(), None).unwrap().add_unit(TensorId(3), &[1.0], StatePlacement::Nvme);
    assert!(e.unwrap_err().to_string().contains("NvmeStore"));
}

/// The compute copy has one home: the optimizer writes a speculated unit's new copy there only
/// once the step is final (publish), a deferred unit's straight into it after the decision; and
/// every host byte it holds is claimed from its ledger by category.
#[test]
fn one_home_per_compute_copy_and_every_host_byte_claimed() {
    use oogc_optimizer::{speculation_cost, state_host_bytes, ComputeCopyHome, MemoryHome};
    use oogc_swapper::{HostLedger, HostUse};
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 64 << 20)).unwrap());
    let cfg = config(None, 2);
    let ledger = HostLedger::new(1 << 30);
    let home = Arc::new(MemoryHome::new());
    let opt = PipelinedOptimizer::with_home(cfg.clone(), Some(store), ledger.clone(), home.clone()).unwrap();
    let sizes = [3 * NORM_BLOCK + 5, 1000, 2 * NORM_BLOCK];
    let place = |i: usize| if i == 1 { StatePlacement::Nvme } else { StatePlacement::Host };
    let mut reference = Reference::new(&cfg);
    for (i, &n) in sizes.iter().enumerate() {
        let master = noise(5 + i as u64, n, 1.0);
        opt.add_unit(TensorId(i as u64), &master, place(i)).unwrap();
        reference.add(TensorId(i as u64), &master);
    }
    let state: u64 = sizes.iter().enumerate().map(|(i, &n)| state_host_bytes(n, place(i), cfg.state_format())).sum();
    assert_eq!(ledger.used_bytes_of(HostUse::OptimizerState), state);
    // Room for the second buffers of units 0 and 1 only: unit 2 is deferred.
    let cost = |i: usize| speculation_cost(sizes[i], place(i), DType::BF16, &cfg.stream_config());
    let room = cost(0).0 + cost(1).0;
    let spec = opt.reserve_speculation(room, u64::MAX).unwrap();
    assert_eq!((spec.speculative_units, spec.deferred_units), (2, 1), "{spec:?}");
    assert_eq!(ledger.used_bytes_of(HostUse::Speculation), room);
    let home_copy = |id: u64| {
        let mut v = Vec::new();
        home.read(TensorId(id), &mut |b| v = b.to_vec()).unwrap();
        v
    };
    let before: Vec<Vec<u8>> = (0..3).map(home_copy).collect();
    opt.begin_step(1, 1e-3).unwrap();
    let mut all = Vec::new();
    for (i, &n) in sizes.iter().enumerate().rev() {
        let g = grads(i as u64, 1, n, 0.1);
        all.push((TensorId(i as u64), g.clone()));
        opt.submit(TensorId(i as u64), Grads::BF16(g)).unwrap();
    }
    for i in 0..3 {
        opt.wait_unit(TensorId(i)).unwrap();
    }
    assert!(ledger.used_bytes_of(HostUse::Gradients) > 0, "gradients are held until the step is final");
    assert_eq!((0..3).map(home_copy).collect::<Vec<_>>(), before, "no home changes while the step is open");
    let r = opt.finish_step().unwrap();
    assert_eq!((r.committed_speculative, r.deferred), (2, 1), "{r:?}");
    reference.step(1, 1e-3, &all);
    for i in 0..3 {
        opt.wait_unit(TensorId(i)).unwrap();
    }
    assert_eq!(ledger.used_bytes_of(HostUse::Gradients), 0, "given back once the update is final");
    assert_eq!(home_copy(0), before[0], "a speculated unit's copy waits for publish");
    assert_ne!(home_copy(2), before[2], "a deferred unit wrote its home after the decision");
    reference.check(&opt, "before publish");
    for i in 0..3 {
        opt.publish(TensorId(i)).unwrap();
    }
    for (id, st, copy) in &reference.units {
        let len = st.master.len() * cfg.compute_dtype.size_in_bytes();
        assert_eq!(home_copy(id.0), bytemuck::cast_slice::<u32, u8>(copy)[..len], "unit {id} home after publish");
    }
    assert!(ledger.used_bytes_of(HostUse::NvmeStream) <= cfg.stream_host_budget_bytes);
    assert!(ledger.peak_bytes() >= state + room);
}

#[test]
fn shards_of_a_model_joined_by_a_norm_reduce_update_as_the_whole_model() {
    // Two optimizers each hold half of the units (as two data-parallel ranks hold their shards);
    // each one's norm reduce adds the other half's sum of squares (an all-reduce of two). With
    // clipping that triggers, every unit must update as the one optimizer of the reference.
    let cfg = config(Some(1.0), 2);
    let isa = Isa::detect();
    let halves: [Vec<usize>; 2] = [vec![0, 1, 2], vec![3, 4, 5]];
    let mut reference = Reference::new(&cfg);
    let mut shards = Vec::new();
    for half in &halves {
        let opt = PipelinedOptimizer::new(cfg.clone(), None).unwrap();
        let other = Arc::new(parking_lot::Mutex::new(0.0f64));
        let o = other.clone();
        opt.set_norm_reduce(Arc::new(move |sumsq| Ok(sumsq + *o.lock())));
        for &i in half {
            let master = noise(77 + i as u64, SIZES[i], 2.0);
            opt.add_unit(TensorId(i as u64), &master, StatePlacement::Host).unwrap();
            reference.add(TensorId(i as u64), &master);
        }
        shards.push((opt, other));
    }
    let mut scales = Vec::new();
    for (t, gscale) in [(1u64, 1.0f32), (2, 1e-5), (3, 1.0)] {
        let all: Vec<(TensorId, Vec<bf16>)> =
            (0..SIZES.len()).rev().map(|i| (TensorId(i as u64), grads(i as u64, t, SIZES[i], gscale))).collect();
        let sumsq = |half: &[usize]| -> f64 {
            half.iter()
                .map(|&i| {
                    grad_sumsq(isa, GradSlice::BF16(&all.iter().find(|g| g.0 .0 == i as u64).unwrap().1)).unwrap()
                })
                .sum()
        };
        let partial = [sumsq(&halves[0]), sumsq(&halves[1])];
        let mut reports = Vec::new();
        for (k, (opt, other)) in shards.iter().enumerate() {
            *other.lock() = partial[1 - k];
            opt.begin_step(t, 1e-3).unwrap();
            for (id, g) in all.iter().filter(|(id, _)| halves[k].contains(&(id.0 as usize))) {
                opt.submit(*id, Grads::BF16(g.clone())).unwrap();
            }
            reports.push(opt.finish_step().unwrap());
        }
        let (norm, scale, _) = reference.step(t, 1e-3, &all);
        scales.push(scale);
        for r in &reports {
            assert!((r.grad_norm - norm).abs() <= 1e-12 * norm, "step {t}: norm {} vs {norm}", r.grad_norm);
            assert_eq!(r.clip_scale.to_bits(), scale.to_bits(), "step {t}: the shards clip as the whole model");
        }
        for (k, (opt, _)) in shards.iter().enumerate() {
            for &i in &halves[k] {
                let id = TensorId(i as u64);
                opt.wait_unit(id).unwrap();
                let got = opt.export_state(id).unwrap();
                let (_, want, _) = reference.units.iter().find(|u| u.0 == id).unwrap();
                assert!(bits(&got.master) == bits(&want.master), "step {t}: unit {i} master differs");
                assert!(got.moments == want.moments, "step {t}: unit {i} moments differ");
            }
        }
    }
    // Steps 1 and 3 clipped (a shard alone would have clipped less), step 2 did not.
    assert!(scales[0] < 0.1 && scales[1] == 1.0 && scales[2] < 0.1, "{scales:?}");
}

/// bf16 and int8 moments, host- and NVMe-placed, speculated, clipped, redone, skipped and
/// deferred: the pipelined step gives the bits of [`adam_step_moments`] over the whole model,
/// and the state takes the bytes its dtype says. With bf16 compute copies and bf16 masters, and
/// with f32 copies and f32 masters, NVMe-placed units keep their master weights in the compute
/// copy ([`OptimizerConfig::master_in_compute_copy`]): the same bits.
#[test]
fn reduced_moments_equal_the_reference_on_host_and_nvme() {
    let formats = [
        (StateFormat::with_moments(StateDType::Bf16), DType::BF16),
        (StateFormat::with_moments(StateDType::Int8), DType::BF16),
        (StateFormat { master: MasterDType::Bf16, moments: StateDType::F32 }, DType::BF16),
        (StateFormat { master: MasterDType::Bf16, moments: StateDType::Int8 }, DType::BF16),
        (StateFormat::with_moments(StateDType::Int8), DType::F32),
        (StateFormat::with_moments(StateDType::F32), DType::F32),
    ];
    for (format, compute) in formats {
        let dtype = format.moments;
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 256 << 20)).unwrap());
        // Step 2's gradients have a norm of 133.6, 117 without unit 0's (the last submitted)
        // and 74 without unit 4's: with a clip of 125 the running norm passes it only once
        // both are in, so the units submitted before them (unit 5 first) speculate and are
        // redone whatever order the pool runs the jobs in (with a clip of 50, unit 4's alone
        // passed it, and a run whose pool finished unit 4 before starting unit 5 speculated
        // nothing).
        let mut cfg = config(Some(125.0), 2);
        cfg.state_dtype = dtype;
        cfg.master_dtype = format.master;
        cfg.compute_dtype = compute;
        let aliased =
            matches!((format.master, compute), (MasterDType::F32, DType::F32) | (MasterDType::Bf16, DType::BF16));
        assert_eq!(cfg.master_in_compute_copy(), aliased, "{format} with {compute} copies");
        // A roll-back budget for a few units: the rest are deferred (updated in place).
        cfg.rollback_budget_bytes = Some(40_000);
        let place = |i: usize| if i.is_multiple_of(2) { StatePlacement::Nvme } else { StatePlacement::Host };
        let (opt, mut reference) = setup(&cfg, Some(store.clone()), &SIZES, place);
        let reports = run(
            &opt,
            &mut reference,
            &SIZES,
            &[(1, 1e-3, 1e-3, None), (2, 1e-3, 1.0, None), (3, 1e-3, 1e-3, Some(4)), (3, 1e-3, 1e-3, None)],
        );
        assert!(reports[0].committed_speculative > 0 && reports[0].deferred > 0, "{dtype}: {:?}", reports[0]);
        assert!(reports[1].clip_scale < 1.0 && reports[1].redone > 0, "{dtype}: {:?}", reports[1]);
        assert!(reports[2].skipped, "{dtype}");
        let st = opt.export_state(TensorId(4)).unwrap();
        assert_eq!(st.moments.dtype(), dtype);
        let is_bf16 = st.master.iter().all(|&x| bf16::from_f32(x).to_f32() == x);
        assert_eq!(is_bf16, format.master == MasterDType::Bf16, "{format}: the master weights' values");
        // The NVMe units' extents hold their dtype's bytes (chunks of 2 blocks, padded to 4 KiB).
        let nvme: u64 = SIZES
            .iter()
            .enumerate()
            .filter(|(i, _)| place(*i) == StatePlacement::Nvme)
            .map(|(_, &n)| oogc_optimizer::state_nvme_bytes(n, &cfg.stream_config()))
            .sum();
        assert_eq!(store.used_bytes(), nvme, "{dtype}");
        let f32_stream = config(None, 1).stream_config();
        let f32_nvme: u64 = [0, 2, 4].iter().map(|&i| oogc_optimizer::state_nvme_bytes(SIZES[i], &f32_stream)).sum();
        assert!(nvme < f32_nvme, "{dtype}: {nvme} NVMe bytes, not fewer than f32's {f32_nvme}");
        // Export and import keep every bit (the int8 codes and absmaxes as they are).
        let mut changed = st.clone();
        changed.master[0] += 1.0;
        opt.import_state(TensorId(4), changed.clone()).unwrap();
        assert_eq!(opt.export_state(TensorId(4)).unwrap(), changed);
        // f32 moments imported into a reduced optimizer are converted to its dtype.
        let (p, m, v) = st.clone().into_f32();
        let n = SIZES[3];
        let f32_state = UnitState::from_f32(p[..n].to_vec(), m[..n].to_vec(), v[..n].to_vec()).unwrap();
        opt.import_state(TensorId(3), f32_state).unwrap();
        assert_eq!(opt.export_state(TensorId(3)).unwrap().moments.dtype(), dtype);
        drop(opt);
        assert_eq!(store.used_bytes(), 0, "{dtype}: extents left on the store");
    }
}

/// A data-parallel rank's shard: a unit's elements `offset..` added with
/// [`PipelinedOptimizer::add_shard`] at a block boundary. Two optimizers holding the two shards
/// of a unit (bf16 master weights, int8 moments; host- and NVMe-placed) update it bit for bit as
/// one optimizer holding it whole: the shards' int8 blocks are the whole unit's, and the
/// stochastic rounding keys on the element's index in the unit. A shard added at offset 0
/// instead rounds otherwise. A rank whose shard is empty (a unit of one block over 2 ranks) holds
/// and steps nothing.
#[test]
fn shards_added_at_their_offsets_update_as_the_whole_unit() {
    let block = oogc_optimizer::QUANT_BLOCK;
    let n = NORM_BLOCK + 3 * block + 77;
    let cut = 9 * block;
    let id = TensorId(3);
    let master = noise(5, n, 2.0);
    let cases = [StatePlacement::Host, StatePlacement::Nvme].into_iter().flat_map(|p| [(p, false), (p, true)]);
    for (place, immediate) in cases {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(NvmeStore::open(NvmeConfig::new(vec![dir.path().to_path_buf()], 64 << 20)).unwrap());
        let mut cfg = config(None, 2);
        // Speculated updates write the new compute copy into second buffers; immediate ones
        // straight into its home.
        if immediate {
            cfg.nonfinite = NonFinite::Stop;
        }
        assert_eq!(cfg.updates_immediately(), immediate);
        cfg.state_dtype = StateDType::Int8;
        cfg.master_dtype = MasterDType::Bf16;
        let make = || PipelinedOptimizer::new(cfg.clone(), Some(store.clone())).unwrap();
        let whole = make();
        whole.add_unit(id, &master, place).unwrap();
        let ranges = [0..cut, cut..n];
        let shards: Vec<PipelinedOptimizer> = ranges
            .iter()
            .map(|r| {
                let opt = make();
                opt.add_shard(id, &master[r.clone()], r.start, place).unwrap();
                opt
            })
            .collect();
        // A third rank's empty shard, at the unit's end.
        let nothing = make();
        nothing.add_shard(id, &[], n, place).unwrap();
        // The second shard as if it were a unit of its own (offset 0).
        let unaligned = make();
        unaligned.add_unit(id, &master[cut..], place).unwrap();
        for t in 1..=3u64 {
            let g = grads(3, t, n, 1.0);
            let step = |opt: &PipelinedOptimizer, r: std::ops::Range<usize>| {
                opt.begin_step(t, 1e-2).unwrap();
                opt.submit(id, Grads::BF16(g[r].to_vec())).unwrap();
                assert!(!opt.finish_step().unwrap().skipped);
                opt.wait_unit(id).unwrap();
            };
            step(&whole, 0..n);
            for (opt, r) in shards.iter().zip(&ranges) {
                step(opt, r.clone());
            }
            step(&unaligned, cut..n);
            step(&nothing, n..n);
        }
        let empty = nothing.export_state(id).unwrap();
        assert!(empty.master.is_empty() && empty.moments.is_empty() && empty.moments.dtype() == StateDType::Int8);
        let want = whole.export_state(id).unwrap();
        let want_moments = moment_bytes(&want.moments);
        let mut joined_master = Vec::new();
        for (opt, r) in shards.iter().zip(&ranges) {
            let got = opt.export_state(id).unwrap();
            assert!(bits(&got.master) == bits(&want.master[r.clone()]), "{place:?}: shard {r:?}'s master weights");
            let mut whole_part = vec![0u8; StateDType::Int8.moment_bytes(r.len())];
            want.moments.write_bytes(r.clone(), &mut whole_part);
            assert!(moment_bytes(&got.moments) == whole_part, "{place:?}: shard {r:?}'s int8 codes and absmaxes");
            joined_master.extend(got.master);
        }
        assert_eq!(joined_master.len(), n);
        assert!(want_moments.len() > 2 * n, "int8 moments with their absmaxes");
        let off = unaligned.export_state(id).unwrap();
        let differ = bits(&off.master).iter().zip(bits(&want.master[cut..])).filter(|(a, b)| **a != *b).count();
        assert!(differ > 0, "{place:?}: a shard rounding by its own indices matched the whole unit");
    }
}
