//! Checks 3 and 4: the numerics of the composed path.
//!
//! **3, ops.** Every unit call of the composed op sequence (what a CUDA device runs: embedding,
//! RMSNorm/LayerNorm, RoPE, GQA attention with the causal softmax, SwiGLU/GELU MLPs, biases, the
//! tied and untied heads, the cross-entropy; Mixtral's router, top-2 routing, experts, combine
//! and load-balancing loss), forward (logits) and backward (the loss and every unit's gradient,
//! through `oogc_models::loss_and_grads`, which chains the unit calls as the trainer does),
//! against the same calls in f64 on the CPU. On CUDA: CUDA f32 and bf16, and the CPU's f32
//! beside them; on the sim device: the CPU's composed f32 and bf16, and the fused CPU kernels.
//! The models: the fixtures' `llama_gqa`, `qwen2_tied`, `mixtral_moe` and a tiny tied GPT.
//!
//! **4, fixtures.** The three fixtures through a [`Runtime`] on the device (GPU budget of the
//! minimum working set, experts fetched), composed path, f32 and bf16: logits, loss (Mixtral:
//! router logits, cross-entropy, load-balancing loss) and every gradient against transformers'
//! numbers; f32 within the fixtures' tolerances (logits and loss 1e-4 relative + 1e-5 absolute,
//! gradients 1e-3 + 1e-6), bf16 within [`BF16`]'s.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use oogc::models::hf::{HfCheckpoint, NamedTensor};
use oogc::models::llama::Llama;
use oogc::models::{CausalLm, Gpt, GptConfig, UnitKind};
use oogc::optimizer::OptimizerConfig;
use oogc::runtime::{DeviceSpec, Phase, Runtime, RuntimeConfig};
use serde_json::json;

use super::common::{
    cpu, diff, fixture_floats, fixture_id_vec, fixture_ids, fixture_tensors, host_f64, tolerance_share, verdict,
    within, Ctx, Diff, Figures, Rng, Verdict,
};

/// Limits of a candidate against the f64 oracle (check 3): logits' and gradients' relative L2
/// error, and the loss's relative error.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Limits {
    logits_rel_l2: f64,
    grads_rel_l2: f64,
    loss_rel: f64,
}

/// f32 against f64: another summation order (and cuBLAS's) over a few hundred terms.
const F32: Limits = Limits { logits_rel_l2: 1e-5, grads_rel_l2: 1e-4, loss_rel: 1e-5 };
/// bf16 (8 significant bits; norm statistics, softmax, RoPE and the loss in f32): about 3 × the
/// errors of the CPU's bf16 path (logits ~7e-3, gradients ~1e-2, loss ~4e-5 on these models).
const BF16: Limits = Limits { logits_rel_l2: 2e-2, grads_rel_l2: 5e-2, loss_rel: 5e-3 };

/// A model of check 3 with its f32 parameters and a batch.
struct Case {
    name: &'static str,
    /// The model with the composed path only, and (for the sim's comparison) with the fused CPU
    /// kernels where they apply.
    composed: Arc<dyn CausalLm>,
    fused: Arc<dyn CausalLm>,
    params: Vec<Vec<f32>>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    batch: (usize, usize),
}

fn fixture_case(ctx: &Ctx, name: &'static str) -> anyhow::Result<Case> {
    let dir = ctx.fixtures().join(name);
    let ckpt = HfCheckpoint::open(&dir)?;
    let config = ckpt.llama_config()?;
    let fused: Arc<dyn CausalLm> = Arc::new(Llama::new(config.clone())?);
    let composed: Arc<dyn CausalLm> = Arc::new(Llama::new(config)?.composed_only());
    ckpt.check_units(composed.units())?;
    let params = composed.units().iter().map(|u| ckpt.read_unit(u)).collect::<Result<Vec<_>, _>>()?;
    let reference = fixture_tensors(&dir.join("reference.safetensors"))?;
    let (tokens, batch) = fixture_id_vec(&reference, "input_ids")?;
    let (targets, _) = fixture_id_vec(&reference, "labels")?;
    Ok(Case { name, composed, fused, params, tokens, targets, batch })
}

fn gpt_case() -> anyhow::Result<Case> {
    let cfg = GptConfig {
        vocab_size: 256,
        d_model: 64,
        n_layer: 2,
        n_head: 4,
        max_seq_len: 32,
        tied_head: true,
        ..GptConfig::default()
    };
    let fused: Arc<dyn CausalLm> = Arc::new(Gpt::new(cfg.clone())?);
    let composed: Arc<dyn CausalLm> = Arc::new(Gpt::new(cfg)?.composed_only());
    let params = composed.units().iter().map(|u| oogc::models::init_unit_from_seed(u, 7)).collect();
    let mut rng = Rng::new(3);
    let (b, t) = (2, 32);
    let stream: Vec<u32> = (0..b * t + 1).map(|_| (rng.next_u64() % 256) as u32).collect();
    Ok(Case {
        name: "gpt_tied",
        composed,
        fused,
        params,
        tokens: stream[..b * t].to_vec(),
        targets: stream[1..].to_vec(),
        batch: (b, t),
    })
}

/// Logits, loss and every unit's gradient of one model on one device and dtype, on the host.
struct Computed {
    logits: Vec<f64>,
    loss: f64,
    grads: Vec<Vec<f64>>,
}

/// The logits `[B, T, V]` of `model` by its unit calls (an MoE block: trunk, each routed
/// expert, combine), as the trainer chains them.
fn forward_logits(model: &dyn CausalLm, params: &[Tensor], tokens: &Tensor) -> anyhow::Result<Tensor> {
    let units = model.units();
    let head = units.len() - 1;
    let mut x = model.forward(0, &params[0], tokens, None)?;
    let mut u = 1;
    while u < head {
        match (&units[u].kind, model.moe()) {
            (UnitKind::MoeTrunk(block), Some(moe)) => {
                // The trunk, each routed expert (the units after it), the combine.
                let t = moe.trunk_forward(*block, &params[u], &x)?;
                let experts: Vec<usize> =
                    (u + 1..head).take_while(|&k| matches!(units[k].kind, UnitKind::Expert { .. })).collect();
                let mut outs = vec![None; experts.len()];
                for (e, &k) in experts.iter().enumerate() {
                    if let Some(h_e) = t.routing.expert_input(e, &t.h)? {
                        outs[e] = Some(moe.expert_forward(&params[k], &h_e)?);
                    }
                }
                x = moe.combine(&t.x1, &t.routing, &outs)?;
                u += 1 + experts.len();
            }
            _ => {
                x = model.forward(u, &params[u], &x, None)?;
                u += 1;
            }
        }
    }
    let tied = model.tied_head().then(|| &params[0]);
    Ok(model.forward(head, &params[head], &x, tied)?)
}

fn compute(case: &Case, model: &dyn CausalLm, device: &Device, dtype: DType) -> anyhow::Result<Computed> {
    let params = case
        .params
        .iter()
        .map(|p| Ok(Tensor::from_slice(p, p.len(), device)?.to_dtype(dtype)?))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let tokens = Tensor::from_slice(&case.tokens, case.batch, device)?;
    let targets = Tensor::from_slice(&case.targets, case.batch, device)?;
    let logits = host_f64(&forward_logits(model, &params, &tokens)?)?;
    let (loss, grads) = oogc::models::loss_and_grads(model, &params, &tokens, &targets)?;
    let grads = grads.iter().map(host_f64).collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Computed { logits, loss, grads })
}

/// One candidate's errors against the oracle, by figure.
fn compare(case: &Case, got: &Computed, oracle: &Computed) -> (Diff, f64, (String, Diff)) {
    let logits = diff(&got.logits, &oracle.logits);
    let loss_rel = (got.loss - oracle.loss).abs() / oracle.loss.abs().max(1e-12);
    let mut worst = (String::new(), Diff { rel_l2: -1.0, max_rel: 0.0, max_abs: 0.0 });
    for (u, (g, o)) in got.grads.iter().zip(&oracle.grads).enumerate() {
        let d = diff(g, o);
        if d.rel_l2 > worst.1.rel_l2 || d.rel_l2.is_nan() {
            worst = (case.composed.units()[u].name.clone(), d);
        }
    }
    (logits, loss_rel, worst)
}

/// Check 3.
pub(crate) fn ops(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let device = ctx.compute_device()?;
    let cases = vec![
        fixture_case(ctx, "llama_gqa")?,
        fixture_case(ctx, "qwen2_tied")?,
        fixture_case(ctx, "mixtral_moe")?,
        gpt_case()?,
    ];
    // (label, device, dtype, composed, limits)
    let candidates: Vec<(String, Device, DType, bool, Limits)> = match ctx.cuda_ordinal() {
        Some(n) => vec![
            (format!("cuda:{n} f32"), device.clone(), DType::F32, true, F32),
            (format!("cuda:{n} bf16"), device.clone(), DType::BF16, true, BF16),
            ("cpu f32".into(), cpu(), DType::F32, true, F32),
        ],
        None => vec![
            ("cpu f32".into(), cpu(), DType::F32, true, F32),
            ("cpu f32 fused".into(), cpu(), DType::F32, false, F32),
            ("cpu bf16".into(), cpu(), DType::BF16, true, BF16),
        ],
    };
    f.set("limits", json!({"f32": F32, "bf16": BF16}));
    let mut failures = Vec::new();
    let mut worst_per_candidate: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for case in &cases {
        let oracle = compute(case, &*case.composed, &cpu(), DType::F64)?;
        f.set(&format!("{}.oracle_loss", case.name), oracle.loss);
        for (label, dev, dtype, composed, limits) in &candidates {
            let model = if *composed { &case.composed } else { &case.fused };
            let key = format!("{}.{}", case.name, label.replace(' ', "_"));
            let got = match compute(case, &**model, dev, *dtype) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{} on {label}: {}", case.name, crate::error_line(&e)));
                    f.set(&key, json!({"error": crate::error_line(&e)}));
                    continue;
                }
            };
            let (logits, loss_rel, (unit, grads)) = compare(case, &got, &oracle);
            f.set(&key, json!({"logits": logits, "loss_rel": loss_rel, "worst_grad_unit": unit, "worst_grad": grads}));
            let w = worst_per_candidate.entry(label.clone()).or_insert((0.0, 0.0));
            w.0 = w.0.max(logits.rel_l2);
            w.1 = w.1.max(grads.rel_l2);
            if !within(logits.rel_l2, limits.logits_rel_l2) {
                failures.push(format!(
                    "{} on {label}: logits rel L2 {:.2e} > {:.0e}",
                    case.name, logits.rel_l2, limits.logits_rel_l2
                ));
            }
            if !within(loss_rel, limits.loss_rel) {
                failures.push(format!("{} on {label}: loss rel {loss_rel:.2e} > {:.0e}", case.name, limits.loss_rel));
            }
            if !within(grads.rel_l2, limits.grads_rel_l2) {
                failures.push(format!(
                    "{} on {label}: gradient of {unit} rel L2 {:.2e} > {:.0e}",
                    case.name, grads.rel_l2, limits.grads_rel_l2
                ));
            }
        }
    }
    f.summary(
        worst_per_candidate
            .iter()
            .map(|(l, (lg, g))| format!("{l}: logits ≤ {lg:.1e}, grads ≤ {g:.1e}"))
            .collect::<Vec<_>>()
            .join("; ")
            + " (rel L2 vs f64, 4 models)",
    );
    Ok(verdict(failures))
}

/// bf16 limits against transformers' f32 numbers (check 4): relative L2 of the logits, of each
/// parameter's gradient, and the loss's relative error.
const FIXTURE_BF16: Limits = BF16;

/// The fixtures' f32 tolerances (README): logits and losses, gradients (relative, absolute).
const TOL_LOGITS: (f64, f64) = (1e-4, 1e-5);
const TOL_GRADS: (f64, f64) = (1e-3, 1e-6);

/// What one fixture run produced on the host.
struct FixtureOut {
    logits: Vec<f64>,
    /// Named scalars / vectors compared like logits: `loss`, and Mixtral's `loss_ce`,
    /// `aux_loss`, `router_logits`.
    extra: Vec<(String, Vec<f64>)>,
    /// Per unit, its flat gradient.
    grads: BTreeMap<usize, Vec<f64>>,
    h2d_bytes: u64,
}

fn runtime_for(ctx: &Ctx, model: &dyn CausalLm, dtype: oogc::swapper::DType, in_use: u64) -> anyhow::Result<Runtime> {
    let largest = model.units().iter().map(|u| dtype.num_bytes(u.numel) as u64).max().unwrap_or(0);
    let mut rc = RuntimeConfig::sim((in_use + 2) * largest);
    if let Some(ordinal) = ctx.cuda_ordinal() {
        rc.device = DeviceSpec::Cuda { ordinal, event_tracking: true };
    }
    rc.host_budget_bytes = 1 << 30;
    rc.optimizer = OptimizerConfig { threads: 1, clip_norm: None, compute_dtype: dtype, ..OptimizerConfig::default() };
    Ok(Runtime::new(rc, oogc::dist::Ranks::single())?)
}

/// One step of a dense fixture through the runtime.
fn dense_step(
    ctx: &Ctx,
    ckpt: &HfCheckpoint,
    model: &dyn CausalLm,
    reference: &BTreeMap<String, NamedTensor>,
    dtype: oogc::swapper::DType,
) -> anyhow::Result<FixtureOut> {
    let units = model.units().to_vec();
    let in_use = if model.tied_head() { 2 } else { 1 };
    let mut rt = runtime_for(ctx, model, dtype, in_use)?;
    // The runtime's id of each model unit, in the model's order.
    let mut ids = Vec::with_capacity(units.len());
    for u in &units {
        ids.push(rt.add_unit(&u.name, &ckpt.read_unit(u)?)?);
    }
    rt.set_max_units_in_use(in_use as usize);
    rt.begin_step(1, 1e-3)?;
    let dev = rt.compute_device().clone();
    let tokens = fixture_ids(reference, "input_ids", &dev)?;
    let targets = fixture_ids(reference, "labels", &dev)?;
    let head = units.len() - 1;
    let mut x = model.forward(0, rt.fetch(ids[0], Phase::Forward)?.tensor(), &tokens, None)?;
    let mut inputs = Vec::new();
    for (u, &id) in ids.iter().enumerate().take(head).skip(1) {
        let y = model.forward(u, rt.fetch(id, Phase::Forward)?.tensor(), &x, None)?;
        inputs.push(std::mem::replace(&mut x, y));
    }
    rt.end_forward();
    let emb = if model.tied_head() { Some(rt.fetch(ids[0], Phase::Backward)?) } else { None };
    let p = rt.fetch(ids[head], Phase::Backward)?;
    let logits = host_f64(&model.forward(head, p.tensor(), &x, emb.as_ref().map(|e| e.tensor()))?)?;
    let out = model.head_loss_backward(p.tensor(), &x, emb.as_ref().map(|e| e.tensor()), &targets)?;
    drop((p, emb));
    let mut grads = BTreeMap::new();
    grads.insert(head, host_f64(&out.grads.grad_params)?);
    rt.push_grads(ids[head], &out.grads.grad_params)?;
    let mut g = out.grads.grad_input.clone().ok_or_else(|| anyhow::anyhow!("the head gave no input gradient"))?;
    for u in (1..head).rev() {
        let p = rt.fetch(ids[u], Phase::Backward)?;
        let ug = model.backward(u, p.tensor(), &inputs[u - 1], &g, None)?;
        drop(p);
        grads.insert(u, host_f64(&ug.grad_params)?);
        rt.push_grads(ids[u], &ug.grad_params)?;
        g = ug.grad_input.ok_or_else(|| anyhow::anyhow!("unit {u} gave no input gradient"))?;
    }
    let p = rt.fetch(ids[0], Phase::Backward)?;
    let mut g0 = model.backward(0, p.tensor(), &tokens, &g, None)?.grad_params;
    drop(p);
    if let Some(extra) = out.grads.grad_tied_wte {
        g0 = (g0 + extra)?;
    }
    grads.insert(0, host_f64(&g0)?);
    rt.push_grads(ids[0], &g0)?;
    let stats = rt.finish_step()?;
    Ok(FixtureOut { logits, extra: vec![("loss".into(), vec![out.loss])], grads, h2d_bytes: stats.figures.h2d_bytes })
}

/// One step of the Mixtral fixture through the runtime, every routed expert fetched.
fn moe_step(
    ctx: &Ctx,
    ckpt: &HfCheckpoint,
    model: &Llama,
    reference: &BTreeMap<String, NamedTensor>,
    dtype: oogc::swapper::DType,
) -> anyhow::Result<FixtureOut> {
    let cfg = model.config().clone();
    let moe = model.moe().ok_or_else(|| anyhow::anyhow!("mixtral_moe is not an MoE model"))?;
    let units = model.units().to_vec();
    let (layers, experts) = (cfg.num_hidden_layers, cfg.num_experts());
    let mut rt = runtime_for(ctx, model, dtype, 2)?;
    // The runtime's id of each model unit, in the model's order.
    let mut ids = Vec::with_capacity(units.len());
    for u in &units {
        let id = rt.add_unit(&u.name, &ckpt.read_unit(u)?)?;
        if matches!(u.kind, UnitKind::Expert { .. }) {
            rt.set_unscheduled(id)?;
        }
        ids.push(id);
    }
    rt.set_max_units_in_use(2);
    rt.begin_step(1, 1e-3)?;
    let dev = rt.compute_device().clone();
    let tokens = fixture_ids(reference, "input_ids", &dev)?;
    let targets = fixture_ids(reference, "labels", &dev)?;
    let head = units.len() - 1;
    let mut x = model.forward(0, rt.fetch(ids[0], Phase::Forward)?.tensor(), &tokens, None)?;
    let (mut inputs, mut routings, mut router_logits) = (Vec::new(), Vec::new(), Vec::new());
    for b in 0..layers {
        let t = moe.trunk_forward(b, rt.fetch(ids[cfg.block_unit(b)], Phase::Forward)?.tensor(), &x)?;
        let mut outs = vec![None; experts];
        for (e, out) in outs.iter_mut().enumerate() {
            let Some(h_e) = t.routing.expert_input(e, &t.h)? else { continue };
            let p = rt.fetch(ids[cfg.expert_unit(b, e)], Phase::Forward)?;
            *out = Some(moe.expert_forward(p.tensor(), &h_e)?);
        }
        let y = moe.combine(&t.x1, &t.routing, &outs)?;
        router_logits.extend(host_f64(&t.logits)?);
        routings.push(t.routing);
        inputs.push(std::mem::replace(&mut x, y));
    }
    moe.finish_forward(&mut routings.iter_mut().collect::<Vec<_>>())?;
    let aux = moe.aux_loss(&routings.iter().collect::<Vec<_>>());
    rt.end_forward();
    let p = rt.fetch(ids[head], Phase::Backward)?;
    let logits = host_f64(&model.forward(head, p.tensor(), &x, None)?)?;
    let out = model.head_loss_backward(p.tensor(), &x, None, &targets)?;
    drop(p);
    let mut grads = BTreeMap::new();
    grads.insert(head, host_f64(&out.grads.grad_params)?);
    rt.push_grads(ids[head], &out.grads.grad_params)?;
    let mut g = out.grads.grad_input.clone().ok_or_else(|| anyhow::anyhow!("the head gave no input gradient"))?;
    for b in (0..layers).rev() {
        let trunk = cfg.block_unit(b);
        let pt = rt.fetch(ids[trunk], Phase::Backward)?;
        let routing = &routings[b];
        let t = moe.trunk_forward(b, pt.tensor(), &inputs[b])?;
        let (mut grad_inputs, mut grad_gates) = (vec![None; experts], vec![None; experts]);
        for e in 0..experts {
            let u = cfg.expert_unit(b, e);
            let Some(h_e) = routing.expert_input(e, &t.h)? else {
                grads.insert(u, vec![0.0; units[u].numel]);
                let zeros = Tensor::zeros(units[u].numel, pt.tensor().dtype(), &dev)?;
                rt.push_grads(ids[u], &zeros)?;
                continue;
            };
            let go = moe
                .expert_grad_output(routing, e, &g)?
                .ok_or_else(|| anyhow::anyhow!("expert {e} has tokens but no output gradient"))?;
            let pe = rt.fetch(ids[u], Phase::Backward)?;
            let eg = moe.expert_backward(pe.tensor(), &h_e, &go)?;
            drop(pe);
            grad_gates[e] = moe.expert_grad_gate(routing, e, &g, &eg.output)?;
            grad_inputs[e] = Some(eg.grad_input);
            grads.insert(u, host_f64(&eg.grad_params)?);
            rt.push_grads(ids[u], &eg.grad_params)?;
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs)?;
        let tg = moe.trunk_backward(b, pt.tensor(), &inputs[b], routing, &g, &grad_h, &grad_gates)?;
        drop(pt);
        grads.insert(trunk, host_f64(&tg.grad_params)?);
        rt.push_grads(ids[trunk], &tg.grad_params)?;
        g = tg.grad_input.ok_or_else(|| anyhow::anyhow!("trunk {b} gave no input gradient"))?;
    }
    let p = rt.fetch(ids[0], Phase::Backward)?;
    let g0 = model.backward(0, p.tensor(), &tokens, &g, None)?.grad_params;
    drop(p);
    grads.insert(0, host_f64(&g0)?);
    rt.push_grads(ids[0], &g0)?;
    let stats = rt.finish_step()?;
    let coef = cfg.aux_loss_weight();
    Ok(FixtureOut {
        logits,
        extra: vec![
            ("router_logits".into(), router_logits),
            ("loss_ce".into(), vec![out.loss]),
            ("aux_loss".into(), vec![aux / coef]),
            ("loss".into(), vec![out.loss + aux]),
        ],
        grads,
        h2d_bytes: stats.figures.h2d_bytes,
    })
}

/// Check 4.
pub(crate) fn fixtures(ctx: &Ctx, f: &mut Figures) -> anyhow::Result<Verdict> {
    let mut failures = Vec::new();
    let mut summary = Vec::new();
    for case in ["llama_gqa", "qwen2_tied", "mixtral_moe"] {
        let dir = ctx.fixtures().join(case);
        let reference = fixture_tensors(&dir.join("reference.safetensors"))?;
        let ckpt = HfCheckpoint::open(&dir)?;
        let model = Llama::new(ckpt.llama_config()?)?.composed_only();
        ckpt.check_units(model.units())?;
        for dtype in [oogc::swapper::DType::F32, oogc::swapper::DType::BF16] {
            let label = format!("{case}.{dtype}");
            let run = if model.moe().is_some() {
                moe_step(ctx, &ckpt, &model, &reference, dtype)
            } else {
                dense_step(ctx, &ckpt, &model, &reference, dtype)
            };
            let out = match run {
                Ok(o) => o,
                Err(e) => {
                    failures.push(format!("{label}: {}", crate::error_line(&e)));
                    f.set(&label, json!({"error": crate::error_line(&e)}));
                    continue;
                }
            };
            let f32_run = dtype == oogc::swapper::DType::F32;
            let mut figures = serde_json::Map::new();
            figures.insert("h2d_bytes".into(), json!(out.h2d_bytes));
            // Logits and the named extras.
            let mut named = vec![("logits".to_string(), out.logits)];
            named.extend(out.extra);
            for (name, got) in &named {
                let want = fixture_floats(&reference, name)?;
                if got.len() != want.len() {
                    failures.push(format!("{label} {name}: {} values, the fixture has {}", got.len(), want.len()));
                    continue;
                }
                let d = diff(got, &want);
                let share = tolerance_share(got, &want, TOL_LOGITS.0, TOL_LOGITS.1);
                figures.insert(name.clone(), json!({"diff": d, "tolerance_share": share}));
                let ok = if f32_run {
                    within(share, 1.0)
                } else if got.len() == 1 {
                    within(d.max_abs / want[0].abs().max(1e-12), FIXTURE_BF16.loss_rel)
                } else {
                    within(d.rel_l2, FIXTURE_BF16.logits_rel_l2)
                };
                if !ok {
                    failures.push(format!(
                        "{label} {name}: rel L2 {:.2e}, max |Δ| {:.2e} ({:.2} × the f32 tolerance)",
                        d.rel_l2, d.max_abs, share
                    ));
                }
            }
            // Every parameter's gradient.
            let (mut worst_share, mut worst_rel, mut worst_name, mut checked) = (0.0f64, 0.0f64, String::new(), 0);
            for (u, flat) in &out.grads {
                for p in &model.units()[*u].params {
                    let want = fixture_floats(&reference, &format!("grad.{}", p.name))?;
                    let got = &flat[p.offset..p.offset + p.numel()];
                    let share = tolerance_share(got, &want, TOL_GRADS.0, TOL_GRADS.1);
                    let d = diff(got, &want);
                    checked += 1;
                    let worse = if f32_run {
                        share > worst_share || share.is_nan()
                    } else {
                        d.rel_l2 > worst_rel || d.rel_l2.is_nan()
                    };
                    if worse {
                        worst_name = p.name.clone();
                    }
                    worst_share = if share.is_nan() { f64::NAN } else { worst_share.max(share) };
                    worst_rel = if d.rel_l2.is_nan() { f64::NAN } else { worst_rel.max(d.rel_l2) };
                }
            }
            let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
            if checked != expected {
                failures.push(format!("{label}: {checked} gradients compared, the fixture has {expected}"));
            }
            figures.insert(
                "grads".into(),
                json!({"compared": checked, "worst": worst_name, "worst_tolerance_share": worst_share, "worst_rel_l2": worst_rel}),
            );
            let ok = if f32_run { within(worst_share, 1.0) } else { within(worst_rel, FIXTURE_BF16.grads_rel_l2) };
            if !ok {
                failures.push(format!(
                    "{label} gradient of {worst_name}: {:.2} × the f32 tolerance, rel L2 {worst_rel:.2e}",
                    worst_share
                ));
            }
            summary.push(if f32_run {
                format!("{case} f32 {worst_share:.2}× tol")
            } else {
                format!("{case} bf16 grads rel L2 {worst_rel:.1e}")
            });
            f.set(&label, serde_json::Value::Object(figures));
        }
    }
    // The device optimizer's update (candle ops on the compute device) against torch's
    // AdamW/Adam vectors: the cases `scripts/build-cuda.sh` carries.
    let adamw = ctx.shared.join("fixtures/adamw");
    match oogc::runtime::adam_fixture_excess(&adamw, &ctx.compute_device()?, Some(&DEVICE_ADAM_CASES)) {
        Ok(excess) => {
            for (case, e) in &excess {
                f.set(&format!("device_adam.{case}.tolerance_share"), e);
                if !within(*e, 1.0) {
                    failures.push(format!("device_adam.{case}: {e:.2} × torch's tolerance"));
                }
            }
            let worst = excess.iter().map(|(_, e)| *e).fold(0.0, f64::max);
            summary.push(format!("device AdamW {worst:.2}× tol"));
        }
        Err(e) => failures.push(format!("device_adam: {e}")),
    }
    // The device optimizer's bf16 and int8 moment codecs (candle ops on the compute device)
    // against the CPU optimizer's.
    match oogc::runtime::moment_codec_excess(&ctx.compute_device()?) {
        Ok(excess) => {
            for (dtype, e) in &excess {
                f.set(&format!("device_moments.{dtype}.tolerance_share"), e);
                if !within(*e, 1.0) {
                    failures.push(format!("device_moments.{dtype}: {e:.2} × the codecs' tolerance"));
                }
            }
            let worst = excess.iter().map(|(_, e)| *e).fold(0.0, f64::max);
            summary.push(format!("device moments {worst:.2}× tol"));
        }
        Err(e) => failures.push(format!("device_moments: {e}")),
    }
    f.set("bf16_limits", FIXTURE_BF16);
    f.summary(summary.join(", "));
    Ok(verdict(failures))
}

/// The AdamW/Adam fixture cases check 4 runs the device optimizer's update on (the ones
/// `scripts/build-cuda.sh` carries: Adam with L2, a large ε, a tiny case without decay).
const DEVICE_ADAM_CASES: [&str; 3] = ["adam_l2", "adamw_bigeps", "adamw_nowd_tiny"];
