"""A scanned stack computes what the loop computes, or refuses (xla_wrap/_scan/alike.py).

A scan runs layer 0's module for every layer with each layer's parameters and buffers. Layers
that differ in anything else their forward reads (an index, a scale, a list, a function, a
child's setting, a tensor that is not a buffer) must be refused, naming the layer, the
attribute and both values; layers that differ only where forward does not look must scan and
give the loop's result. Each kind of difference runs through every way in (``scan_layers``,
``ScannedLayers`` with per-layer and stacked parameters, ``apply_scan``), on eager CPU and on
XLA:CPU, against the plain loop on eager CPU.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap
from xla_wrap import internal

from models import sync

WIDTH = 4
DEPTH = 3
FORMS = ("scan_layers", "ScannedLayers", "ScannedLayers stacked", "apply_scan")
API = {
    "scan_layers": "xla_wrap.scan_layers",
    "ScannedLayers": "xla_wrap.ScannedLayers",
    "ScannedLayers stacked": "xla_wrap.ScannedLayers",
    "apply_scan": "xla_wrap.ScannedLayers",  # apply_scan made the list one
}


class Deep(nn.Module):
    pass


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.deep = Deep()


class Layer(nn.Module):
    """``x + tanh(lin(x)) * read(self)``: ``read`` (one function for all layers) is how its
    forward uses the attribute under test; without it forward reads nothing of the kind."""

    def __init__(self, read: Callable[[nn.Module], float] | None) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.inner = Inner()
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if self.read is not None:
            y = y * self.read(self)
        return x + y


class Model(nn.Module):
    def __init__(self, layers: nn.ModuleList, *, scan: bool = False) -> None:
        super().__init__()
        self.layers = layers
        self.scan = scan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scan:
            return xla_wrap.scan_layers(self.layers, x)
        for layer in self.layers:
            x = layer(x)
        return x


class Settings:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale


class Scale(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale


# --- the kinds of value a layer may hold, each with the number its forward makes of it ---------


@dataclass(frozen=True)
class Value:
    make: Callable[[int], Any]  # a new object holding "value i" (equal objects for equal i)
    factor: Callable[[Any], float]  # what forward computes with it
    plain_repr: bool = False  # its repr is its value (the error shows both)


VALUES = {
    "int": Value(lambda i: i, lambda v: 1.0 / (v + 1), plain_repr=True),
    "float": Value(lambda i: 1.0 + i, lambda v: v, plain_repr=True),
    "str": Value(lambda i: f"window-{i}", lambda v: 1.0 + len(v) % 7 + int(v[-1]), True),
    "bool": Value(lambda i: i % 2 == 1, lambda v: 0.5 if v else 1.0, plain_repr=True),
    "tuple": Value(lambda i: (2, 1 + i), lambda v: v[1], plain_repr=True),
    "list": Value(lambda i: [1 + i, 2], lambda v: v[0], plain_repr=True),
    "dict": Value(lambda i: {"scale": 1 + i}, lambda v: v["scale"], plain_repr=True),
    "tensor": Value(lambda i: torch.tensor([1.0 + i]), lambda v: float(v[0])),
    "builtin function": Value(
        lambda i: (torch.sigmoid, torch.tanh)[i % 2], lambda v: float(v(torch.tensor(1.0)))
    ),
    "closure": Value(lambda i: (lambda s: lambda: s)(1.0 + i), lambda v: v()),
    "partial": Value(lambda i: functools.partial(operator.mul, 1.0 + i), lambda v: v(1.0)),
    "namespace": Value(lambda i: types.SimpleNamespace(scale=1.0 + i), lambda v: v.scale),
    "object": Value(lambda i: Settings(1.0 + i), lambda v: v.scale),
    "slotted object": Value(lambda i: Slotted(1.0 + i), lambda v: v.scale),
    # A module outside the module tree (transformers' kernel functions are held so): its state.
    "unregistered module": Value(lambda i: [Scale(1.0 + i)], lambda v: v[0].scale),
}


def _reader(path: str, name: str, value: Value) -> Callable[[nn.Module], float]:
    return lambda layer: value.factor(getattr(layer.get_submodule(path), name))


def _layers(path: str, name: str, value: Value, values: list[int], read: bool) -> list[nn.Module]:
    """Layer ``i`` holds ``value.make(values[i])`` at ``path``.``name``; its forward reads it
    when ``read``."""
    torch.manual_seed(0)
    reader = _reader(path, name, value) if read else None
    layers: list[nn.Module] = [Layer(reader) for _ in values]
    for layer, v in zip(layers, values, strict=True):
        setattr(layer.get_submodule(path), name, value.make(v))
    return layers


def _gemma2_layers(read: bool) -> list[nn.Module]:
    """Gemma-2's pattern: odd layers slide a window; only they read its size."""
    torch.manual_seed(0)

    def read_window(layer: nn.Module) -> float:
        return 1.0 / layer.sliding_window if layer.is_sliding else 1.0

    layers: list[nn.Module] = [Layer(read_window if read else None) for _ in range(DEPTH)]
    for i, layer in enumerate(layers):
        layer.is_sliding = i % 2 == 1
        layer.sliding_window = 4 if i % 2 else None
    return layers


def _run(layers: list[nn.Module], form: str | None, device: torch.device) -> dict[str, Any]:
    """One step: the output and every gradient by state_dict name."""
    if form in (None, "scan_layers"):
        model = Model(nn.ModuleList(layers), scan=form is not None)
    elif form == "apply_scan":
        model = xla_wrap.apply_scan(Model(nn.ModuleList(layers)))
    else:
        stacked = form == "ScannedLayers stacked"
        model = Model(xla_wrap.ScannedLayers(layers, stack_parameters=stacked))
    model.to(device)
    x = torch.linspace(-1.0, 1.0, 2 * WIDTH).reshape(2, WIDTH).to(device).requires_grad_()
    y = model(x)
    y.pow(2).sum().backward()
    out = {"y": y.detach(), "x": x.grad, **internal.per_layer_gradients(model)}
    sync(device)
    return {k: v.cpu() for k, v in out.items()}


def _assert_loop_result(
    make: Callable[[], list[nn.Module]], form: str, device: torch.device
) -> None:
    expected = _run(make(), None, torch.device("cpu"))
    got = _run(make(), form, device)
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        if device.type == "cpu":
            assert torch.equal(got[key], want), key
        else:
            torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5, msg=key)


def _assert_refused(
    make: Callable[[], list[nn.Module]], form: str, device: torch.device, layer: int, where: str
) -> str:
    with pytest.raises(xla_wrap.CheckpointError) as info:
        _run(make(), form, device)
    message = str(info.value)
    assert message.startswith(f"{API[form]}: ")
    assert f"layer {layer}'s {where!r} = " in message and "where layer 0 has" in message
    for way_out in ("register it as a buffer", "pass it to forward as an argument", "unscan"):
        assert way_out in message
    return message


def _where(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- each kind, each way in, eager CPU and XLA:CPU ----------------------------------------------

CASES = [
    pytest.param(path, name, kind, id=f"{kind}-at-{path or 'layer'}")
    for kind in VALUES
    for path, name in [("", "setting")]
] + [
    pytest.param("inner", "scale", "float", id="child-attribute"),
    pytest.param("inner.deep", "windows", "list", id="grandchild-attribute"),
    pytest.param("", "layer_idx", "int", id="layer_idx"),
    pytest.param("inner", "training", "bool", id="training-flag"),
]


@pytest.mark.parametrize(("path", "name", "kind"), CASES)
def test_layers_differing_in_what_forward_reads_are_refused(
    path: str, name: str, kind: str, device: torch.device
) -> None:
    value = VALUES[kind]
    values = [0] * (DEPTH - 1) + [1]  # layer 1 alike: the first layer that differs is the last
    for form in FORMS:
        message = _assert_refused(
            lambda: _layers(path, name, value, values, read=True),
            form,
            device,
            DEPTH - 1,
            _where(path, name),
        )
        if value.plain_repr:
            ours, theirs = value.make(values[0]), value.make(values[-1])
            assert f"= {theirs!r} where layer 0 has {ours!r}" in message


@pytest.mark.parametrize(("path", "name", "kind"), CASES)
def test_layers_differing_where_forward_does_not_read_scan_as_the_loop(
    path: str, name: str, kind: str, device: torch.device
) -> None:
    value = VALUES[kind]
    for form in FORMS:
        _assert_loop_result(
            lambda: _layers(path, name, value, list(range(DEPTH)), read=False), form, device
        )


@pytest.mark.parametrize(("path", "name", "kind"), CASES)
def test_equal_values_in_separate_objects_scan_as_the_loop(
    path: str, name: str, kind: str, device: torch.device
) -> None:
    """Every layer holds its own object of the same value (a list, a closure, a tensor built
    per layer), which its forward reads: alike."""
    value = VALUES[kind]
    for form in FORMS:
        _assert_loop_result(
            lambda: _layers(path, name, value, [0] * DEPTH, read=True), form, device
        )


def test_gemma2s_pattern_is_refused_naming_what_layer_0_reads(device: torch.device) -> None:
    for form in FORMS:
        _assert_refused(lambda: _gemma2_layers(read=True), form, device, 1, "is_sliding")
    for form in FORMS:
        _assert_loop_result(lambda: _gemma2_layers(read=False), form, device)


def test_a_refused_stack_leaves_its_layers_as_they_were() -> None:
    """The recording swaps classes only while forward runs."""
    layers = _layers("inner", "scale", VALUES["float"], list(range(DEPTH)), read=True)
    classes = [type(m) for layer in layers for m in layer.modules()]
    with pytest.raises(xla_wrap.CheckpointError):
        xla_wrap.scan_layers(nn.ModuleList(layers), torch.randn(2, WIDTH))
    assert [type(m) for layer in layers for m in layer.modules()] == classes
    assert all(
        "_xla_wrap" not in key for layer in layers for m in layer.modules() for key in vars(m)
    )
    assert [layer.inner.scale for layer in layers] == [1.0, 2.0, 3.0]


def test_a_forward_that_writes_a_differing_attribute_is_refused() -> None:
    class Counting(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = 1  # state that differs between layers, set by forward
            return super().forward(x)

    torch.manual_seed(0)
    layers = [Counting(None) for _ in range(DEPTH)]
    layers[2].calls = 5
    with pytest.raises(xla_wrap.CheckpointError, match="layer 2's 'calls' = 5"):
        xla_wrap.scan_layers(nn.ModuleList(layers), torch.randn(2, WIDTH))


def test_a_forward_set_on_each_instance_is_alike_when_each_wraps_its_own_layer(
    device: torch.device,
) -> None:
    """accelerate's hooks set ``forward`` on each module, bound to that module: alike. A layer
    whose instance ``forward`` is another function is not, though no attribute read shows it
    (the call itself reads ``forward``)."""

    def hooked(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return type(module).forward(module, x) * 0.5

    def own_forwards(layers: list[nn.Module]) -> list[nn.Module]:
        for layer in layers:
            layer.forward = functools.partial(hooked, layer)
        return layers

    def make(other: bool) -> list[nn.Module]:
        layers = own_forwards(_layers("", "setting", VALUES["int"], [0] * DEPTH, read=False))
        if other:
            layers[2].forward = functools.partial(hooked, layers[1])
        return layers

    for form in FORMS:
        _assert_loop_result(functools.partial(make, False), form, device)
        _assert_refused(functools.partial(make, True), form, device, 2, "forward")


# --- what an independent review found (each accepted and computed wrong, or falsely refused) --


class Hooked(Layer):
    """Scales its gradient by ``grad_scale`` in a tensor hook: a read in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad * self.grad_scale)
        return x + torch.tanh(h)


def _each(cls: type[Layer], name: str, values: list[Any]) -> list[nn.Module]:
    """Layers of ``cls`` (reading nothing of ``Layer``'s kinds), layer ``i`` holding
    ``values[i]`` as ``name``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [cls(None) for _ in values]
    for layer, value in zip(layers, values, strict=True):
        setattr(layer, name, value)
    return layers


def _hooked(scales: list[float]) -> list[nn.Module]:
    return _each(Hooked, "grad_scale", scales)


@pytest.mark.xla
def test_a_read_in_backward_is_refused_on_xla(xla_device: torch.device) -> None:
    """The backward loop differentiates layer 0's module for every layer: a tensor hook that
    reads the layer would use layer 0's value."""
    for form in FORMS:
        _assert_refused(lambda: _hooked([1.0, -2.0, 3.0]), form, xla_device, 1, "grad_scale")
    _assert_loop_result(lambda: _hooked([2.0, 2.0, 2.0]), "scan_layers", xla_device)


def test_off_xla_every_layer_runs_its_own_module_so_reads_in_backward_are_its_own() -> None:
    """Stacked parameters included: each layer's module runs on its slices."""
    for form in FORMS:
        _assert_loop_result(lambda: _hooked([1.0, -2.0, 3.0]), form, torch.device("cpu"))


class Gated(Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gate


def test_a_plain_tensor_that_needs_gradients_is_each_layers_own_whatever_it_holds(
    device: torch.device,
) -> None:
    """In the loop each layer's gate gets its own gradient; a scan would give layer 0's the
    sum of all."""

    def make() -> list[nn.Module]:
        return _each(Gated, "gate", [torch.ones(WIDTH, requires_grad=True) for _ in range(DEPTH)])

    for form in FORMS:
        message = _assert_refused(make, form, device, 1, "gate")
        assert "its own tensor requiring gradients" in message


class Validated(Layer):
    """A class-level property that keeps its value in the instance's ``__dict__`` under the
    same name: reads go through the property."""

    @property  # type: ignore[misc]
    def scale(self) -> float:
        return float(self.__dict__["scale"])

    @scale.setter
    def scale(self, value: float) -> None:
        self.__dict__["scale"] = float(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


@pytest.mark.parametrize(
    ("values", "refused"),
    [
        ([0.0, -0.0, 0.0], True),  # another value: 1 / x tells them apart
        ([1.0, 1.0, 2.0], True),
        ([1.0, 1.0, 1.0], False),
    ],
    ids=["signed-zero", "differ", "alike"],
)
def test_values_behind_a_class_property_and_signed_zeros(
    values: list[float], refused: bool, device: torch.device
) -> None:
    def make() -> list[nn.Module]:
        return _each(Validated, "scale", values)

    first = next((i for i, v in enumerate(values) if repr(v) != repr(values[0])), None)
    for form in FORMS:
        if refused:
            assert first is not None
            _assert_refused(make, form, device, first, "scale")
        else:
            _assert_loop_result(make, form, device)


def test_objects_compare_field_by_field_and_dicts_in_order() -> None:
    """A dataclass whose ``__eq__`` ignores a field forward reads; a dict whose order forward
    depends on."""
    import dataclasses

    @dataclasses.dataclass
    class Config:
        name: str
        scale: float = dataclasses.field(compare=False)

    cases = {
        "config": (lambda i: Config("c", 1.0 + i), lambda v: v.scale),
        "ordered": (
            lambda i: {"a": 1.0, "b": 3.0} if i == 0 else {"b": 3.0, "a": 1.0},
            lambda v: next(iter(v.values())),
        ),
    }
    for name, (make_value, factor) in cases.items():
        value = Value(make_value, factor)
        for form in FORMS:
            _assert_refused(
                lambda v=value, n=name: _layers("", n, v, [0, 1, 1], read=True),
                form,
                torch.device("cpu"),
                1,
                name,
            )


class Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def _parametrized(kind: str) -> list[nn.Module]:
    """Layers whose Linear is parametrized: torch makes a class per module. (Not weight_norm
    here: its kernel falls back to the CPU on XLA, which crashes any scanned body.)"""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    layers: list[nn.Module] = [Layer(None) for _ in range(DEPTH)]
    for i, layer in enumerate(layers):
        if kind == "parametrized":
            parametrize.register_parametrization(layer.lin, "weight", Doubled())
        elif kind == "class factory":  # same name, another class per layer
            act = type("Act", (nn.Module,), {"forward": lambda self, x, k=1.0 + i: x * k})
            layer.inner.deep = act()
    return layers


def test_per_module_classes_alike_scan_and_unlike_ones_are_refused(device: torch.device) -> None:
    for form in FORMS:
        _assert_loop_result(lambda: _parametrized("parametrized"), form, device)
        with pytest.raises(xla_wrap.CheckpointValueError, match="another class of that name"):
            _run(_parametrized("class factory"), form, device)


def test_recurrent_layers_scan_as_the_loop() -> None:
    """nn.LSTM keeps weak references to its own parameters (refreshed when they are set)."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(WIDTH, WIDTH, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.rnn(x.unsqueeze(1))[0].squeeze(1)

    def make() -> list[nn.Module]:
        torch.manual_seed(0)
        return [Recurrent() for _ in range(DEPTH)]

    for form in FORMS:
        _assert_loop_result(make, form, torch.device("cpu"))


def test_a_class_that_refuses_subclasses_counts_its_differences_as_read() -> None:
    class Registered(Layer):
        def __init_subclass__(cls, *, kind: str, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)

    for form in FORMS:
        _assert_refused(
            lambda: _each(Registered, "setting", [0, 1, 1]), form, torch.device("cpu"), 1, "setting"
        )


def test_long_chains_of_equal_objects_do_not_recurse_without_bound() -> None:
    class Link:
        def __init__(self, n: int) -> None:
            self.next = Link(n - 1) if n else None

    def make() -> list[nn.Module]:
        torch.manual_seed(0)
        layers: list[nn.Module] = [Layer(None) for _ in range(DEPTH)]
        for layer in layers:
            chain = Link(0)
            for _ in range(2000):  # built iteratively: deeper than the recursion limit
                head = Link(0)
                head.next, chain = chain, head
            layer.chain = chain
        return layers

    for form in FORMS:  # too deep to show equal: a difference, but not read
        _assert_loop_result(make, form, torch.device("cpu"))


# --- any attribute of any submodule ---------------------------------------------------------


ANY_ATTRIBUTE = {
    "kind": st.sampled_from(sorted(VALUES)),
    "path": st.sampled_from(["", "inner", "inner.deep", "lin"]),
    "name": st.sampled_from(["setting", "layer_idx", "_private", "training"]),
    "differing": st.lists(st.integers(1, DEPTH - 1), max_size=DEPTH - 1, unique=True),
    "read": st.booleans(),
}


def _equal_or_refused(
    kind: str,
    path: str,
    name: str,
    differing: list[int],
    read: bool,
    form: str,
    device: torch.device,
) -> None:
    """Layers differing (where ``differing``) in a value of ``kind`` at ``path``.``name``,
    read or not: refused exactly when read and different, else the loop's result."""
    value = VALUES[kind]
    values = [i if i in differing else 0 for i in range(DEPTH)]
    factors = [value.factor(value.make(v)) for v in values]  # what each layer computes with
    make = functools.partial(_layers, path, name, value, values, read)
    if read and any(f != factors[0] for f in factors):
        first = next(i for i, f in enumerate(factors) if f != factors[0])
        _assert_refused(make, form, device, first, _where(path, name))
    else:
        _assert_loop_result(make, form, device)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**ANY_ATTRIBUTE, form=st.sampled_from(FORMS))
def test_on_eager_cpu_any_attribute_is_equal_to_the_loop_or_refused(
    kind: str, path: str, name: str, differing: list[int], read: bool, form: str
) -> None:
    """Off XLA each layer runs its own module, and refuses what XLA's template would."""
    _equal_or_refused(kind, path, name, differing, read, form, torch.device("cpu"))


@pytest.mark.xla
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(**ANY_ATTRIBUTE, form=st.sampled_from(FORMS[:3]))
def test_on_xla_any_attribute_is_equal_to_the_loop_or_refused(
    xla_device: torch.device,
    kind: str,
    path: str,
    name: str,
    differing: list[int],
    read: bool,
    form: str,
) -> None:
    """On XLA layer 0's module runs for every layer: what the check accepts must compute
    what the loop computes."""
    _equal_or_refused(kind, path, name, differing, read, form, xla_device)


@pytest.mark.xla
def test_after_a_refusal_on_xla_the_device_keeps_working(xla_device: torch.device) -> None:
    """The refusal comes while torch_xla traces the loop body on placeholder tensors; the
    error, kept here, must not keep them alive into the next sync (a segmentation fault)."""
    import torch_xla

    with pytest.raises(xla_wrap.CheckpointError) as info:
        _run(_layers("", "setting", VALUES["int"], [0, 1, 2], read=True), "scan_layers", xla_device)
    torch_xla.sync()
    got = _run(
        _layers("", "setting", VALUES["int"], [0, 1, 2], read=False), "scan_layers", xla_device
    )
    assert torch.isfinite(got["y"]).all() and info.value is not None
