"""Paged attention as a Pallas kernel that reads the KV view in place (GPU; any platform
with ``interpret=True``, which is how CI tests it).

One program per (sequence, KV head, split of the context): it walks the sequence's block
table, loads ``blocks_per_step`` blocks of K and V at a time straight from the view's
``(layer, K|V)`` planes, and keeps an online softmax over them (flash decoding). Only the
blocks under ``ctx_lens`` are visited, so padded blocks and rows cost nothing. The
programs return partial (max, sum, weighted values); the splits and the new tokens of
the step (causal within the chunk) are merged with log-sum-exp outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_kvcached.engine.attention import _MASKED, merge_new_tokens, paged_attention

MAX_KERNEL_ROWS = 64  # query rows per KV head the kernel takes; more go to the XLA path
MAX_F32_KEYS = 128  # keys per kernel step for an f32 cache (an H200's shared memory)


def _kernel(tables_ref, ctx_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_size: int,
            blocks_per_split: int, blocks_per_step: int, scale: float):  # fmt: skip
    split = pl.program_id(2)
    ctx = ctx_ref[0]
    q = q_ref[...].astype(jnp.float32)  # (R, D): the T x G query rows of this KV head
    rows, dim = q.shape
    n_blocks = pl.cdiv(ctx, block_size)
    # An f32 cache gets f32 dots: Triton's default for f32 operands is TF32 (~1e-3 error,
    # seen on an H200); bf16/f16 caches keep the tensor-core default.
    prec = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, n_blocks)
    steps = pl.cdiv(jnp.maximum(last - first, 0), blocks_per_step)
    width = blocks_per_step * block_size

    def body(i, carry):
        m, den, acc = carry
        start = i * blocks_per_step  # within this split's table slice
        ids = tables_ref[pl.ds(start, blocks_per_step)]
        k = k_ref[ids].reshape(width, dim)  # (blocks, bs, D) in place from the plane
        v = v_ref[ids].reshape(width, dim)
        s = (
            jax.lax.dot_general(
                q,
                k.astype(jnp.float32),
                (((1,), (1,)), ((), ())),
                precision=prec,
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        pos = (first + start) * block_size + jnp.arange(width)
        s = jnp.where((pos < ctx)[None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * corr[:, None] + jax.lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        return m_new, den * corr + p.sum(axis=1), acc

    init = (
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dim), jnp.float32),
    )
    m, den, acc = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = den


def _cached_parts(q, view, layer, block_tables, ctx_lens, *, num_splits, blocks_per_step,
                  interpret):  # fmt: skip
    """Kernel partials over the cached blocks: m, l ``(B, S, Hkv, R)``, o ``(..., D)``."""
    b, t, h, d = q.shape
    bs, kvh = view.shape[3], view.shape[4]
    g = h // kvh
    nb = block_tables.shape[1]
    rows = t * g
    rows_p = max(16, 1 << (rows - 1).bit_length())  # Triton dots want >= 16 rows
    qk = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, d)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0)))
    step = min(blocks_per_step, nb)
    per_split = -(-nb // num_splits)
    per_split = -(-per_split // step) * step  # whole steps per split
    padded = per_split * num_splits
    tables = jnp.pad(block_tables, ((0, 0), (0, padded - nb)))  # the null block: never read
    kernel = functools.partial(_kernel, block_size=bs, blocks_per_split=per_split,
                               blocks_per_step=step, scale=1.0 / float(d) ** 0.5)  # fmt: skip
    plane = (None, None, view.shape[2], bs, None, d)  # one head of one (layer, K|V) plane
    o, m, den = pl.pallas_call(
        kernel,
        grid=(b, kvh, num_splits),
        in_specs=[
            pl.BlockSpec((None, per_split), lambda i, k, s: (i, s)),
            pl.BlockSpec((1,), lambda i, k, s: (i,)),
            pl.BlockSpec((None, None, rows_p, d), lambda i, k, s: (i, k, 0, 0)),
            pl.BlockSpec(plane, lambda i, k, s: (layer, 0, 0, 0, k, 0)),
            pl.BlockSpec(plane, lambda i, k, s: (layer, 1, 0, 0, k, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows_p, d), lambda i, k, s: (i, s, k, 0, 0)),
            pl.BlockSpec((None, None, None, rows_p), lambda i, k, s: (i, s, k, 0)),
            pl.BlockSpec((None, None, None, rows_p), lambda i, k, s: (i, s, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, num_splits, kvh, rows_p, d), jnp.float32),
            jax.ShapeDtypeStruct((b, num_splits, kvh, rows_p), jnp.float32),
            jax.ShapeDtypeStruct((b, num_splits, kvh, rows_p), jnp.float32),
        ],
        interpret=interpret,
        name="kvcached_paged_attention",
    )(tables, ctx_lens.astype(jnp.int32), qk, view, view)
    # (B, S, Hkv, R, ...) -> (B, T, Hkv, G, S, ...), the layout of _attend_part
    o = o[:, :, :, :rows].reshape(b, num_splits, kvh, t, g, d).transpose(0, 3, 2, 4, 1, 5)
    m = m[:, :, :, :rows].reshape(b, num_splits, kvh, t, g).transpose(0, 3, 2, 4, 1)
    den = den[:, :, :, :rows].reshape(b, num_splits, kvh, t, g).transpose(0, 3, 2, 4, 1)
    return m, den, o


def pallas_paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    view: jax.Array,
    layer: int,
    block_tables: jax.Array,
    ctx_lens: jax.Array,
    new_lens: jax.Array,
    *,
    num_splits: int = 1,
    blocks_per_step: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """:func:`jax_kvcached.engine.attention.paged_attention` with the cached blocks read by the
    Pallas kernel (same arguments and result). ``num_splits`` splits each context across
    that many programs (flash decoding: more parallelism for long contexts and small
    batches); ``interpret=True`` runs the kernel on any platform (tests).

    A chunk of more than ``MAX_KERNEL_ROWS`` query rows per KV head (T x G: prefill) is
    compute-bound and goes to the XLA path's dense dots, as the host path does: the
    kernel's tiles for it would not fit a GPU's shared memory (seen on an H200: 573 KB
    asked of 227 KB for 128 tokens x 2 groups, f32)."""
    b, t, h, _ = q.shape
    if t * (h // view.shape[4]) > MAX_KERNEL_ROWS:
        return paged_attention(q, k_new, v_new, view, layer, block_tables, ctx_lens, new_lens)
    if view.dtype == jnp.float32:  # f32 tiles (and f32 dots) take twice the shared memory
        blocks_per_step = max(1, min(blocks_per_step, MAX_F32_KEYS // view.shape[3]))
    m1, l1, o1 = _cached_parts(q, view, layer, block_tables, ctx_lens, num_splits=num_splits,
                               blocks_per_step=blocks_per_step, interpret=interpret)  # fmt: skip
    # Merge the splits, then the step's new tokens.
    m_c = m1.max(axis=-1)
    a = jnp.exp(m1 - m_c[..., None])
    l_c = (l1 * a).sum(axis=-1)
    o_c = (o1 * a[..., None]).sum(axis=-2)
    return merge_new_tokens(q, k_new, v_new, view.dtype, new_lens, m_c, l_c, o_c)
