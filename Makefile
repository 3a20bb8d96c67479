# `make demo` and `make test` work on a fresh clone: they create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# This machine has a CPU build of torch on disk: pin it here; the package itself asks only torch>=2.6.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick lint typecheck docs bench bytecode tf-venv clean gpu-check

# uv installs the same versions as pip here in about a third of the time (33 s against 97 s or more,
# bytecode compiled as pip does: with PYTHONDONTWRITEBYTECODE=1 nothing would ever compile it later).
# uv reads neither pip's configuration nor its environment: pip's find-links (where this machine's torch
# build lies; without them uv would fetch a CUDA build of several GB) are passed on. If uv cannot be
# installed or fails, pip does the install.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	( $(BIN)/pip install -q --disable-pip-version-check uv && \
	  links=$$(for d in $$PIP_FIND_LINKS $$($(BIN)/pip config get global.find-links 2>/dev/null); do \
	           echo "--find-links $$d"; done | sort -u) && \
	  $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $$links "$(TORCH_PIN)" -e ".[test,docs]" ) || \
	( $(BIN)/pip install -q --disable-pip-version-check "$(TORCH_PIN)" && \
	  $(BIN)/pip install -q --disable-pip-version-check -e ".[test,docs]" "$(TORCH_PIN)" )
	touch $(STAMP)

# An editable install compiles no bytecode (a wheel install does), and a shell with
# PYTHONDONTWRITEBYTECODE=1 never writes it: then every process compiles meshfit's ~120 modules
# again (about 0.1 s of each `import meshfit` here). Compile them once; a no-op when up to date.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q meshfit

demo: bytecode
	$(BIN)/meshfit demo

lint: $(STAMP)
	$(BIN)/ruff check meshfit tests bench examples

# Configured in pyproject.toml ([tool.mypy]): the whole package, the protocols and their users strict.
typecheck: $(STAMP)
	$(BIN)/mypy

# The documentation site (mkdocs.yml) into site/. Strict: a broken link, a reference to a missing
# name or a docstring griffe cannot render is an error. The reference is generated from meshfit.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(BIN)/mkdocs build --strict

# The suite in TEST_WORKERS pytest workers (pytest-xdist): most multi-process tests wait (for a timeout
# to detect, a peer to start) more than they compute, so more workers than cores pays on 2 cores. Tests
# that share a module-scoped fixture starting processes stay in one worker (tests/conftest.py).
# The type check and the strict docs build (45 s one after the other on a fresh clone here) run beside the
# suite at the lowest CPU priority (nice 19): they take the cores mostly while the suite's tests wait on
# processes and timeouts. Their output follows the suite's; a failure of either fails `make test`.
TEST_WORKERS ?= 3
test: lint bytecode
	mkdir -p build
	( nice -n 19 $(MAKE) -k --no-print-directory typecheck docs > build/checks.log 2>&1; echo $$? > build/checks.rc ) & \
	checks=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests; status=$$?; \
	wait $$checks; echo "--- make typecheck docs (beside the suite):"; cat build/checks.log; \
	test $$status -eq 0 && test "$$(cat build/checks.rc)" -eq 0

test-quick: lint bytecode
	$(BIN)/python -m pytest -q -m "not slow" tests

# One table of ratios, every comparison in default processes (bench/README.md). The TF Keras row
# needs .venv-tf: `make tf-venv` once (tensorflow-cpu, big; never a meshfit dependency).
bench: bytecode
	$(BIN)/python bench/bench_all.py

# On a machine with CUDA: the tests marked `gpu` (tests/gpu/), then fit ÷ a hand-written loop on one
# GPU, in one report (README "On a GPU") that also counts the tests; a failed test still lets the bench
# report (then the target exits non-zero). Without CUDA the tests skip, saying why, and the bench says so.
# A GPU image that brings its own CUDA build of torch and no package index: `make gpu-check
# GPU_PYTHON=python3` runs the same check with that interpreter and this checkout on PYTHONPATH.
ifdef GPU_PYTHON
GPU_CHECK_PY := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON)
GPU_CHECK_DEPS :=
else
GPU_CHECK_PY := $(BIN)/python
GPU_CHECK_DEPS := bytecode
endif

gpu-check: $(GPU_CHECK_DEPS)
	mkdir -p build
	$(GPU_CHECK_PY) -m pytest -q -m gpu -rs --junitxml=build/gpu-tests.xml tests/gpu; status=$$?; \
	$(GPU_CHECK_PY) bench/bench_gpu.py --tests-xml build/gpu-tests.xml && exit $$status

tf-venv:
	PY=$(PY) bash bench/tf_venv.sh

clean:
	rm -rf $(VENV) build site *.egg-info
