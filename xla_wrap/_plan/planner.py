"""`plan_checkpointing`: the cheapest checkpointing that fits a memory budget, from XLA's own
numbers.

1. **Measure each block** without compiling: one traced forward records every candidate's
   inputs; each block is then traced alone under each choice, forward and backward, on
   stand-in inputs. What autograd saves gives the bytes the choice keeps; the dots and
   convolutions of the traced HLO give the FLOPs it recomputes. Alike blocks are traced once.
2. **Compile two anchors**: the step without checkpointing and with every candidate fully
   recomputed. They calibrate the cost model (`cost_model`) to XLA's buffer assignment:
   compiled peak = unplanned peak - scale x (the bytes the model says are saved). Where
   `dots_saveable` is a choice, the step with every candidate on it is compiled too: it
   recomputes the fewest FLOPs that save anything, and the model misjudges it by a few percent.
3. **Solve exactly** for the least recomputation under the budget, compile the plan, and
   correct the model by what it missed; a bounded number of times.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .._inspect import hlo as _hlo
from .._inspect import programs as introspect
from .._inspect import residuals as _residuals
from .._paths import xla as _xla
from .._support import fingerprint
from .._support.checks import check_flag, check_module
from .._support.errors import (
    BudgetUnreachableError,
    CheckpointError,
    CheckpointValueError,
    describe,
)
from ..wrap_policies import WrapPolicy
from .blocks import (
    API,
    Call,
    Progress,
    applied,
    budget_in_bytes,
    capture_calls,
    check_budget,
    checked_choices,
    checked_loss,
    classes,
    find_candidates,
    repeated_blocks,
    signature,
    summed,
)
from .checkpoint_plan import CheckpointPlan, summarize
from .compiled_planner import check_compiled_model, plan_compiled
from .cost_model import (
    DOTS,
    FULL,
    NONE,
    OFFLOAD,
    BlockCost,
    lowest_choices,
    modelled_peak,
    objective,
    solve,
)

# Compiles of candidate plans after the two anchors: the model is corrected after each.
MAX_VERIFY_COMPILES = 3
_MIB = 2**20


class _PlannerState:
    """The planner's own state, per process (the planner alone reads it): registries that only
    grow."""

    def __init__(self) -> None:
        # Per model: the measured steps, by the step's fingerprint.
        self.steps: weakref.WeakKeyDictionary[Any, dict[object, Any]] = weakref.WeakKeyDictionary()
        # Lengths of fresh tensors, so that each measured step compiles a program of its own.
        self.fresh_lengths = itertools.count(1)


_state = _PlannerState()


def plan_checkpointing(
    model: nn.Module,
    *example_args: Any,
    budget: int | float,
    candidates: WrapPolicy | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    choices: Sequence[str] | None = None,
    progress: bool = True,
    **example_kwargs: Any,
) -> CheckpointPlan:
    """Choose, per block, how to checkpoint `model` to fit `budget` at the least recomputation.

    Each candidate block gets one of `"none"` (kept as it is), `"dots_saveable"`,
    `"full"` (recompute its whole forward) and, where the backend places buffers in host
    memory, `"offload"`. The plan minimises the FLOPs recomputed while the step's memory stays
    within `budget`. The model is left as it was (gradients, buffers and the random state
    included); apply the plan with [`CheckpointPlan.apply()`][xla_wrap.CheckpointPlan.apply].

    The step measured is `loss(model(*example_args, **example_kwargs)).backward()`, by the
    device the model is on:

    - **On an XLA device**, the budget bounds the step's compiled peak, read from XLA's buffer
      assignment in its compile dumps: start the process with
      [`xla_wrap.introspect.enable_compile_dumps()`][xla_wrap.introspect.enable_compile_dumps]
      (before the first XLA device), and on XLA:CPU keep the barriers
      (`XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander`).
    - **On CPU or CUDA**, the step is the one `torch.compile` makes, and the budget bounds the
      bytes its compiled forward saves for backward (the model's parameters and buffers left
      out), read from AOTAutograd's partitioned graphs (the min-cut partitioner's, as inductor
      and `aot_eager` use). Every plan of the frontier between nothing checkpointed and the
      least kept is measured once (at most 9 steps); every budget is answered from those, so
      a lower budget never saves more. The step must compile as one graph.

    Args:
        model: The model, not checkpointed yet: on an XLA device, or on CPU or CUDA.
        *example_args: Its positional inputs, with the shapes the plan is for.
        budget: Bytes (an int), or a fraction in (0, 1] of the unplanned step's (a float):
            its compiled peak on XLA, its bytes saved for backward under `torch.compile`.
        candidates: An [`xla_wrap.wrap_policies`][xla_wrap.wrap_policies] policy selecting the
            blocks the plan may checkpoint; by default the repeated blocks (modules of one
            class, two or more in a `ModuleList` or `Sequential`, with parameters).
        loss: Turns the model's output into the scalar to differentiate; by default the sum of
            its floating-point tensors.
        choices: The choices open to every block besides `"none"`, among
            `"dots_saveable"`, `"full"` and `"offload"`; by default all of them that the
            backend supports (`"offload"`: never under `torch.compile`).
            `choices=("full",)` plans whole-block recomputation only.
        progress: Print what it compiles, and how long that took, to stderr.
        **example_kwargs: Its keyword inputs.

    Returns:
        The plan, with the measured memory of the planned step and what it recomputes.

    Raises:
        CheckpointTypeError: If an argument has the wrong type.
        BudgetUnreachableError: If the budget is below the smallest reachable figure (the
            message names it, `smallest_peak_bytes` holds it).
        CheckpointValueError: If no candidate is found, or a candidate is nested in another, already
            checkpointed, scanned or called more than once.
        CheckpointError: If the step cannot be measured here (on XLA: no compile dumps,
            barriers stripped on XLA:CPU; under `torch.compile`: a graph break).

    Examples:
        >>> plan = xla_wrap.plan_checkpointing(model, x, budget=0.5)  # doctest: +SKIP
        >>> print(plan)                                               # doctest: +SKIP
        >>> plan.apply(model)                                         # doctest: +SKIP
    """
    model = check_module(API, model, "the nn.Module to plan for")
    check_budget(budget)
    check_flag(API, "progress", progress)
    loss_fn = summed if loss is None else checked_loss(loss)
    if not any(_xla.is_xla_tensor(t) for t in (*model.parameters(), *model.buffers())):
        check_compiled_model(model)
        return plan_compiled(
            model,
            example_args,
            example_kwargs,
            budget=budget,
            candidates=candidates,
            loss=loss_fn,
            choices=choices,
            progress=progress,
        )
    device = _check_model(model)
    open_choices = checked_choices(
        choices,
        (DOTS, FULL) + ((OFFLOAD,) if _xla.host_offload_supported() else ()),
        "needs a backend that places buffers in host memory (TPU, GPU); this one cannot "
        "(docs/offload.md)",
    )
    blocks = find_candidates(model, candidates)
    say = Progress(progress)
    step = _Step(model, example_args, example_kwargs, loss_fn, dict(blocks), device, say)
    with _model_left_unchanged(model, device):
        calls = capture_calls(model, blocks, example_args, example_kwargs)
        not_called = [name for name, _ in blocks if name not in calls]
        say(
            f"{len(calls)} candidate blocks ({classes(calls.values())}); tracing each choice"
            + (f" ({len(not_called)} never called: left as they are)" if not_called else "")
        )
        costs = _block_costs(calls, open_choices)
        unplanned = step.measure({}, "the unplanned step")
        budget_bytes = budget_in_bytes(budget, unplanned.peak_bytes)
        names = [cost.name for cost in costs]

        def choices_of(chosen: Sequence[str]) -> dict[str, str]:
            return {**dict(zip(names, chosen, strict=True)), **dict.fromkeys(not_called, NONE)}

        if budget_bytes >= unplanned.peak_bytes or not costs:
            if budget_bytes < unplanned.peak_bytes:
                _raise_unreachable(budget_bytes, unplanned.peak_bytes, unplanned.peak_bytes)
            return step.plan(
                choices_of([NONE] * len(costs)),
                costs,
                budget_bytes,
                unplanned,
                unplanned,
                unplanned.peak_bytes,
            )
        all_full = (FULL,) * len(costs)
        full = step.measure(choices_of(all_full), "every candidate fully recomputed")
        model_of = _Calibrated(costs, unplanned.peak_bytes, full.peak_bytes)
        # Compiled plans by their choices; a plan may return only those within `choices`.
        measured = {(NONE,) * len(costs): unplanned, all_full: full}
        allowed = [c for c in measured if set(c) <= set(open_choices)]
        lowest = lowest_choices(costs)
        if lowest not in measured and (
            all_full not in allowed
            or (budget_bytes < full.peak_bytes and model_of.predict(lowest) < full.peak_bytes)
        ):
            measured[lowest] = step.measure(choices_of(lowest), "the lowest modelled peak")
            allowed.append(lowest)
        # Every block keeping its products recomputes the fewest FLOPs that save anything: the
        # cost model, fitted on full recomputation, misjudges it by a few percent, too much to
        # leave to the solver near a budget.
        all_dots = (DOTS,) * len(costs)
        if DOTS in open_choices and all_dots not in measured:
            measured[all_dots] = step.measure(
                choices_of(all_dots), "every candidate keeping its products"
            )
            allowed.append(all_dots)
        reachable = min(measured[c].peak_bytes for c in allowed)
        if budget_bytes < reachable:
            _raise_unreachable(budget_bytes, reachable, unplanned.peak_bytes)
        # Solve, compile, shift the model by what it missed; a bounded number of times.
        correction = 0
        for _ in range(MAX_VERIFY_COMPILES):
            chosen = model_of.solve(budget_bytes - correction)
            if chosen is None or chosen in measured:
                break
            predicted = model_of.predict(chosen)
            measured[chosen] = step.measure(
                choices_of(chosen),
                f"the plan for {budget_bytes / _MIB:.1f} MiB ({summarize(chosen)}; predicted "
                f"{predicted / _MIB:.1f} MiB)",
            )
            allowed.append(chosen)
            correction = measured[chosen].peak_bytes - predicted
        # Never empty: the plan that reached the smallest peak fits.
        fitting = [c for c in allowed if measured[c].peak_bytes <= budget_bytes]
        chosen = min(
            fitting,
            key=lambda c: (measured[c].flops, objective(costs, c), measured[c].peak_bytes),
        )
        plan = step.plan(
            choices_of(chosen),
            costs,
            budget_bytes,
            measured[chosen],
            unplanned,
            model_of.predict(chosen),
        )
        say(
            f"done: {summarize(chosen)}; peak {plan.peak_bytes / _MIB:.1f} MiB, FLOPs "
            f"{plan.flops_ratio:.3f}x of the unplanned step"
        )
        return plan


# --- what the planner is given -----------------------------------------------------------


def _check_model(model: nn.Module) -> torch.device:
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors or not all(_xla.is_xla_tensor(t) for t in tensors):
        where = sorted({str(t.device) for t in tensors}) or ["no parameters"]
        raise CheckpointValueError(
            f"{API}: expected a model on one kind of device (XLA for XLA's compiled peak; CPU "
            f"or CUDA for a torch.compile step), got one on {', '.join(where)}. Move it all "
            "first: `model.to(torch_xla.device())`."
        )
    device = tensors[0].device
    if introspect.dump_directory() is None:
        raise CheckpointError(
            f"{API}: expected XLA to dump its compilations (the compiled peak comes from its "
            "buffer assignment), got a process started without. Call "
            "`xla_wrap.introspect.enable_compile_dumps()` before the first XLA device is "
            "created, or start Python with XLA_FLAGS=--xla_dump_to=DIR."
        )
    if _xla.barriers_stripped_here():
        raise CheckpointError(
            f"{API}: expected a backend that keeps optimization barriers, got XLA:CPU with "
            f"{_xla.BARRIER_STRIPPING_PASS} on: every plan would show the unplanned peak. "
            f"Start Python with XLA_FLAGS={_xla.KEEP_BARRIERS_FLAG} to plan on a CPU."
        )
    return device


def _raise_unreachable(budget: int, reachable: int, unplanned: int) -> None:
    raise BudgetUnreachableError(
        f"{API}: no plan fits a budget of {budget / _MIB:.1f} MiB: the smallest reachable "
        f"peak is {reachable / _MIB:.1f} MiB ({reachable} bytes, the least of the steps compiled), "
        f"and the unplanned step peaks at {unplanned / _MIB:.1f} MiB. Raise the budget to at "
        "least that, let more blocks be candidates (`candidates=`), or shrink the batch.",
        reachable,
    )


# --- measuring -----------------------------------------------------------------------------


def _block_costs(calls: Mapping[str, Call], open_choices: tuple[str, ...]) -> list[BlockCost]:
    traced = (*open_choices, FULL) if FULL not in open_choices else open_choices
    known: dict[object, tuple[dict[str, int], dict[str, int]]] = {}
    costs = []
    for name, call in calls.items():
        key = signature(call)
        if key not in known:
            kept, flops = {}, {}
            for choice in traced:
                with applied({name: call.module}, {name: choice}):
                    kept[choice], flops[choice] = _traced_cost(call)
            known[key] = kept, flops
        kept, flops = known[key]
        base = flops[NONE]
        costs.append(
            BlockCost(
                name=name,
                kept_bytes={c: (0 if c == OFFLOAD else b) for c, b in kept.items()},
                recompute_flops={c: max(0, f - base) for c, f in flops.items()},
                offloaded_bytes={c: (kept[NONE] if c == OFFLOAD else 0) for c in kept},
                working_bytes=kept[NONE],
                choices=open_choices,
            )
        )
    return costs


def _traced_cost(call: Call) -> tuple[int, int]:
    """Bytes the block's forward keeps for backward (its activations and the inputs it saves),
    and the FLOPs of its traced forward and backward. Nothing is executed."""
    args, kwargs = call.inputs()
    outputs: list[Any] = []
    residuals = _residuals.saved_residuals(
        lambda *a, **k: outputs.append(call.module(*a, **k)), *args, **kwargs
    )
    kept = sum(r.nbytes for r in residuals if r.kind in ("input", "activation"))
    differentiable = [
        t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    wrt = [
        t
        for t in pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.requires_grad
    ] + [p for p in call.module.parameters() if p.requires_grad]
    if not differentiable or not wrt:
        return kept, 0
    grads = torch.autograd.grad(
        differentiable,
        wrt,
        grad_outputs=[torch.ones_like(t) for t in differentiable],
        allow_unused=True,
    )
    # The outputs too: the step computes them, and what backward recomputes is what it needs
    # beyond them (XLA drops the rest as dead code).
    pending = [*differentiable, *(g for g in grads if g is not None)]
    return kept, _hlo.flops(introspect.pending_hlo(pending))


def measure_choices(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    labelled_choices: Mapping[str, Mapping[str, str]],
    *,
    progress: bool = False,
) -> dict[str, _Measured]:
    """The compiled peak and FLOPs of the training step under each labelled choice per block
    (of `repeated_blocks()`), the loss being the output's sum, as the planner measures
    them; `model` is left as it was. For the bench's uniform plans."""
    blocks = dict(repeated_blocks(model))
    device = next(model.parameters()).device
    step = _Step(model, args, kwargs, summed, blocks, device, Progress(progress))
    with _model_left_unchanged(model, device):
        return {label: step.measure(choices, label) for label, choices in labelled_choices.items()}


@contextmanager
def _model_left_unchanged(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Give back the model's gradients, buffers and the device's random state as they were:
    the measured steps are real training steps without an optimizer."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().cpu()) for b in model.buffers()]
    seed = _xla.rng_state(device)
    try:
        yield
    finally:
        for p, grad in grads.items():
            p.grad = grad
        for b, saved in buffers:
            if not _xla.is_device_data(b):  # updated in place by a traced forward
                b.data = saved.to(device)
        _xla.set_rng_state(device, seed)


@dataclass(frozen=True)
class _Measured:
    peak_bytes: int
    flops: int


class _Step:
    """The training step of the model under a choice per block, compiled and measured."""

    def __init__(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss: Callable[[Any], torch.Tensor],
        modules: dict[str, nn.Module],
        device: torch.device,
        say: Progress,
    ) -> None:
        self.model, self.args, self.kwargs, self.loss = model, args, kwargs, loss
        self.modules, self.device, self.say = modules, device, say
        self.compiles = 0

    def measure(self, choices: Mapping[str, str], what: str) -> _Measured:
        """The compiled peak and FLOPs of the step under `choices`: compiled now, or as
        compiled before for the same structure, inputs, loss and choices (planning the same
        model for another budget)."""
        known = _state.steps.setdefault(self.model, {})
        key = self._key(choices)
        if key in known:
            self.say(f"{what}: compiled before, peak {known[key].peak_bytes / _MIB:.1f} MiB")
            return known[key]
        known[key] = self._compile(choices, what)
        return known[key]

    def _key(self, choices: Mapping[str, str]) -> object:
        model = self.model
        return (
            tuple(sorted((n, c) for n, c in choices.items() if c != NONE)),
            tuple(
                (n, type(m), m.training, fingerprint.parameter_entries(m, recurse=False))
                for n, m in model.named_modules()
            ),
            repr(fingerprint.value_meta((self.args, self.kwargs))),
            getattr(self.loss, "__code__", self.loss),
        )

    def _compile(self, choices: Mapping[str, str], what: str) -> _Measured:
        self.compiles += 1
        started = time.perf_counter()
        self.say(f"compile {self.compiles}, {what} ...", end="")

        def run() -> None:
            for p in self.model.parameters():
                p.grad = None
            value = self.loss(self.model(*self.args, **self.kwargs))
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise CheckpointValueError(
                    f"{API}: expected `loss` to return a scalar tensor, got "
                    f"{describe(value)}. Reduce the output to one number (`.sum()`, `.mean()`)."
                )
            value.backward()
            # An extra output of a new length, so that XLA compiles the step afresh (a step
            # compiled before comes from the cache, and caches report no buffer assignment).
            fresh = torch.zeros(next(_state.fresh_lengths), device=self.device)
            _xla.sync()
            del fresh

        with applied(self.modules, choices):
            program = introspect.compiled_memory(run)
        for p in self.model.parameters():
            p.grad = None
        self.say(
            f" peak {program.total_bytes / _MIB:.1f} MiB, {time.perf_counter() - started:.1f} s",
            start="",
        )
        return _Measured(program.total_bytes, program.flops)

    def plan(
        self,
        choices: dict[str, str],
        costs: list[BlockCost],
        budget: int,
        measured: _Measured,
        unplanned: _Measured,
        predicted: int,
    ) -> CheckpointPlan:
        return CheckpointPlan(
            choices=choices,
            budget_bytes=budget,
            peak_bytes=measured.peak_bytes,
            predicted_peak_bytes=int(predicted),
            recompute_flops=measured.flops - unplanned.flops,
            unplanned_peak_bytes=unplanned.peak_bytes,
            unplanned_flops=unplanned.flops,
            costs=tuple(costs),
            compiles=self.compiles,
            _names=weakref.WeakKeyDictionary({m: n for n, m in self.modules.items()}),
        )


class _Calibrated:
    """The cost model fitted to two compiled anchors: exact at both by construction."""

    def __init__(self, costs: list[BlockCost], unplanned_peak: int, full_peak: int) -> None:
        self.costs = costs
        self.unplanned_peak = unplanned_peak
        self.modelled_unplanned = modelled_peak(costs, [NONE] * len(costs))
        spread = self.modelled_unplanned - modelled_peak(costs, [FULL] * len(costs))
        # Compiled bytes saved per modelled byte saved; XLA fuses, and keeps less than autograd.
        self.scale = max(0.0, (unplanned_peak - full_peak) / spread) if spread > 0 else 0.0

    def predict(self, choices: Sequence[str]) -> int:
        saved = self.modelled_unplanned - modelled_peak(self.costs, choices)
        return round(self.unplanned_peak - self.scale * saved)

    def solve(self, budget: float) -> tuple[str, ...] | None:
        if self.scale == 0:
            fits = budget >= self.unplanned_peak
            return tuple([NONE] * len(self.costs)) if fits else None
        limit = self.modelled_unplanned - (self.unplanned_peak - budget) / self.scale
        return solve(self.costs, math.floor(limit))
