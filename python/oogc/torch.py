"""``oogc.torch.offload``: a ``torch.nn.Module`` trained out of GPU core by the oogc runtime.

The submodules given as ``units`` (a Hugging Face model's embedding, each decoder layer, the
final norm with the head) become the runtime's units: their parameters are flattened into one
vector per unit, handed to the runtime (which keeps the fp32 master weights and the AdamW state
in host memory or on NVMe) and dropped from the module. Then, for each call of a unit's module:

* **forward** (grad enabled): the unit is fetched (``Runtime.fetch(unit, "forward")``), its
  parameters are bound as views into the fetched buffer (``torch.func.functional_call``), the
  module runs without building a graph, and the unit is released. Only the unit's inputs are
  kept: activations are checkpointed at unit boundaries.
* **backward**: the unit is fetched again (``"backward"``), the call is recomputed with the
  graph (same RNG state), its input and parameter gradients are taken, and the unit is
  released; when every call of the unit in this step is done, its flat gradient is pushed
  (``push_grads``) at once, so the CPU AdamW updates it while the backward goes on.
* **no grad** (evaluation): fetched with ``"eval"`` (off the recorded schedule), no graph.

``engine.step()`` ends the step (the runtime's AdamW replaces the torch optimizer);
``engine.zero_grad()`` is a no-op kept for loops that call it. Prefetch follows the schedule
the runtime recorded in the first step, as in Rust.

**Precision.** The units' compute copies — the tensors the modules run with, in every tier —
and the gradients pushed are in the runtime's compute dtype, which is the model's parameter
dtype: a float32 model trains in fp32; a bfloat16 model (``model.to(torch.bfloat16)``) in mixed
precision, with bf16 unit tensors and bf16 gradients (half of fp32's bytes on every link) over
fp32 master weights and AdamW state, each update rounding the new masters to bf16 (nearest
even) for the next forward. Without ``compute_dtype`` in the config, :func:`offload` takes the
model's; a config that names another is refused. The masters start as the model's values,
up-cast exactly. (A float16 model works the same way, without loss scaling: gradients below
float16's range are lost; bfloat16 is the mixed precision to use.)

Limits (each raises :class:`oogc.UsageError` naming what to change): one forward and one
backward per step (no gradient accumulation across micro-batches yet); every trainable
parameter of the model belongs to exactly one unit (a parameter shared by two units, e.g. tied
embeddings, puts both modules in one unit); no frozen parameters inside a unit; float32,
bfloat16 or float16 parameters, one dtype for every unit. On CUDA (the ``cuda`` build of the
wheel, ``device = {"kind": "cuda:0"}``) the model's parameters are still given on the CPU; the
unit tensors the modules run with are CUDA tensors shared through DLPack, the inputs must be
CUDA tensors, the recompute replays the CUDA generator too, and the gradients pushed are CUDA
tensors (copied to the host by the binding). That path is what ``oogc gpu-check``'s check 10
runs on a GPU; CI runs the same script on the sim device. Fetches here are read-only, so no
write pin is released from this module; the binding's release synchronises torch's current
stream on CUDA before unpinning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from oogc._oogc import Runtime, UsageError, init_ranks

__all__ = ["Engine", "offload"]

# The runtime's compute dtypes (``Runtime.compute_dtype``) and torch's.
_TORCH_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_OOGC_DTYPE = {v: k for k, v in _TORCH_DTYPE.items()}

UnitSpec = Union[nn.Module, Sequence[nn.Module]]
LrSpec = Union[float, Callable[[int], float]]


@dataclass
class _Slot:
    """One parameter of a unit: its slice of the flat vector and every (module, name) holding it."""

    offset: int
    shape: torch.Size
    holders: List[Tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Unit:
    """A unit: modules whose parameters form one flat vector (of ``dtype``) in the runtime."""

    def __init__(self, index: int, name: str, modules: List[nn.Module]):
        self.index = index
        self.name = name
        self.modules = modules
        self.slots: List[_Slot] = []
        self.numel = 0
        # The parameters' dtype (one per unit) and the qualified name of the first parameter
        # that has it (for messages).
        self.dtype: Optional[torch.dtype] = None
        self.dtype_of = ""
        # This step: calls whose backward is still to come, and the gradient summed so far.
        self.pending = 0
        self.grad: Optional[torch.Tensor] = None

    def views(self, flat: torch.Tensor, module: nn.Module) -> Dict[str, torch.Tensor]:
        """``module``'s parameters as views into ``flat`` (names relative to ``module``)."""
        out: Dict[str, torch.Tensor] = {}
        for slot in self.slots:
            view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for holder, qualified in slot.holders:
                if holder is module:
                    out[qualified] = view
        return out


class _UnitCall(torch.autograd.Function):
    """One call of a unit's module: forward without a graph, recomputed in the backward."""

    @staticmethod
    def forward(ctx, call: "_Call", anchor: torch.Tensor, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.call = call
        ctx.save_for_backward(*tensors)
        ctx.rng = torch.get_rng_state()
        cuda = [t.device for t in tensors if t.is_cuda][:1]
        ctx.cuda_rng = torch.cuda.get_rng_state(cuda[0]) if cuda else None
        outs = call.run(tensors, "forward", grad=False)
        leaves, call.out_spec = pytree.tree_flatten(outs)
        call.out_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        call.out_other = [None if t else x for x, t in zip(leaves, call.out_is_tensor)]
        tensor_outs = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*(t for t in tensor_outs if not t.is_floating_point()))
        return tensor_outs

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor):  # type: ignore[override]
        call: _Call = ctx.call
        engine = call.engine
        engine._begin_backward()
        saved = ctx.saved_tensors
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        # The recompute replays the forward's random numbers: the CPU generator's, and the
        # current CUDA device's when the call's tensors are CUDA tensors.
        cuda = [t.device for t in saved if t.is_cuda][:1]
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(ctx.rng)
            if cuda:
                torch.cuda.set_rng_state(ctx.cuda_rng, cuda[0])
            with torch.enable_grad():
                outs, flat = call.run(inputs, "backward", grad=True)
                leaves = [x for x in pytree.tree_leaves(outs) if isinstance(x, torch.Tensor)]
                pairs = [(o, g) for o, g in zip(leaves, grad_outs) if o.requires_grad and g is not None]
                wrt = [flat] + [t for t in inputs if t.requires_grad]
                if pairs:
                    grads = torch.autograd.grad(
                        [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                    )
                else:
                    grads = tuple(None for _ in wrt)
        call.release()
        engine._unit_grad(call.unit, grads[0])
        it = iter(grads[1:])
        input_grads = tuple(next(it) if t.requires_grad else None for t in inputs)
        return (None, None, *input_grads)


class _Call:
    """The state of one module call between its forward and its backward."""

    def __init__(self, engine: "Engine", unit: _Unit, module: nn.Module, forward: Callable, args, kwargs):
        self.engine = engine
        self.unit = unit
        self.module = module
        self.forward = forward
        leaves, self.in_spec = pytree.tree_flatten((args, kwargs))
        self.in_is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.in_other = [None if t else x for x, t in zip(leaves, self.in_is_tensor)]
        self.in_tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        self.fetched: Any = None
        self.out_spec: Any = None
        self.out_is_tensor: List[bool] = []
        self.out_other: List[Any] = []

    def _args(self, tensors: Iterable[torch.Tensor]):
        it = iter(tensors)
        leaves = [next(it) if t else o for t, o in zip(self.in_is_tensor, self.in_other)]
        return pytree.tree_unflatten(leaves, self.in_spec)

    def run(self, tensors, phase: str, grad: bool):
        """Fetches the unit and runs the module on ``tensors`` with its parameters bound.
        Without ``grad`` the unit is released before returning; with it the caller releases
        (after taking the gradients) and gets the flat parameter leaf too."""
        self.fetched = self.engine.runtime.fetch(self.unit.index, phase)
        flat = self.fetched.tensor()
        if grad:
            flat = flat.detach().requires_grad_()
        args, kwargs = self._args(tensors)
        try:
            # The module's own forward (its __call__ would come back here), with the parameters
            # swapped for the views for the call's length.
            with _reparametrize_module(self.module, self.unit.views(flat, self.module)):
                outs = self.forward(*args, **kwargs)
        except BaseException:
            self.release()
            raise
        if not grad:
            self.release()
            return outs
        return outs, flat

    def release(self) -> None:
        if self.fetched is not None:
            self.fetched.release()
            self.fetched = None

    def outputs(self, tensor_outs: Sequence[torch.Tensor]):
        it = iter(tensor_outs)
        leaves = [next(it) if t else o for t, o in zip(self.out_is_tensor, self.out_other)]
        return pytree.tree_unflatten(leaves, self.out_spec)


class Engine:
    """A model offloaded by :func:`offload`: call it as the model; then ``step()``.

    Attributes:
        model: the wrapped module (its units' parameters are empty placeholders between calls).
        runtime: the :class:`oogc.Runtime` holding the units.
        lr: the learning rate, a float or a function of the 1-based step.
        dtype: the units' compute dtype (``torch.float32``, ``torch.bfloat16`` or
            ``torch.float16``): the model's parameter dtype, the unit tensors' and the gradients'.
        last_stats: the last finished step's stats (``Runtime.finish_step``), or ``None``.
    """

    def __init__(self, model: nn.Module, units: List[_Unit], runtime: Runtime, lr: LrSpec):
        self.model = model
        self.runtime = runtime
        self.lr = lr
        self.dtype = _TORCH_DTYPE[runtime.compute_dtype]
        self.last_stats: Optional[Dict[str, Any]] = None
        self._units = units
        self._step = runtime.step
        self._in_step = False
        self._in_backward = False
        self._anchor = torch.zeros((), requires_grad=True)
        # Where the units' tensors are: the CPU on the sim device, the GPU on CUDA.
        kind = runtime.device
        self._device = torch.device("cuda", int(kind.split(":")[1])) if kind.startswith("cuda:") else torch.device("cpu")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (``model(*args, **kwargs)`` does the same)."""
        return self.model(*args, **kwargs)

    @property
    def units(self) -> List[Tuple[str, int]]:
        """``(name, numel)`` of each unit, in registration order."""
        return [(u.name, u.numel) for u in self._units]

    @property
    def step_count(self) -> int:
        """Steps finished (the Adam step of the last one)."""
        return self._step

    def current_lr(self) -> float:
        """The learning rate of the step that is (or would be) running."""
        step = self._step + 1
        return float(self.lr(step) if callable(self.lr) else self.lr)

    def _begin(self) -> None:
        if not self._in_step:
            self.runtime.begin_step(self._step + 1, self.current_lr())
            self._in_step = True
            self._in_backward = False

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self.runtime.end_forward()

    def _unit_grad(self, unit: _Unit, grad: Optional[torch.Tensor]) -> None:
        if grad is None:
            # On the device the unit's tensors live on (the runtime's CPU or CUDA tensors).
            device = unit.grad.device if unit.grad is not None else self._device
            grad = torch.zeros(unit.numel, dtype=self.dtype, device=device)
        if unit.grad is None:
            unit.grad = grad
        else:
            unit.grad = unit.grad + grad
        unit.pending -= 1
        if unit.pending == 0:
            g, unit.grad = unit.grad, None
            self.runtime.push_grads(unit.index, g.contiguous())

    def _call(self, unit: _Unit, module: nn.Module, forward: Callable, args, kwargs):
        if not torch.is_grad_enabled():
            call = _Call(self, unit, module, forward, args, kwargs)
            return call.run(call.in_tensors, "eval", grad=False)
        if self._in_backward:
            raise UsageError(
                f"unit {unit.name!r} ran forward after this step's backward began: one forward and one "
                "backward per step (call engine.step() between them; gradient accumulation is not supported yet)"
            )
        self._begin()
        call = _Call(self, unit, module, forward, args, kwargs)
        unit.pending += 1
        tensor_outs = _UnitCall.apply(call, self._anchor, *call.in_tensors)
        return call.outputs(tensor_outs)

    def step(self) -> Dict[str, Any]:
        """Ends the step: waits until every unit's gradients went to the optimizer, then
        commits the updates (or skips the step on a non-finite gradient norm). Returns the
        step's stats (``Runtime.finish_step``: ``step``, ``step_s``, ``h2d_bytes``,
        ``d2h_bytes`` — the gradients pushed, in the compute dtype: 2 bytes a parameter in
        bf16, 4 in fp32 —, ``nvme_read_bytes``, ``nvme_write_bytes``, ``grad_norm``, ...).

        Raises:
            UsageError: no step is running (no forward since the last ``step()``), or a unit's
                backward did not run (its gradients are missing).
        """
        if not self._in_step:
            raise UsageError("engine.step(): no forward ran since the last step")
        missing = [u.name for u in self._units if u.pending > 0]
        if missing:
            self._in_step = False
            for u in self._units:
                u.pending, u.grad = 0, None
            raise UsageError(f"engine.step(): the backward of units {missing} did not run (call loss.backward() first)")
        stats = self.runtime.finish_step()
        self._in_step = False
        self._in_backward = False
        if not stats["skipped"]:
            self._step = stats["step"]
        self.last_stats = stats
        return stats

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: gradients go to the runtime as the backward makes them."""

    def state_dict(self) -> Dict[str, Any]:
        """The runtime's state (``Runtime.state_dict``: per unit the master weights and AdamW
        moments, flat float32 whatever the compute dtype) with the step count."""
        return self.runtime.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (units with the same names and sizes)."""
        self.runtime.load_state_dict(dict(state_dict))
        self._step = self.runtime.step

    def unit_parameters(self, unit: Union[int, str]) -> Dict[str, torch.Tensor]:
        """A unit's fp32 master weights as ``{qualified parameter name: tensor}`` (float32
        copies whatever the compute dtype; after the pending updates are done). In bf16 the
        tensors the modules run with are these rounded to nearest even."""
        u = self._units[self.runtime.unit_id(unit)]
        master, _, _ = self.runtime.unit_state(u.index)
        out = {}
        for slot in u.slots:
            module, name = slot.holders[0]
            out[_qualified(self.model, module, name)] = master[slot.offset : slot.offset + slot.numel].view(slot.shape)
        return out

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Every unit's fp32 master weights by qualified name (see :meth:`unit_parameters`)."""
        out: Dict[str, torch.Tensor] = {}
        for u in self._units:
            out.update(self.unit_parameters(u.index))
        return out


def _qualified(model: nn.Module, module: nn.Module, name: str) -> str:
    for prefix, m in model.named_modules(remove_duplicate=False):
        if m is module:
            return f"{prefix}.{name}" if prefix else name
    return name


def _unit_name(model: nn.Module, modules: List[nn.Module]) -> str:
    names = []
    for module in modules:
        for prefix, m in model.named_modules():
            if m is module:
                names.append(prefix or "<root>")
                break
        else:
            raise UsageError(f"offload: a unit's module {type(module).__name__} is not a submodule of the model")
    return "+".join(names)


class _TorchCollectives:
    """The runtime's collectives (``oogc::dist::Collectives``) over a torch.distributed process
    group: what ``offload(..., process_group=...)`` hands the runtime. Each method takes a
    ``bytearray`` (viewed with ``torch.frombuffer``) and returns one; the runtime calls them from
    its gradient thread and from the caller's, never two at once, in the same order on every rank.

    On a gloo group the reduce-scatter is an all-reduce of which this rank keeps its block (gloo
    has no reduce-scatter of flat tensors in every torch version); on NCCL the buffers go to the
    current CUDA device and back (``reduce_scatter_tensor``)."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.nccl else torch.device("cpu")

    def _tensor(self, buf: bytearray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.frombuffer(buf, dtype=dtype)
        return t.to(self.device) if self.nccl else t

    @staticmethod
    def _bytes(t: torch.Tensor) -> bytearray:
        out = bytearray(t.numel() * t.element_size())
        torch.frombuffer(out, dtype=t.dtype).copy_(t.reshape(-1))
        return out

    def all_reduce_sum_f64(self, buf: bytearray) -> bytearray:
        t = self._tensor(buf, torch.float64)
        self._dist.all_reduce(t, group=self.group)
        return self._bytes(t)

    def reduce_scatter_sum_f32(self, buf: bytearray, block: int) -> bytearray:
        t = self._tensor(buf, torch.float32)
        if self.nccl:
            out = torch.empty(block, dtype=torch.float32, device=self.device)
            self._dist.reduce_scatter_tensor(out, t, group=self.group)
        else:
            self._dist.all_reduce(t, group=self.group)
            out = t[self.rank * block : (self.rank + 1) * block]
        return self._bytes(out)

    def all_gather_bytes(self, buf: bytearray) -> bytearray:
        t = self._tensor(buf, torch.uint8)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._dist.all_gather(parts, t, group=self.group)
        return self._bytes(torch.cat(parts))


def _join_ranks(process_group: Any) -> None:
    """Makes this process a rank of ``process_group`` for the runtime (``init_ranks``), over a
    private copy of the group, so that the runtime's collectives (some from its gradient thread,
    while the backward runs) never interleave with the trainer's own on the group."""
    import os

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            "offload(process_group=...): torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() first (under torchrun: backend 'gloo' on the CPU, 'nccl' on GPUs)"
        )
    ranks = dist.get_process_group_ranks(process_group)
    private = dist.new_group(ranks=ranks, backend=dist.get_backend(process_group))
    rank = dist.get_rank(process_group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    init_ranks(rank, len(ranks), local_rank, _TorchCollectives(private))


def offload(
    model: nn.Module,
    units: Sequence[UnitSpec],
    config: Union[Mapping[str, Any], str],
    *,
    lr: LrSpec = 1e-3,
    process_group: Any = None,
) -> Engine:
    """Offloads ``model``'s given submodules through an oogc runtime.

    Args:
        model: the model; its parameters must be on the CPU (on the sim device and on CUDA) and of one dtype,
            float32, bfloat16 or float16, which becomes the runtime's compute dtype: the unit
            tensors the modules run with and the gradients pushed are in it, the master weights
            and AdamW state are fp32 (for mixed precision, ``model.to(torch.bfloat16)``).
        units: one entry per unit, in the order the forward runs them: a submodule, or a
            sequence of submodules sharing one unit (e.g. ``(model.model.norm, model.lm_head)``).
            Every trainable parameter of ``model`` must be in exactly one unit.
        config: the runtime's config (a dict or a TOML path; see :class:`oogc.Runtime`). Its
            ``compute_dtype``, if given, must be the model's (``"f32"`` for float32, ``"bf16"``
            for bfloat16, ``"f16"`` for float16); without it the model's is taken.
        lr: the learning rate: a float, or a function of the 1-based step returning one (the
            step's lr is taken when its first forward begins).
        process_group: data-parallel ranks (``torch.distributed.group.WORLD`` or a group of
            one's own, under ``torchrun``): each rank runs the same model on its own batch; the
            runtime averages each unit's gradients over the ranks (a reduce-scatter as the
            backward pushes them), keeps only this rank's shard of the fp32 master weights and
            AdamW state (ZeRO-style: ``ceil(numel / world size)`` of every unit, on the host or
            in this rank's NVMe directory: ``{rank}``/``{local_rank}`` in ``nvme_dirs``, else a
            ``rank{r}`` subdirectory), clips by the global norm, and all-gathers the updated
            parameters at ``engine.step()``. The collectives run over a private copy of the
            group (``new_group``, so every rank of the default group must call ``offload``),
            gloo on the CPU, NCCL on GPUs. ``engine.parameters()``, ``state_dict()`` and
            ``unit_parameters()`` gather the shards: call them on every rank. One world per
            process. ``None`` (default): this process trains alone.

    Returns:
        The :class:`Engine`. The units' parameters are moved into the runtime: ``model``'s
        parameters are left as empty placeholders (``numel() == 0``), so a torch optimizer
        over them does nothing; read the trained weights (fp32 masters) with
        ``engine.parameters()``.

    Raises:
        UsageError: a unit's module is not in ``model``, a parameter is in two units, a
            trainable parameter is in no unit, a unit has a frozen parameter or one of another
            dtype than float32, bfloat16 or float16, or not on the CPU; a unit mixes dtypes, or
            two units have different ones; the config's ``compute_dtype`` is not the model's.
        ConfigError, OutOfMemoryError, StorageError: from ``Runtime(config)`` and ``add_unit``.
    """
    owner: Dict[int, int] = {}
    built: List[_Unit] = []
    inits: List[torch.Tensor] = []
    for index, spec in enumerate(units):
        modules = [spec] if isinstance(spec, nn.Module) else list(spec)
        unit = _Unit(index, _unit_name(model, modules), modules)
        by_param: Dict[int, _Slot] = {}
        values: List[torch.Tensor] = []
        for module in modules:
            for qualified, p in module.named_parameters(remove_duplicate=False):
                pid = id(p)
                if pid in owner and owner[pid] != index:
                    raise UsageError(
                        f"offload: parameter {qualified!r} of unit {unit.name!r} is also in unit "
                        f"{built[owner[pid]].name!r}: put modules that share a parameter in one unit"
                    )
                if not p.requires_grad:
                    raise UsageError(f"offload: {unit.name}.{qualified} is frozen; frozen parameters in a unit are not supported yet")
                if p.dtype not in _OOGC_DTYPE or p.device.type != "cpu":
                    raise UsageError(
                        f"offload: {unit.name}.{qualified} is {p.dtype} on {p.device}; units take float32, "
                        "bfloat16 or float16 CPU parameters"
                    )
                if unit.dtype is None:
                    unit.dtype, unit.dtype_of = p.dtype, _qualified(model, module, qualified)
                elif p.dtype != unit.dtype:
                    raise UsageError(
                        f"offload: unit {unit.name!r} mixes dtypes: {unit.dtype_of} is {unit.dtype} but "
                        f"{_qualified(model, module, qualified)} is {p.dtype}; a unit is one flat tensor of one "
                        f"dtype: convert the model to one dtype (e.g. model.to({unit.dtype}))"
                    )
                owner[pid] = index
                slot = by_param.get(pid)
                if slot is None:
                    slot = _Slot(unit.numel, p.shape)
                    by_param[pid] = slot
                    unit.slots.append(slot)
                    unit.numel += p.numel()
                    values.append(p.detach().reshape(-1))
                slot.holders.append((module, qualified))
        if unit.numel == 0:
            raise UsageError(f"offload: unit {unit.name!r} has no parameters")
        if built and unit.dtype != built[0].dtype:
            first = built[0]
            raise UsageError(
                f"offload: unit {unit.name!r} is {unit.dtype} ({unit.dtype_of}) but unit {first.name!r} is "
                f"{first.dtype} ({first.dtype_of}); the runtime has one compute dtype: convert the model to "
                f"one dtype (e.g. model.to({first.dtype}))"
            )
        inits.append(torch.cat(values))
        built.append(unit)
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if stray:
        raise UsageError(
            f"offload: trainable parameters in no unit: {stray[:8]}{' ...' if len(stray) > 8 else ''} "
            "(add their modules to a unit, or freeze them with requires_grad_(False))"
        )
    if not built:
        raise UsageError("offload: no units given")
    model_dtype = built[0].dtype
    assert model_dtype is not None
    if process_group is not None:
        _join_ranks(process_group)
    runtime = Runtime(config, default_compute_dtype=_OOGC_DTYPE[model_dtype])
    if _TORCH_DTYPE[runtime.compute_dtype] != model_dtype:
        want = _OOGC_DTYPE[model_dtype]
        raise UsageError(
            f"offload: the model's parameters are {model_dtype} ({built[0].dtype_of}) but the config's "
            f"compute_dtype is {runtime.compute_dtype!r}, and the units' tensors the modules run with are "
            f"in the compute dtype: set compute_dtype = {want!r} in the config (or leave it out to follow "
            f"the model), or convert the model with model.to({_TORCH_DTYPE[runtime.compute_dtype]})"
        )
    for unit, init in zip(built, inits):
        # The fp32 masters are the values up-cast exactly; the compute copy is the values.
        runtime.add_unit(unit.name, unit.numel, init)
    engine = Engine(model, built, runtime, lr)
    placeholder_params = {id(p): p for u in built for m in u.modules for p in m.parameters()}
    for p in placeholder_params.values():
        # The runtime holds the values now; the module keeps an empty placeholder of its dtype.
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    for unit in built:
        for module in unit.modules:
            _wrap(engine, unit, module)
    return engine


def _wrap(engine: Engine, unit: _Unit, module: nn.Module) -> None:
    forward = module.forward

    def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
        return engine._call(unit, module, forward, args, kwargs)

    offloaded_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    module.forward = offloaded_forward  # type: ignore[method-assign]

