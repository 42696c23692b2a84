"""torch's own devices (CPU, CUDA, ...): every operation runs as it is called, so nothing can
merge a recomputation with the forward, and saved values go to pinned host memory."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EagerRng:
    """The CPU generator, and the CUDA generators of the devices a block uses."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]


class EagerPath:
    name = "eager"
    autocast_device_types: tuple[str, ...] = ("cpu", "cuda")
    barriers = False  # eager execution has nothing to reorder
    stops_early = True  # the engine's Rule 5 (xla_wrap/_core/engine.py)

    def barrier(
        self, tensors: Sequence[torch.Tensor], in_place: Sequence[bool]
    ) -> list[torch.Tensor]:
        with torch.no_grad():
            return [t.detach() for t in tensors]

    def rewritable(self, tensor: torch.Tensor) -> bool:
        return True

    def note_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        return None  # an eager barrier is a no-op: nothing is lost across it

    def lay_out_gradients(
        self, notes: list[object | None], positions: Sequence[int], grads: Sequence[torch.Tensor]
    ) -> None:
        pass

    def warn_if_barriers_stripped(self, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def capture_rng(self, tensors: Sequence[torch.Tensor]) -> EagerRng:
        # CUDA only if it is initialised already: capturing must not create a CUDA context.
        cuda: tuple[tuple[int, torch.Tensor], ...] = ()
        if torch.cuda.is_initialized():
            indices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
            if not indices:
                indices = [torch.cuda.current_device()]
            cuda = tuple((i, torch.cuda.get_rng_state(i)) for i in indices)
        return EagerRng(cpu=torch.get_rng_state(), cuda=cuda)

    def refuse_unreplayable(self, api: str, captured: object) -> None:
        pass

    @contextmanager
    def replay_rng(self, captured: object) -> Iterator[None]:
        assert isinstance(captured, EagerRng)
        with ExitStack() as stack:
            stack.enter_context(_replay_cpu(captured.cpu))
            for index, state in captured.cuda:
                stack.enter_context(_replay_cuda(index, state))
            yield

    def drew(self, captured: object) -> bool:
        assert isinstance(captured, EagerRng)
        return not torch.equal(torch.get_rng_state(), captured.cpu) or any(
            not torch.equal(torch.cuda.get_rng_state(i), state) for i, state in captured.cuda
        )

    def seed_tensors(self, captured: object) -> list[torch.Tensor]:
        return []  # each recomputation runs when its gradients arrive: nothing to tie

    def drawing_from(
        self, captured: object, seeds: Sequence[torch.Tensor]
    ) -> AbstractContextManager[None]:
        return nullcontext()

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
        if tensor.device.type == "cpu":
            return tensor, None  # in host memory already
        pinned = torch.empty(
            tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda"
        )
        return pinned.copy_(tensor.detach(), non_blocking=True), tensor.device

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)


@contextmanager
def _replay_cpu(state: torch.Tensor) -> Iterator[None]:
    outside = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(outside)


@contextmanager
def _replay_cuda(index: int, state: torch.Tensor) -> Iterator[None]:
    outside = torch.cuda.get_rng_state(index)
    torch.cuda.set_rng_state(state, index)
    try:
        yield
    finally:
        torch.cuda.set_rng_state(outside, index)


EAGER = EagerPath()
