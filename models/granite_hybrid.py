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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .interface import Attend, recurrence_of
from .llama import MLP, Attention, RMSNorm, attention_weights
from .mamba2 import Mamba2Mixer, mamba2_weights
from .moe import MoE, expert_weights
from .registry import register
from .rope import rope_inv_freq
from .stack import layer_runs, num_stacked, run_layers, stack_segments


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


@register("granitemoehybrid")
class GraniteHybridModel(nnx.Module):
    """Granite 4.0-H (see the module docstring): runs of alike layers stacked and
    scanned (:func:`~.stack.stack_segments`)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        if cfg.linear is None or cfg.layer_types is None:
            raise ValueError("granitemoehybrid: a config with Mamba2 layers is needed")
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        kinds = [t == "linear_attention" for t in cfg.layer_types]
        self.layers, self.layer_starts = stack_segments(
            lambda mamba: GraniteHybridLayer(cfg, dtype, rngs, mamba), kinds
        )
        self.scan_layers = True
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
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
        x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
        for start, layers in layer_runs(self.layers, self.layer_starts):
            x, carry = run_layers(layers, x, carry, body, scan=self.scan_layers, offset=start)
        return self.norm(x), carry

    def logits(self, x: jax.Array) -> jax.Array:
        out = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return out.astype(jnp.float32) / self.config.logits_scaling

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        if tp == 1:
            return []
        raise ValueError("granitemoehybrid: tensor parallelism over its recurrent layers is "
                         "not supported yet")  # fmt: skip

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
                if layer.mamba is not None:
                    t.update(mamba2_weights(layer.mamba, p + "mamba.", i))
                else:
                    t.update(attention_weights(layer.self_attn, p, i))
                if isinstance(layer.mlp, MoE):
                    t.update(expert_weights(layer.mlp, p, i))
                else:
                    for name in ("gate_proj", "up_proj", "down_proj"):
                        t[p + f"mlp.{name}.weight"] = (getattr(layer.mlp, name), "kernel", True, i)
        return t


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
