"""The prefix cache's host tier: host copies of evicted blocks, restored instead of recomputed.

Layers: the C++ copies and the bounded store (memory/host_store.py), the LRU tier
(engine/host_cache.py), the KV manager's spill and restore, and whole engines (outputs
identical with the tier on and off, byte-identical restores, exact accounting, tenants).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cache, tp_pool

import jax_kvcached as kv
from jax_kvcached import ops
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.host_cache import HostCache
from jax_kvcached.engine.prefix_cache import extra_key_bytes, hash_blocks
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory.config import Config, host_cache_blocks
from jax_kvcached.memory.errors import KVCacheError
from jax_kvcached.memory.host_store import HostStore
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

BS = 16


def fill(cache, blocks, seed=0):
    """Writes random K/V into every slot of ``blocks`` (every layer); returns the view."""
    rng = np.random.default_rng(seed)
    n = len(blocks) * BS
    shape = (cache.num_layers, n, cache.shard_kv_heads, cache.head_dim)
    k = jnp.asarray(rng.standard_normal(shape), cache.dtype)
    v = jnp.asarray(rng.standard_normal(shape), cache.dtype)
    slots = cache.slot_mapping(np.asarray(blocks), np.arange(n))
    tok = ops.write_kv(cache, 0, k, v, slots, ops.new_token())
    jax.block_until_ready(tok)
    return np.asarray(cache.view)


def block_bytes(view, block):
    """One block's bytes, every plane in order (layer-major, K then V)."""
    return np.ascontiguousarray(view[:, :, block]).tobytes()


# -- the store: C++ copies ---------------------------------------------------------------


def test_store_round_trip_is_byte_identical_through_an_unmap(pool):
    cache = make_cache(pool)
    store = HostStore(cache, 8)
    blocks = cache.alloc(5).tolist()
    before = fill(cache, blocks)
    slots = store.alloc(5)
    assert slots == [0, 1, 2, 3, 4]  # lowest first: one run, one copy per plane
    ticket = store.copy_out(blocks, slots)
    assert store.done(ticket)  # host copies complete at once
    for b, s in zip(blocks, slots, strict=True):
        assert store.read_slot(s) == block_bytes(before, b)
    cache.free(blocks)
    assert pool.stats()["mapped_pages"] == 0  # the originals are gone
    new = cache.alloc(5).tolist()
    assert not np.asarray(cache.view)[:, :, new].any()  # fresh pages read zeros
    store.copy_in(slots[::-1], new[::-1])  # any order: not one run
    after = np.asarray(cache.view)
    for old, b in zip(blocks, new, strict=True):
        assert block_bytes(after, b) == block_bytes(before, old)
    assert store.slot_bytes == 2 * cache.num_layers * cache.block_bytes
    assert store.total_bytes == 8 * store.slot_bytes


def test_store_refuses_bad_copies_and_copies_nothing(pool):
    cache = make_cache(pool)
    store = HostStore(cache, 4)
    blocks = cache.alloc(2).tolist()
    fill(cache, blocks)
    with pytest.raises(ValueError, match="not allocated"):
        store.copy_out([blocks[0], 77], [0, 1])
    with pytest.raises(KVCacheError, match="host slot 4"):
        store.copy_out(blocks, [0, 4])
    with pytest.raises(KVCacheError, match="given twice"):
        store.copy_out(blocks, [1, 1])
    with pytest.raises(KVCacheError, match="differ in length"):
        store.copy_out(blocks, [0])
    buf = cache.shards[0]
    with pytest.raises(KVCacheError, match="null block"):
        buf.copy_to_host(np.array([0], np.int32), np.array([0], np.int64), store.arenas[0])
    other = HostStore(make_cache(pool, "b", layers=3), 2)
    with pytest.raises(KVCacheError, match="not made for this KV buffer"):
        buf.copy_to_host(np.array(blocks[:1], np.int32), np.array([0], np.int64), other.arenas[0])
    assert store.read_slot(0) == bytes(store.slot_bytes)  # nothing was written
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="positive number of slots"):
            HostStore(cache, bad)
    store.close()
    with pytest.raises(KVCacheError, match="closed"):
        store.copy_out(blocks, [0, 1])


def test_store_of_a_tensor_parallel_cache_copies_every_device():
    pool = tp_pool(2, "64MiB", min_reserved_pages=0, max_reserved_pages=0)
    cache = pool.create_kv_cache("tp", 2, 4, 32, "float32", block_size=BS)
    store = HostStore(cache, 4)
    blocks = cache.alloc(3).tolist()
    for shard_view in cache.view.addressable_shards:
        assert shard_view.data.shape[4] == 2  # two of the four KV heads each
    # write through shard_map: each device its own heads
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((2, 3 * BS, 4, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 3 * BS, 4, 32)), jnp.float32)
    slots = cache.slot_mapping(np.asarray(blocks), np.arange(3 * BS))
    P = jax.sharding.PartitionSpec

    @jax.jit
    def write(cache, k, v):
        def body(cache, k, v):  # (this device's buffer and heads)
            return ops.write_kv(cache, 0, k, v, slots, ops.new_token())[None]

        return jax.shard_map(
            body, mesh=cache.mesh,
            in_specs=(cache.sharding.spec, P(None, None, "tp"), P(None, None, "tp")),
            out_specs=P("tp"), check_vma=False,
        )(cache, k, v)  # fmt: skip

    jax.block_until_ready(write(cache, k, v))
    before = [np.asarray(s.data) for s in cache.view.addressable_shards]
    store.copy_out(blocks, store.alloc(3))
    cache.free(blocks)
    new = cache.alloc(3).tolist()
    store.copy_in([0, 1, 2], new)
    after = [np.asarray(s.data) for s in cache.view.addressable_shards]
    for b_old, b_new in zip(blocks, new, strict=True):
        for d in range(2):
            assert block_bytes(after[d], b_new) == block_bytes(before[d], b_old)
    assert store.read_slot(0) == block_bytes(before[0], blocks[0]) + block_bytes(
        before[1], blocks[0]
    )
    pool.close()


# -- the tier: LRU, bound, readiness ---------------------------------------------------


class SlowStore(HostStore):
    """A store whose copies complete only when the test says so (as on CUDA), or fail."""

    complete = False
    fail = False

    def done(self, ticket):
        if self.fail:
            raise KVCacheError("injected copy failure")
        return self.complete and super().done(ticket)


def hashes(n, salt=b""):
    return [bytes([i]) * 31 + salt for i in range(n)]


def test_tier_is_lru_and_bounded_and_bytes_are_exact(pool):
    cache = make_cache(pool)
    tier = HostCache(HostStore(cache, 4), BS)
    blocks = cache.alloc(6).tolist()
    fill(cache, blocks)
    hs = hashes(6)
    assert tier.store_blocks(hs[:3], blocks[:3]) == 3
    assert tier.lookup(hs[:3]) == 3
    tier.store_blocks(hs[:1], blocks[:1])  # already there: only marked used
    assert tier.stored_blocks == 3
    assert tier.store_blocks(hs[3:6], blocks[3:6]) == 3  # full: drops the 2 oldest
    assert tier.num_entries == 4 and tier.evictions == 2
    assert hs[0] in tier and hs[1] not in tier and hs[2] not in tier
    assert tier.bytes == tier.num_entries * tier.store.slot_bytes <= tier.store.total_bytes
    assert tier.lookup(hs[1:]) == 0  # a chain is served from its first block on
    s = tier.stats()
    assert s["entries"] == 4 and s["bytes_to_host"] == 6 * tier.store.slot_bytes
    assert tier.clear() == 4 and tier.num_entries == 0 and tier.store.num_free == 4


def test_an_entry_whose_copy_is_not_done_is_never_served(pool):
    cache = make_cache(pool)
    store = SlowStore(cache, 4)
    tier = HostCache(store, BS)
    blocks = cache.alloc(2).tolist()
    fill(cache, blocks)
    hs = hashes(2)
    tier.store_blocks(hs, blocks)
    assert tier.lookup(hs) == 0
    assert tier.restore(hs, lambda n: pytest.fail("nothing may be restored")) == []
    store.complete = True
    assert tier.lookup(hs) == 2
    # a failed copy: its entries are dropped (never served) and their slots come back
    tier.store_blocks(hashes(1, b"x"), blocks[:1])
    store.fail = True
    assert tier.lookup(hashes(1, b"x")) == 0
    assert hashes(1, b"x")[0] not in tier and tier.copy_failures == 1
    assert store.num_free == 2
    # a copy that cannot start (a block that is not allocated) stores nothing
    store.fail = False
    assert tier.store_blocks(hashes(1, b"y"), [99]) == 0
    assert tier.copy_failures == 2 and store.num_free == 2


def test_entries_being_restored_survive_evictions_into_a_full_tier(pool):
    cache = make_cache(pool)
    tier = HostCache(HostStore(cache, 3), BS)
    blocks = cache.alloc(6).tolist()
    view = fill(cache, blocks)
    hs = hashes(6)
    tier.store_blocks(hs[:3], blocks[:3])  # full

    def get_blocks(n):
        # evicting device blocks while allocating spills them into the full tier
        tier.store_blocks(hs[3:], blocks[3:])
        return blocks[3 : 3 + n]

    got = tier.restore(hs[:2], get_blocks)
    assert got == blocks[3:5]
    assert hs[0] in tier and hs[1] in tier  # held during the restore
    assert tier.num_entries == 3 and tier.restores == 1 and tier.hits_tokens == 2 * BS
    after = np.asarray(cache.view)
    assert block_bytes(after, blocks[3]) == block_bytes(view, blocks[0])


def test_bounds_from_tokens_bytes_and_the_environment():
    assert host_cache_blocks(None, None, 16, 100) == 0
    assert host_cache_blocks(160, None, 16, 100) == 10
    assert host_cache_blocks(160, 500, 16, 100) == 5  # the smaller
    assert host_cache_blocks(0, 10**9, 16, 100) == 0  # 0 is off
    with pytest.raises(ValueError, match="must be >= 0"):
        host_cache_blocks(-1, None, 16, 100)
    env = {"KVCACHED_HOST_CACHE_TOKENS": "4096", "KVCACHED_HOST_CACHE_BYTES": "1GiB"}
    c = Config.from_env(env)
    assert (c.host_cache_tokens, c.host_cache_bytes) == (4096, 1 << 30)
    assert Config.from_env({}).host_cache_tokens is None
    with pytest.raises(ValueError, match="KVCACHED_HOST_CACHE_TOKENS"):
        Config.from_env({"KVCACHED_HOST_CACHE_TOKENS": "-3"})
    with pytest.raises(ValueError, match="KVCACHED_HOST_CACHE_BYTES"):
        Config.from_env({"KVCACHED_HOST_CACHE_BYTES": "lots"})


# -- engines -----------------------------------------------------------------------------

LLAMA = BUILTIN_CONFIGS["tiny-llama"]  # 4 layers x 2 KV heads x 32 fp32: 4 KiB a plane-block
PAGE = 16384


def small_pool(pages):
    return kv.Pool(
        pages * PAGE, page_size=PAGE, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )


def prompts(seed, n, length, prefix):
    rng = np.random.default_rng(seed)
    return [prefix + rng.integers(1, 250, size=length).tolist() for _ in range(n)]


def check_accounting(eng):
    """Device pages mapped == the pages of the cached blocks; tier bytes == entries x
    block bytes, within the bound."""
    c, pc = eng.cache, eng.prefix_cache
    assert c.num_used_blocks == pc.num_cached_blocks
    pages = {c.page_of(b) for b in pc.cached_blocks()}
    assert c.num_mapped_pages == len(pages)
    hc = eng.kv.host_cache
    if hc is not None:
        s = hc.stats()
        assert s["bytes"] == s["entries"] * hc.store.slot_bytes <= s["capacity_bytes"]
        assert s["entries"] <= s["capacity_blocks"]


def run_rounds(host_tokens, params, pages=40):  # params: one per prefix
    """Two rounds of prompts on 3 shared prefixes; a bound of 64 cached tokens evicts
    most of round 1's blocks before round 2 asks for them again."""
    pool = small_pool(pages)
    eng = Engine(
        build_model(LLAMA, seed=3), pool, max_batch=4, max_num_batched_tokens=32,
        max_cached_tokens=64, host_cache_tokens=host_tokens,
    )  # fmt: skip
    heads = [prompts(10 + i, 1, 70, [])[0] for i in range(3)]
    outs = []
    for r in range(2):
        ps = [h + [200 + r, 201 + i] for i, h in enumerate(heads)]
        outs += [o.token_ids for o in eng.generate(ps, params)]
        check_accounting(eng)
    stats = eng.stats()
    eng.close()
    assert pool.stats()["mapped_pages"] == 0
    pool.close()
    return outs, stats


def test_outputs_are_identical_with_the_tier_on_and_off():
    """Greedy and seeded requests side by side."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_k=50, seed=11, ignore_eos=True)
    params = [greedy, seeded, greedy]
    off, s_off = run_rounds(0, params)
    on, s_on = run_rounds(4096, params)
    assert on == off
    assert s_off["host_cache"] is None
    hc = s_on["host_cache"]
    # round 2 found every prefix block (4 per prompt), most of them on the host
    assert s_on["prefix_cache"]["hits_tokens"] + hc["hits_tokens"] == 3 * 64
    assert s_off["prefix_cache"]["hits_tokens"] < 3 * 64
    assert hc["restores"] >= 2
    assert (
        hc["bytes_from_host"]
        == hc["restored_blocks"] * hc["capacity_bytes"] // hc["capacity_blocks"]
    )


def test_a_restored_block_is_byte_identical_to_the_evicted_one():
    pool = small_pool(40)
    eng = Engine(
        build_model(LLAMA, seed=3),
        pool,
        max_batch=2,
        max_num_batched_tokens=32,
        host_cache_tokens=1024,
    )
    p = prompts(1, 1, 70, [])[0]
    eng.generate([p + [5]], SamplingParams(max_tokens=2))
    hs = hash_blocks(p, BS, extra_key_bytes(eng.name, None, None))
    pc = eng.prefix_cache
    view = np.asarray(eng.cache.view)
    evicted = {h: block_bytes(view, pc.block_of(h)) for h in hs}
    assert len(evicted) == 4
    assert pc.evict(100) >= 4 and all(pc.block_of(h) is None for h in hs)
    assert eng.cache.num_mapped_pages == 0  # their pages are gone
    hc = eng.kv.host_cache
    for h in hs:
        assert hc.store.read_slot(hc.slot_of(h)) == evicted[h]
    out = eng.generate([p + [6]], SamplingParams(max_tokens=2))[0]
    assert out.cached_tokens == 64 and hc.restores == 1
    view = np.asarray(eng.cache.view)
    for h in hs:
        assert block_bytes(view, pc.block_of(h)) == evicted[h]
    check_accounting(eng)
    eng.close()
    pool.close()


def test_tiers_keep_tenants_and_salts_apart():
    pool = small_pool(40)
    eng = Engine(build_model(LLAMA, seed=3), pool, max_batch=2, host_cache_tokens=1024)
    p = prompts(2, 1, 70, [])[0]
    eng.generate([p + [1]], SamplingParams(max_tokens=2), cache_salt="alice")
    eng.prefix_cache.evict(100)
    assert eng.kv.host_cache.num_entries == 4
    out = eng.generate([p + [2]], SamplingParams(max_tokens=2), cache_salt="bob")[0]
    assert out.cached_tokens == 0 and eng.kv.host_cache.restores == 0
    out = eng.generate([p + [3]], SamplingParams(max_tokens=2), cache_salt="alice")[0]
    assert out.cached_tokens == 64 and eng.kv.host_cache.restores == 1
    # resetting the prefix cache forgets the tier too
    eng.reset_prefix_cache()
    assert eng.kv.host_cache.num_entries == 0
    out = eng.generate([p + [4]], SamplingParams(max_tokens=2), cache_salt="alice")[0]
    assert out.cached_tokens == 0
    check_accounting(eng)
    eng.close()
    # no prefix caching (or a bound of 0): no tier
    for kw in ({"prefix_caching": False}, {"max_cached_tokens": 0}):
        e = Engine(build_model(LLAMA, seed=3), pool, host_cache_tokens=1024, **kw)
        assert e.stats()["host_cache"] is None
        e.close()
    with pytest.raises(ValueError, match="host_cache_tokens must be >= 0"):
        Engine(build_model(LLAMA, seed=3), pool, host_cache_tokens=-1)
    assert pool.stats()["mapped_pages"] == 0 and not pool.caches
    pool.close()


def test_an_idle_tenant_restores_what_a_busy_tenant_reclaimed():
    """Tenant a's idle prefixes are taken by b's burst; with a tier a's next requests
    restore them (same tokens as recomputing them) and b never preempts."""
    results = {}
    for host in (0, 2048):
        pool = small_pool(48)
        a = Engine(
            build_model(LLAMA, seed=1), pool, name="a", max_batch=4, max_cached_tokens=-1,
            host_cache_tokens=host,
        )  # fmt: skip
        b = Engine(build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2), pool, name="b", max_batch=4)
        heads = [prompts(20 + i, 1, 64, [])[0] for i in range(3)]
        greedy = SamplingParams(max_tokens=4, ignore_eos=True)
        a.generate([h + [1] for h in heads], greedy)
        held = a.cache.num_mapped_pages
        b.generate(prompts(5, 4, 150, []), greedy)  # the burst reclaims a's idle pages
        assert a.cache.num_mapped_pages < held and b.num_preemptions == 0
        hits_before = a.prefix_cache.hits + (a.kv.host_cache.hits_tokens if host else 0)
        outs = a.generate([h + [2] for h in heads], greedy)
        hc = a.stats()["host_cache"]
        hits = a.prefix_cache.hits + (hc["hits_tokens"] if host else 0) - hits_before
        results[host] = ([o.token_ids for o in outs], hits)
        for e in (a, b):
            check_accounting(e)
            e.close()
        assert pool.stats()["mapped_pages"] == 0
        pool.close()
    assert results[0][0] == results[2048][0]
    assert results[2048][1] == 3 * 64 > results[0][1]  # every prefix block, from the host


def test_a_tensor_parallel_engine_restores_from_the_tier():
    pool = tp_pool(2, "64MiB", min_reserved_pages=0, max_reserved_pages=0)
    outs = {}
    for host in (0, 1024):
        eng = Engine(build_model(LLAMA, seed=3), pool, name=f"h{host}", host_cache_tokens=host)
        p = prompts(3, 1, 70, [])[0]
        first = eng.generate([p + [1]], SamplingParams(max_tokens=3, ignore_eos=True))
        eng.prefix_cache.evict(100)
        out = eng.generate([p + [2]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        outs[host] = (first[0].token_ids, out.token_ids)
        if host:
            assert out.cached_tokens == 64 and eng.kv.host_cache.restores == 1
            assert eng.kv.host_cache.store.slot_bytes == 2 * 8 * eng.cache.block_bytes
        check_accounting(eng)
        eng.close()
    assert outs[0] == outs[1024]
    pool.close()


def test_a_chain_split_between_device_and_tier_is_restored_in_place():
    """Page-aware eviction can take a chain's middle: the request matches the device
    blocks around it and restores the middle from the host tier."""
    pool = small_pool(40)
    outs = {}
    for host in (0, 1024):
        eng = Engine(build_model(LLAMA, seed=3), pool, name=f"e{host}", host_cache_tokens=host)
        p = prompts(4, 1, 70, [])[0]
        greedy = SamplingParams(max_tokens=3, ignore_eos=True)
        first = eng.generate([p + [1]], greedy)[0]
        pc = eng.prefix_cache
        hs = hash_blocks(p, BS, extra_key_bytes(eng.name, None, None))
        blocks = [pc.block_of(h) for h in hs]
        view = np.asarray(eng.cache.view)
        middle = block_bytes(view, blocks[1])
        for b in (blocks[0], blocks[2], blocks[3]):
            pc.policy.touch(b)  # block 1 becomes the least recently used
        assert pc.evict(1, page_aware=False) == 1 and pc.block_of(hs[1]) is None
        out = eng.generate([p + [2]], greedy)[0]
        outs[host] = (first.token_ids, out.token_ids)
        if host:
            assert out.cached_tokens == 64
            hc = eng.kv.host_cache
            assert hc.restores == 1 and hc.restored_blocks == 1
            assert [pc.block_of(h) for h in hs][::2] == blocks[::2]  # matched in place
            view = np.asarray(eng.cache.view)
            assert block_bytes(view, pc.block_of(hs[1])) == middle
        else:
            assert out.cached_tokens == 16  # only the head: the chain breaks at the gap
        check_accounting(eng)
        eng.close()
    assert outs[0] == outs[1024]
    pool.close()
