"""Save policies (xla_wrap.checkpoint_policies) and checkpoint_name: gradients unchanged, and
exactly the selected values kept, proven by what the optimized HLO still computes."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import introspect

from models import BATCH, WIDTH, Scores, Stack, assert_same, train_step, wrap_blocks, wrapped_copy

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
    "dots_with_no_batch_dims_saveable": (cp.dots_with_no_batch_dims_saveable, 0),
    "save_any_names_but_these-fc2": (cp.save_any_names_but_these("fc2"), 1),
}


def _stack() -> nn.Module:
    model = Stack()
    model.blocks = nn.ModuleList(Mlp() for _ in model.blocks)
    return model


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_gives_the_unwrapped_gradients_with_dropout(name: str) -> None:
    policy, _ = POLICIES[name]
    torch.manual_seed(0)
    model = _stack()
    twin = wrapped_copy(model, functools.partial(wrap_blocks, policy=policy))
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
        # no ("dropout", None): in eval mode it returns its input, which is not offered
        ("linear", None),
        ("checkpoint_name", "fc2"),
        ("tanh", None),
        ("add", None),
    ]
    assert seen[0].shapes == ((BATCH, HIDDEN),) and seen[0].nbytes == 4 * BATCH * HIDDEN
    assert seen[0].input_shapes == ((BATCH, WIDTH), (HIDDEN, WIDTH), (HIDDEN,))  # x, w, b


def test_dots_with_no_batch_dims_keep_projections_and_recompute_scores() -> None:
    block = Scores()
    x = torch.randn(2, 5, WIDTH, requires_grad=True)

    def kept(policy: Any) -> list[tuple[int, ...]]:
        residuals = introspect.saved_residuals(
            lambda t: xla_wrap.checkpoint(block, t, policy=policy), x
        )
        return [r.shape for r in residuals if r.kind == "activation"]

    projection, scores, mixed = (2, 5, WIDTH), (2, 5, 5), (2, 5, WIDTH)
    assert kept(cp.dots_saveable) == [projection, projection, scores, mixed]
    assert kept(cp.dots_with_no_batch_dims_saveable) == [projection, projection]
    assert kept("dots_with_no_batch_dims_saveable") == [projection, projection]


def test_offload_dot_with_no_batch_dims_offloads_what_the_saveable_one_keeps() -> None:
    policy = cp.offload_dot_with_no_batch_dims()
    linear = cp.Op("linear", None, ((2, 8),), 64, ((2, 4), (8, 4)))
    scores = cp.Op("matmul", None, ((2, 5, 5),), 200, ((2, 5, 4), (2, 4, 5)))
    assert cp.decide(policy, linear) is cp.Decision.OFFLOAD
    assert cp.decide(policy, scores) is cp.Decision.RECOMPUTE
    for dst in ("disk", "unpinned_host"):  # JAX's other kind: no counterpart, not ignored
        with pytest.raises(xla_wrap.CheckpointValueError, match="offload_dst='pinned_host'"):
            cp.offload_dot_with_no_batch_dims("device", dst)


def test_checkpoint_name_outside_a_checkpoint_returns_the_tensor() -> None:
    x = torch.randn(3)
    assert xla_wrap.checkpoint_name(x, "anything") is x


def _grads_of(function: Any, x: torch.Tensor, **options: Any) -> torch.Tensor:
    x = x.detach().requires_grad_()
    out = function(x) if not options else xla_wrap.checkpoint(function, x, **options)
    (out**2).sum().backward()
    assert x.grad is not None
    return x.grad


def test_kept_values_modified_in_place_or_returned_are_recomputed_instead() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(WIDTH, WIDTH)

    def block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = linear(x)
        h.mul_(2)  # the kept product changes after the policy saw it
        return h.tanh(), linear(h)  # the second product is returned as it is

    x = torch.randn(BATCH, WIDTH)
    out = xla_wrap.checkpoint(block, x.requires_grad_(), policy=cp.dots_saveable)
    out[1].add_(1)  # legal on a plain output; a kept alias of it would fail in backward
    (out[0].sum() + out[1].sum()).backward()
    expected = x.grad
    x.grad = None
    plain = block(x)
    plain[1].add_(1)
    (plain[0].sum() + plain[1].sum()).backward()
    assert torch.equal(x.grad, expected)
    residuals = introspect.saved_residuals(
        lambda t: xla_wrap.checkpoint(block, t, policy=cp.dots_saveable), x
    )
    assert [r.kind for r in residuals] == ["input"]  # neither product is kept


def test_an_input_that_is_a_view_and_ops_returning_their_input_keep_occurrences_aligned() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)

    def rms_norm_then_product(x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32).contiguous()  # both return x itself: x is f32 and contiguous
        h = xla_wrap.checkpoint_name(h[:, :8], "h").float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w

    base = torch.randn(2, 4, 4)
    view = (base.requires_grad_() * 1).view(2, 16)[:, :8]
    expected = _grads_of(rms_norm_then_product, view)
    for policy in (cp.dots_saveable, cp.save_only_these_names("h")):
        assert torch.equal(_grads_of(rms_norm_then_product, view, policy=policy), expected)


def test_a_block_catching_exceptions_does_not_swallow_the_early_stop() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        try:
            h = h.exp()  # saves the last tensor: the recomputation stops in here
        except Exception:  # a fast-path/fallback pattern
            h = h.cos()
        return h * 2

    x = torch.randn(3)
    assert torch.equal(_grads_of(block, x, use_reentrant=False), _grads_of(block, x))


def test_wrapping_again_with_an_equal_policy_returns_the_wrapper() -> None:
    wrapper = xla_wrap.checkpoint_wrapper(nn.Tanh(), policy=cp.save_only_these_names("a", "b"))
    again = xla_wrap.checkpoint_wrapper(wrapper, policy=cp.save_only_these_names("b", "a"))
    assert again is wrapper
    with pytest.raises(xla_wrap.CheckpointValueError, match="is already checkpointed with"):
        xla_wrap.checkpoint_wrapper(wrapper, policy=cp.save_only_these_names("c"))


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

    def dots(policy: Any, rows: int) -> tuple[int, float]:
        # Each policy gets its own batch size: policies that keep the same values build the
        # same program, which XLA would otherwise take from its cache without a report.
        x = torch.randn(rows, WIDTH, device=xla_device)
        # Checkpointing is in place: each policy first undoes the previous one's.
        plain = [xla_wrap.unwrap(b) for b in base]
        model = nn.Sequential(
            *(b if policy is None else xla_wrap.checkpoint_wrapper(b, policy=policy) for b in plain)
        )

        def step() -> None:
            # The loss stays alive, so it is an output: else the last block's forward is dead
            # code and only its recomputation would remain.
            loss = model(x).sum()
            loss.backward()
            torch_xla.sync()

        program = introspect.compiled_memory(step)
        # FLOPs per row: the batch sizes differ, the work per row does not.
        return program.count("dot"), program.flops / rows

    plain_dots, plain_flops = dots(None, BATCH)
    for rows, (name, (policy, recomputed)) in enumerate(POLICIES.items(), start=BATCH + 1):
        count, flops = dots(policy, rows)
        assert count == plain_dots + recomputed * blocks, name
        # fc1 and fc2 cost the same FLOPs: each one recomputed adds 2 * WIDTH * HIDDEN per row.
        assert flops == plain_flops + recomputed * blocks * 2 * WIDTH * HIDDEN, name


def test_a_policy_does_not_reach_into_a_nested_checkpoint() -> None:
    seen: list[str | None] = []

    def policy(op: cp.Op) -> bool:
        seen.append(op.name)
        return False

    def inner(x: torch.Tensor) -> torch.Tensor:
        return xla_wrap.checkpoint_name(x.sin(), "inner")

    def outer(x: torch.Tensor) -> torch.Tensor:
        h = xla_wrap.checkpoint_name(x.cos(), "outer")
        return xla_wrap.checkpoint(inner, h)

    x = torch.randn(3, requires_grad=True)
    xla_wrap.checkpoint(outer, x, policy=policy).sum().backward()
    assert "outer" in seen and "inner" not in seen
