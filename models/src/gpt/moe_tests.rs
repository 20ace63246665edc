//! Tests of the MoE-GPT: layout and unit order, config, init, routing (top-k, gates, capacity,
//! auxiliary loss), finite-difference gradients of every parameter, unit-wise == whole graph,
//! experts without tokens, determinism, input errors.

use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::moe::{aux_value, combine_math, gate_values};
use super::tests::{ids, max_abs_diff, random_params, to_tensors, FD_ATOL, FD_RTOL, FD_STEP};
use super::*;
use crate::kernels::cross_entropy_composed;
use crate::lm::{CausalLm, MoeLm};
use crate::ops::views;
use crate::shared_tests::{assert_grads_within, bf16_uniform, to_vec, BF16_SPACING};
use crate::unit::{init_params, init_unit_from_seed, ParamInit, ParamSpec, UnitKind};
use crate::unit_tensor;
use crate::Error;

/// The tiny MoE config of the gradient checks: d = 8, 2 heads, 2 layers, E = 4 experts of width
/// 12, `aux_loss_coef` 0.5 (large, so the auxiliary gradient weighs in the check).
fn moe_tiny(top_k: usize, capacity_factor: Option<f64>, tied: bool) -> GptConfig {
    GptConfig {
        vocab_size: 256,
        d_model: 8,
        n_layer: 2,
        n_head: 2,
        d_ff: None,
        max_seq_len: 6,
        tied_head: tied,
        ln_eps: 1e-5,
        moe: Some(MoeConfig { experts: 4, top_k, aux_loss_coef: 0.5, capacity_factor, d_expert: Some(12) }),
    }
}

fn cpu() -> Device {
    Device::Cpu
}

/// Random parameters ([`random_params`], std 0.3) whose routing spreads tokens over the experts:
/// with every parameter at std 0.3 the common part of `h` (the `ln_2` bias) and the router bias
/// dominate the logits and send every token to one expert. Here `ln_2.weight` is `1 + 0.3 ·
/// N(0, 1)`, `ln_2.bias` and the router bias are scaled by 0.1 and the router weight by 3, so
/// the logits vary from token to token (std ~1).
fn moe_random_params(cfg: &GptConfig, rng: &mut ChaCha8Rng) -> Vec<Vec<f64>> {
    let mut flats = random_params(cfg, 0.3, rng);
    for i in 0..cfg.n_layer {
        let spec = &cfg.units()[cfg.block_unit(i)];
        let flat = &mut flats[spec.index];
        let mut scale = |name: &str, a: f64, b: f64| {
            let p = spec.param(&format!("blocks.{i}.{name}")).unwrap();
            flat[p.offset..p.offset + p.numel()].iter_mut().for_each(|x| *x = a * *x + b);
        };
        scale("ln_2.weight", 1.0, 1.0);
        scale("ln_2.bias", 0.1, 0.0);
        scale("router.weight", 3.0, 0.0);
        scale("router.bias", 0.1, 0.0);
    }
    flats
}

// ---- layout, config, init ------------------------------------------------------------------

#[test]
fn moe_layout_unit_order_and_sizes() {
    let cfg = GptConfig {
        d_model: 16,
        n_head: 4,
        n_layer: 3,
        moe: Some(MoeConfig { experts: 5, ..MoeConfig::default() }),
        ..GptConfig::default()
    };
    cfg.validate().unwrap();
    let units = cfg.units();
    let e = 5;
    assert_eq!(units.len(), 3 * (1 + e) + 2);
    assert_eq!(cfg.num_units(), units.len());
    assert_eq!(units[0].kind, UnitKind::Embedding);
    assert_eq!(units[cfg.head_unit()].kind, UnitKind::Head);
    let mut names = std::collections::HashSet::new();
    for (i, u) in units.iter().enumerate() {
        assert_eq!(u.index, i);
        let mut off = 0;
        for p in &u.params {
            assert_eq!(p.offset, off, "{}", p.name);
            assert!(names.insert(p.name.clone()), "duplicate {}", p.name);
            off += p.numel();
        }
        assert_eq!(off, u.numel);
    }
    let (d, f, v, s) = (16, cfg.expert_dim(), 256, 256);
    assert_eq!(f, 4 * 16, "d_expert defaults to d_ff");
    for i in 0..3 {
        let t = &units[cfg.block_unit(i)];
        assert_eq!(t.kind, UnitKind::MoeTrunk(i));
        assert_eq!(t.name, format!("blocks.{i}"));
        assert_eq!(t.param(&format!("blocks.{i}.router.weight")).unwrap().shape, [d, e]);
        assert_eq!(t.param(&format!("blocks.{i}.router.bias")).unwrap().shape, [e]);
        assert!(t.param(&format!("blocks.{i}.mlp.fc.weight")).is_none());
        assert_eq!(t.numel, 4 * d * d + 8 * d + d * e + e);
        for x in 0..e {
            let u = &units[cfg.expert_unit(i, x)];
            assert_eq!(u.kind, UnitKind::Expert { block: i, expert: x });
            assert_eq!(u.name, format!("blocks.{i}.experts.{x}"));
            assert_eq!(u.param(&format!("blocks.{i}.experts.{x}.fc.weight")).unwrap().shape, [d, f]);
            assert_eq!(u.numel, 2 * d * f + f + d);
            // Same offsets and shapes as every other expert (expert_forward takes any of them).
            let first = &units[cfg.expert_unit(0, 0)];
            for (a, b) in u.params.iter().zip(&first.params) {
                assert_eq!((a.offset, &a.shape, a.init), (b.offset, &b.shape, b.init));
            }
        }
    }
    // Unit order: embed, trunk 0, experts of block 0, trunk 1, ...
    assert_eq!(cfg.block_unit(1), 1 + 1 + e);
    assert_eq!(cfg.expert_unit(1, 0), cfg.block_unit(1) + 1);
    let expect = v * d + s * d + 3 * ((4 * d * d + 8 * d + d * e + e) + e * (2 * d * f + f + d)) + 2 * d + d * v;
    assert_eq!(cfg.num_params(), expect);
    // A custom expert width.
    let c2 = GptConfig { moe: Some(MoeConfig { d_expert: Some(24), ..MoeConfig::default() }), ..cfg.clone() };
    assert_eq!(c2.expert_dim(), 24);
    assert_eq!(c2.units()[c2.expert_unit(0, 0)].params[0].shape, [d, 24]);
    // The dense layout and helpers are unchanged.
    let dense = GptConfig { moe: None, ..cfg };
    assert_eq!(dense.num_units(), 5);
    assert_eq!(dense.block_unit(2), 3);
    assert_eq!(dense.units()[3].kind, UnitKind::Block(2));
}

#[test]
fn moe_config_from_toml_and_validation() {
    let cfg: GptConfig =
        toml::from_str("d_model = 64\nn_head = 8\n[moe]\nexperts = 6\ntop_k = 1\ncapacity_factor = 1.25").unwrap();
    let moe = cfg.moe.clone().unwrap();
    assert_eq!(
        (moe.experts, moe.top_k, moe.aux_loss_coef, moe.capacity_factor, moe.d_expert),
        (6, 1, 0.01, Some(1.25), None)
    );
    cfg.validate().unwrap();
    let all: GptConfig = toml::from_str("[moe]").unwrap();
    assert_eq!(all.moe, Some(MoeConfig::default()));
    assert_eq!(MoeConfig::default().top_k, 2);
    let err = toml::from_str::<GptConfig>("[moe]\nexpert = 4").unwrap_err();
    assert!(err.to_string().contains("expert"), "{err}");
    // Capacity: ceil(cf · N · k / E).
    let m = MoeConfig { experts: 4, top_k: 2, capacity_factor: Some(0.75), ..MoeConfig::default() };
    assert_eq!(m.capacity(10), Some(4)); // ceil(3.75)
    assert_eq!(MoeConfig { capacity_factor: Some(1e-9), ..m.clone() }.capacity(10), Some(1));
    assert_eq!(MoeConfig { capacity_factor: None, ..m }.capacity(10), None);

    let bad = |moe: MoeConfig, field: &str| {
        let c = GptConfig { moe: Some(moe), ..GptConfig::default() };
        match c.validate() {
            Err(Error::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected a config error on {field}, got {other:?}"),
        }
    };
    let d = MoeConfig::default;
    bad(MoeConfig { experts: 1, top_k: 1, ..d() }, "model.moe.experts");
    bad(MoeConfig { top_k: 0, ..d() }, "model.moe.top_k");
    bad(MoeConfig { top_k: 3, ..d() }, "model.moe.top_k");
    bad(MoeConfig { aux_loss_coef: -0.1, ..d() }, "model.moe.aux_loss_coef");
    bad(MoeConfig { aux_loss_coef: f64::NAN, ..d() }, "model.moe.aux_loss_coef");
    bad(MoeConfig { capacity_factor: Some(0.0), ..d() }, "model.moe.capacity_factor");
    bad(MoeConfig { capacity_factor: Some(f64::INFINITY), ..d() }, "model.moe.capacity_factor");
    bad(MoeConfig { d_expert: Some(0), ..d() }, "model.moe.d_expert");
    // Two experts, top-2 is allowed.
    GptConfig { moe: Some(MoeConfig { experts: 2, top_k: 2, ..d() }), ..GptConfig::default() }.validate().unwrap();
}

#[test]
fn moe_init_is_deterministic_router_and_experts() {
    let cfg = GptConfig {
        d_model: 64,
        n_head: 4,
        n_layer: 2,
        moe: Some(MoeConfig { experts: 8, ..MoeConfig::default() }),
        ..GptConfig::default()
    };
    let a = init_params(&cfg.units(), 7);
    assert_eq!(a, init_params(&cfg.units(), 7));
    assert_ne!(a[cfg.expert_unit(0, 1)], init_params(&cfg.units(), 8)[cfg.expert_unit(0, 1)]);
    let units = cfg.units();
    // Each expert alone gives the same vector, and experts differ from each other.
    let u = &units[cfg.expert_unit(1, 3)];
    assert_eq!(init_unit_from_seed(u, 7), a[u.index]);
    assert_ne!(a[cfg.expert_unit(0, 0)], a[cfg.expert_unit(0, 1)]);
    let std = |v: &[f32]| (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    let trunk = &units[cfg.block_unit(0)];
    let rw = trunk.param("blocks.0.router.weight").unwrap();
    assert_eq!(rw.init, ParamInit::Normal { std: 0.02 });
    let got = std(&a[trunk.index][rw.offset..rw.offset + rw.numel()]);
    assert!((got - 0.02).abs() < 0.002, "router std {got}");
    let rb = trunk.param("blocks.0.router.bias").unwrap();
    assert!(a[trunk.index][rb.offset..rb.offset + rb.numel()].iter().all(|x| *x == 0.0));
    let ex = &units[cfg.expert_unit(0, 2)];
    assert_eq!(ex.param("blocks.0.experts.2.fc.weight").unwrap().init, ParamInit::Normal { std: 0.02 });
    assert_eq!(ex.param("blocks.0.experts.2.proj.weight").unwrap().init, ParamInit::Normal { std: 0.02 / 2.0 });
    assert_eq!(ex.param("blocks.0.experts.2.proj.bias").unwrap().init, ParamInit::Zeros);
}

// ---- routing ---------------------------------------------------------------------------------

/// One MoE block through the unit calls, as a trainer runs it: `(y, trunk output, expert
/// outputs)`.
fn moe_block_forward(
    gpt: &Gpt,
    i: usize,
    params: &[Tensor],
    x: &Tensor,
) -> crate::Result<(Tensor, TrunkOut, Vec<Option<Tensor>>)> {
    let cfg = gpt.config();
    let tr = gpt.trunk_forward(i, &params[cfg.block_unit(i)], x)?;
    let mut outs = Vec::with_capacity(tr.routing.num_experts());
    for e in 0..tr.routing.num_experts() {
        outs.push(match tr.routing.expert_input(e, &tr.h)? {
            Some(h_e) => Some(gpt.expert_forward(&params[cfg.expert_unit(i, e)], &h_e)?),
            None => None,
        });
    }
    let y = gpt.combine(&tr.x1, &tr.routing, &outs)?;
    Ok((y, tr, outs))
}

fn probs_tensor(rows: &[&[f64]]) -> Tensor {
    let e = rows[0].len();
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), e), &cpu()).unwrap()
}

fn router_only(experts: usize, top_k: usize, capacity_factor: Option<f64>, coef: f64) -> Gpt {
    let moe = MoeConfig { experts, top_k, aux_loss_coef: coef, capacity_factor, d_expert: None };
    Gpt::new(GptConfig { d_model: 2, n_head: 1, n_layer: 1, moe: Some(moe), ..GptConfig::default() }).unwrap()
}

fn gates_of(r: &Routing, e: usize) -> Vec<f64> {
    r.gates(e).map(to_vec).unwrap_or_default()
}

/// Top-1 (Switch): gate = the raw probability; capacity `ceil(cf · N / E)` keeps the first
/// tokens in token order; the aux loss is `coef · E · Σ f_e P_e` with `f` before drops.
#[test]
fn routing_top1_capacity_drops_in_token_order() {
    let gpt = router_only(2, 1, Some(1.0), 0.1);
    let rows: [&[f64]; 6] = [&[0.9, 0.1], &[0.6, 0.4], &[0.3, 0.7], &[0.8, 0.2], &[0.5, 0.5], &[0.7, 0.3]];
    let r = gpt.route(&probs_tensor(&rows)).unwrap();
    assert_eq!(r.choices(), [0, 0, 1, 0, 0, 0]); // the tie of token 4 goes to expert 0
    assert_eq!(r.capacity(), Some(3)); // ceil(1.0 · 6 · 1 / 2)
    assert_eq!(r.demand(), [5, 1]);
    assert_eq!(r.tokens(0), [0, 1, 3]); // tokens 4 and 5 dropped
    assert_eq!(r.tokens(1), [2]);
    assert_eq!(r.counts(), [3, 1]);
    assert_eq!(r.dropped(), 2);
    assert_eq!(gates_of(&r, 0), [0.9, 0.6, 0.8]);
    assert_eq!(gates_of(&r, 1), [0.7]);
    assert_eq!(r.top1_fraction(), [5.0 / 6.0, 1.0 / 6.0]);
    let p0 = (0.9 + 0.6 + 0.3 + 0.8 + 0.5 + 0.7) / 6.0;
    assert!((r.mean_prob()[0] - p0).abs() < 1e-15);
    let aux = 0.1 * 2.0 * (5.0 / 6.0 * p0 + 1.0 / 6.0 * (1.0 - p0));
    assert!((r.aux_loss() - aux).abs() < 1e-15, "{} vs {aux}", r.aux_loss());
    // Without a capacity factor nothing is dropped.
    let r = router_only(2, 1, None, 0.1).route(&probs_tensor(&rows)).unwrap();
    assert_eq!((r.counts(), r.dropped(), r.capacity()), (vec![5, 1], 0, None));

    // Combine: a dropped token's row is x1's; the others get gate · out.
    let x1 = Tensor::arange(0f64, 12.0, &cpu()).unwrap().reshape((1, 6, 2)).unwrap();
    let r = gpt.route(&probs_tensor(&rows)).unwrap();
    let out0 = Tensor::ones((3, 2), DType::F64, &cpu()).unwrap();
    let out1 = Tensor::full(10f64, (1, 2), &cpu()).unwrap();
    let y = gpt.combine(&x1, &r, &[Some(out0), Some(out1)]).unwrap();
    let y = y.reshape((6, 2)).unwrap().to_vec2::<f64>().unwrap();
    let expect = [[0.9, 1.9], [2.6, 3.6], [11.0, 12.0], [6.8, 7.8], [8.0, 9.0], [10.0, 11.0]];
    for (a, b) in y.iter().zip(expect) {
        assert!((a[0] - b[0]).abs() < 1e-12 && (a[1] - b[1]).abs() < 1e-12, "{y:?}");
    }
    // A missing output of an active expert is an error naming the argument.
    assert!(matches!(gpt.combine(&x1, &r, &[None, None]), Err(Error::Input { what: "expert_outputs", .. })));
}

/// Top-2 (GShard): gates renormalized over the chosen pair; capacity drops per slot in token
/// order; a token with one slot dropped keeps its other slot's gate.
#[test]
fn routing_top2_gates_and_capacity() {
    // E = 3, N = 4, k = 2, cf = 0.75: capacity ceil(0.75 · 8 / 3) = 2.
    let gpt = router_only(3, 2, Some(0.75), 0.01);
    let rows: [&[f64]; 4] = [&[0.5, 0.3, 0.2], &[0.1, 0.6, 0.3], &[0.45, 0.1, 0.45], &[0.4, 0.35, 0.25]];
    let r = gpt.route(&probs_tensor(&rows)).unwrap();
    assert_eq!(r.choices(), [0, 1, 1, 2, 0, 2, 0, 1]);
    assert_eq!(r.capacity(), Some(2));
    assert_eq!(r.demand(), [3, 3, 2]);
    assert_eq!(r.tokens(0), [0, 2]); // token 3 dropped for expert 0
    assert_eq!(r.tokens(1), [0, 1]); // token 3 dropped for expert 1
    assert_eq!(r.tokens(2), [1, 2]);
    assert_eq!(r.dropped(), 2);
    let g = |a: f64, b: f64| a / (a + b);
    let close = |got: Vec<f64>, want: [f64; 2]| {
        assert!(got.iter().zip(want).all(|(x, y)| (x - y).abs() < 1e-15), "{got:?} vs {want:?}")
    };
    close(gates_of(&r, 0), [g(0.5, 0.3), g(0.45, 0.45)]);
    close(gates_of(&r, 1), [g(0.3, 0.5), g(0.6, 0.3)]);
    close(gates_of(&r, 2), [g(0.3, 0.6), g(0.45, 0.45)]);
    assert_eq!(r.top1_fraction(), [0.75, 0.25, 0.0]);
}

// ---- finite differences ------------------------------------------------------------------------

/// A test case for the finite-difference check: the first seed from `first_seed` on whose
/// random parameters ([`moe_random_params`]) and tokens (`B = 2`, `T = 5`) route tokens to every
/// expert of every block (so every expert's gradient is exercised), drop tokens when the config
/// has a capacity factor, and keep every router probability gap that decides a top-k choice at
/// least 1e-3 (so an FD step of 1e-5 is far from a tie). Returns `(seed, tokens, targets,
/// params)`.
fn fd_case(gpt: &Gpt, first_seed: u64) -> (u64, Tensor, Tensor, Vec<Vec<f64>>) {
    let cfg = gpt.config();
    let has_capacity = cfg.moe.as_ref().unwrap().capacity_factor.is_some();
    for seed in first_seed..first_seed + 1000 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tokens = ids(2, 5, cfg.vocab_size, &mut rng);
        let targets = ids(2, 5, cfg.vocab_size, &mut rng);
        let flats = moe_random_params(cfg, &mut rng);
        let params = to_tensors(&flats, DType::F64);
        let mut x = gpt.forward(0, &params[0], &tokens, None).unwrap();
        let (mut ok, mut dropped) = (true, 0);
        for i in 0..cfg.n_layer {
            let (y, tr, _) = moe_block_forward(gpt, i, &params, &x).unwrap();
            ok &= tr.routing.counts().iter().all(|&c| c > 0) && min_gap(&tr) >= 1e-3;
            dropped += tr.routing.dropped();
            x = y;
        }
        if ok && (dropped > 0) == has_capacity {
            return (seed, tokens, targets, flats);
        }
    }
    panic!("no seed in {first_seed}..+1000 routes to every expert");
}

/// The smallest gap between router probabilities that decides a top-k choice (first vs second,
/// k-th vs (k+1)-th) over the tokens of one block call.
fn min_gap(tr: &TrunkOut) -> f64 {
    let k = tr.routing.top_k();
    let mut gap = f64::INFINITY;
    for mut row in tr.probs.to_vec2::<f64>().unwrap() {
        row.sort_by(|a, b| b.total_cmp(a));
        gap = gap.min(row[k - 1] - row[k]).min(row[0] - row[1]);
    }
    gap
}

/// The objective `CE + Σ aux` recomputed from block `start` (input `x`) on, or from the tokens
/// when `start` is `None` (embedding perturbed), and the top-k choices of every block it ran.
fn objective_from(
    gpt: &Gpt,
    params: &[Tensor],
    start: Option<usize>,
    x: &Tensor,
    targets: &Tensor,
) -> (f64, Vec<Vec<u32>>) {
    let cfg = gpt.config();
    let mut x = match start {
        None => gpt.forward(0, &params[0], x, None).unwrap(),
        Some(_) => x.clone(),
    };
    let (mut aux, mut choices) = (0.0, Vec::new());
    for i in start.unwrap_or(0)..cfg.n_layer {
        let (y, tr, _) = moe_block_forward(gpt, i, params, &x).unwrap();
        aux += tr.routing.aux_loss();
        choices.push(tr.routing.choices().to_vec());
        x = y;
    }
    let ce = gpt.head_loss(&params[cfg.head_unit()], &x, cfg.tied_head.then(|| &params[0]), targets).unwrap();
    (ce + aux, choices)
}

/// Every element of every unit (embedding, trunks incl. the router, every expert, head) against
/// central finite differences of `CE + Σ aux` in F64 (step and tolerances of the dense check,
/// [`FD_STEP`], `|autograd − fd| ≤ FD_ATOL + FD_RTOL |fd|`).
///
/// Top-k selection is piecewise constant: a difference across a flip of a choice would measure a
/// jump, not a derivative. Two guards: the case ([`fd_case`]) has every deciding probability
/// gap ≥ 1e-3, far above what a step of 1e-5 moves; and each evaluation at `±h` also returns
/// the top-k choices of every block it recomputed, which the check asserts equal the
/// unperturbed ones. Equal choices also mean equal capacity drops and an equal `f_e` (the aux
/// loss' constant), so the difference quotient is the derivative the backward computes. The
/// case also routes tokens to every expert of both blocks and, with a capacity factor, drops
/// some.
fn check_moe_finite_differences(cfg: GptConfig, first_seed: u64) {
    let gpt = Gpt::new(cfg.clone()).unwrap();
    let (seed, tokens, targets, mut flats) = fd_case(&gpt, first_seed);
    let params = to_tensors(&flats, DType::F64);
    let (parts, grads) = crate::lm::loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
    let ref_parts = crate::lm::loss_parts(&gpt, &params, &tokens, &targets).unwrap();
    assert_eq!(parts, ref_parts);
    assert!(parts.aux > 0.0);

    // Block inputs and routings at the unperturbed parameters.
    let mut block_in = Vec::new();
    let mut x = gpt.forward(0, &params[0], &tokens, None).unwrap();
    let mut base_choices = Vec::new();
    let mut min_prob_gap = f64::INFINITY;
    let mut dropped = 0;
    let mut counts = Vec::new();
    for i in 0..cfg.n_layer {
        block_in.push(x.clone());
        let (y, tr, _) = moe_block_forward(&gpt, i, &params, &x).unwrap();
        base_choices.push(tr.routing.choices().to_vec());
        dropped += tr.routing.dropped();
        counts.push(tr.routing.counts());
        min_prob_gap = min_prob_gap.min(min_gap(&tr));
        x = y;
    }
    let head_in = x;
    let moe = cfg.moe.clone().unwrap();
    assert!(counts.iter().flatten().all(|&c| c > 0), "every expert must receive tokens in this check: {counts:?}");
    if moe.capacity_factor.is_some() {
        assert!(dropped > 0, "the capacity factor must drop tokens in this check");
    } else {
        assert_eq!(dropped, 0);
    }

    let (mut worst_abs, mut worst_rel, mut checked) = (0f64, 0f64, 0usize);
    for (u, spec) in gpt.units().iter().enumerate() {
        let ad = to_vec(&grads[u]);
        assert_eq!(ad.len(), spec.numel);
        let (start, input): (Option<usize>, &Tensor) = match spec.kind {
            UnitKind::Embedding => (None, &tokens),
            UnitKind::MoeTrunk(i) | UnitKind::Expert { block: i, .. } => (Some(i), &block_in[i]),
            UnitKind::Head if cfg.tied_head => (None, &tokens),
            UnitKind::Head => (Some(cfg.n_layer), &head_in),
            UnitKind::Block(_) => unreachable!("MoE model"),
        };
        let want_choices = &base_choices[start.unwrap_or(0)..];
        for i in 0..spec.numel {
            let orig = flats[u][i];
            let mut eval = |v: f64| {
                flats[u][i] = v;
                let mut ps = params.clone();
                ps[u] = Tensor::from_slice(&flats[u], spec.numel, &cpu()).unwrap();
                let (l, choices) = objective_from(&gpt, &ps, start, input, &targets);
                assert_eq!(
                    choices, want_choices,
                    "unit {} element {i}: the FD step flipped a top-k choice; pick another seed",
                    spec.name
                );
                l
            };
            let fd = (eval(orig + FD_STEP) - eval(orig - FD_STEP)) / (2.0 * FD_STEP);
            flats[u][i] = orig;
            let err = (ad[i] - fd).abs();
            let name = spec.params.iter().find(|p| p.offset <= i && i < p.offset + p.numel()).unwrap().name.as_str();
            assert!(
                err <= FD_ATOL + FD_RTOL * fd.abs(),
                "{moe:?} unit {} {name} element {i}: autograd {} vs finite difference {fd} (err {err:e})",
                spec.name,
                ad[i]
            );
            worst_abs = worst_abs.max(err);
            if fd.abs() > 1e-6 {
                worst_rel = worst_rel.max(err / fd.abs());
            }
            checked += 1;
        }
    }
    assert_eq!(checked, cfg.num_params());
    eprintln!(
        "moe fd check top_k={} cf={:?} tied={} (seed {seed}): {checked} elements, ce {:.4} aux {:.4}, {dropped} slots dropped, \
         tokens per expert {counts:?}, min prob gap {min_prob_gap:.2e}, max abs err {worst_abs:.2e}, max rel err (|g| > 1e-6) {worst_rel:.2e}",
        moe.top_k, moe.capacity_factor, cfg.tied_head, parts.ce, parts.aux
    );
}

#[test]
fn moe_gradients_match_finite_differences_top1() {
    check_moe_finite_differences(moe_tiny(1, None, false), 31);
}

#[test]
fn moe_gradients_match_finite_differences_top2() {
    check_moe_finite_differences(moe_tiny(2, None, false), 32);
}

#[test]
fn moe_gradients_match_finite_differences_top1_capacity_drops() {
    check_moe_finite_differences(moe_tiny(1, Some(0.75), false), 33);
}

#[test]
fn moe_gradients_match_finite_differences_top2_capacity_drops_tied() {
    check_moe_finite_differences(moe_tiny(2, Some(0.75), true), 34);
}

/// The auxiliary loss' own gradient: `grads(coef) − grads(coef = 0)` is `∇aux` (the objective is
/// linear in the coefficient); it matches finite differences of [`LossParts::aux`] on every
/// parameter it depends on (all units before the last block's experts) and is zero on the last
/// block's experts and the head. (Routing stability as in the full check: same seeds' margins.)
#[test]
fn moe_aux_loss_gradient_matches_finite_differences() {
    let cfg = moe_tiny(2, Some(0.75), false);
    let off = GptConfig { moe: cfg.moe.clone().map(|m| MoeConfig { aux_loss_coef: 0.0, ..m }), ..cfg.clone() };
    let (gpt, gpt0) = (Gpt::new(cfg.clone()).unwrap(), Gpt::new(off).unwrap());
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let tokens = ids(2, 5, 256, &mut rng);
    let targets = ids(2, 5, 256, &mut rng);
    let mut flats = moe_random_params(&cfg, &mut rng);
    let params = to_tensors(&flats, DType::F64);
    let (p1, g1) = crate::lm::loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
    let (p0, g0) = crate::lm::loss_parts_and_grads(&gpt0, &params, &tokens, &targets).unwrap();
    assert_eq!((p0.ce, p0.aux), (p1.ce, 0.0));
    let (_, base) = crate::lm::forward_hidden(&gpt, &params, &tokens).unwrap();
    let base_choices: Vec<&[u32]> = base.iter().map(|r| r.choices()).collect();
    let mut worst = 0f64;
    for (u, spec) in gpt.units().iter().enumerate() {
        let aux_grad: Vec<f64> = to_vec(&g1[u]).iter().zip(to_vec(&g0[u])).map(|(a, b)| a - b).collect();
        let last = cfg.n_layer - 1;
        let independent = match spec.kind {
            UnitKind::Head => true,
            UnitKind::Expert { block, .. } => block == last,
            _ => false,
        };
        if independent {
            assert!(aux_grad.iter().all(|g| *g == 0.0), "{}", spec.name);
            continue;
        }
        for i in 0..spec.numel {
            let orig = flats[u][i];
            let mut eval = |v: f64| {
                flats[u][i] = v;
                let mut ps = params.clone();
                ps[u] = Tensor::from_slice(&flats[u], spec.numel, &cpu()).unwrap();
                let (_, routings) = crate::lm::forward_hidden(&gpt, &ps, &tokens).unwrap();
                let choices: Vec<&[u32]> = routings.iter().map(|r| r.choices()).collect();
                assert_eq!(choices, base_choices, "{} element {i}: the FD step flipped a top-k choice", spec.name);
                routings.iter().map(Routing::aux_loss).sum::<f64>()
            };
            let fd = (eval(orig + FD_STEP) - eval(orig - FD_STEP)) / (2.0 * FD_STEP);
            flats[u][i] = orig;
            let err = (aux_grad[i] - fd).abs();
            assert!(err <= FD_ATOL + FD_RTOL * fd.abs(), "{} element {i}: {} vs {fd}", spec.name, aux_grad[i]);
            worst = worst.max(err);
        }
    }
    eprintln!("aux gradient: max abs err {worst:.2e}");
}

// ---- unit-wise == whole graph ------------------------------------------------------------------

/// The whole MoE model as one candle graph: every unit's flat vector one `Var`, every activation
/// kept, the gates and the aux loss differentiable functions of the router probabilities (the
/// top-k choices from the same forward), one `backward`.
fn whole_graph(gpt: &Gpt, params: &[Tensor], tokens: &Tensor, targets: &Tensor) -> (LossParts, Vec<Tensor>) {
    let cfg = gpt.config();
    let moe = cfg.moe.clone().unwrap();
    let units = gpt.units();
    let vars: Vec<Var> = params.iter().map(|p| Var::from_tensor(p).unwrap()).collect();
    let pv: Vec<Vec<Tensor>> = units.iter().zip(&vars).map(|(u, v)| views(u, v.as_tensor()).unwrap()).collect();
    let mut x = gpt.embed_math(&pv[0], tokens).unwrap();
    let mut aux_terms = Vec::new();
    for i in 0..cfg.n_layer {
        let (x1, h, _, probs) = gpt.trunk_math(&pv[cfg.block_unit(i)], &x).unwrap();
        let routing = gpt.route(&probs.detach()).unwrap();
        let gate_all = gate_values(&probs, routing.choices_tensor(), moe.top_k).unwrap();
        let (mut gates, mut outs) = (Vec::new(), Vec::new());
        for e in 0..moe.experts {
            gates.push(routing.slots(e).map(|s| gate_all.index_select(s, 0).unwrap()));
            if let Some(index) = routing.index(e) {
                let h_e = h.index_select(index, 0).unwrap();
                outs.push(gpt.expert_math(&pv[cfg.expert_unit(i, e)], &h_e).unwrap());
            }
        }
        x = combine_math(&x1, &routing, &gates, &outs).unwrap();
        aux_terms.push(aux_value(&probs, routing.top1_fraction_tensor(), moe.aux_loss_coef).unwrap());
    }
    let n = units.len();
    let w_out = if cfg.tied_head { pv[0][0].t().unwrap() } else { pv[n - 1][2].clone() };
    let logits = gpt.head_math(&pv[n - 1], &w_out, &x).unwrap();
    let ce = cross_entropy_composed(&logits, targets).unwrap();
    let mut obj = ce.clone();
    let mut aux = 0.0;
    for a in &aux_terms {
        obj = (obj + a).unwrap();
        aux += to_vec(&a.reshape(1).unwrap())[0];
    }
    let g = obj.backward().unwrap();
    // An expert without tokens is not in the graph: zero gradient.
    let grads = vars
        .iter()
        .map(|v| g.get(v.as_tensor()).cloned().unwrap_or_else(|| v.as_tensor().zeros_like().unwrap()))
        .collect();
    (LossParts { ce: to_vec(&ce.reshape(1).unwrap())[0], aux }, grads)
}

/// The unit calls (as a trainer runs them) and one whole-model graph compute the same loss
/// bitwise (the same forward ops) and the same gradients up to the order in which candle adds
/// the contributions to a shared gradient (`h` gets the experts' and the router's; the tied `wte`
/// the embedding's and the head's): at most 16 ulp of the unit's largest gradient element.
#[test]
fn moe_unitwise_equals_whole_graph() {
    for (top_k, cf, tied, dtype, eps) in [
        (1, None, false, DType::F64, f64::EPSILON),
        (2, Some(0.75), true, DType::F64, f64::EPSILON),
        (2, None, false, DType::F32, f32::EPSILON as f64),
        (1, Some(1.0), true, DType::F32, f32::EPSILON as f64),
    ] {
        let cfg = GptConfig {
            d_model: 16,
            n_head: 4,
            n_layer: 3,
            max_seq_len: 12,
            tied_head: tied,
            moe: Some(MoeConfig { experts: 4, top_k, aux_loss_coef: 0.1, capacity_factor: cf, d_expert: Some(24) }),
            ..GptConfig::default()
        };
        let gpt = Gpt::new(cfg.clone()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let tokens = ids(3, 10, 256, &mut rng);
        let targets = ids(3, 10, 256, &mut rng);
        let params = to_tensors(&moe_random_params(&cfg, &mut rng), dtype);
        let (parts, grads) = crate::lm::loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
        let (ref_parts, ref_grads) = whole_graph(&gpt, &params, &tokens, &targets);
        assert_eq!(parts, ref_parts, "top_k={top_k} cf={cf:?} {dtype:?}");
        let mut worst = 0f64;
        for (u, (g, r)) in grads.iter().zip(&ref_grads).enumerate() {
            assert_eq!(g.dtype(), dtype);
            assert_eq!(g.dims(), r.dims());
            let scale = to_vec(r).iter().fold(0f64, |m, x| m.max(x.abs()));
            let diff = max_abs_diff(g, r);
            assert!(
                diff <= 16.0 * eps * scale,
                "top_k={top_k} cf={cf:?} {dtype:?} unit {}: max |diff| {diff:e}, max |grad| {scale:e}",
                gpt.units()[u].name
            );
            if scale > 0.0 {
                worst = worst.max(diff / (eps * scale));
            }
        }
        eprintln!("unit-wise vs whole graph top_k={top_k} cf={cf:?} {dtype:?}: max diff {worst:.1} ulp of max |grad|");
    }
}

/// The op-composition path (what non-CPU devices run) computes the same MoE loss and gradients
/// as the fused CPU kernels, up to rounding (the routing is the same: the case's probability
/// gaps are far above the rounding differences).
#[test]
fn moe_fused_kernels_match_composed_ops() {
    for (dtype, rtol) in [(DType::F64, 1e-12), (DType::F32, 1e-4)] {
        let cfg = moe_tiny(2, Some(0.75), false);
        let fused = Gpt::new(cfg.clone()).unwrap();
        let composed = Gpt::new(cfg.clone()).unwrap().composed_only();
        let (_, tokens, targets, flats) = fd_case(&fused, 34);
        let params = to_tensors(&flats, dtype);
        let (l1, g1) = crate::lm::loss_parts_and_grads(&fused, &params, &tokens, &targets).unwrap();
        let (l2, g2) = crate::lm::loss_parts_and_grads(&composed, &params, &tokens, &targets).unwrap();
        assert!((l1.ce - l2.ce).abs() <= rtol * l2.ce && (l1.aux - l2.aux).abs() <= rtol * l2.aux, "{l1:?} vs {l2:?}");
        for (u, (a, b)) in g1.iter().zip(&g2).enumerate() {
            let scale = to_vec(b).iter().fold(0f64, |m, x| m.max(x.abs()));
            let diff = max_abs_diff(a, b);
            assert!(diff <= rtol * scale, "{dtype:?} unit {u}: {diff:e} vs scale {scale:e}");
        }
    }
}

// ---- behaviour ---------------------------------------------------------------------------------

/// An expert no token chooses is never called and has a zero gradient: its parameters are NaN
/// (any call would make the loss or some gradient NaN), the router bias pushes its probability
/// to 0.
#[test]
fn expert_without_tokens_is_never_called_and_has_zero_gradient() {
    for top_k in [1, 2] {
        let cfg = moe_tiny(top_k, None, false);
        let gpt = Gpt::new(cfg.clone()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(51);
        let tokens = ids(2, 5, 256, &mut rng);
        let targets = ids(2, 5, 256, &mut rng);
        let mut flats = random_params(&cfg, 0.3, &mut rng);
        let units = cfg.units();
        for i in 0..cfg.n_layer {
            let trunk = &units[cfg.block_unit(i)];
            let rb = trunk.param(&format!("blocks.{i}.router.bias")).unwrap();
            flats[trunk.index][rb.offset + 3] = -1e3;
            flats[cfg.expert_unit(i, 3)].fill(f64::NAN);
        }
        let params = to_tensors(&flats, DType::F64);
        let (parts, grads) = crate::lm::loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
        assert!(parts.ce.is_finite() && parts.aux.is_finite(), "{parts:?}");
        for (u, g) in grads.iter().enumerate() {
            let g = to_vec(g);
            if matches!(units[u].kind, UnitKind::Expert { expert: 3, .. }) {
                assert!(g.iter().all(|x| *x == 0.0), "{}", units[u].name);
            } else {
                assert!(g.iter().all(|x| x.is_finite()), "{}", units[u].name);
            }
        }
        let (_, routings) = crate::lm::forward_hidden(&gpt, &params, &tokens).unwrap();
        for r in &routings {
            assert!(!r.is_active(3) && r.index(3).is_none() && r.gates(3).is_none());
            assert_eq!(r.counts()[3], 0);
            assert_eq!(r.counts().iter().sum::<usize>(), 10 * top_k);
        }
    }
}

/// Same inputs, same bits: twice on one model, and on a second model instance.
#[test]
fn moe_is_deterministic() {
    let cfg = moe_tiny(2, Some(1.0), false);
    let params: Vec<Tensor> =
        init_params(&cfg.units(), 5).iter().map(|f| unit_tensor(f, DType::F32, &cpu()).unwrap()).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let tokens = ids(2, 6, 256, &mut rng);
    let targets = ids(2, 6, 256, &mut rng);
    let run = || {
        let gpt = Gpt::new(cfg.clone()).unwrap();
        let (p, g) = crate::lm::loss_parts_and_grads(&gpt, &params, &tokens, &targets).unwrap();
        (p, g.iter().map(|t| t.to_vec1::<f32>().unwrap()).collect::<Vec<_>>())
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    // At init the loss is near uniform and the router too: each block's aux loss is near
    // coef · E · Σ_e f_e / E = coef.
    assert!((a.0.ce - 256f64.ln()).abs() < 0.05, "{:?}", a.0);
    assert!((a.0.aux / (0.5 * cfg.n_layer as f64) - 1.0).abs() < 0.05, "{:?}", a.0);
    let gpt = Gpt::new(cfg.clone()).unwrap();
    assert_eq!(crate::lm::loss(&gpt, &params, &tokens, &targets).unwrap(), a.0.total());
    assert_eq!(crate::lm::forward_all(&gpt, &params, &tokens).unwrap().dims(), [2, 6, 256]);
}

/// The expert calls are pure row-wise functions: a subset of rows gives the same rows, the
/// backward's recomputed output equals the forward's, an empty input is not computed.
#[test]
fn expert_calls_are_pure_and_row_wise() {
    let cfg = moe_tiny(2, None, false);
    let gpt = Gpt::new(cfg.clone()).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(61);
    let params = to_tensors(&random_params(&cfg, 0.3, &mut rng), DType::F64);
    let p = &params[cfg.expert_unit(1, 2)];
    let h = Tensor::randn(0f64, 1.0, (7, 8), &cpu()).unwrap();
    let out = gpt.expert_forward(p, &h).unwrap();
    let part = gpt.expert_forward(p, &h.narrow(0, 2, 3).unwrap()).unwrap();
    assert!(max_abs_diff(&part, &out.narrow(0, 2, 3).unwrap()) < 1e-15);
    let g = Tensor::randn(0f64, 1.0, (7, 8), &cpu()).unwrap();
    let eg = gpt.expert_backward(p, &h, &g).unwrap();
    assert_eq!(max_abs_diff(&eg.output, &out), 0.0);
    assert_eq!(eg.grad_input.dims(), [7, 8]);
    let empty = Tensor::zeros((0, 8), DType::F64, &cpu()).unwrap();
    assert_eq!(gpt.expert_forward(p, &empty).unwrap().dims(), [0, 8]);
    let eg = gpt.expert_backward(p, &empty, &empty).unwrap();
    assert!(to_vec(&eg.grad_params).iter().all(|x| *x == 0.0));
}

#[test]
fn moe_bad_inputs_are_errors_naming_the_argument() {
    let cfg = moe_tiny(2, None, false);
    let gpt = Gpt::new(cfg.clone()).unwrap();
    let params: Vec<Tensor> =
        init_params(&cfg.units(), 1).iter().map(|f| unit_tensor(f, DType::F32, &cpu()).unwrap()).collect();
    let what = |r: std::result::Result<(), Error>| match r {
        Err(Error::Input { what, .. }) => what,
        other => panic!("expected an input error, got {other:?}"),
    };
    let x = Tensor::zeros((1, 3, 8), DType::F32, &cpu()).unwrap();
    let trunk = cfg.block_unit(0);
    // The dense entry points refuse MoE units.
    assert_eq!(what(gpt.forward(trunk, &params[trunk], &x, None).map(drop)), "unit kind");
    assert_eq!(what(gpt.forward(trunk + 1, &params[trunk + 1], &x, None).map(drop)), "unit kind");
    // Wrong block, params, input.
    assert_eq!(what(gpt.trunk_forward(2, &params[trunk], &x).map(drop)), "block index");
    assert_eq!(what(gpt.trunk_forward(0, &params[trunk + 1], &x).map(drop)), "unit parameters shape");
    let h = Tensor::zeros((3, 7), DType::F32, &cpu()).unwrap();
    assert_eq!(what(gpt.expert_forward(&params[trunk + 1], &h).map(drop)), "expert input");
    // Routing-shaped arguments.
    let tr = gpt.trunk_forward(0, &params[trunk], &x).unwrap();
    assert_eq!(what(tr.routing.scatter_input_grads(&[None]).map(drop)), "grad_inputs");
    let grad_h = Tensor::zeros((3, 8), DType::F32, &cpu()).unwrap();
    let none = vec![None; 4];
    let wrong_y = Tensor::zeros((1, 4, 8), DType::F32, &cpu()).unwrap();
    assert_eq!(
        what(gpt.trunk_backward(0, &params[trunk], &x, &tr.routing, &wrong_y, &grad_h, &none).map(drop)),
        "grad_y"
    );
    let active = (0..4).find(|&e| tr.routing.is_active(e)).unwrap();
    let r = gpt.trunk_backward(0, &params[trunk], &x, &tr.routing, &x, &grad_h, &none);
    assert_eq!(what(r.map(drop)), "grad_gates", "expert {active} is active, its gate gradient is missing");
    // The expert API on a dense model.
    let dense = Gpt::new(GptConfig { moe: None, ..cfg }).unwrap();
    assert_eq!(what(dense.expert_forward(&params[trunk + 1], &grad_h).map(drop)), "model");
}

// ---- half precision --------------------------------------------------------------------------

/// With BF16 parameters the router's softmax, gates and load-balancing loss are computed in F32
/// from the BF16 logits: the probabilities (F32) within 1e-6 of an f64 softmax of the same
/// logits (a BF16 softmax is ~1e-3 off), each gate (BF16) within one BF16 spacing of the f64
/// gate, the block's load-balancing loss within 1e-6 relative.
#[test]
fn bf16_router_softmax_gates_and_aux_are_in_f32() {
    for top_k in [1, 2] {
        let cfg = moe_tiny(top_k, None, false);
        let gpt = Gpt::new(cfg.clone()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(45);
        let tokens = ids(2, 6, 256, &mut rng);
        let params = to_tensors(&moe_random_params(&cfg, &mut rng), DType::BF16);
        let x = gpt.forward(0, &params[0], &tokens, None).unwrap();
        let tr = gpt.trunk_forward(0, &params[cfg.block_unit(0)], &x).unwrap();
        assert_eq!((tr.logits.dtype(), tr.probs.dtype()), (DType::BF16, DType::F32));
        let (n, e) = tr.probs.dims2().unwrap();
        let (logits, probs) = (to_vec(&tr.logits), to_vec(&tr.probs));
        let mut want = vec![0f64; n * e];
        for (w, z) in want.chunks_exact_mut(e).zip(logits.chunks_exact(e)) {
            let m = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            let s: f64 = z.iter().map(|x| (x - m).exp()).sum();
            w.iter_mut().zip(z).for_each(|(w, x)| *w = (x - m).exp() / s);
        }
        let err = probs.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        assert!(err <= 1e-6, "top_k={top_k}: router probabilities off by {err:e}");

        let r = &tr.routing;
        let mut checked = 0;
        for ex in 0..e {
            let Some(gates) = r.gates(ex) else { continue };
            assert_eq!(gates.dtype(), DType::BF16);
            for (&tok, g) in r.tokens(ex).iter().zip(to_vec(gates)) {
                let tok = tok as usize;
                let chosen = &r.choices()[tok * top_k..tok * top_k + top_k];
                let norm: f64 = if top_k == 2 { chosen.iter().map(|&c| want[tok * e + c as usize]).sum() } else { 1.0 };
                let gate = want[tok * e + ex] / norm;
                assert!((g - gate).abs() <= BF16_SPACING * gate, "top_k={top_k}: gate {g} vs {gate}");
                checked += 1;
            }
        }
        assert_eq!(checked, n * top_k);
        let coef = cfg.moe.as_ref().unwrap().aux_loss_coef;
        let aux: f64 = (0..e)
            .map(|ex| r.top1_fraction()[ex] * (0..n).map(|t| want[t * e + ex]).sum::<f64>() / n as f64)
            .sum::<f64>()
            * coef
            * e as f64;
        assert!((r.aux_loss() - aux).abs() <= 1e-6 * aux, "top_k={top_k}: aux {} vs {aux}", r.aux_loss());
    }
}

/// The gate gradient `Σ_d grad_y ⊙ out_e` of BF16 rows accumulates in F32: with `d = 4096`
/// products ~1e-3 (sum ~4) it is within one rounding of the exact sum, where a BF16 sum stalls
/// far below.
#[test]
fn bf16_gate_gradient_accumulates_in_f32() {
    let d = 4096;
    let moe = MoeConfig { experts: 2, top_k: 1, aux_loss_coef: 0.0, capacity_factor: None, d_expert: Some(4) };
    let gpt =
        Gpt::new(GptConfig { d_model: d, n_head: 1, n_layer: 1, moe: Some(moe), ..GptConfig::default() }).unwrap();
    let rows: [&[f64]; 4] = [&[0.9, 0.1], &[0.8, 0.2], &[0.3, 0.7], &[0.6, 0.4]];
    let r = gpt.route_as(&probs_tensor(&rows).to_dtype(DType::F32).unwrap(), DType::BF16).unwrap();
    assert_eq!(r.tokens(0), [0, 1, 3]);
    let mut rng = ChaCha8Rng::seed_from_u64(46);
    let grad_y = bf16_uniform(&[1, 4, d], 0.02, 0.04, &mut rng);
    let out = bf16_uniform(&[3, d], 0.02, 0.04, &mut rng);
    let got = r.expert_grad_gate(0, &grad_y, &out).unwrap().unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    let (gy, o) = (to_vec(&grad_y), to_vec(&out));
    for (i, (&tok, g)) in r.tokens(0).iter().zip(to_vec(&got)).enumerate() {
        let exact: f64 = (0..d).map(|j| gy[tok as usize * d + j] * o[i * d + j]).sum();
        assert!((g - exact).abs() <= BF16_SPACING * exact, "row {i}: {g} vs exact {exact}");
        let naive =
            (grad_y.get(0).unwrap().get(tok as usize).unwrap() * out.get(i).unwrap()).unwrap().sum_all().unwrap();
        let naive = naive.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        assert!((naive - exact).abs() > 0.2 * exact, "a BF16 sum is off by little: the test would not tell");
    }
}

/// The whole MoE-GPT in BF16 follows the F32 computation on the same (BF16-rounded)
/// parameters: the same routing, the cross-entropy and load-balancing loss within 1e-2
/// relative, each parameter's gradient within 5e-2 (relative Frobenius; measured ≤ 2.6e-2, an
/// expert's bias with few tokens).
#[test]
fn moe_gpt_in_bf16_tracks_f32() {
    for (top_k, cf, tied) in [(1, Some(1.0), false), (2, None, true)] {
        let cfg = moe_tiny(top_k, cf, tied);
        let gpt = Gpt::new(cfg.clone()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(47);
        let tokens = ids(2, 6, 256, &mut rng);
        let targets = ids(2, 6, 256, &mut rng);
        let bf16 = to_tensors(&moe_random_params(&cfg, &mut rng), DType::BF16);
        let f32s: Vec<Tensor> = bf16.iter().map(|p| p.to_dtype(DType::F32).unwrap()).collect();
        let (_, r16) = crate::lm::forward_hidden(&gpt, &bf16, &tokens).unwrap();
        let (_, r32) = crate::lm::forward_hidden(&gpt, &f32s, &tokens).unwrap();
        for (a, b) in r16.iter().zip(&r32) {
            assert_eq!((a.choices(), a.counts()), (b.choices(), b.counts()), "top_k={top_k}: the same routing");
        }
        let (l16, g16) = crate::lm::loss_parts_and_grads(&gpt, &bf16, &tokens, &targets).unwrap();
        let (l32, g32) = crate::lm::loss_parts_and_grads(&gpt, &f32s, &tokens, &targets).unwrap();
        eprintln!("top_k={top_k}: bf16 {l16:?} vs f32 {l32:?}");
        assert!((l16.ce - l32.ce).abs() <= 1e-2 * l32.ce, "{l16:?} vs {l32:?}");
        assert!((l16.aux - l32.aux).abs() <= 1e-2 * l32.aux, "{l16:?} vs {l32:?}");
        let r32: Vec<Vec<f64>> = g32.iter().map(to_vec).collect();
        let reference = |u: usize, p: &ParamSpec| r32[u][p.offset..p.offset + p.numel()].to_vec();
        assert_grads_within(&format!("top_k={top_k}"), gpt.units(), &g16, reference, 5e-2, "");
    }
}
