"""The package's one piece of mutable state: what the current thread is doing right now.

Every field is per thread and is changed only by a context manager that puts the previous
value back in ``finally`` (the RNG step tables are the exception: a step closure updates them
at the step marker they belong to), so an exception cannot leave a flag stuck and two threads
never see each other's checkpoints.
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
        # the outer ones from xla_wrap's own operations); see _selective.
        self.selections: list[Any] = []
        # Emit host-placement annotations even where the backend cannot run them (HLO reading).
        self.annotate_offload_anywhere = False
        # Per XLA device: the base seed of the current step and the last seed a replay wrote;
        # see _rng.
        self.step_seeds: dict[Any, Any] = {}
        # Per XLA device: the base seed a step closure saw the next step start from; see _rng.
        self.next_base_seeds: dict[Any, int] = {}


local = ThreadState()


def is_recomputing() -> bool:
    """Return True while a checkpointed forward is being recomputed for backward.

    Modules with side effects (counters, caches, logging) can ask this to run them once per
    step instead of twice. The flag is per thread and is True only inside the recomputation,
    never during the original forward.

    Returns:
        Whether the calling thread is inside a recomputation.

    Example:
        >>> import xla_wrap
        >>> xla_wrap.is_recomputing()
        False
    """
    return local.recomputing > 0


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the calling thread as recomputing for the duration of the block (nestable)."""
    local.recomputing += 1
    try:
        yield
    finally:
        local.recomputing -= 1


@contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Run every xla_wrap checkpoint as the plain call inside this context.

    Wrapped modules, :func:`~xla_wrap.checkpoint`, :func:`~xla_wrap.checkpoint_sequential` and
    scanned stacks (:func:`~xla_wrap.scan_layers`, :class:`~xla_wrap.ScannedLayers`) called
    inside it run as if unwrapped: one forward, activations kept, no recomputation, the
    ordinary Python loop for a scanned stack. For evaluation with gradients, debugging, or a
    comparison against the unwrapped model without unwrapping it; as FairScale's context of
    the same name. It decides at forward time: a backward inside it of a forward run outside
    still recomputes.

    The setting is per thread (other threads keep checkpointing), the contexts nest, and the
    previous setting comes back on exit, also when the body raises. It works as a decorator
    too. Inside ``torch.compile`` it applies when the function is traced.

    Example:
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
    """Whether :func:`disable_checkpointing` is in effect on the calling thread."""
    return local.checkpointing_disabled > 0


@contextmanager
def checkpointing_as_in_forward() -> Iterator[None]:
    """Inside a recomputation: checkpointing on, as it was when the checkpointed forward ran
    (a backward inside :func:`disable_checkpointing` must recompute nested checkpoints as
    checkpoints, or the recomputation would save other tensors than the forward)."""
    outside, local.checkpointing_disabled = local.checkpointing_disabled, 0
    try:
        yield
    finally:
        local.checkpointing_disabled = outside
