"""Pickles of xla_wrap's objects name public paths only, so that moving a module inside the
package never breaks a saved model; and pickles made before that still load."""

from __future__ import annotations

import pickle
import pickletools
from pathlib import Path
from typing import Any

import torch
from torch import nn

import xla_wrap

BEFORE = Path(__file__).parent / "data" / "pickled_before_0.1.0.pkl"
# What BEFORE holds, built again: made at commit 3d1d6c2 by
#   torch.manual_seed(0)
#   {"checkpointed": checkpoint_wrapper(Sequential(Linear(3, 3), GELU()), policy="dots_saveable"),
#    "options": CheckpointOptions(preserve_rng_state=False, policy=dots_saveable),
#    "scanned": ScannedLayers([Linear(3, 3) for _ in range(2)]),
#    "stacked": ScannedLayers([Linear(3, 3) for _ in range(2)], stack_parameters=True)}
#   pickled with protocol 4.


def _objects() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "checkpointed": xla_wrap.checkpoint_wrapper(
            nn.Sequential(nn.Linear(3, 3), nn.GELU()), policy="dots_saveable"
        ),
        "options": xla_wrap.CheckpointOptions(
            preserve_rng_state=False, policy=xla_wrap.checkpoint_policies.dots_saveable
        ),
        "scanned": xla_wrap.ScannedLayers([nn.Linear(3, 3) for _ in range(2)]),
        "stacked": xla_wrap.ScannedLayers(
            [nn.Linear(3, 3) for _ in range(2)], stack_parameters=True
        ),
    }


def _xla_wrap_paths(data: bytes) -> set[str]:
    """Every module path of xla_wrap a pickle names (the strings its globals are found by)."""
    return {
        arg
        for _, arg, _ in pickletools.genops(data)
        if isinstance(arg, str) and arg.split(" ")[0].split(".")[0] == "xla_wrap"
    }


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """The loaded objects are what was pickled: the same classes, options, states, and a
    checkpointed forward and backward (eager CPU) equal to the originals'."""
    assert got["options"] == expected["options"]
    x = torch.randn(2, 3)
    for name in ("checkpointed", "scanned", "stacked"):
        module, original = got[name], expected[name]
        assert type(module) is type(original), name
        assert list(module.state_dict()) == list(original.state_dict()), name  # hooks once
        for (key, a), b in zip(
            module.state_dict().items(), original.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (name, key)
        out = x
        for layer in module if name != "checkpointed" else [module]:
            out = layer(out)
        ref = x
        for layer in original if name != "checkpointed" else [original]:
            ref = layer(ref)
        assert torch.equal(out, ref), name
    checkpointed = got["checkpointed"]
    assert isinstance(checkpointed, xla_wrap.CheckpointWrapper)
    assert checkpointed.checkpoint_options == expected["checkpointed"].checkpoint_options
    assert got["stacked"].parameters_stacked and not got["scanned"].parameters_stacked
    # The stacked list's load hook came back (once): a per-layer state loads into the stack.
    state = {k: v + 1 for k, v in expected["stacked"].state_dict().items()}
    got["stacked"].load_state_dict(state)
    assert all(torch.equal(a, state[k]) for k, a in got["stacked"].state_dict().items())


def test_pickles_name_public_paths_only_and_load_as_what_was_pickled() -> None:
    objects = _objects()
    data = pickle.dumps(objects)
    paths = _xla_wrap_paths(data)
    assert "xla_wrap" in paths  # the probe sees the classes' module
    assert not [p for p in paths if "._" in p], paths
    _assert_same(pickle.loads(data), _objects())


def test_a_deep_copy_of_a_stacked_list_keeps_its_state_dict_hooks_once() -> None:
    import copy

    stacked = _objects()["stacked"]
    copied = copy.deepcopy(stacked)
    assert list(copied.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_a_pickle_made_before_0_1_0_loads() -> None:
    with BEFORE.open("rb") as f:
        before = pickle.load(f)
    _assert_same(before, _objects())
