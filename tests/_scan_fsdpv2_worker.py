"""A scanned stack under SPMD FSDPv2 on a 4-device virtual XLA:CPU mesh, for
tests/test_scan.py (SPMD must be on before the process's first XLA tensor, so this runs in a
fresh process: ``python tests/_scan_fsdpv2_worker.py OUT.json``).

Each composition builds the same model from the same seed and runs one training step: the
loss, the gradients by parameter name, and the sharding of every parameter are recorded.
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

xr.use_spmd()  # before any XLA tensor exists

WIDTH, HIDDEN, DEPTH, BATCH = 32, 64, 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=scale)
        return self.head(x).sum()


def _units(net: Net) -> nn.Module:
    def policy(module: nn.Module, recurse: bool, **_: Any) -> bool:
        return recurse or isinstance(module, Block)

    return FSDPv2(net, auto_wrap_policy=policy)


COMPOSITIONS: dict[str, Callable[[Net], nn.Module]] = {
    "fsdpv2": _units,
    # The blocks scanned, each block an FSDPv2 unit inside the scanned list.
    "fsdpv2 units, scanned": lambda net: _units(xla_wrap.apply_scan(net)),
    # The blocks scanned, the whole model one FSDPv2 unit (parameters sharded all the same).
    "fsdpv2 root, scanned": lambda net: FSDPv2(xla_wrap.apply_scan(net, policy="dots_saveable")),
}


def run(build: Callable[[Net], nn.Module], mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build(Net())
    device = torch_xla.device()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    scale = torch.tensor(0.5).to(device)
    loss = model(x, scale)
    loss.backward()
    torch_xla.sync()
    return {
        "loss": loss.item(),
        "grads": {_name(n): p.grad.cpu().tolist() for n, p in model.named_parameters()},
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
    for name, build in COMPOSITIONS.items():
        try:
            results[name] = run(build, mesh)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
