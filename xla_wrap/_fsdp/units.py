"""FSDP units built around checkpoints, and the hooks that keep FSDP out of the checkpoint
core (the face is [`xla_wrap.fsdp`][xla_wrap.fsdp])."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from .._core import hooks as _hooks
from .._core.engine import record_of
from .._core.options import options_from
from .._core.wrapper import checkpoint_wrapper
from .._layouts import is_fsdp_unit as is_unit
from .._paths import xla as _xla
from .._plan.checkpoint_plan import CheckpointPlan
from .._support.checks import check_module, is_function
from .._support.errors import CheckpointTypeError, CheckpointValueError, describe
from .._support.tree import Flat
from ..wrap_policies import WrapPolicy

__all__ = ["auto_wrap_policy", "auto_wrapper_callable", "fsdp_units"]


def auto_wrap_policy(policy: WrapPolicy, model: nn.Module) -> Callable[..., bool]:
    """FSDP's `auto_wrap_policy` callback for the submodules `policy` selects in `model`.

    Works with torch_xla's FSDP (`module=, recurse=, unwrapped_params=`) and PyTorch's FSDP1
    (`module, recurse, nonwrapped_numel`): FSDP recurses everywhere, and wraps exactly the
    selected modules. The selection is made on `model` as it is now, before FSDP wraps
    anything, so pass the model you are about to give FSDP.

    Args:
        policy: The [`xla_wrap.wrap_policies`][xla_wrap.wrap_policies] policy that selects
            the modules to become FSDP units.
        model: The model about to be given to FSDP, not wrapped by FSDP yet.

    Returns:
        The callback to pass as FSDP's `auto_wrap_policy`: `True` when FSDP asks whether to
        recurse, and, for a module, whether `policy` selected it.

    Raises:
        CheckpointTypeError: If `policy` is not a wrap policy or `model` not an `nn.Module`.
        CheckpointValueError: If `model` already contains FSDP units.

    Examples:
        >>> import torch
        >>> from xla_wrap import fsdp, wrap_policies
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> callback = fsdp.auto_wrap_policy(wrap_policies.by_type(torch.nn.Linear), model)
        >>> callback(module=model[0], recurse=False, unwrapped_params=6)
        True
        >>> callback(module=model[1], recurse=False, unwrapped_params=0)
        False
    """
    api = "xla_wrap.fsdp.auto_wrap_policy"
    if not isinstance(policy, WrapPolicy):
        raise CheckpointTypeError(
            f"{api}: expected a policy of xla_wrap.wrap_policies as `policy`, got "
            f"{describe(policy)}. Example: `wrap_policies.by_type(Block)`."
        )
    check_module(api, model, "the model about to be given to FSDP as `model`")
    units = fsdp_units(model)
    if units:
        raise CheckpointValueError(
            "xla_wrap.fsdp.auto_wrap_policy: expected the model before FSDP wraps it, got one "
            f"that already contains FSDP units (at {format_units(units)}). Build the policy "
            "from the unwrapped model and hand that model to FSDP with it."
        )
    chosen = {id(module) for _, module in policy.select(model)}

    def callback(module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return True if recurse else id(module) in chosen

    return callback


def auto_wrapper_callable(
    *, fsdp_class: type | None = None, plan: CheckpointPlan | None = None, **checkpoint_options: Any
) -> Callable[..., nn.Module]:
    """FSDP's `auto_wrapper_callable`: build each unit as `FSDP(checkpoint_wrapper(m))`.

    The unit's output sharding, when SPMD FSDPv2 gives it one, is handed to the checkpoint,
    so that the recomputation in backward stays sharded.

    Args:
        fsdp_class: The FSDP class to build units with (`SpmdFullyShardedDataParallel` for
            FSDPv2); torch_xla's `XlaFullyShardedDataParallel` if omitted.
        plan: A [`xla_wrap.CheckpointPlan`][xla_wrap.CheckpointPlan] made on the model about
            to be wrapped: each unit is checkpointed as the plan chose for its module (or not
            at all), in place of one set of options for all.
        **checkpoint_options: Options for
            [`xla_wrap.checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper]
            (`preserve_rng_state`, `use_reentrant`, `policy`, `offload_to_cpu`), the same for
            every unit; not with `plan`.

    Returns:
        The callable to pass as FSDP's `auto_wrapper_callable`: called with a module and
        FSDP's arguments, it returns the FSDP unit.

    Raises:
        CheckpointTypeError: If an option is unknown or has the wrong type, `fsdp_class` is
            not a class, or `plan` is not a `CheckpointPlan` or is given with other options.
        CheckpointValueError: If the save `policy` is unknown.
        ImportError: If `fsdp_class` is omitted and torch_xla is not installed.
    """
    api = "xla_wrap.fsdp.auto_wrapper_callable"
    options = options_from(api, checkpoint_options)  # fail early
    if plan is not None and (checkpoint_options or not isinstance(plan, CheckpointPlan)):
        raise CheckpointTypeError(
            f"{api}: expected a CheckpointPlan as `plan` and no other checkpoint options (the "
            f"plan chooses them per unit), got plan={describe(plan)} and "
            f"{sorted(checkpoint_options)}. Pass one or the other."
        )
    if fsdp_class is not None and not (isinstance(fsdp_class, type) or is_function(fsdp_class)):
        raise CheckpointTypeError(
            f"{api}: expected an FSDP class as `fsdp_class` (or None for torch_xla's "
            f"XlaFullyShardedDataParallel), got {describe(fsdp_class)}."
        )
    fsdp = _xla.xla_fsdp_class() if fsdp_class is None else fsdp_class

    def build(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        chosen = options if plan is None else plan.options_of(module)
        if chosen is None:  # the plan keeps this unit's activations
            unit: nn.Module = fsdp(module, *args, **kwargs)
            return unit
        checkpointed = checkpoint_wrapper(module, **chosen.as_keywords())
        unit = fsdp(checkpointed, *args, **kwargs)
        _record_output_shardings(checkpointed, unit)
        return unit

    return build


def fsdp_units(model: nn.Module) -> list[str]:
    """Qualified names of the FSDP units in `model`.

    A unit is a module of any FSDP class (torch_xla's FSDP and FSDPv2, PyTorch's FSDP1 and
    FSDP2, FairScale's), recognised by class name.

    Args:
        model: The model to look through, itself included.

    Returns:
        The units' qualified names in `named_modules` order (`""` for the model itself);
        empty if FSDP has not wrapped anything in `model`.

    Raises:
        CheckpointTypeError: If `model` is not an `nn.Module`.

    Examples:
        >>> import torch
        >>> from xla_wrap import fsdp
        >>> fsdp.fsdp_units(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        []
    """
    check_module("xla_wrap.fsdp.fsdp_units", model, "an nn.Module as `model`")
    return [name for name, module in model.named_modules() if is_unit(module)]


def format_units(units: list[str]) -> str:
    """The first few unit names for a message."""
    shown = ", ".join(repr(name or "<root>") for name in units[:3])
    return shown + (f" and {len(units) - 3} more" if len(units) > 3 else "")


def _record_output_shardings(checkpointed: nn.Module, unit: nn.Module) -> None:
    """Hand the shardings SPMD FSDP gives `unit`'s outputs to the checkpoint inside it.

    FSDPv2 annotates a unit's outputs once the unit returns, after the checkpoint returned them
    (through module hooks, on aliases); the checkpoint's backward must shard their gradients
    the same way. A forward hook on the checkpointed module sees the checkpoint's own outputs;
    one on the unit sees what it returns, in the same order; the core names the checkpoint
    behind each of the former (`record_of`).
    """
    returned: list[Any] = []  # per call in progress (a unit may run inside itself)

    def checkpoint_returned(module: nn.Module, args: Any, output: Any) -> None:
        returned.append(output)

    def unit_returned(module: nn.Module, args: Any, output: Any) -> None:
        inner = Flat.of(returned.pop()).tensors if returned else ()
        outer = Flat.of(output).tensors
        if len(inner) != len(outer):
            return
        for own, annotated in zip(inner, outer, strict=True):
            found = record_of(own)
            op_sharding = _xla.sharding(annotated)
            if found is not None and op_sharding is not None:
                record, position = found
                _xla.note_output_sharding(record.output_notes, position, op_sharding)

    checkpointed.register_forward_hook(checkpoint_returned)
    unit.register_forward_hook(unit_returned)


class _EagerFsdpUnits(_hooks.CheckpointHook):
    """Refuse what cannot work with FSDP units already in the model (when wrapping: nothing
    of it runs in a step)."""

    device_types: frozenset[str] = frozenset()

    def check_module(self, api: str, module: nn.Module) -> None:
        """Refuse to checkpoint a unit of PyTorch's FSDP1.

        FSDP1's unit is a wrapper whose forward gathers and frees the parameters and
        registers backward hooks; recomputed in backward, it would run that forward again
        where FSDP1's state machine expects a backward. FSDP2's `fully_shard` keeps its
        hooks on the module itself, so they run around the checkpoint, as they do for
        `fully_shard(checkpoint_wrapper(block))`; torch_xla's FSDP expects checkpoints
        around its units (docs/fsdp.md).
        """
        eager_fsdp = sys.modules.get("torch.distributed.fsdp")
        if eager_fsdp is None:
            return
        fsdp1 = getattr(eager_fsdp, "FullyShardedDataParallel", None)
        if isinstance(fsdp1, type) and isinstance(module, fsdp1):
            raise CheckpointTypeError(
                f"{api}: expected a module that FSDP has not wrapped, got "
                f"{type(module).__name__}, which is a unit of PyTorch's FSDP1. Checkpoint inside "
                "each unit instead: checkpoint the blocks before `FullyShardedDataParallel` "
                "wraps them, or apply_activation_checkpointing to the FSDP1-wrapped model with "
                "a policy that selects the blocks (docs/fsdp.md)."
            )

    def check_selection(
        self, api: str, wrap_policy: object, model: nn.Module, selected: Sequence[nn.Module]
    ) -> None:
        """Refuse a wrap policy that selects nothing in a model FSDP has wrapped: FSDP flattened
        and renamed what the wrap policy looks for."""
        units = [] if selected else fsdp_units(model)
        if units:
            raise CheckpointValueError(
                f"{api}: the wrap policy {wrap_policy!r} selects nothing in a model that FSDP has "
                f"already wrapped (units at {format_units(units)}). FSDP flattens parameters "
                "and renames submodules, which hides them from rules on size and names. "
                "Checkpoint first, then shard: call apply_activation_checkpointing on the model "
                "before FSDP wraps it, or let FSDP build each unit as "
                "FSDP(checkpoint_wrapper(block)) with `auto_wrap_policy=xla_wrap.fsdp."
                "auto_wrap_policy(wrap_policy, model), auto_wrapper_callable=xla_wrap.fsdp."
                "auto_wrapper_callable()` (docs/fsdp.md)."
            )


class _XlaFsdpRecomputing(_hooks.CheckpointHook):
    """Tell XLA FSDP that a checkpointed block is being recomputed in backward, as torch_xla's
    own checkpoint does: XLA FSDP then skips resharding the parameters it is about to gather
    again (`torch_xla.utils.checkpoint.chkpt_status`)."""

    device_types = frozenset({"xla"})
    library = "torch_xla.utils.checkpoint"  # XLA FSDP imports it; the flag lives there

    def replaying(self) -> AbstractContextManager[None]:
        return _xla.checkpoint_backward_status()


_hooks.install(_EagerFsdpUnits())
_hooks.install(_XlaFsdpRecomputing())
