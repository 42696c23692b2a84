"""What the checkpoint core asks of an execution path.

An execution path is where a block's tensors run: torch's own eager devices, or torch_xla's
lazy tensors that become one compiled program per step. The core never asks which one it has;
it asks the path of its tensors (`xla_wrap._paths.path_of`) these questions. A new path (a
device whose compiler merges work, or that keeps saved values elsewhere) is a class with these
members, registered by device type in `xla_wrap/_paths/__init__.py` (`PATHS`); nothing in the
core changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch


class ExecutionPath(Protocol):
    """One execution path, as the checkpoint core sees it."""

    name: str  # the device type whose tensors run on this path ("eager": every other one)
    # The device types whose autocast settings a recomputation on this path replays.
    autocast_device_types: tuple[str, ...]
    # Whether a barrier means something here: the compiler could otherwise merge the
    # recomputation with the forward, or move it before the gradients arrive. Where it does,
    # barrier() returns new values; where not, aliases.
    barriers: bool
    # Whether the recomputation may stop once the last tensor the backward needs exists.
    stops_early: bool

    def barrier(
        self, tensors: Sequence[torch.Tensor], in_place: Sequence[bool]
    ) -> list[torch.Tensor]:
        """Detached tensors equal to `tensors` (all on this path), tied by one barrier; those
        marked `in_place` may share the caller's value, the others are copies."""
        ...

    def rewritable(self, tensor: torch.Tensor) -> bool:
        """Whether `barrier()` may share `tensor`'s value with the caller's tensor."""
        ...

    def note_outputs(self, outputs: Sequence[torch.Tensor]) -> list[object | None] | None:
        """What the gradients of a block's `outputs` must get back after the barrier (their
        layout: SPMD shardings on XLA), per output; None when there is nothing to keep."""
        ...

    def lay_out_gradients(
        self, notes: list[object | None], positions: Sequence[int], grads: Sequence[torch.Tensor]
    ) -> None:
        """Give each barriered gradient, of output `positions[i]`, what `note_outputs()`
        noted for that output."""
        ...

    def warn_if_barriers_stripped(self, tensors: Sequence[torch.Tensor]) -> None:
        """Warn (once) if this path's compiler deletes barriers before they can act."""
        ...

    def capture_rng(self, tensors: Sequence[torch.Tensor]) -> object:
        """The random-generator state a block computing on `tensors` starts from."""
        ...

    def refuse_unreplayable(self, api: str, captured: object) -> None:
        """Raise if the block's draws since `captured` cannot be replayed."""
        ...

    def replay_rng(self, captured: object) -> AbstractContextManager[None]:
        """Run the recomputation from `captured`; restore the generators afterwards."""
        ...

    def drew(self, captured: object) -> bool:
        """Whether the generators moved since `captured`: the block drew random numbers."""
        ...

    def seed_tensors(self, captured: object) -> list[torch.Tensor]:
        """Tensors holding the seeds of `captured`, for the barrier, so that the recomputed
        draws wait for it; none where draws need no such tie."""
        ...

    def drawing_from(
        self, captured: object, seeds: Sequence[torch.Tensor]
    ) -> AbstractContextManager[None]:
        """Within the recomputation: its draws read their seeds from `seeds`, the barriered
        `seed_tensors(captured)`."""
        ...

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
        """`tensor` kept in host memory, and the device to bring it back to (None: kept
        where it is, nothing to bring back)."""
        ...

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A value from `to_host()`, back on `device`."""
        ...
