"""The checkpointing variants the benchmark compares, each applied to the same blocks.

Each is what a user would write with that tool. `torch_xla.utils.checkpoint` rejects keyword
arguments, so its users bind them with `functools.partial`; that is what it gets here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

import xla_wrap


class _CallThrough(nn.Module):
    """Calls `checkpoint_fn(block, *args, **kwargs)`: how function-style APIs are used."""

    def __init__(self, block: nn.Module, checkpoint_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.block = block
        self.checkpoint_fn = checkpoint_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint_fn(self.block, *args, **kwargs)


def _torch_utils(block: nn.Module) -> nn.Module:
    import torch.utils.checkpoint as tuc

    return _CallThrough(block, lambda b, *a, **k: tuc.checkpoint(b, *a, use_reentrant=False, **k))


def _torch_wrapper(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(block)


def _fairscale(block: nn.Module) -> nn.Module:
    from fairscale.nn.checkpoint import checkpoint_wrapper

    return checkpoint_wrapper(block)


def _torch_xla(block: nn.Module) -> nn.Module:
    from torch_xla.utils.checkpoint import checkpoint

    def call(b: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(functools.partial(b, **kwargs) if kwargs else b, *args)

    return _CallThrough(block, call)


def _xla_wrap(block: nn.Module) -> nn.Module:
    return xla_wrap.checkpoint_wrapper(block)


def _xla_wrap_dots(block: nn.Module) -> nn.Module:
    return xla_wrap.checkpoint_wrapper(block, policy="dots_saveable")


class _TorchXlaScanned(xla_wrap.ScannedLayers):
    """The blocks through torch_xla's `scan_layers`, with min-cut rematerialization (what
    its docs suggest for activation checkpointing)."""

    def _run_stack(
        self, layers: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        from functorch.compile import min_cut_rematerialization_partition
        from torch_xla.experimental.scan_layers import scan_layers

        if kwargs or len(args) != 1:
            raise TypeError("torch_xla's scan_layers passes one input and no keyword arguments")
        return scan_layers(layers, args[0], partition_fn=min_cut_rematerialization_partition)


def _xla_wrap_scan(blocks: nn.ModuleList) -> nn.ModuleList:
    return xla_wrap.ScannedLayers(blocks)


def _xla_wrap_scan_stacked(blocks: nn.ModuleList) -> nn.ModuleList:
    return xla_wrap.ScannedLayers(blocks, stack_parameters=True)


def _torch_xla_scan(blocks: nn.ModuleList) -> nn.ModuleList:
    return _TorchXlaScanned(blocks)


VARIANTS: dict[str, Callable[[nn.Module], nn.Module] | None] = {
    "none": None,
    "torch.utils.checkpoint": _torch_utils,
    "torch checkpoint_wrapper": _torch_wrapper,
    "fairscale checkpoint_wrapper": _fairscale,
    "torch_xla.utils.checkpoint": _torch_xla,
    "xla_wrap": _xla_wrap,
    "xla_wrap dots_saveable": _xla_wrap_dots,
}

# Variants that replace the whole list of blocks: one scanned stack instead of a Python loop.
STACK_VARIANTS: dict[str, Callable[[nn.ModuleList], nn.ModuleList]] = {
    "torch_xla scan_layers": _torch_xla_scan,
    "xla_wrap scan": _xla_wrap_scan,
    "xla_wrap scan stacked": _xla_wrap_scan_stacked,
}
VARIANTS.update(dict.fromkeys(STACK_VARIANTS))

# Run only when asked for (--variants): torch_xla's scan_layers, which takes no keyword
# arguments (the default transformer passes its mask as one; the depth sweep runs it with the
# mask a buffer).
# The save policy and the scans run on the transformer only: a conv block is nothing but
# convolutions and ReLUs, so keeping the products keeps almost everything.
OPT_IN = ("torch_xla scan_layers",)
TRANSFORMER_ONLY = ("xla_wrap dots_saveable", *STACK_VARIANTS)
# The depth sweep (--depth): loops against scans, Dropout off (torch_xla's scan crashes on it).
DEPTH_VARIANTS = (
    "none",
    "torch_xla.utils.checkpoint",
    "xla_wrap",
    "torch_xla scan_layers",
    "xla_wrap scan",
    "xla_wrap scan stacked",
)
