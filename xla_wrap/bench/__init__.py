"""The side-by-side benchmark: `python -m xla_wrap.bench` (or `xla-wrap-bench`).

See docs/benchmarks.md for what it measures and a real run.
"""

from .cli import main as main

__all__ = ["main"]
