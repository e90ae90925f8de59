"""Ragged paged attention as a Pallas kernel that reads the KV view in place (GPU; any
platform with ``interpret=True``, which is how CI tests it).

One program per (item, KV head, split of the context), an item being up to ``Q``
consecutive query rows of one sequence (:func:`jax_kvcached.engine.attention.ragged_layout`):
decode rows and prefill tiles alike. A program walks its sequence's block table up to its
last query's position, loads ``blocks_per_step`` blocks of K and V at a time straight from
the view's ``(layer, K|V)`` planes, masks keys past each row's position (causal) and keeps
an online softmax (flash attention; splits of long contexts are flash decoding). Blocks
past the item's last position are never visited. The programs return partial (max, sum,
weighted values), merged with log-sum-exp outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_kvcached.engine.attention import _MASKED, Ragged, item_queries, scatter_items, visible

MAX_KERNEL_ROWS = 64  # query rows (tokens x groups) per program: an H200's shared memory
MAX_F32_KEYS = 128  # keys per kernel step for an f32 cache (an H200's shared memory)


def item_tile(groups: int) -> int:
    """Query tokens per item for a prefill step: the most whose rows fit a program (1 when
    one token's query heads per KV head fill it: the kernel then takes them in chunks)."""
    if groups >= MAX_KERNEL_ROWS:
        return 1
    return 1 << ((MAX_KERNEL_ROWS // groups).bit_length() - 1)


def _head_chunk(groups: int, tile: int) -> int:
    """The most query heads per KV head a program takes with items of ``tile`` rows: a
    divisor of ``groups`` (all of them when they fit)."""
    limit = max(1, MAX_KERNEL_ROWS // tile)
    return max(c for c in range(1, min(groups, limit) + 1) if groups % c == 0)


def _kernel(tables_ref, end_ref, win_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
            block_size: int, blocks_per_split: int, blocks_per_step: int, v_offset: int,
            scale: float):  # fmt: skip
    split = pl.program_id(2)
    end = end_ref[0]  # keys the item's last row sees
    q = q_ref[...].astype(jnp.float32)  # (R, D): the item's Q x G query rows of this head
    rows, dim = q.shape
    row_pos = pos_ref[...]  # (R,): each row's position (-1: no query)
    n_blocks = pl.cdiv(end, block_size)
    # An f32 cache gets f32 dots: Triton's default for f32 operands is TF32 (~1e-3 error,
    # seen on an H200); bf16/f16 caches keep the tensor-core default.
    prec = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
    window = win_ref[0]  # > 0: each row sees its last `window` positions only
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, n_blocks)
    # With a window, skip (never load) the blocks below the item's first row's window,
    # in whole steps of this split's table slice.
    low = jnp.where(window > 0, jnp.maximum(row_pos[0] - window + 1, 0) // block_size, 0)
    skip = jnp.maximum(low - first, 0) // blocks_per_step * blocks_per_step
    steps = pl.cdiv(jnp.maximum(last - first - skip, 0), blocks_per_step)
    width = blocks_per_step * block_size

    def body(i, carry):
        m, den, acc = carry
        start = skip + i * blocks_per_step  # within this split's table slice
        ids = tables_ref[pl.ds(start, blocks_per_step)]  # rows of the layer's K plane
        k = k_ref[ids].reshape(width, dim)  # (blocks, bs, D) in place from the planes
        v = v_ref[ids + v_offset].reshape(width, dim)
        s = jax.lax.dot_general(
            q,
            k.astype(jnp.float32),
            (((1,), (1,)), ((), ())),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        s = s * scale
        pos = (first + start) * block_size + jnp.arange(width)
        s = jnp.where(visible(pos[None, :], row_pos[:, None], window), s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * corr[:, None] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
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


def pallas_paged_attention(
    q: jax.Array,
    view: jax.Array,
    layer: jax.Array | int,
    lay: Ragged,
    *,
    num_splits: int = 1,
    blocks_per_step: int = 4,
    interpret: bool = False,
    slice_layer: bool | None = None,
    window: jax.Array | int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """:func:`jax_kvcached.engine.attention.paged_attention` with the blocks read by the
    Pallas kernel (same arguments and result). ``num_splits`` splits each context across
    that many programs (flash decoding: more parallelism for long contexts and small
    batches); ``interpret=True`` runs the kernel on any platform (tests). Items of up to
    :func:`item_tile` rows keep a program's tiles within a GPU's shared memory.

    ``layer`` may be traced (layers under ``jax.lax.scan``): the kernel sees the view as
    one flat array of blocks, ``(layers x planes x blocks, bs, Hkv, D)`` (a free reshape),
    and reads the layer's K and V blocks at the table's ids shifted to that layer's planes
    (a latent view, one plane: MLA's, is read as both).
    ``slice_layer`` (default: when interpreted) first slices the layer out of the view
    instead: an interpreted kernel copies its whole input per program. ``window`` > 0
    (may be traced): sliding-window attention; a program never loads the blocks below
    its item's window. ``sinks`` ``(H,)`` (attention sinks) join the softmax's
    denominator where the splits are merged, once per row. More query heads per KV head
    than a program's rows (MLA's 128 over one latent) run as chunks of heads, one call
    each (items of one token)."""
    t, h, d = q.shape
    n_layers, planes, nblk = view.shape[0], view.shape[1], view.shape[2]
    bs, kvh = view.shape[3], view.shape[4]
    if n_layers * planes * nblk >= 1 << 31:
        raise ValueError(f"{n_layers} layers x {planes} x {nblk} blocks overflow int32 block ids")
    g = h // kvh
    n_items, tile = lay.item_rows.shape
    rows = tile * g
    if rows > MAX_KERNEL_ROWS and tile == 1:  # many heads to a KV head (MLA: all of them)
        chunk = _head_chunk(g, tile)
        qg = q.reshape(t, kvh, g, d)
        sk = None if sinks is None else jnp.asarray(sinks).reshape(kvh, g)
        kw = dict(num_splits=num_splits, blocks_per_step=blocks_per_step, interpret=interpret,
                  slice_layer=slice_layer, window=window)  # fmt: skip
        outs = [
            pallas_paged_attention(
                qg[:, :, c : c + chunk].reshape(t, kvh * chunk, d), view, layer, lay,
                sinks=None if sk is None else sk[:, c : c + chunk].reshape(-1), **kw,
            ).reshape(t, kvh, chunk, d)
            for c in range(0, g, chunk)
        ]  # fmt: skip
        return jnp.concatenate(outs, axis=2).reshape(t, h, d)
    if rows > MAX_KERNEL_ROWS:
        raise ValueError(f"items of {tile} tokens x {g} groups exceed {MAX_KERNEL_ROWS} rows")
    if view.dtype == jnp.float32:  # f32 tiles (and f32 dots) take twice the shared memory
        blocks_per_step = max(1, min(blocks_per_step, MAX_F32_KEYS // bs))
    if interpret if slice_layer is None else slice_layer:
        # Interpreted, the kernel's blocks become XLA slices of a copy of the view that
        # nothing orders after the step's write (XLA:CPU orders by buffers, and only the
        # tables come from it): read this layer's planes through an index that does.
        # (Compiled, the kernel is one launch that takes the tables: ordered.)
        dep = jnp.minimum(lay.tables.min(), 0)  # 0, but XLA cannot know it
        view = jax.lax.dynamic_slice_in_dim(view, layer + dep, 1, axis=0)
        layer = 0
    flat = view.reshape(-1, bs, kvh, d)  # (layers x planes x blocks, bs, Hkv, D)
    base = (planes * nblk) * jnp.asarray(layer, jnp.int32)  # the layer's K plane in `flat`
    rows_p = max(16, 1 << (rows - 1).bit_length())  # Triton dots want >= 16 rows
    qi = item_queries(q, lay, kvh)  # (I, Q, Hkv, G, D)
    qk = qi.transpose(0, 2, 1, 3, 4).reshape(n_items, kvh, rows, d)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0)))
    pos = jnp.repeat(lay.item_pos, g, axis=1)  # (I, R): row r is token r // g
    pos = jnp.pad(pos, ((0, 0), (0, rows_p - rows)), constant_values=-1)
    end = lay.item_pos.max(axis=1) + 1  # (I,)
    nb = lay.tables.shape[1]
    step = min(blocks_per_step, nb)
    per_split = -(-nb // num_splits)
    per_split = -(-per_split // step) * step  # whole steps per split
    padded = per_split * num_splits
    tables = jnp.pad(lay.tables[lay.item_seq], ((0, 0), (0, padded - nb)))  # null: never read
    tables = tables + base
    kernel = functools.partial(_kernel, block_size=bs, blocks_per_split=per_split,
                               blocks_per_step=step, v_offset=nblk if planes == 2 else 0,
                               scale=1.0 / float(d) ** 0.5)  # fmt: skip
    planes = (flat.shape[0], bs, None, d)  # one head of every block of every plane
    o, m, den = pl.pallas_call(
        kernel,
        grid=(n_items, kvh, num_splits),
        in_specs=[
            pl.BlockSpec((None, per_split), lambda i, k, s: (i, s)),
            pl.BlockSpec((1,), lambda i, k, s: (i,)),
            pl.BlockSpec((1,), lambda i, k, s: (0,)),
            pl.BlockSpec((None, rows_p), lambda i, k, s: (i, 0)),
            pl.BlockSpec((None, None, rows_p, d), lambda i, k, s: (i, k, 0, 0)),
            pl.BlockSpec(planes, lambda i, k, s: (0, 0, k, 0)),
            pl.BlockSpec(planes, lambda i, k, s: (0, 0, k, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows_p, d), lambda i, k, s: (i, s, k, 0, 0)),
            pl.BlockSpec((None, None, None, rows_p), lambda i, k, s: (i, s, k, 0)),
            pl.BlockSpec((None, None, None, rows_p), lambda i, k, s: (i, s, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_items, num_splits, kvh, rows_p, d), jnp.float32),
            jax.ShapeDtypeStruct((n_items, num_splits, kvh, rows_p), jnp.float32),
            jax.ShapeDtypeStruct((n_items, num_splits, kvh, rows_p), jnp.float32),
        ],
        interpret=interpret,
        name="kvcached_paged_attention",
    )(
        tables,
        end.astype(jnp.int32),
        jnp.reshape(jnp.asarray(window, jnp.int32), (1,)),
        pos.astype(jnp.int32),
        qk,
        flat,
        flat,
    )
    # Merge the splits (log-sum-exp), normalise, back to (I, Q, Hkv, G, D).
    m_c = m.max(axis=1)  # (I, Hkv, rows_p)
    if sinks is not None:  # row r is token r // g, head group r % g
        sink = jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(kvh, g), (1, tile))
        sink = jnp.pad(sink, ((0, 0), (0, rows_p - rows)), constant_values=_MASKED)[None]
        m_c = jnp.maximum(m_c, sink)
    a = jnp.exp(m - m_c[:, None])
    den = (den * a).sum(axis=1)
    if sinks is not None:
        den = den + jnp.exp(sink - m_c)
    o = (o * a[..., None]).sum(axis=1) / jnp.maximum(den, 1e-30)[..., None]
    o = o[:, :, :rows].reshape(n_items, kvh, tile, g, d).transpose(0, 2, 1, 3, 4)
    return scatter_items(o, lay, h).astype(q.dtype)
