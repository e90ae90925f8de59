"""Recurrent state in the paged KV cache: the state slots of a recurrent group, read and
written inside the step program.

A recurrent layer (Gated DeltaNet, Mamba2) carries a fixed-size state per sequence (its
conv window and its state matrix) instead of K/V per token. Its layers form one KV cache
group (a ``recurrent`` ``KVSpec``) whose blocks hold state, not tokens: a sequence's *slot*
is :func:`slot_blocks` blocks of that group, the same blocks on each of the group's
layers, and the state is laid out flat over the slot's K and V planes (block order, then
rows). Pages are mapped as slots are allocated and given back as they are freed, in the
cache's one budget; a *checkpoint* is a slot's copy at a block boundary, cached like a
block under a key of the prefix's hash (``kv_group_managers.RecurrentStateManager``).

:func:`recurrence` is what the engine's ``attend`` offers a model as ``attend.recur``
(the seam: ``models.interface.Recur``). Per step and layer it

1. reads every sequence slot's state (from its slot, from a restored checkpoint, or
   zeros for a sequence starting at position 0), ordered after the previous writes;
2. runs the model's update over each sequence's tokens of the step in order, all
   sequences at once: a decode step (one token a sequence) is one per-token update; a
   step where a sequence has several tokens runs the model's chunked form ``C`` tokens at
   a time from each sequence's own cursor (a chunk ends at the sequence's checkpoint
   position), or the per-token update position by position when the model has none;
3. writes the final state back to the slot and, where the step crosses the sequence's
   checkpoint position, the state there to the checkpoint's blocks (one write call).

Invariant: a slot is written only by the step that owns its sequence, and its reads are
ordered after the writes of the step before (the token chain), so no read sees a
half-written state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcached.memory import ops
from jax_kvcached.memory.kv_cache import KVCache


def _block_values(cache: KVCache) -> int:
    """Values one block holds on one layer, over its planes (a slot's unit)."""
    return cache.planes_per_layer * cache.block_size * cache.shard_kv_heads * cache.head_dim


def slot_blocks(cache: KVCache, state_elems: int) -> int:
    """Blocks of a state slot holding ``state_elems`` values per layer (in the cache's
    dtype, over the K and V planes of each block)."""
    if state_elems <= 0:
        raise ValueError(f"a recurrent state needs a positive size, got {state_elems}")
    return -(-state_elems // _block_values(cache))


def state_elems(init: Any) -> int:
    """Values of one sequence's state (a pytree of arrays without a batch axis)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(init))


def _flatten(tree: Any, rows: int) -> jax.Array:
    return jnp.concatenate(
        [x.reshape(rows, -1).astype(jnp.float32) for x in jax.tree.leaves(tree)], axis=1
    )


def _unflatten(flat: jax.Array, init: Any) -> Any:
    leaves, treedef = jax.tree.flatten(init)
    out, at = [], 0
    for x in leaves:
        n = int(np.prod(x.shape))
        out.append(flat[:, at : at + n].reshape(flat.shape[0], *x.shape).astype(x.dtype))
        at += n
    return jax.tree.unflatten(treedef, out)


def _pick(cond: jax.Array, a: Any, b: Any) -> Any:
    """``a`` where the per-sequence ``cond`` ``(S,)`` holds, else ``b`` (pytrees)."""
    return jax.tree.map(
        lambda x, y: jnp.where(cond.reshape(-1, *([1] * (x.ndim - 1))), x, y), a, b
    )


def _token_update(step_fn, tokens, q_start, q_lens, ck_at, j, carry):
    """Every sequence's ``j``-th token of the step (if it has one) in one update; the
    state after it is the snapshot where it is the last before the checkpoint."""
    state, snap, ys = carry
    t = jax.tree.leaves(tokens)[0].shape[0]
    valid = j < q_lens
    tok = jnp.clip(q_start + j, 0, t - 1)
    new, y = jax.vmap(step_fn)(state, jax.tree.map(lambda a: a[tok], tokens))
    state = _pick(valid, new, state)
    snap = _pick(valid & (j + 1 == ck_at), new, snap)
    at = jnp.where(valid, tok, t)  # (past the axis: dropped)
    ys = jax.tree.map(lambda acc, v: acc.at[at].set(v.astype(acc.dtype), mode="drop"), ys, y)
    return state, snap, ys


def _one_token(step_fn, state, ys, tokens, q_start, q_lens, ck_at):
    """A decode step: each sequence's one token (if any) in one update, no loop."""
    return _token_update(step_fn, tokens, q_start, q_lens, ck_at, 0, (state, state, ys))


def _by_token(step_fn, state, ys, tokens, q_start, q_lens, ck_at):
    """Every sequence's tokens one position at a time."""
    body = functools.partial(_token_update, step_fn, tokens, q_start, q_lens, ck_at)
    return jax.lax.fori_loop(0, jnp.max(q_lens), body, (state, state, ys))


def _by_chunk(chunk_fn, size, state, ys, tokens, q_start, q_lens, ck_at):
    """Every sequence's tokens ``size`` at a time from its own cursor; a chunk ends at
    the sequence's checkpoint position, so the state there is a chunk's end."""
    t = jax.tree.leaves(tokens)[0].shape[0]
    offs = jnp.arange(size, dtype=jnp.int32)

    def cond(carry):
        return jnp.any(carry[0] < q_lens)

    def body(carry):
        cursor, state, snap, ys = carry
        left = q_lens - cursor
        to_ck = jnp.where(ck_at > cursor, ck_at - cursor, size)
        n = jnp.clip(jnp.minimum(jnp.minimum(left, to_ck), size), 0, size)
        tok = jnp.clip(q_start[:, None] + cursor[:, None] + offs, 0, t - 1)  # (S, C)
        new, y = jax.vmap(chunk_fn)(state, jax.tree.map(lambda a: a[tok], tokens), n)
        state = _pick(n > 0, new, state)
        cursor = cursor + n
        snap = _pick((n > 0) & (cursor == ck_at), new, snap)
        at = jnp.where(offs < n[:, None], tok, t)  # (past the axis: dropped)
        ys = jax.tree.map(
            lambda acc, v: acc.at[at.reshape(-1)].set(
                v.reshape(-1, *v.shape[2:]).astype(acc.dtype), mode="drop"
            ),
            ys, y,
        )  # fmt: skip
        return cursor, state, snap, ys

    cursor = jnp.zeros_like(q_lens)
    _, state, snap, ys = jax.lax.while_loop(cond, body, (cursor, state, state, ys))
    return state, snap, ys


def recurrence(
    cache: KVCache,
    view: jax.Array,
    layer: Any,
    step_fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    chain: jax.Array,
    *,
    blocks: jax.Array,
    rows: jax.Array,
    q_start: jax.Array,
    q_lens: jax.Array,
    chunk: tuple[int, Callable] | None = None,
) -> tuple[Any, jax.Array]:
    """Runs ``step_fn(state, x) -> (state, y)`` (one sequence, one token) over each
    sequence's tokens of the step from its stored state (see the module docstring).

    Args:
      view: the cache's view ``(layers, planes, blocks, block_size, heads, head_dim)``.
      layer: the layer (an int or a traced int32).
      init: one sequence's zero state (a pytree; its shapes and dtypes are the state's).
      xs: per-token inputs, a pytree of ``(1, t, ...)`` arrays on the step's flat axis.
      chain: the token ordering the cache's reads and writes.
      blocks: ``(3, S, nS)`` each sequence slot's state blocks to read, to write and to
        checkpoint to (0: none).
      rows: ``(2, S)``: starts from zeros; the step's tokens before its checkpoint (-1).
      q_start, q_lens: ``(S,)`` each sequence slot's tokens on the flat axis.
      chunk: ``(C, chunk_fn)``, ``chunk_fn(state, xs, n) -> (state, ys)`` the same
        update over one sequence's next ``C`` tokens of which the first ``n`` count
        (``xs`` / ``ys`` ``(C, ...)``): steps where a sequence has several tokens run
        ``C`` at a time (a prefill chunk of n tokens: ``n / C`` updates), decode steps
        by token. None: always by token.

    Returns the per-token outputs ``(1, t, ...)`` and the chain after the write.
    """
    if cache.planes_per_layer != 2:
        raise ValueError("recurrent state needs a K/V cache (not a latent one)")
    num_seqs, nslot = blocks.shape[1], blocks.shape[2]
    bs, heads, dim = cache.block_size, cache.shard_kv_heads, cache.head_dim
    cap = nslot * _block_values(cache)
    total = state_elems(init)
    if total > cap:
        raise ValueError(f"a state of {total} values does not fit a slot of {nslot} blocks")
    t = jax.tree.leaves(xs)[0].shape[1]
    # 1. read: -> (S, cap) plane by plane, zeros where the sequence starts
    src = ops.after(blocks[0], chain)
    got = view[layer, :, src]  # (S, nS, planes, bs, H, D): one gather, no copy of a layer
    flat = jnp.moveaxis(got, 2, 1).reshape(num_seqs, cap)[:, :total].astype(jnp.float32)
    flat = jnp.where(rows[0][:, None] > 0, 0.0, flat)
    state = _unflatten(flat, init)
    # 2. the tokens in order, every sequence at once
    tokens = jax.tree.map(lambda a: a[0], xs)  # (t, ...)
    y_shape = jax.eval_shape(step_fn, init, jax.tree.map(lambda a: a[0], tokens))[1]
    ys = jax.tree.map(lambda s: jnp.zeros((t, *s.shape), s.dtype), y_shape)
    args = (state, ys, tokens, q_start, q_lens, rows[1])
    if chunk is None:
        many = functools.partial(_by_token, step_fn)
    else:
        many = functools.partial(_by_chunk, chunk[1], chunk[0])
    # A decode step (one token a sequence) is one update, no loop; a step where some
    # sequence has several tokens runs the chunked form (or the per-token loop).
    state, snap, ys = jax.lax.cond(
        jnp.max(q_lens) <= 1, functools.partial(_one_token, step_fn), many, *args
    )
    # 3. write the slots and the checkpoints in one call
    both = jnp.concatenate([_flatten(state, num_seqs), _flatten(snap, num_seqs)], axis=0)
    both = jnp.pad(both, ((0, 0), (0, cap - total))).astype(cache.dtype)
    both = both.reshape(2 * num_seqs, 2, nslot * bs, heads, dim)
    ck = jnp.where(rows[1][:, None] > 0, blocks[2], 0)
    table = jnp.concatenate([blocks[1], ck], axis=0)  # (2S, nS)
    slots = jnp.where(
        table[:, :, None] > 0, table[:, :, None] * bs + jnp.arange(bs, dtype=jnp.int32), -1
    ).reshape(-1)
    k = both[:, 0].reshape(-1, heads, dim)
    v = both[:, 1].reshape(-1, heads, dim)
    chain = ops.write_kv_async(cache, layer, k, v, slots, chain, view=view)
    return jax.tree.map(lambda a: a[None], ys), chain
