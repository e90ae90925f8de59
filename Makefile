# Two entry points (see README): `make demo` and `make test`. Each creates .venv with the
# project's own dependencies, builds the C++/FFI extension and runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUILD_DEPS := scikit-build-core>=0.10 nanobind>=2.4 jax>=0.6 jaxlib>=0.6

.PHONY: install demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q $(foreach d,$(BUILD_DEPS),"$(d)")
	$(BIN)/python -m pip install -q --no-build-isolation ".[test]"

demo: install
	$(BIN)/jax-kvcached demo

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest

bench: install
	$(BIN)/python -m pip install -q --no-build-isolation ".[test,bench]"
	$(BIN)/python benchmarks/bench_vmm.py
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_decode.py --tp 1,2,4
	$(BIN)/python benchmarks/bench_prefix.py
	$(BIN)/python benchmarks/bench_multitenant.py
	$(BIN)/python benchmarks/bench_openai_features.py

clean:
	rm -rf build $(VENV)
