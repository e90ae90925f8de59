"""Latent attention and attention sinks on a GPU: the write kernel stores one plane a
layer (no V), the Pallas kernel and XLA read the latent as keys and values and add GPT-OSS's
sinks, and engines over the tiny DeepSeek-V3 and GPT-OSS presets give the CPU's greedy
tokens with either. Skipped only when no GPU is present."""

import jax
import pytest
from conftest import gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

pytestmark = needs_gpu("GPU MLA tests")


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-gpt-oss"])
def test_the_presets_give_the_cpus_tokens_on_the_gpu(name):
    cfg = BUILTIN_CONFIGS[name]
    prompts = [[256, *range(20, 60)], [256, 9, 8, 7]]
    outs = {}
    runs = (("host", "host", jax.devices("cpu")[0]), ("cuda", "pallas", gpus()[0]),
            ("cuda", "xla", gpus()[0]))  # fmt: skip
    for backend, attention, device in runs:
        with jax.default_device(device):
            pool = kv.Pool("64MiB", backend=backend)
            eng = Engine(build_model(cfg, seed=0), pool, max_batch=2, max_model_len=128,
                         attention=attention)  # fmt: skip
            if cfg.mla is not None:
                assert eng.cache.latent and eng.cache.pages_per_kv_page == cfg.num_layers
            got = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
            outs[attention] = [o.token_ids for o in got]
            eng.close()
            pool.close()
    assert outs["pallas"] == outs["host"] == outs["xla"]
