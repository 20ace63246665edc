//! The attention core over query blocks against an independent reference (transformers'
//! `repeat_kv` and the whole `[B, H, T, T]` softmax written out, differentiated by candle's
//! autograd in F64), against itself as one block (F32 rounding, BF16 within a stated bound), its
//! autograd path against its explicit backward, and the plan's bound against tensors counted
//! here.

use candle_core::{DType, Device, Tensor, Var, D};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::*;
use crate::shared_tests::to_vec;

fn randn(shape: &[usize], rng: &mut ChaCha8Rng) -> Tensor {
    let normal = Normal::new(0.0, 1.0).unwrap();
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| normal.sample(rng)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `max |a − b| / max |b|`.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (to_vec(a), to_vec(b));
    assert_eq!(a.len(), b.len());
    let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    err / b.iter().map(|y| y.abs()).fold(0.0, f64::max)
}

/// transformers' eager attention written out: k and v repeated per query head
/// (`repeat_kv`: head `h` reads `h / rep`), the whole `[B, H, T, T]` scores, the causal mask
/// from explicit loops, softmax, `· v` → `[B, T, H, hd]`.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (b, h, t, _) = q.dims4().unwrap();
    let kv = k.dim(1).unwrap();
    let idx: Vec<u32> = (0..h).map(|i| (i / (h / kv)) as u32).collect();
    let idx = Tensor::new(idx.as_slice(), &Device::Cpu).unwrap();
    let k = k.index_select(&idx, 1).unwrap();
    let v = v.index_select(&idx, 1).unwrap();
    let mut m = vec![0f64; t * t];
    for i in 0..t {
        for j in i + 1..t {
            m[i * t + j] = f64::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(m, (t, t), &Device::Cpu).unwrap();
    let s = q.matmul(&k.t().unwrap()).unwrap().broadcast_add(&mask).unwrap();
    let e = s.broadcast_sub(&s.max_keepdim(D::Minus1).unwrap().detach()).unwrap().exp().unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    let y = p.matmul(&v).unwrap().transpose(1, 2).unwrap();
    assert_eq!(y.dims(), [b, t, h, q.dim(3).unwrap()]);
    y
}

/// Random q `[B, H, T, hd]` (scaled as a model scales it), k, v `[B, KV, T, hd]`, and an output
/// gradient `[B, T, H, hd]`, in F64.
fn inputs(b: usize, h: usize, kv: usize, t: usize, hd: usize, seed: u64) -> [Tensor; 4] {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let q = (randn(&[b, h, t, hd], &mut rng) * (1.5 / (hd as f64).sqrt())).unwrap();
    [q, randn(&[b, kv, t, hd], &mut rng), randn(&[b, kv, t, hd], &mut rng), randn(&[b, t, h, hd], &mut rng)]
}

/// `(y, gq, gk, gv)` of `f` by candle's autograd with q, k, v as `Var`s.
fn autograd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gy: &Tensor,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> [Tensor; 4] {
    let (qv, kv, vv) = (Var::from_tensor(q).unwrap(), Var::from_tensor(k).unwrap(), Var::from_tensor(v).unwrap());
    let y = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
    let grads = (&y * gy).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |x: &Var| grads.get(x.as_tensor()).expect("a gradient for every input").clone();
    [y.detach(), g(&qv), g(&kv), g(&vv)]
}

/// (H, KV): grouped-query (rep 2 and 4) and multi-head.
const HEADS: [(usize, usize); 3] = [(4, 2), (4, 1), (3, 3)];
/// T = 13 with blocks that divide it and that do not, and one block.
const T: usize = 13;
const CHUNKS: [usize; 5] = [1, 4, 5, 13, 20];

/// F64: every chunk's output and its gradients (through autograd and the explicit backward)
/// against the reference's, to rounding.
#[test]
fn blocks_match_the_whole_softmax_forward_and_backward_f64() {
    for (i, &(h, kv)) in HEADS.iter().enumerate() {
        let [q, k, v, gy] = inputs(2, h, kv, T, 4, i as u64);
        let want = autograd(&q, &k, &v, &gy, reference);
        for chunk in CHUNKS {
            let got = autograd(&q, &k, &v, &gy, |q, k, v| causal_attention(q, k, v, chunk).unwrap());
            let (gq, gk, gv) = causal_attention_backward(&q, &k, &v, &gy, chunk).unwrap();
            for (name, a, r) in [
                ("y", &got[0], &want[0]),
                ("gq", &got[1], &want[1]),
                ("gk", &got[2], &want[2]),
                ("gv", &got[3], &want[3]),
                ("gq (explicit)", &gq, &want[1]),
                ("gk (explicit)", &gk, &want[2]),
                ("gv (explicit)", &gv, &want[3]),
            ] {
                assert_eq!(a.dims(), r.dims(), "{name}");
                let e = rel_err(a, r);
                assert!(e < 1e-13, "H {h} KV {kv} chunk {chunk}: {name} off by {e:e}");
            }
            // The autograd path is the explicit backward.
            assert_eq!(to_vec(&got[1]), to_vec(&gq));
            assert_eq!(to_vec(&got[2]), to_vec(&gk));
        }
    }
}

/// F32: blocks against one block within F32 rounding (forward and backward); BF16: blocks
/// against one block, and both against the F64 reference, within BF16's rounding. A BF16
/// result is rounded once from F32 sums that the blocks order differently, so two results may
/// sit one BF16 spacing (2^-8 relative) apart, and gradients go through a few such roundings
/// (`S`, `dtype(P)`, `dP`, `dS`, each matmul's output): bound 2^-5 of the largest value,
/// 8 spacings; a missed block or key is an error of order 1.
#[test]
fn blocks_match_one_block_in_f32_and_bf16() {
    for (i, &(h, kv)) in HEADS.iter().enumerate() {
        let [q, k, v, gy] = inputs(2, h, kv, T, 8, 10 + i as u64);
        let exact = autograd(&q, &k, &v, &gy, reference);
        for (dtype, tol, tol_ref) in [(DType::F32, 1e-6, 1e-5), (DType::BF16, 1.0 / 32.0, 1.0 / 32.0)] {
            let cast = |x: &Tensor| x.to_dtype(dtype).unwrap();
            let (q, k, v, gy) = (cast(&q), cast(&k), cast(&v), cast(&gy));
            let one = autograd(&q, &k, &v, &gy, |q, k, v| causal_attention(q, k, v, T).unwrap());
            for (name, a, r) in ["y", "gq", "gk", "gv"].iter().zip(&one).zip(&exact).map(|((n, a), r)| (n, a, r)) {
                assert_eq!(a.dtype(), dtype);
                let e = rel_err(a, r);
                eprintln!("{dtype:?} H {h} KV {kv} one block: {name} vs F64 {e:.2e}");
                assert!(e < tol_ref, "{dtype:?} H {h} KV {kv}: one block's {name} off the F64 reference by {e:e}");
            }
            for chunk in [1, 4, 5] {
                let got = autograd(&q, &k, &v, &gy, |q, k, v| causal_attention(q, k, v, chunk).unwrap());
                for (name, a, r) in ["y", "gq", "gk", "gv"].iter().zip(&got).zip(&one).map(|((n, a), r)| (n, a, r)) {
                    let e = rel_err(a, r);
                    assert!(e < tol, "{dtype:?} H {h} KV {kv} chunk {chunk}: {name} off one block by {e:e}");
                }
            }
        }
    }
}

/// One block runs exactly the unchunked eager ops: its output is bitwise
/// `softmax(q kᵀ + mask) v` with GQA's stacked rows (the composition this core replaced).
#[test]
fn one_block_is_bitwise_the_unchunked_composition() {
    for dtype in [DType::F32, DType::BF16] {
        let [q, k, v, _] = inputs(2, 4, 2, T, 8, 3);
        let (q, k, v) = (q.to_dtype(dtype).unwrap(), k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
        let mut m = vec![0f32; T * T];
        for i in 0..T {
            for j in i + 1..T {
                m[i * T + j] = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(m, (T, T), &Device::Cpu).unwrap();
        let s = ops::matmul(&q.reshape((2, 2, 2 * T, 8)).unwrap(), &k.t().unwrap()).unwrap();
        let s = ops::widen(&s.reshape((2, 4, T, T)).unwrap()).unwrap().broadcast_add(&mask).unwrap();
        let p = crate::kernels::softmax_last_dim(&s).unwrap().to_dtype(dtype).unwrap();
        let y = ops::matmul(&p.reshape((2, 2, 2 * T, T)).unwrap(), &v).unwrap();
        let want = y.reshape((2, 4, T, 8)).unwrap().transpose(1, 2).unwrap();
        let got = causal_attention(&q, &k, &v, T).unwrap();
        assert_eq!(to_vec(&got), to_vec(&want), "{dtype:?}");
    }
}

/// The bound's scores term is the largest block's scores tensor as the core builds it
/// (counted here from the tensor), the default chunk is what its docs say, and the peaks grow
/// with the chunk, not with `T²`, once the chunk is fixed.
#[test]
fn the_bound_counts_the_largest_blocks_scores() {
    let (b, h, kv, hd) = (2, 4, 2, 8);
    let [q, k, _, _] = inputs(b, h, kv, T, hd, 7);
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let (q, k) = (q.to_dtype(dtype).unwrap(), k.to_dtype(dtype).unwrap());
        let q5 = q.reshape((b, kv, h / kv, T, hd)).unwrap();
        for chunk in CHUNKS {
            let c = chunk.min(T);
            // The largest block: the last full one, or the last (shorter, seeing all keys).
            let largest = blocks(T, c)
                .map(|(s, c)| {
                    let q_c = block_rows(&q5, s, c).unwrap();
                    let scores = ops::matmul(&q_c, &k.narrow(2, 0, s + c).unwrap().t().unwrap()).unwrap();
                    let (p, _) = probs(
                        scores,
                        &block_mask(&Masks::default().tri(c, softmax_dtype(dtype), &Device::Cpu).unwrap(), s, c)
                            .unwrap(),
                        h / kv,
                    )
                    .unwrap();
                    (p.elem_count() * p.dtype().size_in_bytes()) as u64
                })
                .max()
                .unwrap();
            let shape = AttentionShape { batch: b, seq_len: T, heads: h, kv_heads: kv, head_dim: hd };
            let bytes = attention_workspace_bytes(shape, chunk, dtype);
            assert_eq!(bytes.chunk, c);
            // c · e ≤ chunk · T, equal when the chunk divides T or is T.
            assert!(largest <= bytes.scores_chunk_bytes, "{dtype:?} chunk {chunk}: {largest} > bound");
            if T % c == 0 {
                assert_eq!(largest, bytes.scores_chunk_bytes, "{dtype:?} chunk {chunk}");
            }
            assert!(bytes.forward_peak_bytes < bytes.backward_peak_bytes);
        }
    }
    // The default: 64 MiB of F32 scores per block, multiples of 16, the whole sequence when it fits.
    let llama8b = |t| AttentionShape { batch: 1, seq_len: t, heads: 32, kv_heads: 8, head_dim: 128 };
    assert_eq!(llama8b(2048).default_chunk(), 256);
    assert_eq!(llama8b(4096).default_chunk(), 128);
    assert_eq!(llama8b(1024).default_chunk(), 512);
    assert_eq!(llama8b(512).default_chunk(), 512);
    assert_eq!(AttentionShape { batch: 64, ..llama8b(1 << 20) }.default_chunk(), 1);
    assert_eq!(llama8b(4096).chunk(Some(100_000)), 4096);
    // A fixed chunk: the scores term is linear in T; the whole sequence's is quadratic.
    let at = |t, chunk| attention_workspace_bytes(llama8b(t), chunk, DType::BF16);
    assert_eq!(at(8192, 128).scores_chunk_bytes, 2 * at(4096, 128).scores_chunk_bytes);
    assert_eq!(at(8192, 8192).scores_chunk_bytes, 4 * at(4096, 4096).scores_chunk_bytes);
}

/// Bad inputs are errors naming the argument, and a chunk of 0 a config error with its fix.
#[test]
fn bad_inputs_are_errors() {
    let [q, k, v, gy] = inputs(1, 3, 2, 5, 4, 1);
    let err = causal_attention(&q, &k, &v, 2).unwrap_err().to_string();
    assert!(err.contains("attention inputs"), "{err}");
    let [q, k, v, gy2] = inputs(1, 4, 2, 5, 4, 1);
    assert!(causal_attention(&q, &k, &v, 0).unwrap_err().to_string().contains("attention chunk"));
    let err = causal_attention_backward(&q, &k, &v, &gy, 2).unwrap_err().to_string();
    assert!(err.contains("attention output gradient"), "{err}");
    assert!(causal_attention_backward(&q, &k, &v, &gy2, 2).is_ok());
    let err = check_chunk(Some(0)).unwrap_err().to_string();
    assert!(err.contains("attention_chunk") && err.contains("fix:"), "{err}");
}
