# attnkit: `make demo` and `make test` set up what they need in .venv, from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: demo notebooks test test-slow fuzz lint format bench docs docs-check clean native sanitize

CASES ?= 10000
SEED ?= 0
SURFACE ?= all

# what the demo needs: the runtime (PyTorch's CPU build: the package index's torch for
# Linux is a multi-GB CUDA build, so PyTorch's CPU index is asked first where it answers,
# else the package index as pip is configured; pip's progress shows) and attnkit with
# its command
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
		echo "attnkit: $(TORCH), CPU build, from PyTorch's CPU index"; \
		$(PY) -m pip install --progress-bar on $(TORCH) --index-url $(TORCH_CPU_INDEX); \
	else \
		echo "attnkit: PyTorch's CPU index does not answer: $(TORCH) from the package index"; \
		$(PY) -m pip install --progress-bar on $(TORCH); \
	fi
	$(PY) -m pip install --quiet numpy  # else torch warns at import
	$(PY) -m pip install --quiet -e '.[native]'  # ninja: PyTorch's extension builder runs it
	touch $(RUNTIME)

# what the tests, lint, docs and benchmarks need on top
$(STAMP): $(RUNTIME)
	$(PY) -m pip install --quiet -e '.[dev,plot,docs]'
	touch $(STAMP)

# attnkit's C++ kernels built for this CPU, once (cached; without a compiler the composed
# backends serve and `explain` says why)
native: $(RUNTIME)
	-$(PY) -m attnkit.native build

demo: $(RUNTIME) native
	$(VENV)/bin/attnkit tour
	@echo "Next: the notebooks, from the closed loop to flash attention, with interactive"
	@echo "pictures: 'make notebooks' (installs attnkit[notebooks]: JupyterLab, ipywidgets,"
	@echo "matplotlib) opens examples/notebooks in JupyterLab."

# the notebooks in JupyterLab (the `notebooks` extra: JupyterLab, the explorers' widgets)
notebooks: $(RUNTIME) native
	$(PY) -m pip install --quiet -e '.[notebooks]'
	$(VENV)/bin/jupyter lab examples/notebooks

test: $(STAMP) lint native
	$(PY) -m pytest -q

# the native kernels' tests under AddressSanitizer and UndefinedBehaviorSanitizer (the
# kernels built with both; the interpreter preloads their runtimes)
SANITIZERS = $$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)
sanitize: $(STAMP)
	ATTNKIT_NATIVE=sanitize $(PY) -m attnkit.native build
	ATTNKIT_NATIVE=sanitize LD_PRELOAD="$(SANITIZERS)" ASAN_OPTIONS=detect_leaks=0 \
		UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_native_half.py tests/test_native_decode.py tests/test_native_backward.py -k "not suite_passes"

bench: $(STAMP)
	cd benchmarks && ../$(PY) bench.py && ../$(PY) small_calls.py && ../$(PY) block_mask.py && ../$(PY) tile_levers.py && ../$(PY) dropins.py && ../$(PY) native.py

# the long differential campaign: CASES random cases of SEED on each surface (core
# backends, distributed, paged, transformers, dropins; or SURFACE=one of them) against a
# float64 oracle, a summary table per surface (replay one: tests/fuzz.py --surface X --case I)
fuzz: $(STAMP)
	$(PY) tests/fuzz.py --cases $(CASES) --seed $(SEED) --surface $(SURFACE)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# the kernels' C++, in the style .clang-format names
CSRC = src/attnkit/native/csrc/*.cpp src/attnkit/native/csrc/*.h
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples docs/hooks.py docs/notebook_pages.py docs/check_site.py
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/hooks.py docs/notebook_pages.py docs/check_site.py
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run --Werror $(CSRC)

format: $(STAMP)
	$(VENV)/bin/clang-format -i $(CSRC)
	$(VENV)/bin/ruff format src tests benchmarks examples docs/hooks.py docs/notebook_pages.py docs/check_site.py
	$(VENV)/bin/ruff check --fix src tests benchmarks examples docs/hooks.py docs/notebook_pages.py docs/check_site.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site docs/images/generated

# the docs site, with the API reference from the docstrings, into site/ (warnings are errors)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# the built site in a real browser (docs/check_site.py: Debian's Chromium, headless, over
# the DevTools protocol): every page loads without a console error or a failed request,
# links and images resolve, the search finds, no code block scrolls sideways at 1280 px;
# installs chromium from Debian's packages where it is missing (as root, as CI runs)
docs-check: native docs
	command -v chromium >/dev/null || \
		(apt-get update && apt-get install -y --no-install-recommends chromium)
	$(PY) docs/check_site.py site
