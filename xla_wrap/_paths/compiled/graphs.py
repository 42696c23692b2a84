"""What AOTAutograd's partitioner makes of a compiled step: the forward and backward graphs it
keeps, read back for [`xla_wrap.introspect`][xla_wrap.introspect]."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

        def keep(kind: str) -> Callable[..., Any]:
            def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
                setattr(self, kind, gm)
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = runs_regions_as_they_are(
            aot_autograd(
                fw_compiler=keep("forward"),
                bw_compiler=keep("backward"),
                partition_fn=min_cut_rematerialization_partition,
            )
        )

    def _graph(self, kind: str) -> torch.fx.GraphModule:
        graph: torch.fx.GraphModule | None = getattr(self, kind)
        if graph is None:
            raise CheckpointValueError(
                f"xla_wrap.introspect.PartitionedGraphs: no {kind} graph yet; run a step "
                "compiled with `backend=graphs.backend` (and its backward) first."
            )
        return graph

    def saved_bytes(self, outputs: int = 1) -> int:
        """What the forward keeps for backward, in bytes.

        That is, the forward graph's outputs after the compiled function's own `outputs` (one: a
        loss, or a tensor).

        Args:
            outputs: How many of the forward graph's outputs are the compiled function's
                own results (not saved for backward); 1 for a function returning one tensor.

        Returns:
            The size in bytes of the tensors the forward graph saves for backward (inputs
            and parameters it saves included).

        Raises:
            CheckpointValueError: If no step has been compiled with `backend` yet.
        """
        output = next(n for n in self._graph("forward").graph.nodes if n.op == "output")
        values = [
            a.meta.get("val") for a in output.args[0][outputs:] if isinstance(a, torch.fx.Node)
        ]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        return sum(int(v.numel()) * v.element_size() for v in tensors)  # int: a size's hint

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
