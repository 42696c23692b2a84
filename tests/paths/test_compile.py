"""Checkpointing inside ``torch.compile`` (xla_wrap/_paths/compiled/): every entry point compiles as
one graph, reaches AOTAutograd as the checkpoint higher-order op (the partitioned forward
saves what PyTorch's own checkpoint saves, the backward recomputes tagged nodes), and save
policies become selective checkpointing, measured in the partitioned graphs."""

from __future__ import annotations

import copy
import functools
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import internal, introspect

from models import Scores, tiny_gpt2

WIDTH = 32


class Block(nn.Module):
    """A pre-norm transformer block; its MLP's hidden value is tagged ``"hidden"``."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.drop(self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        hidden = xla_wrap.checkpoint_name(F.gelu(self.up(self.norm2(x))), "hidden")
        return x + self.drop(self.down(hidden))


class Stack(nn.Module):
    def __init__(self, blocks: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


BATCH, SEQ = 2, 8


def _x() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles afresh (Dynamo would otherwise reuse or stop recompiling) and
    counts its own graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


def _step(model: nn.Module, backend: str | None, seed: int = 5) -> tuple[torch.Tensor, list]:
    """Loss and gradients of one step (compiled whole with ``backend``, or eager)."""
    model.zero_grad(set_to_none=True)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    torch.manual_seed(seed)
    loss = run(_x()).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _assert_same_step(
    expected: tuple[torch.Tensor, list], got: tuple[torch.Tensor, list], *, exact: bool
) -> None:
    (expected_loss, expected_grads), (loss, grads) = expected, got
    assert len(grads) == len(expected_grads) and all(g is not None for g in grads)
    for a, b in zip([loss, *grads], [expected_loss, *expected_grads], strict=True):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- every entry point compiles, whole ----------------------------------------------------------


def _wrapped(how: str, dropout: float) -> tuple[nn.Module, nn.Module]:
    """The plain stack and a copy checkpointed ``how``."""
    torch.manual_seed(0)
    plain = Stack(dropout=dropout)
    twin = copy.deepcopy(plain)
    is_block = functools.partial(lambda m: isinstance(m, Block))
    if how == "checkpoint_wrapper":
        for i, block in enumerate(twin.blocks):
            twin.blocks[i] = xla_wrap.checkpoint_wrapper(block)
    elif how in ("apply_activation_checkpointing", "use_reentrant=True"):
        xla_wrap.apply_activation_checkpointing(
            twin, is_block, use_reentrant=how != "apply_activation_checkpointing"
        )
    elif how == "functional checkpoint":
        twin.forward = functools.partial(_functional_forward, twin)  # type: ignore[method-assign]
    elif how == "checkpoint_sequential":
        twin.forward = functools.partial(_sequential_forward, twin)  # type: ignore[method-assign]
    else:
        policy = {
            "dots_saveable": "dots_saveable",
            "save_only_these_names": cp.save_only_these_names("hidden"),
            "save_from_both_policies": cp.save_from_both_policies(
                cp.dots_saveable, cp.save_only_these_names("hidden")
            ),
        }[how]
        xla_wrap.apply_activation_checkpointing(twin, is_block, policy=policy)
    return plain, twin


def _functional_forward(stack: Stack, x: torch.Tensor) -> torch.Tensor:
    """``checkpoint`` of a function with keyword and non-tensor arguments and a policy made
    inside the compiled code."""

    def run(
        block: Block, x: torch.Tensor, *, scale: float, shift: torch.Tensor | None, debug: bool
    ) -> Any:
        return block(x) * scale + (0 if shift is None else shift)

    for block in stack.blocks:
        x = xla_wrap.checkpoint(  # `debug` is the function's: bound, as torch's checkpoint has one
            functools.partial(run, debug=False),
            block,
            x,
            scale=1.0,
            shift=None,
            policy=cp.save_only_these_names("hidden"),
        )
    return x


def _sequential_forward(stack: Stack, x: torch.Tensor) -> torch.Tensor:
    return xla_wrap.checkpoint_sequential(list(stack.blocks), 2, x)


ENTRY_POINTS = [
    "checkpoint_wrapper",
    "apply_activation_checkpointing",
    "use_reentrant=True",
    "functional checkpoint",
    "checkpoint_sequential",
    "dots_saveable",
    "save_only_these_names",
    "save_from_both_policies",
]


@pytest.mark.parametrize("how", ENTRY_POINTS)
def test_every_entry_point_compiles_whole_and_trains_as_eager(how: str) -> None:
    """``fullgraph=True`` (no graph break) on aot_eager; with Dropout 0.1 the compiled
    checkpointed step is the eager plain step bitwise (aot_eager draws as eager does), so the
    recomputation used the forward's masks."""
    plain, twin = _wrapped(how, dropout=0.1)
    expected = _step(plain, None)
    got = _step(twin, "aot_eager")
    assert _graph_breaks() == {}
    _assert_same_step(expected, got, exact=True)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan"])
def test_the_transformers_drop_in_compiles_whole_and_trains_as_eager(scan: bool) -> None:
    pytest.importorskip("transformers")
    xla_hf = pytest.importorskip("xla_wrap.integrations.transformers")
    torch.manual_seed(0)
    plain = tiny_gpt2(layers=2, width=WIDTH, use_cache=False).train()  # Dropout 0.1
    twin = copy.deepcopy(plain)
    xla_hf.gradient_checkpointing_enable(twin, policy="dots_saveable", scan=scan)
    ids = torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(0))

    def step(model: nn.Module, compiled: bool) -> tuple[torch.Tensor, list]:
        model.zero_grad(set_to_none=True)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        torch.manual_seed(5)
        # transformers' own loss function warns once, which Dynamo cannot trace
        loss = F.cross_entropy(run(ids).logits.flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    expected = step(plain, False)
    got = step(twin, True)
    assert _graph_breaks() == {}
    _assert_same_step(expected, got, exact=True)


def test_under_inductor_the_recomputation_uses_the_forwards_masks() -> None:
    """Inductor with its random numbers drawn as eager draws them (``fallback_random``): the
    checkpointed step with Dropout equals the eager plain step."""
    import torch._inductor.config as inductor_config

    plain, twin = _wrapped("dots_saveable", dropout=0.1)
    expected = _step(plain, None)
    with inductor_config.patch(fallback_random=True):
        got = _step(twin, "inductor")
    assert _graph_breaks() == {}
    _assert_same_step(expected, got, exact=False)


# --- what the compiler sees ---------------------------------------------------------------------


MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


def _graphs(model: nn.Module) -> introspect.PartitionedGraphs:
    graphs = introspect.PartitionedGraphs()
    _step(model, graphs.backend)
    assert _graph_breaks() == {}
    return graphs


@pytest.fixture(scope="module")
def compiled_graphs() -> dict[str, introspect.PartitionedGraphs]:
    """The stack's partitioned graphs: plain, PyTorch's checkpoint_wrapper, and xla_wrap with
    each policy (Dropout 0)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as torch_apply,
    )

    torch.manual_seed(0)
    plain = Stack()
    graphs = {"plain": _graphs(plain)}
    torch_wrapped = copy.deepcopy(plain)
    torch_apply(torch_wrapped, check_fn=lambda m: isinstance(m, Block))
    graphs["torch"] = _graphs(torch_wrapped)
    for name, policy in [
        ("xla_wrap", None),
        ("dots_saveable", "dots_saveable"),
        ("names", cp.save_only_these_names("hidden")),
    ]:
        torch._dynamo.reset()
        twin = copy.deepcopy(plain)
        xla_wrap.apply_activation_checkpointing(twin, lambda m: isinstance(m, Block), policy=policy)
        graphs[name] = _graphs(twin)
    return graphs


def test_the_compiler_sees_a_checkpoint_and_recomputes_the_blocks(
    compiled_graphs: dict[str, introspect.PartitionedGraphs],
) -> None:
    plain, torch_wrapped, ours = (compiled_graphs[k] for k in ("plain", "torch", "xla_wrap"))
    assert ours.saved_bytes() <= torch_wrapped.saved_bytes() < plain.saved_bytes()
    # The blocks' forward matmuls run again in backward (those whose outputs backward needs;
    # which ones, the partitioner decides, as for PyTorch's own checkpoint), tagged for the
    # barriers TorchTPU's backend places.
    recomputed = ours.backward_ops(*MATMULS) - plain.backward_ops(*MATMULS)
    assert recomputed >= 2 * len(Stack().blocks)
    assert ours.backward_ops(*MATMULS) == torch_wrapped.backward_ops(*MATMULS)
    assert ours.recompute_tags() > 0 and plain.recompute_tags() == 0


def test_dots_saveable_recomputes_no_matmul_under_compile(
    compiled_graphs: dict[str, introspect.PartitionedGraphs],
) -> None:
    plain, dots = compiled_graphs["plain"], compiled_graphs["dots_saveable"]
    assert dots.backward_ops(*MATMULS) == plain.backward_ops(*MATMULS)
    assert dots.saved_bytes() < plain.saved_bytes()
    assert dots.recompute_tags() > 0  # the elementwise work around the matmuls still is


def test_a_names_policy_keeps_exactly_the_named_values_under_compile(
    compiled_graphs: dict[str, introspect.PartitionedGraphs],
) -> None:
    full, names = compiled_graphs["xla_wrap"], compiled_graphs["names"]
    hidden = BATCH * SEQ * 4 * WIDTH * 4  # one float32 [batch, seq, 4 * width] per block
    assert names.saved_bytes() == full.saved_bytes() + len(Stack().blocks) * hidden


def _backward_ops(
    plain: nn.Module, x: torch.Tensor, policies: tuple[Any, ...], *packets: Any
) -> dict[Any, int]:
    """Per policy, how many calls of ``packets`` the backward of ``checkpoint(plain, x)``
    makes, compiled."""
    counts = {}
    for policy in policies:
        torch._dynamo.reset()
        graphs = introspect.PartitionedGraphs()
        model = copy.deepcopy(plain)
        run = torch.compile(
            lambda x, m=model, p=policy: xla_wrap.checkpoint(m, x, policy=p),
            backend=graphs.backend,
            fullgraph=True,
        )
        run(x).sum().backward()
        counts[policy] = graphs.backward_ops(*packets)
    return counts


def test_dots_with_no_batch_dims_keep_the_projections_and_recompute_the_scores() -> None:
    torch.manual_seed(0)
    plain, x = Scores(WIDTH), _x()
    policies = (None, "dots_saveable", "dots_with_no_batch_dims_saveable")
    mms = _backward_ops(plain, x, policies, torch.ops.aten.mm, torch.ops.aten.addmm)
    bmms = _backward_ops(plain, x, policies, torch.ops.aten.bmm)
    counts = {p: (mms[p], bmms[p]) for p in policies}
    (mm_full, bmm_full), (mm_dots, bmm_dots), (mm_nb, bmm_nb) = counts.values()
    assert mm_nb == mm_dots < mm_full  # projections kept, as by dots_saveable
    assert bmm_nb == bmm_full > bmm_dots  # the scores recomputed, as without a policy


def test_save_any_names_but_these_keeps_every_other_tagged_value(
    compiled_graphs: dict[str, introspect.PartitionedGraphs],
) -> None:
    torch.manual_seed(0)
    plain = Stack()
    saved = {}
    for excluded in ((), ("hidden",)):
        torch._dynamo.reset()
        twin = copy.deepcopy(plain)
        policy = cp.save_any_names_but_these(*excluded)
        xla_wrap.apply_activation_checkpointing(twin, lambda m: isinstance(m, Block), policy=policy)
        saved[excluded] = _graphs(twin).saved_bytes()
    assert saved[()] == compiled_graphs["names"].saved_bytes()  # the only tag: "hidden"
    assert saved[("hidden",)] == compiled_graphs["xla_wrap"].saved_bytes()


def test_offload_policies_offload_where_torch_can_and_keep_the_values_elsewhere() -> None:
    """With CheckpointPolicy.MUST_CPU_OFFLOAD (newer torch) the offloaded values are the
    compiler's to place; without it (torch 2.9) a warning says they stay on the device. The
    gradients are the eager ones either way."""
    layer = nn.Linear(WIDTH, WIDTH)

    def step(x: torch.Tensor) -> torch.Tensor:
        policy = cp.offload_dot_with_no_batch_dims()
        return xla_wrap.checkpoint(lambda t: torch.tanh(layer(t)), x, policy=policy).sum()

    x = _x().requires_grad_()
    expected = torch.autograd.grad(torch.tanh(layer(x)).sum(), x)[0]
    from xla_wrap import internal

    internal.forget_warnings()  # each warns once per process: this test's to see
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(step, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, expected)
    kept = [w for w in caught if "MUST_CPU_OFFLOAD" in str(w.message)]
    offloads = hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD")
    assert (not kept) if offloads else (torch.__version__ in str(kept[0].message))


def test_dots_saveable_keeps_convolutions_as_aten_names_them() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 3, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    counts = _backward_ops(plain, x, (None, "dots_saveable"), torch.ops.aten.convolution)
    # Full recomputation runs the first convolution again (the GELU's backward needs its
    # output; nothing needs the second's); dots_saveable keeps it.
    assert counts[None] == 1 and counts["dots_saveable"] == 0


# --- scanned stacks ----------------------------------------------------------------------------


class Scanned(nn.Module):
    """The stack's loop, through ``scan_layers`` or over a scanned list."""

    def __init__(
        self, blocks: nn.ModuleList, *, call: bool, policy: str | None = "dots_saveable"
    ) -> None:
        super().__init__()
        self.blocks = blocks
        self.call = call
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.call:
            return xla_wrap.scan_layers(self.blocks, x, policy=self.policy)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("how", ["scan_layers", "ScannedLayers", "apply_scan"])
def test_scanned_stacks_compile_whole_as_the_checkpointed_loop(how: str) -> None:
    """Inside torch.compile a scanned stack runs as the checkpointed loop (the compiler's
    checkpoint per layer): no graph break, the eager plain model's step with Dropout."""
    plain, _ = _wrapped("checkpoint_wrapper", dropout=0.1)
    blocks = copy.deepcopy(plain.blocks)
    if how == "scan_layers":
        twin: nn.Module = Scanned(blocks, call=True)
    elif how == "ScannedLayers":
        twin = Scanned(xla_wrap.ScannedLayers(blocks), call=False)
    else:
        twin = xla_wrap.apply_scan(Scanned(blocks, call=False))
        assert isinstance(twin.blocks, xla_wrap.ScannedLayers)
    expected = _step(plain, None)
    graphs = introspect.PartitionedGraphs()
    got = _step(twin, graphs.backend)
    assert _graph_breaks() == {}
    _assert_same_step(expected, got, exact=True)
    assert graphs.recompute_tags() > 0  # checkpointed, layer by layer


def _dynamo_graph(model: nn.Module) -> fx.GraphModule:
    """The graph Dynamo captures of one compiled step of ``model``."""
    graphs: list[fx.GraphModule] = []

    @internal.runs_regions_as_they_are
    def capture(graph: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(graph)
        return torch._dynamo.backends.debugging.aot_eager(graph, example_inputs)

    x = _x().requires_grad_()  # as an embedding's output: then the first layer is alike too
    torch.compile(model, backend=capture, fullgraph=True)(x).sum().backward()
    assert len(graphs) == 1
    return graphs[0]


def _layer_regions(graph: fx.GraphModule) -> list[str]:
    """The subgraph each nested compile region of ``graph`` calls, in order."""
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return [str(n.args[0].target) for n in calls]


@pytest.mark.skipif(not internal.has_layer_regions(), reason="no nested compile regions")
@pytest.mark.parametrize(
    ("how", "policy"),
    [("scan_layers", None), ("ScannedLayers", None), ("scan_layers", "dots_saveable")],
)
def test_a_scanned_stack_compiles_one_layer_and_calls_it_for_each(
    how: str, policy: str | None
) -> None:
    """Each layer is the same nested compile region: one subgraph, called once per layer, so
    the compiler lowers one layer whatever the depth, and it saves what the checkpointed loop
    saves. A plain checkpointed loop (the user did not say the layers are alike) stays a
    loop. torch 2.9 drops a save policy inside a region, so there a policy keeps the loop."""
    plain, looped = _wrapped("checkpoint_wrapper", dropout=0.1)
    blocks = copy.deepcopy(plain.blocks)
    if how == "scan_layers":
        twin: nn.Module = Scanned(blocks, call=True, policy=policy)
    else:
        twin = Scanned(xla_wrap.ScannedLayers(blocks), call=False)
    found = _layer_regions(_dynamo_graph(twin))
    if policy is not None and not internal.POLICIES_IN_LAYER_REGIONS:
        assert found == []
    else:
        assert len(found) == len(blocks) and len(set(found)) == 1
    torch._dynamo.reset()
    assert _layer_regions(_dynamo_graph(looped)) == []


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_a_scanned_stack_saves_what_the_checkpointed_loop_saves(policy: str | None) -> None:
    """Measured in the partitioned graphs (whose backend runs regions): the regions keep the
    checkpoint (and its policy) of every layer."""
    plain, _ = _wrapped("checkpoint_wrapper", dropout=0.1)
    looped = copy.deepcopy(plain)
    xla_wrap.apply_activation_checkpointing(looped, lambda m: isinstance(m, Block), policy=policy)
    scanned = Scanned(copy.deepcopy(plain.blocks), call=True, policy=policy)
    saved = {}
    for name, model in [("plain", plain), ("loop", looped), ("scan", scanned)]:
        torch._dynamo.reset()
        graphs = introspect.PartitionedGraphs()
        _step(model, graphs.backend)
        saved[name] = graphs.saved_bytes()
    assert abs(saved["scan"] - saved["loop"]) <= 0.05 * saved["loop"]
    assert saved["loop"] < saved["plain"]


@pytest.mark.parametrize(
    ("backend", "one_region"), [("aot_eager", True), ("inductor", False), ("eager", False)]
)
def test_a_scanned_stack_is_one_region_only_where_the_backend_runs_it_correctly(
    backend: str, one_region: bool
) -> None:
    """Inductor miscompiles a region called more than once (wrong gradients, torch 2.9 and
    2.14.1), and torch 2.9's eager backend cannot run one backward: there the loop."""
    assert internal.compiles_layers_once(backend) is (one_region and internal.has_layer_regions())


@pytest.mark.skipif(not internal.has_layer_regions(), reason="no nested compile regions")
def test_inductor_still_miscompiles_a_region_called_twice() -> None:
    """Why a scanned stack is the loop under inductor: two calls of one region and a matrix
    product after them give a wrong gradient (the caller reuses the buffer the region
    returned as saved for backward). When this goes red, the installed torch has fixed it:
    let xla_wrap make regions under inductor (xla_wrap/_paths/compiled/regions.py)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    def f(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (block(block(x, w0), w1) @ h).sum()

    generator = torch.Generator().manual_seed(0)
    shapes = [(4, 4), (4,), (4,), (4, 4)]
    args = [torch.randn(s, generator=generator, requires_grad=True) for s in shapes]
    expected = torch.autograd.grad(f(*args), args)
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        got = torch.autograd.grad(torch.compile(f, fullgraph=True)(*args), args)
    assert not all(torch.allclose(a, b) for a, b in zip(got, expected, strict=True))


def test_a_scan_without_a_carry_inside_compile_is_refused_as_outside() -> None:
    blocks = nn.ModuleList(Block() for _ in range(2))
    with pytest.raises(xla_wrap.CheckpointTypeError, match="expected the carry"):
        torch.compile(lambda: xla_wrap.scan_layers(blocks), backend="aot_eager")()


def test_stacked_parameters_inside_compile_run_eager_or_are_refused_under_fullgraph() -> None:
    """Dynamo cannot trace a layer on its slices of the stacked parameters: the stack is then
    a graph break and runs eagerly (the step is the eager one, with Dropout); under
    ``fullgraph=True`` the refusal names the way out."""
    plain, _ = _wrapped("checkpoint_wrapper", dropout=0.1)
    twin = Scanned(
        xla_wrap.ScannedLayers(copy.deepcopy(plain.blocks), stack_parameters=True), call=False
    )
    expected = _step(plain, None)
    model = copy.deepcopy(twin)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = torch.compile(model, backend="aot_eager")(_x()).pow(2).mean()
    loss.backward()
    assert torch.equal(loss.detach(), expected[0])
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(twin, backend="aot_eager", fullgraph=True)(_x())
    chain, error = [], info.value
    while error is not None:
        chain.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    assert any("CheckpointValueError" in e for e in chain)


# --- a graph break costs one block --------------------------------------------------------------


class Breaking(Block):
    """A block Dynamo cannot trace whole: a graph break in its forward (as a print or a
    data-dependent branch would make)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        torch._dynamo.graph_break()
        return x * 2


class Unrolled(nn.Module):
    """Work before, between and after the blocks, the second and fourth of which break."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block(0.1), Breaking(0.1), Block(0.1), Breaking(0.1)])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b0, b1, b2, b3 = self.blocks
        h0 = b0(self.inp(x))
        h1 = b1(h0)
        h2 = b2(h1)
        h3 = b3(h2)
        self.block_outputs = [h0, h1, h2, h3]
        return self.head(h3)


def _compiled_ops(model: nn.Module, **compile_kwargs: Any) -> list[list[str]]:
    """One step of ``model`` compiled on ``aot_eager``: the operations of each graph Dynamo
    compiled."""
    graphs: list[list[str]] = []

    def capture(graph: fx.GraphModule, example_inputs: Any) -> Any:
        ops = [n for n in graph.graph.nodes if n.op in ("call_function", "call_module")]
        graphs.append([getattr(n.target, "__name__", str(n.target)) for n in ops])
        return torch._dynamo.backends.debugging.aot_eager(graph, example_inputs)

    run = torch.compile(model, backend=capture, **compile_kwargs)
    torch.manual_seed(5)
    run(_x()).pow(2).mean().backward()
    return graphs


def test_a_graph_break_in_a_block_costs_that_block_only() -> None:
    """The blocks Dynamo cannot trace run under xla_wrap's own engine (their outputs come
    from its gate, so they recompute behind a barrier and save memory), all around them still
    compiles (the input layer, the traceable blocks as the compiler's checkpoint, the head),
    and the step is the eager unwrapped model's, bitwise, with Dropout."""
    torch.manual_seed(0)
    plain = Unrolled()
    twin = copy.deepcopy(plain)
    xla_wrap.apply_activation_checkpointing(twin, lambda m: isinstance(m, Block))
    torch.manual_seed(5)
    plain(_x()).pow(2).mean().backward()
    graphs = _compiled_ops(twin)
    ran_by_engine = [internal.record_of(h) is not None for h in twin.block_outputs]
    assert ran_by_engine == [False, True, False, True]
    checkpoints = [g.count("tag_activation_checkpoint") for g in graphs]
    assert sum(checkpoints) == 2 and any("linear" in g for g in graphs[-1:])  # the head
    assert any(g[0] == "linear" and "tag_activation_checkpoint" in g for g in graphs)  # inp, b0
    for a, b in zip(plain.parameters(), twin.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)


def test_a_graph_break_in_a_block_under_fullgraph_names_the_block_and_the_break() -> None:
    block = xla_wrap.checkpoint_wrapper(Breaking())
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(block, backend="aot_eager", fullgraph=True)(_x())
    message = str(info.value)
    assert "graph_break()" in message and "_paths/compiled/checkpoint.py" in message
    assert f'{__file__}", line' in message and "in forward" in message  # the block's forward


# --- refusals -----------------------------------------------------------------------------------


def test_offload_inside_compile_runs_the_block_eagerly_or_is_refused_under_fullgraph() -> None:
    """The compiler decides where saved values live, so a block that offloads is a graph
    break and runs under xla_wrap's engine (which offloads, with the eager gradients); under
    ``fullgraph=True`` the refusal reaches the caller as xla_wrap's own error, naming the way
    out."""
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        return xla_wrap.checkpoint(layer, x, offload_to_cpu=True).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on the CPU the offloaded values stay where they are
        torch.compile(step, backend="aot_eager")(x).backward()
    compiled_grad = layer.weight.grad
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    assert compiled_grad is not None and torch.equal(compiled_grad, layer.weight.grad)
    torch._dynamo.reset()
    # fullgraph: xla_wrap's class and message, not Dynamo's "Observed exception"
    with pytest.raises(xla_wrap.CheckpointValueError) as info:
        torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    assert str(info.value).startswith("xla_wrap.checkpoint: offload_to_cpu=True is not supported")
    assert "Drop offload_to_cpu" in str(info.value)
    assert type(info.value).__name__ == "CheckpointValueError"


# --- torch_xla's Dynamo backend -----------------------------------------------------------------


@torch.library.custom_op("xla_wrap_tests::barrier", mutates_args=())
def _stand_in_barrier(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A barrier operation as TorchTPU registers its own: a list of tensors in, the same
    values out (copies: a custom operation may not return its inputs)."""
    return [t.clone() for t in tensors]


@_stand_in_barrier.register_fake
def _(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


_BARRIER = torch.ops.xla_wrap_tests.barrier.default


def _recording_backend(
    passes: Callable[[fx.GraphModule], Any] | None = None,
) -> tuple[Any, list[fx.GraphModule], list[fx.GraphModule]]:
    """An AOTAutograd backend on eager CPU that keeps its forward and backward graphs (after
    `passes`, run on the backward), as a compiler of one's own would see them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    forwards: list[fx.GraphModule] = []
    backwards: list[fx.GraphModule] = []

    def forward(graph_module: fx.GraphModule, inputs: Any) -> Any:
        forwards.append(graph_module)
        return make_boxed_func(graph_module.forward)

    def backward(graph_module: fx.GraphModule, inputs: Any) -> Any:
        if passes is not None:
            passes(graph_module)
        backwards.append(graph_module)
        return make_boxed_func(graph_module.forward)

    return aot_autograd(fw_compiler=forward, bw_compiler=backward), forwards, backwards


def _barriered_graphs(model: nn.Module) -> tuple[list[int], fx.GraphModule]:
    """The step on an eager backend with region barriers placed in its backward graph: how
    many per backward graph, and the last backward graph."""
    placed: list[int] = []
    backend, _, backwards = _recording_backend(
        lambda gm: placed.append(xla_wrap.region_barriers(gm, _BARRIER))
    )
    expected = _step(copy.deepcopy(model), None)
    got = _step(model, backend)
    _assert_same_step(expected, got, exact=True)
    return placed, backwards[-1]


def _from_tangents(graph: fx.GraphModule) -> set[fx.Node]:
    found: set[fx.Node] = set()
    for node in graph.graph.nodes:
        if node.name.startswith("tangents") or set(node.all_input_nodes) & found:
            found.add(node)
    return found


def test_each_recomputed_block_waits_behind_a_barrier_for_its_gradient() -> None:
    """The backward graph's pass, on eager CPU (both torch versions): one barrier per
    checkpointed block; it takes a value computed from the incoming gradient, every value the
    recomputation reads from outside comes through it, and the step is unchanged."""
    _, twin = _wrapped("apply_activation_checkpointing", dropout=0.1)
    placed, graph = _barriered_graphs(twin)
    blocks = len(Stack().blocks)
    assert placed == [blocks]
    from_tangents = _from_tangents(graph)
    barriers = [n for n in graph.graph.nodes if n.target is _BARRIER]
    assert len(barriers) == blocks
    assert all(set(b.args[0]) & (from_tangents - {b}) for b in barriers)
    # every output is read (a compiler drops unread ones), the gradient's by the backward
    assert all(len(b.users) == len(b.args[0]) for b in barriers)
    assert all(output.users for b in barriers for output in b.users)
    recomputed = [n for n in graph.graph.nodes if n.meta.get("recompute") is not None]
    assert recomputed and not any(
        i.op == "placeholder" for n in recomputed for i in n.all_input_nodes
    )


def test_with_region_barriers_wraps_a_registered_backend_by_name_and_runs_on_backward_only() -> (
    None
):
    """What a TorchTPU user would do, with stand-ins: a barrier operation registered by name
    and an AOTAutograd backend registered by name. The pass runs on the backward graph only,
    with the given operation, once per checkpointed block; gradients are the eager ones."""
    backend, forwards, backwards = _recording_backend()
    name = "xla_wrap_tests_stand_in"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(backend, name=name)
    plain, twin = _wrapped("checkpoint_wrapper", dropout=0.1)
    wrapped_backend = xla_wrap.with_region_barriers(name, barrier=_BARRIER)
    forwards.clear()
    backwards.clear()
    _assert_same_step(_step(plain, None), _step(twin, wrapped_backend), exact=True)
    assert len(forwards) == len(backwards) == 1
    targets = [[n.target for n in g.graph.nodes] for g in (forwards[0], backwards[0])]
    assert _BARRIER not in targets[0]
    assert targets[1].count(_BARRIER) == len(Stack().blocks)


def test_with_region_barriers_refuses_what_it_cannot_wrap() -> None:
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"registered.*'no such backend'"):
        xla_wrap.with_region_barriers("no such backend", barrier=_BARRIER)
    with pytest.raises(xla_wrap.CheckpointTypeError, match=r"AOTAutograd backend.*inductor"):
        xla_wrap.with_region_barriers("inductor", barrier=_BARRIER)
    backend, _, _ = _recording_backend()
    with pytest.raises(xla_wrap.CheckpointTypeError, match=r"barrier.*got int"):
        xla_wrap.with_region_barriers(backend, barrier=3)
    with pytest.raises(xla_wrap.CheckpointTypeError, match=r"GraphModule.*got str"):
        xla_wrap.region_barriers("graph", _BARRIER)


@pytest.mark.parametrize("order", ["leaves only", "regions first", "leaves first"])
def test_leaf_barriers_order_nothing_after_the_gradient_and_region_barriers_do(order: str) -> None:
    """TorchTPU's placement (a barrier after each recomputed leaf) alone: no barrier depends on
    the incoming gradient, so nothing makes the recomputation wait for it. With the region pass
    before it (a backend's own pass runs after the one handed to its backward compiler) or
    after it, every region gets its barrier, which takes a value computed from the gradient."""
    from xla_wrap.internal import leaf_barriers

    def passes(gm: fx.GraphModule) -> None:
        if order == "leaves only":
            placed.append((0, leaf_barriers(gm, _BARRIER)))
        elif order == "leaves first":
            leaves = leaf_barriers(gm, _BARRIER)
            placed.append((xla_wrap.region_barriers(gm, _BARRIER), leaves))
        else:
            regions = xla_wrap.region_barriers(gm, _BARRIER)
            placed.append((regions, leaf_barriers(gm, _BARRIER)))

    placed: list[tuple[int, int]] = []
    backend, _, backwards = _recording_backend(passes)
    plain, twin = _wrapped("checkpoint_wrapper", dropout=0.1)
    _assert_same_step(_step(plain, None), _step(twin, backend), exact=True)
    (regions, leaves), graph = placed[0], backwards[0]
    blocks = len(Stack().blocks)
    assert regions == (0 if order == "leaves only" else blocks) and leaves > blocks
    from_tangents = _from_tangents(graph)
    barriers = [n for n in graph.graph.nodes if n.target is _BARRIER]
    # a barrier that takes a gradient itself (an untagged value computed from one)
    waiting = [
        b
        for b in barriers
        if any(i in from_tangents and i.meta.get("recompute") is None for i in b.args[0])
    ]
    assert len(barriers) == regions + leaves and len(waiting) == regions
    if order == "leaves only":
        assert not set(barriers) & from_tangents  # none waits for the gradient at all


def test_a_graph_without_checkpoints_gets_no_barrier() -> None:
    placed, _ = _barriered_graphs(Stack())
    assert placed == [0]


@pytest.mark.xla
def test_openxla_compiles_it_whole_with_eager_gradients(xla_device: torch.device) -> None:
    import torch_xla

    plain, twin = _wrapped("apply_activation_checkpointing", dropout=0.0)
    expected = _step(plain, None)
    twin.to(xla_device)
    twin.zero_grad(set_to_none=True)
    loss = torch.compile(twin, backend="openxla", fullgraph=True)(_x().to(xla_device))
    loss = loss.pow(2).mean()
    loss.backward()
    grads = [p.grad for p in twin.parameters()]
    torch_xla.sync()
    assert _graph_breaks() == {}
    _assert_same_step(expected, (loss.cpu(), [g.cpu() for g in grads]), exact=False)


def _openxla_step(model: nn.Module, backend: Any, x: torch.Tensor) -> introspect.CompiledProgram:
    """The largest program of one compiled step on XLA:CPU (the backward one)."""
    import torch_xla

    torch._dynamo.reset()
    run = torch.compile(model, backend=backend, fullgraph=True)

    def step() -> None:
        run(x).pow(2).mean().backward()
        torch_xla.sync()

    return introspect.compiled_memory(step)


@pytest.mark.xla
def test_the_openxla_backend_with_barriers_saves_memory(xla_device: torch.device) -> None:
    """XLA's buffer assignment, barriers kept: torch_xla's plain ``openxla`` recomputes every
    block at the start of the backward program and peaks as the uncheckpointed step;
    ``xla_wrap.openxla_backend`` orders each block's recomputation behind its gradient. Its
    gradients are the eager plain model's."""
    import torch_xla

    torch.manual_seed(0)
    plain = Stack(blocks=4)
    twin = copy.deepcopy(plain)
    xla_wrap.apply_activation_checkpointing(twin, lambda m: isinstance(m, Block))
    x = torch.randn(4, 64, WIDTH, generator=torch.Generator().manual_seed(1))
    plain(x).pow(2).mean().backward()
    expected = [p.grad for p in plain.parameters()]
    plain.zero_grad(set_to_none=True)
    plain.to(xla_device)
    twin.to(xla_device)
    x = x.to(xla_device)
    uncheckpointed = _openxla_step(plain, "openxla", x)
    unordered = _openxla_step(twin, "openxla", x)
    twin.zero_grad(set_to_none=True)
    ordered = _openxla_step(twin, xla_wrap.openxla_backend, x)
    torch_xla.sync()
    for got, want in zip([p.grad.cpu() for p in twin.parameters()], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ordered.count("opt-barrier") == 4 and ordered.count("dot") > uncheckpointed.count("dot")
    assert unordered.total_bytes > 0.9 * uncheckpointed.total_bytes
    assert ordered.total_bytes < 0.6 * uncheckpointed.total_bytes
    assert not hasattr(torch, "xla")  # the stand-in lives only while the backend traces


def test_the_openxla_backend_without_torch_xla_says_what_to_install() -> None:
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed here")
    graph = fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(xla_wrap.CheckpointError, match="expected torch_xla.*inductor"):
        xla_wrap.openxla_backend(graph, [torch.randn(2)])


def test_torch_compile_knows_the_backend_by_name() -> None:
    """The entry point pyproject.toml declares (for trainers that take a backend's name)."""
    assert torch._dynamo.lookup_backend("xla_wrap_openxla") is xla_wrap.openxla_backend
