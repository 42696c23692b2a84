"""Compile a deep stack once: a checkpointed Python loop against a scanned stack, in one process.

Builds a pre-LayerNorm transformer (attention and a 4x MLP per block) and runs its training
step three ways, each compiled in this process: every block checkpointed in the Python loop
(``xla_wrap.checkpoint_wrapper``), the blocks as one scanned stack (``xla_wrap.ScannedLayers``,
the same model code), and that stack with its parameters stored stacked
(``stack_parameters=True``: nothing per block left in the program). For each it prints the
compile seconds
(torch_xla's CompileTime metric), the Python trace time of a step, the compiled peak memory
(XLA's buffer assignment), and whether loss and gradients agree. Then it trains both with
Dropout for a few steps (the scanned stack draws its own masks: alike curves, not equal).

    python examples/scan_stack.py                    # 16 blocks, width 128, under 2 minutes
    python examples/scan_stack.py --blocks 4 --dim 32 --seq 16

docs/scan.md explains when to scan and what it measures at 12 to 48 blocks.
"""

from __future__ import annotations

import argparse
import copy
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="transformer blocks (default 16)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    args = parser.parse_args()

    # Before torch_xla creates its device: keep barriers on XLA:CPU (the loop needs them).
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()

    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from torch import nn

    import xla_wrap
    from xla_wrap import introspect

    introspect.enable_compile_dumps()
    device = torch_xla.device()

    class Block(nn.Module):
        def __init__(self, dim: int, dropout: float) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, 4, dropout=dropout, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.drop = nn.Dropout(dropout)

        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            h = self.norm1(x)
            x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
            return x + self.drop(self.mlp(self.norm2(x)))

    class Model(nn.Module):
        def __init__(self, blocks: int, dim: int, dropout: float) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(blocks))
            self.head = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:  # unchanged: a scanned list runs the stack from here
                x = block(x, mask=mask)
            return self.head(x).pow(2).mean()

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        return Model(args.blocks, args.dim, dropout)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim, generator=generator).to(device)
    mask = torch.full((args.seq, args.seq), float("-inf")).triu(1).to(device)

    def measure(model: nn.Module) -> dict[str, object]:
        model.to(device)
        torch_xla.sync()
        compile_before = met.metric_data("CompileTime")
        traced: list[float] = []

        def step() -> None:
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = model(x, mask)
            loss.backward()
            traced.append(time.perf_counter() - started)
            torch_xla.sync()
            result["loss"] = loss.item()

        result: dict[str, object] = {}
        program = introspect.compiled_memory(step)
        compile_after = met.metric_data("CompileTime")
        step()
        step()
        result.update(
            compile_s=(compile_after[1] - (compile_before[1] if compile_before else 0)) / 1e9,
            trace_ms=min(traced[1:]) * 1e3,
            peak_mib=program.total_bytes / 2**20,
            grads={name: p.grad.cpu() for name, p in model.named_parameters()},
        )
        return result

    print(f"{args.blocks} blocks, width {args.dim}, sequence {args.seq}, batch {args.batch}")
    plain = build(dropout=0.0)
    looped = copy.deepcopy(plain)
    xla_wrap.apply_activation_checkpointing(looped, lambda m: isinstance(m, Block))
    scanned = copy.deepcopy(plain)
    xla_wrap.apply_scan(scanned)  # model.blocks is now a ScannedLayers
    stacked = xla_wrap.apply_scan(copy.deepcopy(plain), stack_parameters=True)
    runs = {}
    for name, model in (
        ("checkpointed loop", looped),
        ("scanned stack", scanned),
        ("stacked parameters", stacked),
    ):
        print(f"{name}: compiling and running ...", flush=True)
        runs[name] = measure(model)
    reference = runs["checkpointed loop"]
    print(f"{'':20} {'compile s':>10} {'trace ms':>9} {'peak MiB':>9}  loss")
    for name, run in runs.items():
        print(
            f"{name:20} {run['compile_s']:10.1f} {run['trace_ms']:9.0f} {run['peak_mib']:9.1f}"
            f"  {run['loss']:.6f}"
        )
    expected: dict[str, torch.Tensor] = reference["grads"]  # type: ignore[assignment]

    def as_loop(name: str, stacked: bool) -> torch.Tensor:
        """The loop's gradient under a scanned model's parameter name: with stacked
        parameters, ``blocks.0.x`` is every block's ``blocks.<i>.x``, stacked."""
        if not (stacked and name.startswith("blocks.0.")):
            return expected[name]
        rest = name.removeprefix("blocks.0.")
        return torch.stack([expected[f"blocks.{i}.{rest}"] for i in range(args.blocks)])

    for name in ("scanned stack", "stacked parameters"):
        grads: dict[str, torch.Tensor] = runs[name]["grads"]  # type: ignore[assignment]
        pairs = [(g, as_loop(n, name == "stacked parameters")) for n, g in grads.items()]
        worst = max(float((g - e).abs().max() / e.abs().max().clamp_min(1e-30)) for g, e in pairs)
        print(f"{name}: largest gradient difference, relative to its tensor's largest: {worst:.1e}")

    print(f"training all with Dropout 0.1 for {args.steps} Adam steps ...", flush=True)
    for name in runs:
        model = build(dropout=0.1)
        if name == "checkpointed loop":
            xla_wrap.apply_activation_checkpointing(model, lambda m: isinstance(m, Block))
        else:
            xla_wrap.apply_scan(model, stack_parameters=name == "stacked parameters")
        model.to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # after stacking
        losses = []
        for _ in range(args.steps):
            optimizer.zero_grad()
            loss = model(x, mask)
            loss.backward()
            optimizer.step()
            torch_xla.sync()
            losses.append(round(loss.item(), 5))
        # Other Dropout masks than the loop's (docs/scan.md): alike curves, not equal ones.
        print(f"{name}, Dropout 0.1: losses {losses}")


if __name__ == "__main__":
    main()
