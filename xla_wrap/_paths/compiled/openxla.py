"""torch_xla's `openxla` Dynamo backend, with a barrier in front of each recomputed region.

`openxla` hands a checkpoint's backward graph to XLA as one program, and XLA may run every
region's recomputation at the program's start: measured, the backward program then holds every
block's activations at once and the step's peak is the uncheckpointed one. This backend is
`with_region_barriers("openxla", barrier=xla_barrier)` (xla_wrap/_paths/compiled/barriers.py
says how the barriers are placed), plus a stand-in for `torch.xla` while AOTAutograd traces.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from ..._support.errors import CheckpointError, CheckpointTypeError, describe
from .. import xla
from .barriers import with_region_barriers

API = "xla_wrap.openxla_backend"


def openxla_backend(
    graph_module: fx.GraphModule, example_inputs: Sequence[torch.Tensor]
) -> Callable[..., Any]:
    """A `torch.compile` backend: torch_xla's `openxla`, with optimization barriers.

    The barriers order each checkpoint's recomputation after the gradient that needs it.

    With plain `backend="openxla"` a checkpoint recomputes but saves no memory: XLA runs
    every recomputation at the start of the backward program. Here the step's peak is that of
    the lazy-tensor path (docs/compile.md has the figures). Also known to `torch.compile` by
    name, as `backend="xla_wrap_openxla"` (for trainers that take a string).

    Pass the function itself as `backend=`; Dynamo calls it, once per graph it captures.

    Args:
        graph_module: The FX graph Dynamo captured.
        example_inputs: Example inputs of that graph.

    Returns:
        The compiled function that Dynamo runs in place of the graph (forward and backward
        through XLA).

    Raises:
        CheckpointError: If torch_xla is not installed.
        CheckpointTypeError: If `graph_module` is not an FX graph or `example_inputs` not a
            list of them.

    Examples:
        >>> model = torch.compile(model, backend=xla_wrap.openxla_backend)  # doctest: +SKIP
    """
    if not isinstance(graph_module, fx.GraphModule):
        raise CheckpointTypeError(
            f"{API}: expected the FX graph Dynamo captured (a torch.fx.GraphModule) as "
            f"`graph_module`, got {describe(graph_module)}. Pass the backend itself to "
            "torch.compile: `torch.compile(model, backend=xla_wrap.openxla_backend)`."
        )
    if not isinstance(example_inputs, (list, tuple)):
        raise CheckpointTypeError(
            f"{API}: expected a list of example inputs as `example_inputs`, got "
            f"{describe(example_inputs)}. Dynamo passes them; pass the backend to torch.compile."
        )
    if not xla.installed():
        raise CheckpointError(
            f"{API}: expected torch_xla (the openxla backend compiles through it), got none "
            "installed. Install torch_xla with the torch of its release (2.9.0), or compile "
            "with another backend (backend='inductor')."
        )
    backend = with_region_barriers("openxla", barrier=xla_barrier)
    with _xla_device_module():
        return backend(graph_module, example_inputs)


@contextlib.contextmanager
def _xla_device_module() -> Iterator[None]:
    """`torch.xla` while AOTAutograd traces: selective checkpointing looks up the device
    module of its inputs' device (`getattr(torch, "xla")`, which torch_xla 2.9 does not
    register), only to read `_initialized`. Without it, a save policy fails to compile with
    `AttributeError: module 'torch' has no attribute 'xla'`."""
    if hasattr(torch, "xla"):
        yield
        return
    stand_in = types.ModuleType("torch.xla", "Stand-in while xla_wrap.openxla_backend traces.")
    setattr(torch, "xla", stand_in)  # noqa: B010 (torch declares no such attribute)
    try:
        yield
    finally:
        delattr(torch, "xla")


def xla_barrier(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch_xla's optimization barrier as a graph operation: a list of tensors in, the same
    values out, XLA ones through one barrier (copied in), others as detached aliases."""
    return xla.barriered(tensors, [not xla.is_xla_tensor(t) for t in tensors])
