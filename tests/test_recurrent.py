"""Recurrent state in the paged KV cache (Qwen3-Next's Gated DeltaNet, Granite 4.0-H's
Mamba2): a state slot per sequence in a recurrent KV cache group, checkpoints of it cached
at block boundaries (restored on a prefix hit, spilled to the host tier, kept over a
sleep), and exact accounting. Compared with transformers: logits, and greedy tokens
through the engine with 16-token steps, several sequences, prefix hits, a preemption and
a sleep; the chunked forms (prefill) against the per-token updates (decode)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_logits_match,
    check_group_accounting,
    dense_greedy,
    gguf_write,
    gguf_writer,
    hf_greedy,
    host_pool,
    tp_pool,
)

from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.kv_groups import kv_cache_groups
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, ModelConfig, build_model
from jax_kvcached.models.gated_deltanet import (
    LinearAttentionConfig,
    delta_rule_chunk,
    delta_rule_step,
)
from jax_kvcached.models.interface import FULL, RECURRENT, KVSpec
from jax_kvcached.models.loader import load_checkpoint
from jax_kvcached.models.mamba2 import Mamba2Config, mamba2_chunk, mamba2_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAGE = 16384
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)




def _next_config(**kw):
    base = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=512, initializer_range=0.2, attn_implementation="eager",
        mlp_only_layers=[1],
    )  # fmt: skip
    return transformers.Qwen3NextConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def hf_next(tmp_path_factory):
    """A random Qwen3-Next (3 Gated DeltaNet layers, 1 gated attention layer, experts
    with a gated shared expert, one dense layer) saved as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(_next_config()).eval()
    with torch.no_grad():  # the (1 + w) norms start at 0: make them count
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0, 0.2)
    hf.save_pretrained(path)
    return hf, str(path)


def test_a_qwen3_next_folder_matches_transformers(hf_next):
    hf, path = hf_next
    cfg, model = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.layer_specs() == (RECURRENT, RECURRENT, RECURRENT, FULL)
    assert cfg.rotary_dim == 4 and cfg.moe.shared_gate and cfg.moe.dense_layers == (1,)
    assert cfg.state_elems == 3 * (2 * 16 + 32) + 4 * 8 * 8  # conv window + S
    assert_logits_match(hf, model, cfg)


def _granite_config():
    return transformers.GraniteMoeHybridConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, shared_intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_expand=2, mamba_d_conv=4,
        embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5,
        attention_multiplier=0.1, position_embedding_type="nope", max_position_embeddings=512,
        initializer_range=0.1, attn_implementation="eager",
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_granite(tmp_path_factory):
    """A random Granite 4.0-H (3 Mamba2 layers in 2 groups, 1 attention layer without
    RoPE, 4 experts beside a shared MLP, Granite's multipliers) as a folder."""
    path = tmp_path_factory.mktemp("granite")
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(_granite_config()).eval()
    with torch.no_grad():  # (norms, D, dt_bias and the conv bias start constant)
        for name, p in hf.named_parameters():
            if name.split(".")[-1] in ("D", "dt_bias", "bias") or "norm" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(path)
    return hf, str(path)


def test_a_granite_4_h_folder_matches_transformers(hf_granite):
    hf, path = hf_granite
    cfg, model = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.layer_specs() == (RECURRENT, RECURRENT, FULL, RECURRENT) and not cfg.rope
    assert cfg.state_elems == 3 * (128 + 2 * 2 * 16) + 8 * 16 * 16  # conv window + S
    assert_logits_match(hf, model, cfg)


def test_granite_engine_greedy_matches_generate_with_three_block_slots(hf_granite):
    """A Mamba2 state of 2624 values a layer takes 3 blocks a slot (1024 values each):
    transformers' tokens for three sequences at once and a prefix hit restoring the
    checkpoint at token 32; exact accounting per group."""
    hf, path = hf_granite
    _, model = load_checkpoint(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, n).tolist() for n in (60, 5, 41)]
    prompts.append(prompts[0][:40] + [7, 7, 7])
    want = [hf_greedy(hf, p, 6) for p in prompts]
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    eng = Engine(model, pool, max_batch=3, max_num_batched_tokens=16,
                 state_checkpoint_tokens=32)  # fmt: skip
    group, pc, mgr = _state_group(eng)
    assert mgr.slot_blocks == 3
    assert [o.token_ids for o in eng.generate(prompts[:3], PARAMS)] == want[:3]
    assert pc.num_cached_blocks == 3 * 3  # checkpoints at 32 and 48 of the first, 32 of the third
    hit = eng.generate([prompts[3]], PARAMS)[0]
    assert hit.token_ids == want[3] and hit.cached_tokens == 32
    check_group_accounting(eng)
    eng.close()
    pool.close()


def _qwen3next_gguf(hf, path):
    """A qwen3next GGUF of a transformers Qwen3-Next as llama.cpp's converter writes it:
    the (1 + w) norms stored as 1 + w, A as -exp(A_log), the conv squeezed, in_proj_qkvz
    split into attn_qkv (all q, all k, all v) and attn_gate, experts stacked; all F32."""
    c = hf.config
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w = gguf_writer(path, "qwen3next", c)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * 0.25))
    names = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight":
             "post_attention_norm", "self_attn.q_proj.weight": "attn_q",
             "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
             "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
             "self_attn.k_norm.weight": "attn_k_norm", "mlp.gate.weight": "ffn_gate_inp",
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
             "mlp.down_proj.weight": "ffn_down", "mlp.shared_expert_gate.weight":
             "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
             "linear_attn.in_proj_ba.weight": "ssm_ba", "linear_attn.norm.weight": "ssm_norm",
             "linear_attn.out_proj.weight": "ssm_out"}  # fmt: skip
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"] + 1)
    w.add_tensor("output.weight", sd["lm_head.weight"])
    nk, dk = c.linear_num_key_heads, c.linear_key_head_dim
    vz = c.linear_num_value_heads // nk * c.linear_value_head_dim
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in names.items():
            if p + hf_name in sd:
                x = sd[p + hf_name]
                folded = hf_name.endswith("norm.weight") and not hf_name.startswith("linear_attn")
                w.add_tensor(f"blk.{i}.{name}.weight", x + 1 if folded else x)
        experts = [k for k in sd if k.startswith(p + "mlp.experts.")]
        if experts:
            gu = sd[p + "mlp.experts.gate_up_proj"]  # (E, 2I, H): transformers 5's layout
            half = gu.shape[1] // 2
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gu[:, :half]))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gu[:, half:]))
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
        if p + "linear_attn.A_log" not in sd:
            continue
        q = p + "linear_attn."
        qkvz = sd[q + "in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * vz, -1)
        parts = np.split(qkvz, [dk, 2 * dk, 2 * dk + vz], axis=1)
        flat = [x.reshape(-1, qkvz.shape[-1]) for x in parts]
        w.add_tensor(f"blk.{i}.attn_qkv.weight", np.concatenate(flat[:3]))
        w.add_tensor(f"blk.{i}.attn_gate.weight", np.ascontiguousarray(flat[3]))
        conv = np.ascontiguousarray(sd[q + "conv1d.weight"][:, 0])  # (squeezed)
        w.add_tensor(f"blk.{i}.ssm_conv1d.weight", conv)
        w.add_tensor(f"blk.{i}.ssm_a", -np.exp(sd[q + "A_log"]))
        w.add_tensor(f"blk.{i}.ssm_dt.bias", sd[q + "dt_bias"])
    gguf_write(w)


def test_a_qwen3next_gguf_matches_transformers(hf_next, tmp_path):
    """llama.cpp's qwen3next layout (folded norms, A, the split qkvz, stacked experts, a
    dense layer without a router): within 1e-4 of transformers."""
    hf, _ = hf_next
    path = tmp_path / "next.gguf"
    _qwen3next_gguf(hf, path)
    cfg, model = load_checkpoint(str(path), dtype=jnp.float32)
    assert cfg.model_type == "qwen3_next" and cfg.moe.dense_layers == (1,) and cfg.rotary_dim == 4
    assert_logits_match(hf, model, cfg)


def _granitehybrid_gguf(hf, folder, path):
    """A granitehybrid GGUF of a transformers Granite 4.0-H as llama.cpp's converter
    writes it: q / k rows in llama.cpp's RoPE order, KV heads per layer (0: Mamba2), A as
    -exp(A_log) and D as (heads, 1), the conv squeezed, the norm in groups, the fused
    experts and shared MLP split; Granite's scales; all F32."""
    from safetensors.numpy import load_file

    c = hf.config
    sd = load_file(f"{folder}/model.safetensors")  # (the checkpoint's own names)
    w = gguf_writer(path, "granitehybrid", c)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count_kv([0 if t == "linear_attention" else c.num_key_value_heads
                         for t in c.layer_types])  # fmt: skip
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    w.add_attention_scale(c.attention_multiplier)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)
    w.add_rope_scaling_finetuned(False)
    inner = c.mamba_expand * c.hidden_size
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(c.mamba_n_heads)

    def permute(x, heads):  # llama.cpp's RoPE row order
        return x.reshape(heads, 2, x.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "block_sparse_moe.router.layer.weight": "ffn_gate_inp",
             "block_sparse_moe.output_linear.weight": "ffn_down_exps",
             "shared_mlp.output_linear.weight": "ffn_down_shexp",
             "mamba.in_proj.weight": "ssm_in", "mamba.conv1d.bias": "ssm_conv1d",
             "mamba.out_proj.weight": "ssm_out"}  # fmt: skip
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in names.items():
            if p + hf_name in sd:
                kind = "bias" if hf_name.endswith("bias") else "weight"
                w.add_tensor(f"blk.{i}.{name}.{kind}", sd[p + hf_name])
        if p + "self_attn.q_proj.weight" in sd:
            w.add_tensor(f"blk.{i}.attn_q.weight",
                         permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
            w.add_tensor(f"blk.{i}.attn_k.weight",
                         permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        gu = sd[p + "block_sparse_moe.input_linear.weight"]
        half = gu.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gu[:, :half]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gu[:, half:]))
        gu = sd[p + "shared_mlp.input_linear.weight"]
        w.add_tensor(f"blk.{i}.ffn_gate_shexp.weight", gu[: gu.shape[0] // 2])
        w.add_tensor(f"blk.{i}.ffn_up_shexp.weight", gu[gu.shape[0] // 2 :])
        if p + "mamba.A_log" not in sd:
            continue
        q = p + "mamba."
        conv = np.ascontiguousarray(sd[q + "conv1d.weight"][:, 0])  # (squeezed)
        w.add_tensor(f"blk.{i}.ssm_conv1d.weight", conv)
        w.add_tensor(f"blk.{i}.ssm_a", -np.exp(sd[q + "A_log"]).reshape(-1, 1))
        w.add_tensor(f"blk.{i}.ssm_d", sd[q + "D"].reshape(-1, 1))
        w.add_tensor(f"blk.{i}.ssm_dt.bias", sd[q + "dt_bias"])
        norm = sd[q + "norm.weight"].reshape(c.mamba_n_groups, -1)  # (in its groups)
        w.add_tensor(f"blk.{i}.ssm_norm.weight", norm)
    gguf_write(w)


def test_a_granitehybrid_gguf_matches_transformers(hf_granite, tmp_path):
    """llama.cpp's granitehybrid layout (attention layers by their KV heads, Mamba2's
    A / D / conv / grouped norm, split experts, Granite's scales, q / k permuted): within
    1e-4 of transformers."""
    hf, folder = hf_granite
    path = tmp_path / "granite.gguf"
    _granitehybrid_gguf(hf, folder, path)
    cfg, model = load_checkpoint(str(path), dtype=jnp.float32)
    assert cfg.model_type == "granitemoehybrid" and not cfg.rope and cfg.linear.num_groups == 2
    assert cfg.layer_specs() == (RECURRENT, RECURRENT, FULL, RECURRENT)
    assert_logits_match(hf, model, cfg)


def _state_group(eng):
    (g,) = [g for g, s in enumerate(eng.group_specs) if s == RECURRENT]
    return eng.cache.groups[g], eng.kv.prefix_caches[g], eng.kv.managers[g]


def test_engine_greedy_matches_generate_with_state_checkpoints(hf_next):
    """16-token steps, three sequences at once: transformers' tokens. A prompt sharing
    the first 40 tokens restores the state checkpointed at token 32 (the interval) and
    prefills only the rest; the same prompt again restores the checkpoint at its last
    block boundary. Mapped state bytes: live sequences x slot plus cached checkpoints."""
    hf, path = hf_next
    _, model = load_checkpoint(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, n).tolist() for n in (60, 5, 41)]
    shared = prompts[0][:40] + [7, 7, 7]
    want = [hf_greedy(hf, p, 6) for p in [*prompts, shared]]
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    eng = Engine(model, pool, max_batch=3, max_num_batched_tokens=16,
                 state_checkpoint_tokens=32)  # fmt: skip
    group, pc, mgr = _state_group(eng)
    assert mgr.slot_blocks == 1 and len(group.layers) == 3
    ids = [eng.add_request(p, PARAMS) for p in prompts]
    done, most = {}, 0
    while eng.has_work:
        done.update({s.request_id: s.output for s in eng.step()})
        # after every step: a slot per live sequence (1 block: 1408 floats <= 2 x 16 x
        # 2 x 16) and the cached checkpoints, nothing else, rounded to pages
        slots = [b for s in eng.scheduler.running for b in s.tables[group.index]]
        most = max(most, len(eng.scheduler.running))
        assert group.num_used_blocks == len(slots) + pc.num_cached_blocks
        held = {group.page_of(b) for b in [*slots, *pc.cached_blocks()]}
        assert set(group.mapped_page_ids()) == held
        assert group.mapped_bytes == len(held) * 3 * 2 * PAGE  # 3 layers, K and V planes
    assert most == 3
    assert [done[i] for i in ids] == want[:3]
    # checkpoints: prompt 0 at 32 and 48 (its last boundary), prompt 2 at 32
    assert pc.num_cached_blocks == 3 == group.num_used_blocks
    out = eng.generate([shared, prompts[0]], PARAMS)
    assert [o.token_ids for o in out] == [want[3], want[0]]
    assert [o.cached_tokens for o in out] == [32, 48]
    check_group_accounting(eng)
    assert eng.kv.reset_prefix_cache() > 0 and pool.stats()["mapped_pages"] == 0
    eng.close()
    pool.close()


def test_preemption_recomputes_or_restores_the_state_and_keeps_the_tokens():
    """Three sequences under a budget that cannot hold them all: preempted ones come back
    (from a checkpoint when one is cached, else recomputed from token 0; the engine
    counts and logs which) with the tokens of an unpressured run."""
    model = build_model(BUILTIN_CONFIGS["tiny-qwen3-next"], seed=0)
    prompts = [[256, *range(1, 50)], [256, *range(60, 90)], [256, *range(100, 140)]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {}
    for pages in (2048, 10):  # 10: 2 pages of 4 attention blocks, 1 of 4 state blocks
        pool = host_pool(pages * PAGE, page_size=PAGE)
        eng = Engine(model, pool, max_batch=3, max_num_batched_tokens=16,
                     state_checkpoint_tokens=16)  # fmt: skip
        outs[pages] = [o.token_ids for o in eng.generate(prompts, params)]
        if pages == 10:
            assert eng.scheduler.num_preemptions > 0
            kvm = eng.kv
            assert kvm.state_restores + kvm.state_recomputes == eng.scheduler.num_preemptions
        check_group_accounting(eng)
        eng.close()
        pool.close()
    assert outs[10] == outs[2048]


@pytest.fixture(scope="module")
def follow_up():
    """The preset, a first turn, its follow-up turn and the follow-up's reference tokens."""
    model = build_model(BUILTIN_CONFIGS["tiny-qwen3-next"], seed=0)
    base = [256, *range(30, 80)]
    follow = [*base, *dense_greedy(model, base, 6), 5, 6, 7]
    # (the reference's padding changes nothing: the same token unpadded)
    assert dense_greedy(model, base, 1) == dense_greedy(model, base, 1, width=len(base) + 1)
    return model, base, follow, dense_greedy(model, follow, 6)


@pytest.mark.parametrize("how", ["evicted", "sleep"])
def test_a_state_checkpoint_comes_back_from_the_host_tier(how, follow_up):
    """A follow-up turn after its checkpoint left the device (evicted to the host tier,
    or spilled by a sleep) restores it from there: the reference's tokens."""
    model, base, follow, want = follow_up
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    eng = Engine(model, pool, max_batch=2, max_num_batched_tokens=16, host_cache_tokens=512)
    assert eng.generate([base], PARAMS)[0].token_ids == follow[len(base) : -3]
    group, pc, _ = _state_group(eng)
    assert pc.num_cached_blocks == 1  # the checkpoint at 48 (its prompt's last boundary)
    if how == "evicted":
        assert pc.evict(pc.num_cached_blocks) == 1 and group.num_used_blocks == 0
    else:
        assert eng.sleep()["mapped_pages"] == 0 == eng.cache.mapped_pages
        eng.wake()
    out = eng.generate([follow], PARAMS)[0]
    assert out.token_ids == want and out.cached_tokens == 48
    tiers = eng.kv.host_caches
    assert tiers[_group_index(eng)].restored_blocks >= 1
    check_group_accounting(eng)
    eng.close()
    pool.close()


def _group_index(eng):
    return list(eng.group_specs).index(RECURRENT)


def test_recurrent_groups_and_bad_configs_fail_naming_the_field():
    w16 = KVSpec.sliding(16)
    assert kv_cache_groups((RECURRENT, FULL, RECURRENT, w16)) == ((2, 0, 2, 1),
                                                                 (FULL, w16, RECURRENT))
    assert kv_cache_groups((RECURRENT, w16), merge_windows=True) == ((1, 0), (FULL, RECURRENT))
    with pytest.raises(TypeError, match="KVSpec"):
        kv_cache_groups((0, -1))
    base = BUILTIN_CONFIGS["tiny-qwen3-next"]
    with pytest.raises(ValueError, match="layer_types.*mamba"):
        dataclasses.replace(base, layer_types=("mamba",) * 3 + ("full_attention",))
    with pytest.raises(ValueError, match="linear_num_value_heads 3"):
        ModelConfig.from_hf({**_next_config(linear_num_value_heads=3).to_dict()})
    with pytest.raises(ValueError, match="linear attention config"):
        dataclasses.replace(base, linear=None)
    pool = tp_pool(2, min_reserved_pages=0, max_reserved_pages=0)
    with pytest.raises(ValueError, match="tensor parallelism"):
        Engine(build_model(base, seed=0), pool, max_batch=2)
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def _delta_rule_case(rng):
    lin = LinearAttentionConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    w = jnp.asarray(rng.normal(size=(lin.conv_dim, 4)) * 0.5, jnp.float32)
    xs = {"qkv": rng.normal(size=(40, lin.conv_dim)), "g": -rng.uniform(0, 2, size=(40, 4)),
          "beta": rng.uniform(0, 1, size=(40, 4))}  # fmt: skip
    init = {"conv": rng.normal(size=(3, lin.conv_dim)), "ssm": rng.normal(size=(4, 8, 8))}
    return delta_rule_step(lin, w), delta_rule_chunk(lin, w), xs, init


def _mamba2_case(rng):
    m = Mamba2Config(num_heads=8, head_dim=4, num_groups=2, d_state=8)
    w = jnp.asarray(rng.normal(size=(4, m.conv_dim)) * 0.5, jnp.float32)
    b = jnp.asarray(rng.normal(size=(m.conv_dim,)) * 0.1, jnp.float32)
    a = -jnp.asarray(rng.uniform(0.5, 4, size=(8,)), jnp.float32)
    d = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    xs = {"xbc": rng.normal(size=(40, m.conv_dim)), "dt": rng.uniform(0, 0.5, size=(40, 8))}
    init = {"conv": rng.normal(size=(3, m.conv_dim)), "ssm": rng.normal(size=(8, 4, 8))}
    return mamba2_step(m, w, b, a, d), mamba2_chunk(m, w, b, a, d), xs, init


@pytest.mark.parametrize("case", [_delta_rule_case, _mamba2_case])
def test_the_chunked_forms_equal_the_per_token_updates(case):
    """The chunked form (prefill) against the per-token update (decode), from a non-zero
    state, over chunks with a partial last one: outputs, the state and the conv window
    (Gated DeltaNet's WY form; Mamba2's SSD)."""
    step, chunk, xs, init = case(np.random.default_rng(0))
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in xs.items()}
    init = {k: jnp.asarray(v, jnp.float32) for k, v in init.items()}
    want_state, want = jax.lax.scan(step, init, xs)
    chunk = jax.jit(chunk)
    t, c = 40, 16
    state, got = init, []
    for a in range(0, t, c):
        n = min(c, t - a)
        x = {k: jnp.pad(v[a : a + n], [(0, c - n)] + [(0, 0)] * (v.ndim - 1))
             for k, v in xs.items()}  # fmt: skip
        state, y = chunk(state, x, n)
        got.append(y[:n])
    assert np.abs(np.concatenate(got) - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    for key in ("ssm", "conv"):
        scale = max(1.0, np.abs(want_state[key]).max())
        assert np.abs(state[key] - want_state[key]).max() < 1e-5 * scale


def test_the_server_reports_the_recurrent_group_and_restores_state():
    """A served Qwen3-Next: a repeated request restores the state checkpoint and gives
    the same text; /admin/memory, /metrics and top show the recurrent group, and
    the groups add up to the model's mapped bytes."""
    import httpx

    from jax_kvcached.models import ByteTokenizer
    from jax_kvcached.serve.app import AuthConfig, BackgroundServer, ServedModel, create_app
    from jax_kvcached.serve.loop import ServingLoop
    from jax_kvcached.serve.top import render, scrape

    model = build_model(BUILTIN_CONFIGS["tiny-qwen3-next"], seed=0)
    pool = host_pool(2048 * PAGE, page_size=PAGE)
    eng = Engine(model, pool, name="q", max_batch=2, tokenizer=ByteTokenizer())
    loop = ServingLoop({"q": eng}).start()
    app = create_app(loop, {"q": ServedModel(eng, ByteTokenizer())},
                     auth=AuthConfig(allow_unauthenticated_admin=True))  # fmt: skip
    http = BackgroundServer(app).start()
    try:
        body = {"model": "q", "prompt": "y" * 90, "max_tokens": 3, "ignore_eos": True,
                "temperature": 0}
        first = httpx.post(f"{http.url}/v1/completions", json=body, timeout=120).json()
        again = httpx.post(f"{http.url}/v1/completions", json=body, timeout=120).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        # the second prefilled 10 tokens: 80 from the cache, the state from its checkpoint
        assert eng.prefix_cache.hits == 80 and eng.kv.prefix_caches[1].hits > 0
        mem = httpx.get(f"{http.url}/admin/memory").json()["models"]["q"]["kv_cache_groups"]
        assert [(g["layers"], g["kind"]) for g in mem] == [(1, "full"), (3, "recurrent")]
        assert sum(g["mapped_bytes"] for g in mem) == eng.cache.mapped_bytes > 0
        m = scrape(http.url)
        series = m["kvcached_kv_cache_group_mapped_bytes"]
        assert {dict(k)["kind"] for k in series} == {"full", "recurrent"}
        assert sum(series.values()) == eng.cache.mapped_bytes
        assert "KV groups: full" in render(m) and "state" in render(m)
    finally:
        http.stop()
        loop.stop()
        pool.close()
