//! The one place this crate maps a file into memory (`memmap2::Mmap::map` is `unsafe`): the
//! safetensors shards of a Hugging Face checkpoint, read-only, for the duration of one header
//! parse or one unit's copy ([`super::HfCheckpoint`]). This module is on the fenced-unsafe list.
#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::{Error, Result};

/// Maps all of `file` (opened read-only from `path`) read-only.
///
/// # Errors
/// [`Error::Io`] naming `path` when the mapping fails.
pub(super) fn map_read_only(file: &File, path: &Path) -> Result<Mmap> {
    // SAFETY: `Mmap::map` is unsafe because the mapped bytes may change (or, if the file is
    // truncated, fault with SIGBUS) under the process while the map lives. The file was opened
    // read-only by this crate; the map is created for one header parse or one unit's copy and
    // dropped right after, never handed out; the map is only read through `&[u8]`, whose
    // contents the safetensors parser and our copies check (lengths, offsets) before use. A
    // checkpoint is an immutable input: the caller must not truncate or rewrite the shard files
    // while a read is in progress (as with transformers' own `safe_open`, which maps them too).
    unsafe { Mmap::map(file) }.map_err(|source| Error::Io { path: path.to_path_buf(), source })
}
