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
use crate::mixtral::{self, Case, Place};

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use oogc::models::hf::HfCheckpoint;
use oogc::models::{CausalLm, UnitKind};

/// A case of `tests/fixtures/dense_among_sparse/`.
fn case(name: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures/dense_among_sparse").join(name)
}

/// The mixed placement of expert `e` of layer `layer`.
fn mixed(layer: usize, e: usize) -> Place {
    [Place::Resident, Place::Fetch, Place::Cpu][(layer + e) % 3]
}

/// One training step of the case in `dir` through an offloaded `Runtime`, experts where
/// `place(layer, expert)` says, checked against the fixture
/// ([`mixtral::check_through_the_runtime`], whose pass runs dense layers as block units), after
/// the units' layout: one dense unit per dense layer, a trunk and experts per sparse layer, and
/// the MoE calls refusing a dense layer.
fn through_the_runtime(dir: &Path, label: &str, place: impl Fn(usize, usize) -> Place) {
    let case = Case::open(dir, None);
    let (model, cfg) = (&case.model, case.model.config());
    let moe = model.moe().expect("an MoE model");
    let units = model.units();
    let (layers, experts) = (cfg.num_hidden_layers, cfg.num_experts());
    let sparse = cfg.sparse_layers();
    assert!(!sparse.is_empty() && sparse.len() < layers, "{label}: dense layers among sparse ones");
    let dense_units = units.iter().filter(|u| matches!(u.kind, UnitKind::Block(_))).count();
    assert_eq!(dense_units, layers - sparse.len(), "{label}: one dense unit per dense layer");
    for l in 0..layers {
        let u = cfg.block_unit(l);
        if cfg.is_sparse_layer(l) {
            assert_eq!(units[u].kind, UnitKind::MoeTrunk(l), "{label}: layer {l}'s trunk");
            for e in 0..experts {
                assert_eq!(units[cfg.expert_unit(l, e)].kind, UnitKind::Expert { block: l, expert: e });
            }
        } else {
            assert_eq!(units[u].kind, UnitKind::Block(l), "{label}: layer {l} is a dense unit");
            let zeros = Tensor::zeros(units[u].numel, candle_core::DType::F32, &Device::Cpu).unwrap();
            let x = Tensor::zeros((1, 1, cfg.hidden_size), candle_core::DType::F32, &Device::Cpu).unwrap();
            let err = moe.trunk_forward(l, &zeros, &x).unwrap_err().to_string();
            assert!(err.contains("a dense layer"), "{label}: the MoE calls refuse dense layer {l}: {err}");
        }
    }
    mixtral::check_through_the_runtime(&case, label, place);
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
