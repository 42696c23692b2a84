"""`checkpoint_wrapper`: a module that checkpoints every call of itself, and stays what it is.

Wrapping does not put the module inside another one. As PyTorch's FSDP2 `fully_shard` does,
the module's class is swapped, in place, for a generated subclass (one per class, cached) whose
`forward` runs the original one under [`xla_wrap.checkpoint()`][xla_wrap.checkpoint]. The
module therefore keeps its identity, its class (`isinstance`), its place and name in the module
tree
(`modules()`, `named_modules()`, `apply`), and every parameter, buffer, submodule and
attribute where its own code looks for them, so tools that walk, rename, shard or re-assign
module state (FSDP auto-wrap policies, torch_xla FSDP's parameter swaps,
`object.__setattr__`) work on it as on the unwrapped module. `state_dict` keys and
parameter names never change.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from .._support.checks import check_module
from .._support.errors import CheckpointTypeError, CheckpointValueError, describe
from .._support.state import process
from ..checkpoint_policies import SavePolicy
from . import hooks as _hooks
from .checkpoint import run_checkpointed
from .options import CheckpointOptions, make_options

M = TypeVar("M", bound=nn.Module)

# Keys in a wrapped module's __dict__.
OPTIONS_KEY = "_checkpoint_options"
INSTANCE_FORWARD_KEY = "_checkpoint_instance_forward"  # a `forward` set on the instance before


class CheckpointWrapper(nn.Module):
    """The base of every checkpointed module's class.

    `isinstance(m, CheckpointWrapper)` tells whether `m` is checkpointed. Made by
    [`checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper], never directly: constructing it
    raises `CheckpointTypeError`.

    A checkpointed module of class `Block` is an instance of a generated class whose bases
    are this class and `Block`; its `__name__` is `Block`'s (tools that find layers by
    class name still find it) and it pickles and deep-copies as a checkpointed `Block`.

    Examples:
        >>> import torch, xla_wrap
        >>> layer = xla_wrap.checkpoint_wrapper(torch.nn.Linear(2, 2))
        >>> isinstance(layer, xla_wrap.CheckpointWrapper), type(layer).__name__
        (True, 'Linear')
        >>> layer.checkpoint_module is layer
        True
    """

    # The class the generated class was made for; set on each generated class.
    _checkpoint_base: type[nn.Module]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        base = cls.__dict__.get("_checkpoint_base")
        if base is None:
            raise CheckpointTypeError(
                "xla_wrap.CheckpointWrapper: expected to be made by checkpoint_wrapper, got a "
                "direct construction. Call `xla_wrap.checkpoint_wrapper(module, ...)`."
            )
        # A checkpointed module building another of its own class (nn.Sequential slicing
        # does `type(self)(...)`) gets a plain one, as FSDP2 does: the new module is not
        # checkpointed unless wrapped.
        return base(*args, **kwargs)

    @property
    def checkpoint_options(self) -> CheckpointOptions:
        """The options this module checkpoints with."""
        options: CheckpointOptions = self.__dict__[OPTIONS_KEY]
        return options

    @property
    def checkpoint_module(self) -> nn.Module:
        """The checkpointed module, which is this module itself: the wrapper is the module, not
        a box around it. Code that asks a wrapper for its module gets the right answer."""
        return self

    @property
    def _checkpoint_wrapped_module(self) -> nn.Module:
        """The module unchecked, under the name PyTorch's `checkpoint_wrapper` gives its inner
        module, for code that reads it: an object of the original class sharing this module's
        state (the same parameters, buffers, submodules and hooks) whose forward is the plain
        one. It has no such attribute itself, so an unwrapping loop
        (`while hasattr(m, "_checkpoint_wrapped_module")`) ends on it. Not a child: names
        and `state_dict` do not change. A new object on each read."""
        # a class derived from a generated one inherits its _checkpoint_base
        plain = nn.Module.__new__(type(self)._checkpoint_base)
        plain.__dict__ = self.__dict__  # shared: state stays one
        return plain

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_checkpoint_wrapped_module":  # nn.Module would register a module there
            raise AttributeError(
                "xla_wrap.checkpoint_wrapper: _checkpoint_wrapped_module is read-only (a view "
                "of this module, unchecked). Assign to the module's own attributes instead."
            )
        super().__setattr__(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's own forward as a checkpoint.

        It runs with [`checkpoint_options`][xla_wrap.CheckpointWrapper.checkpoint_options], and the
        module's parameters and buffers join the barrier. Under `torch.no_grad()`, or inside
        [`xla_wrap.disable_checkpointing()`][xla_wrap.disable_checkpointing], it is a plain call.

        Args:
            *args: The module's positional arguments.
            **kwargs: The module's keyword arguments.

        Returns:
            What the module's own forward returns.
        """
        return run_checkpointed(
            "xla_wrap.checkpoint_wrapper",
            self.plain_forward,
            args,
            kwargs,
            owners=(self,),
            options=self.checkpoint_options,
        )

    @property
    def plain_forward(self) -> Any:
        """The module's own forward, not checkpointed: what this module's forward runs as a
        checkpoint, and what a scanned stack calls (it checkpoints the layer itself)."""
        inner = self.__dict__.get(INSTANCE_FORWARD_KEY)
        # A bound method unpickles by name, as this very method: the class's forward then.
        if inner is None or getattr(inner, "__func__", None) is CheckpointWrapper.forward:
            inner = super().forward
        return inner

    def __repr__(self) -> str:
        return f"CheckpointWrapper({super().__repr__()})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The generated class cannot be pickled by name; rebuild it from the wrapped class,
        # through this public class. A class derived from it again (FSDP2 swaps classes too) is
        # rebuilt as itself, which pickles where that class can be found by name. The state is
        # what the class would pickle (an LSTM drops its weak references, a compiled module its
        # compiled call).
        cls = type(self)
        rebuilt = cls if "_checkpoint_base" not in cls.__dict__ else cls._checkpoint_base
        return (CheckpointWrapper.empty_checkpointed, (rebuilt,), self.__getstate__())

    @classmethod
    def empty_checkpointed(cls, module_class: type[nn.Module]) -> CheckpointWrapper:
        """An empty checkpointed module, for unpickling and deep copies to fill.

        Pickles name this method (a public path), so it keeps its name and signature.

        Args:
            module_class: The class of the module before checkpointing (its generated
                checkpointed class is used), or a class derived from a generated one.

        Returns:
            A checkpointed module without state: no parameters, buffers or submodules yet.

        Raises:
            CheckpointTypeError: `module_class` is not a subclass of `nn.Module`.
        """
        if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
            raise CheckpointTypeError(
                "xla_wrap.CheckpointWrapper.empty_checkpointed: expected a module class, got "
                f"{describe(module_class)}."
            )
        made = (
            module_class
            if issubclass(module_class, CheckpointWrapper)
            else checkpointed_class(module_class)
        )
        module: CheckpointWrapper = nn.Module.__new__(made)
        return module


def unwrapped_class(module: nn.Module) -> type[nn.Module]:
    """The class `module` has without checkpointing (its own class if it is not wrapped)."""
    if isinstance(module, CheckpointWrapper):
        return type(module)._checkpoint_base
    return type(module)


def checkpointed_class(base: type[nn.Module]) -> type[CheckpointWrapper]:
    """The generated checkpointed class for modules of class `base`: one per class, so that
    every checkpointed `Block` has the same class, as `type(a) is type(b)` checks expect."""
    cls = process.checkpointed_classes.get(base)
    if cls is None:
        namespace = {
            "_checkpoint_base": base,
            "__module__": base.__module__,
            "__qualname__": f"{base.__qualname__}[checkpointed]",
            "__doc__": base.__doc__,
        }
        metaclass: Any = type(base)
        made = metaclass(base.__name__, (CheckpointWrapper, base), namespace)
        # A racing thread's class wins, once.
        cls = process.checkpointed_classes.setdefault(base, made)
    return cls


# Pickles made before 0.1.0 name these two.
def _new_checkpointed(base: type[nn.Module]) -> CheckpointWrapper:
    return CheckpointWrapper.empty_checkpointed(base)


def _new_of_class(cls: type[CheckpointWrapper]) -> CheckpointWrapper:
    return CheckpointWrapper.empty_checkpointed(cls)


def checkpoint_in_place(
    api: str, module: nn.Module, options: CheckpointOptions
) -> CheckpointWrapper:
    """Make `module` checkpoint every call with `options`; the one place that does it."""
    if isinstance(module, CheckpointWrapper):
        if module.checkpoint_options == options:
            return module
        raise CheckpointValueError(
            f"{api}: this {type(module).__name__} is already checkpointed with "
            f"{module.checkpoint_options}, and got {options}. To change its options, undo the "
            "checkpointing first: `xla_wrap.checkpoint_wrapper(xla_wrap.unwrap(module), ...)`."
        )
    for hook in _hooks.installed():
        hook.check_module(api, module)
    try:
        cls = checkpointed_class(type(module))
    except TypeError as error:
        raise CheckpointTypeError(
            f"{api}: cannot derive a checkpointed class from {type(module).__qualname__} "
            f"({error}). Checkpoint the call instead: `xla_wrap.checkpoint(module, *args)`."
        ) from None
    if "forward" in module.__dict__:
        # A forward set on the instance (accelerate's hooks, a patched method) would hide the
        # class's; it becomes the function the checkpoint runs.
        module.__dict__[INSTANCE_FORWARD_KEY] = module.__dict__.pop("forward")
    module.__dict__[OPTIONS_KEY] = options
    module.__class__ = cls
    return module  # type: ignore[return-value]  # its class is now `cls`


def unwrap(module: nn.Module) -> nn.Module:
    """Undo [`checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] in place.

    `module` gets its own class back and is no longer checkpointed. A module that is not
    checkpointed is returned as it is.

    Args:
        module: A module made by [`checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper] (or
            any module).

    Returns:
        `module`.

    Raises:
        CheckpointTypeError: If `module` is not an `nn.Module`, or another library derived a
            class from the checkpointed one since (FSDP2's `fully_shard`), which cannot be
            undone without undoing that.

    Examples:
        >>> import torch, xla_wrap
        >>> layer = xla_wrap.checkpoint_wrapper(torch.nn.Linear(2, 2))
        >>> type(xla_wrap.unwrap(layer)) is torch.nn.Linear
        True
    """
    check_module("xla_wrap.unwrap", module, "an nn.Module as `module`")
    if not isinstance(module, CheckpointWrapper):
        return module
    cls = type(module)
    base = cls.__dict__.get("_checkpoint_base")
    if base is None:
        raise CheckpointTypeError(
            f"xla_wrap.unwrap: expected a module checkpointed by xla_wrap, got one whose class "
            f"{cls.__qualname__} another library derived from the checkpointed class since. "
            "Undo that library's wrapping first, or unwrap before it wraps."
        )
    module.__class__ = base
    module.__dict__.pop(OPTIONS_KEY, None)
    forward = module.__dict__.pop(INSTANCE_FORWARD_KEY, None)
    if forward is not None:
        module.__dict__["forward"] = forward
    return module


def checkpoint_wrapper(
    module: M,
    *,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    policy: SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
) -> M:
    """Make `module` checkpoint every call of itself with an optimization barrier.

    The module is changed in place and returned: its class becomes a generated subclass of its
    own class (also a [`CheckpointWrapper`][xla_wrap.CheckpointWrapper]) whose forward runs
    under [`xla_wrap.checkpoint()`][xla_wrap.checkpoint]. Nothing else changes: `isinstance`,
    its place in the module tree, parameter names, `state_dict` keys, optimizer groups and
    attribute access are those of the unwrapped module, so
    `model.block = checkpoint_wrapper(model.block)` and `checkpoint_wrapper(model.block)` do
    the same. The forward accepts any positional and keyword arguments. Under
    `torch.no_grad()` it is a plain call. Hooks registered on the module run once per call,
    around the checkpoint; hooks of its submodules also run in the recomputation.
    [`unwrap()`][xla_wrap.unwrap] undoes it.

    Wrapping a checkpointed module again with the same options returns it unchanged
    (checkpoints are never nested); with different options it raises.

    Args:
        module: The module to checkpoint.
        preserve_rng_state: Replay the CPU, CUDA and XLA generators so that Dropout draws the
            same mask in the recomputation as in the forward. Turn off only for blocks
            without random ops, to skip saving generator states.
        use_reentrant: Accepted and without effect, as for
            [`xla_wrap.checkpoint()`][xla_wrap.checkpoint].
        policy: A save policy
            ([`xla_wrap.checkpoint_policies`][xla_wrap.checkpoint_policies], a function or its
            name), as for [`xla_wrap.checkpoint()`][xla_wrap.checkpoint].
        offload_to_cpu: Keep what the checkpoint saves in host memory until backward, as for
            [`xla_wrap.checkpoint()`][xla_wrap.checkpoint].

    Returns:
        `module`, now checkpointed.

    Raises:
        CheckpointTypeError: If `module` is not an `nn.Module`, its class cannot be derived
            from, `use_reentrant` is not a bool or `None`, `policy` is neither a policy name
            nor callable, or `module` is a unit of PyTorch's FSDP1.
        CheckpointValueError: If `module` is already checkpointed with other options, or
            `policy` is unknown.

    Examples:
        >>> import torch, xla_wrap
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> model[0] = xla_wrap.checkpoint_wrapper(model[0])
        >>> [name for name, _ in model.named_parameters()]
        ['0.weight', '0.bias']
    """
    check_module(
        "xla_wrap.checkpoint_wrapper",
        module,
        "an nn.Module",
        "To checkpoint a function, call `xla_wrap.checkpoint(function, *args)` instead.",
    )
    options = make_options(
        "xla_wrap.checkpoint_wrapper",
        preserve_rng_state=preserve_rng_state,
        use_reentrant=use_reentrant,
        policy=policy,
        offload_to_cpu=offload_to_cpu,
    )
    checkpoint_in_place("xla_wrap.checkpoint_wrapper", module, options)
    return module
