"""Physical memory follows mapping: RSS and the kernel's own count of committed pages."""

import jax
import jax.numpy as jnp
import numpy as np
import psutil

import jax_kvcached as kv
from jax_kvcached.memory import ops

MiB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_rss_tracks_mapped_pages_over_a_reservation_larger_than_ram():
    ram = psutil.virtual_memory().total
    limit = 2 * ram + (64 << 30)
    pool = kv.Pool(limit, backend="host", min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("big", 1, 8, 128, "float32")  # 64 KiB blocks, 32 per page
    assert c.virtual_bytes > ram
    write = jax.jit(lambda k, s, t, view: ops.write_kv(c, 0, k, k, s, t, view=view))
    chunk = 1024
    k = jnp.ones((chunk, 8, 128), jnp.float32)
    write(k, jnp.full((chunk,), -1, jnp.int32), ops.new_token(), c.view).block_until_ready()

    n_kv_pages = 32  # 64 physical pages = 128 MiB
    base = _rss()
    ids = c.alloc(n_kv_pages * c.blocks_per_page - 1)  # page 0 holds the null block
    assert pool.stats()["mapped_pages"] == 2 * n_kv_pages
    assert _rss() - base < 8 * MiB  # mapping alone commits nothing to RSS
    slots = c.slot_mapping(ids, np.arange(len(ids) * c.block_size))
    token = ops.new_token()
    for i in range(0, len(slots), chunk):
        part = np.full(chunk, -1, np.int32)
        part[: len(slots[i : i + chunk])] = slots[i : i + chunk]
        token = write(k, jnp.asarray(part), token, c.view)
    token.block_until_ready()
    grown = _rss() - base
    expected = 2 * n_kv_pages * pool.page_size  # the K and V planes of 32 KV pages
    assert 0.9 * expected <= grown <= expected + 24 * MiB, (grown, expected)
    assert pool.stats()["committed_bytes"] == 2 * n_kv_pages * pool.page_size

    c.free(ids)
    assert pool.stats()["mapped_pages"] == 0
    assert _rss() - base < 24 * MiB
    assert pool.stats()["committed_bytes"] == 0  # returned to the OS (no reserve kept)
    pool.close()


def test_reserved_pages_are_committed_but_not_resident():
    pool = kv.Pool("256MiB", backend="host", min_reserved_pages=0, max_reserved_pages=64)
    c = pool.create_kv_cache("a", 1, 8, 128, "float32")
    ids = c.alloc(16 * c.blocks_per_page)
    c.free(ids)
    s = pool.stats()
    assert s["mapped_pages"] == 0 and s["reserved_pages"] > 0
    assert s["committed_bytes"] == s["reserved_pages"] * pool.page_size
    pool.trim()
    assert pool.stats()["committed_bytes"] == 0
    pool.close()
