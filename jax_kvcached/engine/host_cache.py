"""HostCache: the host tier of the prefix cache.

Idle prefix blocks the prefix cache evicts (its ``max_cached_tokens`` bound, allocation
pressure, another tenant reclaiming memory) are copied into a bounded
:class:`~jax_kvcached.memory.host_store.HostStore` before their pages are unmapped, keyed
by the same chained block hash, so tenant, ``cache_salt`` and adapter isolation holds in
the tier too. A request whose prefix continues past its device-cached blocks into the tier
gets new blocks with the KV copied back instead of recomputed.

- Bounded: the store's slots; storing into a full tier drops its least recently used
  entries first (entries being restored are never dropped).
- An entry is served only once its copy out has completed (asynchronous on CUDA); a copy
  that failed drops its entries (counted in ``copy_failures``), never serves them.
- Inclusive: a restored entry stays in the tier, so evicting the block again later needs
  no copy.
- Preload: each entry keeps its hit count (the device's before it was evicted, plus its
  restores) and its depth in its chain; :meth:`HostCache.most_hit` ranks them for a wake.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from jax_kvcached.memory.errors import KVCacheError
from jax_kvcached.memory.host_store import HostStore, Ticket

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Entry:
    slot: int
    ticket: Ticket
    ready: bool = False  # its copy out has completed
    hits: int = 0  # takes on the device before, and restores since
    depth: int = 0  # index in its chain


class HostCache:
    """hash -> a host copy of an evicted block, LRU within ``store``'s bound.

    Args:
      store: the host slots (one per cached block).
      block_size: tokens per block (for the token figures).
    """

    def __init__(self, store: HostStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest first
        self._pinned: dict[bytes, _Entry] = {}  # being restored: never dropped
        self.hits_tokens = 0  # prompt tokens restored from the tier
        self.restores = 0  # restore operations (one per admitted request that had hits)
        self.restored_blocks = 0
        self.stored_blocks = 0  # blocks copied out
        self.bytes_to_host = 0
        self.bytes_from_host = 0
        self.evictions = 0  # entries dropped for room
        self.copy_failures = 0  # blocks whose copy failed (never served)
        self.preloaded_blocks = 0  # copied back on a wake, before any request
        self.listener: Any = None  # told of entries stored / removed (``kv_events``)

    # -- queries ---------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.store.num_slots

    @property
    def num_entries(self) -> int:
        return len(self._entries) + len(self._pinned)

    @property
    def bytes(self) -> int:
        """Host bytes the entries hold (entries x one block's bytes on every device)."""
        return self.num_entries * self.store.slot_bytes

    def _entry(self, h: bytes) -> _Entry | None:
        """The entry under ``h``, also while it is being restored (None if none)."""
        return self._entries.get(h) or self._pinned.get(h)

    def slot_of(self, h: bytes) -> int | None:
        """The host slot holding the copy cached under ``h`` (None if none)."""
        e = self._entry(h)
        return None if e is None else e.slot

    def keys(self) -> list[bytes]:
        """The hashes of every entry."""
        return list(self._entries) + list(self._pinned)

    def __contains__(self, h: object) -> bool:
        return h in self._entries or h in self._pinned

    def _ready(self, h: bytes, e: _Entry) -> bool:
        """Whether ``e`` may be served: its copy has completed. A failed copy drops it."""
        if e.ready:
            return True
        try:
            e.ready = self.store.done(e.ticket)
        except KVCacheError as err:
            log.warning("host tier of %r: a copy to host failed (%s)", self.store.cache.name, err)
            self._drop(h)
            self.copy_failures += 1
            return False
        return e.ready

    def ready(self, h: bytes) -> bool:
        """Whether the tier can serve ``h`` now (its copy has completed)."""
        e = self._entries.get(h)
        return e is not None and self._ready(h, e)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the tier can serve now (no change, no metrics)."""
        n = 0
        for h in hashes:
            if not self.ready(h):
                break
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "capacity_tokens": self.capacity_blocks * self.block_size,
            "capacity_bytes": self.store.total_bytes,
            "entries": self.num_entries,
            "bytes": self.bytes,
            "pinned_memory": self.store.pinned,
            "hits_tokens": self.hits_tokens,
            "restores": self.restores,
            "restored_blocks": self.restored_blocks,
            "stored_blocks": self.stored_blocks,
            "bytes_to_host": self.bytes_to_host,
            "bytes_from_host": self.bytes_from_host,
            "evictions": self.evictions,
            "copy_failures": self.copy_failures,
            "preloaded_blocks": self.preloaded_blocks,
        }

    def most_hit(self, n: int, skip: Callable[[bytes], bool]) -> list[tuple[bytes, int, int]]:
        """Up to ``n`` servable entries, most hit first (ties: shallower first, so a
        chain's parents come before its children), leaving out those ``skip`` names:
        (hash, hits, depth) each."""
        ranked = sorted(
            ((h, e.hits, e.depth) for h, e in self._entries.items() if not skip(h)),
            key=lambda x: (-x[1], x[2]),
        )
        return [x for x in ranked if self.ready(x[0])][:n]

    # -- storing ---------------------------------------------------------------------
    def _drop(self, h: bytes) -> None:
        e = self._entries.pop(h)
        self.store.release([e.slot])
        if self.listener is not None:
            self.listener.removed([h])

    def store_blocks(
        self,
        hashes: Sequence[bytes],
        blocks: Sequence[int],
        meta: Sequence[tuple[int, int]] | None = None,
    ) -> int:
        """Copies evicted ``blocks`` (cached under ``hashes``; ``meta``: each one's
        (hits, depth)) out; the caller has waited for every computation that wrote them.
        Hashes already in the tier are only marked used (and keep the larger hit count).
        Makes room by dropping the least recently used entries; stores what fits (the
        first ones given). Returns the blocks copied."""
        meta = list(meta) if meta is not None else [(0, 0)] * len(hashes)
        new_h: list[bytes] = []
        new_b: list[int] = []
        new_m: list[tuple[int, int]] = []
        for h, b, m in zip(hashes, blocks, meta, strict=True):
            if h in self._entries:
                self._entries.move_to_end(h)
                self._entries[h].hits = max(self._entries[h].hits, m[0])
            elif h not in self._pinned:
                new_h.append(h)
                new_b.append(b)
                new_m.append(m)
        while self.store.num_free < len(new_h) and self._entries:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        slots = self.store.alloc(len(new_h))
        if not slots:
            return 0
        new_h, new_b, new_m = new_h[: len(slots)], new_b[: len(slots)], new_m[: len(slots)]
        try:
            ticket = self.store.copy_out(new_b, slots)
        except (KVCacheError, ValueError) as err:
            self.store.release(slots)
            self.copy_failures += len(slots)
            log.warning("host tier of %r: copy to host failed (%s)", self.store.cache.name, err)
            return 0
        for h, s, (hits, depth) in zip(new_h, slots, new_m, strict=True):
            self._entries[h] = _Entry(s, ticket, hits=hits, depth=depth)
        self.stored_blocks += len(slots)
        if self.listener is not None:
            self.listener.stored(new_h)
        self.bytes_to_host += len(slots) * self.store.slot_bytes
        return len(slots)

    # -- restoring -------------------------------------------------------------------
    def restore(
        self, hashes: Sequence[bytes], get_blocks: Callable[[int], Sequence[int] | None]
    ) -> list[int]:
        """Copies the entries of the leading servable ``hashes`` into fresh blocks.

        ``get_blocks(n)`` returns ``n`` allocated blocks, with every computation that may
        still read them done (or None: no memory; nothing is restored). It may evict
        device blocks into the tier: the entries being restored are held meanwhile.
        Returns the blocks, in ``hashes`` order (empty when nothing was restored).
        Raises KVCacheError if a copy in fails (the blocks' contents are then undefined)."""
        n = self.lookup(hashes)
        if n == 0:
            return []
        hashes = list(hashes[:n])
        for h in hashes:
            self._pinned[h] = self._entries.pop(h)
        try:
            blocks = get_blocks(n)
            if blocks is None:
                return []
            blocks = list(blocks)
            self.store.copy_in([self._pinned[h].slot for h in hashes], blocks)
        finally:
            for h in hashes:  # back, most recently used
                self._entries[h] = self._pinned.pop(h)
        for h in hashes:
            self._entries[h].hits += 1
        self.restores += 1
        self.restored_blocks += n
        self.hits_tokens += n * self.block_size
        self.bytes_from_host += n * self.store.slot_bytes
        return blocks

    def preload(self, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Copies servable entries into allocated ``blocks`` (every computation that may
        still read them done) before any request asks: not counted as hits. Raises
        KVCacheError if a copy fails."""
        self.store.copy_in([self._entries[h].slot for h in hashes], blocks)
        for h in hashes:
            self._entries.move_to_end(h)
        self.preloaded_blocks += len(hashes)
        self.bytes_from_host += len(hashes) * self.store.slot_bytes

    def hits_of(self, h: bytes) -> int:
        """An entry's hit count (0 if absent)."""
        e = self._entry(h)
        return 0 if e is None else e.hits

    def clear(self) -> int:
        """Drops every entry (none may be mid-restore); returns how many."""
        n = len(self._entries)
        for h in list(self._entries):
            self._drop(h)
        return n

    def close(self) -> None:
        self._entries.clear()
        self._pinned.clear()
        self.store.close()
