"""Argument checks every API shares, so that the same mistake gets the same answer.

Each API keeps its own words for what it expected; these decide what counts as that.
"""

from __future__ import annotations

from typing import TypeGuard

from torch import nn

from .errors import CheckpointTypeError, describe


def is_int(value: object) -> TypeGuard[int]:
    """An int, and not a bool: `True` is an int to Python and never a count here."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
