//! Data-parallel ranks over MPI (feature `mpi`): the process's place in the run ([`World`]) and
//! the few host-buffer collectives the trainer needs, through the `mpi` crate (rsmpi) over the
//! system's Open MPI. A run started without `mpirun` is a world of one, exactly as before, and
//! every collective is then a no-op.
//!
//! | piece | what it is |
//! |---|---|
//! | [`init`] | initialises MPI once per process when `mpirun` started it (`MPI_THREAD_MULTIPLE`); keep the returned [`MpiGuard`] alive until the end (dropping it finalises MPI) |
//! | [`init_with`] | the ranks of another engine instead: a [`Collectives`] (the Python module's over torch.distributed, for `torchrun`) |
//! | [`world`] | rank, world size, local rank (`OMPI_COMM_WORLD_*`): a world of one without [`init`] |
//! | [`shard_range`] | the elements of a unit whose master weights and Adam state a rank holds (ZeRO-style: `⌈numel / ranks⌉` each, in rank order) |
//! | [`reduce_scatter_mean_grads`] | this rank's shard of a unit's gradients averaged over the ranks (summed in f32, divided by the world size, back in their dtype) |
//! | [`all_gather_shards`] | a unit's bytes (a compute copy, master weights) from every rank's shard |
//! | [`all_reduce_sum_f64`], [`all_gather_f64`] | the trainer's scalars: losses, validation sums, per-rank figures, the global norm |
//!
//! **Sharding (ZeRO-style).** With more than one rank the runtime's optimizer holds only this
//! rank's [`shard_range`] of every unit: its fp32 master weights and Adam state (host or NVMe),
//! its gradients (a reduce-scatter of each unit's), its update; the global norm is an all-reduce
//! of the shards' sums of squares (`PipelinedOptimizer::set_norm_reduce`), so clipping and the
//! non-finite skip are the same everywhere. With `RuntimeConfig::shard_parameters` (ZeRO-3, the
//! trainer's default) the tiers hold the same shard of each compute copy and `Runtime::fetch`
//! all-gathers the unit (`runtime/gathered.rs` keeps gathered units for their next use);
//! without it (ZeRO-2, the Python module) the compute copies stay whole on every rank and
//! `Runtime::finish_step` all-gathers each updated unit's new copy — as it does, with sharded
//! parameters too, for units registered unscheduled (MoE experts: each rank fetches those its
//! own routing needs, so their copies stay whole; `Runtime::add_unscheduled_unit`). A checkpoint gathers the state (every rank takes part, rank 0 writes it); a
//! checkpoint of any world size loads, each rank taking its shard.
//!
//! **Ordering.** MPI collectives on one communicator must be called in the same order on every
//! rank. Two threads call them: the runtime's gradient drain thread (one reduce-scatter per unit,
//! in the order the backward pushes them, the same on every rank) and the trainer's thread (the
//! all-gathers of sharded units at their fetch, each after waiting until the drain thread
//! reduced every gradient pushed before it; the norm and the all-gathers in `finish_step`, after
//! the same wait; the loss, validation and checkpoint gathers between steps). So the two never
//! interleave differently on two ranks; a process-wide lock keeps any two calls from
//! overlapping.
//!
//! **Engines.** The collectives go to one backend per process: MPI ([`init`], feature `mpi`) or
//! a [`Collectives`] given to [`init_with`] by the program that set the ranks up (the Python
//! module's `oogc.torch.offload(..., process_group=...)` under `torchrun`: gloo on the CPU, NCCL
//! on GPUs). Both run under the same lock in the same order. A collective that fails ends the
//! process with the cause (as MPI's default error handler does): the ranks are out of step and
//! nothing can be resumed but a checkpoint; the launcher (`mpirun`, `torchrun`) then stops the
//! others.
//!
//! Without the `mpi` feature the binary needs no MPI library (the CUDA bundle, a machine without
//! Open MPI); started by `mpirun` with more than one rank it refuses to run ([`DistError`]),
//! naming the rebuild that fixes it.

use std::sync::OnceLock;

use oogc_optimizer::Grads;
use serde::Serialize;

/// This process's place in a data-parallel run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct World {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// Ranks in the run (the world size).
    pub size: usize,
    /// The rank among the ranks on this node (picks `cuda:{local_rank}` and `{local_rank}` in
    /// NVMe paths).
    pub local_rank: usize,
}

impl World {
    /// A run of one process.
    pub const SINGLE: World = World { rank: 0, size: 1, local_rank: 0 };

    /// Whether this is rank 0, the one that writes metrics and checkpoints.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// `path` with `{rank}` and `{local_rank}` replaced by this process's (per-rank NVMe
    /// directories, as DeepSpeed's `nvme_path_per_local_rank`).
    pub fn expand(&self, path: &str) -> String {
        path.replace("{rank}", &self.rank.to_string()).replace("{local_rank}", &self.local_rank.to_string())
    }

    /// This rank's NVMe directory for `dir` (`[budgets] nvme_dirs`): `{rank}` and
    /// `{local_rank}` replaced ([`World::expand`]); with several ranks, a directory that names
    /// neither gets a `rank{r}` subdirectory, so ranks never share store files. A world of one
    /// only expands.
    pub fn rank_dir(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let s = dir.to_string_lossy();
        let expanded = self.expand(&s);
        if expanded != s || self.size == 1 {
            std::path::PathBuf::from(expanded)
        } else {
            dir.join(format!("rank{}", self.rank))
        }
    }
}

/// Why the ranks could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// Started by `mpirun` with several ranks, without MPI compiled in.
    #[error(
        "started by mpirun as rank {rank} of {size}, but this oogc was built without the `mpi` feature, so \
         every rank would train alone: rebuild with `cargo build --release --features mpi` (needs Open MPI \
         and libclang: `apt-get install openmpi-bin libopenmpi-dev libclang-dev`), or run one process"
    )]
    NotBuiltWithMpi {
        /// This process's rank.
        rank: usize,
        /// The world size mpirun announced.
        size: usize,
    },
    /// MPI was initialised already (by another library, or [`init`] called twice).
    #[error("MPI is already initialised in this process: call oogc::dist::init once, before any other MPI use")]
    AlreadyInitialized,
    /// The MPI library cannot give the thread support the runtime needs.
    #[error(
        "the MPI library grants thread level {granted}, the runtime needs MPI_THREAD_SERIALIZED at least \
         (its gradient thread and the trainer call collectives): use an MPI built with thread support \
         (Open MPI does)"
    )]
    ThreadLevel {
        /// The level granted.
        granted: String,
    },
    /// [`init_with`] was given a rank outside its world.
    #[error("rank {rank} of a world of {size}: a rank is 0..size, and a world has at least one rank")]
    BadWorld {
        /// The rank given.
        rank: usize,
        /// The world size given.
        size: usize,
    },
    /// `OMPI_COMM_WORLD_*` and what MPI reports disagree.
    #[error("mpirun's environment says rank {env_rank} of {env_size}, MPI says rank {rank} of {size}")]
    Mismatch {
        /// From the environment.
        env_rank: usize,
        /// From the environment.
        env_size: usize,
        /// From MPI.
        rank: usize,
        /// From MPI.
        size: usize,
    },
}

static WORLD: OnceLock<World> = OnceLock::new();

/// Where this process's collectives go (set once, with [`WORLD`]).
static BACKEND: OnceLock<Backend> = OnceLock::new();

enum Backend {
    #[cfg(feature = "mpi")]
    Mpi,
    External(Box<dyn Collectives>),
}

/// Serialises this process's collectives (see the module docs).
static COLLECTIVE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// The collectives of ranks that another engine set up (torch.distributed's process group under
/// `torchrun`, ...), for [`init_with`]. Every rank calls the same methods in the same order
/// (the runtime guarantees it, and never calls two at once); buffers are host memory.
///
/// An `Err` is the engine's message; the run cannot go on after it (see the module docs).
pub trait Collectives: Send + Sync {
    /// `values` (f64) summed over the ranks, in place.
    ///
    /// # Errors
    /// The engine's failure (a rank died, a timeout), as text.
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), String>;

    /// A reduce-scatter of f32 blocks: `send` holds `world size` blocks of `recv.len()` (block
    /// r for rank r); block `rank` summed over the ranks lands in `recv`.
    ///
    /// # Errors
    /// The engine's failure, as text.
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), String>;

    /// An all-gather of equal blocks of bytes: every rank's `send` into `recv`
    /// (`send.len() × world size` bytes) in rank order.
    ///
    /// # Errors
    /// The engine's failure, as text.
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), String>;
}

/// This process's world: the one [`init`] set up, else a world of one.
pub fn world() -> World {
    WORLD.get().copied().unwrap_or(World::SINGLE)
}

/// What `mpirun` (Open MPI) announced in this process's environment — `OMPI_COMM_WORLD_RANK`,
/// `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` — without initialising MPI; `None` when
/// not started by it.
pub fn launched_by_mpirun() -> Option<World> {
    let var = |k: &str| std::env::var(k).ok()?.parse::<usize>().ok();
    let size = var("OMPI_COMM_WORLD_SIZE")?;
    let rank = var("OMPI_COMM_WORLD_RANK")?;
    Some(World { rank, size, local_rank: var("OMPI_COMM_WORLD_LOCAL_RANK").unwrap_or(rank) })
}

/// Keeps MPI initialised; finalises it when dropped. Hold it for the whole run, on the thread
/// that called [`init`] (it is neither `Send` nor `Sync`).
pub struct MpiGuard {
    #[cfg(feature = "mpi")]
    _universe: Option<mpi::environment::Universe>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for MpiGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGuard").field("world", &world()).finish()
    }
}

/// Sets up this process's world: when `mpirun` started it (with the `mpi` feature), initialises
/// MPI with `MPI_THREAD_MULTIPLE` and reads rank and size from it; otherwise a world of one (no
/// MPI call at all). Call once, first thing, and keep the guard until the end of `main`.
///
/// # Errors
/// [`DistError::NotBuiltWithMpi`] when started by `mpirun` with more than one rank without the
/// `mpi` feature; [`DistError::AlreadyInitialized`], [`DistError::ThreadLevel`],
/// [`DistError::Mismatch`] from MPI.
pub fn init() -> Result<MpiGuard, DistError> {
    let none = || MpiGuard {
        #[cfg(feature = "mpi")]
        _universe: None,
        _not_send: std::marker::PhantomData,
    };
    let Some(env) = launched_by_mpirun() else { return Ok(none()) };
    #[cfg(not(feature = "mpi"))]
    {
        if env.size > 1 {
            return Err(DistError::NotBuiltWithMpi { rank: env.rank, size: env.size });
        }
        Ok(none())
    }
    #[cfg(feature = "mpi")]
    {
        use mpi::traits::Communicator;
        let (universe, granted) =
            mpi::initialize_with_threading(mpi::Threading::Multiple).ok_or(DistError::AlreadyInitialized)?;
        if granted < mpi::Threading::Serialized {
            return Err(DistError::ThreadLevel { granted: format!("{granted:?}") });
        }
        let comm = universe.world();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        if rank != env.rank || size != env.size {
            return Err(DistError::Mismatch { env_rank: env.rank, env_size: env.size, rank, size });
        }
        let world = World { rank, size, local_rank: env.local_rank };
        WORLD.set(world).map_err(|_| DistError::AlreadyInitialized)?;
        BACKEND.set(Backend::Mpi).map_err(|_| DistError::AlreadyInitialized)?;
        tracing::info!(rank, size, local_rank = world.local_rank, "MPI initialised");
        Ok(MpiGuard { _universe: Some(universe), _not_send: std::marker::PhantomData })
    }
}

/// The backend, locked for one collective; `None` in a world of one.
fn backend() -> Option<(&'static Backend, parking_lot::MutexGuard<'static, ()>)> {
    if world().size == 1 {
        return None;
    }
    let backend = BACKEND.get()?;
    Some((backend, COLLECTIVE.lock()))
}

/// An external collective's result, or the end of the process when it failed (see the module
/// docs).
fn or_exit<T>(op: &str, result: Result<T, String>) -> T {
    result.unwrap_or_else(|e| {
        let w = world();
        eprintln!(
            "oogc: rank {} of {}: the collective {op} failed: {e}; this rank stops (the ranks are out of step; \
             the launcher stops the others; resume from the last checkpoint)",
            w.rank, w.size
        );
        tracing::error!(rank = w.rank, op, error = %e, "collective failed");
        std::process::exit(1)
    })
}

/// Sets up this process's world from another engine's ranks: `world` and the [`Collectives`]
/// every later collective goes to (the Python module's over torch.distributed). A `world` of one
/// changes nothing (no collective is ever called).
///
/// # Errors
/// [`DistError::AlreadyInitialized`] when this process's world was set already (by [`init`]
/// under `mpirun`, or an earlier call with another world); calling it again with the same world
/// keeps the first backend and is not an error. [`DistError::BadWorld`] when `world` is not a
/// world (rank beyond the size, size 0).
pub fn init_with(world: World, collectives: Box<dyn Collectives>) -> Result<(), DistError> {
    if world.size == 0 || world.rank >= world.size {
        return Err(DistError::BadWorld { rank: world.rank, size: world.size });
    }
    if let Some(have) = WORLD.get() {
        return if *have == world { Ok(()) } else { Err(DistError::AlreadyInitialized) };
    }
    if world.size == 1 {
        return Ok(());
    }
    WORLD.set(world).map_err(|_| DistError::AlreadyInitialized)?;
    BACKEND.set(Backend::External(collectives)).map_err(|_| DistError::AlreadyInitialized)?;
    tracing::info!(
        rank = world.rank,
        size = world.size,
        local_rank = world.local_rank,
        "ranks set up by another engine"
    );
    Ok(())
}

#[cfg(feature = "mpi")]
fn comm() -> mpi::topology::SimpleCommunicator {
    mpi::topology::SimpleCommunicator::world()
}

/// `values` summed over the ranks, in place (f64). A no-op in a world of one.
pub fn all_reduce_sum_f64(values: &mut [f64]) {
    if values.is_empty() {
        return;
    }
    let Some((backend, _one)) = backend() else { return };
    match backend {
        #[cfg(feature = "mpi")]
        Backend::Mpi => {
            use mpi::collective::SystemOperation;
            use mpi::traits::CommunicatorCollectives;
            let send = values.to_vec();
            comm().all_reduce_into(&send[..], values, SystemOperation::sum());
        }
        Backend::External(c) => or_exit("all-reduce (sum, f64)", c.all_reduce_sum_f64(values)),
    }
}

/// `value` of every rank, in rank order (`[value]` in a world of one).
pub fn all_gather_f64(value: f64) -> Vec<f64> {
    let Some((backend, _one)) = backend() else { return vec![value] };
    let mut out = vec![0.0; world().size];
    match backend {
        #[cfg(feature = "mpi")]
        Backend::Mpi => {
            use mpi::traits::CommunicatorCollectives;
            comm().all_gather_into(&value, &mut out[..]);
        }
        Backend::External(c) => {
            let mut bytes = vec![0u8; 8 * out.len()];
            or_exit("all-gather (f64)", c.all_gather_bytes(&value.to_ne_bytes(), &mut bytes));
            out = bytemuck::pod_collect_to_vec(&bytes);
        }
    }
    out
}

/// Ends every rank of the run now (`MPI_Abort` with `code`): what a rank that failed does, so
/// that the others do not wait forever in their next collective (nor in `MPI_Finalize`). In a
/// world of one, or with another engine's ranks (whose launcher stops the others when this
/// process ends), exits the process with `code`.
pub fn abort(code: i32) -> ! {
    #[cfg(feature = "mpi")]
    if world().size > 1 && matches!(BACKEND.get(), Some(Backend::Mpi)) {
        use mpi::traits::Communicator;
        comm().abort(code)
    }
    std::process::exit(code)
}

/// The elements of a flat unit of `numel` that rank `rank` of `ranks` owns (its master
/// weights, Adam state and update, ZeRO-style): `⌈numel / ranks⌉` per rank, the last ones
/// shorter (or empty), together the whole unit in rank order.
pub fn shard_range(numel: usize, rank: usize, ranks: usize) -> std::ops::Range<usize> {
    let per = numel.div_ceil(ranks.max(1));
    (rank * per).min(numel)..((rank + 1) * per).min(numel)
}

/// This rank's shard ([`shard_range`]) of a unit's gradients averaged over the ranks: a
/// reduce-scatter (`MPI_Reduce_scatter_block`, summed in f32, the unit padded to equal blocks),
/// divided by the world size, returned in the gradients' dtype. The whole gradients, unchanged,
/// in a world of one.
pub fn reduce_scatter_mean_grads(grads: Grads) -> Grads {
    let world = world();
    if world.size == 1 {
        return grads;
    }
    let dtype = grads.dtype();
    let numel = grads.len();
    let per = numel.div_ceil(world.size);
    let mut send = match Grads::converted(grads.as_slice(), oogc_swapper::DType::F32) {
        Grads::F32(v) => v,
        _ => unreachable!("converted to f32"),
    };
    send.resize(per * world.size, 0.0);
    let mut mine = vec![0.0f32; per];
    if let Some((backend, _one)) = backend() {
        match backend {
            #[cfg(feature = "mpi")]
            Backend::Mpi => {
                use mpi::collective::SystemOperation;
                use mpi::traits::CommunicatorCollectives;
                comm().reduce_scatter_block_into(&send[..], &mut mine[..], SystemOperation::sum());
            }
            Backend::External(c) => {
                or_exit("reduce-scatter (sum, f32)", c.reduce_scatter_sum_f32(&send, &mut mine));
            }
        }
    }
    mine.truncate(shard_range(numel, world.rank, world.size).len());
    let inv = 1.0 / world.size as f32;
    mine.iter_mut().for_each(|g| *g *= inv);
    let mean = Grads::F32(mine);
    if dtype == oogc_swapper::DType::F32 {
        mean
    } else {
        Grads::converted(mean.as_slice(), dtype)
    }
}

/// A unit of `numel` elements of `elem_bytes` bytes each, gathered from every rank's shard
/// ([`shard_range`]; `shard` is this rank's, `shard.len() == range.len() × elem_bytes`): an
/// all-gather of equal padded blocks, `numel × elem_bytes` bytes in rank order. `shard` itself
/// in a world of one.
///
/// # Panics
/// When `shard` is not this rank's shard's size.
pub fn all_gather_shards(shard: &[u8], numel: usize, elem_bytes: usize) -> Vec<u8> {
    let world = world();
    let range = shard_range(numel, world.rank, world.size);
    assert_eq!(shard.len(), range.len() * elem_bytes, "rank {}'s shard of a unit of {numel}", world.rank);
    if world.size == 1 {
        return shard.to_vec();
    }
    let block = numel.div_ceil(world.size) * elem_bytes;
    let mut send = shard.to_vec();
    send.resize(block, 0);
    let mut all = vec![0u8; block * world.size];
    if let Some((backend, _one)) = backend() {
        match backend {
            #[cfg(feature = "mpi")]
            Backend::Mpi => {
                use mpi::traits::CommunicatorCollectives;
                comm().all_gather_into(&send[..], &mut all[..]);
            }
            Backend::External(c) => or_exit("all-gather (bytes)", c.all_gather_bytes(&send, &mut all)),
        }
    }
    all.truncate(numel * elem_bytes);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one_leaves_everything_as_it_is() {
        // No mpirun in the test's environment: no MPI call is made.
        assert_eq!(world(), World::SINGLE);
        let g = Grads::F32(vec![1.5, -2.0]);
        assert_eq!(reduce_scatter_mean_grads(g.clone()), g);
        assert_eq!(all_gather_shards(&[1, 2, 3, 4], 2, 2), vec![1, 2, 3, 4]);
        let mut v = [3.0, 4.0];
        all_reduce_sum_f64(&mut v);
        assert_eq!(v, [3.0, 4.0]);
        assert_eq!(all_gather_f64(7.0), vec![7.0]);
    }

    struct Unreachable;
    impl Collectives for Unreachable {
        fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<(), String> {
            unreachable!("a world of one calls no collective")
        }
        fn reduce_scatter_sum_f32(&self, _: &[f32], _: &mut [f32]) -> Result<(), String> {
            unreachable!("a world of one calls no collective")
        }
        fn all_gather_bytes(&self, _: &[u8], _: &mut [u8]) -> Result<(), String> {
            unreachable!("a world of one calls no collective")
        }
    }

    #[test]
    fn another_engine_s_world_is_checked_and_a_world_of_one_changes_nothing() {
        let bad = init_with(World { rank: 2, size: 2, local_rank: 0 }, Box::new(Unreachable));
        assert!(matches!(bad, Err(DistError::BadWorld { rank: 2, size: 2 })), "{bad:?}");
        let empty = init_with(World { rank: 0, size: 0, local_rank: 0 }, Box::new(Unreachable));
        assert!(matches!(empty, Err(DistError::BadWorld { .. })), "{empty:?}");
        init_with(World::SINGLE, Box::new(Unreachable)).expect("a world of one");
        assert_eq!(world(), World::SINGLE);
        let mut v = [1.0];
        all_reduce_sum_f64(&mut v);
        assert_eq!(v, [1.0]);
    }

    #[test]
    fn the_shards_cover_a_unit_once_in_rank_order() {
        for (numel, ranks) in [(10, 3), (9, 3), (1, 4), (0, 2), (7, 1), (5, 8)] {
            let mut next = 0;
            for rank in 0..ranks {
                let r = shard_range(numel, rank, ranks);
                assert_eq!(r.start, next, "numel {numel}, rank {rank} of {ranks}");
                assert!(r.len() <= numel.div_ceil(ranks));
                next = r.end;
            }
            assert_eq!(next, numel, "numel {numel} over {ranks} ranks");
        }
    }

    #[test]
    fn rank_placeholders_expand_in_paths() {
        let w = World { rank: 3, size: 4, local_rank: 1 };
        assert_eq!(w.expand("/nvme{local_rank}/oogc/rank{rank}"), "/nvme1/oogc/rank3");
        assert_eq!(World::SINGLE.expand("/nvme/oogc"), "/nvme/oogc");
        let dir = std::path::Path::new("/nvme/oogc");
        assert_eq!(w.rank_dir(dir), dir.join("rank3"));
        assert_eq!(w.rank_dir(std::path::Path::new("/nvme{local_rank}")), std::path::Path::new("/nvme1"));
        assert_eq!(World::SINGLE.rank_dir(dir), dir);
    }
}
