# `make demo` and `make test` set up .venv themselves (torch 2.9.0 + torch_xla 2.9.0 + fairscale).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PJRT_DEVICE ?= CPU

.PHONY: venv test demo lint clean

venv: $(STAMP)

# Rebuilt when missing or when pyproject.toml changed; otherwise nothing happens.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[xla,fairscale,bench,hf,trl,lightning,examples,test,dev]'
	touch $(STAMP)

# Two processes, each test file in one of them (its module fixtures share compiled programs).
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile

# Every checkpointing tool side by side on XLA:CPU (about 7 minutes on 2 cores).
demo: venv
	$(PY) -m xla_wrap.bench --out bench-results

lint: venv
	$(PY) -m ruff check xla_wrap tests examples
	$(PY) -m ruff format --check xla_wrap tests examples
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
