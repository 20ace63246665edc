//! Helpers shared by the optimizer's test binaries: torch's AdamW/Adam reference vectors from
//! `shared/fixtures/adamw` and a small deterministic generator.
#![allow(dead_code)] // each test binary uses a part

use std::path::{Path, PathBuf};

use oogc_optimizer::{AdamConfig, AdamKind};
use serde_json::Value;

/// The reference vectors' folder; panics (these tests do not skip) when it is missing.
pub fn fixtures_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/adamw");
    assert!(
        dir.join("cases.json").is_file(),
        "the torch reference vectors are missing: expected {}/cases.json. The repository must be \
         checked out with `shared/` beside its root (../shared/fixtures/adamw); these tests do not skip",
        dir.display()
    );
    dir
}

/// A raw little-endian f32 file.
pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{} is not a whole number of f32", path.display());
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// One case of `cases.json` with its arrays (see the fixtures' README).
pub struct Case {
    /// The case's name (file prefix).
    pub name: String,
    /// Parameters.
    pub n: usize,
    /// Steps.
    pub steps: usize,
    /// Hyper-parameters.
    pub cfg: AdamConfig,
    /// Learning rate of every step.
    pub lr: f32,
    /// Parameters before the first step (`n`).
    pub p0: Vec<f32>,
    /// Gradients, step-major (`steps × n`).
    pub grads: Vec<f32>,
    /// torch's `p`, `exp_avg`, `exp_avg_sq` after each step (`steps × n` each).
    pub p: Vec<f32>,
    /// See `p`.
    pub m: Vec<f32>,
    /// See `p`.
    pub v: Vec<f32>,
}

/// Every case of the reference vectors.
pub fn load_cases() -> Vec<Case> {
    let dir = fixtures_dir();
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let cases = cases["cases"].as_array().expect("cases array");
    cases
        .iter()
        .map(|case| {
            let name = case["name"].as_str().unwrap().to_string();
            let f = |k: &str| case[k].as_f64().unwrap();
            let cfg = AdamConfig {
                kind: match case["optimizer"].as_str().unwrap() {
                    "AdamW" => AdamKind::AdamW,
                    "Adam" => AdamKind::Adam,
                    o => panic!("unknown optimizer {o}"),
                },
                beta1: f("beta1"),
                beta2: f("beta2"),
                eps: f("eps"),
                weight_decay: f("weight_decay"),
            };
            let load = |s: &str| read_f32(&dir.join(format!("{name}.{s}.f32")));
            let (n, steps) = (case["n"].as_u64().unwrap() as usize, case["steps"].as_u64().unwrap() as usize);
            let c = Case {
                lr: f("lr") as f32,
                p0: load("p0"),
                grads: load("grads"),
                p: load("p"),
                m: load("m"),
                v: load("v"),
                name,
                n,
                steps,
                cfg,
            };
            assert_eq!(c.p0.len(), n);
            assert_eq!(c.grads.len(), n * steps);
            c
        })
        .collect()
}

/// The bits of each value.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A small deterministic generator (no `rand` dependency in this crate).
pub struct Lcg(pub u64);

impl Lcg {
    /// 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let x = self.0;
        (x ^ (x >> 33)).wrapping_mul(0xff51afd7ed558ccd) ^ (x >> 29)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}
