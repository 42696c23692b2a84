"""Checkpointing composed with PyTorch's eager FSDP (FSDP2 ``fully_shard`` and FSDP1
``FullyShardedDataParallel``), on CPU over gloo, in two processes; no XLA anywhere.

One start of two worker processes (tests/workers/fsdp_eager.py) runs every composition; the
tests below read its results. Each checkpointed composition must give, on both ranks and in
both training steps, bitwise the loss and gradients of the same FSDP without checkpointing and
the same all-gathers and reduce-scatters, run each block twice per step (once in forward, once
recomputed in backward), and end with the same parameters, CPU generator state and
``state_dict`` keys.

Orders that put the checkpoint around an FSDP unit are refused by xla_wrap with a message; the
tests pin that message.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from _workers import ROOT, WORKERS

pytestmark = pytest.mark.subprocess

WORKER = WORKERS / "fsdp_eager.py"
WORLD_SIZE = 2
DEPTH = 3  # blocks in the worker's model (as in workers/fsdp_eager.py)
STEPS = 2  # training steps the worker runs (as in workers/fsdp_eager.py)
TIMEOUT_S = 120  # for both processes together; a hung gloo collective must not hang the suite

# composition -> the FSDP without checkpointing that it must match
WORKING = {
    "fsdp2: fully_shard(checkpoint_wrapper(block))": "fsdp2 reference",
    "fsdp2: checkpoint_wrapper(fully_shard(block))": "fsdp2 reference",
    "fsdp2: apply_activation_checkpointing after fully_shard": "fsdp2 reference",
    "fsdp1: apply_activation_checkpointing after FSDP": "fsdp1 reference",
    "fsdp1 use_orig_params: apply_activation_checkpointing after FSDP": (
        "fsdp1 use_orig_params reference"
    ),
    "fsdp1: apply_activation_checkpointing before FSDP": "fsdp1 reference",
    "fsdp1: apply_activation_checkpointing before FSDP, policy resolved before": (
        "fsdp1 reference"
    ),
    "fsdp1: auto_wrapper_callable(fsdp_class=FSDP) per block": "fsdp1 reference",
    "fsdp1: ModuleWrapPolicy({Block}) after apply_activation_checkpointing": (
        "fsdp1 ModuleWrapPolicy reference"
    ),
}

# The order that puts the checkpoint around an FSDP1 unit: recomputed in backward, the unit's
# forward would run where FSDP1's state machine expects a backward ("expected to be in states
# [IDLE] but current state is FORWARD_BACKWARD", seen with the refusal lifted), so xla_wrap
# refuses it up front with this message. FSDP2 keeps its hooks on the module itself, around the
# checkpoint, so checkpointing a fully_shard-ed block works (in WORKING).
REFUSED = "is a unit of PyTorch's FSDP1"
UNSUPPORTED = {
    "fsdp1: checkpoint_wrapper(FSDP(block))": REFUSED,
}


@dataclass(repr=False)  # pytest shows the fixture in failures; the results are too long for it
class Run:
    ranks: list[dict[str, Any]]  # per rank: composition -> result, as far as the worker got
    returncodes: list[int | None]
    timed_out: bool
    logs: list[str]
    seconds: float

    def __repr__(self) -> str:
        return f"Run(return codes {self.returncodes}, {self.seconds:.1f} s)"

    def describe(self) -> str:
        lines = [f"return codes {self.returncodes}, timed out: {self.timed_out}"]
        for rank, log in enumerate(self.logs):
            lines.append(f"--- rank {rank} output (last 3000 characters) ---\n{log[-3000:]}")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Both ranks, all compositions, once."""
    out = tmp_path_factory.mktemp("fsdp_eager")
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_FLAGS")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(WORLD_SIZE),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(
            p for p in (env.get("PYTHONPATH"), str(ROOT / "tests"), str(ROOT)) if p
        ),
    )
    start = time.monotonic()
    processes, logs = [], []
    for rank in range(WORLD_SIZE):
        log = open(out / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
        logs.append(log)
        processes.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        )
    timed_out = False
    for process in processes:
        try:
            process.wait(timeout=max(1.0, start + TIMEOUT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    ranks = []
    for rank in range(WORLD_SIZE):
        path = out / f"rank{rank}.pt"
        ranks.append(torch.load(path) if path.exists() else {})
    return Run(
        ranks=ranks,
        returncodes=[p.returncode for p in processes],
        timed_out=timed_out,
        logs=texts,
        seconds=time.monotonic() - start,
    )


def _result(run: Run, rank: int, name: str) -> dict[str, Any]:
    if name not in run.ranks[rank]:
        pytest.fail(f"rank {rank} reported nothing for {name!r}\n{run.describe()}")
    result: dict[str, Any] = run.ranks[rank][name]
    return result


def _error(run: Run, name: str) -> str | None:
    errors = [_result(run, rank, name).get("error") for rank in range(WORLD_SIZE)]
    return next((e for e in errors if e), None)


def _check_same_training(run: Run, name: str, reference: str) -> None:
    for rank in range(WORLD_SIZE):
        for label in (reference, name):
            error = _result(run, rank, label).get("error")
            assert error is None, f"{label!r} failed on rank {rank}:\n{error}"
        expected, got = _result(run, rank, reference), _result(run, rank, name)
        where = f"{name!r}, rank {rank}"
        assert got["wrappers"] == DEPTH, f"{where}: not every block checkpointed"
        assert expected["wrappers"] == 0
        assert len(got["steps"]) == len(expected["steps"]) == STEPS
        for step, (e, g) in enumerate(zip(expected["steps"], got["steps"], strict=True)):
            at = f"{where}, step {step}"
            # Bitwise: on eager CPU the recomputation runs the same kernels on the same values
            # with the replayed Dropout masks, and FSDP reduces the same gradients in the same
            # order, so nothing may differ, not even in the last bit.
            assert torch.equal(g["loss"], e["loss"]), f"{at}: loss {g['loss']} != {e['loss']}"
            assert g["grads"].keys() == e["grads"].keys(), at
            assert e["grads"], at
            for key in e["grads"]:
                diff = (g["grads"][key] - e["grads"][key]).abs().max().item()
                assert torch.equal(g["grads"][key], e["grads"][key]), f"{at}: {key} by {diff}"
            assert sorted(e["calls"]) == [(i, False) for i in range(DEPTH)], at
            # Each block once in forward and once recomputed in backward, no more.
            assert sorted(g["calls"]) == [(i, r) for i in range(DEPTH) for r in (False, True)], at
            # FSDP communicates as without checkpointing: every unit gathered once in forward
            # (and resharded after it) and once in backward, every gradient reduced once.
            assert g["collectives"] == e["collectives"], at
        assert got["state_dict keys"] == expected["state_dict keys"], where
        assert expected["params"].keys() == got["params"].keys(), where
        for key in expected["params"]:
            assert torch.equal(got["params"][key], expected["params"][key]), f"{where}: {key}"
        # The generator continues as without checkpointing (the replay puts it back).
        assert torch.equal(got["rng"], expected["rng"]), where


def test_workers_finish_in_time_without_torch_xla(run: Run) -> None:
    assert not run.timed_out and run.returncodes == [0] * WORLD_SIZE, run.describe()
    for rank in range(WORLD_SIZE):
        assert run.ranks[rank]["torch_xla imported"] is False, f"rank {rank} loaded torch_xla"
    every = {"fsdp2 reference", "fsdp1 reference", "fsdp1 use_orig_params reference"}
    every.add("fsdp1 ModuleWrapPolicy reference")
    every |= WORKING.keys() | UNSUPPORTED.keys()
    assert set(run.ranks[0]) - {"torch_xla imported"} == every


@pytest.mark.parametrize("name", list(WORKING))
def test_checkpointing_inside_eager_fsdp_trains_like_fsdp(run: Run, name: str) -> None:
    _check_same_training(run, name, WORKING[name])


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_orders_fail_loudly(run: Run, name: str) -> None:
    error = _error(run, name)
    assert error is not None, f"{name!r} ran: check it like WORKING and update docs/fsdp.md"
    assert UNSUPPORTED[name] in error, error


def test_module_wrap_policy_after_checkpointing_makes_one_fsdp1_unit_per_block(run: Run) -> None:
    """PyTorch's ``ModuleWrapPolicy({Block})`` applied after ``apply_activation_checkpointing``
    recognizes each checkpointed block as a Block: FSDP1 makes one unit per block plus the root,
    as with the same policy on the unwrapped net (the training itself is checked in
    ``test_checkpointing_inside_eager_fsdp_trains_like_fsdp``)."""
    name = "fsdp1: ModuleWrapPolicy({Block}) after apply_activation_checkpointing"
    for rank in range(WORLD_SIZE):
        for label in (WORKING[name], name):
            result = _result(run, rank, label)
            assert "fsdp units" in result, f"{label!r} failed on rank {rank}:\n{result['error']}"
            units = result["fsdp units"]
            assert units == DEPTH + 1, f"{label!r}, rank {rank}: {units} FSDP units"
