#!/usr/bin/env bash
# One prepared GPU run (H200 device machine: JAX + CUDA preinstalled, no internet), sized
# to finish in under 10 minutes, most important first: builds with the preinstalled
# toolchain; runs the GPU tests (CUDA backend, engine on CUDA, the Pallas paged-attention
# kernel compiled for the GPU, the tensor-parallel path over the GPUs present, the host
# tier's page-locked asynchronous copies, two processes of one process group each mapping
# its own cuMemCreate pages, n forks + penalties + logprobs on CUDA against the CPU run);
# the decode step paged (CUDA pages, Pallas kernel) vs a dense donated cache; the
# attention benchmark (Pallas vs XLA vs jax's decode kernel vs dense); the cost of
# logprobs / penalties and of n samples forked vs independent; the VMM benchmark (with the
# host tier's copy bandwidth); the step's K/V write with and without the host sync; the
# serving benchmark (ragged steps: the stall case and two request rates); the hybrid
# benchmark (KV cache groups: sliding-window blocks given back; tiny-mistral on CUDA).
# The bf16-vs-fp32 greedy check needs SmolLM2's GGUF (98 MB, over what a run carries):
# put it under .models/ in the checkout (`KVCACHED_MODEL_CACHE=.models jax-kvcached download`)
# where the carry limit allows, else that one test fails saying the file is missing.
# Logs go to $OUT (default /tmp/gpu-check), the JSON results into $OUT/json.tgz at the end
# (the device tool brings back at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
J=/tmp/gpu-check-json
mkdir -p "$OUT" "$J"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d "$PWD/.models" ] && export KVCACHED_MODEL_CACHE="$PWD/.models"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps --no-index . 2>&1 | tail -5
B="$PWD/benchmarks"
cd /tmp  # import the installed package, not the checkout
timeout 200 python3 -m pytest -q -rs "$OLDPWD/tests/gpu" "$OLDPWD/tests/test_build.py" 2>&1 \
  | tee "$OUT/pytest-gpu.log"
timeout 110 python3 "$B/bench_decode.py" --parts decode --backend cuda --batches 1,8,32 \
  --ctx 1024,4096 --iters 5 --rounds 2 --out "$J/bench_decode_gpu.json" 2>&1 \
  | tee "$OUT/bench_decode_gpu.log"
timeout 90 python3 "$B/bench_attention.py" --ctx 1024,4096 --iters 5 --rounds 2 \
  --out "$J/bench_attention_gpu.json" 2>&1 | tee "$OUT/bench_attention_gpu.log"
timeout 80 python3 "$B/bench_openai_features.py" --rounds 2 --tokens 32 \
  --out "$J/bench_openai_features_gpu.json" 2>&1 | tee "$OUT/bench_features_gpu.log"
timeout 45 python3 "$B/bench_vmm.py" --out "$J/bench_vmm_gpu.json" 2>&1 \
  | tee "$OUT/bench_vmm_gpu.log"
# The step's K/V write with the old host round trip (write_kv) vs without (write_kv_async).
timeout 30 python3 "$B/bench_decode.py" --parts write --backend cuda \
  --out "$J/bench_write_gpu.json" 2>&1 | tee "$OUT/bench_write_gpu.log"
# The ragged step served on the GPU (tiny-llama: no checkpoint to carry): the stall case
# and two Poisson rates through the OpenAI route.
timeout 120 python3 "$B/bench_serving.py" --model m=tiny-llama --parts stall,rates \
  --stall-prompts 200,900 --stall-tokens 100 --rates 4,16 --num-prompts 24 --max-id 300 --max-prompt-len 600 \
  --out "$J/bench_serving_gpu.json" 2>&1 | tee "$OUT/bench_serving_gpu.log"
timeout 60 python3 "$B/bench_hybrid.py" --quick --models tiny-mistral --out "$J" 2>&1 \
  | tee "$OUT/bench_hybrid_gpu.log"
# Sleep and wake of six tiny models on the GPU (two awake): wake time, device bytes.
timeout 90 python3 "$B/bench_sleep.py" --quick --out "$J/bench_sleep_gpu.json" 2>&1 \
  | tee "$OUT/bench_sleep_gpu.log"
tar czf "$OUT/json.tgz" -C "$J" .
