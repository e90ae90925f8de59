# Two entry points (see README): `make demo` and `make test`. Each creates .venv, builds the
# C++/FFI extension and installs the package editable (so it imports from this folder too).
# `make demo` installs the runtime dependencies only; `make test` adds the test extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
# The build's own tools come from PyPI (CMake and Ninja too): a machine needs only Python
# and a C++ compiler.
BUILD_DEPS := scikit-build-core>=0.10 nanobind>=2.4 jax>=0.6 jaxlib>=0.6 cmake>=3.18 ninja>=1.11

.PHONY: install install-test demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip

install: $(BIN)/python
	$(PIP) $(foreach d,$(BUILD_DEPS),"$(d)")
	$(PIP) --no-build-isolation -e .

install-test: $(BIN)/python
	$(PIP) $(foreach d,$(BUILD_DEPS),"$(d)")
	$(PIP) --no-build-isolation -e ".[test]"
	$(BIN)/jax-kvcached download smollm2-135m

demo: install
	$(BIN)/jax-kvcached demo

test: install-test
	$(BIN)/ruff check .
	$(BIN)/pytest

# Every benchmark; each prints its table and writes its JSON under benchmarks/results/
# (committed: the figures in docs/benchmarks.md come from those files).
bench: install-test
	$(PIP) --no-build-isolation -e ".[test,bench]"
	$(BIN)/python benchmarks/bench_vmm.py
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_decode.py --tp 1,2,4
	$(BIN)/python benchmarks/bench_prefix.py
	$(BIN)/python benchmarks/bench_multitenant.py
	$(BIN)/python benchmarks/bench_openai_features.py
	$(BIN)/python benchmarks/bench_structured.py
	$(BIN)/python benchmarks/bench_decode.py --parts launches --out benchmarks/results/bench_decode_launches.json
	$(BIN)/python benchmarks/bench_serving.py
	$(BIN)/python benchmarks/bench_hybrid.py
	$(BIN)/python benchmarks/bench_sleep.py
	# llama.cpp beside it when --llama-python names a Python with llama-cpp-python
	$(BIN)/python benchmarks/bench_quant.py
	$(BIN)/python benchmarks/bench_moe.py
	$(BIN)/python benchmarks/bench_mla.py
	$(BIN)/python benchmarks/bench_recurrent.py
	$(BIN)/python benchmarks/bench_router.py
	$(BIN)/python benchmarks/bench_multihost.py
	$(BIN)/python benchmarks/bench_faults.py  # (mounts small tmpfs folders as root)
	$(BIN)/python benchmarks/bench_gc.py
	$(BIN)/python benchmarks/bench_soak.py  # 30 minutes
	# Served against llama.cpp's server needs guidellm and llama-cpp-python[server] in
	# their own venvs: benchmarks/bench_guidellm.py --guidellm G --llama-python P

clean:
	rm -rf build $(VENV)
