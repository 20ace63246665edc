//! NVMe-streamed optimizer state: bitwise equal to the in-memory update, bounded host memory,
//! old state intact (roll-back) and errors that leave nothing behind.

use half::bf16;
use oogc_optimizer::{
    adam_step_bf16_master, adam_step_moments, grad_sumsq, sr_key, state_nvme_bytes, stream_update, AdamConfig, CopyOut,
    GradSlice, Isa, MasterDType, MomentBufs, NvmeState, StateDType, StateFormat, StreamConfig, NORM_BLOCK,
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
    assert_eq!(store.used_bytes(), state_nvme_bytes(n, cfg.chunk_params, cfg.format), "{dtype}");
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
            assert_eq!(bits(&np), bits(&p), "step {t} {stream_isa} {dtype}: p");
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
        stream_update(&store, &exact, Isa::detect(), &s, &state, GradSlice::F32(&g), CopyOut::None, None).unwrap();
    assert_eq!(stats.peak_host_bytes, cfg.stream_host_bytes());
    assert_eq!(stats.chunks, 10);
    new.free(&store);
    // Two buffers' worth: refused up front with the host budget named, nothing written.
    let small = pool(2 * cfg.buffer_bytes());
    let before = store.used_bytes();
    let e = stream_update(&store, &small, Isa::detect(), &s, &state, GradSlice::F32(&g), CopyOut::None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("host") && e.contains("unit #1"), "{e}");
    assert_eq!(store.used_bytes(), before);
    let (rp, _) = state.read(&store, &exact).unwrap();
    assert_eq!(bits(&rp), bits(&p));
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
    let e = stream_update(&store, &pool, Isa::Scalar, &s, &state, GradSlice::F32(&p[..99]), CopyOut::None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unit #9") && e.contains("100") && e.contains("99"), "{e}");
    assert!(StreamConfig::new(1000).is_err());
    state.free(&store);
}
