"""KV blocks whose bytes do not divide the page (3 or 5 KV heads, head_dim 80 or 96...):
packed densely, blocks straddling two pages never used, accounting exact."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FFI_ERRORS, host_pool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import PROMPTS, _reference, assert_only_cached_blocks_hold_pages

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory import ops
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

PAGE = 64 << 10




@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    heads=st.integers(1, 6),
    head_dim=st.sampled_from([16, 48, 64, 80, 96]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    block_size=st.sampled_from([1, 8, 16, 24]),
    layers=st.integers(1, 2),
)
def test_packed_blocks_fill_pages_and_account_exactly(heads, head_dim, dtype, block_size, layers):
    pool = host_pool(48 * PAGE, page_size=PAGE)
    c = pool.create_kv_cache("t", layers, heads, head_dim, dtype, block_size=block_size)
    bb = block_size * heads * head_dim * jnp.dtype(dtype).itemsize
    assert c.block_bytes == bb and c.blocks_per_page == PAGE // bb
    assert c.num_blocks * bb == c.num_pages * PAGE  # planes hold whole blocks: dense view
    for p in range(c.num_pages):  # each page's blocks lie wholly inside it
        blocks = c.page_blocks(p)
        assert len(blocks) in (PAGE // bb, PAGE // bb - 1)
        if not blocks:  # a block over half a page: some pages hold none (never mapped)
            continue
        for b in (blocks.start, blocks.stop - 1):
            assert b * bb >= p * PAGE and (b + 1) * bb <= (p + 1) * PAGE and c.page_of(b) == p
    cap = c.capacity_blocks
    assert c.num_free_blocks == cap  # exact, also when pages hold different counts
    ids = c.alloc(cap)
    assert 0 not in ids.tolist() and len(set(ids.tolist())) == len(ids)
    assert c.num_free_blocks == 0
    with pytest.raises(kv.PoolExhausted):
        c.alloc(1)
    pages = {c.page_of(b) for b in ids.tolist()}
    assert c.num_mapped_pages == len(pages)
    assert pool.stats()["mapped_pages"] == len(pages) * c.pages_per_kv_page
    # Write every allocated block's first token and read it back through the view.
    slots = jnp.asarray(ids.astype(np.int64) * block_size, jnp.int32)
    k = jnp.arange(len(ids), dtype=jnp.float32)[None, :, None, None] + jnp.zeros(
        (layers, len(ids), heads, head_dim)
    )
    token = ops.write_kv(c, 0, k.astype(dtype), (-k).astype(dtype), slots, ops.new_token())
    token.block_until_ready()
    got = np.asarray(c.view[:, 0, ids, 0, 0, 0].astype(jnp.float32))
    want = np.asarray(jnp.arange(len(ids), dtype=jnp.float32).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
    c.free(ids)
    assert c.num_mapped_pages == 0 and pool.stats()["mapped_pages"] == 0
    pool.close()


def test_a_straddling_block_is_never_written_or_handed_out():
    pool = host_pool(16 * PAGE, page_size=PAGE)
    c = pool.create_kv_cache("t", 1, 3, 64, "bfloat16", block_size=16)  # 6 KiB blocks
    bb = c.block_bytes
    straddler = next(
        b for b in range(1, c.num_blocks) if (b * bb) // PAGE != ((b + 1) * bb - 1) // PAGE
    )
    ids = c.alloc(c.capacity_blocks)
    assert straddler not in ids.tolist()
    k = jnp.ones((1, 1, 3, 64), jnp.bfloat16)
    with pytest.raises(FFI_ERRORS, match="straddles two pages"):
        ops.write_kv(c, 0, k, k, jnp.array([straddler * 16], jnp.int32), ops.new_token()
                     ).block_until_ready()  # fmt: skip
    c.free(ids)
    pool.close()


def test_smollm2_shaped_cache_on_2mib_pages():
    """3 KV heads x 64 x 16 tokens: 12 KiB (fp32) / 6 KiB (bf16) blocks on 2 MiB pages."""
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    for dtype, per_page in (("float32", 170), ("bfloat16", 341)):
        c = pool.create_kv_cache(dtype, 2, 3, 64, dtype, block_size=16)
        assert c.blocks_per_page == per_page
        ids = c.alloc(3 * per_page)
        assert c.num_mapped_pages <= 4
        c.free(ids)
        c.close()
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_engine_with_three_kv_heads_matches_the_dense_reference():
    cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], num_heads=6, num_kv_heads=3,
                              head_dim=32, hidden_size=192)  # fmt: skip
    model = build_model(cfg, seed=5)
    pool = host_pool(64 * PAGE, page_size=PAGE)  # 1.5 KiB blocks on 64 KiB pages: 42 + a tail
    eng = Engine(model, pool, name="m", max_batch=4, max_cached_tokens=-1)
    assert PAGE % eng.cache.block_bytes != 0
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = eng.generate(PROMPTS, params)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == _reference(model, p, 8)[0]
    again = eng.generate(PROMPTS, params)  # through the prefix cache
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert sum(o.cached_tokens for o in again) > 0
    before = eng.cache.num_mapped_pages
    assert eng.prefix_cache.evict(1) >= 1  # page-aware: a whole idle page goes
    assert eng.cache.num_mapped_pages == before - 1
    assert_only_cached_blocks_hold_pages(eng, pool)
    pool.close()
