"""The DeepSeek-V2 / V3 family: latent attention (:mod:`.mla`) and DeepSeek's experts
(softmax or sigmoid routing, groups, shared experts, leading dense layers) on
:class:`~.llama.LlamaModel`'s decoder. Its config.json and GGUF (``deepseek2``) readers
and presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import registry
from .config import ModelConfig, hf_common, hf_rope
from .family import Family, GGUFArch, Merge
from .gguf import GGUFError, yarn_scaling
from .llama import LlamaModel
from .mla import MLAConfig, mla_from_hf, softmax_scale
from .moe import MoEConfig, check_silu


def deepseek_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2 / V3 from a config.json; the cache holds one latent per token and
    layer (one KV head of the latent's width)."""
    check_silu(cfg)
    _, scaling, _ = hf_rope(cfg)
    # (DeepSeek-V2 always interleaves; V3's config may say rope_interleave)
    mla = mla_from_hf(cfg, scaling, interleave=True if cfg["model_type"] == "deepseek_v2"
                      else None)  # fmt: skip
    return hf_common(cfg, num_kv_heads=1, head_dim=mla.latent_dim, mla=mla,
                     moe=deepseek_moe_from_hf(cfg, cfg["model_type"]))  # fmt: skip


def deepseek_moe_from_hf(cfg: dict[str, Any], model_type: str) -> MoEConfig:
    """DeepSeek-V2 (softmax; ``greedy`` or ``group_limited_greedy``) and V3 (sigmoid with
    the score-correction bias, ``noaux_tc``): routed experts on every layer from
    ``first_k_dense_replace`` on, ``n_shared_experts`` shared ones beside them."""
    v3 = model_type == "deepseek_v3"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ValueError(f"{model_type}: topk_method {method!r} is not supported ({methods})")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"{model_type}: scoring_func {scoring!r} is not supported")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        freq = cfg["moe_layer_freq"]
        raise ValueError(f"{model_type}: moe_layer_freq {freq} is not supported (1)")
    if not v3 and cfg.get("norm_topk_prob"):  # (transformers' DeepSeek-V2 never renormalizes)
        raise ValueError(f"{model_type}: norm_topk_prob true is not supported")
    grouped = v3 or method == "group_limited_greedy"
    n = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg["num_experts"])
    width = int(cfg["moe_intermediate_size"])
    return MoEConfig(
        num_experts=n, top_k=int(cfg["num_experts_per_tok"]), intermediate_size=width,
        scoring=scoring, norm_topk_prob=v3 and bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
        n_group=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        group_score="top2" if v3 else "max", score_bias=v3,
        shared_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
        dense_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
    )  # fmt: skip


def deepseek2_fields(ck: Any) -> dict[str, Any]:
    """DeepSeek-V2 / V3 as llama.cpp writes them: latent attention (the latent's
    widths under ``key_length`` / ``value_length``, the heads' under ``*_mla``), the
    experts' gating (1 softmax: V2, 2 sigmoid: V3), shared experts, leading dense
    layers."""
    a = "deepseek2"
    r = int(ck.meta(f"{a}.attention.kv_lora_rank"))
    rope = int(ck.meta(f"{a}.rope.dimension_count"))
    att = f"{a}.attention."
    qk = int(ck.meta(att + "key_length_mla", None) or ck.meta(att + "key_length"))
    v = int(ck.meta(att + "value_length_mla", None) or ck.meta(att + "value_length"))
    q_lora = ck.meta(f"{a}.attention.q_lora_rank", None)
    log_mul = ck.meta(f"{a}.rope.scaling.yarn_log_multiplier", None)
    yarn = None
    if ck.meta(f"{a}.rope.scaling.type", None) == "yarn":
        yarn = yarn_scaling(ck, float(log_mul) / 0.1 if log_mul else None)
    gating = int(ck.meta(f"{a}.expert_gating_func", 1))
    if gating not in (1, 2):
        raise GGUFError(f"{ck.path}: {a}.expert_gating_func {gating} is not supported "
                        "(1 softmax, 2 sigmoid)")  # fmt: skip
    sigmoid = gating == 2
    width = int(ck.meta(f"{a}.expert_feed_forward_length"))
    dense = int(ck.meta(f"{a}.leading_dense_block_count", 0))
    moe = MoEConfig(
        num_experts=int(ck.meta(f"{a}.expert_count")),
        top_k=int(ck.meta(f"{a}.expert_used_count")), intermediate_size=width,
        scoring="sigmoid" if sigmoid else "softmax",
        norm_topk_prob=bool(ck.meta(f"{a}.expert_weights_norm", False)),
        routed_scaling_factor=float(ck.meta(f"{a}.expert_weights_scale", 1.0)),
        n_group=int(ck.meta(f"{a}.expert_group_count", 1) or 1),
        topk_group=int(ck.meta(f"{a}.expert_group_used_count", 1) or 1),
        group_score="top2" if sigmoid else "max",
        score_bias=f"blk.{dense}.exp_probs_b.bias" in ck.tensor_names,
        shared_intermediate_size=width * int(ck.meta(f"{a}.expert_shared_count", 0)),
        dense_layers=tuple(range(dense)),
    )  # fmt: skip
    mla = MLAConfig(kv_lora_rank=r, qk_nope_head_dim=qk - rope, qk_rope_head_dim=rope,
                    v_head_dim=v, q_lora_rank=int(q_lora) if q_lora else None,
                    softmax_scale=softmax_scale(qk, dict(yarn) if yarn else None))  # fmt: skip
    return dict(mla=mla, moe=moe, num_kv_heads=1, head_dim=mla.latent_dim, rope_scaling=yarn,
                model_type="deepseek_v3" if sigmoid else "deepseek_v2")  # fmt: skip


def kv_b_from_split(
    path: str, layer: str, parts: dict[str, np.ndarray], cfg: Any = None
) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` ``(H * (nope + v), r)`` from llama.cpp's split of it:
    ``attn_k_b`` ``(H, r, nope)`` (transposed for its absorbed attention) and
    ``attn_v_b`` ``(H, v, r)``."""
    k_b, v_b = parts.get("attn_k_b"), parts.get("attn_v_b")
    if (
        k_b is None
        or v_b is None
        or k_b.ndim != 3
        or v_b.ndim != 3
        or (k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]))
    ):
        raise GGUFError(f"{path}: blk.{layer}'s attn_k_b / attn_v_b are not a pair "
                        f"of (H, r, nope) and (H, v, r)")  # fmt: skip
    per_head = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, nope + v, r)
    return per_head.reshape(-1, per_head.shape[-1])


# DeepSeek-V3's shape in small: latent attention (a 24 + 8 latent a token and layer, the
# query through a q_lora of 32), YaRN with mscale_all_dim, and sigmoid-routed experts in 2
# groups with a shared one, the first layer dense.
_DEEPSEEK_YARN = (("beta_fast", 32), ("beta_slow", 1), ("factor", 4.0), ("mscale", 1.0),
                  ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 256),
                  ("rope_type", "yarn"))  # fmt: skip
_V3 = ModelConfig(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
    num_kv_heads=1, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_scaling=_DEEPSEEK_YARN,
    model_type="deepseek_v3", bos_token_id=256, eos_token_id=257,
    moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, scoring="sigmoid",
                  norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                  score_bias=True, shared_intermediate_size=64, dense_layers=(0,)),
    mla=MLAConfig(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  q_lora_rank=32, softmax_scale=softmax_scale(24, dict(_DEEPSEEK_YARN))),
)  # fmt: skip
PRESETS = {
    "tiny-deepseek-v3": _V3,
    # DeepSeek-V2-Lite's form: the query through q_proj (no q_lora), softmax routing over
    # all experts, two shared experts, plain RoPE.
    "tiny-deepseek-v2-lite": dataclasses.replace(
        _V3, model_type="deepseek_v2", rope_scaling=None,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, routed_scaling_factor=1.0,
                      shared_intermediate_size=128, dense_layers=(0,)),
        mla=MLAConfig(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16),
    ),
}  # fmt: skip

FAMILY = registry.add(Family(
    name="deepseek", model=LlamaModel, model_types=("deepseek_v2", "deepseek_v3"),
    from_hf=deepseek_from_hf,
    gguf=(GGUFArch("deepseek2", "deepseek_v2", fields=deepseek2_fields, yarn=True,
                   merges=(Merge(("attn_k_b", "attn_v_b"), "self_attn.kv_b_proj.weight",
                                 kv_b_from_split),)),),
    presets=PRESETS,
))  # fmt: skip
