//! The token file: a tokenized text, memory-mapped.
//!
//! All integers little-endian. `W` = 2 when the vocabulary fits in u16, else 4.
//!
//! | offset | bytes | what |
//! |---|---|---|
//! | 0 | 8 | magic `OOGCTOK\0` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | `W`, bytes per id |
//! | 16 | 4 | vocabulary size |
//! | 20 | 4 | end-of-text id between documents, `u32::MAX` when none |
//! | 24 | 8 | `n`, tokens |
//! | 32 | 8 | bytes of text the tokens cover (the sum of their lengths) |
//! | 40 | 8 | documents |
//! | 48 | 8 | `k`, overflow entries |
//! | 56 | 4 | input format (0 plain text, 1 JSON Lines) |
//! | 60 | 4 | crc32c of everything after the header |
//! | 64 | 32 | SHA-256 of the text file's bytes |
//! | 96 | 32 | the recipe: SHA-256 of the tokenizer.json's bytes, the input format, the file version |
//! | 128 | 4 | crc32c of bytes 0..128 |
//! | 132 | 28 | zero |
//! | 160 | `n·W` | ids |
//! | … | `n` | bytes of text each token covers, u8; 255 = look it up in the overflow table |
//! | … | `16·k` | overflow: (u64 token index, u64 bytes) for every token of ≥ 255 bytes, by index |
//!
//! A file is written beside its final name, fsynced, and renamed (then the directory fsynced): a
//! reader sees a whole file or none. One that is short, has another key, or fails a checksum
//! (torn by a crash on a file system that reorders, truncated, edited) is rebuilt.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::DataError;

pub(crate) const HEADER_BYTES: usize = 160;
const MAGIC: &[u8; 8] = b"OOGCTOK\0";
pub(crate) const VERSION: u32 = 1;
/// A length byte meaning "in the overflow table".
pub(crate) const LEN_OVERFLOW: u8 = u8::MAX;
const NO_EOT: u32 = u32::MAX;

/// The header of a token file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub id_width: usize,
    pub vocab_size: u32,
    pub eot: Option<u32>,
    pub n_tokens: u64,
    pub text_bytes: u64,
    pub documents: u64,
    pub n_overflow: u64,
    pub format: u32,
    pub body_crc: u32,
    pub data_sha256: [u8; 32],
    pub recipe_sha256: [u8; 32],
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(self.id_width as u32).to_le_bytes());
        h[16..20].copy_from_slice(&self.vocab_size.to_le_bytes());
        h[20..24].copy_from_slice(&self.eot.unwrap_or(NO_EOT).to_le_bytes());
        h[24..32].copy_from_slice(&self.n_tokens.to_le_bytes());
        h[32..40].copy_from_slice(&self.text_bytes.to_le_bytes());
        h[40..48].copy_from_slice(&self.documents.to_le_bytes());
        h[48..56].copy_from_slice(&self.n_overflow.to_le_bytes());
        h[56..60].copy_from_slice(&self.format.to_le_bytes());
        h[60..64].copy_from_slice(&self.body_crc.to_le_bytes());
        h[64..96].copy_from_slice(&self.data_sha256);
        h[96..128].copy_from_slice(&self.recipe_sha256);
        let crc = crc32c::crc32c(&h[..128]);
        h[128..132].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Parses a header, or says why it is not one.
    fn decode(h: &[u8]) -> Result<Self, String> {
        if h.len() < HEADER_BYTES {
            return Err(format!("{} bytes, shorter than the {HEADER_BYTES}-byte header", h.len()));
        }
        if &h[0..8] != MAGIC {
            return Err("not a token file (magic)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(128) != crc32c::crc32c(&h[..128]) {
            return Err("header checksum mismatch".into());
        }
        if u32_at(8) != VERSION {
            return Err(format!("format version {} (this build writes {VERSION})", u32_at(8)));
        }
        let id_width = u32_at(12) as usize;
        if id_width != 2 && id_width != 4 {
            return Err(format!("id width {id_width}"));
        }
        let eot = Some(u32_at(20)).filter(|&e| e != NO_EOT);
        Ok(Self {
            id_width,
            vocab_size: u32_at(16),
            eot,
            n_tokens: u64_at(24),
            text_bytes: u64_at(32),
            documents: u64_at(40),
            n_overflow: u64_at(48),
            format: u32_at(56),
            body_crc: u32_at(60),
            data_sha256: h[64..96].try_into().expect("32 bytes"),
            recipe_sha256: h[96..128].try_into().expect("32 bytes"),
        })
    }

    /// The file's length in bytes.
    pub fn file_bytes(&self) -> u64 {
        HEADER_BYTES as u64 + self.n_tokens * (self.id_width as u64 + 1) + 16 * self.n_overflow
    }
}

/// Bytes per id for a vocabulary of `vocab_size`.
pub(crate) fn id_width(vocab_size: usize) -> usize {
    if vocab_size <= 1 << 16 {
        2
    } else {
        4
    }
}

/// A checked, memory-mapped token file.
#[derive(Debug)]
pub(crate) struct TokenFile {
    pub header: Header,
    map: Mmap,
}

impl TokenFile {
    /// Opens `path` and checks it is whole and has the expected key: `Ok(None)` when it is
    /// missing, stale or torn (the reason is logged), so the caller rebuilds it.
    pub fn open(path: &Path, data_sha256: &[u8; 32], recipe_sha256: &[u8; 32]) -> Option<Self> {
        let file = File::open(path).ok()?;
        match Self::check(&file, data_sha256, recipe_sha256) {
            Ok(t) => Some(t),
            Err(reason) => {
                tracing::warn!(path = %path.display(), %reason, "data: token cache rejected, rebuilding it");
                None
            }
        }
    }

    fn check(file: &File, data_sha256: &[u8; 32], recipe_sha256: &[u8; 32]) -> Result<Self, String> {
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        let mut head = vec![0u8; HEADER_BYTES.min(len as usize)];
        (&*file).read_exact(&mut head).map_err(|e| e.to_string())?;
        let header = Header::decode(&head)?;
        if &header.data_sha256 != data_sha256 || &header.recipe_sha256 != recipe_sha256 {
            return Err("made from another text or tokenizer".into());
        }
        if header.file_bytes() != len {
            return Err(format!("{len} bytes, the header says {} (torn or truncated)", header.file_bytes()));
        }
        let map = map_read_only(file).map_err(|e| format!("cannot map it: {e}"))?;
        if crc32c::crc32c(&map[HEADER_BYTES..]) != header.body_crc {
            return Err("checksum mismatch (torn or corrupt)".into());
        }
        Ok(Self { header, map })
    }

    /// The ids, `n·W` bytes.
    pub fn ids(&self) -> &[u8] {
        let n = self.header.n_tokens as usize;
        &self.map[HEADER_BYTES..HEADER_BYTES + n * self.header.id_width]
    }

    /// The length bytes, `n`.
    pub fn lens(&self) -> &[u8] {
        let start = HEADER_BYTES + self.ids().len();
        &self.map[start..start + self.header.n_tokens as usize]
    }

    /// The overflow table, `16·k` bytes.
    pub fn overflow(&self) -> &[u8] {
        &self.map[HEADER_BYTES + self.ids().len() + self.lens().len()..]
    }
}

/// Maps `file` read-only.
///
/// The one `unsafe` of the `oogc` crate (fenced here, as ripgrep's `MmapChoice`): a mapped file
/// that another process truncates makes later reads fault (SIGBUS). Token files are written under
/// a temporary name and renamed into place, never written again; a rebuild renames a new file
/// over the name, which leaves this mapping on the old inode.
#[allow(unsafe_code)]
fn map_read_only(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the file is only ever replaced by rename, never modified or truncated in place
    // (module docs), so the mapped bytes do not change under the reader.
    unsafe { Mmap::map(file) }
}

/// Writes a token file under a temporary name beside `path`; [`TokenWriter::finish`] renames it.
/// Tokens arrive as (id, bytes of text covered); the last token is held back so bytes that no
/// later token claims can still be added to it.
pub(crate) struct TokenWriter {
    path: PathBuf,
    tmp: PathBuf,
    lens_tmp: PathBuf,
    ids: BufWriter<File>,
    lens: BufWriter<File>,
    overflow: Vec<(u64, u64)>,
    header: Header,
    crc: u32,
    held: Option<(u32, u64)>,
    carry: u64,
    done: bool,
}

impl TokenWriter {
    /// Creates the temporary files beside `path` (whose directory must exist).
    ///
    /// # Errors
    /// [`DataError::Cache`] when they cannot be created.
    pub fn create(path: &Path, header: Header) -> Result<Self, DataError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let nonce = format!(
            "{}.{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        );
        let tmp = dir.join(format!(".{name}.{nonce}.tmp"));
        let lens_tmp = dir.join(format!(".{name}.{nonce}.lens.tmp"));
        let open = |p: &Path| {
            File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(p)
                .map_err(|e| cache_err(dir, format!("cannot create {}: {e}", p.display())))
        };
        let mut ids = BufWriter::with_capacity(1 << 20, open(&tmp)?);
        let lens = BufWriter::with_capacity(1 << 20, open(&lens_tmp)?);
        ids.write_all(&[0u8; HEADER_BYTES]).map_err(|e| cache_err(dir, e.to_string()))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            lens_tmp,
            ids,
            lens,
            overflow: Vec::new(),
            header: Header { n_tokens: 0, text_bytes: 0, n_overflow: 0, body_crc: 0, ..header },
            crc: 0,
            held: None,
            carry: 0,
            done: false,
        })
    }

    fn io_err(&self, e: std::io::Error) -> DataError {
        cache_err(self.path.parent().unwrap_or(Path::new(".")), format!("writing {}: {e}", self.tmp.display()))
    }

    /// Appends a token covering `bytes` bytes of text (plus any carried bytes).
    pub fn push(&mut self, id: u32, bytes: u64) -> Result<(), DataError> {
        if let Some((id, bytes)) = self.held.take() {
            self.emit(id, bytes)?;
        }
        self.held = Some((id, bytes + std::mem::take(&mut self.carry)));
        Ok(())
    }

    /// Bytes of text no token covered yet: they go to the next token, or to the last one.
    pub fn carry(&mut self, bytes: u64) {
        self.carry += bytes;
    }

    /// Counts a document.
    pub fn document(&mut self) {
        self.header.documents += 1;
    }

    /// Documents counted so far.
    pub fn documents(&self) -> u64 {
        self.header.documents
    }

    /// Tokens pushed so far.
    pub fn len(&self) -> u64 {
        self.header.n_tokens + self.held.is_some() as u64
    }

    fn emit(&mut self, id: u32, bytes: u64) -> Result<(), DataError> {
        let idb = id.to_le_bytes();
        let idb = &idb[..self.header.id_width];
        self.crc = crc32c::crc32c_append(self.crc, idb);
        let len = if bytes >= LEN_OVERFLOW as u64 {
            self.overflow.push((self.header.n_tokens, bytes));
            LEN_OVERFLOW
        } else {
            bytes as u8
        };
        let r = self.ids.write_all(idb).and_then(|_| self.lens.write_all(&[len]));
        r.map_err(|e| self.io_err(e))?;
        self.header.n_tokens += 1;
        self.header.text_bytes += bytes;
        Ok(())
    }

    /// Writes the lengths, the overflow table and the header, fsyncs and renames the file into
    /// place; returns it opened.
    ///
    /// # Errors
    /// [`DataError::Cache`] on any I/O error (the temporary files are removed).
    pub fn finish(mut self) -> Result<TokenFile, DataError> {
        if let Some((id, bytes)) = self.held.take() {
            let carry = std::mem::take(&mut self.carry);
            self.emit(id, bytes + carry)?;
        }
        let r = self.finish_io();
        let r = r.map_err(|e| self.io_err(e));
        self.done = true;
        let _ = std::fs::remove_file(&self.lens_tmp);
        if r.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        let header = r?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        TokenFile::open(&self.path, &header.data_sha256, &header.recipe_sha256)
            .ok_or_else(|| cache_err(dir, format!("{} does not read back as written", self.path.display())))
    }

    fn finish_io(&mut self) -> std::io::Result<Header> {
        self.lens.flush()?;
        let mut lens = self.lens.get_ref().try_clone()?;
        lens.seek(SeekFrom::Start(0))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = lens.read(&mut buf)?;
            if n == 0 {
                break;
            }
            self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
            self.ids.write_all(&buf[..n])?;
        }
        for &(index, bytes) in &self.overflow {
            let mut e = [0u8; 16];
            e[..8].copy_from_slice(&index.to_le_bytes());
            e[8..].copy_from_slice(&bytes.to_le_bytes());
            self.crc = crc32c::crc32c_append(self.crc, &e);
            self.ids.write_all(&e)?;
        }
        self.header.n_overflow = self.overflow.len() as u64;
        self.header.body_crc = self.crc;
        self.ids.flush()?;
        let mut file = self.ids.get_ref();
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&self.header.encode())?;
        file.sync_all()?;
        std::fs::rename(&self.tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            // Make the rename durable; some file systems refuse to fsync a directory: not fatal.
            let _ = File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(self.header.clone())
    }
}

impl Drop for TokenWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
            let _ = std::fs::remove_file(&self.lens_tmp);
        }
    }
}

pub(crate) fn cache_err(dir: &Path, reason: String) -> DataError {
    DataError::Cache { dir: dir.to_path_buf(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Split;

    fn header(vocab_size: usize) -> Header {
        Header {
            id_width: id_width(vocab_size),
            vocab_size: vocab_size as u32,
            eot: None,
            n_tokens: 0,
            text_bytes: 0,
            documents: 0,
            n_overflow: 0,
            format: 0,
            body_crc: 0,
            data_sha256: [1; 32],
            recipe_sha256: [2; 32],
        }
    }

    fn split(f: &TokenFile) -> Split<'_> {
        Split::tokens(f.ids(), f.header.id_width, f.lens(), 0, f.overflow())
    }

    #[test]
    fn long_tokens_go_to_the_overflow_table_and_wide_vocabularies_to_u32() {
        let dir = tempfile::tempdir().unwrap();
        for (vocab, width) in [(1024, 2), (1 << 16, 2), ((1 << 16) + 1, 4), (150_000, 4)] {
            let path = dir.path().join(format!("v{vocab}.tokens"));
            let mut w = TokenWriter::create(&path, header(vocab)).unwrap();
            let toks: [(u32, u64); 7] =
                [(1, 1), (vocab as u32 - 1, 300), (2, 0), (3, 70_000), (4, 255), (5, 254), (6, 3)];
            for &(id, len) in &toks {
                w.push(id, len).unwrap();
            }
            w.carry(10); // no later token: goes to the last one
            let f = w.finish().unwrap();
            assert_eq!(f.header.id_width, width);
            assert_eq!(f.header.n_tokens, 7);
            assert_eq!(f.header.n_overflow, 3);
            assert_eq!(f.header.text_bytes, 1 + 300 + 70_000 + 255 + 254 + 13);
            let s = split(&f);
            let ids: Vec<u32> = (0..7).map(|i| s.id(i)).collect();
            assert_eq!(ids, toks.map(|t| t.0));
            let lens: Vec<u64> = (0..7).map(|i| s.covered_bytes(i..i + 1)).collect();
            assert_eq!(lens, [1, 300, 0, 70_000, 255, 254, 13]);
            assert_eq!(s.slice(2..5).covered_bytes(1..3), 70_255);
            assert_eq!(s.text_bytes(), f.header.text_bytes);
            // No temporary file is left beside it.
            let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert!(names.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")), "{names:?}");
        }
    }

    #[test]
    fn torn_stale_or_corrupt_files_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tokens");
        let mut w = TokenWriter::create(&path, header(1024)).unwrap();
        for i in 0..1000 {
            w.push(i % 1024, 2).unwrap();
        }
        w.finish().unwrap();
        let whole = std::fs::read(&path).unwrap();
        assert!(TokenFile::open(&path, &[1; 32], &[2; 32]).is_some());
        assert!(TokenFile::open(&path, &[9; 32], &[2; 32]).is_none(), "another text");
        assert!(TokenFile::open(&path, &[1; 32], &[9; 32]).is_none(), "another tokenizer");
        for bad in [whole[..whole.len() - 1].to_vec(), whole[..100].to_vec(), Vec::new(), {
            let mut b = whole.clone();
            b[HEADER_BYTES + 7] ^= 1;
            b
        }] {
            std::fs::write(&path, &bad).unwrap();
            assert!(TokenFile::open(&path, &[1; 32], &[2; 32]).is_none(), "{} bytes", bad.len());
        }
        assert!(TokenFile::open(&dir.path().join("missing"), &[1; 32], &[2; 32]).is_none());
    }
}
