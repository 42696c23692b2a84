"""xla_wrap.introspect against programs whose answers are known."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import internal, introspect

from models import WIDTH

_BUFFER_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, maybe-live-out:
 value: <1 dot.1 @0> (size=64,offset=0): f32[4,4]{1,0}
allocation 1: size 32, parameter 0, shape |f32[8]| at ShapeIndex {}:
allocation 2: size 1000, preallocated-temp:
allocation 3: size 4, thread-local:

Total bytes used: 1100 (1.07KiB)
"""


def test_buffer_assignment_splits_the_total_into_arguments_outputs_and_temporaries() -> None:
    parsed = internal.parse_buffer_assignment(_BUFFER_ASSIGNMENT)
    assert parsed == internal.BufferAssignment(
        total=1100, arguments=32, outputs=64, temporaries=1004
    )
    assert internal.parse_buffer_assignment("no total here") is None


_HLO = """
  %p0 = f32[8,16]{1,0} parameter(0)
  p1 = f32[16,32]{1,0} parameter(1)
  %dot.1 = f32[8,32]{1,0} dot(%p0, p1), lhs_contracting_dims={1}, metadata={op_name="a dot(x)"}
  %x = f32[2,14,14,3]{3,2,1,0} parameter(2)
  %w = f32[3,3,3,5]{3,2,1,0} parameter(3)
  ROOT %conv.2 = f32[2,12,12,5]{3,2,1,0} convolution(%x, %w), dim_labels=b01f_01io->b01f
  %opt-barrier.3 = (f32[4]{0}, f32[4]{0}) opt-barrier((f32[4]{0}, f32[4]{0}) %tuple.2)
  %dot.5 = f32[<=8,32]{1,0} dot(f32[<=8,16]{1,0} %p9, f32[16,32]{1,0} %p1), lhs_contracting_dims={1}
  %p9 = f32[<=8,16]{1,0} parameter(4)
"""


def test_flops_and_counts_in_hlo_text() -> None:
    # Two 8x16 @ 16x32 dots (one with a dynamic dim and operands printed with their shapes),
    # a 3x3 convolution from 3 to 5 channels over a 12x12 output, batch 2.
    expected = 2 * (2 * 8 * 32 * 16) + 2 * (2 * 12 * 12 * 5) * (3 * 3 * 3)
    assert introspect.hlo_flops(_HLO) == expected
    # Only definitions count: not the "dot(" inside the metadata string.
    assert introspect.count_instructions(_HLO, "dot") == 2
    assert introspect.count_instructions(_HLO, "opt-barrier") == 1  # a tuple-shaped result
    assert introspect.count_instructions(_HLO, "convolution") == 1


_WHILE = (
    "  %while.0 = (s64[], f32[8,16]{1,0}, f32[16,32]{1,0}) while(%tuple.0), condition=%Cond.1, "
    'body=%Body.1, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0"}}'
)
_LOOP_MODULE = """HloModule loop

%fused (param_0: f32[8,16], param_1: f32[16,32]) -> f32[8,32] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.9 = f32[8,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}

%Body.1 (p.1: (s64[], f32[8,16], f32[16,32])) -> (s64[], f32[8,16], f32[16,32]) {
  %p.1 = (s64[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %a.1 = f32[8,16]{1,0} get-tuple-element(%p.1), index=1
  %b.1 = f32[16,32]{1,0} get-tuple-element(%p.1), index=2
  %fusion.1 = f32[8,32]{1,0} fusion(%a.1, %b.1), kind=kOutput, calls=%fused
  ROOT %t.1 = (s64[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%i.1, %a.1, %b.1)
}

%Cond.1 (p.2: (s64[], f32[8,16], f32[16,32])) -> pred[] {
  %p.2 = (s64[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  ROOT %lt.1 = pred[] compare(%i.2, %n.2), direction=LT
}

ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[8,32] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,32]{1,0} parameter(1)
  %once = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}
WHILE_LINE
  ROOT %r = f32[8,32]{1,0} copy(%once)
}
"""
_LOOP_MODULE = _LOOP_MODULE.replace("WHILE_LINE", _WHILE)


def test_flops_count_a_loop_body_once_per_known_iteration() -> None:
    dot = 2 * 8 * 32 * 16
    assert introspect.hlo_flops(_LOOP_MODULE) == dot + 5 * dot  # the body's dot, in a fusion
    unknown = _LOOP_MODULE.replace('"known_trip_count":{"n":"5"},', "")
    assert introspect.hlo_flops(unknown) == 2 * dot  # trip count unknown: once


_GATHERS = """
  %shard = f32[4]{0} parameter(0)
  %barrier = (f32[4]{0}, f32[2]{0}) opt-barrier((f32[4]{0}, f32[2]{0}) %tuple.1)
  %forward = f32[16]{0} all-gather(%shard), dimensions={0}
  %gte = f32[4]{0} get-tuple-element(%barrier), index=0
  %moved = f32[4]{0} copy(%gte)
  %again = f32[16]{0} all-gather(%moved), dimensions={0}
  %computed = f32[4]{0} add(%gte, %shard)
  %other = f32[16]{0} all-gather(%computed), dimensions={0}
"""


def test_count_instructions_reading_a_barrier_follows_data_movement_only() -> None:
    assert introspect.count_instructions(_GATHERS, "all-gather") == 3
    # %again reads the barrier through a tuple access and a copy; %other reads a computed value.
    assert introspect.count_instructions(_GATHERS, "all-gather", reading="opt-barrier") == 1
    assert introspect.count_instructions(_GATHERS, "all-gather", reading="parameter") == 1


def test_recompute_cost_is_the_difference_of_two_programs() -> None:
    def program(hlo: str) -> introspect.CompiledProgram:
        return introspect.CompiledProgram("m", 1, 0, 0, 1, hlo)

    plain = program(_HLO)
    again = program(_HLO + "  %dot.9 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}\n")
    cost = introspect.recompute_cost(plain, again)
    assert (cost.extra_dots, cost.extra_convolutions, cost.extra_flops) == (1, 0, 2 * 8 * 32 * 16)
    assert cost.flops_ratio == pytest.approx(again.flops / plain.flops)


@pytest.mark.xla
def test_matmul_chain_flops_and_barrier_count_on_xla(xla_device: torch.device) -> None:
    import torch_xla

    # Made on the host, so that they are arguments of the compiled program.
    a, b, c = (torch.randn(*shape).to(xla_device) for shape in ((8, 16), (16, 32), (32, 4)))
    torch_xla.sync()
    (ab,) = xla_wrap.optimization_barrier(a @ b)
    (out,) = xla_wrap.optimization_barrier(ab @ c)
    expected = 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4
    hlo = introspect.pending_hlo([out])
    assert introspect.hlo_flops(hlo) == expected
    assert introspect.count_instructions(hlo, "opt-barrier") == 2
    program = introspect.compiled_memory(lambda: (out.add_(0), torch_xla.sync()))
    assert program.flops == expected and program.count("opt-barrier") == 2
    assert program.total_bytes == (
        program.argument_bytes + program.output_bytes + program.temporary_bytes
    )
    assert program.argument_bytes == 4 * (8 * 16 + 16 * 32 + 32 * 4)


@pytest.mark.xla
def test_compiled_peak_orders_none_above_checkpointed(xla_device: torch.device) -> None:
    import torch_xla

    def peak(checkpointed: bool) -> int:
        torch.manual_seed(0)
        # MLP blocks whose wide hidden activations are what checkpointing drops.
        layers = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())
                for _ in range(6)
            )
        )
        layers = layers.to(xla_device)
        if checkpointed:
            xla_wrap.apply_activation_checkpointing(layers, lambda m: isinstance(m, nn.Sequential))
        x = torch.randn(256, 64, device=xla_device)

        def step() -> None:
            layers(x).sum().backward()
            torch_xla.sync()

        return introspect.compiled_memory(step).total_bytes

    assert peak(checkpointed=False) > peak(checkpointed=True)


def test_saved_residuals_of_a_small_mlp() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    residuals = introspect.saved_residuals(mlp, x)
    by_kind = {r.kind: r for r in residuals}
    assert sorted(by_kind) == ["activation", "input", "parameter"] and len(residuals) == 3
    assert by_kind["input"].shape == (3, 4) and by_kind["input"].nbytes == 3 * 4 * 4
    assert by_kind["activation"].shape == (3, 8)  # the ReLU output, kept once for two users
    assert by_kind["activation"].made_by == "relu"
    assert by_kind["parameter"].shape == (8, 2)  # the second weight, for the ReLU's gradient
    table = introspect.format_residuals(residuals)
    assert table.splitlines()[-1].startswith("total 0.00 MiB (activation")


def test_a_checkpointed_block_keeps_only_its_input(device: torch.device) -> None:
    block = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, WIDTH), nn.Tanh())
    block = block.to(device)
    x = torch.randn(5, WIDTH, device=device, requires_grad=True)
    plain = introspect.saved_residuals(block, x)
    wrapped = introspect.saved_residuals(xla_wrap.checkpoint_wrapper(block), x)
    # Both Tanh outputs (Tanh's backward reads its result; the second Linear reads the first).
    assert sorted(r.shape for r in plain if r.kind == "activation") == [(5, WIDTH), (5, 32)]
    assert [(r.kind, r.shape) for r in wrapped] == [("input", (5, WIDTH))]


def test_a_checkpointed_block_keeps_its_input_and_a_copy_of_each_buffer() -> None:
    block = nn.BatchNorm1d(WIDTH)  # two statistics and a step counter, updated by the forward
    x = torch.randn(5, WIDTH, requires_grad=True)
    wrapped = introspect.saved_residuals(xla_wrap.checkpoint_wrapper(block), x)
    assert [(r.kind, r.shape) for r in wrapped] == [
        ("input", (5, WIDTH)),
        ("buffer", (WIDTH,)),
        ("buffer", (WIDTH,)),
        ("buffer", ()),
    ]


def test_saved_residuals_never_triggers_another_tools_recomputation() -> None:
    import torch.utils.checkpoint as torch_checkpoint

    calls: list[int] = []
    block = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, WIDTH))

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return block(x)

    x = torch.randn(5, WIDTH, requires_grad=True)
    residuals = introspect.saved_residuals(
        lambda t: torch_checkpoint.checkpoint(forward, t, use_reentrant=False), x
    )
    assert calls == [1]  # reading what is saved did not unpack (and so rerun) anything
    assert not any(r.kind == "activation" for r in residuals)


def test_saved_residuals_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError, match=r"^xla_wrap.introspect.saved_residuals: expected"):
        introspect.saved_residuals(torch.ones(2))


@pytest.mark.xla
def test_compile_dumps_are_read_from_the_running_configuration(
    xla_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert introspect.enable_compile_dumps() == introspect.dump_directory()
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander")
    with pytest.raises(xla_wrap.CheckpointError, match="before the first XLA device"):
        introspect.enable_compile_dumps()
    with pytest.raises(ValueError, match="enable_compile_dumps"):
        introspect.compiled_programs(lambda: None)


@pytest.mark.xla
def test_no_barrier_warning_when_barriers_are_kept(xla_device: torch.device) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", xla_wrap.BarriersStrippedWarning)
        x = torch.randn(3, device=xla_device, requires_grad=True)
        xla_wrap.checkpoint(torch.sin, x).sum().backward()


_STOCK_CPU = """
import warnings, torch, torch_xla, xla_wrap
dumps = xla_wrap.introspect.enable_compile_dumps()  # before the device: a temporary directory
x = torch.randn(3, device=torch_xla.device(), requires_grad=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        xla_wrap.checkpoint(torch.sin, x).sum().backward()  # user line
print(len([w for w in caught if issubclass(w.category, xla_wrap.BarriersStrippedWarning)]))
print(caught[0].filename.endswith("<string>"), caught[0].lineno)
print(str(caught[0].message))
program = xla_wrap.introspect.compiled_memory(lambda: (x.grad.add_(1), torch_xla.sync()))
print(program.total_bytes > 0, dumps.is_dir())
print(dumps)
"""


@pytest.mark.xla
@pytest.mark.subprocess
def test_stock_xla_cpu_warns_once_and_dumps_clean_up() -> None:
    pytest.importorskip("torch_xla")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PJRT_DEVICE"] = "CPU"
    done = subprocess.run(
        [sys.executable, "-c", _STOCK_CPU], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    count, location, message, measured, dumps = done.stdout.strip().splitlines()
    assert count == "1"
    assert location == "True 8"  # points at the user's line, not inside xla_wrap or torch
    assert "--xla_disable_hlo_passes=cse_barrier_expander" in message
    # enable_compile_dumps made a working dump directory, and it is gone after the process.
    assert measured == "True True"
    assert not Path(dumps).exists()
