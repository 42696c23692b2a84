"""``apply_activation_checkpointing``: wrap the submodules of a model in place."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ._errors import CheckpointTypeError, CheckpointValueError, describe
from ._options import options_from
from ._wrapper import CheckpointWrapper, refuse_eager_fsdp_unit
from .fsdp import format_units, fsdp_units
from .wrap import Policy

M = TypeVar("M", bound=nn.Module)


def apply_activation_checkpointing(
    model: M, check_fn: Callable[[nn.Module], bool] | Policy, **wrapper_options: Any
) -> M:
    """Wrap, in place, every submodule of ``model`` that ``check_fn`` selects.

    ``check_fn`` is either a callable ``check_fn(module) -> bool`` or a policy from
    :mod:`xla_wrap.wrap` (by type, by name, by size, every n-th, combinations). A policy sees the
    whole model at once; one that selects nothing gives a warning, and one that selects the
    model itself is refused.

    Children are visited before their parents (post-order), so ``check_fn`` sees a parent whose
    selected children are already wrapped. The root is never wrapped (it cannot be replaced in
    place; wrap it yourself with :func:`checkpoint_wrapper`). A module reachable under several
    names is wrapped once and the same wrapper is put at every place. An existing
    :class:`CheckpointWrapper` is left as it is, and nothing inside it is offered (that would
    nest checkpoints).

    Args:
        model: The model to modify.
        check_fn: Decides, per submodule, whether to checkpoint it.
        **wrapper_options: Keyword options for :func:`checkpoint_wrapper` (``policy``,
            ``use_reentrant``, ...).

    Returns:
        ``model`` itself.

    Raises:
        CheckpointTypeError: If ``model`` is not an ``nn.Module``, ``check_fn`` is not
            callable, or an option is unknown.
        CheckpointValueError: If a wrap policy selects ``model`` itself, or the save
            ``policy`` among the options is unknown.

    Example:
        >>> import torch, xla_wrap
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> model = xla_wrap.apply_activation_checkpointing(
        ...     model, lambda m: isinstance(m, torch.nn.Linear))
        >>> type(model[0]).__name__
        'CheckpointWrapper'
    """
    api = "xla_wrap.apply_activation_checkpointing"
    if not isinstance(model, nn.Module):
        raise CheckpointTypeError(
            f"{api}: expected an nn.Module as `model`, got {describe(model)}. Pass the model "
            "whose submodules should be checkpointed."
        )
    if not (isinstance(check_fn, Policy) or callable(check_fn)):
        raise CheckpointTypeError(
            f"{api}: expected a callable `check_fn(module) -> bool` or an xla_wrap.wrap policy, "
            f"got {describe(check_fn)}. Example: `check_fn=lambda m: isinstance(m, Block)` or "
            "`xla_wrap.wrap.by_type(Block)`."
        )
    options = options_from(api, wrapper_options)
    if isinstance(check_fn, Policy):
        check_fn = _resolved(api, check_fn, model)
    replacement: dict[int, nn.Module] = {}
    considered: set[int] = {id(model)}

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) in replacement:  # a module seen before under another name
                parent._modules[name] = replacement[id(child)]
                continue
            if id(child) in considered:
                continue
            considered.add(id(child))
            if isinstance(child, CheckpointWrapper):  # already checkpointed, inside included
                continue
            visit(child)
            if check_fn(child):
                refuse_eager_fsdp_unit(api, child)
                wrapper = CheckpointWrapper(child, options)
                replacement[id(child)] = parent._modules[name] = wrapper

    visit(model)
    return model


def _resolved(api: str, policy: Policy, model: nn.Module) -> Callable[[nn.Module], bool]:
    """Turn a policy into the per-module test for ``model``, refusing what cannot be done."""
    selected = policy.select(model)
    if any(module is model for _, module in selected):
        raise CheckpointValueError(
            f"{api}: the policy {policy!r} selects the model itself "
            f"({type(model).__name__}), which cannot be replaced in place. Narrow the policy "
            "to its submodules, or wrap the model yourself: "
            "`model = xla_wrap.checkpoint_wrapper(model)`."
        )
    units = [] if selected else fsdp_units(model)
    if units:
        raise CheckpointValueError(
            f"{api}: the policy {policy!r} selects nothing in a model that FSDP has already "
            f"wrapped (units at {format_units(units)}). FSDP "
            "flattens parameters and renames submodules, which hides them from rules on size "
            "and names. Checkpoint first, then shard: call apply_activation_checkpointing on "
            "the model before FSDP wraps it, or let FSDP build each unit as "
            "FSDP(checkpoint_wrapper(block)) with `auto_wrap_policy=xla_wrap.fsdp."
            "auto_wrap_policy(policy, model), auto_wrapper_callable=xla_wrap.fsdp."
            "auto_wrapper_callable()` (docs/fsdp.md)."
        )
    if not selected:
        warnings.warn(
            f"{api}: the policy {policy!r} selects no submodule of {type(model).__name__}; "
            "nothing is checkpointed. Check the classes, names or sizes it looks for.",
            stacklevel=3,
        )
    for _, module in selected:  # refuse before anything is replaced
        refuse_eager_fsdp_unit(api, module)
    chosen = {id(module) for _, module in selected}
    return lambda module: id(module) in chosen
