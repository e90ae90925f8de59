"""What the OpenAI sampling features cost in the engine, side by side in one run.

``--parts steps``: decode throughput of one batch (``--batch`` requests decoding
``--tokens`` tokens each) plain greedy, seeded temperature sampling, with logprobs
(5 alternatives), with logit processing (presence / frequency / repetition penalties and
a logit bias), and with both; interleaved rounds, medians. ``--parts n``: ``n`` samples
of one long prompt, forked (one prefill, blocks shared, copy-on-write of the partial
block) against ``n`` independent requests (prefix caching off: each computes the prompt;
on: the later ones reuse its full blocks once cached): wall time, TTFT of the last
sample and peak KV blocks. Prints tables and writes JSON
(benchmarks/results/bench_openai_features.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np
from bench_common import load_model

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams


def _backend() -> str:
    """The platform's own backend: CUDA pages on a GPU, host pages on the CPU."""
    from jax_kvcached.memory import _C

    return "cuda" if jax.default_backend() == "gpu" and _C.cuda_compiled() else "host"


def _engine(model, max_batch: int, caching: bool = True) -> tuple[Engine, kv.Pool]:
    pool = kv.Pool("1GiB", backend=_backend(), min_reserved_pages=0, max_reserved_pages=0)
    eng = Engine(model, pool, max_batch=max_batch, max_num_batched_tokens=256,
                 prefix_caching=caching,
                 max_model_len=2048)  # (fewer shapes to warm up than the model's 8192)  # fmt: skip
    eng.compile()
    return eng, pool


STEP_VARIANTS = {
    "plain greedy": {},
    "temperature 0.8": dict(temperature=0.8),
    "logprobs 5": dict(temperature=0.8, logprobs=5),
    "penalties + bias": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.1, logit_bias=((3, 2.0), (5, -1.0))),
    "both": dict(temperature=0.8, logprobs=5, presence_penalty=0.5, frequency_penalty=0.3,
                 repetition_penalty=1.1, logit_bias=((3, 2.0), (5, -1.0))),
}  # fmt: skip


def bench_steps(model, batch: int, tokens: int, rounds: int) -> dict:
    eng, pool = _engine(model, batch)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, 64).tolist() for _ in range(batch)]
    times: dict[str, list[float]] = {k: [] for k in STEP_VARIANTS}
    for r in range(rounds + 1):  # round 0 warms up
        for name, kw in STEP_VARIANTS.items():
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=r, **kw)
            eng.generate(prompts, params)  # the prompts' blocks are cached after round 0
            t0 = time.perf_counter()
            eng.generate(prompts, params)
            if r:
                times[name].append(time.perf_counter() - t0)
    assert eng.runner.compiles_after_warmup == 0
    pool.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    base = med["plain greedy"]
    return {
        "batch": batch,
        "tokens": tokens,
        "variants": {
            k: {"seconds": v, "tok_s": batch * tokens / v, "vs_plain": v / base}
            for k, v in med.items()
        },
    }


def bench_n(model, n: int, prompt_len: int, tokens: int, rounds: int) -> dict:
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
    out = {}
    for mode in ("fork", "independent, no prefix cache", "independent, prefix cache"):
        eng, pool = _engine(model, n, caching=mode != "independent, no prefix cache")
        walls, ttfts, peaks = [], [], []
        for r in range(rounds + 1):
            eng.reset_prefix_cache()
            params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=100 * r + i,
                                     ignore_eos=True) for i in range(n)]  # fmt: skip
            first_tok: dict[int, float] = {}
            t0 = time.perf_counter()

            def on_token(rid, tok, done, first_tok=first_tok):
                first_tok.setdefault(rid, time.perf_counter())

            rid0 = eng.add_request(prompt, params[0], on_token)
            for i in range(1, n):
                fork = rid0 if mode == "fork" else None
                eng.add_request(prompt, params[i], on_token, fork_of=fork)
            peak = 0
            while eng.has_work:
                eng.step()
                peak = max(peak, eng.cache.num_used_blocks)
            if r:
                walls.append(time.perf_counter() - t0)
                ttfts.append(max(first_tok.values()) - t0)
                peaks.append(peak)
        if mode == "fork":
            assert eng.forks >= n - 1
        pool.close()
        out[mode] = {
            "wall_s": float(np.median(walls)),
            "last_ttft_s": float(np.median(ttfts)),
            "peak_blocks": int(max(peaks)),
        }
    return {"n": n, "prompt_len": prompt_len, "tokens": tokens, "modes": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="steps,n")
    p.add_argument("--model", default="bench")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    here = os.path.dirname(__file__)
    p.add_argument("--out", default=os.path.join(here, "results", "bench_openai_features.json"))
    args = p.parse_args()
    model = load_model(args.model)
    result: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__, "model": args.model}
    parts = args.parts.split(",")
    if "steps" in parts:
        r = result["steps"] = bench_steps(model, args.batch, args.tokens, args.rounds)
        print(f"\nDecode, batch {r['batch']} x {r['tokens']} tokens ({args.model} model, "
              f"{_backend()} backend)")  # fmt: skip
        print(f"{'variant':<18}{'seconds':>9}{'tok/s':>9}{'vs plain':>10}")
        for k, v in r["variants"].items():
            print(f"{k:<18}{v['seconds']:>9.3f}{v['tok_s']:>9.0f}{v['vs_plain']:>10.2f}")
    if "n" in parts:
        r = result["n"] = bench_n(model, args.n, args.prompt_len, args.tokens, args.rounds)
        print(
            f"\nn={r['n']} samples of a {r['prompt_len']}-token prompt, {r['tokens']} tokens each"
        )
        print(f"{'mode':<30}{'wall s':>8}{'last TTFT s':>12}{'peak blocks':>12}")
        for k, v in r["modes"].items():
            print(f"{k:<30}{v['wall_s']:>8.3f}{v['last_ttft_s']:>12.3f}{v['peak_blocks']:>12}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
