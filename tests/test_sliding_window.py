"""Sliding-window attention (Mistral: every layer; GPT-OSS style: alternating windowed and
full layers) through the engine, in every attention implementation, against a dense
no-cache forward with each layer's window; configs declare the windows per layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.attention import no_cache_attend, no_cache_attention
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, ModelConfig, build_model

# Longer than the windows (24, 16): chunks of 16 straddle the window boundary.
PROMPTS = [[256, *range(30, 100)], [256, *range(120, 161)], [256, 7, 8]]


def _greedy_reference(model, prompt, n):
    attend = no_cache_attention(model.config)
    fwd = jax.jit(lambda ids: model(ids, jnp.arange(ids.shape[1])[None], attend))
    toks = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, 128), np.int32)
        ids[0, : len(toks)] = toks
        toks.append(int(np.asarray(fwd(jnp.asarray(ids))[0, len(toks) - 1]).argmax()))
    return toks[len(prompt) :]


def test_configs_declare_each_layers_window():
    assert BUILTIN_CONFIGS["tiny-mistral"].layer_windows() == (24, 24, 24)
    assert BUILTIN_CONFIGS["tiny-swa"].layer_windows() == (16, 0, 16, 0)
    assert BUILTIN_CONFIGS["tiny-llama"].layer_windows() == (0,) * 4
    hf = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2)  # fmt: skip
    assert ModelConfig.from_hf({**hf, "model_type": "mistral", "sliding_window": 4096}
                               ).layer_windows() == (4096, 4096)  # fmt: skip
    assert ModelConfig.from_hf({**hf, "model_type": "qwen2", "sliding_window": 4096}
                               ).layer_windows() == (0, 0)  # use_sliding_window false  # fmt: skip
    mixed = {**hf, "model_type": "llama", "sliding_window": 8,
             "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    assert ModelConfig.from_hf(mixed).layer_windows() == (8, 0)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**mixed, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        ModelConfig.from_hf({**hf, "model_type": "mistral", "sliding_window": -3})


def test_the_window_changes_what_the_model_computes():
    """The reference itself sees the window (else the tests below prove nothing)."""
    model = build_model(BUILTIN_CONFIGS["tiny-swa"], seed=0)
    ids = jnp.asarray([PROMPTS[0]])
    pos = jnp.arange(ids.shape[1])[None]
    windowed = model(ids, pos, no_cache_attention(model.config))
    full = model(ids, pos, no_cache_attend)
    np.testing.assert_allclose(windowed[0, :16], full[0, :16], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(windowed[0, 40:] - full[0, 40:])).max() > 1e-3


@pytest.mark.parametrize(
    "name, attention",
    # (the interpreted kernel is slow: once, on the preset with both groups)
    [(n, a) for n in ("tiny-mistral", "tiny-swa") for a in ("host", "xla")]
    + [("tiny-swa", "pallas-interpret")],
)
def test_greedy_matches_the_windowed_reference(name, attention):
    model = build_model(BUILTIN_CONFIGS[name], seed=4)
    pool = kv.Pool("128MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    # 16-token steps straddle the window boundary in every path; the interpreted kernel
    # (slow: a step is many interpreted grid cells) takes 48-token ones, still straddling.
    step = 48 if attention == "pallas-interpret" else 16
    eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=step, attention=attention)
    n = 3 if attention == "pallas-interpret" else 6  # (its decode steps are the slow part)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _greedy_reference(model, prompt, n), (name, attention)
    eng.reset_prefix_cache()
    assert eng.cache.num_mapped_pages == 0  # accounting exact after the run
    pool.close()
