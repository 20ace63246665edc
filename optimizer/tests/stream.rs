//! NVMe-streamed optimizer state: bitwise equal to the in-memory update, bounded host memory,
//! old state intact (roll-back) and errors that leave nothing behind.

use half::bf16;
use oogc_optimizer::{
    adam_step_bf16_master, adam_step_moments, grad_sumsq, sr_key, state_nvme_bytes, stream_update, AdamConfig, CopyOut,
    GradSlice, Isa, MasterDType, MasterIn, MomentBufs, NvmeState, StateDType, StateFormat, StreamConfig, NORM_BLOCK,
};
use oogc_swapper::{NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig, TensorId};

fn store(dir: &std::path::Path) -> NvmeStore {
    NvmeStore::open(NvmeConfig::new(vec![dir.to_path_buf()], 64 << 20)).expect("open NVMe store in a temp dir")
}

fn pool(budget_bytes: u64) -> PinnedPool {
    PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes, lock: false })
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// [`stream_update`] without a compute copy out or norm partials.
fn no_copy(
    store: &NvmeStore,
    pool: &PinnedPool,
    isa: Isa,
    s: &oogc_optimizer::StepScalars,
    state: &NvmeState,
    master: MasterIn<'_>,
    g: GradSlice<'_>,
) -> oogc_optimizer::Result<(NvmeState, oogc_optimizer::StreamStats)> {
    stream_update(store, pool, isa, s, state, master, g, CopyOut::None, None)
}

/// The moments' bytes as stored.
fn moment_bytes(m: &MomentBufs) -> Vec<u8> {
    let mut out = vec![0u8; m.dtype().moment_bytes(m.len())];
    m.write_bytes(0..m.len(), &mut out);
    out
}

#[test]
fn streamed_update_equals_in_memory_update_bitwise() {
    for dtype in [StateDType::F32, StateDType::Bf16, StateDType::Int8] {
        streamed_update_equals_in_memory_update(StateFormat::with_moments(dtype));
        // bf16 master weights, stochastically rounded with the unit's key of the step.
        streamed_update_equals_in_memory_update(StateFormat { master: MasterDType::Bf16, moments: dtype });
    }
}

fn streamed_update_equals_in_memory_update(format: StateFormat) {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let dtype = format;
    let cfg = StreamConfig::with_format(2 * NORM_BLOCK, format).unwrap();
    let pool = pool(cfg.stream_host_bytes() + (1 << 20));
    let n = 5 * cfg.chunk_params + NORM_BLOCK + 77; // 6 chunks, the last one short
    let unit = TensorId(7);
    let (mut p, mut mom) = (data(n, 1), MomentBufs::zeros(format.moments, n));
    let bf16_master = format.master == MasterDType::Bf16;
    if bf16_master {
        p.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
    }
    let adam = AdamConfig::default();
    let mut state = NvmeState::write(&store, &pool, unit, cfg, &p, &mom).unwrap();
    assert_eq!(state.num_chunks(), 6);
    assert_eq!(store.used_bytes(), state_nvme_bytes(n, &cfg), "{dtype}");
    for t in 1..=3u64 {
        let g: Vec<bf16> = data(n, 100 + t as u32).iter().map(|&x| bf16::from_f32(x * 1e-2)).collect();
        let s = adam.scalars(t, 1e-3, if t == 2 { 0.25 } else { 1.0 }).unwrap();
        let mut copy_mem = vec![bf16::ZERO; n];
        let isa = Isa::detect();
        if bf16_master {
            let mut pb: Vec<bf16> = p.iter().map(|&x| bf16::from_f32(x)).collect();
            let (key, out) = (sr_key(unit.0, t), CopyOut::BF16(&mut copy_mem));
            adam_step_bf16_master(isa, &s, &mut pb, mom.view(), GradSlice::BF16(&g), out, key, 0).unwrap();
            p = pb.iter().map(|b| b.to_f32()).collect();
        } else {
            adam_step_moments(isa, &s, &mut p, mom.view(), GradSlice::BF16(&g), CopyOut::BF16(&mut copy_mem)).unwrap();
        }
        for stream_isa in Isa::available() {
            let mut copy = vec![bf16::ZERO; n];
            let mut partials = vec![0f64; n.div_ceil(NORM_BLOCK)];
            let (new, stats) = stream_update(
                &store,
                &pool,
                stream_isa,
                &s,
                &state,
                MasterIn::Stored,
                GradSlice::BF16(&g),
                CopyOut::BF16(&mut copy),
                Some(&mut partials),
            )
            .unwrap();
            assert_eq!(stats.chunks, 6);
            assert!(stats.peak_host_bytes <= cfg.stream_host_bytes());
            let chunk_bytes = |k: usize| format.bytes(cfg.chunk_params.min(n - k * cfg.chunk_params)) as u64;
            assert_eq!(stats.read_bytes, (0..6).map(chunk_bytes).sum::<u64>(), "{dtype}");
            let sumsq: f64 = partials.iter().fold(0.0, |a, &b| a + b);
            assert_eq!(sumsq.to_bits(), grad_sumsq(isa, GradSlice::BF16(&g)).unwrap().to_bits());
            let (np, nmom) = new.read(&store, &pool).unwrap();
            assert_eq!(bits(&np.unwrap()), bits(&p), "step {t} {stream_isa} {dtype}: p");
            assert_eq!(moment_bytes(&nmom), moment_bytes(&mom), "step {t} {stream_isa} {dtype}: moments");
            assert!(copy.iter().zip(&copy_mem).all(|(a, b)| a.to_bits() == b.to_bits()));
            if stream_isa == Isa::Scalar {
                // Commit: the old extents go, the new ones are the state.
                std::mem::replace(&mut state, new).free(&store);
            } else {
                // Roll back: the old state is untouched.
                new.free(&store);
            }
        }
    }
    assert_eq!(pool.live_bytes(), 0, "the stream kept host buffers");
    let used = store.used_bytes();
    assert_eq!(used, state.allocated_bytes(), "extents leaked");
    state.free(&store);
    assert_eq!(store.used_bytes(), 0);
}

#[test]
fn host_memory_is_bounded_by_the_pool_budget() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let cfg = StreamConfig::new(NORM_BLOCK).unwrap();
    let n = 10 * NORM_BLOCK;
    let (p, mom) = (data(n, 3), MomentBufs::zeros(StateDType::F32, n));
    let g = data(n, 4);
    let s = AdamConfig::default().scalars(1, 1e-3, 1.0).unwrap();
    // Exactly three chunk buffers: enough for read k+1 ‖ update k ‖ write k−1, nothing more.
    let exact = pool(cfg.stream_host_bytes());
    let state = NvmeState::write(&store, &exact, TensorId(1), cfg, &p, &mom).unwrap();
    let (new, stats) =
        no_copy(&store, &exact, Isa::detect(), &s, &state, MasterIn::Stored, GradSlice::F32(&g)).unwrap();
    assert_eq!(stats.peak_host_bytes, cfg.stream_host_bytes());
    assert_eq!(stats.chunks, 10);
    new.free(&store);
    // Two buffers' worth: refused up front with the host budget named, nothing written.
    let small = pool(2 * cfg.buffer_bytes());
    let before = store.used_bytes();
    let e = no_copy(&store, &small, Isa::detect(), &s, &state, MasterIn::Stored, GradSlice::F32(&g))
        .unwrap_err()
        .to_string();
    assert!(e.contains("host") && e.contains("unit #1"), "{e}");
    assert_eq!(store.used_bytes(), before);
    let (rp, _) = state.read(&store, &exact).unwrap();
    assert_eq!(bits(&rp.unwrap()), bits(&p));
    state.free(&store);
}

#[test]
fn wrong_gradient_length_names_the_unit() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let cfg = StreamConfig::new(NORM_BLOCK).unwrap();
    let pool = pool(cfg.stream_host_bytes());
    let p = data(100, 1);
    let mom = MomentBufs::F32 { m: p.clone(), v: p.clone() };
    let state = NvmeState::write(&store, &pool, TensorId(9), cfg, &p, &mom).unwrap();
    // Moments of another dtype than the stream's are refused naming the key.
    let int8 = MomentBufs::zeros(StateDType::Int8, 100);
    let e = NvmeState::write(&store, &pool, TensorId(9), cfg, &p, &int8).unwrap_err().to_string();
    assert!(e.contains("optimizer.state_dtype") && e.contains("int8"), "{e}");
    let s = AdamConfig::default().scalars(1, 1e-3, 1.0).unwrap();
    let e = no_copy(&store, &pool, Isa::Scalar, &s, &state, MasterIn::Stored, GradSlice::F32(&p[..99]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unit #9") && e.contains("100") && e.contains("99"), "{e}");
    assert!(StreamConfig::new(1000).is_err());
    state.free(&store);
}

/// The compute copy `bytes` as an update's output of the master's dtype.
fn out_of(master: MasterDType, bytes: &mut [u8]) -> CopyOut<'_> {
    match master {
        MasterDType::F32 => CopyOut::F32(bytemuck::cast_slice_mut(bytes)),
        MasterDType::Bf16 => CopyOut::BF16(bytemuck::cast_slice_mut(bytes)),
    }
}

/// One update of `state` with the master weights in the compute copy `copy` (bytes of the
/// master's dtype): read from it beside a fresh output (`in_place` false) or updated in place.
#[allow(clippy::too_many_arguments)]
fn aliased_step(
    store: &NvmeStore,
    pool: &PinnedPool,
    s: &oogc_optimizer::StepScalars,
    state: &NvmeState,
    master: MasterDType,
    g: &[bf16],
    copy: &mut Vec<u8>,
    in_place: bool,
) -> (NvmeState, oogc_optimizer::StreamStats) {
    let isa = Isa::detect();
    if in_place {
        stream_update(store, pool, isa, s, state, MasterIn::Out, GradSlice::BF16(g), out_of(master, copy), None)
            .unwrap()
    } else {
        let mut fresh = vec![0u8; copy.len()];
        let r = stream_update(
            store,
            pool,
            isa,
            s,
            state,
            MasterIn::Copy(copy),
            GradSlice::BF16(g),
            out_of(master, &mut fresh),
            None,
        )
        .unwrap();
        *copy = fresh;
        r
    }
}

#[test]
fn master_weights_kept_in_the_compute_copy_update_bitwise_as_stored_ones() {
    for master in [MasterDType::F32, MasterDType::Bf16] {
        for moments in [StateDType::F32, StateDType::Bf16, StateDType::Int8] {
            let format = StateFormat { master, moments };
            let dir = tempfile::tempdir().unwrap();
            let store = store(dir.path());
            let stored = StreamConfig::with_format(2 * NORM_BLOCK, format).unwrap();
            let aliased = stored.with_master_in_copy(true);
            let pool = pool(stored.stream_host_bytes() + aliased.stream_host_bytes());
            let n = 5 * stored.chunk_params + NORM_BLOCK + 77; // a short, odd last chunk
            let unit = TensorId(3);
            let mut p = data(n, 11);
            if master == MasterDType::Bf16 {
                p.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
            }
            // The compute copy holds the master weights bit for bit.
            let mut copy: Vec<u8> = match master {
                MasterDType::F32 => bytemuck::cast_slice(&p).to_vec(),
                MasterDType::Bf16 => p.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
            };
            let zeros = MomentBufs::zeros(moments, n);
            let mut a = NvmeState::write(&store, &pool, unit, stored, &p, &zeros).unwrap();
            let before = store.used_bytes();
            let mut b = NvmeState::write(&store, &pool, unit, aliased, &p, &zeros).unwrap();
            // The extents hold the moments alone.
            assert_eq!(store.used_bytes() - before, state_nvme_bytes(n, &aliased), "{format}");
            assert!(state_nvme_bytes(n, &aliased) < state_nvme_bytes(n, &stored), "{format}");
            let adam = AdamConfig { weight_decay: 0.1, ..Default::default() };
            for t in 1..=4u64 {
                let g: Vec<bf16> = data(n, 200 + t as u32).iter().map(|&x| bf16::from_f32(x * 1e-2)).collect();
                let s = adam.scalars(t, 1e-3, 1.0).unwrap();
                let mut want = vec![0u8; copy.len()];
                let out = out_of(master, &mut want);
                let isa = Isa::detect();
                let (na, sa) =
                    stream_update(&store, &pool, isa, &s, &a, MasterIn::Stored, GradSlice::BF16(&g), out, None)
                        .unwrap();
                let (nb, sb) = aliased_step(&store, &pool, &s, &b, master, &g, &mut copy, t % 2 == 0);
                assert_eq!(copy, want, "{format} step {t}: the compute copies");
                let (pa, ma) = na.read(&store, &pool).unwrap();
                let (pb, mb) = nb.read(&store, &pool).unwrap();
                assert!(pb.is_none(), "{format}: the aliased state stores no master weights");
                assert_eq!(moment_bytes(&ma), moment_bytes(&mb), "{format} step {t}: moments");
                // The stored master weights are the compute copy's values.
                let pa = pa.unwrap();
                let widened: Vec<f32> = match master {
                    MasterDType::F32 => bytemuck::cast_slice(&copy).to_vec(),
                    MasterDType::Bf16 => copy.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                };
                assert_eq!(bits(&pa), bits(&widened), "{format} step {t}: master");
                // The stream moves the moments alone: each chunk's master bytes fewer each way.
                let lens = [2 * NORM_BLOCK; 5].into_iter().chain([NORM_BLOCK + 77]);
                let master_bytes: u64 = lens.map(|len| master.master_bytes(len) as u64).sum();
                assert_eq!(sa.read_bytes - sb.read_bytes, master_bytes, "{format}: {sb:?} vs {sa:?}");
                assert_eq!(sa.written_bytes - sb.written_bytes, master_bytes, "{format}: {sb:?} vs {sa:?}");
                std::mem::replace(&mut a, na).free(&store);
                std::mem::replace(&mut b, nb).free(&store);
            }
            // A master source the layout does not take is refused naming the key.
            let g = vec![bf16::ZERO; n];
            let s = adam.scalars(5, 1e-3, 1.0).unwrap();
            let mut sink = vec![0f32; n];
            let refuse = |state: &NvmeState, master: MasterIn<'_>, out: CopyOut<'_>| {
                let (isa, g) = (Isa::Scalar, GradSlice::BF16(&g));
                stream_update(&store, &pool, isa, &s, state, master, g, out, None).unwrap_err().to_string()
            };
            let e = refuse(&b, MasterIn::Stored, CopyOut::F32(&mut sink));
            assert!(e.contains("optimizer.master_dtype") && e.contains("compute copy"), "{e}");
            let e = no_copy(&store, &pool, Isa::Scalar, &s, &a, MasterIn::Copy(&copy), GradSlice::BF16(&g))
                .unwrap_err()
                .to_string();
            assert!(e.contains("optimizer.master_dtype"), "{e}");
            let e = no_copy(&store, &pool, Isa::Scalar, &s, &b, MasterIn::Copy(&copy[..8]), GradSlice::BF16(&g))
                .unwrap_err()
                .to_string();
            assert!(e.contains("unit #3") && e.contains(&copy.len().to_string()), "{e}");
            // An output of another dtype than the master's cannot carry it.
            let mut other = vec![half::f16::ZERO; n];
            let e = refuse(&b, MasterIn::Copy(&copy), CopyOut::F16(&mut other));
            assert!(e.contains("optimizer.master_dtype"), "{e}");
            assert_eq!(pool.live_bytes(), 0);
            a.free(&store);
            b.free(&store);
            assert_eq!(store.used_bytes(), 0, "{format}: extents leaked");
        }
    }
}
