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
past the device-cached blocks (new blocks, KV copied back, no recompute). Each KV cache
group has its own tier (the group's layers of a block; ``host_cache_blocks`` each), keyed
like its prefix cache; a hit counts a group's blocks on the device and in its tier alike.

It also owns the device fence: the arrays of the last dispatched step, set by the engine
after each dispatch. Every block freed here is unmapped only once the fence is ready, and
blocks are copied to or from the host tier only once it is ready, so no host policy code
passes device arrays around.

KV cache groups (a cache of several: hybrid models): each group has its own block table
per sequence and its own prefix cache (a block's key is its hash within its group). A
sliding-window group (``windows[g]`` > 0) holds per sequence only the blocks some future
query can still see: as a sequence advances, blocks wholly below ``start - window + 1``
leave its table (the null block 0 takes their place) and are freed, cached or not, unless
another sequence still holds them (as SGLang's SWA cache does; vLLM keeps them cached
and evictable, which in an elastic pool would keep a long prompt's memory mapped); pages
are unmapped when they empty. A finished sequence's last window stays cached. A prefix
hit needs every full group's blocks of the whole prefix and each sliding group's blocks of
the last window before the hit point (vLLM's rule); the hit is the longest prefix for
which all groups agree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
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
      host_cache_blocks: blocks the host tier holds, per KV cache group (0: no tier;
        needs prefix caching). A group's block is its layers' share, so the tier's host
        bytes are those of this many blocks of every layer.
      windows: each KV cache group's sliding window in tokens (0: full attention; default
        all full). A sliding group gives back the blocks below its window.
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
        windows: Seq[int] | None = None,
    ) -> None:
        if host_cache_blocks < 0:
            raise ValueError(f"host_cache_blocks must be >= 0, got {host_cache_blocks}")
        self.cache = cache
        self.groups = cache.groups
        self.windows = tuple(int(w) for w in (windows or (0,) * len(self.groups)))
        if len(self.windows) != len(self.groups) or min(self.windows) < 0:
            raise ValueError(
                f"windows must give each of the {len(self.groups)} KV cache groups a window "
                f">= 0 (0: full attention), got {windows!r}"
            )
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self._fence: Any = None
        # One prefix cache per group (blocks are per group); the first is the one the
        # engine reports, its bound applies to each.
        self.prefix_caches: list[PrefixCache] = (
            [
                PrefixCache(
                    g,
                    max_cached_tokens,
                    policy=eviction,
                    free=lambda blocks, g=g: self._free(blocks, g.index),
                    evicted=lambda hashes, blocks, g=g: self._spill(hashes, blocks, g.index),
                )  # fmt: skip
                for g in self.groups
            ]
            if prefix_caching
            else []
        )
        self.prefix_cache: PrefixCache | None = (
            self.prefix_caches[0] if self.prefix_caches else None
        )
        # The host tier, one per group (none without one).
        self.host_caches: list[HostCache] = []
        # With a host tier: each cached (group, block)'s writer, the fence of the step that
        # wrote it (None: restored on the host), so a spill waits only for running steps.
        self._writer: dict[tuple[int, int], Any] = {}
        # Prompt tokens served from the tier and admissions that restored some.
        self.host_hit_tokens = 0
        self.host_restores = 0
        # Blocks shared by forked sequences (n samples of one prompt): holders beyond the
        # first. Only the last holder releases a block (to the prefix cache, or frees it).
        self._shared: dict[int, int] = {}
        if host_cache_blocks and self.caching:
            self.host_caches = [
                HostCache(HostStore(cache, host_cache_blocks, g.index), self.block_size)
                for g in self.groups
            ]

    @property
    def host_cache(self) -> HostCache | None:
        """The first group's host tier (None without one)."""
        return self.host_caches[0] if self.host_caches else None

    # -- the fence ---------------------------------------------------------------------
    def set_fence(self, arrays: Any) -> None:
        """The arrays (any pytree) of the newest dispatched step: blocks freed from now
        on are unmapped only after they are ready (no read of a freed block races)."""
        self._fence = arrays

    def _free(self, blocks: list[int], group: int = 0) -> None:
        self.groups[group].free(blocks, after=self._fence)

    def _wait_fence(self) -> None:
        if self._fence is not None:
            jax.block_until_ready(self._fence)

    # -- the host tier -------------------------------------------------------------------
    def _spill(self, hashes: list[bytes], blocks: list[int], group: int) -> None:
        """Evicted blocks of a group go to its host tier (before they are freed)."""
        if not self.host_caches:
            return
        # Every step that wrote them must be done; usually long ago (no wait).
        writers = [self._writer.pop((group, b), self._fence) for b in blocks]
        running = {id(f): f for f in writers if f is not None and not _ready(f)}
        if running:
            jax.block_until_ready(list(running.values()))
        pc = self.prefix_caches[group]
        meta = [(pc.hits_of(b), pc.depth_of(b)) for b in blocks]
        self.host_caches[group].store_blocks(hashes, blocks, meta)

    def _has(self, group: int, h: bytes) -> bool:
        """Whether a group can serve block ``h``: cached on the device or ready in its
        host tier."""
        if self.prefix_caches[group].block_of(h) is not None:
            return True
        return bool(self.host_caches) and self.host_caches[group].ready(h)

    def _hit(self, hashes: list[bytes]) -> tuple[int, list[int]]:
        """(n, on_device): the longest prefix (in blocks) of ``hashes`` every group can
        serve, each full group all its blocks and each sliding group those of its last
        window before the hit point (on the device or from its host tier); and per group
        how many of the blocks it needs are on the device. Page-aware eviction empties
        whole pages, so device and host blocks of a chain may alternate."""
        n = len(hashes)
        for g, w in enumerate(self.windows):
            if not w:
                k = 0
                while k < n and self._has(g, hashes[k]):
                    k += 1
                n = k
        sliding = [g for g, w in enumerate(self.windows) if w]
        while n > 0 and not all(
            all(self._has(g, h) for h in hashes[self._hit_lo(g, n) : n]) for g in sliding
        ):
            n -= 1
        on_device = [
            sum(pc.block_of(h) is not None for h in hashes[self._hit_lo(g, n) : n])
            for g, pc in enumerate(self.prefix_caches)
        ]
        return n, on_device

    def _take(self, hashes: list[bytes], n: int) -> tuple[list[list[int]], int]:
        """Each group's table for a hit of ``n`` blocks (see :meth:`_hit`), its blocks
        held (the null block below a sliding window): device ones matched, host ones
        restored into new blocks and cached. When memory or a copy fails a restore, the
        hit shrinks to the longest prefix every group still holds (the rest is
        recomputed). Returns the tables and the hit."""
        found = [
            pc.match_each(hashes, n, skip=self._hit_lo(g, n))
            for g, pc in enumerate(self.prefix_caches)
        ]
        if self.host_caches:
            restored_at: set[int] = set()
            for g, f in enumerate(found):
                missing = [i for i in range(self._hit_lo(g, n), n) if f[i] is None]
                if not missing:
                    continue
                blocks = self._restore([hashes[i] for i in missing], g)
                hc = self.host_caches[g]
                for i, b in zip(missing, blocks, strict=False):
                    f[i] = b
                    self.prefix_caches[g].insert(hashes[i], b, i, hc.hits_of(hashes[i]))
                    self._writer[(g, b)] = None  # written by a finished host copy
                    restored_at.add(i)
            m = n
            while m > 0 and any(
                None in f[self._hit_lo(g, m) : m] for g, f in enumerate(found)
            ):  # a restore fell short: (blocks below lo(g, m) <= lo(g, n) were never taken)
                m -= 1
            for g, f in enumerate(found):
                self.prefix_caches[g].release([b for b in f[m:n] if b is not None])
                del f[m:]
            if restored := [i for i in restored_at if i < m]:
                self.host_hit_tokens += len(restored) * self.block_size
                self.host_restores += 1
            n = m
        return [[b or 0 for b in f] for f in found], n

    def _alloc(self, n: int, group: int = 0) -> list[int] | None:
        """``n`` new blocks of a group: evicting own idle prefixes (the group's, then the
        other groups'), then asking other tenants for theirs. None: no memory without
        preempting."""
        while True:
            try:
                return self.groups[group].alloc(n).tolist()
            except PoolExhausted:
                if self.prefix_caches and self.prefix_caches[group].evict(n) > 0:
                    continue
                if self._evict_other_groups(group) > 0:
                    continue
                if self._reclaim_from_others(n, group) > 0:
                    continue
                return None

    def _evict_other_groups(self, group: int) -> int:
        """Idle cached blocks of the other groups, a page's worth each (their pages are
        charged to the same tenant: freeing them gives this group room)."""
        return sum(
            pc.evict(self.groups[g].blocks_per_page)
            for g, pc in enumerate(self.prefix_caches)
            if g != group
        )

    def _restore(self, hashes: list[bytes], group: int) -> list[int]:
        """New blocks of a group holding its host tier's copies of ``hashes`` (fewer, in
        order, when memory or a copy fails; an empty list then frees what was
        allocated)."""

        got: list[int] = []

        def new_blocks(n: int) -> list[int] | None:
            blocks = self._alloc(n, group)
            if blocks is not None:
                got.extend(blocks)
                self._wait_fence()  # no dispatched step still reads them
            return blocks

        try:
            return self.host_caches[group].restore(hashes, new_blocks)
        except KVCacheError as err:  # their contents are undefined: recompute instead
            log.warning("%r: restoring from the host tier failed (%s)", self.cache.name, err)
            self._free(got, group)
            return []

    def preload(self, max_tokens: int) -> list[int]:
        """Copies each group's most-hit host-tier blocks back to the device (parents
        before children on equal hits), up to ``max_tokens`` tokens of blocks per group
        and the prefix cache's bound, into memory the model can map now without evicting
        or reclaiming anything; they join the prefix cache idle, as if a request had
        just finished with them. Returns the blocks copied per group."""
        done = [0] * len(self.groups)
        if not self.host_caches or max_tokens <= 0:
            return done
        bound = self.prefix_cache.max_cached_tokens
        budget = (max_tokens if bound < 0 else min(max_tokens, bound)) // self.block_size
        for g, (hc, pc) in enumerate(zip(self.host_caches, self.prefix_caches, strict=True)):
            room = min(budget - pc.num_cached_blocks, self.groups[g].num_free_blocks)
            if room <= 0:  # the bound is reached already, or no free room
                continue
            picks = hc.most_hit(room, skip=lambda h, pc=pc: pc.block_of(h) is not None)
            if not picks:
                continue
            picks.sort(key=lambda x: x[2])  # chain order: parents first
            try:
                blocks = self.groups[g].alloc(len(picks)).tolist()
            except PoolExhausted:  # another tenant took the room meanwhile
                continue
            self._wait_fence()
            hashes = [h for h, _, _ in picks]
            try:
                hc.preload(hashes, blocks)
            except KVCacheError as err:
                log.warning("%r: preloading from the host tier failed (%s)", self.cache.name, err)
                self._free(blocks, g)
                continue
            for (h, hits, depth), b in zip(picks, blocks, strict=True):
                pc.insert(h, b, depth, hits)
                self._writer[(g, b)] = None
            pc.release(blocks)  # idle: evictable like any cached prefix
            done[g] = len(blocks)
        return done

    # -- arithmetic ------------------------------------------------------------------------
    @property
    def caching(self) -> bool:
        """Whether prompts are hashed and matched (a bound of 0 reuses nothing)."""
        return self.prefix_cache is not None and self.prefix_cache.enabled

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, group: int, position: int) -> int:
        """The first block of a group a query at ``position`` (or later) can see: 0 for a
        full group; for a sliding one, the block of ``position - window + 1``."""
        w = self.windows[group]
        return max(0, position - w + 1) // self.block_size if w else 0

    def available_blocks(self, group: int = 0) -> int:
        """Blocks an allocation of a group could get now: free ones plus its idle cached
        ones."""
        idle = self.prefix_caches[group].num_evictable_blocks if self.prefix_caches else 0
        return self.groups[group].num_free_blocks + idle

    def _reclaim_from_others(self, blocks: int, group: int = 0) -> int:
        pages = self.groups[group].pages_for_blocks(blocks)
        return self.cache.ledger.reclaim(self.cache.name, pages)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of seq's first ``num_blocks`` full blocks (extends its chain once)."""
        have = len(seq.hashes)
        if have < num_blocks:
            new = seq.token_ids[have * self.block_size : num_blocks * self.block_size]
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += hash_blocks(new, self.block_size, seq.extra, parent)
        return seq.hashes[:num_blocks]

    def _hit_lo(self, group: int, n: int) -> int:
        """The first block of a group a hit of ``n`` blocks needs."""
        return self.first_needed_block(group, n * self.block_size)

    def _needs(self, seq: Sequence, hit: list[int]) -> list[int]:
        """Blocks each group must still allocate to admit ``seq`` (a sliding group: at
        most its window's, as its blocks below the window go back as it advances)."""
        total = self.blocks_for(min(seq.num_tokens + 1, self.max_model_len))
        out = []
        for g, w in enumerate(self.windows):
            want = total if not w else min(total, -(-w // self.block_size) + 1)
            out.append(max(0, want - hit[g]))
        return out

    # -- the scheduler's calls -------------------------------------------------------------
    def admit(self, seq: Sequence) -> int | None:
        """Admits ``seq`` if the blocks for its known tokens and one more can be had now
        (asking other tenants for idle memory if needed): takes its cached prefix and
        returns the tokens it covers. None: not now (memory is busy; try later).
        Raises PoolExhausted if it could never fit under the current limits."""
        bs, ng = self.block_size, len(self.groups)
        hashes: list[bytes] = []
        # Prompt log-probabilities need every prompt position computed: no reuse.
        if self.caching and not seq.params.prompt_logprobs:
            # The last token is always recomputed: it yields the next token's logits.
            hashes = self._hashes(seq, (seq.num_tokens - 1) // bs)
        while True:  # (evicting for room may evict the hit's own blocks: look again)
            # hit: blocks of each group the prefix gives without an allocation.
            prefix, hit = self._hit(hashes) if self.caching else (0, [0] * ng)
            need = self._needs(seq, hit)
            short = [g for g in range(ng) if need[g] > self.available_blocks(g) - hit[g]]
            if not short:
                break
            for g in short:
                capacity = self.groups[g].capacity_blocks
                if need[g] + hit[g] > capacity:
                    where = f" of group {g}" if ng > 1 else ""
                    raise PoolExhausted(
                        f"request {seq.request_id} needs {need[g] + hit[g]} KV blocks{where} "
                        f"but {self.cache.name!r} can hold at most {capacity} under the "
                        f"pool's current budget and limits"
                    )
            if ng > 1:
                # Together: the groups share the tenant's room.
                pages = sum(g.pages_for_blocks(n + h) for g, n, h in zip(self.groups, need, hit,
                                                                       strict=True))  # fmt: skip
                capacity = self.cache.ledger.capacity_pages(self.cache.name)
                if pages > capacity:
                    raise PoolExhausted(
                        f"request {seq.request_id} needs {pages} pages of KV blocks over its "
                        f"{ng} KV cache groups but {self.cache.name!r} can hold at most "
                        f"{capacity} under the pool's current budget and limits"
                    )
                if any(self._evict_other_groups(g) for g in short):
                    continue
            g = short[0]
            if not self._reclaim_from_others(need[g] - (self.available_blocks(g) - hit[g]), g):
                return None  # other tenants hold the memory: wait
        seq.tables = [[] for _ in range(ng)]
        seq.inserted = [0] * ng
        if self.caching:
            seq.tables, prefix = self._take(hashes, prefix)
            seq.inserted = [prefix] * ng
            seq.num_computed = prefix * bs
            seq.cached_tokens = seq.num_computed
        return seq.num_computed

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives ``seq`` blocks for ``num_tokens`` tokens (a step from ``seq.num_computed``
        on): a sliding group first lets go of the blocks below the window of that step's
        first query; new blocks evict own idle prefixes, then ask other tenants for
        theirs. False: no memory without preempting."""
        for g, table in enumerate(seq.tables):
            if self.windows[g]:
                self._slide(seq, g, seq.num_computed)
            need = self.blocks_for(num_tokens) - len(table)
            if need <= 0:
                continue
            blocks = self._alloc(need, g)
            if blocks is None:
                return False
            table.extend(blocks)
        return True

    def _slide(self, seq: Sequence, group: int, position: int) -> None:
        """A sliding group's blocks wholly below the window of a query at ``position``
        leave seq's table (null block 0) and are freed unless another sequence holds
        them (their pages unmapped once empty, behind the fence)."""
        table = seq.tables[group]
        lo = min(self.first_needed_block(group, position), len(table))
        gone = [b for b in table[:lo] if b]
        if not gone:
            return
        table[:lo] = [0] * lo
        if self.prefix_caches:
            # Held by no one else, they leave the cache too: kept, a long prompt's
            # out-of-window blocks would hold the memory the window is meant to give back
            # (a later hit needs only the blocks of the window before its hit point).
            self.prefix_caches[group].release(gone, keep=False)
        else:
            self._free(gone, group)

    def release(self, seq: Sequence) -> None:
        """Lets go of seq's blocks: cached ones stay cached (idle), the rest are freed;
        blocks another forked sequence still holds stay with it."""
        for g, table in enumerate(seq.tables):
            held = [b for b in table if b and not (g == 0 and self._unshare(b))]
            if self.prefix_caches:
                self.prefix_caches[g].release(held)
            elif held:
                self._free(held, g)
        seq.tables = [[] for _ in seq.tables]
        seq.inserted = [0] * len(seq.tables)

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
        if len(self.groups) > 1:
            return None  # copies are per group: the child computes its prompt on its own
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
        if min(seq.inserted) >= full:
            return
        hashes = self._hashes(seq, full)
        for g, (pc, table) in enumerate(zip(self.prefix_caches, seq.tables, strict=True)):
            for i in range(seq.inserted[g], full):
                if not table[i]:  # a sliding group's block already gone below the window
                    continue
                inserted = pc.insert(hashes[i], table[i], i)
                if inserted and self.host_caches:
                    self._writer[(g, table[i])] = self._fence  # the newest step wrote it
            seq.inserted[g] = full

    def _evict_pages(self, pages: int) -> int:
        """Evicts idle cached blocks, page-aware, group by group, until ``pages``
        physical pages are unmapped or nothing idle is left; returns pages unmapped."""
        cache = self.cache
        before = cache.mapped_pages
        while (left := pages - (before - cache.mapped_pages)) > 0:
            evicted = 0
            for g, pc in zip(self.groups, self.prefix_caches, strict=False):  # [] if not caching
                if pc.num_evictable_blocks:
                    evicted += pc.evict(-(-left // g.pages_per_kv_page) * g.blocks_per_page)
                    break
            if not evicted:
                break
        return before - cache.mapped_pages

    def shrink_to_limit(self) -> bool:
        """Gives back what is mapped above the cache's memory limit from idle cached
        prefixes. False: still over the limit (the scheduler preempts and calls again)."""
        if (over := self.cache.over_limit_pages) > 0:
            self._evict_pages(over)
        return self.cache.over_limit_pages <= 0

    # -- other tenants -------------------------------------------------------------------
    def poll(self) -> None:
        """At each step: reports the prefix hits to the ledger and honours what other
        processes of a group asked of this tenant (memory back, a lower limit)."""
        pc, cache = self.prefix_cache, self.cache
        hits = (pc.hits if pc else 0) + self.host_hit_tokens
        # Pages its idle cached blocks could free at most (page-aware eviction frees
        # whole pages): what other processes may ask of it.
        idle_pages = sum(
            min(-(-c.num_evictable_blocks // g.min_blocks_per_page), g.num_mapped_pages)
            * g.pages_per_kv_page
            for g, c in zip(self.groups, self.prefix_caches, strict=False)  # [] if not caching
        )
        cache.ledger.poll(cache.name, hits, pc.queries if pc else 0, idle_pages)

    def reclaim(self, pages: int) -> int:
        """Another tenant needs memory: evicts idle cached prefixes (page-aware) until
        ``pages`` physical pages are unmapped or none are left. Returns pages freed."""
        return self._evict_pages(pages) if self.prefix_caches else 0

    def reset_prefix_cache(self) -> int:
        """Forgets every idle cached block, on the device and in the host tier; returns
        how many device blocks were evicted."""
        for hc in self.host_caches:
            hc.clear()
        n = sum(pc.reset() for pc in self.prefix_caches)
        self._writer = {
            (g, b): f for (g, b), f in self._writer.items() if self.prefix_caches[g].is_cached(b)
        }
        return n

    def stats(self) -> dict[str, Any] | None:
        """The prefix cache's figures (None without one); with several KV cache groups,
        the first group's, and each group's under ``groups``."""
        if not self.prefix_caches:
            return None
        out = self.prefix_cache.stats()
        if len(self.groups) > 1:
            out["groups"] = [
                {"window": w, **pc.stats()}
                for w, pc in zip(self.windows, self.prefix_caches, strict=True)
            ]
        return out

    def group_stats(self) -> list[dict[str, Any]]:
        """Per KV cache group: its layers, window, mapped memory, blocks in use and
        cached (per device)."""
        out = []
        for g, w in zip(self.groups, self.windows, strict=True):
            pc = self.prefix_caches[g.index] if self.prefix_caches else None
            out.append({
                "layers": len(g.layers), "window": w, "mapped_bytes": g.mapped_bytes,
                "used_blocks": g.num_used_blocks,
                "cached_blocks": pc.num_cached_blocks if pc else 0,
            })  # fmt: skip
        return out

    def host_stats(self) -> dict[str, Any] | None:
        """The host tier's figures (None without one). With several KV cache groups,
        memory and block counters are summed over the groups' tiers (``capacity_blocks``
        / ``capacity_tokens`` are each group's), and each group's are under ``groups``.
        ``hits_tokens`` and ``restores`` count prompt tokens and admissions."""
        if not self.host_caches:
            return None
        per = [hc.stats() for hc in self.host_caches]
        out = dict(per[0])
        for key in ("capacity_bytes", "entries", "bytes", "restored_blocks", "stored_blocks",
                    "bytes_to_host", "bytes_from_host", "evictions", "copy_failures"):  # fmt: skip
            out[key] = sum(p[key] for p in per)
        out["hits_tokens"] = self.host_hit_tokens
        out["restores"] = self.host_restores
        if len(per) > 1:
            out["groups"] = [{"window": w, **p} for w, p in zip(self.windows, per, strict=True)]
        return out

    def close(self) -> None:
        """Gives the host tier's memory back."""
        for hc in self.host_caches:
            hc.close()
        self.host_caches = []
        self._writer.clear()
