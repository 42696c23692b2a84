"""A scanned stack under SPMD FSDPv2 on a 4-device virtual XLA:CPU mesh, for
tests/scan/test_scan.py (SPMD must be on before the process's first XLA tensor, so this runs in a
fresh process: ``PYTHONPATH=tests python tests/workers/scan_fsdpv2.py OUT.json``).

Each composition builds the same model from the same seed and runs one training step: the
loss, the FLOPs per device, the gradients by parameter name, and the sharding of every
parameter are recorded.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = str(DEVICES := 4)

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)

import xla_wrap
from xla_wrap import internal, introspect
from xla_wrap.bench.models import TransformerStack, causal_mask

import models

introspect.enable_compile_dumps()  # FLOPs per device, read from the compiled step
xr.use_spmd()  # before any XLA tensor exists

WIDTH, HIDDEN, DEPTH, BATCH = 32, 64, 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * scale


class Net(models.Net):
    def __init__(self) -> None:
        super().__init__((Block() for _ in range(DEPTH)), WIDTH)


def _units(net: nn.Module) -> nn.Module:
    def policy(module: nn.Module, recurse: bool, **_: Any) -> bool:
        return recurse or type(module).__name__ in ("Block", "TransformerBlock")

    return FSDPv2(net, auto_wrap_policy=policy)


def _attention_stack() -> nn.Module:
    """The benchmark's transformer, tiny: its attention is where a backward loop partitioned
    apart from the forward's batch split shows."""
    return TransformerStack(blocks=3, dim=32, heads=2, dropout=0.0)


COMPOSITIONS: dict[str, Callable[[Net], nn.Module]] = {
    "fsdpv2": _units,
    # The blocks scanned, each block an FSDPv2 unit inside the scanned list.
    "fsdpv2 units, scanned": lambda net: _units(xla_wrap.apply_scan(net)),
    # The blocks scanned, the whole model one FSDPv2 unit (parameters sharded all the same).
    "fsdpv2 root, scanned": lambda net: FSDPv2(xla_wrap.apply_scan(net, policy="dots_saveable")),
    # Both again with the parameters stored stacked (sharded as FSDPv2 shards any parameter).
    "fsdpv2 units, scanned stacked": lambda net: _units(
        xla_wrap.apply_scan(net, stack_parameters=True)
    ),
    "fsdpv2 root, scanned stacked": lambda net: FSDPv2(
        xla_wrap.apply_scan(net, stack_parameters=True)
    ),
}


# The same two ways in on the tiny transformer (the mask a keyword argument).
TRANSFORMER_COMPOSITIONS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "transformer, fsdpv2": _units,
    "transformer, fsdpv2 units, scanned": lambda net: _units(xla_wrap.apply_scan(net)),
}


def run(build: Callable[[Any], nn.Module], mesh: Any, transformer: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build(_attention_stack() if transformer else Net())
    device = torch_xla.device()
    shape = (8, 16, 32) if transformer else (BATCH, WIDTH)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    xs.mark_sharding(x, mesh, ("fsdp",) + (None,) * (x.dim() - 1))
    scale = torch.tensor(0.5).to(device)
    mask = causal_mask(16).to(device)
    losses = []

    def step() -> None:
        loss = model(x, mask=mask) if transformer else model(x, scale=scale)
        loss.backward()
        torch_xla.sync()
        losses.append(loss)

    program = introspect.compiled_memory(step)
    return {
        "loss": losses[0].item(),
        "flops": program.flops,
        # By state_dict name, one per layer also where the parameters are stacked.
        "grads": {
            _name(n): g.cpu().tolist()
            for n, g in internal.per_layer_gradients(model).items()
            if g is not None
        },
        "sharded": {
            _name(n): bool(torch_xla._XLAC._get_xla_sharding_spec(p))
            for n, p in model.named_parameters()
        },
    }


def _name(name: str) -> str:
    """The parameter's name without FSDPv2's wrapper prefixes."""
    return name.replace("_orig_module.", "")


def main(out: str) -> None:
    xs.set_global_mesh(mesh := xs.Mesh(np.arange(DEVICES), (DEVICES, 1), ("fsdp", "model")))
    results: dict[str, Any] = {}
    runs = [(n, b, False) for n, b in COMPOSITIONS.items()]
    runs += [(n, b, True) for n, b in TRANSFORMER_COMPOSITIONS.items()]
    for name, build, transformer in runs:
        try:
            results[name] = run(build, mesh, transformer)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
