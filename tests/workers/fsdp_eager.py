"""One rank of tests/fsdp/test_fsdp_eager.py: PyTorch's eager FSDP on CPU over gloo, with xla_wrap.

The test starts this file twice
(``PYTHONPATH=tests python tests/workers/fsdp_eager.py RESULTS_DIR [NAME...]``) with torchrun's
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). It is not a test
module (pytest collects ``test_*.py`` only), so it never imports tests/conftest.py and neither
needs nor loads torch_xla.

Every composition in :data:`COMPOSITIONS` trains the same small model for two SGD steps and
records, on this rank: the losses, the gradients, the parameters after the optimizer steps,
which calls of each block were recomputations, how many all-gathers and reduce-scatters each
step issued in forward and in backward, the CPU generator state, the ``state_dict`` keys and the
number of FSDP units at the end. An exception is recorded with its
traceback and the next composition runs. The results file is rewritten after every
composition, so a hang still reports the compositions before it.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import xla_wrap
from xla_wrap import fsdp, wrap_policies

import models

WIDTH = 16
BATCH = 4
DEPTH = 3
STEPS = 2
# A collective that waits longer than this raises instead of hanging; the test's own timeout
# on the processes is the last resort.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


class Block(nn.Module):
    """Linear + GELU + Dropout(0.1) with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.linear(x)))


class Net(models.Net):
    def __init__(self) -> None:
        super().__init__((Block() for _ in range(DEPTH)), WIDTH)


# --- FSDP2: torch.distributed.fsdp.fully_shard ---------------------------------------------


def fsdp2_plain(net: Net) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block)
    return fully_shard(net)


def fsdp2_shard_checkpointed_blocks(net: Net, **options: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(net.blocks):
        net.blocks[i] = fully_shard(xla_wrap.checkpoint_wrapper(block, **options))
        # Wrapping the sharded checkpoint again is a no-op, as for any CheckpointWrapper.
        if xla_wrap.checkpoint_wrapper(net.blocks[i], **options) is not net.blocks[i]:
            raise AssertionError("checkpoint_wrapper re-wrapped an FSDP2-sharded wrapper")
    return fully_shard(net)


def fsdp2_checkpoint_after_sharding(net: Net) -> nn.Module:
    model = fsdp2_plain(net)
    return xla_wrap.apply_activation_checkpointing(model, wrap_policies.by_type(Block))


def fsdp2_checkpoint_sharded_blocks(net: Net) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(net.blocks):
        net.blocks[i] = xla_wrap.checkpoint_wrapper(fully_shard(block))
    return fully_shard(net)


def full_values(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The whole value of each DTensor (a collective: all ranks call it in the same order)."""
    return {name: t.full_tensor().detach().clone() for name, t in tensors.items()}


def fsdp2_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_values({n: p.grad for n, p in model.named_parameters()})


def fsdp2_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_values(dict(model.named_parameters()))


# --- FSDP1: torch.distributed.fsdp.FullyShardedDataParallel --------------------------------


def fsdp1(
    order: str, *, use_orig_params: bool = False, **checkpoint_options: Any
) -> Callable[[Net], nn.Module]:
    def build(net: Net) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # FSDP1 refuses a CPU model unless told that the CPU is the device to compute on.
        options: dict[str, Any] = {
            "device_id": torch.device("cpu"),
            "use_orig_params": use_orig_params,
        }
        if order == "plain":
            policy = fsdp.auto_wrap_policy(wrap_policies.by_type(Block), net)
            return FSDP(net, auto_wrap_policy=policy, **options)
        if order == "checkpoint after wrapping":
            policy = fsdp.auto_wrap_policy(wrap_policies.by_type(Block), net)
            model = FSDP(net, auto_wrap_policy=policy, **options)
            return xla_wrap.apply_activation_checkpointing(
                model, wrap_policies.by_type(Block), **checkpoint_options
            )
        if order == "checkpoint before wrapping":
            xla_wrap.apply_activation_checkpointing(net, wrap_policies.by_type(Block))
            # The blocks are CheckpointWrappers now, so the FSDP units are selected by that type.
            policy = fsdp.auto_wrap_policy(wrap_policies.by_type(xla_wrap.CheckpointWrapper), net)
            return FSDP(net, auto_wrap_policy=policy, **options)
        if order == "checkpoint before wrapping, Block policy":
            policy = fsdp.auto_wrap_policy(wrap_policies.by_type(Block), net)
            xla_wrap.apply_activation_checkpointing(net, wrap_policies.by_type(Block))
            return FSDP(net, auto_wrap_policy=policy, **options)
        if order == "plain, ModuleWrapPolicy":
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), **options)
        if order == "checkpoint before wrapping, ModuleWrapPolicy":
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            # PyTorch's own policy selects the units by class: a checkpointed block is a Block.
            xla_wrap.apply_activation_checkpointing(net, lambda m: isinstance(m, Block))
            return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), **options)
        if order == "auto_wrapper_callable per block":
            unit = fsdp.auto_wrapper_callable(fsdp_class=FSDP)
            for i, block in enumerate(net.blocks):
                net.blocks[i] = unit(block, **options)
            return FSDP(net, **options)
        if order == "checkpoint_wrapper(FSDP(block))":
            for i, block in enumerate(net.blocks):
                net.blocks[i] = xla_wrap.checkpoint_wrapper(FSDP(block, **options))
            return FSDP(net, **options)
        raise ValueError(order)

    return build


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of the gradients (FSDP1 flattens and shards the parameters)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@dataclass(frozen=True)
class Composition:
    build: Callable[[Net], nn.Module]
    grads: Callable[[nn.Module], dict[str, torch.Tensor]]
    params: Callable[[nn.Module], dict[str, torch.Tensor]]


FSDP2 = {"grads": fsdp2_grads, "params": fsdp2_params}
FSDP1 = {"grads": local_grads, "params": local_params}

# The references (no checkpointing) first; test_fsdp_eager.py names each composition's one.
COMPOSITIONS: dict[str, Composition] = {
    "fsdp2 reference": Composition(fsdp2_plain, **FSDP2),
    "fsdp1 reference": Composition(fsdp1("plain"), **FSDP1),
    "fsdp1 use_orig_params reference": Composition(fsdp1("plain", use_orig_params=True), **FSDP1),
    "fsdp1 ModuleWrapPolicy reference": Composition(fsdp1("plain, ModuleWrapPolicy"), **FSDP1),
    "fsdp2: fully_shard(checkpoint_wrapper(block))": Composition(
        fsdp2_shard_checkpointed_blocks, **FSDP2
    ),
    "fsdp2: apply_activation_checkpointing after fully_shard": Composition(
        fsdp2_checkpoint_after_sharding, **FSDP2
    ),
    "fsdp2: checkpoint_wrapper(fully_shard(block))": Composition(
        fsdp2_checkpoint_sharded_blocks, **FSDP2
    ),
    "fsdp1: apply_activation_checkpointing after FSDP": Composition(
        fsdp1("checkpoint after wrapping"), **FSDP1
    ),
    "fsdp1: apply_activation_checkpointing before FSDP": Composition(
        fsdp1("checkpoint before wrapping"), **FSDP1
    ),
    "fsdp1: auto_wrapper_callable(fsdp_class=FSDP) per block": Composition(
        fsdp1("auto_wrapper_callable per block"), **FSDP1
    ),
    "fsdp1: apply_activation_checkpointing before FSDP, policy resolved before": Composition(
        fsdp1("checkpoint before wrapping, Block policy"), **FSDP1
    ),
    "fsdp1 use_orig_params: apply_activation_checkpointing after FSDP": Composition(
        fsdp1("checkpoint after wrapping", use_orig_params=True), **FSDP1
    ),
    "fsdp1: checkpoint_wrapper(FSDP(block))": Composition(
        fsdp1("checkpoint_wrapper(FSDP(block))"), **FSDP1
    ),
    "fsdp1: ModuleWrapPolicy({Block}) after apply_activation_checkpointing": Composition(
        fsdp1("checkpoint before wrapping, ModuleWrapPolicy"), **FSDP1
    ),
}


_collectives: Counter[str] = Counter()


def count_collectives() -> None:
    """Count the all-gathers and reduce-scatters FSDP issues (both FSDPs call them through
    ``torch.distributed`` at call time)."""
    for name in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor"):
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            _collectives[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def fsdp_unit_count(model: nn.Module) -> int:
    """The FSDP1 units and FSDP2-sharded modules in ``model``, the root included."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return sum(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules())


def train(composition: Composition, rank: int, built: dict[str, Any]) -> dict[str, Any]:
    """Two SGD steps. The CPU generator is seeded once, so the second step's Dropout masks also
    show whether checkpointing left the generator where the unwrapped model leaves it. What is
    known once the model is built (its FSDP units) goes into ``built`` at once, so that it is
    reported even if the training then fails."""
    torch.manual_seed(0)  # the same initial parameters on every rank
    net = Net()
    calls: list[tuple[int, bool]] = []
    for index, block in enumerate(net.blocks):
        # On a submodule: the checkpointed block's own hooks run once, around the checkpoint.
        block.linear.register_forward_hook(
            lambda *_, index=index: calls.append((index, xla_wrap.is_recomputing()))
        )
    model = composition.build(net)
    built["fsdp units"] = fsdp_unit_count(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    torch.manual_seed(1000 + rank)  # and its own Dropout masks
    steps = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=inputs)
        optimizer.zero_grad(set_to_none=True)
        calls.clear()
        _collectives.clear()
        loss = model(x)
        in_forward = dict(_collectives)
        _collectives.clear()
        loss.backward()
        in_backward = dict(_collectives)
        steps.append(
            {
                "loss": loss.detach().clone(),
                "grads": composition.grads(model),
                "calls": [*calls],
                "collectives": {"forward": in_forward, "backward": in_backward},
            }
        )
        optimizer.step()
    return {
        "steps": steps,
        "params": composition.params(model),
        "rng": torch.get_rng_state(),
        "state_dict keys": sorted(model.state_dict()),
        "wrappers": sum(isinstance(m, xla_wrap.CheckpointWrapper) for m in model.modules()),
        **built,
    }


def main() -> None:
    out = Path(sys.argv[1])
    only = sys.argv[2:]  # names of the compositions to run; all of them when none is given
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    count_collectives()
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    results: dict[str, Any] = {}
    path = out / f"rank{rank}.pt"
    for name, composition in COMPOSITIONS.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        built: dict[str, Any] = {}
        try:
            result = train(composition, rank, built)
        except Exception:
            result = {**built, "error": traceback.format_exc()}
        try:
            dist.barrier()  # the next composition starts together on both ranks
        except Exception:
            result.setdefault("error", traceback.format_exc())
        result["seconds"] = time.perf_counter() - start
        results[name] = result
        results["torch_xla imported"] = "torch_xla" in sys.modules
        torch.save(results, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
