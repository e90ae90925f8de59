"""The engine end to end on the CUDA backend, with the Pallas paged-attention kernel
compiled for the GPU. Skipped only when no GPU is present."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached.engine.attention import Ragged, paged_attention, ragged_layout
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.pallas_attention import pallas_paged_attention
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

pytestmark = needs_gpu("GPU engine tests")

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, *range(40, 77)], [256, 9], [256, *range(1, 70)]]


def _run(backend, device, attention="auto", devices=None, host_cache_tokens=0,
         command_buffers=None):  # fmt: skip
    with jax.default_device(device):
        model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=3)
        where = {"devices": devices} if devices else {}
        pool = kv.Pool("256MiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0,
                       **where)  # fmt: skip
        eng = Engine(
            model, pool, name="m", max_batch=4, attention=attention,
            host_cache_tokens=host_cache_tokens, command_buffers=command_buffers,
        )  # fmt: skip
        view = eng.cache.view
        for shard, buf in zip(view.addressable_shards, eng.cache.shards, strict=True):
            assert shard.data.unsafe_buffer_pointer() == buf.base  # zero-copy
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
        if host_cache_tokens:  # evict to the host tier, then restore every prefix
            eng.prefix_cache.evict(10**6)
            again = eng.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
            assert [o.token_ids for o in again] == [o.token_ids for o in outs]
            assert eng.stats()["host_cache"]["restores"] >= 2
        eng.reset_prefix_cache()
        assert set(pool.mapped_pages_per_device().values()) == {0}  # nothing leaks
        pool.close()
    return [o.token_ids for o in outs]


def test_engine_on_cuda_matches_the_cpu_run():
    cpu = _run("host", jax.devices("cpu")[0])
    assert _run("cuda", gpus()[0]) == cpu  # the Pallas kernel (auto on CUDA)
    assert _run("cuda", gpus()[0], attention="xla") == cpu


def test_steps_replayed_as_cuda_graphs_match_ordinary_launches():
    """Command buffers on (default: the K/V write, the sampler's branches and the layer
    loop captured) and off: the same tokens as the CPU run; a replay sees each step's
    new slots, tables and pages (the write checks them on the device)."""
    cpu = _run("host", jax.devices("cpu")[0])
    assert _run("cuda", gpus()[0], command_buffers=True) == cpu
    assert _run("cuda", gpus()[0], command_buffers=False) == cpu


def test_host_tier_on_cuda_restores_what_it_evicted():
    cpu = _run("host", jax.devices("cpu")[0])
    assert _run("cuda", gpus()[0], host_cache_tokens=4096) == cpu


def test_tensor_parallel_engine_on_cuda_matches_the_cpu_run():
    # tiny-llama has 2 KV heads: TP over two GPUs where present, else a mesh of one (the
    # mesh path: shard_map, the FFI handlers finding the buffer by the GPU's ordinal).
    two = gpus()[:2]
    cpu = _run("host", jax.devices("cpu")[0])
    assert _run("cuda", two[0], devices=two) == cpu


@pytest.mark.parametrize("window", [0, 48])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bs,groups,splits,tile", [(16, 1, 1, 1), (32, 4, 2, 16), (64, 8, 4, 8)])
def test_pallas_kernel_matches_the_xla_path_on_gpu(dtype, bs, groups, splits, tile, window):
    """Ragged steps on the GPU: decode rows and chunks of several sequences, the kernel
    against the XLA path over the same layout, with and without a sliding window, the
    layer (1 of 2) a traced operand (the flat-view ids the compiled kernel uses)."""
    with jax.default_device(gpus()[0]):
        pool = kv.Pool("512MiB", backend="cuda", min_reserved_pages=0, max_reserved_pages=0)
        c = pool.create_kv_cache("a", 2, 2, 64, dtype, block_size=bs)
        rng = np.random.default_rng(bs)
        kv_lens = [1, 5, bs * 3 + 1, 700]
        q_lens = [1, 5, 1, 40] if tile > 1 else [1, 1, 1, 1]
        nb = -(-max(kv_lens) // bs)
        tables = np.zeros((4, nb), np.int32)
        from jax_kvcached.memory import ops

        for i, n in enumerate(kv_lens):
            k = -(-n // bs)
            tables[i, :k] = c.alloc(k)
            kv_ = jnp.asarray(rng.standard_normal((2, n, 2, 64)), dtype)
            slots = c.slot_mapping(tables[i, :k], np.arange(n))
            ops.write_kv(c, 0, kv_, -kv_, jnp.asarray(slots), ops.new_token()).block_until_ready()
        tokens = 64 if tile > 1 else 4
        q = jnp.asarray(rng.standard_normal((tokens, 2 * groups, 64)), jnp.float32)
        lay = Ragged(**{k: jnp.asarray(v) for k, v in
                        ragged_layout(q_lens, kv_lens, tables, tokens, tile).items()})  # fmt: skip
        layer, w = jnp.int32(1), jnp.int32(window)
        want = jax.jit(paged_attention)(q, c.view, layer, lay, w)
        got = jax.jit(lambda *a: pallas_paged_attention(*a[:4], num_splits=splits, window=a[4])
                      )(q, c.view, layer, lay, w)  # fmt: skip
        tol = 1e-4 if dtype == "float32" else 2e-2
        n = sum(q_lens)
        np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=tol, rtol=tol)
        pool.close()


def _features(backend, device):
    """n forks of one prompt (copy-on-write through copy_blocks), penalties, a bias,
    logprobs and prompt logprobs; returns the tokens and the log-probabilities."""
    with jax.default_device(device):
        model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=3)
        pool = kv.Pool("256MiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
        eng = Engine(model, pool, name="m", max_batch=4)
        p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, presence_penalty=0.8,
                           repetition_penalty=1.2, logit_bias=((7, 1.5),))  # fmt: skip
        got: dict[int, list[int]] = {}
        first = eng.add_request(PROMPTS[1], p, lambda r, t, f: got.setdefault(r, []).append(t))
        for _ in range(2):
            eng.add_request(PROMPTS[1], p, lambda r, t, f: got.setdefault(r, []).append(t),
                            fork_of=first)  # fmt: skip
        eng.run()
        assert eng.forks == 2
        scored = eng.generate([PROMPTS[3]], SamplingParams(max_tokens=2, prompt_logprobs=True,
                                                           logprobs=0))[0]  # fmt: skip
        eng.reset_prefix_cache()
        assert set(pool.mapped_pages_per_device().values()) == {0}
        pool.close()
    lps = [lp for lp, _ in scored.logprobs] + [e[0] for e in scored.prompt_logprobs[1:]]
    return [got[r] for r in sorted(got)], np.asarray(lps)


def test_forks_penalties_and_logprobs_on_cuda_match_the_cpu_run():
    cpu_toks, cpu_lps = _features("host", jax.devices("cpu")[0])
    gpu_toks, gpu_lps = _features("cuda", gpus()[0])
    assert gpu_toks == cpu_toks and len({tuple(t) for t in cpu_toks}) == 1  # greedy forks
    np.testing.assert_allclose(gpu_lps, cpu_lps, atol=2e-2)


def test_kv_cache_groups_on_cuda_match_the_cpu_run():
    """A hybrid model on CUDA pages: each group's pages mapped on the device, the CUDA
    write kernel checking each layer against its group's page map, the Pallas kernel (and
    the XLA path) reading each layer through its group's tables; the sliding group's
    blocks below the window freed; the same tokens as the CPU run, nothing leaked."""

    def run(backend, device, attention="auto", free=True, host=0):
        with jax.default_device(device):
            model = build_model(BUILTIN_CONFIGS["tiny-swa"], seed=3)
            pool = kv.Pool("256MiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
            eng = Engine(model, pool, name="h", max_batch=4, attention=attention,
                         max_num_batched_tokens=32, free_window_blocks=free,
                         host_cache_tokens=host)  # fmt: skip
            assert eng.cache.num_groups == (2 if free else 1)
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            outs = [o.token_ids for o in eng.generate(PROMPTS, params)]
            if host:  # each group's idle prefixes to its page-locked tier
                eng.sleep()
                eng.wake()
            # Follow-up turns hit the full group's prefix and the sliding group's window.
            follow = [[*p, *o, 5, 6, 7] for p, o in zip(PROMPTS, outs, strict=True)]
            outs += [o.token_ids for o in eng.generate(follow, params)]
            if host:
                assert eng.stats()["host_cache"]["restores"] > 0
            eng.reset_prefix_cache()
            assert set(pool.mapped_pages_per_device().values()) == {0}
            pool.close()
        return outs

    cpu = run("host", jax.devices("cpu")[0])
    assert run("cuda", gpus()[0]) == cpu
    assert run("cuda", gpus()[0], attention="xla") == cpu
    assert run("cuda", gpus()[0], free=False) == cpu
    assert run("cuda", gpus()[0], host=4096) == cpu


def test_forks_of_a_hybrid_model_on_cuda_match_the_cpu_run():
    """n forks of one prompt on a model with a sliding group: the partial block is copied
    per KV cache group (the CUDA copy kernel once per plane of the group), the full
    blocks shared in both groups; greedy forks give the CPU run's tokens, nothing leaks."""

    def run(backend, device):
        with jax.default_device(device):
            model = build_model(BUILTIN_CONFIGS["tiny-swa"], seed=3)
            pool = kv.Pool("256MiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
            eng = Engine(model, pool, name="h", max_batch=4, max_num_batched_tokens=16,
                         prefix_caching=False)  # fmt: skip
            assert eng.cache.num_groups == 2
            got: dict[int, list[int]] = {}
            p = SamplingParams(max_tokens=8, ignore_eos=True)
            first = eng.add_request(PROMPTS[3], p, lambda r, t, f: got.setdefault(r, []).append(t))
            for _ in range(2):
                eng.add_request(PROMPTS[3], p, lambda r, t, f: got.setdefault(r, []).append(t),
                                fork_of=first)  # fmt: skip
            eng.run()
            assert eng.forks == 2 and eng.fork_fallbacks == 0
            assert set(pool.mapped_pages_per_device().values()) == {0}
            pool.close()
        return [got[r] for r in sorted(got)]

    cpu = run("host", jax.devices("cpu")[0])
    assert len({tuple(t) for t in cpu}) == 1  # greedy: every fork samples the same
    assert run("cuda", gpus()[0]) == cpu


def _structured(backend, device):
    import json

    from jax_kvcached.engine.structured import Structured
    from jax_kvcached.models import ByteTokenizer

    with jax.default_device(device):
        pool = kv.Pool("256MiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
        eng = Engine(build_model(BUILTIN_CONFIGS["tiny-llama"], seed=3), pool, name="m",
                     max_batch=4, tokenizer=ByteTokenizer())  # fmt: skip
        specs = [Structured("regex", "[0-9]{2}-[a-z]{3}"),
                 Structured("choice", json.dumps(["red", "green"]))]  # fmt: skip
        outs = eng.generate(PROMPTS[:3], [SamplingParams(max_tokens=16, structured=s)
                                          for s in specs] + [SamplingParams(max_tokens=8)])
        eng.reset_prefix_cache()
        assert set(pool.mapped_pages_per_device().values()) == {0}
        pool.close()
    return [o.text for o in outs]


def test_structured_outputs_on_cuda_match_the_cpu_run():
    """The grammar's token mask runs behind the step on the device (greedy rows): the
    same texts as the CPU run, each of its structure."""
    import re

    cpu = _structured("host", jax.devices("cpu")[0])
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", cpu[0]) and cpu[1] in ("red", "green")
    assert _structured("cuda", gpus()[0]) == cpu
