"""Hugging Face transformers: checkpoint a model's layers with xla_wrap, through transformers'
own switch.

transformers' `model.gradient_checkpointing_enable()` and
`TrainingArguments(gradient_checkpointing=True)` checkpoint with `torch.utils.checkpoint`,
which fails on XLA (`module 'torch' has no attribute 'xla'`) and would save no memory there
anyway. transformers lets a model take another checkpoint function. Two ways in:
[`install()`][xla_wrap.integrations.transformers.install] makes the flag (the `Trainer`'s
included) use xla_wrap on XLA, and
[`gradient_checkpointing_enable()`][xla_wrap.integrations.transformers.gradient_checkpointing_enable]
checkpoints one model.

Either way [`xla_wrap.checkpoint()`][xla_wrap.checkpoint] finds each layer's parameters from
the `functools.partial` of the layer's `forward` that transformers passes.

Needs transformers (`pip install 'xla_wrap[hf]'`).

Examples:
    >>> from xla_wrap.integrations import transformers as xla_hf
    >>> xla_hf.install()  # doctest: +SKIP
    >>> xla_hf.gradient_checkpointing_enable(model, every_n_layers=2)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .._core.checkpoint import checkpoint, owning_modules, unpartial
from .._core.options import options_from
from .._core.wrapper import CheckpointWrapper, unwrap
from .._paths import xla as _xla
from .._plan.checkpoint_plan import CheckpointPlan
from .._scan.module_list import ScannedLayers, apply_scan, unscan
from .._support.checks import check_flag, is_int
from .._support.errors import CheckpointTypeError, CheckpointValueError, describe
from .._support.tree import Flat

__all__ = [
    "gradient_checkpointing_disable",
    "gradient_checkpointing_enable",
    "install",
    "installed",
    "uninstall",
]

# The model's config.use_cache while checkpointing is on, restored when it is switched off.
_SAVED_USE_CACHE = "_xla_wrap_saved_use_cache"


def gradient_checkpointing_enable(
    model: nn.Module,
    *,
    every_n_layers: int = 1,
    scan: bool = False,
    stack_parameters: bool = False,
    plan: CheckpointPlan | None = None,
    **checkpoint_options: Any,
) -> None:
    """Checkpoint the layers of a transformers `PreTrainedModel` with xla_wrap.

    Every `every_n_layers`-th layer (the first, then every n-th) is checkpointed; the others
    keep their activations. `config.use_cache` is set to False, as transformers users are
    told to when checkpointing (a key/value cache cannot be recomputed, and filling one while
    training changes the attention's numerics);
    [`gradient_checkpointing_disable()`][xla_wrap.integrations.transformers.gradient_checkpointing_disable]
    restores it.

    Args:
        model: A transformers `PreTrainedModel` whose class supports gradient checkpointing.
        every_n_layers: Checkpoint one layer in this many (1: all of them).
        scan: Run each list of layers as one scanned stack
            ([`xla_wrap.ScannedLayers`][xla_wrap.ScannedLayers]): one compiled layer body on
            XLA instead of one per layer. Only models whose forward passes each layer's result
            to the next and nothing else qualify (docs/scan.md lists them); every layer is
            checkpointed, and only `policy` and `offload_to_cpu` apply.
        stack_parameters: With `scan`, store each scanned list's parameters stacked
            ([`xla_wrap.ScannedLayers`][xla_wrap.ScannedLayers]): compile time flat in depth.
            The model's parameters change (`state_dict` does not): build the optimizer after
            this.
        plan: A [`xla_wrap.CheckpointPlan`][xla_wrap.CheckpointPlan] for this model
            ([`xla_wrap.plan_checkpointing()`][xla_wrap.plan_checkpointing]): each layer is
            checkpointed as the plan chose, and `every_n_layers` is the special case of a plan
            that fully recomputes every n-th layer. Takes no other option.
        **checkpoint_options: Options of
            [`xla_wrap.checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper]
            (`preserve_rng_state`, `use_reentrant`, `policy`, `offload_to_cpu`).

    Raises:
        ImportError: If transformers is not installed.
        CheckpointTypeError: If `model` is not a `PreTrainedModel`, `plan` is not a
            `CheckpointPlan`, `every_n_layers` is not an int, `scan` or `stack_parameters`
            not a bool, or an option is unknown or has the wrong type.
        CheckpointValueError: If the model does not support gradient checkpointing (or
            overrides transformers' pre-4.35 `_set_gradient_checkpointing`),
            `every_n_layers` is below 1, `stack_parameters` is given without
            `scan`, `scan` is given with `every_n_layers` or options other than `policy` and
            `offload_to_cpu`, `plan` comes with other options,
            or the save `policy` is unknown.
    """
    api = "xla_wrap.integrations.transformers.gradient_checkpointing_enable"
    _check_model(api, model)
    if not is_int(every_n_layers):
        raise CheckpointTypeError(
            f"{api}: expected a positive integer as `every_n_layers`, got "
            f"{describe(every_n_layers)}. Pass 1 to checkpoint every layer, 2 for every other one."
        )
    if every_n_layers < 1:
        raise CheckpointValueError(
            f"{api}: expected a positive integer as `every_n_layers`, got {every_n_layers!r}. "
            "Pass 1 to checkpoint every layer, 2 for every other one."
        )
    options = options_from(api, checkpoint_options)
    check_flag(api, "scan", scan)
    check_flag(api, "stack_parameters", stack_parameters)
    if stack_parameters and not scan:
        raise CheckpointValueError(
            f"{api}: stack_parameters=True stores a scanned stack's parameters; got it "
            "without scan=True. Pass scan=True too, or drop stack_parameters."
        )
    pretrained: Any = model  # a PreTrainedModel, checked above
    if plan is not None:
        if not isinstance(plan, CheckpointPlan):
            raise CheckpointTypeError(
                f"{api}: expected a CheckpointPlan (what xla_wrap.plan_checkpointing returns) "
                f"as `plan`, got {describe(plan)}."
            )
        if every_n_layers != 1 or scan or checkpoint_options:
            raise CheckpointValueError(
                f"{api}: expected a CheckpointPlan as `plan` and nothing else (the plan chooses "
                f"every layer's checkpoint), got plan={describe(plan)}, every_n_layers="
                f"{every_n_layers}, scan={scan} and options {sorted(checkpoint_options)}. Pass "
                "the plan alone."
            )
        plan.apply(pretrained)
    elif scan:
        _scan_layers(api, pretrained, every_n_layers, checkpoint_options, stack_parameters)
    else:
        function = functools.partial(checkpoint, **options.as_keywords())
        pretrained._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=function, every_n_layers=every_n_layers
        )
    config = pretrained.config
    if hasattr(config, "use_cache"):
        if not hasattr(pretrained, _SAVED_USE_CACHE):
            setattr(pretrained, _SAVED_USE_CACHE, config.use_cache)
        config.use_cache = False


def gradient_checkpointing_disable(model: nn.Module) -> None:
    """Undo `gradient_checkpointing_enable()`.

    No layer is checkpointed any more, and `config.use_cache` is what it was before
    [`gradient_checkpointing_enable()`][xla_wrap.integrations.transformers.gradient_checkpointing_enable].

    Scanned layer lists become plain `nn.ModuleList`s again (stacked parameters become
    per-layer ones: build the optimizer again), and the layers a plan checkpointed are
    unwrapped.

    Args:
        model: The transformers `PreTrainedModel` whose checkpointing to switch off.

    Raises:
        ImportError: If transformers is not installed.
        CheckpointTypeError: If `model` is not a `PreTrainedModel`.
        CheckpointValueError: If the model does not support gradient checkpointing.
    """
    _check_model("xla_wrap.integrations.transformers.gradient_checkpointing_disable", model)
    pretrained: Any = model  # a PreTrainedModel, checked above
    pretrained._set_gradient_checkpointing(enable=False)
    for module in pretrained.modules():
        if isinstance(module, ScannedLayers):
            unscan(module)
        elif isinstance(module, CheckpointWrapper):  # a plan's layers
            unwrap(module)
    if hasattr(pretrained, _SAVED_USE_CACHE):
        pretrained.config.use_cache = getattr(pretrained, _SAVED_USE_CACHE)
        delattr(pretrained, _SAVED_USE_CACHE)


def _scan_layers(
    api: str, model: Any, every_n_layers: int, options: dict[str, Any], stack_parameters: bool
) -> None:
    """Scan every list of transformers' checkpointable layers in `model`."""
    other = sorted(set(options) - {"policy", "offload_to_cpu"})
    if every_n_layers != 1 or other:
        raise CheckpointValueError(
            f"{api}: scan=True checkpoints every layer of a scanned stack with `policy` and "
            f"`offload_to_cpu` only; got every_n_layers={every_n_layers}"
            + (f" and {', '.join(other)}" if other else "")
            + ". Drop them, or checkpoint without scan=True."
        )
    layer_class = importlib.import_module("transformers.modeling_layers").GradientCheckpointingLayer
    apply_scan(
        model,
        lambda layer: isinstance(layer, layer_class),
        stack_parameters=stack_parameters,
        **options,
    )


# --- transformers' own switch ---------------------------------------------------------------

# install()'s state, kept on transformers' module itself (a reloaded xla_wrap finds it there):
# what it replaced (transformers' checkpoint function, and its method that builds the
# checkpoint function for `offload=True`, transformers 5.24 and later) and `everywhere`.
_ORIGINALS = "_xla_wrap_originals"
# Options only xla_wrap's checkpoint takes: asked for by name, xla_wrap runs on any device.
_XLA_WRAP_ONLY = frozenset({"policy", "offload_to_cpu"})


def install(*, everywhere: bool = False) -> None:
    """Make transformers' own checkpointing switch checkpoint with xla_wrap on XLA.

    Afterwards `TrainingArguments(gradient_checkpointing=True)` (or
    `activation_checkpointing=True`), `model.gradient_checkpointing_enable()` and
    `model.activation_checkpointing_enable()` checkpoint each layer that runs on an XLA
    device with [`xla_wrap.checkpoint()`][xla_wrap.checkpoint]. Layers on other devices keep
    `torch.utils.checkpoint`, unless `everywhere` is True or the checkpoint keyword
    arguments name an option only xla_wrap has (`policy`, `offload_to_cpu`). The device is
    looked at in every call, so enabling checkpointing before moving the model works too.

    The keyword arguments (`gradient_checkpointing_kwargs`) go to the checkpoint that runs;
    xla_wrap takes `use_reentrant`, `preserve_rng_state`, `policy` and
    `offload_to_cpu`, and transformers' `offload=True` becomes `offload_to_cpu=True`.
    Calling it again only updates `everywhere` (for every model, process-wide).

    Args:
        everywhere: Checkpoint with xla_wrap on every device, not only on XLA.

    Raises:
        ImportError: If transformers is not installed.
        CheckpointTypeError: If `everywhere` is not a bool.
    """
    api = "xla_wrap.integrations.transformers.install"
    check_flag(api, "everywhere", everywhere)
    modeling = _modeling_utils(api)
    if _ORIGINALS not in vars(modeling):
        originals = {"checkpoint": modeling.checkpoint}
        builder = modeling.PreTrainedModel.__dict__.get("_activation_checkpointing_enable")
        if builder is not None:
            originals["_activation_checkpointing_enable"] = builder
        setattr(modeling, _ORIGINALS, originals)
    _originals()["everywhere"] = everywhere
    # Always this module's functions, also over an earlier import's.
    modeling.checkpoint = _checkpoint_layer
    if "_activation_checkpointing_enable" in _originals():
        modeling.PreTrainedModel._activation_checkpointing_enable = _offload_as_an_option


def uninstall() -> None:
    """Undo [`install()`][xla_wrap.integrations.transformers.install].

    transformers checkpoints with `torch.utils.checkpoint` again from the next time a model's
    checkpointing is enabled (models enabled before keep xla_wrap's until then). Does nothing if
    not installed."""
    if not installed():
        return
    modeling = _modeling_utils("xla_wrap.integrations.transformers.uninstall")
    originals = vars(modeling).pop(_ORIGINALS)
    modeling.checkpoint = originals["checkpoint"]
    if "_activation_checkpointing_enable" in originals:
        builder = originals["_activation_checkpointing_enable"]
        modeling.PreTrainedModel._activation_checkpointing_enable = builder


def installed() -> bool:
    """Whether [`install()`][xla_wrap.integrations.transformers.install] is in effect.

    Returns:
        `True` between [`install()`][xla_wrap.integrations.transformers.install] and
        [`uninstall()`][xla_wrap.integrations.transformers.uninstall]; `False` otherwise,
        also when transformers is not imported.
    """
    return bool(_originals())


def _originals() -> dict[str, Any]:
    """install()'s state; empty when not installed (transformers not imported included)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    originals: dict[str, Any] = vars(modeling).get(_ORIGINALS, {}) if modeling else {}
    return originals


def _offload_as_an_option(
    model: Any,
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
    every_n_layers: int = 1,
    offload: bool = False,
) -> None:
    # For offload=True transformers wraps its checkpoint in a pinned-memory `save_on_cpu`, which
    # cannot hold XLA tensors; the checkpoint takes it as an option instead and decides per
    # device. transformers' default keyword arguments, when none are given, kept.
    if offload:
        given = activation_checkpointing_kwargs or {"use_reentrant": False}
        activation_checkpointing_kwargs = {**given, "offload": True}
    _originals()["_activation_checkpointing_enable"](
        model, activation_checkpointing_kwargs, every_n_layers, False
    )


def _checkpoint_layer(function: Callable[..., Any], *args: Any, **options: Any) -> Any:
    """The checkpoint function transformers calls per layer once `install()` ran: `function`
    is `partial(Layer.forward, layer, **kwargs)`, `args` the layer's positional tensors,
    `options` the checkpoint keyword arguments."""
    offload = bool(options.pop("offload", False))
    everywhere = _originals().get("everywhere", False)
    if everywhere or not _XLA_WRAP_ONLY.isdisjoint(options) or _runs_on_xla(function, args):
        api = "xla_wrap.integrations.transformers (installed), per layer"
        if "context_fn" in options:
            raise CheckpointValueError(
                f"{api}: expected checkpoint options xla_wrap takes, got `context_fn` (PyTorch's "
                "selective checkpointing, which TRL's `selective=True` sets). Choose what to "
                "keep with an xla_wrap save policy instead: "
                "`gradient_checkpointing_kwargs={'policy': 'dots_saveable'}`."
            )
        if offload:
            options["offload_to_cpu"] = True
        return checkpoint(function, *args, **options_from(api, options).as_keywords())
    torch_checkpoint = _originals().get("checkpoint", torch.utils.checkpoint.checkpoint)
    if not offload:
        return torch_checkpoint(function, *args, **options)
    # transformers' own offload: pinned host memory where there is a device to pin for.
    devices = [t.device.type for t in _tensors(function, args)]
    device_type = next((d for d in devices if d != "cpu"), "cpu")
    with torch.autograd.graph.save_on_cpu(pin_memory=device_type != "cpu", device_type=device_type):
        return torch_checkpoint(function, *args, **options)


def _runs_on_xla(function: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    return any(_xla.is_xla_tensor(t) for t in _tensors(function, args))


def _tensors(function: Callable[..., Any], args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The layer's tensor arguments (those bound in the partial included) and its first
    parameter: enough to tell the device it runs on."""
    _, all_args, kwargs = unpartial(function, args, {})
    tensors = list(Flat.of((all_args, kwargs)).tensors)
    for module in owning_modules(function, args):
        first = next(module.parameters(), None)
        if first is not None:
            tensors.append(first)
    return tensors


def _modeling_utils(api: str) -> Any:
    _transformers(api)
    return importlib.import_module("transformers.modeling_utils")


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
            "xla_wrap.wrap_policies.by_type(BlockClass)) instead."
        )
    if "value" in inspect.signature(model._set_gradient_checkpointing).parameters:
        raise CheckpointValueError(
            f"{api}: expected a model using transformers' current checkpointing hook, got "
            f"{type(model).__name__}, which overrides `_set_gradient_checkpointing(module, "
            "value)` in the format before transformers 4.35 and cannot take another checkpoint "
            "function. Checkpoint its blocks with xla_wrap.apply_activation_checkpointing("
            "model, xla_wrap.wrap_policies.by_type(BlockClass)) instead."
        )


def _transformers(api: str) -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            f"{api}: transformers is not installed. Install xla_wrap's `hf` extra: "
            "pip install 'xla_wrap[hf]'."
        ) from error
