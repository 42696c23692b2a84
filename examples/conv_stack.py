"""The first seed report's model on XLA:CPU: does checkpointing save memory, and is it correct?

A stack of 1x1-convolution blocks (conv, ReLU, conv, ReLU), every block but the first
checkpointed, trained for a step three ways: without checkpointing, with
``torch_xla.utils.checkpoint``, and with ``xla_wrap.checkpoint_wrapper``. For each it prints the
compiled peak memory (XLA's own buffer assignment), how many convolution/dot instructions the
optimized program runs (the recomputation adds one forward per checkpointed block), whether the
gradients equal the unwrapped model's, and whether later steps reuse the compiled program.

Each variant runs in a fresh Python process, because XLA reads its flags at start-up. Barriers
are kept by default (``--xla_disable_hlo_passes=cse_barrier_expander``): stock XLA:CPU deletes
them, and then no checkpointing saves memory; ``--stock`` shows that.

    python examples/conv_stack.py                      # the default, about a minute on 2 cores
    python examples/conv_stack.py --blocks 4 --channels 32 --stock
"""

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

VARIANTS = ("none", "torch_xla.utils.checkpoint", "xla_wrap.checkpoint_wrapper")
KEEP_BARRIERS = "--xla_disable_hlo_passes=cse_barrier_expander"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=16, help="number of blocks (default 16)")
    parser.add_argument("--channels", type=int, default=256, help="channels (default 256)")
    parser.add_argument("--size", type=int, default=14, help="height and width (default 14)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument(
        "--stock", action="store_true", help="leave XLA:CPU's barrier-stripping pass enabled"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Inside a fresh process: build, compile and run one variant; return its figures."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from torch import nn
    from torch_xla.utils.checkpoint import checkpoint as torch_xla_checkpoint

    import xla_wrap
    from xla_wrap import introspect

    device = torch_xla.device()
    torch.manual_seed(0)
    c = args.channels
    blocks = nn.ModuleList(
        nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 1), nn.ReLU())
        for _ in range(args.blocks)
    ).to(device)
    if args.worker == "xla_wrap.checkpoint_wrapper":
        for i in range(1, len(blocks)):
            blocks[i] = xla_wrap.checkpoint_wrapper(blocks[i])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, c, args.size, args.size, generator=generator).to(device)

    def step() -> None:
        for p in blocks.parameters():
            p.grad = None
        h = x
        for i, block in enumerate(blocks):
            if args.worker == "torch_xla.utils.checkpoint" and i > 0:
                h = torch_xla_checkpoint(block, h)
            else:
                h = block(h)
        h.mean().backward()
        torch_xla.sync()

    program = introspect.compiled_programs(step)[0]
    compiles = met.metric_data("CompileTime")[0]
    for _ in range(2):
        step()
    grads = {name: p.grad.cpu() for name, p in blocks.named_parameters()}
    torch.save(grads, args.result.with_suffix(".pt"))
    return {
        "variant": args.worker,
        "peak_bytes": program.total_bytes,
        "conv_dot_ops": program.count("convolution") + program.count("dot"),
        "barriers": program.count("opt-barrier"),
        "recompiles_after_warm_up": met.metric_data("CompileTime")[0] - compiles,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = run_variant(args)
        args.result.write_text(json.dumps(result))
        return 0

    flags = [] if args.stock else [KEEP_BARRIERS]
    mode = "stock XLA:CPU (barriers stripped)" if args.stock else f"barriers kept ({KEEP_BARRIERS})"
    print(
        f"conv stack: {args.blocks} blocks x {args.channels} channels, "
        f"{args.size}x{args.size}, batch {args.batch}; XLA:CPU, {mode}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="xla_wrap_demo_") as tmp:
        for index, variant in enumerate(VARIANTS, 1):
            print(f"[{index}/{len(VARIANTS)}] {variant}: compiling and running ...", flush=True)
            started = time.monotonic()
            result_path = Path(tmp) / f"variant{index}.json"
            env = dict(os.environ, PJRT_DEVICE="CPU")
            env["XLA_FLAGS"] = " ".join(
                [*flags, f"--xla_dump_to={Path(tmp) / f'dump{index}'}", env.get("XLA_FLAGS", "")]
            ).strip()
            command = [sys.executable, __file__, *_forwarded(args)]
            command += ["--worker", variant, "--result", str(result_path)]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
                results.append({"variant": variant, "error": lines[-1]})
                print(f"      failed: {lines[-1]}", flush=True)
                continue
            result = json.loads(result_path.read_text())
            result["grads"] = str(result_path.with_suffix(".pt"))
            results.append(result)
            print(f"      done in {time.monotonic() - started:.0f} s", flush=True)
        _compare_gradients(results)
    for result in results:
        result.pop("grads", None)
    print()
    print(_table(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"config": vars(args) | {"json": str(args.json)}, "results": results}, indent=2
            )
        )
        print(f"\nwrote {args.json}")
    return 0 if all("error" not in r for r in results) else 1


def _forwarded(args: argparse.Namespace) -> list[str]:
    return [
        f"--blocks={args.blocks}",
        f"--channels={args.channels}",
        f"--size={args.size}",
        f"--batch={args.batch}",
    ]


def _compare_gradients(results: list[dict[str, Any]]) -> None:
    import torch

    reference = results[0]
    if "error" in reference:
        return
    expected = torch.load(reference["grads"])
    for result in results[1:]:
        if "error" in result:
            continue
        got = torch.load(result["grads"])
        result["grads_match_none"] = expected.keys() == got.keys() and all(
            torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-7) for k in expected
        )


def _table(results: list[dict[str, Any]]) -> str:
    reference = results[0] if "error" not in results[0] else None
    header = (
        "variant",
        "peak MiB",
        "vs none",
        "conv+dot ops",
        "recompute ops",
        "grads = none",
        "recompiles",
    )
    rows = [header]
    for r in results:
        if "error" in r:
            rows.append((r["variant"], "crashed: " + r["error"][:60], "", "", "", "", ""))
            continue
        ratio = f"{r['peak_bytes'] / reference['peak_bytes']:.2f}x" if reference else "-"
        extra = r["conv_dot_ops"] - reference["conv_dot_ops"] if reference else "-"
        match = r.get("grads_match_none")
        rows.append(
            (
                r["variant"],
                f"{r['peak_bytes'] / 2**20:.2f}",
                ratio,
                str(r["conv_dot_ops"]),
                str(extra),
                "reference" if match is None else ("yes" if match else "NO"),
                str(r["recompiles_after_warm_up"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


if __name__ == "__main__":
    sys.exit(main())
