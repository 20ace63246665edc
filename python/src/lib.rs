//! Python bindings of oogc (the `oogc._oogc` extension module; the `oogc` Python package wraps
//! it and adds `oogc.torch.offload`). It owns the mapping from Python objects to the library's
//! [`oogc::runtime::Runtime`] and nothing else: no compute, no model code.
//!
//! | Python | Rust |
//! |---|---|
//! | `Runtime(config, default_compute_dtype=None)` | [`Runtime::new`] from a dict or a TOML path (the module-private `config::Config`) |
//! | `Runtime.compute_dtype` | [`Runtime::compute_dtype`]'s name (`"f32"`, `"bf16"`, `"f16"`) |
//! | `Runtime.add_unit(name, numel, init=None)` | [`Runtime::add_unit`], `init` read in place through DLPack (zeros without; bf16 or f16 up-cast exactly) |
//! | `Runtime.fetch(unit, phase, writable=False)` → `Fetched` | [`Runtime::fetch_pinned`]; the pinned compute copy shared as a torch tensor of its dtype without a copy (the module-private `dlpack::Lease`): a CPU tensor on the sim device, a CUDA tensor on a CUDA runtime (the `cuda` feature) |
//! | `Runtime.push_grads(unit, grads)` | [`Runtime::push_grads_slice`], `grads` (f32, bf16 or f16) read in place through DLPack (a CUDA tensor copied to the host first), converted to the compute dtype if they are not in it |
//! | `Runtime.finish_step()` → dict | [`Runtime::finish_step`]'s [`oogc::runtime::StepStats`] |
//! | `Runtime.state_dict()` / `load_state_dict()` | [`Runtime::unit_state`] / [`Runtime::load_unit_state`] |
//! | `OogcError` and subclasses | the module-private `error::Error` |
//!
//! Every call that may block (a fetch waiting for H2D or an optimizer update, a staging buffer,
//! the end of a step, NVMe reads) releases the GIL; the runtime sits behind a mutex taken only
//! without the GIL, so two Python threads never deadlock on it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use oogc::optimizer::{DType, GradSlice, Grads};
use oogc::runtime::{Phase, Runtime, UnitId};
use oogc::swapper::Access;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

mod config;
mod dlpack;
mod error;
mod ranks;

use dlpack::Lease;
use error::{Error, Result};

/// What one Python `Runtime` holds behind its mutex.
struct State {
    rt: Runtime,
    /// Unit names → ids (names are unique: they key the state dict).
    ids: HashMap<String, usize>,
    /// The Adam step of the last finished step that was not skipped (0 before any).
    adam_step: u64,
    /// Where the units' tensors live: `sim` or `cuda:N` (from the config the runtime was built
    /// with).
    device: String,
}

/// The out-of-GPU-core runtime for one model on one device: units of flat parameters whose
/// compute copies (in the compute dtype: f32, bf16 or f16) move between the (sim) GPU, pinned
/// host memory and NVMe, updated from fp32 master weights by a pipelined CPU AdamW.
#[pyclass(module = "oogc._oogc", name = "Runtime", frozen)]
struct PyRuntime {
    state: Mutex<State>,
}

/// A unit argument: its id (int) or its name (str).
fn unit_id(st: &State, unit: &Bound<'_, PyAny>) -> Result<UnitId> {
    if let Ok(name) = unit.cast::<PyString>() {
        let name = name.to_cow()?;
        let name: &str = &name;
        return st
            .ids
            .get(name)
            .ok_or_else(|| Error::Usage(format!("no unit named {name:?} (units: {})", st.ids.len())))
            .and_then(|&i| Ok(st.rt.units().id(i)?));
    }
    let id: usize =
        unit.extract().map_err(|_| Error::Usage(format!("a unit is an int id or a str name, got {unit}")))?;
    st.rt
        .units()
        .id(id)
        .map_err(|_| Error::Usage(format!("unit {id} is not registered ({} units)", st.rt.units().len())))
}

fn label(st: &State, unit: UnitId) -> String {
    format!("unit {} ({:?})", unit.index(), st.rt.units().name(unit))
}

fn phase(name: &str) -> Result<Phase> {
    match name {
        "forward" => Ok(Phase::Forward),
        "backward" => Ok(Phase::Backward),
        "eval" => Ok(Phase::Eval),
        _ => Err(Error::Usage(format!("phase {name:?}: use \"forward\", \"backward\" or \"eval\""))),
    }
}

/// A serde value as a Python object (through JSON: dicts, lists, numbers, strings).
fn to_py<'py, T: serde::Serialize>(py: Python<'py>, value: &T) -> Result<Bound<'py, PyAny>> {
    let text = serde_json::to_string(value).map_err(|e| Error::Usage(format!("serializing a result: {e}")))?;
    Ok(py.import("json")?.call_method1("loads", (text,))?)
}

fn torch_from(py: Python<'_>, values: Vec<f32>) -> Result<Bound<'_, PyAny>> {
    let cap = dlpack::export_values(py, values)?;
    let torch = py.import("torch").map_err(|e| Error::Usage(format!("torch is needed for tensors: {e}")))?;
    Ok(torch.call_method1("from_dlpack", (cap,))?)
}

impl PyRuntime {
    /// Runs `f` on the state without the GIL (the mutex is taken there).
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut State) -> Result<T> + Send) -> Result<T> {
        py.detach(|| f(&mut self.state.lock()))
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (config, *, default_compute_dtype = None))]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>, default_compute_dtype: Option<&str>) -> Result<Self> {
        let default_dtype = default_compute_dtype.map(config::ComputeDType::parse).transpose()?;
        let config = if config.is_instance_of::<PyDict>() {
            let json = py.import("json")?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("default", py.import("builtins")?.getattr("str")?)?;
            let text: String = json.call_method("dumps", (config,), Some(&kwargs))?.extract()?;
            config::Config::from_json(&text)?
        } else if let Ok(path) = config.extract::<PathBuf>() {
            config::Config::from_toml_file(&path)?
        } else {
            return Err(Error::Config(format!(
                "config: expected a dict or the path of a TOML file, got {}",
                config.get_type().name()?
            )));
        };
        // This process's ranks: torch.distributed's after `init_ranks`, else a world of one.
        let ranks = ranks::process_ranks();
        let rc = config.runtime_config(default_dtype, ranks.world())?;
        let device = match rc.device {
            oogc::runtime::DeviceSpec::Sim { .. } => "sim".to_string(),
            oogc::runtime::DeviceSpec::Cuda { ordinal, .. } => format!("cuda:{ordinal}"),
        };
        let rt = py.detach(|| Runtime::new(rc, ranks))?;
        Ok(Self { state: Mutex::new(State { rt, ids: HashMap::new(), adam_step: 0, device }) })
    }

    /// Registers a unit and returns its id (units are numbered 0, 1, ... in registration order).
    /// `init` is its fp32 master weights (bf16 or f16 are up-cast exactly).
    #[pyo3(signature = (name, numel, init = None))]
    fn add_unit(&self, py: Python<'_>, name: &str, numel: usize, init: Option<&Bound<'_, PyAny>>) -> Result<usize> {
        if self.state.lock().ids.contains_key(name) {
            return Err(Error::Usage(format!(
                "add_unit({name:?}): a unit of that name exists (names key the state dict)"
            )));
        }
        if numel == 0 {
            return Err(Error::Usage(format!("add_unit({name:?}): a unit needs at least one parameter")));
        }
        let add = |values: &[f32]| self.with(py, |st| Ok(st.rt.add_unit(name, values)?.index()));
        let id = match init {
            None => add(&vec![0.0; numel])?,
            Some(init) => dlpack::read_floats(init, &format!("add_unit({name:?}) init"), |values| {
                if values.len() != numel {
                    return Err(Error::Usage(format!(
                        "add_unit({name:?}): init has {} elements, numel is {numel}",
                        values.len()
                    )));
                }
                match values {
                    GradSlice::F32(values) => add(values),
                    // Every bf16 and f16 value is an f32: the master weights are the init exactly.
                    other => match Grads::converted(other, DType::F32) {
                        Grads::F32(values) => add(&values),
                        _ => unreachable!("converted to f32"),
                    },
                }
            })??,
        };
        self.state.lock().ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// Starts step `step` (1-based, Adam's t) with learning rate `lr`; the first call checks the
    /// GPU budget against the minimum working set. Raises UsageError, OutOfMemoryError.
    fn begin_step(&self, py: Python<'_>, step: u64, lr: f32) -> Result<()> {
        if step == 0 {
            return Err(Error::Usage("begin_step: steps are 1-based (Adam's t)".into()));
        }
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::Usage(format!("begin_step: lr {lr} must be finite and >= 0")));
        }
        self.with(py, |st| Ok(st.rt.begin_step(step, lr)?))
    }

    /// Pins `unit` (id or name) on the device for `phase` ("forward", "backward" or "eval")
    /// and returns a `Fetched`: `with rt.fetch(u) as t:` yields its `[numel]` parameters in the
    /// compute dtype as a torch tensor over the pinned copy (no copy; a CUDA tensor on a CUDA
    /// runtime), revoked and unpinned on exit. Raises UsageError, OutOfMemoryError, StorageError.
    #[pyo3(signature = (unit, phase = "forward", writable = false))]
    fn fetch(&self, py: Python<'_>, unit: &Bound<'_, PyAny>, phase: &str, writable: bool) -> Result<Fetched> {
        let ph = self::phase(phase)?;
        let (unit, label, numel) = {
            let st = self.state.lock();
            let u = unit_id(&st, unit)?;
            (u, label(&st, u), st.rt.units().numel(u))
        };
        let access = if writable { Access::Write } else { Access::Read };
        let pinned = self.with(py, |st| Ok(st.rt.fetch_pinned(unit, ph, access)?))?;
        // torch computes on its own stream, which the runtime's event waits do not order: the
        // host waits for the unit's H2D before the memory is shared.
        py.detach(|| pinned.wait_arrival())?;
        let dtype = pinned.dtype().name();
        Ok(Fetched { lease: Lease::new(pinned, label), unit: unit.index(), numel, dtype, writable })
    }

    /// Hands `unit`'s gradients (`[numel]` float32, bfloat16 or float16, contiguous, CPU; read in
    /// place through DLPack, converted to the compute dtype, rounded to nearest even, if they are
    /// not in it) to the CPU optimizer, once per unit per step. A CUDA torch tensor is copied to
    /// the host first (`.cpu()`, after torch's current stream) and pushed from there; a
    /// device-to-device path (no host hop) is future work. Raises UsageError.
    fn push_grads(&self, py: Python<'_>, unit: &Bound<'_, PyAny>, grads: &Bound<'_, PyAny>) -> Result<()> {
        let (unit, label) = {
            let st = self.state.lock();
            let u = unit_id(&st, unit)?;
            (u, label(&st, u))
        };
        dlpack::read_floats(grads, &format!("push_grads({label})"), |values| {
            self.with(py, |st| Ok(st.rt.push_grads_slice(unit, values)?))
        })?
    }

    /// Marks the turn from forward to backward (optional; per-phase stats).
    fn end_forward(&self, py: Python<'_>) -> Result<()> {
        self.with(py, |st| {
            st.rt.end_forward();
            Ok(())
        })
    }

    /// Ends the step (all gradients pushed, the updates committed, clipped or skipped) and
    /// returns its stats as a dict (`step`, `step_s`, `h2d_bytes`, `d2h_bytes`,
    /// `nvme_read_bytes`, `nvme_write_bytes`, `grad_norm`, `skipped`, ...). Raises UsageError.
    fn finish_step<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyAny>> {
        let stats = self.with(py, |st| {
            let stats = st.rt.finish_step()?;
            if !stats.figures.skipped {
                st.adam_step = stats.step;
            }
            Ok(stats)
        })?;
        to_py(py, &stats)
    }

    /// Waits for every pending optimizer update.
    fn sync(&self, py: Python<'_>) -> Result<()> {
        self.with(py, |st| Ok(st.rt.sync()?))
    }

    /// Checks the GPU budget against the minimum working set. Raises OutOfMemoryError.
    fn check_working_set(&self, py: Python<'_>) -> Result<()> {
        self.with(py, |st| Ok(st.rt.check_working_set()?))
    }

    /// Device bytes a step needs at the least with `max_units_in_use` units pinned at once.
    #[pyo3(signature = (max_units_in_use = 1))]
    fn min_working_set_bytes(&self, max_units_in_use: usize) -> u64 {
        self.state.lock().rt.memory().min_working_set_bytes(max_units_in_use)
    }

    /// How many units the trainer keeps pinned at once (for the working-set check).
    fn set_max_units_in_use(&self, units: usize) {
        self.state.lock().rt.set_max_units_in_use(units);
    }

    /// Where the units' tensors live: `"sim"` (CPU tensors) or `"cuda:N"` (CUDA tensors on GPU
    /// `N`).
    #[getter]
    fn device(&self) -> String {
        self.state.lock().device.clone()
    }

    /// The compute copies' and gradients' element type: `"f32"`, `"bf16"` or `"f16"`.
    #[getter]
    fn compute_dtype(&self) -> &'static str {
        self.state.lock().rt.compute_dtype().name()
    }

    /// Units registered.
    #[getter]
    fn num_units(&self) -> usize {
        self.state.lock().rt.units().len()
    }

    /// `(name, numel)` of each unit, in id order.
    #[getter]
    fn units(&self) -> Vec<(String, usize)> {
        let st = self.state.lock();
        let units = st.rt.units();
        units.ids().map(|u| (units.name(u).to_string(), units.numel(u))).collect()
    }

    /// The last finished, not skipped, step (0 before any).
    #[getter]
    fn step(&self) -> u64 {
        self.state.lock().adam_step
    }

    /// A unit's id from its id or name. Raises UsageError.
    fn unit_id(&self, unit: &Bound<'_, PyAny>) -> Result<usize> {
        Ok(unit_id(&self.state.lock(), unit)?.index())
    }

    /// Whether the unit has a copy on the device now.
    fn is_on_device(&self, unit: &Bound<'_, PyAny>) -> Result<bool> {
        let st = self.state.lock();
        let u = unit_id(&st, unit)?;
        Ok(st.rt.memory().is_on_device(u))
    }

    /// Per link (`htod`, `dtoh`, `nvme_read`, `nvme_write`): bytes, ops, busy seconds; stalls,
    /// evictions, prefetch hits.
    fn traffic<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyAny>> {
        let t = self.state.lock().rt.memory().traffic();
        to_py(py, &t)
    }

    /// Peak bytes per tier (`device`, `host`, `nvme`, `host_ledger`).
    fn peak_bytes<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyAny>> {
        let p = self.state.lock().rt.memory().peak_bytes();
        to_py(py, &p)
    }

    /// Copies of a unit's master weights, `exp_avg`, `exp_avg_sq` (`[numel]` float32 each).
    fn unit_state<'py>(
        &self,
        py: Python<'py>,
        unit: &Bound<'py, PyAny>,
    ) -> Result<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let unit = unit_id(&self.state.lock(), unit)?;
        let (master, m, v) = self.with(py, |st| Ok(st.rt.unit_state(unit)?.into_f32()))?;
        Ok((torch_from(py, master)?, torch_from(py, m)?, torch_from(py, v)?))
    }

    /// Replaces a unit's master weights and moments (`[numel]` float32 each). Raises UsageError.
    fn load_unit_state(
        &self,
        py: Python<'_>,
        unit: &Bound<'_, PyAny>,
        master: &Bound<'_, PyAny>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
    ) -> Result<()> {
        let (unit, label) = {
            let st = self.state.lock();
            let u = unit_id(&st, unit)?;
            (u, label(&st, u))
        };
        let master = dlpack::read_f32(master, &format!("load_unit_state({label}) master"), <[f32]>::to_vec)?;
        let m = dlpack::read_f32(exp_avg, &format!("load_unit_state({label}) exp_avg"), <[f32]>::to_vec)?;
        let v = dlpack::read_f32(exp_avg_sq, &format!("load_unit_state({label}) exp_avg_sq"), <[f32]>::to_vec)?;
        let state = oogc::optimizer::UnitState::from_f32(master, m, v)
            .map_err(|e| Error::Usage(format!("load_unit_state({label}): {e}")))?;
        self.with(py, |st| Ok(st.rt.load_unit_state(unit, state)?))
    }

    /// `{"step": int, "units": {name: {"master", "exp_avg", "exp_avg_sq"}}}` (tensor copies).
    fn state_dict<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyDict>> {
        self.sync(py)?;
        let (ids, step) = {
            let st = self.state.lock();
            (st.rt.units().ids().collect::<Vec<_>>(), st.adam_step)
        };
        let units = PyDict::new(py);
        for u in ids {
            let name = self.state.lock().rt.units().name(u).to_string();
            let (master, m, v) = self.with(py, |st| Ok(st.rt.unit_state(u)?.into_f32()))?;
            let entry = PyDict::new(py);
            entry.set_item("master", torch_from(py, master)?)?;
            entry.set_item("exp_avg", torch_from(py, m)?)?;
            entry.set_item("exp_avg_sq", torch_from(py, v)?)?;
            units.set_item(name, entry)?;
        }
        let sd = PyDict::new(py);
        sd.set_item("step", step)?;
        sd.set_item("units", units)?;
        Ok(sd)
    }

    /// Restores `state_dict()`'s output into a runtime with the same units. Raises UsageError.
    fn load_state_dict(&self, py: Python<'_>, state_dict: &Bound<'_, PyDict>) -> Result<()> {
        let step: u64 = state_dict
            .get_item("step")?
            .ok_or_else(|| Error::Usage("load_state_dict: no \"step\" key".into()))?
            .extract()?;
        let units =
            state_dict.get_item("units")?.ok_or_else(|| Error::Usage("load_state_dict: no \"units\" key".into()))?;
        let units =
            units.cast::<PyDict>().map_err(|_| Error::Usage("load_state_dict: \"units\" is not a dict".into()))?;
        let names: Vec<String> = self.units().into_iter().map(|(n, _)| n).collect();
        for name in &names {
            if !units.contains(name)? {
                return Err(Error::Usage(format!("load_state_dict: no state for unit {name:?}")));
            }
        }
        if units.len() != names.len() {
            return Err(Error::Usage(format!(
                "load_state_dict: {} units in the state dict, {} registered",
                units.len(),
                names.len()
            )));
        }
        for name in &names {
            let entry = units.get_item(name)?.expect("checked above");
            let get = |key: &str| {
                entry.get_item(key).map_err(|_| Error::Usage(format!("load_state_dict: unit {name:?} has no {key:?}")))
            };
            let unit = PyString::new(py, name);
            self.load_unit_state(py, unit.as_any(), &get("master")?, &get("exp_avg")?, &get("exp_avg_sq")?)?;
        }
        self.state.lock().adam_step = step;
        Ok(())
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock();
        format!(
            "Runtime(units={}, step={}, compute_dtype={:?})",
            st.rt.units().len(),
            st.adam_step,
            st.rt.compute_dtype().name()
        )
    }
}

/// A unit pinned on the device by `Runtime.fetch` until released (a context manager: the
/// `with` block's end releases it). See the stubs (`oogc/_oogc.pyi`).
#[pyclass(module = "oogc._oogc", frozen)]
struct Fetched {
    lease: Arc<Lease>,
    #[pyo3(get)]
    unit: usize,
    #[pyo3(get)]
    numel: usize,
    /// The compute copy's element type (`"f32"`, `"bf16"`, `"f16"`).
    #[pyo3(get)]
    dtype: &'static str,
    #[pyo3(get)]
    writable: bool,
}

#[pymethods]
impl Fetched {
    /// The unit's `[numel]` parameters, in the unit's dtype, as a torch tensor over the pinned
    /// copy (the same tensor on every call); a read fetch's tensor refuses in-place writes.
    /// Raises UsageError after release.
    fn tensor(&self, py: Python<'_>) -> Result<Py<PyAny>> {
        self.lease.torch_tensor(py)
    }

    /// Revokes the tensors (any later access to their data raises RuntimeError) and unpins the
    /// unit, or, while a borrowed DLPack export lives, when it is freed. Idempotent.
    fn release(&self, py: Python<'_>) -> Result<()> {
        self.lease.release(py)
    }

    /// `release()` was called.
    #[getter]
    fn released(&self) -> bool {
        self.lease.is_released()
    }

    /// The unit is still pinned.
    #[getter]
    fn pinned(&self) -> bool {
        self.lease.is_pinned()
    }

    fn __enter__(&self, py: Python<'_>) -> Result<Py<PyAny>> {
        self.lease.torch_tensor(py)
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> Result<bool> {
        self.lease.release(py)?;
        Ok(false)
    }

    /// A borrowed DLPack capsule over the pinned copy (`kDLCPU` on the sim device, `kDLCUDA` on a
    /// GPU): the unit stays pinned until the consumer frees it. `stream` is ignored: the unit's
    /// H2D was waited for on the host before the fetch returned (`PinnedUnit::wait_arrival`), so
    /// the memory is ready for any stream.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> Result<Bound<'py, PyAny>> {
        let _ = (stream, max_version);
        if let Some(dev) = dl_device {
            let here = self.lease.device()?;
            if dev != here {
                return Err(Error::Usage(format!(
                    "__dlpack__: the unit's memory is on DLPack device {here:?}, not {dev:?} (a fetch is shared, not \
                     copied)"
                )));
            }
        }
        if copy == Some(true) {
            return Err(Error::Usage(
                "__dlpack__(copy=True): a fetch is shared, not copied; copy the array yourself".into(),
            ));
        }
        self.lease.export(py)
    }

    /// `(1, 0)` (`kDLCPU`) on the sim device, `(2, ordinal)` (`kDLCUDA`) on a GPU.
    /// Raises UsageError after release (unless asked or exported before).
    fn __dlpack_device__(&self) -> Result<(i32, i32)> {
        self.lease.device()
    }

    fn __repr__(&self) -> String {
        let state = if self.lease.is_released() { "released" } else { "pinned" };
        format!(
            "Fetched(unit={}, numel={}, dtype={:?}, writable={}, {state})",
            self.unit, self.numel, self.dtype, self.writable
        )
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        // Collected without release(): revoke its tensors and unpin now, as release() does.
        Python::attach(|py| {
            if let Err(e) = self.lease.release(py) {
                PyErr::from(e).write_unraisable(py, None);
            }
        });
    }
}

/// The extension module.
#[pymodule]
fn _oogc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyRuntime>()?;
    m.add_class::<Fetched>()?;
    m.add_function(wrap_pyfunction!(ranks::init_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(ranks::world, m)?)?;
    m.add("OogcError", py.get_type::<error::OogcError>())?;
    m.add("ConfigError", py.get_type::<error::ConfigError>())?;
    m.add("UsageError", py.get_type::<error::UsageError>())?;
    m.add("OutOfMemoryError", py.get_type::<error::OutOfMemoryError>())?;
    m.add("StorageError", py.get_type::<error::StorageError>())?;
    m.add("DeviceError", py.get_type::<error::DeviceError>())?;
    Ok(())
}
