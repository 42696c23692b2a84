"""See what XLA made of a step: its HLO, its barriers, its compiled peak memory.

Allocator statistics do not exist on XLA:CPU and, on TPU, show the end of a step rather than
its peak. The figure that does not lie is XLA's own buffer assignment: the total size of every
allocation after liveness-based packing, which XLA writes next to the optimized HLO when the
process starts with ``XLA_FLAGS=--xla_dump_to=DIR``. These functions read it back.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import _xla
from ._errors import CheckpointValueError

_TOTAL_BYTES = re.compile(r"^Total bytes used: (\d+)", re.MULTILINE)
_BUFFER_ASSIGNMENT_SUFFIX = "after_optimizations-buffer-assignment.txt"


@dataclass(frozen=True)
class CompiledProgram:
    """One program XLA compiled: its name, its peak bytes and its optimized HLO text."""

    name: str
    total_bytes: int
    optimized_hlo: str

    @property
    def total_mib(self) -> float:
        return self.total_bytes / 2**20

    def count(self, opcode: str) -> int:
        """How many instructions of ``opcode`` (``"dot"``, ``"convolution"``, ``"opt-barrier"``)
        the optimized program contains."""
        return count_instructions(self.optimized_hlo, opcode)


def pending_hlo(tensors: Sequence[torch.Tensor]) -> str:
    """The HLO text (before XLA's optimizations) of the pending computation of XLA ``tensors``."""
    torch_xla = _xla._loaded("torch_xla")
    if torch_xla is None or not all(_xla.is_xla_tensor(t) for t in tensors):
        raise CheckpointValueError(
            "xla_wrap.introspect.pending_hlo: expected tensors on an XLA device, got "
            f"{[str(t.device) for t in tensors]}. Move the computation to `torch_xla.device()`."
        )
    text: str = torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))
    return text


def count_instructions(hlo: str, opcode: str) -> int:
    """Count the instructions of ``opcode`` in HLO text."""
    return len(re.findall(rf"\s{re.escape(opcode)}\(", hlo))


def dump_directory(xla_flags: str | None = None) -> Path | None:
    """The ``--xla_dump_to`` directory of this process, or None when XLA is not dumping."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    for flag in shlex.split(flags):
        name, _, value = flag.partition("=")
        if name == "--xla_dump_to" and value:
            return Path(value)
    return None


def compiled_programs(step: Callable[[], Any]) -> list[CompiledProgram]:
    """Run ``step`` and return every program XLA compiled while it ran, largest peak first.

    ``step`` must end in (or be followed inside it by) ``torch_xla.sync()``. The process must
    have been started with ``XLA_FLAGS=--xla_dump_to=DIR``: XLA reads its flags once, at start-up.
    A program already compiled earlier in the process is served from the cache and not reported,
    so measure each configuration once per process (or with fresh shapes). The dump files read
    here are deleted.

    Raises:
        CheckpointValueError: If XLA is not dumping, or ``step`` compiled nothing.
    """
    directory = dump_directory()
    if directory is None:
        raise CheckpointValueError(
            "xla_wrap.introspect.compiled_programs: expected the process to start with "
            "XLA_FLAGS=--xla_dump_to=DIR, got XLA_FLAGS="
            f"{os.environ.get('XLA_FLAGS', '')!r}. Set it before starting Python."
        )
    before = set(directory.iterdir()) if directory.exists() else set()
    step()
    after = set(directory.iterdir()) if directory.exists() else set()
    new = sorted(after - before)
    programs = []
    for path in new:
        if not path.name.endswith(_BUFFER_ASSIGNMENT_SUFFIX):
            continue
        prefix = path.name[: -len(_BUFFER_ASSIGNMENT_SUFFIX)]
        match = _TOTAL_BYTES.search(path.read_text())
        hlo_path = path.with_name(prefix + "after_optimizations.txt")
        if match is None or not hlo_path.exists():
            continue
        programs.append(
            CompiledProgram(
                name=prefix.rstrip("."),
                total_bytes=int(match.group(1)),
                optimized_hlo=hlo_path.read_text(),
            )
        )
    for path in new:
        if path.is_file():
            path.unlink(missing_ok=True)
    if not programs:
        raise CheckpointValueError(
            "xla_wrap.introspect.compiled_programs: expected `step` to compile at least one "
            "program, got none (it was cached, or `step` did not call torch_xla.sync()). "
            "Measure each configuration once per process, and sync inside `step`."
        )
    return sorted(programs, key=lambda p: p.total_bytes, reverse=True)
