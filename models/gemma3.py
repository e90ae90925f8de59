"""Gemma 3 (text) in Flax NNX: a :class:`~.interface.CausalLM`.

Against the Llama family: the embedding is scaled by ``sqrt(hidden_size)``; RMSNorm
multiplies by ``1 + weight`` (GGUF files store ``1 + weight``: the loader takes the 1
back off); q and k are RMS-normed per head before RoPE; each block is wrapped in pre- and
post-norms (attention and MLP); the MLP is a GELU-tanh gated one; queries are scaled by
``query_pre_attn_scalar ** -0.5``; local (sliding-window) layers rotate with RoPE base
``rope_local_theta`` (10 000) and global ones with ``rope_theta`` (1e6); every sixth
layer is global (``config.layer_types``); embeddings are tied; no soft-capping (Gemma 3
has none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .interface import Attend
from .llama import (
    MLP,
    Attention,
    attention_weights,
    decoder_tp_plan,
    rms_normalize,
    rope_inv_freq,
)
from .registry import register
from .stack import run_layers, stack_layers


class GemmaRMSNorm(nnx.Module):
    """``x / rms(x) * (1 + weight)``, in fp32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = 1.0 + self.weight[...].astype(jnp.float32)
        return (rms_normalize(x, self.eps) * scale).astype(x.dtype)


class Gemma3Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype, rngs, norm=GemmaRMSNorm)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, dtype, rngs, act="gelu_tanh")
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, inv_freq, attend_layer, carry):
        a, carry = self.self_attn(self.input_layernorm(x), positions, inv_freq, attend_layer, carry)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(m), carry


@register("gemma3")
class Gemma3Model(nnx.Module):
    """Gemma 3 text decoder; ``model(tokens, positions, attend)`` returns fp32 logits."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        if not cfg.tie_word_embeddings:
            raise ValueError("gemma3: untied embeddings are not supported")
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = stack_layers(lambda: Gemma3Layer(cfg, dtype, rngs), cfg.num_layers)
        self.scan_layers = True
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> jax.Array:
        return self.logits(self.hidden_states(tokens, positions, attend, carry)[0])

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> tuple[jax.Array, Any]:
        """The final-normed hidden states of tokens ``(B, T)`` and the attention's carry."""
        cfg = self.config
        global_freq = rope_inv_freq(cfg)
        local_freq = rope_inv_freq(
            dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta)
        )
        local = np.asarray([w > 0 for w in cfg.layer_windows()])

        def body(layer, x, i, carry):
            inv = jnp.where(jnp.asarray(local)[i], local_freq, global_freq)
            return layer(x, positions, inv, lambda q, k, v, c: attend(i, q, k, v, c), carry)

        x = self.embed_tokens(tokens)
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
        x, carry = run_layers(self.layers, x, carry, body, scan=self.scan_layers)
        return self.norm(x), carry

    def logits(self, x: jax.Array) -> jax.Array:
        """fp32 logits of hidden states ``(..., hidden)`` (tied embeddings)."""
        return self.embed_tokens.attend(x).astype(jnp.float32)

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        """See :func:`~.llama.decoder_tp_plan`."""
        return decoder_tp_plan(self, tp)

    def hf_weights(self) -> dict[str, tuple[object, str, bool, int | None]]:
        """Hugging Face tensor name -> (module, attribute, transpose, layer index)."""
        t: dict[str, tuple[object, str, bool, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, "embedding", False, None),
            "model.norm.weight": (self.norm, "weight", False, None),
        }
        layer = self.layers
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            for name in ("input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
                t[p + f"{name}.weight"] = (getattr(layer, name), "weight", False, i)
            t.update(attention_weights(layer.self_attn, p, i))
            for name in ("gate_proj", "up_proj", "down_proj"):
                t[p + f"mlp.{name}.weight"] = (getattr(layer.mlp, name), "kernel", True, i)
        return t
