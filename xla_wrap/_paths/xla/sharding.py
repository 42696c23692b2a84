"""SPMD shardings of XLA tensors: read, copied and rebuilt from torch_xla's annotations."""

from __future__ import annotations

import re

import torch

from ..._support.warn import warn_once
from .runtime import is_xla_tensor, loaded


def sharding(tensor: torch.Tensor) -> object | None:
    """The SPMD sharding annotation of an XLA tensor (torch_xla's `OpSharding`), or None
    when the tensor has none that Python can see."""
    torch_xla = loaded("torch_xla")
    if torch_xla is None or not is_xla_tensor(tensor):
        return None
    if not torch_xla._XLAC._get_xla_sharding_spec(tensor):
        return None
    return torch_xla._XLAC._get_xla_op_sharding(tensor)


def shard_like(tensor: torch.Tensor, op_sharding: object) -> None:
    """Annotate the XLA `tensor` with `op_sharding` (from `sharding()`), in place."""
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None
    torch_xla._XLAC._xla_mark_sharding(tensor, op_sharding)


# A tiled sharding as torch_xla prints it: "{devices=[4,1,1]0,1,2,3}" or, with the devices as
# an iota, "{devices=[4,1,1]<=[4]}" ("<=[2,2]T(1,0)": reshaped and transposed), optionally
# replicated over the last tile dimension.
_TILED_SPEC = re.compile(
    r"\{devices=\[([\d,]+)\](?:([\d,]+)|<=\[([\d,]+)\](?:T\(([\d,]+)\))?)"
    r"( last_tile_dim_replicate)?\}"
)


def sharding_spec(tensor: torch.Tensor) -> str:
    """The SPMD sharding of an XLA tensor as torch_xla prints it; "" when it has none."""
    torch_xla = loaded("torch_xla")
    if torch_xla is None or not is_xla_tensor(tensor):
        return ""
    return str(torch_xla._XLAC._get_xla_sharding_spec(tensor))


def shard_by_spec(tensor: torch.Tensor, spec: str, *, leading: int = 0) -> bool:
    """Annotate the XLA `tensor` with the tiled sharding `spec` (from
    `sharding_spec()`), after `leading` new replicated dimensions (a stack of tensors
    sharded as `spec`). Returns False, annotating nothing, for a spec that is not tiled."""
    tiling = tiled_sharding(spec)
    if tiling is None:
        if spec and not spec.startswith(("{replicated", "{maximal", "{manual")):
            _warn_unread_sharding_once(spec)
        return False
    tiles, devices, sharded = tiling
    if tensor.dim() != leading + sharded:
        return False
    import numpy as np
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.array(devices), tiles)
    xs.mark_sharding(tensor, mesh, (None,) * leading + tuple(range(sharded)))
    return True


def tiled_sharding(spec: str) -> tuple[tuple[int, ...], list[int], int] | None:
    """A tiled sharding spec read: its tile counts per dimension, its devices in tile
    order, and how many of the dimensions are the tensor's (not trailing replicas); None for
    any other spec."""
    match = _TILED_SPEC.fullmatch(spec)
    if match is None:
        return None

    def numbers(text: str) -> list[int]:
        return [int(d) for d in text.split(",")]

    tiles = tuple(numbers(match.group(1)))
    if match.group(2):
        devices = numbers(match.group(2))
    else:  # an iota of devices, reshaped and maybe transposed
        shape = numbers(match.group(3))
        ids = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        if match.group(4):
            ids = ids.permute(numbers(match.group(4)))
        devices = ids.reshape(-1).tolist()
    return tiles, devices, len(tiles) - (1 if match.group(5) else 0)


def _warn_unread_sharding_once(spec: str) -> None:
    warn_once(
        ("unread sharding", spec),
        f"xla_wrap.scan_layers: cannot read the sharding {spec!r}, so the stacked carries are "
        "left to XLA's sharding propagation, which may partition the backward loop another "
        "way than the forward (more FLOPs per device). Please report this sharding.",
    )


def warn_unsharded_gradient_once() -> None:
    warn_once(
        "unsharded gradient",
        "xla_wrap: under SPMD, a checkpoint's output has no sharding annotation that xla_wrap "
        "can see, so its gradient after the barrier has none either, and XLA may replicate "
        "the recomputation (gathering activations in full). Annotate the output inside the "
        "checkpointed block with torch_xla.distributed.spmd.mark_sharding, or, inside "
        "SpmdFullyShardedDataParallel, build each unit with "
        "xla_wrap.fsdp.auto_wrapper_callable(fsdp_class=SpmdFullyShardedDataParallel) or nest "
        "as checkpoint_wrapper(SpmdFullyShardedDataParallel(block)) (docs/fsdp.md).",
        UserWarning,
        stacklevel=2,
    )
