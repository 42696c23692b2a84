"""Test configuration.

XLA reads its flags once, when the first XLA device is created, so they are set here for the
whole session, before any test touches torch_xla:

* ``PJRT_DEVICE=CPU``: XLA:CPU, which runs on any machine;
* barriers kept (``--xla_disable_hlo_passes=cse_barrier_expander``): XLA:CPU otherwise deletes
  every optimization barrier and no checkpointing saves memory (docs/index.md);
* the concurrency-optimized scheduler pinned on (XLA:CPU's default), so memory figures do not
  move with the default;
* ``--xla_dump_to`` a temporary directory, from which ``xla_wrap.introspect`` reads XLA's buffer
  assignment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

_DUMP_DIR = tempfile.mkdtemp(prefix="xla_wrap_tests_dump_")
os.environ.setdefault("PJRT_DEVICE", "CPU")
# A dump directory inherited from a parent pytest (pytest-xdist's workers inherit the
# controller's environment) would mix two processes' programs: each process dumps to its own.
_INHERITED = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_dump_to")
]
os.environ["XLA_FLAGS"] = " ".join(
    [
        *_INHERITED,
        "--xla_disable_hlo_passes=cse_barrier_expander",
        "--xla_cpu_enable_concurrency_optimized_scheduler=true",
        f"--xla_dump_to={_DUMP_DIR}",
    ]
).strip()


# The XLA device must exist before the first backward of the process: PyTorch's autograd engine
# sizes its per-device queues when it first starts, and an XLA backward after an eager one
# otherwise fails with "device_ready_queues_ ... INTERNAL ASSERT FAILED".
try:
    import torch_xla
except ImportError:  # eager-only environments still run the eager tests
    torch_xla = None
if torch_xla is not None:
    torch_xla.device()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_DUMP_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def xla_device() -> torch.device:
    """The XLA:CPU device; tests that use it are skipped where torch_xla is not installed."""
    torch_xla = pytest.importorskip("torch_xla")
    return torch_xla.device()


@pytest.fixture(params=["cpu", "xla"])
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """Eager CPU and XLA:CPU, for behaviour that must hold on both."""
    if request.param == "cpu":
        yield torch.device("cpu")
    else:
        yield request.getfixturevalue("xla_device")
