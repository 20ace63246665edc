//! The I/O engine seam of the NVMe store and its pread/pwrite engine.
//!
//! | concept | what it is |
//! |---|---|
//! | [`IoEngine`] | object-safe: takes an [`IoRequest`] (buffer by value) and calls its `done` with the buffer back |
//! | [`Segment`] | one 4 KiB-aligned piece of a request: file, file offset, buffer offset, length (bytes) |
//! | [`PsyncEngine`] | a few threads doing `pread`/`pwrite` (`FileExt::read_at/write_at`), one request per thread at a time |
//! | `UringEngine` | (in `uring.rs`) one thread owning an io_uring, up to `queue_depth` segments in flight |
//!
//! Ownership follows tokio-uring's `BufResult`: the engine owns the [`HostBuffer`] from submission
//! to completion and hands it back to `done` with the result, so the memory can never be freed
//! or reused while the kernel may still read or write it. foyer's `IoEngine` is the model for the
//! trait seam.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::EngineKind;
use crate::error::{Error, Result};
use crate::host::HostBuffer;

/// One preallocated store file. The file is removed from its directory when the last owner (the
/// store, its engine thread, a pending completion) drops it: the store is swap space.
#[derive(Debug)]
pub(crate) struct StoreFile {
    /// Where the file is.
    pub path: PathBuf,
    /// The open file (O_DIRECT when [`StoreFile::direct`]).
    pub file: File,
    /// Whether the file was opened with O_DIRECT.
    pub direct: bool,
}

impl Drop for StoreFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove NVMe store file");
        }
    }
}

/// Direction of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// File → buffer.
    Read,
    /// Buffer → file.
    Write,
}

/// One contiguous piece of a request. Offsets and length are multiples of 4 KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Index of the file in the engine's file list.
    pub file: usize,
    /// Byte offset in the file.
    pub file_offset: u64,
    /// Byte offset in the buffer's padded slice.
    pub buf_offset: usize,
    /// Bytes to move.
    pub len: usize,
}

/// What an engine hands back when a request is finished: the first error (if any) and the buffer.
pub(crate) struct Completion {
    /// `Ok` when every segment moved all its bytes; else the first [`Error::Io`].
    pub result: Result<()>,
    /// The request's buffer, now free for the caller.
    pub buf: HostBuffer,
}

/// Called once, on the engine's thread, when the kernel is done with every segment.
pub(crate) type DoneFn = Box<dyn FnOnce(Completion) + Send>;

/// A request: a buffer taken by value, the segments to move, and what to do when done.
pub(crate) struct IoRequest {
    /// Direction.
    pub op: Op,
    /// The buffer; segments address its [`HostBuffer::as_padded_slice`].
    pub buf: HostBuffer,
    /// Pieces, each within the buffer's padded slice and at most the store's block size.
    pub segments: Vec<Segment>,
    /// Completion callback; receives the buffer back.
    pub done: DoneFn,
}

impl IoRequest {
    /// Checks that every segment lies in the buffer's padded slice and names a known file; the
    /// io_uring engine relies on it for the soundness of the pointers it gives the kernel.
    pub(crate) fn check(&self, num_files: usize) -> Result<()> {
        let padded = self.buf.as_padded_slice().len();
        for s in &self.segments {
            let in_buf = s.buf_offset.checked_add(s.len).is_some_and(|end| end <= padded);
            if !in_buf || s.file >= num_files || s.len == 0 || u32::try_from(s.len).is_err() {
                return Err(Error::InvalidRequest(format!(
                    "I/O segment {s:?} does not fit a buffer of {padded} padded bytes and {num_files} files"
                )));
            }
        }
        Ok(())
    }
}

/// An I/O engine: moves the segments of requests between buffers and store files.
///
/// Object-safe so the store can hold `Box<dyn IoEngine>` chosen at run time (foyer's `IoEngine`).
/// Dropping an engine waits until every submitted request completed and its `done` ran.
pub(crate) trait IoEngine: Send + Sync {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;
    /// Queues `req`; returns at once. `req.done` is always called exactly once, with the buffer.
    fn submit(&self, req: IoRequest);
}

/// Builds the [`Error::Io`] of a failed piece.
pub(crate) fn io_error(file: &StoreFile, offset: u64, len: usize, source: io::Error) -> Error {
    Error::Io { path: file.path.clone(), offset, len: len as u64, source }
}

/// A pool of threads doing positional reads and writes, one request per thread at a time.
///
/// Runs of segments that are contiguous in the file and in the buffer are merged into one
/// call of up to `block_bytes × queue_depth` bytes, so that with O_DIRECT the kernel has about
/// `queue_depth` blocks of that request in flight (the block layer splits the call).
pub(crate) struct PsyncEngine {
    tx: Option<Sender<IoRequest>>,
    threads: Vec<JoinHandle<()>>,
}

impl PsyncEngine {
    /// Starts `threads` workers over `files`; `max_call_bytes` bounds one merged call.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when a thread cannot be spawned.
    pub(crate) fn new(files: std::sync::Arc<[StoreFile]>, threads: usize, max_call_bytes: usize) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<IoRequest>();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx: Receiver<IoRequest> = rx.clone();
            let files = files.clone();
            let h = std::thread::Builder::new()
                .name(format!("oogc-psync-{i}"))
                .spawn(move || {
                    for mut req in rx.iter() {
                        let result = req.check(files.len()).and_then(|()| run(&files, &mut req, max_call_bytes));
                        (req.done)(Completion { result, buf: req.buf });
                    }
                })
                .map_err(|e| Error::InvalidRequest(format!("cannot spawn a pread/pwrite thread: {e}")))?;
            handles.push(h);
        }
        Ok(Self { tx: Some(tx), threads: handles })
    }
}

/// Merges contiguous segments into runs of at most `max_call_bytes`.
fn merge(segments: &[Segment], max_call_bytes: usize) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::with_capacity(segments.len());
    for s in segments {
        if let Some(last) = out.last_mut() {
            if last.file == s.file
                && last.file_offset + last.len as u64 == s.file_offset
                && last.buf_offset + last.len == s.buf_offset
                && last.len + s.len <= max_call_bytes
            {
                last.len += s.len;
                continue;
            }
        }
        out.push(*s);
    }
    out
}

fn run(files: &[StoreFile], req: &mut IoRequest, max_call_bytes: usize) -> Result<()> {
    for seg in merge(&req.segments, max_call_bytes) {
        let file = &files[seg.file];
        let mut done = 0usize;
        while done < seg.len {
            let offset = seg.file_offset + done as u64;
            let range = seg.buf_offset + done..seg.buf_offset + seg.len;
            let r = match req.op {
                Op::Write => file.file.write_at(&req.buf.as_padded_slice()[range], offset),
                Op::Read => file.file.read_at(&mut req.buf.as_padded_mut_slice()[range], offset),
            };
            match r {
                Ok(0) => {
                    let kind =
                        if req.op == Op::Write { io::ErrorKind::WriteZero } else { io::ErrorKind::UnexpectedEof };
                    let e = io::Error::new(kind, "the file took no bytes (end of file or device full)");
                    return Err(io_error(file, offset, seg.len - done, e));
                }
                Ok(n) => done += n,
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) => {}
                Err(e) => return Err(io_error(file, offset, seg.len - done, e)),
            }
        }
    }
    Ok(())
}

impl IoEngine for PsyncEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Psync
    }

    fn submit(&self, req: IoRequest) {
        // The sender lives until drop, and workers only stop when it is gone: send cannot fail.
        if let Err(e) = self.tx.as_ref().expect("engine sender present until drop").send(req) {
            let req = e.into_inner();
            (req.done)(Completion { result: Err(Error::Device("pread/pwrite engine stopped".into())), buf: req.buf });
        }
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        self.tx.take();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_joins_only_contiguous_pieces_up_to_the_cap() {
        let s = |file, file_offset, buf_offset, len| Segment { file, file_offset, buf_offset, len };
        let segs = [s(0, 0, 0, 4096), s(0, 4096, 4096, 4096), s(1, 0, 8192, 4096), s(1, 8192, 12288, 4096)];
        assert_eq!(merge(&segs, 1 << 20), vec![s(0, 0, 0, 8192), s(1, 0, 8192, 4096), s(1, 8192, 12288, 4096)]);
        assert_eq!(merge(&segs[..2], 4096).len(), 2);
    }
}
