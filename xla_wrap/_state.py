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
