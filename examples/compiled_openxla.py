"""Checkpoint through torch.compile on torch_xla: the openxla backend with and without barriers.

Builds a pre-LayerNorm transformer stack and compiles its training step with torch_xla's
Dynamo backends, in one process: without checkpointing on ``backend="openxla"``, every block
checkpointed on ``backend="openxla"`` (recomputes, saves nothing: XLA runs every recomputation
at the start of the backward program), on ``openxla`` with TorchTPU's barrier placement (one
after each recomputed leaf node, written from its description), on
``backend=xla_wrap.openxla_backend`` (one barrier per block, tied to the gradient arriving at
it), with both placements, and on ``openxla_backend`` keeping the matrix products
(``dots_saveable``). For each it prints the compiled step's peak (XLA's buffer assignment of
its largest program, barriers kept), the dot products and barriers of that program, and
whether loss and gradients equal the eager uncheckpointed model's.

    python examples/compiled_openxla.py                  # 4 blocks, width 64, about a minute
    python examples/compiled_openxla.py --blocks 2 --dim 32 --seq 32

docs/compile.md says which path to use where.
"""

from __future__ import annotations

import argparse
import copy
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    args = parser.parse_args()

    # Before torch_xla creates its device: keep barriers on XLA:CPU.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()

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
        def __init__(self, dim: int) -> None:
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
            self.blocks = nn.ModuleList(Block(args.dim) for _ in range(args.blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    plain = Stack()
    x = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(1))
    expected_loss = plain(x)
    expected_loss.backward()
    expected = [expected_loss.detach(), *(p.grad for p in plain.parameters())]
    plain.zero_grad(set_to_none=True)
    is_block = lambda m: isinstance(m, Block)  # noqa: E731

    def ours(model: nn.Module) -> None:
        xla_wrap.apply_activation_checkpointing(model, is_block)

    def ours_dots(model: nn.Module) -> None:
        xla_wrap.apply_activation_checkpointing(model, is_block, policy="dots_saveable")

    # TorchTPU's placement on openxla: its backward compiler puts a barrier after each
    # recomputed leaf node, then compiles as openxla does.
    settings = dict(torch._dynamo.lookup_backend("openxla").kwargs)
    compile_backward = settings.get("bw_compiler") or settings["fw_compiler"]

    def leaf_backward(graph_module: torch.fx.GraphModule, inputs: list) -> object:
        internal.leaf_barriers(graph_module, internal.xla_barrier)
        return compile_backward(graph_module, inputs)

    leaves = aot_autograd(**{**settings, "bw_compiler": leaf_backward})
    # xla_wrap's region barriers handed to that backend: placed before its own leaf pass.
    both = xla_wrap.with_region_barriers(leaves, barrier=internal.xla_barrier)

    variants = [
        ("no checkpointing", None, "openxla"),
        ("xla_wrap, openxla", ours, "openxla"),
        ("xla_wrap, leaf barriers", ours, leaves),
        ("xla_wrap, openxla_backend", ours, xla_wrap.openxla_backend),
        ("xla_wrap, region + leaf", ours, both),
        ("dots_saveable, openxla_backend", ours_dots, xla_wrap.openxla_backend),
    ]
    rows = []
    for index, (name, wrap, backend) in enumerate(variants, start=1):
        print(f"[{index}/{len(variants)}] {name}: compiling and running ...", flush=True)
        model = copy.deepcopy(plain)
        if wrap is not None:
            wrap(model)
        model.to(device)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss = []

        def step(compiled: nn.Module = compiled, loss: list = loss) -> None:
            loss.append(compiled(x.to(device)))
            loss[-1].backward()
            torch_xla.sync()

        program = introspect.compiled_memory(step)
        got = [loss[0].cpu(), *(p.grad.cpu() for p in model.parameters())]
        equal = all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, expected, strict=True)
        )
        rows.append(
            (name, program.total_mib, program.count("dot"), program.count("opt-barrier"), equal)
        )

    print(f"\n{'':<32}{'peak MiB':>10}{'dots':>7}{'barriers':>10}  gradients equal")
    for name, peak, dots, barriers, equal in rows:
        print(f"{name:<32}{peak:>10.2f}{dots:>7}{barriers:>10}  {'yes' if equal else 'NO'}")


if __name__ == "__main__":
    main()
