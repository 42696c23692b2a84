"""Execution paths, looked up by device type, and the one branch into the compiler.

The checkpoint core asks the path of its block (`path_of()`) the questions of `ExecutionPath`
and never which device it runs on. Paths are registered by device type in `PATHS`; every other
device type runs on the eager path. A path that is not in play costs nothing: a step on the CPU
calls no XLA code. The rooms below are each the only importer of their library: `xla` of
torch_xla, `compiled` of Dynamo, AOTAutograd and `torch.utils.checkpoint`.

Under `torch.compile` no path runs at all: `compiling()` is the one branch, taken where a
checkpoint starts, into the compiler's own checkpoint (`compiled_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from .base import ExecutionPath
from .compiled.checkpoint import checkpoint as compiled_checkpoint
from .compiled.checkpoint import tag as compiled_tag
from .compiled.frames import never_traced_first, outside_the_compiler
from .compiled.regions import in_layer_region
from .eager import EAGER
from .xla.path import XLA

# Device type -> the path its tensors run on. Every device type not named here is eager.
PATHS: dict[str, ExecutionPath] = {XLA.name: XLA}

__all__ = [
    "EAGER",
    "PATHS",
    "ExecutionPath",
    "branches_on_compiling",
    "compiled_checkpoint",
    "compiled_tag",
    "compiling",
    "device_path",
    "generator_paths",
    "in_layer_region",
    "outside_the_compiler",
    "path_of",
]


def device_path(device: torch.device) -> ExecutionPath:
    """The path tensors on `device` run on."""
    return PATHS.get(device.type, EAGER)


def path_of(tensors: Iterable[torch.Tensor]) -> ExecutionPath:
    """The path of a block computing on `tensors`: the first registered one among their
    device types, else eager."""
    for tensor in tensors:
        path = PATHS.get(tensor.device.type)
        if path is not None:
            return path
    return EAGER


def generator_paths(path: ExecutionPath) -> tuple[ExecutionPath, ...]:
    """The paths whose random generators and autocast settings a block on `path` reads: its
    own, and the eager one (any block may draw or cast on the CPU)."""
    return (EAGER,) if path is EAGER else (EAGER, path)


def compiling() -> bool:
    """Whether Dynamo is tracing the caller (`torch.compile`): then a checkpoint becomes the
    compiler's own, and no execution path runs. Here, not in the compiled room, so that an
    eager step never enters that room to ask."""
    return bool(torch.compiler.is_compiling())


_F = TypeVar("_F", bound=Callable[..., Any])


def branches_on_compiling(function: _F) -> _F:
    """Mark `function`, which branches on `compiling()`: Dynamo traces it only when inlining
    it from a frame it traces, and runs it natively when it is the first frame Dynamo sees.
    That happens after a graph break (xla_wrap/_paths/compiled/frames.py), and the function
    must then take the eager branch, which its callees, run natively too, agree with."""
    never_traced_first(function)
    return function


branches_on_compiling(compiling)
