"""What AOTAutograd's partitioner makes of a compiled step: the forward and backward graphs it
keeps, read back for :mod:`xla_wrap.introspect`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._support.errors import CheckpointValueError


class PartitionedGraphs:
    """A ``torch.compile`` backend that keeps the forward and backward graphs AOTAutograd's
    min-cut partitioner (inductor's) makes, and runs them eagerly: what the compiled forward
    saves for backward, what the backward recomputes, and which nodes carry the recompute
    tags that a barrier-placing backend (TorchTPU) reads.

    Example:
        >>> graphs = introspect.PartitionedGraphs()
        >>> torch.compile(model, backend=graphs.backend, fullgraph=True)(x).sum().backward()
        >>> graphs.saved_bytes(), graphs.backward_ops(torch.ops.aten.mm)  # doctest: +SKIP
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

        self.backend = aot_autograd(
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            partition_fn=min_cut_rematerialization_partition,
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
        """What the forward keeps for backward: its outputs after the compiled function's
        own ``outputs`` (one: a loss, or a tensor)."""
        output = next(n for n in self._graph("forward").graph.nodes if n.op == "output")
        values = [
            a.meta.get("val") for a in output.args[0][outputs:] if isinstance(a, torch.fx.Node)
        ]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        return sum(int(v.numel()) * v.element_size() for v in tensors)  # int: a size's hint

    def backward_ops(self, *packets: Any) -> int:
        """How many calls of these ATen operations (``torch.ops.aten.mm``, ...) the backward
        graph makes: with recomputation, the forward's ones too."""
        return sum(
            1
            for n in self._graph("backward").graph.nodes
            if n.op == "call_function" and getattr(n.target, "overloadpacket", None) in packets
        )

    def recompute_tags(self) -> int:
        """Backward nodes tagged MUST_RECOMPUTE or PREFER_RECOMPUTE."""
        from torch.utils.checkpoint import CheckpointPolicy

        tags = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
        return sum(
            1 for n in self._graph("backward").graph.nodes if n.meta.get("recompute") in tags
        )
