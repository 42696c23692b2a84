"""What the peers' own checkpointing tests ask of their APIs, asked of xla_wrap's.

The peers: FairScale 0.4.13 (``tests/nn/checkpoint``), PyTorch 2.9 (``test_utils.py``,
``test_autograd.py``, ``test/distributed/fsdp/test_checkpoint_wrapper.py``) and torch_xla 2.9
(``test_operations.py``, ``scan/test_scan_layers.py``). Each test names the peer test it follows
and is written in this project's words; behaviour other test files already pin down (Dropout
parity, nested structures, state_dict round trips, disable_checkpointing, double backward) is
not repeated here. docs/guide.md's migration table lists what differs on purpose.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap

from models import BATCH, WIDTH, Block

# --- PyTorch: torch.distributed.algorithms._checkpoint.checkpoint_wrapper ------------------


def _nested_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 4),
        nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 4)),
        nn.Linear(4, 4),
    )


def _fsdp_policies() -> dict[str, Any]:
    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    return {
        "ModuleWrapPolicy": ModuleWrapPolicy({nn.Linear}),
        "CustomPolicy": CustomPolicy(lambda m: isinstance(m, nn.Sequential)),
        "size_based": functools.partial(size_based_auto_wrap_policy, min_num_params=100),
        "transformer": functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential}
        ),
    }


@pytest.mark.parametrize(
    "policy", ["ModuleWrapPolicy", "CustomPolicy", "size_based", "transformer"]
)
def test_auto_wrap_policy_wraps_what_pytorchs_apply_activation_checkpointing_wraps(
    policy: str,
) -> None:
    # test_apply_activation_checkpointing passes auto_wrap_policy=ModuleWrapPolicy(...).
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrapper

    theirs = _nested_linears()
    torch_wrapper.apply_activation_checkpointing(theirs, auto_wrap_policy=_fsdp_policies()[policy])
    prefix = torch_wrapper._CHECKPOINT_PREFIX
    expected = [
        name.replace(prefix, "")
        for name, m in theirs.named_modules()
        if isinstance(m, torch_wrapper.CheckpointWrapper)
    ]
    ours = xla_wrap.apply_activation_checkpointing(
        _nested_linears(), auto_wrap_policy=_fsdp_policies()[policy]
    )
    got = [name for name, m in ours.named_modules() if isinstance(m, xla_wrap.CheckpointWrapper)]
    assert got and sorted(got) == sorted(expected)
    if policy in ("ModuleWrapPolicy", "CustomPolicy"):  # also where check_fn goes
        again = xla_wrap.apply_activation_checkpointing(_nested_linears(), _fsdp_policies()[policy])
        wrapped = [n for n, m in again.named_modules() if isinstance(m, xla_wrap.CheckpointWrapper)]
        assert sorted(wrapped) == sorted(expected)


def test_pytorchs_wrapper_keywords_get_errors_that_say_what_to_pass() -> None:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    apply = xla_wrap.apply_activation_checkpointing
    with pytest.raises(xla_wrap.CheckpointTypeError, match="checkpoint_wrapper_fn.*use_reentrant"):
        apply(_nested_linears(), lambda m: True, checkpoint_wrapper_fn=xla_wrap.checkpoint_wrapper)
    with pytest.raises(xla_wrap.CheckpointValueError, match="got both"):
        apply(_nested_linears(), lambda m: True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    with pytest.raises(xla_wrap.CheckpointTypeError, match="auto_wrap_policy.*got int"):
        apply(_nested_linears(), auto_wrap_policy=3)
    with pytest.raises(xla_wrap.CheckpointTypeError, match="auto_wrap_policy"):
        apply(_nested_linears())  # neither


class _TakesAnything(nn.Module):
    """A forward that takes ``**kwargs``, as Hugging Face layers do: a stray keyword vanishes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seen: dict[str, Any] = {}

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.seen = kwargs
        return self.linear(x)


@pytest.mark.parametrize("keyword", ["context_fn", "determinism_check", "debug", "early_stop"])
def test_torch_checkpoint_keywords_xla_wrap_lacks_are_refused_not_passed_on(keyword: str) -> None:
    block = _TakesAnything()
    x = torch.randn(BATCH, WIDTH)
    with pytest.raises(xla_wrap.CheckpointTypeError, match=f"`{keyword}`.*functools.partial"):
        xla_wrap.checkpoint(block, x, **{keyword: None})
    # The function's own argument of that name goes through a partial, as the error says.
    xla_wrap.checkpoint(functools.partial(block, **{keyword: 1}), x).sum().backward()
    assert block.seen == {keyword: 1}


# --- PyTorch: torch.utils.checkpoint (test_utils.py, test_autograd.py) -----------------------


class _Counted(nn.Module):
    """A linear layer that counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize(
    "container",
    [lambda layers: nn.Sequential(*layers), nn.ModuleList, list],
    ids=["Sequential", "ModuleList", "list"],
)
def test_checkpoint_sequential_reruns_the_checkpointed_segments_only(
    container: Callable[[Any], Any],
) -> None:
    # test_checkpoint_trigger, test_checkpoint and test_checkpoint_module_list.
    torch.manual_seed(0)
    layers = [_Counted() for _ in range(10)]
    plain = nn.Sequential(*copy.deepcopy(layers))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    out = xla_wrap.checkpoint_sequential(container(layers), 2, x)
    assert [layer.calls for layer in layers] == [1] * 10
    out.sum().backward()
    assert [layer.calls for layer in layers] == [2] * 5 + [1] * 5
    x_plain = x.detach().requires_grad_()
    plain(x_plain).sum().backward()
    assert torch.equal(out, plain(x_plain))
    assert torch.equal(x.grad, x_plain.grad)
    for ours, theirs in zip(layers, plain, strict=True):
        assert torch.equal(ours.linear.weight.grad, theirs.linear.weight.grad)


def test_a_call_without_tensors_returns_its_values() -> None:
    # test_checkpoint_no_tensors.
    with torch.enable_grad():
        assert xla_wrap.checkpoint(lambda a, b: (a + b, str(a)), 2, b=3) == (5, "2")


def test_without_rng_preservation_dropout_draws_anew_in_the_recomputation() -> None:
    # test_checkpoint_not_preserve_rng_state_and_without_reentrant: it runs; here also, the
    # option does what it says (the recomputation's mask differs, and so does the gradient).
    torch.manual_seed(0)
    block = Block(p=0.5)
    grads = []
    for preserve in (True, False):
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        torch.manual_seed(5)
        y = xla_wrap.checkpoint(block, x, preserve_rng_state=preserve)
        y.sum().backward()
        grads.append(x.grad)
    x_plain = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    x_plain.requires_grad_()
    torch.manual_seed(5)
    block(x_plain).sum().backward()
    assert torch.equal(grads[0], x_plain.grad)
    assert not torch.equal(grads[1], x_plain.grad)


class _Cube(torch.autograd.Function):
    """Saves its input and an intermediate, as PyTorch's test Function does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        square = x * x
        ctx.save_for_backward(x, square)
        return square * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _x, square = ctx.saved_tensors
        return grad * 3 * square


def test_a_custom_autograd_function_inside_a_block() -> None:
    # test_checkpointing_without_reentrant_custom_function_works.
    def block(x: torch.Tensor) -> torch.Tensor:
        return _Cube.apply(x.sin()).cos()

    x = torch.linspace(-1, 1, 6, requires_grad=True)
    xla_wrap.checkpoint(block, x).sum().backward()
    x_plain = x.detach().requires_grad_()
    block(x_plain).sum().backward()
    assert torch.equal(x.grad, x_plain.grad)


def test_a_recomputation_that_would_save_more_stops_once_it_has_what_backward_needs() -> None:
    # test_checkpoint_detects_non_determinism, the "saves more" case under early stop: what
    # comes after the last saved tensor is not run again, so it cannot differ.
    runs: list[str] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        y = x.sin().cos()  # saves x, then sin(x)
        runs.append("forward" if not xla_wrap.is_recomputing() else "recompute")
        if xla_wrap.is_recomputing():
            y.exp()  # would save a third tensor
        return y

    x = torch.linspace(-1, 1, 6, requires_grad=True)
    xla_wrap.checkpoint(block, x).sum().backward()
    x_plain = x.detach().requires_grad_()
    x_plain.sin().cos().sum().backward()
    assert torch.equal(x.grad, x_plain.grad)
    assert runs == ["forward"]  # the recomputation stopped before reaching the append


@pytest.mark.parametrize(
    ("function", "forwards"),
    [(lambda x: x * 2.0, 1), (lambda x: x.sin(), 2)],
    ids=["saves-nothing", "saves-its-input"],
)
def test_a_block_that_saves_nothing_is_not_run_again(
    function: Callable[[torch.Tensor], torch.Tensor], forwards: int
) -> None:
    # test_nested_checkpoint_set_early_stop_no_recompution_needed.
    calls = []

    def block(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return function(x)

    x = torch.ones(3, requires_grad=True)
    xla_wrap.checkpoint(block, x).sum().backward()
    assert len(calls) == forwards


def test_a_hook_on_a_parameter_used_inside_and_outside_fires_once() -> None:
    # test_checkpointing_without_reentrant_parameter_used_in_an_out.
    weight = nn.Parameter(torch.randn(WIDTH, WIDTH))
    fired = []
    weight.register_hook(lambda grad: fired.append(grad.clone()))
    x = torch.randn(BATCH, WIDTH)
    out = xla_wrap.checkpoint(lambda h: h @ weight, x) @ weight
    out.sum().backward()
    assert len(fired) == 1
    plain = nn.Parameter(weight.detach().clone())
    ((x @ plain) @ plain).sum().backward()
    assert torch.equal(fired[0], plain.grad)


def test_a_hook_on_a_node_of_the_blocks_graph_fires_once() -> None:
    # test_nested_checkpoint_same_graph: the forward's nodes run in backward, the
    # recomputation's graph is never differentiated.
    fired = []

    def block(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        y.grad_fn.register_hook(lambda *grads: fired.append(1))
        return y.cos()

    x = torch.ones(3, requires_grad=True)
    xla_wrap.checkpoint(block, x).sum().backward()
    assert fired == [1]


def test_a_hook_on_one_output_that_runs_backward_from_another_ends_with_the_plain_gradient() -> (
    None
):
    # test_nested_checkpoint_reentrant_backwards: each output has a gradient node of its own,
    # so the hook's backward from `x` does not pass the node of `out` (and its hook) again.
    def block(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = a.sin().cos()
        return x, x.sin()

    def run(checkpoint: Callable[..., Any]) -> tuple[torch.Tensor, list[str]]:
        a = torch.tensor(1.0, requires_grad=True)
        x, out = checkpoint(block, a)
        fired = []

        def hook(*_: Any) -> None:
            fired.append(out.grad_fn.name())
            x.backward(retain_graph=True)

        out.grad_fn.register_hook(hook)
        out.backward(retain_graph=True)
        assert a.grad is not None
        return a.grad, fired

    (grad, fired), (plain, _) = run(xla_wrap.checkpoint), run(lambda f, a: f(a))
    assert torch.equal(grad, plain)  # d(out)/da, then d(x)/da from the hook's backward
    assert fired == ["CheckpointOutputBackward"]
    # One node per output, behind one gate: a backward through both recomputes once.
    calls = []
    a = torch.tensor(1.0, requires_grad=True)
    x, out = xla_wrap.checkpoint(lambda a: (calls.append(1), *block(a))[1:], a)
    assert x.grad_fn is not out.grad_fn
    assert x.grad_fn.next_functions[0][0] is out.grad_fn.next_functions[0][0]
    (x + out).backward()
    assert len(calls) == 2


def test_non_tensor_outputs_and_backward_with_retain_graph() -> None:
    # test_checkpoint_non_tensor_inputs_outputs: an input returned as an output, non-tensor
    # outputs, three backwards with retain_graph, then the graph is gone.
    def block(scale: float, a: torch.Tensor, b: torch.Tensor) -> tuple[Any, ...]:
        return scale, a * b, b, "text"

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    scale, product, same_b, text = xla_wrap.checkpoint(block, 2.0, a, b)
    assert (scale, text) == (2.0, "text") and torch.equal(same_b, b)
    loss = (product + same_b).sum()
    for _ in range(3):
        loss.backward(retain_graph=True)
    assert torch.equal(a.grad, 3 * b.detach()) and torch.equal(b.grad, 3 * (a.detach() + 1))
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_a_block_that_computes_part_of_its_output_without_grad() -> None:
    # test_checkpointing_without_reentrant_detached_tensor.
    def block(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shift = x.exp()
        return x.sin() + shift

    x = torch.linspace(-1, 1, 5, requires_grad=True)
    out = xla_wrap.checkpoint(block, x)
    out.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


# --- FairScale: fairscale.nn.checkpoint --------------------------------------------------------


class _CountedFrozen(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.linear.requires_grad_(not frozen)
        self.calls = 0

    def forward(self, x: torch.Tensor, tag: str) -> tuple[torch.Tensor, list[str]]:
        self.calls += 1
        return torch.tanh(self.linear(x)), [tag]


@pytest.mark.parametrize(
    ("frozen", "calls"),
    [
        ([True, True, True, False], [1, 1, 1, 2]),
        ([False, True, True, True], [2, 2, 2, 2]),
        ([True, False, True, False], [1, 2, 2, 2]),
    ],
    ids=["frozen-then-trained", "trained-first", "mixed"],
)
def test_frozen_blocks_whose_inputs_need_no_grad_are_not_recomputed(
    frozen: list[bool], calls: list[int]
) -> None:
    # test_checkpoint_requires_grad, with the default engine: a block is recomputed only if
    # something before it, or its own parameters, need a gradient. Non-tensor arguments and
    # outputs pass through.
    torch.manual_seed(0)
    blocks = [xla_wrap.checkpoint_wrapper(_CountedFrozen(f)) for f in frozen]
    h = torch.randn(BATCH, WIDTH)
    for i, block in enumerate(blocks):
        h, tags = block(h, f"block {i}")
        assert tags == [f"block {i}"]
    h.sum().backward()
    assert [block.calls for block in blocks] == calls


@pytest.mark.parametrize("precision", ["fp32", "fp16-data", "half-call"])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm2d])
def test_norm_layers_state_after_a_step_equals_the_unwrapped_models(
    norm: type[nn.Module], precision: str
) -> None:
    # test_checkpoint_activations_norm.py: forward, backward and an SGD step leave the
    # state_dict (BatchNorm's running statistics updated once) as without checkpointing.
    torch.manual_seed(0)
    if norm is nn.BatchNorm2d:
        model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2))
        x = torch.randn(2, 3, 4, 4)
    else:
        model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
        x = torch.randn(5, 3)
    if precision == "fp16-data":
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.half()
        x = x.half()
    elif precision == "half-call":
        model.half()
        x = x.half()
    states = []
    for wrap in (False, True):
        twin = copy.deepcopy(model)
        if wrap:
            twin = xla_wrap.checkpoint_wrapper(twin)
        optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
        twin(x.clone().requires_grad_()).float().pow(2).sum().backward()
        optimizer.step()
        states.append(twin.state_dict())
    plain, wrapped = states
    assert plain.keys() == wrapped.keys()
    for key in plain:
        assert torch.equal(wrapped[key], plain[key]), key
    if norm is nn.BatchNorm2d:
        assert int(wrapped["1.num_batches_tracked"]) == 1


def test_a_list_in_and_a_list_out_run_the_forward_twice() -> None:
    # test_list_input: the forward runs once, and once more in backward.
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)
            self.calls = 0

        def forward(self, pair: list[torch.Tensor]) -> list[torch.Tensor]:
            self.calls += 1
            return [self.linear(pair[0]), pair[1].sin()]

    torch.manual_seed(0)
    pair = xla_wrap.checkpoint_wrapper(Pair())
    a, b = torch.randn(BATCH, WIDTH, requires_grad=True), torch.randn(3, requires_grad=True)
    out = pair([a, b])
    assert isinstance(out, list) and pair.calls == 1
    (out[0].sum() + out[1].sum()).backward()
    assert pair.calls == 2
    assert torch.equal(b.grad, b.detach().cos())


# --- torch_xla: torch_xla.utils.checkpoint ----------------------------------------------------


@pytest.mark.xla
def test_the_backward_barrier_holds_the_blocks_buffers_too(xla_device: torch.device) -> None:
    # test_operations.py TestActivationCheckpoint.test_opt_barrier: one barrier in backward,
    # holding inputs, gradients, parameters and buffers.
    import re

    from xla_wrap import introspect

    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)
            self.register_buffer("bias", torch.randn(3, WIDTH))  # a shape nothing else has

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(x)) + self.bias[0]

    torch.manual_seed(0)
    block = xla_wrap.checkpoint_wrapper(WithBuffer()).to(xla_device)
    x = torch.randn(BATCH, WIDTH, device=xla_device, requires_grad=True)
    block(x).sum().backward()
    hlo = introspect.pending_hlo([block.linear.weight.grad, x.grad])
    barriers = re.findall(r"= \((.*?)\) opt-barrier\(", hlo)
    assert len(barriers) == 1
    assert f"f32[3,{WIDTH}]" in barriers[0]  # the buffer
    assert f"f32[{WIDTH},{WIDTH}]" in barriers[0]  # the weight
    assert barriers[0].count(f"f32[{BATCH},{WIDTH}]") == 2  # the input and its gradient


def _accumulation_model(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(dropout))
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), inner, nn.Linear(WIDTH, 1))


def _accumulate(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    import torch_xla
    from torch_xla.experimental.gradient_accumulation import gradient_accumulation

    model.to(device)
    xs = torch.randn(3, BATCH, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    ys = torch.randn(3, BATCH, 1, generator=torch.Generator().manual_seed(2)).to(device)
    torch_xla.sync()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (model(x) - y).pow(2).mean()

    loss = gradient_accumulation(step, (xs, ys), model)
    torch_xla.sync()
    return [loss.cpu(), *(p.grad.cpu() for p in model.parameters())]


@pytest.mark.xla
def test_inside_torch_xlas_gradient_accumulation_loop(xla_device: torch.device) -> None:
    # test_train_spmd_linear_model.py's gradient-accumulation test, checkpoint arm: the loop
    # gives the plain model's losses and gradients.
    plain = _accumulation_model(0.0)
    checkpointed = copy.deepcopy(plain)
    checkpointed[2] = xla_wrap.checkpoint_wrapper(checkpointed[2])
    expected, got = _accumulate(plain, xla_device), _accumulate(checkpointed, xla_device)
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)
    # The loop gives each iteration a seed of its own, which no replay can reproduce: Dropout
    # inside a checkpoint there is refused rather than recomputed with other masks.
    with_dropout = _accumulation_model(0.5)
    with_dropout[2] = xla_wrap.checkpoint_wrapper(with_dropout[2])
    with pytest.raises(xla_wrap.CheckpointError, match="gradient_accumulation loop"):
        _accumulate(with_dropout, xla_device)


@pytest.mark.xla
def test_under_xla_autocast_the_step_equals_the_unwrapped_models(xla_device: torch.device) -> None:
    # test_grad_checkpoint.py --test_autocast: checkpointed blocks under torch.autocast("xla").
    import torch_xla
    import torch_xla.core.xla_model as xm

    from models import Stack

    torch.manual_seed(0)
    plain = Stack()
    results = []
    for wrap in (False, True):
        model = copy.deepcopy(plain)
        if wrap:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = xla_wrap.checkpoint_wrapper(block)
        model.to(xla_device)
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
        x = x.to(xla_device).requires_grad_()
        xm.set_rng_state(5, str(xla_device))
        with torch.autocast("xla", dtype=torch.bfloat16):
            loss = model(x)
        assert loss.dtype == torch.bfloat16
        loss.backward()
        torch_xla.sync()
        results.append(
            [loss.float().cpu(), x.grad.cpu(), *(p.grad.cpu() for p in model.parameters())]
        )
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
