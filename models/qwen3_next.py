"""Qwen3-Next in Flax NNX: Gated DeltaNet layers (:mod:`.gated_deltanet`, recurrent
state) and gated full attention, 3 to 1 by default, each followed by a mixture of
experts with a gated shared expert (:mod:`.moe`) or a dense MLP.

Full attention: q_proj gives each head's query and a gate (interleaved per head), q and
k get RMSNorm per head, RoPE rotates the first ``partial_rotary_factor`` of each head,
and the output is multiplied by ``sigmoid(gate)`` before o_proj. Every norm scales by
``1 + weight`` (:class:`~.gemma3.GemmaRMSNorm`'s form). A
:class:`~.interface.CausalLM`: the attention layers go through ``attend`` (the engine's
full-attention group), the Gated DeltaNet layers through ``recurrence_of(attend)`` (its
recurrent group's state slots).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .gated_deltanet import GatedDeltaNet, gated_deltanet_weights
from .gemma3 import GemmaRMSNorm
from .interface import Attend, recurrence_of
from .llama import MLP
from .moe import MoE, expert_weights
from .registry import register
from .rope import apply_rope, rope_inv_freq
from .stack import layer_runs, num_stacked, run_layers, stack_segments


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


@register("qwen3_next")
class Qwen3NextModel(nnx.Module):
    """Qwen3-Next (see the module docstring): runs of alike layers stacked and scanned
    (:func:`~.stack.stack_segments`)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        types = cfg.layer_types or ("full_attention",) * cfg.num_layers  # (all attention)
        kinds = [
            (t == "linear_attention", cfg.moe is not None and cfg.moe.is_moe(i))
            for i, t in enumerate(types)
        ]
        self.layers, self.layer_starts = stack_segments(
            lambda kind: Qwen3NextLayer(cfg, dtype, rngs, kind), kinds
        )
        self.scan_layers = True
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
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
        inv_freq = rope_inv_freq(self.config)
        recur = recurrence_of(attend)

        def body(layer, x, i, carry):
            def attend_layer(q, k, v, c, **kw):
                return attend(i, q, k, v, c, **kw)

            def recur_layer(step, init, xs, c, **kw):
                return recur(i, step, init, xs, c, **kw)

            return layer(x, positions, inv_freq, attend_layer, recur_layer, carry)

        x = self.embed_tokens(tokens)
        for start, layers in layer_runs(self.layers, self.layer_starts):
            x, carry = run_layers(layers, x, carry, body, scan=self.scan_layers, offset=start)
        return self.norm(x), carry

    def logits(self, x: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.embed_tokens.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        if tp == 1:
            return []
        raise ValueError("qwen3_next: tensor parallelism over its recurrent layers is not "
                         "supported yet")  # fmt: skip

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
                if layer.linear_attn is not None:
                    t.update(gated_deltanet_weights(layer.linear_attn, p, i))
                else:
                    a = layer.self_attn
                    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                        t[p + f"self_attn.{name}.weight"] = (getattr(a, name), "kernel", True, i)
                    t[p + "self_attn.q_norm.weight"] = (a.q_norm, "weight", False, i)
                    t[p + "self_attn.k_norm.weight"] = (a.k_norm, "weight", False, i)
                if isinstance(layer.mlp, MoE):
                    t.update(expert_weights(layer.mlp, p, i))
                else:
                    for name in ("gate_proj", "up_proj", "down_proj"):
                        t[p + f"mlp.{name}.weight"] = (getattr(layer.mlp, name), "kernel", True, i)
        return t
