"""VMM primitive latency and the KV write path.

1. Per-page create / map / unmap / release latency of the physical backends, timed in
   C++ (jax_kvcached.memory._C.bench_backend), beside kvcached's published A100 numbers.
2. KV-page map+unmap through the Python API (one KV page = 2 * num_layers pages).
3. The decode write path: FFI write_kv into the virtual buffer vs a donated
   dynamic_update_slice into an XLA-owned dense cache, side by side in one run.
4. The host tier's copies: 2048 tokens of KV (128 blocks) out to the host arena and back
   (per backend: page-locked memory and a copy stream on CUDA).

Prints a table and writes JSON (default benchmarks/results/bench_vmm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import median_time

import jax_kvcached as kv
from jax_kvcached.memory import _C, ops

# kvcached bench_vmm on an A100 with 2 MiB pages (microseconds), from DESIGN.md.
KVCACHED_A100_US = {"create": 193.0, "map": 1.45, "set_access": 36.0, "unmap": 25.6}


def _summary(samples_ns) -> dict:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {
        "median_us": float(np.median(a)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
        "n": int(a.size),
    }


def bench_backend(name: str, iters: int, repeats: int) -> dict:
    merged: dict[str, list[float]] = {}
    for _ in range(repeats):
        for op, xs in _C.bench_backend(name, 2 << 20, iters).items():
            merged.setdefault(op, []).extend(xs)
    out = {op: _summary(xs) for op, xs in merged.items()}
    pair = np.asarray(merged["map"]) + np.asarray(merged["unmap"])
    out["map+unmap"] = _summary(pair)
    return out


def bench_kv_page(pool: kv.Pool, layers: int, iters: int) -> dict:
    c = pool.create_kv_cache("bench-kv-page", layers, 8, 128, "bfloat16")
    maps, unmaps = [], []
    for i in range(iters):
        page = np.asarray([i % c.num_pages], np.int32)
        t0 = time.perf_counter_ns()
        c.buffer.map_pages(page)
        t1 = time.perf_counter_ns()
        c.buffer.unmap_pages(page)
        t2 = time.perf_counter_ns()
        maps.append(t1 - t0)
        unmaps.append(t2 - t1)
    c.close()
    return {"layers": layers, "map": _summary(maps), "unmap": _summary(unmaps)}


def bench_write(
    batch: int, layers: int, heads: int, dim: int, max_len: int, iters: int, backend: str = "host"
) -> dict:
    # float32: XLA CPU updates a donated f32 cache in place, while for bf16 it converts
    # the whole cache to f32 and back on every dynamic_update_slice (measured: 25 ms for a
    # 256 MiB cache), which would make the dense baseline meaningless.
    dtype = jnp.float32
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.standard_normal((layers, batch, heads, dim)), dtype)
    vals = jnp.asarray(rng.standard_normal((layers, batch, heads, dim)), dtype)

    # Paged: the virtual buffer, written by the FFI custom call.
    block = 16
    kv_bytes = layers * 2 * batch * max_len * heads * dim * jnp.dtype(dtype).itemsize
    pool = kv.Pool(
        max(2 * kv_bytes, 64 << 20), backend=backend, min_reserved_pages=0, max_reserved_pages=0
    )
    cache = pool.create_kv_cache("bench", layers, heads, dim, dtype, block_size=block)
    per_seq = max_len // block
    tables = [cache.alloc(per_seq) for _ in range(batch)]
    pos = max_len // 2
    slots = jnp.asarray(np.array([t[pos // block] * block + pos % block for t in tables], np.int32))

    # Per-layer variants take one array per layer, as a layer loop produces them (slicing
    # one stacked array inside the step would add copies to both sides).
    key_list = [keys[i] for i in range(layers)]
    val_list = [vals[i] for i in range(layers)]

    def make_ffi(side_effect: bool, one_call: bool = False):
        @jax.jit
        def ffi_write(cache, keys, vals, slots, token):
            if one_call:
                return ops.write_kv(cache, 0, keys, vals, slots, token)
            for layer in range(layers):
                token = ops.write_kv(
                    cache, layer, keys[layer], vals[layer], slots, token, side_effect=side_effect
                )
            return token

        state = {"token": ops.new_token()}

        args = (keys, vals) if one_call else (key_list, val_list)

        def run():
            state["token"] = ffi_write(cache, *args, slots, state["token"])
            state["token"].block_until_ready()

        return run

    run_ffi, run_ffi_se, run_ffi_all = make_ffi(False), make_ffi(True), make_ffi(False, True)

    # Dense: an XLA-owned (layers, 2, batch, max_len, heads, dim) cache, donated each step.
    dense = {"cache": jnp.zeros((layers, 2, batch, max_len, heads, dim), dtype)}

    def dense_write_impl(cache, keys, vals, pos):
        for layer in range(layers):
            k = keys[layer][None, None, :, None]
            v = vals[layer][None, None, :, None]
            cache = jax.lax.dynamic_update_slice(cache, k, (layer, 0, 0, pos, 0, 0))
            cache = jax.lax.dynamic_update_slice(cache, v, (layer, 1, 0, pos, 0, 0))
        return cache

    def dense_stacked_impl(cache, keys, vals, pos):
        kv_new = jnp.stack([keys, vals], axis=1)[:, :, :, None]  # (layers, 2, batch, 1, h, d)
        return jax.lax.dynamic_update_slice(cache, kv_new, (0, 0, 0, pos, 0, 0))

    dense_write = jax.jit(dense_write_impl, donate_argnums=0)
    dense_stacked = jax.jit(dense_stacked_impl, donate_argnums=0)
    pos_j = jnp.int32(pos)

    def run_dense():
        dense["cache"] = dense_write(dense["cache"], key_list, val_list, pos_j)
        dense["cache"].block_until_ready()

    def run_dense_stacked():
        dense["cache"] = dense_stacked(dense["cache"], keys, vals, pos_j)
        dense["cache"].block_until_ready()

    # Interleave the two in rounds so machine noise hits both alike.
    runs = {
        "ffi_write_us": run_ffi,
        "ffi_side_effect_us": run_ffi_se,
        "ffi_one_call_us": run_ffi_all,
        "dense_donated_us": run_dense,
        "dense_stacked_us": run_dense_stacked,
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(5):
        for k, fn in runs.items():
            times[k].append(median_time(fn, iters, warmup=3))
    # Check that both wrote the same data.
    got = np.asarray(cache.view[:, 0, np.asarray(slots) // block, pos % block].astype(jnp.float32))
    want = np.asarray(dense["cache"][:, 0, :, pos].astype(jnp.float32))
    assert np.array_equal(got, want), "FFI write and dense write disagree"
    pool.close()
    med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    return {
        "backend": backend,
        "batch": batch,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": dim,
        "max_len": max_len,
        "dtype": "float32",
        **med,
        "ffi_over_dense": med["ffi_write_us"] / med["dense_donated_us"],
        "ffi_one_call_over_dense_stacked": med["ffi_one_call_us"] / med["dense_stacked_us"],
    }


def bench_host_tier(backend: str, layers: int, iters: int) -> dict:
    """Copy out (enqueue + wait for the ticket) and copy in of 128 blocks of 16 tokens,
    ``layers`` x 8 KV heads x 128, bf16 (what a 2048-token prefix restore moves)."""
    from jax_kvcached.memory.host_store import HostStore

    pool = kv.Pool("2GiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("bench-host-tier", layers, 8, 128, "bfloat16")
    store = HostStore(c, 128)
    blocks = c.alloc(128).tolist()
    slots = store.alloc(128)
    outs, ins = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        ticket = store.copy_out(blocks, slots)
        while not store.done(ticket):
            pass
        t1 = time.perf_counter()
        store.copy_in(slots, blocks)
        ins.append(time.perf_counter() - t1)
        outs.append(t1 - t0)
    mib = 128 * store.slot_bytes / (1 << 20)
    pool.close()
    out_ms, in_ms = 1e3 * float(np.median(outs)), 1e3 * float(np.median(ins))
    return {
        "backend": backend, "layers": layers, "mib": mib, "pinned": store.pinned,
        "out_ms": out_ms, "in_ms": in_ms,
        "out_gib_s": mib / 1024 / (out_ms / 1e3), "in_gib_s": mib / 1024 / (in_ms / 1e3),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=256, help="pages per backend run")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--write-iters", type=int, default=50)
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_vmm.json")
    )
    args = p.parse_args()

    result: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "jax": jax.__version__,
        "kvcached_a100_us": KVCACHED_A100_US,
        "backends": {"host": bench_backend("host", args.iters, args.repeats)},
    }
    gpu = [d for d in jax.devices() if d.platform == "gpu"]
    if gpu and _C.cuda_compiled():
        result["backends"]["cuda"] = bench_backend("cuda", args.iters, args.repeats)

    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):  # host-backend handles run on the CPU device
        pool = kv.Pool("4GiB", backend="host", min_reserved_pages=0, max_reserved_pages=64)
        result["kv_page"] = [bench_kv_page(pool, layers, 200) for layers in (1, 8, 32)]
        pool.close()

    result["host_tier"] = [bench_host_tier("host", 8, 20)]
    if gpu and _C.cuda_compiled():
        result["host_tier"].append(bench_host_tier("cuda", 8, 20))

    # The step's K/V write (FFI vs a donated dense cache) on the platform's own backend.
    on_gpu = bool(gpu) and _C.cuda_compiled()
    with jax.default_device(gpu[0] if on_gpu else cpu):
        result["write"] = [
            bench_write(b, 8, 8, 128, 1024, args.write_iters, backend="cuda" if on_gpu else "host")
            for b in (1, 8, 32)
        ]

    print("\nVMM primitives, 2 MiB pages (median / p99 us; kvcached A100 median for reference)")
    print(
        f"{'op':<10}"
        + "".join(f"{b + ' med':>12}{b + ' p99':>11}" for b in result["backends"])
        + f"{'A100 kvcached':>15}"
    )
    for op in ("reserve", "create", "map", "unmap", "map+unmap", "release"):
        row = f"{op:<10}"
        for b in result["backends"].values():
            row += f"{b[op]['median_us']:>12.2f}{b[op]['p99_us']:>11.2f}"
        ref = KVCACHED_A100_US.get(op)
        row += f"{ref:>15.2f}" if ref is not None else f"{'-':>15}"
        print(row)
    host = result["backends"]["host"]["map+unmap"]["median_us"]
    print(
        f"host map+unmap median {host:.2f} us (goal < 10 us): {'met' if host < 10 else 'NOT met'}"
    )

    print("\nKV page (all 2L planes) through the API, host backend, reserved pages reused")
    print(f"{'layers':>6} {'map med us':>11} {'unmap med us':>13} {'map p99':>9} {'unmap p99':>10}")
    for r in result["kv_page"]:
        print(
            f"{r['layers']:>6} {r['map']['median_us']:>11.1f} {r['unmap']['median_us']:>13.1f} "
            f"{r['map']['p99_us']:>9.1f} {r['unmap']['p99_us']:>10.1f}"
        )

    print(
        f"\nDecode write path ({result['write'][0]['backend']} backend): 8 layers x 8 KV heads "
        "x 128, f32, one token per sequence, ctx 1024 (median us per jitted step)"
    )
    print("per layer: one write_kv / two dynamic_update_slice per layer; one call: all layers")
    print(
        f"{'batch':>5} {'FFI/layer':>10} {'(+side-eff)':>12} {'DUS/layer':>10} {'ratio':>6} "
        f"{'FFI 1 call':>11} {'DUS stacked':>12} {'ratio':>6}"
    )
    for r in result["write"]:
        print(
            f"{r['batch']:>5} {r['ffi_write_us']:>10.1f} {r['ffi_side_effect_us']:>12.1f} "
            f"{r['dense_donated_us']:>10.1f} {r['ffi_over_dense']:>6.2f} "
            f"{r['ffi_one_call_us']:>11.1f} {r['dense_stacked_us']:>12.1f} "
            f"{r['ffi_one_call_over_dense_stacked']:>6.2f}"
        )
    worst = max(r["ffi_over_dense"] for r in result["write"])
    worst1 = max(r["ffi_one_call_over_dense_stacked"] for r in result["write"])
    print(f"worst FFI/dense: per layer {worst:.2f}, one call {worst1:.2f} (goal <= 1.0)")

    print("\nHost tier: 2048 tokens (128 blocks) of 8 layers x 8 KV heads x 128 bf16")
    for r in result["host_tier"]:
        print(
            f"  {r['backend']:>4}: {r['mib']:.0f} MiB out {r['out_ms']:.2f} ms "
            f"({r['out_gib_s']:.1f} GiB/s), in {r['in_ms']:.2f} ms ({r['in_gib_s']:.1f} GiB/s)"
            f"{', page-locked' if r['pinned'] else ''}"
        )

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
