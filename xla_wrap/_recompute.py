"""What both checkpoint engines share: the record of a call, the barrier before recomputing,
and the state the recomputation runs under.

Recomputation survives XLA only with JAX's recipe (and the seed discussion's): the values the
recomputation starts from, the incoming output gradients, and the parameters and buffers of the
owning modules go through **one** optimization barrier together. Recomputing from the barrier's
outputs makes the recomputation a different value for XLA (common-subexpression elimination
cannot merge it back into the forward) and makes it wait for the gradients (it cannot be
scheduled early, where it would keep activations alive again).

Under SPMD the barrier's outputs carry no sharding: XLA's sharding propagation does not pass
through it, and the partitioner then replicates the recomputation and gathers its activations
in full. Each incoming gradient is therefore annotated with the sharding of the output it
belongs to (recorded in the forward, or found on the recomputed output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
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
    offload_to_cpu: bool = False
    rng: _rng.RngSnapshot | None = None
    autocast: _autocast.AutocastSnapshot | None = None
    outputs: Flat | None = field(default=None, repr=False)
    output_shardings: list[object | None] = field(default_factory=list, repr=False)

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        args, kwargs = self.inputs.rebuild(inputs)
        return self.function(*args, **kwargs)

    def capture_state(self, tensors: Sequence[torch.Tensor]) -> None:
        """Record the generators and autocast settings the forward starts with."""
        if self.preserve_rng_state:
            self.rng = _rng.capture([*tensors, *self.owners.buffers])
        self.autocast = _autocast.capture()


@dataclass(frozen=True)
class Barriered:
    """Detached copies, taken through one barrier, of what a recomputation reads."""

    inputs: list[torch.Tensor]
    kept: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]


def barrier_for_recompute(
    call: CheckpointCall,
    inputs: Sequence[torch.Tensor],
    inputs_require_grad: Sequence[bool],
    grads: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    kept: Sequence[torch.Tensor] = (),
) -> Barriered:
    """Put the saved ``inputs``, the values a save policy ``kept``, the incoming ``grads`` and
    the owners' parameters and ``buffers`` (as the forward read them) through one barrier.

    Saved inputs, kept values and gradients are rewritten in place (their other readers then
    need no pre-barrier copy); parameters and buffers are copied (module state stays). Under
    SPMD, inputs that are program inputs (data, masks) are copied too: rewritten, they would
    come out of the step with another sharding and recompile the next one. The copies of inputs
    require grad as ``inputs_require_grad`` says (as the forward's inputs did: a saved input
    brought back from the host does not), and those of parameters as the parameters do, so the
    recomputation builds the same graph.
    """
    params = call.owners.params
    spmd = _xla.spmd_active()
    n = [len(inputs), len(kept), len(grads), len(params), len(buffers)]
    copies = barriered(
        [*inputs, *kept, *grads, *params, *buffers],
        in_place=[not (spmd and _xla.is_device_data(t)) for t in inputs]
        + [True] * (n[1] + n[2])
        + [False] * (n[3] + n[4]),
    )
    groups: list[list[torch.Tensor]] = []
    for size in n:
        groups.append(copies[:size])
        copies = copies[size:]
    input_copies, kept_copies, grad_copies, param_copies, buffer_copies = groups
    for copy, requires_grad in zip(input_copies, inputs_require_grad, strict=True):
        copy.requires_grad_(requires_grad)
    for copy, param in zip(param_copies, params, strict=True):
        copy.requires_grad_(param.requires_grad)
    # The recomputation may update buffers in place (BatchNorm statistics); it gets its own
    # copies so the update happens once. On XLA the barrier output is already a new value.
    buffer_copies = [b if _xla.is_xla_tensor(b) else b.clone() for b in buffer_copies]
    return Barriered(input_copies, kept_copies, grad_copies, param_copies, buffer_copies)


@contextmanager
def replaying(call: CheckpointCall, copies: Barriered) -> Iterator[None]:
    """Run the block as its forward ran: same generators and autocast settings, the barriered
    parameters and buffers in the modules' slots, gradients recorded, and
    :func:`xla_wrap.is_recomputing` true."""
    with ExitStack() as stack:
        stack.enter_context(recomputing())
        stack.enter_context(_xla.checkpoint_backward_status())
        if call.rng is not None:
            stack.enter_context(_rng.replay(call.rng))
        if call.autocast is not None:
            stack.enter_context(_autocast.replay(call.autocast))
        stack.enter_context(call.owners.substituted(copies.params, copies.buffers))
        stack.enter_context(torch.enable_grad())
        yield


def shard_like_output(
    grad: torch.Tensor, output: torch.Tensor | None, forward_sharding: object | None
) -> None:
    """Give a barriered gradient the sharding of its output, if that output had one."""
    if _xla.sharding(grad) is not None:
        return
    op_sharding = (_xla.sharding(output) if output is not None else None) or forward_sharding
    if op_sharding is not None:
        _xla.shard_like(grad, op_sharding)
    elif _xla.is_xla_tensor(grad) and _xla.spmd_active():
        _xla.warn_unsharded_gradient_once()


def record_output_sharding(output: torch.Tensor) -> None:
    """Record the sharding given to ``output`` after a checkpoint returned it.

    SPMD FSDP annotates a unit's output once the unit returns, on an alias that module hooks
    made of the checkpoint's output. This walks from ``output`` back through such pass-through
    nodes to the checkpoint that produced it (either engine's node carries its
    :class:`CheckpointCall`), so that its backward shards the gradient the same way. An output
    that no checkpoint produced, or that has no sharding, is left alone.
    """
    op_sharding = _xla.sharding(output)
    if op_sharding is None:
        return
    node, index = output.grad_fn, output.output_nr
    for _ in range(_MAX_ALIAS_HOPS):
        if node is None:
            return
        call = getattr(node, "call", None)
        if isinstance(call, CheckpointCall):
            if index < len(call.output_shardings):
                call.output_shardings[index] = op_sharding
            return
        if type(node).__name__ not in _PASS_THROUGH_NODES:
            return
        node, index = node.next_functions[index]


# Autograd nodes that hand their inputs on unchanged, one output per input.
_PASS_THROUGH_NODES = {"BackwardHookFunctionBackward", "AliasBackward0"}
_MAX_ALIAS_HOPS = 4


def check_inputs_unchanged(
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


def raise_not_deterministic(api: str, problem: str) -> None:
    raise CheckpointError(
        f"{api}: the recomputation in backward {problem}. A checkpointed callable must "
        "compute the same thing when run again on the same inputs; branch on "
        "`xla_wrap.is_recomputing()` only for side effects, never for what it computes."
    )
