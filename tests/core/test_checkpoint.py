"""xla_wrap.checkpoint / checkpoint_sequential / checkpoint_wrapper: training is unchanged."""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap

from models import (
    BATCH,
    WIDTH,
    Block,
    Stack,
    assert_same,
    seed_everything,
    sync,
    train_step,
    wrap_blocks,
    wrapped_copy,
)


def test_wrapped_model_gives_same_loss_and_gradients_with_dropout(device: torch.device) -> None:
    torch.manual_seed(0)
    model = Stack().to(device)
    twin = wrapped_copy(model, wrap_blocks)
    expected = train_step(model, device, seed=7)
    got = train_step(twin, device, seed=7)
    assert_same(expected, got, device)


def test_dropout_is_active_so_parity_is_not_trivial() -> None:
    # Guards the parity test above: different seeds must change the gradients.
    torch.manual_seed(0)
    model = Stack()
    a = train_step(model, torch.device("cpu"), seed=7)
    b = train_step(model, torch.device("cpu"), seed=8)
    assert not torch.equal(a["blocks.0.linear.weight"], b["blocks.0.linear.weight"])


def test_rng_after_step_is_as_without_checkpointing() -> None:
    torch.manual_seed(0)
    model = Stack()
    twin = wrapped_copy(model, wrap_blocks)
    train_step(model, torch.device("cpu"), seed=3)
    after_plain = torch.get_rng_state()
    train_step(twin, torch.device("cpu"), seed=3)
    assert torch.equal(torch.get_rng_state(), after_plain)


# Argument structures: nested tuples/lists/dicts of tensors (some needing grad) and other values.
_leaf = st.one_of(
    st.sampled_from(["grad", "nograd", "int"]).map(lambda kind: ("tensor", kind)),
    st.integers(-3, 3),
    st.text(max_size=3),
    st.none(),
)
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), children, max_size=3),
    ),
    max_leaves=6,
)


def _materialize(spec: Any, counter: list[int]) -> Any:
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "tensor":
        counter[0] += 1
        g = torch.Generator().manual_seed(counter[0])
        if spec[1] == "int":
            return torch.randint(0, 5, (BATCH, WIDTH), generator=g)
        return torch.randn(BATCH, WIDTH, generator=g).requires_grad_(spec[1] == "grad")
    if isinstance(spec, list):
        return [_materialize(s, counter) for s in spec]
    if isinstance(spec, tuple):
        return tuple(_materialize(s, counter) for s in spec)
    if isinstance(spec, dict):
        return {k: _materialize(v, counter) for k, v in spec.items()}
    return spec


class TreeBlock(nn.Module):
    """Maps every float tensor leaf through Linear + Dropout and mirrors the input structure in
    its output, non-tensor leaves included."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.5)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def visit(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.is_floating_point():
                    return self.drop(self.linear(value))
                return value + 1
            if isinstance(value, list):
                return [visit(v) for v in value]
            if isinstance(value, tuple):
                return tuple(visit(v) for v in value)
            if isinstance(value, dict):
                return {k: visit(v) for k, v in value.items()}
            return value

        return {"args": visit(args), "kwargs": visit(kwargs), "tag": "out"}


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


@settings(max_examples=40, deadline=None)
@given(args=st.lists(_tree, max_size=3), kwargs=st.dictionaries(st.sampled_from(["x", "y"]), _tree))
def test_nested_arguments_and_outputs_match_unwrapped(args: list[Any], kwargs: dict) -> None:
    torch.manual_seed(0)
    block = TreeBlock()
    wrapped = xla_wrap.checkpoint_wrapper(block)

    def run(module: nn.Module) -> tuple[Any, list[torch.Tensor | None]]:
        counter = [0]
        call_args = _materialize(args, counter)
        call_kwargs = _materialize(kwargs, counter)
        torch.manual_seed(11)
        out = module(*call_args, **call_kwargs)
        floats = [v for v in _leaves(out) if isinstance(v, torch.Tensor) and v.requires_grad]
        block.linear.weight.grad = None
        if floats:
            sum(f.sum() for f in floats).backward()
        inputs = [v for v in _leaves((call_args, call_kwargs)) if isinstance(v, torch.Tensor)]
        return out, [block.linear.weight.grad, *(v.grad for v in inputs)]

    plain_out, plain_grads = run(block)
    wrapped_out, wrapped_grads = run(wrapped)
    plain_leaves, wrapped_leaves = _leaves(plain_out), _leaves(wrapped_out)
    assert len(plain_leaves) == len(wrapped_leaves)
    for a, b in zip(plain_leaves, wrapped_leaves, strict=True):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b)
            assert a.requires_grad == b.requires_grad
        else:
            assert a == b
    for a, b in zip(plain_grads, wrapped_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_block_whose_inputs_need_no_grad_still_trains_its_parameters() -> None:
    torch.manual_seed(0)
    block = Block()
    wrapped = xla_wrap.checkpoint_wrapper(Block())
    wrapped.load_state_dict(block.state_dict())
    x = torch.randn(BATCH, WIDTH)  # no requires_grad: the first layer of a model
    grads = []
    for module in (block, wrapped):
        torch.manual_seed(5)
        module(x).sum().backward()
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        assert b is not None and torch.equal(a, b)


@pytest.mark.parametrize(
    "make_function",
    [
        pytest.param(lambda block: block, id="module"),
        pytest.param(lambda block: block.forward, id="bound-method"),
        pytest.param(lambda block: functools.partial(block.__call__), id="partial"),
        # transformers 5 checkpoints `partial(Layer.forward, layer, **kwargs)`.
        pytest.param(
            lambda block: functools.partial(type(block).forward, block), id="unbound-method"
        ),
    ],
)
def test_checkpoint_finds_parameters_of_module_method_and_partial(make_function: Any) -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(BATCH, WIDTH)
    torch.manual_seed(1)
    block(x, scale=2.0).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    y = xla_wrap.checkpoint(make_function(block), x, scale=2.0)
    # The block's parameters are found, so they join the barrier (on XLA:
    # tests/paths/test_xla.py::test_backward_barrier_ties_inputs_gradients_and_parameters).
    owners = y.grad_fn.record.call.owners  # the gate's record of the call
    assert [id(p) for p in owners.params] == [id(p) for p in block.parameters()]
    y.sum().backward()
    for a, p in zip(expected, block.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_outputs_that_need_no_grad_are_fine() -> None:
    linear = nn.Linear(WIDTH, WIDTH)

    def function(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        y = linear(x)
        return y, y.argmax(dim=1), y.detach() * 0, "label"

    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    y, _, constant, _ = function(x)
    (y.sum() + constant.sum()).backward()
    expected, x.grad = x.grad, None
    y, index, constant, label = xla_wrap.checkpoint(function, x)
    assert y.requires_grad and not index.requires_grad
    assert index.dtype == torch.int64 and label == "label"
    (y.sum() + constant.sum()).backward()
    assert torch.equal(x.grad, expected)


def test_no_grad_runs_a_plain_forward_once() -> None:
    calls: list[bool] = []

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(torch.is_grad_enabled())
            return self.linear(x)

    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    for use_reentrant in (True, False):  # PyTorch's keyword changes nothing
        wrapped = xla_wrap.checkpoint_wrapper(
            xla_wrap.unwrap(Counting()), use_reentrant=use_reentrant
        )
        calls.clear()
        with torch.no_grad():
            y = wrapped(x)
        assert y.grad_fn is None and calls == [False]
        calls.clear()
        wrapped(x).sum().backward()
        # The forward records the block's graph (with placeholders); the recomputation too.
        assert calls == [True, True]


def test_is_recomputing_is_true_only_inside_the_recomputation_and_per_thread() -> None:
    seen: list[tuple[bool, bool]] = []

    def function(x: torch.Tensor) -> torch.Tensor:
        other: list[bool] = []
        thread = threading.Thread(target=lambda: other.append(xla_wrap.is_recomputing()))
        thread.start()
        thread.join()
        seen.append((xla_wrap.is_recomputing(), other[0]))
        return x.sin()  # saves x: something to recompute

    x = torch.randn(3, requires_grad=True)
    y = xla_wrap.checkpoint(function, x)
    assert not xla_wrap.is_recomputing()
    y.sum().backward()
    assert seen == [(False, False), (True, False)]
    assert not xla_wrap.is_recomputing()


def test_state_is_restored_after_an_error_in_the_recomputation() -> None:
    block = nn.BatchNorm1d(WIDTH)
    weight, mean = block.weight, block.running_mean

    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if xla_wrap.is_recomputing():
                raise ValueError("boom")
            return self.norm(x)

    y = xla_wrap.checkpoint_wrapper(Failing())(torch.randn(BATCH, WIDTH, requires_grad=True))
    with pytest.raises(ValueError, match="boom"):
        y.sum().backward()
    assert not xla_wrap.is_recomputing()
    # The barriered copies swapped in for the recomputation are gone again.
    assert block.weight is weight and block.running_mean is mean


def test_autocast_of_the_forward_is_restored_in_the_recomputation() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5), nn.Linear(WIDTH, WIDTH))

    torch.manual_seed(0)
    block = make()
    wrapped = xla_wrap.checkpoint_wrapper(make())
    wrapped.load_state_dict(block.state_dict())
    x = torch.randn(BATCH, WIDTH)
    grads = []
    for module in (block, wrapped):
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()  # backward runs outside autocast
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_batchnorm_running_statistics_update_once() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
    wrapped = xla_wrap.checkpoint_wrapper(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
    )
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    for module in (plain, wrapped):
        module(x).sum().backward()
    assert torch.equal(plain[1].running_mean, wrapped[1].running_mean)
    assert int(wrapped[1].num_batches_tracked) == 1


def test_recomputation_with_a_different_shape_is_refused() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        return x[:2].sin() if xla_wrap.is_recomputing() else x.sin()

    out = xla_wrap.checkpoint(function, torch.randn(3, requires_grad=True))
    with pytest.raises(
        xla_wrap.CheckpointError, match=r"^xla_wrap.checkpoint: .*shape=\(2,\).*shape=\(3,\)"
    ):
        out.sum().backward()


@pytest.mark.parametrize("use_reentrant", [True, False, None])
def test_use_reentrant_is_accepted_and_runs_the_one_engine(use_reentrant: bool | None) -> None:
    """PyTorch's keyword, which FairScale, torch_xla and older code pass: every value runs the
    same engine, so `torch.autograd.grad`, save policies and double backward work with
    `use_reentrant=True` too, with the unwrapped model's gradients."""
    torch.manual_seed(0)
    linear = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    expected = torch.autograd.grad(linear(x).tanh().sum(), (x, linear.weight))
    y = xla_wrap.checkpoint(linear, x, use_reentrant=use_reentrant, policy="dots_saveable")
    assert type(y.grad_fn).__name__ == "TanhBackward0" or y.grad_fn is not None
    got = torch.autograd.grad(y.tanh().sum(), (x, linear.weight))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    wrapped = xla_wrap.checkpoint_wrapper(nn.Linear(WIDTH, WIDTH), use_reentrant=use_reentrant)
    assert wrapped.checkpoint_options == xla_wrap.CheckpointOptions()


def test_checkpoint_sequential_matches_plain_sequential() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3)) for _ in range(5))
    )
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    results = []
    for run in (lambda: layers(x), lambda: xla_wrap.checkpoint_sequential(layers, 3, x)):
        layers.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(4)
        loss = run().sum()
        loss.backward()
        results.append([loss, x.grad, *(p.grad for p in layers.parameters())])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_checkpoint_sequential_checkpoints_all_but_the_last_segment() -> None:
    calls: list[int] = []

    def layer(i: int) -> Any:
        def f(x: torch.Tensor) -> torch.Tensor:
            calls.append(i)
            return x.sin()  # saves x: something to recompute

        return f

    x = torch.randn(3, requires_grad=True)
    xla_wrap.checkpoint_sequential([layer(i) for i in range(4)], 2, x).sum().backward()
    # Segments [0, 1] (checkpointed: run twice) and [2, 3] (plain: run once).
    assert sorted(calls) == [0, 0, 1, 1, 2, 3]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: xla_wrap.checkpoint(3, torch.ones(1)), TypeError, "expected a callable"),
        (lambda: xla_wrap.checkpoint_wrapper(lambda x: x), TypeError, "expected an nn.Module"),
        (
            lambda: xla_wrap.checkpoint(nn.Linear(2, 2), torch.ones(2), use_reentrant="no"),
            TypeError,
            "use_reentrant",
        ),
        (
            lambda: xla_wrap.checkpoint_sequential(
                nn.Sequential(nn.Linear(2, 2)), 2, torch.ones(2)
            ),
            ValueError,
            "between 1 and 1",
        ),
        (
            lambda: xla_wrap.checkpoint_sequential(nn.Linear(2, 2), 1, torch.ones(2)),
            TypeError,
            "nn.Sequential or a list",
        ),
        (
            lambda: xla_wrap.checkpoint_sequential([nn.Linear(2, 2), 5], 1, torch.ones(2)),
            TypeError,
            "position 1",
        ),
        (lambda: xla_wrap.optimization_barrier(torch.ones(1), 2), TypeError, "position 1"),
    ],
)
def test_bad_input_gets_an_error_naming_the_api_and_the_fix(
    call: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        call()
    text = str(info.value)
    assert text.startswith("xla_wrap.")
    if error is not NotImplementedError:
        assert isinstance(info.value, xla_wrap.XlaWrapError)


def test_optimization_barrier_is_identity_off_xla() -> None:
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3)
    a, b = xla_wrap.optimization_barrier(x, y)
    assert a is x and b is y


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_recomputes_exactly() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Stack().to(device)
    twin = wrapped_copy(model, wrap_blocks)
    expected = train_step(model, device, seed=7)
    after_plain = torch.cuda.get_rng_state()
    got = train_step(twin, device, seed=7)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert torch.equal(torch.cuda.get_rng_state(), after_plain)


@pytest.mark.parametrize(
    "function",
    [
        pytest.param(lambda x, w: x, id="returns-its-input"),
        pytest.param(lambda x, w: (x[0], x @ w), id="view-of-input"),
        pytest.param(lambda x, w: (x @ w, x @ w.t()), id="two-outputs"),
    ],
)
def test_unusual_but_valid_functions_match_unwrapped(device: torch.device, function: Any) -> None:
    w = torch.randn(WIDTH, WIDTH, device=device, requires_grad=True)
    x0 = torch.randn(2, BATCH, WIDTH)
    grads = []
    for run in (function, lambda x, w: xla_wrap.checkpoint(function, x, w)):
        x = x0.to(device).requires_grad_()
        w.grad = None
        out = run(x, w)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in outs).backward()
        sync(device)  # one program for both reads
        grads.append((x.grad.cpu(), None if w.grad is None else w.grad.cpu()))
    (xa, wa), (xb, wb) = grads
    torch.testing.assert_close(xb, xa, rtol=1e-5, atol=1e-6)
    assert (wa is None) == (wb is None)
    if wa is not None:
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)


def test_closure_parameters_get_gradients_when_no_input_needs_grad(device: torch.device) -> None:
    """The FSDP-flattening case: the block's weights are not parameters it owns, and its input
    needs no grad; an anchor keeps the recomputation in the backward."""
    torch.manual_seed(0)
    w = torch.randn(WIDTH, WIDTH, device=device, requires_grad=True)
    drop = nn.Dropout(0.5)

    def block(x: torch.Tensor) -> torch.Tensor:
        return drop(torch.tanh(x @ w))

    x = torch.randn(BATCH, WIDTH).to(device)
    grads = []
    for run in (block, lambda t: xla_wrap.checkpoint(block, t)):
        w.grad = None
        seed_everything(device, 9)
        run(x).sum().backward()
        sync(device)
        grads.append(w.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    assert grads[0].abs().sum() > 0


def test_callable_that_modifies_its_input_in_place_is_refused(device: torch.device) -> None:
    linear = nn.Linear(3, 1).to(device)
    x = torch.ones(2, 3, device=device)
    with pytest.raises(xla_wrap.CheckpointError, match=r"modified its input tensor 0.*in place"):
        xla_wrap.checkpoint(lambda t: linear(t.mul_(2)), x)
    h = torch.randn(2, 3, device=device, requires_grad=True) * 1  # a non-leaf activation
    block = xla_wrap.checkpoint_wrapper(nn.Sequential(nn.ReLU(inplace=True), linear))
    with pytest.raises(xla_wrap.CheckpointError, match=r"ReLU\(inplace=False\)"):
        block(h)


class RunningScale(nn.Module):
    """Reads a buffer, then updates it in place (an exponential moving average)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x) * self.scale.clone()
        with torch.no_grad():
            self.scale.mul_(0.5).add_(x.detach().abs().mean(0))
        return out


def test_buffer_updated_in_place_by_the_forward_is_recomputed_as_read(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    plain = RunningScale().to(device)
    wrapped = xla_wrap.checkpoint_wrapper(RunningScale().to(device))
    wrapped.load_state_dict(plain.state_dict())
    x0 = torch.randn(BATCH, WIDTH)
    results = []
    for module in (plain, wrapped):
        x = x0.to(device).requires_grad_()
        module(x).pow(2).sum().backward()
        sync(device)
        results.append([x.grad.cpu(), module.linear.weight.grad.cpu(), module.scale.cpu()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


class ReadsScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sin() * self.scale


class ScaleUpdatedThroughData(ReadsScale):
    """Updates its buffer through ``.data``, which no version counter sees (as EMA codebooks
    do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A copy of the buffer: the unwrapped model's backward then reads it as the forward did.
        out = self.linear(x).sin() * (self.scale * 1.0)
        if not xla_wrap.is_recomputing():
            self.scale.data.mul_(3.0)
        return out


@pytest.mark.parametrize(
    "change",
    ["in place before backward", "through .data before backward", "replaced before backward"],
)
def test_a_buffer_changed_after_the_forward_is_recomputed_as_the_forward_read_it(
    change: str,
) -> None:
    torch.manual_seed(0)
    plain = ReadsScale()
    block = xla_wrap.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(BATCH, WIDTH)
    plain(x).sum().backward()
    loss = block(x).sum()
    if change == "in place before backward":
        block.scale.mul_(3.0)
    elif change == "through .data before backward":
        block.scale.data.mul_(3.0)
    else:
        block.scale = torch.full((WIDTH,), 5.0)
    loss.backward()
    assert torch.equal(block.linear.weight.grad, plain.linear.weight.grad)


def test_a_buffer_the_forward_updates_through_data_is_recomputed_as_read() -> None:
    torch.manual_seed(0)
    plain = ScaleUpdatedThroughData()
    block = xla_wrap.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(BATCH, WIDTH)
    plain(x).sum().backward()
    block(x).sum().backward()
    assert torch.equal(block.linear.weight.grad, plain.linear.weight.grad)
    assert torch.equal(block.scale, plain.scale)  # updated once, by the forward


def test_a_buffer_a_hook_updates_between_two_calls_is_recomputed_as_each_call_read_it() -> None:
    # spectral_norm's pre-hook runs a power iteration on its `weight_u` buffer before every
    # call: a GAN discriminator called on real and fake data, then one backward.
    torch.manual_seed(0)
    plain = nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH))
    wrapped = xla_wrap.checkpoint_wrapper(copy.deepcopy(plain))
    real, fake = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    for module in (plain, wrapped):
        (module(real).tanh().sum() - module(fake).tanh().sum()).backward()
    assert torch.equal(wrapped.weight_orig.grad, plain.weight_orig.grad)
    assert torch.equal(wrapped.weight_u, plain.weight_u)


class ScaledByAHook(nn.Module):
    """A forward pre-hook sets a tensor computed from a parameter, a new one per call (as
    spectral_norm and pruning set `weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(WIDTH))
        self.calls = 0
        self.register_forward_pre_hook(ScaledByAHook.scale_for_this_call)

    @staticmethod
    def scale_for_this_call(module: ScaledByAHook, args: Any) -> None:
        module.calls += 1
        module.scale = module.p * module.calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sin()


def test_a_tensor_a_hook_sets_per_call_is_recomputed_as_each_call_saw_it() -> None:
    torch.manual_seed(0)
    first, second = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    plain = ScaledByAHook()
    (plain(first).sum() + plain(second).sum()).backward()
    wrapped = xla_wrap.checkpoint_wrapper(ScaledByAHook())
    (wrapped(first).sum() + wrapped(second).sum()).backward()
    assert torch.equal(wrapped.p.grad, plain.p.grad)


class AddsShift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        with torch.inference_mode():  # a cache built during evaluation
            self.register_buffer("shift", torch.full((WIDTH,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) + self.shift).sin()


def test_a_buffer_made_in_inference_mode_is_read_like_any_other() -> None:
    torch.manual_seed(0)
    plain = AddsShift()
    torch.manual_seed(0)
    block = xla_wrap.checkpoint_wrapper(AddsShift())
    assert block.shift.is_inference()
    x = torch.randn(BATCH, WIDTH)
    plain(x).sum().backward()
    block(x).sum().backward()
    assert torch.equal(block.linear.weight.grad, plain.linear.weight.grad)


def test_returning_a_buffer_leaves_the_buffer_out_of_autograd() -> None:
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)
            self.register_buffer("table", torch.arange(4.0))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.linear(x), self.table

    wrapped = xla_wrap.checkpoint_wrapper(WithBuffer())
    y, table = wrapped(torch.randn(BATCH, WIDTH, requires_grad=True))
    (y.sum() + table.sum()).backward()
    assert torch.equal(table, torch.arange(4.0))
    assert wrapped.table.grad_fn is None and not wrapped.table.requires_grad


def test_tensors_bound_in_a_partial_are_inputs_of_the_checkpoint() -> None:
    # transformers binds a layer's masks and position embeddings with functools.partial; they
    # must be saved and checked like any input, not read through a closure in backward.
    def scaled(x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        mask.mul_(2.0)
        return x * mask

    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    mask = torch.ones(BATCH, WIDTH)
    with pytest.raises(xla_wrap.CheckpointError, match=r"modified its input tensor 1 \("):
        xla_wrap.checkpoint(functools.partial(scaled, mask=mask), x)
