"""Every public callable, driven with wrong values in each argument (issue 38 part 3): each
call either refuses at once, with a CheckpointTypeError or CheckpointValueError whose message
starts with the API's name, or accepts the value and then works when its result is used. Any
other exception, and a failure only when the result is used (a lazy failure), is red.

The records (Op, Residual, CompiledProgram, RecomputeCost, CheckpointPlan) are built by hand
too, for a policy's tests or a plan kept as data. plan_checkpointing plans a tiny CPU model for
torch.compile; the XLA-only targets run where torch_xla is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import fsdp, introspect
from xla_wrap import wrap_policies as wp

# A valid policy meeting a wrong model selects nothing, and says so.
pytestmark = pytest.mark.filterwarnings("ignore:.*selects no submodule:UserWarning")


def _wrong_values() -> list[tuple[str, Any]]:
    return [
        ("None", None),
        ("-1", -1),
        ("0", 0),
        ("2.5", 2.5),
        ("nan", math.nan),
        ("True", True),
        ("'x'", "x"),
        ("[]", []),
        ("{}", {}),
        ("object()", object()),
        ("tensor", torch.ones(2)),
        ("module", nn.ReLU()),
    ]


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(2, 2)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))


def _x() -> torch.Tensor:
    return torch.linspace(-1, 1, 4).reshape(2, 2).requires_grad_()


def _step(module: Any) -> None:
    """Use a module (or anything callable on a batch) as a training step does."""
    assert callable(module), f"expected a module, got {module!r}"
    out = module(_x())
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()


def _save_policy_used(policy: Any) -> None:
    x = _x()
    xla_wrap.checkpoint(lambda h: (h @ h).tanh(), x, policy=policy).sum().backward()


def _wrap_policy_used(policy: Any) -> None:
    model = _model()
    modules = {id(m) for m in model.modules()}
    chosen = policy.select(model)
    assert all(isinstance(n, str) and id(m) in modules for n, m in chosen), chosen


def _loop(layers: Any) -> None:
    """Use a stack as a model's forward does: layer by layer."""
    h = _x()
    for layer in layers:
        h = layer(h)
    h.sum().backward()


def _count(n: Any) -> None:
    assert isinstance(n, int) and not isinstance(n, bool), repr(n)


def _nothing(value: Any) -> None:
    del value


def _tensors(value: Any) -> None:
    flat = value if isinstance(value, tuple) else (value,)
    assert all(isinstance(t, torch.Tensor) for t in flat)


def _fx_graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(nn.Tanh())


def _residuals() -> list[introspect.Residual]:
    return introspect.saved_residuals(_linear(), _x())


def _program() -> introspect.CompiledProgram:
    return introspect.CompiledProgram(
        name="step",
        total_bytes=64,
        argument_bytes=16,
        output_bytes=16,
        temporary_bytes=32,
        optimized_hlo="ENTRY %main {\n  %p = f32[2,2]{1,0} parameter(0)\n}",
    )


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).tanh()


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block())


def _planned(plan: Any) -> None:
    assert isinstance(plan, xla_wrap.CheckpointPlan), repr(plan)
    assert set(plan.choices) == {"0", "1"}, plan.choices


@functools.cache
def _plan() -> xla_wrap.CheckpointPlan:
    """A plan of `_blocks()`, made once: it knows blocks by name (`apply`) and by identity
    (`options_of`, which answers None for another model's blocks)."""
    return xla_wrap.plan_checkpointing(_blocks(), _x(), budget=1.0, progress=False)


def _options_or_none(options: Any) -> None:
    assert options is None or isinstance(options, xla_wrap.CheckpointOptions), repr(options)


def _has_xla() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def _xla_step() -> None:
    import torch_xla

    total = (torch.ones(2, device=torch_xla.device()) * 3).sum()
    torch_xla.sync()  # runs the pending graph of `total`, still alive here
    del total


def _xla_tensors() -> list[torch.Tensor]:
    import torch_xla

    return [torch.ones(2, device=torch_xla.device()) * 2]


def _program_list(programs: Any) -> None:
    assert all(isinstance(p, introspect.CompiledProgram) for p in programs), programs


def _transformers_model() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def _enable_hf(**arguments: Any) -> nn.Module:
    from xla_wrap.integrations import transformers as xla_hf

    model = arguments.pop("model")
    xla_hf.gradient_checkpointing_enable(model, **arguments)
    return model


def _install_and_uninstall(**arguments: Any) -> None:
    from xla_wrap.integrations import transformers as xla_hf

    pytest.importorskip("transformers")
    try:
        xla_hf.install(**arguments)
    finally:
        xla_hf.uninstall()


def _disable_hf(model: Any) -> nn.Module:
    from xla_wrap.integrations import transformers as xla_hf

    xla_hf.gradient_checkpointing_disable(model)
    return model


def _hf_step(model: nn.Module) -> None:
    model.train()
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()


@dataclass(frozen=True)
class Target:
    """A public callable: its name (as its errors start), a valid call as keyword arguments
    (`call` takes them; positional-only ones are passed on by position inside `call`), and
    how its result is used. `passed` names the inputs handed on to the user's function as they
    are: what that function does with a wrong one is its own answer. `also` gives the other
    types an argument takes (a policy's name, a budget's fraction), whose wrong values are wrong
    values, not wrong types.
    `available` says whether the target can run here (torch_xla installed)."""

    api: str
    call: Callable[..., Any]
    valid: Callable[[], dict[str, Any]]
    use: Callable[[Any], None]
    passed: tuple[str, ...] = ()
    also: dict[str, tuple[type, ...]] = field(default_factory=dict)
    available: Callable[[], bool] = lambda: True


# The checkpoint options every checkpointing API takes, at valid values.
_OPTIONS = {
    "preserve_rng_state": True,
    "use_reentrant": None,
    "policy": None,
    "offload_to_cpu": False,
}

TARGETS = [
    Target(
        "xla_wrap.checkpoint",
        lambda function, x, **o: xla_wrap.checkpoint(function, x, **o),
        lambda: {
            "function": _linear(),
            "x": _x(),
            **_OPTIONS,
        },
        lambda out: out.sum().backward(),
        passed=("x",),
    ),
    Target(
        "xla_wrap.checkpoint_wrapper",
        lambda module, **o: xla_wrap.checkpoint_wrapper(module, **o),
        lambda: {
            "module": _linear(),
            **_OPTIONS,
        },
        _step,
    ),
    Target(
        "xla_wrap.checkpoint_sequential",
        lambda functions, segments, x, **o: xla_wrap.checkpoint_sequential(
            functions, segments, x, **o
        ),
        lambda: {
            "functions": _model(),
            "segments": 2,
            "x": _x(),
            **_OPTIONS,
        },
        lambda out: out.sum().backward(),
        passed=("x",),
    ),
    Target(
        "xla_wrap.CheckpointOptions",
        xla_wrap.CheckpointOptions,
        lambda: {"preserve_rng_state": True, "policy": None, "offload_to_cpu": False},
        lambda options: _step(
            xla_wrap.checkpoint_wrapper(
                _linear(),
                preserve_rng_state=options.preserve_rng_state,
                policy=options.policy,
                offload_to_cpu=options.offload_to_cpu,
            )
        ),
    ),
    Target(
        "xla_wrap.apply_activation_checkpointing",
        lambda model, **o: xla_wrap.apply_activation_checkpointing(model, **o),
        lambda: {"model": _model(), "check_fn": wp.by_type(nn.Linear)},
        _step,
    ),
    Target(
        "xla_wrap.ScannedLayers",
        xla_wrap.ScannedLayers,
        lambda: {
            "modules": [_linear(), _linear()],
            "policy": None,
            "offload_to_cpu": False,
            "stack_parameters": False,
        },
        _loop,
    ),
    Target(
        "xla_wrap.apply_scan",
        lambda model, **o: xla_wrap.apply_scan(model, **o),
        lambda: {
            "model": nn.Sequential(_linear(), _linear()),
            "check_fn": None,
            "policy": None,
            "offload_to_cpu": False,
            "stack_parameters": False,
        },
        _step,
    ),
    Target(
        "xla_wrap.scan_layers",
        lambda layers, x, **o: xla_wrap.scan_layers(layers, x, **o),
        lambda: {
            "layers": [_linear(), _linear()],
            "x": _x(),
            "policy": None,
            "offload_to_cpu": False,
        },
        lambda out: out.sum().backward(),
        passed=("x",),
    ),
    Target(
        "xla_wrap.unscan",
        xla_wrap.unscan,
        lambda: {"layers": xla_wrap.ScannedLayers([_linear(), _linear()])},
        lambda layers: _step(nn.Sequential(*layers)),
    ),
    Target(
        "xla_wrap.unwrap",
        xla_wrap.unwrap,
        lambda: {"module": xla_wrap.checkpoint_wrapper(_linear())},
        _step,
    ),
    Target(
        "xla_wrap.checkpoint_name",
        xla_wrap.checkpoint_name,
        lambda: {"tensor": _x(), "name": "h"},
        _tensors,
    ),
    Target(
        "xla_wrap.optimization_barrier",
        lambda a, b: xla_wrap.optimization_barrier(a, b),
        lambda: {"a": _x(), "b": _x()},
        _tensors,
    ),
    Target(
        "xla_wrap.region_barriers",
        xla_wrap.region_barriers,
        lambda: {"graph_module": _fx_graph(), "barrier": lambda ts: ts},
        _nothing,
    ),
    Target(
        "xla_wrap.with_region_barriers",
        xla_wrap.with_region_barriers,
        lambda: {"backend": "aot_eager", "barrier": lambda ts: ts},
        lambda backend: None if callable(backend) else pytest.fail(f"not a backend: {backend}"),
    ),
    Target(
        "xla_wrap.checkpoint_policies.offload_dot_with_no_batch_dims",
        cp.offload_dot_with_no_batch_dims,
        lambda: {"offload_src": "device", "offload_dst": "pinned_host"},
        _save_policy_used,
    ),
    *[
        Target(
            f"xla_wrap.checkpoint_policies.{factory.__name__}",
            lambda first, second, factory=factory: factory(first, second),
            lambda: {"first": "h", "second": "g"},
            _save_policy_used,
        )
        for factory in (
            cp.offload_these_names,
            cp.save_any_names_but_these,
            cp.save_only_these_names,
        )
    ],
    Target(
        "xla_wrap.checkpoint_policies.save_and_offload_only_these_names",
        cp.save_and_offload_only_these_names,
        lambda: {"names_which_can_be_saved": ("h",), "names_which_can_be_offloaded": ("g",)},
        _save_policy_used,
    ),
    Target(
        "xla_wrap.checkpoint_policies.save_from_both_policies",
        cp.save_from_both_policies,
        lambda: {"policy_1": cp.dots_saveable, "policy_2": cp.save_only_these_names("h")},
        _save_policy_used,
        also={"policy_1": (str,), "policy_2": (str,)},
    ),
    Target(
        "xla_wrap.wrap_policies.by_name",
        lambda first, second: wp.by_name(first, second),
        lambda: {"first": "0", "second": "2"},
        _wrap_policy_used,
    ),
    Target(
        "xla_wrap.wrap_policies.by_type",
        lambda first, second: wp.by_type(first, second),
        lambda: {"first": nn.Linear, "second": nn.Tanh},
        _wrap_policy_used,
    ),
    Target(
        "xla_wrap.wrap_policies.by_param_count",
        wp.by_param_count,
        lambda: {"min_params": 1, "max_params": None},
        _wrap_policy_used,
    ),
    Target(
        "xla_wrap.wrap_policies.by_predicate",
        wp.by_predicate,
        lambda: {"predicate": lambda m: isinstance(m, nn.Linear)},
        _wrap_policy_used,
    ),
    Target(
        "xla_wrap.wrap_policies.every_nth",
        wp.every_nth,
        lambda: {"policy": wp.by_type(nn.Linear), "n": 2, "offset": 0},
        _wrap_policy_used,
    ),
    Target(
        "xla_wrap.introspect.count_instructions",
        introspect.count_instructions,
        lambda: {"hlo": _program().optimized_hlo, "opcode": "parameter", "reading": None},
        _count,
    ),
    Target(
        "xla_wrap.introspect.hlo_flops",
        introspect.hlo_flops,
        lambda: {"hlo": _program().optimized_hlo},
        _count,
    ),
    Target(
        "xla_wrap.introspect.format_residuals",
        introspect.format_residuals,
        lambda: {"residuals": _residuals()},
        lambda text: None if isinstance(text, str) else pytest.fail(repr(text)),
    ),
    Target(
        "xla_wrap.introspect.saved_residuals",
        lambda function, x: introspect.saved_residuals(function, x),
        lambda: {"function": _linear(), "x": _x()},
        lambda residuals: introspect.format_residuals(residuals) and None,
        passed=("x",),
    ),
    Target(
        "xla_wrap.introspect.recompute_cost",
        introspect.recompute_cost,
        lambda: {"plain": _program(), "checkpointed": _program()},
        lambda cost: None if cost.extra_flops == 0 else pytest.fail(repr(cost)),
    ),
    Target(
        "xla_wrap.introspect.dump_directory",
        introspect.dump_directory,
        lambda: {"xla_flags": "--xla_dump_to=/tmp/x"},
        _nothing,
    ),
    Target(
        "xla_wrap.fsdp.auto_wrap_policy",
        fsdp.auto_wrap_policy,
        lambda: {"policy": wp.by_type(nn.Linear), "model": _model()},
        lambda fn: None if callable(fn) else pytest.fail(repr(fn)),
    ),
    Target(
        "xla_wrap.fsdp.auto_wrapper_callable",
        fsdp.auto_wrapper_callable,
        lambda: {"fsdp_class": None, "plan": None, "preserve_rng_state": True},
        lambda wrap: None if callable(wrap) else pytest.fail(repr(wrap)),
        available=_has_xla,  # its default class is torch_xla's
    ),
    Target(
        "xla_wrap.fsdp.fsdp_units",
        fsdp.fsdp_units,
        lambda: {"model": _model()},
        lambda units: None if units == [] else pytest.fail(repr(units)),
    ),
    Target(
        "xla_wrap.CheckpointWrapper.empty_checkpointed",
        xla_wrap.CheckpointWrapper.empty_checkpointed,
        lambda: {"module_class": nn.Linear},
        lambda made: None if isinstance(made, xla_wrap.CheckpointWrapper) else pytest.fail(made),
    ),
    Target(
        "xla_wrap.introspect.CompiledProgram.count",
        lambda opcode, reading: _program().count(opcode, reading=reading),
        lambda: {"opcode": "parameter", "reading": None},
        _count,
    ),
    Target(
        "xla_wrap.plan_checkpointing",
        lambda model, x, **o: xla_wrap.plan_checkpointing(model, x, **o),
        lambda: {
            "model": _blocks(),
            "x": _x(),
            "budget": 10**6,
            "candidates": None,
            "loss": None,
            "choices": None,
            "progress": False,
        },
        _planned,
        passed=("x",),
        also={"budget": (float,)},
    ),
    Target(
        "xla_wrap.CheckpointPlan.apply",
        lambda model: _plan().apply(model),
        lambda: {"model": _blocks()},
        _step,
    ),
    Target(
        "xla_wrap.CheckpointPlan.options_of",
        lambda module: _plan().options_of(module),
        lambda: {"module": _blocks()[0]},
        _options_or_none,
    ),
    Target(
        "xla_wrap.checkpoint_policies.Op",
        cp.Op,
        lambda: {
            "function": "linear",
            "name": None,
            "shapes": ((2, 2),),
            "nbytes": 16,
            "input_shapes": ((2, 2), (2, 2)),
        },
        lambda op: None if isinstance(cp.dots_saveable(op), bool) else pytest.fail(repr(op)),
    ),
    Target(
        "xla_wrap.introspect.Residual",
        introspect.Residual,
        lambda: {
            "shape": (2, 2),
            "dtype": torch.float32,
            "nbytes": 16,
            "kind": "input",
            "made_by": "linear",
        },
        lambda residual: introspect.format_residuals([residual]) and None,
    ),
    Target(
        "xla_wrap.introspect.CompiledProgram",
        introspect.CompiledProgram,
        lambda: dataclasses.asdict(_program()),
        lambda program: _count(program.count("parameter") + program.flops),
    ),
    Target(
        "xla_wrap.introspect.RecomputeCost",
        introspect.RecomputeCost,
        lambda: {"extra_dots": 1, "extra_convolutions": 0, "extra_flops": 8, "flops_ratio": 1.5},
        lambda cost: None if isinstance(repr(cost), str) else pytest.fail(),
    ),
    Target(
        "xla_wrap.CheckpointPlan",
        xla_wrap.CheckpointPlan,
        lambda: {
            "choices": {"0": "full", "1": "none"},
            "budget_bytes": 100,
            "peak_bytes": 50,
            "predicted_peak_bytes": 50,
            "recompute_flops": 10,
            "unplanned_peak_bytes": 100,
            "unplanned_flops": 100,
            "costs": (),
            "compiles": 0,
            "measure": "saved bytes",
        },
        lambda plan: _step(plan.apply(_blocks())) if str(plan) else None,
        also={"budget_bytes": (int,)},
    ),
    Target(
        "xla_wrap.openxla_backend",
        lambda graph_module, example_inputs: xla_wrap.openxla_backend(graph_module, example_inputs),
        lambda: {"graph_module": _fx_graph(), "example_inputs": [torch.ones(2)]},
        lambda compiled: None if callable(compiled) else pytest.fail(repr(compiled)),
        passed=("example_inputs",),
        available=_has_xla,
    ),
    Target(
        "xla_wrap.introspect.pending_hlo",
        introspect.pending_hlo,
        lambda: {"tensors": _xla_tensors()},
        lambda text: None if "HloModule" in text else pytest.fail(text),
        available=_has_xla,
    ),
    *[
        Target(
            f"xla_wrap.introspect.{read.__name__}",
            read,
            lambda: {"step": _xla_step},
            _program_list if read is introspect.compiled_programs else _nothing,
            available=_has_xla,
        )
        for read in (introspect.compiled_memory, introspect.compiled_programs)
    ],
    Target(
        # The suite's processes dump already (tests/conftest.py): the call changes no flag.
        "xla_wrap.introspect.enable_compile_dumps",
        introspect.enable_compile_dumps,
        lambda: {"directory": None},
        lambda path: None if isinstance(path, Path) else pytest.fail(repr(path)),
    ),
    Target(
        "xla_wrap.integrations.transformers.install",
        _install_and_uninstall,
        lambda: {"everywhere": False},
        _nothing,
    ),
]
_HF = Target(
    "xla_wrap.integrations.transformers.gradient_checkpointing_enable",
    _enable_hf,
    lambda: {"model": _transformers_model(), "every_n_layers": 1, "scan": False,
             "stack_parameters": False, "plan": None, "preserve_rng_state": True},
    _hf_step,
)  # fmt: skip
_HF_DISABLE = Target(
    "xla_wrap.integrations.transformers.gradient_checkpointing_disable",
    _disable_hf,
    lambda: {"model": _enable_hf(model=_transformers_model())},
    _hf_step,
)


def _same_kind(value: Any, valid: Any) -> bool:
    """Whether `value` could be a wrong value of the type `valid` has, rather than a wrong type:
    always where the valid value is None (the argument's type is open) or a string (a name, which
    may name a value of another type); a bool is no int, a float no int, any list, tuple or
    container module a sequence, any module a module, any callable a callable."""
    if valid is None or isinstance(valid, str):
        return True
    if isinstance(valid, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(valid, bool)
    sequences = (list, tuple, nn.Sequential, nn.ModuleList)
    if isinstance(valid, nn.Module) and isinstance(value, nn.Module):
        return True
    if isinstance(valid, sequences):
        return isinstance(value, sequences)
    if isinstance(valid, nn.Module):
        return False
    if isinstance(valid, (int, float)):
        return isinstance(value, type(valid))
    if callable(valid):
        return callable(value)
    return isinstance(value, type(valid))


def _attack(target: Target, argument: str, value: Any) -> None:
    arguments = target.valid()
    valid, arguments[argument] = arguments[argument], value
    try:
        result = target.call(**arguments)
    except (xla_wrap.CheckpointTypeError, xla_wrap.CheckpointValueError) as error:
        assert str(error).startswith(target.api.rsplit(".", 1)[0]), (
            f"{target.api}({argument}={value!r}): the message does not name the API: {error}"
        )
        same_kind = _same_kind(value, valid) or isinstance(value, target.also.get(argument, ()))
        if isinstance(error, xla_wrap.CheckpointValueError) and not same_kind:
            pytest.fail(
                f"{target.api}({argument}={value!r}): a value of another type than the valid "
                f"{valid!r} is a wrong type, answered with a CheckpointValueError: {error}"
            )
        return
    except Exception as error:
        pytest.fail(
            f"{target.api}({argument}={value!r}) raised {type(error).__name__}: {error}",
        )
    try:
        target.use(result)
    except Exception as error:
        pytest.fail(
            f"{target.api}({argument}={value!r}) was accepted, then failed when used: "
            f"{type(error).__name__}: {error}"
        )


def _cases() -> list[tuple[Target, str]]:
    return [(t, a) for t in TARGETS if t.available() for a in t.valid() if a not in t.passed]


@pytest.mark.parametrize(
    ("target", "argument"), _cases(), ids=[f"{t.api.rsplit('.', 1)[1]}-{a}" for t, a in _cases()]
)
def test_each_wrong_value_is_refused_at_the_call_or_works(target: Target, argument: str) -> None:
    for _, value in _wrong_values():
        _attack(target, argument, value)


def test_the_transformers_integration_refuses_wrong_values_at_the_call_or_works() -> None:
    # Each call builds a model: a few values of each type, the module (a non-PreTrainedModel)
    # among them.
    cheap = ("None", "0", "-1", "nan", "2.5", "True", "'x'", "tensor", "module")
    for target in (_HF, _HF_DISABLE):
        for argument in target.valid():
            for label, value in _wrong_values():
                if label in cheap:
                    _attack(target, argument, value)


_values = st.one_of(
    st.sampled_from([v for _, v in _wrong_values()]),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-1, 2), max_size=2),
    st.tuples(st.text(max_size=2)),
    st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=1),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(_cases()), value=_values)
def test_any_value_is_refused_at_the_call_or_works(case: tuple[Target, str], value: Any) -> None:
    _attack(*case, value)
