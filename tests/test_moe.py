"""Mixture of experts: the grouped matmul against a dense reference, routing in each
family's form against numpy, Qwen3-MoE against transformers (logits and greedy tokens
through the engine), tensor parallelism and exact accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_logits_match, gguf_write, gguf_writer, hf_greedy
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import assert_only_cached_blocks_hold_pages

import jax_kvcached as kv
from jax_kvcached.engine.attention import no_cache_attention
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory import _C
from jax_kvcached.models import BUILTIN_CONFIGS, build_model, load_checkpoint
from jax_kvcached.models.moe import MoEConfig, grouped_matmul, route, sort_by_expert

ISAS = ["portable", "avx512"] if "avx512" in _C.grouped_isa() else ["portable"]


def _dense_reference(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[-1]), np.float64)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n].astype(np.float64) @ w[g].astype(np.float64)
        start += n
    return out


@pytest.mark.parametrize("isa", ISAS)
def test_grouped_matmul_matches_a_dense_reference(isa):
    _C.set_grouped_isa(isa)
    try:
        _grouped_matches()
    finally:
        _C.set_grouped_isa("auto")


@settings(max_examples=12, deadline=None)
@given(
    groups=st.integers(1, 9), k=st.integers(1, 70), n=st.integers(1, 140),
    spare=st.integers(0, 3), seed=st.integers(0, 2**16), bf16=st.booleans(),
)  # fmt: skip
def _grouped_matches(groups, k, n, spare, seed, bf16):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 7, groups)
    sizes[rng.integers(0, groups)] = 0  # an expert with no tokens
    rows = int(sizes.sum()) + spare  # rows past the groups come back zero
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((groups, k, n)).astype(np.float32)
    wj = jnp.asarray(w, jnp.bfloat16 if bf16 else jnp.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(x), wj, jnp.asarray(sizes), impl="kernel"))
    ref = _dense_reference(x, np.asarray(wj.astype(jnp.float32)), sizes)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    assert not got[int(sizes.sum()) :].any()
    ragged = grouped_matmul(jnp.asarray(x), wj.astype(jnp.float32), jnp.asarray(sizes),
                            impl="ragged_dot")  # fmt: skip
    np.testing.assert_allclose(got, np.asarray(ragged), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_grouped_matmul_refuses_bad_group_sizes():
    x = jnp.ones((4, 8))
    w = jnp.ones((2, 8, 3))
    for sizes, msg in (([3, 2], "more than x's 4"), ([-1, 2], "negative size")):
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(grouped_matmul(x, w, jnp.asarray(sizes), impl="kernel"))
    with pytest.raises(Exception, match="group sizes must be int32 \\(2,\\)"):
        jax.block_until_ready(grouped_matmul(x, w, jnp.asarray([1, 1, 1]), impl="kernel"))


def test_no_dense_compute_of_all_experts_on_the_cpu():
    """The CPU path is the custom call, never XLA's ragged_dot expansion (every row
    against every expert)."""
    x, w, sizes = jnp.ones((16, 32)), jnp.ones((64, 32, 48)), jnp.full((64,), 0, jnp.int32)
    hlo = jax.jit(lambda x, w, s: grouped_matmul(x, w, s)).lower(x, w, sizes).compile().as_text()
    assert "kvcached_grouped_matmul" in hlo
    assert "f32[64,16,32]" not in hlo and "ragged" not in hlo.lower()


def _route_reference(logits, bias, m):
    """Routing as transformers writes it (Qwen3-MoE; DeepSeek-V3's group-limited sigmoid)."""
    logits = logits.astype(np.float64)
    if m.scoring == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    n, e = choice.shape
    if m.n_group > 1:
        g = choice.reshape(n, m.n_group, -1)
        gs = np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-gs, -1, kind="stable")[:, : m.topk_group]
        mask = np.zeros((n, m.n_group), bool)
        np.put_along_axis(mask, keep, True, -1)
        choice = np.where(mask[:, :, None], g, 0.0).reshape(n, e)
    idx = np.argsort(-choice, -1, kind="stable")[:, : m.top_k]
    w = np.take_along_axis(scores, idx, -1)
    if m.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if m.scoring == "sigmoid" else 0))
    return w * m.routed_scaling_factor, idx


@pytest.mark.parametrize("m", [
    MoEConfig(num_experts=8, top_k=2, intermediate_size=4),
    MoEConfig(num_experts=8, top_k=3, intermediate_size=4, norm_topk_prob=True),
    MoEConfig(num_experts=16, top_k=4, intermediate_size=4, scoring="sigmoid", n_group=4,
              topk_group=2, score_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5),
])  # fmt: skip
def test_routing_matches_each_familys_reference(m):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((33, m.num_experts)).astype(np.float32)
    bias = rng.standard_normal(m.num_experts).astype(np.float32) if m.score_bias else None
    w, idx = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), m)
    rw, ridx = _route_reference(logits, bias, m)
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(ridx, -1))
    order = np.argsort(np.asarray(idx), -1)
    got_w = np.take_along_axis(np.asarray(w), order, -1)
    np.testing.assert_allclose(got_w, np.take_along_axis(rw, np.argsort(ridx, -1), -1), rtol=1e-5)
    if m.n_group > 1:  # every pick lies in one of the topk_group groups
        assert (np.asarray([len(set(r // 4)) for r in np.asarray(idx)]) <= m.topk_group).all()


def test_sort_by_expert_groups_pairs():
    experts = jnp.asarray([[3, 1], [1, 0], [3, 2]])
    order, token, sizes = sort_by_expert(experts, 5)
    assert np.asarray(sizes).tolist() == [1, 2, 1, 2, 0]
    assert np.asarray(experts).reshape(-1)[np.asarray(order)].tolist() == [0, 1, 1, 2, 3, 3]
    assert np.asarray(token).tolist() == [1, 0, 1, 2, 0, 2]


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A small random Qwen3-MoE (the first layer dense) saved as transformers writes it."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        max_position_embeddings=512, attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(path)
    return model, str(path)


def test_qwen3_moe_folder_matches_transformers(hf_moe):
    hf, path = hf_moe
    cfg, model = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.moe.dense_layers == (0,) and cfg.moe.top_k == 2 and cfg.moe.norm_topk_prob
    assert model.layer_starts == (0, 1)
    assert_logits_match(hf, model, cfg)


def test_fused_expert_tensors_load_as_the_per_expert_ones(hf_moe, tmp_path):
    """transformers 5 holds experts fused (gate_up_proj (E, 2I, H), down_proj (E, H, I));
    a folder saved in that layout loads to the same weights as the Hub's per-expert one."""
    import shutil

    from safetensors.numpy import save_file

    hf, path = hf_moe
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    _, fused = load_checkpoint(str(tmp_path), dtype=jnp.float32)
    _, per_expert = load_checkpoint(path, dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(nnx.state(fused)), jax.tree.leaves(nnx.state(per_expert)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qwen3_moe_engine_greedy_matches_transformers_generate(hf_moe):
    """Chunked prefill (16-token steps), several sequences at once, then a prefix hit and
    a preemption under a small budget: the tokens of transformers' greedy generate."""
    hf, path = hf_moe
    cfg, model = load_checkpoint(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, n).tolist() for n in (60, 5, 41)]
    prompts.append(prompts[0][:32] + [7, 7, 7])  # shares two blocks with the first

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    pool = kv.Pool("32MiB", page_size="64KiB", backend="host", min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    eng = Engine(model, pool, max_batch=3, max_num_batched_tokens=16)
    assert [o.token_ids for o in eng.generate(prompts[:3], params)] == want[:3]
    hit = eng.generate([prompts[3]], params)[0]
    assert hit.token_ids == want[3] and hit.cached_tokens >= 32
    assert_only_cached_blocks_hold_pages(eng, pool)
    eng.close()
    pool.close()
    # a 16-token block of 2 KV heads of 16 is 2 KiB a plane: one 16 KiB KV page (6 pages,
    # 3 layers x K and V), 7 usable blocks for the 9 the three need at once
    small = kv.Pool(6 * 16384, page_size=16384, backend="host", min_reserved_pages=0,
                    max_reserved_pages=0)  # fmt: skip
    eng = Engine(model, small, max_batch=3, max_num_batched_tokens=16)
    outs = eng.generate(prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == want[:3]
    assert eng.scheduler.num_preemptions > 0
    assert_only_cached_blocks_hold_pages(eng, small)
    eng.close()
    small.close()


def test_deepseek_form_with_shared_experts_through_the_engine():
    """Sigmoid routing with a score bias over 2 groups of 4 (topk_group 1), routed scaling
    and shared experts: the engine's greedy tokens equal the dense reference's, the
    shared experts add what they compute alone, and the weights' names round-trip."""
    import dataclasses

    from jax_kvcached.models.loader import repack
    from jax_kvcached.models.stack import layer_slice

    base = BUILTIN_CONFIGS["tiny-qwen3-moe"]
    cfg = dataclasses.replace(base, moe=dataclasses.replace(
        base.moe, scoring="sigmoid", n_group=2, topk_group=1, score_bias=True,
        routed_scaling_factor=2.5, shared_intermediate_size=64))  # fmt: skip
    model = build_model(cfg, seed=1)
    moe = model.layers[1].mlp
    moe.score_bias.set_value(jnp.linspace(-1.0, 1.0, 16).reshape(2, 8))  # (2 stacked layers)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 128)).astype(np.float32))
    layer = layer_slice(model.layers[1], 0).mlp  # the MoE run's first layer, alone
    shared = layer.shared(x)
    routed_only = layer(x) - shared
    layer.shared = None
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(routed_only), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    pool = kv.Pool("32MiB", page_size="64KiB", backend="host", min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16)
    prompts = [[256, *range(20, 50)], [256, 9, 8, 7]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    attend = no_cache_attention(cfg)
    for p, o in zip(prompts, outs, strict=True):
        toks = list(p)
        for _ in range(4):
            logits = model(jnp.asarray([toks]), jnp.arange(len(toks))[None], attend)
            toks.append(int(jnp.argmax(logits[0, -1])))
        assert o.token_ids == toks[len(p) :]
    assert_only_cached_blocks_hold_pages(eng, pool)
    eng.close()
    pool.close()
    names = model.hf_weights()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in names
    again = repack(model, cfg, "int8")  # every named tensor read back and loaded again
    np.testing.assert_array_equal(np.asarray(again.layers[1].mlp.score_bias.get_value()),
                                  np.asarray(moe.score_bias.get_value()))  # fmt: skip


def test_quantizing_a_moe_model_packs_attention_and_says_the_experts_stay(caplog):
    import logging

    from jax_kvcached.models import load_pretrained
    from jax_kvcached.models.quant_linear import QuantLinear

    with caplog.at_level(logging.INFO, logger="jax_kvcached.models"):
        pre = load_pretrained("tiny-qwen3-moe", quantization="int8")
    assert "keep their experts in the model dtype" in caplog.text
    runs = list(pre.model.layers)
    assert isinstance(runs[1].self_attn.q_proj, QuantLinear)
    assert runs[1].mlp.gate_up.get_value().dtype == jnp.float32


def test_moe_config_refuses_what_it_lacks():
    from jax_kvcached.models.config import ModelConfig

    base = dict(model_type="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="scoring 'tanh'"):
        MoEConfig(num_experts=8, top_k=2, intermediate_size=4, scoring="tanh")


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices (conftest)")
def test_moe_under_tensor_parallelism_gives_the_same_tokens():
    """Experts split along their units over 4 devices, and GPT-OSS's form over 2
    (shard_map, one psum): the tokens of one device, a prefix hit included, and exact
    accounting per device."""
    import dataclasses

    base = dataclasses.replace(BUILTIN_CONFIGS["tiny-qwen3-moe"], num_heads=8, num_kv_heads=4,
                               head_dim=16)  # fmt: skip
    # GPT-OSS's form too: its expert biases split with the units (the down bias added once)
    oai = dataclasses.replace(base, moe=dataclasses.replace(
        base.moe, activation="swiglu_oai", router_bias=True, expert_bias=True))  # fmt: skip
    _tp_tokens(base, (1, 4))
    _tp_tokens(oai, (1, 2))


def _tp_tokens(cfg, tps):
    from conftest import tp_pool

    prompts = [list(range(1, 40)), [5, 6, 7], list(range(1, 33)) + [9, 9]]
    outs = {}
    for tp in tps:
        pool = tp_pool(tp, min_reserved_pages=0, max_reserved_pages=0)
        model = build_model(cfg, seed=0)
        if cfg.moe.expert_bias:  # (they start at zero)
            rng = np.random.default_rng(5)
            for name in ("gate_up_bias", "down_bias", "router_bias"):
                prm = getattr(model.layers[1].mlp, name)
                shape = prm.get_value().shape
                prm.set_value(jnp.asarray(rng.standard_normal(shape).astype(np.float32)))
        eng = Engine(model, pool, max_batch=4, max_num_batched_tokens=32, max_model_len=256)
        if tp > 1:  # the experts' weights split along their units (the last axis)
            gate_up = [a for a in eng.runner.weights.arrays if a.shape == (8, 128, 2, 64)]
            assert gate_up and all(a.sharding.spec[-1] is not None for a in gate_up)
        outs[tp] = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=8))]
        assert_only_cached_blocks_hold_pages(eng, pool)
        eng.close()
        pool.close()
    assert all(outs[tp] == outs[1] for tp in tps)


def _gguf_from_hf(hf, path, expert_type=None):
    """A qwen3moe GGUF of a transformers Qwen3-MoE (llama.cpp's names and layout; F32, or
    ``expert_type`` for the stacked expert tensors)."""
    import gguf

    c = hf.config
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w = gguf_writer(path, "qwen3moe", c)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight"}  # fmt: skip
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in names.items():
            w.add_tensor(f"blk.{i}.{name}", sd[p + hf_name])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # transformers 5 in memory: fused
        inter = gate_up.shape[1] // 2
        for stacked, name in ((gate_up[:, :inter], "ffn_gate_exps"),
                              (gate_up[:, inter:], "ffn_up_exps"),
                              (sd[p + "mlp.experts.down_proj"], "ffn_down_exps")):  # fmt: skip
            stacked = np.ascontiguousarray(stacked)
            if expert_type is None:
                w.add_tensor(f"blk.{i}.{name}.weight", stacked)
            else:
                raw = gguf.quants.quantize(stacked, expert_type)
                w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=expert_type)
    gguf_write(w)


def test_a_qwen3moe_gguf_matches_transformers(tmp_path, caplog):
    """llama.cpp's qwen3moe layout (stacked expert tensors, ffn_gate_inp): F32 within
    1e-4 of transformers; Q8_0 experts load dequantized and the log says so."""
    import logging

    from gguf import GGMLQuantizationType as Q

    torch.manual_seed(1)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    ids = np.random.default_rng(0).integers(0, 300, 30).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    for expert_type, tol in ((None, 1e-4), (Q.Q8_0, 3e-2)):
        path = tmp_path / f"moe-{expert_type}.gguf"
        _gguf_from_hf(hf, path, expert_type)
        with caplog.at_level(logging.INFO, logger="jax_kvcached.models"):
            ours, model = load_checkpoint(str(path), dtype=jnp.float32, quantization="none")
        assert ours.model_type == "qwen3_moe" and ours.moe.num_experts == 8
        got = model(jnp.asarray([ids]), jnp.arange(30)[None], no_cache_attention(ours))[0]
        assert np.abs(np.asarray(got) - ref).max() < tol * max(1.0, np.abs(ref).max())
    assert "ffn_gate_exps.weight (Q8_0) dequantized" in caplog.text


def test_gpt_oss_experts_match_transformers():
    """GPT-OSS's form: a router with a bias (top-k of the logits, softmax over them),
    experts with biases, gate and up interleaved by column, the clamped SwiGLU; the
    checkpoint's tensors through split_gpt_oss_experts into our layout."""
    from jax_kvcached.models.gpt_oss import split_gpt_oss_experts
    from jax_kvcached.models.moe import MoE, expert_weights

    torch.manual_seed(2)
    hc = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                                   num_experts_per_tok=2, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   vocab_size=64)  # fmt: skip
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    ref = GptOssMLP(hc).eval()
    with torch.no_grad():
        for prm in ref.parameters():
            prm.normal_(0.0, 0.5)  # large enough that the clamps at +-7 bite
    m = MoEConfig(num_experts=8, top_k=2, intermediate_size=16, norm_topk_prob=True,
                  activation="swiglu_oai", router_bias=True, expert_bias=True)  # fmt: skip
    ours = MoE(32, m, jnp.float32, nnx.Rngs(0))
    tensors = {f"model.layers.0.mlp.{k}": v.detach().numpy() for k, v in ref.state_dict().items()}
    split_gpt_oss_experts(tensors)
    for name, (mod, attr, transpose, index) in expert_weights(ours, "model.layers.0.", 0).items():
        value = tensors.pop(name)
        value = value.T if transpose else value
        param = getattr(mod, attr)
        at = index[1:] if isinstance(index, tuple) else ()  # (not stacked: no layer axis)
        param.set_value(param.get_value().at[at].set(value))
    assert not tensors  # every checkpoint tensor has its place
    x = np.random.default_rng(0).standard_normal((2, 7, 32)).astype(np.float32) * 3
    with torch.no_grad():
        want = ref(torch.tensor(x))
        want = (want[0] if isinstance(want, tuple) else want).numpy()
    got = np.asarray(ours(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
