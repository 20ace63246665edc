//! The stand-in for [`super::cuda`] in a build without the `cuda` feature: opening a GPU
//! fails with the swapper's `NotCompiledWithCuda` (its `CudaDevice::new` stand-in), and the
//! other calls are never reached (no CUDA buffer exists without the feature).

use candle_core::{Shape, Tensor};
use oogc_swapper::{CudaBuffer, CudaDevice, DType, Device};

use super::{Result, RuntimeError};

/// Fails: the binary was built without the `cuda` feature.
///
/// # Errors
/// Always [`oogc_swapper::Error::NotCompiledWithCuda`].
pub(super) fn open(
    ordinal: usize,
    capacity_bytes: u64,
    _event_tracking: bool,
) -> Result<(Device, candle_core::Device)> {
    let cuda = CudaDevice::new(ordinal, Some(capacity_bytes))?;
    Ok((Device::Cuda(cuda), candle_core::Device::new_cuda(ordinal)?))
}

fn not_compiled() -> RuntimeError {
    RuntimeError::Swapper(oogc_swapper::Error::NotCompiledWithCuda)
}

/// Unreachable without the feature (no CUDA buffer exists).
///
/// # Errors
/// Always.
pub(super) fn unit_tensor(
    _buf: &CudaBuffer,
    _dtype: DType,
    _shape: impl Into<Shape>,
    _device: &candle_core::Device,
) -> Result<Tensor> {
    Err(not_compiled())
}

/// Unreachable without the feature (no CUDA buffer exists).
///
/// # Errors
/// Always.
pub(super) fn write_tensor(
    _t: &Tensor,
    _dtype: DType,
    _staging: &mut CudaBuffer,
    _device: &CudaDevice,
) -> Result<usize> {
    Err(not_compiled())
}
