"""Execution paths, and the switchboard the checkpoint core asks.

The core imports this module only, never a path's room: it asks the path of its tensors
(`path_of()`, `device_path()`) the questions of
`ExecutionPath`, and whether Dynamo is tracing (then every
checkpoint becomes the compiler's own, `xla_wrap._paths.compiled`). The rooms below are
each the only importer of their library: `xla` of torch_xla, `compiled` of Dynamo,
AOTAutograd and `torch.utils.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .base import ExecutionPath
from .compiled.checkpoint import checkpoint as compiled_checkpoint
from .compiled.checkpoint import compiling as compiling
from .compiled.checkpoint import tag as compiled_tag
from .eager import EAGER
from .xla.path import XLA

# Every path, in the order their random generators are captured and replayed.
PATHS: tuple[ExecutionPath, ...] = (EAGER, XLA)

__all__ = [
    "PATHS",
    "ExecutionPath",
    "barrier",
    "compiled_checkpoint",
    "compiled_tag",
    "compiling",
    "device_path",
    "path_of",
    "warn_if_barriers_stripped",
]


def device_path(device: torch.device) -> ExecutionPath:
    """The path tensors on `device` run on."""
    return XLA if XLA.owns(device) else EAGER


def path_of(tensors: Iterable[torch.Tensor]) -> ExecutionPath:
    """The path of a block computing on `tensors`: XLA if any of them is an XLA tensor."""
    return XLA if any(XLA.owns(t.device) for t in tensors) else EAGER


def barrier(tensors: Sequence[torch.Tensor], in_place: Sequence[bool]) -> list[torch.Tensor]:
    """Detached tensors equal to `tensors`, each path's members through that path's barrier
    together (see `ExecutionPath.barrier()`)."""
    pairs = list(zip(tensors, in_place, strict=True))
    out = list(tensors)
    for path in PATHS:
        picked = [i for i, (t, _) in enumerate(pairs) if device_path(t.device) is path]
        if picked:
            done = path.barrier([tensors[i] for i in picked], [in_place[i] for i in picked])
            for i, tensor in zip(picked, done, strict=True):
                out[i] = tensor
    return out


def warn_if_barriers_stripped(tensors: Sequence[torch.Tensor]) -> None:
    """Warn (once per path) where a path's compiler deletes barriers before they act."""
    for path in PATHS:
        path.warn_if_barriers_stripped(tensors)
