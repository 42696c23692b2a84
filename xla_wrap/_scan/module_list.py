"""A way in for models that loop over a `ModuleList`: [`ScannedLayers`][xla_wrap.ScannedLayers]
and [`apply_scan()`][xla_wrap.apply_scan].

A model's forward usually runs its blocks as `for layer in self.layers: x = layer(x, ...)`.
A scanned list keeps its layers, names and `state_dict` as they are, but iterating over it
yields stand-ins: the first one, called, runs the whole stack through
[`scan_layers()`][xla_wrap.scan_layers];
each later one checks that it receives the previous result and the same other arguments, and
hands the result on. A loop body that does anything else between layers gets an error at the
second layer instead of a wrong result; a loop that stops early cannot be told apart, so only
loops over the whole list (or a slice of it) qualify (docs/scan.md lists the models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from torch import nn

from .. import _paths
from .. import checkpoint_policies as cp
from .._core.options import make_options
from .._support.checks import check_flag, check_module, is_function
from .._support.errors import CheckpointError, CheckpointTypeError, CheckpointValueError, describe
from . import stacked_parameters as _stacked
from .loops import _LayerStack, checkpoint_layer, layer_sequence, run_scan

M = TypeVar("M", bound=nn.Module)
_OPTIONS = "_xla_wrap_scan_options"


class ScannedLayers(nn.ModuleList):
    """An `nn.ModuleList` whose loop runs its layers as one scanned, checkpointed stack.

    The stack runs through [`xla_wrap.scan_layers()`][xla_wrap.scan_layers]. Indexing and `len`
    see the layers themselves; a slice (`layers[:n]`) is scanned too.

    Only a loop `for layer in layers: x = layer(x, ...)` that calls every layer in order,
    each with the previous result and the same other arguments, qualifies; any other use of
    the layers it yields raises `CheckpointError` at the second layer.

    Args:
        modules: The layers, all built alike; `None` (the default) for an empty list.
        policy: The save policy each layer checkpoints with (as in
            [`scan_layers()`][xla_wrap.scan_layers]).
        offload_to_cpu: Keep the saved carries in host memory (as in
            [`scan_layers()`][xla_wrap.scan_layers]).
        stack_parameters: Store the layers' parameters stacked, one parameter per name with
            the layers on its first dimension, held where layer 0 holds its own: the scan
            then neither copies the weights nor compiles anything per layer (compile time
            flat in depth). `state_dict` still has one entry per layer; build optimizers
            after this. See docs/scan.md.

    Raises:
        CheckpointTypeError: If `modules` is not a sequence of modules, `offload_to_cpu` or
            `stack_parameters` is not a bool, or `policy` is not a policy.
        CheckpointValueError: If the save `policy` is unknown, or, with `stack_parameters`,
            the layers' parameters cannot be stacked.

    Examples:
        >>> import torch, xla_wrap
        >>> layers = xla_wrap.ScannedLayers(torch.nn.Linear(8, 8) for _ in range(4))
        >>> x = torch.randn(2, 8)
        >>> for layer in layers:
        ...     x = layer(x)
        >>> x.shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        modules: Iterable[nn.Module] | None = None,
        *,
        policy: cp.SavePolicy | str | None = None,
        offload_to_cpu: bool = False,
        stack_parameters: bool = False,
    ) -> None:
        api = "xla_wrap.ScannedLayers"
        super().__init__(None if modules is None else layer_sequence(api, modules))
        self.__dict__[_OPTIONS] = _scan_options(api, policy, offload_to_cpu)
        if check_flag(api, "stack_parameters", stack_parameters):
            _stack(api, self)

    @property
    def parameters_stacked(self) -> bool:
        """Whether the layers' parameters are stored stacked (`stack_parameters=True`)."""
        return _stacked.is_stacked(self)

    @property
    def scan_options(self) -> dict[str, Any]:
        """`policy` and `offload_to_cpu`, as [`scan_layers()`][xla_wrap.scan_layers] takes
        them (a new dict on each read)."""
        options: dict[str, Any] = self.__dict__[_OPTIONS]
        return dict(options)

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        if isinstance(index, slice):  # `self.layers[:n]` stays scanned
            item.__dict__[_OPTIONS] = self.__dict__[_OPTIONS]
        return item

    @_paths.branches_on_compiling
    def __iter__(self) -> Iterator[nn.Module]:
        layers = list(self._modules.values())
        if not layers:
            return iter(())
        if _paths.compiling():  # the compiler's loop: each layer as the loop runs it
            options = make_options("xla_wrap.ScannedLayers", **self.scan_options)
            compiled: list[Any] = [_CompiledStage(layer, options) for layer in layers]
            return iter(compiled)
        run = _StackRun(lambda args, kwargs: self._run_stack(layers, args, kwargs))
        stand_ins: list[Any] = [_Stage(run, i, layer) for i, layer in enumerate(layers)]
        return iter(stand_ins)

    def _run_stack(
        self, layers: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run all `layers` on what layer 0 was called with."""
        return run_scan("xla_wrap.ScannedLayers", layers, args, kwargs, **self.scan_options)

    def __getstate__(self) -> dict[str, Any]:
        return _stacked.state_without_hooks(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self.parameters_stacked:
            _stacked.register_hooks(self)

    def __repr__(self) -> str:
        if not self.parameters_stacked:
            return nn.Module.__repr__(self)  # ModuleList's own iterates: it would see stand-ins
        # The other layers hold no parameters, which their modules' own reprs may read.
        count = len(self)
        first = nn.Module.__repr__(self[0]).replace("\n", "\n  ")
        others = "" if count == 1 else f"({1 if count == 2 else f'1-{count - 1}'}): as layer 0, "
        return (
            f"ScannedLayers(\n  (0): {first}\n  {others}parameters stacked in layer 0 "
            f"({count} layers)\n)"
        )


class _CompiledStage:
    """A layer of a scanned list inside `torch.compile`: called, the loop's checkpointed
    layer (`checkpoint_layer()`); otherwise the layer (`layer.attention_type` and the like)."""

    def __init__(self, layer: nn.Module, options: Any) -> None:
        # Private names: any other attribute is the layer's.
        self._layer, self._options = layer, options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_layer("xla_wrap.ScannedLayers", self._layer, args, kwargs, self._options)


class _StackRun:
    """One iteration over a scanned list: the result of the whole stack, once computed."""

    def __init__(self, run: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> None:
        self.run = run
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.result: Any = None
        self.done = -1  # the last stage called


class _Stage:
    """What the loop body calls in place of layer `index`."""

    def __init__(self, run: _StackRun, index: int, layer: nn.Module) -> None:
        self.__dict__["run"] = run
        self.__dict__["index"] = index
        self.__dict__["layer"] = layer

    def __getattr__(self, name: str) -> Any:
        if "layer" not in self.__dict__:  # half made (a debugger or Dynamo looks at it)
            raise AttributeError(name)
        return getattr(self.__dict__["layer"], name)  # `layer.attention_type` and the like

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(stand_in, Layer) holds, as for the layer
        layer = self.__dict__.get("layer")
        return _Stage if layer is None else type(layer)

    def __repr__(self) -> str:
        return f"stand-in for layer {self.__dict__['index']}: {self.__dict__['layer']!r}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run: _StackRun = self.__dict__["run"]
        index: int = self.__dict__["index"]
        if index != run.done + 1:
            raise CheckpointError(
                f"xla_wrap.ScannedLayers: layer {index} was called after layer {run.done}; a "
                "scanned list runs all its layers when the first is called, so its layers must "
                "be called in order, once per iteration."
            )
        run.done = index
        if index == 0:
            run.args, run.kwargs = args, kwargs
            run.result = run.run(args, kwargs)
            return run.result
        _check_same_call(index, run, args, kwargs)
        return run.result


def _check_same_call(
    index: int, run: _StackRun, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    def same(a: Any, b: Any) -> bool:
        return a is b or (not hasattr(a, "shape") and type(a) is type(b) and _equal(a, b))

    problem = None
    if not args or args[0] is not run.result:
        problem = (
            f"its first argument is {describe(args[0]) if args else 'missing'}, not the "
            "previous layer's result"
        )
    elif len(args) != len(run.args) or not all(
        same(a, b) for a, b in zip(args[1:], run.args[1:], strict=True)
    ):
        problem = "its positional arguments after the first differ from layer 0's"
    elif kwargs.keys() != run.kwargs.keys() or not all(
        same(kwargs[k], run.kwargs[k]) for k in kwargs
    ):
        problem = "its keyword arguments differ from layer 0's"
    if problem:
        raise CheckpointError(
            f"xla_wrap.ScannedLayers: layer {index} was called differently from the loop "
            f"`x = layer(x, ...)` a scanned list needs: {problem}. The whole stack ran when "
            "layer 0 was called. Loop over a plain nn.ModuleList here, or make every layer "
            "take the previous result and the same other arguments."
        )


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _stack(api: str, layers: nn.ModuleList) -> None:
    stack = _LayerStack.of(list(layers._modules.values()), api)
    if stack.stacked_storage:
        return
    _stacked.stack(api, layers, stack.param_names)


def _scan_options(
    api: str, policy: cp.SavePolicy | str | None, offload_to_cpu: bool
) -> dict[str, Any]:
    options = make_options(api, policy=policy, offload_to_cpu=offload_to_cpu)
    return {"policy": options.policy, "offload_to_cpu": options.offload_to_cpu}


def apply_scan(
    model: M,
    check_fn: Callable[[nn.Module], bool] | None = None,
    *,
    policy: cp.SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
    stack_parameters: bool = False,
) -> M:
    """Turn, in place, each `nn.ModuleList` of `model` of alike layers into a scanned list.

    Each list whose layers are built alike (and, with `check_fn`, all selected by it) becomes a
    [`ScannedLayers`][xla_wrap.ScannedLayers]. A list inside a list already chosen is scanned
    with it, not on its own; lists of a subclass of `nn.ModuleList`, and empty ones, are left
    alone.

    The lists keep their identity, names and `state_dict`; the model's loop over each then
    runs as one scanned, checkpointed stack. Only a forward that loops `x = layer(x, ...)`
    over the whole list qualifies (docs/scan.md).

    Args:
        model: The model to modify.
        check_fn: Which layers may be scanned (`check_fn(layer) -> bool`): a list qualifies
            only if it accepts every layer of it. `None` (the default) accepts all.
        policy: The save policy of the scanned layers (as in
            [`scan_layers()`][xla_wrap.scan_layers]).
        offload_to_cpu: Keep the saved carries in host memory (as in
            [`scan_layers()`][xla_wrap.scan_layers]).
        stack_parameters: Store each list's parameters stacked (as in
            [`ScannedLayers`][xla_wrap.ScannedLayers]): the model's parameters change, so
            build the optimizer after this.

    Returns:
        `model` itself.

    Raises:
        CheckpointTypeError: If `model` is not an `nn.Module`, or `policy` is neither a
            policy name nor callable.
        CheckpointValueError: If nothing qualifies (the message says why for each list),
            the save `policy` is unknown, or, with `stack_parameters`, a list's parameters
            cannot be stacked.

    Examples:
        >>> import torch, xla_wrap
        >>> model = torch.nn.Module()
        >>> model.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> model = xla_wrap.apply_scan(model)
        >>> type(model.layers).__name__
        'ScannedLayers'
    """
    api = "xla_wrap.apply_scan"
    check_module(
        api,
        model,
        "an nn.Module as `model`",
        "Pass the model whose layer lists should be scanned.",
    )
    options = _scan_options(api, policy, offload_to_cpu)
    check_flag(api, "stack_parameters", stack_parameters)
    if check_fn is not None and not is_function(check_fn):
        raise CheckpointTypeError(
            f"{api}: expected a function `check_fn(layer) -> bool` (or None, for every layer "
            f"list), got {describe(check_fn)}. Example: `check_fn=lambda m: isinstance(m, Block)`."
        )
    found = []
    reasons = []
    inside: set[int] = set()  # modules within a list already chosen: scanned with it
    for name, module in model.named_modules():
        if id(module) in inside or type(module) is not nn.ModuleList or len(module) == 0:
            continue
        if check_fn is not None and not all(check_fn(layer) for layer in module):
            continue
        try:
            stack = _LayerStack.of(list(module), api)
        except (CheckpointTypeError, CheckpointValueError) as error:
            reasons.append(f"{name or 'the model'}: {str(error).rstrip('.')}")
            continue
        if stack_parameters:  # refused before any list changes
            _stacked.check_stackable(api, stack.layers, stack.param_names)
        found.append((module, stack))
        inside.update(id(m) for m in module.modules())
    if not found:
        detail = ("; ".join(reasons)) if reasons else "it has no nn.ModuleList of layers"
        raise CheckpointValueError(
            f"{api}: found no layer list to scan in {type(model).__name__}: {detail}."
        )
    for module, stack in found:
        module.__class__ = ScannedLayers
        module.__dict__[_OPTIONS] = options
        if stack_parameters and not stack.stacked_storage:
            _stacked.stack(api, module, stack.param_names)
    return model


def unscan(layers: ScannedLayers) -> nn.ModuleList:
    """Undo [`apply_scan()`][xla_wrap.apply_scan] on one list, in place.

    The list (also one made as a [`ScannedLayers`][xla_wrap.ScannedLayers]) is a plain
    `nn.ModuleList` again, whose loop runs layer by layer. Stacked parameters become per-layer
    ones again (new tensors: build the optimizer again).

    Args:
        layers: The scanned list to undo.

    Returns:
        `layers` itself, now of class `nn.ModuleList`.

    Raises:
        CheckpointTypeError: If `layers` is not an `nn.ModuleList`.

    Examples:
        >>> import torch, xla_wrap
        >>> layers = xla_wrap.ScannedLayers(
        ...     (torch.nn.Linear(8, 8) for _ in range(3)), stack_parameters=True
        ... )
        >>> type(xla_wrap.unscan(layers)).__name__, tuple(layers[2].weight.shape)
        ('ModuleList', (8, 8))
    """
    if not isinstance(layers, nn.ModuleList):
        raise CheckpointTypeError(
            f"xla_wrap.unscan: expected a ScannedLayers (or an nn.ModuleList) as `layers`, got "
            f"{describe(layers)}. Pass the scanned list itself, e.g. `model.layers`."
        )
    if _stacked.is_stacked(layers):
        _stacked.unstack(layers)
    plain: nn.ModuleList = layers
    plain.__dict__.pop(_OPTIONS, None)
    plain.__class__ = nn.ModuleList
    return plain
