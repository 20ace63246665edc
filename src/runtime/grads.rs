//! The gradients' way to the CPU optimizer ([`GradPipe`]): a unit's gradients (in the compute
//! dtype: half the bytes of f32 with bf16 compute copies) go into a device staging buffer, D2H on
//! the copy engine into pinned host memory, and a drain thread submits
//! them to the [`PipelinedOptimizer`] as each copy lands, so the update overlaps the rest of the
//! backward. With `hold` (the ZeRO-Infinity-like baseline) the landed gradients are kept and
//! submitted at the end of the step instead. With data-parallel ranks the drain thread's one
//! collective step is [`reduce_scatter_grads`]: each unit's gradients, in push order, become
//! this rank's shard averaged over the ranks before the optimizer sees them.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use oogc_optimizer::{Grads, PipelinedOptimizer, UpdateHandle};
use oogc_swapper::{DType, Device, DeviceBuffer, HostClaim, HostLedger, HostUse, PinnedPool, Transfer};
use parking_lot::{Condvar, Mutex};

use super::ordering::{Order, OrderingCall};
use super::tensor::{write_bytes_to_sim, write_to_device};
use super::{Result, RuntimeError, UnitId};

/// Where a unit's gradients come from: a tensor on the compute device (the trainer's), or bytes
/// in host memory already in the compute dtype (a host caller on the sim device).
#[derive(Clone, Copy)]
pub(super) enum GradSource<'a> {
    /// `[numel]` (any shape), any float dtype: converted on the device.
    Tensor(&'a candle_core::Tensor),
    /// Little-endian elements of the compute dtype.
    Bytes(&'a [u8]),
}

/// Device buffers for gradients on their way D2H: one unit's gradients are copied while the
/// next unit's backward computes.
pub(super) const STAGING_BUFFERS: usize = 1;

/// Pinned host buffers the D2H copies land in, at most at once: the one being copied into
/// while the drain thread still reads the previous one.
pub(super) const GRAD_LANDING_BUFFERS: usize = STAGING_BUFFERS + 1;

struct GradJob {
    unit: UnitId,
    /// The gradients' element type (what the landing buffer holds).
    dtype: DType,
    transfer: Transfer,
}

/// What the caller and the drain thread share.
struct Shared {
    optimizer: PipelinedOptimizer,
    /// The run's ranks: with more than one, each unit's gradients are reduce-scattered.
    ranks: crate::dist::Ranks,
    /// Free device buffers for gradient staging.
    staging: Mutex<Vec<DeviceBuffer>>,
    staging_returned: Condvar,
    /// First error of the drain thread.
    drain_error: Mutex<Option<RuntimeError>>,
    /// Gradient copies in flight (sent to the drain thread, not yet submitted or held).
    in_flight: Mutex<usize>,
    in_flight_done: Condvar,
    /// Hold landed gradients for [`GradPipe::take_held`] instead of submitting them.
    hold: bool,
    held: Mutex<Vec<(UnitId, Grads, HostClaim)>>,
    /// The host ledger the gradients the optimizer holds are claimed from.
    ledger: Arc<HostLedger>,
    /// The handles of updates the drain thread submitted, for the caller's unit states.
    handles: Sender<(UnitId, UpdateHandle)>,
}

/// Gradient staging, the D2H copies and the drain thread that feeds the optimizer.
pub(super) struct GradPipe {
    shared: Arc<Shared>,
    /// Pinned host buffers the gradients land in.
    pool: PinnedPool,
    jobs: Option<Sender<GradJob>>,
    handles: Receiver<(UnitId, UpdateHandle)>,
    drain: Option<std::thread::JoinHandle<()>>,
}

impl GradPipe {
    /// Starts the drain thread. `pool` is where the D2H copies land; every gradient vector is
    /// claimed from `ledger` ([`HostUse::Gradients`]) before it is made; with more than one of
    /// `ranks`, each unit's are reduce-scattered ([`reduce_scatter_grads`]).
    pub(super) fn new(
        optimizer: PipelinedOptimizer,
        ranks: crate::dist::Ranks,
        pool: PinnedPool,
        ledger: Arc<HostLedger>,
        hold: bool,
    ) -> Self {
        let (handles_tx, handles) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            optimizer,
            ranks,
            staging: Mutex::new(Vec::new()),
            staging_returned: Condvar::new(),
            drain_error: Mutex::new(None),
            in_flight: Mutex::new(0),
            in_flight_done: Condvar::new(),
            hold,
            held: Mutex::new(Vec::new()),
            ledger,
            handles: handles_tx,
        });
        let (tx, rx) = crossbeam_channel::unbounded::<GradJob>();
        let drain = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("oogc-grad-drain".into())
                .spawn(move || drain_loop(rx, shared))
                .expect("spawn the gradient drain thread")
        };
        Self { shared, pool, jobs: Some(tx), handles, drain: Some(drain) }
    }

    /// The optimizer.
    pub(super) fn optimizer(&self) -> &PipelinedOptimizer {
        &self.shared.optimizer
    }

    /// Caps the pinned landing pool (the host plan's share; its cached buffers above it go).
    pub(super) fn set_landing_budget_bytes(&self, bytes: u64) {
        self.pool.set_budget_bytes(bytes);
    }

    /// A pinned buffer of `len` bytes from the landing pool (claimed from the ledger as
    /// gradients), for a state move of a device optimizer between steps.
    pub(super) fn landing_buffer(&self, len: usize) -> Result<oogc_swapper::HostBuffer> {
        Ok(self.pool.alloc(len)?)
    }

    /// Adds a device staging buffer.
    pub(super) fn add_staging(&self, buf: DeviceBuffer) {
        self.shared.staging.lock().push(buf);
    }

    /// Writes a unit's gradients (`src`, converted to `dtype`) into a staging buffer, waiting
    /// for one to be free, and queues its D2H copy, ordered after that write by a compute event;
    /// the drain thread submits it. Returns the seconds spent waiting for a staging buffer.
    ///
    /// # Errors
    /// Host bytes on a CUDA device (they go to the optimizer directly); a staging buffer too
    /// small; a pinned host allocation or the copy's submission failed.
    pub(super) fn push(
        &self,
        unit: UnitId,
        src: GradSource<'_>,
        dtype: DType,
        device: &Device,
        order: Order,
    ) -> Result<f64> {
        let t = Instant::now();
        let mut dev = {
            let mut staging = self.shared.staging.lock();
            while staging.is_empty() {
                self.shared.staging_returned.wait(&mut staging);
            }
            staging.pop().expect("a staging buffer")
        };
        let stall_s = t.elapsed().as_secs_f64();
        let written = match (src, &mut dev) {
            (GradSource::Tensor(t), dev) => write_to_device(t, dtype, dev, device),
            (GradSource::Bytes(bytes), DeviceBuffer::Sim(b)) => write_bytes_to_sim(bytes, b),
            (GradSource::Bytes(_), DeviceBuffer::Cuda(_)) => Err(RuntimeError::Usage(
                "gradients in host memory on a CUDA device go to the optimizer directly".into(),
            )),
        };
        let n = match written {
            Ok(n) => n,
            Err(e) => {
                self.shared.staging.lock().push(dev);
                self.shared.staging_returned.notify_all();
                return Err(e);
            }
        };
        let mut host = self.pool.alloc(n)?;
        host.set_len(n);
        // The D2H is ordered after the compute that wrote the staging buffer: an event recorded
        // after the write (the sim device's checker fails a copy ordered before it).
        let transfer = order.dtoh_after_write(device, OrderingCall::GradDtohAfterWrite, dev, host)?;
        *self.shared.in_flight.lock() += 1;
        self.jobs.as_ref().expect("drain running").send(GradJob { unit, dtype, transfer }).expect("drain thread alive");
        Ok(stall_s)
    }

    /// Submits the `numel` gradients of `unit` computed on the CPU (in `dtype`) straight to the
    /// optimizer (no staging, no D2H), claiming what the optimizer will hold of them from the
    /// ledger first ([`held_grad_bytes`]); `make` builds them once the claim holds.
    ///
    /// # Errors
    /// The host budget or the optimizer refused them.
    pub(super) fn submit_host(
        &self,
        unit: UnitId,
        dtype: DType,
        numel: usize,
        make: impl FnOnce() -> Result<Grads>,
    ) -> Result<UpdateHandle> {
        let world = self.shared.ranks.world();
        if world.size > 1 {
            // The drain thread's reductions of earlier units first: every rank reduces the
            // units in push order.
            self.wait_submitted()?;
        }
        self.shared.optimizer.wait_for_gradient_room();
        let claim = self.shared.ledger.claim(HostUse::Gradients, held_grad_bytes(world, dtype, numel))?;
        let grads = reduce_scatter_grads(&self.shared.ranks, make()?)?;
        Ok(self.shared.optimizer.submit_claimed(unit.tensor(), grads, claim)?)
    }

    /// Blocks until every queued copy has been submitted (or held), then reports the drain
    /// thread's first error.
    ///
    /// # Errors
    /// A gradient copy or a submission failed.
    pub(super) fn wait_submitted(&self) -> Result<()> {
        let mut n = self.shared.in_flight.lock();
        while *n > 0 {
            self.shared.in_flight_done.wait(&mut n);
        }
        drop(n);
        self.check()
    }

    /// The drain thread's first error, if any (reported once).
    ///
    /// # Errors
    /// That error.
    pub(super) fn check(&self) -> Result<()> {
        match self.shared.drain_error.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Lands every later gradient copy in a buffer of at least `bytes`
    /// ([`PinnedPool::raise_min_len`]).
    pub(super) fn raise_landing_len(&self, bytes: usize) {
        self.pool.raise_min_len(bytes);
    }

    /// The gradients held so far (hold mode), in arrival order, with their claims.
    pub(super) fn take_held(&self) -> Vec<(UnitId, Grads, HostClaim)> {
        std::mem::take(&mut *self.shared.held.lock())
    }

    /// The handles of the updates the drain thread submitted since the last call.
    pub(super) fn submitted(&self) -> impl Iterator<Item = (UnitId, UpdateHandle)> + '_ {
        self.handles.try_iter()
    }
}

impl Drop for GradPipe {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.drain.take() {
            let _ = t.join();
        }
    }
}

fn drain_loop(rx: Receiver<GradJob>, shared: Arc<Shared>) {
    for job in rx {
        // Immediate updates: while the optimizer's jobs hold as many units' gradients as it
        // allows, the staging buffer stays here and the next push waits for it (backpressure
        // instead of gradients piling up in host memory).
        shared.optimizer.wait_for_gradient_room();
        let (host, dev) = match job.transfer.wait() {
            Ok(pair) => pair,
            Err(e) => {
                shared.drain_error.lock().get_or_insert(e.into());
                finish_job(&shared);
                continue;
            }
        };
        shared.staging.lock().push(dev);
        shared.staging_returned.notify_all();
        let _span = tracing::info_span!("runtime::submit", unit = job.unit.0).entered();
        let made = make_grads(&shared, job.unit, job.dtype, host.as_slice());
        drop(host);
        let (grads, claim) = match made {
            Ok(pair) => pair,
            Err(e) => {
                shared.drain_error.lock().get_or_insert(e);
                finish_job(&shared);
                continue;
            }
        };
        if shared.hold {
            shared.held.lock().push((job.unit, grads, claim));
            finish_job(&shared);
            continue;
        }
        match shared.optimizer.submit_claimed(job.unit.tensor(), grads, claim) {
            Ok(handle) => {
                // The receiver lives as long as the pipe, which joins this thread first.
                let _ = shared.handles.send((job.unit, handle));
            }
            Err(e) => {
                shared.drain_error.lock().get_or_insert(e.into());
            }
        }
        finish_job(&shared);
    }
}

/// The gradients the optimizer will hold for `unit` from the landed `bytes`, with their ledger
/// claim ([`HostUse::Gradients`], taken before the vector is made and held with it until the
/// step's update is final). In a world of one they land in a vector of the optimizer's
/// [`GradPool`](oogc_optimizer::GradPool) (the one this unit's gradients used last step: no fresh
/// pages). With data-parallel ranks the optimizer holds this rank's shard of them, averaged over
/// the ranks (one reduce-scatter per unit, in push order: the same order on every rank); the
/// whole vector lives only until the reduce-scatter.
fn make_grads(shared: &Shared, unit: UnitId, dtype: DType, bytes: &[u8]) -> Result<(Grads, HostClaim)> {
    let world = shared.ranks.world();
    if world.size == 1 {
        return Ok(shared.optimizer.grad_pool().from_bytes(unit.tensor(), dtype, bytes)?);
    }
    let numel = bytes.len() / dtype.size_in_bytes().max(1);
    let claim = shared.ledger.claim(HostUse::Gradients, held_grad_bytes(world, dtype, numel))?;
    let grads = reduce_scatter_grads(&shared.ranks, Grads::from_bytes(dtype, bytes)?)?;
    Ok((grads, claim))
}

/// The drain thread's collective step (and a host caller's, [`GradPipe::submit_host`]): a
/// unit's gradients as this rank's shard averaged over the ranks
/// ([`crate::dist::Ranks::reduce_scatter_mean_grads`]), called for every unit in push order, the
/// same on every rank. The gradients themselves in a world of one.
///
/// # Errors
/// The collective failed ([`RuntimeError::Dist`]).
fn reduce_scatter_grads(ranks: &crate::dist::Ranks, grads: Grads) -> Result<Grads> {
    Ok(ranks.reduce_scatter_mean_grads(grads)?)
}

/// Bytes of a unit's `numel` gradients in `dtype` that the optimizer holds, the ledger's claim
/// for them: this rank's shard ([`crate::dist::shard_range`]) after the reduce-scatter, the
/// whole vector in a world of one.
fn held_grad_bytes(world: crate::dist::World, dtype: DType, numel: usize) -> u64 {
    dtype.num_bytes(crate::dist::shard_range(numel, world.rank, world.size).len()) as u64
}

fn finish_job(shared: &Shared) {
    let mut n = shared.in_flight.lock();
    *n -= 1;
    if *n == 0 {
        shared.in_flight_done.notify_all();
    }
}
