"""Logit processing, log-probabilities and n samples of one prompt, in the engine:
against references computed here (numpy, and a dense no-cache forward of the model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import host_pool

from jax_kvcached.engine.attention import no_cache_attend
from jax_kvcached.engine.compile_events import compile_events
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams, process_logits, token_logprobs
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

PROMPT = [256, *range(40, 77)]  # 38 tokens: two full blocks and a partial one


def _np_process(logits, generated, prompt, presence, frequency, repetition, bias):
    """The reference: OpenAI's presence / frequency penalties over generated tokens,
    the repetition penalty over prompt and generated tokens, additive biases."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(out))
    seen = counts > 0
    seen[list(prompt)] = True
    if repetition != 1.0:
        out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    out -= presence * (counts > 0) + frequency * counts
    for t, b in bias.items():
        out[t] += b
    return out


def _entries(generated, prompt, bias, repetition):
    w = {}
    for t in generated:
        w.setdefault(t, [0.0, 0.0, 0.0])[0] += 1
    if repetition != 1.0:
        for t in set(prompt):
            w.setdefault(t, [0.0, 0.0, 0.0])[1] = 1.0
    for t, b in bias.items():
        w.setdefault(t, [0.0, 0.0, 0.0])[2] += b
    return np.fromiter(w, np.int32, len(w)), np.asarray(list(w.values()), np.float32).T


def test_process_logits_matches_the_reference_and_is_batch_independent():
    rng = np.random.default_rng(0)
    v, p = 300, 64
    rows = []
    for r in range(4):
        gen = rng.integers(0, v, rng.integers(0, 20)).tolist()
        prompt = rng.integers(0, v, 10).tolist()
        bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, v, 3)}
        pen = (float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2)), [1.0, 1.3, 0.7, 2.0][r])
        rows.append((rng.standard_normal(v).astype(np.float32) * 3, gen, prompt, bias, pen))

    def run(subset):
        b = len(subset)
        ids, w = np.zeros((b, p), np.int32), np.zeros((3, b, p), np.float32)
        pens = np.zeros((3, b), np.float32)
        for i, (_, gen, prompt, bias, pen) in enumerate(subset):
            e_ids, e_w = _entries(gen[:-1], prompt, bias, pen[2])  # last one: on device
            ids[i, : len(e_ids)], w[:, i, : len(e_ids)] = e_ids, e_w
            pens[:, i] = pen
        prev = np.asarray([r[1][-1] if r[1] else -1 for r in subset], np.int32)
        logits = np.stack([r[0] for r in subset])
        return np.asarray(process_logits(jnp.asarray(logits), ids, w, pens, prev))

    out = run(rows)
    for i, (logits, gen, prompt, bias, (pr, fr, rep)) in enumerate(rows):
        want = _np_process(logits, gen, prompt, pr, fr, rep, bias)
        np.testing.assert_allclose(out[i], want, rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the batch around it
    np.testing.assert_array_equal(run(rows[2:3])[0], out[2])
    np.testing.assert_array_equal(run(rows[::-1])[1], out[2])


def test_token_logprobs_are_the_log_softmax():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 4
    toks = np.array([3, 0, 49])
    chosen, ids, lps = (np.asarray(x) for x in token_logprobs(jnp.asarray(logits), toks, 5))
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, ref[np.arange(3), toks], atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-logits, axis=-1, kind="stable")[:, :5])
    np.testing.assert_allclose(lps, np.take_along_axis(ref, ids, -1), atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return build_model(BUILTIN_CONFIGS["tiny-llama"], seed=3)


@pytest.fixture(scope="module")
def dense(model):
    fwd = jax.jit(lambda ids: model(ids, jnp.arange(ids.shape[1])[None], _dense_attend))

    def logits_of(tokens):
        """Logits of every position of ``tokens`` (no cache)."""
        ids = np.zeros((1, 128), np.int32)
        ids[0, : len(tokens)] = tokens
        return np.asarray(fwd(jnp.asarray(ids))[0, : len(tokens)], np.float64)

    return logits_of


_dense_attend = no_cache_attend


def _log_softmax(x):
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()




def _accounting_exact(eng, pool):
    """After every request: mapped pages are exactly the cached blocks' pages."""
    c, pc = eng.cache, eng.prefix_cache
    assert c.num_used_blocks == (pc.num_cached_blocks if pc else 0)
    if pc:
        assert pc.num_evictable_blocks == pc.num_cached_blocks
        assert set(c.mapped_page_ids()) == {c.page_of(b) for b in pc.cached_blocks()}
        pc.reset()
    assert pool.stats()["mapped_pages"] == 0


def test_greedy_with_penalties_biases_and_min_tokens_matches_a_reference(model, dense):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16)
    eos = model.config.eos_ids[0]
    cases = [
        dict(presence_penalty=1.5, frequency_penalty=0.7),
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=-0.5, repetition_penalty=0.8, logit_bias=((7, 2.5), (90, -100.0))),
        dict(min_tokens=6, stop_token_ids=(eos,)),
    ]
    params = [SamplingParams(max_tokens=10, **c) for c in cases]
    outs = eng.generate([PROMPT] * len(cases), params)  # one batch: rows side by side
    for c, p, out in zip(cases, params, outs, strict=True):
        toks = list(PROMPT)
        want = []
        for step in range(p.max_tokens):
            logits = dense(toks)[-1]
            bias = dict(p.logit_bias)
            if step < p.min_tokens:
                for t in (*model.config.eos_ids, *p.stop_token_ids):
                    bias[t] = -np.inf
            x = _np_process(logits, want, PROMPT, p.presence_penalty, p.frequency_penalty,
                            p.repetition_penalty, bias)  # fmt: skip
            t = int(np.argmax(x))
            want.append(t)
            toks.append(t)
            if t in (*model.config.eos_ids, *p.stop_token_ids):
                break
        assert out.token_ids == want, c
    # the bias of -100 keeps token 90 out, +2.5 is visible against the unbiased run
    plain = eng.generate([PROMPT], SamplingParams(max_tokens=10))[0].token_ids
    assert outs[0].token_ids != plain or outs[1].token_ids != plain
    _accounting_exact(eng, pool)
    pool.close()


def test_logprobs_and_prompt_logprobs_equal_the_log_softmax(model, dense):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16)
    eng.generate([PROMPT], SamplingParams(max_tokens=2))  # the prompt's blocks are cached
    p = SamplingParams(max_tokens=5, temperature=0.8, seed=4, logprobs=3, prompt_logprobs=True)
    out = eng.generate([PROMPT], p)[0]
    assert out.cached_tokens == 0  # prompt logprobs compute the whole prompt
    full = dense(PROMPT + out.token_ids)
    for i, (lp, top) in enumerate(out.logprobs):
        ref = _log_softmax(full[len(PROMPT) - 1 + i])
        assert lp == pytest.approx(ref[out.token_ids[i]], abs=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-ref, kind="stable")[:3])
        np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1][:3], atol=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        ref = _log_softmax(full[pos - 1])
        lp, top = out.prompt_logprobs[pos]
        assert lp == pytest.approx(ref[PROMPT[pos]], abs=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-ref, kind="stable")[:3])
        np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1][:3], atol=1e-4)
    _accounting_exact(eng, pool)
    pool.close()


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_fork_the_prompt_and_equal_single_seeded_runs(model, caching):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=6, max_num_batched_tokens=16, prefix_caching=caching)

    def params(i):
        return SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i, ignore_eos=True)

    singles = [eng.generate([PROMPT], params(i))[0].token_ids for i in range(4)]
    eng.reset_prefix_cache()
    got: dict[int, list[int]] = {}
    steps_before = eng.steps

    def on_token(rid, tok, finished):
        got.setdefault(rid, []).append(tok)

    first = eng.add_request(PROMPT, params(0), on_token)
    rids = [first] + [eng.add_request(PROMPT, params(i), on_token, fork_of=first)
                      for i in range(1, 4)]  # fmt: skip
    # The parent's prompt (38 tokens: prefill chunks of 16) is computed once: one prefill
    # row per step, then decode steps for all four.
    eng.step()
    assert eng.num_running == 1  # the forks wait for the parent's prompt
    eng.run()
    assert [got[r] for r in rids] == singles
    assert eng.forks == 3 and eng.fork_fallbacks == 0
    assert eng.steps - steps_before <= 3 + 12 + 1
    _accounting_exact(eng, pool)
    pool.close()


def test_a_fork_copies_the_partial_block_and_shares_the_full_ones(model):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=64, prefix_caching=False)
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    first = eng.add_request(PROMPT, p)
    kid = eng.add_request(PROMPT, p, fork_of=first)
    used = eng.cache.num_used_blocks
    eng.dispatch()  # the parent's whole prompt in one step: the fork happens here
    parent, child = (s for s in eng.scheduler.running)
    assert child.request_id == kid and child.forked_from == first
    bs = eng.cache.block_size
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    assert child.num_computed == len(PROMPT) - 1
    assert eng.cache.num_used_blocks - used == 3 + 1  # the parent's 3 blocks + 1 copy
    eng.drain()
    jax.block_until_ready(eng.runner.token)
    view = np.asarray(eng.cache.view)
    n = (len(PROMPT) - 1) % bs  # computed prompt tokens in the copied block
    np.testing.assert_array_equal(view[:, :, child.blocks[2], :n], view[:, :, parent.blocks[2], :n])
    eng.run()
    assert pool.stats()["mapped_pages"] == 0  # shared blocks freed once, by the last holder
    pool.close()


def test_forks_of_an_aborted_parent_run_on_their_own(model):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=16)
    p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    want = eng.generate([PROMPT], p)[0].token_ids
    eng.reset_prefix_cache()
    first = eng.add_request(PROMPT, p)
    got = []
    eng.add_request(PROMPT, p, lambda r, t, f: got.append(t), fork_of=first)
    assert eng.abort(first)
    eng.run()
    assert got == want and eng.fork_fallbacks == 1
    _accounting_exact(eng, pool)
    pool.close()


def test_processing_and_logprobs_compile_nothing_after_warm_up(model):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16, max_model_len=256)
    eng.compile()
    events = compile_events()
    params = [
        SamplingParams(max_tokens=6, logprobs=2, presence_penalty=0.5, logit_bias=((3, 1.0),)),
        SamplingParams(max_tokens=6, temperature=0.7, seed=1, repetition_penalty=1.2,
                       logprobs=0, prompt_logprobs=True),
    ]  # fmt: skip
    first = eng.add_request(PROMPT, params[0])
    eng.add_request(PROMPT, params[0], fork_of=first)
    eng.run()
    eng.generate([PROMPT, PROMPT[:5]], params)
    assert eng.runner.compiles_after_warmup == 0
    assert compile_events() == events
    pool.close()


def test_bad_logit_bias_and_stop_ids_are_refused(model):
    pool = host_pool("128MiB")
    eng = Engine(model, pool, max_batch=2)
    v = model.config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request(PROMPT, SamplingParams(logit_bias=((v, 1.0),)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request(PROMPT, SamplingParams(stop_token_ids=(v + 5,)))
    for bad in (
        dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
        dict(logprobs=21),
        dict(min_tokens=20, max_tokens=4),
        dict(logit_bias=((1, 1.0), (1, 2.0))),
        dict(logit_bias=((1, float("nan")),)),
    ):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**bad)
    pool.close()


def test_fused_sampling_is_one_dispatch_and_samples_as_the_separate_programs(model):
    """Sampling inside a decode-sized step (one program per step) gives the tokens and
    log-probabilities of the sampler dispatched behind the step. A row with penalties or
    biases adds processing and sampling on the processed logits (and their
    log-probabilities) behind the step either way."""
    cases = [  # (params, programs per step: fused, separate)
        (SamplingParams(max_tokens=5, ignore_eos=True), 1, 2),
        (SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3), 1, 2),
        (SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2), 1, 3),
        (SamplingParams(max_tokens=5, ignore_eos=True, presence_penalty=0.5), 3, 3),
        (SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={3: 1.0}, logprobs=1), 4, 4),
    ]
    pool = host_pool("128MiB")
    outputs = {}
    for fuse in (True, False):
        eng = Engine(model, pool, name=f"m{fuse}", max_batch=2, max_num_batched_tokens=16,
                     max_model_len=256, fuse_sampling=fuse)  # fmt: skip
        runner, seen = eng.runner, []
        run = runner.execute

        def recording(step, run=run, runner=runner, seen=seen):
            before = runner.dispatches
            out = run(step)
            seen.append((step.shape[0], runner.dispatches - before))
            return out

        runner.execute = recording
        for params, fused, separate in cases:
            seen.clear()
            # the prompts prefill in one 16-token step (separate sampler), then decode
            # steps of 2 rows (fused when on)
            out = eng.generate([PROMPT[:6], PROMPT[:4]], params)
            assert all(len(o.token_ids) == 5 for o in out)
            assert {t for t, _ in seen} == {16, 2}
            for t, n in seen:
                assert n == (fused if fuse and t <= runner.max_rows else separate), (params, t)
            outputs.setdefault(repr(params), []).append([(o.token_ids, o.logprobs) for o in out])
        _accounting_exact(eng, pool)
        eng.close()
    for key, (fused_out, separate_out) in outputs.items():
        assert fused_out == separate_out, key
    pool.close()


def test_a_fused_prefill_step_scores_its_prompt_as_a_separate_one(model):
    """A prompt short enough for a decode-sized step prefills in a fused step: its prompt
    log-probabilities, sampled tokens and their log-probabilities equal the run that
    samples behind the step."""
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=5, logprobs=2,
                            prompt_logprobs=True)  # fmt: skip
    pool = host_pool("128MiB")
    got = []
    for fuse in (True, False):
        eng = Engine(model, pool, name=f"p{fuse}", max_batch=8, max_num_batched_tokens=16,
                     max_model_len=128, fuse_sampling=fuse)  # fmt: skip
        assert eng.runner.step_spec.fused(8) is fuse
        (out,) = eng.generate([PROMPT[:6]], params)  # one 8-token prefill step
        assert len(out.prompt_logprobs) == 6 and out.prompt_logprobs[1] is not None
        got.append((out.token_ids, out.logprobs, out.prompt_logprobs))
        _accounting_exact(eng, pool)
        eng.close()
    assert got[0] == got[1]
    pool.close()
