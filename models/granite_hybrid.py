"""IBM Granite 4.0-H (``granitemoehybrid``) in Flax NNX: Mamba2 layers (:mod:`.mamba2`,
recurrent state) and attention layers (no RoPE when ``position_embedding_type`` is
"nope"), each followed by a mixture of experts beside a shared SwiGLU MLP (or the MLP
alone).

Granite's scalars: the embeddings are multiplied by ``embedding_multiplier``, each
sublayer's output by ``residual_multiplier`` before its residual add, the attention
scores by ``attention_multiplier`` (instead of ``head_dim ** -0.5``: the config's
``query_pre_attn_scalar``) and the logits divided by ``logits_scaling``. The checkpoint's
fused tensors (``block_sparse_moe.input_linear`` / ``output_linear`` / ``router.layer``,
``shared_mlp.input_linear`` / ``output_linear``) are split per expert at load
(:func:`split_granite_tensors`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .hybrid import HybridDecoder
from .llama import MLP, Attention, RMSNorm, attention_weights
from .mamba2 import Mamba2Mixer, mamba2_weights
from .moe import MoE
from .registry import register


class GraniteHybridLayer(nnx.Module):
    """A mixer (Mamba2 when ``kind`` is True, else attention), then the feed-forward."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs, mamba: bool) -> None:
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.linear, eps, dtype, rngs) if mamba else None
        self.self_attn = None if mamba else Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        if cfg.moe is not None:
            shared = MLP(cfg, dtype, rngs, units=cfg.moe.shared_intermediate_size)
            self.mlp = MoE(cfg.hidden_size, cfg.moe, dtype, rngs, shared=shared)
        else:
            self.mlp = MLP(cfg, dtype, rngs)
        self.residual = cfg.residual_multiplier

    def __call__(self, x, positions, inv_freq, attend_layer, recur_layer, carry):
        y = self.input_layernorm(x)
        if self.mamba is not None:
            a, carry = self.mamba(y, recur_layer, carry)
        else:
            a, carry = self.self_attn(y, positions, inv_freq, attend_layer, carry)
        x = x + a * jnp.asarray(self.residual, x.dtype)
        f = self.mlp(self.post_attention_layernorm(x))
        return x + f * jnp.asarray(self.residual, x.dtype), carry


def _mixer_weights(layer: GraniteHybridLayer, p: str, i: int) -> dict[str, tuple]:
    if layer.mamba is not None:
        return mamba2_weights(layer.mamba, p + "mamba.", i)
    return attention_weights(layer.self_attn, p, i)


@register("granitemoehybrid")
class GraniteHybridModel(HybridDecoder):
    """Granite 4.0-H (see the module docstring)."""

    mixer_weights = staticmethod(_mixer_weights)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        if cfg.linear is None or cfg.layer_types is None:
            raise ValueError("granitemoehybrid: a config with Mamba2 layers is needed")
        kinds = [t == "linear_attention" for t in cfg.layer_types]
        def make(mamba):
            return GraniteHybridLayer(cfg, dtype, rngs, mamba)

        super().__init__(cfg, dtype, rngs, kinds, make, RMSNorm)


def split_granite_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """Granite's fused feed-forward tensors as the per-expert names :func:`expert_weights`
    reads (in place; returns ``tensors``): ``block_sparse_moe.input_linear`` ``(E, 2I,
    H)`` (gate rows, then up), ``output_linear`` ``(E, H, I)``, ``router.layer``; the
    shared MLP's ``input_linear`` ``(2S, H)`` and ``output_linear`` as the shared
    experts' (with experts) or the layer's MLP (without)."""
    for name in [n for n in tensors if n.endswith(".shared_mlp.input_linear.weight")]:
        p = name[: -len("shared_mlp.input_linear.weight")]
        moe = p + "block_sparse_moe.input_linear.weight" in tensors
        where = p + ("mlp.shared_experts." if moe else "mlp.")
        gu = np.asarray(tensors.pop(name))
        half = gu.shape[0] // 2
        tensors[where + "gate_proj.weight"] = gu[:half]
        tensors[where + "up_proj.weight"] = gu[half:]
        tensors[where + "down_proj.weight"] = tensors.pop(p + "shared_mlp.output_linear.weight")
        if not moe:
            continue
        gu = np.asarray(tensors.pop(p + "block_sparse_moe.input_linear.weight"))
        down = np.asarray(tensors.pop(p + "block_sparse_moe.output_linear.weight"))
        inter = gu.shape[1] // 2
        for j in range(gu.shape[0]):
            q = f"{p}mlp.experts.{j}."
            tensors[q + "gate_proj.weight"] = gu[j, :inter]
            tensors[q + "up_proj.weight"] = gu[j, inter:]
            tensors[q + "down_proj.weight"] = down[j]
        tensors[p + "mlp.gate.weight"] = tensors.pop(p + "block_sparse_moe.router.layer.weight")
    return tensors
