//! Optimizer state on NVMe, streamed through a bounded amount of host memory.
//!
//! A unit's state is cut into chunks of [`StreamConfig::chunk_params`] parameters (a multiple of
//! [`NORM_BLOCK`], so of [`QUANT_BLOCK`]: a chunk holds whole quantization blocks); chunk `k` is
//! one extent of the swapper's [`NvmeStore`] holding the f32 master weights, then the moments in
//! their [`StateDType`](crate::StateDType) in the layout of [`Moments::from_bytes`]: `[p | m | v]` in f32 (12 B per
//! parameter), `[p | m | v]` with bf16 moments (8 B), `[p | m absmax | v absmax | m | v]` with
//! int8 moments (6 B and 8 B per block of 256). [`stream_update`] runs the update with three host buffers
//! (ZeRO-Infinity's overlap of NVMe reads, CPU update and NVMe writes).
//!
//! **Master weights in the compute copy.** When the compute copy holds the master weights bit
//! for bit (f32 masters with f32 compute copies, bf16 masters with bf16 ones:
//! [`StreamConfig::master_in_copy`]), storing them again in every chunk only writes the same
//! bytes twice per step. Then a chunk's extent holds the moments alone; the update reads the
//! master weights from the unit's compute copy ([`MasterIn`]) into the chunk buffer behind the
//! moments and writes the new ones as the new compute copy, as always. With state and
//! parameters on NVMe this drops 4 B per parameter from the optimizer's NVMe writes and reads
//! (the compute copy is read and written back anyway):
//!
//! ```text
//! buffer A: read k+1   | update k+2 | write k+2 ...
//! buffer B: update k   | write k    | read k+3 ...     (read k+1 ‖ update k ‖ write k−1)
//! buffer C: write k−1  | read k+2   | update k+2 ...
//! ```
//!
//! The chunk is updated in place in its buffer (the kernel is element-wise, so chunking does not
//! change a bit of the result) and written to a **new** extent: the old extents stay valid until
//! the caller frees them, which makes every streamed update out-of-place at no extra host memory
//! (the pipelined step's roll-back) and an I/O error harmless (the new extents are freed, the
//! old state is intact). Host memory is three buffers of `size_class(chunk bytes)`
//! ([`StreamConfig::buffer_bytes`]), taken from the [`PinnedPool`] the caller passes, whose
//! budget bounds it.

use std::collections::VecDeque;
use std::sync::Arc;

use oogc_swapper::host::PAGE_BYTES;
use oogc_swapper::{Extent, HostBuffer, IoHandle, NvmeStore, PinnedPool, TensorId};

use crate::error::{Error, Result};
use crate::kernel::{step_one, CopyOut, GradSlice, StateIo, StepScalars, NORM_BLOCK};
use crate::master::{sr_key, Bf16Master, MasterDType, StateFormat};
use crate::quant::{MomentBufs, Moments, Reduced, QUANT_BLOCK};
use crate::simd::Isa;

/// Buffers one stream holds: read, update, write.
pub const STREAM_BUFFERS: usize = 3;

/// How state is cut and streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamConfig {
    /// Parameters per chunk: a multiple of [`NORM_BLOCK`], more than 0. A chunk is
    /// [`StateFormat::bytes`]`(chunk_params)` bytes (12 × `chunk_params` in f32).
    pub chunk_params: usize,
    /// The master weights' and the moments' element types.
    pub format: StateFormat,
    /// The master weights live in the unit's compute copy, not in the chunks (module docs):
    /// extents hold the moments only and every update takes a [`MasterIn`] other than
    /// [`MasterIn::Stored`].
    pub master_in_copy: bool,
}

impl StreamConfig {
    /// Chunks of `chunk_params` parameters, f32 moments.
    ///
    /// # Errors
    /// [`Error::Config`] unless `chunk_params` is a positive multiple of [`NORM_BLOCK`].
    pub fn new(chunk_params: usize) -> Result<Self> {
        Self::with_format(chunk_params, StateFormat::default())
    }

    /// Chunks of `chunk_params` parameters, state stored as `format`.
    ///
    /// # Errors
    /// As [`StreamConfig::new`].
    pub fn with_format(chunk_params: usize, format: StateFormat) -> Result<Self> {
        if chunk_params == 0 || !chunk_params.is_multiple_of(NORM_BLOCK) {
            return Err(Error::Config {
                key: "optimizer.stream_chunk_bytes".into(),
                reason: format!("{chunk_params} parameters per chunk is not a positive multiple of {NORM_BLOCK}"),
            });
        }
        debug_assert_eq!(NORM_BLOCK % QUANT_BLOCK, 0);
        Ok(Self { chunk_params, format, master_in_copy: false })
    }

    /// The same, with the master weights in the compute copy when `yes` (module docs).
    pub fn with_master_in_copy(self, yes: bool) -> Self {
        Self { master_in_copy: yes, ..self }
    }

    /// Bytes of a chunk of `len` parameters on the store (before padding): master weights and
    /// moments, or the moments alone with [`Self::master_in_copy`].
    pub fn nvme_chunk_bytes(&self, len: usize) -> usize {
        if self.master_in_copy {
            self.format.moments.moment_bytes(len)
        } else {
            self.format.bytes(len)
        }
    }

    /// Where a chunk buffer of `len` parameters holds the master weights, and the buffer's
    /// length: `[p | moments]` when they are stored, `[moments | p]` when they come from the
    /// compute copy (the read fills the buffer's start), `p` at the next multiple of 4 bytes.
    /// Never more than [`StateFormat::bytes`] of a chunk one parameter longer, so a buffer of a
    /// whole chunk holds any chunk.
    fn layout(&self, len: usize) -> (usize, usize) {
        let p = self.format.master.master_bytes(len);
        if self.master_in_copy {
            let at = self.format.moments.moment_bytes(len).next_multiple_of(4);
            (at, at + p)
        } else {
            (0, self.format.bytes(len))
        }
    }

    /// Bytes of a host buffer for a chunk of `len` parameters ([`StateFormat::bytes`], plus at
    /// most 3 bytes of alignment for a ragged last chunk with the master in the compute copy).
    pub fn buffer_len(&self, len: usize) -> usize {
        self.layout(len).1
    }

    /// NVMe bytes of a unit's state of `numel` parameters: each chunk one extent of
    /// [`Self::nvme_chunk_bytes`] padded to 4 KiB.
    pub fn nvme_bytes(&self, numel: usize) -> u64 {
        let chunk_params = self.chunk_params.max(1);
        let full = (numel / chunk_params) as u64;
        let rest = numel % chunk_params;
        let pad = |params: usize| (self.nvme_chunk_bytes(params) as u64).next_multiple_of(PAGE_BYTES as u64);
        full * pad(chunk_params) + if rest > 0 { pad(rest) } else { 0 }
    }

    /// NVMe bytes per parameter over whole blocks of [`QUANT_BLOCK`], unpadded (what a planner
    /// multiplies): [`StateFormat::bytes_per_param`], less the master's with
    /// [`Self::master_in_copy`].
    pub fn nvme_bytes_per_param(&self) -> f64 {
        self.nvme_chunk_bytes(QUANT_BLOCK) as f64 / QUANT_BLOCK as f64
    }

    /// Bytes of one chunk buffer as the pool hands it out (its size class).
    pub fn buffer_bytes(&self) -> u64 {
        oogc_swapper::host::size_class(self.buffer_len(self.chunk_params)) as u64
    }

    /// Host bytes one stream holds at most: [`STREAM_BUFFERS`] chunk buffers.
    pub fn stream_host_bytes(&self) -> u64 {
        STREAM_BUFFERS as u64 * self.buffer_bytes()
    }
}

/// NVMe bytes of a unit's state of `numel` parameters streamed as `stream` says
/// ([`StreamConfig::nvme_bytes`]: `12 × numel` in f32 with the master weights stored, padded
/// per chunk to 4 KiB).
pub fn state_nvme_bytes(numel: usize, stream: &StreamConfig) -> u64 {
    stream.nvme_bytes(numel)
}

/// Where an update over NVMe state reads the unit's master weights from.
#[derive(Debug, Clone, Copy)]
pub enum MasterIn<'a> {
    /// From the chunks (the state stores them: [`StreamConfig::master_in_copy`] false).
    Stored,
    /// From this committed compute copy (the unit's whole copy, bytes of the compute dtype,
    /// which holds the master weights bit for bit); the new one goes to the update's output.
    Copy(&'a [u8]),
    /// From the update's output itself, before each chunk overwrites it: the compute copy is
    /// updated in place.
    Out,
}

/// What one stream did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Chunks updated.
    pub chunks: usize,
    /// Most host bytes the stream held at once (buffer capacities).
    pub peak_host_bytes: u64,
    /// Bytes read from the store.
    pub read_bytes: u64,
    /// Bytes written to the store.
    pub written_bytes: u64,
}

/// A unit's optimizer state on the NVMe store: `len` parameters in chunks, one extent each.
///
/// Not `Clone`, like [`Extent`]: give it back with [`NvmeState::free`] exactly once.
#[derive(Debug)]
pub struct NvmeState {
    unit: TensorId,
    len: usize,
    /// The unit's index of element 0 (a rank's shard starts inside its unit).
    offset: u64,
    cfg: StreamConfig,
    /// Shared with the snapshots of this state ([`NvmeState::share`]): the last holder frees
    /// them ([`NvmeState::free`]).
    extents: Arc<Vec<Extent>>,
}

fn swap_err(unit: TensorId) -> impl Fn(oogc_swapper::Error) -> Error {
    move |source| Error::Swapper { unit, source }
}

impl NvmeState {
    /// Writes master weights `p` (stored in `cfg`'s master dtype: bf16 rounded to nearest even,
    /// exact for values that are bf16) and `moments` (one length; of `cfg`'s moment dtype) to
    /// new extents, chunk by chunk through one buffer of `pool`. With
    /// [`StreamConfig::master_in_copy`] only the moments are written (`p` gives the length: the
    /// caller writes the master weights into the unit's compute copy).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`]; [`Error::Config`] for moments of another dtype than `cfg`'s;
    /// [`Error::Swapper`] for a full store, an I/O error or the pool's budget (extents written
    /// before the error are freed).
    pub fn write(
        store: &NvmeStore,
        pool: &PinnedPool,
        unit: TensorId,
        cfg: StreamConfig,
        p: &[f32],
        moments: &MomentBufs,
    ) -> Result<Self> {
        if moments.len() != p.len() {
            return Err(Error::LengthMismatch {
                what: format!("unit {unit} state moments"),
                expected: p.len(),
                got: moments.len(),
            });
        }
        if moments.dtype() != cfg.format.moments {
            return Err(Error::Config {
                key: "optimizer.state_dtype".into(),
                reason: format!("unit {unit}: {} moments given to a {} stream", moments.dtype(), cfg.format.moments),
            });
        }
        let mut state = NvmeState { unit, len: p.len(), offset: 0, cfg, extents: Arc::default() };
        let mut buf = Some(pool.alloc(state.buffer_bytes(0)).map_err(swap_err(unit))?);
        for k in 0..state.num_chunks() {
            let r = state.chunk_range(k);
            let mut b = buf.take().expect("buffer returned by the previous write");
            b.set_len(cfg.nvme_chunk_bytes(r.len()));
            if cfg.master_in_copy {
                moments.write_bytes(r, b.as_mut_slice());
            } else {
                let (fp, fm) = b.as_mut_slice().split_at_mut(cfg.format.master.master_bytes(r.len()));
                write_master(cfg.format.master, &p[r.clone()], fp);
                moments.write_bytes(r, fm);
            }
            let (res, b) = store.write(unit, b).wait();
            buf = Some(b);
            match res {
                Ok(e) => state.push_extent(e),
                Err(e) => {
                    state.free(store);
                    return Err(Error::Swapper { unit, source: e });
                }
            }
        }
        Ok(state)
    }

    /// Reads the whole state back: master weights (in f32: bf16 widened; `None` with
    /// [`StreamConfig::master_in_copy`]: the compute copy holds them) and moments.
    ///
    /// # Errors
    /// [`Error::Swapper`] for an I/O error, a corrupt block or the pool's budget.
    pub fn read(&self, store: &NvmeStore, pool: &PinnedPool) -> Result<(Option<Vec<f32>>, MomentBufs)> {
        let (mut p, mut moments) = (Vec::new(), MomentBufs::zeros(self.cfg.format.moments, 0));
        let stored = self.read_into(store, pool, &mut p, &mut moments)?;
        Ok((stored.then_some(p), moments))
    }

    /// [`NvmeState::read`] into `p` and `moments` (replacing what they held, within their
    /// capacity when it suffices); returns whether the master weights were stored (else `p` is
    /// left empty: the compute copy holds them).
    ///
    /// # Errors
    /// As [`NvmeState::read`].
    pub fn read_into(
        &self,
        store: &NvmeStore,
        pool: &PinnedPool,
        p: &mut Vec<f32>,
        moments: &mut MomentBufs,
    ) -> Result<bool> {
        let stored = !self.cfg.master_in_copy;
        p.clear();
        p.resize(if stored { self.len } else { 0 }, 0.0);
        moments.reset(self.cfg.format.moments, self.len);
        let mut buf = Some(pool.alloc(self.buffer_bytes(0)).map_err(swap_err(self.unit))?);
        for (k, e) in self.extents.iter().enumerate() {
            let r = self.chunk_range(k);
            let (res, b) = store.read(e, buf.take().expect("buffer back")).wait();
            res.map_err(swap_err(self.unit))?;
            let at = if stored { self.cfg.format.master.master_bytes(r.len()) } else { 0 };
            let (fp, fm) = b.as_slice().split_at(at);
            if stored {
                read_master(self.cfg.format.master, fp, &mut p[r.clone()]);
            }
            moments.read_bytes(r, fm);
            buf = Some(b);
        }
        Ok(stored)
    }

    /// Host buffer bytes of chunk `k` ([`StreamConfig::buffer_len`]).
    fn buffer_bytes(&self, k: usize) -> usize {
        self.cfg.buffer_len(self.chunk_range(k).len())
    }

    /// Frees every extent, unless a [`NvmeState::share`] of this state still holds them: the
    /// last holder's `free` does (copy-on-write snapshots for background checkpoints).
    pub fn free(self, store: &NvmeStore) {
        for e in Arc::into_inner(self.extents).into_iter().flatten() {
            store.free(e);
        }
    }

    /// The same state, holding the same extents: they stay valid (and allocated on the store)
    /// until every holder has called [`NvmeState::free`]. An update writes new extents and
    /// leaves these as they are, so a share reads the state of the moment it was taken.
    pub fn share(&self) -> Self {
        Self { extents: Arc::clone(&self.extents), ..*self }
    }

    /// Appends a written chunk's extent to a state being written (never shared yet).
    fn push_extent(&mut self, e: Extent) {
        Arc::get_mut(&mut self.extents).expect("a state being written is not shared").push(e);
    }

    /// The unit.
    pub fn unit(&self) -> TensorId {
        self.unit
    }

    /// This state as that of elements `offset..offset + len` of its unit (a data-parallel
    /// rank's shard): bf16 master weights round element `i` stochastically with the unit's
    /// index `offset + i` ([`crate::sr_bits`]), so that a rank rounds as one process holding
    /// the whole unit. [`NvmeState::write`] gives offset 0; [`stream_update`] keeps it.
    pub fn at_offset(mut self, offset: u64) -> Self {
        self.offset = offset;
        self
    }

    /// The unit's index of this state's element 0 ([`NvmeState::at_offset`]).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Parameters.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Chunks (extents).
    pub fn num_chunks(&self) -> usize {
        self.len.div_ceil(self.cfg.chunk_params)
    }

    /// Parameters of chunk `k`.
    pub fn chunk_range(&self, k: usize) -> std::ops::Range<usize> {
        k * self.cfg.chunk_params..((k + 1) * self.cfg.chunk_params).min(self.len)
    }

    /// Bytes on the store (padded extents).
    pub fn allocated_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.allocated_bytes()).sum()
    }
}

/// One Adam step over NVMe-resident `state`, streamed chunk by chunk (read k+1 ‖ update k ‖
/// write k−1) through [`STREAM_BUFFERS`] buffers of `pool`, on the calling thread with `isa`.
/// Writes the compute copy to `out` and, when given, the block sums of squares of `grads` to
/// `partials` (one slot per [`NORM_BLOCK`]). The master weights come from `master`: the chunks
/// ([`MasterIn::Stored`]), or the compute copy when the state keeps them there
/// ([`StreamConfig::master_in_copy`]; `out` must then be the compute copy of the master's
/// dtype). Returns the **new** state (new extents) and the stream's figures; `state` is left as
/// it was, for the caller to free (commit) or keep (roll back).
///
/// The result equals [`crate::adam_step`] over the same state in memory, bit for bit.
///
/// # Errors
/// [`Error::LengthMismatch`] (grads, out, partials, the master's copy); [`Error::Config`] for a
/// `master` the state's layout does not take (stored master weights and a copy given, or none
/// given with the master in the copy, or an `out` of another dtype than the master's);
/// [`Error::Swapper`] for the pool's budget (`OutOfMemory` on the host tier: raise
/// `optimizer.stream_host_budget_bytes`), a full store, an I/O error or a corrupt block. On error
/// every new extent is freed and `state` is intact — but with [`MasterIn::Out`] the chunks
/// updated before the error have new master weights in `out` (the step failed: resume from a
/// checkpoint).
#[allow(clippy::too_many_arguments)]
pub fn stream_update(
    store: &NvmeStore,
    pool: &PinnedPool,
    isa: Isa,
    scalars: &StepScalars,
    state: &NvmeState,
    master: MasterIn<'_>,
    grads: GradSlice<'_>,
    mut out: CopyOut<'_>,
    mut partials: Option<&mut [f64]>,
) -> Result<(NvmeState, StreamStats)> {
    let unit = state.unit;
    let n = state.len;
    check_master_in(state, master, &out)?;
    if grads.len() != n {
        return Err(Error::LengthMismatch { what: format!("unit {unit} gradients"), expected: n, got: grads.len() });
    }
    if let Some(got) = out.len() {
        if got != n {
            return Err(Error::LengthMismatch { what: format!("unit {unit} compute copy"), expected: n, got });
        }
    }
    if let Some(p) = &partials {
        if p.len() != n.div_ceil(NORM_BLOCK) {
            let what = format!("unit {unit} norm partials");
            return Err(Error::LengthMismatch { what, expected: n.div_ceil(NORM_BLOCK), got: p.len() });
        }
    }
    let chunks = state.num_chunks();
    let mut stats = StreamStats { chunks, ..Default::default() };
    let extents = Arc::new(Vec::with_capacity(chunks));
    let mut new = NvmeState { unit, len: n, offset: state.offset, cfg: state.cfg, extents };
    if chunks == 0 {
        return Ok((new, stats));
    }
    let buffer_len = state.buffer_bytes(0);
    let mut free: Vec<HostBuffer> = Vec::with_capacity(STREAM_BUFFERS);
    for _ in 0..STREAM_BUFFERS.min(chunks + 1) {
        let b = pool.alloc(buffer_len).map_err(swap_err(unit))?;
        stats.peak_host_bytes += b.capacity() as u64;
        free.push(b);
    }
    let mut writes: VecDeque<IoHandle<Extent>> = VecDeque::with_capacity(STREAM_BUFFERS);
    // On error: in-flight handles are dropped (the swapper keeps their buffers until the kernel
    // is done and frees a dropped write's extent); finished new extents are freed here.
    let fail = |new: NvmeState, e: oogc_swapper::Error| {
        new.free(store);
        Error::Swapper { unit, source: e }
    };
    let mut reading = Some(store.read(&state.extents[0], free.pop().expect("a buffer")));
    for k in 0..chunks {
        let next = if k + 1 < chunks {
            if free.is_empty() {
                let (res, b) = writes.pop_front().expect("a buffer is in a write").wait();
                free.push(b);
                match res {
                    Ok(e) => new.push_extent(e),
                    Err(e) => return Err(fail(new, e)),
                }
            }
            Some(store.read(&state.extents[k + 1], free.pop().expect("a buffer")))
        } else {
            None
        };
        let (res, mut buf) = reading.take().expect("chunk k is being read").wait();
        if let Err(e) = res {
            return Err(fail(new, e));
        }
        let r = state.chunk_range(k);
        stats.read_bytes += buf.len() as u64;
        let stored_len = buf.len();
        {
            let blocks = (r.start / NORM_BLOCK)..r.end.div_ceil(NORM_BLOCK);
            let part = partials.as_deref_mut().map(|p| &mut p[blocks]);
            let (g, o) = (grads.slice(r.clone()), out.slice_mut(r.clone()));
            let StateFormat { master: mdt, moments: dtype } = state.cfg.format;
            let (at, len) = state.cfg.layout(r.len());
            buf.set_len(len);
            let (pb, mb) = if state.cfg.master_in_copy {
                let (mb, pb) = buf.as_mut_slice().split_at_mut(at);
                let pb = &mut pb[..mdt.master_bytes(r.len())];
                let size = mdt.copy_dtype().size_in_bytes();
                let dst = &mut pb[..size * r.len()];
                match master {
                    MasterIn::Copy(copy) => dst.copy_from_slice(&copy[r.start * size..r.end * size]),
                    MasterIn::Out => dst.copy_from_slice(o.as_bytes().expect("checked: a compute copy")),
                    MasterIn::Stored => unreachable!("checked: the master comes from the compute copy"),
                }
                (pb, &mut mb[..dtype.moment_bytes(r.len())])
            } else {
                buf.as_mut_slice().split_at_mut(mdt.master_bytes(r.len()))
            };
            let moments = Moments::from_bytes(dtype, r.len(), mb);
            match (mdt, moments) {
                (MasterDType::F32, Moments::F32 { m, v }) => {
                    let p = bytemuck::cast_slice_mut(pb);
                    step_one(isa, scalars, StateIo::InPlace { p, m, v }, g, o, part)?;
                }
                (MasterDType::F32, moments) => {
                    step_one(isa, scalars, Reduced { p: bytemuck::cast_slice_mut(pb), moments }, g, o, part)?;
                }
                (MasterDType::Bf16, moments) => {
                    let p = &mut bytemuck::cast_slice_mut(pb)[..r.len()];
                    let st = Bf16Master {
                        p,
                        moments,
                        key: sr_key(unit.0, scalars.step()),
                        offset: state.offset + r.start as u64,
                    };
                    step_one(isa, scalars, st, g, o, part)?;
                }
            }
        }
        buf.set_len(stored_len);
        stats.written_bytes += buf.len() as u64;
        writes.push_back(store.write(unit, buf));
        reading = next;
    }
    while let Some(h) = writes.pop_front() {
        match h.wait() {
            (Ok(e), _) => new.push_extent(e),
            (Err(e), _) => return Err(fail(new, e)),
        }
    }
    Ok((new, stats))
}

/// Checks that `master` is what `state`'s layout takes and `out` can carry the master weights.
fn check_master_in(state: &NvmeState, master: MasterIn<'_>, out: &CopyOut<'_>) -> Result<()> {
    let unit = state.unit;
    let bad = |reason: String| Err(Error::Config { key: "optimizer.master_dtype".into(), reason });
    let mdt = state.cfg.format.master;
    match (state.cfg.master_in_copy, master) {
        (false, MasterIn::Stored) => return Ok(()),
        (false, _) => return bad(format!("unit {unit}: its state stores the master weights, a copy was given")),
        (true, MasterIn::Stored) => {
            return bad(format!("unit {unit}: its master weights live in the compute copy, none was given"))
        }
        (true, MasterIn::Copy(copy)) if copy.len() != mdt.copy_dtype().size_in_bytes() * state.len => {
            let what = format!("unit {unit} master weights in the compute copy (bytes)");
            return Err(Error::LengthMismatch {
                what,
                expected: mdt.copy_dtype().size_in_bytes() * state.len,
                got: copy.len(),
            });
        }
        (true, _) => {}
    }
    if out.dtype() != Some(mdt.copy_dtype()) {
        return bad(format!(
            "unit {unit}: {mdt} master weights kept in the compute copy need a compute copy of that dtype"
        ));
    }
    Ok(())
}

/// Writes master weights `p` into `out` ([`MasterDType::master_bytes`] of them) in `dtype`.
fn write_master(dtype: MasterDType, p: &[f32], out: &mut [u8]) {
    match dtype {
        MasterDType::F32 => out.copy_from_slice(bytemuck::cast_slice(p)),
        MasterDType::Bf16 => {
            let o: &mut [half::bf16] = bytemuck::cast_slice_mut(out);
            o.iter_mut().zip(p).for_each(|(o, &x)| *o = half::bf16::from_f32(x));
        }
    }
}

/// Reads master weights in `dtype` from `bytes` into `p` (widened).
fn read_master(dtype: MasterDType, bytes: &[u8], p: &mut [f32]) {
    match dtype {
        MasterDType::F32 => p.copy_from_slice(bytemuck::cast_slice(bytes)),
        MasterDType::Bf16 => {
            let b: &[half::bf16] = bytemuck::cast_slice(bytes);
            p.iter_mut().zip(b).for_each(|(p, b)| *p = b.to_f32());
        }
    }
}
