"""Split nested Python values into their tensors and everything else, and put them back.

Checkpointed callables take and return any nesting of tuples, lists, dicts and namedtuples with
non-tensor values mixed in. The autograd Function sees only the flat tensors; `Flat`
keeps the structure and the non-tensor leaves so that the exact value can be rebuilt around new
tensors. The structure comes from `torch.utils._pytree`, which also knows the containers that
libraries register (transformers registers its `ModelOutput`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class TensorMeta:
    """What stands in for a tensor leaf once the tensor itself is dropped."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype})"


@dataclass(frozen=True)
class Flat:
    """A nested value taken apart: its structure, its leaves, and which leaves are tensors."""

    # The structure: as `_shape()` describes it when the value is made of plain tuples, lists
    # and dicts only (every checkpointed call's arguments and most outputs: taken apart and
    # rebuilt without pytree, which costs more than the rest of a small block's checkpoint),
    # else pytree's spec.
    structure: object
    leaves: tuple[Any, ...]
    tensor_positions: tuple[int, ...]

    @classmethod
    def of(cls, value: Any) -> Flat:
        leaves: list[Any] = []
        structure = _shape(value, leaves)
        if structure is _NOT_PLAIN:
            leaves, structure = pytree.tree_flatten(value)
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        return cls(structure, tuple(leaves), positions)

    @property
    def spec(self) -> pytree.TreeSpec:
        """pytree's spec of the structure."""
        if isinstance(self.structure, pytree.TreeSpec):
            return self.structure
        return pytree.tree_flatten(_build(self.structure, iter(lambda: 0, None)))[1]

    def same_structure(self, other: Flat) -> bool:
        """Whether `other` has this structure (as pytree sees it)."""
        plain = not isinstance(self.structure, pytree.TreeSpec)
        if plain == (not isinstance(other.structure, pytree.TreeSpec)):
            return self.structure == other.structure
        return self.spec == other.spec

    @property  # not cached_property: its lock is a context manager Dynamo cannot trace
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.leaves[i] for i in self.tensor_positions)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The original value with its tensors replaced, in order, by `tensors`."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        if isinstance(self.structure, pytree.TreeSpec):
            return pytree.tree_unflatten(leaves, self.structure)
        return _build(self.structure, iter(leaves))

    def without_tensors(self) -> Flat:
        """The same structure with each tensor leaf replaced by its `TensorMeta`, so
        nothing here keeps the tensors alive."""
        leaves = list(self.leaves)
        for position in self.tensor_positions:
            leaves[position] = TensorMeta.of(leaves[position])
        return Flat(self.structure, tuple(leaves), self.tensor_positions)


# The leaves `_shape()` knows pytree treats as leaves too; anything else goes to pytree.
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_LEAF = "leaf"
_NOT_PLAIN = object()


def _shape(value: Any, leaves: list[Any]) -> object:
    """`value`'s structure, hashable (`_LEAF`, or the container's type with its children's
    shapes, and a dict's keys), its leaves appended to `leaves`; `_NOT_PLAIN` if it holds any
    other container (a namedtuple, an OrderedDict, a registered class), which pytree takes
    apart its own way."""
    kind = type(value)
    if kind is tuple or kind is list:
        children = []
        for item in value:
            child = _shape(item, leaves)
            if child is _NOT_PLAIN:
                return _NOT_PLAIN
            children.append(child)
        return (kind, tuple(children))
    if kind is dict:
        children = []
        for item in value.values():
            child = _shape(item, leaves)
            if child is _NOT_PLAIN:
                return _NOT_PLAIN
            children.append(child)
        return (dict, tuple(value), tuple(children))
    if isinstance(value, torch.Tensor) or kind in _PLAIN_LEAVES:
        leaves.append(value)
        return _LEAF
    return _NOT_PLAIN


def _build(shape: Any, leaves: Iterator[Any]) -> Any:
    """The value of structure `shape` with `leaves` at its leaves, in order."""
    if shape is _LEAF:
        return next(leaves)
    if shape[0] is dict:
        return {key: _build(child, leaves) for key, child in zip(shape[1], shape[2], strict=True)}
    return shape[0](_build(child, leaves) for child in shape[1])
