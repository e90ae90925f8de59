"""Multi-head latent attention (MLA: DeepSeek-V2 / V3), over a latent KV cache.

A token's keys and values are compressed into one latent per layer: ``c`` (``kv_lora_rank``
values, RMS-normed) and a shared rotary key ``k_rope`` (``qk_rope_head_dim``). Every head's
key is ``[W_UK c, k_rope]`` and its value ``W_UV c`` (``kv_b_proj`` holds ``W_UK`` and
``W_UV``). The cache keeps only ``[c, k_rope]``: one plane of ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer (``KVCache(latent=True)``), 576 in
DeepSeek-V3 against 2 x 128 heads x 192 for the same model's keys and values.

Attention runs in the *absorbed* form, for prefill chunks and decode rows alike: each
head's query ``q_nope`` goes through ``W_UK`` into the latent space, so a head's score is
``[q_nope W_UK, q_rope] . [c, k_rope]``: multi-query attention of ``H`` heads over one
latent head, the latent itself as the values. The first ``kv_lora_rank`` values of the
output go through ``W_UV`` to each head's ``v_head_dim``. So the engine's three attention
paths (host custom call, XLA, Pallas) serve MLA unchanged: they read a one-plane cache as
both keys and values. The softmax scale is ``qk_head_dim ** -0.5`` (times YaRN's
``mscale_all_dim`` correction squared); the engine divides by ``sqrt(latent width)``, so
the query is pre-scaled to make up the difference.

RoPE: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3)...``; the module
de-interleaves the rotary dims (evens, then odds) of q and k alike and rotates halves,
which gives the same scores (the layout transformers' DeepSeek-V3 writes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .quant_linear import split_entries
from .rope import apply_rope, rope_attention_factor, yarn_mscale


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """A model's latent attention shape (DeepSeek's config.json names)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj (V2-Lite), else q_a_proj / q_b_proj
    rope_interleave: bool = True  # rotary dims in interleaved pairs (DeepSeek's default)
    softmax_scale: float = 0.0  # 0: qk_head_dim ** -0.5

    def __post_init__(self) -> None:
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"mla config: {f} must be positive")
        if self.qk_rope_head_dim % 2:
            raise ValueError("mla config: qk_rope_head_dim must be even")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError("mla config: q_lora_rank must be positive (or None)")

    @property
    def latent_dim(self) -> int:
        """Values one token keeps per layer in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim**-0.5


def softmax_scale(qk_head_dim: int, rope: dict[str, Any] | None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim)`` squared when ``rope`` (a config's YaRN parameters;
    None: plain RoPE) has ``mscale_all_dim``."""
    scale = qk_head_dim**-0.5
    if rope and rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


def mla_from_hf(
    cfg: dict[str, Any], rope: dict[str, Any] | None, *, interleave: bool | None = None
) -> MLAConfig:
    """The latent attention of a config.json with MLA fields; ``rope``: its YaRN
    parameters (None: plain RoPE), whose ``mscale_all_dim`` scales the softmax;
    ``interleave``: the family's RoPE layout (None: the config's ``rope_interleave``,
    default true)."""
    if cfg.get("attention_bias"):
        raise ValueError("deepseek: attention_bias is not supported")
    q_lora = cfg.get("q_lora_rank")
    nope, r = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    if interleave is None:
        interleave = bool(cfg.get("rope_interleave", True))
    return MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=r,
        v_head_dim=int(cfg["v_head_dim"]), q_lora_rank=int(q_lora) if q_lora else None,
        rope_interleave=interleave, softmax_scale=softmax_scale(nope + r, rope),
    )  # fmt: skip


def _deinterleave(x: jax.Array) -> jax.Array:
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLAttention(nnx.Module):
    """DeepSeek's latent attention; ``attend`` gets the absorbed query ``(B, T, H,
    latent)`` and the latent ``(B, T, 1, latent)`` as both key and value."""

    def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs, norm: type) -> None:
        m: MLAConfig = cfg.mla
        h, e = cfg.num_heads, cfg.hidden_size
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        if m.q_lora_rank is None:
            self.q_proj = nnx.Linear(e, h * m.qk_head_dim, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nnx.Linear(e, m.q_lora_rank, **kw)
            self.q_a_layernorm = norm(m.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = nnx.Linear(m.q_lora_rank, h * m.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = nnx.Linear(e, m.latent_dim, **kw)
        self.kv_a_layernorm = norm(m.kv_lora_rank, cfg.rms_norm_eps, dtype)
        # kv_b_proj's kernel (r, H * (nope + v)): W_UK and W_UV, read per head (a plain
        # parameter: attention absorbs it, so it is never a packed projection)
        width = h * (m.qk_nope_head_dim + m.v_head_dim)
        init = nnx.initializers.lecun_normal()
        self.kv_b = nnx.Param(init(rngs.params(), (m.kv_lora_rank, width), dtype))
        self.o_proj = nnx.Linear(h * m.v_head_dim, e, **kw)
        self.mla = m
        self.num_heads = h
        factor = rope_attention_factor(cfg)  # YaRN: the rotary dims scaled after rotation
        self.rope_factor = factor if factor != 1.0 else None
        # The engine divides scores by sqrt(latent width): q makes up DeepSeek's scale.
        self.q_scale = float(m.scale * m.latent_dim**0.5)

    def __call__(self, x, positions, inv_freq, attend_layer, carry):
        m, h = self.mla, self.num_heads
        b, t, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, h, m.qk_head_dim)
        q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[..., : m.kv_lora_rank])
        k_rope = ckv[..., m.kv_lora_rank :][:, :, None, :]  # (B, T, 1, rope)
        if m.rope_interleave:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope = apply_rope(q_rope, positions, inv_freq)
        k_rope = apply_rope(k_rope, positions, inv_freq)
        if self.rope_factor is not None:
            q_rope = q_rope * jnp.asarray(self.rope_factor, q_rope.dtype)
            k_rope = k_rope * jnp.asarray(self.rope_factor, k_rope.dtype)
        w = self.kv_b[...].reshape(m.kv_lora_rank, h, -1)  # (r, H, nope + v)
        w_uk, w_uv = w[..., : m.qk_nope_head_dim], w[..., m.qk_nope_head_dim :]
        f32 = jnp.float32
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk, preferred_element_type=f32)
        q_abs = jnp.concatenate([q_lat, q_rope.astype(f32)], axis=-1) * self.q_scale
        latent = jnp.concatenate([c, k_rope[:, :, 0].astype(c.dtype)], axis=-1)[:, :, None]
        out, carry = attend_layer(q_abs.astype(x.dtype), latent, latent, carry)
        o_lat = out[..., : m.kv_lora_rank]  # (B, T, H, r): the rest weighs the rotary keys
        o = jnp.einsum("bthr,rhv->bthv", o_lat, w_uv, preferred_element_type=f32)
        return self.o_proj(o.reshape(b, t, h * m.v_head_dim).astype(x.dtype)), carry


def mla_weights(attn: MLAttention, p: str, i: int) -> dict[str, tuple]:
    """The HF names of one layer's latent attention weights (prefix ``p``, layer ``i``)."""
    t: dict[str, tuple] = {}
    names = ["kv_a_proj_with_mqa", "o_proj"]
    names += ["q_proj"] if attn.q_proj is not None else ["q_a_proj", "q_b_proj"]
    for name in names:
        t[p + f"self_attn.{name}.weight"] = (getattr(attn, name), "kernel", True, i)
    t[p + "self_attn.kv_b_proj.weight"] = (attn, "kv_b", True, i)
    t[p + "self_attn.kv_a_layernorm.weight"] = (attn.kv_a_layernorm, "weight", False, i)
    if attn.q_a_layernorm is not None:
        t[p + "self_attn.q_a_layernorm.weight"] = (attn.q_a_layernorm, "weight", False, i)
    return t


def mla_tp_plan(attn: MLAttention, tp: int) -> list[tuple[object, str, int]]:
    """Under tensor parallelism each device computes its heads: the query's last
    projection and ``kv_b_proj`` split by output columns (whole heads), ``o_proj`` by
    input rows; the latent's projection and norms are replicated, as is the cache."""
    q = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
    plan = split_entries(q, "out", tp) + split_entries(attn.o_proj, "in", tp)
    return plan + [(attn, "kv_b", attn.kv_b.get_value().ndim - 1)]  # whole heads
