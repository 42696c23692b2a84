"""Save policies: which values of a checkpointed forward are kept for backward, and which are
recomputed. The names are JAX's (`jax.checkpoint_policies`), except `offload_these_names`,
a shorthand of ours; `dots_saveable` also keeps convolutions, which PyTorch users count
among the expensive products.

A policy is called once per operation of the checkpointed forward that computes a
differentiable value (`linear`, `matmul`, `gelu`, ... as the block calls them through
`torch` and `torch.nn.functional`) and once per value tagged with
[`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name]. It receives an
[`Op`][xla_wrap.checkpoint_policies.Op] and returns `True` (keep the value in device memory),
`False` (recompute it), or a [`Decision`][xla_wrap.checkpoint_policies.Decision]. The values
kept join the checkpoint's inputs: in backward they go through the same optimization barrier
and the recomputation reads them instead of computing them, so on XLA the work that produced
them is not repeated. In-place operations and views are never kept: they cost nothing to
recompute.

Pass a policy as `policy=` to [`xla_wrap.checkpoint()`][xla_wrap.checkpoint],
[`xla_wrap.checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] or
[`xla_wrap.apply_activation_checkpointing()`][xla_wrap.apply_activation_checkpointing], either
as a function from this module or, for the four policies that take no arguments
(`nothing_saveable`, `everything_saveable`, `dots_saveable`,
`dots_with_no_batch_dims_saveable`), by its name (`policy="dots_saveable"`). docs/policies.md
shows what each one costs.

Examples:
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

from ._support.checks import check_record, is_function
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
    """What to do with one value of the forward.

    A policy's answer where `True` (keep) and `False` (recompute) do not say enough.

    Examples:
        >>> from xla_wrap.checkpoint_policies import Decision, Op
        >>> def offload_attention(op: Op) -> Decision:
        ...     return Decision.OFFLOAD if op.name == "attn" else Decision.RECOMPUTE
    """

    RECOMPUTE = "recompute"
    """Recompute the value in backward (what a policy's `False` means)."""
    SAVE = "save"
    """Keep the value in device memory until backward (what a policy's `True` means)."""
    OFFLOAD = "offload"
    """Keep the value in host memory until backward (docs/offload.md)."""


@dataclass(frozen=True)
class Op:
    """One value of a checkpointed forward, as a policy sees it.

    Attributes:
        function: The name of the torch function that computed it (`"linear"`, `"matmul"`
            for `a @ b`, `"conv2d"`, `"gelu"`), or `"checkpoint_name"` for a tagged value.
        name: The tag given with [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name];
            `None` for operations.
        shapes: The shape of each tensor the operation returned (empty inside
            `torch.compile`, where a policy is asked before the operation runs).
        nbytes: Their total size in bytes (0 inside `torch.compile`).
        input_shapes: The shape of each tensor the operation took, in order.
    """

    function: str
    name: str | None
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    input_shapes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # One is made per operation a save policy sees: exact types pass at a third of the
        # cost of the general check, which decides (and words the refusal) for the rest.
        if not _plain(self):
            check_record("xla_wrap.checkpoint_policies.Op", self)


def _plain(op: Op) -> bool:
    return (
        type(op.function) is str
        and (op.name is None or type(op.name) is str)
        and type(op.nbytes) is int
        and _plain_shapes(op.shapes)
        and _plain_shapes(op.input_shapes)
    )


def _plain_shapes(shapes: object) -> bool:
    if type(shapes) is not tuple:
        return False
    for shape in shapes:  # loops, not all(): generators cost more than the check
        if type(shape) is not tuple:
            return False
        for size in shape:
            if type(size) is not int:
                return False
    return True


SavePolicy = Callable[[Op], bool | Decision]
"""The type of a save policy: a callable that takes an [`Op`][xla_wrap.checkpoint_policies.Op]
and returns `True` (keep the value on the device), `False` (recompute it) or a
[`Decision`][xla_wrap.checkpoint_policies.Decision]."""

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
"""The functions whose outputs [`dots_saveable()`][xla_wrap.checkpoint_policies.dots_saveable]
keeps: matrix products and convolutions, by the names a policy sees in
[`Op.function`][xla_wrap.checkpoint_policies.Op]."""


def nothing_saveable(op: Op) -> bool:
    """Recompute everything: the block keeps only its inputs (the default).

    Args:
        op: The value asked about (not looked at).

    Returns:
        `False`, for every value.
    """
    return False


def everything_saveable(op: Op) -> bool:
    """Keep everything: no recomputation, and no memory saved. Exactly a plain call.

    Args:
        op: The value asked about (not looked at).

    Returns:
        `True`, for every value.
    """
    return True


def dots_saveable(op: Op) -> bool:
    """Keep the outputs of matrix products and convolutions; recompute the rest.

    The products and convolutions are those of
    [`DOT_FUNCTIONS`][xla_wrap.checkpoint_policies.DOT_FUNCTIONS]; what is recomputed is the
    cheap elementwise work around them (normalization, activations, softmax, Dropout).

    Args:
        op: The value asked about.

    Returns:
        Whether `op.function` is one of `DOT_FUNCTIONS` (tagged values are recomputed).

    Examples:
        >>> from xla_wrap.checkpoint_policies import Op, dots_saveable
        >>> dots_saveable(Op("linear", None, ((2, 8),), 64))
        True
        >>> dots_saveable(Op("gelu", None, ((2, 8),), 64))
        False
    """
    return op.function in DOT_FUNCTIONS


# Matrix products without batch dimensions whatever their operands; `matmul` and `einsum`
# have batch dimensions when two operands have three or more dimensions.
_DOTS_WITHOUT_BATCH = frozenset({"linear", "mm", "addmm", "mv", "addmv", "dot", "tensordot"})
_DOTS_MAYBE_BATCHED = frozenset({"matmul", "einsum"})


def dots_with_no_batch_dims_saveable(op: Op) -> bool:
    """Keep the outputs of matrix products without batch dimensions.

    JAX's policy of the same name: a layer's `linear` and `x @ w` with a 2-D `w`, but not
    attention's `q @ k.T` or `bmm`, whose outputs grow with the sequence length squared.
    Convolutions are recomputed.

    Args:
        op: The value asked about; for `matmul` and `einsum` its `input_shapes` decide.

    Returns:
        Whether `op` is the output of a matrix product without batch dimensions: `linear`,
        `mm`, `addmm`, `mv`, `addmv`, `dot` and `tensordot` always, `matmul` and `einsum`
        when at most one operand has three or more dimensions.

    Examples:
        >>> from xla_wrap.checkpoint_policies import Op, dots_with_no_batch_dims_saveable
        >>> x_w = Op("matmul", None, ((2, 16, 8),), 1024, input_shapes=((2, 16, 4), (4, 8)))
        >>> q_k = Op("matmul", None, ((2, 16, 16),), 2048, input_shapes=((2, 16, 4), (2, 4, 16)))
        >>> dots_with_no_batch_dims_saveable(x_w), dots_with_no_batch_dims_saveable(q_k)
        (True, False)
    """
    if op.function in _DOTS_WITHOUT_BATCH:
        return True
    if op.function in _DOTS_MAYBE_BATCHED:
        return sum(len(shape) >= 3 for shape in op.input_shapes) < 2
    return False


def offload_dot_with_no_batch_dims(
    offload_src: str = "device", offload_dst: str = "pinned_host"
) -> SavePolicy:
    """Keep in host memory the outputs of matrix products without batch dimensions.

    What
    [`dots_with_no_batch_dims_saveable()`][xla_wrap.checkpoint_policies.dots_with_no_batch_dims_saveable]
    keeps goes to host memory, and the rest is recomputed (JAX's policy of the same name; the
    memory kinds are JAX's, and the only ones there are here).

    Args:
        offload_src: Where the values are: `"device"`, the only value accepted.
        offload_dst: Where they go: `"pinned_host"`, the only value accepted (JAX's other
            kind, `"unpinned_host"`, has no counterpart here: xla_wrap keeps offloaded values
            in pinned memory on CUDA and in host memory on XLA, docs/offload.md).

    Returns:
        The policy, which answers `Decision.OFFLOAD` or `Decision.RECOMPUTE`.

    Raises:
        CheckpointValueError: If `offload_src` is not `"device"` or `offload_dst` is not
            `"pinned_host"`.
    """
    api = "xla_wrap.checkpoint_policies.offload_dot_with_no_batch_dims"
    if offload_src != "device" or offload_dst != "pinned_host":
        raise CheckpointValueError(
            f"{api}: expected offload_src='device' and offload_dst='pinned_host', got "
            f"{offload_src!r} and {offload_dst!r}. Values move from the device to host memory "
            "(pinned where the backend has it); pass the defaults."
        )
    return _OffloadDotsWithoutBatch()


@dataclass(frozen=True)
class _OffloadDotsWithoutBatch:
    def __call__(self, op: Op) -> Decision:
        return Decision.OFFLOAD if dots_with_no_batch_dims_saveable(op) else Decision.RECOMPUTE


def save_any_names_but_these(*names: str) -> SavePolicy:
    """Keep every tagged value except those tagged with one of `names`.

    Tags are given with [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name]; untagged
    values are recomputed (JAX's policy of the same name).

    Args:
        *names: The tags whose values are recomputed; none keeps every tagged value.

    Returns:
        The policy, which answers `True` or `False`.

    Raises:
        CheckpointTypeError: If a name is not a string.

    Examples:
        >>> from xla_wrap.checkpoint_policies import Op, save_any_names_but_these
        >>> policy = save_any_names_but_these("mlp_hidden")
        >>> policy(Op("checkpoint_name", "attn_out", ((2, 8),), 64))
        True
        >>> policy(Op("checkpoint_name", "mlp_hidden", ((2, 32),), 256))
        False
    """
    return _AllNamesBut(_names("save_any_names_but_these", names, allow_empty=True))


@dataclass(frozen=True)
class _AllNamesBut:
    excluded: frozenset[str]

    def __call__(self, op: Op) -> bool:
        return op.name is not None and op.name not in self.excluded


def save_only_these_names(*names: str) -> SavePolicy:
    """Keep exactly the values tagged with one of `names`, in device memory.

    Tags are given with [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name]; everything else
    is recomputed.

    Args:
        *names: The tags to keep; at least one.

    Returns:
        The policy, which answers `Decision.SAVE` or `Decision.RECOMPUTE`.

    Raises:
        CheckpointValueError: If no name is given.
        CheckpointTypeError: If a name is not a string.

    Examples:
        >>> from xla_wrap.checkpoint_policies import Op, save_only_these_names
        >>> policy = save_only_these_names("attn_out")
        >>> policy(Op("checkpoint_name", "attn_out", ((2, 8),), 64))
        <Decision.SAVE: 'save'>
        >>> policy(Op("linear", None, ((2, 8),), 64))
        <Decision.RECOMPUTE: 'recompute'>
    """
    return _Named(saved=_names("save_only_these_names", names))


def offload_these_names(*names: str) -> SavePolicy:
    """Keep the values tagged with one of `names` in host memory; recompute the rest.

    Ours; JAX spells it with
    [`save_and_offload_only_these_names()`][xla_wrap.checkpoint_policies.save_and_offload_only_these_names].

    Args:
        *names: The tags given with [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name]
            whose values go to host memory; at least one.

    Returns:
        The policy, which answers `Decision.OFFLOAD` or `Decision.RECOMPUTE`.

    Raises:
        CheckpointValueError: If no name is given.
        CheckpointTypeError: If a name is not a string.
    """
    return _Named(offloaded=_names("offload_these_names", names))


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: tuple[str, ...] | list[str] = (),
    names_which_can_be_offloaded: tuple[str, ...] | list[str] = (),
) -> SavePolicy:
    """Keep some tagged values on the device, some on the host, and recompute the rest.

    JAX's policy of the same name.

    Args:
        names_which_can_be_saved: The tags (given with
            [`xla_wrap.checkpoint_name()`][xla_wrap.checkpoint_name]) whose values are kept
            in device memory.
        names_which_can_be_offloaded: The tags whose values are kept in host memory.

    Returns:
        The policy, which answers `Decision.SAVE`, `Decision.OFFLOAD` or
        `Decision.RECOMPUTE`.

    Raises:
        CheckpointValueError: If a name is in both lists.
        CheckpointTypeError: If a name is not a string.

    Examples:
        >>> from xla_wrap.checkpoint_policies import Op, save_and_offload_only_these_names
        >>> policy = save_and_offload_only_these_names(
        ...     names_which_can_be_saved=["qkv"], names_which_can_be_offloaded=["mlp_hidden"]
        ... )
        >>> policy(Op("checkpoint_name", "mlp_hidden", ((2, 32),), 256))
        <Decision.OFFLOAD: 'offload'>
    """
    api = "save_and_offload_only_these_names"
    saved = _names(
        api, _name_list(api, "names_which_can_be_saved", names_which_can_be_saved), allow_empty=True
    )
    offloaded = _names(
        api,
        _name_list(api, "names_which_can_be_offloaded", names_which_can_be_offloaded),
        allow_empty=True,
    )
    both = saved & offloaded
    if both:
        raise CheckpointValueError(
            f"xla_wrap.checkpoint_policies.{api}: the names {sorted(both)} are both saved and "
            "offloaded; give each name to one list."
        )
    return _Named(saved=saved, offloaded=offloaded)


def save_from_both_policies(policy_1: SavePolicy, policy_2: SavePolicy) -> SavePolicy:
    """Keep what either policy keeps; on the device if either keeps it there.

    Args:
        policy_1: A save policy: a function of this module, its name, or any callable taking
            an [`Op`][xla_wrap.checkpoint_policies.Op].
        policy_2: Another, in the same forms.

    Returns:
        The policy, which answers `Decision.SAVE` if either policy saves the value, else
        `Decision.OFFLOAD` if either offloads it, else `Decision.RECOMPUTE`.

    Raises:
        CheckpointValueError: If a policy is given by an unknown name.
        CheckpointTypeError: If a policy is neither a name nor callable.

    Examples:
        >>> from xla_wrap import checkpoint_policies as cp
        >>> policy = cp.save_from_both_policies(cp.dots_saveable, cp.offload_these_names("h"))
        >>> policy(cp.Op("linear", None, ((2, 8),), 64))
        <Decision.SAVE: 'save'>
        >>> policy(cp.Op("checkpoint_name", "h", ((2, 8),), 64))
        <Decision.OFFLOAD: 'offload'>
    """
    api = "xla_wrap.checkpoint_policies.save_from_both_policies"
    return _Both(resolve(api, policy_1), resolve(api, policy_2))


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
    """`policy` as a callable: a policy of this module by name, or any callable."""
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
    if not is_function(policy):
        raise CheckpointTypeError(
            f"{api}: expected a policy (a function of xla_wrap.checkpoint_policies, its name, or "
            f"a callable taking an Op), got {describe(policy)}."
        )
    return policy


def decide(policy: SavePolicy, op: Op) -> Decision:
    """Call `policy` on `op` and check what it answered."""
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


def _name_list(api: str, argument: str, names: object) -> tuple[object, ...]:
    """`names` as a tuple, if it is a list, tuple or set of them. A lone string would split into
    its letters, so it is refused."""
    if not isinstance(names, (list, tuple, set, frozenset)):
        raise CheckpointTypeError(
            f"xla_wrap.checkpoint_policies.{api}: expected a list of names as `{argument}`, got "
            f"{describe(names)}. Pass a list, even of one name: `{argument}=['attn_out']`."
        )
    return tuple(names)


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
    """`policy` as a tree of constants (its function, or the names it keeps), which Dynamo can
    hold in a compiled graph; `from_constants()` makes the policy again."""
    if isinstance(policy, _Named):
        return ("names", tuple(sorted(policy.saved)), tuple(sorted(policy.offloaded)))
    if isinstance(policy, _Both):
        return ("both", to_constants(policy.first), to_constants(policy.second))
    if isinstance(policy, _AllNamesBut):
        return ("all_but", tuple(sorted(policy.excluded)))
    if isinstance(policy, _OffloadDotsWithoutBatch):
        return ("offload_dots",)
    for name, named in _BY_NAME.items():
        if policy is named:
            return ("named", name)
    return ("function", policy)  # a user's function: not a constant, but Dynamo can hold it


def from_constants(spec: Any) -> SavePolicy:
    """The policy `to_constants()` described."""
    if spec[0] == "names":
        return _Named(saved=frozenset(spec[1]), offloaded=frozenset(spec[2]))
    if spec[0] == "both":
        return _Both(from_constants(spec[1]), from_constants(spec[2]))
    if spec[0] == "all_but":
        return _AllNamesBut(frozenset(spec[1]))
    if spec[0] == "offload_dots":
        return _OffloadDotsWithoutBatch()
    if spec[0] == "named":
        return _BY_NAME[spec[1]]
    policy: SavePolicy = spec[1]
    return policy
