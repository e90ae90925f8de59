"""Qwen3, Gemma 3 and Mistral from Hugging Face folders (config.json + safetensors, as
transformers writes them): small random models, logits against transformers' own
forward; the random tiny presets through the engine against a dense reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_logits_match, dense_greedy

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model, load_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, attn_implementation="eager")  # fmt: skip


def _hf(kind):
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, tie_word_embeddings=False)
        return transformers.Qwen3ForCausalLM(cfg)
    if kind == "qwen3-yarn":  # YaRN (factor 4 over 128 original positions)
        cfg = transformers.Qwen3Config(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0})
        return transformers.Qwen3ForCausalLM(cfg)
    if kind == "mistral":
        cfg = transformers.MistralConfig(**COMMON, sliding_window=12)
        return transformers.MistralForCausalLM(cfg)
    cfg = transformers.Gemma3TextConfig(
        **COMMON, sliding_window=12, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # norms start at 0 (x * (1 + 0)): make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "mistral", "qwen3-yarn"])
def test_hf_folder_matches_transformers(kind, tmp_path):
    hf = _hf(kind).eval()
    hf.save_pretrained(tmp_path)
    cfg, model = load_checkpoint(str(tmp_path), dtype=jnp.float32)
    assert cfg.qk_norm == (kind != "mistral")
    if kind in ("gemma3", "mistral"):  # both windowed, on the layers transformers windows
        assert cfg.sliding_window == 12
    if kind == "qwen3-yarn":
        assert cfg.rope_scaling_dict["rope_type"] == "yarn"
    assert_logits_match(hf, model, cfg)


@pytest.mark.parametrize(
    "name", ["tiny-qwen3", "tiny-gemma3", "tiny-qwen3-moe", "tiny-deepseek-v2-lite", "tiny-gpt-oss"]
)
def test_presets_through_the_engine_match_the_dense_reference(name):
    model = build_model(BUILTIN_CONFIGS[name], seed=0)
    pool = kv.Pool("32MiB", page_size="64KiB", backend="host")
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16)
    prompts = [[256, *range(20, 75)], [256, 9, 8, 7]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == dense_greedy(model, p, 5), name
    eng.close()
    pool.close()


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 128},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},  # GPT-OSS's shape
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},  # DeepSeek's
])  # fmt: skip
def test_yarn_frequencies_and_attention_factor_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jax_kvcached.models.rope import yarn

    cfg = transformers.Qwen3Config(**{**COMMON, "head_dim": 64, "max_position_embeddings": 8192},
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0,
                                                    **params})  # fmt: skip
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    inv, factor = yarn(64, 50000.0, params, 8192)
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=1e-6)
    assert abs(factor - ref_factor) < 1e-6
