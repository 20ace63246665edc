//! One registered unit's state in the runtime ([`Unit`]): its size, whether it is in the
//! recorded schedule, and where its optimizer update stands ([`Update`]); and the guards a
//! fetch returns ([`UnitParams`] with a candle tensor, [`PinnedUnit`] with the pinned copy's
//! memory for sharing it without a copy).

use std::sync::Arc;

use oogc_optimizer::UpdateHandle;
use oogc_prefetch::TraceRecorder;
use oogc_swapper::{Access, DType, DeviceBuffer, Resident, Tier};
use parking_lot::Mutex;

use super::{Result, UnitId};

/// Whether a unit's uses are part of the recorded schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scheduling {
    /// Fetched in the same order every step: recorded, prefetched, ranked by next use.
    Scheduled,
    /// Used as data decides (MoE experts): not recorded, not prefetched, ranked by the fallback
    /// eviction policy.
    Unscheduled,
}

/// Where a unit's optimizer update stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Update {
    /// No update outstanding: the tiers hold the unit's current compute copy.
    Current,
    /// Gradients pushed in the step still running: the tiers hold the copy this step must use
    /// (the unit's own later fetches in the step see the old parameters).
    Pushed,
    /// The step that pushed them finished: the update is final once the optimizer is done with
    /// it, and its compute copy is published to the host copy before the unit's next use.
    StepFinished,
}

/// A registered unit.
#[derive(Debug)]
pub(super) struct Unit {
    pub(super) name: String,
    /// Parameters (elements of the flat vector).
    pub(super) numel: usize,
    /// Elements of the compute copy the tiers hold: `numel`, or this rank's shard of them with
    /// [`super::RuntimeConfig::shard_parameters`] (the rest is all-gathered at each fetch).
    pub(super) home_numel: usize,
    /// Whether the tiers hold only this rank's shard of its compute copy, all-gathered at each
    /// fetch (with sharded parameters, a scheduled unit; an unscheduled one is kept whole).
    pub(super) gathers: bool,
    /// The compute copy's element type (the runtime's compute dtype).
    pub(super) dtype: DType,
    pub(super) scheduling: Scheduling,
    pub(super) update: Update,
    /// The handle of the unit's latest submitted update (tells whether it is done without
    /// waiting).
    pub(super) handle: Option<UpdateHandle>,
    /// Its optimizer on the device ([`super::OptimizerPlace::Device`]): master weights, Adam
    /// state and compute copy as device tensors; the tiers' copies are stale meanwhile.
    pub(super) on_device: Option<Box<super::device_optim::DeviceState>>,
}

impl Unit {
    pub(super) fn new(name: &str, numel: usize, home_numel: usize, dtype: DType) -> Self {
        Self {
            name: name.to_string(),
            numel,
            home_numel,
            gathers: false,
            dtype,
            scheduling: Scheduling::Scheduled,
            update: Update::Current,
            handle: None,
            on_device: None,
        }
    }

    /// Bytes of the compute copy (and of the unit's gradients, which have its dtype).
    pub(super) fn bytes(&self) -> u64 {
        self.dtype.num_bytes(self.numel) as u64
    }

    /// Bytes of the compute copy the tiers hold (the shard with sharded parameters).
    pub(super) fn home_bytes(&self) -> u64 {
        self.dtype.num_bytes(self.home_numel) as u64
    }

    /// Whether its compute copy can be published now without waiting.
    pub(super) fn ready_to_publish(&self) -> bool {
        self.update == Update::StepFinished && self.handle.as_ref().is_some_and(|h| h.is_ready())
    }
}

/// A unit pinned for compute: its parameters as one flat candle tensor (`[numel]`, the
/// runtime's compute dtype: f32 or bf16).
/// Dropping it releases the unit (it may then be evicted).
pub struct UnitParams {
    pub(super) tensor: candle_core::Tensor,
    pub(super) unit: UnitId,
    /// The pin on the tiers' copy; `None` for a unit whose optimizer is on the device (its
    /// compute copy is a device tensor the runtime keeps) or gathered from the ranks' shards.
    pub(super) _pinned: Option<PinnedUnit>,
    /// Marks a unit gathered from the ranks' shards in use (`runtime/gathered.rs`).
    pub(super) _gathered: Option<Arc<()>>,
}

impl UnitParams {
    /// The flat parameter tensor, `[numel]`.
    pub fn tensor(&self) -> &candle_core::Tensor {
        &self.tensor
    }

    /// The unit.
    pub fn unit(&self) -> UnitId {
        self.unit
    }
}

/// Where a pinned unit's compute copy lives, for handing it to another framework (DLPack)
/// without a copy. The address is valid while the [`PinnedUnit`] it came from lives: a pinned
/// copy is never evicted, lent to a transfer, moved or freed (the swapper's invariant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceMemory {
    /// The sim device: its memory is host memory at this CPU address, 8-byte aligned, holding
    /// the unit's `[numel]` parameters of `dtype` (`num_bytes` = numel × the dtype's size).
    Host {
        /// First byte of the unit's parameters.
        ptr: *mut u8,
        /// Bytes of the unit's parameters.
        num_bytes: usize,
        /// Their element type (the runtime's compute dtype).
        dtype: DType,
    },
    /// A CUDA GPU: the unit's `[numel]` parameters of `dtype` at this device address on GPU
    /// `ordinal`, for kernels on the runtime's compute stream (candle's).
    Cuda {
        /// Device address (`CUdeviceptr`) of the first byte.
        ptr: u64,
        /// Bytes of the unit's parameters.
        num_bytes: usize,
        /// Their element type (the runtime's compute dtype).
        dtype: DType,
        /// The GPU's ordinal.
        ordinal: usize,
    },
}

/// A unit pinned on the device, without a tensor: the guard [`super::Runtime::fetch_pinned`]
/// returns. Dropping it releases the unit (it may then be evicted) and records the release in
/// the step's trace. [`PinnedUnit::memory`] is the compute copy itself, not a copy of it.
pub struct PinnedUnit {
    pub(super) pin: Resident,
    pub(super) unit: UnitId,
    pub(super) numel: usize,
    pub(super) dtype: DType,
    pub(super) access: Access,
    /// The step's trace, which records the release (scheduled device fetches only).
    pub(super) recorder: Option<Arc<Mutex<TraceRecorder>>>,
}

impl Drop for PinnedUnit {
    fn drop(&mut self) {
        if let Some(r) = &self.recorder {
            r.lock().release(self.unit.tensor(), Tier::Device);
        }
    }
}

impl PinnedUnit {
    /// The unit.
    pub fn unit(&self) -> UnitId {
        self.unit
    }

    /// Parameters (elements) of the unit.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The compute copy's element type (the runtime's compute dtype).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether the unit was pinned for write ([`Access::Write`]): then writes through
    /// [`PinnedUnit::memory`] are the compute copy's new value (the device copy is dirty and is
    /// written back to the host copy when evicted) until the optimizer publishes the unit's next
    /// update. Pinned for read, the memory must not be written.
    pub fn is_writable(&self) -> bool {
        self.access == Access::Write
    }

    /// Blocks the host until the unit's H2D has landed: before handing [`PinnedUnit::memory`] to
    /// kernels on another stream than the runtime's compute stream (a DLPack consumer such as
    /// torch), which the compute stream's wait for the copy does not order. The runtime's own
    /// compute needs no such wait.
    ///
    /// # Errors
    /// The copy failed.
    pub fn wait_arrival(&self) -> Result<()> {
        Ok(self.pin.wait_arrived()?)
    }

    /// The pinned compute copy's memory: valid for reads (and, when [`PinnedUnit::is_writable`],
    /// writes) of `num_bytes` bytes while this guard lives, and not after. For a write pin the
    /// address is taken through the buffer's mutable borrow.
    ///
    /// # Errors
    /// The sim device's ordering checker refusing a compute access (an H2D into the buffer not
    /// waited for).
    pub fn memory(&self) -> Result<DeviceMemory> {
        let (num_bytes, dtype) = (self.dtype.num_bytes(self.numel), self.dtype);
        if self.access == Access::Write {
            let mut buf = self.pin.device_buffer_mut();
            match &mut *buf {
                DeviceBuffer::Sim(b) => {
                    Ok(DeviceMemory::Host { ptr: b.compute_write()?.as_mut_ptr(), num_bytes, dtype })
                }
                DeviceBuffer::Cuda(b) => Ok(cuda_memory(b, num_bytes, dtype)),
            }
        } else {
            let buf = self.pin.device_buffer();
            match &*buf {
                // Only the address leaves the borrow; writing through it breaks the caller's
                // contract (a read pin is never written).
                DeviceBuffer::Sim(b) => {
                    Ok(DeviceMemory::Host { ptr: b.compute_read()?.as_ptr().cast_mut(), num_bytes, dtype })
                }
                DeviceBuffer::Cuda(b) => Ok(cuda_memory(b, num_bytes, dtype)),
            }
        }
    }
}

fn cuda_memory(b: &oogc_swapper::CudaBuffer, num_bytes: usize, dtype: DType) -> DeviceMemory {
    let (ptr, ordinal) = b.device_address();
    DeviceMemory::Cuda { ptr, num_bytes, dtype, ordinal }
}
