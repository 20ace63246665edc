//! Tokenized training text: a text file or JSON Lines tokenized once into a memory-mapped token
//! file ([`super::cache`]) in a cache directory, reused while the text and the tokenizer.json are
//! byte-for-byte the same.
//!
//! # Tokenizing in parallel
//!
//! The input is read in blocks of [`BLOCK_BYTES`], cut into pieces of about [`PIECE_BYTES`], and
//! the pieces are tokenized on rayon's threads; ids are written in order, so only a block's ids are
//! in memory at once (never the whole token list). A JSON Lines document is a piece (or several).
//!
//! Cutting text changes ids when a pre-token could have spanned the cut. A cut is made only just
//! after a newline between two printable ASCII characters (`…x\ny…`), and only for tokenizers
//! whose pre-tokenizer splits there anyway ([`TextTokenizer::splits_at_newlines`]): GPT-2's regex
//! (`'s|…| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`), as Llama 3's and Qwen's, makes a
//! lone newline followed by a non-space its own pre-token (or the tail of a punctuation one) and
//! starts the next pre-token at `y`, with or without the cut; a cut after `\n\n`, or before a
//! space, would not be safe (`\s+(?!\S)` matches differently at the end of a piece). BPE works
//! within pre-tokens, so equal pre-tokens give equal ids. As a run-time guard, the text around
//! the first cut of a run (4 KiB on each side) is also tokenized across the cut and compared; on
//! a difference, or for any other tokenizer (a normalizer that prepends `▁`, no regex
//! pre-tokenizer), a plain text is tokenized whole, on one thread, holding it in memory (JSON
//! Lines documents are then tokenized whole each, still in parallel).
//!
//! # Bytes per token
//!
//! Each token carries the number of bytes of the text it covers, so a batch's targets cover a
//! known number of bytes and validation loss converts to bits per byte exactly. A byte-level
//! tokenizer's tokens cover their own bytes (each vocabulary character is one byte; a special
//! token its UTF-8 content), which is exact even when a character is split across tokens; this is
//! used when a piece's token bytes add up to its length (no normalizer, no added prefix space).
//! Otherwise the tokenizer's byte offsets: each byte goes to the first token whose span ends at or
//! after it, bytes after the last span to the last token. A document's tokens cover exactly its
//! bytes; the end-of-text separator between JSON Lines documents covers 0 bytes (its loss still
//! counts); a piece that gives no token passes its bytes to the next token. The covered bytes of
//! JSON Lines are those of the `text` strings (UTF-8), not of the JSON.

mod build;

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::cache::{self, cache_err, Header, TokenFile};
use super::tokenizer::TextTokenizer;
use super::{DataError, DataSource, Split, TextFormat};
use build::Builder;

/// Bytes of input read and tokenized between two progress reports.
pub const BLOCK_BYTES: usize = 4 << 20;
/// Bytes of text per piece tokenized on one thread.
pub const PIECE_BYTES: usize = 64 << 10;

/// A tokenized text with a train/validation split (the tail `val_fraction` of the tokens).
#[derive(Debug)]
pub struct TokenData {
    path: PathBuf,
    tokenizer: TextTokenizer,
    file: TokenFile,
    cache_path: PathBuf,
    split: usize,
    val_text_bytes: u64,
    built: bool,
}

impl TokenData {
    /// Tokenizes `source.path` with `tokenizer` into a token file in `cache_dir`, or reuses the
    /// one there made from the same bytes of text and tokenizer.json; `progress(done_bytes,
    /// total_bytes)` is called as the input is tokenized (not when the cache is reused).
    ///
    /// # Errors
    /// [`DataError::Read`] (text missing or unreadable), [`DataError::NotUtf8`],
    /// [`DataError::JsonLines`], [`DataError::Cache`] (`cache_dir` not writable),
    /// [`DataError::Tokenizer`], [`DataError::TooFewTokens`].
    pub fn load(
        source: &DataSource,
        tokenizer: TextTokenizer,
        cache_dir: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self, DataError> {
        Self::load_in_blocks(source, tokenizer, cache_dir, progress, (BLOCK_BYTES, PIECE_BYTES))
    }

    /// [`TokenData::load`] with other block and piece sizes (tests).
    fn load_in_blocks(
        source: &DataSource,
        tokenizer: TextTokenizer,
        cache_dir: &Path,
        progress: &mut dyn FnMut(u64, u64),
        (block_bytes, piece_bytes): (usize, usize),
    ) -> Result<Self, DataError> {
        let path = &source.path;
        let format = source.format.resolve(path);
        let data_sha256 = sha256_file(path)?;
        let recipe = recipe(&tokenizer, format);
        std::fs::create_dir_all(cache_dir).map_err(|e| cache_err(cache_dir, format!("cannot create it: {e}")))?;
        let cache_path = cache_dir.join(cache_name(path, &data_sha256, &recipe));
        let (file, built) = match TokenFile::open(&cache_path, &data_sha256, &recipe) {
            Some(f) => (f, false),
            None => {
                let header = Header {
                    id_width: cache::id_width(tokenizer.vocab_size()),
                    vocab_size: tokenizer.vocab_size() as u32,
                    eot: tokenizer.eot_id().filter(|_| format == TextFormat::Jsonl),
                    n_tokens: 0,
                    text_bytes: 0,
                    documents: 0,
                    n_overflow: 0,
                    format: (format == TextFormat::Jsonl) as u32,
                    body_crc: 0,
                    data_sha256,
                    recipe_sha256: recipe,
                };
                let pool = match source.threads {
                    0 => None,
                    n => Some(rayon::ThreadPoolBuilder::new().num_threads(n).build().map_err(|e| {
                        DataError::Tokenizer { path: tokenizer.path().to_path_buf(), reason: e.to_string() }
                    })?),
                };
                let mut b = Builder {
                    tokenizer: &tokenizer,
                    path,
                    pool: pool.as_ref(),
                    progress,
                    header,
                    block_bytes,
                    piece_bytes,
                };
                (b.build(&cache_path, format)?, true)
            }
        };
        Self::from_file(path, tokenizer, file, cache_path, built, source.val_fraction, source.seq_len)
    }

    fn from_file(
        path: &Path,
        tokenizer: TextTokenizer,
        file: TokenFile,
        cache_path: PathBuf,
        built: bool,
        val_fraction: f64,
        seq_len: usize,
    ) -> Result<Self, DataError> {
        let n = file.header.n_tokens as usize;
        let split = super::corpus::split_point(n, val_fraction, seq_len).map_err(|needed| DataError::TooFewTokens {
            path: path.to_path_buf(),
            tokens: n,
            needed,
            val_fraction,
        })?;
        let mut data = Self { path: path.to_path_buf(), tokenizer, file, cache_path, split, val_text_bytes: 0, built };
        data.val_text_bytes = data.val().text_bytes();
        Ok(data)
    }

    /// The text file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token file in the cache directory.
    pub fn cache_path(&self) -> &Path {
        &self.cache_path
    }

    /// What the ids were made from: 64 bits of the text's SHA-256 and of the recipe's
    /// (tokenizer.json, format), in hex, `<text>.<recipe>`. For a checkpoint to record, so a resume
    /// with another text or tokenizer can be refused.
    pub fn key(&self) -> String {
        format!("{}.{}", hex(&self.file.header.data_sha256[..8]), hex(&self.file.header.recipe_sha256[..8]))
    }

    /// Whether this load tokenized the text (false: the cache was reused).
    pub fn built(&self) -> bool {
        self.built
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The model's vocabulary size (the tokenizer's).
    pub fn vocab_size(&self) -> usize {
        self.file.header.vocab_size as usize
    }

    /// All tokens.
    pub fn all(&self) -> Split<'_> {
        Split::tokens(self.file.ids(), self.file.header.id_width, self.file.lens(), 0, self.file.overflow())
    }

    /// Training tokens (the head).
    pub fn train(&self) -> Split<'_> {
        self.all().slice(0..self.split)
    }

    /// Validation tokens (the tail).
    pub fn val(&self) -> Split<'_> {
        let all = self.all();
        all.slice(self.split..all.len())
    }

    /// Bytes of text all tokens cover (the text's bytes; for JSON Lines, of its `text` strings).
    pub fn text_bytes(&self) -> u64 {
        self.file.header.text_bytes
    }

    /// Bytes of text the validation tokens cover.
    pub fn val_text_bytes(&self) -> u64 {
        self.val_text_bytes
    }

    /// Documents (1 for a plain text).
    pub fn documents(&self) -> u64 {
        self.file.header.documents
    }

    /// Entropy of the training tokens' frequencies (unigram model), in nats per token.
    pub fn unigram_entropy_nats(&self) -> f64 {
        self.train().unigram_entropy_nats(self.vocab_size())
    }
}

/// Streaming SHA-256 of a file.
fn sha256_file(path: &Path) -> Result<[u8; 32], DataError> {
    let read_err = |source| DataError::Read { path: path.to_path_buf(), source };
    let mut f = File::open(path).map_err(read_err)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Ok(h.finalize().into()),
            Ok(n) => h.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(read_err(e)),
        }
    }
}

/// What, beside the text, decides the ids: the tokenizer.json's bytes, the input format, the
/// token file's version.
fn recipe(tokenizer: &TextTokenizer, format: TextFormat) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tokenizer.sha256());
    h.update(format!("format={format:?};version={}", cache::VERSION).as_bytes());
    h.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `<text file name>.<text hash>.<recipe hash>.tokens`, 64 bits of each hash.
fn cache_name(path: &Path, data_sha256: &[u8; 32], recipe: &[u8; 32]) -> String {
    let stem: String = path
        .file_name()
        .map(|n| n.to_string_lossy().chars().map(|c| if c.is_alphanumeric() || c == '.' { c } else { '_' }).collect())
        .unwrap_or_default();
    format!("{stem}.{}.{}.tokens", hex(&data_sha256[..8]), hex(&recipe[..8]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{shared, Corpus, Sampler};

    pub(super) fn tokenizer_path() -> PathBuf {
        shared("fixtures/llama/tokenizer.json")
    }

    pub(super) fn load(source: &DataSource) -> Result<TokenData, DataError> {
        match Corpus::load(source, &mut |_, _| {})? {
            Corpus::Tokens(t) => Ok(t),
            Corpus::Bytes(_) => panic!("bytes"),
        }
    }

    pub(super) fn ids(split: &Split<'_>) -> Vec<u32> {
        let mut v = Vec::new();
        split.extend_ids(0..split.len(), &mut v);
        v
    }

    #[test]
    fn the_cache_is_reused_and_rebuilt_when_text_tokenizer_or_file_change() {
        let dir = tempfile::tempdir().unwrap();
        let text_path = dir.path().join("t.txt");
        let tok_path = dir.path().join("tokenizer.json");
        let cache = dir.path().join("cache");
        std::fs::copy(tokenizer_path(), &tok_path).unwrap();
        let text = std::fs::read_to_string(shared("data/tinyshakespeare.txt")).unwrap();
        std::fs::write(&text_path, &text[..200_000]).unwrap();
        let src = DataSource::tokenized(&text_path, &tok_path, &cache, 0.1, 32);
        let first = load(&src).unwrap();
        assert!(first.built());
        let want = ids(&first.all());
        let mut reused_progress = 0;
        let second = match Corpus::load(&src, &mut |_, _| reused_progress += 1).unwrap() {
            Corpus::Tokens(t) => t,
            Corpus::Bytes(_) => unreachable!(),
        };
        assert!(!second.built(), "same text and tokenizer: reused");
        assert_eq!(reused_progress, 0);
        assert_eq!(second.cache_path(), first.cache_path());
        assert_eq!(second.key(), first.key());
        assert!(first.cache_path().to_string_lossy().ends_with(&format!("t.txt.{}.tokens", first.key())));
        assert_eq!(ids(&second.all()), want);
        // A torn file (cut short), then a corrupt one (a flipped bit), are rebuilt in place.
        let cache_file = first.cache_path().to_path_buf();
        drop((first, second));
        let bytes = std::fs::read(&cache_file).unwrap();
        std::fs::write(&cache_file, &bytes[..bytes.len() / 2]).unwrap();
        let again = load(&src).unwrap();
        assert!(again.built());
        assert_eq!(again.cache_path(), cache_file);
        assert_eq!(ids(&again.all()), want);
        drop(again);
        let mut flipped = std::fs::read(&cache_file).unwrap();
        assert_eq!(flipped, bytes);
        let k = flipped.len() - 5;
        flipped[k] ^= 0x10;
        std::fs::write(&cache_file, &flipped).unwrap();
        assert!(load(&src).unwrap().built());
        assert!(!load(&src).unwrap().built());
        // Changed text: a new file.
        std::fs::write(&text_path, &text[..210_000]).unwrap();
        let longer = load(&src).unwrap();
        assert!(longer.built());
        assert_ne!(longer.cache_path(), cache_file);
        assert!(longer.all().len() > want.len());
        // Changed tokenizer.json bytes (the same tokenizer, reformatted): a new file too.
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&tok_path).unwrap()).unwrap();
        std::fs::write(&tok_path, serde_json::to_vec(&json).unwrap()).unwrap();
        let retok = load(&src).unwrap();
        assert!(retok.built());
        assert_ne!(retok.cache_path(), longer.cache_path());
        assert_eq!(retok.key()[..16], longer.key()[..16], "same text");
        assert_ne!(retok.key()[17..], longer.key()[17..], "another tokenizer.json");
        assert_eq!(ids(&retok.all()), ids(&longer.all()));
        assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 3, "one file per (text, tokenizer), no temporaries");
    }

    #[test]
    fn split_sizes_sampler_and_its_saved_state() {
        let dir = tempfile::tempdir().unwrap();
        let src = DataSource::tokenized(shared("data/tinyshakespeare.txt"), tokenizer_path(), dir.path(), 0.1, 64);
        let data = load(&src).unwrap();
        let n = data.all().len();
        let split = ((n as f64) * 0.9).round() as usize;
        assert_eq!(data.train().len(), split);
        assert_eq!(data.val().len(), n - split);
        assert_eq!(data.train().text_bytes() + data.val_text_bytes(), data.text_bytes());
        assert_eq!(data.val().id(0), data.all().id(split));
        let (mut a, mut b) = (Sampler::new(11), Sampler::new(11));
        for _ in 0..3 {
            let x = a.sample(&data.train(), 4, 64);
            assert_eq!(x, b.sample(&data.train(), 4, 64));
            assert_eq!(x.inputs.len(), 256);
            for r in 0..4 {
                assert_eq!(x.inputs[r * 64 + 1..r * 64 + 64], x.targets[r * 64..r * 64 + 63]);
            }
            assert!(x.inputs.iter().chain(&x.targets).all(|&t| t < 1024));
        }
        let saved = serde_json::to_string(&a).unwrap();
        let next = a.sample(&data.train(), 4, 64);
        let mut restored: Sampler = serde_json::from_str(&saved).unwrap();
        assert_eq!(restored.sample(&data.train(), 4, 64), next);
        assert_ne!(Sampler::new(12).sample(&data.train(), 4, 64), Sampler::new(11).sample(&data.train(), 4, 64));
        // Too long a sequence for the validation tail.
        let err = load(&DataSource { seq_len: n / 10 + 1, ..src }).unwrap_err().to_string();
        assert!(err.contains("tinyshakespeare.txt") && err.contains("tokens") && err.contains("seq_len"), "{err}");
    }

    #[test]
    fn target_bytes_match_the_decoded_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = shared("data/tinyshakespeare.txt");
        let corpus =
            Corpus::load(&DataSource::tokenized(&path, tokenizer_path(), dir.path(), 0.1, 64), &mut |_, _| {}).unwrap();
        let Corpus::Tokens(data) = &corpus else { unreachable!() };
        let val = corpus.validation_batches(8, 4, 64);
        let mut total = 0;
        for b in &val {
            let mut sum = 0;
            for r in 0..4 {
                // The text is ASCII: the decoded targets have exactly the bytes the targets cover.
                let decoded = data.tokenizer().decode(&b.targets[r * 64..r * 64 + 64]).unwrap();
                sum += decoded.len() as u64;
            }
            assert_eq!(b.target_bytes, sum);
            total += sum;
        }
        let targets: usize = val.iter().map(|b| b.targets.len()).sum();
        let bytes_per_token = total as f64 / targets as f64;
        assert!(bytes_per_token > 2.0 && bytes_per_token < 6.0, "{bytes_per_token}");
        assert_eq!(corpus.val_text_bytes(), data.val().text_bytes());
        let mut s = Sampler::new(3);
        let b = corpus.next_batch(&mut s, 2, 64);
        let decoded = data.tokenizer().decode(&b.targets).unwrap();
        assert_eq!(b.target_bytes, decoded.len() as u64);
    }

    #[test]
    fn errors_name_the_path_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("t.txt");
        std::fs::write(&text, "hello\nworld\n".repeat(200)).unwrap();
        let err = |src: DataSource| load(&src).unwrap_err().to_string();
        let cache = dir.path().join("c");
        let e = err(DataSource::tokenized(dir.path().join("missing.txt"), tokenizer_path(), &cache, 0.1, 8));
        assert!(e.contains("missing.txt") && e.contains("fix:"), "{e}");
        let e = err(DataSource::tokenized(&text, dir.path().join("nope.json"), &cache, 0.1, 8));
        assert!(e.contains("nope.json") && e.contains("fix:"), "{e}");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{ not json").unwrap();
        let e = err(DataSource::tokenized(&text, &bad, &cache, 0.1, 8));
        assert!(e.contains("bad.json") && e.contains("parse") && e.contains("fix:"), "{e}");
        let empty = dir.path().join("empty.txt");
        std::fs::write(&empty, "").unwrap();
        let e = err(DataSource::tokenized(&empty, tokenizer_path(), &cache, 0.1, 8));
        assert!(e.contains("empty.txt") && e.contains("no tokens") && e.contains("fix:"), "{e}");
        let short = dir.path().join("short.txt");
        std::fs::write(&short, "a few words").unwrap();
        let e = err(DataSource::tokenized(&short, tokenizer_path(), &cache, 0.1, 8));
        assert!(e.contains("short.txt") && e.contains("tokens") && e.contains("fix:"), "{e}");
        let latin1 = dir.path().join("latin1.txt");
        std::fs::write(&latin1, b"caf\xe9\n".repeat(10)).unwrap();
        let e = err(DataSource::tokenized(&latin1, tokenizer_path(), &cache, 0.1, 8));
        assert!(e.contains("latin1.txt") && e.contains("offset 3") && e.contains("UTF-8"), "{e}");
        // A cache directory that cannot be created (a file is in the way; root ignores modes).
        let e = err(DataSource::tokenized(&text, tokenizer_path(), text.join("cache"), 0.1, 8));
        assert!(e.contains("t.txt/cache") && e.contains("cache_dir"), "{e}");
    }
}
