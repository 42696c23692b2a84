"""Argument checks every API shares, so that the same mistake gets the same answer.

Each API keeps its own words for what it expected; these decide what counts as that.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import torch
from torch import nn

from .errors import CheckpointTypeError, describe


def is_int(value: object) -> TypeGuard[int]:
    """An int, and not a bool: `True` is an int to Python and never a count here."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_function(value: object) -> TypeGuard[Callable[..., Any]]:
    """Callable, and not a class, a module or a tensor: those are callable or look it, and are
    never the function an API asked for (a class given for `by_type(cls)`, a layer for its
    forward)."""
    return callable(value) and not isinstance(value, (type, nn.Module, torch.Tensor))


def check_flag(api: str, name: str, value: object) -> bool:
    """`value` if it is a bool: a tensor, a string or a number would be read as true or false
    without saying so, so anything else is a CheckpointTypeError naming `api`'s argument."""
    if not isinstance(value, bool):
        raise CheckpointTypeError(
            f"{api}: expected True or False as `{name}`, got {describe(value)}."
        )
    return value


def check_text(api: str, name: str, value: object) -> str:
    """`value` if it is a string; otherwise a CheckpointTypeError naming `api`'s argument."""
    if not isinstance(value, str):
        raise CheckpointTypeError(f"{api}: expected a string as `{name}`, got {describe(value)}.")
    return value


def check_module(api: str, value: object, expected: str, advice: str = "") -> nn.Module:
    """`value` if it is an `nn.Module`; otherwise a CheckpointTypeError that says what
    `api` `expected` (e.g. "an nn.Module as `model`"), what came, and the `advice`."""
    if not isinstance(value, nn.Module):
        message = f"{api}: expected {expected}, got {describe(value)}."
        raise CheckpointTypeError(f"{message} {advice}" if advice else message)
    return value


def check_record(api: str, record: object) -> None:
    """Refuse a field of a public record (a frozen dataclass: `Op`, `CompiledProgram`, ...)
    that does not have its annotated type, with a CheckpointTypeError naming the record `api`
    and the field, so that a record built by hand fails where it is built, not where it is
    read."""
    cls: Any = type(record)
    for name, expected, accepts in _field_checks(cls):
        value = getattr(record, name)
        if not accepts(value):
            raise CheckpointTypeError(
                f"{api}: expected {expected} as `{name}`, got {describe(value)}."
            )


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, str, Callable[[object], bool]], ...]:
    """Per field: its name, its type spelled, and a check made once per class (a record is
    made per operation a save policy sees)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, _spelled(hints[f.name]), _accepting(hints[f.name]))
        for f in dataclasses.fields(cls)
        if f.init
    )


def _accepting(expected: Any) -> Callable[[object], bool]:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (types.UnionType, typing.Union):
        options = [_accepting(arg) for arg in args]
        return lambda value: any(accepts(value) for accepts in options)
    if expected is type(None):
        return lambda value: value is None
    if expected is int:  # a shape's size is a SymInt under torch.compile's dynamic shapes
        return lambda value: is_int(value) or isinstance(value, torch.SymInt)
    if expected is float:
        return is_number
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _accepting(args[0])
        return lambda value: isinstance(value, tuple) and all(map(item, value))
    if origin is tuple:
        items = [_accepting(arg) for arg in args]
        return lambda value: (
            isinstance(value, tuple)
            and len(value) == len(items)
            and all(accepts(v) for accepts, v in zip(items, value, strict=True))
        )
    if origin is not None and issubclass(origin, Mapping) and len(args) == 2:
        key, item = _accepting(args[0]), _accepting(args[1])
        return lambda value: (
            isinstance(value, origin) and all(key(k) and item(v) for k, v in value.items())
        )
    kind = expected if origin is None else origin
    return lambda value: isinstance(value, kind)


def _spelled(expected: Any) -> str:
    if typing.get_origin(expected) is None and hasattr(expected, "__qualname__"):
        return str(expected.__qualname__)
    return str(expected).replace("typing.", "").replace("collections.abc.", "")
