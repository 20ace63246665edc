//! Between candle's tensors and the swapper's buffers: the dtype mapping ([`candle_dtype`]), and,
//! crate-private, a device buffer as a typed tensor (`device_tensor`), a tensor's bytes for a
//! copy into a staging buffer (`tensor_values`) and back (`tensor_from_bytes`). One `match` per
//! direction over the device kinds (the CUDA arms come with the CUDA path).

use candle_core::{Device as CandleDevice, Shape, Tensor};
use oogc_optimizer::Grads;
use oogc_swapper::{DType, Device, DeviceBuffer};

use super::{Result, RuntimeError};

/// candle's dtype of a compute copy of `dtype`.
///
/// # Errors
/// [`RuntimeError::Usage`] for a dtype that is not a float (compute copies are f32, bf16 or f16).
pub fn candle_dtype(dtype: DType) -> Result<candle_core::DType> {
    match dtype {
        DType::F32 => Ok(candle_core::DType::F32),
        DType::BF16 => Ok(candle_core::DType::BF16),
        DType::F16 => Ok(candle_core::DType::F16),
        DType::U8 => Err(RuntimeError::Usage("compute copies are f32, bf16 or f16, not u8".into())),
    }
}

/// candle's dtype of elements of `dtype`, any of them (U8 for optimizer state's int8 codes).
pub(super) fn element_dtype(dtype: DType) -> candle_core::DType {
    match dtype {
        DType::F32 => candle_core::DType::F32,
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
        DType::U8 => candle_core::DType::U8,
    }
}

/// The swapper's dtype of a device optimizer's state tensor (F32, BF16, F16 or U8).
///
/// # Errors
/// [`RuntimeError::Usage`] for another dtype.
pub(super) fn state_dtype_of(dtype: candle_core::DType) -> Result<DType> {
    match dtype {
        candle_core::DType::U8 => Ok(DType::U8),
        other => swapper_dtype(other),
    }
}

/// The little-endian bytes of `t`'s values (F32, BF16, F16 or U8; flattened), in host memory.
///
/// # Errors
/// candle's; [`RuntimeError::Usage`] for another dtype.
pub(super) fn host_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match state_dtype_of(t.dtype())? {
        DType::U8 => t.to_vec1::<u8>()?,
        dtype => tensor_values(&t, dtype)?.as_slice().as_bytes().to_vec(),
    })
}

/// The swapper's dtype of a candle float dtype.
///
/// # Errors
/// [`RuntimeError::Usage`] for a dtype other than F32, BF16 and F16.
pub fn swapper_dtype(dtype: candle_core::DType) -> Result<DType> {
    match dtype {
        candle_core::DType::F32 => Ok(DType::F32),
        candle_core::DType::BF16 => Ok(DType::BF16),
        candle_core::DType::F16 => Ok(DType::F16),
        other => Err(RuntimeError::Usage(format!("tensors the runtime moves are f32, bf16 or f16, not {other:?}"))),
    }
}

/// The device buffer's first elements of `dtype` as a candle tensor of `shape` on the compute
/// device `compute`. On the sim device compute runs on the CPU, so this is a copy into a CPU
/// tensor; on CUDA one device-to-device copy into memory candle owns (`cuda::unit_tensor`).
pub(super) fn device_tensor(
    buf: &DeviceBuffer,
    shape: impl Into<Shape>,
    dtype: DType,
    compute: &candle_core::Device,
) -> Result<Tensor> {
    let shape = shape.into();
    match buf {
        DeviceBuffer::Sim(b) => {
            // The sim device's memory is host memory and its compute the CPU: compute reads the
            // unit here (a compute access the sim device's ordering checker records).
            let bytes = &b.compute_read()?[..dtype.num_bytes(shape.elem_count())];
            tensor_from_bytes(bytes, dtype, shape, &candle_core::Device::Cpu)
        }
        DeviceBuffer::Cuda(b) => super::cuda::unit_tensor(b, dtype, shape, compute),
    }
}

/// The device buffer's first `numel` elements of `dtype` as host bytes (an all-gather's send
/// buffer until device collectives come): on the sim device a read of its memory (a compute
/// access the ordering checker records), on CUDA through a tensor candle owns.
pub(super) fn device_bytes(
    buf: &DeviceBuffer,
    numel: usize,
    dtype: DType,
    compute: &candle_core::Device,
) -> Result<Vec<u8>> {
    match buf {
        DeviceBuffer::Sim(b) => Ok(b.compute_read()?[..dtype.num_bytes(numel)].to_vec()),
        DeviceBuffer::Cuda(_) => {
            let t = device_tensor(buf, numel, dtype, compute)?;
            Ok(tensor_values(&t, dtype)?.as_slice().as_bytes().to_vec())
        }
    }
}

/// Writes `t` (flattened, converted to `dtype`; U8 for int8 optimizer state) into the front of
/// the device buffer `buf`, as compute does (the sim device's checker records a compute write),
/// on `device`'s compute stream (CUDA: after the kernels that wrote `t`, on whichever stream);
/// returns the bytes written. Record a compute event after it to order a D2H of `buf`.
pub(super) fn write_to_device(t: &Tensor, dtype: DType, buf: &mut DeviceBuffer, device: &Device) -> Result<usize> {
    match (buf, device) {
        (DeviceBuffer::Sim(b), _) if dtype == DType::U8 => {
            write_bytes_to_sim(&t.flatten_all()?.to_dtype(candle_core::DType::U8)?.to_vec1::<u8>()?, b)
        }
        (DeviceBuffer::Sim(b), _) => write_bytes_to_sim(tensor_values(t, dtype)?.as_slice().as_bytes(), b),
        (DeviceBuffer::Cuda(b), Device::Cuda(d)) => super::cuda::write_tensor(t, dtype, b, d),
        (DeviceBuffer::Cuda(_), Device::Sim(_)) => {
            Err(RuntimeError::Usage("a CUDA buffer written through a sim device".into()))
        }
    }
}

/// Writes `bytes` (already in host memory) into the front of the sim buffer `b`, as compute
/// does (the ordering checker records a compute write); returns the bytes written.
pub(super) fn write_bytes_to_sim(bytes: &[u8], b: &mut oogc_swapper::SimBuffer) -> Result<usize> {
    let n = bytes.len();
    if n > b.num_bytes() {
        return Err(RuntimeError::Usage(format!("{n} bytes into a device staging buffer of {} bytes", b.num_bytes())));
    }
    b.compute_write()?[..n].copy_from_slice(bytes);
    Ok(n)
}

/// A tensor of `shape` and `dtype` (any: U8 for int8 optimizer state) from its little-endian
/// bytes, on `device`.
pub(super) fn tensor_from_bytes(
    bytes: &[u8],
    dtype: DType,
    shape: impl Into<Shape>,
    device: &CandleDevice,
) -> Result<Tensor> {
    Ok(Tensor::from_raw_buffer(bytes, element_dtype(dtype), shape.into().dims(), device)?)
}

/// The elements of `t` (any shape, flattened in row-major order) converted to `dtype`, in host
/// memory (`as_slice().as_bytes()` are their little-endian bytes, `dtype.num_bytes(t.elem_count())`
/// of them). Converting rounds to nearest even (candle's casts), so f32 gradients of a bf16 unit
/// cross the link as bf16. One copy out of candle.
pub(super) fn tensor_values(t: &Tensor, dtype: DType) -> Result<Grads> {
    let t = t.flatten_all()?.to_dtype(candle_dtype(dtype)?)?;
    Ok(match dtype {
        DType::F32 => Grads::F32(t.to_vec1()?),
        DType::BF16 => Grads::BF16(t.to_vec1()?),
        DType::F16 => Grads::F16(t.to_vec1()?),
        DType::U8 => return Err(RuntimeError::Usage("compute copies are f32, bf16 or f16, not u8".into())),
    })
}
