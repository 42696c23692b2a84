"""Warnings that say a thing once per process, pointing at the user's line."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Hashable
from types import FrameType

from .state import process


def warn_once(
    key: Hashable,
    message: str,
    category: type[Warning] = UserWarning,
    *,
    stacklevel: int | None = None,
) -> None:
    """Warn with `message` the first time `key` comes, and never again in this process.

    The warning points at the first frame outside xla_wrap and torch (the user's line), or,
    with `stacklevel`, that many frames above the caller of this function (2: the caller's
    caller), as `warnings.warn()` counts them.
    """
    if key in process.warned:
        return
    level = caller_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(message, category, stacklevel=level)
    process.warned.add(key)  # after: a warning turned into an error raises every time


def caller_stacklevel() -> int:
    """The stacklevel, counted from the caller of this function, of the first frame outside
    xla_wrap and torch: where a warning should point."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("xla_wrap") or name.startswith("torch")):
            return level
        frame = frame.f_back
        level += 1
    return 1


def forget_warnings() -> None:
    """Let every warn-once warning warn again (for a test that checks one)."""
    process.warned.clear()
