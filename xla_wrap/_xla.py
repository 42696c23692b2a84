"""The one gateway to torch_xla.

torch_xla is optional: xla_wrap imports on plain CPU/CUDA torch, and nothing here imports
torch_xla on its own initiative. A tensor can only live on an XLA device once torch_xla is
loaded, so every question about XLA is answered from ``sys.modules``; the rest of the package
asks these functions and never touches torch_xla directly.
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any

import torch

from ._errors import BarriersStrippedWarning, XlaWrapError

# The pass that deletes every opt-barrier on XLA:CPU before CSE (see docs/index.md).
BARRIER_STRIPPING_PASS = "cse_barrier_expander"
KEEP_BARRIERS_FLAG = f"--xla_disable_hlo_passes={BARRIER_STRIPPING_PASS}"

# XLA advances each device's base seed at every step marker with this affine map
# (LazyGraphExecutor::DeviceContextArena::MarkStep); xla_wrap must reproduce it to give the
# next step the seed it would have had without checkpointing.
_STEP_SEED_MUL = 7012063
_STEP_SEED_ADD = 1012031
_SEED_MASK = (1 << 64) - 1
# ... and each random op advances the running seed (XLAGraphExecutor::GetRngSeed).
_DRAW_SEED_MUL = 214013
_DRAW_SEED_ADD = 2531011


def _loaded(name: str) -> ModuleType | None:
    return sys.modules.get(name)


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on an XLA device."""
    return tensor.device.type == "xla"


def xla_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct XLA devices among ``tensors``, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for tensor in tensors:
        if is_xla_tensor(tensor):
            seen.setdefault(tensor.device, None)
    return list(seen)


def tensor_id(tensor: torch.Tensor) -> int:
    """torch_xla's id of the lazy tensor behind an XLA tensor: equal for Python objects that
    stand for the same value (autograd unpacks a saved output into a new object each time)."""
    torch_xla = _loaded("torch_xla")
    assert torch_xla is not None
    return int(torch_xla._XLAC._xla_get_tensor_id(tensor))


def ir_text(tensor: torch.Tensor) -> str:
    """torch_xla's IR of an XLA tensor's pending value, as text (changes when it is written)."""
    torch_xla = _loaded("torch_xla")
    assert torch_xla is not None
    text: str = torch_xla._XLAC._get_xla_tensors_text([tensor])
    return text


def is_device_data(tensor: torch.Tensor) -> bool:
    """Whether an XLA tensor is materialized data (a program input) rather than a value still
    to be computed. Read from torch_xla's description of the tensor: no cheaper public query
    exists."""
    torch_xla = _loaded("torch_xla")
    if torch_xla is None or not is_xla_tensor(tensor):
        return False
    info: str = torch_xla._XLAC._get_xla_tensor_debug_info(tensor)
    ir_line = next((line for line in info.splitlines() if line.startswith("IR:")), "")
    # Data already on the device has no IR, or an IR that only points at its data.
    return ir_line.strip() == "IR: None" or "xla::device_data" in ir_line


def barrier_(tensors: Sequence[torch.Tensor]) -> None:
    """Put the XLA tensors of ``tensors`` through one optimization barrier per device, in place.

    One barrier over all of them ties them together: XLA cannot compute anything that reads one
    barrier output before every input of the barrier exists, and cannot treat an output as the
    same value as its input (so common-subexpression elimination cannot merge work across it).
    The in-place form keeps autograd out of it; callers pass fresh detached copies.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if is_xla_tensor(tensor):
            by_device.setdefault(tensor.device, []).append(tensor)
    if not by_device:
        return
    xm = _loaded("torch_xla.core.xla_model")
    assert xm is not None  # a tensor on XLA implies torch_xla is loaded
    for group in by_device.values():
        xm.optimization_barrier_(group)


def sharding(tensor: torch.Tensor) -> object | None:
    """The SPMD sharding annotation of an XLA tensor (torch_xla's ``OpSharding``), or None
    when the tensor has none that Python can see."""
    torch_xla = _loaded("torch_xla")
    if torch_xla is None or not is_xla_tensor(tensor):
        return None
    if not torch_xla._XLAC._get_xla_sharding_spec(tensor):
        return None
    return torch_xla._XLAC._get_xla_op_sharding(tensor)


def shard_like(tensor: torch.Tensor, op_sharding: object) -> None:
    """Annotate the XLA ``tensor`` with ``op_sharding`` (from :func:`sharding`), in place."""
    torch_xla = _loaded("torch_xla")
    assert torch_xla is not None
    torch_xla._XLAC._xla_mark_sharding(tensor, op_sharding)


# A tiled sharding as torch_xla prints it: "{devices=[4,1,1]0,1,2,3}" or, with the devices as
# an iota, "{devices=[4,1,1]<=[4]}" ("<=[2,2]T(1,0)": reshaped and transposed), optionally
# replicated over the last tile dimension.
_TILED_SPEC = re.compile(
    r"\{devices=\[([\d,]+)\](?:([\d,]+)|<=\[([\d,]+)\](?:T\(([\d,]+)\))?)"
    r"( last_tile_dim_replicate)?\}"
)


def sharding_spec(tensor: torch.Tensor) -> str:
    """The SPMD sharding of an XLA tensor as torch_xla prints it; "" when it has none."""
    torch_xla = _loaded("torch_xla")
    if torch_xla is None or not is_xla_tensor(tensor):
        return ""
    return str(torch_xla._XLAC._get_xla_sharding_spec(tensor))


def shard_by_spec(tensor: torch.Tensor, spec: str, *, leading: int = 0) -> bool:
    """Annotate the XLA ``tensor`` with the tiled sharding ``spec`` (from
    :func:`sharding_spec`), after ``leading`` new replicated dimensions (a stack of tensors
    sharded as ``spec``). Returns False, annotating nothing, for a spec that is not tiled."""
    tiling = tiled_sharding(spec)
    if tiling is None:
        if spec and not spec.startswith(("{replicated", "{maximal", "{manual")):
            _warn_unread_sharding_once(spec)
        return False
    tiles, devices, sharded = tiling
    if tensor.dim() != leading + sharded:
        return False
    import numpy as np
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.array(devices), tiles)
    xs.mark_sharding(tensor, mesh, (None,) * leading + tuple(range(sharded)))
    return True


def tiled_sharding(spec: str) -> tuple[tuple[int, ...], list[int], int] | None:
    """A tiled sharding spec read: its tile counts per dimension, its devices in tile
    order, and how many of the dimensions are the tensor's (not trailing replicas); None for
    any other spec."""
    match = _TILED_SPEC.fullmatch(spec)
    if match is None:
        return None

    def numbers(text: str) -> list[int]:
        return [int(d) for d in text.split(",")]

    tiles = tuple(numbers(match.group(1)))
    if match.group(2):
        devices = numbers(match.group(2))
    else:  # an iota of devices, reshaped and maybe transposed
        shape = numbers(match.group(3))
        ids = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        if match.group(4):
            ids = ids.permute(numbers(match.group(4)))
        devices = ids.reshape(-1).tolist()
    return tiles, devices, len(tiles) - (1 if match.group(5) else 0)


def while_loop(body: Callable[..., Any], init: Any, xs: Any, *, reverse: bool = False) -> Any:
    """torch_xla's scan lowering (an XLA While loop of ``body``, traced once).

    torch_xla traces the body on placeholder tensors with no data, and a sync that finds one
    still alive crashes the process (torch_xla 2.9: a segmentation fault). An error raised
    while tracing holds them in its traceback's frames for as long as anyone keeps the error
    (a ``pytest.raises``, a logger), so it leaves without those frames: its traceback as text
    in its notes, where it did not come from xla_wrap."""
    from torch_xla.experimental.scan import _scan_impl_pytree

    try:
        return _scan_impl_pytree(body, init, xs, reverse=reverse)
    except BaseException as error:
        if not isinstance(error, XlaWrapError):
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            _add_note(error, f"Raised while tracing a scanned layer:\n{text}")
        chained: BaseException | None = error
        seen: set[int] = set()
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
        del chained
        gc.collect()  # frames that held placeholders in a cycle
        raise error


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


@functools.cache
def layer_slice_ops() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``take(stack, i)`` (layer ``i``'s slice) and ``overwrite(stack, value, i)`` (the stack
    with that slice replaced) for a scalar index tensor: XLA DynamicSlice and
    DynamicUpdateSlice, which torch's indexing does not lower to."""
    import torch_xla.core.xla_op_registry as xor
    from torch_xla.experimental.scan import dynamic_slice, dynamic_update_slice

    return (
        xor.register("xla_wrap_layer_slice", dynamic_slice),
        xor.register("xla_wrap_layer_overwrite", dynamic_update_slice),
    )


@functools.cache
def _warn_unread_sharding_once(spec: str) -> None:
    warnings.warn(
        f"xla_wrap.scan_layers: cannot read the sharding {spec!r}, so the stacked carries are "
        "left to XLA's sharding propagation, which may partition the backward loop another "
        "way than the forward (more FLOPs per device). Please report this sharding.",
        stacklevel=_caller_stacklevel(),
    )


def spmd_active() -> bool:
    """Whether torch_xla runs this process in SPMD mode (``torch_xla.runtime.use_spmd()``)."""
    runtime = _loaded("torch_xla.runtime")
    return runtime is not None and bool(runtime.is_spmd())


@functools.cache
def warn_unsharded_gradient_once() -> None:
    warnings.warn(
        "xla_wrap: under SPMD, a checkpoint's output has no sharding annotation that xla_wrap "
        "can see, so its gradient after the barrier has none either, and XLA may replicate "
        "the recomputation (gathering activations in full). Annotate the output inside the "
        "checkpointed block with torch_xla.distributed.spmd.mark_sharding, or, inside "
        "SpmdFullyShardedDataParallel, build each unit with "
        "xla_wrap.fsdp.auto_wrapper_callable(fsdp_class=SpmdFullyShardedDataParallel) or nest "
        "as checkpoint_wrapper(SpmdFullyShardedDataParallel(block)) (docs/fsdp.md).",
        UserWarning,
        stacklevel=2,
    )


def rng_state(device: torch.device) -> int:
    """The running RNG seed of an XLA device (what its next random op will advance from)."""
    xm = _loaded("torch_xla.core.xla_model")
    assert xm is not None  # only called with XLA devices
    return int(xm.get_rng_state(str(device)))


def in_gradient_accumulation_loop() -> bool:
    """Whether the calling code runs inside the body of torch_xla's ``gradient_accumulation``
    (its XLA While loop gives each iteration a seed of its own, as an input of the traced body
    that no host-side seed can stand for)."""
    module = _loaded("torch_xla.experimental.gradient_accumulation")
    if module is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == module.__name__:
            return True
        frame = frame.f_back
    return False


def set_rng_state(device: torch.device, seed: int) -> None:
    """Set both the running and the base RNG seed of an XLA device."""
    xm = _loaded("torch_xla.core.xla_model")
    assert xm is not None
    xm.set_rng_state(seed, str(device))


def advance_seed(seed: int) -> int:
    """The running seed after one random op draws from ``seed`` (XLA's per-draw step)."""
    return (_DRAW_SEED_ADD + seed * _DRAW_SEED_MUL) & _SEED_MASK


def base_seed(device: torch.device) -> int:
    """The base seed of an XLA device: the seed its step started from.

    Reading it restarts the device's pending seed chain at the base seed, so call it only right
    before :func:`set_rng_state` overwrites the state anyway.
    """
    torch_xla = _loaded("torch_xla")
    assert torch_xla is not None
    return int(torch_xla._XLAC._get_base_seed_as_tensor(str(device)).cpu().item())


def next_step_seed(seed: int) -> int:
    """The base seed XLA gives the next step when this step's base seed is ``seed``."""
    return (_STEP_SEED_ADD + seed * _STEP_SEED_MUL) & _SEED_MASK


def add_step_closure(closure: Callable[[], None]) -> None:
    """Run ``closure`` after the next step marker (``torch_xla.sync()``)."""
    xm = _loaded("torch_xla.core.xla_model")
    assert xm is not None
    xm.add_step_closure(closure)


@contextmanager
def checkpoint_backward_status() -> Iterator[None]:
    """Tell XLA FSDP that a checkpointed block is being recomputed in backward.

    XLA FSDP reads ``torch_xla.utils.checkpoint.chkpt_status.in_chkpt_bwd`` to skip resharding
    parameters it is about to gather again. torch_xla's own checkpoint sets it and never resets
    it on error; here the previous value comes back in ``finally``.
    """
    module = _loaded("torch_xla.utils.checkpoint")
    status = getattr(module, "chkpt_status", None)
    if status is None:
        yield
        return
    previous = status.in_chkpt_bwd
    status.in_chkpt_bwd = True
    try:
        yield
    finally:
        status.in_chkpt_bwd = previous


def xla_fsdp_class() -> type:
    """torch_xla's ``XlaFullyShardedDataParallel`` (imported on request: FSDP helpers only)."""
    try:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
    except ImportError:
        raise ImportError(
            "xla_wrap.fsdp: XLA FSDP needs torch_xla; install it with `pip install "
            "'xla_wrap[xla]'`, or pass the FSDP class to use as `fsdp_class=`."
        ) from None
    fsdp: type = XlaFullyShardedDataParallel
    return fsdp


# Backends whose compiler executes torch_xla's host-placement annotations. XLA:CPU aborts the
# process on them (FIELD-NOTES.md: `free(): invalid size`).
_HOST_OFFLOAD_DEVICE_TYPES = {"TPU", "CUDA", "GPU"}


def host_offload_supported() -> bool:
    """Whether this process's XLA backend can keep values in host memory inside a program."""
    runtime = _loaded("torch_xla.runtime")
    return runtime is not None and runtime.device_type().upper() in _HOST_OFFLOAD_DEVICE_TYPES


def place_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` annotated to live in pinned host memory (``annotate_device_placement``)."""
    return _placement_ops().place_to_host(tensor)


def place_to_device(tensor: torch.Tensor) -> torch.Tensor:
    """A value placed by :func:`place_to_host`, annotated back to device memory."""
    return _placement_ops().place_to_device(tensor)


def _placement_ops() -> Any:
    importlib.import_module("torch_xla.experimental.stablehlo_custom_call")  # registers them
    return torch.ops.xla


def barrier_stripping_active(device_type: str, xla_flags: str | None = None) -> bool:
    """Whether XLA will delete optimization barriers before CSE on this backend.

    The XLA:CPU pipeline runs ``cse_barrier_expander`` before CSE unless the pass is disabled in
    ``XLA_FLAGS``; then checkpointing saves no memory there. GPU expands barriers only after
    scheduling and TPU keeps them, so neither strips them early.

    Args:
        device_type: torch_xla's device type (``"CPU"``, ``"TPU"``, ``"CUDA"``, ...).
        xla_flags: The flags to inspect; ``XLA_FLAGS`` from the environment when omitted.
    """
    if device_type.upper() != "CPU":
        return False
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    for flag in flags.split():
        name, _, value = flag.partition("=")
        if name == "--xla_disable_hlo_passes" and BARRIER_STRIPPING_PASS in value.split(","):
            return False
    return True


def warn_if_barriers_stripped(tensors: Iterable[torch.Tensor]) -> None:
    """Warn once per process when checkpointing XLA tensors on XLA:CPU with the barrier-stripping
    pass enabled: the step recomputes, but the memory saving cannot show there."""
    if any(is_xla_tensor(t) for t in tensors) and _barriers_stripped_here():
        _warn_barriers_stripped_once()


@functools.cache
def _barriers_stripped_here() -> bool:
    # XLA reads its flags once per process, so the answer cannot change.
    runtime = _loaded("torch_xla.runtime")
    return runtime is not None and barrier_stripping_active(runtime.device_type())


@functools.cache
def _warn_barriers_stripped_once() -> None:
    warnings.warn(
        "xla_wrap: checkpointing on XLA:CPU, whose compiler deletes optimization barriers "
        f"({BARRIER_STRIPPING_PASS}) before common-subexpression elimination: the step will "
        "recompute but save no memory here. Accelerators keep the barriers. To see the saving "
        f"on a CPU, start Python with XLA_FLAGS={KEEP_BARRIERS_FLAG}.",
        BarriersStrippedWarning,
        stacklevel=_caller_stacklevel(),
    )


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside xla_wrap and torch, so the warning points at
    the user's line."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("xla_wrap") or name.startswith("torch")):
            return level
        frame = frame.f_back
        level += 1
    return 1
