# sharedarrays: the two commands a fresh machine needs are `make demo` and `make test`.
#
# Both create .venv from nothing (python3 -m venv, upgrade pip, pip install -e ...),
# re-installing only when pyproject.toml changes (a stamp file records the last install).
# `make demo` installs only what the demo needs: the base install (NumPy, tqdm, cloudpickle),
# plus CuPy where an NVIDIA GPU is present; `make test` installs every extra it tests.
#
# Variables:
#   PYTHON=python3        the interpreter that creates .venv (or runs everything, see below)
#   PYTHON_ENV=system     skip .venv and use $(PYTHON) as it is (for a machine without a
#                         package registry, e.g. the GPU machine); nothing is installed
#   EXTRAS=cuda13,notebook,test,dev   the extras `make test` installs into .venv
#   DEMO_EXTRAS=cuda13    the extras `make demo` installs: cuda13 where /dev/nvidia0 (or
#                         another /dev/nvidiaN) exists, none elsewhere (cuda12: older drivers)
#   DEMO_ARGS=...         extra arguments for `python -m sharedarrays demo`
#   PYTEST_ARGS=...       extra arguments for pytest
#   PYTEST_WORKERS=2      pytest-xdist worker processes for `make pytest` (each test file runs
#                         whole in one of them: --dist loadfile); 0 runs the suite in pytest's
#                         own process, as plain `pytest` does
#   TORCH_VERSION=2.13.0+cpu   the torch installed before the extras (the test extra's
#                         torch==2.13.0, as its CPU build: never a CUDA download)

PYTHON ?= python3
PYTHON_ENV ?= venv
EXTRAS ?= cuda13,notebook,test,dev
DEMO_EXTRAS ?= $(if $(wildcard /dev/nvidia[0-9]*),cuda13,)
VENV ?= .venv
DEMO_ARGS ?=
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
TORCH_VERSION ?= 2.13.0+cpu

# Only the source folders that exist (an empty folder does not survive a git clone).
LINT_PATHS := $(wildcard sharedarrays tests benchmarks)

ifeq ($(PYTHON_ENV),system)
PY := $(PYTHON)
ENV_DEPS :=
ENV_PATH := $(PATH)
PY_FOR_SCRIPTS := $(PYTHON)
DEMO_DEPS :=
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-installed-stamp
ENV_DEPS := $(STAMP)
DEMO_DEPS := $(DEMO_STAMP)
ENV_PATH := $(abspath $(VENV))/bin:$(PATH)
PY_FOR_SCRIPTS := $(abspath $(VENV))/bin/python
endif

.DEFAULT_GOAL := help
.PHONY: help venv test demo gpu-check lint typecheck docs pytest clean

help:
	@echo "make demo       create .venv with what the demo needs, then python -m sharedarrays demo"
	@echo "make test       create .venv if needed, then ruff, mypy, docs (-W), pytest"
	@echo "make lint       ruff check and ruff format --check"
	@echo "make typecheck  mypy sharedarrays"
	@echo "make docs       Sphinx HTML into docs/_build/html, warnings are errors"
	@echo "make pytest     the test suite only"
	@echo "make gpu-check  bash scripts/gpu_check.sh"
	@echo "make clean      remove .venv, build outputs and caches"
	@echo "PYTHON_ENV=system uses \$$PYTHON ($(PYTHON)) as it is, without .venv"

# ---------------------------------------------------------------------------------------------
# the environment

ifneq ($(PYTHON_ENV),system)
$(VENV)/bin/python:
	@# a half-made venv (no ensurepip, pip upgrade failed) is removed so the next run retries
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(VENV)/bin/python -m pip install --upgrade pip || { rm -rf $(VENV); exit 1; }

$(STAMP): pyproject.toml | $(VENV)/bin/python
	@# torch first, and its CPU build (+cpu: the wheel on this machine's disk, pip's find-links),
	@# so that the extras' torch==2.13.0 is satisfied and no CUDA build is downloaded
	@start=$$(date +%s); \
	$(VENV)/bin/python -m pip install 'torch==$(TORCH_VERSION)' && \
	$(VENV)/bin/python -m pip install -e '.[$(EXTRAS)]' && \
	echo "installed .[$(EXTRAS)] in $$(( $$(date +%s) - start )) s"
	@touch $@

# The demo's install: skipped where `make test`'s (a superset) is up to date.
$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	@if [ $(STAMP) -nt pyproject.toml ]; then \
		echo "the full install in $(VENV) is up to date: the demo needs nothing more"; \
	else \
		start=$$(date +%s); \
		$(VENV)/bin/python -m pip install -e '.$(if $(DEMO_EXTRAS),[$(DEMO_EXTRAS)])' && \
		echo "installed .$(if $(DEMO_EXTRAS),[$(DEMO_EXTRAS)]) in $$(( $$(date +%s) - start )) s"; \
	fi
	@touch $@
endif

venv: $(ENV_DEPS)

# ---------------------------------------------------------------------------------------------
# the two set-up commands

# Every stage runs even when an earlier one fails, so one run shows every problem; the target
# fails if any stage failed. pytest's exit status is kept as it is: 5 (no tests collected)
# is a failure too.
test: $(ENV_DEPS)
	@failed=""; \
	$(MAKE) --no-print-directory lint      || failed="$$failed lint"; \
	$(MAKE) --no-print-directory typecheck || failed="$$failed typecheck"; \
	$(MAKE) --no-print-directory docs      || failed="$$failed docs"; \
	$(MAKE) --no-print-directory pytest    || failed="$$failed pytest"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi; \
	echo "make test: all stages passed"

demo: $(DEMO_DEPS)
	$(PY) -m sharedarrays demo $(DEMO_ARGS)

gpu-check: $(ENV_DEPS)
	@# the script finds the interpreter as $$PYTHON, or as python/python3 on PATH
	PATH="$(ENV_PATH)" PYTHON="$(PY_FOR_SCRIPTS)" bash scripts/gpu_check.sh

# ---------------------------------------------------------------------------------------------
# the stages

lint: $(ENV_DEPS)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

typecheck: $(ENV_DEPS)
	$(PY) -m mypy sharedarrays

docs: $(ENV_DEPS)
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

# Each xdist worker is a pytest process of its own, with its own private XDG_RUNTIME_DIR
# (tests/conftest.py): workers share no keeper, handle server or named array.
pytest: $(ENV_DEPS)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# ---------------------------------------------------------------------------------------------

clean:
	rm -rf $(VENV) build dist *.egg-info docs/_build .pytest_cache .mypy_cache .ruff_cache \
		.hypothesis artifacts
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
