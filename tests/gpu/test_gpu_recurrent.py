"""Recurrent state on a GPU: engines over the tiny Qwen3-Next (Gated DeltaNet) and
Granite 4.0-H (Mamba2) presets give the CPU's greedy tokens with the Pallas kernel and the
XLA path for their attention layers (the recurrence runs in XLA: chunked for prefill, one
update a decode step), and a repeated prompt restores its state checkpoint with the same
tokens; mapped bytes are the cached blocks' pages after the run. Skipped only when no GPU
is present."""

import jax
import pytest
from conftest import gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

pytestmark = needs_gpu("GPU recurrent tests")


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-granite-4.0-h"])
def test_the_recurrent_presets_give_the_cpus_tokens_on_the_gpu(name):
    cfg = BUILTIN_CONFIGS[name]
    prompts = [[256, *range(20, 120)], [256, 9, 8, 7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    runs = (("host", "host", jax.devices("cpu")[0]), ("cuda", "pallas", gpus()[0]),
            ("cuda", "xla", gpus()[0]))  # fmt: skip
    for backend, attention, device in runs:
        with jax.default_device(device):
            pool = kv.Pool("64MiB", backend=backend)
            eng = Engine(build_model(cfg, seed=0), pool, max_batch=2, max_model_len=256,
                         attention=attention, max_num_batched_tokens=32)  # fmt: skip
            got = [o.token_ids for o in eng.generate(prompts, params)]
            again = eng.generate(prompts[:1], params)[0]
            assert again.token_ids == got[0] and again.cached_tokens == 96
            outs[attention] = got
            cached = eng.kv.prefix_caches
            assert eng.cache.num_used_blocks == sum(pc.num_cached_blocks for pc in cached)
            eng.close()
            pool.close()
    assert outs["pallas"] == outs["host"] == outs["xla"]
