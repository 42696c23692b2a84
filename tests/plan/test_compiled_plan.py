"""xla_wrap.plan_checkpointing for a `torch.compile` step (eager CPU): every accepted budget is
met, a lower budget never saves more, an unreachable one names the least reachable, and the
figures agree with the partitioned graphs measured here independently."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import introspect
from xla_wrap.bench.models import MlpBlock, UnevenStack, build
from xla_wrap.internal import DOTS, FULL, NONE, apply_choices

SIZES = {"blocks": 4, "dim": 32, "batch": 64, "dropout_pct": 10}


def _stack() -> tuple[nn.Module, torch.Tensor]:
    work = build("uneven", SIZES)
    return work.model, work.args[0]


def _measured(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """What the compiled step saves for backward (parameters and buffers left out) and the
    FLOPs of its graphs, measured here with the public introspection."""
    torch._dynamo.reset()  # one lambda for every model: its guards would fill Dynamo's cache
    graphs = introspect.PartitionedGraphs()
    torch.compile(lambda: model(x).sum(), backend=graphs.backend, fullgraph=True)().backward()
    model.zero_grad(set_to_none=True)
    saved = graphs.saved_bytes(excluding=[*model.parameters(), *model.buffers()])
    return saved, graphs.forward_flops() + graphs.backward_flops()


@pytest.fixture(scope="module")
def stack() -> tuple[nn.Module, torch.Tensor]:
    return _stack()


@pytest.fixture(scope="module")
def uniform(stack: tuple[nn.Module, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Each uniform plan's saved bytes and FLOPs, on copies of the stack."""
    model, x = stack
    names = [f"blocks.{i}" for i in range(SIZES["blocks"])]
    plans = {
        "none": [NONE] * 4,
        "all dots_saveable": [DOTS] * 4,
        "all full": [FULL] * 4,
        "every 2nd full": [NONE, FULL, NONE, FULL],
    }
    figures = {}
    for label, choices in plans.items():
        copied = apply_choices("test", copy.deepcopy(model), dict(zip(names, choices, strict=True)))
        figures[label] = _measured(copied, x)
    return figures


@pytest.fixture(scope="module")
def budgets(
    stack: tuple[nn.Module, torch.Tensor], uniform: dict[str, tuple[int, int]]
) -> Iterator[list[tuple[int, xla_wrap.CheckpointPlan]]]:
    """Plans for 10 budgets from the all-full step's saved bytes to the unplanned step's."""
    model, x = stack
    low, high = uniform["all full"][0], uniform["none"][0]
    sizes = [round(low + (high - low) * i / 9) for i in range(10)]
    yield [(b, xla_wrap.plan_checkpointing(model, x, budget=b, progress=False)) for b in sizes]


def test_every_accepted_budget_is_met_as_the_graphs_measure_the_applied_plan(
    stack: tuple[nn.Module, torch.Tensor], budgets: list[tuple[int, xla_wrap.CheckpointPlan]]
) -> None:
    model, x = stack
    measured: dict[object, tuple[int, int]] = {}  # each distinct plan compiled once here
    for budget, plan in budgets:
        key = tuple(plan.choices.items())
        if key not in measured:
            measured[key] = _measured(plan.apply(copy.deepcopy(model)), x)
        saved, flops = measured[key]
        assert saved == plan.peak_bytes <= budget
        assert flops == plan.unplanned_flops + plan.recompute_flops
        assert plan.measure == "saved for backward"


def test_a_lower_budget_never_saves_more_nor_recomputes_less(
    budgets: list[tuple[int, xla_wrap.CheckpointPlan]],
) -> None:
    saved = [plan.peak_bytes for _, plan in budgets]
    flops = [plan.recompute_flops for _, plan in budgets]
    assert saved == sorted(saved) and flops == sorted(flops, reverse=True)
    assert len(set(saved)) >= 4  # the budgets span plans, not one answer
    assert budgets[-1][1].checkpointed == {}  # the unplanned step's own bytes: nothing to do


def test_plans_recompute_no_more_than_the_cheapest_uniform_plan_that_fits(
    budgets: list[tuple[int, xla_wrap.CheckpointPlan]], uniform: dict[str, tuple[int, int]]
) -> None:
    unplanned_flops = uniform["none"][1]
    for budget, plan in budgets:
        fitting = [flops for saved, flops in uniform.values() if saved <= budget]
        assert plan.unplanned_flops + plan.recompute_flops <= min(fitting)
    # Somewhere the plan is strictly cheaper than every uniform plan that fits.
    assert any(
        plan.unplanned_flops + plan.recompute_flops
        < min(f for s, f in uniform.values() if s <= budget)
        for budget, plan in budgets
    )
    assert budgets[0][1].unplanned_flops == unplanned_flops


def test_a_budget_below_the_least_reachable_is_refused_naming_it(
    stack: tuple[nn.Module, torch.Tensor], uniform: dict[str, tuple[int, int]]
) -> None:
    model, x = stack
    least = uniform["all full"][0]  # every block keeping only its input
    with pytest.raises(xla_wrap.BudgetUnreachableError, match=rf"\({least} bytes") as caught:
        xla_wrap.plan_checkpointing(model, x, budget=least - 1, progress=False)
    assert caught.value.smallest_peak_bytes == least
    fraction = xla_wrap.plan_checkpointing(model, x, budget=0.5, progress=False)
    assert fraction.budget_bytes == int(0.5 * uniform["none"][0]) >= fraction.peak_bytes


def test_planning_again_compiles_nothing_and_leaves_the_model_as_it_was(
    stack: tuple[nn.Module, torch.Tensor],
    budgets: list[tuple[int, xla_wrap.CheckpointPlan]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, x = stack
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    rng = torch.get_rng_state()
    calls: list[Any] = []
    original = torch.compile
    try:
        torch.compile = lambda *a, **k: calls.append(a) or original(*a, **k)  # type: ignore[assignment]
        xla_wrap.plan_checkpointing(model, x, budget=budgets[3][0])
    finally:
        torch.compile = original
    assert calls == []
    assert "measured before" in capsys.readouterr().err
    assert torch.equal(torch.get_rng_state(), rng)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))
    model.zero_grad(set_to_none=True)


def test_a_fresh_plan_leaves_buffers_random_state_and_gradients_as_they_were() -> None:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)))
    x = torch.randn(16, 8)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    xla_wrap.plan_checkpointing(model, x, budget=1.0, progress=False)
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_the_report_says_what_the_bytes_measure(
    budgets: list[tuple[int, xla_wrap.CheckpointPlan]],
) -> None:
    budget, plan = budgets[2]
    text = str(plan)
    assert re.search(rf"budget {budget / 2**20:.2f} MiB; saved for backward", text)
    for name, choice in plan.choices.items():
        assert re.search(rf"^{re.escape(name)}\s+{choice}\s", text, re.M)


def test_applying_a_compiled_plan_keeps_the_compiled_gradients_with_dropout(
    stack: tuple[nn.Module, torch.Tensor], budgets: list[tuple[int, xla_wrap.CheckpointPlan]]
) -> None:
    model, x = stack
    plan = next(p for _, p in budgets if {FULL, DOTS} <= set(p.choices.values()) or FULL in
                set(p.choices.values()))  # fmt: skip
    grads = []
    for variant in (copy.deepcopy(model), plan.apply(copy.deepcopy(model))):
        torch.manual_seed(3)
        torch.compile(variant, backend="aot_eager", fullgraph=True)(x).sum().backward()
        grads.append([p.grad for p in variant.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MlpBlock(8, 8, 0.0) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        return self.blocks[1](x)


def test_bad_input_under_compile_is_refused_with_what_to_do() -> None:
    api = r"^xla_wrap.plan_checkpointing: "
    x = torch.randn(4, 8)
    with pytest.raises(xla_wrap.CheckpointError, match=api + "expected a step torch.compile"):
        xla_wrap.plan_checkpointing(_Breaks(), x, budget=0.5, progress=False)
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + '"offload" is not planned'):
        xla_wrap.plan_checkpointing(_Breaks(), x, budget=0.5, choices=("offload",))
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "expected a model with its"):
        xla_wrap.plan_checkpointing(UnevenStack(2, 8, 0.0).to("meta"), x, budget=0.5)
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "expected `loss` to return"):
        xla_wrap.plan_checkpointing(
            UnevenStack(2, 8, 0.0), x, budget=0.5, loss=lambda out: out.expand(2), progress=False
        )


# --- the partitioned graphs' figures ---------------------------------------------------------


def test_graph_flops_are_what_the_flop_counter_counts_in_an_eager_step() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model, x = build("uneven", {**SIZES, "dropout_pct": 0}).model, torch.randn(64, 32)
    graphs = introspect.PartitionedGraphs()
    torch.compile(model, backend=graphs.backend, fullgraph=True)(x).sum().backward()
    with FlopCounterMode(display=False) as forward:
        loss = model(x).sum()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    assert graphs.forward_flops() == forward.get_total_flops() > 0
    assert graphs.backward_flops() == backward.get_total_flops() > 0


def test_saved_bytes_count_neither_the_outputs_nor_what_is_excluded() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))

    def two_losses(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = model(x)
        return y.sum(), y.square().mean()

    graphs = introspect.PartitionedGraphs()
    first, second = torch.compile(two_losses, backend=graphs.backend, fullgraph=True)(
        torch.randn(4, 8)
    )
    (first + second).backward()
    assert graphs.saved_bytes() == graphs.saved_bytes(outputs=2) < graphs.saved_bytes(outputs=1)
    # What backward reads of the parameters: the weights that carry the input's gradient back
    # through BatchNorm and the last Linear (the first one's input needs none).
    held = sum(w.numel() * w.element_size() for w in (model[1].weight, model[3].weight))
    assert graphs.saved_bytes(excluding=model.parameters()) == graphs.saved_bytes() - held
