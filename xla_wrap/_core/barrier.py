"""The public optimization barrier, which keeps autograd intact. (The checkpoint's own barrier
is the engine's Rule 1, xla_wrap/_core/engine.py.)

`xm.optimization_barrier` returns detached tensors, so a loss computed after it gets no
gradients (examples/digits_barrier.py: MNIST stuck at chance). Here the barrier is an autograd
Function: values pass through a barrier in forward, and incoming gradients pass through a
barrier of their own in backward, so gradient computation cannot be fused across it either.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _paths
from .._support.errors import CheckpointTypeError, describe


class _Barrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_paths.path_of(tensors).barrier(tensors, [False] * len(tensors)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Through the Function again: under `create_graph=True` the gradients stay differentiable.
        return tuple(_Barrier.apply(*grads))


def optimization_barrier(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stop XLA from moving or merging computation across these tensors, keeping gradients.

    All tensors pass through one barrier: nothing that reads an output can start before every
    input exists, and XLA cannot treat an output as the input it came from. Unlike
    `torch_xla.core.xla_model.optimization_barrier`, gradients flow to every input, and the
    incoming gradients are barriered together in backward. Off XLA it returns the tensors
    unchanged.

    Args:
        *tensors: The tensors to tie together.

    Returns:
        A tuple with one tensor per input, equal in value to it.

    Raises:
        CheckpointTypeError: If an argument is not a tensor.

    Examples:
        >>> import torch, xla_wrap
        >>> x = torch.ones(2, requires_grad=True)
        >>> y, = xla_wrap.optimization_barrier(x * 2)
        >>> y.sum().backward()
        >>> x.grad
        tensor([2., 2.])
    """
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointTypeError(
                f"xla_wrap.optimization_barrier: expected tensors, got {describe(tensor)} at "
                f"position {index}. Pass only tensors, e.g. `out, = optimization_barrier(out)`."
            )
    if not _paths.path_of(tensors).barriers:
        return tuple(tensors)
    return tuple(_Barrier.apply(*tensors))
