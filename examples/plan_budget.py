"""Fit a memory budget: let xla_wrap plan what to checkpoint, then train with the plan.

Builds a pre-LayerNorm transformer whose blocks differ in MLP width (some blocks cost four
times what others do) and asks ``xla_wrap.plan_checkpointing`` for the least recomputation
under a budget, a fraction of the step's compiled peak without checkpointing. It prints the
planner's progress and its plan, applies the plan, and trains a few steps with Dropout
against the unplanned model from the same seed (the losses agree to float rounding).

    python examples/plan_budget.py                      # 8 blocks, width 128, budget 0.5
    python examples/plan_budget.py --budget 0.7 --blocks 4 --dim 32 --seq 16

docs/planning.md explains what the planner measures and how it solves.
"""

from __future__ import annotations

import argparse
import copy
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=0.5, help="fraction of the unplanned peak (default 0.5)"
    )
    parser.add_argument("--blocks", type=int, default=8, help="transformer blocks (default 8)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    args = parser.parse_args()

    # Before torch_xla creates its device: keep barriers on XLA:CPU, dump the buffer assignment.
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
        def __init__(self, dim: int, mlp: int) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, 4, dropout=0.1, batch_first=True)
            self.mlp = nn.Sequential(
                nn.Linear(dim, mlp * dim), nn.GELU(), nn.Linear(mlp * dim, dim)
            )
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            h = self.norm1(x)
            x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
            return x + self.drop(self.mlp(self.norm2(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            widths = [(1, 4, 2, 4)[i % 4] for i in range(args.blocks)]  # MLP widths differ
            self.blocks = nn.ModuleList(Block(args.dim, w) for w in widths)
            self.head = nn.Linear(args.dim, 1)

        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, mask=mask)
            return self.head(x).pow(2).mean()

    torch.manual_seed(0)
    plain = Model().to(device)
    planned = copy.deepcopy(plain)
    x = torch.randn(args.batch, args.seq, args.dim).to(device)
    mask = torch.full((args.seq, args.seq), float("-inf")).triu(1).to(device)
    torch_xla.sync()

    plan = xla_wrap.plan_checkpointing(planned, x, budget=args.budget, mask=mask)
    print(plan)
    plan.apply(planned)

    losses = {}
    for name, model in (("unplanned", plain), ("planned", planned)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        xm.set_rng_state(7, str(device))  # the same Dropout masks for both
        curve = []
        for _ in range(args.steps):
            optimizer.zero_grad()
            loss = model(x, mask=mask)
            loss.backward()
            optimizer.step()
            torch_xla.sync()
            curve.append(loss.item())
        losses[name] = curve
        print(f"{name:<10} losses [{', '.join(f'{v:.6f}' for v in curve)}]")
    pairs = zip(losses["unplanned"], losses["planned"], strict=True)
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    print(f"largest relative loss difference: {worst:.2e}")


if __name__ == "__main__":
    main()
