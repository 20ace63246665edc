//! The io_uring engine: one thread owns the ring and keeps up to `queue_depth` segments in flight.
//!
//! | concept | what it is |
//! |---|---|
//! | ring thread | owns the `IoUring`, the requests in flight and their buffers; the only place SQEs are pushed |
//! | slot | one SQE in flight (`user_data` = slot index): request, segment, bytes done so far |
//! | active request | a submitted request: its buffer, the next segment to issue, the SQEs it has in flight |
//!
//! Buffer ownership follows tokio-uring's `BufResult`: a request's [`HostBuffer`] is moved into
//! the ring thread and only handed back (through `done`) once no SQE of it is in flight. If the
//! caller dropped its handle the buffer is still kept until the kernel completed (foyer once
//! freed buffers on cancellation while the kernel still wrote to them; this engine has no
//! cancellation). Short transfers are resubmitted for the rest; `EINTR`/`EAGAIN` are retried.
//!
//! This is the only file of the crate with `unsafe`: pushing an SQE (`io-uring`'s `push`
//! contract: the buffer and fd must stay valid until the completion is reaped).
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use io_uring::{opcode, types, IoUring};

use super::engine::{io_error, Completion, DoneFn, IoEngine, IoRequest, Op, Segment, StoreFile};
use super::EngineKind;
use crate::error::{Error, Result};
use crate::host::HostBuffer;

/// Checks that io_uring works here: builds a ring and completes a NOP.
///
/// # Errors
/// The reason, as text, when the kernel refuses (old kernel, seccomp, `io_uring_disabled`).
pub(crate) fn probe() -> std::result::Result<(), String> {
    let mut ring = IoUring::new(2).map_err(|e| format!("io_uring_setup failed: {e}"))?;
    let nop = opcode::Nop::new().build().user_data(7);
    // SAFETY: a NOP references no buffer or file descriptor.
    unsafe { ring.submission().push(&nop) }.map_err(|e| format!("cannot queue a NOP: {e}"))?;
    ring.submit_and_wait(1).map_err(|e| format!("io_uring_enter failed: {e}"))?;
    let cqe = ring.completion().next().ok_or("the NOP did not complete")?;
    if cqe.result() < 0 {
        return Err(format!("the NOP failed: {}", io::Error::from_raw_os_error(-cqe.result())));
    }
    Ok(())
}

/// The io_uring engine (see the module docs).
pub(crate) struct UringEngine {
    tx: Option<Sender<IoRequest>>,
    thread: Option<JoinHandle<()>>,
}

impl UringEngine {
    /// Builds a ring of `queue_depth` entries over `files` and starts its thread.
    ///
    /// # Errors
    /// [`Error::UringUnavailable`] when the ring cannot be built or the thread spawned.
    pub(crate) fn new(files: Arc<[StoreFile]>, queue_depth: u32) -> Result<Self> {
        let ring = IoUring::new(queue_depth.max(1))
            .map_err(|e| Error::UringUnavailable { reason: format!("io_uring_setup({queue_depth}) failed: {e}") })?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("oogc-uring".into())
            .spawn(move || RingLoop::new(ring, files, queue_depth.max(1) as usize).run(&rx))
            .map_err(|e| Error::UringUnavailable { reason: format!("cannot spawn the ring thread: {e}") })?;
        Ok(Self { tx: Some(tx), thread: Some(thread) })
    }
}

impl IoEngine for UringEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }

    fn submit(&self, req: IoRequest) {
        if let Err(e) = self.tx.as_ref().expect("engine sender present until drop").send(req) {
            let req = e.into_inner();
            (req.done)(Completion { result: Err(Error::Device("io_uring engine stopped".into())), buf: req.buf });
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The thread finishes every request in flight, then sees the channel closed and exits.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Active {
    op: Op,
    buf: HostBuffer,
    /// Start of the buffer's padded slice; valid while `buf` is owned here (its memory is a
    /// separate allocation that does not move with the `HostBuffer`).
    base: *mut u8,
    segments: Vec<Segment>,
    next: usize,
    in_flight: usize,
    error: Option<Error>,
    done: DoneFn,
}

#[derive(Clone, Copy)]
struct Slot {
    req: usize,
    seg: Segment,
    moved: usize,
}

struct RingLoop {
    ring: IoUring,
    files: Arc<[StoreFile]>,
    active: Vec<Option<Active>>,
    free_active: Vec<usize>,
    /// Requests with segments left to issue, oldest first.
    issuing: VecDeque<usize>,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<usize>,
    /// Slots to resubmit (short transfer, EINTR, EAGAIN).
    retry: VecDeque<usize>,
    in_flight: usize,
}

impl RingLoop {
    fn new(ring: IoUring, files: Arc<[StoreFile]>, queue_depth: usize) -> Self {
        Self {
            ring,
            files,
            active: Vec::new(),
            free_active: Vec::new(),
            issuing: VecDeque::new(),
            slots: vec![None; queue_depth],
            free_slots: (0..queue_depth).rev().collect(),
            retry: VecDeque::new(),
            in_flight: 0,
        }
    }

    fn run(mut self, rx: &Receiver<IoRequest>) {
        loop {
            if self.active.iter().all(Option::is_none) {
                match rx.recv() {
                    Ok(req) => self.accept(req),
                    Err(_) => return, // store dropped and nothing in flight
                }
            }
            while let Ok(req) = rx.try_recv() {
                self.accept(req);
            }
            self.fill();
            if self.in_flight == 0 {
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => {
                    // Nothing may be freed while SQEs are in flight: log, back off, and go on reaping.
                    tracing::error!(error = %e, "io_uring_enter failed; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.reap();
        }
    }

    fn accept(&mut self, mut req: IoRequest) {
        if let Err(e) = req.check(self.files.len()) {
            (req.done)(Completion { result: Err(e), buf: req.buf });
            return;
        }
        if req.segments.is_empty() {
            (req.done)(Completion { result: Ok(()), buf: req.buf });
            return;
        }
        let base = match req.op {
            Op::Write => req.buf.as_padded_slice().as_ptr().cast_mut(),
            Op::Read => req.buf.as_padded_mut_slice().as_mut_ptr(),
        };
        let a = Active {
            op: req.op,
            buf: req.buf,
            base,
            segments: req.segments,
            next: 0,
            in_flight: 0,
            error: None,
            done: req.done,
        };
        let idx = match self.free_active.pop() {
            Some(i) => {
                self.active[i] = Some(a);
                i
            }
            None => {
                self.active.push(Some(a));
                self.active.len() - 1
            }
        };
        self.issuing.push_back(idx);
    }

    /// Pushes retries, then new segments, until `queue_depth` SQEs are in flight.
    fn fill(&mut self) {
        while let Some(slot) = self.retry.pop_front() {
            self.push(slot);
        }
        while let Some(&req) = self.issuing.front() {
            let a = self.active[req].as_mut().expect("issuing request is active");
            if a.error.is_some() || a.next == a.segments.len() {
                self.issuing.pop_front();
                continue;
            }
            let Some(slot) = self.free_slots.pop() else { break };
            let seg = a.segments[a.next];
            a.next += 1;
            a.in_flight += 1;
            self.slots[slot] = Some(Slot { req, seg, moved: 0 });
            self.in_flight += 1;
            self.push(slot);
        }
    }

    fn push(&mut self, slot: usize) {
        let s = self.slots[slot].expect("slot in use");
        let a = self.active[s.req].as_ref().expect("slot's request is active");
        let fd = types::Fd(self.files[s.seg.file].file.as_raw_fd());
        let offset = s.seg.file_offset + s.moved as u64;
        let len = (s.seg.len - s.moved) as u32; // checked to fit u32 in `IoRequest::check`
                                                // SAFETY: `IoRequest::check` proved buf_offset + len <= the padded slice's length, so the
                                                // pointer stays inside the buffer's allocation.
        let ptr = unsafe { a.base.add(s.seg.buf_offset + s.moved) };
        let entry = match a.op {
            Op::Write => opcode::Write::new(fd, ptr, len).offset(offset).build(),
            Op::Read => opcode::Read::new(fd, ptr, len).offset(offset).build(),
        }
        .user_data(slot as u64);
        loop {
            // SAFETY: the buffer behind `ptr` is owned by `self.active[s.req]` and is neither read,
            // written nor dropped by us until this slot's CQE is reaped (the request completes only
            // when `in_flight == 0`, and a panic leaks the buffers, see `Drop`); the fd belongs to
            // `self.files`, which this thread keeps alive for the ring's whole life.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                return;
            }
            // The SQ is full (cannot happen with in_flight <= entries, but be safe): flush it.
            if let Err(e) = self.ring.submit() {
                tracing::error!(error = %e, "io_uring submit failed while the SQ was full; retrying");
            }
        }
    }

    fn reap(&mut self) {
        let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (ud, res) in cqes {
            let slot = ud as usize;
            let mut s = self.slots[slot].expect("completion for a slot in use");
            if res == -libc::EINTR || res == -libc::EAGAIN {
                self.retry.push_back(slot);
                continue;
            }
            let err = if res < 0 {
                Some(io::Error::from_raw_os_error(-res))
            } else if res == 0 {
                let a = self.active[s.req].as_ref().expect("active");
                let kind = if a.op == Op::Write { io::ErrorKind::WriteZero } else { io::ErrorKind::UnexpectedEof };
                Some(io::Error::new(kind, "the file took no bytes (end of file or device full)"))
            } else {
                s.moved += res as usize;
                if s.moved < s.seg.len {
                    self.slots[slot] = Some(s);
                    self.retry.push_back(slot); // short transfer: submit the rest
                    continue;
                }
                None
            };
            self.slots[slot] = None;
            self.free_slots.push(slot);
            self.in_flight -= 1;
            let a = self.active[s.req].as_mut().expect("active");
            a.in_flight -= 1;
            if let Some(e) = err {
                if a.error.is_none() {
                    let file = &self.files[s.seg.file];
                    a.error = Some(io_error(file, s.seg.file_offset + s.moved as u64, s.seg.len - s.moved, e));
                }
            }
            if a.in_flight == 0 && (a.error.is_some() || a.next == a.segments.len()) {
                let a = self.active[s.req].take().expect("active");
                self.free_active.push(s.req);
                let result = a.error.map_or(Ok(()), Err);
                (a.done)(Completion { result, buf: a.buf });
            }
        }
    }
}

impl Drop for RingLoop {
    fn drop(&mut self) {
        if self.in_flight > 0 {
            // Only reached by a panic on the ring thread: the kernel may still write into these
            // buffers, so leak them rather than return them to the pool. Dropping `done` closes
            // the waiters' channels, so they learn that the engine died instead of hanging.
            for a in self.active.drain(..).flatten() {
                std::mem::forget(a.buf);
                drop(a.done);
            }
        }
    }
}
