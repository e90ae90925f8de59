"""Tensor-parallel engines on four CPU devices (conftest forces them): TP=1/2/4 give the
same tokens and logits for both model families and the real default model, prefix
caching, preemption and two tenants under TP with exact per-device accounting, and two
processes (jax.distributed, gloo) equal to one."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dist_addr, tp_pool
from jax.sharding import Mesh

import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams
from jax_kvcached.engine.compile_events import compile_events
from jax_kvcached.engine.runner import StepInput
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices (conftest)")

# The tiny presets with 4 KV heads, so they split over 1, 2 and 4 devices.
LLAMA = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], num_heads=8, num_kv_heads=4, head_dim=16)
QWEN2 = dataclasses.replace(BUILTIN_CONFIGS["tiny-qwen2"], num_heads=8, num_kv_heads=4, head_dim=16)
PROMPTS = [list(range(1, 22)), [5, 6, 7], list(range(40, 90))]


def test_a_mesh_other_than_the_pools_or_heads_that_do_not_split_are_errors():
    with tp_pool(2) as pool:
        other = Mesh(np.array(CPUS[2:4]), ("tp",))
        with pytest.raises(ValueError, match="does not match the pool's"):
            Engine(build_model(LLAMA), pool, mesh=other)
        with kv.Pool("8MiB", backend="host") as one:
            with pytest.raises(ValueError, match="does not match the pool's"):
                Engine(build_model(LLAMA), one, mesh=pool.mesh)
        # heads that do not split: the model's plan says which
        bad = dataclasses.replace(LLAMA, num_heads=6, num_kv_heads=2, intermediate_size=255)
        with pytest.raises(ValueError, match="MLP units"):
            Engine(build_model(bad), pool, max_model_len=64)
        assert pool.caches == {}  # the failed engine's cache is gone again
        with pytest.raises(ValueError, match="does not match the pool's"):
            Engine(build_model(LLAMA), pool, mesh=Mesh(np.array(CPUS[:2]), ("x",)))


# -- engines ----------------------------------------------------------------------------
def _generate(cfg, tp, attention="host", params=None, **kw):
    pool = tp_pool(tp)
    eng = Engine(build_model(cfg, seed=0), pool, max_batch=4, max_num_batched_tokens=32,
                 max_model_len=256, attention=attention, **kw)  # fmt: skip
    outs = eng.generate(PROMPTS, params or SamplingParams(max_tokens=10))
    return [o.token_ids for o in outs], eng, pool


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_tp_1_2_4_give_the_same_tokens_and_logits(cfg):
    tokens, logits = {}, {}
    for tp in (1, 2, 4):
        tokens[tp], eng, pool = _generate(cfg, tp)
        # One prefill step's logits, on fresh blocks.
        blocks = eng.cache.alloc(2).tolist()
        logits[tp] = np.asarray(eng.runner.run([StepInput(list(range(3, 30)), 0, blocks)]))
        eng.cache.free(blocks)
        assert eng.cache.tensor_parallel == tp
        # Every request done: what stays mapped is the prefix cache's, on every device.
        cached = eng.prefix_cache.stats()["cached_blocks"]
        pages = {eng.cache.page_of(b) for b in eng.prefix_cache.cached_blocks()}
        assert cached > 0 and eng.cache.num_used_blocks == cached
        assert eng.cache.mapped_pages_per_device() == [len(pages) * 2 * cfg.num_layers] * tp
        pool.close()
    assert tokens[1] == tokens[2] == tokens[4]
    np.testing.assert_allclose(logits[2], logits[1], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[4], logits[1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["xla", "pallas-interpret"])
def test_every_attention_path_runs_under_tp(attention):
    short = SamplingParams(max_tokens=3)  # the interpreted kernel is slow
    one, _, p1 = _generate(LLAMA, 1, attention, short)
    two, _, p2 = _generate(LLAMA, 2, attention, short)
    p1.close(), p2.close()
    assert one == two


@pytest.mark.parametrize("tp", [1, 2])
def test_a_warm_engine_compiles_nothing_more(tp):
    # The warm-up's placement (replicated token, logits, sampled tokens) matches what
    # serving passes: no compile and not even a retrace after Engine.compile(). (Tests
    # run under jax.default_device, which jit's cache keys on, and warm-up compiles in
    # worker threads outside it: the runner pins its own.)
    with tp_pool(tp) as pool:
        eng = Engine(build_model(LLAMA), pool, max_batch=2, max_num_batched_tokens=16,
                     max_model_len=32)  # fmt: skip
        eng.compile()
        events = compile_events()
        eng.generate([[1, 2, 3, 4, 5], list(range(9, 29))], SamplingParams(max_tokens=6))
        assert eng.runner.compiles_after_warmup == 0
        assert compile_events() == events


def test_seeded_sampling_is_the_same_under_tp():
    """Also with the sampler inside the step (every device samples the replicated logits
    under shard_map): the same tokens as the sampler dispatched behind it."""
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    one, _, p1 = _generate(LLAMA, 1, params=params)
    four, _, p4 = _generate(LLAMA, 4, params=params)
    fused, eng, p5 = _generate(LLAMA, 4, params=params, fuse_sampling=True)
    assert eng.runner.step_spec.fuse
    p1.close(), p4.close(), p5.close()
    assert one == four == fused


def test_prefix_caching_preemption_and_two_tenants_under_tp():
    # Two tenants share a TP=2 pool too small for both to run everything at once: the
    # second sees prefix hits, someone is preempted, the outputs equal one device's.
    prompts = [list(range(1, 60)) + [i] for i in range(6)]
    params = SamplingParams(max_tokens=16)

    def run(pool):
        a = Engine(build_model(LLAMA, seed=0), pool, name="a", max_batch=6,
                   max_num_batched_tokens=32,
                   max_model_len=128)  # fmt: skip
        b = Engine(build_model(QWEN2, seed=1), pool, name="b", max_batch=6,
                   max_num_batched_tokens=32,
                   max_model_len=128)  # fmt: skip
        out_a = a.generate(prompts, params)
        out_b = b.generate(prompts, params)
        stats = (a.num_preemptions + b.num_preemptions,
                 sum(o.cached_tokens for o in out_a + out_b))  # fmt: skip
        for e in (a, b):  # exact accounting per device
            pages = {e.cache.page_of(x) for x in e.prefix_cache.cached_blocks()}
            assert e.cache.num_used_blocks == e.prefix_cache.stats()["cached_blocks"]
            planes = 2 * e.config.num_layers
            assert e.cache.mapped_pages_per_device() == [len(pages) * planes] * pool.tensor_parallel
        return [o.token_ids for o in out_a + out_b], stats

    # A block is 4 KiB per plane on one device (4 heads x 16 x fp32 x 16 tokens), 2 KiB
    # on each of two: with half the page size, both pools hold 4 blocks a page and the
    # same number of pages, so they schedule alike.
    with tp_pool(1, "640KiB", page_size="16KiB") as p1:
        one, (pre1, hits1) = run(p1)
    with tp_pool(2, "320KiB", page_size="8KiB") as p2:
        two, (pre2, hits2) = run(p2)
    assert one == two
    assert (pre1, hits1) == (pre2, hits2)
    assert hits2 > 0 and pre2 > 0


@pytest.mark.parametrize("quantization", ["none", None])
def test_the_real_model_over_three_devices_equals_one(quantization):
    # SmolLM2-135M: 9 heads, 3 KV heads, split over three devices; dequantized, and with
    # its weights packed as the GGUF stores them (values, scales and mins split alike).
    from jax_kvcached.models import load_pretrained

    pre = load_pretrained("smollm2-135m", dtype=jnp.float32, quantization=quantization)
    prompt = pre.tokenizer.encode("The capital of France is")
    out, logits = {}, {}
    for tp in (1, 3):
        pool = tp_pool(tp, "256MiB")
        eng = Engine(pre.model, pool, max_batch=2, max_num_batched_tokens=32, max_model_len=128)
        out[tp] = eng.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
        blocks = eng.cache.alloc(2).tolist()
        logits[tp] = np.asarray(eng.runner.run([StepInput(prompt, 0, blocks)]))
        eng.cache.free(blocks)
        pool.close()
    assert out[1] == out[3]
    if quantization == "none":
        np.testing.assert_allclose(logits[3], logits[1], atol=2e-3, rtol=1e-3)
    else:
        # Activations are rounded to int8 per block: a last-bit difference in an input
        # (another fusion under the split) can flip a rounding, and 30 layers carry it to
        # ~3% of the logits' range. A wrongly split weight is off by far more.
        err = np.abs(logits[3] - logits[1]).max()
        assert err < 0.1 * np.abs(logits[1]).max(), err
        assert logits[3].argmax() == logits[1].argmax()
    with tp_pool(2, "64MiB") as pool, pytest.raises(ValueError, match="3 KV heads"):
        Engine(pre.model, pool, max_model_len=128)


# -- two processes ------------------------------------------------------------------------
WORKER = textwrap.dedent(
    """
    import dataclasses, json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
    import jax_kvcached as kv
    from jax_kvcached import Engine, SamplingParams
    from jax_kvcached.models import BUILTIN_CONFIGS, build_model
    cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], **json.loads(sys.argv[3]))
    pool = kv.Pool("64MiB", backend="host", devices=jax.devices())
    eng = Engine(build_model(cfg, seed=0), pool, max_batch=4, max_num_batched_tokens=32,
                 max_model_len=256)
    outs = eng.generate(json.loads(sys.argv[4]), SamplingParams(max_tokens=10))
    print("RESULT", json.dumps({"tokens": [o.token_ids for o in outs],
                               "devices": len(pool.devices),
                               "local": pool.mapped_pages_per_device()}), flush=True)
    """
)




def test_two_processes_with_gloo_equal_one_process(tmp_path):
    changes = json.dumps({"num_heads": 8, "num_kv_heads": 4, "head_dim": 16})
    addr = dist_addr()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), addr, changes, json.dumps(PROMPTS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,  # the installed package, not the source tree
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[7:]))
    one, _, pool = _generate(LLAMA, 1)
    pool.close()
    for r in results:
        assert r["devices"] == 4 and len(r["local"]) == 2  # each maps its own two
        assert r["tokens"] == one
    assert results[0]["local"] != results[1]["local"]  # different devices, same pages
    assert set(results[0]["local"].values()) == set(results[1]["local"].values())


def test_kv_cache_groups_under_tp_give_the_same_tokens_and_exact_accounting():
    """A hybrid model (windowed and full layers): each group's pages on every device."""
    cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-swa"], num_heads=8, num_kv_heads=4,
                              head_dim=16, sliding_window=8)  # fmt: skip
    tokens = {}
    for tp in (1, 2):
        tokens[tp], eng, pool = _generate(cfg, tp)
        assert eng.cache.num_groups == 2 and eng.cache.tensor_parallel == tp
        per_device = 0
        for g, pc in zip(eng.cache.groups, eng.kv.prefix_caches, strict=True):
            pages = {g.page_of(b) for b in pc.cached_blocks()}
            assert set(g.mapped_page_ids()) == pages
            per_device += len(pages) * g.pages_per_kv_page
        assert eng.cache.mapped_pages_per_device() == [per_device] * tp
        pool.close()
    assert tokens[1] == tokens[2]
