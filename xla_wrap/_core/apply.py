"""`apply_activation_checkpointing`: wrap the submodules of a model in place."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from .._support.checks import check_module, is_function
from .._support.errors import CheckpointTypeError, CheckpointValueError, describe
from ..wrap_policies import WrapPolicy
from . import hooks as _hooks
from .options import options_from
from .wrapper import CheckpointWrapper, checkpoint_in_place

M = TypeVar("M", bound=nn.Module)


def apply_activation_checkpointing(
    model: M,
    check_fn: Callable[[nn.Module], bool] | WrapPolicy | None = None,
    *,
    auto_wrap_policy: Any = None,
    **wrapper_options: Any,
) -> M:
    """Wrap, in place, every submodule of `model` that `check_fn` selects.

    `check_fn` is either a callable `check_fn(module) -> bool` or a wrap policy from
    [`xla_wrap.wrap_policies`][xla_wrap.wrap_policies] (by type, by name, by size, every n-th,
    combinations). A wrap policy sees the whole model at once; one that selects nothing gives
    a warning, and one that selects the model itself is refused. Instead of `check_fn`,
    PyTorch's keyword `auto_wrap_policy` takes an FSDP auto-wrap policy, as PyTorch's function
    of the same name does.

    Children are visited before their parents (post-order), so `check_fn` sees a parent whose
    selected children are already wrapped. The root is never wrapped (a policy means the blocks
    inside it; to checkpoint a whole model, call
    [`checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] on it). Selected modules are
    checkpointed in place, as [`checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] does: they
    keep their class, names and places. A module reachable under several names is offered
    once. A module already checkpointed is left as it is, and nothing inside it is offered
    (that would nest checkpoints).

    Args:
        model: The model to modify.
        check_fn: Decides, per submodule, whether to checkpoint it: a callable taking the
            module and returning a bool, or a [`WrapPolicy`][xla_wrap.wrap_policies.WrapPolicy].
            An FSDP policy given here is taken as `auto_wrap_policy`. `None` only with
            `auto_wrap_policy`.
        auto_wrap_policy: Instead of `check_fn`: a policy of `torch.distributed.fsdp.wrap`
            (`ModuleWrapPolicy({Block})`, `CustomPolicy`, or a function such as
            `partial(size_based_auto_wrap_policy, min_num_params=...)`, called with
            `recurse=False` and the parameter count not yet wrapped below the module).
        **wrapper_options: Keyword options for
            [`checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] (`preserve_rng_state`,
            `use_reentrant`, `policy`, `offload_to_cpu`), the same for every selected module.

    Returns:
        `model` itself.

    Raises:
        CheckpointTypeError: If `model` is not an `nn.Module`; `check_fn` is neither callable
            nor a wrap policy (or is missing); `auto_wrap_policy` is not an FSDP policy; an
            option is unknown (PyTorch's `checkpoint_wrapper_fn` included) or has the wrong
            type; or a selected module is a unit of PyTorch's FSDP1.
        CheckpointValueError: If both `check_fn` and `auto_wrap_policy` are given, a wrap
            policy selects `model` itself or nothing in a model FSDP has wrapped, or the save
            `policy` among the options is unknown.

    Examples:
        >>> import torch, xla_wrap
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> model = xla_wrap.apply_activation_checkpointing(
        ...     model, lambda m: isinstance(m, torch.nn.Linear))
        >>> isinstance(model[0], xla_wrap.CheckpointWrapper), isinstance(model[0], torch.nn.Linear)
        (True, True)
    """
    api = "xla_wrap.apply_activation_checkpointing"
    check_module(
        api,
        model,
        "an nn.Module as `model`",
        "Pass the model whose submodules should be checkpointed.",
    )
    if "checkpoint_wrapper_fn" in wrapper_options:
        raise CheckpointTypeError(
            f"{api}: got `checkpoint_wrapper_fn`, PyTorch's keyword for the wrapper to apply; "
            "xla_wrap applies its own checkpoint_wrapper. Pass its options as keywords instead "
            "(`use_reentrant=`, `preserve_rng_state=`, `policy=`, `offload_to_cpu=`)."
        )
    if auto_wrap_policy is not None and check_fn is not None:
        raise CheckpointValueError(
            f"{api}: expected `check_fn` or `auto_wrap_policy`, got both. Pass one: "
            "PyTorch ignores `check_fn` when `auto_wrap_policy` is given."
        )
    if hasattr(check_fn, "_run_policy"):  # an FSDP policy given as check_fn
        check_fn, auto_wrap_policy = None, check_fn
    if auto_wrap_policy is not None:
        check_fn = _from_fsdp_policy(api, auto_wrap_policy, model)
    if not (isinstance(check_fn, WrapPolicy) or is_function(check_fn)):
        raise CheckpointTypeError(
            f"{api}: expected a callable `check_fn(module) -> bool` or a wrap policy "
            "(xla_wrap.wrap_policies; or an FSDP policy as `auto_wrap_policy=`), got "
            f"{describe(check_fn)}. Example: "
            "`check_fn=lambda m: isinstance(m, Block)` or `xla_wrap.wrap_policies.by_type(Block)`."
        )
    options = options_from(api, wrapper_options)
    if isinstance(check_fn, WrapPolicy):
        check_fn = _resolved(api, check_fn, model)
    considered: set[int] = {id(model)}

    def visit(parent: nn.Module) -> None:
        for child in list(parent.children()):
            if id(child) in considered:  # a module seen before under another name
                continue
            considered.add(id(child))
            if isinstance(child, CheckpointWrapper):  # already checkpointed, inside included
                continue
            visit(child)
            if check_fn(child):
                checkpoint_in_place(api, child, options)

    visit(model)
    return model


def _from_fsdp_policy(api: str, policy: Any, model: nn.Module) -> Callable[[nn.Module], bool]:
    """The per-module test of an FSDP auto-wrap policy, as PyTorch's
    `apply_activation_checkpointing` applies one."""
    if hasattr(policy, "_run_policy"):  # torch.distributed.fsdp.wrap._Policy
        chosen = {id(m) for m in policy._run_policy(model, set(), {}) if m is not model}
        return lambda module: id(module) in chosen
    if not callable(policy):
        raise CheckpointTypeError(
            f"{api}: expected a policy of torch.distributed.fsdp.wrap as `auto_wrap_policy` "
            f"(ModuleWrapPolicy, CustomPolicy, or a function of (module, recurse, "
            f"nonwrapped_numel)), got {describe(policy)}. Or pass `check_fn`."
        )

    def check(module: nn.Module) -> bool:
        # As FSDP's recursive wrap: the parameters of the module not inside a wrapped child.
        wrapped = {
            id(p)
            for m in module.modules()
            if m is not module and isinstance(m, CheckpointWrapper)
            for p in m.parameters()
        }
        remainder = sum(p.numel() for p in module.parameters() if id(p) not in wrapped)
        return bool(policy(module=module, recurse=False, nonwrapped_numel=remainder))

    return check


def _resolved(api: str, wrap_policy: WrapPolicy, model: nn.Module) -> Callable[[nn.Module], bool]:
    """Turn a wrap policy into the per-module test for `model`, refusing what cannot be done."""
    selected = wrap_policy.select(model)
    if any(module is model for _, module in selected):
        raise CheckpointValueError(
            f"{api}: the wrap policy {wrap_policy!r} selects the model itself "
            f"({type(model).__name__}): checkpointing all of it keeps only its inputs and "
            "recomputes the whole forward. Narrow the wrap policy to its submodules, or, if that "
            "is what you want, wrap the model yourself: `xla_wrap.checkpoint_wrapper(model)`."
        )
    for hook in _hooks.installed():
        hook.check_selection(api, wrap_policy, model, [module for _, module in selected])
    if not selected:
        warnings.warn(
            f"{api}: the wrap policy {wrap_policy!r} selects no submodule of "
            f"{type(model).__name__}; nothing is checkpointed. Check the classes, names or "
            "sizes it looks for.",
            stacklevel=3,
        )
    for _, module in selected:  # refuse before anything is wrapped
        for hook in _hooks.installed():
            hook.check_module(api, module)
    chosen = {id(module) for _, module in selected}
    return lambda module: id(module) in chosen
