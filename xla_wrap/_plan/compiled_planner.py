"""`plan_checkpointing` for a step compiled with `torch.compile`: the least recomputation whose
compiled forward saves at most a budget of bytes for backward, read from AOTAutograd's
partitioned graphs (the min-cut partitioner's, which inductor and `aot_eager` use).

1. **Each block alone, compiled.** One forward records every candidate's inputs; each block
   alike in class, parameters, settings and inputs is then compiled alone under each choice
   ([`PartitionedGraphs`][xla_wrap.introspect.PartitionedGraphs]: Dynamo's and AOTAutograd's
   tracing and the partitioner, no code generated) and run once on stand-in inputs: the bytes
   its forward saves for backward and the FLOPs of its backward.
2. **The frontier.** With those bytes added up over the blocks (the cost model's, without a
   backward working set: the budget is on what the forward saves), the exact solver walks the
   Pareto front of saved bytes against recomputed FLOPs, from nothing checkpointed to the least
   kept; at most `MAX_FRONTIER_STEPS` of its plans, evenly spread along it, are kept.
3. **Every plan of the frontier compiled as a whole step**, once per model and inputs. A budget
   is answered from those measured steps alone: the least FLOPs (then the fewest blocks
   changed, then the fewest bytes) among those whose saved bytes fit. So every plan fits its
   budget, and as the measured steps do not depend on the budget, a lower budget never saves
   more: were the plan for a higher budget to save less, it would fit the lower budget too,
   and be chosen there.

"Saved bytes" leave out the model's parameters and buffers, which live through the step
whatever is checkpointed: they are the activations that checkpointing can free.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._paths.compiled.graphs import PartitionedGraphs
from .._support import fingerprint
from .._support.errors import BudgetUnreachableError, CheckpointError, CheckpointValueError
from ..wrap_policies import WrapPolicy
from .blocks import (
    API,
    Call,
    Progress,
    applied,
    budget_in_bytes,
    capture_calls,
    checked_choices,
    classes,
    find_candidates,
    signature,
    summed,
)
from .checkpoint_plan import SAVED_FOR_BACKWARD, CheckpointPlan, summarize
from .cost_model import DOTS, FULL, NONE, BlockCost, modelled_peak, solve

#: The most whole steps a plan compiles: the frontier's plans beyond it are left out, evenly.
MAX_FRONTIER_STEPS = 9
_MIB = 2**20


@dataclass(frozen=True)
class _Measured:
    saved_bytes: int
    flops: int  # forward and backward


@dataclass(frozen=True)
class _Frontier:
    """A model's measured plans: its block costs, and each plan's compiled step."""

    costs: tuple[BlockCost, ...]
    base_bytes: int  # what the step saves outside the blocks (modelled)
    steps: Mapping[tuple[str, ...], _Measured]
    compiles: int


class _CompiledPlannerState:
    """Per process (the compiled planner alone reads it): each model's measured frontiers, by
    the fingerprint of its structure, inputs, loss and choices."""

    def __init__(self) -> None:
        self.frontiers: weakref.WeakKeyDictionary[nn.Module, dict[object, _Frontier]] = (
            weakref.WeakKeyDictionary()
        )


_state = _CompiledPlannerState()


def plan_compiled(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    budget: int | float,
    candidates: WrapPolicy | None,
    loss: Callable[[Any], torch.Tensor],
    choices: Sequence[str] | None,
    progress: bool,
) -> CheckpointPlan:
    """The plan for `budget` bytes saved for backward (or that fraction of the unplanned
    step's), from the model's measured frontier (measured now, or before for the same step)."""
    open_choices = checked_choices(
        choices,
        (DOTS, FULL),
        "is not planned under torch.compile: xla_wrap's offload runs outside the compiler "
        "(docs/compile.md)",
    )
    blocks = find_candidates(model, candidates)
    say = Progress(progress)
    key = _key(model, args, kwargs, loss, blocks, open_choices)
    known = _state.frontiers.setdefault(model, {})
    if key in known:
        say(f"the frontier of this step was measured before ({len(known[key].steps)} steps)")
    else:
        with _model_left_unchanged(model):
            known[key] = _measure_frontier(model, args, kwargs, loss, blocks, open_choices, say)
    frontier = known[key]
    names = [cost.name for cost in frontier.costs]
    not_called = [name for name, _ in blocks if name not in names]
    steps = frontier.steps
    unplanned = steps[(NONE,) * len(names)]
    budget_bytes = budget_in_bytes(budget, unplanned.saved_bytes)
    fitting = [plan for plan, step in steps.items() if step.saved_bytes <= budget_bytes]
    if not fitting:
        smallest = min(step.saved_bytes for step in steps.values())
        raise BudgetUnreachableError(
            f"{API}: no plan fits a budget of {budget_bytes / _MIB:.2f} MiB saved for backward: "
            f"the least a compiled step saves is {smallest / _MIB:.2f} MiB ({smallest} bytes, "
            f"the least of the {len(steps)} steps compiled), and the unplanned step saves "
            f"{unplanned.saved_bytes / _MIB:.2f} MiB. Raise the budget to at least that, let "
            "more blocks be candidates (`candidates=`), or shrink the batch.",
            smallest,
        )
    # The least FLOPs, then the fewest blocks changed (room to spare changes nothing), then
    # the fewest bytes. Any one order over the same measured steps keeps a lower budget from
    # saving more: the plan for a higher budget, if it fits the lower one, is chosen there too.
    chosen = min(
        fitting,
        key=lambda plan: (
            steps[plan].flops,
            sum(choice != NONE for choice in plan),
            steps[plan].saved_bytes,
            plan,
        ),
    )
    plan = CheckpointPlan(
        choices={**dict(zip(names, chosen, strict=True)), **dict.fromkeys(not_called, NONE)},
        budget_bytes=budget_bytes,
        peak_bytes=steps[chosen].saved_bytes,
        predicted_peak_bytes=frontier.base_bytes + modelled_peak(frontier.costs, chosen),
        recompute_flops=steps[chosen].flops - unplanned.flops,
        unplanned_peak_bytes=unplanned.saved_bytes,
        unplanned_flops=unplanned.flops,
        costs=frontier.costs,
        compiles=frontier.compiles,
        measure=SAVED_FOR_BACKWARD,
        _names=weakref.WeakKeyDictionary({m: n for n, m in blocks}),
    )
    say(
        f"done: {summarize(chosen)}; saves {plan.peak_bytes / _MIB:.2f} MiB for backward "
        f"(unplanned {plan.unplanned_peak_bytes / _MIB:.2f}), FLOPs {plan.flops_ratio:.3f}x"
    )
    return plan


def check_compiled_model(model: nn.Module) -> None:
    """Refuse a model the compiled planner cannot measure: one without parameters, or with
    some on a device torch.compile does not train on here (meta)."""
    tensors = [*model.parameters(), *model.buffers()]
    devices = sorted({t.device.type for t in tensors})
    if not tensors or "meta" in devices:
        where = ", ".join(devices) or "no parameters"
        raise CheckpointValueError(
            f"{API}: expected a model with its parameters on a device (XLA for XLA's compiled "
            f"peak; CPU or CUDA for a torch.compile step), got one with {where}. Move it "
            "first: `model.to(device)`."
        )


# --- measuring -----------------------------------------------------------------------------


def _measure_frontier(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss: Callable[[Any], torch.Tensor],
    blocks: list[tuple[str, nn.Module]],
    open_choices: tuple[str, ...],
    say: Progress,
) -> _Frontier:
    calls = capture_calls(model, blocks, args, kwargs)
    excluded = [*model.parameters(), *model.buffers()]
    alike = len({signature(call) for call in calls.values()})
    say(
        f"{len(calls)} candidate blocks ({classes(calls.values())}); compiling each choice of "
        f"{alike} distinct block{'s' if alike != 1 else ''} alone"
    )
    costs, compiles = _block_costs(calls, open_choices), alike * len(open_choices)
    modules = {name: call.module for name, call in calls.items()}
    front = _thinned(_modelled_front(costs))
    steps: dict[tuple[str, ...], _Measured] = {}
    for index, chosen in enumerate(front, start=1):
        say(f"step {index}/{len(front)}, {summarize(chosen)} ...", end="")
        with applied(modules, dict(zip(modules, chosen, strict=True))):
            steps[chosen] = _measure_step(lambda: loss(model(*args, **kwargs)), excluded)
        compiles += 1
        say(f" saves {steps[chosen].saved_bytes / _MIB:.2f} MiB", start="")
    unplanned = steps[(NONE,) * len(costs)]
    base = unplanned.saved_bytes - modelled_peak(costs, [NONE] * len(costs))
    return _Frontier(tuple(costs), base, steps, compiles)


def _block_costs(calls: Mapping[str, Call], open_choices: tuple[str, ...]) -> list[BlockCost]:
    known: dict[object, tuple[dict[str, int], dict[str, int]]] = {}
    costs = []
    for name, call in calls.items():
        key = signature(call)
        if key not in known:
            excluded = [*call.module.parameters(), *call.module.buffers()]
            measured = {}
            for choice in open_choices:
                with applied({name: call.module}, {name: choice}):
                    measured[choice] = _measure_step(_block_step(call), excluded)
            known[key] = (
                {c: m.saved_bytes for c, m in measured.items()},
                {c: max(0, m.flops - measured[NONE].flops) for c, m in measured.items()},
            )
        kept, flops = known[key]
        costs.append(
            BlockCost(
                name=name,
                kept_bytes=kept,
                recompute_flops=flops,
                offloaded_bytes=dict.fromkeys(kept, 0),
                working_bytes=0,  # the budget bounds what the forward saves, not a peak
                choices=open_choices,
            )
        )
    return costs


def _block_step(call: Call) -> Callable[[], torch.Tensor]:
    """The block alone on fresh stand-in inputs, its outputs summed."""
    args, kwargs = call.inputs()
    return lambda: _summed_if_any(call.module(*args, **kwargs))


def _summed_if_any(output: Any) -> torch.Tensor:
    """A block's outputs summed; zero for a block whose output needs no gradient."""
    try:
        return summed(output)
    except CheckpointValueError:
        return torch.zeros(())


def _measure_step(step: Callable[[], torch.Tensor], excluded: list[torch.Tensor]) -> _Measured:
    """Compile `step` (a loss) with the partitioned graphs' backend, run it and its backward
    once, and read what its forward saves (but `excluded`) and the FLOPs of both graphs."""
    graphs = PartitionedGraphs()

    def run() -> torch.Tensor:
        return step()

    # A code object of its own: Dynamo caches graphs per code object, so a measured step
    # neither runs another's graph nor fills that cache up to its recompile limit.
    fresh = types.FunctionType(
        run.__code__.replace(), run.__globals__, "step", None, run.__closure__
    )
    try:
        value = torch.compile(fresh, backend=graphs.backend, fullgraph=True)()
    except torch._dynamo.exc.Unsupported as error:
        reason = str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"{API}: expected a step torch.compile traces as one graph (fullgraph=True): its "
            f"saved bytes are read from that graph; got a graph break: {reason}. Plan a model "
            "without the break, or plan its parts apart."
        ) from error
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise CheckpointValueError(
            f"{API}: expected `loss` to return a scalar tensor, got {type(value).__name__}. "
            "Reduce the output to one number (`.sum()`, `.mean()`)."
        )
    if not value.requires_grad:
        return _Measured(0, 0)
    value.backward()
    return _Measured(
        graphs.saved_bytes(excluding=excluded),
        graphs.forward_flops() + graphs.backward_flops(),
    )


def _modelled_front(costs: Sequence[BlockCost]) -> list[tuple[str, ...]]:
    """The plans of the modelled Pareto front, from nothing checkpointed to the least kept:
    each the cheapest that keeps less than the one before."""
    front: list[tuple[str, ...]] = []
    limit = modelled_peak(costs, [NONE] * len(costs))
    while True:
        chosen = solve(costs, limit)
        if chosen is None:
            return front
        front.append(chosen)
        limit = modelled_peak(costs, chosen) - 1


def _thinned(front: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """At most `MAX_FRONTIER_STEPS` plans of `front`, its two ends kept, evenly spread."""
    if len(front) <= MAX_FRONTIER_STEPS:
        return front
    last = len(front) - 1
    picks = sorted({round(i * last / (MAX_FRONTIER_STEPS - 1)) for i in range(MAX_FRONTIER_STEPS)})
    return [front[i] for i in picks]


def _key(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss: Callable[[Any], torch.Tensor],
    blocks: list[tuple[str, nn.Module]],
    open_choices: tuple[str, ...],
) -> object:
    return (
        tuple(name for name, _ in blocks),
        open_choices,
        tuple(
            (n, type(m), m.training, fingerprint.parameter_entries(m, recurse=False))
            for n, m in model.named_modules()
        ),
        repr(fingerprint.value_meta((args, kwargs))),
        getattr(loss, "__code__", loss),
    )


@contextmanager
def _model_left_unchanged(model: nn.Module) -> Iterator[None]:
    """Give back the model's gradients, buffers and the random state as they were: the measured
    steps run, forward and backward, without an optimizer."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = sorted({t.device.index or 0 for t in grads if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        for p, grad in grads.items():
            p.grad = grad
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
