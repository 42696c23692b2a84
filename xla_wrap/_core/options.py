"""How a checkpoint runs: the options every API takes, checked in one place."""

from dataclasses import dataclass, fields
from typing import Any

from .. import checkpoint_policies as cp
from .._support.checks import check_flag
from .._support.errors import CheckpointTypeError, describe

# The keyword options every checkpointing API accepts. `use_reentrant` is PyTorch's keyword,
# which FairScale, torch_xla and older PyTorch code pass: accepted (a bool or None) and
# without effect, since xla_wrap has one engine (xla_wrap/_core/engine.py), which does all
# that PyTorch's reentrant engine does and more.
OPTION_NAMES = ("preserve_rng_state", "use_reentrant", "policy", "offload_to_cpu")

# torch.utils.checkpoint.checkpoint's keywords that xla_wrap does not take, with what to do
# instead. Passed to xla_wrap.checkpoint they would reach the function as its own arguments,
# and a forward taking **kwargs (as Hugging Face layers do) would drop them without a word.
_TORCH_ONLY_KEYWORDS = {
    "context_fn": "choose what to keep with `policy=` (xla_wrap.checkpoint_policies) instead",
    "determinism_check": "xla_wrap always checks the recomputation (count, shapes and dtypes "
    "of what it saves) and names the first difference; drop it",
    "debug": "xla_wrap's CheckpointError names the first different tensor and the op that made "
    "it; drop it",
    "early_stop": "xla_wrap always stops the recomputation once the last saved tensor exists "
    "(on XLA the compiler drops the rest); drop it",
}


def refuse_torch_only_keywords(api: str, kwargs: dict[str, Any]) -> None:
    """Refuse a keyword of `torch.utils.checkpoint.checkpoint` that xla_wrap lacks."""
    for name in (name for name in _TORCH_ONLY_KEYWORDS if name in kwargs):
        raise CheckpointTypeError(
            f"{api}: expected the function's own keyword arguments and xla_wrap's options "
            f"({', '.join(OPTION_NAMES)}), got `{name}`, an option of "
            f"torch.utils.checkpoint.checkpoint that xla_wrap does not take: "
            f"{_TORCH_ONLY_KEYWORDS[name]}. If `{name}` is the function's own argument, bind it: "
            f"`checkpoint(functools.partial(function, {name}=...), *args)`."
        )


@dataclass(frozen=True)
class CheckpointOptions:
    """How a checkpoint runs (see [`xla_wrap.checkpoint()`][xla_wrap.checkpoint] for each option).

    As a checkpointed module holds them
    ([`CheckpointWrapper.checkpoint_options`][xla_wrap.CheckpointWrapper]) and a plan gives
    them ([`CheckpointPlan.options_of()`][xla_wrap.CheckpointPlan.options_of]): checked and
    resolved, `policy` a callable or `None`. (`use_reentrant` is accepted by every API and
    changes nothing, so it is not kept.)

    Attributes:
        preserve_rng_state: Replay the random generators in the recomputation.
        policy: The save policy; `None` recomputes everything.
        offload_to_cpu: Keep what the checkpoint saves in host memory.
    """

    preserve_rng_state: bool = True
    policy: cp.SavePolicy | None = None
    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        api = "xla_wrap.CheckpointOptions"
        check_flag(api, "preserve_rng_state", self.preserve_rng_state)
        check_flag(api, "offload_to_cpu", self.offload_to_cpu)
        if self.policy is not None:
            object.__setattr__(self, "policy", cp.resolve(api, self.policy))

    def as_keywords(self) -> dict[str, Any]:
        """The options as the keyword arguments of [`xla_wrap.checkpoint()`][xla_wrap.checkpoint].

        Returns:
            A new dict from each option's name (`preserve_rng_state`, `policy`,
            `offload_to_cpu`) to its value.

        Examples:
            >>> import torch, xla_wrap
            >>> layer = xla_wrap.checkpoint_wrapper(torch.nn.Linear(2, 2), policy="dots_saveable")
            >>> layer.checkpoint_options.as_keywords()["policy"].__name__
            'dots_saveable'
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}


def options_from(api: str, options: dict[str, Any]) -> CheckpointOptions:
    """`make_options()` for APIs that take the options as `**kwargs`: an unknown name
    gets an error that lists the known ones."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise CheckpointTypeError(
            f"{api}: expected checkpoint options among {', '.join(OPTION_NAMES)}, got "
            f"{unknown}. Pass only those, as keywords."
        )
    return make_options(api, **options)


def make_options(
    api: str,
    *,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    policy: cp.SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
) -> CheckpointOptions:
    """Check the options once, for every API that takes them."""
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise CheckpointTypeError(
            f"{api}: expected True, False or None as `use_reentrant`, got "
            f"{describe(use_reentrant)}."
        )
    check_flag(api, "preserve_rng_state", preserve_rng_state)
    check_flag(api, "offload_to_cpu", offload_to_cpu)
    resolved = None if policy is None else cp.resolve(api, policy)
    if resolved is cp.nothing_saveable:
        resolved = None
    return CheckpointOptions(
        preserve_rng_state=preserve_rng_state, policy=resolved, offload_to_cpu=offload_to_cpu
    )
