"""Prefix caching: hashing, the bounded page-aware LRU cache, and engine integration."""

import pytest
from conftest import hold_prefix
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.prefix_cache import PrefixCache, extra_key_bytes, hash_blocks
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

BS = 16


def _cache(pool_pages=48, layers=1, name="c"):
    # 64 KiB pages, 2 KiB blocks (16 x 1 head x 32 x 4 B): 32 blocks per page.
    pool = kv.Pool(
        pool_pages * 65536,
        page_size=65536,
        backend="host",
        min_reserved_pages=0,
        max_reserved_pages=0,
    )
    return pool, pool.create_kv_cache(name, layers, 1, 32, "float32", block_size=BS)


def test_hashes_are_chained_full_block_and_keyed():
    extra = extra_key_bytes("m", None, None)
    toks = list(range(40))
    hs = hash_blocks(toks, BS, extra)
    assert len(hs) == 2  # the partial third block is not hashed
    assert hash_blocks(toks[:32], BS, extra) == hs
    changed = hash_blocks([99] + toks[1:], BS, extra)
    assert changed[0] != hs[0] and changed[1] != hs[1]  # a change propagates down the chain
    assert hash_blocks(toks, BS, extra_key_bytes("m", "salt", None))[0] != hs[0]
    assert hash_blocks(toks, BS, extra_key_bytes("other", None, None))[0] != hs[0]
    assert hash_blocks(toks, BS, extra_key_bytes("m", None, "lora-1"))[0] != hs[0]
    assert len(hs[0]) == 32  # sha256


def test_bound_semantics():
    toks = list(range(64))  # 4 full blocks
    for bound, kept in ((-1, 4), (0, 0), (32, 2), (1000, 4)):
        pool, c = _cache()
        pc = PrefixCache(c, bound)
        blocks = hold_prefix(pc, c, toks)
        assert pc.num_cached_blocks == (0 if bound == 0 else 4)
        pc.pool.free_blocks(blocks)
        assert pc.num_evictable_blocks == kept
        assert c.num_used_blocks == kept  # the rest went back to the cache at once
        again = pc.match(hash_blocks(toks, BS, b""))
        assert (
            len(again) == (kept if bound in (-1, 1000) else 0 if bound == 0 else 0) or bound == 32
        )
        if bound == 32:
            # The two kept blocks are the chain's head: its tail was evicted first.
            assert again == blocks[:2]
        pool.close()


def test_ref_counts_and_sharing():
    pool, c = _cache()
    pc = PrefixCache(c, -1)
    a = hold_prefix(pc, c, list(range(48)))
    b = hold_prefix(pc, c, list(range(40)))  # shares a's first two blocks
    assert b[:2] == a[:2] and b[2] != a[2]
    assert pc.ref_count(a[0]) == 2 and pc.ref_count(a[2]) == 1
    pc.pool.free_blocks(a)
    assert pc.ref_count(a[0]) == 1 and pc.num_evictable_blocks == 1  # a's third block
    assert pc.evict(10) == 1  # only idle blocks can go
    pc.pool.free_blocks(b)
    assert pc.ref_count(a[0]) == 0
    with pytest.raises(ValueError, match="released more often"):
        pc.pool.free_blocks(b[:1])
    assert pc.reset() == 2 and c.num_used_blocks == 0
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_page_aware_eviction_frees_whole_pages():
    """kvcached's stride-8 case: idle cached blocks of many requests interleave across pages.
    Freeing the same number of blocks, LRU empties almost no page; page-aware empties pages."""
    results = {}
    for page_aware in (False, True):
        pool, c = _cache(pool_pages=64)
        pc = PrefixCache(c, -1)
        bpp = c.blocks_per_page
        seqs = [hold_prefix(pc, c, [1000 + i] + [i] * (BS * 8 - 1)) for i in range(8 * 4)]
        # Request i's 8 blocks are interleaved with the others' in allocation order? Make
        # them so: release in an order where LRU age runs across pages (stride 8).
        for s in seqs:
            pc.pool.free_blocks(s)
        for blocks in zip(*seqs, strict=True):  # touch in stride order: LRU runs across pages
            for b in blocks:
                pc.policy.touch(b)
        before = pool.stats()["mapped_pages"]
        pc.evict(2 * bpp, page_aware=page_aware)
        results[page_aware] = before - pool.stats()["mapped_pages"]
        pool.close()
    assert results[True] >= 2 and results[True] > 4 * results[False], results


def test_isolation_by_salt_and_tenant():
    pool, c = _cache()
    pc = PrefixCache(c, -1)
    toks = list(range(33))
    blocks = hold_prefix(pc, c, toks, extra_key_bytes("a", None, None))
    pc.pool.free_blocks(blocks)
    for extra in (extra_key_bytes("a", "s1", None), extra_key_bytes("b", None, None)):
        assert pc.match(hash_blocks(toks, BS, extra)) == []
    assert len(pc.match(hash_blocks(toks, BS, extra_key_bytes("a", None, None)))) == 2
    pool.close()


class PrefixCacheMachine(RuleBasedStateMachine):
    """Against a reference model: the bound holds at every step, refs equal the holders,
    no block is both free and cached, and page accounting is exact."""

    @initialize(bound=st.sampled_from([-1, 0, 16, 64, 160]))
    def setup(self, bound):
        self.pool, self.c = _cache(pool_pages=12)
        self.pc = PrefixCache(self.c, bound)
        self.held: list[list[int]] = []  # the reference: live sequences' blocks

    def teardown(self):
        if hasattr(self, "pool"):
            self.pool.close()

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 90), tail=st.integers(0, 5))
    def acquire(self, prefix, length, tail):
        toks = [prefix] * min(length, 48) + [100 + tail] * max(0, length - 48)
        try:
            self.held.append(hold_prefix(self.pc, self.c, toks))
        except kv.PoolExhausted:
            hs = hash_blocks(toks, BS, b"")
            # A failed sequence gives back what it matched (like a failed admission).
            self.pc.pool.free_blocks(self.pc.match(hs))
            self.pc.evict(8)

    @rule(i=st.integers(0, 50))
    def release(self, i):
        if self.held:
            self.pc.pool.free_blocks(self.held.pop(i % len(self.held)))

    @rule(n=st.integers(1, 40), page_aware=st.booleans())
    def evict(self, n, page_aware):
        idle = self.pc.num_evictable_blocks
        got = self.pc.evict(n, page_aware=page_aware)
        assert got >= min(n, idle) and got <= idle

    @invariant()
    def consistent(self):
        if not hasattr(self, "pc"):
            return
        pc, c = self.pc, self.c
        if pc.max_cached_tokens >= 0:
            assert pc.num_evictable_blocks * BS <= pc.max_cached_tokens
        refs: dict[int, int] = {}
        for blocks in self.held:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        for b in pc.cached_blocks():
            assert pc.ref_count(b) == refs.get(b, 0) >= 0
            assert c.is_allocated(b)  # never both free and cached
            assert pc.is_evictable(b) == (pc.ref_count(b) == 0)
        assert all(pc.pool.ref_count(b) == n for b, n in refs.items())  # one count each
        pc.pool.check()
        live = set(refs) | set(pc.cached_blocks())
        assert c.num_used_blocks == len(live)
        pages = {b // c.blocks_per_page for b in live}
        assert set(c.mapped_page_ids()) == pages
        assert self.pool.stats()["mapped_pages"] == len(pages) * c.pages_per_kv_page


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_machine = PrefixCacheMachine.TestCase


SYSTEM = [256, *([7] * 40), *range(30, 60)]  # 71 tokens: 4 full shared blocks


def _engine(caching, bound=None, seed=5):
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=seed)
    pool = kv.Pool("128MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    return pool, Engine(
        model,
        pool,
        max_batch=4,
        max_num_batched_tokens=32,
        prefix_caching=caching,
        max_cached_tokens=bound,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=3, ignore_eos=True),
    ],
)
def test_outputs_identical_with_and_without_the_cache(params):
    prompts = [SYSTEM + [100 + i, 101, 102] for i in range(4)]
    outs = {}
    for caching in (False, True):
        pool, eng = _engine(caching)
        first = eng.generate(prompts[:2], params)
        second = eng.generate(prompts[2:], params)  # warm: the system prompt is cached
        outs[caching] = [o.token_ids for o in first + second]
        if caching:
            assert all(o.cached_tokens == 64 for o in second)
            s = eng.prefix_cache.stats()
            assert s["hits_tokens"] >= 2 * 64 and 0 < s["hit_rate"] < 1
            assert eng.stats()["prefix_cache"]["cached_blocks"] > 0
        else:
            assert all(o.cached_tokens == 0 for o in second)
        pool.close()
    assert outs[True] == outs[False]


def test_salted_requests_do_not_share():
    pool, eng = _engine(True)
    p = SamplingParams(max_tokens=2)
    eng.generate([SYSTEM + [1]], p, cache_salt="alice")
    out = eng.generate([SYSTEM + [2]], p, cache_salt="bob")[0]
    assert out.cached_tokens == 0
    out = eng.generate([SYSTEM + [3]], p, cache_salt="alice")[0]
    assert out.cached_tokens == 64
    pool.close()


def test_bound_zero_disables_reuse_and_frees_at_once():
    pool, eng = _engine(True, bound=0)
    eng.generate([SYSTEM + [1], SYSTEM + [2]], SamplingParams(max_tokens=3))
    out = eng.generate([SYSTEM + [3]], SamplingParams(max_tokens=3))[0]
    assert out.cached_tokens == 0
    assert eng.prefix_cache.num_cached_blocks == 0
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_cached_prefixes_are_evicted_under_pressure_before_preempting():
    model = build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2)
    # One KV page of 7 usable 2 KiB blocks (see test_engine): tight.
    pool = kv.Pool(
        6 * 16384, page_size=16384, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16, max_cached_tokens=-1)
    eng.generate([list(range(1, 50))], SamplingParams(max_tokens=2))
    assert eng.prefix_cache.num_cached_blocks == 3
    eng.generate([list(range(200, 280))], SamplingParams(max_tokens=4))  # needs 6 blocks
    assert eng.prefix_cache.evictions > 0 and eng.scheduler.num_preemptions == 0
    pool.close()


def test_bound_defaults_to_the_environment_and_metrics_are_logged(caplog):
    import logging

    from jax_kvcached.memory.config import Config

    pool = kv.Pool("64MiB", backend="host", config=Config(max_cached_tokens=32))
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    eng = Engine(model, pool, log_every=1)
    assert eng.prefix_cache.max_cached_tokens == 32
    with caplog.at_level(logging.INFO, logger="jax_kvcached.engine.prefix_cache"):
        eng.generate([SYSTEM + [1]], SamplingParams(max_tokens=2))
    assert any("hit rate" in r.getMessage() for r in caplog.records)
    assert eng.prefix_cache.num_evictable_blocks * BS <= 32  # the bound holds
    assert eng.stats()["prefix_cache"]["cached_blocks"] == eng.prefix_cache.num_cached_blocks
    pool.close()
