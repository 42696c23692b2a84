"""Save policies (xla_wrap.checkpoint_policies) and checkpoint_name: gradients unchanged, and
exactly the selected values kept, proven by what the optimized HLO still computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import introspect

from models import BATCH, WIDTH, Stack, assert_same, train_step, wrapped_copy

HIDDEN = 4 * WIDTH


class Mlp(nn.Module):
    """x -> fc1 -> tanh -> fc2 -> tanh, plus x. Backward reads the fc1 and fc2 outputs (through
    the tanh outputs), so full recomputation repeats both matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:  # Stack passes scale, mask
        h1 = xla_wrap.checkpoint_name(self.fc1(x), "fc1")
        h2 = xla_wrap.checkpoint_name(self.fc2(self.drop(torch.tanh(h1))), "fc2")
        return x + torch.tanh(h2)


def _keeps_wide_linear(op: cp.Op) -> bool:
    return op.function == "linear" and op.shapes[0][-1] == HIDDEN


# policy -> how many of each block's two matrix products the recomputation repeats
POLICIES: dict[str, tuple[Any, int]] = {
    "nothing_saveable": (cp.nothing_saveable, 2),
    "dots_saveable": (cp.dots_saveable, 0),
    "dots_saveable-by-name": ("dots_saveable", 0),
    "save_only_these_names-fc1": (cp.save_only_these_names("fc1"), 1),
    "save_only_these_names-fc2": (cp.save_only_these_names("fc2"), 1),
    "save_from_both_policies": (
        cp.save_from_both_policies(
            cp.save_only_these_names("fc1"), cp.save_only_these_names("fc2")
        ),
        0,
    ),
    "callable": (_keeps_wide_linear, 1),
}


def _wrap_blocks(model: nn.Module, policy: Any) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = xla_wrap.checkpoint_wrapper(block, policy=policy)


def _stack() -> nn.Module:
    model = Stack()
    model.blocks = nn.ModuleList(Mlp() for _ in model.blocks)
    return model


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_gives_the_unwrapped_gradients_with_dropout(name: str) -> None:
    policy, _ = POLICIES[name]
    torch.manual_seed(0)
    model = _stack()
    twin = wrapped_copy(model, lambda m: _wrap_blocks(m, policy))
    cpu = torch.device("cpu")
    assert_same(train_step(model, cpu, seed=3), train_step(twin, cpu, seed=3), cpu)


def test_kept_values_are_what_the_block_saves() -> None:
    block = Mlp()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    def saved(policy: Any) -> list[tuple[str, tuple[int, ...]]]:
        residuals = introspect.saved_residuals(
            lambda t: xla_wrap.checkpoint(block, t, policy=policy), x
        )
        return [(r.kind, r.shape) for r in residuals]

    assert saved(cp.nothing_saveable) == [("input", (BATCH, WIDTH))]
    assert saved(cp.dots_saveable) == [
        ("input", (BATCH, WIDTH)),
        ("activation", (BATCH, HIDDEN)),
        ("activation", (BATCH, WIDTH)),
    ]
    assert saved(cp.save_only_these_names("fc1")) == [
        ("input", (BATCH, WIDTH)),
        ("activation", (BATCH, HIDDEN)),
    ]


def test_everything_saveable_is_a_plain_call() -> None:
    block = Mlp()
    y = xla_wrap.checkpoint(block, torch.randn(BATCH, WIDTH), policy=cp.everything_saveable)
    assert y.grad_fn.name() == "AddBackward0"


def test_policy_sees_functions_names_and_shapes() -> None:
    seen: list[cp.Op] = []

    def policy(op: cp.Op) -> bool:
        seen.append(op)
        return False

    xla_wrap.checkpoint(Mlp().eval(), torch.randn(BATCH, WIDTH), policy=policy).sum().backward()
    functions = [(op.function, op.name) for op in seen]
    assert functions == [
        ("linear", None),
        ("checkpoint_name", "fc1"),
        ("tanh", None),
        ("dropout", None),
        ("linear", None),
        ("checkpoint_name", "fc2"),
        ("tanh", None),
        ("add", None),
    ]
    assert seen[0].shapes == ((BATCH, HIDDEN),) and seen[0].nbytes == 4 * BATCH * HIDDEN


def test_checkpoint_name_outside_a_checkpoint_returns_the_tensor() -> None:
    x = torch.randn(3)
    assert xla_wrap.checkpoint_name(x, "anything") is x


def test_kept_value_modified_in_place_afterwards_is_refused() -> None:
    linear = nn.Linear(WIDTH, WIDTH)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = linear(x)
        h.mul_(2)
        return h.tanh()

    with pytest.raises(xla_wrap.CheckpointError, match=r"kept the output of `linear`.*in place"):
        xla_wrap.checkpoint(block, torch.randn(BATCH, WIDTH), policy=cp.dots_saveable)


def test_recomputation_calling_other_functions_is_refused_naming_the_first() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        h = x.cos() if xla_wrap.is_recomputing() else x.sin()
        return h.exp()

    y = xla_wrap.checkpoint(block, torch.randn(3, requires_grad=True), policy=cp.dots_saveable)
    with pytest.raises(
        xla_wrap.CheckpointError,
        match=r"called `cos` as operation 0, where the forward called `sin`",
    ):
        y.sum().backward()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: xla_wrap.checkpoint(nn.Tanh(), torch.ones(2), policy="dot_saveable"),
            xla_wrap.CheckpointValueError,
            r"unknown policy name 'dot_saveable'.*Did you mean 'dots_saveable'",
        ),
        (
            lambda: xla_wrap.checkpoint_wrapper(nn.Tanh(), policy=3),
            xla_wrap.CheckpointTypeError,
            r"^xla_wrap.checkpoint_wrapper: expected a policy",
        ),
        (
            lambda: xla_wrap.checkpoint(
                nn.Tanh(), torch.ones(2), policy=cp.dots_saveable, use_reentrant=True
            ),
            xla_wrap.CheckpointValueError,
            r"needs the non-reentrant engine.*use_reentrant=False",
        ),
        (
            lambda: xla_wrap.checkpoint(
                nn.Tanh(), torch.ones(2, requires_grad=True), policy=lambda op: "yes"
            ),
            xla_wrap.CheckpointTypeError,
            r"returned str 'yes' for Op\(function='tanh'.*True \(keep\), False",
        ),
        (
            lambda: xla_wrap.checkpoint_name([1.0], "h"),
            xla_wrap.CheckpointTypeError,
            r"^xla_wrap.checkpoint_name: expected a tensor to tag, got list",
        ),
        (
            lambda: xla_wrap.checkpoint_name(torch.ones(1), 7),
            xla_wrap.CheckpointTypeError,
            r"expected a string as `name`",
        ),
        (
            lambda: cp.save_only_these_names(),
            xla_wrap.CheckpointValueError,
            r"save_only_these_names: expected at least one name",
        ),
        (
            lambda: cp.save_only_these_names("a", 1),
            xla_wrap.CheckpointTypeError,
            r"expected names as strings, got int",
        ),
        (
            lambda: cp.save_and_offload_only_these_names(
                names_which_can_be_saved=["a"], names_which_can_be_offloaded=["a"]
            ),
            xla_wrap.CheckpointValueError,
            r"\['a'\] are both saved and offloaded",
        ),
        (
            lambda: xla_wrap.apply_activation_checkpointing(
                nn.Sequential(nn.Tanh()), lambda m: False, policy="nope"
            ),
            xla_wrap.CheckpointValueError,
            r"^xla_wrap.apply_activation_checkpointing: unknown policy name 'nope'",
        ),
    ],
)
def test_bad_policy_input_gets_an_error_naming_the_api_and_the_fix(
    call: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call()


@pytest.mark.xla
def test_hlo_recomputes_exactly_the_products_each_policy_leaves_out(
    xla_device: torch.device,
) -> None:
    import torch_xla

    torch.manual_seed(0)
    blocks = 3
    base = nn.Sequential(*(Mlp() for _ in range(blocks))).to(xla_device)

    def dots(policy: Any, rows: int) -> int:
        # Each policy gets its own batch size: policies that keep the same values build the
        # same program, which XLA would otherwise take from its cache without a report.
        x = torch.randn(rows, WIDTH, device=xla_device)
        model = nn.Sequential(
            *(b if policy is None else xla_wrap.checkpoint_wrapper(b, policy=policy) for b in base)
        )

        def step() -> None:
            # The loss stays alive, so it is an output: else the last block's forward is dead
            # code and only its recomputation would remain.
            loss = model(x).sum()
            loss.backward()
            torch_xla.sync()

        return introspect.compiled_memory(step).count("dot")

    plain = dots(None, BATCH)
    for rows, (name, (policy, recomputed)) in enumerate(POLICIES.items(), start=BATCH + 1):
        assert dots(policy, rows) == plain + recomputed * blocks, name
