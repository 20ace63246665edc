//! Sharded checkpoints: with data-parallel ranks each rank writes its own shard of every unit
//! to its own file, `ckpt-{step:08}.rank-{r}-of-{n}.safetensors` (a [`super::Writer`] file:
//! header first, a crc32c per tensor, temp file, fsync, rename), and no rank gathers the state.
//! Rank 0 then writes the set's index, `ckpt-{step:08}.index.json` ([`ShardIndex`]), once every
//! rank's file is durable: the checkpoint exists (for [`super::list`], `--resume`, `keep`) only
//! with its index.
//!
//! A shard file holds, for each tensor of the checkpoint's layout, the elements of the rank's
//! range as a 1-D tensor of the same name (a tensor the rank holds nothing of is absent); its
//! metadata is the run's (as a single file's) plus `step`, `shard_rank` and `world_size`. The
//! index names the world size, the step, each rank's file, each unit's element range per rank,
//! and per tensor its dtype, whole shape and pieces (rank, element range of the flattened
//! tensor), which tile the tensor. [`ShardedReader`] assembles a whole tensor from its pieces,
//! whatever world size reads it; [`AnyReader`] reads either form.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use super::{io, CheckpointError, NamedTensor, Reader, Result, TensorData};
use crate::checksum::Verification;

/// The index's file name ending: `ckpt-{step:08}.index.json`.
pub const INDEX_SUFFIX: &str = ".index.json";

/// [`ShardIndex::format`] of this version.
pub const FORMAT: &str = "oogc-shards-1";

/// Metadata keys a shard file adds to the run's: its rank and the world size.
const RANK_KEY: &str = "shard_rank";
const WORLD_KEY: &str = "world_size";

/// The index of the sharded checkpoint of `step` in `dir`.
pub fn index_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt-{step:08}{INDEX_SUFFIX}"))
}

/// The file name of rank `rank` of `world`'s shard of the checkpoint of `step`.
pub fn shard_file_name(step: u64, rank: usize, world: usize) -> String {
    format!("ckpt-{step:08}.rank-{rank}-of-{world}.safetensors")
}

/// The step of a shard file's name ([`shard_file_name`]), `None` for any other name.
pub(crate) fn shard_step(name: &str) -> Option<u64> {
    let (step, rest) = name.strip_prefix("ckpt-")?.split_once(".rank-")?;
    let (rank, world) = rest.strip_suffix(".safetensors")?.split_once("-of-")?;
    rank.parse::<usize>().ok()?;
    world.parse::<usize>().ok()?;
    step.parse().ok()
}

/// The run's metadata of a shard file of rank `rank` of `world`: `metadata` plus its rank and
/// the world size (checked against the index when read).
pub fn shard_metadata(metadata: &BTreeMap<String, String>, rank: usize, world: usize) -> BTreeMap<String, String> {
    let mut out = metadata.clone();
    out.insert(RANK_KEY.into(), rank.to_string());
    out.insert(WORLD_KEY.into(), world.to_string());
    out
}

/// A sharded checkpoint's index (module docs), as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// [`FORMAT`].
    pub format: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Ranks that wrote it (`files.len()`).
    pub world_size: usize,
    /// Each rank's shard file, by rank, relative to the index's directory.
    pub files: Vec<String>,
    /// Each unit's elements in each rank's file.
    pub units: Vec<IndexedUnit>,
    /// Every tensor, in the order of the single-file form.
    pub tensors: Vec<IndexedTensor>,
}

/// A unit of a sharded checkpoint: which of its elements each rank's file holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexedUnit {
    /// The unit's name.
    pub name: String,
    /// Elements of its flat vector.
    pub numel: usize,
    /// Per rank, `[start, end)` of the flat vector in its file (empty: none; a unit every rank
    /// holds whole, a device-resident one, is rank 0's alone).
    pub ranges: Vec<[usize; 2]>,
}

/// A tensor of a sharded checkpoint and where its pieces are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexedTensor {
    /// The tensor's name (as in the single-file form).
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its whole shape.
    pub shape: Vec<usize>,
    /// Its pieces, in order: together they tile `[0, numel)` of the flattened tensor.
    pub pieces: Vec<Piece>,
}

/// Elements `[start, end)` of a flattened tensor, stored in rank `rank`'s file as a 1-D tensor
/// of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The rank whose file holds it.
    pub rank: usize,
    /// First element.
    pub start: usize,
    /// One past the last element.
    pub end: usize,
}

impl ShardIndex {
    /// Writes the index into `dir` atomically (temp file, fsync, rename, fsync of the directory);
    /// returns its path and its bytes.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] (the temp file is removed; nothing else is touched).
    pub fn write(&self, dir: &Path) -> Result<(PathBuf, u64)> {
        use std::io::Write as _;
        let path = index_path(dir, self.step);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(self).expect("an index serializes");
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(&text)?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&path)(e));
        }
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))?;
        Ok((path, text.len() as u64))
    }

    /// Reads and checks the index at `path`: its format, a file per rank, a range per rank for
    /// each unit, and pieces tiling each tensor.
    ///
    /// # Errors
    /// [`CheckpointError::Io`]; [`CheckpointError::Corrupt`] naming what is inconsistent.
    pub fn read(path: &Path) -> Result<Self> {
        let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_path_buf(), reason };
        let text = std::fs::read(path).map_err(io(path))?;
        let index: Self = serde_json::from_slice(&text).map_err(|e| corrupt(format!("index: {e}")))?;
        if index.format != FORMAT {
            return Err(corrupt(format!("index format `{}`, this oogc reads `{FORMAT}`", index.format)));
        }
        let n = index.world_size;
        if n == 0 || index.files.len() != n {
            return Err(corrupt(format!("world size {n} with {} shard files", index.files.len())));
        }
        if let Some(u) = index.units.iter().find(|u| u.ranges.len() != n) {
            return Err(corrupt(format!("unit {} has {} ranges for {n} ranks", u.name, u.ranges.len())));
        }
        for t in &index.tensors {
            let numel: usize = t.shape.iter().product();
            let mut next = 0;
            for p in &t.pieces {
                if p.rank >= n || p.start != next || p.end < p.start {
                    return Err(corrupt(format!(
                        "tensor {}: its pieces {:?} do not tile 0..{numel}",
                        t.name, t.pieces
                    )));
                }
                next = p.end;
            }
            if next != numel {
                return Err(corrupt(format!("tensor {}: its pieces {:?} do not tile 0..{numel}", t.name, t.pieces)));
            }
        }
        Ok(index)
    }

    /// What rank `rank`'s file holds, in words: its ranges of the first units.
    fn holds(&self, rank: usize) -> String {
        let held: Vec<_> = self
            .units
            .iter()
            .filter_map(|u| {
                let [a, b] = u.ranges[rank];
                (a < b).then(|| format!("elements {a}..{b} of unit {}", u.name))
            })
            .collect();
        match held.len() {
            0 => "nothing of the units".into(),
            1..=3 => held.join(", "),
            n => format!("{}, and its ranges of {} more units", held[..3].join(", "), n - 3),
        }
    }
}

/// A sharded checkpoint open for reading: its index and every rank's file, checked against each
/// other (module docs).
#[derive(Debug)]
pub struct ShardedReader {
    path: PathBuf,
    index: ShardIndex,
    /// Each tensor's position in the index, by name.
    by_name: HashMap<String, usize>,
    files: Vec<Reader>,
    /// Rank 0's metadata without the shard keys: the run's.
    metadata: BTreeMap<String, String>,
}

impl ShardedReader {
    /// Opens the sharded checkpoint whose index is `path`: reads the index ([`ShardIndex::read`])
    /// and opens every rank's file by its header ([`Reader::open`]), checking that each is of
    /// the index's step, world size and rank and holds each of its pieces with the index's
    /// dtype and length.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] naming the rank and its ranges when a shard file is missing,
    /// naming both steps when a shard is of another step than its index (shards of two
    /// checkpoints mixed), or naming the tensor whose piece is missing or of another size;
    /// [`Reader::open`]'s errors of a shard file.
    pub fn open(path: &Path) -> Result<Self> {
        let index = ShardIndex::read(path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_path_buf(), reason };
        let n = index.world_size;
        let mut files = Vec::with_capacity(n);
        for (rank, name) in index.files.iter().enumerate() {
            let file = dir.join(name);
            if !file.exists() {
                return Err(corrupt(format!(
                    "the shard of rank {rank} of {n} ({}) is missing: it holds {}",
                    file.display(),
                    index.holds(rank)
                )));
            }
            let r = Reader::open(&file)?;
            let step = r.step()?;
            if step != index.step {
                return Err(corrupt(format!(
                    "the shard of rank {rank} of {n} ({}) is of step {step}, its index of step {}: shards of two \
                     checkpoints are mixed",
                    file.display(),
                    index.step
                )));
            }
            let meta = |key: &str| r.metadata().get(key).and_then(|v| v.parse::<usize>().ok());
            if (meta(RANK_KEY), meta(WORLD_KEY)) != (Some(rank), Some(n)) {
                return Err(corrupt(format!(
                    "{} says it is rank {:?} of {:?}, the index lists it as rank {rank} of {n}",
                    file.display(),
                    meta(RANK_KEY),
                    meta(WORLD_KEY)
                )));
            }
            files.push(r);
        }
        for t in &index.tensors {
            for p in t.pieces.iter().filter(|p| p.end > p.start) {
                let len = p.end - p.start;
                match files[p.rank].info(&t.name) {
                    Some((dtype, shape)) if dtype == t.dtype && shape == [len] => {}
                    other => {
                        return Err(corrupt(format!(
                            "tensor {}: rank {}'s shard should hold elements {}..{} ({:?} [{len}]), it holds {:?}",
                            t.name, p.rank, p.start, p.end, t.dtype, other
                        )))
                    }
                }
            }
        }
        let mut metadata = files[0].metadata().clone();
        metadata.remove(RANK_KEY);
        metadata.remove(WORLD_KEY);
        let by_name = index.tensors.iter().enumerate().map(|(k, t)| (t.name.clone(), k)).collect();
        Ok(Self { path: path.to_path_buf(), index, by_name, files, metadata })
    }

    /// The index.
    pub fn index(&self) -> &ShardIndex {
        &self.index
    }

    /// Tensor `name`'s entry of the index.
    fn indexed(&self, name: &str) -> Option<&IndexedTensor> {
        self.by_name.get(name).map(|&k| &self.index.tensors[k])
    }

    /// Each rank's file, by rank.
    pub fn files(&self) -> &[Reader] {
        &self.files
    }

    /// Reads tensor `name` whole (`None` when the checkpoint has no such tensor), its pieces from
    /// the ranks' files, each checked against its crc32c as it is read.
    ///
    /// # Errors
    /// [`Reader::tensor`]'s of a shard file.
    pub fn tensor(&self, name: &str) -> Result<Option<NamedTensor>> {
        let Some(t) = self.indexed(name) else { return Ok(None) };
        let numel = t.shape.iter().product();
        let mut data = match t.dtype {
            Dtype::F32 => TensorData::F32(vec![0.0; numel]),
            Dtype::BF16 => TensorData::BF16(vec![half::bf16::ZERO; numel]),
            Dtype::I8 => TensorData::I8(vec![0; numel]),
            Dtype::U8 => TensorData::U8(vec![0; numel]),
            other => {
                return Err(CheckpointError::Corrupt {
                    path: self.path.clone(),
                    reason: format!("tensor {name} is {other:?}, expected F32, BF16, I8 or U8"),
                })
            }
        };
        for p in t.pieces.iter().filter(|p| p.end > p.start) {
            let piece = self.files[p.rank].tensor(name)?.expect("checked at open");
            let r = p.start..p.end;
            match (&mut data, piece.data) {
                (TensorData::F32(d), TensorData::F32(s)) => d[r].copy_from_slice(&s),
                (TensorData::BF16(d), TensorData::BF16(s)) => d[r].copy_from_slice(&s),
                (TensorData::I8(d), TensorData::I8(s)) => d[r].copy_from_slice(&s),
                (TensorData::U8(d), TensorData::U8(s)) => d[r].copy_from_slice(&s),
                _ => unreachable!("dtypes checked at open"),
            }
        }
        Ok(Some(NamedTensor { name: name.to_string(), shape: t.shape.clone(), data }))
    }

    /// Checks every shard file's tensors against their crc32c ([`Reader::verify`]); the
    /// tensors and bytes of all files.
    ///
    /// # Errors
    /// [`Reader::verify`]'s of the first file that fails (naming it and the tensor).
    pub fn verify(&self) -> Result<Verification> {
        let (mut tensors, mut bytes) = (0, 0);
        for f in &self.files {
            match f.verify()? {
                Verification::Verified { tensors: t, bytes: b } => (tensors, bytes) = (tensors + t, bytes + b),
                Verification::Unverified => return Ok(Verification::Unverified),
            }
        }
        Ok(Verification::Verified { tensors, bytes })
    }
}

/// A checkpoint of either form open for reading: one file ([`Reader`]) or a rank-sharded set
/// ([`ShardedReader`]); the same questions of both.
#[derive(Debug)]
pub enum AnyReader {
    /// `ckpt-{step:08}.safetensors`.
    File(Reader),
    /// `ckpt-{step:08}.index.json` and its shards.
    Sharded(ShardedReader),
}

impl AnyReader {
    /// Opens the checkpoint `path`: a file, an index, or a directory (its newest checkpoint,
    /// [`super::latest`]).
    ///
    /// # Errors
    /// [`Reader::open`]'s or [`ShardedReader::open`]'s.
    pub fn open(path: &Path) -> Result<Self> {
        let path = if path.is_dir() { super::latest(path)? } else { path.to_path_buf() };
        if path.to_string_lossy().ends_with(INDEX_SUFFIX) {
            Ok(Self::Sharded(ShardedReader::open(&path)?))
        } else {
            Ok(Self::File(Reader::open(&path)?))
        }
    }

    /// The file, or the index.
    pub fn path(&self) -> &Path {
        match self {
            Self::File(r) => r.path(),
            Self::Sharded(s) => &s.path,
        }
    }

    /// Optimizer steps the checkpoint holds ([`Reader::step`]).
    ///
    /// # Errors
    /// [`Reader::step`]'s.
    pub fn step(&self) -> Result<u64> {
        match self {
            Self::File(r) => r.step(),
            Self::Sharded(s) => Ok(s.index.step),
        }
    }

    /// The run's string metadata ([`Reader::metadata`]; of a sharded one, rank 0's file's
    /// without its rank and world size).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        match self {
            Self::File(r) => r.metadata(),
            Self::Sharded(s) => &s.metadata,
        }
    }

    /// Whether every file carries checksums.
    pub fn has_checksums(&self) -> bool {
        match self {
            Self::File(r) => r.has_checksums(),
            Self::Sharded(s) => s.files.iter().all(Reader::has_checksums),
        }
    }

    /// Tensor names, in the single-file form's order.
    pub fn names(&self) -> Vec<String> {
        match self {
            Self::File(r) => r.names(),
            Self::Sharded(s) => s.index.tensors.iter().map(|t| t.name.clone()).collect(),
        }
    }

    /// The dtype and whole shape of tensor `name`, if the checkpoint has it.
    pub fn info(&self, name: &str) -> Option<(Dtype, &[usize])> {
        match self {
            Self::File(r) => r.info(name),
            Self::Sharded(s) => s.indexed(name).map(|t| (t.dtype, t.shape.as_slice())),
        }
    }

    /// Bytes of tensor data in the file, or in all shard files.
    pub fn data_bytes(&self) -> u64 {
        match self {
            Self::File(r) => r.data_bytes(),
            Self::Sharded(s) => s.files.iter().map(Reader::data_bytes).sum(),
        }
    }

    /// Tensor `name`, whole ([`Reader::tensor`], [`ShardedReader::tensor`]).
    ///
    /// # Errors
    /// Theirs.
    pub fn tensor(&self, name: &str) -> Result<Option<NamedTensor>> {
        match self {
            Self::File(r) => r.tensor(name),
            Self::Sharded(s) => s.tensor(name),
        }
    }

    /// Checks every tensor's crc32c ([`Reader::verify`], [`ShardedReader::verify`]).
    ///
    /// # Errors
    /// Theirs.
    pub fn verify(&self) -> Result<Verification> {
        match self {
            Self::File(r) => r.verify(),
            Self::Sharded(s) => s.verify(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{list, load, verify, Writer};
    use super::*;
    use crate::checkpoint::TensorSpec;

    const N: usize = 700;
    const CUT: usize = 512;

    fn values(step: u64) -> Vec<f32> {
        (0..N).map(|i| i as f32 * 0.25 + step as f32).collect()
    }

    /// A sharded checkpoint of `step` as 2 ranks write it: tensor `w` (`[7, 100]` f32) cut at
    /// element 512, tensor `c` (`[3]` u8) rank 0's whole; returns the index's path.
    fn write_set(dir: &Path, step: u64) -> PathBuf {
        let w = values(step);
        let metadata = BTreeMap::from([("k".to_string(), "v".to_string())]);
        for (rank, r) in [(0, 0..CUT), (1, CUT..N)] {
            let mut specs = vec![TensorSpec::new("w", Dtype::F32, vec![r.len()])];
            if rank == 0 {
                specs.push(TensorSpec::new("c", Dtype::U8, vec![3]));
            }
            let path = dir.join(shard_file_name(step, rank, 2));
            let mut f = Writer::create_at(dir, path, step, &shard_metadata(&metadata, rank, 2), specs).unwrap();
            f.append(bytemuck::cast_slice(&w[r])).unwrap();
            if rank == 0 {
                f.append(&[1, 2, 3]).unwrap();
            }
            f.complete().unwrap();
        }
        let index = ShardIndex {
            format: FORMAT.into(),
            step,
            world_size: 2,
            files: (0..2).map(|r| shard_file_name(step, r, 2)).collect(),
            units: vec![IndexedUnit { name: "u".into(), numel: N, ranges: vec![[0, CUT], [CUT, N]] }],
            tensors: vec![
                IndexedTensor {
                    name: "w".into(),
                    dtype: Dtype::F32,
                    shape: vec![7, 100],
                    pieces: vec![Piece { rank: 0, start: 0, end: CUT }, Piece { rank: 1, start: CUT, end: N }],
                },
                IndexedTensor {
                    name: "c".into(),
                    dtype: Dtype::U8,
                    shape: vec![3],
                    pieces: vec![Piece { rank: 0, start: 0, end: 3 }],
                },
            ],
        };
        index.write(dir).unwrap().0
    }

    /// A set reads as the single file of the same tensors: each whole, in the index's order,
    /// with the run's metadata; it lists, verifies and loads as one checkpoint.
    #[test]
    fn a_set_reads_as_its_whole_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let index = write_set(dir.path(), 4);
        assert_eq!(list(dir.path()).unwrap(), vec![(4, index.clone())], "the index is the checkpoint");
        let r = AnyReader::open(dir.path()).unwrap();
        assert_eq!((r.path(), r.step().unwrap()), (index.as_path(), 4));
        assert_eq!(r.metadata(), &BTreeMap::from([("k".to_string(), "v".to_string())]));
        assert_eq!(r.names(), ["w", "c"]);
        assert_eq!(r.info("w"), Some((Dtype::F32, &[7usize, 100][..])));
        let w = r.tensor("w").unwrap().unwrap();
        assert_eq!((w.shape.as_slice(), w.data), (&[7usize, 100][..], TensorData::F32(values(4))));
        assert_eq!(r.tensor("c").unwrap().unwrap().data, TensorData::U8(vec![1, 2, 3]));
        assert_eq!(verify(&index).unwrap(), Verification::Verified { tensors: 3, bytes: 4 * N as u64 + 3 });
        assert_eq!(load(dir.path()).unwrap().tensor("w").unwrap().data, TensorData::F32(values(4)));
    }

    /// A missing shard file is refused naming its rank and the range it holds.
    #[test]
    fn a_missing_shard_is_named_by_rank_and_range() {
        let dir = tempfile::tempdir().unwrap();
        let index = write_set(dir.path(), 4);
        std::fs::remove_file(dir.path().join(shard_file_name(4, 1, 2))).unwrap();
        let err = AnyReader::open(&index).unwrap_err().to_string();
        for needle in ["rank 1 of 2", "is missing", "elements 512..700 of unit u", "ckpt-00000004.index.json"] {
            assert!(err.contains(needle), "`{needle}` not in: {err}");
        }
        assert!(verify(&index).is_err());
    }

    /// A shard of another step in a set's place (shards of two checkpoints mixed) is refused,
    /// naming both steps; so is an index whose pieces leave a gap.
    #[test]
    fn shards_of_two_steps_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let index = write_set(dir.path(), 4);
        let other = tempfile::tempdir().unwrap();
        write_set(other.path(), 6);
        std::fs::copy(other.path().join(shard_file_name(6, 1, 2)), dir.path().join(shard_file_name(4, 1, 2))).unwrap();
        let err = AnyReader::open(&index).unwrap_err().to_string();
        for needle in ["rank 1 of 2", "of step 6, its index of step 4", "mixed"] {
            assert!(err.contains(needle), "`{needle}` not in: {err}");
        }
        let mut gap = ShardIndex::read(&other.path().join("ckpt-00000006.index.json")).unwrap();
        gap.tensors[0].pieces[1].start += 1;
        gap.write(other.path()).unwrap();
        let err = ShardIndex::read(&index_path(other.path(), 6)).unwrap_err().to_string();
        assert!(err.contains("tensor w: its pieces") && err.contains("do not tile 0..700"), "{err}");
    }

    /// A flipped byte in a shard fails verification naming the shard file and the tensor, and
    /// the reading of that tensor; the other tensors still read.
    #[test]
    fn a_corrupt_shard_fails_its_crc32c() {
        let dir = tempfile::tempdir().unwrap();
        let older = write_set(dir.path(), 2);
        let index = write_set(dir.path(), 4);
        let shard = dir.path().join(shard_file_name(4, 1, 2));
        let mut bytes = std::fs::read(&shard).unwrap();
        let last = bytes.len() - 5;
        bytes[last] ^= 0x40;
        std::fs::write(&shard, bytes).unwrap();
        let err = verify(&index).unwrap_err().to_string();
        for needle in ["ckpt-00000004.rank-1-of-2.safetensors", "tensor w", "ckpt-00000002.index.json"] {
            assert!(err.contains(needle), "`{needle}` not in: {err}");
        }
        let r = AnyReader::open(&index).unwrap();
        assert!(r.tensor("w").unwrap_err().to_string().contains("tensor w"));
        assert_eq!(r.tensor("c").unwrap().unwrap().data, TensorData::U8(vec![1, 2, 3]));
        // --fallback's choice: the older set.
        assert_eq!(super::super::newest_verified(dir.path()).unwrap().0, older);
    }

    /// Pruning removes whole sets: the index, then its shards; shards without an index go too.
    #[test]
    fn keep_prunes_whole_sets() {
        let dir = tempfile::tempdir().unwrap();
        for step in [1, 2, 3] {
            write_set(dir.path(), step);
        }
        // A failed save's shard: no index.
        std::fs::copy(dir.path().join(shard_file_name(3, 0, 2)), dir.path().join(shard_file_name(9, 0, 2))).unwrap();
        super::super::prune(dir.path(), 2).unwrap();
        let mut names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        let mut want: Vec<String> = [2, 3]
            .into_iter()
            .flat_map(|s| {
                [index_path(Path::new(""), s).display().to_string(), shard_file_name(s, 0, 2), shard_file_name(s, 1, 2)]
            })
            .collect();
        want.sort();
        assert_eq!(names, want);
        assert_eq!(shard_step("ckpt-00000012.rank-3-of-4.safetensors"), Some(12));
        assert_eq!(shard_step("ckpt-00000012.safetensors"), None);
    }
}
