"""HostTier: the prefix cache's host-memory tier, one :class:`HostCache` per KV cache group.

Evicted prefix blocks of a group are copied to its tier (before they are freed) and a
later prompt restores them from there into new blocks instead of recomputing them. Each
group's tier holds that group's layers of a block, keyed like its prefix cache. A block
is copied to the host only once every step that wrote it is done: the tier keeps each
cached block's writer (the fence of the step that wrote it; None: restored from the
host, already complete), so a spill waits only for steps still running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_kvcached.engine.host_cache import HostCache
from jax_kvcached.engine.prefix_cache import PrefixCache
from jax_kvcached.memory.errors import KVCacheError, PoolExhausted
from jax_kvcached.memory.host_store import HostStore
from jax_kvcached.memory.kv_cache import KVCache

log = logging.getLogger(__name__)


def _ready(arrays: Any) -> bool:
    """Whether every array of a pytree is computed (no wait)."""
    return all(x.is_ready() for x in jax.tree_util.tree_leaves(arrays))


class HostTier:
    """The host tier of one KV cache's prefix caches (``blocks`` per group).

    Args:
      cache: the KV cache.
      blocks: blocks each group's tier holds.
      prefix_caches: the groups' prefix caches (hits and depths travel with a block).
      fence: returns the newest dispatched step's arrays (a block's default writer).
    """

    def __init__(
        self,
        cache: KVCache,
        blocks: int,
        prefix_caches: Sequence[PrefixCache],
        fence: Callable[[], Any],
    ) -> None:
        self.cache = cache
        self.caches: list[HostCache] = [
            HostCache(HostStore(cache, blocks, g.index), cache.block_size) for g in cache.groups
        ]
        self._prefix_caches = list(prefix_caches)
        self._fence = fence
        # Each cached (group, block)'s writer: the fence of the step that wrote it.
        self._writer: dict[tuple[int, int], Any] = {}
        self.hit_tokens = 0  # prompt tokens served from the tier
        self.restores = 0  # admissions that restored some

    # -- writers ---------------------------------------------------------------------------
    def wrote(self, group: int, block: int, fence: Any) -> None:
        """Block ``block`` of ``group`` joined the prefix cache, written by the step of
        ``fence`` (None: a finished host copy)."""
        self._writer[(group, block)] = fence

    def forget_uncached(self) -> None:
        """Drops the writers of blocks no longer cached (after a reset)."""
        self._writer = {
            (g, b): f for (g, b), f in self._writer.items()
            if self._prefix_caches[g].is_cached(b)
        }  # fmt: skip

    # -- spill and restore -----------------------------------------------------------------
    def spill(self, hashes: list[bytes], blocks: list[int], group: int) -> None:
        """Evicted blocks of a group go to its tier (before they are freed)."""
        # Every step that wrote them must be done; usually long ago (no wait).
        fence = self._fence()
        writers = [self._writer.pop((group, b), fence) for b in blocks]
        running = {id(f): f for f in writers if f is not None and not _ready(f)}
        if running:
            jax.block_until_ready(list(running.values()))
        pc = self._prefix_caches[group]
        meta = [(pc.hits_of(b), pc.depth_of(b)) for b in blocks]
        self.caches[group].store_blocks(hashes, blocks, meta)

    def ready(self, group: int, h: bytes) -> bool:
        """Whether a group's tier can restore block ``h`` now."""
        return self.caches[group].ready(h)

    def restore(
        self,
        group: int,
        hashes: list[bytes],
        new_blocks: Callable[[int], list[int] | None],
        free: Callable[[list[int]], None],
    ) -> list[int]:
        """New blocks of a group (from ``new_blocks(n)``) holding its tier's copies of
        ``hashes``, cached in its prefix cache: fewer, in order, when memory or a copy
        fails (a failed copy frees what was allocated and restores nothing: its contents
        are undefined, the prompt recomputes them)."""
        got: list[int] = []

        def alloc(n: int) -> list[int] | None:
            blocks = new_blocks(n)
            if blocks is not None:
                got.extend(blocks)
            return blocks

        try:
            blocks = self.caches[group].restore(hashes, alloc)
        except KVCacheError as err:
            log.warning("%r: restoring from the host tier failed (%s)", self.cache.name, err)
            free(got)
            return []
        return blocks

    def cache_restored(self, group: int, h: bytes, block: int, depth: int) -> None:
        """A restored block joins its group's prefix cache with its tier hits."""
        self._prefix_caches[group].insert(h, block, depth, self.caches[group].hits_of(h))
        self._writer[(group, block)] = None  # written by a finished host copy

    def counted(self, blocks: int, block_size: int) -> None:
        """An admission restored ``blocks`` of its prompt from the tier."""
        if blocks:
            self.hit_tokens += blocks * block_size
            self.restores += 1

    def preload(self, max_blocks: int, wait_fence: Callable[[], None]) -> list[int]:
        """Copies each group's most-hit blocks back to the device (parents before
        children on equal hits), up to ``max_blocks`` cached blocks per group, into
        memory the model can map now without evicting or reclaiming anything; they join
        the prefix cache idle. Returns the blocks copied per group."""
        done = [0] * len(self.caches)
        for g, (hc, pc) in enumerate(zip(self.caches, self._prefix_caches, strict=True)):
            room = min(max_blocks - pc.num_cached_blocks, self.cache.groups[g].num_free_blocks)
            if room <= 0:  # the bound is reached already, or no free room
                continue
            picks = hc.most_hit(room, skip=lambda h, pc=pc: pc.block_of(h) is not None)
            if not picks:
                continue
            picks.sort(key=lambda x: x[2])  # chain order: parents first
            try:
                blocks = pc.pool.alloc(len(picks))  # (held: copied into, then idle)
            except PoolExhausted:  # another tenant took the room meanwhile
                continue
            wait_fence()
            try:
                hc.preload([h for h, _, _ in picks], blocks)
            except KVCacheError as err:
                log.warning("%r: preloading from the host tier failed (%s)", self.cache.name, err)
                pc.pool.free_blocks(blocks)
                continue
            for (h, hits, depth), b in zip(picks, blocks, strict=True):
                pc.insert(h, b, depth, hits)
                self._writer[(g, b)] = None
            pc.pool.free_blocks(blocks)  # idle: evictable like any cached prefix
            done[g] = len(blocks)
        return done

    # -- figures and lifetime --------------------------------------------------------------
    def clear(self) -> None:
        for hc in self.caches:
            hc.clear()

    def stats(self, windows: Sequence[int]) -> dict[str, Any]:
        """Memory and block counters summed over the groups' tiers (``capacity_blocks``
        / ``capacity_tokens`` are each group's), each group's under ``groups`` when there
        are several; ``hits_tokens`` and ``restores`` count prompt tokens and
        admissions."""
        per = [hc.stats() for hc in self.caches]
        out = dict(per[0])
        for key in ("capacity_bytes", "entries", "bytes", "restored_blocks", "stored_blocks",
                    "bytes_to_host", "bytes_from_host", "evictions", "copy_failures"):  # fmt: skip
            out[key] = sum(p[key] for p in per)
        out["hits_tokens"] = self.hit_tokens
        out["restores"] = self.restores
        if len(per) > 1:
            out["groups"] = [{"window": w, **p} for w, p in zip(windows, per, strict=True)]
        return out

    def close(self) -> None:
        """Gives the tier's host memory back."""
        for hc in self.caches:
            hc.close()
        self.caches = []
        self._writer.clear()
