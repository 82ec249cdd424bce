# The two quick-start commands: `make demo` trains the tiny model on the standard-library corpus,
# `make test` runs lint and the whole test suite. Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/meshlm train --config configs/tiny.toml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check meshlm tests benchmarks
	$(VENV)/bin/ruff format --check meshlm tests benchmarks

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .cache runs
