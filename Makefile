# Quick start: `make demo` runs the main job, `make test` runs lint + types + tests.
# Both create .venv and install the pinned dependencies (requirements-dev.txt) themselves.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint typecheck pytest bench clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -q

test: lint typecheck pytest

demo: $(STAMP)
	$(PY) -m cryosnap.demo

bench: $(STAMP)
	$(PY) bench/bench_save_load.py --state all

clean:
	rm -rf $(VENV) demo-run .pytest_cache .mypy_cache .ruff_cache
