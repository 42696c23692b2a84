"""What a forward keeps for backward, in the spirit of JAX's `print_saved_residuals`.

Every tensor autograd keeps for backward passes through the saved-tensor pack hook at the
moment it is saved. Recording it there (rather than reading the `_saved_*` attributes of the
graph afterwards) sees exactly what is kept, and never triggers the unpack hooks of other tools
(`torch.utils.checkpoint` recomputes when its saved tensors are read).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._core.engine import is_buffer_copy
from .._paths import xla as _xla
from .._support.checks import check_record
from .._support.errors import CheckpointTypeError, describe


@dataclass(frozen=True)
class Residual:
    """One tensor a forward keeps alive for backward.

    Attributes:
        shape: Its shape.
        dtype: Its dtype.
        nbytes: Its size in bytes.
        kind: `"input"` (one of the call's tensor arguments, or a view of one),
            `"parameter"` (another leaf that requires grad, or a view of one),
            `"buffer"` (an xla_wrap checkpoint's copy of a module buffer as the forward read
            it: on XLA free unless the forward changes the buffer), or `"activation"`
            (computed by the forward: what checkpointing exists to shrink).
        made_by: For an activation, the op that computed it (`"relu"`, `"addmm"`); empty
            otherwise.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    kind: str
    made_by: str

    def __post_init__(self) -> None:
        check_record("xla_wrap.introspect.Residual", self)

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return (
            f"{self.kind:<10} {shape:<20} {self.dtype!s:<16} {self.nbytes:>12,d} B  {self.made_by}"
        )


def saved_residuals(function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Run `function(*args, **kwargs)` once and list what it saves for backward.

    The call runs with autograd on. It works on eager and XLA tensors alike; on XLA it only
    traces (nothing is executed). A block checkpointed by xla_wrap shows up as its inputs
    alone.

    Args:
        function: A module or any callable.
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.

    Returns:
        One [`Residual`][xla_wrap.introspect.Residual] per distinct saved tensor, in the
        order they were saved.

    Raises:
        CheckpointTypeError: If `function` is not callable.

    Examples:
        >>> import torch, xla_wrap
        >>> mlp = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        ... )
        >>> residuals = xla_wrap.introspect.saved_residuals(mlp, torch.randn(3, 4))
        >>> [(r.kind, r.made_by) for r in residuals]  # the input, the ReLU output, a weight
        [('input', ''), ('activation', 'relu'), ('parameter', '')]
    """
    if not callable(function):
        raise CheckpointTypeError(
            "xla_wrap.introspect.saved_residuals: expected a module or callable, got "
            f"{describe(function)}. Pass what you would call, then its arguments."
        )
    input_roots = {
        id(_root(t)) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    }
    found: dict[Any, Residual] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _identity(tensor)
        if key not in found:
            found[key] = _describe(tensor, input_roots)
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        function(*args, **kwargs)
    return list(found.values())


def format_residuals(residuals: list[Residual]) -> str:
    """A table of `residuals` with totals per kind, for printing.

    Args:
        residuals: What [`saved_residuals()`][xla_wrap.introspect.saved_residuals] returned.

    Returns:
        One line per residual (kind, shape, dtype, bytes, the op that made it), then a line
        with the total and the total per kind, in MiB.

    Raises:
        CheckpointTypeError: If `residuals` is not a list of residuals.

    Examples:
        >>> import torch
        >>> from xla_wrap import introspect
        >>> mlp = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        ... )
        >>> print(introspect.format_residuals(introspect.saved_residuals(mlp, torch.randn(3, 4))))
        input      3x4                  torch.float32              48 B
        activation 3x8                  torch.float32              96 B  relu
        parameter  8x2                  torch.float32              64 B
        total 0.00 MiB (activation 0.00 MiB, input 0.00 MiB, parameter 0.00 MiB)
    """
    if not isinstance(residuals, (list, tuple)) or not all(
        isinstance(r, Residual) for r in residuals
    ):
        raise CheckpointTypeError(
            "xla_wrap.introspect.format_residuals: expected the list "
            f"`introspect.saved_residuals()` returns, got {describe(residuals)}."
        )
    lines = [str(r) for r in residuals]
    totals: dict[str, int] = {}
    for r in residuals:
        totals[r.kind] = totals.get(r.kind, 0) + r.nbytes
    summary = ", ".join(f"{kind} {size / 2**20:.2f} MiB" for kind, size in sorted(totals.items()))
    lines.append(f"total {sum(totals.values()) / 2**20:.2f} MiB ({summary or 'nothing saved'})")
    return "\n".join(lines)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


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


def _describe(tensor: torch.Tensor, input_roots: set[int]) -> Residual:
    root = _root(tensor)
    made_by = ""
    if id(root) in input_roots or id(tensor) in input_roots:
        kind = "input"
    elif root.is_leaf and root.requires_grad:
        kind = "parameter"
    elif is_buffer_copy(tensor):
        kind = "buffer"
    else:
        kind = "activation"
        node = tensor.grad_fn
        # ReluBackward0 -> relu, AddmmBackward0 -> addmm, CheckpointFunctionBackward -> ...
        name = node.name() if node is not None else "no grad"
        made_by = re.sub(r"Backward\d*$", "", name).lower()
    return Residual(
        shape=tuple(tensor.shape),
        dtype=tensor.dtype,
        nbytes=tensor.numel() * tensor.element_size(),
        kind=kind,
        made_by=made_by,
    )
