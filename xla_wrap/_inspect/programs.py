"""What XLA made of a step, read back from its dumps and lazy graphs (the face is
[`xla_wrap.introspect`][xla_wrap.introspect])."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._paths import xla as _xla
from .._support.checks import check_record, check_text, is_function
from .._support.errors import CheckpointError, CheckpointTypeError, CheckpointValueError, describe
from .._support.flags import append_xla_flags, flag_values
from . import hlo as _hlo

# module_0003.SyncTensorsGraph.412.cpu_after_optimizations-buffer-assignment.txt
_BUFFER_ASSIGNMENT = re.compile(r"^(.*?)\.(?:\w+_)?after_optimizations-buffer-assignment\.txt$")


def hlo_flops(hlo: str) -> int:
    """Floating-point operations of the dot and convolution instructions in HLO text.

    Counting them in the *optimized* HLO of a training step shows what recomputation really
    costs: work XLA eliminated as dead code or merged away is not counted. A multiply-add
    counts 2; a While loop's body counts once per iteration where XLA annotated the trip count
    (`known_trip_count`), else once. Elementwise work, and matmuls a backend rewrote into
    custom calls (cuBLAS, oneDNN), are not counted.

    Args:
        hlo: HLO text: a module as XLA dumps it (`*after_optimizations.txt`,
            [`CompiledProgram.optimized_hlo`][xla_wrap.introspect.CompiledProgram]), as
            [`pending_hlo()`][xla_wrap.introspect.pending_hlo] returns it, or a fragment of
            instructions (each then counted once).

    Returns:
        The FLOP count; 0 for text without dots or convolutions.

    Raises:
        CheckpointTypeError: If `hlo` is not a string.

    Examples:
        >>> from xla_wrap import introspect
        >>> hlo = '''
        ... %a = f32[8,16]{1,0} parameter(0)
        ... %b = f32[16,4]{1,0} parameter(1)
        ... %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... '''
        >>> introspect.hlo_flops(hlo)  # 8 x 4 outputs, 16 multiply-adds each
        1024
    """
    return _hlo.flops(check_text("xla_wrap.introspect.hlo_flops", "hlo", hlo))


@dataclass(frozen=True)
class CompiledProgram:
    """One program XLA compiled, from its dumps.

    Attributes:
        name: XLA's module name as dumped (`module_0003.SyncTensorsGraph.412`).
        total_bytes: Peak device memory of the program (XLA's buffer assignment).
        argument_bytes: The part taken by the program's arguments (parameters, inputs).
        output_bytes: The part taken by its outputs.
        temporary_bytes: The rest: activations and other temporaries.
        optimized_hlo: The HLO text after XLA's optimizations.
    """

    name: str
    total_bytes: int
    argument_bytes: int
    output_bytes: int
    temporary_bytes: int
    optimized_hlo: str

    def __post_init__(self) -> None:
        check_record("xla_wrap.introspect.CompiledProgram", self)

    @property
    def total_mib(self) -> float:
        """`total_bytes` in MiB."""
        return self.total_bytes / 2**20

    @property
    def flops(self) -> int:
        """FLOPs of the program's dots and convolutions
        (see [`hlo_flops()`][xla_wrap.introspect.hlo_flops])."""
        return _hlo.flops(self.optimized_hlo)

    def count(self, opcode: str, *, reading: str | None = None) -> int:
        """How many instructions of `opcode` the optimized program contains.

        Opcodes as XLA spells them: `"dot"`, `"convolution"`, `"opt-barrier"`, `"all-gather"`.

        With `reading=`, only those that read an output of a `reading` instruction
        (through tuple access and pure data movement):
        `count("all-gather", reading="opt-barrier")` is the number of parameter re-gathers
        that the recomputation makes from barriered shards, separate from the forward's
        gathers.

        Args:
            opcode: The HLO opcode to count, as XLA spells it.
            reading: Another opcode; when given, only instructions that read its output
                count. `None` (the default) counts them all.

        Returns:
            The number of such instructions (see
            [`count_instructions()`][xla_wrap.introspect.count_instructions]).

        Raises:
            CheckpointTypeError: If `opcode` or `reading` is not a string.
        """
        api = "xla_wrap.introspect.CompiledProgram.count"
        check_text(api, "opcode", opcode)
        if reading is not None:
            check_text(api, "reading", reading)
        return _hlo.count_instructions(self.optimized_hlo, opcode, reading=reading)


def pending_hlo(tensors: Sequence[torch.Tensor]) -> str:
    """The HLO text, before XLA's optimizations, of the computation pending for XLA `tensors`.

    Nothing is compiled or executed: this is what the next `torch_xla.sync()` would compile
    for them (XLA may still eliminate or merge parts of it when it optimizes).

    Args:
        tensors: Lazy tensors on an XLA device whose computation is not executed yet.

    Returns:
        The HLO module text, operands printed with their shapes; it can be read with
        [`count_instructions()`][xla_wrap.introspect.count_instructions] and
        [`hlo_flops()`][xla_wrap.introspect.hlo_flops].

    Raises:
        CheckpointTypeError: If `tensors` is not a list of tensors.
        CheckpointValueError: If it is empty, torch_xla is not imported or a tensor is not on
            an XLA device.
    """
    api = "xla_wrap.introspect.pending_hlo"
    if not isinstance(tensors, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) for t in tensors
    ):
        raise CheckpointTypeError(f"{api}: expected a list of tensors, got {describe(tensors)}.")
    if not tensors:
        raise CheckpointValueError(
            f"{api}: expected at least one tensor, got an empty list. Pass the tensors whose "
            "pending computation to show (a step's loss, or its gradients)."
        )
    if _xla.loaded("torch_xla") is None or not all(_xla.is_xla_tensor(t) for t in tensors):
        raise CheckpointValueError(
            "xla_wrap.introspect.pending_hlo: expected tensors on an XLA device, got "
            f"{[str(t.device) for t in tensors]}. Move the computation to `torch_xla.device()`."
        )
    return _xla.pending_hlo_text(tensors)


def dump_directory(xla_flags: str | None = None) -> Path | None:
    """The `--xla_dump_to` directory of this process, or None when XLA is not dumping.

    Args:
        xla_flags: Flags to read, as in `XLA_FLAGS`; `None` (the default) reads this
            process's `XLA_FLAGS` environment variable.

    Returns:
        The directory of the first `--xla_dump_to` flag with a value, or `None` if there is
        none.

    Raises:
        CheckpointTypeError: If `xla_flags` is neither a string nor None.

    Examples:
        >>> from xla_wrap import introspect
        >>> introspect.dump_directory("--xla_dump_to=/tmp/dumps --xla_dump_hlo_as_text")
        PosixPath('/tmp/dumps')
        >>> introspect.dump_directory("") is None
        True
    """
    if xla_flags is not None:
        check_text("xla_wrap.introspect.dump_directory", "xla_flags", xla_flags)
    directories = [value for value in flag_values("--xla_dump_to", xla_flags) if value]
    return Path(directories[0]) if directories else None


def enable_compile_dumps(directory: str | os.PathLike[str] | None = None) -> Path:
    """Make XLA dump what it compiles, so that its compiled memory can be read.

    [`compiled_memory()`][xla_wrap.introspect.compiled_memory] and
    [`compiled_programs()`][xla_wrap.introspect.compiled_programs] read the dumps. Call it
    before the process creates its first XLA device: XLA reads `XLA_FLAGS` once. It appends
    `--xla_dump_to` to this process's `XLA_FLAGS` environment variable. If the
    process already dumps (`--xla_dump_to` in `XLA_FLAGS`), that directory is returned
    unchanged.

    Args:
        directory: Where XLA writes its dumps (made if missing). `None` (the default) makes
            a temporary directory, removed when the process exits.

    Returns:
        The dump directory.

    Raises:
        CheckpointTypeError: If `directory` is neither a path nor None.
        CheckpointError: If the XLA runtime has already started without dumps.
    """
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise CheckpointTypeError(
            "xla_wrap.introspect.enable_compile_dumps: expected a directory path (a str or "
            f"pathlib.Path) or None as `directory`, got {describe(directory)}."
        )
    existing = dump_directory()
    if existing is not None:
        return existing
    if _xla.runtime_started():
        raise CheckpointError(
            "xla_wrap.introspect.enable_compile_dumps: expected to run before the first XLA "
            "device is created, got a running XLA runtime (XLA has read its flags already). "
            "Call it at the top of the script, or start Python with "
            "XLA_FLAGS=--xla_dump_to=DIR."
        )
    if directory is None:
        path = Path(tempfile.mkdtemp(prefix="xla_wrap_dumps_"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    else:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
    append_xla_flags(f"--xla_dump_to={path}")
    return path


def compiled_programs(step: Callable[[], Any]) -> list[CompiledProgram]:
    """Run `step` and return every program XLA compiled while it ran, largest peak first.

    `step` must end with `torch_xla.sync()` (or otherwise execute its graph). A program
    compiled earlier in the process comes from the cache and is not reported: measure each
    configuration once per process. Every dump file the step produced is deleted.

    Args:
        step: Called once with no arguments: a training step on an XLA device, its graph
            executed before it returns.

    Returns:
        One [`CompiledProgram`][xla_wrap.introspect.CompiledProgram] per program compiled
        while `step` ran, sorted by `total_bytes`, largest first.

    Raises:
        CheckpointTypeError: If `step` is not a function.
        CheckpointValueError: If XLA is not dumping (see
            [`enable_compile_dumps()`][xla_wrap.introspect.enable_compile_dumps]) or the
            step compiled nothing.
    """
    return _programs("xla_wrap.introspect.compiled_programs", step)


def _programs(api: str, step: Callable[[], Any]) -> list[CompiledProgram]:
    """[`compiled_programs()`][xla_wrap.introspect.compiled_programs], with `api` naming the
    caller in errors."""
    if not is_function(step):
        raise CheckpointTypeError(
            f"{api}: expected the step as a function of no arguments, got {describe(step)}. "
            "Example: `compiled_memory(lambda: train_step(batch))`."
        )
    directory = dump_directory()
    if directory is None:
        raise CheckpointValueError(
            f"{api}: expected XLA to dump its compilations, got "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}. Call "
            "`introspect.enable_compile_dumps()` before the first XLA device is created, or "
            "start Python with XLA_FLAGS=--xla_dump_to=DIR."
        )
    before = _files(directory)
    step()
    new = sorted(_files(directory) - before)
    programs = []
    for path in new:
        match = _BUFFER_ASSIGNMENT.match(path.name)
        if match is None:
            continue
        assignment = _hlo.parse_buffer_assignment(path.read_text())
        hlo_path = path.with_name(path.name.replace("-buffer-assignment", ""))
        if assignment is None or not hlo_path.exists():
            continue
        programs.append(
            CompiledProgram(
                name=match.group(1),
                total_bytes=assignment.total,
                argument_bytes=assignment.arguments,
                output_bytes=assignment.outputs,
                temporary_bytes=assignment.temporaries,
                optimized_hlo=hlo_path.read_text(),
            )
        )
    for path in new:
        path.unlink(missing_ok=True)
    if not programs:
        raise CheckpointValueError(
            f"{api}: expected `step` to compile a program, got "
            "none (it came from the compilation cache, or `step` did not call "
            "torch_xla.sync()). Measure each configuration once per process, and sync inside "
            "`step`."
        )
    return sorted(programs, key=lambda p: p.total_bytes, reverse=True)


@dataclass(frozen=True)
class RecomputeCost:
    """What a checkpointed program computes beyond the plain one.

    Made by [`recompute_cost()`][xla_wrap.introspect.recompute_cost].

    Attributes:
        extra_dots: How many more dot instructions the checkpointed program has.
        extra_convolutions: How many more convolution instructions it has.
        extra_flops: How many more FLOPs its dots and convolutions compute.
        flops_ratio: Its dot and convolution FLOPs over the plain program's; `nan` when the
            plain program has none.
    """

    extra_dots: int
    extra_convolutions: int
    extra_flops: int
    flops_ratio: float

    def __post_init__(self) -> None:
        check_record("xla_wrap.introspect.RecomputeCost", self)


def recompute_cost(plain: CompiledProgram, checkpointed: CompiledProgram) -> RecomputeCost:
    """The dot and convolution work that checkpointing adds to a step.

    Both steps, with and without checkpointing, are read from their optimized HLO. Full
    recomputation adds at most one forward of the checkpointed blocks: a FLOP ratio of at
    most 4/3 when every block is checkpointed. A ratio of 1.0 means XLA merged the
    recomputation back into the forward (no barrier), and saved no memory either.

    Args:
        plain: The step without checkpointing, from
            [`compiled_memory()`][xla_wrap.introspect.compiled_memory].
        checkpointed: The same step with checkpointing.

    Returns:
        The differences, `checkpointed` minus `plain`, and the FLOP ratio.

    Raises:
        CheckpointTypeError: If `plain` or `checkpointed` is not a `CompiledProgram`.

    Examples:
        >>> cost = introspect.recompute_cost(plain, checkpointed)  # doctest: +SKIP
        >>> cost.flops_ratio  # doctest: +SKIP
        1.32
    """
    for name, program in (("plain", plain), ("checkpointed", checkpointed)):
        if not isinstance(program, CompiledProgram):
            raise CheckpointTypeError(
                f"xla_wrap.introspect.recompute_cost: expected a CompiledProgram as `{name}`, got "
                f"{describe(program)}. Pass what introspect.compiled_memory() returns."
            )
    plain_flops = plain.flops
    extra = checkpointed.flops - plain_flops
    return RecomputeCost(
        extra_dots=checkpointed.count("dot") - plain.count("dot"),
        extra_convolutions=checkpointed.count("convolution") - plain.count("convolution"),
        extra_flops=extra,
        flops_ratio=checkpointed.flops / plain_flops if plain_flops else float("nan"),
    )


def compiled_memory(step: Callable[[], Any]) -> CompiledProgram:
    """Run `step` and return the largest program it compiled: the step's compiled peak.

    As [`compiled_programs()`][xla_wrap.introspect.compiled_programs], which it calls: call
    [`enable_compile_dumps()`][xla_wrap.introspect.enable_compile_dumps] first, and measure
    each configuration once per process.

    Args:
        step: Called once with no arguments: a training step on an XLA device that ends with
            `torch_xla.sync()`.

    Returns:
        The program with the largest `total_bytes` compiled while `step` ran.

    Raises:
        CheckpointTypeError: If `step` is not a function.
        CheckpointValueError: If XLA is not dumping, or the step compiled nothing.
    """
    return _programs("xla_wrap.introspect.compiled_memory", step)[0]


def _files(directory: Path) -> set[Path]:
    if not directory.exists():
        return set()
    return {p for p in directory.iterdir() if p.is_file()}
