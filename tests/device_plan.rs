//! The device plan's unit backward against candle itself: the peak heap bytes of the composed
//! Llama's block, head and embedding backward on the CPU (`composed_only`: the op sequence a CUDA
//! device runs; f32, and f16 for the half dtypes' f32 upcasts — the CPU's bf16 matmul adds f32
//! copies a GPU does not make), counted by a `GlobalAlloc` over `System`, against
//! `oogc::runtime::device_plan`'s [`block_peak`], [`head_peak`] and [`embedding_peak`], on shapes
//! drawn with another seed than the shapes the coefficients were fitted on. The real check is on
//! the GPU (gpu-check compares the memory pool's peak with the plan).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};
use oogc::models::{init_unit_from_seed, CausalLm, Llama, LlamaConfig};
use oogc::runtime::device_plan::{block_peak, embedding_peak, head_peak, DeviceShape};
use oogc::swapper::DType as SwapperDType;

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static SERIAL: Mutex<()> = Mutex::new(());

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to `System` with the caller's arguments, so `System`'s
// guarantees hold; the counters are only read by the tests.
unsafe impl GlobalAlloc for Counting {
    /// # Safety
    /// As [`GlobalAlloc::alloc`].
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() && l.align() <= 16 {
            grew(l.size());
        }
        p
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(p, l) };
        if l.align() <= 16 {
            LIVE.fetch_sub(l.size(), Ordering::SeqCst);
        }
    }

    /// # Safety
    /// As [`GlobalAlloc::alloc_zeroed`].
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() && l.align() <= 16 {
            grew(l.size());
        }
        p
    }

    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() && l.align() <= 16 {
            if new >= l.size() {
                grew(new - l.size());
            } else {
                LIVE.fetch_sub(l.size() - new, Ordering::SeqCst);
            }
        }
        q
    }
}

#[global_allocator]
static A: Counting = Counting;

fn measure<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let r = f();
    (r, PEAK.load(Ordering::SeqCst) - base)
}

/// Within this of the measured peak (the fit's own shapes: −6.6 %…+3.5 %).
const TOLERANCE: f64 = 0.08;

#[test]
fn the_unit_backward_peaks_match_what_candle_allocates() {
    let _g = SERIAL.lock().unwrap();
    let mut seed = 987_654_321u64;
    let mut pick = |xs: &[usize]| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        xs[((seed >> 33) as usize) % xs.len()]
    };
    let mut failures = Vec::new();
    let mut checked = 0;
    for _ in 0..12 {
        let h = pick(&[2, 4, 8]);
        let kv = pick(&[1, 2, h]).min(h);
        let (hd, d) = (pick(&[16, 32, 64, 128]), pick(&[96, 128, 320, 512, 768]));
        let (b, t, i, v) =
            (pick(&[1, 2, 3]), pick(&[48, 96, 160, 256, 320]), pick(&[192, 384, 1536]), pick(&[768, 1536, 6144]));
        let chunk = pick(&[t, t / 2, 16, 32]).min(t);
        for (dtype, ours) in [(DType::F32, SwapperDType::F32), (DType::F16, SwapperDType::F16)] {
            let mut c = LlamaConfig::new(v, d, i, 1, h);
            c.num_key_value_heads = Some(kv);
            c.head_dim = Some(hd);
            c.max_position_embeddings = t;
            let m = Llama::new(c).unwrap().composed_only().with_attention_chunk(Some(chunk)).unwrap();
            let dev = Device::Cpu;
            let p = |u: usize| {
                let flat = init_unit_from_seed(&m.units()[u], 1);
                Tensor::from_slice(&flat, flat.len(), &dev).unwrap().to_dtype(dtype).unwrap()
            };
            let (pe, pb, ph) = (p(0), p(1), p(2));
            let ids: Vec<u32> = (0..b * t).map(|k| ((k * 7919) % v) as u32).collect();
            let tokens = Tensor::from_slice(&ids, (b, t), &dev).unwrap();
            let x = m.forward(0, &pe, &tokens, None).unwrap();
            let gy = x.affine(1e-2, 0.0).unwrap();
            // The model's caches (RoPE tables) filled by a first forward, as in a run.
            drop(m.forward(1, &pb, &x, None).unwrap());
            let (_, block) = measure(|| m.backward(1, &pb, &x, &gy, None).unwrap());
            let (_, head) = measure(|| m.head_loss_backward(&ph, &x, None, &tokens).unwrap());
            let (_, embedding) = measure(|| m.backward(0, &pe, &tokens, &gy, None).unwrap());
            let (b, t, d, i, h, kv, hd, v) =
                (b as u64, t as u64, d as u64, i as u64, h as u64, kv as u64, hd as u64, v as u64);
            let shape = DeviceShape {
                dtype: ours,
                batch: b,
                micro_batches: 1,
                seq: t,
                d_model: d,
                d_ff: i,
                heads: h,
                kv_heads: kv,
                head_dim: hd,
                layers: 1,
                vocab: v,
                block_params: pb.elem_count() as u64,
                block_largest_group: (2 * i * d).max(h * hd * d),
                head_params: ph.elem_count() as u64,
                embedding_params: pe.elem_count() as u64,
                tied_head: false,
                activation_offload: false,
                attention_chunk: Some(chunk as u64),
            };
            for (unit, measured, planned) in [
                ("block", block, block_peak(&shape).total_bytes()),
                ("head", head, head_peak(&shape).total_bytes()),
                ("embedding", embedding, embedding_peak(&shape).total_bytes()),
            ] {
                let err = planned as f64 / measured as f64 - 1.0;
                eprintln!("{dtype:?} b{b} t{t}/{chunk} d{d} I{i} H{h} KV{kv} hd{hd} V{v} {unit}: measured {measured} B, planned {planned} B ({:+.1} %)", 100.0 * err);
                checked += 1;
                if err.abs() > TOLERANCE {
                    failures.push(format!(
                        "{dtype:?} b{b} t{t} d{d} I{i} H{h} KV{kv} hd{hd} V{v} {unit}: {:+.1} %",
                        100.0 * err
                    ));
                }
            }
        }
    }
    assert_eq!(checked, 72);
    assert!(failures.is_empty(), "planned unit peaks off the measured by more than {TOLERANCE}: {failures:#?}");
}
