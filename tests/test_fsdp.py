"""Checkpointing composed with torch_xla's FSDP (v1), in one process (world size 1)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import fsdp, wrap

from models import BATCH, WIDTH, Block

pytestmark = pytest.mark.xla


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x).sum()


def _per_block(order: str) -> Callable[[Net, torch.device], nn.Module]:
    def build(net: Net, device: torch.device) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

        for i, block in enumerate(net.blocks):
            block = block.to(device)
            net.blocks[i] = {
                "plain": lambda b: FSDP(b),
                "fsdp(checkpoint)": lambda b: FSDP(xla_wrap.checkpoint_wrapper(b)),
                "checkpoint(fsdp)": lambda b: xla_wrap.checkpoint_wrapper(FSDP(b)),
                # the non-reentrant engine recomputes inside FSDP's own forward, the order
                # where stopping the recomputation early would break FSDP's state machine
                "checkpoint(fsdp) non-reentrant": lambda b: xla_wrap.checkpoint_wrapper(
                    FSDP(b), use_reentrant=False
                ),
            }[order](block)
        return FSDP(net.to(device))

    return build


def _auto(checkpointed: bool) -> Callable[[Net, torch.device], nn.Module]:
    def build(net: Net, device: torch.device) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

        net = net.to(device)
        policy = fsdp.auto_wrap_policy(wrap.by_type(Block), net)
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
        block.register_forward_hook(lambda *_: calls.append(xla_wrap.is_recomputing()))
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
        (
            "checkpoint_wrapper(FSDP(block), use_reentrant=False)",
            _per_block("checkpoint(fsdp) non-reentrant"),
            "per-block",
        ),
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
    callback = fsdp.auto_wrap_policy(wrap.by_type(Block), net)
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
    "policy", [wrap.by_param_count(1, 511), wrap.by_name("blocks.*")], ids=["size", "name"]
)
def test_a_policy_blind_inside_fsdp_is_refused_with_the_order_to_use(
    reference: dict[str, tuple], policy: wrap.Policy
) -> None:
    # FSDP(net) with every block a unit: the parameters are flattened into the units (512
    # each) and the names prefixed with `_fsdp_wrapped_module._fpw_module.`.
    sharded = reference["auto"][0]
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"(?s)already wrapped.*before FSDP"):
        xla_wrap.apply_activation_checkpointing(sharded, policy)
    assert not any(isinstance(m, xla_wrap.CheckpointWrapper) for m in sharded.modules())
    with pytest.raises(xla_wrap.CheckpointValueError, match="already contains FSDP units"):
        fsdp.auto_wrap_policy(wrap.by_type(Block), sharded)
