"""A checkpointed module keeps its class: it is what the module tree yields and what code that
walks the tree by class (``isinstance``, ``model.apply``, ``named_modules``) and code that sets
attributes behind ``nn.Module``'s back (``object.__setattr__``, as torch_xla's FSDP does) reaches.

Eager CPU only. Every test uses the module ``checkpoint_wrapper`` returns (or the one
``apply_activation_checkpointing`` put in the tree), never whether it is the object passed in.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import wrap_policies as wp

from models import BATCH, WIDTH, Block, Stack

# Modules to wrap: leaves with parameters only (Linear, Conv2d), a block with submodules, a
# container.
MODULES: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: nn.Linear(WIDTH, WIDTH),
    "Conv2d": lambda: nn.Conv2d(2, 2, 3, padding=1),
    "Block": Block,
    "Sequential": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
}


@pytest.mark.parametrize("make", list(MODULES.values()), ids=list(MODULES))
def test_checkpoint_wrapper_returns_an_instance_of_the_module_class_with_its_names(
    make: Callable[[], nn.Module],
) -> None:
    """The returned module is a CheckpointWrapper and an instance of the wrapped module's class,
    and it names its parameters, buffers and submodules as the unwrapped module does."""
    torch.manual_seed(0)
    module = make()
    cls = type(module)
    plain = copy.deepcopy(module)
    wrapped = xla_wrap.checkpoint_wrapper(module)
    assert isinstance(wrapped, xla_wrap.CheckpointWrapper)
    assert isinstance(wrapped, cls), f"{type(wrapped).__name__} is not a {cls.__name__}"
    for method in ("named_parameters", "named_buffers", "named_modules"):
        names = [name for name, _ in getattr(wrapped, method)()]
        assert names == [name for name, _ in getattr(plain, method)()], method
    assert next(iter(wrapped.named_modules())) == ("", wrapped)


@pytest.mark.parametrize("select", ["check_fn", "policy"])
def test_modules_yield_the_wrapped_blocks_as_blocks_that_are_still_recomputed(
    select: str,
) -> None:
    """After apply_activation_checkpointing, ``sum(isinstance(m, Block) for m in
    model.modules())`` counts every block once, each of them a CheckpointWrapper, and each block
    is still recomputed once in backward, with the unwrapped model's loss and gradients."""
    torch.manual_seed(0)
    model = Stack()
    plain = copy.deepcopy(model)
    check_fn = wp.by_type(Block) if select == "policy" else lambda m: isinstance(m, Block)
    xla_wrap.apply_activation_checkpointing(model, check_fn)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert sum(isinstance(m, Block) for m in model.modules()) == len(model.blocks) == 3
    assert all(isinstance(b, xla_wrap.CheckpointWrapper) for b in blocks)
    assert [id(b) for b in blocks] == [id(b) for b in model.blocks]
    # A submodule of each block is called through nn.Module.__call__ in the forward and in the
    # recomputation, whatever the wrapper does with the block's own call.
    calls: list[bool] = []
    for block in blocks:
        block.linear.register_forward_hook(lambda *_: calls.append(xla_wrap.is_recomputing()))
    results = []
    for net in (plain, model):
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)  # the same Dropout masks for both
        loss = net(x)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in net.parameters())])
    assert sorted(calls) == [False] * 3 + [True] * 3
    for expected, got in zip(*results, strict=True):
        assert torch.equal(got, expected)


def test_model_apply_reaches_a_wrapped_linear() -> None:
    """``model.apply(init_fn)`` calls ``init_fn`` on a wrapped ``nn.Linear`` as a Linear, so an
    init function that zeroes Linear weights zeroes the wrapped one too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    model[0] = xla_wrap.checkpoint_wrapper(model[0])
    wrapped = model[0]
    visited: list[nn.Module] = []

    def init_fn(module: nn.Module) -> None:
        visited.append(module)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)
            nn.init.ones_(module.bias)

    model.apply(init_fn)
    assert any(m is wrapped for m in visited)
    assert torch.equal(wrapped.weight, torch.zeros(WIDTH, WIDTH))
    assert torch.equal(wrapped.bias, torch.ones(WIDTH))
    assert torch.equal(model[2].weight, torch.zeros(1, WIDTH))  # the unwrapped one, as ever


class LinearWithBatchNorm(nn.Module):
    """The inner module of PyTorch's ``test_apply_activation_checkpointing``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.nested_linear = nn.Sequential(nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.nested_linear(self.lin(x)))


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(*(LinearWithBatchNorm() for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


@pytest.mark.parametrize("select", ["check_fn", "policy"])
def test_pytorch_apply_activation_checkpointing_pattern_counts_every_linear(select: str) -> None:
    """PyTorch's own ``test_apply_activation_checkpointing``: after checkpointing every
    ``nn.Linear``, ``model.modules()`` holds as many Linears as before, each of them a
    CheckpointWrapper, and a keyword-argument forward gives every wrapped Linear gradients."""
    torch.manual_seed(0)
    model = MyModel()
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    check_fn = wp.by_type(nn.Linear) if select == "policy" else lambda m: isinstance(m, nn.Linear)
    xla_wrap.apply_activation_checkpointing(model, check_fn)
    n_linear_wrapped = sum(isinstance(m, nn.Linear) for m in model.modules())
    n_checkpointed = sum(isinstance(m, xla_wrap.CheckpointWrapper) for m in model.modules())
    assert n_linear == n_linear_wrapped == n_checkpointed == 6
    for layer in model.seq:
        for linear in (layer.lin, layer.nested_linear[0]):
            assert isinstance(linear, xla_wrap.CheckpointWrapper)
            assert isinstance(linear, nn.Linear)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    for _ in range(2):
        loss = model(x=x).sum()
        assert loss.requires_grad
        loss.backward()
        for layer in model.seq:
            for linear in (layer.lin, layer.nested_linear[0]):
                for param in (linear.weight, linear.bias):
                    assert param.requires_grad and param.grad is not None


def test_named_modules_keep_the_unwrapped_names_and_classes_and_yield_the_wrapped_modules() -> None:
    """``model.named_modules()`` of a model with wrapped blocks and a wrapped head gives the
    unwrapped model's names, at each name a module of the unwrapped one's class, and at the
    wrapped places the very modules the wrapping put there."""
    torch.manual_seed(0)
    model = Stack()
    plain = copy.deepcopy(model)
    xla_wrap.apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
    model.head = xla_wrap.checkpoint_wrapper(model.head)
    named = list(model.named_modules())
    assert [name for name, _ in named] == [name for name, _ in plain.named_modules()]
    for (name, module), (_, original) in zip(named, plain.named_modules(), strict=True):
        assert isinstance(module, type(original)), f"{name}: {type(module).__name__}"
    modules = dict(named)
    wrapped = {"head": model.head, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)}}
    for name, module in wrapped.items():
        assert isinstance(module, xla_wrap.CheckpointWrapper), name
        assert modules[name] is module, name
    assert sum(isinstance(m, xla_wrap.CheckpointWrapper) for m in model.modules()) == 4


def test_object_setattr_of_a_popped_parameter_is_what_the_forward_then_uses() -> None:
    """torch_xla's FSDP pops ``weight`` from a module's ``_parameters`` and puts the full tensor
    back with ``object.__setattr__``: the wrapped module's forward (and its recomputation) then
    reads that tensor, and the gradient reaches it."""
    torch.manual_seed(0)
    wrapped = xla_wrap.checkpoint_wrapper(nn.Linear(WIDTH, 3))
    weight = torch.randn(3, WIDTH, requires_grad=True)
    wrapped._parameters.pop("weight")
    object.__setattr__(wrapped, "weight", weight)
    assert wrapped.weight is weight
    assert [name for name, _ in wrapped.named_parameters()] == ["bias"]
    x = torch.randn(BATCH, WIDTH)
    out = wrapped(x)
    twin = weight.detach().clone().requires_grad_()
    expected = torch.nn.functional.linear(x, twin, wrapped.bias.detach())
    assert torch.equal(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, twin.grad)
