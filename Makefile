# attnkit: `make demo` and `make test` set up what they need in .venv, from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow fuzz lint format bench clean

CASES ?= 10000
SEED ?= 0
SURFACE ?= all

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attnkit tour

test: $(STAMP) lint
	$(PY) -m pytest -q

bench: $(STAMP)
	cd benchmarks && ../$(PY) bench.py && ../$(PY) small_calls.py && ../$(PY) block_mask.py && ../$(PY) tile_levers.py && ../$(PY) dropins.py

# the long differential campaign: CASES random cases of SEED on each surface (core
# backends, distributed, paged, transformers, dropins; or SURFACE=one of them) against a
# float64 oracle, a summary table per surface (replay one: tests/fuzz.py --surface X --case I)
fuzz: $(STAMP)
	$(PY) tests/fuzz.py --cases $(CASES) --seed $(SEED) --surface $(SURFACE)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
