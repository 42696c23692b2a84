"""The benchmark: report logic on known numbers, and a smoke run of the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xla_wrap.bench.cli import parse_args
from xla_wrap.bench.report import compare, render_table


def test_compare_takes_ratios_against_none_and_checks_gradients(tmp_path: Path) -> None:
    grads = tmp_path / "ref.pt"
    torch.save([torch.ones(3)], grads)
    wrong = tmp_path / "wrong.pt"
    torch.save([torch.ones(3) * 2], wrong)
    base = {"model": "m", "flops": 100, "step_ms": 10.0}
    runs = [
        {**base, "variant": "none", "peak_bytes": 400, "floor_bytes": 100, "grads": str(grads)},
        {**base, "variant": "good", "peak_bytes": 200, "flops": 130, "grads": str(grads)},
        {**base, "variant": "wrong", "peak_bytes": 400, "step_ms": 20.0, "grads": str(wrong)},
        {"model": "m", "variant": "broken", "error": "AttributeError: boom"},
    ]
    compare(runs)
    _, good, wrong_run, broken = runs
    assert good["peak_ratio"] == 0.5 and good["floor_ratio"] == 2.0
    assert good["flops_ratio"] == 1.3 and good["grads_equal"] is True
    assert wrong_run["grads_equal"] is False and wrong_run["time_ratio"] == 2.0
    assert broken["runs"] is False and "peak_ratio" not in broken
    table = render_table(runs).splitlines()
    assert table[0].split()[:3] == ["model", "variant", "runs?"]
    assert table[2].split()[2:4] == ["yes", "yes"] and "0.50x" in table[2]
    assert "NO" in table[3].split()
    assert table[4].split()[2] == "no" and table[4].endswith("AttributeError: boom")


def test_without_a_reference_there_are_no_ratios_and_no_gradient_verdict() -> None:
    runs = [
        {"model": "m", "variant": "none", "error": "RuntimeError: reference broke"},
        {"model": "m", "variant": "xla_wrap", "peak_bytes": 2**20, "flops": 1, "step_ms": 1.0},
        {
            "model": "m",
            "variant": "other",
            "peak_bytes": 2**20,
            "flops": 1,
            "timing_error": "one step ran 2 XLA executions, expected 1",
        },
    ]
    compare(runs)
    assert runs[1]["peak_mib"] == 1.0 and "peak_ratio" not in runs[1]
    table = render_table(runs, caption="XLA:CPU, barriers kept").splitlines()
    assert table[0] == "XLA:CPU, barriers kept"
    assert table[3].split()[2:5] == ["yes", "-", "1.0"]  # not "NO": nothing to compare with
    assert table[4].endswith("timing: one step ran 2 XLA executions, expected 1")


@pytest.mark.subprocess
def test_a_worker_that_dies_is_reported_with_its_last_words(tmp_path: Path) -> None:
    from xla_wrap.bench.cli import spawn

    # An unknown task makes the worker die before writing a result.
    result = spawn({"task": "no-such-task"}, "", tmp_path, timeout=300)
    assert result["error"].startswith("process died (exit 1): KeyError")


def test_steps_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


def test_size_overrides_are_checked() -> None:
    from xla_wrap.bench.cli import sizes_for

    args = parse_args(["--size", "conv.channels=32"])
    assert sizes_for(args, ["conv"])["conv"]["channels"] == 32
    with pytest.raises(SystemExit, match="MODEL.KEY=N"):
        sizes_for(parse_args(["--size", "conv.depth=3"]), ["conv"])


@pytest.mark.xla
@pytest.mark.subprocess
def test_cli_smoke_run_writes_json_and_reports_crashes(tmp_path: Path) -> None:
    pytest.importorskip("torch_xla")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "xla_wrap.bench", "--quick", "--models", "conv"]
    command += ["--variants", "torch.utils.checkpoint,xla_wrap", "--steps", "2"]
    command += ["--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[4/4] conv / step times of 2 variants" in done.stdout  # progress, and the count
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["barriers_kept"] is True
    runs = {r["variant"]: r for r in report["runs"]}
    assert list(runs) == ["none", "torch.utils.checkpoint", "xla_wrap"]
    crashed = runs["torch.utils.checkpoint"]
    assert crashed["runs"] is False and crashed["error"].startswith("AttributeError")
    ours = runs["xla_wrap"]
    for key in ("peak_bytes", "flops", "step_ms", "peak_ratio", "flops_ratio", "time_ratio"):
        assert isinstance(ours[key], (int, float)), key
    assert ours["step_ms"] > 0 and runs["none"]["step_ms"] > 0
    assert ours["grads_equal"] is True and ours["recompiles"] == 0 and ours["barriers"] >= 2
    assert 1.0 < ours["flops_ratio"] <= 4 / 3
    assert runs["none"]["floor_bytes"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_the_sharded_model_takes_a_divisible_batch_and_the_tools_that_run_on_xla() -> None:
    from xla_wrap.bench.cli import sizes_for, variants_for

    with pytest.raises(SystemExit, match=r"multiple of 4"):
        sizes_for(parse_args(["--size", "transformer-fsdpv2.batch=6"]), ["transformer-fsdpv2"])
    every = ["none", "torch.utils.checkpoint", "torch_xla.utils.checkpoint", "xla_wrap"]
    assert variants_for("transformer", every) == every
    assert variants_for("transformer-fsdpv2", [*every, "xla_wrap scan"]) == [
        "none",
        "torch_xla.utils.checkpoint",
        "xla_wrap",
        "xla_wrap scan",
    ]


def test_the_save_policy_and_scan_run_on_the_transformer_and_comparisons_on_request() -> None:
    from xla_wrap.bench.cli import DEFAULT_VARIANTS, variants_for

    default = DEFAULT_VARIANTS.split(",")
    assert "xla_wrap dots_saveable" in default and "xla_wrap scan" in default
    assert "torch_xla scan_layers" not in default
    for variant in ("xla_wrap dots_saveable", "xla_wrap scan"):
        assert variant in variants_for("transformer", default)
        assert variant not in variants_for("conv", default)


def test_the_transformer_can_keep_its_mask_as_a_buffer_with_the_same_loss() -> None:
    from xla_wrap.bench.cli import QUICK_SIZES
    from xla_wrap.bench.models import build

    as_argument = build("transformer", QUICK_SIZES["transformer"])
    as_buffer = build("transformer", {**QUICK_SIZES["transformer"], "mask_buffer": 1})
    assert as_buffer.kwargs == {} and "mask" in as_argument.kwargs
    for block in as_buffer.blocks:
        assert torch.equal(dict(block.named_buffers())["mask"], as_argument.kwargs["mask"])
    # Not persistent: the two load each other's checkpoints.
    assert as_buffer.model.state_dict().keys() == as_argument.model.state_dict().keys()
    for workload in (as_argument, as_buffer):
        workload.model.eval()  # no Dropout: the two must compute the same loss
    loss = as_argument.model(*as_argument.args, **as_argument.kwargs)
    assert torch.equal(as_buffer.model(*as_buffer.args), loss)


def test_the_depth_sweep_runs_loops_against_scans_at_each_depth() -> None:
    from xla_wrap.bench.cli import variant_groups
    from xla_wrap.bench.variants import DEPTH_VARIANTS

    args = parse_args(["--depth", "12,48"])
    groups = variant_groups(args, ["transformer"], ["none"], explicit=False)
    assert [(label, model) for label, model, _, _ in groups] == [
        ("transformer, 12 blocks", "transformer"),
        ("transformer, 48 blocks", "transformer"),
    ]
    for (_, _, sizes, variants), depth in zip(groups, (12, 48), strict=True):
        assert sizes["blocks"] == depth and sizes["mask_buffer"] == 1
        assert sizes["dropout_pct"] == 0  # torch_xla's scan_layers crashes with Dropout
        assert variants == list(DEPTH_VARIANTS)
    chosen = parse_args(["--depth", "4", "--size", "transformer.dropout_pct=10"])
    [(_, _, sizes, variants)] = variant_groups(chosen, ["transformer"], ["none", "xla_wrap"], True)
    assert sizes["dropout_pct"] == 10 and variants == ["none", "xla_wrap"]
    with pytest.raises(SystemExit):
        parse_args(["--depth", "12,0"])


def test_the_compile_section_measures_the_variants_and_the_openxla_barriers(
    tmp_path: Path,
) -> None:
    """``--compile``: inductor on the CPU; the checkpoints reach the compiler (tags, fewer
    bytes saved than without, PyTorch's own bytes), dots_saveable recomputes no matmul, and
    every variant's gradients are the uncheckpointed compiled model's."""
    from xla_wrap.bench.cli import main

    assert main(["--compile", "--quick", "--steps", "1", "--out", str(tmp_path)]) == 0
    runs = {r["variant"]: r for r in json.loads((tmp_path / "compile.json").read_text())["runs"]}
    none, torch_own, ours, dots = (
        runs[v] for v in ("none", "torch checkpoint_wrapper", "xla_wrap", "xla_wrap dots_saveable")
    )
    assert all(r["graph_breaks"] == 0 and r["grads_equal"] for r in runs.values())
    assert ours["saved_bytes"] == torch_own["saved_bytes"] < none["saved_bytes"]
    assert ours["backward_matmuls"] == torch_own["backward_matmuls"] > none["backward_matmuls"]
    assert dots["backward_matmuls"] == none["backward_matmuls"]
    assert ours["recompute_tags"] > 0 == none["recompute_tags"]
    assert all(r["compile_s"] > 0 and r["step_ms"] > 0 for r in runs.values())
    # The depth sweep: a scanned stack is one region per layer on aot_eager (where torch has
    # regions), the loop on inductor, and computes what the loop does; at this tiny size one
    # activation more than the loop saves is 6% (the bench's sizes: docs/compile.md).
    from xla_wrap.internal import has_layer_regions

    sweep = json.loads((tmp_path / "compile.json").read_text())["sweep"]
    scans = {r["backend"]: r for r in sweep if r["variant"] == "ScannedLayers"}
    assert scans["aot_eager"]["one_region_per_layer"] is has_layer_regions()
    assert scans["inductor"]["one_region_per_layer"] is False
    assert all(r["grads_equal_loop"] and abs(r["saved_vs_loop"] - 1) <= 0.1 for r in sweep)
    # The budget row: xla_wrap's plan saves at most half the unplanned step's bytes,
    # recomputing to get there, and PyTorch's solver is measured beside it, saving less than
    # none (the refusal of an unreachable budget: tests/plan/test_compiled_plan.py).
    budgets = {
        (r["solver"], r["fraction"]): r
        for r in json.loads((tmp_path / "compile.json").read_text())["budgets"]
    }
    unplanned = budgets["none", 1.0]
    ours, theirs = budgets["xla_wrap plan", 0.5], budgets["activation_memory_budget", 0.5]
    assert theirs["saved_bytes"] < unplanned["saved_bytes"]
    assert "least_bytes" not in ours
    assert ours["saved_bytes"] <= 0.5 * unplanned["saved_bytes"]
    assert ours["backward_matmuls"] > unplanned["backward_matmuls"] and ours["plan"]
    # torch_xla's Dynamo backend, where installed: TorchTPU's leaf barriers keep no saving,
    # the region barriers do, alone or with the leaf ones.
    openxla = json.loads((tmp_path / "compile.json").read_text())["openxla"]
    if importlib.util.find_spec("torch_xla") is None:
        assert openxla == []
        return
    peak = {r["variant"]: r["peak_mib"] for r in openxla}
    assert len(openxla) == 6 and all(r["grads_equal"] for r in openxla)
    assert peak["xla_wrap, leaf barriers"] > 0.9 * peak["xla_wrap, openxla"]
    assert peak["xla_wrap, openxla_backend"] < 0.9 * peak["xla_wrap, leaf barriers"]
    assert peak["xla_wrap, region + leaf"] < 0.9 * peak["xla_wrap, leaf barriers"]


def test_the_walk_through_one_checkpoint_counts_the_package_and_pytorch_functions() -> None:
    """``xla_wrap.bench.walk`` on eager CPU: the step enters the wrapper's forward, and PyTorch's
    count is taken over its own two files."""
    from xla_wrap.bench.walk import PYTORCH, XLA_WRAP, render, walk

    ours = walk("cpu", XLA_WRAP)
    assert ours.files > 0 and ours.folders > 0 and ours.functions == len(ours.names) > 0
    assert any(name.endswith(":CheckpointWrapper.forward") for name in ours.names)
    assert not any(name.startswith("bench/") for name in ours.names)
    pytorch = walk("cpu", PYTORCH)
    assert pytorch.functions > 0 and pytorch.files <= 2
    assert all(name.startswith("torch/") for name in pytorch.names)
    assert render([ours, pytorch]).splitlines()[2].startswith("| xla_wrap.checkpoint_wrapper |")


def test_the_host_times_of_the_three_variants_come_with_equal_gradients() -> None:
    from xla_wrap.bench.host import VARIANTS, measure, render

    threads = torch.get_num_threads()
    times = measure(blocks=2, width=8, steps=3, warmup=1)
    assert torch.get_num_threads() == threads  # put back
    assert list(times.median_ms) == list(VARIANTS) and len(VARIANTS) == 3
    assert all(ms > 0 for ms in times.median_ms.values())
    assert times.grads_equal == {v: True for v in VARIANTS[1:]}
    assert "gradients equal to unwrapped (bitwise)" in render([times])
