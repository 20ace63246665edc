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
//!
//! | file | what |
//! |---|---|
//! | `corpus.rs` | loading: [`DataSource`], [`TextFormat`], [`TextData`], [`Corpus`] |
//! | `sampler.rs` | token access and batches: [`Split`], [`Batch`], [`Sampler`], [`Shard`] |
//! | `tokens/` | the tokenized text and its token file ([`TokenData`]; `tokens/build.rs` tokenizes) |
//!
//! This file holds the errors ([`DataError`]).

pub mod cache;
mod corpus;
mod sampler;
mod tokenizer;
pub mod tokens;

use std::path::PathBuf;

pub use corpus::{Corpus, DataSource, TextData, TextFormat};
pub use sampler::{validation_batches, Batch, Sampler, Shard, Split};
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

/// A file of `../shared/` beside the repository; panics (the test fails, never skips) when it is
/// missing.
#[cfg(test)]
pub(crate) fn shared(rel: &str) -> PathBuf {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = here.join("../shared").join(rel);
    assert!(p.exists(), "{} is missing: the tests need ../shared beside the repository", p.display());
    p
}
