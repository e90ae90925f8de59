"""Sleep mode (library): an idle engine gives back its weights' device memory and every
KV page, keeps its compiled steps, and answers the same after waking."""

import dataclasses

import jax
import pytest

import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams
from jax_kvcached.engine.compile_events import compile_events

PROMPTS = ["The quick brown fox", "Virtual memory", "JAX is"]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = dataclasses.replace(GREEDY, temperature=0.9, top_p=0.9, seed=5)


@pytest.fixture
def engine():
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    eng = Engine.from_pretrained("tiny-llama", pool, max_batch=4, host_cache_tokens=2048)
    yield eng
    eng.close()
    pool.close()


def _tokens(eng, params):
    return [o.token_ids for o in eng.generate(PROMPTS, params)]


@pytest.mark.parametrize("level", [1, 2])
def test_a_round_trip_answers_the_same_and_compiles_nothing(engine, level):
    greedy, seeded = _tokens(engine, GREEDY), _tokens(engine, SEEDED)
    compiled = (compile_events(), engine.num_compiled)
    before = {id(a) for a in jax.live_arrays()}
    weights = list(engine.runner.state_arrays())
    info = engine.sleep(level=level)
    assert engine.sleeping and engine.sleep_level == level
    assert info["mapped_pages"] == 0 and engine.cache.num_mapped_pages == 0
    assert info["weight_bytes"] == sum(w.nbytes for w in weights) > 0
    assert all(w.is_deleted() for w in weights)  # the device arrays are gone
    live = {id(a) for a in jax.live_arrays()}
    assert not live & {id(w) for w in weights} and len(live) < len(before)
    woke = engine.wake()
    assert not engine.sleeping and woke["level"] == level
    assert _tokens(engine, GREEDY) == greedy and _tokens(engine, SEEDED) == seeded
    assert (compile_events(), engine.num_compiled) == compiled  # no compile


def test_requests_added_while_asleep_are_served_after_the_wake(engine):
    want = _tokens(engine, GREEDY)
    engine.sleep()
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    assert engine.step() == [] and engine.sleeping  # a sleeping engine steps nothing
    engine.run()  # wakes first
    assert not engine.sleeping
    done = {s.request_id: s.output for s in engine.drain_finished()}
    assert [done[i] for i in ids] == want
    engine.reset_prefix_cache()
    assert engine.cache.num_mapped_pages == 0


def test_sleep_finishes_or_aborts_the_requests_in_flight(engine):
    rid = engine.add_request("in flight", GREEDY)
    engine.step()
    engine.sleep()
    (s,) = [s for s in engine.drain_finished() if s.request_id == rid]
    assert s.finish_reason == "length" and len(s.output) == 8  # it finished first
    engine.wake()
    rid = engine.add_request("aborted", dataclasses.replace(GREEDY, max_tokens=500))
    engine.step()
    engine.sleep(abort=True)
    assert engine.cache.num_mapped_pages == 0 and not engine.has_work
    engine.wake()


def test_idle_prefixes_go_to_the_host_tier_and_come_back(engine):
    engine.generate(PROMPTS, GREEDY)
    cached = engine.prefix_cache.num_cached_blocks
    assert cached > 0
    info = engine.sleep()
    assert info["evicted_blocks"] == cached and engine.stats()["host_cache"]["entries"] >= cached
    engine.wake()
    restores = engine.stats()["host_cache"]["restores"]
    engine.generate(PROMPTS, GREEDY)
    assert engine.stats()["host_cache"]["restores"] > restores  # served from the tier


def test_bad_sleep_and_wake_calls_are_clear_errors(engine):
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="is awake"):
        engine.wake()
    engine.sleep()
    with pytest.raises(ValueError, match="already asleep"):
        engine.sleep()
    engine.wake()
    from jax_kvcached.models import load_pretrained

    bare = Engine(load_pretrained("tiny-qwen2").model, engine.pool, name="bare")
    try:
        with pytest.raises(ValueError, match="only an engine with a reload"):
            bare.sleep(level=2)
        assert not bare.sleeping
    finally:
        bare.close()


def test_preload_brings_the_most_hit_prefixes_back_on_wake(engine):
    """A system prompt hit by every request is copied back from the host tier on wake:
    the first request after it hits on the device as before the sleep (none restored on
    its path), within the preload's token budget; exact accounting after it. Without a
    preload the same request is served from the tier instead."""
    system = "You are a helpful assistant. Answer briefly and precisely, please. " * 2
    ask = [system + q for q in ("Who?", "What?", "When?", "Where?")]
    engine.generate(ask[:3], GREEDY)
    pc = engine.prefix_cache
    hits0 = pc.hits
    want = engine.generate(ask[3:], GREEDY)[0].token_ids
    warm_hit = pc.hits - hits0  # the system prompt's blocks, on the device
    assert warm_hit >= 128
    for preload in (0, 4096):
        engine.sleep()
        info = engine.wake(preload_tokens=preload)
        assert info["compiled"] == 0
        restores, hits0 = engine.stats()["host_cache"]["restores"], pc.hits
        assert engine.generate(ask[3:], GREEDY)[0].token_ids == want
        restored = engine.stats()["host_cache"]["restores"] - restores
        if preload:
            assert info["preloaded_tokens"] >= warm_hit
            assert pc.hits - hits0 >= 0.9 * warm_hit and restored == 0
        else:
            assert info["preloaded_tokens"] == 0
            assert pc.hits - hits0 < warm_hit and restored == 1
    # A budget below the prompt preloads that much at most, parents first.
    engine.sleep()
    assert engine.wake(preload_tokens=32)["preloaded_tokens"] == 32
    assert pc.num_cached_blocks == 32 // engine.cache.block_size
    assert engine.kv.preload(16) == [0]  # a budget below what is cached: nothing more
    engine.reset_prefix_cache()
    assert engine.cache.num_mapped_pages == 0
    engine.sleep()
    with pytest.raises(ValueError, match="preload_tokens"):
        engine.wake(preload_tokens=-1)
    assert engine.sleeping
    engine.wake()
