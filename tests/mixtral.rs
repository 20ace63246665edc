//! Mixtral against transformers' numbers (`../shared/fixtures/llama/mixtral_moe/`, README
//! there): the checkpoint (4 experts per layer, top-2, 10 shards) loaded through the reader and
//! computed **through the `Runtime`** with its experts placed resident (pinned from forward to
//! backward), fetched (H2D in each direction) and computed on the CPU from their host copy
//! (`fetch_host` / `push_grads_host`), each placement for every expert and mixed: logits, router
//! logits, cross-entropy, load-balancing loss and loss within 1e-4 relative + 1e-5 absolute,
//! every gradient within 1e-3 relative + 1e-6 absolute (and the in-memory
//! `oogc_models::loss_parts_and_grads` alike), one AdamW step within 1e-5 relative + 1e-7
//! absolute of `step.safetensors`. Then the oogc path: `[model] family = "mixtral"`, `init =`
//! the checkpoint, exported bitwise the input.

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

fn case() -> PathBuf {
    common::repo_root().join("../shared/fixtures/llama/mixtral_moe")
}

/// A case of `../shared/fixtures/moe/` (`qwen3_moe`, `olmoe`, `qwen2_moe`; README there).
fn moe_case(name: &str) -> PathBuf {
    common::repo_root().join("../shared/fixtures/moe").join(name)
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

/// One training step through an offloaded `Runtime`, experts where `place(block, expert)` says,
/// checked against the fixture. `chunk`: run the model on the op compositions (a CUDA device's
/// path) with its attention over blocks of that many query positions; `None`: the default
/// model (fused CPU kernels).
fn through_the_runtime(label: &str, chunk: Option<usize>, place: impl Fn(usize, usize) -> Place) {
    case_through_the_runtime(&case(), label, chunk, place)
}

/// [`through_the_runtime`] for the fixture case in `dir`.
fn case_through_the_runtime(dir: &Path, label: &str, chunk: Option<usize>, place: impl Fn(usize, usize) -> Place) {
    let reference = tensors(&dir.join("reference.safetensors"));
    let step = tensors(&dir.join("step.safetensors"));
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let mut model = Llama::new(ckpt.llama_config().unwrap()).unwrap();
    if chunk.is_some() {
        model = model.composed_only().with_attention_chunk(chunk).unwrap();
    }
    let cfg = model.config().clone();
    let moe = model.moe().expect("Mixtral is an MoE model");
    ckpt.check_units(model.units()).unwrap();
    let units = model.units().to_vec();
    let (layers, experts) = (cfg.num_hidden_layers, cfg.num_experts());
    let total_bytes: u64 = units.iter().map(|u| u.numel as u64 * 4).sum();
    let largest = units.iter().map(|u| u.numel as u64 * 4).max().unwrap();
    let expert_bytes = units[cfg.expert_unit(0, 0)].numel as u64 * 4;
    let resident = (0..layers)
        .flat_map(|b| (0..experts).map(move |e| (b, e)))
        .filter(|&(b, e)| place(b, e) == Place::Resident)
        .count() as u64;

    // Offloaded (the GPU budget below the model's bytes) unless every expert stays resident.
    let nvme = tempfile::tempdir().unwrap();
    let mut rc = RuntimeConfig::sim(resident * expert_bytes + 3 * largest);
    if resident < (layers * experts) as u64 {
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
    // The runtime's id of each model unit, in the model's order.
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
    let mut held: HashMap<usize, UnitParams> = HashMap::new();
    let mut x = model.forward(0, rt.fetch(unit_ids[0], Phase::Forward).unwrap().tensor(), &tokens, None).unwrap();
    let (mut inputs, mut routings, mut router_logits) = (Vec::new(), Vec::new(), Vec::new());
    for b in 0..layers {
        let t =
            moe.trunk_forward(b, rt.fetch(unit_ids[cfg.block_unit(b)], Phase::Forward).unwrap().tensor(), &x).unwrap();
        let mut outs = vec![None; experts];
        for (e, out) in outs.iter_mut().enumerate() {
            let Some(h_e) = t.routing.expert_input(e, &t.h).unwrap() else { continue };
            let u = cfg.expert_unit(b, e);
            let p = fetch(&mut rt, unit_ids[u], place(b, e), Phase::Forward);
            *out = Some(moe.expert_forward(p.tensor(), &h_e).unwrap());
            if place(b, e) == Place::Resident {
                held.insert(u, p);
            }
        }
        let y = moe.combine(&t.x1, &t.routing, &outs).unwrap();
        router_logits.extend(t.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        routings.push(t.routing);
        inputs.push(std::mem::replace(&mut x, y));
    }
    assert_close(&format!("{label} router_logits"), &router_logits, &floats(&reference, "router_logits"), 1e-4, 1e-5);
    moe.finish_forward(&mut routings.iter_mut().collect::<Vec<_>>()).unwrap();
    let aux = moe.aux_loss(&routings.iter().collect::<Vec<_>>());
    let coef = cfg.aux_loss_weight();
    assert_close(&format!("{label} aux_loss"), &[(aux / coef) as f32], &floats(&reference, "aux_loss"), 1e-4, 1e-5);

    let p = rt.fetch(unit_ids[head], Phase::Backward).unwrap();
    let logits: Vec<f32> = model.forward(head, p.tensor(), &x, None).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_close(&format!("{label} logits"), &logits, &floats(&reference, "logits"), 1e-4, 1e-5);
    let out = model.head_loss_backward(p.tensor(), &x, None, &targets).unwrap();
    drop(p);
    assert_close(&format!("{label} loss_ce"), &[out.loss as f32], &floats(&reference, "loss_ce"), 1e-4, 1e-5);
    assert_close(&format!("{label} loss"), &[(out.loss + aux) as f32], &floats(&reference, "loss"), 1e-4, 1e-5);
    let mut grads: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    grads.insert(head, out.grads.grad_params.to_vec1().unwrap());
    let mut g = out.grads.grad_input.unwrap();
    for b in (0..layers).rev() {
        let trunk = cfg.block_unit(b);
        let pt = rt.fetch(unit_ids[trunk], Phase::Backward).unwrap();
        let routing = &routings[b];
        let t = moe.trunk_forward(b, pt.tensor(), &inputs[b]).unwrap();
        let (mut grad_inputs, mut grad_gates) = (vec![None; experts], vec![None; experts]);
        for e in 0..experts {
            let u = cfg.expert_unit(b, e);
            let Some(h_e) = routing.expert_input(e, &t.h).unwrap() else {
                grads.insert(u, vec![0.0; units[u].numel]);
                continue;
            };
            let go = moe.expert_grad_output(routing, e, &g).unwrap().unwrap();
            let pe = held.remove(&u).unwrap_or_else(|| fetch(&mut rt, unit_ids[u], place(b, e), Phase::Backward));
            let eg = moe.expert_backward(pe.tensor(), &h_e, &go).unwrap();
            drop(pe);
            grad_gates[e] = moe.expert_grad_gate(routing, e, &g, &eg.output).unwrap();
            grad_inputs[e] = Some(eg.grad_input);
            grads.insert(u, eg.grad_params.to_vec1().unwrap());
        }
        let grad_h = routing.scatter_input_grads(&grad_inputs).unwrap();
        let tg = moe.trunk_backward(b, pt.tensor(), &inputs[b], routing, &g, &grad_h, &grad_gates).unwrap();
        drop(pt);
        grads.insert(trunk, tg.grad_params.to_vec1().unwrap());
        g = tg.grad_input.unwrap();
    }
    assert!(held.is_empty());
    let p = rt.fetch(unit_ids[0], Phase::Backward).unwrap();
    grads.insert(0, model.backward(0, p.tensor(), &tokens, &g, None).unwrap().grad_params.to_vec1().unwrap());
    drop(p);

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
    assert!(rt.memory().traffic().nvme_write.bytes > 0, "the optimizer state went through NVMe");
}

#[test]
fn mixtral_matches_transformers_with_resident_experts() {
    through_the_runtime("resident", None, |_, _| Place::Resident);
}

#[test]
fn mixtral_matches_transformers_with_fetched_experts() {
    through_the_runtime("fetch", None, |_, _| Place::Fetch);
}

#[test]
fn mixtral_matches_transformers_with_experts_on_the_cpu() {
    through_the_runtime("cpu", None, |_, _| Place::Cpu);
}

#[test]
fn mixtral_matches_transformers_with_mixed_placements() {
    through_the_runtime("mixed", None, |b, e| [Place::Resident, Place::Fetch, Place::Cpu][(b + e) % 3]);
}

/// The composed path with attention over query blocks of 5 (not dividing the fixture's T).
#[test]
fn mixtral_over_attention_blocks_matches_transformers() {
    through_the_runtime("blocks", Some(5), |b, e| [Place::Resident, Place::Fetch, Place::Cpu][(b + e) % 3]);
}

/// A run config that starts from the Mixtral checkpoint.
fn init_config(work: &Path) -> String {
    init_config_of("mixtral", &case(), &case().join("../tokenizer.json"), work)
}

/// A run config of `family` that starts from the checkpoint in `dir`.
fn init_config_of(family: &str, dir: &Path, tokenizer: &Path, work: &Path) -> String {
    format!(
        r#"
[model]
family = "{family}"
init = "{init}"
[data]
path = "{data}"
tokenizer = "{tok}"
cache_dir = "{work}/tokens"
[train]
batch_size = 2
seq_len = 16
steps = 1
[budgets]
gpu = "64MiB"
[checkpoint]
dir = "{work}/ckpt"
"#,
        init = dir.display(),
        data = common::data_path().display(),
        tok = tokenizer.display(),
        work = work.display(),
    )
}

#[test]
fn a_mixtral_checkpoint_imported_then_exported_is_bitwise_the_input() {
    let work = tempfile::tempdir().unwrap();
    imported_then_exported(&init_config(work.path()), &case(), work.path());
}

/// The trainer started from the checkpoint in `dir` by `config`, saved, exported with
/// `export --hf`: the exported files re-read equal the original tensors bitwise, and the config.
fn imported_then_exported(config: &str, dir: &Path, work: &Path) {
    let cfg = oogc::config::TrainConfig::from_toml_str(config).unwrap();
    let mut t = oogc::train::Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
    let saved = t.save_checkpoint().unwrap().expect("a checkpoint dir").path;
    drop(t);
    let out = work.join("hf");
    oogc::export::export_hf(&saved, &out, &Default::default()).unwrap();
    let original = HfCheckpoint::open(dir).unwrap();
    let exported = HfCheckpoint::open(&out).unwrap();
    assert_eq!(original.tensors().keys().collect::<Vec<_>>(), exported.tensors().keys().collect::<Vec<_>>());
    for name in original.tensors().keys() {
        let (a, b) = (original.read_tensor(name).unwrap(), exported.read_tensor(name).unwrap());
        assert_eq!(a.0, b.0, "{name}: shape");
        assert!(a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: not bitwise equal");
    }
    assert_eq!(exported.llama_config().unwrap(), original.llama_config().unwrap(), "config.json");
}

// ---- the fine-grained MoE families (`../shared/fixtures/moe/`) -------------------------------

/// The case `name` through the runtime with mixed placements (resident, fetched, on the CPU),
/// then imported by the trainer (`family`) and exported bitwise.
fn fine_grained_case(name: &str, family: &str) {
    let dir = moe_case(name);
    case_through_the_runtime(&dir, name, None, |b, e| [Place::Resident, Place::Fetch, Place::Cpu][(b + e) % 3]);
    let work = tempfile::tempdir().unwrap();
    let tokenizer = dir.join("../../llama/tokenizer.json");
    imported_then_exported(&init_config_of(family, &dir, &tokenizer, work.path()), &dir, work.path());
}

/// Qwen3-MoE: 8 experts, top-4 renormalized, per-head q/k norm.
#[test]
fn qwen3_moe_matches_transformers_through_the_runtime_and_exports_bitwise() {
    fine_grained_case("qwen3_moe", "qwen3_moe");
}

/// OLMoE: top-4 not renormalized, q/k norm over the whole projections.
#[test]
fn olmoe_matches_transformers_through_the_runtime_and_exports_bitwise() {
    fine_grained_case("olmoe", "olmoe");
}

/// Qwen2-MoE: q/k/v bias, the shared expert and its sigmoid gate in the trunk unit.
#[test]
fn qwen2_moe_matches_transformers_through_the_runtime_and_exports_bitwise() {
    fine_grained_case("qwen2_moe", "qwen2_moe");
}
