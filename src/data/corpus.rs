//! Loading the training text: where it is and how to read it ([`DataSource`], [`TextFormat`]),
//! byte-level text ([`TextData`]) and [`Corpus`], bytes or tokens behind one interface.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Batch, DataError, Sampler, Shard, Split, TextTokenizer, TokenData};

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
pub(super) fn split_point(len: usize, val_fraction: f64, seq_len: usize) -> Result<usize, usize> {
    let split = ((len as f64) * (1.0 - val_fraction)).round() as usize;
    if split < seq_len + 1 || len - split.min(len) < seq_len + 1 {
        return Err(((seq_len + 1) as f64 / val_fraction.min(1.0 - val_fraction)).ceil() as usize);
    }
    Ok(split)
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

    /// Fixed validation batches (for bytes, those of [`validation_batches`](super::validation_batches)).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::validation_batches;

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
