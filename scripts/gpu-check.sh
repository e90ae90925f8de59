#!/usr/bin/env bash
# The prepared GPU run (H200 device machine: JAX + CUDA preinstalled, no internet), in
# three parts of under 9 minutes each (run each with timeout_s 590, in this order on one
# warm machine: the install is done once), most important first:
#
#   scripts/gpu-check.sh core   builds with the preinstalled toolchain; the GPU tests
#       (CUDA backend, FFI ops, the engine with the Pallas kernel and the XLA path against
#       the CPU run, steps replayed as CUDA graphs vs ordinary launches, tensor
#       parallelism, the host tier's page-locked copies, two processes of one group, n
#       forks + penalties + logprobs, KV cache groups, forks of a hybrid model: a block
#       copy per group, packed int8 / int4 weights: no dequantized weight in the optimized
#       HLO, mixtures of experts: ragged_dot computes each expert's rows only and the tiny
#       MoE preset gives the CPU's tokens, latent attention and sinks, recurrent state:
#       the Qwen3-Next and Granite 4.0-H presets give the CPU's tokens and restore a
#       state checkpoint, structured outputs: the grammar's token mask behind the step
#       gives the CPU's texts, LoRA: ragged_dot's deltas match each token's adapter and
#       an adapter gives the CPU's tokens); the engine's decode step per step
#       (programs, launches, host time) with command buffers on and off; paged vs dense
#       decode at batch 1/8/32 for the bench model.
#   scripts/gpu-check.sh smollm2   the same two for SmolLM2-135M's architecture in bf16
#       (random weights: a run cannot carry the checkpoint, and the step costs the same),
#       then its decode step with int8 and int4 packed weights at batch 1 and 32.
#   scripts/gpu-check.sh more   sleep / wake of six models (SmolLM2's architecture the
#       big one: device bytes, JAX's memory_stats, the level-1 wake against the
#       host-to-device bandwidth); Gemma 3 270M's architecture paged vs dense; the ragged
#       mixed step served (stall case, two rates); the hybrid sliding-window freeing;
#       a mixture of experts' decode step vs a dense one and ragged_dot's time.
#   (The attention kernels, VMM, K/V write and OpenAI-feature benchmarks ran on the H200
#   on 2026-12-04: docs/gpu.md; their scripts take --backend cuda / run as before.)
#
# Structured outputs need llguidance (and LoRA's test safetensors), which the device has
# no index for: put their wheels in .wheels/ (`pip download llguidance safetensors
# --no-deps -d .wheels`, 4 MB, ignored by git) and carry it (run's carry [".wheels"]);
# the script installs them first.
# The bf16-vs-fp32 greedy test needs SmolLM2's GGUF (98 MB, over what a run carries) under
# .models/ in the checkout (`KVCACHED_MODEL_CACHE=.models jax-kvcached download`); without
# it that one test fails saying the file is missing. Logs go to $OUT (default
# /tmp/gpu-check), the JSON results into $OUT/json-PART.tgz.
set -uo pipefail
PART=${1:-core}
OUT=${OUT:-/tmp/gpu-check}
J=/tmp/gpu-check-json-$PART
mkdir -p "$OUT" "$J"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d "$PWD/.models" ] && export KVCACHED_MODEL_CACHE="$PWD/.models"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
if [ -d "$PWD/.wheels" ]; then
  python3 -m pip install -q --no-index --find-links "$PWD/.wheels" llguidance safetensors \
    2>&1 | tail -2
fi
# Build and install once per source tree (a warm machine keeps the install between parts).
SRC=$(find ffi jax_kvcached models CMakeLists.txt pyproject.toml -type f | sort | xargs sha1sum \
  | sha1sum | cut -c1-16)
if [ "$(cat /tmp/kvcached-installed 2>/dev/null)" != "$SRC" ]; then
  python3 -m pip install -q --no-build-isolation --no-deps --no-index . 2>&1 | tail -5 \
    && echo "$SRC" > /tmp/kvcached-installed
fi
B="$PWD/benchmarks"
T="$PWD/tests"
cd /tmp  # import the installed package, not the checkout
run() {  # run SECONDS NAME COMMAND...: one step, its log in $OUT/NAME.log
  local limit=$1 name=$2
  shift 2
  echo "== $name" | tee -a "$OUT/summary.log"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -25 | tee -a "$OUT/summary.log"
}
if [ "$PART" = core ]; then
  run 200 pytest-gpu python3 -m pytest -q -rs "$T/gpu" "$T/test_build.py"
  # Per engine decode step: programs, launches op by op, host time; graphs on vs off.
  run 60 launches-bench python3 "$B/bench_decode.py" --parts launches --backend cuda \
    --batches 1,32 --rounds 3 --out "$J/launches_bench.json"
  run 60 decode-bench python3 "$B/bench_decode.py" --parts decode --no-prefill \
    --backend cuda --batches 1,8,32 --ctx 1024 --iters 5 --rounds 2 --out "$J/decode_bench.json"
elif [ "$PART" = smollm2 ]; then
  run 200 smollm2 python3 "$B/bench_decode.py" --model arch:smollm2-135m --dtype bfloat16 \
    --parts decode --no-prefill --backend cuda --batches 1,8,32 --ctx 1024 --iters 5 \
    --rounds 2 --out "$J/decode_smollm2.json"
  run 150 smollm2-launches python3 "$B/bench_decode.py" --model arch:smollm2-135m \
    --dtype bfloat16 --parts launches --backend cuda --batches 1,32 --rounds 2 \
    --out "$J/launches_smollm2.json"
  for q in int8 int4; do  # packed weights (XLA's fused dequantization) vs the bf16 above
    run 100 "smollm2-$q" python3 "$B/bench_decode.py" --model arch:smollm2-135m \
      --dtype bfloat16 --quantization $q --parts decode --no-prefill --backend cuda \
      --batches 1,32 --ctx 1024 --iters 5 --rounds 2 --out "$J/decode_smollm2_$q.json"
  done
else
  # Six models sharing the device, two awake: wake time against the H2D bound, device
  # bytes and JAX's memory_stats asleep / awake (each engine compiles all it can run).
  run 200 sleep python3 "$B/bench_sleep.py" --big arch:smollm2-135m --dtype bfloat16 \
    --out "$J/sleep.json"
  run 90 moe python3 "$B/bench_moe.py" --backend cuda --batches 1,32 --rounds 2 \
    --out "$J/moe.json"
  run 70 gemma3 python3 "$B/bench_decode.py" --model arch:gemma3-270m --dtype bfloat16 \
    --parts decode --no-prefill --backend cuda --batches 1,8,32 --ctx 1024 --iters 5 \
    --rounds 2 --out "$J/decode_gemma3.json"
  run 120 serving python3 "$B/bench_serving.py" --model m=tiny-llama --parts stall,rates \
    --stall-prompts 200,900 --stall-tokens 100 --rates 4,16 --num-prompts 24 --max-id 300 \
    --max-prompt-len 600 --out "$J/serving.json"
  run 60 hybrid python3 "$B/bench_hybrid.py" --quick --models tiny-mistral --out "$J"
  run 120 recurrent python3 "$B/bench_recurrent.py" --contexts 1024,8192 --rounds 2 \
    --out "$J/recurrent.json"
fi
tar czf "$OUT/json-$PART.tgz" -C "$J" .
