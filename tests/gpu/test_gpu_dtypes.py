"""Right answers by default on a GPU: the trained model's greedy tokens in bf16 (the GPU
default) agree with fp32 over the first 16 tokens of the demo's prompts. Skipped only
when no GPU is present; the model's file must be on the machine (scripts/gpu-check.sh
points KVCACHED_MODEL_CACHE at a copy)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams
from jax_kvcached.demo import CHATS
from jax_kvcached.models import default_dtype, download

pytestmark = needs_gpu("GPU dtype tests")


def test_bf16_default_agrees_with_fp32_on_the_demo_prompts():
    assert default_dtype(gpus()[0]) == jnp.bfloat16
    if download.find("smollm2-135m") is None:
        pytest.fail("smollm2-135m is not on this machine: copy it into $KVCACHED_MODEL_CACHE")
    tokens = {}
    with jax.default_device(gpus()[0]):
        pool = kv.Pool("1GiB", backend="cuda")
        for dtype in (jnp.float32, jnp.bfloat16):
            eng = Engine.from_pretrained("smollm2-135m", pool, dtype=dtype, name=str(dtype))
            outs = eng.chat([[{"role": "user", "content": c}] for c in CHATS],
                            SamplingParams(max_tokens=16, ignore_eos=True))  # fmt: skip
            tokens[dtype] = [o.token_ids for o in outs]
            eng.close()
        pool.close()
    for chat, a, b in zip(CHATS, tokens[jnp.float32], tokens[jnp.bfloat16], strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"{chat!r}: bf16 leaves fp32's greedy path at token {first}"
