//! Oracles from transformers (`shared/fixtures/llama`, see its README.md): logits, loss and
//! every gradient of two checkpoints loaded through [`HfCheckpoint`] and computed unit by unit;
//! export bitwise; `config.json` round trips, transformers 4 and 5 layouts, refusals by key;
//! checkpoint errors naming the tensor and file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use super::*;
use crate::lm::{loss_and_grads, CausalLm, IGNORE_INDEX};
use crate::shared_tests::{assert_fixture_grads_within, rel_max_abs, to_f32};
use crate::{Error, Llama, LlamaConfig, LlamaFamily, RopeScaling, UnitKind};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/llama")
}

/// A case's directory: `llama/<case>`, else `moe/<case>` (`shared/fixtures/moe`, README there).
fn case_dir(case: &str) -> PathBuf {
    let dirs = [fixtures().join(case), fixtures().join("../moe").join(case)];
    dirs.into_iter().find(|d| d.exists()).unwrap_or_else(|| panic!("no fixture `{case}` in llama/ or moe/"))
}

fn reference(dir: &Path) -> BTreeMap<String, NamedTensor> {
    read_tensors(&dir.join("reference.safetensors")).unwrap().into_iter().map(|t| (t.name.clone(), t)).collect()
}

/// `max |a − r| / (atol + rtol |r|)`: ≤ 1 within the tolerance.
fn tolerance_ratio(a: &[f32], r: &[f32], rtol: f64, atol: f64) -> (f64, f64) {
    assert_eq!(a.len(), r.len());
    let (mut worst, mut max_abs) = (0f64, 0f64);
    for (&a, &r) in a.iter().zip(r) {
        let err = (a as f64 - r as f64).abs();
        worst = worst.max(err / (atol + rtol * (r as f64).abs()));
        max_abs = max_abs.max(err);
    }
    (worst, max_abs)
}

fn ids_tensor(t: &NamedTensor, ignore: bool) -> Tensor {
    let v: Vec<u32> = t
        .as_i64()
        .unwrap()
        .iter()
        .map(|&x| {
            if x == -100 {
                assert!(ignore);
                IGNORE_INDEX
            } else {
                u32::try_from(x).unwrap()
            }
        })
        .collect();
    Tensor::from_vec(v, (t.shape[0], t.shape[1]), &Device::Cpu).unwrap()
}

fn load(dir: &Path) -> (HfCheckpoint, LlamaConfig, Vec<Vec<f32>>) {
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let cfg = ckpt.llama_config().unwrap();
    let units = cfg.units();
    ckpt.check_units(&units).unwrap();
    let flats = units.iter().map(|u| ckpt.read_unit(u).unwrap()).collect();
    (ckpt, cfg, flats)
}

/// The model loaded through the reader reproduces transformers' logits, loss and every
/// parameter's gradient, computed unit by unit (forward keeping each unit's input, the head's
/// loss backward, then each unit's backward by recomputation in reverse). `chunk`: the
/// composed attention's query positions per block (`None`: the default).
fn check_oracle(case: &str, composed: bool, chunk: Option<usize>) {
    let dir = case_dir(case);
    let (_, cfg, flats) = load(&dir);
    let mut model = Llama::new(cfg.clone()).unwrap().with_attention_chunk(chunk).unwrap();
    if composed {
        model = model.composed_only();
    }
    let r = reference(&dir);
    let tokens = ids_tensor(&r["input_ids"], false);
    let targets = ids_tensor(&r["labels"], true);
    assert!(targets.flatten_all().unwrap().to_vec1::<u32>().unwrap().contains(&IGNORE_INDEX));
    let params: Vec<Tensor> = flats.iter().map(|f| Tensor::from_slice(f, f.len(), &Device::Cpu).unwrap()).collect();

    let logits = crate::lm::forward_all(&model, &params, &tokens).unwrap();
    assert_eq!(logits.dims(), r["logits"].shape.as_slice());
    let got = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (ratio, abs) = tolerance_ratio(&got, r["logits"].as_f32().unwrap(), 1e-4, 1e-5);
    eprintln!("{case} composed={composed} chunk={chunk:?}: logits max |err| {abs:.2e}, {ratio:.3} of the tolerance");
    assert!(ratio <= 1.0, "{case}: logits off by {ratio} x the tolerance");

    let (loss, grads) = loss_and_grads(&model, &params, &tokens, &targets).unwrap();
    let want = r["loss"].as_f32().unwrap()[0] as f64;
    let loss_err = (loss - want).abs();
    eprintln!("{case} composed={composed} chunk={chunk:?}: loss {loss} vs {want}, |err| {loss_err:.2e}");
    assert!(loss_err <= 1e-5 + 1e-4 * want.abs(), "{case}: loss {loss} vs {want}");

    let (mut worst, mut worst_name, mut worst_abs, mut checked) = (0f64, String::new(), 0f64, 0);
    for (unit, g) in model.units().iter().zip(&grads) {
        let g = g.to_vec1::<f32>().unwrap();
        for p in &unit.params {
            let want = &r[&format!("grad.{}", p.name)];
            assert_eq!(want.shape, p.shape, "{}", p.name);
            let (ratio, abs) = tolerance_ratio(&g[p.offset..p.offset + p.numel()], want.as_f32().unwrap(), 1e-3, 1e-6);
            assert!(ratio <= 1.0, "{case}: gradient of {} off by {ratio} x the tolerance", p.name);
            if ratio > worst {
                (worst, worst_name) = (ratio, p.name.clone());
            }
            worst_abs = worst_abs.max(abs);
            checked += 1;
        }
    }
    let n_grads = r.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(checked, n_grads, "every reference gradient is a parameter of the model");
    eprintln!(
        "{case} composed={composed}: {checked} gradients, max |err| {worst_abs:.2e}, worst {worst:.3} of the tolerance \
         ({worst_name})"
    );
}

#[test]
fn llama_gqa_matches_transformers() {
    check_oracle("llama_gqa", false, None);
    check_oracle("llama_gqa", true, None);
    // Attention over query blocks of 5 (not dividing the fixture's T).
    check_oracle("llama_gqa", true, Some(5));
}

#[test]
fn qwen2_tied_matches_transformers() {
    check_oracle("qwen2_tied", false, None);
    check_oracle("qwen2_tied", true, None);
    check_oracle("qwen2_tied", true, Some(5));
}

/// Qwen3: the per-head q/k RMSNorm before RoPE, `head_dim` 32 ≠ hidden / heads = 16, GQA 4/2.
#[test]
fn qwen3_dense_matches_transformers() {
    check_oracle("qwen3_dense", false, None);
    check_oracle("qwen3_dense", true, None);
    check_oracle("qwen3_dense", true, Some(5));
}

// ---- BF16 against the f32 oracle -------------------------------------------------------------
//
// The checkpoints' parameters rounded to BF16 and run unit by unit (`loss_and_grads`) on the op
// compositions (BF16 always takes them: the op sequence of a CUDA device; the CPU multiplies
// through F32, as a GPU's BF16 GEMM accumulates in F32). BF16 keeps 8 significant bits: one
// rounding is off by at most 2^-9 ≈ 2e-3 relative (neighbours are 2^-8 ≈ 3.9e-3 apart). The
// parameters are rounded once, every matmul output, residual add, RoPE product, norm output and
// activation once more, and a gradient goes back through all of them across two layers: the
// errors are a few roundings' worth, mostly independent noise, so relative Frobenius errors of
// about 2^-9 · sqrt(#roundings) ~ 1e-2. Each bound is 3.5–27x what the fixtures run at (printed
// by the tests) and far below a real bug's error: a missing gradient is a relative error of 1,
// a wrong sign 2; the cross-entropy in BF16 puts the loss 12–13 % off (its sum over 1024 classes
// stalls in BF16). The F32 attention softmax, router softmax and embedding accumulation are too
// small an effect at these sizes (T = 24, each token once or twice): the tests named
// `bf16_*_in_f32` in `llama/tests.rs`, `gpt/tests.rs`, `gpt/moe_tests.rs`, `mixtral/tests.rs`
// check them.

/// Loss: relative error `|loss − ref| / ref`. Measured ≤ 3.7e-5.
const BF16_LOSS_RTOL: f64 = 1e-3;
/// Logits: `max |z − ref| / max |ref|`. Measured 7.3e-3 (Llama), 4.1e-3 (Qwen2).
const BF16_LOGITS_RTOL: f64 = 3e-2;
/// Gradients, per parameter tensor: `‖g − ref‖ / ‖ref‖` (Frobenius). Measured ≤ 1.4e-2 (a
/// `k_proj` bias).
const BF16_GRAD_RTOL: f64 = 5e-2;

/// The model in BF16 against transformers' f32 logits, loss and every gradient (bounds above).
fn check_oracle_bf16(case: &str, chunk: Option<usize>) {
    let dir = case_dir(case);
    let (_, cfg, flats) = load(&dir);
    let model = Llama::new(cfg).unwrap().composed_only().with_attention_chunk(chunk).unwrap();
    let r = reference(&dir);
    let tokens = ids_tensor(&r["input_ids"], false);
    let targets = ids_tensor(&r["labels"], true);
    let params: Vec<Tensor> = flats
        .iter()
        .map(|f| Tensor::from_slice(f, f.len(), &Device::Cpu).unwrap().to_dtype(candle_core::DType::BF16).unwrap())
        .collect();

    let logits = crate::lm::forward_all(&model, &params, &tokens).unwrap();
    assert_eq!(logits.dtype(), candle_core::DType::BF16);
    let q = rel_max_abs(&to_f32(&logits), r["logits"].as_f32().unwrap());
    eprintln!("{case} bf16: logits max |err| / max |ref| {q:.2e}");
    assert!(q <= BF16_LOGITS_RTOL, "{case} bf16: logits off by {q:.2e} of their range");

    let (loss, grads) = loss_and_grads(&model, &params, &tokens, &targets).unwrap();
    let want = r["loss"].as_f32().unwrap()[0] as f64;
    let q = (loss - want).abs() / want.abs();
    eprintln!("{case} bf16: loss {loss} vs {want}, relative error {q:.2e}");
    assert!(q <= BF16_LOSS_RTOL, "{case} bf16: loss {loss} vs {want}");

    assert_fixture_grads_within(&format!("{case} bf16"), model.units(), &grads, &r, BF16_GRAD_RTOL);
}

#[test]
fn llama_gqa_in_bf16_matches_transformers_f32() {
    check_oracle_bf16("llama_gqa", None);
    check_oracle_bf16("llama_gqa", Some(5));
}

#[test]
fn qwen2_tied_in_bf16_matches_transformers_f32() {
    check_oracle_bf16("qwen2_tied", None);
    check_oracle_bf16("qwen2_tied", Some(5));
}

#[test]
fn qwen3_dense_in_bf16_matches_transformers_f32() {
    check_oracle_bf16("qwen3_dense", None);
}

#[test]
fn fixture_configs_parse_as_described() {
    let (ckpt, cfg, _) = load(&fixtures().join("llama_gqa"));
    assert_eq!(ckpt.files().len(), 12);
    assert_eq!(cfg.family, LlamaFamily::Llama);
    assert_eq!((cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_heads()), (64, 2, 4, 2));
    assert_eq!((cfg.head_dim(), cfg.intermediate_size, cfg.vocab_size), (16, 176, 1024));
    assert_eq!((cfg.rms_norm_eps, cfg.rope_theta, cfg.tie_word_embeddings), (1e-5, 1e4, false));
    assert_eq!(cfg.num_params(), 223_552);
    let (ckpt, cfg, _) = load(&fixtures().join("qwen2_tied"));
    assert_eq!(ckpt.files().len(), 1);
    assert_eq!(cfg.family, LlamaFamily::Qwen2);
    assert!(cfg.qkv_bias() && !cfg.o_bias() && cfg.tie_word_embeddings);
    assert_eq!((cfg.rms_norm_eps, cfg.rope_theta), (1e-6, 1e6));
    assert_eq!(cfg.num_params(), 148_160);
    // The AdamW oracle reads with the same helper: one tensor per parameter, same shapes.
    for case in ["llama_gqa", "qwen2_tied"] {
        let dir = fixtures().join(case);
        let cfg = HfCheckpoint::open(&dir).unwrap().llama_config().unwrap();
        let step: BTreeMap<String, NamedTensor> =
            read_tensors(&dir.join("step.safetensors")).unwrap().into_iter().map(|t| (t.name.clone(), t)).collect();
        let params: Vec<_> = cfg.units().into_iter().flat_map(|u| u.params).collect();
        assert_eq!(step.len(), params.len());
        for p in params {
            assert_eq!(step[&p.name].shape, p.shape);
        }
    }
}

// ---- export ----------------------------------------------------------------------------------

/// Every tensor of every safetensors file of a checkpoint: name → (shape, dtype name, raw bytes).
fn raw_tensors(dir: &Path) -> BTreeMap<String, (Vec<usize>, String, Vec<u8>)> {
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let mut out = BTreeMap::new();
    for f in ckpt.files() {
        let bytes = std::fs::read(f).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            out.insert(name, (view.shape().to_vec(), format!("{:?}", view.dtype()), view.data().to_vec()));
        }
    }
    out
}

#[test]
fn export_of_a_loaded_checkpoint_is_bitwise_the_input() {
    for case in ["llama_gqa", "qwen2_tied", "qwen3_dense"] {
        let src = case_dir(case);
        let (ckpt, cfg, flats) = load(&src);
        let units = cfg.units();
        for max_shard_bytes in [5_000_000_000, 100_000] {
            let tmp = tempfile::tempdir().unwrap();
            let opts = WriteOptions { max_shard_bytes, ..WriteOptions::default() };
            let mut calls = 0;
            let written = write_checkpoint(tmp.path(), &cfg, ckpt.config_json(), &units, &opts, |u| {
                assert_eq!(u.index, calls, "units are produced in order, once");
                calls += 1;
                Ok(flats[u.index].clone())
            })
            .unwrap();
            assert_eq!(calls, units.len());
            assert_eq!(raw_tensors(tmp.path()), raw_tensors(&src), "{case} shard {max_shard_bytes}");
            // The layout transformers expects.
            let n = written.files.len();
            if max_shard_bytes == 100_000 {
                assert!(n > 1);
                let index: Value =
                    serde_json::from_str(&std::fs::read_to_string(tmp.path().join(INDEX_FILE)).unwrap()).unwrap();
                assert_eq!(index["metadata"]["total_size"], json!(cfg.num_params() * 4));
                assert_eq!(index["metadata"]["total_parameters"], json!(cfg.num_params()));
                let wm = index["weight_map"].as_object().unwrap();
                assert_eq!(wm.len(), units.iter().map(|u| u.params.len()).sum::<usize>());
                for (k, f) in written.files.iter().enumerate() {
                    let name = f.file_name().unwrap().to_str().unwrap();
                    assert_eq!(name, format!("model-{:05}-of-{n:05}.safetensors", k + 1));
                    // At most the shard size of data, unless a single larger tensor.
                    let in_shard: Vec<_> = wm.iter().filter(|(_, v)| v.as_str() == Some(name)).collect();
                    let data: usize = units
                        .iter()
                        .flat_map(|u| &u.params)
                        .filter(|p| in_shard.iter().any(|(k, _)| **k == p.name))
                        .map(|p| p.numel() * 4)
                        .sum();
                    assert!(data <= 100_000 || in_shard.len() == 1, "{name}: {data} bytes in {}", in_shard.len());
                }
                assert!(wm.values().all(|f| written.files.iter().any(|p| p.ends_with(f.as_str().unwrap()))));
            } else {
                assert_eq!(n, 1);
                assert!(written.index.is_none());
                assert!(!tmp.path().join(INDEX_FILE).exists());
            }
            // Headers: 8-byte aligned data, `format: pt`.
            for f in &written.files {
                let bytes = std::fs::read(f).unwrap();
                let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                assert_eq!((8 + n) % 8, 0);
                let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
                assert_eq!(header["__metadata__"]["format"], "pt");
            }
            // Read back: the same config, the same units.
            let (back, cfg2, flats2) = load(tmp.path());
            assert_eq!(cfg2, cfg);
            assert_eq!(flats2, flats);
            // Keys that are not the model's are carried (token ids, use_cache).
            assert_eq!(back.config_json().get("use_cache"), Some(&json!(true)));
            assert!(!back.config_json().contains_key("transformers_version"));
        }
    }
}

#[test]
fn exporting_again_with_fewer_shards_removes_the_old_ones() {
    let (_, cfg, flats) = load(&fixtures().join("llama_gqa"));
    let units = cfg.units();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("README.md"), "kept").unwrap();
    let small = WriteOptions { max_shard_bytes: 50_000, ..WriteOptions::default() };
    write_checkpoint(tmp.path(), &cfg, &Default::default(), &units, &small, |u| Ok(flats[u.index].clone())).unwrap();
    let w = write_checkpoint(tmp.path(), &cfg, &Default::default(), &units, &WriteOptions::default(), |u| {
        Ok(flats[u.index].clone())
    })
    .unwrap();
    let mut names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["README.md", "config.json", "model.safetensors"]);
    assert_eq!(w.files.len(), 1);
    // A failing callback leaves no partial file behind and the old export intact.
    let err = write_checkpoint(tmp.path(), &cfg, &Default::default(), &units, &small, |u| {
        if u.index == 2 {
            Err(crate::ops::input_err("test", "x".into(), "y".into()))
        } else {
            Ok(flats[u.index].clone())
        }
    });
    assert!(err.is_err());
    let mut after: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    after.sort();
    assert_eq!(after, names);
}

#[test]
fn bf16_export_rounds_to_nearest_even() {
    let (_, cfg, flats) = load(&fixtures().join("qwen2_tied"));
    let units = cfg.units();
    let tmp = tempfile::tempdir().unwrap();
    let opts = WriteOptions { dtype: HfDtype::BF16, ..WriteOptions::default() };
    write_checkpoint(tmp.path(), &cfg, &Default::default(), &units, &opts, |u| Ok(flats[u.index].clone())).unwrap();
    let back = HfCheckpoint::open(tmp.path()).unwrap();
    assert_eq!(back.config_json()["dtype"], "bfloat16");
    assert!(back.tensors().values().all(|t| t.dtype == HfDtype::BF16));
    for (u, f) in units.iter().zip(&flats) {
        let want: Vec<f32> = f.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
        assert_eq!(back.read_unit(u).unwrap(), want);
    }
}

// ---- checksums ---------------------------------------------------------------------------------

/// `llama_gqa` exported in `dir` with shards of at most `max_shard_bytes`.
fn export_gqa(dir: &Path, max_shard_bytes: u64) -> (LlamaConfig, Vec<Vec<f32>>, WrittenCheckpoint) {
    let (ckpt, cfg, flats) = load(&fixtures().join("llama_gqa"));
    let opts = WriteOptions { max_shard_bytes, ..WriteOptions::default() };
    let w =
        write_checkpoint(dir, &cfg, ckpt.config_json(), &cfg.units(), &opts, |u| Ok(flats[u.index].clone())).unwrap();
    (cfg, flats, w)
}

/// A safetensors file's header: (data start, header JSON).
fn header(bytes: &[u8]) -> (usize, Value) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (8 + n, serde_json::from_slice(&bytes[8..8 + n]).unwrap())
}

#[test]
fn an_export_verifies_and_a_hub_checkpoint_loads_unverified() {
    use crate::checksum::{verify_bytes, Verification};
    for dtype in [HfDtype::F32, HfDtype::BF16] {
        let tmp = tempfile::tempdir().unwrap();
        let (ckpt, cfg, flats) = load(&fixtures().join("llama_gqa"));
        let opts = WriteOptions { max_shard_bytes: 100_000, dtype };
        let w =
            write_checkpoint(tmp.path(), &cfg, ckpt.config_json(), &cfg.units(), &opts, |u| Ok(flats[u.index].clone()))
                .unwrap();
        assert!(w.files.len() > 1);
        let mut tensors = 0;
        for f in &w.files {
            let bytes = std::fs::read(f).unwrap();
            let (_, h) = header(&bytes);
            let n = h.as_object().unwrap().len() - 1;
            assert_eq!(h["__metadata__"]["format"], "pt");
            match verify_bytes(&bytes).unwrap() {
                Verification::Verified { tensors: t, .. } => assert_eq!(t, n, "{f:?}"),
                Verification::Unverified => panic!("{f:?} has no checksums"),
            }
            tensors += n;
        }
        assert_eq!(tensors, cfg.units().iter().map(|u| u.params.len()).sum::<usize>());
        // And it reads back through the verifying reader.
        let (_, _, back) = load(tmp.path());
        assert_eq!(back.len(), flats.len());
    }
    // The fixtures (written by transformers) carry no checksums: they load, unverified.
    let hub = HfCheckpoint::open(&fixtures().join("llama_gqa")).unwrap();
    for f in hub.files() {
        assert_eq!(verify_bytes(&std::fs::read(f).unwrap()).unwrap(), Verification::Unverified);
    }
}

#[test]
fn a_flipped_data_byte_fails_the_read_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, flats, w) = export_gqa(tmp.path(), 5_000_000_000);
    let path = &w.files[0];
    let mut bytes = std::fs::read(path).unwrap();
    let (data_start, h) = header(&bytes);
    let victim = "model.layers.1.mlp.up_proj.weight";
    let [s, e] = [0, 1].map(|i| h[victim]["data_offsets"][i].as_u64().unwrap() as usize);
    bytes[data_start + (s + e) / 2] ^= 0x04;
    std::fs::write(path, &bytes).unwrap();
    // The header is intact: it opens.
    let ckpt = HfCheckpoint::open(tmp.path()).unwrap();
    for (u, flat) in cfg.units().iter().zip(&flats) {
        let holds = u.params.iter().any(|p| p.name == victim);
        match ckpt.read_unit(u) {
            Ok(got) => {
                assert!(!holds, "unit {} read despite the corrupt tensor", u.name);
                assert_eq!(&got, flat);
            }
            Err(Error::HfTensor { path: p, tensor, reason }) => {
                assert!(holds, "unit {}: {reason}", u.name);
                assert_eq!((&p, tensor.as_str()), (path, victim));
                assert!(reason.contains("crc32c") && reason.contains("corrupt"), "{reason}");
            }
            Err(other) => panic!("{other}"),
        }
    }
    let err = ckpt.read_tensor(victim).unwrap_err().to_string();
    assert!(err.contains(victim) && err.contains("re-export or re-download"), "{err}");
    assert!(ckpt.read_tensor("model.norm.weight").is_ok());
}

#[test]
fn a_flipped_checksum_in_the_header_fails_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, _, w) = export_gqa(tmp.path(), 100_000);
    let path = &w.files[1];
    let good = std::fs::read(path).unwrap();
    let (data_start, h) = header(&good);
    let name = h.as_object().unwrap().keys().find(|k| *k != "__metadata__").unwrap().clone();
    for key in [format!("oogc.crc32c:{name}"), "oogc.crc32c".to_string()] {
        // One hex digit of the stored value changed to another (the JSON stays valid).
        let needle = format!("\"{key}\":\"");
        let at = good[..data_start].windows(needle.len()).position(|w| w == needle.as_bytes()).unwrap() + needle.len();
        let mut bad = good.clone();
        bad[at] = if bad[at] == b'0' { b'1' } else { b'0' };
        std::fs::write(path, &bad).unwrap();
        match HfCheckpoint::open(tmp.path()) {
            Err(Error::HfFile { path: p, reason }) => {
                assert_eq!(&p, path);
                assert!(reason.contains("crc32c") && reason.contains("corrupt"), "{key}: {reason}");
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    std::fs::write(path, &good).unwrap();
    assert!(HfCheckpoint::open(tmp.path()).is_ok());
}

// ---- config.json -----------------------------------------------------------------------------

fn fixture_config(case: &str) -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(case_dir(case).join("config.json")).unwrap();
    serde_json::from_str::<Value>(&text).unwrap().as_object().unwrap().clone()
}

fn parse(map: &serde_json::Map<String, Value>) -> crate::Result<LlamaConfig> {
    parse_config(&Value::Object(map.clone()).to_string(), Path::new("config.json"))
}

/// transformers 5's `rope_parameters` rewritten as transformers 4 writes it.
fn to_v4(map: &serde_json::Map<String, Value>) -> serde_json::Map<String, Value> {
    let mut m = map.clone();
    let mut params = m.remove("rope_parameters").unwrap().as_object().unwrap().clone();
    m.insert("rope_theta".into(), params.remove("rope_theta").unwrap());
    let scaling = if params.get("rope_type") == Some(&json!("default")) { Value::Null } else { Value::Object(params) };
    m.insert("rope_scaling".into(), scaling);
    m
}

#[test]
fn transformers_4_and_5_configs_parse_to_the_same_config() {
    for case in ["llama_gqa", "qwen2_tied"] {
        let v5 = fixture_config(case);
        let v4 = to_v4(&v5);
        assert!(v4.contains_key("rope_theta") && !v4.contains_key("rope_parameters"));
        assert_eq!(parse(&v4).unwrap(), parse(&v5).unwrap(), "{case}");
    }
    // Llama 3.1-style scaling, both layouts; and the old `type` key of transformers 4.
    let mut v5 = fixture_config("llama_gqa");
    v5.insert(
        "rope_parameters".into(),
        json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    );
    let v4 = to_v4(&v5);
    let c = parse(&v5).unwrap();
    assert_eq!(parse(&v4).unwrap(), c);
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    let mut old = to_v4(&fixture_config("llama_gqa"));
    old.insert("rope_scaling".into(), json!({"type": "linear", "factor": 2.0}));
    assert_eq!(parse(&old).unwrap().rope_scaling, RopeScaling::Linear { factor: 2.0 });
}

#[test]
fn config_json_written_then_read_is_the_same_config() {
    let mut configs: Vec<LlamaConfig> =
        ["llama_gqa", "qwen2_tied", "qwen3_dense"].iter().map(|c| parse(&fixture_config(c)).unwrap()).collect();
    // Qwen3's attention_bias covers q/k/v and o, as Llama's.
    configs.push(LlamaConfig {
        family: LlamaFamily::Qwen3,
        head_dim: Some(48),
        attention_bias: Some(true),
        ..LlamaConfig::new(1024, 128, 300, 2, 4)
    });
    configs.push(LlamaConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
        rope_theta: 500000.0,
        num_key_value_heads: Some(2),
        tie_word_embeddings: true,
        attention_bias: Some(true),
        mlp_bias: true,
        ..LlamaConfig::new(1024, 256, 688, 4, 8)
    });
    configs.push(LlamaConfig {
        family: LlamaFamily::Mistral,
        rope_scaling: RopeScaling::Linear { factor: 4.0 },
        ..LlamaConfig::new(1024, 128, 300, 2, 4)
    });
    for c in configs {
        let v = config_json(&c, "float32", &Default::default());
        let back = parse(v.as_object().unwrap()).unwrap();
        assert_eq!(back, c.resolved());
        // And through a file.
        let tmp = tempfile::tempdir().unwrap();
        let path = write_config(tmp.path(), &c, HfDtype::F32, &Default::default()).unwrap();
        assert_eq!(read_config(&path).unwrap(), c.resolved());
    }
}

/// Parses `map` with `edit` applied and expects an [`Error::HfConfig`] naming `key`.
fn refused(case: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>), key: &str) -> String {
    let mut m = fixture_config(case);
    edit(&mut m);
    match parse(&m) {
        Err(e @ Error::HfConfig { .. }) => {
            let Error::HfConfig { key: k, .. } = &e else { unreachable!() };
            assert_eq!(k, key, "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{key}`")) && msg.contains("config.json"), "{msg}");
            msg
        }
        other => panic!("expected a config error on {key}, got {other:?}"),
    }
}

#[test]
fn unsupported_options_are_refused_by_name() {
    let msg = refused(
        "llama_gqa",
        |m| {
            m.insert("model_type".into(), json!("mistral"));
            m.insert("architectures".into(), json!(["MistralForCausalLM"]));
            m.insert("sliding_window".into(), json!(4096));
        },
        "sliding_window",
    );
    assert!(msg.contains("null"), "{msg}");
    // Absent means transformers' default of 4096 for Mistral.
    refused(
        "llama_gqa",
        |m| {
            m.insert("model_type".into(), json!("mistral"));
            m.insert("architectures".into(), json!(["MistralForCausalLM"]));
        },
        "sliding_window",
    );
    refused("qwen2_tied", |m| drop(m.insert("use_sliding_window".into(), json!(true))), "use_sliding_window");
    refused(
        "qwen2_tied",
        |m| drop(m.insert("layer_types".into(), json!(["full_attention", "sliding_attention"]))),
        "layer_types",
    );
    let msg = refused(
        "llama_gqa",
        |m| {
            *m = to_v4(m);
            m.insert("rope_scaling".into(), json!({"rope_type": "yarn", "factor": 4.0}));
        },
        "rope_scaling.rope_type",
    );
    assert!(msg.contains("yarn"), "{msg}");
    refused(
        "llama_gqa",
        |m| drop(m.insert("rope_parameters".into(), json!({"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}))),
        "rope_parameters.rope_type",
    );
    refused(
        "llama_gqa",
        |m| drop(m.insert("rope_parameters".into(), json!({"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}))),
        "rope_parameters.low_freq_factor",
    );
    refused(
        "llama_gqa",
        |m| drop(m.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": 2.0}))),
        "rope_scaling",
    );
    refused("llama_gqa", |m| drop(m.insert("rope_theta".into(), json!(5e5))), "rope_theta");
    // Mixtral is supported (mixtral/tests.rs), but not its router's jitter noise.
    refused("mixtral_moe", |m| drop(m.insert("router_jitter_noise".into(), json!(0.1))), "router_jitter_noise");
    refused("qwen3_dense", |m| drop(m.insert("use_sliding_window".into(), json!(true))), "use_sliding_window");
    refused(
        "qwen3_dense",
        |m| drop(m.insert("layer_types".into(), json!(["sliding_attention", "full_attention"]))),
        "layer_types",
    );
    let msg = refused("llama_gqa", |m| drop(m.insert("model_type".into(), json!("deepseek_v3"))), "model_type");
    assert!(msg.contains("qwen3_moe") && msg.contains("supported"), "{msg}");
    // The fine-grained MoE families are supported (mixtral/tests.rs), but not every option of
    // the MoE configs: each refused by its key, with the value that is supported.
    for (case, key, v, fix) in [
        // Qwen3-MoE and Qwen2-MoE take dense layers among sparse ones (below); OLMoE has none.
        ("olmoe", "decoder_sparse_step", json!(2), "set it to 1"),
        ("olmoe", "mlp_only_layers", json!([0]), "set it to []"),
        ("qwen3_moe", "mlp_only_layers", json!([0, 1]), "keep at least one MoE layer"),
        ("qwen2_moe", "decoder_sparse_step", json!(3), "keep at least one MoE layer"),
        ("qwen2_moe", "decoder_sparse_step", json!(0), "at least 1"),
        ("qwen3_moe", "mlp_only_layers", json!([2]), "names layer 2"),
        ("qwen3_moe", "mlp_only_layers", json!("1"), "a list of layer indices"),
        ("qwen3_moe", "mlp_only_layers", json!([-1]), "a list of layer indices"),
        ("qwen3_moe", "router_bias", json!(true), "set it to false"),
        ("olmoe", "scoring_func", json!("sigmoid"), "softmax"),
        ("qwen3_moe", "n_group", json!(8), "set it to 1"),
        ("qwen2_moe", "topk_group", json!(4), "set it to 1"),
        ("qwen3_moe", "kv_lora_rank", json!(512), "set it to null"),
        ("olmoe", "clip_qkv", json!(8.0), "set it to null"),
        ("qwen3_moe", "num_experts", json!(16), "keep one"),
    ] {
        let msg = refused(case, |m| drop(m.insert(key.into(), v)), key);
        assert!(msg.contains(fix), "{case} {key}: {msg}");
    }
    refused("llama_gqa", |m| drop(m.insert("model_type".into(), json!("gemma"))), "model_type");
    refused(
        "llama_gqa",
        |m| drop(m.insert("architectures".into(), json!(["LlamaForSequenceClassification"]))),
        "architectures",
    );
    refused("llama_gqa", |m| drop(m.insert("hidden_act".into(), json!("gelu"))), "hidden_act");
    refused("llama_gqa", |m| drop(m.insert("attention_dropout".into(), json!(0.1))), "attention_dropout");
    refused("llama_gqa", |m| drop(m.insert("partial_rotary_factor".into(), json!(0.5))), "partial_rotary_factor");
    refused(
        "llama_gqa",
        |m| drop(m.insert("quantization_config".into(), json!({"quant_method": "gptq"}))),
        "quantization_config",
    );
    refused("llama_gqa", |m| drop(m.remove("hidden_size")), "hidden_size");
    refused("llama_gqa", |m| drop(m.insert("hidden_size".into(), json!("64"))), "hidden_size");
    refused("llama_gqa", |m| drop(m.insert("num_key_value_heads".into(), json!(3))), "num_key_value_heads");
    // Harmless unknown keys are ignored; model_type alone (no architectures) is enough.
    let mut m = fixture_config("llama_gqa");
    m.insert("some_future_key".into(), json!({"a": 1}));
    m.remove("architectures");
    assert_eq!(parse(&m).unwrap(), parse(&fixture_config("llama_gqa")).unwrap());
    match parse_config("{not json", Path::new("x/config.json")) {
        Err(Error::HfConfig { key, .. }) => assert_eq!(key, "<json>"),
        other => panic!("{other:?}"),
    }
}

// ---- checkpoint errors -------------------------------------------------------------------------

fn tensor_error(r: crate::Result<()>) -> (PathBuf, String, String) {
    match r {
        Err(Error::HfTensor { path, tensor, reason }) => (path, tensor, reason),
        other => panic!("expected a tensor error, got {other:?}"),
    }
}

#[test]
fn missing_extra_and_misshapen_tensors_name_the_tensor_and_file() {
    let gqa = HfCheckpoint::open(&fixtures().join("llama_gqa")).unwrap();
    let cfg = gqa.llama_config().unwrap();
    // Tied config on an untied checkpoint: lm_head.weight is unexpected.
    let tied = LlamaConfig { tie_word_embeddings: true, ..cfg.clone() };
    let (path, tensor, reason) = tensor_error(gqa.check_units(&tied.units()));
    assert_eq!(tensor, "lm_head.weight");
    assert!(path.ends_with("model-00011-of-00012.safetensors"), "{path:?}");
    assert!(reason.contains("tie_word_embeddings"), "{reason}");
    // Untied config on a tied checkpoint: lm_head.weight is missing.
    let qwen = HfCheckpoint::open(&fixtures().join("qwen2_tied")).unwrap();
    let untied = LlamaConfig { tie_word_embeddings: false, ..qwen.llama_config().unwrap() };
    let (_, tensor, reason) = tensor_error(qwen.check_units(&untied.units()));
    assert_eq!(tensor, "lm_head.weight");
    assert!(reason.contains("missing"), "{reason}");
    // Another intermediate size: the first MLP tensor of layer 0, in its shard.
    let wider = LlamaConfig { intermediate_size: 177, ..cfg.clone() };
    let (path, tensor, reason) = tensor_error(gqa.check_units(&wider.units()));
    assert_eq!(tensor, "model.layers.0.mlp.gate_proj.weight");
    assert!(path.ends_with("model-00003-of-00012.safetensors"), "{path:?}");
    assert!(reason.contains("[176, 64]") && reason.contains("[177, 64]"), "{reason}");
    let err = gqa.read_unit(&wider.units()[1]).unwrap_err();
    assert!(err.to_string().contains("model.layers.0.mlp.gate_proj.weight"), "{err}");
    // One layer fewer: layer 1's tensors are unexpected.
    let shallow = LlamaConfig { num_hidden_layers: 1, ..cfg.clone() };
    let (_, tensor, _) = tensor_error(gqa.check_units(&shallow.units()));
    assert!(tensor.starts_with("model.layers.1."), "{tensor}");
}

#[test]
fn broken_checkpoint_files_are_errors_naming_the_file() {
    let src = fixtures().join("llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    // A shard the index names is gone.
    let shard = tmp.path().join("model-00007-of-00012.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::remove_file(&shard).unwrap();
    match HfCheckpoint::open(tmp.path()) {
        Err(Error::Io { path, .. }) => assert_eq!(path, shard),
        other => panic!("{other:?}"),
    }
    // A truncated shard.
    std::fs::write(&shard, &bytes[..bytes.len() - 4]).unwrap();
    match HfCheckpoint::open(tmp.path()) {
        Err(Error::HfFile { path, reason }) => {
            assert_eq!(path, shard);
            assert!(reason.contains("safetensors"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(&shard, &bytes).unwrap();
    // The index maps a tensor to a shard that does not hold it.
    let index_path = tmp.path().join(INDEX_FILE);
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["model.norm.weight"] = json!("model-00001-of-00012.safetensors");
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = HfCheckpoint::open(tmp.path()).unwrap_err();
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
    // No weights at all.
    let empty = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), empty.path().join("config.json")).unwrap();
    match HfCheckpoint::open(empty.path()) {
        Err(Error::HfFile { reason, .. }) => assert!(reason.contains("model.safetensors"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn read_tensors_converts_each_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.safetensors");
    let f32s: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let bf16s: Vec<u8> = [0.25f32, 3.0].iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect();
    let f16s: Vec<u8> = [0.5f32].iter().flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()).collect();
    let i64s: Vec<u8> = [-100i64, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let views = vec![
        ("a", TensorView::new(Dtype::F32, vec![2], &f32s).unwrap()),
        ("b", TensorView::new(Dtype::BF16, vec![1, 2], &bf16s).unwrap()),
        ("c", TensorView::new(Dtype::F16, vec![], &f16s).unwrap()),
        ("d", TensorView::new(Dtype::I64, vec![2], &i64s).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let t: BTreeMap<String, NamedTensor> =
        read_tensors(&path).unwrap().into_iter().map(|t| (t.name.clone(), t)).collect();
    assert_eq!(t["a"].as_f32().unwrap(), [1.5, -2.0]);
    assert_eq!((t["b"].shape.as_slice(), t["b"].as_f32().unwrap()), ([1, 2].as_slice(), [0.25, 3.0].as_slice()));
    assert_eq!((t["c"].shape.len(), t["c"].as_f32().unwrap()), (0, [0.5].as_slice()));
    assert_eq!(t["d"].as_i64().unwrap(), [-100, 7]);
    assert!(t["d"].as_f32().is_none());
}

/// Qwen3-MoE's and Qwen2-MoE's dense layers among the sparse ones (`decoder_sparse_step`,
/// `mlp_only_layers`): transformers' rule per layer, a dense unit of the MLP's width for each
/// dense layer (Qwen2-MoE's without a shared expert), and `config.json` written back with them.
#[test]
fn dense_layers_among_sparse_ones_parse_lay_out_and_write_back() {
    let mut m = fixture_config("qwen3_moe");
    m.insert("num_hidden_layers".into(), json!(4));
    m.insert("mlp_only_layers".into(), json!([2]));
    m.insert("decoder_sparse_step".into(), json!(2));
    let c = parse(&m).unwrap();
    // (i + 1) % 2 == 0 and i not in [2]: layer 1 and 3, but 2 is not a multiple anyway.
    let sparse: Vec<bool> = (0..4).map(|l| c.is_sparse_layer(l)).collect();
    assert_eq!(sparse, [false, true, false, true]);
    assert_eq!(c.sparse_layers(), [1, 3]);
    let units = c.units();
    assert_eq!(units.len(), c.num_units());
    assert_eq!(units.len(), 4 + 2 * 8 + 2);
    for l in 0..4 {
        let u = &units[c.block_unit(l)];
        assert_eq!(u.name, format!("model.layers.{l}"));
        if sparse[l] {
            assert_eq!(u.kind, UnitKind::MoeTrunk(l));
            assert_eq!(units[c.expert_unit(l, 7)].kind, UnitKind::Expert { block: l, expert: 7 });
        } else {
            assert_eq!(u.kind, UnitKind::Block(l));
            let names: Vec<&str> = u.params.iter().map(|p| p.name.as_str()).collect();
            assert!(names.contains(&format!("model.layers.{l}.mlp.down_proj.weight").as_str()), "{names:?}");
            assert!(!names.iter().any(|n| n.contains("gate.weight") || n.contains("experts")), "{names:?}");
            let down = u.params.iter().find(|p| p.name.ends_with("mlp.down_proj.weight")).unwrap();
            assert_eq!(down.shape, vec![c.hidden_size, c.intermediate_size]);
        }
    }
    let back = parse(config_json(&c, "float32", &Default::default()).as_object().unwrap()).unwrap();
    assert_eq!(back, c);
    let written = config_json(&c, "float32", &Default::default());
    assert_eq!((written["decoder_sparse_step"].clone(), written["mlp_only_layers"].clone()), (json!(2), json!([2])));
    // The defaults are the all-sparse model, as before.
    let all = parse(&fixture_config("qwen3_moe")).unwrap();
    assert_eq!((all.decoder_sparse_step, all.mlp_only_layers.clone()), (None, None));
    assert_eq!(all.sparse_layers(), (0..all.num_hidden_layers).collect::<Vec<_>>());

    // Qwen2-MoE: a dense layer has no shared expert.
    let mut m = fixture_config("qwen2_moe");
    m.insert("mlp_only_layers".into(), json!([0]));
    let c = parse(&m).unwrap();
    let dense = &c.units()[c.block_unit(0)];
    assert_eq!(dense.kind, UnitKind::Block(0));
    assert!(!dense.params.iter().any(|p| p.name.contains("shared_expert")), "{:?}", dense.params);
    let trunk = &c.units()[c.block_unit(1)];
    assert!(trunk.params.iter().any(|p| p.name.contains("shared_expert_gate")));
}
