"""The documentation site: it builds with --strict (a broken link or unknown reference fails),
its API reference lists every public name, and every Python block in docs/ and the README runs
on eager CPU, but for those marked with why they cannot (an XLA device, several processes, a
download)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap

import models
from _workers import ROOT

# The modules the API reference documents (docs/api/), each by its __all__: the package, the
# modules it exports, and the transformers integration (imported on its own, for transformers).
PUBLIC_MODULES = (
    "xla_wrap",
    *(f"xla_wrap.{name}" for name in xla_wrap.__all__ if inspect.ismodule(getattr(xla_wrap, name))),
    "xla_wrap.integrations.transformers",
)

# A block preceded by this comment is shown but not run; the reason is required.
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    not_run: str | None  # the reason, for a block that is shown but not run

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: Path) -> Iterator[Block]:
    text = page.read_text()
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = NOT_RUN.search(before[-1]) if before else None
        indent = len(match["indent"])
        code = "\n".join(line[indent:] for line in match["body"].splitlines())
        line = text.count("\n", 0, match.start()) + 1
        name = str(page.relative_to(ROOT))
        yield Block(name, line, code, marker["reason"] if marker else None)


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [block for page in PAGES for block in _blocks(page)]


# The names the examples use without defining them, as docs/index.md describes them: a model
# whose `blocks` are `Block`s (also called `DecoderLayer`, `MyBlock` in places), one `block`,
# an input `x` and its `mask`, and a function `fn`.
class DocsBlock(models.Block):
    """The tests' residual Dropout block, also taking the `cache` the guide passes to show that
    non-tensor arguments go through."""

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, cache: Any = None
    ) -> torch.Tensor:
        return super().forward(x, mask=mask)


def _names() -> dict[str, Any]:
    torch.manual_seed(0)
    model = models.Net((DocsBlock() for _ in range(4)), models.WIDTH)
    block = DocsBlock()

    def fn(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return block(xla_wrap.checkpoint_name(torch.tanh(x), "attn_out"), mask=mask)

    return {
        "torch": torch,
        "nn": nn,
        "xla_wrap": xla_wrap,
        "Block": DocsBlock,
        "DecoderLayer": DocsBlock,
        "MyBlock": DocsBlock,
        "model": model,
        "block": block,
        "fn": fn,
        "x": torch.randn(models.BATCH, models.WIDTH, requires_grad=True),
        "mask": torch.ones(models.BATCH, models.WIDTH),
    }


def test_the_example_blocks_are_found_and_few_are_not_run() -> None:
    assert len(BLOCKS) >= 30
    not_run = [b for b in BLOCKS if b.not_run is not None]
    assert all(b.not_run for b in not_run), "a `not run:` marker needs its reason"
    # A floor, so that marking blocks is no way around running them.
    assert len(BLOCKS) - len(not_run) >= 15, [b.id for b in not_run]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_python_examples_in_the_docs_run(block: Block) -> None:
    if block.not_run is not None:
        compile(block.code, block.id, "exec")  # shown as Python, so it must at least parse
        pytest.skip(block.not_run)
    exec(compile(block.code, block.id, "exec"), _names())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs tools: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    return out


def _inventory(site: Path) -> set[str]:
    # objects.inv: four header lines, then zlib-compressed "name domain:role priority uri ...".
    raw = (site / "objects.inv").read_bytes().split(b"\n", 4)[4]
    return {line.split()[0] for line in zlib.decompress(raw).decode().splitlines()}


@pytest.mark.subprocess
def test_the_site_builds_strictly_with_every_page_and_the_chart(site: Path) -> None:
    for page in ("", "guide", "scan", "api/xla_wrap", "api/introspect", "changelog"):
        assert (site / page / "index.html").exists(), page
    assert (site / "bench.png").exists()
    assert "xla_wrap.checkpoint_wrapper" in (site / "api/xla_wrap/index.html").read_text()
    assert "0.1.0" in (site / "changelog/index.html").read_text()


@pytest.mark.subprocess
def test_the_api_reference_lists_every_public_name(site: Path) -> None:
    documented = _inventory(site)
    missing = []
    for module_path in PUBLIC_MODULES:
        module = importlib.import_module(module_path)
        for name in module.__all__:
            if f"{module_path}.{name}" not in documented:
                missing.append(f"{module_path}.{name}")
    assert not missing, f"not in the API reference (docs/api/): {missing}"
