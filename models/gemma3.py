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
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import registry
from .config import ModelConfig
from .family import Family, GGUFArch
from .interface import Attend
from .llama import (
    MLP,
    Attention,
    attention_weights,
    decoder_tp_plan,
    rms_normalize,
    rope_inv_freq,
)
from .lora import TARGETS, lora_of
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
        m = self.mlp(self.pre_feedforward_layernorm(x), getattr(attend_layer, "lora", (None, None)))
        return x + self.post_feedforward_layernorm(m), carry


class Gemma3Model(nnx.Module):
    """Gemma 3 text decoder; ``model(tokens, positions, attend)`` returns fp32 logits."""

    lora_targets = TARGETS  # (models/lora.py)

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
        lora = lora_of(attend)
        order = itertools.count()  # (unrolled, the bodies run in layer order)

        def body(layer, x, i, carry):
            inv = jnp.where(jnp.asarray(local)[i], local_freq, global_freq)

            def attend_layer(q, k, v, c):
                return attend(i, q, k, v, c)

            if lora is not None:
                attend_layer.lora = (lora, lora.layer(i, next(order)))
            return layer(x, positions, inv, attend_layer, carry)

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


# -- the family: config.json and GGUF readers, preset ---------------------------------


def gemma3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Gemma 3 (text) from its config.json (transformers 4.x or 5.x spelling; a
    multimodal config's ``text_config``)."""
    cfg = cfg.get("text_config") or cfg
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise ValueError(f"gemma3: {cap} is not supported")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3: hidden_activation {act!r} is not supported")
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    local = rope.get("sliding_attention", {}) if isinstance(rope, dict) else {}
    for params in (full, local, cfg.get("rope_scaling") or {}):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(f"gemma3: rope type {kind!r} is not supported yet")
    heads = cfg.get("num_attention_heads", 8)
    layers = cfg.get("num_hidden_layers", 26)
    eos = cfg.get("eos_token_id", 1)
    return ModelConfig(
        vocab_size=cfg.get("vocab_size", 262208),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", 4),
        head_dim=cfg.get("head_dim", 256),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        model_type="gemma3",
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        sliding_window=int(cfg.get("sliding_window", 4096)),
        layer_types=tuple(cfg.get("layer_types") or gemma3_layer_types(layers)),
        qk_norm=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
    )


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's attention per layer: every ``pattern``-th layer global, the rest local."""
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    )


def _gemma3_gguf(ck: Any) -> dict[str, Any]:
    a = "gemma3"
    return dict(
        sliding_window=int(ck.meta(f"{a}.attention.sliding_window")),
        layer_types=gemma3_layer_types(int(ck.meta(f"{a}.block_count"))),
        qk_norm=True,
        # llama.cpp's choice: head_dim ** -0.5 (Gemma 3 27B alone differs).
        query_pre_attn_scalar=float(int(ck.meta(f"{a}.attention.key_length"))),
        rope_local_theta=float(ck.meta(f"{a}.rope.local.freq_base", 10000.0)),
    )


def _gemma3_gguf_weight(hf: str, w: np.ndarray) -> np.ndarray:
    return w - 1.0 if hf.endswith("norm.weight") else w  # stored as 1 + w


# Gemma's block has a norm before and after attention and MLP each.
_GGUF_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
PRESETS = {
    # Gemma 3's shape in small: 5 local layers (window 16) to 1 global one.
    "tiny-gemma3": ModelConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4,
        num_kv_heads=1, head_dim=32, max_position_embeddings=1024, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, model_type="gemma3", bos_token_id=256,
        eos_token_id=257, sliding_window=16, layer_types=gemma3_layer_types(6), qk_norm=True,
        query_pre_attn_scalar=32.0, rope_local_theta=10000.0,
    ),
}  # fmt: skip

FAMILY = registry.add(Family(
    name="gemma3", model=Gemma3Model, model_types=("gemma3", "gemma3_text"),
    from_hf=gemma3_from_hf,
    gguf=(GGUFArch("gemma3", "gemma3", fields=_gemma3_gguf, layer_names=_GGUF_NAMES,
                   weight=_gemma3_gguf_weight, spm_ranks_by_position=True,
                   add_space_prefix=False),),
    presets=PRESETS,
))  # fmt: skip
