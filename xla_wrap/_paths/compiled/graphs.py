"""What AOTAutograd's partitioner makes of a compiled step: the forward and backward graphs it
keeps, read back for [`xla_wrap.introspect`][xla_wrap.introspect]."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..._support.errors import CheckpointValueError
from .regions import runs_regions_as_they_are


class PartitionedGraphs:
    """A `torch.compile` backend that keeps the graphs AOTAutograd's partitioner makes.

    It keeps the forward and backward graphs that the min-cut partitioner (inductor's) makes,
    and runs them eagerly: what the compiled forward saves for backward, what the backward
    recomputes, and which nodes carry the recompute tags that a barrier-placing backend
    (TorchTPU) reads.

    Use one instance per compiled function: each compilation overwrites the graphs kept.

    Attributes:
        backend: The backend to pass to `torch.compile(..., backend=graphs.backend)`.
        forward: The forward graph of the last compilation; `None` before one.
        backward: The backward graph of the last compilation; `None` before one (AOTAutograd
            compiles it when the first backward runs).

    Examples:
        >>> import torch, xla_wrap
        >>> from xla_wrap import introspect
        >>> model = xla_wrap.checkpoint_wrapper(
        ...     torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        ... )
        >>> graphs = introspect.PartitionedGraphs()
        >>> step = torch.compile(model, backend=graphs.backend, fullgraph=True)
        >>> step(torch.randn(2, 4)).sum().backward()
        >>> graphs.backward_ops(torch.ops.aten.addmm)  # the first linear, recomputed
        1
        >>> graphs.recompute_tags() > 0
        True
    """

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.forward: torch.fx.GraphModule | None = None
        self.backward: torch.fx.GraphModule | None = None
        # The ids of the tensors Dynamo passed in, by position: the forward graph's placeholders
        # in the same order (parameters and buffers are lifted to inputs).
        self._input_ids: list[int] = []
        # How many of the forward graph's outputs are not saved for backward: the function's
        # own and the inputs it mutates (BatchNorm's running statistics), as AOTAutograd says.
        self._returns: int | None = None

        def keep(kind: str) -> Callable[..., Any]:
            def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
                setattr(self, kind, gm)
                if kind == "forward":
                    context = torch._guards.TracingContext.try_get()
                    metadata = getattr(context, "fw_metadata", None)
                    self._returns = getattr(metadata, "num_forward_returns", None)
                return make_boxed_func(gm.forward)

            return compiler

        partitioned = aot_autograd(
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            partition_fn=min_cut_rematerialization_partition,
            # As aot_eager and inductor: inputs updated in place that need no gradient
            # (BatchNorm's statistics) are updated inside the graph; outside it, a copy back
            # would bump the version of one the recomputation saved, and backward refuses.
            keep_inference_input_mutations=True,
        )

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self._input_ids = [id(t) for t in example_inputs]
            return partitioned(gm, example_inputs)

        self.backend = runs_regions_as_they_are(backend)

    def _graph(self, kind: str) -> torch.fx.GraphModule:
        graph: torch.fx.GraphModule | None = getattr(self, kind)
        if graph is None:
            raise CheckpointValueError(
                f"xla_wrap.introspect.PartitionedGraphs: no {kind} graph yet; run a step "
                "compiled with `backend=graphs.backend` (and its backward) first."
            )
        return graph

    def saved_bytes(
        self, outputs: int | None = None, *, excluding: Iterable[torch.Tensor] = ()
    ) -> int:
        """What the forward keeps for backward, in bytes.

        That is, the forward graph's outputs after the compiled function's own results and the
        new values of the inputs it mutates (BatchNorm's running statistics).

        Args:
            outputs: How many of the forward graph's outputs are not saved for backward; by
                default what AOTAutograd counted (the function's outputs and the inputs it
                mutates), or 1 where it did not say.
            excluding: Inputs of the compiled function not to count where the forward saves
                them as they came in: pass the model's parameters and buffers to count only
                what checkpointing can free (`model.parameters()` live through the step anyway).

        Returns:
            The size in bytes of the tensors the forward graph saves for backward (inputs
            and parameters it saves included, but for `excluding`).

        Raises:
            CheckpointValueError: If no step has been compiled with `backend` yet.
        """
        forward = self._graph("forward")
        placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
        skipped = {id(t) for t in excluding}
        # Placeholders pair with Dynamo's inputs only where AOTAutograd added none of its own.
        paired = len(placeholders) == len(self._input_ids)
        not_counted = {
            node
            for node, input_id in zip(placeholders, self._input_ids, strict=False)
            if paired and input_id in skipped
        }
        if outputs is None:
            outputs = 1 if self._returns is None else self._returns
        output = next(n for n in forward.graph.nodes if n.op == "output")
        values = [
            a.meta.get("val")
            for a in output.args[0][outputs:]
            if isinstance(a, torch.fx.Node) and a not in not_counted
        ]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        return sum(int(v.numel()) * v.element_size() for v in tensors)  # int: a size's hint

    def forward_flops(self) -> int:
        """The FLOPs of the forward graph's matrix products, convolutions and attention.

        Counted from the nodes' shapes with `torch.utils.flop_counter`'s formulas, as
        `FlopCounterMode` counts a run.

        Returns:
            The FLOPs of the operations in the forward graph that `torch.utils.flop_counter`
            has a formula for.

        Raises:
            CheckpointValueError: If no step has been compiled with `backend` yet.
        """
        return _flops(self._graph("forward"))

    def backward_flops(self) -> int:
        """The FLOPs of the backward graph's matrix products, convolutions and attention.

        Counted as [`forward_flops()`][xla_wrap.introspect.PartitionedGraphs.forward_flops];
        with recomputation, the forward's operations recomputed count too.

        Returns:
            The FLOPs of the operations in the backward graph that `torch.utils.flop_counter`
            has a formula for.

        Raises:
            CheckpointValueError: If no backward has been compiled with `backend` yet.
        """
        return _flops(self._graph("backward"))

    def backward_ops(self, *packets: Any) -> int:
        """How many calls of these ATen operations the backward graph makes.

        With recomputation, the forward's ones count too.

        Args:
            *packets: ATen operator packets (`torch.ops.aten.mm`, not an overload such as
                `torch.ops.aten.mm.default`).

        Returns:
            The number of calls in the backward graph of any of `packets`.

        Raises:
            CheckpointValueError: If no backward has been compiled with `backend` yet.
        """
        return sum(
            1
            for n in _run_nodes(self._graph("backward"))
            if n.op == "call_function" and getattr(n.target, "overloadpacket", None) in packets
        )

    def recompute_tags(self) -> int:
        """How many nodes of the backward graph carry a recompute tag.

        Returns:
            The number of backward nodes tagged `CheckpointPolicy.MUST_RECOMPUTE` or
            `PREFER_RECOMPUTE` (`node.meta["recompute"]`): the recomputation that a
            checkpoint put there.

        Raises:
            CheckpointValueError: If no backward has been compiled with `backend` yet.
        """
        from torch.utils.checkpoint import CheckpointPolicy

        tags = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
        return sum(
            1 for n in _run_nodes(self._graph("backward")) if n.meta.get("recompute") in tags
        )


def _run_nodes(graph: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The nodes `graph` runs, in order: a nested compile region's (a scanned stack's layer)
    once per call of it."""
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    for node in graph.graph.nodes:
        if invoke is not None and node.target is invoke:
            yield from _run_nodes(getattr(graph, node.args[0].target))
        else:
            yield node


def _flops(graph: torch.fx.GraphModule) -> int:
    """The FLOPs `graph` runs, by `torch.utils.flop_counter`'s formulas on its nodes' shapes."""
    from torch.utils.flop_counter import flop_registry

    def value(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg

    total = 0
    for node in _run_nodes(graph):
        formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if node.op == "call_function" and formula is not None:
            args, kwargs = torch.utils._pytree.tree_map(value, (node.args, node.kwargs))
            total += int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    return total
