"""The XLA execution path: torch_xla's lazy tensors, compiled into one program per step, whose
compiler would merge a recomputation with the forward unless a barrier stands between them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch

from ..._support.errors import CheckpointError
from . import draws, lowering, rng
from .runtime import (
    in_gradient_accumulation_loop,
    is_device_data,
    is_xla_tensor,
    spmd_active,
    xla_devices,
)
from .sharding import shard_like, sharding, warn_unsharded_gradient_once

XlaRng = tuple[tuple[torch.device, int], ...]  # the running seed of each XLA device


class XlaPath:
    name = "xla"
    autocast_device_types: tuple[str, ...] = ("xla",)
    barriers = True
    stops_early = False  # the engine's Rule 5 says why (xla_wrap/_core/engine.py)

    def barrier(
        self, tensors: Sequence[torch.Tensor], in_place: Sequence[bool]
    ) -> list[torch.Tensor]:
        return lowering.barriered(tensors, in_place)

    def rewritable(self, tensor: torch.Tensor) -> bool:
        # Under SPMD a program input (data, masks) rewritten by a barrier would come out of the
        # step with another sharding and recompile the next one.
        return not (spmd_active() and is_device_data(tensor))

    def note_outputs(self, outputs: Sequence[torch.Tensor]) -> list[object | None] | None:
        """Under SPMD, each output's sharding. XLA's sharding propagation does not pass through
        an optimization barrier, so a barriered gradient carries none, and the partitioner
        would then replicate the recomputation and gather its activations in full. A sharding
        given to an output after the checkpoint returned it (FSDPv2 annotates a unit's output
        then) is added later with `note_output_sharding()`."""
        return [sharding(t) for t in outputs] if spmd_active() else None

    def lay_out_gradients(
        self, notes: list[object | None], positions: Sequence[int], grads: Sequence[torch.Tensor]
    ) -> None:
        for position, grad in zip(positions, grads, strict=True):
            if sharding(grad) is not None:
                continue
            if notes[position] is not None:
                shard_like(grad, notes[position])
            elif is_xla_tensor(grad):
                warn_unsharded_gradient_once()

    def warn_if_barriers_stripped(self, tensors: Sequence[torch.Tensor]) -> None:
        lowering.warn_if_barriers_stripped(tensors)

    def capture_rng(self, tensors: Sequence[torch.Tensor]) -> XlaRng:
        return tuple((d, rng.rng_state(d)) for d in xla_devices(tensors))

    def refuse_unreplayable(self, api: str, captured: object) -> None:
        """Refuse a forward that drew XLA random numbers where its draws cannot be replayed: in
        torch_xla's `gradient_accumulation` loop, the recomputation would draw other Dropout
        masks than the forward, and the gradients would be wrong without any error."""
        assert isinstance(captured, tuple)
        for device, seed in captured:
            if rng.rng_state(device) != seed and in_gradient_accumulation_loop():
                raise CheckpointError(
                    f"{api}: the checkpointed block drew random numbers (Dropout) inside "
                    "torch_xla's gradient_accumulation loop, which gives each iteration a seed "
                    "of its own that the recomputation cannot replay: its masks would differ "
                    "from the forward's and the gradients would be wrong. Inside that loop, "
                    "checkpoint only blocks without random ops, or accumulate with a Python "
                    "loop of forward and backward passes (each backward adds to .grad)."
                )

    @contextmanager
    def replay_rng(self, captured: object) -> Iterator[None]:
        assert isinstance(captured, tuple)
        with ExitStack() as stack:
            for device, seed in captured:
                stack.enter_context(rng.replay(device, seed))
            yield

    def drew(self, captured: object) -> bool:
        assert isinstance(captured, tuple)
        return any(rng.rng_state(device) != seed for device, seed in captured)

    def seed_tensors(self, captured: object) -> list[torch.Tensor]:
        assert isinstance(captured, tuple)
        return draws.seed_tensors(captured)

    def drawing_from(
        self, captured: object, seeds: Sequence[torch.Tensor]
    ) -> AbstractContextManager[None]:
        assert isinstance(captured, tuple)
        return draws.drawing_from(captured, seeds) if seeds else nullcontext()

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
        if lowering.annotating_offload():
            return lowering.place_to_host(tensor), tensor.device
        lowering.warn_offload_kept_on_device()
        return tensor, None

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return lowering.place_to_device(tensor)


XLA = XlaPath()


def note_output_sharding(notes: object, position: int, op_sharding: object) -> None:
    """Add to what `XlaPath.note_outputs()` noted the sharding given to output `position`
    after the checkpoint returned it."""
    if isinstance(notes, list):
        notes[position] = op_sharding
