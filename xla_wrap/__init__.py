"""xla_wrap: activation checkpointing that saves memory on PyTorch/XLA and leaves training
unchanged.

XLA compiles a whole training step into one program. Recomputed activations look identical to
the forward's, so XLA's common-subexpression elimination merges them back and no memory is
saved. xla_wrap recomputes behind an optimization barrier that keeps gradients flowing, replays
the CPU/CUDA/XLA random generators so Dropout recomputes exactly, and presents wrapped modules
as what they are: same class, same names, same place in the tree.
"""

from . import checkpoint_policies as checkpoint_policies
from . import fsdp as fsdp
from . import introspect as introspect
from . import wrap as wrap
from . import wrap_policies as wrap_policies
from ._core.apply import apply_activation_checkpointing as apply_activation_checkpointing
from ._core.barrier import optimization_barrier as optimization_barrier
from ._core.checkpoint import checkpoint as checkpoint
from ._core.checkpoint import checkpoint_sequential as checkpoint_sequential
from ._core.options import CheckpointOptions as CheckpointOptions
from ._core.selective import checkpoint_name as checkpoint_name
from ._core.wrapper import CheckpointWrapper as CheckpointWrapper
from ._core.wrapper import checkpoint_wrapper as checkpoint_wrapper
from ._core.wrapper import unwrap as unwrap
from ._paths.compiled.barriers import region_barriers as region_barriers
from ._paths.compiled.barriers import with_region_barriers as with_region_barriers
from ._paths.compiled.openxla import openxla_backend as openxla_backend
from ._plan.checkpoint_plan import CheckpointPlan as CheckpointPlan
from ._plan.planner import plan_checkpointing as plan_checkpointing
from ._scan.loops import scan_layers as scan_layers
from ._scan.module_list import ScannedLayers as ScannedLayers
from ._scan.module_list import apply_scan as apply_scan
from ._scan.module_list import unscan as unscan
from ._support.errors import BarriersStrippedWarning as BarriersStrippedWarning
from ._support.errors import BudgetUnreachableError as BudgetUnreachableError
from ._support.errors import CheckpointError as CheckpointError
from ._support.errors import CheckpointTypeError as CheckpointTypeError
from ._support.errors import CheckpointValueError as CheckpointValueError
from ._support.errors import XlaWrapError as XlaWrapError
from ._support.state import disable_checkpointing as disable_checkpointing
from ._support.state import is_recomputing as is_recomputing

__version__ = "0.1.0"

# The errors name the public module: tracebacks, `except` advice and pickles then say
# `xla_wrap.CheckpointError`, wherever the class lives inside the package. (Not the annotated
# classes: typing.get_type_hints resolves their annotations in the module they name.)
# Pickles and messages name these by their public path, wherever they live.
# (CheckpointOptions's annotations are evaluated, so typing resolves them without its module.)
for _public in (
    BarriersStrippedWarning,
    BudgetUnreachableError,
    CheckpointError,
    CheckpointOptions,
    CheckpointTypeError,
    CheckpointValueError,
    CheckpointWrapper,
    ScannedLayers,
    XlaWrapError,
):
    _public.__module__ = __name__
del _public

__all__ = [
    "BarriersStrippedWarning",
    "BudgetUnreachableError",
    "CheckpointError",
    "CheckpointOptions",
    "CheckpointPlan",
    "CheckpointTypeError",
    "CheckpointValueError",
    "CheckpointWrapper",
    "ScannedLayers",
    "XlaWrapError",
    "apply_activation_checkpointing",
    "apply_scan",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_policies",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "fsdp",
    "introspect",
    "is_recomputing",
    "openxla_backend",
    "optimization_barrier",
    "plan_checkpointing",
    "region_barriers",
    "scan_layers",
    "unscan",
    "unwrap",
    "with_region_barriers",
    "wrap_policies",
]
