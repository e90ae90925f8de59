"""A prompt's prefix hit across the KV cache groups: how long it is, and taking it.

The hit is the longest prefix every group's rule (its manager's ``hit_length``) accepts,
from blocks cached on the device or ready in the group's host tier. Taking it holds the
device blocks, restores the host ones into new blocks (cached again), shortens the hit
where a restore fell short, and starts each group's table from what it got (the
manager says what it looks up and how its table starts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax_kvcached.engine.block_pool import BlockPool
from jax_kvcached.engine.kv_group_managers import KVGroupManager
from jax_kvcached.engine.prefix_cache import PrefixCache
from jax_kvcached.engine.sequence import Sequence


class PrefixHits:
    """Prefix hits over one engine's KV cache groups.

    Args:
      managers, prefix_caches, pools: each group's (in group order).
      host_tier: the host tier, asked at each hit (None: none; it may close).
      has: ``has(group, key)``: the group can serve the key (device or host tier).
      alloc: ``alloc(n, group)``: new blocks held once, into which a host copy may write
        at once (no dispatched step still reads them); None: no memory.
      block_size: tokens per block.
    """

    def __init__(
        self,
        managers: list[KVGroupManager],
        prefix_caches: list[PrefixCache],
        pools: list[BlockPool],
        host_tier: Callable[[], Any],
        has: Callable[[int, bytes], bool],
        alloc: Callable[[int, int], list[int] | None],
        block_size: int,
    ) -> None:
        self.managers, self.prefix_caches, self.pools = managers, prefix_caches, pools
        self._host_tier = host_tier
        self._has, self._alloc = has, alloc
        self.block_size = block_size

    def longest(self, hashes: list[bytes]) -> tuple[int, list[int]]:
        """(n, on_device): the longest prefix (in blocks) of ``hashes`` every group's
        hit rule accepts (on the device or from its host tier), and per group how many of
        the blocks it needs are on the device. Page-aware eviction empties whole pages,
        so device and host blocks of a chain may alternate."""
        n = len(hashes)
        while True:  # each rule only shortens the hit: until every group agrees
            m = n
            for mgr in self.managers:
                m = mgr.hit_length(hashes, m, lambda h, g=mgr.index: self._has(g, h))
            if m == n:
                break
            n = m
        on_device = [
            sum(pc.block_of(k) is not None for k in mgr.hit_keys(hashes, n))
            for mgr, pc in zip(self.managers, self.prefix_caches, strict=True)
        ]
        return n, on_device

    def take(self, seq: Sequence, hashes: list[bytes], n: int) -> tuple[list[list[int]], int]:
        """Each group's table for a hit of ``n`` blocks (see :meth:`longest`), its blocks
        held: device ones matched, host ones restored into new blocks and cached (each
        manager says what it looks up, and starts the sequence's table from it). When
        memory or a copy fails a restore, the hit shrinks to the longest prefix every
        group still serves. Returns the tables and the hit."""
        lookups = [mgr.hit_lookup(hashes, n) for mgr in self.managers]
        found = [
            pc.match_each(keys, upto, skip=skip)
            for pc, (keys, upto, skip) in zip(self.prefix_caches, lookups, strict=True)
        ]
        tier = self._host_tier()
        if tier is not None:
            restored_at: set[int] = set()
            for mgr, f, (keys, _, skip) in zip(self.managers, found, lookups, strict=True):
                g = mgr.index
                missing = [i for i in range(skip, len(f)) if f[i] is None]
                if not missing:
                    continue
                blocks = tier.restore(g, [keys[i] for i in missing],
                                      lambda c, g=g: self._alloc(c, g),
                                      self.pools[g].free_blocks)  # fmt: skip
                for i, b in zip(missing, blocks, strict=False):
                    f[i] = b
                    tier.cache_restored(g, keys[i], b, i)
                restored_at.update(mgr.restored_prompt_blocks(missing[: len(blocks)]))
            m = n
            while m > 0 and not all(
                mgr.serves(f, m, n) for mgr, f in zip(self.managers, found, strict=True)
            ):  # a restore fell short: (blocks below start(m) <= start(n) were never taken)
                m -= 1
            for mgr, f in zip(self.managers, found, strict=True):
                lo = mgr.kept(f, m, n)
                self.pools[mgr.index].free_blocks([b for b in f[lo:] if b is not None])
                del f[lo:]
            tier.counted(len([i for i in restored_at if i < m]), self.block_size)
            n = m
        tables = [mgr.start(seq, f) for mgr, f in zip(self.managers, found, strict=True)]
        return tables, n
