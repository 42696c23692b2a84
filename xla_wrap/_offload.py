"""Keeping what a checkpoint saves in host memory until backward needs it.

* Eager CUDA: each tensor is copied into pinned host memory without blocking, and copied back,
  again without blocking, when backward starts. Eager CPU tensors are in host memory already.
* XLA: the values get torch_xla's ``annotate_device_placement`` custom calls (to pinned host in
  the forward, back to the device in backward) inside the one compiled program, so the graph is
  never split and a step stays one execution. Only backends that execute these annotations get
  them (:func:`._xla.host_offload_supported`); XLA:CPU aborts the process on them, so there the
  values stay on the device and a warning says so, once.

Brought back, the values go through the checkpoint's barrier like any other input of the
recomputation, so the copy back cannot start before the gradients arrive either.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from . import _xla
from ._state import local


def to_host(
    tensors: Sequence[torch.Tensor], offload: Sequence[bool]
) -> tuple[list[torch.Tensor], list[torch.device | None]]:
    """Host copies of the ``tensors`` marked in ``offload`` (the others as they are), and the
    device each offloaded one must go back to (None: nothing to bring back)."""
    out: list[torch.Tensor] = []
    devices: list[torch.device | None] = []
    for tensor, wanted in zip(tensors, offload, strict=True):
        device = None
        if wanted and _xla.is_xla_tensor(tensor):
            if _annotating():
                tensor, device = _xla.place_to_host(tensor), tensor.device
            else:
                _warn_kept_on_device_once()
        elif wanted and tensor.device.type != "cpu":
            device = tensor.device
            pinned = torch.empty(
                tensor.shape,
                dtype=tensor.dtype,
                pin_memory=tensor.device.type == "cuda",
            )
            tensor = pinned.copy_(tensor.detach(), non_blocking=True)
        out.append(tensor)
        devices.append(device)
    return out, devices


def to_device(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device | None]
) -> list[torch.Tensor]:
    """The inverse of :func:`to_host`."""
    out = []
    for tensor, device in zip(tensors, devices, strict=True):
        if device is not None:
            if device.type == "xla":
                tensor = _xla.place_to_device(tensor)
            else:
                tensor = tensor.to(device, non_blocking=True)
        out.append(tensor)
    return out


def _annotating() -> bool:
    return local.annotate_offload_anywhere or _xla.host_offload_supported()


@contextmanager
def annotating_on_any_backend() -> Iterator[None]:
    """Emit the host-placement annotations even where the backend cannot execute them, to read
    the HLO a supporting backend would get. Never execute what is traced inside."""
    previous, local.annotate_offload_anywhere = local.annotate_offload_anywhere, True
    try:
        yield
    finally:
        local.annotate_offload_anywhere = previous


@functools.cache
def _warn_kept_on_device_once() -> None:
    warnings.warn(
        "xla_wrap: offloading to host memory is not available on this XLA backend (XLA:CPU "
        "aborts on torch_xla's host-placement annotations), so the values stay in device "
        "memory and the step is otherwise unchanged. Offload takes effect on TPU and GPU; to "
        "save memory here, recompute instead (no offload, or a policy that saves less).",
        UserWarning,
        stacklevel=_xla._caller_stacklevel(),
    )
