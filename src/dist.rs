//! Data-parallel ranks as a value: the process's place in the run ([`World`]) and the few
//! host-buffer collectives the trainer needs ([`Collectives`]), together a [`Ranks`] that the
//! entry point makes once and passes down (`Runtime::new`, `Trainer::new`, `run::run`); the
//! planners take the [`World`]. Nothing here is process-global: a run started without `mpirun`
//! is given [`Ranks::single`] (a world of one, every collective a no-op), exactly as before.
//!
//! | piece | what it is |
//! |---|---|
//! | [`init`] | initialises MPI once per process when `mpirun` started it (`MPI_THREAD_MULTIPLE`, feature `mpi`, through the `mpi` crate over the system's Open MPI); the returned [`MpiGuard`] gives the run's [`Ranks`] and finalises MPI when dropped |
//! | [`Ranks::new`] | the ranks of another engine instead: a [`Collectives`] of the program that set them up (the Python module's over torch.distributed, for `torchrun`) |
//! | [`World`] | rank, world size, local rank (`OMPI_COMM_WORLD_*`); [`World::SINGLE`] without ranks |
//! | [`Collectives`] | the engine's calls: all-reduce (f64 sum), reduce-scatter (f32 sum), all-gather (bytes), abort; [`SingleProcess`] is the no-op of a world of one |
//! | [`shard_range`], [`shard_len`] | the elements of a unit whose master weights and Adam state a rank holds (ZeRO-style: `⌈numel / ranks⌉` each rounded up to whole blocks of [`SHARD_ALIGN`], in rank order) |
//! | [`Ranks::reduce_scatter_mean_grads`] | the drain thread's step: this rank's shard of a unit's gradients averaged over the ranks (summed in f32, divided by the world size, back in their dtype) |
//! | [`Ranks::all_gather_shards`] | the fetch's step: a unit's bytes (a compute copy, master weights) from every rank's shard |
//! | [`Ranks::all_gather_shard_blocks`] | a checkpoint's step for int8 moments: one value per block of every rank's shard (the absmaxes) |
//! | [`Ranks::all_reduce_sum_f64`], [`Ranks::all_gather_f64`] | the trainer's scalars: losses, validation sums, per-rank figures, the global norm |
//!
//! **Sharding (ZeRO-style).** With more than one rank the runtime's optimizer holds only this
//! rank's [`shard_range`] of every unit: its master weights and Adam state (host or NVMe, in
//! `[optimizer] state_dtype` / `master_dtype`; a shard starts on a block of [`SHARD_ALIGN`], so
//! a rank's int8 blocks are one process's blocks of that range),
//! its gradients (a reduce-scatter of each unit's), its update; the global norm is an all-reduce
//! of the shards' sums of squares (`PipelinedOptimizer::set_norm_reduce`), so clipping and the
//! non-finite skip are the same everywhere. With `RuntimeConfig::shard_parameters` (ZeRO-3, the
//! trainer's default) the tiers hold the same shard of each compute copy and `Runtime::fetch`
//! all-gathers the unit (`runtime/gathered.rs` keeps gathered units for their next use);
//! without it (ZeRO-2, the Python module) the compute copies stay whole on every rank and
//! `Runtime::finish_step` all-gathers each updated unit's new copy — as it does, with sharded
//! parameters too, for units registered unscheduled (MoE experts: each rank fetches those its
//! own routing needs, so their copies stay whole; `Runtime::add_unscheduled_unit`). A checkpoint gathers the state in its
//! stored dtype (every rank takes part, rank 0 writes it: the file a world of one writes); a
//! checkpoint of any world size loads, each rank taking its shard.
//!
//! **Ordering.** MPI collectives on one communicator must be called in the same order on every
//! rank. Two threads call them: the runtime's gradient drain thread (one reduce-scatter per unit,
//! in the order the backward pushes them, the same on every rank) and the trainer's thread (the
//! all-gathers of sharded units at their fetch, each after waiting until the drain thread
//! reduced every gradient pushed before it; the norm and the all-gathers in `finish_step`, after
//! the same wait; the loss, validation and checkpoint gathers between steps). So the two never
//! interleave differently on two ranks; the implementation keeps any two calls from overlapping
//! (the MPI one holds a lock of its own; another engine's does the same).
//!
//! **Failures.** A collective that fails is an error ([`DistError::Collective`]) returned up to
//! the caller: the ranks are out of step and nothing can be resumed but a checkpoint. The entry
//! point decides: the CLI ends every rank ([`Ranks::abort`]: `MPI_Abort`) and exits; the Python
//! module raises, and its launcher (`torchrun`) stops the others. Nothing here ends the process.
//!
//! Without the `mpi` feature the binary needs no MPI library (the CUDA bundle, a machine without
//! Open MPI); started by `mpirun` with more than one rank it refuses to run ([`DistError`]),
//! naming the rebuild that fixes it.

use std::sync::Arc;

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
    /// [`Ranks::new`] was given a rank outside its world.
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
    /// A collective failed (a rank died, a timeout): the ranks are out of step, and the run cannot
    /// go on; the entry point ends it ([`Ranks::abort`]) and it resumes from its last checkpoint.
    #[error(
        "rank {rank} of {size}: the collective {op} failed: {message}; the ranks are out of step, so this run \
         cannot go on (the launcher stops the other ranks); resume from the last checkpoint"
    )]
    Collective {
        /// The collective (`"all-reduce (sum, f64)"`, ...).
        op: &'static str,
        /// This process's rank.
        rank: usize,
        /// The world size.
        size: usize,
        /// The engine's message.
        message: String,
    },
}

/// The collectives of a run's ranks, over the engine that set them up: MPI ([`init`], feature
/// `mpi`), torch.distributed's process group under `torchrun` (the Python module's), or none
/// ([`SingleProcess`]). Every rank calls the same methods in the same order (the runtime
/// guarantees it); an implementation keeps two calls from overlapping (the runtime calls from
/// two threads, one after the other); buffers are host memory.
///
/// The methods are the engine's raw calls; the runtime and the trainer reach them through
/// [`Ranks`], which skips them in a world of one and turns a failure into
/// [`DistError::Collective`].
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

    /// Ends every rank of the run now, where the engine can (MPI: `MPI_Abort` with `code`, which
    /// does not return), so that the others do not wait forever in their next collective. The
    /// default returns: the caller then ends this process, and the engine's launcher
    /// (`torchrun`) stops the others.
    fn abort(&self, code: i32) {
        let _ = code;
    }
}

/// The collectives of a world of one: each leaves its data as it is (a sum over one rank, the
/// one block scattered, the one block gathered). [`Ranks`] does not even call them.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collectives for SingleProcess {
    fn all_reduce_sum_f64(&self, _values: &mut [f64]) -> Result<(), String> {
        Ok(())
    }

    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), String> {
        let n = recv.len();
        recv.copy_from_slice(&send[..n]);
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), String> {
        recv[..send.len()].copy_from_slice(send);
        Ok(())
    }
}

/// A run's ranks: this process's [`World`] and the [`Collectives`] it shares with the others.
/// Made once by the entry point ([`init`] under `mpirun`, [`Ranks::new`] for another engine's,
/// [`Ranks::single`] otherwise) and passed down by value (cloning shares the collectives).
///
/// Its methods are the named collective steps of a run, each a no-op in a world of one (no call
/// reaches the collectives) and each an error when the engine fails
/// ([`DistError::Collective`]): the run cannot go on after it.
#[derive(Clone)]
pub struct Ranks {
    world: World,
    collectives: Arc<dyn Collectives>,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks").field("world", &self.world).finish_non_exhaustive()
    }
}

impl Ranks {
    /// A run of one process: [`World::SINGLE`] and [`SingleProcess`].
    pub fn single() -> Self {
        Self { world: World::SINGLE, collectives: Arc::new(SingleProcess) }
    }

    /// The ranks of `world` over `collectives` (another engine's: the Python module's over
    /// torch.distributed). A world of one never calls `collectives`.
    ///
    /// # Errors
    /// [`DistError::BadWorld`] when `world` is not a world (rank beyond the size, size 0).
    pub fn new(world: World, collectives: Arc<dyn Collectives>) -> Result<Self, DistError> {
        if world.size == 0 || world.rank >= world.size {
            return Err(DistError::BadWorld { rank: world.rank, size: world.size });
        }
        Ok(Self { world, collectives })
    }

    /// This process's place in the run.
    pub fn world(&self) -> World {
        self.world
    }

    fn failed(&self, op: &'static str, message: String) -> DistError {
        let w = self.world;
        tracing::error!(rank = w.rank, op, error = %message, "collective failed");
        DistError::Collective { op, rank: w.rank, size: w.size, message }
    }

    /// `values` summed over the ranks, in place (f64): the global norm's sum of squares, the
    /// step's loss, the validation sums, the collective stop. A no-op in a world of one.
    ///
    /// # Errors
    /// [`DistError::Collective`] when the engine fails.
    pub fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), DistError> {
        if values.is_empty() || self.world.size == 1 {
            return Ok(());
        }
        self.collectives.all_reduce_sum_f64(values).map_err(|e| self.failed("all-reduce (sum, f64)", e))
    }

    /// `value` of every rank, in rank order (`[value]` in a world of one): the per-rank step
    /// times of the metrics.
    ///
    /// # Errors
    /// [`DistError::Collective`] when the engine fails.
    pub fn all_gather_f64(&self, value: f64) -> Result<Vec<f64>, DistError> {
        if self.world.size == 1 {
            return Ok(vec![value]);
        }
        let mut bytes = vec![0u8; 8 * self.world.size];
        self.collectives
            .all_gather_bytes(&value.to_ne_bytes(), &mut bytes)
            .map_err(|e| self.failed("all-gather (f64)", e))?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// The gradient drain thread's step: this rank's shard ([`shard_range`]) of a unit's
    /// gradients averaged over the ranks: a reduce-scatter (`MPI_Reduce_scatter_block`, summed
    /// in f32, the unit padded to equal blocks of [`shard_len`]), divided by the world size, returned in the
    /// gradients' dtype. The whole gradients, unchanged, in a world of one.
    ///
    /// # Errors
    /// [`DistError::Collective`] when the engine fails.
    pub fn reduce_scatter_mean_grads(&self, grads: Grads) -> Result<Grads, DistError> {
        let world = self.world;
        if world.size == 1 {
            return Ok(grads);
        }
        let dtype = grads.dtype();
        let numel = grads.len();
        let per = shard_len(numel, world.size);
        let mut send = match Grads::converted(grads.as_slice(), oogc_swapper::DType::F32) {
            Grads::F32(v) => v,
            _ => unreachable!("converted to f32"),
        };
        send.resize(per * world.size, 0.0);
        let mut mine = vec![0.0f32; per];
        self.collectives
            .reduce_scatter_sum_f32(&send, &mut mine)
            .map_err(|e| self.failed("reduce-scatter (sum, f32)", e))?;
        mine.truncate(shard_range(numel, world.rank, world.size).len());
        let inv = 1.0 / world.size as f32;
        mine.iter_mut().for_each(|g| *g *= inv);
        let mean = Grads::F32(mine);
        Ok(if dtype == oogc_swapper::DType::F32 { mean } else { Grads::converted(mean.as_slice(), dtype) })
    }

    /// The fetch's step: a unit of `numel` elements of `elem_bytes` bytes each, gathered from
    /// every rank's shard ([`shard_range`]; `shard` is this rank's,
    /// `shard.len() == range.len() × elem_bytes`): an all-gather of equal padded blocks
    /// ([`shard_len`] elements), `numel × elem_bytes` bytes in rank order. `shard` itself in a
    /// world of one.
    ///
    /// # Errors
    /// [`DistError::Collective`] when the engine fails.
    ///
    /// # Panics
    /// When `shard` is not this rank's shard's size.
    pub fn all_gather_shards(&self, shard: &[u8], numel: usize, elem_bytes: usize) -> Result<Vec<u8>, DistError> {
        let per = shard_len(numel, self.world.size);
        self.all_gather_chunks(shard, numel, per, elem_bytes, "all-gather (bytes)")
    }

    /// A checkpoint's step for int8 moments: one value of `elem_bytes` bytes per block of
    /// [`SHARD_ALIGN`] elements of every rank's shard of a unit of `numel` elements (`blocks`
    /// is this rank's: `shard_range(..).len().div_ceil(SHARD_ALIGN)` values, its blocks'
    /// absmaxes), gathered in rank order: `numel.div_ceil(SHARD_ALIGN)` values as bytes, one
    /// process's blocks (a shard starts on a block). `blocks` itself in a world of one.
    ///
    /// # Errors
    /// [`DistError::Collective`] when the engine fails.
    ///
    /// # Panics
    /// When `blocks` is not this rank's shard's number of blocks.
    pub fn all_gather_shard_blocks(
        &self,
        blocks: &[u8],
        numel: usize,
        elem_bytes: usize,
    ) -> Result<Vec<u8>, DistError> {
        let per = shard_len(numel, self.world.size) / SHARD_ALIGN;
        self.all_gather_chunks(blocks, numel.div_ceil(SHARD_ALIGN), per, elem_bytes, "all-gather (block values)")
    }

    /// `total` elements of `elem_bytes` bytes cut in chunks of `per` in rank order (the last
    /// shorter or empty), this rank's chunk `mine`: every rank's, gathered (equal blocks of
    /// `per` elements, padded).
    fn all_gather_chunks(
        &self,
        mine: &[u8],
        total: usize,
        per: usize,
        elem_bytes: usize,
        op: &'static str,
    ) -> Result<Vec<u8>, DistError> {
        let world = self.world;
        let len = ((world.rank + 1) * per).min(total).saturating_sub(world.rank * per);
        assert_eq!(mine.len(), len * elem_bytes, "rank {}'s shard of a unit of {total}", world.rank);
        if world.size == 1 {
            return Ok(mine.to_vec());
        }
        let block = per * elem_bytes;
        let mut send = mine.to_vec();
        send.resize(block, 0);
        let mut all = vec![0u8; block * world.size];
        self.collectives.all_gather_bytes(&send, &mut all).map_err(|e| self.failed(op, e))?;
        all.truncate(total * elem_bytes);
        Ok(all)
    }

    /// Ends every rank of the run now where the engine can (`MPI_Abort` with `code`, which does
    /// not return): what the entry point does when a rank failed, so that the others do not
    /// wait forever in their next collective (nor in `MPI_Finalize`). Returns in a world of one
    /// and with another engine's ranks: the caller then ends this process.
    pub fn abort(&self, code: i32) {
        if self.world.size > 1 {
            self.collectives.abort(code);
        }
    }
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

/// The run's [`Ranks`] and, under `mpirun`, MPI kept initialised: dropping it finalises MPI, so
/// hold it for the whole run, on the thread that called [`init`] (it is neither `Send` nor
/// `Sync`), and drop every runtime and trainer made with its ranks first.
pub struct MpiGuard {
    ranks: Ranks,
    #[cfg(feature = "mpi")]
    _universe: Option<mpi::environment::Universe>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for MpiGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGuard").field("world", &self.ranks.world).finish()
    }
}

impl MpiGuard {
    /// The run's ranks: MPI's when `mpirun` started the process, else [`Ranks::single`].
    pub fn ranks(&self) -> Ranks {
        self.ranks.clone()
    }
}

/// Sets up this process's ranks: when `mpirun` started it (with the `mpi` feature), initialises
/// MPI with `MPI_THREAD_MULTIPLE` and reads rank and size from it; otherwise a world of one (no
/// MPI call at all). Call once, first thing, keep the guard until the end of `main`, and pass
/// [`MpiGuard::ranks`] down.
///
/// # Errors
/// [`DistError::NotBuiltWithMpi`] when started by `mpirun` with more than one rank without the
/// `mpi` feature; [`DistError::AlreadyInitialized`], [`DistError::ThreadLevel`],
/// [`DistError::Mismatch`] from MPI.
pub fn init() -> Result<MpiGuard, DistError> {
    let none = || MpiGuard {
        ranks: Ranks::single(),
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
        tracing::info!(rank, size, local_rank = world.local_rank, "MPI initialised");
        let collectives: Arc<dyn Collectives> =
            if size == 1 { Arc::new(SingleProcess) } else { Arc::new(mpi_world::MpiCollectives::default()) };
        let ranks = Ranks::new(world, collectives)?;
        Ok(MpiGuard { ranks, _universe: Some(universe), _not_send: std::marker::PhantomData })
    }
}

/// The MPI engine: `MPI_COMM_WORLD` through rsmpi, one call at a time.
#[cfg(feature = "mpi")]
mod mpi_world {
    use mpi::collective::SystemOperation;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::{Communicator, CommunicatorCollectives};

    use super::Collectives;

    /// MPI's collectives on the world communicator; the lock serialises them (the runtime's
    /// drain thread and the trainer's thread call one after the other, never at once, but MPI
    /// is told nothing of that order).
    #[derive(Default)]
    pub(super) struct MpiCollectives {
        one_at_a_time: parking_lot::Mutex<()>,
    }

    fn comm() -> SimpleCommunicator {
        SimpleCommunicator::world()
    }

    // MPI's default error handler (`MPI_ERRORS_ARE_FATAL`) ends the run on a failure: these
    // calls return only on success.
    impl Collectives for MpiCollectives {
        fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), String> {
            let _one = self.one_at_a_time.lock();
            let send = values.to_vec();
            comm().all_reduce_into(&send[..], values, SystemOperation::sum());
            Ok(())
        }

        fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), String> {
            let _one = self.one_at_a_time.lock();
            comm().reduce_scatter_block_into(send, recv, SystemOperation::sum());
            Ok(())
        }

        fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), String> {
            let _one = self.one_at_a_time.lock();
            comm().all_gather_into(send, recv);
            Ok(())
        }

        fn abort(&self, code: i32) {
            comm().abort(code)
        }
    }
}

/// The alignment of a rank's shard ([`shard_range`]): a shard starts at a multiple of
/// [`oogc_optimizer::QUANT_BLOCK`] (256) elements, so the int8 moments' blocks of a rank (counted
/// from its shard's start) are exactly one process's blocks of that range, and a gathered unit
/// is one process's layout whatever the world size.
pub const SHARD_ALIGN: usize = oogc_optimizer::QUANT_BLOCK;

/// Elements per rank's shard of a flat unit of `numel` over `ranks` ranks: `⌈numel / ranks⌉`
/// rounded up to a multiple of [`SHARD_ALIGN`] (the last shards hold less, or nothing).
pub fn shard_len(numel: usize, ranks: usize) -> usize {
    numel.div_ceil(ranks.max(1)).next_multiple_of(SHARD_ALIGN)
}

/// The elements of a flat unit of `numel` that rank `rank` of `ranks` owns (its master
/// weights, Adam state and update, ZeRO-style): [`shard_len`] per rank, each starting at a
/// multiple of [`SHARD_ALIGN`], the last ones shorter (or empty, at `numel..numel`), together
/// the whole unit in rank order. A world of one holds the whole unit.
pub fn shard_range(numel: usize, rank: usize, ranks: usize) -> std::ops::Range<usize> {
    let per = shard_len(numel, ranks);
    (rank * per).min(numel)..((rank + 1) * per).min(numel)
}

/// Whether every rank of `ranks` holds a part of a unit of `numel` ([`shard_range`] not empty):
/// not for units of fewer than `ranks - 1` blocks of [`SHARD_ALIGN`] and a bit, whose compute
/// copies stay whole with sharded parameters (`RuntimeConfig::shard_parameters`). Always in a
/// world of one.
pub fn every_rank_holds(numel: usize, ranks: usize) -> bool {
    ranks <= 1 || !shard_range(numel, ranks - 1, ranks).is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one_leaves_everything_as_it_is() {
        let ranks = Ranks::single();
        assert_eq!(ranks.world(), World::SINGLE);
        let g = Grads::F32(vec![1.5, -2.0]);
        assert_eq!(ranks.reduce_scatter_mean_grads(g.clone()).unwrap(), g);
        assert_eq!(ranks.all_gather_shards(&[1, 2, 3, 4], 2, 2).unwrap(), vec![1, 2, 3, 4]);
        let mut v = [3.0, 4.0];
        ranks.all_reduce_sum_f64(&mut v).unwrap();
        assert_eq!(v, [3.0, 4.0]);
        assert_eq!(ranks.all_gather_f64(7.0).unwrap(), vec![7.0]);
        ranks.abort(1);
        // The no-op collectives are right for one rank when called directly too.
        let mut recv = [0.0f32; 2];
        SingleProcess.reduce_scatter_sum_f32(&[1.0, 2.0], &mut recv).unwrap();
        assert_eq!(recv, [1.0, 2.0]);
        let mut all = [0u8; 3];
        SingleProcess.all_gather_bytes(&[7, 8, 9], &mut all).unwrap();
        assert_eq!(all, [7, 8, 9]);
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
    fn another_engine_s_world_is_checked_and_a_world_of_one_calls_nothing() {
        let bad = Ranks::new(World { rank: 2, size: 2, local_rank: 0 }, Arc::new(Unreachable));
        assert!(matches!(bad, Err(DistError::BadWorld { rank: 2, size: 2 })), "{bad:?}");
        let empty = Ranks::new(World { rank: 0, size: 0, local_rank: 0 }, Arc::new(Unreachable));
        assert!(matches!(empty, Err(DistError::BadWorld { .. })), "{empty:?}");
        let one = Ranks::new(World::SINGLE, Arc::new(Unreachable)).expect("a world of one");
        assert_eq!(one.world(), World::SINGLE);
        let mut v = [1.0];
        one.all_reduce_sum_f64(&mut v).unwrap();
        assert_eq!(v, [1.0]);
        assert_eq!(one.all_gather_f64(2.0).unwrap(), vec![2.0]);
    }

    /// Two ranks whose engine fails every call.
    struct Failing;
    impl Collectives for Failing {
        fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<(), String> {
            Err("rank 1 died".into())
        }
        fn reduce_scatter_sum_f32(&self, _: &[f32], _: &mut [f32]) -> Result<(), String> {
            Err("rank 1 died".into())
        }
        fn all_gather_bytes(&self, _: &[u8], _: &mut [u8]) -> Result<(), String> {
            Err("rank 1 died".into())
        }
    }

    #[test]
    fn a_failed_collective_is_an_error_naming_it_and_the_rank() {
        let ranks = Ranks::new(World { rank: 0, size: 2, local_rank: 0 }, Arc::new(Failing)).unwrap();
        let e = ranks.all_reduce_sum_f64(&mut [1.0]).unwrap_err();
        assert!(matches!(&e, DistError::Collective { op: "all-reduce (sum, f64)", rank: 0, size: 2, .. }), "{e:?}");
        assert!(e.to_string().contains("rank 1 died"), "{e}");
        let e = ranks.reduce_scatter_mean_grads(Grads::F32(vec![1.0; 4])).unwrap_err();
        assert!(matches!(e, DistError::Collective { op: "reduce-scatter (sum, f32)", .. }), "{e:?}");
        let e = ranks.all_gather_shards(&[0; 4], 4, 1).unwrap_err();
        assert!(matches!(e, DistError::Collective { op: "all-gather (bytes)", .. }), "{e:?}");
        assert!(ranks.all_gather_f64(1.0).is_err());
        // The default abort returns: the caller ends the process.
        ranks.abort(1);
    }

    #[test]
    fn the_shards_cover_a_unit_once_in_rank_order_on_whole_blocks() {
        let b = SHARD_ALIGN;
        let cases = [(10, 3), (9, 3), (1, 4), (0, 2), (7, 1), (5, 8), (3 * b, 2), (1000, 3), (4 * b + 1, 4), (5000, 7)];
        for (numel, ranks) in cases {
            let (mut next, mut empty) = (0, 0);
            for rank in 0..ranks {
                let r = shard_range(numel, rank, ranks);
                assert_eq!(r.start, next, "numel {numel}, rank {rank} of {ranks}");
                // A shard starts on a block; an empty one sits at the unit's end.
                assert!(r.start % b == 0 || r.start == numel, "numel {numel}, rank {rank} of {ranks}: {r:?}");
                assert!(r.len() <= shard_len(numel, ranks));
                // Whole blocks but at the unit's end: the shard's blocks are the unit's.
                assert!(r.end == numel || r.len() % b == 0, "numel {numel}, rank {rank} of {ranks}: {r:?}");
                empty += usize::from(r.is_empty());
                next = r.end;
            }
            assert_eq!(next, numel, "numel {numel} over {ranks} ranks");
            assert_eq!(shard_range(numel, 0, 1), 0..numel);
            // A unit of one block or less is rank 0's alone.
            if numel <= b {
                assert_eq!(empty, ranks - usize::from(numel > 0), "numel {numel} over {ranks} ranks");
            }
            assert_eq!(every_rank_holds(numel, ranks), empty == 0, "numel {numel} over {ranks} ranks");
        }
        // The per-rank size: ⌈numel / ranks⌉ rounded up to a block.
        assert_eq!(shard_len(1000, 3), 512);
        assert_eq!(shard_range(1000, 1, 3), 512..1000);
        assert_eq!(shard_range(1000, 2, 3), 1000..1000);
        assert_eq!(shard_len(4 * b, 4), b);
        for (numel, ranks) in [(12345, 5), (99, 2), (2 * b, 2)] {
            let per = shard_len(numel, ranks);
            assert!(per >= numel.div_ceil(ranks) && per < numel.div_ceil(ranks) + b, "{numel} / {ranks}: {per}");
        }
    }

    /// Two ranks' engine in one process: what each rank sends, recorded beforehand.
    struct Recorded(Vec<Vec<u8>>);
    impl Collectives for Recorded {
        fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<(), String> {
            unreachable!("only all-gathers here")
        }
        fn reduce_scatter_sum_f32(&self, _: &[f32], _: &mut [f32]) -> Result<(), String> {
            unreachable!("only all-gathers here")
        }
        fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), String> {
            // Every rank's block padded to one length, as each rank sends it.
            for (k, chunk) in recv.chunks_mut(send.len()).enumerate() {
                assert!(self.0[k].len() <= send.len(), "rank {k} sends more than one padded block");
                chunk.fill(0);
                chunk[..self.0[k].len()].copy_from_slice(&self.0[k]);
            }
            Ok(())
        }
    }

    #[test]
    fn block_values_gather_as_one_process_s_blocks() {
        // A unit of 3 blocks and a bit over 2 ranks: rank 0 holds blocks 0, 1; rank 1 blocks 2, 3.
        let numel = 3 * SHARD_ALIGN + 5;
        let per_rank: Vec<Vec<u8>> = (0..2)
            .map(|r| {
                let range = shard_range(numel, r, 2);
                let first = range.start / SHARD_ALIGN;
                (first..first + range.len().div_ceil(SHARD_ALIGN)).map(|k| k as u8 + 10).collect()
            })
            .collect();
        assert_eq!(per_rank, [vec![10, 11], vec![12, 13]]);
        for rank in 0..2 {
            let world = World { rank, size: 2, local_rank: rank };
            let ranks = Ranks::new(world, Arc::new(Recorded(per_rank.clone()))).unwrap();
            assert_eq!(ranks.all_gather_shard_blocks(&per_rank[rank], numel, 1).unwrap(), [10, 11, 12, 13]);
        }
        // A unit of one block: rank 1 holds nothing, sends nothing but padding.
        let one = [vec![7u8, 0, 0, 0], vec![]];
        let ranks = Ranks::new(World { rank: 1, size: 2, local_rank: 1 }, Arc::new(Recorded(one.to_vec()))).unwrap();
        assert_eq!(ranks.all_gather_shard_blocks(&[], 100, 4).unwrap(), [7, 0, 0, 0]);
        assert_eq!(ranks.all_gather_shards(&[], 100, 1).unwrap().len(), 100);
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
