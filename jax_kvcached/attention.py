"""Attention over the paged KV buffer (and the dense references it is tested against).

Shapes: q ``(B, T, H, D)``, new k / v ``(B, T, Hkv, D)``, with ``H = G * Hkv`` (GQA).
Scores and softmax are computed in fp32 whatever the KV dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite: a fully masked (padded) row gives finite garbage, never NaN


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention; ``mask`` ``(B, T, S)`` is True where query t may see key s."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / jnp.sqrt(jnp.float32(d)))
    s = jnp.where(mask[:, None, None], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """No-cache causal attention over the whole sequence (the reference)."""
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(q.shape[0], 0)
    return gqa_attention(q, k, v, mask)


def paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    view: jax.Array,
    layer: int,
    block_tables: jax.Array,
    ctx_lens: jax.Array,
    new_lens: jax.Array,
) -> jax.Array:
    """Attention of T new tokens per sequence over their cached context plus themselves.

    ``view`` is ``KVCache.view``; ``block_tables`` ``(B, nb)`` hold each sequence's blocks
    (padding: the null block 0); ``ctx_lens`` ``(B,)`` tokens already cached;
    ``new_lens`` ``(B,)`` valid new tokens (the rest of T is padding). Covers chunked
    prefill (T > 1, causal within the chunk, on top of cached blocks) and decode (T = 1).
    """
    b, t = q.shape[:2]
    nb = block_tables.shape[1]
    bs, kvh, d = view.shape[3:]
    # One gather straight from the view (no copy of the layer plane).
    kc = view[layer, 0, block_tables].reshape(b, nb * bs, kvh, d)
    vc = view[layer, 1, block_tables].reshape(b, nb * bs, kvh, d)
    keys = jnp.concatenate([kc, k_new.astype(kc.dtype)], axis=1)
    vals = jnp.concatenate([vc, v_new.astype(vc.dtype)], axis=1)
    cached = jnp.arange(nb * bs)[None, None, :] < ctx_lens[:, None, None]
    cached = jnp.broadcast_to(cached, (b, t, nb * bs))
    ti = jnp.arange(t)
    causal = (ti[None, :] <= ti[:, None])[None] & (ti[None, None, :] < new_lens[:, None, None])
    return gqa_attention(q, keys, vals, jnp.concatenate([cached, causal], axis=-1))
