"""``xla_wrap.disable_checkpointing()``: inside it every xla_wrap checkpoint is the plain call
(one forward, the unwrapped model's gradients); outside it nothing changes. Per thread, nested,
restored after an exception (FairScale's ``test_checkpoint_disabling``, in this project's
words)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import xla_wrap

from models import BATCH, WIDTH

CALLS: list[str] = []  # one entry per layer forward, on any thread


class Layer(nn.Module):
    """Counts its forwards in ``CALLS`` (a module global: scanned layers must stay alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append(threading.current_thread().name)
        return x + self.drop(torch.tanh(self.linear(x)))


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(3))


def _loop(layers: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _wrapped(layers: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor]:
    for i, layer in enumerate(layers):
        layers[i] = xla_wrap.checkpoint_wrapper(layer)
    return lambda x: _loop(layers, x)


def _nested(layers: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor]:
    run = _wrapped(layers)
    return lambda x: xla_wrap.checkpoint(run, x)


# name -> how a model over the layers runs them checkpointed
ENTRY_POINTS: dict[str, Callable[[nn.ModuleList], Callable[[torch.Tensor], torch.Tensor]]] = {
    "checkpoint_wrapper": _wrapped,
    "checkpoint": lambda layers: (
        lambda x: _loop(
            [lambda h, layer=layer: xla_wrap.checkpoint(layer, h) for layer in layers], x
        )
    ),
    "checkpoint_sequential": lambda layers: (
        lambda x: xla_wrap.checkpoint_sequential(list(layers), 3, x)
    ),
    "scan_layers": lambda layers: lambda x: xla_wrap.scan_layers(layers, x),
    "ScannedLayers": lambda layers: lambda x: _loop(xla_wrap.ScannedLayers(layers), x),
    "nested": _nested,
}


def _step(run: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter]) -> list:
    """Forward and backward from seed 5; the forwards it ran, the input and parameter grads."""
    CALLS.clear()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(5)
    run(x).pow(2).sum().backward()
    grads = [x.grad, *(p.grad for p in params)]
    return [len(CALLS), grads]


def _checkpointed(entry: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[nn.Parameter]]:
    layers = _layers()
    params = list(layers.parameters())
    return ENTRY_POINTS[entry](layers), params


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_inside_it_each_forward_runs_once_with_the_unwrapped_gradients(entry: str) -> None:
    plain = _layers()
    expected_calls, expected = _step(lambda x: _loop(plain, x), list(plain.parameters()))
    run, params = _checkpointed(entry)
    with xla_wrap.disable_checkpointing():
        calls, grads = _step(run, params)
    assert calls == expected_calls == 3
    for want, got in zip(expected, grads, strict=True):
        assert torch.equal(got, want)
    # Outside it, the same model checkpoints again (the last chunk of checkpoint_sequential
    # runs plainly, as always; a nested checkpoint recomputes each level once).
    outside, _ = _step(run, params)
    assert outside == {"checkpoint_sequential": 5, "nested": 9}.get(entry, 6)


def _checkpointed_calls() -> int:
    run, params = _checkpointed("checkpoint_wrapper")
    return _step(run, params)[0]


def test_it_nests_and_an_exception_inside_leaves_checkpointing_on() -> None:
    with xla_wrap.disable_checkpointing():
        with xla_wrap.disable_checkpointing():
            assert _checkpointed_calls() == 3
        assert _checkpointed_calls() == 3  # the outer context still holds
    assert _checkpointed_calls() == 6
    with pytest.raises(ValueError, match="inside"), xla_wrap.disable_checkpointing():
        raise ValueError("inside")
    assert _checkpointed_calls() == 6


def test_it_works_as_a_decorator() -> None:
    @xla_wrap.disable_checkpointing()
    def evaluate() -> int:
        return _checkpointed_calls()

    assert evaluate() == 3
    assert _checkpointed_calls() == 6


def test_another_thread_keeps_checkpointing() -> None:
    inside = threading.Barrier(2)
    counts: dict[str, int] = {}

    def disabled() -> None:
        with xla_wrap.disable_checkpointing():
            inside.wait()  # the other thread runs while this one is inside the context
            inside.wait()
            counts["disabled"] = _checkpointed_calls()

    def enabled() -> None:
        inside.wait()
        counts["enabled"] = _checkpointed_calls()
        inside.wait()

    threads = [threading.Thread(target=f, name=f.__name__) for f in (disabled, enabled)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert counts == {"disabled": 3, "enabled": 6}


def test_a_backward_inside_it_still_recomputes_what_ran_checkpointed() -> None:
    # It decides at forward time. Nested checkpoints recompute as checkpoints inside the
    # outer recomputation, or it would save other tensors than the forward did.
    plain = _layers()
    _, expected = _step(lambda x: _loop(plain, x), list(plain.parameters()))
    run, params = _checkpointed("nested")
    CALLS.clear()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(5)
    loss = run(x).pow(2).sum()
    with xla_wrap.disable_checkpointing():
        loss.backward()
    assert len(CALLS) == 9
    for want, got in zip(expected, [x.grad, *(p.grad for p in params)], strict=True):
        assert torch.equal(got, want)


@pytest.mark.xla
def test_on_xla_a_scanned_stack_becomes_the_plain_loop(xla_device: torch.device) -> None:
    layers = copy.deepcopy(_layers()).to(xla_device)
    x = torch.randn(BATCH, WIDTH).to(xla_device).requires_grad_()
    CALLS.clear()
    scanned = xla_wrap.scan_layers(layers, x)
    assert type(scanned.grad_fn).__name__ == "_ScanFunctionBackward"  # the While loop
    CALLS.clear()
    with xla_wrap.disable_checkpointing():
        y = xla_wrap.scan_layers(layers, x)
    assert len(CALLS) == 3  # each layer's own forward
    assert type(y.grad_fn).__name__ == "AddBackward0"  # the last layer's residual add


def test_under_torch_compile_it_applies_when_traced() -> None:
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    backend = EagerAndRecordGraphs()
    layer = xla_wrap.checkpoint_wrapper(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
    compiled = torch.compile(layer, backend=backend)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    compiled(x).sum().backward()
    with xla_wrap.disable_checkpointing():
        compiled(x).sum().backward()  # Dynamo guards on the setting: traced again
    compiled(x).sum().backward()  # the first graph, reused
    assert ["checkpoint" in graph.code for graph in backend.graphs] == [True, False]
    torch._dynamo.reset()
