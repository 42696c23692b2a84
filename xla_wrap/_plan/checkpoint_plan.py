"""`CheckpointPlan`: what [`xla_wrap.plan_checkpointing()`][xla_wrap.plan_checkpointing] chose
per block, what it measured, and how to apply it."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from torch import nn

from .. import checkpoint_policies as cp
from .._core.options import CheckpointOptions, make_options
from .._core.wrapper import checkpoint_in_place
from .._layouts import names_without_wrappers
from .._support.checks import check_module, check_record
from .._support.errors import CheckpointValueError
from .cost_model import CHOICES, DOTS, FULL, NONE, OFFLOAD, BlockCost

M = TypeVar("M", bound=nn.Module)

_MIB = 2**20

#: What a plan's `*_bytes` measure on XLA: the step's compiled peak (XLA's buffer assignment).
COMPILED_PEAK = "compiled peak"
#: What they measure under `torch.compile`: the bytes the compiled forward saves for backward,
#: the model's parameters and buffers left out (AOTAutograd's partitioned graphs).
SAVED_FOR_BACKWARD = "saved for backward"


def summarize(choices: Iterable[str]) -> str:
    """`"2 full, 3 dots_saveable, 1 none"`: how many blocks take each choice, in the order
    the choices first appear."""
    counts: dict[str, int] = {}
    for choice in choices:
        counts[choice] = counts.get(choice, 0) + 1
    return ", ".join(f"{n} {choice}" for choice, n in counts.items()) or "no blocks"


def options_for(api: str, choice: str) -> CheckpointOptions | None:
    """The checkpoint options of a choice; None for a block left as it is."""
    if choice == NONE:
        return None
    if choice == DOTS:
        return make_options(api, policy=cp.dots_saveable)
    if choice == FULL:
        return make_options(api)
    if choice == OFFLOAD:
        return make_options(api, policy=cp.everything_saveable, offload_to_cpu=True)
    raise CheckpointValueError(f"{api}: unknown choice {choice!r}")


@dataclass(frozen=True)
class CheckpointPlan:
    """Which blocks to checkpoint, and how, to fit a memory budget at the least recomputation.

    Made by [`xla_wrap.plan_checkpointing()`][xla_wrap.plan_checkpointing] for the model,
    shapes and backend it measured. On XLA every figure comes from XLA (the `*_bytes` are
    compiled peaks, from its buffer assignment; the FLOPs from the optimized HLO); for a
    `torch.compile` step they come from AOTAutograd's partitioned graphs (the `*_bytes` are
    what the compiled forward saves for backward; the FLOPs those of its graphs); `measure`
    says which. `predicted_peak_bytes` is the cost model's. `print(plan)` shows a table of
    the blocks and their choices.

    Attributes:
        choices: Every candidate block's qualified name, in call order, to its choice:
            `"none"` (left as it is), `"dots_saveable"`, `"full"` or `"offload"`.
        budget_bytes: The budget the plan was made for.
        peak_bytes: The planned step's compiled peak on XLA; under `torch.compile`, the bytes
            its compiled forward saves for backward.
        predicted_peak_bytes: The cost model's peak for the plan, calibrated on the compiled
            steps (see docs/planning.md).
        recompute_flops: What the planned step computes beyond the unplanned one (FLOPs of dots
            and convolutions, compiled).
        unplanned_peak_bytes: The same figure for the step without checkpointing.
        unplanned_flops: The FLOPs of that step.
        costs: What each block keeps and recomputes under each choice (measured per block).
        compiles: How many steps (and, under `torch.compile`, blocks) the planner compiled.
        measure: What the `*_bytes` measure: `"compiled peak"` (XLA) or
            `"saved for backward"` (`torch.compile`).
    """

    choices: Mapping[str, str]
    budget_bytes: int
    peak_bytes: int
    predicted_peak_bytes: int
    recompute_flops: int
    unplanned_peak_bytes: int
    unplanned_flops: int
    costs: tuple[BlockCost, ...] = ()
    compiles: int = 0
    measure: str = COMPILED_PEAK
    # The modules the plan was made on, for FSDP's auto-wrapping (which sees modules, not names).
    _names: weakref.WeakKeyDictionary[nn.Module, str] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_record("xla_wrap.CheckpointPlan", self)
        unknown = sorted({c for c in self.choices.values() if c not in CHOICES})
        if unknown:
            raise CheckpointValueError(
                f"xla_wrap.CheckpointPlan: expected choices among {', '.join(CHOICES)}, got "
                f"{unknown}."
            )

    @property
    def checkpointed(self) -> dict[str, str]:
        """The blocks the plan checkpoints, with their choices (empty: checkpoint nothing)."""
        return {name: choice for name, choice in self.choices.items() if choice != NONE}

    @property
    def flops_ratio(self) -> float:
        """The planned step's FLOPs over the unplanned step's."""
        if not self.unplanned_flops:
            return float("nan")
        return (self.unplanned_flops + self.recompute_flops) / self.unplanned_flops

    def options_of(self, module: nn.Module) -> CheckpointOptions | None:
        """The checkpoint options the plan gives `module`.

        `module` is one of the modules the plan was made on; the answer is `None` if the plan leaves
        it as it is or does not know it.

        Modules are recognised by identity, not by name: a copy of the planned model is not
        known (use [`apply()`][xla_wrap.CheckpointPlan.apply] for that).

        Args:
            module: A block of the model the plan was made on.

        Returns:
            The options to checkpoint `module` with, or `None`.

        Raises:
            CheckpointTypeError: If `module` is not an `nn.Module`.
        """
        check_module("xla_wrap.CheckpointPlan.options_of", module, "an nn.Module as `module`")
        name = self._names.get(module)
        if name is None:
            return None
        return options_for("xla_wrap.CheckpointPlan", self.choices[name])

    def apply(self, model: M) -> M:
        """Checkpoint, in place, exactly the blocks the plan chose, each with its choice.

        Blocks are found by qualified name, so `model` may be the model planned or a copy of
        it; FSDP wrappers added since are looked through (the checkpoint goes inside each
        unit).

        Args:
            model: The model the plan was made for, or a copy of it.

        Returns:
            `model` itself.

        Raises:
            CheckpointTypeError: If `model` is not an `nn.Module`.
            CheckpointValueError: If a planned block is not in `model`, or is already
                checkpointed with other options.
        """
        return apply_choices("xla_wrap.CheckpointPlan.apply", model, self.choices)

    def __str__(self) -> str:
        rows = [("block", "choice", "kept MiB", "recompute GFLOP")]
        by_name = {cost.name: cost for cost in self.costs}
        for name, choice in self.choices.items():
            cost = by_name.get(name)
            kept = f"{cost.kept_bytes[choice] / _MIB:.2f}" if cost else "-"
            flops = f"{cost.recompute_flops[choice] / 1e9:.3f}" if cost else "-"
            rows.append((name, choice, kept, flops))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        digits = 1 if self.measure == COMPILED_PEAK else 2  # saved bytes: a smaller figure

        def mib(size: int) -> str:
            return f"{size / _MIB:.{digits}f}"

        lines += [
            f"blocks: {summarize(self.choices.values())}",
            f"budget {mib(self.budget_bytes)} MiB; {self.measure} {mib(self.peak_bytes)} MiB "
            f"(predicted {mib(self.predicted_peak_bytes)}, "
            f"unplanned {mib(self.unplanned_peak_bytes)})",
            f"FLOPs {self.flops_ratio:.3f}x of the unplanned step "
            f"(+{self.recompute_flops / 1e9:.3f} GFLOP recomputed); {self.compiles} compiles",
        ]
        return "\n".join(lines)


def apply_choices(api: str, model: M, choices: Mapping[str, str]) -> M:
    """Checkpoint, in place, each block of `model` named in `choices` with its choice."""
    check_module(api, model, "the nn.Module the plan was made for")
    modules = names_without_wrappers(model)
    chosen = {name: choice for name, choice in choices.items() if choice != NONE}
    missing = [name for name in chosen if name not in modules]
    if missing:
        raise CheckpointValueError(
            f"{api}: expected a model with the planned blocks, got one without "
            f"{', '.join(map(repr, missing[:3]))}. Apply the plan to the model it was made "
            "for (or a copy of it), before anything renames its submodules."
        )
    for name, choice in chosen.items():
        options = options_for(api, choice)
        assert options is not None
        checkpoint_in_place(api, modules[name], options)
    return model
