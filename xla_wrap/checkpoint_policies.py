"""Save policies: which values of a checkpointed forward are kept for backward, and which are
recomputed. The names are JAX's (``jax.checkpoint_policies``), except ``offload_these_names``,
a shorthand of ours; ``dots_saveable`` also keeps convolutions, which PyTorch users count
among the expensive products.

A policy is called once per operation of the checkpointed forward that computes a
differentiable value (``linear``, ``matmul``, ``gelu``, ... as the block calls them through
``torch`` and ``torch.nn.functional``) and once per value tagged with
:func:`xla_wrap.checkpoint_name`. It receives an :class:`Op` and returns ``True`` (keep the
value in device memory), ``False`` (recompute it), or a :class:`Decision`. The values kept join
the checkpoint's inputs: in backward they go through the same optimization barrier and the
recomputation reads them instead of computing them, so on XLA the work that produced them is
not repeated. In-place operations and views are never kept: they cost nothing to recompute.

Pass a policy as ``policy=`` to :func:`xla_wrap.checkpoint`, :func:`xla_wrap.checkpoint_wrapper`
or :func:`xla_wrap.apply_activation_checkpointing`, either as a function from this module or by
its name (``policy="dots_saveable"``). docs/policies.md shows what each one costs.

Example:
    >>> import torch, xla_wrap
    >>> from xla_wrap import checkpoint_policies as cp
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    >>> y = xla_wrap.checkpoint(mlp, torch.randn(2, 4), policy=cp.dots_saveable)
    >>> y.sum().backward()  # recomputes the GELU only; both linear outputs were kept
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._support.errors import CheckpointTypeError, CheckpointValueError, describe

__all__ = [
    "DOT_FUNCTIONS",
    "Decision",
    "Op",
    "SavePolicy",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "offload_these_names",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_from_both_policies",
    "save_only_these_names",
]


class Decision(enum.Enum):
    """What to do with one value of the forward."""

    RECOMPUTE = "recompute"
    SAVE = "save"  # keep it in device memory
    OFFLOAD = "offload"  # keep it in host memory (docs/offload.md)


@dataclass(frozen=True)
class Op:
    """One value of a checkpointed forward, as a policy sees it.

    Attributes:
        function: The name of the torch function that computed it (``"linear"``, ``"matmul"``
            for ``a @ b``, ``"conv2d"``, ``"gelu"``), or ``"checkpoint_name"`` for a tagged value.
        name: The tag given with :func:`xla_wrap.checkpoint_name`; ``None`` for operations.
        shapes: The shape of each tensor the operation returned (empty inside
            ``torch.compile``, where a policy is asked before the operation runs).
        nbytes: Their total size in bytes (0 inside ``torch.compile``).
        input_shapes: The shape of each tensor the operation took, in order.
    """

    function: str
    name: str | None
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    input_shapes: tuple[tuple[int, ...], ...] = ()


SavePolicy = Callable[[Op], bool | Decision]

#: The functions whose outputs :func:`dots_saveable` keeps: matrix products and convolutions.
DOT_FUNCTIONS = frozenset(
    {
        "linear",
        "bilinear",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "addbmm",
        "baddbmm",
        "mv",
        "addmv",
        "dot",
        "einsum",
        "tensordot",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        # ATen's own names, as selective checkpointing inside torch.compile sees operations
        "convolution",
        "_convolution",
    }
)


def nothing_saveable(op: Op) -> bool:
    """Recompute everything: the block keeps only its inputs (the default)."""
    return False


def everything_saveable(op: Op) -> bool:
    """Keep everything: no recomputation, and no memory saved. Exactly a plain call."""
    return True


def dots_saveable(op: Op) -> bool:
    """Keep the outputs of matrix products and convolutions (:data:`DOT_FUNCTIONS`); recompute
    the cheap elementwise work around them (normalization, activations, softmax, Dropout)."""
    return op.function in DOT_FUNCTIONS


#: Matrix products without batch dimensions whatever their operands; ``matmul`` and ``einsum``
#: have batch dimensions when two operands have three or more dimensions.
_DOTS_WITHOUT_BATCH = frozenset({"linear", "mm", "addmm", "mv", "addmv", "dot", "tensordot"})
_DOTS_MAYBE_BATCHED = frozenset({"matmul", "einsum"})


def dots_with_no_batch_dims_saveable(op: Op) -> bool:
    """Keep the outputs of matrix products without batch dimensions (JAX's policy of the same
    name): a layer's ``linear`` and ``x @ w`` with a 2-D ``w``, but not attention's
    ``q @ k.T`` or ``bmm``, whose outputs grow with the sequence length squared. Convolutions
    are recomputed."""
    if op.function in _DOTS_WITHOUT_BATCH:
        return True
    if op.function in _DOTS_MAYBE_BATCHED:
        return sum(len(shape) >= 3 for shape in op.input_shapes) < 2
    return False


def offload_dot_with_no_batch_dims(
    offload_src: str = "device", offload_dst: str = "pinned_host"
) -> SavePolicy:
    """Keep in host memory what :func:`dots_with_no_batch_dims_saveable` keeps (JAX's policy
    of the same name; the memory kinds are JAX's, and the only ones there are here)."""
    api = "xla_wrap.checkpoint_policies.offload_dot_with_no_batch_dims"
    if offload_src != "device" or offload_dst not in ("pinned_host", "unpinned_host"):
        raise CheckpointValueError(
            f"{api}: expected offload_src='device' and offload_dst 'pinned_host' or "
            f"'unpinned_host', got {offload_src!r} and {offload_dst!r}. Values move from the "
            "device to host memory; pass the defaults."
        )
    return _OffloadDotsWithoutBatch()


@dataclass(frozen=True)
class _OffloadDotsWithoutBatch:
    def __call__(self, op: Op) -> Decision:
        return Decision.OFFLOAD if dots_with_no_batch_dims_saveable(op) else Decision.RECOMPUTE


def save_any_names_but_these(*names: str) -> SavePolicy:
    """Keep every value tagged with :func:`xla_wrap.checkpoint_name` except those tagged with
    one of ``names`` (JAX's policy of the same name)."""
    return _AllNamesBut(_names("save_any_names_but_these", names, allow_empty=True))


@dataclass(frozen=True)
class _AllNamesBut:
    excluded: frozenset[str]

    def __call__(self, op: Op) -> bool:
        return op.name is not None and op.name not in self.excluded


def save_only_these_names(*names: str) -> SavePolicy:
    """Keep exactly the values tagged with one of ``names`` by :func:`xla_wrap.checkpoint_name`."""
    return _Named(saved=_names("save_only_these_names", names))


def offload_these_names(*names: str) -> SavePolicy:
    """Keep the values tagged with one of ``names`` in host memory; recompute the rest. (Ours;
    JAX spells it with :func:`save_and_offload_only_these_names`.)"""
    return _Named(offloaded=_names("offload_these_names", names))


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: tuple[str, ...] | list[str] = (),
    names_which_can_be_offloaded: tuple[str, ...] | list[str] = (),
) -> SavePolicy:
    """JAX's policy of the same name: keep some tagged values on the device, some on the host,
    and recompute everything else."""
    api = "save_and_offload_only_these_names"
    saved = _names(api, tuple(names_which_can_be_saved), allow_empty=True)
    offloaded = _names(api, tuple(names_which_can_be_offloaded), allow_empty=True)
    both = saved & offloaded
    if both:
        raise CheckpointValueError(
            f"xla_wrap.checkpoint_policies.{api}: the names {sorted(both)} are both saved and "
            "offloaded; give each name to one list."
        )
    return _Named(saved=saved, offloaded=offloaded)


def save_from_both_policies(policy_1: SavePolicy, policy_2: SavePolicy) -> SavePolicy:
    """Keep what either policy keeps; on the device if either keeps it there."""
    return _Both(
        resolve("save_from_both_policies", policy_1), resolve("save_from_both_policies", policy_2)
    )


@dataclass(frozen=True)
class _Named:
    """Policies by name. Equal arguments make equal policies, so wrapping a module again with
    the same policy is recognised as the same options."""

    saved: frozenset[str] = frozenset()
    offloaded: frozenset[str] = frozenset()

    def __call__(self, op: Op) -> Decision:
        if op.name in self.saved:
            return Decision.SAVE
        if op.name in self.offloaded:
            return Decision.OFFLOAD
        return Decision.RECOMPUTE


@dataclass(frozen=True)
class _Both:
    first: SavePolicy
    second: SavePolicy

    def __call__(self, op: Op) -> Decision:
        decisions = {decide(self.first, op), decide(self.second, op)}
        for decision in (Decision.SAVE, Decision.OFFLOAD):
            if decision in decisions:
                return decision
        return Decision.RECOMPUTE


def resolve(api: str, policy: object) -> SavePolicy:
    """``policy`` as a callable: a policy of this module by name, or any callable."""
    if isinstance(policy, str):
        found = _BY_NAME.get(policy)
        if found is None:
            close = difflib.get_close_matches(policy, _BY_NAME, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise CheckpointValueError(
                f"{api}: unknown policy name {policy!r}; the names are {sorted(_BY_NAME)}.{hint} "
                "Policies that take arguments (save_only_these_names, ...) are passed as "
                "functions: `policy=checkpoint_policies.save_only_these_names('attn')`."
            )
        return found
    if not callable(policy):
        raise CheckpointTypeError(
            f"{api}: expected a policy (a function of xla_wrap.checkpoint_policies, its name, or "
            f"a callable taking an Op), got {describe(policy)}."
        )
    return policy


def decide(policy: SavePolicy, op: Op) -> Decision:
    """Call ``policy`` on ``op`` and check what it answered."""
    answer = policy(op)
    if isinstance(answer, Decision):
        return answer
    if isinstance(answer, bool):
        return Decision.SAVE if answer else Decision.RECOMPUTE
    name = getattr(policy, "__qualname__", None) or repr(policy)
    raise CheckpointTypeError(
        f"xla_wrap.checkpoint_policies: the policy {name} returned {describe(answer)} for "
        f"{op}; a policy returns True (keep), False (recompute) or a Decision."
    )


def _names(api: str, names: tuple[object, ...], *, allow_empty: bool = False) -> frozenset[str]:
    if not names and not allow_empty:
        raise CheckpointValueError(
            f"xla_wrap.checkpoint_policies.{api}: expected at least one name, got none. Pass "
            f"the names given to xla_wrap.checkpoint_name: `{api}('attn_out')`."
        )
    for name in names:
        if not isinstance(name, str):
            raise CheckpointTypeError(
                f"xla_wrap.checkpoint_policies.{api}: expected names as strings, got "
                f"{describe(name)}. Pass the names given to xla_wrap.checkpoint_name."
            )
    return frozenset(names)  # type: ignore[arg-type]


_BY_NAME: dict[str, SavePolicy] = {
    "nothing_saveable": nothing_saveable,
    "everything_saveable": everything_saveable,
    "dots_saveable": dots_saveable,
    "dots_with_no_batch_dims_saveable": dots_with_no_batch_dims_saveable,
}


def to_constants(policy: SavePolicy) -> Any:
    """``policy`` as a tree of constants (its function, or the names it keeps), which Dynamo can
    hold in a compiled graph; :func:`from_constants` makes the policy again."""
    if isinstance(policy, _Named):
        return ("names", tuple(sorted(policy.saved)), tuple(sorted(policy.offloaded)))
    if isinstance(policy, _Both):
        return ("both", to_constants(policy.first), to_constants(policy.second))
    if isinstance(policy, _AllNamesBut):
        return ("all_but", tuple(sorted(policy.excluded)))
    if isinstance(policy, _OffloadDotsWithoutBatch):
        return ("offload_dots",)
    return ("function", policy)


def from_constants(spec: Any) -> SavePolicy:
    """The policy :func:`to_constants` described."""
    if spec[0] == "names":
        return _Named(saved=frozenset(spec[1]), offloaded=frozenset(spec[2]))
    if spec[0] == "both":
        return _Both(from_constants(spec[1]), from_constants(spec[2]))
    if spec[0] == "all_but":
        return _AllNamesBut(frozenset(spec[1]))
    if spec[0] == "offload_dots":
        return _OffloadDotsWithoutBatch()
    policy: SavePolicy = spec[1]
    return policy
