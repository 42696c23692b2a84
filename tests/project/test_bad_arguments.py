"""Each mistake issue 38 found answered with an error of its kind at the call: a wrong type a
CheckpointTypeError (a TypeError), a wrong value a CheckpointValueError (a ValueError), each
naming the API and what it was given. (Every public callable with wrong values in each argument:
test_argument_sweep.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import introspect
from xla_wrap import wrap_policies as wp


def _linear() -> nn.Module:
    return nn.Linear(2, 2)


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # errors from inside before: AttributeError or RuntimeError
    ("unscan(int)", lambda: xla_wrap.unscan(3), xla_wrap.CheckpointTypeError, "xla_wrap.unscan"),
    ("hlo_flops(int)", lambda: introspect.hlo_flops(3), xla_wrap.CheckpointTypeError, "`hlo`"),
    (
        "count_instructions(int)",
        lambda: introspect.count_instructions(3, "dot"),
        xla_wrap.CheckpointTypeError,
        "`hlo`",
    ),
    (
        "count_instructions(opcode=int)",
        lambda: introspect.count_instructions("", 3),
        xla_wrap.CheckpointTypeError,
        "`opcode`",
    ),
    (
        "format_residuals(str)",
        lambda: introspect.format_residuals("x"),
        xla_wrap.CheckpointTypeError,
        "format_residuals",
    ),
    (
        "preserve_rng_state=tensor",
        lambda: xla_wrap.checkpoint_wrapper(_linear(), preserve_rng_state=torch.tensor(True)),
        xla_wrap.CheckpointTypeError,
        "`preserve_rng_state`",
    ),
    (
        "offload_to_cpu=tensor",
        lambda: xla_wrap.checkpoint_wrapper(_linear(), offload_to_cpu=torch.tensor(False)),
        xla_wrap.CheckpointTypeError,
        "`offload_to_cpu`",
    ),
    # accepted before, wrong later
    *[
        (
            f"CheckpointOptions(policy={label})",
            lambda value=value: xla_wrap.CheckpointOptions(policy=value),
            error,
            "CheckpointOptions",
        )
        for label, value, error in [
            ("-1", -1, xla_wrap.CheckpointTypeError),
            ("'x'", "x", xla_wrap.CheckpointValueError),
            ("[]", [], xla_wrap.CheckpointTypeError),
            ("tensor", torch.ones(1), xla_wrap.CheckpointTypeError),
            ("module", nn.ReLU(), xla_wrap.CheckpointTypeError),
            ("class", nn.ReLU, xla_wrap.CheckpointTypeError),
        ]
    ],
    (
        "CheckpointOptions(offload_to_cpu=1)",
        lambda: xla_wrap.CheckpointOptions(offload_to_cpu=1),  # type: ignore[arg-type]
        xla_wrap.CheckpointTypeError,
        "`offload_to_cpu`",
    ),
    (
        "checkpoint_wrapper(preserve_rng_state='yes')",
        lambda: xla_wrap.checkpoint_wrapper(_linear(), preserve_rng_state="yes"),
        xla_wrap.CheckpointTypeError,
        "`preserve_rng_state`",
    ),
    (
        "offload_dot_with_no_batch_dims(unpinned_host)",
        lambda: cp.offload_dot_with_no_batch_dims(offload_dst="unpinned_host"),
        xla_wrap.CheckpointValueError,
        "pinned_host",
    ),
    (
        "pending_hlo([])",
        lambda: introspect.pending_hlo([]),
        xla_wrap.CheckpointValueError,
        "at least one tensor",
    ),
    # one answer per mistake: a bool count is a type error everywhere
    (
        "every_nth(n=True)",
        lambda: wp.every_nth(wp.by_name("*"), True),
        xla_wrap.CheckpointTypeError,
        "every_nth",
    ),
    (
        "checkpoint_sequential(segments=True)",
        lambda: xla_wrap.checkpoint_sequential(nn.Sequential(_linear()), True, torch.ones(2)),
        xla_wrap.CheckpointTypeError,
        "checkpoint_sequential",
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_mistake_gets_its_kind_of_error_at_the_call(
    make: Callable[[], Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error) as info:
        make()
    assert type(info.value) is error  # the kind, not a subclass that means something else
    assert str(info.value).startswith("xla_wrap."), str(info.value)
    assert names in str(info.value)


def test_a_plan_that_is_not_a_plan_is_a_type_error_in_both_apis_that_take_one() -> None:
    transformers = pytest.importorskip("transformers")
    from xla_wrap.integrations import transformers as xla_hf

    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(xla_wrap.CheckpointTypeError, match="CheckpointPlan"):
        xla_hf.gradient_checkpointing_enable(model, plan="all")
    with pytest.raises(xla_wrap.CheckpointTypeError, match="CheckpointPlan"):
        xla_wrap.fsdp.auto_wrapper_callable(plan="all")
