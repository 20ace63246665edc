//! Ranks set up by torch.distributed (`torchrun`): the runtime's collectives ([`oogc::dist::Collectives`])
//! forwarded to a Python object, `oogc.torch._TorchCollectives` over a process group (gloo on
//! the CPU, NCCL on GPUs).
//!
//! The runtime calls them from its gradient thread as well as from the caller's, one at a time
//! (a lock of [`PyCollectives`]'s own), so each call takes the GIL ([`Python::attach`]); every
//! `Runtime` method that may wait for that thread runs without the GIL (`PyRuntime::with`), so
//! the two never wait on each other. Buffers cross as `bytearray`s (one copy each way; the
//! Python side views them with `torch.frombuffer`).
//!
//! The process's ranks are the Python module's to hold ([`process_ranks`]): `init_ranks` sets
//! them once, and every `Runtime` made after it is given them (`oogc::runtime::Runtime::new`);
//! the library itself keeps no ranks of its own.

use std::sync::{Arc, OnceLock};

use oogc::dist::{Collectives, DistError, Ranks, World};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::error::{Error, Result};

/// A Python object with the methods `all_reduce_sum_f64(buf) -> bytearray`,
/// `reduce_scatter_sum_f32(buf, block_len) -> bytearray` and `all_gather_bytes(buf) -> bytearray`
/// (see `oogc.torch._TorchCollectives`).
struct PyCollectives {
    obj: Py<PyAny>,
    /// One collective at a time: the runtime's two threads never overlap two calls.
    one_at_a_time: parking_lot::Mutex<()>,
}

impl PyCollectives {
    /// Calls `method(bytearray(send), *extra)` and returns the bytes of its result, which must
    /// be `want` bytes long.
    fn call(
        &self,
        method: &str,
        send: &[u8],
        extra: Option<usize>,
        want: usize,
    ) -> std::result::Result<Vec<u8>, String> {
        let _one = self.one_at_a_time.lock();
        Python::attach(|py| {
            let buf = PyByteArray::new(py, send);
            let obj = self.obj.bind(py);
            let out = match extra {
                Some(n) => obj.call_method1(method, (buf, n)),
                None => obj.call_method1(method, (buf,)),
            }
            .map_err(|e| format!("{method}: {e}"))?;
            let out = out
                .cast::<PyByteArray>()
                .map_err(|_| format!("{method} returned {}, not a bytearray", out.get_type()))?
                .to_vec();
            if out.len() != want {
                return Err(format!("{method} returned {} bytes, expected {want}", out.len()));
            }
            Ok(out)
        })
    }
}

impl Collectives for PyCollectives {
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> std::result::Result<(), String> {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let out = self.call("all_reduce_sum_f64", bytes, None, bytes.len())?;
        values.copy_from_slice(&bytemuck::pod_collect_to_vec::<u8, f64>(&out));
        Ok(())
    }

    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) -> std::result::Result<(), String> {
        let out = self.call("reduce_scatter_sum_f32", bytemuck::cast_slice(send), Some(recv.len()), 4 * recv.len())?;
        recv.copy_from_slice(&bytemuck::pod_collect_to_vec::<u8, f32>(&out));
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> std::result::Result<(), String> {
        let out = self.call("all_gather_bytes", send, None, recv.len())?;
        recv.copy_from_slice(&out);
        Ok(())
    }
}

/// Makes this process rank `rank` of `world_size` (`local_rank` on its node) for every runtime
/// made after it, with `collectives` (see [`PyCollectives`]) as the engine: each runtime then
/// holds this rank's shard of the optimizer state and reduces gradients over the ranks, as
/// `mpirun -np N oogc train` does. Once per process (again with the same world: a no-op).
/// Called by `oogc.torch.offload(..., process_group=...)`.
///
/// Raises UsageError: another world was set already, or the rank is outside the world.
#[pyfunction]
#[pyo3(signature = (rank, world_size, local_rank, collectives))]
pub fn init_ranks(rank: usize, world_size: usize, local_rank: usize, collectives: Py<PyAny>) -> Result<()> {
    let world = World { rank, size: world_size, local_rank };
    let usage = |e: DistError| {
        Error::Usage(format!(
            "init_ranks(rank {rank}, world size {world_size}): {e} (this process is {:?}; one world per process)",
            process_ranks().world()
        ))
    };
    let collectives = PyCollectives { obj: collectives, one_at_a_time: parking_lot::Mutex::new(()) };
    let ranks = Ranks::new(world, Arc::new(collectives)).map_err(usage)?;
    if let Some(have) = PROCESS_RANKS.get() {
        // Again with the same world keeps the first collectives.
        return if have.world() == world { Ok(()) } else { Err(usage(DistError::AlreadyInitialized)) };
    }
    if world.size == 1 {
        // A world of one changes nothing (no collective is ever called).
        return Ok(());
    }
    PROCESS_RANKS.set(ranks).map_err(|_| usage(DistError::AlreadyInitialized))?;
    Ok(())
}

/// The ranks `init_ranks` set up in this Python process (set once; a torch.distributed process
/// group is the process's, as `torchrun` made it).
static PROCESS_RANKS: OnceLock<Ranks> = OnceLock::new();

/// This process's ranks for a new `Runtime`: those [`init_ranks`] set up, else a world of one
/// ([`Ranks::single`]).
pub(crate) fn process_ranks() -> Ranks {
    PROCESS_RANKS.get().cloned().unwrap_or_else(Ranks::single)
}

/// This process's world: `(rank, world_size, local_rank)`, `(0, 1, 0)` without ranks.
#[pyfunction]
pub fn world() -> (usize, usize, usize) {
    let w = process_ranks().world();
    (w.rank, w.size, w.local_rank)
}
