"""The reentrant engine: the block runs without a graph and is recomputed and differentiated
inside the backward of one autograd Function.

The forward (`recompute.record_forward()` under `no_grad`) saves nothing inside the
block. `_ReentrantGate` then joins the block's outputs to its inputs and its owners'
parameters in the autograd graph, saving only the inputs. Its backward puts them through the
barrier of `recompute` with the incoming gradients and the parameters and buffers, runs
the block again on the barriered values with the forward's RNG and autocast state, and lets
gradients flow from the incoming gradients through the recomputed graph.

Parameters are explicit inputs of the gate, so a block whose inputs need no gradient (the first
layer) still gives its parameters gradients. Tensors the block reaches by other routes (FSDP's
views of flattened parameters, closures) receive gradients through the recomputed graph itself;
when no explicit input needs a gradient, an empty *anchor* tensor that requires one keeps the
gate in the autograd graph so that this backward runs at all.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._support.errors import CheckpointError
from .._support.tree import Flat, TensorMeta
from . import selective as _selective
from .recompute import (
    CheckpointCall,
    ForwardRecord,
    barrier_for_recompute,
    gradients_arrived,
    raise_not_deterministic,
    record_forward,
    replaying,
    save_for_recompute,
    saved_for_recompute,
)


def run_reentrant(call: CheckpointCall, inputs: Flat) -> Any:
    """Run `call` on `inputs` without a graph, and return its outputs behind the gate."""
    with torch.no_grad(), _selective.active(None):  # an enclosing policy does not look inside
        record, outputs, buffers = record_forward(call, inputs, contextlib.nullcontext())
    tensors = (*inputs.tensors, *call.owners.params)
    anchor = None
    if not any(t.requires_grad for t in tensors):
        anchor = torch.empty(0, requires_grad=True)
    through = _ReentrantGate.apply(
        record, anchor, buffers, len(tensors), *tensors, *outputs.tensors
    )
    return outputs.rebuild(through)


class _ReentrantGate(torch.autograd.Function):
    """`apply(record, anchor, buffers, n, *inputs, *params, *outputs)` -> aliases of
    `outputs` whose backward recomputes the block (`n` counts the inputs and parameters;
    `buffers` are the owners' buffers as the forward read them)."""

    @staticmethod
    def forward(
        ctx: Any,
        record: ForwardRecord,
        anchor: torch.Tensor | None,
        buffers: tuple[torch.Tensor, ...],
        n: int,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        n_inputs = len(record.inputs_require_grad)
        inputs, outputs = tensors[:n_inputs], tensors[n:]
        ctx.record = record
        ctx.output_positions = tuple(range(len(outputs)))  # as fsdp's sharding record reads
        ctx.n_tensors = n
        save_for_recompute(ctx, record, inputs, buffers)
        ctx.set_materialize_grads(False)
        out = tuple(t.detach() for t in outputs)
        not_differentiable = [t for t in out if not (t.is_floating_point() or t.is_complex())]
        if not_differentiable:
            ctx.mark_non_differentiable(*not_differentiable)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        record: ForwardRecord = ctx.record
        if torch.is_grad_enabled():  # first: the check below would name the wrong problem
            raise CheckpointError(
                f"{record.api}: double backward (`create_graph=True`, as in gradient penalties "
                "or Hessian-vector products) is not supported with `use_reentrant=True`: this "
                "engine differentiates the recomputation inside its own backward, without a "
                "graph of its own. Checkpoint with `use_reentrant=False` (the default), which "
                "supports it."
            )
        if not torch.autograd._is_checkpoint_valid():
            raise CheckpointError(
                f"{record.api}: the reentrant engine supports `loss.backward()` only, got "
                "`torch.autograd.grad(...)` or `backward(inputs=...)`. The recomputation "
                "accumulates gradients into every leaf it reaches, which those calls forbid. "
                "Checkpoint with `use_reentrant=False` (the default), whose engine supports "
                "them, or call `loss.backward()` and read `.grad`."
            )
        present = [i for i, g in enumerate(grads) if g is not None]
        inputs, buffers = saved_for_recompute(ctx)
        copies = barrier_for_recompute(record, inputs, buffers, [g for g in grads if g is not None])
        with replaying(record, copies), _selective.active(None):
            recomputed = Flat.of(record.run(copies.inputs))
        _check_same_outputs(record, recomputed)
        gradients_arrived(record, present, copies.grads, [recomputed.tensors[i] for i in present])
        pairs = [
            (recomputed.tensors[i], g)
            for i, g in zip(present, copies.grads, strict=True)
            if recomputed.tensors[i].requires_grad
        ]
        if pairs:
            outs, out_grads = zip(*pairs, strict=True)
            torch.autograd.backward(outs, out_grads)
        input_grads = [c.grad if c.requires_grad else None for c in copies.inputs]
        param_grads = [c.grad if c.requires_grad else None for c in copies.params]
        output_grads = [None] * (len(ctx.needs_input_grad) - 4 - ctx.n_tensors)
        return (None, None, None, None, *input_grads, *param_grads, *output_grads)


def _check_same_outputs(record: ForwardRecord, again: Flat) -> None:
    """Refuse a recomputation that does not match the forward: its gradients would be wrong."""
    forward = record.outputs
    problem = None
    if forward.spec != again.spec or forward.tensor_positions != again.tensor_positions:
        problem = (
            f"a value of structure {again.spec} with tensors at leaves "
            f"{list(again.tensor_positions)}, where the forward returned structure "
            f"{forward.spec} with tensors at leaves {list(forward.tensor_positions)}"
        )
    else:
        for position in forward.tensor_positions:
            expected, got = forward.leaves[position], TensorMeta.of(again.leaves[position])
            if expected != got:
                problem = f"{got} at output leaf {position}, where the forward returned {expected}"
                break
    if problem is not None:
        raise_not_deterministic(record.api, f"returned {problem}")
