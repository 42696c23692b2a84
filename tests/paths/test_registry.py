"""The execution-path registry (xla_wrap/_paths/__init__.py): a path is looked up by device
type, and a path, or a composition, that is not in play costs nothing. Measured with the
bench's walk (`python -m xla_wrap.bench.walk`), which lists the package's functions one
training step through a checkpointed block runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xla_wrap.bench.walk import XLA_WRAP, walk

_NOT_EAGER = ("_paths/xla/", "_paths/compiled/", "_fsdp/")


def test_an_eager_step_runs_no_xla_compile_or_fsdp_code() -> None:
    names = walk("cpu", XLA_WRAP).names
    assert any(name.startswith("_core/engine.py:") for name in names)  # the walk sees the engine
    assert [name for name in names if name.startswith(_NOT_EAGER)] == []


@pytest.mark.xla
@pytest.mark.subprocess
def test_an_xla_step_without_fsdp_runs_the_xla_path_and_no_fsdp_code(tmp_path: Path) -> None:
    pytest.importorskip("torch_xla")
    # A fresh process: this one may have imported XLA FSDP (another test file), and then its
    # hook rightly runs.
    out = tmp_path / "walk.json"
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    command = [sys.executable, "-m", "xla_wrap.bench.walk", "--device", "xla", "--json", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = json.loads(out.read_text())[0]["names"]
    assert any(name.startswith("_paths/xla/path.py:XlaPath.barrier") for name in names)
    assert [name for name in names if name.startswith(("_fsdp/", "_paths/compiled/"))] == []


def test_a_device_type_without_a_path_of_its_own_runs_eager() -> None:
    from xla_wrap import internal

    assert internal.device_path(torch.device("cpu")).name == "eager"
    assert internal.device_path(torch.device("meta")).name == "eager"
    assert internal.device_path(torch.device("xla", 0)).name == "xla"
