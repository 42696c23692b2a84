"""Choose what a checkpoint keeps: save policies on a small transformer, measured in one process.

Trains one step of a pre-LayerNorm transformer (attention and a 4x MLP per block, Dropout)
with every block but the first checkpointed under several save policies, and prints for each
the compiled peak memory (XLA's buffer assignment), the FLOPs of the optimized program against
no checkpointing, and whether loss and gradients equal the unwrapped model's:

- full recomputation (no policy);
- ``dots_saveable``: keep the outputs of the matrix products, recompute the rest;
- ``save_only_these_names("attn")``: keep only the attention output, tagged in the block with
  ``xla_wrap.checkpoint_name``.

    python examples/save_policies.py                # 4 blocks, width 128, about a minute
    python examples/save_policies.py --blocks 2 --dim 32 --seq 16

docs/policies.md explains the policies and the trade-off on the benchmark's model.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    args = parser.parse_args()

    # Before torch_xla creates its device: keep barriers on XLA:CPU and dump compilations.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch import nn

    import xla_wrap
    from xla_wrap import checkpoint_policies as cp
    from xla_wrap import introspect

    xla_wrap.introspect.enable_compile_dumps()
    device = torch_xla.device()

    class Block(nn.Module):
        """Attention written out with products a policy can see (``nn.MultiheadAttention``
        runs as one composite function, whose inner products a policy does not see)."""

        def __init__(self, dim: int, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            weights = self.drop((q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1))
            attn = self.proj((weights @ v).transpose(1, 2).reshape(b, s, d))
            x = x + self.drop(xla_wrap.checkpoint_name(attn, "attn"))
            return x + self.drop(self.mlp(self.norm2(x)))

    variants = {
        "no checkpointing": None,
        "full recomputation": {},
        "dots_saveable": {"policy": cp.dots_saveable},
        "save_only_these_names('attn')": {"policy": cp.save_only_these_names("attn")},
    }
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.dim, generator=generator).to(device)
    results = {}
    for name, options in variants.items():
        print(f"{name}: compiling and running one training step ...", flush=True)
        torch.manual_seed(0)
        blocks = nn.Sequential(*(Block(args.dim) for _ in range(args.blocks))).to(device)
        if options is not None:
            for i in range(1, len(blocks)):
                blocks[i] = xla_wrap.checkpoint_wrapper(blocks[i], **options)
        torch_xla.sync()
        xm.set_rng_state(7, str(device))
        losses = []

        def step(blocks: nn.Module = blocks, losses: list = losses) -> None:
            loss = blocks(x).pow(2).mean()
            loss.backward()
            torch_xla.sync()
            losses.append(loss)

        program = introspect.compiled_memory(step)
        grads = [p.grad.cpu() for p in blocks.parameters()]
        results[name] = (program.total_mib, program.flops, losses[0].item(), grads)

    base_mib, base_flops, base_loss, base_grads = results["no checkpointing"]
    print()
    print(f"{'':<32}{'peak MiB':>10}{'vs none':>9}{'FLOPs vs none':>15}  loss, grads equal")
    for name, (mib, flops, loss, grads) in results.items():
        same = loss == base_loss and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(grads, base_grads, strict=True)
        )
        print(
            f"{name:<32}{mib:>10.2f}{mib / base_mib:>8.2f}x{flops / base_flops:>14.2f}x"
            f"  {'yes' if same else 'NO'}"
        )


if __name__ == "__main__":
    main()
