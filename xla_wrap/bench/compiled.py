"""`python -m xla_wrap.bench --compile`: the benchmark's transformer under `torch.compile`
(inductor, on the CPU), without checkpointing, with PyTorch's checkpoint wrapper, and with
xla_wrap's (full recomputation and `dots_saveable`), in one process.

Per variant: graph breaks; bytes the compiled forward saves for backward and matrix products
in the backward graph (the partitioned graphs,
[`xla_wrap.introspect.PartitionedGraphs`][xla_wrap.introspect.PartitionedGraphs], the min-cut
partitioner inductor uses); inductor's compile seconds (the first step less a
compiled one, with inductor's and AOTAutograd's caches off); the median step time; and
whether the gradients equal the uncheckpointed compiled model's (inductor with
`fallback_random`, so that Dropout draws as eager does in every variant).

The depth sweep (`sweep()`) compiles the bench transformer (width 64, sequence 32, batch 4)
at 4, 16 and 32 blocks, every block checkpointed, as a `checkpoint_wrapper` loop and as
`ScannedLayers`, on `aot_eager` and on inductor: compile seconds, bytes saved for backward,
whether the stack compiled as one nested compile region per layer, and the gradients against
the loop's.

The budget rows (`budgets()`) set xla_wrap's planner
([`xla_wrap.plan_checkpointing`][xla_wrap.plan_checkpointing] on the CPU) beside PyTorch's
`torch._functorch.config.activation_memory_budget` at the same fractions, on the bench
transformer: bytes saved for backward (parameters and buffers left out, for both), backward
matmuls and FLOPs (the partitioned graphs), and inductor's median step time against none.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import introspect
from ..internal import compiles_layers_once, summarize
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


def _caches_off() -> Any:
    """Inductor's and AOTAutograd's caches off, so that a compile is timed as a first one."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


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
    with inductor_config.patch(fallback_random=True), _caches_off():
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


SWEEP_SIZES = {"dim": 64, "heads": 4, "seq": 32, "batch": 4, "dropout_pct": 10, "mask_buffer": 0}
SWEEP_DEPTHS = (4, 16, 32)
QUICK_SWEEP_DEPTHS = (3,)  # the first layer, fed no gradient, is a region of its own
SWEEP_BACKENDS = ("aot_eager", "inductor")
SWEEP_VARIANTS = ("checkpoint_wrapper loop", "ScannedLayers")


def _stacked(variant: str, blocks: int) -> Workload:
    """The sweep's transformer with every block checkpointed, as a loop or as a scan."""
    import xla_wrap

    work = build("transformer", {**SWEEP_SIZES, "blocks": blocks})
    if variant == "ScannedLayers":
        work.model.blocks = xla_wrap.ScannedLayers(work.blocks)
    else:
        xla_wrap.apply_activation_checkpointing(
            work.model, lambda m: isinstance(m, TransformerBlock)
        )
    return work


def _compile_seconds(work: Workload, backend: str) -> tuple[float, list[torch.Tensor]]:
    """Compile seconds of one step (the first step less the median of three compiled ones),
    caches off, and its gradients."""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True), _caches_off():
        compiled = torch.compile(work.model, backend=backend, fullgraph=True)
        started = time.perf_counter()
        grads = [g.detach().clone() for g in _step(work, compiled)]
        first = time.perf_counter() - started
        times = []
        for _ in range(3):
            started = time.perf_counter()
            _step(work, compiled)
            times.append(time.perf_counter() - started)
    return first - statistics.median(times), grads


def _regions_and_saved(work: Workload) -> tuple[bool, int]:
    """Whether the stack compiled as nested compile regions, and the bytes its forward saves
    for backward (the partitioned graphs; their backend runs regions)."""
    torch._dynamo.reset()
    graphs = introspect.PartitionedGraphs()
    _step(work, torch.compile(work.model, backend=graphs.backend, fullgraph=True))
    forward = graphs.forward
    assert forward is not None  # the step above compiled it
    invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    regions = any(n.target is invoke for n in forward.graph.nodes) if invoke else False
    return regions, graphs.saved_bytes()


def sweep(depths: tuple[int, ...], progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Compile seconds of the loop and the scan at each depth, on each backend, in this
    process (after one warm-up compile per backend)."""
    warm = _stacked("checkpoint_wrapper loop", 1)
    for backend in SWEEP_BACKENDS:
        _compile_seconds(warm, backend)
    rows: list[dict[str, Any]] = []
    for blocks in depths:
        regions, saved = {}, {}
        for variant in SWEEP_VARIANTS:
            regions[variant], saved[variant] = _regions_and_saved(_stacked(variant, blocks))
        for variant in SWEEP_VARIANTS:
            work = _stacked(variant, blocks)
            for backend in SWEEP_BACKENDS:
                progress(f"sweep: {blocks} blocks / {variant} / {backend} ...")
                one_region = regions[variant] and compiles_layers_once(backend)
                seconds, grads = _compile_seconds(work, backend)
                rows.append(
                    {
                        "blocks": blocks,
                        "variant": variant,
                        "backend": backend,
                        "compile_s": seconds,
                        # Where the stack is the loop, it saves what the loop saves.
                        "saved_bytes": saved[variant if one_region else SWEEP_VARIANTS[0]],
                        "one_region_per_layer": one_region,
                        "grads": grads,
                    }
                )
    for row in rows:  # against the loop's, same depth and backend
        loop = next(
            r
            for r in rows
            if (r["blocks"], r["backend"], r["variant"])
            == (row["blocks"], row["backend"], SWEEP_VARIANTS[0])
        )
        exact = row["backend"] == "aot_eager"
        row["grads_equal_loop"] = all(
            torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(row["grads"], loop["grads"], strict=True)
        )
        row["compile_vs_loop"] = row["compile_s"] / loop["compile_s"]
        row["saved_vs_loop"] = row["saved_bytes"] / loop["saved_bytes"]
    for row in rows:
        del row["grads"]
    return rows


def render_sweep(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'blocks':>6}  {'variant':<24}{'backend':<11}{'regions':>8}{'compile s':>11}"
        f"{'vs loop':>9}{'saved MiB':>11}{'vs loop':>9}  grads = loop"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['blocks']:>6}  {r['variant']:<24}{r['backend']:<11}"
            f"{'yes' if r['one_region_per_layer'] else 'no':>8}{r['compile_s']:>11.1f}"
            f"{r['compile_vs_loop']:>8.2f}x{r['saved_bytes'] / 2**20:>11.2f}"
            f"{r['saved_vs_loop']:>8.2f}x  {'yes' if r['grads_equal_loop'] else 'NO'}"
        )
    return "\n".join(lines)


BUDGET_FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1)
QUICK_BUDGET_FRACTIONS = (0.5,)  # one compile per fraction; tests/plan covers the refusals


def _budget_row(
    solver: str,
    fraction: float,
    work: Workload,
    steps: int,
    backend: str,
    memory_budget: float = 1.0,
) -> dict[str, Any]:
    """One budget row: the partitioned graphs, then the step time under `backend`, with
    PyTorch's `activation_memory_budget` (1.0: its default partition)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with functorch_config.patch(activation_memory_budget=memory_budget):
        torch._dynamo.reset()
        graphs = introspect.PartitionedGraphs()
        _step(work, torch.compile(work.model, backend=graphs.backend, fullgraph=True))
        torch._dynamo.reset()
        with inductor_config.patch(fallback_random=True):
            compiled = torch.compile(work.model, backend=backend, fullgraph=True)
            _step(work, compiled)  # compiled under the budget
    times = []
    _step(work, compiled)  # warm
    with inductor_config.patch(fallback_random=True):
        for _ in range(steps):
            started = time.perf_counter()
            _step(work, compiled)
            times.append(time.perf_counter() - started)
    state = [*work.model.parameters(), *work.model.buffers()]
    return {
        "solver": solver,
        "fraction": fraction,
        "saved_bytes": graphs.saved_bytes(excluding=state),
        "backward_matmuls": graphs.backward_ops(*_MATMULS),
        "backward_gflop": graphs.backward_flops() / 1e9,
        "step_ms": statistics.median(times) * 1e3,
    }


def budgets(
    sizes: dict[str, int],
    fractions: tuple[float, ...],
    steps: int,
    progress: Callable[[str], None],
    backend: str = "inductor",
) -> list[dict[str, Any]]:
    """At each fraction, PyTorch's `activation_memory_budget` on the plain transformer, and
    xla_wrap's plan for that fraction of the unplanned step's saved bytes; a row without
    checkpointing first. The plans are made once (the frontier), then applied to copies.
    Step times under `backend` (the bench's quick run: `aot_eager`, which compiles fast)."""
    import copy

    import xla_wrap

    work = build("transformer", sizes)
    _budget_row("none", 1.0, work, 1, backend)  # the backend's first use here, untimed
    rows = [_budget_row("none", 1.0, work, steps, backend)]
    for fraction in fractions:
        progress(f"budget {fraction}: activation_memory_budget ...")
        rows.append(
            _budget_row("activation_memory_budget", fraction, work, steps, backend, fraction)
        )
        progress(f"budget {fraction}: xla_wrap.plan_checkpointing ...")
        try:
            plan = xla_wrap.plan_checkpointing(
                work.model, *work.args, budget=fraction, progress=False, **work.kwargs
            )
        except xla_wrap.BudgetUnreachableError as error:  # PyTorch's op-level solver goes lower
            least = error.smallest_peak_bytes
            rows.append({"solver": "xla_wrap plan", "fraction": fraction, "least_bytes": least})
            continue
        planned = copy.deepcopy(work)
        plan.apply(planned.model)
        row = _budget_row("xla_wrap plan", fraction, planned, steps, backend)
        rows.append({**row, "plan": summarize(plan.choices.values())})
    unplanned = rows[0]
    for row in rows:
        row["backend"] = backend
        if "least_bytes" in row:
            continue
        row["saved_vs_none"] = row["saved_bytes"] / unplanned["saved_bytes"]
        row["time_vs_none"] = row["step_ms"] / unplanned["step_ms"]
    return rows


def render_budgets(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'fraction':>8}  {'solver':<26}{'saved MiB':>10}{'vs none':>9}{'bw matmuls':>12}"
        f"{'bw GFLOP':>10}{'step ms':>9}{'vs none':>9}  plan"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "least_bytes" in r:
            least = r["least_bytes"] / 2**20
            lines.append(
                f"{r['fraction']:>8.2f}  {r['solver']:<26}{'-':>10}{'-':>9}{'-':>12}{'-':>10}"
                f"{'-':>9}{'-':>9}  unreachable: the least a plan saves is {least:.2f} MiB"
            )
            continue
        lines.append(
            f"{r['fraction']:>8.2f}  {r['solver']:<26}{r['saved_bytes'] / 2**20:>10.2f}"
            f"{r['saved_vs_none']:>8.2f}x{r['backward_matmuls']:>12}{r['backward_gflop']:>10.3f}"
            f"{r['step_ms']:>9.1f}{r['time_vs_none']:>8.2f}x  {r.get('plan', '')}"
        )
    return "\n".join(lines)
