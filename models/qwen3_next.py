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
from flax import nnx

from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet, gated_deltanet_weights
from .gemma3 import GemmaRMSNorm
from .hybrid import HybridDecoder
from .llama import MLP
from .moe import MoE
from .registry import register
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


@register("qwen3_next")
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
