//! A Hugging Face `tokenizer.json` loaded through the `tokenizers` crate, with what the token
//! cache needs beside the ids: the SHA-256 of the file (the cache key), the end-of-text token that
//! separates documents, whether text may be cut at newlines and tokenized in parallel without
//! changing the ids, and how many bytes of text each token covers.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::DataError;

/// Contents of special tokens taken as the end-of-text separator, in order of preference
/// (GPT-2 and most byte-level BPEs, Llama 3, SentencePiece models, Gemma).
const EOT_CANDIDATES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// A loaded `tokenizer.json`.
///
/// Encoding never adds special tokens (no BOS/EOS from the post-processor) and ignores the file's
/// truncation and padding settings: the training text is one long stream of ids.
pub struct TextTokenizer {
    path: PathBuf,
    inner: Box<tokenizers::Tokenizer>,
    sha256: [u8; 32],
    vocab_size: usize,
    eot: Option<u32>,
    splits_at_newlines: bool,
    /// Bytes of text each id stands for, when the tokenizer is byte-level (every character of a
    /// vocabulary entry is one byte; special tokens are their UTF-8 content); `None` otherwise.
    id_bytes: Option<Vec<u32>>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("eot", &self.eot)
            .field("splits_at_newlines", &self.splits_at_newlines)
            .field("byte_level", &self.id_bytes.is_some())
            .finish()
    }
}

/// Token ids of a piece of text and the bytes of that text each covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Bytes of the text each token covers; they sum to the text's length, unless `ids` is empty.
    pub lens: Vec<u64>,
}

impl TextTokenizer {
    /// Reads and parses `path`.
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] when the file is missing, unreadable or not a `tokenizer.json`
    /// the `tokenizers` crate can parse.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|e| tokenizer_err(path, format!("cannot read it: {e}")))?;
        Self::from_bytes(path, &bytes)
    }

    /// As [`TextTokenizer::load`], from the file's bytes (`path` names them in errors).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`].
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, DataError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| tokenizer_err(path, format!("not a tokenizer.json the tokenizers crate can parse: {e}")))?;
        let json: Value = serde_json::from_slice(bytes).map_err(|e| tokenizer_err(path, e.to_string()))?;
        if json.pointer("/model/dropout").and_then(Value::as_f64).is_some_and(|d| d > 0.0) {
            return Err(tokenizer_err(
                path,
                "its BPE model has dropout, so the same text would not always give the same ids; \
                 set \"dropout\": null in the file"
                    .into(),
            ));
        }
        inner.with_truncation(None).map_err(|e| tokenizer_err(path, e.to_string()))?;
        inner.with_padding(None);
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0).max(inner.get_vocab_size(true));
        let added = inner.get_added_tokens_decoder();
        let eot = EOT_CANDIDATES
            .iter()
            .find_map(|c| added.iter().find(|(_, t)| t.special && t.content == *c).map(|(&id, _)| id));
        let splits_at_newlines = splits_at_newlines(&json);
        let id_bytes = byte_level(&json).then(|| {
            (0..vocab_size as u32)
                .map(|id| match added.get(&id) {
                    Some(t) => t.content.len() as u32,
                    None => inner.id_to_token(id).map_or(0, |s| s.chars().count() as u32),
                })
                .collect()
        });
        Ok(Self {
            path: path.to_path_buf(),
            inner: Box::new(inner),
            sha256: Sha256::digest(bytes).into(),
            vocab_size,
            eot,
            splits_at_newlines,
            id_bytes,
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// SHA-256 of the file's bytes.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }

    /// One more than the largest id (added tokens included): the model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The special token that separates documents of a JSON Lines text, if the tokenizer has one
    /// of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` (in that order of preference).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// Whether text may be cut at a newline between two printable ASCII characters and its
    /// pieces tokenized apart (in parallel) with the same ids as the whole: true for a regex
    /// pre-tokenizer that never joins a newline to what follows it (GPT-2's byte-level, Llama 3's
    /// and Qwen's `Split` + byte-level), no normalizer other than a Unicode normal form, and no
    /// added token that strips whitespace around it. See [`super::TokenData`] for why.
    pub fn splits_at_newlines(&self) -> bool {
        self.splits_at_newlines
    }

    /// Whether each token's bytes come from the vocabulary (byte-level BPE) rather than from the
    /// tokenizer's offsets.
    pub fn is_byte_level(&self) -> bool {
        self.id_bytes.is_some()
    }

    /// The `tokenizers` crate's tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`, no special tokens added.
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] when the tokenizer fails (an id missing from the vocabulary).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| self.encode_err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens kept; invalid UTF-8 replaced by U+FFFD).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] when the decoder fails.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner.decode(ids, false).map_err(|e| self.encode_err(e))
    }

    /// Ids of `text` and the bytes each covers (module docs of [`super::TokenData`]): from the
    /// vocabulary for a byte-level tokenizer when they add up to the text's length, else from the
    /// offsets — each byte goes to the first token whose span ends at or after it, bytes after the
    /// last token's span to the last token.
    pub(crate) fn encode_with_lens(&self, text: &str) -> Result<Encoded, DataError> {
        if let Some(table) = &self.id_bytes {
            let enc = self.inner.encode_fast(text, false).map_err(|e| self.encode_err(e))?;
            let ids = enc.get_ids().to_vec();
            let lens: Vec<u64> = ids.iter().map(|&id| table.get(id as usize).copied().unwrap_or(0) as u64).collect();
            if lens.iter().sum::<u64>() == text.len() as u64 || ids.is_empty() {
                return Ok(Encoded { ids, lens });
            }
        }
        let enc = self.inner.encode(text, false).map_err(|e| self.encode_err(e))?;
        let ids = enc.get_ids().to_vec();
        let mut lens = Vec::with_capacity(ids.len());
        let mut covered = 0usize;
        for &(_, end) in enc.get_offsets() {
            let end = end.clamp(covered, text.len());
            lens.push((end - covered) as u64);
            covered = end;
        }
        if let Some(last) = lens.last_mut() {
            *last += (text.len() - covered) as u64;
        }
        Ok(Encoded { ids, lens })
    }

    fn encode_err(&self, e: tokenizers::Error) -> DataError {
        tokenizer_err(&self.path, format!("tokenization failed: {e}"))
    }
}

fn tokenizer_err(path: &Path, reason: String) -> DataError {
    DataError::Tokenizer { path: path.to_path_buf(), reason }
}

/// Whether the decoder is byte-level (GPT-2, Llama 3, Qwen): every character of a vocabulary
/// entry stands for one byte.
fn byte_level(json: &Value) -> bool {
    let ty = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_owned);
    match json.get("decoder") {
        Some(d) if ty(d).as_deref() == Some("ByteLevel") => true,
        Some(d) if ty(d).as_deref() == Some("Sequence") => d
            .get("decoders")
            .and_then(Value::as_array)
            .is_some_and(|ds| ds.len() == 1 && ty(&ds[0]).as_deref() == Some("ByteLevel")),
        _ => false,
    }
}

/// The structural half of [`TextTokenizer::splits_at_newlines`] (the builder also checks the first
/// cut of each run against tokenizing across it).
fn splits_at_newlines(json: &Value) -> bool {
    let ty = |v: &Value| v.get("type").and_then(Value::as_str).unwrap_or("").to_owned();
    let normalizer_ok = match json.get("normalizer") {
        None | Some(Value::Null) => true,
        Some(n) => matches!(ty(n).as_str(), "NFC" | "NFD" | "NFKC" | "NFKD"),
    };
    let byte_level_ok =
        |p: &Value| ty(p) == "ByteLevel" && !p.get("add_prefix_space").and_then(Value::as_bool).unwrap_or(true);
    let uses_regex = |p: &Value| p.get("use_regex").and_then(Value::as_bool).unwrap_or(true);
    let pre_ok = match json.get("pre_tokenizer") {
        Some(p) if byte_level_ok(p) => uses_regex(p),
        Some(p) if ty(p) == "Sequence" => {
            let parts = p.get("pretokenizers").and_then(Value::as_array).cloned().unwrap_or_default();
            parts.iter().any(|q| ty(q) == "Split" || (byte_level_ok(q) && uses_regex(q)))
                && parts.iter().all(|q| matches!(ty(q).as_str(), "Split" | "Digits") || byte_level_ok(q))
        }
        _ => false,
    };
    let added_ok = json.get("added_tokens").and_then(Value::as_array).is_none_or(|ts| {
        ts.iter().all(|t| {
            !t.get("lstrip").and_then(Value::as_bool).unwrap_or(false)
                && !t.get("rstrip").and_then(Value::as_bool).unwrap_or(false)
        })
    });
    normalizer_ok && pre_ok && added_ok
}

/// Whether `text` may be cut at `p` for [`TextTokenizer::splits_at_newlines`] tokenizers: just
/// after a newline that has a printable ASCII character (not a space) on each side.
pub(crate) fn is_cut(text: &[u8], p: usize) -> bool {
    p >= 2 && p < text.len() && text[p - 1] == b'\n' && text[p].is_ascii_graphic() && text[p - 2].is_ascii_graphic()
}

/// The last cut ([`is_cut`]) in `lo + 1 ..= hi`.
pub(crate) fn last_cut(text: &[u8], lo: usize, hi: usize) -> Option<usize> {
    (lo + 1..=hi.min(text.len())).rev().find(|&p| is_cut(text, p))
}

/// The first cut ([`is_cut`]) at or after `from`.
pub(crate) fn next_cut(text: &[u8], from: usize) -> Option<usize> {
    (from..text.len()).find(|&p| is_cut(text, p))
}

/// Cuts `text` into pieces of about `target` bytes at [`is_cut`] positions: the pieces' end
/// offsets, the last one `text.len()`. A piece is longer only where no cut is near.
pub(crate) fn cut_points(text: &[u8], target: usize) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut start = 0;
    while text.len() - start > target + target / 2 {
        match last_cut(text, start, start + target).or_else(|| next_cut(text, start + target + 1)) {
            Some(p) => {
                ends.push(p);
                start = p;
            }
            None => break,
        }
    }
    ends.push(text.len());
    ends
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::data::shared;

    fn fixture() -> TextTokenizer {
        TextTokenizer::load(&shared("fixtures/llama/tokenizer.json")).unwrap()
    }

    /// A word-level tokenizer (not byte-level, whitespace pre-tokenizer): offsets give the bytes.
    pub(crate) const WORDS: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2, "cc": 3}, "unk_token": "[UNK]"}
    }"#;

    #[test]
    fn fixture_ids_match_transformers() {
        let tok = fixture();
        assert_eq!(tok.vocab_size(), 1024);
        assert_eq!(tok.eot_id(), Some(0));
        assert!(tok.splits_at_newlines() && tok.is_byte_level());
        let cases: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(shared("fixtures/llama/tokenizer_check.json")).unwrap()).unwrap();
        assert!(cases.len() >= 4);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
            assert_eq!(tok.decode(&want).unwrap(), text);
            // Each token covers its own bytes, which add up to the text's.
            let e = tok.encode_with_lens(text).unwrap();
            assert_eq!(e.ids, want);
            assert_eq!(e.lens.iter().sum::<u64>(), text.len() as u64, "{text:?}");
        }
    }

    #[test]
    fn split_characters_share_their_bytes_between_tokens() {
        let tok = fixture();
        // Each of these characters becomes one token per byte with this vocabulary.
        let e = tok.encode_with_lens("ü✓").unwrap();
        assert_eq!(e.lens.iter().sum::<u64>(), 5);
        assert!(e.lens.iter().all(|&l| l == 1), "{e:?}");
    }

    #[test]
    fn offsets_give_the_bytes_of_other_tokenizers() {
        let tok = TextTokenizer::from_bytes(Path::new("words.json"), WORDS.as_bytes()).unwrap();
        assert!(!tok.is_byte_level() && !tok.splits_at_newlines());
        assert_eq!(tok.eot_id(), None);
        assert_eq!(tok.vocab_size(), 4);
        // "  a  b cc  ": the spaces before a word go to it, the trailing ones to the last token.
        let e = tok.encode_with_lens("  a  b cc  ").unwrap();
        assert_eq!(e.ids, [1, 2, 3]);
        assert_eq!(e.lens, [3, 3, 5]);
        assert_eq!(tok.encode_with_lens("   ").unwrap(), Encoded::default());
    }

    #[test]
    fn a_tokenizer_that_does_not_parse_is_a_clear_error() {
        let err = TextTokenizer::from_bytes(Path::new("/x/tokenizer.json"), b"{\"model\": 3}").unwrap_err().to_string();
        assert!(err.contains("/x/tokenizer.json") && err.contains("fix:"), "{err}");
        let err = TextTokenizer::load(Path::new("/nonexistent/tokenizer.json")).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/tokenizer.json") && err.contains("cannot read"), "{err}");
        let json = std::fs::read_to_string(shared("fixtures/llama/tokenizer.json")).unwrap();
        let dropout = json.replacen("\"dropout\": null", "\"dropout\": 0.1", 1);
        assert_ne!(dropout, json);
        let err = TextTokenizer::from_bytes(Path::new("d.json"), dropout.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("d.json") && err.contains("dropout"), "{err}");
    }

    #[test]
    fn cuts_only_after_a_lone_newline_between_printable_characters() {
        let t = b"ab\ncd\n\nef\n gh\nij";
        let cuts: Vec<usize> = (0..=t.len()).filter(|&p| is_cut(t, p)).collect();
        assert_eq!(cuts, [3, 14]);
        assert_eq!(last_cut(t, 0, t.len()), Some(14));
        assert_eq!(last_cut(t, 3, 13), None);
        let long: Vec<u8> = b"word word\nline\n".repeat(1000);
        let ends = cut_points(&long, 1000);
        assert_eq!(*ends.last().unwrap(), long.len());
        assert!(ends.len() > 10);
        assert!(ends[..ends.len() - 1].iter().all(|&p| is_cut(&long, p)));
        assert!(ends.windows(2).all(|w| w[1] - w[0] <= 1500 + 16));
        assert_eq!(cut_points(b"no newline at all", 4), [17]);
    }
}
