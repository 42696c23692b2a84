"""`checkpoint` and `checkpoint_sequential`: the functional entry points."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _paths
from .. import checkpoint_policies as cp
from .._support.checks import is_int
from .._support.errors import CheckpointTypeError, CheckpointValueError, describe
from .._support.state import checkpointing_disabled
from .._support.tree import Flat
from . import engine
from .module_tensors import ModuleTensors
from .options import CheckpointOptions, make_options, refuse_torch_only_keywords


@_paths.branches_on_compiling  # reached first after a graph break, it runs the block itself
def run_checkpointed(
    api: str,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    owners: Iterable[nn.Module],
    options: CheckpointOptions,
) -> Any:
    """Run `function(*args, **kwargs)` as a checkpoint whose barrier also covers the
    parameters and buffers of `owners`. Outside autograd, with a policy that keeps
    everything, or under [`disable_checkpointing()`][xla_wrap.disable_checkpointing], it is a
    plain call.

    This is where every checkpoint starts, and where it branches, once, on `torch.compile`:
    while Dynamo traces, the call becomes the compiler's own checkpoint (the compiler then
    decides what to recompute); otherwise xla_wrap's engine runs it (xla_wrap/_core/engine.py).
    """
    if (
        not torch.is_grad_enabled()
        or options.policy is cp.everything_saveable
        or checkpointing_disabled()
    ):
        return function(*args, **kwargs)
    if _paths.compiling():
        return _paths.compiled_checkpoint(
            api,
            function,
            args,
            kwargs,
            preserve_rng_state=options.preserve_rng_state,
            policy=options.policy,
            offload_to_cpu=options.offload_to_cpu,
        )
    call = engine.CheckpointCall(
        api=api, function=function, owners=ModuleTensors.of(owners), options=options
    )
    return _run_engine(call, Flat.of((args, kwargs)))


# The engine runs outside the compiler: when Dynamo cannot trace a block, it breaks the graph
# at the block's call, and the block then runs here, whole and eager, as under no compiler.
_run_engine = _paths.outside_the_compiler(engine.run)


@_paths.branches_on_compiling
def owning_modules(function: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[nn.Module]:
    """The module whose parameters `function` reads: the module itself, the owner of a bound
    method, either of those inside `functools.partial`, or the module an unbound method is
    called on (`Layer.forward(layer, x)`, as transformers 5 checkpoints its layers). None
    inside `torch.compile`, whose checkpoint differentiates whatever the function reads."""
    if _paths.compiling():
        return []
    function, args, _ = unpartial(function, args, {})
    if isinstance(function, nn.Module):
        return [function]
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return [owner]
    if args and isinstance(args[0], nn.Module) and _is_method_of(function, args[0]):
        return [args[0]]
    return []


def _is_method_of(function: Callable[..., Any], module: nn.Module) -> bool:
    """Whether `function` is defined as a method of `module`'s class (or a base class), as
    far as its qualified name tells (`GPT2Block.forward`, or a wrapper that keeps it)."""
    qualname = getattr(function, "__qualname__", "")
    owner_name, _, _ = qualname.rpartition(".")
    return any(cls.__qualname__ == owner_name for cls in type(module).__mro__)


def unpartial(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """`partial(f, *a, **k)(*args, **kwargs)` as `f(*a, *args, **k, **kwargs)`, so that the
    tensors bound in a partial (transformers binds a layer's masks and position embeddings
    this way) are inputs of the checkpoint, and the module behind it is found."""
    while isinstance(function, functools.partial):
        args = (*function.args, *args)
        kwargs = {**function.keywords, **kwargs}
        function = function.func
    return function, args, kwargs


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    policy: cp.SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
    **kwargs: Any,
) -> Any:
    """Run `function(*args, **kwargs)` without keeping its activations.

    They are recomputed in backward behind an optimization barrier, so that XLA keeps the
    saving.

    Inputs and outputs may nest tuples, lists and dicts and contain non-tensor values. When
    `function` is an `nn.Module`, a bound method of one, or a `functools.partial` of
    either, that module's parameters and buffers join the barrier and receive gradients even
    when no input requires grad. Under `torch.no_grad()` this is a plain call.

    Args:
        function: The callable to checkpoint.
        *args: Positional arguments for `function`.
        preserve_rng_state: Replay the CPU, CUDA and XLA generators so that random ops
            (Dropout) draw the same numbers in the recomputation as in the forward.
        use_reentrant: PyTorch's choice of engine, accepted for code written for it
            (`True`, `False` or `None`) and without effect: xla_wrap has one engine, which
            records the block's graph with placeholders for what it saves and recomputes
            them behind the barrier before that graph runs in backward. It supports
            everything PyTorch's reentrant engine does, and `torch.autograd.grad`, save
            policies and double backward besides (docs/guide.md).
        policy: What to keep instead of recomputing: a function of
            [`xla_wrap.checkpoint_policies`][xla_wrap.checkpoint_policies] (or its name, like
            `"dots_saveable"`) or any callable taking an
            [`Op`][xla_wrap.checkpoint_policies.Op]. `None` (the default) recomputes
            everything.
        offload_to_cpu: Keep what the checkpoint saves (its inputs, and the values a policy
            keeps) in host memory until backward: pinned memory on CUDA, host-placement
            annotations inside the compiled program on XLA TPU and GPU (docs/offload.md). On
            XLA:CPU the values stay on the device, with a warning.
        **kwargs: Keyword arguments for `function`.

    Returns:
        What `function` returns.

    Raises:
        CheckpointTypeError: If `function` or `policy` is not callable, `use_reentrant` is
            not a bool or `None`, or a keyword of `torch.utils.checkpoint.checkpoint` that
            xla_wrap lacks is given (`context_fn`, `determinism_check`, `debug`,
            `early_stop`).
        CheckpointValueError: If `policy` is unknown.
        CheckpointError: In backward, if the recomputation computes something else than the
            forward did (the first different saved tensor or operation is named).

    Examples:
        >>> import torch, xla_wrap
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4)
        >>> y = xla_wrap.checkpoint(layer, x)
        >>> y.sum().backward()
        >>> layer.weight.grad.shape
        torch.Size([4, 4])
    """
    if not callable(function):
        raise CheckpointTypeError(
            f"xla_wrap.checkpoint: expected a callable as `function`, got {describe(function)}. "
            "Pass the module or function to run, then its arguments: "
            "`checkpoint(block, x, mask=m)`."
        )
    refuse_torch_only_keywords("xla_wrap.checkpoint", kwargs)
    options = make_options(
        "xla_wrap.checkpoint",
        preserve_rng_state=preserve_rng_state,
        use_reentrant=use_reentrant,
        policy=policy,
        offload_to_cpu=offload_to_cpu,
    )
    function, args, kwargs = unpartial(function, args, kwargs)
    return run_checkpointed(
        "xla_wrap.checkpoint",
        function,
        args,
        kwargs,
        owners=owning_modules(function, args),
        options=options,
    )


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    *,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    policy: cp.SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
) -> Any:
    """Run a sequence of callables in `segments` chunks, checkpointing all but the last chunk.

    Same contract as `torch.utils.checkpoint.checkpoint_sequential`: each callable takes the
    previous one's output. The last chunk runs normally because its activations are needed
    right away by backward. The parameters of the modules in a chunk join that chunk's barrier.

    Args:
        functions: An `nn.Sequential`, or a list, tuple or `nn.ModuleList` of modules or
            functions.
        segments: How many chunks to split `functions` into (1 to `len(functions)`).
        input: The input of the first callable.
        preserve_rng_state: As for [`checkpoint()`][xla_wrap.checkpoint].
        use_reentrant: As for [`checkpoint()`][xla_wrap.checkpoint].
        policy: As for [`checkpoint()`][xla_wrap.checkpoint].
        offload_to_cpu: As for [`checkpoint()`][xla_wrap.checkpoint].

    Returns:
        The output of the last callable.

    Raises:
        CheckpointTypeError: If `functions` is not one of those or holds something not
            callable, `segments` is not an int, `use_reentrant` is not a bool or `None`, or
            `policy` is neither a policy name nor callable.
        CheckpointValueError: If `segments` is not between 1 and `len(functions)`, or the
            save `policy` is unknown.

    Examples:
        >>> import torch, xla_wrap
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> y = xla_wrap.checkpoint_sequential(model, 2, torch.randn(2, 4))
        >>> y.shape
        torch.Size([2, 4])
    """
    api = "xla_wrap.checkpoint_sequential"
    if isinstance(functions, nn.Sequential):
        items: list[Any] = list(functions)
    elif isinstance(functions, (list, tuple, nn.ModuleList)):
        items = list(functions)
    else:
        raise CheckpointTypeError(
            f"{api}: expected an nn.Sequential or a list of callables as `functions`, got "
            f"{describe(functions)}. Wrap the layers: `checkpoint_sequential(nn.Sequential(...), "
            "segments, x)`."
        )
    for index, item in enumerate(items):
        if not callable(item):
            raise CheckpointTypeError(
                f"{api}: expected every element of `functions` to be callable, got "
                f"{describe(item)} at position {index}. Pass modules or functions only."
            )
    if not is_int(segments):
        raise CheckpointTypeError(
            f"{api}: expected an int as `segments`, got {describe(segments)}. Pass how many "
            "chunks to split the layers into."
        )
    if not 1 <= segments <= len(items):
        raise CheckpointValueError(
            f"{api}: expected `segments` between 1 and {len(items)} (the number of layers), got "
            f"{segments}. Choose fewer segments or pass more layers."
        )
    options = make_options(
        api,
        preserve_rng_state=preserve_rng_state,
        use_reentrant=use_reentrant,
        policy=policy,
        offload_to_cpu=offload_to_cpu,
    )

    def run(chunk: list[Any]) -> Callable[[Any], Any]:
        def forward(value: Any) -> Any:
            for item in chunk:
                value = item(value)
            return value

        return forward

    size = len(items) // segments
    start = 0
    for _ in range(segments - 1):
        chunk = items[start : start + size]
        modules = [m for f in chunk for m in owning_modules(f)]
        input = run_checkpointed(api, run(chunk), (input,), {}, owners=modules, options=options)
        start += size
    return run(items[start:])(input)
