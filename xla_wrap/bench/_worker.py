"""Benchmark work done inside fresh processes.

:func:`measure` compiles and checks one variant (peak memory, FLOPs, gradients, recompiles) in a
process of its own, so a crash or a cached compilation cannot leak into another variant.
:func:`time_variants` then times every variant that ran in *one* process, interleaving their
steps round by round, so that the step-time ratios do not move with the machine's load.
"""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._floor import estimated_floor
from ._models import build
from ._variants import VARIANTS

SEED = 1234
WARM_UP_STEPS = 1  # the first step compiles; timing starts after it


def measure(model_name: str, variant: str, sizes: dict[str, int], grads: Path) -> dict:
    """Compile one variant's training step and check it; its figures, or its error."""
    try:
        return _measure(model_name, variant, sizes, grads)
    except Exception as error:  # a crashing variant is a result, not the end of the run
        return _error(error)


def time_variants(model_name: str, variants: list[str], sizes: dict[str, int], steps: int) -> dict:
    """Median XLA execution time (ms) per variant, all in this process, steps interleaved.

    Each step waits for its execution to finish before its ``ExecuteTime`` sample is read, and
    must add exactly one sample (one execution per step). A variant that fails here is dropped
    with its error; the others go on.
    """
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    steps_by_variant: dict[str, Callable[[], torch.Tensor]] = {}
    errors: dict[str, str] = {}
    for variant in variants:
        try:
            steps_by_variant[variant] = _prepare(model_name, variant, sizes)
        except Exception as error:
            errors[variant] = _error(error)["error"]
    times: dict[str, list[float]] = {v: [] for v in steps_by_variant}

    def timed(variant: str) -> float:
        before = _execute_count(met)
        steps_by_variant[variant]()
        xm.wait_device_ops()
        executions = _execute_count(met) - before
        if executions != 1:
            raise RuntimeError(f"one step ran {executions} XLA executions, expected 1")
        return float(met.metric_data("ExecuteTime")[2][-1][1]) / 1e6

    order = list(steps_by_variant)
    for round_index in range(WARM_UP_STEPS + steps):
        for variant in order:
            if variant in errors:
                continue
            try:
                elapsed = timed(variant)
            except Exception as error:
                errors[variant] = _error(error)["error"]
                continue
            if round_index >= WARM_UP_STEPS:
                times[variant].append(elapsed)
        order = order[1:] + order[:1]  # rotate, so no variant always runs first
    return {
        "step_ms": {v: statistics.median(t) for v, t in times.items() if t and v not in errors},
        "errors": errors,
    }


def _execute_count(met: Any) -> int:
    data = met.metric_data("ExecuteTime")
    return int(data[0]) if data else 0


def _error(error: Exception) -> dict:
    message = f"{type(error).__name__}: {error}".splitlines()[0]
    return {"error": message[:300], "traceback": traceback.format_exc()[-2000:]}


def _prepare(model_name: str, variant: str, sizes: dict[str, int]) -> Callable[[], torch.Tensor]:
    """Build the model on the XLA device, apply ``variant`` to all blocks but the first, and
    return its training step (forward, backward, sync; the loss is the only output kept)."""
    import torch_xla

    workload = build(model_name, sizes)
    device = torch_xla.device()
    model = workload.model.to(device)
    args = tuple(a.to(device) for a in workload.args)
    kwargs = {k: v.to(device) for k, v in workload.kwargs.items()}
    torch_xla.sync()
    wrap = VARIANTS[variant]
    if wrap is not None:
        blocks = workload.blocks  # moved to the device with the model
        for index in range(1, len(blocks)):
            blocks[index] = wrap(blocks[index])

    def step() -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        loss = model(*args, **kwargs)
        loss.backward()
        torch_xla.sync()
        return loss

    step.model = model  # type: ignore[attr-defined]
    return step


def _measure(model_name: str, variant: str, sizes: dict[str, int], grads: Path) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from xla_wrap import introspect

    result: dict[str, Any] = {}
    if variant == "none":
        workload = build(model_name, sizes)
        result["floor_bytes"] = estimated_floor(workload, range(1, len(workload.blocks)))
    step = _prepare(model_name, variant, sizes)
    xm.set_rng_state(SEED, str(torch_xla.device()))
    losses: list[torch.Tensor] = []
    program = introspect.compiled_memory(lambda: losses.append(step()))
    torch.save([p.grad.cpu() for p in step.model.parameters()], grads)  # type: ignore[attr-defined]
    compiles = met.metric_data("CompileTime")[0]
    for _ in range(2):  # later steps must reuse the program the first one compiled
        step()
    result.update(
        loss=float(losses[0].item()),
        peak_bytes=program.total_bytes,
        argument_bytes=program.argument_bytes,
        output_bytes=program.output_bytes,
        temporary_bytes=program.temporary_bytes,
        flops=program.flops,
        barriers=program.count("opt-barrier"),
        recompiles=met.metric_data("CompileTime")[0] - compiles,
    )
    return result
