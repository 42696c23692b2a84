"""The plan section (`--plan`):
[`xla_wrap.plan_checkpointing()`][xla_wrap.plan_checkpointing] against every uniform plan, on
the same model, in one process.

The uniform plans are what users write by hand: nothing, every block fully recomputed, every
block with `dots_saveable`, every n-th block fully recomputed (n = 2, 3, 4; n = 1 is every
block). Each is compiled once for its peak and FLOPs. Then, for budgets spread between the
all-full peak and the unplanned one, the planner plans, and its plan is compared with the
cheapest uniform plan that fits the same budget.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import xla_wrap
from xla_wrap.internal import DOTS, FULL, NONE, apply_choices, measure_choices, repeated_blocks

# Where the budgets lie between the all-full peak (0) and the unplanned peak (1).
BUDGET_POSITIONS = (0.25, 0.5, 0.75)


def uniform_plans(count: int) -> dict[str, list[str]]:
    """The hand-written plans for `count` blocks, by name."""
    plans = {
        "none": [NONE] * count,
        "all full": [FULL] * count,
        "all dots_saveable": [DOTS] * count,
    }
    for n, nth in ((2, "2nd"), (3, "3rd"), (4, "4th")):
        plans[f"every {nth} full"] = [FULL if i % n == 0 else NONE for i in range(count)]
    return plans


def compare_plans(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    positions: tuple[float, ...] = BUDGET_POSITIONS,
    progress: bool = False,
) -> dict[str, Any]:
    """Compile every uniform plan, then plan for each budget; the figures of both.

    `model` (on the XLA device, not checkpointed) is left as it was.

    Returns:
        `{"uniform": {name: {"peak_bytes", "flops", "choices"}}, "planned": [{"budget_bytes",
        "choices", "peak_bytes", "flops", "predicted_peak_bytes", "compiles",
        "cheapest_uniform"}]}`.
    """
    names = [name for name, _ in repeated_blocks(model)]
    labelled = {
        label: dict(zip(names, chosen, strict=True))
        for label, chosen in uniform_plans(len(names)).items()
    }
    measured = measure_choices(model, args, kwargs, labelled, progress=progress)
    uniform: dict[str, dict[str, Any]] = {
        label: {
            "peak_bytes": measured[label].peak_bytes,
            "flops": measured[label].flops,
            "choices": choices,
        }
        for label, choices in labelled.items()
    }
    low, high = uniform["all full"]["peak_bytes"], uniform["none"]["peak_bytes"]
    planned = []
    for position in positions:
        budget = int(low + position * (high - low))
        plan = xla_wrap.plan_checkpointing(model, *args, budget=budget, progress=progress, **kwargs)
        fitting = [name for name, u in uniform.items() if u["peak_bytes"] <= budget]
        cheapest = min(fitting, key=lambda name: uniform[name]["flops"]) if fitting else None
        planned.append(
            {
                "budget_bytes": budget,
                "position": position,
                "choices": dict(plan.choices),
                "peak_bytes": plan.peak_bytes,
                "flops": plan.unplanned_flops + plan.recompute_flops,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "compiles": plan.compiles,
                "cheapest_uniform": cheapest,
            }
        )
    return {"uniform": uniform, "planned": planned}


def step_of(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], choices: dict[str, str]
) -> Callable[[], torch.Tensor]:
    """A training step of a copy of `model` checkpointed by `choices`, for timing."""
    import torch_xla

    copied = apply_choices("xla_wrap.bench", copy.deepcopy(model), choices)
    # Inputs of its own too: a checkpoint puts its barrier on its inputs in place.
    args, kwargs = copy.deepcopy((args, kwargs))
    torch_xla.sync()

    def step() -> torch.Tensor:
        for p in copied.parameters():
            p.grad = None
        loss = copied(*args, **kwargs)
        loss.backward()
        torch_xla.sync()
        return loss

    return step
