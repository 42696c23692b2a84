"""Offload (``offload_to_cpu=True``, ``checkpoint_policies.offload_these_names``): training is
unchanged, XLA programs carry host-placement annotations where a backend executes them, and
XLA:CPU keeps the values on the device, warns once and still runs one execution per step."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import checkpoint_policies as cp
from xla_wrap import internal

from _workers import WORKERS
from models import BATCH, WIDTH, Stack, assert_same, sync, train_step, wrap_blocks, wrapped_copy

WORKER = WORKERS / "offload_hlo.py"

OFFLOADS = {
    "offload_to_cpu": {"offload_to_cpu": True},
    "offload-policy": {
        "policy": lambda op: cp.Decision.OFFLOAD if op.function == "linear" else False
    },
}


@pytest.mark.parametrize("name", list(OFFLOADS))
def test_offloading_checkpoints_give_the_unwrapped_gradients_with_dropout(name: str) -> None:
    torch.manual_seed(0)
    model = Stack()
    twin = wrapped_copy(model, functools.partial(wrap_blocks, **OFFLOADS[name]))
    cpu = torch.device("cpu")
    assert_same(train_step(model, cpu, seed=4), train_step(twin, cpu, seed=4), cpu)


def test_annotations_in_the_hlo_a_tpu_or_gpu_would_get_feed_the_barrier() -> None:
    pytest.importorskip("torch_xla")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    # The block's input (offload_to_cpu) or the tagged hidden value (the policy) goes to the
    # host in the forward and comes back, into the barrier, in backward.
    assert results["offload_to_cpu"] == {
        "to_host": [f"f32[4,{WIDTH}]"],
        "to_device": [f"f32[4,{WIDTH}]"],
        "barriered": True,
    }
    assert results["offload_these_names"] == {
        "to_host": [f"f32[4,{4 * WIDTH}]"],
        "to_device": [f"f32[4,{4 * WIDTH}]"],
        "barriered": True,
    }


@pytest.mark.xla
def test_xla_cpu_keeps_values_on_device_warns_once_and_runs_one_execution_per_step(
    xla_device: torch.device,
) -> None:
    import torch_xla.debug.metrics as met

    torch.manual_seed(0)
    model = Stack().to(xla_device)
    twin = wrapped_copy(model, functools.partial(wrap_blocks, offload_to_cpu=True))
    expected = train_step(model, xla_device, seed=4)
    internal.forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_step(twin, xla_device, seed=4)
        executions = met.metric_data("ExecuteTime")[0]
        train_step(twin, xla_device, seed=4)
        executions = met.metric_data("ExecuteTime")[0] - executions
    assert_same(expected, got, xla_device)
    offload_warnings = [w for w in caught if "offloading to host memory" in str(w.message)]
    assert len(offload_warnings) == 1
    assert offload_warnings[0].filename == __file__ or "models.py" in offload_warnings[0].filename
    # train_step syncs once and then copies results to the host: one program execution.
    assert executions == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_saved_inputs_wait_in_pinned_host_memory() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5), nn.Tanh()).cuda()
    x = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
    y = xla_wrap.checkpoint(block, x, offload_to_cpu=True)
    saved = y.grad_fn.saved_tensors
    assert saved and all(t.device.type == "cpu" and t.is_pinned() for t in saved)
    torch.manual_seed(1)
    y = xla_wrap.checkpoint(block, x, offload_to_cpu=True)
    (got,) = torch.autograd.grad(y.sum(), x)
    torch.manual_seed(1)
    (expected,) = torch.autograd.grad(block(x).sum(), x)
    sync(x.device)
    assert torch.equal(got, expected)
