"""Decode and prefill throughput: the paged engine step vs a dense, donated KV cache.

Both run the same Flax model and the same attention math; they differ only in where K/V
live: the paged step gathers blocks from the virtual KV buffer through block tables and
writes new K/V with one FFI call, the dense step keeps an XLA-owned contiguous
``(layers, 2, batch, max_len, kv_heads, head_dim)`` cache, donated every step (the
Flax / MaxText approach). Step times are medians of interleaved rounds, so machine noise
hits both alike. Prints a table and writes JSON (benchmarks/results/bench_decode.json).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import load_model, median_time
from flax import nnx

import jax_kvcached as kv
from jax_kvcached.attention import gqa_attention
from jax_kvcached.runner import ModelRunner, StepInput


def make_dense_step(model, max_len: int):
    graphdef, state = nnx.split(model)
    cfg = model.config

    def step(state, cache, tokens, pos):
        m = nnx.merge(graphdef, state)
        b = tokens.shape[0]
        box = {"cache": cache}  # updated in place (donated) layer by layer

        def attend(i, q, k, v):
            c = box["cache"]
            c = jax.lax.dynamic_update_slice(c, k[None, None].astype(c.dtype), (i, 0, 0, pos, 0, 0))
            c = jax.lax.dynamic_update_slice(c, v[None, None].astype(c.dtype), (i, 1, 0, pos, 0, 0))
            box["cache"] = c
            mask = jnp.broadcast_to(jnp.arange(max_len)[None, None] <= pos, (b, 1, max_len))
            return gqa_attention(q, c[i, 0], c[i, 1], mask)

        positions = jnp.full((b, 1), pos, jnp.int32)
        logits = m(tokens, positions, attend)[:, -1]
        return logits, box["cache"]

    fn = jax.jit(step, donate_argnums=1)
    shape = (cfg.num_layers, 2, 0, max_len, cfg.num_kv_heads, cfg.head_dim)
    return fn, state, shape


def bench_decode(model, batch: int, ctx: int, iters: int, rounds: int) -> dict:
    cfg = model.config
    bs = 16
    itemsize = 4
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    need = batch * (ctx + bs) * kv_per_token
    one_kv_page = 2 * cfg.num_layers * (2 << 20)  # one 2 MiB page per layer for K and V
    pool = kv.Pool(
        max(2 * need, 4 * one_kv_page), backend="host", min_reserved_pages=0,
        max_reserved_pages=0,
    )  # fmt: skip
    cache = pool.create_kv_cache(
        "bench", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32", block_size=bs
    )
    runner = ModelRunner(model, cache)
    tables = [cache.alloc(-(-(ctx + 1) // bs)).tolist() for _ in range(batch)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, batch).tolist()
    inputs = [StepInput([tokens[i]], ctx, tables[i]) for i in range(batch)]

    def paged():
        jax.block_until_ready(runner.run(inputs))

    max_len = ctx + bs  # the dense cache is sized for the context it serves
    dense_fn, state, shape = make_dense_step(model, max_len)
    d_cache = {"c": jnp.zeros((shape[0], 2, batch, max_len, shape[4], shape[5]), jnp.float32)}
    d_tokens = jnp.asarray(np.asarray(tokens, np.int32)[:, None])
    d_pos = jnp.int32(ctx)

    def dense():
        logits, d_cache["c"] = dense_fn(state, d_cache["c"], d_tokens, d_pos)
        jax.block_until_ready(logits)

    for fn in (paged, dense):  # compile + warm up
        fn()
        fn()
    tp, td = [], []
    for _ in range(rounds):
        tp.append(median_time(paged, iters))
        td.append(median_time(dense, iters))
    p, d = float(np.median(tp)), float(np.median(td))
    kv_bytes = batch * ctx * kv_per_token
    pool.close()
    return {
        "batch": batch,
        "ctx": ctx,
        "paged_step_ms": p * 1e3,
        "dense_step_ms": d * 1e3,
        "paged_over_dense": p / d,
        "paged_tokens_per_s": batch / p,
        "dense_tokens_per_s": batch / d,
        "paged_kv_read_gbps": kv_bytes / p / 1e9,
        "dense_kv_read_gbps": kv_bytes / d / 1e9,
    }


def bench_prefill(model, chunk: int, iters: int) -> dict:
    cfg = model.config
    pool = kv.Pool("256MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    cache = pool.create_kv_cache(
        "prefill", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32"
    )
    runner = ModelRunner(model, cache)
    blocks = cache.alloc(-(-chunk // 16)).tolist()
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, chunk).tolist()
    x = [StepInput(toks, 0, blocks)]
    jax.block_until_ready(runner.run(x))
    t = median_time(lambda: jax.block_until_ready(runner.run(x)), iters)
    pool.close()
    return {"chunk": chunk, "step_ms": t * 1e3, "tokens_per_s": chunk / t}


def memcpy_gbps(mib: int = 256) -> float:
    a = np.ones(mib << 18, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = median_time(lambda: np.copyto(b, a), 5)
    return a.nbytes / t / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ctx", default="256,1024,2048")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="bench", help="bench (random, small) or smollm2-135m")
    here = os.path.dirname(__file__)
    p.add_argument("--out", default=None, help="default results/bench_decode[_MODEL].json")
    args = p.parse_args()
    suffix = "" if args.model == "bench" else f"_{args.model}"
    args.out = args.out or os.path.join(here, "results", f"bench_decode{suffix}.json")

    model = load_model(args.model)
    rows = [
        bench_decode(model, b, c, args.iters, args.rounds)
        for c in map(int, args.ctx.split(","))
        for b in map(int, args.batches.split(","))
    ]
    prefill = [bench_prefill(model, n, args.iters) for n in (128, 512)]
    copy = memcpy_gbps()
    cfg = model.config
    print(
        f"\nDecode, {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads x {cfg.head_dim}, fp32, "
        "one token per sequence"
    )
    print(
        f"{'batch':>5} {'ctx':>5} {'paged ms':>9} {'dense ms':>9} {'paged/dense':>12} "
        f"{'paged tok/s':>12} {'KV GB/s paged':>14} {'dense':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ctx']:>5} {r['paged_step_ms']:>9.2f} {r['dense_step_ms']:>9.2f} "
            f"{r['paged_over_dense']:>12.2f} {r['paged_tokens_per_s']:>12.0f} "
            f"{r['paged_kv_read_gbps']:>14.2f} {r['dense_kv_read_gbps']:>7.2f}"
        )
    worst = max(r["paged_over_dense"] for r in rows)
    print(f"worst paged/dense {worst:.2f} (goal <= 1.10); memcpy bandwidth {copy:.1f} GB/s")
    print("\nPrefill (one sequence, one chunk, paged)")
    for r in prefill:
        print(f"  {r['chunk']:>4} tokens: {r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"model": args.model, "decode": rows, "prefill": prefill, "memcpy_gbps": copy,
             "jax": jax.__version__},  # fmt: skip
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
