"""`python -m xla_wrap.bench`: every checkpointing tool side by side on XLA:CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..internal import KEEP_BARRIERS_FLAG
from .models import MODELS, PLAN_ONLY_MODELS, SHARDED_DEVICES
from .report import compare, render_chart, render_plan_table, render_table
from .variants import DEPTH_VARIANTS, OPT_IN, TRANSFORMER_ONLY, VARIANTS

DEFAULT_VARIANTS = ",".join(v for v in VARIANTS if v not in OPT_IN)
# The depth sweep's transformer: the mask a buffer of each block (torch_xla's scan_layers takes
# no keyword arguments), Dropout off (it crashes with Dropout on torch_xla 2.9).
DEPTH_SIZES = {"mask_buffer": 1, "dropout_pct": 0}

# mask_buffer=1: every block keeps the causal mask as a buffer instead of taking it as an argument.
_TRANSFORMER = {
    "blocks": 6, "dim": 128, "heads": 4, "seq": 128, "batch": 8, "dropout_pct": 10, "mask_buffer": 0
}  # fmt: skip
_QUICK_TRANSFORMER = {
    "blocks": 3, "dim": 16, "heads": 2, "seq": 8, "batch": 4, "dropout_pct": 10, "mask_buffer": 0
}  # fmt: skip
DEFAULT_SIZES = {
    "conv": {"blocks": 16, "channels": 256, "size": 14, "batch": 16},
    "transformer": _TRANSFORMER,
    "transformer-fsdpv2": _TRANSFORMER,
    "uneven": {"blocks": 8, "dim": 128, "batch": 1024, "dropout_pct": 10},
}
QUICK_SIZES = {
    "conv": {"blocks": 3, "channels": 8, "size": 4, "batch": 2},
    "transformer": _QUICK_TRANSFORMER,
    "transformer-fsdpv2": _QUICK_TRANSFORMER,
    "uneven": {"blocks": 4, "dim": 16, "batch": 32, "dropout_pct": 10},
}
# The plan section's models: (label, model, sizes changed from the defaults).
PLAN_GROUPS: tuple[tuple[str, str, dict[str, int]], ...] = (
    ("transformer, Dropout off", "transformer", {"dropout_pct": 0}),
    ("transformer, Dropout 0.1", "transformer", {}),
    ("uneven MLP blocks, Dropout 0.1", "uneven", {}),
)
# Under FSDP only the tools that run on XLA with the right gradients are worth compiling: the
# others crash or give wrong gradients already without sharding (see the other models).
SHARDED_VARIANTS = (
    "none",
    "torch_xla.utils.checkpoint",
    "xla_wrap",
    "xla_wrap scan",
    "xla_wrap scan stacked",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m xla_wrap.bench",
        description="Compare activation-checkpointing tools on XLA:CPU: does each run, are its "
        "gradients right, what is its compiled peak memory, how much does it recompute, how "
        "fast is a step. Every (model, variant) runs in a fresh process. All but the first "
        "block are checkpointed.",
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma-separated; transformer-fsdpv2 is the transformer under SPMD FSDPv2 on "
        f"{SHARDED_DEVICES} virtual CPU devices (figures per device)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, among {', '.join(VARIANTS)} (default: all but {', '.join(OPT_IN)})",
    )
    parser.add_argument(
        "--steps",
        type=_positive,
        default=8,
        help="timed steps per variant (interleaved, one process)",
    )
    parser.add_argument(
        "--timeout", type=_positive, default=1800, help="seconds one process may take"
    )
    parser.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="MODEL.KEY=N",
        help="override a size, e.g. conv.channels=128 or transformer.blocks=4 (repeatable)",
    )
    parser.add_argument(
        "--depth",
        type=_depths,
        help="a depth sweep instead, e.g. 12,24,48: the transformer at each number of blocks "
        "(mask as a buffer, Dropout off), Python loops against scanned stacks "
        f"(default variants: {', '.join(DEPTH_VARIANTS)})",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="the plan section instead: xla_wrap.plan_checkpointing at three budgets against "
        "every uniform plan, on the transformer (Dropout off and on) and on blocks of unequal "
        "sizes",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the torch.compile section instead (and, with torch_xla, the openxla backend with "
        "and without barriers at 4 and 8 blocks): the transformer compiled with inductor on the "
        "CPU, none against PyTorch's checkpoint wrapper and xla_wrap (default, dots_saveable): "
        "graph breaks, bytes saved for backward, backward matmuls, compile seconds, step time; "
        "a depth sweep (loop against scan); and xla_wrap's plan against PyTorch's "
        "activation_memory_budget at 5 budgets",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--stock", action="store_true", help="keep XLA:CPU's barrier-stripping pass (no savings)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="JSON and PNG")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _depths(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive block counts such as 12,24,48, got {text!r}"
        )
    return [int(p) for p in parts]


def variant_groups(
    args: argparse.Namespace, models: list[str], variants: list[str], explicit: bool
) -> list[tuple[str, str, dict[str, int], list[str]]]:
    """What to run: (label, model, sizes, variants) per table group."""
    sizes = sizes_for(args, models)
    if not args.depth:
        return [(m, m, sizes[m], variants_for(m, variants)) for m in models]
    chosen = variants if explicit else list(DEPTH_VARIANTS)
    groups = []
    for depth in args.depth:
        sized = dict(sizes["transformer"], blocks=depth)
        for key, value in DEPTH_SIZES.items():
            if f"transformer.{key}" not in " ".join(args.size):  # --size wins
                sized[key] = value
        groups.append((f"transformer, {depth} blocks", "transformer", sized, chosen))
    return groups


def sizes_for(args: argparse.Namespace, models: list[str]) -> dict[str, dict[str, int]]:
    sizes = {m: dict((QUICK_SIZES if args.quick else DEFAULT_SIZES)[m]) for m in models}
    for item in args.size:
        key, _, value = item.partition("=")
        model, _, name = key.partition(".")
        if model not in sizes or name not in sizes[model] or not value.isdigit():
            raise SystemExit(
                f"xla_wrap.bench: --size expects MODEL.KEY=N with MODEL in {sorted(sizes)} and "
                f"KEY among {sorted(sizes.get(model, {}))}; got {item!r}"
            )
        sizes[model][name] = int(value)
    for model, sized in sizes.items():
        if model.endswith("fsdpv2") and sized["batch"] % SHARDED_DEVICES:
            raise SystemExit(
                f"xla_wrap.bench: {model} splits the batch over {SHARDED_DEVICES} devices; got "
                f"batch {sized['batch']}. Pass --size {model}.batch=N with N a multiple of "
                f"{SHARDED_DEVICES}."
            )
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)
    if args.plan:
        return _plan_main(args)
    if args.compile:
        return _compile_main(args)
    models = [m for m in args.models.split(",") if m]
    if args.depth:
        models = ["transformer"]
    explicit = args.variants is not None
    variants = [v for v in (args.variants or DEFAULT_VARIANTS).split(",") if v]
    unknown = [m for m in models if m not in DEFAULT_SIZES] + [
        v for v in variants if v not in VARIANTS
    ]
    if unknown:
        raise SystemExit(
            f"xla_wrap.bench: unknown model or variant {unknown}; models: {sorted(DEFAULT_SIZES)}, "
            f"variants: {list(VARIANTS)}"
        )
    if "none" not in variants:
        variants.insert(0, "none")  # the reference every ratio is taken against
    groups = variant_groups(args, models, variants, explicit)
    flags = "" if args.stock else KEEP_BARRIERS_FLAG
    mode = "stock XLA:CPU, barriers stripped" if args.stock else f"barriers kept ({flags})"
    print(f"xla_wrap.bench on XLA:CPU, {mode}; {args.steps} timed steps per variant", flush=True)
    print("each variant compiles in a fresh process; step times come from one process per model")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    total = sum(len(g[3]) + 1 for g in groups)
    tasks = iter(range(1, total + 1))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="xla_wrap_bench_") as tmp_name:
        tmp = Path(tmp_name)
        for index, (label, model, sized, group_variants) in enumerate(groups):
            model_runs: list[dict[str, Any]] = []
            for variant in group_variants:
                grads = tmp / f"grads-{index}-{len(model_runs)}.pt"
                job: dict[str, Any] = {"task": "measure", "model": model, "variant": variant}
                job.update(sizes=sized, grads=str(grads))
                print(f"[{next(tasks)}/{total}] {label} / {variant} ...", end=" ", flush=True)
                run = {"model": label, "variant": variant, **spawn(job, flags, tmp, args.timeout)}
                if "error" not in run:
                    run["grads"] = str(grads)
                model_runs.append(run)
            ran = [r["variant"] for r in model_runs if "error" not in r]
            job = {"task": "time", "model": model, "variants": ran, "sizes": sized}
            job["steps"] = args.steps
            print(
                f"[{next(tasks)}/{total}] {label} / step times of {len(ran)} variants, "
                "interleaved ...",
                end=" ",
                flush=True,
            )
            timing = spawn(job, flags, tmp, args.timeout)
            for run in model_runs:
                variant = run["variant"]
                if variant in timing.get("step_ms", {}):
                    run["step_ms"] = timing["step_ms"][variant]
                elif "error" not in run:
                    reason = timing.get("errors", {}).get(variant) or timing.get("error")
                    run["timing_error"] = reason or "not timed"
            runs += model_runs
        compare(runs)
    for run in runs:
        run.pop("grads", None)
    table = render_table(runs, caption=f"XLA:CPU, {mode}")
    print()
    print(table)
    report = {
        "config": {
            "sizes": {label: sized for label, _, sized, _ in groups},
            "steps": args.steps,
            "barriers_kept": not args.stock,
            "xla_flags": flags,
        },
        "runs": runs,
    }
    json_path = args.out / "bench.json"
    json_path.write_text(json.dumps(report, indent=2))
    chart = render_chart(runs, args.out / "bench.png")
    print(f"\nwrote {json_path}" + (f" and {chart}" if chart else " (no matplotlib: no chart)"))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


def _plan_main(args: argparse.Namespace) -> int:
    sizes = sizes_for(args, ["transformer", *PLAN_ONLY_MODELS])
    flags = "" if args.stock else KEEP_BARRIERS_FLAG
    print(f"xla_wrap.bench plan section on XLA:CPU, barriers kept ({flags})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="xla_wrap_bench_") as tmp_name:
        for index, (label, model, changed) in enumerate(PLAN_GROUPS, start=1):
            sized = dict(sizes[model], **changed)
            job = {"task": "plan", "model": model, "sizes": sized, "steps": args.steps}
            print(f"[{index}/{len(PLAN_GROUPS)}] {label} ...", end=" ", flush=True)
            sections.append(
                {"model": label, "sizes": sized, **spawn(job, flags, Path(tmp_name), args.timeout)}
            )
    table = render_plan_table(sections)
    print()
    print(table)
    json_path = args.out / "plan.json"
    json_path.write_text(json.dumps({"steps": args.steps, "sections": sections}, indent=2))
    print(f"\nwrote {json_path}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


def _compile_main(args: argparse.Namespace) -> int:
    from . import compiled

    sizes = sizes_for(args, ["transformer"])["transformer"]
    print(
        f"xla_wrap.bench compile section: torch {_torch_version()}, inductor on the CPU "
        f"(fallback_random), {args.steps} timed steps per variant, in this process",
        flush=True,
    )
    started = time.monotonic()
    results = compiled.run(sizes, args.steps, lambda line: print(line, flush=True))
    table = compiled.render(results)
    print()
    print(table)
    depths = compiled.QUICK_SWEEP_DEPTHS if args.quick else compiled.SWEEP_DEPTHS
    print(f"\ndepth sweep at {depths} blocks, every block checkpointed ...", flush=True)
    sweep = compiled.sweep(depths, lambda line: print(line, flush=True))
    print()
    print(compiled.render_sweep(sweep))
    fractions = compiled.QUICK_BUDGET_FRACTIONS if args.quick else compiled.BUDGET_FRACTIONS
    backend = "aot_eager" if args.quick else "inductor"
    print(f"\nbudgets {fractions}: PyTorch's activation_memory_budget and xla_wrap's plan, "
          f"step times on {backend} ...", flush=True)  # fmt: skip
    budgets = compiled.budgets(
        sizes, fractions, args.steps, lambda line: print(line, flush=True), backend
    )
    print()
    print(compiled.render_budgets(budgets))
    args.out.mkdir(parents=True, exist_ok=True)
    openxla = _openxla_rows(args.quick, args.out)
    json_path = args.out / "compile.json"
    json_path.write_text(
        json.dumps(
            {
                "sizes": sizes,
                "steps": args.steps,
                "runs": results,
                "sweep": sweep,
                "budgets": budgets,
                "openxla": openxla,
            },
            indent=2,
        )
    )
    print(f"\nwrote {json_path}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


# torch_xla's Dynamo backend, barriers kept: (blocks, width, sequence, batch) per run.
OPENXLA_SIZES = ((4, 64, 128, 8), (8, 64, 128, 8))
QUICK_OPENXLA_SIZES = ((2, 32, 32, 4),)


def _openxla_rows(quick: bool, out: Path) -> list[dict[str, Any]]:
    """Where torch_xla is installed: `xla_wrap.bench.openxla` at each size, each in a process
    of its own (XLA reads its flags at start); its rows, or none."""
    import importlib.util

    from .openxla import render

    if importlib.util.find_spec("torch_xla") is None:
        print("\ntorch_xla is not installed: no openxla rows", flush=True)
        return []
    rows: list[dict[str, Any]] = []
    for blocks, dim, seq, batch in QUICK_OPENXLA_SIZES if quick else OPENXLA_SIZES:
        print(f"\nopenxla, {blocks} blocks (barriers kept, a process of its own) ...", flush=True)
        path = out / f"openxla-{blocks}.json"
        command = [sys.executable, "-m", "xla_wrap.bench.openxla", f"--blocks={blocks}"]
        command += [f"--dim={dim}", f"--seq={seq}", f"--batch={batch}", f"--json={path}"]
        env = {**os.environ, "PJRT_DEVICE": "CPU"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if not path.exists():
            print(f"failed:\n{done.stderr[-2000:]}", flush=True)
            continue
        measured = json.loads(path.read_text())
        print(render(measured), flush=True)
        rows += measured
    return rows


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def variants_for(model: str, variants: list[str]) -> list[str]:
    if model.endswith("fsdpv2"):
        return [v for v in variants if v in SHARDED_VARIANTS]
    if model == "transformer":
        return variants
    return [v for v in variants if v not in TRANSFORMER_ONLY]


def spawn(job: dict[str, Any], flags: str, tmp: Path, timeout: float) -> dict[str, Any]:
    """Run `job` in a fresh Python (XLA reads its flags at start-up) and return its result,
    or an error saying how the process ended."""
    handle, name = tempfile.mkstemp(dir=tmp, suffix=".json")
    os.close(handle)
    result_path = Path(name)
    job = dict(job, result=str(result_path))
    env = dict(os.environ, PJRT_DEVICE="CPU")
    if str(job.get("model", "")).endswith("fsdpv2"):
        env["CPU_NUM_DEVICES"] = str(SHARDED_DEVICES)
    dump = tmp / ("dump-" + result_path.stem)
    # The user's own XLA flags stay; ours come last so that they win.
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), flags, f"--xla_dump_to={dump}"]).strip()
    command = [sys.executable, "-m", "xla_wrap.bench", "--worker", json.dumps(job)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        result = _read_result(result_path, done)
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {timeout:.0f} s (raise --timeout)"}
    status = f"crashed: {result['error']}" if "error" in result else "ok"
    print(f"{status} ({time.monotonic() - t0:.0f} s)", flush=True)
    return result


def _read_result(path: Path, done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads(path.read_text())
        return result
    except (OSError, ValueError):
        pass
    # The process died (an abort inside XLA, say): report its most telling last words.
    lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    telling = [
        line for line in lines if "rror" in line or "Check failed" in line or "abort" in line
    ]
    last = (telling or lines or [""])[-1][:200]
    return {"error": f"process died (exit {done.returncode}): {last}"}


def _worker_main(job_text: str) -> int:
    from .worker import measure, plan_section, time_variants

    job = json.loads(job_text)
    if job["task"] not in ("measure", "time", "plan"):
        raise KeyError(f"unknown benchmark task {job['task']!r}")
    if job["task"] == "measure":
        result = measure(job["model"], job["variant"], job["sizes"], Path(job["grads"]))
    elif job["task"] == "plan":
        result = plan_section(job["model"], job["sizes"], job["steps"])
    else:
        result = time_variants(job["model"], job["variants"], job["sizes"], job["steps"])
    Path(job["result"]).write_text(json.dumps(result))
    return 0
