"""The benchmark's models: a stack of 1x1-convolution blocks and a transformer-style stack,
the latter also sharded with SPMD FSDPv2 over a virtual CPU mesh ("transformer-fsdpv2").

All expose `blocks` (an `nn.ModuleList`) so that every variant checkpoints the same
blocks, and a `forward` that calls each block the same way, keyword arguments included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class ConvBlock(nn.Sequential):
    """conv 1x1, ReLU, conv 1x1, ReLU: the block of the model on which XLA was first seen to merge
    a recomputation back into the forward (docs/index.md, "Why barriers")."""

    def __init__(self, channels: int) -> None:
        super().__init__(
            nn.Conv2d(channels, channels, 1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 1),
            nn.ReLU(),
        )


class ConvStack(nn.Module):
    def __init__(self, blocks: int, channels: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.mean()


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + mask
        weights = self.drop(scores.softmax(dim=-1))
        return self.proj((weights @ v).transpose(1, 2).reshape(b, s, d))


def causal_mask(seq: int) -> torch.Tensor:
    """Additive causal mask: 0 on and below the diagonal, -inf above."""
    return torch.full((seq, seq), float("-inf")).triu(1)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm attention and MLP with Dropout. The mask comes as a keyword argument or,
    with `mask_seq`, from a non-persistent buffer the block keeps and only reads (as models
    keep causal masks and rotary tables)."""

    def __init__(
        self, dim: int, heads: int, dropout: float = 0.1, mask_seq: int | None = None
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)
        if mask_seq is not None:
            self.register_buffer("mask", causal_mask(mask_seq), persistent=False)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.get_buffer("mask") if mask is None else mask
        x = x + self.drop(self.attn(self.norm1(x), mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class TransformerStack(nn.Module):
    def __init__(
        self, blocks: int, dim: int, heads: int, dropout: float, mask_seq: int | None = None
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(dim, heads, dropout, mask_seq) for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask=mask)
        return self.head(self.norm(x)).pow(2).mean()


class MlpBlock(nn.Module):
    """Pre-LayerNorm residual MLP with Dropout; its hidden width sets its size."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.drop(nn.functional.gelu(self.up(self.norm(x))))))


# The uneven stack's hidden widths, as multiples of its width: the plan's hard case, where
# checkpointing one block saves sixteen times what another does.
UNEVEN_WIDTHS = (1, 8, 4, 16, 2, 8, 1, 4)


class UnevenStack(nn.Module):
    def __init__(self, blocks: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            MlpBlock(dim, dim * UNEVEN_WIDTHS[i % len(UNEVEN_WIDTHS)], dropout)
            for i in range(blocks)
        )
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


@dataclass(frozen=True)
class Workload:
    """A model and the fixed inputs of its training step (made on the host, seeded)."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    devices: int = 1  # more than one: SPMD FSDPv2 over that many virtual CPU devices

    @property
    def blocks(self) -> nn.ModuleList:
        """The blocks a variant checkpoints (all but the first)."""
        blocks = self.model.blocks
        assert isinstance(blocks, nn.ModuleList)
        return blocks


MODELS = ("conv", "transformer", "transformer-fsdpv2")
# Only in the plan section (--plan): blocks of unequal sizes.
PLAN_ONLY_MODELS = ("uneven",)
SHARDED_DEVICES = 4


def build(name: str, sizes: dict[str, int]) -> Workload:
    """Build model `name` (one of `MODELS` or `PLAN_ONLY_MODELS`) with
    `sizes` on the CPU, seeded."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if name == "conv":
        c, hw = sizes["channels"], sizes["size"]
        model: nn.Module = ConvStack(sizes["blocks"], c)
        x = torch.randn(sizes["batch"], c, hw, hw, generator=generator)
        return Workload(model, (x,), {})
    if name in ("transformer", "transformer-fsdpv2"):
        d, s = sizes["dim"], sizes["seq"]
        in_blocks = bool(sizes["mask_buffer"])
        model = TransformerStack(
            sizes["blocks"], d, sizes["heads"], sizes["dropout_pct"] / 100, s if in_blocks else None
        )
        x = torch.randn(sizes["batch"], s, d, generator=generator)
        kwargs = {} if in_blocks else {"mask": causal_mask(s)}
        devices = SHARDED_DEVICES if name.endswith("fsdpv2") else 1
        return Workload(model, (x,), kwargs, devices)
    if name == "uneven":
        model = UnevenStack(sizes["blocks"], sizes["dim"], sizes["dropout_pct"] / 100)
        x = torch.randn(sizes["batch"], sizes["dim"], generator=generator)
        return Workload(model, (x,), {})
    raise ValueError(
        f"xla_wrap.bench: unknown model {name!r}; choose among {MODELS + PLAN_ONLY_MODELS}"
    )
