# Quick start: `make demo` runs the main job, `make test` runs lint + types + tests, and
# `make test-deep` the full-length campaigns that `make test` runs a slice of.
# Both create .venv themselves. `make demo` installs the runtime and the demo's needs
# (requirements.txt); `make test` adds the development stack (requirements-dev.txt) on top, so
# either order installs each package once. constraints.txt pins every transitive version.
# TORCH_INDEX=URL installs torch from that index first (its CPU or CUDA build; README).

PYTHON      ?= python3
TORCH_INDEX ?=
VENV        := .venv
PY          := $(VENV)/bin/python
CREATED     := $(VENV)/.created
RUNTIME     := $(VENV)/.runtime-installed
DEV         := $(VENV)/.dev-installed

# The suite runs on PYTEST_WORKERS processes (pytest-xdist) in a random order (pytest-randomly,
# its seed printed last); CONTRIBUTING.md says how to rerun one order, or file order.
# `make test` leaves out the tests marked deep (full-length campaigns); `make test-deep` runs
# them (CI runs both). PYTEST_ARGS adds options to both.
# 6 workers on 2 cores: the tests wait on child processes, the disk and fsync often; since
# their children are forked from a warm server (tests/forkserver.py) the suite needs less CPU
# and waits more: 6 workers took 319 s where 4 took 384 s (CONTRIBUTING.md).
PYTEST_WORKERS ?= 6
PYTEST_ARGS    ?=
PYTEST      := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup
# Compiled modules are cached in __pycache__ (ignored by git) even where the environment says
# not to write them: each xdist worker and each child process of the tests would otherwise
# compile src/ and tests/ again (about 3 s of CPU per worker).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: test test-deep demo lint typecheck pytest bench clean

$(CREATED):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $(CREATED)

# --no-compile: pip would byte-compile every module of every package (torch, transformers,
# sympy...: tens of thousands); the ones a run imports are compiled then, once, into
# __pycache__ (see PYTHONDONTWRITEBYTECODE below). One pip call per step: each call resolves
# the whole set again.
PIP := $(PY) -m pip install --quiet --no-compile

$(RUNTIME): $(CREATED) requirements.txt constraints.txt pyproject.toml
ifneq ($(TORCH_INDEX),)
	$(PIP) --no-deps -c constraints.txt torch --index-url $(TORCH_INDEX)
endif
	$(PIP) -r requirements.txt -e .
	touch $(RUNTIME)

# requirements-nodeps.txt: packages installed without their declared dependencies (torchtitan's
# would downgrade fsspec); the file says why.
$(DEV): $(RUNTIME) requirements-dev.txt requirements-nodeps.txt
	$(PIP) -r requirements-dev.txt
	$(PIP) --no-deps -r requirements-nodeps.txt
	touch $(DEV)

# tools/guards.py: no function over 100 lines or class over 400 (its ALLOWED list says why
# for each exception), and every repository path the docs and docstrings name exists.
lint: $(DEV)
	$(PY) -m ruff check src tests bench examples tools
	$(PY) -m ruff format --check src tests bench examples tools
	$(VENV)/bin/lint-imports
	$(PY) tools/guards.py

# mypy's parallel mode (experimental in mypy 2; the same checks): about 1.5x faster cold on 2 cores.
MYPY_WORKERS ?= 2

typecheck: $(DEV)
	$(PY) -m mypy --num-workers $(MYPY_WORKERS)

pytest: $(DEV)
	$(PYTEST) -m "not deep" $(PYTEST_ARGS)

test-deep: $(DEV)
	$(PYTEST) -m deep $(PYTEST_ARGS)

# make test: lint first (seconds: its failures show at once), then mypy in the background
# beside pytest, whose workers leave a core idle part of the time (they wait on children
# and fsync); mypy's output is printed whole when pytest ends (its log in .venv), and make
# test fails when either failed. CONTRIBUTING.md has the times, serial and overlapped.
TYPECHECK_LOG := $(VENV)/typecheck.log

test: lint
	@echo "$(PY) -m mypy --num-workers $(MYPY_WORKERS): in the background, beside pytest"
	@$(MAKE) --no-print-directory typecheck > $(TYPECHECK_LOG) 2>&1 & typecheck=$$!; \
	$(MAKE) --no-print-directory pytest; pytest=$$?; \
	wait $$typecheck; typecheck=$$?; \
	echo "mypy (make typecheck) said:"; cat $(TYPECHECK_LOG); \
	if [ $$typecheck -ne 0 ]; then echo "make test: typecheck failed"; fi; \
	if [ $$pytest -ne 0 ]; then echo "make test: pytest failed"; fi; \
	[ $$typecheck -eq 0 ] && [ $$pytest -eq 0 ]

demo: $(RUNTIME)
	$(PY) -m cryosnap.demo

bench: $(RUNTIME)
	$(PY) -m cryosnap bench --workload dense
	$(PY) -m cryosnap bench --workload many-small

# demo-run goes only if the demo made it (its marker file): clean deletes no directory of yours.
clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
	if [ -f demo-run/.cryosnap-demo ]; then rm -rf demo-run; fi
