"""A barrier before the loss must leave training unchanged, on a dataset that ships with
scikit-learn.

A torch_xla bug report checked that an optimization barrier does not hurt training: a CNN
reached the same MNIST accuracy with ``optimization_barrier`` on its output as without. This
trains the same small CNN on scikit-learn's 8x8 digits (1797 images, no download) three times
on XLA:CPU, from the same initial weights and with the same batches:

* plain;
* with ``xla_wrap.optimization_barrier`` on the logits;
* with both convolution blocks wrapped by ``xla_wrap.checkpoint_wrapper`` (Dropout inside).

and prints the test accuracy of each (expect about 97% or more, equal within a sample or two).

    python examples/digits_barrier.py                 # 12 epochs, about 1 minute
    python examples/digits_barrier.py --epochs 2 --train 256

Needs scikit-learn (``pip install 'xla_wrap[examples]'``).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12, help="training epochs (default 12)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument(
        "--train", type=int, default=1347, help="training images (default 1347 of 1797)"
    )
    args = parser.parse_args()
    # Before torch_xla starts: keep the barriers on XLA:CPU (it deletes them otherwise, and the
    # experiment would test nothing; see docs/index.md).
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_disable_hlo_passes=cse_barrier_expander".strip()

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "examples/digits_barrier.py needs scikit-learn: pip install 'xla_wrap[examples]'"
        ) from None
    import torch

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = order[: args.train], order[args.train :]
    data = (images[train_idx], labels[train_idx], images[test_idx], labels[test_idx])
    print(f"digits: {len(train_idx)} training and {len(test_idx)} test images, 8x8")

    results = {}
    for variant in ("plain", "barrier on logits", "checkpoint_wrapper blocks"):
        results[variant] = train(variant, data, args)
    print()
    print(f"{'variant':<28}{'final loss':>12}{'test accuracy':>16}")
    for variant, (loss, accuracy) in results.items():
        print(f"{variant:<28}{loss:>12.4f}{accuracy:>15.2%}")


def train(variant: str, data, args: argparse.Namespace) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    import torch
    import torch_xla
    from torch import nn

    import xla_wrap

    device = torch_xla.device()
    train_x, train_y, test_x, test_y = data
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        [
            nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.1),
            ),
            nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Dropout(0.1)),
        ]
    )  # fmt: skip
    head = nn.Linear(32 * 4 * 4, 10)
    if variant == "checkpoint_wrapper blocks":
        for i, block in enumerate(blocks):
            blocks[i] = xla_wrap.checkpoint_wrapper(block)
    model = nn.ModuleDict({"blocks": blocks, "head": head}).to(device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in model["blocks"]:
            x = block(x)
        logits = model["head"](x.flatten(1))
        if variant == "barrier on logits":
            (logits,) = xla_wrap.optimization_barrier(logits)
        return logits

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = len(train_y) // args.batch  # whole batches only: one compiled step
    loss_value = float("nan")
    for epoch in range(args.epochs):
        model.train()
        shuffle = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch))
        total = torch.zeros((), device=device)
        for b in range(batches):
            idx = shuffle[b * args.batch : (b + 1) * args.batch]
            x, y = train_x[idx].to(device), train_y[idx].to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(forward(x), y)
            loss.backward()
            optimizer.step()
            total = total + loss.detach()
            torch_xla.sync()
        loss_value = float(total.item()) / batches
        print(f"{variant}: epoch {epoch + 1}/{args.epochs} mean loss {loss_value:.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        predicted = forward(test_x.to(device)).argmax(-1).cpu()
    return loss_value, float((predicted == test_y).float().mean())


if __name__ == "__main__":
    main()
