//! Activation checkpoints offloaded to pinned host memory (`[activations] offload`, ZeRO-Offload's
//! and ZeRO-Infinity's checkpoint offload): [`ActivationPipe`]. A checkpoint (a block's input, one
//! micro-batch's `[B, T, d]` in the compute dtype) goes D2H into a pinned host buffer as soon as the forward made
//! it, so the device holds it only while the copy runs; the backward asks for it back one block
//! ahead ([`ActivationPipe::prefetch`]) and takes it when the block's backward starts
//! ([`ActivationPipe::take`]). Every host byte is claimed from the ledger
//! ([`HostUse::Activations`]) before it is made; the device holds [`STAGING`] buffers of the
//! largest checkpoint, carved out of the GPU budget.

use std::collections::{HashMap, VecDeque};

use candle_core::{Shape, Tensor};
use oogc_swapper::{DType, Device, DeviceBuffer, DeviceEvent, HostBuffer, PendingHost, PinnedPool, Transfer};

use super::ordering::{Order, OrderingCall};
use super::tensor::{device_tensor, swapper_dtype, write_to_device};
use super::{Result, Runtime, RuntimeError};

/// Device staging buffers: one checkpoint copied D2H (or H2D, a block ahead) while the other
/// is filled or read.
pub(super) const STAGING: usize = 2;

/// A stashed checkpoint, from [`Activations::stash`]; give it back to [`Activations::take`] once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActivationId(u64);

enum Stash {
    /// D2H in flight (holds a staging buffer).
    Landing(Transfer),
    /// In pinned host memory.
    Host(HostBuffer),
    /// H2D in flight (holds a staging buffer), with the copy's event compute waits for.
    Loading(Transfer, DeviceEvent),
}

/// What a stashed checkpoint was: its shape and element type, to give it back as it came.
struct StashMeta {
    shape: Shape,
    dtype: DType,
}

/// The checkpoints in host memory and the device staging buffers they move through.
pub(super) struct ActivationPipe {
    pool: PinnedPool,
    staging: Vec<DeviceBuffer>,
    /// Each checkpoint's copy state, with what it was stashed as.
    stashes: HashMap<ActivationId, (Stash, StashMeta)>,
    /// Checkpoints whose D2H is in flight, oldest first.
    landing: VecDeque<ActivationId>,
    /// Host buffers of checkpoints taken back while their H2D may still read them: compute
    /// waited for the copy's event, the host did not; each goes back to the pool once its copy
    /// is seen complete.
    retiring: Vec<PendingHost>,
    next: u64,
}

impl ActivationPipe {
    /// A pipe whose host buffers come from `pool` (claimed as [`oogc_swapper::HostUse::Activations`]);
    /// it copies through the staging buffers made by [`make_staging`](Self::make_staging).
    pub(super) fn new(pool: PinnedPool) -> Self {
        Self {
            pool,
            staging: Vec::new(),
            stashes: HashMap::new(),
            landing: VecDeque::new(),
            retiring: Vec::new(),
            next: 0,
        }
    }

    /// Caps the pinned pool (the host plan's share for activations).
    pub(super) fn set_budget_bytes(&self, bytes: u64) {
        self.pool.set_budget_bytes(bytes);
    }

    /// Checkpoints held (landing, in host memory or loading).
    pub(super) fn len(&self) -> usize {
        self.stashes.len()
    }

    /// A free staging buffer: a spare one, else the oldest D2H's once it has landed.
    fn staging(&mut self) -> Result<DeviceBuffer> {
        if let Some(b) = self.staging.pop() {
            return Ok(b);
        }
        let id = self.landing.pop_front().ok_or_else(|| {
            RuntimeError::Usage(format!(
                "activation offload: more than {STAGING} checkpoints loading at once; take one before prefetching another"
            ))
        })?;
        self.land(id)?;
        Ok(self.staging.pop().expect("a landed copy returns its staging buffer"))
    }

    /// Waits for `id`'s D2H copy; its staging buffer goes back to the free list.
    fn land(&mut self, id: ActivationId) -> Result<()> {
        if let Some((Stash::Landing(t), meta)) = self.stashes.remove(&id) {
            let (host, dev) = t.wait()?;
            self.staging.push(dev);
            self.stashes.insert(id, (Stash::Host(host), meta));
        }
        Ok(())
    }

    /// Copies `data` to a staging buffer (on the sim device from candle's CPU tensor) and
    /// starts its D2H copy into a pinned host buffer claimed from the ledger.
    pub(super) fn stash(&mut self, device: &Device, order: Order, data: &Tensor) -> Result<ActivationId> {
        self.retire_landed()?;
        let dtype = swapper_dtype(data.dtype())?;
        let num_bytes = dtype.num_bytes(data.elem_count());
        let mut dev = self.staging()?;
        if dev.num_bytes() < num_bytes {
            let n = dev.num_bytes();
            self.staging.push(dev);
            return Err(RuntimeError::Usage(format!(
                "activation offload: a checkpoint of {num_bytes} bytes is larger than the staging buffers ({n} bytes) \
                 the runtime was configured with"
            )));
        }
        if let Err(e) = write_to_device(data, dtype, &mut dev, device) {
            self.staging.push(dev);
            return Err(e);
        }
        let mut host = self.pool.alloc(num_bytes)?;
        host.set_len(num_bytes);
        // The D2H after the compute that wrote the staging buffer.
        let transfer = order.dtoh_after_write(device, OrderingCall::ActivationDtohAfterWrite, dev, host)?;
        let id = ActivationId(self.next);
        self.next += 1;
        self.stashes.insert(id, (Stash::Landing(transfer), StashMeta { shape: data.shape().clone(), dtype }));
        self.landing.push_back(id);
        Ok(id)
    }

    /// Starts `id`'s H2D copy back to the device, if not started yet.
    pub(super) fn prefetch(&mut self, device: &Device, order: Order, id: ActivationId) -> Result<()> {
        if !self.stashes.contains_key(&id) {
            return Err(RuntimeError::Usage(format!("activation {id:?} is not stashed (taken already?)")));
        }
        if let Some(pos) = self.landing.iter().position(|&x| x == id) {
            self.landing.remove(pos);
            self.land(id)?;
        }
        if matches!(self.stashes.get(&id), Some((Stash::Loading(..), _))) {
            return Ok(());
        }
        let dev = self.staging()?;
        let Some((Stash::Host(host), meta)) = self.stashes.remove(&id) else { unreachable!("landed above") };
        // The H2D overwrites a staging buffer compute may have read (an earlier take): after it.
        let (transfer, copied) = order.htod_after_reads(device, OrderingCall::ActivationHtodAfterRead, host, dev)?;
        self.stashes.insert(id, (Stash::Loading(transfer, copied), meta));
        Ok(())
    }

    /// `id`'s checkpoint back on the device as the tensor it was stashed as (shape, dtype,
    /// bytes), on `compute`; its host buffer goes back to the pool and its claim to the ledger.
    pub(super) fn take(
        &mut self,
        device: &Device,
        order: Order,
        compute: &candle_core::Device,
        id: ActivationId,
    ) -> Result<Tensor> {
        self.prefetch(device, order, id)?;
        let Some((Stash::Loading(t, copied), meta)) = self.stashes.remove(&id) else {
            unreachable!("prefetched above")
        };
        // Not waited on the host: compute waits for the H2D's event before it reads the staging
        // buffer; the host buffer stays with the copy until it is complete.
        let (dev, host) = t.release_device()?;
        self.retiring.push(host);
        order.compute_waits(device, OrderingCall::ActivationComputeWaits, &copied)?;
        let tensor = device_tensor(&dev, meta.shape, meta.dtype, compute);
        self.staging.push(dev);
        tensor
    }

    /// Gives the host buffers of completed H2D copies back to the pool (and their claims to the
    /// ledger); the others stay until a later call.
    ///
    /// # Errors
    /// A copy failed.
    fn retire_landed(&mut self) -> Result<()> {
        let mut failed = None;
        self.retiring.retain(|p| match p.is_complete() {
            Ok(done) => !done,
            Err(e) => {
                failed.get_or_insert(e);
                false
            }
        });
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Allocates the device staging buffers: [`STAGING`] of `bytes` (the largest checkpoint),
    /// for compute (a stash writes one first).
    ///
    /// # Errors
    /// The device's budget or allocator.
    pub(super) fn make_staging(&mut self, device: &Device, order: Order, bytes: usize) -> Result<()> {
        let staging = (0..STAGING)
            .map(|_| order.alloc_for_compute(device, OrderingCall::ActivationStagingAlloc, bytes.max(1)))
            .collect::<Result<Vec<_>>>()?;
        self.staging = staging;
        Ok(())
    }
}

/// The runtime's activation offload, lent for one call ([`Runtime::activations`]): stash a
/// checkpoint D2H, prefetch it back a block ahead, take it.
pub struct Activations<'a> {
    pub(super) rt: &'a mut Runtime,
}

impl Activations<'_> {
    /// Copies an activation checkpoint (`data`: any shape, f32, bf16 or f16, on the compute
    /// device) D2H into pinned host memory claimed from the host ledger
    /// ([`oogc_swapper::HostUse::Activations`]) and returns its handle; the caller drops its
    /// device copy. Bring it back with [`prefetch`](Self::prefetch) (ahead) and
    /// [`take`](Self::take).
    ///
    /// # Errors
    /// [`RuntimeError::Usage`] without `RuntimeConfig::activation_offload`, before the first
    /// [`Runtime::begin_step`], or for a checkpoint larger than configured; the host budget
    /// ([`RuntimeError::Swapper`]) or the copy failing.
    pub fn stash(&mut self, data: &Tensor) -> Result<ActivationId> {
        self.check()?;
        let tiers = &self.rt.tiers;
        self.rt.activations.stash(tiers.residency.device(), tiers.order, data)
    }

    /// Starts the H2D copy of a stashed checkpoint back to the device (at most one at a time
    /// besides the one being taken).
    ///
    /// # Errors
    /// As [`stash`](Self::stash); an unknown or taken `id`.
    pub fn prefetch(&mut self, id: ActivationId) -> Result<()> {
        self.check()?;
        let tiers = &self.rt.tiers;
        self.rt.activations.prefetch(tiers.residency.device(), tiers.order, id)
    }

    /// A stashed checkpoint back on the compute device, as the tensor stashed (shape, dtype and
    /// bits); its host memory is given back.
    ///
    /// # Errors
    /// As [`prefetch`](Self::prefetch).
    pub fn take(&mut self, id: ActivationId) -> Result<Tensor> {
        self.check()?;
        let tiers = &self.rt.tiers;
        self.rt.activations.take(tiers.residency.device(), tiers.order, &tiers.compute_device, id)
    }

    /// Checkpoints stashed and not taken yet.
    pub fn len(&self) -> usize {
        self.rt.activations.len()
    }

    /// Whether every stashed checkpoint was taken.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check(&self) -> Result<()> {
        if self.rt.config.activation_offload.is_none() {
            return Err(RuntimeError::Usage(
                "activation offload is off: set RuntimeConfig::activation_offload ([activations] offload = true)"
                    .into(),
            ));
        }
        if !self.rt.carve.checked {
            return Err(RuntimeError::Usage("stash activations after begin_step (the staging is made there)".into()));
        }
        Ok(())
    }
}
