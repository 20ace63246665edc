//! Training data: text turned into token ids, a train/validation split, a seeded batch sampler
//! whose state is saved in checkpoints (a resumed run sees the same batches), fixed validation
//! batches, and the bytes of text each batch's targets cover (validation loss in bits per byte).
//!
//! | item | what |
//! |---|---|
//! | [`Corpus`] | what a trainer holds: bytes or tokens behind one interface (vocabulary, splits, batches, bytes covered, unigram entropy) |
//! | [`DataSource`] | where the text is and how to read it: path, [`TextFormat`], tokenizer, cache directory, split |
//! | [`TextData`] | byte-level text: bytes are tokens (vocabulary 256), one byte per token |
//! | [`TokenData`] | text tokenized by a Hugging Face `tokenizer.json` into a memory-mapped token file, cached ([`tokens`] module docs: parallel tokenization, bytes per token) |
//! | [`TextTokenizer`] | the loaded `tokenizer.json`: ids, its hash, end-of-text token |
//! | [`Split`] | one side of a split: ids and the bytes of text each covers |
//! | [`Sampler`], [`Batch`] | random windows of `seq_len + 1` tokens: inputs and targets (shifted by one) |
//!
//! Bits per byte: the validation loss summed over the target tokens of the validation batches, in
//! nats, divided by the bytes of text those targets cover ([`Batch::target_bytes`]) and by ln 2:
//! `Σ_b mean_loss_b · batch_size · seq_len / Σ_b target_bytes_b / ln 2`. For byte-level data it is
//! the loss in nats per byte / ln 2.

pub mod cache;
mod tokenizer;
pub mod tokens;

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use tokenizer::TextTokenizer;
pub use tokens::TokenData;

/// Where to get the text the README's main job trains on.
pub const TINYSHAKESPEARE_URL: &str =
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt";

/// The text cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file is missing or unreadable.
    #[error(
        "cannot read training text {path}: {source}\n  fix: set [data] path in the config (relative to the config file) \
         to a text file; the example configs expect ../shared/data/tinyshakespeare.txt beside the repository \
         (download it from {TINYSHAKESPEARE_URL})"
    )]
    Read {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is too short for one training and one validation sequence.
    #[error(
        "training text {path} has {len} bytes; a split with val_fraction {val_fraction} needs at least {needed} \
         (seq_len + 1 tokens on each side)\n  fix: use a longer text or a shorter train.seq_len"
    )]
    TooShort {
        /// The path.
        path: PathBuf,
        /// Bytes in the file.
        len: usize,
        /// Bytes needed.
        needed: usize,
        /// The configured fraction.
        val_fraction: f64,
    },
    /// The tokenized text is too short for one training and one validation sequence.
    #[error(
        "training text {path} gives {tokens} tokens; a split with val_fraction {val_fraction} needs at least \
         {needed} (seq_len + 1 tokens on each side)\n  fix: use a longer text or a shorter train.seq_len"
    )]
    TooFewTokens {
        /// The path.
        path: PathBuf,
        /// Tokens of the text.
        tokens: usize,
        /// Tokens needed.
        needed: usize,
        /// The configured fraction.
        val_fraction: f64,
    },
    /// The text gives no token at all.
    #[error(
        "training text {path} gives no tokens (an empty file, or JSON Lines without a non-empty `text`)\n  \
         fix: point [data] path at a non-empty text"
    )]
    Empty {
        /// The path.
        path: PathBuf,
    },
    /// The tokenizer.json is missing, does not parse, or fails.
    #[error(
        "tokenizer {path}: {reason}\n  fix: point [data] tokenizer at a Hugging Face tokenizer.json (the file of \
         that name in a model repository), or remove the key to train on bytes"
    )]
    Tokenizer {
        /// The tokenizer.json.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The text is not UTF-8 (a tokenizer reads text, not bytes).
    #[error(
        "training text {path} is not UTF-8 (invalid byte at offset {offset})\n  fix: convert it to UTF-8 \
         (iconv -t UTF-8), or train on bytes (no [data] tokenizer)"
    )]
    NotUtf8 {
        /// The path.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        offset: u64,
    },
    /// A JSON Lines line is not an object with a string `text`.
    #[error(
        "training text {path}, line {line}: {reason}\n  fix: each line of a JSON Lines text must be an object \
         with a string field `text`, e.g. {{\"text\": \"...\"}} (or set [data] format = \"text\" to read the file as \
         plain text)"
    )]
    JsonLines {
        /// The path.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// JSON Lines needs a tokenizer (its documents are separated by the end-of-text token).
    #[error(
        "training text {path} is JSON Lines, which needs a tokenizer\n  fix: set [data] tokenizer to a \
         tokenizer.json, or set [data] format = \"text\" to train on the file's bytes"
    )]
    JsonLinesNeedsTokenizer {
        /// The path.
        path: PathBuf,
    },
    /// The token cache directory cannot be created or written.
    #[error(
        "token cache directory {dir}: {reason}\n  fix: set [data] cache_dir to a writable directory (the token \
         file takes about 3 bytes per token)"
    )]
    Cache {
        /// The directory.
        dir: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A tokenizer was given without a cache directory.
    #[error("tokenized training text {path} needs a cache directory\n  fix: set [data] cache_dir")]
    NoCacheDir {
        /// The text.
        path: PathBuf,
    },
}

/// A byte-level corpus split into a training head and a validation tail.
#[derive(Debug, Clone)]
pub struct TextData {
    path: PathBuf,
    bytes: Vec<u8>,
    split: usize,
}

impl TextData {
    /// Reads `path` and holds out its last `val_fraction` for validation.
    ///
    /// # Errors
    /// [`DataError::Read`] when the file is missing or unreadable; [`DataError::TooShort`] when
    /// either side of the split is shorter than `seq_len + 1` bytes (an empty file included).
    pub fn load(path: &Path, val_fraction: f64, seq_len: usize) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Read { path: path.to_path_buf(), source })?;
        Self::from_bytes(path, bytes, val_fraction, seq_len)
    }

    /// As [`TextData::load`], from bytes already in memory (`path` names them in errors).
    ///
    /// # Errors
    /// [`DataError::TooShort`].
    pub fn from_bytes(path: &Path, bytes: Vec<u8>, val_fraction: f64, seq_len: usize) -> Result<Self, DataError> {
        let len = bytes.len();
        let split = split_point(len, val_fraction, seq_len).map_err(|needed| DataError::TooShort {
            path: path.to_path_buf(),
            len,
            needed,
            val_fraction,
        })?;
        Ok(Self { path: path.to_path_buf(), bytes, split })
    }

    /// The file the text came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Training bytes.
    pub fn train(&self) -> &[u8] {
        &self.bytes[..self.split]
    }

    /// Validation bytes.
    pub fn val(&self) -> &[u8] {
        &self.bytes[self.split..]
    }

    /// Entropy of the training text's byte frequencies (unigram model), in nats per byte: the
    /// loss a model that ignores context cannot beat.
    pub fn unigram_entropy_nats(&self) -> f64 {
        let mut counts = [0u64; 256];
        self.train().iter().for_each(|&b| counts[b as usize] += 1);
        let n = self.train().len() as f64;
        counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
    }
}

/// Where `len` tokens split for `val_fraction` (the tail) held out, or the tokens needed when
/// either side is shorter than `seq_len + 1`.
fn split_point(len: usize, val_fraction: f64, seq_len: usize) -> Result<usize, usize> {
    let split = ((len as f64) * (1.0 - val_fraction)).round() as usize;
    if split < seq_len + 1 || len - split.min(len) < seq_len + 1 {
        return Err(((seq_len + 1) as f64 / val_fraction.min(1.0 - val_fraction)).ceil() as usize);
    }
    Ok(split)
}

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

    fn tokens(ids: &'a [u8], width: usize, lens: &'a [u8], first: u64, overflow: &'a [u8]) -> Self {
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

    /// Bytes of text tokens `range` cover ([`tokens`] module docs: how a token's bytes are
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
    rng: ChaCha8Rng,
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
    /// If `split.len() < seq_len + 1` ([`TextData`] and [`TokenData`] guarantee it is not).
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

/// How the training text is stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextFormat {
    /// JSON Lines when the name ends in `.jsonl` or `.ndjson`, else plain text. Default.
    #[default]
    Auto,
    /// Plain text (UTF-8 for a tokenizer); one document.
    Text,
    /// JSON Lines: one object per line with a string field `text`, each a document; documents are
    /// separated by the tokenizer's end-of-text token (if it has one). Needs a tokenizer.
    Jsonl,
}

impl TextFormat {
    /// `Text` or `Jsonl` for `path` (`Auto` decided by its extension).
    pub fn resolve(self, path: &Path) -> TextFormat {
        match self {
            TextFormat::Auto => match path.extension().and_then(|e| e.to_str()) {
                Some("jsonl" | "ndjson") => TextFormat::Jsonl,
                _ => TextFormat::Text,
            },
            f => f,
        }
    }
}

/// Where the training text is and how to read it (the `[data]` section of a config).
#[derive(Debug, Clone, PartialEq)]
pub struct DataSource {
    /// The text: plain text or JSON Lines.
    pub path: PathBuf,
    /// How it is stored. Default: [`TextFormat::Auto`].
    pub format: TextFormat,
    /// A Hugging Face `tokenizer.json`; `None`: bytes are tokens (vocabulary 256).
    pub tokenizer: Option<PathBuf>,
    /// Where token files are cached (needed with a tokenizer), e.g. beside the run's checkpoints.
    pub cache_dir: Option<PathBuf>,
    /// Fraction of the tokens (the tail) held out for validation.
    pub val_fraction: f64,
    /// Tokens per training sequence: each side of the split needs `seq_len + 1`.
    pub seq_len: usize,
    /// Threads that tokenize; 0: rayon's current pool. Default: 0.
    pub threads: usize,
}

impl DataSource {
    /// Byte-level text at `path`.
    pub fn bytes(path: impl Into<PathBuf>, val_fraction: f64, seq_len: usize) -> Self {
        Self {
            path: path.into(),
            format: TextFormat::Text,
            tokenizer: None,
            cache_dir: None,
            val_fraction,
            seq_len,
            threads: 0,
        }
    }

    /// Text at `path` tokenized by `tokenizer` (a tokenizer.json), cached in `cache_dir`.
    pub fn tokenized(
        path: impl Into<PathBuf>,
        tokenizer: impl Into<PathBuf>,
        cache_dir: impl Into<PathBuf>,
        val_fraction: f64,
        seq_len: usize,
    ) -> Self {
        Self {
            format: TextFormat::Auto,
            tokenizer: Some(tokenizer.into()),
            cache_dir: Some(cache_dir.into()),
            ..Self::bytes(path, val_fraction, seq_len)
        }
    }
}

/// The training text as a trainer uses it: bytes or tokens behind one interface.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per trainer, never moved in a loop
pub enum Corpus {
    /// Bytes are tokens.
    Bytes(TextData),
    /// Tokenized by a `tokenizer.json`.
    Tokens(TokenData),
}

impl Corpus {
    /// Loads `source`: reads the bytes, or tokenizes the text (reusing the cache when it can),
    /// calling `progress(done_bytes, total_bytes)` while it tokenizes.
    ///
    /// # Errors
    /// The [`DataError`] of whatever is wrong: the text (missing, too short, empty, not UTF-8, a bad
    /// JSON Lines line), the tokenizer, or the cache directory; each names the path and the fix.
    pub fn load(source: &DataSource, progress: &mut dyn FnMut(u64, u64)) -> Result<Self, DataError> {
        let format = source.format.resolve(&source.path);
        match &source.tokenizer {
            None if format == TextFormat::Jsonl => {
                Err(DataError::JsonLinesNeedsTokenizer { path: source.path.clone() })
            }
            None => TextData::load(&source.path, source.val_fraction, source.seq_len).map(Corpus::Bytes),
            Some(tok) => {
                let cache_dir =
                    source.cache_dir.as_deref().ok_or(DataError::NoCacheDir { path: source.path.clone() })?;
                if !source.path.is_file() {
                    let source_err = std::fs::metadata(&source.path)
                        .err()
                        .unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
                    return Err(DataError::Read { path: source.path.clone(), source: source_err });
                }
                let tokenizer = TextTokenizer::load(tok)?;
                TokenData::load(source, tokenizer, cache_dir, progress).map(Corpus::Tokens)
            }
        }
    }

    /// The text file.
    pub fn path(&self) -> &Path {
        match self {
            Corpus::Bytes(d) => d.path(),
            Corpus::Tokens(d) => d.path(),
        }
    }

    /// For a checkpoint to record: `None` for bytes, else [`TokenData::key`] (which text and
    /// tokenizer.json made the ids).
    pub fn key(&self) -> Option<String> {
        match self {
            Corpus::Bytes(_) => None,
            Corpus::Tokens(d) => Some(d.key()),
        }
    }

    /// Vocabulary size: 256 for bytes, else the tokenizer's.
    pub fn vocab_size(&self) -> usize {
        match self {
            Corpus::Bytes(_) => 256,
            Corpus::Tokens(d) => d.vocab_size(),
        }
    }

    /// Training tokens.
    pub fn train(&self) -> Split<'_> {
        match self {
            Corpus::Bytes(d) => Split::bytes(d.train()),
            Corpus::Tokens(d) => d.train(),
        }
    }

    /// Validation tokens.
    pub fn val(&self) -> Split<'_> {
        match self {
            Corpus::Bytes(d) => Split::bytes(d.val()),
            Corpus::Tokens(d) => d.val(),
        }
    }

    /// The next training batch from `sampler` (for bytes, the batch [`Sampler::next_batch`] gives).
    pub fn next_batch(&self, sampler: &mut Sampler, batch_size: usize, seq_len: usize) -> Batch {
        sampler.sample(&self.train(), batch_size, seq_len)
    }

    /// Shard `shard.rank`'s `batch_size` windows of the next global batch of `batch_size ×
    /// shard.ranks` ([`Sampler::sample_shard`]).
    pub fn next_batch_shard(&self, sampler: &mut Sampler, batch_size: usize, seq_len: usize, shard: Shard) -> Batch {
        sampler.sample_shard(&self.train(), batch_size, seq_len, shard)
    }

    /// Fixed validation batches (for bytes, those of [`validation_batches`]).
    pub fn validation_batches(&self, batches: usize, batch_size: usize, seq_len: usize) -> Vec<Batch> {
        self.val().validation_batches(batches, batch_size, seq_len)
    }

    /// Bytes of text the validation split covers.
    pub fn val_text_bytes(&self) -> u64 {
        match self {
            Corpus::Bytes(d) => d.val().len() as u64,
            Corpus::Tokens(d) => d.val_text_bytes(),
        }
    }

    /// Bytes of training text per training token (1 for bytes).
    pub fn bytes_per_token(&self) -> f64 {
        let train = self.train();
        train.text_bytes() as f64 / train.len().max(1) as f64
    }

    /// Entropy of the training tokens' frequencies (unigram model), in nats per token: the loss a
    /// model that ignores context cannot beat.
    pub fn unigram_entropy_nats(&self) -> f64 {
        match self {
            Corpus::Bytes(d) => d.unigram_entropy_nats(),
            Corpus::Tokens(d) => d.unigram_entropy_nats(),
        }
    }
}

/// A file of `../shared/` beside the repository; panics (the test fails, never skips) when it is
/// missing.
#[cfg(test)]
pub(crate) fn shared(rel: &str) -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = here.join("../shared").join(rel);
    assert!(p.exists(), "{} is missing: the tests need ../shared beside the repository", p.display());
    p
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn short_or_missing_text_is_a_clear_error() {
        let err = TextData::from_bytes(Path::new("t.txt"), vec![], 0.1, 8).unwrap_err().to_string();
        assert!(err.contains("t.txt") && err.contains("0 bytes"), "{err}");
        let err = TextData::load(Path::new("/nonexistent/x.txt"), 0.1, 8).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/x.txt") && err.contains("tinyshakespeare"), "{err}");
    }

    #[test]
    fn unigram_entropy_of_uniform_bytes_is_ln_256() {
        let text: Vec<u8> = (0..256 * 20).map(|i| (i % 256) as u8).collect();
        let data = TextData::from_bytes(Path::new("t"), text, 0.1, 8).unwrap();
        // The training head is not a whole number of periods; entropy is close to ln 256.
        assert!((data.unigram_entropy_nats() - 256f64.ln()).abs() < 1e-3);
    }

    #[test]
    fn corpus_of_bytes_gives_the_batches_of_the_byte_api() {
        let text: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 253) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        std::fs::write(&path, &text).unwrap();
        let corpus = Corpus::load(&DataSource::bytes(&path, 0.1, 16), &mut |_, _| panic!("no tokenization")).unwrap();
        let data = TextData::from_bytes(&path, text, 0.1, 16).unwrap();
        assert_eq!(corpus.vocab_size(), 256);
        assert_eq!(corpus.val_text_bytes(), data.val().len() as u64);
        assert_eq!(corpus.bytes_per_token(), 1.0);
        assert_eq!(corpus.unigram_entropy_nats(), data.unigram_entropy_nats());
        let (mut a, mut b) = (Sampler::new(5), Sampler::new(5));
        for _ in 0..4 {
            let x = corpus.next_batch(&mut a, 4, 16);
            assert_eq!(x, b.next_batch(data.train(), 4, 16));
            assert_eq!(x.target_bytes, 64);
        }
        assert_eq!(corpus.validation_batches(3, 4, 16), validation_batches(&data, 3, 4, 16));
        // The generic entropy agrees with the byte one.
        let e = corpus.train().unigram_entropy_nats(256);
        assert!((e - data.unigram_entropy_nats()).abs() < 1e-12);
    }

    #[test]
    fn json_lines_without_a_tokenizer_is_a_clear_error() {
        let err = Corpus::load(
            &DataSource { format: TextFormat::Auto, ..DataSource::bytes("d.jsonl", 0.1, 8) },
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("d.jsonl") && err.contains("tokenizer"), "{err}");
        let mut src = DataSource::tokenized("d.txt", "tok.json", "c", 0.1, 8);
        src.cache_dir = None;
        let err = Corpus::load(&src, &mut |_, _| {}).unwrap_err().to_string();
        assert!(err.contains("d.txt") && err.contains("cache_dir"), "{err}");
    }
}
