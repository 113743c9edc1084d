# Two entry points a new user needs: `make demo` (the main job, locally) and `make test`.
# Both create or reuse .venv and install the pinned dependencies (constraints.txt) first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest workers for `make test` (pytest-xdist; 0: one process). Two took the suite from 26 to 19-22 min on a
# 2-core machine at 1100 tests (22-27 min at 1253; 12-13 min at 1253-1295 on a faster 2-core machine);
# tests marked `alone` (they need a checkpoint writer up by a given step) run while no other test does
# (tests/support/alone.py; docs/benchmarks.md#suite).
TEST_WORKERS ?= 2

.PHONY: demo test lint clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/resilient-training run

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf $(VENV) local_outputs runs
