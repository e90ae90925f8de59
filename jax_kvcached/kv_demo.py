"""The KV-level demo (`jax-kvcached kv-demo`): two tenants share one pool, write K/V
through the FFI inside jitted steps, read it back through block tables, and hand pages to
each other."""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcached.memory import ops
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.memory.pool import Pool
from jax_kvcached.progress import Log

MiB = 1 << 20


@dataclass
class TenantSpec:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


TENANTS = (
    TenantSpec("llama-tiny", 4, 4, 64, "bfloat16"),
    TenantSpec("qwen-tiny", 2, 2, 128, "float32"),
)


def _make_step(cache: KVCache, batch: int, max_blocks: int):
    """One decode-like step: write each sequence's new K/V in every layer, then read the
    sequences back through their block tables (ordered after the writes)."""

    def step(view, keys, values, slots, tables, lengths, token):
        pos = jnp.arange(max_blocks * cache.block_size)
        mask = (pos[None, :] < lengths[:, None]).astype(jnp.float32)
        checks = []
        for layer in range(cache.num_layers):
            token = ops.write_kv(cache, layer, keys[layer], values[layer], slots, token,
                                 view=view)  # fmt: skip
            t = ops.after(tables, token)
            k = view[layer, 0, t].reshape(batch, -1, cache.num_kv_heads, cache.head_dim)
            checks.append(jnp.einsum("bthd,bt->b", k.astype(jnp.float32), mask))
        return jnp.stack(checks), token

    return jax.jit(step)


def _run_tenant(cache: KVCache, batch: int, steps: int, rng: np.random.Generator, log) -> dict:
    bs = cache.block_size
    max_blocks = -(-steps // bs)
    step = _make_step(cache, batch, max_blocks)
    tables = np.zeros((batch, max_blocks), np.int32)  # block 0: the null block
    owned: list[list[int]] = [[] for _ in range(batch)]
    expect = np.zeros((cache.num_layers, batch), np.float64)
    token = ops.new_token()
    peak = 0
    t0 = time.perf_counter()
    first = None
    for t in range(steps):
        slots = np.empty(batch, np.int32)
        for b in range(batch):
            if t % bs == 0:
                owned[b].extend(cache.alloc(1).tolist())
                tables[b, len(owned[b]) - 1] = owned[b][-1]
            slots[b] = owned[b][t // bs] * bs + t % bs
        shape = (cache.num_layers, batch, cache.num_kv_heads, cache.head_dim)
        keys = rng.standard_normal(shape).astype(np.float32)
        vals = rng.standard_normal(shape).astype(np.float32)
        keys_j = jnp.asarray(keys, cache.dtype)
        expect += np.asarray(keys_j.astype(jnp.float32)).sum(axis=(2, 3))
        lengths = np.full(batch, t + 1, np.int32)
        checks, token = step(
            cache.view,
            keys_j,
            jnp.asarray(vals, cache.dtype),
            jnp.asarray(slots),
            jnp.asarray(tables),
            jnp.asarray(lengths),
            token,
        )
        if first is None:
            checks.block_until_ready()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
        peak = max(peak, cache.stats()["mapped_bytes"])
        log.progress(cache.name, t + 1, steps)
    checks = np.asarray(checks, np.float64)
    elapsed = time.perf_counter() - t0
    ok = np.allclose(checks, expect, rtol=2e-2, atol=1e-1)
    for blocks in owned:
        cache.free(blocks, after=token)
    tokens = batch * (steps - 1)
    return {
        "tenant": cache.name,
        "tokens": batch * steps,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else float("nan"),
        "step_ms": 1e3 * elapsed / max(steps - 1, 1),
        "compile_s": first,
        "peak_mapped_mib": peak / MiB,
        "verified": bool(ok),
    }


def run_kv_demo(
    memory_limit: str = "256MiB",
    batch: int = 8,
    steps: int = 96,
    backend: str = "auto",
    seed: int = 0,
    quiet: bool = False,
) -> dict:
    """Runs the demo and returns its measurements."""
    log = Log(quiet)
    rng = np.random.default_rng(seed)
    pool = Pool(memory_limit, backend=backend, min_reserved_pages=0, max_reserved_pages=64)
    log(
        f"jax-kvcached demo: {pool.backend} backend on {pool.device}, budget "
        f"{pool.memory_limit / MiB:.0f} MiB in {pool.page_size // 1024} KiB pages"
    )
    caches = [
        pool.create_kv_cache(s.name, s.num_layers, s.num_kv_heads, s.head_dim, s.dtype)
        for s in TENANTS
    ]
    for c in caches:
        log(
            f"  {c.name}: {c.num_layers} layers x {c.num_kv_heads} KV heads x {c.head_dim} "
            f"({c.dtype}), virtual {c.virtual_bytes / MiB:.0f} MiB, nothing mapped"
        )
    results = []
    for c in caches:
        before = pool.stats()
        log(f"burst on {c.name} (batch {batch}, {steps} tokens each):")
        r = _run_tenant(c, batch, steps, rng, log)
        after = pool.stats()
        r["pages_created"] = after["creates"] - before["creates"]
        r["pages_reused"] = after["reuses"] - before["reuses"]
        results.append(r)
        log(
            f"  idle again: mapped {after['mapped_bytes'] / MiB:.0f} MiB, "
            f"reserved {after['reserved_bytes'] / MiB:.0f} MiB for the next tenant"
        )
    stats = pool.stats()
    log("")
    log(
        f"{'tenant':<11} {'tokens/s':>10} {'step ms':>8} {'peak MiB':>9} "
        f"{'created':>8} {'reused':>7} {'verified':>9}"
    )
    for r in results:
        log(
            f"{r['tenant']:<11} {r['tokens_per_s']:>10.0f} {r['step_ms']:>8.2f} "
            f"{r['peak_mapped_mib']:>9.1f} {r['pages_created']:>8} {r['pages_reused']:>7} "
            f"{str(r['verified']):>9}"
        )
    log(
        f"pool after the run: mapped {stats['mapped_pages']} pages, reserved "
        f"{stats['reserved_pages']} pages, committed {stats['committed_bytes'] / MiB:.0f} MiB"
    )
    pool.close()
    return {"results": results, "final": stats}
