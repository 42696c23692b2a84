"""Measure checkpointing on your own model, in one process: a stack of 1x1-conv blocks.

Builds the 1x1-conv stack (conv, ReLU, conv, ReLU per block) twice, once plain and once with
every block but the first wrapped by ``xla_wrap.checkpoint_wrapper``, and prints for each the
compiled peak memory (XLA's own buffer assignment), the FLOPs the optimized program runs, what
the forward keeps for backward, and whether the gradients agree.

    python examples/conv_stack.py                 # 16 blocks x 256 channels, about 30 s
    python examples/conv_stack.py --blocks 4 --channels 32

XLA reads its flags once, so the script sets them before creating the XLA device: barriers
kept (XLA:CPU deletes them otherwise, see docs/index.md) and compile dumps on. For every
checkpointing tool side by side, run ``python -m xla_wrap.bench``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="number of blocks (default 16)")
    parser.add_argument("--channels", type=int, default=256, help="channels (default 256)")
    parser.add_argument("--size", type=int, default=14, help="height and width (default 14)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    args = parser.parse_args()

    # Before torch_xla creates its device: keep barriers on XLA:CPU and dump compilations.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()

    import torch
    import torch_xla
    from torch import nn

    import xla_wrap

    xla_wrap.introspect.enable_compile_dumps()
    device = torch_xla.device()
    c = args.channels

    def build() -> nn.ModuleList:
        torch.manual_seed(0)
        return nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 1), nn.ReLU())
            for _ in range(args.blocks)
        )

    x = torch.randn(args.batch, c, args.size, args.size, generator=torch.Generator().manual_seed(0))
    plain = measure("no checkpointing", build(), x, device)
    blocks = build()
    for i in range(1, len(blocks)):
        blocks[i] = xla_wrap.checkpoint_wrapper(blocks[i])
    ours = measure("xla_wrap", blocks, x, device)

    same = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-7)
        for a, b in zip(plain.grads, ours.grads, strict=True)
    )
    print()
    print(f"{'':<28}{'no checkpointing':>18}{'xla_wrap':>14}")
    print(f"{'compiled peak (MiB)':<28}{plain.peak_mib:>18.2f}{ours.peak_mib:>14.2f}")
    print(f"{'kept for backward (MiB)':<28}{plain.kept_mib:>18.2f}{ours.kept_mib:>14.2f}")
    print(f"{'MFLOPs per step':<28}{plain.mflops:>18.1f}{ours.mflops:>14.1f}")
    print(f"{'optimization barriers':<28}{plain.barriers:>18}{ours.barriers:>14}")
    print(f"gradients equal: {'yes' if same else 'NO'}")


@dataclass
class Measured:
    peak_mib: float
    kept_mib: float
    mflops: float
    barriers: int
    grads: list


def measure(name: str, blocks, x, device) -> Measured:  # type: ignore[no-untyped-def]
    """One training step of ``blocks`` on XLA: compiled peak, FLOPs, barriers, gradients; and
    what the forward keeps for backward (read on the CPU, no XLA needed)."""
    import torch_xla

    from xla_wrap import introspect

    print(f"{name}: compiling and running one training step ...", flush=True)
    kept = introspect.saved_residuals(lambda t: _forward(blocks, t), x)
    blocks = blocks.to(device)
    x = x.to(device)

    def step() -> None:
        _forward(blocks, x).mean().backward()
        torch_xla.sync()

    program = introspect.compiled_memory(step)
    return Measured(
        peak_mib=program.total_mib,
        kept_mib=sum(r.nbytes for r in kept) / 2**20,
        mflops=program.flops / 1e6,
        barriers=program.count("opt-barrier"),
        grads=[p.grad.cpu() for p in blocks.parameters()],
    )


def _forward(blocks, x):  # type: ignore[no-untyped-def]
    for block in blocks:
        x = block(x)
    return x


if __name__ == "__main__":
    main()
