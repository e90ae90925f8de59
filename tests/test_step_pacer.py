"""The step pacer: a CPU step's prompt chunk beside decode rows, sized from step times."""

from __future__ import annotations

import pytest

from jax_kvcached.engine.step_pacer import StepPacer
from jax_kvcached.engine.step_shapes import StepShapes

SIZES = StepShapes("host", "host", max_batch=8, max_num_batched_tokens=None,
                   max_prefill_tokens=None, max_blocks=64, block_size=16).token_sizes  # fmt: skip


def simulate(pacer: StepPacer, decodes: int, cost, steps: int) -> list[tuple[int, float]]:
    """Runs ``steps`` steps against a cost model ``cost(decodes, prompt_tokens)``
    (seconds), one decode-only step first; returns each mixed step's (prompt tokens,
    ratio to the decode-only step)."""
    pacer.observe(decodes, 0, cost(decodes, 0))
    out = []
    for _ in range(steps):
        p = pacer.budget(decodes) - decodes
        t = cost(decodes, p)
        pacer.observe(decodes, p, t)
        out.append((p, t / cost(decodes, 0)))
    return out


def test_budget_bounds_and_buckets():
    pacer = StepPacer(2.5, 64, SIZES)
    assert SIZES[:6] == (1, 2, 4, 8, 16, 32)
    for chunk in (0.2, 1, 2.7, 6, 13, 40, 500):
        pacer.chunk = chunk
        for d in range(1, 9):
            b = pacer.budget(d)
            assert d + 1 <= b <= 64  # every waiting prompt advances; the cap holds
            assert b <= max(d + 1, d + int(chunk))
            if any(d + 1 <= s <= d + chunk for s in SIZES):
                assert b in SIZES  # nothing padded when a bucket fits


def test_the_chunk_settles_where_a_step_costs_the_ratio():
    """Against a step cost of 12 ms + 4 ms a prompt token (SmolLM2 on 2 cores near
    position 0), the chunk grows bucket by bucket to the largest step within 2.5x a
    decode step, never past it once settled."""
    pacer = StepPacer(2.5, 64, SIZES)
    steps = simulate(pacer, 1, lambda d, p: 0.012 + 0.001 * d + 0.004 * p, 40)
    tokens = [p for p, _ in steps]
    assert tokens[:3] == [1, 3, 3]  # start=2 -> bucket 2, then one bucket up: 4
    assert all(b <= 2 * a + 1 for a, b in zip(tokens, tokens[1:], strict=False))
    assert all(r <= 2.5 for _, r in steps[3:])
    # A steeper cost (a long context: ~20 ms a token) shrinks it to one token at once.
    steep = simulate(pacer, 1, lambda d, p: 0.013 + 0.02 * p, 5)
    assert [p for p, _ in steep][1:] == [1, 1, 1, 1]


def test_more_decode_rows_buy_a_bigger_chunk():
    """Eight streams make a slower decode step (12 + 8 x 4 ms here), so the same prompt
    token cost fits more of them within the ratio."""
    cost = lambda d, p: 0.012 + 0.004 * d + 0.004 * p  # noqa: E731
    one, eight = StepPacer(2.5, 64, SIZES), StepPacer(2.5, 64, SIZES)
    a = simulate(one, 1, cost, 30)[-1][0]
    b = simulate(eight, 8, cost, 30)[-1][0]
    assert b > 2 * a


def test_a_follower_takes_the_leaders_chunk_and_measures_nothing():
    pacer = StepPacer(2.5, 64, SIZES)
    pacer.follow(7.0)
    pacer.observe(1, 0, 0.01)
    pacer.observe(1, 7, 1.0)  # would shrink it
    assert pacer.chunk == 7.0 and pacer.decode_time(1) is None and pacer.budget(1) == 8


def test_bad_ratio_is_refused():
    with pytest.raises(ValueError, match="above 1"):
        StepPacer(1.0, 64, SIZES)


def test_a_paced_engine_measures_its_steps_and_every_step_serves_both():
    """A CPU engine without a fixed budget paces its chunks: it measures its decode-only
    and mixed steps, every step gives each stream a token and advances the prompt, and
    no step exceeds the budget. Afterwards only cached blocks hold pages."""
    import jax_kvcached as kv
    from jax_kvcached.engine.engine import Engine
    from jax_kvcached.engine.sampling import SamplingParams
    from jax_kvcached.models import BUILTIN_CONFIGS, build_model

    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    eng = Engine(model, pool, max_batch=4, max_model_len=1024)
    got: dict[int, int] = {}

    def on_token(rid, tok, finished):
        got[rid] = got.get(rid, 0) + 1

    stream = eng.add_request([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), on_token)
    for _ in range(6):
        eng.step()
    eng.drain()
    assert eng.pacer.decode_time(1) is not None  # decode-only steps were measured
    long = eng.add_request(list(range(1, 301)), SamplingParams(max_tokens=2), on_token)
    seq = next(s for s in eng.scheduler.waiting if s.request_id == long)
    chunks, paced = [], []
    while long not in got:
        before, done = got[stream], seq.num_computed
        paced.append(min(eng.pacer.budget(1) - 1, 300 - done))  # the pacer's chunk now
        eng.complete(eng.dispatch())
        assert got[stream] == before + 1  # a token in this very step
        chunks.append(seq.num_computed - done)
    assert all(1 <= c <= eng.max_num_batched_tokens - 1 for c in chunks[:-1])
    # Every chunk is the one the pacer sized from the steps measured so far (one decode
    # row), and that size moved: the chunk follows measured step times.
    assert chunks == paced and len(set(chunks)) > 1
    for r in (stream, long):
        eng.abort(r)
    eng.drain()
    cached_pages = {eng.cache.page_of(b) for b in eng.prefix_cache.cached_blocks()}
    assert cached_pages and eng.cache.num_mapped_pages == len(cached_pages)
    eng.reset_prefix_cache()
    assert eng.cache.num_mapped_pages == 0
    eng.close()
    pool.close()


def test_before_any_decode_only_step_the_chunk_grows_a_bucket_a_step():
    """A burst of prompts has no decode-only step to hold its steps to: the chunk grows
    (it never stays at its start, which would prefill one token a step)."""
    pacer = StepPacer(2.5, 64, SIZES)
    seen = []
    for _ in range(4):
        p = pacer.budget(3) - 3
        seen.append(p)
        pacer.observe(3, p, 0.05)
    assert seen == [1, 5, 13, 29]
