"""ModelRunner: one jitted, shape-bucketed step of a Flax model over a paged KV cache.

A step takes, per sequence, a run of new tokens (a prefill chunk or one decode token), its
cached context length and its block table; it attends over the cached blocks plus the new
tokens, writes the new K/V of every layer with one ``ops.write_kv`` call after all reads,
and returns the logits of each sequence's last new token. Batch size, new-token count and
block-table width are padded to buckets so steady-state serving never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_kvcached import ops
from jax_kvcached.attention import host_paged_attention, paged_attention
from jax_kvcached.kv_cache import KVCache

ATTENTION_IMPLS = ("auto", "host", "xla", "pallas", "pallas-interpret")


def resolve_attention(impl: str, cache: KVCache) -> str:
    """Validates an attention choice for ``cache``; ``auto`` becomes the Pallas kernel for
    a CUDA cache and the host custom call for a host cache."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if cache.pool.backend == "cuda" else "host"
    if impl == "host" and cache.pool.backend != "host":
        raise ValueError("attention='host' needs a host-backend cache")
    return impl


def attention_fn(impl: str, cache: KVCache, nb: int, token: jax.Array):
    """The paged attention of a resolved choice (:func:`resolve_attention`): ``xla`` is
    the portable fallback; ``pallas-interpret`` runs the kernel interpreted (tests)."""
    if impl == "xla":
        return paged_attention
    if impl == "host":
        return functools.partial(host_paged_attention, cache, token)
    from jax_kvcached.pallas_attention import pallas_paged_attention

    splits = max(1, min(8, nb // 32))  # flash decoding: split long contexts
    return functools.partial(
        pallas_paged_attention, num_splits=splits, interpret=impl == "pallas-interpret"
    )


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class StepInput:
    tokens: list[int]  # the new tokens
    start: int  # tokens of this sequence already in the cache (their positions come first)
    blocks: list[int]  # the sequence's block table; covers start + len(tokens) tokens


class ModelRunner:
    """``attention``: ``auto`` (the Pallas kernel for a CUDA cache, the host custom call
    for a host cache), ``host``, ``xla``, ``pallas`` or ``pallas-interpret``."""

    def __init__(self, model: nnx.Module, cache: KVCache, attention: str = "auto") -> None:
        cfg = model.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError("the KV cache's layers / KV heads / head_dim do not match the model")
        self.config = cfg
        self.cache = cache
        self.attention = resolve_attention(attention, cache)
        self.graphdef, self.state = nnx.split(model)
        self.token = ops.new_token(cache.pool.device)
        self._step = jax.jit(self._make_step(), static_argnums=(3, 4, 5))

    def _make_step(self):
        graphdef, cache = self.graphdef, self.cache
        layers = self.config.num_layers

        def step(state, view, packed, b, t, nb, token):
            # All integer inputs travel as one array (one host-to-device transfer).
            sizes = (b * t, b * t, b * nb, b, b, b * t)
            parts, at = [], 0
            for n in sizes:
                parts.append(packed[at : at + n])
                at += n
            tokens, positions = parts[0].reshape(b, t), parts[1].reshape(b, t)
            tables, ctx_lens, new_lens = parts[2].reshape(b, nb), parts[3], parts[4]
            slots = parts[5]
            model = nnx.merge(graphdef, state)
            tables = ops.after(tables, token)  # reads see every earlier step's writes
            new_k: list = [None] * layers
            new_v: list = [None] * layers
            attention = attention_fn(self.attention, cache, nb, token)

            def attend(i, q, k, v):
                new_k[i], new_v[i] = k, v
                return attention(q, k, v, view, i, tables, ctx_lens, new_lens)

            logits = model(tokens, positions, attend)
            last = logits[jnp.arange(b), jnp.maximum(new_lens - 1, 0)]
            kvh, d = cache.num_kv_heads, cache.head_dim
            k_all = jnp.stack(new_k).reshape(layers, -1, kvh, d).astype(cache.dtype)
            v_all = jnp.stack(new_v).reshape(layers, -1, kvh, d).astype(cache.dtype)
            # After every read of this step (`last` depends on all of them).
            token = ops.write_kv(cache, 0, k_all, v_all, slots, token, last)
            return last, token

        return step

    @property
    def num_compiled(self) -> int:
        """Distinct shapes compiled so far."""
        return self._step._cache_size()

    def shapes_for(self, batch: list[StepInput]) -> tuple[int, int, int]:
        b = bucket(len(batch))
        t = max(len(x.tokens) for x in batch)
        t = 1 if t == 1 else bucket(t, 16)  # prefill chunks: at least 16 (fewer shapes)
        nb = bucket(max(-(-x.start // self.cache.block_size) for x in batch))
        return b, t, nb

    def run(self, batch: list[StepInput]) -> jax.Array:
        """Runs one step; returns logits ``(len(batch), vocab)`` (device array)."""
        return self.run_padded(batch)[: len(batch)]

    def run_padded(self, batch: list[StepInput]) -> jax.Array:
        """Runs one step; returns logits of the whole bucketed batch ``(b, vocab)``:
        rows past ``len(batch)`` are padding. Their shape depends only on the bucket,
        so what consumes them compiles once per bucket."""
        if not batch:
            raise ValueError("empty batch")
        bsz = self.cache.block_size
        b, t, nb = self.shapes_for(batch)
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        tables = np.zeros((b, nb), np.int32)
        ctx = np.zeros(b, np.int32)
        new = np.zeros(b, np.int32)
        slots = np.full((b, t), -1, np.int32)
        for i, x in enumerate(batch):
            n = len(x.tokens)
            if n == 0 or len(x.blocks) * bsz < x.start + n:
                raise ValueError("a step input needs tokens and blocks covering them")
            tokens[i, :n] = x.tokens
            pos = np.arange(x.start, x.start + n)
            positions[i, :n] = pos
            cached_blocks = -(-x.start // bsz)
            tables[i, :cached_blocks] = x.blocks[:cached_blocks]
            ctx[i], new[i] = x.start, n
            blk = np.asarray(x.blocks, np.int64)[pos // bsz]
            slots[i, :n] = blk * bsz + pos % bsz
        packed = np.concatenate(
            [tokens.ravel(), positions.ravel(), tables.ravel(), ctx, new, slots.ravel()]
        )
        logits, self.token = self._step(
            self.state, self.cache.view, jnp.asarray(packed), b, t, nb, self.token
        )
        return logits
