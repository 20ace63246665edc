//! The MoE fixtures in BF16 **through the `Runtime`** (BF16 compute copies over f32 masters,
//! optimizer state on NVMe, experts resident, fetched and on the CPU in one step) against
//! transformers' f32 numbers (`../shared/fixtures/moe/` and `llama/mixtral_moe`, READMEs there),
//! within the BF16 bounds of the in-memory checks (`fixtures::BF16_*`).
//!
//! **The routing.** BF16 moves a router logit by up to a few BF16 spacings, so a row whose k-th
//! and (k+1)-th experts are nearly tied in f32 may pick the other one in BF16 — and its block
//! output, every later position of its sequence (attention) and every gradient are then another
//! routing's, not a rounding of the oracle's: no bound on rounding error covers them. So:
//!
//! 1. The routing itself: the rows whose BF16 top-k (as a set) differs from the top-k of
//!    transformers' router logits must be few (at most 1 in [`ROWS_PER_DIFFERENCE`] of a case's
//!    rows) and each a near tie in the oracle: its gap between the k-th and (k+1)-th router
//!    logit at most [`TIE_SIGMAS`] times σ, the rms error of the BF16 run's router logits in
//!    that layer. A row routes differently only if the two logits' errors differ by more than
//!    its gap, and their difference has an rms of √2 σ: a gap of 4 σ is 2.8 of those, which
//!    rounding almost never reaches, while a routing bug moves rows of any gap (the fixtures'
//!    median gap is 30–80 σ).
//! 2. A second oracle for what every row touches (the loss, the load-balancing loss, every
//!    gradient): our own f32 path routed to the BF16 run's choices (routing replay,
//!    `Llama::trunk_forward_routed`), which is transformers' computation where the routings
//!    agree — checked: its logits within f32's 1e-4 of transformers' on every row that no
//!    differing routing reaches (a differing row and the later rows of its sequence excepted), and
//!    with no differing row at all its loss and gradients within 1e-4 / 1e-3 of transformers'.
//!    The BF16 run is held to this oracle within the BF16 bounds: router logits, logits, the
//!    three losses, every gradient.
//! 3. Transformers' f32 numbers directly: the router logits, and the logits of every row no
//!    differing routing reaches, within the BF16 bound.
//!
//! And the runtime's numbers are bitwise the in-memory loop's over the masters rounded to BF16
//! (`oogc_models::loss_parts_and_grads`): the placements move bytes, not values. One AdamW step
//! from transformers' gradients: masters within `fixtures::assert_adamw_step`'s bound, the
//! compute copies the masters rounded to BF16 bit for bit.
//!
//! Measured (mixed placements): one differing row in all four cases — Qwen3-MoE's layer 0 row
//! 10, whose oracle gap (1.9e-3) is the smallest of its 96 (median 4.6e-2), reaching 14 of the
//! 48 positions; against the replayed oracle the logits are off by ≤ 9.8e-3 of their range, the
//! losses by ≤ 5.6e-5, the gradients by ≤ 2.0e-2 (Qwen3-MoE's `k_norm`); the AdamW step within
//! 0.60–0.73 of its bound.

use crate::fixtures;
use crate::mixtral::{moe_case, Case, Params, Pass, Place};

use std::path::Path;

use oogc::runtime::Phase;
use oogc::swapper::DType;

use fixtures::{assert_close, f32s, floats, ids, rel_max_abs};

/// A row's routing may differ from the oracle's only if its oracle gap between the k-th and
/// (k+1)-th router logit is at most this many times the rms error of the layer's BF16 router
/// logits. Measured: 2.2 (Qwen3-MoE, layer 0 row 10: gap 1.9e-3, σ 8.9e-4); a test-only
/// perturbation computing the router's logits in f32 moved OLMoE's layer 0 row 29 instead (gap
/// 2.9e-3, σ 9.5e-4: 3.1); one that swapped a row's k-th and (k+1)-th choice every 16 rows was
/// refused at gaps of 1.1e-2 to 6.7e-2 (≥ 11 σ).
const TIE_SIGMAS: f64 = 4.0;

/// At most one row in this many may route differently from the oracle.
const ROWS_PER_DIFFERENCE: usize = 32;

/// The experts of each row of `logits` `[rows, E]` chosen by top-`k` (softmax is monotone; ties
/// to the lower index), sorted (the order does not change the block's output); and each row's
/// gap between its k-th and (k+1)-th logit.
fn top_k_sets(logits: &[f32], e: usize, k: usize) -> Vec<(Vec<u32>, f32)> {
    logits
        .chunks_exact(e)
        .map(|row| {
            let mut idx: Vec<u32> = (0..e as u32).collect();
            idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            let gap = row[idx[k - 1] as usize] - row[idx[k] as usize];
            let mut set = idx[..k].to_vec();
            set.sort();
            (set, gap)
        })
        .collect()
}

/// The BF16 run of the fixture case in `dir` through the runtime, experts where `place` says,
/// checked as the module's doc says.
fn bf16_through_the_runtime(dir: &Path, label: &str, place: impl Fn(usize, usize) -> Place) {
    let case = Case::open(dir, None);
    let nvme = tempfile::tempdir().unwrap();
    let (mut rt, unit_ids) = case.runtime(DType::BF16, nvme.path(), &place);
    let bf16 = case.runtime_pass(&mut rt, &unit_ids, &place);
    let (model, r) = (&case.model, &case.reference);
    let cfg = model.config();
    let (layers, e, k) = (cfg.num_hidden_layers, cfg.num_experts(), cfg.top_k());
    let (tokens, targets) = (ids(r, "input_ids"), ids(r, "labels"));
    let (batch, seq) = tokens.dims2().unwrap();
    let n = batch * seq;

    // The runtime's numbers are the in-memory loop's over the masters rounded to BF16.
    let params = case.params(candle_core::DType::BF16);
    let (parts, in_memory) = oogc::models::loss_parts_and_grads(model, &params, &tokens, &targets).unwrap();
    assert_eq!(parts.total().to_bits(), bf16.loss.to_bits(), "{label}: the runtime's loss is the in-memory loop's");
    for (u, flat) in &bf16.grads {
        assert!(f32s(&in_memory[*u]) == *flat, "{label}: unit {u}'s gradients are the in-memory loop's");
    }

    // 1. The routing: few rows differ from the oracle's, each a near tie there.
    let want_logits = floats(r, "router_logits");
    fixtures::assert_rel(
        &format!("{label} bf16 router logits vs transformers"),
        rel_max_abs(&bf16.router_logits, &want_logits),
        fixtures::BF16_LOGITS_RTOL,
    );
    let oracle_sets = top_k_sets(&want_logits, e, k);
    let mut gaps: Vec<f32> = oracle_sets.iter().map(|(_, gap)| *gap).collect();
    gaps.sort_by(f32::total_cmp);
    eprintln!("{label}: the oracle's top-{k} gaps: median {:.3e}, smallest {:.3e}", gaps[gaps.len() / 2], gaps[0]);
    let mut differing = Vec::new();
    for layer in 0..layers {
        let span = layer * n * e..(layer + 1) * n * e;
        let (ours, want) = (&bf16.router_logits[span.clone()], &want_logits[span]);
        let sq: f64 = ours.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        let sigma = (sq / ours.len() as f64).sqrt();
        eprintln!("{label} layer {layer}: BF16 router logits off by {sigma:.3e} rms");
        for (row, c) in bf16.choices[layer].chunks_exact(k).enumerate() {
            let mut set = c.to_vec();
            set.sort();
            let (want, gap) = &oracle_sets[layer * n + row];
            if set != *want {
                let sigmas = *gap as f64 / sigma;
                eprintln!(
                    "{label}: layer {layer} row {row} routes to {set:?}, the oracle to {want:?}: gap {gap:.3e} ({sigmas:.1} σ)"
                );
                assert!(
                    sigmas <= TIE_SIGMAS,
                    "{label}: layer {layer} row {row} routes differently at a gap of {gap:.3e} = {sigmas:.1} σ: no near tie"
                );
                differing.push(row);
            }
        }
    }
    assert!(
        differing.len() * ROWS_PER_DIFFERENCE <= layers * n,
        "{label}: {} of {} rows route differently",
        differing.len(),
        layers * n
    );
    // The rows no differing routing reaches: before the first differing row of their sequence.
    let reached = |row: usize| differing.iter().any(|&d| d / seq == row / seq && d % seq <= row % seq);
    let vocab = cfg.vocab_size;
    let rows_of = |logits: &[f32]| -> Vec<f32> {
        logits.chunks_exact(vocab).enumerate().filter(|(row, _)| !reached(*row)).flat_map(|(_, z)| z.to_vec()).collect()
    };

    // 2. The second oracle: our f32 path routed as the BF16 run was.
    let f32_params = case.params(candle_core::DType::F32);
    let mut memory = |u: usize, _: Phase| Params::Memory(f32_params[u].clone());
    let replayed: Pass = case.pass(&mut memory, &|_| false, Some(&bf16.choices));
    assert_close(
        &format!("{label} replayed oracle: unreached logits vs transformers"),
        &rows_of(&replayed.logits),
        &rows_of(&floats(r, "logits")),
        1e-4,
        1e-5,
    );
    if differing.is_empty() {
        for (name, got) in [("loss_ce", replayed.loss_ce), ("aux_loss", replayed.aux), ("loss", replayed.loss)] {
            assert_close(&format!("{label} replayed oracle {name}"), &[got as f32], &floats(r, name), 1e-4, 1e-5);
        }
        for (u, flat) in &replayed.grads {
            for (name, ours) in fixtures::by_param(model, *u, flat) {
                assert_close(
                    &format!("{label} replayed oracle grad {name}"),
                    &ours,
                    &floats(r, &format!("grad.{name}")),
                    1e-3,
                    1e-6,
                );
            }
        }
    }
    for (name, got, want) in
        [("router logits", &bf16.router_logits, &replayed.router_logits), ("logits", &bf16.logits, &replayed.logits)]
    {
        fixtures::assert_rel(
            &format!("{label} bf16 {name} vs the replayed oracle"),
            rel_max_abs(got, want),
            fixtures::BF16_LOGITS_RTOL,
        );
    }
    for (name, got, want) in [
        ("loss_ce", bf16.loss_ce, replayed.loss_ce),
        ("aux_loss", bf16.aux, replayed.aux),
        ("loss", bf16.loss, replayed.loss),
    ] {
        fixtures::assert_rel(
            &format!("{label} bf16 {name} vs the replayed oracle"),
            (got - want).abs() / want.abs(),
            fixtures::BF16_LOSS_RTOL,
        );
    }
    let checked = fixtures::assert_grads_rel(
        &format!("{label} bf16 vs the replayed oracle"),
        model,
        &bf16.grads,
        |name| {
            let u = model.units().iter().position(|u| u.params.iter().any(|p| p.name == name)).unwrap();
            fixtures::by_param(model, u, &replayed.grads[&u]).into_iter().find(|(p, _)| p == name).unwrap().1
        },
        fixtures::BF16_GRAD_RTOL,
    );
    assert_eq!(checked, r.keys().filter(|k| k.starts_with("grad.")).count(), "{label}: every gradient compared");

    // 3. Transformers' logits directly, where no differing routing reaches.
    fixtures::assert_rel(
        &format!("{label} bf16 unreached logits vs transformers"),
        rel_max_abs(&rows_of(&bf16.logits), &rows_of(&floats(r, "logits"))),
        fixtures::BF16_LOGITS_RTOL,
    );
    eprintln!(
        "{label}: {} of {} rows route differently, {} of {n} positions reached",
        differing.len(),
        layers * n,
        (0..n).filter(|&row| reached(row)).count()
    );

    case.adamw_step(&format!("{label} bf16"), &mut rt, &unit_ids, &place);
}

/// Resident, fetched and on the CPU, mixed over the blocks' experts.
fn mixed(b: usize, e: usize) -> Place {
    [Place::Resident, Place::Fetch, Place::Cpu][(b + e) % 3]
}

/// Qwen3-MoE: top-4 of 8 renormalized, per-head q/k norm.
#[test]
fn qwen3_moe_in_bf16_matches_transformers_through_the_runtime() {
    bf16_through_the_runtime(&moe_case("qwen3_moe"), "qwen3_moe", mixed);
}

/// OLMoE: top-4 of 8 not renormalized, q/k norm over the whole projections.
#[test]
fn olmoe_in_bf16_matches_transformers_through_the_runtime() {
    bf16_through_the_runtime(&moe_case("olmoe"), "olmoe", mixed);
}

/// Qwen2-MoE: the shared expert and its sigmoid gate in the trunk, q/k/v bias.
#[test]
fn qwen2_moe_in_bf16_matches_transformers_through_the_runtime() {
    bf16_through_the_runtime(&moe_case("qwen2_moe"), "qwen2_moe", mixed);
}

/// Mixtral: top-2 of 4 renormalized (`../shared/fixtures/llama/mixtral_moe`).
#[test]
fn mixtral_in_bf16_matches_transformers_through_the_runtime() {
    bf16_through_the_runtime(&crate::mixtral::case(), "mixtral", mixed);
}
