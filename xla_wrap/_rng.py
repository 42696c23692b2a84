"""Random-number state for recomputation: CPU, CUDA and XLA.

A recomputed block must draw the same random numbers as its forward (Dropout masks), and the
code around it must see the RNG as if nothing had been recomputed. :func:`capture` records the
generators at forward time; :func:`replay` sets them for the recomputation and puts the
surrounding state back afterwards.

XLA keeps two numbers per device: a *running* seed that each random op advances, and a *base*
seed that the step started from and that every step marker advances. torch_xla's only setter
writes both, so after a recomputation the running seed can be restored but the base seed is
left at whatever was set last, and every later step would draw a different stream than the
unwrapped model. :class:`_StepBaseSeed` remembers the true base seed of the step and, through a
step closure, gives the next step the base seed XLA would have given it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from . import _xla
from ._errors import CheckpointError
from ._state import local


@dataclass(frozen=True)
class RngSnapshot:
    """Generator states taken when a checkpointed forward started."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]
    xla: tuple[tuple[torch.device, int], ...]


def capture(tensors: Iterable[torch.Tensor]) -> RngSnapshot:
    """Record the CPU generator, the CUDA generators of the devices that ``tensors`` use (only if
    CUDA is already initialised: capturing must not create a CUDA context), and the running seed
    of every XLA device among ``tensors``."""
    tensors = list(tensors)
    cuda: tuple[tuple[int, torch.Tensor], ...] = ()
    if torch.cuda.is_initialized():
        indices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        if not indices:
            indices = [torch.cuda.current_device()]
        cuda = tuple((i, torch.cuda.get_rng_state(i)) for i in indices)
    xla = tuple((d, _xla.rng_state(d)) for d in _xla.xla_devices(tensors))
    return RngSnapshot(cpu=torch.get_rng_state(), cuda=cuda, xla=xla)


def refuse_unreplayable(api: str, snapshot: RngSnapshot) -> None:
    """Refuse a forward that drew XLA random numbers where its draws cannot be replayed: in
    torch_xla's ``gradient_accumulation`` loop, the recomputation would draw other Dropout
    masks than the forward, and the gradients would be wrong without any error."""
    for device, seed in snapshot.xla:
        if _xla.rng_state(device) != seed and _xla.in_gradient_accumulation_loop():
            raise CheckpointError(
                f"{api}: the checkpointed block drew random numbers (Dropout) inside torch_xla's "
                "gradient_accumulation loop, which gives each iteration a seed of its own that "
                "the recomputation cannot replay: its masks would differ from the forward's and "
                "the gradients would be wrong. Inside that loop, checkpoint only blocks without "
                "random ops, or accumulate with a Python loop of forward and backward passes "
                "(each backward adds to .grad)."
            )


@contextmanager
def replay(snapshot: RngSnapshot) -> Iterator[None]:
    """Run the block with the generators as they were in ``snapshot``, then restore the
    generators as they were on entry (including on error)."""
    with ExitStack() as stack:
        stack.enter_context(_replay_cpu(snapshot.cpu))
        for index, state in snapshot.cuda:
            stack.enter_context(_replay_cuda(index, state))
        for device, seed in snapshot.xla:
            stack.enter_context(_replay_xla(device, seed))
        yield


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


@contextmanager
def _replay_xla(device: torch.device, seed: int) -> Iterator[None]:
    outside = _xla.rng_state(device)
    _StepBaseSeed.remember(device)
    _xla.set_rng_state(device, seed)
    try:
        yield
    finally:
        _xla.set_rng_state(device, outside)
        _StepBaseSeed.note_set(device, outside)


# How many random draws after the step's start a replay looks back for the base seed a step
# closure kept, before it reads the base seed from the device instead.
_DRAWS_LOOKED_BACK = 4096


def _base_seed(device: torch.device) -> int:
    """The base seed of the device's current step. Reading it from the device waits for the
    work queued on it (the previous step's execution, under SPMD on XLA:CPU: 0.5 s a step),
    so the seed the last step's closure kept is used when the running seed is that seed
    advanced by the step's draws so far (a user's reseed since breaks the chain)."""
    kept = local.next_base_seeds.pop(device, None)
    if kept is not None:
        running, seed = _xla.rng_state(device), kept
        for _ in range(_DRAWS_LOOKED_BACK):
            if seed == running:
                return kept
            seed = _xla.advance_seed(seed)
    return _xla.base_seed(device)


class _StepBaseSeed:
    """Per device and thread: the base seed of the current step, from the first replay in the
    step until the step marker, and the last seed a replay wrote.

    The table is thread-local (:data:`._state.local`), filled by the first replay of a step and
    emptied by the step closure that replay registers, so it cannot outlive its step.
    """

    def __init__(self, base: int) -> None:
        self.base = base
        self.last_set: int | None = None

    @classmethod
    def _table(cls) -> dict[torch.device, _StepBaseSeed]:
        table: dict[torch.device, _StepBaseSeed] = local.step_seeds
        return table

    @classmethod
    def remember(cls, device: torch.device) -> None:
        table, next_bases = cls._table(), local.next_base_seeds  # the replaying thread's
        if device in table:
            return
        table[device] = entry = cls(_base_seed(device))

        def restore_next_step_seed() -> None:
            table.pop(device, None)
            # Act only if the step marker advanced the seed a replay wrote; if the user seeded
            # the device after the replay, their seed stands.
            if entry.last_set is not None and _xla.rng_state(device) == _xla.next_step_seed(
                entry.last_set
            ):
                _xla.set_rng_state(device, _xla.next_step_seed(entry.base))
            # After the marker the running seed is the next step's base seed: kept, so that
            # the next step's first replay need not read it from the device.
            next_bases[device] = _xla.rng_state(device)

        _xla.add_step_closure(restore_next_step_seed)

    @classmethod
    def note_set(cls, device: torch.device, seed: int) -> None:
        entry = cls._table().get(device)
        if entry is not None:
            entry.last_set = seed
