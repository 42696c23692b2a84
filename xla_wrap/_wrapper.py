"""``CheckpointWrapper``: an ``nn.Module`` proxy that checkpoints every call of a module.

The proxy *shares* the wrapped module's ``_parameters``, ``_buffers`` and ``_modules`` dicts and
keeps the module itself outside ``_modules``. A parent therefore sees exactly the unwrapped
names in ``state_dict``, ``named_parameters``, ``named_buffers`` and ``named_modules`` (no
``_checkpoint_wrapped_module.`` prefix, the complaint users file against PyTorch's wrapper),
and optimizers, ``.to()``, ``deepcopy`` and pickling act on the same tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ._checkpoint import run_checkpointed
from ._errors import CheckpointTypeError, CheckpointValueError, describe
from ._options import CheckpointOptions, make_options
from .checkpoint_policies import SavePolicy

# state_dict hook tables: shared, so hooks registered on either object run exactly once, from
# the module's own state_dict / load path.
_SHARED_HOOK_TABLES = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class CheckpointWrapper(nn.Module):
    """A module that runs the wrapped module under :func:`xla_wrap.checkpoint`.

    Create it with :func:`checkpoint_wrapper`. Attribute access, indexing, ``len`` and iteration
    fall through to the wrapped module, which stays reachable as :attr:`checkpoint_module`.
    """

    def __init__(self, module: nn.Module, options: CheckpointOptions) -> None:
        super().__init__()
        # Share the containers instead of registering `module` as a child: the parent then
        # names every tensor exactly as it would without the wrapper.
        self.__dict__["_checkpoint_module"] = module
        self.__dict__["_checkpoint_options"] = options
        for table in (
            "_parameters",
            "_buffers",
            "_modules",
            "_non_persistent_buffers_set",
            *_SHARED_HOOK_TABLES,
        ):
            self.__dict__[table] = getattr(module, table)
        self.__dict__["training"] = module.training

    @property
    def checkpoint_module(self) -> nn.Module:
        """The wrapped module."""
        module: nn.Module = self.__dict__["_checkpoint_module"]
        return module

    @property
    def checkpoint_options(self) -> CheckpointOptions:
        """The options this wrapper checkpoints with."""
        options: CheckpointOptions = self.__dict__["_checkpoint_options"]
        return options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.checkpoint_module
        return run_checkpointed(
            "xla_wrap.CheckpointWrapper",
            module,
            args,
            kwargs,
            owners=(module,),
            options=self.checkpoint_options,
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_checkpoint_module")
            if module is None:  # half-built (unpickling): nothing to fall through to
                raise
            return getattr(module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module's own bookkeeping (hook flags, `training`, compiled call) stays on the
        # wrapper. Everything else goes to the wrapped module, which registers parameters,
        # buffers and submodules in the dicts both share, and keeps plain attributes where its
        # forward reads them.
        # `__class__` stays too: FSDP2's fully_shard swaps the class of the module it shards.
        module = self.__dict__.get("_checkpoint_module")
        if module is None or name == "__class__" or name in self.__dict__:
            super().__setattr__(name, value)
            if module is None or name != "training":
                return
        setattr(module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.checkpoint_module, name)

    def __getitem__(self, index: Any) -> Any:
        return self.checkpoint_module[index]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self.checkpoint_module)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.checkpoint_module)  # type: ignore[call-overload]

    def __bool__(self) -> bool:
        return bool(self.checkpoint_module)

    def train(self, mode: bool = True) -> CheckpointWrapper:
        self.checkpoint_module.train(mode)  # honours a `train` override of the module
        self.__dict__["training"] = mode
        return self

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> CheckpointWrapper:
        # The shared dicts see every replaced tensor; the module's own `_apply` override runs.
        self.checkpoint_module._apply(fn, recurse)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint_module.state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.checkpoint_module._load_from_state_dict(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CheckpointWrapper({self.checkpoint_module!r})"


def checkpoint_wrapper(
    module: nn.Module,
    *,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    policy: SavePolicy | str | None = None,
    offload_to_cpu: bool = False,
) -> CheckpointWrapper:
    """Wrap ``module`` so that every call of it is checkpointed with an optimization barrier.

    The wrapper is a drop-in replacement: put it where the module was (``model.block =
    checkpoint_wrapper(model.block)``) and nothing else changes; parameter names, ``state_dict``
    keys, optimizer groups and attribute access are those of the unwrapped model. The forward
    accepts any positional and keyword arguments. Under ``torch.no_grad()`` it is a plain call.

    Wrapping a :class:`CheckpointWrapper` again with the same options returns it unchanged
    (checkpoints are never nested by accident); with different options it raises.

    Args:
        module: The module to checkpoint.
        preserve_rng_state: Replay the CPU, CUDA and XLA generators so that Dropout draws the
            same mask in the recomputation as in the forward. Turn off only for blocks
            without random ops, to skip saving generator states.
        use_reentrant: The engine, as for :func:`xla_wrap.checkpoint`.
        policy: A save policy (:mod:`xla_wrap.checkpoint_policies`), as for
            :func:`xla_wrap.checkpoint`.
        offload_to_cpu: Keep what the checkpoint saves in host memory until backward, as for
            :func:`xla_wrap.checkpoint`.

    Returns:
        The wrapper.

    Raises:
        CheckpointTypeError: If ``module`` is not an ``nn.Module``.
        CheckpointValueError: If ``module`` is already wrapped with other options, or
            ``policy`` is unknown or given with ``use_reentrant=True``.

    Example:
        >>> import torch, xla_wrap
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> model[0] = xla_wrap.checkpoint_wrapper(model[0])
        >>> [name for name, _ in model.named_parameters()]
        ['0.weight', '0.bias']
    """
    if not isinstance(module, nn.Module):
        raise CheckpointTypeError(
            f"xla_wrap.checkpoint_wrapper: expected an nn.Module, got {describe(module)}. "
            "To checkpoint a function, call `xla_wrap.checkpoint(function, *args)` instead."
        )
    options = make_options(
        "xla_wrap.checkpoint_wrapper",
        preserve_rng_state=preserve_rng_state,
        use_reentrant=use_reentrant,
        policy=policy,
        offload_to_cpu=offload_to_cpu,
    )
    if isinstance(module, CheckpointWrapper):
        if module.checkpoint_options == options:
            return module
        raise CheckpointValueError(
            f"xla_wrap.checkpoint_wrapper: this module is already a CheckpointWrapper with "
            f"{module.checkpoint_options}, and got {options}. To change options, wrap the "
            "inner module: `checkpoint_wrapper(wrapper.checkpoint_module, ...)`."
        )
    refuse_eager_fsdp_unit("xla_wrap.checkpoint_wrapper", module)
    return CheckpointWrapper(module, options)


def refuse_eager_fsdp_unit(api: str, module: nn.Module) -> None:
    """Refuse to checkpoint around a unit of PyTorch's eager FSDP (FSDP1 or FSDP2).

    The wrapper shares the unit's containers instead of registering it as a child, which hides
    the unit from the FSDP root: FSDP2 then fails, and FSDP1 would keep the unit unsharded from
    forward to backward. torch_xla's FSDP is not affected (docs/fsdp.md).
    """
    eager_fsdp = sys.modules.get("torch.distributed.fsdp")
    if eager_fsdp is None:
        return
    classes = tuple(
        cls
        for cls in (
            getattr(eager_fsdp, "FullyShardedDataParallel", None),
            getattr(eager_fsdp, "FSDPModule", None),
        )
        if isinstance(cls, type)
    )
    if classes and isinstance(module, classes):
        raise CheckpointTypeError(
            f"{api}: expected a module that FSDP has not wrapped, got "
            f"{type(module).__name__}, which is a unit of PyTorch's FSDP. Checkpoint inside "
            "each unit instead: checkpoint the blocks before `fully_shard` or "
            "`FullyShardedDataParallel` wraps them, or apply_activation_checkpointing to the "
            "FSDP1-wrapped model with a policy that selects the blocks (docs/fsdp.md)."
        )
