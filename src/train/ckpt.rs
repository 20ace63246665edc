//! The trainer's checkpoints, streamed one unit at a time (saves and loads hold one unit's
//! state, claimed from the host ledger as [`HostUse::Checkpoint`], never the model's).
//!
//! A unit's tensors, in file order: for each parameter its master weights (`{name}`: f32, or
//! bf16 with `[optimizer] master_dtype = "bf16"` when the unit's optimizer is on the host — a
//! device-resident unit's are f32), `{name}.exp_avg` and `{name}.exp_avg_sq` in the moments'
//! stored dtype (f32, bf16, or int8 codes: I8 for `m`'s linear map, U8 for `v`'s tree map; a
//! device-resident unit's too, the device optimizer keeping the same format), then for int8 the unit's block absmaxes
//! (`{unit}.exp_avg.absmax`, `{unit}.exp_avg_sq.absmax`, f32 `[blocks]`: blocks of 256 run over
//! the unit's flat vector, across its parameters).
//!
//! With ranks each rank writes its own shard ([`crate::checkpoint::shards`]): the same tensors
//! restricted to the elements of the unit its optimizer holds ([`UnitLayout::shard_tensors`]),
//! read without a collective ([`save_shard`]); a unit every rank holds whole (its optimizer on
//! the device) is written by rank 0 alone.

use std::ops::Range;

use oogc_models::UnitSpec;
use oogc_optimizer::{MasterDType, MomentBufs, StateDType, UnitState};
use oogc_swapper::{HostClaim, HostUse};
use safetensors::Dtype;

use crate::checkpoint::shards::{IndexedTensor, IndexedUnit, Piece};
use crate::checkpoint::{AnyReader, CheckpointError, TensorData as D, TensorSpec, Writer};
use crate::dist::World;
use crate::runtime::{OptimizerPlace, Runtime, RuntimeError, UnitId};
use crate::train::{Result as TrainResult, TrainError};

/// Elements converted to bf16 at a time when a bf16 master is written.
const CONVERT_CHUNK: usize = 1 << 15;

/// How one unit's state is stored in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct UnitLayout {
    /// Master weights as bf16 (else f32).
    master_bf16: bool,
    /// The moments' dtype.
    moments: StateDType,
    /// Every rank holds the unit whole (its optimizer is on the device).
    whole: bool,
}

impl UnitLayout {
    /// The layout of a unit whose optimizer is at `place`, in a run of `[optimizer]
    /// state_dtype` and `master_dtype`.
    pub(super) fn new(place: OptimizerPlace, state: StateDType, master: MasterDType) -> Self {
        match place {
            OptimizerPlace::Device => Self { master_bf16: false, moments: state, whole: true },
            OptimizerPlace::Host => Self { master_bf16: master == MasterDType::Bf16, moments: state, whole: false },
        }
    }

    /// The elements of a unit of `numel` that rank `rank` of `ranks` writes in a sharded
    /// checkpoint: its optimizer's [`crate::dist::shard_range`], or for a unit every rank holds
    /// whole, all of them on rank 0 and none on the others.
    pub(super) fn written_range(self, numel: usize, rank: usize, ranks: usize) -> Range<usize> {
        match (self.whole, rank) {
            (true, 0) => 0..numel,
            (true, _) => numel..numel,
            (false, _) => crate::dist::shard_range(numel, rank, ranks),
        }
    }

    /// The unit's tensors ([`UnitLayout::tensors`]) restricted to elements `range` of its flat
    /// vector (`range.start` a multiple of [`crate::dist::SHARD_ALIGN`], or `range` empty): per
    /// tensor the range meets, in file order, a 1-D tensor of the same name holding its
    /// elements there, and which elements of the whole flattened tensor they are (int8 absmaxes:
    /// the range's blocks).
    pub(super) fn shard_tensors(self, spec: &UnitSpec, range: Range<usize>) -> Vec<(TensorSpec, Range<usize>)> {
        let mut whole = self.tensors(spec).into_iter();
        let mut out = Vec::new();
        let mut piece = |t: TensorSpec, r: Range<usize>| {
            if !r.is_empty() {
                out.push((TensorSpec::new(t.name, t.dtype, vec![r.len()]), r));
            }
        };
        for p in &spec.params {
            let (a, b) = (range.start.max(p.offset), range.end.min(p.offset + p.numel()));
            let within = if a < b { a - p.offset..b - p.offset } else { 0..0 };
            for t in whole.by_ref().take(3) {
                piece(t, within.clone());
            }
        }
        let q = oogc_optimizer::QUANT_BLOCK;
        let blocks = if range.is_empty() { 0..0 } else { range.start / q..range.end.div_ceil(q) };
        for t in whole {
            piece(t, blocks.clone());
        }
        out
    }

    /// The index's entries of the unit ([`crate::checkpoint::ShardIndex`]) when each rank `r`
    /// of `ranks` writes elements [`UnitLayout::written_range`].
    pub(super) fn index_entries(self, spec: &UnitSpec, ranks: usize) -> (IndexedUnit, Vec<IndexedTensor>) {
        let ranges: Vec<_> = (0..ranks).map(|r| self.written_range(spec.numel, r, ranks)).collect();
        let mut tensors: Vec<IndexedTensor> = self
            .tensors(spec)
            .into_iter()
            .map(|t| IndexedTensor { name: t.name, dtype: t.dtype, shape: t.shape, pieces: Vec::new() })
            .collect();
        for (rank, r) in ranges.iter().enumerate() {
            for (t, within) in self.shard_tensors(spec, r.clone()) {
                let entry = tensors.iter_mut().find(|e| e.name == t.name).expect("a tensor of the layout");
                entry.pieces.push(Piece { rank, start: within.start, end: within.end });
            }
        }
        let unit = IndexedUnit {
            name: spec.name.clone(),
            numel: spec.numel,
            ranges: ranges.iter().map(|r| [r.start, r.end]).collect(),
        };
        (unit, tensors)
    }

    /// The unit's tensors, in file order (module docs).
    pub(super) fn tensors(self, spec: &UnitSpec) -> Vec<TensorSpec> {
        let (m, v) = match self.moments {
            StateDType::F32 => (Dtype::F32, Dtype::F32),
            StateDType::Bf16 => (Dtype::BF16, Dtype::BF16),
            StateDType::Int8 => (Dtype::I8, Dtype::U8),
        };
        let w = if self.master_bf16 { Dtype::BF16 } else { Dtype::F32 };
        let mut out = Vec::with_capacity(3 * spec.params.len() + 2);
        for p in &spec.params {
            out.push(TensorSpec::new(p.name.clone(), w, p.shape.clone()));
            out.push(TensorSpec::new(format!("{}.exp_avg", p.name), m, p.shape.clone()));
            out.push(TensorSpec::new(format!("{}.exp_avg_sq", p.name), v, p.shape.clone()));
        }
        if self.moments == StateDType::Int8 {
            let blocks = vec![spec.numel.div_ceil(oogc_optimizer::QUANT_BLOCK)];
            out.push(TensorSpec::new(format!("{}.exp_avg.absmax", spec.name), Dtype::F32, blocks.clone()));
            out.push(TensorSpec::new(format!("{}.exp_avg_sq.absmax", spec.name), Dtype::F32, blocks));
        }
        out
    }

    /// Whether the unit's optimizer is on the device (every rank holds it whole).
    pub(super) fn is_device(self) -> bool {
        self.whole
    }

    /// Host bytes of `elements` of the unit's state while a save holds them (f32 master weights
    /// and the moments in their dtype) and the writer's buffer
    /// ([`crate::runtime::budget::checkpoint_staging_bytes`]).
    pub(super) fn staging_bytes(self, elements: usize) -> u64 {
        Self::staging_bytes_of(elements, self.moments)
    }

    /// [`UnitLayout::staging_bytes`] of `elements` with moments of `moments`.
    pub(super) fn staging_bytes_of(elements: usize, moments: StateDType) -> u64 {
        crate::runtime::budget::checkpoint_staging_bytes(elements, elements, moments)
    }
}

/// Claims the staging of one unit's state while a resume reads it whole (with ranks beside this
/// rank's shard of it) from the runtime's host ledger.
fn claim(rt: &Runtime, world: World, layout: UnitLayout, numel: usize) -> Result<HostClaim, RuntimeError> {
    let shard = crate::dist::shard_range(numel, world.rank, world.size).len();
    let bytes = crate::runtime::budget::checkpoint_staging_bytes(numel, shard, layout.moments);
    rt.memory().host_ledger().claim(HostUse::Checkpoint, bytes).map_err(RuntimeError::from)
}

/// Appends one unit's tensors (the layout's, in its order) to `w`, restricted to elements
/// `range` of the unit ([`UnitLayout::shard_tensors`]; `0..numel`: the whole tensors), `state`
/// holding those elements.
pub(super) fn write_unit(
    w: &mut Writer,
    spec: &UnitSpec,
    layout: UnitLayout,
    state: &UnitState,
    range: Range<usize>,
) -> Result<(), CheckpointError> {
    let wrong = |what: &str| CheckpointError::Corrupt {
        path: std::path::PathBuf::from(&spec.name),
        reason: format!("unit {}: its state is {what}, the checkpoint's layout {layout:?}", spec.name),
    };
    if state.moments.dtype() != layout.moments {
        return Err(wrong(&format!("{} moments", state.moments.dtype())));
    }
    let mut bf16 = Vec::with_capacity(if layout.master_bf16 { CONVERT_CHUNK } else { 0 });
    for p in &spec.params {
        let (a, b) = (range.start.max(p.offset), range.end.min(p.offset + p.numel()));
        if a >= b {
            continue;
        }
        let r = a - range.start..b - range.start;
        let master = &state.master[r.clone()];
        if layout.master_bf16 {
            for chunk in master.chunks(CONVERT_CHUNK) {
                bf16.clear();
                bf16.extend(chunk.iter().map(|&x| half::bf16::from_f32(x)));
                if bf16.iter().zip(chunk).any(|(b, &x)| b.to_f32() != x) {
                    return Err(wrong("a master weight that bf16 cannot hold"));
                }
                w.append(bytemuck::cast_slice(&bf16))?;
            }
        } else {
            w.append(bytemuck::cast_slice(master))?;
        }
        match &state.moments {
            MomentBufs::F32 { m, v } => {
                w.append(bytemuck::cast_slice(&m[r.clone()]))?;
                w.append(bytemuck::cast_slice(&v[r]))?;
            }
            MomentBufs::Bf16 { m, v } => {
                w.append(bytemuck::cast_slice(&m[r.clone()]))?;
                w.append(bytemuck::cast_slice(&v[r]))?;
            }
            MomentBufs::Int8 { m, v, .. } => {
                w.append(bytemuck::cast_slice(&m[r.clone()]))?;
                w.append(&v[r])?;
            }
        }
    }
    if let (MomentBufs::Int8 { m_absmax, v_absmax, .. }, false) = (&state.moments, range.is_empty()) {
        w.append(bytemuck::cast_slice(m_absmax))?;
        w.append(bytemuck::cast_slice(v_absmax))?;
    }
    Ok(())
}

/// Restores unit `id`'s state from `r` within a claim of its staging: the moments' dtype is the
/// file's (f32, bf16 or int8; converted by [`Runtime::load_unit_state`] when it is not the
/// run's).
///
/// # Errors
/// [`TrainError::Mismatch`] naming a missing tensor or one of another size or dtype; the
/// file's [`CheckpointError`] (a tensor failing its crc32c, I/O); runtime failures.
pub(super) fn load_unit(
    rt: &mut Runtime,
    world: World,
    id: UnitId,
    spec: &UnitSpec,
    layout: UnitLayout,
    r: &AnyReader,
) -> TrainResult<()> {
    let _claim = claim(rt, world, layout, spec.numel)?;
    let state = unit_state_from(r, spec)?;
    rt.load_unit_state(id, state)?;
    Ok(())
}

/// One unit's state from a checkpoint's tensors (the module's layout): the moments' dtype is
/// the tensors' (f32, bf16 or int8).
fn unit_state_from(r: &AnyReader, spec: &UnitSpec) -> TrainResult<UnitState> {
    let mismatch = |reason: String| TrainError::Mismatch {
        path: r.path().to_path_buf(),
        reason: format!("cannot resume: {reason}\n  fix: resume with the config the checkpoint was written with"),
    };
    let get = |name: &str, numel: usize| -> TrainResult<D> {
        let t = r.tensor(name)?.ok_or_else(|| mismatch(format!("tensor {name} is missing")))?;
        if t.data.len() != numel {
            return Err(mismatch(format!("{name} has {} values, expected {numel}", t.data.len())));
        }
        Ok(t.data)
    };
    // The moments' dtype is the first parameter's exp_avg's (read from the header).
    let first = spec.params.first().map(|p| format!("{}.exp_avg", p.name));
    let dtype = match first.as_deref().map(|n| (n, r.info(n))) {
        None => StateDType::F32,
        Some((_, Some((Dtype::F32, _)))) => StateDType::F32,
        Some((_, Some((Dtype::BF16, _)))) => StateDType::Bf16,
        Some((_, Some((Dtype::I8, _)))) => StateDType::Int8,
        Some((n, Some((other, _)))) => return Err(mismatch(format!("{n} is {other:?}, expected F32, BF16 or I8"))),
        Some((n, None)) => return Err(mismatch(format!("tensor {n} is missing"))),
    };
    let mut master = vec![0f32; spec.numel];
    let mut moments = MomentBufs::zeros(dtype, spec.numel);
    for p in &spec.params {
        let r = p.offset..p.offset + p.numel();
        let w = get(&p.name, p.numel())?;
        let values = w.into_f32().map_err(|d| mismatch(format!("{} is {d:?}, expected F32 or BF16", p.name)))?;
        master[r.clone()].copy_from_slice(&values);
        let (mn, vn) = (format!("{}.exp_avg", p.name), format!("{}.exp_avg_sq", p.name));
        let (md, vd) = (get(&mn, p.numel())?, get(&vn, p.numel())?);
        match (&mut moments, md, vd) {
            (MomentBufs::F32 { m, v }, D::F32(a), D::F32(b)) => {
                m[r.clone()].copy_from_slice(&a);
                v[r].copy_from_slice(&b);
            }
            (MomentBufs::Bf16 { m, v }, D::BF16(a), D::BF16(b)) => {
                m[r.clone()].copy_from_slice(&a);
                v[r].copy_from_slice(&b);
            }
            (MomentBufs::Int8 { m, v, .. }, D::I8(a), D::U8(b)) => {
                m[r.clone()].copy_from_slice(&a);
                v[r].copy_from_slice(&b);
            }
            (_, a, b) => {
                return Err(mismatch(format!(
                    "{mn} is {:?} and {vn} is {:?}: the unit's first exp_avg says its moments are {dtype}",
                    a.dtype(),
                    b.dtype()
                )))
            }
        }
    }
    if let MomentBufs::Int8 { m_absmax, v_absmax, .. } = &mut moments {
        for (name, out) in [("exp_avg", m_absmax), ("exp_avg_sq", v_absmax)] {
            let name = format!("{}.{name}.absmax", spec.name);
            let d = get(&name, out.len())?;
            let values = d.as_f32().ok_or_else(|| mismatch(format!("{name} is {:?}, expected F32", d.dtype())))?;
            out.copy_from_slice(values);
        }
    }
    Ok(UnitState { master, moments })
}

#[cfg(test)]
mod tests {
    use oogc_models::{ParamInit, ParamSpec, UnitKind};
    use oogc_optimizer::QUANT_BLOCK;

    use super::*;

    /// A unit of three parameters (the middle one crossing rank boundaries).
    fn unit() -> UnitSpec {
        let shapes = [vec![100], vec![7, 130], vec![3, 33]];
        let mut offset = 0;
        let params = shapes
            .iter()
            .enumerate()
            .map(|(k, shape)| {
                let p = ParamSpec { name: format!("u.p{k}"), shape: shape.clone(), offset, init: ParamInit::Zeros };
                offset += shape.iter().product::<usize>();
                p
            })
            .collect();
        UnitSpec { index: 1, kind: UnitKind::Block(0), name: "u".into(), params, numel: offset }
    }

    /// Every tensor of the layout is tiled by the ranks' pieces, in rank order, each piece the
    /// 1-D tensor a rank's file holds; int8 absmaxes by the ranks' blocks; a unit every rank
    /// holds whole is rank 0's alone.
    #[test]
    fn the_ranks_pieces_tile_every_tensor() {
        let spec = unit();
        for (place, whole) in [(OptimizerPlace::Host, false), (OptimizerPlace::Device, true)] {
            for state in [StateDType::F32, StateDType::Int8] {
                let layout = UnitLayout::new(place, state, MasterDType::F32);
                for ranks in [1, 2, 3, 5] {
                    let (u, tensors) = layout.index_entries(&spec, ranks);
                    assert_eq!(tensors.len(), layout.tensors(&spec).len());
                    for (r, range) in u.ranges.iter().enumerate() {
                        let want = if whole {
                            if r == 0 {
                                [0, spec.numel]
                            } else {
                                [spec.numel, spec.numel]
                            }
                        } else {
                            let s = crate::dist::shard_range(spec.numel, r, ranks);
                            [s.start, s.end]
                        };
                        assert_eq!(*range, want, "{state}, rank {r} of {ranks}");
                    }
                    for t in &tensors {
                        let numel: usize = t.shape.iter().product();
                        let mut next = 0;
                        for p in &t.pieces {
                            assert!(p.start == next && p.end > p.start, "{}: {:?}", t.name, t.pieces);
                            assert!(!whole || p.rank == 0, "{}: a whole unit's piece on rank {}", t.name, p.rank);
                            next = p.end;
                        }
                        assert_eq!(next, numel, "{}: {:?}", t.name, t.pieces);
                        if t.name.ends_with(".absmax") {
                            assert_eq!(numel, spec.numel.div_ceil(QUANT_BLOCK));
                        }
                    }
                }
            }
        }
    }
}
