# The two quick-start commands: `make demo` trains the tiny model on the standard-library corpus,
# `make test` runs lint and the fast tier (a plain `pytest`: the checks marked slow are skipped, and every pair
# of strategies keeps an equivalence run, tests/parallel/test_compositions.py). `make test-full` runs lint and
# every check, slow ones included (`pytest --run-slow`); CI (.ci/run) runs `make test`, then
# `make test-slow` (the slow tier alone, `pytest -m slow`, so nothing runs twice).
# All create the virtual environment on first use. The tests sit in three folders by what they start
# (tests/unit: nothing; tests/parallel: gloo ranks; tests/integration: torchrun, launch, Slurm, signals, exports);
# both speed tiers run all three.
# `make test-portability` reruns the fast tier of the layout-equivalence tests (one run per pair of strategies, and
# every mutation check on them; PARALLEL_TESTS, files of tests/parallel) under other CPU kernels (another
# machine's rounding, tests/equivalence.py):
# CAPABILITY=default|avx2|avx512 (not above what this CPU has), THREADS=1|2. PORTABILITY_ARGS=--run-slow adds their
# slow matrices.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-full test-slow test-portability lint bench clean

CAPABILITY ?= default
THREADS ?= 1
PORTABILITY_ARGS ?=
PARALLEL_TESTS := $(addprefix tests/parallel/,test_tensor_parallel.py test_data_parallel.py test_pipeline.py \
	test_checkpoint_reshard.py test_trainer_distributed.py test_api.py test_context_parallel.py test_loss_contract.py \
	test_tied.py test_expert_parallel.py test_compositions.py)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf,peft,ft]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/meshlm train --config configs/tiny.toml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check meshlm tests benchmarks examples
	$(VENV)/bin/ruff format --check meshlm tests benchmarks examples

test: lint
	$(PY) -m pytest

test-full: lint
	$(PY) -m pytest --run-slow

test-slow: $(VENV)/.installed
	$(PY) -m pytest -m slow

test-portability: $(VENV)/.installed
	ATEN_CPU_CAPABILITY=$(CAPABILITY) MESHLM_TEST_THREADS=$(THREADS) $(PY) -m pytest $(PORTABILITY_ARGS) $(PARALLEL_TESTS)

clean:
	rm -rf $(VENV) .cache runs
