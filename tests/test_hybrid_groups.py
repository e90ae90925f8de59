"""KV cache groups in the engine: sliding-window groups give their blocks back below the
window, outputs match the all-blocks-kept run and a dense windowed reference (greedy and
seeded, with prefix caching and preemption), accounting is exact per group, a sliding
group holds at most its window's blocks, and prefix hits restore exactly what a sliding
group needs."""

import dataclasses

import pytest
from conftest import check_group_accounting, dense_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.kv_groups import kv_cache_groups
from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.interface import FULL, KVSpec

PAGE = 65536
# Prompts longer than the windows; chunks of 16 straddle the window boundaries.
PROMPTS = [[256, *range(30, 110)], [256, *range(120, 171)], [256, 7, 8, 9]]


@pytest.fixture(scope="module")
def models():
    out = {name: build_model(BUILTIN_CONFIGS[name], seed=0)
           for name in ("tiny-swa", "tiny-mistral")}  # fmt: skip
    # A window smaller than a block and not a multiple of it (block size 8 below).
    small = dataclasses.replace(BUILTIN_CONFIGS["tiny-swa"], sliding_window=5)
    out["window-5"] = build_model(small, seed=1)
    return out


def _engine(model, free=True, page=PAGE, **kw):
    pool = kv.Pool(kw.pop("budget", 96) * page, page_size=page, backend="host")
    kw.setdefault("block_size", 16)
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16, attention="host",
                 free_window_blocks=free, **kw)  # fmt: skip
    return eng, pool


def _bound_checker(eng):
    """Wraps the KV manager's grow: after each, every sliding group holds at most
    ceil((window + chunk) / block) + 1 blocks of the sequence."""
    kvm, bs, worst = eng.kv, eng.cache.block_size, {}
    grow = kvm.grow

    def checked(seq, num_tokens):
        ok = grow(seq, num_tokens)
        chunk = num_tokens - seq.num_computed
        for g, spec in enumerate(kvm.specs):
            w = spec.window
            if w and ok:
                held = sum(1 for b in seq.tables[g] if b)
                bound = -(-(w + chunk) // bs) + 1
                assert held <= bound, (g, held, bound)
                worst[g] = max(worst.get(g, 0), held)
        return ok

    kvm.grow = checked
    return worst


def _specs(*windows):
    return tuple(KVSpec.sliding(w) if w else FULL for w in windows)


def test_groups_follow_the_layers_windows():
    assert kv_cache_groups(_specs(16, 0, 16, 0)) == ((1, 0, 1, 0), _specs(0, 16))
    assert kv_cache_groups(_specs(24, 24)) == ((0, 0), _specs(24))
    assert kv_cache_groups(_specs(0, 0, 0)) == ((0, 0, 0), _specs(0))
    assert kv_cache_groups(_specs(512, 512, 0, 1024)) == ((1, 1, 0, 2), _specs(0, 512, 1024))


@pytest.mark.parametrize("name", ["tiny-swa", "tiny-mistral", "window-5"])
def test_freeing_on_off_and_the_dense_reference_agree(models, name):
    model = models[name]
    bs = 8 if name == "window-5" else 16
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=7)
    outs = {}
    for free in (True, False):
        eng, pool = _engine(model, free, block_size=bs)
        worst = _bound_checker(eng)
        assert eng.cache.num_groups == (1 if name == "tiny-mistral" or not free else 2)
        outs[free] = (
            [o.token_ids for o in eng.generate(PROMPTS, greedy)],
            [o.token_ids for o in eng.generate(PROMPTS, seeded)],
        )
        check_group_accounting(eng)
        if free:
            assert worst, "the sliding group was never checked"
            # What stays mapped is the prefix cache's (full prefixes, sliding tails).
            assert eng.reset_prefix_cache() > 0
            assert eng.cache.mapped_pages == 0
        eng.close()
        pool.close()
    assert outs[True] == outs[False]
    for prompt, out in zip(PROMPTS, outs[True][0], strict=True):
        assert out == dense_greedy(model, prompt, 6), name


def test_without_prefix_caching_blocks_below_the_window_are_unmapped(models):
    """Mapped memory with freeing is what the windows need, not the whole context."""
    model = models["tiny-mistral"]  # every layer windowed (24 tokens)
    mapped = {}
    for free in (True, False):
        eng, pool = _engine(model, free, prefix_caching=False, block_size=8, budget=400)
        peak = [0]
        step = eng.step

        def tracked(step=step, eng=eng, peak=peak):
            out = step()
            peak[0] = max(peak[0], eng.cache.mapped_pages)
            return out

        eng.step = tracked
        long = [[256, *range(1, 200)], [256, *range(2, 220)]]
        eng.generate(long, SamplingParams(max_tokens=4, ignore_eos=True))
        assert eng.cache.mapped_pages == 0  # everything freed at the end
        mapped[free] = peak[0]
        eng.close()
        pool.close()
    assert mapped[True] < mapped[False]


def test_preemption_with_a_sliding_group(models):
    """Too little memory for all at once: preempted sequences come back with the same
    outputs; accounting stays exact."""
    model = models["tiny-swa"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[256, *range(10 + i, 60 + i)] for i in range(4)]
    roomy, pool = _engine(model)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    roomy.close()
    pool.close()
    # 16 KiB pages hold 4 blocks; each group's KV page is 4 physical pages. A sequence
    # needs up to 5 full blocks (2 KV pages) and 3 sliding ones: 4 do not fit in 28.
    tight, pool = _engine(model, budget=28, page=16384)
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    check_group_accounting(tight)
    tight.close()
    pool.close()


def test_a_prefix_hit_restores_the_window_a_sliding_group_needs(models):
    """A follow-up turn (the conversation so far plus a new message) hits the cached
    prefix: every block in the full group, the hit point's window in the sliding one."""
    model = models["tiny-swa"]
    eng, pool = _engine(model)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    base = [256, *range(30, 111)]  # 82 tokens; with 5 generated, 86 (85 computed)
    first = eng.generate([base], params)[0].token_ids
    follow = [*base, *first, 5, 6, 7, 8, 9, 10]
    seen = {}
    admit = eng.kv.admit

    def spy(seq):
        n = admit(seq)
        seen["tables"] = [list(t) for t in seq.tables]
        seen["cached"] = n
        return n

    eng.kv.admit = spy
    warm = eng.generate([follow], params)[0].token_ids
    assert seen["cached"] == 80  # 5 full blocks
    full, sliding = seen["tables"]
    # Full group: every block of the prefix; sliding (window 16): the hit point's window,
    # positions 65..79 -> block 4 only (blocks 0..3 are the null block).
    assert all(full[:5]) and sliding[:4] == [0, 0, 0, 0] and sliding[4]
    # Both groups counted the two prompts' lookups (5 blocks each) and the 80-token hit.
    for group in eng.kv.stats()["groups"]:
        assert (group["queries_tokens"], group["hits_tokens"]) == (160, 80), group
    eng.kv.admit = admit
    check_group_accounting(eng)
    want = dense_greedy(model, follow, 5)  # (before the sleep takes the weights off)
    # Asleep, the model keeps no KV of any group; awake, it recomputes the same.
    assert eng.sleep()["mapped_pages"] == 0 == eng.cache.mapped_pages
    eng.wake()
    cold = eng.generate([follow], params)[0].token_ids
    assert warm == cold == want
    eng.close()
    pool.close()


def test_the_host_tier_keeps_each_groups_blocks(monkeypatch):
    """With a host tier, each group's evicted blocks go to its own tier (a sliding group
    keeps only its last window's): asleep the model maps nothing, and the follow-up turn
    restores the full group's whole prefix and the sliding group's window from the host
    (the same tokens as the dense reference). A sliding group's failed restore shrinks
    the hit to what every group holds: recomputed, same tokens, nothing leaked."""
    model = build_model(BUILTIN_CONFIGS["tiny-swa"], seed=0)  # its own: a sleep takes these
    eng, pool = _engine(model, host_cache_tokens=512)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    base = [256, *range(30, 111)]
    first = eng.generate([base], params)[0].token_ids
    follow = [*base, *first, 5, 6, 7, 8, 9, 10]
    want = dense_greedy(model, follow, 5)
    assert eng.sleep()["mapped_pages"] == 0 == eng.cache.mapped_pages
    eng.wake()
    full_tier, sliding_tier = eng.kv.host_caches
    # 85 computed tokens: 5 full blocks; the sliding group (window 16) had kept block 4.
    assert (full_tier.num_entries, sliding_tier.num_entries) == (5, 1)
    slot = 2 * 2 * eng.cache.block_bytes  # 2 layers each, K and V
    assert sliding_tier.store.slot_bytes == full_tier.store.slot_bytes == slot
    seen = {}
    admit = eng.kv.admit

    def spy(seq):
        n = admit(seq)
        seen["tables"], seen["cached"] = [list(t) for t in seq.tables], n
        return n

    monkeypatch.setattr(eng.kv, "admit", spy)
    assert eng.generate([follow], params)[0].token_ids == want
    assert seen["cached"] == 80
    full, sliding = seen["tables"]
    assert all(full[:5]) and sliding[:4] == [0, 0, 0, 0] and sliding[4]
    host = eng.stats()["host_cache"]
    assert (host["restores"], host["hits_tokens"], host["restored_blocks"]) == (1, 80, 6)
    assert [g["restored_blocks"] for g in host["groups"]] == [5, 1]
    check_group_accounting(eng)
    # Again from the host, but the sliding group's copy back fails: no group hit at all.
    eng.sleep()
    eng.wake()

    def broken(slots, blocks):
        raise kv.KVCacheError("injected copy failure")

    monkeypatch.setattr(sliding_tier.store, "copy_in", broken)
    assert eng.generate([follow], params)[0].token_ids == want
    assert seen["cached"] == 0 and eng.stats()["host_cache"]["restores"] == 1
    check_group_accounting(eng)
    assert eng.reset_prefix_cache() > 0 and eng.cache.mapped_pages == 0
    assert full_tier.num_entries == sliding_tier.num_entries == 0
    eng.close()
    pool.close()


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 40),
    block=st.sampled_from([4, 8, 16]),
    prompt=st.integers(1, 90),
    chunks=st.lists(st.integers(1, 24), min_size=1, max_size=12),
)
def test_sliding_tables_hold_exactly_the_window(window, block, prompt, chunks):
    """Any window vs block size, prompt lengths around the window, any chunking: after
    each grow the sliding table's nulls are exactly the blocks below the chunk's window,
    the held blocks are within the bound, and after release every page is back."""
    pool = kv.Pool(64 * PAGE, page_size=PAGE, backend="host")
    cache = pool.create_kv_cache("h", 2, 1, 16, "float32", block, layer_groups=(0, 1))
    kvm = KVManager(cache, 4096, prefix_caching=False, specs=_specs(0, window))
    seq = Sequence(0, list(range(prompt)), SamplingParams())
    assert kvm.admit(seq) == 0
    pos = 0
    for c in chunks:
        assert kvm.grow(seq, pos + c)
        first = max(0, pos - window + 1) // block
        full, sliding = seq.tables
        assert len(full) == len(sliding) == -(-(pos + c) // block)
        assert all(full) and all(b == 0 for b in sliding[:first]) and all(sliding[first:])
        assert len(sliding) - first <= -(-(window + c) // block) + 1
        kvm.computed(seq, pos + c)
        pos += c
        used = {cache.groups[1].page_of(b) for b in sliding if b}
        assert set(cache.groups[1].mapped_page_ids()) == used
    kvm.release(seq)
    assert cache.mapped_pages == 0
    pool.close()


def test_the_server_reports_each_kv_cache_group(models):
    """/admin/memory, /metrics and top show each group's mapped memory, and the groups
    add up to the model's total."""
    import httpx

    from jax_kvcached.models import ByteTokenizer
    from jax_kvcached.serve.app import AuthConfig, BackgroundServer, ServedModel, create_app
    from jax_kvcached.serve.loop import ServingLoop
    from jax_kvcached.serve.top import render, scrape

    model = build_model(BUILTIN_CONFIGS["tiny-gemma3"], seed=0)
    pool = kv.Pool(96 * PAGE, page_size=PAGE, backend="host")
    eng = Engine(model, pool, name="g", max_batch=2, tokenizer=ByteTokenizer())
    loop = ServingLoop({"g": eng}).start()
    app = create_app(loop, {"g": ServedModel(eng, ByteTokenizer())},
                     auth=AuthConfig(allow_unauthenticated_admin=True))  # fmt: skip
    http = BackgroundServer(app).start()
    try:
        body = {"model": "g", "prompt": "x" * 90, "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{http.url}/v1/completions", json=body, timeout=120).status_code == 200
        mem = httpx.get(f"{http.url}/admin/memory").json()["models"]["g"]["kv_cache_groups"]
        assert [(g["layers"], g["window"]) for g in mem] == [(1, 0), (5, 16)]
        assert sum(g["mapped_bytes"] for g in mem) == eng.cache.mapped_bytes > 0
        m = scrape(http.url)
        series = m["kvcached_kv_cache_group_mapped_bytes"]
        assert {dict(k)["window"] for k in series} == {"0", "16"}
        assert sum(series.values()) == eng.cache.mapped_bytes
        assert "KV groups: full" in render(m) and "window 16" in render(m)
    finally:
        http.stop()
        loop.stop()
        pool.close()


@pytest.mark.parametrize("caching", [False, True])
def test_forks_of_a_hybrid_model_share_the_prompt_in_every_group(caching):
    """n samples of one prompt on a model with a sliding group: each fork shares its
    parent's computed prompt blocks in both groups (a reference each, the sliding
    group's null blocks stay null), copies the partial block per group, and samples what
    a single seeded run samples; afterwards every group's accounting is exact."""
    # window 16: a 40-token prompt leaves null blocks behind (its own model: a sleep in
    # another test deletes the shared fixture's weights)
    model = build_model(BUILTIN_CONFIGS["tiny-swa"], seed=0)
    prompt = [256, *range(30, 69)]
    eng, pool = _engine(model, prefix_caching=caching)

    def params(i):
        return SamplingParams(max_tokens=5, temperature=1.0, seed=10 + i, ignore_eos=True)

    singles = [eng.generate([prompt], params(i))[0].token_ids for i in range(3)]
    eng.reset_prefix_cache()
    got: dict[int, list[int]] = {}

    def on_token(rid, tok, finished):
        got.setdefault(rid, []).append(tok)

    first = eng.add_request(prompt, params(0), on_token)
    rids = [first] + [eng.add_request(prompt, params(i), on_token, fork_of=first)
                      for i in (1, 2)]  # fmt: skip
    used = [g.num_used_blocks for g in eng.cache.groups]
    for _ in range(6):  # the parent's prompt: 3 chunks of 16
        eng.step()
        if eng.forks:
            break
    assert eng.forks == 2, "the forks did not take their parent's prompt"
    parent, *kids = (s for s in eng.scheduler.running)
    full = (len(prompt) - 1) // eng.cache.block_size
    for g, mgr in enumerate(eng.kv.managers):
        shared = parent.tables[g][:full]
        assert 0 in shared if mgr.window else 0 not in shared  # the window's null blocks
        for kid in kids:
            assert kid.tables[g][:full] == shared and kid.tables[g][full] != parent.tables[g][full]
        held = [b for b in shared if b]
        assert held and all(mgr.pool.ref_count(b) == 3 for b in held)
    if not caching:  # no cached copies: the parent's blocks plus one copy per fork per group
        for g, group in enumerate(eng.cache.groups):
            assert group.num_used_blocks - used[g] == len(set(parent.tables[g]) - {0}) + 2
    eng.run()
    assert [got[r] for r in rids] == singles
    assert eng.fork_fallbacks == 0
    assert all(p.num_held_blocks == 0 for p in eng.kv.pools)
    for p in eng.kv.pools:
        p.check()
    check_group_accounting(eng)
    eng.close()
    pool.close()
