"""SPMD FSDPv2 on a 4-device virtual XLA:CPU mesh, for tests/fsdp/test_fsdp_spmd.py.

SPMD must be switched on before the process makes its first XLA tensor, and tests/conftest.py
makes one at import, so the test runs this file in a fresh process
(``PYTHONPATH=tests python tests/workers/spmd_fsdp.py OUT.json``). It is not a test module and
never imports conftest. Barriers are kept and XLA dumps what it compiles, so the compiled peak
and the all-gathers are read from XLA's own buffer assignment and optimized HLO.

Each composition builds the same 4-block model from the same seed, runs one training step with
the same Dropout seed, and records: the loss, the gradients by parameter name, which calls of
each block were recomputations, the step's compiled peak, all-gathers, and all-gathers of
barriered shards (the recomputation's re-gathers), and whether running the step again compiled
anything.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = str(DEVICES := 4)
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_disable_hlo_passes=cse_barrier_expander "
    "--xla_cpu_enable_concurrency_optimized_scheduler=true"
).strip()

# torch_xla reads the environment above when it is imported.
import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)

import xla_wrap
from xla_wrap import fsdp, internal, introspect, wrap_policies

import models

introspect.enable_compile_dumps()
xr.use_spmd()  # before any XLA tensor exists

# Rows are many next to the width, so the partitioner gathers weights (FSDP) rather than
# activations; a short, wide batch would turn FSDPv2 into tensor parallelism.
WIDTH, HIDDEN, DEPTH, BATCH = 64, 256, 4, 2048


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Net(models.Net):
    def __init__(self) -> None:
        super().__init__((Block() for _ in range(DEPTH)), WIDTH)


def _auto(unit: Callable[..., nn.Module] | None) -> Callable[[Net], nn.Module]:
    def build(net: Net) -> nn.Module:
        policy = fsdp.auto_wrap_policy(wrap_policies.by_type(Block), net)
        if unit is None:
            return FSDPv2(net, auto_wrap_policy=policy)
        return FSDPv2(net, auto_wrap_policy=policy, auto_wrapper_callable=unit)

    return build


def _planned(net: Net) -> nn.Module:
    """Planned on the unsharded model for a budget halfway between the smallest reachable peak
    and the unplanned one; FSDPv2's auto-wrapping builds each unit as the plan says."""
    device = torch_xla.device()
    net = net.to(device)
    x = torch.zeros(BATCH, WIDTH).to(device)
    unplanned = xla_wrap.plan_checkpointing(net, x, budget=1.0, progress=False)
    try:
        xla_wrap.plan_checkpointing(net, x, budget=1, progress=False)
    except xla_wrap.BudgetUnreachableError as error:
        smallest = error.smallest_peak_bytes
    budget = (smallest + unplanned.unplanned_peak_bytes) // 2
    plan = xla_wrap.plan_checkpointing(net, x, budget=budget, progress=False)
    PLANS["fsdp(plan) helper"] = dict(plan.choices)
    unit = fsdp.auto_wrapper_callable(fsdp_class=FSDPv2, plan=plan)
    return _auto(unit)(net)


# The choices of the planned compositions, by name.
PLANS: dict[str, dict[str, str]] = {}

COMPOSITIONS: dict[str, Callable[[Net], nn.Module]] = {
    "plain": _auto(None),
    # The helper: FSDPv2(checkpoint_wrapper(block)), recording the unit's output sharding.
    "fsdp(checkpoint) helper": _auto(fsdp.auto_wrapper_callable(fsdp_class=FSDPv2)),
    "checkpoint(fsdp)": _auto(lambda m, *a, **k: xla_wrap.checkpoint_wrapper(FSDPv2(m, *a, **k))),
    # Written by hand, FSDPv2 shards the output where the checkpoint cannot see it.
    "fsdp(checkpoint) by hand": _auto(
        lambda m, *a, **k: FSDPv2(xla_wrap.checkpoint_wrapper(m), *a, **k)
    ),
    "fsdp(plan) helper": _planned,
}


def run(build: Callable[[Net], nn.Module], mesh: Any) -> dict[str, Any]:
    warnings.simplefilter("always")
    torch.manual_seed(0)
    net = Net()
    calls: list[list[bool]] = [[] for _ in net.blocks]
    for index, block in enumerate(net.blocks):
        # On a submodule: the checkpointed block's own hooks run once, around the checkpoint.
        block.up.register_forward_hook(
            lambda *_, i=index: calls[i].append(xla_wrap.is_recomputing())
        )
    model = build(net)
    for record in calls:  # planning runs the blocks
        record.clear()
    device = torch_xla.device()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    torch_xla.sync()
    result: dict[str, Any] = {}

    def step() -> None:
        xm.set_rng_state(7, str(device))
        loss = model(x)
        loss.backward()
        torch_xla.sync()
        result["loss"] = loss.item()

    with warnings.catch_warnings(record=True) as caught:
        try:
            program: introspect.CompiledProgram | None = introspect.compiled_memory(step)
        except xla_wrap.CheckpointValueError:
            # The step ran, but XLA took its program from the cache: the composition built
            # exactly the program of an earlier one (the cache is keyed by the HLO).
            program = None
    result["compiled"] = program is not None
    grads = {n: p.grad.cpu().tolist() for n, p in model.named_parameters()}
    first_calls = [list(c) for c in calls]
    compiles = met.metric_data("CompileTime")[0]
    for p in model.parameters():
        p.grad = None
    step()  # the same step again must reuse the compiled program
    result.update(
        recompiles=met.metric_data("CompileTime")[0] - compiles,
        grads=grads,
        calls=first_calls,
        **(
            {
                "peak_bytes": program.total_bytes,
                "flops": program.flops,
                "all_gathers": program.count("all-gather"),
                "regathers": program.count("all-gather", reading="opt-barrier"),
            }
            if program is not None
            else {}
        ),
        warnings=[str(w.message) for w in caught if "SPMD" in str(w.message)],
        sharded=all(internal.sharding(p) is not None for p in model.parameters()),
    )
    return result


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale


def data_inputs(mesh: Any) -> dict[str, Any]:
    """A checkpoint whose inputs are program inputs (data, a mask-like constant): two steps."""

    device = torch_xla.device()
    block = Scaled().to(device)
    x = torch.randn(BATCH, WIDTH).to(device)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    scale = torch.full((WIDTH,), 0.5).to(device)
    torch_xla.sync()
    counts = []
    for _ in range(2):
        block.zero_grad(set_to_none=True)
        xla_wrap.checkpoint(block, x, scale=scale).sum().backward()
        torch_xla.sync()
        counts.append(met.metric_data("CompileTime")[0])
    return {
        "recompiles": counts[1] - counts[0],
        "still data": internal.is_device_data(x) and internal.is_device_data(scale),
    }


def expected_bytes() -> dict[str, int]:
    """Per-device bytes the analysis predicts, from what autograd saves for one block."""
    rows = BATCH // DEVICES
    saved = introspect.saved_residuals(Block(), torch.randn(rows, WIDTH))
    per_block = sum(r.nbytes for r in saved if r.kind != "parameter")
    block_input = rows * WIDTH * 4
    return {
        "activations_per_block": per_block,
        # Without checkpointing every block's activations live until its backward; with it,
        # each block keeps its input, and one block's activations exist at a time.
        "plain_activations": DEPTH * per_block,
        "checkpointed_activations": DEPTH * block_input + per_block,
    }


def main(out: str) -> None:
    mesh = xs.Mesh(np.arange(DEVICES), (DEVICES, 1), ("fsdp", "model"))
    xs.set_global_mesh(mesh)
    results: dict[str, Any] = {"expected": expected_bytes()}
    for name, build in COMPOSITIONS.items():
        try:
            results[name] = run(build, mesh)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        with open(out, "w") as f:
            json.dump(results, f)
    results["plans"] = PLANS
    results["data inputs"] = data_inputs(mesh)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
