"""KVManager: the one seam between requests and KV memory.

The scheduler asks it, per sequence: may this one start (:meth:`KVManager.admit`), give
it room for n tokens (:meth:`grow`), let go of its blocks (:meth:`release`), record what
a step computed (:meth:`computed`). It owns block hashing, the prefix cache and the
eviction cascade, in this order: own idle cached prefixes, then other tenants' idle
prefixes above their guarantee (through the ledger), then a preemption signal (``grow``
returns False; whom to preempt is the scheduler's choice). Other tenants take memory
back through :meth:`reclaim`.

With a host tier (``host_cache_blocks`` > 0), evicted prefix blocks are copied to host
memory first, and :meth:`admit` restores a prompt's prefix from there when it continues
past the device-cached blocks (new blocks, KV copied back, no recompute).

It also owns the device fence: the arrays of the last dispatched step, set by the engine
after each dispatch. Every block freed here is unmapped only once the fence is ready, and
blocks are copied to or from the host tier only once it is ready, so no host policy code
passes device arrays around.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jax_kvcached.engine.eviction import EvictionPolicy
from jax_kvcached.engine.host_cache import HostCache
from jax_kvcached.engine.prefix_cache import PrefixCache, hash_blocks
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.errors import KVCacheError, PoolExhausted
from jax_kvcached.memory.host_store import HostStore
from jax_kvcached.memory.kv_cache import KVCache

log = logging.getLogger(__name__)


def _ready(arrays: Any) -> bool:
    """Whether every array of a pytree is computed (no wait)."""
    return all(x.is_ready() for x in jax.tree_util.tree_leaves(arrays))


class KVManager:
    """Blocks of one KV cache for the sequences of one engine.

    Args:
      cache: the KV cache (its ledger answers how much it may map).
      max_model_len: the longest sequence.
      prefix_caching: share the KV of cached prompt prefixes across requests.
      max_cached_tokens: the prefix cache's bound (default ``KVCACHED_MAX_CACHED_TOKENS``).
      eviction: the prefix cache's eviction policy (``"lru"``, ``"lfu"`` or an instance).
      host_cache_blocks: blocks the host tier holds (0: no tier; needs prefix caching).
    """

    def __init__(
        self,
        cache: KVCache,
        max_model_len: int,
        *,
        prefix_caching: bool = True,
        max_cached_tokens: int | None = None,
        eviction: str | EvictionPolicy = "lru",
        host_cache_blocks: int = 0,
    ) -> None:
        if host_cache_blocks < 0:
            raise ValueError(f"host_cache_blocks must be >= 0, got {host_cache_blocks}")
        self.cache = cache
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self._fence: Any = None
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(
                cache, max_cached_tokens, policy=eviction, free=self._free, evicted=self._spill
            )
            if prefix_caching
            else None
        )
        self.host_cache: HostCache | None = None
        # With a host tier: each cached block's writer, the fence of the step that wrote
        # it (None: restored on the host), so a spill waits only for steps still running.
        self._writer: dict[int, Any] = {}
        # Blocks shared by forked sequences (n samples of one prompt): holders beyond the
        # first. Only the last holder releases a block (to the prefix cache, or frees it).
        self._shared: dict[int, int] = {}
        if host_cache_blocks and self.caching:
            self.host_cache = HostCache(HostStore(cache, host_cache_blocks), self.block_size)

    # -- the fence ---------------------------------------------------------------------
    def set_fence(self, arrays: Any) -> None:
        """The arrays (any pytree) of the newest dispatched step: blocks freed from now
        on are unmapped only after they are ready (no read of a freed block races)."""
        self._fence = arrays

    def _free(self, blocks: list[int]) -> None:
        self.cache.free(blocks, after=self._fence)

    def _wait_fence(self) -> None:
        if self._fence is not None:
            jax.block_until_ready(self._fence)

    # -- the host tier -------------------------------------------------------------------
    def _spill(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Evicted blocks go to the host tier (before the prefix cache frees them)."""
        if self.host_cache is None:
            return
        # Every step that wrote them must be done; usually long ago (no wait).
        writers = [self._writer.pop(b, self._fence) for b in blocks]
        running = {id(f): f for f in writers if f is not None and not _ready(f)}
        if running:
            jax.block_until_ready(list(running.values()))
        self.host_cache.store_blocks(hashes, blocks)

    def _prefix(self, hashes: list[bytes]) -> tuple[int, int]:
        """(n, on_device): the longest prefix of ``hashes`` whose every block is cached
        on the device or servable from the host tier, and how many of those are on the
        device. Page-aware eviction empties whole pages, so a chain's evicted blocks
        need not be its tail: device and host blocks may alternate."""
        pc, hc = self.prefix_cache, self.host_cache
        if hc is None:
            n = pc.lookup(hashes)
            return n, n
        n = dev = 0
        for h in hashes:
            if pc.block_of(h) is not None:
                dev += 1
            elif not hc.ready(h):
                break
            n += 1
        return n, dev

    def _take_prefix(self, hashes: list[bytes], n: int) -> list[int]:
        """The blocks of the first ``n`` hashes (see :meth:`_prefix`), each held: device
        ones matched, host ones restored into new blocks and cached. Shorter when memory
        for a restore cannot be had (the rest is recomputed)."""
        pc = self.prefix_cache
        if self.host_cache is None:
            return pc.match(hashes)
        found = pc.match_each(hashes, n)
        missing = [i for i, b in enumerate(found) if b is None]
        restored = self._restore([hashes[i] for i in missing]) if missing else []
        if len(restored) < len(missing):  # cut before the first block not restored
            cut = missing[len(restored)]
            pc.release([b for b in found[cut:] if b is not None])
            found = found[:cut]
        for i, b in zip(missing, restored, strict=False):
            found[i] = b
            pc.insert(hashes[i], b)
            self._writer[b] = None  # written by a finished host copy
        return found

    def _alloc(self, n: int) -> list[int] | None:
        """``n`` new blocks: evicting own idle prefixes, then asking other tenants for
        theirs. None: no memory without preempting."""
        while True:
            try:
                return self.cache.alloc(n).tolist()
            except PoolExhausted:
                if self.prefix_cache and self.prefix_cache.evict(n) > 0:
                    continue
                if self._reclaim_from_others(n) > 0:
                    continue
                return None

    def _restore(self, hashes: list[bytes]) -> list[int]:
        """New blocks holding the host tier's copies of ``hashes`` (fewer, in order, when
        memory or a copy fails; an empty list then frees what was allocated)."""

        def new_blocks(n: int) -> list[int] | None:
            blocks = self._alloc(n)
            if blocks is not None:
                self._wait_fence()  # no dispatched step still reads them
            return blocks

        try:
            return self.host_cache.restore(hashes, new_blocks)
        except KVCacheError as err:  # their contents are undefined: recompute instead
            log.warning("%r: restoring from the host tier failed (%s)", self.cache.name, err)
            return []

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
        # Prompt log-probabilities need every prompt position computed: no reuse.
        if self.caching and not seq.params.prompt_logprobs:
            # The last token is always recomputed: it yields the next token's logits.
            hashes = self._hashes(seq, (seq.num_tokens - 1) // bs)
        prefix, hit = self._prefix(hashes) if self.caching else (0, 0)
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
            seq.blocks = self._take_prefix(hashes, prefix)
            seq.num_inserted = len(seq.blocks)
            seq.num_computed = len(seq.blocks) * bs
            seq.cached_tokens = seq.num_computed
        return seq.num_computed

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives ``seq`` blocks for ``num_tokens`` tokens: evicting own idle prefixes,
        then asking other tenants for theirs. False: no memory without preempting."""
        need = self.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        blocks = self._alloc(need)
        if blocks is None:
            return False
        seq.blocks.extend(blocks)
        return True

    def release(self, seq: Sequence) -> None:
        """Lets go of seq's blocks: cached ones stay cached (idle), the rest are freed;
        blocks another forked sequence still holds stay with it."""
        held = [b for b in seq.blocks if not self._unshare(b)]
        if self.prefix_cache:
            self.prefix_cache.release(held)
        elif held:
            self._free(held)
        seq.blocks = []
        seq.num_inserted = 0

    def _unshare(self, block: int) -> bool:
        """Drops one extra holder of a shared block; False when none is left (the
        caller holds it alone)."""
        n = self._shared.get(block, 0)
        if n == 0:
            return False
        if n == 1:
            del self._shared[block]
        else:
            self._shared[block] = n - 1
        return True

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Gives ``child`` (the same prompt, not started) ``parent``'s prompt KV: it
        shares every block holding only computed prompt tokens before the last one, and
        gets a new block for the block of the last prompt token, which it recomputes
        (its own first sample). Returns the (parent block, new block) copies to make on
        the device before the child's first step (copy-on-write of that partial block);
        None when no memory can be had for it now (nothing changed)."""
        n, bs = parent.num_prompt, self.block_size
        if parent.num_computed < n or child.token_ids != parent.prompt or child.blocks:
            raise ValueError("fork needs a parent whose prompt is computed and a fresh child")
        shared = parent.blocks[: (n - 1) // bs]
        copies: list[tuple[int, int]] = []
        if (n - 1) % bs:  # the last token's block also holds computed prompt tokens
            new = self._alloc(1)
            if new is None:
                return None
            copies.append((parent.blocks[len(shared)], new[0]))
        for b in shared:
            self._shared[b] = self._shared.get(b, 0) + 1
        child.blocks = list(shared) + [dst for _, dst in copies]
        child.num_computed = child.cached_tokens = n - 1
        child.hashes = list(parent.hashes[: n // bs])
        child.num_inserted = len(shared) if self.caching else 0
        child.forked_from = parent.request_id
        return copies

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
            inserted = self.prefix_cache.insert(hashes[i], seq.blocks[i])
            if inserted and self.host_cache is not None:
                self._writer[seq.blocks[i]] = self._fence  # the newest step wrote it
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
    def poll(self) -> None:
        """At each step: reports the prefix hits to the ledger and honours what other
        processes of a group asked of this tenant (memory back, a lower limit)."""
        pc, hc, cache = self.prefix_cache, self.host_cache, self.cache
        hits = (pc.hits if pc else 0) + (hc.hits_tokens if hc else 0)
        # Pages its idle cached blocks could free at most (page-aware eviction frees
        # whole pages): what other processes may ask of it.
        idle = pc.num_evictable_blocks if pc else 0
        idle_pages = min(-(-idle // cache.min_blocks_per_page), cache.num_mapped_pages)
        cache.ledger.poll(
            cache.name, hits, pc.queries if pc else 0, idle_pages * cache.pages_per_kv_page
        )

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
        """Forgets every idle cached block, on the device and in the host tier; returns
        how many device blocks were evicted."""
        if self.host_cache is None:
            return self.prefix_cache.reset() if self.prefix_cache else 0
        self.host_cache.clear()
        n = self.prefix_cache.reset()
        self._writer = {b: f for b, f in self._writer.items() if self.prefix_cache.is_cached(b)}
        return n

    def stats(self) -> dict[str, Any] | None:
        """The prefix cache's figures (None without one)."""
        return self.prefix_cache.stats() if self.prefix_cache else None

    def host_stats(self) -> dict[str, Any] | None:
        """The host tier's figures (None without one)."""
        return self.host_cache.stats() if self.host_cache else None

    def close(self) -> None:
        """Gives the host tier's memory back."""
        if self.host_cache is not None:
            self.host_cache.close()
            self.host_cache = None
            self._writer.clear()
