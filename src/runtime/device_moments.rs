//! Adam's moments of a device optimizer in the run's `[optimizer] state_dtype`
//! ([`oogc_optimizer::StateDType`]): [`DeviceMoments`], candle tensors on the compute device in
//! the CPU optimizer's own format, so that moving a unit's state between the CPU optimizer and
//! the device copies the stored arrays as they are (no re-encoding, no drift) and a device unit
//! holds as few bytes as a host one.
//!
//! - **f32**: `m`, `v` as F32 tensors `[n]`.
//! - **bf16**: `m`, `v` as BF16 tensors `[n]`; the update widens them to f32 and rounds the new
//!   moments back to nearest even (candle's f32→bf16 cast: `half::bf16::from_f32` on the CPU,
//!   `__float2bfloat16` on CUDA), as the CPU kernel ([`oogc_optimizer::bf16_rne`]).
//! - **int8**: the block-wise format of `optimizer/src/quant.rs` ([`QUANT_BLOCK`] = 256 values
//!   per block, one f32 absmax per block and moment): `m`'s codes on the linear map `j/127`
//!   (`j ∈ −127..=127`, stored as its two's-complement byte in a U8 tensor, as the CPU's `i8`),
//!   `v`'s on the dynamic tree map ([`oogc_optimizer::dynamic_map`]), absmaxes F32 `[blocks]`.
//!   The update decodes them to f32 (`(j/127)·A`; the tree map's value gathered by code,
//!   times `A`), runs the f32 element update, takes each block's new absmax (a ragged last
//!   block is padded with zeros, which change no absmax) and encodes: `m` to the nearest `j`
//!   (`|m − m̃| ≤ A/254`, plus f32 rounding), `v` to the number of the tree map's 255 decision
//!   thresholds (midpoints of consecutive values) `t` with `v > t·A`, found by an 8-step binary
//!   search of gathers, so the transient memory is a few `[n]` tensors whatever the unit's
//!   size. The codes are the CPU encoder's except where a value lies within f32 rounding of a
//!   decision boundary (the CPU decides those in f64); decoding is the CPU's up to two f32
//!   roundings ([`moment_codec_excess`] measures both).
//!
//! Master weights stay f32 on the device (a bf16 master's values, widened, exactly).

use candle_core::{DType as CandleDType, Device, Tensor};
use oogc_optimizer::{MomentBufs, StateDType, QUANT_BLOCK};
use oogc_swapper::DType;

use super::Result;

/// Adam's `m` and `v` of one unit on the compute device, in their stored dtype (module docs).
#[derive(Debug)]
pub(super) enum DeviceMoments {
    /// F32 `[n]` each.
    F32 { m: Tensor, v: Tensor },
    /// BF16 `[n]` each.
    Bf16 { m: Tensor, v: Tensor },
    /// U8 codes `[n]` (`m`: the `i8` code's byte) and F32 absmaxes `[n.div_ceil(QUANT_BLOCK)]`.
    Int8 { m: Tensor, m_absmax: Tensor, v: Tensor, v_absmax: Tensor },
}

/// The swapper's dtype of each array of [`MomentBufs`] of `dtype`, in the order of
/// [`DeviceMoments::arrays`].
fn array_dtypes(dtype: StateDType) -> &'static [DType] {
    match dtype {
        StateDType::F32 => &[DType::F32, DType::F32],
        StateDType::Bf16 => &[DType::BF16, DType::BF16],
        StateDType::Int8 => &[DType::U8, DType::F32, DType::U8, DType::F32],
    }
}

impl DeviceMoments {
    /// The stored dtype.
    pub(super) fn dtype(&self) -> StateDType {
        match self {
            DeviceMoments::F32 { .. } => StateDType::F32,
            DeviceMoments::Bf16 { .. } => StateDType::Bf16,
            DeviceMoments::Int8 { .. } => StateDType::Int8,
        }
    }

    /// The tensors: `m`, `v` (f32, bf16) or `m` codes, `m` absmax, `v` codes, `v` absmax (int8).
    pub(super) fn arrays(&self) -> Vec<&Tensor> {
        match self {
            DeviceMoments::F32 { m, v } | DeviceMoments::Bf16 { m, v } => vec![m, v],
            DeviceMoments::Int8 { m, m_absmax, v, v_absmax } => vec![m, m_absmax, v, v_absmax],
        }
    }

    /// Bytes the tensors hold: [`StateDType::moment_bytes`] of their length.
    pub(super) fn bytes(&self) -> u64 {
        self.arrays().iter().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
    }

    /// From the CPU optimizer's moments, each array through `upload` (its little-endian bytes
    /// and its dtype to a 1-D tensor on the compute device): a plain copy.
    ///
    /// # Errors
    /// `upload`'s.
    pub(super) fn from_host(
        moments: &MomentBufs,
        mut upload: impl FnMut(&[u8], DType) -> Result<Tensor>,
    ) -> Result<Self> {
        let dt = array_dtypes(moments.dtype());
        Ok(match moments {
            MomentBufs::F32 { m, v } => DeviceMoments::F32 {
                m: upload(bytemuck::cast_slice(m), dt[0])?,
                v: upload(bytemuck::cast_slice(v), dt[1])?,
            },
            MomentBufs::Bf16 { m, v } => DeviceMoments::Bf16 {
                m: upload(bytemuck::cast_slice(m), dt[0])?,
                v: upload(bytemuck::cast_slice(v), dt[1])?,
            },
            MomentBufs::Int8 { m, m_absmax, v, v_absmax } => DeviceMoments::Int8 {
                m: upload(bytemuck::cast_slice(m), dt[0])?,
                m_absmax: upload(bytemuck::cast_slice(m_absmax), dt[1])?,
                v: upload(v, dt[2])?,
                v_absmax: upload(bytemuck::cast_slice(v_absmax), dt[3])?,
            },
        })
    }

    /// The CPU optimizer's moments, each array through `download` (a tensor's little-endian
    /// bytes on the host): a plain copy, the inverse of [`Self::from_host`].
    ///
    /// # Errors
    /// `download`'s.
    pub(super) fn to_host(&self, mut download: impl FnMut(&Tensor) -> Result<Vec<u8>>) -> Result<MomentBufs> {
        let mut a = self.arrays().into_iter().map(&mut download).collect::<Result<Vec<_>>>()?.into_iter();
        let mut next = || a.next().expect("one array per tensor");
        Ok(match self.dtype() {
            StateDType::F32 => {
                MomentBufs::F32 { m: bytemuck::pod_collect_to_vec(&next()), v: bytemuck::pod_collect_to_vec(&next()) }
            }
            StateDType::Bf16 => {
                MomentBufs::Bf16 { m: bytemuck::pod_collect_to_vec(&next()), v: bytemuck::pod_collect_to_vec(&next()) }
            }
            StateDType::Int8 => MomentBufs::Int8 {
                m: bytemuck::pod_collect_to_vec(&next()),
                m_absmax: bytemuck::pod_collect_to_vec(&next()),
                v: next(),
                v_absmax: bytemuck::pod_collect_to_vec(&next()),
            },
        })
    }

    /// `m` and `v` in f32 (`[n]` each), as the update reads them: bf16 widened, int8 decoded.
    ///
    /// # Errors
    /// candle's.
    pub(super) fn decode(&self) -> candle_core::Result<(Tensor, Tensor)> {
        match self {
            DeviceMoments::F32 { m, v } => Ok((m.clone(), v.clone())),
            DeviceMoments::Bf16 { m, v } => Ok((m.to_dtype(CandleDType::F32)?, v.to_dtype(CandleDType::F32)?)),
            DeviceMoments::Int8 { m, m_absmax, v, v_absmax } => {
                // m: the code's byte b is j = b − 256·[b ≥ 128]; the value j/127 times A.
                let q = m.to_dtype(CandleDType::F32)?;
                let j = (&q - q.ge(128.0)?.to_dtype(CandleDType::F32)?.affine(256.0, 0.0)?)?;
                let mf = per_block(&j.affine(1.0 / 127.0, 0.0)?, m_absmax, |x, a| x.broadcast_mul(a))?;
                // v: the map's value gathered by code (U32 indices: candle's index_select reads
                // an index of the type's maximum, 255 for U8, as padding), times A.
                let table = dynamic_table(v.device())?;
                let vf = table.index_select(&v.to_dtype(CandleDType::U32)?, 0)?;
                let vf = per_block(&vf, v_absmax, |x, a| x.broadcast_mul(a))?;
                Ok((mf, vf))
            }
        }
    }

    /// `m` and `v` (f32 `[n]` each) stored in `dtype`: bf16 rounded to nearest even, int8
    /// encoded block by block with each block's new absmax (module docs).
    ///
    /// # Errors
    /// candle's.
    pub(super) fn encode(dtype: StateDType, m: Tensor, v: Tensor) -> candle_core::Result<Self> {
        Ok(match dtype {
            StateDType::F32 => DeviceMoments::F32 { m, v },
            StateDType::Bf16 => {
                DeviceMoments::Bf16 { m: m.to_dtype(CandleDType::BF16)?, v: v.to_dtype(CandleDType::BF16)? }
            }
            StateDType::Int8 => {
                let (m, m_absmax) = encode_linear(&m)?;
                let (v, v_absmax) = encode_dynamic(&v)?;
                DeviceMoments::Int8 { m, m_absmax, v, v_absmax }
            }
        })
    }
}

/// `x` (`[n]`) padded with zeros to whole blocks, `[blocks, QUANT_BLOCK]`.
fn blocks_of(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    let blocks = n.div_ceil(QUANT_BLOCK);
    x.pad_with_zeros(0, 0, blocks * QUANT_BLOCK - n)?.reshape((blocks, QUANT_BLOCK))
}

/// `f(x's blocks, the block's absmax as [blocks, 1])`, flattened back to `x`'s `[n]`.
fn per_block(
    x: &Tensor,
    absmax: &Tensor,
    f: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    let a = absmax.reshape((absmax.elem_count(), 1))?;
    f(&blocks_of(x)?, &a)?.flatten_all()?.narrow(0, 0, n)
}

/// Each block's absmax, `[blocks]` f32.
fn block_absmax(x: &Tensor) -> candle_core::Result<Tensor> {
    blocks_of(x)?.abs()?.max(1)
}

/// The tree map's values by code ([`oogc_optimizer::dynamic_map`]), F32 `[256]`.
fn dynamic_table(device: &Device) -> candle_core::Result<Tensor> {
    Tensor::from_slice(oogc_optimizer::dynamic_map(), 256, device)
}

/// `m` (f32 `[n]`) on the linear map: U8 codes `[n]` (the `i8` code's byte: the nearest integer
/// to `127·m/A`, clamped to ±127) and the blocks' absmax `A` (`[blocks]`; all codes 0 where
/// `A = 0`).
fn encode_linear(m: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let absmax = block_absmax(m)?;
    // A block of zeros divides by 1 (its codes are 0 either way).
    let safe = (&absmax + absmax.eq(0.0)?.to_dtype(CandleDType::F32)?)?;
    let q = per_block(m, &safe, |x, a| x.broadcast_div(a))?.affine(127.0, 0.0)?.round()?.clamp(-127f32, 127f32)?;
    // Two's complement in a byte: −j ↦ 256 − j.
    let byte = (&q + q.lt(0.0)?.to_dtype(CandleDType::F32)?.affine(256.0, 0.0)?)?;
    Ok((byte.to_dtype(CandleDType::U8)?, absmax))
}

/// `v` (f32 `[n]`, non-negative) on the dynamic tree map: U8 codes `[n]` (how many of the
/// map's 255 decision thresholds `t`, the midpoints of consecutive values, have `v > t·A`) and
/// the blocks' absmax `A` (`[blocks]`).
fn encode_dynamic(v: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (n, dev) = (v.elem_count(), v.device());
    let absmax = block_absmax(v)?;
    let map = oogc_optimizer::dynamic_map();
    let thresholds: Vec<f32> = map.windows(2).map(|w| ((f64::from(w[0]) + f64::from(w[1])) / 2.0) as f32).collect();
    let thresholds = Tensor::from_vec(thresholds, 255, dev)?;
    // Each element's block absmax, `[blocks · QUANT_BLOCK]`.
    let blocks = absmax.elem_count();
    let a = absmax.reshape((blocks, 1))?.broadcast_as((blocks, QUANT_BLOCK))?.flatten_all()?;
    let y = blocks_of(v)?.flatten_all()?;
    // The code is the largest c with v > t[c − 1]·A (the thresholds ascend): binary search, one
    // gather of the thresholds per bit.
    let mut code = Tensor::zeros(y.elem_count(), CandleDType::F32, dev)?;
    for bit in (0..8).rev() {
        let step = f64::from(1u32 << bit);
        let idx = code.affine(1.0, step - 1.0)?.to_dtype(CandleDType::U32)?;
        let t = (thresholds.index_select(&idx, 0)? * &a)?;
        code = (code + y.gt(&t)?.to_dtype(CandleDType::F32)?.affine(step, 0.0)?)?;
    }
    Ok((code.narrow(0, 0, n)?.to_dtype(CandleDType::U8)?, absmax))
}

/// Test values of `n` elements: magnitudes over eight decades, signs mixed, a block of zeros
/// (elements 256..512).
fn codec_test_values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if (QUANT_BLOCK..2 * QUANT_BLOCK).contains(&i) {
                0.0
            } else {
                let mag = 10f32.powf(-((i * 37 % 97) as f32) / 12.0);
                if i % 3 == 0 {
                    -mag
                } else {
                    mag
                }
            }
        })
        .collect()
}

/// Runs the device optimizer's moment codecs (bf16 and int8, `DeviceMoments`) on `device`
/// over test values (four blocks of [`QUANT_BLOCK`], the last ragged, one of zeros; `m` over
/// eight decades with signs mixed, `v = m²`) against the CPU optimizer's
/// ([`MomentBufs::from_f32`], [`MomentBufs::to_f32`]) and returns, per dtype (`"bf16"`,
/// `"int8"`), how far it is from agreeing, in units of its tolerance (≤ 1 passes): the larger
/// of the share of stored bytes (codes, bf16 bits, absmaxes) that differ from the CPU
/// encoder's, in units of 1 % (the device decides values within f32 rounding of a decision
/// boundary in f32, the CPU in f64), and the largest deviation of the device's decode of the
/// CPU's codes from the CPU's decode, in units of a relative 2^−22 (two f32 roundings). For the
/// unit tests and `oogc gpu-check` (the same codecs on the GPU).
///
/// # Errors
/// candle's, as text.
pub fn moment_codec_excess(device: &Device) -> Result<Vec<(String, f64)>, String> {
    let n = 3 * QUANT_BLOCK + 77;
    let m = codec_test_values(n);
    let v: Vec<f32> = m.iter().map(|x| x * x).collect();
    let err = |e: super::RuntimeError| e.to_string();
    let cerr = |e: candle_core::Error| e.to_string();
    let mut out = Vec::new();
    for dtype in [StateDType::Bf16, StateDType::Int8] {
        let t = |x: &[f32]| Tensor::from_slice(x, x.len(), device).map_err(cerr);
        let encoded = DeviceMoments::encode(dtype, t(&m)?, t(&v)?).map_err(cerr)?;
        let got = encoded.to_host(super::tensor::host_bytes).map_err(err)?;
        let want = MomentBufs::from_f32(dtype, &m, &v).map_err(|e| e.to_string())?;
        let bytes = |b: &MomentBufs| {
            let mut out = vec![0u8; dtype.moment_bytes(n)];
            b.write_bytes(0..n, &mut out);
            out
        };
        let (g, w) = (bytes(&got), bytes(&want));
        let differ = g.iter().zip(&w).filter(|(a, b)| a != b).count() as f64 / w.len() as f64;
        // The device's decode of the CPU's codes against the CPU's decode.
        let upload = |b: &[u8], dt: DType| super::tensor::tensor_from_bytes(b, dt, b.len() / dt.num_bytes(1), device);
        let (dm, dv) = DeviceMoments::from_host(&want, upload).map_err(err)?.decode().map_err(cerr)?;
        let (hm, hv) = want.to_f32();
        let mut worst = 0f64;
        for (d, h) in [(dm, hm), (dv, hv)] {
            for (a, b) in d.to_vec1::<f32>().map_err(cerr)?.iter().zip(&h) {
                let e =
                    f64::from((a - b).abs()) / (f64::from(b.abs()) * 2f64.powi(-22)).max(f64::from(f32::MIN_POSITIVE));
                worst = if e.is_nan() { f64::INFINITY } else { worst.max(e) };
            }
        }
        out.push((dtype.name().to_string(), (differ / 0.01).max(worst)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        codec_test_values(n)
    }

    fn host(dtype: StateDType, m: &[f32], v: &[f32]) -> MomentBufs {
        MomentBufs::from_f32(dtype, m, v).unwrap()
    }

    fn on_device(dtype: StateDType, m: &[f32], v: &[f32]) -> DeviceMoments {
        let t = |x: &[f32]| Tensor::from_slice(x, x.len(), &Device::Cpu).unwrap();
        DeviceMoments::encode(dtype, t(m), t(v)).unwrap()
    }

    fn to_host(d: &DeviceMoments) -> MomentBufs {
        d.to_host(super::super::tensor::host_bytes).unwrap()
    }

    /// The device codecs (here on the CPU, as on the sim device) write the CPU optimizer's
    /// format: the stored bytes agree but for under 1 % (values within f32 rounding of a
    /// boundary), decoding to two f32 roundings; f32 moments are stored as they are.
    #[test]
    fn device_codecs_write_the_cpu_format() {
        let excess = moment_codec_excess(&Device::Cpu).unwrap();
        assert_eq!(excess.iter().map(|(d, _)| d.as_str()).collect::<Vec<_>>(), ["bf16", "int8"]);
        for (dtype, e) in &excess {
            eprintln!("{dtype}: {e:.3} × the tolerance");
            assert!(*e <= 1.0, "{dtype}: {e:.3} × the tolerance");
        }
        let m = values(QUANT_BLOCK + 3);
        assert_eq!(to_host(&on_device(StateDType::F32, &m, &m)), host(StateDType::F32, &m, &m));
    }

    /// decode(encode(x)) stays within the codecs' bounds: bf16 a relative 2^−8; int8 `m` within
    /// `A/254` of the block's absmax `A` (plus f32 rounding); int8 `v` within the tree map's
    /// relative error of its decade (half the gap to the next value) or below its smallest
    /// threshold. And encode(decode(codes)) of `m` is the identity (a unit moved
    /// device→host→device and updated by nothing keeps its codes).
    #[test]
    fn device_int8_and_bf16_round_trips_stay_within_the_codec_bounds() {
        let n = 2 * QUANT_BLOCK + 5;
        let m = values(n);
        let v: Vec<f32> = m.iter().map(|x| x * x).collect();
        let map = oogc_optimizer::dynamic_map();
        for dtype in [StateDType::Bf16, StateDType::Int8] {
            let d = on_device(dtype, &m, &v);
            let (dm, dv) = d.decode().unwrap();
            let (dm, dv) = (dm.to_vec1::<f32>().unwrap(), dv.to_vec1::<f32>().unwrap());
            for (k, (x, y)) in m.chunks(QUANT_BLOCK).zip(dm.chunks(QUANT_BLOCK)).enumerate() {
                let a = x.iter().fold(0f32, |s, x| s.max(x.abs()));
                for (x, y) in x.iter().zip(y) {
                    let bound = match dtype {
                        StateDType::Bf16 => x.abs() / 256.0,
                        _ => a / 254.0 + f32::EPSILON * a,
                    };
                    assert!((x - y).abs() <= bound, "{dtype} m, block {k}: {x} → {y}");
                }
            }
            for (x, y) in v.chunks(QUANT_BLOCK).zip(dv.chunks(QUANT_BLOCK)) {
                let a = x.iter().fold(0f32, |s, x| s.max(x.abs()));
                for (x, y) in x.iter().zip(y) {
                    let bound = match dtype {
                        StateDType::Bf16 => x.abs() / 256.0,
                        // Half the gap between the map's values around x/A, times A.
                        _ => {
                            let u = x / a.max(f32::MIN_POSITIVE);
                            let c = map.partition_point(|&t| t < u).min(255);
                            let gap = (map[c] - map[c.saturating_sub(1)]).max(map[c.min(254) + 1] - map[c]);
                            gap * a * (0.5 + 1e-5) + f32::EPSILON * a
                        }
                    };
                    assert!((x - y).abs() <= bound, "{dtype} v: {x} → {y} (bound {bound})");
                }
            }
            if dtype == StateDType::Int8 {
                let again = DeviceMoments::encode(dtype, Tensor::new(dm.as_slice(), &Device::Cpu).unwrap(), {
                    Tensor::new(dv.as_slice(), &Device::Cpu).unwrap()
                })
                .unwrap();
                let (first, second) = (to_host(&d), to_host(&again));
                let (MomentBufs::Int8 { m: c0, .. }, MomentBufs::Int8 { m: c1, .. }) = (&first, &second) else {
                    unreachable!()
                };
                assert_eq!(c0, c1, "m's codes survive a decode and an encode");
            }
        }
    }

    /// Bytes held are the dtype's [`StateDType::moment_bytes`].
    #[test]
    fn device_moments_hold_the_dtypes_bytes() {
        let n = QUANT_BLOCK + 1;
        let z = vec![0.0f32; n];
        for dtype in [StateDType::F32, StateDType::Bf16, StateDType::Int8] {
            assert_eq!(on_device(dtype, &z, &z).bytes(), dtype.moment_bytes(n) as u64, "{dtype}");
        }
    }
}
