"""Running a test worker script in a fresh Python process.

SPMD must be switched on before a process's first XLA tensor, and tests/conftest.py makes one
at import, so tests of SPMD compositions run a worker script in a process of its own, without
the session's XLA flags and device count; the worker writes its results as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository
WORKERS = ROOT / "tests" / "workers"  # the worker scripts


def worker_env() -> dict[str, str]:
    """The environment of a worker process: this one's without the session's XLA flags and
    device count, with tests/ on the path for the shared models (tests/models.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CPU_NUM_DEVICES")}
    paths = [str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def run_worker(script: Path, out: Path, timeout: float = 300) -> dict[str, Any]:
    """Run ``python script out`` in a fresh process and return the JSON it wrote to ``out``."""
    env = worker_env()
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), f"{script.name} wrote nothing (rc {proc.returncode}):\n{proc.stderr}"
    results: dict[str, Any] = json.loads(out.read_text())
    return results
