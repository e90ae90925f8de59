"""The shell of a hybrid decoder (Qwen3-Next, Granite 4.0-H): embeddings, runs of alike
layers stacked and scanned (:func:`~.stack.stack_segments`), the final norm and the LM
head, with one ``attend`` for the attention layers and its ``recurrence_of`` for the
recurrent ones. A family gives its layer class (called ``layer(x, positions, inv_freq,
attend_layer, recur_layer, carry)``), each layer's kind, its norm class and the Hugging
Face names of its mixers (``mixer_weights(layer, prefix, index)``); the multipliers
(``embedding_multiplier``, ``logits_scaling``) and RoPE (``rope``) come from the config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .interface import Attend, recurrence_of
from .moe import MoE, expert_weights
from .rope import rope_inv_freq
from .stack import layer_runs, num_stacked, run_layers, stack_segments


class HybridDecoder(nnx.Module):
    """A :class:`~.interface.CausalLM` over layers of ``kinds`` built by ``make(kind)``
    (each with ``input_layernorm``, ``post_attention_layernorm`` and ``mlp``: a dense MLP
    or a :class:`~.moe.MoE`); ``norm`` the final norm's class. A family's class sets
    ``mixer_weights`` (a static method: ``(layer, prefix, index)`` -> the HF names of a
    layer's token mixer; on the class, so no function is part of the model's graph)."""

    mixer_weights: Callable[[nnx.Module, str, int], dict]

    def __init__(self, cfg: Any, dtype: Any, rngs: nnx.Rngs, kinds: list,
                 make: Callable[[Any], nnx.Module], norm: type) -> None:  # fmt: skip
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers, self.layer_starts = stack_segments(make, kinds)
        self.scan_layers = True
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, **kw)
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> jax.Array:
        return self.logits(self.hidden_states(tokens, positions, attend, carry)[0])

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> tuple[jax.Array, Any]:
        cfg = self.config
        inv_freq = rope_inv_freq(cfg) if cfg.rope else None
        recur = recurrence_of(attend)

        def body(layer, x, i, carry):
            def attend_layer(q, k, v, c, **kw):
                return attend(i, q, k, v, c, **kw)

            def recur_layer(step, init, xs, c, **kw):
                return recur(i, step, init, xs, c, **kw)

            return layer(x, positions, inv_freq, attend_layer, recur_layer, carry)

        x = self.embed_tokens(tokens)
        if cfg.embedding_multiplier != 1.0:
            x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
        for start, layers in layer_runs(self.layers, self.layer_starts):
            x, carry = run_layers(layers, x, carry, body, scan=self.scan_layers, offset=start)
        return self.norm(x), carry

    def logits(self, x: jax.Array) -> jax.Array:
        out = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        out = out.astype(jnp.float32)
        scale = self.config.logits_scaling
        return out if scale == 1.0 else out / scale

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        if tp == 1:
            return []
        raise ValueError(f"{self.config.model_type}: tensor parallelism over its recurrent "
                         "layers is not supported yet")  # fmt: skip

    def hf_weights(self) -> dict[str, tuple[object, str, bool, int | None]]:
        t: dict[str, tuple[object, str, bool, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, "embedding", False, None),
            "model.norm.weight": (self.norm, "weight", False, None),
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, "kernel", True, None)
        for start, layer in layer_runs(self.layers, self.layer_starts):
            for i in range(num_stacked(layer)):
                p = f"model.layers.{start + i}."
                t[p + "input_layernorm.weight"] = (layer.input_layernorm, "weight", False, i)
                t[p + "post_attention_layernorm.weight"] = (
                    layer.post_attention_layernorm, "weight", False, i,
                )  # fmt: skip
                t.update(type(self).mixer_weights(layer, p, i))
                if isinstance(layer.mlp, MoE):
                    t.update(expert_weights(layer.mlp, p, i))
                else:
                    for name in ("gate_proj", "up_proj", "down_proj"):
                        t[p + f"mlp.{name}.weight"] = (getattr(layer.mlp, name), "kernel", True, i)
        return t
