"""The reentrant engine: an autograd Function that recomputes its block in its own backward.

Forward runs the callable without recording a graph and saves only its tensor inputs. Backward
puts them through the barrier of :mod:`._recompute` with the incoming gradients and the owners'
parameters and buffers, runs the callable again on the barriered values with the forward's RNG
and autocast state, and lets gradients flow from the incoming gradients through the recomputed
graph.

Parameters are explicit inputs of the Function, so a block whose inputs need no gradient (the
first layer) still gives its parameters gradients. Tensors the callable reaches by other routes
(FSDP's views of flattened parameters, closures) receive gradients through the recomputed graph
itself; when no explicit input needs a gradient, an empty *anchor* tensor that requires one
keeps the Function in the autograd graph so that this backward runs at all.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _offload, _selective, _xla
from ._errors import CheckpointError
from ._recompute import (
    CheckpointCall,
    barrier_for_recompute,
    check_inputs_unchanged,
    raise_not_deterministic,
    replaying,
    shard_like_output,
)
from ._tree import Flat, TensorMeta


class CheckpointFunction(torch.autograd.Function):
    """``apply(call, anchor, *input_tensors, *params)`` -> the output tensors of ``call``."""

    @staticmethod
    def forward(
        ctx: Any, call: CheckpointCall, anchor: torch.Tensor | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        inputs = tensors[: len(call.inputs.tensor_positions)]
        ctx.call = call
        saved, ctx.offload_devices = _offload.to_host(inputs, [call.offload_to_cpu] * len(inputs))
        ctx.save_for_backward(*saved)
        # The forward may update buffers in place (BatchNorm statistics, EMAs); the
        # recomputation must read them as the forward did. On XLA the copy shares the lazy
        # value and costs nothing until the buffer changes.
        ctx.buffers = [b.detach().clone() for b in call.owners.buffers]
        call.capture_state(tensors)
        versions = [t._version for t in inputs]
        with _selective.active(None):  # an enclosing policy does not look inside
            outputs = Flat.of(call.run(inputs))
        check_inputs_unchanged(call, inputs, versions)
        # Keep structure and non-tensor values only: holding the output tensors here would
        # make a reference cycle through their grad_fn.
        call.output_shardings = [_xla.sharding(t) for t in outputs.tensors]
        call.outputs = outputs.without_tensors()
        call.inputs = call.inputs.without_tensors()
        ctx.set_materialize_grads(False)
        # A tensor the callable returns without computing it (a buffer, a global) would get
        # this Function as its grad_fn in place; return an alias of it instead. Inputs returned
        # as they are need no alias: autograd handles those.
        ids = {id(t) for t in tensors}
        out = tuple(t if id(t) in ids else t.detach() for t in outputs.tensors)
        not_differentiable = [t for t in out if not (t.is_floating_point() or t.is_complex())]
        if not_differentiable:
            ctx.mark_non_differentiable(*not_differentiable)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: CheckpointCall = ctx.call
        if not torch.autograd._is_checkpoint_valid():
            raise CheckpointError(
                f"{call.api}: checkpointed blocks support `loss.backward()` only, got "
                "`torch.autograd.grad(...)` or `backward(inputs=...)`. The recomputation "
                "accumulates gradients into every leaf it reaches, which those calls forbid. "
                "Checkpoint with `use_reentrant=False`, whose engine supports them, or call "
                "`loss.backward()` and read `.grad`."
            )
        present = [i for i, g in enumerate(grads) if g is not None]
        inputs = _offload.to_device(ctx.saved_tensors, ctx.offload_devices)
        copies = barrier_for_recompute(
            call,
            inputs,
            ctx.needs_input_grad[2 : 2 + len(inputs)],  # (call, anchor, *inputs, *params)
            [g for g in grads if g is not None],
            ctx.buffers,
        )
        with replaying(call, copies), _selective.active(None):
            recomputed = Flat.of(call.run(copies.inputs))

        assert call.outputs is not None
        _check_same_outputs(call, call.outputs, recomputed)
        for i, grad in zip(present, copies.grads, strict=True):
            shard_like_output(grad, recomputed.tensors[i], call.output_shardings[i])
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
        return (None, None, *input_grads, *param_grads)


def _check_same_outputs(call: CheckpointCall, forward: Flat, again: Flat) -> None:
    """Refuse a recomputation that does not match the forward: its gradients would be wrong."""
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
        raise_not_deterministic(call.api, f"returned {problem}")
