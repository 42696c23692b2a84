"""Stacked parameter storage for a scanned layer list: one parameter per name, the layers
on its first dimension (`xla_wrap.ScannedLayers(..., stack_parameters=True)`).

A scan over per-layer parameters stacks them into the loop at every step and hands each
layer its gradient as a slice out of the loop's stacked gradient: a copy of the weights in
memory, and program inputs, outputs and small XLA kernels that grow with depth (compile time
with them). With the parameters stored stacked, the loop reads them as they are and their
gradients come out as they are: nothing per layer is left in the compiled program.

The stacked parameters live where layer 0 keeps its own, under its names (so optimizers,
weight-decay rules by module type and FSDPv2 see ordinary modules); the other layers keep
their structure, settings and buffers but no parameters. `state_dict` and
`load_state_dict` still speak per layer (`layers.3.mlp.weight`), so checkpoints move
between stacked, per-layer and unscanned models unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._layouts import WRAPPED_CHILDREN
from .._paths import xla as _xla
from .._support.errors import CheckpointError, CheckpointValueError

# In a layer's __dict__: its index on the stacked parameters' first dimension.
_SLOT = "_xla_wrap_stack_slot"
# In the list's __dict__, while its parameters are stacked: how many layers they hold.
_STACKED = "_xla_wrap_parameters_stacked"


def slot(layer: nn.Module) -> int | None:
    """The layer's index in stacked storage (looking through wrappers such as FSDPv2
    units), or None for a layer with parameters of its own."""
    module: nn.Module | None = layer
    while module is not None:
        if _SLOT in module.__dict__:
            index: int = module.__dict__[_SLOT]
            return index
        module = next((module._modules[c] for c in WRAPPED_CHILDREN if c in module._modules), None)
    return None


def is_stacked(layers: nn.Module) -> bool:
    return _STACKED in layers.__dict__


def check_stackable(api: str, layers: Sequence[nn.Module], param_names: Sequence[str]) -> None:
    """Refuse layers whose parameters stacking would untie or unshard. The layers were
    checked to be alike (same names, shapes, dtypes and `requires_grad`, each parameter
    under one name)."""
    owners: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for name in param_names:
            param = layer.get_parameter(name)
            first = owners.setdefault(id(param), i)
            if first != i:
                raise CheckpointValueError(
                    f"{api}: expected each layer to own its parameters, got {name!r} of layer "
                    f"{i} shared with layer {first}. Stacked storage keeps one slice per "
                    "layer and would untie them: pass stack_parameters=False."
                )
            if _xla.sharding_spec(param):
                raise CheckpointValueError(
                    f"{api}: expected unsharded parameters, got {name!r} of layer {i} sharded "
                    "already (FSDPv2 wraps the model before stacking?). Stacking would replace "
                    "it unsharded: stack the parameters first, then wrap the model with FSDPv2."
                )


def stack(api: str, layers: nn.ModuleList, param_names: Sequence[str]) -> None:
    """Move every layer's parameters into layer 0, stacked per name, in place (for a moment
    the weights exist twice: the layers' and the stack)."""
    items = list(layers._modules.values())
    check_stackable(api, items, param_names)
    for name in param_names:
        path, _, leaf = name.rpartition(".")
        tensors = [layer.get_parameter(name) for layer in items]
        with torch.no_grad():
            stacked = nn.Parameter(
                torch.stack([t.detach() for t in tensors]), requires_grad=tensors[0].requires_grad
            )
        for layer in items:
            del layer.get_submodule(path)._parameters[leaf]
        items[0].get_submodule(path).register_parameter(leaf, stacked)
    for i, layer in enumerate(items):
        layer.__dict__[_SLOT] = i
    layers.__dict__[_STACKED] = len(items)
    register_hooks(layers)


def register_hooks(layers: nn.Module) -> None:
    """Give a list with stacked parameters the hooks that show them per layer in `state_dict`
    and stack a per-layer state when loaded. A pickle leaves them out (they are private
    functions, which a pickle would name), and unpickling calls this again (once: a pickle made
    before 0.1.0 holds them)."""
    if not any(h is _per_layer_state for h in layers._state_dict_hooks.values()):
        layers.register_state_dict_post_hook(_per_layer_state)
    pre_hooks = layers._load_state_dict_pre_hooks.values()
    if not any(getattr(h, "hook", h) is _stack_loaded_state for h in pre_hooks):
        layers.register_load_state_dict_pre_hook(_stack_loaded_state)


def state_without_hooks(layers: nn.Module) -> dict[str, Any]:
    """`layers.__dict__` for a pickle: the hooks of `register_hooks` left out."""
    state = dict(layers.__dict__)
    if _STACKED in state:
        state["_state_dict_hooks"] = type(layers._state_dict_hooks)(
            (k, h) for k, h in layers._state_dict_hooks.items() if h is not _per_layer_state
        )
        state["_load_state_dict_pre_hooks"] = type(layers._load_state_dict_pre_hooks)(
            (k, h)
            for k, h in layers._load_state_dict_pre_hooks.items()
            if getattr(h, "hook", h) is not _stack_loaded_state
        )
    return state


def check_unchanged(api: str, layers: nn.Module) -> None:
    """Refuse a list with stacked parameters whose layers were since replaced, added or
    removed: its stack no longer says which parameters belong to which layer."""
    slots = [slot(layer) for layer in layers._modules.values() if layer is not None]
    if slots != list(range(layers.__dict__[_STACKED])):
        raise CheckpointError(
            f"{api}: expected the layers a list with stacked parameters was built with, in "
            f"order, got layers at stack positions {slots} (a layer replaced, added or "
            "removed). Edit such a list only after xla_wrap.unscan(layers), then stack again."
        )


def unstack(layers: nn.ModuleList) -> None:
    """Undo `stack()` in place: each layer its own parameters again (new tensors, so an
    optimizer built before must be built again)."""
    check_unchanged("xla_wrap.unscan", layers)
    items = list(layers._modules.values())
    template = items[0]
    for name, stacked in list(template.named_parameters()):
        path, _, leaf = name.rpartition(".")
        del template.get_submodule(path)._parameters[leaf]
        for i, layer in enumerate(items):
            piece = nn.Parameter(stacked.detach()[i].clone(), requires_grad=stacked.requires_grad)
            layer.get_submodule(path).register_parameter(leaf, piece)
    for layer in items:
        for module in layer.modules():
            module.__dict__.pop(_SLOT, None)
    # By identity, not by handle: a deep copy's handles would remove the original's hooks.
    hooks: dict[int, Any] = layers._state_dict_hooks
    for key in [k for k, hook in hooks.items() if hook is _per_layer_state]:
        del hooks[key]
    pre_hooks: dict[int, Any] = layers._load_state_dict_pre_hooks
    for key in [k for k, h in pre_hooks.items() if getattr(h, "hook", h) is _stack_loaded_state]:
        del pre_hooks[key]
    del layers.__dict__[_STACKED]


def _stacked_names(layers: nn.Module) -> list[str]:
    template: nn.Module = layers._modules["0"]  # type: ignore[assignment]
    return [name for name, _ in template.named_parameters()]


def _per_layer_state(
    layers: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict post-hook: each stacked `0.<name>` entry becomes one `<i>.<name>` per
    layer, in the order an unscanned list has them. With `keep_vars` (the entry is the
    parameter itself) they are views of it; otherwise copies, since savers such as
    safetensors refuse tensors that share memory."""
    check_unchanged(f"{type(layers).__name__}.state_dict", layers)
    count = len(layers._modules)
    names = set(_stacked_names(layers))
    first = f"{prefix}0."
    layer_keys = [k[len(first) :] for k in state_dict if k.startswith(first)]  # layer 0's order
    entries = dict(state_dict)
    state_dict.clear()
    placed = False
    for key, value in entries.items():
        index = key[len(prefix) :].partition(".")[0]
        if not (key.startswith(prefix) and index.isdigit() and int(index) < count):
            state_dict[key] = value
        elif not placed:  # all layers' entries go where the first one was
            placed = True
            for i in range(count):
                for name in layer_keys:
                    own = f"{prefix}{i}.{name}"
                    if name in names:
                        whole = entries[first + name]
                        state_dict[own] = (
                            whole[i] if isinstance(whole, nn.Parameter) else whole[i].clone()
                        )
                    elif own in entries:
                        state_dict[own] = entries[own]


def _stack_loaded_state(
    layers: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """load_state_dict pre-hook: per-layer entries of each stacked parameter become the one
    stacked entry layer 0 loads (an entry already stacked loads as it is). A layer's entry
    missing is reported missing; its slice keeps the current values."""
    check_unchanged(f"{type(layers).__name__}.load_state_dict", layers)
    count = len(layers._modules)
    for name in _stacked_names(layers):
        param = layers.get_parameter(f"0.{name}")
        keys = [f"{prefix}{i}.{name}" for i in range(count)]
        present = [state_dict[k] for k in keys if k in state_dict]
        if not present or (keys[0] in state_dict and state_dict[keys[0]].shape == param.shape):
            continue
        like = present[0]
        pieces = []
        for i, key in enumerate(keys):
            if key in state_dict:
                pieces.append(state_dict.pop(key))
            else:
                missing_keys.append(key)
                pieces.append(param.detach()[i].to(device=like.device, dtype=like.dtype))
        state_dict[keys[0]] = torch.stack(pieces)


def per_layer_gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient under its `state_dict` name: one entry per layer (a slice
    of the stacked gradient) for a list with stacked parameters, as an unscanned model has."""
    stacked_keys: dict[str, tuple[nn.Parameter, int]] = {}
    for prefix, module in model.named_modules():
        if is_stacked(module):
            lead = f"{prefix}." if prefix else ""
            for name in _stacked_names(module):
                param = module.get_parameter(f"0.{name}")
                for i in range(len(module._modules)):
                    stacked_keys[f"{lead}{i}.{name}"] = (param, i)
    grads: dict[str, torch.Tensor | None] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in stacked_keys:
            param, i = stacked_keys[key]
            grads[key] = None if param.grad is None else param.grad[i]
        elif isinstance(value, nn.Parameter):
            grads[key] = value.grad
    return grads
