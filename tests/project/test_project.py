"""The project around the library: import without torch_xla, and the examples."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _workers import ROOT

_WITHOUT_TORCH_XLA = """
import sys

attempts = []


class NoTorchXla:
    # Record every attempt to import torch_xla and make it fail, as if it were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch_xla":
            attempts.append(name)
            raise ImportError("torch_xla is not installed here")
        return None


sys.meta_path.insert(0, NoTorchXla())
import torch, xla_wrap
block = xla_wrap.checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout()))
x = torch.randn(2, 4, requires_grad=True)
block(x).sum().backward()
y, = xla_wrap.optimization_barrier(x)
assert y is x and x.grad is not None and block[0].weight.grad is not None
assert attempts == [], attempts
print("ok")
"""


def _run_example(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>`` with ``args`` in a fresh Python, with XLA's flags and device
    count left to the example, and require it to succeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CPU_NUM_DEVICES")}
    command = [sys.executable, str(ROOT / "examples" / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_installed_version_is_the_packages_one() -> None:
    # One version, written once: pyproject.toml reads xla_wrap.__version__.
    import importlib.metadata

    import xla_wrap

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("xla_wrap") == xla_wrap.__version__


@pytest.mark.subprocess
def test_import_and_eager_features_work_without_torch_xla() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH_XLA], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.subprocess
@pytest.mark.xla
def test_conv_stack_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example("conv_stack.py", "--blocks=3", "--channels=16", "--size=8", "--batch=2")
    assert "xla_wrap: compiling and running" in done.stdout  # progress is shown
    lines = {line[:28].strip(): line[28:].split() for line in done.stdout.splitlines()}
    plain_barriers, our_barriers = map(int, lines["optimization barriers"])
    assert plain_barriers == 0 and our_barriers >= 2
    plain_flops, our_flops = map(float, lines["MFLOPs per step"])
    assert our_flops > plain_flops
    assert "gradients equal: yes" in done.stdout


@pytest.mark.subprocess
@pytest.mark.xla
def test_save_policies_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example("save_policies.py", "--blocks=3", "--dim=32", "--seq=16", "--batch=2")
    assert "dots_saveable: compiling and running" in done.stdout  # progress is shown
    rows = {line[:32].strip(): line[32:].split() for line in done.stdout.splitlines()}
    peak = {name: float(rows[name][0]) for name in rows if len(rows[name]) == 4}
    flops = {name: float(rows[name][2].rstrip("x")) for name in peak}
    assert all(rows[name][3] == "yes" for name in peak)  # same loss and gradients
    full, dots = "full recomputation", "dots_saveable"
    assert flops[full] > 1.0 and flops[dots] == 1.0  # keeping the products recomputes none
    assert peak[full] < peak[dots] < peak["no checkpointing"]


@pytest.mark.subprocess
@pytest.mark.xla
def test_gradient_penalty_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example("gradient_penalty.py", "--blocks=2", "--dim=32", "--seq=16", "--batch=2")
    assert "penalty step, xla_wrap: compiling and running" in done.stdout  # progress is shown
    rows = {line[:36].strip(): line[36:].split() for line in done.stdout.splitlines()}
    table = {name: row for name, row in rows.items() if len(row) == 3 and row[2] in ("yes", "NO")}
    assert len(table) == 4 and all(row[2] == "yes" for row in table.values())
    dots = {name: int(row[1]) for name, row in table.items()}
    # One extra forward per block, in both steps: each block's first product (its second one
    # is dead code XLA drops: backward reads only that layer's input).
    for step in ("plain step", "penalty step"):
        checkpointed, plain = dots[f"{step}, xla_wrap"], dots[f"{step}, no checkpointing"]
        assert checkpointed == plain + 2


@pytest.mark.subprocess
@pytest.mark.xla
def test_scan_stack_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example(
        "scan_stack.py", "--blocks=3", "--dim=32", "--seq=16", "--batch=2", "--steps=4"
    )
    assert "scanned stack: compiling and running" in done.stdout  # progress is shown
    rows = {line[:20].strip(): line[20:].split() for line in done.stdout.splitlines()}
    loop = rows["checkpointed loop"]
    for scan in (rows["scanned stack"], rows["stacked parameters"]):
        assert float(scan[3]) == pytest.approx(float(loop[3]), rel=1e-5)  # the same loss
        assert all(float(v) > 0 for v in (*scan[:3], *loop[:3]))  # compile s, trace ms, peak
    differences = [part.split()[0] for part in done.stdout.split("largest: ")[1:]]
    assert len(differences) == 2 and all(float(d) < 1e-4 for d in differences)
    curves = [
        [float(v) for v in part.split("]")[0].split(",")]
        for part in done.stdout.split("losses [")[1:]
    ]
    assert len(curves) == 3 and all(len(c) == 4 for c in curves)
    for curve in curves:  # all train, with Dropout
        assert curve[-1] < curve[0]


@pytest.mark.subprocess
@pytest.mark.xla
def test_compiled_openxla_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example("compiled_openxla.py", "--blocks=2", "--dim=32", "--seq=32", "--batch=4")
    assert "[4/6] xla_wrap, openxla_backend: compiling and running" in done.stdout
    table = done.stdout.split("gradients equal\n")[1]
    rows = {line[:32].strip(): line[32:].split() for line in table.splitlines()}
    peak, dots, barriers, equal = (
        {name: row[i] for name, row in rows.items() if len(row) == 4} for i in range(4)
    )
    assert len(equal) == 6 and set(equal.values()) == {"yes"}
    none, plain_backend = "no checkpointing", "xla_wrap, openxla"
    ours, dots_saveable = "xla_wrap, openxla_backend", "dots_saveable, openxla_backend"
    leaves, both = "xla_wrap, leaf barriers", "xla_wrap, region + leaf"
    assert barriers[none] == barriers[plain_backend] == "0"
    assert int(barriers[ours]) >= 1 and int(barriers[dots_saveable]) >= 1
    assert int(barriers[leaves]) > int(barriers[ours])
    assert int(barriers[both]) == int(barriers[leaves]) + int(barriers[ours])
    assert int(dots[ours]) > int(dots[none]) == int(dots[dots_saveable])  # products kept
    assert float(peak[ours]) < float(peak[plain_backend]) < float(peak[none])
    # the leaf barriers order nothing after the gradient; the region barriers still do with them
    assert float(peak[leaves]) > 0.9 * float(peak[plain_backend])
    assert float(peak[both]) < 0.9 * float(peak[leaves])


@pytest.mark.subprocess
@pytest.mark.xla
def test_plan_budget_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example(
        "plan_budget.py", "--budget=0.8", "--blocks=2", "--dim=16", "--seq=32", "--batch=4",
        "--steps=2",
    )  # fmt: skip
    assert "xla_wrap.plan_checkpointing: compile 1, the unplanned step" in done.stderr
    budget, peak = re.search(
        r"budget ([\d.]+) MiB; compiled peak ([\d.]+) MiB", done.stdout
    ).groups()
    assert float(peak) <= float(budget)
    assert re.search(r"^blocks\.0\s+(none|dots_saveable|full)\s", done.stdout, re.MULTILINE)
    difference = float(done.stdout.split("largest relative loss difference: ")[1].split()[0])
    assert difference < 1e-5  # the plan trains as the unplanned model does, Dropout included


@pytest.mark.parametrize(
    ("example", "option"),
    [
        ("plan_budget.py", "--budget"),
        ("conv_stack.py", "--blocks"),
        ("fsdp_transformer.py", "--layers"),
        ("digits_barrier.py", "--epochs"),
        ("hf_llama.py", "--steps"),
        ("hf_trainer.py", "--sft"),
        ("save_policies.py", "--blocks"),
        ("gradient_penalty.py", "--blocks"),
        ("scan_stack.py", "--blocks"),
        ("compiled_openxla.py", "--blocks"),
    ],
)
def test_example_help_runs_without_starting_xla(example: str, option: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and option in done.stdout


@pytest.mark.subprocess
@pytest.mark.xla
def test_fsdp_transformer_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    done = _run_example(
        "fsdp_transformer.py",
        "--layers=2",
        "--dim=32",
        "--heads=2",
        "--seq=16",
        "--batch=8",
        "--vocab=16",
        "--steps=3",
    )
    assert "FSDPv2 + xla_wrap: step 3/3" in done.stdout  # progress is shown
    curve = [line.split() for line in done.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(curve) == 3
    for _, plain, ours in curve:
        assert float(ours) == pytest.approx(float(plain), abs=1e-5)
    assert float(curve[-1][1]) < float(curve[0][1])  # it trains
    table = {line[:36].strip(): line[36:].split() for line in done.stdout.splitlines()}
    plain_peak, our_peak = map(float, table["compiled peak (MiB)"])
    assert our_peak < plain_peak
    plain_regathers, our_regathers = map(int, table["of barriered shards (re-gathers)"])
    assert plain_regathers == 0 and our_regathers >= 2


@pytest.mark.subprocess
@pytest.mark.xla
def test_digits_barrier_example_converges_alike_in_a_short_run() -> None:
    pytest.importorskip("torch_xla")
    pytest.importorskip("sklearn")
    done = _run_example("digits_barrier.py", "--epochs=6", "--train=640")
    assert "checkpoint_wrapper blocks: epoch 6/6" in done.stdout  # progress is shown
    rows = [line.rsplit(None, 2) for line in done.stdout.splitlines() if line.endswith("%")]
    accuracy = {name.strip(): float(value.rstrip("%")) for name, _, value in rows}
    assert set(accuracy) == {"plain", "barrier on logits", "checkpoint_wrapper blocks"}
    # 6 short epochs reach about 92% (the full run about 98%); the three train alike.
    assert min(accuracy.values()) >= 85.0
    assert max(accuracy.values()) - min(accuracy.values()) <= 3.0


@pytest.mark.subprocess
@pytest.mark.xla
def test_hf_llama_example_smallest_configuration(tmp_path: Path) -> None:
    pytest.importorskip("torch_xla")
    pytest.importorskip("transformers")
    done = _run_example(
        "hf_llama.py",
        "--steps=4",
        "--layers=2",
        "--width=32",
        "--seq=32",
        "--batch=4",
        f"--out={tmp_path / 'loss.png'}",
    )
    assert "xla_wrap: step 4/4" in done.stdout  # progress is shown
    _assert_same_curves_and_a_lower_peak(done.stdout, steps=4, abs=1e-5)
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.subprocess
@pytest.mark.xla
def test_hf_trainer_example_smallest_configuration() -> None:
    pytest.importorskip("torch_xla")
    pytest.importorskip("accelerate")
    done = _run_example("hf_trainer.py", "--steps=2", "--layers=2")
    assert "flag on, xla_wrap installed: compiling and training 2 steps" in done.stdout
    _assert_same_curves_and_a_lower_peak(done.stdout, steps=2, rel=1e-5)


def _assert_same_curves_and_a_lower_peak(stdout: str, steps: int, **tolerance: float) -> None:
    """An example's table of two loss curves ("step plain ours") agrees within ``tolerance``,
    and its "compiled peak (MiB): plain P, ours Q" line has Q below P."""
    curve = [line.split() for line in stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(curve) == steps
    for _, plain, ours in curve:
        assert float(ours) == pytest.approx(float(plain), **tolerance)
    peaks = next(line for line in stdout.splitlines() if line.startswith("compiled peak"))
    plain_peak, our_peak = (float(part.split()[-1]) for part in peaks.split(":")[1].split(","))
    assert our_peak < plain_peak


def test_public_classes_resolve_their_annotations_and_errors_pickle_by_the_public_name() -> None:
    """Classes moved into rooms keep working with the tools that read them: typing resolves the
    dataclasses' annotations (configuration tools do), and an error pickles and prints as
    ``xla_wrap.CheckpointError`` wherever it lives."""
    import pickle
    import typing

    import xla_wrap

    assert "policy" in typing.get_type_hints(xla_wrap.CheckpointOptions)
    assert "choices" in typing.get_type_hints(xla_wrap.CheckpointPlan)
    error = pickle.loads(pickle.dumps(xla_wrap.CheckpointValueError("x")))
    assert type(error) is xla_wrap.CheckpointValueError
    assert f"{type(error).__module__}.{type(error).__qualname__}" == "xla_wrap.CheckpointValueError"
