"""DeepSeek's latent attention (MLA) over a latent KV cache (one plane per layer): the
cache's bytes follow the formula, the three attention paths read the latent as keys and
values alike, DeepSeek-V2 / V3 folders match transformers (logits, and greedy tokens
through the engine with chunked prefill, several sequences, a prefix hit, a preemption,
the host tier and a sleep), tensor parallelism keeps the tokens, accounting is exact."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_logits_match,
    dense_greedy,
    gguf_write,
    gguf_writer,
    hf_greedy,
    host_pool,
    tp_pool,
)
from test_engine import assert_only_cached_blocks_hold_pages

import jax_kvcached as kv
from jax_kvcached.engine.attention import (
    Ragged,
    host_paged_attention,
    paged_attention,
)
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.pallas_attention import pallas_paged_attention
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory import ops
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.loader import load_checkpoint

PAGE = 16384




@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_latent_cache_maps_one_plane_per_layer_by_the_formula(dtype):
    """Mapped bytes = blocks x layers x block_size x latent x itemsize, rounded to pages:
    one plane per layer (no V), a KV page is ``layers`` physical pages."""
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    layers, latent, bs = 3, 72, 16
    c = pool.create_kv_cache("mla", layers, 1, latent, dtype, block_size=bs, latent=True)
    item = jnp.dtype(dtype).itemsize
    assert c.view.shape[:2] == (layers, 1) and c.pages_per_kv_page == layers
    assert c.block_bytes == bs * latent * item
    assert [p.name for p in c.groups[0].planes] == ["latent"]
    n = 20
    ids = c.alloc(n)
    pages = {c.page_of(b) for b in ids}
    assert len(pages) <= -(-n // c.min_blocks_per_page) + 1  # (+1: page 0's null block)
    assert c.mapped_bytes == len(pages) * layers * PAGE == pool.stats()["mapped_bytes"]
    # the formula against an MHA cache of the same tokens: 2 planes of heads x head_dim
    mha = pool.create_kv_cache("mha", layers, 4, 24, dtype, block_size=bs)
    assert mha.pages_per_kv_page == 2 * layers and mha.block_bytes == bs * 4 * 24 * item
    c.free(ids)
    assert c.mapped_bytes == 0 and pool.stats()["mapped_pages"] == 0
    with pytest.raises(ValueError, match="one KV head"):
        pool.create_kv_cache("bad", layers, 2, latent, dtype, latent=True)
    pool.close()


def test_the_three_attention_paths_read_the_latent_as_keys_and_values():
    """Host custom call, XLA and the Pallas kernel (interpreted) over one latent plane:
    softmax(q . c / sqrt(D)) c, against a dense reference; a bad query shape is refused."""
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    c = pool.create_kv_cache("mla", 2, 1, 40, "float32", block_size=16, latent=True)
    ids = c.alloc(3)
    t, h, d = 37, 8, 40
    rng = np.random.default_rng(0)
    lat = jnp.asarray(rng.normal(size=(t, 1, d)), jnp.float32)
    token = ops.write_kv(c, 1, lat, lat, c.slot_mapping(ids, np.arange(t)), ops.new_token())
    q = jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32)
    tables = np.zeros((2, 4), np.int32)
    tables[0, :3] = ids
    lay = Ragged.of([t], [t], tables)
    view = c.view
    scores = jnp.einsum("thd,sd->hts", q, lat[:, 0]) / np.sqrt(d)
    scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, -1e30)
    want = jnp.einsum("hts,sd->thd", jax.nn.softmax(scores, -1), lat[:, 0])
    got = {
        "host": host_paged_attention(c, token, q, view, 1, lay),
        "xla": paged_attention(q, view + token, 1, lay),
        "pallas": pallas_paged_attention(q, view + token, 1, lay, interpret=True),
    }
    for name, out in got.items():
        assert float(jnp.abs(out - want).max()) < 1e-5, name
    with pytest.raises(ValueError, match="q must be float32"):
        host_paged_attention(c, token, q[..., :32], view, 1, lay)
    pool.close()


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1}  # fmt: skip


def _v3():
    """DeepSeek-V3's form: q_lora, sigmoid routing in groups with the score-correction
    bias, a shared expert, the first layer dense, YaRN with mscale_all_dim."""
    return transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
        max_position_embeddings=512, rope_parameters=dict(ROPE), initializer_range=0.3,
        attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip


def _v2_lite():
    """DeepSeek-V2-Lite's form: no q_lora (q_proj), softmax routing, two shared experts;
    group-limited greedy routing (V2's own) on top."""
    return transformers.DeepseekV2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, n_shared_experts=2, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        max_position_embeddings=512, initializer_range=0.3, attn_implementation="eager",
    )  # fmt: skip


def _save(hf_cls, cfg, path):
    torch.manual_seed(0)
    model = hf_cls(cfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)  # (it starts at zero: make the choice use it)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf_v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    return _save(transformers.DeepseekV3ForCausalLM, _v3(), path), str(path)


def test_deepseek_v3_and_v2_lite_folders_match_transformers(hf_v3, tmp_path):
    hf2 = _save(transformers.DeepseekV2ForCausalLM, _v2_lite(), tmp_path)
    for hf, path in (hf_v3, (hf2, str(tmp_path))):
        cfg, model = load_checkpoint(path, dtype=jnp.float32)
        assert cfg.kv_latent and (cfg.num_kv_heads, cfg.head_dim) == (1, 40)
        assert_logits_match(hf, model, cfg)
    assert load_checkpoint(path)[0].mla.q_lora_rank is None  # V2-Lite: q_proj
    assert load_checkpoint(hf_v3[1])[0].moe.score_bias


@pytest.mark.parametrize("family", ["v3", "v2-lite"])
def test_deepseek_engine_greedy_matches_transformers_generate(hf_v3, tmp_path, family):
    """16-token steps, three sequences at once, a prefix hit, then a preemption under a
    small budget: transformers' greedy tokens; the mapped bytes are the latent's."""
    if family == "v3":
        hf, path = hf_v3
    else:
        hf, path = _save(transformers.DeepseekV2ForCausalLM, _v2_lite(), tmp_path), str(tmp_path)
    _, model = load_checkpoint(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, n).tolist() for n in (60, 5, 41)]
    prompts.append(prompts[0][:32] + [7, 7, 7])  # shares two blocks with the first

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    eng = Engine(model, pool, max_batch=3, max_num_batched_tokens=16)
    assert eng.cache.latent and eng.cache.view.shape[1] == 1
    assert [o.token_ids for o in eng.generate(prompts[:3], params)] == want[:3]
    hit = eng.generate([prompts[3]], params)[0]
    assert hit.token_ids == want[3] and hit.cached_tokens >= 32
    # a 16-token block of a 40-wide fp32 latent is 2560 bytes: 6 to a 16 KiB page
    cached = eng.prefix_cache.num_cached_blocks
    pages = {eng.cache.page_of(b) for b in eng.prefix_cache.cached_blocks()}
    assert eng.cache.block_bytes == 16 * 40 * 4 and len(pages) >= -(-cached // 6)
    assert eng.cache.mapped_bytes == len(pages) * 3 * PAGE  # 3 layers, one plane each
    assert_only_cached_blocks_hold_pages(eng, pool)
    eng.close()
    pool.close()
    # one KV page: 5 usable blocks for the 9 the three need
    small = host_pool(3 * PAGE, page_size=PAGE)
    eng = Engine(model, small, max_batch=3, max_num_batched_tokens=16)
    assert [o.token_ids for o in eng.generate(prompts[:3], params)] == want[:3]
    assert eng.scheduler.num_preemptions > 0
    assert_only_cached_blocks_hold_pages(eng, small)
    eng.close()
    small.close()


def test_a_latent_prefix_survives_sleep_through_the_host_tier():
    """The preset's latent blocks go to the host tier on a sleep (one plane a layer in a
    slot), the follow-up turn restores them and gives the reference's tokens."""
    model = build_model(BUILTIN_CONFIGS["tiny-deepseek-v3"], seed=0)
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16, host_cache_tokens=512)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    base = [256, *range(30, 80)]
    first = eng.generate([base], params)[0].token_ids
    follow = [*base, *first, 5, 6, 7]
    want = dense_greedy(model, follow, 5)
    assert eng.sleep()["mapped_pages"] == 0 == eng.cache.mapped_pages
    eng.wake()
    (tier,) = eng.kv.host_caches
    assert tier.num_entries == 3 and tier.store.slot_bytes == 3 * eng.cache.block_bytes
    out = eng.generate([follow], params)[0]
    assert out.token_ids == want and out.cached_tokens == 48
    assert eng.stats()["host_cache"]["restored_blocks"] == 3
    assert_only_cached_blocks_hold_pages(eng, pool)
    eng.close()
    pool.close()


def test_latent_attention_under_tensor_parallelism_gives_the_same_tokens():
    """Heads split over 2 and 4 devices, the latent cache replicated (every device maps
    what one device does): the tokens of one device."""
    cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-deepseek-v3"], num_heads=8)
    prompts = [list(range(1, 40)), [5, 6, 7], list(range(1, 33)) + [9, 9]]
    outs, mapped = {}, {}
    for tp in (1, 2, 4):
        pool = tp_pool(tp, min_reserved_pages=0, max_reserved_pages=0)
        eng = Engine(build_model(cfg, seed=0), pool, max_batch=4, max_num_batched_tokens=32,
                     max_model_len=256)  # fmt: skip
        assert eng.cache.shard_kv_heads == 1
        if tp > 1:  # kv_b_proj split by heads
            assert any(a.shape[-2:] == (24, 8 * 32) and a.sharding.spec[-1] is not None
                       for a in jax.tree.leaves(eng.runner.weights.arrays))  # fmt: skip
        outs[tp] = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=8))]
        mapped[tp] = set(pool.mapped_pages_per_device().values())
        assert_only_cached_blocks_hold_pages(eng, pool)
        eng.close()
        pool.close()
    assert outs[2] == outs[1] == outs[4]
    assert mapped[2] == mapped[4] == mapped[1]  # one value: every device alike


@pytest.mark.parametrize(
    "field,value",
    [("attention_bias", True), ("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"),
     ("moe_layer_freq", 2), ("norm_topk_prob", True)],
)  # fmt: skip
def test_a_deepseek_config_with_what_we_lack_fails_naming_it(tmp_path, field, value):
    cfg = _v2_lite().to_dict()
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        kv.models.ModelConfig.from_dir(str(tmp_path))


def _deepseek_gguf(hf, path):
    """A deepseek2 GGUF of a transformers DeepSeek-V3 in llama.cpp's layout: MQA of one
    576-wide head, kv_b_proj split into attn_k_b (H, r, nope) and attn_v_b (H, v, r),
    stacked experts, the routing under its keys; all F32."""
    import gguf

    c = hf.config
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    a = "deepseek2"
    w = gguf_writer(path, a, c)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count_kv(1)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_uint32(f"{a}.expert_group_count", c.n_group)
    w.add_uint32(f"{a}.expert_group_used_count", c.topk_group)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    names = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.q_a_proj.weight": "attn_q_a", "self_attn.q_b_proj.weight": "attn_q_b",
             "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
             "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
             "self_attn.o_proj.weight": "attn_output", "mlp.gate.weight": "ffn_gate_inp",
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
             "mlp.down_proj.weight": "ffn_down",
             "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
             "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
             "mlp.shared_experts.down_proj.weight": "ffn_down_shexp"}  # fmt: skip
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    h, nope, r = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in names.items():
            if p + hf_name in sd:
                w.add_tensor(f"blk.{i}.{name}.weight", sd[p + hf_name])
        kv_b = sd[p + "self_attn.kv_b_proj.weight"].reshape(h, nope + c.v_head_dim, r)
        k_b = kv_b[:, :nope].transpose(0, 2, 1)  # (H, r, nope): llama.cpp's absorbed layout
        w.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(k_b))
        w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
        if p + "mlp.gate.e_score_correction_bias" in sd:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
            gate_up = sd[p + "mlp.experts.gate_up_proj"]  # transformers 5 in memory: fused
            inter = gate_up.shape[1] // 2
            for stacked, name in ((gate_up[:, :inter], "ffn_gate_exps"),
                                  (gate_up[:, inter:], "ffn_up_exps"),
                                  (sd[p + "mlp.experts.down_proj"], "ffn_down_exps")):  # fmt: skip
                w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(stacked))
    gguf_write(w)


def test_a_deepseek2_gguf_matches_transformers(tmp_path):
    """llama.cpp's deepseek2 layout (k_b / v_b split, YaRN's log multiplier, sigmoid
    gating in groups): within 1e-4 of transformers. (A GGUF keeps mscale_all_dim only:
    the model's mscale equals it, as in DeepSeek's own configs.)"""
    cfg = _v3()
    cfg.rope_parameters = {**ROPE, "mscale": 0.8}
    hf = _save(transformers.DeepseekV3ForCausalLM, cfg, tmp_path / "hf")
    path = tmp_path / "v3.gguf"
    _deepseek_gguf(hf, path)
    cfg, model = load_checkpoint(str(path), dtype=jnp.float32)
    assert cfg.model_type == "deepseek_v3" and cfg.mla.q_lora_rank == 48 and cfg.moe.score_bias
    assert_logits_match(hf, model, cfg)


def test_many_heads_over_one_latent_run_in_chunks_in_the_pallas_kernel():
    """DeepSeek-V3's 128 heads over one latent: more rows than a program takes, so the
    kernel (interpreted) runs them in chunks of heads; the result is XLA's. Under
    ``auto`` a CUDA cache whose width is not a power of two gets XLA's attention."""
    from jax_kvcached.engine.device_choices import resolve_attention
    from jax_kvcached.engine.pallas_attention import item_tile

    pool = host_pool(2048 * PAGE, page_size=PAGE)
    c = pool.create_kv_cache("mla", 1, 1, 32, "float32", block_size=16, latent=True)
    ids = c.alloc(2)
    t, h = 20, 128
    rng = np.random.default_rng(2)
    lat = jnp.asarray(rng.normal(size=(t, 1, 32)), jnp.float32)
    token = ops.write_kv(c, 0, lat, lat, c.slot_mapping(ids, np.arange(t)), ops.new_token())
    q = jnp.asarray(rng.normal(size=(t, h, 32)), jnp.float32)
    tables = np.zeros((1, 2), np.int32)
    tables[0] = ids
    assert item_tile(h) == 1
    lay = Ragged.of([t], [t], tables, tile=item_tile(h))
    want = paged_attention(q, c.view + token, 0, lay)
    got = pallas_paged_attention(q, c.view + token, 0, lay, interpret=True)
    assert float(jnp.abs(got - want).max()) < 1e-5
    cuda = dataclasses.make_dataclass("C", ["backend", "head_dim", "name"])
    assert resolve_attention("auto", cuda("cuda", 576, "m")) == "xla"
    assert resolve_attention("auto", cuda("cuda", 512, "m")) == "pallas"
    pool.close()
