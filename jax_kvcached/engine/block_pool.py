"""BlockPool: the blocks of one KV cache group, with one reference count per block.

vLLM's ``block_pool.py`` is the model (``KVCacheBlock.ref_cnt``; SGLang's
``TreeNode.lock_ref``). Every block of the group is in exactly one state:

- **free**: in the group's allocator (not mapped for anyone);
- **held**: its count is the number of holders (sequences, forks, a hit's checkpoint
  read, a restore in progress), > 0;
- **idle cached**: count 0, kept by the group's prefix cache (its hash index and
  eviction order), to be taken again or evicted.

So the allocator's used bit follows from the count: a block is allocated exactly when
it is held or idle cached (:meth:`BlockPool.check`). :meth:`alloc` hands out blocks held
once, :meth:`touch` adds a holder (a fork, a prefix hit), :meth:`free_blocks` drops one;
a block whose last holder lets go goes to the prefix cache when it is cached there, back
to the allocator otherwise. Nothing else counts holders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class BlockIndex(Protocol):
    """What the pool asks of the group's prefix cache (``prefix_cache.PrefixCache``)."""

    def is_cached(self, block: int) -> bool: ...

    def busy(self, block: int) -> None:
        """An idle cached block is held again."""

    def idle(self, blocks: Sequence[int], *, keep: bool = True) -> None:
        """Blocks lost their last holder (the cache keeps or frees them)."""

    def cached_blocks(self) -> list[int]: ...

    def evictable_blocks(self) -> list[int]: ...


class BlockPool:
    """One KV cache group's blocks and their reference counts.

    Args:
      group: the memory layer's group (``cache.groups[g]``, or a single-group cache):
        ``alloc`` / ``is_allocated`` / ``num_used_blocks``.
      free: gives blocks back to the allocator (the KV manager's frees the blocks behind
        its fence: the unmap waits for the last dispatched step). Default
        ``group.free``.
    """

    def __init__(self, group: Any, free: Callable[[list[int]], None] | None = None) -> None:
        self.group = group
        self.free_to_allocator: Callable[[list[int]], None] = free or group.free
        self._ref: dict[int, int] = {}
        self.cache: BlockIndex | None = None  # set by the group's prefix cache

    # -- queries ---------------------------------------------------------------------
    def ref_count(self, block: int) -> int:
        """Holders of ``block`` (0: free or idle cached)."""
        return self._ref.get(block, 0)

    @property
    def num_held_blocks(self) -> int:
        return len(self._ref)

    def held_blocks(self) -> list[int]:
        return list(self._ref)

    # -- holders ---------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """``n`` new blocks, each held once. Raises PoolExhausted when the group has no
        room (the caller evicts and tries again)."""
        blocks = self.group.alloc(n).tolist() if n else []
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """One more holder of each block (the null block 0 is skipped): a fork shares
        its parent's, a hit takes cached ones (an idle one leaves the eviction order)."""
        for b in blocks:
            if not b:
                continue
            n = self._ref.get(b, 0)
            if n == 0:
                if self.cache is None or not self.cache.is_cached(b):
                    raise ValueError(f"block {b} is neither held nor cached")
                self.cache.busy(b)
            self._ref[b] = n + 1

    def free_blocks(self, blocks: Sequence[int], *, keep: bool = True) -> None:
        """One holder fewer of each block (null blocks skipped), the chain's tail first
        (so it is evicted before its parents). A block whose last holder that was stays
        cached, idle, when the prefix cache has it (``keep=False``: it leaves the cache
        too: a sliding window's blocks left behind), and is freed otherwise."""
        last = []
        for b in reversed(blocks):
            if not b:
                continue
            n = self._ref.get(b, 0) - 1
            if n < 0:
                raise ValueError(f"block {b} released more often than taken")
            if n:
                self._ref[b] = n
            else:
                del self._ref[b]
                last.append(b)
        if not last:
            return
        if self.cache is not None:
            self.cache.idle(last, keep=keep)
        else:
            self.free_to_allocator(last)

    def check(self) -> None:
        """The invariant: the allocator's used blocks are the held ones and the idle
        cached ones, no block both (AssertionError otherwise; for tests)."""
        cached = set(self.cache.cached_blocks()) if self.cache is not None else set()
        idle = set(self.cache.evictable_blocks()) if self.cache is not None else set()
        held = set(self._ref)
        assert not held & idle, f"blocks both held and idle: {sorted(held & idle)[:8]}"
        assert idle <= cached
        assert all(self.group.is_allocated(b) for b in held | cached)
        assert self.group.num_used_blocks == len(held | cached), (
            self.group.num_used_blocks, len(held), len(cached))  # fmt: skip
