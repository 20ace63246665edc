//! Tests of the Llama family: layout and init, the fused kernels against finite differences
//! and the compositions, whole units and the whole model against finite differences (f64),
//! GQA against repeated heads, RoPE scaling against transformers' formulas, causality, the
//! ignore index, input errors. (The transformers oracles are in `hf/tests.rs`.)

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::*;
use crate::kernels::{
    cross_entropy_composed, cross_entropy_rows, rms_norm_composed, rms_norm_fused, rope_composed, rope_fused,
    swiglu_composed, swiglu_fused,
};
use crate::lm::{loss_and_grads, CausalLm, IGNORE_INDEX};
use crate::shared_tests::{
    assert_bf16_accumulation_far_off, assert_rows_equal_row_0, assert_within_bf16_spacing, bf16_uniform, to_vec,
};
use crate::unit::{init_params, ParamInit};
use crate::{unit_tensor, Error};

/// Finite-difference step and tolerance (f64): as the GPT's (`gpt/tests.rs`), central
/// differences with h = 1e-5 have truncation and round-off errors ~1e-10 at these sizes.
const FD_STEP: f64 = 1e-5;
const FD_RTOL: f64 = 1e-6;
const FD_ATOL: f64 = 1e-9;

/// A tiny config exercising every option: GQA (4 query heads over 2 KV heads), biases
/// (Llama's `attention_bias` on q/k/v/o and `mlp_bias`), head_dim ≠ hidden/heads.
fn tiny(tied: bool) -> LlamaConfig {
    LlamaConfig {
        num_key_value_heads: Some(2),
        head_dim: Some(4),
        tie_word_embeddings: tied,
        attention_bias: Some(true),
        mlp_bias: true,
        max_position_embeddings: 8,
        rms_norm_eps: 1e-5,
        ..LlamaConfig::new(32, 12, 10, 2, 4)
    }
}

fn qwen2_tiny() -> LlamaConfig {
    LlamaConfig {
        family: LlamaFamily::Qwen2,
        tie_word_embeddings: true,
        max_position_embeddings: 8,
        rope_theta: 1e6,
        ..LlamaConfig::new(32, 8, 12, 2, 2)
    }
}

/// Qwen3: the per-head q/k RMSNorm, GQA, head_dim ≠ hidden/heads, biases on q/k/v and o.
fn qwen3_tiny() -> LlamaConfig {
    LlamaConfig { family: LlamaFamily::Qwen3, mlp_bias: false, ..tiny(false) }
}

fn ids(b: usize, t: usize, vocab: usize, rng: &mut impl Rng) -> Tensor {
    let v: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..vocab as u32)).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

/// Random parameters: norms near 1 (away from it), everything else N(0, std).
fn random_params(units: &[UnitSpec], std: f64, rng: &mut impl Rng) -> Vec<Vec<f64>> {
    let normal = Normal::new(0.0, std).unwrap();
    units
        .iter()
        .map(|u| {
            let mut v: Vec<f64> = (0..u.numel).map(|_| normal.sample(rng)).collect();
            for p in u.params.iter().filter(|p| p.init == ParamInit::Ones) {
                v[p.offset..p.offset + p.numel()].iter_mut().for_each(|x| *x += 1.0);
            }
            v
        })
        .collect()
}

fn to_tensors(flats: &[Vec<f64>], dtype: DType) -> Vec<Tensor> {
    flats.iter().map(|f| Tensor::from_slice(f, f.len(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    to_vec(a).iter().zip(to_vec(b)).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

fn max_abs(t: &Tensor) -> f64 {
    to_vec(t).iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn assert_fd(what: &str, autograd: f64, fd: f64) {
    let err = (autograd - fd).abs();
    assert!(err <= FD_ATOL + FD_RTOL * fd.abs(), "{what}: autograd {autograd} vs finite difference {fd} (err {err:e})");
}

// ---- layout and init -----------------------------------------------------------------------

#[test]
fn layout_is_hf_names_back_to_back_and_groups_cover_it() {
    for cfg in [tiny(false), tiny(true), qwen2_tiny(), qwen3_tiny(), LlamaConfig::new(1024, 256, 688, 4, 4)] {
        let model = Llama::new(cfg.clone()).unwrap();
        let units = model.units();
        assert_eq!(units.len(), cfg.num_hidden_layers + 2);
        assert_eq!(units[0].kind, UnitKind::Embedding);
        assert_eq!(units[0].name, "model.embed_tokens");
        assert_eq!(units[1].kind, UnitKind::Block(0));
        assert_eq!(units[1].name, "model.layers.0");
        assert_eq!(units.last().unwrap().kind, UnitKind::Head);
        for (u, unit) in units.iter().enumerate() {
            let mut off = 0;
            for p in &unit.params {
                assert_eq!(p.offset, off, "{}", p.name);
                off += p.numel();
            }
            assert_eq!(off, unit.numel);
            // The groups cover the flat vector back to back.
            let mut off = 0;
            for (g_off, shape) in &model.groups[u] {
                assert_eq!(*g_off, off);
                off += shape.iter().product::<usize>();
            }
            assert_eq!(off, unit.numel);
        }
        let c = model.config();
        let (d, hd, h, kv, i) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads(), c.intermediate_size);
        let blk = &units[2];
        let p = |n: &str| blk.param(&format!("model.layers.1.{n}")).map(|p| p.shape.clone());
        assert_eq!(p("self_attn.q_proj.weight"), Some(vec![h * hd, d]));
        assert_eq!(p("self_attn.k_proj.weight"), Some(vec![kv * hd, d]));
        assert_eq!(p("self_attn.o_proj.weight"), Some(vec![d, h * hd]));
        assert_eq!(p("mlp.gate_proj.weight"), Some(vec![i, d]));
        assert_eq!(p("mlp.down_proj.weight"), Some(vec![d, i]));
        assert_eq!(p("input_layernorm.weight"), Some(vec![d]));
        assert_eq!(p("self_attn.q_proj.bias").is_some(), c.qkv_bias());
        assert_eq!(p("self_attn.o_proj.bias").is_some(), c.o_bias());
        assert_eq!(p("mlp.down_proj.bias").is_some(), c.mlp_bias);
        assert_eq!(p("self_attn.q_norm.weight"), c.qk_norm().then(|| vec![hd]));
        assert_eq!(p("self_attn.k_norm.weight"), c.qk_norm().then(|| vec![hd]));
        // gate and up are adjacent: the merged [2I, d] group is exactly them.
        let gate = blk.param("model.layers.1.mlp.gate_proj.weight").unwrap();
        let up = blk.param("model.layers.1.mlp.up_proj.weight").unwrap();
        assert_eq!(up.offset, gate.offset + gate.numel());
        let (_, g) = c.block_groups();
        assert_eq!(model.groups[2][g.gate_up_w], (gate.offset, vec![2 * i, d]));
        let head = units.last().unwrap();
        assert_eq!(head.param("lm_head.weight").is_some(), !c.tie_word_embeddings);
        assert_eq!(head.params[0].name, "model.norm.weight");
    }
    // Qwen2: q/k/v biases, no o or MLP bias.
    let q = Llama::new(qwen2_tiny()).unwrap();
    assert!(q.units()[1].param("model.layers.0.self_attn.v_proj.bias").is_some());
    assert!(q.units()[1].param("model.layers.0.self_attn.o_proj.bias").is_none());
    // Closed form for the plain Llama: V d + L (2 d + 4 d² (MHA) + 3 d I) + d + V d.
    let c = LlamaConfig::new(1024, 256, 688, 4, 4);
    assert_eq!(c.num_params(), 1024 * 256 + 4 * (2 * 256 + 4 * 256 * 256 + 3 * 256 * 688) + 256 + 1024 * 256);
}

#[test]
fn init_follows_transformers_init_weights() {
    let cfg = LlamaConfig { initializer_range: 0.05, ..tiny(false) };
    let units = cfg.units();
    let flats = init_params(&units, 3);
    for (u, f) in units.iter().zip(&flats) {
        for p in &u.params {
            let v = &f[p.offset..p.offset + p.numel()];
            if p.name.ends_with("layernorm.weight") || p.name == "model.norm.weight" {
                assert!(v.iter().all(|&x| x == 1.0), "{}", p.name);
            } else if p.name.ends_with(".bias") {
                assert!(v.iter().all(|&x| x == 0.0), "{}", p.name);
            } else {
                assert_eq!(p.init, ParamInit::Normal { std: 0.05 }, "{}", p.name);
            }
        }
    }
    let all: Vec<f64> = units
        .iter()
        .zip(&flats)
        .flat_map(|(u, f)| {
            u.params
                .iter()
                .filter(|p| matches!(p.init, ParamInit::Normal { .. }))
                .flat_map(move |p| f[p.offset..p.offset + p.numel()].iter().map(|&x| x as f64))
        })
        .collect();
    let std = (all.iter().map(|x| x * x).sum::<f64>() / all.len() as f64).sqrt();
    assert!((std - 0.05).abs() < 0.005, "{std}");
}

#[test]
fn config_validation_names_the_key() {
    let bad = |c: LlamaConfig, field: &str| match c.validate() {
        Err(Error::Config { field: f, .. }) => assert_eq!(f, field),
        other => panic!("expected a config error on {field}, got {other:?}"),
    };
    bad(LlamaConfig { num_key_value_heads: Some(3), ..tiny(false) }, "model.num_key_value_heads");
    bad(LlamaConfig { head_dim: Some(5), ..tiny(false) }, "model.head_dim");
    bad(LlamaConfig::new(32, 10, 8, 1, 3), "model.num_attention_heads");
    bad(LlamaConfig { rms_norm_eps: 0.0, ..tiny(false) }, "model.rms_norm_eps");
    bad(LlamaConfig { vocab_size: 0, ..tiny(false) }, "model.vocab_size");
    bad(LlamaConfig { family: LlamaFamily::Mistral, ..tiny(false) }, "model.attention_bias");
    bad(LlamaConfig { attention_bias: Some(false), ..qwen2_tiny() }, "model.attention_bias");
    bad(
        LlamaConfig {
            rope_scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 4.0,
                high_freq_factor: 1.0,
                original_max_position_embeddings: 8192,
            },
            ..tiny(false)
        },
        "model.rope_scaling.high_freq_factor",
    );
    // The TOML form for training from scratch.
    let cfg: LlamaConfig = toml::from_str(
        "vocab_size = 1024\nhidden_size = 256\nintermediate_size = 688\nnum_hidden_layers = 4\n\
         num_attention_heads = 4\nnum_key_value_heads = 2\ntie_word_embeddings = true\n\
         rope_scaling = { rope_type = \"linear\", factor = 2.0 }",
    )
    .unwrap();
    assert_eq!(cfg.kv_heads(), 2);
    assert_eq!(cfg.head_dim(), 64);
    assert_eq!(cfg.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    cfg.validate().unwrap();
    let err = toml::from_str::<LlamaConfig>("vocab_size = 1\nhiden_size = 2").unwrap_err();
    assert!(err.to_string().contains("hiden_size"), "{err}");
}

// ---- fused kernels, op by op ---------------------------------------------------------------

/// Checks the gradients of `f` (its inputs `xs`, F64) by finite differences of the scalar
/// `Σ f(xs) ⊙ w` (random fixed `w`), and returns them.
fn check_op_fd(name: &str, xs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) -> Vec<Tensor> {
    let out = f(xs);
    // The same weights for every call with outputs of this shape (fused and composed compare).
    let w = randn(out.dims(), 0.0, &mut ChaCha8Rng::seed_from_u64(99));
    let vars: Vec<Var> = xs.iter().map(|x| Var::from_tensor(x).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let loss = (f(&ts) * &w).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let scalar = |xs: &[Tensor]| (f(xs) * &w).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    let mut out_grads = Vec::new();
    for (k, v) in vars.iter().enumerate() {
        let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient for input {k}"));
        let ad = to_vec(g);
        let mut x = to_vec(&xs[k]);
        for i in 0..x.len() {
            let orig = x[i];
            let mut eval = |val: f64| {
                x[i] = val;
                let mut ys = xs.to_vec();
                ys[k] = Tensor::from_slice(&x, xs[k].dims(), &Device::Cpu).unwrap();
                scalar(&ys)
            };
            let fd = (eval(orig + FD_STEP) - eval(orig - FD_STEP)) / (2.0 * FD_STEP);
            x[i] = orig;
            assert_fd(&format!("{name} input {k} element {i}"), ad[i], fd);
        }
        out_grads.push(g.clone());
    }
    out_grads
}

fn randn(shape: &[usize], mean: f64, rng: &mut impl Rng) -> Tensor {
    let normal = Normal::new(mean, 1.0).unwrap();
    let n: usize = shape.iter().product();
    Tensor::from_vec((0..n).map(|_| normal.sample(rng)).collect::<Vec<f64>>(), shape, &Device::Cpu).unwrap()
}

#[test]
fn rms_norm_kernel_matches_finite_differences_and_composition() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let x = randn(&[3, 2, 6], 0.2, &mut rng);
    let w = randn(&[6], 1.0, &mut rng);
    let fused =
        check_op_fd("rms_norm fused", &[x.clone(), w.clone()], &|t| rms_norm_fused(&t[0], &t[1], 1e-5).unwrap());
    let composed =
        check_op_fd("rms_norm composed", &[x.clone(), w.clone()], &|t| rms_norm_composed(&t[0], &t[1], 1e-5).unwrap());
    let (a, b) = (rms_norm_fused(&x, &w, 1e-5).unwrap(), rms_norm_composed(&x, &w, 1e-5).unwrap());
    assert!(max_abs_diff(&a, &b) < 1e-14);
    for (g1, g2) in fused.iter().zip(&composed) {
        assert!(max_abs_diff(g1, g2) < 1e-13);
    }
}

#[test]
fn rope_kernel_matches_finite_differences_and_composition() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (b, t, nh, hd) = (2, 5, 3, 6);
    let x = randn(&[b, t, nh, hd], 0.0, &mut rng);
    let cfg = LlamaConfig { head_dim: Some(hd), rope_theta: 100.0, ..LlamaConfig::new(8, 12, 8, 1, 2) };
    let (cos, sin) = rope::tables(&cfg, t, rope::Precision::F64);
    let cos_h = Tensor::from_vec(cos, (t, hd / 2), &Device::Cpu).unwrap();
    let sin_h = Tensor::from_vec(sin, (t, hd / 2), &Device::Cpu).unwrap();
    let cos_f = Tensor::cat(&[&cos_h, &cos_h], 1).unwrap();
    let sin_f = Tensor::cat(&[&sin_h, &sin_h], 1).unwrap();
    let scale = 0.7;
    let fused =
        check_op_fd("rope fused", std::slice::from_ref(&x), &|ts| rope_fused(&ts[0], &cos_h, &sin_h, scale).unwrap());
    let composed = check_op_fd("rope composed", std::slice::from_ref(&x), &|ts| {
        rope_composed(&ts[0].transpose(1, 2).unwrap(), &cos_f, &sin_f).unwrap().affine(scale, 0.0).unwrap()
    });
    let a = rope_fused(&x, &cos_h, &sin_h, scale).unwrap();
    let b2 = rope_composed(&x.transpose(1, 2).unwrap(), &cos_f, &sin_f).unwrap().affine(scale, 0.0).unwrap();
    assert_eq!(a.dims(), [b, nh, t, hd]);
    assert!(max_abs_diff(&a, &b2) < 1e-14);
    assert!(max_abs_diff(&fused[0], &composed[0]) < 1e-14);
    // Position 0 is the identity rotation.
    let x0 = x.narrow(1, 0, 1).unwrap().squeeze(1).unwrap(); // [B, nh, hd]
    let a0 = a.narrow(2, 0, 1).unwrap().squeeze(2).unwrap();
    assert!(max_abs_diff(&(x0 * scale).unwrap(), &a0) < 1e-15);
}

#[test]
fn swiglu_kernel_matches_finite_differences_and_composition() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let gu = randn(&[7, 10], 0.0, &mut rng);
    let fused = check_op_fd("swiglu fused", std::slice::from_ref(&gu), &|t| swiglu_fused(&t[0]).unwrap());
    let composed = check_op_fd("swiglu composed", std::slice::from_ref(&gu), &|t| swiglu_composed(&t[0]).unwrap());
    assert!(max_abs_diff(&swiglu_fused(&gu).unwrap(), &swiglu_composed(&gu).unwrap()) < 1e-15);
    assert!(max_abs_diff(&fused[0], &composed[0]) < 1e-14);
}

#[test]
fn cross_entropy_kernel_matches_finite_differences_and_composition() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (b, t, v) = (2, 4, 9);
    let logits = randn(&[b * t, v], 0.0, &mut rng).affine(3.0, 0.0).unwrap();
    let mut tv: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v as u32)).collect();
    tv[1] = IGNORE_INDEX;
    tv[6] = IGNORE_INDEX;
    let targets = Tensor::from_vec(tv.clone(), b * t, &Device::Cpu).unwrap();
    let fused = check_op_fd("cross-entropy fused", std::slice::from_ref(&logits), &|ts| {
        cross_entropy_rows(&ts[0], &targets).unwrap().sum_all().unwrap().affine(1.0 / 6.0, 0.0).unwrap()
    });
    let t2 = targets.reshape((b, t)).unwrap();
    let composed = check_op_fd("cross-entropy composed", std::slice::from_ref(&logits), &|ts| {
        cross_entropy_composed(&ts[0].reshape((b, t, v)).unwrap(), &t2).unwrap()
    });
    assert!(max_abs_diff(&fused[0], &composed[0]) < 1e-15);
    // Ignored rows: zero loss, zero gradient.
    let rows = cross_entropy_rows(&logits, &targets).unwrap().to_vec1::<f64>().unwrap();
    assert_eq!((rows[1], rows[6]), (0.0, 0.0));
    let g = fused[0].to_vec2::<f64>().unwrap();
    assert!(g[1].iter().chain(&g[6]).all(|&x| x == 0.0));
    // The mean over the counted rows is the composed loss.
    let mean = rows.iter().sum::<f64>() / 6.0;
    let c = crate::ops::scalar(&cross_entropy_composed(&logits.reshape((b, t, v)).unwrap(), &t2).unwrap()).unwrap();
    assert!((mean - c).abs() < 1e-14);
}

// ---- units and the whole model -------------------------------------------------------------

/// Finite differences of `⟨forward(unit), G⟩` against `backward(unit)` for every parameter of
/// one block and the head, and for their inputs.
fn check_unit_fd(model: &Llama, seed: u64) {
    let cfg = model.config().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let units = model.units().to_vec();
    let mut flats = random_params(&units, 0.4, &mut rng);
    let params = to_tensors(&flats, DType::F64);
    let (b, t, d) = (2, 5, cfg.hidden_size);
    let x = randn(&[b, t, d], 0.0, &mut rng);
    let tied = cfg.tie_word_embeddings.then(|| params[0].clone());
    for u in [1, units.len() - 1] {
        let out = model.forward(u, &params[u], &x, tied.as_ref()).unwrap();
        let g = randn(out.dims(), 0.0, &mut rng);
        let grads = model.backward(u, &params[u], &x, &g, tied.as_ref()).unwrap();
        let f = |p: &Tensor, x: &Tensor, tied: Option<&Tensor>| {
            (model.forward(u, p, x, tied).unwrap() * &g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let ad = to_vec(&grads.grad_params);
        for i in 0..units[u].numel {
            let orig = flats[u][i];
            let mut eval = |v: f64| {
                flats[u][i] = v;
                let p = Tensor::from_slice(&flats[u], units[u].numel, &Device::Cpu).unwrap();
                f(&p, &x, tied.as_ref())
            };
            let fd = (eval(orig + FD_STEP) - eval(orig - FD_STEP)) / (2.0 * FD_STEP);
            flats[u][i] = orig;
            assert_fd(&format!("unit {} element {i}", units[u].name), ad[i], fd);
        }
        let gx = to_vec(grads.grad_input.as_ref().unwrap());
        let mut xv = to_vec(&x);
        for i in 0..xv.len() {
            let orig = xv[i];
            let mut eval = |v: f64| {
                xv[i] = v;
                f(&params[u], &Tensor::from_slice(&xv, (b, t, d), &Device::Cpu).unwrap(), tied.as_ref())
            };
            let fd = (eval(orig + FD_STEP) - eval(orig - FD_STEP)) / (2.0 * FD_STEP);
            xv[i] = orig;
            assert_fd(&format!("unit {} input element {i}", units[u].name), gx[i], fd);
        }
        assert_eq!(grads.grad_tied_wte.is_some(), cfg.tie_word_embeddings && u == units.len() - 1);
    }
}

#[test]
fn units_match_finite_differences() {
    for composed in [false, true] {
        for (k, cfg) in [tiny(false), tiny(true), qwen2_tiny(), qwen3_tiny()].into_iter().enumerate() {
            let mut model = Llama::new(cfg).unwrap();
            if composed {
                model = model.composed_only();
            }
            check_unit_fd(&model, 10 + k as u64);
        }
    }
}

/// Loss from unit `start` on, with `input` that unit's input.
fn loss_from(model: &Llama, params: &[Tensor], start: usize, input: &Tensor, targets: &Tensor) -> f64 {
    let n = params.len();
    let tied = model.config().tie_word_embeddings.then(|| &params[0]);
    let mut x = input.clone();
    for (k, p) in params.iter().enumerate().take(n - 1).skip(start) {
        x = model.forward(k, p, &x, None).unwrap();
    }
    model.head_loss(&params[n - 1], &x, tied, targets).unwrap()
}

/// `chunk`: the composed attention's query positions per block (`None`: the default, one
/// block at these sizes).
fn check_model_fd(cfg: LlamaConfig, composed: bool, chunk: Option<usize>, seed: u64) {
    let mut model = Llama::new(cfg.clone()).unwrap().with_attention_chunk(chunk).unwrap();
    if composed {
        model = model.composed_only();
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (b, t) = (2, 6);
    let tokens = ids(b, t, cfg.vocab_size, &mut rng);
    let mut tv = ids(b, t, cfg.vocab_size, &mut rng).to_vec2::<u32>().unwrap();
    tv[1][4] = IGNORE_INDEX;
    tv[1][5] = IGNORE_INDEX;
    let targets = Tensor::new(tv, &Device::Cpu).unwrap();
    let units = model.units().to_vec();
    let mut flats = random_params(&units, 0.4, &mut rng);
    let params = to_tensors(&flats, DType::F64);
    let (loss, grads) = loss_and_grads(&model, &params, &tokens, &targets).unwrap();
    assert!((loss - crate::lm::loss(&model, &params, &tokens, &targets).unwrap()).abs() < 1e-12);
    let mut inputs = vec![tokens.clone()];
    for u in 0..params.len() - 1 {
        let x = model.forward(u, &params[u], &inputs[u], None).unwrap();
        inputs.push(x);
    }
    let mut checked = 0;
    for (u, spec) in units.iter().enumerate() {
        let ad = to_vec(&grads[u]);
        let start = if cfg.tie_word_embeddings && u == 0 { 0 } else { u };
        for i in 0..spec.numel {
            let orig = flats[u][i];
            let mut eval = |v: f64| {
                flats[u][i] = v;
                let mut ps = params.clone();
                ps[u] = Tensor::from_slice(&flats[u], spec.numel, &Device::Cpu).unwrap();
                loss_from(&model, &ps, start, &inputs[start], &targets)
            };
            let fd = (eval(orig + FD_STEP) - eval(orig - FD_STEP)) / (2.0 * FD_STEP);
            flats[u][i] = orig;
            assert_fd(&format!("composed={composed} unit {} element {i}", spec.name), ad[i], fd);
            checked += 1;
        }
    }
    assert_eq!(checked, cfg.num_params());
}

#[test]
fn model_gradients_match_finite_differences() {
    check_model_fd(tiny(false), false, None, 21);
    check_model_fd(tiny(true), false, None, 22);
    check_model_fd(qwen2_tiny(), false, None, 23);
    check_model_fd(qwen3_tiny(), false, None, 25);
    let llama3 = LlamaConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        },
        ..tiny(false)
    };
    check_model_fd(llama3, false, None, 24);
}

#[test]
fn model_gradients_match_finite_differences_composed_ops() {
    check_model_fd(tiny(false), true, None, 31);
    check_model_fd(qwen2_tiny(), true, None, 32);
    // T = 6 over blocks of 4 queries (4 + 2) and of 1.
    check_model_fd(tiny(false), true, Some(4), 33);
    check_model_fd(qwen2_tiny(), true, Some(1), 34);
    check_model_fd(qwen3_tiny(), true, None, 35);
}

/// A decoder layer whose composed attention runs over query blocks (of 1, 4 and 5 positions at
/// T = 13: blocks that divide T and that do not) against the same layer as one block: the
/// output and every gradient (each parameter, the input) within F32 rounding (1e-5 of each
/// tensor's largest element) and, in BF16, within 2^-5 of it (a BF16 result is rounded once
/// from F32 sums that the blocks order differently, and a gradient passes through a few such
/// roundings; a missed block or key is an error of order 1). GQA with q/k/v/o and MLP biases,
/// GQA without, and Qwen2's multi-head attention with q/k/v biases.
#[test]
fn attention_blocks_match_one_block_in_a_decoder_layer() {
    let t = 13;
    let cases = [
        ("gqa, biases", tiny(false)),
        ("gqa, no bias", LlamaConfig { attention_bias: Some(false), mlp_bias: false, ..tiny(false) }),
        ("qwen2 mha, qkv bias", qwen2_tiny()),
    ];
    for (k, (name, cfg)) in cases.into_iter().enumerate() {
        let cfg = LlamaConfig { max_position_embeddings: 16, ..cfg };
        let one = Llama::new(cfg.clone()).unwrap().composed_only().with_attention_chunk(Some(t)).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(50 + k as u64);
        let unit = &one.units()[1];
        let flat = &random_params(one.units(), 0.4, &mut rng)[1];
        let x = randn(&[2, t, cfg.hidden_size], 0.0, &mut rng);
        let g = randn(&[2, t, cfg.hidden_size], 0.0, &mut rng);
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1.0 / 32.0)] {
            let p = Tensor::from_slice(flat, unit.numel, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let (x, g) = (x.to_dtype(dtype).unwrap(), g.to_dtype(dtype).unwrap());
            let y1 = one.forward(1, &p, &x, None).unwrap();
            let g1 = one.backward(1, &p, &x, &g, None).unwrap();
            for chunk in [1, 4, 5] {
                let blocks =
                    Llama::new(cfg.clone()).unwrap().composed_only().with_attention_chunk(Some(chunk)).unwrap();
                let y = blocks.forward(1, &p, &x, None).unwrap();
                let gb = blocks.backward(1, &p, &x, &g, None).unwrap();
                let rel = |a: &Tensor, b: &Tensor| max_abs_diff(a, b) / max_abs(b);
                let what = format!("{name} {dtype:?} chunk {chunk}");
                assert!(rel(&y, &y1) <= tol, "{what}: output off by {:e}", rel(&y, &y1));
                let gx = rel(gb.grad_input.as_ref().unwrap(), g1.grad_input.as_ref().unwrap());
                assert!(gx <= tol, "{what}: input gradient off by {gx:e}");
                for ps in &unit.params {
                    let part = |t: &Tensor| t.narrow(0, ps.offset, ps.numel()).unwrap();
                    let e = rel(&part(&gb.grad_params), &part(&g1.grad_params));
                    assert!(e <= tol, "{what}: gradient of {} off by {e:e}", ps.name);
                }
            }
        }
    }
}

/// Fused CPU kernels and op compositions: the same loss and gradients (f64: to rounding; f32:
/// 1e-4 of the largest gradient).
#[test]
fn fused_kernels_match_composed_ops() {
    for (dtype, rtol) in [(DType::F64, 1e-12), (DType::F32, 1e-4)] {
        for cfg in [tiny(false), tiny(true), qwen2_tiny()] {
            let fused = Llama::new(cfg.clone()).unwrap();
            let composed = Llama::new(cfg.clone()).unwrap().composed_only();
            let mut rng = ChaCha8Rng::seed_from_u64(41);
            let tokens = ids(3, 8, 32, &mut rng);
            let mut tv = ids(3, 8, 32, &mut rng).to_vec2::<u32>().unwrap();
            tv[2][7] = IGNORE_INDEX;
            let targets = Tensor::new(tv, &Device::Cpu).unwrap();
            let params = to_tensors(&random_params(fused.units(), 0.3, &mut rng), dtype);
            let (l1, g1) = crate::lm::loss_and_grads(&fused, &params, &tokens, &targets).unwrap();
            let (l2, g2) = crate::lm::loss_and_grads(&composed, &params, &tokens, &targets).unwrap();
            assert!((l1 - l2).abs() <= rtol * l2.abs(), "{dtype:?}: {l1} vs {l2}");
            let logits1 = crate::lm::forward_all(&fused, &params, &tokens).unwrap();
            let logits2 = crate::lm::forward_all(&composed, &params, &tokens).unwrap();
            assert!(max_abs_diff(&logits1, &logits2) <= rtol * max_abs(&logits2));
            for (u, (a, b)) in g1.iter().zip(&g2).enumerate() {
                let (diff, scale) = (max_abs_diff(a, b), max_abs(b));
                assert!(diff <= rtol * scale, "{dtype:?} unit {u}: {diff:e} vs scale {scale:e}");
            }
        }
    }
}

/// GQA equals multi-head attention with each key/value head repeated for its group
/// (transformers' `repeat_kv`: query head `h` reads key/value head `h / (H / KV)`).
#[test]
fn gqa_equals_attention_with_repeated_kv_heads() {
    let gqa_cfg = LlamaConfig { attention_bias: Some(false), mlp_bias: false, ..tiny(false) };
    let mha_cfg = LlamaConfig { num_key_value_heads: Some(4), ..gqa_cfg.clone() };
    let (gqa, mha) = (Llama::new(gqa_cfg.clone()).unwrap(), Llama::new(mha_cfg).unwrap());
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let flats = random_params(gqa.units(), 0.4, &mut rng);
    let hd = gqa_cfg.head_dim();
    let rep = 2;
    // Build the MHA block: k/v rows of KV head j repeated for heads j*rep .. j*rep+rep.
    let g_unit = &gqa.units()[1];
    let m_unit = &mha.units()[1];
    let mut m_flat = vec![0f64; m_unit.numel];
    for mp in &m_unit.params {
        let gp = g_unit.param(&mp.name).unwrap();
        let src = &flats[1][gp.offset..gp.offset + gp.numel()];
        let dst = &mut m_flat[mp.offset..mp.offset + mp.numel()];
        if mp.name.ends_with("k_proj.weight") || mp.name.ends_with("v_proj.weight") {
            let row = gp.shape[1] * hd; // one head's rows
            for h in 0..4 {
                dst[h * row..(h + 1) * row].copy_from_slice(&src[(h / rep) * row..(h / rep + 1) * row]);
            }
        } else {
            dst.copy_from_slice(src);
        }
    }
    let x = randn(&[2, 6, gqa_cfg.hidden_size], 0.0, &mut rng);
    for composed in [false, true] {
        let (g, m) = if composed {
            (Llama::new(gqa_cfg.clone()).unwrap().composed_only(), mha.config().clone())
        } else {
            (Llama::new(gqa_cfg.clone()).unwrap(), mha.config().clone())
        };
        let m = Llama::new(m).unwrap();
        let pg = Tensor::from_slice(&flats[1], g_unit.numel, &Device::Cpu).unwrap();
        let pm = Tensor::from_slice(&m_flat, m_unit.numel, &Device::Cpu).unwrap();
        let yg = g.forward(1, &pg, &x, None).unwrap();
        let ym = m.forward(1, &pm, &x, None).unwrap();
        assert!(max_abs_diff(&yg, &ym) < 1e-13, "composed={composed}");
    }
}

/// The llama3 and linear frequencies against transformers' formulas written out directly in
/// f64 (`_compute_llama3_parameters`, `_compute_linear_scaling_rope_parameters`).
#[test]
fn rope_scaling_follows_transformers() {
    let base = LlamaConfig { head_dim: Some(64), rope_theta: 500000.0, ..LlamaConfig::new(8, 128, 8, 1, 2) };
    let default = rope::inv_freq(&base, rope::Precision::F64);
    for (i, f) in default.iter().enumerate() {
        let want = 1.0 / 500000f64.powf((2 * i) as f64 / 64.0);
        assert!((f - want).abs() <= 1e-15 * want);
    }
    let linear = rope::inv_freq(
        &LlamaConfig { rope_scaling: RopeScaling::Linear { factor: 4.0 }, ..base.clone() },
        rope::Precision::F64,
    );
    assert!(linear.iter().zip(&default).all(|(l, d)| (l - d / 4.0).abs() <= 1e-18));
    let (factor, low, high, old) = (32.0, 1.0, 4.0, 8192usize);
    let l3 = rope::inv_freq(
        &LlamaConfig {
            rope_scaling: RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: old,
            },
            ..base.clone()
        },
        rope::Precision::F64,
    );
    let (low_wl, high_wl) = (old as f64 / low, old as f64 / high);
    let (mut n_low, mut n_high, mut n_mid) = (0, 0, 0);
    for (f, g) in default.iter().zip(&l3) {
        let wl = 2.0 * std::f64::consts::PI / f;
        let want = if wl < high_wl {
            n_high += 1;
            *f
        } else if wl > low_wl {
            n_low += 1;
            f / factor
        } else {
            n_mid += 1;
            let s = (old as f64 / wl - low) / (high - low);
            (1.0 - s) * f / factor + s * f
        };
        assert!((g - want).abs() <= 1e-12 * want, "{g} vs {want}");
    }
    assert!(n_low > 0 && n_high > 0 && n_mid > 0, "{n_low} {n_mid} {n_high}");
    // The f32 tables are the f64 ones to f32 rounding.
    let f32s = rope::inv_freq(&base, rope::Precision::F32);
    assert!(f32s.iter().zip(&default).all(|(a, b)| (a - b).abs() <= 2e-7 * b));
}

#[test]
fn future_tokens_do_not_change_earlier_logits() {
    for composed in [false, true] {
        let cfg = LlamaConfig { max_position_embeddings: 16, ..tiny(false) };
        let mut model = Llama::new(cfg.clone()).unwrap();
        if composed {
            model = model.composed_only();
        }
        let params: Vec<Tensor> =
            init_params(model.units(), 1).iter().map(|f| unit_tensor(f, DType::F32, &Device::Cpu).unwrap()).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let tokens = ids(2, 12, 32, &mut rng);
        let base = crate::lm::forward_all(&model, &params, &tokens).unwrap().to_vec3::<f32>().unwrap();
        for k in [0, 5, 11] {
            let mut v = tokens.to_vec2::<u32>().unwrap();
            v[1][k] = (v[1][k] + 1) % 32;
            let out = crate::lm::forward_all(&model, &params, &Tensor::new(v, &Device::Cpu).unwrap()).unwrap();
            let out = out.to_vec3::<f32>().unwrap();
            for t in 0..12 {
                if t < k {
                    assert_eq!(base[1][t], out[1][t], "composed={composed}: position {t} saw token {k}");
                } else {
                    assert_ne!(base[1][t], out[1][t], "position {t} did not see token {k}");
                }
                assert_eq!(base[0][t], out[0][t]);
            }
        }
    }
}

#[test]
fn ignored_targets_leave_the_mean_and_the_gradients() {
    let cfg = tiny(true);
    let model = Llama::new(cfg.clone()).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let params = to_tensors(&random_params(model.units(), 0.3, &mut rng), DType::F64);
    let tokens = ids(2, 6, 32, &mut rng);
    let full = ids(2, 6, 32, &mut rng).to_vec2::<u32>().unwrap();
    let mut ign = full.clone();
    ign[0][2] = IGNORE_INDEX;
    ign[1][5] = IGNORE_INDEX;
    let head = model.units().len() - 1;
    let x = crate::lm::forward_all(&model, &params[..1], &tokens).err(); // wrong length: an input error
    assert!(matches!(x, Some(Error::Input { .. })));
    let mut h = model.forward(0, &params[0], &tokens, None).unwrap();
    for (u, p) in params.iter().enumerate().take(head).skip(1) {
        h = model.forward(u, p, &h, None).unwrap();
    }
    let logits = model.forward(head, &params[head], &h, Some(&params[0])).unwrap().to_vec3::<f64>().unwrap();
    let ce = |b: usize, t: usize, y: u32| {
        let z = &logits[b][t];
        let m = z.iter().fold(f64::MIN, |m, &v| m.max(v));
        (z.iter().map(|v| (v - m).exp()).sum::<f64>()).ln() + m - z[y as usize]
    };
    let mut sum = 0.0;
    let mut n = 0;
    for (b, row) in ign.iter().enumerate() {
        for (t, &y) in row.iter().enumerate() {
            if y != IGNORE_INDEX {
                sum += ce(b, t, y);
                n += 1;
            }
        }
    }
    let targets = Tensor::new(ign, &Device::Cpu).unwrap();
    for composed in [false, true] {
        let m =
            if composed { Llama::new(cfg.clone()).unwrap().composed_only() } else { Llama::new(cfg.clone()).unwrap() };
        let hl = m.head_loss_backward(&params[head], &h, Some(&params[0]), &targets).unwrap();
        assert_eq!(hl.tokens, 10);
        assert!((hl.loss - sum / n as f64).abs() < 1e-12, "composed={composed}");
        let tl = m.head_loss_sum(&params[head], &h, Some(&params[0]), &targets).unwrap();
        assert_eq!(tl.tokens, 10);
        assert!((tl.sum_nats - sum).abs() < 1e-11);
        // Every target ignored: loss 0, zero gradients (not NaN).
        let none = Tensor::full(IGNORE_INDEX, (2, 6), &Device::Cpu).unwrap();
        let z = m.head_loss_backward(&params[head], &h, Some(&params[0]), &none).unwrap();
        assert_eq!((z.loss, z.tokens), (0.0, 0));
        assert_eq!(max_abs(z.grads.grad_input.as_ref().unwrap()), 0.0);
        assert_eq!(max_abs(&z.grads.grad_params), 0.0);
    }
    // An id past the vocabulary that is not the ignore index is an error.
    let bad = Tensor::new(&[[0u32, 1, 2, 3, 4, 32], [0, 1, 2, 3, 4, 5]], &Device::Cpu).unwrap();
    assert!(matches!(model.head_loss(&params[head], &h, Some(&params[0]), &bad), Err(Error::Input { .. })));
}

#[test]
fn bad_inputs_are_errors_naming_the_argument() {
    let model = Llama::new(tiny(true)).unwrap();
    let params: Vec<Tensor> =
        init_params(model.units(), 1).iter().map(|f| unit_tensor(f, DType::F32, &Device::Cpu).unwrap()).collect();
    let dev = Device::Cpu;
    let what = |r: Result<Tensor>| match r {
        Err(Error::Input { what, .. }) => what,
        other => panic!("expected an input error, got {other:?}"),
    };
    let big = Tensor::new(&[[0u32, 32]], &dev).unwrap();
    assert_eq!(what(model.forward(0, &params[0], &big, None)), "embedding input");
    let long = Tensor::zeros((1, 9), DType::U32, &dev).unwrap();
    assert_eq!(what(model.forward(0, &params[0], &long, None)), "embedding input");
    let tok = Tensor::zeros((1, 3), DType::U32, &dev).unwrap();
    assert_eq!(what(model.forward(0, &params[1], &tok, None)), "unit parameters shape");
    assert_eq!(what(model.forward(9, &params[1], &tok, None)), "unit index");
    let x = Tensor::zeros((1, 3, 5), DType::F32, &dev).unwrap();
    assert_eq!(what(model.forward(1, &params[1], &x, None)), "block input");
    let x = Tensor::zeros((1, 3, 12), DType::F64, &dev).unwrap();
    assert_eq!(what(model.forward(1, &params[1], &x, None)), "block input");
    let x = Tensor::zeros((1, 3, 12), DType::F32, &dev).unwrap();
    assert_eq!(what(model.forward(3, &params[3], &x, None)), "tied");
    assert!(model.forward(3, &params[3], &x, Some(&params[0])).is_ok());
    let targets = Tensor::zeros((1, 2), DType::U32, &dev).unwrap();
    assert!(matches!(
        model.head_loss(&params[3], &x, Some(&params[0]), &targets),
        Err(Error::Input { what: "targets shape", .. })
    ));
}

#[test]
fn init_loss_is_near_uniform_and_trait_objects_work() {
    let cfg = LlamaConfig { max_position_embeddings: 16, ..LlamaConfig::new(64, 32, 64, 2, 4) };
    let model: Box<dyn CausalLm> = Box::new(Llama::new(cfg).unwrap());
    let params: Vec<Tensor> =
        init_params(model.units(), 1).iter().map(|f| unit_tensor(f, DType::F32, &Device::Cpu).unwrap()).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (loss, grads) =
        loss_and_grads(model.as_ref(), &params, &ids(4, 16, 64, &mut rng), &ids(4, 16, 64, &mut rng)).unwrap();
    assert!((loss - 64f64.ln()).abs() < 0.05, "{loss}");
    assert_eq!(grads.len(), model.units().len());
}

// ---- half precision --------------------------------------------------------------------------

/// The BF16 embedding's gradient is the scatter-add of its rows' gradients accumulated in F32:
/// one id at 4032 of 4096 positions with gradients ~1e-3 sums to ~4 within one rounding of the
/// exact sum (an f64 sum of the same BF16 values), where candle's `index_select` backward in
/// BF16 (the path F32 and F64 take) stalls far below it (each add is lost once the running sum's
/// spacing exceeds twice the addend).
#[test]
fn bf16_embedding_gradient_accumulates_in_f32() {
    let (b, t, v, d) = (64, 64, 32, 8);
    let cfg = LlamaConfig { max_position_embeddings: t, ..LlamaConfig::new(v, d, 8, 1, 2) };
    let model = Llama::new(cfg).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(40);
    // Id 5 everywhere but the first position of each row (id 7: 64 hits).
    let ids: Vec<u32> = (0..b * t).map(|k| if k % t == 0 { 7 } else { 5 }).collect();
    let tokens = Tensor::from_vec(ids.clone(), (b, t), &Device::Cpu).unwrap();
    let g = bf16_uniform(&[b, t, d], 0.5e-3, 1.5e-3, &mut rng);
    let params = bf16_uniform(&[v * d], -1.0, 1.0, &mut rng);

    let got = model.backward(0, &params, &tokens, &g, None).unwrap();
    assert_eq!(got.grad_params.dtype(), DType::BF16);
    assert_eq!(got.grad_params.dims(), [v * d]);
    assert!(got.grad_input.is_none() && got.grad_tied_wte.is_none());
    let got = to_vec(&got.grad_params);

    let gv = to_vec(&g);
    let mut exact = vec![0f64; v * d];
    for (k, &id) in ids.iter().enumerate() {
        for j in 0..d {
            exact[id as usize * d + j] += gv[k * d + j];
        }
    }
    assert_within_bf16_spacing(&got, &exact);
    assert!(exact[5 * d] > 3.0 && exact[7 * d] > 0.03);

    assert_bf16_accumulation_far_off(&params.reshape((v, d)).unwrap(), &tokens, &g, &exact, 5 * d);
}

/// The attention softmax of BF16 runs in F32: with zero queries every score is 0 and row `i`
/// of the causal softmax is `1/(i+1)` on its `i+1` keys; with every input row equal the values
/// are equal too, so every output row equals row 0's (which attends to itself alone). A BF16
/// softmax sums the `i+1` ones in BF16, which stalls at 256 (257 is not a BF16 number): rows
/// past 256 would come out up to 2x row 0's.
#[test]
fn bf16_attention_softmax_is_in_f32() {
    let (t, d) = (512, 8);
    let cfg = LlamaConfig { max_position_embeddings: t, ..LlamaConfig::new(32, d, 8, 1, 2) };
    let model = Llama::new(cfg).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let q_w = Tensor::zeros((d, d), DType::BF16, &Device::Cpu).unwrap();
    let (k_w, v_w, o_w) = (
        bf16_uniform(&[d, d], -1.0, 1.0, &mut rng),
        bf16_uniform(&[d, d], -1.0, 1.0, &mut rng),
        bf16_uniform(&[d, d], -1.0, 1.0, &mut rng),
    );
    let p = AttnParams {
        q_w: &q_w,
        q_b: None,
        k_w: &k_w,
        k_b: None,
        v_w: &v_w,
        v_b: None,
        o_w: &o_w,
        o_b: None,
        q_norm: None,
        k_norm: None,
    };
    let row = bf16_uniform(&[1, 1, d], -1.0, 1.0, &mut rng);
    let h = row.broadcast_as((1, t, d)).unwrap().contiguous().unwrap();
    // Each row: the probabilities rounded once (≤ 2^-9 each, the same for all keys of a row),
    // the weighted sum rounded once, o_proj's output rounded once: a few roundings of `scale`.
    assert_rows_equal_row_0(&model.attention(&p, &h).unwrap());
}
