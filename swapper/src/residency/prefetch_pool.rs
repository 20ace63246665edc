//! The prefetch threads: a queue of jobs served by `prefetch_threads` workers (named
//! `oogc-prefetch-{i}`), each bringing a copy to its tier through `ensure` without a pin, for
//! [`ResidencyManager::prefetch`]; and [`PrefetchHandle`], the reply end of one job. Dropping the
//! pool closes the queue and joins the workers.
//!
//! [`ResidencyManager::prefetch`]: super::ResidencyManager::prefetch

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use super::fetch::{Caller, Pin};
use super::Inner;
use crate::error::{Error, Result};
use crate::tier::{TensorId, Tier};

/// The workers and the sending end of their queue.
pub(super) struct PrefetchPool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

/// One queued fetch, and where its result goes.
struct Job {
    id: TensorId,
    tier: Tier,
    reply: Sender<Result<()>>,
}

impl PrefetchPool {
    /// Starts `threads` workers over `inner`.
    pub(super) fn start(inner: &Arc<Inner>, threads: usize) -> Self {
        let (tx, rx) = unbounded::<Job>();
        let threads = (0..threads)
            .map(|i| {
                let inner = inner.clone();
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("oogc-prefetch-{i}"))
                    .spawn(move || {
                        for job in rx {
                            let r = inner.ensure(job.id, job.tier, Pin::No, Caller::Prefetch).map(|_| ());
                            let _ = job.reply.send(r);
                        }
                    })
                    .expect("spawn prefetch thread")
            })
            .collect();
        Self { jobs: Some(tx), threads }
    }

    /// Queues a fetch of `id` to `tier` (device or host).
    ///
    /// # Errors
    /// [`Error::Device`] when the workers stopped.
    pub(super) fn submit(&self, id: TensorId, tier: Tier) -> Result<PrefetchHandle> {
        let (reply, rx) = bounded(1);
        self.jobs
            .as_ref()
            .expect("running")
            .send(Job { id, tier, reply })
            .map_err(|_| Error::Device("prefetch threads stopped".into()))?;
        Ok(PrefetchHandle { rx })
    }
}

impl Drop for PrefetchPool {
    fn drop(&mut self) {
        drop(self.jobs.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A background fetch started by [`ResidencyManager::prefetch`].
///
/// [`ResidencyManager::prefetch`]: super::ResidencyManager::prefetch
#[derive(Debug)]
pub struct PrefetchHandle {
    rx: Receiver<Result<()>>,
}

impl PrefetchHandle {
    /// Blocks until the fetch finished.
    ///
    /// # Errors
    /// The fetch's error (out of memory, I/O, corrupt data).
    pub fn wait(self) -> Result<()> {
        self.rx.recv().unwrap_or_else(|_| Err(Error::Device("prefetch thread stopped".into())))
    }

    /// Whether the fetch finished (non-blocking).
    pub fn is_ready(&self) -> bool {
        !self.rx.is_empty()
    }
}
