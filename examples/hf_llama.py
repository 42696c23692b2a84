"""Train a tiny Hugging Face Llama on XLA:CPU with and without xla_wrap checkpointing.

The model is built from a ``LlamaConfig`` (nothing is downloaded) and learns to continue
bytes of text that ships with Python (the Zen of Python and the docstrings of a few standard
modules). It trains twice from the same weights, batches and Dropout seed: once as it is, and
once after ``xla_wrap.integrations.transformers.gradient_checkpointing_enable(model)``. It
prints both loss curves (they match), the compiled peak memory of each training step (XLA's
own buffer assignment, barriers kept), and writes a PNG of the curves.

    python examples/hf_llama.py                       # 40 steps, about 1 minute
    python examples/hf_llama.py --steps 4 --layers 2 --width 32 --seq 32

Needs transformers (``pip install 'xla_wrap[hf]'``); the PNG needs matplotlib (``bench``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--width", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--out", type=Path, default=Path("hf_llama_loss.png"), help="loss-curve PNG"
    )
    args = parser.parse_args()
    if args.width % 4:
        parser.error("--width must be a multiple of 4 (4 attention heads)")

    # Before torch_xla starts: keep the barriers on XLA:CPU and dump compilations.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit(
            "examples/hf_llama.py needs transformers: pip install 'xla_wrap[hf]'"
        ) from None
    from xla_wrap import introspect

    introspect.enable_compile_dumps()
    corpus = text_bytes()
    print(f"corpus: {len(corpus)} bytes of Python's own text; byte-level vocabulary of 256")
    plain = train("plain", corpus, args, checkpointed=False)
    ours = train("xla_wrap", corpus, args, checkpointed=True)

    print()
    print(f"{'step':>4}  {'plain':>8}  {'xla_wrap':>8}")
    for step, (a, b) in enumerate(zip(plain.losses, ours.losses, strict=True), 1):
        print(f"{step:>4}  {a:>8.4f}  {b:>8.4f}")
    worst = max(abs(a - b) for a, b in zip(plain.losses, ours.losses, strict=True))
    print(f"largest loss difference: {worst:.2e}")
    print(f"compiled peak (MiB): plain {plain.peak_mib:.2f}, xla_wrap {ours.peak_mib:.2f}")
    chart = plot(plain.losses, ours.losses, args.out)
    print(f"wrote {chart}" if chart else "no matplotlib: no chart (pip install 'xla_wrap[bench]')")


@dataclass
class Run:
    losses: list[float]
    peak_mib: float


def text_bytes() -> bytes:
    """Text that ships with every Python: no download."""
    import codecs
    import contextlib
    import importlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        this = importlib.import_module("this")
    names = ["argparse", "collections", "contextlib", "functools", "heapq", "json", "textwrap"]
    docs = [importlib.import_module(name).__doc__ or "" for name in names]
    return "\n".join([codecs.decode(this.s, "rot13"), *docs]).encode()


def train(name: str, corpus: bytes, args: argparse.Namespace, *, checkpointed: bool) -> Run:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from transformers import LlamaConfig, LlamaForCausalLM

    from xla_wrap import introspect
    from xla_wrap.integrations import transformers as xla_hf

    device = torch_xla.device()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        attention_dropout=0.1,
        use_cache=False,  # no key/value cache while training, in both runs
    )
    model = LlamaForCausalLM(config).train()
    if checkpointed:
        xla_hf.gradient_checkpointing_enable(model)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.tensor(list(corpus), dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    xm.set_rng_state(1234, str(device))  # the same Dropout masks in both runs
    losses: list[float] = []

    def step() -> None:
        starts = torch.randint(0, len(data) - args.seq, (args.batch,), generator=generator)
        ids = torch.stack([data[s : s + args.seq] for s in starts.tolist()]).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
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
    return Run(losses=losses, peak_mib=programs[0].total_mib)


def plot(plain: list[float], ours: list[float], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(plain) + 1)
    ax.plot(steps, plain, label="plain", linewidth=3, alpha=0.5)
    ax.plot(steps, ours, label="xla_wrap checkpointing", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny Llama on XLA:CPU")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    main()
