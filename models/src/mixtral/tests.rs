//! Mixtral against transformers (`shared/fixtures/llama/mixtral_moe`, README there): loaded
//! through [`HfCheckpoint`], the logits, router logits, cross-entropy, load-balancing loss and
//! every gradient of [`crate::lm::loss_parts_and_grads`] (fused CPU kernels and op compositions);
//! export bitwise; `config.json` parse, refusals and round trip; the pooled loss's pieces.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::hf::{config_json, parse_config, read_tensors, write_checkpoint, HfCheckpoint, NamedTensor, WriteOptions};
use crate::lm::{loss_parts_and_grads, CausalLm, IGNORE_INDEX};
use crate::shared_tests::{assert_fixture_grads_within, rel_max_abs, to_f32};
use crate::{Llama, LlamaConfig, LlamaFamily, UnitKind};

fn case_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/llama/mixtral_moe")
}

/// A case of `shared/fixtures/moe` (`qwen3_moe`, `olmoe`, `qwen2_moe`; README there).
fn moe_case(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/moe").join(name)
}

fn reference() -> BTreeMap<String, NamedTensor> {
    reference_of(&case_dir())
}

fn reference_of(dir: &Path) -> BTreeMap<String, NamedTensor> {
    read_tensors(&dir.join("reference.safetensors")).unwrap().into_iter().map(|t| (t.name.clone(), t)).collect()
}

/// `max |a − r| / (atol + rtol |r|)`: ≤ 1 within the tolerance.
fn ratio(a: &[f32], r: &[f32], rtol: f64, atol: f64) -> f64 {
    assert_eq!(a.len(), r.len());
    a.iter().zip(r).map(|(&a, &r)| (a as f64 - r as f64).abs() / (atol + rtol * (r as f64).abs())).fold(0.0, f64::max)
}

fn ids(t: &NamedTensor) -> Tensor {
    let v: Vec<u32> = t.as_i64().unwrap().iter().map(|&x| if x < 0 { IGNORE_INDEX } else { x as u32 }).collect();
    Tensor::from_vec(v, (t.shape[0], t.shape[1]), &Device::Cpu).unwrap()
}

fn load() -> (HfCheckpoint, LlamaConfig, Vec<Tensor>) {
    load_of(&case_dir())
}

fn load_of(dir: &Path) -> (HfCheckpoint, LlamaConfig, Vec<Tensor>) {
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let cfg = ckpt.llama_config().unwrap();
    let units = cfg.units();
    ckpt.check_units(&units).unwrap();
    let params =
        units.iter().map(|u| Tensor::from_vec(ckpt.read_unit(u).unwrap(), u.numel, &Device::Cpu).unwrap()).collect();
    (ckpt, cfg, params)
}

/// Logits `[B, T, V]` and every layer's router logits `[L, N, E]` through the unit calls.
fn forward_all(model: &Llama, params: &[Tensor], tokens: &Tensor) -> (Tensor, Tensor) {
    let moe = model.moe().unwrap();
    let c = model.config();
    let mut x = model.forward(0, &params[0], tokens, None).unwrap();
    let mut router = Vec::new();
    for i in 0..c.num_hidden_layers {
        let t = moe.trunk_forward(i, &params[c.block_unit(i)], &x).unwrap();
        let outs: Vec<Option<Tensor>> = (0..c.num_experts())
            .map(|e| {
                t.routing
                    .expert_input(e, &t.h)
                    .unwrap()
                    .map(|h| moe.expert_forward(&params[c.expert_unit(i, e)], &h).unwrap())
            })
            .collect();
        x = moe.combine(&t.x1, &t.routing, &outs).unwrap();
        router.push(t.logits);
    }
    let head = params.len() - 1;
    (model.forward(head, &params[head], &x, None).unwrap(), Tensor::stack(&router, 0).unwrap())
}

/// `chunk`: the composed attention's query positions per block (`None`: the default).
fn check_oracle(composed: bool, chunk: Option<usize>) {
    let cfg = load().1;
    assert_eq!(cfg.family, LlamaFamily::Mixtral);
    assert_eq!((cfg.num_experts(), cfg.top_k(), cfg.aux_loss_weight()), (4, 2, 0.02));
    check_oracle_of(&case_dir(), 303_936, composed, chunk);
}

/// The case in `dir` (`params` parameters) against its reference: logits, router logits, the
/// loss's parts, every gradient.
fn check_oracle_of(dir: &Path, params_count: usize, composed: bool, chunk: Option<usize>) {
    let (_, cfg, params) = load_of(dir);
    let mut model = Llama::new(cfg.clone()).unwrap().with_attention_chunk(chunk).unwrap();
    if composed {
        model = model.composed_only();
    }
    assert_eq!(model.units().iter().map(|u| u.numel).sum::<usize>(), params_count);
    let r = reference_of(dir);
    let tokens = ids(&r["input_ids"]);
    let targets = ids(&r["labels"]);

    let (logits, router) = forward_all(&model, &params, &tokens);
    assert_eq!(logits.dims(), r["logits"].shape.as_slice());
    assert_eq!(router.dims(), r["router_logits"].shape.as_slice());
    for (name, t) in [("logits", &logits), ("router_logits", &router)] {
        let got: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let q = ratio(&got, r[name].as_f32().unwrap(), 1e-4, 1e-5);
        eprintln!("composed={composed} chunk={chunk:?}: {name} {q:.3} of the tolerance");
        assert!(q <= 1.0, "{name} off by {q} x the tolerance");
    }

    let (parts, grads) = loss_parts_and_grads(&model, &params, &tokens, &targets).unwrap();
    let scalar = |n: &str| r[n].as_f32().unwrap()[0];
    let aux = parts.aux / cfg.aux_loss_weight();
    for (name, got) in [("loss_ce", parts.ce), ("aux_loss", aux), ("loss", parts.total())] {
        let q = ratio(&[got as f32], &[scalar(name)], 1e-4, 1e-5);
        eprintln!("composed={composed} chunk={chunk:?}: {name} {got} vs {}", scalar(name));
        assert!(q <= 1.0, "{name}: {got} vs {}", scalar(name));
    }

    let mut checked = 0;
    let mut worst = (0f64, String::new());
    for (unit, g) in model.units().iter().zip(&grads) {
        let g: Vec<f32> = g.to_vec1().unwrap();
        for p in &unit.params {
            let want = &r[&format!("grad.{}", p.name)];
            assert_eq!(want.shape, p.shape, "{}", p.name);
            let q = ratio(&g[p.offset..p.offset + p.numel()], want.as_f32().unwrap(), 1e-3, 1e-6);
            assert!(q <= 1.0, "gradient of {} off by {q} x the tolerance", p.name);
            if q > worst.0 {
                worst = (q, p.name.clone());
            }
            checked += 1;
        }
    }
    assert_eq!(checked, r.keys().filter(|k| k.starts_with("grad.")).count());
    eprintln!(
        "composed={composed} chunk={chunk:?}: {checked} gradients, worst {:.3} of the tolerance ({})",
        worst.0, worst.1
    );
}

#[test]
fn mixtral_matches_transformers() {
    check_oracle(false, None);
}

#[test]
fn mixtral_composed_matches_transformers() {
    check_oracle(true, None);
    // Attention over query blocks of 5 (not dividing the fixture's T).
    check_oracle(true, Some(5));
}

// ---- BF16 against the f32 oracle -------------------------------------------------------------
//
// As `hf/tests.rs` (`check_oracle_bf16`, where the bounds are argued): the parameters rounded to
// BF16, the op compositions, the unit calls of `loss_parts_and_grads`. The router computes its
// softmax, gates and load-balancing statistics in F32 (transformers' `softmax(.., dtype=
// torch.float)`), from BF16 logits. A token whose 2nd and 3rd experts are nearly tied in f32
// could pick another expert in BF16, and its gradients would then be another routing's; this
// oracle's tokens keep every pair (checked; two rows swap the order of a nearly tied pair,
// which changes nothing), so the dense bounds hold.

/// Loss (cross-entropy, load-balancing loss, total): relative error. Measured ≤ 3.3e-5 (the
/// load-balancing loss's).
const BF16_LOSS_RTOL: f64 = 1e-3;
/// Logits and router logits: `max |z − ref| / max |ref|`. Measured 7.3e-3 and 6.3e-3.
const BF16_LOGITS_RTOL: f64 = 3e-2;
/// Gradients, per parameter tensor: `‖g − ref‖ / ‖ref‖`. Measured ≤ 1.2e-2 (experts and
/// router ≤ 1.1e-2).
const BF16_GRAD_RTOL: f64 = 5e-2;

/// The top-2 experts of each row of `logits` `[rows, E]` (softmax is monotone), as a set
/// (ascending): the order of the two does not change the block's output.
fn top2(logits: &[f32], e: usize) -> Vec<[usize; 2]> {
    logits
        .chunks_exact(e)
        .map(|row| {
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            [idx[0].min(idx[1]), idx[0].max(idx[1])]
        })
        .collect()
}

#[test]
fn mixtral_in_bf16_matches_transformers_f32() {
    let (_, cfg, params) = load();
    let model = Llama::new(cfg.clone()).unwrap().composed_only();
    let r = reference();
    let tokens = ids(&r["input_ids"]);
    let targets = ids(&r["labels"]);
    let params: Vec<Tensor> = params.iter().map(|p| p.to_dtype(candle_core::DType::BF16).unwrap()).collect();

    let (logits, router) = forward_all(&model, &params, &tokens);
    assert_eq!(logits.dtype(), candle_core::DType::BF16);
    for (name, t) in [("logits", &logits), ("router_logits", &router)] {
        let q = rel_max_abs(&to_f32(t), r[name].as_f32().unwrap());
        eprintln!("bf16: {name} max |err| / max |ref| {q:.2e}");
        assert!(q <= BF16_LOGITS_RTOL, "bf16: {name} off by {q:.2e} of their range");
    }
    let e = cfg.num_experts();
    let (got, want) = (top2(&to_f32(&router), e), top2(r["router_logits"].as_f32().unwrap(), e));
    let flips = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    eprintln!("bf16: {flips} of {} rows pick other experts than in f32", got.len());
    assert_eq!(flips, 0, "BF16 picks the oracle's experts for every row");

    let (parts, grads) = loss_parts_and_grads(&model, &params, &tokens, &targets).unwrap();
    let scalar = |n: &str| r[n].as_f32().unwrap()[0] as f64;
    let aux = parts.aux / cfg.aux_loss_weight();
    for (name, got) in [("loss_ce", parts.ce), ("aux_loss", aux), ("loss", parts.total())] {
        let q = (got - scalar(name)).abs() / scalar(name).abs();
        eprintln!("bf16: {name} {got} vs {}, relative error {q:.2e}", scalar(name));
        assert!(q <= BF16_LOSS_RTOL, "bf16: {name} {got} vs {}", scalar(name));
    }

    assert_fixture_grads_within("bf16", model.units(), &grads, &r, BF16_GRAD_RTOL);
}

/// With BF16 parameters the router's softmax and gates are computed in F32 from the BF16
/// logits (transformers: `softmax(router_logits, dim=1, dtype=torch.float)`, top-k,
/// renormalize, `.to(hidden_states.dtype)`): the probabilities (F32) within 1e-6 of an f64
/// softmax of the same logits (a BF16 softmax is ~1e-3 off), each gate (BF16) within one BF16
/// spacing of the f64 gate, the probability sums of the load-balancing loss within 1e-6.
#[test]
fn bf16_router_softmax_and_gates_are_in_f32() {
    let (_, cfg, params) = load();
    let model = Llama::new(cfg.clone()).unwrap();
    let moe = model.moe().unwrap();
    let r = reference();
    let tokens = ids(&r["input_ids"]);
    let params: Vec<Tensor> = params.iter().map(|p| p.to_dtype(candle_core::DType::BF16).unwrap()).collect();
    let x = model.forward(0, &params[0], &tokens, None).unwrap();
    let t = moe.trunk_forward(0, &params[cfg.block_unit(0)], &x).unwrap();
    assert_eq!((t.logits.dtype(), t.probs.dtype()), (candle_core::DType::BF16, candle_core::DType::F32));
    let (n, e) = t.probs.dims2().unwrap();
    let k = cfg.top_k();
    let (logits, probs) = (to_f32(&t.logits), to_f32(&t.probs));
    let mut want = vec![0f64; n * e];
    for (w, z) in want.chunks_exact_mut(e).zip(logits.chunks_exact(e)) {
        let m = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let s: f64 = z.iter().map(|&x| (x as f64 - m).exp()).sum();
        w.iter_mut().zip(z).for_each(|(w, &x)| *w = (x as f64 - m).exp() / s);
    }
    let err = probs.iter().zip(&want).map(|(&a, b)| (a as f64 - b).abs()).fold(0f64, f64::max);
    assert!(err <= 1e-6, "router probabilities off by {err:e}");
    let mut checked = 0;
    for ex in 0..e {
        let Some(gates) = t.routing.gates(ex) else { continue };
        assert_eq!(gates.dtype(), candle_core::DType::BF16);
        for (&tok, g) in t.routing.tokens(ex).iter().zip(to_f32(gates)) {
            let tok = tok as usize;
            let chosen = &t.routing.choices()[tok * k..tok * k + k];
            let norm: f64 = chosen.iter().map(|&c| want[tok * e + c as usize]).sum();
            let gate = want[tok * e + ex] / norm;
            assert!((g as f64 - gate).abs() <= gate / 256.0, "gate {g} vs {gate}");
            checked += 1;
        }
    }
    assert_eq!(checked, n * k);
    for (ex, &s) in t.routing.prob_sum().iter().enumerate() {
        let exact: f64 = (0..n).map(|i| want[i * e + ex]).sum();
        assert!((s - exact).abs() <= 1e-6 * exact, "expert {ex}: probability sum {s} vs {exact}");
    }
}

#[test]
fn units_are_trunks_and_experts_with_hub_names() {
    let cfg = HfCheckpoint::open(&case_dir()).unwrap().llama_config().unwrap();
    let units = cfg.units();
    assert_eq!(units.len(), cfg.num_units());
    assert_eq!(units.len(), 2 * (1 + 4) + 2);
    assert_eq!(units[cfg.block_unit(1)].kind, UnitKind::MoeTrunk(1));
    let e = &units[cfg.expert_unit(1, 2)];
    assert_eq!(e.kind, UnitKind::Expert { block: 1, expert: 2 });
    let names: Vec<&str> = e.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model.layers.1.block_sparse_moe.experts.2.w1.weight",
            "model.layers.1.block_sparse_moe.experts.2.w3.weight",
            "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        ]
    );
    assert_eq!(units[cfg.block_unit(0)].params.last().unwrap().name, "model.layers.0.block_sparse_moe.gate.weight");
}

#[test]
fn export_is_bitwise_the_input() {
    export_is_bitwise(&case_dir());
}

/// The checkpoint in `dir` written back by [`write_checkpoint`]: the same tensors, bitwise, and
/// the same config.
fn export_is_bitwise(dir: &Path) {
    let (ckpt, cfg, params) = load_of(dir);
    let units = cfg.units();
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(tmp.path(), &cfg, ckpt.config_json(), &units, &WriteOptions::default(), |u| {
        Ok(params[u.index].to_vec1::<f32>().unwrap())
    })
    .unwrap();
    let back = HfCheckpoint::open(tmp.path()).unwrap();
    assert_eq!(back.llama_config().unwrap(), cfg);
    assert_eq!(back.tensors().keys().collect::<Vec<_>>(), ckpt.tensors().keys().collect::<Vec<_>>());
    for name in ckpt.tensors().keys() {
        let (a, b) = (ckpt.read_tensor(name).unwrap(), back.read_tensor(name).unwrap());
        assert_eq!(a.0, b.0);
        assert!(a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}");
    }
}

#[test]
fn config_json_round_trips_and_refuses_by_key() {
    let text = std::fs::read_to_string(case_dir().join("config.json")).unwrap();
    let p = Path::new("config.json");
    let cfg = parse_config(&text, p).unwrap();
    let again = parse_config(&config_json(&cfg, "float32", &Default::default()).to_string(), p).unwrap();
    assert_eq!(again, cfg);
    let with = |key: &str, v: serde_json::Value| {
        let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
        m[key] = v;
        parse_config(&m.to_string(), p).unwrap_err().to_string()
    };
    for (key, v) in [
        ("router_jitter_noise", serde_json::json!(0.01)),
        ("sliding_window", serde_json::json!(4096)),
        ("num_experts_per_tok", serde_json::json!(5)),
        ("num_local_experts", serde_json::json!(1)),
    ] {
        let err = with(key, v);
        assert!(err.contains(key), "{key}: {err}");
    }
    // A dense family with a Mixtral key is refused by name.
    let mut dense = LlamaConfig::new(16, 8, 8, 1, 2);
    dense.num_local_experts = Some(4);
    assert!(dense.validate().unwrap_err().to_string().contains("num_local_experts"));
}

#[test]
fn pooled_aux_loss_is_the_sum_of_the_blocks_shares_and_needs_finishing() {
    let cfg = LlamaConfig { router_aux_loss_coef: Some(0.1), ..LlamaConfig::mixtral(32, 16, 24, 2, 2, 4, 2) };
    let model = Llama::new(cfg.clone()).unwrap();
    let params: Vec<Tensor> = crate::init_params(model.units(), 3)
        .iter()
        .map(|f| crate::unit_tensor(f, candle_core::DType::F32, &Device::Cpu).unwrap())
        .collect();
    let tokens = Tensor::from_vec((0..16u32).collect::<Vec<_>>(), (2, 8), &Device::Cpu).unwrap();
    let moe = model.moe().unwrap();
    let x = model.forward(0, &params[0], &tokens, None).unwrap();
    let t0 = moe.trunk_forward(0, &params[cfg.block_unit(0)], &x).unwrap();
    let t1 = moe.trunk_forward(1, &params[cfg.block_unit(1)], &x).unwrap();
    let (mut r0, mut r1) = (t0.routing.clone(), t1.routing.clone());
    let pooled = moe.aux_loss(&[&r0, &r1]);
    let g = x.zeros_like().unwrap();
    let gh = t0.h.zeros_like().unwrap();
    let gates: Vec<Option<Tensor>> = (0..4).map(|e| r0.gates(e).map(|g| g.zeros_like().unwrap())).collect();
    let err = moe.trunk_backward(0, &params[cfg.block_unit(0)], &x, &r0, &g, &gh, &gates).unwrap_err();
    assert!(err.to_string().contains("finish_forward"), "{err}");
    moe.finish_forward(&mut [&mut r0, &mut r1]).unwrap();
    let shares = r0.aux_loss() + r1.aux_loss();
    assert!((shares - pooled).abs() <= 1e-12 * pooled.abs().max(1.0), "{shares} vs {pooled}");
    assert!(pooled > 0.0);
    moe.trunk_backward(0, &params[cfg.block_unit(0)], &x, &r0, &g, &gh, &gates).unwrap();
}

/// A Mixtral trunk (attention, norm, router) whose composed attention runs over query blocks of
/// 1, 4 and 5 positions at T = 13 (GQA: 4 query heads over 2 key/value heads) against one
/// block: `x1`, `h`, the router's probabilities and choices, and the trunk's backward (every
/// parameter, the input) within F32 rounding (1e-5 of each tensor's largest element).
#[test]
fn trunk_attention_blocks_match_one_block() {
    let t = 13;
    let cfg = LlamaConfig {
        num_key_value_heads: Some(2),
        max_position_embeddings: 16,
        router_aux_loss_coef: Some(0.1),
        ..LlamaConfig::mixtral(32, 16, 24, 1, 4, 4, 2)
    };
    let build = |chunk| Llama::new(cfg.clone()).unwrap().composed_only().with_attention_chunk(Some(chunk)).unwrap();
    let one = build(t);
    let trunk = cfg.block_unit(0);
    let flat = &crate::init_params(one.units(), 5)[trunk];
    let p = Tensor::from_slice(flat, flat.len(), &Device::Cpu).unwrap();
    let wave = |n: usize, f: f64| (0..n).map(|i| ((i as f64) * f).sin()).collect::<Vec<f64>>();
    let x = Tensor::from_vec(wave(2 * t * 16, 0.37), (2, t, 16), &Device::Cpu).unwrap().to_dtype(p.dtype()).unwrap();
    let gy = Tensor::from_vec(wave(2 * t * 16, 0.91), (2, t, 16), &Device::Cpu).unwrap().to_dtype(p.dtype()).unwrap();
    let gh = gy.reshape((2 * t, 16)).unwrap().affine(-0.5, 0.1).unwrap();
    let moe = one.moe().unwrap();
    let t1 = moe.trunk_forward(0, &p, &x).unwrap();
    let mut routing = t1.routing.clone();
    moe.finish_forward(&mut [&mut routing]).unwrap();
    let gates: Vec<Option<Tensor>> = (0..4).map(|e| routing.gates(e).map(|g| g.affine(2.0, -0.5).unwrap())).collect();
    let g1 = moe.trunk_backward(0, &p, &x, &routing, &gy, &gh, &gates).unwrap();
    let rel = |a: &Tensor, b: &Tensor| {
        let (a, b) = (crate::shared_tests::to_vec(a), crate::shared_tests::to_vec(b));
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        err / b.iter().map(|y| y.abs()).fold(0.0, f64::max)
    };
    for chunk in [1, 4, 5] {
        let blocks = build(chunk);
        let moe = blocks.moe().unwrap();
        let tb = moe.trunk_forward(0, &p, &x).unwrap();
        for (name, a, b) in [("x1", &tb.x1, &t1.x1), ("h", &tb.h, &t1.h), ("probs", &tb.probs, &t1.probs)] {
            assert!(rel(a, b) <= 1e-5, "chunk {chunk}: {name} off by {:e}", rel(a, b));
        }
        assert_eq!(tb.routing.choices, t1.routing.choices, "chunk {chunk}: the same experts");
        let gb = moe.trunk_backward(0, &p, &x, &routing, &gy, &gh, &gates).unwrap();
        let gx = rel(gb.grad_input.as_ref().unwrap(), g1.grad_input.as_ref().unwrap());
        assert!(gx <= 1e-5, "chunk {chunk}: input gradient off by {gx:e}");
        for ps in &one.units()[trunk].params {
            let part = |t: &Tensor| t.narrow(0, ps.offset, ps.numel()).unwrap();
            let e = rel(&part(&gb.grad_params), &part(&g1.grad_params));
            assert!(e <= 1e-5, "chunk {chunk}: gradient of {} off by {e:e}", ps.name);
        }
    }
}

// ---- the fine-grained MoE families (`shared/fixtures/moe`) ------------------------------------

/// The fixture case `name` (`params` parameters, 8 experts, top-4): the fused CPU path and the
/// op compositions over query blocks of 5 against transformers, then export bitwise. Returns
/// its config.
fn fine_grained_case(name: &str, family: LlamaFamily, params: usize) -> LlamaConfig {
    let dir = moe_case(name);
    let cfg = load_of(&dir).1;
    assert_eq!((cfg.family, cfg.num_experts(), cfg.top_k(), cfg.aux_loss_weight()), (family, 8, 4, 0.02));
    check_oracle_of(&dir, params, false, None);
    check_oracle_of(&dir, params, true, Some(5));
    export_is_bitwise(&dir);
    cfg
}

/// Qwen3-MoE: top-4 renormalized, per-head q/k norm, `num_local_experts`.
#[test]
fn qwen3_moe_matches_transformers() {
    let cfg = fine_grained_case("qwen3_moe", LlamaFamily::Qwen3Moe, 255_360);
    assert_eq!(
        (cfg.norm_topk_prob(), cfg.expert_intermediate_size(), cfg.qk_norm_widths()),
        (true, 32, Some((16, 16)))
    );
}

/// OLMoE: top-4 not renormalized, RMSNorm over the whole q and k projections, `num_experts`,
/// experts of width `intermediate_size`, one file.
#[test]
fn olmoe_matches_transformers() {
    let cfg = fine_grained_case("olmoe", LlamaFamily::Olmoe, 263_744);
    assert_eq!(
        (cfg.norm_topk_prob(), cfg.expert_intermediate_size(), cfg.qk_norm_widths()),
        (false, 32, Some((64, 64)))
    );
}

/// Qwen2-MoE: top-4 not renormalized, q/k/v bias, the shared expert and its sigmoid gate in the
/// trunk.
#[test]
fn qwen2_moe_matches_transformers() {
    let cfg = fine_grained_case("qwen2_moe", LlamaFamily::Qwen2Moe, 280_256);
    assert_eq!(
        (cfg.norm_topk_prob(), cfg.expert_intermediate_size(), cfg.shared_expert_width()),
        (false, 32, Some(64))
    );
    let trunk = &cfg.units()[cfg.block_unit(0)];
    assert_eq!(trunk.params.last().unwrap().name, "model.layers.0.mlp.shared_expert_gate.weight");
}

/// The fine-grained families' `config.json` written back and read again is the same config,
/// and names each family's keys.
#[test]
fn fine_grained_config_json_round_trips() {
    for (case, keys) in [
        ("qwen3_moe", &["num_experts", "moe_intermediate_size", "norm_topk_prob"][..]),
        ("olmoe", &["num_experts", "norm_topk_prob"][..]),
        ("qwen2_moe", &["num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "qkv_bias"][..]),
    ] {
        let text = std::fs::read_to_string(moe_case(case).join("config.json")).unwrap();
        let p = Path::new("config.json");
        let cfg = parse_config(&text, p).unwrap();
        let json = config_json(&cfg, "float32", &Default::default());
        for k in keys {
            assert!(json.get(*k).is_some(), "{case}: {k} in {json}");
        }
        assert_eq!(parse_config(&json.to_string(), p).unwrap(), cfg, "{case}");
    }
}

/// A from-scratch config of each fine-grained family (the TOML form's keys, `num_experts` as
/// an alias of `num_local_experts`) validates and lays out its units; the families' keys are
/// refused elsewhere by name.
#[test]
fn fine_grained_scratch_configs_validate_and_refuse_foreign_keys() {
    let scratch = |family: &str, extra: serde_json::Value| {
        let mut m = serde_json::json!({
            "family": family, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 6, "num_experts_per_tok": 3,
        });
        m.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value::<LlamaConfig>(m).unwrap()
    };
    let q2 =
        scratch("qwen2_moe", serde_json::json!({"moe_intermediate_size": 8, "shared_expert_intermediate_size": 12}));
    q2.validate().unwrap();
    // The trunk: 2 norms, q/k/v (+ bias), o, router [6, 16], shared gate/up/down, its gate [1, 16].
    let trunk = &q2.units()[q2.block_unit(1)];
    let attn = 16 * 16 * 4 + 16 * 3;
    assert_eq!(trunk.numel, 2 * 16 + attn + 6 * 16 + 3 * 12 * 16 + 16);
    assert_eq!(q2.units()[q2.expert_unit(1, 5)].numel, 3 * 8 * 16);
    let olmoe = scratch("olmoe", serde_json::json!({"norm_topk_prob": true}));
    olmoe.validate().unwrap();
    assert!(olmoe.norm_topk_prob() && olmoe.expert_intermediate_size() == 24);
    let err = scratch("qwen2_moe", serde_json::json!({"moe_intermediate_size": 8})).validate().unwrap_err();
    assert!(err.to_string().contains("shared_expert_intermediate_size"), "{err}");
    let mut wrong = olmoe.clone();
    wrong.moe_intermediate_size = Some(8);
    assert!(wrong.validate().unwrap_err().to_string().contains("moe_intermediate_size"));
    let mut dense = LlamaConfig::new(16, 8, 8, 1, 2);
    dense.norm_topk_prob = Some(true);
    assert!(dense.validate().unwrap_err().to_string().contains("norm_topk_prob"));
}

/// Routing replay (`Llama::trunk_forward_routed`) on the Qwen3-MoE fixture (top-4 of 8,
/// renormalized): replaying the router's own choices is `trunk_forward` bitwise (choices,
/// gates, probability sums); replaying others routes each row to exactly those experts with
/// gates their probabilities renormalized over them; choices of the wrong length, an expert out
/// of range or named twice in a row are refused by name.
#[test]
fn trunk_forward_routed_replays_the_given_choices() {
    let (_, cfg, params) = load_of(&moe_case("qwen3_moe"));
    let model = Llama::new(cfg.clone()).unwrap();
    let moe = model.moe().unwrap();
    let tokens = ids(&reference_of(&moe_case("qwen3_moe"))["input_ids"]);
    let x = model.forward(0, &params[0], &tokens, None).unwrap();
    let p = &params[cfg.block_unit(0)];
    let own = moe.trunk_forward(0, p, &x).unwrap();
    let same = model.trunk_forward_routed(0, p, &x, own.routing.choices()).unwrap();
    let (e, k) = (cfg.num_experts(), cfg.top_k());
    assert_eq!(same.routing.choices(), own.routing.choices());
    assert_eq!(same.routing.prob_sum(), own.routing.prob_sum());
    for ex in 0..e {
        assert_eq!(same.routing.tokens(ex), own.routing.tokens(ex));
        assert_eq!(same.routing.gates(ex).map(to_f32), own.routing.gates(ex).map(to_f32), "expert {ex}");
    }
    // Every row routed to the experts it did not pick, best first as given.
    let others: Vec<u32> = own
        .routing
        .choices()
        .chunks_exact(k)
        .flat_map(|c| (0..e as u32).filter(|x| !c.contains(x)).collect::<Vec<_>>())
        .collect();
    let t = model.trunk_forward_routed(0, p, &x, &others).unwrap();
    assert_eq!(t.routing.choices(), &others[..]);
    let probs = to_f32(&t.probs);
    for ex in 0..e {
        let Some(gates) = t.routing.gates(ex) else { continue };
        for (&row, g) in t.routing.tokens(ex).iter().zip(to_f32(gates)) {
            let row = row as usize;
            assert!(others[row * k..row * k + k].contains(&(ex as u32)));
            let sum: f32 = others[row * k..row * k + k].iter().map(|&c| probs[row * e + c as usize]).sum();
            let want = probs[row * e + ex] / sum;
            assert!((g - want).abs() <= 1e-6, "row {row} expert {ex}: gate {g} vs {want}");
        }
    }
    let n = own.routing.num_tokens();
    for (bad, says) in [
        (vec![0u32; n * k - 1], format!("{}", n * k - 1)),
        ([vec![8u32, 1, 2, 3], others[4..].to_vec()].concat(), "row 0: [8, 1, 2, 3]".into()),
        ([vec![1u32, 2, 1, 3], others[4..].to_vec()].concat(), "row 0: [1, 2, 1, 3]".into()),
    ] {
        let err = model.trunk_forward_routed(0, p, &x, &bad).unwrap_err().to_string();
        assert!(err.contains("routing choices") && err.contains(&says), "{err}");
    }
}
