"""Type stubs of the extension module ``oogc._oogc`` (the Rust ``Runtime`` through PyO3).

Units: sizes in bytes unless named otherwise; ``numel`` counts elements (of the compute dtype
for compute copies and gradients, float32 for master weights and Adam moments: a unit of
``numel`` parameters moves ``2 * numel`` bytes per copy in bf16, ``4 * numel`` in fp32); times in
seconds; link rates in GB/s (10⁹ bytes per second).

Dtypes: a runtime's compute dtype (``Runtime.compute_dtype``: ``"f32"``, ``"bf16"`` or
``"f16"``) is the element type of every unit's compute copy in every tier — the tensors
``Fetched.tensor`` returns are ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``
(DLPack ``kDLFloat`` 32, ``kDLBfloat`` 16, ``kDLFloat`` 16) — and of the gradients sent D2H; the
master weights and Adam state are float32 with the CPU optimizer.
"""

from os import PathLike
from types import TracebackType
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Type, Union

import torch

Phase = Literal["forward", "backward", "eval"]
ComputeDType = Literal["f32", "bf16", "f16"]
UnitRef = Union[int, str]

class OogcError(Exception):
    """Every error oogc raises; the message is the Rust error's, unchanged."""

class ConfigError(OogcError):
    """A bad config key or value; the message names the key (``budgets.gpu: ...``)."""

class UsageError(OogcError):
    """A call out of order or with a wrong argument: unknown unit, dtype, rank, length, a
    released fetch, ``add_unit`` after the first step."""

class OutOfMemoryError(OogcError):
    """A budget below the minimum working set, or a tier out of memory; gives the bytes."""

class StorageError(OogcError):
    """NVMe: a missing directory, too little free space, an I/O error, a corrupt block."""

class DeviceError(OogcError):
    """No CUDA device, CUDA not compiled in, a driver error."""

class Fetched:
    """A unit pinned on the device by :meth:`Runtime.fetch` until released.

    As a context manager, ``with rt.fetch(u) as t:`` yields :meth:`tensor` and releases on exit.

    Release revokes: every tensor :meth:`tensor` returned (and every view of it) raises
    ``RuntimeError("oogc: the parameters of unit ... were released ...")`` on any access to its
    data afterwards (torch's storage access-error hook), then the unit is unpinned and may be
    evicted; its memory is never read through a revoked tensor. A borrowed export
    (``torch.from_dlpack(fetched)``, ``numpy.from_dlpack(fetched)``) instead keeps the unit
    pinned until the consumer frees the array, even past release. Collected without
    ``release()``, a ``Fetched`` releases itself.

    On a CUDA runtime (the wheel built with the ``cuda`` feature) the unit's memory is on the
    GPU: :meth:`tensor` is a CUDA tensor on the runtime's GPU and the DLPack device is
    ``kDLCUDA`` (``(2, ordinal)``). The unit's H2D was waited for before :meth:`Runtime.fetch`
    returned, so the memory is ready for any stream (``__dlpack__``'s ``stream`` needs no
    event). Release synchronises torch's current stream of that GPU before unpinning (kernels
    torch queued on the unit, writes through a writable fetch included, are done before the
    runtime touches the memory again); work queued on other streams is the caller's to
    synchronise first, and a borrowed export freed after release unpins at once, so its
    consumer synchronises before freeing it.
    """

    @property
    def unit(self) -> int:
        """The unit's id."""
    @property
    def numel(self) -> int:
        """Elements (parameters) of the unit."""
    @property
    def dtype(self) -> ComputeDType:
        """The compute copy's element type (the runtime's compute dtype)."""
    @property
    def writable(self) -> bool:
        """Fetched with ``writable=True``: writes through the tensor are the unit's compute
        copy (until the optimizer publishes its next update)."""
    @property
    def released(self) -> bool:
        """``release()`` was called (or the ``with`` block ended)."""
    @property
    def pinned(self) -> bool:
        """The unit is still pinned (after release: while a borrowed export lives)."""
    def tensor(self) -> torch.Tensor:
        """The unit's flat parameters, ``[numel]`` of :attr:`dtype` (``torch.float32``,
        ``torch.bfloat16`` or ``torch.float16``), on the CPU for the sim device, on the GPU
        (CUDA) for a CUDA runtime: the pinned compute copy itself, not a copy (the same tensor on every call). A read
        fetch's tensor refuses in-place writes and ``data_ptr()`` (torch's mutable accessor).

        Raises:
            UsageError: after release; without torch (>= 2.3).
        """
    def release(self) -> None:
        """Revokes the tensors and unpins the unit (see the class). Idempotent."""
    def __enter__(self) -> torch.Tensor: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A borrowed DLPack capsule of :attr:`dtype` (``kDLBfloat`` 16 bits for bf16; keeps the
        unit pinned until the consumer frees it), on :meth:`__dlpack_device__`. ``stream`` is
        ignored: the memory is ready for any stream when the fetch returns.

        Raises:
            UsageError: after release; ``copy=True``; a ``dl_device`` other than the unit's.
        """
    def __dlpack_device__(self) -> Tuple[int, int]:
        """``(1, 0)`` (``kDLCPU``) for the sim device's memory, ``(2, ordinal)``
        (``kDLCUDA``) for a CUDA runtime's GPU.

        Raises:
            UsageError: after release, unless asked or exported before it.
        """

class Runtime:
    """The out-of-GPU-core runtime for one model on one device (the Rust ``Runtime``).

    Units of flat parameters move between the (sim) GPU, pinned host memory and NVMe as compute
    copies in the compute dtype (f32, or bf16 for mixed precision); a pipelined CPU AdamW keeps
    their fp32 master weights and Adam moments (host or NVMe), updates each unit as soon as its
    gradients arrive and writes the new compute copy (the masters rounded to nearest even).

    A step: ``begin_step(t, lr)``; per unit in forward order ``fetch(u, "forward")``; per unit
    in reverse ``fetch(u, "backward")`` then ``push_grads(u, g)``; ``finish_step()``. The first
    step's order is recorded and drives prefetch and eviction from the second on.

    Args:
        config: a dict or the path of a TOML file with the tables ``device`` (``kind`` =
            ``"sim"``, ``link_gbps`` = 16, ``latency_us`` = 0), ``budgets`` (``gpu`` bytes or a
            size string such as ``"64 MiB"``, required; ``host`` = ``"4 GiB"``;
            ``optimizer_state`` and ``params``: ``"host"`` or ``"nvme"``; ``nvme_dirs``;
            ``nvme_size``, required with NVMe), ``optimizer`` (``kind`` = ``"adamw"``,
            ``betas`` = ``[0.9, 0.95]``, ``eps`` = 1e-8, ``weight_decay`` = 0.1,
            ``clip_norm`` = 1.0 with 0 for none, ``threads`` = 1), ``prefetch`` (``depth`` = 2,
            ``host_depth`` = 4, ``overlap_optimizer`` = true), ``lock_host_memory`` = false,
            ``compute_dtype`` (``oogc train``'s ``[train] compute_dtype``, at the top level:
            ``"f32"``, ``"bf16"`` or ``"f16"``, also spelled ``"float32"``, ``"bfloat16"``,
            ``"float16"``; default ``default_compute_dtype``, else ``"f32"``).
        default_compute_dtype: the compute dtype when the config has no ``compute_dtype``
            (``oogc.torch.offload`` passes the model's).

    Raises:
        ConfigError: an unknown, missing or mistyped key (named); an unknown dtype name.
        StorageError: an NVMe directory missing or too small.
        DeviceError: a CUDA device asked for and absent or not compiled in.
    """

    def __init__(
        self,
        config: Union[Mapping[str, Any], str, PathLike[str]],
        *,
        default_compute_dtype: Optional[str] = None,
    ) -> None: ...
    @property
    def device(self) -> str:
        """Where the units' tensors live: ``"sim"`` (CPU tensors) or ``"cuda:N"``."""
        ...
    @property
    def compute_dtype(self) -> ComputeDType:
        """The compute copies' and gradients' element type."""
    def add_unit(self, name: str, numel: int, init: Optional[Any] = None) -> int:
        """Registers a unit of ``numel`` parameters, before the first step; returns its id
        (0, 1, ... in order). ``init``: its initial values, a 1-D contiguous float32 CPU tensor
        or array of ``numel`` elements (bfloat16 or float16 are up-cast exactly), read in place
        through DLPack; zeros without. They are the fp32 master weights; the compute copy is
        them in the compute dtype (rounded to nearest even).

        Raises:
            UsageError: a duplicate name, ``numel == 0``, ``init`` of another length, dtype,
                rank or device, after the first step began.
            OutOfMemoryError, StorageError: the unit's state does not fit its tier.
        """
    def begin_step(self, step: int, lr: float) -> None:
        """Starts step ``step`` (1-based, Adam's t) with learning rate ``lr``. The first call
        checks the GPU budget against the minimum working set.

        Raises:
            UsageError: ``step == 0``, ``lr`` negative or not finite, a step already running.
            OutOfMemoryError: ``budgets.gpu`` below the minimum working set (gives the bytes).
        """
    def fetch(self, unit: UnitRef, phase: Phase = "forward", writable: bool = False) -> Fetched:
        """Pins ``unit`` on the device (waiting for its pending update and its H2D copy) and
        returns the lease on it; prefetches the next units of the recorded schedule. ``"eval"``
        fetches are off the schedule. Blocks without holding the GIL.

        Raises:
            UsageError: an unknown unit or phase.
            OutOfMemoryError: the device is full of pinned units.
            StorageError: an NVMe read failed.
        """
    def push_grads(self, unit: UnitRef, grads: Any) -> None:
        """Hands ``unit``'s gradients (``[numel]`` float32, bfloat16 or float16, contiguous, CPU
        or CUDA; read in place through DLPack — a CUDA tensor is first copied to the host with
        ``.cpu()``, which waits for torch's current stream (a device-to-device path without the
        host hop is future work) —, converted to the compute dtype —
        rounded to nearest even — if they are not in it, copied D2H into staging: ``2 * numel``
        bytes in bf16, ``4 * numel`` in f32) to the optimizer, once per unit per step; the
        update runs on the CPU (in fp32) while the caller goes on.

        Raises:
            UsageError: an unknown unit, a wrong length, a dtype other than float32, bfloat16
                or float16, a wrong rank or device, no step running.
        """
    def end_forward(self) -> None:
        """Marks the turn from forward to backward (optional; for the per-phase stats)."""
    def finish_step(self) -> Dict[str, Any]:
        """Ends the step: every unit's gradients submitted, the global norm computed, the
        updates committed (or redone with the clip scale, or discarded when the norm is not
        finite). Returns the stats: ``step``, ``step_s``, ``stall_transfer_s``,
        ``stall_optimizer_s``, ``h2d_bytes`` (compute copies fetched), ``d2h_bytes``
        (gradients, in the compute dtype), ``nvme_read_bytes``,
        ``nvme_write_bytes``, ``grad_norm``, ``clip_scale``, ``skipped``, ``forward`` (a dict
        of the forward phase's ``wall_s``, ``stall_s``, ``h2d_bytes``, ``d2h_bytes``).

        Raises:
            UsageError: a unit's gradients were not pushed.
        """
    def sync(self) -> None:
        """Waits for every pending optimizer update."""
    def check_working_set(self) -> None:
        """Checks the GPU budget against the minimum working set now (``begin_step`` does it
        on the first step). Raises OutOfMemoryError."""
    def min_working_set_bytes(self, max_units_in_use: int = 1) -> int:
        """Device bytes the step needs at the least with ``max_units_in_use`` units pinned."""
    def set_max_units_in_use(self, units: int) -> None:
        """How many units the trainer keeps pinned at once (for the working-set check)."""
    @property
    def num_units(self) -> int: ...
    @property
    def units(self) -> List[Tuple[str, int]]:
        """``(name, numel)`` of each unit, in id order."""
    @property
    def step(self) -> int:
        """The last finished, not skipped, step (0 before any)."""
    def unit_id(self, unit: UnitRef) -> int: ...
    def is_on_device(self, unit: UnitRef) -> bool: ...
    def traffic(self) -> Dict[str, Any]:
        """Bytes, operations and busy seconds per link since the start: ``htod``, ``dtoh``,
        ``nvme_read``, ``nvme_write`` (each ``{"bytes", "ops", "busy_s"}``), ``stall_s``,
        ``evictions``, ``prefetch_hits``."""
    def peak_bytes(self) -> Dict[str, int]:
        """Peak bytes held per tier: ``device``, ``host``, ``nvme``, ``host_ledger``."""
    def unit_state(self, unit: UnitRef) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of ``unit``'s master weights, ``exp_avg`` and ``exp_avg_sq`` (``[numel]``
        float32 each, whatever the compute dtype), after its pending update."""
    def load_unit_state(self, unit: UnitRef, master: Any, exp_avg: Any, exp_avg_sq: Any) -> None:
        """Replaces ``unit``'s master weights and moments (``[numel]`` float32 each; the
        compute copy becomes ``master`` in the compute dtype).

        Raises:
            UsageError: a wrong length; a dtype other than float32."""
    def state_dict(self) -> Dict[str, Any]:
        """``{"step": int, "units": {name: {"master", "exp_avg", "exp_avg_sq"}}}``, tensors
        ``[numel]`` float32 (copies). Waits for pending updates."""
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into a runtime with the same units.

        Raises:
            UsageError: a unit missing from either side, a wrong length.
        """


def init_ranks(rank: int, world_size: int, local_rank: int, collectives: Any) -> None:
    """Makes this process rank ``rank`` of ``world_size`` (``local_rank`` on its node) for every
    runtime made after it: each holds this rank's shard (``ceil(numel / world_size)`` elements of
    every unit) of the fp32 master weights and AdamW state, reduce-scatters each unit's
    gradients (f32 sums divided by the world size), all-reduces the global norm and all-gathers
    the new compute copies through ``collectives``: an object with
    ``all_reduce_sum_f64(buf: bytearray) -> bytearray``,
    ``reduce_scatter_sum_f32(buf: bytearray, block: int) -> bytearray`` (``buf``: ``world_size``
    blocks of ``block`` f32; returns this rank's block summed) and
    ``all_gather_bytes(buf: bytearray) -> bytearray`` (every rank's equal ``buf`` in rank
    order), called from the runtime's gradient thread too (with the GIL), one at a time, in the
    same order on every rank. A method that raises makes the runtime call that needed it raise
    ``OogcError`` with its message (from the gradient thread: at the next call that waits for
    it); the ranks are then out of step and the run cannot go on. ``oogc.torch.offload(..., process_group=...)`` calls this with
    ``oogc.torch._TorchCollectives``. Once per process; again with the same world, a no-op.

    Raises:
        UsageError: another world was set already, or ``rank`` is not below ``world_size``.
    """


def world() -> Tuple[int, int, int]:
    """This process's ``(rank, world_size, local_rank)``; ``(0, 1, 0)`` without ranks."""

