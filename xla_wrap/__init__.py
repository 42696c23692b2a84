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
from ._apply import apply_activation_checkpointing as apply_activation_checkpointing
from ._barrier import optimization_barrier as optimization_barrier
from ._checkpoint import checkpoint as checkpoint
from ._checkpoint import checkpoint_sequential as checkpoint_sequential
from ._errors import BarriersStrippedWarning as BarriersStrippedWarning
from ._errors import BudgetUnreachableError as BudgetUnreachableError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointTypeError as CheckpointTypeError
from ._errors import CheckpointValueError as CheckpointValueError
from ._errors import XlaWrapError as XlaWrapError
from ._openxla import openxla_backend as openxla_backend
from ._options import CheckpointOptions as CheckpointOptions
from ._plan import CheckpointPlan as CheckpointPlan
from ._planner import plan_checkpointing as plan_checkpointing
from ._scan import scan_layers as scan_layers
from ._scanned import ScannedLayers as ScannedLayers
from ._scanned import apply_scan as apply_scan
from ._scanned import unscan as unscan
from ._selective import checkpoint_name as checkpoint_name
from ._state import disable_checkpointing as disable_checkpointing
from ._state import is_recomputing as is_recomputing
from ._wrapper import CheckpointWrapper as CheckpointWrapper
from ._wrapper import checkpoint_wrapper as checkpoint_wrapper
from ._wrapper import unwrap as unwrap

__version__ = "0.1.0"

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
    "scan_layers",
    "unscan",
    "unwrap",
    "wrap",
]
