# SPDX-License-Identifier: Apache-2.0
# Everyday commands. Each installs what it needs into the active Python environment first
# (scripts/install.sh: CPU torch where there is no CUDA, then the package, editable) and is
# safe to rerun.
#
#   make serve   # serve the embedded default model with NEXTN on 127.0.0.1:30000
#   make test    # the fast tests (the README's test command)
#   make lint    # ruff check + format check
#   make bench   # the benchmarks of docs/benchmarks.md, then render it (scripts/run_benchmarks.sh)

PYTHON ?= python
SERVE_ARGS ?=
BENCH_OUT ?= bench_results
INSTALL := PYTHON=$(PYTHON) bash scripts/install.sh
LINT_PATHS := runtime tests scripts training

.PHONY: help install install-test serve test test-slow lint format bench

help:
	@sed -n 's/^#   make /make /p' $(firstword $(MAKEFILE_LIST))
	@echo "make test-slow  # the slow tests"
	@echo "make format     # ruff format + ruff check --fix"

install:
	@$(INSTALL) serve

install-test:
	@$(INSTALL) test

serve: install
	$(PYTHON) -m runtime.launch_server --speculative-algorithm NEXTN $(SERVE_ARGS)

test: install-test
	$(PYTHON) -m pytest -m "not slow" -q

test-slow: install-test
	$(PYTHON) -m pytest -m slow -q

lint:
	@$(INSTALL) lint
	$(PYTHON) -m ruff check $(LINT_PATHS)
	$(PYTHON) -m ruff format --check $(LINT_PATHS)

format:
	@$(INSTALL) lint
	$(PYTHON) -m ruff format $(LINT_PATHS)
	$(PYTHON) -m ruff check --fix $(LINT_PATHS)

bench: install-test
	PYTHON=$(PYTHON) bash scripts/run_benchmarks.sh $(BENCH_OUT)
