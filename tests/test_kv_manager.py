"""The KV manager, the scheduler, the eviction policies and the tenant ledger, each on
its own (no model, no runner)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hold_prefix

import jax_kvcached as kv
from jax_kvcached.engine.eviction import LFUPolicy, LRUPolicy, make_policy
from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.prefix_cache import PrefixCache, hash_blocks
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.scheduler import Scheduler
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.ledger import LocalLedger

BS = 16
# 64 KiB pages, 2 KiB blocks (16 x 1 head x 32 x fp32): a KV page (one physical page for
# K and one for V of the one layer) holds 32 blocks; block 0 is never handed out.
PAGE = 65536
GREEDY = SamplingParams(max_tokens=4)


def make_pool(pages=8):
    return kv.Pool(
        pages * PAGE, page_size=PAGE, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )


def make_kv(pool, name="a", **kw):
    cache = pool.create_kv_cache(name, 1, 1, 32, "float32", block_size=BS)
    return KVManager(cache, max_model_len=4096, **kw)


def seq(rid, tokens, **kw):
    return Sequence(rid, list(tokens), kw.pop("params", GREEDY), **kw)


def run_to_end(kvm, s):
    """What the engine does for a prefilled sequence: blocks for every token, computed."""
    assert kvm.grow(s, s.num_tokens)
    kvm.computed(s, s.num_tokens)


def accounting_exact(kvm):
    """Mapped pages are exactly the pages of allocated blocks."""
    c = kvm.cache
    pages = {c.page_of(b) for b in range(1, c.num_blocks) if c.is_allocated(b)}
    assert set(c.mapped_page_ids()) == pages


# -- KV manager --------------------------------------------------------------------------
def test_admit_reuses_a_released_prefix_and_counts_cached_tokens():
    pool = make_pool()
    kvm = make_kv(pool, max_cached_tokens=-1)
    prompt = list(range(100))
    a = seq(0, prompt)
    assert kvm.admit(a) == 0  # nothing cached yet
    run_to_end(kvm, a)
    kvm.release(a)
    assert a.blocks == [] and kvm.prefix_cache.num_evictable_blocks == 6  # 96 / 16
    b = seq(1, prompt + [7])
    assert kvm.admit(b) == 96 and b.cached_tokens == 96 and len(b.blocks) == 6
    run_to_end(kvm, b)
    kvm.release(b)
    assert kvm.reset_prefix_cache() > 0
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_grow_evicts_own_idle_prefixes_before_signalling_preemption():
    pool = make_pool(pages=4)  # 2 KV pages: 31 + 32 usable blocks
    kvm = make_kv(pool, max_cached_tokens=-1)
    idle = seq(0, range(32 * BS))  # 32 blocks, all cached when released
    run_to_end(kvm, idle)
    kvm.release(idle)
    assert kvm.prefix_cache.num_evictable_blocks == 32
    busy = seq(1, [5] * (50 * BS))
    assert kvm.grow(busy, 50 * BS)  # takes the idle prefixes' memory
    assert kvm.prefix_cache.num_evictable_blocks < 32 and kvm.prefix_cache.evictions > 0
    accounting_exact(kvm)
    more = seq(2, [6] * (20 * BS))
    assert not kvm.grow(more, 20 * BS)  # nothing idle left: preempt someone
    kvm.release(busy)
    kvm.release(more)
    kvm.reset_prefix_cache()
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_grow_reclaims_other_tenants_idle_prefixes_above_their_guarantee():
    pool = make_pool(pages=8)  # 4 KV pages: 127 blocks
    a = make_kv(pool, "a", max_cached_tokens=-1)
    b = make_kv(pool, "b", max_cached_tokens=-1)
    pool.set_reclaimer("a", a.reclaim)
    s = seq(0, range(60 * BS))
    run_to_end(a, s)
    a.release(s)  # a holds 2 KV pages of idle prefixes
    assert a.cache.num_mapped_pages == 2
    t = seq(1, [3] * (100 * BS))
    assert b.grow(t, 100 * BS)  # needs 4 KV pages: a gives its idle ones back
    assert a.cache.num_mapped_pages == 0 and b.cache.num_mapped_pages == 4
    b.release(t)
    b.reset_prefix_cache()
    pool.set_memory_guarantee("a", 4 * PAGE)  # 2 KV pages
    s2 = seq(2, range(60 * BS))
    run_to_end(a, s2)
    a.release(s2)
    t2 = seq(3, [4] * (100 * BS))
    assert not b.grow(t2, 100 * BS)  # a's idle pages are within its guarantee now
    assert a.cache.num_mapped_pages == 2
    b.release(t2)
    pool.close()


def test_admit_rejects_what_can_never_fit_and_waits_for_what_can():
    pool = make_pool(pages=2)  # 1 KV page: 31 blocks
    kvm = make_kv(pool)
    with pytest.raises(kv.PoolExhausted, match="can hold at most 31"):
        kvm.admit(seq(0, range(100 * BS)))
    big = seq(1, [7] * (20 * BS))
    run_to_end(kvm, big)  # 20 blocks held by a running sequence
    assert kvm.admit(seq(2, range(15 * BS))) is None  # 16 blocks: later, not now
    kvm.release(big)
    assert kvm.admit(seq(3, range(15 * BS))) == 0
    pool.close()


def test_the_fence_orders_unmaps_after_the_last_step():
    pool = make_pool()
    kvm = make_kv(pool, prefix_caching=False)
    s = seq(0, range(40))
    run_to_end(kvm, s)
    fence = jnp.arange(1000.0).sum()  # stands for the last dispatched step's output
    kvm.set_fence(fence)
    kvm.release(s)
    assert pool.stats()["mapped_pages"] == 0
    assert float(fence) == 499500.0
    pool.close()


def test_shrink_to_limit_evicts_idle_prefixes_then_asks_for_preemption():
    pool = make_pool()
    kvm = make_kv(pool, max_cached_tokens=-1)
    idle = seq(0, range(40 * BS))
    run_to_end(kvm, idle)
    kvm.release(idle)
    held = seq(1, [9] * (70 * BS))
    run_to_end(kvm, held)
    assert kvm.cache.num_mapped_pages == 4
    pool.set_memory_limit("a", 4 * PAGE)  # 2 KV pages
    assert not kvm.shrink_to_limit()  # idle prefixes went, the running one is too big
    assert kvm.prefix_cache.num_evictable_blocks == 0
    kvm.release(held)
    kvm.reset_prefix_cache()
    assert kvm.shrink_to_limit()
    pool.close()


# -- scheduler ---------------------------------------------------------------------------
class FakeKV:
    """A KV manager of ``capacity`` blocks and no prefix cache: the scheduler alone."""

    block_size = BS

    def __init__(self, capacity: int, too_big: int = 10**9) -> None:
        self.capacity, self.used, self.too_big = capacity, 0, too_big
        self.released: list[int] = []

    def blocks(self, n: int) -> int:
        return -(-n // BS)

    def admit(self, s):
        need = self.blocks(s.num_tokens + 1)
        if need > self.too_big:
            raise kv.PoolExhausted(f"request {s.request_id} can never fit")
        return 0 if need <= self.capacity - self.used else None

    def grow(self, s, n):
        need = self.blocks(n) - len(s.blocks)
        if need > self.capacity - self.used:
            return False
        s.blocks += [0] * max(need, 0)
        self.used += max(need, 0)
        return True

    def release(self, s):
        self.used -= len(s.blocks)
        self.released.append(s.request_id)
        s.blocks = []

    def computed(self, s, n):
        s.num_computed = n

    def shrink_to_limit(self):
        return True


def test_scheduler_admits_in_order_and_chunks_prompts_within_the_token_budget():
    fake = FakeKV(capacity=100)
    sch = Scheduler(fake, max_batch=2, max_num_batched_tokens=32, max_model_len=4096)
    for i in range(3):
        sch.add(seq(i, range(40)))
    out = sch.schedule()
    # Two admitted (max_batch); the first prompt's chunk takes the whole budget.
    assert [s.request_id for s in out.sequences] == [0]
    assert [x.num_tokens for x in out.scheduled] == [32]
    assert [s.request_id for s in sch.running] == [0, 1]
    assert [s.request_id for s in sch.waiting] == [2]
    for s, x in zip(out.sequences, out.scheduled, strict=True):
        fake.computed(s, x.start + x.num_tokens)
    out = sch.schedule()  # the rest of the first, then the second's chunk fills the budget
    assert [s.request_id for s in out.sequences] == [0, 1]
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(32, 8), (0, 24)]


def test_scheduler_puts_every_decode_first_and_fills_the_budget_with_a_chunk():
    """A long prompt never stalls running streams: each step holds every decode row
    (one token each) and a chunk of the prompt in the rest of the budget."""
    fake = FakeKV(capacity=1000)
    sch = Scheduler(fake, max_batch=4, max_num_batched_tokens=16, max_model_len=4096,
                    max_prefill_tokens=64)  # fmt: skip
    streams = [seq(i, range(5)) for i in range(2)]
    for s in streams:
        sch.add(s)
    out = sch.schedule()
    for s, x in zip(out.sequences, out.scheduled, strict=True):
        fake.computed(s, x.start + x.num_tokens)
        s.token_ids.append(7)  # its first token arrived: it decodes now
    sch.add(seq(9, range(100)))  # a long prompt arrives
    chunks: list[int] = []
    while sum(chunks) < 60:
        out = sch.schedule()
        ids = [s.request_id for s in out.sequences]
        assert ids == [0, 1, 9]  # the streams first, one token each, then the prompt
        assert [x.num_tokens for x in out.scheduled[:2]] == [1, 1]
        assert sum(x.num_tokens for x in out.scheduled) <= 16
        for s, x in zip(out.sequences, out.scheduled, strict=True):
            fake.computed(s, x.start + x.num_tokens)
            if s.request_id < 2:
                s.token_ids.append(7)
        chunks.append(out.scheduled[2].num_tokens)
    assert chunks == [14] * 5  # budget 16 - 2 decode rows
    for s in streams:
        sch.finish(s, "stop")
    out = sch.schedule()  # no stream decodes: the prompt takes the prefill budget
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(70, 30)]


def test_scheduler_takes_its_decode_budget_by_the_decode_rows():
    """A step with D decode rows takes ``decode_budget(D)`` tokens: one stream gets a
    15-token chunk beside it, eight streams a 40-token one (the pacer's seam)."""
    for streams, chunk in ((1, 15), (8, 40)):
        fake = FakeKV(capacity=1000)
        sch = Scheduler(fake, max_batch=9, max_num_batched_tokens=64, max_model_len=4096,
                        max_prefill_tokens=256,
                        decode_budget=lambda d: (16 + 4 * d) // 16 * 16)  # fmt: skip
        for i in range(streams):
            s = seq(i, range(3))
            fake.computed(s, 2)  # it decodes
            sch.running.append(s)
        sch.add(seq(99, range(500)))
        out = sch.schedule()
        assert [x.num_tokens for x in out.scheduled] == [1] * streams + [chunk]
        assert out.num_decodes == streams


def test_a_short_prompt_is_not_held_behind_a_long_ones_chunks():
    """Prompts with the fewest tokens left take the step's chunk first: a 3-token request
    arriving while a 6000-token prompt prefills is computed in the next step, beside the
    stream's decode row, and the long prompt keeps what it leaves."""
    fake = FakeKV(capacity=1000)
    sch = Scheduler(fake, max_batch=4, max_num_batched_tokens=16, max_model_len=8192)
    stream = seq(0, range(3))
    fake.computed(stream, 2)
    sch.running.append(stream)
    long = seq(1, range(6000))
    sch.add(long)
    out = sch.schedule()
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [(0, 1), (1, 15)]
    for x in out.scheduled:
        fake.computed(x.seq, x.end)
    short = seq(2, range(3))
    sch.add(short)
    out = sch.schedule()
    assert [(x.seq.request_id, x.num_tokens) for x in out.scheduled] == [(0, 1), (2, 3), (1, 12)]


def test_scheduler_preempts_the_newest_when_memory_runs_out():
    fake = FakeKV(capacity=7)
    sch = Scheduler(fake, max_batch=4, max_num_batched_tokens=64, max_model_len=4096)
    a, b = seq(0, range(47)), seq(1, range(47))  # 3 blocks each with the next token
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    for s, x in zip(out.sequences, out.scheduled, strict=True):
        fake.computed(s, x.start + x.num_tokens)
    for s in (a, b):
        s.token_ids.append(1)  # the sampled token arrived: both decode now
    a.token_ids += [1] * 20  # a needs a fourth block and more
    a.num_computed = len(a.token_ids) - 1
    out = sch.schedule()
    assert b.preemptions == 1 and list(sch.waiting) == [b] and fake.released == [1]
    assert [s.request_id for s in out.sequences] == [0]
    assert b.num_computed == 0  # recomputed from its tokens when readmitted


def test_scheduler_reports_rejections_and_goes_on():
    fake = FakeKV(capacity=100, too_big=5)
    sch = Scheduler(fake, max_batch=4, max_num_batched_tokens=64, max_model_len=4096)
    sch.add(seq(0, range(200)))  # 14 blocks: can never fit
    sch.add(seq(1, range(20)))
    out = sch.schedule()
    assert [s.request_id for s in out.rejected] == [0]
    assert out.rejected[0].finish_reason == "error"
    assert isinstance(out.rejected[0].error, kv.PoolExhausted)
    assert [s.request_id for s in out.sequences] == [1]


# -- eviction policies -------------------------------------------------------------------
def test_policies_by_name_and_a_clear_error():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_popular_prefix_survives_a_burst_only_under_lfu(policy):
    pool = make_pool()
    cache = pool.create_kv_cache("a", 1, 1, 32, "float32", block_size=BS)
    pc = PrefixCache(cache, 8 * BS, policy=policy)  # room for 8 idle blocks
    system = list(range(4 * BS))
    for _ in range(5):  # a popular system prompt, hit again and again
        pc.pool.free_blocks(hold_prefix(pc, cache, system))
    for i in range(8):  # then a burst of one-off prompts, 1 block each
        pc.pool.free_blocks(hold_prefix(pc, cache, [1000 + i] * BS))
    kept = pc.lookup(hash_blocks(system, BS, b""))
    assert kept == (4 if policy == "lfu" else 0)
    assert pc.num_evictable_blocks <= 8
    pc.reset()
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_lfu_evicts_a_chain_from_its_tail():
    p = LFUPolicy()
    for b in (1, 2, 3):
        p.on_insert(b)
    for b in (3, 2, 1):  # a chain's release order: tail first
        p.on_idle(b)
    assert list(p.order()) == [3, 2, 1]
    p.on_busy(1)
    p.on_hit(1)
    p.on_idle(1)
    assert list(p.order())[-1] == 1  # the hit one goes last


# -- the tenant ledger -------------------------------------------------------------------
class Usage:
    def __init__(self) -> None:
        self.pages = 0

    def __call__(self) -> int:
        return self.pages


def ledger(budget=10):
    used = {"a": Usage(), "b": Usage()}
    led = LocalLedger(4096, lambda: budget, lambda: sum(u() for u in used.values()))
    led.register("a", 2, used["a"])
    led.register("b", 2, used["b"])
    return led, used


def test_ledger_room_limits_and_guarantees():
    led, used = ledger()
    assert led.room_pages("a") == 10 and led.capacity_pages("a") == 10
    led.set_guarantee("b", 3 * 4096)  # rounded up to whole KV pages: 4 pages
    assert led.room_pages("a") == 6 and led.capacity_pages("a") == 6
    led.set_limit("a", 5 * 4096)  # rounded down: 4 pages
    assert led.room_pages("a") == 4
    used["a"].pages = 6
    assert led.over_limit_pages("a") == 2 and not led.limit_of("a").applied
    with pytest.raises(ValueError, match="below its guarantee"):
        led.set_limit("b", 0)
    led.set_guarantee("a", 4 * 4096)
    with pytest.raises(ValueError, match="more than the pool budget"):
        led.set_guarantee("b", 8 * 4096)
    with pytest.raises(KeyError, match="no KV cache named 'c'"):
        led.room_pages("c")
    with pytest.raises(ValueError, match="already registered"):
        led.register("a", 2, Usage())


def test_ledger_charge_is_atomic_with_its_check():
    led, used = ledger(budget=4)
    mapped = []

    def do_map(n):
        def f():
            mapped.append(n)
            used["a"].pages += n

        return f

    led.charge("a", 4, do_map(4))
    with pytest.raises(kv.PoolExhausted, match="2 pages needed, 0 within its room"):
        led.charge("a", 2, do_map(2))
    assert mapped == [4]  # the refused charge mapped nothing
    led.close()
    with pytest.raises(kv.KVCacheError, match="closed"):
        led.charge("b", 0, do_map(0))


def test_ledger_reclaims_from_the_tenant_furthest_above_its_guarantee():
    led, used = ledger()
    used["a"].pages, used["b"].pages = 6, 2
    asked = []
    led.set_reclaimer("a", lambda n: asked.append(("a", n)) or n)
    led.set_reclaimer("b", lambda n: asked.append(("b", n)) or n)
    assert led.reclaim("b", 3) == 3 and asked == [("a", 3)]
    asked.clear()
    led.set_guarantee("a", 6 * 4096)  # a is at its guarantee: nothing to ask of it
    assert led.reclaim("b", 3) == 0 and asked == []
    np.testing.assert_equal(led.tenants(), ["a", "b"])
