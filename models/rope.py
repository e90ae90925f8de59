"""Rotary position embeddings: the rotation (:func:`apply_rope`, rotate-half), a model's
frequencies (:func:`rope_inv_freq`: plain, llama3 or YaRN scaling) and YaRN (long-context
Qwen3 configs, GPT-OSS, DeepSeek-V2/V3) as transformers computes it.

YaRN interpolates the low frequencies by ``factor`` and keeps the high ones, with a linear
ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
original context; the rotated q and k are then scaled by an attention factor (``0.1
ln(factor) + 1``, or DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio, or as configured).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "llama3", "yarn")  # what config.json may name


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor`` (1 when not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn(dim: int, theta: float, s: dict[str, Any], max_positions: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies (dim / 2,) float32, attention factor) of YaRN scaling ``s``
    (a config's ``rope_scaling`` / ``rope_parameters``) over ``dim`` rotated dimensions."""
    original = float(s.get("original_max_position_embeddings") or max_positions)
    factor = s.get("factor") or max_positions / original
    factor = float(factor)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
        else:
            attention = yarn_mscale(factor)
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (as transformers: no division by zero)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the dimension extrapolates (high frequency), 0: interpolated
    pos = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
    return inv.astype(np.float32), float(attention)


def rope_inv_freq(cfg: Any) -> jax.Array:
    """Inverse RoPE frequencies (rotary_dim / 2,) of a model config, llama3 or YaRN
    scaling applied when configured."""
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    s = cfg.rope_scaling_dict
    if not s:
        return inv
    if s.get("rope_type", s.get("type")) == "yarn":
        return jnp.asarray(yarn(d, cfg.rope_theta, s, cfg.max_position_embeddings)[0])
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_attention_factor(cfg: Any) -> float:
    """The factor YaRN scales the rotated q and k by (1 for other RoPE kinds)."""
    s = cfg.rope_scaling_dict
    if not s or s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    return yarn(cfg.rotary_dim, cfg.rope_theta, s, cfg.max_position_embeddings)[1]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x ``(B, T, H, D)`` by positions ``(B, T)`` (the rotate-half convention);
    with fewer frequencies than ``D / 2`` only the first ``2 * len(inv_freq)`` dims
    rotate (partial rotary: Qwen3-Next)."""
    rd = 2 * inv_freq.shape[-1]
    if rd < x.shape[-1]:
        rot = apply_rope(x[..., :rd], positions, inv_freq)
        return jnp.concatenate([rot, x[..., rd:]], axis=-1)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, D/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
