//! Device optimizers: a unit whose fp32 master weights and Adam state live in GPU memory, updated
//! there after the step's decision (the moments in the run's `[optimizer] state_dtype`, in the
//! CPU optimizer's format: `runtime/device_moments.rs`), its compute copy rewritten on the
//! device — so a hot unit (a popular MoE expert, the last units of a dense model's backward) is
//! neither re-uploaded after every update nor waited for on the CPU optimizer.
//!
//! The update ([`adam_step_tensors`]) is the CPU kernel's element update (torch's fused
//! AdamW/Adam, [`ElementConstants`]) written as candle ops, so the same code runs on CUDA and,
//! on the sim device, on the CPU. It is not bitwise the CPU kernel's (which fuses `m`'s update
//! into one FMA and divides once): within torch's tolerance (`../shared/fixtures/adamw`). The
//! clip scale and the non-finite skip are the step's, decided with every other unit's gradients
//! (the unit's sum of squares joins the CPU optimizer's global norm,
//! [`oogc_optimizer::PipelinedOptimizer::add_external_sumsq`]).
//!
//! Peers: DeepSpeed ZeRO-Offload++ "Twin-Flow" keeps a ratio of the optimizer state on the GPU;
//! Deep Optimizer States (Maurya et al., 2024) splits the update between CPU and GPU; ZenFlow
//! updates important gradients on the GPU. Here placement is per unit and follows the MoE hot
//! set (`train/moe.rs`) or `[optimizer] device_units` (`train/mod.rs`).

use candle_core::{DType as CandleDType, Tensor};
use oogc_optimizer::{ElementConstants, StateDType};
use oogc_swapper::DType;

use super::device_moments::DeviceMoments;
use super::tensor::{self, candle_dtype, device_tensor};
use super::unit::{Kind, OffDevice, Update};
use super::{OrderingCall, Result, Runtime, RuntimeError, UnitId};

/// Where a unit's optimizer (master weights, Adam `m` and `v`) lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptimizerPlace {
    /// The CPU optimizer's (host memory or NVMe, as `[budgets] optimizer_state` says).
    Host,
    /// GPU memory, updated there by [`adam_step_tensors`].
    Device,
}

/// GPU bytes a unit of `numel` parameters holds with its optimizer on the device: fp32 master
/// weights (4 B per parameter), `m` and `v` in `moments`, the run's `[optimizer] state_dtype`
/// ([`StateDType::moment_bytes`]: 8 B per parameter in f32, 4 in bf16, 2 + 8 per block of
/// [`oogc_optimizer::QUANT_BLOCK`] in int8, the ragged last block's absmaxes whole), the step's
/// fp32 gradients (4 B per parameter) and its compute copy in `dtype` (4 B per parameter in
/// f32, 2 in bf16): 16, 12 or 10.03 B per parameter + the compute copy.
pub fn device_optimizer_bytes(numel: usize, dtype: DType, moments: StateDType) -> u64 {
    (8 * numel + moments.moment_bytes(numel) + dtype.num_bytes(numel)) as u64
}

/// One AdamW/Adam step on tensors of one device (`p`, `m`, `v`, `g`: f32 of one shape), the CPU
/// kernel's formula with its constants `c` (module docs): returns the new `(p, m, v)`.
///
/// # Errors
/// candle's (shapes or dtypes that differ, a device error).
pub fn adam_step_tensors(
    c: &ElementConstants,
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let mut g = g.affine(f64::from(c.grad_scale), 0.0)?;
    if c.l2 != 0.0 {
        g = (g + p.affine(f64::from(c.l2), 0.0)?)?;
    }
    let p = p.affine(f64::from(c.decay), 0.0)?;
    let m = ((g.sub(m)?).affine(f64::from(c.c1), 0.0)? + m)?;
    let v = (v.affine(f64::from(c.b2), 0.0)? + (g.affine(f64::from(c.c2), 0.0)? * &g)?)?;
    let bc2_sqrt = Tensor::new(c.bc2_sqrt, p.device())?;
    let denom = v.sqrt()?.broadcast_div(&bc2_sqrt)?.affine(1.0, f64::from(c.eps))?;
    let p = (p - (m.affine(f64::from(c.step_size), 0.0)? / denom)?)?;
    Ok((p, m, v))
}

/// Sum of squares of `g` in f64 (one device reduction, then one scalar to the host).
///
/// # Errors
/// candle's.
pub(super) fn sumsq(g: &Tensor) -> candle_core::Result<f64> {
    g.to_dtype(CandleDType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

/// A unit's optimizer on the device.
#[derive(Debug)]
pub(super) struct DeviceState {
    /// fp32 master weights, `[numel]`.
    pub(super) master: Tensor,
    /// Adam's `m` and `v` in the run's `[optimizer] state_dtype`.
    pub(super) moments: DeviceMoments,
    /// The compute copy (`[numel]`, the compute dtype), rewritten from `master` by each update.
    pub(super) copy: Tensor,
    /// The step's gradients (`[numel]` f32), from the unit's `push_grads` to `finish_step`.
    pub(super) grads: Option<Tensor>,
}

impl DeviceState {
    /// Applies the step's update with `c` (after the decision: the clip scale is in `c`) and
    /// rewrites the compute copy in `dtype`; drops the gradients. Reduced moments are decoded
    /// to f32, updated, and stored in their dtype again ([`DeviceMoments`]).
    pub(super) fn update(&mut self, c: &ElementConstants, dtype: CandleDType) -> candle_core::Result<()> {
        let Some(g) = self.grads.take() else { return Ok(()) };
        let (m, v) = self.moments.decode()?;
        let (p, m, v) = adam_step_tensors(c, &self.master, &m, &v, &g)?;
        self.copy = p.to_dtype(dtype)?;
        self.moments = DeviceMoments::encode(self.moments.dtype(), m, v)?;
        self.master = p;
        Ok(())
    }

    /// GPU bytes its tensors hold (master weights, moments, compute copy), without the step's
    /// gradients: [`device_optimizer_bytes`] less 4 B per parameter.
    pub(super) fn bytes(&self) -> u64 {
        [&self.master, &self.copy].iter().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum::<u64>()
            + self.moments.bytes()
    }
}

impl Runtime {
    /// GPU bytes a device optimizer could still take: the device budget less the minimum
    /// working set and the device optimizers placed already.
    fn device_optimizer_room(&mut self) -> Result<u64> {
        self.check_working_set()?;
        let floor = self.units.largest_bytes(self.units.max_in_use());
        Ok(self.carve.base.saturating_sub(floor).saturating_sub(self.carve.device_optimizers))
    }

    /// Moves `unit`'s optimizer (fp32 master weights, Adam `m` and `v` in the run's `[optimizer]
    /// state_dtype`, copied as stored: int8 codes and absmaxes, bf16 bits) to `place`, between
    /// steps: to the device, the state goes H2D over the link from the CPU optimizer's tier and
    /// the compute copy is made there; from then the unit's fetches move nothing, its gradients
    /// stay on the device and [`Runtime::finish_step`] updates it there after the step's
    /// decision. Back to the host, the state goes D2H into the CPU optimizer (which rewrites the
    /// compute copy's home from it). The state is not changed by the move (bitwise). Its GPU
    /// bytes ([`device_optimizer_bytes`]) are carved out of the residency manager's budget
    /// (evicting other copies if needed). Returns the bytes moved over the link: the master
    /// weights' 4 B per parameter and the moments' [`StateDType::moment_bytes`].
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] during a step, with data-parallel ranks (their optimizer holds a
    /// shard), or when the GPU budget has no room for it beyond the minimum working set (the
    /// message gives the bytes and the fix); swapper, optimizer or candle errors moving state.
    pub fn place_optimizer(&mut self, unit: UnitId, place: OptimizerPlace) -> Result<u64> {
        if self.units.optimizer_place(unit) == place {
            return Ok(0);
        }
        let name = self.units.name(unit).to_string();
        if self.ranks.world().size > 1 {
            return Err(RuntimeError::Usage(format!(
                "place_optimizer({name}): device optimizers with data-parallel ranks are not supported (each rank's \
                 optimizer holds a shard); keep [optimizer] device_units = 0 and [moe] device_optimizer = false"
            )));
        }
        if self.clock.in_step() || self.units.get(unit).update == Update::Pushed {
            return Err(RuntimeError::Usage(format!("place_optimizer({name}) during a step: call it between steps")));
        }
        self.check_working_set()?;
        self.publish(unit)?;
        let u = self.units.get(unit);
        let (tensor, numel, dtype) = (unit.tensor(), u.numel, u.dtype);
        let state_dtype = self.config.optimizer.state_dtype;
        let bytes = device_optimizer_bytes(numel, dtype, state_dtype);
        let moved = (4 * numel + state_dtype.moment_bytes(numel)) as u64;
        match place {
            OptimizerPlace::Device => {
                let room = self.device_optimizer_room()?;
                if bytes > room {
                    return Err(RuntimeError::Usage(format!(
                        "place_optimizer({name}): its device optimizer needs {bytes} GPU bytes (master weights, \
                         {state_dtype} moments, gradients and the compute copy), the GPU budget has {room} bytes \
                         beyond the minimum working set and the device optimizers placed already\n  fix: raise \
                         [budgets] gpu, or lower [optimizer] device_units / [moe] expert_budget"
                    )));
                }
                self.carve.device_optimizers += bytes;
                self.tiers.residency.set_device_budget_bytes(self.carve.residency_bytes())?;
                // The moments go as the CPU optimizer stores them (no re-encoding).
                let state = self.grads.optimizer().export_state(tensor)?;
                let master = self.upload(bytemuck::cast_slice(&state.master), DType::F32)?;
                let moments = DeviceMoments::from_host(&state.moments, |b, dt| self.upload(b, dt))?;
                let copy = master.to_dtype(candle_dtype(dtype)?)?;
                let u = self.units.get_mut(unit);
                let off = match u.kind {
                    Kind::Unscheduled => OffDevice::Unscheduled,
                    _ => OffDevice::Tiered,
                };
                u.kind = Kind::Device { state: Box::new(DeviceState { master, moments, copy, grads: None }), off };
                tracing::debug!(unit = unit.index(), bytes, "runtime: optimizer placed on the device");
                Ok(moved)
            }
            OptimizerPlace::Host => {
                let u = self.units.get_mut(unit);
                let Kind::Device { state: d, off } = std::mem::replace(&mut u.kind, Kind::Tiered) else {
                    unreachable!("placed on the device")
                };
                u.kind = off.into();
                let state = oogc_optimizer::UnitState {
                    master: bytemuck::pod_collect_to_vec(&self.download(&d.master)?),
                    moments: d.moments.to_host(|t| self.download(t))?,
                };
                drop(d);
                self.grads.optimizer().import_state(tensor, state)?;
                self.carve.device_optimizers -= bytes;
                self.tiers.residency.set_device_budget_bytes(self.carve.residency_bytes())?;
                tracing::debug!(unit = unit.index(), bytes, "runtime: optimizer placed on the host");
                Ok(moved)
            }
        }
    }

    /// Bytes of one H2D/D2H piece of a state move: the gradient landing pool's buffers serve
    /// them (at least the largest unit's compute copy), whole f32 elements (so whole elements
    /// of every state dtype).
    fn state_chunk_bytes(&self) -> usize {
        (self.units.largest_bytes(1) as usize / 4).max(1) * 4
    }

    /// `values` (the little-endian bytes of elements of `dtype`) H2D over the link (pieces
    /// through the landing pool and a device buffer), as a tensor `[len]` of `dtype` on the
    /// compute device. No host wait: compute waits for each piece's copy event; the landing
    /// buffers go back to the pool once their copies are complete.
    fn upload(&self, values: &[u8], dtype: DType) -> Result<Tensor> {
        let (device, order) = (self.tiers.device(), self.tiers.order);
        let mut parts = Vec::new();
        let mut in_flight = Vec::new();
        let width = dtype.num_bytes(1);
        for piece in values.chunks(self.state_chunk_bytes()) {
            let mut host = self.grads.landing_buffer(piece.len())?;
            host.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            let dev = order.alloc(device, piece.len())?;
            let (transfer, copied) = order.htod_fresh(device, host, dev)?;
            let (dev, host) = transfer.release_device()?;
            in_flight.push(host);
            order.compute_waits(device, OrderingCall::StateUploadComputeWaits, &copied)?;
            parts.push(device_tensor(&dev, piece.len() / width, dtype, &self.tiers.compute_device)?);
            order.free_after_use(device, OrderingCall::StateUploadFreeAfterRead, dev)?;
        }
        // Between steps: the host buffers go back to the pool here (their copies finish while
        // compute concatenates the pieces).
        let tensor = if parts.is_empty() {
            Tensor::zeros(0, tensor::element_dtype(dtype), &self.tiers.compute_device)?
        } else {
            Tensor::cat(&parts, 0)?
        };
        for host in in_flight {
            drop(host.wait()?);
        }
        Ok(tensor)
    }

    /// A tensor on the compute device (F32, BF16 or U8) D2H over the link (pieces through a
    /// device buffer and the landing pool), as the host bytes of its values.
    fn download(&self, t: &Tensor) -> Result<Vec<u8>> {
        let (device, order) = (self.tiers.device(), self.tiers.order);
        let flat = t.flatten_all()?;
        let dtype = tensor::state_dtype_of(flat.dtype())?;
        let (n, width) = (flat.elem_count(), dtype.num_bytes(1));
        let per = self.state_chunk_bytes() / width;
        let mut out = Vec::with_capacity(n * width);
        let mut start = 0;
        while start < n {
            let len = per.min(n - start);
            let mut dev = order.alloc_for_compute(device, OrderingCall::StateDownloadAlloc, len * width)?;
            tensor::write_to_device(&flat.narrow(0, start, len)?, dtype, &mut dev, device)?;
            let host = self.grads.landing_buffer(len * width)?;
            let transfer = order.dtoh_after_write(device, OrderingCall::StateDownloadDtohAfterWrite, dev, host)?;
            // The host needs the bytes: it waits for this copy (a D2H, between steps).
            let (host, dev) = transfer.wait()?;
            out.extend_from_slice(&host.as_slice()[..len * width]);
            order.free_after_use(device, OrderingCall::StateDownloadFreeAfterWrite, dev)?;
            start += len;
        }
        Ok(out)
    }
}

/// Runs [`adam_step_tensors`] on `device` over torch's AdamW/Adam reference vectors in `dir`
/// (`../shared/fixtures/adamw`: `cases.json` and each case's `p0`, `grads`, `p`, `m`, `v` files)
/// and returns, per case (every case of `cases.json`, or those named in `only`), the largest
/// deviation in units of the fixtures' tolerance (1e-5·|ref| plus 1e-8 for `p`, 1e-6 for `m`,
/// 1e-12 for `v`; ≤ 1 passes), over every step and element. For the unit tests and
/// `oogc gpu-check` (the same update on the GPU).
///
/// # Errors
/// A missing or malformed fixture file (named), a name of `only` not among the cases, candle's.
pub fn adam_fixture_excess(
    dir: &std::path::Path,
    device: &candle_core::Device,
    only: Option<&[&str]>,
) -> Result<Vec<(String, f64)>, String> {
    use oogc_optimizer::{AdamConfig, AdamKind};
    let read = |name: &str| std::fs::read(dir.join(name)).map_err(|e| format!("{}: {e}", dir.join(name).display()));
    let f32s = |name: &str| -> Result<Vec<f32>, String> {
        Ok(read(name)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    };
    let cases: serde_json::Value =
        serde_json::from_slice(&read("cases.json")?).map_err(|e| format!("cases.json: {e}"))?;
    let bad = |what: &str| format!("cases.json: {what}");
    let all = cases["cases"].as_array().ok_or_else(|| bad("no `cases` list"))?;
    if let Some(missing) = only.into_iter().flatten().find(|n| !all.iter().any(|c| c["name"].as_str() == Some(**n))) {
        return Err(bad(&format!("no case named {missing}")));
    }
    let mut out = Vec::new();
    for case in all {
        let num = |k: &str| case[k].as_f64().ok_or_else(|| bad(&format!("`{k}` is not a number")));
        let name = case["name"].as_str().ok_or_else(|| bad("a case without a name"))?;
        if only.is_some_and(|o| !o.contains(&name)) {
            continue;
        }
        let (n, steps) = (num("n")? as usize, num("steps")? as usize);
        let kind = match case["optimizer"].as_str() {
            Some(k) if k.eq_ignore_ascii_case("adam") => AdamKind::Adam,
            _ => AdamKind::AdamW,
        };
        let cfg = AdamConfig {
            beta1: num("beta1")?,
            beta2: num("beta2")?,
            eps: num("eps")?,
            weight_decay: num("weight_decay")?,
            kind,
        };
        let file = |what: &str| f32s(&format!("{name}.{what}.f32"));
        let (p0, grads, p_ref, m_ref, v_ref) = (file("p0")?, file("grads")?, file("p")?, file("m")?, file("v")?);
        let err = |e: candle_core::Error| format!("{name}: {e}");
        let t = |x: &[f32]| Tensor::from_slice(x, x.len(), device).map_err(err);
        let zeros = vec![0.0f32; n];
        let (mut p, mut m, mut v) = (t(&p0)?, t(&zeros)?, t(&zeros)?);
        let mut worst = 0.0f64;
        for s in 0..steps {
            let c = cfg.scalars(s as u64 + 1, num("lr")? as f32, 1.0).map_err(|e| format!("{name}: {e}"))?;
            let g = t(&grads[s * n..(s + 1) * n])?;
            (p, m, v) = adam_step_tensors(&c.element_constants(), &p, &m, &v, &g).map_err(err)?;
            let r = s * n..(s + 1) * n;
            for (got, want, abs) in
                [(&p, &p_ref[r.clone()], 1e-8), (&m, &m_ref[r.clone()], 1e-6), (&v, &v_ref[r], 1e-12)]
            {
                let got = got.to_vec1::<f32>().map_err(err)?;
                for (a, b) in got.iter().zip(want) {
                    let e = f64::from((a - b).abs()) / (1e-5 * f64::from(b.abs()) + abs);
                    worst = if e.is_nan() { f64::INFINITY } else { worst.max(e) };
                }
            }
        }
        out.push((name.to_string(), worst));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use oogc_optimizer::AdamConfig;

    use super::*;

    /// The device update (candle ops, here on the CPU as on the sim device) against torch's
    /// AdamW/Adam vectors, every case and step, within the fixtures' tolerance (the CPU
    /// kernel's, `optimizer/tests/kernel.rs`).
    #[test]
    fn device_update_matches_torch_vectors() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/adamw");
        let excess = adam_fixture_excess(&dir, &Device::Cpu, None)
            .unwrap_or_else(|e| panic!("{e} (the fixtures are ../shared/fixtures/adamw beside the repository)"));
        assert!(excess.len() >= 5, "{excess:?}");
        for (case, e) in &excess {
            assert!(*e <= 1.0, "{case}: {e:.2} × the tolerance");
        }
    }

    /// The clip scale and decoupled decay enter as the CPU kernel's: one element by hand.
    #[test]
    fn clip_scale_and_decay_enter_the_update() {
        let cfg = AdamConfig { weight_decay: 0.1, ..AdamConfig::default() };
        let c = cfg.scalars(1, 1e-2, 0.5).unwrap().element_constants();
        let dev = Device::Cpu;
        let one = |x: f32| Tensor::new(&[x], &dev).unwrap();
        let (p, m, v) = adam_step_tensors(&c, &one(1.0), &one(0.0), &one(0.0), &one(4.0)).unwrap();
        // g = 2 after the scale; m = 0.2, v = 0.004; m̂ = 2, v̂ = 4: p = 1·(1 − 1e-3) − 1e-2·2/(2 + eps).
        let want = 0.999f64 - 1e-2 * 2.0 / (2.0 + 1e-8);
        assert!((f64::from(p.to_vec1::<f32>().unwrap()[0]) - want).abs() < 1e-6);
        assert!((m.to_vec1::<f32>().unwrap()[0] - 0.2).abs() < 1e-7);
        assert!((v.to_vec1::<f32>().unwrap()[0] - 0.004).abs() < 1e-9);
    }
}
