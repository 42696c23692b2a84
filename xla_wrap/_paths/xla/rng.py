"""XLA random numbers: the device's seeds, and replaying them for a recomputation.

XLA keeps two numbers per device: a *running* seed that each random op advances, and a *base*
seed that the step started from and that every step marker advances. torch_xla's only setter
writes both, so after a recomputation the running seed can be restored but the base seed is
left at whatever was set last, and every later step would draw a different stream than the
unwrapped model. `StepBaseSeed` remembers the true base seed of the step and, through a
step closure, gives the next step the base seed XLA would have given it. All of xla_wrap's
handling of XLA seeds lives in this file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .runtime import loaded

# XLA advances each device's base seed at every step marker with this affine map
# (LazyGraphExecutor::DeviceContextArena::MarkStep); xla_wrap must reproduce it to give the
# next step the seed it would have had without checkpointing.
_STEP_SEED_MUL = 7012063
_STEP_SEED_ADD = 1012031
SEED_MASK = (1 << 64) - 1
# ... and each random op advances the running seed (XLAGraphExecutor::GetRngSeed).
_DRAW_SEED_MUL = 214013
_DRAW_SEED_ADD = 2531011


def rng_state(device: torch.device) -> int:
    """The running RNG seed of an XLA device (what its next random op will advance from)."""
    xm = loaded("torch_xla.core.xla_model")
    assert xm is not None  # only called with XLA devices
    return int(xm.get_rng_state(str(device)))


def set_rng_state(device: torch.device, seed: int) -> None:
    """Set both the running and the base RNG seed of an XLA device."""
    xm = loaded("torch_xla.core.xla_model")
    assert xm is not None
    xm.set_rng_state(seed, str(device))


def advance_seed(seed: int) -> int:
    """The running seed after one random op draws from `seed` (XLA's per-draw step)."""
    return (_DRAW_SEED_ADD + seed * _DRAW_SEED_MUL) & SEED_MASK


def base_seed(device: torch.device) -> int:
    """The base seed of an XLA device: the seed its step started from.

    Reading it restarts the device's pending seed chain at the base seed, so call it only right
    before `set_rng_state()` overwrites the state anyway.
    """
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None
    return int(torch_xla._XLAC._get_base_seed_as_tensor(str(device)).cpu().item())


def next_step_seed(seed: int) -> int:
    """The base seed XLA gives the next step when this step's base seed is `seed`."""
    return (_STEP_SEED_ADD + seed * _STEP_SEED_MUL) & SEED_MASK


def add_step_closure(closure: Callable[[], None]) -> None:
    """Run `closure` after the next step marker (`torch_xla.sync()`)."""
    xm = loaded("torch_xla.core.xla_model")
    assert xm is not None
    xm.add_step_closure(closure)


@contextmanager
def replay(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block with the device's running seed at `seed`, then put the seed back and keep
    the step's base seed true (see `StepBaseSeed`)."""
    outside = rng_state(device)
    StepBaseSeed.remember(device)
    set_rng_state(device, seed)
    try:
        yield
    finally:
        set_rng_state(device, outside)
        StepBaseSeed.note_set(device, outside)


# How many random draws after the step's start a replay looks back for the base seed a step
# closure kept, before it reads the base seed from the device instead.
_DRAWS_LOOKED_BACK = 4096


class _SeedTables(threading.local):
    """Per thread (each thread replays its own steps): the seeds a step's replays keep. The
    only mutable state of this room; `StepBaseSeed` fills and empties it."""

    def __init__(self) -> None:
        # Per XLA device: the base seed of the current step and the last seed a replay wrote.
        self.step_seeds: dict[Any, StepBaseSeed] = {}
        # Per XLA device: the base seed a step closure saw the next step start from.
        self.next_base_seeds: dict[Any, int] = {}


_tables = _SeedTables()


def base_seed_of_step(device: torch.device) -> int:
    """The base seed of the device's current step. Reading it from the device waits for the
    work queued on it (the previous step's execution, under SPMD on XLA:CPU: 0.5 s a step),
    so the seed the last step's closure kept is used when the running seed is that seed
    advanced by the step's draws so far (a user's reseed since breaks the chain)."""
    kept = _tables.next_base_seeds.pop(device, None)
    if kept is not None:
        running, seed = rng_state(device), kept
        for _ in range(_DRAWS_LOOKED_BACK):
            if seed == running:
                return kept
            seed = advance_seed(seed)
    return base_seed(device)


class StepBaseSeed:
    """Per device and thread: the base seed of the current step, from the first replay in the
    step until the step marker, and the last seed a replay wrote.

    The table is thread-local (`_SeedTables`), filled by the first replay of a step and
    emptied by the step closure that replay registers, so it cannot outlive its step.
    """

    def __init__(self, base: int) -> None:
        self.base = base
        self.last_set: int | None = None

    @classmethod
    def _table(cls) -> dict[torch.device, StepBaseSeed]:
        return _tables.step_seeds

    @classmethod
    def remember(cls, device: torch.device) -> None:
        table, next_bases = cls._table(), _tables.next_base_seeds  # the replaying thread's
        if device in table:
            return
        table[device] = entry = cls(base_seed_of_step(device))

        def restore_next_step_seed() -> None:
            table.pop(device, None)
            # Act only if the step marker advanced the seed a replay wrote; if the user seeded
            # the device after the replay, their seed stands.
            if entry.last_set is not None and rng_state(device) == next_step_seed(entry.last_set):
                set_rng_state(device, next_step_seed(entry.base))
            # After the marker the running seed is the next step's base seed: kept, so that
            # the next step's first replay need not read it from the device.
            next_bases[device] = rng_state(device)

        add_step_closure(restore_next_step_seed)

    @classmethod
    def note_set(cls, device: torch.device, seed: int) -> None:
        entry = cls._table().get(device)
        if entry is not None:
            entry.last_set = seed


@contextmanager
def call_seed(device: torch.device) -> Iterator[int]:
    """A seed of its own for one call (a scanned stack), from the device's stream; afterwards
    the stream moves on by one draw (two calls in a row must not share masks)."""
    outside = rng_state(device)
    StepBaseSeed.remember(device)
    try:
        yield mix(outside)
    finally:
        after = advance_seed(outside)
        set_rng_state(device, after)
        StepBaseSeed.note_set(device, after)


@contextmanager
def keep_stream(device: torch.device) -> Iterator[None]:
    """The device's stream as it was on entry, after whatever the block seeds (a backward loop
    built with its call's seed)."""
    outside = rng_state(device)
    try:
        yield
    finally:
        set_rng_state(device, outside)
        StepBaseSeed.note_set(device, outside)


def mix(seed: int) -> int:
    """SplitMix64 of `seed`: a seed unrelated to the stream `seed` continues."""
    z = (seed + 0x9E3779B97F4A7C15) & SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & SEED_MASK
    return (z ^ (z >> 31)) >> 1  # non-negative as an int64
