"""Attention over the paged KV buffer (and the dense references it is tested against).

Shapes: q ``(B, T, H, D)``, new k / v ``(B, T, Hkv, D)``, with ``H = G * Hkv`` (GQA).
Scores and softmax are computed in fp32 whatever the KV dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jax_kvcached.memory.kv_cache import KVCache

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


def _attend_part(qg, k, v, valid, scale):
    """Unnormalised softmax attention of ``qg`` ``(B, T, Hkv, G, D)`` over one part of the
    keys: ``k`` / ``v`` ``(B, *S, Hkv, D)`` (S: one or more key axes), ``valid``
    broadcastable to ``(B, T, 1, 1, *S)``. Returns (max, sum of exp, exp-weighted values)
    in fp32, for a log-sum-exp merge with the other parts."""
    ks = "".join("nsuv"[: k.ndim - 3])  # the key axes' letters
    s = jnp.einsum(f"btkgd,b{ks}kd->btkg{ks}", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(valid, s * scale, _MASKED)
    axes = tuple(range(4, 4 + len(ks)))
    m = jnp.max(s, axis=axes)
    p = jnp.exp(s - jnp.expand_dims(m, axes))
    # p in the KV dtype: a bf16 cache is read as bf16 (no fp32 copy of V), accumulated in fp32.
    o = jnp.einsum(
        f"btkg{ks},b{ks}kd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return m, jnp.sum(p, axis=axes), o


def merge_new_tokens(q, k_new, v_new, kv_dtype, new_lens, m_c, l_c, o_c) -> jax.Array:
    """Attends the step's new tokens (causal within the chunk, padding masked) and merges
    them by log-sum-exp with the cached context's partials ``m_c``, ``l_c``
    ``(B, T, Hkv, G)`` and ``o_c`` ``(B, T, Hkv, G, D)``. Returns ``(B, T, H, D)``."""
    b, t, h, d = q.shape
    kvh = k_new.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    ti = jnp.arange(t)
    causal = (ti[None, :] <= ti[:, None])[None] & (ti[None, None, :] < new_lens[:, None, None])
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    kn, vn = k_new.astype(kv_dtype), v_new.astype(kv_dtype)
    m_n, l_n, o_n = _attend_part(qg, kn, vn, causal[:, :, None, None], scale)
    m = jnp.maximum(m_c, m_n)
    a_c, a_n = jnp.exp(m_c - m), jnp.exp(m_n - m)
    o = (o_c * a_c[..., None] + o_n * a_n[..., None]) / (l_c * a_c + l_n * a_n)[..., None]
    return o.reshape(b, t, h, d).astype(q.dtype)


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
    """Attention of T new tokens per sequence over their cached context plus themselves,
    in XLA (any platform: the portable fallback).

    ``view`` is ``KVCache.view``; ``block_tables`` ``(B, nb)`` hold each sequence's blocks
    (padding: the null block 0); ``ctx_lens`` ``(B,)`` tokens already cached;
    ``new_lens`` ``(B,)`` valid new tokens (the rest of T is padding). Covers chunked
    prefill (T > 1, causal within the chunk, on top of cached blocks) and decode (T = 1).

    The cached blocks and the new tokens are attended separately and merged with
    log-sum-exp (online softmax): the gathered blocks are never concatenated with the new
    tokens. Decode (memory-bound) never copies them into another layout either; a prefill
    chunk (compute-bound: T x G query rows per key) feeds them to a dense dot.
    """
    b, t, h, d = q.shape
    nb = block_tables.shape[1]
    bs, kvh = view.shape[3], view.shape[4]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    # Cached context: one gather per plane straight from the view, (B, nb, bs, Hkv, D).
    kc = view[layer, 0, block_tables]
    vc = view[layer, 1, block_tables]
    pos = jnp.arange(nb * bs).reshape(nb, bs)
    valid = pos[None] < ctx_lens[:, None, None]  # (B, nb, bs)
    if t > 1:  # prefill: T x G rows share each key, a dense dot is worth its operand copy
        m_c, l_c, o_c = _attend_part(qg, kc, vc, valid[:, None, None, None], scale)
        return merge_new_tokens(q, k_new, v_new, view.dtype, new_lens, m_c, l_c, o_c)
    # Decode: scores and the weighted sum multiply and reduce elementwise over the gathered
    # blocks, which XLA fuses into reduction loops (a dot would first transpose them).
    f32 = jnp.float32
    qe = qg.astype(f32)[:, :, None, None]  # (B, T, 1, 1, Hkv, G, D)
    s = jnp.sum(qe * kc[:, None, :, :, :, None, :].astype(f32), axis=-1)  # (B,T,nb,bs,Hkv,G)
    s = jnp.where(valid[:, None, :, :, None, None], s * scale, _MASKED)
    m_c = s.max(axis=(2, 3))
    p = jnp.exp(s - m_c[:, :, None, None])
    l_c = p.sum(axis=(2, 3))
    o_c = jnp.sum(p[..., None] * vc[:, None, :, :, :, None, :].astype(f32), axis=(2, 3))
    return merge_new_tokens(q, k_new, v_new, view.dtype, new_lens, m_c, l_c, o_c)


def host_paged_attention(
    cache: KVCache,
    token: jax.Array,
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    view: jax.Array,
    layer: int,
    block_tables: jax.Array,
    ctx_lens: jax.Array,
    new_lens: jax.Array,
) -> jax.Array:
    """:func:`paged_attention` with decode computed by the host backend's custom call
    (:func:`jax_kvcached.ops.paged_attention`): the cached context read in place, no
    gather, no copy of the KV, all cores. A prefill chunk (T > 1) is compute-bound and
    goes to the XLA path's dense dots. ``token`` orders the call after earlier writes
    (the XLA path is ordered by its block tables, as the runner passes them)."""
    from jax_kvcached.memory import ops

    b, t, h, d = q.shape
    if t > 1:  # prefill is compute-bound: XLA's dense dots beat the call's row loops
        return paged_attention(q, k_new, v_new, view, layer, block_tables, ctx_lens, new_lens)
    kvh = view.shape[4]
    qg = q.reshape(b, t, kvh, h // kvh, d).astype(jnp.float32)
    # New K/V rounded to the cache dtype, as the other paths (and later steps) see them.
    kn, vn = (x.astype(view.dtype).astype(jnp.float32) for x in (k_new, v_new))
    o, _, _ = ops.paged_attention(cache, layer, qg, kn, vn, block_tables, ctx_lens, new_lens, token)
    return o.reshape(b, t, h, d).astype(q.dtype)
