"""The autograd Function behind every xla_wrap checkpoint.

Forward runs the callable without recording a graph and saves only its tensor inputs. Backward
follows the recipe that makes rematerialization survive XLA (JAX's, and the seed discussion's):

1. the saved inputs, the incoming output gradients, and the parameters and buffers of the
   owning modules go through **one** optimization barrier together. Recomputing from the
   barrier's outputs makes the recomputation a different value for XLA (common-subexpression
   elimination cannot merge it back into the forward) and makes it wait for the gradients (it
   cannot be scheduled early, where it would keep activations alive again);
2. the callable runs again on those barriered values, with the forward's RNG and autocast state;
3. gradients flow from the incoming gradients through the recomputed graph.

Under SPMD the barrier's outputs carry no sharding: XLA's sharding propagation does not pass
through it, and the partitioner then replicates the recomputation and gathers its activations
in full. Each incoming gradient is therefore annotated with the sharding of the output it
belongs to (recorded in the forward, or found on the recomputed output).

Parameters are explicit inputs of the Function, so a block whose inputs need no gradient (the
first layer) still gives its parameters gradients. Tensors the callable reaches by other routes
(FSDP's views of flattened parameters, closures) receive gradients through the recomputed graph
itself; when no explicit input needs a gradient, an empty *anchor* tensor that requires one
keeps the Function in the autograd graph so that this backward runs at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _autocast, _rng, _xla
from ._barrier import barriered
from ._errors import CheckpointError
from ._module_tensors import ModuleTensors
from ._state import recomputing
from ._tree import Flat, TensorMeta


@dataclass
class CheckpointCall:
    """One checkpointed call: what to run, on what, and what its forward recorded."""

    api: str
    function: Callable[..., Any]
    inputs: Flat  # flattened (args, kwargs)
    owners: ModuleTensors
    preserve_rng_state: bool
    rng: _rng.RngSnapshot | None = None
    autocast: _autocast.AutocastSnapshot | None = None
    outputs: Flat | None = field(default=None, repr=False)
    output_shardings: list[object | None] = field(default_factory=list, repr=False)

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        args, kwargs = self.inputs.rebuild(inputs)
        return self.function(*args, **kwargs)


class CheckpointFunction(torch.autograd.Function):
    """``apply(call, anchor, *input_tensors, *params)`` -> the output tensors of ``call``."""

    @staticmethod
    def forward(
        ctx: Any, call: CheckpointCall, anchor: torch.Tensor | None, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        inputs = tensors[: len(call.inputs.tensor_positions)]
        ctx.call = call
        ctx.params = call.owners.params
        ctx.save_for_backward(*inputs)
        # The forward may update buffers in place (BatchNorm statistics, EMAs); the
        # recomputation must read them as the forward did. On XLA the copy shares the lazy
        # value and costs nothing until the buffer changes.
        ctx.buffers = [b.detach().clone() for b in call.owners.buffers]
        if call.preserve_rng_state:
            call.rng = _rng.capture([*tensors, *call.owners.buffers])
        call.autocast = _autocast.capture()
        versions = [t._version for t in inputs]
        outputs = Flat.of(call.run(inputs))
        _check_inputs_unchanged(call, inputs, versions)
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
                "Call `loss.backward()` and read `.grad`."
            )
        inputs = ctx.saved_tensors
        params: tuple[torch.Tensor, ...] = ctx.params
        buffers: list[torch.Tensor] = ctx.buffers
        present = [i for i, g in enumerate(grads) if g is not None]
        incoming = [g for g in grads if g is not None]
        n_in, n_grad, n_param = len(inputs), len(present), len(params)
        # Saved inputs and incoming gradients are rewritten in place (their other readers then
        # need no pre-barrier copy); parameters and buffers are copied (module state stays).
        # Under SPMD, inputs that are program inputs (data, masks) are copied too: rewritten,
        # they would come out of the step with another sharding and recompile the next one.
        spmd = _xla.spmd_active()
        copies = barriered(
            [*inputs, *incoming, *params, *buffers],
            in_place=[not (spmd and _xla.is_device_data(t)) for t in inputs]
            + [True] * n_grad
            + [False] * (n_param + len(buffers)),
        )
        input_copies = copies[:n_in]
        grad_copies = copies[n_in : n_in + n_grad]
        param_copies = copies[n_in + n_grad : n_in + n_grad + n_param]
        # The recomputation may update buffers in place (BatchNorm statistics); it gets its own
        # copies so the update happens once. On XLA the barrier output is already a new value.
        buffer_copies = [
            b if _xla.is_xla_tensor(b) else b.clone() for b in copies[n_in + n_grad + n_param :]
        ]
        # needs_input_grad: (call, anchor, *inputs, *params)
        for copy, needs_grad in zip(input_copies, ctx.needs_input_grad[2 : 2 + n_in], strict=True):
            copy.requires_grad_(needs_grad)
        for copy, param in zip(param_copies, params, strict=True):
            copy.requires_grad_(param.requires_grad)

        with ExitStack() as stack:
            stack.enter_context(recomputing())
            stack.enter_context(_xla.checkpoint_backward_status())
            if call.rng is not None:
                stack.enter_context(_rng.replay(call.rng))
            if call.autocast is not None:
                stack.enter_context(_autocast.replay(call.autocast))
            stack.enter_context(call.owners.substituted(param_copies, buffer_copies))
            stack.enter_context(torch.enable_grad())
            recomputed = Flat.of(call.run(input_copies))

        assert call.outputs is not None
        _check_same_outputs(call, call.outputs, recomputed)
        for i, grad in zip(present, grad_copies, strict=True):
            _shard_like_output(grad, recomputed.tensors[i], call.output_shardings[i])
        pairs = [
            (recomputed.tensors[i], g)
            for i, g in zip(present, grad_copies, strict=True)
            if recomputed.tensors[i].requires_grad
        ]
        if pairs:
            outs, out_grads = zip(*pairs, strict=True)
            torch.autograd.backward(outs, out_grads)
        input_grads = [c.grad if c.requires_grad else None for c in input_copies]
        param_grads = [c.grad if c.requires_grad else None for c in param_copies]
        return (None, None, *input_grads, *param_grads)


def _shard_like_output(
    grad: torch.Tensor, output: torch.Tensor, forward_sharding: object | None
) -> None:
    """Give a barriered gradient the sharding of its output, if that output had one."""
    if _xla.sharding(grad) is not None:
        return
    op_sharding = _xla.sharding(output) or forward_sharding
    if op_sharding is not None:
        _xla.shard_like(grad, op_sharding)
    elif _xla.is_xla_tensor(grad) and _xla.spmd_active():
        _xla.warn_unsharded_gradient_once()


def record_output_sharding(output: torch.Tensor) -> None:
    """Record the sharding given to ``output`` after a checkpoint returned it.

    SPMD FSDP annotates a unit's output once the unit returns, on an alias that module hooks
    made of the checkpoint's output. This walks from ``output`` back through such pass-through
    nodes to the checkpoint that produced it, so that its backward shards the gradient the same
    way. An output that no checkpoint produced, or that has no sharding, is left alone.
    """
    op_sharding = _xla.sharding(output)
    if op_sharding is None:
        return
    node, index = output.grad_fn, output.output_nr
    for _ in range(_MAX_ALIAS_HOPS):
        if node is None:
            return
        if isinstance(node, CheckpointFunction._backward_cls):
            call: CheckpointCall = node.call
            if index < len(call.output_shardings):
                call.output_shardings[index] = op_sharding
            return
        if type(node).__name__ not in _PASS_THROUGH_NODES:
            return
        node, index = node.next_functions[index]


# Autograd nodes that hand their inputs on unchanged, one output per input.
_PASS_THROUGH_NODES = {"BackwardHookFunctionBackward", "AliasBackward0"}
_MAX_ALIAS_HOPS = 4


def _check_inputs_unchanged(
    call: CheckpointCall, inputs: Sequence[torch.Tensor], versions: Sequence[int]
) -> None:
    """Refuse a callable that modified its inputs in place: the recomputation would start from
    the modified values and give wrong gradients without any error."""
    for index, (tensor, version) in enumerate(zip(inputs, versions, strict=True)):
        if tensor._version != version:
            raise CheckpointError(
                f"{call.api}: the checkpointed callable modified its input tensor {index} "
                f"({TensorMeta.of(tensor)}) in place; the recomputation in backward would start "
                "from the modified value and give wrong gradients. Make that operation "
                "out-of-place (for example `nn.ReLU(inplace=False)` as the block's first layer) "
                "or clone the input inside the callable."
            )


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
        raise CheckpointError(
            f"{call.api}: the recomputation in backward returned {problem}. A checkpointed "
            "callable must give the same outputs when run again on the same inputs; branch on "
            "`xla_wrap.is_recomputing()` only for side effects, never for what it returns."
        )
