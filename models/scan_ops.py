"""What the recurrent mixers (Gated DeltaNet, Mamba2) share: the causal depthwise conv
over a window of the last inputs and the state it carries, and the decays between a
chunk's positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def conv_window(conv_state: jax.Array, xs: jax.Array, n: jax.Array | int) -> tuple:
    """``(window, next_state)``: the conv state ``(K - 1, C)`` followed by the new inputs
    ``(T, C)``, and the state after the first ``n`` of them (their last ``K - 1``
    inputs, older ones first)."""
    window = jnp.concatenate([conv_state, xs], axis=0)
    return window, jax.lax.dynamic_slice_in_dim(window, n, conv_state.shape[0], axis=0)


def causal_conv(window: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """SiLU of the depthwise causal conv (taps ``w`` ``(K, C)``, optional bias ``b``)
    over a window of ``K - 1 + T`` inputs: ``(T, C)``."""
    k = w.shape[0]
    n = window.shape[0] - (k - 1)
    y = sum(window[j : j + n] * w[j] for j in range(k))
    return jax.nn.silu(y if b is None else y + b)


def decay_matrix(acum: jax.Array) -> jax.Array:
    """``exp(acum[h, i] - acum[h, j])`` for ``i >= j``, else 0: ``(H, C, C)`` from the
    cumulative log-decays ``acum`` ``(H, C)`` of a chunk (masked before the exp, so the
    upper triangle never overflows)."""
    c = acum.shape[-1]
    lower = jnp.tril(jnp.ones((c, c), bool))
    diff = acum[:, :, None] - acum[:, None, :]
    return jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
