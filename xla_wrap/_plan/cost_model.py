"""The planner's cost model and its exact solver: which choice per block minimises the
recomputed FLOPs while the modelled peak stays under a limit.

The peak model follows the order of a training step. The forward keeps, for every block, what
its choice keeps (everything, the dot outputs, only its inputs, or nothing on the device when it
offloads). Backward then visits the blocks in reverse; while it differentiates block `i`,
block `i` holds its whole working set again (recomputed or kept, the same tensors) and the
blocks before it still hold what they kept::

    peak = max(max_i (kept_0 + ... + kept_{i-1} + working_i), kept_0 + ... + kept_{n-1})

So the last block's choice never changes the peak, and a block's saving counts for every later
block. The planner (`planner`) calibrates this model against compiled peaks; this module
knows nothing of XLA.

The solver is a dynamic program over the blocks in call order whose states are the bytes kept so
far: the future depends on nothing else, so a state that keeps more and costs no less is
dropped. The surviving states form a Pareto front, and the answer is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Keep every activation (the block is not checkpointed).
NONE = "none"
#: Keep the outputs of matrix products and convolutions; recompute the rest.
DOTS = "dots_saveable"
#: Keep only the block's inputs; recompute its whole forward.
FULL = "full"
#: Keep every activation in host memory; recompute nothing (backends with host offload only).
OFFLOAD = "offload"
#: Every choice a plan can make for a block.
CHOICES = (NONE, DOTS, FULL, OFFLOAD)


@dataclass(frozen=True)
class BlockCost:
    """What one block costs under each choice open to it.

    Attributes:
        name: The block's qualified name in the model.
        kept_bytes: Per choice, the bytes the forward leaves on the device for backward.
        recompute_flops: Per choice, the FLOPs of the dots and convolutions backward recomputes.
        offloaded_bytes: Per choice, the bytes sent to host memory and back.
        working_bytes: The bytes the block holds while backward differentiates it.
        choices: The choices a plan may make for it (the costs may know more: the planner
            measures every block fully recomputed, to calibrate).
    """

    name: str
    kept_bytes: Mapping[str, int]
    recompute_flops: Mapping[str, int]
    offloaded_bytes: Mapping[str, int]
    working_bytes: int
    choices: tuple[str, ...]


def modelled_peak(costs: Sequence[BlockCost], choices: Sequence[str]) -> int:
    """The peak model above for `choices` (one per block, in call order), without the part
    of the step no choice changes."""
    kept = 0
    peak = 0
    for cost, choice in zip(costs, choices, strict=True):
        peak = max(peak, kept + cost.working_bytes)
        kept += cost.kept_bytes[choice]
    return max(peak, kept)


# Lexicographic: recomputed FLOPs first, then bytes moved to the host, then how many blocks
# change at all (equal work left as it is: the empty plan when nothing needs to be saved).
Objective = tuple[int, int, int]


def objective(costs: Sequence[BlockCost], choices: Sequence[str]) -> Objective:
    flops = sum(c.recompute_flops[x] for c, x in zip(costs, choices, strict=True))
    moved = sum(c.offloaded_bytes[x] for c, x in zip(costs, choices, strict=True))
    return flops, moved, sum(x != NONE for x in choices)


def solve(costs: Sequence[BlockCost], limit: int) -> tuple[str, ...] | None:
    """The choices of least `objective()` whose `modelled_peak()` is at most `limit`
    (ties broken by peak among the states the pruning kept); None if no choices fit."""
    # state: kept bytes so far -> (objective, peak so far, choices)
    front: list[tuple[int, Objective, int, tuple[str, ...]]] = [(0, (0, 0, 0), 0, ())]
    for cost in costs:
        grown = []
        for kept, (flops, moved, changed), peak, chosen in front:
            reached = max(peak, kept + cost.working_bytes)
            if reached > limit:
                continue
            for choice in cost.choices:
                grown.append(
                    (
                        kept + cost.kept_bytes[choice],
                        (
                            flops + cost.recompute_flops[choice],
                            moved + cost.offloaded_bytes[choice],
                            changed + (choice != NONE),
                        ),
                        reached,
                        (*chosen, choice),
                    )
                )
        front = _pareto(grown)
    fitting = [(obj, max(peak, kept), chosen) for kept, obj, peak, chosen in front]
    fitting = [entry for entry in fitting if entry[1] <= limit]
    if not fitting:
        return None
    return min(fitting)[2]


def lowest_choices(costs: Sequence[BlockCost]) -> tuple[str, ...]:
    """Choices of the least `modelled_peak()`: each block keeping its least."""
    return tuple(min(c.choices, key=c.kept_bytes.__getitem__) for c in costs)


def _pareto(
    states: list[tuple[int, Objective, int, tuple[str, ...]]],
) -> list[tuple[int, Objective, int, tuple[str, ...]]]:
    """Drop every state that keeps at least as much as another and costs no less. Peaks are
    not compared: a state on the front has passed every limit check so far, and what lies
    ahead depends only on the bytes kept."""
    states.sort(key=lambda s: (s[0], s[1], s[2]))
    front = []
    best: Objective | None = None
    for state in states:
        if best is None or state[1] < best:
            front.append(state)
            best = state[1]
    return front
