"""checkpoint_wrapper checkpoints a module in place and leaves it what it was (class, names,
place in the tree, state); apply_activation_checkpointing does it for the selected submodules."""

from __future__ import annotations

import copy
import pickle
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap

from models import BATCH, WIDTH, Block, Stack


class WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("kept", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.note = "unset"

    def get_extra_state(self) -> Any:
        return {"note": self.note}

    def set_extra_state(self, state: Any) -> None:
        self.note = state["note"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Stack(), WithExtraState())
    model[1].note = "saved"
    return model


def wrap_all(model: nn.Module) -> nn.Module:
    stack = model[0]
    for i, block in enumerate(stack.blocks):
        stack.blocks[i] = xla_wrap.checkpoint_wrapper(block)
    model[1] = xla_wrap.checkpoint_wrapper(model[1])
    return model


def test_parent_sees_the_unwrapped_names() -> None:
    plain, wrapped = make_model(), wrap_all(make_model())
    for method in ("named_parameters", "named_buffers"):
        assert [n for n, _ in getattr(wrapped, method)()] == [
            n for n, _ in getattr(plain, method)()
        ]
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert not any("checkpoint" in name for name in wrapped.state_dict())


def test_state_dict_round_trips_between_wrapped_and_unwrapped_models() -> None:
    plain, wrapped = make_model(), wrap_all(make_model())
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    wrapped[1].note = "other"
    wrapped.load_state_dict(plain.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    assert wrapped[1].note == "saved"  # extra state went through the wrapper
    assert "1.scratch" not in wrapped.state_dict()  # non-persistent buffers stay out
    fresh = make_model()
    fresh.load_state_dict(wrapped.state_dict())
    assert torch.equal(fresh[1].linear.weight, plain[1].linear.weight)


def test_the_wrapped_module_keeps_its_identity_class_and_class_name() -> None:
    seq = nn.Sequential(nn.Linear(WIDTH, 3), nn.ReLU())
    first = seq[0]
    wrapped = xla_wrap.checkpoint_wrapper(seq)
    assert wrapped is seq and wrapped.checkpoint_module is seq
    assert isinstance(wrapped, nn.Sequential) and isinstance(wrapped, xla_wrap.CheckpointWrapper)
    assert type(wrapped) is not nn.Sequential and type(wrapped).__name__ == "Sequential"
    assert wrapped[0] is first and len(wrapped) == 2 and list(wrapped) == [first, seq[1]]
    # Every checkpointed Sequential has one class, generated once.
    assert type(xla_wrap.checkpoint_wrapper(nn.Sequential())) is type(wrapped)
    linear = xla_wrap.checkpoint_wrapper(nn.Linear(WIDTH, 3))
    assert linear.in_features == WIDTH and linear.weight.shape == (3, WIDTH)
    with pytest.raises(AttributeError):
        _ = linear.no_such_attribute


def test_a_slice_of_a_checkpointed_sequential_is_a_plain_sequential() -> None:
    seq = xla_wrap.checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)))
    part = seq[1:]
    assert type(part) is nn.Sequential and part[1] is seq[2]


def test_the_forward_is_checkpointed_even_when_set_on_the_instance_before_wrapping() -> None:
    # accelerate's hooks and in-place patches set `forward` on the instance; the class's
    # checkpointing forward must not be hidden by it, and the patch must still run.
    seen: list[bool] = []
    linear = nn.Linear(WIDTH, WIDTH)
    original = linear.forward

    def patched(x: torch.Tensor) -> torch.Tensor:
        seen.append(xla_wrap.is_recomputing())
        return original(x)

    linear.forward = patched  # type: ignore[method-assign]
    wrapped = xla_wrap.checkpoint_wrapper(linear)
    wrapped(torch.randn(BATCH, WIDTH, requires_grad=True)).sum().backward()
    assert seen == [False, True]
    assert xla_wrap.unwrap(wrapped).forward is patched and type(wrapped) is nn.Linear


def test_unwrap_gives_the_module_its_class_back_and_stops_checkpointing() -> None:
    calls: list[bool] = []
    block = Block()
    block.linear.register_forward_hook(lambda *_: calls.append(xla_wrap.is_recomputing()))
    xla_wrap.checkpoint_wrapper(block)
    assert xla_wrap.unwrap(block) is block and type(block) is Block
    assert "_checkpoint_options" not in vars(block)
    block(torch.randn(BATCH, WIDTH, requires_grad=True)).sum().backward()
    assert calls == [False]  # not recomputed
    assert xla_wrap.unwrap(block) is block  # a plain module is returned as it is


def test_checkpointed_class_is_refused_for_a_direct_construction() -> None:
    with pytest.raises(TypeError, match="made by checkpoint_wrapper"):
        xla_wrap.CheckpointWrapper()


def test_setting_a_parameter_on_the_wrapper_reaches_the_module() -> None:
    linear = nn.Linear(WIDTH, 3)
    wrapped = xla_wrap.checkpoint_wrapper(linear)
    wrapped.weight = nn.Parameter(torch.zeros(3, WIDTH))
    assert torch.equal(linear.weight, torch.zeros(3, WIDTH))


def test_to_deepcopy_and_pickle_keep_the_module_checkpointed() -> None:
    wrapped = wrap_all(make_model())
    original_block = wrapped[0].blocks[0]
    as_double = copy.deepcopy(wrapped).to(torch.float64)
    block = as_double[0].blocks[0]
    assert block is not original_block and type(block) is type(original_block)
    assert block.linear.weight.dtype == torch.float64
    assert block.checkpoint_options == original_block.checkpoint_options
    assert wrapped[0].blocks[0].linear.weight.dtype == torch.float32  # the copy is independent
    restored = pickle.loads(pickle.dumps(wrapped))
    inner = restored[0].blocks[1]
    assert isinstance(inner, xla_wrap.CheckpointWrapper) and isinstance(inner, Block)
    assert type(inner) is type(original_block)
    assert restored[1].note == "saved"
    # The copies still checkpoint: each block runs again in backward.
    calls: list[bool] = []
    restored[0].blocks[1].linear.register_forward_hook(
        lambda *_: calls.append(xla_wrap.is_recomputing())
    )
    restored[0](torch.randn(BATCH, WIDTH, requires_grad=True)).backward()
    assert calls == [False, True]
    assert "CheckpointWrapper(Block(" in repr(wrapped)


def test_pickling_keeps_what_the_module_class_pickles() -> None:
    # An LSTM drops its weak references when pickled; a wrapper that pickled __dict__ itself
    # would fail on them.
    torch.manual_seed(0)
    lstm = xla_wrap.checkpoint_wrapper(nn.LSTM(WIDTH, WIDTH, batch_first=True))
    restored = pickle.loads(pickle.dumps(lstm))
    assert type(restored) is type(lstm)
    x = torch.randn(BATCH, 3, WIDTH)
    assert torch.equal(restored(x)[0], lstm(x)[0])


def test_a_forward_bound_on_the_instance_unpickles_without_recursing() -> None:
    # A bound method pickles by name: unpickled, it is the class's (checkpointing) forward.
    wrapped = xla_wrap.checkpoint_wrapper(_with_bound_forward(nn.Linear(WIDTH, WIDTH)))
    restored = pickle.loads(pickle.dumps(wrapped))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    assert torch.equal(restored(x), wrapped(x) / 2)  # the patch is lost, as without wrapping


def _with_bound_forward(linear: nn.Linear) -> nn.Linear:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias) * 2

    linear.forward = types.MethodType(forward, linear)  # type: ignore[method-assign]
    return linear


def test_a_class_derived_from_a_checkpointed_class_copies_as_itself() -> None:
    block = xla_wrap.checkpoint_wrapper(Block())
    derived = type("Derived", (type(block),), {})  # as FSDP2 derives a class of its own
    block.__class__ = derived
    twin = copy.deepcopy(block)
    assert type(twin) is derived and twin.checkpoint_options == block.checkpoint_options
    calls: list[bool] = []
    twin.linear.register_forward_hook(lambda *_: calls.append(xla_wrap.is_recomputing()))
    twin(torch.randn(BATCH, WIDTH, requires_grad=True)).sum().backward()
    assert calls == [False, True]


def test_building_another_module_of_a_checkpointed_class_builds_a_plain_one() -> None:
    wrapped = xla_wrap.checkpoint_wrapper(nn.Linear(WIDTH, WIDTH))
    other = type(wrapped)(3, 5)  # constructor arguments reach the class's __init__
    assert type(other) is nn.Linear and other.weight.shape == (5, 3)


def test_train_and_eval_reach_the_wrapped_module() -> None:
    wrapped = wrap_all(make_model())
    wrapped.eval()
    inner = wrapped[0].blocks[0]
    assert not inner.training and not inner.drop.training
    wrapped.train()
    assert inner.training and inner.drop.training


def test_optimizer_over_wrapped_model_sees_the_same_parameters() -> None:
    plain, wrapped = make_model(), wrap_all(make_model())
    assert [p.shape for p in wrapped.parameters()] == [p.shape for p in plain.parameters()]
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_wrapping_twice_returns_the_wrapper_or_refuses_other_options() -> None:
    wrapped = xla_wrap.checkpoint_wrapper(Block())
    assert xla_wrap.checkpoint_wrapper(wrapped) is wrapped
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"xla_wrap\.unwrap\(module\)"):
        xla_wrap.checkpoint_wrapper(wrapped, preserve_rng_state=False)
    assert wrapped.checkpoint_options.preserve_rng_state is True
    rewrapped = xla_wrap.checkpoint_wrapper(xla_wrap.unwrap(wrapped), preserve_rng_state=False)
    assert rewrapped is wrapped and wrapped.checkpoint_options.preserve_rng_state is False


# Module trees for apply_activation_checkpointing: each node is a Sequential of children or a
# Linear leaf; a few modules are shared between two places.
_trees = st.recursive(
    st.just("leaf"),
    lambda children: st.lists(children, min_size=1, max_size=3),
    max_leaves=8,
)


def _build(spec: Any) -> nn.Module:
    if spec == "leaf":
        return nn.Linear(2, 2)
    return nn.Sequential(*(_build(s) for s in spec))


@settings(max_examples=60, deadline=None)
@given(spec=_trees, data=st.data())
def test_apply_wraps_exactly_the_selected_modules_once_never_the_root(spec: Any, data: Any) -> None:
    model = _build(spec)
    modules = list(model.modules())
    if len(modules) > 2 and data.draw(st.booleans(), label="share a module"):
        # Put one module at a second place too; it must end up wrapped once, at both places.
        model.add_module("again", data.draw(st.sampled_from(modules[1:]), label="shared"))
    chosen = data.draw(st.sets(st.sampled_from(range(len(modules)))), label="chosen")
    selected = {id(modules[i]) for i in chosen}
    names_before = [n for n, _ in model.named_parameters()]
    seen: list[int] = []

    def check_fn(module: nn.Module) -> bool:
        seen.append(id(module))
        return id(module) in selected

    result = xla_wrap.apply_activation_checkpointing(model, check_fn)
    assert result is model and not isinstance(model, xla_wrap.CheckpointWrapper)
    assert id(model) not in seen  # the root is never offered
    assert len(seen) == len(set(seen))  # nothing is considered (so wrapped) twice
    wrapped = {id(m) for m in model.modules() if isinstance(m, xla_wrap.CheckpointWrapper)}
    assert wrapped == selected - {id(model)}
    assert [id(m) for m in model.modules()] == [id(m) for m in modules]  # same tree, in place
    assert [n for n, _ in model.named_parameters()] == names_before
    x = torch.randn(3, 2, requires_grad=True)
    model(x).sum().backward()  # every layer maps 2 -> 2, so the wrapped tree still runs
    assert x.grad is not None


def test_apply_visits_children_before_parents() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    order: list[str] = []

    def check_fn(module: nn.Module) -> bool:
        order.append(type(module).__name__ + str(len(list(module.children()))))
        return isinstance(module, nn.Linear)

    xla_wrap.apply_activation_checkpointing(model, check_fn)
    assert order == ["Linear0", "Sequential1", "Linear0"]
    assert isinstance(model[0][0], xla_wrap.CheckpointWrapper)


def test_apply_passes_wrapper_options_and_rejects_bad_arguments() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    xla_wrap.apply_activation_checkpointing(model, lambda m: True, preserve_rng_state=False)
    assert model[0].checkpoint_options.preserve_rng_state is False
    with pytest.raises(TypeError, match="apply_activation_checkpointing: expected a callable"):
        xla_wrap.apply_activation_checkpointing(model, "Linear")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected an nn.Module"):
        xla_wrap.apply_activation_checkpointing([nn.Linear(2, 2)], lambda m: True)  # type: ignore[type-var]


def test_hooks_registered_on_the_wrapper_run() -> None:
    calls: list[str] = []
    plain = nn.Linear(WIDTH, WIDTH)
    wrapped = xla_wrap.checkpoint_wrapper(nn.Linear(WIDTH, WIDTH))
    for module in (plain, wrapped):
        module.register_full_backward_hook(lambda m, gi, go: calls.append("backward"))
        module.register_forward_hook(lambda m, i, o: calls.append("forward"))
        module(torch.randn(BATCH, WIDTH, requires_grad=True)).sum().backward()
    assert calls == ["forward", "backward"] * 2
    state_calls: list[str] = []
    wrapped.register_state_dict_post_hook(lambda *args: state_calls.append("state_dict"))
    nn.Sequential(wrapped).state_dict()
    assert state_calls == ["state_dict"]


def test_hooks_of_the_module_run_once_and_hooks_of_its_submodules_run_again() -> None:
    # The module's own hooks wrap the checkpoint (as FSDP2's hooks must, around the unit);
    # its submodules run inside the block, so their hooks run in the recomputation too.
    seen: list[str] = []
    block = Block()
    block.register_forward_hook(lambda *_: seen.append(f"block {xla_wrap.is_recomputing()}"))
    block.linear.register_forward_hook(
        lambda *_: seen.append(f"linear {xla_wrap.is_recomputing()}")
    )
    xla_wrap.checkpoint_wrapper(block)(torch.randn(BATCH, WIDTH)).sum().backward()
    assert seen == ["linear False", "block False", "linear True"]


def test_apply_leaves_existing_wrappers_and_their_insides_alone() -> None:
    inner = nn.Sequential(nn.Linear(2, 2))
    model = nn.Sequential(xla_wrap.checkpoint_wrapper(inner), nn.Linear(2, 2))
    xla_wrap.apply_activation_checkpointing(model, lambda m: isinstance(m, nn.Linear))
    assert isinstance(inner[0], nn.Linear)  # no checkpoint nested inside the existing one
    assert isinstance(model[1], xla_wrap.CheckpointWrapper)


def test_apply_checks_options_before_wrapping_anything() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        TypeError, match=r"apply_activation_checkpointing: expected checkpoint options among"
    ):
        xla_wrap.apply_activation_checkpointing(model, lambda m: False, bogus=1)
    with pytest.raises(ValueError, match=r"apply_activation_checkpointing: unknown policy"):
        xla_wrap.apply_activation_checkpointing(model, lambda m: False, policy="dot_saveable")
    # A wrongly typed option is named as such, not as an unknown option.
    with pytest.raises(TypeError, match=r"expected a policy .* got int 42"):
        xla_wrap.apply_activation_checkpointing(model, lambda m: False, policy=42)
    assert isinstance(model[0], nn.Linear)


def test_functional_call_and_reassigned_parameters_get_the_forward_parameters_gradients() -> None:
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    model[0] = xla_wrap.checkpoint_wrapper(model[0])
    x = torch.randn(BATCH, WIDTH)
    # functional_call puts the module's own parameters back before backward runs: the
    # recomputation must still use the parameters the forward used.
    params = {n: torch.randn_like(p, requires_grad=True) for n, p in model.named_parameters()}
    twins = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    functional_call(model, params, (x,)).sum().backward()
    functional_call(reference, twins, (x,)).sum().backward()
    for name, param in params.items():
        assert param.grad is not None and torch.equal(param.grad, twins[name].grad), name
    assert all(p.grad is None for p in model.parameters())
    # A parameter replaced between forward and backward: the forward's one gets the gradient.
    linear = nn.Linear(WIDTH, WIDTH)
    old_weight = linear.weight
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    y = xla_wrap.checkpoint(linear, x)
    linear.weight = nn.Parameter(torch.zeros(WIDTH, WIDTH))
    y.sum().backward()
    assert old_weight.grad is not None and linear.weight.grad is None
    torch.testing.assert_close(x.grad, old_weight.detach().sum(0).expand(BATCH, WIDTH))


# --- PyTorch's name for the inner module -----------------------------------------------------


class CountingLinear(nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingLinear.calls += 1
        return super().forward(x)


def test_checkpoint_wrapped_module_is_the_module_unchecked_sharing_its_state() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(CountingLinear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.2))
    wrapped = xla_wrap.checkpoint_wrapper(copy.deepcopy(block))
    inner = wrapped._checkpoint_wrapped_module
    assert type(inner) is nn.Sequential and not isinstance(inner, xla_wrap.CheckpointWrapper)
    assert inner[0].weight is wrapped[0].weight and inner[0] is wrapped[0]
    # not a child: names, state_dict and modules() are the unwrapped module's
    assert list(wrapped.state_dict()) == list(block.state_dict())
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in block.named_modules()]
    # its forward is the plain one: one call per step, where the wrapper recomputes
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    for module, calls in ((inner, 1), (wrapped, 2)):
        CountingLinear.calls = 0
        module(x).sum().backward()
        assert CountingLinear.calls == calls
    with pytest.raises(AttributeError, match="read-only"):
        wrapped._checkpoint_wrapped_module = nn.Linear(2, 2)
    assert "_checkpoint_wrapped_module" not in wrapped._modules


def test_the_unwrapping_loop_pytorch_users_write_ends_on_the_plain_module() -> None:
    model = Stack()
    xla_wrap.apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
    for block in model.blocks:
        inner = block
        while hasattr(inner, "_checkpoint_wrapped_module"):
            inner = inner._checkpoint_wrapped_module
        assert type(inner) is Block
        assert dict(inner.named_parameters()) == dict(block.named_parameters())
    plain = [m for m in model.modules() if not hasattr(m, "_checkpoint_wrapped_module")]
    assert len(plain) == len(list(model.modules())) - len(model.blocks)


def test_pytorchs_apply_activation_checkpointing_test_shape_reads_the_inner_weight() -> None:
    """PyTorch's test_apply_activation_checkpointing compares each wrapped linear's weight
    through ``_checkpoint_wrapped_module`` after an optimizer step."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential(*(Inner() for _ in range(3)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.seq(x)

    torch.manual_seed(0)
    plain = Model()
    model = copy.deepcopy(plain)
    xla_wrap.apply_activation_checkpointing(model, lambda m: isinstance(m, nn.Linear))
    for m in (plain, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(1)
        m(torch.randn(BATCH, WIDTH)).pow(2).sum().backward()
        optimizer.step()
    for j in range(3):
        got = model.seq[j].lin._checkpoint_wrapped_module.weight
        assert torch.equal(got, plain.seq[j].lin.weight)
        assert got is model.seq[j].lin.weight
