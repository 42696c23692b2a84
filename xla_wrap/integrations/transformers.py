"""Hugging Face transformers: switch a model's own gradient checkpointing to xla_wrap's.

transformers' ``model.gradient_checkpointing_enable()`` checkpoints with
``torch.utils.checkpoint``, which fails on XLA (``module 'torch' has no attribute 'xla'``) and
would save no memory there anyway. transformers lets a model take another checkpoint function;
this module hands it :func:`xla_wrap.checkpoint`, which finds each layer's parameters from the
``functools.partial`` of the layer's ``__call__`` that transformers passes:

    >>> from xla_wrap.integrations import transformers as xla_hf
    >>> xla_hf.gradient_checkpointing_enable(model, every_n_layers=2)  # doctest: +SKIP
    >>> xla_hf.gradient_checkpointing_disable(model)                   # doctest: +SKIP

Needs transformers (``pip install 'xla_wrap[hf]'``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import Any

from torch import nn

from .._checkpoint import checkpoint
from .._errors import CheckpointTypeError, CheckpointValueError, describe
from .._options import options_from

__all__ = ["gradient_checkpointing_disable", "gradient_checkpointing_enable"]

# The model's config.use_cache while checkpointing is on, restored when it is switched off.
_SAVED_USE_CACHE = "_xla_wrap_saved_use_cache"


def gradient_checkpointing_enable(
    model: nn.Module, *, every_n_layers: int = 1, **checkpoint_options: Any
) -> None:
    """Checkpoint the layers of a transformers ``PreTrainedModel`` with xla_wrap.

    Every ``every_n_layers``-th layer (the first, then every n-th) is checkpointed; the others
    keep their activations. ``config.use_cache`` is set to False, as transformers users are
    told to when checkpointing (a key/value cache cannot be recomputed, and filling one while
    training changes the attention's numerics); :func:`gradient_checkpointing_disable`
    restores it.

    Args:
        model: A transformers ``PreTrainedModel`` whose class supports gradient checkpointing.
        every_n_layers: Checkpoint one layer in this many (1: all of them).
        **checkpoint_options: Options of :func:`xla_wrap.checkpoint_wrapper`
            (``preserve_rng_state``, ``use_reentrant``, ``policy``, ``offload_to_cpu``).

    Raises:
        ImportError: If transformers is not installed.
        CheckpointTypeError: If ``model`` is not a ``PreTrainedModel`` or an option is unknown.
        CheckpointValueError: If the model does not support gradient checkpointing, or
            ``every_n_layers`` is not a positive integer.
    """
    api = "xla_wrap.integrations.transformers.gradient_checkpointing_enable"
    _check_model(api, model)
    if (
        isinstance(every_n_layers, bool)
        or not isinstance(every_n_layers, int)
        or every_n_layers < 1
    ):
        raise CheckpointValueError(
            f"{api}: expected a positive integer as `every_n_layers`, got {every_n_layers!r}. "
            "Pass 1 to checkpoint every layer, 2 for every other one."
        )
    options = options_from(api, checkpoint_options)
    function = functools.partial(
        checkpoint,
        preserve_rng_state=options.preserve_rng_state,
        use_reentrant=options.use_reentrant,
        policy=options.policy,
        offload_to_cpu=options.offload_to_cpu,
    )
    pretrained: Any = model  # a PreTrainedModel, checked above
    pretrained._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=function, every_n_layers=every_n_layers
    )
    config = pretrained.config
    if hasattr(config, "use_cache"):
        if not hasattr(pretrained, _SAVED_USE_CACHE):
            setattr(pretrained, _SAVED_USE_CACHE, config.use_cache)
        config.use_cache = False


def gradient_checkpointing_disable(model: nn.Module) -> None:
    """Undo :func:`gradient_checkpointing_enable`: no layer is checkpointed any more, and
    ``config.use_cache`` is what it was before.

    Raises:
        ImportError: If transformers is not installed.
        CheckpointTypeError: If ``model`` is not a ``PreTrainedModel``.
        CheckpointValueError: If the model does not support gradient checkpointing.
    """
    _check_model("xla_wrap.integrations.transformers.gradient_checkpointing_disable", model)
    pretrained: Any = model  # a PreTrainedModel, checked above
    pretrained._set_gradient_checkpointing(enable=False)
    if hasattr(pretrained, _SAVED_USE_CACHE):
        pretrained.config.use_cache = getattr(pretrained, _SAVED_USE_CACHE)
        delattr(pretrained, _SAVED_USE_CACHE)


def _check_model(api: str, model: Any) -> None:
    hf = _transformers(api)
    if not isinstance(model, hf.PreTrainedModel):
        raise CheckpointTypeError(
            f"{api}: expected a transformers PreTrainedModel, got {describe(model)}. For any "
            "other nn.Module use xla_wrap.apply_activation_checkpointing(model, policy)."
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise CheckpointValueError(
            f"{api}: expected a model that supports gradient checkpointing, got "
            f"{type(model).__name__}, whose class sets supports_gradient_checkpointing = False. "
            "Checkpoint its blocks with xla_wrap.apply_activation_checkpointing(model, "
            "xla_wrap.wrap.by_type(BlockClass)) instead."
        )
    if "value" in inspect.signature(model._set_gradient_checkpointing).parameters:
        raise CheckpointValueError(
            f"{api}: expected a model using transformers' current checkpointing hook, got "
            f"{type(model).__name__}, which overrides `_set_gradient_checkpointing(module, "
            "value)` in the format before transformers 4.35 and cannot take another checkpoint "
            "function. Checkpoint its blocks with xla_wrap.apply_activation_checkpointing("
            "model, xla_wrap.wrap.by_type(BlockClass)) instead."
        )


def _transformers(api: str) -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            f"{api}: transformers is not installed. Install xla_wrap's `hf` extra: "
            "pip install 'xla_wrap[hf]'."
        ) from error
