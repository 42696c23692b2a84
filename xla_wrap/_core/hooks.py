"""Extension points of the checkpointing core for the compositions it knows nothing about.

The wrapper, the engine and `apply_activation_checkpointing` never ask which sharding
framework runs around them. A composition that must act on checkpoints (refuse a module it
owns, mark the recomputation for a framework that asks) subclasses `CheckpointHook` and
installs an instance once, at import: xla_wrap/_fsdp/units.py installs the FSDP units check
and the XLA FSDP recomputation hook, and the package imports it, so they are always in
place. Nothing else changes the list. (What a gradient loses across the barrier, an SPMD
sharding, is the execution path's business: `ExecutionPath.note_outputs`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

from torch import nn

from .._support.state import process


class CheckpointHook:
    """What a composition adds to checkpointing. Every method does nothing by default."""

    # The execution paths (`ExecutionPath.name`) on whose checkpoints `replaying` runs; None:
    # every path. A checkpoint on another path never calls this hook.
    device_types: frozenset[str] | None = None
    # The module (`sys.modules` name) of the library the hook is for; None: always. A
    # checkpoint taken while that library is not imported never calls this hook.
    library: str | None = None

    def check_module(self, api: str, module: nn.Module) -> None:
        """Raise if `module` must not be checkpointed; called before anything is wrapped."""

    def check_selection(
        self, api: str, wrap_policy: object, model: nn.Module, selected: Sequence[nn.Module]
    ) -> None:
        """Raise if a `wrap_policy` selecting `selected` in `model` is a mistake."""

    def replaying(self) -> AbstractContextManager[None]:
        """A context entered around each recomputation (after the recomputing flag is set,
        before the random generators are replayed)."""
        return nullcontext()


def install(hook: CheckpointHook) -> None:
    """Add `hook` to the hooks every checkpoint consults (once per hook)."""
    if hook not in process.hooks:
        process.hooks = (*process.hooks, hook)


def installed() -> tuple[CheckpointHook, ...]:
    """The installed hooks, in installation order."""
    return process.hooks
