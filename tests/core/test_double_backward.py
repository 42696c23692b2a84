"""Double backward (``create_graph=True``) through checkpoints: gradient penalties, Hessian-
vector products and higher derivatives equal the unwrapped model's (bitwise on eager CPU with
Dropout, within 1e-5 on XLA:CPU), the block's forward runs once more and no more, and on XLA
the recomputation still sits behind the barrier."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import introspect

from models import BATCH, WIDTH, Block, Stack, seed_everything, sync, wrap_blocks

Step = Callable[[nn.Module, torch.device], dict[str, torch.Tensor]]


class Blocks(nn.Module):
    """Dropout blocks and a nonlinear loss, run through one of xla_wrap's entry points."""

    def __init__(self, run: str) -> None:
        super().__init__()
        self.run = run
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.run == "function":
            for block in self.blocks:
                x = xla_wrap.checkpoint(block, x, scale=0.5)
        elif self.run == "sequential":
            x = xla_wrap.checkpoint_sequential(self.blocks, 3, x)
        else:  # the blocks themselves, wrapped or not
            x = self.blocks(x)
        return x.sin().pow(2).sum()


def _nest(model: Blocks) -> None:
    wrap_blocks(model)
    model.blocks = xla_wrap.checkpoint_wrapper(model.blocks)  # a checkpoint around checkpoints


def _as_function(model: Blocks) -> None:
    model.run = "function"


def _as_sequential(model: Blocks) -> None:
    model.run = "sequential"


def _blocks_scaled_half(model: Blocks) -> None:
    """What the "function" entry point computes (scale 0.5), without checkpoints."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _Scaled(block)


class _Scaled(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, scale=0.5)


# name -> (how to checkpoint an unwrapped model, how to make the plain model compute the same)
ENTRY_POINTS: dict[str, tuple[Callable[[Blocks], None], Callable[[Blocks], None]]] = {
    "checkpoint_wrapper": (wrap_blocks, lambda m: None),
    "checkpoint": (_as_function, _blocks_scaled_half),
    "checkpoint_sequential": (_as_sequential, lambda m: None),
    "dots_saveable": (functools.partial(wrap_blocks, policy="dots_saveable"), lambda m: None),
    "save_any_names_but_these": (
        functools.partial(
            wrap_blocks, policy=xla_wrap.checkpoint_policies.save_any_names_but_these("x")
        ),
        lambda m: None,
    ),
    "offload_to_cpu": (functools.partial(wrap_blocks, offload_to_cpu=True), lambda m: None),
    "nested": (_nest, lambda m: None),
}


def _twins(entry: str) -> tuple[Blocks, Blocks]:
    torch.manual_seed(0)
    plain = Blocks("plain")
    checkpointed = copy.deepcopy(plain)
    checkpoint, same = ENTRY_POINTS[entry]
    checkpoint(checkpointed)
    same(plain)
    return plain, checkpointed


def _input(device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(BATCH, WIDTH, generator=generator).to(device).requires_grad_()


def gradient_penalty_step(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """loss + |d loss / d x|^2, differentiated: the first derivative with a graph, then the
    second through it."""
    x = _input(device)
    model.zero_grad(set_to_none=True)
    seed_everything(device, 21)
    loss = model(x)
    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad_x.pow(2).sum()).backward()
    out = {"loss": loss.detach(), "grad_x": grad_x.detach(), "x.grad": x.grad}
    out.update({name: p.grad for name, p in model.named_parameters()})
    sync(device)
    return {key: value.cpu() for key, value in out.items()}


def hessian_vector_step(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """H v for the parameters' Hessian, v a fixed random direction: the second backward runs
    through the first one's graph only (the loss itself is not differentiated again)."""
    x = _input(device)
    names, params = zip(*model.named_parameters(), strict=True)
    generator = torch.Generator().manual_seed(7)
    v = [torch.randn(p.shape, generator=generator).to(device) for p in params]
    seed_everything(device, 21)
    grads = torch.autograd.grad(model(x), params, create_graph=True)
    hv = torch.autograd.grad(grads, params, grad_outputs=v)
    out = dict(zip(names, hv, strict=True))
    sync(device)
    return {key: value.cpu() for key, value in out.items()}


def _assert_bitwise(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Equal values in the same order (parameter names differ between some wrappings)."""
    assert len(got) == len(expected)
    for (key, want), have in zip(expected.items(), got.values(), strict=True):
        assert torch.equal(have, want), key


@pytest.mark.parametrize("step", [gradient_penalty_step, hessian_vector_step])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_second_derivatives_equal_the_unwrapped_models_bitwise(entry: str, step: Step) -> None:
    plain, checkpointed = _twins(entry)
    cpu = torch.device("cpu")
    _assert_bitwise(step(plain, cpu), step(checkpointed, cpu))
    # Dropout is really on (two different seeds give other derivatives).
    seed_everything(cpu, 22)
    assert not torch.equal(plain(_input(cpu)), plain(_input(cpu)))


def test_third_derivatives_equal_the_unwrapped_functions() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.sin(t) * t.exp(), 0.5)

    def derivatives(through: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        x = torch.linspace(-1, 1, 6, requires_grad=True)
        torch.manual_seed(3)
        y = through(x).sum()
        out = []
        for order in range(3):
            (y,) = torch.autograd.grad(y, x, create_graph=order < 2)
            out.append(y.detach())
            y = y.sum()
        return out

    expected = derivatives(f)
    got = derivatives(lambda t: xla_wrap.checkpoint(f, t))
    for order, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        assert torch.equal(have, want), f"derivative {order}"


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.block(x)


@pytest.mark.parametrize("step", [gradient_penalty_step, hessian_vector_step])
def test_the_forward_runs_once_more_and_no_more(step: Step) -> None:
    # The second backward reads what the first one recomputed (it lives with that graph): a
    # third run would be one more forward of compute for nothing.
    torch.manual_seed(0)
    model = Blocks("plain")
    model.blocks = nn.Sequential(*(xla_wrap.checkpoint_wrapper(_Counted()) for _ in range(3)))
    step(model, torch.device("cpu"))
    assert [block.calls for block in model.blocks] == [2, 2, 2]


def test_use_reentrant_true_gives_second_derivatives_too() -> None:
    """PyTorch's reentrant engine refuses double backward; xla_wrap's one engine runs for
    every value of the keyword, so code that passes `use_reentrant=True` gets them."""
    torch.manual_seed(0)
    linear = nn.Linear(WIDTH, WIDTH)
    x = _input(torch.device("cpu"))
    results = []
    for run in (linear, lambda t: xla_wrap.checkpoint(linear, t, use_reentrant=True)):
        (g,) = torch.autograd.grad(run(x).tanh().sum(), x, create_graph=True)
        results.append(torch.autograd.grad(g.pow(2).sum(), (x, linear.weight)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.xla
def test_on_xla_the_step_matches_eager_and_recomputes_once_behind_barriers(
    xla_device: torch.device,
) -> None:
    torch.manual_seed(0)
    plain = Stack()
    programs = {}
    results = {}
    for name in ("plain", "checkpointed"):
        model = copy.deepcopy(plain)
        if name == "checkpointed":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = xla_wrap.checkpoint_wrapper(block)
        model.to(xla_device)
        sync(xla_device)

        def step(model: nn.Module = model, name: str = name) -> None:
            results[name] = gradient_penalty_step(model, xla_device)

        programs[name] = introspect.compiled_memory(step)
    # XLA draws other Dropout masks than the CPU: the unwrapped model on XLA is the reference.
    expected = results["plain"]
    assert len(results["checkpointed"]) == len(expected)
    for (key, want), got in zip(expected.items(), results["checkpointed"].values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
    blocks = len(plain.blocks)
    # One barrier per block, and one extra forward (a dot per block) that CSE did not merge.
    assert programs["plain"].count("opt-barrier") == 0
    assert programs["checkpointed"].count("opt-barrier") == blocks
    assert programs["checkpointed"].count("dot") == programs["plain"].count("dot") + blocks
    # What the first backward recomputed goes with its graph: nothing more is alive when the
    # step ends (a tensor alive then would be one more output of the program; the smallest
    # activation takes BATCH * WIDTH floats).
    extra_output = programs["checkpointed"].output_bytes - programs["plain"].output_bytes
    assert extra_output < BATCH * WIDTH * 4


@pytest.mark.xla
@pytest.mark.filterwarnings("ignore:xla_wrap. offloading to host memory is not available")
@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e != "checkpoint_wrapper"])
def test_on_xla_every_entry_point_gives_the_unwrapped_second_derivatives(
    xla_device: torch.device, entry: str
) -> None:
    # The wrapper's program is measured above; here each other entry point's values, and
    # its barriers in the step's graph.
    plain, checkpointed = _twins(entry)
    results, barriers = [], []
    for model in (plain, checkpointed):
        model.to(xla_device)
        sync(xla_device)
        x = _input(xla_device)
        seed_everything(xla_device, 21)
        loss = model(x)
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad_x.pow(2).sum()).backward()
        grads = [loss, grad_x, x.grad, *(p.grad for p in model.parameters())]
        barriers.append(introspect.count_instructions(introspect.pending_hlo(grads), "opt-barrier"))
        sync(xla_device)
        results.append([g.detach().cpu() for g in grads])
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    checkpoints = {"checkpoint_sequential": 2, "nested": 4}.get(entry, 3)
    assert barriers == [0, checkpoints]


@pytest.mark.xla
def test_optimization_barrier_is_twice_differentiable_on_xla(xla_device: torch.device) -> None:
    x = torch.linspace(-1, 1, 5).to(xla_device).requires_grad_()
    (y,) = xla_wrap.optimization_barrier(x**3)
    (first,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), x)
    sync(xla_device)
    torch.testing.assert_close(second.cpu(), 6 * torch.linspace(-1, 1, 5))


# A block may differentiate its own graph: `torch.autograd.grad` inside the checkpointed
# function (PyTorch's TestNestedCheckpoint asks this of its non-reentrant checkpoint), in the
# forward and again in the recomputation, composed with checkpoints and derivatives around it.


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x.sin().exp(), 0.3).sin()


def _g(x: torch.Tensor) -> torch.Tensor:
    """Differentiates what it computed, and returns something else."""
    a = _f(x)
    (ga,) = torch.autograd.grad(a.sum(), x)
    return x.sin() * ga.detach()


def _c(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: xla_wrap.checkpoint(fn, x)


def _grad(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def gradient(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (dx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        return dx

    return gradient


def _same(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return fn


def _is_xla_wraps(node: object) -> bool:
    function = getattr(type(node), "_forward_cls", None)
    return function is not None and function.__module__.startswith("xla_wrap.")


def _graph(root: object) -> list[object]:
    """The autograd nodes reachable from ``root``."""
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = node
            todo += [next_node for next_node, _ in node.next_functions]  # type: ignore[attr-defined]
    return list(seen.values())


COMPOSITIONS = {
    "c": lambda c, fn: c(fn),
    "c(c)": lambda c, fn: c(c(fn)),
    "grad(c)": lambda c, fn: _grad(c(fn)),
    "c(grad)": lambda c, fn: c(_grad(fn)),
    "grad(grad(c))": lambda c, fn: _grad(_grad(c(fn))),
    "grad(c(grad))": lambda c, fn: _grad(c(_grad(fn))),
    "c(grad(c))": lambda c, fn: c(_grad(c(fn))),
    "grad(c(grad(c)))": lambda c, fn: _grad(c(_grad(c(fn)))),
}


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("fn", [_f, _g], ids=["f", "grad-inside"])
def test_gradients_inside_and_around_checkpoints_equal_the_plain_functions(
    fn: Callable[[torch.Tensor], torch.Tensor], composition: str
) -> None:
    import weakref

    compose = COMPOSITIONS[composition]
    values = []
    for c in (_same, _c):
        x = torch.linspace(-1, 1, 7, requires_grad=True)
        torch.manual_seed(3)
        out = compose(c, fn)(x)
        (dx,) = torch.autograd.grad(out.sum(), x)
        values.append((out.detach(), dx))
        # Nothing keeps the graph alive once its output goes (placeholders hold no cycle):
        # xla_wrap's nodes in it (Python objects, unlike PyTorch's own) die with it.
        ours = [weakref.ref(node) for node in _graph(out.grad_fn) if _is_xla_wraps(node)]
        if composition.startswith("c"):  # the output comes out of a checkpoint's gate
            assert (c is _c) == bool(ours)
        del out
        assert all(node() is None for node in ours)
    (want, want_dx), (got, got_dx) = values
    assert torch.equal(got, want) and torch.equal(got_dx, want_dx)
