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
per sequence, its own prefix cache (a block's key is its hash within its group) and one
manager of its type (:mod:`jax_kvcached.engine.kv_group_managers`), which holds the
rules that differ: which blocks a query sees, the hit rule, the blocks a sequence holds
at once, what it lets go of as it advances, how a hit is taken and what a step's
progress caches. This class asks every manager alike and never branches on a type; a
hit is the longest prefix every group's rule agrees on. A recurrent group
(``kv_group_managers.RecurrentStateManager``) holds a fixed state slot per sequence and
owns its state checkpoints. Each group's blocks and their one reference count are its
:class:`~jax_kvcached.engine.block_pool.BlockPool`: forks share their parent's prompt
blocks in every group with a ``touch``. The host tier is
:class:`~jax_kvcached.engine.host_tier.HostTier`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from contextlib import nullcontext
from typing import Any

import jax

from jax_kvcached.engine.block_pool import BlockPool
from jax_kvcached.engine.eviction import EvictionPolicy
from jax_kvcached.engine.host_cache import HostCache
from jax_kvcached.engine.host_tier import HostTier
from jax_kvcached.engine.kv_events import KVEventLog
from jax_kvcached.engine.kv_group_managers import GroupServices, KVGroupManager, make_manager
from jax_kvcached.engine.prefix_cache import PrefixCache, hash_blocks
from jax_kvcached.engine.prefix_hits import PrefixHits
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.errors import PoolExhausted
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.models.interface import FULL, KVSpec


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
      specs: what each KV cache group's layers keep (``models.interface.KVSpec``;
        default all full attention); each group gets the manager of its kind. A sliding
        group gives back the blocks below its window.
      slot_blocks: blocks of a recurrent group's state slot (``recurrent.slot_blocks``).
      state_interval: tokens between a recurrent group's prompt checkpoints (besides
        the one at the prompt's end).
      events: a log told of every block that joins or leaves a tier (``kv_events``).
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
        specs: Seq[KVSpec] | None = None,
        slot_blocks: int = 0,
        state_interval: int = 512,
        events: KVEventLog | None = None,
    ) -> None:
        if host_cache_blocks < 0:
            raise ValueError(f"host_cache_blocks must be >= 0, got {host_cache_blocks}")
        self.cache = cache
        self.groups = cache.groups
        self.specs = tuple(specs) if specs is not None else (FULL,) * len(self.groups)
        if len(self.specs) != len(self.groups) or not all(
            isinstance(s, KVSpec) for s in self.specs
        ):  # fmt: skip
            raise ValueError(f"specs must give each of the {len(self.groups)} KV cache "
                             f"groups a KVSpec, got {specs!r}")  # fmt: skip
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self._fence: Any = None
        # One block pool per group: the one reference count of each of its blocks.
        self.pools = [BlockPool(g, lambda blocks, g=g: self._free(blocks, g.index))
                      for g in self.groups]  # fmt: skip
        # One prefix cache per group (blocks are per group); the first is the one the
        # engine reports, its bound applies to each.
        self.prefix_caches: list[PrefixCache] = (
            [
                PrefixCache(
                    g,
                    max_cached_tokens,
                    policy=eviction,
                    pool=self.pools[g.index],
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
        self.events = events
        # One manager per group, of its type (full attention, a sliding window, state).
        self.managers: list[KVGroupManager] = [
            make_manager(spec, g, self.block_size, self.pools[g.index],
                         self.prefix_caches[g.index] if self.prefix_caches else None,
                         self._services(g.index), slot_blocks=slot_blocks,
                         interval=state_interval)  # fmt: skip
            for g, spec in zip(self.groups, self.specs, strict=True)
        ]
        # The host tier (None without one).
        self.host_tier: HostTier | None = None
        if host_cache_blocks and self.caching:
            self.host_tier = HostTier(cache, host_cache_blocks, self.prefix_caches,
                                      lambda: self._fence)  # fmt: skip
        if events is not None:
            events.attach(self.prefix_caches, self.host_caches)
        self.hits = PrefixHits(self.managers, self.prefix_caches, self.pools,
                               lambda: self.host_tier, self._has, self._alloc_fenced,
                               self.block_size)  # fmt: skip

    def _services(self, g: int) -> GroupServices:
        """What group ``g``'s manager may ask of this manager."""

        def wrote(block: int) -> None:
            if self.host_tier is not None:
                self.host_tier.wrote(g, block, self._fence)

        return GroupServices(lambda n: self._alloc(n, g), lambda h: self._has(g, h), wrote,
                             self.events)  # fmt: skip

    @property
    def state_restores(self) -> int:
        """Preempted sequences of a recurrent model resumed from a state checkpoint."""
        return sum(getattr(m, "restores", 0) for m in self.managers)

    @property
    def state_recomputes(self) -> int:
        """Preempted sequences of a recurrent model recomputed from token 0."""
        return sum(getattr(m, "recomputes", 0) for m in self.managers)

    @property
    def host_caches(self) -> list[HostCache]:
        """Each group's host tier (empty without one)."""
        return self.host_tier.caches if self.host_tier is not None else []

    @property
    def host_cache(self) -> HostCache | None:
        """The first group's host tier (None without one)."""
        return self.host_caches[0] if self.host_caches else None

    @property
    def host_hit_tokens(self) -> int:
        """Prompt tokens served from the host tier."""
        return self.host_tier.hit_tokens if self.host_tier is not None else 0

    # -- the fence ---------------------------------------------------------------------
    def set_fence(self, arrays: Any) -> None:
        """The arrays (any pytree) of the newest dispatched step: blocks freed from now
        on are unmapped only after they are ready (no read of a freed block races)."""
        self._fence = arrays

    def _free(self, blocks: list[int], group: int = 0) -> None:
        """Gives blocks back to the allocator behind the fence (the pools' way out)."""
        self.groups[group].free(blocks, after=self._fence)

    def _wait_fence(self) -> None:
        if self._fence is not None:
            jax.block_until_ready(self._fence)

    # -- the host tier -------------------------------------------------------------------
    def _spill(self, hashes: list[bytes], blocks: list[int], group: int) -> None:
        """Evicted blocks of a group go to its host tier (before they are freed)."""
        if self.host_tier is not None:
            self.host_tier.spill(hashes, blocks, group)

    def _has(self, group: int, h: bytes) -> bool:
        """Whether a group can serve block ``h``: cached on the device or ready in its
        host tier."""
        if self.prefix_caches[group].block_of(h) is not None:
            return True
        return self.host_tier is not None and self.host_tier.ready(group, h)

    def _alloc_fenced(self, n: int, group: int) -> list[int] | None:
        """:meth:`_alloc`, then waits until no dispatched step still reads the blocks
        (a host copy writes them at once)."""
        blocks = self._alloc(n, group)
        if blocks is not None:
            self._wait_fence()
        return blocks

    def _alloc(self, n: int, group: int = 0) -> list[int] | None:
        """``n`` new blocks of a group: evicting own idle prefixes (the group's, then the
        other groups'), then asking other tenants for theirs. None: no memory without
        preempting."""
        while True:
            try:
                return self.pools[group].alloc(n)
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

    def preload(self, max_tokens: int) -> list[int]:
        """Copies each group's most-hit host-tier blocks back to the device (see
        :meth:`HostTier.preload`), up to ``max_tokens`` tokens of blocks per group and the
        prefix cache's bound. Returns the blocks copied per group."""
        if self.host_tier is None or max_tokens <= 0:
            return [0] * len(self.groups)
        bound = self.prefix_cache.max_cached_tokens
        budget = (max_tokens if bound < 0 else min(max_tokens, bound)) // self.block_size
        return self.host_tier.preload(budget, self._wait_fence)

    # -- arithmetic ------------------------------------------------------------------------
    @property
    def caching(self) -> bool:
        """Whether prompts are hashed and matched (a bound of 0 reuses nothing)."""
        return self.prefix_cache is not None and self.prefix_cache.enabled

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def _needs(self, seq: Sequence, hit: list[int]) -> list[int]:
        """Blocks each group must still allocate to admit ``seq`` (what its manager
        holds at once of the blocks of its tokens and one more, less the hit's)."""
        total = self.blocks_for(min(seq.num_tokens + 1, self.max_model_len))
        return [m.new_blocks(total, h) for m, h in zip(self.managers, hit, strict=True)]

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
            prefix, hit = self.hits.longest(hashes) if self.caching else (0, [0] * ng)
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
        seq.state_src, seq.state_ck = [], None
        if self.caching:
            seq.tables, prefix = self.hits.take(seq, hashes, prefix)
            seq.inserted = [prefix] * ng
            seq.num_computed = prefix * bs
            seq.cached_tokens = seq.num_computed
        for mgr in self.managers:
            mgr.admitted(seq)
        return seq.num_computed

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives ``seq`` blocks for ``num_tokens`` tokens (a step from ``seq.num_computed``
        on): each group first lets go of the blocks no query of that step sees (its
        manager's ``remove_skipped_blocks``); new blocks evict own idle prefixes, then ask
        other tenants for theirs. False: no memory without preempting."""
        for mgr, table in zip(self.managers, seq.tables, strict=True):
            mgr.remove_skipped_blocks(table, seq.num_computed)
            need = mgr.to_grow(len(table), self.blocks_for(num_tokens))
            if need <= 0:
                continue
            blocks = self._alloc(need, mgr.index)
            if blocks is None:
                return False
            table.extend(blocks)
        for mgr in self.managers:
            mgr.planned(seq, num_tokens, lambda k: self._hashes(seq, k))
        return True

    def release(self, seq: Sequence) -> None:
        """Lets go of seq's blocks: cached ones stay cached (idle), the rest are freed;
        blocks another forked sequence still holds stay with it."""
        for mgr in self.managers:
            mgr.release_sequence(seq)
        seq.tables = [[] for _ in seq.tables]
        seq.inserted = [0] * len(seq.tables)

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int, int]] | None:
        """Gives ``child`` (the same prompt, not started) ``parent``'s prompt KV in every
        KV cache group: it shares each block holding only computed prompt tokens before
        the last one (a sliding group's null blocks stay null), and gets a new block for
        the block of the last prompt token, which it recomputes (its own first sample).
        Returns the (group, parent block, new block) copies to make on the device before
        the child's first step (copy-on-write of that partial block); None when no
        memory can be had for it now (nothing changed)."""
        n, bs = parent.num_prompt, self.block_size
        if not all(m.forkable for m in self.managers):
            return None  # (a state is not shared: the child runs on its own, from a hit)
        if parent.num_computed < n or child.token_ids != parent.prompt or child.blocks:
            raise ValueError("fork needs a parent whose prompt is computed and a fresh child")
        full = (n - 1) // bs  # blocks of computed prompt tokens only
        copies: list[tuple[int, int, int]] = []
        if (n - 1) % bs:  # the last token's block also holds computed prompt tokens
            for mgr, table in zip(self.managers, parent.tables, strict=True):
                new = self._alloc(1, mgr.index)
                if new is None:
                    for g, _, dst in copies:
                        self.pools[g].free_blocks([dst])
                    return None
                copies.append((mgr.index, table[full], new[0]))
        child.tables = [
            mgr.share(table[:full]) for mgr, table in zip(self.managers, parent.tables, strict=True)
        ]
        for g, _, dst in copies:
            child.tables[g].append(dst)
        child.num_computed = child.cached_tokens = n - 1
        child.hashes = list(parent.hashes[: n // bs])
        child.inserted = [full if self.caching else 0] * len(self.groups)
        child.forked_from = parent.request_id
        return copies

    def computed(self, seq: Sequence, num_computed: int) -> None:
        """Records a step's progress; full blocks of known tokens join the prefix cache
        (a block holding a still-pending token joins when it arrives: call again)."""
        seq.num_computed = num_computed
        full = min(num_computed, len(seq.token_ids)) // self.block_size
        for mgr in self.managers:
            mgr.computed(seq, full, lambda k: self._hashes(seq, k))

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
        with self.events.resetting() if self.events is not None else nullcontext():
            if self.host_tier is not None:
                self.host_tier.clear()
            n = sum(pc.reset() for pc in self.prefix_caches)
        if self.host_tier is not None:
            self.host_tier.forget_uncached()
        return n

    def stats(self) -> dict[str, Any] | None:
        """The prefix cache's figures (None without one); with several KV cache groups,
        the first group's, and each group's under ``groups``."""
        if not self.prefix_caches:
            return None
        out = self.prefix_cache.stats()
        if len(self.groups) > 1:
            out["groups"] = [
                {"window": spec.window, **pc.stats()}
                for spec, pc in zip(self.specs, self.prefix_caches, strict=True)
            ]
        return out

    def group_stats(self) -> list[dict[str, Any]]:
        """Per KV cache group: its layers, window, mapped memory, blocks in use and
        cached (per device)."""
        out = []
        for g, spec, mgr in zip(self.groups, self.specs, self.managers, strict=True):
            pc = self.prefix_caches[g.index] if self.prefix_caches else None
            out.append({
                "layers": len(g.layers), "window": spec.window, "kind": mgr.kind,
                "mapped_bytes": g.mapped_bytes,
                "used_blocks": g.num_used_blocks,
                "cached_blocks": pc.num_cached_blocks if pc else 0,
            })  # fmt: skip
        return out

    def host_stats(self) -> dict[str, Any] | None:
        """The host tier's figures (None without one; see :meth:`HostTier.stats`)."""
        if self.host_tier is None:
            return None
        return self.host_tier.stats([s.window for s in self.specs])

    def close(self) -> None:
        """Gives the host tier's memory back."""
        if self.host_tier is not None:
            self.host_tier.close()
            self.host_tier = None
