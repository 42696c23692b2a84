"""Whether the current thread is recomputing a checkpointed forward.

Modules with side effects (counters, caches, logging) can ask :func:`is_recomputing` to run
them once per step instead of twice. The flag lives in a thread-local and is only ever set by
the :func:`recomputing` context manager, so an exception cannot leave it stuck.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


def is_recomputing() -> bool:
    """Return True while a checkpointed forward is being recomputed for backward.

    The flag is per thread and is True only inside the recomputation, never during the
    original forward.

    Returns:
        Whether the calling thread is inside a recomputation.

    Example:
        >>> import xla_wrap
        >>> xla_wrap.is_recomputing()
        False
    """
    return getattr(_local, "depth", 0) > 0


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the calling thread as recomputing for the duration of the block (nestable)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
