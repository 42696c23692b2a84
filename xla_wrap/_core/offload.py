"""Keeping what a checkpoint saves in host memory until backward needs it.

* Eager CUDA: each tensor is copied into pinned host memory without blocking, and copied back,
  again without blocking, when backward starts. Eager CPU tensors are in host memory already.
* XLA: the values get torch_xla's `annotate_device_placement` custom calls (to pinned host in
  the forward, back to the device in backward) inside the one compiled program, so the graph is
  never split and a step stays one execution. Only backends that execute these annotations get
  them (xla_wrap/_paths/xla/lowering.py); XLA:CPU aborts the process on them, so there the
  values stay on the device and a warning says so, once.

Brought back, the values go through the checkpoint's barrier like any other input of the
recomputation, so the copy back cannot start before the gradients arrive either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _paths


def to_host(
    tensors: Sequence[torch.Tensor], offload: Sequence[bool]
) -> tuple[list[torch.Tensor], list[torch.device | None]]:
    """Host copies of the `tensors` marked in `offload` (the others as they are), and the
    device each offloaded one must go back to (None: nothing to bring back)."""
    out: list[torch.Tensor] = []
    devices: list[torch.device | None] = []
    for tensor, wanted in zip(tensors, offload, strict=True):
        device = None
        if wanted:
            tensor, device = _paths.device_path(tensor.device).to_host(tensor)
        out.append(tensor)
        devices.append(device)
    return out, devices


def to_device(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device | None]
) -> list[torch.Tensor]:
    """The inverse of `to_host()`."""
    return [
        tensor if device is None else _paths.device_path(device).to_device(tensor, device)
        for tensor, device in zip(tensors, devices, strict=True)
    ]
