"""`python -m xla_wrap.bench.walk`: how long is the walk through one checkpoint.

Counts which of xla_wrap's own functions run during one training step (forward and
`loss.backward()`, after one warm-up step) of a two-block MLP with Dropout whose second block
is wrapped by [`xla_wrap.checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] with its
defaults, and the same for PyTorch's `checkpoint_wrapper` (eager CPU) over its wrapper file
and `torch/utils/checkpoint.py`.

Every Python function entered counts once (`sys.setprofile`, "call" events, by
`(file, first line, qualified name)`), comprehensions and lambdas included, modules' own code
not. xla_wrap's count covers the package's files but its `bench/`. Both steps run with
`torch.autograd.set_multithreading_enabled(False)`: the backward of XLA tensors would
otherwise run on autograd's device thread, which `sys.setprofile` does not see (on eager CPU
the backward runs on the calling thread either way).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import xla_wrap

PACKAGE = Path(xla_wrap.__file__).resolve().parent
TORCH_ROOT = Path(torch.__file__).resolve().parent.parent  # names read "torch/utils/..."

XLA_WRAP = "xla_wrap.checkpoint_wrapper"
PYTORCH = "torch checkpoint_wrapper"
# Functions entered: (file, first line, qualified name).
_Entered = set[tuple[str, int, str]]
_NOT_DEFS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


@dataclass
class Walk:
    """The functions one training step entered, within the files counted.

    Attributes:
        wrapper: Which checkpoint wrapper the model used.
        device: `"cpu"` (eager) or `"xla"`.
        files: Distinct files the functions are in.
        functions: Distinct functions.
        defs: Those of them written with `def` (no comprehension, generator expression or
            lambda).
        folders: Distinct folders of those files (`"."` for the root the names start from).
        names: `file:function` of each function, sorted.
    """

    wrapper: str
    device: str
    files: int
    functions: int
    defs: int
    folders: int
    names: list[str]


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 16))


def _nothing() -> None:
    pass


def _pytorch_wrapper() -> Callable[[nn.Module], nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper


def _namer(root: Path, counted: Callable[[Path], bool]) -> Callable[[str], str | None]:
    """Maps a code object's file name to its path under `root`, or None if not counted."""
    cache: dict[str, str | None] = {}

    def name(filename: str) -> str | None:
        if filename not in cache:
            path = Path(filename).resolve()
            cache[filename] = path.relative_to(root).as_posix() if counted(path) else None
        return cache[filename]

    return name


def _trace(step: Callable[[], None], name: Callable[[str], str | None]) -> _Entered:
    """Runs `step` under `sys.setprofile`; returns the (file, line, qualname) entered."""
    seen: _Entered = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            qualname = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
            seen.add((code.co_filename, code.co_firstlineno, qualname))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(previous)
    return {
        (file, line, qualname)
        for filename, line, qualname in seen
        if qualname != "<module>" and (file := name(filename)) is not None
    }


def _summary(wrapper: str, device: str, entered: _Entered) -> Walk:
    files = {file for file, _, _ in entered}
    folders = {Path(file).parent.as_posix() for file in files}
    names = sorted(f"{file}:{qualname}" for file, _, qualname in entered)
    defs = sum(not qualname.endswith(_NOT_DEFS) for _, _, qualname in entered)
    return Walk(wrapper, device, len(files), len(entered), defs, len(folders), names)


def walk(device: str = "cpu", wrapper: str = XLA_WRAP) -> Walk:
    """Counts the functions of the wrapper's own code that one training step runs.

    Args:
        device: `"cpu"` for eager CPU, `"xla"` for `torch_xla.device()` with a
            `torch_xla.sync()` ending each step (PyTorch's wrapper: `"cpu"` only).
        wrapper: `"xla_wrap.checkpoint_wrapper"` (counts xla_wrap's files but `bench/`) or
            `"torch checkpoint_wrapper"` (counts PyTorch's wrapper file and
            `torch/utils/checkpoint.py`).

    Returns:
        The counts and the sorted `file:function` names.

    Raises:
        ValueError: For an unknown wrapper or device, or PyTorch's wrapper on XLA.

    Note:
        On XLA, the XLA device must exist before the process's first backward (PyTorch's
        autograd engine sizes its device queues then): walk XLA first, or call
        `torch_xla.device()` before walking on the CPU.
    """
    if device not in ("cpu", "xla") or (wrapper == PYTORCH and device != "cpu"):
        raise ValueError(f"walk: no {wrapper} on device {device!r}")
    if wrapper == XLA_WRAP:
        wrap: Callable[[nn.Module], nn.Module] = xla_wrap.checkpoint_wrapper
        bench = PACKAGE / "bench"
        name = _namer(PACKAGE, lambda p: p.is_relative_to(PACKAGE) and not p.is_relative_to(bench))
    elif wrapper == PYTORCH:
        wrap = _pytorch_wrapper()
        from torch.utils import checkpoint as torch_checkpoint

        mine = {Path(sys.modules[wrap.__module__].__file__ or "").resolve()}
        mine.add(Path(torch_checkpoint.__file__).resolve())
        name = _namer(TORCH_ROOT, mine.__contains__)
    else:
        raise ValueError(f"walk: unknown wrapper {wrapper!r}")

    torch.manual_seed(0)
    model = nn.Sequential(_block(), wrap(_block()))
    x = torch.randn(4, 16)
    sync: Callable[[], None] = _nothing
    if device == "xla":
        import torch_xla

        model, x = model.to(torch_xla.device()), x.to(torch_xla.device())
        sync = torch_xla.sync

    def step() -> None:
        loss = model(x).sum()
        loss.backward()
        sync()

    with torch.autograd.set_multithreading_enabled(False):
        step()  # warm-up: first-call caches, lazy imports, XLA's first compilation
        entered = _trace(step, name)
    return _summary(wrapper, device, entered)


def render(walks: Sequence[Walk]) -> str:
    """A Markdown table of the counts, then each walk's function names."""
    lines = [
        "| wrapper | device | files | functions | of them defs | folders |",
        "|---|---|--:|--:|--:|--:|",
        *(
            f"| {w.wrapper} | {w.device} | {w.files} | {w.functions} | {w.defs} | {w.folders} |"
            for w in walks
        ),
    ]
    for w in walks:
        lines += ["", f"{w.wrapper} on {w.device}, {w.functions} functions:", *w.names]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m xla_wrap.bench.walk [--device cpu|xla] [--json PATH]`."""
    parser = argparse.ArgumentParser(
        prog="python -m xla_wrap.bench.walk",
        description="Counts xla_wrap's and PyTorch's functions in one checkpointed step.",
    )
    parser.add_argument("--device", choices=("cpu", "xla"), default="cpu")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the walks here")
    args = parser.parse_args(argv)
    walks = [walk(args.device, XLA_WRAP), walk("cpu", PYTORCH)]
    print(f"xla_wrap from {xla_wrap.__file__}; torch {torch.__version__}")
    print(render(walks))
    if args.json:
        args.json.write_text(json.dumps([asdict(w) for w in walks], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
