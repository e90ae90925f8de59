#!/usr/bin/env bash
# One prepared GPU run (H200 device machine: JAX + CUDA preinstalled, no internet), sized
# to finish in under 8 minutes: builds with the preinstalled toolchain, runs the GPU
# tests (CUDA backend, engine on CUDA, the Pallas paged-attention kernel compiled for the
# GPU, the tensor-parallel path over the GPUs present, the host tier's page-locked
# asynchronous copies and an engine restoring from it, two processes of one process group
# each mapping its own cuMemCreate pages under the shared ledger), the attention benchmark (Pallas vs
# XLA vs jax's decode kernel vs dense), the VMM benchmark (with the host tier's copy
# bandwidth) and the step's K/V write with and without the host sync; copies logs and
# JSON to $OUT when it is set.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps --no-index . 2>&1 | tail -5
cd /tmp  # import the installed package, not the checkout
timeout 240 python3 -m pytest -q -rs "$OLDPWD/tests/gpu" "$OLDPWD/tests/test_build.py" 2>&1 \
  | tee "$OUT/pytest-gpu.log"
timeout 150 python3 "$OLDPWD/benchmarks/bench_attention.py" --iters 5 --rounds 2 \
  --out "$OUT/bench_attention_gpu.json" 2>&1 | tee "$OUT/bench_attention_gpu.log"
timeout 60 python3 "$OLDPWD/benchmarks/bench_vmm.py" --out "$OUT/bench_vmm_gpu.json" 2>&1 \
  | tee "$OUT/bench_vmm_gpu.log"
# The step's K/V write with the old host round trip (write_kv) vs without (write_kv_async).
timeout 60 python3 "$OLDPWD/benchmarks/bench_decode.py" --parts write --backend cuda \
  --out "$OUT/bench_write_gpu.json" 2>&1 | tee "$OUT/bench_write_gpu.log"
