//! How a unit's gradients leave, by its kind ([`Kind`]): kept on the device for a device
//! optimizer; otherwise through a device staging buffer and a D2H copy to the gradient pipe's
//! drain thread (which reduce-scatters them with ranks and submits them to the CPU optimizer), or
//! from host memory straight to the CPU optimizer.

use oogc_optimizer::{GradSlice, Grads};
use oogc_swapper::{DType, Device};

use super::grads::GradSource;
use super::tensor::{swapper_dtype, tensor_values};
use super::unit::{Kind, Update};
use super::{Result, Runtime, RuntimeError, UnitId};

impl Runtime {
    /// Hands `unit`'s gradients to the pipeline: `grads` holds `numel` elements in the unit's
    /// flat layout (any shape, flattened; f32, bf16 or f16 — converted to the compute dtype,
    /// rounded to nearest even, before the copy, so bf16 compute sends half of f32's bytes), on
    /// the compute device. They are written to a device staging buffer, copied D2H on the copy
    /// engine, and submitted to the CPU optimizer by a background thread. Returns as soon as the
    /// D2H copy is queued.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a length mismatch or a non-float tensor; candle failing to
    /// read it; a failure of an earlier submission.
    pub fn push_grads(&mut self, unit: UnitId, grads: &candle_core::Tensor) -> Result<()> {
        self.units.check_grads_len(unit, grads.elem_count(), "push_grads")?;
        swapper_dtype(grads.dtype())?;
        match self.units.get(unit).kind {
            Kind::Device { .. } => self.keep_device_grads(unit, grads),
            _ => self.push_to_device(unit, GradSource::Tensor(grads)),
        }
    }

    /// A unit with its optimizer on the device keeps its gradients there (f32, on the compute
    /// device) until [`Runtime::finish_step`] updates it.
    fn keep_device_grads(&mut self, unit: UnitId, grads: &candle_core::Tensor) -> Result<()> {
        let g = grads.flatten_all()?.to_device(&self.tiers.compute_device)?.to_dtype(candle_core::DType::F32)?;
        let u = self.units.get_mut(unit);
        let name = u.name.clone();
        let d = u.device_mut().expect("checked by the caller");
        if d.grads.is_some() {
            return Err(RuntimeError::Usage(format!("push_grads({name}): a second push of the unit in one step")));
        }
        d.grads = Some(g);
        Ok(())
    }

    /// [`Runtime::push_grads`] from host memory (callers whose gradients are not candle tensors,
    /// such as the Python bindings): `grads` (`[numel]`, f32, bf16 or f16) are converted to the
    /// compute dtype if they are not in it; on the sim device they are copied to the device
    /// staging buffer and D2H as `push_grads` does (the link is what is simulated), on CUDA they
    /// are in host memory already and go to the optimizer directly.
    ///
    /// # Errors
    /// As [`Runtime::push_grads`].
    pub fn push_grads_slice(&mut self, unit: UnitId, grads: GradSlice<'_>) -> Result<()> {
        self.units.check_grads_len(unit, grads.len(), "push_grads_slice")?;
        if let Kind::Device { .. } = self.units.get(unit).kind {
            let g = Grads::converted(grads, DType::F32);
            let GradSlice::F32(values) = g.as_slice() else { unreachable!("converted to f32") };
            let t = candle_core::Tensor::from_slice(values, values.len(), &self.tiers.compute_device)?;
            return self.keep_device_grads(unit, &t);
        }
        let dtype = self.units.get(unit).dtype;
        if matches!(self.tiers.device(), Device::Cuda(_)) {
            return self.submit_from_host(unit, || Ok(Grads::converted(grads, dtype)));
        }
        if grads.dtype() == dtype {
            return self.push_to_device(unit, GradSource::Bytes(grads.as_bytes()));
        }
        let converted = Grads::converted(grads, dtype);
        self.push_to_device(unit, GradSource::Bytes(converted.as_slice().as_bytes()))
    }

    fn push_to_device(&mut self, unit: UnitId, src: GradSource<'_>) -> Result<()> {
        self.grads.check()?;
        let dtype = self.units.get(unit).dtype;
        let stall_s = self.grads.push(unit, src, dtype, self.tiers.device(), self.tiers.order)?;
        self.clock.stats.figures.stall_transfer_s += stall_s;
        self.units.get_mut(unit).update = Update::Pushed;
        self.record_optimizer_write(unit);
        Ok(())
    }

    /// The optimizer will rewrite a scheduled unit's compute copy: its device copy is dead from
    /// here (recorded in the step's trace).
    fn record_optimizer_write(&self, unit: UnitId) {
        let u = self.units.get(unit);
        if u.scheduled() {
            self.scheduler.record_optimizer_write(unit.tensor(), u.home_bytes());
        }
    }

    /// Submits gradients computed on the CPU (after [`Runtime::fetch_host`]; `grads` `[numel]`
    /// on the CPU, converted to the compute dtype as in [`Runtime::push_grads`]) straight to the
    /// CPU optimizer: no device staging, no D2H.
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a length mismatch; the host budget; optimizer errors.
    pub fn push_grads_host(&mut self, unit: UnitId, grads: &candle_core::Tensor) -> Result<()> {
        self.units.check_grads_len(unit, grads.elem_count(), "push_grads_host")?;
        swapper_dtype(grads.dtype())?;
        if let Kind::Device { .. } = self.units.get(unit).kind {
            return self.keep_device_grads(unit, grads);
        }
        let dtype = self.units.get(unit).dtype;
        self.submit_from_host(unit, || tensor_values(grads, dtype))
    }

    /// Submits `unit`'s gradients from host memory straight to the CPU optimizer (`make` builds
    /// them in the compute dtype once their bytes are claimed from the ledger): no staging, no
    /// copy over the link.
    fn submit_from_host(&mut self, unit: UnitId, make: impl FnOnce() -> Result<Grads>) -> Result<()> {
        self.grads.check()?;
        let (numel, dtype) = (self.units.get(unit).numel, self.units.get(unit).dtype);
        let handle = self.grads.submit_host(unit, dtype, numel, make)?;
        let u = self.units.get_mut(unit);
        u.handle = Some(handle);
        u.update = Update::Pushed;
        self.record_optimizer_write(unit);
        Ok(())
    }
}
