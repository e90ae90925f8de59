"""Prefix caching: chained block hashes and a bounded, page-aware cache of KV blocks.

A full block's hash is ``sha256(parent_hash || block_token_ids || extra_keys)``; extra keys
(tenant / model, per-request ``cache_salt``, adapter id) make different tenants or salts
never share a block. The cache is the hash index and the eviction order over its group's
:class:`~jax_kvcached.engine.block_pool.BlockPool`, which keeps the one reference count
per block: blocks in use (count > 0) are never evicted; blocks whose count falls to 0
stay cached, evictable in the order of an eviction policy (``eviction.py``: LRU by
default, a chain's tail first), bounded by
``max_cached_tokens`` (``KVCACHED_MAX_CACHED_TOKENS``: -1 unlimited, 0 no cross-request
reuse, N tokens of idle cached blocks). Under allocation pressure
:meth:`PrefixCache.evict` picks victims page-aware, so evictions empty whole pages that
the pool can unmap and hand to any tenant.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jax_kvcached.engine.block_pool import BlockPool
from jax_kvcached.engine.eviction import EvictionPolicy, make_policy
from jax_kvcached.memory.config import Config
from jax_kvcached.memory.kv_cache import KVCache

log = logging.getLogger(__name__)


def extra_key_bytes(*keys: Any) -> bytes:
    """Canonical bytes of the extra keys (None entries are kept: position matters)."""
    return repr(tuple(keys)).encode()


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(np.asarray(tokens, np.int64).tobytes())
    h.update(extra)
    return h.digest()


def hash_blocks(
    tokens: Sequence[int], block_size: int, extra: bytes, parent: bytes | None = None
) -> list[bytes]:
    """Chained hashes of every *full* block of ``tokens``."""
    out = []
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


class PrefixCache:
    """hash -> block of one KV cache group, and the bounded eviction of idle blocks.

    Args:
      cache: the KV cache (group) whose blocks are cached.
      max_cached_tokens: the bound on idle cached tokens (default
        ``KVCACHED_MAX_CACHED_TOKENS``).
      policy: the eviction order, ``"lru"``, ``"lfu"`` or an EvictionPolicy.
      pool: the group's block pool (its reference counts; default a pool of ``cache``
        freeing with ``cache.free``). Blocks leave the cache through its
        ``free_to_allocator``.
      evicted: called with (hashes, blocks) of evicted blocks before they are freed (the
        KV manager copies them to its host tier); not called by :meth:`reset`.
    """

    def __init__(
        self,
        cache: KVCache,
        max_cached_tokens: int | None = None,
        *,
        policy: str | EvictionPolicy = "lru",
        pool: BlockPool | None = None,
        evicted: Callable[[list[bytes], list[int]], None] | None = None,
    ) -> None:
        if max_cached_tokens is None:
            max_cached_tokens = Config.from_env().max_cached_tokens
        if max_cached_tokens < -1:
            raise ValueError("max_cached_tokens must be -1 (unlimited), 0 (off) or positive")
        self.cache = cache
        self.block_size = cache.block_size
        self.max_cached_tokens = max_cached_tokens
        self.policy = make_policy(policy)
        self.pool = pool if pool is not None else BlockPool(cache)
        if self.pool.cache is not None:
            raise ValueError("this block pool has a prefix cache already")
        self.pool.cache = self
        self._evicted = evicted
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._hits: dict[int, int] = {}  # takes per cached block (the preload's ranking)
        self._depth: dict[int, int] = {}  # index in its chain per cached block
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found
        self.evictions = 0  # blocks evicted
        # Told of every key that joins (``stored``) or leaves (``removed``) the cache
        # (a ``kv_events`` listener; None: no one).
        self.listener: Any = None

    # -- queries ---------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.max_cached_tokens != 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.policy)

    def cached_blocks(self) -> list[int]:
        """Every cached block (held or idle)."""
        return list(self._hash_of)

    def evictable_blocks(self) -> list[int]:
        """The idle cached blocks, in eviction order."""
        return list(self.policy.order())

    def block_of(self, h: bytes) -> int | None:
        """The block cached under hash ``h`` (None if none)."""
        return self._block_of.get(h)

    def key_of(self, block: int) -> bytes | None:
        """The hash a block is cached under (None if it is not cached)."""
        return self._hash_of.get(block)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self.policy

    def ref_count(self, block: int) -> int:
        """The block's holders (its pool's count)."""
        return self.pool.ref_count(block)

    def stats(self) -> dict[str, Any]:
        return {
            "max_cached_tokens": self.max_cached_tokens,
            "eviction_policy": self.policy.name,
            "queries_tokens": self.queries,
            "hits_tokens": self.hits,
            "hit_rate": self.hits / self.queries if self.queries else 0.0,
            "cached_blocks": self.num_cached_blocks,
            "cached_tokens": self.num_cached_blocks * self.block_size,
            "evictable_blocks": self.num_evictable_blocks,
            "evictions": self.evictions,
        }

    # -- lookups and registration ----------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are cached (no refs taken, no metrics)."""
        if not self.enabled:
            return 0
        n = 0
        for h in hashes:
            if h not in self._block_of:
                break
            n += 1
        return n

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``; holds each (the
        caller frees them through the pool)."""
        self.queries += len(hashes) * self.block_size
        out: list[int] = []
        if not self.enabled:
            return out
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        for block in out:
            self._take(block)
        return out

    def hits_of(self, block: int) -> int:
        """How often requests have taken a cached block (0 if it is not cached)."""
        return self._hits.get(block, 0)

    def depth_of(self, block: int) -> int:
        """A cached block's index in its chain (0: a prompt's first block)."""
        return self._depth.get(block, 0)

    def _take(self, block: int) -> None:
        """A new request holds a cached block: a holder and a hit."""
        self._hits[block] = self._hits.get(block, 0) + 1
        self.pool.touch([block])
        self.policy.on_hit(block)
        self.hits += self.block_size

    def busy(self, block: int) -> None:
        """(The pool:) an idle cached block is held again."""
        self.policy.on_busy(block)

    def match_each(self, hashes: Sequence[bytes], n: int, skip: int = 0) -> list[int | None]:
        """One entry per hash of the first ``n`` of ``hashes``: its cached block, with a
        holder added, or None where it is not cached (the caller fills the gaps, e.g. from
        the host tier). Counts the lookup of all ``hashes``. ``skip``: the first entries
        a hit covers without a block (a sliding window's, below it): None, not looked
        up, counted as hits."""
        self.queries += len(hashes) * self.block_size
        self.hits += skip * self.block_size
        out = [None] * skip
        out += [self._block_of.get(h) if self.enabled else None for h in hashes[skip:n]]
        for block in out:
            if block is not None:
                self._take(block)
        return out

    def insert(self, h: bytes, block: int, depth: int = 0, hits: int = 0) -> bool:
        """Registers a computed full block that someone holds (``depth``: its index in
        its chain; ``hits``: takes it had before, e.g. in the host tier). Returns False
        (and changes nothing) when caching is off or the hash is already cached."""
        if not self.enabled or h in self._block_of:
            return False
        if block in self._hash_of:
            raise ValueError(f"block {block} is already cached under another hash")
        if not self.pool.ref_count(block):
            raise ValueError(f"block {block} is not held (only a held block is cached)")
        self._block_of[h] = block
        self._hash_of[block] = h
        self._depth[block] = depth
        if hits:
            self._hits[block] = hits
        self.policy.on_insert(block)
        if self.listener is not None:
            self.listener.stored([h])
        return True

    def idle(self, blocks: Sequence[int], *, keep: bool = True) -> None:
        """(The pool:) ``blocks`` lost their last holder, the chain's tail first. Cached
        ones become idle (evictable), or leave the cache when not ``keep``; the others
        are freed at once. Then the bound is enforced."""
        uncached, dropped = [], []
        for block in blocks:
            if block in self._hash_of:
                self.policy.on_idle(block)  # (the policy removes idle blocks only)
                if not keep:
                    dropped.append(block)
            else:
                uncached.append(block)
        self._forget(dropped)
        if uncached or dropped:
            self.pool.free_to_allocator(uncached + dropped)
        self._enforce_bound()

    # -- eviction --------------------------------------------------------------------
    def _forget(self, blocks: list[int]) -> None:
        """Idle cached blocks leave the cache (the caller frees them)."""
        if self.listener is not None and blocks:
            self.listener.removed([self._hash_of[b] for b in blocks])
        for block in blocks:
            self.policy.on_remove(block)
            del self._block_of[self._hash_of.pop(block)]
            self._depth.pop(block, None)
            self._hits.pop(block, None)

    def _drop(self, blocks: Iterable[int], *, spill: bool = True) -> int:
        blocks = list(blocks)
        if blocks and spill and self._evicted is not None:
            self._evicted([self._hash_of[b] for b in blocks], blocks)
        self._forget(blocks)
        if blocks:
            self.pool.free_to_allocator(blocks)
            self.evictions += len(blocks)
        return len(blocks)

    def _enforce_bound(self) -> None:
        if self.max_cached_tokens < 0:
            return
        excess = len(self.policy) - self.max_cached_tokens // self.block_size
        if excess > 0:
            self._drop(list(itertools.islice(self.policy.order(), excess)))

    def evict(self, num_blocks: int, *, page_aware: bool = True) -> int:
        """Evicts at least ``num_blocks`` idle cached blocks (fewer if there are fewer).

        Page-aware: first the pages all of whose used blocks are idle cached blocks
        (evicting them empties the page, which the pool unmaps), in the policy's order of
        each page's first block; then single blocks in the policy's order. Returns the
        number evicted.
        """
        if num_blocks <= 0 or not len(self.policy):
            return 0
        order = list(self.policy.order())
        if not page_aware:
            return self._drop(order[:num_blocks])
        by_page: dict[int, list[int]] = {}
        for block in order:
            by_page.setdefault(self.cache.page_of(block), []).append(block)
        usage = self.cache.used_blocks_per_page(by_page)
        whole = [p for p, bs in by_page.items() if len(bs) == usage[p]]
        victims: list[int] = []
        for p in whole:
            if len(victims) >= num_blocks:
                break
            victims.extend(by_page[p])
        if len(victims) < num_blocks:
            chosen = set(victims)
            victims.extend([b for b in order if b not in chosen][: num_blocks - len(victims)])
        return self._drop(victims)

    def reset(self) -> int:
        """Evicts every idle cached block (forgotten: not handed to ``evicted``);
        returns how many. Blocks in use stay."""
        return self._drop(list(self.policy.order()), spill=False)

    def log_stats(self) -> None:
        s = self.stats()
        log.info(
            "prefix cache %s: hit rate %.1f%% (%d/%d tokens), %d cached blocks, %d evictions",
            self.cache.name,
            100 * s["hit_rate"],
            s["hits_tokens"],
            s["queries_tokens"],
            s["cached_blocks"],
            s["evictions"],
        )
