"""The checkpoint engine: one checkpointed call, from its forward to its recomputation.

NOTE [ The engine's rules ]

A checkpointed call runs its block once in the forward, recording the block's autograd graph as
usual, except that every tensor the graph saves for backward becomes a placeholder. In backward
a *gate* (an autograd Function over the block's outputs) runs first, recomputes what the
placeholders stand for, and hands the gradients on to the block's own graph. These rules hold
everywhere below; the code cites them.

Rule 1 (one barrier over everything the recomputation reads). The saved inputs, the values a
  save policy kept, the incoming output gradients, the owners' parameters and buffers, and the
  seeds of the block's random draws (Rule 9) go through ONE optimization barrier together, and
  the recomputation and the block's backward read only its outputs. Reading from the barrier
  makes the recomputation a new value for XLA (CSE cannot merge it back into the forward) and
  makes it wait for the gradients (it cannot be scheduled early, where it would keep the
  activations alive again). JAX's recipe; docs/index.md.
  Eager paths have nothing to reorder: there the recomputation reads the values themselves
  (as PyTorch's checkpoint does), and only the buffers are copies (Rule 7).
Rule 2 (the gate goes first). The gate holds every output that requires grad, so its backward
  runs before any node of the block's graph and sees every output gradient at once. It takes
  one context object (`_GateInput`) and returns one gradient per output. Each output then gets
  a node of its own (`CheckpointOutput`, passing its gradient on): a hook on one output's
  `grad_fn` that runs backward from another output reaches the gate without passing itself
  again (PyTorch's `test_nested_checkpoint_reentrant_backwards`), and that backward recomputes
  in its own graph task (Rule 4).
Rule 3 (nesting). The gate saves the block's inputs and kept values with `save_for_backward`,
  so an enclosing checkpoint swaps them for placeholders of its own. A save policy acts only
  while its own checkpoint is the innermost one running; xla_wrap's own operations are
  nobody's to keep.
Rule 4 (lifetime per graph task). What a recomputation makes is stored per backward (autograd
  graph task), each tensor handed out once, and whatever that backward did not read is
  dropped when it ends.
Rule 5 (early stop). Where the path allows it (eager), the recomputation stops as soon as the
  last saved tensor exists. On XLA it runs to the end: the rest is dead code the compiler
  drops, and stopping would leave wrappers inside the block mid-forward (XLA FSDP's state
  machine then refuses the next backward hook).
Rule 6 (`create_graph`). Under `create_graph=True` the gate's gradients stay differentiable and
  the recomputed tensors stay on the placeholders until the graph goes: a backward through that
  backward reaches the block's nodes without passing the gate, and reads them as they are.
Rule 7 (what is replayed). The recomputation runs with the forward's random generators (of the
  block's path, and the CPU's), its autocast settings, the buffers as the forward read them and
  the plain tensor attributes as the forward saw them (`ModuleTensors`), and it is checked:
  each tensor it saves must match the forward's in shape and dtype, or the first difference is
  named instead of a wrong gradient.
Rule 8 (no in-place change of inputs). A block that modifies one of its inputs in place is
  refused when its forward returns: the recomputation would start from the modified value.
Rule 9 (draws wait for the barrier). Where a barrier orders the recomputation, a block that drew
  random numbers has the seeds its recomputation starts from go through the barrier too, and
  the recomputed Dropout draws its masks from them: the same numbers, which XLA then cannot
  compute (and hold) before the block's gradients arrive (xla_wrap/_paths/xla/draws.py).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .. import _paths
from .. import checkpoint_policies as cp
from .._support.errors import CheckpointError, recomputation_differs
from .._support.state import Recomputing, local, process
from .._support.tree import Flat, TensorMeta
from . import selective as _selective
from .hooks import CheckpointHook
from .module_tensors import ModuleTensors
from .options import CheckpointOptions


@dataclass(frozen=True)
class CheckpointCall:
    """One checkpointed call, described before it runs: what to run, whose parameters and
    buffers join the barrier, and with which options."""

    api: str
    function: Callable[..., Any]
    owners: ModuleTensors
    options: CheckpointOptions


def run(call: CheckpointCall, inputs: Flat) -> Any:
    """Run `call` on `inputs` once, with placeholders for what its graph saves, and return its
    outputs behind the gate (Rule 2)."""
    path = _paths.path_of((*inputs.tensors, *call.owners.params))
    if path.barriers:
        path.warn_if_barriers_stripped((*inputs.tensors, *call.owners.params))
    policy = call.options.policy
    selection = None
    if policy is not None and policy is not cp.nothing_saveable:
        selection = _selective.Selection(call.api, policy)
    saved = _SavedTensors(call.api, selection)
    # Rule 3: xla_wrap's own operations are nobody's to keep.
    with _selective.active(None) if local.selections else nullcontext():
        record, outputs, buffers = _record_forward(call, inputs, path, saved)
        kept = selection.take_kept(outputs.tensors) if selection else []
        gated = record.output_positions
        if not gated:
            return outputs.rebuild(outputs.tensors)
        decisions = selection.decisions if selection else []
        gate = _GateInput(
            record=record,
            saved=saved,
            residuals=[*inputs.tensors, *kept],
            offload_kept=[d is cp.Decision.OFFLOAD for d in decisions],
            buffers=buffers,
        )
        through = _OutputGate.apply(gate, *(outputs.tensors[i] for i in gated))
    tensors = list(outputs.tensors)
    for i, tensor in zip(gated, through, strict=True):
        tensors[i] = CheckpointOutput.apply(tensor, record, i)
    return outputs.rebuild(tensors)


# ----------------------------------------------------------------------------------------------
# The forward and its record


@dataclass(frozen=True)
class ForwardRecord:
    """What the forward of a `CheckpointCall` left for its backward. Made by `_record_forward()`
    only; it holds no activation, input or buffer tensor (those are the gate's saved tensors,
    which autograd frees with the graph)."""

    call: CheckpointCall
    inputs: Flat  # the (args, kwargs) structure, tensor leaves as TensorMeta
    outputs: Flat  # the returned structure, tensor leaves as TensorMeta
    inputs_require_grad: tuple[bool, ...]
    replay: ReplayState  # the generators and autocast settings (Rule 7)
    path: _paths.ExecutionPath  # where the block runs
    output_positions: tuple[int, ...]  # the output tensors that require grad: the gate's
    # What the path noted about the output tensors, for their gradients after the barrier
    # (SPMD shardings on XLA); None: nothing.
    output_notes: list[object | None] | None
    hooks: tuple[CheckpointHook, ...]  # those that act on this checkpoint (Rule 7)
    # The generators of `path` as the forward started (Rule 9): set where the block drew random
    # numbers and a barrier orders its recomputation; None otherwise.
    seeded: object | None

    @property
    def api(self) -> str:
        return self.call.api

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        """Call the function on the forward's arguments with `inputs` as their tensors."""
        args, kwargs = self.inputs.rebuild(inputs)
        return self.call.function(*args, **kwargs)


def _record_forward(
    call: CheckpointCall, inputs: Flat, path: _paths.ExecutionPath, saved: _SavedTensors
) -> tuple[ForwardRecord, Flat, tuple[torch.Tensor, ...]]:
    """Run `call` once on `inputs`, its saved tensors replaced by placeholders, and record what
    its backward needs (Rule 7). Returns the record, the outputs, and copies of the owners'
    buffers as the forward read them, which the gate saves beside the inputs."""
    tensors = inputs.tensors
    owners = call.owners
    # The forward may update buffers in place (BatchNorm statistics, EMAs, `.data` writes that
    # no version counter sees); the recomputation must read them as the forward did. On XLA the
    # copy shares the lazy value, and as a saved tensor it is freed with the graph.
    buffers = tuple(_buffer_copy(b) for b in owners.buffers)
    replay = ReplayState.capture(
        path, (*tensors, *owners.params, *owners.buffers), rng=call.options.preserve_rng_state
    )
    versions = [t._version for t in tensors]
    with (
        saved.forward_running(),
        torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack),
        saved.selection.recording() if saved.selection else nullcontext(),
    ):
        args, kwargs = inputs.rebuild(tensors)
        outputs = Flat.of(call.function(*args, **kwargs))
    _check_inputs_unchanged(call.api, tensors, versions)  # Rule 8
    replay.refuse_unreplayable(call.api)
    if path is _paths.EAGER:  # a block that reads its XLA tensors from a closure only
        path = _paths.path_of(outputs.tensors)
    captured = replay.captured(path)
    seeded = captured if path.barriers and captured is not None and path.drew(captured) else None
    record = ForwardRecord(
        call=call,
        inputs=inputs.without_tensors(),
        outputs=outputs.without_tensors(),
        inputs_require_grad=tuple(t.requires_grad for t in tensors),
        replay=replay,
        path=path,
        output_positions=tuple(i for i, t in enumerate(outputs.tensors) if t.requires_grad),
        output_notes=path.note_outputs(outputs.tensors) if path.barriers else None,
        # The hooks that act here: for this path, and whose library is in use.
        hooks=tuple(
            h
            for h in process.hooks
            if (h.device_types is None or path.name in h.device_types)
            and (h.library is None or h.library in sys.modules)
        ),
        seeded=seeded,
    )
    return record, outputs, buffers


def _buffer_copy(buffer: torch.Tensor) -> torch.Tensor:
    copy = buffer.detach().clone()
    setattr(copy, _BUFFER_COPY, True)
    return copy


_BUFFER_COPY = "_xla_wrap_buffer_copy"


def is_buffer_copy(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a checkpoint's copy of a module buffer as a forward read it."""
    return getattr(tensor, _BUFFER_COPY, False) is True


def _check_inputs_unchanged(
    api: str, inputs: Sequence[torch.Tensor], versions: Sequence[int]
) -> None:
    """Rule 8: refuse a callable that modified its inputs in place."""
    for index, (tensor, version) in enumerate(zip(inputs, versions, strict=True)):
        if tensor._version != version:
            raise CheckpointError(
                f"{api}: the checkpointed callable modified its input tensor {index} "
                f"({TensorMeta.of(tensor)}) in place; the recomputation in backward would start "
                "from the modified value and give wrong gradients. Make that operation "
                "out-of-place (for example `nn.ReLU(inplace=False)` as the block's first layer) "
                "or clone the input inside the callable."
            )


# ----------------------------------------------------------------------------------------------
# What is replayed (Rule 7): random generators and autocast


@dataclass(frozen=True)
class ReplayState:
    """The generators and autocast settings a checkpointed forward started with (Rule 7), per
    execution path in play: the block's own, and the eager one (any block may draw random
    numbers or cast on the CPU). The recomputation runs in backward, where autocast is usually
    off and the generators have moved on; without them it would draw other Dropout masks and
    compute in other dtypes."""

    rng: tuple[tuple[_paths.ExecutionPath, object], ...]  # empty: the generators not replayed
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    autocast_cache: bool

    @classmethod
    def capture(
        cls, path: _paths.ExecutionPath, tensors: Sequence[torch.Tensor], *, rng: bool = True
    ) -> ReplayState:
        paths = _paths.generator_paths(path)
        return cls(
            rng=tuple((p, p.capture_rng(tensors)) for p in paths) if rng else (),
            autocast=tuple(
                (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                for p in paths
                for kind in p.autocast_device_types
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
        )

    def captured(self, path: _paths.ExecutionPath) -> object | None:
        """What was captured of `path`'s generators; None if they are not replayed."""
        return next((c for p, c in self.rng if p is path), None)

    def refuse_unreplayable(self, api: str) -> None:
        """Raise if the forward since the capture drew random numbers that no replay can draw
        again (see each path's `refuse_unreplayable`)."""
        for path, captured in self.rng:
            path.refuse_unreplayable(api, captured)

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run the block with the captured generators and autocast settings; put the
        generators back as they were on entry afterwards (also on error), so that the code
        around sees no recomputation. Only autocast settings that differ from the current
        ones are entered: a machine without CUDA never enters a CUDA autocast context."""
        with ExitStack() as stack:
            for path, captured in self.rng:
                stack.enter_context(path.replay_rng(captured))
            for kind, enabled, dtype in self.autocast:
                if enabled == torch.is_autocast_enabled(kind) and (
                    not enabled or dtype == torch.get_autocast_dtype(kind)
                ):
                    continue
                stack.enter_context(
                    torch.autocast(
                        kind, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache
                    )
                )
            yield


# ----------------------------------------------------------------------------------------------
# Offload: what the gate saves may wait in host memory


def to_host(
    tensors: Sequence[torch.Tensor], offload: Sequence[bool]
) -> tuple[list[torch.Tensor], list[torch.device | None]]:
    """Host copies of the `tensors` marked in `offload` (the others as they are), and the
    device each offloaded one goes back to (None: nothing to bring back). Eager CUDA: pinned
    memory, copied without blocking. XLA: host-placement annotations inside the one program,
    where the backend runs them (docs/offload.md). Brought back, the values go through the
    barrier like any other input of the recomputation (Rule 1)."""
    out: list[torch.Tensor] = []
    devices: list[torch.device | None] = []
    for tensor, wanted in zip(tensors, offload, strict=True):
        device = None
        if wanted:
            tensor, device = _paths.device_path(tensor.device).to_host(tensor)
        out.append(tensor)
        devices.append(device)
    return out, devices


def to_device(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device | None]
) -> list[torch.Tensor]:
    """The inverse of `to_host()`."""
    return [
        tensor if device is None else _paths.device_path(device).to_device(tensor, device)
        for tensor, device in zip(tensors, devices, strict=True)
    ]


# ----------------------------------------------------------------------------------------------
# Placeholders: what the block's graph holds instead of its saved tensors


@dataclass(frozen=True)
class _SavedMeta:
    """What the forward saved at one position, to check the recomputation against (Rule 7)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    made_by: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _SavedMeta:
        node = tensor.grad_fn
        return cls(tuple(tensor.shape), tensor.dtype, node.name() if node is not None else "")

    def __str__(self) -> str:
        made_by = f" made by {self.made_by}" if self.made_by else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}){made_by}"


class _Placeholder:
    """What the block's graph holds instead of a saved tensor. It holds the tensor itself while
    it must be readable without recomputation: during the block's forward (which may
    differentiate its own graph), and after a backward with `create_graph=True` (Rule 6)."""

    __slots__ = ("__weakref__", "index", "saved", "tensor")

    def __init__(self, saved: _SavedTensors, index: int) -> None:
        self.saved = saved
        self.index = index
        self.tensor: torch.Tensor | None = None


class _StopRecomputation(BaseException):
    """Raised by the recomputation's pack hook once the last saved tensor exists (Rule 5). Not
    an `Exception`: a block's own `except Exception` fallback must not swallow it."""

    def __init__(self, saved: _SavedTensors) -> None:
        super().__init__()
        self.saved = saved


class _SavedTensors:
    """The saved-tensor bookkeeping of one call: what the forward saved (placeholders stand in
    for it in the block's graph), and per backward what the recomputation made instead."""

    def __init__(self, api: str, selection: _selective.Selection | None) -> None:
        self.api = api
        self.selection = selection
        self.metas: list[_SavedMeta] = []
        # Rule 4: per backward (graph task id), position in `metas` -> recomputed tensor.
        self.recomputed: dict[int, dict[int, torch.Tensor]] = {}
        self.placeholders: list[weakref.ref[_Placeholder]] = []
        self.forward_placeholders: list[_Placeholder] | None = None  # while the forward runs
        # Rule 6: a backward with `create_graph=True` left the recomputed tensors on the
        # placeholders; later backwards read those instead of recomputing again.
        self.on_placeholders = False

    def pack(self, tensor: torch.Tensor) -> _Placeholder:
        self.metas.append(_SavedMeta.of(tensor))
        placeholder = _Placeholder(self, len(self.metas) - 1)
        self.placeholders.append(weakref.ref(placeholder))
        if self.forward_placeholders is not None:
            placeholder.tensor = tensor.detach()
            self.forward_placeholders.append(placeholder)
        return placeholder

    @contextmanager
    def forward_running(self) -> Iterator[None]:
        """The forward's saved tensors stay readable until it returns (a block may call
        `torch.autograd.grad` on its own graph); then only placeholders are left."""
        self.forward_placeholders = []
        try:
            yield
        finally:
            for placeholder in self.forward_placeholders:
                placeholder.tensor = None
            self.forward_placeholders = None

    def recompute(self, record: ForwardRecord, barriered: _Barriered) -> None:
        """Run the block again on the `barriered` values (Rule 1) and store what its graph
        saves, checked against the forward (Rule 7), for this backward (Rule 4)."""
        if not self.metas:
            return
        store: dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> int:
            index = len(store)
            if index >= len(self.metas):  # possible on XLA only, where nothing stops early
                raise recomputation_differs(
                    self.api, f"saved more than the {len(self.metas)} tensors"
                )
            expected = self.metas[index]
            got = _SavedMeta.of(tensor)
            if (got.shape, got.dtype) != (expected.shape, expected.dtype):
                raise recomputation_differs(
                    self.api,
                    f"saved {got} as tensor {index} for backward, where the forward saved "
                    f"{expected}",
                )
            store[index] = tensor.detach()
            if len(store) == len(self.metas) and record.path.stops_early:  # Rule 5
                raise _StopRecomputation(self)
            return index

        with ExitStack() as stack:
            stack.enter_context(_replaying(record, barriered))
            if record.seeded is not None:  # below a save policy's mode: it sees F.dropout first
                stack.enter_context(record.path.drawing_from(record.seeded, barriered.seeds))
            # A block that differentiates its own graph reads what it saved here too.
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, store.__getitem__))
            if self.selection is not None:
                stack.enter_context(self.selection.substituting(barriered.kept))
            try:
                record.run(barriered.inputs)
            except _StopRecomputation as stop:
                if stop.saved is not self:
                    raise
        if len(store) < len(self.metas):
            raise recomputation_differs(
                self.api,
                f"saved {len(store)} tensors for backward, where the forward saved "
                f"{len(self.metas)}; the first missing one is {self.metas[len(store)]}",
            )
        graph_task = torch._C._current_graph_task_id()
        self.recomputed[graph_task] = store
        if torch.is_grad_enabled():  # Rule 6
            for index, tensor in store.items():
                placeholder = self.placeholders[index]()
                if placeholder is not None:
                    placeholder.tensor = tensor
            self.on_placeholders = True
        # Rule 4: what this backward does not read (branches that need no gradient) goes at
        # its end.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._release(graph_task))

    def _release(self, graph_task: int) -> None:
        self.recomputed.pop(graph_task, None)


def _unpack(placeholder: _Placeholder) -> torch.Tensor:
    saved = placeholder.saved
    store = saved.recomputed.get(torch._C._current_graph_task_id(), {})
    tensor = store.pop(placeholder.index, placeholder.tensor)  # Rule 4: handed out once
    if tensor is None:
        raise CheckpointError(
            f"{saved.api}: backward needed a tensor saved inside a checkpointed block "
            "before the gradients of the block's outputs arrived, so it cannot be recomputed "
            "behind the barrier. A value computed inside the block reached the loss (or "
            "`torch.autograd.grad`) without passing through the block's return value, or a "
            "saved tensor was read outside backward. Return that value from the block."
        )
    return tensor


# ----------------------------------------------------------------------------------------------
# The barrier and the recomputation's state


@dataclass(frozen=True)
class _Barriered:
    """What the recomputation and the block's backward read (Rule 1): on a path with barriers,
    new values through one barrier; inputs and parameters requiring grad as in the forward."""

    inputs: list[torch.Tensor]
    kept: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    seeds: list[torch.Tensor]  # Rule 9


def _barrier(
    record: ForwardRecord,
    inputs: Sequence[torch.Tensor],
    kept: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
) -> _Barriered:
    """Rule 1: the saved `inputs`, the `kept` values, the incoming `grads`, the owners'
    parameters and the saved `buffers` through one barrier of the block's path.

    Inputs, kept values and gradients are rewritten in place where the path allows (their other
    readers then need no pre-barrier copy beside them); parameters and buffers are copied
    (module state stays as it is). The copies of inputs require grad as the forward's inputs
    did (one brought back from the host does not), and those of parameters as the parameters
    do, so the recomputation builds the forward's graph.
    """
    path = record.path
    params = record.call.owners.params
    if not path.barriers:  # nothing to reorder: the values themselves, as the forward had them
        return _Barriered(
            inputs=[
                t if t.requires_grad == r else t.detach().requires_grad_(r)
                for t, r in zip(inputs, record.inputs_require_grad, strict=True)
            ],
            kept=list(kept),
            grads=list(grads),
            params=list(params),
            buffers=[b.clone() for b in buffers],  # updated in place once, by the forward
            seeds=[],
        )
    seeds = path.seed_tensors(record.seeded) if record.seeded is not None else []
    values = [*inputs, *kept, *grads, *params, *buffers, *seeds]
    in_place = [path.rewritable(t) for t in inputs] + [True] * (len(kept) + len(grads))
    in_place += [False] * (len(params) + len(buffers)) + [True] * len(seeds)
    out = iter(path.barrier(values, in_place))
    barriered = _Barriered(
        inputs=[next(out).requires_grad_(r) for r in record.inputs_require_grad],
        kept=[next(out) for _ in kept],
        grads=[next(out) for _ in grads],
        params=[next(out).requires_grad_(p.requires_grad) for p in params],
        # New values (copies): the recomputation's in-place updates of buffers (BatchNorm
        # statistics) stay its own, and the forward's happen once.
        buffers=[next(out) for _ in buffers],
        seeds=[next(out) for _ in seeds],
    )
    return barriered


@contextmanager
def _replaying(record: ForwardRecord, barriered: _Barriered) -> Iterator[None]:
    """Rule 7: run the block as its forward ran: same generators and autocast settings, the
    barriered parameters and buffers in the modules' slots, gradients recorded, and
    [`xla_wrap.is_recomputing()`][xla_wrap.is_recomputing] true."""
    with (
        Recomputing(),
        _hooks_replaying(record) if record.hooks else nullcontext(),
        record.replay.replaying(),
        record.call.owners.substituted(barriered.params, barriered.buffers),
        torch.enable_grad(),
    ):
        yield


@contextmanager
def _hooks_replaying(record: ForwardRecord) -> Iterator[None]:
    with ExitStack() as stack:
        for hook in record.hooks:
            stack.enter_context(hook.replaying())
        yield


# ----------------------------------------------------------------------------------------------
# The gate (Rule 2)


@dataclass(frozen=True)
class _GateInput:
    """Everything the gate's forward takes besides the outputs it holds."""

    record: ForwardRecord
    saved: _SavedTensors
    residuals: list[torch.Tensor]  # the block's inputs, then the values a policy kept
    offload_kept: list[bool]  # per kept value: whether it waits in host memory
    buffers: tuple[torch.Tensor, ...]  # the owners' buffers as the forward read them


class _OutputGate(torch.autograd.Function):
    """`apply(gate_input, *outputs)` -> aliases of the outputs that require grad; their
    backward recomputes the block behind the barrier before the block's graph runs (Rules 1
    and 2)."""

    @staticmethod
    def forward(ctx: Any, gate: _GateInput, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.record, ctx.saved = gate.record, gate.saved
        # Rule 3: saved tensors, not attributes: autograd frees them with the graph, and an
        # enclosing checkpoint swaps them for placeholders of its own.
        offload = gate.record.call.options.offload_to_cpu
        residuals, ctx.devices = gate.residuals, None
        if offload or any(gate.offload_kept):
            wanted = [offload] * (len(gate.residuals) - len(gate.offload_kept))
            wanted += [offload or flag for flag in gate.offload_kept]
            residuals, ctx.devices = to_host(gate.residuals, wanted)
        ctx.n_residuals = len(residuals)
        ctx.save_for_backward(*residuals, *gate.buffers)
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        record: ForwardRecord = ctx.record
        saved: _SavedTensors = ctx.saved
        everything = ctx.saved_tensors  # once: under an enclosing checkpoint each read unpacks
        residuals, buffers = everything[: ctx.n_residuals], everything[ctx.n_residuals :]
        if ctx.devices is not None:
            residuals = to_device(residuals, ctx.devices)
        n_inputs = len(record.inputs_require_grad)
        present = [i for i, g in enumerate(grads) if g is not None]
        incoming = [g for g in grads if g is not None]
        handed_on = incoming  # Rule 6: a create_graph backward recomputed for good already
        if not saved.on_placeholders:
            with _selective.active(None) if local.selections else nullcontext():  # Rule 3
                barriered = _barrier(
                    record, residuals[:n_inputs], residuals[n_inputs:], incoming, buffers
                )
                saved.recompute(record, barriered)
            handed_on = barriered.grads  # Rule 1
        if record.output_notes is not None:
            positions = [record.output_positions[i] for i in present]
            record.path.lay_out_gradients(record.output_notes, positions, handed_on)
        if torch.is_grad_enabled():  # Rule 6: keep the gradients differentiable
            handed_on = [
                _DifferentiableCopy.apply(g, b) for g, b in zip(incoming, handed_on, strict=True)
            ]
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, grad in zip(present, handed_on, strict=True):
            out[i] = grad
        return (None, *out)


class _DifferentiableCopy(torch.autograd.Function):
    """`apply(value, copy)` -> `copy` (a barriered copy of `value`), with `value`'s derivative:
    the gate's backward stays differentiable under `create_graph=True` (Rule 6)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        return copy.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class CheckpointOutput(torch.autograd.Function):
    """`apply(output, record, position)` -> an alias of one output behind the gate, with a
    gradient node of its own (Rule 2): `grad_fn.name()` is "CheckpointOutputBackward", and its
    `next_functions` lead to the gate."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, record: ForwardRecord, position: int) -> Any:
        ctx.record, ctx.position = record, position
        ctx.set_materialize_grads(False)
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        return grad, None, None


def record_of(tensor: torch.Tensor) -> tuple[ForwardRecord, int] | None:
    """The record of the checkpoint that returned `tensor`, and the tensor's position among
    that forward's output tensors; None if no checkpoint returned it."""
    node = tensor.grad_fn
    if not isinstance(node, CheckpointOutput._backward_cls):
        return None
    return node.record, node.position
