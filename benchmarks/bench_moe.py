"""Mixture of experts: decode step time of an MoE model against a dense model of the same
active parameters, and the CPU grouped matmul against XLA's ragged_dot.

``--parts decode``: BENCH_MODEL's attention with a Qwen3-MoE feed-forward (``--experts``
experts, ``--top-k`` a token, ``--expert-size`` units each) against the same model with a
dense MLP of top_k x expert_size units (the same active parameters per token), random
weights; greedy decode tokens/s at each batch, rounds alternating, medians; the goal is an
MoE step within 1.5x the dense one.
``--parts grouped``: one expert layer's gate/up projection (the tokens sorted by expert)
through ``grouped_matmul`` (our kernel on a CPU, ragged_dot on a GPU) and through
``jax.lax.ragged_dot``, which XLA's CPU backend computes for every expert, against one
dense matmul of the same active rows. ``--backend cuda``: on a GPU.
Prints tables and writes JSON (benchmarks/results/bench_moe.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import BENCH_MODEL, median_time  # noqa: E402

import jax_kvcached as kv  # noqa: E402
from jax_kvcached import Engine, SamplingParams  # noqa: E402
from jax_kvcached.models import build_model  # noqa: E402
from jax_kvcached.models.moe import MoEConfig, grouped_matmul, sort_by_expert  # noqa: E402

TOKENS = 48


def configs(experts: int, top_k: int, size: int) -> dict:
    base = dataclasses.replace(BENCH_MODEL, model_type="qwen3_moe", qk_norm=True)
    moe = dataclasses.replace(base, moe=MoEConfig(num_experts=experts, top_k=top_k,
                                                  intermediate_size=size, norm_topk_prob=True))
    dense = dataclasses.replace(base, model_type="qwen3", intermediate_size=top_k * size)
    return {"moe": moe, "dense": dense}  # fmt: skip


def _tok_s(eng: Engine, batch: int) -> float:
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(16)] for i in range(batch)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    ttft = max(o.ttft_s for o in outs)
    return batch * (TOKENS - 1) / (max(o.latency_s for o in outs) - ttft)


def bench_decode(args) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    pool = kv.Pool("2GiB", backend=args.backend)
    engines = {}
    for name, cfg in configs(args.experts, args.top_k, args.expert_size).items():
        engines[name] = Engine(build_model(cfg, seed=0), pool, name=name, max_batch=max(batches),
                               max_model_len=256)  # fmt: skip
        for b in batches:
            _tok_s(engines[name], b)  # compile
    runs = {n: {b: [] for b in batches} for n in engines}
    for _ in range(args.rounds):
        for b in batches:
            for n, eng in engines.items():
                runs[n][b].append(_tok_s(eng, b))
    med = {n: {b: statistics.median(v) for b, v in r.items()} for n, r in runs.items()}
    ratio = {b: med["dense"][b] / med["moe"][b] for b in batches}  # MoE step / dense step
    print(f"\nDecode, {args.experts} experts top-{args.top_k} x {args.expert_size} vs dense "
          f"{args.top_k * args.expert_size} (tok/s, median of {args.rounds})")  # fmt: skip
    print("batch     moe   dense  moe step / dense step")
    for b in batches:
        print(f"{b:5d} {med['moe'][b]:7.1f} {med['dense'][b]:7.1f} {ratio[b]:8.2f}x")
    for eng in engines.values():
        eng.close()
    pool.close()
    return {"tok_s": med, "runs": runs, "moe_step_over_dense": ratio,
            "config": {"experts": args.experts, "top_k": args.top_k,
                       "expert_size": args.expert_size}}  # fmt: skip


def bench_grouped(args) -> dict:
    rng = np.random.default_rng(0)
    h, e, k, inter = BENCH_MODEL.hidden_size, args.experts, args.top_k, args.expert_size
    w = jnp.asarray(rng.standard_normal((e, h, 2 * inter)).astype(np.float32))
    out = {}
    print(f"\nGrouped matmul, {e} experts x ({h}, {2 * inter}), top-{k} (ms)")
    print("tokens  kernel  ragged_dot  dense(active rows)")
    for tokens in (1, 8, 32, 256):
        x = jnp.asarray(rng.standard_normal((tokens * k, h)).astype(np.float32))
        experts = jnp.asarray(rng.integers(0, e, (tokens, k)))
        _, _, sizes = sort_by_expert(experts, e)
        fns = {  # (on a GPU "auto" is ragged_dot, and there is no CPU kernel)
            "kernel": jax.jit(lambda x, s: grouped_matmul(x, w, s, impl="auto")),
            "ragged_dot": jax.jit(lambda x, s: grouped_matmul(x, w, s, impl="ragged_dot")),
            "dense": jax.jit(lambda x, s: x @ w[0]),
        }
        res = {n: median_time(lambda f=f, x=x, s=sizes: f(x, s).block_until_ready(), 10, 2)
               for n, f in fns.items()}  # fmt: skip
        out[tokens] = {n: t * 1e3 for n, t in res.items()}
        print(f"{tokens:6d} {res['kernel'] * 1e3:7.3f} {res['ragged_dot'] * 1e3:11.3f} "
              f"{res['dense'] * 1e3:10.3f}")  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="decode,grouped")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=256)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="host", help="the pool's backend (cuda on a GPU)")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "bench_moe.json"))
    args = p.parse_args()
    parts = set(args.parts.split(","))
    result: dict = {"model": "BENCH_MODEL", "date": time.strftime("%Y-%m-%d")}
    if "decode" in parts:
        result["decode"] = bench_decode(args)
    if "grouped" in parts:
        result["grouped"] = bench_grouped(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
