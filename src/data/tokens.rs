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

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::cache::{self, cache_err, Header, TokenFile, TokenWriter};
use super::tokenizer::{cut_points, last_cut, next_cut, Encoded, TextTokenizer};
use super::{DataError, DataSource, Split, TextFormat};

/// Bytes of input read and tokenized between two progress reports.
pub const BLOCK_BYTES: usize = 4 << 20;
/// Bytes of text per piece tokenized on one thread.
pub const PIECE_BYTES: usize = 64 << 10;
/// Bytes of text on each side of the first cut that the run-time guard tokenizes.
const GUARD_BYTES: usize = 4 << 10;

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

/// A piece of a block to tokenize: `docs[doc][range]`.
struct Piece {
    doc: usize,
    range: std::ops::Range<usize>,
    /// First piece of a document (JSON Lines: an end-of-text separator goes before it, except
    /// before the first document).
    starts_doc: bool,
}

struct Builder<'a, 'p> {
    tokenizer: &'a TextTokenizer,
    path: &'a Path,
    pool: Option<&'a rayon::ThreadPool>,
    progress: &'p mut dyn FnMut(u64, u64),
    header: Header,
    block_bytes: usize,
    piece_bytes: usize,
}

/// The first cut of a run changed the ids: start over without cutting.
struct Uncuttable;

impl Builder<'_, '_> {
    fn build(&mut self, cache_path: &Path, format: TextFormat) -> Result<TokenFile, DataError> {
        let cut = self.tokenizer.splits_at_newlines();
        match self.build_with(cache_path, format, cut)? {
            Ok(file) => Ok(file),
            Err(Uncuttable) => {
                tracing::warn!(
                    tokenizer = %self.tokenizer.path().display(),
                    "data: cutting the text at newlines changed the ids; tokenizing it whole on one thread"
                );
                self.build_with(cache_path, format, false).map(|r| r.unwrap_or_else(|_| unreachable!("no cuts")))
            }
        }
    }

    fn build_with(
        &mut self,
        cache_path: &Path,
        format: TextFormat,
        cut: bool,
    ) -> Result<Result<TokenFile, Uncuttable>, DataError> {
        let read_err = |source| DataError::Read { path: self.path.to_path_buf(), source };
        let file = File::open(self.path).map_err(read_err)?;
        let total = file.metadata().map_err(read_err)?.len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut out = TokenWriter::create(cache_path, self.header.clone())?;
        let mut checked = !cut;
        let mut done = 0u64;
        let mut sha = Sha256::new();
        (self.progress)(0, total);
        match format {
            TextFormat::Jsonl => {
                let mut line_no = 0usize;
                let mut line = Vec::new();
                loop {
                    let mut docs = Vec::new();
                    let mut block_bytes = 0usize;
                    let mut eof = false;
                    while block_bytes < self.block_bytes {
                        line.clear();
                        let n = reader.read_until(b'\n', &mut line).map_err(read_err)?;
                        if n == 0 {
                            eof = true;
                            break;
                        }
                        line_no += 1;
                        block_bytes += n;
                        sha.update(&line);
                        if line.iter().all(u8::is_ascii_whitespace) {
                            continue;
                        }
                        let text = self.parse_line(&line, line_no)?;
                        if !text.is_empty() {
                            docs.push(text);
                        }
                    }
                    done += block_bytes as u64;
                    let strs: Vec<&str> = docs.iter().map(String::as_str).collect();
                    if self.tokenize_block(&strs, true, cut, &mut checked, &mut out)?.is_err() {
                        return Ok(Err(Uncuttable));
                    }
                    (self.progress)(done.min(total), total);
                    if eof {
                        break;
                    }
                }
            }
            TextFormat::Text | TextFormat::Auto => {
                out.document();
                let mut buf: Vec<u8> = Vec::new();
                let mut offset = 0u64;
                let mut want = if cut { self.block_bytes } else { usize::MAX };
                loop {
                    let mut eof = false;
                    while buf.len() < want {
                        let before = buf.len();
                        let chunk = (want - buf.len()).min(1 << 20) as u64;
                        if (&mut reader).take(chunk).read_to_end(&mut buf).map_err(read_err)? == 0 {
                            eof = true;
                            break;
                        }
                        sha.update(&buf[before..]);
                    }
                    let end = match (eof, last_cut(&buf, 0, buf.len())) {
                        (true, _) => buf.len(),
                        (false, Some(p)) => p,
                        (false, None) => {
                            // No cut in the block (one long line): read on.
                            want += self.block_bytes;
                            continue;
                        }
                    };
                    want = if cut { self.block_bytes } else { usize::MAX };
                    let text = std::str::from_utf8(&buf[..end]).map_err(|e| DataError::NotUtf8 {
                        path: self.path.to_path_buf(),
                        offset: offset + e.valid_up_to() as u64,
                    })?;
                    if self.tokenize_block(&[text], false, cut, &mut checked, &mut out)?.is_err() {
                        return Ok(Err(Uncuttable));
                    }
                    offset += end as u64;
                    buf.drain(..end);
                    (self.progress)(offset.min(total), total);
                    if eof {
                        break;
                    }
                }
            }
        }
        (self.progress)(total, total);
        if <[u8; 32]>::from(sha.finalize()) != self.header.data_sha256 {
            let source = std::io::Error::other("it changed while it was being tokenized; run again once it is written");
            return Err(DataError::Read { path: self.path.to_path_buf(), source });
        }
        if out.len() == 0 {
            return Err(DataError::Empty { path: self.path.to_path_buf() });
        }
        out.finish().map(Ok)
    }

    fn parse_line(&self, line: &[u8], line_no: usize) -> Result<String, DataError> {
        let err = |reason: String| DataError::JsonLines { path: self.path.to_path_buf(), line: line_no, reason };
        let v: serde_json::Value = serde_json::from_slice(line).map_err(|e| err(format!("not JSON: {e}")))?;
        match v.get("text") {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(err(format!("`text` is not a string but {other}"))),
            None => Err(err("no `text` field".into())),
        }
    }

    /// Tokenizes `docs` (JSON Lines documents, or a block of one plain text) and appends them.
    /// `Ok(Err(Uncuttable))` when the first cut changed the ids.
    fn tokenize_block(
        &mut self,
        docs: &[&str],
        jsonl: bool,
        cut: bool,
        checked: &mut bool,
        out: &mut TokenWriter,
    ) -> Result<Result<(), Uncuttable>, DataError> {
        let mut pieces = Vec::new();
        for (doc, text) in docs.iter().enumerate() {
            let mut start = 0;
            let ends = if cut { cut_points(text.as_bytes(), self.piece_bytes) } else { vec![text.len()] };
            for end in ends {
                pieces.push(Piece { doc, range: start..end, starts_doc: start == 0 });
                start = end;
            }
        }
        let tokenizer = self.tokenizer;
        let encode = |p: &Piece| tokenizer.encode_with_lens(&docs[p.doc][p.range.clone()]);
        let encoded: Vec<Result<Encoded, DataError>> = match self.pool {
            Some(pool) => pool.install(|| pieces.par_iter().map(encode).collect()),
            None => pieces.par_iter().map(encode).collect(),
        };
        if !*checked {
            if let Some(k) = (1..pieces.len()).find(|&k| pieces[k].doc == pieces[k - 1].doc) {
                // The first cut, with a few KiB of text on each side (from and to neighbouring
                // cuts): tokenized across it and on each side of it.
                let (text, cut) = (docs[pieces[k].doc], pieces[k].range.start);
                let bytes = text.as_bytes();
                let from = last_cut(bytes, pieces[k - 1].range.start, cut.saturating_sub(GUARD_BYTES))
                    .unwrap_or(pieces[k - 1].range.start);
                let to = next_cut(bytes, cut + GUARD_BYTES)
                    .filter(|&t| t < pieces[k].range.end)
                    .unwrap_or(pieces[k].range.end);
                let across = tokenizer.encode(&text[from..to])?;
                let (left, right) = (tokenizer.encode(&text[from..cut])?, tokenizer.encode(&text[cut..to])?);
                if across.iter().ne(left.iter().chain(&right)) {
                    return Ok(Err(Uncuttable));
                }
                *checked = true;
            }
        }
        for (p, e) in pieces.iter().zip(encoded) {
            let e = e?;
            if jsonl && p.starts_doc {
                if let Some(eot) = self.header.eot.filter(|_| out.documents() > 0) {
                    out.push(eot, 0)?;
                }
                out.document();
            }
            if e.ids.is_empty() {
                out.carry(p.range.len() as u64);
            }
            for (&id, &len) in e.ids.iter().zip(&e.lens) {
                out.push(id, len)?;
            }
        }
        Ok(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{shared, Corpus, Sampler};

    fn tokenizer_path() -> PathBuf {
        shared("fixtures/llama/tokenizer.json")
    }

    fn load(source: &DataSource) -> Result<TokenData, DataError> {
        match Corpus::load(source, &mut |_, _| {})? {
            Corpus::Tokens(t) => Ok(t),
            Corpus::Bytes(_) => panic!("bytes"),
        }
    }

    fn ids(split: &Split<'_>) -> Vec<u32> {
        let mut v = Vec::new();
        split.extend_ids(0..split.len(), &mut v);
        v
    }

    /// GPT-2's byte ↔ character table, written out here from its definition (independent of the
    /// tokenizers crate): printable Latin-1 bytes map to themselves, the others to U+0100 on.
    fn gpt2_char_to_byte() -> std::collections::HashMap<char, u8> {
        let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
        let mut chars = printable.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !printable.contains(&b) {
                printable.push(b);
                chars.push(256 + n);
                n += 1;
            }
        }
        printable.iter().zip(&chars).map(|(&b, &c)| (char::from_u32(c).unwrap(), b as u8)).collect()
    }

    /// The raw bytes of `ids` by the byte-level table; the end-of-text separator is no text.
    fn raw_bytes(tok: &TextTokenizer, ids: &[u32], table: &std::collections::HashMap<char, u8>) -> Vec<u8> {
        ids.iter()
            .filter(|&&id| Some(id) != tok.eot_id())
            .flat_map(|&id| tok.inner().id_to_token(id).unwrap().chars().map(|c| table[&c]).collect::<Vec<_>>())
            .collect()
    }

    #[test]
    fn shakespeare_cut_into_pieces_gives_the_ids_of_the_whole_text() {
        let path = shared("data/tinyshakespeare.txt");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(cut_points(text.as_bytes(), PIECE_BYTES).len() > 10, "the text is really cut");
        let dir = tempfile::tempdir().unwrap();
        let mut calls = Vec::new();
        let src = DataSource { threads: 2, ..DataSource::tokenized(&path, tokenizer_path(), dir.path(), 0.1, 64) };
        let data = match Corpus::load(&src, &mut |d, t| calls.push((d, t))).unwrap() {
            Corpus::Tokens(t) => t,
            Corpus::Bytes(_) => unreachable!(),
        };
        assert!(data.built());
        assert_eq!(calls.first(), Some(&(0, text.len() as u64)));
        assert_eq!(calls.last(), Some(&(text.len() as u64, text.len() as u64)));
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0));
        let whole = data.tokenizer().encode(&text).unwrap();
        assert_eq!(ids(&data.all()), whole);
        assert_eq!(data.text_bytes(), text.len() as u64);
        assert_eq!(data.documents(), 1);
        assert_eq!(data.vocab_size(), 1024);
        let e = data.unigram_entropy_nats();
        assert!(e > 3.0 && e < 1024f64.ln(), "{e}");
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
    fn json_lines_documents_with_split_characters_cover_their_exact_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let docs = [
            "First Citizen:\nBefore we proceed any further, hear me speak.",
            "  ünïcödé ✓ — 日本語のテキスト, émigré\n\ttabs\n",
            "ROMEO:\nBut, soft! what light through yonder window breaks? ☃☃☃",
        ];
        let mut jsonl = String::new();
        for (i, d) in docs.iter().cycle().take(300).enumerate() {
            jsonl += &serde_json::json!({"id": i, "text": d}).to_string();
            jsonl += if i % 50 == 7 { "\n\n" } else { "\n" }; // blank lines are skipped
        }
        let path = dir.path().join("docs.jsonl");
        std::fs::write(&path, &jsonl).unwrap();
        let data = load(&DataSource::tokenized(&path, tokenizer_path(), dir.path().join("c"), 0.1, 32)).unwrap();
        let tok = data.tokenizer();
        assert_eq!(data.documents(), 300);
        let mut want = Vec::new();
        for (i, d) in docs.iter().cycle().take(300).enumerate() {
            if i > 0 {
                want.push(0);
            }
            want.extend(tok.encode(d).unwrap());
        }
        let all = data.all();
        assert_eq!(ids(&all), want);
        let text: Vec<u8> = docs.iter().cycle().take(300).flat_map(|d| d.bytes()).collect();
        assert_eq!(data.text_bytes(), text.len() as u64);
        // Every window: its targets' bytes (by GPT-2's byte table) are the text at the offset the
        // covered bytes before it give.
        let table = gpt2_char_to_byte();
        let mut s = Sampler::new(1);
        for _ in 0..200 {
            let start = rand::Rng::random_range(&mut s.rng, 0..all.len() - 33);
            let window: Vec<u32> = (start + 1..start + 33).map(|i| all.id(i)).collect();
            let raw = raw_bytes(tok, &window, &table);
            let covered = all.covered_bytes(start + 1..start + 33);
            assert_eq!(raw.len() as u64, covered);
            let at = all.covered_bytes(0..start + 1) as usize;
            assert_eq!(raw, text[at..at + raw.len()]);
        }
    }

    #[test]
    fn bad_json_lines_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        for (body, want) in [
            ("{\"text\": \"a\"}\n{\"txt\": \"b\"}\n", "line 2: no `text` field"),
            ("{\"text\": \"a\"}\n\n{\"text\": 3}\n", "line 3: `text` is not a string"),
            ("{\"text\": \"a\"}\nnot json\n", "line 2: not JSON"),
        ] {
            let path = dir.path().join("bad.jsonl");
            std::fs::write(&path, body).unwrap();
            let err =
                load(&DataSource::tokenized(&path, tokenizer_path(), dir.path(), 0.1, 8)).unwrap_err().to_string();
            assert!(err.contains("bad.jsonl") && err.contains(want) && err.contains("fix:"), "{err}");
        }
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

    #[test]
    fn a_tokenizer_that_may_not_be_cut_tokenizes_the_text_whole() {
        // Passes the structural check (a `Split` pre-tokenizer) but its regex keeps `a\nb`
        // together: the first cut (after `a\n`) changes the ids, the guard notices and starts over
        // uncut.
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "post_processor": null, "decoder": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "a\nb|a|b|c|\n| "}, "behavior": "Isolated", "invert": false}]},
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2, "c": 3, " ": 4, "\n": 5, "a\nb": 6},
                      "unk_token": "[UNK]"}
        }"#;
        let dir = tempfile::tempdir().unwrap();
        let tok_path = dir.path().join("ab.json");
        std::fs::write(&tok_path, json).unwrap();
        let tok = TextTokenizer::load(&tok_path).unwrap();
        assert!(tok.splits_at_newlines());
        let text = "a\nb c\n".repeat(40_000);
        assert!(!crate::data::tokenizer::is_cut(text.as_bytes(), PIECE_BYTES) && PIECE_BYTES % 6 == 4);
        let path = dir.path().join("ab.txt");
        std::fs::write(&path, &text).unwrap();
        let data = load(&DataSource::tokenized(&path, &tok_path, dir.path(), 0.1, 8)).unwrap();
        assert_eq!(ids(&data.all()), tok.encode(&text).unwrap());
        assert_eq!(data.all().len(), 160_000);
        assert_eq!(data.text_bytes(), text.len() as u64);
        // A word-level tokenizer is never cut (whitespace pre-tokenizer): offsets give the bytes.
        let words = dir.path().join("words.json");
        std::fs::write(&words, crate::data::tokenizer::tests::WORDS).unwrap();
        let text = "a b  cc\n".repeat(20_000);
        std::fs::write(&path, &text).unwrap();
        let data = load(&DataSource::tokenized(&path, &words, dir.path(), 0.1, 8)).unwrap();
        assert_eq!(data.all().len(), 60_000);
        // `a`, ` b`, `  cc`; the newline goes to the next line's `a`, the last one to the last `cc`.
        assert_eq!(data.all().covered_bytes(0..4), 9);
        assert_eq!(data.all().covered_bytes(59_999..60_000), 5);
        assert_eq!(data.text_bytes(), text.len() as u64);
    }

    #[test]
    fn small_blocks_long_lines_and_many_documents_give_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let shakespeare = std::fs::read_to_string(shared("data/tinyshakespeare.txt")).unwrap();
        // A line of 300 KB with no cut in it spans several 64 KiB blocks.
        let long_line = "word ".repeat(60_000);
        let text = format!("{}{long_line}\n{}", &shakespeare[..150_000], &shakespeare[150_000..400_000]);
        let path = dir.path().join("t.txt");
        std::fs::write(&path, &text).unwrap();
        let tok = || TextTokenizer::load(&tokenizer_path()).unwrap();
        let mut calls = 0;
        let src = DataSource::tokenized(&path, tokenizer_path(), dir.path().join("a"), 0.1, 8);
        let data =
            TokenData::load_in_blocks(&src, tok(), &dir.path().join("a"), &mut |_, _| calls += 1, (64 << 10, 4096))
                .unwrap();
        assert!(calls > 5, "{calls} progress calls");
        assert_eq!(ids(&data.all()), tok().encode(&text).unwrap());
        assert_eq!(data.text_bytes(), text.len() as u64);
        // JSON Lines over many blocks.
        let docs: Vec<&str> = shakespeare[..300_000].split("\n\n").collect();
        let jsonl: String = docs.iter().map(|d| serde_json::json!({ "text": d }).to_string() + "\n").collect();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, jsonl).unwrap();
        let src = DataSource::tokenized(&path, tokenizer_path(), dir.path().join("b"), 0.1, 8);
        let data =
            TokenData::load_in_blocks(&src, tok(), &dir.path().join("b"), &mut |_, _| {}, (16 << 10, 1024)).unwrap();
        let t = tok();
        let want: Vec<u32> = docs
            .iter()
            .filter(|d| !d.is_empty())
            .enumerate()
            .flat_map(|(i, d)| (i > 0).then_some(0).into_iter().chain(t.encode(d).unwrap()))
            .collect();
        assert_eq!(ids(&data.all()), want);
        assert_eq!(data.documents(), docs.iter().filter(|d| !d.is_empty()).count() as u64);
    }
}
