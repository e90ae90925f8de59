"""Per-tenant memory limits and guarantees, cross-tenant reclaim, engines sharing a pool."""

import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

PAGE = 16384


def small_pool(pages=48, reserve=0):
    return kv.Pool(
        pages * PAGE,
        page_size=PAGE,
        backend="host",
        min_reserved_pages=0,
        max_reserved_pages=reserve,
    )


def cache(pool, name, layers=2, **kw):
    # 2 layers x 4 heads x 64 fp32: 1 KiB per token and plane -> 16 tokens (1 block) per
    # 16 KiB page; a KV page is 4 physical pages.
    return pool.create_kv_cache(name, layers, 4, 64, "float32", block_size=16, **kw)


def mapped(c):
    return c.num_mapped_pages * c.pages_per_kv_page


def test_limit_caps_growth_and_reports_rounding():
    pool = small_pool()
    a = cache(pool, "a")
    r = pool.set_memory_limit("a", 10 * PAGE)  # 10 pages -> 2 whole KV pages (8 pages)
    assert r.limit_bytes == 8 * PAGE and r.applied and r.over_limit_bytes == 0
    assert a.num_free_blocks == 2  # one block per page; page 0 (the null block) is never mapped
    a.alloc(2)
    with pytest.raises(kv.PoolExhausted):
        a.alloc(1)
    assert mapped(a) == 8  # the failed alloc mapped nothing
    pool.set_memory_limit("a", None)
    assert a.num_free_blocks == 48 // 4 - 1 - 2
    pool.close()


def test_limit_below_use_drains_and_blocks_growth():
    pool = small_pool()
    a = cache(pool, "a")
    ids = a.alloc(5)  # 6 KV pages with the null block's page
    r = pool.set_memory_limit("a", 8 * PAGE)
    assert not r.applied
    assert r.mapped_bytes == mapped(a) * PAGE
    assert r.over_limit_bytes == (mapped(a) - 8) * PAGE > 0
    assert a.over_limit_pages == mapped(a) - 8
    assert a.num_free_blocks == 0
    with pytest.raises(kv.PoolExhausted):
        a.alloc(1)
    a.free(ids[1:])  # leaves pages 0 and 1: 8 pages
    assert pool.memory_limits()["a"].applied
    assert a.over_limit_pages == 0
    pool.close()


def test_bad_limits_are_clear_errors():
    pool = small_pool()
    cache(pool, "a")
    cache(pool, "b")
    with pytest.raises(KeyError, match="no KV cache named 'zz'"):
        pool.set_memory_limit("zz", PAGE)
    with pytest.raises(ValueError, match=">= 0"):
        pool.set_memory_limit("a", -1)
    with pytest.raises(ValueError, match="cannot parse"):
        pool.set_memory_limit("a", "lots")
    pool.set_memory_guarantee("a", 20 * PAGE)
    with pytest.raises(ValueError, match="below its guarantee"):
        pool.set_memory_limit("a", 8 * PAGE)
    with pytest.raises(ValueError, match="more than the pool budget"):
        pool.set_memory_guarantee("b", 32 * PAGE)
    with pytest.raises(ValueError, match="exceeds its limit"):
        pool.set_memory_limit("b", 8 * PAGE)
        pool.set_memory_guarantee("b", 12 * PAGE)
    # nothing above changed a's settings
    lim = pool.memory_limits()["a"]
    assert lim.guarantee_bytes == 20 * PAGE and lim.limit_bytes is None
    with pytest.raises(ValueError, match="exceeds its limit"):
        cache(pool, "c", memory_limit=4 * PAGE, memory_guarantee=8 * PAGE)
    assert "c" not in pool.caches  # a failed create leaves nothing behind
    pool.close()


def test_guarantee_is_held_back_from_other_tenants():
    pool = small_pool()
    a = cache(pool, "a")
    b = cache(pool, "b", memory_guarantee=16 * PAGE)  # 4 KV pages
    assert a.num_free_blocks == (48 - 16) // 4
    a.alloc(a.num_free_blocks)
    with pytest.raises(kv.PoolExhausted):
        a.alloc(1)
    assert len(b.alloc(4)) == 4  # b's 16 pages are there
    pool.close()


def test_guarantee_set_late_reports_shortfall_and_stops_others():
    pool = small_pool()
    a = cache(pool, "a")
    cache(pool, "b")
    ids = a.alloc(11)  # 11 KV pages: 44 of the 48 pages
    r = pool.set_memory_guarantee("b", 8 * PAGE)
    assert r.guarantee_shortfall_bytes == 4 * PAGE and not r.applied
    a.free(ids[:4])  # 4 KV pages back: 20 free pages
    assert a.num_free_blocks == (20 - 8) // 4  # b's 8 pages are held back from a
    assert pool.memory_limits()["b"].applied
    pool.close()


def test_pages_move_between_tenants_without_new_creates():
    pool = small_pool(reserve=64)  # keep freed pages created for reuse
    a, b = cache(pool, "a"), cache(pool, "b")
    ids = a.alloc(11)
    a.view  # noqa: B018 - touch the view
    creates = pool.stats()["creates"]
    for _ in range(3):
        a.free(ids)
        idb = b.alloc(11)
        b.free(idb)
        ids = a.alloc(11)
    s = pool.stats()
    assert s["creates"] == creates and s["reuses"] > 0
    pool.close()


# -- engines sharing a pool ----------------------------------------------------------

QWEN = BUILTIN_CONFIGS["tiny-qwen2"]  # 3 layers x 1 KV head x 32: 8 blocks per 16 KiB page
LLAMA = BUILTIN_CONFIGS["tiny-llama"]  # 4 layers x 2 KV heads x 32: 4 blocks per page
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def prompts(seed, n, length):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, size=length).tolist() for _ in range(n)]


def alone(cfg, seed, ps, pages=64):
    pool = small_pool(pages)
    eng = Engine(build_model(cfg, seed=seed), pool, name="alone", max_batch=4)
    out = [o.token_ids for o in eng.generate(ps, GREEDY)]
    pool.close()
    return out


def test_idle_tenants_cached_prefix_is_reclaimed_before_preemption():
    pool = small_pool(48)  # 48 pages: 8 qwen KV pages (64 blocks) or 6 llama KV pages
    a = Engine(build_model(QWEN, seed=1), pool, name="a", max_batch=4, max_cached_tokens=-1)
    b = Engine(build_model(LLAMA, seed=2), pool, name="b", max_batch=4)
    pa = prompts(0, 4, 100)
    a.generate(pa, GREEDY)  # a now holds its prompts' blocks in its prefix cache
    held = mapped(a.cache)
    assert held > 0 and a.prefix_cache.num_evictable_blocks > 0
    pb = prompts(1, 4, 40)  # b needs more than is free
    out_b = [o.token_ids for o in b.generate(pb, GREEDY)]
    assert a.prefix_cache.evictions > 0 and mapped(a.cache) < held
    assert b.scheduler.num_preemptions == 0
    assert out_b == alone(LLAMA, 2, pb)
    # exact accounting: what is mapped is what the prefix caches hold
    for e in (a, b):
        held_blocks = e.prefix_cache.num_cached_blocks
        assert e.cache.num_used_blocks == held_blocks
    a.close(), b.close()
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def prefill(eng, n):
    """Steps until n sequences run with their prompts computed (a prefill step takes at
    most ``prefill_chunk`` tokens in all)."""
    sched = eng.scheduler
    while len(sched.running) < n or any(s.num_computed < s.num_prompt for s in sched.running):
        eng.step()


def test_waiting_tenant_runs_when_the_other_frees_and_run_does_not_hang():
    pool = small_pool(48)
    a = Engine(
        build_model(QWEN, seed=1),
        pool,
        name="a",
        max_batch=4,
        max_num_batched_tokens=256,
        prefix_caching=False,
    )
    b = Engine(build_model(LLAMA, seed=2), pool, name="b", max_batch=4, prefix_caching=False)
    pa, pb = prompts(2, 4, 180), prompts(3, 2, 60)
    for p in pa:
        a.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    prefill(a, 4)  # a's prompts take 4 x 12 blocks: 6 of the 8 KV pages
    rids = [b.add_request(p, GREEDY) for p in pb]
    assert b.dispatch() is None  # not enough memory now, but it would fit: it waits
    assert b.scheduler.waiting and not b.scheduler.running
    with pytest.raises(kv.PoolExhausted, match="held by other tenants"):
        b.run()
    a.run()
    b.run()
    done = {s.request_id: s.output for s in b.drain_finished()}
    assert [done[r] for r in rids] == alone(LLAMA, 2, pb)
    pool.close()


def test_engine_gives_back_memory_above_a_lowered_limit_and_outputs_stay():
    pool = small_pool(96)
    eng = Engine(build_model(QWEN, seed=1), pool, name="a", max_batch=4, max_cached_tokens=-1)
    ps = prompts(4, 4, 70)
    for p in ps:
        eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    prefill(eng, 4)
    before = mapped(eng.cache)
    r = pool.set_memory_limit("a", 12 * PAGE)  # 2 KV pages: room for 2 sequences
    assert r.over_limit_bytes == (before - 12) * PAGE > 0
    eng.step()
    assert mapped(eng.cache) <= 12
    assert eng.scheduler.num_preemptions > 0
    eng.run()
    assert mapped(eng.cache) <= 12
    out = {s.request_id: s.output for s in eng.drain_finished()}
    ref = alone(QWEN, 1, ps, pages=96)
    assert [out[i][:6] for i in range(4)] == ref
    pool.close()


def test_request_over_the_tenant_capacity_fails_alone():
    pool = small_pool(48)
    eng = Engine(build_model(QWEN, seed=1), pool, name="a", max_batch=2, memory_limit=6 * PAGE)
    with pytest.raises(kv.PoolExhausted, match="can hold at most 7"):
        eng.generate([list(range(1, 140))], GREEDY)
    assert not eng.has_work
    out = eng.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.token_ids) == 6
    pool.close()
