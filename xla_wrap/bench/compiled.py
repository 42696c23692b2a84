"""`python -m xla_wrap.bench --compile`: the benchmark's transformer under `torch.compile`
(inductor, on the CPU), without checkpointing, with PyTorch's checkpoint wrapper, and with
xla_wrap's (full recomputation and `dots_saveable`), in one process.

Per variant: graph breaks; bytes the compiled forward saves for backward and matrix products
in the backward graph (the partitioned graphs,
[`xla_wrap.introspect.PartitionedGraphs`][xla_wrap.introspect.PartitionedGraphs], the min-cut
partitioner inductor uses); inductor's compile seconds (the first step less a
compiled one); the median step time; and whether the gradients equal the uncheckpointed
compiled model's (inductor with `fallback_random`, so that Dropout draws as eager does in
every variant).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import introspect
from .models import TransformerBlock, Workload, build

VARIANTS = ("none", "torch checkpoint_wrapper", "xla_wrap", "xla_wrap dots_saveable")
_MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


def _wrap(variant: str, work: Workload) -> None:
    """Checkpoint all blocks but the first, as the rest of the benchmark does."""
    import xla_wrap

    blocks = work.blocks
    if variant == "none":
        return
    if variant == "torch checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(1, len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i])
        return
    policy = "dots_saveable" if variant.endswith("dots_saveable") else None
    first = blocks[0]
    xla_wrap.apply_activation_checkpointing(
        work.model, lambda m: isinstance(m, TransformerBlock) and m is not first, policy=policy
    )


def _step(work: Workload, run: Callable[..., Any]) -> list[torch.Tensor]:
    work.model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    run(*work.args, **work.kwargs).backward()
    return [p.grad for p in work.model.parameters() if p.grad is not None]


def measure(variant: str, sizes: dict[str, int], steps: int) -> dict[str, Any]:
    """One variant: its graphs, then inductor's compile and step times, and its gradients."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    work = build("transformer", sizes)
    _wrap(variant, work)
    torch._dynamo.reset()
    counters.clear()
    graphs = introspect.PartitionedGraphs()
    _step(work, torch.compile(work.model, backend=graphs.backend, fullgraph=True))
    result: dict[str, Any] = {
        "variant": variant,
        "graph_breaks": sum(counters["graph_break"].values()),
        "saved_bytes": graphs.saved_bytes(),
        "backward_matmuls": graphs.backward_ops(*_MATMULS),
        "recompute_tags": graphs.recompute_tags(),
    }
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(work.model, fullgraph=True)
        started = time.perf_counter()
        grads = _step(work, compiled)
        first = time.perf_counter() - started
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            _step(work, compiled)
            times.append(time.perf_counter() - started)
    step = statistics.median(times)
    result.update(compile_s=first - step, step_ms=step * 1e3, grads=[g.detach() for g in grads])
    return result


def run(sizes: dict[str, int], steps: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every variant, with ratios against `none` and a gradient verdict."""
    results = []
    for index, variant in enumerate(VARIANTS, start=1):
        progress(f"[{index}/{len(VARIANTS)}] transformer / {variant} ...")
        results.append(measure(variant, sizes, steps))
    reference, expected = results[0], results[0]["grads"]
    for result in results:
        grads = result.pop("grads")
        result["grads_equal"] = len(grads) == len(expected) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, expected, strict=True)
        )
        result["saved_ratio"] = result["saved_bytes"] / reference["saved_bytes"]
        result["time_ratio"] = result["step_ms"] / reference["step_ms"]
    return results


def render(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'variant':<26}{'breaks':>7}{'saved MiB':>11}{'vs none':>9}{'bw matmuls':>12}"
        f"{'tags':>6}{'compile s':>11}{'step ms':>9}{'vs none':>9}  grads = none"
    )
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(
            f"{r['variant']:<26}{r['graph_breaks']:>7}{r['saved_bytes'] / 2**20:>11.2f}"
            f"{r['saved_ratio']:>8.2f}x{r['backward_matmuls']:>12}{r['recompute_tags']:>6}"
            f"{r['compile_s']:>11.1f}{r['step_ms']:>9.1f}{r['time_ratio']:>8.2f}x  "
            f"{'yes' if r['grads_equal'] else 'NO'}"
        )
    return "\n".join(rows)
