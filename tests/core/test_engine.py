"""The engine (xla_wrap/_core/engine.py): torch.autograd.grad, nesting, early stop of the
recomputation, and the determinism check. Its barrier on XLA is tested in
tests/paths/test_xla.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap

from models import BATCH, WIDTH, Block, seed_everything, sync

checkpoint = xla_wrap.checkpoint


class Counting(nn.Module):
    """Counts its calls; multiplies by a constant, which autograd saves nothing for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 3.0


def _grads(
    run: Any, x: torch.Tensor, params: list[torch.Tensor], seed: int = 5
) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    out = run(x)
    return list(torch.autograd.grad((out**2).sum(), [x, *params]))


def test_autograd_grad_matches_unwrapped_with_dropout() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    params = list(block.parameters())
    expected = _grads(block, x, params)
    got = _grads(lambda t: checkpoint(block, t), x, params)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in params)  # autograd.grad accumulates nowhere


def test_backward_with_inputs_fills_only_those() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    torch.manual_seed(5)
    checkpoint(block, x).sum().backward(inputs=[x])
    torch.manual_seed(5)
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    assert torch.equal(x.grad, expected)
    assert all(p.grad is None for p in block.parameters())


def test_nested_checkpoints_match_unwrapped_and_run_each_level_once_more() -> None:
    torch.manual_seed(0)
    inner, outer_part, counter = Block(), Block(), Counting()
    inner_calls = []
    inner.register_forward_pre_hook(lambda *_: inner_calls.append(xla_wrap.is_recomputing()))

    def outer(t: torch.Tensor) -> torch.Tensor:
        return outer_part(checkpoint(inner, counter(t)))

    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    params = [*inner.parameters(), *outer_part.parameters()]
    expected = _grads(outer, x, params)
    counter.calls, inner_calls[:] = 0, []
    got = _grads(lambda t: checkpoint(outer, t), x, params)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    # The outer recomputation runs the inner block once more (to reach what the outer block
    # saved after it); the inner block's own recomputation once more again.
    assert inner_calls == [False, True, True]
    assert counter.calls == 2


def test_recomputation_stops_once_the_last_saved_tensor_exists() -> None:
    counter = Counting()
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), counter)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    checkpoint(block, x).sum().backward()
    # tanh saves the last tensor; the multiplication after it is not run again (Rule 5).
    assert counter.calls == 1


def test_recomputation_saving_another_shape_is_refused_naming_the_tensor() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        h = x[:2].sin() if xla_wrap.is_recomputing() else x.sin()
        return h.sum() * x

    out = checkpoint(function, torch.randn(3, requires_grad=True))
    with pytest.raises(
        xla_wrap.CheckpointError,
        match=r"^xla_wrap.checkpoint: the recomputation in backward saved "
        r"Tensor\(shape=\(2,\).*as tensor 0 .* forward saved Tensor\(shape=\(3,\)",
    ):
        out.sum().backward()


def test_recomputation_saving_fewer_tensors_is_refused() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        h = x if xla_wrap.is_recomputing() else x.sin()
        return h * 2 + h.exp()

    out = checkpoint(function, torch.randn(3, requires_grad=True))
    with pytest.raises(
        xla_wrap.CheckpointError, match=r"saved 1 tensors for backward, where the forward saved 2"
    ):
        out.sum().backward()


def test_inner_value_reaching_the_loss_outside_the_output_gets_a_clear_error() -> None:
    leaked: list[torch.Tensor] = []

    def function(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        leaked.append(h.exp())
        return h.cos()

    x = torch.randn(3, requires_grad=True)
    checkpoint(function, x)
    # The gate over the block's output is not on this path, so nothing recomputed `h` first.
    with pytest.raises(xla_wrap.CheckpointError, match="Return that value from the block"):
        torch.autograd.grad(leaked[0].sum(), x)


def test_recomputed_tensors_are_released_after_backward() -> None:
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    # Two outputs, one unused by the loss: what only its branch would read is released too.
    out = checkpoint(lambda t: (block(t), t.exp() * 2), x)
    gate = out[0].grad_fn.next_functions[0][0]  # behind the output's own node (Rule 2)
    saved = gate.saved  # the gate's saved-tensor bookkeeping (engine Rule 4)
    out[0].sum().backward()
    assert saved.recomputed == {}


def test_the_same_graph_backpropagates_twice_with_retain_graph() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    torch.manual_seed(5)
    y = checkpoint(block, x).sum()
    first = torch.autograd.grad(y, x, retain_graph=True)[0]
    second = torch.autograd.grad(y, x)[0]
    assert torch.equal(first, second)


@pytest.mark.xla
def test_xla_gradients_through_autograd_grad_match_unwrapped(xla_device: torch.device) -> None:
    torch.manual_seed(0)
    block = Block().to(xla_device)
    params = list(block.parameters())
    x = torch.randn(BATCH, WIDTH).to(xla_device).requires_grad_()

    def grads(run: Any) -> list[torch.Tensor]:
        seed_everything(xla_device, 9)
        out = torch.autograd.grad((run(x) ** 2).sum(), [x, *params])
        sync(xla_device)
        return [g.cpu() for g in out]

    expected = grads(block)
    for a, b in zip(expected, grads(lambda t: checkpoint(block, t)), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_inputs_are_released_after_backward_while_the_loss_lives() -> None:
    import weakref

    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    x = torch.randn(BATCH, WIDTH) * 1.0  # a non-leaf, as an activation would be
    alive = weakref.ref(x)
    loss = xla_wrap.checkpoint(block, x).sum()
    loss.backward()
    del x
    # On XLA, a tensor kept alive with the loss becomes an output of every step.
    assert alive() is None and loss.grad_fn is not None


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


_LAYERS = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "dropout": lambda: nn.Dropout(0.4),
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "layernorm": lambda: nn.LayerNorm(WIDTH),
    "batchnorm": lambda: nn.BatchNorm1d(WIDTH),  # running statistics: updated once
    "residual": lambda: _Residual(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3))),
}
_HOW = ("checkpoint_wrapper", "checkpoint", "dots_saveable", "use_reentrant=True", "plain")


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(
            st.lists(st.sampled_from(sorted(_LAYERS)), min_size=1, max_size=4),
            st.sampled_from(_HOW),
        ),
        min_size=1,
        max_size=4,
    ),
    input_requires_grad=st.booleans(),
)
def test_random_models_match_the_unwrapped_model_bitwise(
    blocks: list[tuple[list[str], str]], input_requires_grad: bool
) -> None:
    """Models drawn at random (Linear, Dropout, norms with and without running statistics,
    residual blocks), each block checkpointed through a drawn entry point or not at all: the
    loss, every gradient and every buffer equal the unwrapped model's bitwise, with Dropout."""
    torch.manual_seed(0)
    plain = nn.ModuleList(nn.Sequential(*(_LAYERS[n]() for n in names)) for names, _ in blocks)
    plain.append(nn.Linear(WIDTH, 1))  # a head: the loss needs a gradient somewhere
    blocks = [*blocks, (["head"], "plain")]
    twin = copy.deepcopy(plain)
    calls = []
    for i, (_, how) in enumerate(blocks):
        block = twin[i]
        if how == "checkpoint_wrapper":
            twin[i] = xla_wrap.checkpoint_wrapper(block)
        calls.append(
            {
                "checkpoint": lambda b, h: xla_wrap.checkpoint(b, h),
                "dots_saveable": lambda b, h: xla_wrap.checkpoint(b, h, policy="dots_saveable"),
                "use_reentrant=True": lambda b, h: xla_wrap.checkpoint(b, h, use_reentrant=True),
            }.get(how, lambda b, h: b(h))
        )

    def step(model: nn.ModuleList, checkpointed: bool) -> list[torch.Tensor]:
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(input_requires_grad)
        torch.manual_seed(7)
        h = x
        for block, call in zip(model, calls, strict=True):
            h = call(block, h) if checkpointed else block(h)
        loss = (h.tanh() ** 2).sum()
        loss.backward()
        grads = [x.grad] if input_requires_grad else []
        return [loss, *grads, *(p.grad for p in model.parameters()), *model.buffers()]

    for a, b in zip(step(plain, False), step(twin, True), strict=True):
        assert torch.equal(a, b)
