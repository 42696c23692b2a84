"""Exceptions raised by xla_wrap.

Every message starts with the API that refused, says what it expected and what it got, and
how to fix it. Each class also derives from the built-in exception that fits, so callers that
catch ``TypeError`` or ``RuntimeError`` keep working.
"""

from __future__ import annotations


class XlaWrapError(Exception):
    """Base class of every error raised by xla_wrap."""


class CheckpointTypeError(XlaWrapError, TypeError):
    """An argument has the wrong type (a non-module, a non-callable, a non-tensor)."""


class CheckpointValueError(XlaWrapError, ValueError):
    """An argument has the right type but a value the API cannot use."""


class CheckpointError(XlaWrapError, RuntimeError):
    """Checkpointing cannot proceed without giving a wrong result (for example, the
    recomputation in backward did not reproduce the forward)."""


class BudgetUnreachableError(CheckpointValueError):
    """No checkpointing plan fits the memory budget; ``smallest_peak_bytes`` is the least
    compiled peak that the planner reached, the budget to ask for instead."""

    def __init__(self, message: str, smallest_peak_bytes: int) -> None:
        super().__init__(message)
        self.smallest_peak_bytes = smallest_peak_bytes


class BarriersStrippedWarning(UserWarning):
    """Checkpointing runs on XLA:CPU while XLA deletes optimization barriers: it will recompute
    but save no memory there."""


def describe(value: object) -> str:
    """A short description of a value for error messages: its type, and its shape for tensors."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__}(shape={tuple(shape)}, dtype={dtype})"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"
