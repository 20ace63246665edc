//! The units: what kind each is ([`Kind`]: how it is fetched, how its gradients leave, how its
//! update is committed), where its optimizer update stands ([`Update`]), the table of them in
//! registration order ([`Units`], the runtime's only `UnitId` → unit mapping); and the guards a
//! fetch returns ([`UnitParams`] with a candle tensor, [`PinnedUnit`] with the pinned copy's
//! memory for sharing it without a copy).

use std::sync::Arc;

use oogc_optimizer::UpdateHandle;
use oogc_prefetch::TraceRecorder;
use oogc_swapper::{Access, DType, DeviceBuffer, Resident, TensorId, Tier};
use parking_lot::Mutex;

use super::device_optim::{DeviceState, OptimizerPlace};
use super::{Result, RuntimeError, UnitId};

/// What a unit is: each kind owns how the unit is fetched, how its gradients leave and how its
/// update is committed. The runtime's calls match on it in one place each (`runtime/fetch.rs`,
/// `runtime/push.rs`, `runtime/step.rs`).
#[derive(Debug)]
pub(super) enum Kind {
    /// The swapper's tiers hold its whole compute copy. Fetched in the same order every step:
    /// recorded, prefetched, ranked for eviction by next use. Its gradients go D2H to the CPU
    /// optimizer; the new compute copy is published into its home at its next fetch (with ranks,
    /// all-gathered from the ranks' shards at the step's end).
    Tiered,
    /// The tiers hold this rank's shard of its compute copy (sharded parameters, ZeRO-3): a
    /// fetch brings the shard H2D and all-gathers the whole unit, kept for its next use while
    /// the budget allows (`runtime/gathered.rs`). Its gradients are reduce-scattered by the
    /// drain thread; the optimizer writes the new shard into the tiers and the gathered copy is
    /// dropped at the step's end.
    Gathered,
    /// Used as data decides (an MoE expert placed by the placer): whole on every rank, not
    /// recorded, not prefetched, ranked for eviction by the fallback policy; gradients and
    /// update as [`Kind::Tiered`].
    Unscheduled,
    /// Its optimizer is on the device: master weights, Adam state and compute copy are device
    /// tensors, a fetch moves nothing, its gradients stay on the device and it is updated there
    /// after the step's decision. `off` is the kind it takes back on the host.
    Device {
        /// The device optimizer's state.
        state: Box<DeviceState>,
        /// The kind the unit returns to when its optimizer goes back to the host.
        off: OffDevice,
    },
}

/// The kind a unit with a device optimizer returns to ([`Kind::Device`]); device optimizers
/// exist only in a world of one, so never [`Kind::Gathered`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OffDevice {
    /// [`Kind::Tiered`].
    Tiered,
    /// [`Kind::Unscheduled`].
    Unscheduled,
}

impl From<OffDevice> for Kind {
    fn from(off: OffDevice) -> Self {
        match off {
            OffDevice::Tiered => Kind::Tiered,
            OffDevice::Unscheduled => Kind::Unscheduled,
        }
    }
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
    /// Elements of the compute copy the tiers hold: `numel`, or this rank's shard of them for a
    /// [`Kind::Gathered`] unit.
    pub(super) home_numel: usize,
    /// The compute copy's element type (the runtime's compute dtype).
    pub(super) dtype: DType,
    pub(super) kind: Kind,
    pub(super) update: Update,
    /// The handle of the unit's latest submitted update (tells whether it is done without
    /// waiting).
    pub(super) handle: Option<UpdateHandle>,
}

impl Unit {
    pub(super) fn new(name: &str, numel: usize, home_numel: usize, dtype: DType, kind: Kind) -> Self {
        Self { name: name.to_string(), numel, home_numel, dtype, kind, update: Update::Current, handle: None }
    }

    /// Bytes of the compute copy (and of the unit's gradients, which have its dtype).
    pub(super) fn bytes(&self) -> u64 {
        self.dtype.num_bytes(self.numel) as u64
    }

    /// Bytes of the compute copy the tiers hold (the shard for a [`Kind::Gathered`] unit).
    pub(super) fn home_bytes(&self) -> u64 {
        self.dtype.num_bytes(self.home_numel) as u64
    }

    /// Whether its fetches are part of the recorded schedule.
    pub(super) fn scheduled(&self) -> bool {
        matches!(self.kind, Kind::Tiered | Kind::Gathered)
    }

    /// Its device optimizer's state ([`Kind::Device`]).
    pub(super) fn device(&self) -> Option<&DeviceState> {
        match &self.kind {
            Kind::Device { state, .. } => Some(state),
            _ => None,
        }
    }

    /// [`Unit::device`], mutable.
    pub(super) fn device_mut(&mut self) -> Option<&mut DeviceState> {
        match &mut self.kind {
            Kind::Device { state, .. } => Some(state),
            _ => None,
        }
    }

    /// Whether its compute copy can be published now without waiting.
    pub(super) fn ready_to_publish(&self) -> bool {
        self.update == Update::StepFinished && self.handle.as_ref().is_some_and(|h| h.is_ready())
    }
}

/// The registered units in registration order: the one mapping from a [`UnitId`] to a unit (its
/// name, size, swapper tensor and optimizer place). [`super::Runtime::units`] lends it read-only.
#[derive(Debug)]
pub struct Units {
    list: Vec<Unit>,
    /// Units a caller holds pinned at once (2 when a tied head uses the embedding).
    max_in_use: usize,
}

impl Units {
    pub(super) fn new() -> Self {
        Self { list: Vec::new(), max_in_use: 1 }
    }

    /// The id the next registered unit gets.
    pub(super) fn next_id(&self) -> UnitId {
        UnitId(self.list.len())
    }

    pub(super) fn push(&mut self, unit: Unit) -> UnitId {
        let id = self.next_id();
        self.list.push(unit);
        id
    }

    pub(super) fn get(&self, unit: UnitId) -> &Unit {
        &self.list[unit.0]
    }

    pub(super) fn get_mut(&mut self, unit: UnitId) -> &mut Unit {
        &mut self.list[unit.0]
    }

    /// The unit whose compute copy is swapper tensor `tensor` (tensors are numbered as units
    /// are: [`UnitId`]'s one mapping).
    pub(super) fn of_tensor(&self, tensor: TensorId) -> Option<&Unit> {
        self.list.get(UnitId::of_tensor(tensor)?.0)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (UnitId, &Unit)> {
        self.list.iter().enumerate().map(|(k, u)| (UnitId(k), u))
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (UnitId, &mut Unit)> {
        self.list.iter_mut().enumerate().map(|(k, u)| (UnitId(k), u))
    }

    pub(super) fn set_max_in_use(&mut self, units: usize) {
        self.max_in_use = units.max(1);
    }

    /// Units a caller holds pinned at once ([`super::Runtime::set_max_units_in_use`]).
    pub fn max_in_use(&self) -> usize {
        self.max_in_use
    }

    /// Registered units.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether no unit is registered.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Every unit's id, in registration order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = UnitId> + '_ {
        (0..self.list.len()).map(UnitId)
    }

    /// The unit registered `index`-th (0-based), as a caller's own table of units would name it
    /// (the Python bindings' integer ids).
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for an index past the registered units.
    pub fn id(&self, index: usize) -> Result<UnitId> {
        if index < self.list.len() {
            Ok(UnitId(index))
        } else {
            Err(RuntimeError::Usage(format!("unit {index}: only {} units are registered", self.list.len())))
        }
    }

    /// The name it was registered with.
    pub fn name(&self, unit: UnitId) -> &str {
        &self.list[unit.0].name
    }

    /// Its parameters (elements of its flat vector).
    pub fn numel(&self, unit: UnitId) -> usize {
        self.list[unit.0].numel
    }

    /// The swapper tensor that holds its compute copy (what eviction policies and the swapper's
    /// metrics and traces name).
    pub fn tensor(&self, unit: UnitId) -> TensorId {
        unit.tensor()
    }

    /// Where its optimizer lives.
    pub fn optimizer_place(&self, unit: UnitId) -> OptimizerPlace {
        match self.list[unit.0].kind {
            Kind::Device { .. } => OptimizerPlace::Device,
            _ => OptimizerPlace::Host,
        }
    }

    /// Bytes of the `k` (at least 1) largest units' compute copies together.
    pub(super) fn largest_bytes(&self, k: usize) -> u64 {
        largest(self.list.iter().map(Unit::bytes), k)
    }

    /// Bytes of the `k` (at least 1) largest compute copies the tiers hold, together.
    pub(super) fn largest_home_bytes(&self, k: usize) -> u64 {
        largest(self.list.iter().map(Unit::home_bytes), k)
    }

    /// Every unit's parameters, in order.
    pub(super) fn numels(&self) -> Vec<usize> {
        self.list.iter().map(|u| u.numel).collect()
    }

    /// Every unit's compute-copy elements in the tiers, in order.
    pub(super) fn home_numels(&self) -> Vec<usize> {
        self.list.iter().map(|u| u.home_numel).collect()
    }

    /// [`RuntimeError::Usage`] unless `len` gradients fit `unit` (`call` names the caller).
    pub(super) fn check_grads_len(&self, unit: UnitId, len: usize, call: &str) -> Result<()> {
        let u = self.get(unit);
        if len != u.numel {
            return Err(RuntimeError::Usage(format!(
                "{call}({}): {len} gradients for a unit of {} parameters",
                u.name, u.numel
            )));
        }
        Ok(())
    }
}

/// Bytes of the `k` (at least 1) largest of `sizes` together.
fn largest(sizes: impl Iterator<Item = u64>, k: usize) -> u64 {
    let mut sizes: Vec<u64> = sizes.collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.iter().take(k.max(1)).sum()
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
    /// The swapper tensor pinned (the unit's compute copy), named in the trace's release.
    pub(super) tensor: TensorId,
    pub(super) numel: usize,
    pub(super) dtype: DType,
    pub(super) access: Access,
    /// The step's trace, which records the release (scheduled device fetches only).
    pub(super) recorder: Option<Arc<Mutex<TraceRecorder>>>,
}

impl Drop for PinnedUnit {
    fn drop(&mut self) {
        if let Some(r) = &self.recorder {
            r.lock().release(self.tensor, Tier::Device);
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
