"""Run by test_offload.py in a fresh process: trace a checkpointed step with the host-placement
annotations forced on, as a TPU or GPU would get them, and print what its HLO contains. The
graph is never executed (XLA:CPU aborts on these annotations), so the process leaves with
``os._exit`` before anything could sync it."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch_xla
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import internal, introspect

WIDTH = 8


class Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = xla_wrap.checkpoint_name(self.fc1(x), "h")
        return self.fc2(torch.tanh(h)).tanh()


def placements(hlo: str) -> dict[str, object]:
    """Host and device placements, and whether every value brought back feeds the barrier."""
    found: dict[str, list[str]] = {"pinned_host": [], "device": []}
    for line in hlo.splitlines():
        match = re.match(r"\s*(%\S+) = (\S+) custom-call\(", line)
        if match and "annotate_device_placement" in line:
            where = re.search(r'_xla_buffer_placement="(\w+)"', line)
            assert where is not None, line
            found[where.group(1)].append(f"{match.group(1)}:{match.group(2).split('{')[0]}")
    barrier_operands = " ".join(
        line for line in hlo.splitlines() if " tuple(" in line or "opt-barrier(" in line
    )
    back = [entry.split(":")[0] for entry in found["device"]]
    return {
        "to_host": [entry.split(":")[1] for entry in found["pinned_host"]],
        "to_device": [entry.split(":")[1] for entry in found["device"]],
        "barriered": all(re.search(rf"{re.escape(n)}[,)]", barrier_operands) for n in back),
    }


def main() -> None:
    device = torch_xla.device()
    results = {}
    cases = {
        "offload_to_cpu": {"offload_to_cpu": True},
        "offload_these_names": {"policy": cp.offload_these_names("h")},
    }
    for label, options in cases.items():
        torch.manual_seed(0)
        block = Tagged().to(device)
        x = torch.randn(4, WIDTH, device=device, requires_grad=True)
        with internal.annotating_offload_on_any_backend():
            xla_wrap.checkpoint(block, x, **options).sum().backward()
        grads = [x.grad, *(p.grad for p in block.parameters())]
        results[label] = placements(introspect.pending_hlo(grads))
    print(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # nothing traced here may ever run


if __name__ == "__main__":
    main()
