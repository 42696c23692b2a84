"""xla_wrap.plan_checkpointing: the exact solver, the plans it makes on XLA:CPU against every
uniform plan, applying a plan, and the errors."""

from __future__ import annotations

import copy
import functools
import itertools
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import wrap_policies
from xla_wrap.bench.models import MlpBlock, TransformerBlock, build
from xla_wrap.bench.plan import compare_plans
from xla_wrap.internal import (
    DOTS,
    FULL,
    NONE,
    OFFLOAD,
    BlockCost,
    modelled_peak,
    objective,
    repeated_blocks,
    solve,
)

# --- the solver, without XLA -----------------------------------------------------------------


def _cost(name: str, kept: dict[str, int], flops: dict[str, int]) -> BlockCost:
    return BlockCost(
        name=name,
        kept_bytes=kept,
        recompute_flops=flops,
        offloaded_bytes={c: (kept[NONE] if c == OFFLOAD else 0) for c in kept},
        working_bytes=kept[NONE],
        choices=tuple(kept),
    )


def test_modelled_peak_is_the_largest_backward_working_set_after_what_earlier_blocks_keep() -> None:
    costs = [_cost(str(i), {NONE: 10, FULL: 1}, {NONE: 0, FULL: 5}) for i in range(3)]
    # All kept: block 2's backward holds 10 + 10 kept before it and its own 10.
    assert modelled_peak(costs, [NONE, NONE, NONE]) == 30
    # All recomputed: 1 + 1 kept before block 2, then its 10 again.
    assert modelled_peak(costs, [FULL, FULL, FULL]) == 12
    # The last block's choice changes nothing: it is differentiated first.
    assert modelled_peak(costs, [FULL, FULL, NONE]) == 12
    assert modelled_peak(costs, [NONE, FULL, FULL]) == 21


_choices = st.lists(st.sampled_from([DOTS, FULL, OFFLOAD]), unique=True).map(
    lambda extra: (NONE, *extra)
)


@st.composite
def _problems(draw: Any) -> tuple[list[BlockCost], int]:
    costs = []
    for i in range(draw(st.integers(1, 5))):
        choices = draw(_choices)
        kept = {c: draw(st.integers(0, 40)) for c in choices}
        kept[NONE] = max(kept.values())
        flops = {c: (0 if c == NONE else draw(st.integers(0, 30))) for c in choices}
        costs.append(_cost(str(i), kept, flops))
    return costs, draw(st.integers(0, 250))


@settings(max_examples=300, deadline=None)
@given(_problems())
def test_the_solver_finds_the_cheapest_choices_that_fit_as_enumeration_does(
    problem: tuple[list[BlockCost], int],
) -> None:
    costs, limit = problem
    every = itertools.product(*(c.choices for c in costs))
    fitting = [chosen for chosen in every if modelled_peak(costs, chosen) <= limit]
    got = solve(costs, limit)
    if not fitting:
        assert got is None
        return
    assert got is not None
    assert modelled_peak(costs, got) <= limit
    assert objective(costs, got) == min(objective(costs, chosen) for chosen in fitting)


def test_with_room_for_everything_the_solver_changes_nothing() -> None:
    costs = [_cost(str(i), {NONE: 10, DOTS: 4, FULL: 1}, {NONE: 0, DOTS: 0, FULL: 5})
             for i in range(4)]  # fmt: skip
    assert solve(costs, 40) == (NONE,) * 4
    # Just under: one block keeps its dots (free by FLOPs), not its whole forward recomputed.
    assert solve(costs, 39).count(DOTS) == 1  # type: ignore[union-attr]


# --- default candidates ------------------------------------------------------------------------


def test_the_default_candidates_are_the_repeated_blocks_with_parameters() -> None:
    stack = build("transformer", {"blocks": 3, "dim": 8, "heads": 2, "seq": 4, "batch": 1,
                                  "dropout_pct": 0, "mask_buffer": 0}).model  # fmt: skip
    assert [name for name, _ in repeated_blocks(stack)] == ["blocks.0", "blocks.1", "blocks.2"]
    mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    assert [name for name, _ in repeated_blocks(mlp)] == ["0", "2"]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


# --- plans on XLA:CPU ------------------------------------------------------------------------

_TINY = {
    "transformer": {"blocks": 4, "dim": 32, "heads": 2, "seq": 16, "batch": 4, "mask_buffer": 0},
    "uneven": {"blocks": 4, "dim": 32, "batch": 64},
}


@functools.cache
def _on_device(name: str, dropout_pct: int, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """One model per configuration for the whole module: planning a model again reuses the
    steps it compiled for it (tests must leave it as they found it)."""
    workload = build(name, dict(_TINY[name], dropout_pct=dropout_pct))
    model = workload.model.to(device)
    args = tuple(a.to(device) for a in workload.args)
    kwargs = {k: v.to(device) for k, v in workload.kwargs.items()}
    return model, args, kwargs


# The transformer without Dropout is in the benchmark's plan section (`--plan`).
_CASES = {
    "transformer, Dropout 0.2": ("transformer", 20),
    "uneven blocks, Dropout 0.2": ("uneven", 20),
}


@pytest.fixture(scope="module", params=list(_CASES), ids=list(_CASES))
def compared(request: pytest.FixtureRequest, xla_device: torch.device) -> dict[str, Any]:
    """Every uniform plan compiled, and a plan at three budgets between the all-full and the
    unplanned peaks (xla_wrap.bench's plan section, tiny)."""
    name, dropout = _CASES[request.param]
    model, args, kwargs = _on_device(name, dropout, xla_device)
    return compare_plans(model, args, kwargs)


@pytest.mark.xla
def test_plans_fit_their_budgets_and_recompute_no_more_than_the_cheapest_uniform_plan_that_fits(
    compared: dict[str, Any],
) -> None:
    uniform = compared["uniform"]
    assert uniform["all full"]["peak_bytes"] < uniform["none"]["peak_bytes"]
    assert len(compared["planned"]) == 3
    for planned in compared["planned"]:
        budget = planned["budget_bytes"]
        assert planned["peak_bytes"] <= budget, planned
        fitting = [u["flops"] for u in uniform.values() if u["peak_bytes"] <= budget]
        assert fitting, "all full fits every budget of the section"
        assert planned["flops"] <= min(fitting), planned
        assert planned["compiles"] <= 3  # the anchors were compiled for the uniform plans


@pytest.fixture(scope="module")
def planned(xla_device: torch.device) -> tuple[xla_wrap.CheckpointPlan, nn.Module, tuple]:
    model, args, kwargs = _on_device("uneven", 20, xla_device)
    plan = xla_wrap.plan_checkpointing(model, *args, budget=0.9, progress=False, **kwargs)
    return plan, model, args


@pytest.mark.xla
def test_a_plan_reports_its_choices_and_the_figures_it_was_compiled_with(
    planned: tuple[xla_wrap.CheckpointPlan, nn.Module, tuple],
) -> None:
    plan, _, _ = planned
    assert list(plan.choices) == [f"blocks.{i}" for i in range(4)]
    assert set(plan.choices.values()) <= {NONE, DOTS, FULL}  # XLA:CPU offloads nothing
    assert plan.checkpointed, "a budget of 0.9 needs some checkpointing"
    assert plan.budget_bytes == int(0.9 * plan.unplanned_peak_bytes)
    assert plan.peak_bytes <= plan.budget_bytes
    assert plan.flops_ratio == pytest.approx(
        (plan.unplanned_flops + plan.recompute_flops) / plan.unplanned_flops
    )
    table = str(plan)
    for name, choice in plan.choices.items():
        assert re.search(rf"^{re.escape(name)}\s+{choice}\s", table, re.MULTILINE)
    assert f"compiled peak {plan.peak_bytes / 2**20:.1f} MiB" in table


@pytest.mark.xla
def test_applying_a_plan_checkpoints_exactly_its_blocks_and_keeps_gradients_bitwise(
    planned: tuple[xla_wrap.CheckpointPlan, nn.Module, tuple],
) -> None:
    plan, model, _ = planned
    assert not any(isinstance(m, xla_wrap.CheckpointWrapper) for m in model.modules())
    reference = copy.deepcopy(model).cpu()
    applied = plan.apply(copy.deepcopy(reference))
    for name, choice in plan.choices.items():
        block = applied.get_submodule(name)
        assert isinstance(block, MlpBlock)
        assert isinstance(block, xla_wrap.CheckpointWrapper) == (choice != NONE), name
        if choice != NONE:
            policy = block.checkpoint_options.policy
            assert policy is (cp.dots_saveable if choice == DOTS else None), name
    x = torch.randn(64, 32)
    grads = []
    for net in (reference, applied):
        torch.manual_seed(3)  # the same Dropout masks
        net.zero_grad()
        net(x).backward()
        grads.append([p.grad for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.xla
def test_choices_restrict_what_a_plan_may_choose(
    planned: tuple[xla_wrap.CheckpointPlan, nn.Module, tuple],
) -> None:
    plan, model, args = planned
    full_only = xla_wrap.plan_checkpointing(
        model, *args, budget=plan.budget_bytes, choices=("full",), progress=False
    )
    assert set(full_only.choices.values()) <= {NONE, FULL} and full_only.checkpointed
    assert full_only.peak_bytes <= plan.budget_bytes
    assert full_only.recompute_flops >= plan.recompute_flops  # fewer choices: no cheaper


@pytest.mark.xla
def test_a_budget_above_the_unplanned_peak_gives_the_empty_plan_after_one_compile(
    xla_device: torch.device, capsys: pytest.CaptureFixture[str]
) -> None:
    model, args, kwargs = _on_device("uneven", 0, xla_device)
    plan = xla_wrap.plan_checkpointing(model, *args, budget=1.0, **kwargs)
    assert plan.checkpointed == {} and set(plan.choices.values()) == {NONE}
    assert plan.compiles == 1 and plan.peak_bytes == plan.unplanned_peak_bytes
    assert plan.recompute_flops == 0
    progress = capsys.readouterr().err
    assert "xla_wrap.plan_checkpointing: 4 candidate blocks (MlpBlock)" in progress
    assert "compile 1, the unplanned step ... peak" in progress


@pytest.mark.xla
def test_a_budget_nothing_meets_names_the_smallest_reachable_peak(
    xla_device: torch.device,
) -> None:
    model, args, kwargs = _on_device("uneven", 0, xla_device)
    with pytest.raises(xla_wrap.BudgetUnreachableError) as raised:
        xla_wrap.plan_checkpointing(model, *args, budget=1000, progress=False, **kwargs)
    message = str(raised.value)
    assert message.startswith("xla_wrap.plan_checkpointing: no plan fits a budget of 0.0 MiB")
    reachable = raised.value.smallest_peak_bytes
    assert f"smallest reachable peak is {reachable / 2**20:.1f} MiB ({reachable} bytes" in message
    # No higher than every block fully recomputed, compiled here on its own...
    for block in model.blocks:
        xla_wrap.checkpoint_wrapper(block)
    program = xla_wrap.introspect.compiled_memory(lambda: _step(model, args))
    for block in model.blocks:
        xla_wrap.unwrap(block)
    assert reachable <= program.total_bytes + 4096  # the fresh-compile markers aside
    # ... and reachable indeed.
    plan = xla_wrap.plan_checkpointing(model, *args, budget=reachable, progress=False, **kwargs)
    assert plan.peak_bytes <= reachable


def _step(model: nn.Module, args: tuple) -> None:
    import torch_xla

    model.zero_grad(set_to_none=True)
    model(*args).backward()
    extra = torch.zeros(12345, device=args[0].device)  # not the planner's program: compile afresh
    torch_xla.sync()
    del extra
    model.zero_grad(set_to_none=True)


# --- refusals ----------------------------------------------------------------------------------


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.blocks[0](x) + self.blocks[1](x)).sum()


@pytest.mark.xla
def test_bad_input_is_refused_with_what_to_do(xla_device: torch.device) -> None:
    api = r"^xla_wrap.plan_checkpointing: "
    x = torch.randn(2, 4)
    with pytest.raises(xla_wrap.CheckpointTypeError, match=api + "expected the nn.Module"):
        xla_wrap.plan_checkpointing(lambda x: x, x, budget=0.5)
    model, xx = _Twice().to(xla_device), x.to(xla_device)
    mixed = _Twice().to(xla_device)
    mixed.blocks[1].to("cpu")
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "expected a model on one kind"):
        xla_wrap.plan_checkpointing(mixed, xx, budget=0.5)
    for budget, error in [(True, TypeError), ("1", TypeError), (0.0, ValueError),
                          (1.5, ValueError), (-5, ValueError)]:  # fmt: skip
        with pytest.raises(error, match=api + r"expected .*`budget`"):
            xla_wrap.plan_checkpointing(model, xx, budget=budget, progress=False)
    for choices, error in [("full", TypeError), (("bogus",), ValueError), ((), ValueError),
                           (("offload",), ValueError)]:  # fmt: skip
        with pytest.raises(error, match=api + r'(expected .*`choices`|"offload" needs)'):
            xla_wrap.plan_checkpointing(model, xx, budget=0.5, choices=choices)
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "candidate 'blocks.0' is called"):
        xla_wrap.plan_checkpointing(model, xx, budget=0.5, progress=False)
    with pytest.raises(xla_wrap.CheckpointTypeError, match=api + "expected a wrap policy"):
        xla_wrap.plan_checkpointing(model, xx, budget=0.5, candidates=nn.Linear)  # type: ignore[arg-type]
    stack = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)).to(xla_device)
    nested = wrap_policies.by_name("0") | wrap_policies.by_type(nn.Linear)
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "candidate '0.0' lies inside"):
        xla_wrap.plan_checkpointing(stack, xx, budget=0.5, candidates=nested)
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "found no repeated blocks"):
        xla_wrap.plan_checkpointing(nn.Linear(4, 4).to(xla_device), xx, budget=0.5)
    xla_wrap.checkpoint_wrapper(stack[1])
    with pytest.raises(xla_wrap.CheckpointValueError, match=api + "expected a model without"):
        xla_wrap.plan_checkpointing(stack, xx, budget=0.5, candidates=wrap_policies.by_name("1"))


def test_a_plan_applied_to_another_model_names_the_missing_blocks() -> None:
    plan = xla_wrap.CheckpointPlan(
        choices={"blocks.0": FULL}, budget_bytes=0, peak_bytes=0, predicted_peak_bytes=0,
        recompute_flops=0, unplanned_peak_bytes=0, unplanned_flops=0,
    )  # fmt: skip
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"without 'blocks.0'"):
        plan.apply(nn.Sequential(TransformerBlock(8, 2)))
