"""The paged engine against a dense, no-cache forward of the same model."""

import numpy as np
import pytest
from conftest import dense_greedy, host_pool

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.runner import StepInput
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

PROMPTS = [
    [256, 72, 101, 108, 108, 111],
    [256, *range(40, 77)],  # 38 tokens: several blocks, chunked prefill
    [256, 9],
    [256, *range(100, 120)],
]


def _reference(model, prompt, n):
    """Greedy tokens and per-step last-position logits, recomputing everything each step
    (conftest.dense_greedy: one padded, jitted program)."""
    return dense_greedy(model, prompt, n, with_logits=True)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2"])
def model(request):
    return build_model(BUILTIN_CONFIGS[request.param], seed=3)


def assert_only_cached_blocks_hold_pages(eng, pool):
    """Exact accounting once every request finished: the mapped pages are exactly the pages
    of idle prefix-cache blocks; after a reset nothing is mapped."""
    c, pc = eng.cache, eng.prefix_cache
    assert c.num_used_blocks == (pc.num_cached_blocks if pc else 0)
    if pc:
        assert pc.num_evictable_blocks == pc.num_cached_blocks  # no refs left
        pages = {c.page_of(b) for b in pc.cached_blocks()}
        assert set(c.mapped_page_ids()) == pages
        assert pool.stats()["caches"][c.name]["mapped_pages"] == len(pages) * c.pages_per_kv_page
        pc.reset()
    assert pool.stats()["mapped_pages"] == 0




def test_greedy_matches_dense_reference(model):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=8)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref, _ = _reference(model, prompt, 12)
        assert out.token_ids == ref
        assert out.finish_reason == "length" and out.ttft_s > 0
    assert_only_cached_blocks_hold_pages(eng, pool)
    pool.close()


@pytest.mark.parametrize("kv_dtype,atol", [("float32", 1e-4), ("bfloat16", 0.15)])
def test_logits_close_for_prefill_and_every_decode_step(kv_dtype, atol):
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=1)
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16, kv_dtype=kv_dtype)
    prompt = PROMPTS[1]
    ref_tokens, ref_logits = _reference(model, prompt, 10)
    cache, runner = eng.cache, eng.runner
    blocks = cache.alloc(4).tolist()
    # Chunked prefill: 16 + 16 + 6 tokens, each chunk on top of the cached ones.
    start = 0
    while start < len(prompt):
        chunk = prompt[start : start + 16]
        logits = runner.run([StepInput(chunk, start, blocks)])
        start += len(chunk)
    np.testing.assert_allclose(np.asarray(logits[0]), ref_logits[0], atol=atol, rtol=0)
    toks = list(prompt) + [ref_tokens[0]]
    for i in range(1, 10):  # decode, feeding the reference's tokens
        logits = runner.run([StepInput([toks[-1]], len(toks) - 1, blocks)])
        np.testing.assert_allclose(np.asarray(logits[0]), ref_logits[i], atol=atol, rtol=0)
        toks.append(ref_tokens[i])
    cache.free(blocks, after=runner.token)
    pool.close()


def test_steady_state_decode_never_recompiles():
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=32)
    shapes, seqs = [], []
    run = eng.runner.execute

    def recording_run(step):
        shapes.append(step.shape)
        seqs.append(step.num_rows)
        return run(step)

    eng.runner.execute = recording_run
    eng.generate(PROMPTS[:3], SamplingParams(max_tokens=60, ignore_eos=True))
    # Every compile is a new bucket: no step ever recompiled a shape seen before, and
    # every shape is one of the runner's bounded set.
    assert eng.runner.num_compiled == len(set(shapes))
    assert set(shapes) <= set(eng.runner.step_shapes())
    # On a CPU the sampler runs behind the step: one program per logit row count (the
    # step's tokens, rounded up to a power of two, at most max_batch's).
    rows = {min(eng.runner.max_rows, 1 << (t - 1).bit_length()) for t, _ in shapes}
    assert eng.runner.compiled_sampler_sizes == rows
    assert eng.runner.dispatches == 2 * len(shapes)
    decode = [sh for sh in shapes if sh[0] <= 4]  # 3 sequences: at most 4 tokens
    assert len(decode) >= 59 and len(set(decode)) <= 3  # 60 decode steps, <= 3 buckets
    pool.close()


def test_preemption_under_a_tiny_budget_gives_the_same_outputs():
    model = build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    big = host_pool("64MiB")
    ref = Engine(model, big, max_batch=4).generate(PROMPTS, params)
    # 3 layers -> 6 pages per KV page. A block (16 tokens x 1 KV head x 32 x 4 B) is
    # 2 KiB, so a 16 KiB page holds 8: one KV page, 7 usable blocks, for 15 needed.
    small = kv.Pool(
        6 * 16384, page_size=16384, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )
    eng = Engine(model, small, max_batch=4, max_num_batched_tokens=16)
    assert eng.cache.num_free_blocks < sum(-(-(len(p) + 40) // 16) for p in PROMPTS)
    outs = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.scheduler.num_preemptions > 0
    assert_only_cached_blocks_hold_pages(eng, small)
    big.close()
    small.close()


def test_seeded_sampling_is_independent_of_batching():
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=4)
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4)
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = eng.generate([PROMPTS[0]], p)[0].token_ids
    batched = eng.generate(PROMPTS, [p, *[SamplingParams(max_tokens=5)] * 3])[0].token_ids
    assert alone == batched
    other = eng.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.8, seed=8, ignore_eos=True)
    )[0].token_ids
    assert other != alone
    pool.close()


def test_stop_tokens_max_tokens_and_streaming():
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool("128MiB")
    eng = Engine(model, pool)
    free = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = free.token_ids[3]
    streamed = []
    out = eng.generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=8, stop_token_ids=(stop,)),
        on_token=lambda rid, tok, fin: streamed.append((tok, fin)),
    )[0]
    first = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert [t for t, _ in streamed] == out.token_ids and streamed[-1][1] is True
    assert not any(f for _, f in streamed[:-1])
    pool.close()


def test_bad_requests_raise_clear_errors():
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_model_len=64)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[]])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([[1, 2, 999]])
    with pytest.raises(ValueError, match="max_model_len"):
        eng.generate([list(range(64))])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.generate(["text needs a tokenizer"])
    assert not eng.scheduler.has_work  # nothing half-queued
    pool.close()


def test_a_request_larger_than_the_pool_fails_alone():
    model = build_model(BUILTIN_CONFIGS["tiny-qwen2"], seed=2)
    pool = kv.Pool(  # 7 usable blocks (see the preemption test): at most 112 tokens
        6 * 16384, page_size=16384, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )
    eng = Engine(model, pool, max_batch=2)
    with pytest.raises(kv.PoolExhausted, match="needs 9 KV blocks"):
        eng.generate([list(range(1, 140))], SamplingParams(max_tokens=2))
    assert not eng.scheduler.has_work  # the engine stays usable
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    pool.close()
