"""Fingerprints of modules and call arguments: what two modules or calls must share to be
treated alike (the scan's "layers are alike" check, the planner's cost and compile caches).

Each caller picks the parts it needs; the parts are built here, once, so that two checks cannot
mean different things by "the same parameters".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

# Plain values a setting may hold and still count as a setting (not state).
_PLAIN = (bool, int, float, str, type(None), tuple)


def tensor_entries(
    named: Iterable[tuple[str, torch.Tensor]], *, requires_grad: bool
) -> tuple[tuple[object, ...], ...]:
    """Name, shape and dtype of each tensor (and whether it requires grad)."""
    return tuple(
        (name, tuple(t.shape), t.dtype, *((t.requires_grad,) if requires_grad else ()))
        for name, t in named
    )


def parameter_entries(module: nn.Module, *, recurse: bool = True) -> tuple[tuple[object, ...], ...]:
    """Each parameter's name, shape, dtype and `requires_grad`."""
    return tensor_entries(module.named_parameters(recurse=recurse), requires_grad=True)


def buffer_entries(module: nn.Module) -> tuple[tuple[object, ...], ...]:
    """Each buffer's name, shape and dtype."""
    return tensor_entries(module.named_buffers(), requires_grad=False)


def plain_settings(
    module: nn.Module, ignore: frozenset[str] = frozenset()
) -> tuple[tuple[str, object], ...]:
    """A module's public plain settings (numbers, strings, flags), which may change what it
    computes and costs; `training` and the names in `ignore` left out."""
    return tuple(
        (k, v)
        for k, v in sorted(vars(module).items())
        if not k.startswith("_") and k not in ignore and k != "training" and isinstance(v, _PLAIN)
    )


def value_meta(tree: Any) -> Any:
    """`tree` with each tensor replaced by its shape, dtype and `requires_grad`."""

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.requires_grad)
        return value

    return pytree.tree_map(meta, tree)
