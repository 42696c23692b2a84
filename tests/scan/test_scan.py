"""Scanned layer stacks (xla_wrap.scan_layers, ScannedLayers, apply_scan): the loop's result
and gradients for every policy, Dropout masks recomputed exactly, what each policy saves and
recomputes as XLA compiles it, the way in for models that loop over a ModuleList, errors."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import internal, introspect

from _workers import WORKERS, run_worker
from models import sync

WIDTH = 16
DEPTH = 4
POLICIES = {
    "nothing": None,
    "dots": "dots_saveable",
    "names": cp.save_only_these_names("hidden"),
}


class Layer(nn.Module):
    """Reads a shared argument (needing its own gradient), a keyword and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.register_buffer("offset", torch.randn(WIDTH), persistent=False)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, shift: float) -> torch.Tensor:
        hidden = xla_wrap.checkpoint_name(torch.tanh(self.up(self.norm(x))), "hidden")
        return x + self.down(hidden) * scale + self.offset * shift


def _loop(layers: nn.ModuleList, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    for layer in layers:
        x = layer(x, *args, **kwargs)
    return x


def _run(
    layers: nn.ModuleList, device: torch.device, scanned: bool, policy: Any = None
) -> dict[str, torch.Tensor]:
    """One step; the gradients by state_dict name (per layer also where stacked)."""
    torch.manual_seed(1)
    x = torch.randn(3, WIDTH).to(device).requires_grad_()
    scale = torch.tensor(0.7).to(device).requires_grad_()
    layers.zero_grad(set_to_none=True)
    if scanned and not isinstance(layers, xla_wrap.ScannedLayers):
        y = xla_wrap.scan_layers(layers, x, scale, shift=0.5, policy=policy)
    else:
        y = _loop(layers, x, scale, shift=0.5)  # a ScannedLayers scans it
    y.pow(2).mean().backward()
    out = {"y": y.detach(), "x": x.grad, "scale": scale.grad}
    out.update(internal.per_layer_gradients(layers))
    sync(device)  # one program for all: each .cpu() would compile its own
    return {k: v.cpu() for k, v in out.items()}


@pytest.fixture(scope="module")
def layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(DEPTH))


@pytest.mark.xla
@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_loss_and_gradients_equal_the_eager_loop_for_each_policy(
    layers: nn.ModuleList, xla_device: torch.device, policy: str, stacked: bool
) -> None:
    expected = _run(layers, torch.device("cpu"), scanned=False)
    twin = copy.deepcopy(layers)
    if stacked:
        twin = xla_wrap.ScannedLayers(twin, policy=POLICIES[policy], stack_parameters=True)
    got = _run(twin.to(xla_device), xla_device, True, POLICIES[policy])
    assert got.keys() == expected.keys()
    for key in expected:
        scale = float(expected[key].abs().max())
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5 * scale, msg=key)


def test_on_eager_cpu_it_is_the_checkpointed_loop_bitwise_with_dropout() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3)) for _ in range(3)
    )
    runs = []
    for scanned in (False, True):
        torch.manual_seed(5)
        x = torch.randn(4, WIDTH, requires_grad=True)
        layers.zero_grad(set_to_none=True)
        y = xla_wrap.scan_layers(layers, x) if scanned else _loop(layers, x)
        y.sum().backward()
        runs.append([y, x.grad, *(p.grad for p in layers.parameters())])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


class _Masked(nn.Module):
    """Adds Dropout(0.5) of a constant 2**i: the sum of all layers' outputs spells every
    layer's forward mask in binary, and the gradient of ``w`` is the mask backward used."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4, 32), 2.0**i))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.w)


@pytest.mark.xla
def test_dropout_recomputes_the_forward_mask_and_each_layer_and_step_draws_its_own(
    xla_device: torch.device,
) -> None:
    import torch_xla

    n = 6
    layers = nn.ModuleList(_Masked(i) for i in range(n)).to(xla_device)
    steps = []
    for _ in range(2):
        layers.zero_grad(set_to_none=True)
        y = xla_wrap.scan_layers(layers, torch.zeros(4, 32, device=xla_device))
        y.sum().backward()
        torch_xla.sync()
        code = (y.cpu() / 2).round().long()  # kept values are scaled by 1 / (1 - p) = 2
        forward = torch.stack([(code >> i) & 1 for i in range(n)])
        backward = torch.stack([(layer.w.grad.cpu() / 2).round().long() for layer in layers])
        assert torch.equal(forward, backward)
        steps.append(forward)
        assert 0.3 < forward.float().mean() < 0.7
    for i in range(1, n):
        assert not torch.equal(steps[0][i], steps[0][0])  # layers differ
    assert not torch.equal(steps[0], steps[1])  # steps differ


@pytest.mark.xla
def test_a_model_with_dropout_trains(xla_device: torch.device) -> None:
    import torch_xla

    torch.manual_seed(0)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3)
    ).to(xla_device)
    x = torch.randn(32, WIDTH).to(xla_device)
    target = torch.randn(32, WIDTH).to(xla_device) * 0.1
    optimizer = torch.optim.Adam(layers.parameters(), lr=0.02)
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        loss = (xla_wrap.scan_layers(layers, x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


@pytest.fixture(scope="module")
def compiled_stacks(xla_device: torch.device) -> dict[str, introspect.CompiledProgram]:
    """One stack of layers whose activations outweigh their weights, compiled as the plain
    loop, the checkpointed loop and the scan under two policies."""
    torch.manual_seed(0)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)
    ).to(xla_device)
    x = torch.randn(512, 64).to(xla_device).requires_grad_()

    def checkpointed() -> torch.Tensor:
        y = x
        for layer in layers:
            y = xla_wrap.checkpoint(layer, y)
        return y

    def compiled(run: Any) -> introspect.CompiledProgram:
        def step() -> None:
            import torch_xla

            layers.zero_grad(set_to_none=True)
            run().pow(2).sum().backward()  # not a plain sum: XLA would fold its ones away
            torch_xla.sync()

        return introspect.compiled_memory(step)

    return {
        "plain": compiled(lambda: _loop(layers, x)),
        "checkpointed": compiled(checkpointed),
        "nothing": compiled(lambda: xla_wrap.scan_layers(layers, x)),
        "dots": compiled(lambda: xla_wrap.scan_layers(layers, x, policy="dots_saveable")),
    }


@pytest.mark.xla
def test_policies_decide_what_is_stacked_and_what_is_recomputed(
    compiled_stacks: dict[str, introspect.CompiledProgram],
) -> None:
    """Read from the compiled programs: nothing_saveable recomputes the matmuls whose outputs
    backward reads, dots_saveable none; nothing_saveable keeps the least."""
    plain, nothing, dots = (compiled_stacks[k] for k in ("plain", "nothing", "dots"))
    # A layer's matmuls, F each: 2 forward, 4 backward. Recomputing costs the first one only
    # (backward does not read the second's output): 7F per layer instead of 6F.
    assert nothing.flops == pytest.approx(plain.flops * 7 / 6, rel=0.01)
    assert dots.flops == pytest.approx(plain.flops, rel=0.01)
    assert nothing.total_bytes < dots.total_bytes < plain.total_bytes


@pytest.mark.xla
def test_the_scan_needs_no_more_memory_than_the_checkpointed_loop(
    compiled_stacks: dict[str, introspect.CompiledProgram],
) -> None:
    """The scan stacks the layers' weights, but the gradients overwrite that stack in
    backward instead of taking a second one: its peak is the checkpointed loop's (both keep
    one input per layer; the scan's stack also copies the first), not a stack of weights
    above it (1.16x)."""
    scan, loop = compiled_stacks["nothing"], compiled_stacks["checkpointed"]
    assert scan.total_bytes <= 1.05 * loop.total_bytes


@pytest.mark.xla
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    structure=st.sampled_from(["tuple", "dict", "nested"]),
    with_int=st.booleans(),
)
def test_any_carry_structure_round_trips(
    xla_device: torch.device, structure: str, with_int: bool
) -> None:
    """Tuples, dicts and nestings of tensors (an integer tensor among them) as the carry."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, carry: Any) -> Any:
            if structure == "tuple":
                a, b, *rest = carry
                return (b, self.lin(a) + b, *rest)
            if structure == "dict":
                return {
                    "a": carry["b"],
                    "b": self.lin(carry["a"]) + carry["b"],
                    **{k: v for k, v in carry.items() if k == "n"},
                }
            (a, b), rest = carry
            return (b, self.lin(a)), rest

        @staticmethod
        def make(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor | None) -> Any:
            if structure == "tuple":
                return (a, b, n) if n is not None else (a, b)
            if structure == "dict":
                return {"a": a, "b": b, **({"n": n} if n is not None else {})}
            return (a, b), ([n] if n is not None else [])

    torch.manual_seed(0)
    layers = nn.ModuleList(Pair() for _ in range(3))
    n = torch.arange(3) if with_int else None
    results = []
    for device, scanned in ((torch.device("cpu"), False), (xla_device, True)):
        stack = copy.deepcopy(layers).to(device)
        a = torch.ones(2, WIDTH, device=device, requires_grad=True)
        b = torch.zeros(2, WIDTH, device=device)
        carry = Pair.make(a, b, n.to(device) if n is not None else None)
        out = xla_wrap.scan_layers(stack, carry) if scanned else _loop(stack, carry)
        leaves = torch.utils._pytree.tree_leaves(out)
        sum(t.float().sum() for t in leaves).backward()
        sync(device)  # one program, not one per .cpu()
        results.append((torch.utils._pytree.tree_map(lambda t: t.cpu(), out), a.grad.cpu()))
    (expected, expected_grad), (got, got_grad) = results
    assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(expected)
    for e, g in zip(
        torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got), strict=True
    ):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-5)


# --- the way in for existing models ---------------------------------------------------------


class LoopModel(nn.Module):
    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:DEPTH]:  # sliced, as transformers models do
            x = layer(x, scale, shift=0.25)
        return self.head(x).mean()


@pytest.mark.xla
def test_apply_scan_keeps_names_and_state_and_trains_as_the_loop(xla_device: torch.device) -> None:
    torch.manual_seed(0)
    model = LoopModel()
    twin = copy.deepcopy(model)
    keys = list(model.state_dict())
    xla_wrap.apply_scan(twin, policy="dots_saveable")
    assert isinstance(twin.layers, xla_wrap.ScannedLayers)
    assert isinstance(twin.layers, nn.ModuleList)
    assert list(twin.state_dict()) == keys
    assert twin.layers[0] is twin.layers._modules["0"]
    grads = []
    for m, device in ((model, torch.device("cpu")), (twin.to(xla_device), xla_device)):
        x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(2)).to(device)
        scale = torch.tensor(0.5).to(device)
        m(x, scale).backward()
        sync(device)  # one program, not one per .cpu()
        grads.append({n: p.grad.cpu() for n, p in m.named_parameters()})
    for name, expected in grads[0].items():
        torch.testing.assert_close(grads[1][name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_a_loop_that_does_more_than_pass_the_result_on_is_refused() -> None:
    class Skipping(LoopModel):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x * 2, scale, shift=0.25)
            return x.sum()

    model = xla_wrap.apply_scan(Skipping())
    with pytest.raises(
        xla_wrap.CheckpointError, match=r"ScannedLayers: layer 1 .*not the previous"
    ):
        model(torch.randn(2, WIDTH), torch.tensor(1.0))


def test_scanned_layers_built_at_construction_run_on_eager_cpu_as_the_loop() -> None:
    torch.manual_seed(0)
    plain = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
    scanned = xla_wrap.ScannedLayers(copy.deepcopy(plain), policy="dots_saveable")
    x = torch.randn(2, WIDTH)
    assert torch.equal(_loop(scanned, x), _loop(plain, x))
    assert repr(scanned).startswith("ScannedLayers(\n  (0): Linear(")
    assert all(isinstance(stand_in, nn.Linear) for stand_in in scanned)


# --- stacked parameter storage --------------------------------------------------------------


class _TwiceTied(nn.Module):
    """One parameter under two names: the same Linear applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.once = nn.Linear(WIDTH, WIDTH)
        self.again = self.once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.again(torch.tanh(self.once(x)))


def test_a_parameter_a_layer_holds_under_two_names_is_refused() -> None:
    """The body gives each layer its parameters by name: under a second name layer 0's would
    stay (silently wrong gradients); replacing both names makes torch_xla 2.9 crash."""
    layers = nn.ModuleList(_TwiceTied() for _ in range(2))
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"under several \(once.weight"):
        xla_wrap.scan_layers(layers, torch.randn(2, WIDTH))


def test_tiled_sharding_specs_read_as_torch_xla_prints_them() -> None:
    from xla_wrap.internal import tiled_sharding

    assert tiled_sharding("{devices=[4,1,1]0,1,2,3}") == ((4, 1, 1), [0, 1, 2, 3], 3)
    assert tiled_sharding("{devices=[4,1]<=[4]}") == ((4, 1), [0, 1, 2, 3], 2)
    transposed = "{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}"
    assert tiled_sharding(transposed) == ((2, 1, 2), [0, 2, 1, 3], 2)
    assert tiled_sharding("{replicated}") is None


def _dropout_layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(
            nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.3)
        ).append(nn.Linear(2 * WIDTH, WIDTH))
        for _ in range(3)
    )


def test_stacked_parameters_are_one_per_name_held_by_layer_0() -> None:
    plain = _dropout_layers()
    stacked = xla_wrap.ScannedLayers(copy.deepcopy(plain), stack_parameters=True)
    assert stacked.parameters_stacked and not xla_wrap.ScannedLayers(plain).parameters_stacked
    names = [name for name, _ in plain.named_parameters() if name.startswith("0.")]
    assert [name for name, _ in stacked.named_parameters()] == names
    for name, param in stacked.named_parameters():
        expected = torch.stack([plain.get_parameter(f"{i}{name[1:]}") for i in range(3)])
        assert torch.equal(param, expected)
    assert not list(stacked[1].parameters())  # the others keep structure and buffers only
    assert isinstance(stacked[0][0], nn.LayerNorm)  # weight decay rules by type still see it
    # Printing does not reach the other layers, whose modules' reprs read their parameters.
    assert "(1-2): as layer 0, parameters stacked in layer 0 (3 layers)" in repr(stacked)


def test_stacked_parameters_on_eager_cpu_train_as_the_checkpointed_loop_bitwise() -> None:
    plain = _dropout_layers()
    stacked = xla_wrap.ScannedLayers(copy.deepcopy(plain), stack_parameters=True)
    runs = []
    for layers in (plain, stacked):
        torch.manual_seed(5)
        x = torch.randn(4, WIDTH, requires_grad=True)
        y = x
        for layer in layers:
            y = layer(y) if layers is stacked else xla_wrap.checkpoint(layer, y)
        y.pow(2).sum().backward()
        runs.append({"y": y, "x": x.grad, **internal.per_layer_gradients(layers)})
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_stacked_parameters_keep_the_per_layer_state_dict_and_load_both_ways(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    plain = _dropout_layers()
    stacked = xla_wrap.ScannedLayers(copy.deepcopy(plain), stack_parameters=True)
    expected = plain.state_dict()
    state = stacked.state_dict()
    assert list(state) == list(expected)  # names and order of the unscanned list
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    save_file(state, tmp_path / "layers.safetensors")  # refuses tensors that share memory
    fresh = _dropout_layers()
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    into_stacked = xla_wrap.ScannedLayers(fresh, stack_parameters=True)
    into_stacked.load_state_dict(load_file(tmp_path / "layers.safetensors"))
    pairs = zip(into_stacked.parameters(), stacked.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    back = _dropout_layers()
    back.load_state_dict(into_stacked.state_dict())
    assert all(torch.equal(back.state_dict()[k], v) for k, v in expected.items())
    xla_wrap.unscan(into_stacked)
    assert type(into_stacked) is nn.ModuleList
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in into_stacked.named_parameters()] == names
    assert all(torch.equal(into_stacked.state_dict()[k], v) for k, v in expected.items())


def test_stacked_parameters_load_partial_and_one_layer_state_dicts() -> None:
    plain = _dropout_layers()
    stacked = xla_wrap.ScannedLayers(copy.deepcopy(plain), stack_parameters=True)
    before = stacked.state_dict()
    partial = {k: v + 1 for k, v in plain.state_dict().items() if not k.startswith("2.")}
    result = stacked.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == sorted(k for k in before if k.startswith("2."))
    after = stacked.state_dict()
    for key in before:  # layers 0 and 1 loaded, layer 2's slices kept
        expected = before[key] if key.startswith("2.") else before[key] + 1
        assert torch.equal(after[key], expected), key
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*2\.1\.weight"):
        stacked.load_state_dict(partial)
    single = xla_wrap.ScannedLayers([nn.Linear(WIDTH, WIDTH)], stack_parameters=True)
    single.load_state_dict(single.state_dict())  # per-layer entries of one layer, stacked


def test_a_stacked_list_edited_afterwards_is_refused_until_unscanned() -> None:
    layers = xla_wrap.ScannedLayers(_dropout_layers(), stack_parameters=True)
    layers.append(_dropout_layers()[0])
    for use in (layers.state_dict, lambda: xla_wrap.unscan(layers)):
        with pytest.raises(xla_wrap.CheckpointError, match=r"positions \[0, 1, 2, None\].*unscan"):
            use()
    with pytest.raises(xla_wrap.CheckpointValueError, match="xla_wrap.unscan the list first"):
        _loop(layers, torch.randn(2, WIDTH))
    del layers[3]
    assert xla_wrap.unscan(layers) is layers and len(list(layers.parameters())) == 3 * 6


@pytest.mark.xla
def test_stacked_parameters_leave_nothing_per_layer_in_the_compiled_program(
    xla_device: torch.device,
) -> None:
    """What makes compile time flat in depth: with stacked storage the program of 3 layers
    and of 6 is the same HLO but for the loop's trip count and the stacks' first dimension;
    with per-layer parameters each layer adds inputs, slices and outputs."""
    import torch_xla

    def program_lines(depth: int, stacked: bool) -> int:
        torch.manual_seed(0)
        layers = xla_wrap.ScannedLayers(
            (nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(depth)),
            stack_parameters=stacked,
        ).to(xla_device)
        x = torch.randn(4, 8).to(xla_device)

        def step() -> None:
            _loop(layers, x).pow(2).sum().backward()
            torch_xla.sync()

        return len(introspect.compiled_memory(step).optimized_hlo.splitlines())

    # From 3 layers on: torch_xla bakes the scalars 0 and 1 (the last layer's index at 2
    # layers) into the program as constants, and XLA folds them.
    assert program_lines(3, stacked=True) == program_lines(6, stacked=True)
    assert program_lines(3, stacked=False) < program_lines(6, stacked=False)


def test_stacked_parameters_refuse_tied_layers_and_slices_past_the_first() -> None:
    shared = nn.Linear(WIDTH, WIDTH)
    tied = nn.ModuleList(nn.Sequential(shared, nn.Tanh()) for _ in range(2))
    with pytest.raises(xla_wrap.CheckpointValueError, match="shared with layer 0.*untie"):
        xla_wrap.ScannedLayers(tied, stack_parameters=True)
    model = nn.Module()
    model.first = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
    model.second = tied
    with pytest.raises(xla_wrap.CheckpointValueError, match="xla_wrap.apply_scan: .*shared"):
        xla_wrap.apply_scan(model, stack_parameters=True)
    assert type(model.first) is nn.ModuleList  # refused before any list changed
    layers = xla_wrap.ScannedLayers(_dropout_layers(), stack_parameters=True)
    x = torch.randn(2, WIDTH)
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"stack positions \[1, 2\]"):
        _loop(layers[1:], x)
    assert _loop(layers[:2], x).shape == x.shape  # a prefix scans its part of the stacks


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "error", "message"),
    [
        ([nn.Linear(2, 2), "relu"], xla_wrap.CheckpointTypeError, "nn.Module layers, got str"),
        (nn.Linear(2, 2), xla_wrap.CheckpointTypeError, "a sequence of layers"),
        (
            [nn.Linear(2, 2), nn.Linear(2, 3)],
            xla_wrap.CheckpointValueError,
            r"layer 1 differing from layer 0 in parameters",
        ),
        ([nn.Linear(2, 2), nn.ReLU()], xla_wrap.CheckpointValueError, "layer 1 differing"),
    ],
    ids=["not-a-module", "one-module", "other-shapes", "other-class"],
)
def test_bad_layers_get_an_error_naming_the_api(layers: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        xla_wrap.scan_layers(layers, torch.randn(2, 2))
    assert "xla_wrap.scan_layers" in str(info.value)


def test_no_layers_leave_the_carry_as_it_came() -> None:
    # As the loop over an empty list, and torch_xla's scan_layers.
    x = torch.randn(2, 2)
    assert xla_wrap.scan_layers([], x) is x
    assert xla_wrap.scan_layers(nn.ModuleList(), x, torch.ones(1), shift=0.5) is x


def test_hooks_and_wrong_outputs_are_refused() -> None:
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    handle = layers[1].register_forward_hook(lambda *a: None)
    with pytest.raises(xla_wrap.CheckpointValueError, match="layer 1 has module hooks"):
        xla_wrap.scan_layers(layers, torch.randn(2, 2))
    handle.remove()
    with pytest.raises(xla_wrap.CheckpointTypeError, match="carry as the first positional"):
        xla_wrap.scan_layers(layers)


@pytest.mark.xla
def test_a_layer_that_returns_another_structure_or_writes_a_buffer_is_refused(
    xla_device: torch.device,
) -> None:
    class Widening(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    with pytest.raises(xla_wrap.CheckpointTypeError, match="return its carry's structure"):
        xla_wrap.scan_layers(
            nn.ModuleList([Widening(), Widening()]).to(xla_device),
            torch.randn(3, 2, device=xla_device),
        )
    norms = nn.ModuleList(nn.BatchNorm1d(2) for _ in range(2)).to(xla_device)
    with pytest.raises(xla_wrap.CheckpointError, match="modified 'running_mean', 'running_var'"):
        xla_wrap.scan_layers(norms, torch.randn(3, 2, device=xla_device))


def test_on_eager_cpu_a_layer_returning_more_than_its_carry_is_refused_as_on_xla() -> None:
    class WithExtras(nn.Module):  # as Falcon's and Bloom's layers: (hidden states, None)
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return self.lin(x), None

    layers = nn.ModuleList(WithExtras() for _ in range(2))
    with pytest.raises(xla_wrap.CheckpointTypeError, match="return its carry's structure"):
        xla_wrap.scan_layers(layers, torch.randn(2, WIDTH))


@pytest.mark.xla
def test_double_backward_through_a_scan_is_refused_and_on_eager_cpu_works(
    layers: nn.ModuleList, xla_device: torch.device
) -> None:
    # The XLA scan's backward is a While loop without a graph: refused, not a silent zero.
    twin = copy.deepcopy(layers).to(xla_device)
    x = torch.randn(3, WIDTH).to(xla_device).requires_grad_()
    scale = torch.tensor(0.7).to(xla_device)
    y = xla_wrap.scan_layers(twin, x, scale, shift=0.5).pow(2).sum()
    with pytest.raises(xla_wrap.CheckpointError, match=r"double backward .* scanned stack"):
        torch.autograd.grad(y, x, create_graph=True)
    # On eager CPU the scan is the checkpointed loop, whose engine supports it.
    derivatives = []
    for scanned in (False, True):
        x = torch.linspace(-1, 1, 3 * WIDTH).reshape(3, WIDTH).requires_grad_()
        run = xla_wrap.scan_layers if scanned else _loop
        loss = run(layers, x, torch.tensor(0.7), shift=0.5).pow(2).sum()
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        derivatives.append(torch.autograd.grad(grad_x.pow(2).sum(), x)[0])
    assert torch.equal(derivatives[1], derivatives[0])


@pytest.mark.xla
def test_xla_fsdp_v1_units_are_refused(xla_device: torch.device) -> None:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    layers = nn.ModuleList(FSDP(nn.Linear(4, 4).to(xla_device)) for _ in range(2))
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"XLA FSDP \(v1\) unit.*FSDPv2"):
        xla_wrap.scan_layers(layers, torch.randn(2, 4, device=xla_device))


# --- SPMD FSDPv2 ------------------------------------------------------------------------------

FSDPV2_WORKER = WORKERS / "scan_fsdpv2.py"
# Each scanned composition, and FSDPv2 alone on the same model.
SCANNED_UNDER_FSDPV2 = {
    "fsdpv2 units, scanned": "fsdpv2",
    "fsdpv2 root, scanned": "fsdpv2",
    "fsdpv2 units, scanned stacked": "fsdpv2",
    "fsdpv2 root, scanned stacked": "fsdpv2",
    "transformer, fsdpv2 units, scanned": "transformer, fsdpv2",
}


@pytest.fixture(scope="module")
def spmd_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("torch_xla")
    out = tmp_path_factory.mktemp("scan_spmd") / "results.json"
    results = run_worker(FSDPV2_WORKER, out)
    for name, result in results.items():
        assert "error" not in result, f"{name}: {result['error']}"
    return results


@pytest.mark.xla
@pytest.mark.parametrize("name", SCANNED_UNDER_FSDPV2)
def test_under_fsdpv2_a_scanned_stack_gives_fsdpv2s_loss_and_gradients(
    spmd_results: dict[str, Any], name: str
) -> None:
    plain, scanned = spmd_results[SCANNED_UNDER_FSDPV2[name]], spmd_results[name]
    assert scanned["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert scanned["grads"].keys() == plain["grads"].keys()
    for param, grad in plain["grads"].items():
        expected = torch.tensor(grad)
        torch.testing.assert_close(
            torch.tensor(scanned["grads"][param]),
            expected,
            rtol=1e-5,
            atol=1e-5 * float(expected.abs().max()),
            msg=param,
        )


@pytest.mark.xla
@pytest.mark.parametrize("name", SCANNED_UNDER_FSDPV2)
def test_under_fsdpv2_the_scanned_layers_parameters_stay_sharded(
    spmd_results: dict[str, Any], name: str
) -> None:
    sharded = spmd_results[name]["sharded"]
    weights = [p for p in sharded if p.startswith("blocks.") and p.endswith("weight")]
    assert weights and all(sharded[p] for p in weights)


@pytest.mark.xla
@pytest.mark.parametrize("name", SCANNED_UNDER_FSDPV2)
def test_under_fsdpv2_the_scan_recomputes_at_most_one_forward_per_device(
    spmd_results: dict[str, Any], name: str
) -> None:
    """Both loops keep the batch split over the devices: a backward loop partitioned another
    way (the hidden dimension split, every device computing the whole batch) costs more than
    the one extra forward a checkpoint may (1.66x on the benchmark's transformer)."""
    plain = spmd_results[SCANNED_UNDER_FSDPV2[name]]
    assert spmd_results[name]["flops"] <= 4 / 3 * plain["flops"]


@pytest.mark.xla
def test_boolean_masks_reach_the_layers_as_booleans(xla_device: torch.device) -> None:
    """torch_xla multiplies every loop input by 1 before tracing, which makes a boolean an
    integer; attention masks must still arrive as booleans (Falcon's sdpa refuses others)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.register_buffer("keep", torch.rand(WIDTH) > 0.5, persistent=False)

        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            assert mask.dtype == torch.bool and self.keep.dtype == torch.bool
            return self.lin(x).masked_fill(mask, 0.0) * self.keep + x

    torch.manual_seed(0)
    layers = nn.ModuleList(Masked() for _ in range(3))
    mask = torch.rand(2, WIDTH) > 0.5
    x = torch.randn(2, WIDTH)
    expected = _loop(layers, x, mask=mask)
    stack = copy.deepcopy(layers).to(xla_device)
    got = xla_wrap.scan_layers(stack, x.to(xla_device).requires_grad_(), mask=mask.to(xla_device))
    got.sum().backward()
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)


class _FourierMix(nn.Module):
    """FNet's token mixing: an FFT, which torch_xla runs on its CPU fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(torch.fft.fft(x, dim=-1).real)


@pytest.mark.xla
@pytest.mark.parametrize(
    ("make", "op"),
    [
        (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), "_weight_norm_interface"),
        (_FourierMix, "_fft_r2c"),
    ],
    ids=["weight_norm", "fft"],
)
def test_a_layer_that_runs_an_op_on_the_cpu_fallback_is_refused_and_runs_once_unscanned(
    xla_device: torch.device, make: Callable[[], nn.Module], op: str
) -> None:
    """The scanned body cannot run torch_xla's CPU fallback (the process died): the stack is
    refused before it runs, naming the op and the layer and pointing at `unscan`; unscanned,
    the same layers train and give the plain loop's gradients."""
    torch.manual_seed(0)
    made = [make() for _ in range(2)]
    plain = copy.deepcopy(nn.ModuleList(made)).to(xla_device)
    layers = xla_wrap.ScannedLayers(made).to(xla_device)
    x = torch.randn(2, 8, device=xla_device)
    with pytest.raises(
        xla_wrap.CheckpointError, match=rf"\({type(made[0]).__name__}\).*{op}.*unscan"
    ):
        h = x
        for layer in layers:
            h = layer(h)
    xla_wrap.unscan(layers)
    for model in (layers, plain):
        h = x
        for layer in model:
            h = layer(h)
        h.square().sum().backward()
    torch_xla = pytest.importorskip("torch_xla")
    torch_xla.sync()
    for (name, a), b in zip(layers.named_parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad.cpu(), b.grad.cpu()), name
