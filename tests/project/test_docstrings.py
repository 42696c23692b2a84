"""The API reference is built from the docstrings: every public name has one, in one style
(Google's, read by griffe as the site reads it), describing every parameter, the return value
and the errors the function itself raises."""

from __future__ import annotations

import doctest
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from _workers import ROOT
from test_docs import PUBLIC_MODULES

griffe = pytest.importorskip("griffe", reason="the docs tools: pip install -e '.[docs]'")


def _package() -> griffe.Module:
    return griffe.load(
        "xla_wrap", search_paths=[str(ROOT)], docstring_parser="google", resolve_aliases=True
    )


def _sections(obj: griffe.Object) -> dict[str, griffe.DocstringSection]:
    assert obj.docstring is not None
    return {section.kind.value: section for section in obj.docstring.parse("google")}


def _described(sections: dict[str, griffe.DocstringSection], kind: str) -> set[str]:
    if kind not in sections:
        return set()
    return {item.name.lstrip("*") for item in sections[kind].value}


def _summary_problems(path: str, obj: griffe.Object) -> Iterator[str]:
    # The first line is the summary the API reference's tables show: a whole sentence.
    assert obj.docstring is not None
    first = obj.docstring.value.strip().splitlines()[0]
    if not first.rstrip().endswith((".", ":")):
        yield f"{path}: the first line is not a whole sentence (the summary): {first!r}"


def _function_problems(path: str, function: griffe.Function) -> Iterator[str]:
    if function.docstring is None:
        yield f"{path}: no docstring"
        return
    yield from _summary_problems(path, function)
    sections = _sections(function)
    described = _described(sections, "parameters")
    # Parameters named with a leading underscore are the implementation's, not the caller's.
    parameters = {p.name for p in function.parameters if p.name not in ("self", "cls")}
    parameters = {name for name in parameters if not name.startswith("_")}
    for name in sorted(parameters - described):
        yield f"{path}: parameter `{name}` is not described (Args:)"
    for name in sorted(described - parameters):
        yield f"{path}: describes `{name}`, which is not a parameter"
    returns = str(function.returns) if function.returns is not None else "None"
    is_property = "property" in function.labels
    if returns != "None" and not is_property and not {"returns", "yields"} & sections.keys():
        yield f"{path}: the return value is not described (Returns:)"
    body = "\n".join(function.lines)
    if "raise " in body.replace("raise NotImplementedError", "") and "raises" not in sections:
        yield f"{path}: raises, but has no Raises: section"


def _class_problems(path: str, cls: griffe.Class) -> Iterator[str]:
    if cls.docstring is None:
        yield f"{path}: no docstring"
        return
    yield from _summary_problems(path, cls)
    sections = _sections(cls)
    described = _described(sections, "parameters") | _described(sections, "attributes")
    init = cls.members.get("__init__")
    if init is not None and not init.is_alias and isinstance(init, griffe.Function):
        for p in init.parameters:
            if p.name != "self" and not p.name.startswith("_") and p.name not in described:
                yield f"{path}: constructor parameter `{p.name}` is not described"
    for name, member in cls.members.items():
        if name.startswith("_") or member.is_alias:
            continue
        if isinstance(member, griffe.Function):
            if "property" in member.labels:
                if member.docstring is None:
                    yield f"{path}.{name}: no docstring"
            else:
                yield from _function_problems(f"{path}.{name}", member)
        elif (
            isinstance(member, griffe.Attribute)
            and member.docstring is None
            and name not in described
        ):
            yield f"{path}.{name}: attribute not described"


def _public_objects() -> Iterator[tuple[str, griffe.Object]]:
    package = _package()
    for module_path in PUBLIC_MODULES:
        module = package if module_path == "xla_wrap" else package[module_path[len("xla_wrap.") :]]
        assert module.exports, f"{module_path} has no __all__"
        for name in module.exports:
            obj = module[str(name)]
            target = obj.final_target if obj.is_alias else obj
            if not target.is_module:
                yield f"{module_path}.{name}", target


def test_every_public_name_describes_its_parameters_return_value_and_errors() -> None:
    problems: list[str] = []
    for path, obj in _public_objects():
        if isinstance(obj, griffe.Function):
            problems.extend(_function_problems(path, obj))
        elif isinstance(obj, griffe.Class):
            problems.extend(_class_problems(path, obj))
        elif obj.docstring is None:
            problems.append(f"{path}: no docstring")
    assert not problems, "\n".join(problems)


def test_the_docstring_check_finds_what_is_missing(tmp_path: Path) -> None:
    # The check itself can fail: a function with an undescribed parameter, no Returns and a
    # bare raise, and a class with an undescribed attribute.
    source = '''
def f(a: int, b: int) -> int:
    """Add `a`
    and `b`.

    Args:
        a: One.
        c: Not a parameter.
    """
    raise ValueError(a)


class C:
    """A class.

    Attributes:
        x: Described.
    """

    x: int
    y: int
'''
    (tmp_path / "probe.py").write_text(source)
    module = griffe.load("probe", search_paths=[str(tmp_path)], docstring_parser="google")
    found = [*_function_problems("f", module["f"]), *_class_problems("C", module["C"])]
    assert found == [
        "f: the first line is not a whole sentence (the summary): 'Add `a`'",
        "f: parameter `b` is not described (Args:)",
        "f: describes `c`, which is not a parameter",
        "f: the return value is not described (Returns:)",
        "f: raises, but has no Raises: section",
        "C.y: attribute not described",
    ]


def _docstring_examples() -> Iterator[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    seen: set[str] = set()
    for module_path in PUBLIC_MODULES:
        module = importlib.import_module(module_path)
        for name in [*module.__all__, None]:
            obj = module if name is None else getattr(module, name)
            for test in finder.find(obj, f"{module_path}.{name}" if name else module_path):
                key = f"{test.filename}:{test.lineno}"
                if test.examples and key not in seen:
                    seen.add(key)
                    yield test


def test_the_examples_in_docstrings_run_as_written() -> None:
    # Each Examples: section of a public docstring, run by doctest on eager CPU (examples
    # that need an XLA device say `# doctest: +SKIP`).
    tests = list(_docstring_examples())
    assert len(tests) >= 10, [t.name for t in tests]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed (output above)"
