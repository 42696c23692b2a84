"""The blocks a plan is made of, whatever measures them: which modules are candidates, what
each is called with (captured once, as stand-ins), which of them are alike, and checkpointing
them for a while. Shared by the XLA planner (`planner`) and the compiled one
(`compiled_planner`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .._core.wrapper import CheckpointWrapper, checkpoint_in_place, unwrap
from .._layouts import LAYER_INDEX_ATTRIBUTES
from .._scan.module_list import ScannedLayers
from .._support import fingerprint
from .._support.checks import is_number
from .._support.errors import CheckpointTypeError, CheckpointValueError, describe
from ..wrap_policies import WrapPolicy
from .checkpoint_plan import options_for
from .cost_model import CHOICES, DOTS, FULL, NONE, OFFLOAD

API = "xla_wrap.plan_checkpointing"


def find_candidates(model: nn.Module, policy: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """The blocks a plan may checkpoint: those `policy` selects, or the repeated blocks; refused
    where one is checkpointed or scanned already, or lies inside another."""
    if policy is None:
        blocks = repeated_blocks(model)
        if not blocks:
            raise CheckpointValueError(
                f"{API}: found no repeated blocks in {type(model).__name__} (modules of one "
                "class, two or more in a ModuleList or Sequential). Say which blocks the plan "
                "may checkpoint: `candidates=xla_wrap.wrap_policies.by_type(Block)`."
            )
    elif isinstance(policy, WrapPolicy):
        blocks = [(n, m) for n, m in policy.select(model) if m is not model]
        if not blocks:
            raise CheckpointValueError(
                f"{API}: the policy {policy!r} selects no submodule of "
                f"{type(model).__name__}. Check the classes, names or sizes it looks for."
            )
    else:
        raise CheckpointTypeError(
            f"{API}: expected a wrap policy (xla_wrap.wrap_policies) as `candidates`, got "
            f"{describe(policy)}. Example: `candidates=xla_wrap.wrap_policies.by_type(Block)`."
        )
    for name, module in model.named_modules():
        if isinstance(module, (CheckpointWrapper, ScannedLayers)):
            what = "checkpointed" if isinstance(module, CheckpointWrapper) else "scanned"
            raise CheckpointValueError(
                f"{API}: expected a model without checkpointing, got {name or 'the model'} "
                f"{what} already. Plan on the model as it is without it (`xla_wrap.unwrap`), "
                "then apply the plan."
            )
    inside = {id(m): n for n, m in blocks}
    for name, module in blocks:
        for sub in module.modules():
            if sub is not module and id(sub) in inside:
                raise CheckpointValueError(
                    f"{API}: candidate {inside[id(sub)]!r} lies inside candidate {name!r}; a "
                    "checkpoint cannot nest in another. Narrow `candidates` to one level."
                )
    return blocks


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules with parameters whose class occurs at least twice among the children of a
    `ModuleList` or `Sequential`, outermost first; nothing inside them is looked at."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        repeated: set[type] = set()
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            classes = [type(c) for _, c in children if any(True for _ in c.parameters())]
            repeated = {cls for cls in classes if classes.count(cls) > 1}
        for name, child in children:
            qualified = f"{prefix}{name}"
            if type(child) in repeated:
                found.append((qualified, child))
            else:
                visit(f"{qualified}.", child)

    visit("", model)
    return found


def checked_loss(loss: object) -> Callable[[Any], torch.Tensor]:
    if not callable(loss):
        raise CheckpointTypeError(
            f"{API}: expected a callable `loss(output) -> scalar tensor`, got {describe(loss)}."
        )
    return loss


def summed(output: Any) -> torch.Tensor:
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    floating = [t.float().sum() for t in tensors if t.is_floating_point() and t.requires_grad]
    if not floating:
        raise CheckpointValueError(
            f"{API}: the model's output has no floating-point tensor that requires grad, so "
            "there is no backward to plan. Pass `loss=` to say what to differentiate."
        )
    return torch.stack(floating).sum()


def check_budget(budget: object) -> None:
    if not is_number(budget):
        raise CheckpointTypeError(
            f"{API}: expected `budget` in bytes (int) or as a fraction of the unplanned peak "
            f"(float in (0, 1]), got {describe(budget)}."
        )
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise CheckpointValueError(
            f"{API}: expected a fraction in (0, 1] of the unplanned peak as a float "
            f"`budget`, got {budget}. Pass bytes as an int (`budget=16 * 2**30`)."
        )
    if isinstance(budget, int) and budget <= 0:
        raise CheckpointValueError(f"{API}: expected a positive `budget` in bytes, got {budget}.")


def budget_in_bytes(budget: int | float, unplanned: int) -> int:
    return int(budget * unplanned) if isinstance(budget, float) else budget


@dataclass(frozen=True)
class StandIn:
    """What a block's input tensor was: each trace gets fresh zeros of it on the device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    identity: int  # inputs shared between blocks (masks) stay shared within a trace

    def __repr__(self) -> str:  # part of a block's signature: no identity
        return f"StandIn({self.shape}, {self.dtype}, {self.requires_grad})"


@dataclass(frozen=True)
class Call:
    """A candidate's first call in the traced forward, its tensors replaced by stand-ins."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh zeros on the device for the stand-ins. Fresh for every trace: a checkpoint
        may put its barrier on its inputs in place, and the next trace must not inherit it;
        data, not the model's forward up to the block, so the block's HLO is its own."""
        made: dict[int, torch.Tensor] = {}

        def make(value: Any) -> Any:
            if not isinstance(value, StandIn):
                return value
            if value.identity not in made:
                zeros = torch.zeros(value.shape, dtype=value.dtype).to(value.device)
                made[value.identity] = zeros.requires_grad_(value.requires_grad)
            return made[value.identity]

        return pytree.tree_map(make, (self.args, self.kwargs))


def capture_calls(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, Call]:
    """Trace one forward (nothing runs) and record each candidate's inputs, in call order,
    and which of them require grad."""
    calls: dict[str, Call] = {}
    originals: list[torch.Tensor] = []  # alive until the end, so ids are not reused

    def stand_in(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        originals.append(value)
        return StandIn(
            tuple(value.shape), value.dtype, value.device, value.requires_grad, id(value)
        )

    def recorder(name: str) -> Callable[..., None]:
        def record(module: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
            if name in calls:
                raise CheckpointValueError(
                    f"{API}: candidate {name!r} is called more than once in a forward; its "
                    "cost would count once per call. Leave it out of `candidates`."
                )
            a, k = pytree.tree_map(stand_in, (a, k))
            calls[name] = Call(module, a, k)

        return record

    handles = [
        module.register_forward_pre_hook(recorder(name), with_kwargs=True)
        for name, module in blocks
    ]
    try:
        with torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    originals.clear()
    return calls  # in call order


def checked_choices(
    choices: Sequence[str] | None, supported: tuple[str, ...], where: str
) -> tuple[str, ...]:
    """The choices a plan may make per block, `"none"` first: `choices` checked against the
    choice names and against those `supported` here (`where` says why one is not)."""
    if choices is None:
        return (NONE, *supported)
    if not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
        raise CheckpointTypeError(
            f"{API}: expected a sequence of choice names as `choices`, got "
            f'{describe(choices)}. Example: `choices=("full",)`.'
        )
    unknown = [c for c in choices if c not in CHOICES]
    if unknown or not choices:
        raise CheckpointValueError(
            f"{API}: expected `choices` among {', '.join((DOTS, FULL, OFFLOAD))}, got "
            f'{list(choices)}. A block may always be left as it is ("none").'
        )
    for choice in choices:
        if choice != NONE and choice not in supported:
            raise CheckpointValueError(f'{API}: "{choice}" {where}. Leave it out of `choices`.')
    return (NONE, *(c for c in (DOTS, FULL, OFFLOAD) if c in choices))


def signature(call: Call) -> object:
    """Blocks with the same signature cost the same: class, tensors, settings, inputs."""
    module = call.module
    flat, spec = pytree.tree_flatten((call.args, call.kwargs))
    # Blocks differing only in a layer index are costed once (a guess the compiled check
    # verifies).
    return (
        type(module),
        module.training,
        fingerprint.parameter_entries(module),
        fingerprint.buffer_entries(module),
        tuple(
            (n, type(m), m.training, fingerprint.plain_settings(m, LAYER_INDEX_ATTRIBUTES))
            for n, m in module.named_modules()
        ),
        str(spec),
        tuple(repr(v) for v in flat),
    )


@contextmanager
def applied(modules: Mapping[str, nn.Module], choices: Mapping[str, str]) -> Iterator[None]:
    """Checkpoint `modules` by their `choices` for the duration, then undo it."""
    wrapped = []
    try:
        for name, choice in choices.items():
            options = options_for(API, choice)
            if options is not None:
                wrapped.append(checkpoint_in_place(API, modules[name], options))
        yield
    finally:
        for module in wrapped:
            unwrap(module)


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str, *, end: str = "\n", start: str = f"{API}: ") -> None:
        if self.enabled:
            print(f"{start}{message}", end=end, file=sys.stderr, flush=True)


def classes(calls: Any) -> str:
    names = sorted({type(call.module).__name__ for call in calls})
    return ", ".join(names) or "none"
