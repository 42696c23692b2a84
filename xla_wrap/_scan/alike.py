"""When layer 0's module may compute for every layer of a scanned stack.

A scanned stack runs one module, layer 0's, as the template of every layer, with each layer's
own parameters and buffers swapped in. Whatever else the template's forward reads from its
modules (a layer index, a scale, a list of window sizes, a function, a child module's
setting) is layer 0's. So the layers must be alike in two ways:

* **in structure**, checked when the stack is made: the same class, the same submodules of the
  same classes, parameters and buffers of the same names, shapes and dtypes;
* **in what the layer reads**: every other attribute of every submodule is compared between
  the layers (numbers, strings, tensors that are neither parameters nor buffers, lists,
  dicts, functions and their closures, other objects field by field). Where some differ,
  the modules holding them read those attributes through recording descriptors while the
  layer runs (on XLA the forward and backward bodies the scan traces anyway; off XLA each
  layer's own call), and a read of one that differs is refused before its result is used.
  An attribute that differs but is never read (transformers' `layer_idx` when no cache is
  passed) is accepted.

What the recording cannot see: reads that bypass attribute access (`self.__dict__[...]`,
`vars(self)`), values reached outside the layer (a global variable, a closure over
something that is not an attribute), and randomness drawn in Python. docs/scan.md lists
these and what the check costs.
"""

from __future__ import annotations

import enum
import functools
import math
import types
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._core import wrapper as _wrapper
from .._support import fingerprint
from .._support.errors import CheckpointError, CheckpointValueError
from . import stacked_parameters as _stacked

# What nn.Module keeps in every instance's __dict__ (the parameters, buffers and submodules,
# compared as structure; the hooks, refused where a body cannot run them), and xla_wrap's own
# bookkeeping (options and stack slots, which the template's forward does not read).
_NOT_SETTINGS = (frozenset(vars(nn.Module())) - {"training"}) | {
    _wrapper.OPTIONS_KEY,
    _stacked._SLOT,
    _stacked._STACKED,
}
# Caches torch keeps in sync with a module's parameters: whenever a parameter is set (as the
# scan sets each layer's), nn.RNNBase updates its flat weights.
_DERIVED: tuple[tuple[type, frozenset[str]], ...] = (
    (nn.RNNBase, frozenset({"_flat_weights", "_flat_weight_refs"})),
)
# Read by the call itself, without attribute access the recording would see.
_ALWAYS_READ = frozenset({"forward", _wrapper.INSTANCE_FORWARD_KEY})
# In a watched module's __dict__ while it records: where its reads go, and its path.
_RECORDER = "_xla_wrap_attribute_reads"
# Deeper than this, two values count as different (no RecursionError on long chains).
_MAX_DEPTH = 64


def _settings(module: nn.Module) -> dict[str, Any]:
    """What a module holds besides its structure: its `__dict__` and slots."""
    skip = _NOT_SETTINGS.union(*(n for t, n in _DERIVED if isinstance(module, t)))
    settings = {k: v for k, v in vars(module).items() if k not in skip}
    for name in _slots(type(module)):
        settings[name] = getattr(module, name, _MISSING)
    return settings


def _slots(cls: type) -> list[str]:
    return [
        s
        for k in cls.__mro__
        for s in getattr(k, "__slots__", ())
        if s not in ("__dict__", "__weakref__")
    ]


def check_structure(
    api: str, first: nn.Module, index: int, layer: nn.Module, *, parameters: bool
) -> None:
    """Refuse a layer built unlike layer 0 (with `parameters`, also in its parameters: in
    stacked storage layer 0 holds all of them)."""

    base = _wrapper.unwrapped_class

    def signature(module: nn.Module) -> tuple[tuple[object, ...], ...]:
        return (
            fingerprint.parameter_entries(module) if parameters else (),
            fingerprint.buffer_entries(module),
            tuple(n for n, _ in module.named_modules()),
        )

    ours, theirs = signature(first), signature(layer)
    difference = next(
        (
            f"{part}: {_first_difference(a, b)}"
            for part, a, b in zip(
                ("parameters", "buffers", "submodules"), ours, theirs, strict=True
            )
            if a != b
        ),
        None,
    )
    if difference is None:
        both = list(zip(first.named_modules(), layer.named_modules(), strict=True))
        compare = _Comparison({id(a): b for (_, a), (_, b) in both})
        classes = [("", base(first), base(layer))] + [
            (n, type(a), type(b)) for (n, a), (_, b) in both if n
        ]
        unlike = next(((n, a, b) for n, a, b in classes if not _alike_classes(a, b, compare)), None)
        if unlike is None:
            return
        path, a, b = unlike
        same_name = " (another class of that name)" if a.__qualname__ == b.__qualname__ else ""
        where = f"{path}: " if path else ""
        difference = f"class: {where}{b.__qualname__}{same_name} where layer 0 has {a.__qualname__}"
    raise CheckpointValueError(
        f"{api}: expected layers of one structure, got layer {index} differing from layer 0 "
        f"in {difference}. Scan a run of identically built layers; call the others in Python "
        "before or after."
    )


def _alike_classes(a: type, b: type, compare: _Comparison) -> bool:
    """One class, or two made alike (`torch.nn.utils.parametrize` makes a class per
    module, whose properties refer to that module): the same name, bases and class
    attributes."""
    if a is b:
        return True
    if a.__qualname__ != b.__qualname__ or a.__bases__ != b.__bases__:
        return False
    skip = {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"}
    return compare.same(
        {k: v for k, v in vars(a).items() if k not in skip},
        {k: v for k, v in vars(b).items() if k not in skip},
    )


def _first_difference(ours: tuple[object, ...], theirs: tuple[object, ...]) -> str:
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            return f"{b} where layer 0 has {a}"
    return f"{len(theirs)} entries where layer 0 has {len(ours)}"


@dataclass(frozen=True)
class Difference:
    """An attribute of the submodule at `path` whose value in layer `index` differs
    from layer 0's (the first such layer)."""

    path: str
    name: str
    index: int
    ours: object  # layer 0's value, or _MISSING
    theirs: object

    @property
    def where(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name


class _Missing:
    def __repr__(self) -> str:
        return "no such attribute"


_MISSING = _Missing()


@dataclass(frozen=True)
class AttributeDifferences:
    """The attributes in which a stack's layers differ, by submodule path and name; a
    forward may run only if it reads none of them (`watching()`)."""

    differences: Mapping[tuple[str, str], Difference]
    layers: tuple[nn.Module, ...]  # to name the modules a difference holds

    @classmethod
    def of(cls, layers: tuple[nn.Module, ...]) -> AttributeDifferences:
        """Compare every layer's attributes with layer 0's (layers of one structure)."""
        found: dict[tuple[str, str], Difference] = {}
        first = dict(layers[0].named_modules())
        for index, layer in enumerate(layers[1:], start=1):
            modules = dict(layer.named_modules())
            compare = _Comparison({id(a): modules[p] for p, a in first.items() if p in modules})
            for path, ours in first.items():
                theirs = modules.get(path)
                if theirs is None or theirs is ours:
                    continue
                mine, other = _settings(ours), _settings(theirs)
                for name in mine.keys() | other.keys():
                    if (path, name) in found:
                        continue
                    a, b = mine.get(name, _MISSING), other.get(name, _MISSING)
                    if not compare.same(a, b):
                        found[(path, name)] = Difference(path, name, index, a, b)
        return cls(found, layers)

    def __bool__(self) -> bool:
        return bool(self.differences)

    def refuse_read(self, api: str, reads: set[tuple[str, str]]) -> None:
        """Refuse if a forward read one of the differing attributes."""
        read = [d for key, d in self.differences.items() if key in reads or key[1] in _ALWAYS_READ]
        if not read:
            return
        first = min(read, key=lambda d: (d.index, d.path, d.name))
        others = sorted({d.where for d in read} - {first.where})
        also = f" (it also reads {', '.join(others)}, which differ too)" if others else ""
        names = {
            id(module): f"layer {i}" + (f"'s {path}" if path else "")
            for i, layer in enumerate(self.layers)
            for path, module in layer.named_modules()
        }
        show = functools.partial(_show, names=names)
        raise CheckpointError(
            f"{api}: expected layers that read the same values, got layer "
            f"{first.index}'s {first.where!r} = {show(first.theirs)} where layer 0 has "
            f"{show(first.ours)}, and the layer reads it{also}. A scanned stack runs "
            f"layer 0's module for every layer with that layer's parameters and buffers, so "
            f"layer {first.index} would compute with layer 0's value. Make the attribute the "
            "same in every layer, register it as a buffer (a tensor per layer), or pass it "
            "to forward as an argument; or unscan this list (xla_wrap.unscan) and keep the "
            "Python loop."
        )

    @contextmanager
    def watching(self, api: str, layer: nn.Module) -> Iterator[None]:
        """Run `layer`'s forward (the template's, or a layer's own in the eager loop)
        recording which differing attributes it reads; refuse any on the way out."""
        if not self.differences:
            yield
            return
        names: dict[str, set[str]] = {}
        for path, name in self.differences:
            names.setdefault(path, set()).add(name)
        reads: set[tuple[str, str]] = set()
        swapped: list[tuple[nn.Module, type]] = []
        try:
            for path, watched in names.items():
                module = layer.get_submodule(path)
                if _RECORDER in module.__dict__:  # one module at two paths: watched once
                    continue
                original: type = type(module)
                try:
                    recording = _recording_class(original, frozenset(watched))
                except Exception:  # a class that refuses subclasses: count them all as read
                    reads.update((path, name) for name in watched)
                    continue
                module.__dict__[_RECORDER] = (reads, path)
                swapped.append((module, original))
                module.__class__ = recording
            yield
        finally:
            for module, original in reversed(swapped):
                module.__class__ = original
                del module.__dict__[_RECORDER]
        self.refuse_read(api, reads)


@functools.cache
def _recording_class(cls: type, names: frozenset[str]) -> type:
    """`cls` with each of `names` behind a descriptor that records its reads (and its
    writes: a forward that sets one reads state that differs between layers)."""
    namespace: dict[str, Any] = {
        name: _Recorded(cls, name, _data_descriptor(cls, name)) for name in names - _ALWAYS_READ
    }
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), namespace)


def _data_descriptor(cls: type, name: str) -> Any:
    """The descriptor `cls` answers `name` with ahead of the instance's `__dict__` (a
    property that keeps its value there), or None."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            kind = type(attr)
            return attr if hasattr(kind, "__set__") or hasattr(kind, "__delete__") else None
    return None


class _Recorded:
    """A data descriptor (so it comes before the instance's `__dict__`) that answers as
    lookup without it would (through `inner`, the class's own data descriptor, if any), and
    notes each access through an instance in its recorder."""

    def __init__(self, cls: type, name: str, inner: Any) -> None:
        self.cls, self.name, self.inner = cls, name, inner

    def _state(self, module: Any) -> dict[str, Any]:
        state: dict[str, Any] = object.__getattribute__(module, "__dict__")
        reads, path = state[_RECORDER]
        reads.add((path, self.name))
        return state

    def _class_attribute(self, module: Any, owner: type) -> Any:
        for klass in self.cls.__mro__:
            if self.name in klass.__dict__:
                attr = klass.__dict__[self.name]
                binder = getattr(type(attr), "__get__", None)
                return attr if binder is None else binder(attr, module, owner)
        raise AttributeError(self.name)  # nn.Module.__getattr__ answers next

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        if module is None:  # `type(self).name`: the class's own
            return self._class_attribute(None, owner or self.cls)
        state = self._state(module)
        if self.inner is None and self.name in state:
            return state[self.name]
        return self._class_attribute(module, type(module))

    def __set__(self, module: Any, value: Any) -> None:
        state = self._state(module)
        if self.inner is not None:
            self.inner.__set__(module, value)
        else:
            state[self.name] = value

    def __delete__(self, module: Any) -> None:
        state = self._state(module)
        if self.inner is not None:
            self.inner.__delete__(module)
        else:
            del state[self.name]


# --- comparing values ------------------------------------------------------------------------

_PLAIN = (bool, int, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)


class _Comparison:
    """Whether a value of layer 0 and one of another layer are the same, as far as a forward
    reading them could tell. Modules of layer 0 match the other layer's module at the same
    path (`pairs`); whatever cannot be shown equal counts as different."""

    def __init__(self, pairs: Mapping[int, nn.Module]) -> None:
        self.pairs = pairs
        self.seen: set[tuple[int, int]] = set()
        self.depth = 0

    def same(self, a: Any, b: Any) -> bool:
        if a is b:
            return True
        if isinstance(a, nn.Module) and id(a) in self.pairs:  # others compare by state
            return self.pairs[id(a)] is b
        if type(a) is not type(b) or self.depth > _MAX_DEPTH:
            return False
        if isinstance(a, torch.Tensor):
            return _same_tensor(a, b)
        if isinstance(a, (float, complex)):
            return _same_number(a, b)
        if isinstance(a, _PLAIN):
            return bool(a == b)
        key = (id(a), id(b))
        if key in self.seen:  # a cycle: equal unless shown otherwise elsewhere
            return True
        self.seen.add(key)
        self.depth += 1
        try:
            return self._same_structure(a, b)
        finally:
            self.depth -= 1

    def _same_structure(self, a: Any, b: Any) -> bool:
        same = self.same
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict):  # in order: a forward may iterate it
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (set, frozenset)):
            return bool(a == b)
        if isinstance(a, types.FunctionType):
            return (
                a.__code__ is b.__code__
                and a.__globals__ is b.__globals__
                and same(a.__defaults__, b.__defaults__)
                and same(a.__kwdefaults__, b.__kwdefaults__)
                and same(_cells(a), _cells(b))
                and same(vars(a), vars(b))
            )
        if isinstance(a, (types.MethodType, staticmethod, classmethod)):
            return same(a.__func__, b.__func__) and same(
                getattr(a, "__self__", None), getattr(b, "__self__", None)
            )
        if isinstance(a, property):
            return same(a.fget, b.fget) and same(a.fset, b.fset) and same(a.fdel, b.fdel)
        if isinstance(a, functools.partial):
            return same(a.func, b.func) and same(a.args, b.args) and same(a.keywords, b.keywords)
        if isinstance(a, weakref.ref):
            return same(a(), b())
        if isinstance(a, (type, types.ModuleType, types.BuiltinFunctionType)):
            return False  # not the same object
        state_a, slots = getattr(a, "__dict__", None), _slots(type(a))
        if state_a is not None or slots:  # field by field, whatever its __eq__ says
            return same(state_a, getattr(b, "__dict__", None)) and all(
                same(getattr(a, s, _MISSING), getattr(b, s, _MISSING)) for s in slots
            )
        if type(a).__eq__ is not object.__eq__:
            return _equal(a, b)
        try:  # a value of a C type (operator.itemgetter): by how it pickles
            return same(a.__reduce_ex__(4), b.__reduce_ex__(4))
        except Exception:
            return False


def _equal(a: Any, b: Any) -> bool:
    """`a == b` for values with their own equality (arrays answer elementwise)."""
    if getattr(a, "shape", None) != getattr(b, "shape", None):
        return False
    if getattr(a, "dtype", None) != getattr(b, "dtype", None):
        return False
    try:
        result = a == b
        return bool(result) if isinstance(result, bool) else bool(result.all())
    except Exception:
        return False


def _same_number(a: float | complex, b: float | complex) -> bool:
    """Equal, NaN alike, and of the same sign for zeros (`-0.0` is another value)."""
    parts_a = (a.real, a.imag) if isinstance(a, complex) else (a,)
    parts_b = (b.real, b.imag) if isinstance(b, complex) else (b,)
    return all(
        (x != x and y != y) or (x == y and math.copysign(1.0, x) == math.copysign(1.0, y))
        for x, y in zip(parts_a, parts_b, strict=True)
    )


def _cells(function: types.FunctionType) -> tuple[Any, ...]:
    cells = function.__closure__ or ()
    return tuple(_cell_contents(c) for c in cells)


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tensors held as plain attributes (the same tensor was checked before). One that needs
    gradients is a value of its own per layer, whatever it holds (in the loop each layer's
    gets its gradient). Values are compared where they are in host memory; on a device that
    would read it on every call, so two device tensors count as different (register them as
    buffers, which each layer brings as its own)."""
    if a.requires_grad or b.requires_grad:
        return False
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device) or a.device.type != "cpu":
        return False
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = a.isnan(), b.isnan()
        return bool(torch.equal(nan_a, nan_b)) and bool(
            torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))
        )
    return bool(torch.equal(a, b))


def _show(value: object, names: Mapping[int, str]) -> str:
    """A short description of a value for the error, modules by their place in the stack
    (reprs of modules can be long, and fail on a stacked list's layers, which hold no
    parameters)."""
    show = functools.partial(_show, names=names)
    if isinstance(value, torch.Tensor):
        own = "its own tensor requiring gradients, " if value.requires_grad else ""
        if value.device.type == "cpu" and value.numel() <= 8:
            return own + repr(value.detach().tolist())
        return f"{own or 'a tensor '}of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, (list, tuple)) and len(value) <= 8:
        items = ", ".join(show(v) for v in value)
        return (
            f"[{items}]"
            if isinstance(value, list)
            else f"({items}{',' if len(value) == 1 else ''})"
        )
    if isinstance(value, nn.Module):
        return f"<{names.get(id(value), 'a')} {type(value).__name__} module>"
    if isinstance(value, functools.partial):
        args = [show(a) for a in value.args] + [f"{k}={show(v)}" for k, v in value.keywords.items()]
        return f"functools.partial({', '.join([show(value.func), *args])})"
    if isinstance(value, types.MethodType):
        return f"<method {value.__func__.__qualname__} of {show(value.__self__)}>"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"<function {value.__qualname__}>"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
