"""Checkpointing inside `torch.compile`: the compiler's own checkpoint, with our policies.

Under `torch.compile` there is no step to replay and no barrier to place by hand: Dynamo
turns `torch.utils.checkpoint.checkpoint` into the checkpoint higher-order op, AOTAutograd
tags the region's nodes for recomputation (`node.meta["recompute"]`), the partitioner
recomputes them in the backward graph, and a backend that needs barriers (TorchTPU) places
them by those tags. xla_wrap's own engine captures random generator states and runs autograd
Functions that Dynamo cannot trace, so while Dynamo traces, every xla_wrap checkpoint becomes
that op instead; the random numbers are then the compiler's business (it keeps the forward's
masks for the recomputation).

Save policies become selective checkpointing (`create_selective_checkpoint_contexts`): the
policy is asked for every ATen operation of the region, as the compiler sees it (`mm`,
`addmm`, `bmm`, `convolution`; `linear` and `matmul` where a backend keeps them
whole), and for each value tagged with [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name],
which inside a compiled region is an operation of its own (`xla_wrap::checkpoint_name`) so that
a policy can find it by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import _pytree as pytree

from ... import checkpoint_policies as cp
from ..._layouts import TORCH_CHECKPOINT_KEYWORDS
from ..._support.errors import CheckpointValueError
from ..._support.warn import warn_once
from .frames import refuse

_NAME_OP = "xla_wrap::checkpoint_name"


def checkpoint(
    api: str,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    policy: cp.SavePolicy | None,
    offload_to_cpu: bool,
) -> Any:
    """`function(*args, **kwargs)` as the compiler's checkpoint, with the save `policy`.
    xla_wrap has one engine; under the compiler it is this op."""
    if offload_to_cpu:
        refuse(
            CheckpointValueError,
            f"{api}: offload_to_cpu=True is not supported inside torch.compile: the compiler "
            "decides where saved values live. Drop offload_to_cpu for the compiled model, or "
            "use an offload policy (offload_these_names) on a torch with "
            "CheckpointPolicy.MUST_CPU_OFFLOAD.",
        )
    if any(k in TORCH_CHECKPOINT_KEYWORDS for k in kwargs):  # the function's, not torch's
        function, kwargs = functools.partial(function, **kwargs), {}
    if policy is not None and policy is not cp.nothing_saveable:
        kwargs = {**kwargs, "context_fn": _context_fn(api, policy)}
    return torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        **kwargs,
    )


def _context_fn(api: str, policy: cp.SavePolicy) -> Callable[[], Any]:
    """Selective checkpointing's contexts for `policy`, as a partial of constants: Dynamo
    takes the context function of a checkpoint only as a function or a partial it can hold
    as a constant, and a policy object made in the compiled code is neither."""
    return functools.partial(_contexts, api, cp.to_constants(policy))


def _contexts(api: str, spec: Any) -> Any:
    return torch_checkpoint.create_selective_checkpoint_contexts(
        _Policy(api, cp.from_constants(spec))
    )


@dataclass(frozen=True)
class _Policy:
    """A save policy as selective checkpointing asks it: per ATen operation, before it runs
    (so [`Op`][xla_wrap.checkpoint_policies.Op] carries no output shapes there)."""

    api: str
    policy: cp.SavePolicy

    def __call__(
        self, ctx: Any, func: Any, *args: Any, **kwargs: Any
    ) -> torch_checkpoint.CheckpointPolicy:
        if func is _NAME:
            op = cp.Op(function="checkpoint_name", name=args[1], shapes=(), nbytes=0)
        else:
            inputs = pytree.tree_leaves((args, kwargs))
            shapes = tuple(tuple(i.shape) for i in inputs if isinstance(i, torch.Tensor))
            op = cp.Op(_aten_name(func), None, shapes=(), nbytes=0, input_shapes=shapes)
        decision = cp.decide(self.policy, op)
        if decision is cp.Decision.SAVE:
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        if decision is cp.Decision.OFFLOAD:
            offload = getattr(torch_checkpoint.CheckpointPolicy, "MUST_CPU_OFFLOAD", None)
            if offload is not None:
                return offload
            # Raising here, inside AOTAutograd's trace of the checkpoint, would leave torch's
            # checkpoint hooks installed for whatever runs next; kept on the device instead,
            # as XLA:CPU keeps offloaded values.
            _warn_offload_kept(self.api)
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _warn_offload_kept(api: str) -> None:
    warn_once(
        ("offload kept in compile", api),
        f"{api}: the policy offloads values, which inside torch.compile needs "
        f"CheckpointPolicy.MUST_CPU_OFFLOAD; torch {torch.__version__} has none, so they stay "
        "in device memory (saved, not recomputed). Use a newer torch to offload, or a policy "
        "that saves less to save memory.",
        stacklevel=2,
    )


def _aten_name(func: Any) -> str:
    """`aten.addmm.default` -> `"addmm"`, as
    [`checkpoint_policies.DOT_FUNCTIONS`][xla_wrap.checkpoint_policies.DOT_FUNCTIONS] names
    it."""
    packet = getattr(func, "overloadpacket", func)
    return str(getattr(packet, "__name__", func)).rpartition(".")[2]


@torch.library.custom_op(_NAME_OP, mutates_args=())
def _checkpoint_name(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """[`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name] inside a compiled region: an
    operation of its own, which a policy finds by name. It copies the value (a custom
    operation may not alias its input)."""
    return tensor.clone()


@_checkpoint_name.register_fake
def _(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


def _name_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_checkpoint_name.register_autograd(_name_backward)
_NAME = torch.ops.xla_wrap.checkpoint_name.default


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """`tensor` tagged with `name` inside a compiled region."""
    result: torch.Tensor = _checkpoint_name(tensor, name)
    return result
