# Set-up and the two jobs. `make demo`: set up + run the main job; `make test`: set up + run the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test

$(BIN)/stree: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the machine's CPU build so pip never pulls a multi-GB CUDA build here
	$(BIN)/pip install -q torch==2.13.0 -e '.[test]'
	touch $(BIN)/stree

setup: $(BIN)/stree

demo: setup
	$(BIN)/stree demo

test: setup
	$(BIN)/python -m pytest
