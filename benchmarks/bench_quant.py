"""Packed weights: decode tokens/s against llama.cpp on the same GGUF, weight bytes, how
many models fit one budget, and the level-1 wake, packed vs full precision.

``--parts decode``: SmolLM2-135M's Q4_1 file decoded greedily (128 tokens, ignore EOS)
by our engine with the file's packed weights, by our engine with them dequantized to
fp32 (the old path), and by llama.cpp (llama-cpp-python, ``--llama-python``: the
interpreter that has it, so it stays out of this project's environment) with as many
threads as this process's XLA pool (``--threads``); rounds alternate the three, medians
reported. Batch 8 and 32: our aggregate decode tokens/s, packed vs fp32.
``--parts prefill``: four 256-token prompts prefilled together: packed with the row-count
dispatch (``quant_linear.KERNEL_MAX_ROWS``), packed through the kernel at every row
count, and fp32.
``--parts bytes``: weight bytes of SmolLM2 in fp32, bf16, int8 and int4 (quantized at
load) and as the file packs it, and the ratios to bf16.
``--parts density``: SmolLM2 models that fit awake in one 2 GiB budget with room for a
2048-token sequence each (weights + that sequence's mapped KV pages, both measured).
``--parts wake``: a level-1 sleep / wake of SmolLM2, packed vs fp32 (the copy back is the
weights' bytes).
Prints tables and writes JSON (benchmarks/results/bench_quant.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams

MODEL = "smollm2-135m"
PROMPT = "Write a story about the number {i}."
TOKENS = 128

_LLAMA = r"""
import json, sys, time
import llama_cpp
from llama_cpp import Llama
path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
            verbose=False)
toks = llm.tokenize(sys.argv[4].encode())
def run(k):
    llm.reset()
    llm.eval(toks)
    t0 = time.perf_counter()
    out = []
    for _ in range(k):
        tok = llm.sample(temp=0.0)
        out.append(tok)
        llm.eval([tok])
    return time.perf_counter() - t0, out
run(8)
dt, out = run(n)
print(json.dumps({"decode_tok_s": n / dt, "version": llama_cpp.__version__,
                  "system_info": llama_cpp.llama_print_system_info().decode(),
                  "text": llm.detokenize(out).decode(errors="replace")}))
"""


def _engine(pool: kv.Pool, quantization: str | None, name: str) -> Engine:
    return Engine.from_pretrained(MODEL, pool, quantization=quantization, name=name,
                                  max_batch=32, max_model_len=1024)  # fmt: skip


def _decode_tok_s(eng: Engine, batch: int) -> tuple[float, str]:
    prompts = [PROMPT.format(i=i) for i in range(batch)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    # every request: prefill to first token, then TOKENS - 1 decode steps
    ttft = max(o.ttft_s for o in outs)
    total = max(o.latency_s for o in outs)
    return batch * (TOKENS - 1) / (total - ttft), outs[0].text


def _llama(python: str, path: str, threads: int) -> dict:
    proc = subprocess.run(
        [python, "-c", _LLAMA, path, str(threads), str(TOKENS), PROMPT.format(i=0)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_decode(rounds: int, batches: list[int], python: str | None, threads: int) -> dict:
    from jax_kvcached.models.pretrained import pretrained_path

    path = pretrained_path(MODEL)
    pool = kv.Pool("2GiB", backend="host")
    engines = {"packed": _engine(pool, None, "packed"), "fp32": _engine(pool, "none", "fp32")}
    for eng in engines.values():  # compile every shape these runs meet
        for b in batches:
            _decode_tok_s(eng, b)
    runs: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in engines}
    llama: list[float] = []
    info: dict = {}
    texts = {}
    for r in range(rounds):
        for b in batches:
            for name, eng in engines.items():
                tps, text = _decode_tok_s(eng, b)
                runs[name][b].append(tps)
                texts[name] = text
        if python:
            info = _llama(python, path, threads)
            llama.append(info["decode_tok_s"])
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{k} b{b} {v[b][-1]:.1f}" for k, v in runs.items() for b in batches
        ) + (f", llama.cpp b1 {llama[-1]:.1f}" if llama else ""))  # fmt: skip
    med = {k: {b: statistics.median(v[b]) for b in batches} for k, v in runs.items()}
    out = {
        "model_file": os.path.basename(path), "tokens": TOKENS, "rounds": rounds,
        "threads": threads, "tok_s": med, "runs": runs,
        "packed_over_fp32": {b: med["packed"][b] / med["fp32"][b] for b in batches},
        "texts": texts,
    }  # fmt: skip
    if llama:
        out["llama_cpp"] = {
            "tok_s": statistics.median(llama), "runs": llama, "version": info.get("version"),
            "system_info": info.get("system_info"), "text": info.get("text"),
        }  # fmt: skip
        out["packed_over_llama_cpp_b1"] = med["packed"][1] / out["llama_cpp"]["tok_s"]
    print("\nDecode tokens/s (median of rounds; batch > 1: aggregate)")
    print("batch  packed    fp32  packed/fp32" + ("  llama.cpp  packed/llama.cpp" if llama else ""))
    for b in batches:
        pk, fp = med["packed"][b], med["fp32"][b]
        line = f"{b:5d} {pk:7.1f} {fp:7.1f} {pk / fp:11.2f}"
        if llama and b == 1:
            lc = out["llama_cpp"]["tok_s"]
            line += f"  {lc:9.1f}  {med['packed'][1] / lc:15.2f}"
        print(line)
    for eng in engines.values():
        eng.close()
    pool.close()
    return out


def bench_prefill(rounds: int) -> dict:
    """Four 256-token prompts prefilled together (first token only), tokens/s: the packed
    file with the row-count dispatch (auto), with the kernel for every row count, and
    dequantized to fp32."""
    import numpy as np

    from jax_kvcached.models import quant_linear

    pool = kv.Pool("2GiB", backend="host")
    rng = np.random.default_rng(0)
    out: dict = {}
    default = quant_linear.KERNEL_MAX_ROWS
    for name, q, max_rows in (("packed", None, default), ("packed_kernel_only", None, 1 << 30),
                              ("fp32", "none", default)):  # fmt: skip
        quant_linear.KERNEL_MAX_ROWS = max_rows  # read when the steps are traced
        eng = Engine.from_pretrained(MODEL, pool, quantization=q, name=name, max_batch=8,
                                     max_model_len=1024)  # fmt: skip
        runs = []
        for r in range(rounds + 1):
            ids = [[int(t) for t in rng.integers(100, 40000, 256)] for _ in range(4)]
            t0 = time.perf_counter()
            eng.generate(ids, SamplingParams(max_tokens=1))
            if r:  # the first compiles
                runs.append(1024 / (time.perf_counter() - t0))
        eng.close()
        out[name] = {"tok_s": statistics.median(runs), "runs": runs}
    quant_linear.KERNEL_MAX_ROWS = default
    pool.close()
    print("\nPrefill, 4 x 256 tokens (median tok/s)")
    for name, o in out.items():
        print(f"{name:20s} {o['tok_s']:7.1f}")
    return out


def bench_bytes() -> dict:
    import jax.numpy as jnp

    from jax_kvcached.models import load_pretrained
    from jax_kvcached.models.loader import repack
    from jax_kvcached.models.quant_linear import packed_bytes

    def nbytes(model) -> int:
        import jax
        from flax import nnx

        return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))

    full = load_pretrained(MODEL, dtype=jnp.float32, quantization="none")
    packed = load_pretrained(MODEL, dtype=jnp.float32).model
    out = {
        "float32": nbytes(full.model),
        "bfloat16": nbytes(load_pretrained(MODEL, dtype=jnp.bfloat16, quantization="none").model),
        "int8": nbytes(repack(full.model, full.config, "int8")),
        "int4": nbytes(repack(full.model, full.config, "int4")),
        "file_packed": nbytes(packed),
    }
    out["file_packed_share"] = packed_bytes(packed) / out["file_packed"]
    ratios = {k: out[k] / out["bfloat16"] for k in ("float32", "int8", "int4", "file_packed")}
    print("\nWeight bytes (SmolLM2-135M)")
    for k in ("float32", "bfloat16", "int8", "int4", "file_packed"):
        r = out[k] / out["bfloat16"]
        print(f"{k:12s} {out[k] / 2**20:8.1f} MiB  {r:5.2f}x bf16")
    return {"bytes": out, "over_bf16": ratios}


def bench_density(budget: int = 2 << 30, seq: int = 2048) -> dict:
    """Per format: the weights' device bytes and the KV pages one ``seq``-token sequence
    maps (its blocks stay cached after it ends: ``mapped_bytes``), both measured."""
    import jax.numpy as jnp

    out = {}
    for name, q, dtype in (("float32", "none", "float32"), ("bfloat16", "none", "bfloat16"),
                           ("int8", "int8", "float32"), ("int4", "int4", "float32"),
                           ("file_packed", None, "float32")):  # fmt: skip
        with kv.Pool("1GiB", backend="host") as pool:
            eng = Engine.from_pretrained(MODEL, pool, quantization=q, dtype=jnp.dtype(dtype),
                                         name=name, max_model_len=seq + 16)  # fmt: skip
            eng.generate([[1 + i % 100 for i in range(seq - 1)]], SamplingParams(max_tokens=1))
            st = eng.stats()
            out[name] = {"weight_bytes": st["weight_bytes"], "kv_bytes": st["mapped_bytes"]}
            eng.close()
        item = out[name]
        item["models_in_2GiB"] = budget // (item["weight_bytes"] + item["kv_bytes"])
    print(f"\nSmolLM2 models awake in one 2 GiB budget, a {seq}-token sequence each")
    for name, item in out.items():
        w, k = item["weight_bytes"] / 2**20, item["kv_bytes"] / 2**20
        print(f"{name:12s} weights {w:7.1f} MiB  KV {k:5.1f} MiB  -> "
              f"{item['models_in_2GiB']} models")  # fmt: skip
    return out


def bench_wake(rounds: int) -> dict:
    pool = kv.Pool("1GiB", backend="host")
    out = {}
    for name, q in (("packed", None), ("fp32", "none")):
        eng = _engine(pool, q, name)
        eng.generate(["hi"], SamplingParams(max_tokens=2))
        times = []
        for _ in range(rounds):
            eng.sleep(1)
            t0 = time.perf_counter()
            eng.wake()
            times.append(time.perf_counter() - t0)
        out[name] = {"wake_s": statistics.median(times), "runs": times,
                     "weight_bytes": eng.stats()["weight_bytes"]}  # fmt: skip
        eng.close()
    pool.close()
    out["fp32_over_packed"] = out["fp32"]["wake_s"] / out["packed"]["wake_s"]
    print("\nLevel-1 wake (median)")
    for name in ("packed", "fp32"):
        o = out[name]
        print(f"{name:7s} {o['wake_s'] * 1e3:7.1f} ms  {o['weight_bytes'] / 2**20:6.1f} MiB")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="decode,prefill,bytes,density,wake")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--llama-python", default=None,
                   help="a Python with llama-cpp-python (default: this one if it has it; "
                        "'none': skip llama.cpp)")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count())
    here = os.path.dirname(__file__)
    p.add_argument("--out", default=os.path.join(here, "results", "bench_quant.json"))
    args = p.parse_args()
    python = args.llama_python
    if python is None:
        has = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
        python = sys.executable if has.returncode == 0 else None
        if python is None:
            print("llama-cpp-python is not installed here: --llama-python PATH names one")
    elif python == "none":
        python = None
    parts = set(args.parts.split(","))
    result: dict = {"model": MODEL}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result.update(json.load(f))  # parts not run this time keep their figures
    if "decode" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        result["decode"] = bench_decode(args.rounds, batches, python, args.threads)
    if "prefill" in parts:
        result["prefill"] = bench_prefill(args.rounds)
    if "bytes" in parts:
        result["bytes"] = bench_bytes()
    if "density" in parts:
        result["density"] = bench_density()
    if "wake" in parts:
        result["wake"] = bench_wake(max(args.rounds, 3))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
