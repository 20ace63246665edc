//! Dense layers among sparse ones (Qwen3-MoE's and Qwen2-MoE's `mlp_only_layers` and
//! `decoder_sparse_step`) against transformers' numbers (`tests/fixtures/dense_among_sparse/`,
//! made by `scripts/make-dense-among-sparse-fixture.py`, README there): each checkpoint loaded
//! through the reader and computed **through the `Runtime`**, dense layers as dense units and
//! sparse layers as a trunk and its experts (placed resident, fetched and on the CPU, mixed):
//! logits, the sparse layers' router logits, cross-entropy, the load-balancing loss pooled over
//! the sparse layers only, and the loss within 1e-4 relative + 1e-5 absolute, every gradient
//! within 1e-3 relative + 1e-6 absolute (and the in-memory `oogc_models::loss_parts_and_grads`
//! alike), one AdamW step within 1e-5 relative + 1e-7 absolute. Then the trainer: `init =` the
//! checkpoint, two steps (the placer and the routing trace number the MoE blocks by sparse
//! layer), exported with `export --hf` bitwise the input.

use crate::common;
use crate::fixtures;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use oogc::models::hf::HfCheckpoint;
use oogc::models::llama::Llama;
use oogc::models::{CausalLm, UnitKind};
use oogc::optimizer::{AdamConfig, AdamKind, OptimizerConfig};
use oogc::runtime::{Phase, Runtime, RuntimeConfig, UnitId, UnitParams};
use oogc::swapper::{DType, NvmeConfig, StatePlacement};

use fixtures::{assert_close, by_param, floats, ids, tensors};

/// A case of `tests/fixtures/dense_among_sparse/`.
fn case(name: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures/dense_among_sparse").join(name)
}

/// Where an expert runs in the test's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Fetched in the forward and kept pinned until its backward.
    Resident,
    /// Fetched (H2D) in the forward and again in the backward.
    Fetch,
    /// Computed on the CPU from its host copy; gradients straight to the CPU optimizer.
    Cpu,
}

fn fetch(rt: &mut Runtime, unit: UnitId, place: Place, phase: Phase) -> UnitParams {
    match place {
        Place::Cpu => rt.fetch_host(unit).unwrap(),
        _ => rt.fetch(unit, phase).unwrap(),
    }
}

/// The mixed placement of expert `e` of layer `layer`.
fn mixed(layer: usize, e: usize) -> Place {
    [Place::Resident, Place::Fetch, Place::Cpu][(layer + e) % 3]
}

/// One training step of the case in `dir` through an offloaded `Runtime`, experts where
/// `place(layer, expert)` says, checked against the fixture.
fn through_the_runtime(dir: &Path, label: &str, place: impl Fn(usize, usize) -> Place) {
    let reference = tensors(&dir.join("reference.safetensors"));
    let step = tensors(&dir.join("step.safetensors"));
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let model = Llama::new(ckpt.llama_config().unwrap()).unwrap();
    let cfg = model.config().clone();
    let moe = model.moe().expect("an MoE model");
    ckpt.check_units(model.units()).unwrap();
    let units = model.units().to_vec();
    let (layers, experts) = (cfg.num_hidden_layers, cfg.num_experts());
    let sparse = cfg.sparse_layers();
    assert!(!sparse.is_empty() && sparse.len() < layers, "{label}: dense layers among sparse ones");
    let dense_units = units.iter().filter(|u| matches!(u.kind, UnitKind::Block(_))).count();
    assert_eq!(dense_units, layers - sparse.len(), "{label}: one dense unit per dense layer");
    let expert_bytes = units[cfg.expert_unit(sparse[0], 0)].numel as u64 * 4;
    let largest = units.iter().map(|u| u.numel as u64 * 4).max().unwrap();
    let resident = sparse
        .iter()
        .flat_map(|&l| (0..experts).map(move |e| (l, e)))
        .filter(|&(l, e)| place(l, e) == Place::Resident)
        .count() as u64;
    let total_bytes: u64 = units.iter().map(|u| u.numel as u64 * 4).sum();

    let nvme = tempfile::tempdir().unwrap();
    let mut rc = RuntimeConfig::sim(resident * expert_bytes + 3 * largest);
    // Offloaded (the GPU budget below the model's bytes) unless every expert stays resident.
    if resident < (sparse.len() * experts) as u64 {
        assert!(rc.gpu_budget_bytes < total_bytes, "{label}: the GPU budget must be below the model's bytes");
    }
    rc.state_placement = StatePlacement::Nvme;
    rc.nvme = Some(NvmeConfig::new(vec![nvme.path().to_path_buf()], 64 << 20));
    rc.optimizer = OptimizerConfig {
        threads: 1,
        adam: AdamConfig { kind: AdamKind::AdamW, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 },
        clip_norm: None,
        compute_dtype: DType::F32,
        ..OptimizerConfig::default()
    };
    let mut rt = Runtime::new(rc, oogc::dist::Ranks::single()).unwrap();
    let mut unit_ids = Vec::with_capacity(units.len());
    for u in &units {
        let id = rt.add_unit(&u.name, &ckpt.read_unit(u).unwrap()).unwrap();
        if matches!(u.kind, UnitKind::Expert { .. }) {
            rt.set_unscheduled(id).unwrap();
        }
        unit_ids.push(id);
    }
    rt.set_max_units_in_use(2);
    rt.begin_step(1, 1e-3).unwrap();

    let tokens = ids(&reference, "input_ids");
    let targets = ids(&reference, "labels");
    let head = units.len() - 1;
    let tied = cfg.tie_word_embeddings;
    let mut held: HashMap<usize, UnitParams> = HashMap::new();
    let mut x = model.forward(0, rt.fetch(unit_ids[0], Phase::Forward).unwrap().tensor(), &tokens, None).unwrap();
    let mut inputs = Vec::new();
    // The routing of each sparse layer, by layer.
    let mut routings: BTreeMap<usize, oogc::models::Routing> = BTreeMap::new();
    let mut router_logits = Vec::new();
    for l in 0..layers {
        let u = cfg.block_unit(l);
        let y = if cfg.is_sparse_layer(l) {
            assert_eq!(units[u].kind, UnitKind::MoeTrunk(l), "{label}: layer {l}'s trunk");
            let t = moe.trunk_forward(l, rt.fetch(unit_ids[u], Phase::Forward).unwrap().tensor(), &x).unwrap();
            let mut outs = vec![None; experts];
            for (e, out) in outs.iter_mut().enumerate() {
                let Some(h_e) = t.routing.expert_input(e, &t.h).unwrap() else { continue };
                let eu = cfg.expert_unit(l, e);
                assert_eq!(units[eu].kind, UnitKind::Expert { block: l, expert: e });
                let p = fetch(&mut rt, unit_ids[eu], place(l, e), Phase::Forward);
                *out = Some(moe.expert_forward(p.tensor(), &h_e).unwrap());
                if place(l, e) == Place::Resident {
                    held.insert(eu, p);
                }
            }
            let y = moe.combine(&t.x1, &t.routing, &outs).unwrap();
            router_logits.extend(t.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            routings.insert(l, t.routing);
            y
        } else {
            assert_eq!(units[u].kind, UnitKind::Block(l), "{label}: layer {l} is a dense unit");
            assert!(moe
                .trunk_forward(l, &Tensor::zeros(units[u].numel, candle_core::DType::F32, &Device::Cpu).unwrap(), &x)
                .is_err());
            model.forward(u, rt.fetch(unit_ids[u], Phase::Forward).unwrap().tensor(), &x, None).unwrap()
        };
        inputs.push(std::mem::replace(&mut x, y));
    }
    assert_close(&format!("{label} router_logits"), &router_logits, &floats(&reference, "router_logits"), 1e-4, 1e-5);
    moe.finish_forward(&mut routings.values_mut().collect::<Vec<_>>()).unwrap();
    let aux = moe.aux_loss(&routings.values().collect::<Vec<_>>());
    let coef = cfg.aux_loss_weight();
    assert_close(&format!("{label} aux_loss"), &[(aux / coef) as f32], &floats(&reference, "aux_loss"), 1e-4, 1e-5);

    let emb = tied.then(|| rt.fetch(unit_ids[0], Phase::Backward).unwrap());
    let emb_t = emb.as_ref().map(|e| e.tensor().clone());
    let p = rt.fetch(unit_ids[head], Phase::Backward).unwrap();
    let logits: Vec<f32> =
        model.forward(head, p.tensor(), &x, emb_t.as_ref()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_close(&format!("{label} logits"), &logits, &floats(&reference, "logits"), 1e-4, 1e-5);
    let out = model.head_loss_backward(p.tensor(), &x, emb_t.as_ref(), &targets).unwrap();
    drop((p, emb));
    assert_close(&format!("{label} loss_ce"), &[out.loss as f32], &floats(&reference, "loss_ce"), 1e-4, 1e-5);
    assert_close(&format!("{label} loss"), &[(out.loss + aux) as f32], &floats(&reference, "loss"), 1e-4, 1e-5);
    let mut grads: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    grads.insert(head, out.grads.grad_params.to_vec1().unwrap());
    let tied_grad = out.grads.grad_tied_wte;
    let mut g = out.grads.grad_input.unwrap();
    for l in (0..layers).rev() {
        let u = cfg.block_unit(l);
        let Some(routing) = routings.get(&l) else {
            let p = rt.fetch(unit_ids[u], Phase::Backward).unwrap();
            let ug = model.backward(u, p.tensor(), &inputs[l], &g, None).unwrap();
            grads.insert(u, ug.grad_params.to_vec1().unwrap());
            g = ug.grad_input.unwrap();
            continue;
        };
        let pt = rt.fetch(unit_ids[u], Phase::Backward).unwrap();
        let t = moe.trunk_forward(l, pt.tensor(), &inputs[l]).unwrap();
        let (mut grad_inputs, mut grad_gates) = (vec![None; experts], vec![None; experts]);
        for e in 0..experts {
            let eu = cfg.expert_unit(l, e);
            let Some(h_e) = routing.expert_input(e, &t.h).unwrap() else {
                grads.insert(eu, vec![0.0; units[eu].numel]);
                continue;
            };
            let go = moe.expert_grad_output(routing, e, &g).unwrap().unwrap();
            let pe = held.remove(&eu).unwrap_or_else(|| fetch(&mut rt, unit_ids[eu], place(l, e), Phase::Backward));
            let eg = moe.expert_backward(pe.tensor(), &h_e, &go).unwrap();
            drop(pe);
            grad_gates[e] = moe.expert_grad_gate(routing, e, &g, &eg.output).unwrap();
            grad_inputs[e] = Some(eg.grad_input);
            grads.insert(eu, eg.grad_params.to_vec1().unwrap());
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs).unwrap();
        let tg = moe.trunk_backward(l, pt.tensor(), &inputs[l], routing, &g, &grad_h, &grad_gates).unwrap();
        drop(pt);
        grads.insert(u, tg.grad_params.to_vec1().unwrap());
        g = tg.grad_input.unwrap();
    }
    assert!(held.is_empty());
    let p = rt.fetch(unit_ids[0], Phase::Backward).unwrap();
    let mut g0 = model.backward(0, p.tensor(), &tokens, &g, None).unwrap().grad_params;
    drop(p);
    if let Some(gt) = tied_grad {
        g0 = (g0 + gt).unwrap();
    }
    grads.insert(0, g0.to_vec1().unwrap());

    // The same from the in-memory loop, and both against transformers'.
    let params: Vec<Tensor> =
        units.iter().map(|u| Tensor::from_vec(ckpt.read_unit(u).unwrap(), u.numel, &Device::Cpu).unwrap()).collect();
    let (parts, in_memory) = oogc::models::loss_parts_and_grads(&model, &params, &tokens, &targets).unwrap();
    assert_close(&format!("{label} in-memory loss"), &[parts.total() as f32], &floats(&reference, "loss"), 1e-4, 1e-5);
    let mut checked = 0;
    for (u, flat) in &grads {
        let mem: Vec<f32> = in_memory[*u].to_vec1().unwrap();
        for ((name, ours), (_, theirs)) in by_param(&model, *u, flat).into_iter().zip(by_param(&model, *u, &mem)) {
            let want = floats(&reference, &format!("grad.{name}"));
            assert_close(&format!("{label} grad {name} (runtime)"), &ours, &want, 1e-3, 1e-6);
            assert_close(&format!("{label} grad {name} (in memory)"), &theirs, &want, 1e-3, 1e-6);
            checked += 1;
        }
    }
    let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(checked, expected, "{label}: every parameter's gradient is compared");

    // One AdamW step from transformers' gradients, CPU experts' straight to the optimizer.
    for (u, unit) in units.iter().enumerate().rev() {
        let mut flat = vec![0f32; unit.numel];
        for p in &unit.params {
            flat[p.offset..p.offset + p.numel()].copy_from_slice(&floats(&reference, &format!("grad.{}", p.name)));
        }
        match unit.kind {
            UnitKind::Expert { block, expert } if place(block, expert) == Place::Cpu => {
                let flat = Tensor::from_vec(flat, unit.numel, &Device::Cpu).unwrap();
                rt.push_grads_host(unit_ids[u], &flat).unwrap()
            }
            _ => rt.push_grads_slice(unit_ids[u], oogc::optimizer::GradSlice::F32(&flat)).unwrap(),
        }
    }
    let stats = rt.finish_step().unwrap();
    assert!(!stats.figures.skipped && stats.figures.clip_scale == 1.0, "{stats:?}");
    rt.sync().unwrap();
    for (u, &id) in unit_ids.iter().enumerate() {
        let master = rt.unit_state(id).unwrap().master;
        for (name, ours) in by_param(&model, u, &master) {
            assert_close(&format!("{label} AdamW step {name}"), &ours, &floats(&step, &name), 1e-5, 1e-7);
        }
    }
}

/// A run config of `family` that starts from the checkpoint in `dir` (with its own tokenizer),
/// the routing trace written to `work/trace.bin`.
fn init_config(family: &str, dir: &Path, work: &Path) -> String {
    format!(
        r#"
[model]
family = "{family}"
init = "{init}"
[data]
path = "{data}"
tokenizer = "{init}/tokenizer.json"
cache_dir = "{work}/tokens"
[train]
batch_size = 2
seq_len = 16
steps = 2
[budgets]
gpu = "64MiB"
[moe]
routing_trace = "{work}/trace.bin"
[checkpoint]
dir = "{work}/ckpt"
"#,
        init = dir.display(),
        data = common::data_path().display(),
        work = work.display(),
    )
}

/// The trainer from the checkpoint in `dir`: its first step's loss is the in-memory
/// reference's on the same batch, two steps route every token of each sparse layer only (the
/// routing statistics and the trace number the MoE blocks 0, 1, .. by sparse layer); a
/// checkpoint saved before any step exports bitwise the input, config included.
fn trained_and_exported(name: &str, family: &str) {
    let dir = case(name);
    let work = tempfile::tempdir().unwrap();
    let cfg = oogc::config::TrainConfig::from_toml_str(&init_config(family, &dir, work.path())).unwrap();
    let mut t = oogc::train::Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    let saved = t.save_checkpoint().unwrap().expect("a checkpoint dir").path;
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let config = ckpt.llama_config().unwrap();
    let (sparse, k) = (config.sparse_layers(), config.top_k());
    for step in 0..2 {
        let out = t.train_step().unwrap();
        assert!(out.loss.is_finite() && out.aux_loss > 0.0, "{name} step {step}: {out:?}");
        assert_eq!(out.routed_tokens.len(), sparse.len(), "{name}: one routing per sparse layer");
        for counts in &out.routed_tokens {
            assert_eq!(counts.len(), config.num_experts());
            assert_eq!(counts.iter().sum::<usize>(), 2 * 16 * k, "{name}: every token routed k times");
        }
    }
    drop(t);
    let trace = oogc::moe_placement::read_trace_file(&work.path().join("trace.bin")).unwrap();
    assert_eq!(trace.header.blocks as usize, sparse.len(), "{name}: the trace's blocks are the sparse layers");
    assert_eq!(trace.steps.len(), 2, "{name}: a record per step");
    for (i, (_, tokens)) in trace.steps.iter().enumerate() {
        for b in 0..sparse.len() as u32 {
            assert_eq!(trace.tokens(i, b).iter().sum::<u64>(), 2 * 16 * k as u64, "{name}: block {b}");
        }
        assert_eq!(tokens.len(), sparse.len() * config.num_experts());
    }

    let out = work.path().join("hf");
    oogc::export::export_hf(&saved, &out, &Default::default()).unwrap();
    let exported = HfCheckpoint::open(&out).unwrap();
    assert_eq!(ckpt.tensors().keys().collect::<Vec<_>>(), exported.tensors().keys().collect::<Vec<_>>());
    for name in ckpt.tensors().keys() {
        let (a, b) = (ckpt.read_tensor(name).unwrap(), exported.read_tensor(name).unwrap());
        assert_eq!(a.0, b.0, "{name}: shape");
        assert!(a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: not bitwise equal");
    }
    assert_eq!(exported.llama_config().unwrap(), config, "config.json");
}

/// Qwen3-MoE, `mlp_only_layers = [1]` of 3 layers, tied head.
#[test]
fn qwen3_moe_with_a_dense_middle_layer_matches_transformers_through_the_runtime() {
    let dir = case("qwen3_moe_mlp_only");
    through_the_runtime(&dir, "qwen3 mixed", mixed);
    through_the_runtime(&dir, "qwen3 resident", |_, _| Place::Resident);
}

/// Qwen2-MoE, `decoder_sparse_step = 2` of 4 layers (0 and 2 dense, without shared experts).
#[test]
fn qwen2_moe_with_decoder_sparse_step_2_matches_transformers_through_the_runtime() {
    let dir = case("qwen2_moe_sparse_step");
    through_the_runtime(&dir, "qwen2 mixed", mixed);
    through_the_runtime(&dir, "qwen2 cpu", |_, _| Place::Cpu);
}

#[test]
fn qwen3_moe_with_dense_layers_trains_and_exports_bitwise() {
    trained_and_exported("qwen3_moe_mlp_only", "qwen3_moe");
}

#[test]
fn qwen2_moe_with_dense_layers_trains_and_exports_bitwise() {
    trained_and_exported("qwen2_moe_sparse_step", "qwen2_moe");
}
