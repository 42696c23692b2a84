"""Deprecated: [`xla_wrap.wrap_policies`][xla_wrap.wrap_policies] under its old name.

`xla_wrap.wrap` read as the inverse of [`xla_wrap.unwrap()`][xla_wrap.unwrap], which it is
not: it holds wrap policies, the rules that select which submodules to checkpoint. Every name
still works here and warns with a `DeprecationWarning`.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import wrap_policies as _wrap_policies

__all__ = _wrap_policies.__all__


def __getattr__(name: str) -> Any:
    value = getattr(_wrap_policies, name)  # AttributeError names the module and the attribute
    warnings.warn(
        f"xla_wrap.wrap is now xla_wrap.wrap_policies: use xla_wrap.wrap_policies.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
