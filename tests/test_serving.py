"""ServingLoop: fair interleaving of several engines on one pool, from any thread."""

import queue
import threading

import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.serve.loop import Overloaded, ServingLoop, Unavailable, UnknownModel

PAGE = 16384
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def make_pool(pages):
    return kv.Pool(
        pages * PAGE, page_size=PAGE, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )


def engines(pool, **kw):
    return {
        "llama": Engine(
            build_model(BUILTIN_CONFIGS["tiny-llama"], seed=1), pool, name="llama", **kw
        ),
        "qwen": Engine(build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2), pool, name="qwen", **kw),
    }


def prompts(seed, n, length=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, size=length).tolist() for _ in range(n)]


def reference(name, ps, params=PARAMS):
    pool = make_pool(256)
    eng = engines(pool, max_batch=4)[name]
    out = [o.token_ids for o in eng.generate(ps, params)]
    pool.close()
    return out


class Collector:
    def __init__(self):
        self.tokens, self.done, self.error = [], None, None
        self.finished = threading.Event()

    def __call__(self, kind, value):
        if kind == "token":
            self.tokens.append(value)
        else:
            self.done, self.error = (value, None) if kind == "done" else (None, value)
            self.finished.set()


def submit_all(loop, model, ps, params=PARAMS):
    cols = []
    for p in ps:
        c = Collector()
        loop.submit(model, p, params, c)
        cols.append(c)
    return cols


def wait(cols, timeout=120):
    for c in cols:
        assert c.finished.wait(timeout), "a request never finished"


def assert_only_prefixes_mapped(pool, engs):
    for e in engs.values():
        assert e.cache.num_used_blocks == e.prefix_cache.num_cached_blocks


def test_two_models_from_many_threads_match_running_alone():
    pool = make_pool(64)  # tight: the two tenants take pages from each other
    engs = engines(pool, max_batch=4)
    ps = {"llama": prompts(0, 6), "qwen": prompts(1, 6)}
    results: dict[str, list] = {}
    with ServingLoop(engs) as loop:

        def client(model):
            cols = submit_all(loop, model, ps[model])
            wait(cols)
            results[model] = cols

        threads = [threading.Thread(target=client, args=(m,)) for m in ps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = loop.stats()
    for model in ps:
        cols = results[model]
        assert all(c.error is None for c in cols)
        assert [c.tokens for c in cols] == reference(model, ps[model])
        assert all(c.done.finish_reason == "length" for c in cols)
        assert stats[model]["outstanding"] == 0 and stats[model]["finished"] == 6
    assert_only_prefixes_mapped(pool, engs)
    pool.close()


def test_rounds_interleave_engines_fairly():
    pool = make_pool(256)
    engs = engines(pool, max_batch=2)
    order = []
    for name, e in engs.items():
        orig = e.dispatch

        def traced(orig=orig, name=name):
            step = orig()
            if step is not None:
                order.append(name)
            return step

        e.dispatch = traced
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    with ServingLoop(engs) as loop:
        cols = submit_all(loop, "llama", prompts(2, 2), long)
        cols += submit_all(loop, "qwen", prompts(3, 2), long)
        wait(cols)
    # While both have work, neither runs more than two steps in a row (one round ends
    # with it, the next starts with it).
    both = order[: min(order.count("llama"), order.count("qwen")) * 2 - 2]
    runs = [len(r) for r in "".join("l" if n == "llama" else "q" for n in both).split("q") if r]
    runs += [len(r) for r in "".join("l" if n == "llama" else "q" for n in both).split("l") if r]
    assert len(both) > 40 and max(runs) <= 2
    pool.close()


def test_overload_unknown_model_bad_prompt_and_stop():
    pool = make_pool(256)
    engs = engines(pool, max_batch=1)
    loop = ServingLoop(engs, max_queue=1).start()
    c1, c2 = Collector(), Collector()
    loop.submit("llama", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True), c1)
    loop.submit("llama", [1, 2, 3], PARAMS, c2)
    with pytest.raises(Overloaded, match="limit 2"):
        loop.submit("llama", [1, 2, 3], PARAMS, Collector())
    with pytest.raises(UnknownModel):
        loop.submit("gpt-9", [1], PARAMS, Collector())
    with pytest.raises(ValueError, match="vocabulary"):
        loop.submit("qwen", [100000], PARAMS, Collector())
    wait([c1, c2])
    loop.submit("llama", [1, 2, 3], PARAMS, Collector())  # room again
    loop.stop()
    with pytest.raises(Unavailable):
        loop.submit("llama", [1, 2, 3], PARAMS, Collector())
    assert loop.stats()["llama"]["outstanding"] == 0  # the last one was closed at shutdown
    pool.close()


def test_samples_of_a_prompt_are_queued_together_and_fork_it():
    """n samples of one prompt reach the engine in one round: one prefill, n - 1 forks,
    whatever runs beside them; all or none are queued (a group past the limit is refused
    whole, nothing left in flight)."""
    pool = make_pool(256)
    engs = engines(pool, max_batch=5)
    loop = ServingLoop(engs, max_queue=1).start()
    busy = submit_all(loop, "llama", prompts(5, 2), SamplingParams(max_tokens=40,
                                                                   ignore_eos=True))  # fmt: skip
    forks = engs["llama"].forks
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]  # fmt: skip
    cols = [Collector() for _ in params]
    reqs = loop.submit_samples("llama", prompts(6, 1)[0], params, cols)
    wait(cols + busy)
    assert engs["llama"].forks - forks == 2 and reqs[1].fork_of is reqs[0]
    assert all(len(c.tokens) == 6 for c in cols)
    with pytest.raises(Overloaded):  # 7 at once > max_batch 5 + max_queue 1
        loop.submit_samples("llama", [1, 2, 3], [PARAMS] * 7, [Collector() for _ in range(7)])
    assert loop.stats()["llama"]["outstanding"] == 0
    loop.stop()
    pool.close()


def test_cancel_frees_the_request():
    pool = make_pool(256)
    engs = engines(pool, max_batch=2, prefix_caching=False)
    got = queue.Queue()
    with ServingLoop(engs) as loop:
        req = loop.submit(
            "qwen",
            prompts(4, 1, 60)[0],
            SamplingParams(max_tokens=500, ignore_eos=True),
            lambda kind, v: got.put(kind),
        )
        assert got.get(timeout=60) == "token"
        loop.cancel(req)
        for _ in range(200):
            if loop.stats()["qwen"]["outstanding"] == 0:
                break
            threading.Event().wait(0.05)
        assert loop.stats()["qwen"]["outstanding"] == 0
        assert not engs["qwen"].has_work
        assert engs["qwen"].cache.num_used_blocks == 0
    pool.close()


def test_limit_change_while_serving_and_a_request_too_big_for_its_limit():
    pool = make_pool(96)
    engs = engines(pool, max_batch=4)
    ps = prompts(5, 6, 60)
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    with ServingLoop(engs) as loop:
        cols = submit_all(loop, "qwen", ps, long)
        while not cols[0].tokens:
            threading.Event().wait(0.01)
        res = pool.set_memory_limit("qwen", 12 * PAGE)  # 2 qwen KV pages (16 blocks)
        assert res.limit_bytes == 12 * PAGE
        big = Collector()
        loop.submit("qwen", list(range(1, 300)), PARAMS, big)
        wait(cols + [big])
        assert isinstance(big.error, kv.PoolExhausted)
        assert engs["qwen"].cache.num_mapped_pages * 6 <= 12
        other = submit_all(loop, "llama", prompts(6, 2))
        wait(other)
    assert [c.tokens for c in cols] == reference("qwen", ps, long)
    assert all(c.error is None for c in other)
    pool.close()


def test_a_failing_event_callback_cancels_only_its_request():
    pool = make_pool(256)
    engs = engines(pool, max_batch=2, prefix_caching=False)

    def broken(kind, value):
        raise RuntimeError("consumer bug")

    with ServingLoop(engs) as loop:
        loop.submit("qwen", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), broken)
        cols = submit_all(loop, "qwen", prompts(7, 2))
        wait(cols)
        for _ in range(200):
            if loop.stats()["qwen"]["outstanding"] == 0:
                break
            threading.Event().wait(0.05)
        stats = loop.stats()["qwen"]
    assert [c.tokens for c in cols] == reference("qwen", prompts(7, 2))
    assert stats["outstanding"] == 0 and not stats["failed"]
    assert engs["qwen"].cache.num_used_blocks == 0
    pool.close()


def test_stats_read_each_engines_own_pool():
    pools = [make_pool(64), make_pool(64)]
    llama = Engine(build_model(BUILTIN_CONFIGS["tiny-llama"], seed=1), pools[0], name="llama")
    qwen = Engine(
        build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2), pools[1], name="qwen",
        memory_limit=12 * PAGE, memory_guarantee=6 * PAGE,
    )  # fmt: skip
    stats = ServingLoop({"llama": llama, "qwen": qwen}).stats()
    assert stats["qwen"]["limit_bytes"] == 12 * PAGE
    assert stats["qwen"]["guarantee_bytes"] == 6 * PAGE
    assert stats["llama"]["limit_bytes"] is None
    for p in pools:
        p.close()
