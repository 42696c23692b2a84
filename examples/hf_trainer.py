"""Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``) on XLA:CPU with its own checkpointing flag.

``TrainingArguments(gradient_checkpointing=True)`` fails on XLA (``module 'torch' has no
attribute 'xla'``). One line before building the trainer makes the flag checkpoint with
xla_wrap instead:

    from xla_wrap.integrations import transformers as xla_hf
    xla_hf.install()

This trains a tiny GPT-2 (built from a config, nothing downloaded) twice from the same weights,
batches and Dropout seed: with the flag off, and with it on after ``install()``. It prints both
loss curves and the compiled peak of the training step (XLA's own buffer assignment, barriers
kept).

    python examples/hf_trainer.py                  # Trainer, 8 steps, about 1 minute
    python examples/hf_trainer.py --sft            # TRL's SFTTrainer (flag on by default there)
    python examples/hf_trainer.py --steps 2 --layers 2

Needs transformers and accelerate (``pip install 'xla_wrap[hf]'``); ``--sft`` needs TRL
(``pip install 'xla_wrap[trl]'``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from typing import Any

VOCAB = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 blocks (default 4)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    parser.add_argument("--sft", action="store_true", help="TRL's SFTTrainer on text")
    args = parser.parse_args()

    # Before torch_xla starts: keep the barriers on XLA:CPU and dump compilations.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed options
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401

        if args.sft:
            import trl  # noqa: F401
    except ImportError as error:
        extra = "trl" if args.sft else "hf"
        raise SystemExit(f"examples/hf_trainer.py needs {error.name}: pip install "
                         f"'xla_wrap[{extra}]'") from None  # fmt: skip
    from xla_wrap import introspect
    from xla_wrap.integrations import transformers as xla_hf

    introspect.enable_compile_dumps()
    kind = "SFTTrainer" if args.sft else "Trainer"
    plain = train(f"{kind}, flag off", args, checkpointing=False)
    xla_hf.install()
    ours = train(f"{kind}, flag on, xla_wrap installed", args, checkpointing=True)

    print()
    print(f"{'step':>4}  {'flag off':>9}  {'flag on':>9}")
    for step, (a, b) in enumerate(zip(plain[0], ours[0], strict=True), 1):
        print(f"{step:>4}  {a:>9.5f}  {b:>9.5f}")
    worst = max(abs(a - b) for a, b in zip(plain[0], ours[0], strict=True))
    print(f"largest loss difference: {worst:.2e}")
    print(f"compiled peak (MiB): flag off {plain[1]:.2f}, flag on {ours[1]:.2f}")


def train(name: str, args: argparse.Namespace, *, checkpointing: bool) -> tuple[list[float], float]:
    """Train from scratch; the logged losses and the largest compiled program's peak (MiB)."""
    import torch
    import torch_xla.core.xla_model as xm
    import transformers

    from xla_wrap import introspect

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=args.seq, n_embd=32, n_layer=args.layers, n_head=2,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    options: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_trainer_"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_checkpointing=checkpointing,
        optim="adamw_torch",  # the default fused AdamW refuses XLA tensors
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    if args.sft:
        trainer = sft_trainer(model, args, options)
    else:
        draw = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (args.batch * args.steps, args.seq), generator=draw)
        rows = [{"input_ids": row, "labels": row} for row in ids]
        trainer = transformers.Trainer(
            model=model, args=transformers.TrainingArguments(**options), train_dataset=rows
        )
    print(f"{name}: compiling and training {args.steps} steps ...", flush=True)
    xm.set_rng_state(0)  # the same Dropout masks in both runs
    programs = introspect.compiled_programs(trainer.train)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, max(p.total_mib for p in programs)


def sft_trainer(model: Any, args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """TRL's SFTTrainer on random words, with a word-level tokenizer built on the spot."""
    import datasets
    import tokenizers
    import torch
    import transformers
    import trl

    words = [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    draw = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[j] for j in torch.randint(0, len(words), (args.seq - 8,), generator=draw))
        for _ in range(args.batch * args.steps)
    ]
    config = trl.SFTConfig(**options, max_length=args.seq, packing=False)
    data = datasets.Dataset.from_dict({"text": texts})
    return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)


if __name__ == "__main__":
    main()
