"""What xla_wrap's own bench and tests use beyond the public API, as Equinox's
`equinox.internal`: not part of the public API, and names here change without deprecation.

Everything is re-exported from where it lives, so that the bench and the tests import no private
module (tests/project/test_house.py checks) and the package can rearrange its rooms behind this
face.
"""

from ._core.engine import record_of
from ._inspect.hlo import BufferAssignment, parse_buffer_assignment
from ._paths import device_path
from ._paths.compiled.barriers import leaf_barriers
from ._paths.compiled.openxla import xla_barrier
from ._paths.compiled.regions import (
    POLICIES_IN_LAYER_REGIONS,
    compiles_layers_once,
    has_layer_regions,
    runs_regions_as_they_are,
)
from ._paths.xla import (
    KEEP_BARRIERS_FLAG,
    annotating_offload_on_any_backend,
    is_device_data,
    sharding,
    tiled_sharding,
)
from ._paths.xla import rng as xla_rng  # tests patch its reads (the step's base seed)
from ._plan.blocks import repeated_blocks
from ._plan.checkpoint_plan import apply_choices, summarize
from ._plan.cost_model import DOTS, FULL, NONE, OFFLOAD, BlockCost, modelled_peak, objective, solve
from ._plan.planner import measure_choices
from ._scan.stacked_parameters import per_layer_gradients
from ._support.warn import forget_warnings

__all__ = [
    "DOTS",
    "FULL",
    "KEEP_BARRIERS_FLAG",
    "NONE",
    "OFFLOAD",
    "POLICIES_IN_LAYER_REGIONS",
    "BlockCost",
    "BufferAssignment",
    "annotating_offload_on_any_backend",
    "apply_choices",
    "compiles_layers_once",
    "device_path",
    "forget_warnings",
    "has_layer_regions",
    "is_device_data",
    "leaf_barriers",
    "measure_choices",
    "modelled_peak",
    "objective",
    "parse_buffer_assignment",
    "per_layer_gradients",
    "record_of",
    "repeated_blocks",
    "runs_regions_as_they_are",
    "sharding",
    "solve",
    "summarize",
    "tiled_sharding",
    "xla_barrier",
    "xla_rng",
]
