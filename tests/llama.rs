//! The Llama family against transformers' numbers (`../shared/fixtures/llama/`, README there):
//! `llama_gqa` (GQA, untied, 12 shards), `qwen2_tied` (q/k/v bias, tied, one file) and
//! `../shared/fixtures/moe/qwen3_dense` (Qwen3's per-head q/k norm, 14 shards), loaded
//! through the checkpoint reader and computed unit by unit **through the `Runtime`** (offloaded:
//! a GPU budget below the model, optimizer state on NVMe) and in the plain in-memory loop of
//! `oogc_models::loss_and_grads`: logits and loss within 1e-4 relative + 1e-5 absolute, every
//! gradient within 1e-3 relative + 1e-6 absolute, and one AdamW step from those gradients within
//! 1e-5 relative + 1e-7 absolute of `step.safetensors` (torch's fused AdamW). Then the oogc path
//! around them: a run initialised from a checkpoint and exported (`oogc::export`) is bitwise
//! the input tensors (its shards carrying verified crc32c checksums), and an unsupported
//! `config.json` key is refused by name.

use crate::common;
use crate::fixtures;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use oogc::models::hf::HfCheckpoint;
use oogc::models::llama::Llama;
use oogc::models::{CausalLm, UnitKind};
use oogc::runtime::tensor::candle_dtype;
use oogc::runtime::{Phase, Runtime, RuntimeConfig, UnitId};
use oogc::swapper::{DType, NvmeConfig, StatePlacement};

use fixtures::{assert_close, by_param, f32s, floats, ids, tensors};

fn fixtures() -> PathBuf {
    common::repo_root().join("../shared/fixtures/llama")
}

/// A case's directory: `llama/<case>`, else `moe/<case>` (`../shared/fixtures/moe`, README there).
fn case_dir(case: &str) -> PathBuf {
    let dirs = [fixtures().join(case), fixtures().join("../moe").join(case)];
    dirs.into_iter().find(|d| d.exists()).unwrap_or_else(|| panic!("no fixture `{case}` in llama/ or moe/"))
}

/// One training step of `case` through an offloaded `Runtime`, checked against the fixture.
/// `chunk`: run the model on the op compositions (a CUDA device's path) with its attention over
/// blocks of that many query positions; `None`: the default model (fused CPU kernels).
fn through_the_runtime(case: &str, chunk: Option<usize>) {
    through_the_runtime_in(case, chunk, DType::F32)
}

/// [`through_the_runtime`] with compute copies in `dtype` over f32 masters. F32: logits and
/// loss within 1e-4 relative + 1e-5 absolute of transformers', gradients within 1e-3 + 1e-6.
/// BF16 (which computes on the op compositions): within the BF16 bounds of the in-memory
/// checks (`fixtures::BF16_*`), and the runtime's logits, loss and gradients bitwise those of
/// the in-memory loop over the masters rounded to BF16. Either way, one AdamW step
/// ([`fixtures::assert_adamw_step`]).
fn through_the_runtime_in(case: &str, chunk: Option<usize>, dtype: DType) {
    let dir = case_dir(case);
    let reference = tensors(&dir.join("reference.safetensors"));
    let step = tensors(&dir.join("step.safetensors"));
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let mut model = Llama::new(ckpt.llama_config().unwrap()).unwrap();
    if chunk.is_some() {
        model = model.composed_only().with_attention_chunk(chunk).unwrap();
    }
    ckpt.check_units(model.units()).unwrap();
    let units = model.units().to_vec();
    let total_bytes: u64 = units.iter().map(|u| dtype.num_bytes(u.numel) as u64).sum();
    let largest = units.iter().map(|u| dtype.num_bytes(u.numel) as u64).max().unwrap();

    // Offloaded: state on NVMe, and the GPU budget of the minimum working set (the units in use
    // at once and gradient staging), below the model's bytes where the model allows it (the
    // tied qwen2's embedding is most of the model: two of it are more than all).
    let nvme = tempfile::tempdir().unwrap();
    let in_use = if model.tied_head() { 2 } else { 1 };
    let mut rc = RuntimeConfig::sim((in_use + 1) * largest);
    let in_use = in_use as usize;
    if !model.tied_head() {
        assert!(rc.gpu_budget_bytes < total_bytes, "the GPU budget must be below the model's bytes");
    }
    rc.state_placement = StatePlacement::Nvme;
    rc.nvme = Some(NvmeConfig::new(vec![nvme.path().to_path_buf()], 64 << 20));
    rc.optimizer = fixtures::fixture_optimizer(dtype);
    let mut rt = Runtime::new(rc, oogc::dist::Ranks::single()).unwrap();
    // The runtime's id of each model unit, in the model's order.
    let unit_ids: Vec<_> = units.iter().map(|u| rt.add_unit(&u.name, &ckpt.read_unit(u).unwrap()).unwrap()).collect();
    rt.set_max_units_in_use(in_use);
    rt.begin_step(1, fixtures::FIXTURE_LR).unwrap();

    let tokens = ids(&reference, "input_ids");
    let targets = ids(&reference, "labels");
    let head = units.len() - 1;
    assert!(matches!(units[head].kind, UnitKind::Head));
    // Forward, keeping each unit's input.
    let mut x = model.forward(0, rt.fetch(unit_ids[0], Phase::Forward).unwrap().tensor(), &tokens, None).unwrap();
    let mut inputs = Vec::new();
    for (u, &id) in unit_ids.iter().enumerate().take(head).skip(1) {
        let y = model.forward(u, rt.fetch(id, Phase::Forward).unwrap().tensor(), &x, None).unwrap();
        inputs.push(std::mem::replace(&mut x, y));
    }
    // The head: logits, then loss and backward.
    let emb = model.tied_head().then(|| rt.fetch(unit_ids[0], Phase::Backward).unwrap());
    let p = rt.fetch(unit_ids[head], Phase::Backward).unwrap();
    let logits = model.forward(head, p.tensor(), &x, emb.as_ref().map(|e| e.tensor())).unwrap();
    assert_eq!(logits.dtype(), candle_dtype(dtype).unwrap());
    let logits = f32s(&logits);
    let out = model.head_loss_backward(p.tensor(), &x, emb.as_ref().map(|e| e.tensor()), &targets).unwrap();
    drop((p, emb));
    let mut grads: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    grads.insert(head, f32s(&out.grads.grad_params));
    let mut g = out.grads.grad_input.unwrap();
    for u in (1..head).rev() {
        let p = rt.fetch(unit_ids[u], Phase::Backward).unwrap();
        let ug = model.backward(u, p.tensor(), &inputs[u - 1], &g, None).unwrap();
        grads.insert(u, f32s(&ug.grad_params));
        g = ug.grad_input.unwrap();
    }
    let p = rt.fetch(unit_ids[0], Phase::Backward).unwrap();
    let mut g0 = model.backward(0, p.tensor(), &tokens, &g, None).unwrap().grad_params;
    if let Some(extra) = out.grads.grad_tied_wte {
        g0 = (g0 + extra).unwrap();
    }
    drop(p);
    grads.insert(0, f32s(&g0));

    // The same from the plain in-memory loop over the masters (rounded to `dtype`).
    let params: Vec<Tensor> = units
        .iter()
        .map(|u| {
            let flat = ckpt.read_unit(u).unwrap();
            Tensor::from_vec(flat, u.numel, &Device::Cpu).unwrap().to_dtype(candle_dtype(dtype).unwrap()).unwrap()
        })
        .collect();
    let (loss, in_memory) = oogc::models::loss_and_grads(&model, &params, &tokens, &targets).unwrap();
    if dtype != DType::F32 {
        check_bf16(case, &model, &reference, &logits, out.loss, &grads);
        assert_eq!(loss.to_bits(), out.loss.to_bits(), "{case}: the runtime's loss is the in-memory loop's");
        for (u, flat) in &grads {
            assert!(f32s(&in_memory[*u]) == *flat, "{case}: unit {u}'s gradients are the in-memory loop's");
        }
        push_fixture_grads_and_step(case, &mut rt, &model, &unit_ids, &reference, &step);
        return;
    }
    assert_close(&format!("{case} logits"), &logits, &floats(&reference, "logits"), 1e-4, 1e-5);
    assert_close(&format!("{case} loss"), &[out.loss as f32], &floats(&reference, "loss"), 1e-4, 1e-5);
    assert_close(&format!("{case} in-memory loss"), &[loss as f32], &floats(&reference, "loss"), 1e-4, 1e-5);
    let mut checked = 0;
    for (u, flat) in &grads {
        let mem: Vec<f32> = in_memory[*u].to_vec1().unwrap();
        for ((name, ours), (_, theirs)) in by_param(&model, *u, flat).into_iter().zip(by_param(&model, *u, &mem)) {
            let want = floats(&reference, &format!("grad.{name}"));
            assert_close(&format!("{case} grad {name} (runtime)"), &ours, &want, 1e-3, 1e-6);
            assert_close(&format!("{case} grad {name} (in memory)"), &theirs, &want, 1e-3, 1e-6);
            checked += 1;
        }
    }
    let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(checked, expected, "{case}: every parameter's gradient is compared");

    push_fixture_grads_and_step(case, &mut rt, &model, &unit_ids, &reference, &step);
}

/// The BF16 run's logits, loss and every gradient against transformers' f32 ones, within the
/// BF16 bounds.
fn check_bf16(
    case: &str,
    model: &Llama,
    reference: &fixtures::Tensors,
    logits: &[f32],
    loss: f64,
    grads: &BTreeMap<usize, Vec<f32>>,
) {
    fixtures::assert_rel(
        &format!("{case} bf16 logits"),
        fixtures::rel_max_abs(logits, &floats(reference, "logits")),
        fixtures::BF16_LOGITS_RTOL,
    );
    let want = floats(reference, "loss")[0] as f64;
    fixtures::assert_rel(&format!("{case} bf16 loss"), (loss - want).abs() / want.abs(), fixtures::BF16_LOSS_RTOL);
    let checked = fixtures::assert_grads_rel(
        &format!("{case} bf16"),
        model,
        grads,
        |name| floats(reference, &format!("grad.{name}")),
        fixtures::BF16_GRAD_RTOL,
    );
    assert_eq!(checked, reference.keys().filter(|k| k.starts_with("grad.")).count());
}

/// One AdamW step from transformers' gradients (step.safetensors was made from them; from
/// ours, which differ in the last bits, a first Adam step `g / (|g| + eps)` moves tiny
/// gradients differently), through the pipelined optimizer with state on NVMe, checked by
/// [`fixtures::assert_adamw_step`].
fn push_fixture_grads_and_step(
    case: &str,
    rt: &mut Runtime,
    model: &Llama,
    unit_ids: &[UnitId],
    reference: &fixtures::Tensors,
    step: &fixtures::Tensors,
) {
    for (u, unit) in model.units().iter().enumerate().rev() {
        let mut flat = vec![0f32; unit.numel];
        for p in &unit.params {
            flat[p.offset..p.offset + p.numel()].copy_from_slice(&floats(reference, &format!("grad.{}", p.name)));
        }
        rt.push_grads_slice(unit_ids[u], oogc::optimizer::GradSlice::F32(&flat)).unwrap();
    }
    let stats = rt.finish_step().unwrap();
    assert!(!stats.figures.skipped && stats.figures.clip_scale == 1.0, "{stats:?}");
    fixtures::assert_adamw_step(case, rt, model, unit_ids, step);
    assert!(rt.memory().traffic().nvme_write.bytes > 0, "the optimizer state went through NVMe");
}

#[test]
fn llama_gqa_matches_transformers_through_the_offloaded_runtime() {
    through_the_runtime("llama_gqa", None);
}

/// The composed path with attention over query blocks of 5 (not dividing the fixture's T).
#[test]
fn llama_gqa_over_attention_blocks_matches_transformers_through_the_offloaded_runtime() {
    through_the_runtime("llama_gqa", Some(5));
}

#[test]
fn qwen2_tied_matches_transformers_through_the_offloaded_runtime() {
    through_the_runtime("qwen2_tied", None);
}

/// Qwen3 (`../shared/fixtures/moe/qwen3_dense`): the per-head q/k norm, fused and composed.
#[test]
fn qwen3_dense_matches_transformers_through_the_offloaded_runtime() {
    through_the_runtime("qwen3_dense", None);
    through_the_runtime("qwen3_dense", Some(5));
}

/// Qwen3 with BF16 compute copies over f32 masters, whole and over attention blocks of 5.
#[test]
fn qwen3_dense_in_bf16_matches_transformers_through_the_offloaded_runtime() {
    through_the_runtime_in("qwen3_dense", None, DType::BF16);
    through_the_runtime_in("qwen3_dense", Some(5), DType::BF16);
}

/// A run config that starts from the `case` checkpoint.
fn init_config(case: &Path, work: &Path) -> String {
    format!(
        r#"
[model]
family = "llama"
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
        init = case.display(),
        data = common::data_path().display(),
        tok = fixtures().join("tokenizer.json").display(),
        work = work.display(),
    )
}

#[test]
fn a_checkpoint_imported_then_exported_is_bitwise_the_input() {
    for case in ["llama_gqa", "qwen2_tied", "qwen3_dense"] {
        let work = tempfile::tempdir().unwrap();
        let cfg = oogc::config::TrainConfig::from_toml_str(&init_config(&case_dir(case), work.path())).unwrap();
        let mut t = oogc::train::Trainer::new(cfg, oogc::dist::Ranks::single()).unwrap();
        let saved = t.save_checkpoint().unwrap().expect("a checkpoint dir").path;
        drop(t);
        let out = work.path().join("hf");
        let e = oogc::export::export_hf(&saved, &out, &Default::default()).unwrap();
        assert_eq!(e.step, 0);
        let original = HfCheckpoint::open(&case_dir(case)).unwrap();
        let exported = HfCheckpoint::open(&out).unwrap();
        assert_eq!(original.tensors().keys().collect::<Vec<_>>(), exported.tensors().keys().collect::<Vec<_>>());
        for name in original.tensors().keys() {
            let (a, b) = (original.read_tensor(name).unwrap(), exported.read_tensor(name).unwrap());
            assert_eq!(a.0, b.0, "{case} {name}: shape");
            let (a, b): (Vec<u32>, Vec<u32>) =
                (a.1.iter().map(|x| x.to_bits()).collect(), b.1.iter().map(|x| x.to_bits()).collect());
            assert!(a == b, "{case} {name}: not bitwise equal");
        }
        // Each exported shard carries its checksums (`oogc inspect --verify` reads them too).
        for f in exported.files() {
            let bytes = std::fs::read(f).unwrap();
            let n = bytes.len();
            let tensors_in_file = exported.tensors().values().filter(|t| t.path == f).count();
            match oogc::checksum::verify_bytes(&bytes).unwrap() {
                oogc::checksum::Verification::Verified { tensors, .. } => {
                    assert_eq!(tensors, tensors_in_file, "{case} {f:?}")
                }
                v => panic!("{case} {f:?} ({n} bytes): {v:?}"),
            }
            assert!(matches!(oogc::checkpoint::verify(f), Ok(oogc::checksum::Verification::Verified { .. })));
        }
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            std::fs::read(fixtures().join("tokenizer.json")).unwrap()
        );
        assert_eq!(exported.llama_config().unwrap(), original.llama_config().unwrap(), "{case}: config.json");
    }
}

#[test]
fn an_unsupported_config_key_is_refused_by_name() {
    let work = tempfile::tempdir().unwrap();
    // A copy of llama_gqa whose config.json asks for YaRN RoPE scaling (not supported).
    let case = work.path().join("yarn");
    std::fs::create_dir_all(&case).unwrap();
    for entry in std::fs::read_dir(fixtures().join("llama_gqa")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, case.join(p.file_name().unwrap())).unwrap();
    }
    let config = case.join("config.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    json["rope_scaling"] =
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64});
    std::fs::write(&config, serde_json::to_vec(&json).unwrap()).unwrap();
    let cfg = oogc::config::TrainConfig::from_toml_str(&init_config(&case, work.path())).unwrap();
    let err = oogc::train::Trainer::new(cfg, oogc::dist::Ranks::single()).err().expect("refused").to_string();
    assert!(err.contains("rope_scaling") && err.contains("yarn"), "{err}");
    assert!(err.contains("config.json"), "{err}");
    // And an unknown [model] key of the run config, by name.
    let bad = init_config(&fixtures().join("llama_gqa"), work.path())
        .replace("family = \"llama\"", "family = \"llama\"\nhidden = 64");
    let err = oogc::config::TrainConfig::from_toml_str(&bad).unwrap_err().to_string();
    assert!(err.contains("hidden"), "{err}");
}
