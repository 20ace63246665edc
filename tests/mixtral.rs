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
use oogc::runtime::{Phase, Runtime, RuntimeConfig, UnitId, UnitParams};
use oogc::swapper::{DType, NvmeConfig, StatePlacement};

use fixtures::{assert_close, by_param, f32s, floats, ids, tensors};

pub(crate) fn case() -> PathBuf {
    common::repo_root().join("../shared/fixtures/llama/mixtral_moe")
}

/// A case of `../shared/fixtures/moe/` (`qwen3_moe`, `olmoe`, `qwen2_moe`; README there).
pub(crate) fn moe_case(name: &str) -> PathBuf {
    common::repo_root().join("../shared/fixtures/moe").join(name)
}

/// Where an expert runs in the test's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
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

/// A fixture case loaded: the checkpoint, its model, transformers' numbers.
pub(crate) struct Case {
    pub(crate) ckpt: HfCheckpoint,
    pub(crate) model: Llama,
    pub(crate) reference: fixtures::Tensors,
    pub(crate) step: fixtures::Tensors,
}

impl Case {
    /// The case in `dir`; `chunk` as [`through_the_runtime`]'s.
    pub(crate) fn open(dir: &Path, chunk: Option<usize>) -> Case {
        let ckpt = HfCheckpoint::open(dir).unwrap();
        let mut model = Llama::new(ckpt.llama_config().unwrap()).unwrap();
        if chunk.is_some() {
            model = model.composed_only().with_attention_chunk(chunk).unwrap();
        }
        assert!(model.moe().is_some(), "{dir:?} is an MoE model");
        ckpt.check_units(model.units()).unwrap();
        let reference = tensors(&dir.join("reference.safetensors"));
        let step = tensors(&dir.join("step.safetensors"));
        Case { ckpt, model, reference, step }
    }

    /// Every unit's parameters in memory, rounded to `dtype`.
    pub(crate) fn params(&self, dtype: candle_core::DType) -> Vec<Tensor> {
        let units = self.model.units();
        units
            .iter()
            .map(|u| {
                Tensor::from_vec(self.ckpt.read_unit(u).unwrap(), u.numel, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            })
            .collect()
    }

    /// An offloaded runtime (state on NVMe in `nvme`, a GPU budget below the model's bytes
    /// unless every expert stays resident) with compute copies in `dtype` and every unit
    /// registered (experts unscheduled), its step 1 begun; and the runtime's id of each model
    /// unit, in the model's order.
    pub(crate) fn runtime(
        &self,
        dtype: DType,
        nvme: &Path,
        place: &dyn Fn(usize, usize) -> Place,
    ) -> (Runtime, Vec<UnitId>) {
        let cfg = self.model.config();
        let units = self.model.units();
        let (sparse, experts) = (cfg.sparse_layers(), cfg.num_experts());
        let bytes = |numel: usize| dtype.num_bytes(numel) as u64;
        let total_bytes: u64 = units.iter().map(|u| bytes(u.numel)).sum();
        let largest = units.iter().map(|u| bytes(u.numel)).max().unwrap();
        let expert_bytes = bytes(units[cfg.expert_unit(sparse[0], 0)].numel);
        let resident = sparse
            .iter()
            .flat_map(|&b| (0..experts).map(move |e| (b, e)))
            .filter(|&(b, e)| place(b, e) == Place::Resident)
            .count() as u64;
        let mut rc = RuntimeConfig::sim(resident * expert_bytes + 3 * largest);
        if resident < (sparse.len() * experts) as u64 {
            assert!(rc.gpu_budget_bytes < total_bytes, "the GPU budget must be below the model's bytes");
        }
        rc.state_placement = StatePlacement::Nvme;
        rc.nvme = Some(NvmeConfig::new(vec![nvme.to_path_buf()], 64 << 20));
        rc.optimizer = fixtures::fixture_optimizer(dtype);
        let mut rt = Runtime::new(rc, oogc::dist::Ranks::single()).unwrap();
        let mut unit_ids = Vec::with_capacity(units.len());
        for u in units {
            let id = rt.add_unit(&u.name, &self.ckpt.read_unit(u).unwrap()).unwrap();
            if matches!(u.kind, UnitKind::Expert { .. }) {
                rt.set_unscheduled(id).unwrap();
            }
            unit_ids.push(id);
        }
        rt.set_max_units_in_use(2);
        rt.begin_step(1, fixtures::FIXTURE_LR).unwrap();
        (rt, unit_ids)
    }

    /// One forward and backward with the unit parameters `source` gives (`keep(unit)`: an
    /// expert's forward parameters are held until its backward), routed as the router decides
    /// or, with `replay` (every sparse layer's choices `[N · k]`), to those experts
    /// (`Llama::trunk_forward_routed`). Dense layers among the sparse ones (`mlp_only_layers`,
    /// `decoder_sparse_step`) run as the block units they are; a tied head uses the embedding.
    pub(crate) fn pass(
        &self,
        source: &mut dyn FnMut(usize, Phase) -> Params,
        keep: &dyn Fn(usize) -> bool,
        replay: Option<&[Vec<u32>]>,
    ) -> Pass {
        let (model, cfg) = (&self.model, self.model.config());
        let moe = model.moe().unwrap();
        let units = model.units();
        let (layers, experts) = (cfg.num_hidden_layers, cfg.num_experts());
        let tokens = ids(&self.reference, "input_ids");
        let targets = ids(&self.reference, "labels");
        let head = units.len() - 1;
        let mut held: HashMap<usize, Params> = HashMap::new();
        let mut x = model.forward(0, source(0, Phase::Forward).tensor(), &tokens, None).unwrap();
        let (mut inputs, mut routings, mut router_logits) = (Vec::new(), Vec::new(), Vec::new());
        for b in 0..layers {
            let trunk = source(cfg.block_unit(b), Phase::Forward);
            if !cfg.is_sparse_layer(b) {
                let y = model.forward(cfg.block_unit(b), trunk.tensor(), &x, None).unwrap();
                inputs.push(std::mem::replace(&mut x, y));
                continue;
            }
            let t = match replay {
                Some(choices) => model.trunk_forward_routed(b, trunk.tensor(), &x, &choices[routings.len()]).unwrap(),
                None => moe.trunk_forward(b, trunk.tensor(), &x).unwrap(),
            };
            drop(trunk);
            let mut outs = vec![None; experts];
            for (e, out) in outs.iter_mut().enumerate() {
                let Some(h_e) = t.routing.expert_input(e, &t.h).unwrap() else { continue };
                let u = cfg.expert_unit(b, e);
                let p = source(u, Phase::Forward);
                *out = Some(moe.expert_forward(p.tensor(), &h_e).unwrap());
                if keep(u) {
                    held.insert(u, p);
                }
            }
            let y = moe.combine(&t.x1, &t.routing, &outs).unwrap();
            router_logits.extend(f32s(&t.logits));
            routings.push(t.routing);
            inputs.push(std::mem::replace(&mut x, y));
        }
        moe.finish_forward(&mut routings.iter_mut().collect::<Vec<_>>()).unwrap();
        let weighted_aux = moe.aux_loss(&routings.iter().collect::<Vec<_>>());

        let emb = cfg.tie_word_embeddings.then(|| source(0, Phase::Backward));
        let emb_t = emb.as_ref().map(|e| e.tensor().clone());
        let p = source(head, Phase::Backward);
        let logits = f32s(&model.forward(head, p.tensor(), &x, emb_t.as_ref()).unwrap());
        let out = model.head_loss_backward(p.tensor(), &x, emb_t.as_ref(), &targets).unwrap();
        drop((p, emb));
        let mut grads: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        grads.insert(head, f32s(&out.grads.grad_params));
        let tied_grad = out.grads.grad_tied_wte;
        let mut g = out.grads.grad_input.unwrap();
        let mut sparse = routings.len();
        for b in (0..layers).rev() {
            let trunk = cfg.block_unit(b);
            let pt = source(trunk, Phase::Backward);
            if !cfg.is_sparse_layer(b) {
                let ug = model.backward(trunk, pt.tensor(), &inputs[b], &g, None).unwrap();
                grads.insert(trunk, f32s(&ug.grad_params));
                g = ug.grad_input.unwrap();
                continue;
            }
            sparse -= 1;
            let routing = &routings[sparse];
            let t = moe.trunk_forward(b, pt.tensor(), &inputs[b]).unwrap();
            let (mut grad_inputs, mut grad_gates) = (vec![None; experts], vec![None; experts]);
            for e in 0..experts {
                let u = cfg.expert_unit(b, e);
                let Some(h_e) = routing.expert_input(e, &t.h).unwrap() else {
                    grads.insert(u, vec![0.0; units[u].numel]);
                    continue;
                };
                let go = moe.expert_grad_output(routing, e, &g).unwrap().unwrap();
                let pe = held.remove(&u).unwrap_or_else(|| source(u, Phase::Backward));
                let eg = moe.expert_backward(pe.tensor(), &h_e, &go).unwrap();
                drop(pe);
                grad_gates[e] = moe.expert_grad_gate(routing, e, &g, &eg.output).unwrap();
                grad_inputs[e] = Some(eg.grad_input);
                grads.insert(u, f32s(&eg.grad_params));
            }
            let grad_h = routing.scatter_input_grads(&grad_inputs).unwrap();
            let tg = moe.trunk_backward(b, pt.tensor(), &inputs[b], routing, &g, &grad_h, &grad_gates).unwrap();
            drop(pt);
            grads.insert(trunk, f32s(&tg.grad_params));
            g = tg.grad_input.unwrap();
        }
        assert!(held.is_empty());
        let p = source(0, Phase::Backward);
        let mut g0 = model.backward(0, p.tensor(), &tokens, &g, None).unwrap().grad_params;
        drop(p);
        if let Some(gt) = tied_grad {
            g0 = (g0 + gt).unwrap();
        }
        grads.insert(0, f32s(&g0));
        let choices = routings.iter().map(|r| r.choices().to_vec()).collect();
        let (aux, loss) = (weighted_aux / cfg.aux_loss_weight(), out.loss + weighted_aux);
        Pass { router_logits, choices, aux, logits, loss_ce: out.loss, loss, grads }
    }

    /// [`Case::pass`] through `rt`, experts where `place` says.
    pub(crate) fn runtime_pass(
        &self,
        rt: &mut Runtime,
        unit_ids: &[UnitId],
        place: &dyn Fn(usize, usize) -> Place,
    ) -> Pass {
        let units = self.model.units().to_vec();
        let where_ = |u: usize| match units[u].kind {
            UnitKind::Expert { block, expert } => place(block, expert),
            _ => Place::Fetch,
        };
        let mut source = |u: usize, phase: Phase| Params::Runtime(fetch(rt, unit_ids[u], where_(u), phase));
        self.pass(&mut source, &|u| where_(u) == Place::Resident, None)
    }

    /// Pushes transformers' gradients (experts on the CPU straight to the optimizer), finishes
    /// the step and checks it ([`fixtures::assert_adamw_step`]).
    pub(crate) fn adamw_step(
        &self,
        label: &str,
        rt: &mut Runtime,
        unit_ids: &[UnitId],
        place: &dyn Fn(usize, usize) -> Place,
    ) {
        for (u, unit) in self.model.units().iter().enumerate().rev() {
            let mut flat = vec![0f32; unit.numel];
            for p in &unit.params {
                flat[p.offset..p.offset + p.numel()]
                    .copy_from_slice(&floats(&self.reference, &format!("grad.{}", p.name)));
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
        fixtures::assert_adamw_step(label, rt, &self.model, unit_ids, &self.step);
        assert!(rt.memory().traffic().nvme_write.bytes > 0, "the optimizer state went through NVMe");
    }
}

/// A unit's parameters for one call: the runtime's (pinned while held) or in memory.
pub(crate) enum Params {
    Runtime(UnitParams),
    Memory(Tensor),
}

impl Params {
    fn tensor(&self) -> &Tensor {
        match self {
            Params::Runtime(p) => p.tensor(),
            Params::Memory(t) => t,
        }
    }
}

/// What one forward and backward of an MoE fixture gives (values as f32).
pub(crate) struct Pass {
    /// Every sparse layer's router logits, `[sparse layers, N, E]` flat.
    pub(crate) router_logits: Vec<f32>,
    /// Every sparse layer's top-k choices `[N · k]`, best first.
    pub(crate) choices: Vec<Vec<u32>>,
    /// The load-balancing loss (transformers' `aux_loss`, before its coefficient).
    pub(crate) aux: f64,
    /// `[B, T, V]` flat.
    pub(crate) logits: Vec<f32>,
    pub(crate) loss_ce: f64,
    /// `loss_ce + coef · aux`.
    pub(crate) loss: f64,
    /// Every unit's flat gradients, by model unit.
    pub(crate) grads: BTreeMap<usize, Vec<f32>>,
}

/// [`through_the_runtime`] for the fixture case in `dir`.
fn case_through_the_runtime(dir: &Path, label: &str, chunk: Option<usize>, place: impl Fn(usize, usize) -> Place) {
    check_through_the_runtime(&Case::open(dir, chunk), label, place)
}

/// One step of `case` through an offloaded `Runtime`, experts where `place(layer, expert)` says:
/// router logits, load-balancing loss, logits and losses within 1e-4 relative + 1e-5 absolute of
/// transformers', every gradient (the runtime's and the in-memory loop's) within 1e-3 + 1e-6,
/// and the AdamW step ([`Case::adamw_step`]).
pub(crate) fn check_through_the_runtime(case: &Case, label: &str, place: impl Fn(usize, usize) -> Place) {
    let nvme = tempfile::tempdir().unwrap();
    let (mut rt, unit_ids) = case.runtime(DType::F32, nvme.path(), &place);
    let pass = case.runtime_pass(&mut rt, &unit_ids, &place);
    let r = &case.reference;
    assert_close(&format!("{label} router_logits"), &pass.router_logits, &floats(r, "router_logits"), 1e-4, 1e-5);
    assert_close(&format!("{label} aux_loss"), &[pass.aux as f32], &floats(r, "aux_loss"), 1e-4, 1e-5);
    assert_close(&format!("{label} logits"), &pass.logits, &floats(r, "logits"), 1e-4, 1e-5);
    assert_close(&format!("{label} loss_ce"), &[pass.loss_ce as f32], &floats(r, "loss_ce"), 1e-4, 1e-5);
    assert_close(&format!("{label} loss"), &[pass.loss as f32], &floats(r, "loss"), 1e-4, 1e-5);

    // The same from the in-memory loop, and both against transformers'.
    let model = &case.model;
    let params = case.params(candle_core::DType::F32);
    let (tokens, targets) = (ids(r, "input_ids"), ids(r, "labels"));
    let (parts, in_memory) = oogc::models::loss_parts_and_grads(model, &params, &tokens, &targets).unwrap();
    assert_close(&format!("{label} in-memory loss"), &[parts.total() as f32], &floats(r, "loss"), 1e-4, 1e-5);
    let mut checked = 0;
    for (u, flat) in &pass.grads {
        let mem: Vec<f32> = in_memory[*u].to_vec1().unwrap();
        for ((name, ours), (_, theirs)) in by_param(model, *u, flat).into_iter().zip(by_param(model, *u, &mem)) {
            let want = floats(r, &format!("grad.{name}"));
            assert_close(&format!("{label} grad {name} (runtime)"), &ours, &want, 1e-3, 1e-6);
            assert_close(&format!("{label} grad {name} (in memory)"), &theirs, &want, 1e-3, 1e-6);
            checked += 1;
        }
    }
    let expected = r.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(checked, expected, "{label}: every parameter's gradient is compared");

    // One AdamW step from transformers' gradients, CPU experts' straight to the optimizer.
    case.adamw_step(label, &mut rt, &unit_ids, &place);
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
