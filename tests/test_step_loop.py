"""The step loop: sampling on the device (exact semantics), overlapped dispatch, bounded
buckets compiled ahead of time, per-request seeds, host work per step."""

import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import host_pool

import jax_kvcached as kv
import jax_kvcached.engine.prefix_cache as prefix_cache_module
from jax_kvcached.engine.compile_events import compile_events
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import CHUNK, SamplingParams, gumbel_noise, sample, top_candidates
from jax_kvcached.engine.step_shapes import ladder
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.serve.loop import ServingLoop


# -- sampling ---------------------------------------------------------------------------
def reference_sample(logits, temperature, top_k, top_p, seed, step):
    """The documented semantics, in numpy (float64), with a stable full sort."""
    v = logits.shape[0]
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float32) / np.float32(temperature)
    order = np.lexsort((np.arange(v), -logits.astype(np.float64)))  # desc, ties by id
    k = top_k if 0 < top_k < v else v
    vals = scaled[order].astype(np.float64)
    e = np.exp(vals[:k] - vals[0])
    p = e / e.sum()
    before = np.cumsum(p) - p
    kept = order[:k][before < top_p] if top_p < 1 else order[:k]
    noise = np.asarray(
        gumbel_noise(jnp.asarray([seed], jnp.uint32), jnp.asarray([step]), jnp.arange(v)[None])
    )[0]
    score = scaled[kept] + noise[kept]
    return int(kept[np.argmax(score)])


def test_gumbel_noise_is_finite_for_every_hash():
    """The extreme hashes map inside (0, 1): the noise is finite, so a -inf logit (a
    structured output's mask) is never picked (24 bits once rounded the top one to 1.0,
    noise +inf)."""
    from jax_kvcached.engine.sampling import open_unit

    u = np.asarray(open_unit(jnp.asarray([0, 1, 2**31, 2**32 - 512, 2**32 - 1], jnp.uint32)))
    assert (u > 0).all() and (u < 1).all()
    assert np.isfinite(-np.log(-np.log(u))).all()


def _rows(rng, n, v, ties):
    logits = rng.integers(-6, 6, size=(n, v)).astype(np.float32) if ties else (
        rng.normal(0, 3, size=(n, v)).astype(np.float32)
    )  # fmt: skip
    temperature = rng.choice([0.0, 0.5, 1.0, 2.0], n).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 8, 20, v - 1, v + 5], n).astype(np.int32)
    top_p = rng.choice([1.0, 0.93, 0.6, 0.31, 0.05], n).astype(np.float32)
    seeds = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    steps = rng.integers(0, 1000, n).astype(np.int32)
    return logits, temperature, top_k, top_p, seeds, steps


@pytest.mark.parametrize("candidates", [4, 16, 300])
@pytest.mark.parametrize("ties", [False, True])
def test_sampling_matches_the_documented_semantics(candidates, ties):
    """Every row (greedy, top-k, top-p, both, none; with and without tied logits) equals
    the sorted reference, whether the candidate path or the whole-vocabulary path
    (bisection for the top-k / top-p boundaries) served it."""
    rng = np.random.default_rng(candidates + ties)
    v = 120
    args = _rows(rng, 48, v, ties)
    got = np.asarray(jax.jit(sample, static_argnums=6)(*map(jnp.asarray, args), candidates))
    want = [reference_sample(*(a[i] for a in args)) for i in range(48)]
    assert got.tolist() == want


@pytest.mark.parametrize("ties", [False, True])
def test_two_stage_candidates_equal_lax_top_k(ties):
    """The chunked top-k of a large vocabulary: same values, same ids, same tie order."""
    rng = np.random.default_rng(ties)
    shape = (6, 32 * CHUNK * 2)
    x = rng.integers(-3, 3, shape) if ties else rng.normal(0, 3, shape)
    x = jnp.asarray(x.astype(np.float32))
    got = jax.jit(lambda x: top_candidates(x, 64))(x)
    want = jax.lax.top_k(x, 64)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_row_draws_the_same_in_any_batch():
    rng = np.random.default_rng(5)
    args = _rows(rng, 16, 300, False)
    fn = jax.jit(sample, static_argnums=6)
    together = np.asarray(fn(*map(jnp.asarray, args), 8))
    for i in range(16):
        alone = np.asarray(fn(*(jnp.asarray(a[i : i + 1]) for a in args), 8))
        assert alone[0] == together[i]


def test_sampled_frequencies_follow_the_filtered_softmax():
    v, n = 50, 6000
    logits = np.random.default_rng(1).normal(0, 1.5, v).astype(np.float32)
    for top_k, top_p in [(0, 1.0), (10, 1.0), (0, 0.7)]:
        args = (
            np.broadcast_to(logits, (n, v)), np.full(n, 0.8, np.float32),
            np.full(n, top_k, np.int32), np.full(n, top_p, np.float32),
            np.full(n, 77, np.uint32), np.arange(n, dtype=np.int32),
        )  # fmt: skip
        draws = np.asarray(jax.jit(sample)(*map(jnp.asarray, args)))
        scaled = logits / 0.8
        order = np.argsort(-scaled, kind="stable")
        k = top_k or v
        p = np.exp(scaled[order[:k]] - scaled[order[0]])
        p /= p.sum()
        keep = (np.cumsum(p) - p) < top_p
        want = np.zeros(v)
        want[order[:k][keep]] = p[keep] / p[keep].sum()
        freq = np.bincount(draws, minlength=v) / n
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))
        assert 0.5 * np.abs(freq - want).sum() < 0.04  # total variation


# -- the engine loop --------------------------------------------------------------------
PROMPTS = [[1 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 40, 17, 70, 3])]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_overlapped_loop_equals_the_synchronous_one_under_preemption(params):
    """Step n+1 is prepared and dispatched before step n's tokens reach the host (the
    device feeds them). Outputs, preemption and prefix-cache bookkeeping match the loop
    that waits after every step, under a budget that forces preemption."""
    model = build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2)
    outs, stats = [], []
    for overlap in (False, True):
        pool = kv.Pool(  # 7 usable 16-token blocks (see test_engine): preemption
            6 * 16384, page_size=16384, backend="host", min_reserved_pages=0,
            max_reserved_pages=0,
        )  # fmt: skip
        eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16, overlap=overlap)
        got = eng.generate(PROMPTS[:4], params)
        outs.append([o.token_ids for o in got])
        stats.append(eng.scheduler.num_preemptions)
        c, pc = eng.cache, eng.prefix_cache
        assert c.num_used_blocks == pc.num_cached_blocks == pc.num_evictable_blocks
        assert set(c.mapped_page_ids()) == {c.page_of(b) for b in pc.cached_blocks()}
        pc.reset()
        assert pool.stats()["mapped_pages"] == 0
        pool.close()
    assert outs[0] == outs[1]
    assert stats[0] > 0 and stats[1] > 0


def test_stop_token_while_the_next_step_is_in_flight():
    """A stop token found when step n completes, after step n+1 already computed that
    sequence's next row: the extra token is dropped and its blocks are freed."""
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool()
    eng = Engine(model, pool, max_batch=2)
    free = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = free.token_ids[5]
    streamed = []
    out = eng.generate(
        [PROMPTS[1], PROMPTS[2]],
        SamplingParams(max_tokens=12, stop_token_ids=(stop,), ignore_eos=True),
        on_token=lambda rid, tok, fin: streamed.append(rid),
    )[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert streamed.count(out.request_id) == len(out.token_ids)
    assert eng.cache.num_used_blocks == eng.prefix_cache.num_cached_blocks
    pool.close()


def test_unseeded_requests_get_a_fresh_reported_seed_that_replays():
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=4)
    pool = host_pool()
    eng = Engine(model, pool, max_batch=4)
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a, b = eng.generate([PROMPTS[0], PROMPTS[0]], p)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert a.token_ids != b.token_ids
    replay = eng.generate([PROMPTS[0]], SamplingParams(**{**p.__dict__, "seed": a.seed}))[0]
    assert replay.token_ids == a.token_ids
    pool.close()


def test_a_waiting_prompt_is_hashed_once(monkeypatch):
    """Under memory pressure the head-of-line prompt is tried at every step: its block
    hashes are computed once and kept on the sequence."""
    calls = []
    real = prefix_cache_module.hash_block

    def counting(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(prefix_cache_module, "hash_block", counting)
    model = build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2)
    pool = kv.Pool(
        6 * 16384, page_size=16384, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16)
    long = [1 + i % 200 for i in range(64)]  # 4 blocks: waits while two others run
    outs = eng.generate([PROMPTS[1], PROMPTS[3], long], SamplingParams(max_tokens=16))
    assert all(o.token_ids for o in outs)
    tokens = sum(
        len(p) + len(o.token_ids) for p, o in zip([PROMPTS[1], PROMPTS[3], long], outs, strict=True)
    )
    assert len(calls) <= tokens // 16 + 3 * eng.scheduler.num_preemptions + 3
    pool.close()


# -- buckets, warm-up, compilation ------------------------------------------------------
def test_buckets_step_by_at_most_a_quarter_and_are_few():
    for hi in (1, 8, 32, 256):
        sizes = ladder(1, hi)
        assert sizes[0] == 1 and sizes[-1] == hi
        assert all(b / a <= 1.25 or b - a == 1 for a, b in zip(sizes, sizes[1:], strict=False))
    widths = ladder(8, 512, 8)
    assert all(b / a <= 1.25 or b - a == 8 for a, b in zip(widths, widths[1:], strict=False))
    assert len(ladder(1, 256)) <= 25 and len(widths) <= 25
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool()
    eng = Engine(model, pool, max_batch=32, max_num_batched_tokens=128, max_model_len=2048)
    r = eng.runner
    # Token buckets x one width (the host kernel walks only the context): no batch x chunk
    # product, whatever max_batch is.
    # Powers of two and multiples of 16 up to the budget (which, given, caps every step).
    assert r.token_sizes == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128)
    assert r.step_shapes() == [(t, 128) for t in r.token_sizes]
    eng.close()
    xla = Engine(model, pool, max_batch=32, max_num_batched_tokens=96, max_prefill_tokens=96,
                 max_model_len=2048, attention="xla")  # fmt: skip
    assert xla.runner.token_sizes[-1] == 96  # the budget itself is the largest bucket
    widths = 5  # they double: 8 .. 128
    assert len(xla.runner.step_shapes()) == len(xla.runner.token_sizes) * widths <= 50
    pool.close()


def test_a_served_run_compiles_nothing_after_warm_up():
    """Warm-up compiles the runner's whole shape set; then prompts of every length from
    1 to 200 tokens, alone and in bursts, with prefix hits, compile nothing."""
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool()
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=32, max_model_len=256)
    eng.runner.compile()
    compiled = eng.runner.num_compiled
    events = compile_events()
    rng = np.random.default_rng(0)
    done = threading.Semaphore(0)
    n = 0
    with ServingLoop({"m": eng}) as loop:
        for length in list(range(1, 40, 3)) + [64, 100, 150, 200]:
            for _ in range(1 + length % 3):
                prompt = rng.integers(1, 250, length).tolist()
                temp = float(rng.choice([0.0, 0.8]))
                params = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=temp)
                loop.submit("m", prompt, params, lambda k, v: k != "token" and done.release())
                n += 1
        for _ in range(n):
            assert done.acquire(timeout=300)
    assert eng.runner.compiles_after_warmup == 0
    assert eng.runner.num_compiled == compiled
    assert compile_events() == events  # not even a retrace
    pool.close()


def test_serve_fails_at_once_on_a_busy_port(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        r = subprocess.run(
            [sys.executable, "-m", "jax_kvcached.cli", "serve", "--model", "a=tiny-llama",
             "--port", str(port), "--backend", "host", "--compile-cache", "off"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
    finally:
        busy.close()
    assert r.returncode == 2
    assert f"--port {port}" in r.stderr and "compiled" not in r.stderr
