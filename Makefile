# Two entry points a new user needs: `make demo` (the main job, locally) and `make test`.
# Both create or reuse .venv and install the pinned dependencies (constraints.txt) first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest workers for `make test` (0: one process). Most of a test training's time is spent waiting
# on its processes: two workers took the suite from 26 to 19 min on a 2-core machine.
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
