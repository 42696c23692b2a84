"""Benchmark work done inside fresh processes.

`measure()` compiles and checks one variant (peak memory, FLOPs, gradients, recompiles) in a
process of its own, so a crash or a cached compilation cannot leak into another variant.
`time_variants()` then times every variant that ran in *one* process, interleaving their
steps round by round, so that the step-time ratios do not move with the machine's load.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..internal import per_layer_gradients
from .floor import estimated_floor
from .models import Workload, build
from .variants import STACK_VARIANTS, VARIANTS

SEED = 1234
WARM_UP_STEPS = 1  # the first step compiles; timing starts after it
TRACED_STEPS = 3  # steps after the first whose Python tracing time is measured


def measure(model_name: str, variant: str, sizes: dict[str, int], grads: Path) -> dict:
    """Compile one variant's training step and check it; its figures, or its error."""
    try:
        return _measure(model_name, variant, sizes, grads)
    except Exception as error:  # a crashing variant is a result, not the end of the run
        return _error(error)


def time_variants(model_name: str, variants: list[str], sizes: dict[str, int], steps: int) -> dict:
    """Median XLA execution time (ms) per variant, all in this process, steps interleaved.

    Each step waits for its execution to finish before its `ExecuteTime` sample is read, and
    must add exactly one sample (one execution per step). A variant that fails here is dropped
    with its error; the others go on.
    """
    steps_by_variant: dict[str, Callable[[], Any]] = {}
    errors: dict[str, str] = {}
    for variant in variants:
        try:
            steps_by_variant[variant] = _prepare(model_name, variant, sizes)
        except Exception as error:
            errors[variant] = _error(error)["error"]
    step_ms, failed = interleaved_step_ms(steps_by_variant, steps)
    return {"step_ms": step_ms, "errors": {**errors, **failed}}


def interleaved_step_ms(
    steps_by_name: dict[str, Callable[[], Any]], steps: int
) -> tuple[dict[str, float], dict[str, str]]:
    """Median XLA execution time (ms) of each step, steps interleaved round by round after
    `WARM_UP_STEPS`; and the error of each step that failed (the others go on)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    errors: dict[str, str] = {}
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}

    def timed(name: str) -> float:
        before = _execute_counts(met)
        steps_by_name[name]()
        xm.wait_device_ops()
        after = _execute_counts(met)
        executions = sum(after.values()) - sum(before.values())
        if executions != 1:
            raise RuntimeError(f"one step ran {executions} XLA executions, expected 1")
        metric = next(n for n in _EXECUTE_METRICS if after[n] > before[n])
        return float(met.metric_data(metric)[2][-1][1]) / 1e6

    order = list(steps_by_name)
    for round_index in range(WARM_UP_STEPS + steps):
        for name in order:
            if name in errors:
                continue
            try:
                if round_index < WARM_UP_STEPS:  # compiles, and may run what was pending
                    steps_by_name[name]()
                    xm.wait_device_ops()
                else:
                    times[name].append(timed(name))
            except Exception as error:
                errors[name] = _error(error)["error"]
        order = order[1:] + order[:1]  # rotate, so no step always runs first
    medians = {n: statistics.median(t) for n, t in times.items() if t and n not in errors}
    return medians, errors


# One execution per step adds a sample to one of these; under SPMD, torch_xla times the
# replicated execution under its own name.
_EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")


def _execute_counts(met: Any) -> dict[str, int]:
    counts = {}
    for name in _EXECUTE_METRICS:
        data = met.metric_data(name)
        counts[name] = int(data[0]) if data else 0
    return counts


def _compile_seconds(met: Any) -> float:
    """All XLA compile time of this process so far (torch_xla's CompileTime metric)."""
    data = met.metric_data("CompileTime")
    return float(data[1]) / 1e9 if data else 0.0


def _error(error: Exception) -> dict:
    message = f"{type(error).__name__}: {error}".splitlines()[0]
    return {"error": message[:300], "traceback": traceback.format_exc()[-2000:]}


def _prepare(model_name: str, variant: str, sizes: dict[str, int]) -> Callable[[], torch.Tensor]:
    """Build the model on the XLA device, apply `variant` to all blocks but the first, and
    return its training step (forward, backward, sync; the loss is the only output kept)."""
    import torch_xla

    workload = build(model_name, sizes)
    wrap = VARIANTS[variant]
    if variant in STACK_VARIANTS:
        workload.model.blocks = STACK_VARIANTS[variant](workload.blocks)
    if workload.devices > 1:
        model, args, kwargs = _sharded(workload, wrap)
    else:
        device = torch_xla.device()
        model = workload.model.to(device)
        args = tuple(a.to(device) for a in workload.args)
        kwargs = {k: v.to(device) for k, v in workload.kwargs.items()}
        if wrap is not None:
            blocks = workload.blocks  # moved to the device with the model
            for index in range(1, len(blocks)):
                blocks[index] = wrap(blocks[index])
    torch_xla.sync()

    traced: list[float] = []

    def step() -> torch.Tensor:
        started = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        loss = model(*args, **kwargs)
        loss.backward()
        traced.append(time.perf_counter() - started)  # Python tracing: nothing ran yet
        torch_xla.sync()
        return loss

    step.model = model  # type: ignore[attr-defined]
    step.traced = traced  # type: ignore[attr-defined]
    return step


def _sharded(
    workload: Workload, wrap: Callable[[nn.Module], nn.Module] | None
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The workload under SPMD FSDPv2: every block a unit, the root a unit, the batch split
    over a 1-D "fsdp" mesh of `workload.devices` devices. A variant checkpoints the units of
    all blocks but the first from outside (`checkpoint(FSDPv2(block))`), the order in which
    FSDPv2 shards each output inside the checkpoint, for every tool alike."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2,
    )

    if not xr.is_spmd():
        xr.use_spmd()  # before the process's first XLA tensor
    mesh = xs.Mesh(np.arange(workload.devices), (workload.devices, 1), ("fsdp", "model"))
    blocks = workload.blocks
    for index in range(len(blocks)):
        unit = FSDPv2(blocks[index], mesh=mesh)
        blocks[index] = wrap(unit) if wrap is not None and index >= 1 else unit
    # The root returns the scalar loss: nothing to shard.
    model = FSDPv2(workload.model, mesh=mesh, shard_output=lambda output, mesh: None)
    device = torch_xla.device()
    args = tuple(a.to(device) for a in workload.args)
    xs.mark_sharding(args[0], mesh, ("fsdp",) + (None,) * (args[0].dim() - 1))
    kwargs = {k: v.to(device) for k, v in workload.kwargs.items()}
    return model, args, kwargs


def _measure(model_name: str, variant: str, sizes: dict[str, int], grads: Path) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from xla_wrap import introspect

    result: dict[str, Any] = {}
    if variant == "none":
        workload = build(model_name, sizes)
        if workload.devices == 1:  # the floor is estimated for one device
            result["floor_bytes"] = estimated_floor(workload, range(1, len(workload.blocks)))
    step = _prepare(model_name, variant, sizes)
    xm.set_rng_state(SEED, str(torch_xla.device()))
    losses: list[torch.Tensor] = []
    compiled_before = _compile_seconds(met)
    program = introspect.compiled_memory(lambda: losses.append(step()))
    compile_s = _compile_seconds(met) - compiled_before
    # Per layer, in state_dict order, also where a scanned list stores its parameters stacked.
    gradients = per_layer_gradients(step.model)  # type: ignore[attr-defined]
    torch.save([g.cpu() for g in gradients.values() if g is not None], grads)
    compiles = met.metric_data("CompileTime")[0]
    for _ in range(TRACED_STEPS):  # later steps must reuse the program the first one compiled
        step()
    traced = step.traced[-TRACED_STEPS:]  # type: ignore[attr-defined]
    result.update(
        loss=float(losses[0].item()),
        peak_bytes=program.total_bytes,
        argument_bytes=program.argument_bytes,
        output_bytes=program.output_bytes,
        temporary_bytes=program.temporary_bytes,
        flops=program.flops,
        barriers=program.count("opt-barrier"),
        recompiles=met.metric_data("CompileTime")[0] - compiles,
        compile_s=compile_s,
        # A scanned stack draws its own Dropout masks: its gradients cannot equal the loop's.
        own_masks=variant in STACK_VARIANTS and sizes.get("dropout_pct", 0) > 0,
        trace_ms=statistics.median(traced) * 1e3,
    )
    return result


def plan_section(model_name: str, sizes: dict[str, int], steps: int) -> dict:
    """The plan section for one model: uniform plans and planned ones, compiled and timed."""
    try:
        return _plan_section(model_name, sizes, steps)
    except Exception as error:
        return _error(error)


def _plan_section(model_name: str, sizes: dict[str, int], steps: int) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm

    from .plan import compare_plans, step_of

    workload = build(model_name, sizes)
    device = torch_xla.device()
    model = workload.model.to(device)
    args = tuple(a.to(device) for a in workload.args)
    kwargs = {k: v.to(device) for k, v in workload.kwargs.items()}
    torch_xla.sync()
    xm.set_rng_state(SEED, str(device))
    result = compare_plans(model, args, kwargs)
    configs = {name: u["choices"] for name, u in result["uniform"].items()}
    configs.update({f"plan {i}": p["choices"] for i, p in enumerate(result["planned"])})
    step_ms, errors = interleaved_step_ms(
        {name: step_of(model, args, kwargs, choices) for name, choices in configs.items()}, steps
    )
    for name, u in result["uniform"].items():
        u["step_ms"] = step_ms.get(name)
    for i, p in enumerate(result["planned"]):
        p["step_ms"] = step_ms.get(f"plan {i}")
    result["timing_errors"] = errors
    return result
