//! Building a token file: the text read in blocks, cut into pieces, tokenized on rayon's threads
//! and written in order ([`Builder`]; the [`super`] module docs: where a text may be cut, the
//! run-time guard, the bytes each token covers).

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::data::cache::{Header, TokenFile, TokenWriter};
use crate::data::tokenizer::{cut_points, last_cut, next_cut, Encoded, TextTokenizer};
use crate::data::{DataError, TextFormat};

/// Bytes of text on each side of the first cut that the run-time guard tokenizes.
const GUARD_BYTES: usize = 4 << 10;

/// A piece of a block to tokenize: `docs[doc][range]`.
struct Piece {
    doc: usize,
    range: std::ops::Range<usize>,
    /// First piece of a document (JSON Lines: an end-of-text separator goes before it, except
    /// before the first document).
    starts_doc: bool,
}

/// Tokenizes one text into a token file (made by [`super::TokenData::load`] when the cache has none).
pub(super) struct Builder<'a, 'p> {
    pub(super) tokenizer: &'a TextTokenizer,
    pub(super) path: &'a Path,
    pub(super) pool: Option<&'a rayon::ThreadPool>,
    pub(super) progress: &'p mut dyn FnMut(u64, u64),
    pub(super) header: Header,
    pub(super) block_bytes: usize,
    pub(super) piece_bytes: usize,
}

/// The first cut of a run changed the ids: start over without cutting.
struct Uncuttable;

impl Builder<'_, '_> {
    pub(super) fn build(&mut self, cache_path: &Path, format: TextFormat) -> Result<TokenFile, DataError> {
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
    use crate::data::tokens::tests::{ids, load, tokenizer_path};
    use crate::data::tokens::{TokenData, PIECE_BYTES};
    use crate::data::{shared, Corpus, DataSource, Sampler};

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
