"""The Llama family (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral) in Flax NNX: RMSNorm, RoPE
(with llama3 scaling), GQA, SwiGLU, optional tied embeddings; Qwen2 is the same with
biases on q/k/v, Qwen3 with q/k RMSNorm per head, Qwen3-MoE with experts, Mistral with a
sliding window (``config.layer_windows()``: the attention the engine supplies applies
it). :class:`LlamaModel` also runs DeepSeek's (:mod:`.deepseek`) and GPT-OSS's
(:mod:`.gpt_oss`) layers. The family's config.json and GGUF readers and presets close
the module.

Attention is a pluggable function, ``attend(layer, q, k, v, carry) -> (out, carry)`` with
q ``(B, T, H, D)`` and k / v ``(B, T, Hkv, D)`` after RoPE, so the same module runs over a
paged KV cache (jax_kvcached.engine.attention), a dense cache, or no cache at all. The
layers are stored stacked and run under ``jax.lax.scan`` (:mod:`.stack`): ``layer`` is
an int32 scalar and ``carry`` whatever state the attention threads from layer to layer.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import registry
from .config import ModelConfig, hf_common
from .family import Family, GGUFArch
from .interface import Attend
from .lora import TARGETS, LoRABatch, add_delta, lora_of
from .mla import MLAttention, mla_tp_plan, mla_weights
from .moe import MoE, MoEConfig, expert_weights, moe_from_hf
from .norm import rms_normalize
from .quant_linear import project, split_entries
from .rope import apply_rope, rope_attention_factor, rope_inv_freq
from .stack import layer_runs, num_stacked, run_layers, stack_segments


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight[...] * rms_normalize(x, self.eps).astype(x.dtype)


class Attention(nnx.Module):
    """GQA projections, RoPE, optional q/k RMSNorm per head (``norm``: the model's norm
    class) and an optional query scale other than ``head_dim ** -0.5`` (the attention the
    engine supplies divides by ``sqrt(head_dim)``; q is pre-scaled to make up the rest)."""

    def __init__(
        self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, norm: type | None = None
    ) -> None:
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(cfg.hidden_size, h * d, use_bias=cfg.qkv_bias, **kw)
        self.k_proj = nnx.Linear(cfg.hidden_size, kvh * d, use_bias=cfg.qkv_bias, **kw)
        self.v_proj = nnx.Linear(cfg.hidden_size, kvh * d, use_bias=cfg.qkv_bias, **kw)
        self.o_proj = nnx.Linear(h * d, cfg.hidden_size, use_bias=cfg.o_bias, **kw)
        # GPT-OSS's attention sinks: a logit per head in the softmax's denominator
        self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32)) if cfg.attention_sinks else None
        norm = norm or RMSNorm
        self.q_norm = norm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = norm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = float(d**0.5 * scalar**-0.5) if scalar and scalar != d else None
        factor = rope_attention_factor(cfg)  # YaRN: q and k scaled after the rotation
        self.rope_factor = factor if factor != 1.0 else None
        self.shape = (h, kvh, d)

    def __call__(self, x, positions, inv_freq, attend_layer, carry):
        b, t, _ = x.shape
        h, kvh, d = self.shape
        q, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj])
        lora, i = getattr(attend_layer, "lora", (None, None))  # (the step's adapters)
        if lora is not None:
            q, k, v = (add_delta(y, x, lora, i, name) for y, name in
                       ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))  # fmt: skip
        q = q.reshape(b, t, h, d)
        k = k.reshape(b, t, kvh, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if inv_freq is not None:  # (None: no positional rotation, Granite 4.0-H's "nope")
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
        if self.rope_factor is not None:
            q = q * jnp.asarray(self.rope_factor, q.dtype)
            k = k * jnp.asarray(self.rope_factor, k.dtype)
        if self.q_scale is not None:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        v = v.reshape(b, t, kvh, d)
        if self.sinks is not None:
            out, carry = attend_layer(q, k, v, carry, sinks=self.sinks[...])
        else:
            out, carry = attend_layer(q, k, v, carry)
        out = out.reshape(b, t, h * d).astype(x.dtype)
        return add_delta(self.o_proj(out), out, lora, i, "o_proj"), carry


# Gated MLP activations by name: SwiGLU (Llama family), GELU-tanh (Gemma).
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``; ``act`` names the activation (``_ACTIVATIONS``);
    ``units``: its width (default ``intermediate_size``; a mixture of experts' shared
    experts have their own)."""

    def __init__(
        self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, act: str = "silu",
        units: int | None = None,
    ) -> None:  # fmt: skip
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        units = units or cfg.intermediate_size
        self.gate_proj = nnx.Linear(cfg.hidden_size, units, **kw)
        self.up_proj = nnx.Linear(cfg.hidden_size, units, **kw)
        self.down_proj = nnx.Linear(units, cfg.hidden_size, **kw)
        self.act = act

    def __call__(self, x, lora: tuple[LoRABatch | None, Any] = (None, None)):
        gate, up = project(x, [self.gate_proj, self.up_proj])
        batch, i = lora  # (the step's adapters, this layer)
        if batch is not None:
            gate = add_delta(gate, x, batch, i, "gate_proj")
            up = add_delta(up, x, batch, i, "up_proj")
        h = _ACTIVATIONS[self.act](gate) * up
        return add_delta(self.down_proj(h), h, batch, i, "down_proj")


class DecoderLayer(nnx.Module):
    """Attention then a feed-forward: the dense MLP, or (``moe``) the model's mixture of
    experts (:mod:`.moe`)."""

    def __init__(
        self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, moe: bool = False
    ) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.mla is not None:
            self.self_attn = MLAttention(cfg, dtype, rngs, RMSNorm)
        else:
            self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not moe:
            self.mlp = MLP(cfg, dtype, rngs)
        else:  # DeepSeek's shared experts: one MLP of their total width
            width = cfg.moe.shared_intermediate_size
            shared = MLP(cfg, dtype, rngs, units=width) if width else None
            self.mlp = MoE(cfg.hidden_size, cfg.moe, dtype, rngs, shared=shared)

    def __call__(self, x, positions, inv_freq, attend_layer, carry):
        a, carry = self.self_attn(self.input_layernorm(x), positions, inv_freq, attend_layer, carry)
        x = x + a
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MLP):
            return x + self.mlp(h, getattr(attend_layer, "lora", (None, None))), carry
        return x + self.mlp(h), carry


class LlamaModel(nnx.Module):
    """Decoder-only LM (Llama family, Qwen2/3, Qwen3-MoE, DeepSeek-V2/V3 with latent
    attention: :mod:`.mla`, GPT-OSS with attention sinks): a :class:`~.interface.CausalLM`.
    ``model(tokens, positions, attend)`` returns fp32 logits. ``layers`` is one
    DecoderLayer with stacked parameters (or, when dense and mixture-of-experts layers
    mix, an ``nnx.List`` of one stack per run: ``layer_starts``); ``scan_layers`` False
    unrolls them."""

    # The projections a LoRA adapter may target in this model (models/lora.py).
    lora_targets = TARGETS

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        kinds = [cfg.moe is not None and cfg.moe.is_moe(i) for i in range(cfg.num_layers)]
        self.layers, self.layer_starts = stack_segments(
            lambda moe: DecoderLayer(cfg, dtype, rngs, moe), kinds
        )
        self.scan_layers = True
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> jax.Array:
        return self.logits(self.hidden_states(tokens, positions, attend, carry)[0])

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> tuple[jax.Array, Any]:
        """The final-normed hidden states ``(..., hidden)`` of tokens ``(B, T)``, and the
        attention's carry after the last layer."""
        inv_freq = rope_inv_freq(self.config)
        lora = lora_of(attend)
        order = itertools.count()  # (unrolled, the bodies run in layer order)

        def body(layer, x, i, carry):
            def attend_layer(q, k, v, c, **kw):
                return attend(i, q, k, v, c, **kw)

            if lora is not None:
                attend_layer.lora = (lora, lora.layer(i, next(order)))
            return layer(x, positions, inv_freq, attend_layer, carry)

        x = self.embed_tokens(tokens)
        for start, layers in layer_runs(self.layers, self.layer_starts):
            x, carry = run_layers(layers, x, carry, body, scan=self.scan_layers, offset=start)
        return self.norm(x), carry

    def logits(self, x: jax.Array) -> jax.Array:
        """fp32 logits of hidden states ``(..., hidden)`` (only the rows that need them)."""
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        """See :func:`decoder_tp_plan`."""
        return decoder_tp_plan(self, tp)

    def hf_weights(self) -> dict[str, tuple[object, str, bool, int | None]]:
        """Hugging Face tensor name -> (module, attribute, transpose, layer index into
        the stacked parameter or None)."""
        t: dict[str, tuple[object, str, bool, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, "embedding", False, None),
            "model.norm.weight": (self.norm, "weight", False, None),
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, "kernel", True, None)
        for start, layer in layer_runs(self.layers, self.layer_starts):
            for i in range(num_stacked(layer)):  # i: the index into this run's stack
                p = f"model.layers.{start + i}."
                t[p + "input_layernorm.weight"] = (layer.input_layernorm, "weight", False, i)
                t[p + "post_attention_layernorm.weight"] = (
                    layer.post_attention_layernorm, "weight", False, i,
                )  # fmt: skip
                t.update(attention_weights(layer.self_attn, p, i))
                if isinstance(layer.mlp, MoE):
                    t.update(expert_weights(layer.mlp, p, i))
                    continue
                for name in ("gate_proj", "up_proj", "down_proj"):
                    t[p + f"mlp.{name}.weight"] = (getattr(layer.mlp, name), "kernel", True, i)
        return t


def attention_weights(attn: Attention | MLAttention, p: str, i: int) -> dict[str, tuple]:
    """The HF names of one layer's attention weights (prefix ``p``, layer ``i``)."""
    if isinstance(attn, MLAttention):
        return mla_weights(attn, p, i)
    t: dict[str, tuple] = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mod = getattr(attn, name)
        t[p + f"self_attn.{name}.weight"] = (mod, "kernel", True, i)
        if mod.bias is not None:
            t[p + f"self_attn.{name}.bias"] = (mod, "bias", False, i)
    if attn.sinks is not None:
        t[p + "self_attn.sinks"] = (attn, "sinks", False, i)
    if attn.q_norm is not None:
        t[p + "self_attn.q_norm.weight"] = (attn.q_norm, "weight", False, i)
        t[p + "self_attn.k_norm.weight"] = (attn.k_norm, "weight", False, i)
    return t


def decoder_tp_plan(model: Any, tp: int) -> list[tuple[object, str, int]]:
    """(module, attribute, split axis) of each parameter of a decoder (``embed_tokens``,
    optional ``lm_head``, stacked ``layers`` with ``self_attn`` and ``mlp``) split over
    ``tp`` devices (the rest are replicated): attention heads and KV heads, the MLP's
    hidden units and, when it divides, the vocabulary. ValueError when heads do not split."""
    cfg = model.config
    runs = layer_runs(model.layers, getattr(model, "layer_starts", (0,)))
    checks = [("attention heads", cfg.num_heads)]
    if cfg.mla is None:  # (a latent cache is replicated)
        checks.append(("KV heads", cfg.num_kv_heads))
    if any(not isinstance(layers.mlp, MoE) for _, layers in runs):
        checks.append(("MLP units (intermediate_size)", cfg.intermediate_size))
    if cfg.moe is not None:
        checks.append(("expert units (moe_intermediate_size)", cfg.moe.intermediate_size))
        if cfg.moe.shared_intermediate_size:
            checks.append(("shared expert units", cfg.moe.shared_intermediate_size))
    for what, n in checks:
        if n % tp:
            raise ValueError(
                f"tensor parallelism over {tp} devices needs {what} divisible by {tp}; "
                f"this {cfg.model_type} model has {n}"
            )
    plan: list[tuple[object, str, int]] = []
    lm_head = getattr(model, "lm_head", None)
    if cfg.vocab_size % tp == 0:
        plan += split_entries(model.embed_tokens, "out", tp)
        if lm_head is not None:
            plan += split_entries(lm_head, "out", tp)
    for _, layers in runs:
        attn, mlp = layers.self_attn, layers.mlp  # stacked
        if isinstance(attn, MLAttention):
            plan += mla_tp_plan(attn, tp)
            outs, ins = [], []
        else:
            outs, ins = [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj]
        if isinstance(mlp, MoE):  # experts split along their intermediate units
            plan += [(mlp, "gate_up", mlp.gate_up.get_value().ndim - 1),
                     (mlp, "down", mlp.down.get_value().ndim - 2)]  # fmt: skip
            if mlp.gate_up_bias is not None:  # (the down bias stays whole)
                plan.append((mlp, "gate_up_bias", mlp.gate_up_bias.get_value().ndim - 1))
            if mlp.shared is not None:
                outs += [mlp.shared.gate_proj, mlp.shared.up_proj]
                ins.append(mlp.shared.down_proj)
        else:
            outs += [mlp.gate_proj, mlp.up_proj]
            ins.append(mlp.down_proj)
        if not isinstance(attn, MLAttention) and attn.sinks is not None:  # one per head
            plan.append((attn, "sinks", attn.sinks.get_value().ndim - 1))
        for mod in outs:
            plan += split_entries(mod, "out", tp)  # by output columns (and the bias)
        for mod in ins:
            plan += split_entries(mod, "in", tp)  # by input rows
    return plan


# -- the family: config.json and GGUF readers, presets --------------------------------


def llama_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Llama, Mistral, Qwen2 (biases on q/k/v; a window only with
    ``use_sliding_window``), Qwen3 (q/k norms) and Qwen3-MoE from a config.json."""
    t = cfg.get("model_type", "llama")
    if t == "qwen2" and not cfg.get("use_sliding_window", False):
        cfg = {**cfg, "sliding_window": None}  # Qwen2 configs carry a window they do not use
    bias = bool(cfg.get("attention_bias", False))
    return hf_common(
        cfg, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if t == "qwen2" else 1e-5)),
        qkv_bias=t == "qwen2" or bias, o_bias=t not in ("qwen2", "mistral") and bias,
        qk_norm=t in ("qwen3", "qwen3_moe"), moe=moe_from_hf(cfg) if t == "qwen3_moe" else None,
    )  # fmt: skip


def _llama_gguf(ck: Any) -> dict[str, Any]:
    window = ck.meta("llama.attention.sliding_window", None)
    return dict(sliding_window=int(window)) if window else {}  # Mistral: every layer


def _qwen3moe_gguf(ck: Any) -> dict[str, Any]:
    """Every layer MoE; llama.cpp renormalizes the top k."""
    a = "qwen3moe"
    return dict(qk_norm=True, moe=MoEConfig(
        num_experts=int(ck.meta(f"{a}.expert_count")),
        top_k=int(ck.meta(f"{a}.expert_used_count")),
        intermediate_size=int(ck.meta(f"{a}.expert_feed_forward_length")), norm_topk_prob=True,
    ))  # fmt: skip


_BYTES = dict(vocab_size=320, bos_token_id=256, eos_token_id=257, max_position_embeddings=1024)
_SMALL = dict(_BYTES, hidden_size=128, intermediate_size=256, num_heads=4, head_dim=32)
_LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 256), ("rope_type", "llama3"))  # fmt: skip
_QWEN3 = ModelConfig(**_SMALL, num_layers=3, num_kv_heads=2, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, model_type="qwen3",
                     qk_norm=True)  # fmt: skip
PRESETS = {
    "tiny-llama": ModelConfig(**_SMALL, num_layers=4, num_kv_heads=2, rope_scaling=_LLAMA3_ROPE,
                              tie_word_embeddings=True, model_type="llama"),
    "tiny-qwen2": ModelConfig(**{**_SMALL, "intermediate_size": 320}, num_layers=3,
                              num_kv_heads=1, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              qkv_bias=True, model_type="qwen2"),
    # Mistral-style: one sliding window on every layer.
    "tiny-mistral": ModelConfig(**_SMALL, num_layers=3, num_kv_heads=2, model_type="mistral",
                                sliding_window=24),
    # GPT-OSS-style: sliding-window and full layers alternate.
    "tiny-swa": ModelConfig(**_SMALL, num_layers=4, num_kv_heads=2, model_type="llama",
                            sliding_window=16,
                            layer_types=("sliding_attention", "full_attention") * 2),
    "tiny-qwen3": _QWEN3,
    # Qwen3-MoE's shape in small: tiny-qwen3 with 8 experts, 2 a token, the first layer
    # dense (mlp_only_layers), so both kinds of layer run.
    "tiny-qwen3-moe": dataclasses.replace(
        _QWEN3, model_type="qwen3_moe", tie_word_embeddings=False,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True,
                      dense_layers=(0,)),
    ),
}  # fmt: skip

FAMILY = registry.add(Family(
    name="llama", model=LlamaModel,
    model_types=("llama", "qwen2", "qwen3", "mistral", "qwen3_moe"),
    from_hf=llama_from_hf,
    gguf=(GGUFArch("llama", "llama", fields=_llama_gguf, permuted=True),
          GGUFArch("qwen2", "qwen2", fields=lambda ck: dict(qkv_bias=True)),
          GGUFArch("qwen3", "qwen3", fields=lambda ck: dict(qk_norm=True)),
          GGUFArch("qwen3moe", "qwen3_moe", fields=_qwen3moe_gguf)),
    presets=PRESETS,
))  # fmt: skip
