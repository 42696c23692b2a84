"""The house rules, read from xla_wrap's own source (nothing is imported; docs/architecture.md
draws the house):

* every module sits in a room (``ROOMS``) or is a face (``FACES``);
* a room imports only rooms on lower floors, and nothing imports back up: no circles;
* no private name is taken across rooms (``xla_wrap.internal`` re-exports them for the bench
  and the tests, as Equinox's ``internal``);
* each other library is reached from its own room only (``LIBRARIES``);
* the checkpoint core asks its execution path through the switchboard (``xla_wrap._paths``),
  never a path's room.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "xla_wrap"

# Rooms by dotted prefix (the longest match at a dot boundary wins) and their floors: a room
# imports only rooms on lower floors. Faces (floor 9) hand names on and may import each other.
ROOMS: dict[str, int] = {
    "xla_wrap._support": 1,
    "xla_wrap._layouts": 1,
    "xla_wrap.checkpoint_policies": 2,
    "xla_wrap.wrap_policies": 2,
    "xla_wrap._paths": 3,
    "xla_wrap._core": 4,
    "xla_wrap._scan": 5,
    "xla_wrap._inspect": 5,
    "xla_wrap._plan": 6,
    "xla_wrap._fsdp": 7,
    "xla_wrap.integrations": 8,
    "xla_wrap.bench": 10,
}
FACES = {"xla_wrap", "xla_wrap.introspect", "xla_wrap.fsdp", "xla_wrap.wrap"}
FACE_FLOOR = 9
# The face for xla_wrap's own bench and tests, which re-exports names from private modules.
SEMI_PUBLIC = {"xla_wrap.internal"}

# Other libraries, and the modules (dotted prefixes) that may reach them: the gateways
# (``_paths.xla`` for torch_xla, ``_paths.compiled`` for torch.compile), and the bench.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch_xla": ("xla_wrap._paths.xla.", "xla_wrap.bench."),
    "torch._dynamo": ("xla_wrap._paths.compiled.", "xla_wrap.bench."),
    "torch._functorch": ("xla_wrap._paths.compiled.", "xla_wrap.bench."),
    "functorch": ("xla_wrap._paths.compiled.", "xla_wrap.bench."),
    "torch.utils.checkpoint": ("xla_wrap._paths.compiled.", "xla_wrap.bench."),
    "transformers": ("xla_wrap.integrations.transformers",),
    "fairscale": ("xla_wrap.bench.",),
}

# Rooms that must reach another room through its package (its switchboard), never its modules.
THROUGH_THE_PACKAGE: dict[str, str] = {"xla_wrap._core": "xla_wrap._paths"}


@dataclass
class _Module:
    name: str
    path: Path
    is_package: bool
    imports: list[tuple[str, str | None]] = field(default_factory=list)  # (module, name)
    attributes: list[tuple[str, str]] = field(default_factory=list)  # (module alias, attribute)
    named: list[str] = field(default_factory=list)  # libraries named by a string


def _library(dotted: str) -> str | None:
    return next((lib for lib in LIBRARIES if dotted == lib or dotted.startswith(lib + ".")), None)


def _modules() -> dict[str, _Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(["xla_wrap", *(parts[:-1] if is_package else parts)])
        found[name] = _Module(name, path, is_package)
    return found


def _resolve(module: _Module, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _read(module: _Module, known: dict[str, _Module]) -> None:
    """Every import (at module level, in functions, under TYPE_CHECKING), every attribute read
    through an imported module, and every library named by a string (``sys.modules.get``,
    ``importlib.import_module``, ``find_spec``, ``_loaded``)."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:  # `from . import x`: a module
                    module.imports.append((sub, None))
                    aliases[alias.asname or alias.name] = sub
                else:
                    module.imports.append((target, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module.imports.append((alias.name, None))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func, value = node.func, node.args[0].value
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            by_string = called in ("import_module", "find_spec", "_loaded") or (
                called == "get"
                and isinstance(func, ast.Attribute)
                and ast.unparse(func.value) == "sys.modules"
            )
            if by_string and isinstance(value, str) and _library(value):
                module.named.append(value)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            module.attributes.append((aliases[node.value.id], node.attr))


def _room(name: str) -> str:
    if name in FACES:
        return name
    matches = [prefix for prefix in ROOMS if name == prefix or name.startswith(prefix + ".")]
    return max(matches, key=len) if matches else name  # not placed yet: a room of its own


def _floor(room: str) -> int | None:
    return FACE_FLOOR if room in FACES else ROOMS.get(room)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations() -> set[str]:
    modules = _modules()
    for module in modules.values():
        _read(module, modules)
    graph: dict[str, set[str]] = defaultdict(set)
    found: set[str] = set()
    for module in modules.values():
        room = _room(module.name)
        if room == module.name and room not in {*FACES, *SEMI_PUBLIC, *ROOMS}:
            found.add(f"unplaced: {module.name} is in no room")
        for target, name in module.imports:
            library = _library(target if name is None else f"{target}.{name}") or _library(target)
            if library and not module.name.startswith(LIBRARIES[library]):
                found.add(f"library: {module.name} imports {library}")
            if target not in modules:
                continue
            if target != module.name:
                graph[module.name].add(target)
            gate = THROUGH_THE_PACKAGE.get(room)
            if gate and target.startswith(gate + "."):
                found.add(f"past the switchboard: {module.name} imports {target}")
            target_room = _room(target)
            if room == target_room or (room in FACES and target_room in FACES):
                continue
            floor, target_floor = _floor(room), _floor(target_room)
            if floor is not None and target_floor is not None and target_floor >= floor:
                found.add(f"up a floor: {room} ({floor}) imports {target_room} ({target_floor})")
            if name is not None and _private(name) and module.name not in SEMI_PUBLIC:
                found.add(f"private: {module.name} takes {target}.{name}")
        for owner, attribute in module.attributes:
            if (
                owner in modules
                and _room(owner) != room
                and _private(attribute)
                and module.name not in SEMI_PUBLIC
            ):
                found.add(f"private: {module.name} takes {owner}.{attribute}")
        for library_name in module.named:
            library = _library(library_name)
            if library and not module.name.startswith(LIBRARIES[library]):
                found.add(f"library: {module.name} imports {library}")
    for circle in _circles(graph):
        found.add("circle: " + " <-> ".join(circle))
    return found


def test_the_package_keeps_the_house_rules() -> None:
    found = violations()
    assert not found, "broken house rules:\n" + "\n".join(sorted(found))


def test_the_reader_sees_what_it_must_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules catch a circle, a private name across rooms, a library outside its room, an
    import up a floor, a module in no room and the core reaching past its switchboard, in a
    package made for the purpose."""
    package = tmp_path / "xla_wrap"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from ..high import thing\n")
    (package / "high.py").write_text(
        "from .low import _secret\nfrom . import other\nimport torch_xla\nthing = 1\n"
    )
    (package / "other.py").write_text("from . import high\n")
    (package / "_core").mkdir()
    (package / "_core" / "__init__.py").write_text("")
    (package / "_core" / "engine.py").write_text("from .._paths import device_path\n")
    (package / "_core" / "barrier.py").write_text("from .._paths.xla import lowering\n")
    (package / "_paths" / "xla").mkdir(parents=True)
    for init in ("_paths/__init__.py", "_paths/xla/__init__.py", "_paths/xla/lowering.py"):
        (package / init).write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    rooms = {"xla_wrap.low": 1, "xla_wrap.high": 2, "xla_wrap._paths": 3, "xla_wrap._core": 4}
    monkeypatch.setitem(globals(), "ROOMS", rooms)
    assert violations() == {
        "circle: xla_wrap.high <-> xla_wrap.low <-> xla_wrap.other",
        "private: xla_wrap.high takes xla_wrap.low._secret",
        "library: xla_wrap.high imports torch_xla",
        "up a floor: xla_wrap.low (1) imports xla_wrap.high (2)",
        "unplaced: xla_wrap.other is in no room",
        "past the switchboard: xla_wrap._core.barrier imports xla_wrap._paths.xla.lowering",
    }


def _private_imports() -> set[str]:
    """Every import of a private xla_wrap module or name by the tests or the bench."""
    found = set()
    for path in [
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((PACKAGE / "bench").glob("*.py")),
    ]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            dotted: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] == "xla_wrap":
                    dotted = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and path.parent.name == "bench":
                base = "xla_wrap" if node.level == 2 else "xla_wrap.bench"
                module = f"{base}.{node.module}" if node.module else base
                dotted = [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                dotted = [a.name for a in node.names if a.name.split(".")[0] == "xla_wrap"]
            for name in dotted:
                parts = name.split(".")
                if path.parent.name == "bench" and parts[1:2] == ["bench"]:
                    continue  # the bench's own modules
                private = [i for i, part in enumerate(parts) if _private(part)]
                if private:  # named up to its first private part
                    found.add(
                        f"{path.relative_to(ROOT)} imports {'.'.join(parts[: private[0] + 1])}"
                    )
    return found


def test_the_tests_and_the_bench_use_public_names_or_xla_wrap_internal() -> None:
    found = _private_imports()
    assert not found, "use a public name or xla_wrap.internal:\n" + "\n".join(sorted(found))
