"""The package as it would be published: the sdist and wheel build without a deprecation warning
of ours, pass `twine check`, and the wheel installs and works in a clean environment that has
only torch."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest

import xla_wrap

from _workers import ROOT

pytest.importorskip("build", reason="the release tools: pip install -e '.[release]'")
pytest.importorskip("twine", reason="the release tools: pip install -e '.[release]'")

# The torch the clean environment gets. Any torch>=2.4 does; this one is the CPU wheel this
# kind of machine keeps on disk (pip's find-links), so the install takes seconds, not gigabytes.
CLEAN_TORCH = os.environ.get("XLA_WRAP_TEST_TORCH", "torch==2.13.0")

_SMOKE = """
import warnings
import torch
warnings.simplefilter("error")  # a warning on importing or using xla_wrap fails the check
import xla_wrap
block = xla_wrap.checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout()))
x = torch.randn(2, 4, requires_grad=True)
block(x).sum().backward()
assert x.grad is not None and block[0].weight.grad is not None
import importlib.metadata as md
print(xla_wrap.__version__, md.version("xla_wrap"), md.metadata("xla_wrap")["License-Expression"])
"""


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])
    build_log = build.stdout + build.stderr
    # setuptools warned on every build while the license was a table; nothing of ours may warn.
    for line in build_log.splitlines():
        assert "DeprecationWarning" not in line and "deprecated" not in line.lower(), line
    return out


@pytest.mark.subprocess
def test_the_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    built = sorted(p.name for p in dist.iterdir())
    version = xla_wrap.__version__
    assert built == [f"xla_wrap-{version}-py3-none-any.whl", f"xla_wrap-{version}.tar.gz"]
    done = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())])
    assert done.stdout.count("PASSED") == 2, done.stdout


@pytest.mark.subprocess
def test_the_wheel_carries_the_license_the_types_and_no_tests(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "xla_wrap/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "examples/"))]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA")))
    lines = metadata.decode().splitlines()
    assert "License-Expression: BSD-3-Clause" in lines
    # torch is the one thing an install without extras brings.
    required = [
        line for line in lines if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert required == ["Requires-Dist: torch>=2.4"], required


@pytest.mark.subprocess
def test_the_wheel_installs_and_works_where_only_torch_is(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    env_dir = tmp_path / "clean"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", str(wheel), CLEAN_TORCH])
    _run([python, "-m", "pip", "check"])  # every requirement met by what came
    # Run away from the checkout, so that the installed package is the one imported.
    done = _run([python, "-c", _SMOKE], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert done.stdout.split() == [xla_wrap.__version__, xla_wrap.__version__, "BSD-3-Clause"]
    assert "xla_wrap" not in done.stderr, done.stderr  # torch may warn (no NumPy here); we may not


def test_the_long_description_renders_as_the_index_renders_it_with_every_link_absolute(
    dist: Path,
) -> None:
    """The package index shows the README from the wheel's metadata, rendered as GitHub
    Markdown, where a relative link resolves to nothing. Every link must be absolute; those into
    the documentation site start with the project's Documentation URL (pyproject.toml, the one
    place it is set) and name a page that exists, and those into the repository a file in it."""
    import email
    import re

    markdown = pytest.importorskip("readme_renderer.markdown")
    wheel = next(dist.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(archive.read(name).decode())
    assert metadata["Description-Content-Type"].startswith("text/markdown")
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    html = markdown.render(metadata.get_payload(), variant="GFM")
    assert html is not None, "no Markdown renderer: pip install -e '.[release]'"
    # In-page anchors (the renderer's own, on every heading) resolve on any page.
    links = [link for link in re.findall(r'(?:href|src)="([^"]+)"', html) if link[0] != "#"]
    assert len(links) > 10  # the probe sees the README's links
    site, source = urls["Documentation"], urls["Source"]
    for link in links:
        assert re.match(r"https?://", link), f"a relative link on the index page: {link}"
        page = link.split("#")[0]
        if page.startswith(site):
            doc = page[len(site) :].strip("/") or "index"
            assert (ROOT / "docs" / f"{doc}.md").exists(), f"no docs page for {link}"
        elif page.startswith(f"{source}/blob/main/"):
            assert (ROOT / page[len(f"{source}/blob/main/") :]).exists(), link
