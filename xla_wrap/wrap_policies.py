"""Wrap policies: which submodules of a model to checkpoint (or shard).

A wrap policy is a small named rule that selects submodules of a model, combinable with `&`
and `|`. It chooses *modules*; a save policy
([`xla_wrap.checkpoint_policies`][xla_wrap.checkpoint_policies]) chooses which *values* inside
a checkpointed module to keep. Give one to
[`xla_wrap.apply_activation_checkpointing()`][xla_wrap.apply_activation_checkpointing] in place
of `check_fn`.

Every policy resolves against a whole model at once
([`WrapPolicy.select()`][xla_wrap.wrap_policies.WrapPolicy.select]), which is what lets it
count (every n-th block) and see qualified names, neither of which a per-module callback can
do.

Examples:
    >>> import torch, xla_wrap
    >>> from xla_wrap import wrap_policies as wp
    >>> model = torch.nn.TransformerEncoder(
    ...     torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16), num_layers=4,
    ...     enable_nested_tensor=False,
    ... )
    >>> policy = wp.every_nth(wp.by_type(torch.nn.TransformerEncoderLayer), 2)
    >>> model = xla_wrap.apply_activation_checkpointing(model, policy)
    >>> [isinstance(layer, xla_wrap.CheckpointWrapper) for layer in model.layers]
    [True, False, True, False]
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ._support.checks import is_function, is_int
from ._support.errors import CheckpointTypeError, CheckpointValueError, describe

__all__ = [
    "Policy",
    "WrapPolicy",
    "by_name",
    "by_param_count",
    "by_predicate",
    "by_type",
    "every_nth",
]

Named = tuple[str, nn.Module]


class WrapPolicy:
    """Selects submodules of a model. Combine policies with `&` (both) and `|` (either).

    Made by the functions of this module (`by_type`, `by_name`, ...), not directly.

    Examples:
        >>> from torch import nn
        >>> from xla_wrap import wrap_policies as wp
        >>> model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> policy = wp.by_type(nn.Linear) & wp.by_param_count(100)
        >>> [name for name, _ in policy.select(model)]
        ['0', '2']
    """

    def select(self, model: nn.Module) -> list[Named]:
        """The selected modules of `model`, with their qualified names.

        They come in `named_modules` order, each module once (under its first name). The model
        itself is named `""` and may be selected: APIs that cannot wrap it in place refuse it.

        Args:
            model: The model to select from.

        Returns:
            `(qualified name, module)` pairs, one per selected module.
        """
        return [
            (name, module) for name, module in model.named_modules() if self.accepts(name, module)
        ]

    def accepts(self, name: str, module: nn.Module) -> bool:
        """Whether this policy, on its own, selects `module` found under `name`.

        Args:
            name: The module's qualified name in the model (`"layers.3.mlp"`; `""` for the
                model itself).
            module: The module.

        Returns:
            Whether the module is selected.

        Raises:
            CheckpointValueError: For a policy made by `every_nth` (or combining one), whose
                choice depends on the other modules: use `select()`.
        """
        raise NotImplementedError

    def __and__(self, other: WrapPolicy) -> WrapPolicy:
        return _Combined(self, _checked(other, "&"), both=True)

    def __or__(self, other: WrapPolicy) -> WrapPolicy:
        return _Combined(self, _checked(other, "|"), both=False)


Policy = WrapPolicy
"""The former name of [`WrapPolicy`][xla_wrap.wrap_policies.WrapPolicy], from before wrap
policies and save policies were told apart; the same class."""


@dataclass(frozen=True)
class _ByType(WrapPolicy):
    types: tuple[type, ...]

    def accepts(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, self.types)

    def __repr__(self) -> str:
        return f"by_type({', '.join(t.__name__ for t in self.types)})"


@dataclass(frozen=True)
class _ByParamCount(WrapPolicy):
    minimum: int
    maximum: int | None

    def accepts(self, name: str, module: nn.Module) -> bool:
        count = sum(p.numel() for p in module.parameters())
        return count >= self.minimum and (self.maximum is None or count <= self.maximum)

    def __repr__(self) -> str:
        return f"by_param_count(min={self.minimum}, max={self.maximum})"


@dataclass(frozen=True)
class _ByName(WrapPolicy):
    patterns: tuple[str, ...]

    def accepts(self, name: str, module: nn.Module) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)

    def __repr__(self) -> str:
        return f"by_name({', '.join(map(repr, self.patterns))})"


@dataclass(frozen=True)
class _ByPredicate(WrapPolicy):
    predicate: Callable[[nn.Module], bool]

    def accepts(self, name: str, module: nn.Module) -> bool:
        return bool(self.predicate(module))

    def __repr__(self) -> str:
        return f"by_predicate({getattr(self.predicate, '__name__', self.predicate)!r})"


@dataclass(frozen=True)
class _EveryNth(WrapPolicy):
    inner: WrapPolicy
    n: int
    offset: int

    def select(self, model: nn.Module) -> list[Named]:
        return self.inner.select(model)[self.offset :: self.n]

    def accepts(self, name: str, module: nn.Module) -> bool:
        raise CheckpointValueError(
            "xla_wrap.wrap_policies.every_nth: a position among matches has no meaning for one "
            "module; resolve it against a model with `policy.select(model)`."
        )

    def __repr__(self) -> str:
        return f"every_nth({self.inner!r}, {self.n}, offset={self.offset})"


@dataclass(frozen=True)
class _Combined(WrapPolicy):
    """`left & right` (`both`) or `left | right`."""

    left: WrapPolicy
    right: WrapPolicy
    both: bool

    def select(self, model: nn.Module) -> list[Named]:
        left = self.left.select(model)
        right = {id(m) for _, m in self.right.select(model)}
        if self.both:
            return [(n, m) for n, m in left if id(m) in right]
        chosen = right | {id(m) for _, m in left}
        return [(n, m) for n, m in model.named_modules() if id(m) in chosen]

    def accepts(self, name: str, module: nn.Module) -> bool:
        left, right = self.left.accepts(name, module), self.right.accepts(name, module)
        return (left and right) if self.both else (left or right)

    def __repr__(self) -> str:
        return f"({self.left!r} {'&' if self.both else '|'} {self.right!r})"


def by_type(*types: type | Iterable[type]) -> WrapPolicy:
    """Select modules that are instances of any of `types` (the transformer-layer rule).

    Args:
        *types: Module classes, or sets, lists or tuples of them (`by_type({Block, Other})`);
            at least one class in all.

    Returns:
        The policy.

    Raises:
        CheckpointTypeError: If an item is not a class.
        CheckpointValueError: If no class is given.

    Examples:
        >>> from torch import nn
        >>> from xla_wrap import wrap_policies
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> [name for name, _ in wrap_policies.by_type(nn.Linear).select(model)]
        ['0']
    """
    flat: list[object] = []
    for given in types:
        flat.extend(given if isinstance(given, (set, frozenset, list, tuple)) else [given])
    classes: list[type] = []
    for item in flat:
        if not isinstance(item, type):
            raise CheckpointTypeError(
                f"xla_wrap.wrap_policies.by_type: expected module classes, got {describe(item)}. "
                "Pass classes such as `by_type(MyBlock)` or `by_type({MyBlock, OtherBlock})`."
            )
        classes.append(item)
    if not classes:
        raise CheckpointValueError(
            "xla_wrap.wrap_policies.by_type: expected at least one module class, got none."
        )
    return _ByType(tuple(classes))


def by_param_count(min_params: int, max_params: int | None = None) -> WrapPolicy:
    """Select modules holding at least `min_params` parameters (at most `max_params`).

    Their submodules' parameters count too: the size rule of FSDP's size-based policy.

    Parameters are counted by elements (`numel`), both bounds inclusive. The model itself
    usually qualifies too; combine with another policy (`by_type(Block) & by_param_count(n)`)
    or bound it with `max_params`.

    Args:
        min_params: The fewest parameter elements a selected module holds.
        max_params: The most it holds; `None` (the default) for no upper bound.

    Returns:
        The policy.

    Raises:
        CheckpointTypeError: If a bound is not an int.
        CheckpointValueError: If a bound is negative.

    Examples:
        >>> from torch import nn
        >>> from xla_wrap import wrap_policies as wp
        >>> model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> [name for name, _ in wp.by_param_count(100, max_params=300).select(model)]
        ['0', '2']
    """
    # Only the upper bound may be absent: a None minimum would fail later, inside select().
    bounds = {"min_params": min_params}
    if max_params is not None:
        bounds["max_params"] = max_params
    for label, value in bounds.items():
        if not is_int(value):
            raise CheckpointTypeError(
                "xla_wrap.wrap_policies.by_param_count: expected an int as "
                f"`{label}`, got {describe(value)}."
            )
        if value < 0:
            raise CheckpointValueError(
                "xla_wrap.wrap_policies.by_param_count: expected a non-negative int as "
                f"`{label}`, got {describe(value)}."
            )
    return _ByParamCount(min_params, max_params)


def by_name(*patterns: str) -> WrapPolicy:
    """Select modules whose qualified name matches any of the shell-style `patterns`.

    Names are qualified (`"layers.3.mlp"`); patterns are shell-style (`"layers.*"`, `"*.attn"`;
    `*` also crosses dots).

    Matching is case-sensitive (`fnmatch.fnmatchcase`), against the whole name.

    Args:
        *patterns: Shell-style patterns (`*`, `?`, `[seq]`); at least one.

    Returns:
        The policy.

    Raises:
        CheckpointTypeError: If no pattern is given, or a pattern is not a string.

    Examples:
        >>> from torch import nn
        >>> from xla_wrap import wrap_policies as wp
        >>> model = nn.Module()
        >>> model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        >>> [name for name, _ in wp.by_name("layers.*").select(model)]
        ['layers.0', 'layers.1']
    """
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise CheckpointTypeError(
            "xla_wrap.wrap_policies.by_name: expected one or more patterns as strings, got "
            f"{patterns!r}. "
            'Example: `by_name("encoder.layers.*")`.'
        )
    return _ByName(tuple(patterns))


def by_predicate(predicate: Callable[[nn.Module], bool]) -> WrapPolicy:
    """Select modules for which `predicate(module)` is true (any callable).

    Args:
        predicate: Called with each module; its result is taken as a bool.

    Returns:
        The policy.

    Raises:
        CheckpointTypeError: If `predicate` is not callable.

    Examples:
        >>> from torch import nn
        >>> from xla_wrap import wrap_policies as wp
        >>> model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> wide = wp.by_predicate(lambda m: getattr(m, "out_features", 0) > 4)
        >>> [name for name, _ in wide.select(model)]
        ['0']
    """
    if not is_function(predicate):
        raise CheckpointTypeError(
            "xla_wrap.wrap_policies.by_predicate: expected a function of a module returning a "
            f"bool, got {describe(predicate)}. To select by class, use `by_type(cls)`."
        )
    return _ByPredicate(predicate)


def every_nth(policy: WrapPolicy, n: int, *, offset: int = 0) -> WrapPolicy:
    """Keep every `n`-th module that `policy` selects, starting at position `offset`.

    The usual dial between memory (n=1, every block) and speed (larger n).

    The positions are those of `policy.select(model)`, so the result can only be resolved
    against a whole model: its `select()` works, its `accepts()` refuses.

    Args:
        policy: The wrap policy whose selection is thinned.
        n: Keep one selected module in `n` (a positive int).
        offset: The position of the first one kept, from 0 to `n - 1`.

    Returns:
        The policy.

    Raises:
        CheckpointTypeError: If `policy` is not a wrap policy, or `n` or `offset` not an int.
        CheckpointValueError: If `n` is not positive or `offset` is not in `0..n-1`.

    Examples:
        >>> from torch import nn
        >>> from xla_wrap import wrap_policies as wp
        >>> model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
        >>> [n for n, _ in wp.every_nth(wp.by_type(nn.Linear), 2).select(model)]
        ['0', '2', '4']
    """
    _checked(policy, "every_nth")
    if not is_int(n) or not is_int(offset):
        raise CheckpointTypeError(
            "xla_wrap.wrap_policies.every_nth: expected ints as `n` and `offset`, got "
            f"{describe(n)} and {describe(offset)}."
        )
    if n < 1:
        raise CheckpointValueError(
            f"xla_wrap.wrap_policies.every_nth: expected a positive int as `n`, got {describe(n)}."
        )
    if not 0 <= offset < n:
        raise CheckpointValueError(
            f"xla_wrap.wrap_policies.every_nth: expected `offset` in 0..{n - 1}, got "
            f"{describe(offset)}."
        )
    return _EveryNth(policy, n, offset)


def _checked(policy: object, where: str) -> WrapPolicy:
    if not isinstance(policy, WrapPolicy):
        raise CheckpointTypeError(
            f"xla_wrap.wrap_policies: expected a WrapPolicy for `{where}`, got "
            f"{describe(policy)}. Make one with by_type, by_name, by_param_count or by_predicate."
        )
    return policy
