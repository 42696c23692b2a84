"""When layer 0's module may compute for every layer of a scanned stack.

A scanned stack runs one module, layer 0's, as the template of every layer, with each layer's
own parameters and buffers swapped in. Whatever else the template's forward reads from its
modules (a layer index, a scale, a list of window sizes, a function, a child module's
setting) is layer 0's. So the layers must be alike in two ways:

* **in structure**, checked when the stack is made: the same class, the same submodules of the
  same classes, parameters and buffers of the same names, shapes and dtypes;
* **in what forward reads**: every other attribute of every submodule is compared between
  the layers (numbers, strings, tensors that are neither parameters nor buffers, lists,
  dicts, functions and their closures, other objects field by field). Where some differ,
  the modules holding them read those attributes through recording properties while the
  forward runs (the trace the scan makes anyway, or the eager loop's own call), and a read
  of one that differs is refused before its result is used. An attribute that differs but
  is never read (transformers' ``layer_idx`` when no cache is passed) is accepted.

What the recording cannot see: reads that bypass attribute access (``self.__dict__[...]``,
``vars(self)``), values reached outside the layer (a global variable, a closure over
something that is not an attribute), and randomness drawn in Python. docs/scan.md lists
these and what the check costs.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _stacked, _wrapper
from ._errors import CheckpointError, CheckpointValueError

# What nn.Module keeps in every instance's __dict__ (the parameters, buffers and submodules,
# compared as structure; the hooks, refused where a body cannot run them), and xla_wrap's own
# bookkeeping (options and stack slots, which the template's forward does not read).
_NOT_SETTINGS = (frozenset(vars(nn.Module())) - {"training"}) | {
    _wrapper._OPTIONS,
    _stacked._SLOT,
    _stacked._STACKED,
}
# Read by the call itself, without attribute access the recording would see.
_ALWAYS_READ = frozenset({"forward", _wrapper._INSTANCE_FORWARD})
# In a watched module's __dict__ while it records: where its reads go, and its path.
_RECORDER = "_xla_wrap_attribute_reads"


def check_structure(
    api: str, first: nn.Module, index: int, layer: nn.Module, *, parameters: bool
) -> None:
    """Refuse a layer built unlike layer 0 (with ``parameters``, also in its parameters: in
    stacked storage layer 0 holds all of them)."""

    def base(module: nn.Module) -> type:
        if isinstance(module, _wrapper.CheckpointWrapper):
            return module._checkpoint_base
        return type(module)

    def signature(module: nn.Module) -> tuple[tuple[object, ...], ...]:
        return (
            tuple(
                (n, tuple(p.shape), p.dtype, p.requires_grad)
                for n, p in (module.named_parameters() if parameters else ())
            ),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
            tuple((n, type(m).__qualname__) for n, m in module.named_modules()),
        )

    if base(layer) is base(first) and signature(layer) == signature(first):
        return
    ours, theirs = signature(first), signature(layer)
    difference = next(
        (
            f"{part}: {_first_difference(a, b)}"
            for part, a, b in zip(
                ("parameters", "buffers", "submodules"), ours, theirs, strict=True
            )
            if a != b
        ),
        f"class {type(layer).__qualname__} vs {type(first).__qualname__}",
    )
    raise CheckpointValueError(
        f"{api}: expected layers of one structure, got layer {index} differing from layer 0 "
        f"in {difference}. Scan a run of identically built layers; call the others in Python "
        "before or after."
    )


def _first_difference(ours: tuple[object, ...], theirs: tuple[object, ...]) -> str:
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            return f"{b} where layer 0 has {a}"
    return f"{len(theirs)} entries where layer 0 has {len(ours)}"


@dataclass(frozen=True)
class Difference:
    """An attribute of the submodule at ``path`` whose value in layer ``index`` differs
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
    forward may run only if it reads none of them (:meth:`watching`)."""

    differences: Mapping[tuple[str, str], Difference]
    layers: tuple[nn.Module, ...]  # to name the modules a difference holds

    @classmethod
    def of(cls, layers: tuple[nn.Module, ...]) -> AttributeDifferences:
        """Compare every layer's attributes with layer 0's (layers of one structure)."""
        found: dict[tuple[str, str], Difference] = {}
        first = dict(layers[0].named_modules())
        for index, layer in enumerate(layers[1:], start=1):
            modules = dict(layer.named_modules())
            pairs = {id(a): modules[p] for p, a in first.items() if p in modules}
            for path, ours in first.items():
                theirs = modules.get(path)
                if theirs is None or theirs is ours:
                    continue
                mine, other = vars(ours), vars(theirs)
                for name in mine.keys() | other.keys():
                    if name in _NOT_SETTINGS or (path, name) in found:
                        continue
                    a, b = mine.get(name, _MISSING), other.get(name, _MISSING)
                    if not _same(a, b, pairs, set()):
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
            f"{api}: expected layers whose forward reads the same values, got layer "
            f"{first.index}'s {first.where!r} = {show(first.theirs)} where layer 0 has "
            f"{show(first.ours)}, and the forward reads it{also}. A scanned stack runs "
            f"layer 0's module for every layer with that layer's parameters and buffers, so "
            f"layer {first.index} would compute with layer 0's value. Make the attribute the "
            "same in every layer, register it as a buffer (a tensor per layer), or pass it "
            "to forward as an argument; or unscan this list (xla_wrap.unscan) and keep the "
            "Python loop."
        )

    @contextmanager
    def watching(self, api: str, layer: nn.Module) -> Iterator[None]:
        """Run ``layer``'s forward (the template's, or a layer's own in the eager loop)
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
                module.__dict__[_RECORDER] = (reads, path)
                original: type = type(module)
                swapped.append((module, original))
                module.__class__ = _recording_class(original, frozenset(watched))
            yield
        finally:
            for module, original in reversed(swapped):
                module.__class__ = original
                del module.__dict__[_RECORDER]
        self.refuse_read(api, reads)


@functools.cache
def _recording_class(cls: type, names: frozenset[str]) -> type:
    """``cls`` with each of ``names`` behind a descriptor that records its reads (and its
    writes: a forward that sets one reads state that differs between layers)."""
    namespace: dict[str, Any] = {
        name: _Recorded(cls, name)
        for name in names - _ALWAYS_READ
        if not _is_data_descriptor(cls, name)
    }
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), namespace)


def _is_data_descriptor(cls: type, name: str) -> bool:
    """Whether ``cls`` already answers ``name`` with a descriptor of its own (the instance's
    entry is then not what forward reads through ``self.name``)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            attr = type(klass.__dict__[name])
            return hasattr(attr, "__set__") or hasattr(attr, "__delete__")
    return False


class _Recorded:
    """A data descriptor (so it comes before the instance's ``__dict__``) that answers as
    plain lookup would, and notes each access through an instance in its recorder."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name

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
        if self.name in state:
            return state[self.name]
        return self._class_attribute(module, type(module))

    def __set__(self, module: Any, value: Any) -> None:
        self._state(module)[self.name] = value

    def __delete__(self, module: Any) -> None:
        del self._state(module)[self.name]


# --- comparing values ------------------------------------------------------------------------

_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)


def _same(a: Any, b: Any, pairs: Mapping[int, nn.Module], seen: set[tuple[int, int]]) -> bool:
    """Whether ``a`` (layer 0's) and ``b`` (another layer's) are the same value, as far as a
    forward reading them could tell. Modules of layer 0 match the other layer's module at the
    same path (``pairs``); whatever cannot be shown equal counts as different."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, nn.Module) and id(a) in pairs:  # others (unregistered) compare by state
        return pairs[id(a)] is b
    if isinstance(a, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, _PLAIN):
        return bool(a == b) or (a != a and b != b)  # NaN settings are alike
    key = (id(a), id(b))
    if key in seen:  # a cycle: equal unless shown otherwise elsewhere
        return True
    seen.add(key)
    same = functools.partial(_same, pairs=pairs, seen=seen)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (set, frozenset)):
        return bool(a == b)
    if isinstance(a, types.FunctionType):
        return (
            a.__code__ is b.__code__
            and a.__globals__ is b.__globals__
            and same(a.__defaults__, b.__defaults__)
            and same(a.__kwdefaults__, b.__kwdefaults__)
            and same(_cells(a), _cells(b))
        )
    if isinstance(a, types.MethodType):
        return same(a.__func__, b.__func__) and same(a.__self__, b.__self__)
    if isinstance(a, functools.partial):
        return same(a.func, b.func) and same(a.args, b.args) and same(a.keywords, b.keywords)
    if isinstance(a, (type, types.ModuleType, types.BuiltinFunctionType)):
        return False  # not the same object
    if type(a).__eq__ is not object.__eq__:
        try:
            return bool(a == b)
        except Exception:  # an __eq__ that cannot answer (arrays, tensors inside)
            return False
    state_a, state_b = getattr(a, "__dict__", None), getattr(b, "__dict__", None)
    slots = [s for k in type(a).__mro__ for s in getattr(k, "__slots__", ()) if s != "__dict__"]
    if state_a is None and not slots:
        return False
    return same(state_a, state_b) and all(
        same(getattr(a, s, _MISSING), getattr(b, s, _MISSING)) for s in slots
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
    """Tensors held as plain attributes. Values are compared where they are in host memory;
    on a device that would mean a read of it on every call, so two different device tensors
    count as different (register them as buffers, which each layer brings as its own)."""
    if (a.shape, a.dtype, a.device, a.requires_grad) != (
        b.shape,
        b.dtype,
        b.device,
        b.requires_grad,
    ):
        return False
    return a.device.type == "cpu" and bool(torch.equal(a, b))


def _show(value: object, names: Mapping[int, str]) -> str:
    """A short description of a value for the error, modules by their place in the stack
    (reprs of modules can be long, and fail on a stacked list's layers, which hold no
    parameters)."""
    show = functools.partial(_show, names=names)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel() <= 8:
            return repr(value.detach().tolist())
        return f"a tensor of shape {tuple(value.shape)} on {value.device}"
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
