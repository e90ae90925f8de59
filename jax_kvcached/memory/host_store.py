"""HostStore: bounded host memory for copies of one KV cache group's blocks (the host tier).

One C++ ``HostArena`` per device shard of the cache (page-locked memory on CUDA), all
with the same ``num_slots`` slots: slot ``s`` holds one block of the group's layers' K
and V planes (every layer for a cache of one group), on every device. The arenas are
allocated once and never grow, so the store's host memory is bounded by construction.

Copies out are enqueued (asynchronous DMA on CUDA, a memcpy on the host backend) and
return a ticket; :meth:`HostStore.done` says whether they have completed (and raises if
one failed). The C++ core makes every unmap wait for enqueued copies, so a copy never
outlives its page. Copies in are synchronous.

Ordering with the device is the caller's: wait for the computations that wrote the blocks
(the KV manager's fence) before copying them out, and for those that may still read the
destination blocks before copying in.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from jax_kvcached.memory import _C
from jax_kvcached.memory.errors import KVCacheError
from jax_kvcached.memory.kv_cache import KVCache

Ticket = tuple[int, ...]  # one per shard


class HostStore:
    """``num_slots`` host slots for blocks of one KV cache group of ``cache`` (one arena
    per device shard)."""

    def __init__(self, cache: KVCache, num_slots: int, group: int = 0) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"a host store needs a positive number of slots, got {num_slots!r}")
        if (
            isinstance(group, bool)
            or not isinstance(group, int)
            or not 0 <= group < len(cache.groups)
        ):
            raise ValueError(f"KV cache group {group!r} out of range [0, {len(cache.groups)})")
        self.cache = cache
        self.group = cache.groups[group]
        self.num_slots = num_slots
        self._arenas = [_C.HostArena(shard, num_slots, group) for shard in cache.shards]
        # Host bytes of one slot: the group's planes of one block, on every local device.
        self.slot_bytes: int = sum(a.slot_bytes for a in self._arenas)
        self.pinned: bool = self._arenas[0].pinned
        self._free = list(range(num_slots))  # a heap: lowest slots first (runs stay runs)
        self._closed = False

    @property
    def arenas(self) -> tuple[_C.HostArena, ...]:
        """The C++ arenas, one per local device shard (low level: tools and tests)."""
        return tuple(self._arenas)

    @property
    def total_bytes(self) -> int:
        """Host memory of the arenas (the bound)."""
        return self.slot_bytes * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Up to ``n`` free slots, lowest first (fewer when fewer are free)."""
        return [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"host slot {s} out of range [0, {self.num_slots})")
            heapq.heappush(self._free, int(s))

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        if self._closed:
            raise KVCacheError(f"the host store of {self.cache.name!r} is closed")
        for b in blocks:
            if not self.group.is_allocated(b):
                several = len(self.cache.groups) > 1
                where = f" (KV cache group {self.group.index})" if several else ""
                raise ValueError(f"block {int(b)} of {self.cache.name!r}{where} is not allocated")

    def copy_out(self, blocks: Sequence[int], slots: Sequence[int]) -> Ticket:
        """Enqueues copies of ``blocks`` into ``slots`` (the group's planes, every device);
        returns their ticket. Raises (and enqueues nothing) on a bad block or slot."""
        self._check_blocks(blocks)
        b = np.asarray(blocks, np.int32)
        s = np.asarray(slots, np.int64)
        return tuple(
            shard.copy_to_host(b, s, arena)
            for shard, arena in zip(self.cache.shards, self._arenas, strict=True)
        )

    def done(self, ticket: Ticket) -> bool:
        """Whether a copy out has completed on every device (raises if one failed)."""
        return all(shard.copies_done(t) for shard, t in zip(self.cache.shards, ticket, strict=True))

    def copy_in(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copies ``slots`` back into ``blocks`` (allocated, every device); returns once
        the copies are done."""
        self._check_blocks(blocks)
        b = np.asarray(blocks, np.int32)
        s = np.asarray(slots, np.int64)
        for shard, arena in zip(self.cache.shards, self._arenas, strict=True):
            shard.copy_from_host(arena, s, b)

    def read_slot(self, slot: int) -> bytes:
        """The bytes one slot holds: the group's planes of its block, device after device."""
        return b"".join(a.read_slot(int(slot)) for a in self._arenas)

    def close(self) -> None:
        """Gives the arenas' memory back (after every enqueued copy is done)."""
        self._arenas = []
        self._free = []
        self._closed = True
