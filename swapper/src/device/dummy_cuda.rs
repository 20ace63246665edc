//! Stand-in for the CUDA backend when the `cuda` feature is off: the types exist so no `match`
//! needs a `cfg`, and every constructor returns [`Error::NotCompiledWithCuda`] (candle's
//! `dummy_cuda_backend` does the same).

use std::sync::Arc;

use super::{DeviceBackend, Transfer};
use crate::error::{Error, Result};
use crate::host::{HostAllocator, HostBuffer};

#[derive(Debug)]
enum Never {}

/// CUDA device memory (uninhabited without the `cuda` feature).
#[derive(Debug)]
pub struct CudaBuffer(Never);

impl CudaBuffer {
    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        match self.0 {}
    }

    /// Uninhabited.
    pub fn device_address(&self) -> (u64, usize) {
        match self.0 {}
    }
}

/// A CUDA event (uninhabited without the `cuda` feature).
#[derive(Debug)]
pub struct CudaEvent(Never);

/// A CUDA GPU (uninhabited without the `cuda` feature).
pub struct CudaDevice(Never);

impl CudaDevice {
    /// Always fails: the binary was built without the `cuda` feature.
    ///
    /// # Errors
    /// [`Error::NotCompiledWithCuda`].
    pub fn new(_ordinal: usize, _capacity_bytes: Option<u64>) -> Result<Self> {
        Err(Error::NotCompiledWithCuda)
    }

    /// Uninhabited.
    pub fn link_stats(&self) -> (&crate::metrics::LinkStats, &crate::metrics::LinkStats) {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn record_compute_event(&self) -> Result<CudaEvent> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn htod_after(
        &self,
        _src: HostBuffer,
        _dst: CudaBuffer,
        _after: Option<&CudaEvent>,
    ) -> Result<(Transfer, Arc<CudaEvent>)> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn dtoh_after(
        &self,
        _src: CudaBuffer,
        _dst: HostBuffer,
        _after: Option<&CudaEvent>,
    ) -> Result<(Transfer, Arc<CudaEvent>)> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn compute_waits_for(&self, _copy_done: &CudaEvent) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn synchronize_event(&self, _event: &CudaEvent) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn compute_waits_for_copies(&self) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn copy_waits_for_compute(&self) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn copy_wait(&self, _event: &CudaEvent) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn free_after(&self, _buf: CudaBuffer, _after: Option<&CudaEvent>) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn check_ordering(&self) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn alloc_for_compute(&self, _bytes: usize) -> Result<CudaBuffer> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn keep_pool_memory(&self) -> Result<()> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn pool_peak_bytes(&self) -> Result<u64> {
        match self.0 {}
    }

    /// Uninhabited.
    ///
    /// # Errors
    /// Never returns.
    pub fn reset_pool_peak(&self) -> Result<()> {
        match self.0 {}
    }
}

impl DeviceBackend for CudaDevice {
    type Buffer = CudaBuffer;
    fn name(&self) -> String {
        match self.0 {}
    }
    fn capacity_bytes(&self) -> u64 {
        match self.0 {}
    }
    fn allocated_bytes(&self) -> u64 {
        match self.0 {}
    }
    fn alloc(&self, _bytes: usize) -> Result<CudaBuffer> {
        match self.0 {}
    }
    fn htod(&self, _src: HostBuffer, _dst: CudaBuffer) -> Result<Transfer> {
        match self.0 {}
    }
    fn dtoh(&self, _src: CudaBuffer, _dst: HostBuffer) -> Result<Transfer> {
        match self.0 {}
    }
    fn host_allocator(&self, lock: bool) -> Arc<dyn HostAllocator> {
        let _ = lock;
        match self.0 {}
    }
    fn synchronize(&self) -> Result<()> {
        match self.0 {}
    }
}
