"""What xla_wrap adds to an XLA program: optimization barriers and host-placement annotations,
and whether this backend keeps the barriers."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..._support.errors import BarriersStrippedWarning
from ..._support.flags import flag_values
from ..._support.state import local
from ..._support.warn import warn_once
from .runtime import is_xla_tensor, loaded

# The pass that deletes every opt-barrier on XLA:CPU before CSE (see docs/index.md).
BARRIER_STRIPPING_PASS = "cse_barrier_expander"


KEEP_BARRIERS_FLAG = f"--xla_disable_hlo_passes={BARRIER_STRIPPING_PASS}"


def barrier_(tensors: Sequence[torch.Tensor]) -> None:
    """Put the XLA tensors of `tensors` through one optimization barrier per device, in place.

    One barrier over all of them ties them together: XLA cannot compute anything that reads one
    barrier output before every input of the barrier exists, and cannot treat an output as the
    same value as its input (so common-subexpression elimination cannot merge work across it).
    The in-place form keeps autograd out of it; callers pass fresh detached copies.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if is_xla_tensor(tensor):
            by_device.setdefault(tensor.device, []).append(tensor)
    if not by_device:
        return
    xm = loaded("torch_xla.core.xla_model")
    assert xm is not None  # a tensor on XLA implies torch_xla is loaded
    for group in by_device.values():
        xm.optimization_barrier_(group)


# Backends whose compiler executes torch_xla's host-placement annotations. XLA:CPU aborts the
# process on them (`free(): invalid size`; tests/core/test_offload.py shows the values kept
# instead).
_HOST_OFFLOAD_DEVICE_TYPES = {"TPU", "CUDA", "GPU"}


def host_offload_supported() -> bool:
    """Whether this process's XLA backend can keep values in host memory inside a program."""
    runtime = loaded("torch_xla.runtime")
    return runtime is not None and runtime.device_type().upper() in _HOST_OFFLOAD_DEVICE_TYPES


def place_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` annotated to live in pinned host memory (`annotate_device_placement`)."""
    return _placement_ops().place_to_host(tensor)


def place_to_device(tensor: torch.Tensor) -> torch.Tensor:
    """A value placed by `place_to_host()`, annotated back to device memory."""
    return _placement_ops().place_to_device(tensor)


def _placement_ops() -> Any:
    importlib.import_module("torch_xla.experimental.stablehlo_custom_call")  # registers them
    return torch.ops.xla


def barrier_stripping_active(device_type: str, xla_flags: str | None = None) -> bool:
    """Whether XLA will delete optimization barriers before CSE on this backend.

    The XLA:CPU pipeline runs `cse_barrier_expander` before CSE unless the pass is disabled in
    `XLA_FLAGS`; then checkpointing saves no memory there. GPU expands barriers only after
    scheduling and TPU keeps them, so neither strips them early.

    Args:
        device_type: torch_xla's device type (`"CPU"`, `"TPU"`, `"CUDA"`, ...).
        xla_flags: The flags to inspect; `XLA_FLAGS` from the environment when omitted.
    """
    if device_type.upper() != "CPU":
        return False
    disabled = flag_values("--xla_disable_hlo_passes", xla_flags)
    return not any(BARRIER_STRIPPING_PASS in value.split(",") for value in disabled)


def warn_if_barriers_stripped(tensors: Iterable[torch.Tensor]) -> None:
    """Warn once per process when checkpointing XLA tensors on XLA:CPU with the barrier-stripping
    pass enabled: the step recomputes, but the memory saving cannot show there."""
    if any(is_xla_tensor(t) for t in tensors) and barriers_stripped_here():
        warn_once(
            "barriers stripped",
            "xla_wrap: checkpointing on XLA:CPU, whose compiler deletes optimization barriers "
            f"({BARRIER_STRIPPING_PASS}) before common-subexpression elimination: the step will "
            "recompute but save no memory here. Accelerators keep the barriers. To see the "
            f"saving on a CPU, start Python with XLA_FLAGS={KEEP_BARRIERS_FLAG}.",
            BarriersStrippedWarning,
        )


@functools.cache
def barriers_stripped_here() -> bool:
    """Whether this process's XLA backend deletes barriers before CSE (see
    `barrier_stripping_active()`). XLA reads its flags once per process, so the answer
    cannot change."""
    runtime = loaded("torch_xla.runtime")
    return runtime is not None and barrier_stripping_active(runtime.device_type())


def barriered(tensors: Sequence[torch.Tensor], in_place: Sequence[bool]) -> list[torch.Tensor]:
    """Detached XLA tensors equal to `tensors`, through one barrier per device together.

    A tensor marked `in_place` is barriered through a detached alias, which shares the lazy
    value with the caller's tensor: every later reader of that tensor reads the barrier's
    output as well, so XLA needs no copy to keep the pre-barrier value alive beside it
    (measured: one activation less at peak on the conv stack of docs/index.md). The others are
    cloned first and leave the caller's tensor untouched; use that for module state, which
    would otherwise become an output of every step.
    """
    with torch.no_grad():
        out = [
            t.detach() if keep else t.detach().clone()
            for t, keep in zip(tensors, in_place, strict=True)
        ]
    barrier_(out)
    return out


def annotating_offload() -> bool:
    """Whether offloaded values get host-placement annotations here."""
    return local.annotate_offload_anywhere or host_offload_supported()


@contextmanager
def annotating_offload_on_any_backend() -> Iterator[None]:
    """Emit the host-placement annotations even where the backend cannot execute them, to read
    the HLO a supporting backend would get. Never execute what is traced inside."""
    previous, local.annotate_offload_anywhere = local.annotate_offload_anywhere, True
    try:
        yield
    finally:
        local.annotate_offload_anywhere = previous


def warn_offload_kept_on_device() -> None:
    warn_once(
        "offload kept on device",
        "xla_wrap: offloading to host memory is not available on this XLA backend (XLA:CPU "
        "aborts on torch_xla's host-placement annotations), so the values stay in device "
        "memory and the step is otherwise unchanged. Offload takes effect on TPU and GPU; to "
        "save memory here, recompute instead (no offload, or a policy that saves less).",
    )
