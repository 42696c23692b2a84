"""Double backward through checkpoints: a gradient-penalty step on XLA, measured in one process.

Each step differentiates the loss with ``create_graph=True``, adds the squared norm of the
input gradient to the loss (as the R1 and WGAN-GP penalties do) and differentiates that, so the
second backward runs through the first one's graph and through every checkpointed block. For
residual MLP blocks with Dropout it prints, with and without the penalty, the compiled peak
(XLA's buffer assignment, barriers kept), the matrix products in the program, and whether loss
and gradients equal the unwrapped model's:

    python examples/gradient_penalty.py               # 4 blocks, width 128, about a minute
    python examples/gradient_penalty.py --blocks 2 --dim 32 --seq 16

The penalty step recomputes one forward, like a plain step, but keeps most activations anyway:
the derivative of a derivative reads the forward's values (docs/guide.md, Double backward).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4, help="residual blocks (default 4)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
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
    from xla_wrap import introspect

    introspect.enable_compile_dumps()
    device = torch_xla.device()

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.Tanh(), nn.Linear(4 * dim, dim))
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(self.mlp(self.norm(x)))

    generator = torch.Generator().manual_seed(0)
    data = torch.randn(args.batch, args.seq, args.dim, generator=generator).to(device)
    results = {}
    for penalty in (False, True):
        for checkpointed in (False, True):
            name = (penalty, checkpointed)
            label = f"{'penalty' if penalty else 'plain'} step, " + (
                "xla_wrap" if checkpointed else "no checkpointing"
            )
            print(f"{label}: compiling and running one training step ...", flush=True)
            torch.manual_seed(0)
            model = nn.Sequential(*(Block(args.dim) for _ in range(args.blocks)))
            if checkpointed:
                for i, block in enumerate(model):
                    model[i] = xla_wrap.checkpoint_wrapper(block)
            model.to(device)
            torch_xla.sync()
            xm.set_rng_state(7, str(device))
            losses = []

            def step(model: nn.Module = model, penalty: bool = penalty, losses: list = losses):
                x = data.clone().requires_grad_()
                loss = model(x).pow(2).mean()
                if penalty:
                    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
                    loss = loss + grad_x.pow(2).sum()
                loss.backward()
                torch_xla.sync()
                losses.append(loss)

            program = introspect.compiled_memory(step)
            grads = [p.grad.cpu() for p in model.parameters()]
            results[name] = (label, program.total_mib, program.count("dot"), losses[0], grads)

    print()
    print(f"{'':<36}{'peak MiB':>10}{'dots':>7}  loss, grads equal the unwrapped model's")
    for (penalty, _), (label, mib, dots, loss, grads) in results.items():
        _, _, _, base_loss, base_grads = results[(penalty, False)]
        same = torch.allclose(loss.cpu(), base_loss.cpu(), rtol=1e-5) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(grads, base_grads, strict=True)
        )
        print(f"{label:<36}{mib:>10.2f}{dots:>7}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
