"""The ragged step: decode rows and prefill chunks of several sequences in one step
(the same logits as separate steps), decode never waits for a prefill, and a bounded
shape set that compiles nothing after warm-up for prompts of any length."""

import threading

import numpy as np
import pytest
from conftest import host_pool

from jax_kvcached.engine.compile_events import compile_events
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.runner import ModelRunner, StepInput
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.serve.loop import ServingLoop


@pytest.mark.parametrize("impl", ["host", "xla", "pallas-interpret"])
def test_a_mixed_step_gives_the_logits_of_separate_steps(impl):
    """Two decode rows and two prefill chunks (one starting on cached context, one fresh)
    in one step give the logits each gets in a step of its own."""
    cfg = BUILTIN_CONFIGS["tiny-qwen2"]
    model = build_model(cfg, seed=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 250, n).tolist() for n in (23, 9, 40, 17)]
    outs = []
    for mixed in (False, True):
        pool = host_pool()
        c = pool.create_kv_cache("a", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
        r = ModelRunner(model, c, attention=impl, max_batch=4, max_num_batched_tokens=64)
        blocks = [c.alloc(4).tolist() for _ in prompts]
        # Context first: sequences 0 and 1 whole but their last token, 2 its first 25.
        r.run([StepInput(prompts[0][:-1], 0, blocks[0]), StepInput(prompts[1][:-1], 0, blocks[1])])
        r.run([StepInput(prompts[2][:25], 0, blocks[2])])
        step = [
            StepInput(prompts[0][-1:], 22, blocks[0]),  # decode rows
            StepInput(prompts[1][-1:], 8, blocks[1]),
            StepInput(prompts[2][25:], 25, blocks[2]),  # a chunk on cached context
            StepInput(prompts[3], 0, blocks[3]),  # a fresh prompt's chunk
        ]
        if mixed:
            outs.append(np.asarray(r.run(step)))
        else:
            outs.append(np.concatenate([np.asarray(r.run([x])) for x in step]))
        pool.close()
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def test_a_running_stream_gets_a_token_in_every_step_while_a_long_prompt_prefills():
    """Decode rows never wait for a prefill: while a 700-token prompt is prefilled in
    chunks, every step also samples a token for each running stream."""
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool()
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=32, max_model_len=1024)
    got: dict[int, int] = {}

    def on_token(rid, tok, finished):
        got[rid] = got.get(rid, 0) + 1

    streams = [eng.add_request([5, 6, i], SamplingParams(max_tokens=200, ignore_eos=True),
                               on_token) for i in range(2)]  # fmt: skip
    for _ in range(3):
        eng.complete(eng.dispatch())
    prompt = [1 + i % 300 for i in range(700)]
    long = eng.add_request(prompt, SamplingParams(max_tokens=4), on_token)
    prefill_steps = 0
    while long not in got:  # until the long prompt's first token
        before = {r: got[r] for r in streams}
        eng.complete(eng.dispatch())
        prefill_steps += 1
        assert all(got[r] == before[r] + 1 for r in streams)  # a token in this very step
    # 700 tokens in chunks of at most 30 (the streams' rows take 2 of the 32: a budget
    # given is fixed).
    assert prefill_steps == -(-700 // 30)
    for r in (*streams, long):
        eng.abort(r)
    eng.drain()
    eng.reset_prefix_cache()
    assert eng.cache.num_mapped_pages == 0
    eng.close()
    # By default a CPU step's prompt chunk is paced by measured step times (before any
    # measurement: 2 tokens, so 2 streams make a bucket of 4), within 64 tokens.
    default = Engine(model, pool, max_batch=4, max_model_len=1024)
    assert default.scheduler.decode_budget == default.pacer.budget
    assert default.pacer.budget(2) == 4 and default.max_num_batched_tokens == 64
    default.close()
    assert eng.pacer is None  # (a budget given is fixed)
    pool.close()


def test_nothing_compiles_after_warm_up_for_prompts_up_to_3000_tokens_mixed_with_decodes():
    """Warm-up compiles the token buckets; prompts of 1..3000 tokens arriving while others
    decode compile nothing more (not even a retrace)."""
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16, max_prefill_tokens=64,
                 max_model_len=3200)  # fmt: skip
    info = eng.compile()
    assert info["shapes"] == len(eng.runner.token_sizes) == 7  # 1, 2, .., 64: no products
    compiled, events = eng.runner.num_compiled, compile_events()
    rng = np.random.default_rng(1)
    done = threading.Semaphore(0)
    lengths = [1, 2, 3, 17, 64, 65, 300, 1000, 3000]
    with ServingLoop({"m": eng}) as loop:
        for n in lengths:
            prompt = rng.integers(1, 250, n).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(2, 30)), temperature=0.7, seed=n)
            loop.submit("m", prompt, params, lambda k, v: k != "token" and done.release())
        for _ in lengths:
            assert done.acquire(timeout=600)
    assert eng.runner.compiles_after_warmup == 0
    assert eng.runner.num_compiled == compiled
    assert compile_events() == events  # no trace, lowering or compile of anything
    eng.reset_prefix_cache()
    assert eng.cache.num_mapped_pages == 0  # accounting exact after the run
    pool.close()
