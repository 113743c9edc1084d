# Two entry points a new user needs: `make demo` (the main job, locally) and `make test`.
# Both create or reuse .venv and install the pinned dependencies (constraints.txt) first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest workers for `make test` (0: one process, the default). Two took the suite from 26 to 18-20 min
# on a 2-core machine, but halve the timing margins of tests that need a checkpoint writer up by a
# given step: two of them failed in two runs of four (docs/benchmarks.md#suite).
TEST_WORKERS ?= 0

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
