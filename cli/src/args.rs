//! Argument parsers and output helpers shared by the subcommands.

use anyhow::Context;
use serde::Serialize;

pub(crate) fn parse_nonnegative_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("`{s}` must be a finite number ≥ 0"))
    }
}

pub(crate) fn parse_decay(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("`{s}` must be in [0, 1)"))
    }
}

pub(crate) fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("`{s}` must be a fraction in (0, 1]"))
    }
}

pub(crate) fn parse_positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("`{s}` must be a number greater than 0"))
    }
}

/// Parses `1048576`, `1MiB`, `1M`, `4KiB`, `4k`, `1GiB` into bytes.
pub(crate) fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a byte count (e.g. 1048576, 1MiB, 4KiB)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        other => return Err(format!("unknown unit `{other}` in `{s}`: use B, KiB, MiB or GiB")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("`{s}` is too large"))
}

/// Parses `1000`, `4K`, `256M`, `1G` (binary multiples) into a count.
pub(crate) fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a count (e.g. 1000, 4K, 256M)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        other => return Err(format!("unknown suffix `{other}` in `{s}`: use K, M or G")),
    };
    match n.checked_mul(mult) {
        Some(0) => Err(format!("`{s}` must be at least 1")),
        Some(v) => Ok(v),
        None => Err(format!("`{s}` is too large")),
    }
}

/// Prints `rows` as JSON Lines: one compact object per line.
pub(crate) fn print_json_lines<T: Serialize>(rows: &[T]) -> anyhow::Result<()> {
    for r in rows {
        println!("{}", serde_json::to_string(r).context("serializing a result row")?);
    }
    Ok(())
}
