"""`python -m xla_wrap.bench.openxla`: checkpoints through torch_xla's Dynamo backend, with and
without barriers, on XLA:CPU with barriers kept.

A pre-LayerNorm transformer stack, its training step compiled with `torch.compile` in one
process, six ways:

- without checkpointing, on `backend="openxla"`;
- every block checkpointed, on `"openxla"` (recomputes, saves nothing: XLA runs every
  recomputation at the start of the backward program);
- on `"openxla"` with TorchTPU's barrier placement (one after each recomputed leaf node,
  written from its description: `xla_wrap.internal.leaf_barriers`);
- on [`xla_wrap.openxla_backend`][xla_wrap.openxla_backend] (one barrier per block, tied to
  the gradient arriving at it);
- with both placements (xla_wrap's region pass handed to the leaf-barrier backend, where it
  runs before the backend's own pass);
- on `openxla_backend`, keeping the matrix products (`dots_saveable`).

For each: the compiled step's peak (XLA's buffer assignment of its largest program), the dot
products and barriers of that program, and whether loss and gradients equal the eager
uncheckpointed model's. `examples/compiled_openxla.py` runs it; `python -m xla_wrap.bench
--compile` runs it at 4 and 8 blocks where torch_xla is installed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..internal import KEEP_BARRIERS_FLAG

VARIANTS = (
    "no checkpointing",
    "xla_wrap, openxla",
    "xla_wrap, leaf barriers",
    "xla_wrap, openxla_backend",
    "xla_wrap, region + leaf",
    "dots_saveable, openxla_backend",
)


def measure(blocks: int, dim: int, seq: int, batch: int) -> list[dict[str, Any]]:
    """The six variants at one size, in this process (whose XLA keeps its barriers: see
    `main()`); a row per variant."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    from torch import nn
    from torch._dynamo.backends.common import aot_autograd

    import xla_wrap
    from xla_wrap import internal, introspect

    introspect.enable_compile_dumps()
    device = torch_xla.device()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    plain = Stack()
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(1))
    expected_loss = plain(x)
    expected_loss.backward()
    expected = [expected_loss.detach(), *(p.grad for p in plain.parameters())]
    plain.zero_grad(set_to_none=True)

    def is_block(module: nn.Module) -> bool:
        return isinstance(module, Block)

    # TorchTPU's placement on openxla: its backward compiler puts a barrier after each
    # recomputed leaf node, then compiles as openxla does.
    settings = dict(torch._dynamo.lookup_backend("openxla").kwargs)  # type: ignore[attr-defined]
    compile_backward = settings.get("bw_compiler") or settings["fw_compiler"]

    def leaf_backward(graph_module: torch.fx.GraphModule, inputs: Any) -> Any:
        internal.leaf_barriers(graph_module, internal.xla_barrier)
        return compile_backward(graph_module, inputs)

    leaves = aot_autograd(**{**settings, "bw_compiler": leaf_backward})
    both = xla_wrap.with_region_barriers(leaves, barrier=internal.xla_barrier)
    setups: dict[str, tuple[str | None, Any]] = {
        "no checkpointing": (None, "openxla"),
        "xla_wrap, openxla": ("full", "openxla"),
        "xla_wrap, leaf barriers": ("full", leaves),
        "xla_wrap, openxla_backend": ("full", xla_wrap.openxla_backend),
        "xla_wrap, region + leaf": ("full", both),
        "dots_saveable, openxla_backend": ("dots_saveable", xla_wrap.openxla_backend),
    }
    rows = []
    for index, name in enumerate(VARIANTS, start=1):
        print(f"[{index}/{len(VARIANTS)}] {name}: compiling and running ...", flush=True)
        checkpointing, backend = setups[name]
        model = copy.deepcopy(plain)
        if checkpointing is not None:
            policy = None if checkpointing == "full" else checkpointing
            xla_wrap.apply_activation_checkpointing(model, is_block, policy=policy)
        model.to(device)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss: list[torch.Tensor] = []

        def step(compiled: Any = compiled, loss: list = loss) -> None:
            loss.append(compiled(x.to(device)))
            loss[-1].backward()
            torch_xla.sync()

        program = introspect.compiled_memory(step)
        got = [loss[0].cpu(), *(p.grad.cpu() for p in model.parameters() if p.grad is not None)]
        equal = all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, expected, strict=True)
        )
        rows.append(
            {
                "variant": name,
                "blocks": blocks,
                "peak_mib": program.total_mib,
                "dots": program.count("dot"),
                "barriers": program.count("opt-barrier"),
                "grads_equal": equal,
            }
        )
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a fixed-width table."""
    lines = [f"{'':<32}{'peak MiB':>10}{'dots':>7}{'barriers':>10}  gradients equal"]
    for r in rows:
        lines.append(
            f"{r['variant']:<32}{r['peak_mib']:>10.2f}{r['dots']:>7}{r['barriers']:>10}  "
            f"{'yes' if r['grads_equal'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m xla_wrap.bench.openxla [--blocks N] [--dim D] [--seq S]
    [--batch B] [--json PATH]`."""
    parser = argparse.ArgumentParser(
        prog="python -m xla_wrap.bench.openxla", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows here")
    args = parser.parse_args(argv)
    # Before torch_xla creates its device: keep barriers on XLA:CPU.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    if KEEP_BARRIERS_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {KEEP_BARRIERS_FLAG}".strip()
    rows = measure(args.blocks, args.dim, args.seq, args.batch)
    print(f"\n{args.blocks} blocks, width {args.dim}, sequence {args.seq}, batch {args.batch}")
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["grads_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
