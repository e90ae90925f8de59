"""Qwen3-Next in Flax NNX: Gated DeltaNet layers (:mod:`.gated_deltanet`, recurrent
state) and gated full attention, 3 to 1 by default, each followed by a mixture of
experts with a gated shared expert (:mod:`.moe`) or a dense MLP.

Full attention: q_proj gives each head's query and a gate (interleaved per head), q and
k get RMSNorm per head, RoPE rotates the first ``partial_rotary_factor`` of each head,
and the output is multiplied by ``sigmoid(gate)`` before o_proj. Every norm scales by
``1 + weight`` (:class:`~.gemma3.GemmaRMSNorm`'s form). A
:class:`~.hybrid.HybridDecoder`: the attention layers go through ``attend`` (the
engine's full-attention group), the Gated DeltaNet layers through
``recurrence_of(attend)`` (its recurrent group's state slots).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import registry
from .config import ModelConfig, hf_common, hf_rope
from .family import Family, GGUFArch, Merge
from .gated_deltanet import (
    GatedDeltaNet,
    LinearAttentionConfig,
    gated_deltanet_weights,
    linear_from_hf,
)
from .gemma3 import GemmaRMSNorm
from .gguf import GGUFError
from .hybrid import HybridDecoder
from .llama import MLP
from .moe import MoE, MoEConfig, moe_from_hf
from .rope import apply_rope


class GatedAttention(nnx.Module):
    """Qwen3-Next's full attention (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs) -> None:
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(cfg.hidden_size, 2 * h * d, **kw)
        self.k_proj = nnx.Linear(cfg.hidden_size, kvh * d, **kw)
        self.v_proj = nnx.Linear(cfg.hidden_size, kvh * d, **kw)
        self.o_proj = nnx.Linear(h * d, cfg.hidden_size, **kw)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.shape = (h, kvh, d)

    def __call__(self, x, positions, inv_freq, attend_layer, carry):
        b, t, _ = x.shape
        h, kvh, d = self.shape
        qg = self.q_proj(x).reshape(b, t, h, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, h * d)
        q = apply_rope(self.q_norm(q), positions, inv_freq)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(b, t, kvh, d)), positions, inv_freq)
        v = self.v_proj(x).reshape(b, t, kvh, d)
        out, carry = attend_layer(q, k, v, carry)
        out = out.reshape(b, t, h * d).astype(jnp.float32) * jax.nn.sigmoid(
            gate.astype(jnp.float32)
        )
        return self.o_proj(out.astype(x.dtype)), carry


class Qwen3NextLayer(nnx.Module):
    """A token mixer (Gated DeltaNet when ``linear``, else gated attention) and a
    feed-forward (the mixture of experts when ``moe``, else the dense MLP)."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs, kind: tuple) -> None:
        linear, moe = kind
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.linear_attn = (
            GatedDeltaNet(cfg.hidden_size, cfg.linear, eps, dtype, rngs) if linear else None
        )
        self.self_attn = None if linear else GatedAttention(cfg, dtype, rngs)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        if moe:
            width = cfg.moe.shared_intermediate_size
            shared = MLP(cfg, dtype, rngs, units=width) if width else None
            self.mlp = MoE(cfg.hidden_size, cfg.moe, dtype, rngs, shared=shared)
        else:
            self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, inv_freq, attend_layer, recur_layer, carry):
        y = self.input_layernorm(x)
        if self.linear_attn is not None:
            a, carry = self.linear_attn(y, recur_layer, carry)
        else:
            a, carry = self.self_attn(y, positions, inv_freq, attend_layer, carry)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), carry


def _mixer_weights(layer: Qwen3NextLayer, p: str, i: int) -> dict[str, tuple]:
    if layer.linear_attn is not None:
        return gated_deltanet_weights(layer.linear_attn, p, i)
    a, t = layer.self_attn, {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        t[p + f"self_attn.{name}.weight"] = (getattr(a, name), "kernel", True, i)
    t[p + "self_attn.q_norm.weight"] = (a.q_norm, "weight", False, i)
    t[p + "self_attn.k_norm.weight"] = (a.k_norm, "weight", False, i)
    return t


class Qwen3NextModel(HybridDecoder):
    """Qwen3-Next (see the module docstring); without linear attention layers, the same
    model with gated attention on every layer."""

    mixer_weights = staticmethod(_mixer_weights)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        types = cfg.layer_types or ("full_attention",) * cfg.num_layers
        kinds = [
            (t == "linear_attention", cfg.moe is not None and cfg.moe.is_moe(i))
            for i, t in enumerate(types)
        ]

        def make(kind):
            return Qwen3NextLayer(cfg, dtype, rngs, kind)

        super().__init__(cfg, dtype, rngs, kinds, make, GemmaRMSNorm)


# -- the family: config.json and GGUF readers, preset ---------------------------------


def qwen3_next_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Qwen3-Next from a config.json: Gated DeltaNet on the "linear_attention" layers
    (every ``full_attention_interval``-th one full attention when ``layer_types`` is
    absent), a partial RoPE, experts with a gated shared expert."""
    _, _, rope_params = hf_rope(cfg)
    partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(cfg["num_hidden_layers"])]  # fmt: skip
    return hf_common(cfg, qk_norm=True, linear=linear_from_hf(cfg), layer_types=tuple(types),
                     moe=moe_from_hf(cfg, shared_gate=True),
                     partial_rotary_factor=float(partial))  # fmt: skip


def qwen3next_fields(ck: Any) -> dict[str, Any]:
    """Qwen3-Next as llama.cpp writes it: Gated DeltaNet's shape under ``ssm.*``
    (``state_size`` the key head width, ``group_count`` the key heads,
    ``time_step_rank`` the value heads, ``inner_size`` their total width), a full
    attention layer every ``full_attention_interval``, the partial RoPE's width, experts
    beside one gated shared expert."""
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


def qkvz_from_split(path: str, layer: str, parts: dict[str, np.ndarray], cfg: Any) -> np.ndarray:
    """Gated DeltaNet's ``in_proj_qkvz`` (rows grouped by key head: q, k, v, z of each)
    from llama.cpp's ``attn_qkv`` (all q rows, all k rows, all v rows) and ``attn_gate``
    (z)."""
    if set(parts) != {"attn_qkv", "attn_gate"}:
        raise GGUFError(f"{path}: layer {layer} needs attn_qkv and attn_gate, has {sorted(parts)}")
    qkv, z = parts["attn_qkv"], parts["attn_gate"]
    vd = z.shape[0]
    kd = (qkv.shape[0] - vd) // 2
    q, k, v = qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd :]
    nk = cfg.linear.num_k_heads
    groups = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
    return np.concatenate(groups, axis=1).reshape(-1, qkv.shape[-1])


# Qwen3-Next's shape in small: Gated DeltaNet (2 key heads, 4 value heads of 16) on 3 of
# every 4 layers, gated full attention with a partial RoPE on the 4th, and experts with
# a gated shared expert.
PRESETS = {
    "tiny-qwen3-next": ModelConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, model_type="qwen3_next", bos_token_id=256, eos_token_id=257,
        qk_norm=True, partial_rotary_factor=0.25,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear=LinearAttentionConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                     head_v_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True,
                      shared_intermediate_size=64, shared_gate=True),
    ),
}  # fmt: skip
# Gated DeltaNet's tensors under ssm_*, one gated shared expert (its HF name singular);
# attn_qkv / attn_gate are merged into in_proj_qkvz apart.
_GGUF_NAMES = {
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}

FAMILY = registry.add(Family(
    name="qwen3_next", model=Qwen3NextModel, model_types=("qwen3_next",),
    from_hf=qwen3_next_from_hf,
    gguf=(GGUFArch("qwen3next", "qwen3_next", fields=qwen3next_fields, layer_names=_GGUF_NAMES,
                   weight=qwen3next_weight,
                   merges=(Merge(("attn_qkv", "attn_gate"), "linear_attn.in_proj_qkvz.weight",
                                 qkvz_from_split),)),),
    presets=PRESETS,
))  # fmt: skip
