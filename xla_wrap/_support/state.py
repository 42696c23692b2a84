"""The package's shared mutable state: what more than one room reads.

Per thread (`local`): what the calling thread is doing right now. Every field is changed
only by a context manager that puts the previous value back in `finally`, so an exception
cannot leave a flag stuck and two threads never see each other's checkpoints.

Per process (`process`): registries that only grow, each written in one place: the
installed checkpoint hooks (xla_wrap/_core/hooks.py), the checkpointed class made for each
module class (xla_wrap/_core/wrapper.py), and the warnings already given
(xla_wrap/_support/warn.py).

State one room alone reads lives in that room, declared at the top of its module: XLA's
per-step seed tables (xla_wrap/_paths/xla/rng.py, `_SeedTables`, per thread; a step closure
empties them at the step marker they belong to) and the planners' measured steps
(xla_wrap/_plan/planner.py, `_PlannerState`; xla_wrap/_plan/compiled_planner.py,
`_CompiledPlannerState`).

Kept elsewhere, by design: per-process probes cached with `functools.cache` whose answer
cannot change (XLA flags and ops: xla_wrap/_paths/xla/), the recording classes made for
`xla_wrap._scan.alike`, the values xla_wrap keeps on the objects it wraps (under
`_xla_wrap_*` or `_checkpoint_*` names, declared where they are written), and the effects
on other libraries that the user asks for: `XLA_FLAGS` (xla_wrap/_support/flags.py),
`torch.xla` while the openxla backend compiles (xla_wrap/_paths/compiled/openxla.py),
transformers' checkpoint function (xla_wrap/integrations/transformers.py) and the custom op
`xla_wrap::checkpoint_name` (xla_wrap/_paths/compiled/checkpoint.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ThreadState(threading.local):
    """What xla_wrap is doing on the calling thread."""

    def __init__(self) -> None:
        # How many recomputations are running (they nest: a checkpoint inside a checkpoint).
        self.recomputing = 0
        # How many disable_checkpointing() contexts are open (they nest too).
        self.checkpointing_disabled = 0
        # The save-policy selections of the running checkpoints, innermost last (None hides
        # the outer ones from xla_wrap's own operations); see xla_wrap/_core/selective.py.
        self.selections: list[Any] = []
        # Emit host-placement annotations even where the backend cannot run them (HLO reading).
        self.annotate_offload_anywhere = False


local = ThreadState()


class ProcessState:
    """What xla_wrap has set up in this process (registries that only grow)."""

    def __init__(self) -> None:
        # The checkpoint hooks every checkpoint consults, in installation order.
        self.hooks: tuple[Any, ...] = ()
        # The checkpointed class made for each module class (one per class, reused).
        self.checkpointed_classes: dict[type, type] = {}
        # The keys of the warn-once warnings already given.
        self.warned: set[Any] = set()


process = ProcessState()


def is_recomputing() -> bool:
    """Return True while a checkpointed forward is being recomputed for backward.

    Modules with side effects (counters, caches, logging) can ask this to run them once per
    step instead of twice. The flag is per thread and is True only inside the recomputation,
    never during the original forward.

    Returns:
        Whether the calling thread is inside a recomputation.

    Examples:
        >>> import xla_wrap
        >>> xla_wrap.is_recomputing()
        False
    """
    return local.recomputing > 0


class Recomputing:
    """While a recomputation runs: [`is_recomputing()`][xla_wrap.is_recomputing] is true, and
    checkpointing is on as it was when the checkpointed forward ran (a backward inside
    [`disable_checkpointing()`][xla_wrap.disable_checkpointing] must recompute nested
    checkpoints as checkpoints, or the recomputation would save other tensors than the
    forward). Nestable; a class rather than a generator, since every recomputation enters it."""

    __slots__ = ("_disabled",)

    def __enter__(self) -> None:
        local.recomputing += 1
        self._disabled, local.checkpointing_disabled = local.checkpointing_disabled, 0

    def __exit__(self, *exc: object) -> None:
        local.recomputing -= 1
        local.checkpointing_disabled = self._disabled


@contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Run every xla_wrap checkpoint as the plain call inside this context.

    Wrapped modules, [`checkpoint()`][xla_wrap.checkpoint],
    [`checkpoint_sequential()`][xla_wrap.checkpoint_sequential] and scanned stacks
    ([`scan_layers()`][xla_wrap.scan_layers], [`ScannedLayers`][xla_wrap.ScannedLayers])
    called inside it run as if unwrapped: one forward, activations kept, no recomputation, the
    ordinary Python loop for a scanned stack. For evaluation with gradients, debugging, or a
    comparison against the unwrapped model without unwrapping it; as FairScale's context of
    the same name. It decides at forward time: a backward inside it of a forward run outside
    still recomputes.

    The setting is per thread (other threads keep checkpointing), the contexts nest, and the
    previous setting comes back on exit, also when the body raises. It works as a decorator
    too. Inside `torch.compile` it applies when the function is traced.

    Yields:
        Nothing: the body of the `with` statement runs with checkpointing off.

    Examples:
        >>> import torch, xla_wrap
        >>> layer = xla_wrap.checkpoint_wrapper(torch.nn.Linear(4, 4))
        >>> with xla_wrap.disable_checkpointing():
        ...     y = layer(torch.randn(2, 4))
        >>> y.grad_fn.name()  # the plain layer's graph, no checkpoint in it
        'AddmmBackward0'
    """
    local.checkpointing_disabled += 1
    try:
        yield
    finally:
        local.checkpointing_disabled -= 1


def checkpointing_disabled() -> bool:
    """Whether [`disable_checkpointing()`][xla_wrap.disable_checkpointing] is in effect on the
    calling thread."""
    return local.checkpointing_disabled > 0
