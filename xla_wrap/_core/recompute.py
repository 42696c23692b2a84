"""The core both checkpoint engines share: the description of a call, the record of its
forward, the barrier before recomputing, and the state the recomputation runs under.

Recomputation survives XLA only with JAX's recipe (docs/index.md, "Why barriers"): the values the
recomputation starts from, the incoming output gradients, and the parameters and buffers of the
owning modules go through **one** optimization barrier together. Recomputing from the barrier's
outputs makes the recomputation a different value for XLA (common-subexpression elimination
cannot merge it back into the forward) and makes it wait for the gradients (it cannot be
scheduled early, where it would keep activations alive again).

Both engines run the forward through `record_forward()`, which makes every snapshot and
check in one place and returns a `ForwardRecord` that nothing changes afterwards. What
a composition adds (FSDP, SPMD shardings) comes in through `hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .. import _paths
from .._support.errors import CheckpointError
from .._support.state import checkpointing_as_in_forward, recomputing
from .._support.tree import Flat, TensorMeta
from . import autocast as _autocast
from . import hooks as _hooks
from . import offload as _offload
from . import rng as _rng
from .barrier import barriered
from .module_tensors import ModuleTensors
from .options import CheckpointOptions


@dataclass(frozen=True)
class CheckpointCall:
    """One checkpointed call, described before it runs: what to run, whose parameters and
    buffers join the barrier, and with which options."""

    api: str
    function: Callable[..., Any]
    owners: ModuleTensors
    options: CheckpointOptions


@dataclass(frozen=True)
class ForwardRecord:
    """What the forward of a `CheckpointCall` left for its backward. Made by
    `record_forward()` only; it holds no activation, input or buffer tensor (those live in
    the engines' saved tensors, which autograd frees with the graph)."""

    call: CheckpointCall
    inputs: Flat  # the (args, kwargs) structure, tensor leaves as TensorMeta
    outputs: Flat  # the returned structure, tensor leaves as TensorMeta
    inputs_require_grad: tuple[bool, ...]
    rng: _rng.RngSnapshot | None
    autocast: _autocast.AutocastSnapshot
    path: _paths.ExecutionPath  # where the block ran
    hooks: tuple[tuple[_hooks.CheckpointHook, object], ...]  # each hook with its state

    @property
    def api(self) -> str:
        return self.call.api

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        """Call the function on the forward's arguments with `inputs` as their tensors."""
        args, kwargs = self.inputs.rebuild(inputs)
        return self.call.function(*args, **kwargs)

    def hook_state(self, hook: _hooks.CheckpointHook) -> object:
        """What `hook` recorded in this forward (None if it was not installed then)."""
        return next((state for h, state in self.hooks if h is hook), None)


def record_forward(
    call: CheckpointCall, inputs: Flat, running: AbstractContextManager[Any]
) -> tuple[ForwardRecord, Flat, tuple[torch.Tensor, ...]]:
    """Run `call` once on `inputs` inside the engine's `running` context, and record
    what its backward needs: generator and autocast state, the structure of inputs and
    outputs, and what each installed hook remembers about the outputs.

    Returns the record, the outputs (with their tensors), and copies of the owners' buffers as
    the forward read them, which the engine saves for backward beside the inputs. Raises if the
    call modified an input in place: the recomputation would start from the modified value.
    """
    tensors = inputs.tensors
    owners = call.owners
    # The forward may update buffers in place (BatchNorm statistics, EMAs, `.data` writes that
    # no version counter sees); the recomputation must read them as the forward did. On XLA the
    # copy shares the lazy value, and as a saved tensor it is freed with the graph: one still
    # alive when the step ends would be an output of the step's program.
    buffers = tuple(_buffer_copy(b) for b in owners.buffers)
    rng = None
    if call.options.preserve_rng_state:
        rng = _rng.capture([*tensors, *owners.params, *owners.buffers])
    autocast = _autocast.capture()
    versions = [t._version for t in tensors]
    with running:
        args, kwargs = inputs.rebuild(tensors)
        outputs = Flat.of(call.function(*args, **kwargs))
    _check_inputs_unchanged(call.api, tensors, versions)
    if rng is not None:
        _rng.refuse_unreplayable(call.api, rng)
    record = ForwardRecord(
        call=call,
        inputs=inputs.without_tensors(),
        outputs=outputs.without_tensors(),
        inputs_require_grad=tuple(t.requires_grad for t in tensors),
        rng=rng,
        autocast=autocast,
        path=_paths.path_of((*tensors, *owners.params, *outputs.tensors)),
        hooks=tuple((hook, hook.on_forward(outputs.tensors)) for hook in _hooks.installed()),
    )
    return record, outputs, buffers


def _buffer_copy(buffer: torch.Tensor) -> torch.Tensor:
    copy = buffer.detach().clone()
    setattr(copy, _BUFFER_COPY, True)
    return copy


_BUFFER_COPY = "_xla_wrap_buffer_copy"


def is_buffer_copy(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a checkpoint's copy of a module buffer as a forward read it."""
    return getattr(tensor, _BUFFER_COPY, False) is True


def save_for_recompute(
    ctx: Any,
    record: ForwardRecord,
    residuals: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    offload: Sequence[bool] = (),
) -> None:
    """Save, as `ctx`'s saved tensors, what a gate's backward recomputes from: the
    `residuals` (the block's inputs, then `offload`-flagged kept values), moved to host
    memory where the options or flags say so, and the `buffers` from `record_forward()`.
    Saved tensors, not attributes: autograd frees them with the graph, and an enclosing
    checkpoint swaps them for placeholders of its own."""
    wanted = [record.call.options.offload_to_cpu] * (len(residuals) - len(offload))
    wanted += [record.call.options.offload_to_cpu or flag for flag in offload]
    saved, ctx.offload_devices = _offload.to_host(residuals, wanted)
    ctx.save_for_backward(*saved, *buffers)


def saved_for_recompute(ctx: Any) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """What `save_for_recompute()` saved: the residuals, back on their devices, and the
    buffers. Reads `ctx.saved_tensors` once: under an enclosing checkpoint each read unpacks
    its placeholders."""
    everything = ctx.saved_tensors
    n_residuals = len(ctx.offload_devices)
    residuals = _offload.to_device(everything[:n_residuals], ctx.offload_devices)
    return residuals, everything[n_residuals:]


@dataclass(frozen=True)
class Barriered:
    """Detached copies, taken through one barrier, of what a recomputation reads."""

    inputs: list[torch.Tensor]
    kept: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]


def barrier_for_recompute(
    record: ForwardRecord,
    inputs: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    kept: Sequence[torch.Tensor] = (),
) -> Barriered:
    """Put the saved `inputs`, the values a save policy `kept`, the incoming `grads`, the
    owners' parameters and their saved `buffers` (as the forward read them, from
    `record_forward()`) through one barrier.

    Saved inputs, kept values and gradients are rewritten in place (their other readers then
    need no pre-barrier copy); parameters and buffers are copied (module state stays). Under
    SPMD, inputs that are program inputs (data, masks) are copied too: rewritten, they would
    come out of the step with another sharding and recompile the next one. The copies of inputs
    require grad as the forward's inputs did (a saved input brought back from the host does
    not), and those of parameters as the parameters do, so the recomputation builds the same
    graph.
    """
    params = record.call.owners.params
    n = [len(inputs), len(kept), len(grads), len(params), len(buffers)]
    copies = barriered(
        [*inputs, *kept, *grads, *params, *buffers],
        in_place=[_paths.device_path(t.device).rewritable(t) for t in inputs]
        + [True] * (n[1] + n[2])
        + [False] * (n[3] + n[4]),
    )
    groups: list[list[torch.Tensor]] = []
    for size in n:
        groups.append(copies[:size])
        copies = copies[size:]
    input_copies, kept_copies, grad_copies, param_copies, buffer_copies = groups
    for copy, requires_grad in zip(input_copies, record.inputs_require_grad, strict=True):
        copy.requires_grad_(requires_grad)
    for copy, param in zip(param_copies, params, strict=True):
        copy.requires_grad_(param.requires_grad)
    # The recomputation may update buffers in place (BatchNorm statistics); it gets its own
    # copies so the update happens once. On XLA the barrier output is already a new value.
    buffer_copies = [
        b if _paths.device_path(b.device).barriers else b.clone() for b in buffer_copies
    ]
    return Barriered(input_copies, kept_copies, grad_copies, param_copies, buffer_copies)


@contextmanager
def replaying(record: ForwardRecord, copies: Barriered) -> Iterator[None]:
    """Run the block as its forward ran: same generators and autocast settings, the barriered
    parameters and buffers in the modules' slots, gradients recorded, and
    [`xla_wrap.is_recomputing()`][xla_wrap.is_recomputing] true."""
    with ExitStack() as stack:
        stack.enter_context(recomputing())
        stack.enter_context(checkpointing_as_in_forward())
        for hook in _hooks.installed():
            stack.enter_context(hook.replaying())
        if record.rng is not None:
            stack.enter_context(_rng.replay(record.rng))
        stack.enter_context(_autocast.replay(record.autocast))
        stack.enter_context(record.call.owners.substituted(copies.params, copies.buffers))
        stack.enter_context(torch.enable_grad())
        yield


def gradients_arrived(
    record: ForwardRecord,
    positions: Sequence[int],
    grads: Sequence[torch.Tensor],
    recomputed: Sequence[torch.Tensor | None],
) -> None:
    """Hand each barriered gradient (of output tensor `positions[i]`) to the hooks before
    the block's backward reads it; `recomputed` are the matching recomputed outputs, or None
    where the engine has none."""
    for hook, state in record.hooks:
        for position, grad, output in zip(positions, grads, recomputed, strict=True):
            hook.on_gradient(state, position, grad, output)


def _check_inputs_unchanged(
    api: str, inputs: Sequence[torch.Tensor], versions: Sequence[int]
) -> None:
    """Refuse a callable that modified its inputs in place: the recomputation would start from
    the modified values and give wrong gradients without any error."""
    for index, (tensor, version) in enumerate(zip(inputs, versions, strict=True)):
        if tensor._version != version:
            raise CheckpointError(
                f"{api}: the checkpointed callable modified its input tensor {index} "
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
