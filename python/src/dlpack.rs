//! DLPack in and out: the crate's one `unsafe` (FFI with the DLPack C structs and Python
//! capsules), fenced here.
//!
//! | direction | what | who owns the memory |
//! |---|---|---|
//! | out, revocable | [`Lease::torch_tensor`]: a torch tensor over the pinned compute copy (in the unit's dtype; a CPU tensor on the sim device, a CUDA tensor on a CUDA runtime) | the [`Lease`]; at [`Lease::release`] every such tensor's storage is made to raise on any data access (torch's `_set_storage_data_ptr_access_error_msg`, what cudagraph trees use for outputs whose memory was reused), then the unit is unpinned |
//! | out, borrowed | [`Lease::export`] (`Fetched.__dlpack__`): any DLPack consumer (numpy, jax, `torch.from_dlpack(fetched)`) | the consumer holds a borrow: the unit stays pinned until the consumer frees the array, even past release |
//! | out, owned | [`export_values`]: a `Vec<f32>` handed to the consumer (`unit_state`) | the consumer |
//! | in | [`read_floats`]: a 1-D float32, bfloat16 or float16 CPU tensor or array read in place through `__dlpack__` as a [`GradSlice`] ([`read_f32`]: float32 only); a CUDA torch tensor is first copied to the host (`.cpu()`) | the producer, kept alive until the read returns |
//!
//! Dtypes: a unit's compute copy is exported in its dtype ([`PinnedUnit::dtype`], the runtime's
//! compute dtype): f32 as `kDLFloat` 32 bits, f16 as `kDLFloat` 16 bits, bf16 as `kDLBfloat`
//! 16 bits; the element count is the copy's bytes over the dtype's size.
//!
//! Devices: a [`DeviceMemory::Host`] unit (the sim device) is exported as `kDLCPU` memory; a
//! [`DeviceMemory::Cuda`] unit as `kDLCUDA` memory (device type 2) on its GPU's ordinal, the data
//! pointer being the device address, in the same dtype and shape. Both kinds of export work
//! alike for CUDA memory (torch's storage access-error hook is device-agnostic: cudagraph trees
//! use it on CUDA storages).
//!
//! Streams, out: the runtime orders its own compute stream after a unit's H2D by an event, which
//! does not order torch's stream; so `Runtime.fetch` waits on the host for the H2D
//! (`PinnedUnit::wait_arrival`) before it hands out the pin, and the memory is ready for any
//! stream when it is exported: `__dlpack__(stream=...)` needs no event and ignores the
//! consumer's stream. Back: torch's kernels that read or write a unit are
//! queued on torch's stream and may still run when the Python call that launched them returns,
//! so before [`Lease::release`] unpins a CUDA unit (which lets the runtime write it, evict it or
//! reuse its memory on its own streams) it synchronises torch's current stream of that GPU
//! (`torch.cuda.current_stream(ordinal).synchronize()`, when torch is imported). Work the caller
//! queued on other streams is theirs to synchronise before the release; a borrowed export freed
//! after the release unpins at once, so its consumer synchronises before freeing it.
//!
//! The layouts are DLPack 0.8's `DLTensor` / `DLManagedTensor` (the "legacy" capsule, named
//! `dltensor`, that every consumer accepts); `__dlpack__` is called without `max_version`, so
//! producers return that one too.

#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

use oogc::optimizer::{DType, GradSlice};
use oogc::runtime::{DeviceMemory, PinnedUnit};
use parking_lot::Mutex;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::error::{Error, Result};

/// `kDLCPU`.
const DL_CPU: i32 = 1;
/// `kDLCUDA`: GPU memory.
const DL_CUDA: i32 = 2;
/// `kDLCUDAHost`: page-locked host memory, readable by the CPU.
const DL_CUDA_HOST: i32 = 3;
/// `kDLFloat`.
const DL_FLOAT: u8 = 2;
/// `kDLBfloat`.
const DL_BFLOAT: u8 = 4;
const DLTENSOR: &CStr = c"dltensor";
const USED_DLTENSOR: &CStr = c"used_dltensor";

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

impl DlDevice {
    const CPU: Self = Self { device_type: DL_CPU, device_id: 0 };

    /// `(device_type, device_id)`, what `__dlpack_device__` returns.
    fn pair(self) -> (i32, i32) {
        (self.device_type, self.device_id)
    }
}

/// A pinned unit's memory as DLPack describes it: 1-D, contiguous, `numel` elements of `dtype`
/// at `data` on `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DlView {
    data: *mut c_void,
    numel: usize,
    dtype: DlDataType,
    device: DlDevice,
}

impl DlView {
    /// The DLPack view of a unit's memory: host memory (the sim device) as `kDLCPU`, a CUDA
    /// GPU's as `kDLCUDA` on its ordinal (the device address as the data pointer); `label`
    /// names the unit in errors.
    fn of(memory: DeviceMemory, label: &str) -> Result<Self> {
        let float = |dtype: DType| {
            DlDataType::of(dtype).ok_or_else(|| {
                Error::Usage(format!("{label}: its compute copy is {dtype}, not a float type DLPack shares"))
            })
        };
        match memory {
            DeviceMemory::Host { ptr, num_bytes, dtype } => {
                // The runtime hands out 8-byte-aligned host memory of whole elements.
                debug_assert_eq!(num_bytes % dtype.size_in_bytes(), 0);
                debug_assert_eq!(ptr.addr() % dtype.size_in_bytes(), 0);
                Ok(Self {
                    data: ptr.cast::<c_void>(),
                    numel: num_bytes / dtype.size_in_bytes(),
                    dtype: float(dtype)?,
                    device: DlDevice::CPU,
                })
            }
            DeviceMemory::Cuda { ptr, num_bytes, dtype, ordinal } => {
                // Device allocations are at least 256-byte aligned, of whole elements.
                debug_assert_eq!(num_bytes % dtype.size_in_bytes(), 0);
                debug_assert_eq!(ptr % dtype.size_in_bytes() as u64, 0);
                let device_id = i32::try_from(ordinal)
                    .map_err(|_| Error::Usage(format!("{label}: GPU ordinal {ordinal} does not fit DLPack")))?;
                Ok(Self {
                    // A device address, never dereferenced here: DLPack carries it as a pointer.
                    data: std::ptr::without_provenance_mut(usize::try_from(ptr).map_err(|_| {
                        Error::Usage(format!("{label}: device address {ptr:#x} does not fit a pointer"))
                    })?),
                    numel: num_bytes / dtype.size_in_bytes(),
                    dtype: float(dtype)?,
                    device: DlDevice { device_type: DL_CUDA, device_id },
                })
            }
            #[allow(unreachable_patterns)]
            _ => Err(Error::Usage(format!("{label}: its memory is on a device DLPack is not given yet"))),
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

impl DlDataType {
    const F32: Self = Self { code: DL_FLOAT, bits: 32, lanes: 1 };
    const F16: Self = Self { code: DL_FLOAT, bits: 16, lanes: 1 };
    const BF16: Self = Self { code: DL_BFLOAT, bits: 16, lanes: 1 };

    /// A float dtype of the runtime as DLPack spells it (`None` for a non-float).
    fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::BF16 => Some(Self::BF16),
            DType::F16 => Some(Self::F16),
            _ => None,
        }
    }

    /// The runtime's dtype of a DLPack float dtype it handles (`None` for any other).
    fn float(self) -> Option<DType> {
        [DType::F32, DType::BF16, DType::F16].into_iter().find(|&d| Self::of(d) == Some(self))
    }

    /// For messages: torch's name where there is one (`bfloat16`), else the codes.
    fn describe(self) -> String {
        let name = match (self.code, self.bits, self.lanes) {
            (DL_FLOAT, 16, 1) => "float16",
            (DL_FLOAT, 32, 1) => "float32",
            (DL_FLOAT, 64, 1) => "float64",
            (DL_BFLOAT, 16, 1) => "bfloat16",
            (0, 8, 1) => "int8",
            (0, 16, 1) => "int16",
            (0, 32, 1) => "int32",
            (0, 64, 1) => "int64",
            (1, 8, 1) => "uint8",
            (6, 8, 1) => "bool",
            _ => return format!("DLPack dtype code {} with {} bits and {} lanes", self.code, self.bits, self.lanes),
        };
        name.to_string()
    }
}

/// torch's name of a float dtype of the runtime (`float32`, `bfloat16`, `float16`).
fn torch_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => other.name(),
    }
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// One exported tensor: the managed tensor first (so a `*mut DlManagedTensor` is a `*mut
/// Export`), its shape and strides, and what keeps its memory alive.
#[repr(C)]
struct Export {
    managed: DlManagedTensor,
    shape: [i64; 1],
    strides: [i64; 1],
    /// Dropped by the deleter: a [`Borrow`] (the unit stays pinned until then), a `Vec<f32>`
    /// (the values themselves), or nothing (a revocable export; its [`Lease`] revokes it).
    _keep: Option<Box<dyn Any + Send>>,
}

/// The deleter of every tensor exported here: frees the [`Export`] and what it keeps.
///
/// # Safety
/// `managed` is null or the `managed` field of an `Export` leaked by [`capsule`], and the
/// deleter is called once (the DLPack contract for consumers; the capsule destructor calls it
/// only for an unconsumed capsule).
unsafe extern "C" fn export_deleter(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the first field of a `#[repr(C)]` `Export` that `capsule` leaked from
    // a `Box`, and this is the one call that frees it (see the function's contract).
    drop(unsafe { Box::from_raw(managed.cast::<Export>()) });
}

/// The destructor of the capsules made here: a capsule that no consumer took (still named
/// `dltensor`) frees its tensor; a consumed one (`used_dltensor`) belongs to its consumer.
///
/// # Safety
/// Called by Python, with the GIL held, on a capsule made by [`capsule`].
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule object (Python calls its destructor once, with the
    // GIL); `PyCapsule_IsValid` sets no exception.
    if unsafe { ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) } == 1 {
        // SAFETY: the capsule is valid under that name, so its pointer is our `DlManagedTensor`.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) }.cast::<DlManagedTensor>();
        // SAFETY: no consumer took it, so the deleter has not run; this is its one call.
        unsafe { export_deleter(managed) };
    }
}

/// A `dltensor` capsule over `view` (1-D, contiguous, on its device), keeping `keep` alive
/// until the consumer's deleter runs.
///
/// The caller guarantees that the view's data is aligned for its dtype and stays valid for
/// reads and writes of its elements for as long as the consumer may touch them: while `keep`
/// lives, or until a [`Lease`] revokes the consumer's access before the memory goes.
fn capsule<'py>(py: Python<'py>, view: DlView, keep: Option<Box<dyn Any + Send>>) -> PyResult<Bound<'py, PyAny>> {
    let DlView { data, numel, dtype, device } = view;
    let mut export = Box::new(Export {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data,
                device,
                ndim: 1,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(export_deleter),
        },
        shape: [numel as i64],
        strides: [1],
        _keep: keep,
    });
    // The box's contents do not move from here on: the pointers into it stay valid.
    export.managed.dl_tensor.shape = export.shape.as_mut_ptr();
    export.managed.dl_tensor.strides = export.strides.as_mut_ptr();
    let raw = Box::into_raw(export);
    // SAFETY: `raw` points at the live `Export` just leaked.
    unsafe { (*raw).managed.manager_ctx = raw.cast::<c_void>() };
    // SAFETY: `raw` is a valid pointer that the capsule owns from here (freed by the destructor
    // or a consumer's deleter); the name is a `'static` C string; the GIL is held (`py`).
    let obj = unsafe { ffi::PyCapsule_New(raw.cast::<c_void>(), DLTENSOR.as_ptr(), Some(capsule_destructor)) };
    if obj.is_null() {
        // SAFETY: the capsule was not made, so the export is still ours to free, once.
        unsafe { export_deleter(raw.cast::<DlManagedTensor>()) };
    }
    // SAFETY: `obj` is a new reference (or null with a Python error set), as `from_owned_ptr_or_err` expects.
    unsafe { Bound::from_owned_ptr_or_err(py, obj) }
}

/// `values` handed to a DLPack consumer (it owns them from here): a `[len]` float32 CPU tensor.
///
/// # Errors
/// Python failed to make the capsule.
pub fn export_values(py: Python<'_>, mut values: Vec<f32>) -> PyResult<Bound<'_, PyAny>> {
    let (data, numel) = (values.as_mut_ptr(), values.len());
    // The vector's heap block does not move when the vector does; the capsule keeps it.
    let view = DlView { data: data.cast::<c_void>(), numel, dtype: DlDataType::F32, device: DlDevice::CPU };
    capsule(py, view, Some(Box::new(values)))
}

/// A fetched unit's pin, shared by the `Fetched` object and the DLPack exports of its memory.
/// See the module docs for the two kinds of export.
pub struct Lease {
    state: Mutex<LeaseState>,
    /// For messages: `unit 3 ('layers.0')`.
    label: String,
}

struct LeaseState {
    /// `None` once unpinned.
    pinned: Option<PinnedUnit>,
    /// [`Lease::release`] was called.
    released: bool,
    /// Borrowed exports alive (their consumers have not freed them).
    borrowers: usize,
    /// The revocable torch tensors made so far (invalidated at release).
    tensors: Vec<Revocable>,
    /// Where the memory is (`kDLCPU` for the sim device, `kDLCUDA` and the ordinal for a GPU),
    /// once asked or exported: a unit never exported had no consumer to synchronise with.
    device: Option<DlDevice>,
    /// `torch._C._set_storage_data_ptr_access_error_msg`, taken with the first tensor: release
    /// calls it without importing anything (it may run at interpreter exit, from a collected
    /// `Fetched`).
    revoke: Option<Py<PyAny>>,
}

/// A revocable tensor and its storage's handle (`untyped_storage()._cdata`, valid while the
/// tensor keeps the storage alive).
struct Revocable {
    tensor: Py<PyAny>,
    cdata: Py<PyAny>,
}

/// What a borrowed export keeps: one borrow of the lease's pin, given back when the consumer
/// frees the array (the unit is unpinned then if the lease was released).
struct Borrow(Arc<Lease>);

impl Drop for Borrow {
    fn drop(&mut self) {
        let mut st = self.0.state.lock();
        st.borrowers -= 1;
        if st.released && st.borrowers == 0 {
            st.pinned = None;
        }
    }
}

impl Lease {
    /// A lease over a pinned unit; `label` names it in messages.
    pub fn new(pinned: PinnedUnit, label: String) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(LeaseState {
                pinned: Some(pinned),
                released: false,
                borrowers: 0,
                tensors: Vec::new(),
                device: None,
                revoke: None,
            }),
            label,
        })
    }

    /// `(device_type, device_id)` of the memory as DLPack spells it: `(1, 0)` for the sim
    /// device's host memory, `(2, ordinal)` for a CUDA GPU's.
    ///
    /// # Errors
    /// [`Error::Usage`] after release when it was never asked nor exported before.
    pub fn device(&self) -> Result<(i32, i32)> {
        let mut st = self.state.lock();
        match st.device {
            Some(device) => Ok(device.pair()),
            None => Ok(Self::memory(&mut st, &self.label)?.0.device.pair()),
        }
    }

    /// Whether [`Lease::release`] was called.
    pub fn is_released(&self) -> bool {
        self.state.lock().released
    }

    /// Whether the unit is still pinned (after release: until the last borrowed export is freed).
    pub fn is_pinned(&self) -> bool {
        self.state.lock().pinned.is_some()
    }

    /// The pinned memory as DLPack sees it, and whether it is writable; the device is
    /// remembered (for [`Lease::release`]'s synchronisation).
    fn memory(st: &mut LeaseState, label: &str) -> Result<(DlView, bool)> {
        let pinned = st.pinned.as_ref().filter(|_| !st.released).ok_or_else(|| released_error(label))?;
        let view = DlView::of(pinned.memory()?, label)?;
        let writable = pinned.is_writable();
        st.device = Some(view.device);
        Ok((view, writable))
    }

    /// The unit's flat parameters as a torch tensor (`[numel]` in the unit's dtype: float32,
    /// bfloat16 or float16; CPU on the sim device, CUDA on a GPU) over the pinned compute copy,
    /// without a copy. The same tensor on every call. A read lease's tensor refuses in-place
    /// writes (torch's `_set_throw_on_mutable_data_ptr`); after [`Lease::release`] any access to
    /// its data, or to a view's, raises `RuntimeError`.
    ///
    /// # Errors
    /// [`Error::Usage`] after release or without torch (or a torch without the two private
    /// hooks, before 2.1); torch's own errors.
    pub fn torch_tensor(self: &Arc<Self>, py: Python<'_>) -> Result<Py<PyAny>> {
        // The lock is never held across a call into Python: a garbage collection there may free
        // a borrowed export, whose deleter takes it.
        let (view, writable) = {
            let mut st = self.state.lock();
            if let (Some(t), false) = (st.tensors.first(), st.released) {
                return Ok(t.tensor.clone_ref(py));
            }
            Self::memory(&mut st, &self.label)?
        };
        let torch = import_torch(py)?;
        let c = torch.getattr("_C")?;
        for hook in ["_set_storage_data_ptr_access_error_msg", "_set_throw_on_mutable_data_ptr"] {
            if !c.hasattr(hook)? {
                return Err(Error::Usage(format!(
                    "this torch has no torch._C.{hook}, which oogc needs to revoke a released tensor: use torch >= 2.3"
                )));
            }
        }
        // Revocable: the capsule keeps nothing; `release` makes the tensor raise before it unpins.
        let cap = capsule(py, view, None)?;
        let tensor = torch.call_method1("from_dlpack", (cap,))?;
        if !writable {
            c.call_method1("_set_throw_on_mutable_data_ptr", (&tensor,))?;
        }
        let revocable = Revocable {
            cdata: tensor.call_method0("untyped_storage")?.getattr("_cdata")?.unbind(),
            tensor: tensor.unbind(),
        };
        let revoke = c.getattr("_set_storage_data_ptr_access_error_msg")?.unbind();
        let tensor = revocable.tensor.clone_ref(py);
        let mut st = self.state.lock();
        if st.released {
            // Released while torch made it (another thread): revoke it before anyone sees it.
            drop(st);
            self.invalidate(py, Some(revoke), vec![revocable])?;
            return Err(released_error(&self.label));
        }
        st.tensors.push(revocable);
        st.revoke.get_or_insert(revoke);
        Ok(tensor)
    }

    /// A borrowed `dltensor` capsule over the pinned memory for any DLPack consumer: the unit
    /// stays pinned until the consumer frees it, even past [`Lease::release`]. For CUDA memory
    /// the consumer must synchronise its stream before it frees the array after a release (the
    /// unit is unpinned at once then; see the module docs).
    ///
    /// # Errors
    /// [`Error::Usage`] after release.
    pub fn export<'py>(self: &Arc<Self>, py: Python<'py>) -> Result<Bound<'py, PyAny>> {
        let mut st = self.state.lock();
        let (view, _) = Self::memory(&mut st, &self.label)?;
        st.borrowers += 1;
        drop(st);
        // The borrow keeps the pin (and so the memory) until the consumer's deleter drops it.
        Ok(capsule(py, view, Some(Box::new(Borrow(Arc::clone(self)))))?)
    }

    /// Releases the unit: every revocable torch tensor made from it is invalidated (any access
    /// to its data raises `RuntimeError` naming the unit); for CUDA memory torch's current
    /// stream of the GPU is synchronised (its queued kernels on the unit are done, writes
    /// through a write pin included); then the unit is unpinned, or, while borrowed exports
    /// live, when the last is freed. Idempotent.
    ///
    /// # Errors
    /// torch refused to invalidate a tensor or to synchronise: the unit then stays pinned for
    /// good (never freed under a live tensor or a queued kernel).
    pub fn release(&self, py: Python<'_>) -> Result<()> {
        let (revoke, tensors, device) = {
            let mut st = self.state.lock();
            if st.released {
                return Ok(());
            }
            // From here no new export or tensor is made.
            st.released = true;
            (st.revoke.take(), std::mem::take(&mut st.tensors), st.device)
        };
        let done = self.invalidate(py, revoke, tensors).and_then(|()| match device {
            Some(DlDevice { device_type: DL_CUDA, device_id }) => sync_torch_stream(py, device_id),
            _ => Ok(()),
        });
        if let Err(e) = done {
            // A tensor may still read the memory: keep the pin for the process's life.
            std::mem::forget(self.state.lock().pinned.take());
            return Err(e);
        }
        let mut st = self.state.lock();
        if st.borrowers == 0 {
            st.pinned = None;
        }
        Ok(())
    }

    /// Makes every access to the data of `tensors` (and of their views: the storage is shared)
    /// raise `RuntimeError` naming the unit.
    fn invalidate(&self, py: Python<'_>, revoke: Option<Py<PyAny>>, tensors: Vec<Revocable>) -> Result<()> {
        let Some(revoke) = revoke.filter(|_| !tensors.is_empty()) else {
            return Ok(());
        };
        let message = format!(
            "oogc: the parameters of {} were released (the fetch's `with` block ended, or release() was \
             called); a released tensor cannot be read or written: fetch the unit again",
            self.label
        );
        for t in &tensors {
            revoke.call1(py, (t.cdata.clone_ref(py), &message))?;
        }
        Ok(())
    }
}

/// Waits on the host for torch's current stream of GPU `ordinal` (every kernel torch queued
/// there, on a unit's tensor among them), when torch is imported and its CUDA is initialised
/// (else torch queued nothing). Imports nothing: it may run at interpreter exit.
fn sync_torch_stream(py: Python<'_>, ordinal: i32) -> Result<()> {
    let torch = py.import("sys")?.getattr("modules")?.call_method1("get", ("torch",))?;
    if torch.is_none() {
        return Ok(());
    }
    let cuda = torch.getattr("cuda")?;
    if !cuda.call_method0("is_initialized")?.is_truthy()? {
        return Ok(());
    }
    cuda.call_method1("current_stream", (ordinal,))?.call_method0("synchronize")?;
    Ok(())
}

fn released_error(label: &str) -> Error {
    Error::Usage(format!("{label} was released: fetch it again"))
}

fn import_torch(py: Python<'_>) -> Result<Bound<'_, PyModule>> {
    py.import("torch").map_err(|e| {
        Error::Usage(format!(
            "torch is needed for tensors ({e}): pip install torch, or read the fetch with numpy.from_dlpack(fetched)"
        ))
    })
}

/// A consumed `dltensor` capsule: calls its deleter when dropped.
struct Consumed(*mut DlManagedTensor);

impl Drop for Consumed {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from a capsule we renamed `used_dltensor`, which makes us the
        // consumer that calls the deleter, once (here).
        unsafe {
            if let Some(deleter) = (*self.0).deleter {
                deleter(self.0);
            }
        }
    }
}

/// Reads `obj` (a 1-D contiguous float32, bfloat16 or float16 CPU tensor or array with
/// `__dlpack__`: torch, numpy) in place and calls `f` with its values, a [`GradSlice`] of its
/// dtype; `what` names the argument in errors. A torch tensor that requires grad is detached
/// first (no copy). A CUDA tensor (`__dlpack_device__` `kDLCUDA`) with a `.cpu()` method (torch)
/// is copied to the host first, with `.cpu()`, which waits for torch's current stream: the
/// values are the ones its queued kernels wrote (a device-to-device path, without the host hop,
/// is future work). The GIL may be released inside `f` (the producer's object is kept alive by
/// the capsule until this returns); the caller must not write the tensor from another thread
/// meanwhile.
///
/// # Errors
/// [`Error::Usage`] naming `what` for an object without `__dlpack__`, another dtype, device,
/// rank or stride, a misaligned pointer; the producer's own errors.
pub fn read_floats<R>(obj: &Bound<'_, PyAny>, what: &str, f: impl FnOnce(GradSlice<'_>) -> R) -> Result<R> {
    let py = obj.py();
    let mut obj = obj.clone();
    if !obj.hasattr("__dlpack__")? {
        return Err(Error::Usage(format!(
            "{what}: expected a 1-D float32, bfloat16 or float16 tensor or array with __dlpack__ (torch.Tensor, \
             numpy.ndarray), got {}",
            obj.get_type().name()?
        )));
    }
    if obj.hasattr("requires_grad")? && obj.getattr("requires_grad")?.is_truthy()? {
        obj = obj.call_method0("detach")?;
    }
    if obj.hasattr("__dlpack_device__")? && obj.hasattr("cpu")? {
        let (device_type, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if device_type == DL_CUDA {
            obj = obj.call_method0("cpu")?;
        }
    }
    let cap = obj.call_method0("__dlpack__")?;
    // SAFETY: `cap` is a live object and the GIL is held; `PyCapsule_IsValid` sets no error.
    if unsafe { ffi::PyCapsule_IsValid(cap.as_ptr(), DLTENSOR.as_ptr()) } != 1 {
        return Err(Error::Usage(format!("{what}: __dlpack__ did not return an unconsumed `dltensor` capsule")));
    }
    // SAFETY: valid under that name, so the pointer is the producer's `DLManagedTensor`.
    let managed = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), DLTENSOR.as_ptr()) }.cast::<DlManagedTensor>();
    // SAFETY: renaming marks the capsule consumed (its destructor then leaves the tensor to us);
    // the new name is a `'static` C string.
    if unsafe { ffi::PyCapsule_SetName(cap.as_ptr(), USED_DLTENSOR.as_ptr()) } != 0 {
        return Err(PyErr::fetch(py).into());
    }
    let consumed = Consumed(managed);
    // SAFETY: the producer's tensor lives until its deleter runs (when `consumed` drops, after
    // the last use of this reference).
    let t = unsafe { &(*consumed.0).dl_tensor };
    let Some(dtype) = t.dtype.float() else {
        return Err(Error::Usage(format!("{what}: expected float32, bfloat16 or float16, got {}", t.dtype.describe())));
    };
    if !matches!(t.device.device_type, DL_CPU | DL_CUDA_HOST) {
        return Err(Error::Usage(format!(
            "{what}: expected a CPU (or CUDA torch) tensor, got DLPack device type {} (move it with .cpu())",
            t.device.device_type
        )));
    }
    if t.ndim != 1 {
        return Err(Error::Usage(format!("{what}: expected a 1-D tensor, got {} dimensions (flatten it)", t.ndim)));
    }
    // SAFETY: `ndim` is 1, so `shape` points at one i64 (DLPack's contract).
    let numel = usize::try_from(unsafe { *t.shape }).unwrap_or(0);
    // SAFETY: `strides` is null (compact) or points at `ndim` = 1 i64s.
    let stride = if t.strides.is_null() { 1 } else { unsafe { *t.strides } };
    if numel > 1 && stride != 1 {
        return Err(Error::Usage(format!(
            "{what}: expected a contiguous tensor, got stride {stride} (call .contiguous())"
        )));
    }
    let data = t.data.cast::<u8>().wrapping_add(t.byte_offset as usize).cast_const();
    let size = dtype.size_in_bytes();
    let r = if numel == 0 {
        f(match dtype {
            DType::BF16 => GradSlice::BF16(&[]),
            DType::F16 => GradSlice::F16(&[]),
            _ => GradSlice::F32(&[]),
        })
    } else {
        if data.is_null() || data.addr() % size != 0 {
            return Err(Error::Usage(format!("{what}: the tensor's data pointer is null or not {size}-byte aligned")));
        }
        // SAFETY: a contiguous CPU tensor of `numel` elements of `dtype` at `data`, aligned to
        // the element's size (checked above; the alignment of f32, bf16 and f16), kept alive
        // (and not freed) by the producer until `consumed` calls its deleter below. Each slice's
        // element type is the variant's (f32, half's bf16 or f16), of that size and alignment.
        let values = unsafe {
            match dtype {
                DType::BF16 => GradSlice::BF16(std::slice::from_raw_parts(data.cast(), numel)),
                DType::F16 => GradSlice::F16(std::slice::from_raw_parts(data.cast(), numel)),
                _ => GradSlice::F32(std::slice::from_raw_parts(data.cast(), numel)),
            }
        };
        f(values)
    };
    drop(consumed);
    Ok(r)
}

/// [`read_floats`] for a float32 argument (master weights, Adam moments): calls `f` with its
/// values.
///
/// # Errors
/// As [`read_floats`]; [`Error::Usage`] naming `what` for bfloat16 or float16.
pub fn read_f32<R>(obj: &Bound<'_, PyAny>, what: &str, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    read_floats(obj, what, |values| match values {
        GradSlice::F32(values) => Ok(f(values)),
        other => Err(Error::Usage(format!(
            "{what}: expected float32, got {} (these values are fp32: convert with .float())",
            torch_name(other.dtype())
        ))),
    })?
}
