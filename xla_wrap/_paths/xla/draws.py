"""A recomputation's Dropout masks drawn from a seed that passes the barrier.

torch_xla draws every random number from the device's running seed, which enters the program
as a parameter of its own. A recomputation replays that seed (`rng.replay`), so its draws read
only a parameter: nothing ties them to the barrier, and XLA is free to compute them early.
It does: a recomputed Dropout mask has several readers (the recomputed forward and the
block's backward), so XLA materializes it, and its scheduler computes every block's masks at
the start of the program and holds them all until their backward (issue 37: a third more
peak memory on the benchmark's transformer than without Dropout, where a scanned stack, whose
loop body cannot be hoisted from, pays a tenth).

So the recomputation's `F.dropout` draws its noise itself: torch_xla's own lowering of the
noise (`empty_like(x).bernoulli_(1 - p).div_(1 - p)`, which is what `F.dropout` runs on XLA),
traced once per shape and turned into a computation whose seed is an input
(`_noise_computation`), is called with a seed tensor that passed the barrier together with the
gradients (`seed_tensors`). The same operations from the same seed: the same random numbers;
and the mask cannot be computed before the gradient of its block arrives.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..._support.errors import CheckpointError
from .rng import SEED_MASK, advance_seed, rng_state, set_rng_state
from .runtime import loaded

_SIGN_BIT = 1 << 63
_TRACE_SEED = 0x5EED  # any seed: only the traced computation is kept


def _signed(seed: int) -> int:
    """`seed` (an unsigned 64-bit seed) as the int64 that torch_xla's seed parameter holds."""
    seed &= SEED_MASK
    return seed - (1 << 64) if seed >= _SIGN_BIT else seed


def seed_tensors(captured: Sequence[tuple[torch.device, int]]) -> list[torch.Tensor]:
    """One int64 scalar per device of `captured` (a path capture: (device, running seed)),
    holding the seed its recomputation starts from, for the barrier."""
    return [torch.tensor(_signed(seed), dtype=torch.int64, device=d) for d, seed in captured]


@contextmanager
def drawing_from(
    captured: Sequence[tuple[torch.device, int]], seeds: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Within a recomputation replaying `captured`: `F.dropout` on those devices draws its
    noise from `seeds` (the barriered `seed_tensors(captured)`)."""
    torch_xla = loaded("torch_xla")
    if torch_xla is None or torch_xla._XLAC._get_use_eager_mode():
        yield  # eager mode draws from the seed before advancing it: not this lowering
        return
    starts = {d: (seed, tensor) for (d, seed), tensor in zip(captured, seeds, strict=True)}
    with _SeededDropout(starts):
        yield


class _SeededDropout(TorchFunctionMode):
    def __init__(self, starts: dict[torch.device, tuple[int, torch.Tensor]]) -> None:
        super().__init__()
        self.starts = starts

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(
        self, input: Any, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        start = self.starts.get(input.device) if isinstance(input, torch.Tensor) else None
        if start is None or not (training and 0 < p < 1 and input.numel()):
            return F.dropout(input, p, training, inplace)
        device = input.device
        seed, first = start
        running = rng_state(device)  # where torch_xla's draw would start from
        offset = _signed(running - seed)
        with torch.no_grad():
            seed_tensor = first if offset == 0 else first + offset
            noise = _noise(tuple(input.shape), input.dtype, float(p), device, seed_tensor)
        set_rng_state(device, advance_seed(running))  # the stream moves on as for that draw
        return input.mul_(noise) if inplace else input * noise


def _noise(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    p: float,
    device: torch.device,
    seed: torch.Tensor,
) -> torch.Tensor:
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None
    computation, constants, seed_index = _noise_computation(shape, dtype, p, device)
    inputs = [seed if i == seed_index else c for i, c in enumerate(constants)]
    (noise,) = torch_xla._XLAC._xla_user_computation(
        "xla::xla_wrap_dropout_noise", inputs, computation
    )
    return noise


@functools.lru_cache(maxsize=256)
def _noise_computation(
    shape: tuple[int, ...], dtype: torch.dtype, p: float, device: torch.device
) -> tuple[Any, list[torch.Tensor | None], int]:
    """torch_xla's lowering of Dropout's noise for `shape`, as a computation whose inputs are
    its device data: the seed (at the returned index, None in the list) and constants."""
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None  # an XLA device implies torch_xla is loaded
    xb = importlib.import_module("torch_xla.core.xla_builder")
    outside = rng_state(device)
    set_rng_state(device, _TRACE_SEED)  # the draw's seed a parameter of its own, not a chain
    try:
        with torch.no_grad():
            noise = torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p).div_(1 - p)
        context = torch_xla._XLAC.lowering.LoweringContext("xla_wrap_dropout_noise")
        context.build([noise])
        parameters = context.device_parameter_id_tensor_mapping()
        _, values = torch_xla._XLAC._get_tensors_xla_device_data_node([noise])
        # The seed is the int64 scalar holding _TRACE_SEED (by value: under SPMD its data
        # node does not always carry torch_xla's seed id).
        seeds = [v for v in values if v.dtype == torch.int64 and v.cpu().item() == _TRACE_SEED]
        if len(seeds) != 1:
            raise CheckpointError(
                f"xla_wrap: found {len(seeds)} seeds in torch_xla's lowering of Dropout's "
                f"noise, expected one; this torch_xla ({torch_xla.__version__}) lowers random "
                "numbers differently from 2.9: please report it"
            )
        seed_index = context.tensor_parameter_id(seeds[0])
        computation = xb.computation_from_module_proto("xla_wrap_dropout_noise", context.hlo())
    finally:
        set_rng_state(device, outside)
    constants = [None if i == seed_index else parameters[i] for i in range(len(parameters))]
    return computation, constants, seed_index
