//! Helpers the crate's tests share: tensors as host vectors, BF16 test data, the relative
//! errors the half-precision tests bound, and the checks that `gpt`, `llama`, `hf` and
//! `mixtral` make alike of BF16 against a reference (the bounds stay with each test).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;

use crate::hf::NamedTensor;
use crate::unit::{ParamSpec, UnitSpec};

/// `2^-8`: the spacing of BF16 numbers relative to their magnitude (8 significant bits); one
/// rounding to BF16 is off by at most half of it.
pub(crate) const BF16_SPACING: f64 = 1.0 / 256.0;

/// A tensor's elements, flattened, as f64 (exact from every float dtype).
pub(crate) fn to_vec(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
}

/// A tensor's elements, flattened, as f32 (exact from BF16).
pub(crate) fn to_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// A BF16 tensor `shape` of values uniform in `[lo, hi)`.
pub(crate) fn bf16_uniform(shape: &[usize], lo: f64, hi: f64, rng: &mut impl Rng) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap()
}

/// `‖a − r‖ / ‖r‖` over two equally long slices (f64 sums); 0 when both are zero (an expert
/// without tokens), infinite when only `r` is.
pub(crate) fn rel_frobenius<T: Copy + Into<f64>>(a: &[T], r: &[T]) -> f64 {
    assert_eq!(a.len(), r.len());
    let e: f64 = a.iter().zip(r).map(|(&a, &r)| (a.into() - r.into()).powi(2)).sum();
    let n: f64 = r.iter().map(|&r| r.into().powi(2)).sum();
    if e == 0.0 {
        0.0
    } else {
        (e / n).sqrt()
    }
}

/// `max |a − r| / max |r|`.
pub(crate) fn rel_max_abs(a: &[f32], r: &[f32]) -> f64 {
    assert_eq!(a.len(), r.len());
    let err = a.iter().zip(r).map(|(&a, &r)| (a as f64 - r as f64).abs()).fold(0.0, f64::max);
    err / r.iter().map(|&r| (r as f64).abs()).fold(0.0, f64::max)
}

/// Every gradient of every unit (BF16, one flat tensor a unit, in the order of `units`) against
/// its reference, parameter by parameter: `rel_frobenius(gradient, reference(unit position,
/// parameter)) <= bound`, each printed and the worst reported. `label` starts the messages,
/// `note` ends a failure's. Returns how many parameters it checked.
pub(crate) fn assert_grads_within(
    label: &str,
    units: &[UnitSpec],
    grads: &[Tensor],
    mut reference: impl FnMut(usize, &ParamSpec) -> Vec<f64>,
    bound: f64,
    note: &str,
) -> usize {
    let width = units.iter().flat_map(|u| &u.params).map(|p| p.name.len()).max().unwrap_or(0);
    let (mut worst, mut checked) = ((0f64, String::new()), 0);
    for (u, (unit, g)) in units.iter().zip(grads).enumerate() {
        assert_eq!(g.dtype(), DType::BF16, "{}: gradients in the params' dtype", unit.name);
        let g = to_vec(g);
        for p in &unit.params {
            let q = rel_frobenius(&g[p.offset..p.offset + p.numel()], &reference(u, p));
            eprintln!("  {:<width$} {q:.2e}", p.name);
            assert!(q <= bound, "{label}: gradient of {} off by {q:.2e}{note}", p.name);
            if q > worst.0 {
                worst = (q, p.name.clone());
            }
            checked += 1;
        }
    }
    eprintln!("{label}: {checked} gradients, worst relative error {:.2e} ({})", worst.0, worst.1);
    checked
}

/// [`assert_grads_within`] against a transformers fixture's `grad.<name>` tensors (f32), every
/// one of them checked.
pub(crate) fn assert_fixture_grads_within(
    label: &str,
    units: &[UnitSpec],
    grads: &[Tensor],
    fixture: &BTreeMap<String, NamedTensor>,
    bound: f64,
) {
    let want = |_: usize, p: &ParamSpec| -> Vec<f64> {
        fixture[&format!("grad.{}", p.name)].as_f32().unwrap().iter().map(|&x| f64::from(x)).collect()
    };
    let checked = assert_grads_within(label, units, grads, want, bound, " (relative Frobenius)");
    assert_eq!(checked, fixture.keys().filter(|k| k.starts_with("grad.")).count());
}

/// Each element of `got` within one BF16 spacing (relative) of `exact`.
pub(crate) fn assert_within_bf16_spacing(got: &[f64], exact: &[f64]) {
    for (i, (&a, &e)) in got.iter().zip(exact).enumerate() {
        assert!((a - e).abs() <= BF16_SPACING * e.abs(), "element {i}: {a} vs exact {e}");
    }
}

/// What a BF16 accumulation gives — candle's `index_select` backward of the embedding `table`
/// `[v, d]` (BF16) at `tokens` `[b, t]` under the output gradient `g` `[b, t, d]`: far off, more
/// than 20 % from the `exact` sum at element `at`, or the test would not tell.
pub(crate) fn assert_bf16_accumulation_far_off(table: &Tensor, tokens: &Tensor, g: &Tensor, exact: &[f64], at: usize) {
    let (b, t, d) = g.dims3().unwrap();
    let w = Var::from_tensor(table).unwrap();
    let out = w.as_tensor().index_select(&tokens.flatten_all().unwrap(), 0).unwrap();
    let grads = (out * g.reshape((b * t, d)).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let naive = to_vec(grads.get(w.as_tensor()).unwrap());
    let off = (naive[at] - exact[at]).abs() / exact[at];
    assert!(off > 0.2, "a BF16 accumulation is off by {off} only: the test would not tell");
}

/// `y` `[1, t, d]` is BF16 and every row of it equals row 0 within 8 BF16 spacings of row 0's
/// largest magnitude (a few roundings).
pub(crate) fn assert_rows_equal_row_0(y: &Tensor) {
    assert_eq!(y.dtype(), DType::BF16);
    let (_, t, d) = y.dims3().unwrap();
    let y = to_vec(y);
    let scale = y[..d].iter().fold(0f64, |m, x| m.max(x.abs()));
    let worst = (1..t).map(|i| (0..d).map(|j| (y[i * d + j] - y[j]).abs()).fold(0f64, f64::max)).fold(0f64, f64::max);
    eprintln!("bf16 attention: rows differ from row 0 by {:.2e} of its max", worst / scale);
    assert!(worst <= 8.0 * BF16_SPACING * scale, "rows differ from row 0 by {worst} (scale {scale})");
}
