"""KVManager: the one seam between requests and KV memory.

The scheduler asks it, per sequence: may this one start (:meth:`KVManager.admit`), give
it room for n tokens (:meth:`grow`), let go of its blocks (:meth:`release`), record what
a step computed (:meth:`computed`). It owns block hashing, the prefix cache and the
eviction cascade, in this order: own idle cached prefixes, then other tenants' idle
prefixes above their guarantee (through the ledger), then a preemption signal (``grow``
returns False; whom to preempt is the scheduler's choice). Other tenants take memory
back through :meth:`reclaim`.

It also owns the device fence: the arrays of the last dispatched step, set by the engine
after each dispatch. Every block freed here is unmapped only once the fence is ready, so
no host policy code passes device arrays around.
"""

from __future__ import annotations

from typing import Any

from jax_kvcached.engine.eviction import EvictionPolicy
from jax_kvcached.engine.prefix_cache import PrefixCache, hash_blocks
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.errors import PoolExhausted
from jax_kvcached.memory.kv_cache import KVCache


class KVManager:
    """Blocks of one KV cache for the sequences of one engine.

    Args:
      cache: the KV cache (its ledger answers how much it may map).
      max_model_len: the longest sequence.
      prefix_caching: share the KV of cached prompt prefixes across requests.
      max_cached_tokens: the prefix cache's bound (default ``KVCACHED_MAX_CACHED_TOKENS``).
      eviction: the prefix cache's eviction policy (``"lru"``, ``"lfu"`` or an instance).
    """

    def __init__(
        self,
        cache: KVCache,
        max_model_len: int,
        *,
        prefix_caching: bool = True,
        max_cached_tokens: int | None = None,
        eviction: str | EvictionPolicy = "lru",
    ) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self._fence: Any = None
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(cache, max_cached_tokens, policy=eviction, free=self._free)
            if prefix_caching
            else None
        )

    # -- the fence ---------------------------------------------------------------------
    def set_fence(self, arrays: Any) -> None:
        """The arrays (any pytree) of the newest dispatched step: blocks freed from now
        on are unmapped only after they are ready (no read of a freed block races)."""
        self._fence = arrays

    def _free(self, blocks: list[int]) -> None:
        self.cache.free(blocks, after=self._fence)

    # -- arithmetic ------------------------------------------------------------------------
    @property
    def caching(self) -> bool:
        """Whether prompts are hashed and matched (a bound of 0 reuses nothing)."""
        return self.prefix_cache is not None and self.prefix_cache.enabled

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def available_blocks(self) -> int:
        """Blocks an allocation could get now: free ones plus idle cached ones."""
        idle = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return self.cache.num_free_blocks + idle

    def _pages_for_blocks(self, n: int) -> int:
        """Physical pages that hold n more blocks (whole KV pages)."""
        kv_pages = -(-n // self.cache.min_blocks_per_page)
        return kv_pages * self.cache.pages_per_kv_page

    def _reclaim_from_others(self, blocks: int) -> int:
        return self.cache.ledger.reclaim(self.cache.name, self._pages_for_blocks(blocks))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of seq's first ``num_blocks`` full blocks (extends its chain once)."""
        have = len(seq.hashes)
        if have < num_blocks:
            new = seq.token_ids[have * self.block_size : num_blocks * self.block_size]
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += hash_blocks(new, self.block_size, seq.extra, parent)
        return seq.hashes[:num_blocks]

    # -- the scheduler's calls -------------------------------------------------------------
    def admit(self, seq: Sequence) -> int | None:
        """Admits ``seq`` if the blocks for its known tokens and one more can be had now
        (asking other tenants for idle memory if needed): takes its cached prefix and
        returns the tokens it covers. None: not now (memory is busy; try later).
        Raises PoolExhausted if it could never fit under the current limits."""
        bs = self.block_size
        hashes: list[bytes] = []
        if self.caching:
            # The last token is always recomputed: it yields the next token's logits.
            hashes = self._hashes(seq, (seq.num_tokens - 1) // bs)
        hit = self.prefix_cache.lookup(hashes) if self.caching else 0
        need = self.blocks_for(min(seq.num_tokens + 1, self.max_model_len)) - hit
        while need > (available := self.available_blocks() - hit):
            capacity = self.cache.capacity_blocks
            if need + hit > capacity:
                raise PoolExhausted(
                    f"request {seq.request_id} needs {need + hit} KV blocks but "
                    f"{self.cache.name!r} can hold at most {capacity} under the pool's "
                    f"current budget and limits"
                )
            if not self._reclaim_from_others(need - available):
                return None  # other tenants hold the memory: wait
        if self.caching:
            seq.blocks = self.prefix_cache.match(hashes)
            seq.num_inserted = len(seq.blocks)
            seq.num_computed = len(seq.blocks) * bs
            seq.cached_tokens = seq.num_computed
        return seq.num_computed

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives ``seq`` blocks for ``num_tokens`` tokens: evicting own idle prefixes,
        then asking other tenants for theirs. False: no memory without preempting."""
        need = self.blocks_for(num_tokens) - len(seq.blocks)
        while need > 0:
            try:
                seq.blocks.extend(self.cache.alloc(need).tolist())
                return True
            except PoolExhausted:
                if self.prefix_cache and self.prefix_cache.evict(need) > 0:
                    continue
                if self._reclaim_from_others(need) > 0:
                    continue
                return False
        return True

    def release(self, seq: Sequence) -> None:
        """Lets go of seq's blocks: cached ones stay cached (idle), the rest are freed."""
        if self.prefix_cache:
            self.prefix_cache.release(seq.blocks)
        elif seq.blocks:
            self._free(seq.blocks)
        seq.blocks = []
        seq.num_inserted = 0

    def computed(self, seq: Sequence, num_computed: int) -> None:
        """Records a step's progress; full blocks of known tokens join the prefix cache
        (a block holding a still-pending token joins when it arrives: call again)."""
        seq.num_computed = num_computed
        if not self.caching:
            return  # block hashes are only needed to share blocks
        full = min(num_computed, len(seq.token_ids)) // self.block_size
        if seq.num_inserted >= full:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_inserted, full):
            self.prefix_cache.insert(hashes[i], seq.blocks[i])
        seq.num_inserted = full

    def shrink_to_limit(self) -> bool:
        """Gives back what is mapped above the cache's memory limit from idle cached
        prefixes. False: still over the limit (the scheduler preempts and calls again)."""
        while (over := self.cache.over_limit_pages) > 0:
            blocks = -(-over // self.cache.pages_per_kv_page) * self.cache.blocks_per_page
            if not (self.prefix_cache and self.prefix_cache.evict(blocks) > 0):
                return False
        return True

    # -- other tenants -------------------------------------------------------------------
    def reclaim(self, pages: int) -> int:
        """Another tenant needs memory: evicts idle cached prefixes (page-aware) until
        ``pages`` physical pages are unmapped or none are left. Returns pages freed."""
        if self.prefix_cache is None:
            return 0
        cache = self.cache
        before = cache.num_mapped_pages
        target = -(-pages // cache.pages_per_kv_page)
        while before - cache.num_mapped_pages < target:
            want = (target - (before - cache.num_mapped_pages)) * cache.blocks_per_page
            if self.prefix_cache.evict(want) == 0:
                break
        return (before - cache.num_mapped_pages) * cache.pages_per_kv_page

    def reset_prefix_cache(self) -> int:
        """Evicts every idle cached block; returns how many."""
        return self.prefix_cache.reset() if self.prefix_cache else 0

    def stats(self) -> dict[str, Any] | None:
        """The prefix cache's figures (None without one)."""
        return self.prefix_cache.stats() if self.prefix_cache else None
