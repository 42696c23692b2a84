"""Which of xla_wrap's frames Dynamo traces: a block Dynamo cannot trace costs one block.

Dynamo traces a compiled model's forward and inlines every call, xla_wrap's checkpoints
included (as the compiler's checkpoint, xla_wrap/_paths/compiled/checkpoint.py). When a
block's body cannot be traced (a data-dependent branch, a print, `graph_break()`), Dynamo
breaks the graph at the call in the user's frame that led there and runs that call itself,
and every frame the call enters is a frame Dynamo tries to compile on its own. xla_wrap's
own frames would then try the compiler's checkpoint again, once per frame, and end in
PyTorch's checkpoint run eagerly, without a barrier on XLA.

So `run_checkpointed`, where every checkpoint starts, and every function that branches on
`compiling()` (`_paths.branches_on_compiling`) are never a frame Dynamo starts tracing at
(they are still traced when inlined from the user's code): entered so, `run_checkpointed` is
the graph break, and it runs the block in xla_wrap's engine, which runs outside the compiler
(as PyTorch's own checkpoint does). Everything before and after the block still compiles.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import torch
from torch._C._dynamo import eval_frame as _eval_frame
from torch._dynamo.comptime import comptime
from torch._dynamo.exc import Unsupported

_F = TypeVar("_F", bound=Callable[..., Any])


def never_traced_first(function: Callable[..., Any]) -> None:
    """Dynamo runs `function` as plain Python when its frame is the first it sees (the
    frames it calls are Dynamo's to compile as usual), and traces it when inlining it."""
    code: types.CodeType = function.__code__
    action = _eval_frame._FrameAction
    _eval_frame.set_code_exec_strategy(
        code, _eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT)
    )


def outside_the_compiler(function: _F) -> _F:
    """`function`, run with Dynamo off (its frames and all they call), as PyTorch runs its
    own checkpoint."""
    return cast(_F, torch._disable_dynamo(function))


def refuse(kind: type[Exception], message: str) -> NoReturn:
    """Raise `kind(message)` from code Dynamo may be tracing, so that it reaches whoever called
    the compiled model with its own class and message.

    Raised by traced code, an error becomes Dynamo's "Observed exception", which keeps neither.
    A comptime function runs for real while Dynamo traces (reading the traced frame's
    constants, not its closure); what it raises passes through unchanged if it is Dynamo's
    `Unsupported`, so there the error is raised as an instance of a class that is both
    (`except CheckpointValueError` still catches it). Under `fullgraph=True` that ends the
    compile; otherwise Dynamo takes it for a graph break, and the call runs eagerly, where this
    raises `kind(message)` itself.
    """
    comptime(_refuse_while_tracing)
    raise kind(message)


def _refuse_while_tracing(ctx: Any) -> NoReturn:
    kind = ctx.get_local("kind").as_python_constant()
    message = ctx.get_local("message").as_python_constant()
    raised = _unsupported_kind_of(kind)
    error: Any = raised.__new__(raised)
    Unsupported.__init__(error, message)  # Dynamo's bookkeeping (stack, stats) too
    raise error


@functools.cache
def _unsupported_kind_of(kind: type[Exception]) -> type[Exception]:
    return type(kind.__name__, (kind, Unsupported), {"__module__": kind.__module__})
