"""`XLA_FLAGS`: read in one way, written in one place.

XLA reads the variable once, when the process creates its first XLA device; flags are
separated by whitespace and may be quoted as a shell would."""

from __future__ import annotations

import os
import shlex


def xla_flags(text: str | None = None) -> list[str]:
    """The flags in `text` (`XLA_FLAGS` from the environment when omitted), split as a shell
    would; split on whitespace where the quoting does not parse."""
    text = os.environ.get("XLA_FLAGS", "") if text is None else text
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote: XLA's own reader does not unquote either
        return text.split()


def flag_values(name: str, text: str | None = None) -> list[str]:
    """The values given to the flag `name` (`--xla_dump_to`), in order."""
    prefix = name + "="
    return [flag[len(prefix) :] for flag in xla_flags(text) if flag.startswith(prefix)]


def append_xla_flags(*flags: str) -> None:
    """Add `flags` to `XLA_FLAGS` in this process's environment (read by XLA at start)."""
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
