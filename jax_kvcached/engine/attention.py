"""Ragged paged attention over the KV buffer (and the dense references it is tested against).

A step's queries lie on one flat token axis ``q`` ``(T, H, D)`` (``H = G * Hkv``, GQA):
sequence ``s`` owns the rows ``q_start[s] .. q_start[s] + q_lens[s] - 1``, the queries at
positions ``kv_lens[s] - q_lens[s] .. kv_lens[s] - 1``, and each row sees its sequence's
cached tokens at positions up to its own. Decode rows (one token) and prefill chunks mix
freely in one step. The step's own K/V are written to the cache before attention reads
it, so all keys come from the cache, read through the block tables ``(S, nb)``.

The XLA path and the Pallas kernel work on *items*: tiles of up to ``Q`` consecutive query
rows of one sequence (:func:`ragged_layout` builds them on the host), each attending its
sequence's blocks; the host custom call takes the layout as it is. Scores and softmax are
computed in fp32 whatever the KV dtype.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jax_kvcached.memory.kv_cache import KVCache

_MASKED = -1e30  # finite: a fully masked (padded) row gives finite garbage, never NaN


def visible(key_pos: jax.Array, row_pos: jax.Array, window: jax.Array | int) -> jax.Array:
    """Which keys a query row sees: causal (``key <= row``) and, with ``window`` > 0
    (sliding-window attention), only the last ``window`` positions (``key > row -
    window``). Broadcasts; ``window`` may be traced (0: none)."""
    causal = key_pos <= row_pos
    return causal & ((window <= 0) | (key_pos > row_pos - window))


def gqa_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """Softmax attention; ``mask`` ``(B, T, S)`` is True where query t may see key s;
    ``sinks`` ``(H,)``: a logit per head in the softmax's denominator (attention sinks)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / jnp.sqrt(jnp.float32(d)))
    s = jnp.where(mask[:, None, None], s, _MASKED)
    if sinks is not None:  # a key of value zero every row sees, dropped after the softmax
        sink = jnp.broadcast_to(_head_sinks(sinks, kvh)[None, :, :, None, None], (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype)


def _head_sinks(sinks: jax.Array, kv_heads: int) -> jax.Array:
    """Per-head sink logits ``(H,)`` as ``(Hkv, G)`` float32."""
    return jnp.asarray(sinks, jnp.float32).reshape(kv_heads, -1)


def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, window: jax.Array | int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """No-cache causal attention over the whole sequence (the reference); ``window`` > 0:
    each query sees its last ``window`` positions; ``sinks``: see :func:`gqa_attention`."""
    t = q.shape[1]
    pos = jnp.arange(t)
    mask = visible(pos[None, :], pos[:, None], window)[None].repeat(q.shape[0], 0)
    return gqa_attention(q, k, v, mask, sinks)


def no_cache_attend(layer, q, k, v, carry=None, sinks=None):
    """A model's ``attend`` without a cache: causal attention over the tokens given
    (references and tests of full-attention models); the carry passes through."""
    return dense_causal_attention(q, k, v, sinks=sinks), carry


def no_cache_attention(config):
    """:func:`no_cache_attend` with each layer's window of ``config.layer_windows()``
    (any model: sliding-window layers included)."""
    windows = jnp.asarray(config.layer_windows(), jnp.int32)

    def attend(layer, q, k, v, carry=None, sinks=None):
        return dense_causal_attention(q, k, v, windows[layer], sinks), carry

    return attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Ragged:
    """The layout of a ragged step (int32 device arrays; see the module docstring).

    Per sequence slot ``(S,)``: ``tables`` ``(S, nb)``, ``kv_lens``, ``q_start``,
    ``q_lens`` (0: an unused slot). Items ``(I, Q)``: ``item_seq`` ``(I,)`` the slot of each
    item, ``item_rows`` the flat row of each of its queries (``T``: none) and ``item_pos``
    their positions (-1: none); ``token_slot`` ``(T,)`` where each flat row's output lies
    in the items' ``(I * Q)`` rows."""

    tables: jax.Array
    kv_lens: jax.Array
    q_start: jax.Array
    q_lens: jax.Array
    item_seq: jax.Array
    item_rows: jax.Array
    item_pos: jax.Array
    token_slot: jax.Array

    @classmethod
    def of(
        cls, q_lens: list[int], kv_lens: list[int], tables: np.ndarray, tokens: int | None = None,
        tile: int = 8,
    ) -> Ragged:  # fmt: skip
        """The layout of sequences with ``q_lens`` new rows each (laid out in order on a
        flat axis of ``tokens`` rows, default their sum), ``kv_lens`` tokens in the cache
        after the step, block ``tables`` ``(S, nb)``; items of up to ``tile`` rows. For
        :func:`paged_attention` in a loop of your own."""
        tokens = sum(q_lens) if tokens is None else tokens
        arrays = ragged_layout(q_lens, kv_lens, np.asarray(tables, np.int32), tokens, tile)
        return cls(**{k: jnp.asarray(v) for k, v in arrays.items()})


def num_items(tokens: int, seqs: int, tile: int) -> int:
    """Items a step of ``tokens`` rows over at most ``seqs`` sequences needs with tiles of
    ``tile`` rows (each sequence adds at most one partial tile)."""
    if tile == 1:
        return tokens
    return -(-tokens // tile) + min(seqs, tokens)


def ragged_layout(
    q_lens: list[int], kv_lens: list[int], tables: np.ndarray, tokens: int, tile: int
) -> dict[str, np.ndarray]:
    """The host-side arrays of :class:`Ragged` for sequences laid out in order on a flat
    axis of ``tokens`` rows; ``tables`` ``(S, nb)`` (unused slots: zeros). ``tile`` 0: no
    items (the host call takes the layout without them; none are built)."""
    seqs = tables.shape[0]
    q_lens_a = np.zeros(seqs, np.int32)
    kv_a = np.zeros(seqs, np.int32)
    q_lens_a[: len(q_lens)] = q_lens
    kv_a[: len(kv_lens)] = kv_lens
    q_start = np.zeros(seqs, np.int32)
    q_start[1:] = np.cumsum(q_lens_a)[:-1]
    q_start[len(q_lens) :] = tokens  # unused slots: past the rows
    if int(q_lens_a.sum()) > tokens:
        raise ValueError(f"{int(q_lens_a.sum())} query rows do not fit a step of {tokens}")
    n_items = num_items(tokens, seqs, tile) if tile else 0
    item_seq = np.zeros(n_items, np.int32)
    item_rows = np.full((n_items, max(tile, 1)), tokens, np.int32)
    item_pos = np.full((n_items, max(tile, 1)), -1, np.int32)
    token_slot = np.zeros(tokens, np.int32)
    i = 0
    for s, n in enumerate(q_lens if tile else ()):
        first = int(kv_a[s]) - n  # position of the sequence's first query row
        for t0 in range(0, n, tile):
            c = min(tile, n - t0)
            item_seq[i] = s
            item_rows[i, :c] = q_start[s] + t0 + np.arange(c)
            item_pos[i, :c] = first + t0 + np.arange(c)
            token_slot[q_start[s] + t0 : q_start[s] + t0 + c] = i * tile + np.arange(c)
            i += 1
    return dict(
        tables=tables, kv_lens=kv_a, q_start=q_start, q_lens=q_lens_a, item_seq=item_seq,
        item_rows=item_rows, item_pos=item_pos, token_slot=token_slot,
    )  # fmt: skip


def item_queries(q: jax.Array, lay: Ragged, kv_heads: int) -> jax.Array:
    """The items' query rows ``(I, Q, Hkv, G, D)`` (rows of no query: the last row)."""
    t, h, d = q.shape
    qi = q[jnp.minimum(lay.item_rows, t - 1)]
    return qi.reshape(*lay.item_rows.shape, kv_heads, h // kv_heads, d)


def scatter_items(o: jax.Array, lay: Ragged, heads: int) -> jax.Array:
    """Items' outputs ``(I, Q, Hkv, G, D)`` back on the flat axis ``(T, H, D)``."""
    i, q = o.shape[:2]
    d = o.shape[-1]
    return o.reshape(i * q, heads, d)[lay.token_slot]


def paged_attention(
    q: jax.Array, view: jax.Array, layer: jax.Array | int, lay: Ragged, window: jax.Array | int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """Ragged attention in XLA (any platform: the portable fallback). Each item gathers
    its sequence's blocks straight from the view, ``(I, nb, bs, Hkv, D)``. Items of one row
    (decode) multiply and reduce elementwise over the gathered blocks, which XLA fuses
    into reduction loops (a dot would first transpose them); longer items (prefill
    chunks: Q x G rows share each key) feed them to a dense dot. ``window`` > 0: each row
    sees only its last ``window`` positions (masked here: the portable path gathers every
    block of the table; the host call and the Pallas kernel skip the blocks below). A
    latent view (one plane: MLA) is read as both keys and values. ``sinks`` ``(H,)``: a
    logit per head in each row's softmax denominator (attention sinks, GPT-OSS).

    Inside a jitted function ``view`` must be an argument of it (pass the cache, or its
    view): a view closed over is a constant snapshot of the buffer, refused here."""
    from jax_kvcached.memory.ops import staging

    if not isinstance(view, jax.core.Tracer) and staging((q,)):
        raise ValueError(
            "paged_attention: the KV view is a constant of this jitted function (a snapshot "
            "of the buffer, not what write_kv writes): pass the cache (or cache.view) to the "
            "function as an argument"
        )
    t, h, d = q.shape
    nb = lay.tables.shape[1]
    bs, kvh = view.shape[3], view.shape[4]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    tables = lay.tables[lay.item_seq]  # (I, nb)
    kc = view[layer, 0, tables]
    vc = kc if view.shape[1] == 1 else view[layer, 1, tables]  # a latent is its own value
    qi = item_queries(q, lay, kvh)  # (I, Q, Hkv, G, D)
    pos = jnp.arange(nb * bs).reshape(nb, bs)
    valid = visible(pos[None, None], lay.item_pos[:, :, None, None], window)  # (I, Q, nb, bs)
    f32 = jnp.float32
    if qi.shape[1] == 1:  # decode items
        qe = qi[:, 0].astype(f32)[:, None, None]  # (I, 1, 1, Hkv, G, D)
        s = jnp.sum(qe * kc[..., None, :].astype(f32), axis=-1)  # (I, nb, bs, Hkv, G)
        s = jnp.where(valid[:, 0, :, :, None, None], s * scale, _MASKED)
        m = s.max(axis=(1, 2))  # (I, Hkv, G)
        if sinks is not None:
            m = jnp.maximum(m, _head_sinks(sinks, kvh))
        p = jnp.exp(s - m[:, None, None])
        den = p.sum(axis=(1, 2))
        if sinks is not None:
            den = den + jnp.exp(_head_sinks(sinks, kvh) - m)
        o = jnp.sum(p[..., None] * vc[..., None, :].astype(f32), axis=(1, 2)) / den[..., None]
        o = o[:, None]  # (I, 1, Hkv, G, D)
    else:
        s = jnp.einsum("iqkgd,inskd->iqkgns", qi, kc, preferred_element_type=f32)
        s = jnp.where(valid[:, :, None, None], s * scale, _MASKED)
        m = s.max(axis=(4, 5), keepdims=True)  # (I, Q, Hkv, G, 1, 1)
        if sinks is not None:
            m = jnp.maximum(m, _head_sinks(sinks, kvh)[..., None, None])
        p = jnp.exp(s - m)
        den = p.sum(axis=(4, 5))
        if sinks is not None:
            den = den + jnp.exp(_head_sinks(sinks, kvh) - m[..., 0, 0])
        o = jnp.einsum("iqkgns,inskd->iqkgd", p.astype(vc.dtype), vc, preferred_element_type=f32)
        o = o / den[..., None]
    return scatter_items(o, lay, h).astype(q.dtype)


def host_paged_attention(
    cache: KVCache,
    token: jax.Array,
    q: jax.Array,
    view: jax.Array,
    layer: jax.Array | int,
    lay: Ragged,
    window: jax.Array | int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """:func:`paged_attention` computed by the host backend's custom call
    (:func:`jax_kvcached.ops.paged_attention`): decode rows and prefill chunks alike, the
    cached context read in place, no gather, no copy of the KV, all cores. ``token``
    orders the call after the step's write."""
    from jax_kvcached.memory import ops

    t, h, d = q.shape
    kvh = view.shape[4]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32)
    o = ops.paged_attention(cache, layer, qg, lay.tables, lay.kv_lens, lay.q_start, lay.q_lens,
                            token, window, sinks, view=view)  # fmt: skip
    return o.reshape(t, h, d).astype(q.dtype)
