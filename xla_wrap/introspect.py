"""See what XLA made of a step: what it keeps, what it recomputes, and its compiled peak.

Allocator statistics do not exist on XLA:CPU and, on TPU, show the end of a step rather than
its peak. The figure that does not lie is XLA's own buffer assignment: the size of every
allocation after liveness-based packing, which XLA writes next to the optimized HLO when the
process starts with `XLA_FLAGS=--xla_dump_to=DIR`.
[`enable_compile_dumps()`][xla_wrap.introspect.enable_compile_dumps] sets that up;
[`compiled_memory()`][xla_wrap.introspect.compiled_memory] reads it back. Under
`torch.compile`, [`PartitionedGraphs`][xla_wrap.introspect.PartitionedGraphs] shows what the
partitioner keeps for backward and what it recomputes. On any device,
[`saved_residuals()`][xla_wrap.introspect.saved_residuals] lists what a forward keeps.

Examples:
    >>> from xla_wrap import introspect
    >>> introspect.enable_compile_dumps()  # before the first XLA device exists  # doctest: +SKIP
    >>> program = introspect.compiled_memory(train_step)   # doctest: +SKIP
    >>> print(program.total_mib, program.flops, program.count("opt-barrier"))  # doctest: +SKIP
"""

from ._inspect.hlo import count_instructions as count_instructions
from ._inspect.programs import CompiledProgram as CompiledProgram
from ._inspect.programs import RecomputeCost as RecomputeCost
from ._inspect.programs import compiled_memory as compiled_memory
from ._inspect.programs import compiled_programs as compiled_programs
from ._inspect.programs import dump_directory as dump_directory
from ._inspect.programs import enable_compile_dumps as enable_compile_dumps
from ._inspect.programs import hlo_flops as hlo_flops
from ._inspect.programs import pending_hlo as pending_hlo
from ._inspect.programs import recompute_cost as recompute_cost
from ._inspect.residuals import Residual as Residual
from ._inspect.residuals import format_residuals as format_residuals
from ._inspect.residuals import saved_residuals as saved_residuals
from ._paths.compiled.graphs import PartitionedGraphs as PartitionedGraphs

__all__ = [
    "CompiledProgram",
    "PartitionedGraphs",
    "RecomputeCost",
    "Residual",
    "compiled_memory",
    "compiled_programs",
    "count_instructions",
    "dump_directory",
    "enable_compile_dumps",
    "format_residuals",
    "hlo_flops",
    "pending_hlo",
    "recompute_cost",
    "saved_residuals",
]
