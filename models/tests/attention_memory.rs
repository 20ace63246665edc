//! The attention core's memory against the plan's bound
//! ([`oogc_models::attention_workspace_bytes`]), measured by a counting global allocator (the
//! test binary's only test, so nothing else allocates beside it): for blocks of query
//! positions that divide T, that do not, and one block, in F32 and BF16 (whose CPU matmuls widen
//! their operands to F32), the peak bytes live during the forward (with autograd on, so with the
//! op's copy of the output) and during the explicit backward, plus the inputs and outputs the
//! bound counts, stay within `forward_peak_bytes` and `backward_peak_bytes`; each peak holds at
//! least the largest block's scores (`scores_chunk_bytes`), and the whole sequence as one block
//! takes more than the chunked bound — the blocks are what keep it small.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor, Var};
use oogc_models::attention::{causal_attention, causal_attention_backward};
use oogc_models::{attention_workspace_bytes, AttentionShape};

/// Bytes the process has allocated and not freed, and their high-water mark since the last
/// [`measure`] began.
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

/// `System` with every live byte counted.
struct Counting;

// SAFETY: every call is forwarded to `System` with the caller's arguments, so `System`'s
// guarantees hold; the counters are plain atomics touched after the call.
unsafe impl GlobalAlloc for Counting {
    /// # Safety
    /// As [`GlobalAlloc::alloc`].
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    /// # Safety
    /// As [`GlobalAlloc::alloc_zeroed`].
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` (through this allocator) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// `f()` and the peak of live bytes above those live when it began.
fn measure<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let start = CURRENT.load(Ordering::SeqCst);
    PEAK.store(start, Ordering::SeqCst);
    let out = f();
    (out, (PEAK.load(Ordering::SeqCst) - start) as u64)
}

fn bytes(ts: &[&Tensor]) -> u64 {
    ts.iter().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
}

#[test]
fn attention_memory_stays_within_the_plans_bound() {
    let shape = AttentionShape { batch: 1, seq_len: 512, heads: 8, kv_heads: 2, head_dim: 32 };
    let (b, t, h, kv, hd) = (shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim);
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16] {
        let rand = |dims: &[usize], scale: f64| {
            (Tensor::randn(0f32, 1f32, dims, &dev).unwrap() * scale).unwrap().to_dtype(dtype).unwrap()
        };
        let q = rand(&[b, h, t, hd], 1.0 / (hd as f64).sqrt());
        let (k, v) = (rand(&[b, kv, t, hd], 1.0), rand(&[b, kv, t, hd], 1.0));
        let gy = rand(&[b, t, h, hd], 1.0);
        let (qv, kvv, vv) =
            (Var::from_tensor(&q).unwrap(), Var::from_tensor(&k).unwrap(), Var::from_tensor(&v).unwrap());
        let chunked = attention_workspace_bytes(shape, 32, dtype);
        for chunk in [32, 100, t] {
            let bound = attention_workspace_bytes(shape, chunk, dtype);
            // Warm up (gemm's packing buffers, first-use caches), then measure.
            let _ = causal_attention_backward(&q, &k, &v, &gy, chunk).unwrap();
            let (y, fwd) =
                measure(|| causal_attention(qv.as_tensor(), kvv.as_tensor(), vv.as_tensor(), chunk).unwrap());
            let fwd_total = fwd + bytes(&[&q, &k, &v]);
            let (grads, bwd) = measure(|| causal_attention_backward(&q, &k, &v, &gy, chunk).unwrap());
            let bwd_total = bwd + bytes(&[&q, &k, &v, &y, &gy]);
            eprintln!(
                "{dtype:?} chunk {chunk}: forward {fwd_total} of {} bytes ({:.2}), backward {bwd_total} of {} ({:.2}); \
                 scores of a block {}",
                bound.forward_peak_bytes,
                fwd_total as f64 / bound.forward_peak_bytes as f64,
                bound.backward_peak_bytes,
                bwd_total as f64 / bound.backward_peak_bytes as f64,
                bound.scores_chunk_bytes,
            );
            assert!(fwd_total <= bound.forward_peak_bytes, "{dtype:?} chunk {chunk}: forward {fwd_total} > bound");
            assert!(bwd_total <= bound.backward_peak_bytes, "{dtype:?} chunk {chunk}: backward {bwd_total} > bound");
            assert!(fwd >= bound.scores_chunk_bytes && bwd >= bound.scores_chunk_bytes, "{dtype:?} chunk {chunk}");
            if chunk == t {
                assert!(fwd_total > chunked.forward_peak_bytes && bwd_total > chunked.backward_peak_bytes);
            }
            drop((y, grads));
        }
    }
}
