"""The GGUF architectures whose config does not fit the common reader (:mod:`.gguf`):
DeepSeek-V2 / V3 (``deepseek2``: latent attention, experts with their gating, shared
experts, YaRN with DeepSeek's log multiplier) and GPT-OSS (``gpt-oss``: sinks, biases,
alternating sliding and full layers, MXFP4 experts), as llama.cpp's converter writes
them; each reader returns the :class:`~.config.ModelConfig` fields it sets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .mla import MLAConfig, softmax_scale
from .moe import MoEConfig, gpt_oss_moe


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file (and tensor)."""


def yarn_scaling(ck: Any, mscale_all_dim: float | None) -> tuple[tuple[str, Any], ...]:
    """A file's YaRN scaling as a config.json's ``rope_scaling``. DeepSeek's files keep
    ``mscale_all_dim`` (as 0.1 x it, the log multiplier) but not ``mscale``: the two
    are taken equal, as in DeepSeek-V2 / V3's own configs."""
    a = ck.architecture
    s: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(ck.meta(f"{a}.rope.scaling.factor")),
        "original_max_position_embeddings":
            int(ck.meta(f"{a}.rope.scaling.original_context_length")),
        "beta_fast": float(ck.meta(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(ck.meta(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
    }  # fmt: skip
    if mscale_all_dim:
        s["mscale"] = s["mscale_all_dim"] = mscale_all_dim
    if a == "gpt-oss":
        s["truncate"] = False  # (OpenAI's YaRN keeps the ramp's ends unrounded)
    return tuple(sorted(s.items()))

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

def gpt_oss_fields(ck: Any) -> dict[str, Any]:
    """GPT-OSS: sinks, biases on every attention projection, sliding (even) and full
    (odd) layers, experts with biases and the clamped SwiGLU."""
    a = "gpt-oss"
    layers = int(ck.meta(f"{a}.block_count"))
    moe = gpt_oss_moe(int(ck.meta(f"{a}.expert_count")), int(ck.meta(f"{a}.expert_used_count")),
                      int(ck.meta(f"{a}.expert_feed_forward_length")))  # fmt: skip
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                  for i in range(layers))  # fmt: skip
    return dict(moe=moe, attention_sinks=True, o_bias=True, layer_types=types,
                sliding_window=int(ck.meta(f"{a}.attention.sliding_window")))  # fmt: skip


def kv_b_from_split(path: str, layer: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` ``(H * (nope + v), r)`` from llama.cpp's split of it:
    ``attn_k_b`` ``(H, r, nope)`` (transposed for its absorbed attention) and
    ``attn_v_b`` ``(H, v, r)``."""
    k_b, v_b = parts.get("attn_k_b"), parts.get("attn_v_b")
    if k_b is None or v_b is None or k_b.ndim != 3 or v_b.ndim != 3 or (
        k_b.shape[:2] != (v_b.shape[0], v_b.shape[2])
    ):
        raise GGUFError(f"{path}: blk.{layer}'s attn_k_b / attn_v_b are not a pair "
                        f"of (H, r, nope) and (H, v, r)")  # fmt: skip
    per_head = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, nope + v, r)
    return per_head.reshape(-1, per_head.shape[-1])


def qwen3next_fields(ck: Any) -> dict[str, Any]:
    """Qwen3-Next as llama.cpp writes it: Gated DeltaNet's shape under ``ssm.*``
    (``state_size`` the key head width, ``group_count`` the key heads,
    ``time_step_rank`` the value heads, ``inner_size`` their total width), a full
    attention layer every ``full_attention_interval``, the partial RoPE's width, experts
    beside one gated shared expert."""
    from .gated_deltanet import LinearAttentionConfig

    a = "qwen3next"
    layers = int(ck.meta(f"{a}.block_count"))
    every = int(ck.meta(f"{a}.full_attention_interval", 4))
    nv = int(ck.meta(f"{a}.ssm.time_step_rank"))
    linear = LinearAttentionConfig(
        num_k_heads=int(ck.meta(f"{a}.ssm.group_count")), num_v_heads=nv,
        head_k_dim=int(ck.meta(f"{a}.ssm.state_size")),
        head_v_dim=int(ck.meta(f"{a}.ssm.inner_size")) // nv,
        conv_kernel=int(ck.meta(f"{a}.ssm.conv_kernel")),
    )  # fmt: skip
    head_dim = int(ck.meta(f"{a}.attention.key_length"))
    rope = int(ck.meta(f"{a}.rope.dimension_count", head_dim // 4))
    experts = int(ck.meta(f"{a}.expert_count", 0))
    moe = None
    if experts:
        routed = ck.tensor_names  # (layers without a router: dense MLPs, mlp_only_layers)
        dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in routed)
        shared = int(ck.meta(f"{a}.expert_shared_feed_forward_length", 0))
        moe = MoEConfig(num_experts=experts, top_k=int(ck.meta(f"{a}.expert_used_count")),
                        intermediate_size=int(ck.meta(f"{a}.expert_feed_forward_length")),
                        norm_topk_prob=bool(ck.meta(f"{a}.expert_weights_norm", True)),
                        shared_intermediate_size=shared, shared_gate=bool(shared),
                        dense_layers=dense)  # fmt: skip
    return dict(
        model_type="qwen3_next", head_dim=head_dim, qk_norm=True, linear=linear, moe=moe,
        layer_types=tuple("linear_attention" if (i + 1) % every else "full_attention"
                          for i in range(layers)),
        partial_rotary_factor=rope / head_dim,
    )  # fmt: skip


def qwen3next_weight(hf: str, w: np.ndarray) -> np.ndarray:
    """A qwen3next tensor back in Hugging Face's form: llama.cpp stores the (1 + w) norms
    as 1 + w (Gated DeltaNet's own norm as is), ``A`` = -exp(A_log), the conv squeezed."""
    if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
        return w - 1.0
    if hf.endswith("linear_attn.A_log"):
        return np.log(-w)
    if hf.endswith("linear_attn.conv1d.weight"):
        return w.reshape(w.shape[0], 1, w.shape[-1])
    return w


def qkvz_from_split(path: str, layer: str, parts: dict[str, np.ndarray], nk: int) -> np.ndarray:
    """Gated DeltaNet's ``in_proj_qkvz`` (rows grouped by key head: q, k, v, z of each)
    from llama.cpp's ``attn_qkv`` (all q rows, all k rows, all v rows) and ``attn_gate``
    (z)."""
    if set(parts) != {"attn_qkv", "attn_gate"}:
        raise GGUFError(f"{path}: layer {layer} needs attn_qkv and attn_gate, has {sorted(parts)}")
    qkv, z = parts["attn_qkv"], parts["attn_gate"]
    vd = z.shape[0]
    kd = (qkv.shape[0] - vd) // 2
    q, k, v = qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd :]
    groups = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
    return np.concatenate(groups, axis=1).reshape(-1, qkv.shape[-1])


def granitehybrid_fields(ck: Any) -> dict[str, Any]:
    """Granite 4.0-H as llama.cpp writes it (``granitehybrid``): Mamba2's shape under
    ``ssm.*`` (``time_step_rank`` the heads, ``inner_size`` their total width), the
    attention layers those with KV heads in the per-layer ``head_count_kv``, experts of
    ``feed_forward_length`` beside the shared MLP (or the MLP alone), Granite's scales,
    RoPE only when ``rope.scaling.finetuned`` says so (the converter's flag for it)."""
    from .mamba2 import Mamba2Config

    a = "granitehybrid"
    kv = ck.meta(f"{a}.attention.head_count_kv")
    layers = int(ck.meta(f"{a}.block_count"))
    kv = [int(x) for x in (kv if isinstance(kv, (list, tuple, np.ndarray)) else [kv] * layers)]
    ssm = [i for i, n in enumerate(kv) if n == 0]
    if not ssm:
        raise GGUFError(f"{ck.path}: a {a} file without Mamba2 layers (head_count_kv {kv})")
    heads = int(ck.meta(f"{a}.ssm.time_step_rank"))
    names = ck.tensor_names
    mamba = Mamba2Config(
        num_heads=heads, head_dim=int(ck.meta(f"{a}.ssm.inner_size")) // heads,
        num_groups=int(ck.meta(f"{a}.ssm.group_count")),
        d_state=int(ck.meta(f"{a}.ssm.state_size")), d_conv=int(ck.meta(f"{a}.ssm.conv_kernel")),
        conv_bias=f"blk.{ssm[0]}.ssm_conv1d.bias" in names,
        proj_bias=f"blk.{ssm[0]}.ssm_in.bias" in names,
    )  # fmt: skip
    experts = int(ck.meta(f"{a}.expert_count", 0))
    shared = int(ck.meta(f"{a}.expert_shared_feed_forward_length"))
    moe = None
    if experts:
        moe = MoEConfig(num_experts=experts, top_k=int(ck.meta(f"{a}.expert_used_count")),
                        intermediate_size=int(ck.meta(f"{a}.feed_forward_length")),
                        norm_topk_prob=True, shared_intermediate_size=shared)  # fmt: skip
    scale = float(ck.meta(f"{a}.attention.scale", 1.0))
    return dict(
        model_type="granitemoehybrid", linear=mamba, moe=moe, num_kv_heads=max(kv),
        layer_types=tuple("linear_attention" if n == 0 else "full_attention" for n in kv),
        intermediate_size=shared, query_pre_attn_scalar=scale**-2,
        embedding_multiplier=float(ck.meta(f"{a}.embedding_scale", 1.0)),
        residual_multiplier=float(ck.meta(f"{a}.residual_scale", 1.0)),
        logits_scaling=float(ck.meta(f"{a}.logit_scale", 1.0)),
        rope=bool(ck.meta(f"{a}.rope.scaling.finetuned", False)),
        vocab_size=int(ck.tensor_dims("token_embd.weight")[0]),  # (the token list is padded)
    )  # fmt: skip


def granitehybrid_weight(hf: str, w: np.ndarray) -> np.ndarray:
    """A granitehybrid Mamba2 tensor back in Hugging Face's form: ``A`` = -exp(A_log)
    and ``D`` stored ``(heads, 1)``, the conv squeezed, the norm ``(groups, width)``."""
    if hf.endswith("mamba.A_log"):
        return np.log(-w.reshape(-1))
    if hf.endswith(("mamba.D", "mamba.norm.weight")):
        return w.reshape(-1)
    if hf.endswith("mamba.conv1d.weight"):
        return w.reshape(w.shape[0], 1, w.shape[-1])
    return w
