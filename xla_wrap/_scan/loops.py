"""Checkpointed layer stacks compiled as one layer body: [`scan_layers()`][xla_wrap.scan_layers].

A Python loop over checkpointed layers traces and compiles every layer twice (forward and
recomputation), so compile time grows with depth. torch_xla's `scan` lowers a function into
an XLA While loop, compiled once whatever the trip count. Its autograd layer traces the body
with AOTAutograd, which leaves no room for save policies, offload, keyword arguments or
Dropout (on torch_xla 2.9 a mask residual crashes the lowering), and re-traces every step.

Here torch_xla's While lowering (`_scan_impl_pytree`, through the gateway's `while_loop`) runs
twice under one autograd Function, with bodies written by hand:

* forward: each layer runs on its slice of the stacked parameters and buffers; the scan stacks
  each layer's input carry and the values the save policy keeps;
* backward, in reverse: each layer is recomputed from its saved carry (kept values substituted
  in, gradients still flowing through the recomputed operations) and differentiated with
  `torch.autograd.grad`; the scan stacks the parameter gradients.

The two loops are different While instructions, so XLA cannot merge the recomputation back
into the forward: no optimization barrier is needed. Arguments other than the carry (masks,
rotary tables, positions) ride along in the loop state unchanged instead of being copied per
layer; their gradients, if they need any, accumulate there in backward.

Random numbers: torch_xla gives each iteration its own seed, drawn after tracing the body from
the running seed. Both bodies start from the same seed, chosen per call from the device's
stream, and draw the same numbers in the same order, so the backward loop gets the forward's
per-layer seeds and Dropout recomputes exactly, while each layer and each step draws its own
masks. The stream differs from the unscanned loop's (docs/scan.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from .. import _paths
from .. import checkpoint_policies as cp
from .._core import engine as _engine
from .._core import selective as _selective
from .._core.checkpoint import run_checkpointed
from .._core.options import CheckpointOptions, make_options
from .._core.wrapper import CheckpointWrapper
from .._paths import xla as _xla
from .._support.errors import (
    CheckpointError,
    CheckpointTypeError,
    CheckpointValueError,
    describe,
    recomputation_differs,
)
from .._support.state import Recomputing, checkpointing_disabled
from .._support.tree import Flat, TensorMeta
from . import alike as _alike
from . import stacked_parameters as _stacked

_API = "xla_wrap.scan_layers"


def scan_layers(
    layers: Sequence[nn.Module],
    *args: Any,
    policy: cp.SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
    **kwargs: Any,
) -> Any:
    """Run a stack of identically built layers as one checkpointed loop.

    The loop is `for layer in layers: x = layer(x, ...)`, compiling one layer body on XLA instead
    of one per layer.

    The first positional argument is the *carry*: each layer receives it and must return a
    value of the same structure (a tensor, or a tuple or dict of tensors, of the same shapes
    and dtypes), which the next layer receives. The other arguments reach every layer
    unchanged. On XLA the stack runs as two XLA While loops, forward and backward, each
    compiled once: compile time stays flat in depth (docs/scan.md has the measurements).
    Elsewhere (eager CPU or CUDA) it is that loop, each layer checkpointed as by
    [`xla_wrap.checkpoint()`][xla_wrap.checkpoint].

    Args:
        layers: The layers, all of one class and with parameters and buffers of the same
            names, shapes and dtypes (an `nn.ModuleList` of blocks built alike).
        *args: The carry, then positional arguments every layer receives.
        policy: What each layer keeps for backward besides its input carry
            ([`xla_wrap.checkpoint_policies`][xla_wrap.checkpoint_policies], by function or
            name). `None` or `"nothing_saveable"` keeps only the carries; `"dots_saveable"`
            also keeps matrix products; `save_only_these_names(...)` keeps values tagged with
            [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name].
        offload_to_cpu: Keep the saved carries in host memory until backward (on backends
            that can place buffers there; on XLA:CPU a warning says they stay on the device).
        **kwargs: Keyword arguments every layer receives.

    Returns:
        The last layer's output; the carry itself if `layers` is empty (as the loop).

    Raises:
        CheckpointTypeError: If `layers` is not a sequence of modules, no carry is given or
            it holds no tensor, a layer returns something other than its carry's structure,
            or `policy` is neither a policy name nor callable.
        CheckpointValueError: If the layers differ in structure, carry hooks, or are XLA FSDP
            units (v1), which cannot run inside a loop body, or the save `policy` is
            unknown.
        CheckpointError: If a layer's forward reads an attribute in which the layers differ
            (layer 0's would be used for all), modifies a buffer or an argument in place, or
            runs differently when recomputed.

    Examples:
        >>> import torch, xla_wrap
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> y = xla_wrap.scan_layers(layers, torch.randn(2, 8), policy="dots_saveable")
        >>> y.sum().backward()
    """
    return run_scan(_API, layers, args, kwargs, policy=policy, offload_to_cpu=offload_to_cpu)


@_paths.branches_on_compiling
def run_scan(
    api: str,
    layers: Sequence[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    policy: cp.SavePolicy | str | None,
    offload_to_cpu: bool,
) -> Any:
    """[`scan_layers()`][xla_wrap.scan_layers], with `api` naming the caller in errors."""
    options = make_options(api, policy=policy, offload_to_cpu=offload_to_cpu)
    if not args:
        raise CheckpointTypeError(
            f"{api}: expected the carry as the first positional argument after the layers, "
            "got none. Call it as scan_layers(layers, x, ...), as the loop calls layer(x, ...)."
        )
    if isinstance(layers, (list, tuple, nn.ModuleList, nn.Sequential)) and not layers:
        return args[0]  # a loop over no layer leaves the carry as it came (torch_xla's too)
    if _paths.compiling():
        # The compiler's loop: each layer its own module as the compiler's checkpoint (no
        # template, so nothing to check the layers alike for).
        return _loop(api, list(layers), args, kwargs, options)
    stack = _LayerStack.of(layers, api)
    if stack.wrapped_options is not None and policy is None and not offload_to_cpu:
        options = stack.wrapped_options
    carry = Flat.of(args[0])
    constants = Flat.of((args[1:], kwargs))
    if not carry.tensors:
        raise CheckpointTypeError(
            f"{api}: expected a tensor (or a structure of tensors) as the carry, got "
            f"{describe(args[0])}. The first positional argument is what each layer passes on."
        )
    params = [p for layer in layers for p in layer.parameters()]
    on_xla = any(_xla.is_xla_tensor(t) for t in (*carry.tensors, *params))
    if not on_xla or checkpointing_disabled():  # the loop: its checkpoints are plain calls then
        return _loop(api, stack.layers, args, kwargs, options, stack=stack)
    return _scan(stack, carry, constants, options)


def layer_sequence(api: str, layers: object) -> tuple[nn.Module, ...]:
    """`layers` as a tuple of modules in loop order, or a CheckpointTypeError naming `api`."""
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise CheckpointTypeError(
            f"{api}: expected a sequence of layers (a list or an nn.ModuleList), got one module "
            f"{type(layers).__qualname__}. Pass the list its forward loops over."
        )
    # A mapping or a set has no order to run in; a string or a tensor is no list of layers.
    unordered = (dict, set, frozenset, str, bytes, torch.Tensor)
    if isinstance(layers, unordered) or not isinstance(layers, Iterable):
        raise CheckpointTypeError(
            f"{api}: expected a sequence of layers (a list or an nn.ModuleList), got "
            f"{describe(layers)}."
        )
    items = tuple(layers)
    for i, layer in enumerate(items):
        if not isinstance(layer, nn.Module):
            raise CheckpointTypeError(
                f"{api}: expected nn.Module layers, got {describe(layer)} at position "
                f"{i}. Pass modules; wrap a function as a module to scan it."
            )
    return items


@dataclass(frozen=True)
class _LayerStack:
    """The layers, checked to be alike: the first one runs as the template of all."""

    layers: tuple[nn.Module, ...]
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]  # the layers' own buffers, stacked per name
    shared_buffers: dict[str, torch.Tensor]  # one tensor all layers hold: passed once
    wrapped_options: CheckpointOptions | None  # the layers were checkpoint-wrapped alike
    stacked_storage: bool  # the parameters live stacked in layer 0 (stacked_parameters.py)
    differences: _alike.AttributeDifferences  # what forward must not read (alike.py)
    api: str  # the API the stack is run through, for errors

    @classmethod
    def of(cls, layers: Sequence[nn.Module], api: str = _API) -> _LayerStack:
        """The layers, checked; `api` names the caller in errors."""
        items = layer_sequence(api, layers)
        if not items:
            raise CheckpointValueError(
                f"{api}: expected at least one layer, got an empty sequence. With no layers "
                "there is nothing to scan: call the code after the loop directly."
            )
        first = items[0]
        slots = [_stacked.slot(layer) for layer in items]
        stacked_storage = slots[0] is not None
        if slots != (list(range(len(items))) if stacked_storage else [None] * len(items)):
            raise CheckpointValueError(
                f"{api}: expected the layers of a list with stacked parameters in order from "
                f"its first (the whole list, or a slice [:n]), got layers at stack positions "
                f"{slots}. Scan the list itself or a prefix of it; to add, remove or replace "
                "layers, xla_wrap.unscan the list first and stack it again afterwards."
            )
        for i, layer in enumerate(items):
            _check_runnable(api, i, layer)
            if i:
                _alike.check_structure(api, first, i, layer, parameters=not stacked_storage)
        param_names = tuple(name for name, _ in first.named_parameters())
        for i, layer in enumerate(items):
            aliases = [name for name, _ in layer.named_parameters(remove_duplicate=False)]
            if len(aliases) != len(tuple(layer.named_parameters())):
                raise CheckpointValueError(
                    f"{api}: expected each parameter of a layer under one name, got layer {i} "
                    f"holding one under several ({', '.join(aliases)}). The scanned body gives "
                    "each layer its parameters by name, and would give the second name layer "
                    "0's: untie them in the layer, or keep the Python loop."
                )
        shared: dict[str, torch.Tensor] = {}
        per_layer: list[str] = []
        for name, buffer in first.named_buffers():
            if all(layer.get_buffer(name) is buffer for layer in items):
                shared[name] = buffer
            else:
                per_layer.append(name)
        options = {
            layer.checkpoint_options if isinstance(layer, CheckpointWrapper) else None
            for layer in items
        }
        return cls(
            layers=items,
            param_names=param_names,
            buffer_names=tuple(per_layer),
            shared_buffers=shared,
            wrapped_options=options.pop() if len(options) == 1 else None,
            stacked_storage=stacked_storage,
            differences=_alike.AttributeDifferences.of(items),
            api=api,
        )

    @property
    def template(self) -> nn.Module:
        return self.layers[0]

    def loop_inputs(self) -> list[torch.Tensor]:
        """Per parameter, then per stacked buffer: the layers' tensors stacked on a new first
        dimension (the loop slices one layer's out of each per iteration). Parameters in
        stacked storage are that already."""
        params: list[torch.Tensor]
        if self.stacked_storage:
            count = len(self.layers)
            params = [self.template.get_parameter(name) for name in self.param_names]
            params = [p if p.shape[0] == count else p[:count] for p in params]
        else:
            params = [
                torch.stack([layer.get_parameter(name) for layer in self.layers])
                for name in self.param_names
            ]
        return params + [
            torch.stack([layer.get_buffer(name) for layer in self.layers])
            for name in self.buffer_names
        ]

    def layer_slices(self) -> list[list[torch.Tensor]]:
        """Per layer, its slices of the parameters in stacked storage: one `unbind` per
        parameter, so that backward sums the layers' gradients into the stack once."""
        params = [self.template.get_parameter(name).unbind(0) for name in self.param_names]
        return [[p[index] for p in params] for index in range(len(self.layers))]

    def buffers_of(self, index: int) -> list[torch.Tensor]:
        """Layer `index`'s stacked buffers, in the order of `loop_inputs()` (through
        the slots: a recomputation holds its copies there)."""
        return [_held(self.layers[index], name, "_buffers") for name in self.buffer_names]

    def call(
        self,
        carry: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: Sequence[torch.Tensor],
        *,
        index: int = 0,
    ) -> Any:
        """Run layer `index`'s module (the template, 0, for every layer on XLA) with one
        layer's parameters and buffers (`tensors`, in the order of `loop_inputs()`)."""
        names = self.param_names + self.buffer_names
        mapping = dict(zip(names, tensors, strict=True))
        mapping.update(self.shared_buffers)
        module = self.layers[index]
        with _reparametrize_module(module, mapping):
            return _own_forward(module)(carry, *args, **kwargs)

    def watching(self, index: int = 0) -> Any:
        """Where layer `index` runs (the template on XLA: its forward, and the backward
        through it): refuse reads of attributes in which the layers differ (alike.py)."""
        return self.differences.watching(self.api, self.layers[index])

    def own_forward(self, index: int) -> Any:
        """Layer `index`'s own forward, for the eager loop: refused, as the template would
        be, where it reads an attribute in which the layers differ."""
        forward = _own_forward(self.layers[index])
        if not self.differences:
            return forward

        def watched(*args: Any, **kwargs: Any) -> Any:
            with self.watching(index):
                return forward(*args, **kwargs)

        return watched


def _held(module: nn.Module, name: str, kind: str) -> torch.Tensor:
    """The tensor in the `_parameters` or `_buffers` slot that `name` names."""
    path, _, leaf = name.rpartition(".")
    tensor: torch.Tensor = getattr(module.get_submodule(path), kind)[leaf]
    return tensor


def _own_forward(layer: nn.Module) -> Any:
    """The layer's forward, without the checkpoint of a checkpoint-wrapped layer (the scan
    checkpoints it) and without module hooks (refused: a loop body cannot run them)."""
    return layer.plain_forward if isinstance(layer, CheckpointWrapper) else layer.forward


def _check_runnable(api: str, index: int, layer: nn.Module) -> None:
    """Refuse what cannot run as one traced body for every layer."""
    fsdp_v1 = _xla_fsdp_v1_class()
    for name, module in layer.named_modules():
        where = f"layer {index}" + (f" (its submodule {name!r})" if name else "")
        if fsdp_v1 is not None and isinstance(module, fsdp_v1):
            raise CheckpointValueError(
                f"{api}: {where} is an XLA FSDP (v1) unit, whose forward gathers and frees "
                "its parameters with per-module state that a loop body cannot hold. Scan the "
                "plain layers and shard them with SPMD FSDPv2 (SpmdFullyShardedDataParallel "
                "around the whole model, docs/scan.md), or keep the Python loop."
            )
        hooks = [
            kind
            for kind in (
                "_forward_pre_hooks",
                "_forward_hooks",
                "_backward_hooks",
                "_backward_pre_hooks",
            )
            if any(not _harmless(hook) for hook in getattr(module, kind, {}).values())
        ]
        if hooks:
            raise CheckpointValueError(
                f"{api}: {where} has module hooks ({', '.join(h.strip('_') for h in hooks)}); "
                "a scanned stack runs one traced body for all layers, so per-layer hooks "
                "cannot run. Remove them (or request no per-layer outputs, such as "
                "output_hidden_states), or keep the Python loop."
            )


def _harmless(hook: Any) -> bool:
    """A hook a loop body may leave out: FSDPv2's gradient barrier (it keeps XLA from fusing
    one unit's backward with the next; each iteration of the loop is apart anyway)."""
    name = getattr(hook, "__qualname__", "")
    return bool(name.endswith("apply_backward_optimization_barrier.<locals>.optimization_barrier"))


def _xla_fsdp_v1_class() -> type | None:
    if _xla.loaded("torch_xla") is None:
        return None
    try:
        return _xla.xla_fsdp_class()
    except ImportError:
        return None


def _loop(
    api: str,
    layers: Sequence[nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: CheckpointOptions,
    *,
    stack: _LayerStack | None = None,
) -> Any:
    """The loop itself, each layer checkpointed (`checkpoint_layer()`): off XLA, inside
    `torch.compile` (no `stack`: the layers are not checked alike there), and under
    `disable_checkpointing()`. In stacked storage each layer runs on its slices of the stacked
    parameters, which its checkpoint takes as inputs."""
    carry, rest = args[0], args[1:]
    slices = stack.layer_slices() if stack is not None and stack.stacked_storage else None
    for index, layer in enumerate(layers):
        given = Flat.of(carry)
        if stack is None or slices is None:
            carry = checkpoint_layer(api, layer, (carry, *rest), kwargs, options, stack, index)
        else:
            run = functools.partial(_run_on_slices, stack, index)
            inputs = (slices[index], carry, *rest)  # the slices: inputs of the checkpoint
            carry = run_checkpointed(api, run, inputs, kwargs, owners=(layer,), options=options)
        _check_carry(given, given.tensors, Flat.of(carry))  # refused as on XLA
    return carry


@_paths.branches_on_compiling
def checkpoint_layer(
    api: str,
    layer: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: CheckpointOptions,
    stack: _LayerStack | None = None,
    index: int = 0,
) -> Any:
    """One layer of a scanned stack run as the Python loop runs it: its own forward as a
    checkpoint (the compiler's, inside `torch.compile`), watched for reads of attributes in
    which the layers differ when `stack` is given (layer `index` of it)."""
    if _paths.compiling():
        if _stacked.slot(layer) is not None:
            raise CheckpointValueError(
                f"{api}: stacked parameters (stack_parameters=True) are not supported inside "
                "torch.compile yet: a layer would run on its slices through a reparametrization "
                "Dynamo cannot trace inside the checkpoint. Compile the model with per-layer "
                "parameters (xla_wrap.unscan, then ScannedLayers/apply_scan without "
                "stack_parameters), or keep stacked parameters on torch_xla's lazy tensors."
            )
        return _paths.in_layer_region(  # compiled once for every layer alike
            layer,
            args,
            kwargs,
            api,
            preserve_rng_state=options.preserve_rng_state,
            policy=options.policy,
        )
    forward = _own_forward(layer) if stack is None else stack.own_forward(index)
    return run_checkpointed(api, forward, args, kwargs, owners=(layer,), options=options)


def _run_on_slices(
    stack: _LayerStack,
    index: int,
    params: Sequence[torch.Tensor],
    carry: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Layer `index` on `params`, its slices of the stacked parameters. The layer's own
    module, not the template: what it reads later, in backward (a tensor hook), is then its
    own; its forward refuses what the template's would."""
    with stack.watching(index):
        return stack.call(carry, args, kwargs, [*params, *stack.buffers_of(index)], index=index)


@dataclass
class _Scan:
    """One scanned call: the layers, the carry's and the constants' structure, and what the
    forward loop decided (kept values, seed) for the backward loop."""

    stack: _LayerStack
    carry: Flat  # structure of the carry; its tensors are the Function's first inputs
    constants: Flat  # structure of (args, kwargs) after the carry
    options: CheckpointOptions
    device: torch.device
    seed: int  # the per-call seed both loops' bodies start from
    replay: _engine.ReplayState  # the forward's autocast settings (the seed is the scan's)
    selection: _selective.Selection | None
    kept_offload: list[bool] = field(default_factory=list)
    # Under SPMD: each carry tensor's sharding, which the stack of carries and the backward
    # loop's gradients keep (XLA would otherwise pick another one for the loop state).
    carry_specs: list[str] = field(default_factory=list)
    draws_after_body: int | None = None  # the running seed after tracing the forward body

    @property
    def counts(self) -> tuple[int, int]:
        return len(self.carry.tensors), len(self.constants.tensors)

    def run_layer(
        self,
        carry: Sequence[torch.Tensor],
        constants: Sequence[torch.Tensor],
        layer: Sequence[torch.Tensor],
    ) -> Flat:
        args, kwargs = self.constants.rebuild(constants)
        out = Flat.of(self.stack.call(self.carry.rebuild(carry), args, kwargs, layer))
        _check_carry(self.carry, carry, out)
        return out

    @contextmanager
    def body_state(self) -> Iterator[None]:
        """What both bodies trace under: the call's seed (torch_xla draws the per-iteration
        seeds from it after tracing), the forward's autocast settings, and no op that runs on
        torch_xla's CPU fallback (it would kill the process)."""
        _xla.set_rng_state(self.device, self.seed)
        with (
            self.replay.replaying(),
            torch.enable_grad(),
            _xla.refusing_cpu_fallbacks(self._cpu_fallback_refusal),
        ):
            yield

    def _cpu_fallback_refusal(self, op: str) -> CheckpointError:
        layer = type(self.stack.template).__name__
        return CheckpointError(
            f"{self.stack.api}: a layer ({layer}) of the scanned stack calls {op}, which "
            "torch_xla runs on the CPU (it has no XLA lowering), and a scanned body cannot "
            "leave the device: the process would crash. Run these layers as a loop "
            "(`xla_wrap.unscan(layers)`, or `checkpoint_wrapper` on each layer), or replace "
            "the operation (a weight_norm parametrization folds into the weight with "
            "`torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')`)."
        )


def _check_carry(spec: Flat, carry: Sequence[torch.Tensor], out: Flat) -> None:
    """Refuse a layer's output that is not its carry's structure (`spec`, `carry`)."""
    expected = [TensorMeta.of(t) for t in carry]
    got = [TensorMeta.of(t) for t in out.tensors]
    if not out.same_structure(spec) or got != expected:
        raise CheckpointTypeError(
            f"{_API}: expected each layer to return its carry's structure "
            f"({_shape_of(spec, expected)}), got {_shape_of(out, got)}. A scanned "
            "layer returns what the next layer takes as its first argument; adapt a layer "
            "that returns more (a tuple with extras) with a small wrapper module."
        )


def _shape_of(flat: Flat, metas: Sequence[TensorMeta]) -> str:
    """The structure with each tensor shown as its shape and dtype."""
    if len(metas) != len(flat.tensor_positions):
        return str(list(map(str, metas)))
    leaves = list(flat.leaves)
    for position, meta in zip(flat.tensor_positions, metas, strict=True):
        leaves[position] = str(meta)
    return str(pytree.tree_unflatten(leaves, flat.spec))


def _scan(stack: _LayerStack, carry: Flat, constants: Flat, options: CheckpointOptions) -> Any:
    device = next(
        t.device for t in (*carry.tensors, *stack.template.parameters()) if _xla.is_xla_tensor(t)
    )
    stacked = stack.loop_inputs()
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*carry.tensors, *constants.tensors, *stacked)
    )
    policy = options.policy
    selection = None
    if needs_grad and policy is not None and policy is not cp.nothing_saveable:
        selection = _selective.Selection(_API, policy)
    scan = _Scan(
        stack=stack,
        carry=carry.without_tensors(),
        constants=constants.without_tensors(),
        options=options,
        device=device,
        seed=0,
        replay=_engine.ReplayState.capture(_paths.device_path(device), (), rng=False),
        selection=selection,
    )
    with _xla.call_seed(device) as seed:
        scan.seed = seed
        if not needs_grad:
            with torch.no_grad():
                final = _forward_loop(scan, carry.tensors, constants.tensors, stacked, save=False)[
                    0
                ]
        else:
            final = _ScanFunction.apply(scan, *carry.tensors, *constants.tensors, *stacked)
    return carry.rebuild(list(final))


def _leaf(tensor: torch.Tensor, grad: bool) -> torch.Tensor:
    leaf = tensor.detach()
    return leaf.requires_grad_() if grad else leaf


def _forward_loop(
    scan: _Scan,
    carry: Sequence[torch.Tensor],
    constants: Sequence[torch.Tensor],
    stacked: Sequence[torch.Tensor],
    *,
    save: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The forward While loop: the last carry, and (with `save`) per layer its input carry
    and the values the policy kept, stacked."""
    # The carry is differentiated in any case: every layer's parameters reach the loss through
    # the carries after it.
    grads = [_floating(t) for t in carry], [_differentiable(t) for t in constants]
    layer_grads = [_differentiable(t) for t in stacked]

    dtypes = [t.dtype for t in carry], [t.dtype for t in constants], [t.dtype for t in stacked]

    def body(state: Any, layer: Any) -> Any:
        carry_in, consts = _as(state[0], dtypes[0]), _as(state[1], dtypes[1])
        layer = _as(layer, dtypes[2])
        with scan.body_state(), scan.stack.watching():
            # Differentiable exactly as in the backward body: the policy sees the same ops.
            inputs = [_leaf(t, g) for t, g in zip(carry_in, grads[0], strict=True)]
            const_inputs = [_leaf(t, g) for t, g in zip(consts, grads[1], strict=True)]
            layer_inputs = [_leaf(t, g and save) for t, g in zip(layer, layer_grads, strict=True)]
            before = _values(layer_inputs, const_inputs)
            selection = scan.selection
            if selection is None:
                out = scan.run_layer(inputs, const_inputs, layer_inputs)
                kept: list[torch.Tensor] = []
            else:
                with selection.recording():
                    out = scan.run_layer(inputs, const_inputs, layer_inputs)
                kept = selection.take_kept(out.tensors)
                scan.kept_offload = [d is cp.Decision.OFFLOAD for d in selection.decisions]
            _check_unchanged(scan.stack, before, _values(layer_inputs, const_inputs))
            scan.draws_after_body = _xla.rng_state(scan.device)
            scan.carry_specs = [
                _xla.sharding_spec(t) or _xla.sharding_spec(c)
                for t, c in zip(out.tensors, carry, strict=True)
            ]
        new_carry = [t.detach() for t in out.tensors]
        saved = (list(carry_in), [t.detach() for t in kept]) if save else ([], [])
        return (new_carry, list(consts)), saved

    (final, _), (carries, kept) = _xla.while_loop(
        body, (list(carry), list(constants)), list(stacked)
    )
    for stacked_carry, spec in zip(carries, scan.carry_specs, strict=False):
        if spec:
            _xla.shard_by_spec(stacked_carry, spec, leading=1)
    return list(final), list(carries), list(kept)


def _as(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The body's inputs in their own dtypes: torch_xla multiplies each by 1 before tracing
    the body, which turns a boolean mask into an integer one."""
    return [t if t.dtype == d else t.to(d) for t, d in zip(tensors, dtypes, strict=True)]


def _floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and _floating(tensor)


def _values(
    layer_inputs: Sequence[torch.Tensor], const_inputs: Sequence[torch.Tensor]
) -> list[str]:
    """What each leaf of the body holds, as torch_xla's IR text: an in-place write changes
    it (kernels such as batch_norm's running statistics bump no version counter)."""
    ir_text = _xla.ir_text
    return [ir_text(t) for t in (*layer_inputs, *const_inputs)]


def _check_unchanged(stack: _LayerStack, before: Sequence[str], after: Sequence[str]) -> None:
    names = stack.param_names + stack.buffer_names
    changed = [name for name, a, b in zip(names, before, after, strict=False) if a != b]
    if changed:
        raise CheckpointError(
            f"{_API}: the layer modified {', '.join(map(repr, changed))} in place; a scanned "
            "layer must only read its parameters and buffers (one body runs for all layers). "
            "Keep layers that update state (BatchNorm statistics) in a Python loop."
        )
    if before[len(names) :] != after[len(names) :]:
        raise CheckpointError(
            f"{_API}: a layer modified one of its arguments in place; each layer must only "
            "read the arguments after the carry, which all layers share."
        )


class _ScanFunction(torch.autograd.Function):
    """`apply(scan, *carry, *constants, *stacked)` -> the last carry's tensors."""

    @staticmethod
    def forward(ctx: Any, scan: _Scan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        carry, constants, stacked = _split(tensors, *scan.counts)
        final, carries, kept = _forward_loop(scan, carry, constants, stacked, save=True)
        offload = [scan.options.offload_to_cpu] * len(carries) + scan.kept_offload
        residuals, devices = _engine.to_host([*carries, *kept], offload)
        ctx.scan = scan
        ctx.devices = devices
        ctx.lengths = (len(constants), len(stacked), len(carries))
        ctx.wanted = [_differentiable(t) for t in tensors]
        ctx.save_for_backward(*constants, *stacked, *residuals)
        return tuple(final)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise CheckpointError(
                f"{_API}: double backward (`create_graph=True`, as in gradient penalties or "
                "Hessian-vector products) through a scanned stack is not supported: its "
                "backward is one XLA While loop, whose gradients have no graph of their own. "
                "Loop over the layers in Python instead, each wrapped with "
                "`xla_wrap.checkpoint_wrapper` (an ordinary nn.ModuleList), which supports it."
            )
        scan: _Scan = ctx.scan
        n_const, n_stacked, n_carries = ctx.lengths
        constants, stacked, residuals = _split(ctx.saved_tensors, n_const, n_stacked)
        carries, kept = _split(_engine.to_device(residuals, ctx.devices), n_carries)
        with _xla.keep_stream(scan.device):
            wanted = _split(ctx.wanted, *scan.counts)
            gradients = _backward_loop(scan, grads, constants, stacked, carries, kept, wanted)
        return (None, *gradients)


def _split(seq: Sequence[Any], *lengths: int) -> list[list[Any]]:
    """`seq` cut into pieces of `lengths`, and the rest."""
    pieces, start = [], 0
    for length in lengths:
        pieces.append(list(seq[start : start + length]))
        start += length
    return [*pieces, list(seq[start:])]


def _backward_loop(
    scan: _Scan,
    grads: Sequence[torch.Tensor],
    constants: Sequence[torch.Tensor],
    stacked: Sequence[torch.Tensor],
    carries: Sequence[torch.Tensor],
    kept: Sequence[torch.Tensor],
    wanted: Sequence[Sequence[bool]],
) -> list[torch.Tensor | None]:
    """The backward While loop, last layer first: recompute each layer from its input carry
    and differentiate it. The constants' gradients accumulate in the loop state. Returns the
    gradients of the Function's inputs (None where unwanted).

    The stacked parameters that need gradients ride in the loop state instead of being sliced
    by the scan: each iteration reads its layer's slice and then overwrites it with that
    layer's gradient, so the gradients take the stacked copy's memory instead of a second
    stack of the same size (XLA updates a loop-state slice in place)."""
    want_carry, want_const, want_layer = wanted
    carry_grad = [_floating(t) for t in carries]  # the chain of carries, wanted or not
    read_only = [t for t, w in zip(stacked, want_layer, strict=True) if not w]
    take, overwrite = _xla.layer_slice_ops()

    dtypes = [t.dtype for t in constants], [t.dtype for t in stacked], [t.dtype for t in carries]

    def body(state: Any, layer: Any) -> Any:
        grad_out, consts, acc, grad_stacks, index = state
        fixed, carry_in, kept_here = layer
        slices, fixed_it = iter([take(s, index) for s in grad_stacks]), iter(fixed)
        params = [next(slices) if w else next(fixed_it) for w in want_layer]
        consts, params = _as(consts, dtypes[0]), _as(params, dtypes[1])
        carry_in = _as(carry_in, dtypes[2])
        # Watched through autograd.grad too: hooks and Functions may read the layer there.
        with scan.body_state(), Recomputing(), scan.stack.watching():
            inputs = [_leaf(t, g) for t, g in zip(carry_in, carry_grad, strict=True)]
            const_inputs = [_leaf(t, g) for t, g in zip(consts, want_const, strict=True)]
            layer_inputs = [_leaf(t, g) for t, g in zip(params, want_layer, strict=True)]
            with ExitStack() as stack:
                if scan.selection is not None:
                    stack.enter_context(scan.selection.substituting(kept_here, connected=True))
                out = scan.run_layer(inputs, const_inputs, layer_inputs)
            if _xla.rng_state(scan.device) != scan.draws_after_body:
                raise recomputation_differs(_API, "drew a different number of random values")
            pairs = [(t, g) for t, g in zip(out.tensors, grad_out, strict=True) if t.requires_grad]
            wrt = [t for t in (*inputs, *const_inputs, *layer_inputs) if t.requires_grad]
            computed: Sequence[torch.Tensor | None] = [None] * len(wrt)
            if pairs and wrt:
                outputs, output_grads = zip(*pairs, strict=True)
                computed = torch.autograd.grad(outputs, wrt, output_grads, allow_unused=True)
        it = iter(
            torch.zeros_like(t) if g is None else g for t, g in zip(wrt, computed, strict=True)
        )
        grad_in = [
            next(it) if g else torch.zeros_like(t)
            for t, g in zip(carry_in, carry_grad, strict=True)
        ]
        grad_consts = [next(it) for g in want_const if g]
        grad_layer = [next(it) for g in want_layer if g]
        acc = [a + g for a, g in zip(acc, grad_consts, strict=True)]
        grad_stacks = [overwrite(s, g, index) for s, g in zip(grad_stacks, grad_layer, strict=True)]
        return (grad_in, list(consts), acc, grad_stacks, index - 1), []

    for grad, spec in zip(grads, scan.carry_specs, strict=False):
        if spec and not _xla.sharding_spec(grad):
            _xla.shard_by_spec(grad, spec)
    accumulators = [torch.zeros_like(c) for c, g in zip(constants, want_const, strict=True) if g]
    grad_stacks = [t for t, w in zip(stacked, want_layer, strict=True) if w]
    last = torch.tensor(len(carries[0]) - 1, dtype=torch.int64, device=scan.device)
    (grad_init, _, acc, grad_layers, _), _ = _xla.while_loop(
        body,
        (list(grads), list(constants), accumulators, grad_stacks, last),
        (read_only, list(carries), list(kept)),
        reverse=True,
    )
    acc_it, layer_it = iter(acc), iter(grad_layers)
    return [
        *(g if w else None for g, w in zip(grad_init, want_carry, strict=True)),
        *(next(acc_it) if w else None for w in want_const),
        *(next(layer_it) if w else None for w in want_layer),
    ]
