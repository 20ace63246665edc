//! Every ordering call the runtime makes between compute and the copy stream, by name
//! ([`OrderingCall`]), and the one place that makes them ([`Order`]): the compute stream waits
//! on a copy's event (never the host), a copy or free of a buffer compute used follows an event
//! recorded after that use, and a buffer compute writes first is allocated for compute
//! (DESIGN.md, "GPU backends"; the contract is the swapper's `CudaDevice`'s, checked on the CPU
//! by the sim device's happens-before checker).
//!
//! | call | where | what leaving it out does on CUDA | the checker reports |
//! |---|---|---|---|
//! | [`OrderingCall::FetchComputeWaits`] | a unit pinned for compute (the residency manager) | kernels read a unit before its H2D landed | `ComputeBeforeHtod` |
//! | [`OrderingCall::GradStagingAlloc`] | gradient staging, before the first step | the backward writes memory the copy stream's allocator still owns | `ComputeBeforeAlloc` |
//! | [`OrderingCall::GradDtohAfterWrite`] | each gradient's D2H | the copy reads the staging buffer before the backward wrote it | `DtohBeforeComputeWrite` |
//! | [`OrderingCall::ActivationStagingAlloc`] | activation staging, before the first step | as for gradient staging | `ComputeBeforeAlloc` |
//! | [`OrderingCall::ActivationDtohAfterWrite`] | a checkpoint's D2H (stash) | the copy reads the checkpoint before it was written | `DtohBeforeComputeWrite` |
//! | [`OrderingCall::ActivationHtodAfterRead`] | a checkpoint's H2D into a staging buffer (prefetch) | the copy overwrites a checkpoint a kernel still reads | `HtodOverComputeAccess` |
//! | [`OrderingCall::ActivationComputeWaits`] | a checkpoint taken back (take) | the recompute reads the checkpoint before its H2D landed | `ComputeBeforeHtod` |
//! | [`OrderingCall::StateUploadComputeWaits`] | a device optimizer's state moved H2D | the state tensor is built from bytes not landed | `ComputeBeforeHtod` |
//! | [`OrderingCall::StateUploadFreeAfterRead`] | its upload buffer freed | the memory is reused under the copy out of it | `FreeBeforeComputeAccess` |
//! | [`OrderingCall::StateDownloadAlloc`] | a device optimizer's state moved D2H: its staging | as for gradient staging | `ComputeBeforeAlloc` |
//! | [`OrderingCall::StateDownloadDtohAfterWrite`] | its D2H | the copy reads the staging before the state was written | `DtohBeforeComputeWrite` |
//! | [`OrderingCall::StateDownloadFreeAfterWrite`] | its staging freed | the memory is reused under the write | `FreeBeforeComputeAccess` |
//!
//! **The test hook.** `OOGC_DROP_ORDERING=<name>` (read when a runtime is built,
//! [`crate::hooks::DROP_ORDERING_ENV`]) leaves one call out: a wait is skipped, an event is
//! replaced by one recorded before any compute (what a forgotten record does), an allocation for
//! compute becomes a plain one. `tests/ordering.rs` leaves out each in turn and shows the
//! checker names it; `tests/tidy.rs` keeps every ordering call of the runtime in this file.

use oogc_swapper::{Device, DeviceBuffer, DeviceEvent, HostBuffer, OrderingHazard, SimEvent, Transfer};

use super::{Result, RuntimeError};

/// One ordering call of the runtime, as `OOGC_DROP_ORDERING` names it
/// ([`crate::hooks::DROP_ORDERING_ENV`]). Where each is made, what leaving it out does on CUDA
/// and what the sim device's checker then reports: the table in the module docs of the
/// crate-private `runtime::ordering` (`src/runtime/ordering.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrderingCall {
    /// The compute stream waits for a unit's H2D when the unit is pinned for compute.
    FetchComputeWaits,
    /// Gradient staging buffers are allocated for compute (the backward writes them first).
    GradStagingAlloc,
    /// A gradient's D2H follows an event recorded after the backward wrote its staging buffer.
    GradDtohAfterWrite,
    /// Activation staging buffers are allocated for compute.
    ActivationStagingAlloc,
    /// An activation checkpoint's D2H follows an event recorded after it was written to staging.
    ActivationDtohAfterWrite,
    /// A checkpoint's H2D into a staging buffer follows an event recorded after compute's last
    /// read of that buffer.
    ActivationHtodAfterRead,
    /// The compute stream waits for a checkpoint's H2D before the recompute reads it.
    ActivationComputeWaits,
    /// The compute stream waits for a device optimizer's state H2D before reading it.
    StateUploadComputeWaits,
    /// A state upload buffer is freed after an event recorded after compute read it.
    StateUploadFreeAfterRead,
    /// A state download staging buffer is allocated for compute.
    StateDownloadAlloc,
    /// A state download's D2H follows an event recorded after compute wrote its staging.
    StateDownloadDtohAfterWrite,
    /// A state download staging buffer is freed after an event recorded after compute wrote it.
    StateDownloadFreeAfterWrite,
}

impl OrderingCall {
    /// Every call, in the order of the module docs' table.
    pub const ALL: [OrderingCall; 12] = [
        OrderingCall::FetchComputeWaits,
        OrderingCall::GradStagingAlloc,
        OrderingCall::GradDtohAfterWrite,
        OrderingCall::ActivationStagingAlloc,
        OrderingCall::ActivationDtohAfterWrite,
        OrderingCall::ActivationHtodAfterRead,
        OrderingCall::ActivationComputeWaits,
        OrderingCall::StateUploadComputeWaits,
        OrderingCall::StateUploadFreeAfterRead,
        OrderingCall::StateDownloadAlloc,
        OrderingCall::StateDownloadDtohAfterWrite,
        OrderingCall::StateDownloadFreeAfterWrite,
    ];

    /// The name `OOGC_DROP_ORDERING` takes, e.g. `grads.dtoh_after_write`.
    pub fn name(self) -> &'static str {
        match self {
            OrderingCall::FetchComputeWaits => "fetch.compute_waits",
            OrderingCall::GradStagingAlloc => "grads.staging_alloc",
            OrderingCall::GradDtohAfterWrite => "grads.dtoh_after_write",
            OrderingCall::ActivationStagingAlloc => "activations.staging_alloc",
            OrderingCall::ActivationDtohAfterWrite => "activations.dtoh_after_write",
            OrderingCall::ActivationHtodAfterRead => "activations.htod_after_read",
            OrderingCall::ActivationComputeWaits => "activations.compute_waits",
            OrderingCall::StateUploadComputeWaits => "state_upload.compute_waits",
            OrderingCall::StateUploadFreeAfterRead => "state_upload.free_after_read",
            OrderingCall::StateDownloadAlloc => "state_download.staging_alloc",
            OrderingCall::StateDownloadDtohAfterWrite => "state_download.dtoh_after_write",
            OrderingCall::StateDownloadFreeAfterWrite => "state_download.free_after_write",
        }
    }

    /// The call named `name` ([`OrderingCall::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    /// What the sim device's checker reports when this call is left out.
    pub fn hazard(self) -> OrderingHazard {
        match self {
            OrderingCall::FetchComputeWaits
            | OrderingCall::ActivationComputeWaits
            | OrderingCall::StateUploadComputeWaits => OrderingHazard::ComputeBeforeHtod,
            OrderingCall::GradStagingAlloc
            | OrderingCall::ActivationStagingAlloc
            | OrderingCall::StateDownloadAlloc => OrderingHazard::ComputeBeforeAlloc,
            OrderingCall::GradDtohAfterWrite
            | OrderingCall::ActivationDtohAfterWrite
            | OrderingCall::StateDownloadDtohAfterWrite => OrderingHazard::DtohBeforeComputeWrite,
            OrderingCall::ActivationHtodAfterRead => OrderingHazard::HtodOverComputeAccess,
            OrderingCall::StateUploadFreeAfterRead | OrderingCall::StateDownloadFreeAfterWrite => {
                OrderingHazard::FreeBeforeComputeAccess
            }
        }
    }
}

impl std::fmt::Display for OrderingCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The runtime's ordering calls, made through one value so the test hook can leave one out.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Order {
    /// The call left out (the test hook), if any.
    dropped: Option<OrderingCall>,
}

impl Order {
    /// Reads the test hook ([`crate::hooks::DROP_ORDERING_ENV`]).
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] for a name that is no [`OrderingCall`], listing the names.
    pub(super) fn from_env() -> Result<Self> {
        let Some(name) = crate::hooks::dropped_ordering() else { return Ok(Self::default()) };
        match OrderingCall::from_name(&name) {
            Some(call) => {
                tracing::warn!(call = call.name(), "test hook: the runtime leaves this ordering call out");
                Ok(Self { dropped: Some(call) })
            }
            None => Err(RuntimeError::Usage(format!(
                "{}={name}: not an ordering call of the runtime; one of {}",
                crate::hooks::DROP_ORDERING_ENV,
                OrderingCall::ALL.map(OrderingCall::name).join(", ")
            ))),
        }
    }

    /// Whether `call` is left out.
    pub(super) fn drops(self, call: OrderingCall) -> bool {
        self.dropped == Some(call)
    }

    /// An event after the compute submitted so far, for `call`'s copy or free to follow; left
    /// out, an event that covers no compute (sim device only).
    fn compute_event(self, device: &Device, call: OrderingCall) -> Result<DeviceEvent> {
        if !self.drops(call) {
            return Ok(device.record_compute_event()?);
        }
        match device {
            Device::Sim(_) => Ok(DeviceEvent::Sim(SimEvent::default())),
            Device::Cuda(_) => Err(RuntimeError::Usage(format!(
                "{}={call}: the test hook runs on the sim device only",
                crate::hooks::DROP_ORDERING_ENV
            ))),
        }
    }

    /// A buffer of `bytes` that compute uses first ([`Device::alloc_for_compute`]); left out, a
    /// plain allocation.
    pub(super) fn alloc_for_compute(self, device: &Device, call: OrderingCall, bytes: usize) -> Result<DeviceBuffer> {
        if self.drops(call) {
            return Ok(device.alloc(bytes)?);
        }
        Ok(device.alloc_for_compute(bytes)?)
    }

    /// The compute stream waits for `copied`, an H2D's event; left out, nothing.
    pub(super) fn compute_waits(self, device: &Device, call: OrderingCall, copied: &DeviceEvent) -> Result<()> {
        if !self.drops(call) {
            device.compute_waits_for(copied)?;
        }
        Ok(())
    }

    /// The D2H of `src`, which compute wrote, into `dst`, after an event recorded now (after
    /// the writing kernels).
    pub(super) fn dtoh_after_write(
        self,
        device: &Device,
        call: OrderingCall,
        src: DeviceBuffer,
        dst: HostBuffer,
    ) -> Result<Transfer> {
        let written = self.compute_event(device, call)?;
        Ok(device.dtoh_after(src, dst, Some(&written))?.0)
    }

    /// The H2D of `src` into `dst`, a buffer compute may have read, after an event recorded now
    /// (after those reads). Returns the transfer and the copy's event.
    pub(super) fn htod_after_reads(
        self,
        device: &Device,
        call: OrderingCall,
        src: HostBuffer,
        dst: DeviceBuffer,
    ) -> Result<(Transfer, DeviceEvent)> {
        let read = self.compute_event(device, call)?;
        Ok(device.htod_after(src, dst, Some(&read))?)
    }

    /// The H2D of `src` into a fresh buffer `dst` (no compute saw it). Returns the transfer and
    /// the copy's event, for [`Order::compute_waits`].
    pub(super) fn htod_fresh(
        self,
        device: &Device,
        src: HostBuffer,
        dst: DeviceBuffer,
    ) -> Result<(Transfer, DeviceEvent)> {
        Ok(device.htod_after(src, dst, None)?)
    }

    /// Frees `buf` after an event recorded now (after the compute that used it).
    pub(super) fn free_after_use(self, device: &Device, call: OrderingCall, buf: DeviceBuffer) -> Result<()> {
        let used = self.compute_event(device, call)?;
        Ok(device.free_after(buf, Some(&used))?)
    }

    /// Orders the copy stream (the frees that follow) after all compute submitted so far: the
    /// runtime's end, before its staging buffers go.
    pub(super) fn copies_wait_for_compute(self, device: &Device) -> Result<()> {
        Ok(device.copy_waits_for_compute()?)
    }

    /// A plain allocation, for a buffer an H2D fills before compute sees it.
    pub(super) fn alloc(self, device: &Device, bytes: usize) -> Result<DeviceBuffer> {
        Ok(device.alloc(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_distinct() {
        let mut names: Vec<&str> = OrderingCall::ALL.iter().map(|c| c.name()).collect();
        for c in OrderingCall::ALL {
            assert_eq!(OrderingCall::from_name(c.name()), Some(c));
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), OrderingCall::ALL.len());
        assert_eq!(OrderingCall::from_name("grads"), None);
    }
}
