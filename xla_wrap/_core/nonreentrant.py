"""The non-reentrant engine: the forward records its autograd graph as usual, but every tensor
that graph saves for backward is replaced by a placeholder, and backward recomputes them.

Gradients flow through the forward's own graph, so `torch.autograd.grad`, `backward(inputs=)`
and gradients for tensors the block reaches from outside work as they do without checkpointing.
PyTorch's implementation recomputes from inside the first unpack hook, which on XLA is neither
ordered after the incoming gradient nor distinct from the forward. Here a *gate*, an autograd
Function over the block's outputs, runs first in backward, receives every output gradient, and
recomputes behind the barrier of `recompute` (inputs, values a policy kept, gradients,
parameters, buffers). It hands the barriered gradients on to the block's graph, whose nodes then
read recomputed values only: everything backward does for the block comes after the barrier.

On eager devices the recomputation stops as soon as the last saved tensor exists (on XLA the
rest is dead code the compiler drops anyway), and each tensor it makes is
checked against the one the forward saved at the same position (shape, dtype), so a block that
computes something else when run again fails with the first difference instead of a wrong
gradient. Nested checkpoints work because the gate saves the block's inputs and kept values
through the ordinary saved-tensor mechanism: an enclosing checkpoint replaces them with its own
placeholders.

Higher derivatives: under `create_graph=True` the gate's gradients stay differentiable, and
the recomputed tensors stay on the placeholders (freed with the graph), so a backward through
that backward's graph, which reaches the block's nodes without passing the gate, reads them
without recomputing again. A block that differentiates its own graph reads its saved tensors
from the placeholders while its forward runs, and from the recomputation's store in backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .. import checkpoint_policies as cp
from .._support.errors import CheckpointError
from .._support.tree import Flat
from . import selective as _selective
from .recompute import (
    CheckpointCall,
    ForwardRecord,
    barrier_for_recompute,
    gradients_arrived,
    raise_not_deterministic,
    record_forward,
    replaying,
    save_for_recompute,
    saved_for_recompute,
)


def run_nonreentrant(call: CheckpointCall, inputs: Flat) -> Any:
    """Run `call` on `inputs` once, saving placeholders, and return its output behind the
    gate."""
    policy = call.options.policy
    selection = None
    if policy is not None and policy is not cp.nothing_saveable:
        selection = _selective.Selection(call.api, policy)
    frame = _Frame(call.api, selection)
    running = _recording(frame, selection)
    with _selective.active(None):  # xla_wrap's own operations are nobody's to keep
        record, outputs, buffers = record_forward(call, inputs, running)
        kept = selection.take_kept(outputs.tensors) if selection else []
        gated = tuple(i for i, t in enumerate(outputs.tensors) if t.requires_grad)
        if not gated:
            return outputs.rebuild(outputs.tensors)
        decisions = selection.decisions if selection else []
        through = _OutputGate.apply(
            frame,
            record,
            gated,
            [*inputs.tensors, *kept],
            [decision is cp.Decision.OFFLOAD for decision in decisions],
            buffers,
            *(outputs.tensors[i] for i in gated),
        )
    tensors = list(outputs.tensors)
    for i, tensor in zip(gated, through, strict=True):
        tensors[i] = tensor
    return outputs.rebuild(tensors)


@contextmanager
def _recording(frame: _Frame, selection: _selective.Selection | None) -> Iterator[None]:
    """The block's forward: placeholders for what its graph saves, the policy deciding."""
    with (
        frame.forward_running(),
        torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack),
        selection.recording() if selection else _selective.active(None),
    ):
        yield


@dataclass(frozen=True)
class _SavedMeta:
    """What the forward saved at one position, to check the recomputation against."""

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
    """What the block's graph holds instead of a saved tensor. It holds the tensor itself
    while it must be readable without recomputation: during the block's forward (which may
    differentiate its own graph, `torch.autograd.grad` inside the block), and after a
    backward with `create_graph=True`, whose graph reads the block's nodes again (second
    derivatives) without passing the gate; then the tensor goes when the graph does."""

    __slots__ = ("__weakref__", "frame", "index", "tensor")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index
        self.tensor: torch.Tensor | None = None


class _StopRecomputation(BaseException):
    """Raised by the recomputation's pack hook once the last saved tensor exists. Not an
    `Exception`: a block's own `except Exception` fallback must not swallow it."""

    def __init__(self, frame: _Frame) -> None:
        super().__init__()
        self.frame = frame


class _Frame:
    """The saved-tensor bookkeeping of one call: what the forward saved (placeholders stand in
    for it in the block's graph), and per backward what the recomputation made instead."""

    def __init__(self, api: str, selection: _selective.Selection | None) -> None:
        self.api = api
        self.selection = selection
        self.saved: list[_SavedMeta] = []
        # per backward (graph task id): position in `saved` -> recomputed tensor
        self.recomputed: dict[int, dict[int, torch.Tensor]] = {}
        self.placeholders: list[weakref.ref[_Placeholder]] = []
        self.forward_placeholders: list[_Placeholder] | None = None  # while the forward runs
        # Whether a backward with `create_graph=True` left the recomputed tensors on the
        # placeholders: later backwards read those instead of recomputing again.
        self.recomputed_for_good = False

    def pack(self, tensor: torch.Tensor) -> _Placeholder:
        self.saved.append(_SavedMeta.of(tensor))
        placeholder = _Placeholder(self, len(self.saved) - 1)
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

    def recompute(
        self,
        record: ForwardRecord,
        inputs: Sequence[torch.Tensor],
        kept: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Recompute what the block's graph saved, behind the barrier; the barriered grads."""
        copies = barrier_for_recompute(record, inputs, buffers, grads, kept)
        if not self.saved:
            return copies.grads
        store: dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> int:
            index = len(store)
            if index >= len(self.saved):  # possible on XLA only, where nothing stops early
                raise_not_deterministic(self.api, f"saved more than the {len(self.saved)} tensors")
            expected = self.saved[index]
            got = _SavedMeta.of(tensor)
            if (got.shape, got.dtype) != (expected.shape, expected.dtype):
                raise_not_deterministic(
                    self.api,
                    f"saved {got} as tensor {index} for backward, where the forward saved "
                    f"{expected}",
                )
            store[index] = tensor.detach()
            # Stop early where the path allows it (not on XLA: xla_wrap/_paths/xla/path.py).
            if len(store) == len(self.saved) and record.path.stops_early:
                raise _StopRecomputation(self)
            return index

        with ExitStack() as stack:
            stack.enter_context(replaying(record, copies))
            # A block that differentiates its own graph reads what it saved in the recomputation
            # too.
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, store.__getitem__))
            if self.selection is not None:
                stack.enter_context(self.selection.substituting(copies.kept))
            try:
                record.run(copies.inputs)
            except _StopRecomputation as stop:
                if stop.frame is not self:
                    raise
        if len(store) < len(self.saved):
            raise_not_deterministic(
                self.api,
                f"saved {len(store)} tensors for backward, where the forward saved "
                f"{len(self.saved)}; the first missing one is {self.saved[len(store)]}",
            )
        graph_task = torch._C._current_graph_task_id()
        self.recomputed[graph_task] = store
        if torch.is_grad_enabled():  # create_graph=True
            self._keep_for_good(store)
        # Whatever this backward does not read (branches that need no gradient) goes at its end.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._release(graph_task))
        return copies.grads

    def _release(self, graph_task: int) -> None:
        self.recomputed.pop(graph_task, None)

    def _keep_for_good(self, store: dict[int, torch.Tensor]) -> None:
        for index, tensor in store.items():
            placeholder = self.placeholders[index]()
            if placeholder is not None:
                placeholder.tensor = tensor
        self.recomputed_for_good = True


def _unpack(placeholder: _Placeholder) -> torch.Tensor:
    frame = placeholder.frame
    store = frame.recomputed.get(torch._C._current_graph_task_id(), {})
    tensor = store.pop(placeholder.index, placeholder.tensor)
    if tensor is None:
        raise CheckpointError(
            f"{frame.api}: backward needed a tensor saved inside a checkpointed block "
            "before the gradients of the block's outputs arrived, so it cannot be recomputed "
            "behind the barrier. A value computed inside the block reached the loss (or "
            "`torch.autograd.grad`) without passing through the block's return value, or a "
            "saved tensor was read outside backward. Return that value from the block."
        )
    return tensor


class _OutputGate(torch.autograd.Function):
    """`apply(frame, record, gated, residuals, offload, buffers, *outputs)` -> aliases of
    the block's outputs that require grad (output tensors `gated` of the record); their
    backward recomputes the block behind the barrier before the block's graph runs.
    `residuals` are the block's inputs, then the values a policy kept; `offload` flags the
    kept values that wait in host memory; `buffers` are the owners' buffers as the forward
    read them."""

    @staticmethod
    def forward(
        ctx: Any,
        frame: _Frame,
        record: ForwardRecord,
        gated: tuple[int, ...],
        residuals: list[torch.Tensor],
        offload: list[bool],
        buffers: tuple[torch.Tensor, ...],
        *outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.frame = frame
        ctx.record = record
        ctx.output_positions = gated  # as fsdp's sharding record reads
        save_for_recompute(ctx, record, residuals, buffers, offload)
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        frame: _Frame = ctx.frame
        record: ForwardRecord = ctx.record
        saved, buffers = saved_for_recompute(ctx)
        split = len(record.inputs_require_grad)  # saved[:split] are the block's inputs
        present = [i for i, g in enumerate(grads) if g is not None]
        incoming = [g for g in grads if g is not None]
        copies = incoming  # a backward with create_graph=True has recomputed for good already
        if not frame.recomputed_for_good:
            with _selective.active(None):
                copies = frame.recompute(record, saved[:split], saved[split:], buffers, incoming)
        gradients_arrived(
            record, [ctx.output_positions[i] for i in present], copies, [None] * len(present)
        )
        if torch.is_grad_enabled():  # create_graph=True: keep the gradients differentiable
            copies = [_Same.apply(g, c) for g, c in zip(incoming, copies, strict=True)]
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, grad in zip(present, copies, strict=True):
            out[i] = grad
        return (None, None, None, None, None, None, *out)


class _Same(torch.autograd.Function):
    """`apply(value, copy)` -> `copy`, a barriered copy of `value`, with `value`'s
    derivative: the gate's backward stays differentiable under `create_graph=True`."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        return copy.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
