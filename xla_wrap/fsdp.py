"""Checkpointing inside FSDP-sharded training: ready-made pieces for FSDP's auto-wrapping.

FSDP's `auto_wrap_policy` decides which submodules become sharded units, and its
`auto_wrapper_callable` builds each unit. These helpers make every unit
`FSDP(checkpoint_wrapper(block))` from an [`xla_wrap.wrap_policies`][xla_wrap.wrap_policies]
policy, without a lambda (the example at the end).

With SPMD FSDPv2 pass `fsdp_class=SpmdFullyShardedDataParallel`: the units it builds also
hand FSDPv2's output sharding to the checkpoint, so the recomputation stays sharded. Tested
with torch_xla's FSDP and FSDPv2 and with PyTorch's FSDP1 and FSDP2; docs/fsdp.md says which
nesting order to choose.

The core of xla_wrap knows nothing about FSDP or SPMD: what they need from a checkpoint comes
from the hooks installed at import (xla_wrap/_fsdp/units.py, through xla_wrap/_core/hooks.py),
which refuse checkpointing around an eager FSDP unit and keep SPMD shardings across the barrier.

Examples:
    >>> from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    >>> from xla_wrap import fsdp, wrap_policies
    >>> policy = wrap_policies.by_type(DecoderLayer)  # doctest: +SKIP
    >>> model = FSDP(  # doctest: +SKIP
    ...     model,
    ...     auto_wrap_policy=fsdp.auto_wrap_policy(policy, model),
    ...     auto_wrapper_callable=fsdp.auto_wrapper_callable(),
    ... )
"""

from ._fsdp.units import auto_wrap_policy as auto_wrap_policy
from ._fsdp.units import auto_wrapper_callable as auto_wrapper_callable
from ._fsdp.units import format_units as format_units
from ._fsdp.units import fsdp_units as fsdp_units
from ._fsdp.units import is_unit as is_unit

__all__ = ["auto_wrap_policy", "auto_wrapper_callable", "fsdp_units"]
