"""Checkpointing inside FSDP-sharded training: ready-made pieces for FSDP's auto-wrapping.

FSDP's ``auto_wrap_policy`` decides which submodules become sharded units, and its
``auto_wrapper_callable`` builds each unit. These helpers make every unit
``FSDP(checkpoint_wrapper(block))`` from an :mod:`xla_wrap.wrap` policy, without a lambda:

    >>> from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    >>> from xla_wrap import fsdp, wrap
    >>> policy = wrap.by_type(DecoderLayer)                                      # doctest: +SKIP
    >>> model = FSDP(model, auto_wrap_policy=fsdp.auto_wrap_policy(policy, model),
    ...              auto_wrapper_callable=fsdp.auto_wrapper_callable())         # doctest: +SKIP

With SPMD FSDPv2 pass ``fsdp_class=SpmdFullyShardedDataParallel``: the units it builds also
hand FSDPv2's output sharding to the checkpoint, so the recomputation stays sharded. Tested
with torch_xla's FSDP and FSDPv2 and with PyTorch's FSDP1 and FSDP2; docs/fsdp.md says which
nesting order to choose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from . import _xla
from ._errors import CheckpointValueError
from ._options import options_from
from ._recompute import record_output_sharding
from ._tree import Flat
from ._wrapper import CheckpointWrapper, checkpoint_wrapper
from .wrap import Policy

__all__ = ["auto_wrap_policy", "auto_wrapper_callable", "fsdp_units"]


def auto_wrap_policy(policy: Policy, model: nn.Module) -> Callable[..., bool]:
    """FSDP's ``auto_wrap_policy`` callback for the submodules ``policy`` selects in ``model``.

    Works with torch_xla's FSDP (``module=, recurse=, unwrapped_params=``) and PyTorch's FSDP1
    (``module, recurse, nonwrapped_numel``): FSDP recurses everywhere, and wraps exactly the
    selected modules. The selection is made on ``model`` as it is now, before FSDP wraps
    anything, so pass the model you are about to give FSDP.
    """
    units = fsdp_units(model)
    if units:
        raise CheckpointValueError(
            "xla_wrap.fsdp.auto_wrap_policy: expected the model before FSDP wraps it, got one "
            f"that already contains FSDP units (at {format_units(units)}). Build the policy "
            "from the unwrapped model and hand that model to FSDP with it."
        )
    chosen = {id(_unwrapped(module)) for _, module in policy.select(model)}

    def callback(module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        # A block checkpointed after the policy was made still counts as selected.
        return True if recurse else id(_unwrapped(module)) in chosen

    return callback


def auto_wrapper_callable(
    *, fsdp_class: type | None = None, **checkpoint_options: Any
) -> Callable[..., nn.Module]:
    """FSDP's ``auto_wrapper_callable``: build each unit as ``FSDP(checkpoint_wrapper(m))``.

    Args:
        fsdp_class: The FSDP class; torch_xla's ``XlaFullyShardedDataParallel`` if omitted.
        **checkpoint_options: Options for :func:`xla_wrap.checkpoint_wrapper`.
    """
    options_from("xla_wrap.fsdp.auto_wrapper_callable", checkpoint_options)  # fail early
    fsdp = fsdp_class or _xla.xla_fsdp_class()

    def build(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        unit: nn.Module = fsdp(checkpoint_wrapper(module, **checkpoint_options), *args, **kwargs)
        # SPMD FSDP shards the unit's output after the checkpoint returned it; the checkpoint's
        # backward must shard the gradient the same way (see _recompute.record_output_sharding).
        unit.register_forward_hook(_record_output_shardings)
        return unit

    return build


# FSDP wrapper classes: torch_xla's FSDP and FSDPv2, PyTorch's FSDP1 and FSDP2 (whose
# fully_shard makes each module an FSDPModule), FairScale's FSDP.
_FSDP_CLASS_NAMES = frozenset(
    {
        "XlaFullyShardedDataParallel",
        "SpmdFullyShardedDataParallel",
        "FullyShardedDataParallel",
        "FSDPModule",
    }
)


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.checkpoint_module if isinstance(module, CheckpointWrapper) else module


def fsdp_units(model: nn.Module) -> list[str]:
    """Qualified names of the FSDP units in ``model`` ("" for the model itself)."""
    return [
        name
        for name, module in model.named_modules()
        if any(cls.__name__ in _FSDP_CLASS_NAMES for cls in type(module).__mro__)
    ]


def format_units(units: list[str]) -> str:
    """The first few unit names for a message."""
    shown = ", ".join(repr(name or "<root>") for name in units[:3])
    return shown + (f" and {len(units) - 3} more" if len(units) > 3 else "")


def _record_output_shardings(module: nn.Module, args: Any, output: Any) -> None:
    for tensor in Flat.of(output).tensors:
        record_output_sharding(tensor)
