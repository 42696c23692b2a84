"""Wrap policies (xla_wrap.wrap_policies) on random module trees, against an independent oracle."""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import xla_wrap
from xla_wrap import wrap_policies as wp


class Alpha(nn.Module):
    pass


class Beta(nn.Module):
    pass


class Gamma(nn.Module):
    pass


CLASSES = {"Alpha": Alpha, "Beta": Beta, "Gamma": Gamma}

_node = st.tuples(st.sampled_from(sorted(CLASSES)), st.integers(0, 6))
_trees = st.recursive(
    _node.map(lambda n: (*n, [])),
    lambda children: st.tuples(
        st.sampled_from(sorted(CLASSES)), st.integers(0, 6), st.lists(children, max_size=3)
    ),
    max_leaves=10,
)


def build(spec: Any) -> nn.Module:
    kind, size, children = spec
    module = CLASSES[kind]()
    if size:
        module.weight = nn.Parameter(torch.zeros(size))
    for index, child in enumerate(children):
        module.add_module(f"{child[0].lower()}{index}", build(child))
    return module


# ---- the oracle: its own traversal and its own reading of each rule -------------------------


def traverse(model: nn.Module) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    order: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        order.append((name, module))
        for child_name, child in module._modules.items():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return order


def param_count(module: nn.Module) -> int:
    unique = {id(p): p.numel() for m in traverse(module) for p in m[1]._parameters.values()}
    return sum(unique.values())


def oracle(rule: Any, model: nn.Module) -> list[int]:
    order = traverse(model)
    kind = rule[0]
    if kind == "type":
        return [id(m) for _, m in order if type(m).__name__ in rule[1]]
    if kind == "size":
        low, high = rule[1], rule[2]
        return [
            id(m)
            for _, m in order
            if low <= param_count(m) and (high is None or param_count(m) <= high)
        ]
    if kind == "name":
        return [id(m) for n, m in order if fnmatch.fnmatchcase(n, rule[1])]
    if kind == "predicate":
        return [id(m) for _, m in order if "weight" in m._parameters]
    if kind == "nth":
        return oracle(rule[1], model)[rule[3] :: rule[2]]
    left, right = oracle(rule[1], model), oracle(rule[2], model)
    if kind == "and":
        return [i for i in left if i in right]
    return [id(m) for _, m in order if id(m) in set(left) | set(right)]


def policy_of(rule: Any) -> wp.WrapPolicy:
    kind = rule[0]
    if kind == "type":
        return wp.by_type({CLASSES[name] for name in rule[1]})
    if kind == "size":
        return wp.by_param_count(rule[1], rule[2])
    if kind == "name":
        return wp.by_name(rule[1])
    if kind == "predicate":
        return wp.by_predicate(lambda m: "weight" in m._parameters)
    if kind == "nth":
        return wp.every_nth(policy_of(rule[1]), rule[2], offset=rule[3])
    if kind == "and":
        return policy_of(rule[1]) & policy_of(rule[2])
    return policy_of(rule[1]) | policy_of(rule[2])


_leaf_rules = st.one_of(
    st.tuples(st.just("type"), st.sets(st.sampled_from(sorted(CLASSES)), min_size=1)),
    st.tuples(st.just("size"), st.integers(0, 12), st.one_of(st.none(), st.integers(0, 30))),
    st.tuples(st.just("name"), st.sampled_from(["*alpha*", "beta?", "*.gamma*", "*", "alpha0*"])),
    st.tuples(st.just("predicate")),
)


def _combine(rules: Any) -> Any:
    return st.one_of(
        st.integers(1, 3).flatmap(
            lambda n: st.tuples(st.just("nth"), rules, st.just(n), st.integers(0, n - 1))
        ),
        st.tuples(st.just("and"), rules, rules),
        st.tuples(st.just("or"), rules, rules),
    )


_rules = st.recursive(_leaf_rules, _combine, max_leaves=4)


@settings(max_examples=150, deadline=None)
@given(spec=_trees, rule=_rules, data=st.data())
def test_policy_wraps_exactly_the_selection_once_and_never_the_root(
    spec: Any, rule: Any, data: Any
) -> None:
    model = build(spec)
    modules = [m for _, m in traverse(model)]
    if len(modules) > 2 and data.draw(st.booleans(), label="share a module"):
        model.add_module("again", data.draw(st.sampled_from(modules[1:]), label="shared"))
    expected = oracle(rule, model)
    policy = policy_of(rule)
    assert [id(m) for _, m in policy.select(model)] == expected
    names_before = [n for n, _ in model.named_parameters()]
    if id(model) in expected:
        with pytest.raises(xla_wrap.CheckpointValueError, match="selects the model itself"):
            xla_wrap.apply_activation_checkpointing(model, policy)
        assert not any(isinstance(m, xla_wrap.CheckpointWrapper) for m in model.modules())
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xla_wrap.apply_activation_checkpointing(model, policy)
    assert bool(caught) == (not expected)  # a warning exactly when nothing is selected
    wrapped = [id(m) for m in model.modules() if isinstance(m, xla_wrap.CheckpointWrapper)]
    assert sorted(wrapped) == sorted(expected)  # exactly the selection, in place
    assert not isinstance(model, xla_wrap.CheckpointWrapper)
    assert [n for n, _ in model.named_parameters()] == names_before


def test_every_nth_is_the_memory_speed_dial() -> None:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(6)))
    policy = wp.every_nth(wp.by_type(nn.Linear), 3, offset=1)
    assert [name for name, _ in policy.select(model)] == ["1.0", "4.0"]
    xla_wrap.apply_activation_checkpointing(model, policy)
    assert [isinstance(model[i][0], xla_wrap.CheckpointWrapper) for i in range(6)] == [
        False,
        True,
        False,
        False,
        True,
        False,
    ]
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_policy_reprs_say_what_they_select() -> None:
    policy = wp.every_nth(wp.by_type(nn.Linear), 2) & wp.by_name("layers.*")
    assert repr(policy) == "(every_nth(by_type(Linear), 2, offset=0) & by_name('layers.*'))"


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: wp.by_type("Linear"), TypeError, "expected module classes"),
        (lambda: wp.by_type(), ValueError, "at least one module class"),
        (lambda: wp.by_param_count(-1), ValueError, "non-negative int"),
        (lambda: wp.by_param_count(None), TypeError, "an int as `min_params`"),
        (lambda: wp.by_param_count(2.0), TypeError, "an int as `min_params`"),
        (lambda: wp.every_nth(wp.by_name("*"), True), TypeError, "ints as `n` and `offset`"),
        (lambda: wp.every_nth(wp.by_name("*"), 2, offset=1.0), TypeError, "ints as"),
        (lambda: wp.by_name(), TypeError, "patterns as strings"),
        (lambda: wp.by_predicate(3), TypeError, "expected a function of a module"),
        (lambda: wp.by_predicate(nn.Linear), TypeError, "To select by class, use `by_type"),
        (
            lambda: wp.every_nth(wp.by_name("*"), 0),
            ValueError,
            "positive int",
        ),
        (
            lambda: wp.every_nth(wp.by_name("*"), 2, offset=2),
            ValueError,
            "offset",
        ),
        (lambda: wp.every_nth(lambda m: True, 2), TypeError, "expected a WrapPolicy"),
        (
            lambda: wp.by_name("*") & (lambda m: True),
            TypeError,
            "expected a WrapPolicy for `&`",
        ),
    ],
)
def test_bad_policy_arguments_get_clear_errors(make: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        make()
    assert str(info.value).startswith("xla_wrap.wrap")


def test_the_old_module_name_warns_and_selects_the_same_modules() -> None:
    """``xla_wrap.wrap`` (read as the inverse of ``unwrap``, which it is not) still works for
    code written against it, with a DeprecationWarning that names the new module."""
    from xla_wrap import wrap

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.warns(DeprecationWarning, match="xla_wrap.wrap_policies.by_type"):
        old = wrap.by_type(nn.Linear)
    assert old.select(model) == wp.by_type(nn.Linear).select(model)
    with pytest.warns(DeprecationWarning):
        assert wrap.Policy is wp.WrapPolicy
    with pytest.raises(AttributeError):
        wrap.no_such_policy  # noqa: B018
