"""`python -m xla_wrap.bench.host`: host time per block, against PyTorch's `checkpoint_wrapper`.

Eager CPU, one thread (`torch.set_num_threads(1)`, for less noise). A stack of residual blocks
`x + Linear(Dropout(GELU(Linear(x))))`, batch 8, three ways in one process: unwrapped, each
block wrapped by PyTorch's `checkpoint_wrapper` (its default, non-reentrant engine) and each by
[`xla_wrap.checkpoint_wrapper()`][xla_wrap.checkpoint_wrapper]. The same weights (copies of
one model) and the same seed before every step. Steps (zero the gradients, forward,
`.sum().backward()`) alternate between the variants, after warm-up steps, and each variant's
median step counts. What a wrapper adds is its median less the unwrapped one's, per block.
Once, the wrapped models' gradients are checked to equal the unwrapped model's, bitwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import xla_wrap

UNWRAPPED = "unwrapped"
PYTORCH = "torch checkpoint_wrapper"
XLA_WRAP = "xla_wrap.checkpoint_wrapper"
VARIANTS = (UNWRAPPED, PYTORCH, XLA_WRAP)
BATCH = 8
SEED = 0


class Residual(nn.Module):
    """`x + Linear(Dropout(GELU(Linear(x))))`, all `width` wide."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


@dataclass
class HostTimes:
    """Step times of the three variants at one size.

    Attributes:
        blocks: Residual blocks in the model.
        width: Their width.
        steps: Timed steps per variant.
        median_ms: Median step time per variant, in milliseconds.
        us_per_block: Per wrapper, microseconds its median adds over the unwrapped one's, per
            block.
        ratio: xla_wrap's median over PyTorch's.
        grads_equal: Per wrapper, whether its gradients equal the unwrapped model's bitwise.
    """

    blocks: int
    width: int
    steps: int
    median_ms: dict[str, float]
    us_per_block: dict[str, float]
    ratio: float
    grads_equal: dict[str, bool]


def _pytorch_wrapper() -> Callable[[nn.Module], nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper


def _models(blocks: int, width: int) -> dict[str, nn.Sequential]:
    torch.manual_seed(SEED)
    plain = nn.Sequential(*(Residual(width) for _ in range(blocks)))
    wraps = {PYTORCH: _pytorch_wrapper(), XLA_WRAP: xla_wrap.checkpoint_wrapper}
    models = {UNWRAPPED: plain}
    for variant, wrap in wraps.items():
        models[variant] = nn.Sequential(*(wrap(block) for block in copy.deepcopy(plain)))
    return models


def _step(model: nn.Module, x: torch.Tensor) -> float:
    """One training step, seeded; returns its seconds."""
    torch.manual_seed(SEED)
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return time.perf_counter() - start


def measure(blocks: int = 32, width: int = 256, steps: int = 25, warmup: int = 3) -> HostTimes:
    """Times the three variants' steps, interleaved, and checks their gradients.

    Args:
        blocks: Residual blocks in the model, each wrapped.
        width: Their width.
        steps: Timed steps per variant.
        warmup: Untimed steps per variant first.

    Returns:
        The medians, what each wrapper adds per block, and the gradient verdicts.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = _models(blocks, width)
        x = torch.randn(BATCH, width)
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for index in range(warmup + steps):
            for variant, model in models.items():
                seconds = _step(model, x)
                if index >= warmup:
                    times[variant].append(seconds)
        grads = {}
        for variant, model in models.items():
            _step(model, x)
            grads[variant] = [p.grad for p in model.parameters()]
    finally:
        torch.set_num_threads(threads)
    median_ms = {variant: 1e3 * statistics.median(t) for variant, t in times.items()}
    plain_ms = median_ms[UNWRAPPED]
    return HostTimes(
        blocks=blocks,
        width=width,
        steps=steps,
        median_ms=median_ms,
        us_per_block={v: 1e3 * (median_ms[v] - plain_ms) / blocks for v in (PYTORCH, XLA_WRAP)},
        ratio=median_ms[XLA_WRAP] / median_ms[PYTORCH],
        grads_equal={v: _equal(grads[v], grads[UNWRAPPED]) for v in (PYTORCH, XLA_WRAP)},
    )


def _equal(grads: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> bool:
    return len(grads) == len(reference) and all(
        g is not None and r is not None and torch.equal(g, r)
        for g, r in zip(grads, reference, strict=True)
    )


def render(results: Sequence[HostTimes]) -> str:
    """A Markdown table of the medians, then the gradient verdicts."""
    lines = [
        "| blocks | width | variant | median ms | µs/block added | / PyTorch |",
        "|--:|--:|---|--:|--:|--:|",
    ]
    for r in results:
        for variant, ms in r.median_ms.items():
            added = f"{r.us_per_block[variant]:.1f}" if variant in r.us_per_block else "-"
            ratio = {PYTORCH: "1.00x", XLA_WRAP: f"{r.ratio:.2f}x"}.get(variant, "-")
            lines.append(f"| {r.blocks} | {r.width} | {variant} | {ms:.3f} | {added} | {ratio} |")
    lines.append("")
    for r in results:
        verdicts = ", ".join(f"{v} {'yes' if ok else 'NO'}" for v, ok in r.grads_equal.items())
        lines.append(f"width {r.width}: gradients equal to unwrapped (bitwise): {verdicts}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m xla_wrap.bench.host [--blocks N] [--width W] ...`."""
    parser = argparse.ArgumentParser(
        prog="python -m xla_wrap.bench.host",
        description="Host time per block of xla_wrap's and PyTorch's checkpoint_wrapper.",
    )
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--width", type=int, action="append", help="default: 256 and 16")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    if min(args.blocks, args.steps, *(args.width or [1])) < 1 or args.warmup < 0:
        parser.error("--blocks, --width and --steps must be positive, --warmup not negative")
    widths = args.width or [256, 16]
    results = [measure(args.blocks, width, args.steps, args.warmup) for width in widths]
    print(
        f"xla_wrap from {xla_wrap.__file__}; torch {torch.__version__}\n"
        f"eager CPU, torch.set_num_threads(1); batch {BATCH}; median of {args.steps} steps per "
        f"variant, interleaved, after {args.warmup} warm-up steps each\n"
    )
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0 if all(all(r.grads_equal.values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
