"""Exceptions raised by xla_wrap.

Every message starts with the API that refused, says what it expected and what it got, and
how to fix it. Each class also derives from the built-in exception that fits, so callers that
catch `TypeError` or `RuntimeError` keep working.
"""

from __future__ import annotations


class XlaWrapError(Exception):
    """Base class of every error raised by xla_wrap."""


class CheckpointTypeError(XlaWrapError, TypeError):
    """An argument has the wrong type (a non-module, a non-callable, a non-tensor)."""


class CheckpointValueError(XlaWrapError, ValueError):
    """An argument has the right type but a value the API cannot use."""


class CheckpointError(XlaWrapError, RuntimeError):
    """Checkpointing cannot proceed without giving a wrong result.

    For example, the recomputation in backward did not reproduce the forward."""


def recomputation_differs(api: str, problem: str) -> CheckpointError:
    """The error for a recomputation that computed something else than its forward did."""
    return CheckpointError(
        f"{api}: the recomputation in backward {problem}. A checkpointed callable must "
        "compute the same thing when run again on the same inputs; branch on "
        "`xla_wrap.is_recomputing()` only for side effects, never for what it computes."
    )


class BudgetUnreachableError(CheckpointValueError):
    """No checkpointing plan fits the memory budget.

    Raised by [`xla_wrap.plan_checkpointing()`][xla_wrap.plan_checkpointing];
    `smallest_peak_bytes` is the least compiled peak that the planner reached, the budget to
    ask for instead.

    Args:
        message: The error message.
        smallest_peak_bytes: The least compiled peak the planner reached, in bytes.

    Attributes:
        smallest_peak_bytes: The least compiled peak the planner reached, in bytes: the
            smallest budget a plan can meet.
    """

    def __init__(self, message: str, smallest_peak_bytes: int) -> None:
        super().__init__(message)
        self.smallest_peak_bytes = smallest_peak_bytes


class BarriersStrippedWarning(UserWarning):
    """Checkpointing runs on XLA:CPU, whose compiler deletes optimization barriers.

    The step recomputes but saves no memory there: XLA:CPU removes the barriers
    (`cse_barrier_expander`) before common-subexpression elimination, which then merges the
    recomputation back into the forward. Accelerators keep the barriers. Given once per process;
    to see the saving on a CPU, start Python with
    `XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander`."""


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
