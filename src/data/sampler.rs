//! Token access and batches: one side of a split ([`Split`]: ids and the bytes of text each
//! covers), the seeded sampler of training windows ([`Sampler`], its state checkpointed), a rank's
//! shard of a global batch ([`Shard`]) and the fixed validation batches.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{cache, TextData};

/// A batch: `inputs` and `targets` are `[batch, seq_len]` row-major token ids; `targets` is
/// `inputs` shifted by one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Sequences.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// `batch_size × seq_len` input tokens.
    pub inputs: Vec<u32>,
    /// `batch_size × seq_len` next tokens.
    pub targets: Vec<u32>,
    /// Bytes of text the targets cover (`batch_size × seq_len` for byte-level text): the
    /// denominator of bits per byte.
    pub target_bytes: u64,
}

/// One side of a train/validation split: token ids and the bytes of text each covers. Cheap to
/// copy (it borrows the text or the mapped token file).
#[derive(Debug, Clone, Copy)]
pub struct Split<'a> {
    ids: Ids<'a>,
    lens: Lens<'a>,
}

#[derive(Debug, Clone, Copy)]
enum Ids<'a> {
    /// Bytes are tokens.
    Bytes(&'a [u8]),
    /// Little-endian ids of `width` bytes.
    Le { bytes: &'a [u8], width: usize },
}

#[derive(Debug, Clone, Copy)]
enum Lens<'a> {
    /// One byte per token.
    One,
    /// A length byte per token ([`cache`] format); `first` is the index of `lens[0]` in the file,
    /// `overflow` the file's table of (index, bytes) pairs.
    Table { lens: &'a [u8], first: u64, overflow: &'a [u8] },
}

impl<'a> Split<'a> {
    /// Byte-level text: each byte a token covering itself.
    pub fn bytes(text: &'a [u8]) -> Self {
        Self { ids: Ids::Bytes(text), lens: Lens::One }
    }

    pub(super) fn tokens(ids: &'a [u8], width: usize, lens: &'a [u8], first: u64, overflow: &'a [u8]) -> Self {
        Self { ids: Ids::Le { bytes: ids, width }, lens: Lens::Table { lens, first, overflow } }
    }

    /// Tokens.
    pub fn len(&self) -> usize {
        match self.ids {
            Ids::Bytes(b) => b.len(),
            Ids::Le { bytes, width } => bytes.len() / width,
        }
    }

    /// Whether there is no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens `range` of this split.
    ///
    /// # Panics
    /// If `range` is out of bounds.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        let ids = match self.ids {
            Ids::Bytes(b) => Ids::Bytes(&b[range.clone()]),
            Ids::Le { bytes, width } => Ids::Le { bytes: &bytes[range.start * width..range.end * width], width },
        };
        let lens = match self.lens {
            Lens::One => Lens::One,
            Lens::Table { lens, first, overflow } => {
                Lens::Table { lens: &lens[range.clone()], first: first + range.start as u64, overflow }
            }
        };
        Self { ids, lens }
    }

    /// Token `i`.
    ///
    /// # Panics
    /// If `i >= len()`.
    pub fn id(&self, i: usize) -> u32 {
        match self.ids {
            Ids::Bytes(b) => b[i] as u32,
            Ids::Le { bytes, width: 2 } => u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32,
            Ids::Le { bytes, .. } => u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        }
    }

    /// Appends tokens `range` to `out`.
    ///
    /// # Panics
    /// If `range` is out of bounds.
    pub fn extend_ids(&self, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        match self.ids {
            Ids::Bytes(b) => out.extend(b[range].iter().map(|&x| x as u32)),
            Ids::Le { bytes, width: 2 } => out.extend(
                bytes[range.start * 2..range.end * 2].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            Ids::Le { bytes, .. } => out.extend(
                bytes[range.start * 4..range.end * 4]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))),
            ),
        }
    }

    /// Bytes of text tokens `range` cover ([`tokens`](super::tokens) module docs: how a token's bytes are
    /// counted).
    ///
    /// # Panics
    /// If `range` is out of bounds.
    pub fn covered_bytes(&self, range: std::ops::Range<usize>) -> u64 {
        match self.lens {
            Lens::One => {
                assert!(range.end <= self.len(), "range {range:?} beyond {} tokens", self.len());
                range.len() as u64
            }
            Lens::Table { lens, first, overflow } => lens[range.clone()]
                .iter()
                .enumerate()
                .map(|(k, &l)| {
                    if l == cache::LEN_OVERFLOW {
                        overflow_bytes(overflow, first + (range.start + k) as u64)
                    } else {
                        l as u64
                    }
                })
                .sum(),
        }
    }

    /// Bytes of text the whole split covers.
    pub fn text_bytes(&self) -> u64 {
        self.covered_bytes(0..self.len())
    }

    /// Entropy of the tokens' frequencies (unigram model), in nats per token; ids ≥ `vocab_size`
    /// are not expected.
    pub fn unigram_entropy_nats(&self, vocab_size: usize) -> f64 {
        let mut counts = vec![0u64; vocab_size.max(256)];
        let mut ids = Vec::with_capacity(1 << 16);
        let mut start = 0;
        while start < self.len() {
            let end = (start + (1 << 16)).min(self.len());
            ids.clear();
            self.extend_ids(start..end, &mut ids);
            for &id in &ids {
                counts[id as usize] += 1;
            }
            start = end;
        }
        let n = self.len() as f64;
        counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
    }

    /// A batch of the windows of `seq_len + 1` tokens that begin at `starts`.
    ///
    /// # Panics
    /// If a window reaches past the end.
    pub fn batch_at(&self, starts: &[usize], seq_len: usize) -> Batch {
        let mut inputs = Vec::with_capacity(starts.len() * seq_len);
        let mut targets = Vec::with_capacity(starts.len() * seq_len);
        let mut target_bytes = 0;
        for &start in starts {
            self.extend_ids(start..start + seq_len, &mut inputs);
            self.extend_ids(start + 1..start + seq_len + 1, &mut targets);
            target_bytes += self.covered_bytes(start + 1..start + seq_len + 1);
        }
        Batch { batch_size: starts.len(), seq_len, inputs, targets, target_bytes }
    }

    /// Fixed validation batches: evenly spaced windows, the same every evaluation so the losses
    /// are comparable across steps.
    pub fn validation_batches(&self, batches: usize, batch_size: usize, seq_len: usize) -> Vec<Batch> {
        self.validation_batches_shard(batches, batch_size, seq_len, Shard::WHOLE)
    }

    /// Shard `shard.rank` of the validation batches of a data-parallel run: the batches of
    /// `batch_size × shard.ranks` windows one process would evaluate
    /// ([`Split::validation_batches`]), each cut into `shard.ranks` pieces of `batch_size`
    /// windows, of which the rank takes piece `shard.rank`.
    pub fn validation_batches_shard(
        &self,
        batches: usize,
        batch_size: usize,
        seq_len: usize,
        shard: Shard,
    ) -> Vec<Batch> {
        let (rank, world_size) = (shard.rank, shard.ranks);
        let global = batch_size * world_size;
        let windows = batches * global;
        let span = self.len() - seq_len;
        (0..batches)
            .map(|b| {
                let starts: Vec<usize> = (rank * batch_size..(rank + 1) * batch_size)
                    .map(|i| ((b * global + i) * span) / windows.max(1))
                    .collect();
                self.batch_at(&starts, seq_len)
            })
            .collect()
    }
}

/// Bytes of token `index` in a token file's overflow table (sorted by index).
fn overflow_bytes(table: &[u8], index: u64) -> u64 {
    let entry = |k: usize| {
        let e = &table[16 * k..16 * k + 16];
        (u64::from_le_bytes(e[..8].try_into().expect("8")), u64::from_le_bytes(e[8..].try_into().expect("8")))
    };
    let (mut lo, mut hi) = (0, table.len() / 16);
    while lo < hi {
        let mid = (lo + hi) / 2;
        match entry(mid).0.cmp(&index) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return entry(mid).1,
        }
    }
    panic!("token {index} has no entry in the token file's overflow table (the file passed its checksum)")
}

/// Which slice of a global batch a data-parallel rank takes: shard `rank` of `ranks` equal ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0..ranks`.
    pub rank: usize,
    /// The world size.
    pub ranks: usize,
}

impl Shard {
    /// The whole batch (a world of one).
    pub const WHOLE: Shard = Shard { rank: 0, ranks: 1 };
}

/// Samples random windows of a split with a ChaCha8 generator; its state is serializable so a
/// checkpoint records the data position exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Sampler {
    pub(super) rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler seeded from `seed` (the same seed gives the same batches).
    pub fn new(seed: u64) -> Self {
        Self { rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// The next batch of `batch_size` windows of `seq_len + 1` bytes of `text`.
    ///
    /// # Panics
    /// If `text.len() < seq_len + 1` ([`TextData`] guarantees it is not).
    pub fn next_batch(&mut self, text: &[u8], batch_size: usize, seq_len: usize) -> Batch {
        self.sample(&Split::bytes(text), batch_size, seq_len)
    }

    /// The next batch of `batch_size` windows of `seq_len + 1` tokens of `split` (for bytes, the
    /// same batches as [`Sampler::next_batch`]).
    ///
    /// # Panics
    /// If `split.len() < seq_len + 1` ([`TextData`] and [`TokenData`](super::TokenData) guarantee it is not).
    pub fn sample(&mut self, split: &Split<'_>, batch_size: usize, seq_len: usize) -> Batch {
        self.sample_shard(split, batch_size, seq_len, Shard::WHOLE)
    }

    /// Shard `shard.rank` of the next global batch of a data-parallel run: `batch_size ×
    /// shard.ranks` windows drawn as [`Sampler::sample`] draws them (so every rank's sampler
    /// stays in the same state, and a checkpoint's sampler is the run's), of which the rank takes
    /// windows `rank × batch_size .. (rank + 1) × batch_size`. With [`Shard::WHOLE`], the batch
    /// [`Sampler::sample`] gives; the ranks' shards together are the batch of `batch_size ×
    /// shard.ranks` that one process would draw.
    ///
    /// # Panics
    /// If `split.len() < seq_len + 1`, or `shard.rank >= shard.ranks`.
    pub fn sample_shard(&mut self, split: &Split<'_>, batch_size: usize, seq_len: usize, shard: Shard) -> Batch {
        let (rank, world_size) = (shard.rank, shard.ranks);
        assert!(split.len() > seq_len, "text of {} tokens is shorter than seq_len + 1", split.len());
        assert!(rank < world_size, "rank {rank} of a world of {world_size}");
        let starts: Vec<usize> =
            (0..batch_size * world_size).map(|_| self.rng.random_range(0..split.len() - seq_len)).collect();
        split.batch_at(&starts[rank * batch_size..(rank + 1) * batch_size], seq_len)
    }
}

/// Fixed validation batches: evenly spaced windows of the validation text, the same every
/// evaluation so the losses are comparable across steps.
pub fn validation_batches(data: &TextData, batches: usize, batch_size: usize, seq_len: usize) -> Vec<Batch> {
    Split::bytes(data.val()).validation_batches(batches, batch_size, seq_len)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn split_batches_and_resume_position() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let data = TextData::from_bytes(Path::new("t"), text, 0.1, 8).unwrap();
        assert_eq!(data.train().len(), 900);
        assert_eq!(data.val().len(), 100);
        let mut s = Sampler::new(7);
        let b = s.next_batch(data.train(), 3, 8);
        assert_eq!(b.inputs.len(), 24);
        for r in 0..3 {
            assert_eq!(&b.inputs[r * 8 + 1..r * 8 + 8], &b.targets[r * 8..r * 8 + 7]);
        }
        // Saving the sampler and restoring it continues the same sequence.
        let saved = serde_json::to_string(&s).unwrap();
        let next = s.next_batch(data.train(), 3, 8);
        let mut restored: Sampler = serde_json::from_str(&saved).unwrap();
        assert_eq!(restored.next_batch(data.train(), 3, 8), next);
        let v = validation_batches(&data, 2, 3, 8);
        assert_eq!(v.len(), 2);
        assert!(v.iter().all(|b| b.targets.len() == 24));
    }

    #[test]
    fn the_ranks_shards_together_are_the_global_batch_and_the_sampler_moves_the_same() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i * 13 % 251) as u8).collect();
        let data = TextData::from_bytes(Path::new("t"), text, 0.1, 8).unwrap();
        let split = Split::bytes(data.train());
        let mut one = Sampler::new(3);
        let whole = one.sample(&split, 6, 8);
        let shards: Vec<(Batch, Sampler)> = (0..3)
            .map(|rank| {
                let mut s = Sampler::new(3);
                (s.sample_shard(&split, 2, 8, Shard { rank, ranks: 3 }), s)
            })
            .collect();
        let inputs: Vec<u32> = shards.iter().flat_map(|(b, _)| b.inputs.clone()).collect();
        let targets: Vec<u32> = shards.iter().flat_map(|(b, _)| b.targets.clone()).collect();
        assert_eq!((inputs, targets), (whole.inputs, whole.targets));
        assert_eq!(shards.iter().map(|(b, _)| b.target_bytes).sum::<u64>(), whole.target_bytes);
        // Every rank's sampler is where the single process's is: the next global batch agrees.
        for (_, s) in shards {
            assert_eq!(s, one);
        }
    }
}
