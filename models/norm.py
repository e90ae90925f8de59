"""RMS normalization, the one form every model's norms build on."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x)`` over the last axis, in fp32."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
