"""Autocast state for recomputation.

The recomputation runs in backward, where autocast is usually off; it must run under the
autocast settings the forward had, or it computes in other dtypes and gives other gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

_DEVICE_TYPES = ("cpu", "cuda", "xla")


@dataclass(frozen=True)
class AutocastSnapshot:
    """Per device type: (enabled, dtype); plus whether the autocast cache was enabled."""

    states: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool


def capture() -> AutocastSnapshot:
    """Record the autocast settings of every device type xla_wrap supports."""
    states = tuple(
        (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        for kind in _DEVICE_TYPES
    )
    return AutocastSnapshot(states=states, cache_enabled=torch.is_autocast_cache_enabled())


@contextmanager
def replay(snapshot: AutocastSnapshot) -> Iterator[None]:
    """Run the block under the autocast settings of `snapshot`.

    Only device types whose setting differs from the current one are touched, so a machine
    without CUDA never enters a CUDA autocast context.
    """
    with ExitStack() as stack:
        for kind, enabled, dtype in snapshot.states:
            if enabled == torch.is_autocast_enabled(kind) and (
                not enabled or dtype == torch.get_autocast_dtype(kind)
            ):
                continue
            stack.enter_context(
                torch.autocast(
                    kind, dtype=dtype, enabled=enabled, cache_enabled=snapshot.cache_enabled
                )
            )
        yield
