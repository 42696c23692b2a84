"""Random-number state for recomputation, on every execution path.

A recomputed block must draw the same random numbers as its forward (Dropout masks), and the
code around it must see the RNG as if nothing had been recomputed. `capture()` records the
generators at forward time; `replay()` sets them for the recomputation and puts the
surrounding state back afterwards. Each execution path keeps its own generators (CPU and CUDA:
xla_wrap/_paths/eager.py; XLA's seeds: xla_wrap/_paths/xla/rng.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from .. import _paths


@dataclass(frozen=True)
class RngSnapshot:
    """Generator states taken when a checkpointed forward started, per execution path."""

    states: tuple[tuple[_paths.ExecutionPath, object], ...]


def capture(tensors: Iterable[torch.Tensor]) -> RngSnapshot:
    """Record every path's generators that a block computing on `tensors` draws from."""
    tensors = list(tensors)
    return RngSnapshot(tuple((path, path.capture_rng(tensors)) for path in _paths.PATHS))


def refuse_unreplayable(api: str, snapshot: RngSnapshot) -> None:
    """Raise if the forward since `snapshot` drew random numbers that no replay can draw
    again (see each path's `refuse_unreplayable`)."""
    for path, captured in snapshot.states:
        path.refuse_unreplayable(api, captured)


@contextmanager
def replay(snapshot: RngSnapshot) -> Iterator[None]:
    """Run the block with the generators as they were in `snapshot`, then restore the
    generators as they were on entry (including on error)."""
    with ExitStack() as stack:
        for path, captured in snapshot.states:
            stack.enter_context(path.replay_rng(captured))
        yield
