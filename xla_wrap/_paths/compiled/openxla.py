"""torch_xla's `openxla` Dynamo backend, with barriers in front of the recomputation.

Under `torch.compile` a checkpoint's recomputation lands in the backward graph, each region
(`node.meta["ac_graph_id"]`) right after the gradient that needs it, its nodes tagged
`node.meta["recompute"]`. `openxla` hands that graph to XLA as one program, and XLA may run
every region's recomputation at the program's start, where all their inputs already exist:
measured, the backward program then holds every block's activations at once and the step's
peak is the uncheckpointed one. TorchTPU's backend places optimization barriers by the tags;
this backend does the same for torch_xla 2.9. One barrier per region ties the region's inputs
(saved values, parameters) to the gradient arriving at it, and the recomputation reads the
barrier's outputs, so it cannot start before that gradient exists.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..._support.errors import CheckpointError
from .. import xla

API = "xla_wrap.openxla_backend"
_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def openxla_backend(
    graph_module: fx.GraphModule, example_inputs: Sequence[torch.Tensor]
) -> Callable[..., Any]:
    """A `torch.compile` backend: torch_xla's `openxla`, with optimization barriers.

    The barriers order each checkpoint's recomputation after the gradient that needs it.

    With plain `backend="openxla"` a checkpoint recomputes but saves no memory: XLA runs
    every recomputation at the start of the backward program. Here the step's peak is that of
    the lazy-tensor path (docs/compile.md has the figures). Also known to `torch.compile` by
    name, as `backend="xla_wrap_openxla"` (for trainers that take a string).

    Pass the function itself as `backend=`; Dynamo calls it, once per graph it captures.

    Args:
        graph_module: The FX graph Dynamo captured.
        example_inputs: Example inputs of that graph.

    Returns:
        The compiled function that Dynamo runs in place of the graph (forward and backward
        through XLA).

    Raises:
        CheckpointError: If torch_xla is not installed.

    Examples:
        >>> model = torch.compile(model, backend=xla_wrap.openxla_backend)  # doctest: +SKIP
    """
    if not xla.installed():
        raise CheckpointError(
            f"{API}: expected torch_xla (the openxla backend compiles through it), got none "
            "installed. Install torch_xla with the torch of its release (2.9.0), or compile "
            "with another backend (backend='inductor')."
        )
    from torch._dynamo.backends.common import aot_autograd

    # openxla is AOTAutograd with torch_xla's graph compiler: keep its settings and hand the
    # backward graph over with barriers placed.
    settings = dict(torch._dynamo.lookup_backend("openxla").kwargs)  # type: ignore[attr-defined]
    compile_backward = settings.get("bw_compiler") or settings["fw_compiler"]
    settings["bw_compiler"] = functools.partial(_with_barriers, compile_backward)
    with _xla_device_module():
        return aot_autograd(**settings)(graph_module, example_inputs)


@contextlib.contextmanager
def _xla_device_module() -> Iterator[None]:
    """`torch.xla` while AOTAutograd traces: selective checkpointing looks up the device
    module of its inputs' device (`getattr(torch, "xla")`, which torch_xla 2.9 does not
    register), only to read `_initialized`. Without it, a save policy fails to compile with
    `AttributeError: module 'torch' has no attribute 'xla'`."""
    if hasattr(torch, "xla"):
        yield
        return
    stand_in = types.ModuleType("torch.xla", "Stand-in while xla_wrap.openxla_backend traces.")
    setattr(torch, "xla", stand_in)  # noqa: B010 (torch declares no such attribute)
    try:
        yield
    finally:
        delattr(torch, "xla")


def _with_barriers(
    compile_graph: Callable[..., Any], graph_module: fx.GraphModule, inputs: Any
) -> Any:
    place_barriers(graph_module)
    return compile_graph(graph_module, inputs)


def barrier_node(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The graph's barrier: the values unchanged, through one XLA optimization barrier."""
    # XLA values are copied into the barrier, others pass as detached aliases (as before).
    return tuple(xla.barriered(tensors, [not xla.is_xla_tensor(t) for t in tensors]))


def place_barriers(graph_module: fx.GraphModule) -> int:
    """Put one optimization barrier in front of each recomputed region of a backward graph;
    return how many were placed.

    The barrier takes the region's inputs (saved values, parameters) and the gradients arriving
    at it: the values computed from the incoming gradients that the backward operations reading
    the region take. The region reads the barrier's outputs for its inputs, and those backward
    operations read it for the gradients: XLA drops a barrier's unused outputs, and the order
    with them. The graph is then sorted again, moving as little as it can.

    Regions are ranked by their first reader (the backward's order), and a barrier takes only
    values that depend on no region of its own rank or later: every added edge then runs from
    an earlier region to a later one, so no cycle can form. A region whose incoming gradient
    needs the region itself (the last block, when the loss is computed inside the compiled
    model) gets no barrier: it is recomputed first anyway.
    """
    graph = graph_module.graph
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    regions: dict[Any, list[fx.Node]] = {}
    for node in nodes:
        if node.op == "call_function" and node.meta.get("recompute") in _RECOMPUTED:
            regions.setdefault(node.meta.get("ac_graph_id"), []).append(node)
    recomputed = {node for members in regions.values() for node in members}
    readers = {
        key: _unique(u for node in members for u in node.users if u not in recomputed)
        for key, members in regions.items()
    }
    ranked = sorted(
        (k for k in regions if readers[k]), key=lambda k: min(order[r] for r in readers[k])
    )
    bit = {key: 1 << rank for rank, key in enumerate(ranked)}
    region_of = {node: key for key, members in regions.items() for node in members}
    # Per node: which regions it depends on (a bit per rank), and whether it comes from the
    # incoming gradients (AOTAutograd names them tangents_N).
    depends: dict[fx.Node, int] = {}
    from_tangents: set[fx.Node] = set()
    for node in nodes:
        mask = bit.get(region_of.get(node), 0)
        for i in node.all_input_nodes:
            mask |= depends[i]
        depends[node] = mask
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            i in from_tangents for i in node.all_input_nodes
        ):
            from_tangents.add(node)
    placed = 0
    for rank, key in enumerate(ranked):
        members, region = regions[key], set(regions[key])
        this_or_later = -1 << rank

        def usable(node: fx.Node, region: set = region, later: int = this_or_later) -> bool:
            return node not in region and _is_tensor(node) and not depends[node] & later

        inputs = _unique(i for node in members for i in node.all_input_nodes if usable(i))
        gradients = _unique(
            i
            for reader in readers[key]
            for i in reader.all_input_nodes
            if i in from_tangents and i not in recomputed and usable(i)
        )
        if not inputs or not gradients:
            continue
        with graph.inserting_before(members[0]):
            barrier = graph.call_function(barrier_node, tuple(inputs + gradients))
            outputs = []
            for index, value in enumerate(inputs + gradients):
                output = graph.call_function(operator.getitem, (barrier, index))
                output.meta["val"] = value.meta["val"]
                outputs.append(output)
        for value, output in zip(inputs, outputs, strict=False):
            for node in members:
                node.replace_input_with(value, output)
        for value, output in zip(gradients, outputs[len(inputs) :], strict=True):
            for reader in readers[key]:
                reader.replace_input_with(value, output)
        placed += 1
    if placed:
        _sort(graph)
        graph.lint()
        graph_module.recompile()
    return placed


def _sort(graph: fx.Graph) -> None:
    """Order `graph` topologically, keeping each node where it is unless an input of it
    comes later, which is then moved up in front of it."""
    done: set[fx.Node] = set()
    ordered: list[fx.Node] = []
    for start in graph.nodes:
        stack = [(start, iter(start.all_input_nodes))]
        while stack:
            node, inputs = stack[-1]
            pending = next((i for i in inputs if i not in done), None)
            if pending is not None:
                stack.append((pending, iter(pending.all_input_nodes)))
            else:
                stack.pop()
                if node not in done:
                    done.add(node)
                    ordered.append(node)
    for before, node in itertools.pairwise(ordered):
        before.append(node)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _unique(nodes: Any) -> list[fx.Node]:
    return list(dict.fromkeys(nodes))
