"""Train a small GPT-style model with SPMD FSDPv2 + auto-wrap + xla_wrap checkpointing.

Runs on a virtual 4-device XLA:CPU mesh (``CPU_NUM_DEVICES=4``), so no accelerator is needed.
The model trains twice from the same seed, on the same synthetic data and Dropout seed: once
with FSDPv2 alone and once with every decoder block built as
``FSDPv2(checkpoint_wrapper(block))`` by ``xla_wrap.fsdp.auto_wrapper_callable``. It prints both
loss curves (they match), the compiled peak memory per device of each training step (XLA's own
buffer assignment), and how many parameter gathers the recomputation makes after its barrier.

    python examples/fsdp_transformer.py                       # about 2.5 minutes on 2 cores
    python examples/fsdp_transformer.py --layers 2 --dim 32 --steps 3

XLA reads its flags once, so the script sets them before torch_xla starts: barriers kept
(XLA:CPU deletes them otherwise, see docs/index.md), compile dumps on, 4 CPU devices, SPMD.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks (default 4)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    parser.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices (default 4)")
    args = parser.parse_args()
    if args.batch % args.devices or args.dim % args.heads:
        parser.error("--batch must be a multiple of --devices and --dim of --heads")

    # Before torch_xla starts: 4 CPU devices, barriers kept, SPMD.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["CPU_NUM_DEVICES"] = str(args.devices)
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()

    import torch_xla.runtime as xr

    from xla_wrap import introspect

    introspect.enable_compile_dumps()
    xr.use_spmd()

    plain = train("FSDPv2", args, checkpointed=False)
    ours = train("FSDPv2 + xla_wrap", args, checkpointed=True)

    print()
    print(f"{'step':>4}  {'FSDPv2':>10}  {'+ xla_wrap':>10}")
    for step, (a, b) in enumerate(zip(plain.losses, ours.losses, strict=True), 1):
        print(f"{step:>4}  {a:>10.4f}  {b:>10.4f}")
    worst = max(abs(a - b) for a, b in zip(plain.losses, ours.losses, strict=True))
    print(f"largest loss difference: {worst:.2e}")
    print()
    rows = [
        ("compiled peak (MiB)", plain.peak_mib, ours.peak_mib),
        ("  expected activations (MiB)", plain.expected_mib, ours.expected_mib),
        ("all-gathers", plain.gathers, ours.gathers),
        ("  of barriered shards (re-gathers)", plain.regathers, ours.regathers),
        ("GFLOPs per step", plain.gflops, ours.gflops),
    ]
    print(f"{'per device':<36}{'FSDPv2':>10}{'+ xla_wrap':>12}")
    for label, a, b in rows:
        fmt = ".2f" if isinstance(a, float) else "d"
        print(f"{label:<36}{a:>10{fmt}}{b:>12{fmt}}")


@dataclass
class Run:
    losses: list[float]
    peak_mib: float
    expected_mib: float
    gathers: int
    regathers: int
    gflops: float


def train(name: str, args: argparse.Namespace, *, checkpointed: bool) -> Run:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2,
    )

    from xla_wrap import fsdp, introspect, wrap_policies

    mesh = xs.Mesh(np.arange(args.devices), (args.devices, 1), ("fsdp", "model"))
    device = torch_xla.device()
    torch.manual_seed(0)
    gpt = GPT(args)
    policy = fsdp.auto_wrap_policy(wrap_policies.by_type(DecoderBlock), gpt)
    options = {"auto_wrapper_callable": fsdp.auto_wrapper_callable(fsdp_class=FSDPv2)}
    model = FSDPv2(gpt, mesh=mesh, auto_wrap_policy=policy, **(options if checkpointed else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = synthetic_tokens(args).to(device)
    xs.mark_sharding(tokens, mesh, ("fsdp", None))
    xm.set_rng_state(1234, str(device))  # the same Dropout masks in both runs
    losses: list[float] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
        print(f"{name}: step {len(losses)}/{args.steps} loss {losses[-1]:.4f}", flush=True)

    print(f"{name}: compiling and running the first steps ...", flush=True)
    # The first step has no optimizer state yet; the second compiles the steady-state step.
    programs = introspect.compiled_programs(lambda: [step() for _ in range(min(2, args.steps))])
    for _ in range(args.steps - len(losses)):
        step()
    program = programs[0]
    return Run(
        losses=losses,
        peak_mib=program.total_mib,
        expected_mib=expected_activation_bytes(args, checkpointed) / 2**20,
        gathers=program.count("all-gather"),
        regathers=program.count("all-gather", reading="opt-barrier"),
        gflops=program.flops / 1e9,
    )


def expected_activation_bytes(args: argparse.Namespace, checkpointed: bool) -> int:
    """Per device, what autograd saves in the decoder blocks (read on the CPU from one block):
    every block's activations without checkpointing; with it, each block's input and one
    block's activations at a time."""
    import torch

    from xla_wrap import introspect

    rows = args.batch // args.devices
    block = DecoderBlock(args)
    x = torch.randn(rows, args.seq - 1, args.dim)
    per_block = sum(r.nbytes for r in introspect.saved_residuals(block, x) if r.kind != "parameter")
    if not checkpointed:
        return args.layers * per_block
    return args.layers * x.numel() * x.element_size() + per_block


def synthetic_tokens(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Counting sequences with a per-row stride: learnable, no download."""
    import torch

    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq)) % args.vocab


def _modules():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    class DecoderBlock(nn.Module):
        """Pre-norm causal self-attention and MLP, with Dropout, as in GPT-2."""

        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__()
            self.heads = args.heads
            self.norm1 = nn.LayerNorm(args.dim)
            self.qkv = nn.Linear(args.dim, 3 * args.dim)
            self.proj = nn.Linear(args.dim, args.dim)
            self.norm2 = nn.LayerNorm(args.dim)
            self.mlp = nn.Sequential(
                nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim)
            )
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
            h = self.heads
            q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            attn = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
            x = x + self.drop(self.proj((attn @ v).transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.mlp(self.norm2(x)))

    class GPT(nn.Module):
        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.dim)
            self.position = nn.Parameter(torch.randn(args.seq, args.dim) * 0.02)
            self.blocks = nn.ModuleList(DecoderBlock(args) for _ in range(args.layers))
            self.norm = nn.LayerNorm(args.dim)
            self.head = nn.Linear(args.dim, args.vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.position[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return DecoderBlock, GPT


if __name__ == "__main__":
    DecoderBlock, GPT = _modules()
    main()
