"""Split nested Python values into their tensors and everything else, and put them back.

Checkpointed callables take and return any nesting of tuples, lists, dicts and namedtuples with
non-tensor values mixed in. The autograd Function sees only the flat tensors; `Flat`
keeps the structure and the non-tensor leaves so that the exact value can be rebuilt around new
tensors. The structure comes from `torch.utils._pytree`, which also knows the containers that
libraries register (transformers registers its `ModelOutput`).
"""

from __future__ import annotations

from collections.abc import Sequence
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

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    tensor_positions: tuple[int, ...]

    @classmethod
    def of(cls, value: Any) -> Flat:
        leaves, spec = pytree.tree_flatten(value)
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        return cls(spec=spec, leaves=tuple(leaves), tensor_positions=positions)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.leaves[i] for i in self.tensor_positions)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The original value with its tensors replaced, in order, by `tensors`."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.spec)

    def without_tensors(self) -> Flat:
        """The same structure with each tensor leaf replaced by its `TensorMeta`, so
        nothing here keeps the tensors alive."""
        leaves = list(self.leaves)
        for position in self.tensor_positions:
            leaves[position] = TensorMeta.of(leaves[position])
        return Flat(spec=self.spec, leaves=tuple(leaves), tensor_positions=self.tensor_positions)
