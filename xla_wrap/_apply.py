"""``apply_activation_checkpointing``: wrap the submodules of a model in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ._errors import CheckpointTypeError, describe
from ._wrapper import CheckpointWrapper, make_options

M = TypeVar("M", bound=nn.Module)


def apply_activation_checkpointing(
    model: M, check_fn: Callable[[nn.Module], bool], **wrapper_options: Any
) -> M:
    """Wrap, in place, every submodule of ``model`` for which ``check_fn`` returns True.

    Children are visited before their parents (post-order), so ``check_fn`` sees a parent whose
    selected children are already wrapped. The root is never wrapped (it cannot be replaced in
    place; wrap it yourself with :func:`checkpoint_wrapper`). A module reachable under several
    names is wrapped once and the same wrapper is put at every place. An existing
    :class:`CheckpointWrapper` is left as it is, and nothing inside it is offered (that would
    nest checkpoints).

    Args:
        model: The model to modify.
        check_fn: Decides, per submodule, whether to checkpoint it.
        **wrapper_options: Keyword options for :func:`checkpoint_wrapper`.

    Returns:
        ``model`` itself.

    Raises:
        CheckpointTypeError: If ``model`` is not an ``nn.Module``, ``check_fn`` is not
            callable, or an option is unknown.
        NotImplementedError: If ``offload_to_cpu`` is True (not available yet).

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
    if not callable(check_fn):
        raise CheckpointTypeError(
            f"{api}: expected a callable `check_fn(module) -> bool`, got {describe(check_fn)}. "
            "Example: `check_fn=lambda m: isinstance(m, Block)`."
        )
    try:
        options = make_options(api, **wrapper_options)
    except TypeError:
        raise CheckpointTypeError(
            f"{api}: expected wrapper options among `preserve_rng_state` and `offload_to_cpu`, "
            f"got {sorted(wrapper_options)}. Pass only those, as keywords."
        ) from None
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
                wrapper = CheckpointWrapper(child, options)
                replacement[id(child)] = parent._modules[name] = wrapper

    visit(model)
    return model
