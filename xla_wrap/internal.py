"""What xla_wrap's own bench and tests use beyond the public API, as Equinox's
``equinox.internal``: not part of the public API, and names here change without deprecation.

Everything is re-exported from where it lives, so that the bench and the tests import no private
module (tests/test_house.py checks) and the package can rearrange its rooms behind this face.
"""

from . import _compiled, _offload
from . import _xla as xla_gateway  # tests patch the gateway's reads (the step's base seed)
from ._hlo import BufferAssignment, parse_buffer_assignment
from ._offload import annotating_on_any_backend as annotating_offload_on_any_backend
from ._openxla import _barrier as barrier_node
from ._openxla import place_barriers
from ._plan import apply_choices, summarize
from ._plan_solver import DOTS, FULL, NONE, OFFLOAD, BlockCost, modelled_peak, objective, solve
from ._planner import measure_choices, repeated_blocks
from ._stacked import per_layer_gradients
from ._xla import KEEP_BARRIERS_FLAG, is_device_data, sharding, tiled_sharding


def forget_warnings() -> None:
    """Let xla_wrap's warn-once warnings warn again (for a test that checks one)."""
    _offload._warn_kept_on_device_once.cache_clear()
    _compiled._warn_offload_kept_once.cache_clear()


__all__ = [
    "DOTS",
    "FULL",
    "KEEP_BARRIERS_FLAG",
    "NONE",
    "OFFLOAD",
    "BlockCost",
    "BufferAssignment",
    "annotating_offload_on_any_backend",
    "apply_choices",
    "barrier_node",
    "forget_warnings",
    "is_device_data",
    "measure_choices",
    "modelled_peak",
    "objective",
    "parse_buffer_assignment",
    "per_layer_gradients",
    "place_barriers",
    "repeated_blocks",
    "sharding",
    "solve",
    "summarize",
    "tiled_sharding",
    "xla_gateway",
]
