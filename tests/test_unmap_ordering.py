"""Unmapping never races with in-flight reads: free(after=...) and unmap_pages(*after)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import make_cache

from jax_kvcached.memory import ops


def _slow_read(view, ids, x):
    # A long computation whose result feeds the read's indices (x * 0 cannot be folded
    # away for floats), so the read of `ids` happens only at the very end.
    for _ in range(6):
        x = jnp.tanh(x @ x)
    delay = (x.sum() * 0).astype(jnp.int32)
    return view[0, 0, ids + delay].sum()


def _cache_with_ones(pool):
    """A cache with 64 tokens of ones in layer 0 (4 blocks); expected sum 64 * 2 * 64."""
    c = make_cache(pool)
    ids = c.alloc(4)
    slots = c.slot_mapping(ids, np.arange(64))
    k = jnp.ones((64, 2, 64))
    ops.write_kv(c, 0, k, k, slots, ops.new_token()).block_until_ready()
    return c, ids


def test_free_after_waits_for_dispatched_reads(pool):
    c, ids = _cache_with_ones(pool)
    read = jax.jit(_slow_read)
    x = jnp.full((1024, 1024), 1e-3, jnp.float32)
    read(c.view, jnp.asarray(ids), x).block_until_ready()  # compile

    out = read(c.view, jnp.asarray(ids), x)
    in_flight = not out.is_ready()
    c.free(ids, after=out)  # the pages become empty: unmapped only after `out`
    assert pool.stats()["mapped_pages"] == 0
    assert in_flight, "the read finished before free(); make _slow_read slower"
    assert float(out) == 64 * 2 * 64


def test_unmap_op_runs_after_its_after_operands(pool):
    c = make_cache(pool)
    page = c.num_pages - 1  # mapped by the ops, away from the allocator's pages
    ids = np.arange(4, dtype=np.int32) + page * c.blocks_per_page
    slots = c.slot_mapping(ids, np.arange(64))
    k = jnp.ones((64, 2, 64))
    token = ops.map_pages(c, jnp.array([page], jnp.int32), ops.new_token())
    ops.write_kv(c, 0, k, k, slots, token).block_until_ready()

    @jax.jit
    def step(view, ids, x, token):
        total = _slow_read(view, ids, x)
        token = ops.unmap_pages(c, jnp.array([page], jnp.int32), token, total, view=view)
        return total, token

    x = jnp.full((1024, 1024), 1e-3, jnp.float32)
    total, token = step(c.view, jnp.asarray(ids), x, ops.new_token())
    token.block_until_ready()
    assert float(total) == 64 * 2 * 64
    assert c.num_mapped_pages == 0
