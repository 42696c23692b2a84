"""Applying a save policy to a checkpointed forward, and
[`checkpoint_name()`][xla_wrap.checkpoint_name].

In the forward a `TorchFunctionMode` sees each torch function the block calls. Every call
that returns a differentiable tensor, and every
[`checkpoint_name()`][xla_wrap.checkpoint_name] tag, is an *occurrence*; the policy decides
per occurrence whether its value is kept. In the recomputation the same
calls come in the same order: each still runs (so autograd saves the same tensors as in the
forward), but a kept occurrence hands the kept value, taken through the barrier, to the rest of
the block. On XLA the recomputed value then has no reader and the compiler drops the work that
made it; that is where the saving in compute comes from.

The mode works above autograd, on the functions the block calls. A `TorchDispatchMode` (what
PyTorch's selective checkpointing uses) would see the functionalized inner tensors on XLA
instead. Nested checkpoints each apply their own policy (the engine's Rule 3,
xla_wrap/_core/engine.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .. import _paths
from .. import checkpoint_policies as cp
from .._support.errors import CheckpointTypeError, describe, recomputation_differs
from .._support.state import local
from .._support.tree import Flat


@contextmanager
def active(selection: Selection | None) -> Iterator[None]:
    """Make `selection` the innermost running one (`None` hides the outer ones)."""
    local.selections.append(selection)
    try:
        yield
    finally:
        local.selections.pop()


def _current() -> Selection | None:
    stack: list[Selection | None] = local.selections
    return stack[-1] if stack else None


class Selection:
    """The policy's decisions for one checkpointed call, and the values it kept."""

    def __init__(self, api: str, policy: cp.SavePolicy) -> None:
        self.api = api
        self.policy = policy
        self.functions: list[str] = []  # per occurrence: what computed it
        self.kept_at: dict[int, tuple[int, int]] = {}  # occurrence -> (first kept, how many)
        self.kept: list[torch.Tensor] = []
        self.decisions: list[cp.Decision] = []  # per kept tensor: SAVE or OFFLOAD
        self._versions: list[int] = []
        # Each kept value's tensor in the forward, weakly: an id() could be reused by the
        # block's output once that tensor is freed.
        self._sources: list[weakref.ref[torch.Tensor]] = []
        self._substitutes: Sequence[torch.Tensor] | None = None
        self._connected = False
        self._count = 0

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Run the forward: decide per occurrence and keep what the policy selects."""
        self._count, self._substitutes = 0, None
        with active(self), _Mode(self):
            yield

    @contextmanager
    def substituting(
        self, kept: Sequence[torch.Tensor], *, connected: bool = False
    ) -> Iterator[None]:
        """Run the recomputation: kept occurrences hand out `kept` (barriered copies).

        The engine differentiates the forward's own graph, so a substitute is a new leaf.
        With `connected` (a recomputation that is differentiated itself, as in a scanned
        stack) a substitute passes its gradient on to the recomputed operation, whose unread
        value XLA then drops.
        """
        self._count, self._substitutes, self._connected = 0, kept, connected
        try:
            with active(self), _Mode(self):
                yield
        finally:
            self._substitutes, self._connected = None, False

    def take_kept(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The kept values, once the forward is done. A value the block modified in place
        since, or returns (it stays alive anyway, and the caller may modify it in place), is
        recomputed instead: the recomputation reproduces it, the kept copy would not."""
        output_ids = {id(t) for t in outputs}  # alive: ids cannot be reused meanwhile
        kept_at: dict[int, tuple[int, int]] = {}
        kept: list[torch.Tensor] = []
        decisions: list[cp.Decision] = []
        for occurrence, (start, count) in self.kept_at.items():
            span = range(start, start + count)
            if any(
                self.kept[i]._version != self._versions[i] or id(self._sources[i]()) in output_ids
                for i in span
            ):
                continue
            kept_at[occurrence] = (len(kept), count)
            kept.extend(self.kept[i] for i in span)
            decisions.extend(self.decisions[i] for i in span)
        self.kept_at, self.decisions = kept_at, decisions
        self.kept, self._versions, self._sources = [], [], []
        return kept

    def on_value(
        self, function: str, name: str | None, value: Any, inputs: Sequence[object] = ()
    ) -> Any:
        flat = Flat.of(value)
        tensors = flat.tensors
        if name is None and not _is_candidate(function, tensors, inputs):
            return value
        occurrence = self._count
        self._count += 1
        if self._substitutes is None:
            self._record(occurrence, function, name, tensors, inputs)
            return value
        if occurrence >= len(self.functions) or self.functions[occurrence] != function:
            expected = self.functions[occurrence : occurrence + 1] or ["nothing more"]
            raise recomputation_differs(
                self.api,
                f"called `{function}` as operation {occurrence}, where the forward called "
                f"`{expected[0]}`",
            )
        slot = self.kept_at.get(occurrence)
        if slot is None:
            return value
        start, count = slot
        pairs = zip(self._substitutes[start : start + count], tensors, strict=True)
        if self._connected:
            substitutes = [_Substitute.apply(t, s) for s, t in pairs]
        else:
            substitutes = [s.detach().requires_grad_(t.requires_grad) for s, t in pairs]
        return flat.rebuild(substitutes)

    def _record(
        self,
        occurrence: int,
        function: str,
        name: str | None,
        tensors: Sequence[torch.Tensor],
        inputs: Sequence[object],
    ) -> None:
        self.functions.append(function)
        op = cp.Op(
            function=function,
            name=name,
            shapes=tuple(tuple(t.shape) for t in tensors),
            nbytes=sum(t.numel() * t.element_size() for t in tensors),
            input_shapes=tuple(tuple(i.shape) for i in inputs if isinstance(i, torch.Tensor)),
        )
        decision = cp.decide(self.policy, op)
        if decision is cp.Decision.RECOMPUTE:
            return
        self.kept_at[occurrence] = (len(self.kept), len(tensors))
        for tensor in tensors:
            self.kept.append(tensor.detach())
            self._versions.append(tensor._version)
            self._sources.append(weakref.ref(tensor))
            self.decisions.append(decision)


class _Substitute(torch.autograd.Function):
    """`apply(recomputed, kept)`: the kept value, differentiated as the recomputed one."""

    @staticmethod
    def forward(ctx: Any, recomputed: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return kept.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _is_candidate(function: str, tensors: Sequence[torch.Tensor], inputs: Sequence[object]) -> bool:
    """An operation a policy decides on: it returns differentiable tensors, none of them one
    of its inputs or a view of one (free to recompute: `x.to(x.dtype)` returns `x`,
    `x.view(...)` its storage), and it is not in-place (its output is its input, changed).
    A view of a tensor the operation made itself is a result like any other (`linear` on a
    3-D input returns a view of its matrix product). The answer must not depend on whether an
    input is a view, which a barriered copy is not: inputs and outputs are compared by the
    tensor they view."""
    if not tensors or not any(t.requires_grad for t in tensors):
        return False
    if function.endswith("_") and not function.endswith("__"):
        return False
    bases = {id(_base(i)) for i in inputs if isinstance(i, torch.Tensor)}
    return not any(id(_base(t)) in bases for t in tensors)


def _base(tensor: torch.Tensor) -> torch.Tensor:
    base = tensor._base if tensor._is_view() else None
    return tensor if base is None else base


class _Mode(TorchFunctionMode):
    def __init__(self, selection: Selection) -> None:
        super().__init__()
        self.selection = selection

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _current() is not self.selection:
            return out  # a nested checkpoint's operation, or xla_wrap's own machinery
        inputs = pytree.tree_leaves((args, kwargs))
        return self.selection.on_value(_function_name(func), None, out, inputs)


def _function_name(func: Any) -> str:
    """`linear` for F.linear, `matmul` for `a @ b`, `add` for `Tensor.__radd__`."""
    name: str = getattr(func, "__name__", type(func).__name__)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith(("r", "i")) and name[1:] in _BINARY_DUNDERS:
            name = name[1:]
    return name


_BINARY_DUNDERS = {"add", "sub", "mul", "matmul", "truediv", "floordiv", "pow", "mod", "and", "or"}


@_paths.branches_on_compiling
def checkpoint_name(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Tag `tensor` with `name` so that a save policy can keep it by name.

    Inside a checkpointed call whose policy keeps `name` (for example
    `checkpoint_policies.save_only_these_names(name)`), the value is kept from the forward
    and the recomputation reads it instead of recomputing it. Elsewhere this returns `tensor`
    unchanged, so tagged code runs the same with or without checkpointing.

    Args:
        tensor: The value to tag.
        name: The name a policy refers to.

    Returns:
        `tensor` (in a recomputation: the kept value, if the policy kept it).

    Raises:
        CheckpointTypeError: If `tensor` is not a tensor or `name` not a string.

    Examples:
        >>> import torch, xla_wrap
        >>> from xla_wrap import checkpoint_policies as cp
        >>> def block(x):
        ...     h = xla_wrap.checkpoint_name(torch.tanh(x) * 3, "h")
        ...     return h.sin()
        >>> x = torch.randn(4, requires_grad=True)
        >>> y = xla_wrap.checkpoint(block, x, policy=cp.save_only_these_names("h"))
        >>> y.sum().backward()
    """
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointTypeError(
            f"xla_wrap.checkpoint_name: expected a tensor to tag, got {describe(tensor)} "
            f"(name {name!r}). Tag the tensor that the value is held in."
        )
    if not isinstance(name, str):
        raise CheckpointTypeError(
            f"xla_wrap.checkpoint_name: expected a string as `name`, got {describe(name)}. "
            "Pass the name your policy keeps, as in `checkpoint_name(h, 'attn_out')`."
        )
    if _paths.compiling():
        return _paths.compiled_tag(tensor, name)
    selection = _current()
    if selection is None:
        return tensor
    result: torch.Tensor = selection.on_value("checkpoint_name", name, tensor)
    return result
