"""GPT-OSS: attention sinks (a learned logit per head in the softmax's denominator) in the
three attention paths, biases on every attention projection, alternating sliding and full
layers, YaRN and the clamped SwiGLU experts; HF folders (float or MXFP4 experts) against
transformers: logits, and greedy tokens through the engine with chunked prefill, several
sequences, a prefix hit and a preemption; tensor parallelism keeps the tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_logits_match,
    check_group_accounting,
    gguf_write,
    gguf_writer,
    hf_greedy,
    tp_pool,
)
from flax import nnx

import jax_kvcached as kv
from jax_kvcached.engine.attention import (
    Ragged,
    dense_causal_attention,
    host_paged_attention,
    paged_attention,
)
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.pallas_attention import pallas_paged_attention
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory import ops
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.loader import load_checkpoint
from jax_kvcached.models.quant_format import FP4_E2M1, dequantize_mxfp4


def _check_groups(eng, pool):
    """Exact accounting per KV cache group once every request finished; after a reset
    nothing is mapped."""
    check_group_accounting(eng)
    eng.reset_prefix_cache()
    assert pool.stats()["mapped_pages"] == 0


def _sink_reference(q, k, v, sinks, window):
    """numpy: softmax over [scores, sink] per head (GQA), the sink's column dropped."""
    t, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    out = np.zeros_like(q)
    for i in range(h):
        s = q[:, i] @ k[:, i // g].T / np.sqrt(d)
        pos = np.arange(t)
        seen = (pos[None] <= pos[:, None]) & ((window <= 0) | (pos[None] > pos[:, None] - window))
        s = np.where(seen, s, -np.inf)
        s = np.concatenate([s, np.full((t, 1), sinks[i])], axis=1)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        out[:, i] = p[:, :-1] @ v[:, i // g]
    return out


@pytest.mark.parametrize("window", [0, 9])
def test_attention_sinks_in_every_attention_path(window):
    """Decode rows and prefill chunks of one step, with and without a window: the host
    custom call, XLA, the Pallas kernel (interpreted, context split in two) and the dense
    reference all give numpy's softmax with the sink in its denominator."""
    pool = kv.Pool("64MiB", page_size="64KiB", backend="host")
    c = pool.create_kv_cache("a", 1, 2, 32, "float32", block_size=16)
    ids = c.alloc(3)
    t, h, d = 40, 8, 32
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((t, 2, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    sinks = rng.standard_normal(h).astype(np.float32) * 3
    token = ops.write_kv(c, 0, jnp.asarray(k), jnp.asarray(v), c.slot_mapping(ids, np.arange(t)),
                         ops.new_token())  # fmt: skip
    want = _sink_reference(q, k, v, sinks, window)
    tables = np.zeros((2, 4), np.int32)
    tables[:, :3] = ids
    # sequence 0: the first 39 positions as a prefill chunk; 1: the last as a decode row
    lay = Ragged.of([39, 1], [39, 40], tables, tile=8)
    qq = jnp.asarray(np.concatenate([q[:39], q[39:]]))
    s = jnp.asarray(sinks)
    view = c.view + token
    got = {
        "host": host_paged_attention(c, token, qq, c.view, 0, lay, window, s),
        "xla": paged_attention(qq, view, 0, lay, window, s),
        "pallas": pallas_paged_attention(qq, view, 0, lay, num_splits=2, interpret=True,
                                         window=window, sinks=s),  # fmt: skip
        "dense": dense_causal_attention(q[None], k[None], v[None], window, s)[0],
    }
    for name, out in got.items():
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, err_msg=name)
    with pytest.raises(ValueError, match="sinks"):
        host_paged_attention(c, token, qq, c.view, 0, lay, window, s[:3])
    pool.close()


def test_mxfp4_dequantizes_as_the_format_says():
    """Low nibble first, e2m1 values, a power-of-two scale per 32 (bias 127), the rows'
    inputs moved to the second-last axis (transformers' expert layout)."""
    blocks = np.zeros((1, 2, 1, 16), np.uint8)
    blocks[0, 0, 0, 0] = 0x2F  # values 0 and 1 of row 0: -6.0 (0xF), 1.0 (0x2)
    blocks[0, 1, 0, 3] = 0x90  # values 6 and 7 of row 1: 0.0, -0.5 (0x9)
    scales = np.array([[[128], [125]]], np.uint8)  # 2 ** 1, 2 ** -2
    w = dequantize_mxfp4(blocks, scales)
    assert w.shape == (1, 32, 2)
    assert (w[0, 0, 0], w[0, 1, 0], w[0, 7, 1]) == (-12.0, 2.0, -0.125)
    assert np.count_nonzero(w) == 3
    with pytest.raises(ValueError, match="mxfp4"):
        dequantize_mxfp4(blocks, scales[..., :0])


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf_config():
    return transformers.GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False},
        attn_implementation="eager", initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_oss(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_hf_config()).eval()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return model, str(path)


def _logits_match(hf, path):
    cfg, model = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.attention_sinks and cfg.o_bias and cfg.layer_windows() == (8, 0, 8, 0)
    assert_logits_match(hf, model, cfg)


def test_gpt_oss_folder_matches_transformers(hf_oss):
    _logits_match(*hf_oss)


def _to_mxfp4(w):
    """(E, in, out) float -> MXFP4 blocks (E, out, in / 32, 16) and scales: each value
    rounded to the nearest e2m1 value of its block's power-of-two scale."""
    x = np.swapaxes(np.asarray(w, np.float32), 1, 2)  # (E, out, in)
    x = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(x).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    codes = np.abs(x[..., None] / np.ldexp(1.0, exp)[..., None] - FP4_E2M1).argmin(-1)
    codes = codes.astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp[..., 0] + 127).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)  # (save_file: raw bytes)


def test_mxfp4_experts_load_dequantized(hf_oss, tmp_path, caplog):
    """OpenAI's checkpoint layout: experts as MXFP4 blocks and scales, config
    quantization_config mxfp4. They load dequantized (and the log says so), matching
    transformers' model holding the same dequantized values."""
    import logging

    from safetensors.numpy import save_file

    hf, path = hf_oss
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(_hf_config()).eval()
    ref.load_state_dict(hf.state_dict())
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(sd.pop(name))
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        deq = torch.tensor(dequantize_mxfp4(blocks, scales))
        with torch.no_grad():
            ref.get_parameter(name).copy_(deq)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="jax_kvcached.models"):
        _logits_match(ref, str(tmp_path))
    assert "MXFP4 experts dequantized" in caplog.text


def test_gpt_oss_engine_greedy_matches_transformers_generate(hf_oss):
    """16-token steps over sliding (8) and full layers with sinks, three sequences at once,
    a prefix hit (a follow-up turn), then a preemption under a small budget: transformers'
    greedy tokens; exact accounting per group."""
    hf, path = hf_oss
    _, model = load_checkpoint(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, n).tolist() for n in (60, 5, 41)]

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    # A follow-up turn: the sliding group kept the window at the first turn's end only
    # (the blocks below it went back), so the hit is the whole first turn.
    prompts.append(prompts[0] + want[0] + [7, 7, 7])
    want.append(hf_greedy(hf, prompts[3], 6))
    pool = kv.Pool("32MiB", page_size="64KiB", backend="host", min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    eng = Engine(model, pool, max_batch=3, max_num_batched_tokens=16)
    assert eng.cache.num_groups == 2  # full and sliding layers
    assert [o.token_ids for o in eng.generate(prompts[:3], params)] == want[:3]
    hit = eng.generate([prompts[3]], params)[0]
    assert hit.token_ids == want[3] and hit.cached_tokens == 64
    _check_groups(eng, pool)
    eng.close()
    pool.close()
    # 16-token blocks of 2 KV heads of 16 (fp32): 2 KiB a plane, 8 to a 16 KiB page; a KV
    # page of a group is 4 physical pages (2 layers, K and V): one KV page a group, 7
    # usable full-attention blocks for the 9 the three need at once
    small = kv.Pool(8 * 16384, page_size=16384, backend="host", min_reserved_pages=0,
                    max_reserved_pages=0)  # fmt: skip
    eng = Engine(model, small, max_batch=3, max_num_batched_tokens=16)
    assert [o.token_ids for o in eng.generate(prompts[:3], params)] == want[:3]
    assert eng.scheduler.num_preemptions > 0
    _check_groups(eng, small)
    eng.close()
    small.close()


def test_gpt_oss_under_tensor_parallelism_gives_the_same_tokens():
    """The preset with random sinks and biases: its heads (and their sinks) split over 2
    devices give one device's tokens; accounting exact."""
    cfg = BUILTIN_CONFIGS["tiny-gpt-oss"]
    prompts = [list(range(1, 40)), [5, 6, 7]]
    outs = {}
    for tp in (1, 2):
        model = build_model(cfg, seed=0)
        rng = np.random.default_rng(3)
        for path, var in nnx.state(model, nnx.Param).flat_state():
            if any(str(p).endswith(("sinks", "bias")) for p in path):
                shape = var.get_value().shape
                var.set_value(jnp.asarray(rng.standard_normal(shape).astype(np.float32)))
        pool = tp_pool(tp, min_reserved_pages=0, max_reserved_pages=0)
        eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=32, max_model_len=256)
        if tp > 1:  # the sinks (4 heads a layer) split with the heads
            leaves = jax.tree.leaves(eng.runner.weights.arrays)
            assert any(a.shape[-1:] == (4,) and a.ndim <= 2 and a.sharding.spec
                       and a.sharding.spec[-1] is not None for a in leaves)  # fmt: skip
        outs[tp] = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=8))]
        _check_groups(eng, pool)
        eng.close()
        pool.close()
    assert outs[2] == outs[1]


def _gpt_oss_gguf(hf, path):
    """A gpt-oss GGUF of a transformers GPT-OSS in llama.cpp's layout: gate and up split
    (de-interleaved) and stacked (E, out, in), MXFP4 experts, biases, sinks, YaRN."""
    import gguf

    c = hf.config
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    a = "gpt-oss"
    w = gguf_writer(path, a, c)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(c.sliding_window)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}  # fmt: skip
    for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        for kind in ("weight", "bias"):
            names[f"self_attn.{proj}_proj.{kind}"] = f"{name}.{kind}"
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])

    def mxfp4(name, x):
        raw = gguf.quants.quantize(np.ascontiguousarray(x), gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in names.items():
            w.add_tensor(f"blk.{i}.{name}", sd[p + hf_name])
        gu = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # (E, 2I, H)
        mxfp4(f"blk.{i}.ffn_gate_exps.weight", gu[:, ::2])
        mxfp4(f"blk.{i}.ffn_up_exps.weight", gu[:, 1::2])
        mxfp4(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1))
        gub = sd[p + "mlp.experts.gate_up_proj_bias"]
        w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(gub[:, ::2]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(gub[:, 1::2]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"])
    gguf_write(w)


def test_a_gpt_oss_gguf_with_mxfp4_experts_matches_transformers(hf_oss, tmp_path, caplog):
    """llama.cpp's gpt-oss layout with MXFP4 experts: they load dequantized (the log says
    so) and match transformers' model holding the same dequantized experts."""
    import logging

    import gguf

    hf, _ = hf_oss
    path = tmp_path / "oss.gguf"
    _gpt_oss_gguf(hf, path)
    ref = transformers.GptOssForCausalLM(_hf_config()).eval()
    ref.load_state_dict(hf.state_dict())
    q = gguf.GGMLQuantizationType.MXFP4

    def rounded(x):
        x = np.ascontiguousarray(x)
        return gguf.quants.dequantize(gguf.quants.quantize(x, q), q).reshape(x.shape)

    with torch.no_grad():
        for i in range(hf.config.num_hidden_layers):
            ex = ref.model.layers[i].mlp.experts
            gu = ex.gate_up_proj.numpy().transpose(0, 2, 1)
            out = np.empty_like(gu)
            out[:, ::2], out[:, 1::2] = rounded(gu[:, ::2]), rounded(gu[:, 1::2])
            ex.gate_up_proj.copy_(torch.tensor(out.transpose(0, 2, 1)))
            down = rounded(ex.down_proj.numpy().transpose(0, 2, 1))
            ex.down_proj.copy_(torch.tensor(down.transpose(0, 2, 1)))
    with caplog.at_level(logging.INFO, logger="jax_kvcached.models"):
        cfg, model = load_checkpoint(str(path), dtype=jnp.float32)
    assert cfg.model_type == "gpt_oss" and cfg.layer_windows() == (8, 0, 8, 0)
    assert "MXFP4) dequantized" in caplog.text
    assert_logits_match(ref, model, cfg)
