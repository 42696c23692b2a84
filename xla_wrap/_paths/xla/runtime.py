"""Questions about torch_xla's lazy tensors and runtime, answered without importing it.

torch_xla is optional: xla_wrap imports on plain CPU/CUDA torch, and nothing here imports
torch_xla on its own initiative. A tensor can only live on an XLA device once torch_xla is
loaded, so every question about XLA is answered from `sys.modules`; the rest of the package
asks these functions and never touches torch_xla directly.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any

import torch

from ..._support.errors import XlaWrapError


def loaded(name: str) -> ModuleType | None:
    """The module `name` if this process has imported it (torch_xla is never imported here on
    xla_wrap's own initiative)."""
    return sys.modules.get(name)


def installed() -> bool:
    """Whether torch_xla can be imported in this environment."""
    return importlib.util.find_spec("torch_xla") is not None


def runtime_started() -> bool:
    """Whether this process has started torch_xla's runtime (created an XLA device)."""
    torch_xla = loaded("torch_xla")
    return torch_xla is not None and bool(torch_xla._XLAC._xla_runtime_is_initialized())


def sync() -> None:
    """Compile and run the pending lazy graph (`torch_xla.sync()`)."""
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None  # only called with XLA tensors about
    torch_xla.sync()


def pending_hlo_text(tensors: Sequence[torch.Tensor]) -> str:
    """The HLO module that would compute `tensors` (XLA tensors), as text."""
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None
    text: str = torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))
    return text


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on an XLA device."""
    return tensor.device.type == "xla"


def xla_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct XLA devices among `tensors`, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for tensor in tensors:
        if is_xla_tensor(tensor):
            seen.setdefault(tensor.device, None)
    return list(seen)


def tensor_id(tensor: torch.Tensor) -> int:
    """torch_xla's id of the lazy tensor behind an XLA tensor: equal for Python objects that
    stand for the same value (autograd unpacks a saved output into a new object each time)."""
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None
    return int(torch_xla._XLAC._xla_get_tensor_id(tensor))


def ir_text(tensor: torch.Tensor) -> str:
    """torch_xla's IR of an XLA tensor's pending value, as text (changes when it is written)."""
    torch_xla = loaded("torch_xla")
    assert torch_xla is not None
    text: str = torch_xla._XLAC._get_xla_tensors_text([tensor])
    return text


def is_device_data(tensor: torch.Tensor) -> bool:
    """Whether an XLA tensor is materialized data (a program input) rather than a value still
    to be computed. Read from torch_xla's description of the tensor: no cheaper public query
    exists."""
    torch_xla = loaded("torch_xla")
    if torch_xla is None or not is_xla_tensor(tensor):
        return False
    info: str = torch_xla._XLAC._get_xla_tensor_debug_info(tensor)
    ir_line = next((line for line in info.splitlines() if line.startswith("IR:")), "")
    # Data already on the device has no IR, or an IR that only points at its data.
    return ir_line.strip() == "IR: None" or "xla::device_data" in ir_line


def while_loop(body: Callable[..., Any], init: Any, xs: Any, *, reverse: bool = False) -> Any:
    """torch_xla's scan lowering (an XLA While loop of `body`, traced once).

    torch_xla traces the body on placeholder tensors with no data, and a sync that finds one
    still alive crashes the process (torch_xla 2.9: a segmentation fault). An error raised
    while tracing holds them in its traceback's frames for as long as anyone keeps the error
    (a `pytest.raises`, a logger), so it leaves without those frames: its traceback as text
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
    """`take(stack, i)` (layer `i`'s slice) and `overwrite(stack, value, i)` (the stack
    with that slice replaced) for a scalar index tensor: XLA DynamicSlice and
    DynamicUpdateSlice, which torch's indexing does not lower to."""
    import torch_xla.core.xla_op_registry as xor
    from torch_xla.experimental.scan import dynamic_slice, dynamic_update_slice

    return (
        xor.register("xla_wrap_layer_slice", dynamic_slice),
        xor.register("xla_wrap_layer_overwrite", dynamic_update_slice),
    )


def spmd_active() -> bool:
    """Whether torch_xla runs this process in SPMD mode (`torch_xla.runtime.use_spmd()`)."""
    runtime = loaded("torch_xla.runtime")
    return runtime is not None and bool(runtime.is_spmd())


def in_gradient_accumulation_loop() -> bool:
    """Whether the calling code runs inside the body of torch_xla's `gradient_accumulation`
    (its XLA While loop gives each iteration a seed of its own, as an input of the traced body
    that no host-side seed can stand for)."""
    module = loaded("torch_xla.experimental.gradient_accumulation")
    if module is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == module.__name__:
            return True
        frame = frame.f_back
    return False


@contextmanager
def checkpoint_backward_status() -> Iterator[None]:
    """Tell XLA FSDP that a checkpointed block is being recomputed in backward.

    XLA FSDP reads `torch_xla.utils.checkpoint.chkpt_status.in_chkpt_bwd` to skip resharding
    parameters it is about to gather again. torch_xla's own checkpoint sets it and never resets
    it on error; here the previous value comes back in `finally`.
    """
    module = loaded("torch_xla.utils.checkpoint")
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
    """torch_xla's `XlaFullyShardedDataParallel` (imported on request: FSDP helpers only)."""
    try:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
    except ImportError:
        raise ImportError(
            "xla_wrap.fsdp: XLA FSDP needs torch_xla; install it with `pip install "
            "'xla_wrap[xla]'`, or pass the FSDP class to use as `fsdp_class=`."
        ) from None
    fsdp: type = XlaFullyShardedDataParallel
    return fsdp


# An aten op with none of these kernels runs on torch_xla's CPU fallback: it copies its inputs
# to the host, which a traced loop body's placeholders cannot be (the process dies, issue 38).
_LOWERED_KEYS = ("XLA", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


@functools.cache
def _runs_on_cpu_fallback(op: str) -> bool:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return op.startswith("aten::") and not any(has_kernel(op, key) for key in _LOWERED_KEYS)


@contextmanager
def refusing_cpu_fallbacks(refusal: Callable[[str], Exception]) -> Iterator[None]:
    """Raise `refusal(op name)` before any op that torch_xla would run on its CPU fallback
    (one without an XLA kernel or a decomposition: `_weight_norm_interface`, `_fft_r2c`), for
    code traced into a loop body. Ops whose XLA kernel falls back for some inputs are not
    seen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Refusing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if _runs_on_cpu_fallback(func.name()):
                raise refusal(func.name())
            return func(*args, **(kwargs or {}))

    with _Refusing():
        yield
