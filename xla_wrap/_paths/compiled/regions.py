"""One layer of a scanned stack inside `torch.compile`: a nested compile region.

A Python loop of checkpointed layers is one graph whose every layer the compiler lowers and
optimizes anew, so compile time grows with depth. `torch.compiler.nested_compile_region`
marks a function whose graph is compiled once and called again wherever it is the same graph
(same operations, shapes, dtypes; the parameters are its inputs), as torch_xla's scan compiles
a While body once. A scanned stack says its layers are alike, so each layer's checkpointed
call goes through the same region: the compiler traces each layer, finds the graphs equal,
and lowers, partitions and generates code for one.

Only where that is correct. Inductor (torch 2.9 and 2.14.1) miscompiles a region called more
than once: the caller reuses the buffer of a region's input that the region returned as a
value saved for backward, and the region's backward inherits the caller's donated-buffer
indices, so gradients come out silently wrong (docs/compile.md has the reproduction). So a
scanned stack is one region only under a backend that runs the regions' graphs as they are
(`aot_eager`, `aot_eager_decomp_partition`, and
[`PartitionedGraphs`][xla_wrap.introspect.PartitionedGraphs]); under any other backend, or
where the installed torch has no `nested_compile_region`, each layer is a plain call (the
loop). Plain `checkpoint_wrapper` loops never come here: only a scan says its layers are alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import checkpoint_policies as cp
from .checkpoint import checkpoint


def _layer(
    layer: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    api: str,
    preserve_rng_state: bool,
    policy: Any,
) -> Any:
    # Only modules, tensors and constants come in, so that the compiler can stamp out the
    # region without tracing each layer again (torch 2.14: "subgraph_reuse").
    # A checkpoint-wrapped layer's own forward, without its checkpoint: the region's is it.
    forward: Callable[..., Any] = getattr(layer, "plain_forward", layer.forward)
    return checkpoint(
        api,
        forward,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        policy=None if policy is None else cp.from_constants(policy),
        offload_to_cpu=False,
    )


# One function object for every layer: the compiler reuses a region's graph only between
# calls of the same function.
_REGION: Callable[..., Any] | None = (
    torch.compiler.nested_compile_region(_layer)
    if hasattr(torch.compiler, "nested_compile_region")
    else None
)


# torch 2.9 drops a save policy (selective checkpointing) inside a region: the layer then
# saves everything. Measured right on 2.14.1; the versions between are not measured.
POLICIES_IN_LAYER_REGIONS = torch.torch_version.TorchVersion(torch.__version__) >= "2.14"
_SAFE = "_xla_wrap_runs_regions_as_they_are"


def runs_regions_as_they_are(backend: Any) -> Any:
    """Mark `backend` (an AOTAutograd backend whose compilers run the graphs they are given)
    as one under which a scanned stack compiles one layer."""
    setattr(backend, _SAFE, True)
    return backend


def _regions_are_safe() -> bool:
    """Whether the backend Dynamo compiles for now runs nested compile regions correctly.
    Dynamo calls this while tracing and takes its answer as a constant."""
    try:
        from torch._dynamo.backends.registry import lookup_backend
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
        backend = getattr(backend, "compiler_fn", backend)  # Dynamo's debug wrapper
        safe = [lookup_backend(name) for name in ("aot_eager", "aot_eager_decomp_partition")]
    except Exception:  # a Dynamo whose insides moved: the loop, always correct
        return False
    return any(backend is s for s in safe) or bool(getattr(backend, _SAFE, False))


_regions_are_safe._dynamo_marked_constant = True  # type: ignore[attr-defined]  # assume_constant_result


def compiles_layers_once(backend: Any) -> bool:
    """Whether a scanned stack compiles one region per layer under `backend` (a name or a
    callable, as `torch.compile` takes it): a probe compiled with it asks what a layer asks."""
    answers: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        answers.append(_regions_are_safe())
        return x + 1

    torch._dynamo.reset()
    torch.compile(probe, backend=backend, fullgraph=True)(torch.ones(1))
    return _REGION is not None and answers == [True]


def has_layer_regions() -> bool:
    """Whether this torch can compile a scanned layer once (`nested_compile_region`)."""
    return _REGION is not None


def in_layer_region(
    layer: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    api: str,
    *,
    preserve_rng_state: bool,
    policy: cp.SavePolicy | None,
) -> Any:
    """`layer(*args, **kwargs)`, one layer of a stack, checkpointed (with `policy`) as a
    nested compile region where that is right, else as the compiler's checkpoint."""
    run = _layer
    if _REGION is not None and (policy is None or POLICIES_IN_LAYER_REGIONS):
        run = _REGION if _regions_are_safe() else _layer
    spec = None if policy is None else cp.to_constants(policy)
    return run(layer, args, kwargs, api, preserve_rng_state, spec)
