//! The pipelined per-unit optimizer step: [`PipelinedOptimizer`].
//!
//! The GPU backward produces a unit's gradients one unit at a time (last unit first). As soon as
//! they reach the host, [`PipelinedOptimizer::submit`] hands them to a worker pool and returns;
//! the update of that unit runs on the CPU while the GPU goes on with the earlier units
//! (ZeRO-Offload's one-step-delay-free CPU step, Ren et al. 2021, §4.2; DeepSpeed `DeepSpeedCPUAdam`).
//! The next forward waits only for the unit it needs ([`PipelinedOptimizer::wait_unit`]).
//!
//! # Exact global-norm clipping and non-finite skips: speculate, then commit or redo
//!
//! Clipping by the global norm needs every unit's gradients before the first update, and a
//! non-finite gradient anywhere must leave every unit unchanged. Both are decided only when the
//! backward is over. The scheme (as DeepSpeed SuperOffload's speculation, with an exact redo):
//!
//! 1. **Speculate.** A unit's job takes the gradients' sum of squares (fused into the update,
//!    block by block, in the canonical order of [`crate::grad_sumsq`]) and updates the unit
//!    **out of place** with scale 1: it reads the committed state `A` and writes a second buffer
//!    `B` (and a second compute copy). Out of place moves the same bytes as in place, so
//!    speculation costs no extra memory traffic. NVMe-placed state is copy-on-write anyway (new
//!    chunk extents), so it costs no host memory beyond the second compute copy, but its new
//!    extents hold NVMe space until the commit.
//! 2. **Decide** in [`PipelinedOptimizer::finish_step`]: the global norm is `sqrt(Σ sumsq)` over
//!    the submitted units in unit-id order; `scale = min(1, clip / (norm + 1e-6))`
//!    (`clip_grad_norm_`). Non-finite norm: every unit keeps `A`, the step is reported
//!    `skipped` and not counted. Scale 1 (the common case): every speculated unit commits by a
//!    swap `A ↔ B` (NVMe: the old extents are freed). Scale < 1: every unit is redone from `A`
//!    with the scale, as the reference would compute it, on the worker pool in the reverse order
//!    of submission (the order of the next forward), so the redo overlaps the next forward.
//! 3. **Defer** when speculation cannot pay: a unit whose job starts when the running partial
//!    norm already exceeds the clip (the step will be clipped), or that has no second buffer
//!    because the roll-back budget ([`crate::OptimizerConfig::rollback_budget_bytes`], the host
//!    ledger, the NVMe room given to [`PipelinedOptimizer::reserve_speculation`]) is spent, only
//!    takes its sum of squares; its one update runs after the decision, in place, writing the
//!    new compute copy straight into the unit's home.
//!
//! # Immediate updates
//!
//! With clipping off and [`crate::NonFinite::Stop`]
//! ([`OptimizerConfig::updates_immediately`]) nothing waits for the decision: a unit's job
//! checks its gradients' sum of squares (a non-finite one fails the step with
//! [`Error::NonFiniteGradient`], the unit untouched), updates it in place (NVMe state to new
//! extents, committed at once, the compute copy straight into its home) and drops its gradients.
//! No gradients are held until the step's end and no second buffers exist, so host memory holds
//! only [`OptimizerConfig::gradients_in_flight`] units' gradients
//! ([`PipelinedOptimizer::wait_for_gradient_room`] holds the submitter back) — ZeRO-Offload's
//! and DeepSpeed bf16's update without a step skip, for runs whose gradients outgrow host
//! memory. The result is bitwise that of the scheme above when no gradient is non-finite.
//!
//! # One home per compute copy
//!
//! The committed compute copy lives in its [`ComputeCopyHome`] (the runtime's: the residency
//! manager's host copy), not in the optimizer. A speculated unit's new copy waits in its second
//! buffer until the step is final and is then **published** into the home
//! ([`PipelinedOptimizer::publish`], or at the unit's next submit); a deferred or redone-in-place
//! unit writes it into the home directly, after the decision. So a unit's home changes only
//! after the step that updated it has finished.
//!
//! # Host memory
//!
//! Every host allocation is claimed from the optimizer's [`HostLedger`] first: host-placed state
//! and norm partials ([`HostUse::OptimizerState`]), second buffers ([`HostUse::Speculation`]),
//! stream buffers ([`HostUse::NvmeStream`], through the stream pool) and the gradients it holds
//! until a step is final ([`HostUse::Gradients`]).
//!
//! The result is bitwise the non-pipelined step (all norms first, then every unit updated with
//! the scale), because the kernel is deterministic, element-wise, and its sum of squares does not
//! depend on the thread cut or the ISA. Memory cost: a speculated host unit holds a second
//! `p, m, v` (12 B per parameter) and every speculated unit a second compute copy, bounded by the
//! roll-back budget; a speculated NVMe unit holds its second extents until the commit (12 B per
//! parameter of NVMe space); a clipped step costs one extra optimizer pass, off the backward's
//! critical path.
//!
//! # Threads
//!
//! One pool of [`crate::OptimizerConfig::threads`] threads runs the unit jobs; a host unit's
//! update is cut over the same threads. Jobs of different units run at once, never two of one
//! unit. NVMe streams run on one thread each, at most as many at once as the stream budget holds
//! (three chunk buffers each).

use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use oogc_swapper::host::size_class;
use oogc_swapper::{HostClaim, HostLedger, HostUse, MmapAllocator, NvmeStore, PinnedPool, PinnedPoolConfig, TensorId};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::config::OptimizerConfig;
use crate::error::{Error, Result};
use crate::grad_pool::GradPool;
use crate::home::{ComputeCopyHome, MemoryHome};
use crate::kernel::{clip_scale, global_norm, AdamKernel, CopyOut, GradSlice, StateIo, StepScalars, NORM_BLOCK};
use crate::master::{sr_key, Bf16Master, MasterBuf, MasterDType, StateFormat};

/// `master` as the optimizer will hold it: rounded to bf16 (to nearest even) and widened again
/// for a bf16 master, so that the first compute copy is the master's.
fn held_master(dtype: MasterDType, master: &[f32]) -> std::borrow::Cow<'_, [f32]> {
    match dtype {
        MasterDType::F32 => std::borrow::Cow::Borrowed(master),
        MasterDType::Bf16 => std::borrow::Cow::Owned(master.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()),
    }
}
use crate::quant::{MomentBufs, Reduced};
use crate::simd::Isa;
use crate::stream::{state_nvme_bytes, stream_update, MasterIn, NvmeState, StreamConfig};

mod snapshot;
use oogc_swapper::{DType, StatePlacement};
pub use snapshot::StateSnapshot;

/// A unit's gradients, owned (the optimizer keeps them until the step is final, then gives them
/// to its [`GradPool`] for the next step's).
#[derive(Debug, Clone, PartialEq)]
pub enum Grads {
    /// fp32.
    F32(Vec<f32>),
    /// bf16.
    BF16(Vec<bf16>),
    /// f16.
    F16(Vec<f16>),
}

impl Grads {
    /// Elements.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.as_slice().dtype()
    }

    /// Bytes held.
    pub fn num_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Borrowed view.
    pub fn as_slice(&self) -> GradSlice<'_> {
        match self {
            Grads::F32(g) => GradSlice::F32(g),
            Grads::BF16(g) => GradSlice::BF16(g),
            Grads::F16(g) => GradSlice::F16(g),
        }
    }

    /// The elements' bytes, writable (little-endian, [`num_bytes`](Self::num_bytes) of them).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Grads::F32(g) => bytemuck::cast_slice_mut(g),
            Grads::BF16(g) => bytemuck::cast_slice_mut(g),
            Grads::F16(g) => bytemuck::cast_slice_mut(g),
        }
    }

    /// Gradients of `dtype` from their little-endian bytes (`dtype.num_bytes(n)` of them; any
    /// alignment), e.g. a D2H copy's landing buffer.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] for a `dtype` that is not a float or a length that is not a
    /// whole number of elements.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        if !dtype.is_float() || !bytes.len().is_multiple_of(dtype.size_in_bytes()) {
            return Err(Error::LengthMismatch {
                what: format!("gradient bytes as {dtype} elements"),
                expected: bytes.len().div_ceil(dtype.size_in_bytes()) * dtype.size_in_bytes(),
                got: bytes.len(),
            });
        }
        Ok(match dtype {
            DType::F32 => Grads::F32(bytemuck::pod_collect_to_vec(bytes)),
            DType::BF16 => Grads::BF16(bytemuck::pod_collect_to_vec(bytes)),
            DType::F16 => Grads::F16(bytemuck::pod_collect_to_vec(bytes)),
            DType::U8 => unreachable!("refused above"),
        })
    }

    /// `g` converted to `dtype` (F32, BF16 or F16; rounded to nearest even when narrowing, as
    /// `half`'s conversions; the same values when `dtype` is `g`'s).
    ///
    /// # Panics
    /// For a `dtype` that is not a float.
    pub fn converted(g: GradSlice<'_>, dtype: DType) -> Self {
        let f32s = || -> Vec<f32> {
            match g {
                GradSlice::F32(g) => g.to_vec(),
                GradSlice::BF16(g) => g.to_f32_vec(),
                GradSlice::F16(g) => g.to_f32_vec(),
            }
        };
        match (g, dtype) {
            (GradSlice::F32(g), DType::F32) => Grads::F32(g.to_vec()),
            (GradSlice::BF16(g), DType::BF16) => Grads::BF16(g.to_vec()),
            (GradSlice::F16(g), DType::F16) => Grads::F16(g.to_vec()),
            (_, DType::F32) => Grads::F32(f32s()),
            (_, DType::BF16) => Grads::BF16(f32s().iter().map(|&x| bf16::from_f32(x)).collect()),
            (_, DType::F16) => Grads::F16(f32s().iter().map(|&x| f16::from_f32(x)).collect()),
            (_, DType::U8) => panic!("gradients are f32, bf16 or f16, not u8"),
        }
    }
}

/// A unit's optimizer state, for checkpoints: fp32 master weights and Adam's moments in their
/// element type ([`OptimizerConfig::state_dtype`]), one length. With bf16 master weights
/// ([`OptimizerConfig::master_dtype`]) `master` holds their values widened (exact), and an
/// imported master is rounded to bf16 (to nearest even).
#[derive(Debug, Clone, PartialEq)]
pub struct UnitState {
    /// Master weights.
    pub master: Vec<f32>,
    /// `m` and `v` (torch's `exp_avg`, `exp_avg_sq`), as the optimizer keeps them.
    pub moments: MomentBufs,
}

impl UnitState {
    /// State with f32 moments.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `m` or `v` is not as long as `master`.
    pub fn from_f32(master: Vec<f32>, m: Vec<f32>, v: Vec<f32>) -> Result<Self> {
        for (what, got) in [("m", m.len()), ("v", v.len())] {
            if got != master.len() {
                return Err(Error::LengthMismatch { what: format!("state {what}"), expected: master.len(), got });
            }
        }
        Ok(Self { master, moments: MomentBufs::F32 { m, v } })
    }

    /// Master weights, `m` and `v` in f32 (reduced moments decoded: [`MomentBufs::to_f32`]).
    pub fn into_f32(self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (m, v) = match self.moments {
            MomentBufs::F32 { m, v } => (m, v),
            other => other.to_f32(),
        };
        (self.master, m, v)
    }
}

/// What a step did, from [`PipelinedOptimizer::finish_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The step `t` (1-based) given to `begin_step`.
    pub step: u64,
    /// The learning rate given to `begin_step`.
    pub lr: f32,
    /// Global L2 norm of all submitted gradients (before clipping); not finite when `skipped`.
    pub grad_norm: f64,
    /// The factor the gradients were multiplied by: `min(1, clip / (norm + 1e-6))`, 1 without
    /// clipping or when skipped.
    pub clip_scale: f32,
    /// A gradient was not finite: no unit changed and the step does not count (give the same
    /// `t` to the next `begin_step`).
    pub skipped: bool,
    /// Units submitted in the step.
    pub units: usize,
    /// Units whose speculative update was committed as it was.
    pub committed_speculative: usize,
    /// Units updated again after the decision (speculated, then the step was clipped).
    pub redone: usize,
    /// Units updated only after the decision (no roll-back budget, or the norm was already over
    /// the clip when their job started).
    pub deferred: usize,
}

/// The outcome of one `submit`: ready when the unit's update of that step is final (committed,
/// redone, or discarded because the step was skipped), which happens in or after
/// [`PipelinedOptimizer::finish_step`].
#[derive(Debug, Clone)]
pub struct UpdateHandle {
    cell: Arc<UnitCell>,
    epoch: u64,
}

impl UpdateHandle {
    /// The unit.
    pub fn unit(&self) -> TensorId {
        self.cell.id
    }

    /// Whether the update is final.
    pub fn is_ready(&self) -> bool {
        self.cell.inner.lock().final_epoch >= self.epoch
    }

    /// Blocks until the update is final. Needs `finish_step` to be called (by another thread if
    /// this one waits before it).
    ///
    /// # Errors
    /// The error of the unit's last job, if it failed (reported once, here or by `wait_unit`).
    pub fn wait(&self) -> Result<()> {
        let mut g = self.cell.inner.lock();
        while g.final_epoch < self.epoch || g.data.is_none() {
            self.cell.cv.wait(&mut g);
        }
        g.error.take().map_or(Ok(()), Err)
    }
}

/// Host-resident state buffers (their bytes claimed from the ledger before they were made).
struct HostBufs {
    p: MasterBuf,
    mom: MomentBufs,
    _claim: HostClaim,
}

impl HostBufs {
    fn zeros(n: usize, format: StateFormat, claim: HostClaim) -> Self {
        let p = MasterBuf::from_f32(format.master, &vec![0.0; n]);
        Self { p, mom: MomentBufs::zeros(format.moments, n), _claim: claim }
    }
}

// One per unit, held in its cell: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Home {
    Host { cur: HostBufs, spare: Option<HostBufs> },
    Nvme { cur: Option<NvmeState>, new: Option<NvmeState> },
}

/// A speculated unit's second compute copy (bytes of the compute dtype, in 4-byte words for
/// alignment) and the claim of its second buffers.
struct SpareCopy {
    words: Vec<u32>,
    /// The new compute copy is committed but not yet in the home.
    unpublished: bool,
    _claim: HostClaim,
}

/// A unit's data; taken out of the cell by the job that runs on it.
struct UnitData {
    home: Home,
    /// Speculated units only: where the speculative update writes the new compute copy.
    spare_copy: Option<SpareCopy>,
    partials: Vec<f64>,
    /// Claim of the partials (and of the host state's first buffers).
    _claim: HostClaim,
    grads: Option<(Grads, HostClaim)>,
    /// Bumped whenever the committed state changes (a commit, an in-place update, an import):
    /// a [`StateSnapshot`] reads the state only while it is the version it was taken at.
    version: u64,
}

impl UnitData {
    /// Has second buffers: updated out of place while the step is open.
    fn speculative(&self) -> bool {
        self.spare_copy.is_some()
    }
}

/// What the unit's job of the open step found.
#[derive(Debug, Clone, Copy)]
struct Pending {
    epoch: u64,
    sumsq: f64,
    speculated: bool,
    /// Updated and committed by its submit job (the optimizer
    /// [updates immediately](OptimizerConfig::updates_immediately)): nothing left to decide.
    done: bool,
}

struct UnitInner {
    /// `None` while a job holds the data.
    data: Option<UnitData>,
    error: Option<Error>,
    pending: Option<Pending>,
    submitted_epoch: u64,
    final_epoch: u64,
}

struct UnitCell {
    id: TensorId,
    n: usize,
    /// The unit's index of element 0 (a data-parallel rank's shard): the stochastic rounding's.
    offset: u64,
    placement: StatePlacement,
    inner: Mutex<UnitInner>,
    cv: Condvar,
}

impl std::fmt::Debug for UnitCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitCell").field("id", &self.id).field("n", &self.n).finish()
    }
}

impl UnitCell {
    /// Waits until no job holds the data; returns the guard.
    fn idle(&self) -> parking_lot::MutexGuard<'_, UnitInner> {
        let mut g = self.inner.lock();
        while g.data.is_none() {
            self.cv.wait(&mut g);
        }
        g
    }

    /// Puts the data back after a job, records its outcome, wakes waiters.
    fn put_back(&self, data: UnitData, error: Option<Error>, pending: Option<Pending>, final_epoch: Option<u64>) {
        let mut g = self.inner.lock();
        g.data = Some(data);
        if error.is_some() {
            g.error = error;
        }
        if pending.is_some() {
            g.pending = pending;
        }
        if let Some(e) = final_epoch {
            g.final_epoch = e;
        }
        drop(g);
        self.cv.notify_all();
    }
}

struct OpenStep {
    t: u64,
    lr: f32,
    epoch: u64,
    scalars: StepScalars,
    /// Units in the order they were submitted.
    submitted: Vec<TensorId>,
    /// Sum of the sums of squares of the jobs done so far (arrival order; only to decide
    /// whether to speculate, never for the result).
    partial_sumsq: f64,
    /// Sums of squares of units updated elsewhere ([`PipelinedOptimizer::add_external_sumsq`]).
    external: BTreeMap<TensorId, f64>,
}

struct StepState {
    open: Option<OpenStep>,
    epoch: u64,
    last_step: Option<u64>,
    rollback_used_bytes: u64,
    /// NVMe bytes of speculated units' second extents (held from speculation to commit).
    rollback_nvme_bytes: u64,
    /// [`PipelinedOptimizer::reserve_speculation`] ran (else the first `begin_step` runs it).
    speculation_reserved: bool,
}

/// A counting semaphore of NVMe stream slots.
struct Slots {
    free: Mutex<usize>,
    total: Mutex<usize>,
    cv: Condvar,
}

impl Slots {
    /// Changes the number of slots (between steps); slots in use stay taken.
    fn resize(&self, n: usize) {
        let mut total = self.total.lock();
        let mut free = self.free.lock();
        if n >= *total {
            *free += n - *total;
        } else {
            *free = free.saturating_sub(*total - n);
        }
        *total = n;
        drop((free, total));
        self.cv.notify_all();
    }

    fn acquire(&self) -> SlotGuard<'_> {
        let mut f = self.free.lock();
        while *f == 0 {
            self.cv.wait(&mut f);
        }
        *f -= 1;
        SlotGuard(self)
    }
}

struct SlotGuard<'a>(&'a Slots);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        *self.0.free.lock() += 1;
        self.0.cv.notify_one();
    }
}

struct Shared {
    config: OptimizerConfig,
    kernel: AdamKernel,
    nvme: Option<Arc<NvmeStore>>,
    ledger: Arc<HostLedger>,
    home: Arc<dyn ComputeCopyHome>,
    stream: StreamConfig,
    stream_pool: PinnedPool,
    slots: Slots,
    units: RwLock<HashMap<TensorId, Arc<UnitCell>>>,
    step: Mutex<StepState>,
    /// Submit jobs spawned and not yet finished (they hold their unit's gradients).
    jobs_in_flight: Mutex<usize>,
    job_done: Condvar,
    /// Turns this optimizer's sum of squared gradients into the run's ([`NormReduce`]).
    norm_reduce: Mutex<Option<NormReduce>>,
    /// Gradient vectors of updates done, for the next step's gradients ([`GradPool`]).
    grad_pool: GradPool,
}

/// Turns the sum of squared gradients of the units this optimizer holds into the sum over the
/// whole model, for optimizers that each hold a shard of it (data-parallel ranks sharding the
/// optimizer state, ZeRO-style: an all-reduce of the partial sums). Every shard's optimizer then
/// takes the same norm, clip scale and non-finite skip. Called once per step, from
/// [`PipelinedOptimizer::finish_step`]'s thread. An `Err` (the collective failed, as text) fails
/// that step as a job error does ([`Error::NormReduce`]): rolled back for every unit.
pub type NormReduce = Arc<dyn Fn(f64) -> std::result::Result<f64, String> + Send + Sync>;

/// The pipelined optimizer: per-unit AdamW/Adam updates submitted during the backward, with
/// exact global-norm clipping and non-finite skips (see the module docs for the scheme).
///
/// Units are keyed by the swapper's [`TensorId`] of the unit's flat compute copy; a unit's
/// parameters are one flat f32 vector of `numel` elements. `Send + Sync`: every method takes
/// `&self`.
///
/// A step: [`begin_step`](Self::begin_step)`(t, lr)`, [`submit`](Self::submit) for each unit
/// (any order, from any thread), [`finish_step`](Self::finish_step) once all gradients are in,
/// then [`wait_unit`](Self::wait_unit) / [`read_compute_copy`](Self::read_compute_copy) for each
/// unit as the next forward needs it.
pub struct PipelinedOptimizer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PipelinedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelinedOptimizer")
            .field("config", &self.shared.config)
            .field("units", &self.shared.units.read().len())
            .finish()
    }
}

fn copy_words(n: usize, dtype: DType) -> usize {
    (n * dtype.size_in_bytes()).div_ceil(4)
}

fn copy_bytes(words: &[u32], n: usize, dtype: DType) -> &[u8] {
    &bytemuck::cast_slice(words)[..n * dtype.size_in_bytes()]
}

fn copy_out(words: &mut [u32], n: usize, dtype: DType) -> CopyOut<'_> {
    CopyOut::from_bytes(dtype, &mut bytemuck::cast_slice_mut(words)[..n * dtype.size_in_bytes()])
}

/// The compute copy of `master` in `dtype` (F32, BF16 or F16; little-endian bytes,
/// `dtype.num_bytes(master.len())` of them), rounded to nearest even exactly as the optimizer
/// writes every later copy: what a caller registers as a unit's first compute copy.
///
/// # Panics
/// For a `dtype` that is not a float.
pub fn compute_copy(master: &[f32], dtype: DType) -> Vec<u8> {
    assert!(dtype.is_float(), "a compute copy is f32, bf16 or f16, not {dtype}");
    let mut out = vec![0u8; dtype.num_bytes(master.len())];
    fill_copy(&mut out, master, dtype);
    out
}

/// Converts master weights to the compute copy `out` (`master.len()` elements of `dtype`;
/// outside a step: add and import).
fn fill_copy(out: &mut [u8], master: &[f32], dtype: DType) {
    match CopyOut::from_bytes(dtype, &mut out[..master.len() * dtype.size_in_bytes()]) {
        CopyOut::F32(o) => o.copy_from_slice(master),
        CopyOut::BF16(o) => o.convert_from_f32_slice(master),
        CopyOut::F16(o) => o.convert_from_f32_slice(master),
        CopyOut::None => {}
    }
}

/// Host bytes of a unit's first state buffers and norm partials ([`HostUse::OptimizerState`]):
/// for host-placed state, [`StateFormat::bytes`] (12 B per parameter in f32: p, m, v; 8 with
/// bf16 moments, 6.03 with int8, 2 fewer with a bf16 master), plus 8 B per [`NORM_BLOCK`].
pub fn state_host_bytes(numel: usize, placement: StatePlacement, format: StateFormat) -> u64 {
    let partials = 8 * numel.div_ceil(NORM_BLOCK) as u64;
    partials + if placement == StatePlacement::Host { format.bytes(numel) as u64 } else { 0 }
}

/// What speculating one unit costs: `(host bytes, NVMe bytes)`. Host: its second compute copy
/// (`numel` elements of `dtype`, in 4-byte words) plus, for host-placed state, a second
/// master and moments ([`StateFormat::bytes`] of `stream.format`: 12 B per parameter in f32);
/// NVMe: for NVMe-placed state, its second extents ([`StreamConfig::nvme_bytes`]), held from
/// its speculation to the commit.
pub fn speculation_cost(numel: usize, placement: StatePlacement, dtype: DType, stream: &StreamConfig) -> (u64, u64) {
    let copy = (copy_words(numel, dtype) * 4) as u64;
    match placement {
        StatePlacement::Host => (copy + stream.format.bytes(numel) as u64, 0),
        StatePlacement::Nvme => (copy, state_nvme_bytes(numel, stream)),
    }
}

/// Host bytes of one NVMe stream over units of at most `max_numel` parameters streamed as
/// `stream` says: three chunk buffers of `size_class(`[`StreamConfig::buffer_len`]`(min(chunk,
/// max_numel)))` (12 B per parameter in f32).
pub fn stream_host_bytes(max_numel: usize, stream: &StreamConfig) -> u64 {
    let len = stream.chunk_params.min(max_numel).max(1);
    crate::stream::STREAM_BUFFERS as u64 * size_class(stream.buffer_len(len)) as u64
}

/// Which units speculate, from [`PipelinedOptimizer::reserve_speculation`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationReport {
    /// Units with second buffers (updated out of place while the step is open).
    pub speculative_units: usize,
    /// Units without (updated in place after the decision).
    pub deferred_units: usize,
    /// Host bytes of the second buffers ([`HostUse::Speculation`]).
    pub host_bytes: u64,
    /// NVMe bytes the speculated NVMe units' second extents may hold.
    pub nvme_bytes: u64,
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

impl PipelinedOptimizer {
    /// An optimizer with `config` on its own: `nvme` is the store for units placed on NVMe
    /// (`None`: host only); compute copies live in a [`MemoryHome`] and host memory is measured
    /// by an unlimited [`HostLedger`] ([`PipelinedOptimizer::host_ledger`]).
    ///
    /// # Errors
    /// [`Error::Config`] / [`Error::IsaUnavailable`] from [`OptimizerConfig::validate`];
    /// [`Error::ThreadPool`].
    pub fn new(config: OptimizerConfig, nvme: Option<Arc<NvmeStore>>) -> Result<Self> {
        Self::with_home(config, nvme, HostLedger::unlimited(), Arc::new(MemoryHome::new()))
    }

    /// An optimizer whose units' compute copies live in `home` (the runtime's: the residency
    /// manager's host copies) and whose host memory is claimed from `ledger`.
    ///
    /// # Errors
    /// As [`PipelinedOptimizer::new`].
    pub fn with_home(
        config: OptimizerConfig,
        nvme: Option<Arc<NvmeStore>>,
        ledger: Arc<HostLedger>,
        home: Arc<dyn ComputeCopyHome>,
    ) -> Result<Self> {
        config.validate()?;
        let isa = config.isa.unwrap_or_else(Isa::detect);
        let kernel = AdamKernel::new(isa, config.threads)?;
        let stream = config.stream_config();
        let stream_pool = PinnedPool::with_ledger(
            &PinnedPoolConfig { budget_bytes: config.stream_host_budget_bytes, lock: true },
            Arc::new(MmapAllocator::new(true)),
            ledger.clone(),
            HostUse::NvmeStream,
        );
        let grad_pool = GradPool::new(ledger.clone());
        let slots = ((config.stream_host_budget_bytes / stream.stream_host_bytes()) as usize).max(1);
        tracing::debug!(%isa, threads = config.threads, stream_slots = slots, "pipelined optimizer");
        Ok(Self {
            shared: Arc::new(Shared {
                kernel,
                nvme,
                ledger,
                home,
                stream,
                stream_pool,
                slots: Slots { free: Mutex::new(slots), total: Mutex::new(slots), cv: Condvar::new() },
                units: RwLock::new(HashMap::new()),
                step: Mutex::new(StepState {
                    open: None,
                    epoch: 0,
                    last_step: None,
                    rollback_used_bytes: 0,
                    rollback_nvme_bytes: 0,
                    speculation_reserved: false,
                }),
                jobs_in_flight: Mutex::new(0),
                job_done: Condvar::new(),
                norm_reduce: Mutex::new(None),
                grad_pool,
                config,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.shared.config
    }

    /// Makes the global norm the run's when this optimizer holds a shard of the model's state
    /// ([`NormReduce`]); without it the norm is over this optimizer's units.
    pub fn set_norm_reduce(&self, reduce: NormReduce) {
        *self.shared.norm_reduce.lock() = Some(reduce);
    }

    /// The dispatch path in use.
    pub fn isa(&self) -> Isa {
        self.shared.kernel.isa()
    }

    /// Where the gradients of finished updates wait for the next step's gradients of the same
    /// unit size ([`GradPool`]): a caller making gradient vectors takes them from here.
    pub fn grad_pool(&self) -> &GradPool {
        &self.shared.grad_pool
    }

    /// The host ledger the optimizer claims its memory from.
    pub fn host_ledger(&self) -> &Arc<HostLedger> {
        &self.shared.ledger
    }

    /// The last step `t` that was committed (not skipped), if any.
    pub fn last_step(&self) -> Option<u64> {
        self.shared.step.lock().last_step
    }

    /// Host bytes held for roll-back (second buffers), at most the roll-back budget.
    pub fn rollback_bytes(&self) -> u64 {
        self.shared.step.lock().rollback_used_bytes
    }

    /// Host bytes of the NVMe stream buffers in use now (at most `stream_host_budget_bytes`).
    pub fn stream_host_bytes(&self) -> u64 {
        self.shared.stream_pool.live_bytes()
    }

    /// Host bytes one NVMe stream holds over the units added so far ([`stream_host_bytes`] of
    /// the largest NVMe-placed unit); 0 without NVMe-placed units.
    pub fn stream_bytes_per_stream(&self) -> u64 {
        let max = self.shared.units.read().values().filter(|c| c.placement == StatePlacement::Nvme).map(|c| c.n).max();
        max.map_or(0, |n| stream_host_bytes(n, &self.shared.stream))
    }

    /// Lowers (or raises) the host bytes the NVMe streams may hold, between steps: the stream
    /// pool's budget, and the streams run at once (`bytes / `[`Self::stream_bytes_per_stream`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming `optimizer.stream_host_budget_bytes` when `bytes` cannot hold one
    /// stream of the largest NVMe-placed unit.
    pub fn set_stream_host_budget_bytes(&self, bytes: u64) -> Result<()> {
        let per = self.stream_bytes_per_stream();
        if per == 0 {
            self.shared.stream_pool.set_budget_bytes(bytes);
            return Ok(());
        }
        if bytes < per {
            return Err(Error::Config {
                key: "optimizer.stream_host_budget_bytes".into(),
                reason: format!("{bytes} bytes cannot hold one stream ({per} bytes: three chunk buffers)"),
            });
        }
        self.shared.stream_pool.set_budget_bytes(bytes);
        self.shared.slots.resize((bytes / per) as usize);
        Ok(())
    }

    fn cell(&self, unit: TensorId) -> Result<Arc<UnitCell>> {
        self.shared.units.read().get(&unit).cloned().ok_or(Error::UnknownUnit { unit })
    }

    /// Registers a unit with its master weights (`m = v = 0`, compute copy = `master` converted,
    /// handed to the home). With [`StatePlacement::Nvme`] the state is written to the store now.
    /// Host-placed state and the norm partials are claimed from the ledger
    /// ([`HostUse::OptimizerState`]). Second buffers come later, from
    /// [`PipelinedOptimizer::reserve_speculation`] (or the first `begin_step`).
    ///
    /// # Errors
    /// [`Error::DuplicateUnit`]; [`Error::Protocol`] during a step or after the speculation was
    /// reserved; [`Error::NoNvmeStore`]; [`Error::Swapper`] when the ledger refuses the state
    /// ([`oogc_swapper::Error::HostBudget`]), writing to the store fails, or the home refuses
    /// the copy.
    pub fn add_unit(&self, unit: TensorId, master: &[f32], placement: StatePlacement) -> Result<()> {
        self.add_shard(unit, master, 0, placement)
    }

    /// [`PipelinedOptimizer::add_unit`] for elements `offset..offset + master.len()` of a unit
    /// (a data-parallel rank's shard, `offset` a multiple of [`crate::QUANT_BLOCK`] so that its
    /// int8 blocks are the whole unit's): bf16 master weights round element `i` stochastically
    /// with the unit's index `offset + i` ([`crate::sr_bits`]), as one process holding the whole
    /// unit does. `offset` 0 is [`PipelinedOptimizer::add_unit`].
    ///
    /// # Errors
    /// As [`PipelinedOptimizer::add_unit`].
    pub fn add_shard(&self, unit: TensorId, master: &[f32], offset: usize, placement: StatePlacement) -> Result<()> {
        let sh = &self.shared;
        let offset = offset as u64;
        let master = &*held_master(sh.stream.format.master, master);
        let n = master.len();
        let dtype = sh.config.compute_dtype;
        if sh.units.read().contains_key(&unit) {
            return Err(Error::DuplicateUnit { unit });
        }
        let step = sh.step.lock();
        if step.open.is_some() {
            return Err(Error::Protocol(format!("add_unit({unit}) during a step: add units before begin_step")));
        }
        let claim = sh
            .ledger
            .claim(HostUse::OptimizerState, state_host_bytes(n, placement, sh.stream.format))
            .map_err(|source| Error::Swapper { unit, source })?;
        let (home, claim) = match placement {
            StatePlacement::Host => {
                let mut cur = HostBufs::zeros(n, sh.stream.format, claim);
                cur.p = MasterBuf::from_f32(sh.stream.format.master, master);
                (Home::Host { cur, spare: None }, HostClaim::none(HostUse::OptimizerState))
            }
            StatePlacement::Nvme => {
                let store = sh.nvme.as_ref().ok_or(Error::NoNvmeStore { unit })?;
                // Every stream buffer at the largest unit's chunk length: one size class, each
                // buffer reused by every unit's stream (the plan holds `threads` streams of it).
                sh.stream_pool.raise_min_len(sh.stream.buffer_len(sh.stream.chunk_params.min(n)));
                let zeros = MomentBufs::zeros(sh.stream.format.moments, n);
                let _slot = sh.slots.acquire();
                let st = NvmeState::write(store, &sh.stream_pool, unit, sh.stream, master, &zeros)?.at_offset(offset);
                (Home::Nvme { cur: Some(st), new: None }, claim)
            }
        };
        let mut copy = vec![0u8; n * dtype.size_in_bytes()];
        fill_copy(&mut copy, master, dtype);
        if let Err(source) = sh.home.add_unit(unit, &copy) {
            if let (Home::Nvme { cur: Some(st), .. }, Some(store)) = (home, sh.nvme.as_ref()) {
                st.free(store);
            }
            return Err(Error::Swapper { unit, source });
        }
        let data = UnitData {
            version: 0,
            home,
            spare_copy: None,
            partials: vec![0.0; n.div_ceil(NORM_BLOCK)],
            _claim: claim,
            grads: None,
        };
        let cell = UnitCell {
            id: unit,
            n,
            offset,
            placement,
            inner: Mutex::new(UnitInner {
                data: Some(data),
                error: None,
                pending: None,
                submitted_epoch: 0,
                final_epoch: step.epoch,
            }),
            cv: Condvar::new(),
        };
        sh.units.write().insert(unit, Arc::new(cell));
        Ok(())
    }

    /// Gives second buffers to the units that have none, in unit-id order, while their cost
    /// ([`speculation_cost`]) fits: `host_budget_bytes` (further capped by
    /// [`OptimizerConfig::rollback_budget_bytes`]) and the ledger for the host buffers
    /// ([`HostUse::Speculation`]), `nvme_budget_bytes` for NVMe-placed units' second extents.
    /// A unit that does not fit is deferred (exact either way; only the overlap differs).
    /// Call it once all units are added, before the first step; without a call the first
    /// [`begin_step`](Self::begin_step) makes it with the roll-back budget and no NVMe limit.
    ///
    /// # Errors
    /// [`Error::Protocol`] during a step.
    pub fn reserve_speculation(&self, host_budget_bytes: u64, nvme_budget_bytes: u64) -> Result<SpeculationReport> {
        let sh = &self.shared;
        let mut step = sh.step.lock();
        if step.open.is_some() {
            return Err(Error::Protocol("reserve_speculation during a step: call it before begin_step".into()));
        }
        step.speculation_reserved = true;
        if sh.config.updates_immediately() {
            // Every update is final when its job ends: nothing to roll back, nothing to speculate.
            let report = SpeculationReport::default();
            tracing::debug!(?report, "speculation reserved: none (updates are immediate)");
            return Ok(report);
        }
        let host_budget = sh.config.rollback_budget_bytes.map_or(host_budget_bytes, |b| b.min(host_budget_bytes));
        let dtype = sh.config.compute_dtype;
        let mut cells: Vec<Arc<UnitCell>> = sh.units.read().values().cloned().collect();
        cells.sort_by_key(|c| c.id);
        let mut report = SpeculationReport::default();
        for cell in cells {
            let mut g = cell.idle();
            let data = g.data.as_mut().expect("idle cell holds its data");
            if data.speculative() {
                report.speculative_units += 1;
                continue;
            }
            let (host, nvme) = speculation_cost(cell.n, cell.placement, dtype, &sh.stream);
            let fits = step.rollback_used_bytes.saturating_add(host) <= host_budget
                && step.rollback_nvme_bytes.saturating_add(nvme) <= nvme_budget_bytes;
            let claim = if fits { sh.ledger.claim(HostUse::Speculation, host).ok() } else { None };
            let Some(claim) = claim else {
                report.deferred_units += 1;
                continue;
            };
            if let Home::Host { spare, .. } = &mut data.home {
                *spare = Some(HostBufs::zeros(cell.n, sh.stream.format, HostClaim::none(HostUse::Speculation)));
            }
            data.spare_copy =
                Some(SpareCopy { words: vec![0u32; copy_words(cell.n, dtype)], unpublished: false, _claim: claim });
            step.rollback_used_bytes += host;
            step.rollback_nvme_bytes += nvme;
            report.speculative_units += 1;
        }
        report.host_bytes = step.rollback_used_bytes;
        report.nvme_bytes = step.rollback_nvme_bytes;
        tracing::debug!(?report, "speculation reserved");
        Ok(report)
    }

    /// Opens step `t` (1-based, as torch's step counter) with learning rate `lr` (e.g. from
    /// [`crate::LrSchedule::lr`]). After a skipped step, give the same `t` again.
    ///
    /// # Errors
    /// [`Error::Protocol`] when a step is open; [`Error::Config`] for `t = 0` or a bad `lr`.
    pub fn begin_step(&self, step: u64, lr: f32) -> Result<()> {
        let sh = &self.shared;
        if !sh.step.lock().speculation_reserved {
            self.reserve_speculation(u64::MAX, u64::MAX)?;
        }
        let mut st = sh.step.lock();
        if let Some(o) = &st.open {
            return Err(Error::Protocol(format!(
                "begin_step({step}) while step {} is open: call finish_step first",
                o.t
            )));
        }
        let scalars = sh.config.adam.scalars(step, lr, 1.0)?;
        st.epoch += 1;
        let epoch = st.epoch;
        st.open = Some(OpenStep {
            t: step,
            lr,
            epoch,
            scalars,
            submitted: Vec::new(),
            partial_sumsq: 0.0,
            external: BTreeMap::new(),
        });
        Ok(())
    }

    /// Adds the sum of squared gradients of `unit`, a unit this step updates outside this
    /// optimizer (a device optimizer's, for a unit whose master weights and Adam state live in GPU memory), to the step's global norm: the
    /// norm, the clip scale and the non-finite skip of [`finish_step`](Self::finish_step) are then
    /// the whole model's, summed in unit-id order with this optimizer's own units. The caller
    /// applies the reported clip scale (and skip) to that unit's update itself.
    ///
    /// # Errors
    /// [`Error::Protocol`] without an open step, for a unit this optimizer was given gradients
    /// of in the step, or for a second sum of the same unit.
    pub fn add_external_sumsq(&self, unit: TensorId, sumsq: f64) -> Result<()> {
        let mut st = self.shared.step.lock();
        let Some(open) = st.open.as_mut() else {
            return Err(Error::Protocol(format!(
                "add_external_sumsq({unit}) without an open step: call begin_step first"
            )));
        };
        if open.submitted.contains(&unit) || open.external.insert(unit, sumsq).is_some() {
            return Err(Error::Protocol(format!(
                "add_external_sumsq({unit}): the unit's gradients were counted already this step"
            )));
        }
        Ok(())
    }

    /// Hands over a unit's gradients (`numel` elements, f32, bf16 or f16) and returns at once;
    /// the unit's update runs on the worker pool. If the unit's previous update is still running
    /// (the last step's redo), waits for it first. The gradients' bytes are claimed from the
    /// ledger ([`HostUse::Gradients`]) until the step is final; a caller that claimed them
    /// before making them uses [`submit_claimed`](Self::submit_claimed).
    ///
    /// # Errors
    /// [`Error::Protocol`] without an open step or for a second submit of the unit in the step;
    /// [`Error::UnknownUnit`]; [`Error::LengthMismatch`] naming the unit; [`Error::Swapper`]
    /// when the ledger refuses the gradients' bytes.
    pub fn submit(&self, unit: TensorId, grads: Grads) -> Result<UpdateHandle> {
        let claim = self
            .shared
            .ledger
            .claim(HostUse::Gradients, grads.num_bytes() as u64)
            .map_err(|source| Error::Swapper { unit, source })?;
        self.submit_claimed(unit, grads, claim)
    }

    /// [`submit`](Self::submit) with the gradients' bytes already claimed (`claim`, held until
    /// the step is final).
    ///
    /// # Errors
    /// As [`submit`](Self::submit), without the ledger's.
    pub fn submit_claimed(&self, unit: TensorId, grads: Grads, claim: HostClaim) -> Result<UpdateHandle> {
        let sh = &self.shared;
        let cell = self.cell(unit)?;
        if grads.len() != cell.n {
            return Err(Error::LengthMismatch {
                what: format!("unit {unit} gradients"),
                expected: cell.n,
                got: grads.len(),
            });
        }
        let (t, epoch, scalars) = {
            let mut st = sh.step.lock();
            let Some(open) = st.open.as_mut() else {
                return Err(Error::Protocol(format!("submit({unit}) without an open step: call begin_step first")));
            };
            if open.submitted.contains(&unit) {
                return Err(Error::Protocol(format!("unit {unit} submitted twice in step {}", open.t)));
            }
            open.submitted.push(unit);
            (open.t, open.epoch, open.scalars)
        };
        let mut data = {
            let mut g = cell.idle();
            g.submitted_epoch = epoch;
            g.pending = None;
            g.data.take().expect("idle cell holds its data")
        };
        data.grads = Some((grads, claim));
        let (sh2, cell2) = (self.shared.clone(), cell.clone());
        *sh.jobs_in_flight.lock() += 1;
        let immediate = sh.config.updates_immediately();
        sh.kernel.spawn(move || {
            if immediate {
                immediate_job(&sh2, &cell2, data, t, epoch, scalars);
            } else {
                speculate_job(&sh2, &cell2, data, epoch, scalars);
            }
            *sh2.jobs_in_flight.lock() -= 1;
            sh2.job_done.notify_all();
        });
        Ok(UpdateHandle { cell, epoch })
    }

    /// When the optimizer [updates immediately](OptimizerConfig::updates_immediately), blocks
    /// while [`OptimizerConfig::gradients_in_flight`] submitted units still hold their gradients,
    /// so a submitter faster than the updates (a backward ahead of NVMe-bound updates) waits
    /// instead of piling gradients up in host memory; call it before making the next unit's
    /// gradients' host copy. Otherwise returns at once: the gradients are held until the step's
    /// decision anyway.
    pub fn wait_for_gradient_room(&self) {
        let sh = &self.shared;
        if !sh.config.updates_immediately() {
            return;
        }
        let limit = sh.config.gradients_in_flight();
        let mut n = sh.jobs_in_flight.lock();
        while *n >= limit {
            sh.job_done.wait(&mut n);
        }
    }

    /// Blocks until the unit has no update in flight. After [`finish_step`](Self::finish_step)
    /// returned, this means its state and compute copy of that step are final (a speculated
    /// unit's copy may still wait to be [published](Self::publish)).
    ///
    /// # Errors
    /// [`Error::UnknownUnit`]; the error of the unit's last job if it failed (reported once).
    pub fn wait_unit(&self, unit: TensorId) -> Result<()> {
        let cell = self.cell(unit)?;
        let mut g = cell.idle();
        g.error.take().map_or(Ok(()), Err)
    }

    /// Waits as [`wait_unit`](Self::wait_unit), then writes the unit's committed compute copy
    /// into its home if it is not there yet (a speculated unit's, once its step is final). After
    /// this the home holds the unit's latest committed copy.
    ///
    /// # Errors
    /// As [`wait_unit`](Self::wait_unit); [`Error::Swapper`] when the home cannot take the copy.
    pub fn publish(&self, unit: TensorId) -> Result<()> {
        let cell = self.cell(unit)?;
        let mut data = {
            let mut g = cell.idle();
            if let Some(e) = g.error.take() {
                return Err(e);
            }
            let d = g.data.as_mut().expect("idle cell holds its data");
            if !d.spare_copy.as_ref().is_some_and(|s| s.unpublished) {
                return Ok(());
            }
            g.data.take().expect("idle cell holds its data")
        };
        let r = publish_data(&self.shared, &cell, &mut data);
        cell.put_back(data, None, None, None);
        r
    }

    /// Calls `f` with the unit's committed compute copy (`numel × size` bytes of
    /// [`OptimizerConfig::compute_dtype`], little-endian), after waiting as
    /// [`wait_unit`](Self::wait_unit): the second buffer of a speculated unit not yet
    /// published, else the home's copy. During a step (before `finish_step`) this is the copy
    /// of the previous step.
    ///
    /// # Errors
    /// As [`wait_unit`](Self::wait_unit); [`Error::Swapper`] when the home cannot read it.
    pub fn read_compute_copy(&self, unit: TensorId, f: impl FnOnce(&[u8])) -> Result<()> {
        let cell = self.cell(unit)?;
        let mut g = cell.idle();
        if let Some(e) = g.error.take() {
            return Err(e);
        }
        let data = g.data.as_ref().expect("idle cell holds its data");
        let len = cell.n * self.shared.config.compute_dtype.size_in_bytes();
        if let Some(spare) = data.spare_copy.as_ref().filter(|s| s.unpublished) {
            f(copy_bytes(&spare.words, cell.n, self.shared.config.compute_dtype));
            return Ok(());
        }
        drop(g);
        let mut f = Some(f);
        self.shared
            .home
            .read(unit, &mut |bytes| {
                if let Some(f) = f.take() {
                    f(&bytes[..len]);
                }
            })
            .map_err(|source| Error::Swapper { unit, source })
    }

    /// Closes the step once every gradient is in: waits for the speculative jobs, computes the
    /// global norm and the clipping scale, then commits, redoes or discards each submitted unit
    /// (module docs). Redone and deferred updates continue on the pool after this returns; wait
    /// for them per unit with [`wait_unit`](Self::wait_unit). Units not submitted are not
    /// updated (as a parameter without gradient in torch).
    ///
    /// # Errors
    /// [`Error::Protocol`] without an open step; the first job error (NVMe I/O, a panic) or
    /// [`Error::NormReduce`] (the [`NormReduce`] failed): the step is then rolled back for every
    /// unit (as a skipped step) and not counted.
    pub fn finish_step(&self) -> Result<StepReport> {
        let sh = &self.shared;
        let open = {
            let st = sh.step.lock();
            match &st.open {
                Some(o) => OpenStep { submitted: o.submitted.clone(), external: o.external.clone(), ..*o },
                None => return Err(Error::Protocol("finish_step without an open step: call begin_step first".into())),
            }
        };
        let cells: Vec<Arc<UnitCell>> = open.submitted.iter().map(|&u| self.cell(u)).collect::<Result<_>>()?;
        let mut first_error = None;
        let mut norms = BTreeMap::new();
        for cell in &cells {
            let mut g = cell.idle();
            if let Some(e) = g.error.take() {
                first_error.get_or_insert(e);
            }
            let p = g.pending.expect("a finished job leaves its outcome");
            debug_assert_eq!(p.epoch, open.epoch);
            norms.insert(cell.id, p);
        }
        // Unit-id order over this optimizer's units and those updated elsewhere alike.
        let mut sums: BTreeMap<TensorId, f64> = norms.iter().map(|(&u, p)| (u, p.sumsq)).collect();
        sums.extend(open.external.iter().map(|(&u, &s)| (u, s)));
        let grad_norm = match self.shared.norm_reduce.lock().clone() {
            // The partial sum of squares made the run's (in the same order as `global_norm`).
            Some(reduce) => match reduce(sums.values().fold(0.0f64, |a, s| a + s)) {
                Ok(sumsq) => sumsq.sqrt(),
                Err(reason) => {
                    first_error.get_or_insert(Error::NormReduce { step: open.t, reason });
                    f64::NAN
                }
            },
            None => global_norm(sums.values().copied()),
        };
        let skipped = !grad_norm.is_finite() || first_error.is_some();
        let scale = if skipped { 1.0 } else { clip_scale(grad_norm, sh.config.clip_norm) };
        let mut report = StepReport {
            step: open.t,
            lr: open.lr,
            grad_norm,
            clip_scale: scale,
            skipped,
            units: cells.len(),
            committed_speculative: 0,
            redone: 0,
            deferred: 0,
        };
        let scalars = open.scalars.with_grad_scale(scale);
        // Reverse submission order: the backward submits last unit first, the forward needs
        // the first unit first.
        for cell in cells.iter().rev() {
            let pending = norms[&cell.id];
            let mut g = cell.idle();
            let mut data = g.data.take().expect("idle cell holds its data");
            if pending.done {
                // Updated and committed by its submit job (or failed, reported below).
                g.data = Some(data);
            } else if skipped {
                discard(sh, &mut data);
                recycle_grads(sh, &mut data);
                g.data = Some(data);
                g.final_epoch = open.epoch;
            } else if pending.speculated && scale == 1.0 {
                commit(sh, &mut data);
                recycle_grads(sh, &mut data);
                g.data = Some(data);
                g.final_epoch = open.epoch;
                report.committed_speculative += 1;
            } else {
                if pending.speculated {
                    report.redone += 1;
                } else {
                    report.deferred += 1;
                }
                drop(g);
                let (sh2, cell2) = (sh.clone(), cell.clone());
                let epoch = open.epoch;
                sh.kernel.spawn(move || final_job(&sh2, &cell2, data, epoch, scalars));
                continue;
            }
            drop(g);
            cell.cv.notify_all();
        }
        {
            let mut st = sh.step.lock();
            st.open = None;
            if !skipped {
                st.last_step = Some(open.t);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                tracing::debug!(step = open.t, grad_norm, scale, skipped, "optimizer step");
                Ok(report)
            }
        }
    }

    /// The unit's committed state (for a checkpoint), after waiting as [`wait_unit`](Self::wait_unit):
    /// [`PipelinedOptimizer::snapshot_state`] read at once.
    ///
    /// # Errors
    /// [`Error::UnknownUnit`]; [`Error::Protocol`] during a step; [`Error::Swapper`] reading NVMe.
    pub fn export_state(&self, unit: TensorId) -> Result<UnitState> {
        self.snapshot_state(unit)?.read()
    }

    /// The unit's committed state as it is now, to be read later ([`StateSnapshot::read`], on
    /// any thread) while the step goes on, after waiting as [`wait_unit`](Self::wait_unit): a
    /// background checkpoint's snapshot. Nothing is copied now: the read copies the state
    /// (host-placed: from its buffers; NVMe-placed: from its extents, copy-on-write, so the
    /// read holds them while it streams) as long as the committed state is still this one,
    /// else it fails. A speculated step leaves the committed state as it is until
    /// [`finish_step`](Self::finish_step) (an [immediate](OptimizerConfig::updates_immediately)
    /// one until the unit's update), so a caller reads its snapshots before then.
    ///
    /// # Errors
    /// [`Error::UnknownUnit`]; [`Error::Protocol`] during a step; the unit's failed job's error.
    pub fn snapshot_state(&self, unit: TensorId) -> Result<StateSnapshot> {
        self.no_open_step("snapshot_state")?;
        let cell = self.cell(unit)?;
        let version = {
            let mut g = cell.idle();
            if let Some(e) = g.error.take() {
                return Err(e);
            }
            g.data.as_ref().expect("idle cell holds its data").version
        };
        Ok(StateSnapshot { cell, version, shared: Arc::clone(&self.shared) })
    }

    /// Replaces the unit's state (from a checkpoint) and rewrites its compute copy in its home
    /// from `master`.
    ///
    /// # Errors
    /// [`Error::UnknownUnit`]; [`Error::Protocol`] during a step; [`Error::LengthMismatch`]
    /// naming the unit and the vector; [`Error::Swapper`] writing NVMe (the old state stays) or
    /// the home.
    pub fn import_state(&self, unit: TensorId, state: UnitState) -> Result<()> {
        self.no_open_step("import_state")?;
        let cell = self.cell(unit)?;
        for (what, got) in [("master", state.master.len()), ("moments", state.moments.len())] {
            if got != cell.n {
                return Err(Error::LengthMismatch {
                    what: format!("unit {unit} imported {what}"),
                    expected: cell.n,
                    got,
                });
            }
        }
        let mut data = {
            let mut g = cell.idle();
            g.error = None;
            g.data.take().expect("idle cell holds its data")
        };
        let format = self.shared.stream.format;
        let master = held_master(format.master, &state.master).into_owned();
        let state = UnitState { master, moments: state.moments.converted(format.moments) };
        let r = import_data(&self.shared, &cell, &mut data, state);
        cell.put_back(data, None, None, None);
        r
    }

    fn no_open_step(&self, what: &str) -> Result<()> {
        match &self.shared.step.lock().open {
            Some(o) => Err(Error::Protocol(format!("{what} during step {}: call it after finish_step", o.t))),
            None => Ok(()),
        }
    }
}

impl Drop for PipelinedOptimizer {
    /// Waits for every job, then frees the NVMe extents of the units.
    fn drop(&mut self) {
        let units: Vec<Arc<UnitCell>> = self.shared.units.read().values().cloned().collect();
        for cell in units {
            let mut g = cell.idle();
            if let (Some(store), Some(data)) = (self.shared.nvme.as_ref(), g.data.as_mut()) {
                if let Home::Nvme { cur, new } = &mut data.home {
                    for st in [cur.take(), new.take()].into_iter().flatten() {
                        st.free(store);
                    }
                }
            }
        }
    }
}

/// Widens a compute copy (`bytes` of `dtype`, little-endian) to f32 into `out`. Reads the bytes
/// as they are: a home's buffer need not be aligned to the element (an empty one, a rank's
/// empty shard, has any address).
fn copy_to_f32(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            let elems = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            out.iter_mut().zip(elems).for_each(|(o, x)| *o = x);
        }
        DType::BF16 => {
            let elems = bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32());
            out.iter_mut().zip(elems).for_each(|(o, x)| *o = x);
        }
        DType::F16 => {
            let elems = bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32());
            out.iter_mut().zip(elems).for_each(|(o, x)| *o = x);
        }
        DType::U8 => unreachable!("a compute copy is a float type"),
    }
}

/// [`PipelinedOptimizer::import_state`] on the unit's data, taken out of its cell.
fn import_data(sh: &Shared, cell: &UnitCell, data: &mut UnitData, state: UnitState) -> Result<()> {
    let unit = cell.id;
    data.version += 1;
    match &mut data.home {
        Home::Host { cur, .. } => {
            cur.p = MasterBuf::from_f32(sh.stream.format.master, &state.master);
            cur.mom = state.moments;
        }
        Home::Nvme { cur, .. } => {
            let store = sh.nvme.as_ref().ok_or(Error::NoNvmeStore { unit })?;
            let _slot = sh.slots.acquire();
            let new = NvmeState::write(store, &sh.stream_pool, unit, sh.stream, &state.master, &state.moments)?
                .at_offset(cell.offset);
            if let Some(old) = cur.replace(new) {
                old.free(store);
            }
        }
    }
    if let Some(spare) = data.spare_copy.as_mut() {
        spare.unpublished = false;
    }
    let dtype = sh.config.compute_dtype;
    sh.home
        .write(unit, &mut |out| fill_copy(out, &state.master, dtype))
        .map_err(|source| Error::Swapper { unit, source })
}

/// Writes a committed, unpublished second compute copy into the unit's home.
fn publish_data(sh: &Shared, cell: &UnitCell, data: &mut UnitData) -> Result<()> {
    let Some(spare) = data.spare_copy.as_mut().filter(|s| s.unpublished) else { return Ok(()) };
    let bytes = copy_bytes(&spare.words, cell.n, sh.config.compute_dtype);
    sh.home
        .write(cell.id, &mut |out| out[..bytes.len()].copy_from_slice(bytes))
        .map_err(|source| Error::Swapper { unit: cell.id, source })?;
    spare.unpublished = false;
    Ok(())
}

/// Makes the speculative (or deferred NVMe) result the committed state; a second compute copy
/// becomes the unit's committed copy, to be published into its home.
fn commit(sh: &Shared, data: &mut UnitData) {
    data.version += 1;
    match &mut data.home {
        Home::Host { cur, spare } => {
            if let Some(spare) = spare.as_mut() {
                std::mem::swap(&mut cur.p, &mut spare.p);
                std::mem::swap(&mut cur.mom, &mut spare.mom);
            }
        }
        Home::Nvme { cur, new } => {
            let fresh = new.take().expect("an updated NVMe unit has new extents");
            if let Some(old) = cur.replace(fresh) {
                old.free(sh.nvme.as_ref().expect("NVMe unit has a store"));
            }
        }
    }
    if let Some(spare) = data.spare_copy.as_mut() {
        spare.unpublished = true;
    }
}

/// Drops a speculative result (the committed state is untouched).
fn discard(sh: &Shared, data: &mut UnitData) {
    if let Home::Nvme { new, .. } = &mut data.home {
        if let Some(st) = new.take() {
            st.free(sh.nvme.as_ref().expect("NVMe unit has a store"));
        }
    }
}

/// Runs one update of the unit from its committed state with `scalars`, writing the new compute
/// copy to `out`: out of place into the spare buffers (speculative units) or in place; NVMe
/// state to new extents, its master weights from `master` ([`MasterIn`]). With `with_sumsq`,
/// returns the gradients' sum of squares.
#[allow(clippy::too_many_arguments)]
fn update_into(
    sh: &Shared,
    cell: &UnitCell,
    home: &mut Home,
    partials: &mut [f64],
    grads: GradSlice<'_>,
    master: MasterIn<'_>,
    out: CopyOut<'_>,
    scalars: &StepScalars,
    with_sumsq: bool,
) -> Result<f64> {
    match home {
        Home::Host { cur, spare } => {
            let partials = with_sumsq.then_some(partials);
            match (spare, &mut cur.p, &mut cur.mom) {
                (Some(s), MasterBuf::F32(p), MomentBufs::F32 { m, v }) => {
                    let (MasterBuf::F32(sp), MomentBufs::F32 { m: sm, v: sv }) = (&mut s.p, &mut s.mom) else {
                        unreachable!("one state format")
                    };
                    let state = StateIo::OutOfPlace { src: [p, m, v], dst: [sp, sm, sv] };
                    sh.kernel.step_state(scalars, state, grads, out, partials)
                }
                (None, MasterBuf::F32(p), MomentBufs::F32 { m, v }) => {
                    sh.kernel.step_state(scalars, StateIo::InPlace { p, m, v }, grads, out, partials)
                }
                (spare, _, _) => {
                    // Reduced state updates in place only: a speculated unit's second buffers
                    // take a copy of the committed state first (one more read and write of it).
                    let target = match spare {
                        Some(s) => {
                            s.p.copy_from(&cur.p);
                            s.mom.clone_from(&cur.mom);
                            s
                        }
                        None => cur,
                    };
                    let moments = target.mom.view();
                    match &mut target.p {
                        MasterBuf::F32(p) => {
                            sh.kernel.step_state(scalars, Reduced { p, moments }, grads, out, partials)
                        }
                        MasterBuf::Bf16(p) => {
                            let state =
                                Bf16Master { p, moments, key: sr_key(cell.id.0, scalars.step()), offset: cell.offset };
                            sh.kernel.step_state(scalars, state, grads, out, partials)
                        }
                    }
                }
            }
        }
        Home::Nvme { cur, new } => {
            let store = sh.nvme.as_ref().expect("NVMe unit has a store");
            if let Some(stale) = new.take() {
                stale.free(store);
            }
            let _slot = sh.slots.acquire();
            let part = with_sumsq.then_some(&mut partials[..]);
            let (fresh, stats) = stream_update(
                store,
                &sh.stream_pool,
                sh.kernel.isa(),
                scalars,
                cur.as_ref().expect("committed state"),
                master,
                grads,
                out,
                part,
            )?;
            tracing::trace!(unit = %cell.id, chunks = stats.chunks, peak_host_bytes = stats.peak_host_bytes, "streamed");
            *new = Some(fresh);
            Ok(if with_sumsq { partials.iter().fold(0.0f64, |a, &s| a + s) } else { 0.0 })
        }
    }
}

/// Runs one update of the unit (see [`update_into`]): a speculated unit writes its new compute
/// copy into its second buffer, any other straight into its home (the step is final then). NVMe
/// state that keeps its master weights in the compute copy ([`StreamConfig::master_in_copy`])
/// reads them from the home's committed copy: beside the second buffer, or in place.
fn update(sh: &Shared, cell: &UnitCell, data: &mut UnitData, scalars: &StepScalars, with_sumsq: bool) -> Result<f64> {
    let dtype = sh.config.compute_dtype;
    let n = cell.n;
    let UnitData { home, spare_copy, partials, grads, .. } = data;
    let grads = grads.as_ref().map(|(g, _)| g.as_slice()).expect("a submitted unit holds its gradients");
    let in_copy = sh.stream.master_in_copy && matches!(home, Home::Nvme { .. });
    let len = n * dtype.size_in_bytes();
    let swap = |source| Error::Swapper { unit: cell.id, source };
    let mut result = Ok(0.0);
    match spare_copy {
        Some(spare) if in_copy => {
            sh.home
                .read(cell.id, &mut |bytes| {
                    let out = copy_out(&mut spare.words, n, dtype);
                    let master = MasterIn::Copy(&bytes[..len]);
                    result = update_into(sh, cell, home, partials, grads, master, out, scalars, with_sumsq);
                })
                .map_err(swap)?;
            result
        }
        Some(spare) => {
            let out = copy_out(&mut spare.words, n, dtype);
            update_into(sh, cell, home, partials, grads, MasterIn::Stored, out, scalars, with_sumsq)
        }
        None => {
            let mut f = |bytes: &mut [u8]| {
                let out = CopyOut::from_bytes(dtype, &mut bytes[..len]);
                let master = if in_copy { MasterIn::Out } else { MasterIn::Stored };
                result = update_into(sh, cell, home, partials, grads, master, out, scalars, with_sumsq);
            };
            // The old copy is read first when it holds the master weights; else only written.
            if in_copy { sh.home.update(cell.id, &mut f) } else { sh.home.write(cell.id, &mut f) }.map_err(swap)?;
            result
        }
    }
}

/// The job of `submit`: publish the last step's copy if it still waits, then speculate (update
/// out of place with scale 1 and take the sum of squares) or, when that cannot pay, take the sum
/// of squares only.
fn speculate_job(sh: &Shared, cell: &UnitCell, mut data: UnitData, epoch: u64, scalars: StepScalars) {
    let _span = tracing::debug_span!("optimizer::speculate", unit = cell.id.0, params = cell.n).entered();
    let over_clip = {
        let st = sh.step.lock();
        let partial = st.open.as_ref().map_or(0.0, |o| o.partial_sumsq);
        !partial.is_finite() || sh.config.clip_norm.is_some_and(|c| partial.sqrt() + 1e-6 > c as f64)
    };
    let speculate = data.speculative() && !over_clip;
    let result = catch_unwind(AssertUnwindSafe(|| {
        // The second buffer is about to be overwritten: its committed copy goes home first.
        publish_data(sh, cell, &mut data)?;
        if speculate {
            update(sh, cell, &mut data, &scalars, true)
        } else {
            let g = data.grads.as_ref().map(|(g, _)| g.as_slice()).expect("submitted gradients");
            Ok(sh.kernel.grad_sumsq(g))
        }
    }));
    let (sumsq, error) = match result {
        Ok(Ok(s)) => (s, None),
        Ok(Err(e)) => (f64::NAN, Some(e)),
        Err(p) => (f64::NAN, Some(Error::WorkerPanic { unit: cell.id, message: panic_message(p) })),
    };
    if let Some(o) = sh.step.lock().open.as_mut() {
        o.partial_sumsq += sumsq;
    }
    let pending = Pending { epoch, sumsq, speculated: speculate && error.is_none(), done: false };
    cell.put_back(data, error, Some(pending), None);
}

/// The job of `submit` when the optimizer [updates immediately](OptimizerConfig::updates_immediately):
/// the gradients' sum of squares first (a non-finite one leaves the unit untouched and fails the
/// step), then the one update in place, committed at once ([`update_and_commit`]), and the
/// gradients are dropped.
fn immediate_job(sh: &Shared, cell: &UnitCell, mut data: UnitData, step: u64, epoch: u64, scalars: StepScalars) {
    let _span = tracing::debug_span!("optimizer::update_now", unit = cell.id.0, params = cell.n).entered();
    let g = data.grads.as_ref().map(|(g, _)| g.as_slice()).expect("submitted gradients");
    let (sumsq, error) = match catch_unwind(AssertUnwindSafe(|| sh.kernel.grad_sumsq(g))) {
        Ok(s) if s.is_finite() => match update_and_commit(sh, cell, &mut data, &scalars) {
            None => (s, None),
            error => (f64::NAN, error),
        },
        Ok(s) => (f64::NAN, Some(Error::NonFiniteGradient { step, unit: cell.id, sumsq: s })),
        Err(p) => (f64::NAN, Some(Error::WorkerPanic { unit: cell.id, message: panic_message(p) })),
    };
    recycle_grads(sh, &mut data);
    if let Some(o) = sh.step.lock().open.as_mut() {
        o.partial_sumsq += sumsq;
    }
    let pending = Pending { epoch, sumsq, speculated: false, done: true };
    cell.put_back(data, error, Some(pending), Some(epoch));
}

/// Gives the unit's gradients (its update done or skipped) to the pool for the next step's.
fn recycle_grads(sh: &Shared, data: &mut UnitData) {
    if let Some((grads, claim)) = data.grads.take() {
        sh.grad_pool.give_back(grads, claim);
    }
}

/// The job of `finish_step` for a clipped step or a deferred unit: the one real update, then commit.
fn final_job(sh: &Shared, cell: &UnitCell, mut data: UnitData, epoch: u64, scalars: StepScalars) {
    let _span = tracing::debug_span!("optimizer::update", unit = cell.id.0, params = cell.n).entered();
    let error = update_and_commit(sh, cell, &mut data, &scalars);
    recycle_grads(sh, &mut data);
    cell.put_back(data, error, None, Some(epoch));
}

/// One update of the unit from its committed state with `scalars` ([`update`]), then its commit
/// (a speculated unit's second buffers, an NVMe unit's new extents); on an error or a panic the
/// new extents are discarded and the committed state stays. Returns the error, if any.
fn update_and_commit(sh: &Shared, cell: &UnitCell, data: &mut UnitData, scalars: &StepScalars) -> Option<Error> {
    match catch_unwind(AssertUnwindSafe(|| update(sh, cell, data, scalars, false))) {
        Ok(Ok(_)) => {
            if data.speculative() || matches!(data.home, Home::Nvme { .. }) {
                commit(sh, data);
            } else {
                data.version += 1; // updated in place
            }
            None
        }
        Ok(Err(e)) => {
            discard(sh, data);
            Some(e)
        }
        Err(p) => {
            discard(sh, data);
            Some(Error::WorkerPanic { unit: cell.id, message: panic_message(p) })
        }
    }
}
