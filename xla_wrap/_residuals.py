"""What a forward keeps for backward, in the spirit of JAX's ``print_saved_residuals``.

Autograd nodes expose the tensors they saved as ``_saved_*`` attributes (and custom Functions
as ``saved_tensors``). Walking the graph from a forward's outputs lists every tensor kept alive
for backward, which op keeps it, and whether it is a parameter, an input, or an activation: the
part checkpointing exists to shrink.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import _xla
from ._errors import CheckpointTypeError, describe


@dataclass(frozen=True)
class Residual:
    """One tensor a forward keeps alive for backward.

    Attributes:
        ops: The autograd nodes that keep it (``"AddmmBackward0"``,
            ``"CheckpointFunctionBackward"``, ...), first one first.
        shape: Its shape.
        dtype: Its dtype.
        nbytes: Its size in bytes.
        kind: ``"parameter"`` (a leaf that requires grad, or a view of one, that is not an
            input), ``"input"`` (one of the call's tensor arguments, or a view of one), or
            ``"activation"`` (computed by the forward).
    """

    ops: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    kind: str

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        ops = ", ".join(self.ops)
        return f"{self.kind:<10} {shape:<20} {self.dtype!s:<16} {self.nbytes:>12,d} B  {ops}"


def saved_residuals(function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Run ``function(*args, **kwargs)`` with autograd on and list what it saves for backward.

    Works on eager and XLA tensors alike (it reads shapes, it executes nothing extra on XLA). A
    checkpointed block shows up as one ``CheckpointFunctionBackward`` keeping only its inputs.

    Args:
        function: A module or any callable.
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.

    Returns:
        One :class:`Residual` per distinct saved tensor, in graph order from the outputs.

    Raises:
        CheckpointTypeError: If ``function`` is not callable.

    Example:
        >>> import torch, xla_wrap
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> kinds = [r.kind for r in xla_wrap.introspect.saved_residuals(mlp, torch.randn(3, 4))]
        >>> sorted(kinds)  # the input (kept for the first weight's gradient), the ReLU output
        ['activation', 'input', 'parameter']
    """
    if not callable(function):
        raise CheckpointTypeError(
            "xla_wrap.introspect.saved_residuals: expected a module or callable, got "
            f"{describe(function)}. Pass what you would call, then its arguments."
        )
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    with torch.enable_grad():
        out = function(*args, **kwargs)
    found: dict[Any, tuple[list[str], torch.Tensor]] = {}
    for op, tensor in _saved_tensors(out):
        ops, _ = found.setdefault(_identity(tensor), ([], tensor))
        if op not in ops:
            ops.append(op)
    input_roots = {id(_root(t)) for t in inputs}
    return [
        Residual(
            ops=tuple(ops),
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            nbytes=tensor.numel() * tensor.element_size(),
            kind=_kind(tensor, input_roots),
        )
        for ops, tensor in found.values()
    ]


def format_residuals(residuals: list[Residual]) -> str:
    """A table of ``residuals`` with totals per kind, for printing."""
    lines = [str(r) for r in residuals]
    totals: dict[str, int] = {}
    for r in residuals:
        totals[r.kind] = totals.get(r.kind, 0) + r.nbytes
    summary = ", ".join(f"{kind} {size / 2**20:.2f} MiB" for kind, size in sorted(totals.items()))
    lines.append(f"total {sum(totals.values()) / 2**20:.2f} MiB ({summary or 'nothing saved'})")
    return "\n".join(lines)


def _saved_tensors(out: Any) -> Iterator[tuple[str, torch.Tensor]]:
    roots = [
        t.grad_fn
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    # Python wrappers of autograd nodes are made on access and may be freed; keep each one
    # alive so that its id cannot be reused by another node.
    seen: dict[int, Any] = {}
    queue = list(roots)
    while queue:
        node = queue.pop(0)
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for value in _node_saved_values(node):
            yield node.name(), value
        queue.extend(child for child, _ in node.next_functions if child is not None)


def _node_saved_values(node: Any) -> Iterator[torch.Tensor]:
    values: list[Any] = []
    # RuntimeError: freed already (a backward ran without retain_graph).
    for attribute in dir(node):
        if attribute.startswith("_saved_"):
            with contextlib.suppress(RuntimeError):
                values.append(getattr(node, attribute))
    if hasattr(node, "saved_tensors"):  # custom autograd.Function nodes
        with contextlib.suppress(RuntimeError):
            values.extend(node.saved_tensors)
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _root(tensor: torch.Tensor) -> torch.Tensor:
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


def _identity(tensor: torch.Tensor) -> Any:
    if _xla.is_xla_tensor(tensor):
        return ("xla", _xla.tensor_id(tensor))
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _kind(tensor: torch.Tensor, input_roots: set[int]) -> str:
    root = _root(tensor)
    if id(root) in input_roots or id(tensor) in input_roots:
        return "input"
    if root.is_leaf and root.requires_grad:
        return "parameter"
    return "activation"
