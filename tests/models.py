"""Tiny models and step helpers shared by the tests (small shapes: every XLA compile costs
seconds, and equal shapes let tests share compiled programs)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

WIDTH = 8
BATCH = 4


class Block(nn.Module):
    """A residual block with Dropout and keyword arguments, like a transformer MLP block."""

    def __init__(self, width: int = WIDTH, p: float = 0.5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(
        self, x: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.drop(torch.tanh(self.linear(self.norm(x)))) * scale
        if mask is not None:
            h = h * mask
        return x + h


class Stack(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5, mask=mask)
        return self.head(x).sum()


def seed_everything(device: torch.device, seed: int) -> None:
    torch.manual_seed(seed)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, str(device))


def sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def train_step(
    model: nn.Module, device: torch.device, seed: int | None, *, x: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """One forward/backward, seeded first unless ``seed`` is None; returns the loss, the input
    gradient and every parameter gradient, on the CPU."""
    generator = torch.Generator().manual_seed(1234)
    if x is None:
        x = torch.randn(BATCH, WIDTH, generator=generator)
    x = x.to(device).requires_grad_()
    mask = (torch.rand(BATCH, WIDTH, generator=generator) > 0.2).float().to(device)
    for p in model.parameters():
        p.grad = None
    if seed is not None:
        seed_everything(device, seed)
    loss = model(x, mask=mask)
    loss.backward()
    sync(device)
    result = {"loss": loss.detach().cpu(), "input": x.grad.cpu()}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        result[name] = p.grad.cpu()
    return result


def assert_same(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Bitwise on eager CPU; within 1e-5 relative on XLA:CPU (fusion may reorder arithmetic)."""
    assert expected.keys() == got.keys()
    for key in expected:
        if device.type == "cpu":
            assert torch.equal(expected[key], got[key]), key
        else:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


class Net(nn.Module):
    """Blocks in an ``nn.ModuleList`` and a linear head, the output summed: the model the FSDP
    tests shard unit by unit. Keyword arguments, given here or in the call, go to every block."""

    def __init__(self, blocks: Iterable[nn.Module], width: int, **block_kwargs: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 1)
        self.block_kwargs = block_kwargs

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, **self.block_kwargs, **kwargs)
        return self.head(x).sum()


def wrap_blocks(model: nn.Module, **options: Any) -> None:
    """Wrap each of ``model.blocks`` with ``xla_wrap.checkpoint_wrapper(block, **options)``."""
    import xla_wrap

    for i, block in enumerate(model.blocks):
        model.blocks[i] = xla_wrap.checkpoint_wrapper(block, **options)


def wrapped_copy(model: nn.Module, wrap: Callable[[nn.Module], Any]) -> nn.Module:
    twin = copy.deepcopy(model)
    wrap(twin)
    # A deep copy of XLA parameters is pending computation until the next step marker; make it
    # data now so that the first training step compiles the same program as the later ones.
    sync(next(twin.parameters()).device)
    return twin


def tiny_gpt2(layers: int = 2, width: int = 32, **config: Any) -> nn.Module:
    """A Hugging Face GPT-2 with Dropout 0.1 on embeddings, attention and residuals (its
    defaults), vocabulary 64; ``config`` overrides GPT2Config's fields."""
    import transformers

    settings: dict[str, Any] = {
        "vocab_size": 64,
        "n_embd": width,
        "n_layer": layers,
        "n_head": 4,
        "n_positions": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
        **config,
    }
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))


def _unwrapped_class(module: nn.Module) -> type:
    """The class a module has without xla_wrap's checkpointing (a wrapped layer is still one of
    its list's layers)."""
    import xla_wrap

    return next(c for c in type(module).__mro__ if not issubclass(c, xla_wrap.CheckpointWrapper))


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The elements of the model's layer lists: the outermost ``ModuleList``s of two or more
    modules of one class (``model.layers``, ``transformer.h``, ``encoder.block``, ...)."""
    found: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        one_class = len({_unwrapped_class(layer) for layer in module.children()}) == 1
        if isinstance(module, nn.ModuleList) and len(module) > 1 and one_class:
            found.extend(module)
            inside.append(name + ".")
    return found


def hf_step(
    model: nn.Module, inputs: dict[str, torch.Tensor], seed: int = 5
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One training step of a Hugging Face model on ``inputs`` (with labels), seeded: its loss
    and the gradients of the parameters that require them."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


class Scores(nn.Module):
    """Attention scores by hand: the projections are matrix products without batch
    dimensions (``mm``/``addmm``), ``q @ k.T`` one with them (``bmm``)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1)
        return x + torch.softmax(scores, dim=-1) @ x
