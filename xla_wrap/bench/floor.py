"""The estimated memory floor of a checkpointed training step.

What any checkpointing scheme must keep, given which blocks it checkpoints: parameters and
their gradients; what the forward saves (each checkpointed block's input, every other block's
residuals, the data), counted by
[`xla_wrap.introspect.saved_residuals()`][xla_wrap.introspect.saved_residuals] on an ideally
checkpointed copy of the model; the internals of the largest checkpointed block while it is
recomputed; and the gradients flowing into and out of that block.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

import xla_wrap
from xla_wrap.introspect import saved_residuals

from .models import Workload


def estimated_floor(workload: Workload, checkpointed: Iterable[int]) -> int:
    """Bytes an ideal checkpoint of `checkpointed` blocks needs at peak (eager CPU, no XLA)."""
    chosen = set(checkpointed)
    model = workload.model
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    twin = copy.deepcopy(workload)
    for index in chosen:
        twin.blocks[index] = xla_wrap.checkpoint_wrapper(twin.blocks[index])
    kept = sum(
        r.nbytes
        for r in saved_residuals(twin.model, *workload.args, **workload.kwargs)
        if r.kind not in ("parameter", "buffer")  # an ideal checkpoint copies no buffer
    )
    internals = largest_output = 0
    h = workload.args[0]
    for index, block in enumerate(workload.blocks):
        h = h.detach().requires_grad_()
        if index in chosen:
            residuals = saved_residuals(block, h, **workload.kwargs)
            internals = max(internals, sum(r.nbytes for r in residuals if r.kind == "activation"))
        with torch.no_grad():
            h = block(h, **workload.kwargs)
        largest_output = max(largest_output, h.numel() * h.element_size())
    return 2 * param_bytes + kept + internals + 2 * largest_output
