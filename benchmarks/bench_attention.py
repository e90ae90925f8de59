"""One layer of decode attention over the paged KV view vs a dense einsum over the same
KV laid out contiguously as (B, kv_heads, ctx, D), vs memcpy of the KV bytes.

Paged variants: ``host`` (the host backend's custom call, reading the view in place:
the default on CPU), ``xla`` (the portable XLA path); on a GPU ``pallas`` (the kernel,
the default there) and jax's own decode kernel on a contiguous copy. Timed interleaved
in one run; prints a table and writes JSON (benchmarks/results/bench_attention.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import median_time

import jax_kvcached as kv
from jax_kvcached.engine.attention import (
    Ragged,
    host_paged_attention,
    paged_attention,
    ragged_layout,
)
from jax_kvcached.memory import ops

KVH, D, G, BS = 4, 64, 2, 16  # 4 KV heads x 64, GQA 2, block 16 (the shape)


def dense_decode(q, k, v):
    """q (B, Hkv, G, D), k / v (B, Hkv, S, D): contiguous, head-major."""
    s = jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32) / D**0.5
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def point(b: int, ctx: int, dtype: str, iters: int, rounds: int, gpu: bool) -> dict:
    nb = ctx // BS
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * b * ctx * KVH * D * itemsize
    pool = kv.Pool(2 * kv_bytes + (64 << 20), min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("bench", 1, KVH, D, dtype, block_size=BS)
    rng = np.random.default_rng(0)
    tables = np.stack([c.alloc(nb) for _ in range(b)])
    k = jnp.asarray(rng.standard_normal((b, ctx, KVH, D)), dtype)
    v = jnp.asarray(rng.standard_normal((b, ctx, KVH, D)), dtype)
    for i in range(b):
        slots = c.slot_mapping(tables[i], np.arange(ctx))
        ops.write_kv(c, 0, k[i][None], v[i][None], slots, ops.new_token()).block_until_ready()
    q = jnp.asarray(rng.standard_normal((b, KVH * G, D)), jnp.float32)  # one row each
    lay = Ragged(**{k: jnp.asarray(v) for k, v in
                    ragged_layout([1] * b, [ctx] * b, tables, b, 1).items()})  # fmt: skip
    view = c.view
    variants = {"xla": jax.jit(paged_attention, static_argnums=2)}
    if pool.backend == "host":
        host = functools.partial(host_paged_attention, c, ops.new_token())
        variants["host"] = jax.jit(host, static_argnums=2)
    if gpu:
        from jax_kvcached.engine.pallas_attention import pallas_paged_attention

        splits = max(1, min(8, nb // 32))
        variants["pallas"] = jax.jit(
            functools.partial(pallas_paged_attention, num_splits=splits), static_argnums=2
        )
    calls = {
        name: (lambda f=f: jax.block_until_ready(f(q, view, 0, lay)))
        for name, f in variants.items()
    }
    kd, vd = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # contiguous (B, Hkv, S, D)
    qd = q.reshape(b, KVH, G, D)
    dense = jax.jit(dense_decode)
    calls["dense"] = lambda: jax.block_until_ready(dense(qd, kd, vd))
    if gpu:
        from jax.experimental.pallas.ops.gpu.decode_attention import gqa

        ks, vs = k, v  # (B, S, Hkv, D)
        qg = q.reshape(b, KVH * G, D).astype(k.dtype)  # the kernel wants one element type
        f = jax.jit(gqa)
        calls["jax_decode"] = lambda: jax.block_until_ready(f(qg, ks, vs))
    src = np.ones(kv_bytes // 4, np.float32)
    dst = np.empty_like(src)
    calls["memcpy"] = lambda: np.copyto(dst, src)
    for fn in calls.values():  # compile + warm up
        fn()
        fn()
    times: dict[str, list[float]] = {n: [] for n in calls}
    for _ in range(rounds):
        for n, fn in calls.items():
            times[n].append(median_time(fn, iters))
    med = {n: float(np.median(t)) for n, t in times.items()}
    pool.close()
    row = {"batch": b, "ctx": ctx, "dtype": dtype, "kv_bytes": kv_bytes}
    for n, t in med.items():
        row[f"{n}_ms"] = t * 1e3
        row[f"{n}_gbps"] = kv_bytes / t / 1e9
    best = "pallas" if gpu else "host"  # the default paged path of the platform
    row["paged"] = best
    row["paged_over_dense"] = med[best] / med["dense"]
    row["xla_over_dense"] = med["xla"] / med["dense"]
    row["paged_read_of_memcpy"] = med["memcpy"] / med[best]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ctx", default="1024,2048,4096")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    here = os.path.dirname(__file__)
    p.add_argument("--out", default=os.path.join(here, "results", "bench_attention.json"))
    args = p.parse_args()
    gpu = jax.default_backend() == "gpu"
    rows = [
        point(b, c, dt, args.iters, args.rounds, gpu)
        for dt in args.dtypes.split(",")
        for c in map(int, args.ctx.split(","))
        for b in map(int, args.batches.split(","))
    ]
    names = ["pallas", "jax_decode", "xla"] if gpu else ["host", "xla"]
    print(f"\nOne decode layer, {KVH} KV heads x {D}, GQA {G}, block {BS} ({jax.devices()[0]})")
    head = f"{'dtype':>9} {'B':>3} {'ctx':>5}" + "".join(f" {n + ' ms':>13}" for n in names)
    print(head + f" {'dense ms':>9} {'paged/dense':>12} {'xla/dense':>10} {'paged GB/s':>11} "
          f"{'memcpy GB/s':>12} {'of memcpy':>10}")  # fmt: skip
    for r in rows:
        line = f"{r['dtype']:>9} {r['batch']:>3} {r['ctx']:>5}"
        line += "".join(f" {r[n + '_ms']:>13.3f}" for n in names)
        print(
            line + f" {r['dense_ms']:>9.3f} {r['paged_over_dense']:>12.2f} "
            f"{r['xla_over_dense']:>10.2f} {r[r['paged'] + '_gbps']:>11.2f} "
            f"{r['memcpy_gbps']:>12.2f} {100 * r['paged_read_of_memcpy']:>9.0f}%"
        )
    worst = max(r["paged_over_dense"] for r in rows)
    print(f"worst paged/dense {worst:.2f} (goal <= 1.10)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "device": str(jax.devices()[0]), "jax": jax.__version__}, f,
                  indent=2)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
