# `make demo` and `make test` set up .venv themselves (torch 2.9.0 + torch_xla 2.9.0 + fairscale);
# `make test` also sets up .venv-latest (the newest torch the index serves, no torch_xla).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LATEST := .venv-latest
LATEST_PY := $(LATEST)/bin/python
LATEST_STAMP := $(LATEST)/.installed
export PJRT_DEVICE ?= CPU
# Material for MkDocs prints an end-of-life notice (May 2027) on every build; CHANGELOG.md says
# where the site goes next.
export NO_MKDOCS_2_WARNING := 1

.PHONY: venv venv-latest test demo docs docs-serve dist lint clean

venv: $(STAMP)
venv-latest: $(LATEST_STAMP)

# Rebuilt when missing or when pyproject.toml changed; otherwise nothing happens.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[xla,fairscale,bench,hf,trl,lightning,examples,test,dev,docs,release]'
	touch $(STAMP)

# torch_xla has no build for the newest torch: this one runs what needs no torch_xla (eager
# and torch.compile), the rest skipping.
$(LATEST_STAMP): pyproject.toml
	test -x $(LATEST_PY) || $(PYTHON) -m venv $(LATEST)
	$(LATEST_PY) -m pip install --quiet --upgrade pip
	$(LATEST_PY) -m pip install --quiet --upgrade torch -e '.[hf,test]'
	touch $(LATEST_STAMP)

# Two processes, each test file in one of them (its module fixtures share compiled programs);
# then again on the newest torch.
test: venv venv-latest
	$(PY) -m pytest -q -n 2 --dist loadfile
	$(LATEST_PY) -c "import torch; print('newest torch:', torch.__version__)"
	$(LATEST_PY) -m pytest -q -n 2 --dist loadfile

# Every checkpointing tool side by side on XLA:CPU (about 7 minutes on 2 cores).
demo: venv
	$(PY) -m xla_wrap.bench --out bench-results

# The documentation site (mkdocs.yml, strict: a broken link or reference fails it) into site/.
docs: venv
	$(PY) -m mkdocs build --site-dir site

docs-serve: venv
	$(PY) -m mkdocs serve

# The sdist and wheel into dist/, checked as PyPI would.
dist: venv
	rm -rf dist
	$(PY) -m build --outdir dist
	$(PY) -m twine check --strict dist/*

lint: venv
	$(PY) -m ruff check xla_wrap tests examples
	$(PY) -m ruff format --check xla_wrap tests examples
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(LATEST) site dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
