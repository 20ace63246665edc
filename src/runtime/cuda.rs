//! The runtime on a CUDA GPU (feature `cuda`): one compute stream, candle's. The GPU is opened
//! once, as candle's device with a stream of its own (`Device::new_cuda_with_stream`), and the
//! swapper's [`CudaDevice`] is built on candle's context and that stream
//! (`CudaDevice::with_context`), so the swapper's copy events order against the stream candle
//! launches every kernel on (DESIGN.md "GPU backends").
//!
//! | call | what it does | on which stream |
//! |---|---|---|
//! | [`open`] | candle's device + the swapper's device sharing its stream | — |
//! | [`unit_tensor`] | a fetched unit's compute copy as a candle tensor it owns: one device-to-device copy | compute (after the H2D's event, which the fetch made the compute stream wait for) |
//! | [`write_tensor`] | a tensor (a gradient, a checkpoint) into a staging buffer, in the compute dtype | the swapper's compute stream (candle's), after the kernels that wrote the tensor: a tensor of another stream is joined first |
//!
//! **Why a copy, not zero-copy.** candle 0.9's `CudaStorage::wrap_cuda_slice` takes the slice by
//! value and frees it when the tensor drops, while the residency manager owns a unit's buffer
//! and only lends it; so a fetched unit is copied device-to-device into a slice candle owns.
//! The copy is counted in the GPU budget (`max_units_in_use` of the largest unit, carved out
//! beside the gradient staging) and costs one pass over the unit's bytes at device bandwidth
//! (~3 TB/s on an H100: 0.1 ms for a 256 MiB unit).
//!
//! Nothing here runs without a GPU; it is compiled and linted by `scripts/build-cuda.sh` and
//! exercised by `oogc gpu-check` on a GPU machine.

#![allow(unsafe_code)]

use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, Shape, Storage, Tensor};
use half::{bf16, f16};
use oogc_swapper::{CudaBuffer, CudaDevice, DType, Device};

use super::tensor::element_dtype;
use super::{Result, RuntimeError};

/// Opens GPU `ordinal`: candle's device with a stream of its own, and the swapper's device
/// (`capacity_bytes` of device memory for the residency manager) on candle's context and
/// stream. With `event_tracking` false, cudarc's per-slice event tracking is turned off for the
/// slices allocated from then on (`[device] event_tracking`).
///
/// # Errors
/// candle failing to open the device (no driver, no such ordinal); the swapper's
/// [`oogc_swapper::Error::Cuda`] creating the copy stream.
pub(super) fn open(ordinal: usize, capacity_bytes: u64, event_tracking: bool) -> Result<(Device, candle_core::Device)> {
    let candle = candle_core::Device::new_cuda_with_stream(ordinal)?;
    let stream = candle.as_cuda_device()?.cuda_stream();
    let ctx = stream.context().clone();
    if !event_tracking {
        // SAFETY: without tracking, cudarc no longer orders a slice's uses on different streams;
        // the caller must. In this process a device slice is used on two streams only through
        // the swapper's `CudaDevice` (a unit buffer filled on the copy stream and read by the
        // compute stream; a staging buffer written by compute and read by a D2H), which orders
        // every such use with its own events (its ordering contract, checked by the sim's
        // happens-before checker); candle's tensors live on its one stream.
        unsafe { ctx.disable_event_tracking() };
    }
    let cuda = CudaDevice::with_context(ctx, stream, Some(capacity_bytes))?;
    // The pool keeps what it allocated: without this, memory freed to the default pool is
    // returned to the driver at every stream or event synchronisation and mapped again by the
    // next step's allocations.
    cuda.keep_pool_memory()?;
    Ok((Device::Cuda(cuda), candle))
}

fn candle_cuda(device: &candle_core::Device) -> Result<&candle_core::CudaDevice> {
    Ok(device.as_cuda_device()?)
}

/// The first `shape.elem_count()` elements of `dtype` of `buf` as a tensor of `shape` that
/// candle owns, on `device` (candle's CUDA device): one device-to-device copy on the compute
/// stream.
///
/// # Errors
/// The buffer too small; the allocation or the copy failing.
pub(super) fn unit_tensor(
    buf: &CudaBuffer,
    dtype: DType,
    shape: impl Into<Shape>,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let shape = shape.into();
    let numel = shape.elem_count();
    let cd = candle_cuda(device)?;
    let stream = cd.cuda_stream();
    let storage = match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(buf.copy_out::<f32>(numel, &stream)?, cd.clone()),
        DType::BF16 => CudaStorage::wrap_cuda_slice(buf.copy_out::<bf16>(numel, &stream)?, cd.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(buf.copy_out::<f16>(numel, &stream)?, cd.clone()),
        // A device optimizer's int8 codes.
        DType::U8 => CudaStorage::wrap_cuda_slice(buf.copy_out::<u8>(numel, &stream)?, cd.clone()),
    };
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
}

/// Writes `t` (any shape, flattened; converted to `dtype` on the device, rounded to nearest
/// even) into the front of `staging` on `device`'s compute stream (candle's, the one the D2H's
/// event is recorded on), after the kernels that wrote `t`: when `t` lives on another candle
/// device (another stream of the same context), the compute stream first waits for that
/// stream's work. Returns the bytes written. Record a compute event after this call to order a
/// D2H of `staging` after it.
///
/// # Errors
/// `t` not on a CUDA device of `device`'s context; `staging` too small; candle or the copy
/// failing.
pub(super) fn write_tensor(t: &Tensor, dtype: DType, staging: &mut CudaBuffer, device: &CudaDevice) -> Result<usize> {
    let t = t.flatten_all()?.to_dtype(element_dtype(dtype))?.contiguous()?;
    let tensor_stream = candle_cuda(t.device())
        .map_err(|_| {
            RuntimeError::Usage(format!(
                "a tensor on {:?} pushed to a CUDA runtime: compute it on the runtime's device",
                t.device().location()
            ))
        })?
        .cuda_stream();
    let stream = device.compute_stream().clone();
    if **tensor_stream.context() != **stream.context() {
        return Err(RuntimeError::Usage(
            "a tensor of another CUDA context (another GPU or process-wide device) pushed to the runtime: compute \
             it on the runtime's device (Runtime::compute_device)"
                .into(),
        ));
    }
    if tensor_stream.cu_stream() != stream.cu_stream() {
        // Kernels of another stream wrote `t`: the copy below must follow them.
        stream
            .join(&tensor_stream)
            .map_err(|e| oogc_swapper::Error::Cuda { op: "join streams", message: e.to_string() })?;
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(RuntimeError::Usage("a CUDA tensor without CUDA storage".into()));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| RuntimeError::Usage("a non-contiguous tensor after contiguous()".into()))?;
    match dtype {
        DType::F32 => staging.copy_in(&cs.as_cuda_slice::<f32>()?.slice(start..end), &stream)?,
        DType::BF16 => staging.copy_in(&cs.as_cuda_slice::<bf16>()?.slice(start..end), &stream)?,
        DType::F16 => staging.copy_in(&cs.as_cuda_slice::<f16>()?.slice(start..end), &stream)?,
        DType::U8 => staging.copy_in(&cs.as_cuda_slice::<u8>()?.slice(start..end), &stream)?,
    }
    Ok(dtype.num_bytes(end - start))
}
