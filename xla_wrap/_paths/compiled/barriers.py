"""Optimization barriers in a compiled backward graph, for any AOTAutograd backend.

Under `torch.compile` a checkpoint's recomputation lands in the backward graph, each region
(`node.meta["ac_graph_id"]`) next to the gradient that needs it, its nodes tagged
`node.meta["recompute"]`. A compiler that sees the graph as one program (XLA) may run every
region's recomputation at the program's start, where all its inputs already exist: then the
backward holds every block's activations at once and the checkpoint saves nothing.

A barrier orders work only against its own inputs. `region_barriers()` puts one barrier in
front of each region, taking the region's inputs (saved values, parameters) together with the
gradient arriving at it; the region reads the barrier's outputs, so it cannot start before that
gradient exists (the engine's Rule 1, in the compiled graph). `leaf_barriers()` is TorchTPU's
rule (`mark_activation_checkpoints`, as its public source describes it): a one-input barrier
after each recomputed node that no other recomputed node reads. Those nodes are made from
saved values and parameters only, never from a gradient, so nothing orders the recomputation
after the gradient: measured on torch_xla's Dynamo path, it keeps no saving (docs/compile.md).

A barrier here is any operation with the contract "a list of tensors in, the same list out"
(torch_xla's, TorchTPU's `torch.ops.torch_tpu.optimization_barrier.default`, or one of your
own), called in the graph as `barrier([a, b, ...])`.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..._support.errors import CheckpointTypeError, CheckpointValueError, describe

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
Barrier = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]


def region_barriers(graph_module: fx.GraphModule, barrier: Barrier) -> int:
    """Put one optimization barrier in front of each recomputed region of a backward graph.

    The barrier takes the region's inputs (saved values, parameters) and the gradients
    arriving at it: the values computed from the incoming gradients that the backward
    operations reading the region take. The region reads the barrier's outputs for its inputs,
    and those backward operations read them for the gradients (a compiler drops a barrier's
    unused outputs, and the order with them), so the recomputation waits for its gradient.
    The graph is then sorted again, moving as little as it can.

    Regions are ranked by their first reader (the backward's order), and a barrier takes only
    values that depend on no region of its own rank or later: every added edge then runs from
    an earlier region to a later one, so no cycle can form. A region whose incoming gradient
    needs the region itself (the last block, when the loss is computed inside the compiled
    model) gets no barrier: it is recomputed first anyway. Barriers of the same operation
    already in the graph (TorchTPU's leaf pass, run before) are looked through: the region's
    readers are what reads their outputs, so the passes compose in either order.

    Args:
        graph_module: An AOTAutograd backward graph (its incoming gradients are the
            placeholders named `tangents_*`); changed in place and recompiled.
        barrier: The operation to insert: a list of tensors in, the same list out.

    Returns:
        How many barriers were placed (one per region that has an incoming gradient).

    Raises:
        CheckpointTypeError: If `graph_module` is not an `fx.GraphModule` or `barrier` is not
            callable.

    Examples:
        In a backward compiler of your own, before compiling the graph:

        >>> placed = xla_wrap.region_barriers(backward_graph, my_barrier)  # doctest: +SKIP
    """
    graph = _checked("xla_wrap.region_barriers", graph_module, barrier)
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    regions: dict[Any, list[fx.Node]] = {}
    for node in nodes:
        if _recomputed(node):
            regions.setdefault(node.meta.get("ac_graph_id"), []).append(node)
    recomputed = {node for members in regions.values() for node in members}

    def readers_of(node: fx.Node) -> Any:
        # Through barriers of the same operation placed already (a leaf pass run before):
        # the region's readers are what reads their outputs.
        for user in node.users:
            if user in recomputed:
                continue
            if user.target is barrier or (
                user.target is operator.getitem
                and isinstance(user.args[0], fx.Node)
                and user.args[0].target is barrier
            ):
                yield from readers_of(user)
            else:
                yield user

    readers = {
        key: _unique(r for node in members for r in readers_of(node))
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
            outputs = _insert_barrier(graph, barrier, [*inputs, *gradients])
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


def leaf_barriers(graph_module: fx.GraphModule, barrier: Barrier) -> int:
    """TorchTPU's placement, for comparison: a one-input barrier after each recomputed leaf.

    A leaf is a node tagged for recomputation that no other tagged node reads; every reader of
    a leaf reads the barrier's output instead. Written from the description of TorchTPU's
    `mark_activation_checkpoints` pass. It orders nothing after the gradient (a leaf is made
    from saved values and parameters), which is why it keeps no saving on XLA
    (docs/compile.md); `region_barriers()` is the placement that does.

    Args:
        graph_module: An AOTAutograd backward graph; changed in place and recompiled.
        barrier: The operation to insert: a list of tensors in, the same list out.

    Returns:
        How many barriers were placed.

    Raises:
        CheckpointTypeError: If `graph_module` is not an `fx.GraphModule` or `barrier` is not
            callable.
    """
    graph = _checked("xla_wrap.internal.leaf_barriers", graph_module, barrier)
    tagged = {node for node in graph.nodes if _recomputed(node)}
    leaves = [node for node in graph.nodes if node in tagged and not set(node.users) & tagged]
    for node in leaves:
        readers = list(node.users)
        with graph.inserting_after(node):
            (output,) = _insert_barrier(graph, barrier, [node])
        for reader in readers:
            reader.replace_input_with(node, output)
    if leaves:
        graph.lint()
        graph_module.recompile()
    return len(leaves)


def with_region_barriers(backend: str | Callable[..., Any], *, barrier: Barrier) -> Any:
    """A `torch.compile` backend: `backend`, with `region_barriers()` in its backward.

    `backend` is an AOTAutograd backend (made by
    `torch._dynamo.backends.common.aot_autograd`, as torch_xla's `openxla` is), given as the
    callable or by its registered name. Its backward compiler receives each backward graph
    with one `barrier` in front of each checkpointed region, and compiles it as before; the
    forward is untouched. [`openxla_backend`][xla_wrap.openxla_backend] is this with
    torch_xla's barrier on `"openxla"`.

    Args:
        backend: The AOTAutograd backend, or its name (`"openxla"`, or one you registered
            with `torch._dynamo.register_backend`).
        barrier: The operation to insert: a list of tensors in, the same list out (for
            TorchTPU: `torch.ops.torch_tpu.optimization_barrier.default`).

    Returns:
        The backend to pass as `torch.compile(..., backend=...)`: called by Dynamo with each
        captured graph and its example inputs.

    Raises:
        CheckpointValueError: If `backend` names no registered backend.
        CheckpointTypeError: If `backend` is not an AOTAutograd backend (inductor and
            TorchTPU's `tpu` build their AOTAutograd inside, where no pass can be handed in),
            or `barrier` is not callable.

    Examples:
        >>> compiled = torch.compile(  # doctest: +SKIP
        ...     model, backend=xla_wrap.with_region_barriers("openxla", barrier=my_barrier)
        ... )
    """
    api = "xla_wrap.with_region_barriers"
    if not callable(barrier):
        raise CheckpointTypeError(
            f"{api}: expected the barrier operation (a list of tensors in, the same list out) "
            f"as `barrier`, got {describe(barrier)}."
        )
    settings = _aot_settings(api, backend)
    compile_backward = settings.get("bw_compiler") or settings["fw_compiler"]
    settings["bw_compiler"] = functools.partial(_with_barriers, compile_backward, barrier)
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**settings)


def _aot_settings(api: str, backend: str | Callable[..., Any]) -> dict[str, Any]:
    """The keyword arguments `backend` was made with by `aot_autograd`."""
    named = backend
    if isinstance(backend, str):
        try:
            named = torch._dynamo.lookup_backend(backend)
        except Exception:  # Dynamo's InvalidBackend, whose module moves between versions
            known = ", ".join(sorted(torch._dynamo.list_backends(exclude_tags=())))
            raise CheckpointValueError(
                f"{api}: expected the name of a registered torch.compile backend, got "
                f"{backend!r}. Registered: {known}."
            ) from None
    kwargs = getattr(named, "kwargs", None)
    if not isinstance(kwargs, dict) or "fw_compiler" not in kwargs:
        raise CheckpointTypeError(
            f"{api}: expected an AOTAutograd backend (made by torch._dynamo.backends.common."
            f"aot_autograd, as torch_xla's 'openxla' is), got {describe(backend)}, which does "
            "not hand its backward graph to a compiler xla_wrap can wrap. Build the backend "
            "with aot_autograd(fw_compiler=..., bw_compiler=...), or run "
            "xla_wrap.region_barriers(graph, barrier) on the backward graph where your "
            "backend exposes it."
        )
    return dict(kwargs)


def _with_barriers(
    compile_graph: Callable[..., Any], barrier: Barrier, graph_module: fx.GraphModule, inputs: Any
) -> Any:
    region_barriers(graph_module, barrier)
    return compile_graph(graph_module, inputs)


def _checked(api: str, graph_module: object, barrier: object) -> fx.Graph:
    if not isinstance(graph_module, fx.GraphModule):
        raise CheckpointTypeError(
            f"{api}: expected a backward graph (torch.fx.GraphModule, as AOTAutograd hands its "
            f"backward compiler), got {describe(graph_module)}."
        )
    if not callable(barrier):
        raise CheckpointTypeError(
            f"{api}: expected the barrier operation (a list of tensors in, the same list out) "
            f"as `barrier`, got {describe(barrier)}."
        )
    return graph_module.graph


def _insert_barrier(graph: fx.Graph, barrier: Barrier, values: list[fx.Node]) -> list[fx.Node]:
    """`barrier(values)` at the graph's insertion point, and one output node per value."""
    node = graph.call_function(barrier, (values,))
    node.meta["val"] = [value.meta["val"] for value in values]
    outputs: list[fx.Node] = []
    for index, value in enumerate(values):
        with graph.inserting_after(outputs[-1] if outputs else node):  # in order, after it
            output = graph.call_function(operator.getitem, (node, index))
        output.meta["val"] = value.meta["val"]
        outputs.append(output)
    return outputs


def _recomputed(node: fx.Node) -> bool:
    return node.op == "call_function" and node.meta.get("recompute") in _RECOMPUTED


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
