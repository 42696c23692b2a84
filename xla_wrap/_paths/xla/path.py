"""The XLA execution path: torch_xla's lazy tensors, compiled into one program per step, whose
compiler would merge a recomputation with the forward unless a barrier stands between them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from ..._support.errors import CheckpointError
from . import lowering, rng
from .runtime import in_gradient_accumulation_loop, is_device_data, spmd_active, xla_devices

XlaRng = tuple[tuple[torch.device, int], ...]  # the running seed of each XLA device


class XlaPath:
    name = "xla"
    autocast_device_types: tuple[str, ...] = ("xla",)
    barriers = True
    # The rest of a recomputed block is dead code the compiler drops; stopping early would
    # leave wrappers inside the block mid-forward (XLA FSDP's state machine then refuses the
    # next backward hook).
    stops_early = False

    def barrier(
        self, tensors: Sequence[torch.Tensor], in_place: Sequence[bool]
    ) -> list[torch.Tensor]:
        return lowering.barriered(tensors, in_place)

    def rewritable(self, tensor: torch.Tensor) -> bool:
        # Under SPMD a program input (data, masks) rewritten by a barrier would come out of the
        # step with another sharding and recompile the next one.
        return not (spmd_active() and is_device_data(tensor))

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

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
        if lowering.annotating_offload():
            return lowering.place_to_host(tensor), tensor.device
        lowering.warn_offload_kept_on_device()
        return tensor, None

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return lowering.place_to_device(tensor)


XLA = XlaPath()
