"""Checkpoint through torch.compile on torch_xla: the openxla backend with and without barriers.

Compiles a pre-LayerNorm transformer stack's training step with torch_xla's Dynamo backends
six ways, in one process (XLA:CPU, barriers kept): without checkpointing; every block
checkpointed on plain ``"openxla"`` (recomputes, saves nothing); on ``"openxla"`` with
TorchTPU's barrier placement (one after each recomputed leaf node); on
``xla_wrap.openxla_backend`` (one barrier per block, tied to the gradient arriving at it); with
both placements; and on ``openxla_backend`` keeping the matrix products (``dots_saveable``).
For each it prints the compiled step's peak, the dots and barriers of its largest program, and
whether loss and gradients equal the eager uncheckpointed model's. The measurement is the
benchmark's (``xla_wrap/bench/openxla.py``), which ``python -m xla_wrap.bench --compile`` also
runs at 4 and 8 blocks.

    python examples/compiled_openxla.py                  # 4 blocks, width 64, about a minute
    python examples/compiled_openxla.py --blocks 8       # what docs/compile.md shows
    python examples/compiled_openxla.py --blocks 2 --dim 32 --seq 32

docs/compile.md says which path to use where.
"""

from __future__ import annotations

import sys

from xla_wrap.bench.openxla import main

if __name__ == "__main__":
    sys.exit(main())
