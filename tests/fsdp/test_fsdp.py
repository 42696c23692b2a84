"""Checkpointing composed with torch_xla's FSDP (v1), in one process (world size 1)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xla_wrap
from xla_wrap import fsdp
from xla_wrap import wrap_policies as wp

import models
from models import BATCH, WIDTH, Block

pytestmark = pytest.mark.xla


class Net(models.Net):
    def __init__(self) -> None:
        super().__init__((Block() for _ in range(3)), WIDTH, scale=0.5)


def _per_block(order: str) -> Callable[[Net, torch.device], nn.Module]:
    def build(net: Net, device: torch.device) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

        for i, block in enumerate(net.blocks):
            block = block.to(device)
            net.blocks[i] = {
                "plain": lambda b: FSDP(b),
                "fsdp(checkpoint)": lambda b: FSDP(xla_wrap.checkpoint_wrapper(b)),
                "checkpoint(fsdp)": lambda b: xla_wrap.checkpoint_wrapper(FSDP(b)),
                # recomputes inside FSDP's own forward, the order where stopping the
                # recomputation early would break FSDP's state machine (engine Rule 5)
            }[order](block)
        return FSDP(net.to(device))

    return build


def _auto(checkpointed: bool) -> Callable[[Net, torch.device], nn.Module]:
    def build(net: Net, device: torch.device) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

        net = net.to(device)
        policy = fsdp.auto_wrap_policy(wp.by_type(Block), net)
        if not checkpointed:
            return FSDP(net, auto_wrap_policy=policy)
        return FSDP(
            net, auto_wrap_policy=policy, auto_wrapper_callable=fsdp.auto_wrapper_callable()
        )

    return build


def _step(build: Callable[[Net, torch.device], nn.Module], device: torch.device) -> tuple:
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    net = Net()
    calls: list[bool] = []
    for block in net.blocks:
        # On a submodule: the checkpointed block's own hooks run once, around the checkpoint.
        block.linear.register_forward_hook(lambda *_: calls.append(xla_wrap.is_recomputing()))
    model = build(net, device)
    torch_xla.sync()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0)).to(device)
    xm.set_rng_state(7, str(device))
    loss = model(x)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch_xla.sync()
    return model, loss.item(), [g.cpu() for g in grads], calls


@pytest.fixture(scope="module")
def reference(xla_device: torch.device) -> dict[str, tuple]:
    """FSDP without checkpointing, wrapped per block by hand and by the auto-wrap policy."""
    return {
        "per-block": _step(_per_block("plain"), xla_device),
        "auto": _step(_auto(checkpointed=False), xla_device),
    }


@pytest.mark.parametrize(
    ("name", "build", "reference_key"),
    [
        ("FSDP(checkpoint_wrapper(block))", _per_block("fsdp(checkpoint)"), "per-block"),
        ("checkpoint_wrapper(FSDP(block))", _per_block("checkpoint(fsdp)"), "per-block"),
        ("auto_wrap_policy + auto_wrapper_callable", _auto(checkpointed=True), "auto"),
    ],
)
def test_checkpointing_inside_xla_fsdp_gives_fsdp_loss_and_gradients(
    xla_device: torch.device,
    reference: dict[str, tuple],
    name: str,
    build: Callable[[Net, torch.device], nn.Module],
    reference_key: str,
) -> None:
    _, expected_loss, expected_grads, plain_calls = reference[reference_key]
    model, loss, grads, calls = _step(build, xla_device)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert len(grads) == len(expected_grads) > 0
    for a, b in zip(expected_grads, grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    wrappers = [m for m in model.modules() if isinstance(m, xla_wrap.CheckpointWrapper)]
    assert len(wrappers) == 3  # every block checkpointed
    assert plain_calls == [False] * 3
    assert sorted(calls) == [False] * 3 + [True] * 3  # each block recomputed once in backward


def test_auto_wrap_policy_answers_both_fsdp_callback_styles() -> None:
    net = Net()
    callback = fsdp.auto_wrap_policy(wp.by_type(Block), net)
    assert callback(module=net, recurse=True, unwrapped_params=10)  # torch_xla's keywords
    assert not callback(net, False, 10)  # PyTorch FSDP1's positional nonwrapped_numel
    assert callback(net.blocks[1], False, 10) and not callback(net.head, False, 10)


class Recorder(nn.Module):
    """Stands in for an FSDP class: records what it was built with."""

    def __init__(self, module: nn.Module, *args: object, **kwargs: object) -> None:
        super().__init__()
        self.inner = module
        self.args, self.kwargs = args, kwargs


def test_auto_wrapper_callable_builds_fsdp_around_a_checkpoint_wrapper() -> None:
    with pytest.raises(ValueError, match=r"^xla_wrap.fsdp.auto_wrapper_callable: unknown policy"):
        fsdp.auto_wrapper_callable(fsdp_class=Recorder, policy="dot_saveable")
    build = fsdp.auto_wrapper_callable(fsdp_class=Recorder, preserve_rng_state=False)
    linear = nn.Linear(2, 2)
    unit = build(linear, 1, compute_dtype=torch.float32)
    assert isinstance(unit, Recorder) and unit.args == (1,)
    assert unit.kwargs == {"compute_dtype": torch.float32}
    assert isinstance(unit.inner, xla_wrap.CheckpointWrapper)
    assert unit.inner.checkpoint_module is linear
    assert unit.inner.checkpoint_options.preserve_rng_state is False


@pytest.mark.parametrize(
    "policy",
    [wp.by_param_count(1, 511), wp.by_name("blocks.*")],
    ids=["size", "name"],
)
def test_a_policy_blind_inside_fsdp_is_refused_with_the_order_to_use(
    reference: dict[str, tuple], policy: wp.WrapPolicy
) -> None:
    # FSDP(net) with every block a unit: the parameters are flattened into the units (512
    # each) and the names prefixed with `_fsdp_wrapped_module._fpw_module.`.
    sharded = reference["auto"][0]
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"(?s)already wrapped.*before FSDP"):
        xla_wrap.apply_activation_checkpointing(sharded, policy)
    assert not any(isinstance(m, xla_wrap.CheckpointWrapper) for m in sharded.modules())
    with pytest.raises(xla_wrap.CheckpointValueError, match="already contains FSDP units"):
        fsdp.auto_wrap_policy(wp.by_type(Block), sharded)


# --- a checkpointed module keeps its class inside torch_xla's FSDP ---------------------------


class LayerScale(nn.Module):
    """A Linear whose output a direct parameter of the block scales (layer scale, as in CaiT):
    FSDP shards ``gamma`` from this module's own ``_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * torch.tanh(self.linear(x))


# name -> (the module, the shape of its input)
LEAVES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Linear": (lambda: nn.Linear(WIDTH, WIDTH), (BATCH, WIDTH)),
    "Conv2d": (lambda: nn.Conv2d(2, 2, 3, padding=1), (BATCH, 2, 4, 4)),
    "layer scale": (LayerScale, (BATCH, WIDTH)),
}


@pytest.fixture
def op_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of a linear or 2-D convolution op was a recomputation.

    The ops are patched where ``nn.Linear`` and ``nn.Conv2d`` look them up (``F.linear``,
    ``F.conv2d``) and where torch_xla FSDP's patched Linear does (``torch._C._nn.linear``), so
    the probe sees the forward and the recomputation of a bare Linear or Conv2d, however the
    wrapper calls it. (Hooks on a leaf are not a fair probe of the wrapper, and a
    ``TorchFunctionMode`` misses the recomputation, which runs on the autograd engine's XLA
    thread; the HLO does not show it either, as a Linear's backward never reads its output.)
    """
    calls: list[bool] = []
    inside: list[bool] = []  # a TorchFunctionMode looks the op up again: count the call once
    for owner, name in ((F, "linear"), (F, "conv2d"), (torch._C._nn, "linear")):
        original = getattr(owner, name)

        def probe(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if inside:
                return _original(*args, **kwargs)
            calls.append(xla_wrap.is_recomputing())
            inside.append(True)
            try:
                return _original(*args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(owner, name, probe)
    return calls


def _fsdp_train(
    model: nn.Module,
    shape: tuple[int, ...],
    device: torch.device,
    op_calls: list[bool],
    *,
    scalar_output: bool = False,
) -> dict[str, Any]:
    """One forward/backward of an FSDP model with a loss that needs its activations: the loss,
    the input gradient and every parameter gradient by name (on the CPU), the op calls that
    were (True) and were not (False) recomputations, and the number of FSDP units.

    With ``scalar_output`` the model's output is the loss and the input needs no gradient, as in
    ``_step`` (so that the step compiles to the programs the tests above compiled)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    torch_xla.sync()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x = x.to(device).requires_grad_(not scalar_output)
    xm.set_rng_state(7, str(device))
    op_calls.clear()
    output = model(x)
    loss = output if scalar_output else torch.tanh(output).square().sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), grads.keys()
    if not scalar_output:
        grads["input"] = x.grad
    torch_xla.sync()
    return {
        "loss": loss.item(),
        "grads": {n: g.cpu() for n, g in grads.items()},
        "calls": sorted(op_calls),
        "units": sum(isinstance(m, FSDP) for m in model.modules()),
    }


def _assert_trains_like(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """The same loss and gradients (names included), within XLA:CPU's fusion reordering."""
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _assert_recomputed_once(
    expected: dict[str, Any], got: dict[str, Any], *, forward: int, checkpointed: int
) -> None:
    """Without checkpointing the ``forward`` linear/convolution ops run once each, in forward;
    with it, the ``checkpointed`` ones among them run once more, recomputed in backward."""
    assert expected["calls"] == [False] * forward
    assert got["calls"] == [False] * forward + [True] * checkpointed


@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
@pytest.mark.parametrize("leaf", list(LEAVES))
def test_xla_fsdp_of_a_checkpointed_module_keeps_its_class_trains_like_fsdp_and_recomputes(
    xla_device: torch.device, op_calls: list[bool], leaf: str, flatten: bool
) -> None:
    """``FSDP(checkpoint_wrapper(m))`` for a Linear, a Conv2d and a block with a direct
    parameter, with and without ``flatten_parameters``: the module in FSDP's tree is still of
    its class, FSDP's forward reaches the parameters (unflattened, FSDP pops each one from the
    module's ``_parameters`` and puts the full one back with ``object.__setattr__``, which the
    module's forward must then read), the loss and gradients are those of ``FSDP(m)``, and the
    module's op is recomputed once in backward."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    make, shape = LEAVES[leaf]
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        module = make()
        cls = type(module)
        module = module.to(xla_device)
        if checkpointed:
            module = xla_wrap.checkpoint_wrapper(module)
        model = FSDP(module, flatten_parameters=flatten)
        inner = [m for m in model.modules() if isinstance(m, xla_wrap.CheckpointWrapper)]
        assert len(inner) == int(checkpointed)
        assert all(isinstance(m, cls) for m in inner), [type(m).__name__ for m in inner]
        results.append(_fsdp_train(model, shape, xla_device, op_calls))
    plain, got = results
    _assert_trains_like(plain, got)
    _assert_recomputed_once(plain, got, forward=1, checkpointed=1)


def test_auto_wrapper_callable_makes_checkpointed_linear_units_that_train_like_fsdp(
    xla_device: torch.device, op_calls: list[bool]
) -> None:
    """torch_xla's FSDP auto-wrapping every ``nn.Linear`` of a small net with
    ``xla_wrap.fsdp.auto_wrapper_callable()`` (unflattened parameters, FSDP's default) makes one
    unit per Linear plus the root, as without checkpointing, with the same loss and gradients,
    and recomputes every Linear once."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Linear(WIDTH, WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, 1),
        ).to(xla_device)
        policy = fsdp.auto_wrap_policy(wp.by_type(nn.Linear), net)
        if checkpointed:
            model = FSDP(
                net, auto_wrap_policy=policy, auto_wrapper_callable=fsdp.auto_wrapper_callable()
            )
        else:
            model = FSDP(net, auto_wrap_policy=policy)
        results.append(_fsdp_train(model, (BATCH, WIDTH), xla_device, op_calls))
    plain, got = results
    assert plain["units"] == got["units"] == 4
    _assert_trains_like(plain, got)
    _assert_recomputed_once(plain, got, forward=3, checkpointed=3)


def test_torch_xla_transformer_auto_wrap_policy_after_checkpointing_makes_a_unit_per_block(
    xla_device: torch.device, op_calls: list[bool]
) -> None:
    """torch_xla's own ``transformer_auto_wrap_policy(transformer_layer_cls={Block})`` given a
    net whose blocks ``apply_activation_checkpointing`` has already wrapped still recognizes them
    as Blocks: one FSDP unit per block plus the root, the loss and gradients of the same policy
    on the unwrapped net, and every block recomputed once."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        net = Net().to(xla_device)
        if checkpointed:
            xla_wrap.apply_activation_checkpointing(net, lambda m: isinstance(m, Block))
        model = FSDP(net, auto_wrap_policy=policy)
        results.append(_fsdp_train(model, (BATCH, WIDTH), xla_device, op_calls, scalar_output=True))
    plain, got = results
    assert plain["units"] == 4
    assert got["units"] == 4, "the checkpointed blocks did not become FSDP units"
    _assert_trains_like(plain, got)
    _assert_recomputed_once(plain, got, forward=4, checkpointed=3)  # the head is not a Block


def _planned_units(net: Net, device: torch.device) -> nn.Module:
    """FSDP's auto-wrapping builds every unit as a plan for the smallest reachable peak says."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    net = net.to(device)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0)).to(device)
    with pytest.raises(xla_wrap.BudgetUnreachableError) as raised:
        xla_wrap.plan_checkpointing(net, x, budget=1, progress=False)
    budget = raised.value.smallest_peak_bytes
    plan = xla_wrap.plan_checkpointing(net, x, budget=budget, progress=False)
    assert plan.checkpointed, "the smallest peak needs checkpointing"
    net.plan = plan  # type: ignore[assignment]  # for the test to read
    policy = fsdp.auto_wrap_policy(wp.by_type(Block), net)
    return FSDP(
        net, auto_wrap_policy=policy, auto_wrapper_callable=fsdp.auto_wrapper_callable(plan=plan)
    )


def test_units_built_from_a_plan_are_checkpointed_as_planned_and_train_like_fsdp(
    xla_device: torch.device, reference: dict[str, tuple]
) -> None:
    _, expected_loss, expected_grads, _ = reference["auto"]
    model, loss, grads, _ = _step(_planned_units, xla_device)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert len(grads) == len(expected_grads) > 0
    for a, b in zip(expected_grads, grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    plan = next(vars(m)["plan"] for m in model.modules() if "plan" in vars(m))
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == 3
    for name, block in zip(plan.choices, blocks, strict=True):
        checkpointed = plan.choices[name] != "none"
        assert isinstance(block, xla_wrap.CheckpointWrapper) == checkpointed, name
    with pytest.raises(TypeError, match=r"^xla_wrap.fsdp.auto_wrapper_callable: expected a Che"):
        fsdp.auto_wrapper_callable(plan=plan, policy="dots_saveable")
