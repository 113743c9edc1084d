# Two entry points a new user needs: `make demo` (the main job, locally) and `make test`.
# Both create or reuse .venv and install the pinned dependencies (constraints.txt) first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

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
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) local_outputs runs
